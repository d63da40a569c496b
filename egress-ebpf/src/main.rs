//! Kernel side of egress-agent: confine the sockets of cgroups under an enforcement root.
//!
//! Attachment model (docs/architecture.md): every program is attached once to an enforcement root
//! cgroup (`<cgroup2>/egress-agent`, the Docker cgroup parent, ...); children inherit it from their
//! first instruction. Each program finds the policy of the calling cgroup in [`POLICIES`] by walking
//! its ancestors from the deepest level up, nearest entry wins. A cgroup under a root with no
//! entry at any level is treated as `deny_all` (fail closed). Every entry point is thin:
//! `match try_x(..) { Ok(v) => v, Err(_) => DENY }`, so any unexpected failure denies.
//!
//! Hooks and why (kernel source permalinks at v6.18):
//! - `cgroup/connect4`, `cgroup/connect6` (4.17): the only place a TCP connect (incl. TCP Fast
//!   Open `sendto(MSG_FASTOPEN)`, which goes through `__inet_stream_connect` → `pre_connect`, and
//!   io_uring `IORING_OP_CONNECT`, which calls `__sys_connect_file`) and a UDP connect can be
//!   refused with EPERM and the proxy endpoint rewritten to the cgroup's own listener.
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/af_inet.c (`__inet_stream_connect` → `pre_connect`)
//! - `cgroup/sendmsg4`, `cgroup/sendmsg6` (4.18): unconnected UDP `sendto`/`sendmsg` (connected
//!   UDP skips them, hence the UDP checks in connect4/6).
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/udp.c (`udp_sendmsg`)
//! - `cgroup_skb/egress` (4.10): packet-level backstop for anything the socket hooks did not see.
//!   Kernel TCP sockets pass (their connect was vetted, or they are accepted/request/timewait
//!   sockets of a server in the cgroup answering a client: SYN-ACKs must not be dropped).
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/ip_output.c (`ip_finish_output`)
//! - `cgroup/sock_create` (4.10): refuse raw/SCTP/MPTCP/ping inet sockets at creation. It only sees
//!   AF_INET/AF_INET6, so AF_PACKET needs the LSM hook below.
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/af_inet.c (`inet_create`)
//! - BPF-LSM `socket_create` attached with `BPF_LSM_CGROUP` (6.0): every socket family, so
//!   AF_PACKET, AF_XDP, vsock, ... are refused for tasks in the cgroup.
//!   https://github.com/torvalds/linux/blob/v6.18/net/socket.c (`__sock_create` → `security_socket_create`)
//!
//! Network namespace: loopback (and 0.0.0.0/::, which the kernel connects to loopback) is allowed
//! only when the socket's netns is not the host's. The host netns cookie is written by the loader
//! into [`CONFIG`]; `bpf_get_netns_cookie` exists for sock_addr and sock programs since 5.7 and
//! for cgroup_skb since 6.15 (checked by the verifier at load on this 6.18 kernel).
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, bpf_sock, bpf_sock_addr},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_netns_cookie,
            bpf_ktime_get_ns, bpf_sk_fullsock, bpf_skb_ancestor_cgroup_id, bpf_skb_cgroup_id,
        },
    },
    macros::{cgroup_skb, cgroup_sock, cgroup_sock_addr, lsm_cgroup, map},
    maps::{Array, HashMap, LpmTrie, PerCpuHashMap, RingBuf, lpm_trie::Key},
    programs::{LsmContext, SkBuffContext, SockAddrContext, SockContext},
};
use egress_common::{
    CIDR_ALLOW, CIDR_DENY, CIDR_ID_BITS, Cidr4Data, Cidr6Data, CidrRule, Counters, EVENTS_BYTES,
    Event, GlobalConfig, HOOK_CONNECT4, HOOK_CONNECT6, HOOK_LSM_SOCKET_CREATE, HOOK_SENDMSG4,
    HOOK_SENDMSG6, HOOK_SKB_EGRESS, HOOK_SOCK_CREATE, MAX_CGROUP_DEPTH, MAX_CGROUPS, MAX_CIDRS,
    MAX_RULE_PORTS, MODE_ALLOW_ALL, MODE_ALLOWLIST, POLICY_FLAG_V6, PROTO_BIT_TCP, PROTO_BIT_UDP,
    PolicyEntry, PolicyName, REASON_DENY_CIDR, REASON_HOST_LOOPBACK, REASON_NO_LISTENER,
    REASON_NO_POLICY, REASON_NOT_ALLOWED, REASON_SOCKET_TYPE,
};

