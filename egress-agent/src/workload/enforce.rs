//! The per-workload lifecycle: what the agent does when a runtime creates, starts, stops or
//! removes a workload (a Docker container, a pod, a command under `exec`), and on reload.
//!
//! Each step decides with [`super::plan`] (pure) and carries the plan out through the three
//! parts that hold state: [`Entries`] (kernel entries and the event directory), [`Listener`]s
//! (one proxy listener per opted-in container) and the [`HostLayer`] (nftables). Every step
//! returns an [`Outcome`] the caller must act on: `Refuse` means "stop this container".
//!
//! Fail closed everywhere: a container under the root with no entry is `deny_all` in the
//! kernel; when an entry can't be written with the container's policy, `deny_all` is written
//! instead, and when even that fails the container is refused; when the host layer can't be set
//! up for an enforced container its entry becomes `deny_all`, and if that fails too it is
//! refused. Containers that can't be confined (privileged, dangerous capabilities or mounts,
//! cgroup outside the root) are refused.
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use super::directory::Directory;
use super::entries::{Entries, Written};
use super::host_layer::{HostLayer, HostTables};
use super::info::ContainerInfo;
use super::labels::{self, Resolved};
use super::listeners::Listener;
use super::netinfo;
use super::plan::{self, Plan};
use super::pod_clients::PodClients;
use super::root::WorkloadRoot;
use crate::agent::Stop;
use crate::bpf::PinnedState;
use crate::cgroup;
use crate::config::Config;
use crate::events::{ContainerRef, DenialEvent, EventSink, Source};
use crate::nft;
use crate::proxy::ProxyContext;

#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error(transparent)]
    Nft(#[from] nft::NftError),
}

/// What the caller must do after an enforcement step.
#[must_use = "a refused container must be stopped"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Enforced (or deliberately left as `agent.unlabeled`).
    Ok,
    /// The container can't be confined: stop it. Its cgroup (if under the root) is `deny_all`
    /// or has no entry (which the kernel treats as `deny_all`).
    Refuse(String),
}

struct Tracked {
    /// What Docker last told us about the container (labels, state): a reload re-applies from it.
    info: ContainerInfo,
    resolved: Resolved,
    /// The cgroup (dir, id) that has an entry written by us.
    cgroup: Option<(PathBuf, u64)>,
    /// A directory we created before `start` (removed on destroy if still empty).
    precreated: Option<PathBuf>,
    listener: Option<Listener>,
    /// Refused for these reasons (the event was emitted).
    refused: Option<String>,
    /// The gateways of its bridge endpoints, as the host layer last found them: where it
    /// reaches its host ([`host_addrs`]).
    gateways: Vec<IpAddr>,
}

/// Where a workload reaches its own host (and its policy's `allow_host_services` open):
/// loopback in the host's network namespace (`exec`, `--network host`), else the gateways of
/// its bridge endpoints the host layer found (none yet, or no host layer: nothing opens).
fn host_addrs(info: &ContainerInfo, gateways: &[IpAddr]) -> Vec<IpAddr> {
    if info.host_network() {
        egress_policy::kernel::HOST_NETNS_HOST.to_vec()
    } else {
        gateways.to_vec()
    }
}

/// A policy's `{ host, ports }` entries: what direct allowances were given for.
fn direct_entries(p: &egress_policy::Policy) -> Vec<&egress_policy::HostEntry> {
    p.allow_hosts
        .iter()
        .filter(|h| !h.ports.is_empty())
        .collect()
}

/// Static settings of an enforcer (one per runtime).
#[derive(Debug, Clone)]
pub struct Settings {
    pub root: WorkloadRoot,
    /// The stable proxy endpoint workloads use: for containers and pods IPv4 and non-loopback
    /// (e.g. 169.254.100.1:3128); a command under `exec` shares the host's network and may
    /// use loopback, or only IPv6 (`None`).
    pub endpoint4: Option<SocketAddrV4>,
    pub endpoint6: Option<SocketAddr>,
    /// Where per-workload listeners bind (port 0), one socket each. Containers and pods: the
    /// endpoint's IP (`proxy.listen`), no IPv6 listener (their entries refuse `endpoint_v6`);
    /// `exec`: that and `endpoint_v6`'s IP.
    pub listen: Vec<IpAddr>,
    /// Maintain the nftables host layer (the tables are created on the first change).
    pub nft: bool,
    /// Guard Docker's bridges at L2 until each container is classified: on when the BPF-LSM
    /// socket hook is unavailable.
    pub l2_guard: bool,
    /// Direct ports of `{ host, ports }` entries: the DNS answer sink, which also owns the host
    /// layer's direct sets.
    pub direct: Arc<super::direct::DirectPorts>,
    /// The agent's nftables tables, shared by its runtimes, and this runtime's name in them.
    pub tables: Arc<HostTables>,
    /// The workloads holding a real key (`status`), shared by the agent's runtimes.
    pub holders: crate::exposure::Holders,
    pub runtime: &'static str,
}

