//! The containerd runtime in one call: programs at the kubelet's cgroup root, the shared
//! enforcer, and the watcher, until the agent core's stop.
use std::sync::Arc;

use crate::agent::Stop;
use crate::config::{Config, KubernetesConfig};
use crate::events::EventSink;
use crate::workload::root::WorkloadRoot;
use crate::workload::site::{Hooks, HostOptions, ServeError, Site, enforcer_at};

/// Enforce this node's pods: `k8s` is the `[kubernetes]` section of `config`; `host` the
/// agent's host-wide settings (nftables layer and its tables, BPF-LSM requirement, the
/// directory kernel events are named from). Ready (with the
/// root and endpoint) once the programs are attached at the kubelet root and the proxy address
/// is up — before containerd is reached: a containerd outage must not delay enforcement (pods
/// under the root without an entry are `deny_all` meanwhile).
pub async fn serve(
    config: Arc<Config>,
    k8s: KubernetesConfig,
    host: HostOptions,
    events: EventSink,
    hooks: Hooks,
    shutdown: Stop,
) -> Result<(), ServeError> {
    let root = WorkloadRoot::new(crate::cgroup::cgroup2_mount()?, &k8s.cgroup_root);
    // Pod interfaces (each pod's host-side veth, found through its sandbox's network
    // namespace) go in the same tables as Docker's containers.
    let site = Site::new(root, host, "kubernetes");
    let (enforcer, mut info) =
        enforcer_at(&config, site, &events, hooks.metrics.as_ref(), &shutdown).await?;
    info["containerd"] = serde_json::json!(k8s.containerd_socket.display().to_string());
    if let Some(ready) = hooks.ready
        && ready.send(info).is_err()
    {
        tracing::debug!("nobody waits for readiness");
    }
    let _enforcer = super::watch::run(
        &k8s,
        enforcer,
        hooks.reload,
        hooks.metrics,
        shutdown.cancelled_owned(),
    )
    .await;
    Ok(())
}
