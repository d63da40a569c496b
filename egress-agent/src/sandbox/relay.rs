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
    let mut signals = match signal_hook::iterator::Signals::new(RELAYED.iter().chain(&[SIGCHLD])) {
        Ok(s) => s,
        Err(e) => return super::fail("exec", format!("installing signal handlers: {e}")),
    };
    // The host's procfs, opened before the child starts: the sandbox's init mounts a fresh
    // `/proc` for its pid namespace over `/proc` in the mount namespace it shares with this
    // stage, after which `/proc/<pid>` (a host pid) names nothing there.
    let host_proc = if stage == super::INIT {
        match std::fs::File::open("/proc") {
            Ok(d) => Some(d),
            Err(e) => return super::fail("exec", format!("opening /proc: {e}")),
        }
    } else {
        None
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
    if let Some(host_proc) = &host_proc {
        // The child is pid 1 of its namespace: until its handlers are in place a relayed signal
        // would be dropped (not queued), and a SIGTERM sent to `exec` early would be lost while
        // the command runs on. Signals that arrive meanwhile wait in `signals`.
        wait_for_handlers(host_proc, pid);
    }
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

/// How long a starting pid-1 stage may take to install its handlers.
const HANDLERS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Wait until `pid` catches every relayed signal (`SigCgt` in `<proc>/<pid>/status`), or has
/// exited, or [`HANDLERS_DEADLINE`] passed. A short poll: there is no event for "handler
/// installed", and a pipe to signal it would leave its descriptor to the command (closing an
/// inherited raw descriptor needs `unsafe`, which this crate keeps out of the sandbox).
/// `proc`: a procfs of `pid`'s namespace's parent, held open (the path `/proc` may be
/// covered meanwhile; through it a "gone" would be read, and the wait end early).
fn wait_for_handlers(proc: &std::fs::File, pid: Pid) {
    let deadline = std::time::Instant::now() + HANDLERS_DEADLINE;
    while std::time::Instant::now() < deadline {
        match caught_signals(proc, pid) {
            Some(mask) if RELAYED.iter().all(|s| mask & (1u64 << (s - 1)) != 0) => return,
            Some(_) => {}
            // Gone (or a zombie without status): nothing to wait for.
            None => return,
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    eprintln!(
        "egress-agent: warning: the sandbox's init did not install its signal handlers within {HANDLERS_DEADLINE:?}"
    );
}

/// The `SigCgt` mask of `pid` (bit n-1 = signal n has a handler), read through the procfs
/// directory `proc`; `None` when it is gone.
fn caught_signals(proc: &std::fs::File, pid: Pid) -> Option<u64> {
    use nix::fcntl::{OFlag, openat};
    let fd = openat(
        proc,
        format!("{pid}/status").as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    let status = std::io::read_to_string(std::fs::File::from(fd)).ok()?;
    let state_zombie = status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .is_some_and(|s| s.trim_start().starts_with('Z'));
    if state_zombie {
        return None;
    }
    let hex = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_signals_reads_sigcgt_and_knows_gone_processes() {
        let me = Pid::from_raw(std::process::id() as i32);
        // Registered here: SIGUSR2 is caught from now on.
        let _sig = signal_hook::iterator::Signals::new([SIGUSR2]).expect("handler");
        let proc = std::fs::File::open("/proc").expect("/proc");
        let mask = caught_signals(&proc, me).expect("own status");
        assert_ne!(mask & (1u64 << (SIGUSR2 - 1)), 0, "{mask:x}");
        // A pid that can't exist (above pid_max's limit): gone, so nothing to wait for.
        let none = Pid::from_raw(i32::MAX);
        assert_eq!(caught_signals(&proc, none), None);
        let t = std::time::Instant::now();
        wait_for_handlers(&proc, none);
        assert!(t.elapsed() < HANDLERS_DEADLINE);
    }
}
