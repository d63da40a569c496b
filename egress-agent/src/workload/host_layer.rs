//! The nftables host layer of the Docker integration: the in-memory [`nft::Ruleset`], when it is
//! written, and what happens when a write fails.
//!
//! The ruleset is rebuilt whole on every write (one atomic netlink batch, off the async
//! workers). Writes are deferred while a reconcile or reload runs ([`HostLayer::begin_batch`],
//! [`HostLayer::end_batch`]) and never happen before the first reconcile completed: until then
//! the previous agent's tables, if any, stay in force (rewriting them from an empty state would
//! cut every running container off its bridge). A write that fails leaves the kernel with the
//! previous ruleset (the batch is atomic); the containers whose rules it carried are handed back
//! to the caller, which confines them another way ([`super::enforce`]: `deny_all`, or stopping
//! them).
//!
//! The kernel is reached through [`RulesetWriter`], implemented by [`Netlink`] (the only
//! implementation outside tests): a seam so unit tests can make writes fail.
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::nft;

/// Writes rulesets to the kernel.
pub trait RulesetWriter: Send + Sync + 'static {
    /// Replace our tables with `ruleset` in one atomic batch ([`nft::Ruleset::apply`]).
    fn apply(&self, ruleset: &nft::Ruleset) -> Result<(), nft::NftError>;
    /// Do our tables exist ([`nft::tables_exist`])?
    fn tables_exist(&self) -> Result<bool, nft::NftError>;
}

/// The agent's two tables, shared by its runtimes (Docker, containerd): each runtime's host
/// layer keeps its own part of the ruleset, and every write is the union of all parts in one
/// batch — tables are rebuilt whole, so two writers of their own would erase each other's
/// workloads (and each other's proxy-address accepts). The live direct-port elements the DNS
/// answers wrote ([`nft::DirectSets`]) are one set for all runtimes for the same reason.
#[derive(Debug, Default)]
pub struct HostTables {
    direct: Arc<nft::DirectSets>,
    parts: std::sync::Mutex<BTreeMap<&'static str, nft::Ruleset>>,
    /// [`nft::Ruleset::agent_ports`], set by the daemon before any runtime writes.
    agent_ports: std::sync::Mutex<std::collections::BTreeSet<u16>>,
}

impl HostTables {
    pub fn new() -> HostTables {
        HostTables::default()
    }

    /// The TCP ports of the agent's own services (console, metrics): every write drops enforced
    /// workloads' packets to them ([`nft::Ruleset::agent_ports`]).
    pub fn agent_services(&self, ports: impl IntoIterator<Item = u16>) {
        let mut p = self.agent_ports.lock().unwrap_or_else(|p| p.into_inner());
        p.extend(ports);
    }

    /// The direct-port sets every runtime's DNS answers fill.
    pub fn direct(&self) -> Arc<nft::DirectSets> {
        self.direct.clone()
    }

    /// The writer of `runtime`'s part.
    pub fn writer(self: &Arc<Self>, runtime: &'static str) -> Arc<dyn RulesetWriter> {
        Arc::new(Netlink {
            tables: self.clone(),
            runtime,
        })
    }

    /// Write `runtime`'s part with every other runtime's as last written. On failure the kernel
    /// keeps the previous tables, and so does the record of this runtime's part.
    fn apply(&self, runtime: &'static str, part: &nft::Ruleset) -> Result<(), nft::NftError> {
        // One writer at a time: the union must not interleave with another runtime's write.
        let mut parts = self.parts.lock().unwrap_or_else(|p| p.into_inner());
        let previous = parts.insert(runtime, part.clone());
        let mut merged = merge(part.proxy_ip, parts.values());
        merged.agent_ports = self
            .agent_ports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let written = merged.apply(&self.direct);
        if written.is_err() {
            match previous {
                Some(p) => parts.insert(runtime, p),
                None => parts.remove(runtime),
            };
        }
        written
    }
}

