//! The user-space half of transparent interception and the agent's DNS (the proxy's
//! `InterceptHooks` are built on it in `proxy::kernel_hooks`): the record of every connection
//! the kernel sent to one of the agent's listeners, with the original destination of redirected
//! ones (read from [`maps::ORIG_BY_TUPLE`], deleted as they are read: the listeners'
//! admission), and direct allowances for the addresses the agent's DNS answered ([`maps::DIRECT4`]/[`maps::DIRECT6`], expiring with the answer's TTL on
//! the kernel's clock).
//!
//! Both are map operations on the proxy's tasks: short and non-blocking. A failed allowance
//! write is logged and counted; the client then reaches that address through the transparent
//! proxy (or not at all) — never more than the policy allows.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{HashMap, MapData};
use egress_common::{ConnTuple, Direct4Key, Direct6Key, OrigDst, maps};
use nix::time::{ClockId, clock_gettime};

use super::BpfError;
use super::state::open_typed;
use egress_policy::kernel::ip6_words;

const AF_INET: u32 = libc::AF_INET as u32;
const AF_INET6: u32 = libc::AF_INET6 as u32;

/// Handles on the redirect maps, shared by every listener of the process.
pub struct KernelRedirects {
    orig: Mutex<HashMap<MapData, ConnTuple, OrigDst>>,
    direct4: Mutex<HashMap<MapData, Direct4Key, u64>>,
    direct6: Mutex<HashMap<MapData, Direct6Key, u64>>,
    /// Allowance writes that failed (map errors).
    failed: AtomicU64,
}

impl std::fmt::Debug for KernelRedirects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelRedirects").finish_non_exhaustive()
    }
}

impl KernelRedirects {
    /// Open the pinned maps under `<bpffs>/maps/`.
    pub fn open(bpffs: &Path) -> Result<KernelRedirects, BpfError> {
        let dir = super::loader::maps_dir(bpffs);
        Ok(KernelRedirects {
            orig: Mutex::new(open_typed(&dir, maps::ORIG_BY_TUPLE)?),
            direct4: Mutex::new(open_typed(&dir, maps::DIRECT4)?),
            direct6: Mutex::new(open_typed(&dir, maps::DIRECT6)?),
            failed: AtomicU64::new(0),
        })
    }

    /// Allowance writes that failed so far.
    pub fn failed_writes(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
}

/// An accepted connection (`peer`: the client's address, `local`: the listener address it
/// reached) as sock_ops keyed it: IPv4 (also v4-mapped IPv6) in word 0, network order.
pub fn tuple(peer: SocketAddr, local: SocketAddr) -> ConnTuple {
    let conn = Conn { peer, local };
    let v4 = |a: &SocketAddr| match a.ip() {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(ip) => ip.to_ipv4_mapped(),
    };
    match (v4(&conn.peer), v4(&conn.local)) {
        (Some(p), Some(l)) => ConnTuple {
            client_addr: [u32::from_ne_bytes(p.octets()), 0, 0, 0],
            listener_addr: [u32::from_ne_bytes(l.octets()), 0, 0, 0],
            client_port: conn.peer.port().to_be(),
            listener_port: conn.local.port().to_be(),
            family: AF_INET,
        },
        _ => {
            let words = |a: &SocketAddr| match a.ip() {
                IpAddr::V6(ip) => ip6_words(&ip),
                IpAddr::V4(ip) => ip6_words(&ip.to_ipv6_mapped()),
            };
            ConnTuple {
                client_addr: words(&conn.peer),
                listener_addr: words(&conn.local),
                client_port: conn.peer.port().to_be(),
                listener_port: conn.local.port().to_be(),
                family: AF_INET6,
            }
        }
    }
}

/// The destination an [`OrigDst`] records, if its family is known (`None` for
/// [`egress_common::ORIG_NONE`]: the explicit listener).
pub fn orig_addr(o: &OrigDst) -> Option<SocketAddr> {
    let port = u16::from_be(o.port);
    match o.family {
        AF_INET => Some(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(o.addr[0].to_ne_bytes())),
            port,
        )),
        AF_INET6 => {
            let mut b = [0u8; 16];
            for (i, w) in o.addr.iter().enumerate() {
                b[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(b)), port))
        }
        _ => None,
    }
}

struct Conn {
    peer: SocketAddr,
    local: SocketAddr,
}

impl KernelRedirects {
    /// The kernel's record of sending the accepted connection `peer` → `local` to this listener,
    /// deleted as it is read: `Some(None)` for the explicit listener, `Some(Some(original
    /// destination))` for a redirected one. `None`: no confined workload's connect() was sent
    /// here — the listener refuses it.
    pub fn take_record(&self, peer: SocketAddr, local: SocketAddr) -> Option<Option<SocketAddr>> {
        let key = tuple(peer, local);
        let mut map = self.orig.lock().ok()?;
        let found = map.get(&key, 0).ok()?;
        // Each connection asks once; a reused 4-tuple gets its own entry from sock_ops. Deleting
        // is what keeps a record from admitting a second connection: if it fails, the record
        // admits nothing.
        map.remove(&key).ok()?;
        Some(orig_addr(&found))
    }
}

