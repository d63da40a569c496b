//! The bounds of access requests, and the check of what a workload asks for: a request is
//! untrusted input (the workload may be the prompt-injected party), so every field is bounded
//! and normalised before anyone sees it.
use std::time::Duration;

use egress_policy::name::HostName;

use super::{AskError, Wanted};

/// Requests of one listener waiting for a decision at once.
pub const MAX_PENDING: usize = 8;
/// Requests one listener may file per [`WINDOW`].
pub const MAX_PER_WINDOW: usize = 30;
pub const WINDOW: Duration = Duration::from_secs(600);
/// Requests waiting on the whole agent.
pub const MAX_TOTAL_PENDING: usize = 256;
/// Requests kept (decided ones are dropped first).
pub const MAX_KEPT: usize = 1024;
/// Bytes of a request's reason.
pub const MAX_REASON: usize = 500;
const MAX_LIST: usize = 8;
const MAX_PATH: usize = 200;
const METHODS: [&str; 9] = [
    "GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE", "CONNECT", "TRACE",
];

/// A request's fields once checked.
pub(super) struct Checked {
    pub host: HostName,
    pub reason: String,
    pub methods: Vec<String>,
    pub paths: Vec<String>,
}

pub(super) fn check(w: &Wanted) -> Result<Checked, AskError> {
    let bad = |m: String| Err(AskError::Invalid(m));
    let host = match HostName::parse(&w.host) {
        Ok(h) => h,
        Err(e) => {
            return bad(format!(
                "host: {e} (a name; an address can't be asked for: the operator allows \
                 addresses in the policy)"
            ));
        }
    };
    if w.port == 0 {
        return bad("port: 1-65535".to_owned());
    }
    let reason = w.reason.trim();
    if reason.is_empty() {
        return bad("reason: say why the workload needs it (the operator reads it)".to_owned());
    }
    if reason.len() > MAX_REASON {
        return bad(format!("reason: at most {MAX_REASON} bytes"));
    }
    if reason.chars().any(|c| c.is_control() && c != '\n') {
        return bad("reason: no control characters".to_owned());
    }
    if w.methods.len() > MAX_LIST || w.paths.len() > MAX_LIST {
        return bad(format!("methods, paths: at most {MAX_LIST} each"));
    }
    let mut methods = Vec::new();
    for m in &w.methods {
        let up = m.to_ascii_uppercase();
        if !METHODS.contains(&up.as_str()) {
            return bad(format!(
                "methods: {m:?} is not one of {}",
                METHODS.join(", ")
            ));
        }
        if !methods.contains(&up) {
            methods.push(up);
        }
    }
    for p in &w.paths {
        if !p.starts_with('/') || p.len() > MAX_PATH || p.chars().any(char::is_control) {
            return bad(format!(
                "paths: each starts with / and has at most {MAX_PATH} bytes, no control characters"
            ));
        }
    }
    Ok(Checked {
        host,
        reason: reason.to_owned(),
        methods,
        paths: w.paths.clone(),
    })
}
