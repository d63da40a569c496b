//! The responder's batched UDP path and bounded DNS-over-TCP on loopback (no root): many clients
//! at once, bursts larger than one `recvmmsg` batch (32), malformed datagrams inside a batch,
//! truncation (TC) and the TCP retry, a slow upstream lookup that doesn't hold up cached answers,
//! the answer sink hearing every allowed answer on both transports, the TCP connection bound, and
//! the DNS metrics, and connections through the proxy dialling from the responder's records (no
//! upstream query per connection). The upstream is a resolver the test controls (it can hold an answer until
//! released, and logs every name it is asked), so each test checks what arrived upstream too.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_agent::config::Config;
use egress_agent::events::EventSink;
use egress_agent::metrics::Metrics;
use egress_agent::proxy::admission::StaticAdmission;
use egress_agent::proxy::dns::tcp::MAX_TCP_CONNECTIONS;
use egress_agent::proxy::dns::{Answer, AnswerSink};
use egress_agent::proxy::{InterceptHooks, PolicyHandle, PolicyProxy, ProxyContext};
use hickory_server::proto::op::{Edns, Message, OpCode, Query, ResponseCode};
use hickory_server::proto::rr::rdata::A;
use hickory_server::proto::rr::{Name, RData, Record, RecordType};
use proxy_support::{T, TempDir, temp_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::watch;

/// Names in the hosts file with this many addresses: too big for a 512-byte answer.
const BIG: usize = 40;

/// The agent's upstream nameserver: NOERROR without records (and without an SOA) for every name,
/// except `slow.*` names, answered A 140.82.112.7 only once `release` turns true,
/// `*.loop.test`, A 127.0.0.1 (the test's echo server is there), and `fail.test`, SERVFAIL.
struct Upstream {
    addr: SocketAddr,
    release: watch::Sender<bool>,
    asked: Arc<Mutex<Vec<String>>>,
}

async fn upstream() -> Upstream {
    let s = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = s.local_addr().unwrap();
    let (release, rx) = watch::channel(false);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = asked.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        loop {
            let Ok((n, from)) = s.recv_from(&mut buf).await else {
                return;
            };
            let Ok(q) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let Some(query) = q.queries.first().cloned() else {
                continue;
            };
            let name = query.name().to_ascii().to_ascii_lowercase();
            log.lock()
                .unwrap()
                .push(format!("{name} {}", query.query_type()));
            let mut r = Message::response(q.metadata.id, OpCode::Query);
            r.metadata.recursion_desired = q.metadata.recursion_desired;
            r.metadata.recursion_available = true;
            r.add_query(query.clone());
            let slow = name.ends_with(".slow.test.");
            if slow && query.query_type() == RecordType::A {
                r.add_answer(Record::from_rdata(
                    query.name().clone(),
                    60,
                    RData::A(A::new(140, 82, 112, 7)),
                ));
            }
            if name == "fail.test." {
                r.metadata.response_code = ResponseCode::ServFail;
            }
            if name.ends_with(".loop.test.") && query.query_type() == RecordType::A {
                r.add_answer(Record::from_rdata(
                    query.name().clone(),
                    60,
                    RData::A(A::new(127, 0, 0, 1)),
                ));
            }
            let (s, mut rx) = (s.clone(), rx.clone());
            tokio::spawn(async move {
                if slow {
                    rx.wait_for(|go| *go).await.ok();
                }
                s.send_to(&r.to_vec().unwrap(), from).await.ok();
            });
        }
    });
    Upstream {
        addr,
        release,
        asked,
    }
}

#[derive(Default)]
struct Recorder {
    heard: Mutex<Vec<(String, Vec<IpAddr>)>>,
    /// The TTL and direct ports of each report.
    ttls: Mutex<Vec<(u64, Vec<u16>)>>,
    n: AtomicUsize,
}

