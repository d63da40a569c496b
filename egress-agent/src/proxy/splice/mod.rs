//! Kernel relay of allowed pass-through tunnels: once a CONNECT (200 written) or a transparent
//! connection (dialed) is decided and has proved long-lived in user space, its two sockets are
//! spliced by the `egress-relay` program (sockhash + `sk_skb` stream verdict, see
//! egress-ebpf/src/relay.rs and [`crate::bpf::relay`]) and the bytes no longer cross user space.
//! TLS-intercepted connections never come here.
//!
//! Why not splice at once: splicing and tearing down cost the proxy ~20–30 µs of system calls
//! per tunnel (map entries, `TCP_INFO`, epoll), which a one-request tunnel never earns back
//! (measured with `proxy-bench`, docs/benchmarks.md, "Kernel relay"); each user-space read burst
//! costs a wake-up, a read and a write. So a tunnel starts in user space and is spliced after
//! [`KernelRelay::splice_after`] reads with data ([`super::tunnel::run_until_long_lived`] stops
//! both directions where the proxy holds none of their bytes).
//!
//! Per tunnel ([`splice`], then [`pair::Spliced::run`]):
//! 1. Bytes the proxy already read (the early data after the head, the sniffed ClientHello, or
//!    everything relayed in user space so far) were written to the other side by the caller;
//!    both sockets are drained until a short read, and what that reads is written too (the
//!    program sees whole skbs only, so nothing half-read may stay queued).
//! 2. Both sockets leave tokio's reactor (no per-burst wake-ups), get their flow/credit/peer
//!    entries, then both enter `SPLICED`; queued bytes are handed to the program
//!    (`SO_RCVLOWAT` kick) and the sockets are watched for hang-ups only ([`watch`]).
//! 3. One task per tunnel sleeps until a hang-up, a credit notice or its idle deadline, and then
//!    reads the kernel's view (`TCP_INFO`, queue sizes, the program's per-socket counts) to
//!    propagate half-closes, extend credit, report bytes, and tear down.
//!
//! When the kernel refuses (no sockmap support, a map full, a socket no longer established), the
//! tunnel stays in user space ([`Fallback`]); when a peer falls behind (a slow reader), the
//! tunnel is handed back to the user-space relay exactly ([`pair::Spliced::run`]: quiesced,
//! unspliced, counted; [`pair::Outcome::Demoted`]). No byte is ever read back through a
//! socket's psock: on 6.18 that path delivered a parked skb twice after the socket had
//! redirected (issue #34). A tunnel whose bytes can't be proven exact is reset, never relayed on.
mod pair;
#[allow(
    unsafe_code,
    reason = "TCP_INFO, SO_COOKIE, SIOCINQ/SIOCOUTQ, setsockopt (SO_RCVLOWAT, the quiescing filter, SO_LINGER)"
)]
pub(crate) mod sys;
mod watch;

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use egress_common::relay::Credit;
use tokio::net::TcpStream;

use crate::bpf::relay::{RelayEntries, RelayError, RelayProgram, RelayStats, Sock, SpliceError};
pub(crate) use pair::{Outcome, Spliced};
use watch::{Signal, Watcher};

/// Most rounds of the pre-splice drain: a client that keeps the queue full for longer stays in
/// user space.
const DRAIN_ROUNDS: usize = 64;
const DRAIN_BUF: usize = 64 * 1024;

