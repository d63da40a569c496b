//! Bidirectional byte copy for CONNECT tunnels.
//!
//! Memory: an idle tunnel holds **no copy buffer**. Each direction waits for read readiness, then
//! borrows a buffer (never zeroed; 16 KiB at first, doubled up to `buf_size` each time a read fills
//! it) only while bytes are flowing and drops it as soon as the socket is drained. So 10 000 idle
//! tunnels cost their sockets, tasks and timers, not 10 000 × 2 buffers; a busy tunnel still copies
//! in large chunks. The futures an idle tunnel holds are kept small too: both directions share
//! one [`Shared`] by reference, and the per-tunnel steps are functions returning `async move`
//! blocks rather than `async fn`s (see [`copy`]).
//!
//! System calls: reads go through tokio's `poll_read`, which marks a socket drained after a short
//! read (edge-triggered epoll reports the next arrival), so the end of a burst costs no extra
//! `recv` returning `EAGAIN`. Both reads and readiness waits honour tokio's cooperative budget: a
//! long burst yields to other tunnels instead of starving them.
//!
//! Half-close is propagated (EOF on one side → `shutdown(Write)` on the other); when the second
//! side reaches EOF the tunnel simply ends and closing the sockets sends the last FIN. An error on
//! either side, the idle timeout, or proxy shutdown ends both directions.
//!
//! Hand-over ([`run_until_long_lived`]): with the kernel relay loaded, a tunnel is relayed here
//! until it has made `proxy.kernel_relay_after_reads` reads, then stops with no byte in the
//! proxy's hands and goes to the kernel relay (`super::splice`).
use std::future::{Future, poll_fn};
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::ReadHalf;
use tokio::time::Instant;

/// Why a tunnel ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunnelEnd {
    /// Both sides closed.
    Closed,
    Idle,
    Shutdown,
    Error,
}

/// Millisecond activity clock of one connection (both directions of a tunnel, or a kept-alive
/// HTTP connection), for its idle timeout.
pub(crate) struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
    pub(crate) fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
    /// Completes once `idle` has passed without a [`Activity::touch`]. (A function returning a
    /// block, as [`copy`] is, for the same reason.)
    #[expect(
        clippy::manual_async_fn,
        reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
    )]
    pub(crate) fn idle_for(&self, idle: Duration) -> impl Future<Output = ()> {
        async move {
            loop {
                tokio::time::sleep_until(self.last() + idle).await;
                if self.last() + idle <= Instant::now() {
                    return;
                }
            }
        }
    }
}

/// State both directions of one tunnel share (one [`copy`]'s; its [`pump`]s take it by
/// reference, so each direction's future holds little more than its own burst).
struct Shared<'a> {
    activity: Activity,
    /// Set by the first direction to reach EOF.
    one_side_done: AtomicBool,
    /// Largest read buffer.
    max_buf: usize,
    relayed: &'a (dyn Fn(Direction, u64) + Sync),
    handover: Option<&'a Handover>,
    /// Per direction ([`UP`], [`DOWN`]): the socket its bytes are written to.
    dst: [&'a TcpStream; 2],
    /// Per direction: bytes written on.
    total: [AtomicU64; 2],
}

/// Which way bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client → upstream.
    Upstream,
    /// Upstream → client.
    Downstream,
}

/// Copy until both directions close, either errors, `idle` passes without a byte, or `shutdown`.
/// `relayed` is told every chunk once it has been written on (so metrics of a long-lived tunnel
/// move while it runs). Returns (bytes client→upstream, bytes upstream→client, how it ended).
/// The caller closes both sockets afterwards (dropping them).
pub async fn run(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    buf_size: usize,
    idle: Duration,
    relayed: &(dyn Fn(Direction, u64) + Sync),
    shutdown: impl Future<Output = ()>,
) -> (u64, u64, TunnelEnd) {
    let (up, down, end) = copy(client, upstream, buf_size, idle, relayed, shutdown, None).await;
    (up, down, end.unwrap_or(TunnelEnd::Closed))
}

