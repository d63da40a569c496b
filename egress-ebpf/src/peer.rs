//! Which confined tree a socket belongs to.
//!
//! When a confined socket talks to the host's own loopback (in the host's network namespace),
//! the other end is looked up (`bpf_sk_lookup_tcp/udp`, available to sock_addr programs since
//! 4.20 and to cgroup_skb since 5.8) and its owner — the policy entry of the tree it belongs to —
//! compared with the caller's entry: the same entry means the same `exec` command (or container),
//! whose own servers it may use; anything else — an unconfined host service, another command —
//! is refused. A socket of no tree has owner 0, which is never an entry id (fail closed).
//!
//! The owner is found in one of two ways, by what the asking program can read:
//! - cgroup_skb programs ([`crate::skb`], [`crate::inbound`]) use the cgroup the kernel recorded
//!   in the socket when it was created (`sk_cgrp_data`, never changed afterwards), read with
//!   `bpf_sk_ancestor_cgroup_id` (cgroup_skb since 5.7) and walked to its nearest entry like the
//!   program's own cgroup ([`owner_v4`]/[`owner_v6`] with [`By::Cgroup`]). Nothing is stored.
//! - sock_addr programs ([`crate::connect`], [`crate::sendmsg`]) have no socket-cgroup helper, so
//!   they read an owner tag, [`crate::maps::SOCK_OWNER`] (sk_storage), of the socket they found
//!   ([`By::Tag`]). Their lookups (source 0:0) find only *servers*: TCP listeners and unconnected
//!   bound UDP sockets. So only those are tagged, and only in the host's network namespace (the
//!   only one where the lookups are made): a TCP socket when it starts listening ([`tag_listener`],
//!   sock_ops `BPF_SOCK_OPS_TCP_LISTEN_CB`), a UDP socket when it is created ([`tag`] from
//!   `cgroup/sock_create`; a UDP socket becomes a receiver through bind() or through an autobind
//!   at its first send, with or without an address, allowed or refused — creation is the one point
//!   before all of them).
//!
//! TCP clients are never tagged: until issue #21 item 6 every TCP/UDP socket got a tag at
//! creation, an sk_storage allocation (and a free at close) per socket that made
//! `cgroup/sock_create` cost ~450 ns instead of ~20 ns — for tags that were read only on the
//! host's loopback.
//! https://github.com/torvalds/linux/blob/v6.18/net/core/filter.c (`bpf_sk_lookup`, `cg_skb_func_proto`)

use crate::addr::in_host_netns;
use crate::maps::{POLICIES, SOCK_OWNER};
use crate::policy::{find_policy, policy_of_current};
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::{
    BPF_SK_STORAGE_GET_F_CREATE, bpf_sock, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1,
    bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
};
use aya_ebpf::helpers::generated::{
    bpf_get_netns_cookie, bpf_sk_ancestor_cgroup_id, bpf_sk_cgroup_id, bpf_sk_lookup_tcp,
    bpf_sk_lookup_udp, bpf_sk_release, bpf_sk_storage_get,
};
use aya_ebpf::programs::SockOpsContext;
use core::ffi::c_void;
use egress_common::SockOwner;

/// `BPF_F_CURRENT_NETNS`: look up in the network namespace of the program's context.
const CURRENT_NETNS: u64 = u64::MAX;

/// How the owner of a looked-up socket is read (see the module docs).
#[derive(Clone, Copy)]
pub(crate) enum By {
    /// The socket's owner tag (sock_addr programs: only servers are looked up and tagged).
    Tag,
    /// The policy entry of the socket's cgroup (cgroup_skb programs).
    Cgroup,
}

/// Record `entry_id` as the owner of `sk`: the cgroup/sock context of a socket being created,
/// or the `sk` of a sock_ops context. A failed allocation leaves the socket untagged: it then
/// matches no tree (fail closed).
#[inline(always)]
pub(crate) fn tag(sk: *mut bpf_sock, entry_id: u64) {
    let mut owner = SockOwner { entry_id };
    // SAFETY: `sk` is a socket the verifier accepts for sk_storage (the cg_sock context, or the
    // non-NULL `sk` of a sock_ops context); `owner` is a stack value of the map's value size,
    // copied by the helper.
    unsafe {
        bpf_sk_storage_get(
            SOCK_OWNER.as_ptr(),
            sk.cast(),
            (&raw mut owner).cast(),
            BPF_SK_STORAGE_GET_F_CREATE as u64,
        );
    }
}

