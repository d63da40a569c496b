//! Types shared by the kernel programs (`egress-ebpf`) and the loader (`egress-agent`).
//!
//! Every map key/value is `#[repr(C)]`, `Copy`, with explicit padding and no `bool`/`Option`/enum
//! fields, so both sides agree on the layout byte for byte. Addresses and ports that the kernel
//! compares against `struct bpf_sock_addr` fields are stored exactly as the kernel presents them
//! (network byte order, see each field); ports in the CIDR rules are host order.
#![no_std]

pub mod relay;

/// `a == b` in a `const` context: the eBPF objects assert at compile time that the literal
/// names of their maps (`export_name`) are the constants the loader opens.
pub const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Map names: the ELF symbol of each map in `egress-ebpf` and the file name of its pin under
/// `<bpffs>/maps/`.
pub mod maps {
    /// `HashMap<u64 cgroup id, PolicyEntry>`: the policy of an enforced cgroup.
    pub const POLICIES: &str = "EGRESS_POLICIES";
    /// `LpmTrie<Cidr4Data, CidrRule>`: IPv4 `allow_cidrs` / `deny_cidrs` per policy entry.
    pub const CIDR4: &str = "EGRESS_CIDR4";
    /// `LpmTrie<Cidr6Data, CidrRule>`: IPv6 `allow_cidrs` / `deny_cidrs` per policy entry.
    pub const CIDR6: &str = "EGRESS_CIDR6";
    /// `PerCpuHashMap<u64 cgroup id, Counters>`: allowed/denied totals (survive ring overflow).
    pub const COUNTERS: &str = "EGRESS_COUNTERS";
    /// `RingBuf` of [`crate::Event`]: one record per denial.
    pub const EVENTS: &str = "EGRESS_EVENTS";
    /// `Array<GlobalConfig>` with one element (index 0), written by the loader.
    pub const CONFIG: &str = "EGRESS_CONFIG";
    /// `HashMap<u64 cgroup id, PolicyName>`: user-space bookkeeping (policy and owner names for
    /// `status` and events); never read by the programs.
    pub const NAMES: &str = "EGRESS_NAMES";
    /// `LpmTrie<Cidr4Data, CidrRule>`: IPv4 inbound allows per policy entry — peers (key address)
    /// that may connect to the cgroup's listeners on `CidrRule::ports` (local ports; 0 = all).
    pub const INBOUND4: &str = "EGRESS_INBOUND4";
    /// `LpmTrie<Cidr6Data, CidrRule>`: IPv6 inbound allows (see [`INBOUND4`]).
    pub const INBOUND6: &str = "EGRESS_INBOUND6";
    /// `SkStorage<SockOwner>` (BTF map): the policy entry of confined server sockets in the host's
    /// network namespace — TCP listeners (written at listen()) and UDP sockets (at creation); read
    /// by connect4/6 and sendmsg4/6 when a server on the host's loopback is looked up.
    pub const SOCK_OWNER: &str = "EGRESS_SOCK_OWNER";

    /// `LruHashMap<u64 socket cookie, OrigDst>`: every TCP connection connect4/6 sent to one of
    /// the cgroup's own listeners, with its original destination (until it is established), or
    /// a redirected DNS datagram's (for recvmsg).
    pub const ORIG_BY_COOKIE: &str = "EGRESS_ORIG_COOKIE";
    /// `LruHashMap<ConnTuple, OrigDst>`: an established TCP connection that connect4/6 sent to
    /// one of the agent's listeners, written by sock_ops, read (and deleted) by the proxy when it
    /// accepts: the listener's admission (a connection without an entry came from no confined
    /// workload and is refused) and, for redirected ones, the original destination.
    pub const ORIG_BY_TUPLE: &str = "EGRESS_ORIG_TUPLE";
    /// `LruHashMap<Direct4Key, u64 expiry>`: direct TCP allowances from the agent's DNS answers
    /// (`bpf_ktime_get_ns` deadline).
    pub const DIRECT4: &str = "EGRESS_DIRECT4";
    /// `LruHashMap<Direct6Key, u64 expiry>` (a full map evicts the least recently used: that
    /// address is then reached through the transparent proxy again, or refused).
    pub const DIRECT6: &str = "EGRESS_DIRECT6";

