//! `cgroup/sendmsg4`, `cgroup/sendmsg6`: unconnected UDP.

use crate::addr::{check, unmap_v4};
use crate::peer::{owner_v4, owner_v6};
use crate::policy::policy_of_current;
use crate::report::{Dst, allow, deny};
use crate::{AF_INET, AF_INET6, DENY, IPPROTO_UDP};
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::bpf_sock_addr;
use aya_ebpf::helpers::generated::bpf_get_netns_cookie;
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
    // SAFETY: sock_addr context.
    let cookie = || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let tree4 = |a: u32| move || owner_v4(ctx.as_ptr(), true, (0, 0), (a, port_be)) == cg;
    let verdict = if !v6 {
        check(p, &addr[0], PROTO_BIT_UDP, port, cookie, tree4(addr[0]))
    } else if let Some(v4) = unmap_v4(&addr) {
        check(p, &v4, PROTO_BIT_UDP, port, cookie, tree4(v4))
    } else {
        let tree6 = || owner_v6(ctx.as_ptr(), true, ([0; 4], 0), (addr, port_be)) == cg;
        check(p, &addr, PROTO_BIT_UDP, port, cookie, tree6)
    };
    match verdict {
        Ok(()) => Ok(allow(cg)),
        Err(reason) => Ok(deny(cg, hook, reason, &dst, true)),
    }
}
