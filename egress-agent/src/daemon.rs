//! `egress-agent run`: the daemon.
//!
//! Start order (every step fails the start with a clear error; nothing runs half-configured):
//! root check → config load + validate → control API socket → Docker enforcement (programs
//! loaded or adopted at the Docker root, proxy address, nftables layer, watcher) → READY=1.
//! Then SIGHUP, `POST /v1/reload` or a change of `policies.d` (watched, see
//! [`crate::config::watch`]; `agent.watch_policies`) re-reads the config through one reload
//! ([`Daemon::reload`]): a bad file is refused and the running policy stays; SIGINT/SIGTERM stop
//! the daemon, leaving the pinned programs enforcing.
//!
//! Restarts and upgrades hand the sockets over ([`crate::handover`]): a daemon started while
//! another runs takes that one's sockets (before binding anything) and says it serves once every
//! runtime reconciled; SIGUSR2 makes the running daemon start that new copy of itself. A daemon
//! that handed over stops accepting, stops its tasks, drains its connections
//! (`agent.drain_timeout_s`) and exits.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use serde_json::{Value, json};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::{mpsc, oneshot},
};
use tracing::{error, info, warn};

use crate::{
    agent::Agent,
    api::{
        ApiError, BoxFuture, Control, ExplainQuery, ReplayBody, StoreQuery, backend,
        server::ApiServer,
    },
    bpf, check,
    config::Config,
    docker,
    events::EventSink,
    handover,
    manage::{Change, Who},
    metrics::{self, Metrics},
    notify, status,
    workload::{self, ReloadRequest},
};

/// The Docker runtime's options and the host-wide ones every runtime shares, as `run` takes them.
pub use crate::docker::DockerOptions;
pub use crate::workload::HostOptions;

/// Options of `egress-agent run`.

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub config: PathBuf,
    pub docker: DockerOptions,
    /// The host-wide settings and state every runtime shares.
    pub host: HostOptions,
    /// Run the Docker runtime (off with `--no-docker`, e.g. on a Kubernetes node).
    pub watch_docker: bool,
    pub api_socket: PathBuf,
    /// Serve Prometheus metrics here (loopback unless `metrics_allow_non_loopback`).
    pub metrics: Option<SocketAddr>,
    pub metrics_allow_non_loopback: bool,
    /// After a hand-over and its drain, wait for SIGTERM instead of exiting (`--stay-after-handover`).
    pub stay_after_handover: bool,
}

/// What asked for a reload (logged with its outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    Sighup,
    /// `POST /v1/reload` (`egress-agent reload`).
    Api,
    /// A policy change through the API (`manage::apply`), which reloads the files it wrote.
    Change,
    /// The policies directory changed on disk. A reload that would load what already runs
    /// (the control API's own write, seen again) applies nothing.
    Watch,
}

impl Trigger {
    fn name(self) -> &'static str {
        match self {
            Trigger::Sighup => "sighup",
            Trigger::Api => "api",
            Trigger::Change => "policy-change",
            Trigger::Watch => "policies.d",
        }
    }
}

struct Daemon {
    config_path: PathBuf,
    config: ArcSwap<Config>,
    events: EventSink,
    started: Instant,
    /// One per runtime (Docker, containerd): a reload is applied by every one.
    reload_tx: Vec<mpsc::Sender<ReloadRequest>>,
    /// Serialises reloads (SIGHUP and API at once).
    reload_lock: tokio::sync::Mutex<()>,
    /// What the enforcement task reported when it became ready (root, endpoint, LSM hook).
    ready: Value,
    /// For `explain --container` (the daemon's Docker socket).
    docker_socket: String,
    /// Whether the runtimes' proxies can set TLS interception up (for `status`).
    intercept: crate::proxy::tls::InterceptHealth,
    /// The runtimes' workloads holding a real key (for `status` and `doctor`).
    holders: crate::exposure::Holders,
    /// Refused reloads are counted here.
    metrics: Arc<Metrics>,
    /// The agent this one took over from, while it drains.
    previous: Option<Arc<handover::Previous>>,
    /// `POST /v1/restart`: asks the main loop to start a successor (as SIGUSR2); the answer is
    /// its pid or why not.
    restart_tx: mpsc::Sender<RestartReply>,
    /// The runtimes' workloads by cgroup: where each one's policy came from.
    directory: workload::Directory,
    /// Workloads' access requests (`egress.internal`) and the operator's decisions.
    asks: Arc<crate::asks::Asks>,
    /// Announces new requests to `[requests] webhook`.
    webhook: Arc<crate::asks::webhook::Webhook>,
}

impl Daemon {
    /// The one reload: SIGHUP, `POST /v1/reload` and the policies directory's watch.
    async fn reload(&self, trigger: Trigger) -> Result<Value, String> {
        let _guard = self.reload_lock.lock().await;
        self.reload_locked(trigger).await
    }

    /// A reload with `reload_lock` held (by [`Daemon::reload`], or by a policy change). All or
    /// nothing: the new configuration is loaded and validated whole, then applied, or refused
    /// (logged with its file:line:column: field, counted) and the running one stays.
    async fn reload_locked(&self, trigger: Trigger) -> Result<Value, String> {
        if let Err(e) = notify::reloading() {
            warn!(error = %e, "sd_notify RELOADING failed");
        }
        let result = self.reload_inner(trigger).await;
        let (config, trigger) = (self.config_path.display(), trigger.name());
        match &result {
            Ok(None) => {
                info!(%config, trigger, "configuration unchanged; nothing to apply")
            }
            Ok(Some(_)) => info!(%config, trigger, "configuration reloaded"),
            Err(e) => {
                self.metrics.reload_error();
                error!(%config, trigger, error = %e,
                    "configuration rejected; the running policy stays in force")
            }
        }
        if let Err(e) = notify::ready("enforcing") {
            warn!(error = %e, "sd_notify READY failed");
        }
        result.map(|v| v.unwrap_or_else(|| json!({ "reloaded": false, "unchanged": true })))
    }

