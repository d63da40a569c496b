//! Harness for the interception tests: a test CA (rcgen), a TLS upstream on loopback that speaks
//! h2 and HTTP/1.1 and **records what it received**, a policy listener with credential bindings
//! and request rules, and everything the agent wrote (events, log lines) for the no-leak checks.
#![allow(dead_code, reason = "each test binary uses a different subset")]
#![expect(clippy::unwrap_used, reason = "test harness")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use egress_agent::config::Config;
use egress_agent::events::EventSink;
use egress_agent::proxy::{PolicyProxy, ProxyContext};
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, oneshot};

#[path = "../proxy_support/mod.rs"]
pub mod proxy_support;
pub use proxy_support::{T, TempDir, temp_dir};

/// The real secret (what only the upstream may see) and the placeholder the client holds.
pub const SECRET: &str = "sk-real-Zq8v2LmP0xW7-never-leak";
pub const PLACEHOLDER: &str = "egress-ph-7f3a9c1d5e";
/// HTTP Basic (`basic.test`, user `bot`): the password the upstream gets, and the client's.
pub const SECRET_BASIC: &str = "pw-Basic-4kQz9x2Lm7Vt";
pub const PLACEHOLDER_BASIC: &str = "ph-basic-0001";
/// A secret every encoding changes (`sym.test`, header `x-api-key`): `/`, `+`, `"`, `&`, `=`,
/// `<`, `>`, space, `~`, `!` and non-ASCII.
pub const SECRET_SYM: &str = "Sym/+\"&=\u{e9}<k>9Qz!~ tail";
pub const PLACEHOLDER_SYM: &str = "ph-sym-0001";

/// The forms `/mirror-<form>?h=<header>` echoes a request header's value in.
pub const MIRROR_FORMS: [&str; 14] = [
    "raw",
    "base64",
    "base64url",
    "json",
    "json-ascii",
    "percent",
    "percent-lower",
    "form",
    "hex",
    "gzip",
    "chunks",
    "location",
    "basic-decoded",
    "sse",
];

