//! `cgroup_skb/ingress`: inbound connections are policy too.
//!
//! A confined process that listens needs no `connect()` to leak: a peer outside the policy
//! connects in and the process writes its data on the accepted socket (`python3 -m http.server`).
//! So a packet reaching a confined cgroup's *listening* TCP socket (a SYN, or a syncookie ACK) is
//! dropped unless its source is allowed: the socket's own network namespace's loopback (a
//! container talking to itself), an inbound allow of the entry (`allow_inbound`, `allow_cidrs`
//! entries without ports, a container's published ports — compiled into
//! [`crate::maps::INBOUND4`]/[`crate::maps::INBOUND6`] by the loader), or, in the host's network
//! namespace, a client socket on the host's loopback that belongs to the same confined tree (an
//! `exec` command's test suite talking to the server it started; see [`crate::peer`]). Dropping
//! the SYN means no connection is ever accepted, so not a byte goes back; the client sees a
//! timeout, the denial is an event (`REASON_INBOUND`: peer address, local port).
//!
//! Everything else passes at once, before any lookup: established sockets (their connect was
//! vetted by connect4/6, or they were accepted from an allowed peer), UDP (a UDP server's replies
//! are vetted by sendmsg4/6 and the egress backstop, like any datagram).
//! https://github.com/torvalds/linux/blob/v6.18/net/ipv4/tcp_ipv4.c (`tcp_v4_rcv` → `tcp_filter`)

use crate::addr::{CidrVerdict, DstAddr, in_host_netns};
use crate::peer::{By, owner_v4, owner_v6};
use crate::policy::policy_of_skb;
use crate::report::{Dst, deny, refuse};
use crate::skb::Packet;
use crate::{AF_INET, ALLOW, DENY, IPPROTO_TCP, SOCK_STREAM};
use aya_ebpf::helpers::generated::{bpf_get_netns_cookie, bpf_sk_fullsock};
use aya_ebpf::macros::cgroup_skb;
use aya_ebpf::programs::SkBuffContext;
use egress_common::{HOOK_SKB_INGRESS, MODE_ALLOW_ALL, REASON_INBOUND, REASON_NO_POLICY};

/// `TCP_LISTEN` (include/net/tcp_states.h).
const TCP_LISTEN: u32 = 10;

#[cgroup_skb(ingress)]
pub fn egress_skb_ingress(ctx: SkBuffContext) -> i32 {
    match try_ingress(&ctx) {
        Ok(v) => v,
        Err(_) => DENY,
    }
}

fn try_ingress(ctx: &SkBuffContext) -> Result<i32, i32> {
    let skb = ctx.skb.skb;
    // SAFETY: `sk` of the skb context: the receiving socket (set by the cgroup ingress hook).
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return Err(DENY);
    }
    // SAFETY: bpf_sk_fullsock accepts a sock_common pointer (NULL for request/timewait socks,
    // which are not listeners).
    let full = unsafe { bpf_sk_fullsock(sk) };
    if full.is_null() {
        return Ok(ALLOW);
    }
    // SAFETY: full socket pointer from bpf_sk_fullsock.
    let (sock_type, protocol, state) = unsafe { ((*full).type_, (*full).protocol, (*full).state) };
    if sock_type != SOCK_STREAM || protocol != IPPROTO_TCP || state != TCP_LISTEN {
        return Ok(ALLOW);
    }
    let pkt = Packet::parse(ctx)?;
    let found = match policy_of_skb(skb) {
        Ok(f) => f,
        Err(own) => {
            let dst = Dst {
                family: pkt.family,
                protocol: IPPROTO_TCP,
                port: 0,
                addr: pkt.saddr,
            };
            return Ok(deny(own, HOOK_SKB_INGRESS, REASON_NO_POLICY, &dst, false));
        }
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    let cg = found.cgroup_id;
    if p.mode == MODE_ALLOW_ALL {
        return Ok(ALLOW);
    }
    let at = match pkt.l4 {
        Some(at) if pkt.proto as u32 == IPPROTO_TCP => at,
        // A listener's packet that is not plain TCP right after the IP header (IPv6 extension
        // headers): its peer can't be checked, so it is refused.
        _ => return Err(DENY),
    };
    let (sport, dport) = pkt.ports(ctx, at)?;
    let local_port = u16::from_be(dport);
    let allowed = if pkt.family == AF_INET {
        let peer = pkt.saddr[0];
        allowed_peer(
            ctx,
            cg,
            &peer,
            local_port,
            || {
                owner_v4(
                    skb.cast(),
                    (false, By::Cgroup),
                    (pkt.daddr[0], dport),
                    (peer, sport),
                )
            },
            p.rules_id,
        )
    } else {
        let peer = pkt.saddr;
        allowed_peer(
            ctx,
            cg,
            &peer,
            local_port,
            || {
                owner_v6(
                    skb.cast(),
                    (false, By::Cgroup),
                    (pkt.daddr, dport),
                    (peer, sport),
                )
            },
            p.rules_id,
        )
    };
    if allowed {
        return Ok(ALLOW);
    }
    let dst = Dst {
        family: pkt.family,
        protocol: IPPROTO_TCP,
        port: local_port,
        addr: pkt.saddr,
    };
    Ok(refuse(p, cg, HOOK_SKB_INGRESS, REASON_INBOUND, &dst, false))
}

/// May `peer` connect to the cgroup's listener on `local_port`? `peer_owner` finds the owner tag
/// of the connecting socket (asked only for the host's loopback).
#[inline(always)]
fn allowed_peer(
    ctx: &SkBuffContext,
    entry_id: u64,
    peer: &impl DstAddr,
    local_port: u16,
    peer_owner: impl Fn() -> u64,
    rules_id: u64,
) -> bool {
    if matches!(peer.inbound(rules_id, local_port), CidrVerdict::Allow) {
        return true;
    }
    if !peer.is_loopback() {
        return false;
    }
    // SAFETY: cgroup_skb context (bpf_get_netns_cookie since 6.15).
    let cookie = unsafe { bpf_get_netns_cookie(ctx.skb.skb.cast()) };
    if !in_host_netns(cookie) {
        // The socket's own namespace's loopback: only that namespace can reach it.
        return true;
    }
    peer_owner() == entry_id
}
