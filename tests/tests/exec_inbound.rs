//! Inbound connections are policy too (issue #10, part 2).
//!
//! A command under `exec` runs in the host's network namespace, so a listener of its own is
//! reachable from the LAN and from the host: `python3 -m http.server` would be an exfiltration
//! channel that needs no `connect()`. Under `deny_all` and an allowlist, a peer outside the
//! policy that connects in must never get a byte back — checked by the server probe never
//! accepting anyone. Allowed peers (`allow_inbound`) do get through, and a command's own test
//! suite may talk to the servers it started on loopback.
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use egress_tests::agent::{TestConfig, agent_bin, assert_enforcement_intact, probe_bin};
use egress_tests::netns::Netns;
use egress_tests::{marker, root_or_skip};

const PORT: u16 = 7333;

/// `exec --policy P --config C -- probe serve PORT MARKER`, once it listens.
struct Server {
    child: Child,
    marker: String,
    stderr: std::sync::mpsc::Receiver<String>,
}

impl Server {
    fn start(policy: &str, cfg: &TestConfig) -> Server {
        let m = marker("inbound");
        let mut child = Command::new(agent_bin())
            .args(["exec", "--policy", policy, "--config"])
            .arg(&cfg.path)
            .arg("--")
            .arg(probe_bin())
            .args(["serve", &PORT.to_string(), &m])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn exec serve");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "listening", "server did not start: {line:?}");
        let err = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        Server {
            child,
            marker: m,
            stderr: rx,
        }
    }

    /// Still waiting for its one client: nobody was ever accepted.
    fn never_accepted(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The denial events the exec logged (it drains the kernel's events of its run).
    fn logged(&self, wait_for: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while let Ok(l) = self
            .stderr
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if l.contains(wait_for) {
                return true;
            }
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .ok();
        self.child.wait().ok();
    }
}

/// Connect to `addr` and read what comes back within a short time.
fn pull(addr: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(1500))
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_millis(1500)))
        .map_err(|e| e.to_string())?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).map_err(|e| e.to_string())?;
    Ok(buf)
}

fn policies(ns: &Netns) -> TestConfig {
    TestConfig::new(&format!(
        "[policies.inbound-list]\nallow_hosts = [\"example.com\"]\n\
         allow_cidrs = [{{ cidr = \"198.19.0.0/16\", ports = [7200] }}]\n\
         [policies.inbound-open]\nallow_hosts = [\"example.com\"]\n\
         allow_inbound = [{{ cidr = \"{}/32\", ports = [{PORT}] }}]\n",
        ns.ns_v4
    ))
}

#[test]
fn inbound_pulls_never_get_a_byte() {
    if !root_or_skip("exec inbound") {
        return;
    }
    let ns = Netns::new();
    let cfg = policies(&ns);
    let lan = SocketAddr::new(ns.host_v4.into(), PORT);
    let lo: SocketAddr = format!("127.0.0.1:{PORT}").parse().expect("addr");
    for policy in ["deny_all", "inbound-list"] {
        let mut server = Server::start(policy, &cfg);
        // A LAN peer (the test namespace), the host's own loopback, another confined command.
        let from_lan = ns.run(move || pull(lan));
        let from_host = pull(lo);
        let other = Command::new(agent_bin())
            .args(["exec", "--policy", "deny_all", "--config"])
            .arg(&cfg.path)
            .arg("--")
            .arg(probe_bin())
            .args(["tcp", "127.0.0.1", &PORT.to_string(), "x"])
            .output()
            .expect("other exec");
        for (who, got) in [("LAN peer", &from_lan), ("host loopback", &from_host)] {
            assert!(
                !got.as_ref().is_ok_and(|b| b.contains(&server.marker)),
                "[{policy}] {who} pulled the server's data: {got:?}"
            );
        }
        assert!(
            String::from_utf8_lossy(&other.stdout).contains("err"),
            "[{policy}] another confined command connected: {other:?}"
        );
        assert!(
            server.never_accepted(),
            "[{policy}] the confined server accepted a connection"
        );
        assert!(
            server.logged("kernel-inbound-not-allowed", Duration::from_secs(3)),
            "[{policy}] no inbound denial event"
        );
        drop(server);
        assert_enforcement_intact(&format!("after inbound pulls under {policy}"));
    }
}

