//! The Docker watcher: event stream + reconcile loop.
//!
//! Each (re)connection subscribes to container events starting just before it lists the
//! containers, so nothing that happens during the listing is missed (Docker replays events
//! since the given time; handlers are idempotent). The stream dropping or the daemon
//! restarting leads to a reconnect with backoff and a full reconcile. Nothing is opened in the
//! meantime: the kernel keeps enforcing the pinned entries, and a container started while the
//! agent is blind has no entry and is denied until the agent catches up (fail closed).
//!
//! | event     | action                                                               |
//! |-----------|----------------------------------------------------------------------|
//! | `create`  | resolve labels; pre-create the cgroup dir; write its entry (before `start`) |
//! | `start`   | write/refresh the entry for the real cgroup; host-side nftables rules; refuse (stop) unconfinable containers |
//! | `die`     | release entry, listener and rules; prepare again if the container still exists (restart); nothing if it runs again in its entry's cgroup (a `die` of an earlier run) |
//! | `destroy` | release everything, remove a pre-created dir                         |
//! | network `create`/`destroy` | guard / unguard the bridge of a Docker bridge network (nft) |
//! | network `connect`/`disconnect` | a running container's ports changed: classify it again |
//!
//! Bridge networks are listed before the containers on every reconcile, and a network's
//! `create` event is handled at once (before any later event): a container's frames on a Docker
//! bridge are dropped until its `start` has been handled (see `nft/`).
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bollard::Docker;
use bollard::models::EventMessageTypeEnum;
use bollard::query_parameters::{
    EventsOptions, InspectContainerOptions, InspectNetworkOptions, ListContainersOptions,
    ListNetworksOptions, StopContainerOptions,
};
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;

use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::workload::ReloadRequest;
use crate::workload::enforce::{Enforcer, Outcome};
use crate::workload::info::ContainerInfo;
use crate::workload::reload::{Pause, next_reload, pause, restart_needed};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// HTTP timeout for API calls (the event stream itself is long-lived).
const API_TIMEOUT_SECS: u64 = 120;

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("docker API: {0}")]
    Docker(#[from] bollard::errors::Error),
    #[error("docker event stream ended")]
    StreamEnded,
}

/// Watch `docker_socket` (a path or `unix://` URL) and enforce containers until `shutdown`
/// completes; returns the enforcer (its pinned entries and nftables rules stay in force).
/// Configuration reloads sent on `reload` are applied in between Docker events (so a reload
/// never races an event for the same container); every session that failed (Docker
/// unreachable, reconcile failed, event stream lost) is counted every session that failed
/// (Docker unreachable, reconcile failed, event stream lost) in `metrics`' `reconcile_errors_total`.
pub async fn run(
    docker_socket: &str,
    mut enforcer: Enforcer,
    mut reload: Option<mpsc::Receiver<ReloadRequest>>,
    metrics: Option<Arc<Metrics>>,
    shutdown: impl Future<Output = ()>,
) -> Enforcer {
    tokio::pin!(shutdown);
    let mut backoff = BACKOFF_MIN;
    loop {
        let session = session(docker_socket, &mut enforcer, &mut backoff, &mut reload);
        tokio::select! {
            () = &mut shutdown => break,
            r = session => {
                match r {
                    Ok(()) => tracing::warn!("docker event stream ended; reconnecting"),
                    Err(e) => {
                        if let Some(m) = &metrics {
                            m.reconcile_error();
                        }
                        tracing::warn!(error = %e, backoff = ?backoff, "docker watcher: reconnecting");
                    }
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
                    tracing::info!("docker watcher stopped");
                    return enforcer;
                }
                Pause::Reload(req) => apply_reload(None, &mut enforcer, req).await,
            }
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    enforcer.shutdown();
    tracing::info!("docker watcher stopped");
    enforcer
}

/// Apply a new configuration to the tracked containers. Settings that can't change under
/// running listeners and pins (`[proxy]`, `[dns]`, `agent.bpffs`, `[intercept]`, `agent.state_dir`)
/// need a restart: such a
/// configuration is refused whole and the running one stays in force.
async fn apply_reload(docker: Option<&Docker>, enforcer: &mut Enforcer, req: ReloadRequest) {
    let new = req.config;
    if let Some(msg) = restart_needed(enforcer.config(), &new) {
        if req.done.send(Err(msg)).is_err() {
            tracing::debug!("reload requester went away");
        }
        return;
    }
    let refused = enforcer.reconfigure(new).await;
    for (info, why) in &refused {
        match docker {
            Some(d) => refuse(d, info, why).await,
            // Not connected: the entry is already deny_all; the next reconcile stops it.
            None => {
                tracing::warn!(container = %info.id, reason = %why, "refused on reload; will stop it on reconnect")
            }
        }
    }
    if req.done.send(Ok(())).is_err() {
        tracing::debug!("reload requester went away");
    }
}

/// One connection: subscribe, reconcile, then follow events until the stream ends.
///
/// `create` is handled at once from the event itself (labels are in its attributes), so the
/// cgroup and its entry exist before `start` gets to runc. Every event is then completed with a
/// `docker inspect`; those run concurrently (an inspect waits while the daemon holds the
/// container's lock during `start`) and are applied in event order.
async fn session(
    socket: &str,
    enforcer: &mut Enforcer,
    backoff: &mut Duration,
    reload: &mut Option<mpsc::Receiver<ReloadRequest>>,
) -> Result<(), WatchError> {
    let docker = Docker::connect_with_unix(socket, API_TIMEOUT_SECS, bollard::API_DEFAULT_VERSION)?
        .negotiate_version()
        .await?;
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs().saturating_sub(1))
        .unwrap_or(0);
    let filters = HashMap::from([
        (
            "type".to_owned(),
            vec!["container".to_owned(), "network".to_owned()],
        ),
        (
            "event".to_owned(),
            ["create", "start", "die", "destroy", "connect", "disconnect"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
        ),
    ]);
    let mut stream = docker.events(Some(EventsOptions {
        since: Some(since.to_string()),
        until: None,
        filters: Some(filters),
    }));
    reconcile(&docker, enforcer).await?;
    *backoff = BACKOFF_MIN;
    let mut pending: Pending = FuturesOrdered::new();
    loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(msg) = msg else { return Err(WatchError::StreamEnded) };
                let msg = msg?;
                if msg.typ == Some(EventMessageTypeEnum::NETWORK) {
                    network_event(&docker, enforcer, msg, &mut pending).await?;
                    continue;
                }
                if msg.typ != Some(EventMessageTypeEnum::CONTAINER) {
                    continue;
                }
                let Some(actor) = msg.actor else { continue };
                let (Some(action), Some(id)) = (msg.action, actor.id) else { continue };
                tracing::debug!(action = %action, container = %id, "docker event");
                if action == "create" {
                    let attrs = actor.attributes.unwrap_or_default();
                    let info = ContainerInfo::from_event(&id, &attrs);
                    if let Outcome::Refuse(why) = enforcer.prepare(&info).await {
                        // Not running yet: the stop makes sure it never does confined wrongly.
                        refuse(&docker, &info, &why).await;
                    }
                }
                let d = docker.clone();
                pending.push_back(Box::pin(async move {
                    let info = inspect(&d, &id).await;
                    (action, id, info)
                }));
            }
            Some((action, id, info)) = pending.next(), if !pending.is_empty() => {
                apply(&docker, enforcer, &action, &id, info?).await;
            }
            req = next_reload(reload) => {
                if let Some(req) = req {
                    apply_reload(Some(&docker), enforcer, req).await;
                }
            }
        }
    }
}

