//! The containerd watcher: event stream + reconcile loop, feeding the shared enforcer.
//!
//! Each (re)connection subscribes first, then lists the namespace's containers, so nothing that
//! happens during the listing is missed (handlers are idempotent). A pod is enforced from its
//! sandbox's record: `/containers/create` of the sandbox arrives before runc makes the cgroup,
//! and the entry is written for the **pod-level** cgroup, which covers the sandbox and every
//! later container of the pod (init, app, ephemeral) by the kernel's nearest-ancestor lookup.
//! A pod whose sandbox record is not handled yet has no entry: under the kubelet root it is
//! `deny_all` (fail closed). The stream dropping or containerd restarting leads to a reconnect
//! with backoff and a full reconcile; the pinned entries keep enforcing meanwhile.
//!
//! | event                | action                                                          |
//! |----------------------|-----------------------------------------------------------------|
//! | `/containers/create` | a sandbox: resolve its annotations; pre-create the pod cgroup; write its entry and start its listener. An app container: its environment joins the pod's; a real key in it is reported, and with `agent.refuse_workload_secrets` the pod's entry becomes `deny_all` (before the container's task exists) |
//! | `/tasks/start` of a sandbox | its interfaces exist: write its nftables host rules (found through its network namespace) |
//! | `/tasks/create`, `/tasks/start` | a container of a refused pod: kill it (at create, before it runs anything) |
//! | `/tasks/exit` of a sandbox | its interfaces are gone: take its host rules out (the entry stays until delete) |
//! | `/containers/delete` | a sandbox: release its entry and listener, remove a pre-created dir |
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::client::{self, Client, ClientError, Event};
use super::pod::{self, Record, Sandbox};
use crate::config::KubernetesConfig;
use crate::exposure::WorkloadEnv;
use crate::metrics::Metrics;
use crate::workload::reload::{Pause, next_reload, pause};
use crate::workload::{Enforcer, Outcome, ReloadRequest};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What the watcher knows across reconnects.
#[derive(Default)]
struct Pods {
    /// Sandbox id → the pod it runs.
    sandboxes: HashMap<String, Sandbox>,
    /// Sandboxes whose pod can't be confined: their containers are killed when they start.
    refused: HashSet<String>,
    /// Running sandboxes → their process (the pod's network namespace is found through it).
    running: HashMap<String, u32>,
    /// App containers → their cgroup id, named in the directory (`k8s.container.name`).
    members: HashMap<String, u64>,
    /// Sandbox id → its app containers' environments (app id → env): what the pod holds. Kept
    /// until the pod is removed (a key a container held may have been left in the pod's
    /// volumes: a pod confined for it stays confined).
    envs: HashMap<String, BTreeMap<String, WorkloadEnv>>,
}

impl Pods {
    /// The pod of sandbox `id` as the enforcer sees it, with its process if it runs and its
    /// containers' environments.
    fn workload(&self, id: &str) -> Option<crate::workload::info::ContainerInfo> {
        let sb = self.sandboxes.get(id)?;
        let mut info = sb.workload(self.running.get(id).copied());
        if let Some(envs) = self.envs.get(id) {
            info.env = WorkloadEnv::join(envs.values());
        }
        Some(info)
    }
}