    /// `Ok(None)`: a watched change that loads to the running configuration.
    async fn reload_inner(&self, trigger: Trigger) -> Result<Option<Value>, String> {
        let new = Config::load(&self.config_path).map_err(|e| e.to_string())?;
        if trigger == Trigger::Watch && new == **self.config.load() {
            return Ok(None);
        }
        if new.api != self.config.load().api {
            return Err("[api] changed: these settings take effect only on a restart (systemctl restart egress-agent); nothing was applied".to_owned());
        }
        if new.kubernetes.is_some() != self.config.load().kubernetes.is_some() {
            return Err("[kubernetes] added or removed: the containerd runtime starts or stops only on a restart (systemctl restart egress-agent); nothing was applied".to_owned());
        }
        let new = Arc::new(new);
        // Every runtime refuses the same settings (`restart_needed`), so a refusal comes from
        // the first and none applies it.
        for tx in &self.reload_tx {
            let (done_tx, done_rx) = oneshot::channel();
            tx.send(ReloadRequest {
                config: new.clone(),
                done: done_tx,
            })
            .await
            .map_err(|_| "the enforcement task is not running".to_owned())?;
            done_rx
                .await
                .map_err(|_| "the enforcement task stopped during the reload".to_owned())??;
        }
        self.asks.set_auto(new.requests.auto_approved());
        configure_webhook(&self.webhook, &new);
        let old = self.config.swap(new.clone());
        report_unavailable(&new, Some(&old), &self.events);
        Ok(Some(json!({
            "reloaded": true,
            "policies": new.policy_names().collect::<Vec<_>>(),
            "unavailable_bindings": unavailable_json(&new),
        })))
    }

    /// What `status` says about interception: whether it can be set up, and the credential
    /// bindings served without their secret (their hosts refused).
    fn interception_status(&self, config: &Config) -> Value {
        json!({
            "setup_error": self.intercept.error(),
            "bindings": config.policies.values().map(|p| p.credentials.len()).sum::<usize>(),
            "unavailable_bindings": unavailable_json(config),
        })
    }
}

fn unavailable_json(config: &Config) -> Value {
    config
        .unavailable_bindings()
        .iter()
        .map(crate::config::UnavailableBinding::to_json)
        .collect()
}

/// Say which credential bindings are kept without their secret (a lenient load: their hosts
/// are refused, `interception-unavailable`, every other host is served): a warning and an agent
/// event each; and, after a reload (`old`), which ones have their secret again.
fn report_unavailable(config: &Config, old: Option<&Config>, events: &EventSink) {
    let now = config.unavailable_bindings();
    for u in &now {
        warn!(policy = u.policy, binding = u.index, host = %u.binding.host, port = u.binding.port,
            source = %crate::config::source_label(&u.binding.source), error = %u.why,
            "credential binding unavailable: requests to its host are refused (interception-unavailable) until its secret loads (fix it, then reload); every other host is served");
        events.emit(u.event());
    }
    let Some(old) = old else { return };
    for u in old.unavailable_bindings() {
        let still = now.iter().any(|n| {
            n.policy == u.policy
                && n.binding.host == u.binding.host
                && n.binding.port == u.binding.port
        });
        let served = config.policy(u.policy).is_some_and(|p| {
            p.credentials
                .iter()
                .any(|b| b.host == u.binding.host && b.port == u.binding.port && b.secret.is_some())
        });
        if !still && served {
            info!(policy = u.policy, host = %u.binding.host, port = u.binding.port,
                "credential binding restored: its secret loaded, its host is intercepted again");
        }
    }
}

