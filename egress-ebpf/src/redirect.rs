//! Transparent interception and the agent's DNS: which connections and datagrams go to the
//! cgroup's own interception listeners instead of being refused, and what the kernel remembers
//! about where they were going (docs/architecture.md, "Transparent interception and DNS").
//!
//! - UDP and TCP to port 53 at any address → the DNS listeners (`POLICY_FLAG_DNS`). A UDP
//!   socket's original server is kept by socket cookie so `recvmsg` can put it back as the
//!   reply's source (resolvers drop answers from another address).
//! - TCP to a port of `redirect_ports` (`allow_ports`) that no rule allows directly → the
//!   transparent listener (`POLICY_FLAG_TRANSPARENT`). The original destination is kept by
//!   socket cookie until `sock_ops` sees the connection established and re-keys it by the
//!   4-tuple the proxy will see when it accepts.
//! - TCP to an address the agent's DNS answered for a name whose `allow_hosts` entry carries
//!   that port, until the answer's TTL ran out → allowed directly ([`direct4`], [`direct6`]).
use crate::maps::{DIRECT4, DIRECT6, ORIG_BY_COOKIE};
use crate::{AF_INET, AF_INET6};
use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use egress_common::{
    AGENT_HTTP_PORT, Direct4Key, Direct6Key, MAX_RULE_PORTS, MODE_ALLOWLIST, OrigDst,
    POLICY_FLAG_DNS, POLICY_FLAG_TRANSPARENT, PolicyEntry,
};

pub(crate) const DNS_PORT: u16 = 53;

/// The DNS listener (v4) for a connect/datagram to port 53, if the policy has one.
#[inline(always)]
pub(crate) fn dns4(p: &PolicyEntry, tcp: bool) -> Option<(u32, u16)> {
    if p.mode != MODE_ALLOWLIST || p.flags & POLICY_FLAG_DNS == 0 {
        return None;
    }
    let (addr, port) = if tcp {
        (p.dns_tcp4_addr, p.dns_tcp4_port)
    } else {
        (p.dns_udp4_addr, p.dns_udp4_port)
    };
    (port != 0).then_some((addr, port))
}

/// [`dns4`] for IPv6.
#[inline(always)]
pub(crate) fn dns6(p: &PolicyEntry, tcp: bool) -> Option<([u32; 4], u16)> {
    if p.mode != MODE_ALLOWLIST || p.flags & POLICY_FLAG_DNS == 0 {
        return None;
    }
    let (addr, port) = if tcp {
        (p.dns_tcp6_addr, p.dns_tcp6_port)
    } else {
        (p.dns_udp6_addr, p.dns_udp6_port)
    };
    (port != 0).then_some((addr, port))
}

/// Is `addr:port_be` (IPv4, network order) the cgroup's own DNS listener for UDP? Datagrams may
/// go there directly: a v4-mapped UDP socket that connect6 redirected there sends through the
/// IPv4 path with the listener's address, which runs sendmsg4 again (and the backstop) — and
/// the responder answers only allowed names, as for any port-53 datagram it gets.
#[inline(always)]
pub(crate) fn own_dns_udp4(p: &PolicyEntry, addr: u32, port_be: u16) -> bool {
    dns4(p, false).is_some_and(|(a, pt)| a == addr && pt == port_be)
}

/// [`own_dns_udp4`] for IPv6.
#[inline(always)]
pub(crate) fn own_dns_udp6(p: &PolicyEntry, addr: &[u32; 4], port_be: u16) -> bool {
    dns6(p, false).is_some_and(|(a, pt)| a == *addr && pt == port_be)
}

/// Is `port` (host order) one the transparent listener takes?
#[inline(always)]
fn redirected_port(p: &PolicyEntry, port: u16) -> bool {
    let mut i = 0;
    while i < MAX_RULE_PORTS {
        if (i as u16) < p.nredirect && p.redirect_ports[i] == port {
            return true;
        }
        i += 1;
    }
    false
}

/// The transparent listener (v4) for TCP to `addr:port` (network-order address, host-order
/// port), if the policy intercepts it: a port of `redirect_ports`, or the endpoint's own
/// address on [`AGENT_HTTP_PORT`] (`http://egress.internal/`, which the agent's DNS answers
/// with the endpoint's address).
#[inline(always)]
pub(crate) fn transparent4(p: &PolicyEntry, addr: u32, port: u16) -> Option<(u32, u16)> {
    (p.mode == MODE_ALLOWLIST
        && p.flags & POLICY_FLAG_TRANSPARENT != 0
        && p.transparent4_port != 0
        && (redirected_port(p, port)
            || (port == AGENT_HTTP_PORT && p.endpoint4_port != 0 && addr == p.endpoint4_addr)))
        .then_some((p.transparent4_addr, p.transparent4_port))
}

/// [`transparent4`] for IPv6.
#[inline(always)]
pub(crate) fn transparent6(p: &PolicyEntry, addr: &[u32; 4], port: u16) -> Option<([u32; 4], u16)> {
    (p.mode == MODE_ALLOWLIST
        && p.flags & POLICY_FLAG_TRANSPARENT != 0
        && p.transparent6_port != 0
        && (redirected_port(p, port)
            || (port == AGENT_HTTP_PORT && p.endpoint6_port != 0 && *addr == p.endpoint6_addr)))
        .then_some((p.transparent6_addr, p.transparent6_port))
}

/// Remember where the socket `cookie` was going (IPv4 `addr[0]`, network order; port host order).
/// A full map only evicts the least recently used entry (LRU): a connection whose entry is gone
/// gets no original destination and is refused by the proxy (fail closed).
#[inline(always)]
pub(crate) fn remember(cookie: u64, family: u32, addr: [u32; 4], port_be: u16) {
    let orig = OrigDst {
        addr,
        port: port_be,
        _pad: 0,
        family,
    };
    let _ = ORIG_BY_COOKIE.insert(&cookie, &orig, 0);
}

pub(crate) fn orig4(addr: u32) -> (u32, [u32; 4]) {
    (AF_INET, [addr, 0, 0, 0])
}

pub(crate) fn orig6(addr: [u32; 4]) -> (u32, [u32; 4]) {
    (AF_INET6, addr)
}

#[inline(always)]
fn unexpired(expiry: Option<&u64>) -> bool {
    // SAFETY: helper without arguments.
    expiry.is_some_and(|e| *e > unsafe { bpf_ktime_get_ns() })
}

/// Did the agent's DNS answer `addr` to this entry for a name that allows `port` directly, and
/// is that answer still valid?
#[inline(always)]
pub(crate) fn direct4(entry_id: u64, addr: u32, port: u16) -> bool {
    let key = Direct4Key {
        entry_id,
        addr,
        port,
        _pad: 0,
    };
    // SAFETY: the value is copied out right away.
    unexpired(unsafe { DIRECT4.get(&key) })
}

/// [`direct4`] for IPv6.
#[inline(always)]
pub(crate) fn direct6(entry_id: u64, addr: [u32; 4], port: u16) -> bool {
    let key = Direct6Key {
        entry_id,
        addr,
        port,
        _pad: [0; 3],
    };
    // SAFETY: the value is copied out right away.
    unexpired(unsafe { DIRECT6.get(&key) })
}
