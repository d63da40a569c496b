//! Access requests a confined workload files from inside (issue #41, "asking for access"), and
//! the operator's decisions on them.
//!
//! A workload asks through its own listener (`POST http://egress.internal/v1/requests`,
//! [`crate::proxy::self_service`]): who asks is the listener that accepted the connection — the
//! kernel chose it from the cgroup — never a field of the body. A request changes nothing by
//! itself: it waits for an operator (API, CLI, MCP, console). Approved with scope `run`, the
//! host:port is added to that one listener's policy (an overlay, [`GrantTarget`]) for the
//! listener's lifetime or the TTL, whichever ends first; with scope `policy` it is written to
//! the policy through the change path every write takes (the daemon does that, then records the
//! outcome here). The decision and its reason go back to the request, where the workload's
//! long-poll (`GET /v1/requests/{id}?wait=S`) picks it up.
//!
//! Bounds, per listener: at most [`MAX_PENDING`] waiting, at most [`MAX_PER_WINDOW`] filed per
//! [`WINDOW`] (then 429), the same host:port asked again while pending is the same request; in
//! all, at most [`MAX_TOTAL_PENDING`] waiting and [`MAX_KEPT`] kept. A grant only adds a name to
//! `allow_hosts`: every check after the name — private and metadata addresses refused at dial
//! time, request rules — still holds.
//!
//! The daemon keeps the registry in `<agent.state_dir>/requests.json` ([`persist`]): a restart or
//! a hand-over gives each workload that still runs its requests (same ids) and run grants back
//! when its listener is bound again, keyed by its durable identity ([`Durable`]), never by the
//! listener number.
pub mod commands;
mod limits;
mod persist;
pub mod remote;
pub mod webhook;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use egress_policy::name::HostName;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use limits::{MAX_KEPT, MAX_PENDING, MAX_PER_WINDOW, MAX_REASON, MAX_TOTAL_PENDING, WINDOW};
pub use persist::{Durable, FILE_NAME};

/// A process-wide requester number ([`Requester::listener`]: a workload's listener, or an
/// `exec` filing for its command); 0 is never given out.
pub fn next_listener_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Where a `run` grant goes: the listener that filed the request.
pub trait GrantTarget: Send + Sync {
    /// Add `host:port` to this listener's policy for `ttl` (or its lifetime), as grant `id`.
    fn grant(&self, id: u64, host: &HostName, port: u16, ttl: Option<Duration>);
}

/// Who asked: the listener's identity, as the kernel chose it.
#[derive(Clone)]
pub struct Requester {
    /// Unique per listener for this agent's lifetime: only the same listener reads its requests
    /// (0: a request restored from before a restart whose workload's listener is not bound yet).
    pub listener: u64,
    /// The policy the listener serves.
    pub policy: String,
    /// The container, pod or command, for people.
    pub workload: String,
    /// The `run` context label, when the workload has one.
    pub run: Option<String>,
    /// Where a `run` grant goes (gone when the workload ended).
    pub target: Weak<dyn GrantTarget>,
    /// The workload as it outlives this agent (container, cgroup, policy, listener family):
    /// what a restart keeps its requests and grants under. `None` (a command under a standalone
    /// `exec`, tests): kept in memory only.
    pub durable: Option<Durable>,
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester")
            .field("listener", &self.listener)
            .field("policy", &self.policy)
            .field("workload", &self.workload)
            .field("run", &self.run)
            .field("durable", &self.durable)
            .finish_non_exhaustive()
    }
}

/// What a workload asks for (the body of `POST /v1/requests`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Wanted {
    pub host: String,
    pub port: u16,
    /// For the operator to read (at most [`MAX_REASON`] bytes).
    pub reason: String,
    /// Optional: the methods it needs (shown to the operator; a grant covers the host:port).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Optional: the paths it needs (shown to the operator).
    #[serde(default)]
    pub paths: Vec<String>,
}

/// How far an approval reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// This workload alone, while it runs (or for the TTL).
    Run,
    /// Written to the policy: every workload under it, from now on.
    Policy,
}

/// An operator's decision on a request (`POST /v1/requests/{id}/approve|deny`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Approve {
        scope: Scope,
        /// A `run` grant's lifetime (else the workload's).
        ttl: Option<Duration>,
    },
    Deny {
        reason: String,
    },
}

