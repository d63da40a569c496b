//! Issue #34: every byte the kernel relay carries arrives exactly once, in order — checked by
//! content, not length ([`egress_tests::stream`]: each end checks every byte it reads against
//! what the other sent at that offset, and that EOF comes right after the last one).
//!
//! Tunnels through an in-process proxy with `proxy.kernel_relay = "on"`, spliced at each stage
//! of the hand-off (`kernel_relay_after_reads` 0: before the first byte; 1 and 4: during the
//! first bytes; 16, the default: mid-stream, with the upstream writing), with random sizes from 1
//! byte to 512 MiB each way, half-closes from either side first, slow readers (the hand-back to
//! user space), many tunnels at once. Root (the relay loads eBPF); skips loudly otherwise. A
//! failing run prints its seed: `EGRESS_RELAY_SEED=<seed>` replays it.
#![expect(clippy::unwrap_used, reason = "test")]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use egress_tests::relay_check::{Plan, Proxy, Rng, run_tunnel, start_upstream};

const T: Duration = Duration::from_secs(120);

fn plans(rng: &mut Rng, after_reads: u64) -> Vec<Plan> {
    let mut seed = || rng.next_u64();
    let mut v = vec![
        // The smallest streams, and one direction empty (the client's half-close comes right
        // after its head; the upstream's at once).
        Plan {
            seed: seed(),
            up: 1,
            down: 1,
            slow: false,
            max_write: 1,
        },
        Plan {
            seed: seed(),
            up: 0,
            down: 3 << 20,
            slow: false,
            max_write: 64 << 10,
        },
        Plan {
            seed: seed(),
            up: 5 << 20,
            down: 0,
            slow: false,
            max_write: 64 << 10,
        },
        // A slow reader: its peer falls behind, the tunnel is handed back to user space.
        Plan {
            seed: seed(),
            up: 1 << 10,
            down: 48 << 20,
            slow: true,
            max_write: 256 << 10,
        },
        // A big upload while a small answer comes back first (the upstream half-closes first).
        Plan {
            seed: seed(),
            up: 96 << 20,
            down: 7,
            slow: false,
            max_write: 256 << 10,
        },
    ];
    if after_reads == 16 {
        // The largest: 512 MiB down through one tunnel, spliced mid-stream.
        v.push(Plan {
            seed: seed(),
            up: 1,
            down: 512 << 20,
            slow: false,
            max_write: 256 << 10,
        });
    }
    for _ in 0..32 {
        let (up, down) = (rng.size(48 << 20), rng.size(48 << 20));
        let slow = rng.range(0, 3) == 0;
        let max_write = rng.range(1, 256 << 10) as usize;
        v.push(Plan {
            seed: rng.next_u64(),
            up,
            down,
            slow,
            max_write,
        });
    }
    v
}

#[test]
fn every_relayed_byte_arrives_exactly_once_in_order_at_every_hand_off_stage() {
    if !egress_tests::root_or_skip("the kernel relay loads eBPF (sockhash, sk_skb)") {
        return;
    }
    let seed = std::env::var("EGRESS_RELAY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("relay integrity: seed {seed} (EGRESS_RELAY_SEED={seed} replays this run)");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("egress-relay-integrity-{}", std::process::id()));
    let mut rng = Rng::new(seed);
    let (mut spliced, mut demoted, mut bytes) = (0, 0, 0u64);
    rt.block_on(async {
        let (up, mut verdicts) = start_upstream().await.unwrap();
        for after_reads in [0, 1, 4, 16] {
            let proxy = Proxy::start(&dir, up.port(), after_reads).unwrap();
            let plans = plans(&mut rng, after_reads);
            let started = Instant::now();
            let mut tasks = Vec::new();
            for plan in plans.iter().copied() {
                let addr = proxy.addr;
                tasks.push(tokio::spawn(async move {
                    (
                        plan,
                        tokio::time::timeout(T, run_tunnel(addr, up.port(), plan)).await,
                    )
                }));
            }
            let mut failures = Vec::new();
            for t in tasks {
                let (plan, r) = t.await.unwrap();
                match r {
                    Ok(Ok(())) => bytes += plan.up + plan.down,
                    Ok(Err(e)) => failures.push(format!("{plan:?}: {e:#}")),
                    Err(_) => failures.push(format!("{plan:?}: no end within {T:?}")),
                }
            }
            // The upstream's own verdict on every tunnel (what it received, and that its EOF came
            // right after the client's last byte).
            let mut pending: HashMap<u64, Plan> = plans.iter().map(|p| (p.seed, *p)).collect();
            while !pending.is_empty() {
                match tokio::time::timeout(T, verdicts.recv()).await {
                    Ok(Some((seed, r))) => {
                        if let Some(plan) = pending.remove(&seed)
                            && let Err(e) = r
                        {
                            failures.push(format!("{plan:?} (upstream): {e}"));
                        }
                    }
                    _ => {
                        failures.push(format!("no upstream verdict for {} tunnels", pending.len()));
                        break;
                    }
                }
            }
            // Every tunnel's map entries go with it.
            let deadline = Instant::now() + Duration::from_secs(10);
            let st = loop {
                let st = proxy.relay.stats();
                if (st.active == 0 && st.entries.is_empty()) || Instant::now() > deadline {
                    break st;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            eprintln!(
                "after_reads {after_reads}: {} tunnels in {:.1} s; {st:?}",
                plans.len(),
                started.elapsed().as_secs_f64()
            );
            assert!(
                failures.is_empty(),
                "seed {seed}, after_reads {after_reads}: {} of {} tunnels failed:\n{}",
                failures.len(),
                plans.len(),
                failures.join("\n")
            );
            assert_eq!((st.active, st.aborted), (0, 0), "{st:?}");
            assert!(st.entries.is_empty(), "{st:?}");
            // Nothing dropped by the program, nothing parked in a socket's own queue.
            assert_eq!(
                (st.program.dropped_bytes, st.program.passed_bytes),
                (0, 0),
                "{st:?}"
            );
            spliced += st.spliced;
            demoted += st.demoted;
        }
    });
    std::fs::remove_dir_all(&dir).ok();
    eprintln!(
        "relay integrity: {bytes} bytes checked; {spliced} tunnels spliced, {demoted} handed back"
    );
    // The paths under test were taken: tunnels spliced, and slow readers' tunnels handed back.
    assert!(
        spliced > 0 && demoted > 0,
        "spliced {spliced}, handed back {demoted}"
    );
}