/// [`run`] until the tunnel has proved long-lived: once both directions together have made
/// `after_reads` reads with data, each direction stops at its next point where user space holds
/// none of its bytes (everything read is written, and it waits for the next arrival), and this
/// returns `None` as the end, with both sockets open and nothing of theirs in the proxy's hands —
/// ready for the kernel relay. A tunnel that ends first returns as [`run`] does. A direction
/// that reached EOF first keeps the other one in user space to the end (a half-closed tunnel is
/// not handed over).
pub(crate) async fn run_until_long_lived(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    buf_size: usize,
    idle: Duration,
    relayed: &(dyn Fn(Direction, u64) + Sync),
    shutdown: impl Future<Output = ()>,
    after_reads: u64,
) -> (u64, u64, Option<TunnelEnd>) {
    let handover = Handover {
        after_reads,
        reads: AtomicU64::new(0),
        go: AtomicBool::new(false),
        busy: [AtomicBool::new(false), AtomicBool::new(false)],
    };
    copy(
        client,
        upstream,
        buf_size,
        idle,
        relayed,
        shutdown,
        Some(&handover),
    )
    .await
}

/// When a tunnel leaves user space ([`run_until_long_lived`]). Plain atomics, no wake-ups: both
/// directions run in one task, so when one stops for the hand-over, [`copy`] sees whether the
/// other is mid-burst (it stops at its burst's end) or waiting for data (holding nothing: its
/// wait is dropped).
struct Handover {
    after_reads: u64,
    /// Reads with data so far, both directions.
    reads: AtomicU64,
    /// Set at `after_reads`: every direction stops at its next clean point.
    go: AtomicBool,
    /// Per direction ([`UP`], [`DOWN`]): between a readiness wake-up and the end of its burst
    /// (holding bytes it read, or about to read).
    busy: [AtomicBool; 2],
}

const UP: usize = 0;
const DOWN: usize = 1;

impl Handover {
    fn count_read(&self) {
        if self.reads.fetch_add(1, Ordering::Relaxed) + 1 >= self.after_reads {
            self.go.store(true, Ordering::Relaxed);
        }
    }
    fn busy(&self, dir: usize) -> bool {
        self.busy[dir].load(Ordering::Relaxed)
    }
}

/// How one direction stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PumpEnd {
    /// EOF from its source, passed on.
    Eof,
    /// Stopped for the hand-over, holding nothing.
    HandedOver,
}

