//! `egress-agent cleanup`: the uninstall step. Removes the pinned programs and maps (which
//! detaches the programs), the nftables tables, the proxy address interface and the agent's own
//! empty cgroups. Stopping the agent does none of this on purpose: enforcement must survive it.

use std::path::Path;

use anyhow::{Context, Result};

use crate::{bpf, cgroup, exec, netif, nft};

/// What `cleanup` removed or could not remove.
#[derive(Debug, Default)]
pub struct Report {
    pub removed: Vec<String>,
    pub failed: Vec<String>,
}

fn remove_tree(dir: &Path, report: &mut Report) {
    if !dir.exists() {
        return;
    }
    // bpffs has no rename/recursive semantics of its own: unlink files bottom-up.
    match std::fs::remove_dir_all(dir) {
        Ok(()) => report.removed.push(format!("pins under {}", dir.display())),
        Err(e) => report.failed.push(format!("{}: {e}", dir.display())),
    }
}

/// Runs the cleanup. Each step is attempted even if an earlier one failed; the result is an
/// error if anything is left behind.
pub fn run(bpffs: &Path) -> Result<Report> {
    bpf::loader::require_root()?;
    let mut report = Report::default();
    {
        // Hold the loader lock: no exec or daemon may attach while pins disappear.
        let _lock = bpf::Loader::lock(bpffs).context("taking the loader lock")?;
        remove_tree(bpffs, &mut report);
        if bpf::loader::forget_verified() > 0 {
            report
                .removed
                .push("records of verified programs (/run/egress-agent)".into());
        }
    }
    match nft::cleanup() {
        Ok(()) => report.removed.push("nftables tables egress_agent".into()),
        Err(e) => report.failed.push(format!("nftables: {e}")),
    }
    match netif::cleanup() {
        Ok(()) => report.removed.push("interface egress0".into()),
        Err(e) => report.failed.push(format!("interface egress0: {e}")),
    }
    if let Ok(root) = exec::exec_root()
        && root.exists()
    {
        let mut left = 0;
        if let Ok(rd) = std::fs::read_dir(&root) {
            for e in rd.flatten().filter(|e| e.path().is_dir()) {
                let busy = cgroup::pids(&e.path())
                    .map(|p| !p.is_empty())
                    .unwrap_or(true);
                if busy || std::fs::remove_dir(e.path()).is_err() {
                    left += 1;
                }
            }
        }
        if left == 0 && std::fs::remove_dir(&root).is_ok() {
            report.removed.push(format!("cgroup {}", root.display()));
        } else {
            report.failed.push(format!(
                "cgroup {}: {left} child cgroup(s) still in use",
                root.display()
            ));
        }
    }
    Ok(report)
}