fn percent(v: &[u8], keep: &[u8], lower: bool, plus: bool) -> String {
    let mut s = String::new();
    for &b in v {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            s.push(b as char);
        } else if plus && b == b' ' {
            s.push('+');
        } else if lower {
            s.push_str(&format!("%{b:02x}"));
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// `v` the way `/mirror-<form>` puts it in the body (or header, for `location`).
pub fn mirror(form: &str, v: &[u8]) -> Vec<u8> {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    let text = String::from_utf8_lossy(v);
    match form {
        "base64" => STANDARD.encode(v).into_bytes(),
        "base64url" => URL_SAFE_NO_PAD.encode(v).into_bytes(),
        "json" => serde_json::json!({ "echo": text }).to_string().into_bytes(),
        "json-ascii" => {
            let mut s = String::from("{\"echo\": \"");
            for c in text.chars() {
                match c {
                    '"' => s.push_str("\\\""),
                    '\\' => s.push_str("\\\\"),
                    '/' => s.push_str("\\/"),
                    c if c.is_ascii() && !c.is_ascii_control() => s.push(c),
                    c => {
                        let mut buf = [0u16; 2];
                        for u in c.encode_utf16(&mut buf) {
                            s.push_str(&format!("\\u{u:04x}"));
                        }
                    }
                }
            }
            s.push_str("\"}");
            s.into_bytes()
        }
        "percent" => percent(v, b"-._~", false, false).into_bytes(),
        "percent-lower" => percent(v, b"-._~", true, false).into_bytes(),
        "form" => percent(v, b"*-._", false, true).into_bytes(),
        "hex" => v
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
            .into_bytes(),
        "basic-decoded" => match v.strip_prefix(b"Basic ") {
            Some(b) => STANDARD.decode(b).unwrap_or_default(),
            None => v.to_vec(),
        },
        // raw, gzip (compressed on the wire), chunks and sse (split on the wire), location
        _ => v.to_vec(),
    }
}

type MirrorFrames = Vec<Bytes>;

/// The mirror's response: status, headers, body frames.
fn mirror_response(form: &str, v: &[u8]) -> (u16, Vec<(&'static str, String)>, MirrorFrames) {
    let body = mirror(form, v);
    match form {
        "gzip" => {
            use std::io::Write;
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(b"echo: ").unwrap();
            e.write_all(&body).unwrap();
            let z = e.finish().unwrap();
            (
                200,
                vec![("content-encoding", "gzip".to_owned())],
                vec![Bytes::from(z)],
            )
        }
        "chunks" => (
            200,
            Vec::new(),
            body.iter().map(|b| Bytes::copy_from_slice(&[*b])).collect(),
        ),
        "sse" => {
            let mid = body.len() / 2;
            (
                200,
                vec![("content-type", "text/event-stream".to_owned())],
                vec![
                    Bytes::from([b"data: ".as_slice(), &body[..mid]].concat()),
                    Bytes::from([&body[mid..], b"\n\n".as_slice()].concat()),
                ],
            )
        }
        "location" => (
            302,
            vec![(
                "location",
                format!(
                    "https://elsewhere.test/cb?token={}",
                    percent(v, b"-._~", false, false)
                ),
            )],
            vec![Bytes::from_static(b"moved\n")],
        ),
        _ => (200, Vec::new(), vec![Bytes::from(body)]),
    }
}

/// Everything the agent logs in this test process (a global subscriber writes here).
pub fn log_bytes() -> Vec<u8> {
    LOG.get()
        .map(|l| l.lock().unwrap().clone())
        .unwrap_or_default()
}

static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

#[derive(Clone)]
struct LogWriter(Arc<Mutex<Vec<u8>>>);
impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn init_logging() {
    let buf = LOG.get_or_init(|| Arc::new(Mutex::new(Vec::new()))).clone();
    let w = LogWriter(buf);
    tracing_subscriber::fmt()
        // The test upstream's WebSocket library traces frame payloads (what it sends): not the
        // agent's log.
        .with_env_filter("trace,tungstenite=off,tokio_tungstenite=off")
        .with_writer(move || w.clone())
        .with_ansi(false)
        .try_init()
        .ok();
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    /// Path and query.
    pub target: String,
    pub version: String,
    pub headers: Vec<(String, String)>,
    pub body_len: usize,
    /// The body as received (decoded from the framing).
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A test CA and certificates it issues.
pub struct TestCa {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "egress test upstream CA");
        let cert = p.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: Issuer::new(p, key),
        }
    }

    pub fn leaf(&self, names: &[&str]) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let p = CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
            .unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }
}

