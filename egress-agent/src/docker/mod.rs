//! Docker integration: containers opt in by label and are confined from their first instruction.
//!
//! - [`labels`]: container labels → the policy a container gets (invalid → `deny_all` + reason).
//! - [`container`]: what is taken from `docker inspect`, and what makes a container unconfinable.
//! - [`cgroups`]: the enforcement root and the containers' cgroup2 directories (pre-created
//!   before `start`).
//! - [`netinfo`]: a container's host-side veth and bridge, for the nftables layer.
//! - [`direct`]: direct ports of `{ host, ports }` entries, opened in both layers by DNS answers.
//! - [`directory`]: cgroup id → container, policy and context, for attributing kernel events.
//! - [`plan`]: what a container gets (pure decisions from its inspect data and labels).
//! - [`entries`]: the containers' kernel entries and the event directory (`deny_all` fallback).
//! - [`listeners`]: one proxy listener per opted-in container.
//! - [`host_layer`]: the nftables ruleset, its batching and failed writes.
//! - [`enforce`]: the per-container lifecycle, carrying plans out through the three above.
//! - [`watch`]: the bollard event stream + reconcile loop ([`watch::run`]).
//! - [`serve`]: the whole setup for the daemon in one call ([`serve::serve_with`]), a runtime
//!   plugged into the agent core ([`crate::agent`]).
//!
//! See `docs/architecture.md`, section Docker, for the lifecycle and why it is race-free.
pub mod cgroups;
pub mod container;
pub mod direct;
pub mod directory;
pub mod enforce;
pub mod entries;
pub mod host_layer;
pub mod labels;
pub mod listeners;
pub mod netinfo;
pub mod plan;
pub mod pod_clients;
pub mod serve;
pub mod watch;

pub use directory::{DirEntry, Directory};
pub use enforce::{Enforcer, Outcome, Settings};
pub use serve::{DockerOptions, Hooks, ServeError, cleanup_host, serve_with};
pub use watch::run;

/// A configuration reload for the Docker enforcer: `done` gets `Ok` once every tracked container
/// runs under `config`, or the reason nothing was applied.
pub struct ReloadRequest {
    pub config: std::sync::Arc<crate::config::Config>,
    pub done: tokio::sync::oneshot::Sender<Result<(), String>>,
}
