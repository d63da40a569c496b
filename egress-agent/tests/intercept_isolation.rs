//! Failures stay local (#40 item 3): a credential binding whose secret can't be loaded, or TLS
//! interception without a usable CA, refuses the hosts that need it — `502` with
//! `X-Egress-Error: interception-unavailable` on `CONNECT`, nothing at all to the upstream (not
//! even a TCP connection), an event naming the binding and its source — while every other
//! policy and host of the same proxy keeps working; a reload (or the fixed CA files) brings the
//! interception back.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod intercept_support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use egress_agent::config::Config;
use egress_agent::events::EventSink;
use egress_agent::proxy::{PolicyHandle, PolicyProxy, ProxyContext};
use intercept_support::{
    PLACEHOLDER, SECRET, T, TestCa, Upstream, client_tls, connect_tls, temp_dir, upstream,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One policy listener of the test's context: its explicit and transparent addresses.
struct Listener {
    proxy: SocketAddr,
    transparent: SocketAddr,
    handle: PolicyHandle,
}

async fn bind(config: &Config, ctx: &ProxyContext, name: &str) -> Listener {
    let proxy = PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        name.to_owned(),
        Arc::new(config.policy(name).unwrap().clone()),
        ctx.clone(),
    )
    .await
    .unwrap();
    let l = Listener {
        proxy: proxy.local_addr(),
        transparent: proxy.intercept_addrs().unwrap().transparent.unwrap(),
        handle: proxy.policy_handle(),
    };
    tokio::spawn(proxy.run(std::future::pending()));
    l
}

/// The configuration: `broken` binds `api.test` to `secret_file` and passes `plain.test`
/// through; `good` binds `api.test` to a secret that loads.
fn config_text(dir: &Path, port: u16, secret_file: &Path) -> String {
    let d = dir.display();
    format!(
        r#"
[agent]
state_dir = "{d}/state"
[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"
[proxy]
connect_timeout_ms = 2000
header_timeout_ms = 3000
[dns]
nameservers = []
hosts_file = "{d}/hosts"

[policies.broken]
allow_hosts = ["api.test", "plain.test"]
allow_ports = [{port}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{port}] }}]
[[policies.broken.credentials]]
host = "api.test"
port = {port}
header = "authorization"
prefix = "Bearer "
source = {{ file = "{secret}" }}
placeholder = "{PLACEHOLDER}"

[policies.good]
allow_hosts = ["api.test"]
allow_ports = [{port}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{port}] }}]
[[policies.good.credentials]]
host = "api.test"
port = {port}
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/secret" }}
placeholder = "{PLACEHOLDER}"
"#,
        secret = secret_file.display()
    )
}

struct Setup {
    dir: intercept_support::TempDir,
    ca: TestCa,
    up: Upstream,
    events: EventSink,
}

async fn setup() -> Setup {
    let dir = temp_dir();
    let ca = TestCa::new();
    let up = upstream(&ca, &["api.test", "plain.test"]).await;
    std::fs::write(dir.join("hosts"), "127.0.0.1 api.test plain.test\n").unwrap();
    std::fs::write(dir.join("upstream-ca.pem"), &ca.pem).unwrap();
    std::fs::write(dir.join("secret"), format!("{SECRET}\n")).unwrap();
    Setup {
        dir,
        ca,
        up,
        events: EventSink::new(1000),
    }
}

/// The proxy context; every connection to a transparent listener was going to a documentation
/// address on the upstream's `port` (never dialled: the proxy dials the name).
fn context(config: &Config, events: &EventSink, port: u16) -> ProxyContext {
    let hooks = egress_agent::proxy::InterceptHooks {
        admission: Arc::new(egress_agent::proxy::admission::StaticAdmission::fixed(
            SocketAddr::from(([192, 0, 2, 1], port)),
        )),
        answers: Arc::new(egress_agent::proxy::dns::NoAnswerSink),
    };
    ProxyContext::new(config, events.clone())
        .unwrap()
        .with_interception(hooks)
}

