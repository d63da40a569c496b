//! A confined workload that measures what it sees while the agent restarts: the
//! `egress-workload` binary (src/bin/egress-workload.rs) in a labelled container of an [`Env`],
//! the echo servers its tunnels reach, and the listener that catches its DNS queries if one ever
//! gets past the kernel's redirect ([`DnsLeak`]).
//!
//! The policy [`POLICY`] (written by [`policies`]) allows `allowed.test:8080` (the upstream
//! httpd) and `tls.test` (the dockerd namespace's side of the test network, 198.18.0.1) on the
//! echo ports [`ECHO_PORTS`].
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::docker::{Env, GATEWAY, UPSTREAM_IP};

/// The workload's policy name.
pub const POLICY: &str = "loop";
/// Echo ports on [`GATEWAY`] (`tls.test`): one for a busy tunnel (spliced into the kernel relay
/// after `proxy.kernel_relay_after_reads`), one for a quiet one (stays in user space).
pub const ECHO_PORTS: [u16; 2] = [9300, 9301];

/// The policies of an environment that runs workloads (the default `web` and `canary` too).
pub fn policies() -> String {
    format!(
        r#"{}[policies.{POLICY}]
allow_hosts = ["allowed.test", "tls.test"]
allow_ports = [8080, {}, {}]
allow_cidrs = ["{UPSTREAM_IP}/32", "{GATEWAY}/32"]
"#,
        crate::docker::default_policies(),
        ECHO_PORTS[0],
        ECHO_PORTS[1]
    )
}

/// Wait until an agent logged that it took over for the `after + 1`-th time (`after`: how
/// often the log said so before).
pub fn wait_took_over(env: &Env, after: usize) -> bool {
    env.wait_log(
        |l| l.matches("took over from the running agent").count() > after,
        Duration::from_secs(60),
    )
}

/// How often the agents of `env` logged that they took over.
pub fn took_over(env: &Env) -> usize {
    env.log()
        .matches("took over from the running agent")
        .count()
}

/// Echo servers in the dockerd namespace, counting the connections each accepted.
pub struct Echo {
    pub accepted: Vec<Arc<AtomicUsize>>,
}

impl Echo {
    pub fn start(env: &Env) -> Echo {
        let listeners: Vec<TcpListener> = env.d.netns.run(|| {
            ECHO_PORTS
                .iter()
                .map(|p| TcpListener::bind((GATEWAY, *p)).expect("echo listener"))
                .collect()
        });
        let accepted = listeners
            .into_iter()
            .map(|l| {
                let n = Arc::new(AtomicUsize::new(0));
                let count = n.clone();
                std::thread::spawn(move || {
                    for s in l.incoming().flatten() {
                        count.fetch_add(1, Ordering::SeqCst);
                        std::thread::spawn(move || {
                            let Ok(w) = s.try_clone() else { return };
                            let mut w = w;
                            for line in BufReader::new(s).lines() {
                                let Ok(line) = line else { return };
                                if writeln!(w, "{line}").is_err() {
                                    return;
                                }
                            }
                        });
                    }
                });
                n
            })
            .collect();
        Echo { accepted }
    }

    pub fn connections(&self) -> Vec<usize> {
        self.accepted
            .iter()
            .map(|n| n.load(Ordering::SeqCst))
            .collect()
    }
}

/// What the workload has seen so far (its last state line).
#[derive(Debug, Clone, Default)]
pub struct Seen {
    pub dns_ok: u64,
    pub dns_lost: u64,
    pub http_ok: u64,
    pub http_failed: u64,
    pub dns_gap_ms: u64,
    pub http_gap_ms: u64,
    pub slowest_failure_ms: u64,
    /// (pings echoed, cut, why) per tunnel.
    pub tunnels: Vec<(u64, bool, String)>,
}