/// A socket's hard credit, in windows past what its peer's send queue has taken: the most bytes
/// redirected but not yet sent (memory no socket is charged for) before the program parks the
/// direction — and a parked tunnel is reset, because its parked bytes can't be read back
/// exactly (see `pair::Spliced::hand_back`). It is a safety valve for a proxy that has stopped
/// answering, not the working bound: the proxy hands a tunnel back once a peer is
/// [`BEHIND_WINDOWS`] behind, as soon as its task runs. How soon is not in the proxy's hands:
/// measured on a loopback bulk download (proxy-bench, the proxy pinned to one CPU), the kernel's
/// own send path (the psock backlog, a kworker on the proxy's CPU) kept the task from running
/// for 6–60 ms while 15–68 MiB arrived; with 4, 16 and 64 windows here most runs parked.
/// `KernelRelayStats::max_behind` reports the most a peer was behind at a hand-back.
pub(crate) const HARD_WINDOWS: u64 = 512;
/// A peer this many windows behind (redirected to it but not yet in its send queue) has the
/// tunnel handed back to user space.
pub(crate) const BEHIND_WINDOWS: u64 = 2;
/// The smallest credit window (one credit notice per window redirected): smaller windows mean
/// more notices for the proxy's task to answer (measured before #34: with 256 KiB windows a
/// loopback bulk tunnel outran a busy single-threaded runtime's answers).
pub(crate) const MIN_WINDOW: u64 = 1 << 20;

/// The loaded relay program plus what its tunnels share. One per proxy process.
pub struct KernelRelay {
    program: RelayProgram,
    /// Reads with data (both directions) a tunnel makes in user space before it is spliced;
    /// 0: spliced at once.
    splice_after: u64,
    watcher: OnceLock<Option<Watcher>>,
    /// Credit step per socket (see [`egress_common::relay::Credit`]).
    window: u64,
    counters: Counters,
}

#[derive(Default)]
struct Counters {
    spliced: AtomicU64,
    fallbacks: AtomicU64,
    demoted: AtomicU64,
    aborted: AtomicU64,
    max_behind: AtomicU64,
    active: AtomicU64,
}

/// What [`KernelRelay::stats`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelRelayStats {
    /// Tunnels spliced since start.
    pub spliced: u64,
    /// Tunnels the kernel refused that stayed in user space.
    pub fallbacks: u64,
    /// Spliced tunnels handed back to user space (a peer fell behind).
    pub demoted: u64,
    /// Spliced tunnels reset because their bytes could not be proven exact (a direction
    /// parked, or a socket's byte count did not add up after a hand-back). Expected 0.
    pub aborted: u64,
    /// The most bytes a peer was behind (redirected to it, not yet in its send queue) when a
    /// tunnel was handed back: the memory the kernel held outside socket accounting.
    pub max_behind: u64,
    /// Spliced tunnels open now.
    pub active: u64,
    pub program: RelayStats,
    pub entries: RelayEntries,
}

impl std::fmt::Debug for KernelRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelRelay")
            .field("capacity", &self.program.capacity())
            .field("window", &self.window)
            .field("splice_after", &self.splice_after)
            .finish_non_exhaustive()
    }
}

impl KernelRelay {
    /// Load the relay program with room for `tunnels` spliced tunnels; each socket may have at
    /// most [`HARD_WINDOWS`] `× window` bytes redirected but not yet taken by its peer's send
    /// queue (memory the kernel charges to no socket). A tunnel is spliced once it has made
    /// `splice_after` reads with data in user space (0: at once; see
    /// `proxy.kernel_relay_after_reads`).
    pub fn load(
        tunnels: u32,
        window: u64,
        splice_after: u64,
    ) -> Result<Arc<KernelRelay>, RelayError> {
        let program = RelayProgram::load(tunnels)?;
        Ok(Arc::new(KernelRelay {
            program,
            splice_after,
            watcher: OnceLock::new(),
            window: window.max(MIN_WINDOW),
            counters: Counters::default(),
        }))
    }

    /// Counters, the program's totals and the map entry counts.
    pub fn stats(&self) -> KernelRelayStats {
        let c = &self.counters;
        KernelRelayStats {
            spliced: c.spliced.load(Ordering::Relaxed),
            fallbacks: c.fallbacks.load(Ordering::Relaxed),
            demoted: c.demoted.load(Ordering::Relaxed),
            aborted: c.aborted.load(Ordering::Relaxed),
            max_behind: c.max_behind.load(Ordering::Relaxed),
            active: c.active.load(Ordering::Relaxed),
            program: self.program.stats(),
            entries: self.program.entries(),
        }
    }

