//! `replay-bench`: how fast `egress-agent replay` replays a large event store (issue #35's
//! target: 1,000,000 stored events in at most 2 s). Prints a table; never asserts on times.
//!
//! Two stores of 1,000,000 events each, recorded under policy `ci` and written as the agent's
//! store writer writes them (`Store::write`: one row per denial, the flows aggregated with their
//! counts), in a temporary directory on this machine's disk:
//! 1. **20 000 flows** (about 50 events each): what a busy host keeps — 50 containers, 200 runs,
//!    a hundred names through the proxy (allowed, denied, DNS), IP literals, an address refused
//!    at dial time, direct and refused kernel connections, refusals no policy decides;
//! 2. **every event its own flow** (1,000,000 flows of one event, every destination distinct):
//!    the worst case — a million destinations to decide, group and sort.
//!
//! Each is replayed by the real command, `egress-agent replay --policy P --config C --json`
//! (reading the store read-only, deciding every flow under a proposed policy that drops a
//! wildcard, grouping, and the JSON report), `--runs` times (3; 1 with `--quick`): wall time
//! (median), events/s, the ratio to the 2 s target (≤ 1 meets it), the command's CPU time
//! (user + system, median: what other work on the machine disturbs least) and its peak RSS
//! (VmHWM, polled). The report's event count is checked against the store's. Each store's
//! median wall time (scaled to 1,000,000 events with `--quick`) is then reported against the
//! target as a `target:` line (`egress_tests::bench::Target`).
//!
//! Usage: `replay-bench [--quick] [--runs N] [--agent PATH]` (default: `egress-agent` next to
//! this binary). `--quick` replays 200,000 events per store. `replay-bench build DIR
//! flows|distinct` only builds one store (with its `config.toml` and `proposed.toml`) in DIR and
//! keeps it, for profiling the command on it.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use egress_agent::events::{ContainerRef, DenialEvent, Source, Verdict};
use egress_agent::store::{FlowBatch, FlowKey, FlowStats, Store, micros};
use egress_tests::bench::{Target, median, report_all};

/// The target: this many events replayed in [`TARGET`].
const TARGET_EVENTS: u64 = 1_000_000;
const TARGET: Duration = Duration::from_secs(2);

const RECORDED: &str = r#"[policies.ci]
allow_hosts = ["github.com", "*.github.com", "*.githubusercontent.com", "pypi.org",
               "files.pythonhosted.org", "registry.npmjs.org", "*.example.com"]
allow_cidrs = [{ cidr = "10.0.0.0/8", ports = [5432] }]
"#;

/// The proposal: `*.githubusercontent.com` and `*.example.com` go.
const PROPOSED: &str = r#"[policies.ci]
allow_hosts = ["github.com", "*.github.com", "pypi.org", "files.pythonhosted.org",
               "registry.npmjs.org"]
allow_cidrs = [{ cidr = "10.0.0.0/8", ports = [5432] }]
"#;

struct Opts {
    quick: bool,
    runs: usize,
    agent: PathBuf,
}

fn opts() -> Result<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut o = Opts {
        quick: false,
        runs: 0,
        agent: std::env::current_exe()?.with_file_name("egress-agent"),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--runs" => o.runs = it.next().context("--runs N")?.parse()?,
            "--agent" => o.agent = PathBuf::from(it.next().context("--agent PATH")?),
            other => bail!("unknown argument {other:?} (--quick, --runs N, --agent PATH)"),
        }
    }
    if o.runs == 0 {
        o.runs = if o.quick { 1 } else { 3 };
    }
    if !o.agent.exists() {
        bail!(
            "{}: no egress-agent binary (build it, or pass --agent PATH)",
            o.agent.display()
        );
    }
    Ok(o)
}