/// The recording TLS upstream.
pub struct Upstream {
    pub addr: SocketAddr,
    pub cert: CertificateDer<'static>,
    pub seen: Arc<Mutex<Vec<Received>>>,
    /// `/sse` sends its first event, then waits for this before the second and the end.
    pub sse_gate: Arc<Notify>,
    /// TCP connections accepted (whether or not a request followed).
    pub accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl Upstream {
    pub fn requests(&self) -> Vec<Received> {
        self.seen.lock().unwrap().clone()
    }
}

type UpBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn upstream_service(
    req: hyper::Request<Incoming>,
    seen: Arc<Mutex<Vec<Received>>>,
    gate: Arc<Notify>,
) -> Result<hyper::Response<UpBody>, Infallible> {
    {
        let mut req = req;
        let method = req.method().as_str().to_owned();
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_default();
        let version = format!("{:?}", req.version());
        let mut headers: Vec<(String, String)> = req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        if let Some(a) = req.uri().authority() {
            headers.push((":authority".to_owned(), a.as_str().to_owned()));
        }
        let path = req.uri().path().to_owned();
        let reflect = req.headers().get("authorization").cloned();
        let mirrored = req
            .uri()
            .query()
            .and_then(|q| q.strip_prefix("h="))
            .and_then(|h| req.headers().get(h))
            .map(|v| v.as_bytes().to_vec())
            .unwrap_or_default();
        let ws_key = req.headers().get("sec-websocket-key").cloned();
        let is_ws = path == "/ws" || path == "/ws-reflect";
        let on_upgrade = is_ws.then(|| hyper::upgrade::on(&mut req));
        let mut received = Vec::new();
        if !is_ws {
            let mut body = req.into_body();
            while let Some(f) = body.frame().await {
                match f {
                    Ok(f) => received.extend_from_slice(f.data_ref().map_or(&[][..], |d| d)),
                    Err(_) => break,
                }
            }
        }
        let body_len = received.len();
        seen.lock().unwrap().push(Received {
            method,
            target,
            version: version.clone(),
            headers,
            body_len,
            body: received,
        });
        if path == "/hang" {
            // Recorded, never answered (a receiver that hangs).
            std::future::pending::<()>().await;
        }
        let full = |s: String| Full::new(Bytes::from(s)).boxed();
        let resp = match path.as_str() {
            "/sse" => {
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
                tokio::spawn(async move {
                    tx.send(Ok(Frame::data(Bytes::from_static(b"data: one\n\n"))))
                        .await
                        .ok();
                    gate.notified().await;
                    tx.send(Ok(Frame::data(Bytes::from_static(b"data: two\n\n"))))
                        .await
                        .ok();
                });
                let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
                hyper::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(BodyExt::boxed(StreamBody::new(stream)))
                    .unwrap()
            }
            "/ws" | "/ws-reflect" => {
                // `/ws-reflect` first sends the request's Authorization value as a message.
                let first = (path == "/ws-reflect").then(|| {
                    String::from_utf8_lossy(reflect.as_ref().unwrap().as_bytes()).into_owned()
                });
                let key = ws_key.unwrap();
                let accept =
                    tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
                let on_upgrade = on_upgrade.unwrap();
                tokio::spawn(async move {
                    let up = on_upgrade.await.unwrap();
                    let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
                        TokioIo::new(up),
                        tokio_tungstenite::tungstenite::protocol::Role::Server,
                        None,
                    )
                    .await;
                    if let Some(first) = first {
                        ws.send(tokio_tungstenite::tungstenite::Message::text(first))
                            .await
                            .ok();
                    }
                    while let Some(Ok(m)) = ws.next().await {
                        if m.is_text() || m.is_binary() {
                            ws.send(m).await.ok();
                        }
                    }
                });
                hyper::Response::builder()
                    .status(101)
                    .header("connection", "upgrade")
                    .header("upgrade", "websocket")
                    .header("sec-websocket-accept", accept)
                    .body(full(String::new()))
                    .unwrap()
            }
            "/reflect" => hyper::Response::builder()
                .header(
                    "x-reflected-authorization",
                    reflect.unwrap_or(http::HeaderValue::from_static("-")),
                )
                .body(full("reflected\n".to_owned()))
                .unwrap(),
            p if p.starts_with("/mirror-") => {
                let (status, headers, frames) = mirror_response(&p["/mirror-".len()..], &mirrored);
                let mut b = hyper::Response::builder().status(status);
                for (k, v) in headers {
                    b = b.header(k, v);
                }
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
                tokio::spawn(async move {
                    for f in frames {
                        if tx.send(Ok(Frame::data(f))).await.is_err() {
                            return;
                        }
                        // One frame per write on the wire (the proxy reads them apart).
                        tokio::task::yield_now().await;
                    }
                });
                b.body(BodyExt::boxed(StreamBody::new(
                    tokio_stream::wrappers::ReceiverStream::new(rx),
                )))
                .unwrap()
            }
            _ => hyper::Response::new(full(format!("ok {version} {body_len}\n"))),
        };
        Ok(resp)
    }
}

/// Start the recording upstream with a certificate for `names` from `ca`.
pub async fn upstream(ca: &TestCa, names: &[&str]) -> Upstream {
    let (chain, key) = ca.leaf(names);
    let cert = chain[0].clone();
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sse_gate = Arc::new(Notify::new());
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (s2, g2, a2) = (seen.clone(), sse_gate.clone(), accepted.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            a2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let acceptor = acceptor.clone();
            let (seen, gate) = (s2.clone(), g2.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let svc = hyper::service::service_fn(move |req| {
                    upstream_service(req, seen.clone(), gate.clone())
                });
                let io = TokioIo::new(tls);
                if h2 {
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(io, svc)
                        .await
                        .ok();
                } else {
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .with_upgrades()
                        .await
                        .ok();
                }
            });
        }
    });
    Upstream {
        addr,
        cert,
        seen,
        sse_gate,
        accepted,
    }
}

