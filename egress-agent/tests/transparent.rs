//! Transparent TCP on loopback (no root): real clients connect straight to a policy's
//! transparent listener as if the kernel had redirected them — curl with `--connect-to`, python's
//! `ssl` without SNI, rustls clients for hand-shaped ClientHellos (ECH, many records, trickled
//! segments) — and a test [`Admission`] plays the kernel's map. Upstreams are real (a TLS server
//! with a CA the test generates, an HTTP server, a byte recorder) and so is a canary at the
//! *original* address: each test checks what arrived where.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_agent::config::Config;
use egress_agent::events::{DenialEvent, EventSink, Verdict};
use egress_agent::proxy::admission::{Admission, Admitted, ConnKey, StaticAdmission};
use egress_agent::proxy::dns::NoAnswerSink;
use egress_agent::proxy::{InterceptHooks, PolicyHandle, PolicyProxy, ProxyContext};
use egress_policy::Policy;
use proxy_support::{TempDir, http_server, temp_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(5);

/// The kernel's records, played by the test: what the next connections were "going to"
/// (`None`: no record, a foreign peer). Until a test says otherwise, connections were sent to
/// the explicit listener.
struct Orig(Mutex<Option<Admitted>>);

impl Default for Orig {
    fn default() -> Self {
        Orig(Mutex::new(Some(Admitted { original: None })))
    }
}

impl Admission for Orig {
    fn admit(&self, _: &ConnKey) -> Option<Admitted> {
        *self.0.lock().unwrap()
    }
}

/// A listener that counts connections and keeps what each one sent.
#[derive(Clone)]
struct Recorder {
    addr: SocketAddr,
    conns: Arc<AtomicUsize>,
    bytes: Arc<Mutex<Vec<Vec<u8>>>>,
}

async fn recorder(l: TcpListener) -> Recorder {
    let r = Recorder {
        addr: l.local_addr().unwrap(),
        conns: Arc::default(),
        bytes: Arc::default(),
    };
    let rec = r.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let i = {
                rec.conns.fetch_add(1, Ordering::SeqCst);
                let mut b = rec.bytes.lock().unwrap();
                b.push(Vec::new());
                b.len() - 1
            };
            let rec = rec.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    rec.bytes.lock().unwrap()[i].extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    r
}

/// The test CA and a TLS upstream for `names`, answering every request with the SNI it saw.
struct TlsUpstream {
    addr: SocketAddr,
    conns: Arc<AtomicUsize>,
    ca_pem: PathBuf,
}

async fn tls_upstream(dir: &Path, l: TcpListener, names: &[&str]) -> TlsUpstream {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "egress-agent test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
        .unwrap();
    let ca_pem = dir.join("ca.pem");
    std::fs::write(&ca_pem, ca.as_ref().pem()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
    let leaf = rcgen::CertificateParams::new(names)
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let up = TlsUpstream {
        addr: l.local_addr().unwrap(),
        conns: Arc::default(),
        ca_pem,
    };
    let conns = up.conns.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            conns.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                let sni = tls.get_ref().1.server_name().unwrap_or("-").to_owned();
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let text = format!("tls-upstream sni={sni} path={}\n", req.uri().path());
                        async move {
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from(text)),
                            ))
                        }
                    },
                );
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await
                    .ok();
            });
        }
    });
    up
}

/// Listeners on 127.0.0.1:P (the upstream, what the names resolve to) and 127.0.0.2:P (the
/// canary: the "original" address a client connected to).
async fn pair() -> (TcpListener, TcpListener) {
    loop {
        let a = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = a.local_addr().unwrap().port();
        if let Ok(b) = TcpListener::bind(("127.0.0.2", port)).await {
            return (a, b);
        }
    }
}

struct Fx {
    transparent: SocketAddr,
    explicit: SocketAddr,
    events: EventSink,
    orig: Arc<Orig>,
    handle: PolicyHandle,
    config: Arc<Config>,
    tls: TlsUpstream,
    tls_canary: Recorder,
    http: SocketAddr,
    http_canary: Recorder,
    raw: Recorder,
    raw_canary: Recorder,
    /// A WebSocket echo server (plain `ws://`).
    ws: SocketAddr,
    _dir: TempDir,
}

/// A `ws://` echo server on loopback.
async fn ws_server() -> SocketAddr {
    use futures_util::{SinkExt, StreamExt};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(s).await else {
                    return;
                };
                while let Some(Ok(m)) = ws.next().await {
                    if m.is_text() {
                        ws.send(m).await.ok();
                    }
                }
            });
        }
    });
    addr
}

const HOSTS: &str = "\
127.0.0.1 allowed.test other.test public.test
127.0.0.2 rebind.test
127.0.0.1 api.anthropic.com api.openai.com
";

async fn fixture() -> Fx {
    fixture_with("").await
}

