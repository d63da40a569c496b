//! One proxy listener per opted-in container.
//!
//! The listener serves the container's policy on `proxy.listen` with a kernel-chosen port; the
//! container's kernel entry points the stable endpoint at it. The listener that accepted a
//! connection *is* the container: its identity (container, context labels) goes into every
//! denial event, and no other container can reach it (kernel and nftables both refuse).
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::info::ContainerInfo;
use super::pod_clients::PodClients;
use crate::events::ContainerRef;
use crate::proxy::{Identity, PolicyHandle, PolicyProxy, ProxyContext};
use egress_policy::Policy;
use egress_policy::kernel::InterceptAddrs;

/// A running listener; dropping it stops it.
pub struct Listener {
    pub addr: SocketAddr,
    /// Its transparent listener and DNS responder (when the proxy context has the kernel hooks).
    pub intercept: InterceptAddrs,
    /// The policy name it serves.
    pub policy: String,
    /// The container cgroup it serves (DNS answers allow direct TCP for this entry only).
    pub cgroup_id: u64,
    /// A pod's: names the container of each client (attached when the sandbox runs).
    pub clients: Option<Arc<PodClients>>,
    /// Swaps its policy in place (reload with the same policy name).
    handle: PolicyHandle,
    stop: CancellationToken,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Listener {
    /// Serve `policy` (named `name`) for `info` (whose cgroup is `cgroup_id`) on `ip`, port 0,
    /// until dropped or `shutdown`.
    #[expect(
        clippy::too_many_arguments,
        reason = "one call site; each is a distinct input"
    )]
    pub async fn bind(
        ip: IpAddr,
        info: &ContainerInfo,
        cgroup_id: u64,
        name: &str,
        policy: &Arc<Policy>,
        context: &BTreeMap<String, String>,
        proxy: &ProxyContext,
        clients: Option<Arc<PodClients>>,
        shutdown: &CancellationToken,
    ) -> std::io::Result<Listener> {
        let identity = Identity {
            container: Some(ContainerRef {
                id: info.id.clone(),
                name: info.name.clone(),
            }),
            cgroup_id: Some(cgroup_id),
            context: context.clone(),
            clients: clients
                .clone()
                .map(|c| c as Arc<dyn crate::proxy::client::ClientNames>),
        };
        let proxy = PolicyProxy::bind_for(
            SocketAddr::new(ip, 0),
            name.to_owned(),
            policy.clone(),
            proxy.clone(),
            Some(identity),
        )
        .await?;
        let addr = proxy.local_addr();
        let intercept = proxy.intercept_addrs().unwrap_or_default();
        let handle = proxy.policy_handle();
        let stop = shutdown.child_token();
        tokio::spawn(proxy.run(stop.clone().cancelled_owned()));
        tracing::debug!(container = %info.id, policy = name, %addr, "container proxy listener");
        Ok(Listener {
            addr,
            intercept,
            policy: name.to_owned(),
            cgroup_id,
            clients,
            handle,
            stop,
        })
    }

    /// Keep serving, with the new content of the same policy.
    pub fn set(&self, policy: &Policy) {
        self.handle.set(policy);
    }
}
