//! What every runtime starts from: the agent's host-wide options, the proxy address, the
//! programs at the runtime's enforcement root, a proxy context and an [`Enforcer`]
//! ([`enforcer_at`]); the metrics kept from the workloads' state ([`kernel_gauges`]).
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::directory::Directory;
use super::enforce::{Enforcer, Settings};
use super::host_layer::HostTables;
use super::root::WorkloadRoot;
use crate::bpf;
use crate::cgroup;
use crate::config::Config;
use crate::events::EventSink;
use crate::netif;
use crate::proxy::ProxyContext;
use tokio_util::sync::CancellationToken;

/// The agent's host-wide settings and shared state, the same for every runtime.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// Maintain the nftables host layer.
    pub nft: bool,
    /// Refuse to run without the BPF-LSM socket hook (AF_PACKET hole otherwise).
    pub require_lsm: bool,
    /// cgroup id → container, filled by the enforcer (clone it before starting a runtime):
    /// how the agent core names the container of a kernel event.
    pub directory: Directory,
    /// The agent's nftables tables, shared with its other runtimes (clone it likewise).
    pub tables: Arc<HostTables>,
    /// The agent's sockets: workloads' listeners are taken from a previous agent and offered to
    /// a successor through them (shared by every runtime).
    pub sockets: Arc<crate::handover::Sockets>,
    /// Whether TLS interception can be set up, as every runtime's proxy finds (what `status`
    /// shows; shared likewise).
    pub intercept: crate::proxy::tls::InterceptHealth,
    /// The workloads holding a real key, kept by every runtime's enforcer (what `status` shows;
    /// shared likewise).
    pub holders: crate::exposure::Holders,
    /// Workloads' access requests (`egress.internal`): the daemon's, decided through its API;
    /// `None` (standalone `exec`) answers that nobody can decide them.
    pub asks: Option<Arc<crate::asks::Asks>>,
    /// A command under `exec` while a daemon answers: its requests go there.
    pub remote_asks: Option<Arc<crate::asks::remote::Remote>>,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            nft: true,
            require_lsm: false,
            directory: Directory::default(),
            tables: Arc::default(),
            sockets: crate::handover::Sockets::new(),
            intercept: crate::proxy::tls::InterceptHealth::default(),
            holders: crate::exposure::Holders::default(),
            asks: None,
            remote_asks: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "proxy.endpoint {0} can't be used for containers or pods: they need a non-loopback IPv4 endpoint reachable from every network (e.g. 169.254.100.1:3128)"
    )]
    Endpoint(SocketAddr),
    #[error(transparent)]
    Netif(#[from] netif::NetifError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("creating the enforcement root {path}: {source}")]
    Root {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Bpf(#[from] bpf::BpfError),
    #[error("proxy: {0}")]
    Proxy(String),
    #[error(transparent)]
    Nft(#[from] crate::nft::NftError),
    /// Not a `#[source]`: the cause is in the message already (`{:#}` would repeat it).
    #[error("the nftables host layer could not be set up: {0}")]
    HostLayer(super::enforce::EnforceError),
    #[error(
        "the agent runs under its own enforcement root and its cgroup could not be exempted: {0}"
    )]
    SelfEntry(String),
}

/// How the daemon talks to a running runtime (`docker::serve_with`, `containerd::serve`).
#[derive(Default)]
pub struct Hooks {
    /// Told once the programs are loaded or adopted, the proxy address is up and the enforcer
    /// is ready (before Docker is reached: a Docker outage must not delay enforcement).
    pub ready: Option<tokio::sync::oneshot::Sender<serde_json::Value>>,
    /// Configuration reloads.
    pub reload: Option<tokio::sync::mpsc::Receiver<super::ReloadRequest>>,
    /// Kept up to date: enforced containers, kernel event losses.
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
}

/// Where a runtime's workloads live and how they are guarded.
pub struct Site {
    /// The enforcement root (Docker's cgroup parent, or the kubelet's `/kubepods`).
    pub root: WorkloadRoot,
    /// The agent's host-wide settings and shared state (see [`HostOptions`]).
    pub host: HostOptions,
    /// This runtime's name (in the nftables tables, events and `status`).
    pub runtime: &'static str,
}

impl Site {
    /// `runtime`'s workloads under `root`, with the agent's host-wide `host` options.
    pub fn new(root: WorkloadRoot, host: HostOptions, runtime: &'static str) -> Site {
        Site {
            root,
            host,
            runtime,
        }
    }
}

/// The enforcement every runtime starts from: the proxy address, the programs at `site.root`
/// (loaded or adopted), the kernel redirect maps, a proxy context and an [`Enforcer`] whose host
/// layer protects the proxy address. Returns it with the readiness report.
pub async fn enforcer_at(
    config: &Arc<Config>,
    site: Site,
    events: &EventSink,
    metrics: Option<&Arc<crate::metrics::Metrics>>,
    shutdown: &crate::agent::Stop,
) -> Result<(Enforcer, serde_json::Value), ServeError> {
    let endpoint4 = proxy_endpoint(config)?;
    netif::ensure(*endpoint4.ip())?;
    let root_path = site.root.ensure().map_err(|source| ServeError::Root {
        path: site.root.path(),
        source,
    })?;
    let enforcement = bpf::enforce_root(&config.agent.bpffs, &root_path, site.host.require_lsm)?;
    if let Some(why) = &enforcement.report.lsm_unavailable {
        tracing::warn!(reason = %why, "BPF-LSM socket hook unavailable: AF_PACKET is stopped only by the nftables layer");
    }
    for why in &enforcement.report.upgrade_failed {
        tracing::warn!("{why}");
    }
    tracing::info!(root = %root_path.display(), adopted = ?enforcement.report.adopted,
        upgraded = ?enforcement.report.upgraded, attached = ?enforcement.report.attached,
        "enforcement root ready");
    // `enforce_root` already released the loader lock; the links stay pinned and enforcing.
    let enforcement_lsm = enforcement
        .report
        .lsm_unavailable
        .as_ref()
        .map(|w| w.to_string());
    let bpf::Enforcement { state, .. } = enforcement;
    let addresses = Addresses {
        endpoint4: Some(endpoint4),
        listen: vec![config.proxy.listen.unwrap_or(IpAddr::V4(*endpoint4.ip()))],
    };
    // Without the LSM hook, AF_PACKET frames of a container the agent has not classified yet
    // are stopped only by the L2 guard on Docker's bridges.
    let l2_guard = site.host.nft && enforcement_lsm.is_some();
    let mut enforcer = enforcer_on(
        config, site, state, addresses, l2_guard, events, metrics, shutdown,
    )?;
    // Before anything dials out: the agent's own cgroup, if under the root, must not be
    // refused as an unclassified workload.
    enforcer.exempt_self().map_err(ServeError::SelfEntry)?;
    // Before READY: without the host layer the proxy address is reachable from the LAN.
    enforcer.init().await.map_err(ServeError::HostLayer)?;
    let info = serde_json::json!({
        "root": root_path.display().to_string(),
        "endpoint": endpoint4.to_string(),
        "lsm": enforcement_lsm.is_none(),
        "lsm_unavailable": enforcement_lsm,
    });
    Ok((enforcer, info))
}

/// Where a runtime's workloads reach the proxy and where their listeners bind.
pub struct Addresses {
    /// The IPv4 endpoint (`None`: an IPv6-only `proxy.endpoint`, possible under `exec`).
    pub endpoint4: Option<std::net::SocketAddrV4>,
    /// One listener socket per address, port 0.
    pub listen: Vec<IpAddr>,
}

impl Addresses {
    /// A command under `exec` shares the host's network: the endpoint may be loopback or
    /// IPv6, and its listener also binds `proxy.endpoint_v6`'s address (containers' entries
    /// refuse `endpoint_v6` instead). A non-loopback proxy address (the Docker-style
    /// 169.254.100.1) lives on the agent's interface, set up here as the daemon does.
    pub fn sharing_host_network(config: &Config) -> Result<Addresses, ServeError> {
        let listen_ip = config.proxy.listen_ip();
        if let IpAddr::V4(ip) = listen_ip
            && !ip.is_loopback()
        {
            netif::ensure(ip)?;
        }
        let mut listen = vec![listen_ip];
        listen.extend(config.proxy.endpoint_v6.map(|e| e.ip()));
        Ok(Addresses {
            endpoint4: match config.proxy.endpoint {
                SocketAddr::V4(e) => Some(e),
                SocketAddr::V6(_) => None,
            },
            listen,
        })
    }
}

/// An [`Enforcer`] for the workloads under `site.root`, whose programs are attached and whose
/// pinned maps are `state`: the kernel redirect maps, the direct-port sink, the proxy context
/// and the settings every runtime shares. The daemon's runtimes come through [`enforcer_at`];
/// `exec` calls this directly (it reports the programs' state on its own terminal, and its
/// own cgroup is never under its root).
#[expect(
    clippy::too_many_arguments,
    reason = "two call sites; each is a distinct input"
)]
pub fn enforcer_on(
    config: &Arc<Config>,
    site: Site,
    state: bpf::PinnedState,
    addresses: Addresses,
    l2_guard: bool,
    events: &EventSink,
    metrics: Option<&Arc<crate::metrics::Metrics>>,
    shutdown: &crate::agent::Stop,
) -> Result<Enforcer, ServeError> {
    // Transparent interception and DNS: original destinations and DNS-answer allowances live in
    // the pinned maps the programs just attached read.
    let redirects = Arc::new(bpf::redirects::KernelRedirects::open(&config.agent.bpffs)?);
    let mut hooks_in = crate::proxy::InterceptHooks::kernel(&redirects);
    // Direct ports (`{ host, ports }`): the nftables layer forwards a container's traffic only
    // where its rules say, so a DNS answer opens the addresses in the host layer's direct set
    // first, then in the kernel (workload::direct).
    let direct = Arc::new(super::direct::DirectPorts::new(
        redirects.clone(),
        site.host.nft.then(|| site.host.tables.direct()),
    ));
    hooks_in.answers = direct.clone();
    let mut ctx = ProxyContext::new_reporting(config, events.clone(), site.host.intercept)
        .map_err(|e| ServeError::Proxy(e.to_string()))?
        .with_interception(hooks_in)
        .with_sockets(site.host.sockets);
    if let Some(m) = metrics {
        ctx = ctx.with_metrics(m.clone());
    }
    if let Some(a) = &site.host.asks {
        ctx = ctx.with_asks(a.clone());
    }
    if let Some(r) = &site.host.remote_asks {
        ctx = ctx.with_remote_asks(r.clone());
    }
    let settings = Settings {
        root: site.root,
        endpoint4: addresses.endpoint4,
        endpoint6: config.proxy.endpoint_v6,
        listen: addresses.listen,
        nft: site.host.nft,
        l2_guard,
        direct,
        tables: site.host.tables,
        holders: site.host.holders,
        runtime: site.runtime,
    };
    Ok(Enforcer::new(
        state,
        settings,
        config.clone(),
        ctx,
        events.clone(),
        site.host.directory,
        shutdown.child(),
    ))
}