impl Control for Daemon {
    fn status(&self) -> Value {
        let config = self.config.load();
        let kernel = status::collect(&config.agent.bpffs)
            .map(|s| serde_json::to_value(s).unwrap_or(Value::Null))
            .unwrap_or_else(|e| json!({ "error": e.to_string() }));
        let previous = self
            .previous
            .as_ref()
            .filter(|p| p.pid() != 0)
            .map(|p| json!({ "pid": p.pid(), "draining_connections": p.draining() }));
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "previous_agent": previous,
            "config": self.config_path.display().to_string(),
            "uptime_s": self.started.elapsed().as_secs(),
            "proxy_endpoint": config.proxy.endpoint.to_string(),
            "docker": self.ready.get("docker"),
            "kubernetes": self.ready.get("kubernetes"),
            "events_total": self.events.total(),
            "interception": self.interception_status(&config),
            "workload_secrets": self.holders.list(),
            "kernel": kernel,
        })
    }

    fn containers(&self) -> Value {
        let mut rows = backend::containers(&self.config.load());
        for row in rows.as_array_mut().into_iter().flatten() {
            let entry = row["cgroup_id"]
                .as_u64()
                .and_then(|id| self.directory.get(id));
            if let Some(e) = entry {
                row["source"] = json!(e.source);
                // Its context labels (egress.run, egress.repo, a pod's namespace and name):
                // what the console's filter finds a run's workloads by.
                row["context"] = json!(e.context);
            }
        }
        rows
    }

    fn policies(&self) -> Value {
        check::effective_policies(&self.config.load())
    }

    fn events(&self, n: usize) -> Vec<Value> {
        self.events
            .recent(n)
            .into_iter()
            .filter_map(|e| serde_json::to_value(e).ok())
            .collect()
    }

    fn subscribe(&self) -> mpsc::Receiver<Value> {
        let mut rx = self.events.subscribe();
        let (tx, out) = mpsc::channel(256);
        // Per API connection (`events --follow`): it ends with the connection, which drops
        // `out` (the API ends its connections at the stop).
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    next = rx.recv() => next,
                    () = tx.closed() => return,
                };
                match next {
                    Ok(ev) => {
                        let Ok(v) = serde_json::to_value(ev) else {
                            continue;
                        };
                        if tx.send(v).await.is_err() {
                            return;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        if tx.send(json!({ "lagged": n })).await.is_err() {
                            return;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        out
    }

    fn reload(&self) -> BoxFuture<'_, Result<Value, String>> {
        Box::pin(Daemon::reload(self, Trigger::Api))
    }

    fn policy(&self, name: &str) -> Option<Value> {
        crate::manage::describe(&self.config_path, &self.config.load(), name)
    }

    fn defaults(&self) -> Result<Value, ApiError> {
        Ok(backend::defaults(&self.config_path, &self.config.load()))
    }

    fn export(&self) -> Result<crate::manage::bundle::Bundle, ApiError> {
        Ok(crate::manage::bundle::Bundle::export(&self.config.load()))
    }

    fn change(
        &self,
        change: Change,
        who: Who,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async move {
            // Changes and reloads one at a time: the files written are the files reloaded.
            let _guard = self.reload_lock.lock().await;
            let config = self.config.load_full();
            let in_use = backend::in_use(&config);
            if dry_run {
                return Ok(crate::manage::dry_run(&self.config_path, &change, &in_use)?);
            }
            let log = backend::StoreChangeLog {
                db: config.store.enabled.then(|| config.agent.store_path()),
            };
            let applied =
                crate::manage::apply(&self.config_path, &change, &who, &in_use, &log, || {
                    self.reload_locked(Trigger::Change)
                })
                .await?;
            Ok(applied)
        })
    }

    fn explain(&self, q: ExplainQuery) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(
            async move { backend::explain(&self.config.load_full(), &self.docker_socket, q).await },
        )
    }

    fn denials(&self, q: &StoreQuery) -> Result<Vec<Value>, ApiError> {
        backend::denials(&self.config.load(), q)
    }

    fn suggest(&self, q: &StoreQuery) -> Result<String, ApiError> {
        backend::suggest(&self.config.load(), q)
    }

    fn replay(&self, body: ReplayBody) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(backend::replay(self.config.load_full(), body))
    }

    fn changes(&self, n: usize) -> Result<Vec<Value>, ApiError> {
        backend::changes(&self.config.load(), n)
    }

    fn doctor(&self) -> BoxFuture<'_, Value> {
        Box::pin(async move {
            let config = self.config.load_full();
            let view = crate::doctor::interception::InterceptionView::from_status(
                &json!({ "interception": self.interception_status(&config) }),
            );
            let workloads = crate::doctor::workloads::WorkloadSecretsView::from_status(
                &json!({ "workload_secrets": self.holders.list() }),
            );
            backend::doctor(&config, &self.docker_socket, view, workloads).await
        })
    }

    fn requests(&self, pending_only: bool) -> Result<Value, ApiError> {
        Ok(serde_json::to_value(self.asks.list(pending_only)).unwrap_or(Value::Null))
    }

    fn request(
        &self,
        id: u64,
        wait: std::time::Duration,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async move {
            let v = self
                .asks
                .wait_decided(id, wait)
                .await
                .ok_or(crate::asks::AskError::NotFound(id))?;
            Ok(serde_json::to_value(v).unwrap_or(Value::Null))
        })
    }

    fn file_for_command(
        &self,
        pid: u32,
        req: crate::asks::commands::CommandRequest,
    ) -> Result<Value, ApiError> {
        let (workload, host) = (req.workload.clone(), req.request.host.clone());
        let f = self.asks.file_for_command(pid, req)?;
        info!(
            workload,
            host,
            request = f.id,
            existing = f.existing,
            "access request filed by an exec"
        );
        Ok(serde_json::json!({
            "id": f.id,
            "state": if f.auto_approved { "approved" } else { "pending" },
            "existing": f.existing,
        }))
    }

    fn decide(
        &self,
        id: u64,
        decision: crate::asks::Decision,
        who: Who,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async move {
            let config_path = self.config_path.clone();
            let config = self.config.load_full();
            backend::decide(
                &self.asks,
                id,
                decision,
                who,
                |change, who| self.change(change, who, dry_run),
                &config_path,
                &config,
                dry_run,
            )
            .await
        })
    }

    fn restart(&self) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            let stopping = || ApiError::new(503, "the daemon is stopping".to_owned());
            self.restart_tx.send(tx).await.map_err(|_| stopping())?;
            let new_pid = rx
                .await
                .map_err(|_| stopping())?
                .map_err(|e| ApiError::new(500, e))?;
            Ok(json!({ "pid": std::process::id(), "new_pid": new_pid }))
        })
    }
}

