//! `cgroup/connect4`, `cgroup/connect6`: TCP and connected UDP; the proxy endpoint rewrite, the
//! DNS and transparent redirects ([`crate::redirect`]).
//!
//! Order of the verdict (allowlist; `allow_all` allows at once, no entry denies):
//! 1. the stable proxy endpoint → the cgroup's explicit listener (TCP), recorded for the
//!    listener's admission like every connection sent to one of the agent's listeners;
//! 2. port 53, TCP or UDP, any address → the cgroup's DNS listener (UDP straight to that
//!    listener passes: [`own_dns_udp4`]);
//! 3. [`check`]: `allow_cidrs`, the socket's own netns loopback, same-tree host loopback;
//! 4. TCP to an address the agent's DNS answered for a name with that port → direct;
//! 5. TCP to a port of `allow_ports` → the transparent listener;
//! 6. refused (or, for an audited policy, allowed and reported as a would-deny).

use crate::addr::{check, proto_bit, unmap_v4};
use crate::peer::{By, owner_v4, owner_v6};
use crate::policy::policy_of_current;
use crate::redirect::{
    DNS_PORT, direct4, direct6, dns4, dns6, orig4, orig6, own_dns_udp4, own_dns_udp6, remember,
    transparent4, transparent6,
};
use crate::report::{C_PROXIED, Dst, allow, allow_direct, count, deny, refuse};
use crate::{AF_INET, AF_INET6, ALLOW, DENY};
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::bpf_sock_addr;
use aya_ebpf::helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie};
use aya_ebpf::macros::cgroup_sock_addr;
use aya_ebpf::programs::SockAddrContext;
use egress_common::{
    HOOK_CONNECT4, HOOK_CONNECT6, MODE_ALLOW_ALL, MODE_ALLOWLIST, ORIG_NONE, POLICY_FLAG_V6,
    PROTO_BIT_TCP, PolicyEntry, REASON_NO_LISTENER, REASON_NO_POLICY, REASON_SOCKET_TYPE,
};

/// The proxy endpoint rule of connect4, connect6 and v4-mapped connect6 (allowlist, TCP): a
/// connect to the policy's endpoint is redirected to its listener (`rewrite`), one straight to
/// the listener passes, and with no listener the endpoint is refused. `None`: none of these,
/// go on. Both connections that go on to the listener are recorded by socket cookie
/// ([`admit`]): the listener serves only connections the kernel sent it.
#[inline(always)]
fn endpoint_verdict<A: PartialEq>(
    (p, bit): (&PolicyEntry, u32),
    dst_addr: &A,
    port_be: u16,
    (endpoint, endpoint_port): (&A, u16),
    (listener, listener_port): (&A, u16),
    (cg, hook, dst): (u64, u32, &Dst),
    (ctx, rewrite): (&SockAddrContext, impl FnOnce()),
) -> Option<i32> {
    if p.mode != MODE_ALLOWLIST || bit != PROTO_BIT_TCP {
        return None;
    }
    if dst_addr == endpoint && port_be == endpoint_port && endpoint_port != 0 {
        if listener_port == 0 {
            return Some(deny(cg, hook, REASON_NO_LISTENER, dst, true));
        }
        admit(ctx);
        rewrite();
        count(cg, C_PROXIED);
        return Some(ALLOW);
    }
    if dst_addr == listener && port_be == listener_port && listener_port != 0 {
        admit(ctx);
        return Some(allow(cg));
    }
    None
}

/// Record that this socket is sent to the cgroup's explicit listener (no original destination):
/// sock_ops re-keys the record by the 4-tuple once the connection is established, and the
/// proxy admits only connections it finds a record for (see `established.rs`). A record lost
/// to the LRU only refuses the connection (fail closed).
#[inline(always)]
fn admit(ctx: &SockAddrContext) {
    // SAFETY: sock_addr context; the cookie identifies the socket being connected.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    remember(cookie, ORIG_NONE, [0; 4], 0);
}

/// [`endpoint_verdict`] for the policy's IPv4 endpoint (connect4 and v4-mapped connect6).
#[inline(always)]
fn endpoint4_verdict(
    (p, bit): (&PolicyEntry, u32),
    dst_addr: u32,
    port_be: u16,
    who: (u64, u32, &Dst),
    rewrite: (&SockAddrContext, impl FnOnce()),
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
        .ok_or_else(|| refuse(p, cg, hook, REASON_SOCKET_TYPE, dst, true))?;
    Ok((cg, found.entry, bit, proto))
}

