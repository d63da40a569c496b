//! `relay-floor` and `relay-floor-tokio` (the benchmark's reference relays: io_uring, and tokio's
//! readiness model) really relay: their tunnels/s and CPU figures only mean something if every
//! counted tunnel carried the bytes both ways and passed both EOFs on. Loopback only; no
//! privileges needed.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Relay {
    child: Child,
    addr: SocketAddr,
    _dir: tempdir::Dir,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

mod tempdir {
    /// A private directory under the system temp dir, removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p =
                std::env::temp_dir().join(format!("relay-floor-test-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&p).expect("temp dir");
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            std::fs::remove_dir_all(&self.0).ok();
        }
    }
}

/// `false` (and says so) where this kernel or user may not use io_uring
/// (`kernel.io_uring_disabled`, seccomp): the relay can't run there.
fn io_uring_available() -> bool {
    match io_uring::IoUring::new(2) {
        Ok(_) => true,
        Err(e) => {
            // Straight to the stderr fd: libtest's capture only intercepts `eprintln!`.
            std::io::stderr()
                .write_all(format!("skipping: io_uring unavailable here ({e})\n").as_bytes())
                .ok();
            false
        }
    }
}

const URING: &str = env!("CARGO_BIN_EXE_relay-floor");
const TOKIO: &str = env!("CARGO_BIN_EXE_relay-floor-tokio");

fn start(bin: &str) -> Relay {
    let dir = tempdir::Dir::new();
    let out = dir.0.join("addr");
    let mut child = Command::new(bin)
        .arg(&out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    let addr = loop {
        if let Some(a) = std::fs::read_to_string(&out)
            .ok()
            .and_then(|t| t.trim().strip_prefix("bench ")?.parse().ok())
        {
            break a;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "{bin} exited: {st} (relay-floor: is io_uring disabled? /proc/sys/kernel/io_uring_disabled)"
            );
        }
        assert!(Instant::now() < deadline, "{bin} did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    Relay {
        child,
        addr,
        _dir: dir,
    }
}

/// CONNECT through the relay; the answer's status line.
fn connect(relay: SocketAddr, target: &str) -> io::Result<(TcpStream, Option<String>)> {
    let mut s = TcpStream::connect(relay)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n")?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut status = String::new();
    if r.read_line(&mut status).unwrap_or(0) == 0 {
        return Ok((s, None));
    }
    let mut line = String::new();
    while r.read_line(&mut line)? > 2 {
        line.clear();
    }
    assert!(r.buffer().is_empty(), "bytes after the answer's head");
    Ok((s, Some(status)))
}

#[test]
fn relays_both_ways_and_passes_both_eofs_on() -> io::Result<()> {
    if !io_uring_available() {
        return Ok(());
    }
    relays_both_ways(URING)
}

#[test]
fn the_tokio_floor_relays_both_ways_and_passes_both_eofs_on() -> io::Result<()> {
    relays_both_ways(TOKIO)
}

#[test]
fn refuses_anything_but_the_bench_name() -> io::Result<()> {
    if !io_uring_available() {
        return Ok(());
    }
    refuses_others(URING)
}

#[test]
fn the_tokio_floor_refuses_anything_but_the_bench_name() -> io::Result<()> {
    refuses_others(TOKIO)
}

fn relays_both_ways(bin: &str) -> io::Result<()> {
    let relay = start(bin);
    let upstream = TcpListener::bind("127.0.0.1:0")?;
    let port = upstream.local_addr()?.port();
    let server = std::thread::spawn(move || -> io::Result<Vec<u8>> {
        let (mut s, _) = upstream.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut got = Vec::new();
        s.read_to_end(&mut got)?; // ends only when the client's EOF is passed on
        s.write_all(&got)?;
        s.write_all(b"|from upstream")?;
        s.shutdown(Shutdown::Write)?;
        Ok(got)
    });
    let (mut s, status) = connect(relay.addr, &format!("bench.test:{port}"))?;
    assert_eq!(
        status.as_deref().map(str::trim_end),
        Some("HTTP/1.1 200 Connection established")
    );
    // More than one relay buffer, so the pump loops.
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    s.write_all(&payload)?;
    s.shutdown(Shutdown::Write)?;
    let mut back = Vec::new();
    s.read_to_end(&mut back)?; // ends only when the upstream's EOF is passed on
    assert_eq!(
        server.join().expect("upstream thread")?,
        payload,
        "upstream got the client's bytes"
    );
    let mut want = payload.clone();
    want.extend_from_slice(b"|from upstream");
    assert_eq!(back, want, "client got the upstream's bytes");
    Ok(())
}

fn refuses_others(bin: &str) -> io::Result<()> {
    let relay = start(bin);
    let upstream = TcpListener::bind("127.0.0.1:0")?;
    upstream.set_nonblocking(true)?;
    let port = upstream.local_addr()?.port();
    for target in [
        format!("127.0.0.1:{port}"),
        format!("other.test:{port}"),
        "bench.test:0".to_owned(),
    ] {
        let (_s, status) = connect(relay.addr, &target)?;
        assert_eq!(status, None, "{target}: closed without an answer");
    }
    assert!(
        upstream.accept().is_err(),
        "nothing reached the upstream for a refused target"
    );
    Ok(())
}