/// The stable IPv4 endpoint containers reach the proxy at: not loopback, not unspecified.
pub(crate) fn proxy_endpoint(config: &Config) -> Result<std::net::SocketAddrV4, ServeError> {
    match config.proxy.endpoint {
        SocketAddr::V4(e) if !e.ip().is_loopback() && !e.ip().is_unspecified() => Ok(e),
        other => Err(ServeError::Endpoint(other)),
    }
}

/// How often the per-cgroup kernel counters are read for `event_drops{source="kernel"}`.
const LOSS_SAMPLE: Duration = Duration::from_secs(5);

/// Keep the metrics that come from the workloads' state up to date until `stop`, for every
/// runtime at once (one task per agent: two would count each kernel loss twice): enforced
/// containers and pods every second, with the per-pod series of pods gone dropped, and kernel
/// event losses every [`LOSS_SAMPLE`].
pub async fn kernel_gauges(
    bpffs: std::path::PathBuf,
    directory: Directory,
    metrics: Arc<crate::metrics::Metrics>,
    stop: CancellationToken,
) {
    let mut losses = LossTracker::default();
    let mut state: Option<bpf::PinnedState> = None;
    let mut next_sample = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        metrics.set_enforced_containers(directory.len() as u64);
        metrics.retain_pods(&directory.pods());
        let now = tokio::time::Instant::now();
        if now >= next_sample {
            next_sample = now + LOSS_SAMPLE;
            let lost = sample_lost(&bpffs, &mut state, &mut losses);
            if lost > 0 {
                metrics.event_drops(crate::metrics::DropSource::Kernel, lost);
            }
        }
    }
}

