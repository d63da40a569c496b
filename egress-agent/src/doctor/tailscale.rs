//! Tailscale: installed, up (`tailscale status --json`, `BackendState` `Running`), and whether SSH
//! is reachable only over it (sshd's `ListenAddress`es are all tailnet or loopback addresses).
//! Firewall rules that restrict port 22 to `tailscale0` are not analysed (see `host.firewall_input`).

use std::net::IpAddr;
use std::sync::Arc;

use serde_json::Value;

use super::ssh::{self, SshdView};
use super::sshd_config::SshdConfig;
use super::tool::{self, ToolError};
use super::{Ctx, Outcome};

/// The address of one `ListenAddress` value (`host`, `host:port`, `[v6]:port`, a trailing
/// `rdomain`); `None` for a hostname.
pub(super) fn listen_ip(value: &str) -> Option<IpAddr> {
    let addr = value.split_whitespace().next()?;
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    if let Ok(ip) = addr.parse() {
        return Some(ip);
    }
    addr.rsplit_once(':')?.0.parse().ok()
}

/// sshd's listen addresses as written (`0.0.0.0` and `::` when none is set: every address).
fn listen_addresses(cfg: &SshdConfig) -> Vec<String> {
    let v: Vec<String> = cfg
        .all("listenaddress")
        .into_iter()
        .map(str::to_owned)
        .collect();
    if v.is_empty() {
        vec!["0.0.0.0".into(), "::".into()]
    } else {
        v
    }
}

/// Verdict from `tailscale status --json` and sshd's configuration (`None`: no sshd). Pure, for tests.
pub(super) fn tailscale_verdict(
    status: Result<String, ToolError>,
    sshd: Option<&SshdConfig>,
) -> Outcome {
    const UP: &str = "tailscale up (and systemctl enable --now tailscaled)";
    let text = match status {
        Ok(t) => t,
        Err(ToolError::NotFound(_)) => {
            return Outcome::skip(
                "`tailscale` not installed",
                "nothing to do unless SSH should be reachable only over a tailnet",
            );
        }
        Err(e) => {
            return Outcome::warn(
                format!("tailscale installed but tailscaled did not answer: {e}"),
                UP,
            );
        }
    };
    let v: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            return Outcome::warn(
                format!("`tailscale status --json` is not JSON: {e}"),
                "check `tailscale status`",
            );
        }
    };
    let state = v["BackendState"].as_str().unwrap_or("unknown");
    if state != "Running" {
        return Outcome::warn(
            format!("tailscale installed but not up (state {state})"),
            UP,
        );
    }
    let ips: Vec<IpAddr> = v["Self"]["TailscaleIPs"]
        .as_array()
        .map(|a| a.iter().filter_map(|i| i.as_str()?.parse().ok()).collect())
        .unwrap_or_default();
    let shown: Vec<String> = ips.iter().map(IpAddr::to_string).collect();
    let Some(cfg) = sshd else {
        return Outcome::pass(format!("tailscale up ({}); no sshd", shown.join(", ")));
    };
    let outside: Vec<String> = listen_addresses(cfg)
        .into_iter()
        .filter(|a| !listen_ip(a).is_some_and(|ip| ip.is_loopback() || ips.contains(&ip)))
        .collect();
    if outside.is_empty() {
        return Outcome::pass(format!(
            "tailscale up ({}); sshd listens only on the tailnet",
            shown.join(", ")
        ));
    }
    Outcome::warn(
        format!(
            "tailscale up ({}), but sshd also listens on {}: SSH is reachable outside the tailnet unless the firewall drops it",
            shown.join(", "),
            outside.join(", ")
        ),
        "set `ListenAddress <tailscale address>` in sshd_config (or allow port 22 only on tailscale0) and reload sshd",
    )
}

pub(super) async fn tailscale(ctx: Arc<Ctx>) -> Outcome {
    let status = tool::run(&ctx, "tailscale", &["status", "--json"]).await;
    if matches!(status, Err(ToolError::NotFound(_))) {
        return tailscale_verdict(status, None);
    }
    match ssh::view(&ctx).await {
        SshdView::Found(cfg) => tailscale_verdict(status, Some(&cfg)),
        SshdView::Absent(_) => tailscale_verdict(status, None),
        SshdView::Unreadable(why) => match tailscale_verdict(status, None) {
            o if o.status == super::Status::Pass => Outcome::warn(
                format!(
                    "{}, but sshd's configuration could not be read: {why}",
                    o.summary.trim_end_matches("; no sshd")
                ),
                "run doctor as root",
            ),
            o => o,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse() {
        assert_eq!(listen_ip("0.0.0.0:22"), Some([0, 0, 0, 0].into()));
        assert_eq!(listen_ip("100.64.1.2"), Some([100, 64, 1, 2].into()));
        assert_eq!(listen_ip("[::1]:2222"), "::1".parse().ok());
        assert_eq!(listen_ip("::"), "::".parse().ok());
        assert_eq!(
            listen_ip("100.64.1.2:22 rdomain 1"),
            Some([100, 64, 1, 2].into())
        );
        assert_eq!(listen_ip("ssh.example.com:22"), None);
    }
}
