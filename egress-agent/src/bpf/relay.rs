//! Load and attach the in-kernel tunnel relay (`egress-relay`, see egress-ebpf/src/relay.rs).
//!
//! Unlike the cgroup programs this object is **not pinned**: the proxy process that loads it owns
//! its maps and its stream verdict program (attached to the `SPLICED` sockhash with
//! `BPF_PROG_ATTACH`; no link, nothing in bpffs). Spliced sockets are the proxy's own; when it
//! exits its fds close, the sockets leave the maps, the maps and the program are freed. A
//! restarted agent starts from a fresh, empty set of maps, and nothing outlives the process that
//! could carry bytes without it (fail safe: a dead proxy's tunnels die with it, as with the
//! user-space relay).
//!
//! Map operations are system calls on the maps' fds, serialised by one mutex (a few
//! microseconds each, a handful per tunnel).
use std::os::fd::{AsRawFd as _, BorrowedFd};
use std::sync::Mutex;

use aya::maps::{HashMap, MapData, PerCpuArray, RingBuf, SockHash};
use aya::programs::SkSkb;
use aya::{Ebpf, EbpfLoader};
use egress_common::relay::{self as common, Credit, Flow, maps};

/// The relay object built by build.rs (aya-build), embedded in the binary.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/egress-relay"));

/// `BPF_NOEXIST`: a key (a socket cookie, unique on the host) is never overwritten.
const BPF_NOEXIST: u64 = 1;
/// `BPF_EXIST`: only update an entry that is there.
const BPF_EXIST: u64 = 2;