/// Redirect to one of the cgroup's interception listeners, remembering where it was going.
#[inline(always)]
fn redirect_to(
    ctx: &SockAddrContext,
    cg: u64,
    (family, addr): (u32, [u32; 4]),
    port_be: u16,
    rewrite: impl FnOnce(),
) -> i32 {
    // SAFETY: sock_addr context; the cookie identifies the socket being connected.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    remember(cookie, family, addr, port_be);
    rewrite();
    count(cg, C_PROXIED);
    ALLOW
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
    // SAFETY (every `to` below): user_ip4 and user_port are writable in connect4.
    let to = |a: u32, pt: u16| {
        move || unsafe {
            (*sa).user_ip4 = a;
            (*sa).user_port = pt as u32;
        }
    };
    let who = (cg, HOOK_CONNECT4, &dst(proto));
    if let Some(verdict) = endpoint4_verdict(
        (p, bit),
        addr,
        port_be,
        who,
        (ctx, to(p.listener4_addr, p.listener4_port)),
    ) {
        return Ok(verdict);
    }
    let tcp = bit == PROTO_BIT_TCP;
    if !tcp && own_dns_udp4(p, addr, port_be) {
        return Ok(allow(cg));
    }
    if port == DNS_PORT
        && let Some((a, pt)) = dns4(p, tcp)
    {
        return Ok(redirect_to(ctx, cg, orig4(addr), port_be, to(a, pt)));
    }
    // SAFETY: ctx is a sock_addr context, for which bpf_get_netns_cookie is available (5.7).
    let cookie = || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let same_tree = || owner_v4(ctx.as_ptr(), (!tcp, By::Tag), (0, 0), (addr, port_be)) == cg;
    let reason = match check(p, &addr, bit, port, cookie, same_tree) {
        Ok(()) => return Ok(allow_direct(p, cg, HOOK_CONNECT4, &dst(proto))),
        Err(reason) => reason,
    };
    if tcp && direct4(cg, addr, port) {
        return Ok(allow_direct(p, cg, HOOK_CONNECT4, &dst(proto)));
    }
    if tcp && let Some((a, pt)) = transparent4(p, addr, port) {
        return Ok(redirect_to(ctx, cg, orig4(addr), port_be, to(a, pt)));
    }
    Ok(refuse(p, cg, HOOK_CONNECT4, reason, &dst(proto), true))
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
    let tcp = bit == PROTO_BIT_TCP;
    let who = (cg, HOOK_CONNECT6, &dst(proto));

    // IPv4-mapped: treated exactly as the IPv4 address it maps (listeners written back mapped).
    if let Some(v4) = unmap_v4(&addr) {
        // SAFETY (every `to4`): user_ip6 and user_port are writable in connect6; the address
        // stays ::ffff:a.b.c.d with the listener's IPv4 in the last word.
        let to4 = |a: u32, pt: u16| {
            move || unsafe {
                (*sa).user_ip6[3] = a;
                (*sa).user_port = pt as u32;
            }
        };
        if let Some(verdict) = endpoint4_verdict(
            (p, bit),
            v4,
            port_be,
            who,
            (ctx, to4(p.listener4_addr, p.listener4_port)),
        ) {
            return Ok(verdict);
        }
        if !tcp && own_dns_udp4(p, v4, port_be) {
            return Ok(allow(cg));
        }
        if port == DNS_PORT
            && let Some((a, pt)) = dns4(p, tcp)
        {
            return Ok(redirect_to(ctx, cg, orig4(v4), port_be, to4(a, pt)));
        }
        let same_tree = || owner_v4(ctx.as_ptr(), (!tcp, By::Tag), (0, 0), (v4, port_be)) == cg;
        let reason = match check(p, &v4, bit, port, cookie, same_tree) {
            Ok(()) => return Ok(allow_direct(p, cg, HOOK_CONNECT6, &dst(proto))),
            Err(reason) => reason,
        };
        if tcp && direct4(cg, v4, port) {
            return Ok(allow_direct(p, cg, HOOK_CONNECT6, &dst(proto)));
        }
        if tcp && let Some((a, pt)) = transparent4(p, v4, port) {
            return Ok(redirect_to(ctx, cg, orig4(v4), port_be, to4(a, pt)));
        }
        return Ok(refuse(p, cg, HOOK_CONNECT6, reason, &dst(proto), true));
    }

    // SAFETY (every `to6`): user_ip6 and user_port are writable in connect6.
    let to6 = |a: [u32; 4], pt: u16| {
        move || unsafe {
            (*sa).user_ip6[0] = a[0];
            (*sa).user_ip6[1] = a[1];
            (*sa).user_ip6[2] = a[2];
            (*sa).user_ip6[3] = a[3];
            (*sa).user_port = pt as u32;
        }
    };
    if p.flags & POLICY_FLAG_V6 != 0
        && let Some(verdict) = endpoint_verdict(
            (p, bit),
            &addr,
            port_be,
            (&p.endpoint6_addr, p.endpoint6_port),
            (&p.listener6_addr, p.listener6_port),
            who,
            (ctx, to6(p.listener6_addr, p.listener6_port)),
        )
    {
        return Ok(verdict);
    }
    if !tcp && own_dns_udp6(p, &addr, port_be) {
        return Ok(allow(cg));
    }
    if port == DNS_PORT
        && let Some((a, pt)) = dns6(p, tcp)
    {
        return Ok(redirect_to(ctx, cg, orig6(addr), port_be, to6(a, pt)));
    }
    let same_tree = || owner_v6(ctx.as_ptr(), (!tcp, By::Tag), ([0; 4], 0), (addr, port_be)) == cg;
    let reason = match check(p, &addr, bit, port, cookie, same_tree) {
        Ok(()) => return Ok(allow_direct(p, cg, HOOK_CONNECT6, &dst(proto))),
        Err(reason) => reason,
    };
    if tcp && direct6(cg, addr, port) {
        return Ok(allow_direct(p, cg, HOOK_CONNECT6, &dst(proto)));
    }
    if tcp && let Some((a, pt)) = transparent6(p, &addr, port) {
        return Ok(redirect_to(ctx, cg, orig6(addr), port_be, to6(a, pt)));
    }
    Ok(refuse(p, cg, HOOK_CONNECT6, reason, &dst(proto), true))
}
