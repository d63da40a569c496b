//! The console's `Cookie` header parsing (`api::session::cookie_value`), which every request on
//! `api.ui_listen` goes through before a session is looked up: any bytes a browser or a script
//! sends. Input: `Cookie` header values, one per line. Invariants: never panics; what it finds is
//! a non-empty value that came from the input, without `;`; and a header that carries the
//! session cookie as its own `egress_session=V` pair (V without `;`, space or `=` trouble) is
//! found with exactly V when no earlier pair names it.
#![no_main]

use egress_agent::api::session::{COOKIE, cookie_value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let headers: Vec<&str> = s.lines().take(16).collect();
    if let Some(v) = cookie_value(headers.iter().copied()) {
        assert!(!v.is_empty() && !v.contains(';'), "{v:?}");
        assert!(s.contains(v), "{v:?} is not from the input");
    }
    // A known value appended as its own pair is found unless an earlier pair names the cookie.
    let planted = format!("{}; {COOKIE}=plantedvalue", headers.join("; "));
    let earlier = headers
        .iter()
        .flat_map(|h| h.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(k, v)| k == COOKIE && !v.trim().is_empty());
    if !earlier {
        assert_eq!(cookie_value([planted.as_str()].into_iter()), Some("plantedvalue"));
    }
});
