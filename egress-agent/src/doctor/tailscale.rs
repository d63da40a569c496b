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

/// What the Tailscale probe knows of sshd.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sshd<'a> {
    /// No SSH server on this host.
    Absent,
    /// There is one, but its configuration could not be read (why).
    Unreadable(&'a str),
    Config(&'a SshdConfig),
}

/// Verdict from `tailscale status --json` and sshd's configuration. Pure, for tests.
pub(super) fn tailscale_verdict(status: Result<String, ToolError>, sshd: Sshd<'_>) -> Outcome {
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
    let cfg = match sshd {
        Sshd::Config(cfg) => cfg,
        Sshd::Absent => {
            return Outcome::pass(format!("tailscale up ({}); no sshd", shown.join(", ")));
        }
        Sshd::Unreadable(why) => {
            return Outcome::warn(
                format!(
                    "tailscale up ({}), but sshd's listen addresses are unknown: {why}",
                    shown.join(", ")
                ),
                "run doctor as root",
            );
        }
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
        return tailscale_verdict(status, Sshd::Absent);
    }
    match ssh::view(&ctx).await {
        SshdView::Found(cfg) => tailscale_verdict(status, Sshd::Config(&cfg)),
        SshdView::Absent(_) => tailscale_verdict(status, Sshd::Absent),
        SshdView::Unreadable(why) => tailscale_verdict(status, Sshd::Unreadable(&why)),
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

    #[test]
    fn unknown_listen_addresses_are_a_gap() {
        let up = r#"{"BackendState":"Running","Self":{"TailscaleIPs":["100.64.0.7"]}}"#;
        let v = tailscale_verdict(Ok(up.into()), Sshd::Unreadable("permission denied"));
        assert_eq!(v.status, super::super::Status::Warn);
        assert!(
            v.summary.contains("100.64.0.7") && v.summary.contains("permission denied"),
            "{}",
            v.summary
        );
    }
}
