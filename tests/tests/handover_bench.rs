//! Restart benchmark (root; ignored by default, run by `cargo xtask bench`):
//! `cargo test --release -p egress-tests --test handover_bench -- --ignored --nocapture`
//!
//! A labelled container runs `egress-workload` (DNS and a proxied GET every 20 ms, two tunnels)
//! while the agent is restarted `EGRESS_BENCH_RESTARTS` times (default 5) each way, in one run:
//! - hand-over (SIGUSR2): the time from the signal to the new agent serving (its "took over"
//!   log line), and the longest gap between two successes the workload saw;
//! - the peer, a stop and a start (`systemctl restart`): the time from SIGTERM to the new agent
//!   answering its API, and the longest gap.
//!
//! The gap the workload sees is the figure that matters; it is printed side by side with the
//! workload's own interval (20 ms plus one query), so 20–40 ms means "no gap".
use std::path::Path;
use std::time::{Duration, Instant};

use egress_tests::bench::percentile;
use egress_tests::docker::{Env, SERIAL, require_root};
use egress_tests::workload::{self, Echo, Seen, Workload};
use nix::sys::signal::Signal;

const WAIT: Duration = Duration::from_secs(60);

/// One restart's figures: time to serving, the workload's longest DNS and HTTP gaps in the
/// round, what it lost, and whether a tunnel was cut.
struct Round {
    serving: Duration,
    gap_ms: u64,
    lost: u64,
    cut: bool,
}

/// The workload's totals now, with its longest gap reset by starting a fresh container.
fn fresh(env: &Env, round: usize, tag: &str) -> (Workload, Seen) {
    let name = format!("bench-{tag}-{round}");
    let w = Workload::start(env, &name);
    let seen = w
        .wait(env, WAIT, |s| {
            s.dns_ok >= 50 && s.http_ok >= 50 && s.tunnels.iter().all(|t| t.0 >= 1)
        })
        .unwrap_or_else(|s| panic!("workload never got going: {}\n{}", s.line(), env.log()));
    (w, seen)
}

fn finish(env: &Env, w: &Workload, before: &Seen, serving: Duration) -> Round {
    let after = w
        .progressed(env, before, 100, WAIT)
        .unwrap_or_else(|s| panic!("workload stalled: {}\n{}", s.line(), env.log()));
    env.d.docker_ok(&["rm", "-f", &w.name]);
    Round {
        serving,
        gap_ms: after.dns_gap_ms.max(after.http_gap_ms),
        lost: (after.dns_lost - before.dns_lost) + (after.http_failed - before.http_failed),
        cut: after.tunnels.iter().any(|t| t.1),
    }
}

fn report(name: &str, rounds: &[Round]) -> (f64, f64) {
    let mut serving: Vec<f64> = rounds
        .iter()
        .map(|r| r.serving.as_secs_f64() * 1e3)
        .collect();
    let mut gaps: Vec<f64> = rounds.iter().map(|r| r.gap_ms as f64).collect();
    let lost: u64 = rounds.iter().map(|r| r.lost).sum();
    let cut = rounds.iter().filter(|r| r.cut).count();
    let (s50, g50) = (percentile(&mut serving, 0.5), percentile(&mut gaps, 0.5));
    let gmax = gaps.iter().copied().fold(0.0, f64::max);
    println!(
        "{name:<28} serving after {s50:>7.0} ms (median)   longest workload gap {g50:>6.0} ms median, {gmax:>6.0} ms max   lost {lost:>4}   rounds with a tunnel cut {cut}/{}",
        rounds.len()
    );
    (s50, g50)
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture (root)"]
fn handover_vs_stop_and_start() {
    if !require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let n: usize = std::env::var("EGRESS_BENCH_RESTARTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let mut env = Env::new(&[Path::new(env!("CARGO_BIN_EXE_egress-workload"))]);
    env.write_config(&env.config_text(&workload::policies()));
    assert!(env.cli(&["reload"]).status.success());
    let _echo = Echo::start(&env);

    let mut handed = Vec::new();
    for round in 0..n {
        let (w, before) = fresh(&env, round, "handover");
        let took = workload::took_over(&env);
        let pid = env.serving_pid().expect("pid");
        let t0 = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
            Signal::SIGUSR2,
        )
        .expect("SIGUSR2");
        assert!(workload::wait_took_over(&env, took), "{}", env.log());
        let serving = t0.elapsed();
        handed.push(finish(&env, &w, &before, serving));
    }
    // Back to an agent the test started, for the stop-and-start rounds.
    if let Some(pid) = env.serving_pid() {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
            Signal::SIGTERM,
        )
        .ok();
    }
    let deadline = Instant::now() + WAIT;
    while env.serving_pid().is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    env.agent.take();
    env.start_agent();

    let mut restarted = Vec::new();
    for round in 0..n {
        let (w, before) = fresh(&env, round, "restart");
        let t0 = Instant::now();
        env.signal_agent(Signal::SIGTERM);
        if let Some(mut c) = env.agent.take() {
            c.wait().ok();
        }
        env.start_agent();
        let serving = t0.elapsed();
        restarted.push(finish(&env, &w, &before, serving));
    }
    println!("\nrestart under load ({n} rounds each; workload interval 20 ms):");
    let (hs, hg) = report("hand-over (SIGUSR2)", &handed);
    let (rs, rg) = report("stop and start (peer)", &restarted);
    println!(
        "ratio hand-over / stop-and-start: serving {:.2}, longest gap {:.2}",
        hs / rs,
        hg / rg
    );
}
