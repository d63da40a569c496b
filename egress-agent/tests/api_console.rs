//! The console's authentication on `api.ui_listen`, against the real `ApiServer`, routes and
//! write path (`manage::apply`) with the fake `Control` of the API tests: a login with a token
//! from the tokens file, the session cookie's attributes, CSRF token + same-origin on every
//! write, bearer tokens for scripts, rotation and revocation ending sessions, and every change
//! recorded with the operator's name and its diff. Refused writes write nothing.
mod api_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::Command;

use api_support::{is_root, serve};
use egress_agent::api::tokens::{self, Issued};
use serde_json::Value;

/// One raw HTTP/1.1 request: status, the response's header block, the JSON body.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, String, Value) {
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or("");
    req.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    s.write_all(req.as_bytes()).expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let v = serde_json::from_str(body).unwrap_or(Value::String(body.to_owned()));
    (status, head.to_owned(), v)
}

fn cookie_of(head: &str) -> String {
    head.lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .and_then(|c| c.split(';').next())
        .expect("a set-cookie")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_writes_need_a_session_its_csrf_token_and_the_pages_origin() {
    let s = serve("console").await;
    let addr = s.tcp;
    let file = s.dir.join("state").join(tokens::FILE);
    let Issued::New(token) = tokens::issue(&file, "ops", false).expect("issue") else {
        panic!("a new token")
    };
    let origin = format!("http://{addr}");
    let policy = r#"{"allow_hosts": ["new.example.com"]}"#;
    let written = s.dir.join("policies.d/web.toml");

    let r = tokio::task::spawn_blocking(move || {
        let o = origin.as_str();
        let login_body = format!(r#"{{"token": "{token}"}}"#);
        let mut seen = Vec::new();
        // Not logged in: `GET /v1/session` says so, and that tokens exist.
        let (st, _, v) = http(addr, "GET", "/v1/session", &[], None);
        seen.push(("session before login", st, v["tokens"] == true));
        // A write without any credential, from root on this host: refused, as every write is.
        let (st, _, _) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[("Origin", o)],
            Some(policy),
        );
        seen.push(("write without login", st, st == 401));
        // The login: same-origin only, the right token only.
        let (st, _, _) = http(addr, "POST", "/v1/session", &[], Some(&login_body));
        seen.push(("login without Origin", st, st == 403));
        let (st, _, _) = http(
            addr,
            "POST",
            "/v1/session",
            &[("Origin", "http://evil.example")],
            Some(&login_body),
        );
        seen.push(("login from another origin", st, st == 403));
        let (st, _, _) = http(
            addr,
            "POST",
            "/v1/session",
            &[("Origin", o)],
            Some(r#"{"token": "egc_wrong"}"#),
        );
        seen.push(("login with a wrong token", st, st == 401));
        let (st, head, v) = http(
            addr,
            "POST",
            "/v1/session",
            &[("Origin", o)],
            Some(&login_body),
        );
        let cookie_line = head
            .lines()
            .find(|l| l.starts_with("set-cookie: "))
            .unwrap_or_default()
            .to_owned();
        seen.push((
            "login",
            st,
            st == 200
                && v["name"] == "ops"
                && cookie_line.contains("HttpOnly")
                && cookie_line.contains("SameSite=Strict"),
        ));
        let cookie = cookie_of(&head);
        let csrf = v["csrf"].as_str().unwrap_or_default().to_owned();
        let (st, _, v) = http(addr, "GET", "/v1/session", &[("Cookie", &cookie)], None);
        seen.push(("session after login", st, v["csrf"] == csrf.as_str()));
        // Writes with the session: the CSRF token and the page's origin are both required.
        let (st, _, _) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[("Cookie", &cookie), ("Origin", o)],
            Some(policy),
        );
        seen.push(("write without the CSRF token", st, st == 403));
        let (st, _, _) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[
                ("Cookie", &cookie),
                ("Origin", o),
                ("X-Egress-CSRF", "forged"),
            ],
            Some(policy),
        );
        seen.push(("write with a wrong CSRF token", st, st == 403));
        let (st, _, _) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[("Cookie", &cookie), ("X-Egress-CSRF", &csrf)],
            Some(policy),
        );
        seen.push(("write without Origin", st, st == 403));
        let (st, _, _) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[
                ("Cookie", &cookie),
                ("X-Egress-CSRF", &csrf),
                ("Origin", o),
                ("Sec-Fetch-Site", "cross-site"),
            ],
            Some(policy),
        );
        seen.push(("write marked cross-site", st, st == 403));
        let nothing_yet = !written.exists();
        let (st, _, v) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[("Cookie", &cookie), ("X-Egress-CSRF", &csrf), ("Origin", o)],
            Some(policy),
        );
        seen.push((
            "write with session, CSRF and Origin",
            st,
            nothing_yet
                && st == 200
                && v["diff"]
                    .as_str()
                    .is_some_and(|d| d.contains("+allow_hosts")),
        ));
        // A script's bearer token: no cookie, no CSRF; a wrong one is refused.
        let bearer = format!("Bearer {token}");
        let (st, _, _) = http(
            addr,
            "DELETE",
            "/v1/policies/web",
            &[("Authorization", "Bearer egc_wrong")],
            None,
        );
        seen.push(("write with a wrong bearer token", st, st == 401));
        let (st, _, _) = http(
            addr,
            "DELETE",
            "/v1/policies/web",
            &[("Authorization", &bearer)],
            None,
        );
        seen.push(("write with the bearer token", st, st == 200));
        // Every change carries who made it and what it did.
        let (_, _, changes) = http(addr, "GET", "/v1/changes", &[("Cookie", &cookie)], None);
        let ids: Vec<String> = changes
            .as_array()
            .map(|a| a.iter().map(|c| c["identity"].to_string()).collect())
            .unwrap_or_default();
        seen.push((
            "changes name the operator",
            0,
            ids == ["\"console:ops\"", "\"token:ops\""]
                && changes[0]["diff"]
                    .as_str()
                    .is_some_and(|d| d.contains("new.example.com")),
        ));
        // Logout ends the session; a rotated token ends every session made with it.
        let (st, _, _) = http(
            addr,
            "DELETE",
            "/v1/session",
            &[("Cookie", &cookie), ("X-Egress-CSRF", &csrf), ("Origin", o)],
            None,
        );
        seen.push(("logout", st, st == 200));
        let (st, _, _) = http(addr, "GET", "/v1/session", &[("Cookie", &cookie)], None);
        seen.push(("session after logout", st, st == 401));
        let (_, head, v) = http(
            addr,
            "POST",
            "/v1/session",
            &[("Origin", o)],
            Some(&login_body),
        );
        let (cookie, csrf) = (
            cookie_of(&head),
            v["csrf"].as_str().unwrap_or_default().to_owned(),
        );
        let Ok(Issued::New(_)) = tokens::issue(&file, "ops", true) else {
            panic!("rotated")
        };
        let (st, _, _) = http(
            addr,
            "PUT",
            "/v1/policies/web",
            &[("Cookie", &cookie), ("X-Egress-CSRF", &csrf), ("Origin", o)],
            Some(policy),
        );
        seen.push(("write after the token was rotated", st, st == 401));
        let (st, _, _) = http(
            addr,
            "DELETE",
            "/v1/policies/web",
            &[("Authorization", &bearer)],
            None,
        );
        seen.push(("the old bearer token after rotation", st, st == 401));
        seen
    })
    .await
    .expect("client");
    let failed: Vec<_> = r.iter().filter(|(_, _, ok)| !ok).collect();
    assert!(failed.is_empty(), "failed: {failed:?}\nall: {r:?}");
    assert!(
        !s.dir.join("policies.d/web.toml").exists(),
        "the refused write after rotation wrote nothing"
    );
    s.stop().await;
}

