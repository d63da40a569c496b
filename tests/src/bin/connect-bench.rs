//! `connect-bench`: cost of connect() inside an enforced cgroup over outside it (for
//! `cargo xtask bench`; a benchmark, not a test — nothing here asserts a time).
//!
//! Run as root: `connect-bench [--quick] [--batch N] [--rounds R] [--agent PATH] [--cpu C]`
//! (defaults: 40 rounds of 5 000-connect batches; `--quick`: 12 rounds of 2 000).
//! The client loop — a blocking connect() to a reserved (bound, not listening) port on
//! 127.0.0.1, answered at once by the kernel with a RST (ECONNREFUSED) — runs in long-lived
//! child processes pinned to the same CPU C (sched_setaffinity): one outside any enforced cgroup,
//! one under `egress-agent exec` with an allowlist policy whose `allow_cidrs` allows exactly that
//! port, so every inside connect() runs the full connect4 verdict (policy lookup + CIDR lookup),
//! is allowed, and reaches the same RST. Refused connects keep the loop independent of an accept
//! thread (which on a busy 2-core machine starves and turns the benchmark into a SYN-retry
//! timer) and make the hooks' share of the cost as large as it gets: a conservative ratio.
//! Any error other than ECONNREFUSED (e.g. EPERM) fails the run.
//!
//! Why rounds of short batches: a connect() here takes 15–20 µs and that figure drifts by ±10 %
//! over seconds on these shared machines, more than the 5 % being measured. So the clients take
//! turns in short batches (~0.1 s each), in the order outside-empty-inside, then
//! inside-empty-outside, … (a steady drift counts against every side equally), and every round
//! gives one ratio from batches taken a few milliseconds apart. The figure is the median of those
//! ratios, with its interquartile range.
//!
//! The third client, "empty", runs in a cgroup of its own (outside the agent's tree) to which this
//! bench attaches `r0 = 1; exit` programs on the five hooks a refused TCP connect() runs:
//! sock_create, connect4, cgroup_skb egress and ingress, sock_ops. Empty over outside is what the
//! kernel charges for running cgroup programs at all (8 runs per connect(); nothing the agent's
//! programs can make cheaper); inside over empty is the agent's programs' own work.
//!
//! After the timed rounds, one more inside batch is made with BPF run-time statistics enabled
//! through a BPF_ENABLE_STATS fd (released at exit; no sysctl is changed) and the per-program
//! cost (ns/run, from `egress-agent status --json`) is printed: the hook cost measured by the
//! kernel itself. Those figures include the statistics' own cost, which the empty programs
//! measure in the same batch (`empty <hook>` lines).
//!
//! Output: one line per round, the per-program costs, then
//! `connect() ns/op: outside <o> inside <i> ratio <r> (median of <R> rounds, IQR <a>–<b>)`,
//! the line that splits the ratio into the kernel's part and the agent's, and the target's line
//! (`target: connect() inside/outside an enforced cgroup ... | <= 1.050× | met`, see
//! [`egress_tests::bench::Target`]): the median ratio against [`TARGET`].
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use egress_agent::bpf::sys::attach_type;
use egress_tests::agent::cgroup2_mount;
use egress_tests::bench::{Target, percentile, pin_to_cpu};
use egress_tests::bpf::{attach_to_cgroup, load_allow_all, prog_run_stats, prog_type};

/// connect() inside an enforced cgroup over outside it, at most (issue #38).
const TARGET: f64 = 1.05;

fn arg_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Client (child process): each line `N` on stdin is answered, after N connect()s, with
/// `<ns per connect()> <failures>`; end of input ends it.
fn client(target: SocketAddr, cpu: usize) -> ! {
    pin_to_cpu(cpu);
    let attempt = || matches!(TcpStream::connect(target), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused);
    // Warm-up.
    for _ in 0..200 {
        let _ = attempt();
    }
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lines() {
        let Ok(n) = line.unwrap_or_default().trim().parse::<u64>() else {
            std::process::exit(2);
        };
        let start = Instant::now();
        let failures = (0..n).filter(|_| !attempt()).count();
        let ns = start.elapsed().as_nanos() as f64 / n.max(1) as f64;
        if writeln!(out, "{ns:.1} {failures}")
            .and_then(|()| out.flush())
            .is_err()
        {
            std::process::exit(1);
        }
    }
    std::process::exit(0);
}

