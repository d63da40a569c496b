//! `egress-relay`: the in-kernel relay of allowed pass-through tunnels (a second eBPF object,
//! loaded by the proxy process itself; nothing here is pinned or attached to a cgroup).
//!
//! Once the proxy has decided a tunnel (CONNECT's 200 written, or the transparent decision), it
//! puts the client socket `C` and the upstream socket `U` it owns into two sockhashes:
//! [`PEERS`] maps each socket's cookie to *the other* socket, then [`SPLICED`] (the map this
//! program is attached to) takes both. From then on every skb received on `C` or `U` runs
//! [`egress_relay_verdict`], which redirects it to the peer's **egress** (it is sent on the
//! peer socket as if the proxy had written it), so user space is not woken per burst.
//!
//! Why `sk_skb` stream verdict and not `sk_msg`: the bytes arrive on the proxy's sockets from the
//! network (the receive path); an `sk_msg` program runs on `sendmsg` of a socket in its map, i.e.
//! it would have to sit on the *client's* own socket (another process, inside a confined cgroup)
//! and can do nothing for bytes arriving from a remote upstream. No stream parser: without one
//! (kernel 5.13+) the verdict sees each skb as it is read off the queue, which is all a byte
//! relay needs.
//! https://github.com/torvalds/linux/blob/v6.18/net/core/skmsg.c (`sk_psock_verdict_recv`,
//! `sk_psock_skb_redirect`) and net/core/filter.c (`bpf_sk_redirect_hash`).
//!
//! Keys are socket cookies (`bpf_get_socket_cookie`, unique for the life of the host and never
//! reused), inserted with `BPF_NOEXIST`: two tunnels can never share a key, and a socket whose
//! peer entry is gone (teardown) gets its bytes dropped (counted), never delivered elsewhere.
//! Two maps, not one, so that no socket is spliced before its peer can be found: [`PEERS`] is
//! complete before either socket enters [`SPLICED`].
#![no_std]
#![no_main]

use aya_ebpf::bindings::sk_action::{SK_DROP, SK_PASS};
use aya_ebpf::helpers::generated::bpf_get_socket_cookie;
use aya_ebpf::macros::{map, stream_verdict};
use aya_ebpf::maps::{HashMap, PerCpuArray, RingBuf, SockHash};
use aya_ebpf::programs::SkBuffContext;
use egress_common::relay::{
    Credit, DEFAULT_SOCKETS, EVENT_CREDIT, EVENT_PARKED, EVENTS_BYTES, Flow, RelayEvent,
    STAT_DROPPED_BYTES, STAT_DROPPED_SKBS, STAT_EVENTS_LOST, STAT_PASSED_BYTES, STAT_PASSED_SKBS,
    STAT_REDIRECTED_BYTES, STAT_REDIRECTED_SKBS, STATS as STAT_SLOTS,
};

/// Cookie of a spliced socket → its peer socket (the redirect target). No program attached.
#[map(name = "EGRESS_RELAY_PEERS")]
static PEERS: SockHash<u64> = SockHash::with_max_entries(DEFAULT_SOCKETS, 0);
/// Cookie of a spliced socket → the socket itself; [`egress_relay_verdict`] is attached here.
#[map(name = "EGRESS_RELAY_SPLICED")]
static SPLICED: SockHash<u64> = SockHash::with_max_entries(DEFAULT_SOCKETS, 0);
/// Cookie → what was redirected (written here only).
#[map(name = "EGRESS_RELAY_FLOW")]
static FLOW: HashMap<u64, Flow> = HashMap::with_max_entries(DEFAULT_SOCKETS, 0);
/// Cookie → how far it may go (written by user space only).
#[map(name = "EGRESS_RELAY_CREDIT")]
static CREDIT: HashMap<u64, Credit> = HashMap::with_max_entries(DEFAULT_SOCKETS, 0);
/// Credit and park notices for user space.
#[map(name = "EGRESS_RELAY_EVENTS")]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);
/// Per-CPU totals (`egress_common::relay::STAT_*`).
#[map(name = "EGRESS_RELAY_STATS")]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_SLOTS, 0);

