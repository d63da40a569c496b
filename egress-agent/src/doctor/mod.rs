//! `egress-agent doctor`: a read-only survey of the host's hardening.
//!
//! Every probe answers `pass`, `warn`, `fail` or `skip` with a one-line summary and, unless it passed,
//! a one-line fix. The doctor never changes anything (no mounts, no module loads, no rules) and never
//! hangs: each probe runs in its own task under a per-probe timeout, all of them under a global deadline.
//! A missing tool, socket or file the probe needs is `skip` with the reason, never `fail`.
//!
//! Layout:
//! - `host`: readers for the host files the probes look at (mountinfo, kernel config, /proc, sysctls).
//! - `kernel`: cgroup2, BTF, BPF LSM, cgroup BPF, nf_tables, unprivileged BPF.
//! - `pins`: bpffs and the agent's pinned maps and links.
//! - `proxy`: the proxy listeners accept connections.
//! - `interception`: TLS interception can be set up and every credential binding has its secret.
//! - `workloads`: no running workload holds a real key in its environment (the daemon's view).
//! - `docker`: a minimal Docker Engine API client and the Docker probes.
//! - `netfilter`: an nf_tables netlink dump (and legacy iptables) for the agent's table, the firewall
//!   default policies and IP forwarding.
//! - `docker_security`: Docker's seccomp, user namespace and rootless settings.
//! - `sshd_config` + `ssh`: sshd's effective configuration and the SSH probes.
//! - `perimeter`: fail2ban, firewalld and ufw through their clients.
//! - `tailscale`: Tailscale up, and SSH reachable only over it.
//! - `baseline`: the `--baseline` tables (which probes must pass) and their verdict.
//! - `view`: the text report (gaps only or all, the summary line).
//!
//! # JSON output (stable)
//! `egress-agent doctor --json` prints one JSON array, one object per probe, in the order of
//! [`PROBE_IDS`]:
//! ```json
//! [{"id": "kernel.cgroup2", "status": "pass", "summary": "cgroup2 mounted at /sys/fs/cgroup", "fix": null}]
//! ```
//! - `id` (string): one of [`PROBE_IDS`]; ids are never renamed or reused, new probes are appended.
//! - `status` (string): `pass` | `warn` | `fail` | `skip`.
//! - `summary` (string): one line, what was found.
//! - `fix` (string or null): one line, what to do; `null` when the status is `pass`.
//!
//! With `--baseline <name>` the document is an object instead, the array unchanged under `checks`:
//! ```json
//! {"baseline": {"name": "standard", "met": false, "required": 14,
//!               "missing": [{"id": "host.fail2ban", "status": "skip"}]},
//!  "checks": [{"id": "kernel.cgroup2", "status": "pass", "summary": "...", "fix": null}]}
//! ```
//!
//! The exit status is non-zero ([`Report::exit_code`]) if any probe failed (`--exit-zero`: always 0);
//! a missed baseline does not change it.

pub mod baseline;
mod containerd;
mod docker;
mod docker_security;
mod host;
pub mod interception;
mod kernel;
mod netfilter;
mod perimeter;
mod pins;
mod proxy;
mod ssh;
mod sshd_config;
mod tailscale;
mod tool;
mod view;
pub mod workloads;

use std::ffi::OsString;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::OnceCell;
use tokio::task::JoinSet;

pub use host::HostPaths;
pub use view::TextView;

/// Outcome of one probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Skip,
    Warn,
    Fail,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
            Status::Skip => "skip",
        }
    }
}

/// One probe's result: the element of the `--json` array.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable probe id, one of [`PROBE_IDS`].
    pub id: &'static str,
    pub status: Status,
    /// One line: what was found.
    pub summary: String,
    /// One line: what to do. `None` (JSON `null`) when the probe passed.
    pub fix: Option<String>,
}

/// The result of a doctor run: one [`Check`] per probe, in [`PROBE_IDS`] order.
#[derive(Clone, Debug, Serialize)]
#[serde(transparent)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// 1 if any probe failed, else 0.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.checks.iter().any(|c| c.status == Status::Fail))
    }

    /// The stable JSON document (see the module docs), pretty-printed, with a trailing newline.
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(&self.checks).unwrap_or_else(|_| "[]".into());
        s.push('\n');
        s
    }

    /// The JSON document with a baseline verdict: `{"baseline": <verdict>, "checks": <the
    /// stable array>}` (see the module docs); without a verdict, [`Report::to_json`].
    pub fn to_json_with(&self, verdict: Option<&baseline::Verdict>) -> String {
        let Some(verdict) = verdict else {
            return self.to_json();
        };
        let doc = serde_json::json!({ "baseline": verdict, "checks": self.checks });
        let mut s = serde_json::to_string_pretty(&doc).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }

    /// Human-readable output: one line per probe, the fix indented below it, then a tally
    /// (every probe, no baseline; see [`Report::render_text`] for the other views).
    pub fn to_text(&self) -> String {
        self.render_text(&TextView {
            all: true,
            ..TextView::default()
        })
    }
}