impl AnswerSink for Recorder {
    fn answered(&self, a: &Answer<'_>) {
        self.n.fetch_add(1, Ordering::SeqCst);
        self.heard
            .lock()
            .unwrap()
            .push((a.name.to_string(), a.addrs.to_vec()));
        self.ttls
            .lock()
            .unwrap()
            .push((a.ttl.as_secs(), a.direct_ports.to_vec()));
    }
}

struct Fixture {
    up: Upstream,
    events: EventSink,
    sink: Arc<Recorder>,
    metrics: Arc<Metrics>,
    udp: SocketAddr,
    tcp: SocketAddr,
    handle: PolicyHandle,
    config: Arc<Config>,
    /// The policy's explicit proxy listener, and an echo server the `*.loop.test` names reach.
    proxy: SocketAddr,
    echo: SocketAddr,
    _dir: TempDir,
}

async fn fixture() -> Fixture {
    fixture_with(EventSink::new(4096)).await
}

/// The fixture with `events` as the proxy's event sink (the daemon's collapses).
async fn fixture_with(events: EventSink) -> Fixture {
    let dir = temp_dir();
    let up = upstream().await;
    let echo = proxy_support::echo_server().await;
    let hosts = dir.join("hosts");
    let mut text = String::new();
    for i in 0..8 {
        text.push_str(&format!("140.82.112.{} h{i}.hit.test\n", 10 + i));
    }
    for i in 0..BIG {
        text.push_str(&format!("140.82.113.{} big.test\n", 10 + i));
    }
    std::fs::write(&hosts, text).unwrap();
    let toml = format!(
        r#"
[dns]
nameservers = ["{up}"]
hosts_file = "{hosts}"
timeout_ms = 5000
attempts = 1

[policies.test]
allow_hosts = ["*.hit.test", "big.test", "*.slow.test", {{ host = "h7.hit.test", ports = [22] }},
    {{ host = "*.loop.test", ports = [{echo}] }}]
resolve_private = ["127.0.0.1/32"]
"#,
        up = up.addr,
        hosts = hosts.display(),
        echo = echo.port()
    );
    let config = Arc::new(Config::from_toml_str(&toml, Path::new("test.toml")).unwrap());
    let sink = Arc::new(Recorder::default());
    let metrics = Arc::new(Metrics::new());
    let ctx = ProxyContext::new(&config, events.clone())
        .unwrap()
        .with_metrics(metrics.clone())
        .with_interception(InterceptHooks {
            admission: Arc::new(StaticAdmission::any()),
            answers: sink.clone(),
        });
    let proxy = PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        "test".to_owned(),
        Arc::new(config.policy("test").unwrap().clone()),
        ctx,
    )
    .await
    .unwrap();
    let a = proxy.intercept_addrs().unwrap();
    let handle = proxy.policy_handle();
    let proxy_addr = proxy.local_addr();
    tokio::spawn(proxy.run(std::future::pending()));
    Fixture {
        up,
        events,
        sink,
        metrics,
        udp: a.dns_udp.unwrap(),
        tcp: a.dns_tcp.unwrap(),
        handle,
        config,
        proxy: proxy_addr,
        echo,
        _dir: dir,
    }
}

fn query(id: u16, name: &str, rt: RecordType, edns: Option<u16>) -> Vec<u8> {
    let mut m = Message::query();
    m.metadata.id = id;
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), rt));
    if let Some(p) = edns {
        let mut e = Edns::new();
        e.set_max_payload(p);
        m.set_edns(e);
    }
    m.to_vec().unwrap()
}

async fn client() -> UdpSocket {
    UdpSocket::bind("127.0.0.1:0").await.unwrap()
}

async fn recv(s: &UdpSocket) -> Option<Message> {
    Some(Message::from_vec(&recv_raw(s).await?).unwrap())
}

/// `(id, code, answers)` of every reply arriving on `s` until `n` have come (or a timeout).
async fn replies(s: &UdpSocket, n: usize) -> HashMap<u16, (ResponseCode, usize)> {
    let mut got = HashMap::new();
    while got.len() < n {
        let Some(m) = recv(s).await else { break };
        got.insert(m.metadata.id, (m.metadata.response_code, m.answers.len()));
    }
    got
}