/// Reload on every change of `policies.d` (unless `agent.watch_policies = false`), a task of the
/// core. A directory that can't be watched is logged; SIGHUP still reloads.
fn watch_policies(agent: &mut Agent, daemon: &Arc<Daemon>) {
    let dir = crate::config::policies_dir::policies_dir(&daemon.config_path);
    if !daemon.config.load().agent.watch_policies {
        info!(dir = %dir.display(), "not watching the policies directory (agent.watch_policies = false); reload with SIGHUP");
        return;
    }
    let watch = match crate::config::watch::PolicyWatch::new(&dir) {
        Ok(w) => w,
        Err(e) => {
            warn!(dir = %dir.display(), error = %e,
                "cannot watch the policies directory; reload with SIGHUP after changing it");
            return;
        }
    };
    info!(dir = %dir.display(), exists = watch.watching_dir(),
        kubernetes = crate::config::policies_dir::kubernetes_managed(&dir),
        "watching the policies directory");
    let daemon = daemon.clone();
    agent.spawn("policy watch", |stop| {
        crate::config::watch::run(watch, stop.token().clone(), move |names| {
            let daemon = daemon.clone();
            async move {
                info!(changed = ?names, "the policies directory changed: reloading");
                // Logged and counted by reload(); a rejected file changes nothing.
                daemon.reload(Trigger::Watch).await.ok();
            }
        })
    });
}

/// Runs the daemon until SIGINT/SIGTERM.
/// The agent's own services are no workload's destination, whatever its allow_cidrs say: the
/// host layer drops enforced containers' packets to their ports (the kernel policy already
/// refuses them unless allow_cidrs cover the address; the console refuses confined peers it can
/// attribute).
fn reserve_agent_ports(opts: &RunOptions, config: &Config) {
    opts.host.tables.agent_services(
        config
            .api
            .ui_listen
            .iter()
            .chain(opts.metrics.iter())
            .map(SocketAddr::port),
    );
}

/// `[requests] webhook` from `config` on (a start, a reload): a URL that can't be read or a CA
/// file that can't be used leaves notifications off, said in the log (never the URL).
fn configure_webhook(webhook: &crate::asks::webhook::Webhook, config: &Config) {
    match webhook.configure(config.requests.webhook.as_ref()) {
        Ok(true) => info!("new access requests are announced to [requests] webhook"),
        Ok(false) => {}
        Err(e) => warn!(error = %e, "access requests are not announced: the webhook is unusable"),
    }
}

/// The access-request registry kept in `agent.state_dir` (what an earlier agent of this boot
/// left restored, [`crate::asks::Asks::keep_in`]) and the task announcing new requests
/// (`[requests] webhook`), both before the runtimes: every listener bound finds its workload's
/// requests and grants, and a request filed as soon as a proxy serves is announced.
fn start_asks(
    agent: &mut Agent,
    config: &Config,
    asks: &Arc<crate::asks::Asks>,
    metrics: &Arc<Metrics>,
) -> Arc<crate::asks::webhook::Webhook> {
    asks.keep_in(&config.agent.state_dir);
    let webhook = crate::asks::webhook::Webhook::new(Some(metrics.clone()));
    configure_webhook(&webhook, config);
    let (w, a) = (webhook.clone(), asks.clone());
    agent.spawn("webhook", |stop| w.run(a, stop.cancelled_owned()));
    webhook
}

pub async fn run(mut opts: RunOptions) -> Result<()> {
    // Workloads' access requests: filed through every runtime's proxies, decided here.
    let asks = Arc::clone(opts.host.asks.get_or_insert_with(crate::asks::Asks::new));
    bpf::loader::require_root()?;
    // What SIGUSR2 starts: the file this binary was started from, as it is then (an upgrade
    // installs the new build there first).
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut config = Arc::new(Config::load(&opts.config)?);
    info!(config = %opts.config.display(), policies = ?config.policy_names().collect::<Vec<_>>(),
        "configuration loaded");
    // A running agent hands its sockets over (a restart or an upgrade): take them before
    // binding anything.
    let handover_path = handover::socket_path(&config.agent.state_dir);
    let sockets = opts.host.sockets.clone();
    let (from_store, taking) = adopt_sockets(&opts, &handover_path, &sockets, &mut config).await?;
    let api = bind_api(&opts, &config, &sockets).await?;

    // The core: events, the durable store and exporters (taps on the sink, written off the hot
    // path), one stop for everything below.
    let metrics = Arc::new(Metrics::new());
    let mut agent = Agent::start(&config, Some(metrics.clone()))?;
    let events = agent.events().clone();
    report_unavailable(&config, None, &events);
    if let Some(addr) = opts.metrics {
        let (listener, held) =
            metrics::bind_handed(addr, opts.metrics_allow_non_loopback, &sockets)?;
        let m = metrics.clone();
        agent.spawn("metrics", |stop| async move {
            metrics::serve(listener, m, stop.cancelled_owned()).await;
            drop(held);
        });
    }

    let webhook = start_asks(&mut agent, &config, &asks, &metrics);
    reserve_agent_ports(&opts, &config);
    let mut runtimes = match start_runtimes(&opts, &config, &events, &metrics, &mut agent) {
        Ok(r) => r,
        Err(e) => {
            agent.shutdown().await;
            return Err(e);
        }
    };

    // READY once every runtime's programs are loaded/adopted and the proxy listens (or fail the
    // start with the failing runtime's own error).
    let ready = match runtimes.ready().await {
        Ok(ready) => ready,
        Err(why) => {
            agent.shutdown().await;
            return Err(why);
        }
    };
    info!(ready = %ready, "egress-agent enforcing");
    settle_start(&mut agent, &runtimes, &opts, from_store || taking.is_some()).await;
    let previous = match taking {
        Some(t) => confirm_take_over(&mut agent, t, &metrics).await,
        None => None,
    };
    spawn_workload_telemetry(&mut agent, &config, &opts.host.directory, &metrics);

    let (restart_tx, mut restart_rx) = mpsc::channel(1);
    let daemon = Arc::new(Daemon {
        asks: asks.configured(config.requests.auto_approved()),
        webhook,
        config_path: opts.config.clone(),
        config: ArcSwap::new(config),
        events,
        started: Instant::now(),
        reload_tx: runtimes.reload_senders(),
        reload_lock: tokio::sync::Mutex::new(()),
        ready,
        docker_socket: opts.docker.socket.clone(),
        intercept: opts.host.intercept.clone(),
        holders: opts.host.holders.clone(),
        metrics,
        previous,
        restart_tx,
        directory: opts.host.directory.clone(),
    });
    let control = daemon.clone();
    agent.spawn("api", |stop| api.run(control, stop.cancelled_owned()));
    watch_policies(&mut agent, &daemon);
    // The next agent takes this one's sockets here.
    let mut successor_rx = listen_for_successor(&mut agent, &handover_path, &sockets);
    if let Err(e) = notify::ready("enforcing") {
        warn!(error = %e, "sd_notify READY failed");
    }

    let mut signals = Signals::catch()?;
    let mut spawned: Option<std::process::Child> = None;
    let end = serve_until_end(
        &daemon,
        &exe,
        &mut signals,
        (&mut restart_rx, &mut successor_rx),
        &mut runtimes,
        &mut spawned,
    )
    .await;
    match end {
        End::Stop(result) => stop(agent, &handover_path, result).await,
        End::HandedOver(successor) => {
            let config = daemon.config.load_full();
            let stay = opts.stay_after_handover;
            handed_over(
                agent,
                &sockets,
                successor,
                &config,
                &mut signals,
                spawned,
                stay,
            )
            .await;
            Ok(())
        }
    }
}