/// Why the kernel relay can't be used (the proxy then relays in user space).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("the embedded relay object is empty: this binary was built with AYA_BUILD_SKIP=1")]
    NoObject,
    #[error("loading the relay object: {0}")]
    Object(#[source] Box<aya::EbpfError>),
    #[error("relay map {0} missing from the object")]
    MissingMap(&'static str),
    #[error("relay map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("relay program {0} missing from the object")]
    MissingProgram(&'static str),
    #[error("loading the relay program (sk_skb stream verdict): {0}")]
    Load(#[source] aya::programs::ProgramError),
    #[error("attaching the relay program to its sockhash: {0}")]
    Attach(#[source] aya::programs::ProgramError),
}

/// How far [`RelayProgram::splice_pair`] got when the kernel refused.
#[derive(Debug, thiserror::Error)]
pub enum SpliceError {
    /// Nothing is spliced (every entry made was removed again): the sockets are as they were.
    #[error("{step}: {source}")]
    Refused {
        step: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    /// One socket is spliced, the other could not be: the caller must unsplice and drain it.
    #[error("splicing the second socket: {0}")]
    Partial(#[source] aya::maps::MapError),
}

/// Totals of the verdict program (all CPUs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    pub redirected_skbs: u64,
    pub redirected_bytes: u64,
    /// Bytes received on a spliced socket whose peer entry was already gone: dropped.
    pub dropped_skbs: u64,
    pub dropped_bytes: u64,
    /// Kept in the receiving socket's own queue for user space (parked sockets).
    pub passed_skbs: u64,
    pub passed_bytes: u64,
    pub events_lost: u64,
}

/// Entries in each per-socket map (all 0 when nothing is spliced).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayEntries {
    pub peers: usize,
    pub spliced: usize,
    pub flows: usize,
    pub credits: usize,
}

impl RelayEntries {
    pub fn is_empty(&self) -> bool {
        *self == RelayEntries::default()
    }
}

struct Maps {
    peers: SockHash<MapData, u64>,
    spliced: SockHash<MapData, u64>,
    flow: HashMap<MapData, u64, Flow>,
    credit: HashMap<MapData, u64, Credit>,
}

/// One socket of a pair: its cookie and its fd.
#[derive(Clone, Copy)]
pub struct Sock<'a> {
    pub cookie: u64,
    pub fd: BorrowedFd<'a>,
}

/// The loaded relay: its maps and the verdict program attached to `SPLICED`.
pub struct RelayProgram {
    maps: Mutex<Maps>,
    stats: PerCpuArray<MapData, u64>,
    events: Mutex<Option<RingBuf<MapData>>>,
    capacity: u32,
    /// Holds the program (and so its attachment) for the life of the maps.
    _ebpf: Ebpf,
}

impl std::fmt::Debug for RelayProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayProgram")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl RelayProgram {
    /// Load the embedded object with room for `tunnels` spliced tunnels (two sockets each).
    pub fn load(tunnels: u32) -> Result<RelayProgram, RelayError> {
        RelayProgram::load_object(OBJECT, tunnels)
    }

    fn load_object(object: &[u8], tunnels: u32) -> Result<RelayProgram, RelayError> {
        if object.is_empty() {
            return Err(RelayError::NoObject);
        }
        let tunnels = tunnels.max(1);
        let sockets = tunnels.saturating_mul(2);
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(maps::PEERS, sockets)
            .map_max_entries(maps::SPLICED, sockets)
            .map_max_entries(maps::FLOW, sockets)
            .map_max_entries(maps::CREDIT, sockets)
            .load(object)
            .map_err(|e| RelayError::Object(Box::new(e)))?;
        fn take<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
            ebpf: &mut Ebpf,
            name: &'static str,
        ) -> Result<T, RelayError> {
            let map = ebpf.take_map(name).ok_or(RelayError::MissingMap(name))?;
            T::try_from(map).map_err(|source| RelayError::Map { name, source })
        }
        let peers = take(&mut ebpf, maps::PEERS)?;
        let spliced: SockHash<MapData, u64> = take(&mut ebpf, maps::SPLICED)?;
        let flow = take(&mut ebpf, maps::FLOW)?;
        let credit = take(&mut ebpf, maps::CREDIT)?;
        let events = take(&mut ebpf, maps::EVENTS)?;
        let stats = take(&mut ebpf, maps::STATS)?;
        let prog: &mut SkSkb = ebpf
            .program_mut(common::VERDICT)
            .ok_or(RelayError::MissingProgram(common::VERDICT))?
            .try_into()
            .map_err(RelayError::Load)?;
        prog.load().map_err(RelayError::Load)?;
        prog.attach(spliced.fd()).map_err(RelayError::Attach)?;
        Ok(RelayProgram {
            maps: Mutex::new(Maps {
                peers,
                spliced,
                flow,
                credit,
            }),
            stats,
            events: Mutex::new(Some(events)),
            capacity: tunnels,
            _ebpf: ebpf,
        })
    }

    /// How many tunnels fit.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        // A panic while holding the lock leaves the maps as the kernel has them: still usable.
        self.maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The credit/park ring buffer, handed out once (to the relay's event pump).
    pub fn take_events(&self) -> Option<RingBuf<MapData>> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Splice `a` and `b`: flow and credit entries, then each socket as the other's peer, then
    /// both into `SPLICED` (no socket is spliced before its peer can be found). Every key is
    /// inserted with `BPF_NOEXIST`.
    pub fn splice_pair(&self, a: Sock<'_>, b: Sock<'_>, credit: Credit) -> Result<(), SpliceError> {
        let mut m = self.maps();
        let mut done: Vec<(&'static str, u64)> = Vec::with_capacity(6);
        let refused = |m: &mut Maps, done: &[(&'static str, u64)], step, source| {
            for (map, key) in done.iter().rev() {
                m.remove(map, *key);
            }
            SpliceError::Refused { step, source }
        };
        for (s, step) in [(a, "flow entry"), (b, "flow entry")] {
            if let Err(e) = m.flow.insert(s.cookie, Flow::default(), BPF_NOEXIST) {
                return Err(refused(&mut m, &done, step, e));
            }
            done.push((maps::FLOW, s.cookie));
            if let Err(e) = m.credit.insert(s.cookie, credit, BPF_NOEXIST) {
                return Err(refused(&mut m, &done, "credit entry", e));
            }
            done.push((maps::CREDIT, s.cookie));
        }
        for (s, peer) in [(a, b), (b, a)] {
            if let Err(e) = m.peers.insert(s.cookie, peer.fd.as_raw_fd(), BPF_NOEXIST) {
                return Err(refused(&mut m, &done, "peer entry", e));
            }
            done.push((maps::PEERS, s.cookie));
        }
        if let Err(e) = m.spliced.insert(a.cookie, a.fd.as_raw_fd(), BPF_NOEXIST) {
            return Err(refused(&mut m, &done, "splicing", e));
        }
        m.spliced
            .insert(b.cookie, b.fd.as_raw_fd(), BPF_NOEXIST)
            .map_err(SpliceError::Partial)
    }

    /// Take sockets out of `SPLICED`: what they receive from now on stays in their own receive
    /// queues (ordinary TCP). Their peer, flow and credit entries stay (see [`Self::release`]).
    pub fn unsplice(&self, cookies: &[u64]) {
        let mut m = self.maps();
        for c in cookies {
            m.remove(maps::SPLICED, *c);
        }
    }

    /// Remove every entry of these sockets (teardown).
    pub fn release(&self, cookies: &[u64]) {
        let mut m = self.maps();
        for c in cookies {
            for map in [maps::SPLICED, maps::PEERS, maps::FLOW, maps::CREDIT] {
                m.remove(map, *c);
            }
        }
    }

    /// What the program has redirected from this socket (`None`: no entry).
    pub fn flow(&self, cookie: u64) -> Option<Flow> {
        self.maps().flow.get(&cookie, 0).ok()
    }

    /// Raise a socket's credit (only user space writes it).
    pub fn set_credit(&self, cookie: u64, credit: Credit) -> Result<(), aya::maps::MapError> {
        self.maps().credit.insert(cookie, credit, BPF_EXIST)
    }

    /// Entries in each per-socket map.
    pub fn entries(&self) -> RelayEntries {
        let m = self.maps();
        RelayEntries {
            peers: m.peers.keys().filter_map(Result::ok).count(),
            spliced: m.spliced.keys().filter_map(Result::ok).count(),
            flows: m.flow.keys().filter_map(Result::ok).count(),
            credits: m.credit.keys().filter_map(Result::ok).count(),
        }
    }

    /// The verdict program's totals.
    pub fn stats(&self) -> RelayStats {
        let slot = |i: u32| -> u64 {
            self.stats
                .get(&i, 0)
                .map(|v| v.iter().copied().sum())
                .unwrap_or(0)
        };
        RelayStats {
            redirected_skbs: slot(common::STAT_REDIRECTED_SKBS),
            redirected_bytes: slot(common::STAT_REDIRECTED_BYTES),
            dropped_skbs: slot(common::STAT_DROPPED_SKBS),
            dropped_bytes: slot(common::STAT_DROPPED_BYTES),
            passed_skbs: slot(common::STAT_PASSED_SKBS),
            passed_bytes: slot(common::STAT_PASSED_BYTES),
            events_lost: slot(common::STAT_EVENTS_LOST),
        }
    }
}

impl Maps {
    /// Remove `key` from the named map; a missing key is fine (teardown is idempotent).
    fn remove(&mut self, map: &str, key: u64) {
        let r = match map {
            maps::PEERS => self.peers.remove(&key),
            maps::SPLICED => self.spliced.remove(&key),
            maps::FLOW => self.flow.remove(&key),
            _ => self.credit.remove(&key),
        };
        if let Err(e) = r
            && !is_not_found(&e)
        {
            tracing::warn!(map, key, error = %e, "kernel relay: removing a map entry failed");
        }
    }
}

fn is_not_found(e: &aya::maps::MapError) -> bool {
    match e {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_object_is_refused_before_any_syscall() {
        assert!(matches!(
            RelayProgram::load_object(&[], 4),
            Err(RelayError::NoObject)
        ));
    }
}
