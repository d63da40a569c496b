//! Everything the daemon needs to run the Docker integration, in one call: [`serve_with`].
use std::sync::Arc;

use crate::agent::Stop;
use crate::config::Config;
use crate::events::EventSink;
use crate::workload::root::WorkloadRoot;
use crate::workload::site::{Hooks, HostOptions, ServeError, Site, enforcer_at, proxy_endpoint};

/// The Docker runtime's options (beside the agent's host-wide ones).
#[derive(Debug, Clone)]
pub struct DockerOptions {
    /// Docker API socket (`/var/run/docker.sock` or `unix:///...`).
    pub socket: String,
    /// The daemon's cgroup parent, relative to the cgroup2 mount (`/docker` for the cgroupfs
    /// driver's default, or dockerd's `--cgroup-parent`).
    pub cgroup_parent: String,
}

impl Default for DockerOptions {
    fn default() -> Self {
        DockerOptions {
            socket: "unix:///var/run/docker.sock".to_owned(),
            cgroup_parent: "/docker".to_owned(),
        }
    }
}

/// Set up (proxy address, enforcement root, programs, host layer) and watch Docker until
/// `shutdown` is cancelled (the agent core's stop), with readiness, reload and metrics
/// hooks. The kernel's denial events are the core's to pump (named with
/// [`HostOptions::directory`]).
pub async fn serve_with(
    config: Arc<Config>,
    opts: DockerOptions,
    host: HostOptions,
    events: EventSink,
    hooks: Hooks,
    shutdown: Stop,
) -> Result<(), ServeError> {
    proxy_endpoint(&config)?;
    let root = WorkloadRoot::new(crate::cgroup::cgroup2_mount()?, &opts.cgroup_parent);
    let site = Site::new(root, host, "docker");
    let (enforcer, info) =
        enforcer_at(&config, site, &events, hooks.metrics.as_ref(), &shutdown).await?;
    if let Some(ready) = hooks.ready
        && ready.send(info).is_err()
    {
        tracing::debug!("nobody waits for readiness");
    }
    let _enforcer = super::watch::run(
        &opts.socket,
        enforcer,
        hooks.reload,
        hooks.metrics,
        shutdown.cancelled_owned(),
    )
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_is_spawnable() {
        fn is_send<T: Send + 'static>(_: &T) {}
        // Only built, never polled: the daemon must be able to `tokio::spawn` it.
        let f = serve_with(
            Arc::new(Config::default()),
            DockerOptions::default(),
            HostOptions::default(),
            EventSink::default(),
            Hooks::default(),
            Stop::detached(),
        );
        is_send(&f);
    }

    #[tokio::test]
    async fn loopback_endpoint_is_refused_for_docker() {
        let r = serve_with(
            Arc::new(Config::default()), // endpoint 127.0.0.1:3128
            DockerOptions::default(),
            HostOptions::default(),
            EventSink::default(),
            Hooks::default(),
            Stop::detached(),
        )
        .await;
        assert!(matches!(r, Err(ServeError::Endpoint(_))), "{r:?}");
    }
}
