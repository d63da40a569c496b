//! Kubernetes pod benchmarks (root; ignored by default), beside `docker_bench` in
//! `cargo xtask bench`:
//! `cargo test --release -p egress-tests --test containerd_bench -- --ignored --nocapture`
//!
//! - sandbox created → pod entry written: containerd's `CreatedAt` of the sandbox record to the
//!   agent's "container enforced" log line for it (p50/p99);
//! - the share of app containers that started (CRI `started_at`) before their pod's entry was
//!   written — the window in which a pod is `deny_all` because it is not classified yet;
//! - agent memory (VmRSS) per enforced pod, for N pods (default 100, `EGRESS_BENCH_PODS`).
use std::collections::HashMap;
use std::time::{Duration, Instant};

use egress_tests::bench::{percentile, rss_kib, secs};
use egress_tests::containerd::{Containerd, require_root};
use egress_tests::cri::{ContainerSpec, PodSpec};
use egress_tests::pods::Agent;
use egress_tests::tls_upstream::TestCa;

/// Nanoseconds since the epoch → seconds since midnight UTC (the unit of [`secs`]).
fn secs_of_ns(ns: i64) -> f64 {
    (ns as f64 / 1e9) % 86_400.0
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture (root)"]
fn pod_created_to_enforced_and_memory() {
    if !require_root() {
        return;
    }
    let n: usize = std::env::var("EGRESS_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let mut c = Containerd::start();
    c.kubelet_root = format!("/egress-test-{}/kubepods", std::process::id());
    let mut agent = Agent::new(&c, &TestCa::new().pem);
    agent.start();
    let pid = agent
        .child
        .as_ref()
        .map(std::process::Child::id)
        .expect("agent pid");
    let rss0 = rss_kib(pid);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let t0 = Instant::now();
    let mut pods = Vec::new();
    for i in 0..n {
        let spec = PodSpec::new("bench", &format!("pod-{i}")).annotation("egress.policy", "web");
        let (pod, app) = rt.block_on(async {
            let pod = c.run_pod(&spec).await;
            let app = c
                .create_container_spec(&pod, &ContainerSpec::new("app", &["sleep", "3600"]))
                .await;
            c.start_container(&app).await;
            (pod, app)
        });
        pods.push((pod, app));
    }
    let started = t0.elapsed();
    let deadline = Instant::now() + Duration::from_secs(60);
    while agent.log().matches("container enforced").count() < n {
        assert!(
            Instant::now() < deadline,
            "not every pod was enforced:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let rss = rss_kib(pid);

    // The agent's "container enforced" per sandbox (first one: from its create event).
    let mut entry: HashMap<String, f64> = HashMap::new();
    for line in agent.log().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["message"] != "container enforced" {
            continue;
        }
        if let (Some(t), Some(id)) = (
            v["timestamp"].as_str().and_then(secs),
            v["span"]["container"].as_str(),
        ) {
            entry.entry(id.to_owned()).or_insert(t);
        }
    }
    let mut to_entry = Vec::new();
    let mut app_lead = Vec::new();
    let mut app_before = 0;
    for (pod, app) in &pods {
        let info = c.container_info(&pod.sandbox_id);
        let created = info["CreatedAt"].as_str().and_then(secs);
        let started_at = rt
            .block_on(c.container_status(app))
            .status
            .map(|s| secs_of_ns(s.started_at));
        let (Some(e), Some(cr), Some(st)) = (entry.get(&pod.sandbox_id), created, started_at)
        else {
            panic!(
                "no timings for sandbox {}: entry {:?}, CreatedAt {:?}, app started {:?}; agent log lines \
                 {{\"message\":\"container enforced\",\"span\":{{\"container\":SANDBOX_ID}}}} expected",
                pod.sandbox_id,
                entry.get(&pod.sandbox_id),
                info["CreatedAt"],
                started_at
            );
        };
        to_entry.push((e - cr) * 1000.0);
        if st < *e {
            app_before += 1;
        }
        app_lead.push((st - e) * 1000.0);
    }
    eprintln!(
        "containerd bench: {n} annotated pods (sandbox + one app container) started in {started:?}"
    );
    eprintln!(
        "  sandbox created → pod entry written: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        percentile(&mut to_entry.clone(), 0.5),
        percentile(&mut to_entry.clone(), 0.99),
        percentile(&mut to_entry.clone(), 1.0)
    );
    eprintln!(
        "  app containers started before their pod was classified: {app_before}/{n} (entry's lead over the app's start: p50 {:.1} ms, min {:.1} ms)",
        percentile(&mut app_lead.clone(), 0.5),
        percentile(&mut app_lead.clone(), 0.0)
    );
    eprintln!(
        "  agent VmRSS: {rss0} KiB idle → {rss} KiB with {n} enforced pods ({:.1} KiB each)",
        (rss.saturating_sub(rss0)) as f64 / n as f64
    );
    for (pod, _) in &pods {
        rt.block_on(async {
            c.stop_pod(pod).await;
            c.remove_pod(pod).await;
        });
    }
    agent.kill();
}
