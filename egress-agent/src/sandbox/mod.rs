//! The `exec` sandbox: a confined command can't undo its own confinement or anyone else's,
//! whatever its uid, and nothing it starts (`sudo`, setuid or file-capability binaries) can.
//!
//! The kernel programs confine a cgroup; the sandbox makes sure the command can't leave that
//! cgroup or reach what would let it change enforcement. Between `exec` and the command are three
//! short re-execs of this binary (no `unsafe` pre-exec code in the agent):
//!
//! 1. `__exec-child` (host pid namespace): moves itself into the command's cgroup, unshares a
//!    mount, a cgroup and a pid namespace, starts 2, relays signals, exits with 2's status.
//! 2. `__exec-init` (pid 1 of the new pid namespace): builds the command's view of the file
//!    system ([`mounts`]), starts 3, gives up every capability, reaps orphans and relays
//!    signals. When 3 ends, it exits with 3's status and the kernel ends everything left in the
//!    namespace.
//! 3. `__exec-run`: becomes the target user, keeps only harmless capabilities, sets
//!    `no_new_privs` ([`privs`]) and execs the command.
//!
//! Why these mechanisms (docs/architecture.md, "The exec sandbox", has the full list):
//! - **pid namespace**: the agent, the daemon and every process outside are invisible: no
//!   `kill`/SIGHUP, `ptrace`, `process_vm_*`, `pidfd_getfd` or `/proc/<pid>/fd` on them.
//! - **cgroup namespace + a read-only cgroup2 mount of its own subtree**: no `cgroup.procs`
//!   anywhere outside the command's cgroup can be named, let alone written.
//! - **mount namespace**: bpffs, the agent's state and every secret source of the configuration
//!   (and the directories holding only secrets) are covered by an empty read-only tmpfs or file,
//!   `/run` (the control API socket, Docker/containerd/D-Bus/systemd sockets) and `/dev` are
//!   private, the agent's configuration is read-only; for a root command the whole file system
//!   is read-only except its workspace (so cron, systemd units or `ld.so.preload` can't be made
//!   to run it later, outside). Mounts copied into a namespace a command creates itself (with a
//!   user namespace) are locked: it can't uncover them.
//! - **capabilities**: `CAP_SYS_ADMIN`, `CAP_BPF`, `CAP_NET_ADMIN`, `CAP_SYS_PTRACE`,
//!   `CAP_SYS_MODULE`, `CAP_DAC_READ_SEARCH` (file-handle escapes), `CAP_MKNOD`, ... are gone
//!   from every set including the bounding set; `CAP_NET_RAW` too unless the policy is
//!   `allow_all`.
//! - **no_new_privs**: `sudo`, setuid and file-capability binaries gain nothing.
//! - **the invoking user by default** (`SUDO_UID` when started through sudo): root only when
//!   asked for (`--user root`) or when root started it directly.
pub mod mounts;
pub mod privs;
mod relay;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use privs::Identity;

/// Hidden subcommands of the three stages.
pub const CHILD: &str = "__exec-child";
pub const INIT: &str = "__exec-init";
pub const RUN: &str = "__exec-run";

/// Exit status when the sandbox could not be set up (the command never ran).
pub const SETUP_FAILED: i32 = 125;

/// Everything the three stages need, passed between them as one JSON argument.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    /// The command's cgroup (already has its policy entry).
    pub cgroup: PathBuf,
    /// Who the command runs as.
    pub user: Identity,
    /// Keep `CAP_NET_RAW` (only for `allow_all`).
    pub keep_net_raw: bool,
    /// Covered by an empty read-only tmpfs (besides every bpffs mount, found at setup).
    pub hide: Vec<PathBuf>,
    /// Secret sources and the directories that hold only secrets (`exec`'s `hidden` module
    /// chooses them): each covered like [`Spec::hide`], after it. One that does not exist is
    /// skipped (nothing to read); one that can't be covered stops the command from running.
    #[serde(default)]
    pub secrets: Vec<PathBuf>,
    /// Bound read-only.
    pub read_only: Vec<PathBuf>,
    /// For a root command: the only writable places (everything else is read-only).
    pub writable: Vec<PathBuf>,
    /// Files placed in the private `/run` (path relative to `/run`, contents), e.g. a CA bundle.
    pub run_files: Vec<(PathBuf, Vec<u8>)>,
    /// Files copied into the private `/run` (path relative to `/run`, host path read before
    /// anything is hidden): for contents too large for the spec argument (one argument is at most
    /// 128 KiB, `MAX_ARG_STRLEN`; the host's trusted roots alone are ~220 KB).
    #[serde(default)]
    pub run_copies: Vec<(PathBuf, PathBuf)>,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{what} {path}: {source}")]
    Path {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("cannot hide the secret source {path} from the command ({source}); it was not run")]
    Secret {
        path: PathBuf,
        source: Box<SandboxError>,
    },
}

