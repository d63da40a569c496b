//! Direct ports (`{ host, ports }` entries) for Docker containers: each answer of the agent's
//! DNS opens the answered addresses on the entry's ports in **both layers**, the host layer's
//! direct set first ([`nft::DirectSets`], the nftables second layer, which forwards a container's
//! traffic only where its rules say), then the container cgroup's kernel allowance
//! ([`KernelRedirects::allow_direct`]). Both forget the address when the answer's TTL runs out,
//! the kernel allowance a little before the host layer's element (see [`kernel_ttl`]).
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
use std::time::{Duration, Instant};

use crate::bpf::redirects::KernelRedirects;
use crate::nft::DirectSets;
use crate::proxy::dns::{Answer, AnswerSink};

/// How much earlier than the host layer's element the kernel allowance ends: nftables counts
/// element timeouts in jiffies (up to 10 ms each at HZ=100), so an element can go a tick before
/// `deadline` on the monotonic clock.
const HOST_LAYER_MARGIN: Duration = Duration::from_millis(50);

/// The kernel allowance's time to live when the host layer holds the address until `held_until`:
/// it ends [`HOST_LAYER_MARGIN`] before, so a connection after it is refused at `connect()`
/// (`EPERM`, an event) rather than let through by the cgroup program and then dropped by the
/// host layer (a client hanging on its SYN retries for two minutes). `None`: nothing left.
fn kernel_ttl(held_until: Instant, now: Instant) -> Option<Duration> {
    let ttl = held_until
        .saturating_duration_since(now)
        .saturating_sub(HOST_LAYER_MARGIN);
    (!ttl.is_zero()).then_some(ttl)
}

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
            let held_until = match host.allow(&container.id, *port, &v4, answer.ttl) {
                Ok(deadline) => deadline,
                Err(e) => {
                    tracing::warn!(container = %container.id, name = %answer.name, port, error = %e,
                        "direct port not opened; connections to it are refused");
                    continue;
                }
            };
            let Some(ttl) = kernel_ttl(held_until, Instant::now()) else {
                continue;
            };
            if self.kernel.allow_direct(entry_id, &addrs, &[*port], ttl) > 0 {
                tracing::warn!(container = %container.id, name = %answer.name, port,
                    "writing direct allowances to the kernel failed; connections to them are refused");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_allowance_ends_before_the_host_layer() {
        let now = Instant::now();
        let held = now + Duration::from_secs(2);
        assert_eq!(
            kernel_ttl(held, now),
            Some(Duration::from_secs(2) - HOST_LAYER_MARGIN)
        );
        assert_eq!(
            kernel_ttl(now + HOST_LAYER_MARGIN, now),
            None,
            "nothing left"
        );
        assert_eq!(
            kernel_ttl(now, now + Duration::from_secs(1)),
            None,
            "already gone"
        );
    }
}
