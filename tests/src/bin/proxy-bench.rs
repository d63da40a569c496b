//! `proxy-bench`: the egress-agent proxy side by side with squid, tinyproxy and a direct connection.
//!
//! One run measures, alternating peers each round: new CONNECT tunnels per second with 1 and 64
//! clients, proxy CPU time per tunnel (from /proc/PID/stat), bulk throughput through one tunnel,
//! added round-trip latency (p50/p99) versus direct, and proxy RSS per idle tunnel. The proxies run
//! pinned to CPU 1, this process (clients and upstreams) to CPU 0. Everything is on loopback; peers
//! get their own config/pid/log files under a temp dir (never the system's config), and their
//! `/etc/hosts` is a private bind mount (mount namespace) that maps the bench name to 127.0.0.1.
//! It prints a table with ratios; it never asserts on times.
//!
//! Usage: `proxy-bench [--quick] [--rounds N] [--idle N] [--peers direct,agent,squid,tinyproxy,floor]
//!         [--rate-only | --bulk-only] [--io-buffer BYTES] [--agent-buffer BYTES]
//!         [--peer-logs off|default] [--cpu-quota PERCENT]
//!         [--agent PATH (ignored: the agent's proxy runs from this binary)]`
//! `--cpu-quota 50` runs every proxy in a cgroup limited to 50% of one CPU (cgroup v1 `cpu` or v2
//! `cpu.max`), so tunnels/s compares the proxies at an equal CPU budget instead of at the client's
//! ceiling.
//! Peer `floor` is `relay-floor` (a sibling binary): a relay without policy that does only the
//! TCP work of a tunnel through io_uring. It takes part in the tunnels/s rows only; `floor/squid`
//! is about the most any proxy can reach against squid on the machine at hand.
//! By default squid's access log is off and tinyproxy logs only critical messages (to tmpfs): the
//! peers do the least work they can, so the ratios are conservative. The agent logs denials only.
//! Internal: `proxy-bench serve CONFIG ADDR_FILE` runs the agent's proxy (`egress_agent::proxy::serve`),
//! with a metrics registry attached as in the daemon (`PROXY_BENCH_NO_METRICS=1`: without).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NAME: &str = "bench.test";
/// Both ends' CPU per tunnel (see [`Rate::ends_cpu_us`]).
const ENDS_CPU: &str = "client+upstream CPU µs/tunnel, 64 cl.";

struct Opts {
    quick: bool,
    /// Which peers to run (default all): direct, agent, squid, tinyproxy, floor.
    peers: Vec<String>,
    /// Rate measurements only (no bulk/latency/idle), e.g. for profiling.
    rate_only: bool,
    /// Bulk throughput only.
    bulk_only: bool,
    /// `proxy.tunnel_buffer_bytes` for the agent (default: the agent's default).
    agent_buffer: Option<usize>,
    /// Read/write size of the bench's own clients and upstreams (an application's buffer).
    io_buffer: usize,
    /// Peers' own logging: `off` (access log off, least work for them; default) or `default`
    /// (their shipped logging, written to files in the tmpfs temp dir).
    peer_logs_default: bool,
    /// Percent of one CPU each proxy may use (`--cpu-quota`), via [`CpuCgroup`].
    cpu_quota: Option<usize>,
    rounds: usize,
    rate_secs: f64,
    bulk_bytes: u64,
    pings: usize,
    idle: usize,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        let (Some(cfg), Some(out)) = (args.get(1), args.get(2)) else {
            bail!("usage: proxy-bench serve CONFIG ADDR_FILE")
        };
        return serve(Path::new(cfg), Path::new(out));
    }
    let quick = args.iter().any(|a| a == "--quick");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<usize>().ok())
    };
    let peers = args
        .iter()
        .position(|a| a == "--peers")
        .and_then(|i| args.get(i + 1))
        .map_or_else(
            || {
                vec![
                    "direct".into(),
                    "agent".into(),
                    "squid".into(),
                    "tinyproxy".into(),
                    "floor".into(),
                ]
            },
            |v| v.split(',').map(str::to_owned).collect(),
        );
    let opts = Opts {
        quick,
        peers,
        rate_only: args.iter().any(|a| a == "--rate-only"),
        bulk_only: args.iter().any(|a| a == "--bulk-only"),
        agent_buffer: flag("--agent-buffer"),
        io_buffer: flag("--io-buffer").unwrap_or(64 * 1024),
        peer_logs_default: args
            .windows(2)
            .any(|w| w[0] == "--peer-logs" && w[1] == "default"),
        cpu_quota: flag("--cpu-quota"),
        rounds: flag("--rounds").unwrap_or(if quick { 1 } else { 3 }),
        rate_secs: if quick { 1.0 } else { 3.0 },
        bulk_bytes: if quick { 256 << 20 } else { 1 << 30 },
        pings: if quick { 2_000 } else { 20_000 },
        // Open files are capped at 20,000 per process here and this process holds 2 per tunnel.
        idle: flag("--idle").unwrap_or(if quick { 1_000 } else { 8_000 }),
    };
    pin_to_cpu(0);
    // Peers' helpers (squid's pinger) outlive a stopped peer briefly; as subreaper this process
    // inherits and reaps them (PID 1 may not), so no zombie is left behind.
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!("warning: not a child subreaper ({e}); helpers of stopped peers may linger");
    }
    let cgroup = match opts.cpu_quota {
        Some(pct) if (1..=100).contains(&pct) => Some(CpuCgroup::create(pct)?),
        Some(pct) => bail!("--cpu-quota {pct}: give a percentage of one CPU, 1-100"),
        None => None,
    };
    if let Some(cg) = &cgroup {
        CPU_CGROUP.set(cg.dir.clone()).ok();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(run(opts));
    drop(rt);
    reap_orphans(Duration::from_secs(5));
    drop(cgroup);
    r
}

