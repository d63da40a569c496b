//! Applies resolved policies to containers: the kernel entry for the container's cgroup, its own
//! proxy listener, and its nftables host rules.
//!
//! Fail closed everywhere: a container under the root with no entry is `deny_all` in the kernel;
//! when an entry can't be written with the container's policy, `deny_all` is written instead;
//! when the host layer can't be set up for an enforced container, its entry becomes `deny_all`
//! too. Containers that can't be confined (privileged, dangerous capabilities or mounts, cgroup
//! outside the root) are refused: the caller stops them.
//!
//! Proxy identity: every opted-in container gets a listener of its own (`proxy.listen`, port 0)
//! serving its policy; the kernel rewrites connections to the stable endpoint to it. So the
//! listener that accepted a connection *is* the container, and a second container can never use
//! the first's policy (the kernel refuses connecting to a listener that is not the cgroup's own,
//! and so does the nft layer). Unlabelled containers get `agent.unlabeled` without a listener.
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::oneshot;

use super::cgroups::DockerRoot;
use super::container::ContainerInfo;
use super::directory::{DirEntry, Directory};
use super::labels::{self, Resolved};
use super::netinfo;
use crate::bpf::{KernelPolicy, PinnedState};
use crate::policy::kernel::Endpoints;
use crate::cgroup;
use crate::config::Config;
use crate::events::{ContainerRef, DenialEvent, EventSink, Source};
use crate::nft;
use crate::policy::{Mode, Policy};
use crate::proxy::{PolicyProxy, ProxyContext};

#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error("kernel map: {0}")]
    Kernel(#[from] crate::bpf::BpfError),
    #[error(transparent)]
    KernelPolicy(#[from] crate::policy::kernel::KernelPolicyError),
    #[error("cgroup {path}: {source}")]
    Cgroup {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("proxy listener: {0}")]
    Listener(std::io::Error),
    #[error("nftables: {0}")]
    Nft(#[from] nft::NftError),
    #[error("host-side interfaces: {0}")]
    NetInfo(#[from] netinfo::NetInfoError),
    #[error("the Docker proxy endpoint must be IPv4 (got {0})")]
    Endpoint(SocketAddr),
}

/// What the caller must do after an enforcement step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Enforced (or deliberately left as `agent.unlabeled`).
    Ok,
    /// The container can't be confined: stop it. Its cgroup (if under the root) is `deny_all`.
    Refuse(String),
}

struct Listener {
    addr: SocketAddr,
    policy: String,
    /// Swaps the listener's policy in place (reload with the same policy name).
    handle: crate::proxy::PolicyHandle,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            // The receiver is gone only if the listener task already ended.
            if tx.send(()).is_err() {
                tracing::debug!(addr = %self.addr, "listener already stopped");
            }
        }
    }
}

struct Tracked {
    name: String,
    /// What Docker last told us about the container (labels, state): a reload re-applies from it.
    info: ContainerInfo,
    resolved: Resolved,
    /// The cgroup (dir, id) that has an entry written by us.
    cgroup: Option<(PathBuf, u64)>,
    /// A directory we created before `start` (removed on destroy if still empty).
    precreated: Option<PathBuf>,
    listener: Option<Listener>,
    /// In the nftables ruleset.
    in_nft: bool,
    /// Refused for these reasons (the event was emitted).
    refused: Option<String>,
}

/// Static settings of the Docker enforcer.
#[derive(Debug, Clone)]
pub struct Settings {
    pub root: DockerRoot,
    /// The stable proxy endpoint containers use (IPv4, non-loopback, e.g. 169.254.100.1:3128).
    pub endpoint4: SocketAddrV4,
    pub endpoint6: Option<SocketAddr>,
    /// Where per-container listeners bind (port 0). Normally the endpoint's IP.
    pub listen_ip: IpAddr,
    /// Maintain the nftables host layer (the tables are created on the first change).
    pub nft: bool,
    /// Guard Docker's bridges at L2 until each container is classified (see
    /// `sync_guarded_bridges`): on when the BPF-LSM socket hook is unavailable.
    pub l2_guard: bool,
}