/// The owner of a looked-up socket (released here on every path); 0 when none was found.
#[inline(always)]
fn owner_of(sk: *mut bpf_sock, by: By) -> u64 {
    if sk.is_null() {
        return 0;
    }
    let owner = match by {
        By::Tag => {
            // SAFETY: `sk` is a referenced socket returned by a lookup helper; reading its
            // storage without creating any is allowed for it.
            let v = unsafe {
                bpf_sk_storage_get(SOCK_OWNER.as_ptr(), sk.cast(), core::ptr::null_mut(), 0)
            } as *const SockOwner;
            if v.is_null() {
                0
            } else {
                // SAFETY: a non-NULL storage pointer is valid until the socket is released.
                unsafe { (*v).entry_id }
            }
        }
        By::Cgroup => {
            // Fast path as in `policy_of_skb`: the socket's own cgroup has the entry.
            // SAFETY: `sk` is a referenced full socket returned by a lookup helper.
            let own = unsafe { bpf_sk_cgroup_id(sk.cast()) };
            if own != 0 && POLICIES.get_ptr(&own).is_some() {
                own
            } else {
                // SAFETY: as above.
                find_policy(|level| unsafe { bpf_sk_ancestor_cgroup_id(sk.cast(), level) })
                    .map_or(0, |found| found.cgroup_id)
            }
        }
    };
    // SAFETY: releases the reference the lookup took.
    unsafe {
        bpf_sk_release(sk.cast());
    }
    owner
}

/// Owner of the socket that would receive a packet `saddr:sport → daddr:dport` (IPv4, network
/// byte order) in the context's network namespace. With `saddr`/`sport` 0 this finds a listening
/// (TCP) or bound (UDP) socket on `daddr:dport`. `ctx` is the sock_addr or `__sk_buff` context.
#[inline(always)]
pub(crate) fn owner_v4(
    ctx: *mut c_void,
    (udp, by): (bool, By),
    (saddr, sport): (u32, u16),
    (daddr, dport): (u32, u16),
) -> u64 {
    let mut tuple = bpf_sock_tuple {
        __bindgen_anon_1: bpf_sock_tuple__bindgen_ty_1 {
            ipv6: bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
                saddr: [0; 4],
                daddr: [0; 4],
                sport: 0,
                dport: 0,
            },
        },
    };
    tuple.__bindgen_anon_1.ipv4 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
        saddr,
        daddr,
        sport,
        dport,
    };
    let size = core::mem::size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>() as u32;
    // SAFETY: `ctx` is the program context; `tuple` is initialised stack memory of `size` bytes.
    let sk = unsafe {
        if udp {
            bpf_sk_lookup_udp(ctx, &raw mut tuple, size, CURRENT_NETNS, 0)
        } else {
            bpf_sk_lookup_tcp(ctx, &raw mut tuple, size, CURRENT_NETNS, 0)
        }
    };
    owner_of(sk, by)
}

/// [`owner_v4`] for IPv6 (addresses as `user_ip6`, network byte order).
#[inline(always)]
pub(crate) fn owner_v6(
    ctx: *mut c_void,
    (udp, by): (bool, By),
    (saddr, sport): ([u32; 4], u16),
    (daddr, dport): ([u32; 4], u16),
) -> u64 {
    let mut tuple = bpf_sock_tuple {
        __bindgen_anon_1: bpf_sock_tuple__bindgen_ty_1 {
            ipv6: bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
                saddr,
                daddr,
                sport,
                dport,
            },
        },
    };
    let size = core::mem::size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>() as u32;
    // SAFETY: as in `owner_v4`.
    let sk = unsafe {
        if udp {
            bpf_sk_lookup_udp(ctx, &raw mut tuple, size, CURRENT_NETNS, 0)
        } else {
            bpf_sk_lookup_tcp(ctx, &raw mut tuple, size, CURRENT_NETNS, 0)
        }
    };
    owner_of(sk, by)
}

/// `BPF_SOCK_OPS_TCP_LISTEN_CB` (4.19; called by listen() right after the socket is hashed as a
/// listener, whether it was bound or gets a port now): tag the listener with the policy entry of
/// the task calling listen(), in the host's network namespace only. The `sk` field of the
/// sock_ops context and sk_storage for it exist since 5.10, `bpf_get_netns_cookie` for sock_ops
/// since 5.15. A listener of no tree (or an unknown entry) stays untagged: it matches no tree.
/// https://github.com/torvalds/linux/blob/v6.18/net/ipv4/af_inet.c (`__inet_listen_sk`)
#[inline(always)]
pub(crate) fn tag_listener(ctx: &SockOpsContext) {
    // SAFETY: sock_ops context.
    if !in_host_netns(unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }) {
        return;
    }
    // listen() runs in the calling task's context.
    let Ok(found) = policy_of_current() else {
        return;
    };
    // SAFETY: `sk` of a sock_ops context is readable (NULL-checked below).
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if !sk.is_null() {
        tag(sk, found.cgroup_id);
    }
}
