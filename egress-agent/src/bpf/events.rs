//! Kernel denial events: the ring buffer → [`DenialEvent`]s.
//!
//! A ring buffer has one consumer position: two readers would steal each other's events. The
//! reader therefore takes an exclusive non-blocking `flock` on [`EVENTS_LOCK`]; whoever holds it
//! (normally the daemon, otherwise a standalone `exec`) consumes. Totals never depend on this:
//! the per-cgroup counters are kept in the kernel.
use std::collections::BTreeMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::time::SystemTime;

use aya::maps::{Map, MapData, RingBuf};
use egress_common::{Event, maps};
use nix::fcntl::{Flock, FlockArg};

use super::BpfError;
use super::loader::{lock_file, maps_dir};
use crate::events::{ALLOWED_REASON, DenialEvent, Source, Verdict};

pub const EVENTS_LOCK: &str = "/run/egress-agent/events.lock";

pub struct KernelEvents {
    ring: RingBuf<MapData>,
    _lock: Flock<File>,
}

impl KernelEvents {
    /// Open the pinned ring buffer if no other process is consuming it (`Ok(None)` then).
    pub fn try_open(bpffs: &Path) -> Result<Option<KernelEvents>, BpfError> {
        let Some(lock) = lock_file(Path::new(EVENTS_LOCK), FlockArg::LockExclusiveNonblock)? else {
            return Ok(None);
        };
        let path = maps_dir(bpffs).join(maps::EVENTS);
        let data = MapData::from_pin(&path).map_err(|source| BpfError::OpenMap {
            path: path.clone(),
            source,
        })?;
        let map = Map::from_map_data(data).map_err(|source| BpfError::OpenMap {
            path: path.clone(),
            source,
        })?;
        let ring: RingBuf<MapData> = map.try_into().map_err(|source| BpfError::Map {
            map: maps::EVENTS,
            op: "open",
            source,
        })?;
        Ok(Some(KernelEvents { ring, _lock: lock }))
    }

    /// Drain what is in the ring now.
    pub fn drain(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(item) = self.ring.next() {
            // An older program's events are shorter (no `task_cgroup_id`): taken as they are.
            if item.len() >= egress_common::EVENT_LEN_V1 {
                out.push(decode(&item[..item.len().min(size_of::<Event>())]));
            }
        }
        out
    }

    /// Wall-clock time of an event: the time it is read (the ring is drained every ~200 ms;
    /// `Event::ktime_ns` keeps the exact CLOCK_MONOTONIC stamp for ordering).
    pub fn time_of(&self, _ev: &Event) -> SystemTime {
        SystemTime::now()
    }

    /// The ring's fd, to wait for readiness (epoll / tokio `AsyncFd`).
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.ring.as_fd()
    }

    /// Hand every event to `deliver` as it arrives, until `shutdown` completes (then once more,
    /// for what is left). Woken by the ring buffer's readiness, not by a timer: the kernel wakes
    /// a reader that has caught up as soon as the next record is committed.
    pub async fn pump(
        self,
        mut deliver: impl FnMut(&KernelEvents, Vec<Event>),
        shutdown: impl std::future::Future<Output = ()>,
    ) -> std::io::Result<()> {
        #[expect(
            unsafe_code,
            reason = "tokio's fd registration requires the caller to vouch for the fd's lifetime"
        )]
        // SAFETY: the fd is the ring buffer map's, owned by `self.ring` (moved into the AsyncFd),
        // open for its whole life, and `as_raw_fd` always returns that same fd.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(self, tokio::io::Interest::READABLE)
        };
        let mut ring = registered.map_err(std::io::Error::from)?;
        tokio::pin!(shutdown);
        // Whatever was written before we started waiting.
        let first = ring.get_mut().drain();
        if !first.is_empty() {
            deliver(ring.get_ref(), first);
        }
        loop {
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard?;
                    // Drain until empty; an empty ring clears readiness (try_io sees WouldBlock),
                    // so the next commit wakes us again.
                    while let Ok(batch) = guard.try_io(|r| {
                        let batch = r.get_mut().drain();
                        if batch.is_empty() {
                            Err(std::io::ErrorKind::WouldBlock.into())
                        } else {
                            Ok(batch)
                        }
                    }) {
                        let batch = batch?;
                        deliver(guard.get_inner(), batch);
                    }
                }
                () = &mut shutdown => {
                    let rest = ring.get_mut().drain();
                    if !rest.is_empty() {
                        deliver(ring.get_ref(), rest);
                    }
                    return Ok(());
                }
            }
        }
    }
}

