//! Which confined tree a socket belongs to.
//!
//! `cgroup/sock_create` tags every TCP/UDP socket a confined task creates with the policy entry
//! it was created under ([`tag`], map [`crate::maps::SOCK_OWNER`]). When a confined socket talks
//! to the host's own loopback, the other end is looked up (`bpf_sk_lookup_tcp/udp`, available to
//! sock_addr programs since 4.20 and to cgroup_skb since 5.8) and its tag compared with the
//! caller's entry ([`owner_v4`], [`owner_v6`]): the same entry means the same `exec` command (or
//! container), whose own servers it may use; anything else — an unconfined host service, another
//! command — is refused. Untagged sockets (created outside every enforcement root) have owner 0,
//! which is never an entry id.
//! https://github.com/torvalds/linux/blob/v6.18/net/core/filter.c (`bpf_sk_lookup`, `sock_filter_func_proto`)

use crate::maps::SOCK_OWNER;
use aya_ebpf::bindings::{
    BPF_SK_STORAGE_GET_F_CREATE, bpf_sock, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1,
    bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
};
use aya_ebpf::helpers::generated::{
    bpf_sk_lookup_tcp, bpf_sk_lookup_udp, bpf_sk_release, bpf_sk_storage_get,
};
use core::ffi::c_void;
use egress_common::SockOwner;

/// `BPF_F_CURRENT_NETNS`: look up in the network namespace of the program's context.
const CURRENT_NETNS: u64 = u64::MAX;

/// Record `entry_id` as the owner of the socket being created (`sk` is the cgroup/sock context).
/// A failed allocation leaves the socket untagged: it then matches no tree (fail closed).
#[inline(always)]
pub(crate) fn tag(sk: *mut bpf_sock, entry_id: u64) {
    let mut owner = SockOwner { entry_id };
    // SAFETY: `sk` is the program context (the cg_sock variant of the helper takes the context);
    // `owner` is a stack value of the map's value size, copied by the helper.
    unsafe {
        bpf_sk_storage_get(
            SOCK_OWNER.as_ptr(),
            sk.cast(),
            (&raw mut owner).cast(),
            BPF_SK_STORAGE_GET_F_CREATE as u64,
        );
    }
}

/// The owner tag of a looked-up socket (released here on every path); 0 when none was found.
#[inline(always)]
fn owner_of(sk: *mut bpf_sock) -> u64 {
    if sk.is_null() {
        return 0;
    }
    // SAFETY: `sk` is a referenced socket returned by a lookup helper; reading its storage
    // without creating any is allowed for it.
    let v = unsafe {
        bpf_sk_storage_get(SOCK_OWNER.as_ptr(), sk.cast(), core::ptr::null_mut(), 0)
    } as *const SockOwner;
    // SAFETY: a non-NULL storage pointer is valid until the socket is released.
    let owner = if v.is_null() { 0 } else { unsafe { (*v).entry_id } };
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
    udp: bool,
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
    owner_of(sk)
}

/// [`owner_v4`] for IPv6 (addresses as `user_ip6`, network byte order).
#[inline(always)]
pub(crate) fn owner_v6(
    ctx: *mut c_void,
    udp: bool,
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
    owner_of(sk)
}
