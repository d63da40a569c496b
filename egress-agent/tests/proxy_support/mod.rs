//! Shared harness for the proxy integration tests: a policy listener on loopback, a real echo
//! upstream and a real HTTP upstream on loopback (reachable by name only, through the test policy's
//! `resolve_private = ["127.0.0.1/32"]`: no IP literal and no other loopback address), and a hosts
//! file the test controls (DNS never leaves the machine: no nameservers).
#![allow(dead_code, reason = "each test binary uses a different subset")]
#![expect(clippy::unwrap_used, reason = "test harness")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use egress_agent::config::Config;
use egress_agent::events::EventSink;
use egress_agent::proxy::{Identity, PolicyHandle, PolicyProxy, ProxyContext};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

pub const T: Duration = Duration::from_secs(5);

pub struct Upstreams {
    pub echo: SocketAddr,
    pub http: SocketAddr,
    /// A port nothing listens on (connect refused).
    pub closed: SocketAddr,
}

/// Echo server: writes back whatever it reads.
pub async fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                tokio::io::copy(&mut r, &mut w).await.ok();
            });
        }
    });
    addr
}

/// HTTP server answering every request with a description of what it received (request line,
/// Host, header names, body length) so tests can see what the proxy forwarded.
pub async fn http_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let line = format!("{} {}", req.method(), req.uri());
                        let host = req
                            .headers()
                            .get("host")
                            .map(|v| v.to_str().unwrap_or("?").to_owned())
                            .unwrap_or_default();
                        let names: Vec<String> = req
                            .headers()
                            .keys()
                            .map(|k| k.as_str().to_owned())
                            .collect();
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes().len())
                            .unwrap_or(0);
                        let text = format!(
                            "line={line}\nhost={host}\nheaders={}\nbody={body}\n",
                            names.join(",")
                        );
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(text))))
                    },
                );
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await
                    .ok();
            });
        }
    });
    addr
}

pub async fn upstreams() -> Upstreams {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    Upstreams {
        echo: echo_server().await,
        http: http_server().await,
        closed,
    }
}

static N: AtomicU32 = AtomicU32::new(0);

/// A directory removed when dropped.
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

pub fn temp_dir() -> TempDir {
    let d = std::env::temp_dir().join(format!(
        "egress-proxy-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    // A kept /tmp may hold a directory of this name from a run that had the same pid.
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

/// Names the tests resolve, all on loopback or special addresses; nothing reaches a real resolver.
/// Two preset hosts (`anthropic`, `openai`) are here so a policy's `presets` can be tried on the
/// loopback upstreams.
pub const HOSTS: &str = "\
127.0.0.1 allowed.test api.wild.test deep.api.wild.test wild.test other.test
127.0.0.2 rebind.test
169.254.169.254 metadata.test
169.254.169.254 meta2.test
10.0.0.1 private.test
127.0.0.1 mixed.test
10.1.2.3 mixed.test
::1 v6loop.test
127.0.0.1 api.anthropic.com api.openai.com
";

pub struct Harness {
    pub addr: SocketAddr,
    pub events: EventSink,
    pub handle: PolicyHandle,
    pub up: Upstreams,
    pub config: Arc<Config>,
    stop: Option<oneshot::Sender<()>>,
    _dir: TempDir,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            s.send(()).ok();
        }
    }
}

/// The test policy: allowlist of a few `.test` names on the upstream ports; names may resolve to
/// the loopback upstreams through `resolve_private` (127.0.0.1/32, through the proxy only). IP
/// literals stay refused unless `policy_extra` adds an `allow_cidrs` entry.
/// `proxy.kernel_relay` for the proxy tests: `EGRESS_TEST_KERNEL_RELAY` = `on` (every
/// pass-through tunnel spliced in the kernel at once — `kernel_relay_after_reads = 0`, so the
/// splice path sees every test's tunnels —, the proxy refuses to start without it: needs root
/// and the eBPF object) or `off` (the user-space relay; the default, so an unprivileged run needs
/// nothing). `cargo xtask test` runs the proxy tests both ways.
pub fn kernel_relay_mode() -> &'static str {
    match std::env::var("EGRESS_TEST_KERNEL_RELAY").as_deref() {
        Ok("on") => "on",
        Ok("off") | Err(_) => "off",
        Ok(other) => panic!("EGRESS_TEST_KERNEL_RELAY={other}: expected on or off"),
    }
}

pub fn test_config(
    up: &Upstreams,
    hosts_file: &Path,
    proxy_extra: &str,
    policy_extra: &str,
) -> Config {
    let toml = format!(
        r#"
[proxy]
connect_timeout_ms = 2000
kernel_relay = "{relay}"
{after}
{proxy_extra}
[dns]
nameservers = []
hosts_file = "{hosts}"
timeout_ms = 500
attempts = 1

[policies.test]
mode = "allowlist"
allow_hosts = ["allowed.test", "*.wild.test", "rebind.test", "metadata.test", "private.test", "mixed.test", "v6loop.test", "bücher.test"]
allow_ports = [{echo}, {http}, {closed}]
resolve_private = ["127.0.0.1/32"]
{policy_extra}
"#,
        hosts = hosts_file.display(),
        relay = kernel_relay_mode(),
        // Unless the test sets its own.
        after = if proxy_extra.contains("kernel_relay_after_reads") {
            ""
        } else {
            "kernel_relay_after_reads = 0"
        },
        echo = up.echo.port(),
        http = up.http.port(),
        closed = up.closed.port(),
    );
    Config::from_toml_str(&toml, Path::new("test.toml")).unwrap()
}

pub async fn harness_with(proxy_extra: &str, policy_extra: &str, policy: &str) -> Harness {
    harness_on(upstreams().await, proxy_extra, policy_extra, policy, None).await
}