/// Both directions of [`run`]; `None` as the end: handed over (only with `handover`).
///
/// Written as a function returning an `async move` block, as [`pump`] is: the block uses its
/// arguments where they were captured, while an `async fn` keeps each argument used across an
/// `.await` twice (captured, and moved into the body). Every tunnel holds this future while it
/// is relayed in user space, idle ones included.
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
)]
fn copy<'a>(
    client: &'a mut TcpStream,
    upstream: &'a mut TcpStream,
    buf_size: usize,
    idle: Duration,
    relayed: &'a (dyn Fn(Direction, u64) + Sync),
    shutdown: impl Future<Output = ()> + 'a,
    handover: Option<&'a Handover>,
) -> impl Future<Output = (u64, u64, Option<TunnelEnd>)> + 'a {
    async move {
        let (mut client_rx, client_tx) = client.split();
        let (mut upstream_rx, upstream_tx) = upstream.split();
        let shared = Shared {
            activity: Activity::new(),
            one_side_done: AtomicBool::new(false),
            max_buf: buf_size,
            relayed,
            handover,
            dst: [upstream_tx.as_ref(), client_tx.as_ref()],
            total: [AtomicU64::new(0), AtomicU64::new(0)],
        };
        let copy = async {
            let ends = {
                let mut a = std::pin::pin!(pump(&mut client_rx, &shared, UP, true));
                let mut b = std::pin::pin!(pump(&mut upstream_rx, &shared, DOWN, true));
                let (mut ea, mut eb) = (None, None);
                poll_fn(|cx| {
                    if ea.is_none()
                        && let Poll::Ready(r) = a.as_mut().poll(cx)
                    {
                        ea = Some(r?);
                    }
                    if eb.is_none()
                        && let Poll::Ready(r) = b.as_mut().poll(cx)
                    {
                        eb = Some(r?);
                    }
                    let idle = |dir| handover.is_some_and(|h| !h.busy(dir));
                    Poll::Ready(io::Result::Ok(match (ea, eb) {
                        (Some(x), Some(y)) => (x, y),
                        // One direction stopped for the hand-over while the other waits for
                        // data, holding none: that one stops too (its wait is dropped with it).
                        (Some(PumpEnd::HandedOver), None) if idle(DOWN) => {
                            (PumpEnd::HandedOver, PumpEnd::HandedOver)
                        }
                        (None, Some(PumpEnd::HandedOver)) if idle(UP) => {
                            (PumpEnd::HandedOver, PumpEnd::HandedOver)
                        }
                        _ => return Poll::Pending,
                    }))
                })
                .await?
            };
            // One direction stopped for the hand-over after the other reached EOF: it goes on
            // here.
            match ends {
                (PumpEnd::HandedOver, PumpEnd::HandedOver) => return Ok(None),
                (PumpEnd::HandedOver, PumpEnd::Eof) => {
                    pump(&mut client_rx, &shared, UP, false).await?
                }
                (PumpEnd::Eof, PumpEnd::HandedOver) => {
                    pump(&mut upstream_rx, &shared, DOWN, false).await?
                }
                (PumpEnd::Eof, PumpEnd::Eof) => PumpEnd::Eof,
            };
            io::Result::Ok(Some(TunnelEnd::Closed))
        };
        let watchdog = shared.activity.idle_for(idle);
        let end = tokio::select! {
            r = copy => r.unwrap_or(Some(TunnelEnd::Error)),
            () = watchdog => Some(TunnelEnd::Idle),
            () = shutdown => Some(TunnelEnd::Shutdown),
        };
        let [up, down] = &shared.total;
        (
            up.load(Ordering::Relaxed),
            down.load(Ordering::Relaxed),
            end,
        )
    }
}

/// First buffer of a burst; doubled (up to the configured maximum) whenever a read fills it, so a
/// bulk transfer quickly moves large chunks per wake-up while chatty tunnels stay small.
const INITIAL_BUF: usize = 16 * 1024;

/// One direction of [`copy`] ([`UP`] or [`DOWN`]): from `src` to `shared.dst[way]`. It stops
/// for the hand-over only if `handing_over` (and [`copy`] has one). A function returning a block
/// for the reason given at [`copy`].
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
)]
fn pump<'a>(
    src: &'a mut ReadHalf<'_>,
    shared: &'a Shared<'_>,
    way: usize,
    handing_over: bool,
) -> impl Future<Output = io::Result<PumpEnd>> + 'a {
    async move {
        let handover = shared.handover.filter(|_| handing_over);
        let (dst, total) = (shared.dst[way], &shared.total[way]);
        let dir = if way == UP {
            Direction::Upstream
        } else {
            Direction::Downstream
        };
        let max_buf = shared.max_buf;
        let mut size = INITIAL_BUF.min(max_buf);
        loop {
            // Here this direction holds nothing: everything it read is written.
            if let Some(h) = handover
                && h.go.load(Ordering::Relaxed)
            {
                return Ok(PumpEnd::HandedOver);
            }
            poll_fn(|cx| src.as_ref().poll_read_ready(cx)).await?;
            if let Some(h) = handover {
                h.busy[way].store(true, Ordering::Relaxed);
            }
            // Borrowed only while data flows; dropped below before waiting again.
            let mut buf: Vec<u8> = Vec::with_capacity(size);
            loop {
                buf.clear();
                // One read attempt; `Pending` (drained, or this task's budget is spent: it has
                // been woken to run again) ends the burst and the buffer goes back.
                let read = {
                    let mut read = std::pin::pin!(src.read_buf(&mut buf));
                    poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await
                };
                match read {
                    Poll::Ready(Ok(0)) => {
                        half_close(dst, shared);
                        return Ok(PumpEnd::Eof);
                    }
                    Poll::Ready(Ok(n)) => {
                        shared.activity.touch();
                        write_all(dst, &buf[..n]).await?;
                        total.fetch_add(n as u64, Ordering::Relaxed);
                        (shared.relayed)(dir, n as u64);
                        if let Some(h) = handover {
                            h.count_read();
                        }
                        if n == buf.capacity() && size < max_buf {
                            size = (size * 2).min(max_buf);
                            buf = Vec::with_capacity(size);
                        }
                    }
                    Poll::Pending => break,
                    Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                    Poll::Ready(Err(e)) => return Err(e),
                }
            }
            if let Some(h) = handover {
                h.busy[way].store(false, Ordering::Relaxed);
            }
        }
    }
}

