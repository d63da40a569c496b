//! The fake `Control` shared by the API, CLI and MCP tests: reads from a configuration in a
//! temporary directory and a real event store, writes through the real `manage::apply`.
#![allow(dead_code)]
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use egress_agent::api::{
    self, ApiError, BoxFuture, Control, ExplainQuery, ReplayBody, StoreQuery, backend,
    server::ApiServer,
};
use egress_agent::config::Config;
use egress_agent::events::{ContainerRef, DenialEvent, Verdict};
use egress_agent::manage::{self, Change, ChangeLog, Who};
use egress_agent::store::Store;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

pub struct Fake {
    path: PathBuf,
    config: Mutex<Arc<Config>>,
    log: Recorder,
    asks: Arc<egress_agent::asks::Asks>,
}

#[derive(Default)]
pub struct Recorder(Mutex<Vec<Value>>);

impl ChangeLog for Recorder {
    fn record(&self, who: &Who, change: &Change, files: &[PathBuf], diff: &str, result: &str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(json!({
                "uid": who.uid, "identity": who.identity, "action": change.action(),
                "target": change.target(), "files": files, "diff": diff, "result": result,
            }));
    }
}

impl Fake {
    fn config(&self) -> Arc<Config> {
        self.config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Control for Fake {
    fn status(&self) -> Value {
        json!({ "version": "test", "uptime_s": 1, "proxy_endpoint": "127.0.0.1:3128", "events_total": 2 })
    }
    fn containers(&self) -> Value {
        json!([{ "cgroup_id": 1, "owner": "docker:web-1", "container": "web-1", "policy": "ci",
                 "badge": "allowlist", "allowed": 3, "denied": 1, "proxied": 2 }])
    }
    fn policies(&self) -> Value {
        egress_agent::check::effective_policies(&self.config())
    }
    fn events(&self, n: usize) -> Vec<Value> {
        sample_events()
            .into_iter()
            .take(n)
            .map(|e| serde_json::to_value(e).unwrap_or(Value::Null))
            .collect()
    }
    fn subscribe(&self) -> tokio::sync::mpsc::Receiver<Value> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            for ev in sample_events() {
                if tx
                    .send(serde_json::to_value(ev).unwrap_or(Value::Null))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        rx
    }
    fn reload(&self) -> BoxFuture<'_, Result<Value, String>> {
        Box::pin(async move {
            let c = Config::load(&self.path).map_err(|e| e.to_string())?;
            *self.config.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(c);
            Ok(json!({ "reloaded": true }))
        })
    }
    fn policy(&self, name: &str) -> Option<Value> {
        manage::describe(&self.path, &self.config(), name)
    }
    fn defaults(&self) -> Result<Value, ApiError> {
        Ok(backend::defaults(&self.path, &self.config()))
    }
    fn export(&self) -> Result<manage::bundle::Bundle, ApiError> {
        Ok(manage::bundle::Bundle::export(&self.config()))
    }
    fn change(
        &self,
        change: Change,
        who: Who,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async move {
            let in_use = BTreeMap::from([("ci".to_owned(), vec!["docker:web-1".to_owned()])]);
            if dry_run {
                return Ok(manage::dry_run(&self.path, &change, &in_use)?);
            }
            Ok(
                manage::apply(&self.path, &change, &who, &in_use, &self.log, || {
                    self.reload()
                })
                .await?,
            )
        })
    }
    fn explain(&self, q: ExplainQuery) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(
            async move { backend::explain(&self.config(), "unix:///nonexistent.sock", q).await },
        )
    }
    fn denials(&self, q: &StoreQuery) -> Result<Vec<Value>, ApiError> {
        backend::denials(&self.config(), q)
    }
    fn suggest(&self, q: &StoreQuery) -> Result<String, ApiError> {
        backend::suggest(&self.config(), q)
    }
    fn replay(&self, body: ReplayBody) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(backend::replay(self.config(), body))
    }
    fn changes(&self, n: usize) -> Result<Vec<Value>, ApiError> {
        let all = self.log.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(all.into_iter().rev().take(n).rev().collect())
    }
    fn doctor(&self) -> BoxFuture<'_, Value> {
        Box::pin(async {
            json!([{ "id": "proxy.listening", "status": "pass", "summary": "ok", "fix": null }])
        })
    }
    fn requests(&self, pending_only: bool) -> Result<Value, ApiError> {
        Ok(serde_json::to_value(self.asks.list(pending_only)).unwrap_or(Value::Null))
    }
    fn decide(
        &self,
        id: u64,
        decision: egress_agent::asks::Decision,
        who: Who,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async move {
            let config = self.config();
            backend::decide(
                &self.asks,
                id,
                decision,
                who,
                |change, who| self.change(change, who, dry_run),
                &self.path,
                &config,
                dry_run,
            )
            .await
        })
    }
}

