//! Direct ports of `allow_hosts` entries in the host layer: one named nftables set per enforced
//! container and port (`d<id12>p<port>`, IPv4 addresses with per-element timeouts), filled from
//! the agent's DNS answers to that container.
//!
//! The cgroup programs allow a container direct TCP to the addresses the agent's DNS answered
//! it for a `{ host, ports }` entry (`bpf::redirects`); the forward and input chains of the inet
//! table let the same (container, address, port) through only while its set holds the address.
//! Each element carries the answer's TTL as its kernel timeout, so the second layer forgets an
//! address on its own — also when the agent is gone.
//!
//! Two writers share the sets, both under one lock ([`DirectSets`]): the DNS answer path adds
//! elements to the live sets (a small batch: add, delete, add again — so an element that is
//! already there gets the new timeout on every kernel, and one that isn't is created), and the
//! ruleset rebuild (which deletes and re-creates the whole table) writes every element still
//! alive with its remaining time. Holding the lock across both means no answer is lost between a
//! rebuild's snapshot and its write. A set exists only once a ruleset carrying it was written;
//! until then (and for ports the policy doesn't carry) [`DirectSets::allow`] refuses, and the
//! caller must not open the kernel side either (the connection is then refused at `connect()`,
//! not dropped silently).
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, c_char, c_void};
use std::net::Ipv4Addr;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nftnl::nftnl_sys::{self as sys, libc};
use nftnl::set::Set;
use nftnl::{Batch, MsgType, ProtoFamily, Table};

use super::{NftError, TABLE, send};

/// (container id, port): one set.
pub type SetKey = (String, u16);

/// Most addresses one set holds; beyond it an answer's new addresses are refused (counted),
/// which only keeps them behind the proxy.
pub const MAX_SET_ELEMENTS: usize = 4096;

/// The set of `container`'s direct `port` (also the name rules look it up by).
pub fn set_name(container: &str, port: u16) -> CString {
    let short: String = container
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    // Only [0-9a-zA-Z] and digits: never an interior NUL.
    CString::new(format!("d{short}p{port}")).unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
pub enum DirectError {
    #[error(
        "container {container} has no direct set for port {port} in the host layer (not enforced yet, or the port is not in its policy)"
    )]
    NoSet { container: String, port: u16 },
    #[error(
        "direct set of container {container} port {port} is full ({MAX_SET_ELEMENTS} addresses)"
    )]
    Full { container: String, port: u16 },
    #[error(transparent)]
    Nft(#[from] NftError),
}

#[derive(Debug, Default)]
pub(super) struct Live {
    /// Addresses and the deadline the kernel forgets them at (at the latest).
    pub(super) sets: BTreeMap<SetKey, BTreeMap<Ipv4Addr, Instant>>,
    /// Sets the last written ruleset created.
    present: BTreeSet<SetKey>,
}

impl Live {
    fn prune(&mut self, now: Instant) {
        for addrs in self.sets.values_mut() {
            addrs.retain(|_, deadline| *deadline > now);
        }
        self.sets.retain(|_, a| !a.is_empty());
    }
}

/// The live direct elements of every container (see the module docs).
#[derive(Debug, Default)]
pub struct DirectSets {
    live: Mutex<Live>,
}

impl DirectSets {
    pub fn new() -> DirectSets {
        DirectSets::default()
    }

