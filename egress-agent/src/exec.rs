//! `egress-agent exec --policy P [--config F] -- CMD ARGS...`: run one command confined.
//!
//! Standalone (no daemon needed), per docs/architecture.md:
//! 1. load or adopt the programs on the exec root `<cgroup2>/egress-agent` (loader lock);
//! 2. create `<exec root>/exec-<pid>-<n>`;
//! 3. hand the cgroup to the workload enforcer every runtime uses ([`crate::workload`], with
//!    `exec` as its runtime, [`crate::workload::Enforcer::command_started`]): it binds the
//!    command's proxy listeners for P on `proxy.listen` and `proxy.endpoint_v6`'s address, port
//!    0 (any policy but `deny_all`, as for a container), with their transparent listener and
//!    DNS responder (`proxy::hooks`) and the direct-port sink, and writes the cgroup's policy
//!    entry pointing the endpoint, TCP on `allow_ports` and port 53 at them (`deny_all` when
//!    that can't be written; the command is not run if even that fails). What differs from a
//!    container, and why: no host layer (the command has no interface of its own), the
//!    endpoint may be loopback or IPv6-only (it shares the host's network), its environment
//!    is checked here (a holder is refused rather than confined), and its own cgroup is never
//!    exempted (exec is not under its root);
//! 4. start CMD through a tiny re-exec of this binary (`__exec-child`) that moves itself into the
//!    cgroup, drops CAP_NET_RAW from all capability sets incl. the bounding set (unless the policy
//!    is allow_all), and then `execvp`s CMD — so CMD's first instruction is already confined,
//!    without `unsafe` pre_exec code. Dropping CAP_NET_RAW closes AF_PACKET/raw sockets even where
//!    the BPF-LSM `socket_create` hook cannot be loaded (see docs/architecture.md); the
//!    sandbox (`crate::sandbox`) hides the agent's state and every secret source ([`hidden`]);
//! 5. stream I/O (inherited), forward SIGINT/SIGTERM/SIGHUP/SIGQUIT to CMD, return its exit code
//!    (128+signal when killed by a signal);
//! 6. kill what is left in the cgroup, delete the entry, remove the cgroup — on every exit path
//!    (a guard), including errors and forwarded signals.
//!
//! The command's access requests (`http://egress.internal/v1/requests`) go to a running daemon
//! when one answers on `--api-socket` at start ([`crate::asks::remote`]); without one they are
//! refused (503: nobody could decide them).
//!
//! If `exec` itself is killed with SIGKILL the cgroup and its entry stay: the command keeps
//! running confined (fail closed); the next loader prunes the entry once the cgroup is gone, and
//! removes abandoned empty `exec-*` cgroups.
mod hidden;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};

use crate::agent::Agent;
use crate::bpf::{self, PinnedState};
use crate::cgroup;
use crate::config::{self, Config};
use crate::sandbox::{self, Identity};
use crate::workload::info::ContainerInfo;
use crate::workload::root::WorkloadRoot;
use crate::workload::site::{self, HostOptions, Site};
use crate::workload::{Directory, Outcome};
use egress_policy::{self as policy, Mode};

/// Name of the exec enforcement root under the cgroup2 mount.
pub const EXEC_ROOT: &str = "egress-agent";
/// `NO_PROXY` for confined commands: their own loopback servers, and the host's services
/// (`host.docker.internal`, reached directly when the policy has `allow_host_services`).
pub const LOOPBACK_NO_PROXY: &str = "localhost,127.0.0.1,::1,host.docker.internal";

/// Options of `egress-agent exec`.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    pub policy: String,
    pub config: Option<PathBuf>,
    /// `--user`: who the command runs as (default: the invoking user, see `sandbox::privs`).
    pub user: Option<String>,
    /// `--rw`: extra writable paths for a root command (whose file system is read-only).
    pub writable: Vec<PathBuf>,
    /// `--label KEY=VALUE`: context labels (`egress.run`, ...; checked by
    /// [`crate::workload::labels::command_labels`]).
    pub labels: Vec<String>,
    /// `--api-socket`: a daemon answering there takes the command's access requests
    /// ([`crate::asks::remote`]); none: they are refused (503).
    pub api_socket: PathBuf,
    pub command: Vec<OsString>,
}

