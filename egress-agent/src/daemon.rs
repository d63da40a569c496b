//! `egress-agent run`: the daemon.
//!
//! Start order (every step fails the start with a clear error; nothing runs half-configured):
//! root check → config load + validate → control API socket → Docker enforcement (programs
//! loaded or adopted at the Docker root, proxy address, nftables layer, watcher) → READY=1.
//! Then SIGHUP, `POST /v1/reload` or a change of `policies.d` (watched, see
//! [`crate::config::watch`]; `agent.watch_policies`) re-reads the config through one reload
//! ([`Daemon::reload`]): a bad file is refused and the running policy stays; SIGINT/SIGTERM stop
//! the daemon, leaving the pinned programs enforcing.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Instant};

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
    api::{ApiError, BoxFuture, Control, ExplainQuery, StoreQuery, backend, server::ApiServer},
    bpf, check,
    config::Config,
    docker::{self, DockerOptions, ReloadRequest},
    events::EventSink,
    manage::{Change, Who},
    metrics::{self, Metrics},
    notify, status,
};

/// Options of `egress-agent run`.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub config: PathBuf,
    pub docker: DockerOptions,
    /// Run the Docker runtime (off with `--no-docker`, e.g. on a Kubernetes node).
    pub watch_docker: bool,
    pub api_socket: PathBuf,
    /// Serve Prometheus metrics here (loopback unless `metrics_allow_non_loopback`).
    pub metrics: Option<SocketAddr>,
    pub metrics_allow_non_loopback: bool,
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
    /// Refused reloads are counted here.
    metrics: Arc<Metrics>,
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
        self.config.store(new.clone());
        Ok(Some(
            json!({ "reloaded": true, "policies": new.policy_names().collect::<Vec<_>>() }),
        ))
    }
}