    /// All maps, for pin bookkeeping.
    pub const ALL: [&str; 14] = [
        POLICIES,
        CIDR4,
        CIDR6,
        COUNTERS,
        EVENTS,
        CONFIG,
        NAMES,
        INBOUND4,
        INBOUND6,
        SOCK_OWNER,
        ORIG_BY_COOKIE,
        ORIG_BY_TUPLE,
        DIRECT4,
        DIRECT6,
    ];
}

/// Program names (the function names in `egress-ebpf`), also used as link pin names.
pub mod programs {
    pub const CONNECT4: &str = "egress_connect4";
    pub const CONNECT6: &str = "egress_connect6";
    pub const SENDMSG4: &str = "egress_sendmsg4";
    pub const SENDMSG6: &str = "egress_sendmsg6";
    pub const SKB_EGRESS: &str = "egress_skb";
    pub const SKB_INGRESS: &str = "egress_skb_ingress";
    pub const SOCK_CREATE: &str = "egress_sock_create";
    pub const RECVMSG4: &str = "egress_recvmsg4";
    pub const RECVMSG6: &str = "egress_recvmsg6";
    pub const SOCK_OPS: &str = "egress_sock_ops";
    pub const LSM_SOCKET_CREATE: &str = "egress_lsm_socket_create";

    /// Programs attached to every enforcement root (the LSM one is attached when available).
    pub const CGROUP: [&str; 10] = [
        CONNECT4,
        CONNECT6,
        SENDMSG4,
        SENDMSG6,
        SKB_EGRESS,
        SKB_INGRESS,
        SOCK_CREATE,
        RECVMSG4,
        RECVMSG6,
        SOCK_OPS,
    ];
}

/// Capacity of [`maps::POLICIES`] and [`maps::COUNTERS`].
pub const MAX_CGROUPS: u32 = 16_384;
/// Capacity of the original-destination maps and of each direct-allowance map.
pub const MAX_REDIRECTS: u32 = 65_536;
/// Capacity of each CIDR trie.
pub const MAX_CIDRS: u32 = 16_384;
/// Size of the denial ring buffer in bytes (power of two, multiple of the page size).
pub const EVENTS_BYTES: u32 = 256 * 1024;
/// How many cgroup levels the ancestor walk inspects (levels deeper than this are treated as
/// their ancestor at this depth; the loader refuses to enforce a cgroup deeper than this).
pub const MAX_CGROUP_DEPTH: u32 = 32;
/// Maximum number of ports one CIDR rule can list (zero listed ports = all ports).
pub const MAX_RULE_PORTS: usize = 30;

/// Policy modes (`PolicyEntry::mode`).
pub const MODE_DENY_ALL: u32 = 0;
pub const MODE_ALLOW_ALL: u32 = 1;
pub const MODE_ALLOWLIST: u32 = 2;

/// Hooks (`Event::hook`).
pub const HOOK_CONNECT4: u32 = 1;
pub const HOOK_CONNECT6: u32 = 2;
pub const HOOK_SENDMSG4: u32 = 3;
pub const HOOK_SENDMSG6: u32 = 4;
pub const HOOK_SKB_EGRESS: u32 = 5;
pub const HOOK_SOCK_CREATE: u32 = 6;
pub const HOOK_LSM_SOCKET_CREATE: u32 = 7;
/// `cgroup_skb/ingress`: a connection attempt into a confined cgroup's listening socket.
pub const HOOK_SKB_INGRESS: u32 = 8;

/// Why a denial happened (`Event::reason`).
pub const REASON_NOT_ALLOWED: u32 = 1;
/// No policy entry for the cgroup or any ancestor under the root (fail closed as deny_all).
pub const REASON_NO_POLICY: u32 = 2;
/// The policy proxies, but no listener port has been written yet (fail closed).
pub const REASON_NO_LISTENER: u32 = 3;
/// Socket family/type/protocol not allowed (raw, packet, SCTP, ...).
pub const REASON_SOCKET_TYPE: u32 = 4;
/// Destination is loopback/unspecified in the host network namespace.
pub const REASON_HOST_LOOPBACK: u32 = 5;
/// Matched a deny CIDR rule.
pub const REASON_DENY_CIDR: u32 = 6;
/// A peer outside the policy tried to connect to a listening socket of the cgroup (`Event::addr`
/// is the peer, `Event::port` the local port).
pub const REASON_INBOUND: u32 = 7;