/// Where to look and how long to wait. [`Options::default`] describes a standard host.
#[derive(Clone, Debug)]
pub struct Options {
    /// Host files the probes read (tests point these at fixtures).
    pub paths: HostPaths,
    /// The agent's pin directory on bpffs (config `bpf.pin_dir`).
    pub pin_dir: PathBuf,
    /// The stable proxy endpoint confined processes connect to (config `proxy.endpoint`).
    pub proxy_endpoint: SocketAddr,
    /// Known policy listeners (e.g. from the control API). Empty: discover the listening sockets of
    /// processes named [`Options::agent_process_name`] through /proc.
    pub proxy_listeners: Vec<SocketAddr>,
    /// Listening sockets of the agent that are not proxy listeners (e.g. the metrics address).
    pub ignore_listeners: Vec<SocketAddr>,
    /// The agent's process name (`/proc/<pid>/comm`).
    pub agent_process_name: String,
    /// The Docker Engine API socket.
    pub docker_socket: PathBuf,
    /// Docker's daemon configuration (read for a non-upstream `default-capabilities` key).
    pub docker_daemon_json: PathBuf,
    /// Name of the agent's nftables tables (one `inet`, one `bridge`; see `nft/`).
    pub nft_table: String,
    /// `PATH` used to find external tools (`iptables-legacy`, `sshd`, `fail2ban-client`,
    /// `tailscale`, `firewall-cmd`, `ufw`); `None`: this process's `PATH`.
    pub tool_path: Option<OsString>,
    /// sshd's main configuration file (relative `Include`s are read under its directory).
    pub sshd_config: PathBuf,
    /// Query nf_tables over netlink (needs CAP_NET_ADMIN; `false` makes those probes `skip`).
    pub netlink: bool,
    /// containerd's configuration, read when the agent confines pods (`[kubernetes]`); `None`:
    /// no Kubernetes runtime, the probe is skipped.
    pub containerd_config: Option<PathBuf>,
    /// What `proxy.interception` judges: the daemon's view or the configuration's; `None`:
    /// nothing to judge, the probe is skipped.
    pub interception: Option<interception::InterceptionView>,
    /// What `workloads.secrets` judges: the running daemon's workloads holding a real key;
    /// `None` (no daemon answered): the probe is skipped.
    pub workload_secrets: Option<workloads::WorkloadSecretsView>,
    /// Per-probe timeout.
    pub probe_timeout: Duration,
    /// Deadline for the whole run; probes still running then are reported as `skip`.
    pub deadline: Duration,
}

/// Default pin directory (architecture: everything under `/sys/fs/bpf/egress-agent/`).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/egress-agent";
/// Default Docker socket.
pub const DEFAULT_DOCKER_SOCKET: &str = "/var/run/docker.sock";

impl Default for Options {
    fn default() -> Self {
        Options {
            paths: HostPaths::default(),
            pin_dir: PathBuf::from(DEFAULT_PIN_DIR),
            proxy_endpoint: SocketAddr::from((Ipv4Addr::LOCALHOST, 3128)),
            proxy_listeners: Vec::new(),
            ignore_listeners: Vec::new(),
            agent_process_name: "egress-agent".into(),
            docker_socket: PathBuf::from(DEFAULT_DOCKER_SOCKET),
            docker_daemon_json: PathBuf::from("/etc/docker/daemon.json"),
            nft_table: "egress_agent".into(),
            tool_path: None,
            sshd_config: PathBuf::from("/etc/ssh/sshd_config"),
            netlink: true,
            containerd_config: None,
            interception: None,
            workload_secrets: None,
            probe_timeout: Duration::from_secs(3),
            deadline: Duration::from_secs(8),
        }
    }
}

impl Options {
    /// Defaults, with the pin dir and proxy endpoint taken from the agent's configuration.
    pub fn from_config(cfg: &crate::config::Config) -> Self {
        Options {
            pin_dir: cfg.agent.bpffs.clone(),
            proxy_endpoint: cfg.proxy.endpoint,
            containerd_config: cfg.kubernetes.as_ref().map(|k| k.containerd_config.clone()),
            interception: Some(interception::InterceptionView::from_config(cfg)),
            ..Options::default()
        }
    }
}

