//! What the benchmark binaries share: CPU pinning, a process's CPU time, pinned peer processes
//! that are stopped on drop, waiting for a peer to report its address, and [`Target`]: a
//! performance target reported as one `target:` line, which `cargo xtask bench` collects into its
//! summary.
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

/// A dnsmasq on 127.0.0.1:`port` in the foreground with nothing of the host's (no config file,
/// resolv.conf or hosts file, no pid file), running as the current user, plus `extra` options.
pub fn dnsmasq(port: u16, extra: &[String]) -> Vec<String> {
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .ok()
        .flatten()
        .map_or_else(|| "root".to_owned(), |u| u.name);
    let mut v: Vec<String> = [
        "dnsmasq",
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        "--listen-address=127.0.0.1",
        "--pid-file=",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    v.push(format!("--port={port}"));
    v.push(format!("--user={user}"));
    v.extend_from_slice(extra);
    v
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

/// The ratio `num / den` of two medians; none when either is missing or `den` is not positive.
pub fn ratio(num: Option<f64>, den: Option<f64>) -> Option<f64> {
    match (num, den) {
        (Some(n), Some(d)) if d > 0.0 => Some(n / d),
        _ => None,
    }
}

/// The prefix of a [`Target`]'s line. `cargo xtask bench` (xtask/src/bench_targets.rs) reads
/// the lines that start with it; keep the two in step.
pub const TARGET_PREFIX: &str = "target: ";

/// Which side of its bound a [`Target`]'s figure must stay on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

/// What a [`Target`]'s figure says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Met,
    NotMet,
    /// No figure (a peer missing, a phase skipped, a failed measurement): never met.
    NotMeasured,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::NotMet => "NOT met",
            Verdict::NotMeasured => "not measured",
        }
    }
}

/// A performance target: a metric, its measured figure (a median of the benchmark's rounds, or
/// a ratio of such medians), and the bound it should stay within. Benchmarks assert nothing: a
/// target is reported, met or not.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// The metric, e.g. `connect() inside/outside an enforced cgroup`.
    pub name: String,
    pub measured: Option<f64>,
    pub bound: Bound,
    /// `×` for a ratio, else a unit (`s`, `µs`, `KiB`).
    pub unit: &'static str,
}

impl Target {
    pub fn at_most(
        name: impl Into<String>,
        measured: Option<f64>,
        bound: f64,
        unit: &'static str,
    ) -> Target {
        Target {
            name: name.into(),
            measured,
            bound: Bound::AtMost(bound),
            unit,
        }
    }

    pub fn at_least(
        name: impl Into<String>,
        measured: Option<f64>,
        bound: f64,
        unit: &'static str,
    ) -> Target {
        Target {
            name: name.into(),
            measured,
            bound: Bound::AtLeast(bound),
            unit,
        }
    }

    /// Met or not; a missing or non-finite figure is [`Verdict::NotMeasured`].
    pub fn verdict(&self) -> Verdict {
        let Some(v) = self.measured.filter(|v| v.is_finite()) else {
            return Verdict::NotMeasured;
        };
        let met = match self.bound {
            Bound::AtMost(b) => v <= b,
            Bound::AtLeast(b) => v >= b,
        };
        if met { Verdict::Met } else { Verdict::NotMet }
    }

    /// `target: <name> | <measured> | <= <bound> | met` (or `>=`; `NOT met`; `-` and
    /// `not measured` without a figure). `|` in the name becomes `/`, so the line always has
    /// four fields.
    pub fn line(&self) -> String {
        let (op, bound) = match self.bound {
            Bound::AtMost(b) => ("<=", b),
            Bound::AtLeast(b) => (">=", b),
        };
        let verdict = self.verdict();
        let measured = match self.measured {
            Some(v) if verdict != Verdict::NotMeasured => self.figure(v),
            _ => "-".to_owned(),
        };
        format!(
            "{TARGET_PREFIX}{} | {measured} | {op} {} | {}",
            self.name.replace('|', "/"),
            self.figure(bound),
            verdict.as_str()
        )
    }

    /// Print [`Target::line`] on stdout.
    pub fn report(&self) {
        println!("{}", self.line());
    }

    /// `1.045×`, `1.850 s`, `26.2 µs`, `12515 tunnels/s`: three decimals below 10, one below
    /// 1000, none above.
    fn figure(&self, v: f64) -> String {
        let digits = match v.abs() {
            a if a < 10.0 => 3,
            a if a < 1000.0 => 1,
            _ => 0,
        };
        let sep = if self.unit == "×" { "" } else { " " };
        format!("{v:.digits$}{sep}{}", self.unit)
    }
}

/// Print every target's line (after a benchmark's own table).
pub fn report_all(targets: &[Target]) {
    for t in targets {
        t.report();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_line_says_met_not_met_or_not_measured() {
        let t = Target::at_most("connect() inside/outside", Some(1.0449), 1.05, "×");
        assert_eq!(t.verdict(), Verdict::Met);
        assert_eq!(
            t.line(),
            "target: connect() inside/outside | 1.045× | <= 1.050× | met"
        );
        let t = Target::at_most("connect() inside/outside", Some(1.0501), 1.05, "×");
        assert_eq!(t.verdict(), Verdict::NotMet);
        assert!(
            t.line().ends_with("| 1.050× | <= 1.050× | NOT met"),
            "{}",
            t.line()
        );
        // The bound itself is within it.
        assert_eq!(
            Target::at_most("x", Some(2.0), 2.0, "s").verdict(),
            Verdict::Met
        );
        assert_eq!(
            Target::at_least("x", Some(0.95), 0.95, "×").verdict(),
            Verdict::Met
        );
        let t = Target::at_least("allowed tunnels/s flood/no flood", Some(0.898), 0.95, "×");
        assert_eq!(
            t.line(),
            "target: allowed tunnels/s flood/no flood | 0.898× | >= 0.950× | NOT met"
        );
        assert_eq!(
            Target::at_most("added p99, agent", Some(254.4), 1000.0, "µs").line(),
            "target: added p99, agent | 254.4 µs | <= 1000 µs | met"
        );
    }

    #[test]
    fn a_missing_figure_is_never_met() {
        for measured in [None, Some(f64::NAN), Some(f64::INFINITY)] {
            for t in [
                Target::at_most("m", measured, 1.0, "×"),
                Target::at_least("m", measured, 1.0, "×"),
            ] {
                assert_eq!(t.verdict(), Verdict::NotMeasured);
                assert!(t.line().ends_with(" | not measured"), "{}", t.line());
                assert!(t.line().contains(" | - | "), "{}", t.line());
            }
        }
    }

    #[test]
    fn a_bar_in_the_name_cannot_add_a_field() {
        let line = Target::at_most("a | b", Some(1.0), 2.0, "s").line();
        assert_eq!(line, "target: a / b | 1.000 s | <= 2.000 s | met");
        assert_eq!(line.split(" | ").count(), 4);
    }

    #[test]
    fn ratios_need_both_medians_and_a_positive_denominator() {
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
        assert_eq!(ratio(None, Some(2.0)), None);
        assert_eq!(ratio(Some(3.0), None), None);
        assert_eq!(ratio(Some(3.0), Some(0.0)), None);
    }
}
