//! `sockops`: a TCP connection that connect4/6 sent to one of the agent's listeners is
//! established — re-key its record (original destination, or [`egress_common::ORIG_NONE`] for
//! the explicit listener) by the 4-tuple the proxy will see when it accepts (connect4/6 only
//! knew the socket cookie: the source port is chosen after them). The proxy admits only
//! connections it finds a record for: that is how a listener tells its own workload from any
//! other process that can reach its address (docs/threat-model.md, "Listener admission"). `BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB` runs on the client
//! side when the SYN-ACK arrives, before its ACK lets the proxy's `accept` return, so the entry
//! exists by then. The proxy deletes the entry when it reads it; entries of connections the
//! proxy never accepted are evicted (LRU) and a reused 4-tuple is overwritten by its own
//! connection first.
//! https://github.com/torvalds/linux/blob/v6.18/net/ipv4/tcp_input.c (`tcp_finish_connect`)
//!
//! The same program tags new listeners (`BPF_SOCK_OPS_TCP_LISTEN_CB`) for same-tree loopback:
//! see [`crate::peer`].

use crate::addr::unmap_v4;
use crate::maps::{ORIG_BY_COOKIE, ORIG_BY_TUPLE};
use crate::peer::tag_listener;
use crate::{AF_INET, AF_INET6};
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::{BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_TCP_LISTEN_CB};
use aya_ebpf::helpers::generated::bpf_get_socket_cookie;
use aya_ebpf::macros::sock_ops;
use aya_ebpf::programs::SockOpsContext;
use egress_common::ConnTuple;

#[sock_ops]
pub fn egress_sock_ops(ctx: SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => rekey(&ctx),
        // A new listener: its owner tag for same-tree loopback ([`crate::peer`]).
        BPF_SOCK_OPS_TCP_LISTEN_CB => tag_listener(&ctx),
        _ => {}
    }
    // sock_ops verdicts are advisory (there is nothing to refuse here).
    1
}

#[inline(always)]
fn rekey(ctx: &SockOpsContext) {
    // SAFETY: sock_ops context; the cookie identifies the socket that connected.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: the value is copied out right away.
    let Some(orig) = (unsafe { ORIG_BY_COOKIE.get(&cookie) }).copied() else {
        return;
    };
    // local_port is host order; remote_port carries the network-order port in its upper half.
    let client_port = (ctx.local_port() as u16).to_be();
    let listener_port = (ctx.remote_port() >> 16) as u16;
    let (family, client_addr, listener_addr) = match ctx.family() {
        AF_INET => (
            AF_INET,
            [ctx.local_ip4(), 0, 0, 0],
            [ctx.remote_ip4(), 0, 0, 0],
        ),
        AF_INET6 => {
            let (l, r) = (ctx.local_ip6(), ctx.remote_ip6());
            match (unmap_v4(&l), unmap_v4(&r)) {
                (Some(l4), Some(r4)) => (AF_INET, [l4, 0, 0, 0], [r4, 0, 0, 0]),
                _ => (AF_INET6, l, r),
            }
        }
        _ => return,
    };
    let tuple = ConnTuple {
        client_addr,
        listener_addr,
        client_port,
        listener_port,
        family,
    };
    let _ = ORIG_BY_TUPLE.insert(&tuple, &orig, 0);
    let _ = ORIG_BY_COOKIE.remove(&cookie);
}