    fn lock(&self) -> MutexGuard<'_, Live> {
        // A panic while holding it can't leave an inconsistent map (each write is whole).
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Let `container` reach `addrs` on `port` directly for `ttl` (an answer of the agent's DNS).
    /// Written to the kernel before it returns; an address already allowed for about as long
    /// (within a second) is not written again. Returns the earliest deadline at which the host
    /// layer forgets one of `addrs` (never later than the kernel's own timeout): the cgroup
    /// programs' allowance must end before it, or a `connect()` they let through would hang on
    /// a dropped SYN instead of failing with `EPERM`.
    pub fn allow(
        &self,
        container: &str,
        port: u16,
        addrs: &[Ipv4Addr],
        ttl: Duration,
    ) -> Result<Instant, DirectError> {
        let mut live = self.lock();
        let key = (container.to_owned(), port);
        if !live.present.contains(&key) {
            return Err(DirectError::NoSet {
                container: container.to_owned(),
                port,
            });
        }
        let now = Instant::now();
        let deadline = now + ttl;
        let known = live.sets.get(&key);
        // The kernel's timeout starts when it takes the element, after `now`: our deadline is
        // never later than the kernel's. One second of slack avoids rewriting an element for
        // every cached answer (whose TTL counts down).
        let fresh: Vec<Ipv4Addr> = addrs
            .iter()
            .copied()
            .filter(|a| {
                known
                    .and_then(|k| k.get(a))
                    .is_none_or(|d| *d + Duration::from_secs(1) < deadline)
            })
            .collect();
        let held_until = |fresh: &[Ipv4Addr], known: Option<&BTreeMap<Ipv4Addr, Instant>>| {
            addrs
                .iter()
                .map(|a| {
                    if fresh.contains(a) {
                        deadline
                    } else {
                        known.and_then(|k| k.get(a)).copied().unwrap_or(deadline)
                    }
                })
                .min()
                .unwrap_or(now)
        };
        if fresh.is_empty() {
            return Ok(held_until(&fresh, known));
        }
        let held = known.map_or(0, BTreeMap::len);
        if held + fresh.len() > MAX_SET_ELEMENTS {
            return Err(DirectError::Full {
                container: container.to_owned(),
                port,
            });
        }
        refresh_elements(&set_name(container, port), &fresh, ttl)?;
        let set = live.sets.entry(key).or_default();
        for a in &fresh {
            set.insert(*a, deadline);
        }
        Ok(held_until(&fresh, Some(set)))
    }

    /// Run `write` (a ruleset rebuild) with the live elements, pruned of expired ones; on
    /// success, `written` are the sets that now exist and elements of other sets are forgotten.
    pub(super) fn rebuild<T>(
        &self,
        written: BTreeSet<SetKey>,
        write: impl FnOnce(&Live) -> Result<T, NftError>,
    ) -> Result<T, NftError> {
        let mut live = self.lock();
        live.prune(Instant::now());
        let out = write(&live)?;
        live.sets.retain(|k, _| written.contains(k));
        live.present = written;
        Ok(out)
    }

    /// Forget every element of `container` (its policy's entries with ports changed): the next
    /// ruleset write creates its sets empty.
    pub fn forget(&self, container: &str) {
        self.lock().sets.retain(|(c, _), _| c != container);
    }

    /// The addresses `container` may reach directly on `port` now (tests).
    pub fn addresses(&self, container: &str, port: u16) -> Vec<Ipv4Addr> {
        let now = Instant::now();
        self.lock()
            .sets
            .get(&(container.to_owned(), port))
            .map(|s| {
                s.iter()
                    .filter(|(_, d)| **d > now)
                    .map(|(a, _)| *a)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A named set of IPv4 addresses whose elements time out (created in a rebuild batch).
pub(super) fn timeout_set<'a>(
    name: &std::ffi::CStr,
    id: u32,
    table: &'a Table,
) -> Set<'a, Ipv4Addr> {
    let set = Set::<Ipv4Addr>::new_named(name, id, table, ProtoFamily::Inet);
    #[expect(unsafe_code, reason = "nftnl's Set has no setter for the timeout flag")]
    // SAFETY: `set.as_ptr()` is the live nftnl_set owned by `set`; setting a u32 attribute
    // copies the value.
    unsafe {
        sys::nftnl_set_set_u32(
            set.as_ptr().as_ptr(),
            sys::NFTNL_SET_FLAGS as u16,
            libc::NFT_SET_TIMEOUT as u32,
        );
    }
    set
}

/// Add `addr` to `set`'s element list, with `timeout` when given (rounded up to whole ms).
pub(super) fn push_element(set: &mut Set<'_, Ipv4Addr>, addr: Ipv4Addr, timeout: Option<Duration>) {
    let key = addr.octets();
    #[expect(
        unsafe_code,
        reason = "nftnl's Set::add can't give an element a timeout"
    )]
    // SAFETY: the element is allocated here (null-checked) and handed to the set, which owns and
    // frees it; key and timeout are copied by libnftnl.
    unsafe {
        let elem = sys::nftnl_set_elem_alloc();
        if elem.is_null() {
            // Out of memory: the element is missing, which allows less, never more.
            return;
        }
        sys::nftnl_set_elem_set(
            elem,
            sys::NFTNL_SET_ELEM_KEY as u16,
            key.as_ptr().cast::<c_void>(),
            key.len() as u32,
        );
        if let Some(t) = timeout {
            let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1);
            sys::nftnl_set_elem_set_u64(elem, sys::NFTNL_SET_ELEM_TIMEOUT as u16, ms);
        }
        sys::nftnl_set_elem_add(set.as_ptr().as_ptr(), elem);
    }
}

/// The element messages of a set: `NEWSETELEM` without `NLM_F_EXCL` (an element that exists is
/// not an error) or `DELSETELEM`.
pub(super) struct Elements<'a, 'b>(pub(super) &'b Set<'a, Ipv4Addr>);