/// `<cgroup2>/egress-agent`.
pub fn exec_root() -> anyhow::Result<PathBuf> {
    Ok(cgroup::cgroup2_mount()?.join(EXEC_ROOT))
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Removes the entry and the cgroup when dropped.
struct CgroupGuard {
    path: PathBuf,
    id: u64,
    bpffs: PathBuf,
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        if let Err(e) = cgroup::kill_and_remove(&self.path, Duration::from_secs(5)) {
            eprintln!(
                "egress-agent: warning: could not remove cgroup {}: {e}",
                self.path.display()
            );
            // The entry stays (the cgroup still exists and must stay confined).
            return;
        }
        match PinnedState::open(&self.bpffs).and_then(|mut s| s.remove_policy(self.id)) {
            Ok(()) => {}
            Err(e) => eprintln!(
                "egress-agent: warning: removing policy entry {}: {e}",
                self.id
            ),
        }
    }
}

/// Remove `exec-<pid>-*` cgroups whose `exec` process is gone and which are empty.
fn reap_abandoned(root: &Path) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("exec-"))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = Path::new(&format!("/proc/{pid}")).exists();
        if !alive
            && cgroup::pids(&e.path())
                .map(|p| p.is_empty())
                .unwrap_or(false)
        {
            std::fs::remove_dir(e.path()).ok();
        }
    }
}

/// Run `egress-agent exec`; returns the exit code to exit with.
pub fn run(opts: ExecOptions) -> anyhow::Result<i32> {
    if opts.command.is_empty() {
        bail!("exec: no command given (usage: egress-agent exec --policy P -- CMD ARGS...)");
    }
    crate::workload::labels::command_labels(&opts.labels).map_err(|e| anyhow!("exec: {e}"))?;
    bpf::loader::require_root()?;
    let config = Config::load_or_default(opts.config.as_deref())?;
    let policy = config
        .policy(&opts.policy)
        .ok_or_else(|| {
            anyhow!(
                "exec: no policy named {:?} in the configuration",
                opts.policy
            )
        })?
        .clone();

    let user = Identity::resolve(opts.user.as_deref())?;
    let root = exec_root()?;
    // The agent's own sockets must never be hooked: refuse to run inside an enforced subtree.
    let own = cgroup::cgroup_of_pid(std::process::id()).context("reading own cgroup")?;
    if own.starts_with(&root) {
        bail!(
            "exec: refusing to run inside the enforcement root {} (own cgroup {})",
            root.display(),
            own.display()
        );
    }
    let bpffs = config.agent.bpffs.clone();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run_async(opts, config, policy, root, bpffs, user))
}

/// Paths a root command may not get write access to through its working directory or HOME.
fn is_system_dir(p: &Path) -> bool {
    const TOP: [&str; 17] = [
        "/", "/bin", "/boot", "/dev", "/efi", "/etc", "/lib", "/lib32", "/lib64", "/libx32",
        "/opt", "/proc", "/run", "/sbin", "/sys", "/usr", "/var",
    ];
    const BELOW: [&str; 8] = [
        "/boot/",
        "/etc/",
        "/usr/",
        "/proc/",
        "/sys/",
        "/var/lib",
        "/var/spool",
        "/var/log",
    ];
    let s = p.to_string_lossy();
    TOP.contains(&s.as_ref()) || BELOW.iter().any(|b| s.starts_with(b)) || s == "/var/lib"
}

/// The sandbox of one command (see [`crate::sandbox`]).
fn sandbox_spec(
    opts: &ExecOptions,
    config: &Config,
    cgroup: &Path,
    user: Identity,
    keep_net_raw: bool,
) -> anyhow::Result<sandbox::Spec> {
    let mut writable = Vec::new();
    if user.is_root() {
        let cwd = std::env::current_dir().context("reading the working directory")?;
        let implicit = [Some(cwd), Some(user.home.clone())]
            .into_iter()
            .flatten()
            .chain(["/tmp", "/var/tmp"].map(PathBuf::from));
        for p in implicit {
            match p.canonicalize() {
                Ok(c)
                    if !is_system_dir(&c) || c.starts_with("/tmp") || c.starts_with("/var/tmp") =>
                {
                    writable.push(c)
                }
                Ok(c) => eprintln!(
                    "egress-agent: note: {} stays read-only for the root command (a system directory; --rw {} to insist)",
                    c.display(),
                    c.display()
                ),
                Err(_) => {}
            }
        }
        for p in &opts.writable {
            let c = p
                .canonicalize()
                .with_context(|| format!("exec --rw {}", p.display()))?;
            writable.push(c);
        }
        writable.sort();
        writable.dedup();
    } else if !opts.writable.is_empty() {
        bail!("exec --rw is for root commands (a non-root command writes what its user may write)");
    }
    let mut read_only = vec![PathBuf::from("/etc/egress-agent")];
    read_only.extend(opts.config.clone());
    read_only.push(PathBuf::from(config::DEFAULT_CONFIG_PATH));
    read_only.push(user.home.join(".ssh"));
    let hide = hidden::state(config);
    let secrets = secret_covers(opts, config, &user, &writable, &read_only, &hide)?;
    Ok(sandbox::Spec {
        cgroup: cgroup.to_owned(),
        user,
        keep_net_raw,
        hide,
        secrets,
        read_only,
        writable,
        run_files: Vec::new(),
        run_copies: Vec::new(),
    })
}

