//! The pinned maps, named by the constants the loader opens (checked at compile time).

use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuHashMap, RingBuf};
use egress_common::{
    Cidr4Data, Cidr6Data, CidrRule, ConnTuple, Counters, Direct4Key, Direct6Key, EVENTS_BYTES,
    GlobalConfig, MAX_CGROUPS, MAX_CIDRS, MAX_REDIRECTS, OrigDst, PolicyEntry, PolicyName,
    SockOwner,
};

#[map(name = "EGRESS_POLICIES")]
pub(crate) static POLICIES: HashMap<u64, PolicyEntry> = HashMap::pinned(MAX_CGROUPS, 0);
#[map(name = "EGRESS_CIDR4")]
pub(crate) static CIDR4: LpmTrie<Cidr4Data, CidrRule> = LpmTrie::pinned(MAX_CIDRS, 0);
#[map(name = "EGRESS_CIDR6")]
pub(crate) static CIDR6: LpmTrie<Cidr6Data, CidrRule> = LpmTrie::pinned(MAX_CIDRS, 0);
#[map(name = "EGRESS_COUNTERS")]
pub(crate) static COUNTERS: PerCpuHashMap<u64, Counters> = PerCpuHashMap::pinned(MAX_CGROUPS, 0);
#[map(name = "EGRESS_EVENTS")]
pub(crate) static EVENTS: RingBuf = RingBuf::pinned(EVENTS_BYTES, 0);
#[map(name = "EGRESS_CONFIG")]
pub(crate) static CONFIG: Array<GlobalConfig> = Array::pinned(1, 0);
/// User-space bookkeeping only (policy names for `status`); defined here so it is created and
/// pinned with the others.
#[map(name = "EGRESS_NAMES")]
pub(crate) static NAMES: HashMap<u64, PolicyName> = HashMap::pinned(MAX_CGROUPS, 0);

#[map(name = "EGRESS_INBOUND4")]
pub(crate) static INBOUND4: LpmTrie<Cidr4Data, CidrRule> = LpmTrie::pinned(MAX_CIDRS, 0);
#[map(name = "EGRESS_INBOUND6")]
pub(crate) static INBOUND6: LpmTrie<Cidr6Data, CidrRule> = LpmTrie::pinned(MAX_CIDRS, 0);

#[map(name = "EGRESS_ORIG_COOKIE")]
pub(crate) static ORIG_BY_COOKIE: LruHashMap<u64, OrigDst> = LruHashMap::pinned(MAX_REDIRECTS, 0);
#[map(name = "EGRESS_ORIG_TUPLE")]
pub(crate) static ORIG_BY_TUPLE: LruHashMap<ConnTuple, OrigDst> =
    LruHashMap::pinned(MAX_REDIRECTS, 0);
#[map(name = "EGRESS_DIRECT4")]
pub(crate) static DIRECT4: LruHashMap<Direct4Key, u64> = LruHashMap::pinned(MAX_REDIRECTS, 0);
#[map(name = "EGRESS_DIRECT6")]
pub(crate) static DIRECT6: LruHashMap<Direct6Key, u64> = LruHashMap::pinned(MAX_REDIRECTS, 0);

/// BTF definition of a pinned `BPF_MAP_TYPE_SK_STORAGE` map (aya-ebpf's `SkStorage` has no
/// pinning field). Field names and shapes follow libbpf's BTF map convention; the loader patches
/// the map in at load time, so the fields are never dereferenced.
#[repr(C)]
pub(crate) struct PinnedSkStorage<T> {
    r#type: *const [i32; 24], // BPF_MAP_TYPE_SK_STORAGE
    key: *const i32,
    value: *const T,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; 1], // BPF_F_NO_PREALLOC (required by sk_storage)
    pinning: *const [i32; 1],   // LIBBPF_PIN_BY_NAME
}

// SAFETY: placeholder pointers patched by the loader, never dereferenced from Rust.
unsafe impl<T> Sync for PinnedSkStorage<T> {}

impl<T> PinnedSkStorage<T> {
    pub(crate) const fn new() -> Self {
        PinnedSkStorage {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
            pinning: core::ptr::null(),
        }
    }

    /// The map pointer the sk_storage helpers take.
    #[inline(always)]
    pub(crate) fn as_ptr(&self) -> *mut core::ffi::c_void {
        core::ptr::from_ref(self).cast_mut().cast()
    }
}

/// Which policy entry a confined server socket belongs to: TCP listeners (tagged at listen()) and
/// UDP sockets (at creation), in the host's network namespace (see `peer.rs`).
#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "EGRESS_SOCK_OWNER")]
pub(crate) static SOCK_OWNER: PinnedSkStorage<SockOwner> = PinnedSkStorage::new();

// The literal map names above must match the shared constants the loader opens.
use egress_common::str_eq;
const _: () = assert!(str_eq(egress_common::maps::POLICIES, "EGRESS_POLICIES"));
const _: () = assert!(str_eq(egress_common::maps::CIDR4, "EGRESS_CIDR4"));
const _: () = assert!(str_eq(egress_common::maps::CIDR6, "EGRESS_CIDR6"));
const _: () = assert!(str_eq(egress_common::maps::COUNTERS, "EGRESS_COUNTERS"));
const _: () = assert!(str_eq(egress_common::maps::EVENTS, "EGRESS_EVENTS"));
const _: () = assert!(str_eq(egress_common::maps::CONFIG, "EGRESS_CONFIG"));
const _: () = assert!(str_eq(egress_common::maps::NAMES, "EGRESS_NAMES"));
const _: () = assert!(str_eq(egress_common::maps::INBOUND4, "EGRESS_INBOUND4"));
const _: () = assert!(str_eq(egress_common::maps::INBOUND6, "EGRESS_INBOUND6"));
const _: () = assert!(str_eq(egress_common::maps::SOCK_OWNER, "EGRESS_SOCK_OWNER"));
const _: () = assert!(str_eq(
    egress_common::maps::ORIG_BY_COOKIE,
    "EGRESS_ORIG_COOKIE"
));
const _: () = assert!(str_eq(
    egress_common::maps::ORIG_BY_TUPLE,
    "EGRESS_ORIG_TUPLE"
));
const _: () = assert!(str_eq(egress_common::maps::DIRECT4, "EGRESS_DIRECT4"));
const _: () = assert!(str_eq(egress_common::maps::DIRECT6, "EGRESS_DIRECT6"));