/// `BPF_SK_SKB_STREAM_VERDICT` on [`SPLICED`]: send the skb out of the receiving socket's peer,
/// within the socket's credit.
///
/// - Redirect (`bpf_sk_redirect_hash` on [`PEERS`]): `SK_PASS` with the redirect set, counted in
///   the socket's [`Flow`]; past `Credit::soft` one [`EVENT_CREDIT`] is sent (once per `soft`).
/// - Park: a byte that would pass `Credit::hard` (the peer is not keeping up) is kept in the
///   socket's own receive queue (`SK_PASS` without a redirect: charged to the socket, so TCP's
///   window closes on the sender), and so is everything after it; one [`EVENT_PARKED`].
/// - Drop: no flow entry or no peer (the tunnel is being torn down). Nothing is ever redirected
///   anywhere but the peer user space put in [`PEERS`].
#[stream_verdict]
pub fn egress_relay_verdict(ctx: SkBuffContext) -> u32 {
    // SAFETY: sk_skb context; bpf_get_socket_cookie takes the skb and returns the cookie of the
    // receiving socket (sk_skb programs since 4.12).
    let mut cookie = unsafe { bpf_get_socket_cookie(ctx.skb.skb.cast()) };
    let len = u64::from(ctx.len());
    if len == 0 {
        // A bare FIN (its state change is already made; user space passes it on with
        // `shutdown(Write)` once the bytes before it are out). Redirected, the empty skb would
        // be sent on the peer after that shutdown and break its pipe (EPIPE).
        return SK_DROP;
    }
    let (Some(flow), Some(credit)) = (FLOW.get_ptr_mut(cookie), CREDIT.get_ptr(cookie)) else {
        count(STAT_DROPPED_SKBS, STAT_DROPPED_BYTES, len);
        return SK_DROP;
    };
    // SAFETY: map value pointers from successful lookups; this socket's verdicts run one at a
    // time (under its lock), and user space never writes FLOW after inserting the entry.
    let (flow, credit) = unsafe { (&mut *flow, *credit) };
    if flow.parked != 0 {
        count(STAT_PASSED_SKBS, STAT_PASSED_BYTES, len);
        return SK_PASS;
    }
    if flow.redirected + len > credit.hard {
        flow.parked = 1;
        notify(cookie, EVENT_PARKED);
        count(STAT_PASSED_SKBS, STAT_PASSED_BYTES, len);
        return SK_PASS;
    }
    let verdict = PEERS.redirect_skb(&ctx, &mut cookie, 0) as u32;
    if verdict == SK_DROP {
        count(STAT_DROPPED_SKBS, STAT_DROPPED_BYTES, len);
        return SK_DROP;
    }
    flow.redirected += len;
    count(STAT_REDIRECTED_SKBS, STAT_REDIRECTED_BYTES, len);
    if flow.redirected > credit.soft && flow.notified_soft != credit.soft {
        flow.notified_soft = credit.soft;
        notify(cookie, EVENT_CREDIT);
    }
    verdict
}

#[inline(always)]
fn notify(cookie: u64, kind: u32) {
    let ev = RelayEvent {
        cookie,
        kind,
        _pad: 0,
    };
    if EVENTS.output::<RelayEvent>(&ev, 0).is_err() {
        // User space notices a parked socket without the event too (its flow entry), and a lost
        // credit notice only means the socket parks at `hard`: never unbounded.
        count(STAT_EVENTS_LOST, STAT_EVENTS_LOST, 0);
    }
}

#[inline(always)]
fn count(skbs: u32, bytes: u32, len: u64) {
    if let Some(p) = STATS.get_ptr_mut(skbs) {
        // SAFETY: per-CPU slot of an array map; only this CPU writes it.
        unsafe { *p += 1 };
    }
    if len != 0
        && let Some(p) = STATS.get_ptr_mut(bytes)
    {
        // SAFETY: as above.
        unsafe { *p += len };
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// GPL-compatible licence string (`bpf_sk_redirect_hash` is not GPL-only, but the object is
/// dual licensed like `egress`).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

// The literal map names above must match the shared constants the loader opens.
use egress_common::str_eq;
const _: () = assert!(str_eq(
    egress_common::relay::maps::PEERS,
    "EGRESS_RELAY_PEERS"
));
const _: () = assert!(str_eq(
    egress_common::relay::maps::SPLICED,
    "EGRESS_RELAY_SPLICED"
));
const _: () = assert!(str_eq(
    egress_common::relay::maps::STATS,
    "EGRESS_RELAY_STATS"
));
const _: () = assert!(str_eq(
    egress_common::relay::maps::FLOW,
    "EGRESS_RELAY_FLOW"
));
const _: () = assert!(str_eq(
    egress_common::relay::maps::CREDIT,
    "EGRESS_RELAY_CREDIT"
));
const _: () = assert!(str_eq(
    egress_common::relay::maps::EVENTS,
    "EGRESS_RELAY_EVENTS"
));