/// `GET path` over TLS through `CONNECT` (HTTP/1.1), trusting `ca_pem`, with the placeholder;
/// the whole answer, or the error.
async fn get_via(
    proxy: SocketAddr,
    host: &str,
    port: u16,
    ca_pem: &str,
    path: &str,
) -> Result<String, String> {
    let tls = client_tls(ca_pem, &[b"http/1.1"]);
    let mut s = connect_tls(proxy, host, port, tls)
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {PLACEHOLDER}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut out))
        .await
        .map_err(|_| "timed out".to_owned())?
        .ok();
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A raw `CONNECT` and what the proxy answered (status line and headers).
async fn connect_answer(proxy: SocketAddr, authority: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut out))
        .await
        .expect("the proxy answered and closed")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

/// TLS straight to a transparent listener (as the kernel redirects a program that connects by
/// itself): the handshake's outcome.
async fn transparent_tls(addr: SocketAddr, host: &str, ca_pem: &str) -> std::io::Result<()> {
    let s = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).unwrap();
    let tls = client_tls(ca_pem, &[b"http/1.1"]);
    let mut t = tokio::time::timeout(T, tokio_rustls::TlsConnector::from(tls).connect(name, s))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))??;
    t.write_all(b"GET /t HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    t.read_to_end(&mut out).await?;
    if out.is_empty() {
        return Err(std::io::Error::other("closed without an answer"));
    }
    Ok(())
}

#[tokio::test]
async fn a_binding_without_its_secret_refuses_only_its_host() {
    let s = setup().await;
    let p = s.up.addr.port();
    let missing = s.dir.join("missing-secret");
    let text = config_text(&s.dir, p, &missing);
    let config = Config::from_toml_str(&text, Path::new("isolation.toml")).unwrap();
    let un = config.unavailable_bindings();
    assert_eq!(un.len(), 1, "{un:?}");
    assert_eq!((un[0].policy, un[0].index), ("broken", 0));
    let ctx = context(&config, &s.events, p);
    let broken = bind(&config, &ctx, "broken").await;
    let good = bind(&config, &ctx, "good").await;
    let agent_ca = std::fs::read_to_string(s.dir.join("state/ca.pem")).unwrap();
    let api = format!("api.test:{p}");

    // The bound host of `broken`: 502 interception-unavailable at CONNECT, nothing dialled.
    let answer = connect_answer(broken.proxy, &api).await;
    assert!(
        answer.starts_with("HTTP/1.1 502 ")
            && answer.contains("X-Egress-Error: interception-unavailable\r\n"),
        "{answer}"
    );
    // Transparent TLS to it: refused, nothing dialled either.
    assert!(
        transparent_tls(broken.transparent, "api.test", &agent_ca)
            .await
            .is_err()
    );
    assert_eq!(
        s.up.accepted.load(Ordering::SeqCst),
        0,
        "a connection reached the upstream of an unavailable binding"
    );
    for protocol in ["connect", "tls"] {
        let ev = s
            .events
            .recent(100)
            .into_iter()
            .find(|e| {
                e.reason == "interception-unavailable"
                    && e.policy == "broken"
                    && e.protocol == protocol
            })
            .unwrap_or_else(|| panic!("no {protocol} interception-unavailable event"));
        assert_eq!((ev.host.as_deref(), ev.port), (Some("api.test"), p));
        let why = ev.context.get("unavailable").cloned().unwrap_or_default();
        assert!(
            why.contains("policies.broken.credentials[0].source")
                && why.contains("can't read secret file")
                && why.contains(&missing.display().to_string()),
            "{why}"
        );
    }

    // `broken`'s pass-through host works (its own certificate, end to end).
    let out = get_via(broken.proxy, "plain.test", p, &s.ca.pem, "/pass")
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    // `good` binds the same host with a secret that loads: the upstream gets it.
    let out = get_via(good.proxy, "api.test", p, &agent_ca, "/good")
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let seen = s.up.requests();
    let r = seen.iter().find(|r| r.target == "/good").expect("/good");
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str())
    );
    assert!(seen.iter().all(|r| r.target != "/t"));
    for e in s.events.recent(100) {
        let j = serde_json::to_string(&e).unwrap();
        assert!(!j.contains(SECRET), "secret in an event: {j}");
    }

    // The file appears and the configuration is reloaded: `broken` injects its secret.
    std::fs::write(&missing, "sk-arrived-later\n").unwrap();
    let config = Config::from_toml_str(&text, Path::new("isolation.toml")).unwrap();
    assert!(config.unavailable_bindings().is_empty());
    broken.handle.set(config.policy("broken").unwrap());
    let out = get_via(broken.proxy, "api.test", p, &agent_ca, "/restored")
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let seen = s.up.requests();
    let r = seen.iter().find(|r| r.target == "/restored").unwrap();
    assert_eq!(r.header("authorization"), Some("Bearer sk-arrived-later"));
}

