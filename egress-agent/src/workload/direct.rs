//! Direct ports (`{ host, ports }` entries) for Docker containers: each answer of the agent's
//! DNS opens the answered addresses on the entry's ports in **both layers**, the host layer's
//! direct set first ([`nft::DirectSets`], the nftables second layer, which forwards a container's
//! traffic only where its rules say), then the container cgroup's kernel allowance
//! ([`KernelRedirects::allow_direct`]). Both forget the address when the answer's TTL runs out.
//!
//! If the host layer can't take an address (the container's set isn't written yet, the set is
//! full, netlink refused), the kernel allowance isn't written either: the client's `connect()`
//! then fails at once with `EPERM` and a denial event instead of hanging on a dropped SYN.
//! With the host layer, IPv6 addresses are never opened (it drops enforced containers' IPv6 at
//! the bridge); without it (`--no-nft`) the kernel allowance is all there is, for both families.
//!
//! A reload that changes a container's `{ host, ports }` entries takes back every direct
//! allowance it holds ([`DirectPorts::forget`]): an address answered for a name the policy no
//! longer carries must not stay open until its TTL.
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use crate::bpf::redirects::KernelRedirects;
use crate::nft::DirectSets;
use crate::proxy::dns::{Answer, AnswerSink};

#[derive(Debug)]
pub struct DirectPorts {
    kernel: Arc<KernelRedirects>,
    /// The host layer's sets; `None` without the host layer (`--no-nft`).
    host: Option<Arc<DirectSets>>,
}

impl DirectPorts {
    pub fn new(kernel: Arc<KernelRedirects>, host: Option<Arc<DirectSets>>) -> DirectPorts {
        DirectPorts { kernel, host }
    }

    /// The host layer's sets (a fresh, unused one without the host layer).
    pub fn host_sets(&self) -> Arc<DirectSets> {
        self.host.clone().unwrap_or_default()
    }

    /// Take back every direct allowance of `container` (cgroup `entry_id`): kernel entries at
    /// once, host-layer elements with the next ruleset write (the reload's).
    pub fn forget(&self, container: &str, entry_id: u64) {
        let removed = self.kernel.forget_direct(entry_id);
        if let Some(h) = &self.host {
            h.forget(container);
        }
        tracing::info!(
            container,
            cgroup_id = entry_id,
            removed,
            "direct allowances taken back (the policy's entries with ports changed)"
        );
    }
}

impl AnswerSink for DirectPorts {
    fn answered(&self, answer: &Answer<'_>) {
        if answer.direct_ports.is_empty() || answer.direct_addrs.is_empty() {
            return;
        }
        let Some(identity) = answer.identity else {
            return;
        };
        let (Some(entry_id), Some(container)) = (identity.cgroup_id, identity.container.as_ref())
        else {
            return;
        };
        let Some(host) = &self.host else {
            if self.kernel.allow_direct(
                entry_id,
                answer.direct_addrs,
                answer.direct_ports,
                answer.ttl,
            ) > 0
            {
                tracing::warn!(container = %container.id, name = %answer.name,
                    "writing direct allowances to the kernel failed; connections to them are refused");
            }
            return;
        };
        let v4: Vec<Ipv4Addr> = answer
            .direct_addrs
            .iter()
            .filter_map(|a| match a {
                IpAddr::V4(ip) => Some(*ip),
                IpAddr::V6(_) => None,
            })
            .collect();
        if v4.is_empty() {
            tracing::debug!(container = %container.id, name = %answer.name,
                "direct ports: IPv6-only answer, not opened (the host layer drops IPv6)");
            return;
        }
        let addrs: Vec<IpAddr> = v4.iter().copied().map(IpAddr::V4).collect();
        for port in answer.direct_ports {
            if let Err(e) = host.allow(&container.id, *port, &v4, answer.ttl) {
                tracing::warn!(container = %container.id, name = %answer.name, port, error = %e,
                    "direct port not opened; connections to it are refused");
                continue;
            }
            if self
                .kernel
                .allow_direct(entry_id, &addrs, &[*port], answer.ttl)
                > 0
            {
                tracing::warn!(container = %container.id, name = %answer.name, port,
                    "writing direct allowances to the kernel failed; connections to them are refused");
            }
        }
    }
}
