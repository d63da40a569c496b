//! Docker integration: containers opt in by label and are confined from their first instruction.
//! Docker only feeds the runtime-neutral enforcer ([`crate::workload`]).
//!
//! - [`container`]: what is taken from `docker inspect`, and what makes a container unconfinable.
//! - [`watch`]: the bollard event stream + reconcile loop ([`watch::run`]).
//! - [`serve`]: the whole setup for the daemon in one call ([`serve::serve_with`]), a runtime
//!   plugged into the agent core ([`crate::agent`]).
//!
//! See `docs/architecture.md`, section Docker, for the lifecycle and why it is race-free.
pub mod container;
pub mod serve;
pub mod watch;

pub use serve::{DockerOptions, serve_with};
