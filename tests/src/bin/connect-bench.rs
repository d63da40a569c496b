//! `connect-bench`: cost of connect() inside an enforced cgroup over outside it (for
//! `cargo xtask bench`; a benchmark, not a test — nothing here asserts a time).
//!
//! Run as root: `connect-bench [--quick] [--iterations N] [--rounds R] [--agent PATH] [--cpu C]`
//! (defaults: 50 000 connects x 7 rounds; `--quick`: 10 000 x 3).
//! The client loop — a blocking connect() to a reserved (bound, not listening) port on
//! 127.0.0.1, answered at once by the kernel with a RST (ECONNREFUSED) — runs in a child
//! process pinned to CPU C (sched_setaffinity), once outside any enforced cgroup and once under
//! `egress-agent exec` with an allowlist policy whose `allow_cidrs` allows exactly that port, so
//! every inside connect() runs the full connect4 verdict (policy walk + CIDR lookup), is
//! allowed, and reaches the same RST. Refused connects keep the loop independent of an accept
//! thread (which on a busy 2-core machine starves and turns the benchmark into a SYN-retry
//! timer) and make the hook's share of the cost as large as it gets: a conservative ratio.
//! Any error other than ECONNREFUSED (e.g. EPERM) fails the run. Rounds alternate
//! inside/outside; medians are compared.
//!
//! After the timed rounds, one more inside run is made with BPF run-time statistics enabled
//! through a BPF_ENABLE_STATS fd (released at exit; no sysctl is changed) and the per-program
//! cost (ns/run, from `egress-agent status --json`) is printed: the hook cost measured by the
//! kernel itself, independent of machine noise.
//!
//! Output: one line per round, the per-program costs, then
//! `connect() ns/op: outside <o> inside <i> ratio <i/o> (median of rounds; best-of ratio <b>) (target <= 1.05)`.
use std::io::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).ok();
    }
}

fn arg_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Client loop (child process): prints ns per connect().
fn inner(target: SocketAddr, n: u64, cpu: usize) -> ! {
    pin(cpu);
    let attempt = || matches!(TcpStream::connect(target), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused);
    // Warm-up.
    for _ in 0..200 {
        let _ = attempt();
    }
    let start = Instant::now();
    let mut failures = 0u64;
    for _ in 0..n {
        if !attempt() {
            failures += 1;
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    println!("{ns:.1} {failures}");
    std::process::exit(if failures > 0 { 1 } else { 0 });
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

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run_child(cmd: &mut Command) -> f64 {
    let out = cmd.output().expect("run client");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or("");
    let mut parts = line.split_whitespace();
    let ns: f64 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN);
    let failures: u64 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(
        out.status.success() && failures == 0 && ns.is_finite(),
        "client failed ({}): stdout {text} stderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    ns
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let n: u64 = arg_value(&args, "--iterations")
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 10_000 } else { 50_000 });
    let cpu: usize = arg_value(&args, "--cpu")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if args.iter().any(|a| a == "--inner") {
        let target: SocketAddr = arg_value(&args, "--target")
            .and_then(|s| s.parse().ok())
            .expect("--target");
        inner(target, n, cpu);
    }
    let rounds: usize = arg_value(&args, "--rounds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 3 } else { 7 });
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
    let inner_args = |cmd: &mut Command| {
        cmd.arg("--inner")
            .arg("--target")
            .arg(target.to_string())
            .arg("--iterations")
            .arg(n.to_string())
            .arg("--cpu")
            .arg(cpu.to_string());
    };
    let (mut outside, mut inside) = (Vec::new(), Vec::new());
    println!(
        "connect-bench: {n} refused connect()s per run to {target}, client on CPU {cpu}, {rounds} rounds"
    );
    for round in 0..rounds {
        let mut c = Command::new(&me);
        inner_args(&mut c);
        let o = run_child(&mut c);
        let mut c = Command::new(&agent);
        c.args(["exec", "--policy", "bench", "--config"])
            .arg(&config)
            .arg("--")
            .arg(&me);
        inner_args(&mut c);
        let i = run_child(&mut c);
        println!("round {round}: outside {o:.1} ns/connect, inside {i:.1} ns/connect");
        outside.push(o);
        inside.push(i);
    }
    // Per-program cost: one more inside run with BPF run-time stats on (stats add their own
    // overhead, so they are off during the timed rounds above).
    let stats = enable_run_time_stats();
    let before = program_stats(&agent);
    let mut c = Command::new(&agent);
    c.args(["exec", "--policy", "bench", "--config"])
        .arg(&config)
        .arg("--")
        .arg(&me);
    inner_args(&mut c);
    run_child(&mut c);
    std::fs::remove_dir_all(&dir).ok();
    drop(holder);
    let after = program_stats(&agent);
    drop(stats);
    for (name, (cnt, ns)) in &after {
        let (c0, n0) = before.get(name).copied().unwrap_or((0, 0));
        if cnt > &c0 {
            println!(
                "  {name:<16} {:>10} runs {:>7.1} ns/run",
                cnt - c0,
                (ns - n0) as f64 / (cnt - c0) as f64
            );
        }
    }
    let best = outside.iter().copied().fold(f64::INFINITY, f64::min);
    let best_in = inside.iter().copied().fold(f64::INFINITY, f64::min);
    let (o, i) = (median(&mut outside), median(&mut inside));
    println!(
        "connect() ns/op: outside {o:.1} inside {i:.1} ratio {:.3} (median of rounds; best-of ratio {:.3}) (target <= 1.05)",
        i / o,
        best_in / best
    );
}

/// BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): run-time stats stay on while the returned fd is open.
fn enable_run_time_stats() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    #[repr(C)]
    struct Attr {
        stats_type: u32,
    }
    let mut attr = Attr { stats_type: 0 };
    // SAFETY: BPF_ENABLE_STATS (32) with its one-field attr.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 32, &raw mut attr, size_of::<Attr>() as u32) };
    if fd < 0 {
        eprintln!(
            "note: BPF_ENABLE_STATS failed ({}); no per-program costs",
            std::io::Error::last_os_error()
        );
        return None;
    }
    // SAFETY: the syscall returned a new fd we own.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
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
