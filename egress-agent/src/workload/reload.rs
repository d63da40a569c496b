//! Reloads and reconnects, the same for every runtime: the wait between two sessions of a
//! runtime's watcher ([`pause`]), the next reload request ([`next_reload`]) and the settings a
//! reload can't change ([`restart_needed`]).
use std::future::Future;

use tokio::sync::mpsc;

use super::ReloadRequest;

/// What ended a runtime's wait between two sessions (its reconnect backoff).
pub enum Pause {
    /// The backoff is over: reconnect.
    Elapsed,
    /// The agent is stopping.
    Stop,
    /// A reload to apply (then keep waiting).
    Reload(ReloadRequest),
}

/// Wait out `sleep`, ending early for the agent's stop or a reload request: while a runtime is
/// disconnected, reloads still apply to what it tracks.
pub async fn pause(
    mut sleep: std::pin::Pin<&mut tokio::time::Sleep>,
    mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    reload: &mut Option<mpsc::Receiver<ReloadRequest>>,
) -> Pause {
    loop {
        tokio::select! {
            () = &mut shutdown => return Pause::Stop,
            () = &mut sleep => return Pause::Elapsed,
            // `None`: the sender is gone; `next_reload` pends from now on.
            req = next_reload(reload) => if let Some(req) = req {
                return Pause::Reload(req);
            },
        }
    }
}

/// The next reload request; pending forever once the sender is gone (or there is none).
pub async fn next_reload(
    reload: &mut Option<mpsc::Receiver<ReloadRequest>>,
) -> Option<ReloadRequest> {
    let Some(rx) = reload.as_mut() else {
        return std::future::pending().await;
    };
    let req = rx.recv().await;
    if req.is_none() {
        *reload = None;
    }
    req
}

/// Why `new` can't be applied by a reload (settings that can't change under running listeners
/// and pins), or `None`. Every runtime refuses such a configuration whole.
pub fn restart_needed(old: &crate::config::Config, new: &crate::config::Config) -> Option<String> {
    let needs_restart = [
        (old.proxy != new.proxy, "[proxy]"),
        (old.dns != new.dns, "[dns]"),
        (old.agent.bpffs != new.agent.bpffs, "agent.bpffs"),
        // The interception CA and upstream trust are set up once per proxy context.
        (old.intercept != new.intercept, "[intercept]"),
        (
            old.agent.state_dir != new.agent.state_dir,
            "agent.state_dir",
        ),
        (old.store != new.store, "[store]"),
        (old.export != new.export, "[export]"),
        (
            old.kubernetes != new.kubernetes && !same_runtime(old, new),
            "[kubernetes]",
        ),
    ]
    .into_iter()
    .filter_map(|(changed, what)| changed.then_some(what))
    .collect::<Vec<_>>();
    (!needs_restart.is_empty()).then(|| {
        format!(
            "{} changed: these settings take effect only on a restart (systemctl restart egress-agent); nothing was applied",
            needs_restart.join(", ")
        )
    })
}

/// `[kubernetes]` differs only in `namespace_defaults` (policy choices a reload applies).
fn same_runtime(old: &crate::config::Config, new: &crate::config::Config) -> bool {
    match (&old.kubernetes, &new.kubernetes) {
        (Some(a), Some(b)) => {
            a.containerd_socket == b.containerd_socket
                && a.containerd_namespace == b.containerd_namespace
                && a.cgroup_root == b.cgroup_root
        }
        (None, None) => true,
        _ => false,
    }
}