// Verdicts of cgroup programs and BPF_LSM_CGROUP programs: 1 = allow, 0 = deny (EPERM / drop).
const ALLOW: i32 = 1;
const DENY: i32 = 0;

const AF_UNIX: u32 = 1;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
const AF_NETLINK: u32 = 16;
const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const SOCK_TYPE_MASK: u32 = 0xf;
const IPPROTO_IP: u32 = 0;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;
/// Docker's embedded resolver (user-defined networks) lives on the container's own loopback but
/// forwards to the host's resolvers: reaching it is DNS tunnelling (threats.md 3), so it is not
/// part of "own-netns loopback".
const DOCKER_DNS: [u8; 4] = [127, 0, 0, 11];

#[map(name = "EGRESS_POLICIES")]
static POLICIES: HashMap<u64, PolicyEntry> = HashMap::pinned(MAX_CGROUPS, 0);
#[map(name = "EGRESS_CIDR4")]
static CIDR4: LpmTrie<Cidr4Data, CidrRule> = LpmTrie::pinned(MAX_CIDRS, 0);
#[map(name = "EGRESS_CIDR6")]
static CIDR6: LpmTrie<Cidr6Data, CidrRule> = LpmTrie::pinned(MAX_CIDRS, 0);
#[map(name = "EGRESS_COUNTERS")]
static COUNTERS: PerCpuHashMap<u64, Counters> = PerCpuHashMap::pinned(MAX_CGROUPS, 0);
#[map(name = "EGRESS_EVENTS")]
static EVENTS: RingBuf = RingBuf::pinned(EVENTS_BYTES, 0);
#[map(name = "EGRESS_CONFIG")]
static CONFIG: Array<GlobalConfig> = Array::pinned(1, 0);
/// User-space bookkeeping only (policy names for `status`); defined here so it is created and
/// pinned with the others.
#[map(name = "EGRESS_NAMES")]
static NAMES: HashMap<u64, PolicyName> = HashMap::pinned(MAX_CGROUPS, 0);

