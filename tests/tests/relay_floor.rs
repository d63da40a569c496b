//! `relay-floor` (the benchmark's lower-bound relay) really relays: its tunnels/s figures only
//! mean something if every counted tunnel carried the bytes both ways and passed both EOFs on.
//! Loopback only; no privileges needed.

use std::io::{BufRead, BufReader, Read, Write};
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

fn start() -> Relay {
    let dir = tempdir::Dir::new();
    let out = dir.0.join("addr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_relay-floor"))
        .arg(&out)
        .spawn()
        .expect("spawn relay-floor");
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
                "relay-floor exited: {st} (is io_uring disabled? /proc/sys/kernel/io_uring_disabled)"
            );
        }
        assert!(Instant::now() < deadline, "relay-floor did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    Relay {
        child,
        addr,
        _dir: dir,
    }
}

/// CONNECT through the relay; the answer's status line.
fn connect(relay: SocketAddr, target: &str) -> (TcpStream, Option<String>) {
    let mut s = TcpStream::connect(relay).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut status = String::new();
    if r.read_line(&mut status).unwrap_or(0) == 0 {
        return (s, None);
    }
    let mut line = String::new();
    while r.read_line(&mut line).unwrap() > 2 {
        line.clear();
    }
    assert!(r.buffer().is_empty(), "bytes after the answer's head");
    (s, Some(status))
}

#[test]
fn relays_both_ways_and_passes_both_eofs_on() {
    let relay = start();
    let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = upstream.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = upstream.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap(); // ends only when the client's EOF is passed on
        s.write_all(&got).unwrap();
        s.write_all(b"|from upstream").unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        got
    });
    let (mut s, status) = connect(relay.addr, &format!("bench.test:{port}"));
    assert_eq!(
        status.as_deref().map(str::trim_end),
        Some("HTTP/1.1 200 Connection established")
    );
    // More than one relay buffer, so the pump loops.
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    s.write_all(&payload).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap(); // ends only when the upstream's EOF is passed on
    assert_eq!(
        server.join().unwrap(),
        payload,
        "upstream got the client's bytes"
    );
    let mut want = payload.clone();
    want.extend_from_slice(b"|from upstream");
    assert_eq!(back, want, "client got the upstream's bytes");
}

#[test]
fn refuses_anything_but_the_bench_name() {
    let relay = start();
    let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
    upstream.set_nonblocking(true).unwrap();
    let port = upstream.local_addr().unwrap().port();
    for target in [
        format!("127.0.0.1:{port}"),
        format!("other.test:{port}"),
        "bench.test:0".to_owned(),
    ] {
        let (_s, status) = connect(relay.addr, &target);
        assert_eq!(status, None, "{target}: closed without an answer");
    }
    assert!(
        upstream.accept().is_err(),
        "nothing reached the upstream for a refused target"
    );
}
