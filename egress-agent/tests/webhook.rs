//! `[requests] webhook` (no root): a real policy listener with the agent's request registry, a
//! workload filing through it as a client would, the real notifier, and a local HTTPS receiver
//! whose certificate a test CA (rcgen) issued. What arrived at the receiver is what counts: one
//! `POST` per new request, nothing for a duplicate, a decision or an auto-approval; a receiver
//! that never answers doesn't delay the workload's 202 and is counted; a receiver whose
//! certificate no trusted CA signed gets nothing.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod intercept_support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_agent::asks::Asks;
use egress_agent::asks::webhook::Webhook;
use egress_agent::config::webhook::WebhookConfig;
use egress_agent::metrics::Metrics;
use intercept_support::proxy_support::{Harness, harness_ctx, read_response, upstreams};
use intercept_support::{TempDir, TestCa, Upstream, temp_dir, upstream};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// A policy listener that files into `asks`.
async fn listener(asks: &Arc<Asks>) -> (Harness, u16) {
    let up = upstreams().await;
    let port = up.http.port();
    let asks = asks.clone();
    let h = harness_ctx(up, "header_timeout_ms = 2000", "", "test", move |ctx| {
        ctx.with_asks(asks)
    })
    .await;
    (h, port)
}

/// `POST http://egress.internal/v1/requests` through the listener, as the workload: the answer's
/// status, its JSON, and how long it took.
async fn file(h: &Harness, host: &str, port: u16, reason: &str) -> (u16, Value, Duration) {
    let started = Instant::now();
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let body = json!({ "host": host, "port": port, "reason": reason }).to_string();
    let head = format!(
        "POST http://egress.internal/v1/requests HTTP/1.1\r\nHost: egress.internal\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let r = read_response(&mut s, false).await.0;
    let json = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    (r.status, json, started.elapsed())
}

/// The notifier, running until the returned sender is dropped.
fn notifier(
    asks: &Arc<Asks>,
    cfg: &WebhookConfig,
) -> (Arc<Webhook>, Arc<Metrics>, oneshot::Sender<()>) {
    let metrics = Arc::new(Metrics::new());
    let w = Webhook::new(Some(metrics.clone()));
    assert!(w.configure(Some(cfg)).unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(w.clone().run(asks.clone(), async move {
        rx.await.ok();
    }));
    (w, metrics, tx)
}

/// `[requests.webhook]` with the URL in a file (as an operator keeps it), trusting `ca`.
fn config(dir: &Path, url: &str, ca: &TestCa, timeout_ms: u64) -> WebhookConfig {
    let url_file = dir.join("webhook-url");
    std::fs::write(&url_file, format!("{url}\n")).unwrap();
    let ca_file = dir.join("webhook-ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    toml::from_str(&format!(
        "url = {{ file = \"{}\" }}\nca_file = \"{}\"\ntimeout_ms = {timeout_ms}\n",
        url_file.display(),
        ca_file.display()
    ))
    .unwrap()
}

/// `export_errors_total{sink="webhook"}`.
fn webhook_errors(m: &Metrics) -> u64 {
    let text = m.encode().unwrap();
    text.lines()
        .find(|l| {
            l.starts_with("egress_agent_export_errors_total") && l.contains("sink=\"webhook\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(15);
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn receiver(ca: &TestCa) -> (Upstream, TempDir) {
    (upstream(ca, &["localhost"]).await, temp_dir())
}

#[tokio::test]
async fn a_new_request_is_posted_once_with_its_fields() {
    let ca = TestCa::new();
    let (rx, dir) = receiver(&ca).await;
    let url = format!(
        "https://localhost:{}/hooks/T0/B0/secret-token",
        rx.addr.port()
    );
    let cfg = config(&dir, &url, &ca, 5000);
    let asks = Asks::new();
    let (webhook, metrics, _stop) = notifier(&asks, &cfg);
    let (h, port) = listener(&asks).await;

    let reason = "pip needs it <!here> @channel";
    let (status, filed, _) = file(&h, "other.test", port, reason).await;
    assert_eq!(status, 202, "{filed}");
    let id = filed["id"].as_u64().unwrap();
    eventually("the POST", || !rx.requests().is_empty()).await;
    let got = rx.requests();
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].method.as_str(), got[0].target.as_str()),
        ("POST", "/hooks/T0/B0/secret-token")
    );
    assert_eq!(got[0].header("content-type"), Some("application/json"));
    let body: Value = serde_json::from_slice(&got[0].body).unwrap();
    let sent = &body["egress_request"];
    let view = asks.get(id).unwrap();
    assert_eq!(sent["id"].as_u64(), Some(id));
    assert_eq!(sent["host"].as_str(), Some("other.test"));
    assert_eq!(sent["port"].as_u64(), Some(u64::from(port)));
    assert_eq!(sent["reason"].as_str(), Some(reason));
    assert_eq!(sent["workload"].as_str(), Some(view.workload.as_str()));
    assert_eq!(sent["policy"].as_str(), Some("test"));
    assert_eq!(sent["time"].as_str(), Some(view.time.as_str()));
    assert_eq!(
        sent["approve"].as_str(),
        Some(format!("egress-agent requests approve {id} --scope run").as_str())
    );
    let text = body["text"].as_str().unwrap();
    assert!(text.contains(&format!("access request {id} ")), "{text}");
    assert!(
        !text.contains("<!here>") && !text.contains("@channel"),
        "{text}"
    );

    // The same host:port again is the same request: nothing new is sent. Nor for a decision.
    let (status, again, _) = file(&h, "Other.Test", port, "again").await;
    assert_eq!(
        (status, again["existing"].as_bool()),
        (202, Some(true)),
        "{again}"
    );
    asks.approve_run(id, "token:ops", None).unwrap();
    // An auto-approved request waits for nobody: not announced either.
    let auto: egress_agent::config::RequestsConfig =
        toml::from_str("auto_approve_hosts = [{ host = \"auto.test\", ports = [8443] }]").unwrap();
    asks.set_auto(auto.auto_approved());
    let (status, auto, _) = file(&h, "auto.test", 8443, "auto").await;
    assert_eq!(
        (status, auto["state"].as_str()),
        (202, Some("approved")),
        "{auto}"
    );

    // Off (a reload without the webhook): nothing; on again: the next new one.
    webhook.configure(None).unwrap();
    let (status, _, _) = file(&h, "off.test", port, "while off").await;
    assert_eq!(status, 202);
    webhook.configure(Some(&cfg)).unwrap();
    let (status, on, _) = file(&h, "on.test", port, "on again").await;
    assert_eq!(status, 202);
    eventually("the second POST", || rx.requests().len() >= 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = rx.requests();
    assert_eq!(got.len(), 2, "one POST per new pending request while on");
    let second: Value = serde_json::from_slice(&got[1].body).unwrap();
    assert_eq!(second["egress_request"]["id"], on["id"]);
    assert_eq!(second["egress_request"]["host"], "on.test");
    assert_eq!(webhook_errors(&metrics), 0);
}

#[tokio::test]
async fn a_receiver_that_never_answers_delays_nothing_and_is_counted() {
    let ca = TestCa::new();
    let (rx, dir) = receiver(&ca).await;
    let url = format!("https://localhost:{}/hang", rx.addr.port());
    let cfg = config(&dir, &url, &ca, 2000);
    let asks = Asks::new();
    let (_w, metrics, _stop) = notifier(&asks, &cfg);
    let (h, port) = listener(&asks).await;

    let (status, _, took) = file(&h, "one.test", port, "first").await;
    assert_eq!(status, 202);
    eventually("the first POST to arrive", || rx.requests().len() == 1).await;
    // The receiver holds the first delivery; the workload's next filing is answered at once.
    let (status, _, took2) = file(&h, "two.test", port, "second").await;
    assert_eq!(status, 202);
    assert!(
        took < Duration::from_secs(1) && took2 < Duration::from_secs(1),
        "filing waited for the webhook: {took:?}, {took2:?}"
    );
    eventually("two timeouts counted", || webhook_errors(&metrics) == 2).await;
    assert_eq!(rx.requests().len(), 2, "each tried once, never retried");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!((rx.requests().len(), webhook_errors(&metrics)), (2, 2));
}

#[tokio::test]
async fn a_receiver_no_trusted_ca_signed_gets_nothing() {
    let trusted = TestCa::new();
    let other = TestCa::new();
    let (rx, dir) = receiver(&other).await;
    let url = format!("https://localhost:{}/hooks/x", rx.addr.port());
    let cfg = config(&dir, &url, &trusted, 2000);
    let asks = Asks::new();
    let (_w, metrics, _stop) = notifier(&asks, &cfg);
    let (h, port) = listener(&asks).await;

    let (status, _, _) = file(&h, "other.test", port, "needs it").await;
    assert_eq!(status, 202);
    eventually("the refused delivery counted", || {
        webhook_errors(&metrics) == 1
    })
    .await;
    assert!(
        rx.accepted.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the notifier never connected"
    );
    assert!(
        rx.requests().is_empty(),
        "a request reached an untrusted receiver"
    );
}