#[test]
fn allow_inbound_admits_the_listed_peer_only() {
    if !root_or_skip("exec inbound allow") {
        return;
    }
    let ns = Netns::new();
    let cfg = policies(&ns);
    let lan = SocketAddr::new(ns.host_v4.into(), PORT);
    let lo: SocketAddr = format!("127.0.0.1:{PORT}").parse().expect("addr");
    // The host's loopback is not in allow_inbound: refused (the server stays unaccepted).
    let mut server = Server::start("inbound-open", &cfg);
    let from_host = pull(lo);
    assert!(
        !from_host.as_ref().is_ok_and(|b| b.contains(&server.marker)),
        "host loopback pulled: {from_host:?}"
    );
    assert!(server.never_accepted(), "host loopback was accepted");
    // The listed peer gets the answer.
    let got = ns.run(move || pull(lan));
    assert!(
        got.as_ref().is_ok_and(|b| b.contains(&server.marker)),
        "the allowed peer got nothing: {got:?}"
    );
}

#[test]
fn a_test_suite_using_its_own_loopback_servers_passes() {
    if !root_or_skip("exec own loopback") {
        return;
    }
    let ns = Netns::new();
    let cfg = policies(&ns);
    let dir = std::env::temp_dir().join(format!("egress-suite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let suite = dir.join("test_local.py");
    std::fs::write(&suite, SUITE).expect("write suite");
    for policy in ["deny_all", "inbound-list"] {
        let out = Command::new(agent_bin())
            .args(["exec", "--policy", policy, "--config"])
            .arg(&cfg.path)
            .arg("--")
            .args(["python3", "-m", "unittest", "-v"])
            .arg(&suite)
            .current_dir(&dir)
            .output()
            .expect("run suite");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "[{policy}] suite failed:\n{err}");
        assert!(
            err.contains("Ran 5 tests") && err.contains("OK"),
            "[{policy}] {err}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// An ordinary test suite: servers on loopback in the same process and in a child process,
/// TCP and UDP, bound or given a port by listen() itself, reached by name and by address (through urllib, which honours the proxy
/// variables `exec` sets: `NO_PROXY` covers loopback).
const SUITE: &str = r#"
import http.server, socket, subprocess, sys, threading, time, unittest, urllib.request

class LocalServers(unittest.TestCase):
    def test_http_in_process(self):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            body = urllib.request.urlopen(f"http://localhost:{srv.server_port}/", timeout=5).read()
            self.assertIn(b"test_local.py", body)
        finally:
            srv.shutdown()

    def test_http_child_process(self):
        probe = socket.socket(); probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]; probe.close()
        child = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 10
            while True:
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.05)
            self.assertIn(b"test_local.py", body)
        finally:
            child.terminate(); child.wait()

    def test_tcp_echo(self):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
        c = socket.create_connection(s.getsockname(), timeout=5)
        a, _ = s.accept(); c.sendall(b"ping"); a.sendall(a.recv(4)); self.assertEqual(c.recv(4), b"ping")

    def test_tcp_listen_without_bind(self):
        # The port comes from listen() itself (no bind()), IPv4 and IPv6: what arrives both ways.
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            s = socket.socket(family); s.listen(); port = s.getsockname()[1]
            c = socket.create_connection((host, port), timeout=5)
            a, _ = s.accept(); c.sendall(b"ping"); self.assertEqual(a.recv(4), b"ping")
            a.sendall(b"pong"); self.assertEqual(c.recv(4), b"pong")
            for x in (a, c, s): x.close()

    def test_udp_echo(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0))
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(5)
        c.sendto(b"ping", s.getsockname())
        data, peer = s.recvfrom(16); s.sendto(data, peer)
        self.assertEqual(c.recv(16), b"ping")
"#;