impl Control for Daemon {
    fn status(&self) -> Value {
        let config = self.config.load();
        let kernel = status::collect(&config.agent.bpffs)
            .map(|s| serde_json::to_value(s).unwrap_or(Value::Null))
            .unwrap_or_else(|e| json!({ "error": e.to_string() }));
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "config": self.config_path.display().to_string(),
            "uptime_s": self.started.elapsed().as_secs(),
            "proxy_endpoint": config.proxy.endpoint.to_string(),
            "docker": self.ready.get("docker"),
            "kubernetes": self.ready.get("kubernetes"),
            "events_total": self.events.total(),
            "kernel": kernel,
        })
    }

    fn containers(&self) -> Value {
        backend::containers(&self.config.load())
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
        tokio::spawn(async move {
            loop {
                match rx.recv().await {
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

    fn changes(&self, n: usize) -> Result<Vec<Value>, ApiError> {
        backend::changes(&self.config.load(), n)
    }

    fn doctor(&self) -> BoxFuture<'_, Value> {
        Box::pin(
            async move { backend::doctor(&self.config.load_full(), &self.docker_socket).await },
        )
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
        crate::config::watch::run(watch, stop, move |names| {
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
pub async fn run(opts: RunOptions) -> Result<()> {
    bpf::loader::require_root()?;
    let config = Arc::new(Config::load(&opts.config)?);
    info!(config = %opts.config.display(), policies = ?config.policy_names().collect::<Vec<_>>(),
        "configuration loaded");
    let docker_root = crate::cgroup::cgroup2_mount()
        .map(|m| docker::cgroups::DockerRoot::new(m, &opts.docker.cgroup_parent).path());
    let api = ApiServer::bind(&opts.api_socket)
        .await?
        .refusing_roots(docker_root.ok().into_iter().chain(kubelet_root(&config)));
    let api = crate::api::server::with_config(api, &config.api).await?;

    // The core: events, the durable store and exporters (taps on the sink, written off the hot
    // path), one stop for everything below.
    let metrics = Arc::new(Metrics::new());
    let mut agent = Agent::start(&config, Some(metrics.clone()))?;
    let events = agent.events().clone();
    if let Some(addr) = opts.metrics {
        let listener = metrics::bind(addr, opts.metrics_allow_non_loopback)
            .await
            .with_context(|| format!("metrics listener on {addr}"))?;
        let m = metrics.clone();
        agent.spawn("metrics", |stop| {
            metrics::serve(listener, m, stop.cancelled_owned())
        });
    }

    // The runtimes (Docker; containerd when `[kubernetes]` is configured), on the core's stop,
    // sharing one directory for naming kernel events; the first to end stops the daemon.
    let mut runtimes = Runtimes::default();
    if opts.watch_docker {
        let (hooks, rt) = Runtimes::hooks(&metrics);
        let (c, o, e) = (config.clone(), opts.docker.clone(), events.clone());
        runtimes.add("docker", rt, &mut agent, |stop| {
            docker::serve_with(c, o, e, hooks, stop)
        });
    }
    if let Some(k8s) = config.kubernetes.clone() {
        let (hooks, rt) = Runtimes::hooks(&metrics);
        let (c, host, e) = (config.clone(), opts.docker.clone(), events.clone());
        runtimes.add("kubernetes", rt, &mut agent, |stop| {
            crate::containerd::serve(c, k8s, host, e, hooks, stop)
        });
    }
    if runtimes.is_empty() {
        agent.shutdown().await;
        anyhow::bail!(
            "nothing to enforce: --no-docker and no [kubernetes] section in {}; add one or drop --no-docker",
            opts.config.display()
        );
    }

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
    // Gauges of what the runtimes enforce (one task for all of them), and kernel denials,
    // both named by the directory the runtimes keep.
    let (bpffs, directory, m) = (
        config.agent.bpffs.clone(),
        opts.docker.directory.clone(),
        metrics.clone(),
    );
    agent.spawn("kernel gauges", |stop| {
        docker::serve::kernel_gauges(bpffs, directory, m, stop)
    });
    let directory = opts.docker.directory.clone();
    match agent.pump_kernel_events(&config.agent.bpffs, move |d| directory.enrich(d)) {
        Ok(true) => {}
        Ok(false) => info!("another process consumes kernel events"),
        Err(e) => warn!(error = %e, "kernel events unavailable"),
    }

    let daemon = Arc::new(Daemon {
        config_path: opts.config.clone(),
        config: ArcSwap::new(config),
        events,
        started: Instant::now(),
        reload_tx: runtimes.reload_senders(),
        reload_lock: tokio::sync::Mutex::new(()),
        ready,
        docker_socket: opts.docker.socket.clone(),
        metrics,
    });
    let control = daemon.clone();
    agent.spawn("api", |stop| api.run(control, stop.cancelled_owned()));
    watch_policies(&mut agent, &daemon);
    if let Err(e) = notify::ready("enforcing") {
        warn!(error = %e, "sd_notify READY failed");
    }

    let mut hup = signal(SignalKind::hangup())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let result = loop {
        tokio::select! {
            _ = hup.recv() => {
                info!("SIGHUP: reloading the configuration");
                // The outcome is logged and counted by reload(); a rejected file changes nothing.
                daemon.reload(Trigger::Sighup).await.ok();
            }
            _ = term.recv() => break Ok(()),
            _ = int.recv() => break Ok(()),
            why = runtimes.ended() => break Err(why),
        }
    };
    info!("stopping; the pinned programs keep enforcing");
    if let Err(e) = notify::stopping() {
        warn!(error = %e, "sd_notify STOPPING failed");
    }
    agent.shutdown().await;
    info!("stopped: events recorded and exported");
    result
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
    ended: Option<oneshot::Receiver<Result<(), docker::ServeError>>>,
}

/// The daemon's ends of one runtime's hooks.
struct RuntimeEnds {
    reload: mpsc::Sender<ReloadRequest>,
    ready: oneshot::Receiver<Value>,
}

impl Runtimes {
    fn hooks(metrics: &Arc<Metrics>) -> (docker::Hooks, RuntimeEnds) {
        let (reload_tx, reload_rx) = mpsc::channel(1);
        let (ready_tx, ready_rx) = oneshot::channel();
        (
            docker::Hooks {
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
        F: FnOnce(tokio_util::sync::CancellationToken) -> Fut,
        Fut: std::future::Future<Output = Result<(), docker::ServeError>> + Send + 'static,
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
    r: Result<Result<(), docker::ServeError>, oneshot::error::RecvError>,
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
        let dir = std::env::temp_dir().join(format!("egress-daemon-start-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let config = dir.join("config.toml");
        std::fs::write(&config, "[proxy]\nendpoint = \"127.0.0.1:3128\"\n").expect("config");
        let opts = RunOptions {
            config,
            docker: DockerOptions::default(),
            watch_docker: true,
            api_socket: dir.join("api.sock"),
            metrics: None,
            metrics_allow_non_loopback: false,
        };
        let err = format!(
            "{:#}",
            run(opts).await.expect_err("loopback endpoint accepted")
        );
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            err.contains("127.0.0.1:3128 can't be used for Docker")
                && err.contains("169.254.100.1"),
            "{err}"
        );
        assert!(!err.contains("channel closed"), "{err}");
    }
}
