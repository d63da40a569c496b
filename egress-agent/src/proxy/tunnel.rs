//! Bidirectional byte copy for CONNECT tunnels.
//!
//! Memory: an idle tunnel holds **no copy buffer**. Each direction waits for read readiness, then
//! borrows a buffer (never zeroed; 16 KiB at first, doubled up to `buf_size` each time a read fills
//! it) only while bytes are flowing and drops it as soon as the socket is drained. So 10 000 idle
//! tunnels cost their sockets, tasks and timers, not 10 000 × 2 buffers; a busy tunnel still copies
//! in large chunks.
//!
//! System calls: reads go through tokio's `poll_read`, which marks a socket drained after a short
//! read (edge-triggered epoll reports the next arrival), so the end of a burst costs no extra
//! `recv` returning `EAGAIN`. Both reads and readiness waits honour tokio's cooperative budget: a
//! long burst yields to other tunnels instead of starving them.
//!
//! Half-close is propagated (EOF on one side → `shutdown(Write)` on the other); when the second
//! side reaches EOF the tunnel simply ends and closing the sockets sends the last FIN. An error on
//! either side, the idle timeout, or proxy shutdown ends both directions.
use std::future::{Future, poll_fn};
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};
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
    /// Completes once `idle` has passed without a [`Activity::touch`].
    pub(crate) async fn idle_for(&self, idle: Duration) {
        loop {
            tokio::time::sleep_until(self.last() + idle).await;
            if self.last() + idle <= Instant::now() {
                return;
            }
        }
    }
}

/// State both directions of one tunnel share.
struct Shared {
    activity: Activity,
    /// Set by the first direction to reach EOF.
    one_side_done: AtomicBool,
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
    let shared = Shared {
        activity: Activity::new(),
        one_side_done: AtomicBool::new(false),
    };
    let up_bytes = AtomicU64::new(0);
    let down_bytes = AtomicU64::new(0);
    let (client_rx, client_tx) = client.split();
    let (upstream_rx, upstream_tx) = upstream.split();
    let copy = async {
        tokio::try_join!(
            pump(
                client_rx,
                upstream_tx,
                buf_size,
                &shared,
                &up_bytes,
                (Direction::Upstream, relayed)
            ),
            pump(
                upstream_rx,
                client_tx,
                buf_size,
                &shared,
                &down_bytes,
                (Direction::Downstream, relayed)
            ),
        )
    };
    let watchdog = shared.activity.idle_for(idle);
    let end = tokio::select! {
        r = copy => if r.is_ok() { TunnelEnd::Closed } else { TunnelEnd::Error },
        () = watchdog => TunnelEnd::Idle,
        () = shutdown => TunnelEnd::Shutdown,
    };
    (
        up_bytes.load(Ordering::Relaxed),
        down_bytes.load(Ordering::Relaxed),
        end,
    )
}

/// First buffer of a burst; doubled (up to the configured maximum) whenever a read fills it, so a
/// bulk transfer quickly moves large chunks per wake-up while chatty tunnels stay small.
const INITIAL_BUF: usize = 16 * 1024;

async fn pump(
    mut src: ReadHalf<'_>,
    dst: WriteHalf<'_>,
    max_buf: usize,
    shared: &Shared,
    total: &AtomicU64,
    (dir, relayed): (Direction, &(dyn Fn(Direction, u64) + Sync)),
) -> io::Result<()> {
    let dst: &TcpStream = dst.as_ref();
    let mut size = INITIAL_BUF.min(max_buf);
    loop {
        poll_fn(|cx| src.as_ref().poll_read_ready(cx)).await?;
        // Borrowed only while data flows; dropped below before waiting again.
        let mut buf: Vec<u8> = Vec::with_capacity(size);
        loop {
            buf.clear();
            // One read attempt; `Pending` (drained, or this task's budget is spent: it has been
            // woken to run again) ends the burst and the buffer goes back.
            let read = {
                let mut read = std::pin::pin!(src.read_buf(&mut buf));
                poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await
            };
            match read {
                Poll::Ready(Ok(0)) => {
                    half_close(dst, shared);
                    return Ok(());
                }
                Poll::Ready(Ok(n)) => {
                    shared.activity.touch();
                    write_all(dst, &buf[..n]).await?;
                    total.fetch_add(n as u64, Ordering::Relaxed);
                    relayed(dir, n as u64);
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
    }
}

/// EOF from the source. The first side to finish passes the half-close on; after the second, the
/// caller's close sends the FIN (a `shutdown` now would be one more call).
fn half_close(dst: &TcpStream, shared: &Shared) {
    if !shared.one_side_done.swap(true, Ordering::Relaxed) {
        socket2::SockRef::from(dst).shutdown(Shutdown::Write).ok();
    }
}

/// Write all of `data` to `dst` (which other tasks never write to).
pub async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        match dst.try_write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => dst.writable().await?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::io::{Read, Write};

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
}