/// Names the tests use; all on loopback.
pub const HOSTS: &str =
    "127.0.0.1 api.test other.test plain.test rules.test basic.test sym.test audit.test ro.test\n";

/// How the clients of a test reach the agent: the explicit proxy (`HTTPS_PROXY`, `CONNECT`), or
/// straight to the destination the way a program that ignores the proxy variables does, which the
/// kernel redirects to the policy's transparent listener (here: curl's `--connect-to`, python's
/// and node's socket pointed at it; a test `OriginalDst` plays the kernel's map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Proxy,
    Transparent,
}

/// Run each named `async fn name(via: Via)` as two tests: `via_proxy::name`, `transparent::name`.
#[macro_export]
macro_rules! both_ways {
    ($($name:ident),* $(,)?) => {
        mod via_proxy {
            $( #[tokio::test] async fn $name() { super::$name(super::Via::Proxy).await } )*
        }
        mod transparent {
            $( #[tokio::test] async fn $name() { super::$name(super::Via::Transparent).await } )*
        }
    };
}

pub struct Harness {
    pub via: Via,
    pub proxy: SocketAddr,
    /// The policy's transparent listener (where the kernel would redirect a direct connection).
    pub transparent: SocketAddr,
    pub events: EventSink,
    pub up: Upstream,
    pub test_ca: TestCa,
    pub config: Arc<Config>,
    pub ctx: ProxyContext,
    pub dir: TempDir,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            s.send(()).ok();
        }
    }
}

