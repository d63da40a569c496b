//! `cgroup_skb/egress`: the packet-level backstop.

use crate::addr::check;
use crate::policy::policy_of_skb;
use crate::report::{Dst, deny};
use crate::{AF_INET, AF_INET6, ALLOW, DENY, IPPROTO_TCP, IPPROTO_UDP, SOCK_STREAM};
use aya_ebpf::helpers::generated::{bpf_get_netns_cookie, bpf_sk_fullsock};
use aya_ebpf::macros::cgroup_skb;
use aya_ebpf::programs::SkBuffContext;
use egress_common::{
    HOOK_SKB_EGRESS, MODE_ALLOW_ALL, PROTO_BIT_UDP, REASON_NO_POLICY, REASON_SOCKET_TYPE,
};

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
    // Family, transport protocol, destination and where its UDP header starts (if it can).
    let (family, proto, addr, udp_at): (u32, u8, [u32; 4], Option<usize>) = match first >> 4 {
        4 => {
            let ihl = ((first & 0x0f) as usize) * 4;
            let proto: u8 = ctx.load(9).map_err(|_| DENY)?;
            let daddr: u32 = ctx.load(16).map_err(|_| DENY)?;
            let udp_at = (20..=60).contains(&ihl).then_some(ihl);
            (AF_INET, proto, [daddr, 0, 0, 0], udp_at)
        }
        6 => {
            let next: u8 = ctx.load(6).map_err(|_| DENY)?;
            let a: [u32; 4] = [
                ctx.load(24).map_err(|_| DENY)?,
                ctx.load(28).map_err(|_| DENY)?,
                ctx.load(32).map_err(|_| DENY)?,
                ctx.load(36).map_err(|_| DENY)?,
            ];
            (AF_INET6, next, a, Some(40))
        }
        _ => (0, 0, [0; 4], None),
    };
    let mut dst = Dst {
        family,
        protocol: proto as u32,
        port: 0,
        addr,
    };
    let verdict = match udp_at {
        Some(at) if proto as u32 == IPPROTO_UDP => {
            let dport: u16 = ctx.load(at + 2).map_err(|_| DENY)?;
            dst.port = u16::from_be(dport);
            if family == AF_INET {
                check(p, &addr[0], PROTO_BIT_UDP, dst.port, cookie)
            } else {
                check(p, &addr, PROTO_BIT_UDP, dst.port, cookie)
            }
        }
        _ => Err(REASON_SOCKET_TYPE),
    };
    match verdict {
        Ok(()) => Ok(ALLOW),
        Err(reason) => Ok(deny(cg, HOOK_SKB_EGRESS, reason, &dst, false)),
    }
}
