//! `dns-bench`: the agent's DNS responder side by side with dnsmasq (Debian's), same allowlist.
//!
//! Both answer `*.bench.test` from their cache (filled by one warm-up pass from an upstream dnsmasq
//! authoritative for `bench.test`) and answer every other name NXDOMAIN themselves: the agent
//! because its policy allows only `*.bench.test`, dnsmasq through `--server=/bench.test/UPSTREAM`
//! plus `--address=/#/`. Each round measures, for each peer in turn, closed-loop UDP queries from
//! this process (pinned to CPU 0) to the peer (pinned to CPU 1): answers/s and the peer's CPU time
//! per answer (from /proc/PID/stat), for allowed names (A, cached) and for denied names. Peer
//! `floor` is no DNS server: one thread doing only the `recv` + `send` of each query (it flips the
//! response bit and sets the code), so its CPU per answer is what any UDP responder pays here.
//! Peer `mmsg` is the same floor with batches: one blocking `recvmmsg` (up to 32 datagrams, back
//! as soon as one is there) and one `sendmmsg` per batch — the least a batched responder pays. It
//! prints medians and the ratios to dnsmasq, then the targets of issue #38 as `target:` lines
//! ([`targets`]); it asserts nothing.
//!
//! Usage: `dns-bench [--quick] [--rounds N] [--secs N] [--clients N] [--loads allowed,denied]
//!         [--agent PATH (ignored)] [--before PATH]`. `--before` names another build of this
//! benchmark (e.g. from the previous commit): its `serve` runs as one more peer, `before`, so an
//! old and a new responder are measured in the same run.
//! Internal: `dns-bench serve CONFIG OUT` runs the agent's responder for policy `bench` (with the
//! daemon's shape: a metrics registry, one worker thread, the daemon's event sink — identical
//! refusals collapsed — and an `AnswerSink` that counts).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use egress_tests::bench::{
    Peer, Target, cpu_ticks, free_port, median, pin_to_cpu, ratio, report_all, us_per_op, wait_addr,
};
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder};

/// Names per workload (all cached after the warm-up).
const NAMES: usize = 64;

struct Opts {
    quick: bool,
    rounds: usize,
    secs: f64,
    clients: usize,
    /// `--loads allowed,denied` (default both), e.g. to profile one path.
    loads: Vec<String>,
    /// `--before PATH`: another dns-bench build whose responder runs as peer `before`.
    before: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("floor") {
        let Some(out) = args.get(1) else {
            bail!("usage: dns-bench floor OUT")
        };
        return floor(Path::new(out));
    }
    if args.first().map(String::as_str) == Some("mmsg") {
        let Some(out) = args.get(1) else {
            bail!("usage: dns-bench mmsg OUT")
        };
        return floor_mmsg(Path::new(out));
    }
    if args.first().map(String::as_str) == Some("serve") {
        let (Some(cfg), Some(out)) = (args.get(1), args.get(2)) else {
            bail!("usage: dns-bench serve CONFIG OUT")
        };
        return serve(Path::new(cfg), Path::new(out));
    }
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<usize>().ok())
    };
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = Opts {
        quick,
        rounds: flag("--rounds").unwrap_or(if quick { 1 } else { 3 }),
        secs: if quick { 1.0 } else { 3.0 },
        clients: flag("--clients").unwrap_or(32),
        before: args
            .iter()
            .position(|a| a == "--before")
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from),
        loads: args
            .iter()
            .position(|a| a == "--loads")
            .and_then(|i| args.get(i + 1))
            .map_or_else(
                || vec!["allowed".into(), "denied".into()],
                |v| v.split(',').map(str::to_owned).collect(),
            ),
    };
    if let Some(s) = flag("--secs") {
        o.secs = s as f64;
    }
    pin_to_cpu(0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(o))
}

// ---------------------------------------------------------------- the agent's responder (serve)

#[derive(Default)]
struct CountingSink(AtomicU64);