/// The name of a kernel denial reason in events, metrics and `explain` (one vocabulary for the
/// kernel's `REASON_*` codes, shared by everything that reports or predicts them).
pub const fn reason_name(reason: u32) -> &'static str {
    match reason {
        REASON_NOT_ALLOWED => "kernel-destination-not-allowed",
        REASON_NO_POLICY => "kernel-no-policy-entry",
        REASON_NO_LISTENER => "kernel-proxy-not-running",
        REASON_SOCKET_TYPE => "kernel-socket-type-not-allowed",
        REASON_HOST_LOOPBACK => "kernel-host-loopback",
        REASON_DENY_CIDR => "kernel-deny-cidr",
        REASON_INBOUND => "kernel-inbound-not-allowed",
        _ => "kernel-denied",
    }
}

/// `PolicyEntry::flags`: the entry has an IPv6 proxy endpoint + listener.
pub const POLICY_FLAG_V6: u32 = 1;
/// `PolicyEntry::flags`: the policy audits (`enforce = "audit"`): what it would refuse is allowed
/// and reported with [`EVENT_FLAG_AUDIT`].
pub const POLICY_FLAG_AUDIT: u32 = 2;
/// `PolicyEntry::flags`: TCP to a port in `redirect_ports` goes to the transparent listener.
pub const POLICY_FLAG_TRANSPARENT: u32 = 4;
/// `PolicyEntry::flags`: UDP and TCP to port 53 at any address go to the DNS listeners.
pub const POLICY_FLAG_DNS: u32 = 8;

/// TCP to the proxy endpoint's own address on this port goes to the cgroup's transparent
/// listener (when it has one), whatever `allow_ports` says: `http://egress.internal/`, the name
/// the agent's DNS answers with the endpoint's address, is served there by the Host header.
pub const AGENT_HTTP_PORT: u16 = 80;

/// `Event::flags`: a would-deny — the
/// kernel allowed it because the policy audits.
pub const EVENT_FLAG_AUDIT: u16 = 1;
/// `Event` flags: an allowed direct connection (reported for audit policies only).
pub const EVENT_FLAG_ALLOWED: u16 = 2;

/// `CidrRule::action`.
pub const CIDR_ALLOW: u32 = 1;
pub const CIDR_DENY: u32 = 2;

/// `CidrRule::protos` bits.
pub const PROTO_BIT_TCP: u32 = 1;
pub const PROTO_BIT_UDP: u32 = 2;

/// Value of [`maps::POLICIES`]: the verdict inputs for one enforced cgroup.
///
/// `endpoint*` is the stable proxy address confined processes connect to; `listener*` is this
/// policy's own listener that connect4/6 rewrite it to. Addresses and ports are in network byte
/// order as in `struct bpf_sock_addr` (`user_ip4`, `user_ip6[4]`, `user_port` low 16 bits).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyEntry {
    /// One of `MODE_*`.
    pub mode: u32,
    /// `POLICY_FLAG_*`.
    pub flags: u32,
    /// Key prefix of this entry's rules in the CIDR tries (the cgroup id the entry was written for).
    pub rules_id: u64,
    pub endpoint4_addr: u32,
    pub listener4_addr: u32,
    pub endpoint4_port: u16,
    pub listener4_port: u16,
    pub endpoint6_port: u16,
    pub listener6_port: u16,
    pub endpoint6_addr: [u32; 4],
    pub listener6_addr: [u32; 4],
    /// Transparent interception and the agent's DNS ([`POLICY_FLAG_TRANSPARENT`],
    /// [`POLICY_FLAG_DNS`]): this cgroup's transparent TCP listener and DNS listeners (UDP, TCP),
    /// network byte order like the listener above; port 0 = none (that traffic stays refused).
    pub transparent4_addr: u32,
    pub dns_udp4_addr: u32,
    pub dns_tcp4_addr: u32,
    pub transparent4_port: u16,
    pub dns_udp4_port: u16,
    pub dns_tcp4_port: u16,
    /// Number of valid entries in `redirect_ports`.
    pub nredirect: u16,
    pub transparent6_addr: [u32; 4],
    pub dns_udp6_addr: [u32; 4],
    pub dns_tcp6_addr: [u32; 4],
    pub transparent6_port: u16,
    pub dns_udp6_port: u16,
    pub dns_tcp6_port: u16,
    pub _pad: u16,
    /// TCP destination ports redirected to the transparent listener (`allow_ports`), host order.
    pub redirect_ports: [u16; MAX_RULE_PORTS],
}

