//! `transparent-bench`: transparent tunnels against explicit CONNECT tunnels of the same agent.
//!
//! One agent process (pinned to CPU 1) serves policy `bench` on an explicit listener and a
//! transparent one; the original destination comes from the test double
//! (`StaticAdmission::fixed`) until the kernel map exists. Clients in this process (CPU 0)
//! open tunnels to an echo upstream in this process: explicit = connect, `CONNECT`, 200, then a
//! real TLS ClientHello (rustls, SNI `bench.test`) echoed back, close; transparent = connect, the
//! same ClientHello (the proxy reads its SNI, dials, replays it) echoed back, close. It prints
//! tunnels/s and the agent's CPU µs per tunnel with 1 and 64 clients, medians over rounds, and
//! the ratio transparent/explicit, then the target (≤ 1.1× CPU per tunnel, [`TARGET`]) for each
//! client count as a `target:` line (`egress_tests::bench::Target`); it asserts nothing.
//!
//! Usage: `transparent-bench [--quick] [--rounds N] [--agent PATH (ignored)]`.
//! Internal: `transparent-bench serve CONFIG OUT ORIGINAL`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use egress_tests::bench::{
    Peer, Target, cpu_ticks, median, pin_to_cpu, ratio, report_all, us_per_op, wait_addr,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NAME: &str = "bench.test";
/// A transparent tunnel's proxy CPU over an explicit one's, at most.
const TARGET: f64 = 1.1;

struct Opts {
    quick: bool,
    rounds: usize,
    secs: f64,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        let (Some(cfg), Some(out), Some(orig)) = (args.get(1), args.get(2), args.get(3)) else {
            bail!("usage: transparent-bench serve CONFIG OUT ORIGINAL")
        };
        return serve(Path::new(cfg), Path::new(out), orig.parse()?);
    }
    let quick = args.iter().any(|a| a == "--quick");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let o = Opts {
        quick,
        rounds: rounds.unwrap_or(if quick { 1 } else { 3 }),
        secs: if quick { 1.0 } else { 3.0 },
    };
    pin_to_cpu(0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(o))
}

/// The agent: the daemon's runtime shape (one worker), metrics attached, interception on.
fn serve(config: &Path, out: &Path, orig: SocketAddr) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = Arc::new(egress_agent::config::Config::load(config)?);
        let events = egress_agent::events::EventSink::default();
        let ctx = egress_agent::proxy::ProxyContext::new(&config, events)?
            .with_metrics(Arc::new(egress_agent::metrics::Metrics::new()))
            .with_interception(egress_agent::proxy::InterceptHooks {
                admission: Arc::new(egress_agent::proxy::admission::StaticAdmission::fixed(orig)),
                answers: Arc::new(egress_agent::proxy::dns::NoAnswerSink),
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
        let transparent = proxy
            .intercept_addrs()
            .and_then(|a| a.transparent)
            .ok_or_else(|| anyhow::anyhow!("no transparent listener bound"))?;
        let tmp = out.with_extension("tmp");
        std::fs::write(
            &tmp,
            format!(
                "explicit {}\ntransparent {transparent}\n",
                proxy.local_addr()
            ),
        )?;
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

/// A TLS 1.3 ClientHello for `NAME`, as rustls sends it.
fn client_hello() -> Result<Vec<u8>> {
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(NAME.to_owned())?;
    let mut conn = rustls::ClientConnection::new(Arc::new(cfg), name)?;
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out)?;
    }
    Ok(out)
}

async fn echo_server() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                s.set_nodelay(true).ok();
                let (mut r, mut w) = s.split();
                tokio::io::copy(&mut r, &mut w).await.ok();
            });
        }
    });
    Ok(addr)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Explicit,
    Transparent,
}

/// One tunnel: open, the hello there and back, close.
async fn tunnel(
    mode: Mode,
    proxy: SocketAddr,
    echo_port: u16,
    hello: &[u8],
) -> std::io::Result<()> {
    let mut s = TcpStream::connect(proxy).await?;
    s.set_nodelay(true)?;
    if mode == Mode::Explicit {
        let head =
            format!("CONNECT {NAME}:{echo_port} HTTP/1.1\r\nHost: {NAME}:{echo_port}\r\n\r\n");
        s.write_all(head.as_bytes()).await?;
        let mut buf = [0u8; 256];
        let mut n = 0;
        while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            let r = s.read(&mut buf[n..]).await?;
            if r == 0 || n + r == buf.len() {
                return Err(std::io::Error::other("no CONNECT answer"));
            }
            n += r;
        }
        if !buf.starts_with(b"HTTP/1.1 200") {
            return Err(std::io::Error::other("CONNECT refused"));
        }
    }
    s.write_all(hello).await?;
    let mut back = vec![0u8; hello.len()];
    s.read_exact(&mut back).await?;
    if back != hello {
        return Err(std::io::Error::other("echo differs"));
    }
    Ok(())
}

struct Rate {
    per_sec: f64,
    cpu_us: Option<f64>,
    errors: u64,
}