/// After a hand-over: drain what this agent still carries, reap the successor's spawn record,
/// and with `--stay-after-handover` wait for SIGTERM (unless one came already).
async fn handed_over(
    agent: Agent,
    sockets: &Arc<handover::Sockets>,
    successor: handover::Successor,
    config: &Config,
    signals: &mut Signals,
    spawned: Option<std::process::Child>,
    stay: bool,
) {
    let stop_asked = drain(
        agent,
        sockets,
        successor,
        config,
        (&mut signals.term, &mut signals.int),
    )
    .await;
    reap(spawned);
    if stay && !stop_asked {
        info!("handed over and drained; waiting for SIGTERM (--stay-after-handover)");
        tokio::select! {
            _ = signals.term.recv() => {}
            _ = signals.int.recv() => {}
        }
    }
}

/// The daemon's stop (not a hand-over): no hand-over socket left behind, then the core's
/// ordered stop; the pinned programs keep enforcing.
async fn stop(agent: Agent, handover_path: &Path, result: Result<()>) -> Result<()> {
    std::fs::remove_file(handover_path).ok();
    info!("stopping; the pinned programs keep enforcing");
    if let Err(e) = notify::stopping() {
        warn!(error = %e, "sd_notify STOPPING failed");
    }
    agent.shutdown().await;
    info!("stopped: events recorded and exported");
    result
}

/// The control API on its socket (handed over or new), refusing clients confined under any
/// runtime's root, with `[api]`'s access and status page.
async fn bind_api(
    opts: &RunOptions,
    config: &Config,
    sockets: &Arc<handover::Sockets>,
) -> Result<ApiServer> {
    let docker_root = crate::cgroup::cgroup2_mount()
        .map(|m| workload::root::WorkloadRoot::new(m, &opts.docker.cgroup_parent).path());
    let api = ApiServer::bind_handed(&opts.api_socket, sockets)
        .await?
        .refusing_roots(docker_root.ok().into_iter().chain(kubelet_root(config)));
    Ok(crate::api::server::with_config(api, &config.api, &config.agent.state_dir).await?)
}

/// Take the sockets a previous agent left: those the service manager kept (a crash and its
/// restart), then a running agent's through the hand-over socket, with its `env` secrets (the
/// configuration is loaded again with them, before any binding is resolved for serving).
/// Returns whether the fd store had any, and the hand-over in progress.
async fn adopt_sockets(
    opts: &RunOptions,
    handover_path: &Path,
    sockets: &Arc<handover::Sockets>,
    config: &mut Arc<Config>,
) -> Result<(bool, Option<handover::Taking>)> {
    // Sockets systemd kept for this agent (a crash and its restart: the fd store).
    let stored = handover::fdstore::passed();
    let from_store = !stored.is_empty();
    if from_store {
        info!(
            sockets = stored.len(),
            "adopting the sockets the service manager kept (fd store)"
        );
        sockets.adopt(stored);
    }
    let mut taking = handover::take(handover_path).await?;
    if let Some(t) = &mut taking {
        let fds = t.sockets();
        info!(
            from_pid = t.from_pid,
            sockets = fds.len(),
            "taking over from the running agent"
        );
        sockets.adopt(fds);
        // Its `env` secrets (gone from the environment this process inherited), before any
        // binding is resolved for serving: nothing below serves a request until this config.
        let installed = t.install_env_secrets();
        if !installed.is_empty() {
            info!(variables = ?installed, "took the running agent's env secrets over");
            *config = Arc::new(Config::load(&opts.config)?);
        }
    }
    Ok((from_store, taking))
}