/// The secret sources and directories the sandbox covers (see [`hidden`]); notes about secret
/// files that can only be hidden on their own go to stderr.
fn secret_covers(
    opts: &ExecOptions,
    config: &Config,
    user: &Identity,
    writable: &[PathBuf],
    read_only: &[PathBuf],
    hide: &[PathBuf],
) -> anyhow::Result<Vec<PathBuf>> {
    let mut sources = hidden::file_sources(config);
    // A daemon's configuration, when this exec runs with another one: its secrets too.
    let default = Path::new(config::DEFAULT_CONFIG_PATH);
    let other = opts
        .config
        .as_deref()
        .is_some_and(|c| c.canonicalize().ok() != default.canonicalize().ok());
    if other && default.exists() {
        match hidden::file_sources_in(default) {
            Ok(more) => sources.extend(more),
            Err(e) => eprintln!(
                "egress-agent: warning: the secret files of {} can't be hidden from the command: {e:#}",
                default.display()
            ),
        }
    }
    let credentials = std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from);
    let cwd = std::env::current_dir().context("reading the working directory")?;
    let keep: Vec<PathBuf> = writable
        .iter()
        .chain(read_only)
        .chain([&cwd, &user.home])
        .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone()))
        .collect();
    let covers = hidden::secret_covers(&sources, credentials.as_deref(), &keep, hide);
    for note in &covers.notes {
        eprintln!("egress-agent: note: {note}");
    }
    Ok(covers.paths)
}

/// Where the command finds the agent's CA (in its private `/run`).
pub const CA_IN_RUN: &str = "egress-agent-ca.pem";
/// Where the command finds the run's CA bundle: the host's roots, the CA files the caller had
/// pointed its tools at, and the agent's CA (`ca::trust`).
pub const BUNDLE_IN_RUN: &str = "egress-agent-ca-bundle.pem";
/// `NODE_EXTRA_CA_CERTS` of the run: the caller's own extra CAs and the agent's CA.
pub const EXTRA_IN_RUN: &str = "egress-agent-ca-extra.pem";

/// Variables set for the command (name, value).
type CommandEnv = Vec<(String, String)>;

/// The run's trust files, written for the sandbox to copy into the command's `/run` (root-only,
/// under `agent.state_dir`), removed when the run ends.
struct TrustFiles(PathBuf);

