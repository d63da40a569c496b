//! The local control API: HTTP/1.1 over a unix socket, root-only.
//!
//! The daemon serves it ([`server`]); the CLI subcommands `status`, `events` and `reload` are its
//! clients ([`client`]). Endpoints (all JSON; see `docs/api.yaml` for the OpenAPI description):
//!
//! | method | path                     | answer                                                 |
//! |--------|--------------------------|--------------------------------------------------------|
//! | GET    | `/v1/session`            | who the caller is to the API (uid, or console operator) |
//! | POST   | `/v1/session`            | console login with a token: a session cookie + CSRF token |
//! | DELETE | `/v1/session`            | console logout                                         |
//! | GET    | `/v1/status`             | what is loaded and pinned, listeners, counts           |
//! | GET    | `/v1/containers`         | enforced containers/cgroups with their policy, badge and counters |
//! | GET    | `/v1/policies`           | the effective policies                                 |
//! | GET    | `/v1/policies/{name}`    | one policy: source (built-in, config, policies.d), file, badge |
//! | PUT    | `/v1/policies/{name}`    | create/replace (TOML or JSON body); 422 names the field |
//! | DELETE | `/v1/policies/{name}`    | remove a `policies.d` policy (409 if in use, `?force=1`) |
//! | GET    | `/v1/defaults`           | `agent.default_policy`, `agent.unlabeled`              |
//! | PUT    | `/v1/defaults`           | set either or both                                     |
//! | GET    | `/v1/export`             | the bundle (JSON; `?format=toml`)                      |
//! | POST   | `/v1/import`             | a bundle: the diff (dry run), applied with `?apply=1`  |
//! | GET    | `/v1/explain`            | `?policy=P` or `?container=C`, `&target=HOST[:PORT]`   |
//! | GET    | `/v1/denials`            | recent denials from the event store (selection)        |
//! | GET    | `/v1/suggest`            | a suggested allowlist for a selection                  |
//! | POST   | `/v1/replay`             | recorded flows decided again under a proposed policy (changes nothing) |
//! | GET    | `/v1/changes`            | the policy changes made through the API, with the uid  |
//! | GET    | `/v1/doctor`             | the doctor's probes                                    |
//! | GET    | `/v1/events?n=N`         | the N most recent denial events (default 100)          |
//! | GET    | `/v1/events?follow=1`    | NDJSON stream of denial events as they happen          |
//! | GET    | `/v1/events/sse`         | the same stream as server-sent events (status page)    |
//! | POST   | `/v1/reload`             | re-read the config; 200 if applied, 422 with the error |
//! | POST   | `/v1/restart`            | start a new agent that takes over (hand-over); its pid |
//! | GET    | `/ui/`                   | the status page (HTML, JS, CSS; no external assets)    |
//!
//! Access (see [`peer`]): the socket file is mode 0600 root (0660 with the `api.read_group`
//! group), and every connection's peer credentials are checked again: root gets everything, a
//! member of `api.read_group` the GET endpoints, a confined process nothing, whatever its uid.
//! The optional TCP address (`api.ui_listen`) is the console: the same endpoints behind their
//! own authentication ([`console`]: tokens, sessions, CSRF), refused to confined processes.

pub mod backend;
/// The CLI's client of this API (its own module: `exec` files requests through it too).
pub use crate::control_client as client;
pub mod console;
pub mod peer;
pub mod routes;
pub mod server;
pub mod session;
pub mod tokens;

use std::{future::Future, pin::Pin};

use serde_json::Value;

/// Default path of the control socket.
pub const DEFAULT_SOCKET: &str = "/run/egress-agent/api.sock";

/// A boxed future, for the one async method of [`Control`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An answer other than 200: the HTTP status and the message (`{"error": ...}`), or a whole
/// JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub body: Value,
}

impl ApiError {
    pub fn new(status: u16, message: impl std::fmt::Display) -> Self {
        ApiError {
            status,
            body: serde_json::json!({ "error": message.to_string() }),
        }
    }
    /// An error about one field of a request (`{"error", "field"}`).
    pub fn field(status: u16, field: &str, message: impl std::fmt::Display) -> Self {
        ApiError {
            status,
            body: serde_json::json!({ "error": message.to_string(), "field": field }),
        }
    }
    pub fn unavailable(what: &str) -> Self {
        ApiError::new(501, format!("{what} is not available here"))
    }
}

impl From<crate::asks::AskError> for ApiError {
    fn from(e: crate::asks::AskError) -> Self {
        ApiError::new(e.status(), e)
    }
}

impl From<crate::manage::ManageError> for ApiError {
    fn from(e: crate::manage::ManageError) -> Self {
        ApiError {
            status: e.status(),
            body: e.body(),
        }
    }
}

/// `GET /v1/explain`'s question.
#[derive(Debug, Clone, Default)]
pub struct ExplainQuery {
    pub policy: Option<String>,
    pub container: Option<String>,
    /// A Kubernetes pod, `NAMESPACE/NAME`.
    pub pod: Option<String>,
    pub target: String,
    /// `own` (a container, the default) or `host` (`exec`).
    pub netns: Option<String>,
}

/// A selection of stored events (`/v1/denials`, `/v1/suggest`): the `events`/`suggest` flags.
#[derive(Debug, Clone, Default)]
pub struct StoreQuery {
    pub selection: crate::store::selection::Selection,
    pub n: usize,
    pub include_denied: bool,
    pub name: Option<String>,
}

