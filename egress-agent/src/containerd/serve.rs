//! The containerd runtime in one call: programs at the kubelet's cgroup root, the shared
//! enforcer, and the watcher, until the agent core's stop.
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::{Config, KubernetesConfig};
use crate::docker::cgroups::DockerRoot;
use crate::docker::serve::{Site, enforcer_at};
use crate::docker::{DockerOptions, Hooks, ServeError};
use crate::events::EventSink;

/// Enforce this node's pods: `k8s` is the `[kubernetes]` section of `config`; `host` the
/// agent's host-wide settings (nftables layer and its tables, BPF-LSM requirement, the
/// directory kernel events are named from; its Docker fields are not used). Ready (with the
/// root and endpoint) once the programs are attached at the kubelet root and the proxy address
/// is up — before containerd is reached: a containerd outage must not delay enforcement (pods
/// under the root without an entry are `deny_all` meanwhile).
pub async fn serve(
    config: Arc<Config>,
    k8s: KubernetesConfig,
    host: DockerOptions,
    events: EventSink,
    hooks: Hooks,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let root = DockerRoot::new(crate::cgroup::cgroup2_mount()?, &k8s.cgroup_root);
    let site = Site {
        root,
        // Pod interfaces (each pod's host-side veth, found through its sandbox's network
        // namespace) in the same tables as Docker's containers.
        nft: host.nft,
        require_lsm: host.require_lsm,
        directory: host.directory,
        tables: host.tables,
        sockets: host.sockets,
        intercept: host.intercept,
        holders: host.holders,
        runtime: "kubernetes",
    };
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