// The literal map names above must match the shared constants the loader opens.
const fn str_eq(a: &str, b: &str) -> bool {
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
const _: () = assert!(str_eq(egress_common::maps::POLICIES, "EGRESS_POLICIES"));
const _: () = assert!(str_eq(egress_common::maps::CIDR4, "EGRESS_CIDR4"));
const _: () = assert!(str_eq(egress_common::maps::CIDR6, "EGRESS_CIDR6"));
const _: () = assert!(str_eq(egress_common::maps::COUNTERS, "EGRESS_COUNTERS"));
const _: () = assert!(str_eq(egress_common::maps::EVENTS, "EGRESS_EVENTS"));
const _: () = assert!(str_eq(egress_common::maps::CONFIG, "EGRESS_CONFIG"));
const _: () = assert!(str_eq(egress_common::maps::NAMES, "EGRESS_NAMES"));

// ---------------------------------------------------------------------------------------------
// Policy lookup: ancestor walk, nearest entry wins.

/// The policy found for a cgroup: the entry and the id of the cgroup it is keyed by.
struct Found {
    cgroup_id: u64,
    entry: *const PolicyEntry,
}

/// Walk ancestors of a cgroup given `ancestor(level)` (0 when `level` is deeper than the cgroup).
/// A binary search finds the cgroup's own level (5 helper calls for 32 levels), then the walk goes
/// up from there: the first entry found is the nearest one.
#[inline(always)]
fn find_policy(ancestor: impl Fn(i32) -> u64) -> Result<Found, u64> {
    // Deepest level with a non-zero ancestor id, in [0, MAX_CGROUP_DEPTH).
    let mut lo: i32 = 0;
    let mut hi: i32 = MAX_CGROUP_DEPTH as i32 - 1;
    for _ in 0..6 {
        if lo >= hi {
            break;
        }
        let mid = (lo + hi + 1) / 2;
        if ancestor(mid) != 0 {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let own = ancestor(lo);
    let mut level = lo;
    for _ in 0..MAX_CGROUP_DEPTH {
        if level < 0 {
            break;
        }
        let id = ancestor(level);
        if id != 0
            && let Some(entry) = POLICIES.get_ptr(&id)
        {
            return Ok(Found {
                cgroup_id: id,
                entry,
            });
        }
        level -= 1;
    }
    Err(own)
}

#[inline(always)]
fn policy_of_current() -> Result<Found, u64> {
    // Fast path: the cgroup itself has the entry (exec-* cgroups, containers).
    // SAFETY: helper without arguments.
    let own = unsafe { bpf_get_current_cgroup_id() };
    if let Some(entry) = POLICIES.get_ptr(&own) {
        return Ok(Found {
            cgroup_id: own,
            entry,
        });
    }
    // SAFETY: helper without pointer arguments.
    find_policy(|level| unsafe { bpf_get_current_ancestor_cgroup_id(level) })
}

#[inline(always)]
fn policy_of_skb(skb: *mut __sk_buff) -> Result<Found, u64> {
    // SAFETY: `skb` is the program context.
    let own = unsafe { bpf_skb_cgroup_id(skb) };
    if let Some(entry) = POLICIES.get_ptr(&own) {
        return Ok(Found {
            cgroup_id: own,
            entry,
        });
    }
    // SAFETY: `skb` is the program context.
    find_policy(|level| unsafe { bpf_skb_ancestor_cgroup_id(skb, level) })
}

// ---------------------------------------------------------------------------------------------
// Counters and events.

const C_ALLOWED: u32 = 0;
const C_DENIED: u32 = 1;
const C_PROXIED: u32 = 2;
const C_LOST: u32 = 3;

#[inline(always)]
fn count(cgroup_id: u64, which: u32) {
    let mut ptr = COUNTERS.get_ptr_mut(&cgroup_id);
    if ptr.is_none() {
        // A full map only loses statistics, never a verdict.
        let _ = COUNTERS.insert(&cgroup_id, &Counters::default(), 1 /* BPF_NOEXIST */);
        ptr = COUNTERS.get_ptr_mut(&cgroup_id);
    }
    if let Some(c) = ptr {
        // SAFETY: per-CPU value, valid for the program's run; no concurrent writer on this CPU.
        unsafe {
            match which {
                C_ALLOWED => (*c).allowed += 1,
                C_DENIED => (*c).denied += 1,
                C_PROXIED => {
                    (*c).allowed += 1;
                    (*c).proxied += 1
                }
                _ => (*c).events_lost += 1,
            }
        }
    }
}

struct Dst {
    family: u32,
    protocol: u32,
    /// Host byte order.
    port: u16,
    addr: [u32; 4],
}

/// Count a denial and emit its event; returns the DENY verdict.
#[inline(always)]
fn deny(cgroup_id: u64, hook: u32, reason: u32, dst: &Dst, with_task: bool) -> i32 {
    count(cgroup_id, C_DENIED);
    let (pid, comm) = if with_task {
        (
            (bpf_get_current_pid_tgid() >> 32) as u32,
            bpf_get_current_comm().unwrap_or([0u8; 16]),
        )
    } else {
        (0, [0u8; 16])
    };
    let event = Event {
        // SAFETY: helper without arguments.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        cgroup_id,
        pid,
        hook,
        family: dst.family,
        protocol: dst.protocol,
        port: dst.port,
        _pad0: 0,
        reason,
        addr: dst.addr,
        comm,
    };
    if EVENTS.output::<Event>(&event, 0).is_err() {
        count(cgroup_id, C_LOST);
    }
    DENY
}

#[inline(always)]
fn allow(cgroup_id: u64) -> i32 {
    count(cgroup_id, C_ALLOWED);
    ALLOW
}

// ---------------------------------------------------------------------------------------------
// Address classification.

/// Is the socket in the host network namespace? Unknown host cookie (0) = yes (fail closed).
#[inline(always)]
fn in_host_netns(netns_cookie: u64) -> bool {
    match CONFIG.get(0) {
        Some(cfg) if cfg.host_netns_cookie != 0 => cfg.host_netns_cookie == netns_cookie,
        _ => true,
    }
}

/// 127.0.0.0/8 or 0.0.0.0 (connect() to INADDR_ANY reaches the local host).
#[inline(always)]
fn is_local4(addr_be: u32) -> bool {
    let b = addr_be.to_ne_bytes();
    b[0] == 127 || addr_be == 0
}

#[inline(always)]
fn is_docker_dns(addr_be: u32) -> bool {
    addr_be.to_ne_bytes() == DOCKER_DNS
}

/// `::ffff:a.b.c.d` → `Some(a.b.c.d)` (network order).
#[inline(always)]
fn unmap_v4(a: &[u32; 4]) -> Option<u32> {
    if a[0] == 0 && a[1] == 0 && u32::from_be(a[2]) == 0x0000_ffff {
        Some(a[3])
    } else {
        None
    }
}

/// `::1` or `::`.
#[inline(always)]
fn is_local6(a: &[u32; 4]) -> bool {
    a[0] == 0 && a[1] == 0 && a[2] == 0 && (a[3] == 0 || u32::from_be(a[3]) == 1)
}

enum CidrVerdict {
    Allow,
    Deny,
    NoMatch,
}

#[inline(always)]
fn rule_verdict(rule: &CidrRule, proto_bit: u32, port: u16) -> CidrVerdict {
    if rule.action == CIDR_DENY {
        return CidrVerdict::Deny;
    }
    if rule.action != CIDR_ALLOW || rule.protos & proto_bit == 0 {
        return CidrVerdict::NoMatch;
    }
    if rule.nports == 0 {
        return CidrVerdict::Allow;
    }
    let mut i = 0;
    while i < MAX_RULE_PORTS {
        if (i as u32) < rule.nports && rule.ports[i] == port {
            return CidrVerdict::Allow;
        }
        i += 1;
    }
    CidrVerdict::NoMatch
}

#[inline(always)]
fn cidr4(rules_id: u64, addr_be: u32, proto_bit: u32, port: u16) -> CidrVerdict {
    let key = Key::new(CIDR_ID_BITS + 32, Cidr4Data::new(rules_id, addr_be));
    match CIDR4.get(&key) {
        Some(rule) => rule_verdict(rule, proto_bit, port),
        None => CidrVerdict::NoMatch,
    }
}

#[inline(always)]
fn cidr6(rules_id: u64, addr_be: &[u32; 4], proto_bit: u32, port: u16) -> CidrVerdict {
    let key = Key::new(CIDR_ID_BITS + 128, Cidr6Data::new(rules_id, *addr_be));
    match CIDR6.get(&key) {
        Some(rule) => rule_verdict(rule, proto_bit, port),
        None => CidrVerdict::NoMatch,
    }
}

/// Transport of a sock_addr context: Some(PROTO_BIT_*) for kernel TCP/UDP, None otherwise.
#[inline(always)]
fn proto_bit(sock_type: u32, protocol: u32) -> Option<(u32, u32)> {
    match (sock_type, protocol) {
        (SOCK_STREAM, IPPROTO_TCP | IPPROTO_IP) => Some((PROTO_BIT_TCP, IPPROTO_TCP)),
        (SOCK_DGRAM, IPPROTO_UDP | IPPROTO_IP) => Some((PROTO_BIT_UDP, IPPROTO_UDP)),
        _ => None,
    }
}

/// A destination address as the CIDR and loopback checks see it (network order).
trait DstAddr {
    fn cidr(&self, rules_id: u64, proto_bit: u32, port: u16) -> CidrVerdict;
    fn is_local(&self) -> bool;
    /// Docker's embedded resolver (127.0.0.11), which forwards to the host's resolvers.
    fn is_docker_dns(&self) -> bool;
}

impl DstAddr for u32 {
    #[inline(always)]
    fn cidr(&self, rules_id: u64, proto_bit: u32, port: u16) -> CidrVerdict {
        cidr4(rules_id, *self, proto_bit, port)
    }
    #[inline(always)]
    fn is_local(&self) -> bool {
        is_local4(*self)
    }
    #[inline(always)]
    fn is_docker_dns(&self) -> bool {
        is_docker_dns(*self)
    }
}

impl DstAddr for [u32; 4] {
    #[inline(always)]
    fn cidr(&self, rules_id: u64, proto_bit: u32, port: u16) -> CidrVerdict {
        cidr6(rules_id, self, proto_bit, port)
    }
    #[inline(always)]
    fn is_local(&self) -> bool {
        is_local6(self)
    }
    #[inline(always)]
    fn is_docker_dns(&self) -> bool {
        false
    }
}

/// Verdict for a destination that is not the proxy endpoint (v4-mapped IPv6 already unmapped):
/// CIDR rules, then own-netns loopback. Returns the denial reason on refusal.
#[inline(always)]
fn check(
    p: &PolicyEntry,
    addr: &impl DstAddr,
    bit: u32,
    port: u16,
    netns_cookie: impl Fn() -> u64,
) -> Result<(), u32> {
    if p.mode == MODE_ALLOWLIST {
        match addr.cidr(p.rules_id, bit, port) {
            CidrVerdict::Allow => return Ok(()),
            CidrVerdict::Deny => return Err(REASON_DENY_CIDR),
            CidrVerdict::NoMatch => {}
        }
    }
    if addr.is_local() {
        if addr.is_docker_dns() {
            return Err(REASON_NOT_ALLOWED);
        }
        if in_host_netns(netns_cookie()) {
            return Err(REASON_HOST_LOOPBACK);
        }
        return Ok(());
    }
    Err(REASON_NOT_ALLOWED)
}

/// The proxy endpoint rule of connect4, connect6 and v4-mapped connect6 (allowlist, TCP): a
/// connect to the policy's endpoint is redirected to its listener (`rewrite`), one straight to
/// the listener passes, and with no listener the endpoint is refused. `None`: none of these,
/// go on with [`check`].
#[inline(always)]
fn endpoint_verdict<A: PartialEq>(
    (p, bit): (&PolicyEntry, u32),
    dst_addr: &A,
    port_be: u16,
    (endpoint, endpoint_port): (&A, u16),
    (listener, listener_port): (&A, u16),
    (cg, hook, dst): (u64, u32, &Dst),
    rewrite: impl FnOnce(),
) -> Option<i32> {
    if p.mode != MODE_ALLOWLIST || bit != PROTO_BIT_TCP {
        return None;
    }
    if dst_addr == endpoint && port_be == endpoint_port && endpoint_port != 0 {
        if listener_port == 0 {
            return Some(deny(cg, hook, REASON_NO_LISTENER, dst, true));
        }
        rewrite();
        count(cg, C_PROXIED);
        return Some(ALLOW);
    }
    if dst_addr == listener && port_be == listener_port && listener_port != 0 {
        return Some(allow(cg));
    }
    None
}

/// [`endpoint_verdict`] for the policy's IPv4 endpoint (connect4 and v4-mapped connect6).
#[inline(always)]
fn endpoint4_verdict(
    (p, bit): (&PolicyEntry, u32),
    dst_addr: u32,
    port_be: u16,
    who: (u64, u32, &Dst),
    rewrite: impl FnOnce(),
) -> Option<i32> {
    endpoint_verdict(
        (p, bit),
        &dst_addr,
        port_be,
        (&p.endpoint4_addr, p.endpoint4_port),
        (&p.listener4_addr, p.listener4_port),
        who,
        rewrite,
    )
}

/// The start shared by connect4 and connect6: the cgroup's policy (no entry: deny), `allow_all`,
/// and the socket kind (only kernel TCP/UDP). `Ok` = (cgroup id, policy entry, protocol bit,
/// protocol) to go on with; `Err` = the final verdict, already counted and reported.
#[inline(always)]
fn connect_policy(
    hook: u32,
    dst: &Dst,
    sock_type: u32,
    protocol: u32,
) -> Result<(u64, *const PolicyEntry, u32, u32), i32> {
    let found = policy_of_current().map_err(|own| deny(own, hook, REASON_NO_POLICY, dst, true))?;
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    let cg = found.cgroup_id;
    if p.mode == MODE_ALLOW_ALL {
        return Err(allow(cg));
    }
    let (bit, proto) = proto_bit(sock_type, protocol)
        .ok_or_else(|| deny(cg, hook, REASON_SOCKET_TYPE, dst, true))?;
    Ok((cg, found.entry, bit, proto))
}

#[cgroup_sock_addr(connect4)]
pub fn egress_connect4(ctx: SockAddrContext) -> i32 {
    match try_connect4(&ctx) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

fn try_connect4(ctx: &SockAddrContext) -> Result<i32, i32> {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: ctx fields readable in connect4 (4-byte loads); user_ip4/user_port writable.
    let (addr, port_be, sock_type, protocol) = unsafe {
        (
            (*sa).user_ip4,
            (*sa).user_port as u16,
            (*sa).type_,
            (*sa).protocol,
        )
    };
    let port = u16::from_be(port_be);
    let dst = |protocol| Dst {
        family: AF_INET,
        protocol,
        port,
        addr: [addr, 0, 0, 0],
    };
    let (cg, p, bit, proto) =
        match connect_policy(HOOK_CONNECT4, &dst(protocol), sock_type, protocol) {
            Ok(v) => v,
            Err(verdict) => return Ok(verdict),
        };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*p };
    let rewrite = || {
        // SAFETY: user_ip4 and user_port are writable in connect4.
        unsafe {
            (*sa).user_ip4 = p.listener4_addr;
            (*sa).user_port = p.listener4_port as u32;
        }
    };
    let who = (cg, HOOK_CONNECT4, &dst(proto));
    if let Some(verdict) = endpoint4_verdict((p, bit), addr, port_be, who, rewrite) {
        return Ok(verdict);
    }
    // SAFETY: ctx is a sock_addr context, for which bpf_get_netns_cookie is available (5.7).
    let cookie = || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    match check(p, &addr, bit, port, cookie) {
        Ok(()) => Ok(allow(cg)),
        Err(reason) => Ok(deny(cg, HOOK_CONNECT4, reason, &dst(proto), true)),
    }
}

#[cgroup_sock_addr(connect6)]
pub fn egress_connect6(ctx: SockAddrContext) -> i32 {
    match try_connect6(&ctx) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

fn try_connect6(ctx: &SockAddrContext) -> Result<i32, i32> {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: ctx fields readable in connect6.
    let (addr, port_be, sock_type, protocol) = unsafe {
        (
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ],
            (*sa).user_port as u16,
            (*sa).type_,
            (*sa).protocol,
        )
    };
    let port = u16::from_be(port_be);
    let dst = |protocol| Dst {
        family: AF_INET6,
        protocol,
        port,
        addr,
    };
    let (cg, p, bit, proto) =
        match connect_policy(HOOK_CONNECT6, &dst(protocol), sock_type, protocol) {
            Ok(v) => v,
            Err(verdict) => return Ok(verdict),
        };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*p };
    // SAFETY: sock_addr context (bpf_get_netns_cookie since 5.7).
    let cookie = || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };

    // IPv4-mapped: treated exactly as the IPv4 address it maps.
    if let Some(v4) = unmap_v4(&addr) {
        let rewrite = || {
            // SAFETY: user_ip6 and user_port are writable in connect6.
            unsafe {
                (*sa).user_ip6[3] = p.listener4_addr;
                (*sa).user_port = p.listener4_port as u32;
            }
        };
        let who = (cg, HOOK_CONNECT6, &dst(proto));
        if let Some(verdict) = endpoint4_verdict((p, bit), v4, port_be, who, rewrite) {
            return Ok(verdict);
        }
        return match check(p, &v4, bit, port, cookie) {
            Ok(()) => Ok(allow(cg)),
            Err(reason) => Ok(deny(cg, HOOK_CONNECT6, reason, &dst(proto), true)),
        };
    }

    if p.flags & POLICY_FLAG_V6 != 0
        && let Some(verdict) = endpoint_verdict(
            (p, bit),
            &addr,
            port_be,
            (&p.endpoint6_addr, p.endpoint6_port),
            (&p.listener6_addr, p.listener6_port),
            (cg, HOOK_CONNECT6, &dst(proto)),
            // SAFETY: user_ip6 and user_port are writable in connect6.
            || unsafe {
                (*sa).user_ip6[0] = p.listener6_addr[0];
                (*sa).user_ip6[1] = p.listener6_addr[1];
                (*sa).user_ip6[2] = p.listener6_addr[2];
                (*sa).user_ip6[3] = p.listener6_addr[3];
                (*sa).user_port = p.listener6_port as u32;
            },
        )
    {
        return Ok(verdict);
    }
    match check(p, &addr, bit, port, cookie) {
        Ok(()) => Ok(allow(cg)),
        Err(reason) => Ok(deny(cg, HOOK_CONNECT6, reason, &dst(proto), true)),
    }
}

// ---------------------------------------------------------------------------------------------
// cgroup/sendmsg4, cgroup/sendmsg6 (unconnected UDP)

#[cgroup_sock_addr(sendmsg4)]
pub fn egress_sendmsg4(ctx: SockAddrContext) -> i32 {
    match try_sendmsg(&ctx, false) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

#[cgroup_sock_addr(sendmsg6)]
pub fn egress_sendmsg6(ctx: SockAddrContext) -> i32 {
    match try_sendmsg(&ctx, true) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

#[inline(always)]
fn try_sendmsg(ctx: &SockAddrContext, v6: bool) -> Result<i32, i32> {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    let hook = if v6 { HOOK_SENDMSG6 } else { HOOK_SENDMSG4 };
    // SAFETY: ctx fields readable in sendmsg4/6 (user_ip6 only in sendmsg6).
    let (addr, port_be) = unsafe {
        if v6 {
            (
                [
                    (*sa).user_ip6[0],
                    (*sa).user_ip6[1],
                    (*sa).user_ip6[2],
                    (*sa).user_ip6[3],
                ],
                (*sa).user_port as u16,
            )
        } else {
            ([(*sa).user_ip4, 0, 0, 0], (*sa).user_port as u16)
        }
    };
    let port = u16::from_be(port_be);
    let dst = Dst {
        family: if v6 { AF_INET6 } else { AF_INET },
        protocol: IPPROTO_UDP,
        port,
        addr,
    };
    let found = match policy_of_current() {
        Ok(f) => f,
        Err(own) => return Ok(deny(own, hook, REASON_NO_POLICY, &dst, true)),
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    let cg = found.cgroup_id;
    if p.mode == MODE_ALLOW_ALL {
        return Ok(allow(cg));
    }
    // SAFETY: sock_addr context.
    let cookie = || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let verdict = if !v6 {
        check(p, &addr[0], PROTO_BIT_UDP, port, cookie)
    } else if let Some(v4) = unmap_v4(&addr) {
        check(p, &v4, PROTO_BIT_UDP, port, cookie)
    } else {
        check(p, &addr, PROTO_BIT_UDP, port, cookie)
    };
    match verdict {
        Ok(()) => Ok(allow(cg)),
        Err(reason) => Ok(deny(cg, hook, reason, &dst, true)),
    }
}

// ---------------------------------------------------------------------------------------------
// cgroup/sock_create (inet only) and LSM socket_create (every family)

/// Socket kinds a confined task may create: unix, netlink, and kernel TCP/UDP over IPv4/IPv6.
#[inline(always)]
fn socket_allowed(family: u32, sock_type: u32, protocol: u32) -> bool {
    match family {
        AF_UNIX | AF_NETLINK => true,
        AF_INET | AF_INET6 => proto_bit(sock_type & SOCK_TYPE_MASK, protocol).is_some(),
        _ => false,
    }
}

#[cgroup_sock(sock_create)]
pub fn egress_sock_create(ctx: SockContext) -> i32 {
    match try_sock_create(&ctx) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

fn try_sock_create(ctx: &SockContext) -> Result<i32, i32> {
    let sk: *mut bpf_sock = ctx.sock;
    // SAFETY: family/type/protocol are readable in sock_create.
    let (family, sock_type, protocol) = unsafe { ((*sk).family, (*sk).type_, (*sk).protocol) };
    // Allowed kinds need no policy: every mode permits them (not counted: creating a socket is
    // not an egress attempt). Only a refusal looks for allow_all.
    if socket_allowed(family, sock_type, protocol) {
        return Ok(ALLOW);
    }
    let dst = Dst {
        family,
        protocol: sock_type,
        port: 0,
        addr: [0; 4],
    };
    let found = match policy_of_current() {
        Ok(f) => f,
        Err(own) => return Ok(deny(own, HOOK_SOCK_CREATE, REASON_NO_POLICY, &dst, true)),
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    if p.mode == MODE_ALLOW_ALL {
        return Ok(ALLOW);
    }
    Ok(deny(
        found.cgroup_id,
        HOOK_SOCK_CREATE,
        REASON_SOCKET_TYPE,
        &dst,
        true,
    ))
}

/// `int security_socket_create(int family, int type, int protocol, int kern)`.
#[lsm_cgroup(hook = "socket_create")]
pub fn egress_lsm_socket_create(ctx: LsmContext) -> i32 {
    match try_lsm_socket_create(&ctx) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

fn try_lsm_socket_create(ctx: &LsmContext) -> Result<i32, i32> {
    let family: i32 = ctx.arg(0);
    let sock_type: i32 = ctx.arg(1);
    let protocol: i32 = ctx.arg(2);
    let kern: i32 = ctx.arg(3);
    if kern != 0 {
        // Kernel-internal sockets created on the task's behalf (e.g. by a filesystem).
        return Ok(ALLOW);
    }
    let (family, sock_type, protocol) = (family as u32, sock_type as u32, protocol as u32);
    if socket_allowed(family, sock_type, protocol) {
        return Ok(ALLOW);
    }
    let dst = Dst {
        family,
        protocol: sock_type,
        port: 0,
        addr: [0; 4],
    };
    let found = match policy_of_current() {
        Ok(f) => f,
        Err(own) => {
            return Ok(deny(
                own,
                HOOK_LSM_SOCKET_CREATE,
                REASON_NO_POLICY,
                &dst,
                true,
            ));
        }
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    if p.mode == MODE_ALLOW_ALL {
        return Ok(ALLOW);
    }
    Ok(deny(
        found.cgroup_id,
        HOOK_LSM_SOCKET_CREATE,
        REASON_SOCKET_TYPE,
        &dst,
        true,
    ))
}

// ---------------------------------------------------------------------------------------------
// cgroup_skb/egress backstop

#[cgroup_skb(egress)]
pub fn egress_skb(ctx: SkBuffContext) -> i32 {
    match try_skb(&ctx) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

fn try_skb(ctx: &SkBuffContext) -> Result<i32, i32> {
    let skb = ctx.skb.skb;
    // Kernel TCP first, without a policy lookup (the per-packet fast path).
    // SAFETY: `sk` of the skb context; may be NULL.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if !sk.is_null() {
        // SAFETY: bpf_sk_fullsock accepts a sock_common pointer and returns NULL for request and
        // timewait sockets.
        let full = unsafe { bpf_sk_fullsock(sk) };
        if full.is_null() {
            // Request (SYN-ACK of a server in the cgroup) or timewait socket: TCP replies.
            return Ok(ALLOW);
        }
        // SAFETY: full socket pointer from bpf_sk_fullsock.
        let (sock_type, protocol) = unsafe { ((*full).type_, (*full).protocol) };
        if sock_type == SOCK_STREAM && protocol == IPPROTO_TCP {
            // Kernel TCP: connect() was vetted by connect4/6 (TFO and io_uring included), accepted
            // sockets answer clients. Not counted per packet (connect already counted it).
            return Ok(ALLOW);
        }
    }
    // Policy of the socket's cgroup (the cgroup this program runs for), not of `current`.
    let found = match policy_of_skb(skb) {
        Ok(f) => f,
        Err(own) => {
            let dst = Dst {
                family: 0,
                protocol: 0,
                port: 0,
                addr: [0; 4],
            };
            return Ok(deny(own, HOOK_SKB_EGRESS, REASON_NO_POLICY, &dst, false));
        }
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    let cg = found.cgroup_id;
    if p.mode == MODE_ALLOW_ALL {
        return Ok(ALLOW);
    }
    // Anything else: check the packet's destination. The context starts at the IP header.
    // SAFETY: cgroup_skb context; bpf_get_netns_cookie is offered to cgroup_skb since 6.15.
    let cookie = || unsafe { bpf_get_netns_cookie(skb.cast()) };
    let first: u8 = ctx.load(0).map_err(|_| DENY)?;
    let (dst, verdict) = match first >> 4 {
        4 => {
            let ihl = ((first & 0x0f) as usize) * 4;
            let proto: u8 = ctx.load(9).map_err(|_| DENY)?;
            let daddr: u32 = ctx.load(16).map_err(|_| DENY)?;
            let mut port = 0u16;
            let verdict = if proto as u32 == IPPROTO_UDP && ihl >= 20 && ihl <= 60 {
                let dport: u16 = ctx.load(ihl + 2).map_err(|_| DENY)?;
                port = u16::from_be(dport);
                check(p, &daddr, PROTO_BIT_UDP, port, cookie)
            } else {
                Err(REASON_SOCKET_TYPE)
            };
            (
                Dst {
                    family: AF_INET,
                    protocol: proto as u32,
                    port,
                    addr: [daddr, 0, 0, 0],
                },
                verdict,
            )
        }
        6 => {
            let next: u8 = ctx.load(6).map_err(|_| DENY)?;
            let a: [u32; 4] = [
                ctx.load(24).map_err(|_| DENY)?,
                ctx.load(28).map_err(|_| DENY)?,
                ctx.load(32).map_err(|_| DENY)?,
                ctx.load(36).map_err(|_| DENY)?,
            ];
            let mut port = 0u16;
            let verdict = if next as u32 == IPPROTO_UDP {
                let dport: u16 = ctx.load(42).map_err(|_| DENY)?;
                port = u16::from_be(dport);
                check(p, &a, PROTO_BIT_UDP, port, cookie)
            } else {
                Err(REASON_SOCKET_TYPE)
            };
            (
                Dst {
                    family: AF_INET6,
                    protocol: next as u32,
                    port,
                    addr: a,
                },
                verdict,
            )
        }
        _ => (
            Dst {
                family: 0,
                protocol: 0,
                port: 0,
                addr: [0; 4],
            },
            Err(REASON_SOCKET_TYPE),
        ),
    };
    match verdict {
        Ok(()) => Ok(ALLOW),
        Err(reason) => Ok(deny(cg, HOOK_SKB_EGRESS, reason, &dst, false)),
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// GPL-compatible licence string: required by the kernel for BPF-LSM programs and GPL-only
/// helpers. The eBPF object is dual licensed; the rest of the project is Apache-2.0.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
