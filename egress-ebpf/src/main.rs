//! Kernel side of egress-agent: confine the sockets of cgroups under an enforcement root.
//!
//! Attachment model (docs/architecture.md): every program is attached once to an enforcement root
//! cgroup (`<cgroup2>/egress-agent`, the Docker cgroup parent, ...); children inherit it from their
//! first instruction. Each program finds the policy of the calling cgroup in [`maps::POLICIES`]
//! by walking its ancestors from the deepest level up, nearest entry wins. A cgroup under a root
//! with no entry at any level is treated as `deny_all` (fail closed). Every entry point is thin:
//! `match try_x(..) { Ok(v) => v, Err(_) => DENY }`, so any unexpected failure denies.
//!
//! Hooks and why (kernel source permalinks at v6.18):
//! - `cgroup/connect4`, `cgroup/connect6` (4.17): the only place a TCP connect (incl. TCP Fast
//!   Open `sendto(MSG_FASTOPEN)`, which goes through `__inet_stream_connect` → `pre_connect`, and
//!   io_uring `IORING_OP_CONNECT`, which calls `__sys_connect_file`) and a UDP connect can be
//!   refused with EPERM and the proxy endpoint rewritten to the cgroup's own listener.
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/af_inet.c (`__inet_stream_connect` → `pre_connect`)
//! - `cgroup/sendmsg4`, `cgroup/sendmsg6` (4.18): unconnected UDP `sendto`/`sendmsg` (connected
//!   UDP skips them, hence the UDP checks in connect4/6).
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/udp.c (`udp_sendmsg`)
//! - `cgroup_skb/egress` (4.10): packet-level backstop for anything the socket hooks did not see.
//!   Kernel TCP sockets pass (their connect was vetted, or they are accepted/request/timewait
//!   sockets of a server in the cgroup answering a client: SYN-ACKs must not be dropped).
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/ip_output.c (`ip_finish_output`)
//! - `cgroup/sock_create` (4.10): refuse raw/SCTP/MPTCP/ping inet sockets at creation, and tag the
//!   UDP sockets of confined trees in the host's network namespace with their policy entry
//!   ([`peer`]). It only sees AF_INET/AF_INET6, so AF_PACKET needs the LSM hook below.
//! - `cgroup_skb/ingress` (4.10): inbound connections into confined listeners only from allowed
//!   peers ([`inbound`]).
//! - `cgroup/recvmsg4`, `cgroup/recvmsg6` (5.2): the agent's DNS answers appear to come from the
//!   server the program asked ([`sendmsg`]).
//! - `sockops` (4.13), `BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB`: a redirected connection's original
//!   destination re-keyed by 4-tuple for the proxy ([`established`]); `BPF_SOCK_OPS_TCP_LISTEN_CB`
//!   (4.19): a confined listener's owner tag ([`peer`]).
//!   https://github.com/torvalds/linux/blob/v6.18/net/ipv4/af_inet.c (`inet_create`)
//! - BPF-LSM `socket_create` attached with `BPF_LSM_CGROUP` (6.0): every socket family, so
//!   AF_PACKET, AF_XDP, vsock, ... are refused for tasks in the cgroup.
//!   https://github.com/torvalds/linux/blob/v6.18/net/socket.c (`__sock_create` → `security_socket_create`)
//!
//! Network namespace: loopback (and 0.0.0.0/::, which the kernel connects to loopback) is allowed
//! only when the socket's netns is not the host's. The host netns cookie is written by the loader
//! into [`maps::CONFIG`]; `bpf_get_netns_cookie` exists for sock_addr and sock programs since 5.7 and
//! for cgroup_skb since 6.15 (checked by the verifier at load on this 6.18 kernel).
//!
//! Layout: one module per hook family ([`connect`], [`sendmsg`], [`socket`], [`skb`],
//! [`inbound`]), each with thin entry points; what they share is [`policy`] (whose policy
//! applies), [`addr`] (is this destination allowed), [`peer`] (which confined tree a socket
//! belongs to), [`report`] (counters and denial events) and [`maps`].
#![no_std]
#![no_main]

// Verdicts of cgroup programs and BPF_LSM_CGROUP programs: 1 = allow, 0 = deny (EPERM / drop).
pub(crate) const ALLOW: i32 = 1;
pub(crate) const DENY: i32 = 0;

// Kernel ABI constants several hooks use.
pub(crate) const AF_UNIX: u32 = 1;
pub(crate) const AF_INET: u32 = 2;
pub(crate) const AF_INET6: u32 = 10;
pub(crate) const AF_NETLINK: u32 = 16;
pub(crate) const SOCK_STREAM: u32 = 1;
pub(crate) const SOCK_DGRAM: u32 = 2;
pub(crate) const SOCK_TYPE_MASK: u32 = 0xf;
pub(crate) const IPPROTO_IP: u32 = 0;
pub(crate) const IPPROTO_TCP: u32 = 6;
pub(crate) const IPPROTO_UDP: u32 = 17;

mod addr;
mod connect;
mod established;
mod inbound;
mod maps;
mod peer;
mod policy;
mod redirect;
mod report;
mod sendmsg;
mod skb;
mod socket;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// GPL-compatible licence string: required by the kernel for BPF-LSM programs and GPL-only
/// helpers. The eBPF object is dual licensed; the rest of the project is Apache-2.0.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
