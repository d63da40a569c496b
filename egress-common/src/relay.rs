//! The in-kernel tunnel relay (`egress-relay` object): names, constants and map types both sides
//! share.
//!
//! Its maps belong to the proxy process that loads it (never pinned): when that process exits,
//! the maps, the program and the spliced sockets go with it. See docs/architecture.md, "Kernel
//! relay".

/// Map names (the ELF symbols in `egress-ebpf/src/relay.rs`).
pub mod maps {
    /// `SockHash<u64>`: key = a spliced socket's cookie, value = **its peer** (the socket its
    /// bytes are redirected to). No program is attached to this map, so a socket in it only
    /// behaves differently once it is also in [`SPLICED`].
    pub const PEERS: &str = "EGRESS_RELAY_PEERS";
    /// `SockHash<u64>`: key = a socket's own cookie, value = the socket. The stream verdict
    /// program is attached here: a socket's received bytes go through it once it is in this map.
    pub const SPLICED: &str = "EGRESS_RELAY_SPLICED";
    /// `HashMap<u64 cookie, Flow>`: what the program redirected from each spliced socket.
    /// Written by the program only (user space inserts a zeroed entry before splicing).
    pub const FLOW: &str = "EGRESS_RELAY_FLOW";
    /// `HashMap<u64 cookie, Credit>`: how far each spliced socket may go. Written by user space
    /// only.
    pub const CREDIT: &str = "EGRESS_RELAY_CREDIT";
    /// `RingBuf` of [`super::RelayEvent`]: a socket crossed its soft credit, or parked.
    pub const EVENTS: &str = "EGRESS_RELAY_EVENTS";
    /// `PerCpuArray<u64>` of [`super::STATS`] slots.
    pub const STATS: &str = "EGRESS_RELAY_STATS";
}

/// The stream verdict program (attached to [`maps::SPLICED`]).
pub const VERDICT: &str = "egress_relay_verdict";

/// Per spliced socket, written by the program (in place, under the socket's lock: one writer).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    /// Bytes redirected to the peer (handed to the kernel to send on the peer socket).
    pub redirected: u64,
    /// The [`Credit::soft`] value last reported by a [`EVENT_CREDIT`] event (re-arms when user
    /// space raises `soft`).
    pub notified_soft: u64,
    /// Non-zero once a byte would have gone past [`Credit::hard`]: from then on every byte the
    /// socket receives stays in its own receive queue (accounted, so TCP's window closes on the
    /// sender) and user space takes the tunnel over.
    pub parked: u32,
    pub _pad: u32,
}

/// Per spliced socket, written by user space. Both are totals of [`Flow::redirected`].
///
/// Why: a redirected skb waits in the peer's psock queue until the peer's send buffer has room,
/// and that queue is **not** charged to any socket (no TCP window closes while it grows): a
/// client pushing into a slow upstream would queue without bound. The program stops at `hard`;
/// user space, told at `soft`, moves both up only while the peer keeps up.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Credit {
    pub soft: u64,
    pub hard: u64,
}

/// `RelayEvent::kind`: `Flow::redirected` passed `Credit::soft`.
pub const EVENT_CREDIT: u32 = 1;
/// `RelayEvent::kind`: the socket parked (see [`Flow::parked`]).
pub const EVENT_PARKED: u32 = 2;

/// One record of [`maps::EVENTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayEvent {
    /// Cookie of the socket concerned.
    pub cookie: u64,
    pub kind: u32,
    pub _pad: u32,
}

/// Slots of [`maps::STATS`].
pub const STAT_REDIRECTED_SKBS: u32 = 0;
pub const STAT_REDIRECTED_BYTES: u32 = 1;
/// Received on a spliced socket whose peer (or flow entry) is gone (teardown under way):
/// dropped, never delivered anywhere.
pub const STAT_DROPPED_SKBS: u32 = 2;
pub const STAT_DROPPED_BYTES: u32 = 3;
/// Kept in the receiving socket's own queue for user space (parked).
pub const STAT_PASSED_SKBS: u32 = 4;
pub const STAT_PASSED_BYTES: u32 = 5;
/// Events the ring buffer had no room for.
pub const STAT_EVENTS_LOST: u32 = 6;
/// Number of slots.
pub const STATS: u32 = 7;

/// Capacity the object declares for the per-socket maps; the loader sets the real one (two
/// sockets per tunnel) before loading.
pub const DEFAULT_SOCKETS: u32 = 2 * 8192;
/// Size of [`maps::EVENTS`] in bytes (power of two, multiple of the page size).
pub const EVENTS_BYTES: u32 = 64 * 1024;

#[cfg(feature = "user")]
mod user {
    //! `aya::Pod` impls: `repr(C)`, `Copy`, no padding, no invalid bit patterns.
    use super::*;
    unsafe impl aya::Pod for Flow {}
    unsafe impl aya::Pod for Credit {}
    unsafe impl aya::Pod for RelayEvent {}
}

const _: () = assert!(core::mem::size_of::<Flow>() == 24);
const _: () = assert!(core::mem::size_of::<Credit>() == 16);
const _: () = assert!(core::mem::size_of::<RelayEvent>() == 16);
