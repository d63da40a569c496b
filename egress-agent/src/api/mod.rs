//! The local control API: HTTP/1.1 over a unix socket, root-only.
//!
//! The daemon serves it ([`server`]); the CLI subcommands `status`, `events` and `reload` are its
//! clients ([`client`]). Endpoints (all JSON; see `docs/api.yaml` for the OpenAPI description):
//!
//! | method | path                  | answer                                                    |
//! |--------|-----------------------|-----------------------------------------------------------|
//! | GET    | `/v1/status`          | what is loaded and pinned, listeners, counts              |
//! | GET    | `/v1/containers`      | enforced containers/cgroups with their policy and counters |
//! | GET    | `/v1/policies`        | the effective policies                                    |
//! | GET    | `/v1/events?n=N`      | the N most recent denial events (default 100)             |
//! | GET    | `/v1/events?follow=1` | NDJSON stream of denial events as they happen             |
//! | POST   | `/v1/reload`          | re-read the config; 200 if applied, 422 with the error    |
//!
//! Access: the socket file is created mode 0600 (root only), and every connection's peer
//! credentials (SO_PEERCRED) are checked again: a non-root peer gets 403 even if the file mode
//! was loosened by hand.

pub mod client;
pub mod server;

use std::{future::Future, pin::Pin};

use serde_json::Value;

/// Default path of the control socket.
pub const DEFAULT_SOCKET: &str = "/run/egress-agent/api.sock";

/// A boxed future, for the one async method of [`Control`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the daemon exposes to the API. Answers are JSON values so the API layer stays a thin
/// transport over the daemon's own types.
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
}
