//! Commands under `egress-agent exec` that file their access requests with this daemon
//! (`POST /v1/exec/requests` on the control socket; the exec side is [`super::remote`]).
//!
//! A standalone `exec` has no operator: its command's listener lives in the exec process, not
//! here. When a daemon answers on the control socket, exec forwards each request its command
//! files to it; the request then waits in this registry like a container's, for the same
//! operator (API, CLI, MCP, console), and exec applies the decision to its own listener.
//!
//! Who files is the exec process, as the control socket's `SO_PEERCRED` says (root outside every
//! enforcement root: the API refuses a confined process, and a command can't reach the socket
//! from its sandbox). Each exec process is one requester (its own per-workload bounds) for as
//! long as that process lives: its start time is checked under `/proc` before every filing and
//! every decision, so a request of an exec that ended is `Gone` for a run grant, as a
//! container's is once its listener went.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use egress_policy::name::HostName;
use serde::Deserialize;

use super::{AskError, Asks, Filed, GrantTarget, Requester, Wanted};

/// The body of `POST /v1/exec/requests`: what the command asked for and who it is, as its exec
/// knows it (the exec is trusted: root, outside the sandbox).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandRequest {
    /// The command's name, for people.
    pub workload: String,
    /// The policy the command runs under.
    pub policy: String,
    /// Its `egress.run` label, if any.
    #[serde(default)]
    pub run: Option<String>,
    /// What the command asked for, as it sent it.
    pub request: Wanted,
}

/// A run grant of a command goes to its exec, which reads the decision and applies it to its
/// own listener: nothing to do here but exist while the exec does.
struct CommandTarget;

impl GrantTarget for CommandTarget {
    fn grant(&self, _id: u64, _host: &HostName, _port: u16, _ttl: Option<Duration>) {}
}

struct Session {
    /// The process's start time (`/proc/<pid>/stat` field 22): a reused pid is another exec.
    start: u64,
    listener: u64,
    /// The only strong reference: the run grants' [`Requester::target`] dies with the session.
    target: Arc<dyn GrantTarget>,
}

/// The exec processes that filed requests here, by pid.
#[derive(Default)]
pub struct Commands {
    sessions: Mutex<BTreeMap<u32, Session>>,
}

/// Longest `workload`/`policy`/`run` field taken (they are shown to the operator).
const MAX_LABEL: usize = 200;

impl std::fmt::Debug for Commands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Commands").finish_non_exhaustive()
    }
}

/// The start time of process `pid` (clock ticks since boot), `None` if it is gone.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses; fields after the last
    // `)` start with the state (field 3); the start time is field 22.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Commands {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Session>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forget exec processes that ended (their requests' run grants have nowhere to go).
    pub fn prune(&self) {
        self.lock()
            .retain(|pid, s| start_time(*pid) == Some(s.start));
    }

    /// File `req` for the exec process `pid` (the control connection's peer) in `asks`.
    pub(super) fn file(
        &self,
        asks: &Asks,
        pid: u32,
        req: CommandRequest,
    ) -> Result<Filed, AskError> {
        for (field, value) in [
            ("workload", Some(&req.workload)),
            ("policy", Some(&req.policy)),
            ("run", req.run.as_ref()),
        ] {
            if value.is_some_and(|v| {
                v.is_empty() || v.len() > MAX_LABEL || v.chars().any(char::is_control)
            }) {
                return Err(AskError::Invalid(format!(
                    "{field}: 1-{MAX_LABEL} bytes, no control characters"
                )));
            }
        }
        self.prune();
        let start = start_time(pid)
            .ok_or_else(|| AskError::Invalid(format!("the filing process {pid} is gone")))?;
        let (listener, target) = {
            let mut sessions = self.lock();
            let s = sessions.entry(pid).or_insert_with(|| Session {
                start,
                listener: super::next_listener_id(),
                target: Arc::new(CommandTarget),
            });
            (s.listener, Arc::downgrade(&s.target))
        };
        let who = Requester {
            listener,
            policy: req.policy,
            workload: req.workload,
            run: req.run,
            target,
            durable: None,
        };
        asks.file(who, req.request, SystemTime::now())
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn req(host: &str) -> CommandRequest {
        CommandRequest {
            workload: "exec:1 (curl)".into(),
            policy: "web".into(),
            run: Some("run-7".into()),
            request: Wanted {
                host: host.into(),
                port: 443,
                reason: "tests".into(),
                methods: Vec::new(),
                paths: Vec::new(),
            },
        }
    }

    #[test]
    fn a_live_exec_files_and_gets_its_run_grant_recorded() {
        let asks = Asks::new();
        let commands = Commands::default();
        let me = std::process::id();
        let f = commands.file(&asks, me, req("api.example.com")).unwrap();
        assert!(!f.existing);
        let again = commands.file(&asks, me, req("api.example.com")).unwrap();
        assert_eq!(
            (again.id, again.existing),
            (f.id, true),
            "one session: deduplicated"
        );
        let v = asks.approve_run(f.id, "root", None).unwrap();
        assert_eq!(v.run.as_deref(), Some("run-7"));
        assert_eq!(v.workload, "exec:1 (curl)");
    }

    #[test]
    fn an_exec_that_ended_gets_no_run_grant() {
        let asks = Asks::new();
        let commands = Commands::default();
        let mut child = std::process::Command::new(crate::host_tool::find("sleep").unwrap())
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let f = commands.file(&asks, pid, req("api.example.com")).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        commands.prune();
        assert_eq!(
            asks.approve_run(f.id, "root", None).unwrap_err(),
            AskError::Gone(f.id)
        );
        assert!(
            commands.file(&asks, pid, req("b.example.com")).is_err(),
            "a gone process files nothing"
        );
    }

    #[test]
    fn labels_are_bounded() {
        let asks = Asks::new();
        let commands = Commands::default();
        let mut r = req("api.example.com");
        r.workload = "x\u{1b}[31m".into();
        assert!(matches!(
            commands.file(&asks, std::process::id(), r),
            Err(AskError::Invalid(_))
        ));
    }

    #[test]
    fn start_times_are_read_past_odd_command_names() {
        assert!(start_time(std::process::id()).is_some());
        assert!(start_time(u32::MAX).is_none());
    }
}
