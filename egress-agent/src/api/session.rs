//! Console sessions on `api.ui_listen`: made by a login with a token ([`super::tokens`]),
//! carried by a cookie (`HttpOnly`, `SameSite=Strict`), each with its own CSRF token that every
//! write must send back in a header. Held in memory only: a restart or hand-over logs everybody
//! out. A session ends on logout, after [`IDLE`] without a request, after [`MAX_AGE`], or as
//! soon as the token it was made with is rotated or revoked.
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::tokens::{self, Digest, Tokens};

/// The session cookie's name.
pub const COOKIE: &str = "egress_session";
/// The header a write carries its session's CSRF token in.
pub const CSRF_HEADER: &str = "x-egress-csrf";
/// A session unused this long ends.
pub const IDLE: Duration = Duration::from_secs(60 * 60);
/// No session lives longer.
pub const MAX_AGE: Duration = Duration::from_secs(12 * 60 * 60);
/// At most this many sessions at once; a new login ends the oldest.
const MAX_SESSIONS: usize = 64;
/// Wrong tokens per [`FAIL_WINDOW`] before a wrong one is answered 429 (a right one never is).
const MAX_FAILS: u32 = 20;
const FAIL_WINDOW: Duration = Duration::from_secs(60);

/// A logged-in operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The token's name: what changes are recorded with.
    pub name: String,
    /// The CSRF token writes must send in [`CSRF_HEADER`].
    pub csrf: String,
    token: Digest,
    created: Instant,
    used: Instant,
}

/// A successful login: the cookie's value and the session.
#[derive(Debug)]
pub struct Login {
    pub cookie: String,
    pub session: Session,
}

/// Why a login was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginRefused {
    /// Not a token of `console.tokens`.
    Wrong,
    /// Too many wrong tokens lately.
    TooMany,
    /// The random source failed.
    Unavailable,
}

pub struct Sessions {
    tokens: Tokens,
    /// By the digest of the cookie's value (the value itself is never kept).
    live: Mutex<HashMap<Digest, Session>>,
    fails: Mutex<(Instant, u32)>,
}

impl Sessions {
    pub fn new(tokens: Tokens) -> Self {
        Sessions {
            tokens,
            live: Mutex::new(HashMap::new()),
            fails: Mutex::new((Instant::now(), 0)),
        }
    }

    pub fn tokens(&self) -> &Tokens {
        &self.tokens
    }

    /// Log in with a token: a new session, or why not. A right token always logs in (a client
    /// sending wrong ones can't lock the operator out); past [`MAX_FAILS`] wrong ones a minute,
    /// a wrong one is answered `TooMany` (tokens are 256 random bits: guessing is no threat; the
    /// limit tells a noisy client to stop).
    pub fn login(&self, token: &str) -> Result<Login, LoginRefused> {
        let Some((name, token)) = self.tokens.verify(token.trim()) else {
            let mut f = self.fails.lock().unwrap_or_else(|p| p.into_inner());
            if f.0.elapsed() > FAIL_WINDOW {
                *f = (Instant::now(), 0);
            }
            f.1 = f.1.saturating_add(1);
            return Err(if f.1 > MAX_FAILS {
                LoginRefused::TooMany
            } else {
                LoginRefused::Wrong
            });
        };
        let cookie = tokens::random_text(32).map_err(|_| LoginRefused::Unavailable)?;
        let csrf = tokens::random_text(32).map_err(|_| LoginRefused::Unavailable)?;
        let now = Instant::now();
        let session = Session {
            name,
            csrf,
            token,
            created: now,
            used: now,
        };
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|_, s| fresh(s, now));
        while live.len() >= MAX_SESSIONS {
            let Some(oldest) = live.iter().min_by_key(|(_, s)| s.created).map(|(k, _)| *k) else {
                break;
            };
            live.remove(&oldest);
        }
        live.insert(tokens::digest(&cookie), session.clone());
        Ok(Login { cookie, session })
    }

    /// The session a cookie value names, if it is live (and its token still valid).
    pub fn check(&self, cookie: &str) -> Option<Session> {
        let key = tokens::digest(cookie);
        let now = Instant::now();
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let s = live.get_mut(&key)?;
        if !fresh(s, now) || !self.tokens.still(&s.name, &s.token) {
            live.remove(&key);
            return None;
        }
        s.used = now;
        Some(s.clone())
    }

    /// End the session a cookie value names.
    pub fn logout(&self, cookie: &str) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.remove(&tokens::digest(cookie));
    }
}