/// `POST /v1/replay`'s body: the proposed policy (its fields, as `PUT /v1/policies/{name}` takes
/// them, under `name`) and which recorded flows (the `replay` command's flags). The MCP tool
/// `replay` takes the same object as its arguments (the doc comments are its schema).
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayBody {
    /// The proposed policy's name: the traffic recorded under it is replayed (see `against`).
    pub name: String,
    /// The proposed policy's fields as a JSON object (`{"allow_hosts": ["github.com"]}`), as
    /// `PUT /v1/policies/{name}` (and MCP's set_policy) take them.
    pub policy: serde_json::Map<String, Value>,
    /// Only since then: 30m, 2h, 7d, or an RFC 3339 time.
    #[serde(default)]
    pub since: Option<String>,
    /// Only this container (name or id prefix).
    #[serde(default)]
    pub container: Option<String>,
    /// Only this run (the `run` label).
    #[serde(default)]
    pub run: Option<String>,
    /// Only this Kubernetes pod: `NAME` or `NAMESPACE/NAME`.
    #[serde(default)]
    pub pod: Option<String>,
    /// Only this Kubernetes namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Context labels that must match.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    /// Replay the traffic recorded under this policy instead (default `name`), or `any` for all
    /// of it.
    #[serde(default)]
    pub against: Option<String>,
    /// Destinations listed per bucket (default 20; 0: all).
    #[serde(default)]
    pub limit: Option<usize>,
}

impl ReplayBody {
    /// Parse a request body; a malformed one is a 400 naming the field (`field`).
    pub fn parse(text: &str) -> Result<ReplayBody, ApiError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let inner = e.inner().to_string();
            // Unknown and missing fields are errors of the object itself: their name is quoted.
            let field = match e.path().to_string() {
                p if p != "." => p,
                _ => inner.split('`').nth(1).unwrap_or("").to_owned(),
            };
            ApiError::field(400, &field, format!("request body: {inner}"))
        })
    }
}

/// What the daemon exposes to the API. Answers are JSON values so the API layer stays a thin
/// transport over the daemon's own types. The methods with a default answer 501 (test fakes
/// need not implement what they don't serve).
pub trait Control: Send + Sync + 'static {
    fn status(&self) -> Value;
    fn containers(&self) -> Value;
    fn policies(&self) -> Value;
    /// The `n` most recent denial events, oldest first.
    fn events(&self, n: usize) -> Vec<Value>;
    /// A live feed of denial events (for `events --follow`).
    fn subscribe(&self) -> tokio::sync::mpsc::Receiver<Value>;
    /// Re-reads and applies the config. `Err` carries the message shown to the operator; the
    /// running policy stays in force then.
    fn reload(&self) -> BoxFuture<'_, Result<Value, String>>;
    /// One policy (`None`: no such policy).
    fn policy(&self, _name: &str) -> Option<Value> {
        None
    }
    fn defaults(&self) -> Result<Value, ApiError> {
        Err(ApiError::unavailable("defaults"))
    }
    /// The bundle of this host's policies.
    fn export(&self) -> Result<crate::manage::bundle::Bundle, ApiError> {
        Err(ApiError::unavailable("export"))
    }
    /// Validate and apply a change as `who` (or only validate it: `dry_run`).
    fn change(
        &self,
        _change: crate::manage::Change,
        _who: crate::manage::Who,
        _dry_run: bool,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async { Err(ApiError::unavailable("policy changes")) })
    }
    fn explain(&self, _q: ExplainQuery) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async { Err(ApiError::unavailable("explain")) })
    }
    /// Stored denials (and would-denials) matching the selection, oldest first.
    fn denials(&self, _q: &StoreQuery) -> Result<Vec<Value>, ApiError> {
        Err(ApiError::unavailable("the event store"))
    }
    /// The suggested policy (TOML) for the selection.
    fn suggest(&self, _q: &StoreQuery) -> Result<String, ApiError> {
        Err(ApiError::unavailable("suggest"))
    }
    /// Recorded flows decided again under a proposed policy: the report (JSON). Changes
    /// nothing.
    fn replay(&self, _body: ReplayBody) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async { Err(ApiError::unavailable("replay")) })
    }
    /// The newest `n` recorded policy changes, oldest first.
    fn changes(&self, _n: usize) -> Result<Vec<Value>, ApiError> {
        Err(ApiError::unavailable("the change record"))
    }
    /// The doctor's report (JSON).
    fn doctor(&self) -> BoxFuture<'_, Value> {
        Box::pin(async { serde_json::json!({ "error": "not available" }) })
    }
    /// Workloads' access requests kept (`pending_only`: those waiting), oldest first.
    fn requests(&self, _pending_only: bool) -> Result<Value, ApiError> {
        Err(ApiError::unavailable("access requests"))
    }
    /// Request `id`, after waiting up to `wait` for its decision.
    fn request(
        &self,
        _id: u64,
        _wait: std::time::Duration,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async { Err(ApiError::unavailable("access requests")) })
    }
    /// File a command's request for the exec process `pid` ([`crate::asks::commands`]):
    /// `{"id", "state", "existing"}`.
    fn file_for_command(
        &self,
        _pid: u32,
        _req: crate::asks::commands::CommandRequest,
    ) -> Result<Value, ApiError> {
        Err(ApiError::unavailable("access requests"))
    }
    /// Decide request `id` as `who`: a run grant, a policy change (through [`Control::change`]'s
    /// path), or a denial with its reason; the waiting workload gets it.
    fn decide(
        &self,
        _id: u64,
        _decision: crate::asks::Decision,
        _who: crate::manage::Who,
        _dry_run: bool,
    ) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async { Err(ApiError::unavailable("access requests")) })
    }
    /// Start a new agent from the installed binary that takes this one's sockets (as SIGUSR2
    /// does): `{"pid", "new_pid"}` once it runs; it takes over when it is ready.
    fn restart(&self) -> BoxFuture<'_, Result<Value, ApiError>> {
        Box::pin(async { Err(ApiError::unavailable("restart")) })
    }
}
