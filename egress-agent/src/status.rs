//! `egress-agent status`: what is pinned and attached, each enforced cgroup with its policy and
//! counters. Reads the pinned maps and links directly, so it works without the daemon.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::bpf::{self, PinnedState};
use crate::cgroup;
use egress_policy::kernel;

#[derive(Debug, Serialize)]
pub struct Status {
    pub bpffs: PathBuf,
    pub loaded: bool,
    pub host_netns_cookie: u64,
    pub roots: Vec<RootStatus>,
    pub cgroups: Vec<CgroupStatus>,
    /// Loaded egress-agent programs with their run statistics (non-zero only while BPF run-time
    /// stats are enabled: `sysctl kernel.bpf_stats_enabled=1` or a BPF_ENABLE_STATS fd).
    pub programs: Vec<ProgramStatus>,
}

#[derive(Debug, Serialize)]
pub struct ProgramStatus {
    pub id: u32,
    /// Kernel program name (truncated to 15 bytes by the kernel).
    pub name: String,
    pub run_count: u64,
    pub run_time_ns: u64,
}

/// Loaded programs whose name starts with `egress_`.
pub fn programs() -> Vec<ProgramStatus> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| {
            let name = p.name_as_str()?.to_owned();
            name.starts_with("egress_").then(|| ProgramStatus {
                id: p.id(),
                name,
                run_count: p.run_count(),
                run_time_ns: p.run_time().as_nanos() as u64,
            })
        })
        .collect()
}

#[derive(Debug, Serialize)]
pub struct RootStatus {
    pub cgroup_id: u64,
    /// `None` when the cgroup no longer exists.
    pub path: Option<PathBuf>,
    /// Program names pinned for this root.
    pub pinned_links: Vec<String>,
    /// Programs attached to the root's cgroup, per attach type (BPF_PROG_QUERY), to spot
    /// duplicates (`> 1`) or missing attachments (`0`).
    pub attached: BTreeMap<String, usize>,
}

#[derive(Debug, Serialize)]
pub struct CgroupStatus {
    pub cgroup_id: u64,
    pub path: Option<PathBuf>,
    /// Policy name recorded by the writer of the entry.
    pub policy: Option<String>,
    /// Who wrote the entry (`exec:<pid>`, a container, ...).
    pub owner: Option<String>,
    /// `None`: counters of a cgroup denied for lack of an entry.
    pub mode: Option<&'static str>,
    pub listener: Vec<String>,
    pub allowed: u64,
    pub denied: u64,
    pub proxied: u64,
    pub events_lost: u64,
}

/// Number of programs attached directly to `cgroup_dir` for each hook we use.
pub fn attached_programs(cgroup_dir: &Path) -> std::io::Result<BTreeMap<String, usize>> {
    use bpf::sys::attach_type as at;
    let dir = File::open(cgroup_dir)?;
    let mut out = BTreeMap::new();
    for (name, t) in [
        ("connect4", at::CGROUP_INET4_CONNECT),
        ("connect6", at::CGROUP_INET6_CONNECT),
        ("sendmsg4", at::CGROUP_UDP4_SENDMSG),
        ("sendmsg6", at::CGROUP_UDP6_SENDMSG),
        ("skb_egress", at::CGROUP_INET_EGRESS),
        ("sock_create", at::CGROUP_INET_SOCK_CREATE),
        ("lsm_cgroup", at::LSM_CGROUP),
    ] {
        let n = bpf::sys::query_cgroup_programs(&dir, t)
            .map(|v| v.len())
            .unwrap_or(0);
        out.insert(name.to_owned(), n);
    }
    Ok(out)
}

