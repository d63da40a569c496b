//! Loading, pinning and adopting the eBPF programs; per-cgroup policy entries; kernel events.
//!
//! - [`loader`]: bpffs mount, loader lock, load + attach or adopt per enforcement root, pins.
//! - [`state`]: the pinned maps (policy entries, CIDR rules, counters, global config).
//! - [`events`]: the denial ring buffer → `DenialEvent`s.
//! - [`redirects`]: original destinations and DNS-answer allowances (transparent interception).
//! - [`relay`]: the in-kernel tunnel relay (sockhash + sk_skb verdict), per proxy process.
//! - `sys`: the two raw syscalls aya does not wrap (the agent's other `unsafe` code is listed in
//!   docs/architecture.md, "Kernel enforcement model").
//!
//! [`enforce_root`] is the entry point for `exec` and the daemon.
mod error;
pub mod events;
pub mod loader;
pub mod redirects;
pub mod relay;
pub mod state;
#[allow(
    unsafe_code,
    reason = "raw getsockopt/bpf syscalls that aya 0.14 does not wrap"
)]
pub mod sys;

use std::path::Path;

pub use egress_policy::kernel::KernelPolicy;
pub use error::BpfError;
pub use loader::{Loader, RootReport};
pub use state::PinnedState;

use crate::cgroup;

/// Everything needed to write policy entries for cgroups under one enforcement root. The loader
/// lock is already released: it only serialises attach/adopt/prune, never entry writes.
pub struct Enforcement {
    pub state: PinnedState,
    pub report: RootReport,
    /// Entries removed because their cgroup no longer exists.
    pub pruned: Vec<u64>,
    /// Pinned roots removed because their cgroup no longer exists (their links were defunct).
    pub pruned_roots: Vec<u64>,
}

/// Load or adopt the programs on `root`, open the pinned maps, record the host network
/// namespace, and remove entries of cgroups that no longer exist.
pub fn enforce_root(bpffs: &Path, root: &Path, require_lsm: bool) -> Result<Enforcement, BpfError> {
    let mount = cgroup::cgroup2_mount().map_err(|_| BpfError::NoCgroup2)?;
    if !root.starts_with(&mount) {
        return Err(BpfError::Policy(format!(
            "enforcement root {} is not under the cgroup2 mount {}",
            root.display(),
            mount.display()
        )));
    }
    let mut loader = Loader::lock(bpffs)?;
    std::fs::create_dir_all(root).map_err(BpfError::io("creating cgroup", root))?;
    let report = loader.ensure_root(root, require_lsm)?;
    let mut state = PinnedState::open(bpffs)?;
    let cookie = sys::current_netns_cookie().map_err(|e| BpfError::Io {
        what: "reading SO_NETNS_COOKIE of",
        path: "the host netns".into(),
        source: e,
    })?;
    state.set_host_netns_cookie(cookie)?;
    // Map keys first, then the cgroup listing (see `PinnedState::prune`).
    let pruned = state.prune(|| cgroup::all_ids(&mount).into_keys().collect())?;
    let roots = loader::pinned_roots(bpffs);
    let ids = cgroup::all_ids(&mount);
    let mut pruned_roots = Vec::new();
    for (root_id, _) in roots {
        if !ids.contains_key(&root_id) {
            let dir = loader::root_pin_dir(bpffs, root_id);
            std::fs::remove_dir_all(&dir).map_err(BpfError::io("removing stale pins", &dir))?;
            pruned_roots.push(root_id);
        }
    }
    drop(loader);
    Ok(Enforcement {
        state,
        report,
        pruned,
        pruned_roots,
    })
}