type Pending = FuturesOrdered<
    std::pin::Pin<
        Box<
            dyn Future<Output = (String, String, Result<Option<ContainerInfo>, WatchError>)> + Send,
        >,
    >,
>;

/// A network event. `create`/`destroy` of a bridge network change the guarded bridges at once
/// (no queue: before the next event, so before any container can start on it). `connect` /
/// `disconnect` of a running container queue a re-classification (its ports changed; the new
/// one is dropped until then). At a container's start, its connects come before its `start`
/// event and are skipped: `start` classifies it.
async fn network_event(
    docker: &Docker,
    enforcer: &mut Enforcer,
    msg: bollard::models::EventMessage,
    pending: &mut Pending,
) -> Result<(), WatchError> {
    let Some(actor) = msg.actor else {
        return Ok(());
    };
    let (Some(action), Some(id)) = (msg.action, actor.id) else {
        return Ok(());
    };
    let attrs = actor.attributes.unwrap_or_default();
    tracing::debug!(action = %action, network = %id, "docker network event");
    match action.as_str() {
        "create" => {
            if attrs.get("type").is_some_and(|t| t != "bridge") {
                return Ok(());
            }
            match docker
                .inspect_network(&id, None::<InspectNetworkOptions>)
                .await
            {
                Ok(n) => {
                    if let Some(bridge) = bridge_name(n.driver.as_deref(), &id, n.options.as_ref())
                    {
                        enforcer.network_created(&id, bridge).await;
                    }
                }
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        "destroy" => enforcer.network_destroyed(&id).await,
        "connect" | "disconnect" => {
            if let Some(container) = attrs.get("container").cloned()
                && enforcer.is_running(&container)
            {
                let d = docker.clone();
                pending.push_back(Box::pin(async move {
                    let info = inspect(&d, &container).await;
                    (action, container, info)
                }));
            }
        }
        _ => {}
    }
    Ok(())
}

/// The Linux bridge of a Docker network: `com.docker.network.bridge.name` if set (`docker0` for
/// the default network), else `br-<first 12 characters of the id>` (libnetwork's default).
/// `None` for other drivers.
fn bridge_name(
    driver: Option<&str>,
    id: &str,
    options: Option<&HashMap<String, String>>,
) -> Option<String> {
    if driver != Some("bridge") {
        return None;
    }
    if let Some(name) = options
        .and_then(|o| o.get("com.docker.network.bridge.name"))
        .filter(|n| !n.is_empty())
    {
        return Some(name.clone());
    }
    let short: String = id.chars().take(12).collect();
    (short.len() == 12).then(|| format!("br-{short}"))
}

async fn inspect(docker: &Docker, id: &str) -> Result<Option<ContainerInfo>, WatchError> {
    match docker
        .inspect_container(id, None::<InspectContainerOptions>)
        .await
    {
        Ok(c) => Ok(ContainerInfo::from_inspect(&c)),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Apply one event, given the container's state inspected after it.
async fn apply(
    docker: &Docker,
    enforcer: &mut Enforcer,
    action: &str,
    id: &str,
    info: Option<ContainerInfo>,
) {
    // A `die` of an earlier run (the container runs again, in the cgroup its entry is for) has
    // nothing to release: the `start` after it is handled, or comes next.
    if action == "die" && !info.as_ref().is_some_and(|i| enforcer.runs_in_its_entry(i)) {
        enforcer.stopped(id).await;
    }
    match (action, info) {
        ("destroy", _) | (_, None) => enforcer.destroyed(id).await,
        (_, Some(info)) if info.running => {
            if let Outcome::Refuse(why) = enforcer.started(&info).await {
                refuse(docker, &info, &why).await;
            }
        }
        // `--rm` after it exited: destroy follows.
        ("die", Some(info)) if info.auto_remove => {}
        // Created or stopped: get the (next) start ready — restart policies, `docker start`.
        (_, Some(info)) => {
            if let Outcome::Refuse(why) = enforcer.prepare(&info).await {
                refuse(docker, &info, &why).await;
            }
        }
    }
}

/// Stop a container that can't be confined (no grace period: SIGKILL right away; a stop, not a
/// kill, so a restart policy does not bring it back).
async fn refuse(docker: &Docker, info: &ContainerInfo, why: &str) {
    tracing::warn!(container = %info.id, name = %info.name, reason = why, "refusing container: stopping it");
    let opts = StopContainerOptions {
        signal: None,
        t: Some(0),
    };
    if let Err(e) = docker.stop_container(&info.id, Some(opts)).await {
        tracing::error!(container = %info.id, error = %e, "stopping refused container failed");
    }
}

/// Bring the enforcer in line with what Docker has now: bridge networks first, then every
/// container. The host rules are written once, at the end (and not at all before the first
/// reconcile completed: until then the previous agent's tables stay in force).
async fn reconcile(docker: &Docker, enforcer: &mut Enforcer) -> Result<(), WatchError> {
    enforcer.begin_batch();
    let r = reconcile_all(docker, enforcer).await;
    for (info, why) in enforcer.end_batch(r.is_ok()).await {
        refuse(docker, &info, &why).await;
    }
    r
}

async fn reconcile_all(docker: &Docker, enforcer: &mut Enforcer) -> Result<(), WatchError> {
    let nets = docker.list_networks(None::<ListNetworksOptions>).await?;
    let mut bridges = std::collections::BTreeMap::new();
    for n in nets {
        let Some(id) = n.id else { continue };
        if let Some(b) = bridge_name(n.driver.as_deref(), &id, n.options.as_ref()) {
            bridges.insert(id, b);
        }
    }
    enforcer.set_networks(bridges);
    let list = docker
        .list_containers(Some(ListContainersOptions {
            all: true,
            ..Default::default()
        }))
        .await?;
    let mut seen = HashSet::new();
    for summary in list {
        let Some(id) = summary.id else { continue };
        seen.insert(id.clone());
        let Some(info) = inspect(docker, &id).await? else {
            continue;
        };
        if info.running {
            if let Outcome::Refuse(why) = enforcer.started(&info).await {
                refuse(docker, &info, &why).await;
            }
        } else {
            enforcer.stopped(&id).await;
            if let Outcome::Refuse(why) = enforcer.prepare(&info).await {
                refuse(docker, &info, &why).await;
            }
        }
    }
    for id in enforcer.tracked_ids() {
        if !seen.contains(&id) {
            enforcer.destroyed(&id).await;
        }
    }
    enforcer.prune();
    tracing::info!(containers = seen.len(), "docker reconcile done");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_names_of_docker_networks() {
        let id = "0123456789abcdef0123";
        assert_eq!(
            bridge_name(Some("bridge"), id, None).as_deref(),
            Some("br-0123456789ab")
        );
        let custom = HashMap::from([(
            "com.docker.network.bridge.name".to_owned(),
            "docker0".to_owned(),
        )]);
        assert_eq!(
            bridge_name(Some("bridge"), id, Some(&custom)).as_deref(),
            Some("docker0")
        );
        assert_eq!(bridge_name(Some("macvlan"), id, None), None);
        assert_eq!(bridge_name(Some("host"), id, Some(&custom)), None);
        assert_eq!(bridge_name(Some("bridge"), "short", None), None);
    }
}
