//! One spliced tunnel: its two sockets, and the task that keeps the proxy's promises for it while
//! the kernel moves the bytes — half-closes, idle timeout, byte counts, credit, teardown.
use std::future::Future;
use std::io;
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use egress_common::relay::{Credit, Flow};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::KernelRelay;
use super::sys::{self, TcpInfo};
use super::watch::{PARKED, Signal};
use crate::proxy::tunnel::{Direction, TunnelEnd};

/// How often a spliced tunnel reports its byte counts when live metrics are wanted (the counts
/// are also reported at every wake-up and at the end): one timer wake-up and two map lookups
/// per second per tunnel, so a scrape is at most a second behind the kernel.
const REPORT_EVERY: Duration = Duration::from_secs(1);
/// Polling of a drain (a half-close or a hand-back waiting for the peer's send queue to take the
/// last redirected bytes): from 1 ms, doubling, at most this.
const MAX_BACKOFF: Duration = Duration::from_millis(100);
/// When a spliced tunnel's task hands bytes queued before the splice to the program, if no
/// arrival has done it ([`Spliced::kick_if_queued`]).
pub(crate) const KICK_AFTER: Duration = Duration::from_millis(1);
/// How long a hand-back waits after quiescing a socket before taking its lock: a segment that
/// passed the socket filter just before it was attached is then through the receive path (a
/// softirq's work of microseconds).
const QUIESCE_SETTLE: Duration = Duration::from_millis(1);

/// Bytes written into `fd`'s send queue since it was created (`snd_una` advance + `SIOCOUTQ`),
/// read so that no ACK lands between the two reads. Up to the constant SYN offset: callers
/// compare against a base taken the same way.
pub(crate) fn written(fd: BorrowedFd<'_>) -> io::Result<u64> {
    for _ in 0..16 {
        let before = sys::tcp_info(fd)?.bytes_acked;
        let outq = sys::outq(fd)?;
        if sys::tcp_info(fd)?.bytes_acked == before {
            return Ok(before + u64::from(outq));
        }
    }
    Err(io::Error::other("TCP_INFO never settled"))
}

/// Bytes of the stream the socket has handed on so far (`copied_seq` advance: read by user space
/// or eaten by the relay program's redirects), up to the constant ISN offset: received (FIN not
/// counted) less what still waits in its receive queue. Read so that nothing arrives between the
/// two reads. Only meaningful while nothing parks bytes in the socket's psock (the relay never
/// reads a socket through one).
pub(crate) fn consumed(fd: BorrowedFd<'_>) -> io::Result<u64> {
    for _ in 0..16 {
        let before = sys::tcp_info(fd)?;
        let inq = sys::inq(fd)?;
        let after = sys::tcp_info(fd)?;
        if after.bytes_received == before.bytes_received {
            return Ok(received(&after).saturating_sub(u64::from(inq)));
        }
    }
    Err(io::Error::other("TCP_INFO never settled"))
}

/// Stream bytes the socket has received (`tcpi_bytes_received` counts a received FIN as one).
fn received(i: &TcpInfo) -> u64 {
    i.bytes_received.saturating_sub(u64::from(fin_received(i)))
}

/// A received FIN: the socket is past ESTABLISHED on its receive side.
fn fin_received(i: &TcpInfo) -> bool {
    matches!(
        i.state,
        sys::TCP_CLOSE_WAIT
            | sys::TCP_LAST_ACK
            | sys::TCP_CLOSING
            | sys::TCP_TIME_WAIT
            | sys::TCP_CLOSE
    )
}

/// One socket of the tunnel.
pub(crate) struct Side {
    sock: std::net::TcpStream,
    cookie: u64,
    /// [`written`] at the splice: what user space wrote itself (the 200, early bytes).
    base: u64,
    /// [`consumed`] at the splice: what user space read itself.
    read_base: u64,
    /// The credit as last written to the map (user space is its only writer).
    credit: Credit,
    /// `shutdown(Write)` done: the FIN from the other side was passed on.
    shut: bool,
}

