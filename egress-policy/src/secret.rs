//! A secret for credential injection and where it comes from: the model only (loading, which
//! reads files and the environment, is the agent's `secrets` module).
//!
//! A [`Secret`] is bytes in a [`Zeroizing`] buffer behind an `Arc` (zeroed when the last holder
//! drops it), with a `Debug` that prints nothing of it and no `Display`/`Serialize` at all, so it
//! can't reach a log line, an event, an error message or an API answer by accident.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

/// Where a secret comes from (`source = { file = "..." }` / `{ env = "..." }` /
/// `{ credential = "..." }`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SecretSource {
    /// A file (root-only, e.g. 0600); one trailing newline is dropped.
    File(PathBuf),
    /// An environment variable of the agent process (read once, then scrubbed).
    Env(String),
    /// A systemd credential: `$CREDENTIALS_DIRECTORY/<name>`.
    Credential(String),
}

/// Secret bytes. Cloning shares one zeroizing buffer.
#[derive(Clone)]
pub struct Secret(Arc<Zeroizing<Vec<u8>>>);

impl Secret {
    pub fn new(bytes: Vec<u8>) -> Secret {
        Secret(Arc::new(Zeroizing::new(bytes)))
    }
    /// A secret from bytes already held in a zeroizing buffer (as a loader reads them).
    pub fn from_zeroizing(bytes: Zeroizing<Vec<u8>>) -> Secret {
        Secret(Arc::new(bytes))
    }
    /// The secret's bytes: only for building what goes to the upstream.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl PartialEq for Secret {
    /// Length, then every byte (no early exit on the first difference).
    fn eq(&self, other: &Secret) -> bool {
        let (a, b) = (self.expose(), other.expose());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}