/// Wait (up to `within`) for the orphaned helpers of stopped peers this process inherited.
fn reap_orphans(within: Duration) {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let deadline = Instant::now() + within;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(WaitStatus::StillAlive) | Err(_) => return, // timed out, or no children left
            Ok(_) => {}                                    // reaped one; look for more
        }
    }
}

/// The cgroup every proxy is started in when `--cpu-quota` is given.
static CPU_CGROUP: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// A cgroup limited to a share of one CPU; removed on drop (its processes have exited by then).
struct CpuCgroup {
    dir: PathBuf,
}

impl CpuCgroup {
    fn create(pct: usize) -> Result<CpuCgroup> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
        // (mount point, v1?) of a cgroup v1 hierarchy with the cpu controller, else cgroup2.
        let mut v1 = None;
        let mut v2 = None;
        for line in mountinfo.lines() {
            let Some((pre, post)) = line.split_once(" - ") else {
                continue;
            };
            let mnt = pre.split_whitespace().nth(4).unwrap_or_default();
            let mut post = post.split_whitespace();
            let fstype = post.next().unwrap_or_default();
            let opts = post.nth(1).unwrap_or_default();
            if fstype == "cgroup" && opts.split(',').any(|o| o == "cpu") {
                v1 = Some(PathBuf::from(mnt));
            } else if fstype == "cgroup2" {
                v2 = Some(PathBuf::from(mnt));
            }
        }
        let period = 10_000;
        let quota = pct * period / 100;
        let name = format!("proxy-bench-{}", std::process::id());
        let dir = if let Some(root) = v1 {
            let dir = root.join(name);
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(dir.join("cpu.cfs_period_us"), period.to_string())?;
            std::fs::write(dir.join("cpu.cfs_quota_us"), quota.to_string())?;
            dir
        } else if let Some(root) = v2 {
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers"))?;
            if !controllers.split_whitespace().any(|c| c == "cpu") {
                bail!("--cpu-quota: no cpu controller in {}", root.display());
            }
            std::fs::write(root.join("cgroup.subtree_control"), "+cpu")
                .with_context(|| format!("enabling cpu in {}", root.display()))?;
            let dir = root.join(name);
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(dir.join("cpu.max"), format!("{quota} {period}"))?;
            dir
        } else {
            bail!("--cpu-quota: no cgroup hierarchy with the cpu controller is mounted");
        };
        Ok(CpuCgroup { dir })
    }
}

