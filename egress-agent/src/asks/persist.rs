//! The registry across restarts and hand-overs (issue #41, "requests/grants lost on restart"):
//! `<agent.state_dir>/requests.json`, written atomically (0600, temporary file + rename) after
//! every change, read once at start.
//!
//! What a workload filed is kept under its durable identity ([`Durable`]: container or pod
//! sandbox id, cgroup id, policy, listener family), never under the listener number, which
//! starts over with each process. The file names the boot it was written in
//! (`/proc/sys/kernel/random/boot_id`): cgroup ids are unique within a boot only, so a file of
//! an earlier boot is never applied. A restored request has no listener until one for the same
//! identity is bound ([`Asks::adopt`], from the proxy's bind): it then reads its requests under
//! the same ids and gets its run grants back, through the same overlay as an approval (dial-time
//! address checks and request rules unchanged), with the end they had. A workload that never
//! comes back gets nothing: its cgroup id can't be anyone else's.
//!
//! A file that is not exactly what this agent writes — another owner, a mode open to others, not
//! a regular file, bad JSON, another version, a field out of bounds — is ignored with a warning
//! naming it and the fix, and the agent starts empty: never a grant from a file it can't trust.
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Weak;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{
    Ask, Asks, GrantTarget, MAX_KEPT, Outcome, Requester, Scope, State, Store, Wanted, limits,
};

/// The file's name under `agent.state_dir`.
pub const FILE_NAME: &str = "requests.json";
const VERSION: u32 = 1;
/// Far above what [`MAX_KEPT`] bounded requests take.
const MAX_BYTES: u64 = 16 << 20;
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// A workload as it outlives the agent's process: what its requests and run grants are kept
/// under. Two listeners match only if all four are equal, so a grant never moves to another
/// container, another cgroup (a restarted container gets a new one), another policy or the
/// workload's other listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Durable {
    /// The container's, pod sandbox's or command's id.
    pub container: String,
    pub cgroup_id: u64,
    /// The policy its listener serves.
    pub policy: String,
    /// The workload's IPv6 listener (it has one per address family).
    pub ipv6: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    version: u32,
    boot_id: String,
    /// The highest id given out: new ones continue after it.
    next: u64,
    requests: Vec<SavedAsk>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedAsk {
    id: u64,
    /// When it was filed (Unix milliseconds).
    time_ms: u64,
    workload: Durable,
    /// The workload's name, for people.
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    run: Option<String>,
    host: String,
    port: u16,
    reason: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    paths: Vec<String>,
    outcome: Outcome,
    /// The run grant in force (approved with scope `run`, TTL not ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    grant: Option<SavedGrant>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedGrant {
    /// Its end (Unix milliseconds); none: the workload's lifetime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    until_ms: Option<u64>,
}

#[derive(Deserialize)]
struct Head {
    version: u32,
}

/// Why a file was not used; each says how to fix it.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    #[error("can't be read ({0}): check the state directory (or remove the file)")]
    Read(std::io::Error),
    #[error("is not a regular file: remove it")]
    NotFile,
    #[error(
        "is owned by uid {0}, not by the agent (uid {1}): remove it (or chown it to the agent's user and chmod 600)"
    )]
    Owner(u32, u32),
    #[error("has mode {0:o}, open to others: chmod 600 it (or remove it)")]
    Mode(u32),
    #[error("is larger than {MAX_BYTES} bytes: remove it")]
    Large,
    #[error("is not valid ({0}): remove it")]
    Json(serde_json::Error),
    #[error("has version {0}, this agent reads version {VERSION}: remove it")]
    Version(u32),
    #[error("request {0}: {1}: remove the file")]
    Entry(u64, String),
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn from_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// This boot's id.
fn boot_id() -> std::io::Result<String> {
    Ok(std::fs::read_to_string(BOOT_ID)?.trim().to_owned())
}

/// The file's bytes, if it is the agent's own private regular file (`None`: there is none).
fn read_private(path: &Path) -> Result<Option<Vec<u8>>, Refused> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(Refused::NotFile),
        Err(e) => return Err(Refused::Read(e)),
    };
    let meta = f.metadata().map_err(Refused::Read)?;
    if !meta.is_file() {
        return Err(Refused::NotFile);
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(Refused::Owner(meta.uid(), me));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(Refused::Mode(meta.mode() & 0o777));
    }
    if meta.len() > MAX_BYTES {
        return Err(Refused::Large);
    }
    let mut bytes = Vec::new();
    f.take(MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(Refused::Read)?;
    Ok(Some(bytes))
}