/// The runtimes (Docker; containerd when `[kubernetes]` is configured), on the core's stop,
/// sharing one directory for naming kernel events; the first to end stops the daemon. `Err`
/// when there is none to run.
fn start_runtimes(
    opts: &RunOptions,
    config: &Arc<Config>,
    events: &EventSink,
    metrics: &Arc<Metrics>,
    agent: &mut Agent,
) -> Result<Runtimes> {
    let mut runtimes = Runtimes::default();
    if opts.watch_docker {
        let (hooks, rt) = Runtimes::hooks(metrics);
        let (c, o, h, e) = (
            config.clone(),
            opts.docker.clone(),
            opts.host.clone(),
            events.clone(),
        );
        runtimes.add("docker", rt, agent, |stop| {
            docker::serve_with(c, o, h, e, hooks, stop)
        });
    }
    if let Some(k8s) = config.kubernetes.clone() {
        let (hooks, rt) = Runtimes::hooks(metrics);
        let (c, host, e) = (config.clone(), opts.host.clone(), events.clone());
        runtimes.add("kubernetes", rt, agent, |stop| {
            crate::containerd::serve(c, k8s, host, e, hooks, stop)
        });
    }
    if runtimes.is_empty() {
        anyhow::bail!(
            "nothing to enforce: --no-docker and no [kubernetes] section in {}; add one or drop --no-docker",
            opts.config.display()
        );
    }
    Ok(runtimes)
}

/// The hand-over socket the next agent (a restart, an upgrade) takes this one's sockets
/// through; the successor arrives on the returned channel.
fn listen_for_successor(
    agent: &mut Agent,
    handover_path: &Path,
    sockets: &Arc<handover::Sockets>,
) -> mpsc::Receiver<handover::Successor> {
    let (successor_tx, successor_rx) = mpsc::channel(1);
    match handover::Giver::listen(handover_path, sockets.clone()) {
        Ok(giver) => {
            info!(socket = %giver.path().display(), "hand-over socket listening");
            agent.spawn("hand-over", |stop| async move {
                tokio::select! {
                    s = giver.successor() => { successor_tx.send(s).await.ok(); }
                    () = stop.cancelled() => {}
                }
            });
        }
        Err(e) => warn!(socket = %handover_path.display(), error = %e,
            "no hand-over socket: a restart will bind new sockets (workloads see a short gap)"),
    }
    successor_rx
}

/// Finish taking over from the agent that handed its sockets to this one, once this one serves
/// them: tell it, and follow it until it has drained.
async fn confirm_take_over(
    agent: &mut Agent,
    taking: handover::Taking,
    metrics: &Arc<Metrics>,
) -> Option<Arc<handover::Previous>> {
    match take_over(taking).await {
        Ok(p) => {
            let (follow, m) = (p.clone(), metrics.clone());
            agent.spawn("previous agent", |stop| {
                follow_previous(follow, m, stop.token().clone())
            });
            Some(p)
        }
        Err(e) => {
            // This agent serves every socket already; the previous one may still serve
            // some too (it did not confirm), which is no gap.
            warn!(error = %e, "the previous agent did not confirm the hand-over");
            None
        }
    }
}

/// Gauges of what the runtimes enforce (one task for all of them), and kernel denials, both
/// named by the directory the runtimes keep.
fn spawn_workload_telemetry(
    agent: &mut Agent,
    config: &Config,
    directory: &workload::Directory,
    metrics: &Arc<Metrics>,
) {
    let (bpffs, gauged, m) = (
        config.agent.bpffs.clone(),
        directory.clone(),
        metrics.clone(),
    );
    agent.spawn("kernel gauges", |stop| {
        workload::site::kernel_gauges(bpffs, gauged, m, stop.token().clone())
    });
    let directory = directory.clone();
    match agent.pump_kernel_events(&config.agent.bpffs, move |d| directory.enrich(d)) {
        Ok(true) => {}
        Ok(false) => info!("another process consumes kernel events"),
        Err(e) => warn!(error = %e, "kernel events unavailable"),
    }
}

/// Where the API's restart hears the successor's pid (or why none started).
type RestartReply = oneshot::Sender<Result<u32, String>>;

/// The signals the daemon acts on, caught before it serves.
struct Signals {
    hup: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
}