/// EOF from the source. The first side to finish passes the half-close on; after the second, the
/// caller's close sends the FIN (a `shutdown` now would be one more call).
fn half_close(dst: &TcpStream, shared: &Shared<'_>) {
    if !shared.one_side_done.swap(true, Ordering::Relaxed) {
        socket2::SockRef::from(dst).shutdown(Shutdown::Write).ok();
    }
}

/// Write all of `data` to `dst` (which other tasks never write to).
///
/// Inline in both directions of every tunnel's future, so kept small: it waits with
/// `poll_write_ready` (the socket's one writer waker, which `AsyncWrite` uses too) rather than
/// `writable()`, whose waiter node made this future ~230 bytes, and it is a function returning a
/// block (see [`copy`]).
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
)]
pub fn write_all<'a>(
    dst: &'a TcpStream,
    mut data: &'a [u8],
) -> impl Future<Output = io::Result<()>> + 'a {
    async move {
        while !data.is_empty() {
            match dst.try_write(data) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    poll_fn(|cx| dst.poll_write_ready(cx)).await?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::mpsc;

    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// A bulk transfer (many more reads than tokio's cooperative budget allows per poll) arrives
    /// whole and counted on a single-threaded runtime, and both half-closes get through: the
    /// tunnel neither spins nor stalls when a read is cut short by the budget.
    #[test]
    fn bulk_transfer_yields_and_completes_with_both_half_closes() {
        const BYTES: usize = 96 << 20;
        // source → [upstream | tunnel | client] → sink
        let (mut source, upstream) = pair();
        let (mut sink, client) = pair();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let relayed = rt.block_on(async {
                upstream.set_nonblocking(true).unwrap();
                client.set_nonblocking(true).unwrap();
                let mut upstream = TcpStream::from_std(upstream).unwrap();
                let mut client = TcpStream::from_std(client).unwrap();
                // A second task on the same thread must keep getting turns during the bulk copy.
                let ticks = std::sync::Arc::new(AtomicU64::new(0));
                let t = ticks.clone();
                let ticker = tokio::spawn(async move {
                    loop {
                        t.fetch_add(1, Ordering::Relaxed);
                        tokio::task::yield_now().await;
                    }
                });
                let r = run(
                    &mut client,
                    &mut upstream,
                    64 * 1024,
                    Duration::from_secs(60),
                    &|_, _| {},
                    std::future::pending::<()>(),
                )
                .await;
                ticker.abort();
                (r, ticks.load(Ordering::Relaxed))
            });
            tx.send(relayed).ok();
        });
        let writer = std::thread::spawn(move || {
            let chunk = vec![7u8; 64 * 1024];
            for _ in 0..BYTES / chunk.len() {
                source.write_all(&chunk).unwrap();
            }
            source.shutdown(Shutdown::Write).unwrap();
            // The sink's half-close comes back as EOF here.
            let mut rest = Vec::new();
            source.read_to_end(&mut rest).unwrap();
            rest.len()
        });
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0usize;
        loop {
            let n = sink.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            assert!(buf[..n].iter().all(|b| *b == 7));
            got += n;
        }
        assert_eq!(got, BYTES);
        sink.shutdown(Shutdown::Write).unwrap();
        assert_eq!(writer.join().unwrap(), 0);
        let ((up, down, end), ticks) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("tunnel stalled");
        assert_eq!((up, down, end), (0, BYTES as u64, TunnelEnd::Closed));
        assert!(ticks > 10, "the other task starved: {ticks} turns");
    }

    /// The hand-over stops both directions where the proxy holds none of their bytes: a tunnel
    /// streaming both ways at once, handed over mid-stream and then relayed to the end by a
    /// second relay on the same sockets (as the kernel relay or its fallback does), delivers
    /// every byte once and in order, and the two phases' counts add up to the totals.
    #[test]
    fn a_hand_over_mid_stream_leaves_no_byte_behind_or_twice() {
        const BYTES: usize = 8 << 20;
        // a_end ↔ [client | tunnel | upstream] ↔ b_end
        let (a_end, client) = pair();
        let (b_end, upstream) = pair();
        let pattern = |seed: u8| -> Vec<u8> {
            (0..BYTES)
                .map(|i| seed.wrapping_add((i % 251) as u8))
                .collect()
        };
        let (to_b, to_a) = (pattern(1), pattern(2));
        // Writes `data` (then its FIN) while reading what arrives, to EOF. The second half waits
        // for `resume`: the hand-over is asked for while the first half streams, and a clean
        // point is then certain to come (a machine fast enough never to leave a direction
        // waiting would otherwise stream everything before one).
        let stream = |mut s: std::net::TcpStream, data: Vec<u8>, resume: mpsc::Receiver<()>| {
            std::thread::spawn(move || {
                let mut r = s.try_clone().unwrap();
                let reader = std::thread::spawn(move || {
                    let mut got = Vec::new();
                    r.read_to_end(&mut got).unwrap();
                    got
                });
                let (first, rest) = data.split_at(data.len() / 2);
                for chunk in first.chunks(3000) {
                    s.write_all(chunk).unwrap();
                }
                resume.recv().unwrap();
                for chunk in rest.chunks(3000) {
                    s.write_all(chunk).unwrap();
                }
                s.shutdown(Shutdown::Write).unwrap();
                reader.join().unwrap()
            })
        };
        let (resume_a, a_waits) = mpsc::channel();
        let (resume_b, b_waits) = mpsc::channel();
        let a_side = stream(a_end, to_b.clone(), a_waits);
        let b_side = stream(b_end, to_a.clone(), b_waits);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (first, second) = rt.block_on(async {
            client.set_nonblocking(true).unwrap();
            upstream.set_nonblocking(true).unwrap();
            let mut client = TcpStream::from_std(client).unwrap();
            let mut upstream = TcpStream::from_std(upstream).unwrap();
            let idle = Duration::from_secs(60);
            let first = run_until_long_lived(
                &mut client,
                &mut upstream,
                64 * 1024,
                idle,
                &|_, _| {},
                std::future::pending::<()>(),
                8,
            )
            .await;
            resume_a.send(()).unwrap();
            resume_b.send(()).unwrap();
            let second = run(
                &mut client,
                &mut upstream,
                64 * 1024,
                idle,
                &|_, _| {},
                std::future::pending::<()>(),
            )
            .await;
            (first, second)
        });
        let (got_at_a, got_at_b) = (a_side.join().unwrap(), b_side.join().unwrap());
        assert_eq!(first.2, None, "not handed over: {first:?}");
        assert!(first.0 + first.1 > 0 && first.0 + first.1 < 2 * BYTES as u64);
        assert_eq!(second.2, TunnelEnd::Closed);
        assert_eq!(
            (first.0 + second.0, first.1 + second.1),
            (BYTES as u64, BYTES as u64)
        );
        assert!(
            got_at_b == to_b,
            "client → upstream bytes lost, doubled or reordered"
        );
        assert!(
            got_at_a == to_a,
            "upstream → client bytes lost, doubled or reordered"
        );
    }
}