async fn rate(
    mode: Mode,
    proxy: SocketAddr,
    pid: u32,
    echo_port: u16,
    hello: &Arc<Vec<u8>>,
    clients: usize,
    secs: f64,
) -> Rate {
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_ticks(pid);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (ok, errors, hello) = (ok.clone(), errors.clone(), hello.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                match tunnel(mode, proxy, echo_port, &hello).await {
                    Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    for t in tasks {
        t.await.ok();
    }
    let n = ok.load(Ordering::Relaxed);
    Rate {
        per_sec: n as f64 / start.elapsed().as_secs_f64(),
        cpu_us: us_per_op(cpu0, cpu_ticks(pid), n),
        errors: errors.load(Ordering::Relaxed),
    }
}

async fn run(o: Opts) -> Result<()> {
    let dir = PathBuf::from(format!("/dev/shm/transparent-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let echo = echo_server().await?;
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, format!("127.0.0.1 {NAME}\n"))?;
    let cfg = dir.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[proxy]
listen = "127.0.0.1"
max_connections = 19000
max_connections_per_listener = 19000
[dns]
nameservers = []
hosts_file = "{hosts}"
[policies.bench]
allow_hosts = ["{NAME}"]
allow_ports = [{p}]
resolve_private = ["127.0.0.1/32"]
"#,
            hosts = hosts.display(),
            p = echo.port()
        ),
    )?;
    // What a redirected client "connected to": never dialed (the name's address is).
    let orig = SocketAddr::from(([127, 0, 0, 2], echo.port()));
    let out = dir.join("agent.addrs");
    let log = dir.join("agent.log");
    let argv = vec![
        std::env::current_exe()?.display().to_string(),
        "serve".to_owned(),
        cfg.display().to_string(),
        out.display().to_string(),
        orig.to_string(),
    ];
    let mut agent = Peer::spawn("agent", 1, &argv, &log)?;
    let explicit = wait_addr(&mut agent, &out, "explicit", &log)?;
    let transparent = wait_addr(&mut agent, &out, "transparent", &log)?;
    let hello = Arc::new(client_hello()?);
    for (mode, addr) in [(Mode::Explicit, explicit), (Mode::Transparent, transparent)] {
        if let Err(e) = tunnel(mode, addr, echo.port(), &hello).await {
            bail!("a first tunnel failed: {e}; see {}", log.display());
        }
    }
    let mut samples: BTreeMap<(&str, String), Vec<f64>> = BTreeMap::new();
    let mut errors = 0;
    for round in 0..o.rounds {
        let mut modes = [
            ("explicit", Mode::Explicit, explicit),
            ("transparent", Mode::Transparent, transparent),
        ];
        if round % 2 == 1 {
            modes.reverse();
        }
        for clients in [1, 64] {
            for (name, mode, addr) in modes {
                let r = rate(
                    mode,
                    addr,
                    agent.pid(),
                    echo.port(),
                    &hello,
                    clients,
                    o.secs,
                )
                .await;
                errors += r.errors;
                samples
                    .entry((name, format!("tunnels/s, {clients} client(s)")))
                    .or_default()
                    .push(r.per_sec);
                if let Some(c) = r.cpu_us {
                    samples
                        .entry((name, format!("proxy CPU µs/tunnel, {clients} client(s)")))
                        .or_default()
                        .push(c);
                }
            }
        }
    }
    let m: BTreeMap<(&str, String), f64> = samples
        .into_iter()
        .filter_map(|(k, mut v)| median(&mut v).map(|x| (k, x)))
        .collect();
    println!();
    println!(
        "transparent-bench{} (medians of {} round(s); a {}-byte ClientHello echoed per tunnel; agent on CPU 1, clients and upstream on CPU 0)",
        if o.quick { " --quick" } else { "" },
        o.rounds,
        hello.len()
    );
    println!(
        "| {:<34} | {:>9} | {:>11} | {:>20} |",
        "metric", "explicit", "transparent", "transparent/explicit"
    );
    println!("|{:-<36}|{:-<11}|{:-<13}|{:-<22}|", "", "", "", "");
    for clients in [1, 64] {
        for k in [
            format!("tunnels/s, {clients} client(s)"),
            format!("proxy CPU µs/tunnel, {clients} client(s)"),
        ] {
            let cell = |p: &str| {
                m.get(&(p, k.clone())).map_or("-".to_owned(), |v| {
                    if *v >= 100.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.1}")
                    }
                })
            };
            let ratio = match (
                m.get(&("transparent", k.clone())),
                m.get(&("explicit", k.clone())),
            ) {
                (Some(t), Some(e)) if *e > 0.0 => format!("{:.2}", t / e),
                _ => "-".to_owned(),
            };
            println!(
                "| {:<34} | {:>9} | {:>11} | {:>20} |",
                k,
                cell("explicit"),
                cell("transparent"),
                ratio
            );
        }
    }
    if errors > 0 {
        println!("({errors} tunnels failed)");
    }
    let targets: Vec<Target> = [1, 64]
        .into_iter()
        .map(|clients| {
            let k = format!("proxy CPU µs/tunnel, {clients} client(s)");
            let cpu = |p: &str| m.get(&(p, k.clone())).copied();
            Target::at_most(
                format!("proxy CPU µs per tunnel, {clients} client(s), transparent/explicit"),
                ratio(cpu("transparent"), cpu("explicit")),
                TARGET,
                "×",
            )
        })
        .collect();
    report_all(&targets);
    drop(agent);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