/// The test policy's listener on `up`'s upstreams, reporting to `metrics` if given.
pub async fn harness_on(
    up: Upstreams,
    proxy_extra: &str,
    policy_extra: &str,
    policy: &str,
    metrics: Option<Arc<egress_agent::metrics::Metrics>>,
) -> Harness {
    harness_ctx(
        up,
        proxy_extra,
        policy_extra,
        policy,
        move |ctx| match metrics {
            Some(m) => ctx.with_metrics(m),
            None => ctx,
        },
    )
    .await
}

/// [`harness_on`] with the proxy context adjusted by `tweak` (e.g. a given kernel relay).
pub async fn harness_ctx(
    up: Upstreams,
    proxy_extra: &str,
    policy_extra: &str,
    policy: &str,
    tweak: impl FnOnce(ProxyContext) -> ProxyContext,
) -> Harness {
    harness_for(up, proxy_extra, policy_extra, policy, None, tweak).await
}

/// [`harness_ctx`] for one workload: `identity` is what the enforcer gives a container's
/// listener (its access requests and run grants are kept under it).
pub async fn harness_for(
    up: Upstreams,
    proxy_extra: &str,
    policy_extra: &str,
    policy: &str,
    identity: Option<Identity>,
    tweak: impl FnOnce(ProxyContext) -> ProxyContext,
) -> Harness {
    let dir = temp_dir();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, HOSTS).unwrap();
    let config = Arc::new(test_config(&up, &hosts, proxy_extra, policy_extra));
    let events = EventSink::new(256);
    let ctx = tweak(
        ProxyContext::new(&config, events.clone())
            .unwrap()
            .admit_any_peer(),
    );
    let proxy = PolicyProxy::bind_for(
        "127.0.0.1:0".parse().unwrap(),
        policy.to_owned(),
        Arc::new(config.policy(policy).unwrap().clone()),
        ctx,
        identity,
    )
    .await
    .unwrap();
    let addr = proxy.local_addr();
    let handle = proxy.policy_handle();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(proxy.run(async move {
        rx.await.ok();
    }));
    Harness {
        addr,
        events,
        handle,
        up,
        config,
        stop: Some(tx),
        _dir: dir,
    }
}

pub async fn harness() -> Harness {
    harness_with("header_timeout_ms = 2000", "", "test").await
}

/// A parsed response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn deny(&self) -> Option<&str> {
        self.header("x-egress-deny")
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Read one response (head + Content-Length body, or no body for 200 to CONNECT). Returns the
/// response and any bytes read past it.
pub async fn read_response(s: &mut TcpStream, connect: bool) -> (Resp, Vec<u8>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(len) = r.parse(&buf).unwrap() {
            let status = r.code.unwrap();
            let hs: Vec<(String, String)> = r
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_owned(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect();
            let cl: usize = hs
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .map(|(_, v)| v.parse().unwrap())
                .unwrap_or(0);
            let body_len = if connect && status == 200 { 0 } else { cl };
            while buf.len() < len + body_len {
                let n = tokio::time::timeout(T, s.read(&mut chunk))
                    .await
                    .unwrap()
                    .unwrap();
                assert!(n > 0, "eof inside body");
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = buf[len..len + body_len].to_vec();
            let rest = buf[len + body_len..].to_vec();
            return (
                Resp {
                    status,
                    headers: hs,
                    body,
                },
                rest,
            );
        }
        let n = tokio::time::timeout(T, s.read(&mut chunk))
            .await
            .expect("response timed out")
            .unwrap();
        assert!(
            n > 0,
            "eof before response head; got {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// `GET http://{authority}{path}` (Host: `host`) on an open, possibly kept-alive connection;
/// the response.
pub async fn get_with_host(s: &mut TcpStream, authority: &str, path: &str, host: &str) -> Resp {
    s.write_all(
        format!("GET http://{authority}{path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let (r, rest) = read_response(s, false).await;
    assert!(rest.is_empty(), "bytes after the response");
    r
}

/// [`get_with_host`] with a Host header that agrees with the URI.
pub async fn get(s: &mut TcpStream, authority: &str, path: &str) -> Resp {
    get_with_host(s, authority, path, authority).await
}

/// Send raw bytes on a fresh connection and read one response.
pub async fn exchange(proxy: SocketAddr, raw: &[u8]) -> Resp {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(raw).await.unwrap();
    read_response(&mut s, raw.starts_with(b"CONNECT")).await.0
}

pub async fn connect(proxy: SocketAddr, authority: &str) -> (Resp, TcpStream) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (r, rest) = read_response(&mut s, true).await;
    assert!(rest.is_empty());
    (r, s)
}

/// Send a CONNECT for `target` on `s` and assert nothing comes back for 300 ms: the proxy holds
/// the connection in its backlog (a connection bound is reached). `why` names the bound.
pub async fn assert_connect_waits(s: &mut TcpStream, target: &str, why: &str) {
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut b = [0u8; 16];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), s.read(&mut b))
            .await
            .is_err(),
        "served beyond {why}"
    );
}

/// Write `data` on `s` (a tunnel to an echo server) and assert the same bytes come back within
/// [`T`].
pub async fn assert_echo(s: &mut TcpStream, data: &[u8]) {
    s.write_all(data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(T, s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, data, "the echo came back as sent");
}

/// Assert the peer closes the connection within `within` (reads until EOF or error).
pub async fn assert_closed(s: &mut TcpStream, within: Duration) {
    let mut b = [0u8; 1024];
    let res = tokio::time::timeout(within, async {
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(res.is_ok(), "connection still open after {within:?}");
}