impl Drop for CpuCgroup {
    fn drop(&mut self) {
        // Helpers of a stopped peer (squid's pinger) may take a moment to exit: EBUSY until then.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => {
                    eprintln!("warning: could not remove {}: {e}", self.dir.display());
                    return;
                }
            }
        }
    }
}

fn pin_to_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok()
        && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_err()
    {
        eprintln!("warning: could not pin to CPU {cpu}; figures will be noisier");
    }
}

// ---------------------------------------------------------------- agent proxy process (serve mode)

fn serve(config: &Path, out: &Path) -> Result<()> {
    // The daemon's runtime shape, one worker (the proxy is pinned to one CPU).
    let rt = if std::env::var_os("PROXY_BENCH_CURRENT_THREAD").is_some() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?
    };
    rt.block_on(async {
        let config = Arc::new(egress_agent::config::Config::load(config)?);
        let events = egress_agent::events::EventSink::default();
        let mut ctx = egress_agent::proxy::ProxyContext::new(&config, events)?;
        // The daemon's shape: metrics attached (PROXY_BENCH_NO_METRICS=1 measures without).
        if std::env::var_os("PROXY_BENCH_NO_METRICS").is_none() {
            ctx = ctx.with_metrics(Arc::new(egress_agent::metrics::Metrics::new()));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let server = egress_agent::proxy::serve(config, ctx, async move {
            term.recv().await;
        })
        .await?;
        let text: String = server
            .addrs()
            .iter()
            .map(|(k, v)| format!("{k} {v}\n"))
            .collect();
        let tmp = out.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, out)?;
        server.join().await;
        Ok(())
    })
}

// ---------------------------------------------------------------- upstreams (in this process, CPU 0)

struct Upstreams {
    echo: SocketAddr,
    source: SocketAddr,
}

async fn start_upstreams(bulk: u64, io_buffer: usize) -> Result<Upstreams> {
    let echo = TcpListener::bind("127.0.0.1:0").await?;
    let source = TcpListener::bind("127.0.0.1:0").await?;
    let up = Upstreams {
        echo: echo.local_addr()?,
        source: source.local_addr()?,
    };
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                s.set_nodelay(true).ok();
                let mut b = [0u8; 512];
                loop {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if s.write_all(&b[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
            });
        }
    });
    tokio::spawn(async move {
        while let Ok((mut s, _)) = source.accept().await {
            tokio::spawn(async move {
                let mut go = [0u8; 1];
                if s.read_exact(&mut go).await.is_err() {
                    return;
                }
                let chunk = vec![0x5au8; io_buffer];
                let mut left = bulk;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if s.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
                s.shutdown().await.ok();
            });
        }
    });
    Ok(up)
}

// ---------------------------------------------------------------- peers

struct Peer {
    name: &'static str,
    /// None = direct to the upstream.
    addr: Option<SocketAddr>,
    child: Option<Child>,
}

impl Peer {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SIGTERM first (clean shutdown), then make sure.
            Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status()
                .ok();
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            c.kill().ok();
            c.wait().ok();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Run `cmd` pinned to CPU 1, with the bench hosts file over /etc/hosts in a private mount namespace.
fn spawn_pinned(dir: &Path, cmd: &str, log: &str) -> Result<Child> {
    let hosts = dir.join("hosts");
    // With --cpu-quota the shell joins the limited cgroup first; the proxy it execs inherits it.
    let join = CPU_CGROUP
        .get()
        .map(|d| format!("echo $$ > {}/cgroup.procs && ", d.display()))
        .unwrap_or_default();
    let script = format!(
        "{join}mount --bind {} /etc/hosts && exec taskset -c 1 {cmd}",
        hosts.display()
    );
    let log = std::fs::File::create(dir.join(log))?;
    Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawning {cmd}"))
}

async fn wait_listening(addr: SocketAddr, what: &str, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            bail!("{what} exited: {st}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{what} did not listen on {addr}")
}

async fn start_agent(dir: &Path, up: &Upstreams, o_agent_buffer: Option<usize>) -> Result<Peer> {
    let cfg = dir.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[agent]
default_policy = "bench"
[proxy]
max_connections = 19000
max_connections_per_listener = 19000
idle_timeout_ms = 600000
[dns]
nameservers = []
hosts_file = "{hosts}"
[policies.bench]
mode = "allowlist"
allow_hosts = ["{NAME}"]
allow_ports = [{e}, {s}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{e}, {s}] }}]
"#,
            hosts = dir.join("hosts").display(),
            e = up.echo.port(),
            s = up.source.port()
        ),
    )?;
    if let Some(b) = o_agent_buffer {
        let text = std::fs::read_to_string(&cfg)?.replace(
            "[proxy]\n",
            &format!("[proxy]\ntunnel_buffer_bytes = {b}\n"),
        );
        std::fs::write(&cfg, text)?;
    }
    let out = dir.join("agent.addrs");
    let me = std::env::current_exe()?;
    let child = spawn_pinned(
        dir,
        &format!("{} serve {} {}", me.display(), cfg.display(), out.display()),
        "agent.log",
    )?;
    started("agent", "agent proxy", child, &out, &dir.join("agent.log")).await
}