/// A target that takes nothing: a restored request's until its workload's listener is bound.
struct Nobody;

impl GrantTarget for Nobody {
    fn grant(&self, _: u64, _: &egress_policy::name::HostName, _: u16, _: Option<Duration>) {}
}

fn nobody() -> Weak<dyn GrantTarget> {
    Weak::<Nobody>::new()
}

/// One saved request as the registry holds it, checked like a new one.
fn restore_one(a: SavedAsk, now: SystemTime) -> Result<Ask, Refused> {
    let bad = |why: String| Refused::Entry(a.id, why);
    let checked = limits::check(&Wanted {
        host: a.host.clone(),
        port: a.port,
        reason: a.reason.clone(),
        methods: a.methods.clone(),
        paths: a.paths.clone(),
    })
    .map_err(|e| bad(e.to_string()))?;
    if a.id == 0 || a.workload.container.is_empty() || a.workload.cgroup_id == 0 {
        return Err(bad("no id, container or cgroup".to_owned()));
    }
    let run_approved = matches!(
        a.outcome,
        Outcome::Approved {
            scope: Scope::Run,
            ..
        }
    );
    if a.grant.is_some() && !run_approved {
        return Err(bad(
            "a run grant on a request not approved for its run".to_owned()
        ));
    }
    // A grant whose TTL ended is not restored (the request stays, approved).
    let grant = a
        .grant
        .map(|g| g.until_ms.map(from_ms))
        .filter(|end| end.is_none_or(|e| e > now));
    Ok(Ask {
        id: a.id,
        time: from_ms(a.time_ms),
        who: Requester {
            listener: 0,
            policy: a.workload.policy.clone(),
            workload: a.name,
            run: a.run,
            target: nobody(),
            durable: Some(a.workload),
        },
        host: checked.host,
        port: a.port,
        reason: checked.reason,
        methods: checked.methods,
        paths: checked.paths,
        outcome: watch::channel(a.outcome).0,
        grant,
    })
}

/// What `path` holds for boot `boot_id` at `now`: `None` when there is no file or it is of
/// another boot.
fn load(path: &Path, boot_id: &str, now: SystemTime) -> Result<Option<State>, Refused> {
    let Some(bytes) = read_private(path)? else {
        return Ok(None);
    };
    let head: Head = serde_json::from_slice(&bytes).map_err(Refused::Json)?;
    if head.version != VERSION {
        return Err(Refused::Version(head.version));
    }
    let saved: Saved = serde_json::from_slice(&bytes).map_err(Refused::Json)?;
    if saved.boot_id != boot_id {
        tracing::info!(file = %path.display(),
            "saved access requests are of an earlier boot: not restored (their workloads are gone)");
        return Ok(None);
    }
    if saved.requests.len() > MAX_KEPT {
        return Err(Refused::Entry(0, format!("more than {MAX_KEPT} requests")));
    }
    let mut s = State {
        next: saved.next,
        ..State::default()
    };
    for a in saved.requests {
        let a = restore_one(a, now)?;
        if s.asks.iter().any(|b| b.id == a.id) {
            return Err(Refused::Entry(a.id, "listed twice".to_owned()));
        }
        s.next = s.next.max(a.id);
        s.asks.push_back(a);
    }
    Ok(Some(s))
}

/// What the file keeps of `s` at `now`: the requests of workloads with a durable identity,
/// their grants still in force.
fn snapshot(s: &State, boot_id: &str, now: SystemTime) -> Saved {
    let requests = s
        .asks
        .iter()
        .filter_map(|a| {
            let workload = a.who.durable.clone()?;
            let grant = a
                .grant
                .filter(|end| end.is_none_or(|e| e > now))
                .map(|end| SavedGrant {
                    until_ms: end.map(unix_ms),
                });
            Some(SavedAsk {
                id: a.id,
                time_ms: unix_ms(a.time),
                workload,
                name: a.who.workload.clone(),
                run: a.who.run.clone(),
                host: a.host.as_str().to_owned(),
                port: a.port,
                reason: a.reason.clone(),
                methods: a.methods.clone(),
                paths: a.paths.clone(),
                outcome: a.outcome.borrow().clone(),
                grant,
            })
        })
        .collect();
    Saved {
        version: VERSION,
        boot_id: boot_id.to_owned(),
        next: s.next,
        requests,
    }
}

