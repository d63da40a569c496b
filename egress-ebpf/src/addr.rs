//! Address classification: loopback, v4-mapped, CIDR rules, and the destination check shared
//! by every hook.

use crate::maps::{CIDR4, CIDR6, CONFIG, INBOUND4, INBOUND6};
use crate::{IPPROTO_IP, IPPROTO_TCP, IPPROTO_UDP, SOCK_DGRAM, SOCK_STREAM};
use aya_ebpf::maps::LpmTrie;
use aya_ebpf::maps::lpm_trie::Key;
use egress_common::{
    CIDR_ALLOW, CIDR_DENY, CIDR_ID_BITS, Cidr4Data, Cidr6Data, CidrRule, MAX_RULE_PORTS,
    MODE_ALLOWLIST, PROTO_BIT_TCP, PROTO_BIT_UDP, PolicyEntry, REASON_DENY_CIDR,
    REASON_HOST_LOOPBACK, REASON_NOT_ALLOWED,
};

/// Docker's embedded resolver (user-defined networks) lives on the container's own loopback but
/// forwards to the host's resolvers: reaching it is DNS tunnelling (docs/threat-model.md item 3),
/// so it is not part of "own-netns loopback".
const DOCKER_DNS: [u8; 4] = [127, 0, 0, 11];

/// Is the socket in the host network namespace? Unknown host cookie (0) = yes (fail closed).
#[inline(always)]
pub(crate) fn in_host_netns(netns_cookie: u64) -> bool {
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
pub(crate) fn unmap_v4(a: &[u32; 4]) -> Option<u32> {
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

/// `::1` only.
#[inline(always)]
fn is_loopback6(a: &[u32; 4]) -> bool {
    a[0] == 0 && a[1] == 0 && a[2] == 0 && u32::from_be(a[3]) == 1
}

pub(crate) enum CidrVerdict {
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
fn lpm4(
    trie: &LpmTrie<Cidr4Data, CidrRule>,
    rules_id: u64,
    addr_be: u32,
    proto_bit: u32,
    port: u16,
) -> CidrVerdict {
    let key = Key::new(CIDR_ID_BITS + 32, Cidr4Data::new(rules_id, addr_be));
    match trie.get(&key) {
        Some(rule) => rule_verdict(rule, proto_bit, port),
        None => CidrVerdict::NoMatch,
    }
}

#[inline(always)]
fn lpm6(
    trie: &LpmTrie<Cidr6Data, CidrRule>,
    rules_id: u64,
    addr_be: &[u32; 4],
    proto_bit: u32,
    port: u16,
) -> CidrVerdict {
    let key = Key::new(CIDR_ID_BITS + 128, Cidr6Data::new(rules_id, *addr_be));
    match trie.get(&key) {
        Some(rule) => rule_verdict(rule, proto_bit, port),
        None => CidrVerdict::NoMatch,
    }
}

/// Transport of a sock_addr context: Some(PROTO_BIT_*) for kernel TCP/UDP, None otherwise.
#[inline(always)]
pub(crate) fn proto_bit(sock_type: u32, protocol: u32) -> Option<(u32, u32)> {
    match (sock_type, protocol) {
        (SOCK_STREAM, IPPROTO_TCP | IPPROTO_IP) => Some((PROTO_BIT_TCP, IPPROTO_TCP)),
        (SOCK_DGRAM, IPPROTO_UDP | IPPROTO_IP) => Some((PROTO_BIT_UDP, IPPROTO_UDP)),
        _ => None,
    }
}

/// An address as the CIDR and loopback checks see it (network order).
pub(crate) trait DstAddr {
    /// `allow_cidrs` rules of the entry for this destination.
    fn cidr(&self, rules_id: u64, proto_bit: u32, port: u16) -> CidrVerdict;
    /// Inbound allows of the entry for this peer connecting to local `port`.
    fn inbound(&self, rules_id: u64, port: u16) -> CidrVerdict;
    /// Loopback or unspecified (connect() to "any" reaches the local host).
    fn is_local(&self) -> bool;
    /// Loopback proper (127.0.0.0/8, ::1).
    fn is_loopback(&self) -> bool;
    /// Docker's embedded resolver (127.0.0.11), which forwards to the host's resolvers.
    fn is_docker_dns(&self) -> bool;
}

impl DstAddr for u32 {
    #[inline(always)]
    fn cidr(&self, rules_id: u64, proto_bit: u32, port: u16) -> CidrVerdict {
        lpm4(&CIDR4, rules_id, *self, proto_bit, port)
    }
    #[inline(always)]
    fn inbound(&self, rules_id: u64, port: u16) -> CidrVerdict {
        lpm4(&INBOUND4, rules_id, *self, PROTO_BIT_TCP, port)
    }
    #[inline(always)]
    fn is_local(&self) -> bool {
        is_local4(*self)
    }
    #[inline(always)]
    fn is_loopback(&self) -> bool {
        self.to_ne_bytes()[0] == 127
    }
    #[inline(always)]
    fn is_docker_dns(&self) -> bool {
        is_docker_dns(*self)
    }
}

impl DstAddr for [u32; 4] {
    #[inline(always)]
    fn cidr(&self, rules_id: u64, proto_bit: u32, port: u16) -> CidrVerdict {
        lpm6(&CIDR6, rules_id, self, proto_bit, port)
    }
    #[inline(always)]
    fn inbound(&self, rules_id: u64, port: u16) -> CidrVerdict {
        lpm6(&INBOUND6, rules_id, self, PROTO_BIT_TCP, port)
    }
    #[inline(always)]
    fn is_local(&self) -> bool {
        is_local6(self)
    }
    #[inline(always)]
    fn is_loopback(&self) -> bool {
        is_loopback6(self)
    }
    #[inline(always)]
    fn is_docker_dns(&self) -> bool {
        false
    }
}

/// Verdict for a destination that is not the proxy endpoint (v4-mapped IPv6 already unmapped):
/// CIDR rules, then loopback — the socket's own network namespace's, or, in the host's
/// namespace, a server of the same confined tree (`same_tree`, asked only then: it costs a socket
/// lookup). Returns the denial reason on refusal.
#[inline(always)]
pub(crate) fn check(
    p: &PolicyEntry,
    addr: &impl DstAddr,
    bit: u32,
    port: u16,
    netns_cookie: impl Fn() -> u64,
    same_tree: impl Fn() -> bool,
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
        if !in_host_netns(netns_cookie()) {
            return Ok(());
        }
        if addr.is_loopback() && same_tree() {
            return Ok(());
        }
        return Err(REASON_HOST_LOOPBACK);
    }
    Err(REASON_NOT_ALLOWED)
}
