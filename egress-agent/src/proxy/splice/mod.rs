//! Kernel relay of allowed pass-through tunnels: once a CONNECT (200 written) or a transparent
//! connection (dialed) is decided, its two sockets are spliced by the `egress-relay` program
//! (sockhash + `sk_skb` stream verdict, see egress-ebpf/src/relay.rs and [`crate::bpf::relay`])
//! and the bytes no longer cross user space. TLS-intercepted connections never come here.
//!
//! Per tunnel ([`splice`], then [`pair::Spliced::run`]):
//! 1. Bytes the proxy already read (the early data after the head, or the sniffed ClientHello)
//!    were written to the upstream by the caller; the client socket is drained until a short
//!    read, and what that reads is written too (the program sees whole skbs only, so nothing
//!    half-read may stay queued).
//! 2. Both sockets leave tokio's reactor (no per-burst wake-ups), get their flow/credit/peer
//!    entries, then both enter `SPLICED`; queued bytes are handed to the program
//!    (`SO_RCVLOWAT` kick) and the sockets are watched for hang-ups only ([`watch`]).
//! 3. One task per tunnel sleeps until a hang-up, a credit notice or its idle deadline, and then
//!    reads the kernel's view (`TCP_INFO`, queue sizes, the program's per-socket counts) to
//!    propagate half-closes, extend credit, report bytes, and tear down.
//!
//! When the kernel refuses (no sockmap support, a map full, a socket no longer established), the
//! tunnel stays in user space ([`Fallback`]); when a direction outruns its credit (a slow
//! reader), the program parks it and the tunnel is drained and handed back to the user-space
//! relay ([`pair::Outcome::Demoted`]).
mod pair;
#[allow(
    unsafe_code,
    reason = "TCP_INFO, SO_COOKIE, SIOCINQ/SIOCOUTQ, SO_RCVLOWAT"
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

/// A socket's hard credit, in windows past what it was last granted at: user space has
/// `HARD_WINDOWS - 1` windows of a busy tunnel's flow to answer a credit notice before the
/// direction parks and the tunnel is handed back to user space (measured: at 2 windows, a
/// 64 KiB window parked a loopback bulk tunnel after two 64 KB skbs).
pub(crate) const HARD_WINDOWS: u64 = 4;
/// The smallest credit window: the proxy's task must answer a credit notice within
/// `(HARD_WINDOWS - 1) × window` bytes of a busy direction, i.e. within ~1.2 ms at 2.5 GB/s
/// (measured: with 256 KiB windows a loopback bulk tunnel parked before a busy single-threaded
/// runtime got to the notice).
pub(crate) const MIN_WINDOW: u64 = 1 << 20;

/// The loaded relay program plus what its tunnels share. One per proxy process.
pub struct KernelRelay {
    program: RelayProgram,
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
    active: AtomicU64,
}

/// What [`KernelRelay::stats`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelRelayStats {
    /// Tunnels spliced since start.
    pub spliced: u64,
    /// Tunnels the kernel refused that stayed in user space.
    pub fallbacks: u64,
    /// Spliced tunnels handed back to user space (a direction outran its credit).
    pub demoted: u64,
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
            .finish_non_exhaustive()
    }
}