    /// The hang-up/credit watcher, started on first use in the caller's runtime.
    fn watcher(&self) -> Option<&Watcher> {
        self.watcher
            .get_or_init(|| {
                tokio::runtime::Handle::try_current().ok()?;
                let events = self.program.take_events()?;
                match Watcher::start(events) {
                    Ok(w) => Some(w),
                    Err(e) => {
                        tracing::warn!(error = %e, "kernel relay: watcher unavailable; tunnels stay in user space");
                        None
                    }
                }
            })
            .as_ref()
    }

    fn first_credit(&self) -> Credit {
        Credit {
            soft: self.window,
            hard: HARD_WINDOWS * self.window,
        }
    }
}

/// A tunnel the kernel relay did not take: relay it in user space.
pub(crate) struct Fallback {
    pub client: TcpStream,
    pub upstream: TcpStream,
    /// Bytes the pre-splice drain relayed: (client → upstream, upstream → client).
    pub drained: (u64, u64),
    /// Why (for the log line).
    pub reason: &'static str,
}

/// Why [`splice`] did not return a spliced tunnel.
pub(crate) enum NotSpliced {
    /// Relay it in user space.
    Fallback(Fallback),
    /// The tunnel failed while it was being prepared (a read or write); nothing to relay.
    /// `drained` as in [`Fallback`].
    Failed { drained: (u64, u64) },
}

/// How [`drain`] ended.
enum Drain {
    /// A short read: the queue held whole skbs only after it.
    Done,
    /// EOF.
    Closed,
    /// Still full after [`DRAIN_ROUNDS`] reads.
    Busy,
    /// A read or write failed.
    Failed,
}