/// Watch containerd and enforce pods until `shutdown` completes, applying reloads in between
/// events. Returns the enforcer (its pinned entries stay in force).
pub async fn run(
    k8s: &KubernetesConfig,
    mut enforcer: Enforcer,
    mut reload: Option<mpsc::Receiver<ReloadRequest>>,
    metrics: Option<Arc<Metrics>>,
    shutdown: impl Future<Output = ()>,
) -> Enforcer {
    tokio::pin!(shutdown);
    let mut pods = Pods::default();
    let mut backoff = BACKOFF_MIN;
    loop {
        let session = session(k8s, &mut enforcer, &mut pods, &mut backoff, &mut reload);
        tokio::select! {
            () = &mut shutdown => break,
            r = session => {
                if let Some(m) = &metrics {
                    m.reconcile_error();
                }
                match r {
                    Ok(()) => tracing::warn!("containerd event stream ended; reconnecting"),
                    Err(e) => tracing::warn!(error = %e, backoff = ?backoff, "containerd watcher: reconnecting"),
                }
            }
        }
        let sleep = tokio::time::sleep(backoff);
        tokio::pin!(sleep);
        loop {
            match pause(sleep.as_mut(), shutdown.as_mut(), &mut reload).await {
                Pause::Elapsed => break,
                Pause::Stop => {
                    enforcer.shutdown();
                    tracing::info!("containerd watcher stopped");
                    return enforcer;
                }
                Pause::Reload(req) => apply_reload(&mut enforcer, &mut pods, req).await,
            }
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    enforcer.shutdown();
    tracing::info!("containerd watcher stopped");
    enforcer
}

async fn apply_reload(enforcer: &mut Enforcer, pods: &mut Pods, req: ReloadRequest) {
    if let Some(msg) = crate::workload::reload::restart_needed(enforcer.config(), &req.config) {
        if req.done.send(Err(msg)).is_err() {
            tracing::debug!("reload requester went away");
        }
        return;
    }
    for (info, why) in enforcer.reconfigure(req.config).await {
        refused(pods, &info.id, &why);
    }
    if req.done.send(Ok(())).is_err() {
        tracing::debug!("reload requester went away");
    }
}

fn refused(pods: &mut Pods, sandbox: &str, why: &str) {
    tracing::error!(
        sandbox,
        reason = why,
        "pod can't be confined; its containers will be killed"
    );
    pods.refused.insert(sandbox.to_owned());
}

/// One connection: subscribe, reconcile, then follow events until the stream ends.
async fn session(
    k8s: &KubernetesConfig,
    enforcer: &mut Enforcer,
    pods: &mut Pods,
    backoff: &mut Duration,
    reload: &mut Option<mpsc::Receiver<ReloadRequest>>,
) -> Result<(), ClientError> {
    let client = Client::connect(&k8s.containerd_socket, &k8s.containerd_namespace).await?;
    let (mut stream, early) = subscribe(&client).await?;
    reconcile(&client, k8s, enforcer, pods).await?;
    // Events that came in while the subscription was being confirmed (idempotent after the list).
    for event in early {
        handle(&client, k8s, enforcer, pods, event).await?;
    }
    *backoff = BACKOFF_MIN;
    tracing::info!(pods = pods.sandboxes.len(), "containerd reconciled");
    loop {
        tokio::select! {
            msg = stream.message() => {
                let Some(env) = msg.map_err(|status| ClientError::Call { call: "Events stream", status })? else {
                    return Ok(());
                };
                let event = client::decode(&env.topic, env.event.as_ref().map(|a| &a.value[..]));
                handle(&client, k8s, enforcer, pods, event).await?;
            }
            req = next_reload(reload) => {
                if let Some(req) = req {
                    apply_reload(enforcer, pods, req).await;
                }
            }
        }
    }
}

/// How long the agent waits for its own marker to come back through a new subscription.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the marker is published again meanwhile (the first may precede the subscription).
const SYNC_REPUBLISH: Duration = Duration::from_millis(200);

type EventStream = containerd_client::tonic::Streaming<containerd_client::types::Envelope>;

/// Subscribe and prove the subscription live before anything is listed: containerd answers a
/// subscriber only with its first event, so the agent publishes a marker (again until it comes
/// back) and reads up to it. Returns the stream and the events that arrived before the marker.
async fn subscribe(client: &Client) -> Result<(EventStream, Vec<Event>), ClientError> {
    let token = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    );
    // Aborted if this is dropped (the agent stopped meanwhile), not left running.
    let sub = {
        let client = client.clone();
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
            async move { client.subscribe().await },
        ))
    };
    tokio::pin!(sub);
    let deadline = tokio::time::Instant::now() + SYNC_TIMEOUT;
    let mut stream = loop {
        client.publish_sync(&token).await?;
        tokio::select! {
            r = &mut sub => break r.map_err(|e| ClientError::Sync(format!("subscription task: {e}")))??,
            () = tokio::time::sleep(SYNC_REPUBLISH) => {}
        }
        if tokio::time::Instant::now() > deadline {
            sub.abort();
            return Err(ClientError::Sync(format!(
                "no event came back within {SYNC_TIMEOUT:?} of subscribing"
            )));
        }
    };
    let mut early = Vec::new();
    loop {
        let msg = tokio::time::timeout_at(deadline, stream.message())
            .await
            .map_err(|_| ClientError::Sync("the marker did not come back".to_owned()))?
            .map_err(|status| ClientError::Call {
                call: "Events stream",
                status,
            })?;
        let Some(env) = msg else {
            return Err(ClientError::Sync("the event stream ended".to_owned()));
        };
        match client::decode(&env.topic, env.event.as_ref().map(|a| &a.value[..])) {
            Event::Sync(t) if t == token => return Ok((stream, early)),
            Event::Sync(_) | Event::Other => {}
            event => early.push(event),
        }
    }
}

/// Enforce every sandbox containerd has; forget the ones it no longer has.
async fn reconcile(
    client: &Client,
    k8s: &KubernetesConfig,
    enforcer: &mut Enforcer,
    pods: &mut Pods,
) -> Result<(), ClientError> {
    enforcer.begin_batch();
    let listed = reconcile_all(client, k8s, enforcer, pods).await;
    // Host rules are written once, here; the pods whose rules (and deny_all) failed are refused.
    for (info, why) in enforcer.end_batch(listed.is_ok()).await {
        refused(pods, &info.id, &why);
    }
    // Containers of pods refused meanwhile are stopped now (sandboxes included).
    for (id, sandbox_id) in listed? {
        if pods.refused.contains(&sandbox_id) {
            kill(client, k8s, &id).await;
        }
    }
    Ok(())
}