impl Drop for TrustFiles {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// What a command needs for TLS interception (`ca::command_env`): the agent's CA, the run's CA
/// bundle and extra-CA file in its private `/run`, every CA variable naming them (the caller's
/// replaced ones reported on stderr, their certificates kept in the bundle), and the
/// placeholders the policy's bindings name. Nothing at all when the policy intercepts nothing.
fn interception(
    config: &Config,
    policy: &policy::Policy,
    spec: &mut sandbox::Spec,
) -> anyhow::Result<(CommandEnv, Option<TrustFiles>)> {
    let run = Path::new("/run");
    let env = crate::ca::command_env(policy, &run.join(BUNDLE_IN_RUN), &run.join(EXTRA_IN_RUN));
    if env.is_empty() || policy.mode != Mode::Allowlist {
        return Ok((Vec::new(), None));
    }
    // The proxy context loaded (or created) this CA moments ago; the lock in `load_or_create`
    // makes both loads agree.
    let ca = match crate::ca::AgentCa::load_or_create(&config.agent.state_dir) {
        Ok(ca) => ca,
        Err(e) => {
            // Fail closed for the intercepted hosts only (the proxy refuses them,
            // `interception-unavailable`); the command runs, its other hosts work, and no CA
            // variable points at a bundle that isn't there (it would break every TLS client).
            eprintln!(
                "egress-agent: warning: TLS interception unavailable ({e}): requests to this policy's hosts with credential bindings or request rules are refused (interception-unavailable); every other host works"
            );
            let placeholders = env
                .into_iter()
                .filter(|(k, _)| {
                    policy
                        .credentials
                        .iter()
                        .any(|b| b.placeholder_env.as_deref() == Some(k.as_str()))
                })
                .collect();
            return Ok((placeholders, None));
        }
    };
    let callers = crate::ca::trust::caller_cas(&|k| std::env::var(k).ok());
    let trust = crate::ca::trust::bundle(crate::ca::system_roots(), &callers, ca.cert_pem());
    for note in &trust.notes {
        eprintln!("egress-agent: {note}");
    }
    // Copied by the sandbox, not carried in its argument (a bundle is larger than one argument
    // may be), before it replaces `/run` and hides `agent.state_dir`: so the files live in the
    // state directory (root-only), never in `/run`.
    let dir = config.agent.state_dir.join(format!(
        "exec-trust-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("exec: creating {}", dir.display()))?;
    }
    let files = TrustFiles(dir.clone());
    for (name, text) in [(BUNDLE_IN_RUN, &trust.bundle), (EXTRA_IN_RUN, &trust.extra)] {
        crate::ca::file::write_atomic(&dir, name, text.as_bytes(), 0o600)
            .with_context(|| format!("exec: writing the run's {name} under {}", dir.display()))?;
        spec.run_copies.push((PathBuf::from(name), dir.join(name)));
    }
    spec.run_files
        .push((PathBuf::from(CA_IN_RUN), ca.cert_pem().as_bytes().to_vec()));
    Ok((env, Some(files)))
}

/// The environment the command gets: this process's, with the agent's `changes` applied.
fn command_env(changes: &[(String, Option<String>)]) -> crate::exposure::WorkloadEnv {
    use std::os::unix::ffi::OsStringExt as _;
    let mut env: std::collections::BTreeMap<String, Vec<u8>> = std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.into_vec()))
        .collect();
    for (k, v) in changes {
        match v {
            Some(v) => env.insert(k.clone(), v.clone().into_bytes()),
            None => env.remove(k),
        };
    }
    crate::exposure::WorkloadEnv::from_pairs(None, env)
}