/// One of the long-lived clients, driven a batch at a time.
struct Client {
    name: &'static str,
    child: Child,
    /// Its stderr (a file, so nothing it writes can fill a pipe and stall it).
    log: PathBuf,
    /// Closed to stop the client: end of input ends its loop, and `egress-agent exec` then
    /// exits on its own and removes its cgroup (a SIGKILL would leave that behind).
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl Client {
    fn spawn(name: &'static str, mut cmd: Command, dir: &std::path::Path) -> Self {
        let log = dir.join(format!("{name}.stderr"));
        let stderr = std::fs::File::create(&log).expect("client log");
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("start the {name} client: {e}"));
        let input = child.stdin.take().expect("stdin");
        let output = BufReader::new(child.stdout.take().expect("stdout"));
        Self {
            name,
            child,
            log,
            input: Some(input),
            output,
        }
    }

    /// ns per connect() over a batch of `n`; any connect that was not refused fails the run.
    fn batch(&mut self, n: u64) -> f64 {
        let mut line = String::new();
        let answered = self
            .input
            .as_mut()
            .is_some_and(|i| writeln!(i, "{n}").is_ok())
            && self.output.read_line(&mut line).is_ok_and(|read| read > 0);
        let mut parts = line.split_whitespace();
        let ns: f64 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(f64::NAN);
        let failures: u64 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX);
        if !answered || failures != 0 || !ns.is_finite() {
            let stderr = self.stop();
            let status = self.child.try_wait().ok().flatten();
            panic!(
                "the {} client failed (answer {line:?}, exit {status:?}; each answer is \
                 `<ns> <failures>` and every connect() must be refused by the port, not by the \
                 agent): stderr {stderr}",
                self.name
            );
        }
        ns
    }

    /// End the client's input, wait for it (killed after 10 s) and return what it wrote to
    /// stderr so far.
    fn stop(&mut self) -> String {
        drop(self.input.take());
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while self.child.try_wait().is_ok_and(|s| s.is_none()) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if self.child.try_wait().is_ok_and(|s| s.is_none()) {
            self.child.kill().ok();
            self.child.wait().ok();
        }
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if self.input.is_some() {
            self.stop();
        }
    }
}

/// A TCP socket bound to 127.0.0.1:<free port> but not listening (holds the port; connects to
/// it get a RST).
fn bind_only() -> (std::os::fd::OwnedFd, SocketAddr) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: fresh fd we own.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes([127, 0, 0, 1]),
        },
        sin_zero: [0; 8],
    };
    let mut len = size_of::<libc::sockaddr_in>() as u32;
    // SAFETY: valid sockaddr_in and size.
    let rc = unsafe { libc::bind(fd.as_raw_fd(), (&raw const sin).cast(), len) };
    assert!(rc == 0, "bind: {}", std::io::Error::last_os_error());
    // SAFETY: valid sockaddr_in buffer and its size.
    let rc = unsafe { libc::getsockname(fd.as_raw_fd(), (&raw mut sin).cast(), &raw mut len) };
    assert!(rc == 0, "getsockname: {}", std::io::Error::last_os_error());
    (
        fd,
        SocketAddr::from(([127, 0, 0, 1], u16::from_be(sin.sin_port))),
    )
}

fn agent_bin(args: &[String]) -> PathBuf {
    if let Some(p) = arg_value(args, "--agent") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().expect("dir").join("egress-agent")
}

/// The hooks a refused TCP connect() runs, as (name, program type, attach type).
const HOOKS: [(&str, u32, u32); 5] = [
    (
        "sock_create",
        prog_type::CGROUP_SOCK,
        attach_type::CGROUP_INET_SOCK_CREATE,
    ),
    (
        "connect4",
        prog_type::CGROUP_SOCK_ADDR,
        attach_type::CGROUP_INET4_CONNECT,
    ),
    (
        "skb egress",
        prog_type::CGROUP_SKB,
        attach_type::CGROUP_INET_EGRESS,
    ),
    (
        "skb ingress",
        prog_type::CGROUP_SKB,
        attach_type::CGROUP_INET_INGRESS,
    ),
    (
        "sock_ops",
        prog_type::SOCK_OPS,
        attach_type::CGROUP_SOCK_OPS,
    ),
];