/// The listing part of [`reconcile`]: returns every (container, sandbox) pair it saw.
async fn reconcile_all(
    client: &Client,
    k8s: &KubernetesConfig,
    enforcer: &mut Enforcer,
    pods: &mut Pods,
) -> Result<Vec<(String, String)>, ClientError> {
    let mut seen = HashSet::new();
    let mut started = Vec::new();
    for c in client.list().await? {
        let (labels, spec) = client::parts(&c);
        match pod::classify(&c.id, labels, spec, &k8s.cgroup_root) {
            Ok(Record::Sandbox(sb)) => {
                seen.insert(sb.id.clone());
                started.push((sb.id.clone(), sb.id.clone()));
                match client.running_pid(&sb.id).await? {
                    Some(pid) => pods.running.insert(sb.id.clone(), pid),
                    None => pods.running.remove(&sb.id),
                };
                sandbox(enforcer, pods, sb).await;
            }
            Ok(Record::App(app)) => {
                member(enforcer, pods, &app);
                app_env(enforcer, pods, &app).await;
                started.push((app.id, app.sandbox_id));
            }
            Err(e) => {
                if not_a_pod(pods, &c.id, labels, &e) {
                    // Running already (the agent was away): stop it now.
                    kill(client, k8s, &c.id).await;
                }
            }
        }
    }
    let gone: Vec<String> = pods
        .sandboxes
        .keys()
        .filter(|id| !seen.contains(*id))
        .cloned()
        .collect();
    for id in gone {
        removed(enforcer, pods, &id).await;
    }
    pods.envs.retain(|id, _| seen.contains(id));
    enforcer.prune();
    Ok(started)
}

async fn handle(
    client: &Client,
    k8s: &KubernetesConfig,
    enforcer: &mut Enforcer,
    pods: &mut Pods,
    event: Event,
) -> Result<(), ClientError> {
    match event {
        Event::ContainerCreate(id) => {
            let Some(c) = client.get(&id).await? else {
                return Ok(());
            };
            let (labels, spec) = client::parts(&c);
            match pod::classify(&id, labels, spec, &k8s.cgroup_root) {
                Ok(Record::Sandbox(sb)) => sandbox(enforcer, pods, sb).await,
                // Before its task exists: what it holds is judged before it runs.
                Ok(Record::App(app)) => app_env(enforcer, pods, &app).await,
                Err(e) => {
                    // Refused: its task is killed when it starts (`/tasks/start`).
                    not_a_pod(pods, &id, labels, &e);
                }
            }
        }
        Event::ContainerDelete(id) => {
            if pods.sandboxes.contains_key(&id) {
                removed(enforcer, pods, &id).await;
            }
            if let Some(cgroup_id) = pods.members.remove(&id) {
                enforcer.directory().remove_member(cgroup_id);
            }
        }
        Event::TaskStart { id, pid } if pods.sandboxes.contains_key(&id) => {
            pods.running.insert(id.clone(), pid);
            sandbox_started(client, k8s, enforcer, pods, &id).await;
        }
        Event::TaskExit(id) => {
            if pods.running.remove(&id).is_some() {
                enforcer.pod_stopped(&id).await;
            }
            if let Some(cgroup_id) = pods.members.remove(&id) {
                enforcer.directory().remove_member(cgroup_id);
            }
        }
        // A refused container is killed before it runs anything (at create), or at start if its
        // create was missed. Any other app container is named in the directory (its cgroup
        // exists from create on).
        Event::TaskCreate(id) | Event::TaskStart { id, .. } => {
            let app = match client.get(&id).await? {
                Some(c) => {
                    let (labels, spec) = client::parts(&c);
                    match pod::classify(&id, labels, spec, &k8s.cgroup_root) {
                        Ok(Record::App(app)) => Some(app),
                        _ => None,
                    }
                }
                None => None,
            };
            let refused_pod = pods.refused.contains(&id)
                || app
                    .as_ref()
                    .is_some_and(|app| pods.refused.contains(&app.sandbox_id));
            if refused_pod {
                kill(client, k8s, &id).await;
            } else if let Some(app) = app {
                member(enforcer, pods, &app);
                app_env(enforcer, pods, &app).await;
            }
        }
        Event::Sync(_) | Event::Other => {}
    }
    Ok(())
}