impl egress_agent::proxy::dns::AnswerSink for CountingSink {
    fn answered(&self, _: &egress_agent::proxy::dns::Answer<'_>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn serve(config: &Path, out: &Path) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = Arc::new(egress_agent::config::Config::load(config)?);
        // The daemon's event sink: identical refusals within a second recorded once, then as a
        // count (`egress_agent::agent::Agent::start`).
        let events = egress_agent::events::EventSink::with_collapse(
            egress_agent::events::DEFAULT_RING,
            egress_agent::events::collapse::DEFAULT_WINDOW,
        );
        tokio::spawn(events.collapse_sweeper());
        let ctx = egress_agent::proxy::ProxyContext::new(&config, events)?
            .with_metrics(Arc::new(egress_agent::metrics::Metrics::new()))
            .with_interception(egress_agent::proxy::InterceptHooks {
                admission: Arc::new(egress_agent::proxy::admission::StaticAdmission::any()),
                answers: Arc::new(CountingSink::default()),
            });
        let policy = config
            .policy("bench")
            .ok_or_else(|| anyhow::anyhow!("no policy bench"))?;
        let proxy = egress_agent::proxy::PolicyProxy::bind(
            "127.0.0.1:0".parse()?,
            "bench".into(),
            Arc::new(policy.clone()),
            ctx,
        )
        .await?;
        let dns = proxy
            .intercept_addrs()
            .and_then(|a| a.dns_udp)
            .ok_or_else(|| anyhow::anyhow!("no DNS responder bound"))?;
        let tmp = out.with_extension("tmp");
        std::fs::write(&tmp, format!("dns {dns}\n"))?;
        std::fs::rename(&tmp, out)?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        proxy
            .run(async move {
                term.recv().await;
            })
            .await;
        Ok(())
    })
}

/// The floor: no DNS at all, one blocking thread doing `recv` + `send` per query — the echoed
/// query, marked as a response, NOERROR for `bench` names and NXDOMAIN otherwise (enough for the
/// client's check). What any UDP responder pays per answer on this machine.
fn floor(out: &Path) -> Result<()> {
    let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let tmp = out.with_extension("tmp");
    std::fs::write(&tmp, format!("dns {}\n", s.local_addr()?))?;
    std::fs::rename(&tmp, out)?;
    let mut buf = [0u8; 1500];
    loop {
        let (n, from) = s.recv_from(&mut buf)?;
        if floor_answer(&mut buf[..n]) {
            s.send_to(&buf[..n], from)?;
        }
    }
}

/// Flip a query into the floor's answer in place: response bit, NOERROR for `bench` names,
/// NXDOMAIN otherwise.
fn floor_answer(buf: &mut [u8]) -> bool {
    if buf.len() < 12 {
        return false;
    }
    let bench = buf[12..].windows(5).any(|w| w == b"bench");
    buf[2] |= 0x80;
    buf[3] = (buf[3] & 0xf0) | if bench { 0 } else { 3 };
    true
}