impl std::os::fd::AsRawFd for KernelEvents {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.as_fd().as_raw_fd()
    }
}

/// Field-by-field decode (no unsafe cast of ring memory); offsets follow `Event`'s layout.
fn decode(bytes: &[u8]) -> Event {
    let u64_at = |o: usize| u64::from_ne_bytes(bytes[o..o + 8].try_into().unwrap_or([0; 8]));
    let u32_at = |o: usize| u32::from_ne_bytes(bytes[o..o + 4].try_into().unwrap_or([0; 4]));
    let u16_at = |o: usize| u16::from_ne_bytes(bytes[o..o + 2].try_into().unwrap_or([0; 2]));
    let mut comm = [0u8; 16];
    comm.copy_from_slice(&bytes[56..72]);
    Event {
        ktime_ns: u64_at(0),
        cgroup_id: u64_at(8),
        pid: u32_at(16),
        hook: u32_at(20),
        family: u32_at(24),
        protocol: u32_at(28),
        port: u16_at(32),
        flags: u16_at(34),
        reason: u32_at(36),
        addr: [u32_at(40), u32_at(44), u32_at(48), u32_at(52)],
        comm,
        task_cgroup_id: if bytes.len() >= 80 { u64_at(72) } else { 0 },
    }
}

pub fn hook_name(hook: u32) -> &'static str {
    match hook {
        egress_common::HOOK_CONNECT4 => "connect4",
        egress_common::HOOK_CONNECT6 => "connect6",
        egress_common::HOOK_SENDMSG4 => "sendmsg4",
        egress_common::HOOK_SENDMSG6 => "sendmsg6",
        egress_common::HOOK_SKB_EGRESS => "skb_egress",
        egress_common::HOOK_SOCK_CREATE => "sock_create",
        egress_common::HOOK_LSM_SOCKET_CREATE => "lsm_socket_create",
        egress_common::HOOK_SKB_INGRESS => "skb_ingress",
        _ => "unknown",
    }
}

/// The name of a kernel denial reason (defined next to the codes, in egress-common).
pub use egress_common::reason_name;