/// Data part of the IPv4 LPM key: `(rules_id, address)`; the prefix length covers the 64 bits
/// of `rules_id` plus the network prefix. Fields are u32 so the struct has no padding and sits
/// right after `prefix_len` as the kernel's `struct bpf_lpm_trie_key` requires.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr4Data {
    /// `rules_id.to_be()` split in two u32 halves, in memory order.
    pub id: [u32; 2],
    /// Network byte order.
    pub addr: u32,
}

/// Data part of the IPv6 LPM key (see [`Cidr4Data`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr6Data {
    pub id: [u32; 2],
    /// Network byte order, as `user_ip6`.
    pub addr: [u32; 4],
}

/// Bits of the LPM prefix taken by the rules id.
pub const CIDR_ID_BITS: u32 = 64;

impl Cidr4Data {
    pub const fn new(rules_id: u64, addr_be: u32) -> Self {
        Self {
            id: split_id(rules_id),
            addr: addr_be,
        }
    }
}

impl Cidr6Data {
    pub const fn new(rules_id: u64, addr_be: [u32; 4]) -> Self {
        Self {
            id: split_id(rules_id),
            addr: addr_be,
        }
    }
}

/// Split a rules id into the two key words (big-endian bytes so the trie compares it MSB first;
/// any fixed order works because the id is always fully covered by the prefix).
pub const fn split_id(id: u64) -> [u32; 2] {
    let b = id.to_be_bytes();
    [
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
    ]
}

/// Value of the CIDR tries. The longest matching prefix decides; the loader merges the ports of
/// less specific allow rules of the same policy into more specific ones, so the longest match is
/// the complete answer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CidrRule {
    /// `CIDR_ALLOW` or `CIDR_DENY`.
    pub action: u32,
    /// `PROTO_BIT_*`: which transports the rule allows.
    pub protos: u32,
    /// Number of valid entries in `ports`; 0 = every port.
    pub nports: u32,
    /// Host byte order.
    pub ports: [u16; MAX_RULE_PORTS],
}

impl Default for CidrRule {
    fn default() -> Self {
        Self {
            action: CIDR_DENY,
            protos: 0,
            nports: 0,
            ports: [0; MAX_RULE_PORTS],
        }
    }
}

/// Key of [`maps::ORIG_BY_TUPLE`]: a redirected TCP connection as the proxy sees it when it
/// accepts — the client's address and port, and the listener's — in network byte order (IPv4 in
/// `[0]`, the rest 0; v4-mapped IPv6 is stored as IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnTuple {
    pub client_addr: [u32; 4],
    pub listener_addr: [u32; 4],
    pub client_port: u16,
    pub listener_port: u16,
    /// AF_INET / AF_INET6 of the addresses.
    pub family: u32,
}

/// Where a redirected connection or datagram was going ([`maps::ORIG_BY_COOKIE`],
/// [`maps::ORIG_BY_TUPLE`]): network byte order, IPv4 in `addr[0]`. A connection to the explicit
/// listener (the proxy endpoint, or the listener itself) has family [`ORIG_NONE`]: admitted, with
/// no original destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrigDst {
    pub addr: [u32; 4],
    pub port: u16,
    pub _pad: u16,
    /// AF_INET / AF_INET6, or [`ORIG_NONE`].
    pub family: u32,
}

/// [`OrigDst::family`] of a connection sent to the explicit listener: the kernel vouches for
/// where it came from, but it was going to the proxy itself.
pub const ORIG_NONE: u32 = 0;

/// Key of [`maps::DIRECT4`]: an address the agent's DNS answered to this entry, for a port of
/// an `allow_hosts` entry (network byte order, port host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Direct4Key {
    pub entry_id: u64,
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
}

/// Key of [`maps::DIRECT6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Direct6Key {
    pub entry_id: u64,
    pub addr: [u32; 4],
    pub port: u16,
    pub _pad: [u16; 3],
}

/// Value of [`maps::SOCK_OWNER`]: the cgroup id of the policy entry (the nearest ancestor with an
/// entry) of the task that created the UDP socket or made the TCP socket listen. Two sockets with the same owner belong to the same
/// confined tree (one `exec` command and its children, or one container).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockOwner {
    pub entry_id: u64,
}

