//! Proxy metrics on loopback (no root): a real listener with a metrics registry attached, real
//! upstreams, and exact counter values checked in the OpenMetrics text a scrape would return.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use egress_agent::metrics::{self, Metrics};
use proxy_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the raw upstream answers to every request head, byte for byte.
const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";

/// A raw HTTP/1.1 upstream: answers every request head (no bodies) with [`RESPONSE`] and, when a
/// connection ends, adds the bytes it received on it to the returned counter.
async fn raw_http_server() -> (SocketAddr, Arc<AtomicU64>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let total = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let total = total.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut answered = 0;
                let mut chunk = [0u8; 4096];
                loop {
                    let n = match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    buf.extend_from_slice(&chunk[..n]);
                    let heads = buf.windows(4).filter(|w| w == b"\r\n\r\n").count();
                    while answered < heads {
                        if s.write_all(RESPONSE).await.is_err() {
                            break;
                        }
                        answered += 1;
                    }
                }
                total.fetch_add(buf.len() as u64, Ordering::SeqCst);
            });
        }
    });
    (addr, received)
}

struct Setup {
    h: Harness,
    metrics: Arc<Metrics>,
    raw: SocketAddr,
    raw_received: Arc<AtomicU64>,
}

/// The test policy's listener with metrics attached (and denial events counted as the daemon
/// does), its `http` upstream being the raw server.
async fn setup() -> Setup {
    setup_with("").await
}

/// [`setup`] with more `[proxy]` settings.
async fn setup_with(proxy_extra: &str) -> Setup {
    let (raw, raw_received) = raw_http_server().await;
    let up = Upstreams {
        echo: echo_server().await,
        http: raw,
        closed: {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        },
    };
    let metrics = Arc::new(Metrics::new());
    let h = harness_on(
        up,
        &format!("header_timeout_ms = 2000\n{proxy_extra}"),
        "",
        "test",
        Some(metrics.clone()),
    )
    .await;
    tokio::spawn(metrics::denial_counter(&h.events, metrics.clone()));
    Setup {
        h,
        metrics,
        raw,
        raw_received,
    }
}