impl Signals {
    fn catch() -> std::io::Result<Signals> {
        Ok(Signals {
            hup: signal(SignalKind::hangup())?,
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }
}

/// Serve until SIGTERM/SIGINT, a successor taking the sockets over, or a runtime ending:
/// SIGHUP reloads the configuration; SIGUSR2 (or the API's restart) starts a successor from
/// `exe` (kept in `spawned`).
async fn serve_until_end(
    daemon: &Daemon,
    exe: &Path,
    signals: &mut Signals,
    (restart, successor): (
        &mut mpsc::Receiver<RestartReply>,
        &mut mpsc::Receiver<handover::Successor>,
    ),
    runtimes: &mut Runtimes,
    spawned: &mut Option<std::process::Child>,
) -> End {
    loop {
        tokio::select! {
            _ = signals.hup.recv() => {
                info!("SIGHUP: reloading the configuration");
                // The outcome is logged and counted by reload(); a rejected file changes nothing.
                daemon.reload(Trigger::Sighup).await.ok();
            }
            _ = signals.usr2.recv() => {
                start_successor(exe, spawned).ok();
            }
            Some(reply) = restart.recv() => {
                reply.send(start_successor(exe, spawned)).ok();
            }
            Some(s) = successor.recv() => break End::HandedOver(s),
            _ = signals.term.recv() => break End::Stop(Ok(())),
            _ = signals.int.recv() => break End::Stop(Ok(())),
            why = runtimes.ended() => break End::Stop(Err(why)),
        }
    }
}

/// How the daemon's main loop ended.
enum End {
    Stop(Result<()>),
    HandedOver(handover::Successor),
}

/// Finish taking over from the agent that handed its sockets to this one (after
/// [`settle_adopted`]): tell it this one serves.
async fn take_over(
    taking: handover::Taking,
) -> Result<Arc<handover::Previous>, handover::TakeError> {
    let from_pid = taking.from_pid;
    let previous = taking.serving().await?;
    info!(
        from_pid,
        "took over from the running agent: it stopped accepting and drains"
    );
    Ok(previous)
}

/// Once every runtime reconciled: close the adopted sockets nothing claimed (`adopted`: taken
/// from a running agent or the fd store; the start waits for that) and drop the restored access
/// requests no workload took back (a task: a runtime that is down delays only that).
async fn settle_start(agent: &mut Agent, runtimes: &Runtimes, opts: &RunOptions, adopted: bool) {
    let host = &opts.host;
    if adopted {
        settle_adopted(&host.sockets, runtimes).await;
    }
    let Some(asks) = host.asks.clone() else {
        return;
    };
    let (sockets, names) = (host.sockets.clone(), runtimes.names());
    agent.spawn("asks-settle", |stop| async move {
        let reconciled = async {
            while !sockets
                .wait_reconciled(&names, handover::RECONCILE_WAIT)
                .await
                .is_empty()
            {}
        };
        tokio::select! {
            () = reconciled => { asks.forget_unclaimed(); }
            () = stop.cancelled() => {}
        }
    });
}

/// Sockets adopted (from a running agent or systemd's fd store): once every runtime reconciled
/// (each workload claimed its sockets) or [`handover::RECONCILE_WAIT`] passed, close what nothing
/// claimed.
async fn settle_adopted(sockets: &handover::Sockets, runtimes: &Runtimes) {
    let missing = sockets
        .wait_reconciled(&runtimes.names(), handover::RECONCILE_WAIT)
        .await;
    if !missing.is_empty() {
        warn!(runtimes = ?missing, wait = ?handover::RECONCILE_WAIT,
            "taking over before these runtimes reconciled: their workloads' handed-over sockets are closed and bound anew when they are");
    }
    let unclaimed = sockets.close_unclaimed();
    if !unclaimed.is_empty() {
        info!(sockets = ?unclaimed, "closed handed-over sockets nothing claimed (workloads gone or changed)");
    }
}

/// Keep `draining_connections` up to date until the previous agent exits.
async fn follow_previous(
    previous: Arc<handover::Previous>,
    metrics: Arc<Metrics>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        metrics.set_draining_connections(previous.draining());
        if previous.pid() == 0 {
            metrics.set_draining_connections(0);
            return;
        }
    }
}

/// SIGUSR2 or `POST /v1/restart`: start a new copy of this agent, which takes over (unless one
/// started already and still runs). `running` keeps the child; returns its pid.
fn start_successor(
    exe: &std::path::Path,
    running: &mut Option<std::process::Child>,
) -> Result<u32, String> {
    if let Some(c) = running.as_mut() {
        match c.try_wait() {
            Ok(None) => {
                warn!(
                    pid = c.id(),
                    "restart: a new agent is already starting; wait for it"
                );
                return Ok(c.id());
            }
            Ok(Some(status)) => {
                warn!(pid = c.id(), %status, "the previous restart's agent exited without taking over")
            }
            Err(e) => warn!(error = %e, "checking the previous restart's agent"),
        }
    }
    match handover::spawn_successor(exe) {
        Ok(c) => {
            let pid = c.id();
            info!(pid, exe = %exe.display(),
                "restart: started a new agent; it takes the sockets, then this one drains");
            *running = Some(c);
            Ok(pid)
        }
        Err(e) => {
            error!(exe = %exe.display(), error = %e, "restart: could not start a new agent; this one keeps serving");
            Err(format!(
                "could not start {}: {e}; this agent keeps serving",
                exe.display()
            ))
        }
    }
}

/// Don't leave the restart's child a zombie if it ends before this process.
fn reap(child: Option<std::process::Child>) {
    if let Some(mut c) = child {
        c.try_wait().ok();
    }
}

/// After a hand-over: stop accepting, stop every task (watchers, API, kernel event pump), tell
/// the successor, relay the open connections until they end or `agent.drain_timeout_s` (a
/// second SIGTERM/SIGINT cuts them at once), then record and export what is left. Returns
/// whether a stop was asked meanwhile.
async fn drain(
    mut agent: Agent,
    sockets: &Arc<handover::Sockets>,
    successor: handover::Successor,
    config: &Config,
    (term, int): (
        &mut tokio::signal::unix::Signal,
        &mut tokio::signal::unix::Signal,
    ),
) -> bool {
    sockets.hand_over();
    if std::env::var_os("NOTIFY_SOCKET").is_some()
        && let Err(e) = notify::main_pid(successor.pid)
    {
        warn!(error = %e, "sd_notify MAINPID failed");
    }
    agent.stop_tasks().await;
    if let Err(e) = successor.released().await {
        warn!(error = %e, "telling the new agent that this one let go");
    }
    let deadline = config.agent.drain_timeout();
    info!(successor = successor.pid, connections = sockets.open(), deadline = ?deadline,
        "handed over: no longer accepting; draining the open connections");
    let drained = sockets.drain(deadline, std::time::Duration::from_secs(1), |n| {
        successor.draining(n).ok();
    });
    tokio::pin!(drained);
    let mut asked = false;
    let left = loop {
        tokio::select! {
            left = &mut drained => break left,
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        if asked {
            break sockets.open();
        }
        asked = true;
        info!(
            connections = sockets.open(),
            "stop requested while draining: the connections go on until they end or the deadline; stop again to cut them"
        );
    };
    if left > 0 {
        warn!(
            connections = left,
            "drain over: cutting the connections still open"
        );
    }
    sockets.cut();
    // The cut connections record their ends before the store and exporters are flushed.
    sockets
        .drain(
            std::time::Duration::from_secs(2),
            std::time::Duration::from_secs(1),
            |_| {},
        )
        .await;
    agent.shutdown().await;
    info!(left, "drained; exiting");
    asked
}

/// The kubelet's cgroup root (`[kubernetes] cgroup_root`), whose pods may not use the API.
fn kubelet_root(config: &Config) -> Option<PathBuf> {
    let k = config.kubernetes.as_ref()?;
    let mount = crate::cgroup::cgroup2_mount().ok()?;
    Some(mount.join(k.cgroup_root.trim_start_matches('/')))
}

/// The runtimes the daemon runs, each a task of the agent core.
#[derive(Default)]
struct Runtimes {
    list: Vec<Runtime>,
}

struct Runtime {
    name: &'static str,
    reload: mpsc::Sender<ReloadRequest>,
    ready: Option<oneshot::Receiver<Value>>,
    ended: Option<oneshot::Receiver<Result<(), workload::ServeError>>>,
}

/// The daemon's ends of one runtime's hooks.
struct RuntimeEnds {
    reload: mpsc::Sender<ReloadRequest>,
    ready: oneshot::Receiver<Value>,
}

impl Runtimes {
    fn hooks(metrics: &Arc<Metrics>) -> (workload::Hooks, RuntimeEnds) {
        let (reload_tx, reload_rx) = mpsc::channel(1);
        let (ready_tx, ready_rx) = oneshot::channel();
        (
            workload::Hooks {
                ready: Some(ready_tx),
                reload: Some(reload_rx),
                metrics: Some(metrics.clone()),
            },
            RuntimeEnds {
                reload: reload_tx,
                ready: ready_rx,
            },
        )
    }

    fn add<F, Fut>(&mut self, name: &'static str, ends: RuntimeEnds, agent: &mut Agent, serve: F)
    where
        F: FnOnce(crate::agent::Stop) -> Fut,
        Fut: std::future::Future<Output = Result<(), workload::ServeError>> + Send + 'static,
    {
        let (ended_tx, ended_rx) = oneshot::channel();
        agent.spawn(name, |stop| {
            let fut = serve(stop);
            async move {
                ended_tx.send(fut.await).ok();
            }
        });
        self.list.push(Runtime {
            name,
            reload: ends.reload,
            ready: Some(ends.ready),
            ended: Some(ended_rx),
        });
    }

    fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The runtimes' names, as they report their reconciles.
    fn names(&self) -> Vec<&'static str> {
        self.list.iter().map(|r| r.name).collect()
    }

    fn reload_senders(&self) -> Vec<mpsc::Sender<ReloadRequest>> {
        self.list.iter().map(|r| r.reload.clone()).collect()
    }

    /// Every runtime's readiness report, by name; the first failure's own error otherwise (the
    /// readiness sender is dropped when a runtime fails).
    async fn ready(&mut self) -> Result<Value, anyhow::Error> {
        let mut out = serde_json::Map::new();
        for r in &mut self.list {
            let Some(rx) = r.ready.take() else { continue };
            match rx.await {
                Ok(info) => {
                    out.insert(r.name.to_owned(), info);
                }
                Err(_) => {
                    let ended = r.ended.take();
                    return Err(match ended {
                        Some(e) => ended_error(r.name, e.await),
                        None => anyhow::anyhow!("the {} runtime ended before it was ready", r.name),
                    });
                }
            }
        }
        Ok(Value::Object(out))
    }

    /// Wait until a runtime ends (it should not before the stop) and say why.
    async fn ended(&mut self) -> anyhow::Error {
        let waits: Vec<_> = self
            .list
            .iter_mut()
            .filter_map(|r| {
                let name = r.name;
                r.ended
                    .as_mut()
                    .map(|rx| Box::pin(async move { (name, rx.await) }))
            })
            .collect();
        if waits.is_empty() {
            return std::future::pending().await;
        }
        let ((name, r), _, _) = futures_util::future::select_all(waits).await;
        ended_error(name, r)
    }
}

fn ended_error(
    name: &str,
    r: Result<Result<(), workload::ServeError>, oneshot::error::RecvError>,
) -> anyhow::Error {
    match r {
        Ok(Ok(())) => anyhow::anyhow!("the {name} enforcement task stopped"),
        Ok(Err(e)) => anyhow::Error::new(e).context(format!("{name} enforcement failed")),
        Err(_) => anyhow::anyhow!("the {name} enforcement task panicked"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A start that fails before READY reports the enforcement task's own error (with the
    /// fix), not the readiness channel closing.
    #[tokio::test]
    async fn a_failed_start_names_its_cause() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: needs root (daemon start error)");
            return;
        }
        let dir = crate::test_dir::fresh("daemon-start");
        std::fs::create_dir_all(&dir).expect("dir");
        let config = dir.join("config.toml");
        std::fs::write(&config, "[proxy]\nendpoint = \"127.0.0.1:3128\"\n").expect("config");
        let opts = RunOptions {
            config,
            docker: DockerOptions::default(),
            host: HostOptions::default(),
            watch_docker: true,
            api_socket: dir.join("api.sock"),
            metrics: None,
            metrics_allow_non_loopback: false,
            stay_after_handover: false,
        };
        let err = format!(
            "{:#}",
            run(opts).await.expect_err("loopback endpoint accepted")
        );
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            err.contains("127.0.0.1:3128 can't be used for containers or pods")
                && err.contains("169.254.100.1"),
            "{err}"
        );
        assert!(!err.contains("channel closed"), "{err}");
    }
}