/// A cgroup of this bench's own, next to (not under) the agent's, with `r0 = 1; exit` attached
/// on every hook in [`HOOKS`]. Removed on drop (after its client: the programs go with it).
struct EmptyPrograms {
    dir: PathBuf,
    progs: Vec<(&'static str, OwnedFd)>,
}

impl EmptyPrograms {
    fn create() -> std::io::Result<Self> {
        let dir = cgroup2_mount().join(format!("connect-bench-{}", std::process::id()));
        std::fs::create_dir(&dir)?;
        let mut empty = Self {
            dir,
            progs: Vec::new(),
        };
        for (name, prog_type, attach_type) in HOOKS {
            let prog = load_allow_all(prog_type, attach_type)?;
            attach_to_cgroup(&empty.dir, &prog, attach_type)?;
            empty.progs.push((name, prog));
        }
        Ok(empty)
    }

    fn enter(&self, pid: u32) -> std::io::Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
    }

    fn run_stats(&self) -> Vec<(&'static str, (u64, u64))> {
        self.progs
            .iter()
            .filter_map(|(name, fd)| prog_run_stats(fd).ok().map(|s| (*name, s)))
            .collect()
    }
}

impl Drop for EmptyPrograms {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("note: could not remove {}: {e}", self.dir.display());
        }
    }
}