pub struct Enforcer {
    settings: Settings,
    config: Arc<Config>,
    proxy: ProxyContext,
    events: EventSink,
    entries: Entries,
    host: HostLayer,
    tracked: HashMap<String, Tracked>,
    /// Stops every container listener (agent shutdown): a child of the agent core's stop, whose
    /// tracker keeps the listeners' tasks.
    shutdown: Stop,
}

impl Enforcer {
    pub fn new(
        state: PinnedState,
        settings: Settings,
        config: Arc<Config>,
        proxy: ProxyContext,
        events: EventSink,
        directory: Directory,
        stop: Stop,
    ) -> Enforcer {
        let entries = Entries::new(
            state,
            directory,
            settings.endpoint4,
            settings.endpoint6,
            settings.runtime,
        );
        let host = HostLayer::new(
            settings
                .endpoint4
                .map_or(std::net::Ipv4Addr::UNSPECIFIED, |e| *e.ip()),
            settings.nft,
            settings.l2_guard,
            &settings.tables,
            settings.runtime,
        );
        Enforcer {
            settings,
            config,
            proxy,
            events,
            entries,
            host,
            tracked: HashMap::new(),
            shutdown: stop,
        }
    }

    pub fn directory(&self) -> Directory {
        self.entries.directory().clone()
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Ids of the containers the enforcer tracks.
    pub fn tracked_ids(&self) -> Vec<String> {
        self.tracked.keys().cloned().collect()
    }

    /// The listener serving container `id`, if any.
    pub fn listener_of(&self, id: &str) -> Option<SocketAddr> {
        let bound = self.tracked.get(id)?.listener.as_ref()?.bound;
        bound.v4.or(bound.v6).map(|(a, _)| a)
    }

    /// Name of a tracked container.
    pub fn name_of(&self, id: &str) -> Option<&str> {
        self.tracked.get(id).map(|t| t.info.name.as_str())
    }

    /// Is the container tracked as running (its `start` was handled)?
    pub fn is_running(&self, id: &str) -> bool {
        self.tracked.get(id).is_some_and(|t| t.info.running)
    }

    /// The configuration currently applied.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// The agent's own cgroup, when it lies under this root (the DaemonSet's pod under
    /// `/kubepods`): an `allow_all` entry, or the agent's own upstream connections would be
    /// refused like an unclassified workload's. Written before the agent dials anything; kept
    /// by reconciles (the cgroup exists while the agent runs). `Ok(None)`: outside the root.
    pub fn exempt_self(&mut self) -> Result<Option<u64>, String> {
        let dir = cgroup::cgroup_of_pid(std::process::id()).map_err(|e| e.to_string())?;
        if !self.settings.root.contains(&dir) {
            return Ok(None);
        }
        let id = cgroup::cgroup_id(&dir).map_err(|e| e.to_string())?;
        self.entries.write_self(id)?;
        self.entries.record(
            id,
            (egress_policy::ALLOW_ALL, "the agent itself".to_owned()),
            ContainerRef {
                id: format!("pid:{}", std::process::id()),
                name: "egress-agent".to_owned(),
            },
            std::collections::BTreeMap::new(),
        );
        tracing::info!(cgroup = %dir.display(), cgroup_id = id,
            "the agent runs under its enforcement root: its own cgroup is exempt (allow_all)");
        Ok(Some(id))
    }

    /// Protect the proxy address before becoming ready (see [`HostLayer::init`]).
    pub async fn init(&mut self) -> Result<(), EnforceError> {
        Ok(self.host.init().await?)
    }

    /// Start a reconcile or reload: host-rule writes wait for [`Enforcer::end_batch`].
    pub fn begin_batch(&mut self) {
        self.host.begin_batch();
    }

    /// End a reconcile (`synced`: it completed) or reload and write the host rules once.
    /// Returns the containers that must now be stopped (their rules failed and `deny_all`
    /// could not be written either).
    #[must_use = "refused containers must be stopped"]
    pub async fn end_batch(&mut self, synced: bool) -> Vec<(ContainerInfo, String)> {
        let failures = self.host.end_batch(synced).await;
        if synced {
            // Every workload claimed its handed-over sockets (a successor waits for this).
            self.proxy.sockets().reconciled(self.settings.runtime);
        }
        let mut refuse = Vec::new();
        for (id, why) in failures.0 {
            let Some(info) = self.tracked.get(&id).map(|t| t.info.clone()) else {
                continue;
            };
            if let Outcome::Refuse(r) = self.host_layer_failed(&info, &why) {
                refuse.push((info, r));
            }
        }
        refuse
    }

    /// The Docker bridge networks as listed now (reconcile).
    pub fn set_networks(&mut self, networks: std::collections::BTreeMap<String, String>) {
        self.host.set_networks(networks);
    }

    /// A Docker bridge network was created: guard its bridge before anything starts on it.
    pub async fn network_created(&mut self, network_id: &str, bridge: String) {
        self.host.network_created(network_id, bridge).await;
    }

    pub async fn network_destroyed(&mut self, network_id: &str) {
        self.host.network_destroyed(network_id).await;
    }

    fn resolve(&self, info: &ContainerInfo) -> Resolved {
        let labels = info.labels.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let mut resolved = match &info.pod {
            None => labels::resolve(labels, &self.config),
            Some(pod) => {
                let mut r = labels::resolve_pod(labels, &pod.namespace, &self.config);
                r.context.extend(pod.context.clone());
                r
            }
        };
        // Real keys in its environment: only an opted-in workload is the agent's to judge.
        if resolved.opted_in() {
            resolved.exposure = crate::exposure::check(&self.config, &info.env);
        }
        self.note_invalid(info, &resolved);
        self.note_exposure(info, &resolved);
        resolved
    }

    /// A pod's environment changed (an app container was created or removed): re-applied when
    /// what it holds changes (the pod's entry may become `deny_all`), else only remembered.
    pub async fn env_changed(&mut self, info: &ContainerInfo) -> Outcome {
        let Some(t) = self.tracked.get_mut(&info.id) else {
            return Outcome::Ok;
        };
        let now = if t.resolved.opted_in() {
            crate::exposure::check(&self.config, &info.env)
        } else {
            crate::exposure::Exposure::default()
        };
        if now == t.resolved.exposure {
            t.info.env = info.env.clone();
            return Outcome::Ok;
        }
        if info.running {
            self.started(info).await
        } else {
            self.prepare(info).await
        }
    }

    /// Prepare a container that is not running (from `create`, after `die`, or found stopped):
    /// pre-create its cgroup directory and write its entry, so the next `start` is enforced from
    /// the first instruction.
    #[tracing::instrument(skip_all, fields(container = %info.id, name = %info.name))]
    pub async fn prepare(&mut self, info: &ContainerInfo) -> Outcome {
        let resolved = self.resolve(info);
        let dir = match &info.pod {
            // A pod: its pod-level cgroup, read from the runtime (never derived from an id).
            Some(pod) => Some(self.settings.root.mount.join(&pod.cgroup_dir))
                .filter(|d| self.settings.root.contains(d)),
            None => self
                .settings
                .root
                .expected_dir(&info.id, &info.cgroup_parent),
        };
        let Some(dir) = dir else {
            return self.outside_root(info, resolved, None);
        };
        let id = match self.settings.root.precreate(&dir) {
            Ok(id) => id,
            Err(source) => {
                // runc will create it; `start` writes the entry. Until then: no entry = deny.
                tracing::warn!(dir = %dir.display(), error = %source, "cannot pre-create cgroup");
                self.track(info, resolved);
                return Outcome::Ok;
            }
        };
        self.apply_entry(info, resolved, dir.clone(), id, Some(dir))
            .await
    }

    /// Enforce a running container (from `start`, or found running): its real cgroup from
    /// /proc/<pid>/cgroup, then the host layer.
    #[tracing::instrument(skip_all, fields(container = %info.id, name = %info.name))]
    pub async fn started(&mut self, info: &ContainerInfo) -> Outcome {
        if info.pod.is_some() {
            // A pod's entry is its pod-level cgroup's, never the sandbox process's own cgroup;
            // once its sandbox runs (`info.pid`), its interfaces exist (the CNI plugin made them
            // before) and its host-layer rules follow.
            let outcome = self.prepare(info).await;
            if let Some(pid) = info.pid
                && let Some(clients) = self
                    .tracked
                    .get(&info.id)
                    .and_then(|t| t.listener.as_ref())
                    .and_then(|l| l.clients.as_ref())
                && let Err(e) = clients.attach(pid)
            {
                tracing::warn!(pid, error = %e, "the pod's clients can't be told apart: its events name the pod, not the container");
            }
            return match outcome {
                Outcome::Ok if info.pid.is_some() => self.host_layer(info).await,
                outcome => outcome,
            };
        }
        let resolved = self.resolve(info);
        let Some(pid) = info.pid else {
            return self.prepare(info).await;
        };
        let dir = match cgroup::cgroup_of_pid(pid) {
            Ok(d) => d,
            Err(source) => {
                // Exited already (or /proc unreadable): nothing runs; `die` follows.
                tracing::warn!(pid, error = %source, "cannot read the container's cgroup");
                self.track(info, resolved);
                return Outcome::Ok;
            }
        };
        if !self.settings.root.contains(&dir) {
            let opted_in = resolved.opted_in();
            let outcome = self.outside_root(info, resolved, Some(dir));
            if opted_in {
                return outcome;
            }
            // Unlabelled, elsewhere in the hierarchy: its ports must still be classified.
            return self.host_layer(info).await;
        }
        let id = match cgroup::cgroup_id(&dir) {
            Ok(id) => id,
            Err(source) => {
                tracing::warn!(dir = %dir.display(), error = %source, "cgroup vanished");
                self.track(info, resolved);
                return Outcome::Ok;
            }
        };
        let precreated = self
            .tracked
            .get(&info.id)
            .and_then(|t| t.precreated.clone());
        match self.apply_entry(info, resolved, dir, id, precreated).await {
            Outcome::Ok => self.host_layer(info).await,
            refuse => refuse,
        }
    }

    /// A command run by `exec` (a runtime of its own, [`ContainerInfo::command`]) in `dir`, the
    /// cgroup `exec` made for it under the root (id `id`), before the command starts: its
    /// entry, listener and directory record are written as for any other workload (with the
    /// same `deny_all` fallback). `Refuse`: not even `deny_all` could be written; don't run it.
    #[tracing::instrument(skip_all, fields(workload = %info.id, name = %info.name))]
    pub async fn command_started(
        &mut self,
        info: &ContainerInfo,
        dir: PathBuf,
        id: u64,
    ) -> Outcome {
        let resolved = self.resolve(info);
        self.apply_entry(info, resolved, dir, id, None).await
    }

    /// A pod's sandbox stopped: its interfaces are gone (its address may be given to another
    /// pod), so its host-layer rules go; its entry stays until the pod is removed.
    pub async fn pod_stopped(&mut self, sandbox_id: &str) {
        if let Some(t) = self.tracked.get_mut(sandbox_id) {
            t.info.running = false;
            t.info.pid = None;
        }
        self.host.remove(sandbox_id, "pod sandbox stopped").await;
    }

    /// Whether `info` (inspected after an event) runs in the very cgroup this container's
    /// entry is written for. A `die` seen then belongs to an earlier run of it — one replayed
    /// after the watcher (re)subscribed a second back, or whose restart is handled already —
    /// and releasing the entry would only deny the running container (and rebind its listener)
    /// until the `start` after it is applied again. Cgroup ids are not reused, so a container
    /// that really stopped and started since runs in another cgroup: `false`.
    pub fn runs_in_its_entry(&self, info: &ContainerInfo) -> bool {
        let (true, Some(pid)) = (info.running, info.pid) else {
            return false;
        };
        let Some((_, entry)) = self.tracked.get(&info.id).and_then(|t| t.cgroup.as_ref()) else {
            return false;
        };
        cgroup::cgroup_of_pid(pid)
            .and_then(|dir| cgroup::cgroup_id(&dir))
            .is_ok_and(|now| now == *entry)
    }

    /// The container stopped: release its entry, listener and host rules. Call [`Self::prepare`]
    /// afterwards if it still exists (restart).
    #[tracing::instrument(skip(self))]
    pub async fn stopped(&mut self, container_id: &str) {
        let Some(t) = self.tracked.get_mut(container_id) else {
            return;
        };
        if let Some((dir, id)) = t.cgroup.take() {
            // Keep `precreated` so destroy can remove a directory we made; runc removes its own.
            if t.precreated.as_ref() != Some(&dir) {
                t.precreated = None;
            }
            self.entries.remove(id);
            // Its requests and run grants are not kept for a restart any more.
            if let Some(asks) = self.proxy.asks() {
                asks.forget(container_id, id);
            }
        }
        if let Some(t) = self.tracked.get_mut(container_id) {
            t.listener = None;
        }
        self.host.remove(container_id, "container stopped").await;
    }

    /// The container is gone: release everything and forget it.
    #[tracing::instrument(skip(self))]
    pub async fn destroyed(&mut self, container_id: &str) {
        self.stopped(container_id).await;
        self.settings.holders.remove(container_id);
        if let Some(t) = self.tracked.remove(container_id)
            && let Some(dir) = t.precreated
            && let Err(e) = self.settings.root.remove_if_unused(&dir)
        {
            tracing::warn!(dir = %dir.display(), error = %e, "removing pre-created cgroup");
        }
    }

    async fn apply_entry(
        &mut self,
        info: &ContainerInfo,
        resolved: Resolved,
        dir: PathBuf,
        id: u64,
        precreated: Option<PathBuf>,
    ) -> Outcome {
        let plan = plan::plan(info, &resolved);
        // Re-applied to the same cgroup (reload) with other `{ host, ports }` entries: what the
        // old ones opened directly is taken back.
        if let Some(t) = self.tracked.get(&info.id)
            && t.cgroup.as_ref().is_some_and(|c| c.1 == id)
            && direct_entries(&plan::plan(&t.info, &t.resolved).policy)
                != direct_entries(&plan.policy)
        {
            self.settings.direct.forget(&info.id, id);
        }
        // A new cgroup id (restart, or runc beat us to it): drop the old entry.
        if let Some(old) = self.tracked.get_mut(&info.id).and_then(|t| t.cgroup.take())
            && old.1 != id
        {
            self.entries.remove(old.1);
        }
        let listener = if plan.listener {
            match self.listener_for(info, id, &plan, &resolved).await {
                Ok(l) => Some(l),
                Err(e) => {
                    // No listener: the kernel refuses the endpoint (listener None); the entry
                    // is still written, so the workload stays confined. A reload binds again.
                    tracing::error!(error = %e, "cannot start the container's proxy listener");
                    self.event(info, &resolved, Some(id), &format!("listener-failed: {e}"));
                    None
                }
            }
        } else {
            None
        };
        let addrs = listener.as_ref().map(|l| l.bound).unwrap_or_default();
        let gateways = self
            .tracked
            .get(&info.id)
            .map(|t| t.gateways.clone())
            .unwrap_or_default();
        let host = host_addrs(info, &gateways);
        if let Some(l) = &listener {
            l.set_host(&host);
        }
        let written_name = match self.entries.write_or_deny(
            id,
            &plan.policy,
            addrs,
            (&plan.published, &host),
        ) {
            Written::Policy => plan.policy_name.clone(),
            Written::DenyAll(why) => {
                tracing::error!(cgroup_id = id, error = %why, "writing policy entry failed; wrote deny_all");
                self.event(info, &resolved, Some(id), &format!("entry-failed: {why}"));
                egress_policy::DENY_ALL.to_owned()
            }
            Written::Failed(why) => {
                tracing::error!(cgroup_id = id, error = %why, "no kernel entry could be written");
                self.event(info, &resolved, Some(id), &format!("entry-failed: {why}"));
                self.track_with(info, resolved, None, precreated, None);
                return Outcome::Refuse(format!("cannot write a kernel entry: {why}"));
            }
        };
        tracing::info!(cgroup_id = id, policy = %written_name, source = %resolved.source,
            "container enforced");
        self.entries.record(
            id,
            (&written_name, source_of(info, &resolved.source)),
            container_ref(info),
            resolved.context.clone(),
        );
        let already_refused = self.tracked.get(&info.id).and_then(|t| t.refused.clone());
        self.track_with(
            info,
            resolved.clone(),
            Some((dir, id)),
            precreated,
            listener,
        );
        let Some(reasons) = plan.refuse else {
            return Outcome::Ok;
        };
        // One event per container and reason set (not one per create/die/prepare cycle).
        if already_refused.as_deref() != Some(reasons.as_str()) {
            self.event(
                info,
                &resolved,
                Some(id),
                &format!("refused-unconfinable: {reasons}"),
            );
        }
        if let Some(t) = self.tracked.get_mut(&info.id) {
            t.refused = Some(reasons.clone());
        }
        Outcome::Refuse(reasons)
    }

    /// Reuse the container's listener if it serves the same policy for the same cgroup, else
    /// bind a new one.
    async fn listener_for(
        &mut self,
        info: &ContainerInfo,
        cgroup_id: u64,
        plan: &Plan,
        resolved: &Resolved,
    ) -> std::io::Result<Listener> {
        if let Some(t) = self.tracked.get_mut(&info.id)
            && let Some(l) = t.listener.take()
            && l.policy == plan.policy_name
            && l.cgroup_id == cgroup_id
        {
            // Same name, possibly new content (reload): every new request sees it.
            l.set(&plan.policy);
            return Ok(l);
        }
        Listener::bind(
            &self.settings.listen,
            info,
            cgroup_id,
            &plan.policy_name,
            &plan.policy,
            &resolved.context,
            &self.proxy,
            // A pod's containers share its listener: its events name the container that asked.
            info.pod
                .is_some()
                .then(|| Arc::new(PodClients::new(self.directory()))),
            &self.shutdown,
        )
        .await
    }

    /// Host-side nftables rules for a running container on bridge networks: per-endpoint rules
    /// for an opted-in one, "known, unrestricted" ports for any other (until a container's ports
    /// are known, the guard drops its frames on Docker bridges).
    async fn host_layer(&mut self, info: &ContainerInfo) -> Outcome {
        let Some(t) = self.tracked.get(&info.id) else {
            return Outcome::Ok;
        };
        if !self.host.enabled() || info.host_network() {
            return Outcome::Ok;
        }
        let opted_in = t.resolved.opted_in();
        let plan = plan::plan(info, &t.resolved);
        let Some(proxy_ip) = self.settings.endpoint4.map(|e| *e.ip()) else {
            return Outcome::Ok;
        };
        let listener = match t.listener.as_ref().and_then(|l| l.bound.v4) {
            Some((SocketAddr::V4(l), intercept)) => Some((l, intercept)),
            _ => None,
        };
        let (Some(pid), false) = (info.pid, info.pod.is_none() && info.endpoints.is_empty()) else {
            // --network none / container:<id>: no interface of its own (any old ports are gone).
            self.host
                .remove(&info.id, "container left its networks")
                .await;
            return Outcome::Ok;
        };
        let eps = info.endpoints.clone();
        let pod = info.pod.is_some();
        let found = tokio::task::spawn_blocking(move || {
            if pod {
                netinfo::pod_endpoints(pid)
            } else {
                netinfo::host_endpoints(pid, &eps)
            }
        })
        .await;
        let endpoints = match found {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => return self.host_layer_failed(info, &e.to_string()),
            Err(e) => return self.host_layer_failed(info, &e.to_string()),
        };
        if let Err(e) = nft::Ruleset::check_endpoints(&endpoints) {
            return self.host_layer_failed(info, &e.to_string());
        }
        let gateways = endpoints_gateways(&endpoints);
        let entry = match plan::host_entry(opted_in, &plan, listener, proxy_ip, endpoints) {
            Ok(e) => e,
            Err(why) => return self.host_layer_failed(info, &why),
        };
        match self.host.put(&info.id, &info.name, entry).await {
            // The host layer's rules first, then the kernel's: a host service the cgroup
            // program lets through is never dropped by a rule not yet written.
            Ok(()) => self.learn_gateways(info, gateways),
            Err(why) => self.host_layer_failed(info, &why),
        }
    }

    /// The host layer found the workload's gateways: remember them, and where its policy
    /// allows host services, rewrite its kernel entry so they open there (and its DNS answers
    /// `host.docker.internal` with them). A workload confined as `deny_all` after a failed write
    /// stays so: only an entry that holds its policy is rewritten.
    fn learn_gateways(&mut self, info: &ContainerInfo, gateways: Vec<IpAddr>) -> Outcome {
        let Some(t) = self.tracked.get_mut(&info.id) else {
            return Outcome::Ok;
        };
        if t.gateways == gateways {
            return Outcome::Ok;
        }
        t.gateways = gateways;
        let plan = plan::plan(info, &t.resolved);
        let Some((_, id)) = t.cgroup.clone() else {
            return Outcome::Ok;
        };
        let holds_policy = self
            .entries
            .directory()
            .get(id)
            .is_some_and(|d| d.policy == plan.policy_name);
        if plan.policy.host_service_ports().is_empty() || !holds_policy {
            return Outcome::Ok;
        }
        let host = host_addrs(info, &t.gateways);
        let bound = match &t.listener {
            Some(l) => {
                l.set_host(&host);
                l.bound
            }
            None => Default::default(),
        };
        let resolved = t.resolved.clone();
        match self
            .entries
            .write_or_deny(id, &plan.policy, bound, (&plan.published, &host))
        {
            Written::Policy => {
                tracing::info!(cgroup_id = id, host = ?host, "host services opened at the workload's gateway");
                Outcome::Ok
            }
            Written::DenyAll(why) => {
                tracing::error!(cgroup_id = id, error = %why, "writing policy entry failed; wrote deny_all");
                self.event(info, &resolved, Some(id), &format!("entry-failed: {why}"));
                self.entries
                    .record_denied(id, container_ref(info), resolved.context.clone());
                Outcome::Ok
            }
            Written::Failed(why) => {
                self.event(info, &resolved, Some(id), &format!("entry-failed: {why}"));
                Outcome::Refuse(format!("cannot write a kernel entry: {why}"))
            }
        }
    }

    /// The host layer could not be set up for a container. An enforced one is confined as
    /// `deny_all` — and refused if even that can't be written. An unlabelled one stays
    /// unclassified: the guard keeps dropping its frames on Docker bridges (fail closed) until a
    /// later event or reconcile classifies it.
    fn host_layer_failed(&mut self, info: &ContainerInfo, why: &str) -> Outcome {
        let Some(t) = self.tracked.get(&info.id) else {
            return Outcome::Ok;
        };
        let resolved = t.resolved.clone();
        let id = t.cgroup.as_ref().map(|c| c.1);
        self.event(info, &resolved, id, &format!("host-layer-failed: {why}"));
        if !resolved.opted_in() {
            tracing::error!(container = %info.id, error = why, "host ports unknown; its frames stay dropped on Docker bridges");
            return Outcome::Ok;
        }
        tracing::error!(container = %info.id, error = why, "host layer unavailable; confining as deny_all");
        let Some(id) = id else {
            // No entry of ours: the kernel already treats the cgroup as deny_all.
            return Outcome::Ok;
        };
        match self.entries.deny(id, why.to_owned()) {
            Written::Failed(e) => Outcome::Refuse(format!("host layer failed ({e})")),
            Written::Policy | Written::DenyAll(_) => {
                self.entries
                    .record_denied(id, container_ref(info), resolved.context.clone());
                Outcome::Ok
            }
        }
    }

    fn outside_root(
        &mut self,
        info: &ContainerInfo,
        resolved: Resolved,
        dir: Option<PathBuf>,
    ) -> Outcome {
        let opted_in = resolved.opted_in();
        self.track(info, resolved.clone());
        if !opted_in {
            return Outcome::Ok;
        }
        let why = format!(
            "cgroup {} is outside the enforcement root {}",
            dir.map_or_else(
                || format!("parent {:?}", info.cgroup_parent),
                |d| d.display().to_string()
            ),
            self.settings.root.path().display()
        );
        self.event(
            info,
            &resolved,
            None,
            &format!("refused-cgroup-parent: {why}"),
        );
        Outcome::Refuse(why)
    }

    fn note_invalid(&self, info: &ContainerInfo, resolved: &Resolved) {
        if let Some(reason) = resolved.invalid_reason() {
            // Once per container lifetime is enough.
            if self
                .tracked
                .get(&info.id)
                .is_none_or(|t| t.resolved.invalid_reason() != Some(reason))
            {
                self.event(info, resolved, None, &format!("labels-invalid: {reason}"));
            }
        }
    }

    /// Report what a workload's environment holds, once per change: an event (variable names
    /// and why, never values; what was done) and the list `status` shows.
    fn note_exposure(&self, info: &ContainerInfo, resolved: &Resolved) {
        let before = self.tracked.get(&info.id);
        let exposure = &resolved.exposure;
        if before.map_or(exposure.is_empty(), |t| &t.resolved.exposure == exposure) {
            return;
        }
        self.settings.holders.set(crate::exposure::Holder {
            runtime: self.settings.runtime.to_owned(),
            id: info.id.clone(),
            name: info.name.clone(),
            policy: resolved.name.clone(),
            variables: exposure.holdings.iter().map(ToString::to_string).collect(),
            confined: exposure.confine,
        });
        if exposure.is_empty() {
            return;
        }
        let cgroup_id = before.and_then(|t| t.cgroup.as_ref().map(|c| c.1));
        let mut ev = self.event_of(info, resolved, cgroup_id, crate::exposure::REASON);
        ev.context.extend(exposure.context("confined deny_all"));
        self.events.emit(ev);
    }

    fn track(&mut self, info: &ContainerInfo, resolved: Resolved) {
        let t = self.tracked.get_mut(&info.id);
        let (cgroup, precreated, listener) = match t {
            Some(t) => (t.cgroup.take(), t.precreated.clone(), t.listener.take()),
            None => (None, None, None),
        };
        self.track_with(info, resolved, cgroup, precreated, listener);
    }

    fn track_with(
        &mut self,
        info: &ContainerInfo,
        resolved: Resolved,
        cgroup: Option<(PathBuf, u64)>,
        precreated: Option<PathBuf>,
        listener: Option<Listener>,
    ) {
        let (refused, gateways) = self
            .tracked
            .get(&info.id)
            .map(|t| (t.refused.clone(), t.gateways.clone()))
            .unwrap_or_default();
        self.tracked.insert(
            info.id.clone(),
            Tracked {
                info: info.clone(),
                resolved,
                cgroup,
                precreated,
                listener,
                refused,
                gateways,
            },
        );
    }

    /// An agent event about a container (refusals, invalid labels, failures).
    fn event(
        &self,
        info: &ContainerInfo,
        resolved: &Resolved,
        cgroup_id: Option<u64>,
        reason: &str,
    ) {
        self.events
            .emit(self.event_of(info, resolved, cgroup_id, reason));
    }

    fn event_of(
        &self,
        info: &ContainerInfo,
        resolved: &Resolved,
        cgroup_id: Option<u64>,
        reason: &str,
    ) -> DenialEvent {
        DenialEvent {
            time: SystemTime::now(),
            source: Source::Agent,
            cgroup_id,
            task_cgroup_id: None,
            container: Some(container_ref(info)),
            context: resolved.context.clone(),
            policy: resolved.name.clone(),
            host: None,
            ip: None,
            port: 0,
            protocol: if info.pod.is_some() {
                "containerd"
            } else if self.settings.runtime == "exec" {
                "exec"
            } else {
                "docker"
            }
            .to_owned(),
            reason: reason.to_owned(),
            verdict: crate::events::Verdict::Deny,
            rule: None,
            count: 1,
        }
    }

    /// Remove the kernel entries of cgroups that no longer exist (anywhere in the hierarchy).
    pub fn prune(&mut self) {
        let mount = self.settings.root.mount.clone();
        self.entries.prune(&mount);
    }

    /// Apply a new configuration to every tracked container (reload). Each container is
    /// re-resolved from its labels and re-applied exactly like on `start`/`create`: its kernel
    /// entry is overwritten in place (the cgroup always has an entry: never a moment without
    /// policy), a listener serving the same policy name gets the new policy atomically, a
    /// different policy gets a new listener. Returns the containers that must now be refused.
    #[must_use = "refused containers must be stopped"]
    pub async fn reconfigure(&mut self, config: Arc<Config>) -> Vec<(ContainerInfo, String)> {
        self.config = config;
        let infos: Vec<ContainerInfo> = self.tracked.values().map(|t| t.info.clone()).collect();
        let mut refuse = Vec::new();
        self.begin_batch();
        for info in infos {
            let outcome = if info.running {
                self.started(&info).await
            } else {
                self.prepare(&info).await
            };
            if let Outcome::Refuse(why) = outcome {
                refuse.push((info, why));
            }
        }
        refuse.extend(self.end_batch(false).await);
        tracing::info!(
            containers = self.tracked.len(),
            "configuration applied to tracked containers"
        );
        refuse
    }

    /// Agent shutdown: listeners stop (the endpoint is then refused); kernel entries and
    /// nftables rules stay (pinned, still enforcing).
    pub fn shutdown(&mut self) {
        self.shutdown.token().cancel();
        for t in self.tracked.values_mut() {
            t.listener = None;
        }
    }
}

/// The distinct gateways of a workload's endpoints, in endpoint order.
fn endpoints_gateways(endpoints: &[nft::Endpoint]) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for gw in endpoints.iter().filter_map(|e| e.gateway) {
        if !out.contains(&IpAddr::V4(gw)) {
            out.push(IpAddr::V4(gw));
        }
    }
    out
}

fn container_ref(info: &ContainerInfo) -> ContainerRef {
    ContainerRef {
        id: info.id.clone(),
        name: info.name.clone(),
    }
}

/// Where a workload's policy came from, as the console shows it: a pod's policy label is an
/// annotation, a command's is `exec --policy`.
fn source_of(info: &ContainerInfo, source: &crate::workload::labels::Source) -> String {
    use crate::workload::labels::Source;
    match source {
        Source::Named if info.pod.is_some() => "annotation".to_owned(),
        Source::Named if info.id.starts_with("exec:") => "exec --policy".to_owned(),
        Source::Invalid(_) => "invalid labels (deny_all)".to_owned(),
        other => other.to_string(),
    }
}
