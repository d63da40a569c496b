//! A command under `egress-agent exec` asking for access through a running daemon (the daemon's
//! side is [`super::commands`]).
//!
//! The command's listener lives in the exec process; its requests go to the daemon's registry
//! (`POST /v1/exec/requests` on the control socket), where the operator decides them as any
//! workload's. For each request this exec filed, a task long-polls the daemon
//! (`GET /v1/requests/{id}?wait=S`) and, once it is decided, applies an approval to the
//! command's listener — scope `run` with its TTL, scope `policy` for the rest of this run (the
//! daemon wrote it to the policy; this exec read its policy when it started) — *before* the
//! command can read the decision: a retry after "approved" passes.
//!
//! The command reads only what its own listener filed (the ids are kept here); the daemon's ids
//! are the operator's, so `egress-agent requests approve ID` names the same request the command
//! polls. When the daemon goes away, a request stays as it was last seen (pending) and
//! filing answers 503 naming the socket.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use egress_policy::name::HostName;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::{AskError, Filed, GrantTarget, Requester, Wanted};
use crate::control_client as client;

/// How long one long-poll of the daemon waits (below the control API's own limit).
const POLL: Duration = Duration::from_secs(50);
/// Pause after the daemon failed to answer a poll.
const RETRY: Duration = Duration::from_secs(1);

struct Mine {
    listener: u64,
    /// The request as last read from the daemon (`None` until the first read); a decided one
    /// is stored only after its grant was applied.
    view: watch::Sender<Option<Value>>,
}

/// This exec's way to the daemon's registry.
pub struct Remote {
    socket: PathBuf,
    mine: Mutex<BTreeMap<u64, Mine>>,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

fn unavailable(socket: &Path, e: &dyn std::fmt::Display) -> AskError {
    AskError::Unavailable(format!(
        "the egress-agent daemon at {} did not take the request ({e}): ask the person who \
         started this command",
        socket.display()
    ))
}

/// The daemon's error answer as the error the command gets.
fn answered_error(status: StatusCode, body: &str) -> AskError {
    let msg = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned());
    match status.as_u16() {
        400 | 413 | 422 => AskError::Invalid(msg),
        429 => AskError::TooMany(msg),
        503 => AskError::Full(msg),
        _ => AskError::Unavailable(format!("the egress-agent daemon answered {status}: {msg}")),
    }
}

/// A decided request's approval as (host, port, TTL): `None` while pending, when denied, or
/// when a run grant's TTL has passed already.
fn approval(view: &Value) -> Option<(HostName, u16, Option<Duration>)> {
    if view["state"] != "approved" {
        return None;
    }
    let host = HostName::parse(view["host"].as_str()?).ok()?;
    let port = u16::try_from(view["port"].as_u64()?).ok()?;
    let ttl = match view["until"].as_str() {
        None => None,
        Some(until) => {
            let end = humantime::parse_rfc3339_weak(until).ok()?;
            Some(end.duration_since(SystemTime::now()).ok()?)
        }
    };
    Some((host, port, ttl))
}

fn decided(view: &Value) -> bool {
    view["state"].as_str().is_some_and(|s| s != "pending")
}