impl Decision {
    /// From the API's body (`{"scope", "ttl"}` to approve, `{"reason"}` to deny).
    pub fn parse(approve: bool, body: &str) -> Result<Decision, AskError> {
        #[derive(Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct Approve {
            scope: Option<Scope>,
            ttl: Option<String>,
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Deny {
            reason: String,
        }
        let body = if body.trim().is_empty() { "{}" } else { body };
        if approve {
            let a: Approve = serde_json::from_str(body).map_err(|e| {
                AskError::Invalid(format!("request body: {e} (expected {{\"scope\": \"run\"|\"policy\", \"ttl\"?: \"2h\"}})"))
            })?;
            let scope = a.scope.ok_or_else(|| {
                AskError::Invalid(
                    "scope: run (this workload, while it runs) or policy (written to its policy)"
                        .to_owned(),
                )
            })?;
            let ttl = match a.ttl {
                None => None,
                Some(_) if scope == Scope::Policy => {
                    return Err(AskError::Invalid(
                        "ttl: only a run grant ends by itself; a policy change stays until changed"
                            .to_owned(),
                    ));
                }
                Some(t) => Some(
                    humantime::parse_duration(&t)
                        .map_err(|e| AskError::Invalid(format!("ttl: {e} (e.g. 30m, 2h)")))?,
                ),
            };
            Ok(Decision::Approve { scope, ttl })
        } else {
            let d: Deny = serde_json::from_str(body).map_err(|e| {
                AskError::Invalid(format!(
                    "request body: {e} (expected {{\"reason\": \"…\"}}: the workload reads it)"
                ))
            })?;
            let reason = d.reason.trim().to_owned();
            if reason.is_empty() || reason.len() > MAX_REASON {
                return Err(AskError::Invalid(format!(
                    "reason: 1-{MAX_REASON} bytes (the workload reads it)"
                )));
            }
            Ok(Decision::Deny { reason })
        }
    }
}

/// Where a request stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Outcome {
    Pending,
    Approved {
        scope: Scope,
        by: String,
        /// A `run` grant's end (RFC 3339), if it has a TTL.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        until: Option<String>,
    },
    Denied {
        by: String,
        reason: String,
    },
}

/// One request as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct View {
    pub id: u64,
    pub time: String,
    pub policy: String,
    pub workload: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    pub host: String,
    pub port: u16,
    pub reason: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// Why a request was not taken or a decision not made: each maps to an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    TooMany(String),
    #[error("{0}")]
    Full(String),
    #[error("no request {0}")]
    NotFound(u64),
    #[error("request {0} was decided already")]
    Decided(u64),
    #[error("the workload that filed request {0} has ended: a run grant has nothing to go to")]
    Gone(u64),
    /// The daemon a command under `exec` files through did not answer ([`remote`]).
    #[error("{0}")]
    Unavailable(String),
}

impl AskError {
    pub fn status(&self) -> u16 {
        match self {
            AskError::Invalid(_) => 400,
            AskError::TooMany(_) => 429,
            AskError::Full(_) | AskError::Unavailable(_) => 503,
            AskError::NotFound(_) => 404,
            AskError::Decided(_) | AskError::Gone(_) => 409,
        }
    }
}

struct Ask {
    id: u64,
    time: SystemTime,
    who: Requester,
    host: HostName,
    port: u16,
    reason: String,
    methods: Vec<String>,
    paths: Vec<String>,
    outcome: watch::Sender<Outcome>,
    /// The run grant given (approved with scope `run`), with its end if it has a TTL: what a
    /// restart lays on the workload's listener again.
    grant: Option<Option<SystemTime>>,
}

impl Ask {
    fn view(&self) -> View {
        View {
            id: self.id,
            time: humantime::format_rfc3339_millis(self.time).to_string(),
            policy: self.who.policy.clone(),
            workload: self.who.workload.clone(),
            run: self.who.run.clone(),
            host: self.host.as_str().to_owned(),
            port: self.port,
            reason: self.reason.clone(),
            methods: self.methods.clone(),
            paths: self.paths.clone(),
            outcome: self.outcome.borrow().clone(),
        }
    }

    fn pending(&self) -> bool {
        *self.outcome.borrow() == Outcome::Pending
    }
}

#[derive(Default)]
struct State {
    next: u64,
    /// Oldest first; decided ones are dropped first when [`MAX_KEPT`] is reached.
    asks: VecDeque<Ask>,
    /// Per listener: when its recent requests were filed (for [`MAX_PER_WINDOW`]).
    filed: BTreeMap<u64, VecDeque<SystemTime>>,
}

/// Where the registry is kept across restarts ([`persist`]): `<agent.state_dir>/requests.json`
/// for this boot.
struct Store {
    path: PathBuf,
    boot_id: String,
}

