//! Secrets for credential injection: loading them from their sources. The model ([`Secret`],
//! [`SecretSource`]) is egress-policy's `secret`; this module is the I/O.
//!
//! A [`Secret`] is bytes in a [`Zeroizing`] buffer behind an `Arc` (zeroed when the last holder
//! drops it), with a `Debug` that prints nothing of it and no `Display`/`Serialize` at all, so it
//! can't reach a log line, an event, an error message or an API answer by accident.
//!
//! Sources ([`SecretSource`]):
//! - `file`: the whole file, one trailing newline dropped.
//! - `env`: an environment variable **of the agent**. It is read once, the first time any
//!   configuration names it, kept in a process-wide table (so a reload finds it again), and then
//!   removed from the process environment *and* overwritten in place in the memory that
//!   `/proc/<pid>/environ` shows (see [`sys`]); child processes (`exec`'s command, a restart's
//!   new agent) never inherit it. A new agent that takes over gets the table over the hand-over
//!   socket instead ([`env_secrets`] → `handover::secrets` → [`install_env`]).
//! - `credential`: a systemd credential, `$CREDENTIALS_DIRECTORY/<name>` (`LoadCredential=` /
//!   `LoadCredentialEncrypted=` in the unit).
//!
//! Errors name the source (path, variable or credential name), never its content.
mod sys;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use zeroize::Zeroizing;

pub use egress_policy::secret::{Secret, SecretSource};

/// Why a secret could not be loaded. Never carries the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("can't read secret file {path}: {error}")]
    File { path: PathBuf, error: String },
    #[error(
        "environment variable {0} is not set in the agent's environment (nor was it at an earlier load)"
    )]
    EnvMissing(String),
    #[error("{0:?} is not a valid environment variable name")]
    EnvName(String),
    #[error(
        "systemd credential {0:?}: $CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the unit)"
    )]
    NoCredentialsDirectory(String),
    #[error("{0:?} is not a valid credential name (one path component)")]
    CredentialName(String),
    #[error("secret from {0} is empty")]
    Empty(String),
    #[error("secret from {0} contains bytes not allowed in an HTTP header (control characters)")]
    NotHeaderSafe(String),
}

/// Environment secrets taken out of the process environment so far (name → value).
static ENV_SECRETS: Mutex<Option<HashMap<String, Secret>>> = Mutex::new(None);

/// Load `source`.
pub fn load(source: &SecretSource) -> Result<Secret, SecretError> {
    let (label, bytes) = match source {
        SecretSource::File(path) => (path.display().to_string(), read_file(path)?),
        SecretSource::Env(name) => return from_env(name),
        SecretSource::Credential(name) => {
            if name.is_empty() || name == "." || name == ".." || name.contains('/') {
                return Err(SecretError::CredentialName(name.clone()));
            }
            let dir = std::env::var_os("CREDENTIALS_DIRECTORY")
                .ok_or_else(|| SecretError::NoCredentialsDirectory(name.clone()))?;
            let path = Path::new(&dir).join(name);
            (format!("credential {name}"), read_file(&path)?)
        }
    };
    checked(label, bytes)
}

fn read_file(path: &Path) -> Result<Zeroizing<Vec<u8>>, SecretError> {
    let mut bytes = Zeroizing::new(std::fs::read(path).map_err(|e| SecretError::File {
        path: path.to_owned(),
        error: e.kind().to_string(),
    })?);
    if bytes.ends_with(b"\n") {
        bytes.pop();
        if bytes.ends_with(b"\r") {
            bytes.pop();
        }
    }
    Ok(bytes)
}

fn checked(label: String, bytes: Zeroizing<Vec<u8>>) -> Result<Secret, SecretError> {
    if bytes.is_empty() {
        return Err(SecretError::Empty(label));
    }
    // What http::HeaderValue accepts, minus tab: visible ASCII, space, obs-text.
    if bytes.iter().any(|b| *b < 0x20 || *b == 0x7f) {
        return Err(SecretError::NotHeaderSafe(label));
    }
    Ok(Secret::from_zeroizing(bytes))
}