/// [`fixture`] with more lines in the test policy.
async fn fixture_with(policy_extra: &str) -> Fx {
    let dir = temp_dir();
    let (tls_l, tls_c) = pair().await;
    let tls = tls_upstream(
        &dir,
        tls_l,
        &[
            "allowed.test",
            "other.test",
            "public.test",
            "api.anthropic.com",
            "api.openai.com",
        ],
    )
    .await;
    let tls_canary = recorder(tls_c).await;
    // The HTTP upstream: proxy_support's (describes what it received); its canary on 127.0.0.2.
    let http = http_server().await;
    let http_canary = recorder(TcpListener::bind(("127.0.0.2", http.port())).await.unwrap()).await;
    let (raw_l, raw_c) = pair().await;
    let (raw, raw_canary) = (recorder(raw_l).await, recorder(raw_c).await);
    let ws = ws_server().await;
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, HOSTS).unwrap();
    let toml = format!(
        r#"
[proxy]
header_timeout_ms = 1000
connect_timeout_ms = 2000
kernel_relay = "{relay}"
[dns]
nameservers = []
hosts_file = "{hosts}"
[policies.test]
allow_hosts = ["allowed.test", "rebind.test"]
allow_ports = [{t}, {h}, {r}, {w}]
resolve_private = ["127.0.0.1/32"]
{policy_extra}
"#,
        w = ws.port(),
        hosts = hosts.display(),
        relay = proxy_support::kernel_relay_mode(),
        t = tls.addr.port(),
        h = http.port(),
        r = raw.addr.port(),
    );
    let config = Arc::new(Config::from_toml_str(&toml, Path::new("test.toml")).unwrap());
    let events = EventSink::new(256);
    let orig = Arc::new(Orig::default());
    let ctx = ProxyContext::new(&config, events.clone())
        .unwrap()
        .with_interception(InterceptHooks {
            admission: orig.clone(),
            answers: Arc::new(NoAnswerSink),
        });
    let proxy = PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        "test".into(),
        Arc::new(config.policy("test").unwrap().clone()),
        ctx,
    )
    .await
    .unwrap();
    let transparent = proxy.intercept_addrs().unwrap().transparent.unwrap();
    let explicit = proxy.local_addr();
    let handle = proxy.policy_handle();
    tokio::spawn(proxy.run(std::future::pending()));
    Fx {
        transparent,
        explicit,
        events,
        orig,
        handle,
        config,
        tls,
        tls_canary,
        http,
        http_canary,
        raw,
        raw_canary,
        ws,
        _dir: dir,
    }
}

impl Fx {
    /// The next connections were going to the canary at 127.0.0.2, port `port`.
    fn going_to(&self, port: u16) -> SocketAddr {
        let a = SocketAddr::from(([127, 0, 0, 2], port));
        *self.orig.0.lock().unwrap() = Some(Admitted { original: Some(a) });
        a
    }

    /// The one event since `before`.
    fn event(&self, before: u64) -> DenialEvent {
        assert_eq!(
            self.events.total(),
            before + 1,
            "{:?}",
            self.events.recent(5)
        );
        self.events.recent(1).pop().unwrap()
    }
}

struct Curl {
    code: i32,
    stdout: String,
    stderr: String,
}

