//! Who may do what on `api.ui_listen` (the console's TCP address), decided before any route.
//!
//! - A confined process (any workload, whatever its uid) gets nothing, as on the unix socket.
//! - The `Host` header must name the address the connection arrived on (`localhost:PORT` too
//!   when that is loopback): a page of another site whose name resolves there (DNS rebinding)
//!   gets nothing.
//! - Reads: root and `api.read_group` members of this host (found by their socket) as before;
//!   anybody else — another user, a remote client when the address is not loopback — only with
//!   a session or a bearer token. Without one: the page's files (its login form) and
//!   `GET /v1/session` (401).
//! - Writes, always authenticated, whoever the peer is (a browser of root is still a browser):
//!   a session cookie plus its CSRF token in `X-Egress-CSRF` and a same-origin `Origin` (and
//!   `Sec-Fetch-Site` when sent), or `Authorization: Bearer <token>` (a script; browsers never
//!   attach that header on their own, so it needs no CSRF token).
//! - The login (`POST /v1/session`) is same-origin only too.
//!
//! Every change made this way is recorded with the token's name ([`Grant::identity`]).
use std::sync::atomic::{AtomicU64, Ordering};

use hyper::{Method, Request, StatusCode, body::Incoming};

use super::peer::{Access, Peer};
use super::routes::{Body, error};
use super::session::{CSRF_HEADER, Session, Sessions, cookie_value};
use super::tokens::Tokens;

/// The console's state: its sessions, and how many connections its address accepted (in
/// `GET /v1/status`, so a test — or an operator — can see that nothing reached it).
pub struct Console {
    pub sessions: Sessions,
    accepted: AtomicU64,
}

impl Console {
    pub fn new(tokens: Tokens) -> Console {
        Console {
            sessions: Sessions::new(tokens),
            accepted: AtomicU64::new(0),
        }
    }

    pub fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    /// `console` in `GET /v1/status`.
    pub fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "connections": self.accepted.load(Ordering::Relaxed),
            "tokens": self.sessions.tokens().any(),
        })
    }
}

/// What a request may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub write: bool,
    /// `console:NAME` (a session) or `token:NAME` (a bearer token); `None` for a peer admitted
    /// by its uid.
    pub identity: Option<String>,
    /// The session the request carries, if any.
    pub session: Option<Session>,
}

impl Grant {
    pub fn of_access(access: Access) -> Option<Grant> {
        match access {
            Access::Full => Some(Grant {
                write: true,
                identity: None,
                session: None,
            }),
            Access::ReadOnly => Some(Grant {
                write: false,
                identity: None,
                session: None,
            }),
            Access::Refused(_) => None,
        }
    }
}

/// The paths an unauthenticated client may fetch: the page (it holds the login form) and the
/// question "am I logged in".
fn public(method: &Method, path: &str) -> bool {
    (*method == Method::GET || *method == Method::HEAD)
        && (path == "/" || path.starts_with("/ui/") || path == "/v1/session")
        || (*method == Method::POST && path == "/v1/session")
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|h| h.to_str().ok())
}

/// The `Host` header names `local` (or `localhost` on its port when `local` is loopback).
pub fn host_is_local(req: &Request<Incoming>, local: std::net::SocketAddr) -> bool {
    let Some(host) = header(req, "host") else {
        return false;
    };
    let port = local.port();
    let mut ok = vec![
        format!("{}:{port}", local.ip()),
        format!("[{}]:{port}", local.ip()),
    ];
    if local.ip().is_loopback() {
        ok.push(format!("localhost:{port}"));
    }
    ok.iter().any(|o| o.eq_ignore_ascii_case(host))
}

/// A browser's request from this page itself: `Origin` is `http://<Host>` and, when sent,
/// `Sec-Fetch-Site` is `same-origin`.
fn same_origin(req: &Request<Incoming>) -> bool {
    let (Some(origin), Some(host)) = (header(req, "origin"), header(req, "host")) else {
        return false;
    };
    let site_ok = header(req, "sec-fetch-site").is_none_or(|s| s == "same-origin");
    site_ok && origin.eq_ignore_ascii_case(&format!("http://{host}"))
}

