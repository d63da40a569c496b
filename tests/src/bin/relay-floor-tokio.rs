//! `relay-floor-tokio`: the least work a CONNECT relay does per tunnel on tokio — the I/O model
//! the agent's proxy is built on (readiness through epoll, a task per connection, the daemon's
//! runtime shape: multi-threaded with one worker). A benchmark reference for `proxy-bench`
//! (peer `tokio-floor`) beside `relay-floor` (peer `floor`, the same work through io_uring
//! completions): `agent/tokio-floor` is what the agent's own work (admission, policy, name
//! resolution, events, metrics, timeouts) adds to a tunnel, and `tokio-floor/floor` is what the
//! I/O model costs before the agent does anything.
//!
//! Like `relay-floor` it is **not a proxy**: no policy, no logging, no timeouts or bounds, no
//! name resolution (`bench.test:PORT` means 127.0.0.1:PORT; anything else is closed). Per
//! tunnel: accept, read the request, connect upstream (`TCP_NODELAY`, as the accepted sockets
//! inherit from the listener), answer 200, relay both ways in the tunnel's one task, pass the
//! first EOF on as a half-close, close both after the second — the system calls `relay-floor`
//! makes, plus the readiness ones tokio adds (`epoll_ctl` per socket, `epoll_wait`, a read or
//! accept that finds nothing).
//!
//! Usage: `relay-floor-tokio ADDR_FILE` (binds 127.0.0.1:0, writes `bench ADDR` to ADDR_FILE,
//! runs until killed).
#![forbid(unsafe_code)]

use std::io;
use std::net::Shutdown;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Per-direction relay buffer (`relay-floor`'s).
const BUF: usize = 16 * 1024;
/// Request heads longer than this are refused (the tunnel bench sends ~60 bytes).
const HEAD_MAX: usize = 4096;
const OK200: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// The upstream port of a complete `CONNECT bench.test:PORT` head; `None`: anything else.
fn target(head: &[u8]) -> Option<u16> {
    std::str::from_utf8(head)
        .ok()?
        .lines()
        .next()?
        .strip_prefix("CONNECT bench.test:")?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// One tunnel, to its end (errors end it: both sockets are dropped, i.e. closed).
async fn tunnel(mut client: TcpStream) -> io::Result<()> {
    let mut head = [0u8; HEAD_MAX];
    let mut len = 0;
    let end = loop {
        let n = client.read(&mut head[len..]).await?;
        if n == 0 {
            return Ok(());
        }
        len += n;
        if let Some(i) = head[..len].windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if len == HEAD_MAX {
            return Ok(());
        }
    };
    let Some(port) = target(&head[..end]) else {
        return Ok(());
    };
    let mut upstream = TcpStream::connect(("127.0.0.1", port)).await?;
    upstream.set_nodelay(true)?;
    client.write_all(OK200).await?;
    // Bytes the client sent after the head go first.
    upstream.write_all(&head[end..len]).await?;
    let (mut client_rx, mut client_tx) = client.split();
    let (mut upstream_rx, mut upstream_tx) = upstream.split();
    let done = std::sync::atomic::AtomicBool::new(false);
    tokio::try_join!(
        pump(&mut client_rx, &mut upstream_tx, &done),
        pump(&mut upstream_rx, &mut client_tx, &done),
    )?;
    Ok(())
}

/// One direction until its source's EOF; the first direction to get there passes the
/// half-close on (after the second, closing the sockets sends the last FIN).
async fn pump(
    src: &mut ReadHalf<'_>,
    dst: &mut WriteHalf<'_>,
    done: &std::sync::atomic::AtomicBool,
) -> io::Result<()> {
    // Never zeroed (as the agent's burst buffers): reads fill it through `read_buf`.
    let mut buf: Vec<u8> = Vec::with_capacity(BUF);
    loop {
        buf.clear();
        let n = src.read_buf(&mut buf).await?;
        if n == 0 {
            if !done.swap(true, std::sync::atomic::Ordering::Relaxed) {
                socket2::SockRef::from(dst.as_ref()).shutdown(Shutdown::Write)?;
            }
            return Ok(());
        }
        dst.write_all(&buf[..n]).await?;
    }
}

fn main() -> io::Result<()> {
    let Some(out) = std::env::args().nth(1) else {
        eprintln!("usage: relay-floor-tokio ADDR_FILE");
        std::process::exit(2);
    };
    // The daemon's runtime shape (as `proxy-bench serve` runs the agent).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // The accept loop runs on the worker, as the agent's does (a task of its own), so each
    // connection's task is spawned there rather than handed over from another thread.
    rt.block_on(async {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        // Accepted sockets inherit it (no setsockopt per connection), as the agent's do.
        socket2::SockRef::from(&std_listener).set_tcp_nodelay(true)?;
        std_listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std_listener)?;
        let addr = listener.local_addr()?;
        let tmp = format!("{out}.tmp");
        std::fs::write(&tmp, format!("bench {addr}\n"))?;
        std::fs::rename(&tmp, &out)?;
        tokio::spawn(accept_loop(listener))
            .await
            .map_err(io::Error::other)
    })
}

/// Accept until killed, each connection on a task of its own.
async fn accept_loop(listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                tokio::spawn(async move {
                    tunnel(s).await.ok();
                });
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}