/// A reload that leaves an open intercepted connection's binding without its secret: its next
/// request gets the same `502`, never forwarded without the secret.
#[tokio::test]
async fn a_reload_that_loses_the_secret_refuses_the_next_request() {
    let s = setup().await;
    let p = s.up.addr.port();
    let file = s.dir.join("rotating");
    std::fs::write(&file, "sk-first\n").unwrap();
    let text = config_text(&s.dir, p, &file);
    let config = Config::from_toml_str(&text, Path::new("isolation.toml")).unwrap();
    let ctx = context(&config, &s.events, p);
    let broken = bind(&config, &ctx, "broken").await;
    let agent_ca = std::fs::read_to_string(s.dir.join("state/ca.pem")).unwrap();
    let tls = client_tls(&agent_ca, &[b"http/1.1"]);
    let mut c = connect_tls(broken.proxy, "api.test", p, tls).await.unwrap();
    let req = |path: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: api.test:{p}\r\nAuthorization: Bearer {PLACEHOLDER}\r\n\r\n"
        )
    };
    c.write_all(req("/one").as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(T, c.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    std::fs::remove_file(&file).unwrap();
    let config = Config::from_toml_str(&text, Path::new("isolation.toml")).unwrap();
    broken.handle.set(config.policy("broken").unwrap());
    c.write_all(req("/two").as_bytes()).await.unwrap();
    let n = tokio::time::timeout(T, c.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(
        answer.starts_with("HTTP/1.1 502")
            && answer
                .to_ascii_lowercase()
                .contains("x-egress-error: interception-unavailable"),
        "{answer}"
    );
    assert!(s.up.requests().iter().all(|r| r.target != "/two"));
}

/// No usable CA (the key readable by others): the proxy still starts; every intercepted host is
/// refused with the CA's error in the event, pass-through hosts work; once the key's mode is
/// fixed, the next request (a second later) is intercepted again without a restart.
#[tokio::test]
async fn interception_without_a_usable_ca_refuses_only_intercepted_hosts() {
    use std::os::unix::fs::PermissionsExt as _;
    let s = setup().await;
    let p = s.up.addr.port();
    let state = s.dir.join("state");
    egress_agent::ca::AgentCa::load_or_create(&state).unwrap();
    let key = state.join("ca-key.pem");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let text = config_text(&s.dir, p, &s.dir.join("secret"));
    let config = Config::from_toml_str(&text, Path::new("isolation.toml")).unwrap();
    assert!(config.unavailable_bindings().is_empty());
    let ctx = context(&config, &s.events, p);
    let err = ctx.interception_error().expect("the CA error is reported");
    assert!(err.contains("0644"), "{err}");
    let good = bind(&config, &ctx, "good").await;
    let broken = bind(&config, &ctx, "broken").await;
    let answer = connect_answer(good.proxy, &format!("api.test:{p}")).await;
    assert!(
        answer.starts_with("HTTP/1.1 502 ")
            && answer.contains("X-Egress-Error: interception-unavailable\r\n"),
        "{answer}"
    );
    assert_eq!(s.up.accepted.load(Ordering::SeqCst), 0);
    let ev = s
        .events
        .recent(100)
        .into_iter()
        .find(|e| e.reason == "interception-unavailable")
        .unwrap();
    assert!(
        ev.context["unavailable"].contains("TLS interception can't be set up"),
        "{ev:?}"
    );
    let out = get_via(broken.proxy, "plain.test", p, &s.ca.pem, "/pass")
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    // Fixed: interception comes back by itself.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let agent_ca = std::fs::read_to_string(state.join("ca.pem")).unwrap();
    let out = get_via(good.proxy, "api.test", p, &agent_ca, "/healed")
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(ctx.interception_error(), None);
    let r = s.up.requests();
    let r = r.iter().find(|r| r.target == "/healed").unwrap();
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str())
    );
}