/// The union of the runtimes' parts (workload ids are the runtimes' own: Docker container ids
/// and pod sandbox ids never coincide).
fn merge<'a>(
    proxy_ip: std::net::Ipv4Addr,
    parts: impl Iterator<Item = &'a nft::Ruleset>,
) -> nft::Ruleset {
    let mut all = nft::Ruleset::new(proxy_ip);
    for p in parts {
        all.containers
            .extend(p.containers.iter().map(|(k, v)| (k.clone(), v.clone())));
        all.unrestricted
            .extend(p.unrestricted.iter().map(|(k, v)| (k.clone(), v.clone())));
        all.guarded_bridges
            .extend(p.guarded_bridges.iter().cloned());
    }
    all
}

/// The real writer of one runtime's part: netlink to nf_tables in the agent's network
/// namespace, through the agent's [`HostTables`].
struct Netlink {
    tables: Arc<HostTables>,
    runtime: &'static str,
}

impl RulesetWriter for Netlink {
    fn apply(&self, ruleset: &nft::Ruleset) -> Result<(), nft::NftError> {
        self.tables.apply(self.runtime, ruleset)
    }
    fn tables_exist(&self) -> Result<bool, nft::NftError> {
        nft::tables_exist()
    }
}

/// A container's place in the host layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEntry {
    /// An opted-in container: per-endpoint rules.
    Enforced(nft::Enforced),
    /// A classified container that is not restricted: its ports are known (not guarded).
    Unrestricted(Vec<nft::Endpoint>),
}

pub struct HostLayer {
    /// Maintain the tables at all (`--no-nft` turns this off).
    enabled: bool,
    /// Guard Docker's bridges at L2 (only where BPF-LSM can't refuse AF_PACKET).
    l2_guard: bool,
    ruleset: nft::Ruleset,
    /// Docker bridge networks: network id → bridge name.
    networks: BTreeMap<String, String>,
    /// A reconcile completed at least once.
    synced: bool,
    /// Inside a reconcile or reload.
    batch: bool,
    /// Containers whose rules changed since the last write (deferred).
    pending: Vec<String>,
    /// Container names, for the log.
    names: std::collections::HashMap<String, String>,
    writer: Arc<dyn RulesetWriter>,
}

/// Containers whose rules could not be written: (container id, why).
#[must_use = "containers whose host rules failed must be confined another way"]
#[derive(Debug, Default)]
pub struct WriteFailures(pub Vec<(String, String)>);

impl HostLayer {
    /// `runtime`'s layer in the agent's shared `tables`.
    pub fn new(
        proxy_ip: std::net::Ipv4Addr,
        enabled: bool,
        l2_guard: bool,
        tables: &Arc<HostTables>,
        runtime: &'static str,
    ) -> HostLayer {
        HostLayer::with_writer(proxy_ip, enabled, l2_guard, tables.writer(runtime))
    }

    /// [`HostLayer::new`] writing through `writer` (tests inject failing ones).
    pub fn with_writer(
        proxy_ip: std::net::Ipv4Addr,
        enabled: bool,
        l2_guard: bool,
        writer: Arc<dyn RulesetWriter>,
    ) -> HostLayer {
        HostLayer {
            writer,
            enabled,
            l2_guard,
            ruleset: nft::Ruleset::new(proxy_ip),
            networks: BTreeMap::new(),
            synced: false,
            batch: false,
            pending: Vec::new(),
            names: std::collections::HashMap::new(),
        }
    }

    /// Protect the proxy address from the start. Existing tables (a restart) are kept until the
    /// first reconcile; otherwise the empty ruleset is written. An error here must stop the
    /// start: without it the proxy address is reachable from the LAN.
    pub async fn init(&mut self) -> Result<(), nft::NftError> {
        if !self.enabled {
            return Ok(());
        }
        let ruleset = self.ruleset.clone();
        let writer = self.writer.clone();
        let done = tokio::task::spawn_blocking(move || {
            if writer.tables_exist()? {
                tracing::info!("nftables tables present: kept until the first reconcile");
                Ok(())
            } else {
                writer.apply(&ruleset)
            }
        })
        .await;
        match done {
            Ok(r) => r,
            Err(e) => Err(nft::NftError::Socket(std::io::Error::other(e.to_string()))),
        }
    }