impl Harness {
    pub fn port(&self) -> u16 {
        self.up.addr.port()
    }
    pub fn url(&self, host: &str, path: &str) -> String {
        format!("https://{host}:{}{path}", self.port())
    }
    pub fn proxy_url(&self) -> String {
        format!("http://{}", self.proxy)
    }
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }
    /// The environment a confined command gets (`ca::command_env`) plus the proxy variables
    /// ([`Via::Proxy`]), or `EGRESS_TEST_CONNECT_TO` for the python and node clients of
    /// [`Via::Transparent`] (no proxy variables at all).
    pub fn client_env(&self) -> Vec<(String, String)> {
        let state = self.state_dir();
        let mut env = egress_agent::ca::command_env(
            self.config.policy("test").unwrap(),
            &state.join("ca-bundle.pem"),
            &state.join("ca.pem"),
        );
        match self.via {
            Via::Proxy => {
                for k in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
                    env.push((k.to_owned(), self.proxy_url()));
                }
                env.push(("NO_PROXY".to_owned(), String::new()));
                env.push(("no_proxy".to_owned(), String::new()));
            }
            Via::Transparent => {
                env.push((
                    "EGRESS_TEST_CONNECT_TO".to_owned(),
                    self.transparent.to_string(),
                ));
            }
        }
        env
    }

    /// curl's arguments that reach the agent this harness's way (transparent: every connection
    /// goes to the transparent listener, the URL's name stays the SNI and Host).
    pub fn curl_route(&self) -> Vec<String> {
        match self.via {
            Via::Proxy => Vec::new(),
            Via::Transparent => vec![
                "--connect-to".to_owned(),
                format!("::{}:{}", self.transparent.ip(), self.transparent.port()),
            ],
        }
    }

    /// A python prelude that points every socket at the transparent listener (no-op for the
    /// proxy: urllib uses the proxy variables).
    pub fn python_prelude(&self) -> &'static str {
        "import os, socket\n\
         _to = os.environ.get('EGRESS_TEST_CONNECT_TO')\n\
         if _to:\n\
         \x20   _h, _p = _to.rsplit(':', 1)\n\
         \x20   _cc = socket.create_connection\n\
         \x20   socket.create_connection = lambda a, *x, **k: _cc((_h, int(_p)), *x, **k)\n"
    }

    /// A TCP connection to `host` this harness's way: through `CONNECT`, or straight to the
    /// transparent listener; then TLS with `tls`.
    pub async fn open_tls(
        &self,
        host: &str,
        tls: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        match self.via {
            Via::Proxy => connect_tls(self.proxy, host, self.port(), tls).await,
            Via::Transparent => {
                let s = tokio::net::TcpStream::connect(self.transparent).await?;
                let name = rustls::pki_types::ServerName::try_from(host.to_owned()).unwrap();
                tokio_rustls::TlsConnector::from(tls).connect(name, s).await
            }
        }
    }
    pub fn events_json(&self) -> String {
        self.events
            .recent(1000)
            .iter()
            .map(|e| serde_json::to_string(e).unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    }
    /// Wait for an event with this reason.
    pub async fn wait_event(&self, reason: &str) -> egress_agent::events::DenialEvent {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            if let Some(e) = self
                .events
                .recent(1000)
                .into_iter()
                .find(|e| e.reason == reason)
            {
                return e;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {reason} event; have {}",
                self.events_json()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    /// The secret must be nowhere the agent wrote: events, log lines, state files.
    pub fn assert_no_secret_written(&self, client_saw: &[&[u8]]) {
        let secret = SECRET.as_bytes();
        let has = |b: &[u8]| b.windows(secret.len()).any(|w| w == secret);
        assert!(!has(self.events_json().as_bytes()), "secret in events");
        // What the control API and `check` answer for policies.
        let answer = egress_agent::check::effective_policies(&self.config).to_string();
        assert!(
            answer.contains(PLACEHOLDER),
            "policies answer without the binding"
        );
        assert!(!has(answer.as_bytes()), "secret in the policies answer");
        let log = log_bytes();
        assert!(!log.is_empty(), "the log capture is not working");
        assert!(!has(&log), "secret in the agent's log");
        for e in std::fs::read_dir(self.state_dir()).unwrap() {
            let p = e.unwrap().path();
            assert!(
                !has(&std::fs::read(&p).unwrap()),
                "secret in {}",
                p.display()
            );
        }
        for (i, seen) in client_saw.iter().enumerate() {
            assert!(!has(seen), "the client saw the secret (output {i})");
        }
    }
}

pub async fn harness() -> Harness {
    harness_with("").await
}

pub async fn harness_via(via: Via) -> Harness {
    harness_opts("", true, via).await
}

/// The harness without the upstream's CA configured (only the system roots are trusted).
pub async fn harness_untrusting_upstream(via: Via) -> Harness {
    harness_opts("", false, via).await
}

pub async fn harness_with(extra: &str) -> Harness {
    harness_opts(extra, true, Via::Proxy).await
}

/// Test policy on the recording upstream; `extra` is appended to `[policies.test]`'s tables.
pub async fn harness_opts(extra: &str, trust_upstream: bool, via: Via) -> Harness {
    harness_policy("", extra, trust_upstream, via).await
}

/// [`harness_opts`] with `keys` added to `[policies.test]` itself (e.g. `enforce = "audit"`);
/// `{port}` in `keys` and `extra` is the upstream's port.
pub async fn harness_policy(keys: &str, extra: &str, trust_upstream: bool, via: Via) -> Harness {
    init_logging();
    let dir = temp_dir();
    let test_ca = TestCa::new();
    let up = upstream(
        &test_ca,
        &[
            "api.test",
            "other.test",
            "plain.test",
            "rules.test",
            "basic.test",
            "sym.test",
            "audit.test",
            "ro.test",
        ],
    )
    .await;
    std::fs::write(dir.join("hosts"), HOSTS).unwrap();
    std::fs::write(dir.join("upstream-ca.pem"), &test_ca.pem).unwrap();
    std::fs::write(dir.join("secret"), format!("{SECRET}\n")).unwrap();
    std::fs::write(dir.join("secret-basic"), SECRET_BASIC).unwrap();
    std::fs::write(dir.join("secret-sym"), SECRET_SYM).unwrap();
    let p = up.addr.port();
    let toml = format!(
        r#"
[agent]
state_dir = "{state}"
{intercept}
[proxy]
connect_timeout_ms = 2000
header_timeout_ms = 3000
[dns]
nameservers = []
hosts_file = "{dir}/hosts"
timeout_ms = 500
attempts = 1

[policies.test]
allow_hosts = ["api.test", "other.test", "plain.test", "rules.test", "basic.test", "sym.test",
               {{ host = "ro.test", access = "read-only" }}]
allow_ports = [{p}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{p}] }}]
{keys}

[[policies.test.credentials]]
host = "api.test"
port = {p}
header = "authorization"
prefix = "Bearer "
source = {{ file = "{dir}/secret" }}
placeholder = "{PLACEHOLDER}"
placeholder_env = "API_KEY"
require = true

[[policies.test.credentials]]
host = "basic.test"
port = {p}
basic_user = "bot"
source = {{ file = "{dir}/secret-basic" }}
placeholder = "{PLACEHOLDER_BASIC}"

[[policies.test.credentials]]
host = "sym.test"
port = {p}
header = "x-api-key"
source = {{ file = "{dir}/secret-sym" }}
placeholder = "{PLACEHOLDER_SYM}"

[[policies.test.request_rules]]
host = "api.test"
port = {p}
action = "allow"
methods = ["POST"]
path = "/v1/messages"

[[policies.test.request_rules]]
host = "api.test"
port = {p}
action = "allow"
methods = ["GET", "POST"]
path = "/*"

[[policies.test.request_rules]]
host = "other.test"
port = {p}
action = "deny"
path = "/admin/**"

[[policies.test.request_rules]]
host = "rules.test"
port = {p}
action = "deny"
methods = ["DELETE"]

{extra}
"#,
        keys = keys.replace("{port}", &p.to_string()),
        extra = extra.replace("{port}", &p.to_string()),
        state = dir.join("state").display(),
        dir = dir.display(),
        intercept = if trust_upstream {
            format!(
                "[intercept]\nupstream_ca_file = \"{}/upstream-ca.pem\"",
                dir.display()
            )
        } else {
            String::new()
        },
    );
    let config = Arc::new(Config::from_toml_str(&toml, Path::new("intercept.toml")).unwrap());
    let events = EventSink::new(1000);
    // The kernel's original-destination map, played by a double: every redirected connection
    // was going to a documentation address on the upstream's port. It is never dialled (the
    // proxy dials the name the client sent), so nothing can arrive there.
    let hooks = egress_agent::proxy::InterceptHooks {
        admission: Arc::new(egress_agent::proxy::admission::StaticAdmission::fixed(
            SocketAddr::from(([192, 0, 2, 1], p)),
        )),
        answers: Arc::new(egress_agent::proxy::dns::NoAnswerSink),
    };
    let ctx = ProxyContext::new(&config, events.clone())
        .unwrap()
        .with_interception(hooks);
    let proxy = PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        "test".to_owned(),
        Arc::new(config.policy("test").unwrap().clone()),
        ctx.clone(),
    )
    .await
    .unwrap();
    let addr = proxy.local_addr();
    let transparent = proxy.intercept_addrs().unwrap().transparent.unwrap();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(proxy.run(async move {
        rx.await.ok();
    }));
    Harness {
        via,
        proxy: addr,
        transparent,
        events,
        up,
        test_ca,
        config,
        ctx,
        dir,
        stop: Some(tx),
    }
}

