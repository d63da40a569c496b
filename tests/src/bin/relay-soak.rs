//! `relay-soak`: many tunnels through the kernel relay for a fixed time, every byte checked
//! (issue #34). 200 concurrent workers each run content-checked tunnels of random sizes (1 byte
//! to 8 MiB each way, a quarter with a slow reader) through an in-process proxy with
//! `proxy.kernel_relay = "on"` and the default hand-over (16 reads), until the time is up.
//! Prints bytes relayed, mismatches (must be 0: any is a failure of the run, exit 1) and what
//! the relay did with the tunnels (spliced, handed back to user space, kept in user space,
//! reset). Root only. Part of `cargo xtask bench`.
//!
//! Usage: `relay-soak [--quick] [--secs N] [--tunnels N] [--seed N]`
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use egress_tests::relay_check::{Plan, Proxy, Rng, run_tunnel, start_upstream};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let quick = args.iter().any(|a| a == "--quick");
    let secs = flag("--secs").unwrap_or(if quick { 10 } else { 60 });
    let workers = flag("--tunnels").unwrap_or(200);
    let seed = flag("--seed").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    if !egress_tests::is_root() {
        bail!("relay-soak loads the kernel relay (eBPF): run as root");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let dir = std::env::temp_dir().join(format!("relay-soak-{}", std::process::id()));
    let r = rt.block_on(soak(&dir, secs, workers, seed));
    std::fs::remove_dir_all(&dir).ok();
    r
}

async fn soak(dir: &std::path::Path, secs: u64, workers: u64, seed: u64) -> Result<()> {
    let (up, mut verdicts) = start_upstream().await?;
    let proxy = Proxy::start(dir, up.port(), 16, None)?;
    eprintln!(
        "relay-soak: {workers} concurrent tunnels for {secs} s through the kernel relay (seed {seed}; --seed {seed} replays the plans)"
    );
    let deadline = Instant::now() + Duration::from_secs(secs);
    let bytes = Arc::new(AtomicU64::new(0));
    let tunnels = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    // Upstream verdicts, collected as they come.
    let upstream_failures = Arc::new(AtomicU64::new(0));
    let uf = upstream_failures.clone();
    let fl = failures.clone();
    let collector = tokio::spawn(async move {
        while let Some((seed, r)) = verdicts.recv().await {
            if let Err(e) = r {
                uf.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut f) = fl.lock() {
                    f.push(format!("upstream, tunnel seed {seed}: {e}"));
                }
            }
        }
    });
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (bytes, tunnels, failures) = (bytes.clone(), tunnels.clone(), failures.clone());
        let addr = proxy.addr;
        let port = up.port();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed ^ w.wrapping_mul(0x9E37_79B9));
            while Instant::now() < deadline {
                let plan = Plan {
                    seed: rng.next_u64(),
                    up: rng.size(8 << 20),
                    down: rng.size(8 << 20),
                    slow: rng.range(0, 3) == 0,
                    max_write: rng.range(1, 256 << 10) as usize,
                    hold_open: rng.range(0, 1) == 0,
                };
                match tokio::time::timeout(Duration::from_secs(120), run_tunnel(addr, port, plan))
                    .await
                {
                    Ok(Ok(())) => {
                        bytes.fetch_add(plan.up + plan.down, Ordering::Relaxed);
                        tunnels.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(e)) => {
                        if let Ok(mut f) = failures.lock() {
                            f.push(format!("{plan:?}: {e:#}"));
                        }
                    }
                    Err(_) => {
                        if let Ok(mut f) = failures.lock() {
                            f.push(format!("{plan:?}: no end within 120 s"));
                        }
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.ok();
    }
    // The upstream's last verdicts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    collector.abort();
    let st = proxy.relay.stats();
    let failures = failures.lock().map(|f| f.clone()).unwrap_or_default();
    println!("| relay soak ({secs} s, {workers} tunnels at once) | value |");
    println!("|---|---|");
    println!(
        "| tunnels completed | {} |",
        tunnels.load(Ordering::Relaxed)
    );
    println!(
        "| bytes relayed and checked | {} ({:.0} MB/s) |",
        bytes.load(Ordering::Relaxed),
        bytes.load(Ordering::Relaxed) as f64 / secs as f64 / 1e6
    );
    println!(
        "| mismatches and failed tunnels (must be 0) | {} |",
        failures.len()
    );
    println!("| spliced in the kernel | {} |", st.spliced);
    println!(
        "| handed back to user space (a peer fell behind) | {} |",
        st.demoted
    );
    println!(
        "| kept in user space (the kernel refused) | {} |",
        st.fallbacks
    );
    println!("| reset to stay exact (must be 0) | {} |", st.aborted);
    println!(
        "| most bytes a peer was behind at a hand-back | {} |",
        st.max_behind
    );
    println!(
        "| bytes the program redirected / dropped / parked | {} / {} / {} |",
        st.program.redirected_bytes, st.program.dropped_bytes, st.program.passed_bytes
    );
    if !failures.is_empty() || st.aborted > 0 {
        for f in failures.iter().take(20) {
            eprintln!("  {f}");
        }
        bail!(
            "relay soak: {} failed tunnels, {} reset (seed {seed})",
            failures.len(),
            st.aborted
        );
    }
    Ok(())
}