/// Wait for a peer that reports its address as a `bench ADDR` line in `out`.
async fn started(
    name: &'static str,
    what: &str,
    mut child: Child,
    out: &Path,
    log: &Path,
) -> Result<Peer> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = loop {
        if let Ok(text) = std::fs::read_to_string(out)
            && let Some(rest) = text.lines().find_map(|l| l.strip_prefix("bench "))
        {
            break rest.trim().parse::<SocketAddr>()?;
        }
        if let Ok(Some(st)) = child.try_wait() {
            bail!("{what} exited: {st}; see {}", log.display());
        }
        if Instant::now() > deadline {
            bail!("{what} did not start; see {}", log.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    Ok(Peer {
        name,
        addr: Some(addr),
        child: Some(child),
    })
}

/// `relay-floor` (next to this binary), pinned and confined like the proxies.
async fn start_floor(dir: &Path) -> Result<Peer> {
    let bin = std::env::current_exe()?.with_file_name("relay-floor");
    if !bin.exists() {
        bail!(
            "{} missing (cargo build --release -p egress-tests --bins)",
            bin.display()
        );
    }
    let out = dir.join("floor.addrs");
    let child = spawn_pinned(
        dir,
        &format!("{} {}", bin.display(), out.display()),
        "floor.log",
    )?;
    started("floor", "relay-floor", child, &out, &dir.join("floor.log")).await
}

async fn start_squid(dir: &Path, up: &Upstreams, logs_default: bool) -> Result<Peer> {
    let port = free_port()?;
    let sq = dir.join("squid");
    std::fs::create_dir_all(&sq)?;
    Command::new("chmod").args(["0777"]).arg(&sq).status()?;
    let conf = sq.join("squid.conf");
    std::fs::write(
        &conf,
        format!(
            "http_port 127.0.0.1:{port}
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log {access}
cache_store_log none
logfile_rotate 0
coredump_dir {d}
netdb_filename none
cache deny all
cache_mem 8 MB
hosts_file {hosts}
dns_nameservers 127.0.0.1
max_filedescriptors 20000
shutdown_lifetime 0 seconds
workers 1
acl bench_hosts dstdomain {NAME}
acl bench_ports port {e} {s}
acl CONNECT method CONNECT
http_access allow CONNECT bench_hosts bench_ports
http_access deny all
",
            d = sq.display(),
            access = if logs_default {
                format!("stdio:{}/access.log squid", sq.display())
            } else {
                "none".to_owned()
            },
            hosts = dir.join("hosts").display(),
            e = up.echo.port(),
            s = up.source.port()
        ),
    )?;
    let mut child = spawn_pinned(dir, &format!("squid -N -f {}", conf.display()), "squid.out")?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    wait_listening(addr, "squid", &mut child).await?;
    Ok(Peer {
        name: "squid",
        addr: Some(addr),
        child: Some(child),
    })
}

async fn start_tinyproxy(dir: &Path, up: &Upstreams, logs_default: bool) -> Result<Peer> {
    let port = free_port()?;
    let tp = dir.join("tinyproxy");
    std::fs::create_dir_all(&tp)?;
    Command::new("chmod").args(["0777"]).arg(&tp).status()?;
    std::fs::write(
        tp.join("filter"),
        format!("^{}$\n", NAME.replace('.', "\\.")),
    )?;
    let conf = tp.join("tinyproxy.conf");
    std::fs::write(
        &conf,
        format!(
            "User nobody
Group nogroup
Port {port}
Listen 127.0.0.1
Timeout 600
LogFile \"{d}/tinyproxy.log\"
LogLevel {level}
PidFile \"{d}/tinyproxy.pid\"
MaxClients 10000
ConnectPort {e}
ConnectPort {s}
Filter \"{d}/filter\"
FilterDefaultDeny Yes
",
            d = tp.display(),
            level = if logs_default { "Info" } else { "Critical" },
            e = up.echo.port(),
            s = up.source.port()
        ),
    )?;
    let mut child = spawn_pinned(
        dir,
        &format!("tinyproxy -d -c {}", conf.display()),
        "tinyproxy.out",
    )?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    wait_listening(addr, "tinyproxy", &mut child).await?;
    Ok(Peer {
        name: "tinyproxy",
        addr: Some(addr),
        child: Some(child),
    })
}

// ---------------------------------------------------------------- measurements

/// Open a stream to `target` directly or through `proxy` with CONNECT.
async fn open(proxy: Option<SocketAddr>, target: SocketAddr) -> std::io::Result<TcpStream> {
    let Some(p) = proxy else {
        let s = TcpStream::connect(target).await?;
        s.set_nodelay(true)?;
        return Ok(s);
    };
    let mut s = TcpStream::connect(p).await?;
    s.set_nodelay(true)?;
    let head = format!(
        "CONNECT {NAME}:{port} HTTP/1.1\r\nHost: {NAME}:{port}\r\n\r\n",
        port = target.port()
    );
    s.write_all(head.as_bytes()).await?;
    let mut buf = [0u8; 512];
    let mut n = 0;
    loop {
        let r = s.read(&mut buf[n..]).await?;
        if r == 0 {
            return Err(std::io::Error::other(
                "proxy closed before answering CONNECT",
            ));
        }
        n += r;
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
        if n == buf.len() {
            return Err(std::io::Error::other("CONNECT answer too long"));
        }
    }
    if !(buf.starts_with(b"HTTP/1.1 200") || buf.starts_with(b"HTTP/1.0 200")) {
        return Err(std::io::Error::other(format!(
            "CONNECT refused: {}",
            String::from_utf8_lossy(&buf[..n.min(64)])
        )));
    }
    Ok(s)
}

async fn ping(s: &mut TcpStream) -> std::io::Result<()> {
    s.write_all(b"x").await?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await?;
    Ok(())
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime), counted from `pid` = 1; `rest` starts at field 3.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// What one [`tunnel_rate`] run measured.
struct Rate {
    per_sec: f64,
    /// The proxy's CPU µs per tunnel (none for `direct`).
    proxy_cpu_us: Option<f64>,
    /// This process's CPU µs per tunnel: the clients and the upstream, i.e. both ends of the
    /// connections the proxy relays (for `direct`: the TCP work of one client/server pair).
    ends_cpu_us: Option<f64>,
    errors: u64,
}

/// Full tunnel lifecycles per second: connect, CONNECT, 1-byte echo, close.
async fn tunnel_rate(peer: &Peer, echo: SocketAddr, clients: usize, secs: f64) -> Rate {
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let cpu0 = peer.pid().and_then(cpu_ticks);
    let ends0 = cpu_ticks(std::process::id());
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (ok, errors, proxy) = (ok.clone(), errors.clone(), peer.addr);
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                match async {
                    let mut s = open(proxy, echo).await?;
                    ping(&mut s).await
                }
                .await
                {
                    Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    for t in tasks {
        t.await.ok();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let n = ok.load(Ordering::Relaxed);
    let us_per_tunnel = |before: Option<u64>, after: Option<u64>| match (before, after) {
        (Some(a), Some(b)) if n > 0 => Some(b.saturating_sub(a) as f64 * 10_000.0 / n as f64), // 100 ticks/s
        _ => None,
    };
    Rate {
        per_sec: n as f64 / elapsed,
        proxy_cpu_us: us_per_tunnel(cpu0, peer.pid().and_then(cpu_ticks)),
        ends_cpu_us: us_per_tunnel(ends0, cpu_ticks(std::process::id())),
        errors: errors.load(Ordering::Relaxed),
    }
}

/// MB/s of `bytes` from the source upstream through one tunnel.
async fn bulk(peer: &Peer, source: SocketAddr, bytes: u64, io_buffer: usize) -> Result<f64> {
    let mut s = open(peer.addr, source).await?;
    let mut buf = vec![0u8; io_buffer];
    let start = Instant::now();
    s.write_all(b"g").await?;
    let mut got = 0u64;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    if got != bytes {
        bail!("{}: got {got} of {bytes} bytes", peer.name);
    }
    Ok(got as f64 / secs / 1e6)
}

/// Round-trip times (µs) of 1-byte pings over one connection/tunnel: (p50, p99).
async fn latency(peer: &Peer, echo: SocketAddr, pings: usize) -> Result<(f64, f64)> {
    let mut s = open(peer.addr, echo).await?;
    for _ in 0..200 {
        ping(&mut s).await?;
    }
    let mut rtts = Vec::with_capacity(pings);
    for _ in 0..pings {
        let t = Instant::now();
        ping(&mut s).await?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    rtts.sort_by(f64::total_cmp);
    Ok((rtts[pings / 2], rtts[(pings * 99 / 100).min(pings - 1)]))
}

/// KiB of proxy RSS per idle tunnel, with `n` tunnels open (each pinged once).
async fn idle_memory(peer: &Peer, echo: SocketAddr, n: usize) -> Result<f64> {
    let Some(pid) = peer.pid() else {
        bail!("no process")
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid).context("rss")?;
    let mut open_tunnels = Vec::with_capacity(n);
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut pending = Vec::with_capacity(n);
    for _ in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let proxy = peer.addr;
        pending.push(tokio::spawn(async move {
            let r = async {
                let mut s = open(proxy, echo).await?;
                ping(&mut s).await?;
                Ok::<_, std::io::Error>(s)
            }
            .await;
            drop(permit);
            r
        }));
    }
    let mut errors = 0;
    for p in pending {
        match p.await {
            Ok(Ok(s)) => open_tunnels.push(s),
            _ => errors += 1,
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib(pid).context("rss")?;
    let opened = open_tunnels.len();
    drop(open_tunnels);
    if errors > 0 {
        eprintln!("  {}: {errors} of {n} idle tunnels failed", peer.name);
    }
    if opened == 0 {
        bail!("no tunnel opened");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(after.saturating_sub(before) as f64 / opened as f64)
}

// ---------------------------------------------------------------- driver and table

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

type Samples = BTreeMap<(&'static str, &'static str), Vec<f64>>;

async fn run(o: Opts) -> Result<()> {
    let dir = PathBuf::from(format!("/dev/shm/proxy-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Command::new("chmod").arg("0755").arg(&dir).status()?;
    std::fs::write(
        dir.join("hosts"),
        format!("127.0.0.1 localhost\n127.0.0.1 {NAME}\n"),
    )?;
    let up = start_upstreams(o.bulk_bytes, o.io_buffer).await?;

    let want = |n: &str| o.peers.iter().any(|p| p == n);
    let mut peers = Vec::new();
    if want("direct") {
        peers.push(Peer {
            name: "direct",
            addr: None,
            child: None,
        });
    }
    if want("agent") {
        peers.push(start_agent(&dir, &up, o.agent_buffer).await?);
    }
    if want("squid") {
        match start_squid(&dir, &up, o.peer_logs_default).await {
            Ok(p) => peers.push(p),
            Err(e) => eprintln!("warning: squid not available: {e:#}"),
        }
    }
    if want("tinyproxy") {
        match start_tinyproxy(&dir, &up, o.peer_logs_default).await {
            Ok(p) => peers.push(p),
            Err(e) => eprintln!("warning: tinyproxy not available: {e:#}"),
        }
    }
    if want("floor") {
        match start_floor(&dir).await {
            Ok(p) => peers.push(p),
            Err(e) => eprintln!("warning: relay-floor not available: {e:#}"),
        }
    }
    if peers.is_empty() {
        bail!("no peers selected");
    }
    eprintln!(
        "proxy-bench{}: {} round(s), peers: {}; proxies on CPU 1, clients+upstreams on CPU 0; temp dir {}",
        if o.quick { " --quick" } else { "" },
        o.rounds,
        peers.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        dir.display()
    );

    let mut s: Samples = BTreeMap::new();
    let add = |s: &mut Samples, peer: &'static str, metric: &'static str, v: f64| {
        s.entry((peer, metric)).or_default().push(v)
    };
    for round in 0..o.rounds {
        // Alternate the order each round.
        let mut order: Vec<usize> = (0..peers.len()).collect();
        order.rotate_left(round % peers.len());
        for &i in &order {
            let p = &peers[i];
            for (clients, metric, cpu_metric) in if o.bulk_only {
                vec![]
            } else {
                vec![
                    (1, "tunnels/s, 1 client", "proxy CPU µs/tunnel, 1 client"),
                    (
                        64,
                        "tunnels/s, 64 clients",
                        "proxy CPU µs/tunnel, 64 clients",
                    ),
                ]
            } {
                let r = tunnel_rate(p, up.echo, clients, o.rate_secs).await;
                if r.errors > 0 {
                    eprintln!(
                        "  {}: {} failed tunnels ({clients} clients)",
                        p.name, r.errors
                    );
                }
                add(&mut s, p.name, metric, r.per_sec);
                if let Some(c) = r.proxy_cpu_us {
                    add(&mut s, p.name, cpu_metric, c);
                }
                if let (64, Some(c)) = (clients, r.ends_cpu_us) {
                    add(&mut s, p.name, ENDS_CPU, c);
                }
                // Let TIME_WAIT sockets and proxy cleanup settle between runs.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            if o.rate_only || p.name == "floor" {
                continue;
            }
            match bulk(p, up.source, o.bulk_bytes, o.io_buffer).await {
                Ok(v) => add(&mut s, p.name, "bulk MB/s, 1 tunnel", v),
                Err(e) => eprintln!("  {}: bulk failed: {e:#}", p.name),
            }
            if o.bulk_only {
                continue;
            }
            match latency(p, up.echo, o.pings).await {
                Ok((p50, p99)) => {
                    add(&mut s, p.name, "RTT p50 µs", p50);
                    add(&mut s, p.name, "RTT p99 µs", p99);
                }
                Err(e) => eprintln!("  {}: latency failed: {e:#}", p.name),
            }
            eprintln!("  round {} {} done", round + 1, p.name);
        }
    }
    for p in peers
        .iter()
        .filter(|p| p.child.is_some() && p.name != "floor" && !o.rate_only && !o.bulk_only)
    {
        match idle_memory(p, up.echo, o.idle).await {
            Ok(v) => add(&mut s, p.name, "RSS KiB/idle tunnel", v),
            Err(e) => eprintln!("  {}: idle-tunnel memory failed: {e:#}", p.name),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let mut m: BTreeMap<(&str, &str), f64> = BTreeMap::new();
    for (k, v) in s.iter_mut() {
        if let Some(x) = median(v) {
            m.insert(*k, x);
        }
    }
    // Added latency = proxy RTT − direct RTT.
    for q in ["p50", "p99"] {
        let metric: &'static str = if q == "p50" {
            "RTT p50 µs"
        } else {
            "RTT p99 µs"
        };
        let added: &'static str = if q == "p50" {
            "added latency p50 µs"
        } else {
            "added latency p99 µs"
        };
        if let Some(d) = m.get(&("direct", metric)).copied() {
            for p in ["agent", "squid", "tinyproxy"] {
                if let Some(v) = m.get(&(p, metric)).copied() {
                    m.insert((p, added), (v - d).max(0.0));
                }
            }
        }
    }
    print_table(&m, &o);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

fn print_table(m: &BTreeMap<(&str, &str), f64>, o: &Opts) {
    let metrics = [
        "tunnels/s, 1 client",
        "tunnels/s, 64 clients",
        "proxy CPU µs/tunnel, 1 client",
        "proxy CPU µs/tunnel, 64 clients",
        ENDS_CPU,
        "bulk MB/s, 1 tunnel",
        "RTT p50 µs",
        "RTT p99 µs",
        "added latency p50 µs",
        "added latency p99 µs",
        "RSS KiB/idle tunnel",
    ];
    let cell = |p: &str, k: &str| {
        m.get(&(p, k)).map_or("-".to_owned(), |v| {
            if *v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        })
    };
    let ratio = |a: &str, b: &str, k: &str| match (m.get(&(a, k)), m.get(&(b, k))) {
        (Some(x), Some(y)) if *y > 0.0 => format!("{:.2}", x / y),
        _ => "-".to_owned(),
    };
    println!();
    println!(
        "proxy-bench{} (medians of {} round(s); idle tunnels: {}; bulk {} MiB in {} KiB reads/writes; {} pings; peer logs {})",
        if o.quick { " --quick" } else { "" },
        o.rounds,
        o.idle,
        o.bulk_bytes >> 20,
        o.io_buffer >> 10,
        o.pings,
        if o.peer_logs_default {
            "as shipped (tmpfs)"
        } else {
            "off"
        }
    );
    // Bulk figures depend on it: a pacing default (BBR) throttles loopback; the agent's
    // client-facing sockets use `proxy.client_congestion_control` (cubic unless set).
    let host_cc = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
    println!(
        "host TCP congestion control: {host_cc} (direct, peers, upstream sockets); agent's client-facing sockets: cubic"
    );
    if let Some(pct) = o.cpu_quota {
        println!(
            "every proxy limited to {pct}% of one CPU (cgroup): tunnels/s compares equal CPU budgets"
        );
    }
    println!(
        "| {:<37} | {:>8} | {:>8} | {:>8} | {:>9} | {:>8} | {:>11} | {:>15} | {:>12} | {:>11} |",
        "metric",
        "direct",
        "agent",
        "squid",
        "tinyproxy",
        "floor",
        "agent/squid",
        "agent/tinyproxy",
        "agent/direct",
        "floor/squid"
    );
    println!(
        "|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|",
        "-".repeat(39),
        "-".repeat(10),
        "-".repeat(10),
        "-".repeat(10),
        "-".repeat(11),
        "-".repeat(10),
        "-".repeat(13),
        "-".repeat(17),
        "-".repeat(14),
        "-".repeat(13)
    );
    for k in metrics {
        println!(
            "| {:<37} | {:>8} | {:>8} | {:>8} | {:>9} | {:>8} | {:>11} | {:>15} | {:>12} | {:>11} |",
            k,
            cell("direct", k),
            cell("agent", k),
            cell("squid", k),
            cell("tinyproxy", k),
            cell("floor", k),
            ratio("agent", "squid", k),
            ratio("agent", "tinyproxy", k),
            ratio("agent", "direct", k),
            ratio("floor", "squid", k)
        );
    }
    println!();
    println!(
        "floor: relay-floor, only the TCP work of a tunnel (io_uring, no policy), so floor/squid is about the most any proxy reaches against squid here; {ENDS_CPU}: this process's side (the most tunnels/s it can drive is 1e6 / that)"
    );
    let get = |p: &str, k: &str| m.get(&(p, k)).copied();
    let verdict = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "n/a",
    };
    let rate = "tunnels/s, 64 clients";
    let cpu = "proxy CPU µs/tunnel, 64 clients";
    println!(
        "targets (informational, never asserted): tunnels/s >= 2x squid: {} (CPU/tunnel: agent {} µs, squid {} µs, relay floor {} µs); >= tinyproxy: {}; bulk >= 0.8x direct: {}; added p99 < 200 µs: {}; idle tunnel < 16 KiB: {}",
        verdict(
            get("agent", rate)
                .zip(get("squid", rate))
                .map(|(a, s)| a >= 2.0 * s)
        ),
        cell("agent", cpu),
        cell("squid", cpu),
        cell("floor", cpu),
        verdict(
            get("agent", rate)
                .zip(get("tinyproxy", rate))
                .map(|(a, t)| a >= t)
        ),
        verdict(
            get("agent", "bulk MB/s, 1 tunnel")
                .zip(get("direct", "bulk MB/s, 1 tunnel"))
                .map(|(a, d)| a >= 0.8 * d)
        ),
        verdict(get("agent", "added latency p99 µs").map(|v| v < 200.0)),
        verdict(get("agent", "RSS KiB/idle tunnel").map(|v| v < 16.0)),
    );
}
