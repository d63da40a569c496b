//! Start the next sandbox stage, relay signals to it, reap, and pass its exit status on.
//!
//! Handlers are registered before the child starts (so no SIGCHLD is lost) and are real
//! handlers, not `SIG_DFL`: a pid-1 process gets signals from outside its namespace only for
//! signals it handles (pid_namespaces(7)). The child starts with default dispositions and an
//! empty signal mask (std's spawn resets both).
use std::ffi::OsString;

use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use signal_hook::consts::signal::{
    SIGCHLD, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH,
};

use super::{SETUP_FAILED, privs};

/// Signals passed on to the child.
const RELAYED: [i32; 7] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH];

/// Run `/proc/self/exe <stage> <spec> -- <command>` and relay until it ends; return its status
/// (128+signal when it was killed). `init`: this process is pid 1 of the command's namespace — it
/// reaps every orphan and, once the child runs, gives up its own capabilities.
pub(super) fn run_stage(stage: &str, spec: &str, command: &[OsString], init: bool) -> i32 {
    let mut signals = match signal_hook::iterator::Signals::new(RELAYED.iter().chain(&[SIGCHLD]))
    {
        Ok(s) => s,
        Err(e) => return super::fail("exec", format!("installing signal handlers: {e}")),
    };
    // /proc/self/exe: this very binary even if its file was replaced or is hidden.
    let child = std::process::Command::new("/proc/self/exe")
        .arg(stage)
        .arg(spec)
        .arg("--")
        .args(command)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => return super::fail("exec", format!("starting {stage}: {e}")),
    };
    let pid = Pid::from_raw(child.id() as i32);
    if init && let Err(e) = privs::drop_all() {
        // Not a hole (the command can't ptrace a process with more capabilities than its own),
        // but say so.
        eprintln!("egress-agent: warning: the sandbox's init kept its capabilities: {e}");
    }
    for sig in signals.forever() {
        if sig != SIGCHLD {
            if let Ok(s) = nix::sys::signal::Signal::try_from(sig) {
                nix::sys::signal::kill(pid, s).ok();
            }
            continue;
        }
        if let Some(code) = reap(pid) {
            return code;
        }
    }
    SETUP_FAILED
}

/// Reap every exited child without blocking; the exit status of `main` once it has ended.
fn reap(main: Pid) -> Option<i32> {
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(p, code)) if p == main => return Some(code),
            Ok(WaitStatus::Signaled(p, sig, _)) if p == main => return Some(128 + sig as i32),
            Ok(WaitStatus::StillAlive) => return None,
            Ok(_) => continue,
            // No children left at all: the main one is gone too.
            Err(nix::errno::Errno::ECHILD) => return Some(SETUP_FAILED),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return None,
        }
    }
}