impl KernelRelay {
    /// Load the relay program with room for `tunnels` spliced tunnels; each socket may have at
    /// most [`HARD_WINDOWS`] `× window` bytes redirected but not yet taken by its peer's send
    /// queue (memory the kernel charges to no socket).
    pub fn load(tunnels: u32, window: u64) -> Result<Arc<KernelRelay>, RelayError> {
        let program = RelayProgram::load(tunnels)?;
        Ok(Arc::new(KernelRelay {
            program,
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
    /// Bytes the pre-splice drain read from the client and wrote to the upstream.
    pub drained: u64,
    /// Why (for the log line).
    pub reason: &'static str,
}

/// Why [`splice`] did not return a spliced tunnel.
pub(crate) enum NotSpliced {
    /// Relay it in user space.
    Fallback(Fallback),
    /// The tunnel failed while it was being prepared (a write to the upstream); nothing to relay.
    Failed { drained: u64 },
}

/// Splice `client` ↔ `upstream`. Everything the proxy read from the client must already be
/// written to the upstream (and, for CONNECT, the 200 to the client).
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
        return Err(fallback(client, upstream, 0, "no watcher"));
    }
    // 1. Drain the client until a short read: from here on its queue holds whole skbs only.
    let mut drained = 0u64;
    let mut buf = vec![0u8; DRAIN_BUF];
    let mut rounds = 0;
    loop {
        match client.try_read(&mut buf) {
            Ok(0) => return Err(fallback(client, upstream, drained, "client closed")),
            Ok(n) => {
                if super::tunnel::write_all(&upstream, &buf[..n])
                    .await
                    .is_err()
                {
                    return Err(NotSpliced::Failed { drained });
                }
                drained += n as u64;
                if n < buf.len() {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(NotSpliced::Failed { drained }),
        }
        rounds += 1;
        if rounds >= DRAIN_ROUNDS {
            return Err(fallback(client, upstream, drained, "client busy"));
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
    let bases = (pair::written(c.as_fd()), pair::written(u.as_fd()));
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
            // Returned as spliced: the first thing `run` does is demote it (drain, hand back).
            relay.counters.spliced.fetch_add(1, Ordering::Relaxed);
            relay.counters.active.fetch_add(1, Ordering::Relaxed);
            return Ok(tunnel.demote_at_start());
        }
    }
    relay.counters.spliced.fetch_add(1, Ordering::Relaxed);
    relay.counters.active.fetch_add(1, Ordering::Relaxed);
    // 3. Hand bytes queued before the splice to the program, and watch for hang-ups.
    tunnel.kick();
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

/// Relay an allowed tunnel through the kernel relay when it takes it, else (or after a hand-back)
/// in user space. Returns (bytes client → upstream, upstream → client, how it ended, which path).
pub(crate) async fn relay(
    relay: &Arc<KernelRelay>,
    shared: &super::Shared,
    mut client: TcpStream,
    mut upstream: TcpStream,
    shutdown: impl std::future::Future<Output = ()>,
) -> (u64, u64, super::tunnel::TunnelEnd, &'static str) {
    let limits = shared.ctx.limits();
    let relayed = |dir, n| shared.relayed_one(dir, n);
    let user = async |client: &mut TcpStream, upstream: &mut TcpStream, shutdown| {
        super::tunnel::run(
            client,
            upstream,
            limits.tunnel_buffer_bytes,
            limits.idle_timeout,
            &relayed,
            shutdown,
        )
        .await
    };
    let mut shutdown = std::pin::pin!(shutdown);
    let tunnel = match splice(relay, client, upstream).await {
        Ok(t) => t,
        Err(NotSpliced::Failed { drained }) => {
            shared.relayed(drained, 0);
            return (drained, 0, super::tunnel::TunnelEnd::Error, VIA_USER);
        }
        Err(NotSpliced::Fallback(f)) => {
            tracing::debug!(
                reason = f.reason,
                "kernel relay: tunnel stays in user space"
            );
            shared.relayed(f.drained, 0);
            (client, upstream) = (f.client, f.upstream);
            let (up, down, end) = user(&mut client, &mut upstream, shutdown.as_mut()).await;
            return (f.drained + up, down, end, VIA_USER);
        }
    };
    let live = shared.counters.is_some();
    match tunnel
        .run(limits.idle_timeout, &relayed, live, shutdown.as_mut())
        .await
    {
        Outcome::Ended(up, down, end) => (up, down, end, VIA_KERNEL),
        Outcome::Demoted {
            mut client,
            mut upstream,
            up,
            down,
            release,
        } => {
            tracing::debug!(up, down, "kernel relay: tunnel handed back to user space");
            let (u, d, end) = user(&mut client, &mut upstream, shutdown.as_mut()).await;
            drop((client, upstream));
            drop(release);
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
    match KernelRelay::load(tunnels, p.tunnel_buffer_bytes as u64) {
        Ok(r) => {
            tracing::info!(
                tunnels,
                "kernel relay loaded: pass-through tunnels are spliced in the kernel"
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