#[expect(unsafe_code, reason = "nftnl's element messages always set NLM_F_EXCL")]
// SAFETY: `write` builds one message into `buf`, which nftnl's Batch sizes for
// `nft_nlmsg_maxsize()` bytes; the set outlives the call.
unsafe impl nftnl::NlMsg for Elements<'_, '_> {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, msg_type: MsgType) {
        let (ty, flags) = match msg_type {
            MsgType::Add => (
                libc::NFT_MSG_NEWSETELEM,
                libc::NLM_F_CREATE | libc::NLM_F_ACK,
            ),
            MsgType::Del => (libc::NFT_MSG_DELSETELEM, libc::NLM_F_ACK),
        };
        // SAFETY: see the impl.
        unsafe {
            let header = sys::nftnl_nlmsg_build_hdr(
                buf.cast::<c_char>(),
                ty as u16,
                ProtoFamily::Inet as u16,
                flags as u16,
                seq,
            );
            sys::nftnl_set_elems_nlmsg_build_payload(header, self.0.as_ptr().as_ptr());
        }
    }
}

/// Give `addrs` in the live set `name` the timeout `ttl`: add (creates what's missing), delete,
/// add again with the timeout — one atomic batch.
fn refresh_elements(
    name: &std::ffi::CStr,
    addrs: &[Ipv4Addr],
    ttl: Duration,
) -> Result<(), NftError> {
    let table = Table::new(TABLE, ProtoFamily::Inet);
    let mut timed = Set::<Ipv4Addr>::new_named(name, 0, &table, ProtoFamily::Inet);
    let mut bare = Set::<Ipv4Addr>::new_named(name, 0, &table, ProtoFamily::Inet);
    for a in addrs {
        push_element(&mut timed, *a, Some(ttl));
        push_element(&mut bare, *a, None);
    }
    let mut batch = Batch::new();
    batch.add(&Elements(&timed), MsgType::Add);
    batch.add(&Elements(&bare), MsgType::Del);
    batch.add(&Elements(&timed), MsgType::Add);
    send(&batch.finalize())
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn set_names_are_short_and_plain() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(set_name(id, 22).to_str().unwrap_or(""), "d0123456789abp22");
        assert_eq!(set_name("a/b\0c", 2222).to_str().unwrap_or(""), "dabcp2222");
    }

    #[test]
    fn answers_need_a_written_set() {
        let d = DirectSets::new();
        let e = d
            .allow(
                "c1",
                22,
                &[Ipv4Addr::new(45, 90, 0, 1)],
                Duration::from_secs(5),
            )
            .unwrap_err();
        assert!(matches!(e, DirectError::NoSet { port: 22, .. }), "{e}");
        assert!(d.addresses("c1", 22).is_empty());
    }

    #[test]
    fn an_element_not_written_again_keeps_its_earlier_deadline() {
        let d = DirectSets::new();
        let (a, b) = (Ipv4Addr::new(45, 90, 0, 1), Ipv4Addr::new(45, 90, 0, 2));
        let key = ("c1".to_owned(), 22);
        let soon = Instant::now() + Duration::from_millis(4500);
        let later = Instant::now() + Duration::from_secs(60);
        {
            let mut live = d.lock();
            live.present.insert(key.clone());
            live.sets.insert(key, [(a, soon), (b, later)].into());
        }
        // A cached answer whose TTL counts down: within the second of slack, nothing is written
        // (no netlink here), and the caller learns the host layer still ends at `soon`.
        let held = d.allow("c1", 22, &[a, b], Duration::from_secs(5)).unwrap();
        assert_eq!(held, soon, "the earliest element the host layer holds");
    }

    #[test]
    fn rebuilds_keep_only_written_sets_and_live_elements() {
        let d = DirectSets::new();
        {
            let mut live = d.lock();
            let now = Instant::now();
            live.sets.insert(
                ("c1".into(), 22),
                [
                    (Ipv4Addr::new(45, 90, 0, 1), now + Duration::from_secs(30)),
                    (Ipv4Addr::new(45, 90, 0, 2), now - Duration::from_secs(1)),
                ]
                .into(),
            );
            live.sets.insert(
                ("gone".into(), 22),
                [(Ipv4Addr::new(45, 90, 0, 3), now + Duration::from_secs(30))].into(),
            );
        }
        let seen = d
            .rebuild([("c1".to_owned(), 22)].into(), |live| {
                Ok(live.sets.values().map(BTreeMap::len).sum::<usize>())
            })
            .unwrap_or(0);
        assert_eq!(seen, 2, "the expired element is not written again");
        assert_eq!(d.addresses("c1", 22), [Ipv4Addr::new(45, 90, 0, 1)]);
        assert!(
            d.addresses("gone", 22).is_empty(),
            "a removed container's set is forgotten"
        );
        // A failed rebuild changes nothing.
        let r: Result<(), _> = d.rebuild(BTreeSet::new(), |_| Err(NftError::Comment("refused")));
        assert!(r.is_err());
        assert_eq!(d.addresses("c1", 22).len(), 1);
    }
}