/// Collect the status from the pins under `bpffs`.
pub fn collect(bpffs: &Path) -> Result<Status, bpf::BpfError> {
    let ids = cgroup::cgroup2_mount()
        .map(|m| cgroup::all_ids(&m))
        .unwrap_or_default();
    let roots: Vec<RootStatus> = bpf::loader::pinned_roots(bpffs)
        .into_iter()
        .map(|(id, links)| {
            let path = ids.get(&id).cloned();
            let attached = path
                .as_deref()
                .and_then(|p| attached_programs(p).ok())
                .unwrap_or_default();
            RootStatus {
                cgroup_id: id,
                path,
                pinned_links: links,
                attached,
            }
        })
        .collect();
    let st = match PinnedState::open(bpffs) {
        Ok(st) => st,
        Err(bpf::BpfError::NotLoaded { .. }) => {
            return Ok(Status {
                bpffs: bpffs.to_owned(),
                loaded: false,
                host_netns_cookie: 0,
                roots,
                cgroups: Vec::new(),
                programs: programs(),
            });
        }
        Err(e) => return Err(e),
    };
    let mut cgroups = Vec::new();
    let policies: BTreeMap<u64, egress_common::PolicyEntry> = st.policies()?.into_iter().collect();
    let mut all: Vec<u64> = policies.keys().copied().collect();
    all.extend(st.counter_ids());
    all.sort_unstable();
    all.dedup();
    for id in all {
        let c = st.counters(id)?;
        let entry = policies.get(&id);
        let (policy, owner) = st
            .name(id)
            .map_or((None, None), |(p, o)| (Some(p), Some(o)));
        cgroups.push(CgroupStatus {
            cgroup_id: id,
            policy,
            owner,
            path: ids.get(&id).cloned(),
            mode: entry.map(|e| kernel::mode_name(e.mode)),
            listener: entry
                .map(|e| {
                    [kernel::entry_listener4(e), kernel::entry_listener6(e)]
                        .into_iter()
                        .flatten()
                        .map(|a| a.to_string())
                        .collect()
                })
                .unwrap_or_default(),
            allowed: c.allowed,
            denied: c.denied,
            proxied: c.proxied,
            events_lost: c.events_lost,
        });
    }
    Ok(Status {
        bpffs: bpffs.to_owned(),
        loaded: true,
        host_netns_cookie: st.global_config()?.host_netns_cookie,
        roots,
        cgroups,
        programs: programs(),
    })
}

/// Human-readable rendering.
pub fn render(s: &Status) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    writeln!(
        out,
        "bpffs: {} ({})",
        s.bpffs.display(),
        if s.loaded {
            "maps pinned"
        } else {
            "nothing loaded"
        }
    )
    .ok();
    for r in &s.roots {
        let path = r
            .path
            .as_ref()
            .map_or("(gone)".to_owned(), |p| p.display().to_string());
        writeln!(
            out,
            "root {} {}: links [{}]",
            r.cgroup_id,
            path,
            r.pinned_links.join(", ")
        )
        .ok();
        let attached: Vec<String> = r.attached.iter().map(|(k, v)| format!("{k}={v}")).collect();
        writeln!(out, "  attached: {}", attached.join(" ")).ok();
    }
    for p in &s.programs {
        if p.run_count > 0 {
            writeln!(
                out,
                "program {} {}: {} runs, {:.0} ns/run",
                p.id,
                p.name,
                p.run_count,
                p.run_time_ns as f64 / p.run_count as f64
            )
            .ok();
        }
    }
    if s.cgroups.is_empty() {
        writeln!(out, "no enforced cgroups").ok();
    }
    for c in &s.cgroups {
        let path = c
            .path
            .as_ref()
            .map_or("(gone)".to_owned(), |p| p.display().to_string());
        writeln!(
            out,
            "cgroup {} {}: policy {} ({}) owner {} listener [{}] allowed {} denied {} proxied {} events_lost {}",
            c.cgroup_id,
            path,
            c.policy.as_deref().unwrap_or("-"),
            c.mode.unwrap_or("no entry: deny_all"),
            c.owner.as_deref().unwrap_or("-"),
            c.listener.join(", "),
            c.allowed,
            c.denied,
            c.proxied,
            c.events_lost
        ).ok();
    }
    out
}

/// `egress-agent status [--json]`.
pub fn run(bpffs: &Path, json: bool) -> anyhow::Result<()> {
    // Pinned maps and links can only be opened with CAP_BPF/CAP_SYS_ADMIN: say so up front.
    bpf::loader::require_root()?;
    let s = collect(bpffs)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", render(&s));
    }
    Ok(())
}