fn valid_env_name(name: &str) -> bool {
    let mut b = name.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Every environment secret this process holds (taken from its environment, or installed from
/// the agent it took over from), by variable name: what a hand-over passes to a successor.
pub fn env_secrets() -> Vec<(String, Secret)> {
    let table = ENV_SECRETS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    table
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Install environment secret `name` as the agent this one takes over from held it, before any
/// configuration is resolved with it. The same checks as a value read from the environment.
/// A variable of this process's own environment wins (the operator's newer value, e.g. a
/// DaemonSet roll with a rotated key): it is taken (and scrubbed) instead, and `Ok(false)` says
/// the handed-over value was not used.
pub fn install_env(name: &str, bytes: Zeroizing<Vec<u8>>) -> Result<bool, SecretError> {
    if !valid_env_name(name) {
        return Err(SecretError::EnvName(name.to_owned()));
    }
    let secret = checked(format!("environment variable {name}"), bytes)?;
    let mut table = ENV_SECRETS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let table = table.get_or_insert_with(HashMap::new);
    if table.contains_key(name) {
        return Ok(false);
    }
    if let Some(own) = sys::take_env(name) {
        let own = checked(format!("environment variable {name}"), own)?;
        table.insert(name.to_owned(), own);
        return Ok(false);
    }
    table.insert(name.to_owned(), secret);
    Ok(true)
}

fn from_env(name: &str) -> Result<Secret, SecretError> {
    if !valid_env_name(name) {
        return Err(SecretError::EnvName(name.to_owned()));
    }
    let mut table = ENV_SECRETS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let table = table.get_or_insert_with(HashMap::new);
    if let Some(s) = table.get(name) {
        return Ok(s.clone());
    }
    let Some(bytes) = sys::take_env(name) else {
        return Err(SecretError::EnvMissing(name.to_owned()));
    };
    let secret = checked(format!("environment variable {name}"), bytes)?;
    table.insert(name.to_owned(), secret.clone());
    Ok(secret)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn file_source_drops_one_newline_and_rejects_empty_and_control_bytes() {
        let dir = crate::test_dir::fresh("secret");
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("k");
        std::fs::write(&f, "sk-123\n").unwrap();
        let s = load(&SecretSource::File(f.clone())).unwrap();
        assert_eq!(s.expose(), b"sk-123");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        std::fs::write(&f, "\n").unwrap();
        assert!(matches!(
            load(&SecretSource::File(f.clone())),
            Err(SecretError::Empty(_))
        ));
        std::fs::write(&f, "a\r\nb").unwrap();
        let e = load(&SecretSource::File(f.clone())).unwrap_err();
        assert!(matches!(e, SecretError::NotHeaderSafe(_)));
        assert!(!e.to_string().contains("a\r\nb"));
        let e = load(&SecretSource::File(dir.join("missing"))).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Child mode of the next test: a process whose `CREDENTIALS_DIRECTORY` was set by its
    /// parent (this process's environment is never changed while other tests run).
    #[test]
    fn credential_child() {
        let Some(mode) = std::env::var_os("EGRESS_CREDENTIAL_CHILD") else {
            return;
        };
        let api = load(&SecretSource::Credential("api".into()));
        if mode == "unset" {
            assert!(
                matches!(api, Err(SecretError::NoCredentialsDirectory(ref n)) if n == "api"),
                "{api:?}"
            );
            return;
        }
        assert_eq!(api.unwrap().expose(), b"sk-cred-123");
        let e = load(&SecretSource::Credential("missing".into())).unwrap_err();
        assert!(matches!(e, SecretError::File { .. }), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
        assert!(matches!(
            load(&SecretSource::Credential("empty".into())),
            Err(SecretError::Empty(ref l)) if l == "credential empty"
        ));
    }

    /// `{ credential = "name" }` reads `$CREDENTIALS_DIRECTORY/name` like a file (one newline
    /// dropped, empty refused), and without the variable says so, naming the credential.
    #[test]
    fn credential_source_reads_the_credentials_directory() {
        let dir = crate::test_dir::fresh("creds");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("api"), "sk-cred-123\n").unwrap();
        std::fs::write(dir.join("empty"), "").unwrap();
        let child = |mode: &str| {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "--exact",
                "secrets::tests::credential_child",
                "--test-threads=1",
                "--nocapture",
            ])
            .env("EGRESS_CREDENTIAL_CHILD", mode);
            if mode == "unset" {
                cmd.env_remove("CREDENTIALS_DIRECTORY");
            } else {
                cmd.env("CREDENTIALS_DIRECTORY", &dir);
            }
            let out = cmd.output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "child {mode}: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        child("set");
        child("unset");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn credential_names_are_one_component() {
        for bad in ["", ".", "..", "a/b", "../etc/shadow"] {
            assert!(matches!(
                load(&SecretSource::Credential(bad.into())),
                Err(SecretError::CredentialName(_))
            ));
        }
    }

    /// A handed-over value fills a gap in the table; the table (and this process's own
    /// environment) win over it; a bad one is refused like a bad variable.
    #[test]
    fn installed_env_secrets_are_found_like_taken_ones() {
        let var = "EGRESS_TEST_INSTALLED_SECRET";
        assert!(matches!(
            load(&SecretSource::Env(var.into())),
            Err(SecretError::EnvMissing(_))
        ));
        assert!(install_env(var, Zeroizing::new(b"handed-over".to_vec())).unwrap());
        assert_eq!(
            load(&SecretSource::Env(var.into())).unwrap().expose(),
            b"handed-over"
        );
        assert!(!install_env(var, Zeroizing::new(b"other".to_vec())).unwrap());
        assert_eq!(
            load(&SecretSource::Env(var.into())).unwrap().expose(),
            b"handed-over"
        );
        assert!(
            env_secrets()
                .iter()
                .any(|(k, v)| k == var && v.expose() == b"handed-over")
        );
        assert!(matches!(
            install_env("EGRESS_TEST_EMPTY", Zeroizing::new(Vec::new())),
            Err(SecretError::Empty(_))
        ));
        assert!(matches!(
            install_env("BAD=NAME", Zeroizing::new(b"x".to_vec())),
            Err(SecretError::EnvName(_))
        ));
        assert!(matches!(
            install_env("EGRESS_TEST_CTL", Zeroizing::new(b"a\nb".to_vec())),
            Err(SecretError::NotHeaderSafe(_))
        ));
    }

    #[test]
    fn env_names_are_checked() {
        assert!(matches!(
            load(&SecretSource::Env("1BAD".into())),
            Err(SecretError::EnvName(_))
        ));
        assert!(matches!(
            load(&SecretSource::Env("EGRESS_TEST_SURELY_UNSET_VAR".into())),
            Err(SecretError::EnvMissing(_))
        ));
    }
}