/// The batched floor: `recvmmsg` (blocking until one datagram is there, then taking what else
/// waits, up to 32) and one `sendmmsg` of the answers.
fn floor_mmsg(out: &Path) -> Result<()> {
    use nix::sys::socket::{
        ControlMessage, MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg, sendmmsg,
    };
    use std::io::{IoSlice, IoSliceMut};
    use std::os::fd::AsRawFd;
    const BATCH: usize = 32;
    let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let tmp = out.with_extension("tmp");
    std::fs::write(&tmp, format!("dns {}\n", s.local_addr()?))?;
    std::fs::rename(&tmp, out)?;
    let fd = s.as_raw_fd();
    let mut bufs = vec![[0u8; 1500]; BATCH];
    let mut rx = MultiHeaders::<SockaddrStorage>::preallocate(BATCH, None);
    let mut tx = MultiHeaders::<SockaddrStorage>::preallocate(BATCH, None);
    loop {
        let mut got: Vec<(usize, Option<SockaddrStorage>)> = Vec::with_capacity(BATCH);
        {
            let mut iovs: Vec<[IoSliceMut<'_>; 1]> =
                bufs.iter_mut().map(|b| [IoSliceMut::new(b)]).collect();
            let res = recvmmsg(fd, &mut rx, iovs.iter_mut(), MsgFlags::MSG_WAITFORONE, None)?;
            got.extend(res.map(|m| (m.bytes, m.address)));
        }
        let mut addrs = Vec::with_capacity(got.len());
        let mut lens = Vec::with_capacity(got.len());
        for (i, (n, from)) in got.iter().enumerate() {
            if floor_answer(&mut bufs[i][..*n]) {
                addrs.push(*from);
                lens.push((i, *n));
            }
        }
        let iovs: Vec<[IoSlice<'_>; 1]> = lens
            .iter()
            .map(|(i, n)| [IoSlice::new(&bufs[*i][..*n])])
            .collect();
        let none: [ControlMessage<'_>; 0] = [];
        if !iovs.is_empty() {
            sendmmsg(fd, &mut tx, &iovs, &addrs, none, MsgFlags::empty())?;
        }
    }
}

// ---------------------------------------------------------------- peers

struct Server {
    peer: Peer,
    addr: SocketAddr,
}

fn start_dnsmasq_peer(dir: &Path, upstream: SocketAddr) -> Result<Server> {
    let port = free_port()?;
    let argv = egress_tests::bench::dnsmasq(
        port,
        &[
            format!("--server=/bench.test/{}#{}", upstream.ip(), upstream.port()),
            "--address=/#/".to_owned(),
            "--cache-size=10000".to_owned(),
        ],
    );
    let peer = Peer::spawn("dnsmasq", 1, &argv, &dir.join("dnsmasq.log"))?;
    Ok(Server {
        peer,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    })
}

fn start_floor(dir: &Path, name: &'static str) -> Result<Server> {
    let out = dir.join(format!("{name}.addrs"));
    let log = dir.join(format!("{name}.log"));
    let me = std::env::current_exe()?;
    let argv = vec![
        me.display().to_string(),
        name.to_owned(),
        out.display().to_string(),
    ];
    let mut peer = Peer::spawn(name, 1, &argv, &log)?;
    let addr = wait_addr(&mut peer, &out, "dns", &log)?;
    Ok(Server { peer, addr })
}

fn start_agent(dir: &Path, upstream: SocketAddr, exe: &Path, name: &'static str) -> Result<Server> {
    let cfg = dir.join(format!("{name}.toml"));
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "")?;
    std::fs::write(
        &cfg,
        format!(
            r#"[proxy]
listen = "127.0.0.1"
[dns]
nameservers = ["{upstream}"]
hosts_file = "{hosts}"
[policies.bench]
allow_hosts = ["*.bench.test"]
"#,
            hosts = hosts.display()
        ),
    )?;
    let out = dir.join(format!("{name}.addrs"));
    let log = dir.join(format!("{name}.log"));
    let argv = vec![
        exe.display().to_string(),
        "serve".to_owned(),
        cfg.display().to_string(),
        out.display().to_string(),
    ];
    let mut peer = Peer::spawn(name, 1, &argv, &log)?;
    let addr = wait_addr(&mut peer, &out, "dns", &log)?;
    Ok(Server { peer, addr })
}

// ---------------------------------------------------------------- load

/// One query per name, encoded once (the id is patched per send).
fn queries(suffix: &str) -> Result<Vec<Vec<u8>>> {
    (0..NAMES)
        .map(|i| {
            let mut m = Message::query();
            m.metadata.recursion_desired = true;
            m.add_query(Query::query(
                Name::from_ascii(format!("n{i}.{suffix}."))?,
                RecordType::A,
            ));
            Ok(m.to_vec()?)
        })
        .collect()
}

/// Wait until `server` answers `q` (it may still be starting).
async fn ready(server: SocketAddr, q: &[u8]) -> Result<()> {
    let s = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    s.connect(server).await?;
    let mut buf = [0u8; 1500];
    for _ in 0..100 {
        s.send(q).await?;
        if tokio::time::timeout(Duration::from_millis(100), s.recv(&mut buf))
            .await
            .is_ok()
        {
            return Ok(());
        }
    }
    bail!("{server} never answered")
}

struct Rate {
    per_sec: f64,
    cpu_us: Option<f64>,
    wrong: u64,
}

/// Closed-loop load: `clients` sockets, each one query in flight, for `secs`. An answer counts
/// when its id matches and its code is `want`.
async fn rate(server: &Server, qs: &Arc<Vec<Vec<u8>>>, want: ResponseCode, o: &Opts) -> Rate {
    let ok = Arc::new(AtomicU64::new(0));
    let wrong = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_ticks(server.peer.pid());
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(o.secs);
    let mut tasks = Vec::new();
    for c in 0..o.clients {
        let (ok, wrong, qs, addr) = (ok.clone(), wrong.clone(), qs.clone(), server.addr);
        tasks.push(tokio::spawn(async move {
            let Ok(s) = tokio::net::UdpSocket::bind("127.0.0.1:0").await else {
                return;
            };
            if s.connect(addr).await.is_err() {
                return;
            }
            let mut buf = [0u8; 1500];
            let mut i = c;
            let mut id: u16 = (c as u16).wrapping_mul(997);
            while Instant::now() < deadline {
                let mut q = qs[i % qs.len()].clone();
                id = id.wrapping_add(1);
                q[..2].copy_from_slice(&id.to_be_bytes());
                i += 1;
                if s.send(&q).await.is_err() {
                    wrong.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                match tokio::time::timeout(Duration::from_secs(1), s.recv(&mut buf)).await {
                    Ok(Ok(n)) => {
                        let good = hickory_proto::op::Header::read(&mut BinDecoder::new(&buf[..n]))
                            .is_ok_and(|h| h.metadata.id == id && h.metadata.response_code == want);
                        if good {
                            ok.fetch_add(1, Ordering::Relaxed);
                        } else {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ => {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.ok();
    }
    let n = ok.load(Ordering::Relaxed);
    Rate {
        per_sec: n as f64 / start.elapsed().as_secs_f64(),
        cpu_us: us_per_op(cpu0, cpu_ticks(server.peer.pid()), n),
        wrong: wrong.load(Ordering::Relaxed),
    }
}

// ---------------------------------------------------------------- driver

/// Issue #38's targets for the agent's CPU per answer (the medians' ratios): an allowed (cached)
/// answer at most 0.9× dnsmasq's and 1.15× the `mmsg` floor's (the least a batched responder
/// pays here), a denied one at most 1.15× the floor's.
fn targets(m: &BTreeMap<(&str, &str), f64>) -> Vec<Target> {
    let cpu = |peer: &str, k: &str| m.get(&(peer, k)).copied();
    let (allowed, denied) = ("CPU µs/answer, allowed", "CPU µs/answer, denied");
    vec![
        Target::at_most(
            "DNS CPU µs per allowed (cached) answer, agent/dnsmasq",
            ratio(cpu("agent", allowed), cpu("dnsmasq", allowed)),
            0.9,
            "×",
        ),
        Target::at_most(
            "DNS CPU µs per allowed (cached) answer, agent/mmsg floor",
            ratio(cpu("agent", allowed), cpu("mmsg", allowed)),
            1.15,
            "×",
        ),
        Target::at_most(
            "DNS CPU µs per denied answer, agent/mmsg floor",
            ratio(cpu("agent", denied), cpu("mmsg", denied)),
            1.15,
            "×",
        ),
    ]
}

async fn run(o: Opts) -> Result<()> {
    let dir = PathBuf::from(format!("/dev/shm/dns-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // The authority for bench.test (CPU 0 with this process: it only serves the warm-up).
    let up_port = free_port()?;
    let _upstream = Peer::spawn(
        "upstream",
        0,
        &egress_tests::bench::dnsmasq(
            up_port,
            &[
                "--address=/bench.test/140.82.112.3".to_owned(),
                "--address=/bench.test/2606:50c0:8000::154".to_owned(),
                // Cacheable answers (dnsmasq's local TTL is 0 by default).
                "--local-ttl=300".to_owned(),
                "--cache-size=0".to_owned(),
            ],
        ),
        &dir.join("upstream.log"),
    )?;
    let upstream = SocketAddr::from(([127, 0, 0, 1], up_port));
    let allowed = Arc::new(queries("bench.test")?);
    let denied = Arc::new(queries("denied.test")?);
    ready(upstream, &allowed[0]).await?;
    let me = std::env::current_exe()?;
    let mut servers = vec![start_agent(&dir, upstream, &me, "agent")?];
    if let Some(before) = &o.before {
        servers.push(start_agent(&dir, upstream, before, "before")?);
    }
    servers.push(start_dnsmasq_peer(&dir, upstream)?);
    servers.push(start_floor(&dir, "floor")?);
    servers.push(start_floor(&dir, "mmsg")?);
    for s in &servers {
        ready(s.addr, &allowed[0]).await?;
        // Warm-up: every allowed name once (fills the caches), then a short burst.
        for q in allowed.iter() {
            ready(s.addr, q).await?;
        }
    }
    let mut samples: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    let mut wrong = 0;
    for round in 0..o.rounds {
        for (i, s) in servers.iter().enumerate() {
            // Alternate the order per round.
            let s = if round % 2 == 0 {
                s
            } else {
                &servers[servers.len() - 1 - i]
            };
            for (load, qs, want) in [
                ("allowed", &allowed, ResponseCode::NoError),
                ("denied", &denied, ResponseCode::NXDomain),
            ] {
                if !o.loads.iter().any(|l| l == load) {
                    continue;
                }
                let r = rate(s, qs, want, &o).await;
                wrong += r.wrong;
                let name = s.peer.name;
                samples
                    .entry((
                        name,
                        if load == "allowed" {
                            "answers/s, allowed (cached)"
                        } else {
                            "answers/s, denied (NXDOMAIN)"
                        },
                    ))
                    .or_default()
                    .push(r.per_sec);
                if let Some(c) = r.cpu_us {
                    samples
                        .entry((
                            name,
                            if load == "allowed" {
                                "CPU µs/answer, allowed"
                            } else {
                                "CPU µs/answer, denied"
                            },
                        ))
                        .or_default()
                        .push(c);
                }
            }
        }
    }
    let m: BTreeMap<(&str, &str), f64> = samples
        .into_iter()
        .filter_map(|(k, mut v)| median(&mut v).map(|x| (k, x)))
        .collect();
    println!();
    println!(
        "dns-bench{} (medians of {} round(s), {} clients, {} names per load; peers on CPU 1, clients on CPU 0)",
        if o.quick { " --quick" } else { "" },
        o.rounds,
        o.clients,
        NAMES
    );
    let peers: Vec<&str> = servers.iter().map(|s| s.peer.name).collect();
    let others: Vec<&str> = peers.iter().copied().filter(|p| *p != "dnsmasq").collect();
    let mut head = format!("| {:<30} |", "metric");
    let mut rule = format!("|{:-<32}|", "");
    for p in &peers {
        head.push_str(&format!(" {p:>9} |"));
        rule.push_str(&format!("{:-<11}|", ""));
    }
    for p in &others {
        let h = format!("{p}/dnsmasq");
        head.push_str(&format!(" {h:>15} |"));
        rule.push_str(&format!("{:-<17}|", ""));
    }
    println!("{head}");
    println!("{rule}");
    for k in [
        "answers/s, allowed (cached)",
        "answers/s, denied (NXDOMAIN)",
        "CPU µs/answer, allowed",
        "CPU µs/answer, denied",
    ] {
        let cell = |p: &str| {
            m.get(&(p, k)).map_or("-".to_owned(), |v| {
                if *v >= 100.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.1}")
                }
            })
        };
        let ratio = |a: &str| match (m.get(&(a, k)), m.get(&("dnsmasq", k))) {
            (Some(a), Some(d)) if *d > 0.0 => format!("{:.2}", a / d),
            _ => "-".to_owned(),
        };
        let mut line = format!("| {k:<30} |");
        for p in &peers {
            line.push_str(&format!(" {:>9} |", cell(p)));
        }
        for p in &others {
            line.push_str(&format!(" {:>15} |", ratio(p)));
        }
        println!("{line}");
    }
    if wrong > 0 {
        println!("({wrong} queries timed out or got an unexpected answer)");
    }
    report_all(&targets(&m));
    drop(servers);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