/// Per-cgroup counters (per CPU in the map; the reader sums).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub allowed: u64,
    pub denied: u64,
    /// Connections rewritten from the proxy endpoint to the policy listener (also in `allowed`).
    pub proxied: u64,
    /// Denials whose event could not be written because the ring buffer was full.
    pub events_lost: u64,
}

/// Global loader-written settings ([`maps::CONFIG`] index 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalConfig {
    /// Network namespace cookie of the host namespace (the loader's). 0 = unknown: every socket
    /// is then treated as being in the host namespace (loopback denied), which fails closed.
    pub host_netns_cookie: u64,
    /// Reserved.
    pub flags: u64,
}

/// Value of [`maps::NAMES`]: NUL-padded UTF-8 `policy` and `owner` (e.g. `exec:<pid>`, a
/// container name).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyName {
    pub policy: [u8; 64],
    pub owner: [u8; 64],
}

/// One denial, written to [`maps::EVENTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC).
    pub ktime_ns: u64,
    /// Cgroup the verdict was taken for (the entry's cgroup, or the current cgroup if none).
    pub cgroup_id: u64,
    /// Thread-group id (0 in packet context, where it is not known).
    pub pid: u32,
    /// `HOOK_*`.
    pub hook: u32,
    /// AF_INET / AF_INET6 / other family number.
    pub family: u32,
    /// IPPROTO_* (or the socket type for socket-creation denials).
    pub protocol: u32,
    /// Destination port, host byte order.
    pub port: u16,
    /// `EVENT_FLAG_*` (0: a denial).
    pub flags: u16,
    /// `REASON_*`.
    pub reason: u32,
    /// Destination address in network byte order; IPv4 in `addr[0]`.
    pub addr: [u32; 4],
    /// Task command name (NUL padded).
    pub comm: [u8; 16],
    /// The cgroup of the task that made the call (0 in packet context): which container of a
    /// pod, whose entry is the pod's. Last, so a reader can still take the shorter events of an
    /// older program ([`EVENT_LEN_V1`] bytes) until the upgrade swaps it.
    pub task_cgroup_id: u64,
}

/// The length of an [`Event`] before `task_cgroup_id` was added.
pub const EVENT_LEN_V1: usize = 72;

#[cfg(feature = "user")]
mod user {
    //! `aya::Pod` impls: all types are `repr(C)`, `Copy`, with no padding and no invalid bit
    //! patterns, which is what `Pod` requires.
    use super::*;
    unsafe impl aya::Pod for PolicyEntry {}
    unsafe impl aya::Pod for Cidr4Data {}
    unsafe impl aya::Pod for Cidr6Data {}
    unsafe impl aya::Pod for CidrRule {}
    unsafe impl aya::Pod for Counters {}
    unsafe impl aya::Pod for GlobalConfig {}
    unsafe impl aya::Pod for Event {}
    unsafe impl aya::Pod for PolicyName {}
    unsafe impl aya::Pod for SockOwner {}
    unsafe impl aya::Pod for ConnTuple {}
    unsafe impl aya::Pod for OrigDst {}
    unsafe impl aya::Pod for Direct4Key {}
    unsafe impl aya::Pod for Direct6Key {}
}

// Layout guards: a change here must be a deliberate change on both sides.
const _: () = assert!(core::mem::size_of::<PolicyEntry>() == 200);
const _: () = assert!(core::mem::size_of::<ConnTuple>() == 40);
const _: () = assert!(core::mem::size_of::<OrigDst>() == 24);
const _: () = assert!(core::mem::size_of::<Direct4Key>() == 16);
const _: () = assert!(core::mem::size_of::<Direct6Key>() == 32);
const _: () = assert!(core::mem::size_of::<Cidr4Data>() == 12);
const _: () = assert!(core::mem::size_of::<Cidr6Data>() == 24);
const _: () = assert!(core::mem::size_of::<CidrRule>() == 12 + 2 * MAX_RULE_PORTS);
const _: () = assert!(core::mem::size_of::<Counters>() == 32);
const _: () = assert!(core::mem::size_of::<Event>() == EVENT_LEN_V1 + 8);
const _: () = assert!(core::mem::size_of::<SockOwner>() == 8);
