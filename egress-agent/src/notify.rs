//! systemd readiness notifications (`sd_notify(3)`) for `Type=notify` (dist/egress-agent.service).
//!
//! - [`ready`] once the programs are loaded or adopted and the proxy listens (and again after a reload);
//! - [`reloading`] when a SIGHUP/`reload` starts re-reading the configuration;
//! - [`stopping`] when shutdown begins;
//! - [`status`] for a one-line status shown by `systemctl status`.
//!
//! Every function is a no-op returning `Ok(())` when `NOTIFY_SOCKET` is unset (not started by systemd,
//! or `egress-agent exec`). Failures are returned, not fatal: the caller logs them and carries on.

use sd_notify::NotifyState;

/// A notification could not be delivered to the service manager.
#[derive(Debug, thiserror::Error)]
#[error("sd_notify {what} failed: {source}")]
pub struct NotifyError {
    what: &'static str,
    #[source]
    source: std::io::Error,
}

/// STATUS= is one line of text: newlines would start a new assignment in the datagram.
fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn send(what: &'static str, states: &[NotifyState<'_>]) -> Result<(), NotifyError> {
    let r = sd_notify::notify(states).map_err(|source| NotifyError { what, source });
    match &r {
        Ok(()) => tracing::debug!(what, "sd_notify sent"),
        Err(e) => tracing::warn!(error = %e, "sd_notify failed"),
    }
    r
}

/// `READY=1` with a status line: startup (or a reload) is complete.
pub fn ready(status_line: &str) -> Result<(), NotifyError> {
    let s = one_line(status_line);
    send("READY", &[NotifyState::Ready, NotifyState::Status(&s)])
}

/// `RELOADING=1` plus `MONOTONIC_USEC=` (systemd >= 253 requires it with RELOADING=1). Follow with
/// [`ready`] when the reload is done, whether the new configuration was applied or rejected.
pub fn reloading() -> Result<(), NotifyError> {
    let now = NotifyState::monotonic_usec_now().map_err(|source| NotifyError {
        what: "RELOADING",
        source,
    })?;
    send(
        "RELOADING",
        &[
            NotifyState::Reloading,
            now,
            NotifyState::Status("reloading configuration"),
        ],
    )
}

/// `MAINPID=<pid>`: the agent that took over from this one is the service's main process now
/// (a restart or upgrade through a hand-over; the unit needs `NotifyAccess=all` for the new
/// process's own notifications before this).
pub fn main_pid(pid: u32) -> Result<(), NotifyError> {
    send("MAINPID", &[NotifyState::MainPid(pid)])
}

/// `STOPPING=1`: shutdown has begun.
pub fn stopping() -> Result<(), NotifyError> {
    send(
        "STOPPING",
        &[NotifyState::Stopping, NotifyState::Status("stopping")],
    )
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;
    use std::process::Command;
    use std::time::Duration;

    /// Runs in a child process (so the environment is set by `Command::env`, not by mutating this
    /// process's): sends every notification.
    #[test]
    fn child_sends_notifications() {
        if std::env::var_os("EGRESS_NOTIFY_CHILD").is_none() {
            return;
        }
        super::ready("serving 2 policies\nfake=1").expect("ready");
        super::reloading().expect("reloading");
        super::stopping().expect("stopping");
    }

    fn run_child(socket: Option<&std::path::Path>) -> std::process::Output {
        let exe = std::env::current_exe().expect("current exe");
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            "notify::tests::child_sends_notifications",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("EGRESS_NOTIFY_CHILD", "1");
        match socket {
            Some(p) => cmd.env("NOTIFY_SOCKET", p),
            None => cmd.env_remove("NOTIFY_SOCKET"),
        };
        cmd.output().expect("run child")
    }

    #[test]
    fn notifications_reach_a_real_notify_socket() {
        let dir = std::env::temp_dir().join(format!("egress-notify-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).expect("bind notify socket");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");

        let out = run_child(Some(&path));
        assert!(
            out.status.success(),
            "child failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );

        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        for _ in 0..3 {
            let n = sock.recv(&mut buf).expect("datagram");
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(got[0], "READY=1\nSTATUS=serving 2 policies fake=1\n");
        let reload: Vec<&str> = got[1].lines().collect();
        assert_eq!(reload[0], "RELOADING=1");
        let usec: u64 = reload[1]
            .strip_prefix("MONOTONIC_USEC=")
            .expect("monotonic")
            .parse()
            .expect("number");
        assert!(usec > 0);
        assert_eq!(reload[2], "STATUS=reloading configuration");
        assert_eq!(got[2], "STOPPING=1\nSTATUS=stopping\n");
    }

    #[test]
    fn without_notify_socket_everything_is_a_noop() {
        let out = run_child(None);
        assert!(
            out.status.success(),
            "child failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}