impl Remote {
    /// `Some` when a daemon answers on `socket` (its status), else `None`: a standalone exec.
    pub async fn connect(socket: &Path) -> Option<Arc<Remote>> {
        let status = tokio::time::timeout(
            Duration::from_secs(2),
            client::request(socket, Method::GET, "/v1/status"),
        )
        .await;
        match status {
            Ok(Ok(_)) => Some(Arc::new(Remote {
                socket: socket.to_owned(),
                mine: Mutex::new(BTreeMap::new()),
            })),
            Ok(Err(e)) => {
                tracing::info!(error = %e, "no daemon takes this command's access requests");
                None
            }
            Err(_) => {
                tracing::info!(socket = %socket.display(),
                    "no daemon answered in time: this command's access requests are refused");
                None
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Mine>> {
        self.mine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// File `wanted` for `who` (the command's listener) with the daemon.
    pub async fn file(self: &Arc<Self>, who: Requester, wanted: Wanted) -> Result<Filed, AskError> {
        let body = json!({
            "workload": who.workload,
            "policy": who.policy,
            "run": who.run,
            "request": wanted,
        });
        let (status, text) = client::request_body(
            &self.socket,
            Method::POST,
            "/v1/exec/requests",
            Some(("application/json", body.to_string().into_bytes())),
        )
        .await
        .map_err(|e| unavailable(&self.socket, &e))?;
        if !status.is_success() {
            return Err(answered_error(status, &text));
        }
        let v: Value = serde_json::from_str(&text).map_err(|e| unavailable(&self.socket, &e))?;
        let id = v["id"]
            .as_u64()
            .ok_or_else(|| unavailable(&self.socket, &"no id in its answer"))?;
        let mut filed = Filed {
            id,
            existing: v["existing"].as_bool().unwrap_or(false),
            auto_approved: v["state"] == "approved",
        };
        let new = {
            let mut mine = self.lock();
            match mine.get(&id) {
                Some(_) => false,
                None => {
                    mine.insert(
                        id,
                        Mine {
                            listener: who.listener,
                            view: watch::channel(None).0,
                        },
                    );
                    true
                }
            }
        };
        if filed.auto_approved {
            // Approved at once by `[requests]`: granted before the command hears "approved". If
            // the daemon can't be read back now, the command hears "pending" and the follower
            // grants it, then tells it.
            filed.auto_approved = match self.read(id, Duration::ZERO).await {
                Ok(view) => {
                    self.settle(id, &who.target, view);
                    true
                }
                Err(_) => false,
            };
        }
        if new && !filed.auto_approved {
            let me = Arc::clone(self);
            let target = who.target.clone();
            tokio::spawn(async move { me.follow(id, target).await });
        }
        Ok(filed)
    }

    /// The daemon's view of request `id`, after waiting up to `wait` for a decision.
    async fn read(&self, id: u64, wait: Duration) -> Result<Value, Option<StatusCode>> {
        let path = format!("/v1/requests/{id}?wait={}", wait.as_secs());
        match client::request_body(&self.socket, Method::GET, &path, None).await {
            Ok((status, text)) if status.is_success() => {
                serde_json::from_str(&text).map_err(|_| Some(status))
            }
            Ok((status, _)) => Err(Some(status)),
            Err(_) => Err(None),
        }
    }

    /// Store `view` for request `id`, granting an approval to `target` first.
    fn settle(&self, id: u64, target: &Weak<dyn GrantTarget>, view: Value) {
        if let Some((host, port, ttl)) = approval(&view)
            && let Some(t) = target.upgrade()
        {
            t.grant(id, &host, port, ttl);
        }
        if let Some(m) = self.lock().get(&id) {
            m.view.send_replace(Some(view));
        }
    }

    /// Follow request `id` until it is decided (or the command's listener or the request is
    /// gone), applying its approval.
    async fn follow(&self, id: u64, target: Weak<dyn GrantTarget>) {
        let mut wait = Duration::ZERO;
        while target.strong_count() > 0 {
            match self.read(id, wait).await {
                Ok(view) if decided(&view) => {
                    tracing::info!(request = id, state = %view["state"], "access request decided");
                    self.settle(id, &target, view);
                    return;
                }
                Ok(view) => {
                    if let Some(m) = self.lock().get(&id) {
                        m.view.send_replace(Some(view));
                    }
                    wait = POLL;
                }
                Err(Some(StatusCode::NOT_FOUND)) => {
                    tracing::warn!(
                        request = id,
                        "the daemon no longer knows this access request (restarted?)"
                    );
                    return;
                }
                Err(_) => tokio::time::sleep(RETRY).await,
            }
        }
    }

    /// Request `id` as `listener` may see it, after waiting up to `wait` for its decision
    /// (`None`: not filed by that listener).
    pub async fn wait(&self, id: u64, listener: u64, wait: Duration) -> Option<Value> {
        let mut rx = {
            let mine = self.lock();
            let m = mine.get(&id).filter(|m| m.listener == listener)?;
            m.view.subscribe()
        };
        // Timing out is an answer too: the request as it stands.
        tokio::time::timeout(wait, rx.wait_for(|v| v.as_ref().is_some_and(decided)))
            .await
            .ok();
        let seen = rx.borrow().clone();
        match seen {
            Some(v) => Some(v),
            // Not read yet: ask the daemon once.
            None => self.read(id, Duration::ZERO).await.ok(),
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn approvals_are_read_from_the_daemons_view() {
        let run =
            json!({"state": "approved", "scope": "run", "host": "api.example.com", "port": 443});
        let (h, p, ttl) = approval(&run).unwrap();
        assert_eq!((h.as_str(), p, ttl), ("api.example.com", 443, None));
        let until =
            humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(3600));
        let timed = json!({"state": "approved", "scope": "run", "host": "a.example", "port": 8443, "until": until.to_string()});
        let ttl = approval(&timed).unwrap().2.unwrap();
        assert!(
            ttl > Duration::from_secs(3500) && ttl <= Duration::from_secs(3600),
            "{ttl:?}"
        );
        let past = json!({"state": "approved", "host": "a.example", "port": 1, "until": "2020-01-01T00:00:00Z"});
        assert!(approval(&past).is_none(), "a TTL that ended grants nothing");
        for v in [
            json!({"state": "pending", "host": "a.example", "port": 1}),
            json!({"state": "denied", "host": "a.example", "port": 1, "reason": "no"}),
            json!({"state": "approved", "host": "not a name", "port": 1}),
        ] {
            assert!(approval(&v).is_none(), "{v}");
        }
        assert!(decided(&json!({"state": "denied"})));
        assert!(!decided(&json!({"state": "pending"})));
    }

    #[test]
    fn the_daemons_errors_keep_their_meaning() {
        let e = answered_error(StatusCode::TOO_MANY_REQUESTS, r#"{"error":"slow down"}"#);
        assert_eq!(e, AskError::TooMany("slow down".into()));
        assert_eq!(e.status(), 429);
        assert_eq!(
            answered_error(StatusCode::BAD_REQUEST, "{\"error\":\"host: bad\"}").status(),
            400
        );
        assert_eq!(
            answered_error(StatusCode::FORBIDDEN, "refused").status(),
            503
        );
    }
}
