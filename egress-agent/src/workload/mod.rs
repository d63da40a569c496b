//! The workload enforcer, the same for every runtime: Docker containers ([`crate::docker`]),
//! Kubernetes pods ([`crate::containerd`]). A runtime only reports what it sees (a
//! [`info::ContainerInfo`] per workload, created / started / stopped / destroyed); everything
//! done about a workload happens here.
//!
//! - [`labels`]: labels or annotations → the policy a workload gets (invalid → `deny_all` +
//!   reason).
//! - [`info`]: what the enforcer knows about a workload, whichever runtime reported it.
//! - [`root`]: the enforcement root and the workloads' cgroup2 directories (pre-created before
//!   `start`).
//! - [`netinfo`]: a workload's host-side veth and bridge, for the nftables layer.
//! - [`direct`]: direct ports of `{ host, ports }` entries, opened in both layers by DNS answers.
//! - [`directory`]: cgroup id → workload, policy and context, for attributing kernel events.
//! - [`pod_clients`]: the container of a pod a proxy or DNS client is in (sock_diag).
//! - [`plan`]: what a workload gets (pure decisions from its info and labels).
//! - [`entries`]: the workloads' kernel entries and the event directory (`deny_all` fallback).
//! - [`listeners`]: one proxy listener per opted-in workload.
//! - [`host_layer`]: the nftables ruleset, its batching and failed writes.
//! - [`enforce`]: the per-workload lifecycle, carrying plans out through the three above.
//! - [`site`]: what every runtime starts from ([`site::enforcer_at`]): the host-wide options,
//!   the programs at the runtime's root, the proxy context.
//! - [`reload`]: reloads and reconnect waits, the same for every runtime.
pub mod direct;
pub mod directory;
pub mod enforce;
pub mod entries;
pub mod host_layer;
pub mod info;
pub mod labels;
pub mod listeners;
pub mod netinfo;
pub mod plan;
pub mod pod_clients;
pub mod reload;
pub mod root;
pub mod site;

pub use directory::Directory;
pub use enforce::{Enforcer, Outcome};
pub use site::{Hooks, HostOptions, ServeError};

/// A configuration reload for the enforcer: `done` gets `Ok` once every tracked workload runs
/// under `config`, or the reason nothing was applied.
pub struct ReloadRequest {
    pub config: std::sync::Arc<crate::config::Config>,
    pub done: tokio::sync::oneshot::Sender<Result<(), String>>,
}
