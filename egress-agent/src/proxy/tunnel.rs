//! Bidirectional byte copy for CONNECT tunnels.
//!
//! Memory: an idle tunnel holds **no copy buffer**. Each direction waits for readiness with
//! `readable()`, then borrows a buffer (never zeroed; 16 KiB at first, doubled up to `buf_size` each
//! time a read fills it) only while bytes are flowing and drops it as soon as the socket would block. So 10 000 idle tunnels cost their sockets,
//! tasks and timers, not 10 000 × 2 buffers; a busy tunnel still copies in large chunks.
//! Half-close is propagated (EOF on one side → `shutdown(Write)` on the other); an error on either
//! side, the idle timeout, or proxy shutdown ends both directions.
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::TcpStream;
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

/// Millisecond activity clock shared by both directions of one tunnel.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// Copy until both directions close, either errors, `idle` passes without a byte, or `shutdown`.
/// Returns (bytes client→upstream, bytes upstream→client, how it ended).
pub async fn run(
    client: &TcpStream,
    upstream: &TcpStream,
    buf_size: usize,
    idle: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) -> (u64, u64, TunnelEnd) {
    let activity = Activity {
        start: Instant::now(),
        last_ms: AtomicU64::new(0),
    };
    let up_bytes = AtomicU64::new(0);
    let down_bytes = AtomicU64::new(0);
    let copy = async {
        tokio::try_join!(
            pump(client, upstream, buf_size, &activity, &up_bytes),
            pump(upstream, client, buf_size, &activity, &down_bytes),
        )
    };
    let watchdog = async {
        loop {
            let deadline = activity.last() + idle;
            tokio::time::sleep_until(deadline).await;
            if activity.last() + idle <= Instant::now() {
                return;
            }
        }
    };
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
    src: &TcpStream,
    dst: &TcpStream,
    max_buf: usize,
    activity: &Activity,
    total: &AtomicU64,
) -> io::Result<()> {
    let mut size = INITIAL_BUF.min(max_buf);
    loop {
        src.readable().await?;
        // Borrowed only while data flows; dropped below before waiting again.
        let mut buf: Vec<u8> = Vec::with_capacity(size);
        loop {
            buf.clear();
            match src.try_read_buf(&mut buf) {
                Ok(0) => {
                    // EOF: pass the half-close on and stop this direction.
                    socket2::SockRef::from(dst).shutdown(Shutdown::Write).ok();
                    return Ok(());
                }
                Ok(n) => {
                    activity.touch();
                    write_all(dst, &buf[..n]).await?;
                    total.fetch_add(n as u64, Ordering::Relaxed);
                    if n == buf.capacity() && size < max_buf {
                        size = (size * 2).min(max_buf);
                        buf = Vec::with_capacity(size);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
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