/// The destination IP of an event, if it has one.
pub fn event_ip(ev: &Event) -> Option<IpAddr> {
    match ev.family as i32 {
        libc::AF_INET => Some(IpAddr::V4(Ipv4Addr::from(ev.addr[0].to_ne_bytes()))),
        libc::AF_INET6 => {
            let mut o = [0u8; 16];
            for (i, w) in ev.addr.iter().enumerate() {
                o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            Some(IpAddr::V6(Ipv6Addr::from(o)))
        }
        _ => None,
    }
}

fn protocol_name(ev: &Event) -> String {
    match ev.hook {
        egress_common::HOOK_SOCK_CREATE | egress_common::HOOK_LSM_SOCKET_CREATE => {
            format!("socket(family={}, type={})", ev.family, ev.protocol)
        }
        _ => match ev.protocol as i32 {
            libc::IPPROTO_TCP => "tcp".into(),
            libc::IPPROTO_UDP => "udp".into(),
            libc::IPPROTO_ICMP => "icmp".into(),
            libc::IPPROTO_ICMPV6 => "icmpv6".into(),
            p => format!("ip-proto-{p}"),
        },
    }
}

/// The event's `EVENT_FLAG_*` bits (the u16 after `port`).
pub fn event_flags(ev: &Event) -> u16 {
    ev.flags
}

/// What the kernel did: `EVENT_FLAG_ALLOWED` → allow, `EVENT_FLAG_AUDIT` → would-deny, else deny.
/// An unknown bit reads as a denial (the conservative reading for an operator).
pub fn event_verdict(ev: &Event) -> Verdict {
    let flags = event_flags(ev);
    if flags & !(egress_common::EVENT_FLAG_AUDIT | egress_common::EVENT_FLAG_ALLOWED) != 0 {
        return Verdict::Deny;
    }
    if flags & egress_common::EVENT_FLAG_ALLOWED != 0 {
        Verdict::Allow
    } else if flags & egress_common::EVENT_FLAG_AUDIT != 0 {
        Verdict::WouldDeny
    } else {
        Verdict::Deny
    }
}

/// A kernel event as a [`DenialEvent`]; `policy` is the name the caller knows for the cgroup.
pub fn to_denial(ev: &Event, time: SystemTime, policy: &str) -> DenialEvent {
    let comm_len = ev
        .comm
        .iter()
        .position(|b| *b == 0)
        .unwrap_or(ev.comm.len());
    let mut context = BTreeMap::new();
    context.insert(
        "comm".to_owned(),
        String::from_utf8_lossy(&ev.comm[..comm_len]).into_owned(),
    );
    context.insert("pid".to_owned(), ev.pid.to_string());
    context.insert("hook".to_owned(), hook_name(ev.hook).to_owned());
    if ev.hook == egress_common::HOOK_SKB_INGRESS {
        // `ip` is the peer that tried to connect in, `port` the cgroup's local port.
        context.insert("direction".to_owned(), "inbound".to_owned());
    }
    let verdict = event_verdict(ev);
    DenialEvent {
        time,
        source: Source::Kernel,
        cgroup_id: Some(ev.cgroup_id),
        task_cgroup_id: (ev.task_cgroup_id != 0).then_some(ev.task_cgroup_id),
        container: None,
        context,
        policy: policy.to_owned(),
        host: None,
        ip: event_ip(ev),
        port: ev.port,
        protocol: protocol_name(ev),
        reason: match verdict {
            Verdict::Allow => ALLOWED_REASON.to_owned(),
            _ => reason_name(ev.reason).to_owned(),
        },
        verdict,
        rule: None,
        count: 1,
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use egress_common::{EVENT_FLAG_ALLOWED, EVENT_FLAG_AUDIT, HOOK_CONNECT4, REASON_NOT_ALLOWED};

    fn raw(flags: u16) -> Vec<u8> {
        let mut b = vec![0u8; size_of::<Event>()];
        b[8..16].copy_from_slice(&42u64.to_ne_bytes());
        b[16..20].copy_from_slice(&7u32.to_ne_bytes());
        b[20..24].copy_from_slice(&HOOK_CONNECT4.to_ne_bytes());
        b[24..28].copy_from_slice(&(libc::AF_INET as u32).to_ne_bytes());
        b[28..32].copy_from_slice(&(libc::IPPROTO_TCP as u32).to_ne_bytes());
        b[32..34].copy_from_slice(&5432u16.to_ne_bytes());
        b[34..36].copy_from_slice(&flags.to_ne_bytes());
        b[36..40].copy_from_slice(&REASON_NOT_ALLOWED.to_ne_bytes());
        b[40..44].copy_from_slice(&[10, 0, 0, 5]);
        b[56..60].copy_from_slice(b"curl");
        b
    }

    #[test]
    fn flags_map_to_verdicts() {
        let t = SystemTime::now();
        let deny = to_denial(&decode(&raw(0)), t, "ci");
        assert_eq!(deny.verdict, Verdict::Deny);
        assert_eq!(deny.reason, "kernel-destination-not-allowed");
        assert_eq!(deny.ip, Some("10.0.0.5".parse().unwrap()));
        assert_eq!(deny.port, 5432);
        assert_eq!(deny.protocol, "tcp");
        assert_eq!(deny.context["comm"], "curl");
        let wd = to_denial(&decode(&raw(EVENT_FLAG_AUDIT)), t, "ci");
        assert_eq!(wd.verdict, Verdict::WouldDeny);
        // Exactly the fields a denial has.
        assert_eq!(wd.clone().with_verdict(Verdict::Deny), deny.clone());
        let allowed = to_denial(&decode(&raw(EVENT_FLAG_ALLOWED)), t, "ci");
        assert_eq!(allowed.verdict, Verdict::Allow);
        assert_eq!(allowed.reason, ALLOWED_REASON);
        assert_eq!(
            to_denial(&decode(&raw(0x80)), t, "ci").verdict,
            Verdict::Deny
        );
    }

    #[test]
    fn the_callers_cgroup_is_read_and_an_older_programs_shorter_event_still_decodes() {
        let t = SystemTime::now();
        let mut b = raw(0);
        b[72..80].copy_from_slice(&77u64.to_ne_bytes());
        let ev = to_denial(&decode(&b), t, "ci");
        assert_eq!((ev.cgroup_id, ev.task_cgroup_id), (Some(42), Some(77)));
        let old = to_denial(&decode(&b[..egress_common::EVENT_LEN_V1]), t, "ci");
        assert_eq!((old.cgroup_id, old.task_cgroup_id), (Some(42), None));
        assert_eq!(old.port, 5432);
    }
}