/// Read every cgroup's `events_lost` from the pinned counters (opening the maps on first use)
/// and return the increase since the last read. Errors are logged at debug and count nothing
/// (the next sample catches up).
fn sample_lost(
    bpffs: &std::path::Path,
    state: &mut Option<bpf::PinnedState>,
    losses: &mut LossTracker,
) -> u64 {
    if state.is_none() {
        match bpf::PinnedState::open(bpffs) {
            Ok(s) => *state = Some(s),
            Err(e) => {
                tracing::debug!(error = %e, "kernel counters unavailable");
                return 0;
            }
        }
    }
    let Some(st) = state.as_ref() else { return 0 };
    let mut now = Vec::new();
    for id in st.counter_ids() {
        match st.counters(id) {
            // A cgroup removed between listing and reading reads as zeros (see LossTracker).
            Ok(c) => now.push((id, c.events_lost)),
            Err(e) => {
                // Skip this sample whole rather than forget a cgroup and count it again later.
                tracing::debug!(cgroup_id = id, error = %e, "reading kernel counters");
                return 0;
            }
        }
    }
    losses.update(now)
}

/// Per-cgroup `events_lost` as last read. The summed value can go down (a removed cgroup's
/// counters are deleted), so increases are computed per cgroup: the first read is the baseline
/// (losses from before this process are not reported), a cgroup that appears later counts in
/// full, a counter that went down was recreated and counts from zero. Losses between the last
/// read and a cgroup's removal are missed.
#[derive(Debug, Default)]
struct LossTracker {
    last: std::collections::HashMap<u64, u64>,
    primed: bool,
}