/// Delete the keys of `map` that `doomed` picks; returns how many went.
fn remove_where<K: aya::Pod>(
    map: &Mutex<HashMap<MapData, K, u64>>,
    doomed: impl Fn(&K) -> bool,
) -> usize {
    let Ok(mut m) = map.lock() else {
        return 0;
    };
    let keys: Vec<K> = m
        .keys()
        .filter_map(Result::ok)
        .filter(|k| doomed(k))
        .collect();
    keys.iter().filter(|k| m.remove(k).is_ok()).count()
}

/// CLOCK_MONOTONIC in ns (`bpf_ktime_get_ns`'s clock) + `ttl`.
fn kernel_deadline(ttl: std::time::Duration) -> Option<u64> {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).ok()?;
    let now_ns =
        u64::try_from(now.tv_sec()).ok()? * 1_000_000_000 + u64::try_from(now.tv_nsec()).ok()?;
    now_ns.checked_add(u64::try_from(ttl.as_nanos()).ok()?)
}

impl KernelRedirects {
    /// Let cgroup `entry_id` open `addrs` on `ports` directly until `ttl` from now (the kernel's
    /// clock). Returns how many (address, port) writes failed; those stay refused.
    pub fn allow_direct(
        &self,
        entry_id: u64,
        addrs: &[IpAddr],
        ports: &[u16],
        ttl: std::time::Duration,
    ) -> u64 {
        let Some(deadline) = kernel_deadline(ttl) else {
            return (addrs.len() * ports.len()) as u64;
        };
        let mut failed = 0;
        for addr in addrs {
            for port in ports {
                let ok = match addr {
                    IpAddr::V4(ip) => self.direct4.lock().is_ok_and(|mut m| {
                        let key = Direct4Key {
                            entry_id,
                            addr: u32::from_ne_bytes(ip.octets()),
                            port: *port,
                            _pad: 0,
                        };
                        m.insert(key, deadline, 0).is_ok()
                    }),
                    IpAddr::V6(ip) => self.direct6.lock().is_ok_and(|mut m| {
                        let key = Direct6Key {
                            entry_id,
                            addr: ip6_words(ip),
                            port: *port,
                            _pad: [0; 3],
                        };
                        m.insert(key, deadline, 0).is_ok()
                    }),
                };
                if !ok {
                    failed += 1;
                }
            }
        }
        if failed > 0 {
            self.failed.fetch_add(failed, Ordering::Relaxed);
        }
        failed
    }
}

impl KernelRedirects {
    /// Delete every direct allowance of cgroup `entry_id` (both families). Returns how many
    /// went. Walks the maps: for reloads, not for every answer.
    pub fn forget_direct(&self, entry_id: u64) -> usize {
        remove_where(&self.direct4, |k| k.entry_id == entry_id)
            + remove_where(&self.direct6, |k| k.entry_id == entry_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuples_match_the_kernel_encoding() {
        let a = |s: &str| -> SocketAddr { s.parse().expect("addr") };
        let t = tuple(a("127.0.0.1:50000"), a("127.0.0.1:40001"));
        assert_eq!(t.family, AF_INET);
        assert_eq!(t.client_addr[0].to_ne_bytes(), [127, 0, 0, 1]);
        assert_eq!(u16::from_be(t.client_port), 50000);
        assert_eq!(u16::from_be(t.listener_port), 40001);
        // A v4-mapped pair is keyed as IPv4 (sock_ops unmaps both ends).
        assert_eq!(
            tuple(a("[::ffff:127.0.0.1]:50000"), a("[::ffff:127.0.0.1]:40001")),
            t
        );
        assert_eq!(
            tuple(a("[fd00::2]:50000"), a("[fd00::1]:40001")).family,
            AF_INET6
        );
    }

    #[test]
    fn original_destinations_decode() {
        let o = OrigDst {
            addr: [u32::from_ne_bytes([93, 184, 216, 34]), 0, 0, 0],
            port: 443u16.to_be(),
            _pad: 0,
            family: AF_INET,
        };
        assert_eq!(
            orig_addr(&o),
            Some("93.184.216.34:443".parse().expect("addr"))
        );
        let o6 = OrigDst {
            addr: ip6_words(&"2001:db8::1".parse().expect("ip")),
            port: 80u16.to_be(),
            _pad: 0,
            family: AF_INET6,
        };
        assert_eq!(
            orig_addr(&o6),
            Some("[2001:db8::1]:80".parse().expect("addr"))
        );
        assert_eq!(orig_addr(&OrigDst::default()), None);
    }

    #[test]
    fn deadlines_are_on_the_monotonic_clock() {
        let a = kernel_deadline(std::time::Duration::from_secs(0)).expect("clock");
        let b = kernel_deadline(std::time::Duration::from_secs(60)).expect("clock");
        assert!(b >= a + 60_000_000_000);
    }
}