/// Read `src` until a short read and write what it gave to `dst`, counted in `count`.
async fn drain(src: &TcpStream, dst: &TcpStream, buf: &mut [u8], count: &mut u64) -> Drain {
    for _ in 0..DRAIN_ROUNDS {
        match src.try_read(buf) {
            Ok(0) => return Drain::Closed,
            Ok(n) => {
                if super::tunnel::write_all(dst, &buf[..n]).await.is_err() {
                    return Drain::Failed;
                }
                *count += n as u64;
                if n < buf.len() {
                    return Drain::Done;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Drain::Done,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Drain::Failed,
        }
    }
    Drain::Busy
}

/// Splice `client` ↔ `upstream`. Everything the proxy read from either side must already be
/// written to the other (and, for CONNECT, the 200 to the client).
pub(crate) async fn splice(
    relay: &Arc<KernelRelay>,
    client: TcpStream,
    upstream: TcpStream,
) -> Result<Spliced, NotSpliced> {
    let fallback = |client, upstream, drained, reason| {
        relay.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        NotSpliced::Fallback(Fallback {
            client,
            upstream,
            drained,
            reason,
        })
    };
    if relay.watcher().is_none() {
        return Err(fallback(client, upstream, (0, 0), "no watcher"));
    }
    // 1. Drain both sockets until a short read: from here on their queues hold whole skbs only.
    let mut drained = (0u64, 0u64);
    let mut buf = vec![0u8; DRAIN_BUF];
    for from_client in [true, false] {
        let (src, dst, count) = if from_client {
            (&client, &upstream, &mut drained.0)
        } else {
            (&upstream, &client, &mut drained.1)
        };
        match drain(src, dst, &mut buf, count).await {
            Drain::Done => {}
            Drain::Closed => return Err(fallback(client, upstream, drained, "a side closed")),
            Drain::Busy => return Err(fallback(client, upstream, drained, "a side busy")),
            Drain::Failed => return Err(NotSpliced::Failed { drained }),
        }
    }
    drop(buf);
    // 2. Out of tokio's reactor (no wake-ups per burst), then into the maps.
    let (c, u) = match (client.into_std(), upstream.into_std()) {
        (Ok(c), Ok(u)) => (c, u),
        _ => return Err(NotSpliced::Failed { drained }),
    };
    let back = |c: std::net::TcpStream, u: std::net::TcpStream, reason| match (
        TcpStream::from_std(c),
        TcpStream::from_std(u),
    ) {
        (Ok(c), Ok(u)) => fallback(c, u, drained, reason),
        _ => NotSpliced::Failed { drained },
    };
    let cookies = (sys::socket_cookie(c.as_fd()), sys::socket_cookie(u.as_fd()));
    let (Ok(cc), Ok(uc)) = cookies else {
        return Err(back(c, u, "no socket cookie"));
    };
    let bases = (
        pair::written(c.as_fd()).and_then(|w| Ok((w, pair::consumed(c.as_fd())?))),
        pair::written(u.as_fd()).and_then(|w| Ok((w, pair::consumed(u.as_fd())?))),
    );
    let (Ok(cb), Ok(ub)) = bases else {
        return Err(back(c, u, "no TCP_INFO"));
    };
    let credit = relay.first_credit();
    let a = Sock {
        cookie: cc,
        fd: c.as_fd(),
    };
    let b = Sock {
        cookie: uc,
        fd: u.as_fd(),
    };
    let signal = Arc::new(Signal::default());
    let spliced = relay.program.splice_pair(a, b, credit);
    let tunnel = pair::Spliced::new(
        relay.clone(),
        pair::Side::new(c, cc, cb, credit),
        pair::Side::new(u, uc, ub, credit),
        signal,
        drained,
    );
    match spliced {
        Ok(()) => {}
        Err(SpliceError::Refused { step, source }) => {
            tracing::debug!(step, error = %source, "kernel relay refused a tunnel");
            let (c, u) = tunnel.into_socks();
            return Err(back(c, u, "kernel refused"));
        }
        Err(SpliceError::Partial(e)) => {
            tracing::debug!(error = %e, "kernel relay spliced one socket of two");
            // Returned as spliced: the first thing `run` does is hand it back (quiesce, unsplice).
            relay.counters.spliced.fetch_add(1, Ordering::Relaxed);
            relay.counters.active.fetch_add(1, Ordering::Relaxed);
            return Ok(tunnel.demote_at_start());
        }
    }
    relay.counters.spliced.fetch_add(1, Ordering::Relaxed);
    relay.counters.active.fetch_add(1, Ordering::Relaxed);
    // 3. Watch for hang-ups. Bytes queued before the splice go to the program with the next
    // arrival, or with a kick from the tunnel's task shortly after (`pair::KICK_AFTER`).
    if let Err(e) = tunnel.watch() {
        tracing::debug!(error = %e, "kernel relay: watching a spliced tunnel failed");
        return Ok(tunnel.demote_at_start());
    }
    Ok(tunnel)
}

/// How a tunnel's bytes went, for the "tunnel closed" line.
pub(crate) const VIA_USER: &str = "user";
pub(crate) const VIA_KERNEL: &str = "kernel";
/// Spliced, then handed back to user space.
pub(crate) const VIA_DEMOTED: &str = "kernel+user";

/// Relay an allowed tunnel: in user space until it has proved long-lived
/// ([`KernelRelay::splice_after`] reads, see [`super::tunnel::run_until_long_lived`]), then
/// through the kernel relay when it takes the tunnel, else (or after a hand-back) in user space
/// again. Returns (bytes client → upstream, upstream → client, how it ended, which path).
///
/// A function returning an `async move` block for the reason `route::carry` gives.
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
)]
pub(crate) fn relay(
    relay: &Arc<KernelRelay>,
    shared: &super::Shared,
    mut client: TcpStream,
    mut upstream: TcpStream,
    shutdown: impl std::future::Future<Output = ()>,
) -> impl std::future::Future<Output = (u64, u64, super::tunnel::TunnelEnd, &'static str)> {
    async move {
        let mut shutdown = std::pin::pin!(shutdown);
        // Bytes user space relayed before the splice.
        let mut before = (0, 0);
        if relay.splice_after > 0 {
            let limits = shared.ctx.limits();
            let (up, down, end) = super::tunnel::run_until_long_lived(
                &mut client,
                &mut upstream,
                limits.tunnel_buffer_bytes,
                limits.idle_timeout,
                &|dir, n| shared.relayed_one(dir, n),
                shutdown.as_mut(),
                relay.splice_after,
            )
            .await;
            if let Some(end) = end {
                return (up, down, end, VIA_USER);
            }
            before = (up, down);
        }
        // Boxed: only a long-lived tunnel gets here, and the splice, the spliced tunnel's task and
        // the hand-back would otherwise size every tunnel's future, the idle ones' included.
        let (up, down, end, via) = Box::pin(in_kernel(
            relay,
            shared,
            client,
            upstream,
            shutdown.as_mut(),
        ))
        .await;
        (before.0 + up, before.1 + down, end, via)
    }
}