/// The agent's access requests (one per agent, shared by its listeners and the API).
#[derive(Default)]
pub struct Asks {
    state: Mutex<State>,
    /// `[requests]`' auto-approved hosts (presets expanded); empty: every request waits.
    auto: Mutex<Vec<egress_policy::HostEntry>>,
    /// Announces every new request and decision (the console's live list).
    changed: watch::Sender<u64>,
    /// The file every change is written to (`None`: memory only). Taken before `state` when
    /// both are held, so writes happen in the order of the changes.
    store: Mutex<Option<Store>>,
    /// The `exec` processes filing their commands' requests here ([`commands`]).
    commands: commands::Commands,
}

/// A request taken: its id, whether it was already waiting (the same host:port asked again),
/// and whether `[requests]` approved it at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filed {
    pub id: u64,
    pub existing: bool,
    pub auto_approved: bool,
}

/// Who an automatic approval is recorded as.
pub const AUTO: &str = "auto-approve ([requests])";

/// Request `id`, if it still waits for a decision.
fn waiting(s: &State, id: u64) -> Result<&Ask, AskError> {
    let a = s
        .asks
        .iter()
        .find(|a| a.id == id)
        .ok_or(AskError::NotFound(id))?;
    if a.pending() {
        Ok(a)
    } else {
        Err(AskError::Decided(id))
    }
}

/// Approve waiting request `id` for its workload alone (the registry's lock held): the grant
/// goes to the listener that filed it.
fn approve_locked(
    s: &mut State,
    id: u64,
    by: &str,
    ttl: Option<Duration>,
) -> Result<View, AskError> {
    waiting(s, id)?;
    let a = s
        .asks
        .iter_mut()
        .find(|a| a.id == id)
        .ok_or(AskError::NotFound(id))?;
    let target = a.who.target.upgrade().ok_or(AskError::Gone(id))?;
    target.grant(id, &a.host, a.port, ttl);
    let end = ttl.map(|t| SystemTime::now() + t);
    a.grant = Some(end);
    let until = end.map(|e| humantime::format_rfc3339_seconds(e).to_string());
    a.outcome.send_replace(Outcome::Approved {
        scope: Scope::Run,
        by: by.to_owned(),
        until,
    });
    Ok(a.view())
}

impl std::fmt::Debug for Asks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Asks")
            .field("kept", &self.lock().asks.len())
            .finish_non_exhaustive()
    }
}

