//! Content-checked tunnels through the agent's proxy, for the relay integrity test and the relay
//! soak (`relay-soak`, in `cargo xtask bench`).
//!
//! Each tunnel is a CONNECT to [`NAME`] on an upstream run here. The client sends a 32-byte head
//! ([`MAGIC`], seed, bytes up, bytes down), then both ends stream [`crate::stream`] bytes at once, each
//! half-closing when done, and each checks every byte it reads against what the other sent at
//! that offset, and that its EOF comes exactly after the announced length. Sizes decide which side
//! half-closes first; a "slow" reader pauses between reads so its peer falls behind (the kernel
//! relay's hand-back).
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::stream::{Checker, Source};

/// The upstream's name in the proxy's hosts file.
pub const NAME: &str = "relay.check.test";

/// One tunnel's plan.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub seed: u64,
    /// Bytes client → upstream after the head.
    pub up: u64,
    /// Bytes upstream → client.
    pub down: u64,
    /// The client reads slowly (a pause every [`SLOW_EVERY`] bytes): its peer falls behind.
    pub slow: bool,
    /// Largest write (each write is a random size up to this).
    pub max_write: usize,
    /// The client half-closes only after the whole download arrived (a half-closed tunnel is
    /// never spliced: this keeps a download spliceable to its end).
    pub hold_open: bool,
}

/// A slow reader pauses once per this many bytes.
pub const SLOW_EVERY: u64 = 4 << 20;
const SLOW_PAUSE: Duration = Duration::from_millis(20);

const UP: u64 = 0x5550;
/// First bytes of every tunnel: plain text, so the proxy's sniffing never takes the stream for
/// a TLS record (random bytes starting with 0x16 were answered with a TLS `decode_error` alert,
/// as any CONNECT payload that starts like a malformed ClientHello is).
pub const MAGIC: &[u8; 8] = b"RELAYCHK";
const DOWN: u64 = 0xD0D0;

/// A small deterministic generator (splitmix64) for sizes and plans, so a failing seed replays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// Log-uniform in `1..=max` (as many tiny as huge sizes).
    pub fn size(&mut self, max: u64) -> u64 {
        let bits = 64 - max.leading_zeros() as u64;
        let b = self.range(0, bits);
        (self.next_u64() % (1u64 << b).max(1)).clamp(1, max)
    }
}

/// The upstream: accepts tunnels' connections, checks what each sends, answers with its own
/// stream. Each connection's verdict is sent on the returned channel as (seed, result).
pub async fn start_upstream() -> Result<(
    SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<(u64, Result<(), String>)>,
)> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let (seed, r) = serve_one(s).await;
                tx.send((seed, r.map_err(|e| format!("{e:#}")))).ok();
            });
        }
    });
    Ok((addr, rx))
}