impl SandboxError {
    pub(crate) fn path<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(nix::errno::Errno) -> SandboxError + 'a {
        move |e| SandboxError::Path {
            what,
            path: path.to_owned(),
            source: e.into(),
        }
    }
    pub(crate) fn sys(what: &'static str) -> impl FnOnce(nix::errno::Errno) -> SandboxError {
        move |e| SandboxError::Sys {
            what,
            source: e.into(),
        }
    }
}

impl Spec {
    pub fn to_arg(&self) -> Result<String, SandboxError> {
        serde_json::to_string(self).map_err(|e| SandboxError::Invalid(e.to_string()))
    }
    pub fn from_arg(s: &str) -> Result<Spec, SandboxError> {
        serde_json::from_str(s).map_err(|e| SandboxError::Invalid(format!("sandbox spec: {e}")))
    }
}

fn fail(stage: &str, e: impl std::fmt::Display) -> i32 {
    eprintln!("egress-agent: {stage}: {e}");
    SETUP_FAILED
}

/// Stage 1 (`__exec-child`): enter the cgroup, unshare the namespaces, run stage 2.
pub fn child(spec_arg: &str, command: &[OsString]) -> i32 {
    let spec = match Spec::from_arg(spec_arg) {
        Ok(s) => s,
        Err(e) => return fail("exec", e),
    };
    if let Err(e) = enter_cgroup(&spec.cgroup) {
        return fail("exec", e);
    }
    use nix::sched::CloneFlags;
    let flags = CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWCGROUP | CloneFlags::CLONE_NEWPID;
    if let Err(e) = nix::sched::unshare(flags) {
        return fail(
            "exec",
            format!("unsharing the mount, cgroup and pid namespaces: {e}"),
        );
    }
    relay::run_stage(INIT, spec_arg, command, false)
}

/// Stage 2 (`__exec-init`, pid 1): the file system view, then stage 3, then reaping.
pub fn init(spec_arg: &str, command: &[OsString]) -> i32 {
    let spec = match Spec::from_arg(spec_arg) {
        Ok(s) => s,
        Err(e) => return fail("exec sandbox", e),
    };
    if let Err(e) = mounts::build(&spec) {
        return fail("exec sandbox", e);
    }
    relay::run_stage(RUN, spec_arg, command, true)
}

/// Stage 3 (`__exec-run`): drop privileges and become the command (returns only on failure).
pub fn run(spec_arg: &str, command: &[OsString]) -> i32 {
    let spec = match Spec::from_arg(spec_arg) {
        Ok(s) => s,
        Err(e) => return fail("exec sandbox", e),
    };
    if let Err(e) = privs::drop_to(&spec.user, spec.keep_net_raw) {
        return fail("exec sandbox", e);
    }
    let Some((prog, args)) = command.split_first() else {
        return fail("exec", "no command");
    };
    use std::os::unix::process::CommandExt as _;
    let mut cmd = std::process::Command::new(prog);
    cmd.args(args);
    if spec.user.switched() {
        cmd.env("HOME", &spec.user.home)
            .env("USER", &spec.user.name)
            .env("LOGNAME", &spec.user.name);
    }
    let err = cmd.exec();
    eprintln!(
        "egress-agent: cannot execute {}: {err}",
        Path::new(prog).display()
    );
    if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// Move this process into `dir` and check that it is there.
fn enter_cgroup(dir: &Path) -> Result<(), String> {
    crate::cgroup::move_pid(dir, 0)
        .map_err(|e| format!("cannot enter cgroup {}: {e}", dir.display()))?;
    match crate::cgroup::cgroup_of_pid(std::process::id()) {
        Ok(now) if now == dir => Ok(()),
        Ok(now) => Err(format!(
            "not in {} after moving (in {})",
            dir.display(),
            now.display()
        )),
        Err(e) => Err(format!("cannot verify own cgroup: {e}")),
    }
}