impl Asks {
    pub fn new() -> Arc<Asks> {
        Arc::new(Asks::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// File `wanted` for `who`, at `now`.
    pub fn file(&self, who: Requester, wanted: Wanted, now: SystemTime) -> Result<Filed, AskError> {
        let checked = limits::check(&wanted)?;
        let mut s = self.lock();
        if let Some(a) = s.asks.iter().find(|a| {
            a.who.listener == who.listener
                && a.host == checked.host
                && a.port == wanted.port
                && a.pending()
        }) {
            return Ok(Filed {
                id: a.id,
                existing: true,
                auto_approved: false,
            });
        }
        let mine = s
            .asks
            .iter()
            .filter(|a| a.who.listener == who.listener && a.pending())
            .count();
        if mine >= MAX_PENDING {
            return Err(AskError::TooMany(format!(
                "{mine} requests of this workload wait for a decision already (at most \
                 {MAX_PENDING}): wait for them (GET /v1/requests/ID?wait=60)"
            )));
        }
        // Only what was filed within the window counts; listeners with nothing left in it (most
        // of them ended) are forgotten, so the map stays as small as the recent askers.
        let recent = |t: &SystemTime| now.duration_since(*t).unwrap_or_default() <= WINDOW;
        s.filed.retain(|_, w| {
            w.retain(recent);
            !w.is_empty()
        });
        if s.filed.get(&who.listener).map_or(0, VecDeque::len) >= MAX_PER_WINDOW {
            return Err(AskError::TooMany(format!(
                "this workload filed {MAX_PER_WINDOW} requests in the last {} minutes: wait \
                 for the operator",
                WINDOW.as_secs() / 60
            )));
        }
        if s.asks.iter().filter(|a| a.pending()).count() >= MAX_TOTAL_PENDING {
            return Err(AskError::Full(format!(
                "{MAX_TOTAL_PENDING} requests wait for a decision on this host: try again later"
            )));
        }
        s.filed.entry(who.listener).or_default().push_back(now);
        let host = checked.host;
        s.next += 1;
        let id = s.next;
        if s.asks.len() >= MAX_KEPT
            && let Some(i) = s.asks.iter().position(|a| !a.pending())
        {
            s.asks.remove(i);
        }
        s.asks.push_back(Ask {
            id,
            time: now,
            who,
            host: host.clone(),
            port: wanted.port,
            reason: checked.reason,
            methods: checked.methods,
            paths: checked.paths,
            outcome: watch::channel(Outcome::Pending).0,
            grant: None,
        });
        // Approved at once under the same lock: no reader (the list, the webhook) ever sees an
        // auto-approved request waiting.
        let auto_approved = self.auto_approves(&host, wanted.port)
            && approve_locked(&mut s, id, AUTO, None).is_ok();
        drop(s);
        self.saved();
        self.changed.send_modify(|n| *n += 1);
        Ok(Filed {
            id,
            existing: false,
            auto_approved,
        })
    }

    /// Itself with `[requests]`' auto-approved hosts (the daemon's start).
    pub fn configured(self: Arc<Self>, entries: Vec<egress_policy::HostEntry>) -> Arc<Self> {
        self.set_auto(entries);
        self
    }

    /// `[requests]`' auto-approved hosts from now on (a reload).
    pub fn set_auto(&self, entries: Vec<egress_policy::HostEntry>) {
        *self.auto.lock().unwrap_or_else(PoisonError::into_inner) = entries;
    }

    /// Does `[requests]` approve `host:port` at once? An entry without ports means 443.
    fn auto_approves(&self, name: &HostName, port: u16) -> bool {
        self.auto
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|e| {
                e.pattern.matches(name)
                    && if e.ports.is_empty() {
                        port == 443
                    } else {
                        e.ports.contains(&port)
                    }
            })
    }

    /// Request `id` as the listener `listener` may see it (`None`: not its own, or none).
    pub fn own(&self, id: u64, listener: u64) -> Option<View> {
        let s = self.lock();
        s.asks
            .iter()
            .find(|a| a.id == id && a.who.listener == listener)
            .map(Ask::view)
    }

    /// Wait until request `id` (of `listener`) is decided or `wait` has passed: its view then.
    pub async fn wait(&self, id: u64, listener: u64, wait: Duration) -> Option<View> {
        self.own(id, listener)?;
        self.wait_decided(id, wait).await?;
        self.own(id, listener)
    }

    /// Wait until request `id` is decided or `wait` has passed: its view then (the operator's
    /// long-poll, `GET /v1/requests/{id}?wait=S`; an `exec` waits on it for its command).
    pub async fn wait_decided(&self, id: u64, wait: Duration) -> Option<View> {
        let mut rx = {
            let s = self.lock();
            s.asks.iter().find(|a| a.id == id)?.outcome.subscribe()
        };
        tokio::time::timeout(wait, rx.wait_for(|o| *o != Outcome::Pending))
            .await
            .ok();
        self.get(id)
    }

    /// Every request kept, oldest first (`pending_only`: the waiting ones).
    pub fn list(&self, pending_only: bool) -> Vec<View> {
        self.lock()
            .asks
            .iter()
            .filter(|a| !pending_only || a.pending())
            .map(Ask::view)
            .collect()
    }

    /// One request, for the operator.
    pub fn get(&self, id: u64) -> Option<View> {
        self.lock().asks.iter().find(|a| a.id == id).map(Ask::view)
    }

    /// File a command's request for the `exec` process `pid` ([`commands`]).
    pub fn file_for_command(
        &self,
        pid: u32,
        req: commands::CommandRequest,
    ) -> Result<Filed, AskError> {
        self.commands.file(self, pid, req)
    }

    /// Approve request `id` for its workload alone: the grant goes to the listener that filed it.
    pub fn approve_run(&self, id: u64, by: &str, ttl: Option<Duration>) -> Result<View, AskError> {
        // An exec that ended has no listener left: its run grant would go nowhere.
        self.commands.prune();
        let mut s = self.lock();
        let v = approve_locked(&mut s, id, by, ttl)?;
        drop(s);
        self.saved();
        self.changed.send_modify(|n| *n += 1);
        Ok(v)
    }

    /// Record a decision made elsewhere (a `policy` approval, written by the change path first;
    /// a denial with its reason).
    pub fn decide(&self, id: u64, outcome: Outcome) -> Result<View, AskError> {
        let s = self.lock();
        let a = waiting(&s, id)?;
        a.outcome.send_replace(outcome);
        let v = a.view();
        drop(s);
        self.saved();
        self.changed.send_modify(|n| *n += 1);
        Ok(v)
    }

    /// Whether request `id` waits for a decision, and what it asks for (a `policy` approval
    /// builds its change from it).
    pub fn pending(&self, id: u64) -> Result<View, AskError> {
        let v = self.get(id).ok_or(AskError::NotFound(id))?;
        match v.outcome {
            Outcome::Pending => Ok(v),
            _ => Err(AskError::Decided(id)),
        }
    }

    /// Announces new requests and decisions.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests;