pub struct Enforcer {
    state: PinnedState,
    settings: Settings,
    config: Arc<Config>,
    proxy: ProxyContext,
    events: EventSink,
    ruleset: nft::Ruleset,
    tracked: HashMap<String, Tracked>,
    directory: Directory,
    /// Docker bridge networks: network id → bridge name (guarded in the nft bridge table).
    networks: BTreeMap<String, String>,
    /// A reconcile completed at least once: until then the in-memory ruleset is incomplete and
    /// is never written (the previous agent's tables, if any, stay in force).
    nft_synced: bool,
    /// Inside a reconcile or reload: rule changes are written once, at [`Enforcer::end_batch`].
    nft_batch: bool,
    /// Containers whose host rules changed since the last write (deferred).
    nft_pending: Vec<String>,
}

impl Enforcer {
    pub fn new(
        state: PinnedState,
        settings: Settings,
        config: Arc<Config>,
        proxy: ProxyContext,
        events: EventSink,
    ) -> Enforcer {
        let ruleset = nft::Ruleset::new(*settings.endpoint4.ip());
        Enforcer {
            state,
            settings,
            config,
            proxy,
            events,
            ruleset,
            tracked: HashMap::new(),
            directory: Directory::default(),
            networks: BTreeMap::new(),
            nft_synced: false,
            nft_batch: false,
            nft_pending: Vec::new(),
        }
    }

    /// Use a directory shared with the caller (e.g. a kernel event reader of its own).
    pub fn with_directory(mut self, directory: Directory) -> Enforcer {
        self.directory = directory;
        self
    }

    pub fn directory(&self) -> Directory {
        self.directory.clone()
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
        self.tracked.get(id)?.listener.as_ref().map(|l| l.addr)
    }

    /// Make sure the proxy address is protected from the start. If the agent's tables exist
    /// (a restart) they are **kept** until the first reconcile has classified every running
    /// container: rewriting them from the empty state would cut every running container off its
    /// bridge (unknown ports) and drop the enforced ones' rules. Otherwise the empty ruleset is
    /// written (proxy protection; no bridge guarded yet).
    pub fn init_host_layer(&mut self) -> Result<(), EnforceError> {
        if self.settings.nft {
            if nft::tables_exist()? {
                tracing::info!("nftables tables present: kept until the first reconcile");
            } else {
                self.ruleset.apply()?;
            }
        }
        Ok(())
    }

    /// Host-rule changes are written only once per reconcile or reload, and never before the
    /// first reconcile completed.
    fn nft_deferred(&self) -> bool {
        self.nft_batch || !self.nft_synced
    }

    /// Start a reconcile or reload: defer rule writes to [`Enforcer::end_batch`].
    pub fn begin_batch(&mut self) {
        self.nft_batch = true;
    }

    /// End a reconcile (`synced`: it completed, so the in-memory state now covers every running
    /// container) or a reload, and write the ruleset once. If that write fails, every container
    /// changed in the batch is treated as a host-layer failure (opted-in ones → `deny_all`), and
    /// the rest is written again.
    pub async fn end_batch(&mut self, synced: bool) {
        self.nft_batch = false;
        if synced {
            self.nft_synced = true;
        }
        if !self.settings.nft || !self.nft_synced {
            return;
        }
        let mut pending = std::mem::take(&mut self.nft_pending);
        pending.sort();
        pending.dedup();
        let failure = match self.write_ruleset().await {
            Ok(()) => {
                for id in &pending {
                    self.log_host_layer(id);
                }
                return;
            }
            Err(why) => why,
        };
        tracing::error!(error = %failure, containers = pending.len(), "writing the nftables ruleset failed");
        for id in &pending {
            let Some(t) = self.tracked.get_mut(id) else {
                continue;
            };
            t.in_nft = false;
            let info = t.info.clone();
            self.ruleset.containers.remove(id);
            self.ruleset.unrestricted.remove(id);
            let _outcome = self.host_layer_failed(&info, &failure).await;
        }
        if let Err(e) = self.write_ruleset().await {
            tracing::error!(error = %e, "writing the nftables ruleset failed again; the previous one stays");
        }
    }