/// Every probe id, in output order. Stable: ids are never renamed or reused; new ones are appended.
pub const PROBE_IDS: &[&str] = &[
    "kernel.cgroup2",
    "kernel.btf",
    "kernel.bpf_lsm",
    "kernel.cgroup_bpf",
    "kernel.nf_tables",
    "kernel.unprivileged_bpf",
    "bpf.bpffs",
    "bpf.pinned",
    "proxy.listening",
    "docker.reachable",
    "docker.cgroup_driver",
    "docker.net_raw",
    "docker.privileged",
    "nft.agent_table",
    "host.firewall_input",
    "host.firewall_forward",
    "host.ip_forward",
    "containerd.pod_annotations",
    "proxy.interception",
    "workloads.secrets",
    "host.ssh_password_auth",
    "host.ssh_root_login",
    "host.fail2ban",
    "host.tailscale",
    "host.firewalld",
    "host.ufw",
    "docker.seccomp",
    "docker.userns",
    "docker.rootless",
];

/// What a probe returns; the runner adds the id.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Outcome {
    pub status: Status,
    pub summary: String,
    pub fix: Option<String>,
}

impl Outcome {
    pub fn pass(summary: impl Into<String>) -> Self {
        Outcome {
            status: Status::Pass,
            summary: summary.into(),
            fix: None,
        }
    }
    pub fn warn(summary: impl Into<String>, fix: impl Into<String>) -> Self {
        Outcome {
            status: Status::Warn,
            summary: summary.into(),
            fix: Some(fix.into()),
        }
    }
    pub fn fail(summary: impl Into<String>, fix: impl Into<String>) -> Self {
        Outcome {
            status: Status::Fail,
            summary: summary.into(),
            fix: Some(fix.into()),
        }
    }
    pub fn skip(summary: impl Into<String>, fix: impl Into<String>) -> Self {
        Outcome {
            status: Status::Skip,
            summary: summary.into(),
            fix: Some(fix.into()),
        }
    }
}

/// Shared state of one run: the options, and facts several probes need, computed once.
struct Ctx {
    pub opts: Options,
    pub docker_info: OnceCell<Result<serde_json::Value, docker::DockerError>>,
    pub docker_containers: OnceCell<Result<Vec<docker::ContainerSummary>, docker::DockerError>>,
    pub firewall: OnceCell<netfilter::Snapshot>,
    pub kernel_config: OnceCell<Option<host::KernelConfig>>,
    pub sshd: OnceCell<ssh::SshdView>,
}

impl Ctx {
    /// A context for `opts`, nothing asked yet.
    fn new(opts: Options) -> Ctx {
        Ctx {
            opts,
            docker_info: OnceCell::new(),
            docker_containers: OnceCell::new(),
            firewall: OnceCell::new(),
            kernel_config: OnceCell::new(),
            sshd: OnceCell::new(),
        }
    }
}

type ProbeFuture = Pin<Box<dyn Future<Output = Outcome> + Send>>;
type ProbeFn = fn(Arc<Ctx>) -> ProbeFuture;

fn probe_fn(id: &str) -> Option<ProbeFn> {
    Some(match id {
        "kernel.cgroup2" => |c| Box::pin(kernel::cgroup2(c)),
        "kernel.btf" => |c| Box::pin(kernel::btf(c)),
        "kernel.bpf_lsm" => |c| Box::pin(kernel::bpf_lsm(c)),
        "kernel.cgroup_bpf" => |c| Box::pin(kernel::cgroup_bpf(c)),
        "kernel.nf_tables" => |c| Box::pin(kernel::nf_tables(c)),
        "kernel.unprivileged_bpf" => |c| Box::pin(kernel::unprivileged_bpf(c)),
        "bpf.bpffs" => |c| Box::pin(pins::bpffs(c)),
        "bpf.pinned" => |c| Box::pin(pins::pinned(c)),
        "proxy.listening" => |c| Box::pin(proxy::listening(c)),
        "docker.reachable" => |c| Box::pin(docker::reachable(c)),
        "docker.cgroup_driver" => |c| Box::pin(docker::cgroup_driver(c)),
        "docker.net_raw" => |c| Box::pin(docker::net_raw(c)),
        "docker.privileged" => |c| Box::pin(docker::privileged(c)),
        "nft.agent_table" => |c| Box::pin(netfilter::agent_table(c)),
        "host.firewall_input" => |c| Box::pin(netfilter::firewall_input(c)),
        "host.firewall_forward" => |c| Box::pin(netfilter::firewall_forward(c)),
        "host.ip_forward" => |c| Box::pin(netfilter::ip_forward(c)),
        "containerd.pod_annotations" => |c| Box::pin(containerd::pod_annotations(c)),
        "proxy.interception" => |c| Box::pin(interception::interception(c)),
        "workloads.secrets" => |c| Box::pin(workloads::workload_secrets(c)),
        "host.ssh_password_auth" => |c| Box::pin(ssh::password_auth(c)),
        "host.ssh_root_login" => |c| Box::pin(ssh::root_login(c)),
        "host.fail2ban" => |c| Box::pin(perimeter::fail2ban(c)),
        "host.tailscale" => |c| Box::pin(tailscale::tailscale(c)),
        "host.firewalld" => |c| Box::pin(perimeter::firewalld(c)),
        "host.ufw" => |c| Box::pin(perimeter::ufw(c)),
        "docker.seccomp" => |c| Box::pin(docker_security::seccomp(c)),
        "docker.userns" => |c| Box::pin(docker_security::userns(c)),
        "docker.rootless" => |c| Box::pin(docker_security::rootless(c)),
        _ => return None,
    })
}