    fn deferred(&self) -> bool {
        self.batch || !self.synced
    }

    pub fn begin_batch(&mut self) {
        self.batch = true;
    }

    /// End a reconcile (`synced`: it completed) or reload and write once. On failure the
    /// containers changed in the batch are taken out of the ruleset, the rest is written again,
    /// and the failed ones are returned.
    pub async fn end_batch(&mut self, synced: bool) -> WriteFailures {
        self.batch = false;
        if synced {
            self.synced = true;
        }
        if !self.enabled || !self.synced {
            return WriteFailures::default();
        }
        let mut pending = std::mem::take(&mut self.pending);
        pending.sort();
        pending.dedup();
        let failure = match self.write().await {
            Ok(()) => {
                for id in &pending {
                    self.log_classified(id);
                }
                return WriteFailures::default();
            }
            Err(why) => why,
        };
        tracing::error!(error = %failure, containers = pending.len(), "writing the nftables ruleset failed");
        for id in &pending {
            self.ruleset.containers.remove(id);
            self.ruleset.unrestricted.remove(id);
        }
        if let Err(e) = self.write().await {
            tracing::error!(error = %e, "writing the nftables ruleset failed again; the previous one stays");
        }
        WriteFailures(
            pending
                .into_iter()
                .map(|id| (id, failure.clone()))
                .collect(),
        )
    }