pub fn sample_events() -> Vec<DenialEvent> {
    let mut a = DenialEvent::proxy(
        "ci",
        Some("evil.test".into()),
        None,
        443,
        "connect",
        "host-not-allowed",
    );
    a.container = Some(ContainerRef {
        id: "abc123".into(),
        name: "web-1".into(),
    });
    let mut b = DenialEvent::proxy(
        "ci",
        Some("api.github.com".into()),
        None,
        443,
        "connect",
        "allowed",
    )
    .with_verdict(Verdict::Allow);
    b.container = a.container.clone();
    vec![a, b]
}

pub fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("egress-api-ep-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).expect("dir");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    d
}

pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Says a test is skipped, straight to the stderr fd: libtest's capture only intercepts
/// `eprintln!`, and a skip must be visible in a normal (captured) run.
pub fn skip(why: &str) {
    use std::io::Write as _;
    std::io::stderr()
        .write_all(format!("skipping: {why}\n").as_bytes())
        .ok();
}

pub struct Served {
    /// The fake daemon's access requests (a test files them as a workload would).
    pub asks: Arc<egress_agent::asks::Asks>,
    pub dir: PathBuf,
    pub sock: PathBuf,
    pub tcp: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Served {
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            s.send(()).ok();
        }
        if let Some(t) = self.task.take() {
            t.await.ok();
        }
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

pub async fn serve(tag: &str) -> Served {
    let dir = tempdir(tag);
    let state = dir.join("state");
    std::fs::create_dir_all(&state).expect("state");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let cfg = dir.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "# the operator's file\n[agent]\nstate_dir = \"{}\"\ndefault_policy = \"deny_all\"\n\n[policies.ci]\nallow_hosts = [\"github.com\", \"*.github.com\"]\n",
            state.display()
        ),
    )
    .expect("config");
    // A real store with two denials and an allowed flow (suggest reads flows).
    let config = Config::load(&cfg).expect("config loads");
    {
        let mut store = Store::open(&config.agent.store_path()).expect("store");
        let evs = sample_events();
        let mut flows = egress_agent::store::FlowBatch::new();
        for e in &evs {
            egress_agent::store::add_flow(&mut flows, e);
        }
        let denials: Vec<DenialEvent> = evs
            .into_iter()
            .filter(|e| e.verdict != Verdict::Allow)
            .collect();
        store.write(&denials, &flows).expect("write store");
    }
    let asks = egress_agent::asks::Asks::new();
    let fake = Arc::new(Fake {
        path: cfg,
        config: Mutex::new(Arc::new(config)),
        log: Recorder::default(),
        asks: asks.clone(),
    });
    let sock = dir.join("api.sock");
    let server = ApiServer::bind(&sock)
        .await
        .expect("bind")
        .read_group(65534)
        .expect("read group")
        .ui_listen(
            "127.0.0.1:0".parse().expect("addr"),
            &state.join(egress_agent::api::tokens::FILE),
        )
        .await
        .expect("tcp");
    let tcp = server.ui_addr().expect("tcp addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(fake, async {
        rx.await.ok();
    }));
    Served {
        asks,
        dir,
        sock,
        tcp,
        stop: Some(tx),
        task: Some(task),
    }
}

pub async fn call(
    sock: &Path,
    method: Method,
    path: &str,
    body: Option<(&str, &str)>,
) -> (StatusCode, Value) {
    let (status, text) = api::client::request_body(
        sock,
        method,
        path,
        body.map(|(c, b)| (c, b.as_bytes().to_vec())),
    )
    .await
    .expect("request");
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}