/// Run every probe concurrently and collect the report. Never takes longer than about
/// `opts.deadline`; probes that have not answered by then are reported as `skip`.
pub async fn run_async(opts: Options) -> Report {
    run_only_async(opts, PROBE_IDS).await
}

/// [`run_async`] for the probes `ids` (ids that are not in [`PROBE_IDS`] are left out), in
/// [`PROBE_IDS`] order. For tests and callers that need a few answers.
pub async fn run_only_async(opts: Options, ids: &[&str]) -> Report {
    let per_probe = opts.probe_timeout;
    let deadline = tokio::time::Instant::now() + opts.deadline;
    let ctx = Arc::new(Ctx::new(opts));
    let selected: Vec<&'static str> = PROBE_IDS
        .iter()
        .copied()
        .filter(|id| ids.contains(id))
        .collect();

    let mut results: Vec<Option<Outcome>> = vec![None; selected.len()];
    let mut set = JoinSet::new();
    for (i, id) in selected.iter().enumerate() {
        let Some(f) = probe_fn(id) else { continue };
        let fut = f(Arc::clone(&ctx));
        set.spawn(async move {
            let out = match tokio::time::timeout(per_probe, fut).await {
                Ok(out) => out,
                Err(_) => Outcome::warn(
                    format!("no answer within {}ms", per_probe.as_millis()),
                    "re-run; if it persists, the resource this probe reads is hung (see the probe id)",
                ),
            };
            (i, out)
        });
    }
    loop {
        match tokio::time::timeout_at(deadline, set.join_next()).await {
            Ok(Some(Ok((i, out)))) => results[i] = Some(out),
            Ok(Some(Err(e))) => tracing::warn!(error = %e, "doctor probe task failed"),
            Ok(None) => break,
            Err(_) => {
                set.abort_all();
                break;
            }
        }
    }

    let checks = selected
        .iter()
        .zip(results)
        .map(|(id, out)| {
            let out = out.unwrap_or_else(|| {
                Outcome::skip(
                    "did not finish before the doctor's global deadline",
                    "re-run; if it persists, look for a hung mount, socket or daemon",
                )
            });
            Check {
                id,
                status: out.status,
                summary: out.summary,
                fix: out.fix,
            }
        })
        .collect();
    Report { checks }
}

/// Synchronous entry point for the CLI when no runtime is running yet: builds a small runtime and
/// leaves behind (rather than waits for) any blocking read that is stuck past the deadline.
///
/// Call [`run_async`] instead from inside a tokio runtime.
pub fn run(opts: Options) -> Report {
    run_only(opts, PROBE_IDS)
}

/// [`run`] for the probes `ids` only (see [`run_only_async`]).
pub fn run_only(opts: Options, ids: &[&str]) -> Report {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(8)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return Report {
                checks: PROBE_IDS
                    .iter()
                    .filter(|id| ids.contains(id))
                    .map(|id| Check {
                        id,
                        status: Status::Skip,
                        summary: format!("could not start the async runtime: {e}"),
                        fix: Some("check the process limits (threads, memory)".into()),
                    })
                    .collect(),
            };
        }
    };
    let report = rt.block_on(run_only_async(opts, ids));
    rt.shutdown_background();
    report
}

/// Run a blocking closure off the async threads. The caller's timeout bounds the wait.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    tokio::task::spawn_blocking(f).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_probe_id_has_a_probe() {
        for id in PROBE_IDS {
            assert!(probe_fn(id).is_some(), "{id} has no probe");
        }
        let mut ids = PROBE_IDS.to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), PROBE_IDS.len(), "duplicate probe id");
    }

    #[test]
    fn exit_code_is_nonzero_only_on_fail() {
        let mk = |status| Report {
            checks: vec![Check {
                id: "kernel.btf",
                status,
                summary: String::new(),
                fix: None,
            }],
        };
        assert_eq!(mk(Status::Pass).exit_code(), 0);
        assert_eq!(mk(Status::Warn).exit_code(), 0);
        assert_eq!(mk(Status::Skip).exit_code(), 0);
        assert_eq!(mk(Status::Fail).exit_code(), 1);
    }
}