/// Another user of this host (not root, not in the read group) gets the page — its login
/// form — and nothing else without a token; with one, everything; a DNS-rebinding `Host` gets
/// nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_gets_the_login_form_until_it_presents_a_token() {
    if !is_root() {
        api_support::skip("needs root (a client running as another user)");
        return;
    }
    let s = serve("console-user").await;
    let file = s.dir.join("state").join(tokens::FILE);
    let Issued::New(token) = tokens::issue(&file, "dev", false).expect("issue") else {
        panic!("new")
    };
    let addr = s.tcp;
    let curl = move |path: &str, extra: &[&str]| {
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .args(extra)
            .arg(format!("http://{addr}{path}"))
            .uid(65533)
            .gid(65533)
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let bearer = format!("Authorization: Bearer {token}");
    let got = tokio::task::spawn_blocking(move || {
        [
            curl("/ui/", &[]),
            curl("/v1/policies", &[]),
            curl("/v1/events", &[]),
            curl("/v1/policies", &["-H", bearer.as_str()]),
            curl(
                "/v1/policies",
                &["-H", bearer.as_str(), "-H", "Host: evil.example"],
            ),
        ]
    })
    .await
    .expect("curl");
    assert_eq!(got, ["200", "401", "401", "200", "403"]);
    s.stop().await;
}