/// [`relay`] from the splice on: the bytes relayed from here, how the tunnel ended, which path.
async fn in_kernel(
    relay: &Arc<KernelRelay>,
    shared: &super::Shared,
    client: TcpStream,
    upstream: TcpStream,
    mut shutdown: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> (u64, u64, super::tunnel::TunnelEnd, &'static str) {
    let tunnel = match splice(relay, client, upstream).await {
        Ok(t) => t,
        Err(NotSpliced::Failed { drained }) => {
            shared.relayed(drained.0, drained.1);
            return (
                drained.0,
                drained.1,
                super::tunnel::TunnelEnd::Error,
                VIA_USER,
            );
        }
        Err(NotSpliced::Fallback(mut f)) => {
            tracing::debug!(
                reason = f.reason,
                "kernel relay: tunnel stays in user space"
            );
            shared.relayed(f.drained.0, f.drained.1);
            let (up, down, end) = shared
                .relay_in_user_space(&mut f.client, &mut f.upstream, shutdown.as_mut())
                .await;
            return (f.drained.0 + up, f.drained.1 + down, end, VIA_USER);
        }
    };
    let live = shared.counters.is_some();
    let relayed = |dir, n| shared.relayed_one(dir, n);
    match tunnel
        .run(
            shared.ctx.limits().idle_timeout,
            &relayed,
            live,
            shutdown.as_mut(),
        )
        .await
    {
        Outcome::Ended(up, down, end) => (up, down, end, VIA_KERNEL),
        Outcome::Demoted {
            mut client,
            mut upstream,
            up,
            down,
        } => {
            tracing::debug!(up, down, "kernel relay: tunnel handed back to user space");
            let (u, d, end) = shared
                .relay_in_user_space(&mut client, &mut upstream, shutdown.as_mut())
                .await;
            (up + u, down + d, end, VIA_DEMOTED)
        }
    }
}

/// The kernel relay `proxy.kernel_relay` asks for: loaded for `"on"` (an error if it can't be)
/// and `"auto"` (a warning and none if it can't be), none for `"off"`. Room for
/// `proxy.max_connections` tunnels; the credit step is `proxy.tunnel_buffer_bytes`, at least
/// [`MIN_WINDOW`].
pub(crate) fn from_config(
    p: &crate::config::ProxyConfig,
) -> Result<Option<Arc<KernelRelay>>, super::ProxyError> {
    use crate::config::KernelRelayMode;
    if p.kernel_relay == KernelRelayMode::Off {
        return Ok(None);
    }
    let tunnels = u32::try_from(p.max_connections).unwrap_or(u32::MAX);
    let after = p.kernel_relay_after_reads;
    match KernelRelay::load(tunnels, p.tunnel_buffer_bytes as u64, after) {
        Ok(r) => {
            tracing::info!(
                tunnels,
                after_reads = after,
                "kernel relay loaded: pass-through tunnels are spliced in the kernel once long-lived"
            );
            Ok(Some(r))
        }
        Err(e) if p.kernel_relay == KernelRelayMode::On => Err(super::ProxyError::KernelRelay(e)),
        Err(e) => {
            tracing::warn!(error = %e, "kernel relay unavailable: tunnels are relayed in user space (proxy.kernel_relay = \"auto\")");
            Ok(None)
        }
    }
}