/// A request's refusal: the answer to send instead.
pub type Refusal = Box<hyper::Response<Body>>;

fn refuse(status: StatusCode, why: &str) -> Result<Grant, Refusal> {
    Err(Box::new(error(status, why)))
}

const LOG_IN: &str = "log in: POST /v1/session with a console token (`egress-agent console token NAME` as root on the host makes one), or send Authorization: Bearer <token>";

/// The grant of a request on the TCP address `local`, or the answer refusing it.
pub fn admit(
    req: &Request<Incoming>,
    peer: &Peer,
    read_gid: Option<u32>,
    local: std::net::SocketAddr,
    sessions: &Sessions,
) -> Result<Grant, Refusal> {
    if peer.confined {
        return refuse(
            StatusCode::FORBIDDEN,
            "the control API refuses confined processes",
        );
    }
    if !host_is_local(req, local) {
        return refuse(
            StatusCode::FORBIDDEN,
            "the Host header must be the address this listens on",
        );
    }
    let method = req.method();
    let path = req.uri().path();
    let read = *method == Method::GET || *method == Method::HEAD;
    // A bearer token: a script's credential, no CSRF token needed.
    if let Some(auth) = header(req, "authorization") {
        let Some(token) = auth.strip_prefix("Bearer ") else {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "Authorization: Bearer <token> only",
            );
        };
        return match sessions.tokens().verify(token.trim()) {
            Some((name, _)) => Ok(Grant {
                write: true,
                identity: Some(format!("token:{name}")),
                session: None,
            }),
            None => refuse(StatusCode::UNAUTHORIZED, "not a console token"),
        };
    }
    let session = cookie_value(
        req.headers()
            .get_all("cookie")
            .iter()
            .filter_map(|h| h.to_str().ok()),
    )
    .and_then(|c| sessions.check(c));
    if let Some(s) = session {
        if read {
            return Ok(Grant {
                write: false,
                identity: Some(format!("console:{}", s.name)),
                session: Some(s),
            });
        }
        if !same_origin(req) {
            return refuse(
                StatusCode::FORBIDDEN,
                "a write must come from the console's own page (Origin)",
            );
        }
        let csrf_ok = header(req, CSRF_HEADER).is_some_and(|t| {
            super::tokens::same(&super::tokens::digest(t), &super::tokens::digest(&s.csrf))
        });
        if !csrf_ok {
            return refuse(
                StatusCode::FORBIDDEN,
                "a write must carry the session's CSRF token in X-Egress-CSRF",
            );
        }
        return Ok(Grant {
            write: true,
            identity: Some(format!("console:{}", s.name)),
            session: Some(s),
        });
    }
    if public(method, path) {
        if *method == Method::POST && !same_origin(req) {
            return refuse(
                StatusCode::FORBIDDEN,
                "log in from the console's own page (Origin), or use Authorization: Bearer",
            );
        }
        return Ok(Grant {
            write: false,
            identity: None,
            session: None,
        });
    }
    if read
        && !peer.remote
        && let Some(g) = Grant::of_access(peer.access(read_gid))
    {
        return Ok(Grant { write: false, ..g });
    }
    refuse(StatusCode::UNAUTHORIZED, LOG_IN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_page_and_the_login_are_public() {
        assert!(public(&Method::GET, "/"));
        assert!(public(&Method::GET, "/ui/app.js"));
        assert!(public(&Method::GET, "/v1/session"));
        assert!(public(&Method::POST, "/v1/session"));
        assert!(!public(&Method::DELETE, "/v1/session"));
        assert!(!public(&Method::GET, "/v1/status"));
        assert!(!public(&Method::PUT, "/ui/app.js"));
        assert!(!public(&Method::GET, "/uix"));
    }
}