impl LossTracker {
    fn update(&mut self, now: impl IntoIterator<Item = (u64, u64)>) -> u64 {
        let mut next = std::collections::HashMap::new();
        let mut added = 0u64;
        for (id, lost) in now {
            let delta = match self.last.get(&id) {
                Some(&prev) if lost >= prev => lost - prev,
                Some(_) => lost,
                None if self.primed => lost,
                None => 0,
            };
            added = added.saturating_add(delta);
            next.insert(id, lost);
        }
        self.last = next;
        self.primed = true;
        added
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_losses_are_counted_per_cgroup() {
        let mut t = LossTracker::default();
        // Losses from before the agent started are the baseline, not news.
        assert_eq!(t.update([(1, 5), (2, 0)]), 0);
        assert_eq!(t.update([(1, 5), (2, 3)]), 3);
        // Cgroup 1 removed (its counters deleted): the sum drops, nothing is subtracted.
        assert_eq!(t.update([(2, 4)]), 1);
        // A cgroup seen for the first time after the baseline counts in full.
        assert_eq!(t.update([(2, 4), (3, 2)]), 2);
        // A counter that went down was recreated: it counts from zero.
        assert_eq!(t.update([(2, 1), (3, 2)]), 1);
        assert_eq!(t.update([]), 0);
    }
}