/// Output of a client process.
pub struct Out {
    pub status: std::process::ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Out {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn all(&self) -> Vec<u8> {
        [self.stdout.clone(), self.stderr.clone()].concat()
    }
}

/// Run a client with exactly `env` (plus PATH/HOME), under a timeout.
pub async fn run_client(prog: &str, args: &[&str], env: &[(String, String)]) -> Out {
    let mut cmd = tokio::process::Command::new(prog);
    cmd.args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", "/tmp")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(20), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{prog} timed out"))
        .unwrap_or_else(|e| panic!("{prog}: {e}"));
    Out {
        status: out.status,
        stdout: out.stdout,
        stderr: out.stderr,
    }
}

/// A client-side TLS config trusting only `ca_pem` (ALPN as given).
pub fn client_tls(ca_pem: &str, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for p in pem::parse_many(ca_pem).unwrap() {
        roots.add(CertificateDer::from(p.into_contents())).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Arc::new(cfg)
}

/// CONNECT through the proxy, then TLS with `tls` to `host`.
pub async fn connect_tls(
    proxy: SocketAddr,
    host: &str,
    port: u16,
    tls: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let (resp, s) = proxy_support::connect(proxy, &format!("{host}:{port}")).await;
    assert_eq!(resp.status, 200, "CONNECT {host}");
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(tls).connect(name, s).await
}