/// Scrape until every line in `want` is present (counters are updated when connections end,
/// denials by a task of their own), then return the exposition.
async fn scrape_until(m: &Metrics, want: &[String]) -> String {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let text = m.encode().unwrap();
        if want.iter().all(|w| text.lines().any(|l| l == w)) {
            return text;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("missing some of {want:#?} in\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The exposition line of the test policy's byte counter for `direction`.
fn bytes_line(direction: &str, n: impl std::fmt::Display) -> String {
    format!(r#"egress_agent_proxy_bytes_total{{policy="test",direction="{direction}"}} {n}"#)
}

fn series<'a>(text: &'a str, family: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(family)).collect()
}

async fn read_exactly(s: &mut TcpStream, mut got: Vec<u8>, n: usize) -> Vec<u8> {
    let mut chunk = [0u8; 4096];
    while got.len() < n {
        let k = tokio::time::timeout(T, s.read(&mut chunk))
            .await
            .unwrap()
            .unwrap();
        assert!(k > 0, "eof after {} of {n} bytes", got.len());
        got.extend_from_slice(&chunk[..k]);
    }
    got
}

#[tokio::test]
async fn connect_counts_connections_decisions_and_tunnel_bytes() {
    let Setup {
        h,
        metrics,
        raw,
        raw_received,
    } = setup().await;

    // Allowed CONNECT; part of the tunnelled request pipelined right after the head. A protocol
    // of its own (not HTTP: plain HTTP inside a tunnel is served request by request, so its
    // bytes are re-framed), relayed byte for byte.
    let a = format!("allowed.test:{}", raw.port());
    let req = b"PING /through-the-tunnel RAW/1\r\nHost: allowed.test\r\n\r\n";
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let mut first = format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n").into_bytes();
    first.extend_from_slice(&req[..10]);
    s.write_all(&first).await.unwrap();
    let (r, rest) = read_response(&mut s, true).await;
    assert_eq!(r.status, 200);
    s.write_all(&req[10..]).await.unwrap();
    let got = read_exactly(&mut s, rest, RESPONSE.len()).await;
    assert_eq!(got, RESPONSE);
    // Our half-close reaches the upstream, which closes: the tunnel ends and reports its bytes.
    s.shutdown().await.unwrap();
    assert_closed(&mut s, T).await;

    // Denied CONNECT (host not in the allowlist).
    let r = exchange(
        h.addr,
        format!(
            "CONNECT other.test:{p} HTTP/1.1\r\nHost: other.test:{p}\r\n\r\n",
            p = raw.port()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("host-not-allowed"));

    let want = [
        r#"egress_agent_proxy_connections_total{policy="test"} 2"#.to_owned(),
        r#"egress_agent_decisions_total{verdict="allow",reason="allowed",policy="test"} 1"#
            .to_owned(),
        r#"egress_agent_decisions_total{verdict="deny",reason="host-not-allowed",policy="test"} 1"#
            .to_owned(),
        bytes_line("upstream", req.len()),
        bytes_line("downstream", RESPONSE.len()),
    ];
    let text = scrape_until(&metrics, &want).await;
    // Exactly these series: nothing counted twice or under another label.
    assert_eq!(
        series(&text, "egress_agent_decisions_total{").len(),
        2,
        "{text}"
    );
    assert_eq!(
        series(&text, "egress_agent_proxy_connections_total{").len(),
        1,
        "{text}"
    );
    assert_eq!(
        series(&text, "egress_agent_proxy_bytes_total{").len(),
        2,
        "{text}"
    );
    // The upstream saw what the metrics say was relayed.
    assert_eq!(raw_received.load(Ordering::SeqCst), req.len() as u64);
    // Nothing else changed meanwhile: the counters are settled.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(metrics.encode().unwrap(), text);
}

#[tokio::test]
async fn http_counts_every_forwarded_request_and_upstream_bytes() {
    let Setup {
        h,
        metrics,
        raw,
        raw_received,
    } = setup().await;

    // Two requests on one kept-alive client connection (the second reuses the upstream after
    // its own check), then one denied on the same connection.
    let p = raw.port();
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    for path in ["/one", "/two"] {
        let r = get(&mut s, &format!("allowed.test:{p}"), path).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.body, b"hello");
    }
    let r = get(&mut s, &format!("other.test:{p}"), "/").await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("host-not-allowed"));
    drop(s);

    // Bytes are added when the upstream connection closes (after the client's).
    let deadline = tokio::time::Instant::now() + T;
    while raw_received.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "upstream never closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let upstream_bytes = raw_received.load(Ordering::SeqCst);
    let want = [
        r#"egress_agent_proxy_connections_total{policy="test"} 1"#.to_owned(),
        r#"egress_agent_decisions_total{verdict="allow",reason="allowed",policy="test"} 2"#
            .to_owned(),
        r#"egress_agent_decisions_total{verdict="deny",reason="host-not-allowed",policy="test"} 1"#
            .to_owned(),
        // What reached the upstream (re-framed, origin-form) and what it sent back, exactly.
        bytes_line("upstream", upstream_bytes),
        bytes_line("downstream", 2 * RESPONSE.len()),
    ];
    scrape_until(&metrics, &want).await;
}

/// A tunnel's bytes are counted while it is open, not only when it closes (a long download shows
/// up on the dashboard as it runs).
#[tokio::test]
async fn open_tunnel_bytes_are_counted_while_it_runs() {
    let Setup { h, metrics, .. } = setup().await;
    let a = format!("allowed.test:{}", h.up.echo.port());
    let (r, mut s) = connect(h.addr, &a).await;
    assert_eq!(r.status, 200);
    let payload = vec![0x42u8; 100_000];
    s.write_all(&payload).await.unwrap();
    let echoed = read_exactly(&mut s, Vec::new(), payload.len()).await;
    assert_eq!(echoed, payload);
    let want = [
        bytes_line("upstream", payload.len()),
        bytes_line("downstream", payload.len()),
    ];
    scrape_until(&metrics, &want).await;
    // Still open: the tunnel keeps relaying after the scrape.
    s.write_all(b"still open").await.unwrap();
    assert_eq!(read_exactly(&mut s, Vec::new(), 10).await, b"still open");
}

/// A tunnel that starts in user space and is spliced mid-way (on the kernel relay pass,
/// `EGRESS_TEST_KERNEL_RELAY=on`; in user space throughout otherwise) counts every byte once:
/// those relayed before the hand-over, those of the drain, and the kernel's.
#[tokio::test]
async fn tunnel_bytes_are_counted_once_across_the_hand_over_to_the_kernel() {
    let Setup { h, metrics, .. } = setup_with("kernel_relay_after_reads = 6").await;
    let a = format!("allowed.test:{}", h.up.echo.port());
    let (r, mut s) = connect(h.addr, &a).await;
    assert_eq!(r.status, 200);
    let mut sent = 0;
    for i in 0..8u8 {
        let msg = [b'a' + i; 100];
        s.write_all(&msg).await.unwrap();
        assert_eq!(read_exactly(&mut s, Vec::new(), msg.len()).await, msg);
        sent += msg.len();
    }
    let payload = vec![0x42u8; 3 << 20];
    let (mut r, mut w) = s.into_split();
    let p = payload.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&p).await.unwrap();
        w
    });
    let mut echoed = vec![0u8; payload.len()];
    tokio::time::timeout(T, r.read_exact(&mut echoed))
        .await
        .unwrap()
        .unwrap();
    assert!(echoed == payload);
    sent += payload.len();
    let mut s = r.reunite(writer.await.unwrap()).unwrap();
    s.shutdown().await.unwrap();
    assert_closed(&mut s, T).await;
    let want = [bytes_line("upstream", sent), bytes_line("downstream", sent)];
    let text = scrape_until(&metrics, &want).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        metrics.encode().unwrap(),
        text,
        "counted again after the end"
    );
}