/// Median and interquartile range of `v`.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    (
        percentile(&mut v, 0.5),
        percentile(&mut v, 0.25),
        percentile(&mut v, 0.75),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let n: u64 = arg_value(&args, "--batch")
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 2_000 } else { 5_000 });
    let cpu: usize = arg_value(&args, "--cpu")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if args.iter().any(|a| a == "--client") {
        let target: SocketAddr = arg_value(&args, "--target")
            .and_then(|s| s.parse().ok())
            .expect("--target");
        client(target, cpu);
    }
    let rounds: usize = arg_value(&args, "--rounds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 12 } else { 40 })
        .max(1);
    assert!(
        nix::unistd::geteuid().is_root(),
        "connect-bench needs root (it runs egress-agent exec)"
    );

    // Reserve a port without listening on it: connects are refused by the kernel at once.
    let (holder, target) = bind_only();

    let dir = std::env::temp_dir().join(format!("connect-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("config.toml");
    std::fs::File::create(&config)
        .and_then(|mut f| {
            write!(
                f,
                "[policies.bench]\nmode = \"allowlist\"\nallow_cidrs = [{{ cidr = \"127.0.0.1/32\", ports = [{}] }}]\n",
                target.port()
            )
        })
        .expect("write config");

    let me = std::env::current_exe().expect("current_exe");
    let agent = agent_bin(&args);
    let client_args = |cmd: &mut Command| {
        cmd.arg("--client")
            .arg("--target")
            .arg(target.to_string())
            .arg("--cpu")
            .arg(cpu.to_string());
    };
    let empty = EmptyPrograms::create()
        .inspect_err(|e| {
            eprintln!(
                "note: no empty-programs client (attaching `r0 = 1; exit` failed: {e}); the ratio is not split"
            );
        })
        .ok();
    // Clients in round order: outside, empty programs, inside.
    let mut outside = Command::new(&me);
    client_args(&mut outside);
    let mut clients = vec![("outside", Client::spawn("outside", outside, &dir))];
    if let Some(empty) = &empty {
        let mut cmd = Command::new(&me);
        client_args(&mut cmd);
        let client = Client::spawn("empty", cmd, &dir);
        empty
            .enter(client.child.id())
            .expect("move the empty-programs client into its cgroup");
        clients.push(("empty", client));
    }
    let mut inside = Command::new(&agent);
    inside
        .args(["exec", "--policy", "bench", "--config"])
        .arg(&config)
        .arg("--")
        .arg(&me);
    client_args(&mut inside);
    clients.push(("inside", Client::spawn("inside", inside, &dir)));
    // One batch each before timing: the first batches pay for page faults and cold caches.
    for (_, c) in &mut clients {
        c.batch(n);
    }

    let names: Vec<&str> = clients.iter().map(|(name, _)| *name).collect();
    println!(
        "connect-bench: {rounds} rounds of {n} refused connect()s to {target} per client ({}), all on CPU {cpu}, the order reversed every round",
        names.join(", ")
    );
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); clients.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..clients.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for at in order {
            let ns = clients[at].1.batch(n);
            times[at].push(ns);
        }
        let line: Vec<String> = names
            .iter()
            .zip(&times)
            .map(|(name, t)| format!("{name} {:.1}", t[round]))
            .collect();
        println!(
            "round {round}: {} ns/connect; inside/outside {:.3}",
            line.join(", "),
            times[clients.len() - 1][round] / times[0][round]
        );
    }
    // Per-program cost: one more batch inside (and with the empty programs) with BPF run-time
    // stats on (stats add their own overhead, so they are off during the timed rounds above).
    let stats = egress_tests::bpf::enable_run_time_stats()
        .inspect_err(|e| eprintln!("note: BPF_ENABLE_STATS failed ({e}); no per-program costs"))
        .ok();
    let before = program_stats(&agent);
    let empty_before = empty.as_ref().map(EmptyPrograms::run_stats);
    for (_, c) in clients.iter_mut().skip(1) {
        c.batch(n);
    }
    let after = program_stats(&agent);
    let empty_after = empty.as_ref().map(EmptyPrograms::run_stats);
    drop(stats);
    drop(clients);
    drop(empty);
    std::fs::remove_dir_all(&dir).ok();
    drop(holder);

    let per_run = |(c1, n1): (u64, u64), (c0, n0): (u64, u64)| {
        (c1 > c0).then(|| (c1 - c0, (n1 - n0) as f64 / (c1 - c0) as f64))
    };
    for (name, now) in &after {
        if let Some((runs, ns)) = per_run(*now, before.get(name).copied().unwrap_or((0, 0))) {
            println!("  {name:<18} {runs:>10} runs {ns:>7.1} ns/run");
        }
    }
    for ((name, now), (_, was)) in empty_after
        .iter()
        .flatten()
        .zip(empty_before.iter().flatten())
    {
        if let Some((runs, ns)) = per_run(*now, *was) {
            println!("  empty {name:<12} {runs:>10} runs {ns:>7.1} ns/run (the stats' own cost)");
        }
    }
    let last = times.len() - 1;
    let ratios = |a: usize, b: usize| -> Vec<f64> {
        times[a].iter().zip(&times[b]).map(|(x, y)| x / y).collect()
    };
    let (r, lo, hi) = spread(ratios(last, 0));
    println!(
        "connect() ns/op: outside {:.1} inside {:.1} ratio {r:.3} (median of {rounds} rounds, IQR {lo:.3}–{hi:.3})",
        spread(times[0].clone()).0,
        spread(times[last].clone()).0,
    );
    if times.len() == 3 {
        let (k, klo, khi) = spread(ratios(1, 0));
        let (a, alo, ahi) = spread(ratios(last, 1));
        println!(
            "  split: empty/outside {k:.3} (IQR {klo:.3}–{khi:.3}; the kernel running 8 cgroup programs per connect()), inside/empty {a:.3} (IQR {alo:.3}–{ahi:.3}; egress-agent's programs' own work)"
        );
    }
    Target::at_most(
        "connect() inside/outside an enforced cgroup (median of rounds)",
        Some(r),
        TARGET,
        "×",
    )
    .report();
}

/// (run_count, run_time_ns) per egress-agent program name, from `egress-agent status --json`.
fn program_stats(agent: &PathBuf) -> std::collections::BTreeMap<String, (u64, u64)> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(o) = Command::new(agent).args(["status", "--json"]).output() else {
        return out;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&o.stdout) else {
        return out;
    };
    for p in v["programs"].as_array().into_iter().flatten() {
        let name = p["name"].as_str().unwrap_or("?").to_owned();
        let e = out.entry(name).or_insert((0, 0));
        e.0 += p["run_count"].as_u64().unwrap_or(0);
        e.1 += p["run_time_ns"].as_u64().unwrap_or(0);
    }
    out
}