impl Asks {
    /// Keep the registry in `dir`/[`FILE_NAME`] from now on, starting with what it holds for
    /// this boot (the daemon's start, before any listener is bound). Without a boot id the
    /// registry stays in memory only.
    pub fn keep_in(&self, dir: &Path) {
        match boot_id() {
            Ok(b) => {
                self.keep_in_boot(dir, b, SystemTime::now());
            }
            Err(e) => tracing::warn!(file = BOOT_ID, error = %e,
                "no boot id: access requests and run grants are kept in memory only (a restart loses them)"),
        }
    }

    /// [`Asks::keep_in`] for boot `boot_id` at `now`; returns how many requests it restored.
    pub(crate) fn keep_in_boot(&self, dir: &Path, boot_id: String, now: SystemTime) -> usize {
        let path = dir.join(FILE_NAME);
        let restored = match load(&path, &boot_id, now) {
            Ok(s) => s,
            Err(why) => {
                tracing::warn!(file = %path.display(),
                    "saved access requests ignored: {} {why}; starting with none (the file is replaced at the next change)",
                    path.display());
                None
            }
        };
        let mut store = self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut s = self.lock();
        let n = restored.map_or(0, |r| {
            let n = r.asks.len();
            s.next = s.next.max(r.next);
            for a in r.asks.into_iter().rev() {
                s.asks.push_front(a);
            }
            n
        });
        drop(s);
        if n > 0 {
            tracing::info!(file = %path.display(), requests = n,
                "access requests restored: each goes back to its workload when its listener is bound");
        }
        *store = Some(Store { path, boot_id });
        n
    }

    /// Write the registry to its file, if it has one (after every change).
    pub(super) fn saved(&self) {
        let store = self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(store) = store.as_ref() else {
            return;
        };
        let saved = snapshot(&self.lock(), &store.boot_id, SystemTime::now());
        let write = serde_json::to_vec(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| crate::manage::dir::write_atomic(&store.path, &bytes));
        if let Err(e) = write {
            tracing::warn!(file = %store.path.display(), error = %e,
                "access requests not saved: a restart would lose the latest ones");
        }
    }

    /// A listener for `key` is bound as `listener` (its grants go to `target`): it owns the
    /// restored requests of that workload from now on, and gets their run grants still in
    /// force, with the end they had. Returns how many requests it took.
    pub fn adopt(&self, key: &Durable, listener: u64, target: &Weak<dyn GrantTarget>) -> usize {
        let now = SystemTime::now();
        let mut s = self.lock();
        let mut n = 0;
        for a in s
            .asks
            .iter_mut()
            .filter(|a| a.who.listener == 0 && a.who.durable.as_ref() == Some(key))
        {
            a.who.listener = listener;
            a.who.target = target.clone();
            n += 1;
            let Some(end) = a.grant else { continue };
            let ttl = match end.map(|e| e.duration_since(now)) {
                None => None,
                Some(Ok(left)) => Some(left),
                Some(Err(_)) => {
                    a.grant = None;
                    continue;
                }
            };
            if let Some(t) = a.who.target.upgrade() {
                t.grant(a.id, &a.host, a.port, ttl);
                tracing::info!(policy = %key.policy, container = %key.container, grant = a.id,
                    "run grant restored");
            }
        }
        n
    }

    /// The workload `container` with cgroup `cgroup_id` ended: what it filed is no longer kept
    /// for a restart (it stays listed until it ages out, as before).
    pub fn forget(&self, container: &str, cgroup_id: u64) {
        let mut s = self.lock();
        let mut n = 0;
        for a in s.asks.iter_mut().filter(|a| {
            a.who
                .durable
                .as_ref()
                .is_some_and(|d| d.container == container && d.cgroup_id == cgroup_id)
        }) {
            a.who.durable = None;
            a.grant = None;
            n += 1;
        }
        drop(s);
        if n > 0 {
            self.saved();
        }
    }

    /// Every runtime reconciled: restored requests no listener took are of workloads that did
    /// not come back (gone, or in another cgroup); they are no longer kept. Returns how many.
    pub fn forget_unclaimed(&self) -> usize {
        let mut s = self.lock();
        let mut n = 0;
        for a in s
            .asks
            .iter_mut()
            .filter(|a| a.who.listener == 0 && a.who.durable.is_some())
        {
            a.who.durable = None;
            a.grant = None;
            n += 1;
        }
        drop(s);
        if n > 0 {
            tracing::info!(
                requests = n,
                "restored access requests of workloads that did not come back: dropped from the saved file"
            );
            self.saved();
        }
        n
    }

    /// The file this registry is kept in, if any.
    pub fn kept_in(&self) -> Option<PathBuf> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|s| s.path.clone())
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests;