/// The value of one `dns_*_total` series of policy `test`; `label` is its other label
/// (`outcome="allowed"`), or empty for a series with the policy label alone.
fn metric(m: &Metrics, name: &str, label: &str) -> u64 {
    let text = m.encode().unwrap();
    let labels = if label.is_empty() {
        String::new()
    } else {
        format!(",{label}")
    };
    let key = format!("egress_agent_{name}_total{{policy=\"test\"{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Warm the cache for the `hit.test` names (their first query is a miss, resolved on a task).
async fn warm(f: &Fixture) {
    let s = client().await;
    for i in 0..8u16 {
        s.send_to(
            &query(i, &format!("h{i}.hit.test."), RecordType::A, None),
            f.udp,
        )
        .await
        .unwrap();
    }
    let got = replies(&s, 8).await;
    assert_eq!(got.len(), 8, "{got:?}");
    assert!(
        got.values()
            .all(|(c, n)| *c == ResponseCode::NoError && *n == 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_and_bursts_larger_than_a_batch_are_all_answered_and_reported() {
    let f = fixture().await;
    warm(&f).await;
    let before = f.sink.n.load(Ordering::SeqCst);
    // 40 clients at once, each a burst of 8 (alternating allowed and denied): 320 datagrams, ten
    // batches' worth, arriving while earlier batches are answered (and within the socket's
    // default receive buffer: beyond it the kernel drops, as for any UDP server).
    let mut tasks = Vec::new();
    for c in 0..40u16 {
        let server = f.udp;
        tasks.push(tokio::spawn(async move {
            let s = client().await;
            for k in 0..8u16 {
                let name = if k % 2 == 0 {
                    format!("h{}.hit.test.", (c + k) % 8)
                } else {
                    format!("x{c}-{k}.denied.test.")
                };
                s.send_to(&query(k, &name, RecordType::A, None), server)
                    .await
                    .unwrap();
            }
            replies(&s, 8).await
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        let got = t.await.unwrap();
        assert_eq!(got.len(), 8, "every query answered: {got:?}");
        for (id, (code, n)) in got {
            if id % 2 == 0 {
                assert_eq!((code, n), (ResponseCode::NoError, 1));
                allowed += 1;
            } else {
                assert_eq!((code, n), (ResponseCode::NXDomain, 0));
            }
        }
    }
    assert_eq!(allowed, 160);
    // Every allowed answer was reported to the sink, every denied one is an event.
    assert_eq!(f.sink.n.load(Ordering::SeqCst) - before, 160);
    assert_eq!(f.events.total(), 160);
    // Only hit.test names reached the upstream (their AAAA, at warm-up): no denied name.
    let asked = f.up.asked.lock().unwrap().clone();
    assert!(asked.iter().all(|a| a.contains(".hit.test")), "{asked:?}");
    assert_eq!(
        metric(&f.metrics, "dns_answers", "outcome=\"allowed\""),
        168
    );
    assert_eq!(metric(&f.metrics, "dns_answers", "outcome=\"denied\""), 160);
}

#[tokio::test]
async fn malformed_datagrams_mixed_into_a_batch_are_dropped_or_formerr_and_the_rest_answered() {
    let f = fixture().await;
    warm(&f).await;
    let s = client().await;
    let mut formerr = vec![0xab, 0xcd, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0];
    formerr.extend_from_slice(&[0xc0, 0xff, 0x3f, 0x3f, 0x3f]);
    let mut response = query(0x0101, "h1.hit.test.", RecordType::A, None);
    response[2] |= 0x80;
    // All sent before the responder reads any: they share batches.
    let mut sent: Vec<Vec<u8>> = Vec::new();
    for round in 0..10u16 {
        sent.push(query(round * 10 + 1, "h1.hit.test.", RecordType::A, None));
        sent.push(vec![0x12, 0x34, 0x01]);
        sent.push(formerr.clone());
        sent.push(response.clone());
        // Junk behind a header of its own (id 0xeeee, not one of the ids checked below).
        let mut junk = vec![0xee, 0xee];
        junk.extend((2..40u8).map(|i| i.wrapping_mul(37).wrapping_add(round as u8)));
        sent.push(junk);
        sent.push(query(
            round * 10 + 2,
            "h2.hit.test.",
            RecordType::AAAA,
            Some(1232),
        ));
        sent.push(vec![0u8; 5000]);
    }
    for p in &sent {
        s.send_to(p, f.udp).await.unwrap();
    }
    let mut ok = 0;
    let mut formerrs = 0;
    while let Some(m) = recv(&s).await {
        match m.metadata.id {
            0xabcd => {
                assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
                formerrs += 1;
            }
            0x0101 => panic!("a response was answered"),
            id if id % 10 == 1 => {
                assert_eq!(m.answers.len(), 1);
                ok += 1;
            }
            id if id % 10 == 2 => {
                // NODATA for AAAA (hosts file has A only; upstream NOERROR, no records).
                assert_eq!(
                    (m.metadata.response_code, m.answers.len()),
                    (ResponseCode::NoError, 0)
                );
                ok += 1;
            }
            _ => {}
        }
        if ok == 20 && formerrs == 10 {
            break;
        }
    }
    assert_eq!((ok, formerrs), (20, 10));
    assert!(metric(&f.metrics, "dns_dropped", "reason=\"malformed\"") >= 20);
    assert_eq!(metric(&f.metrics, "dns_dropped", "reason=\"response\""), 10);
}

#[tokio::test]
async fn answers_too_big_for_udp_are_truncated_then_answered_whole_over_tcp() {
    let f = fixture().await;
    let s = client().await;
    // Without EDNS (512 bytes): TC, no records, nothing reported.
    s.send_to(&query(1, "big.test.", RecordType::A, None), f.udp)
        .await
        .unwrap();
    let m = recv(&s).await.unwrap();
    assert!(m.metadata.truncation, "{m:?}");
    assert!(m.answers.is_empty());
    assert_eq!(f.sink.n.load(Ordering::SeqCst), 0);
    // Now cached: still truncated on the fast path (same code, same limit).
    s.send_to(&query(2, "big.test.", RecordType::A, Some(512)), f.udp)
        .await
        .unwrap();
    let m = recv(&s).await.unwrap();
    assert!(m.metadata.truncation && m.answers.is_empty());
    // EDNS 1232: fits.
    s.send_to(&query(3, "big.test.", RecordType::A, Some(1232)), f.udp)
        .await
        .unwrap();
    let m = recv(&s).await.unwrap();
    assert!(!m.metadata.truncation);
    assert_eq!(m.answers.len(), BIG);
    // TCP: the whole answer, without EDNS.
    let b = tcp_raw(&f, &query(4, "big.test.", RecordType::A, None)).await;
    let m = Message::from_vec(&b).unwrap();
    assert_eq!((m.metadata.id, m.answers.len()), (4, BIG));
    assert!(!m.metadata.truncation);
    // Reported once per answer that carried addresses (UDP with EDNS, TCP), never when truncated.
    let heard = f.sink.heard.lock().unwrap().clone();
    assert_eq!(heard.len(), 2, "{heard:?}");
    assert!(heard.iter().all(|(n, a)| n == "big.test" && a.len() == BIG));
    assert_eq!(
        metric(&f.metrics, "dns_answers", "outcome=\"truncated\""),
        2
    );
}

#[tokio::test]
async fn a_slow_lookup_resolves_on_its_own_while_cached_answers_keep_flowing() {
    let f = fixture().await;
    warm(&f).await;
    let s = client().await;
    s.send_to(&query(7, "a.slow.test.", RecordType::A, None), f.udp)
        .await
        .unwrap();
    // The upstream holds it; meanwhile 200 cached answers to another client.
    let other = client().await;
    for i in 0..200u16 {
        other
            .send_to(
                &query(
                    1000 + i,
                    &format!("h{}.hit.test.", i % 8),
                    RecordType::A,
                    None,
                ),
                f.udp,
            )
            .await
            .unwrap();
    }
    let got = replies(&other, 200).await;
    assert_eq!(got.len(), 200);
    assert!(
        got.values()
            .all(|(c, n)| *c == ResponseCode::NoError && *n == 1)
    );
    assert!(
        f.up.asked
            .lock()
            .unwrap()
            .iter()
            .any(|a| a == "a.slow.test. A"),
        "the miss reached the upstream"
    );
    // Nothing for the slow name yet; released, its answer comes.
    let mut b = [0u8; 512];
    assert!(
        tokio::time::timeout(Duration::from_millis(200), s.recv(&mut b))
            .await
            .is_err()
    );
    assert!(
        !f.sink
            .heard
            .lock()
            .unwrap()
            .iter()
            .any(|(n, _)| n == "a.slow.test")
    );
    f.up.release.send(true).unwrap();
    let m = recv(&s).await.unwrap();
    assert_eq!((m.metadata.id, m.answers.len()), (7, 1));
    assert_eq!(
        m.answers[0].data.ip_addr(),
        Some("140.82.112.7".parse().unwrap())
    );
    let heard = f.sink.heard.lock().unwrap().clone();
    assert!(
        heard
            .iter()
            .any(|(n, a)| n == "a.slow.test"
                && a == &vec!["140.82.112.7".parse::<IpAddr>().unwrap()]),
        "{heard:?}"
    );
}

#[tokio::test]
async fn tcp_connections_beyond_the_bound_are_refused_and_counted() {
    let f = fixture().await;
    let mut open = Vec::new();
    for _ in 0..MAX_TCP_CONNECTIONS {
        open.push(TcpStream::connect(f.tcp).await.unwrap());
    }
    // One query on the last of them proves they were all accepted (accepts are in order).
    let ask = |id: u16| {
        let q = query(id, "h0.hit.test.", RecordType::A, None);
        let mut framed = (q.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&q);
        framed
    };
    let last = open.last_mut().unwrap();
    last.write_all(&ask(1)).await.unwrap();
    assert!(
        tokio::time::timeout(T, last.read_u16())
            .await
            .unwrap()
            .is_ok()
    );
    // One more: closed without an answer.
    let mut extra = TcpStream::connect(f.tcp).await.unwrap();
    extra.write_all(&ask(2)).await.ok();
    let mut b = [0u8; 2];
    let r = tokio::time::timeout(T, extra.read(&mut b)).await.unwrap();
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    assert_eq!(metric(&f.metrics, "dns_tcp_refused", ""), 1);
    // Closing one frees a slot.
    drop(open.remove(0));
    let mut again = None;
    for _ in 0..50 {
        let mut t = TcpStream::connect(f.tcp).await.unwrap();
        t.write_all(&ask(3)).await.unwrap();
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), t.read_u16()).await {
            again = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "a slot came free");
}

/// The raw answer on `s` (`None`: nothing within [`T`]).
async fn recv_raw(s: &UdpSocket) -> Option<Vec<u8>> {
    let mut b = vec![0u8; 65_535];
    let n = tokio::time::timeout(T, s.recv(&mut b)).await.ok()?.unwrap();
    b.truncate(n);
    Some(b)
}

/// `q` over DNS-over-TCP (a new connection): the full path, whose answers are never kept.
async fn tcp_raw(f: &Fixture, q: &[u8]) -> Vec<u8> {
    let mut t = TcpStream::connect(f.tcp).await.unwrap();
    let mut framed = (q.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(q);
    t.write_all(&framed).await.unwrap();
    let len = tokio::time::timeout(T, t.read_u16())
        .await
        .unwrap()
        .unwrap();
    let mut b = vec![0; usize::from(len)];
    t.read_exact(&mut b).await.unwrap();
    b
}

/// Queries asked again are answered from the responder's memo: the same bytes as the full path
/// (TCP, never kept) but for each query's own id, and every effect of the full path on each —
/// the sink report (with the entry's direct ports), the counters, a denied name's event, never
/// the upstream; a name spelled otherwise or another record type is another answer; a policy
/// change refuses a kept name at once.
#[tokio::test]
async fn repeated_queries_get_the_full_paths_bytes_and_every_effect() {
    let f = fixture().await;
    warm(&f).await;
    let s = client().await;
    let reference = tcp_raw(&f, &query(1, "h7.hit.test.", RecordType::A, Some(1232))).await;
    let (heard, allowed) = (
        f.sink.n.load(Ordering::SeqCst),
        metric(&f.metrics, "dns_answers", "outcome=\"allowed\""),
    );
    for id in 100..150u16 {
        s.send_to(&query(id, "h7.hit.test.", RecordType::A, Some(1232)), f.udp)
            .await
            .unwrap();
        let got = recv_raw(&s).await.unwrap();
        assert_eq!(got[..2], id.to_be_bytes(), "the query's own id");
        assert_eq!(
            got[2..],
            reference[2..],
            "the full path's bytes (query {id})"
        );
    }
    assert_eq!(f.sink.n.load(Ordering::SeqCst) - heard, 50);
    assert!(
        f.sink.ttls.lock().unwrap()[heard..]
            .iter()
            .all(|(ttl, ports)| *ttl == 300 && ports == &[22]),
        "every report carries the TTL answered and the entry's ports"
    );
    assert_eq!(
        metric(&f.metrics, "dns_answers", "outcome=\"allowed\"") - allowed,
        50
    );
    // Spelled otherwise, or AAAA: another answer (the question echoed as asked).
    for (name, rt) in [
        ("H7.Hit.TEST.", RecordType::A),
        ("h7.hit.test.", RecordType::AAAA),
    ] {
        let reference = tcp_raw(&f, &query(2, name, rt, None)).await;
        for id in [300u16, 301] {
            s.send_to(&query(id, name, rt, None), f.udp).await.unwrap();
            let got = recv_raw(&s).await.unwrap();
            assert_eq!(
                (got[..2] == id.to_be_bytes(), &got[2..]),
                (true, &reference[2..]),
                "{name} {rt}"
            );
        }
    }
    // A denied name: every query an NXDOMAIN with its id and an event; the upstream never asked.
    let events = f.events.total();
    for id in 400..420u16 {
        s.send_to(&query(id, "x.denied.test.", RecordType::A, None), f.udp)
            .await
            .unwrap();
        let m = recv(&s).await.unwrap();
        assert_eq!(
            (m.metadata.id, m.metadata.response_code),
            (id, ResponseCode::NXDomain)
        );
    }
    assert_eq!(f.events.total() - events, 20);
    let denied = f.events.recent(20);
    assert!(
        denied
            .iter()
            .all(|e| e.host.as_deref() == Some("x.denied.test") && e.count == 1)
    );
    // The reused ones are copies of the first (the full path's), each with its own time.
    for pair in denied.windows(2) {
        let mut later = pair[1].clone();
        assert!(later.time >= pair[0].time);
        later.time = pair[0].time;
        assert_eq!(later, pair[0]);
    }
    assert!(
        !upstream_asked(&f, "denied"),
        "the upstream was never asked"
    );
    // The policy changes: the kept answer is refused at the next query.
    let mut narrowed = f.config.policy("test").unwrap().clone();
    narrowed
        .allow_hosts
        .retain(|h| !h.to_string().contains("hit.test"));
    f.handle.set(&narrowed);
    let events = f.events.total();
    s.send_to(
        &query(500, "h7.hit.test.", RecordType::A, Some(1232)),
        f.udp,
    )
    .await
    .unwrap();
    let m = recv(&s).await.unwrap();
    assert_eq!(
        (m.metadata.id, m.metadata.response_code),
        (500, ResponseCode::NXDomain)
    );
    assert_eq!(f.events.total() - events, 1);
}

/// With the daemon's sink (identical refusals collapsed), a denied name asked again and again
/// is answered from the memo with the full path's bytes, and its refusals are the full path's
/// event — the first one recorded at once — then a count: one summary at the stop, the counts
/// adding up to every query. The kept event is the full path's field for field (else its
/// attempts would be another key: a second event recorded at once).
#[tokio::test]
async fn kept_refusals_are_the_full_paths_event_then_a_count() {
    let f = fixture_with(EventSink::with_collapse(4096, Duration::from_secs(3600))).await;
    warm(&f).await;
    let s = client().await;
    let q = |id| query(id, "x.denied.test.", RecordType::A, None);
    // The full path (DNS over TCP is never kept): the refusal's event, recorded at once.
    let reference = tcp_raw(&f, &q(1)).await;
    let first: Vec<_> = f
        .events
        .recent(100)
        .into_iter()
        .filter(|e| e.host.as_deref() == Some("x.denied.test"))
        .collect();
    assert_eq!(first.len(), 1);
    let total = f.events.total();
    for id in 400..450u16 {
        s.send_to(&q(id), f.udp).await.unwrap();
        let got = recv_raw(&s).await.unwrap();
        assert_eq!(got[..2], id.to_be_bytes());
        assert_eq!(
            got[2..],
            reference[2..],
            "the full path's bytes (query {id})"
        );
    }
    assert_eq!(f.events.total() - total, 50, "every query counted at once");
    f.events.flush_collapsed();
    let denied: Vec<_> = f
        .events
        .recent(100)
        .into_iter()
        .filter(|e| e.host.as_deref() == Some("x.denied.test"))
        .collect();
    assert_eq!(
        denied.iter().map(|e| e.count).collect::<Vec<_>>(),
        [1, 50],
        "the first, then one summary of the rest: {denied:?}"
    );
    let mut summary = denied[1].clone();
    assert!(summary.time >= first[0].time);
    (summary.time, summary.count) = (first[0].time, 1);
    assert_eq!(summary, first[0], "the kept event is the full path's");
    assert!(
        !upstream_asked(&f, "denied"),
        "the upstream was never asked"
    );
}

/// A kept answer's TTL follows the records' remaining lifetime: asked again and again, the
/// TTL answered goes down second by second (the memo re-plans when its second has passed), and
/// each report to the sink carries the TTL the client got.
#[tokio::test]
async fn a_kept_answers_ttl_counts_down_with_its_records() {
    let f = fixture().await;
    f.up.release.send(true).unwrap();
    let s = client().await;
    let ask = |id: u16| query(id, "t.slow.test.", RecordType::A, None);
    s.send_to(&ask(1), f.udp).await.unwrap();
    let first = recv(&s).await.unwrap();
    assert_eq!(first.answers.len(), 1, "{first:?}");
    let mut ttls = vec![first.answers[0].ttl];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    let mut id = 2;
    while ttls.last() == ttls.first() && tokio::time::Instant::now() < deadline {
        s.send_to(&ask(id), f.udp).await.unwrap();
        let m = recv(&s).await.unwrap();
        assert_eq!(m.metadata.id, id);
        ttls.push(m.answers[0].ttl);
        id += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (first, last) = (ttls[0], *ttls.last().unwrap());
    assert!(
        first <= 60 && last == first - 1,
        "one second less: {ttls:?}"
    );
    assert!(ttls.windows(2).all(|w| w[1] <= w[0]), "never up: {ttls:?}");
    let reported: Vec<u64> = f
        .sink
        .ttls
        .lock()
        .unwrap()
        .iter()
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(
        reported,
        ttls.iter().map(|t| u64::from(*t)).collect::<Vec<_>>(),
        "each report is the TTL answered"
    );
}

/// What the upstream was asked about `name` (its questions, sorted).
/// Whether any query the upstream got mentions `part`.
fn upstream_asked(f: &Fixture, part: &str) -> bool {
    f.up.asked.lock().unwrap().iter().any(|a| a.contains(part))
}

fn asked_about(f: &Fixture, name: &str) -> Vec<String> {
    let mut v: Vec<String> =
        f.up.asked
            .lock()
            .unwrap()
            .iter()
            .filter(|q| q.split(' ').next() == Some(name))
            .cloned()
            .collect();
    v.sort();
    v
}

/// CONNECT `name`:echo through the explicit proxy, and one byte echoed through the tunnel.
async fn connect_and_echo(f: &Fixture, name: &str, byte: u8) {
    let (resp, mut s) = proxy_support::connect(f.proxy, &format!("{name}:{}", f.echo.port())).await;
    assert_eq!(resp.status, 200, "CONNECT {name}: {}", resp.text());
    proxy_support::assert_echo(&mut s, &[byte]).await;
}

/// A connection to a name dials from the records the responder answers from (one resolver, one
/// cache): after the workload's DNS answer, connections to that name ask the upstream nothing
/// more, and a name the workload never asked is asked once per family by its first connection
/// and then reused. The upstream's no-AAAA answer carries no SOA — hickory alone kept it for 0 s
/// and asked again for every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_to_a_name_reuse_the_responders_records() {
    let f = fixture().await;
    let s = client().await;
    s.send_to(&query(7, "a.loop.test.", RecordType::A, None), f.udp)
        .await
        .unwrap();
    let m = recv(&s).await.expect("an answer");
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    let addrs: Vec<IpAddr> = m.answers.iter().filter_map(|r| r.data.ip_addr()).collect();
    assert_eq!(addrs, ["127.0.0.1".parse::<IpAddr>().unwrap()]);
    let both = ["a.loop.test. A", "a.loop.test. AAAA"];
    assert_eq!(asked_about(&f, "a.loop.test."), both);
    for i in 0..5 {
        connect_and_echo(&f, "a.loop.test", b'a' + i).await;
    }
    assert_eq!(
        asked_about(&f, "a.loop.test."),
        both,
        "the connections asked the upstream nothing more"
    );
    for i in 0..5 {
        connect_and_echo(&f, "b.loop.test", b'k' + i).await;
    }
    assert_eq!(
        asked_about(&f, "b.loop.test."),
        ["b.loop.test. A", "b.loop.test. AAAA"],
        "once per family for five connections"
    );
}

/// The resolver alone (no responder, no proxy) on the same upstream: a name's addresses are asked
/// for once per family however often it is looked up (its AAAA no-data answer without an SOA
/// included), the responder's records are that same answer, and a failure says why.
#[tokio::test]
async fn the_resolver_asks_once_per_family_and_says_why_a_lookup_failed() {
    use egress_agent::config::{DnsConfig, NameServer};
    use egress_agent::proxy::resolve::{DnsResolver, Family};
    use egress_policy::name::HostName;
    let dir = temp_dir();
    let up = upstream().await;
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "").unwrap();
    let cfg = DnsConfig {
        nameservers: Some(vec![NameServer(up.addr)]),
        hosts_file: hosts,
        timeout_ms: 500,
        attempts: 1,
        ..DnsConfig::default()
    };
    let r = DnsResolver::from_config(&cfg).unwrap();
    let x = HostName::parse("x.loop.test").unwrap();
    let want: Vec<IpAddr> = vec!["127.0.0.1".parse().unwrap()];
    for _ in 0..20 {
        assert_eq!(r.lookup(&x).await.unwrap(), want);
    }
    let records = r.lookup_records(&x).await;
    assert!(matches!(records.v6, Family::NoData), "{records:?}");
    let mut heard = up.asked.lock().unwrap().clone();
    heard.sort();
    assert_eq!(
        heard,
        ["x.loop.test. A", "x.loop.test. AAAA"],
        "asked once per family"
    );

    let fail = HostName::parse("fail.test").unwrap();
    let e = r.lookup(&fail).await.unwrap_err().to_string();
    assert!(
        e.starts_with("lookup of fail.test failed: "),
        "a failure says so: {e}"
    );
    let none = HostName::parse("none.test").unwrap();
    assert_eq!(
        r.lookup(&none).await.unwrap_err().to_string(),
        "no address for none.test"
    );
}
