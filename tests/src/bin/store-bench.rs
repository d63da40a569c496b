//! `store-bench`: the event store's ingest rate, and the agent's proxy under a flood of refused
//! connections. Prints a table with ratios; never asserts on times.
//!
//! 1. **Ingest** (in this process): events emitted into an `EventSink` as fast as the store's
//!    queue takes them, written by the real writer task into SQLite (WAL, `synchronous = FULL`) on
//!    this machine's disk: events/s committed and CPU µs per event (emit + writer, this process's
//!    user + system time), for denials (one row and one flow each: every event its own
//!    destination, or all to one destination as in a flood), allowed traffic (flows only, 1 000
//!    names) and a would-deny/allow mix.
//! 2. **Flood**: the agent's proxy as the daemon runs it — `proxy::serve`, the store writer on the
//!    same `EventSink`, metrics, JSON log lines through a non-blocking writer (to /dev/null) — in a
//!    child process pinned to CPU 1. 32 clients on CPU 0 (a one-worker runtime built after this
//!    process pinned itself there, so the clients never run on the agent's CPU) open allowed
//!    CONNECT tunnels (CONNECT, one byte echoed, close) for a phase, while a confined loop (a
//!    child process in a cgroup limited to 25 % of one CPU, also on CPU 0) runs: in the flood
//!    phase it opens refused CONNECTs (`host-not-allowed`, all identical: the agent records the
//!    first, then counts the others and records one summary per second, see
//!    `egress_agent::events::collapse`) as fast as it can; in the control phase it only burns
//!    the same CPU, so both phases take the same CPU from the clients and the difference is the
//!    agent's. Phases alternate. Reported: allowed tunnels/s without and with the flood and
//!    their ratio, refused/s, the agent's CPU µs per allowed tunnel, its RSS (peak per phase and
//!    at the end), and what the store committed and dropped. The ratio is reported against the
//!    target of issue #38 item 5 ([`TARGET`]) as a `target:` line (`egress_tests::bench::Target`).
//!
//! Usage: `store-bench [--quick] [--flood-only] [--no-collapse] [--agent PATH (ignored)]`:
//! `--quick` fewer events and shorter phases, `--flood-only` skips the ingest table,
//! `--no-collapse` runs the agent with every refusal recorded as it comes (as before identical
//! refusals were collapsed: the comparison). Internal: `store-bench serve CONFIG OUT
//! [--no-collapse]`, `store-bench flood ADDR SECS`.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use egress_agent::events::{DenialEvent, EventSink, Verdict};
use egress_tests::bench::Target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const ALLOWED: &str = "bench.test";
const REFUSED: &str = "denied.test";
const CLIENTS: usize = 32;
const FLOODERS: usize = 16;
const FLOOD_CPU_PCT: usize = 25;
/// Allowed tunnels/s during the flood over without it, at least (issue #38 item 5).
const TARGET: f64 = 0.95;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") => {
            let collapse = !args.iter().any(|a| a == "--no-collapse");
            return serve(Path::new(&args[1]), Path::new(&args[2]), collapse);
        }
        Some("flood") => return flood(args[1].parse()?, args[2].parse()?),
        Some("burn") => {
            // The control: the same confined loop, spending its CPU without connecting.
            let end = Instant::now() + Duration::from_secs_f64(args[1].parse()?);
            let mut x = 0u64;
            while Instant::now() < end {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            println!("0");
            return Ok(());
        }
        _ => {}
    }
    let quick = args.iter().any(|a| a == "--quick");
    let flood_only = args.iter().any(|a| a == "--flood-only");
    let collapse = !args.iter().any(|a| a == "--no-collapse");
    if !nix::unistd::geteuid().is_root() {
        bail!("store-bench pins CPUs and creates a cgroup: run as root");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("store-bench{}", if quick { " (quick)" } else { "" });
    if !flood_only {
        rt.block_on(ingest(quick))?;
    }
    drop(rt);
    // The clients' runtime is built once this thread is pinned, so its worker inherits CPU 0
    // (a runtime built before the pin would run the clients on either CPU, the agent's too).
    pin_to_cpu(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(flood_bench(quick, collapse))
}

// ---------------------------------------------------------------- 1. ingest

/// This process's user + system CPU time (clock ticks of 10 ms, from /proc).
fn cpu_self() -> Duration {
    Duration::from_millis(cpu_ticks(std::process::id()).unwrap_or(0) * 10)
}

/// `spread`: distinct destinations (0: every event its own).
fn sample_event(i: u64, verdict: Verdict, spread: u64) -> DenialEvent {
    let host = match spread {
        0 => format!("h{i}.example.com"),
        n => format!("h{}.example.com", i % n),
    };
    let mut ev = DenialEvent::proxy("ci", Some(host), None, 443, "connect", "host-not-allowed")
        .with_verdict(verdict);
    if verdict == Verdict::Allow {
        ev.reason = egress_agent::events::ALLOWED_REASON.to_owned();
    }
    ev.container = Some(egress_agent::events::ContainerRef {
        id: "c0ffee00c0ffee00".into(),
        name: "job".into(),
    });
    ev.context.insert("run".into(), "1842".into());
    ev
}

async fn ingest(quick: bool) -> Result<()> {
    let n: u64 = if quick { 50_000 } else { 300_000 };
    println!("\n== ingest: {n} events per mix, real writer, SQLite WAL synchronous=FULL");
    println!(
        "{:<26} {:>12} {:>14} {:>10} {:>12}",
        "mix", "events/s", "CPU µs/event", "dropped", "db MiB"
    );
    for (label, mix, spread) in [
        ("denials, all distinct", 0u64, 0u64),
        ("denials, 1 destination", 0, 1),
        ("allowed, 1 000 names", 1, 1000),
        ("50/50 would-deny/allow", 2, 1000),
    ] {
        let dir =
            std::env::temp_dir().join(format!("store-bench-{}-{mix}-{spread}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let queue = 65_536;
        let sink = EventSink::new(1024);
        let store = egress_agent::store::Store::open(&dir.join("events.db"))?;
        let h = egress_agent::store::writer::spawn(
            store,
            &sink,
            queue,
            true,
            egress_agent::store::writer::Bounds {
                max_age: Duration::from_secs(3600),
                max_bytes: 1 << 34,
            },
            None,
        );
        let stats = h.stats().clone();
        let cpu0 = cpu_self();
        let t0 = Instant::now();
        let mut i = 0u64;
        while i < n {
            // Keep the queue from overflowing: this measures what the writer sustains.
            let done =
                stats.committed.load(Ordering::Relaxed) + stats.dropped.load(Ordering::Relaxed);
            if i - done > queue as u64 / 2 {
                tokio::time::sleep(Duration::from_micros(200)).await;
                continue;
            }
            for _ in 0..1024.min(n - i) {
                let v = match mix {
                    0 => Verdict::Deny,
                    1 => Verdict::Allow,
                    _ if i.is_multiple_of(2) => Verdict::WouldDeny,
                    _ => Verdict::Allow,
                };
                sink.emit(sample_event(i, v, spread));
                i += 1;
            }
            tokio::task::yield_now().await;
        }
        h.flush().await;
        let wall = t0.elapsed();
        let cpu = cpu_self() - cpu0;
        let committed = stats.committed.load(Ordering::Relaxed);
        let dropped = stats.dropped.load(Ordering::Relaxed);
        let size = std::fs::metadata(dir.join("events.db")).map_or(0, |m| m.len())
            + std::fs::metadata(dir.join("events.db-wal")).map_or(0, |m| m.len());
        h.shutdown().await;
        println!(
            "{:<26} {:>12.0} {:>14.2} {:>10} {:>12.1}",
            label,
            committed as f64 / wall.as_secs_f64(),
            cpu.as_secs_f64() * 1e6 / n as f64,
            dropped,
            size as f64 / (1 << 20) as f64
        );
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok(())
}

// ---------------------------------------------------------------- 2. flood

fn pin_to_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok()
        && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_err()
    {
        eprintln!("warning: could not pin to CPU {cpu}; figures will be noisier");
    }
}

/// The agent's proxy + store + metrics, as the daemon wires them (one worker: pinned to one CPU);
/// `collapse`: identical refusals collapsed as the agent does (`Agent::start`).
fn serve(config: &Path, out: &Path, collapse: bool) -> Result<()> {
    pin_to_cpu(1);
    // The daemon's log pipeline: every denial is a JSON line, written off the hot path.
    let (writer, _guard) = tracing_appender::non_blocking(std::io::stdout());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_writer(writer)
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .try_init()
        .ok();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = Arc::new(egress_agent::config::Config::load(config)?);
        let events = if collapse {
            EventSink::with_collapse(
                egress_agent::events::DEFAULT_RING,
                egress_agent::events::collapse::DEFAULT_WINDOW,
            )
        } else {
            EventSink::default()
        };
        tokio::spawn(events.collapse_sweeper());
        let metrics = Arc::new(egress_agent::metrics::Metrics::new());
        tokio::spawn(egress_agent::metrics::denial_counter(
            &events,
            metrics.clone(),
        ));
        let store = egress_agent::store::start(&config, &events, Some(metrics.clone()))?
            .context("store disabled")?;
        let ctx = egress_agent::proxy::ProxyContext::new(&config, events.clone())?
            .admit_any_peer()
            .with_metrics(metrics);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = egress_agent::proxy::serve(config, ctx, async move {
            stop_rx.await.ok();
        })
        .await?;
        let addr = server.addrs().get("bench").context("no bench listener")?;
        let tmp = out.with_extension("tmp");
        std::fs::write(&tmp, addr.to_string())?;
        std::fs::rename(&tmp, out)?;
        term.recv().await;
        stop_tx.send(()).ok();
        server.join().await;
        // As the agent's stop: the pending counts, then the store's last write.
        events.flush_collapsed();
        let stats = store.stats().clone();
        store.shutdown().await;
        std::fs::write(
            out.with_extension("stats"),
            format!(
                "{} {} {}",
                stats.committed.load(Ordering::Relaxed),
                stats.dropped.load(Ordering::Relaxed),
                stats.write_errors.load(Ordering::Relaxed)
            ),
        )?;
        Ok(())
    })
}

/// The confined loop: refused CONNECTs as fast as it can for `secs`; prints how many.
fn flood(addr: SocketAddr, secs: f64) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let n = rt.block_on(async move {
        let count = Arc::new(AtomicU64::new(0));
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut tasks = Vec::new();
        for _ in 0..FLOODERS {
            let count = count.clone();
            tasks.push(tokio::spawn(async move {
                let req = format!("CONNECT {REFUSED}:443 HTTP/1.1\r\n\r\n");
                let mut b = [0u8; 512];
                while Instant::now() < end {
                    let Ok(mut s) = TcpStream::connect(addr).await else {
                        continue;
                    };
                    if s.write_all(req.as_bytes()).await.is_err() {
                        continue;
                    }
                    // The 403 and the close.
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 {
                            break;
                        }
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for t in tasks {
            t.await.ok();
        }
        count.load(Ordering::Relaxed)
    });
    println!("{n}");
    Ok(())
}

/// A cgroup with `pct` % of one CPU (v1 `cpu` controller, else cgroup2 `cpu.max`).
struct CpuCgroup(PathBuf);

impl CpuCgroup {
    fn create(pct: usize) -> Result<CpuCgroup> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
        let (mut v1, mut v2) = (None, None);
        for line in mountinfo.lines() {
            let Some((pre, post)) = line.split_once(" - ") else {
                continue;
            };
            let mnt = pre.split_whitespace().nth(4).unwrap_or_default();
            let mut post = post.split_whitespace();
            let fstype = post.next().unwrap_or_default();
            let opts = post.nth(1).unwrap_or_default();
            if fstype == "cgroup" && opts.split(',').any(|o| o == "cpu") {
                v1 = Some(PathBuf::from(mnt));
            } else if fstype == "cgroup2" {
                v2 = Some(PathBuf::from(mnt));
            }
        }
        let (period, name) = (10_000, format!("store-bench-{}", std::process::id()));
        let quota = pct * period / 100;
        let dir = if let Some(root) = v1 {
            let dir = root.join(name);
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(dir.join("cpu.cfs_period_us"), period.to_string())?;
            std::fs::write(dir.join("cpu.cfs_quota_us"), quota.to_string())?;
            dir
        } else if let Some(root) = v2 {
            std::fs::write(root.join("cgroup.subtree_control"), "+cpu").ok();
            let dir = root.join(name);
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(dir.join("cpu.max"), format!("{quota} {period}"))?;
            dir
        } else {
            bail!("no cgroup hierarchy with the cpu controller is mounted");
        };
        Ok(CpuCgroup(dir))
    }

    fn add(&self, pid: u32) -> Result<()> {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving {pid} into {}", self.0.display()))
    }
}

impl Drop for CpuCgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.0).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn proc_field(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

async fn echo_upstream() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut b = [0u8; 64];
                while let Ok(n) = s.read(&mut b).await {
                    if n == 0 || s.write_all(&b[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// Allowed tunnels (CONNECT, 1 byte echoed, close) from [`CLIENTS`] clients for `dur`.
async fn tunnels(proxy: SocketAddr, echo_port: u16, dur: Duration) -> u64 {
    let count = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + dur;
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let count = count.clone();
        tasks.push(tokio::spawn(async move {
            let req = format!("CONNECT {ALLOWED}:{echo_port} HTTP/1.1\r\n\r\n");
            let mut b = [0u8; 256];
            while Instant::now() < end {
                let Ok(mut s) = TcpStream::connect(proxy).await else {
                    continue;
                };
                s.set_nodelay(true).ok();
                if s.write_all(req.as_bytes()).await.is_err() {
                    continue;
                }
                let Ok(n) = s.read(&mut b).await else {
                    continue;
                };
                if !b[..n].starts_with(b"HTTP/1.1 200") {
                    continue;
                }
                if s.write_all(b"x").await.is_err() || s.read(&mut b).await.unwrap_or(0) != 1 {
                    continue;
                }
                count.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.ok();
    }
    count.load(Ordering::Relaxed)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

async fn flood_bench(quick: bool, collapse: bool) -> Result<()> {
    let (rounds, secs) = if quick { (2, 2.0) } else { (4, 5.0) };
    let dir = std::env::temp_dir().join(format!("store-bench-flood-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir)?;
    let echo = echo_upstream().await?;
    std::fs::write(
        dir.join("hosts"),
        format!("127.0.0.1 {ALLOWED}\n127.0.0.1 {REFUSED}\n"),
    )?;
    std::fs::write(
        dir.join("config.toml"),
        format!(
            r#"[agent]
state_dir = "{state}"
[proxy]
endpoint = "127.0.0.1:3128"
[dns]
nameservers = []
hosts_file = "{hosts}"
[policies.bench]
allow_hosts = ["{ALLOWED}"]
allow_ports = [{port}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{port}] }}]
"#,
            state = dir.join("state").display(),
            hosts = dir.join("hosts").display(),
            port = echo.port()
        ),
    )?;
    let me = std::env::current_exe()?;
    let out = dir.join("addr");
    let mut agent_cmd = Command::new(&me);
    agent_cmd
        .arg("serve")
        .arg(dir.join("config.toml"))
        .arg(&out);
    if !collapse {
        agent_cmd.arg("--no-collapse");
    }
    let mut agent: Child = agent_cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !out.exists() {
        if Instant::now() > deadline {
            agent.kill().ok();
            bail!("the agent's proxy did not start");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let proxy: SocketAddr = std::fs::read_to_string(&out)?.trim().parse()?;
    let pid = agent.id();
    let cg = CpuCgroup::create(FLOOD_CPU_PCT)?;
    // Warm up.
    tunnels(proxy, echo.port(), Duration::from_millis(500)).await;
    let rss_start = proc_field(pid, "VmRSS:").unwrap_or(0);
    let (mut calm, mut flooded, mut refused_rates) = (Vec::new(), Vec::new(), Vec::new());
    let (mut calm_cpu, mut flood_cpu) = (Vec::new(), Vec::new());
    let (mut calm_rss, mut flood_rss) = (0u64, 0u64);
    for round in 0..rounds * 2 {
        let with_flood = (round % 2 == 1) ^ (round / 2 % 2 == 1);
        // Both phases run the confined loop on CPU 0 (it takes the same CPU from the clients):
        // flooding the proxy, or only burning its CPU share.
        let mut loop_cmd = Command::new(&me);
        if with_flood {
            loop_cmd.arg("flood").arg(proxy.to_string());
        } else {
            loop_cmd.arg("burn");
        }
        let confined = loop_cmd
            .arg(secs.to_string())
            .stdout(Stdio::piped())
            .spawn()?;
        pin_child(confined.id(), 0);
        cg.add(confined.id())?;
        let ticks0 = cpu_ticks(pid).unwrap_or(0);
        let sampler = {
            let stop = Arc::new(AtomicU64::new(0));
            let peak = Arc::new(AtomicU64::new(0));
            let (s, p) = (stop.clone(), peak.clone());
            let t = tokio::spawn(async move {
                while s.load(Ordering::Relaxed) == 0 {
                    p.fetch_max(proc_field(pid, "VmRSS:").unwrap_or(0), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
            (stop, peak, t)
        };
        let n = tunnels(proxy, echo.port(), Duration::from_secs_f64(secs)).await;
        let ticks = cpu_ticks(pid).unwrap_or(0) - ticks0;
        sampler.0.store(1, Ordering::Relaxed);
        sampler.2.await.ok();
        let peak = sampler.1.load(Ordering::Relaxed);
        let rate = n as f64 / secs;
        let cpu_us = ticks as f64 * 1e6 / 100.0 / n.max(1) as f64;
        let o = confined.wait_with_output()?;
        if with_flood {
            let refused: f64 = String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse()
                .unwrap_or(0.0);
            refused_rates.push(refused / secs);
            flooded.push(rate);
            flood_cpu.push(cpu_us);
            flood_rss = flood_rss.max(peak);
        } else {
            calm.push(rate);
            calm_cpu.push(cpu_us);
            calm_rss = calm_rss.max(peak);
        }
    }
    let rss_end = proc_field(pid, "VmRSS:").unwrap_or(0);
    let hwm = proc_field(pid, "VmHWM:").unwrap_or(0);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    agent.wait()?;
    let stats = std::fs::read_to_string(out.with_extension("stats")).unwrap_or_default();
    let s: Vec<&str> = stats.split_whitespace().collect();
    let (calm_m, flood_m) = (median(calm), median(flooded));
    let (calm_cpu, flood_cpu, refused_rate) =
        (median(calm_cpu), median(flood_cpu), median(refused_rates));
    println!(
        "\n== flood: agent proxy + store on CPU 1; {CLIENTS} allowed clients on CPU 0; \
         the flood: {FLOODERS} refused-CONNECT loops in a cgroup at {FLOOD_CPU_PCT}% of a CPU; \
         {rounds} rounds × {secs} s per phase, medians; identical refusals {}",
        if collapse {
            "collapsed (the agent's)"
        } else {
            "each recorded (--no-collapse)"
        }
    );
    println!(
        "{:<44} {:>14} {:>14} {:>8}",
        "", "loop burns", "loop floods", "ratio"
    );
    println!(
        "{:<44} {:>14.0} {:>14.0} {:>8.3}",
        "allowed tunnels/s",
        calm_m,
        flood_m,
        flood_m / calm_m.max(1.0)
    );
    println!(
        "{:<44} {:>14} {:>14.0}",
        "refused CONNECTs/s (identical refusals)", "-", refused_rate
    );
    println!(
        "{:<44} {:>14.1} {:>14.1}",
        "agent CPU µs per allowed tunnel", calm_cpu, flood_cpu
    );
    println!(
        "{:<44} {:>14} {:>14}",
        "agent peak RSS KiB in the phase", calm_rss, flood_rss
    );
    // What one refusal costs the agent: the CPU the flood phase spent beyond its tunnels.
    let per_refusal = (flood_cpu - calm_cpu) * flood_m / refused_rate.max(1.0);
    println!(
        "{:<44} {:>14} {:>14.1}",
        "agent CPU µs per refused CONNECT (estimate)", "-", per_refusal
    );
    println!(
        "agent RSS KiB: start {rss_start}, end {rss_end}, high-water {hwm}; store: committed {}, dropped {}, write errors {}",
        s.first().unwrap_or(&"?"),
        s.get(1).unwrap_or(&"?"),
        s.get(2).unwrap_or(&"?")
    );
    println!("RSS growth {} KiB", rss_end.saturating_sub(rss_start));
    // Medians of no phase (no tunnel at all) are 0: no figure, rather than a ratio of nothing.
    Target::at_least(
        "allowed tunnels/s during a denial flood / without",
        (calm_m > 0.0).then(|| flood_m / calm_m),
        TARGET,
        "×",
    )
    .report();
    drop(cg);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

fn pin_child(pid: u32, cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(pid as i32), &set).ok();
    }
}
