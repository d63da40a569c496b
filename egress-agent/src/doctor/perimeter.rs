//! Perimeter services asked through their own command-line clients: fail2ban
//! (`fail2ban-client status`), firewalld (`firewall-cmd --state`) and ufw (`ufw status`). A client
//! that is not installed makes its probe `skip`; one that needs root says so (`skip`, run as root).

use std::sync::Arc;

use super::tool::{self, ToolError};
use super::{Ctx, Outcome};

/// `skip` for a missing client or missing privileges, `warn` for a client that hung; `None` for a
/// failure the probe judges itself.
fn common(e: &ToolError) -> Option<Outcome> {
    match e {
        ToolError::NotFound(name) => Some(Outcome::skip(
            format!("`{name}` not installed"),
            "nothing to do unless this host should run it",
        )),
        ToolError::TimedOut(..) => Some(Outcome::warn(
            e.to_string(),
            "re-run; if it persists, check the service (systemctl status)",
        )),
        ToolError::Failed(_, why) => {
            let w = why.to_ascii_lowercase();
            (w.contains("permission denied") || w.contains("need to be root"))
                .then(|| Outcome::skip(e.to_string(), "run doctor as root"))
        }
    }
}

/// `fail2ban-client status`: the number of jails and their names.
pub(super) fn parse_fail2ban_status(text: &str) -> Option<(usize, Vec<String>)> {
    let mut count = None;
    let mut jails = Vec::new();
    for line in text.lines() {
        let line = line.trim_start_matches(['|', '`', '-', ' ']);
        if let Some(n) = line.strip_prefix("Number of jail:") {
            count = n.trim().parse().ok();
        } else if let Some(list) = line.strip_prefix("Jail list:") {
            jails = list
                .split(',')
                .map(|j| j.trim().to_owned())
                .filter(|j| !j.is_empty())
                .collect();
        }
    }
    count.map(|n| (n, jails))
}

/// Verdict on `fail2ban-client status` output. Pure, for tests.
pub(super) fn fail2ban_verdict(status: Result<String, ToolError>) -> Outcome {
    const FIX: &str = "enable a jail for sshd (/etc/fail2ban/jail.local: [sshd] enabled = true) and restart fail2ban";
    let text = match status {
        Ok(t) => t,
        Err(e) => {
            return common(&e).unwrap_or_else(|| {
                Outcome::fail(
                    format!("fail2ban installed but not running: {e}"),
                    "systemctl enable --now fail2ban",
                )
            });
        }
    };
    match parse_fail2ban_status(&text) {
        Some((0, _)) => Outcome::warn("fail2ban running with no jail", FIX),
        Some((n, jails)) => Outcome::pass(format!(
            "fail2ban running, {n} jail(s): {}",
            jails.join(", ")
        )),
        None => Outcome::warn(
            "fail2ban answered, but not with a jail count",
            "check `fail2ban-client status`",
        ),
    }
}

pub(super) async fn fail2ban(ctx: Arc<Ctx>) -> Outcome {
    fail2ban_verdict(tool::run(&ctx, "fail2ban-client", &["status"]).await)
}

/// Verdict on `firewall-cmd --state`: `running` exactly (it prints `not running` and exits 252
/// when the daemon is stopped). Pure, for tests.
pub(super) fn firewalld_verdict(state: Result<String, ToolError>) -> Outcome {
    const FIX: &str = "systemctl enable --now firewalld (or rely on another firewall: see host.ufw, host.firewall_input)";
    match state {
        Ok(out) if out.trim() == "running" => Outcome::pass("firewalld running"),
        Ok(out) => Outcome::warn(format!("firewalld installed, state {:?}", out.trim()), FIX),
        Err(e) => common(&e).unwrap_or_else(|| {
            Outcome::warn(format!("firewalld installed but not running: {e}"), FIX)
        }),
    }
}

pub(super) async fn firewalld(ctx: Arc<Ctx>) -> Outcome {
    firewalld_verdict(tool::run(&ctx, "firewall-cmd", &["--state"]).await)
}

/// Verdict on `ufw status`: `Status: active` exactly. Pure, for tests.
pub(super) fn ufw_verdict(status: Result<String, ToolError>) -> Outcome {
    const FIX: &str = "ufw enable (allow SSH first: ufw allow OpenSSH), or rely on another firewall (host.firewalld)";
    let text = match status {
        Ok(t) => t,
        Err(e) => {
            return common(&e)
                .unwrap_or_else(|| Outcome::warn(format!("ufw did not answer: {e}"), FIX));
        }
    };
    let state = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Status:"))
        .map(str::trim);
    match state {
        Some("active") => Outcome::pass("ufw active"),
        Some(other) => Outcome::warn(format!("ufw installed, status {other}"), FIX),
        None => Outcome::warn("ufw answered without a status line", "check `ufw status`"),
    }
}

pub(super) async fn ufw(ctx: Arc<Ctx>) -> Outcome {
    ufw_verdict(tool::run(&ctx, "ufw", &["status"]).await)
}
