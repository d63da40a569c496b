//! egress-agent: confines the network egress of opted-in containers and commands.
//!
//! Layout (each module does one job):
//! - [`config`]: the TOML configuration and the policy model shared by kernel and proxy.
//! - `policy`: hostname normalisation/matching and the address deny list used by the proxy.
//! - `proxy`: the co-located forward proxy (CONNECT + absolute-form HTTP), one listener per policy.
//! - `events`: structured denial events (log + in-memory ring).
//! - `bpf`: loading, pinning and adopting the eBPF programs; per-cgroup policy entries.
//! - `exec`: `egress-agent exec`, run one command in a fresh enforced cgroup.
// `deny`, not `forbid`: the loader's two raw syscalls (bpf/sys.rs) are the one allowed exception.
#![deny(unsafe_code)]
pub mod api;
pub mod doctor;
pub mod metrics;
pub mod notify;

pub mod bpf;
pub mod ca;
pub mod cgroup;
pub mod check;
pub mod cleanup;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod docker;
pub mod events;
pub mod exec;
pub mod export;
pub mod manage;
pub mod mcp;
pub mod mountinfo;
pub mod netif;
pub mod nft;
pub mod proxy;
pub mod sandbox;
pub mod secrets;
pub mod status;
pub mod store;
pub mod suggest;
pub mod ui;
