//! `cgroup/sock_create` (inet only) and BPF-LSM `socket_create` (every family); UDP owner tags.

use crate::addr::{in_host_netns, proto_bit};
use crate::peer::tag;
use crate::policy::policy_of_current;
use crate::report::{Dst, deny, refuse};
use crate::{AF_INET, AF_INET6, AF_NETLINK, AF_UNIX, ALLOW, DENY, SOCK_TYPE_MASK};
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::bpf_sock;
use aya_ebpf::helpers::generated::bpf_get_netns_cookie;
use aya_ebpf::macros::{cgroup_sock, lsm_cgroup};
use aya_ebpf::programs::{LsmContext, SockContext};
use egress_common::{
    HOOK_LSM_SOCKET_CREATE, HOOK_SOCK_CREATE, MODE_ALLOW_ALL, PROTO_BIT_UDP, REASON_NO_POLICY,
    REASON_SOCKET_TYPE,
};

/// Socket kinds a confined task may create: unix, netlink, and kernel TCP/UDP over IPv4/IPv6.
#[inline(always)]
fn socket_allowed(family: u32, sock_type: u32, protocol: u32) -> bool {
    match family {
        AF_UNIX | AF_NETLINK => true,
        AF_INET | AF_INET6 => proto_bit(sock_type & SOCK_TYPE_MASK, protocol).is_some(),
        _ => false,
    }
}

/// The verdict of both hooks. Allowed kinds need no policy: every mode permits them (not
/// counted: creating a socket is not an egress attempt). Only a refusal looks for `allow_all`.
#[inline(always)]
fn socket_verdict(hook: u32, family: u32, sock_type: u32, protocol: u32) -> i32 {
    if socket_allowed(family, sock_type, protocol) {
        return ALLOW;
    }
    let dst = Dst {
        family,
        protocol: sock_type,
        port: 0,
        addr: [0; 4],
    };
    let found = match policy_of_current() {
        Ok(f) => f,
        Err(own) => return deny(own, hook, REASON_NO_POLICY, &dst, true),
    };
    // SAFETY: map value pointer returned by a successful lookup.
    let p = unsafe { &*found.entry };
    if p.mode == MODE_ALLOW_ALL {
        return ALLOW;
    }
    refuse(p, found.cgroup_id, hook, REASON_SOCKET_TYPE, &dst, true)
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
    let verdict = socket_verdict(HOOK_SOCK_CREATE, family, sock_type, protocol);
    // Only UDP sockets are tagged here, and only in the host's network namespace (see `peer`:
    // a UDP socket can become a server reachable on the host's loopback without any later hook
    // seeing it; TCP listeners are tagged at listen(), TCP clients never). An allowed UDP socket
    // had no policy lookup in `socket_verdict`, so this is the only one.
    if verdict == ALLOW
        && matches!(
            proto_bit(sock_type & SOCK_TYPE_MASK, protocol),
            Some((PROTO_BIT_UDP, _))
        )
        // SAFETY: cgroup/sock context (bpf_get_netns_cookie for it since 5.7).
        && in_host_netns(unsafe { bpf_get_netns_cookie(ctx.as_ptr()) })
        && let Ok(found) = policy_of_current()
    {
        tag(sk, found.cgroup_id);
    }
    Ok(verdict)
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
    Ok(socket_verdict(
        HOOK_LSM_SOCKET_CREATE,
        family as u32,
        sock_type as u32,
        protocol as u32,
    ))
}