    async fn write_ruleset(&self) -> Result<(), String> {
        // The netlink round trip grows with the ruleset: keep it off the async workers.
        let ruleset = self.ruleset.clone();
        match tokio::task::spawn_blocking(move || ruleset.apply()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn log_host_layer(&self, id: &str) {
        let name = self.name_of(id).unwrap_or_default();
        if self.ruleset.containers.contains_key(id) {
            tracing::info!(container = %id, name = %name, "host layer enforced");
        } else if self.ruleset.unrestricted.contains_key(id) {
            tracing::info!(container = %id, name = %name, "host ports classified (unrestricted)");
        }
    }

    /// Is the container tracked as running (its `start` was handled)?
    pub fn is_running(&self, id: &str) -> bool {
        self.tracked.get(id).is_some_and(|t| t.info.running)
    }

    /// The L2 guard covers Docker's bridges only where the kernel can't refuse AF_PACKET itself
    /// (no BPF-LSM hook): there it is the only thing that stops a container's hand-made frames
    /// before the agent has written its rules. With the LSM hook active no bridge is guarded, so
    /// unlabelled containers are untouched from their first instruction.
    fn sync_guarded_bridges(&mut self) {
        self.ruleset.guarded_bridges = if self.settings.l2_guard {
            self.networks.values().cloned().collect()
        } else {
            Default::default()
        };
    }

    /// The Docker bridge networks as listed now (reconcile): replaces what was known.
    pub fn set_networks(&mut self, networks: BTreeMap<String, String>) {
        self.networks = networks;
        self.sync_guarded_bridges();
        tracing::info!(bridges = ?self.ruleset.guarded_bridges, "docker bridges guarded");
    }

    /// A Docker bridge network was created (`network create` event): guard its bridge now,
    /// before any container can be started on it.
    pub async fn network_created(&mut self, network_id: &str, bridge: String) {
        if self.networks.get(network_id) == Some(&bridge) {
            return;
        }
        tracing::info!(network = network_id, %bridge, "docker bridge guarded");
        self.networks.insert(network_id.to_owned(), bridge);
        self.sync_guarded_bridges();
        self.write_now("network created").await;
    }

    /// A Docker network was removed.
    pub async fn network_destroyed(&mut self, network_id: &str) {
        if self.networks.remove(network_id).is_some() {
            self.sync_guarded_bridges();
            self.write_now("network destroyed").await;
        }
    }

    /// Write the ruleset now unless deferred (then the batch's end writes it).
    async fn write_now(&mut self, what: &str) {
        if self.settings.nft
            && !self.nft_deferred()
            && let Err(e) = self.write_ruleset().await
        {
            // Kept in memory: the next write includes it.
            tracing::error!(error = %e, change = what, "writing the nftables ruleset failed");
        }
    }

    /// Prepare a container that is not running (from `create`, after `die`, or found stopped):
    /// pre-create its cgroup directory and write its entry, so the next `start` is enforced from
    /// the first instruction.
    pub async fn prepare(&mut self, info: &ContainerInfo) -> Outcome {
        let resolved = labels::resolve(
            info.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &self.config,
        );
        self.note_invalid(info, &resolved);
        let Some(dir) = self
            .settings
            .root
            .expected_dir(&info.id, &info.cgroup_parent)
        else {
            return self.outside_root(info, resolved, None);
        };
        let id = match self.settings.root.precreate(&dir) {
            Ok(id) => id,
            Err(source) => {
                // runc will create it; `start` writes the entry. Until then: no entry = deny.
                tracing::warn!(container = %info.id, dir = %dir.display(), error = %source, "cannot pre-create cgroup");
                self.track(info, resolved);
                return Outcome::Ok;
            }
        };
        let precreated = Some(dir.clone());
        self.apply_entry(info, resolved, dir, id, precreated).await
    }

    /// Enforce a running container (from `start`, or found running): its real cgroup from
    /// /proc/<pid>/cgroup, then the host layer.
    pub async fn started(&mut self, info: &ContainerInfo) -> Outcome {
        let resolved = labels::resolve(
            info.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &self.config,
        );
        self.note_invalid(info, &resolved);
        let Some(pid) = info.pid else {
            return self.prepare(info).await;
        };
        let dir = match cgroup::cgroup_of_pid(pid) {
            Ok(d) => d,
            Err(source) => {
                // Exited already (or /proc unreadable): nothing runs; `die` follows.
                tracing::warn!(container = %info.id, pid, error = %source, "cannot read the container's cgroup");
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
                tracing::warn!(container = %info.id, dir = %dir.display(), error = %source, "cgroup vanished");
                self.track(info, resolved);
                return Outcome::Ok;
            }
        };
        let precreated = self
            .tracked
            .get(&info.id)
            .and_then(|t| t.precreated.clone());
        let outcome = self.apply_entry(info, resolved, dir, id, precreated).await;
        if outcome != Outcome::Ok {
            return outcome;
        }
        self.host_layer(info).await
    }

    /// The container stopped: release its entry, listener and host rules. Call [`Self::prepare`]
    /// afterwards if it still exists (restart).
    pub fn stopped(&mut self, container_id: &str) {
        let Some(t) = self.tracked.get_mut(container_id) else {
            return;
        };
        if let Some((dir, id)) = t.cgroup.take() {
            if let Err(e) = self.state.remove_policy(id) {
                tracing::error!(container = container_id, cgroup_id = id, error = %e, "removing kernel entry failed");
            }
            self.directory.remove(id);
            // Keep `precreated` so destroy can remove a directory we made; runc removes its own.
            if t.precreated.as_ref() != Some(&dir) {
                t.precreated = None;
            }
        }
        t.listener = None;
        if t.in_nft {
            t.in_nft = false;
            self.ruleset.containers.remove(container_id);
            self.ruleset.unrestricted.remove(container_id);
            if self.nft_deferred() {
                return;
            }
            if let Err(e) = self.ruleset.apply() {
                // Stale rules only restrict the old IP further (and a gone veth's name matches
                // nothing); they are rebuilt on the next change.
                tracing::error!(container = container_id, error = %e, "removing nftables rules failed");
            }
        }
    }

    /// The container is gone: release everything and forget it.
    pub fn destroyed(&mut self, container_id: &str) {
        self.stopped(container_id);
        if let Some(t) = self.tracked.remove(container_id)
            && let Some(dir) = t.precreated
            && let Err(e) = self.settings.root.remove_if_unused(&dir)
        {
            tracing::warn!(container = container_id, dir = %dir.display(), error = %e, "removing pre-created cgroup");
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
        let refuse = resolved.opted_in() && !info.unconfinable.is_empty();
        // A new cgroup id (restart, or runc beat us to it): drop the old entry.
        if let Some(old) = self.tracked.get_mut(&info.id).and_then(|t| t.cgroup.take())
            && old.1 != id
        {
            if let Err(e) = self.state.remove_policy(old.1) {
                tracing::warn!(container = %info.id, cgroup_id = old.1, error = %e, "removing stale entry");
            }
            self.directory.remove(old.1);
        }
        let (policy_name, policy) = if refuse {
            (
                crate::policy::DENY_ALL.to_owned(),
                Arc::new(Policy::deny_all()),
            )
        } else {
            (resolved.name.clone(), resolved.policy.clone())
        };
        // deny_all needs no proxy (the kernel refuses even the endpoint).
        let listener = if resolved.opted_in() && !refuse && policy.mode != Mode::DenyAll {
            match self
                .listener_for(info, &policy_name, &policy, &resolved.context)
                .await
            {
                Ok(l) => Some(l),
                Err(e) => {
                    // No listener: the kernel refuses the endpoint (listener None); still enforced.
                    tracing::error!(container = %info.id, error = %e, "cannot start the container's proxy listener");
                    None
                }
            }
        } else {
            None
        };
        // A refused container gets no published ports either.
        let published: &[u16] = if refuse { &[] } else { &info.published_tcp };
        let written = self.write_entry(id, &policy, listener.as_ref().map(|l| l.addr), published);
        let written_name = match written {
            Ok(()) => policy_name,
            Err(e) => {
                tracing::error!(container = %info.id, cgroup_id = id, error = %e, "writing policy entry failed; writing deny_all");
                self.event(info, &resolved, Some(id), &format!("entry-failed: {e}"));
                if let Err(e2) = self.write_entry(id, &Policy::deny_all(), None, &[]) {
                    tracing::error!(container = %info.id, error = %e2, "writing deny_all failed too");
                    self.track_with(info, resolved, None, precreated, None);
                    return Outcome::Refuse(format!("cannot write a kernel entry: {e2}"));
                }
                crate::policy::DENY_ALL.to_owned()
            }
        };
        tracing::info!(container = %info.id, name = %info.name, cgroup_id = id, policy = %written_name,
            source = %resolved.source, "container enforced");
        self.record_name(id, &written_name, info);
        self.directory.set(
            id,
            DirEntry {
                container: ContainerRef {
                    id: info.id.clone(),
                    name: info.name.clone(),
                },
                policy: written_name,
                context: resolved.context.clone(),
            },
        );
        let reasons = info.unconfinable.join(", ");
        let already_refused = self.tracked.get(&info.id).and_then(|t| t.refused.clone());
        self.track_with(
            info,
            resolved.clone(),
            Some((dir, id)),
            precreated,
            listener,
        );
        if refuse {
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
            return Outcome::Refuse(reasons);
        }
        Outcome::Ok
    }

    /// Policy name and owner (`docker:<container name>`) of the cgroup, for `status` and the API's
    /// container list. Bookkeeping only: a failure is logged, enforcement is unaffected.
    fn record_name(&mut self, cgroup_id: u64, policy: &str, info: &ContainerInfo) {
        let owner = format!("docker:{}", info.name);
        if let Err(e) = self.state.set_name(cgroup_id, policy, &owner) {
            tracing::warn!(container = %info.id, cgroup_id, error = %e, "recording the policy name failed");
        }
    }

    /// Write the kernel entry of a container's cgroup. `published`: its published TCP ports
    /// (empty for fail-closed fallbacks).
    fn write_entry(
        &mut self,
        cgroup_id: u64,
        policy: &Policy,
        listener: Option<SocketAddr>,
        published: &[u16],
    ) -> Result<(), EnforceError> {
        let endpoints = Endpoints {
            endpoint4: Some(SocketAddr::V4(self.settings.endpoint4)),
            listener4: listener.filter(SocketAddr::is_ipv4),
            endpoint6: self.settings.endpoint6,
            listener6: None,
        };
        let kp = KernelPolicy::compile(policy, endpoints, published)?;
        self.state.set_policy(cgroup_id, &kp)?;
        Ok(())
    }

    /// Reuse the container's listener if it serves the same policy, else bind a new one.
    async fn listener_for(
        &mut self,
        info: &ContainerInfo,
        name: &str,
        policy: &Arc<Policy>,
        context: &BTreeMap<String, String>,
    ) -> Result<Listener, EnforceError> {
        if let Some(t) = self.tracked.get_mut(&info.id)
            && let Some(l) = t.listener.take()
            && l.policy == name
        {
            // Same name, possibly new content (reload): every new request sees it.
            l.handle.set(policy);
            return Ok(l);
        }
        let addr = SocketAddr::new(self.settings.listen_ip, 0);
        // The listener is this container's alone (the kernel sends only its cgroup here), so its
        // denial events can name the container and carry its context labels.
        let identity = crate::proxy::Identity {
            container: Some(ContainerRef {
                id: info.id.clone(),
                name: info.name.clone(),
            }),
            cgroup_id: None,
            context: context.clone(),
        };
        let proxy = PolicyProxy::bind_for(
            addr,
            name.to_owned(),
            policy.clone(),
            self.proxy.clone(),
            Some(identity),
        )
        .await
        .map_err(EnforceError::Listener)?;
        let local = proxy.local_addr();
        let handle = proxy.policy_handle();
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(proxy.run(async move {
            // Sender dropped or fired: either way, stop.
            let _stopped = rx.await;
        }));
        tracing::debug!(container = %info.id, policy = name, %local, "container proxy listener");
        Ok(Listener {
            addr: local,
            policy: name.to_owned(),
            handle,
            stop: Some(tx),
        })
    }

    /// Host-side nftables rules for a running container on bridge networks: per-endpoint rules
    /// for an opted-in one, "known, unrestricted" ports for any other (until a container's ports
    /// are known, the guard drops its frames on Docker bridges).
    async fn host_layer(&mut self, info: &ContainerInfo) -> Outcome {
        let Some(t) = self.tracked.get(&info.id) else {
            return Outcome::Ok;
        };
        if !self.settings.nft || info.host_network() {
            return Outcome::Ok;
        }
        let opted_in = t.resolved.opted_in();
        let policy = t.resolved.policy.clone();
        let listener = if !opted_in {
            None
        } else {
            match t.listener.as_ref().map(|l| l.addr) {
                Some(SocketAddr::V4(l)) => Some(l),
                // deny_all: no listener; port 0 matches no connection, so the proxy stays closed.
                None if policy.mode == Mode::DenyAll || t.resolved.invalid_reason().is_some() => {
                    Some(SocketAddrV4::new(*self.settings.endpoint4.ip(), 0))
                }
                _ => return self.host_layer_failed(info, "no proxy listener").await,
            }
        };
        let (Some(pid), false) = (info.pid, info.endpoints.is_empty()) else {
            // --network none / container:<id>: no interface of its own (any old ports are gone).
            if self.ruleset.containers.remove(&info.id).is_some()
                | self.ruleset.unrestricted.remove(&info.id).is_some()
            {
                self.write_now("container left its networks").await;
            }
            return Outcome::Ok;
        };
        let eps = info.endpoints.clone();
        let found = tokio::task::spawn_blocking(move || netinfo::host_endpoints(pid, &eps)).await;
        let endpoints = match found {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => return self.host_layer_failed(info, &e.to_string()).await,
            Err(e) => return self.host_layer_failed(info, &e.to_string()).await,
        };
        if let Err(e) = nft::Ruleset::check_endpoints(&endpoints) {
            return self.host_layer_failed(info, &e.to_string()).await;
        }
        self.ruleset.containers.remove(&info.id);
        self.ruleset.unrestricted.remove(&info.id);
        match listener {
            Some(listener) => {
                let allow_cidrs = if policy.mode == Mode::AllowAll {
                    vec![crate::policy::CidrRule {
                        net: "0.0.0.0/0".parse().expect("valid CIDR"),
                        ports: Vec::new(),
                    }]
                } else if policy.mode == Mode::DenyAll {
                    Vec::new()
                } else {
                    policy.allow_cidrs.clone()
                };
                self.ruleset.containers.insert(
                    info.id.clone(),
                    nft::Enforced {
                        listener,
                        allow_cidrs,
                        endpoints,
                    },
                );
            }
            None => {
                self.ruleset.unrestricted.insert(info.id.clone(), endpoints);
            }
        }
        if let Some(t) = self.tracked.get_mut(&info.id) {
            t.in_nft = true;
        }
        if self.nft_deferred() {
            self.nft_pending.push(info.id.clone());
            return Outcome::Ok;
        }
        if let Err(why) = self.write_ruleset().await {
            // The batch is atomic: the kernel still has the previous ruleset.
            self.ruleset.containers.remove(&info.id);
            self.ruleset.unrestricted.remove(&info.id);
            if let Some(t) = self.tracked.get_mut(&info.id) {
                t.in_nft = false;
            }
            return self.host_layer_failed(info, &why).await;
        }
        self.log_host_layer(&info.id);
        Outcome::Ok
    }

    /// The host layer could not be set up for a container. An enforced one is confined as
    /// deny_all. An unlabelled one stays unclassified: the guard keeps dropping its frames on
    /// Docker bridges (fail closed) until a later event or reconcile classifies it.
    async fn host_layer_failed(&mut self, info: &ContainerInfo, why: &str) -> Outcome {
        let Some(t) = self.tracked.get(&info.id) else {
            return Outcome::Ok;
        };
        let resolved = t.resolved.clone();
        if !resolved.opted_in() {
            tracing::error!(container = %info.id, error = why, "host ports unknown; its frames stay dropped on Docker bridges");
            let id = t.cgroup.as_ref().map(|c| c.1);
            self.event(info, &resolved, id, &format!("host-layer-failed: {why}"));
            return Outcome::Ok;
        }
        tracing::error!(container = %info.id, error = why, "host layer unavailable; confining as deny_all");
        let id = t.cgroup.as_ref().map(|c| c.1);
        self.event(info, &resolved, id, &format!("host-layer-failed: {why}"));
        if let Some(id) = id
            && let Err(e) = self.write_entry(id, &Policy::deny_all(), None, &[])
        {
            return Outcome::Refuse(format!(
                "host layer failed ({why}) and deny_all could not be written: {e}"
            ));
        }
        if let Some(id) = id {
            self.record_name(id, crate::policy::DENY_ALL, info);
            self.directory.set(
                id,
                DirEntry {
                    container: ContainerRef {
                        id: info.id.clone(),
                        name: info.name.clone(),
                    },
                    policy: crate::policy::DENY_ALL.to_owned(),
                    context: resolved.context.clone(),
                },
            );
        }
        Outcome::Ok
    }

    fn outside_root(
        &mut self,
        info: &ContainerInfo,
        resolved: Resolved,
        dir: Option<PathBuf>,
    ) -> Outcome {
        let opted_in = resolved.opted_in();
        self.track(info, resolved.clone());
        if opted_in {
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
            return Outcome::Refuse(why);
        }
        Outcome::Ok
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

    fn track(&mut self, info: &ContainerInfo, resolved: Resolved) {
        let precreated = self
            .tracked
            .get(&info.id)
            .and_then(|t| t.precreated.clone());
        let listener = self
            .tracked
            .get_mut(&info.id)
            .and_then(|t| t.listener.take());
        let cgroup = self.tracked.get_mut(&info.id).and_then(|t| t.cgroup.take());
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
        let in_nft = self.tracked.get(&info.id).is_some_and(|t| t.in_nft);
        let refused = self.tracked.get(&info.id).and_then(|t| t.refused.clone());
        self.tracked.insert(
            info.id.clone(),
            Tracked {
                name: info.name.clone(),
                info: info.clone(),
                resolved,
                cgroup,
                precreated,
                listener,
                in_nft,
                refused,
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
        self.events.emit(DenialEvent {
            time: SystemTime::now(),
            source: Source::Agent,
            cgroup_id,
            container: Some(ContainerRef {
                id: info.id.clone(),
                name: info.name.clone(),
            }),
            context: resolved.context.clone(),
            policy: resolved.name.clone(),
            host: None,
            ip: None,
            port: 0,
            protocol: "docker".to_owned(),
            reason: reason.to_owned(),
            verdict: crate::events::Verdict::Deny,
        });
    }

    /// Name of a tracked container.
    pub fn name_of(&self, id: &str) -> Option<&str> {
        self.tracked.get(id).map(|t| t.name.as_str())
    }

    /// Remove the kernel entries of cgroups that no longer exist (anywhere in the hierarchy).
    pub fn prune(&mut self) {
        // The cgroup listing must be taken after the map keys are read (bpf::PinnedState::prune):
        // a listing taken first would prune entries written meanwhile for new cgroups.
        let mount = self.settings.root.mount.clone();
        match self
            .state
            .prune(|| cgroup::all_ids(&mount).into_keys().collect())
        {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "pruned entries of vanished cgroups")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "prune failed"),
        }
    }

    /// Give up everything (agent shutdown): the kernel entries stay (pinned, still enforcing),
    /// listeners stop (the endpoint is then refused), nftables rules stay.
    /// Apply a new configuration to every tracked container (reload). Each container is
    /// re-resolved from its labels and re-applied exactly like on `start`/`create`: its kernel entry
    /// is overwritten in place (the cgroup always has an entry: never a moment without policy),
    /// a listener serving the same policy name gets the new policy atomically, a different policy
    /// gets a new listener. Returns the containers that must now be refused (stopped).
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
        self.end_batch(false).await;
        tracing::info!(
            containers = self.tracked.len(),
            "configuration applied to tracked containers"
        );
        refuse
    }

    /// The configuration currently applied.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    pub fn shutdown(&mut self) {
        for t in self.tracked.values_mut() {
            t.listener = None;
        }
    }
}
