//! Direct ports (`{ host, ports }` entries) for Docker containers: each answer of the agent's
//! DNS opens the answered IPv4 addresses on the entry's ports in **both layers**, the host
//! layer's direct set first ([`nft::DirectSets`], the nftables second layer, which forwards a
//! container's traffic only where its rules say), then the container cgroup's kernel allowance
//! ([`KernelRedirects::allow_direct`]). Both forget the address when the answer's TTL runs out.
//!
//! If the host layer can't take an address (the container's set isn't written yet, the set is
//! full, netlink refused), the kernel allowance isn't written either: the client's `connect()`
//! then fails at once with `EPERM` and a denial event instead of hanging on a dropped SYN.
//! IPv6 addresses are never opened: the host layer drops enforced containers' IPv6 at the bridge.
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::bpf::redirects::KernelRedirects;
use crate::dns::{Answer, AnswerSink};
use crate::nft::DirectSets;

pub struct DockerAnswers {
    kernel: Arc<KernelRedirects>,
    host: Arc<DirectSets>,
    /// Answers whose addresses could not be opened (host layer or kernel map).
    failed: AtomicU64,
}

impl DockerAnswers {
    pub fn new(kernel: Arc<KernelRedirects>, host: Arc<DirectSets>) -> DockerAnswers {
        DockerAnswers {
            kernel,
            host,
            failed: AtomicU64::new(0),
        }
    }

    /// Answers whose direct addresses could not be opened so far.
    pub fn failures(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
}

impl AnswerSink for DockerAnswers {
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
            if let Err(e) = self.host.allow(&container.id, *port, &v4, answer.ttl) {
                self.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(container = %container.id, name = %answer.name, port, error = %e,
                    "direct port not opened; connections to it are refused");
                continue;
            }
            if self
                .kernel
                .allow_direct(entry_id, &addrs, &[*port], answer.ttl)
                > 0
            {
                self.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(container = %container.id, name = %answer.name, port,
                    "writing direct allowances to the kernel failed; connections to them are refused");
            }
        }
    }
}