async fn serve_one(s: TcpStream) -> (u64, Result<()>) {
    s.set_nodelay(true).ok();
    let (mut r, mut w) = s.into_split();
    let mut head = [0u8; 32];
    if let Err(e) = r.read_exact(&mut head).await {
        return (0, Err(anyhow::Error::new(e).context("reading the head")));
    }
    if head[..8] != MAGIC[..] {
        return (
            0,
            Err(anyhow::anyhow!(
                "head does not start with the magic: {head:02x?}"
            )),
        );
    }
    let word = |i: usize| u64::from_le_bytes(head[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    let (seed, up, down) = (word(1), word(2), word(3));
    let mut rng = Rng::new(seed ^ 0xABCD);
    let max_write = rng.range(1, 256 << 10) as usize;
    let sender = tokio::spawn(async move {
        send(&mut w, Source::new(seed ^ DOWN), down, max_write, &mut rng).await?;
        w.shutdown().await.context("half-closing")?;
        Ok::<_, anyhow::Error>(w)
    });
    let received = receive(&mut r, Checker::new(seed ^ UP), up, false).await;
    let sent = sender.await;
    let r = match (received, sent) {
        (Err(e), _) => Err(e.context("upstream receiving")),
        (Ok(()), Err(e)) => Err(anyhow::anyhow!("upstream sender panicked: {e}")),
        (Ok(()), Ok(Err(e))) => Err(e.context("upstream sending")),
        (Ok(()), Ok(Ok(_w))) => Ok(()),
    };
    (seed, r)
}

/// Write `len` bytes of `src` in writes of random sizes up to `max_write`.
async fn send(
    w: &mut (impl AsyncWriteExt + Unpin),
    mut src: Source,
    len: u64,
    max_write: usize,
    rng: &mut Rng,
) -> Result<()> {
    let mut buf = vec![0u8; max_write.max(1)];
    let mut left = len;
    while left > 0 {
        let n = (rng.range(1, max_write.max(1) as u64)).min(left) as usize;
        src.next(&mut buf[..n]);
        w.write_all(&buf[..n])
            .await
            .with_context(|| format!("writing at offset {}", src.offset() - n as u64))?;
        left -= n as u64;
    }
    Ok(())
}

/// Read to EOF, checking every byte; EOF must come after exactly `len` bytes.
async fn receive(
    r: &mut (impl AsyncReadExt + Unpin),
    mut check: Checker,
    len: u64,
    slow: bool,
) -> Result<()> {
    let mut buf = vec![0u8; 256 << 10];
    let mut next_pause = SLOW_EVERY;
    loop {
        let n = r
            .read(&mut buf)
            .await
            .with_context(|| format!("reading at offset {}", check.offset()))?;
        if n == 0 {
            break;
        }
        if let Err(m) = check.check(&buf[..n]) {
            let i = (m.at - (check.offset())) as usize;
            let shown = &buf[i.min(n)..n.min(i + 48)];
            return Err(anyhow::Error::new(m).context(format!(
                "read of {n} bytes; from the mismatch on: {:?}",
                String::from_utf8_lossy(shown)
            )));
        }
        if check.offset() > len {
            bail!(
                "{} bytes arrived, {len} were sent (the last read ended at {})",
                check.offset(),
                check.offset()
            );
        }
        if slow && check.offset() >= next_pause {
            next_pause += SLOW_EVERY;
            tokio::time::sleep(SLOW_PAUSE).await;
        }
    }
    if check.offset() != len {
        bail!("EOF after {} of {len} bytes", check.offset());
    }
    Ok(())
}

/// Run one tunnel through the proxy at `proxy` to the upstream on `port`; checks what the client
/// receives (the upstream's own check arrives on its channel).
pub async fn run_tunnel(proxy: SocketAddr, port: u16, plan: Plan) -> Result<()> {
    let mut s = TcpStream::connect(proxy)
        .await
        .context("connecting to the proxy")?;
    s.set_nodelay(true).ok();
    let head = format!("CONNECT {NAME}:{port} HTTP/1.1\r\nHost: {NAME}:{port}\r\n\r\n");
    s.write_all(head.as_bytes()).await?;
    // Read the answer byte by byte up to its blank line: nothing after it may be consumed here.
    let mut answer = Vec::new();
    while !answer.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        if s.read(&mut b).await? == 0 {
            bail!("the proxy closed before answering CONNECT");
        }
        answer.push(b[0]);
        if answer.len() > 4096 {
            bail!("CONNECT answer too long");
        }
    }
    if !answer.starts_with(b"HTTP/1.1 200") {
        bail!(
            "CONNECT refused: {}",
            String::from_utf8_lossy(&answer[..answer.len().min(80)])
        );
    }
    let (mut r, mut w) = s.into_split();
    let mut head = MAGIC.to_vec();
    for v in [plan.seed, plan.up, plan.down] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    w.write_all(&head).await?;
    let mut rng = Rng::new(plan.seed ^ 0x1234);
    let max_write = plan.max_write;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let sender = tokio::spawn(async move {
        send(
            &mut w,
            Source::new(plan.seed ^ UP),
            plan.up,
            max_write,
            &mut rng,
        )
        .await?;
        if plan.hold_open {
            done_rx.await.ok();
        }
        w.shutdown().await.context("half-closing")?;
        Ok::<_, anyhow::Error>(w)
    });
    let received = receive(&mut r, Checker::new(plan.seed ^ DOWN), plan.down, plan.slow).await;
    done_tx.send(()).ok();
    match (received, sender.await) {
        (Err(e), _) => Err(e.context("client receiving")),
        (Ok(()), Err(e)) => Err(anyhow::anyhow!("client sender panicked: {e}")),
        (Ok(()), Ok(Err(e))) => Err(e.context("client sending")),
        (Ok(()), Ok(Ok(_))) => Ok(()),
    }
}

/// A proxy of the agent's, in this process on its own runtime thread (the daemon's shape: one
/// worker), with the kernel relay on and tunnels spliced after `after_reads` reads.
pub struct Proxy {
    pub addr: SocketAddr,
    pub relay: Arc<egress_agent::proxy::splice::KernelRelay>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Start it; `dir` holds its config and hosts file; `port` is the upstream's; `cpu`: pin
    /// its runtime to that CPU (the daemon's shape under load: the proxy on one CPU, the
    /// kernel's receive work for its peers on another).
    pub fn start(dir: &Path, port: u16, after_reads: u64, cpu: Option<usize>) -> Result<Proxy> {
        std::fs::create_dir_all(dir)?;
        let hosts = dir.join("hosts");
        std::fs::write(&hosts, format!("127.0.0.1 {NAME}\n"))?;
        let cfg = dir.join(format!("relay-{after_reads}.toml"));
        std::fs::write(
            &cfg,
            format!(
                r#"[agent]
default_policy = "check"
[proxy]
max_connections = 4096
max_connections_per_listener = 4096
idle_timeout_ms = 120000
kernel_relay = "on"
kernel_relay_after_reads = {after_reads}
[dns]
nameservers = []
hosts_file = "{hosts}"
[policies.check]
mode = "allowlist"
allow_hosts = ["{NAME}"]
allow_ports = [{port}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{port}] }}]
"#,
                hosts = hosts.display()
            ),
        )?;
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let started = addr_tx.clone();
            if let Some(c) = cpu {
                pin_to_cpu(c);
            }
            let r = (move || -> Result<()> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .on_thread_start(move || {
                        if let Some(c) = cpu {
                            pin_to_cpu(c);
                        }
                    })
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let config = Arc::new(egress_agent::config::Config::load(&cfg)?);
                    let ctx = egress_agent::proxy::ProxyContext::new(
                        &config,
                        egress_agent::events::EventSink::default(),
                    )?
                    .admit_any_peer();
                    let relay = ctx
                        .kernel_relay()
                        .cloned()
                        .context("proxy.kernel_relay = \"on\" but no relay")?;
                    let server = egress_agent::proxy::serve(config, ctx, async move {
                        stopped.await.ok();
                    })
                    .await?;
                    let addr = *server
                        .addrs()
                        .get("check")
                        .context("no listener for policy check")?;
                    started.send(Ok((addr, relay))).ok();
                    server.join().await;
                    Ok(())
                })
            })();
            if let Err(e) = r {
                addr_tx.send(Err(e)).ok();
            }
        });
        let (addr, relay) = addr_rx
            .recv_timeout(Duration::from_secs(30))
            .context("the proxy did not start")??;
        Ok(Proxy {
            addr,
            relay,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            s.send(()).ok();
        }
        if let Some(t) = self.thread.take() {
            t.join().ok();
        }
    }
}

/// Pin the calling thread to `cpu` (best effort: a failure leaves it unpinned).
pub fn pin_to_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).ok();
    }
}

/// Two CPUs to keep the proxy apart from its clients and upstreams, when the machine has them.
pub fn two_cpus() -> Option<(usize, usize)> {
    (std::thread::available_parallelism().map_or(1, usize::from) >= 2).then_some((0, 1))
}