impl Side {
    pub(crate) fn new(
        sock: std::net::TcpStream,
        cookie: u64,
        (base, read_base): (u64, u64),
        credit: Credit,
    ) -> Side {
        Side {
            sock,
            cookie,
            base,
            read_base,
            credit,
            shut: false,
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// Bytes the kernel relay has written into this socket since the splice.
    fn written_since(&self) -> io::Result<u64> {
        Ok(written(self.fd())?.saturating_sub(self.base))
    }
}

/// Map entries and watcher registration of a tunnel, removed when this is dropped (also when the
/// task running the tunnel is aborted). A demoted tunnel keeps it until its user-space relay ends:
/// a parked socket's bytes wait in its psock, which the entries keep alive.
pub(crate) struct Release {
    relay: Arc<KernelRelay>,
    cookies: [u64; 2],
    /// Entries were made (and the tunnel counted as active).
    armed: bool,
}

impl Drop for Release {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(w) = self.relay.watcher.get().and_then(Option::as_ref) {
            w.forget(&self.cookies);
        }
        self.relay.program.release(&self.cookies);
        self.relay.counters.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How a spliced tunnel ended.
pub(crate) enum Outcome {
    /// (bytes client → upstream, bytes upstream → client, why). Sockets and entries are gone.
    Ended(u64, u64, TunnelEnd),
    /// Both directions are now relayed by user space: a direction fell behind (or the splice
    /// was only half done). Everything the kernel had redirected is in the peers' send queues;
    /// what arrived since waits, in order, in the sockets' own receive queues (plain TCP
    /// sockets again: no map entry, no psock).
    Demoted {
        client: TcpStream,
        upstream: TcpStream,
        up: u64,
        down: u64,
    },
}

/// A spliced tunnel, ready to [`Spliced::run`].
pub(crate) struct Spliced {
    c: Side,
    u: Side,
    signal: Arc<Signal>,
    /// Bytes user space relayed during the splice (the pre-splice drain): (client → upstream,
    /// upstream → client).
    drained: (u64, u64),
    demote_first: bool,
    release: Release,
}

impl Spliced {
    pub(super) fn new(
        relay: Arc<KernelRelay>,
        c: Side,
        u: Side,
        signal: Arc<Signal>,
        drained: (u64, u64),
    ) -> Spliced {
        let cookies = [c.cookie, u.cookie];
        Spliced {
            c,
            u,
            signal,
            drained,
            demote_first: false,
            release: Release {
                relay,
                cookies,
                armed: true,
            },
        }
    }

    /// The sockets of a tunnel the kernel refused outright (no entry was made).
    pub(super) fn into_socks(self) -> (std::net::TcpStream, std::net::TcpStream) {
        let Spliced {
            c, u, mut release, ..
        } = self;
        // Nothing to release, and the tunnel was never counted as active.
        release.armed = false;
        (c.sock, u.sock)
    }

    pub(super) fn demote_at_start(mut self) -> Spliced {
        self.demote_first = true;
        self
    }

    fn relay(&self) -> &KernelRelay {
        &self.release.relay
    }

    /// Hand bytes still queued from before the splice to the program (`SO_RCVLOWAT` runs the
    /// socket's data-ready callback, now the verdict's, when bytes are waiting): on each socket
    /// that received more since the splice than the program has redirected. Done by the
    /// tunnel's task [`KICK_AFTER`] after the splice, not at once: the verdict then runs on the
    /// kicking CPU and so does the send work it queues (a kworker, bound to that CPU), which
    /// on the proxy's own CPU kept the proxy's task from running for tens of milliseconds
    /// (docs/benchmarks.md, "Relay integrity"). A busy socket needs no kick: its next segment
    /// runs the verdict over the whole queue where it is received.
    fn kick_if_queued(&self) {
        for s in [&self.c, &self.u] {
            let Some(flow) = self.relay().program.flow(s.cookie) else {
                continue;
            };
            let queued = sys::tcp_info(s.fd())
                .is_ok_and(|i| received(&i).saturating_sub(s.read_base) > flow.redirected);
            if queued && let Err(e) = sys::set_rcvlowat(s.fd(), 1) {
                tracing::debug!(error = %e, "kernel relay: SO_RCVLOWAT kick failed");
            }
        }
    }

    /// Watch both sockets for hang-ups.
    pub(super) fn watch(&self) -> io::Result<()> {
        let w = self
            .relay()
            .watcher()
            .ok_or_else(|| io::Error::other("no watcher"))?;
        w.register(
            [(self.c.cookie, self.c.fd()), (self.u.cookie, self.u.fd())],
            &self.signal,
        )
    }

    fn flows(&self) -> Option<(Flow, Flow)> {
        let p = &self.relay().program;
        Some((p.flow(self.c.cookie)?, p.flow(self.u.cookie)?))
    }

    /// Bytes relayed each way so far (client → upstream, upstream → client): the pre-splice
    /// drain's plus what the program redirected from each socket.
    fn relayed_so_far(&self, fc: &Flow, fu: &Flow) -> (u64, u64) {
        (
            self.drained.0 + fc.redirected,
            self.drained.1 + fu.redirected,
        )
    }

    // Long: the spliced relay's one loop; its wake-ups, errors, idle end, hand-back and reports
    // share the loop's state (bytes reported, backoff, next kick), which split functions would
    // pass around; `relay_integrity` drives every way out of it with content-checked streams.
    /// Relay until the tunnel ends (or is handed back to user space). `relayed` is told the bytes
    /// as the kernel's counts move (at every wake-up; every [`REPORT_EVERY`] if `live`).
    pub(crate) async fn run(
        mut self,
        idle: Duration,
        relayed: &(dyn Fn(Direction, u64) + Sync),
        live: bool,
        shutdown: impl Future<Output = ()>,
    ) -> Outcome {
        let mut shutdown = std::pin::pin!(shutdown);
        let started = Instant::now();
        let mut reported = (0u64, 0u64);
        let report = |reported: &mut (u64, u64), (up, down): (u64, u64)| {
            if up > reported.0 {
                relayed(Direction::Upstream, up - reported.0);
                reported.0 = up;
            }
            if down > reported.1 {
                relayed(Direction::Downstream, down - reported.1);
                reported.1 = down;
            }
        };
        report(&mut reported, self.drained);
        let mut backoff = Duration::from_millis(1);
        let mut next_report = started + REPORT_EVERY;
        let mut kick_at = Some(started + KICK_AFTER);
        if self.demote_first {
            return self.hand_back(idle, relayed, reported, shutdown).await;
        }
        loop {
            let bits = self.signal.take();
            let end =
                |_: Spliced, reported: (u64, u64), end| Outcome::Ended(reported.0, reported.1, end);
            let errs = (self.c.sock.take_error(), self.u.sock.take_error());
            if !matches!(errs, (Ok(None), Ok(None))) {
                tracing::debug!(?errs, "kernel relay: socket error");
                return end(self, reported, TunnelEnd::Error);
            }
            let Some((fc, fu)) = self.flows() else {
                return end(self, reported, TunnelEnd::Error);
            };
            report(&mut reported, self.relayed_so_far(&fc, &fu));
            if bits & PARKED != 0 || fc.parked != 0 || fu.parked != 0 {
                // The proxy did not hand the tunnel back before a direction reached its hard
                // credit: the bytes parked since can't be read back exactly (see `hand_back`).
                let taken = (self.u.written_since().ok(), self.c.written_since().ok());
                let why = format!(
                    "a direction parked (outran its hard credit) before the proxy handed the tunnel back: redirected {}/{} bytes, taken by the peers {taken:?}, credit {:?}/{:?}, {:?} after the splice",
                    fc.redirected,
                    fu.redirected,
                    self.c.credit,
                    self.u.credit,
                    started.elapsed()
                );
                return self.abort(reported, &why);
            }
            let (Ok(ic), Ok(iu)) = (sys::tcp_info(self.c.fd()), sys::tcp_info(self.u.fd())) else {
                return end(self, reported, TunnelEnd::Error);
            };
            let mut pending = false;
            // Half-closes: a FIN passes on once every byte before it is in the peer's queue.
            for (from_client, info) in [(true, &ic), (false, &iu)] {
                let (x, y) = if from_client {
                    (&self.c, &self.u)
                } else {
                    (&self.u, &self.c)
                };
                if !fin_received(info) || y.shut {
                    continue;
                }
                match self.drained_into(x, y) {
                    Ok(true) => {
                        let y = if from_client {
                            &mut self.u
                        } else {
                            &mut self.c
                        };
                        if let Err(e) = y.sock.shutdown(Shutdown::Write)
                            && e.kind() != io::ErrorKind::NotConnected
                        {
                            return end(self, reported, TunnelEnd::Error);
                        }
                        y.shut = true;
                    }
                    Ok(false) => pending = true,
                    Err(_) => return end(self, reported, TunnelEnd::Error),
                }
            }
            if self.c.shut && self.u.shut {
                if let Some((fc, fu)) = self.flows() {
                    report(&mut reported, self.relayed_so_far(&fc, &fu));
                }
                return end(self, reported, TunnelEnd::Closed);
            }
            // Credit: move it up while the peer's send queue keeps up; a peer that falls behind
            // has the tunnel handed back (before `hard`, where the program would park it).
            let mut behind = false;
            for (from_client, flow) in [(true, fc), (false, fu)] {
                match self.extend_credit(from_client, &flow) {
                    Ok(true) => {}
                    Ok(false) => behind = true,
                    Err(_) => return end(self, reported, TunnelEnd::Error),
                }
            }
            if behind {
                // A peer is not keeping up: user space relays on (TCP flow control again)
                // before the direction reaches its hard credit.
                return self.hand_back(idle, relayed, reported, shutdown).await;
            }
            // Idle: no data received on either socket (the kernel's own clocks) for `idle`.
            let quiet_ms = u64::from(ic.last_data_recv_ms.min(iu.last_data_recv_ms))
                .min(started.elapsed().as_millis() as u64);
            let quiet = Duration::from_millis(quiet_ms);
            if quiet >= idle {
                return end(self, reported, TunnelEnd::Idle);
            }
            let now = Instant::now();
            let mut deadline = now + (idle - quiet);
            if pending {
                deadline = deadline.min(now + backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            } else {
                backoff = Duration::from_millis(1);
            }
            if let Some(k) = kick_at {
                if k <= now {
                    self.kick_if_queued();
                    kick_at = None;
                } else {
                    deadline = deadline.min(k);
                }
            }
            if live {
                if next_report <= now {
                    next_report = now + REPORT_EVERY;
                }
                deadline = deadline.min(next_report);
            }
            tokio::select! {
                () = self.signal.wait() => {}
                () = tokio::time::sleep_until(deadline) => {}
                () = &mut shutdown => {
                    if let Some((fc, fu)) = self.flows() {
                        report(&mut reported, self.relayed_so_far(&fc, &fu));
                    }
                    return end(self, reported, TunnelEnd::Shutdown);
                }
            }
        }
    }

    /// Everything `x` received (it has its FIN, so nothing more comes) has gone through the
    /// program and into `y`'s send queue.
    fn drained_into(&self, x: &Side, y: &Side) -> io::Result<bool> {
        // Order matters: the queue first (once it is empty the program has counted every byte),
        // then the count, then what reached the peer.
        if sys::inq(x.fd())? != 0 {
            return Ok(false);
        }
        let Some(flow) = self.relay().program.flow(x.cookie) else {
            return Err(io::Error::other("flow entry gone"));
        };
        Ok(y.written_since()? >= flow.redirected)
    }

    /// Once the socket went past its soft credit: move its hard credit to what its peer's send
    /// queue has taken plus [`HARD_WINDOWS`] windows (so the bytes redirected but not yet taken,
    /// which no socket is charged for, never exceed that), and its next notice one window on.
    /// `Ok(false)`: the peer is more than [`super::BEHIND_WINDOWS`] behind: hand the tunnel back.
    fn extend_credit(&mut self, from_client: bool, flow: &Flow) -> io::Result<bool> {
        let window = self.relay().window;
        let (x, y) = if from_client {
            (&self.c, &self.u)
        } else {
            (&self.u, &self.c)
        };
        if flow.redirected <= x.credit.soft || y.shut {
            return Ok(true);
        }
        let taken = y.written_since()?;
        let (credit, behind) = next_credit(x.credit, flow.redirected, taken, window);
        if credit != x.credit {
            let cookie = x.cookie;
            self.relay()
                .program
                .set_credit(cookie, credit)
                .map_err(io::Error::other)?;
            if from_client {
                self.c.credit = credit;
            } else {
                self.u.credit = credit;
            }
        }
        Ok(!behind)
    }

    /// Hand the tunnel to user space, exactly: no byte may be read back through a socket's psock
    /// (measured on 6.18: after a socket has redirected, bytes parked in its psock were
    /// sometimes delivered twice — issue #34), so the hand-back never parks.
    ///
    /// 1. Quiesce both sockets ([`sys::quiesce`]: segments with payload are dropped before TCP,
    ///    their senders retransmit), let segments already past the filter finish, and take
    ///    each socket's lock once (`TCP_INFO`), so nothing is in the receive path.
    /// 2. Take both out of `SPLICED`: the verdict is detached, and what arrives from now on stays
    ///    in the socket's own receive queue (TCP flow control again). Un-quiesce.
    /// 3. Wait until each peer's send queue holds every byte the program redirected to it, then
    ///    remove every entry (the psocks go; the sockets are plain TCP sockets again).
    /// 4. Check: each socket handed on (`copied_seq` advance) exactly what the program
    ///    redirected from it, and nothing parked. Otherwise the tunnel is reset ([`Self::abort`]):
    ///    a stream that may have lost or repeated a byte is never relayed on.
    async fn hand_back(
        self,
        idle: Duration,
        relayed: &(dyn Fn(Direction, u64) + Sync),
        reported: (u64, u64),
        shutdown: impl Future<Output = ()>,
    ) -> Outcome {
        let mut shutdown = std::pin::pin!(shutdown);
        let relay = self.release.relay.clone();
        let cookies = [self.c.cookie, self.u.cookie];
        // 1. Quiesce.
        let quiesced = sys::quiesce(self.c.fd()).and_then(|()| sys::quiesce(self.u.fd()));
        if let Err(e) = quiesced {
            return self.abort(reported, &format!("quiescing a socket failed: {e}"));
        }
        tokio::time::sleep(QUIESCE_SETTLE).await;
        if let Err(e) = self.lock_both() {
            return self.abort(reported, &format!("TCP_INFO failed: {e}"));
        }
        // 2. Detach the verdict, then let segments in again.
        relay.program.unsplice(&cookies);
        let locked = self.lock_both();
        let opened = [&self.c, &self.u].map(|s| sys::unquiesce(s.fd()));
        if let Err(e) = locked {
            return self.abort(reported, &format!("TCP_INFO failed: {e}"));
        }
        if let Some(Err(e)) = opened.into_iter().find(Result::is_err) {
            return self.abort(reported, &format!("un-quiescing a socket failed: {e}"));
        }
        let Some((fc, fu)) = self.flows() else {
            return self.abort(reported, "flow entries gone");
        };
        if fc.parked != 0 || fu.parked != 0 {
            return self.abort(
                reported,
                "a direction outran its credit before the proxy handed the tunnel back",
            );
        }
        if let (Ok(wu), Ok(wc)) = (self.u.written_since(), self.c.written_since()) {
            let behind = fc
                .redirected
                .saturating_sub(wu)
                .max(fu.redirected.saturating_sub(wc));
            relay
                .counters
                .max_behind
                .fetch_max(behind, Ordering::Relaxed);
        }
        let (up, down) = self.relayed_so_far(&fc, &fu);
        relayed(Direction::Upstream, up.saturating_sub(reported.0));
        relayed(Direction::Downstream, down.saturating_sub(reported.1));
        // 3. Every redirected byte into the peers' send queues. A tunnel that ends before (an
        // error, the idle timeout, shutdown) is reset: redirected bytes still in a psock go with
        // its entries, and a FIN would present the cut stream as complete.
        let cut = |s: &Spliced, end| {
            reset_on_close([&s.c, &s.u]);
            Outcome::Ended(up, down, end)
        };
        let deadline = Instant::now() + idle;
        let mut backoff = Duration::from_millis(1);
        loop {
            if self.c.sock.take_error().ok().flatten().is_some()
                || self.u.sock.take_error().ok().flatten().is_some()
            {
                return cut(&self, TunnelEnd::Error);
            }
            let done = match (self.u.written_since(), self.c.written_since()) {
                (Ok(wu), Ok(wc)) => wu >= fc.redirected && wc >= fu.redirected,
                _ => return cut(&self, TunnelEnd::Error),
            };
            if done {
                break;
            }
            if Instant::now() >= deadline {
                return cut(&self, TunnelEnd::Idle);
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = &mut shutdown => return cut(&self, TunnelEnd::Shutdown),
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        if let Some(w) = relay.watcher.get().and_then(Option::as_ref) {
            w.deregister([(self.c.cookie, self.c.fd()), (self.u.cookie, self.u.fd())]);
        }
        // 4. Plain sockets again, then the check.
        let Spliced { c, u, release, .. } = self;
        drop(release);
        for (side, flow, what) in [(&c, &fc, "client"), (&u, &fu, "upstream")] {
            let handed_on = consumed(side.fd()).map(|n| n.saturating_sub(side.read_base));
            if handed_on.as_ref().ok() != Some(&flow.redirected) {
                let why = format!(
                    "the {what} socket's stream does not add up after the hand-back: redirected {}, handed on {handed_on:?}",
                    flow.redirected
                );
                return reset(&relay, [&c, &u], (up, down), &why);
            }
        }
        match (TcpStream::from_std(c.sock), TcpStream::from_std(u.sock)) {
            (Ok(client), Ok(upstream)) => {
                relay.counters.demoted.fetch_add(1, Ordering::Relaxed);
                Outcome::Demoted {
                    client,
                    upstream,
                    up,
                    down,
                }
            }
            _ => Outcome::Ended(up, down, TunnelEnd::Error),
        }
    }

    /// Take each socket's lock once (`TCP_INFO` runs under it, as does every verdict and every
    /// receive path): once this returns, whatever held it before has finished.
    fn lock_both(&self) -> io::Result<()> {
        sys::tcp_info(self.c.fd())?;
        sys::tcp_info(self.u.fd())?;
        Ok(())
    }

    /// [`reset`] this tunnel.
    fn abort(self, reported: (u64, u64), why: &str) -> Outcome {
        let relay = self.release.relay.clone();
        reset(&relay, [&self.c, &self.u], reported, why)
    }
}

/// Reset both sockets of a tunnel (they close with an RST when dropped) rather than relay a
/// stream that may have lost or repeated a byte: logged with `why`, counted in
/// [`super::KernelRelayStats::aborted`].
fn reset(relay: &KernelRelay, sides: [&Side; 2], reported: (u64, u64), why: &str) -> Outcome {
    tracing::warn!(
        reason = why,
        "kernel relay: tunnel reset to keep every relayed byte exact"
    );
    relay.counters.aborted.fetch_add(1, Ordering::Relaxed);
    reset_on_close(sides);
    Outcome::Ended(reported.0, reported.1, TunnelEnd::Error)
}

/// `SO_LINGER` 0 on both sockets: their close sends an RST, never a FIN.
fn reset_on_close(sides: [&Side; 2]) {
    for s in sides {
        sys::reset_on_close(s.fd()).ok();
    }
}

/// A direction's next credit once it went past `now.soft`, having redirected `redirected` bytes
/// of which its peer's send queue took `taken`: the next notice one `window` on, the hard credit
/// [`super::HARD_WINDOWS`] windows past `taken` (never lowered); and whether the peer is more
/// than [`super::BEHIND_WINDOWS`] behind.
///
/// The soft point moves on every notice, even when the peer took nothing new (so the hard
/// credit stays): the program notifies once per soft point, so one left behind `redirected`
/// sends no further notice and the direction runs on unwatched until it parks at `hard`
/// (measured: 1 GiB loopback downloads reset after ~512 MiB, their soft point stuck at 4.4 MB).
fn next_credit(now: Credit, redirected: u64, taken: u64, window: u64) -> (Credit, bool) {
    let credit = Credit {
        soft: redirected + window,
        hard: (taken + super::HARD_WINDOWS * window).max(now.hard),
    };
    let behind = redirected.saturating_sub(taken) > super::BEHIND_WINDOWS * window;
    (credit, behind)
}

#[cfg(test)]
mod credit_tests {
    use super::*;

    const W: u64 = 1 << 20;

    #[test]
    fn the_soft_point_moves_even_when_the_peer_took_nothing_new() {
        let start = Credit {
            soft: W,
            hard: super::super::HARD_WINDOWS * W,
        };
        // The peer took 0.5 windows; 1.2 windows redirected: not behind, both points move.
        let (c, behind) = next_credit(start, W + W / 5, W / 2, W);
        assert!(!behind);
        assert_eq!(c.soft, W + W / 5 + W);
        assert_eq!(
            c.hard,
            start.hard.max(W / 2 + super::super::HARD_WINDOWS * W)
        );
        // Next notice: the peer took nothing more. The hard credit stays, the soft point must
        // still pass what was redirected (else no notice ever comes again).
        let (c2, behind) = next_credit(c, c.soft + 1, W / 2, W);
        assert!(!behind, "1.7 windows behind");
        assert!(c2.soft > c.soft + 1, "{c2:?}");
        assert_eq!(c2.hard, c.hard, "the hard credit is never lowered");
        // And the notice after that finds the peer more than 2 windows behind: hand back.
        let (_, behind) = next_credit(c2, c2.soft + 1, W / 2, W);
        assert!(behind, "2.7 windows behind");
        // A peer that catches up raises the hard credit again.
        let (c3, behind) = next_credit(c2, c2.soft + 1, c2.soft, W);
        assert!(!behind);
        assert_eq!(c3.hard, c2.soft + super::super::HARD_WINDOWS * W);
    }
}
