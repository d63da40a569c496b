//! `cgroup/sendmsg4`, `cgroup/sendmsg6`: unconnected UDP; `cgroup/recvmsg4`, `cgroup/recvmsg6`:
//! the source of the agent's DNS answers put back.
//!
//! A datagram to port 53 at any address goes to the cgroup's DNS listener (the original server
//! is kept by socket cookie); its answer comes back from the listener's address, which `recvmsg`
//! rewrites to the server the program sent to — resolvers drop answers from anyone else
//! (Cilium's socket load balancer does the same, `cil_sock4_recvmsg`). Everything else:
//! `allow_cidrs` and loopback as for connect, else refused.

use crate::addr::{check, unmap_v4};
use crate::maps::ORIG_BY_COOKIE;
use crate::peer::{By, owner_v4, owner_v6};
use crate::policy::policy_of_current;
use crate::redirect::{DNS_PORT, dns4, dns6, orig4, orig6, own_dns_udp4, own_dns_udp6, remember};
use crate::report::{C_PROXIED, Dst, allow, allow_direct, count, deny, refuse};
use crate::{AF_INET, AF_INET6, ALLOW, DENY, IPPROTO_UDP};
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::bpf_sock_addr;
use aya_ebpf::helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie};
use aya_ebpf::macros::cgroup_sock_addr;
use aya_ebpf::programs::SockAddrContext;
use egress_common::{
    HOOK_SENDMSG4, HOOK_SENDMSG6, MODE_ALLOW_ALL, PROTO_BIT_UDP, REASON_NO_POLICY,
};

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
    // SAFETY: sock_addr context; the cookie identifies the sending socket.
    let sock_cookie = || unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let mapped = if v6 { unmap_v4(&addr) } else { Some(addr[0]) };
    // The cgroup's own DNS listener (see `own_dns_udp4`): where connect6 sent a v4-mapped
    // socket's port-53 traffic.
    let own_dns = match mapped {
        Some(v4) => own_dns_udp4(p, v4, port_be),
        None => own_dns_udp6(p, &addr, port_be),
    };
    if own_dns {
        return Ok(allow(cg));
    }
    if port == DNS_PORT {
        // SAFETY (both rewrites): user_ip4 (sendmsg4) / user_ip6 (sendmsg6) and user_port are
        // writable; a v4-mapped destination stays mapped.
        match mapped {
            Some(v4) => {
                if let Some((a, pt)) = dns4(p, false) {
                    remember(sock_cookie(), orig4(v4).0, orig4(v4).1, port_be);
                    unsafe {
                        if v6 {
                            (*sa).user_ip6[3] = a;
                        } else {
                            (*sa).user_ip4 = a;
                        }
                        (*sa).user_port = pt as u32;
                    }
                    count(cg, C_PROXIED);
                    return Ok(ALLOW);
                }
            }
            None => {
                if let Some((a, pt)) = dns6(p, false) {
                    remember(sock_cookie(), orig6(addr).0, orig6(addr).1, port_be);
                    unsafe {
                        (*sa).user_ip6[0] = a[0];
                        (*sa).user_ip6[1] = a[1];
                        (*sa).user_ip6[2] = a[2];
                        (*sa).user_ip6[3] = a[3];
                        (*sa).user_port = pt as u32;
                    }
                    count(cg, C_PROXIED);
                    return Ok(ALLOW);
                }
            }
        }
    }
    // SAFETY: sock_addr context.
    let cookie = || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let tree4 =
        |a: u32| move || owner_v4(ctx.as_ptr(), (true, By::Tag), (0, 0), (a, port_be)) == cg;
    let verdict = match mapped {
        Some(v4) => check(p, &v4, PROTO_BIT_UDP, port, cookie, tree4(v4)),
        None => {
            let tree6 =
                || owner_v6(ctx.as_ptr(), (true, By::Tag), ([0; 4], 0), (addr, port_be)) == cg;
            check(p, &addr, PROTO_BIT_UDP, port, cookie, tree6)
        }
    };
    match verdict {
        Ok(()) => Ok(allow_direct(p, cg, hook, &dst)),
        Err(reason) => Ok(refuse(p, cg, hook, reason, &dst, true)),
    }
}

#[cgroup_sock_addr(recvmsg4)]
pub fn egress_recvmsg4(ctx: SockAddrContext) -> i32 {
    restore_source(&ctx, false);
    // recvmsg programs can't refuse: 1 is the only verdict the kernel accepts.
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn egress_recvmsg6(ctx: SockAddrContext) -> i32 {
    restore_source(&ctx, true);
    ALLOW
}

/// A datagram from the cgroup's DNS listener to a socket that sent a redirected query: its
/// source becomes the server the query was sent to.
#[inline(always)]
fn restore_source(ctx: &SockAddrContext, v6: bool) {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    let Ok(found) = policy_of_current() else {
        return;
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    // SAFETY: sock_addr context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: the value is copied out right away.
    let Some(orig) = (unsafe { ORIG_BY_COOKIE.get(&cookie) }).copied() else {
        return;
    };
    // SAFETY: user_ip4/user_ip6 and user_port are readable and writable in recvmsg4/6.
    unsafe {
        let port_be = (*sa).user_port as u16;
        if v6 {
            let src = [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ];
            if let Some(v4) = unmap_v4(&src) {
                if let Some((a, pt)) = dns4(p, false)
                    && v4 == a
                    && port_be == pt
                    && orig.family == AF_INET
                {
                    (*sa).user_ip6[3] = orig.addr[0];
                    (*sa).user_port = orig.port as u32;
                }
            } else if let Some((a, pt)) = dns6(p, false)
                && src == a
                && port_be == pt
                && orig.family == AF_INET6
            {
                (*sa).user_ip6[0] = orig.addr[0];
                (*sa).user_ip6[1] = orig.addr[1];
                (*sa).user_ip6[2] = orig.addr[2];
                (*sa).user_ip6[3] = orig.addr[3];
                (*sa).user_port = orig.port as u32;
            }
        } else if let Some((a, pt)) = dns4(p, false)
            && (*sa).user_ip4 == a
            && port_be == pt
            && orig.family == AF_INET
        {
            (*sa).user_ip4 = orig.addr[0];
            (*sa).user_port = orig.port as u32;
        }
    }
}
