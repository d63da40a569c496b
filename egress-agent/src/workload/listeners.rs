//! One proxy listener per opted-in workload (a socket per address family it is asked for).
//!
//! The listener serves the container's policy on `proxy.listen` with a kernel-chosen port; the
//! container's kernel entry points the stable endpoint at it. The listener that accepted a
//! connection *is* the container: its identity (container, context labels) goes into every
//! denial event, and no other container can reach it (kernel and nftables both refuse).
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::info::ContainerInfo;
use super::pod_clients::PodClients;
use crate::agent::Stop;
use crate::events::ContainerRef;
use crate::proxy::{Identity, PolicyHandle, PolicyProxy, ProxyContext};
use egress_policy::Policy;
use egress_policy::kernel::InterceptAddrs;

/// Where a workload's listener serves, per address family, each with its transparent
/// listener and DNS responder (when the proxy context has the kernel hooks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bound {
    pub v4: Option<(SocketAddr, InterceptAddrs)>,
    pub v6: Option<(SocketAddr, InterceptAddrs)>,
}

/// A running listener (one socket per address it was asked for); dropping it stops it.
pub struct Listener {
    pub bound: Bound,
    /// The policy name it serves.
    pub policy: String,
    /// The container cgroup it serves (DNS answers allow direct TCP for this entry only).
    pub cgroup_id: u64,
    /// A pod's: names the container of each client (attached when the sandbox runs).
    pub clients: Option<Arc<PodClients>>,
    /// Swap its policy in place (reload with the same policy name), one per socket.
    handles: Vec<PolicyHandle>,
    stop: Stop,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.token().cancel();
    }
}

impl Listener {
    /// Serve `policy` (named `name`) for `info` (whose cgroup is `cgroup_id`) on each of `ips`
    /// (at most one per address family), port 0, until dropped or `shutdown`, each socket on a
    /// task `shutdown`'s tracker keeps (the agent's stop waits for it, and it for its
    /// connections).
    #[expect(
        clippy::too_many_arguments,
        reason = "one call site; each is a distinct input"
    )]
    pub async fn bind(
        ips: &[IpAddr],
        info: &ContainerInfo,
        cgroup_id: u64,
        name: &str,
        policy: &Arc<Policy>,
        context: &BTreeMap<String, String>,
        proxy: &ProxyContext,
        clients: Option<Arc<PodClients>>,
        shutdown: &Stop,
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
        let stop = shutdown.child();
        let mut bound = Bound::default();
        let mut handles = Vec::new();
        for ip in ips {
            let proxy = PolicyProxy::bind_for(
                SocketAddr::new(*ip, 0),
                name.to_owned(),
                policy.clone(),
                proxy.clone(),
                Some(identity.clone()),
            )
            .await?;
            let addr = proxy.local_addr();
            let at = Some((addr, proxy.intercept_addrs().unwrap_or_default()));
            if addr.is_ipv4() {
                bound.v4 = at;
            } else {
                bound.v6 = at;
            }
            handles.push(proxy.policy_handle());
            stop.spawn(proxy.run(stop.clone().cancelled_owned()));
            tracing::debug!(container = %info.id, policy = name, %addr, "workload proxy listener");
        }
        Ok(Listener {
            bound,
            policy: name.to_owned(),
            cgroup_id,
            clients,
            handles,
            stop,
        })
    }

    /// The workload reaches its own host at `addrs` (the DNS answers them for
    /// `host.docker.internal` when the policy allows host services).
    pub fn set_host(&self, addrs: &[IpAddr]) {
        for h in &self.handles {
            h.set_host(addrs);
        }
    }

    /// Keep serving, with the new content of the same policy.
    pub fn set(&self, policy: &Policy) {
        for h in &self.handles {
            h.set(policy);
        }
    }
}
