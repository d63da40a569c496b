//! Docker benchmarks (root; ignored by default):
//! `cargo test --release -p egress-tests --test docker_bench -- --ignored --nocapture`
//!
//! - start → enforced: for each `docker run`, the agent's own timestamps (JSON log): the kernel
//!   entry written from `create` (before `start` reached runc: lead time reported), and Docker's
//!   `start` event → host layer (nftables) in place.
//! - agent memory (VmRSS) with N enforced containers (default 200, `EGRESS_BENCH_CONTAINERS`).
use std::collections::HashMap;
use std::time::{Duration, Instant};

use egress_tests::bench::{percentile, rss_kib, secs};
use egress_tests::docker::{Env, SERIAL, require_root};

fn env_new() -> Env {
    Env::new(&[])
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture (root)"]
fn start_to_enforced_and_memory() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let env = env_new();
    let n: usize = std::env::var("EGRESS_BENCH_CONTAINERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let pid = env.agent.as_ref().map(|c| c.id()).expect("agent pid");
    let rss0 = rss_kib(pid);
    let t0 = Instant::now();
    let mut ids = Vec::new();
    for i in 0..n {
        let name = format!("bench-{i}");
        ids.push(env.start_ok(&name, &["--label", "egress.policy=web"], &["sleep", "3600"]));
    }
    let started = t0.elapsed();
    let last = format!("\"name\":\"bench-{}\"", n - 1);
    assert!(
        env.wait_log(
            |l| l
                .lines()
                .any(|x| x.contains("host layer enforced") && x.contains(&last)),
            Duration::from_secs(120)
        ),
        "last container never enforced"
    );
    std::thread::sleep(Duration::from_secs(1));
    let rss = rss_kib(pid);

    // Per container: first "container enforced" (from create), "docker event start", "host layer enforced".
    let mut entry: HashMap<String, f64> = HashMap::new();
    let mut start: HashMap<String, f64> = HashMap::new();
    let mut host: HashMap<String, f64> = HashMap::new();
    for line in env.log().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(t) = v["timestamp"].as_str().and_then(secs) else {
            continue;
        };
        // The daemon logs flattened JSON lines (fields at the top level).
        let f = if v["fields"].is_object() {
            &v["fields"]
        } else {
            &v
        };
        // The container is a field of the line ("docker event", "host layer enforced") or of
        // the per-container span the line was logged in ("container enforced").
        let Some(c) = f["container"]
            .as_str()
            .or_else(|| v["span"]["container"].as_str())
        else {
            continue;
        };
        match f["message"].as_str() {
            Some("container enforced") => {
                entry.entry(c.to_owned()).or_insert(t);
            }
            Some("docker event") if f["action"] == "start" => {
                start.entry(c.to_owned()).or_insert(t);
            }
            Some("host layer enforced") => {
                host.entry(c.to_owned()).or_insert(t);
            }
            _ => {}
        }
    }
    let mut lead = Vec::new();
    let mut to_host = Vec::new();
    let mut before_start = 0;
    for id in &ids {
        let (Some(e), Some(s), Some(h)) = (entry.get(id), start.get(id), host.get(id)) else {
            continue;
        };
        if e < s {
            before_start += 1;
        }
        lead.push((s - e) * 1000.0);
        to_host.push((h - s) * 1000.0);
    }
    if to_host.is_empty() {
        let sample = |m: &str| {
            env.log()
                .lines()
                .find(|l| l.contains(m))
                .map_or_else(|| format!("no line with {m:?}"), str::to_owned)
        };
        panic!(
            "no timings parsed: expected, per started container, JSON log lines \
             {{\"message\":\"container enforced\",\"span\":{{\"container\":ID}}}}, \
             {{\"message\":\"docker event\",\"action\":\"start\",\"container\":ID}} and \
             {{\"message\":\"host layer enforced\",\"container\":ID}}; \
             parsed {} / {} / {} of {} containers. Lines seen:\n{}\n{}\n{}",
            entry.len(),
            start.len(),
            host.len(),
            ids.len(),
            sample("container enforced"),
            sample("docker event"),
            sample("host layer enforced"),
        );
    }
    eprintln!("docker bench: {n} labelled containers started in {started:?}");
    eprintln!(
        "  kernel entry written before Docker's start event: {before_start}/{} (lead over `start`: p50 {:.1} ms, min {:.1} ms)",
        lead.len(),
        percentile(&mut lead.clone(), 0.5),
        percentile(&mut lead.clone(), 0.0)
    );
    eprintln!(
        "  `start` event → nftables host layer: p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms",
        percentile(&mut to_host.clone(), 0.5),
        percentile(&mut to_host.clone(), 0.9),
        percentile(&mut to_host.clone(), 1.0)
    );
    eprintln!(
        "  agent VmRSS: {rss0} KiB idle → {rss} KiB with {n} enforced containers ({:.1} KiB each)",
        (rss.saturating_sub(rss0)) as f64 / n as f64
    );
    assert_eq!(
        before_start,
        lead.len(),
        "some containers had no entry before start"
    );
}