    async fn write(&self) -> Result<(), String> {
        // The netlink round trip grows with the ruleset: keep it off the async workers.
        let ruleset = self.ruleset.clone();
        let writer = self.writer.clone();
        match tokio::task::spawn_blocking(move || writer.apply(&ruleset)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Write now unless deferred; a failure is kept in memory (the next write includes it).
    async fn write_now(&mut self, what: &str) {
        if self.enabled
            && !self.deferred()
            && let Err(e) = self.write().await
        {
            tracing::error!(error = %e, change = what, "writing the nftables ruleset failed");
        }
    }

    fn log_classified(&self, id: &str) {
        let name = self.names.get(id).map_or("", String::as_str);
        if self.ruleset.containers.contains_key(id) {
            tracing::info!(container = %id, name, "host layer enforced");
        } else if self.ruleset.unrestricted.contains_key(id) {
            tracing::info!(container = %id, name, "host ports classified (unrestricted)");
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Put a container's rules in place. `Err(why)`: they could not be written (the kernel still
    /// has the previous ruleset, and the container is no longer in the in-memory one).
    pub async fn put(&mut self, id: &str, name: &str, entry: HostEntry) -> Result<(), String> {
        self.names.insert(id.to_owned(), name.to_owned());
        self.ruleset.containers.remove(id);
        self.ruleset.unrestricted.remove(id);
        match entry {
            HostEntry::Enforced(e) => self.ruleset.containers.insert(id.to_owned(), e).map(drop),
            HostEntry::Unrestricted(e) => {
                self.ruleset.unrestricted.insert(id.to_owned(), e).map(drop)
            }
        };
        if self.deferred() {
            self.pending.push(id.to_owned());
            return Ok(());
        }
        if let Err(why) = self.write().await {
            self.ruleset.containers.remove(id);
            self.ruleset.unrestricted.remove(id);
            return Err(why);
        }
        self.log_classified(id);
        Ok(())
    }

    /// Take a container's rules out (it stopped, or has no interface any more). Stale rules
    /// only restrict a gone address further, so a failed write is logged, not escalated.
    pub async fn remove(&mut self, id: &str, what: &str) {
        self.names.remove(id);
        let had = self.ruleset.containers.remove(id).is_some()
            | self.ruleset.unrestricted.remove(id).is_some();
        if had {
            self.write_now(what).await;
        }
    }

    /// The L2 guard covers Docker's bridges only where the kernel can't refuse AF_PACKET itself.
    fn sync_guarded_bridges(&mut self) {
        self.ruleset.guarded_bridges = if self.l2_guard {
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

    /// A Docker bridge network was created: guard its bridge now.
    pub async fn network_created(&mut self, network_id: &str, bridge: String) {
        if self.networks.get(network_id) == Some(&bridge) {
            return;
        }
        tracing::info!(network = network_id, %bridge, "docker bridge guarded");
        self.networks.insert(network_id.to_owned(), bridge);
        self.sync_guarded_bridges();
        self.write_now("network created").await;
    }

    pub async fn network_destroyed(&mut self, network_id: &str) {
        if self.networks.remove(network_id).is_some() {
            self.sync_guarded_bridges();
            self.write_now("network destroyed").await;
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// A writer that fails the writes scripted as `false` (in order; unscripted writes succeed)
    /// the way the kernel refuses a batch, and records every ruleset it was asked to write.
    #[derive(Default)]
    struct Scripted {
        results: Mutex<VecDeque<bool>>,
        tables: Mutex<Option<bool>>,
        attempts: Mutex<Vec<nft::Ruleset>>,
    }

    impl Scripted {
        fn new(results: &[bool]) -> Arc<Scripted> {
            Arc::new(Scripted {
                results: Mutex::new(results.iter().copied().collect()),
                ..Default::default()
            })
        }
        fn attempts(&self) -> Vec<nft::Ruleset> {
            self.attempts.lock().unwrap().clone()
        }
    }

    fn eperm() -> nft::NftError {
        nft::NftError::Rejected(std::io::Error::from_raw_os_error(libc::EPERM))
    }

    impl RulesetWriter for Scripted {
        fn apply(&self, ruleset: &nft::Ruleset) -> Result<(), nft::NftError> {
            self.attempts.lock().unwrap().push(ruleset.clone());
            if self.results.lock().unwrap().pop_front().unwrap_or(true) {
                Ok(())
            } else {
                Err(eperm())
            }
        }
        fn tables_exist(&self) -> Result<bool, nft::NftError> {
            self.tables.lock().unwrap().ok_or_else(eperm)
        }
    }

    fn layer(w: &Arc<Scripted>) -> HostLayer {
        HostLayer::with_writer("169.254.100.1".parse().unwrap(), true, true, w.clone())
    }

    fn enforced(n: u8) -> HostEntry {
        HostEntry::Enforced(nft::Enforced {
            listener: format!("169.254.100.1:{}", 40000 + u16::from(n))
                .parse()
                .unwrap(),
            allow_cidrs: Vec::new(),
            allow_inbound: Vec::new(),
            redirects: Vec::new(),
            direct_ports: Vec::new(),
            host_ports: Vec::new(),
            endpoints: vec![nft::Endpoint {
                bridge: "br-test".into(),
                veth: format!("veth{n}"),
                mac: [2, 0, 0, 0, 0, n],
                ipv4: std::net::Ipv4Addr::new(198, 18, 0, n),
                gateway: None,
            }],
        })
    }

    fn ids(r: &nft::Ruleset) -> Vec<&str> {
        r.containers
            .keys()
            .chain(r.unrestricted.keys())
            .map(String::as_str)
            .collect()
    }

    /// A layer that has completed one reconcile with container `a` written.
    async fn synced_with_a(w: &Arc<Scripted>) -> HostLayer {
        let mut h = layer(w);
        h.begin_batch();
        h.put("a", "a", enforced(1)).await.unwrap();
        assert!(h.end_batch(true).await.0.is_empty());
        h
    }

    #[tokio::test]
    async fn nothing_is_written_before_the_first_reconcile() {
        let w = Scripted::new(&[]);
        let mut h = layer(&w);
        h.put("a", "a", enforced(1)).await.unwrap();
        h.begin_batch();
        let failed = h.end_batch(false).await;
        assert!(failed.0.is_empty());
        assert!(w.attempts().is_empty(), "the previous tables must stay");
    }

    #[tokio::test]
    async fn a_batch_is_written_once() {
        let w = Scripted::new(&[]);
        let mut h = synced_with_a(&w).await;
        h.begin_batch();
        h.put("b", "b", enforced(2)).await.unwrap();
        h.put("c", "c", HostEntry::Unrestricted(Vec::new()))
            .await
            .unwrap();
        assert_eq!(w.attempts().len(), 1, "deferred inside the batch");
        assert!(h.end_batch(false).await.0.is_empty());
        let attempts = w.attempts();
        assert_eq!(attempts.len(), 2);
        assert_eq!(ids(&attempts[1]), ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn a_failed_batch_hands_its_containers_back() {
        let w = Scripted::new(&[]);
        let mut h = synced_with_a(&w).await;
        *w.results.lock().unwrap() = [false].into();
        h.begin_batch();
        h.put("c", "c", enforced(3)).await.unwrap();
        h.put("b", "b", enforced(2)).await.unwrap();
        h.put("b", "b", enforced(2)).await.unwrap();
        let failed = h.end_batch(false).await;
        let got: Vec<&str> = failed.0.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(got, ["b", "c"], "each changed container once");
        assert!(
            failed.0.iter().all(|(_, why)| why.contains("os error 1")),
            "the kernel's cause is kept: {failed:?}"
        );
        // The failed write carried them; the retry carries only what was in force before.
        let attempts = w.attempts();
        assert_eq!(attempts.len(), 3);
        assert_eq!(ids(&attempts[1]), ["a", "b", "c"]);
        assert_eq!(ids(&attempts[2]), ["a"]);
        assert_eq!(ids(&h.ruleset), ["a"]);
    }

    #[tokio::test]
    async fn both_writes_failing_still_hands_them_back() {
        let w = Scripted::new(&[]);
        let mut h = synced_with_a(&w).await;
        *w.results.lock().unwrap() = [false, false].into();
        h.begin_batch();
        h.put("b", "b", enforced(2)).await.unwrap();
        let failed = h.end_batch(false).await;
        assert_eq!(failed.0.len(), 1);
        assert_eq!(failed.0[0].0, "b");
        assert_eq!(w.attempts().len(), 3);
        assert_eq!(ids(&h.ruleset), ["a"], "b is not in force anywhere");
    }

    #[tokio::test]
    async fn a_failed_single_write_is_an_error_for_that_container() {
        let w = Scripted::new(&[]);
        let mut h = synced_with_a(&w).await;
        *w.results.lock().unwrap() = [false].into();
        let e = h.put("b", "b", enforced(2)).await.unwrap_err();
        assert!(e.contains("os error 1"), "{e}");
        assert_eq!(ids(&h.ruleset), ["a"]);
    }

    #[tokio::test]
    async fn init_fails_when_the_tables_cannot_be_set_up() {
        // Tables of a previous agent: kept, nothing written.
        let w = Scripted::new(&[]);
        *w.tables.lock().unwrap() = Some(true);
        layer(&w).init().await.unwrap();
        assert!(w.attempts().is_empty());
        // None yet: the empty ruleset is written, and its failure fails the start.
        let w = Scripted::new(&[false]);
        *w.tables.lock().unwrap() = Some(false);
        let e = layer(&w).init().await.unwrap_err();
        assert!(e.to_string().contains("os error 1"), "{e}");
        assert_eq!(w.attempts().len(), 1);
        // Not even readable: the start fails too.
        let w = Scripted::new(&[]);
        assert!(layer(&w).init().await.is_err());
        assert!(w.attempts().is_empty());
    }

    #[test]
    fn the_tables_are_the_union_of_every_runtimes_part() {
        let ip = "169.254.100.1".parse().unwrap();
        let mut docker = nft::Ruleset::new(ip);
        let HostEntry::Enforced(a) = enforced(1) else {
            unreachable!()
        };
        docker.containers.insert("container".to_owned(), a);
        docker.guarded_bridges.insert("docker0".to_owned());
        let mut pods = nft::Ruleset::new(ip);
        let HostEntry::Enforced(b) = enforced(2) else {
            unreachable!()
        };
        pods.containers.insert("sandbox".to_owned(), b);
        pods.unrestricted.insert("plain".to_owned(), Vec::new());
        let all = merge(ip, [&docker, &pods].into_iter());
        assert_eq!(ids(&all), ["container", "sandbox", "plain"]);
        assert_eq!(all.guarded_bridges, docker.guarded_bridges);
        assert_eq!(all.proxy_ip, ip);
    }
}
