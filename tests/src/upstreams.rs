//! Real upstreams for the transparent-interception and DNS tests: a CA the test generates, web
//! servers (python3, HTTP or HTTPS) that log every request they get, a recording dnsmasq, and a
//! dummy interface carrying "public" addresses on this host. Each records what *arrived*.
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A temp directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(what: &str) -> TempDir {
        let dir = std::env::temp_dir().join(crate::marker(what));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// A CA and one server certificate for `names`, as PEM files in `dir` (for servers and clients
/// that read files): [`crate::tls_upstream::TestCa`] written out.
pub struct TestCa {
    pub ca_pem: PathBuf,
    pub cert_pem: PathBuf,
    pub key_pem: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Path, names: &[&str]) -> TestCa {
        let ca = crate::tls_upstream::TestCa::new();
        let (chain, key) = ca.leaf(names);
        let out = TestCa {
            ca_pem: dir.join("ca.pem"),
            cert_pem: dir.join("server.pem"),
            key_pem: dir.join("server.key"),
        };
        let cert: String = chain
            .iter()
            .map(|c| pem::encode(&pem::Pem::new("CERTIFICATE", c.to_vec())))
            .collect();
        let key = pem::encode(&pem::Pem::new("PRIVATE KEY", key.secret_der().to_vec()));
        std::fs::write(&out.ca_pem, &ca.pem).expect("write ca");
        std::fs::write(&out.cert_pem, cert).expect("write cert");
        std::fs::write(&out.key_pem, key).expect("write key");
        out
    }
}

const WEB_SERVER: &str = r#"
import http.server, socket, ssl, sys
host, port = sys.argv[1], int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        print("HIT", self.headers.get("Host"), self.path, flush=True)
        body = ("upstream-ok " + sys.argv[5] + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
class S(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    daemon_threads = True
srv = S((host, port), H)
if sys.argv[3] != "-":
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[3], sys.argv[4])
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("READY", flush=True)
srv.serve_forever()
"#;

/// A server child (the python3 scripts here) that prints `READY` (or `READY <port>`) once it
/// listens and `HIT <record>` for each request: the records, parsed by `parse`, kept in order.
/// Killed on drop.
pub struct ScriptServer<H> {
    child: Child,
    hits: Arc<Mutex<Vec<H>>>,
}

impl<H: Clone + Send + 'static> ScriptServer<H> {
    /// Spawn `cmd` (its stdout piped here) and wait for its `READY` line: the port it printed,
    /// if any. `what` names it in the panic if it never gets there.
    pub fn start(
        cmd: &mut Command,
        what: &str,
        parse: fn(&str) -> H,
    ) -> (ScriptServer<H>, Option<u16>) {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let hits = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let h = hits.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(port) = line.strip_prefix("READY") {
                    ready_tx.send(port.trim().parse::<u16>().ok()).ok();
                } else if let Some(hit) = line.strip_prefix("HIT ") {
                    let hit = parse(hit);
                    h.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(hit);
                }
            }
        });
        let port = ready_rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{what} did not start"));
        (ScriptServer { child, hits }, port)
    }

    /// Every request so far.
    pub fn hits(&self) -> Vec<H> {
        self.hits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl<H> Drop for ScriptServer<H> {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A python3 web server (HTTPS with `tls`) answering `upstream-ok <tag>` and logging each
/// request's Host header and path. Killed on drop.
pub struct WebServer {
    server: ScriptServer<String>,
    pub addr: SocketAddr,
}

impl WebServer {
    pub fn start(addr: SocketAddr, tls: Option<&TestCa>, tag: &str) -> WebServer {
        let (cert, key) = match tls {
            Some(ca) => (
                ca.cert_pem.display().to_string(),
                ca.key_pem.display().to_string(),
            ),
            None => ("-".to_owned(), "-".to_owned()),
        };
        let mut cmd = Command::new("python3");
        cmd.args(["-u", "-c", WEB_SERVER])
            .arg(addr.ip().to_string())
            .arg(addr.port().to_string())
            .args([cert, key, tag.to_owned()])
            .stderr(Stdio::null());
        let (server, _) =
            ScriptServer::start(&mut cmd, &format!("web server on {addr}"), str::to_owned);
        WebServer { server, addr }
    }

    /// Requests received so far: `"<Host header> <path>"`.
    pub fn hits(&self) -> Vec<String> {
        self.server.hits()
    }

    /// Did a request whose path contains `marker` arrive?
    pub fn saw(&self, marker: &str) -> bool {
        self.hits().iter().any(|h| h.contains(marker))
    }
}

/// dnsmasq on `listen` answering `records` (name → address) with TTL 1 and logging every query
/// it receives; no other upstream. Killed on drop.
pub struct Dnsmasq {
    child: Child,
    log: PathBuf,
    pub listen: SocketAddr,
}

impl Dnsmasq {
    pub fn start(dir: &Path, listen: SocketAddr, records: &[(&str, IpAddr)]) -> Dnsmasq {
        let log = dir.join("dnsmasq.log");
        std::fs::write(&log, "").expect("log file");
        let mut cmd = Command::new("dnsmasq");
        cmd.args([
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--bind-interfaces",
            "--log-queries",
            "--local-ttl=1",
            "--cache-size=0",
            "--user=root",
        ])
        .arg(format!("--pid-file={}", dir.join("dnsmasq.pid").display()))
        .arg(format!("--listen-address={}", listen.ip()))
        .arg(format!("--port={}", listen.port()))
        .arg(format!("--log-facility={}", log.display()));
        for (name, ip) in records {
            cmd.arg(format!("--address=/{name}/{ip}"));
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq (apt install dnsmasq)");
        let d = Dnsmasq { child, log, listen };
        // Ready once it answers (a query of its own, logged like any other).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.log().contains("started") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Queries received for names containing `needle` (case-insensitive).
    pub fn queries_for(&self, needle: &str) -> usize {
        let needle = needle.to_ascii_lowercase();
        self.log()
            .lines()
            .filter(|l| l.contains("query[") && l.to_ascii_lowercase().contains(&needle))
            .count()
    }

    /// Wait until a query for `needle` was logged.
    pub fn wait_query(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.queries_for(needle) > 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A local link (a veth pair) in the caller's network namespace carrying `addrs` (/32 and /128): local
/// addresses outside the built-in deny list, so the agent treats them as public. Removed on drop.
pub struct DummyNet {
    pub name: String,
}

impl DummyNet {
    pub fn new(name: &str, addrs: &[IpAddr]) -> DummyNet {
        crate::sh_quiet(&format!("ip link del {name}"));
        // A veth pair, not a `dummy` link: not every kernel has the dummy module (this machine
        // kind doesn't); addresses on either end are local to the namespace all the same.
        crate::sh(&format!(
            "ip link add {name} type veth peer name {name}p && ip link set {name} up && ip link set {name}p up"
        ));
        for a in addrs {
            let (len, flags) = if a.is_ipv4() {
                (32, "")
            } else {
                (128, " nodad")
            };
            crate::sh(&format!("ip addr add {a}/{len} dev {name}{flags}"));
        }
        DummyNet {
            name: name.to_owned(),
        }
    }
}

impl Drop for DummyNet {
    fn drop(&mut self) {
        crate::sh_quiet(&format!("ip link del {}", self.name));
    }
}