fn fresh(s: &Session, now: Instant) -> bool {
    now.duration_since(s.used) < IDLE && now.duration_since(s.created) < MAX_AGE
}

/// The session cookie's value among a request's `Cookie` headers.
pub fn cookie_value<'a>(headers: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    headers
        .flat_map(|h| h.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .map(|(k, v)| (k, v.trim()))
        .find(|(k, v)| *k == COOKIE && !v.is_empty())
        .map(|(_, v)| v)
}

/// `Set-Cookie` for a new session, and the one that clears it.
pub fn set_cookie(value: &str) -> String {
    format!(
        "{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        MAX_AGE.as_secs()
    )
}
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::api::tokens::{FILE, Issued, issue, revoke};

    fn sessions(tag: &str) -> (Sessions, std::path::PathBuf, String) {
        let d = std::env::temp_dir().join(format!("egress-sessions-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join(FILE);
        let Issued::New(t) = issue(&path, "ops", false).unwrap() else {
            panic!("new")
        };
        (Sessions::new(Tokens::new(path.clone())), path, t)
    }

    #[test]
    fn a_session_lives_until_logout_or_its_token_changes() {
        let (s, path, token) = sessions("life");
        assert_eq!(s.login("egc_nope").err(), Some(LoginRefused::Wrong));
        let a = s.login(&token).unwrap();
        assert_eq!(a.session.name, "ops");
        assert_ne!(a.cookie, a.session.csrf);
        assert_eq!(s.check(&a.cookie).unwrap().csrf, a.session.csrf);
        assert!(s.check("forged").is_none());
        s.logout(&a.cookie);
        assert!(s.check(&a.cookie).is_none(), "logged out");
        let b = s.login(&token).unwrap();
        issue(&path, "ops", true).unwrap();
        assert!(s.check(&b.cookie).is_none(), "rotation ends the session");
        let Issued::New(t2) = issue(&path, "ops", true).unwrap() else {
            panic!("new")
        };
        let c = s.login(&t2).unwrap();
        revoke(&path, "ops").unwrap();
        assert!(s.check(&c.cookie).is_none(), "revocation ends the session");
    }

    #[test]
    fn wrong_tokens_are_limited_and_the_oldest_session_makes_room() {
        let (s, _, token) = sessions("limit");
        let first = s.login(&token).unwrap();
        for _ in 1..MAX_SESSIONS + 1 {
            s.login(&token).unwrap();
        }
        assert!(s.check(&first.cookie).is_none(), "the oldest session ended");
        for _ in 0..MAX_FAILS {
            assert_eq!(s.login("wrong").err(), Some(LoginRefused::Wrong));
        }
        assert_eq!(s.login("wrong").err(), Some(LoginRefused::TooMany));
        assert!(
            s.login(&token).is_ok(),
            "wrong tokens never lock the operator out"
        );
    }

    #[test]
    fn the_cookie_is_found_among_others_and_set_strictly() {
        let h = ["a=1; egress_session=abc ; b=2", "x=y"];
        assert_eq!(cookie_value(h.iter().copied()), Some("abc"));
        assert_eq!(cookie_value(["egress_session="].into_iter()), None);
        assert_eq!(cookie_value(["egress_sessionx=1"].into_iter()), None);
        let c = set_cookie("v");
        for part in ["HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(c.contains(part), "{c}");
        }
    }
}
