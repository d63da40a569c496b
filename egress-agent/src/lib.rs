//! egress-agent: confines the network egress of opted-in containers and commands.
//!
//! The policy model and every decision on it (names, matching, the address check, request
//! rules, credentials, response scrubbing, `explain`'s evaluation) are the `egress-policy` crate,
//! which does no I/O; the types the kernel programs share are `egress-common`. This crate is
//! everything that touches the machine, in layers (a module uses only those below it; the
//! `module_cycles` test keeps every two-way dependency out):
//!
//! - the core and its runtimes: [`agent`] (events, store, exporters, kernel events, one ordered
//!   stop) used by [`daemon`] (`run`: the Docker runtime [`docker`] — whose enforcer the
//!   Kubernetes runtime [`containerd`] shares —, the control API [`api`])
//!   and [`exec`] (one command in a fresh enforced cgroup, inside [`sandbox`]);
//! - restarts: [`handover`] (a new agent takes the running one's sockets; the old one drains);
//! - enforcement: [`bpf`] (loading, pinning and adopting the programs, per-cgroup entries, the
//!   kernel relay), [`nft`] (the nftables host layer), [`cgroup`], [`netif`], [`mountinfo`];
//! - what confined sockets reach: [`proxy`] (explicit CONNECT, transparent TLS/HTTP, TLS
//!   interception, the agent's DNS in [`proxy::dns`]), [`ca`] (the interception CA), [`secrets`]
//!   (loading credentials);
//! - workloads holding real keys: [`exposure`] (their environment checked against the bound
//!   secrets and the provider variables, for every runtime);
//! - records: [`events`] (the sink), [`store`] (SQLite), [`export`] (OTLP, syslog), [`metrics`],
//!   [`suggest`] (policies from observed traffic), `replay` (recorded traffic decided again
//!   under a proposed policy);
//! - management: [`config`] (the file and `policies.d`), [`manage`] (policy changes),
//!   [`check`], [`doctor`], [`status`], [`cleanup`], [`notify`] (sd_notify);
//! - surfaces: [`cli`] (commands that talk to a running agent), [`mcp`], [`ui`] (status page);
//! - below everything: [`tasks`] (how a stopped server ends its connections).
//!
//! `unsafe` is denied crate-wide; the exceptions, each with `expect(unsafe_code, reason)` and a
//! SAFETY comment: raw `bpf()`/sockopt syscalls (`bpf/sys.rs`), the ring buffer's fd registration
//! (`bpf/events.rs`), netlink buffers for nftables (`nft/`), splice/sockmap descriptors
//! (`proxy/splice/`), descriptors received in a hand-over (`handover/wire.rs`) and scrubbing a secret from the process environment (`secrets/sys.rs`).
#![deny(unsafe_code)]
mod agent;
pub mod api;
pub mod asks;
pub mod doctor;
pub mod metrics;
mod notify;

pub mod bpf;
pub mod ca;
mod cgroup;
pub mod check;
pub mod cleanup;
pub mod cli;
pub mod config;
pub mod containerd;
pub mod control_client;
pub mod daemon;
mod docker;
pub mod events;
pub mod exec;
pub mod export;
mod exposure;
pub mod handover;
mod host_tool;
mod http_post;
pub mod manage;
pub mod mcp;
mod mountinfo;
mod netif;
pub mod nft;
pub mod proxy;
mod replay;
pub mod sandbox;
mod secrets;
pub mod status;
pub mod store;
pub mod suggest;
mod tasks;
#[cfg(test)]
mod test_dir;
mod ui;
mod workload;