/// One recorded flow of the mix: flow `i` of `n`, its destination distinct from every other's
/// when `distinct`.
fn flow_event(i: u64, distinct: bool) -> DenialEvent {
    // What varies with every flow: in the realistic store the workload (container, run) of a
    // hundred destinations; in the distinct one the destination itself.
    let k = if distinct { i } else { i % 100 };
    let kind = i % 20;
    let (host, ip, port, protocol, reason, verdict, source) = match kind {
        0..=3 => (
            Some(format!("h{k}.example.com")),
            None,
            443,
            "connect",
            "allowed",
            Verdict::Allow,
            Source::Proxy,
        ),
        4..=6 => (
            Some(format!("r{k}.githubusercontent.com")),
            None,
            443,
            "tls",
            "allowed",
            Verdict::Allow,
            Source::Proxy,
        ),
        7..=9 => (
            Some(format!("api{k}.github.com")),
            None,
            443,
            "connect",
            "allowed",
            Verdict::Allow,
            Source::Proxy,
        ),
        10 | 11 => (
            Some("pypi.org".to_owned()),
            None,
            443 + (k % 1000) as u16,
            "connect",
            "allowed",
            Verdict::Allow,
            Source::Proxy,
        ),
        12 => (
            Some(format!("x{k}.evil.test")),
            None,
            443,
            "connect",
            "host-not-allowed",
            Verdict::Deny,
            Source::Proxy,
        ),
        13 => (
            Some(format!("x{k}.evil.test")),
            None,
            53,
            "dns",
            "host-not-allowed",
            Verdict::Deny,
            Source::Proxy,
        ),
        14 => (
            None,
            Some(ip4(8, k)),
            443,
            "connect",
            "ip-literal-not-allowed",
            Verdict::Deny,
            Source::Proxy,
        ),
        15 => (
            Some(format!("int{k}.github.com")),
            Some(ip4(192, k)),
            443,
            "connect",
            "address-denied",
            Verdict::Deny,
            Source::Proxy,
        ),
        16 | 17 => (
            None,
            Some(ip4(10, k)),
            5432,
            "tcp",
            "allowed",
            Verdict::Allow,
            Source::Kernel,
        ),
        18 => (
            None,
            Some(ip4(1, k)),
            8443,
            "tcp",
            "kernel-destination-not-allowed",
            Verdict::Deny,
            Source::Kernel,
        ),
        _ => (
            None,
            Some(ip4(2, k)),
            443,
            "tls",
            "tls-no-sni",
            Verdict::Deny,
            Source::Proxy,
        ),
    };
    let mut e = DenialEvent::proxy(
        "ci",
        host,
        ip.map(|s| s.parse().expect("address")),
        port,
        protocol,
        reason,
    )
    .with_verdict(verdict);
    e.source = source;
    let job = (i / 100) % 50;
    e.container = Some(ContainerRef {
        id: format!("c0ffee{job:04}"),
        name: format!("job-{job}"),
    });
    // Every flow of the distinct store is also its own run (so no two are one flow).
    let run = if distinct { i } else { 1000 + (i / 100) % 200 };
    e.context.insert("run".into(), run.to_string());
    e
}

/// `a.b.c.d` from `first` and a number (distinct up to 2^24); `192` gives 192.168/16 addresses
/// (the built-in deny list's), distinct up to 2^16.
fn ip4(first: u8, k: u64) -> String {
    match first {
        192 => format!("192.168.{}.{}", (k >> 8) & 255, k & 255),
        _ => format!("{first}.{}.{}.{}", (k >> 16) & 255, (k >> 8) & 255, k & 255),
    }
}

/// Write a store of `events` events in `flows` flows (counts spread ~1..99, summing exactly).
fn build(db: &Path, flows: u64, events: u64, distinct: bool) -> Result<u64> {
    let mut store = Store::open(db)?;
    let now = SystemTime::now();
    let mut batch = FlowBatch::new();
    let mut rows = Vec::new();
    let mut left = events;
    let mut written = 0;
    for i in 0..flows {
        let remaining = flows - i;
        let count = if remaining == 1 {
            left
        } else if distinct {
            1
        } else {
            (1 + (i * 7919) % 99).min(left - (remaining - 1))
        };
        left -= count;
        let mut e = flow_event(i, distinct);
        e.time = now - Duration::from_secs(600) + Duration::from_millis(i % 600_000);
        let t = micros(e.time);
        if e.verdict != Verdict::Allow {
            // One row per refused event, as the writer stores them.
            rows.extend(std::iter::repeat_n(e.clone(), count as usize));
        }
        batch.insert(
            FlowKey::of(&e),
            FlowStats {
                count,
                first_us: t - 1,
                last_us: t,
                rule: String::new(),
            },
        );
        if batch.len() >= 50_000 {
            store.write(&rows, &batch)?;
            written += batch.len() as u64;
            batch.clear();
            rows.clear();
        }
    }
    store.write(&rows, &batch)?;
    written += batch.len() as u64;
    Ok(written)
}

/// `VmHWM` of `pid` in KiB.
fn hwm(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The CPU time of this process's waited-for children (`cutime` + `cstime`), in clock ticks.
fn children_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
}

