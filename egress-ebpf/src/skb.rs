//! `cgroup_skb/egress`: the packet-level backstop.

use crate::addr::check;
use crate::peer::{By, owner_v4, owner_v6};
use crate::policy::policy_of_skb;
use crate::redirect::{own_dns_udp4, own_dns_udp6};
use crate::report::{Dst, deny};
use crate::{AF_INET, AF_INET6, ALLOW, DENY, IPPROTO_TCP, IPPROTO_UDP, SOCK_STREAM};
use aya_ebpf::helpers::generated::{bpf_get_netns_cookie, bpf_sk_fullsock};
use aya_ebpf::macros::cgroup_skb;
use aya_ebpf::programs::SkBuffContext;
use egress_common::{
    HOOK_SKB_EGRESS, MODE_ALLOW_ALL, POLICY_FLAG_AUDIT, PROTO_BIT_UDP, REASON_NO_POLICY,
    REASON_SOCKET_TYPE,
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
    // Anything else: check the packet's destination (UDP only; other transports can't get here
    // from an allowed socket).
    // SAFETY: cgroup_skb context; bpf_get_netns_cookie is offered to cgroup_skb since 6.15.
    let cookie = || unsafe { bpf_get_netns_cookie(skb.cast()) };
    let pkt = Packet::parse(ctx)?;
    let mut dst = Dst {
        family: pkt.family,
        protocol: pkt.proto as u32,
        port: 0,
        addr: pkt.daddr,
    };
    let verdict = match pkt.l4 {
        Some(at) if pkt.proto as u32 == IPPROTO_UDP => {
            let (sport, dport) = pkt.ports(ctx, at)?;
            dst.port = u16::from_be(dport);
            // A query sendmsg4/6 redirected to the cgroup's DNS listener.
            let to_dns = if pkt.family == AF_INET {
                own_dns_udp4(p, pkt.daddr[0], dport)
            } else {
                own_dns_udp6(p, &pkt.daddr, dport)
            };
            if to_dns {
                return Ok(ALLOW);
            }
            if pkt.family == AF_INET {
                let same_tree = || {
                    owner_v4(
                        skb.cast(),
                        (true, By::Cgroup),
                        (pkt.saddr[0], sport),
                        (pkt.daddr[0], dport),
                    ) == cg
                };
                check(p, &pkt.daddr[0], PROTO_BIT_UDP, dst.port, cookie, same_tree)
            } else {
                let same_tree = || {
                    owner_v6(
                        skb.cast(),
                        (true, By::Cgroup),
                        (pkt.saddr, sport),
                        (pkt.daddr, dport),
                    ) == cg
                };
                check(p, &pkt.daddr, PROTO_BIT_UDP, dst.port, cookie, same_tree)
            }
        }
        _ => Err(REASON_SOCKET_TYPE),
    };
    match verdict {
        Ok(()) => Ok(ALLOW),
        // Audit: the socket-level hooks already reported this flow once; not once per packet.
        Err(_) if p.flags & POLICY_FLAG_AUDIT != 0 => Ok(ALLOW),
        Err(reason) => Ok(deny(cg, HOOK_SKB_EGRESS, reason, &dst, false)),
    }
}

/// The IP header fields both cgroup_skb programs decide on. The context starts at the IP header.
pub(crate) struct Packet {
    pub(crate) family: u32,
    pub(crate) proto: u8,
    /// Network byte order; IPv4 in `[0]`.
    pub(crate) saddr: [u32; 4],
    pub(crate) daddr: [u32; 4],
    /// Offset of the transport header, when it directly follows the IP header.
    pub(crate) l4: Option<usize>,
}

impl Packet {
    #[inline(always)]
    pub(crate) fn parse(ctx: &SkBuffContext) -> Result<Packet, i32> {
        let first: u8 = ctx.load(0).map_err(|_| DENY)?;
        Ok(match first >> 4 {
            4 => {
                let ihl = ((first & 0x0f) as usize) * 4;
                Packet {
                    family: AF_INET,
                    proto: ctx.load(9).map_err(|_| DENY)?,
                    saddr: [ctx.load(12).map_err(|_| DENY)?, 0, 0, 0],
                    daddr: [ctx.load(16).map_err(|_| DENY)?, 0, 0, 0],
                    l4: (20..=60).contains(&ihl).then_some(ihl),
                }
            }
            6 => Packet {
                family: AF_INET6,
                proto: ctx.load(6).map_err(|_| DENY)?,
                saddr: [
                    ctx.load(8).map_err(|_| DENY)?,
                    ctx.load(12).map_err(|_| DENY)?,
                    ctx.load(16).map_err(|_| DENY)?,
                    ctx.load(20).map_err(|_| DENY)?,
                ],
                daddr: [
                    ctx.load(24).map_err(|_| DENY)?,
                    ctx.load(28).map_err(|_| DENY)?,
                    ctx.load(32).map_err(|_| DENY)?,
                    ctx.load(36).map_err(|_| DENY)?,
                ],
                l4: Some(40),
            },
            _ => Packet {
                family: 0,
                proto: 0,
                saddr: [0; 4],
                daddr: [0; 4],
                l4: None,
            },
        })
    }

    /// (source port, destination port) of a TCP or UDP header at `at`, network byte order.
    #[inline(always)]
    pub(crate) fn ports(&self, ctx: &SkBuffContext, at: usize) -> Result<(u16, u16), i32> {
        Ok((
            ctx.load(at).map_err(|_| DENY)?,
            ctx.load(at + 2).map_err(|_| DENY)?,
        ))
    }
}
