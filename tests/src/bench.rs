//! What `dns-bench` and `transparent-bench` share: CPU pinning, a process's CPU time, pinned peer
//! processes that are stopped on drop, and waiting for a peer to report its address.
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Pin the calling thread (and what it spawns afterwards) to `cpu`.
pub fn pin_to_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok()
        && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_err()
    {
        eprintln!("warning: could not pin to CPU {cpu}; figures will be noisier");
    }
}

/// utime + stime of `pid`, in clock ticks (100 per second).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Microseconds of CPU per operation between two [`cpu_ticks`] readings.
pub fn us_per_op(before: Option<u64>, after: Option<u64>, ops: u64) -> Option<f64> {
    match (before, after) {
        (Some(a), Some(b)) if ops > 0 => Some(b.saturating_sub(a) as f64 * 10_000.0 / ops as f64),
        _ => None,
    }
}

pub fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// A peer process, SIGTERMed (then killed) on drop.
pub struct Peer {
    pub name: &'static str,
    pub child: Child,
}

impl Peer {
    /// `argv` pinned to `cpu` (taskset), output to `log`.
    pub fn spawn(name: &'static str, cpu: usize, argv: &[String], log: &Path) -> Result<Peer> {
        let log = std::fs::File::create(log)?;
        let child = Command::new("taskset")
            .arg("-c")
            .arg(cpu.to_string())
            .args(argv)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {name}: {argv:?}"))?;
        Ok(Peer { name, child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .ok();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// Wait until `out` holds a line `<key> <addr>` (written atomically by the peer), or the peer
/// exits.
pub fn wait_addr(peer: &mut Peer, out: &Path, key: &str, log: &Path) -> Result<SocketAddr> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(text) = std::fs::read_to_string(out)
            && let Some(rest) = text
                .lines()
                .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
        {
            return Ok(rest.trim().parse()?);
        }
        if let Ok(Some(st)) = peer.child.try_wait() {
            bail!("{} exited: {st}; see {}", peer.name, log.display());
        }
        if Instant::now() > deadline {
            bail!("{} did not start; see {}", peer.name, log.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port free on 127.0.0.1 for both UDP and TCP.
pub fn free_port() -> Result<u16> {
    for _ in 0..100 {
        let t = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = t.local_addr()?.port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no port free for UDP and TCP")
}

/// RFC 3339 (`2026-11-29T09:24:12.056693Z`) → seconds since midnight (enough for deltas).
pub fn secs(ts: &str) -> Option<f64> {
    let t = ts.split('T').nth(1)?.trim_end_matches('Z');
    let mut it = t.split(':');
    let h: f64 = it.next()?.parse().ok()?;
    let m: f64 = it.next()?.parse().ok()?;
    let s: f64 = it.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
