//! Kubernetes pods through containerd: a second runtime plugged into the agent core beside
//! Docker, sharing its enforcer (entries, listeners, events).
//!
//! - [`cgroup_path`]: a pod's cgroup directories from the path runc is given (cgroupfs and
//!   systemd kubelet layouts).
//! - [`pod`]: containerd container records → pod sandboxes and app containers (pure).
//! - [`client`]: containerd's gRPC API (events, containers, task kills).
//! - [`watch`]: the event stream + reconcile loop.
//! - [`serve`]: the whole runtime in one call, on the core's stop token.
//!
//! A pod's policy comes from its `egress.*` annotations (the Docker labels' keys), else its
//! namespace's default (`[kubernetes] namespace_defaults`), else `agent.unlabeled`; malformed
//! annotations or an unknown policy confine the pod as `deny_all` with an event naming the
//! annotation. See `docs/architecture.md`, section Kubernetes.
pub mod cgroup_path;
pub mod client;
pub mod pod;
pub mod serve;
pub mod watch;

pub use serve::serve;