/// curl to `url` whose host:port is sent to `via` instead (what the kernel redirect does).
async fn curl(url: &str, via: SocketAddr, ca: Option<&Path>, extra: &[&str]) -> Curl {
    let authority = url
        .split("://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap();
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args(["-sS", "--max-time", "5", "--noproxy", "*"])
        .arg("--connect-to")
        .arg(format!("{authority}:{}:{}", via.ip(), via.port()));
    if let Some(ca) = ca {
        cmd.arg("--cacert").arg(ca);
    }
    let out = cmd.args(extra).arg(url).output().await.unwrap();
    Curl {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A preset's host is an allow_hosts entry like any other on the transparent path: TLS decided
/// on its SNI, plain HTTP on its Host; a host of a preset the policy does not name is refused.
#[tokio::test]
async fn a_preset_s_host_passes_the_transparent_listener_and_another_s_does_not() {
    let f = fixture_with("presets = [\"anthropic\"]").await;
    let p = f.tls.addr.port();
    f.going_to(p);
    let url = format!("https://api.anthropic.com:{p}/v1/messages");
    let c = curl(&url, f.transparent, Some(&f.tls.ca_pem), &[]).await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    assert_eq!(
        c.stdout,
        "tls-upstream sni=api.anthropic.com path=/v1/messages\n"
    );
    assert_eq!(f.events.total(), 0);
    let c = curl(
        &format!("https://api.openai.com:{p}/v1/responses"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_ne!(c.code, 0, "{}", c.stdout);
    let ev = f.event(0);
    assert_eq!(
        (ev.host.as_deref(), ev.reason.as_str()),
        (Some("api.openai.com"), "host-not-allowed")
    );
    assert_eq!(
        f.tls.conns.load(Ordering::SeqCst),
        1,
        "only the allowed one arrived"
    );
    let h = f.http.port();
    f.going_to(h);
    let c = curl(
        &format!("http://api.anthropic.com:{h}/preset"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    assert!(c.stdout.contains("line=GET /preset\n"), "{}", c.stdout);
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.http_canary.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn curl_reaches_an_allowed_https_name_at_its_own_address_never_the_original() {
    let f = fixture().await;
    let p = f.tls.addr.port();
    f.going_to(p);
    let url = format!("https://allowed.test:{p}/hello");
    let c = curl(&url, f.transparent, Some(&f.tls.ca_pem), &[]).await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    // End-to-end TLS with the upstream's own certificate (curl verified it against the test CA).
    assert_eq!(c.stdout, "tls-upstream sni=allowed.test path=/hello\n");
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 1);
    // Domain fronting: the client "connected to" 127.0.0.2; nothing went there.
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.events.total(), 0);
    // The same through the explicit listener (its fallback for non-HTTP first bytes).
    let c = curl(&url, f.explicit, Some(&f.tls.ca_pem), &[]).await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 2);
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_denied_sni_gets_an_alert_and_an_event_and_nothing_arrives() {
    let f = fixture().await;
    let p = f.tls.addr.port();
    let orig = f.going_to(p);
    // other.test resolves to the very same upstream: only the policy stands in the way.
    let c = curl(
        &format!("https://other.test:{p}/"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_eq!(c.code, 35, "{} {}", c.stdout, c.stderr);
    assert!(c.stderr.contains("access denied"), "{}", c.stderr);
    let ev = f.event(0);
    assert_eq!(
        (
            ev.host.as_deref(),
            ev.ip,
            ev.port,
            ev.protocol.as_str(),
            ev.reason.as_str()
        ),
        (
            Some("other.test"),
            Some(orig.ip()),
            p,
            "tls",
            "host-not-allowed"
        )
    );
    // An allowed name on a port that is not allowed.
    f.going_to(9);
    let c = curl(
        &format!("https://allowed.test:{p}/"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_eq!(c.code, 35, "{}", c.stderr);
    assert_eq!(f.event(1).reason, "port-not-allowed");
    // A direct IP on the port: curl sends no SNI for an address.
    f.going_to(p);
    let c = curl(
        &format!("https://127.0.0.2:{p}/"),
        f.transparent,
        None,
        &["--insecure"],
    )
    .await;
    assert_eq!(c.code, 35, "{}", c.stderr);
    assert_eq!(f.event(2).reason, "tls-no-sni");
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_client_hello_without_sni_from_python_is_refused() {
    let f = fixture().await;
    let p = f.tls.addr.port();
    f.going_to(p);
    let script = format!(
        r#"
import socket, ssl
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
s = socket.create_connection(("{ip}", {port}), timeout=5)
try:
    ctx.wrap_socket(s)  # no server_hostname: no SNI
    print("handshake-ok")
except ssl.SSLError as e:
    print("ssl-error", e.reason)
"#,
        ip = f.transparent.ip(),
        port = f.transparent.port()
    );
    let out = tokio::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        "ssl-error TLSV1_ALERT_ACCESS_DENIED",
        "{out:?}"
    );
    let ev = f.event(0);
    assert_eq!((ev.reason.as_str(), ev.host), ("tls-no-sni", None));
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn plain_http_is_decided_on_its_host_header() {
    let f = fixture().await;
    let p = f.http.port();
    let orig = f.going_to(p);
    let c = curl(
        &format!("http://allowed.test:{p}/x?y=1"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    // Origin-form request replayed untouched to the name's own address.
    assert!(c.stdout.contains("line=GET /x?y=1\n"), "{}", c.stdout);
    assert!(
        c.stdout.contains(&format!("host=allowed.test:{p}\n")),
        "{}",
        c.stdout
    );
    let c = curl(
        &format!("http://other.test:{p}/"),
        f.transparent,
        None,
        &["-i"],
    )
    .await;
    assert!(c.stdout.starts_with("HTTP/1.1 403"), "{}", c.stdout);
    assert!(
        c.stdout.contains("X-Egress-Deny: host-not-allowed"),
        "{}",
        c.stdout
    );
    let ev = f.event(0);
    assert_eq!(
        (ev.host.as_deref(), ev.ip, ev.protocol.as_str()),
        (Some("other.test"), Some(orig.ip()), "http")
    );
    // No Host header at all (HTTP/1.0 without one).
    let mut s = TcpStream::connect(f.transparent).await.unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    let mut resp = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut resp))
        .await
        .unwrap()
        .unwrap();
    assert!(
        resp.starts_with("HTTP/1.1 403") && resp.contains("http-no-host"),
        "{resp}"
    );
    assert_eq!(f.event(1).reason, "http-no-host");
    assert_eq!(f.http_canary.conns.load(Ordering::SeqCst), 0);
}

/// A kept-alive transparent HTTP connection can't carry a request to another site behind the
/// same address: every request is parsed and its Host checked against the name decided on.
/// Checked by what the upstream received.
#[tokio::test]
async fn kept_alive_plain_http_is_checked_request_by_request() {
    let f = fixture().await;
    let p = f.http.port();
    f.going_to(p);
    let mut s = TcpStream::connect(f.transparent).await.unwrap();
    s.write_all(
        format!(
            "GET /one HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\n\
             GET /two HTTP/1.1\r\nHost: other.test:{p}\r\n\r\n\
             GET /three HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\n\
             GET http://allowed.test:{p}/four HTTP/1.1\r\nHost: allowed.test:{p}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut resp = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut resp))
        .await
        .unwrap()
        .unwrap();
    assert!(resp.contains("line=GET /one\n"), "{resp}");
    assert!(
        resp.contains("x-egress-deny: host-header-mismatch"),
        "{resp}"
    );
    assert!(!resp.contains("line=GET /two"), "{resp}");
    assert!(resp.contains("line=GET /three\n"), "{resp}");
    // Absolute-form naming the same host is served in origin-form.
    assert!(resp.contains("line=GET /four\n"), "{resp}");
    assert_eq!(f.http_canary.conns.load(Ordering::SeqCst), 0);
    // Ambiguous framing ends the connection: nothing after it reaches the upstream.
    let mut s = TcpStream::connect(f.transparent).await.unwrap();
    s.write_all(
        format!(
            "POST /a HTTP/1.1\r\nHost: allowed.test:{p}\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n\
             GET /smuggled HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut resp = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut resp))
        .await
        .unwrap()
        .unwrap();
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("obfuscated-header-name"), "{resp}");
    assert!(!resp.contains("line="), "{resp}");
}

/// `ws://` through the transparent HTTP path: the handshake is checked like any request, then
/// the upgraded connection is relayed.
#[tokio::test]
async fn plain_websocket_works_transparently() {
    use futures_util::{SinkExt, StreamExt};
    let f = fixture().await;
    let p = f.ws.port();
    f.going_to(p);
    let s = TcpStream::connect(f.transparent).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(format!("ws://allowed.test:{p}/"), s)
        .await
        .unwrap();
    assert_eq!(resp.status(), 101);
    ws.send(tokio_tungstenite::tungstenite::Message::text("ping-1"))
        .await
        .unwrap();
    let back = tokio::time::timeout(T, ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(back.into_text().unwrap().as_str(), "ping-1");
}

#[tokio::test]
async fn allowed_names_that_resolve_to_denied_addresses_are_refused_at_dial_time() {
    let f = fixture().await;
    let p = f.tls.addr.port();
    f.going_to(p);
    // rebind.test is allowed but resolves to 127.0.0.2, outside resolve_private.
    let c = curl(
        &format!("https://rebind.test:{p}/"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_eq!(c.code, 35, "{}", c.stderr);
    let ev = f.event(0);
    assert_eq!(ev.reason, "address-denied");
    assert_eq!(
        ev.context.get("denied_address").map(String::as_str),
        Some("127.0.0.2")
    );
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
}

/// Every event of the transparent paths names the rule that decided, as configured: the
/// `allow_hosts` entry that let a TLS or HTTP connection through, the entry that matched a name
/// on a port it doesn't allow, the built-in range a resolved address fell in; a name no entry
/// matches names none (its would-deny under audit neither).
#[tokio::test]
async fn every_transparent_decision_names_its_rule() {
    let f = fixture().await;
    let mut allowed = f.events.tap(64, true);
    let mut next = async || {
        tokio::time::timeout(T, allowed.rx.recv())
            .await
            .unwrap()
            .unwrap()
    };
    let (tls, http) = (f.tls.addr.port(), f.http.port());
    f.going_to(tls);
    let c = curl(
        &format!("https://allowed.test:{tls}/"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    let ev = next().await;
    assert_eq!(
        (ev.verdict, ev.protocol.as_str(), ev.rule.as_deref()),
        (Verdict::Allow, "tls", Some("allow_hosts allowed.test"))
    );
    f.going_to(http);
    let c = curl(
        &format!("http://allowed.test:{http}/"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    let ev = next().await;
    assert_eq!(
        (ev.verdict, ev.protocol.as_str(), ev.rule.as_deref()),
        (Verdict::Allow, "http", Some("allow_hosts allowed.test"))
    );
    // A port the policy doesn't list: refused, naming the entry that matched the name.
    f.going_to(9);
    let c = curl("http://allowed.test:9/", f.transparent, None, &["-i"]).await;
    assert!(c.stdout.starts_with("HTTP/1.1 403"), "{}", c.stdout);
    let ev = next().await;
    assert_eq!(
        (ev.verdict, ev.reason.as_str(), ev.rule.as_deref()),
        (
            Verdict::Deny,
            "port-not-allowed",
            Some("allow_hosts allowed.test")
        )
    );
    // An allowed name resolving into the built-in deny list: the range is the rule.
    f.going_to(tls);
    let c = curl(
        &format!("https://rebind.test:{tls}/"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_ne!(c.code, 0);
    let ev = next().await;
    assert_eq!(
        (ev.reason.as_str(), ev.rule.as_deref()),
        ("address-denied", Some("the built-in deny list (loopback)"))
    );
    // No entry matches: no rule, enforced or audited.
    f.going_to(http);
    let c = curl(
        &format!("http://other.test:{http}/"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    let ev = next().await;
    assert_eq!((ev.reason.as_str(), ev.rule), ("host-not-allowed", None));
    let mut audit: Policy = f.config.policy("test").unwrap().clone();
    audit.enforce = egress_policy::model::Enforce::Audit;
    f.handle.set(&audit);
    let c = curl(
        &format!("http://other.test:{http}/"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    let ev = next().await;
    assert_eq!(
        (ev.verdict, ev.reason.as_str(), ev.rule),
        (Verdict::WouldDeny, "host-not-allowed", None)
    );
    // Nothing else was recorded (an audited connection is its would-deny, not also an allow).
    assert!(allowed.rx.try_recv().is_err());
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.http_canary.conns.load(Ordering::SeqCst), 0);
}

/// A transparently redirected HTTP client that is refused reads why: text naming the policy,
/// destination, reason and rule, or JSON when its `Accept` asks.
#[tokio::test]
async fn a_refused_transparent_request_says_why() {
    let f = fixture().await;
    let http = f.http.port();
    f.going_to(9);
    let c = curl("http://allowed.test:9/", f.transparent, None, &["-i"]).await;
    assert!(c.stdout.starts_with("HTTP/1.1 403"), "{}", c.stdout);
    assert!(
        c.stdout.contains("X-Egress-Deny: port-not-allowed"),
        "{}",
        c.stdout
    );
    assert!(
        c.stdout.contains("destination: allowed.test:9\n"),
        "{}",
        c.stdout
    );
    assert!(
        c.stdout.contains("rule: allow_hosts allowed.test\n"),
        "{}",
        c.stdout
    );
    f.going_to(http);
    let c = curl(
        &format!("http://other.test:{http}/"),
        f.transparent,
        None,
        &["-H", "Accept: application/json"],
    )
    .await;
    let j: serde_json::Value = serde_json::from_str(&c.stdout).unwrap();
    assert_eq!(
        (
            j["reason"].as_str(),
            j["host"].as_str(),
            j["policy"].as_str()
        ),
        (Some("host-not-allowed"), Some("other.test"), Some("test"))
    );
    assert_eq!(f.http_canary.conns.load(Ordering::SeqCst), 0);
}

/// A plain request whose Host is `egress.internal`, redirected here from whatever address the
/// client's resolver gave it: the agent answers (the workload's own policy), nothing is dialled,
/// and a second request on the connection naming another host is answered by the agent too.
#[tokio::test]
async fn egress_internal_is_answered_by_the_agent_and_nothing_is_dialled() {
    let f = fixture().await;
    let http = f.http.port();
    f.going_to(http);
    let before = f.events.total();
    let c = curl(
        &format!("http://egress.internal:{http}/v1/self"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    let j: serde_json::Value = serde_json::from_str(&c.stdout).unwrap();
    assert_eq!(
        (j["policy"].as_str(), j["takes_requests"].as_bool()),
        (Some("test"), Some(false)),
        "{j}"
    );
    // Filing needs an operator; this proxy has none, and says so.
    let c = curl(
        &format!("http://egress.internal:{http}/v1/requests"),
        f.transparent,
        None,
        &[
            "-i",
            "-H",
            "content-type: application/json",
            "--data",
            r#"{"host":"other.test","port":443,"reason":"x"}"#,
        ],
    )
    .await;
    assert!(c.stdout.starts_with("HTTP/1.1 503"), "{}", c.stdout);
    assert_eq!(f.http_canary.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.events.total(), before, "{:?}", f.events.recent(3));
}

/// ClientHello bytes rustls would send for `name` with `config`.
fn client_hello(config: rustls::ClientConfig, name: &str) -> Vec<u8> {
    let name = rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).unwrap();
    }
    out
}

fn client_config() -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
}

/// Send `hello` to the transparent listener in `pieces`; what the raw upstream received.
async fn send_hello(f: &Fx, hello: &[u8], piece: usize) -> Vec<u8> {
    send_hello_to(f, f.transparent, hello, piece).await
}

/// [`send_hello`] to `listener`.
async fn send_hello_to(f: &Fx, listener: SocketAddr, hello: &[u8], piece: usize) -> Vec<u8> {
    let before = f.raw.conns.load(Ordering::SeqCst);
    let mut s = TcpStream::connect(listener).await.unwrap();
    s.set_nodelay(true).unwrap();
    for chunk in hello.chunks(piece) {
        s.write_all(chunk).await.unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let deadline = tokio::time::Instant::now() + T;
    loop {
        if f.raw.conns.load(Ordering::SeqCst) > before {
            let got = f.raw.bytes.lock().unwrap()[before].clone();
            if got.len() >= hello.len() {
                return got;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "hello never arrived upstream"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_client_hello_across_records_and_segments_is_replayed_byte_for_byte() {
    let f = fixture().await;
    f.going_to(f.raw.addr.port());
    // Many TLS records (the smallest fragment size rustls allows), sent 7 bytes at a time.
    let mut cfg = client_config()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    cfg.max_fragment_size = Some(32);
    let hello = client_hello(cfg, "allowed.test");
    // Walk the record headers (type, version, length): the hello really spans many records.
    let (mut at, mut records) = (0, 0);
    while at + 5 <= hello.len() {
        assert_eq!(hello[at], 0x16, "handshake record at {at}");
        at += 5 + usize::from(u16::from_be_bytes([hello[at + 3], hello[at + 4]]));
        records += 1;
    }
    assert!(at == hello.len() && records > 5, "{records} records");
    let got = send_hello(&f, &hello, 7).await;
    assert_eq!(got, hello);
    assert_eq!(f.raw_canary.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.events.total(), 0);
}

/// A redirected TLS client that reaches the explicit listener is told apart from HTTP by its
/// first bytes, even when they hold "\n\n" (which ends an HTTP head): about 1 rustls hello in
/// 400 does, in its random or key share, and a GREASE value 0x0a0a always would. It was answered
/// `400 malformed-request` (curl: "wrong version number"), seen once in CI.
#[tokio::test]
async fn a_client_hello_holding_a_blank_line_still_reaches_the_explicit_listener_s_sni_path() {
    let f = fixture().await;
    f.going_to(f.raw.addr.port());
    let blank =
        |h: &[u8]| h.windows(2).any(|w| w == b"\n\n") || h.windows(3).any(|w| w == b"\n\r\n");
    let hello = (0..200_000)
        .map(|_| {
            client_hello(
                client_config()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
                "allowed.test",
            )
        })
        .find(|h| blank(h))
        .expect("no rustls hello with a blank line in 200,000");
    let got = send_hello_to(&f, f.explicit, &hello, hello.len()).await;
    assert_eq!(got, hello);
    assert_eq!(f.raw_canary.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.events.total(), 0);
}

#[tokio::test]
async fn clients_that_stall_or_send_garbage_are_cut_and_nothing_is_dialed() {
    let f = fixture().await;
    f.going_to(f.raw.addr.port());
    // Silent client: closed after the header deadline (1 s here).
    let mut s = TcpStream::connect(f.transparent).await.unwrap();
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(T, s.read(&mut b))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0);
    // A handshake record header that announces more than the bound and never ends.
    let mut s = TcpStream::connect(f.transparent).await.unwrap();
    let mut big = vec![0x16, 0x03, 0x01, 0x40, 0x00, 0x01, 0x00, 0xff, 0xff];
    big.resize(40 * 1024, 0x41);
    s.write_all(&big).await.ok();
    let mut rest = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut rest))
        .await
        .unwrap()
        .ok();
    // SSH-style banner on an allowed port: not TLS, not HTTP.
    let mut s = TcpStream::connect(f.transparent).await.unwrap();
    s.write_all(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut rest))
        .await
        .unwrap()
        .ok();
    let reasons: Vec<String> = f.events.recent(10).into_iter().map(|e| e.reason).collect();
    assert_eq!(reasons, vec!["tls-invalid-hello", "unknown-protocol"]);
    assert_eq!(f.raw.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.raw_canary.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn without_an_original_destination_nothing_is_decided() {
    let f = fixture().await;
    // Admitted, but sent to the explicit listener: no original destination.
    *f.orig.0.lock().unwrap() = Some(Admitted { original: None });
    let c = curl(
        &format!("https://allowed.test:{}/", f.tls.addr.port()),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_ne!(c.code, 0);
    assert_eq!(f.event(0).reason, "no-original-destination");
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 0);
    // On the explicit listener the same bytes are just a malformed request (no event).
    let c = curl(
        &format!("https://allowed.test:{}/", f.tls.addr.port()),
        f.explicit,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_ne!(c.code, 0);
    assert_eq!(f.events.total(), 1);
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 0);
}

/// Audit mode on the transparent path: a name the allowlist refuses goes through, with one
/// would-deny event naming the name and where the connection was going (the same decide → dial
/// → record path as CONNECT; no `denied_address`, nothing was refused at dial time).
#[tokio::test]
async fn an_auditing_policy_lets_a_transparent_connection_through_with_a_would_deny() {
    let f = fixture().await;
    let p = f.http.port();
    let orig = f.going_to(p);
    let mut audit: Policy = f.config.policy("test").unwrap().clone();
    audit.enforce = egress_policy::model::Enforce::Audit;
    f.handle.set(&audit);
    let c = curl(
        &format!("http://other.test:{p}/a"),
        f.transparent,
        None,
        &[],
    )
    .await;
    assert_eq!(c.code, 0, "{}", c.stderr);
    assert!(c.stdout.contains("line=GET /a\n"), "{}", c.stdout);
    let ev = f.event(0);
    assert_eq!(
        (ev.reason.as_str(), ev.host.as_deref(), ev.ip, ev.port),
        ("host-not-allowed", Some("other.test"), Some(orig.ip()), p)
    );
    assert_eq!(ev.verdict, egress_agent::events::Verdict::WouldDeny);
    assert!(!ev.context.contains_key("denied_address"), "{ev:?}");
}

#[tokio::test]
async fn a_reload_turning_transparent_off_refuses_redirected_connections() {
    let f = fixture().await;
    let p = f.tls.addr.port();
    f.going_to(p);
    let mut off: Policy = f.config.policy("test").unwrap().clone();
    off.transparent = Some(false);
    f.handle.set(&off);
    let c = curl(
        &format!("https://allowed.test:{p}/"),
        f.transparent,
        Some(&f.tls.ca_pem),
        &[],
    )
    .await;
    assert_eq!(c.code, 35, "{}", c.stderr);
    assert_eq!(f.event(0).reason, "transparent-off");
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_peer_the_kernel_did_not_send_is_refused_unread_on_both_listeners() {
    // No record: a host process (or another workload) reached the listeners' addresses itself.
    let f = fixture().await;
    *f.orig.0.lock().unwrap() = None;
    for (listener, which) in [(f.transparent, "transparent"), (f.explicit, "explicit")] {
        let before = f.events.total();
        let c = curl(
            &format!("https://allowed.test:{}/", f.tls.addr.port()),
            listener,
            Some(&f.tls.ca_pem),
            &[],
        )
        .await;
        assert_ne!(c.code, 0);
        let ev = f.event(before);
        assert_eq!(ev.reason, "listener-foreign-peer");
        assert_eq!(ev.context.get("listener").map(String::as_str), Some(which));
        assert!(ev.context.contains_key("peer"), "{ev:?}");
        assert_eq!((ev.host, ev.ip, ev.port), (None, None, 0));
    }
    // And an explicit CONNECT from it: refused before the head is read, nothing dialed.
    let before = f.events.total();
    let mut s = TcpStream::connect(f.explicit).await.unwrap();
    let head = format!(
        "CONNECT allowed.test:{p} HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\n",
        p = f.tls.addr.port()
    );
    // The proxy may close before the head is written or read: either way nothing comes back.
    s.write_all(head.as_bytes()).await.ok();
    let mut got = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut got)).await.ok();
    assert!(got.is_empty(), "a foreign peer got {got:?}");
    assert_eq!(f.event(before).reason, "listener-foreign-peer");
    assert_eq!(f.tls.conns.load(Ordering::SeqCst), 0);
    assert_eq!(f.tls_canary.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_static_double_keys_by_the_connection_like_the_kernel() {
    // A client that binds its source port first, so the test can key the entry as the kernel
    // would (peer address + the listener it reached); the entry is used once.
    let f = fixture().await;
    let dir = temp_dir();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, HOSTS).unwrap();
    let table = Arc::new(StaticAdmission::default());
    let ctx = ProxyContext::new(&f.config, f.events.clone())
        .unwrap()
        .with_interception(InterceptHooks {
            admission: table.clone(),
            answers: Arc::new(NoAnswerSink),
        });
    let proxy = PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        "test".into(),
        Arc::new(f.config.policy("test").unwrap().clone()),
        ctx,
    )
    .await
    .unwrap();
    let transparent = proxy.intercept_addrs().unwrap().transparent.unwrap();
    tokio::spawn(proxy.run(std::future::pending()));
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let peer = sock.local_addr().unwrap();
    table.insert(
        ConnKey {
            peer,
            local: transparent,
        },
        SocketAddr::from(([127, 0, 0, 2], f.raw.addr.port())),
    );
    let mut s = sock.connect(transparent).await.unwrap();
    let hello = client_hello(
        client_config()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        "allowed.test",
    );
    s.write_all(&hello).await.unwrap();
    let deadline = tokio::time::Instant::now() + T;
    while f.raw.conns.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        table
            .admit(&ConnKey {
                peer,
                local: transparent
            })
            .is_none(),
        "used once"
    );
}

mod ech {
    //! A real ECH ClientHello (rustls client, ECH mode) whose outer SNI is the config's public
    //! name. The HPKE suite is a stand-in (the proxy never decrypts anything; it only reads the
    //! outer hello), so the test needs no HPKE implementation.
    use super::*;
    use rustls::crypto::hpke::{
        EncapsulatedSecret, Hpke, HpkeOpener, HpkePrivateKey, HpkePublicKey, HpkeSealer, HpkeSuite,
    };
    use rustls::internal::msgs::codec::Codec;
    use rustls::internal::msgs::enums::{HpkeAead, HpkeKdf, HpkeKem};
    use rustls::internal::msgs::handshake::{
        EchConfigContents, EchConfigPayload, HpkeKeyConfig, HpkeSymmetricCipherSuite,
    };

    #[derive(Debug)]
    struct StandInHpke;
    #[derive(Debug)]
    struct StandInSealer;

    const SUITE: HpkeSuite = HpkeSuite {
        kem: HpkeKem::DHKEM_X25519_HKDF_SHA256,
        sym: HpkeSymmetricCipherSuite {
            kdf_id: HpkeKdf::HKDF_SHA256,
            aead_id: HpkeAead::AES_128_GCM,
        },
    };

    impl HpkeSealer for StandInSealer {
        fn seal(&mut self, _aad: &[u8], plaintext: &[u8]) -> Result<Vec<u8>, rustls::Error> {
            let mut out = plaintext.iter().map(|b| b ^ 0x5a).collect::<Vec<_>>();
            out.extend_from_slice(&[0u8; 16]);
            Ok(out)
        }
    }

    impl Hpke for StandInHpke {
        fn seal(
            &self,
            _: &[u8],
            aad: &[u8],
            plaintext: &[u8],
            _: &HpkePublicKey,
        ) -> Result<(EncapsulatedSecret, Vec<u8>), rustls::Error> {
            Ok((
                EncapsulatedSecret(vec![7; 32]),
                StandInSealer.seal(aad, plaintext)?,
            ))
        }
        fn setup_sealer(
            &self,
            _: &[u8],
            _: &HpkePublicKey,
        ) -> Result<(EncapsulatedSecret, Box<dyn HpkeSealer + 'static>), rustls::Error> {
            Ok((EncapsulatedSecret(vec![7; 32]), Box::new(StandInSealer)))
        }
        fn open(
            &self,
            _: &EncapsulatedSecret,
            _: &[u8],
            _: &[u8],
            _: &[u8],
            _: &HpkePrivateKey,
        ) -> Result<Vec<u8>, rustls::Error> {
            Err(rustls::Error::General("stand-in".into()))
        }
        fn setup_opener(
            &self,
            _: &EncapsulatedSecret,
            _: &[u8],
            _: &HpkePrivateKey,
        ) -> Result<Box<dyn HpkeOpener + 'static>, rustls::Error> {
            Err(rustls::Error::General("stand-in".into()))
        }
        fn generate_key_pair(&self) -> Result<(HpkePublicKey, HpkePrivateKey), rustls::Error> {
            Ok((
                HpkePublicKey(vec![9; 32]),
                HpkePrivateKey::from(vec![1; 32]),
            ))
        }
        fn suite(&self) -> HpkeSuite {
            SUITE
        }
    }

    static HPKE: StandInHpke = StandInHpke;

    /// An ECH ClientHello for `inner` behind the public name `public`.
    fn ech_hello(public: &str, inner: &str) -> Vec<u8> {
        let config = EchConfigPayload::V18(EchConfigContents {
            key_config: HpkeKeyConfig {
                config_id: 42,
                kem_id: SUITE.kem,
                public_key: rustls::internal::msgs::base::PayloadU16::new(vec![9; 32]),
                symmetric_cipher_suites: vec![SUITE.sym],
            },
            maximum_name_length: 0,
            public_name: rustls::pki_types::DnsName::try_from(public.to_owned()).unwrap(),
            extensions: Vec::new(),
        });
        let mut list = Vec::new();
        vec![config].encode(&mut list);
        let ech = rustls::client::EchConfig::new(
            rustls::pki_types::EchConfigListBytes::from(list),
            &[&HPKE],
        )
        .unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_ech(rustls::client::EchMode::Enable(ech))
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
        client_hello(cfg, inner)
    }

    /// Through the explicit proxy: `CONNECT allowed.test`, then an ECH hello whose outer name is
    /// another host. Refused before a byte reaches the upstream (it was dialled for the
    /// `CONNECT`, and got nothing).
    #[tokio::test]
    async fn a_connect_tunnel_refuses_an_ech_outer_name_other_than_its_target() {
        let f = fixture().await;
        let p = f.raw.addr.port();
        let mut s = TcpStream::connect(f.explicit).await.unwrap();
        s.write_all(
            format!("CONNECT allowed.test:{p} HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut head = [0u8; 39];
        tokio::time::timeout(T, s.read_exact(&mut head))
            .await
            .unwrap()
            .unwrap();
        assert!(head.starts_with(b"HTTP/1.1 200"));
        s.write_all(&ech_hello("public.test", "allowed.test"))
            .await
            .unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(T, s.read_to_end(&mut back))
            .await
            .unwrap()
            .ok();
        assert_eq!(
            back,
            [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49],
            "access_denied"
        );
        let ev = f.events.recent(1).pop().unwrap();
        assert_eq!(
            (ev.host.as_deref(), ev.reason.as_str()),
            (Some("public.test"), "sni-mismatch")
        );
        assert!(
            f.raw.bytes.lock().unwrap().iter().all(Vec::is_empty),
            "bytes reached the upstream"
        );
    }

    #[tokio::test]
    async fn ech_is_decided_by_the_outer_name() {
        let f = fixture().await;
        f.going_to(f.raw.addr.port());
        // Inner name allowed, public name not: refused, the event names the public name.
        let hello = ech_hello("public.test", "allowed.test");
        assert!(
            hello.windows(2).any(|w| w == [0xfe, 0x0d]),
            "an encrypted_client_hello extension"
        );
        assert!(hello.windows(11).any(|w| w == b"public.test"));
        assert!(
            !hello.windows(12).any(|w| w == b"allowed.test"),
            "the inner name is encrypted, not in the outer hello"
        );
        let mut s = TcpStream::connect(f.transparent).await.unwrap();
        s.write_all(&hello).await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(T, s.read_to_end(&mut back))
            .await
            .unwrap()
            .ok();
        assert_eq!(
            back,
            [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49],
            "access_denied alert"
        );
        let ev = f.event(0);
        assert_eq!(
            (ev.host.as_deref(), ev.reason.as_str()),
            (Some("public.test"), "host-not-allowed")
        );
        assert_eq!(f.raw.conns.load(Ordering::SeqCst), 0);
        // Public name allowed: the outer hello (ECH extension and all) goes on untouched.
        let mut p: Policy = f.config.policy("test").unwrap().clone();
        p.allow_hosts.push(
            egress_policy::matcher::HostPattern::parse("public.test")
                .unwrap()
                .into(),
        );
        f.handle.set(&p);
        let got = send_hello(&f, &hello, hello.len()).await;
        assert_eq!(got, hello);
        assert_eq!(f.raw_canary.conns.load(Ordering::SeqCst), 0);
    }
}
