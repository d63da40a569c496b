//! The DNS responder on loopback (no root) with real programs on both sides: `dig` as the client,
//! and dnsmasq (Debian's) as the agent's upstream resolver, logging every query it receives — so
//! each test checks what *arrived* upstream, not only what the client saw. Installed by
//! `cargo xtask setup` (packages `dnsmasq-base`, `bind9-dnsutils`).
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egress_agent::config::Config;
use egress_agent::events::EventSink;
use egress_agent::proxy::admission::StaticAdmission;
use egress_agent::proxy::dns::{Answer, AnswerSink};
use egress_agent::proxy::{InterceptHooks, PolicyHandle, PolicyProxy, ProxyContext};
use egress_policy::Policy;
use proxy_support::{TempDir, temp_dir};

/// dnsmasq on a loopback port: the upstream resolver, logging every query it gets.
struct Upstream {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

fn free_udp_port() -> u16 {
    // A port free for UDP and TCP alike (dnsmasq binds both).
    loop {
        let t = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = t.local_addr().unwrap().port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

fn need(bin: &str) {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{bin} is missing: run `cargo xtask setup` (installs dnsmasq-base, bind9-dnsutils)"
    );
}

impl Upstream {
    fn start(dir: &Path) -> Upstream {
        need("dnsmasq");
        let port = free_udp_port();
        let log = dir.join("upstream.log");
        let user = String::from_utf8(Command::new("id").arg("-un").output().unwrap().stdout)
            .unwrap()
            .trim()
            .to_owned();
        let child = Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--listen-address=127.0.0.1",
                "--pid-file=",
                "--log-queries",
                "--cache-size=0",
            ])
            .arg(format!("--port={port}"))
            .arg(format!("--user={user}"))
            .arg(format!("--log-facility={}", log.display()))
            .args([
                "--address=/allowed.test/140.82.112.3",
                "--address=/ssh.test/140.82.112.5",
                "--host-record=edge.cdn.test,140.82.112.4,2606:50c0:8000::154",
                "--cname=www.test,edge.cdn.test",
                "--address=/private.test/10.0.0.1",
                "--host-record=mixed.test,140.82.112.6,::1",
                "--address=/reg.test/10.1.2.3",
                "--address=/nx.test/",
                "--address=/control.test/140.82.112.9",
                "--address=/exfil.test/140.82.112.10",
                // Names of presets (the `github` and `openai` presets' hosts).
                "--address=/github.com/140.82.112.7",
                "--address=/openai.com/140.82.112.8",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning dnsmasq");
        let up = Upstream {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
        };
        // Ready once it logs its start (then it answers).
        up.wait_log("started, version");
        up
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the log holds `needle` (events, not sleeps: dnsmasq logs each query as it gets it).
    fn wait_log(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.text().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "upstream never logged {needle:?}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every name the upstream was asked for, lower-cased.
    fn queried(&self) -> String {
        self.text()
            .lines()
            .filter(|l| l.contains(": query["))
            .map(str::to_ascii_lowercase)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[derive(Debug, Clone)]
struct Heard {
    name: String,
    addrs: Vec<IpAddr>,
    ttl: Duration,
    direct_ports: Vec<u16>,
    direct_addrs: Vec<IpAddr>,
}

#[derive(Default)]
struct Recorder(Mutex<Vec<Heard>>);

impl AnswerSink for Recorder {
    fn answered(&self, a: &Answer<'_>) {
        self.0.lock().unwrap().push(Heard {
            name: a.name.to_string(),
            addrs: a.addrs.to_vec(),
            ttl: a.ttl,
            direct_ports: a.direct_ports.to_vec(),
            direct_addrs: a.direct_addrs.to_vec(),
        });
    }
}

struct Fixture {
    up: Upstream,
    events: EventSink,
    heard: Arc<Recorder>,
    udp: SocketAddr,
    tcp: SocketAddr,
    handle: PolicyHandle,
    ctx: ProxyContext,
    config: Arc<Config>,
    _dir: TempDir,
}

async fn fixture() -> Fixture {
    fixture_with("").await
}

/// [`fixture`] with more lines in the test policy.
async fn fixture_with(policy_extra: &str) -> Fixture {
    let dir = temp_dir();
    let up = Upstream::start(&dir);
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "").unwrap();
    let toml = format!(
        r#"
[dns]
nameservers = ["{up}"]
hosts_file = "{hosts}"
timeout_ms = 1000
attempts = 1

[policies.test]
allow_hosts = ["allowed.test", "www.test", {{ host = "ssh.test", ports = [22] }}, "private.test",
               "mixed.test", "reg.test", "*.nx.test", "*.control.test"]
resolve_private = ["10.1.0.0/16"]
{policy_extra}
"#,
        up = up.addr,
        hosts = hosts.display()
    );
    let config = Arc::new(Config::from_toml_str(&toml, Path::new("test.toml")).unwrap());
    let events = EventSink::new(256);
    let heard = Arc::new(Recorder::default());
    let ctx = ProxyContext::new(&config, events.clone())
        .unwrap()
        .with_interception(InterceptHooks {
            admission: Arc::new(StaticAdmission::any()),
            answers: heard.clone(),
        });
    let proxy = bind(&ctx, &config, "test").await;
    let a = proxy.intercept_addrs().unwrap();
    let handle = proxy.policy_handle();
    tokio::spawn(proxy.run(std::future::pending()));
    Fixture {
        up,
        events,
        heard,
        udp: a.dns_udp.unwrap(),
        tcp: a.dns_tcp.unwrap(),
        handle,
        ctx,
        config,
        _dir: dir,
    }
}

async fn bind(ctx: &ProxyContext, config: &Config, policy: &str) -> PolicyProxy {
    PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        policy.to_owned(),
        Arc::new(config.policy(policy).unwrap().clone()),
        ctx.clone(),
    )
    .await
    .unwrap()
}

/// What `dig` saw: the status and the answer section.
#[derive(Debug)]
struct Dig {
    status: String,
    answer: Vec<String>,
    raw: String,
}

async fn dig(server: SocketAddr, tcp: bool, name: &str, rtype: &str) -> Dig {
    need("dig");
    let mut cmd = tokio::process::Command::new("dig");
    cmd.arg(format!("@{}", server.ip()))
        .args(["-p", &server.port().to_string()])
        .args(["+tries=1", "+time=3", "+noall", "+comments", "+answer"]);
    // Explicit either way: dig itself picks TCP for ANY.
    cmd.arg(if tcp { "+tcp" } else { "+notcp" });
    let out = cmd.args([name, rtype]).output().await.unwrap();
    let raw = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = raw
        .split("status: ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or("no answer")
        .to_owned();
    let answer = raw
        .lines()
        .filter(|l| !l.starts_with(';') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    Dig {
        status,
        answer,
        raw,
    }
}

/// A positive control: an allowed name queried now must show up upstream; everything the agent
/// forwarded before it has shown up by then (dnsmasq logs queries in arrival order).
async fn control(f: &Fixture, tcp: bool) {
    let name = if tcp {
        "tcp.control.test"
    } else {
        "udp.control.test"
    };
    let d = dig(if tcp { f.tcp } else { f.udp }, tcp, name, "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    f.up.wait_log(&format!("query[A] {name}"));
}

#[tokio::test]
async fn allowed_names_are_answered_from_the_agents_resolver_with_cname_chains() {
    let f = fixture().await;
    for tcp in [false, true] {
        let server = if tcp { f.tcp } else { f.udp };
        let d = dig(server, tcp, "Allowed.Test", "A").await;
        assert_eq!(d.status, "NOERROR", "{}", d.raw);
        assert_eq!(d.answer.len(), 1, "{}", d.raw);
        assert!(d.answer[0].ends_with("IN A 140.82.112.3"), "{}", d.raw);
        let d = dig(server, tcp, "www.test", "AAAA").await;
        assert_eq!(d.status, "NOERROR", "{}", d.raw);
        assert!(d.answer[0].contains("IN CNAME edge.cdn.test."), "{}", d.raw);
        assert!(
            d.answer[1].ends_with("IN AAAA 2606:50c0:8000::154"),
            "{}",
            d.raw
        );
    }
    f.up.wait_log("query[A] allowed.test");
    f.up.wait_log("query[AAAA] www.test");
    let heard = f.heard.0.lock().unwrap().clone();
    let a = heard.iter().find(|h| h.name == "allowed.test").unwrap();
    assert_eq!(a.addrs, vec!["140.82.112.3".parse::<IpAddr>().unwrap()]);
    assert!(a.ttl >= Duration::from_secs(5) && a.ttl <= Duration::from_secs(300));
    assert!(a.direct_ports.is_empty());
    // Upstream NXDOMAIN for an allowed (wildcard) name passes through, without an event.
    let d = dig(f.udp, false, "gone.nx.test", "A").await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    assert_eq!(f.events.total(), 0);
}

#[tokio::test]
async fn denied_names_never_reach_the_upstream_resolver() {
    let f = fixture().await;
    let secret = "c2VjcmV0LXRva2VuLTEyMzQ1Njc4OTA";
    let mut tries = Vec::new();
    for tcp in [false, true] {
        for (name, rtype, status) in [
            (format!("{secret}.exfil.test"), "A", "NXDOMAIN"),
            (format!("{secret}.exfil.test"), "AAAA", "NXDOMAIN"),
            (format!("{secret}.exfil.test"), "TXT", "REFUSED"),
            (format!("{secret}.exfil.test"), "NULL", "REFUSED"),
            (format!("{secret}.exfil.test"), "ANY", "REFUSED"),
            (format!("allowed.test.{secret}.exfil.test"), "A", "NXDOMAIN"),
            (format!("{secret}.allowed.test"), "A", "NXDOMAIN"),
            (format!("{secret}allowed.test"), "A", "NXDOMAIN"),
            // Allowed names, other types: never forwarded either.
            ("allowed.test".to_owned(), "TXT", "REFUSED"),
            ("allowed.test".to_owned(), "MX", "REFUSED"),
            ("allowed.test".to_owned(), "ANY", "REFUSED"),
            ("allowed.test".to_owned(), "SRV", "REFUSED"),
            ("www.test".to_owned(), "CNAME", "REFUSED"),
        ] {
            let server = if tcp { f.tcp } else { f.udp };
            let d = dig(server, tcp, &name, rtype).await;
            assert_eq!(d.status, status, "{name} {rtype} tcp={tcp}: {}", d.raw);
            assert!(d.answer.is_empty(), "{}", d.raw);
            // Each refusal says why in an Extended DNS Error (RFC 8914).
            let ede = match status {
                "NXDOMAIN" => {
                    "EDE: 15 (Blocked): (egress-agent: denied by policy test: host-not-allowed)"
                }
                _ => {
                    "EDE: 18 (Prohibited): (egress-agent: denied by policy test: dns-type-refused)"
                }
            };
            assert!(d.raw.contains(ede), "{name} {rtype}: {}", d.raw);
            tries.push(name);
        }
        control(&f, tcp).await;
    }
    let upstream = f.up.queried();
    assert!(
        !upstream.contains(&secret.to_ascii_lowercase()),
        "{upstream}"
    );
    assert!(!upstream.contains("exfil"), "{upstream}");
    assert!(
        !upstream.contains("allowed.test"),
        "only the controls arrived: {upstream}"
    );
    // Each one is a denial event naming the (normalised) name.
    let ev = f.events.recent(100);
    assert_eq!(ev.len(), tries.len());
    assert!(
        ev.iter()
            .all(|e| e.protocol == "dns" && e.port == 53 && e.policy == "test")
    );
    let first = &ev[0];
    assert_eq!(
        first.host.as_deref(),
        Some(format!("{}.exfil.test", secret.to_ascii_lowercase()).as_str())
    );
    assert_eq!(first.reason, "host-not-allowed");
    // No rule of the policy is behind a name no entry matches, or a refused query type.
    assert!(ev.iter().all(|e| e.rule.is_none()), "{ev:?}");
    assert!(
        ev.iter()
            .any(|e| e.reason == "dns-type-refused" && e.host.as_deref() == Some("allowed.test"))
    );
}

#[tokio::test]
async fn the_agents_own_name_is_answered_with_the_endpoint_and_never_forwarded() {
    // `egress.internal` is not in the policy: the responder answers it itself with the proxy
    // endpoint's address (where the kernel sends port 80 to the transparent listener), A only;
    // nothing is asked upstream, nothing is reported to the answer sink (no direct allowance),
    // no event.
    let f = fixture().await;
    let endpoint = match f.config.proxy.endpoint {
        SocketAddr::V4(e) => e.ip().to_string(),
        SocketAddr::V6(_) => panic!("the test config's endpoint is IPv4"),
    };
    for tcp in [false, true] {
        let server = if tcp { f.tcp } else { f.udp };
        for name in ["egress.internal", "Egress.Internal."] {
            let d = dig(server, tcp, name, "A").await;
            assert_eq!(d.status, "NOERROR", "{}", d.raw);
            assert_eq!(d.answer.len(), 1, "{}", d.raw);
            assert!(
                d.answer[0].ends_with(&format!("IN A {endpoint}")),
                "{}",
                d.raw
            );
        }
        let d = dig(server, tcp, "egress.internal", "AAAA").await;
        assert_eq!(d.status, "NOERROR", "{}", d.raw);
        assert!(d.answer.is_empty(), "{}", d.raw);
        // Other types of it are refused like any name's; a name under it is no agent name.
        let d = dig(server, tcp, "egress.internal", "TXT").await;
        assert_eq!(d.status, "REFUSED", "{}", d.raw);
        let d = dig(server, tcp, "x.egress.internal", "A").await;
        assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
        control(&f, tcp).await;
    }
    let upstream = f.up.queried();
    assert!(!upstream.contains("egress.internal"), "{upstream}");
    let heard = f.heard.0.lock().unwrap().clone();
    assert!(
        heard.iter().all(|h| !h.name.contains("egress.internal")),
        "{heard:?}"
    );
    // Only the refusals (TXT, the name under it) are events.
    let ev = f.events.recent(100);
    assert!(
        ev.iter()
            .all(|e| e.reason == "dns-type-refused"
                || e.host.as_deref() == Some("x.egress.internal")),
        "{ev:?}"
    );
    assert_eq!(ev.len(), 4, "{ev:?}");
}

#[tokio::test]
async fn names_whose_answer_holds_a_denied_address_are_refused_whole() {
    let f = fixture().await;
    // 10.0.0.1: on the built-in deny list, outside resolve_private.
    let d = dig(f.udp, false, "private.test", "A").await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    assert!(
        d.raw.contains("EDE: 15 (Blocked): (egress-agent: denied by policy test: address-denied (the built-in deny list (rfc1918)))"),
        "{}",
        d.raw
    );
    // mixed.test: a public A and a loopback AAAA; asking for A alone is refused too.
    let d = dig(f.udp, false, "mixed.test", "A").await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    let ev = f.events.recent(10);
    let reasons: Vec<(&str, Option<String>, Option<&str>)> = ev
        .iter()
        .map(|e| {
            let ip = e.ip.map(|i| i.to_string());
            (e.reason.as_str(), ip, e.rule.as_deref())
        })
        .collect();
    // Each names the range that refused it.
    assert_eq!(
        reasons,
        vec![
            (
                "address-denied",
                Some("10.0.0.1".to_owned()),
                Some("the built-in deny list (rfc1918)")
            ),
            (
                "address-denied",
                Some("::1".to_owned()),
                Some("the built-in deny list (loopback)")
            )
        ]
    );
    assert!(
        f.heard.0.lock().unwrap().is_empty(),
        "nothing reported for refused names"
    );
    // resolve_private: answered (the proxy may reach it), but never a direct address.
    let d = dig(f.udp, false, "reg.test", "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    assert!(d.answer[0].ends_with("IN A 10.1.2.3"), "{}", d.raw);
    let heard = f.heard.0.lock().unwrap().clone();
    assert_eq!(heard.len(), 1);
    assert!(heard[0].direct_addrs.is_empty(), "{heard:?}");
}

#[tokio::test]
async fn entry_ports_are_reported_with_the_answered_addresses() {
    let f = fixture().await;
    let d = dig(f.udp, false, "ssh.test", "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    let heard = f.heard.0.lock().unwrap().clone();
    assert_eq!(heard.len(), 1);
    let h = &heard[0];
    assert_eq!(h.name, "ssh.test");
    assert_eq!(h.direct_ports, vec![22]);
    let ip: IpAddr = "140.82.112.5".parse().unwrap();
    assert_eq!(
        (h.addrs.clone(), h.direct_addrs.clone()),
        (vec![ip], vec![ip])
    );
    // The TTL the sink heard is the TTL the client got.
    let ttl: u64 = d.answer[0]
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(Duration::from_secs(ttl), h.ttl);
}

/// A preset's entries are answered like the policy's own, with their own ports for the kernel
/// (`github`'s `{ host = "github.com", ports = [22] }`: git over SSH); a host of a preset the
/// policy does not name is NXDOMAIN and never reaches the upstream.
#[tokio::test]
async fn a_preset_s_names_are_answered_with_their_entry_ports() {
    let f = fixture_with("presets = [\"github\"]").await;
    let d = dig(f.udp, false, "github.com", "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    let heard = f.heard.0.lock().unwrap().clone();
    assert_eq!(heard.len(), 1);
    let ip: IpAddr = "140.82.112.7".parse().unwrap();
    assert_eq!(
        (
            heard[0].name.as_str(),
            heard[0].addrs.clone(),
            heard[0].direct_ports.clone()
        ),
        ("github.com", vec![ip], vec![22])
    );
    let d = dig(f.udp, false, "api.github.com", "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    let d = dig(f.udp, false, "api.openai.com", "A").await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    assert!(!f.up.queried().contains("openai.com"), "{}", f.up.queried());
}

/// Send `pkt`, return the reply if one comes within 300 ms.
async fn answer(s: &tokio::net::UdpSocket, pkt: Vec<u8>) -> Option<Vec<u8>> {
    s.send(&pkt).await.unwrap();
    let mut b = [0u8; 1500];
    tokio::time::timeout(Duration::from_millis(300), s.recv(&mut b))
        .await
        .ok()
        .map(|r| b[..r.unwrap()].to_vec())
}

#[tokio::test]
async fn malformed_packets_get_formerr_or_nothing_and_the_responder_keeps_serving() {
    let f = fixture().await;
    let s = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    s.connect(f.udp).await.unwrap();
    let mut buf = [0u8; 1500];
    // Shorter than a header: dropped.
    assert_eq!(answer(&s, vec![0x12, 0x34, 0x01]).await, None);
    // A header announcing one question, then garbage: FORMERR (rcode 1), same id.
    let mut bad = vec![0xab, 0xcd, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0];
    bad.extend_from_slice(&[0xc0, 0xff, 0x3f, 0x3f, 0x3f]);
    let r = answer(&s, bad).await.unwrap();
    assert_eq!((r[0], r[1], r[3] & 0x0f), (0xab, 0xcd, 1));
    // A label pointer loop.
    let mut looped = vec![0x00, 0x01, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0];
    looped.extend_from_slice(&[0xc0, 0x0c, 0x00, 0x01, 0x00, 0x01]);
    let r = answer(&s, looped).await.unwrap();
    assert_eq!(r[3] & 0x0f, 1);
    // A response packet (QR=1) is never answered.
    let mut resp = vec![0x00, 0x02, 0x81, 0x80, 0x00, 0x01, 0, 0, 0, 0, 0, 0];
    resp.extend_from_slice(b"\x07allowed\x04test\x00\x00\x01\x00\x01");
    assert_eq!(answer(&s, resp).await, None);
    // Random bytes of every length up to 64.
    for n in 12..64u8 {
        let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
        s.send(&junk).await.unwrap();
    }
    while tokio::time::timeout(Duration::from_millis(100), s.recv(&mut buf))
        .await
        .is_ok()
    {}
    let d = dig(f.udp, false, "allowed.test", "A").await;
    assert_eq!(d.status, "NOERROR", "still serving: {}", d.raw);
    let d = dig(f.tcp, true, "allowed.test", "A").await;
    assert_eq!(d.status, "NOERROR", "still serving over TCP: {}", d.raw);
}

#[tokio::test]
async fn deny_all_and_allow_all_get_no_responder_and_a_reload_to_deny_all_refuses() {
    let f = fixture().await;
    for name in ["deny_all", "allow_all"] {
        let p = bind(&f.ctx, &f.config, name).await;
        let a = p.intercept_addrs().unwrap();
        assert_eq!(
            (a.dns_udp, a.dns_tcp, a.transparent),
            (None, None, None),
            "{name}"
        );
    }
    let d = dig(f.udp, false, "allowed.test", "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    f.handle.set(&Policy::deny_all());
    let d = dig(f.udp, false, "allowed.test", "A").await;
    assert_eq!(d.status, "REFUSED", "{}", d.raw);
    assert!(
        d.raw.contains("EDE: 18 (Prohibited): (egress-agent: denied by policy test: policy-deny-all (mode deny_all))"),
        "{}",
        d.raw
    );
    let ev = f.events.recent(1).pop().unwrap();
    assert_eq!(ev.reason, "policy-deny-all");
    assert_eq!(ev.rule.as_deref(), Some("mode deny_all"));
}

/// Under audit a name no entry matches is answered and reported as a would-deny (no rule behind
/// it); an allowed name's answer records nothing.
#[tokio::test]
async fn an_audited_name_is_a_would_deny_without_a_rule() {
    let f = fixture().await;
    let mut audit = f.config.policy("test").unwrap().clone();
    audit.enforce = egress_policy::model::Enforce::Audit;
    f.handle.set(&audit);
    let before = f.events.total();
    let d = dig(f.udp, false, "allowed.test", "A").await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    assert_eq!(f.events.total(), before);
    dig(f.udp, false, "unlisted.test", "A").await;
    let ev = f.events.recent(1).pop().unwrap();
    assert_eq!(
        (ev.verdict, ev.reason.as_str(), ev.host.as_deref(), ev.rule),
        (
            egress_agent::events::Verdict::WouldDeny,
            "host-not-allowed",
            Some("unlisted.test"),
            None
        )
    );
    assert_eq!(f.events.total(), before + 1);
}

#[tokio::test]
async fn serve_reports_interception_addresses_per_policy_v6_siblings_included() {
    if std::net::UdpSocket::bind("[::1]:0").is_err() {
        eprintln!("skipping: no IPv6 loopback");
        return;
    }
    let f = fixture().await;
    let mut config = (*f.config).clone();
    config.proxy.endpoint_v6 = Some("[::1]:3128".parse().unwrap());
    let config = Arc::new(config);
    let heard = Arc::new(Recorder::default());
    let ctx = ProxyContext::new(&config, f.events.clone())
        .unwrap()
        .with_interception(InterceptHooks {
            admission: Arc::new(StaticAdmission::any()),
            answers: heard.clone(),
        });
    let server = egress_agent::proxy::serve(config.clone(), ctx, std::future::pending())
        .await
        .unwrap();
    let v4 = server.intercept_addrs();
    let v6 = server.intercept_addrs_v6();
    for (name, a) in v4.iter().chain(v6.iter()) {
        let all = [a.transparent, a.dns_udp, a.dns_tcp];
        // Allowlist policies (the test's, and the built-in `audit`) are intercepted.
        if name == "test" || name == "audit" {
            assert!(all.iter().all(Option::is_some), "{name}: {a:?}");
        } else {
            assert!(all.iter().all(Option::is_none), "{name}: {a:?}");
        }
    }
    let (a4, a6) = (v4["test"], v6["test"]);
    assert!(a4.dns_udp.unwrap().ip().is_loopback() && a4.dns_udp.unwrap().is_ipv4());
    assert!(a6.dns_udp.unwrap().is_ipv6() && a6.transparent.unwrap().is_ipv6());
    // The v6 responder serves the same policy.
    for (server, tcp) in [(a6.dns_udp.unwrap(), false), (a6.dns_tcp.unwrap(), true)] {
        let d = dig(server, tcp, "allowed.test", "A").await;
        assert_eq!(d.status, "NOERROR", "{}", d.raw);
        let d = dig(server, tcp, "evil.test", "A").await;
        assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    }
    assert_eq!(heard.0.lock().unwrap().len(), 2);
}