/// One `egress-agent replay --json`: its wall time, CPU time, peak RSS (KiB) and the report's
/// events.
fn replay_once(agent: &Path, dir: &Path) -> Result<(Duration, Duration, u64, u64)> {
    let out = dir.join("report.json");
    let ticks = children_ticks().unwrap_or(0);
    let t0 = Instant::now();
    let mut child = Command::new(agent)
        .args(["replay", "--json", "--policy"])
        .arg(dir.join("proposed.toml"))
        .arg("--config")
        .arg(dir.join("config.toml"))
        .stdout(std::fs::File::create(&out)?)
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut peak = 0;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        peak = peak.max(hwm(child.id()).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(5));
    };
    let wall = t0.elapsed();
    // Clock ticks are 10 ms.
    let cpu = Duration::from_millis(children_ticks().unwrap_or(0).saturating_sub(ticks) * 10);
    if !status.success() {
        bail!("egress-agent replay: {status}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    Ok((wall, cpu, peak, v["events"].as_u64().unwrap_or(0)))
}

/// A case's directory: its configuration, the proposed policy, and the store built.
fn prepare(case: &Path, flows: u64, events: u64, distinct: bool) -> Result<(u64, Duration)> {
    let state = case.join("state");
    std::fs::create_dir_all(case)?;
    std::fs::write(
        case.join("config.toml"),
        format!("[agent]\nstate_dir = \"{}\"\n{RECORDED}", state.display()),
    )?;
    std::fs::write(case.join("proposed.toml"), PROPOSED)?;
    let t0 = Instant::now();
    let written = build(&state.join("events.db"), flows, events, distinct)?;
    Ok((written, t0.elapsed()))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("build") {
        let (Some(dir), Some(kind)) = (args.get(1), args.get(2)) else {
            bail!("replay-bench build DIR flows|distinct");
        };
        let distinct = kind == "distinct";
        let flows = if distinct { TARGET_EVENTS } else { 20_000 };
        let (written, took) = prepare(Path::new(dir), flows, TARGET_EVENTS, distinct)?;
        println!("{written} flows of {TARGET_EVENTS} events in {dir} ({took:?})");
        return Ok(());
    }
    let o = opts()?;
    let events = if o.quick { 200_000 } else { TARGET_EVENTS };
    let dir = std::env::temp_dir().join(format!("replay-bench-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir)?;
    println!(
        "replay-bench{}: {events} events per store; `egress-agent replay --json` (store read + decide + report), median of {} run(s)",
        if o.quick { " (quick)" } else { "" },
        o.runs
    );
    println!(
        "{:<36} {:>9} {:>9} {:>9} {:>10} {:>11} {:>9} {:>7} {:>8}",
        "store", "flows", "events", "build s", "replay s", "events/s", "vs 2 s", "CPU s", "RSS MiB"
    );
    let mut targets = Vec::new();
    for (label, flows, distinct) in [
        (
            "20 000 flows (~50 events each)",
            20_000 * events / TARGET_EVENTS,
            false,
        ),
        ("every event its own flow", events, true),
    ] {
        let case = dir.join(if distinct { "distinct" } else { "flows" });
        let (written, built) = prepare(&case, flows, events, distinct)?;
        let (mut walls, mut cpus, mut peak) = (Vec::new(), Vec::new(), 0);
        for _ in 0..o.runs {
            let (wall, cpu, rss, seen) = replay_once(&o.agent, &case)?;
            if seen != events {
                bail!("{label}: the report counts {seen} events, the store holds {events}");
            }
            walls.push(wall.as_secs_f64());
            cpus.push(cpu.as_secs_f64());
            peak = peak.max(rss);
        }
        let wall_m = median(&mut walls);
        let wall = wall_m.unwrap_or(0.0);
        let cpu = median(&mut cpus).unwrap_or(0.0);
        // Scaled to the target's size when --quick replays fewer events.
        let scale = TARGET_EVENTS as f64 / events as f64;
        let at_target = wall * scale;
        targets.push(Target::at_most(
            format!("replay of 1M stored events, {label}: wall time"),
            wall_m.map(|w| w * scale),
            TARGET.as_secs_f64(),
            "s",
        ));
        println!(
            "{:<36} {:>9} {:>9} {:>9.1} {:>10.3} {:>11.0} {:>9.2} {:>7.2} {:>8.1}",
            label,
            written,
            events,
            built.as_secs_f64(),
            wall,
            events as f64 / wall.max(1e-9),
            at_target / TARGET.as_secs_f64(),
            cpu,
            peak as f64 / 1024.0
        );
        std::fs::remove_dir_all(&case).ok();
    }
    println!(
        "(target: {TARGET_EVENTS} events replayed in <= {} s; `vs 2 s` is the time for {TARGET_EVENTS} events over 2 s: <= 1 meets it)",
        TARGET.as_secs()
    );
    report_all(&targets);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
