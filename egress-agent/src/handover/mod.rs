//! Restarts and upgrades that lose nothing (docs/operations.md, "Restart and upgrade").
//!
//! A new agent process takes the running one's listening sockets instead of binding new ones:
//! 1. the new process connects to the running agent's hand-over socket
//!    (`<agent.state_dir>/handover.sock`) and receives every socket it serves, by name
//!    ([`wire`], `SCM_RIGHTS`), and its `env` secrets, which it installs before it resolves its
//!    configuration ([`secrets`]); both now serve the same sockets;
//! 2. it starts as usual, except that each bind takes the handed-over socket of the same name
//!    ([`Sockets`]): the same ports, so the kernel's entries and redirect maps are already right
//!    and nothing queued on a socket is lost; it reconciles every runtime (each workload claims
//!    its sockets), closes what nothing claimed, and says it serves;
//! 3. the running agent stops accepting (its connections stay), stops its watchers, API and
//!    kernel event pump, says so, and drains: it relays its open connections (user-space and
//!    kernel-spliced tunnels) until they end or `agent.drain_timeout`, reporting the count,
//!    then exits.
//!
//! The new process is either started by the operator or a DaemonSet roll (`egress-agent run`
//! while one runs), or spawned by the running agent on SIGUSR2 ([`spawn_successor`]): the same
//! arguments, the binary re-read from the path it was started from (an upgrade installs the new
//! build there first); under systemd the running agent then names the new one the main process.
//!
//! What can't be handed over is a crash: a killed agent's sockets close with it, unless systemd
//! keeps them ([`fdstore`]: the restarted agent gets them back and adopts them the same way).
//! Otherwise the pinned programs keep enforcing (fail closed: a workload's connection to the
//! proxy is refused, never let out), and the next agent binds new sockets and rewrites the
//! entries.
pub mod fdstore;
pub mod give;
pub mod secrets;
pub mod sockets;
pub mod take;
pub mod wire;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use give::{Giver, Successor};
pub use sockets::{Held, Open, Sockets};
pub use take::{Previous, TakeError, Taking, take};

/// The hand-over socket's file name in `agent.state_dir`.
pub const SOCKET_FILE: &str = "handover.sock";
/// How long a new agent waits for every runtime's first reconcile before it says it serves
/// (until then the running agent serves too). Past it, what was not claimed yet is closed and
/// bound anew when its workload is reconciled.
pub const RECONCILE_WAIT: Duration = Duration::from_secs(30);

/// The hand-over socket of the agent whose state directory is `state_dir`.
pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join(SOCKET_FILE)
}

/// The key of one of a workload's listener sockets: workload id, its cgroup, the policy, and
/// which socket (`proxy`, `transparent`, `dns-udp`, `dns-tcp`).
pub fn workload_key(workload: &str, cgroup_id: u64, policy: &str, kind: &str) -> String {
    format!("workload/{workload}/{cgroup_id}/{policy}/{kind}")
}

/// Start a new copy of this agent (`exe`, the arguments this one got) that takes over from it.
/// Its output goes where this process's goes.
pub fn spawn_successor(exe: &Path) -> std::io::Result<std::process::Child> {
    std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .stdin(std::process::Stdio::null())
        .spawn()
}