/// The command's name for events (its first word's file name).
fn command_name(command: &[OsString]) -> String {
    command
        .first()
        .map(|c| {
            Path::new(c)
                .file_name()
                .unwrap_or(c)
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default()
}

/// Signals forwarded to the command, caught from the start of [`run_async`]: a signal before
/// the command runs would otherwise end exec itself and leave the command confined by nothing
/// but the kernel (still confined, but without cleanup).
struct Forwarded {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Forwarded {
    fn catch() -> std::io::Result<Forwarded> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Forwarded {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// Wait for `child`, passing each caught signal on to it.
    async fn wait(
        &mut self,
        child: &mut tokio::process::Child,
    ) -> anyhow::Result<std::process::ExitStatus> {
        use nix::sys::signal::Signal;
        let pid = child.id().ok_or_else(|| anyhow!("child has no pid"))?;
        let forward = |sig: Signal| {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).ok();
        };
        loop {
            tokio::select! {
                s = child.wait() => return s.context("waiting for the command"),
                _ = self.int.recv() => forward(Signal::SIGINT),
                _ = self.term.recv() => forward(Signal::SIGTERM),
                _ = self.hup.recv() => forward(Signal::SIGHUP),
                _ = self.quit.recv() => forward(Signal::SIGQUIT),
            }
        }
    }
}

async fn run_async(
    opts: ExecOptions,
    config: Config,
    policy: policy::Policy,
    root: PathBuf,
    bpffs: PathBuf,
    user: Identity,
) -> anyhow::Result<i32> {
    let mut signals = Forwarded::catch()?;
    // 1. programs on the exec root.
    let enforcement = attach_programs(&bpffs, &root, policy.mode)?;
    reap_abandoned(&root);
    // 2. the cgroup (its id names the listener's client). The guard removes it and its entry
    // on every path from here on.
    let (path, id, guard) = command_cgroup(&root, &bpffs)?;
    // 3. the agent core, as in the daemon: this run's events go to the durable store (`events`,
    // `suggest`) and to the configured exporters, and one ordered stop flushes both.
    let mut agent = Agent::start(&config, None)?;
    let events = agent.events().clone();
    report_unavailable_bindings(&config, &opts.policy, &events);
    // 4. the workload enforcer every runtime uses: entry, listeners, directory record.
    let config = Arc::new(config);
    let directory = Directory::default();
    let labels =
        crate::workload::labels::command_labels(&opts.labels).map_err(|e| anyhow!("exec: {e}"))?;
    let workload = ContainerInfo::command(
        format!("exec:{}", std::process::id()),
        command_name(&opts.command),
        &opts.policy,
        labels,
    );
    let mut enforcer = site::enforcer_on(
        &config,
        exec_site(
            &root,
            &directory,
            crate::asks::remote::Remote::connect(&opts.api_socket).await,
        ),
        enforcement.state,
        site::Addresses::sharing_host_network(&config)?,
        false,
        &events,
        None,
        &agent.stop(),
    )?;
    if let Outcome::Refuse(why) = enforcer.command_started(&workload, path.clone(), id).await {
        drop(guard);
        agent.shutdown().await;
        bail!("exec: the command's cgroup could not be confined: {why}; it was not run");
    }
    pump_kernel_events(&mut agent, &bpffs, directory);

    // 5. the command, in its sandbox (see `sandbox`): /proc/self/exe, not current_exe(): the
    // running image, even if the file was replaced (upgrade, rebuild) since exec started.
    let mut spec = sandbox_spec(&opts, &config, &path, user, policy.mode == Mode::AllowAll)?;
    let (interception_env, _trust_files) = interception(&config, &policy, &mut spec)?;
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.arg(sandbox::CHILD)
        .arg(spec.to_arg()?)
        .arg("--")
        .args(&opts.command);
    let changes = environment_changes(&config, &policy, interception_env);
    for (k, v) in &changes {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    if let Err(refused) = check_environment(&config, &opts, id, &changes, &events) {
        drop(guard);
        agent.shutdown().await;
        return Err(refused);
    }
    let mut child = cmd.spawn().context("starting the command")?;

    // 6. wait, forwarding signals (kernel events are pumped meanwhile).
    let status = signals.wait(&mut child).await?;

    // 7. cleanup (guard: the cgroup, then its entry), the enforcer's record and listeners,
    // then the core's ordered stop: the last kernel events, the store and the exporters.
    drop(guard);
    enforcer.destroyed(&workload.id).await;
    agent.shutdown().await;
    use std::os::unix::process::ExitStatusExt as _;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    })
}

/// Load or adopt the programs on the exec root, saying on stderr what changed or is missing.
fn attach_programs(bpffs: &Path, root: &Path, mode: Mode) -> anyhow::Result<bpf::Enforcement> {
    let enforcement = bpf::enforce_root(bpffs, root, false)?;
    if !enforcement.report.upgraded.is_empty() {
        eprintln!(
            "egress-agent: pinned links switched to this build's programs: {}",
            enforcement.report.upgraded.join(", ")
        );
    }
    for why in &enforcement.report.upgrade_failed {
        eprintln!("egress-agent: warning: {why}");
    }
    if let Some(reason) = &enforcement.report.lsm_unavailable {
        let closed_by = if mode == Mode::AllowAll {
            "nothing (allow_all)"
        } else {
            "CAP_NET_RAW being absent from the command's capability sets, bounding set included"
        };
        eprintln!(
            "egress-agent: warning: BPF-LSM socket_create hook not active: {reason}. AF_PACKET and raw sockets are closed by {closed_by}"
        );
    }
    Ok(enforcement)
}

/// `<root>/exec-<pid>-<n>`, its id, and the guard that removes it and its entry.
fn command_cgroup(root: &Path, bpffs: &Path) -> anyhow::Result<(PathBuf, u64, CgroupGuard)> {
    let name = format!(
        "exec-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let path = root.join(&name);
    std::fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
    let id = cgroup::cgroup_id(&path)?;
    let guard = CgroupGuard {
        path: path.clone(),
        id,
        bpffs: bpffs.to_owned(),
    };
    Ok((path, id, guard))
}

/// This policy's bindings served without their secret (a lenient load): said on stderr and
/// as an event; their hosts are refused, everything else works.
fn report_unavailable_bindings(config: &Config, policy: &str, events: &crate::events::EventSink) {
    for u in config
        .unavailable_bindings()
        .into_iter()
        .filter(|u| u.policy == policy)
    {
        eprintln!(
            "egress-agent: warning: credential binding unavailable, {}: requests to {}:{} are refused (interception-unavailable)",
            u.describe(),
            u.binding.host,
            u.binding.port
        );
        events.emit(u.event());
    }
}

/// The exec root as a runtime's site: no host layer (a command has no interface of its own),
/// no BPF-LSM requirement (reported instead), commands named in `directory`.
fn exec_site(
    root: &Path,
    directory: &Directory,
    remote_asks: Option<Arc<crate::asks::remote::Remote>>,
) -> Site {
    let parent = root
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Site::new(
        WorkloadRoot::new(root.parent().unwrap_or(root), &parent),
        HostOptions {
            nft: false,
            directory: directory.clone(),
            remote_asks,
            ..HostOptions::default()
        },
        "exec",
    )
}

/// Kernel denial events of this run, if no daemon consumes the ring buffer. This exec then
/// holds the ring: events of other cgroups (other execs) would be lost otherwise, so they are
/// logged with the policy their writer recorded.
fn pump_kernel_events(agent: &mut Agent, bpffs: &Path, directory: Directory) {
    // Other commands' names; without them their events keep the policy the kernel recorded.
    let names = PinnedState::open(bpffs).ok();
    if let Err(e) = agent.pump_kernel_events(bpffs, move |d| {
        if d.cgroup_id.is_some_and(|id| directory.get(id).is_some()) {
            directory.enrich(d);
        } else if let Some((policy, _)) = d
            .cgroup_id
            .and_then(|id| names.as_ref().and_then(|n| n.name(id)))
        {
            d.policy = policy;
        }
    }) {
        eprintln!("egress-agent: warning: kernel events: {e}");
    }
}

/// What the agent changes in the environment the command inherits (`None`: removed): the
/// proxy variables (allowlist policies), the interception variables, and no credentials
/// directory (it is covered in the sandbox).
fn environment_changes(
    config: &Config,
    policy: &policy::Policy,
    interception_env: CommandEnv,
) -> Vec<(String, Option<String>)> {
    let mut changes: Vec<(String, Option<String>)> = Vec::new();
    if policy.mode == Mode::Allowlist {
        let url = format!("http://{}", config.proxy.endpoint);
        for var in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            changes.push((var.to_owned(), Some(url.clone())));
        }
        for var in ["ALL_PROXY", "all_proxy"] {
            changes.push((var.to_owned(), None));
        }
        // The command's own servers on loopback are reached directly (the kernel allows that
        // only for servers of the same command); nothing else bypasses the proxy.
        for var in ["NO_PROXY", "no_proxy"] {
            changes.push((var.to_owned(), Some(LOOPBACK_NO_PROXY.to_owned())));
        }
    }
    changes.extend(interception_env.into_iter().map(|(k, v)| (k, Some(v))));
    changes.push(("CREDENTIALS_DIRECTORY".to_owned(), None));
    changes
}

/// A real key in the environment the command gets (issue #40, item 6): reported (an event and
/// stderr); `Err` when `agent.refuse_workload_secrets` says not to start it.
fn check_environment(
    config: &Config,
    opts: &ExecOptions,
    cgroup_id: u64,
    changes: &[(String, Option<String>)],
    events: &crate::events::EventSink,
) -> anyhow::Result<()> {
    let exposure = crate::exposure::check(config, &command_env(changes));
    if exposure.is_empty() {
        return Ok(());
    }
    let mut ev = crate::events::DenialEvent::proxy(
        &opts.policy,
        None,
        None,
        0,
        "exec",
        crate::exposure::REASON,
    );
    ev.source = crate::events::Source::Agent;
    ev.cgroup_id = Some(cgroup_id);
    ev.context
        .insert("exec".to_owned(), command_name(&opts.command));
    ev.context
        .extend(exposure.context("refused to start the command"));
    events.emit(ev);
    if exposure.confine {
        bail!(
            "exec: the command's environment holds a real key: {}; it was not run (agent.refuse_workload_secrets = true). Unset the variable, or bind the key (policies.{}.credentials, with placeholder_env naming the variable) so the command gets its placeholder",
            exposure.variables(),
            opts.policy
        );
    }
    eprintln!(
        "egress-agent: warning: the command's environment holds a real key: {}; it can spend it on every host policy {} allows (bind the key instead; agent.refuse_workload_secrets = true refuses such a command)",
        exposure.variables(),
        opts.policy
    );
    Ok(())
}