impl Seen {
    /// One of `egress-workload`'s state lines.
    pub fn parse(line: &str) -> Option<Seen> {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let n = |k: &str| v[k].as_u64().unwrap_or(0);
        Some(Seen {
            dns_ok: n("dns_ok"),
            dns_lost: n("dns_lost"),
            http_ok: n("http_ok"),
            http_failed: n("http_failed"),
            dns_gap_ms: n("dns_gap_ms"),
            http_gap_ms: n("http_gap_ms"),
            slowest_failure_ms: n("slowest_failure_ms"),
            tunnels: v["tunnels"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|t| {
                            (
                                t["pings"].as_u64().unwrap_or(0),
                                t["cut"].as_bool().unwrap_or(false),
                                t["why"].as_str().unwrap_or_default().to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    /// A one-line summary for logs and benchmarks.
    pub fn line(&self) -> String {
        let tunnels: Vec<String> = self
            .tunnels
            .iter()
            .map(|(p, cut, why)| {
                if *cut {
                    format!("cut after {p} pings ({why})")
                } else {
                    format!("{p} pings")
                }
            })
            .collect();
        format!(
            "dns {} ok / {} lost (longest gap {} ms), http {} ok / {} failed (longest gap {} ms), slowest failure {} ms, tunnels: {}",
            self.dns_ok,
            self.dns_lost,
            self.dns_gap_ms,
            self.http_ok,
            self.http_failed,
            self.http_gap_ms,
            self.slowest_failure_ms,
            tunnels.join(", ")
        )
    }
}

/// UDP and TCP listeners on port 53 of [`GATEWAY`], where workloads send their queries: the
/// kernel redirects every query of a confined container to the agent's responder, whatever its
/// address, so anything that arrives here got past the redirect (a program that stopped
/// enforcing while an agent was away). Nothing is answered.
pub struct DnsLeak {
    arrived: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl DnsLeak {
    pub fn start(env: &Env) -> DnsLeak {
        let (udp, tcp) = env.d.netns.run(|| {
            (
                UdpSocket::bind((GATEWAY, 53)).expect("DNS leak listener (udp)"),
                TcpListener::bind((GATEWAY, 53)).expect("DNS leak listener (tcp)"),
            )
        });
        udp.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        tcp.set_nonblocking(true).expect("nonblocking");
        let arrived = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (n, done) = (arrived.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !done.load(Ordering::SeqCst) {
                if udp.recv_from(&mut buf).is_ok() {
                    n.fetch_add(1, Ordering::SeqCst);
                }
                while tcp.accept().is_ok() {
                    n.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        DnsLeak { arrived, stop }
    }

    /// Queries (UDP datagrams and TCP connections) that arrived so far.
    pub fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }
}

impl Drop for DnsLeak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The workload's command without tunnels: DNS to [`GATEWAY`] (see [`DnsLeak`]) and HTTP.
pub const COMMAND: [&str; 3] = ["egress-workload", "--dns-server", GATEWAY];

/// One running workload container (of the [`Env`] every method is given).
pub struct Workload {
    pub name: String,
}

impl Workload {
    /// Start container `name` under [`POLICY`]: DNS (to [`GATEWAY`], see [`DnsLeak`]) and HTTP
    /// every 20 ms, a tunnel to each echo port (pings every 100 ms on the first, every 4 s on
    /// the second).
    pub fn start(env: &Env, name: &str) -> Workload {
        let t0 = format!("tls.test:{}/100", ECHO_PORTS[0]);
        let t1 = format!("tls.test:{}/4000", ECHO_PORTS[1]);
        env.start_ok(
            name,
            &["--label", &format!("egress.policy={POLICY}")],
            &[&COMMAND[..], &["--tunnel", &t0, "--tunnel", &t1]].concat(),
        );
        Workload {
            name: name.to_owned(),
        }
    }

    /// The last state line, if any yet.
    pub fn seen(&self, env: &Env) -> Option<Seen> {
        let o = env.d.docker(&["logs", "--tail", "1", &self.name]);
        let text = String::from_utf8_lossy(&o.stdout);
        Seen::parse(text.lines().last()?)
    }

    /// Wait (up to `timeout`) until `f` holds for what the workload has seen; the last state.
    pub fn wait(
        &self,
        env: &Env,
        timeout: Duration,
        f: impl Fn(&Seen) -> bool,
    ) -> Result<Seen, Seen> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.seen(env).unwrap_or_default();
            if f(&seen) {
                return Ok(seen);
            }
            if Instant::now() >= deadline {
                return Err(seen);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait until DNS and HTTP each succeeded `n` more times than in `from`, and the busy
    /// tunnel echoed `n / 5` more pings.
    pub fn progressed(
        &self,
        env: &Env,
        from: &Seen,
        n: u64,
        timeout: Duration,
    ) -> Result<Seen, Seen> {
        let pings = from.tunnels.first().map_or(0, |t| t.0);
        self.wait(env, timeout, |s| {
            s.dns_ok >= from.dns_ok + n
                && s.http_ok >= from.http_ok + n
                && s.tunnels
                    .first()
                    .is_some_and(|t| t.0 >= pings + n / 5 || t.1)
        })
    }
}