/// Enforce a pod from its sandbox record (and, if its sandbox runs, its host rules).
#[tracing::instrument(skip_all, fields(pod = %sb.pod.display_name(), sandbox = %sb.id))]
async fn sandbox(enforcer: &mut Enforcer, pods: &mut Pods, sb: Sandbox) {
    let id = sb.id.clone();
    pods.sandboxes.insert(id.clone(), sb);
    let Some(info) = pods.workload(&id) else {
        return;
    };
    match enforcer.started(&info).await {
        Outcome::Ok => {
            pods.refused.remove(&id);
        }
        Outcome::Refuse(why) => refused(pods, &id, &why),
    }
}

/// A pod's sandbox started: its interfaces exist now, and its host rules are written. A pod
/// whose rules and `deny_all` both failed is refused: its sandbox is killed.
async fn sandbox_started(
    client: &Client,
    k8s: &KubernetesConfig,
    enforcer: &mut Enforcer,
    pods: &mut Pods,
    id: &str,
) {
    let Some(info) = pods.workload(id) else {
        return;
    };
    if let Outcome::Refuse(why) = enforcer.started(&info).await {
        refused(pods, id, &why);
    }
    if pods.refused.contains(id) {
        kill(client, k8s, id).await;
    }
}

/// Name an app container's cgroup in the directory, so kernel events of its processes say which
/// container of the pod they came from (its pod's entry says which pod). A cgroup not made yet
/// (no task) is named at the task's create.
fn member(enforcer: &Enforcer, pods: &mut Pods, app: &pod::App) {
    if pods.members.contains_key(&app.id) {
        return;
    }
    let dir = enforcer
        .settings()
        .root
        .mount
        .join(&app.cgroup.container_dir);
    match crate::cgroup::cgroup_id(&dir) {
        Ok(cgroup_id) => {
            enforcer.directory().set_member(
                cgroup_id,
                std::collections::BTreeMap::from([(
                    pod::CTX_CONTAINER.to_owned(),
                    app.name.clone(),
                )]),
            );
            pods.members.insert(app.id.clone(), cgroup_id);
        }
        Err(e) => tracing::debug!(container = %app.id, error = %e, "no cgroup yet"),
    }
}

/// An app container's environment joins its pod's: the pod is applied again when what it
/// holds changes (with `agent.refuse_workload_secrets`, its entry becomes `deny_all`).
async fn app_env(enforcer: &mut Enforcer, pods: &mut Pods, app: &pod::App) {
    let envs = pods.envs.entry(app.sandbox_id.clone()).or_default();
    if envs.get(&app.id) == Some(&app.env) {
        return;
    }
    envs.insert(app.id.clone(), app.env.clone());
    let Some(info) = pods.workload(&app.sandbox_id) else {
        // Its sandbox is not known yet: the sandbox's record brings the environment in.
        return;
    };
    if let Outcome::Refuse(why) = enforcer.env_changed(&info).await {
        refused(pods, &app.sandbox_id, &why);
    }
}

async fn removed(enforcer: &mut Enforcer, pods: &mut Pods, id: &str) {
    pods.envs.remove(id);
    pods.sandboxes.remove(id);
    pods.refused.remove(id);
    pods.running.remove(id);
    enforcer.destroyed(id).await;
    tracing::info!(sandbox = id, "pod removed");
}

/// A record that is not an enforceable pod container; `true` when it must not run. Records
/// without the CRI kind label (`ctr run` in the namespace) are not pods. A CRI container whose
/// cgroup is outside the kubelet root is not confined by anything: an annotated one is refused
/// (killed when it starts), an unannotated one is logged. Any other unreadable CRI record is
/// logged loudly: under the root its pod has no entry and stays `deny_all`.
fn not_a_pod(
    pods: &mut Pods,
    id: &str,
    labels: &HashMap<String, String>,
    e: &pod::RecordError,
) -> bool {
    match e {
        pod::RecordError::OutsideRoot { opted_in: true, .. } => {
            refused(pods, id, &e.to_string());
            true
        }
        pod::RecordError::OutsideRoot { .. } => {
            tracing::warn!(container = id, error = %e, "unannotated CRI container outside the kubelet root");
            false
        }
        _ if labels.contains_key(pod::LABEL_KIND) => {
            tracing::error!(container = id, error = %e, "CRI container not understood; its pod stays deny_all");
            false
        }
        _ => {
            tracing::debug!(container = id, error = %e, "not a CRI pod container");
            false
        }
    }
}

async fn kill(client: &Client, k8s: &KubernetesConfig, id: &str) {
    match client.kill(id).await {
        Ok(()) => {
            tracing::warn!(container = id, namespace = %k8s.containerd_namespace, "killed a container of a refused pod")
        }
        Err(e) => {
            tracing::error!(container = id, error = %e, "killing a container of a refused pod failed; its pod is deny_all")
        }
    }
}
