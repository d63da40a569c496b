//! TLS interception with credential injection and request rules, end to end on loopback: real
//! clients (curl, python3 urllib, node) trusting the agent CA through the variables
//! `ca::command_env` hands a command, a TLS upstream with its own test CA that records what it
//! received. Every case runs twice ([`both_ways!`]): through the explicit proxy (`HTTPS_PROXY`)
//! and with no proxy variables at all, reaching the policy's transparent listener the way the
//! kernel redirects a program that connects by itself.
#![expect(clippy::unwrap_used, reason = "test assertions")]

#[macro_use]
mod intercept_support;

use std::time::Duration;

use egress_agent::events::Verdict;
use futures_util::{SinkExt, StreamExt};
use intercept_support::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

const NODE_CLIENT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/intercept_support/client.js"
);

fn bearer() -> String {
    format!("Authorization: Bearer {PLACEHOLDER}")
}

/// The `X-Egress-Deny` token of a `curl -i` answer, if it has one.
fn deny_of(o: &Out) -> Option<String> {
    o.text()
        .lines()
        .find_map(|l| l.strip_prefix("x-egress-deny: "))
        .map(|s| s.trim().to_owned())
}

async fn curl(h: &Harness, args: &[&str]) -> Out {
    let route = h.curl_route();
    let mut a = vec!["-sS", "--max-time", "15", "-D", "-"];
    a.extend(route.iter().map(String::as_str));
    a.extend_from_slice(args);
    run_client("curl", &a, &h.client_env()).await
}

fn assert_secret_arrived(r: &Received) {
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str()),
        "{r:?}"
    );
}

async fn curl_http1_and_h2_get_the_secret_injected(via: Via) {
    let h = harness_via(via).await;
    let url = h.url("api.test", "/v1/messages");
    let b = bearer();
    let h1 = curl(&h, &["--http1.1", "-X", "POST", "-d", "{}", "-H", &b, &url]).await;
    assert!(
        h1.status.success(),
        "{}",
        String::from_utf8_lossy(&h1.all())
    );
    assert!(h1.text().contains("ok HTTP/1.1 2"), "{}", h1.text());
    let h2 = curl(&h, &["--http2", "-X", "POST", "-d", "{}", "-H", &b, &url]).await;
    assert!(
        h2.status.success(),
        "{}",
        String::from_utf8_lossy(&h2.all())
    );
    assert!(h2.text().contains("HTTP/2 200"), "{}", h2.text());
    assert!(h2.text().contains("ok HTTP/2.0 2"), "{}", h2.text());
    let seen = h.up.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].version, "HTTP/1.1");
    assert_eq!(seen[1].version, "HTTP/2.0");
    for r in &seen {
        assert_eq!(
            (r.method.as_str(), r.target.as_str()),
            ("POST", "/v1/messages")
        );
        assert_secret_arrived(r);
        // The placeholder itself never reaches the upstream.
        assert!(!r.headers.iter().any(|(_, v)| v.contains(PLACEHOLDER)));
    }
    h.assert_no_secret_written(&[&h1.all(), &h2.all()]);
}

async fn python_urllib_gets_the_secret_injected(via: Via) {
    let h = harness_via(via).await;
    let script = format!(
        r#"{prelude}
import urllib.request, os
req = urllib.request.Request({url:?}, data=b'{{}}', method='POST',
    headers={{'Authorization': 'Bearer ' + os.environ['API_KEY']}})
with urllib.request.urlopen(req, timeout=10) as r:
    print(r.status, r.read().decode())
"#,
        url = h.url("api.test", "/v1/messages"),
        prelude = h.python_prelude(),
    );
    // Debian's python3 (the CA comes from SSL_CERT_FILE, the placeholder from API_KEY).
    let out = run_client("/usr/bin/python3", &["-c", &script], &h.client_env()).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.all())
    );
    assert!(out.text().contains("200 ok HTTP/1.1 2"), "{}", out.text());
    let seen = h.up.requests();
    assert_eq!(seen.len(), 1);
    assert_secret_arrived(&seen[0]);
    h.assert_no_secret_written(&[&out.all()]);
}

async fn node_h1_and_h2_get_the_secret_injected(via: Via) {
    let h = harness_via(via).await;
    let url = h.url("api.test", "/v1/messages");
    let auth = format!("authorization=Bearer {PLACEHOLDER}");
    let mut outs = Vec::new();
    for mode in ["h1", "h2"] {
        let out = run_client(
            "node",
            &[NODE_CLIENT, mode, "POST", &url, &auth],
            &h.client_env(),
        )
        .await;
        assert!(
            out.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&out.all())
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["status"], 200, "{mode}: {v}");
        outs.push(out);
    }
    let seen = h.up.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].version, "HTTP/1.1");
    assert_eq!(seen[1].version, "HTTP/2.0");
    seen.iter().for_each(assert_secret_arrived);
    h.assert_no_secret_written(&[&outs[0].all(), &outs[1].all()]);
}

async fn placeholder_to_another_host_is_refused_and_never_arrives(via: Via) {
    let h = harness_via(via).await;
    let b = bearer();
    // Another allowed, intercepted host.
    let out = curl(&h, &["-H", &b, &h.url("other.test", "/v1/messages")]).await;
    if via == Via::Proxy {
        assert!(out.text().starts_with("HTTP/1.1 200"), "{}", out.text()); // the CONNECT
    }
    assert!(
        out.text().contains("HTTP/2 403") || out.text().contains("HTTP/1.1 403"),
        "{}",
        out.text()
    );
    assert!(
        out.text().contains("x-egress-deny: placeholder-wrong-host"),
        "{}",
        out.text()
    );
    let ev = h.wait_event("placeholder-wrong-host").await;
    assert_eq!(ev.host.as_deref(), Some("other.test"));
    assert_eq!(
        ev.context.get("path").map(String::as_str),
        Some("/v1/messages")
    );
    // In the query string, and in another header.
    let q = format!("{}?key={PLACEHOLDER}", h.url("other.test", "/x"));
    let out2 = curl(&h, &["--http1.1", &q]).await;
    assert!(
        out2.text().contains("placeholder-wrong-host"),
        "{}",
        out2.text()
    );
    let hdr = format!("X-Anything: {PLACEHOLDER}");
    let out3 = curl(&h, &["--http1.1", "-H", &hdr, &h.url("other.test", "/")]).await;
    assert!(
        out3.text().contains("placeholder-wrong-host"),
        "{}",
        out3.text()
    );
    // Plain HTTP through the proxy (absolute-form): refused before any dial.
    let plain = format!("http://other.test:{}/x", h.port());
    let out4 = curl(&h, &["-H", &b, &plain]).await;
    assert!(out4.text().contains("403"), "{}", out4.text());
    assert!(
        out4.text().contains("placeholder-wrong-host"),
        "{}",
        out4.text()
    );
    // The bound host over plain HTTP (same port): never gets the secret, refused too.
    let plain_api = format!("http://api.test:{}/v1/messages", h.port());
    let out5 = curl(&h, &["-X", "POST", "-H", &b, &plain_api]).await;
    assert!(
        out5.text().contains("placeholder-wrong-host"),
        "{}",
        out5.text()
    );
    assert!(
        h.up.requests().is_empty(),
        "arrived upstream: {:?}",
        h.up.requests()
    );
    // Without the placeholder, other.test is served as usual (interception works there).
    let ok = curl(&h, &["--http1.1", &h.url("other.test", "/hello")]).await;
    assert!(ok.text().contains("ok HTTP/1.1 0"), "{}", ok.text());
    let seen = h.up.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].header("authorization"), None);
    h.assert_no_secret_written(&[&out.all(), &out2.all(), &out3.all(), &out4.all(), &ok.all()]);
}

async fn method_and_path_rules_hold(via: Via) {
    let h = harness_via(via).await;
    let b = bearer();
    // Only POST /v1/messages (and /<one segment>) on api.test.
    let get = curl(
        &h,
        &[
            "--http1.1",
            "-H",
            &b,
            &format!("{}?token=q", h.url("api.test", "/v1/messages")),
        ],
    )
    .await;
    assert_eq!(
        deny_of(&get).as_deref(),
        Some("request-not-allowed"),
        "{}",
        get.text()
    );
    let ev = h.wait_event("request-not-allowed").await;
    assert_eq!(ev.context.get("method").map(String::as_str), Some("GET"));
    // The event has the path without the query string.
    assert_eq!(
        ev.context.get("path").map(String::as_str),
        Some("/v1/messages")
    );
    assert!(!h.events_json().contains("token=q"));
    let other = curl(
        &h,
        &[
            "--http2",
            "-X",
            "POST",
            "-H",
            &b,
            &h.url("api.test", "/v1/admin/keys"),
        ],
    )
    .await;
    assert_eq!(
        deny_of(&other).as_deref(),
        Some("request-not-allowed"),
        "{}",
        other.text()
    );
    let dots = curl(
        &h,
        &[
            "--http1.1",
            "--path-as-is",
            "-X",
            "POST",
            "-H",
            &b,
            &h.url("api.test", "/v1/x/../messages"),
        ],
    )
    .await;
    assert_eq!(
        deny_of(&dots).as_deref(),
        Some("path-not-normalized"),
        "{}",
        dots.text()
    );
    let enc = curl(
        &h,
        &[
            "--http1.1",
            "-X",
            "POST",
            "-H",
            &b,
            &h.url("api.test", "/v1%2Fmessages"),
        ],
    )
    .await;
    assert_eq!(
        deny_of(&enc).as_deref(),
        Some("path-not-normalized"),
        "{}",
        enc.text()
    );
    // require = true: no placeholder, no request.
    let bare = curl(
        &h,
        &[
            "--http1.1",
            "-X",
            "POST",
            &h.url("api.test", "/v1/messages"),
        ],
    )
    .await;
    assert_eq!(
        deny_of(&bare).as_deref(),
        Some("credential-placeholder-missing"),
        "{}",
        bare.text()
    );
    // Deny rules: DELETE anywhere on rules.test, /admin/** on other.test; others pass.
    let del = curl(
        &h,
        &["--http1.1", "-X", "DELETE", &h.url("rules.test", "/thing")],
    )
    .await;
    assert_eq!(
        deny_of(&del).as_deref(),
        Some("request-denied-by-rule"),
        "{}",
        del.text()
    );
    let adm = curl(&h, &["--http2", &h.url("other.test", "/admin/users")]).await;
    assert_eq!(
        deny_of(&adm).as_deref(),
        Some("request-denied-by-rule"),
        "{}",
        adm.text()
    );
    // Each refusal by a deny rule names that rule, as configured; no rule is behind a request
    // no allow rule matched.
    let rule_of = |host: &str| {
        h.events
            .recent(1000)
            .into_iter()
            .find(|e| e.reason == "request-denied-by-rule" && e.host.as_deref() == Some(host))
            .and_then(|e| e.rule)
    };
    let p = h.port();
    assert_eq!(
        rule_of("rules.test").as_deref(),
        Some(format!("request_rules deny rules.test:{p} DELETE /**").as_str())
    );
    assert_eq!(
        rule_of("other.test").as_deref(),
        Some(format!("request_rules deny other.test:{p} /admin/**").as_str())
    );
    assert_eq!(h.wait_event("request-not-allowed").await.rule, None);
    // The client reads the same in the refusal's body, in JSON when it asks.
    let del = curl(
        &h,
        &[
            "--http1.1",
            "-X",
            "DELETE",
            "-H",
            "Accept: application/json",
            &h.url("rules.test", "/thing"),
        ],
    )
    .await;
    let body = del.text();
    let json = body
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("{body}"));
    let j: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(j["reason"], "request-denied-by-rule");
    assert_eq!(j["host"], "rules.test");
    assert_eq!(
        j["rule"].as_str(),
        Some(format!("request_rules deny rules.test:{p} DELETE /**").as_str())
    );
    assert!(h.up.requests().is_empty(), "arrived: {:?}", h.up.requests());
    let ok = curl(&h, &["--http1.1", &h.url("rules.test", "/thing")]).await;
    assert!(ok.text().contains("ok HTTP/1.1"), "{}", ok.text());
    let ok2 = curl(
        &h,
        &[
            "--http1.1",
            "-X",
            "POST",
            "-H",
            &b,
            &h.url("api.test", "/v1/messages"),
        ],
    )
    .await;
    assert!(ok2.text().contains("ok HTTP/1.1"), "{}", ok2.text());
    assert_eq!(h.up.requests().len(), 2);
    h.assert_no_secret_written(&[&get.all(), &ok2.all()]);
}

/// The upstream sends one event, then waits until the test has read it from the client's
/// output; only then the second event and the end. A proxy that buffered the body would stall.
async fn sse_arrives_event_by_event(via: Via) {
    let h = harness_via(via).await;
    let b = bearer();
    for v in ["--http1.1", "--http2"] {
        let mut cmd = tokio::process::Command::new("curl");
        cmd.args(h.curl_route())
            .args([
                "-sSN",
                "--max-time",
                "15",
                v,
                "-H",
                &b,
                &h.url("api.test", "/sse"),
            ])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .envs(h.client_env())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(T, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("{v}: first event not delivered before the stream ended"))
            .unwrap();
        assert_eq!(first.as_deref(), Some("data: one"), "{v}");
        h.up.sse_gate.notify_one();
        let mut rest = Vec::new();
        while let Some(l) = tokio::time::timeout(T, lines.next_line())
            .await
            .unwrap()
            .unwrap()
        {
            rest.push(l);
        }
        assert!(rest.contains(&"data: two".to_owned()), "{v}: {rest:?}");
        assert!(child.wait().await.unwrap().success(), "{v}");
    }
    assert_eq!(h.up.requests().len(), 2);
    h.up.requests().iter().for_each(assert_secret_arrived);
}

async fn websocket_echo_after_the_swap(via: Via) {
    let h = harness_via(via).await;
    let agent_ca = std::fs::read_to_string(h.state_dir().join("ca.pem")).unwrap();
    let tls = h
        .open_tls("api.test", client_tls(&agent_ca, &[b"http/1.1"]))
        .await
        .unwrap();
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        h.url("api.test", "/ws").replace("https://", "wss://"),
    )
    .unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {PLACEHOLDER}").parse().unwrap(),
    );
    let (mut ws, resp) = tokio_tungstenite::client_async(req, tls).await.unwrap();
    assert_eq!(resp.status(), 101);
    for i in 0..3 {
        let msg = format!("hello {i}");
        ws.send(tokio_tungstenite::tungstenite::Message::text(msg.clone()))
            .await
            .unwrap();
        let back = tokio::time::timeout(T, ws.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(back.into_text().unwrap().as_str(), msg);
    }
    ws.close(None).await.ok();
    let seen = h.up.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].header("upgrade"), Some("websocket"));
    assert_secret_arrived(&seen[0]);
}

/// Audit reaches inside interception: a host the allowlist doesn't list but request rules
/// intercept is a would-deny for its connection (recorded once, however many requests it
/// carries) and its requests go on, as a tunnel's bytes would; the request rules still hold.
/// (Each request used to be re-checked with the enforce-only check: 403 `host-not-allowed`.)
async fn audit_lets_requests_to_an_unlisted_intercepted_host_through(via: Via) {
    let h = harness_policy(
        "enforce = \"audit\"",
        "[[policies.test.request_rules]]\nhost = \"audit.test\"\nport = {port}\naction = \"deny\"\npath = \"/admin/**\"\n",
        true,
        via,
    )
    .await;
    // Two requests on one connection (curl reuses it for the second URL).
    let out = curl(
        &h,
        &[
            "--http1.1",
            &h.url("audit.test", "/v1/first"),
            &h.url("audit.test", "/v1/second"),
        ],
    )
    .await;
    assert!(out.status.success(), "{}", out.text());
    assert!(!out.text().contains("x-egress-deny"), "{}", out.text());
    let seen: Vec<String> = h.up.requests().into_iter().map(|r| r.target).collect();
    assert!(
        seen.contains(&"/v1/first".to_owned()) && seen.contains(&"/v1/second".to_owned()),
        "{seen:?}"
    );
    let ev = h.wait_event("host-not-allowed").await;
    assert_eq!(ev.verdict, Verdict::WouldDeny, "{}", h.events_json());
    assert_eq!(ev.host.as_deref(), Some("audit.test"));
    // No entry of the allowlist matched: no rule is behind it.
    assert_eq!(ev.rule, None);
    let would_deny = h
        .events
        .recent(1000)
        .into_iter()
        .filter(|e| e.reason == "host-not-allowed")
        .count();
    assert_eq!(would_deny, 1, "{}", h.events_json());
    assert!(
        !h.events
            .recent(1000)
            .iter()
            .any(|e| e.verdict == Verdict::Deny),
        "{}",
        h.events_json()
    );
    // Intercepted: the host's deny rule is enforced, audit or not.
    let admin = curl(&h, &["--http1.1", &h.url("audit.test", "/admin/keys")]).await;
    assert!(
        admin
            .text()
            .contains("x-egress-deny: request-denied-by-rule"),
        "{}",
        admin.text()
    );
    assert!(
        !h.up.requests().iter().any(|r| r.target == "/admin/keys"),
        "the refused request reached the upstream"
    );
}

/// A host with neither binding nor rules is a plain tunnel: the client sees the upstream's own
/// certificate (it verifies against the upstream's CA, not the agent's).
async fn pass_through_host_is_not_intercepted(via: Via) {
    let h = harness_via(via).await;
    let tls = h
        .open_tls("plain.test", client_tls(&h.test_ca.pem, &[b"http/1.1"]))
        .await
        .unwrap();
    let certs = tls.get_ref().1.peer_certificates().unwrap();
    assert_eq!(certs[0], h.up.cert);
    // Trusting only the agent CA, the same host fails verification: nobody re-signed it.
    let agent_ca = std::fs::read_to_string(h.state_dir().join("ca.pem")).unwrap();
    let e = h
        .open_tls("plain.test", client_tls(&agent_ca, &[b"http/1.1"]))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
    // And curl with the agent's bundle: unknown issuer.
    let out = curl(&h, &["--http1.1", &h.url("plain.test", "/")]).await;
    assert!(!out.status.success(), "{}", out.text());
    // An intercepted host presents the agent's leaf instead.
    let tls = h
        .open_tls("api.test", client_tls(&agent_ca, &[b"h2", b"http/1.1"]))
        .await
        .unwrap();
    assert_ne!(tls.get_ref().1.peer_certificates().unwrap()[0], h.up.cert);
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
}

async fn secret_reflected_by_the_upstream_is_not_passed_on(via: Via) {
    let h = harness_via(via).await;
    let b = bearer();
    let out = curl(&h, &["--http1.1", "-H", &b, &h.url("api.test", "/reflect")]).await;
    assert!(out.text().contains("reflected"), "{}", out.text());
    // The reflected header comes back with the placeholder in the secret's place.
    assert!(
        out.text()
            .contains(&format!("x-reflected-authorization: Bearer {PLACEHOLDER}")),
        "{}",
        out.text()
    );
    assert!(
        out.text().contains("x-egress-scrubbed: 1"),
        "{}",
        out.text()
    );
    let ev = h.wait_event("response-secret-scrubbed").await;
    assert_eq!(ev.context.get("where").map(String::as_str), Some("headers"));
    assert_secret_arrived(&h.up.requests()[0]);
    h.assert_no_secret_written(&[&out.all()]);
}

async fn large_upload_streams_through(via: Via) {
    let h = harness_via(via).await;
    let b = bearer();
    let file = h.dir.join("upload.bin");
    std::fs::write(&file, vec![b'x'; 24 << 20]).unwrap();
    let data = format!("@{}", file.display());
    for v in ["--http1.1", "--http2"] {
        let out = curl(
            &h,
            &[
                v,
                "-X",
                "POST",
                "-H",
                &b,
                "--data-binary",
                &data,
                &h.url("api.test", "/upload"),
            ],
        )
        .await;
        assert!(
            out.text().contains(&format!(" {}\n", 24 << 20)),
            "{v}: {}",
            out.text()
        );
    }
}

#[tokio::test]
async fn sni_naming_another_server_is_refused() {
    let h = harness().await;
    let agent_ca = std::fs::read_to_string(h.state_dir().join("ca.pem")).unwrap();
    let (resp, s) = {
        let mut s = tokio::net::TcpStream::connect(h.proxy).await.unwrap();
        let t = format!("api.test:{}", h.port());
        s.write_all(format!("CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut buf = [0u8; 39];
        tokio::io::AsyncReadExt::read_exact(&mut s, &mut buf)
            .await
            .unwrap();
        (String::from_utf8_lossy(&buf).into_owned(), s)
    };
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let name = rustls::pki_types::ServerName::try_from("plain.test").unwrap();
    let r = tokio_rustls::TlsConnector::from(client_tls(&agent_ca, &[]))
        .connect(name, s)
        .await;
    assert!(r.is_err());
    h.wait_event("sni-mismatch").await;
    assert!(h.up.requests().is_empty());
}

async fn untrusted_upstream_certificate_is_a_502(via: Via) {
    // The upstream's CA is not configured here: only the system roots.
    let h = harness_untrusting_upstream(via).await;
    let b = bearer();
    let out = curl(
        &h,
        &[
            "--http1.1",
            "-X",
            "POST",
            "-H",
            &b,
            &h.url("api.test", "/v1/messages"),
        ],
    )
    .await;
    assert!(out.text().contains("502"), "{}", out.text());
    assert!(
        out.text().contains("x-egress-error: upstream-tls"),
        "{}",
        out.text()
    );
    assert!(h.up.requests().is_empty());
    h.assert_no_secret_written(&[&out.all()]);
}

#[tokio::test]
async fn ca_is_kept_across_restarts_and_the_key_is_0600() {
    use std::os::unix::fs::PermissionsExt;
    let h = harness().await;
    let state = h.state_dir();
    let mode = |p: &str| {
        std::fs::metadata(state.join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("ca-key.pem"), 0o600);
    assert_eq!(mode("ca.pem"), 0o644);
    assert_eq!(
        std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let before = std::fs::read(state.join("ca.pem")).unwrap();
    let again = egress_agent::ca::AgentCa::load_or_create(&state).unwrap();
    assert_eq!(again.cert_pem().as_bytes(), &before[..]);
    // The bundle has the system roots and the agent CA.
    let bundle = std::fs::read_to_string(state.join("ca-bundle.pem")).unwrap();
    assert!(bundle.ends_with(again.cert_pem()) || bundle.contains(again.cert_pem()));
    assert!(bundle.matches("BEGIN CERTIFICATE").count() > 1);
    // A key readable by others is refused, not used.
    std::fs::set_permissions(
        state.join("ca-key.pem"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let e = egress_agent::ca::AgentCa::load_or_create(&state).unwrap_err();
    assert!(e.to_string().contains("0644"), "{e}");
    let _ = Duration::ZERO;
}

/// A read-only host (`{ host, access = "read-only" }`), h1 and h2: reads and git's fetch reach
/// the upstream; writes, git push and a WebSocket upgrade are refused with
/// `request-not-allowed` and never arrive (checked by what the upstream received).
async fn read_only_hosts_take_reads_and_git_fetch_only(via: Via) {
    let h = harness_via(via).await;
    let url = |path: &str| h.url("ro.test", path);
    let allowed: Vec<Vec<String>> = vec![
        vec!["--http1.1".into(), url("/acme/api")],
        vec![
            "--http2".into(),
            url("/acme/api.git/info/refs?service=git-upload-pack"),
        ],
        vec!["--http1.1".into(), "-I".into(), url("/readme")],
        vec![
            "--http2".into(),
            "-X".into(),
            "POST".into(),
            "--data-binary".into(),
            "0032want".into(),
            url("/acme/api.git/git-upload-pack"),
        ],
    ];
    for args in &allowed {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = curl(&h, &args).await;
        assert_eq!(deny_of(&o), None, "{args:?}: {}", o.text());
        assert!(o.text().contains(" 200"), "{args:?}: {}", o.text());
    }
    for (version, method, path) in [
        ("--http1.1", "POST", "/acme/api.git/git-receive-pack"),
        ("--http2", "POST", "/acme/api.git/git-receive-pack"),
        ("--http2", "PUT", "/repos/acme/api/contents/a"),
        ("--http1.1", "DELETE", "/repos/acme/api"),
        ("--http2", "PATCH", "/repos/acme/api/issues/1"),
        ("--http1.1", "POST", "/repos/acme/api/issues"),
    ] {
        let o = curl(
            &h,
            &[
                version,
                "-X",
                method,
                "--data-binary",
                "secret-data",
                &url(path),
            ],
        )
        .await;
        assert_eq!(
            deny_of(&o).as_deref(),
            Some("request-not-allowed"),
            "{method} {path}: {}",
            o.text()
        );
    }
    let ev = h.wait_event("request-not-allowed").await;
    assert_eq!(ev.host.as_deref(), Some("ro.test"));
    // A protocol switch is a channel to write on: refused before anything is sent.
    let host = format!("ro.test:{}", h.port());
    let got = raw_h1(
        &h,
        "ro.test",
        format!(
            "GET /socket HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert!(got.contains("request-not-allowed"), "{got}");
    let seen: Vec<(String, String)> =
        h.up.requests()
            .into_iter()
            .map(|r| (r.method, r.target))
            .collect();
    assert_eq!(
        seen,
        vec![
            ("GET".to_owned(), "/acme/api".to_owned()),
            (
                "GET".to_owned(),
                "/acme/api.git/info/refs?service=git-upload-pack".to_owned()
            ),
            ("HEAD".to_owned(), "/readme".to_owned()),
            (
                "POST".to_owned(),
                "/acme/api.git/git-upload-pack".to_owned()
            ),
        ],
        "only the reads arrived"
    );
    assert!(
        h.up.requests()
            .iter()
            .all(|r| !contains(&r.body, b"secret-data")),
        "a refused body arrived"
    );
}

/// `repos` on a read-only host, h1 and h2: a push and API writes to the named repository
/// arrive; the same to another repository, a gist and GraphQL are refused and never arrive.
async fn repos_let_writes_reach_the_named_repositories_only(via: Via) {
    let h = harness_policy("repos = [\"acme/api\"]", "", true, via).await;
    let url = |path: &str| h.url("ro.test", path);
    let post = |version: &'static str, path: &str| {
        vec![
            version.to_owned(),
            "-X".to_owned(),
            "POST".to_owned(),
            "--data-binary".to_owned(),
            "pushed-data".to_owned(),
            url(path),
        ]
    };
    let allowed = [
        post("--http1.1", "/acme/api.git/git-receive-pack"),
        post("--http2", "/acme/api/git-receive-pack"),
        post("--http2", "/repos/acme/api/issues"),
    ];
    for args in &allowed {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = curl(&h, &args).await;
        assert_eq!(deny_of(&o), None, "{args:?}: {}", o.text());
        assert!(o.text().contains(" 200"), "{args:?}: {}", o.text());
    }
    for args in [
        post("--http1.1", "/acme/other.git/git-receive-pack"),
        post("--http2", "/evil/api.git/git-receive-pack"),
        post("--http1.1", "/repos/acme/other/issues"),
        post("--http2", "/gists"),
        post("--http2", "/graphql"),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = curl(&h, &args).await;
        assert_eq!(
            deny_of(&o).as_deref(),
            Some("request-not-allowed"),
            "{args:?}: {}",
            o.text()
        );
    }
    let seen: Vec<String> = h.up.requests().into_iter().map(|r| r.target).collect();
    assert_eq!(
        seen,
        vec![
            "/acme/api.git/git-receive-pack",
            "/acme/api/git-receive-pack",
            "/repos/acme/api/issues"
        ],
        "only the named repository's writes arrived"
    );
}

both_ways!(
    repos_let_writes_reach_the_named_repositories_only,
    read_only_hosts_take_reads_and_git_fetch_only,
    curl_http1_and_h2_get_the_secret_injected,
    audit_lets_requests_to_an_unlisted_intercepted_host_through,
    python_urllib_gets_the_secret_injected,
    node_h1_and_h2_get_the_secret_injected,
    placeholder_to_another_host_is_refused_and_never_arrives,
    method_and_path_rules_hold,
    sse_arrives_event_by_event,
    websocket_echo_after_the_swap,
    pass_through_host_is_not_intercepted,
    secret_reflected_by_the_upstream_is_not_passed_on,
    large_upload_streams_through,
    untrusted_upstream_certificate_is_a_502,
    client_not_trusting_the_agent_ca_gets_nothing_through,
    smuggling_and_switches_never_reach_the_upstream,
    every_reflected_secret_is_scrubbed,
    websocket_reflection_is_scrubbed,
);

/// A client that doesn't trust the agent's CA (it trusts only the upstream's own) gets nothing
/// through an intercepted host, and the event says why.
async fn client_not_trusting_the_agent_ca_gets_nothing_through(via: Via) {
    let h = harness_via(via).await;
    let ca = h.dir.join("upstream-ca.pem");
    let b = bearer();
    let out = curl(
        &h,
        &[
            "--cacert",
            &ca.display().to_string(),
            "-X",
            "POST",
            "-H",
            &b,
            &h.url("api.test", "/v1/messages"),
        ],
    )
    .await;
    assert!(!out.status.success(), "{}", out.text());
    let ev = h.wait_event("agent-ca-not-trusted").await;
    assert_eq!(ev.host.as_deref(), Some("api.test"));
    assert!(ev.context.contains_key("client_tls"), "{ev:?}");
    assert!(
        ev.context
            .get("fix")
            .is_some_and(|f| f.contains("NODE_EXTRA_CA_CERTS")),
        "{ev:?}"
    );
    assert!(h.up.requests().is_empty(), "arrived: {:?}", h.up.requests());
    h.assert_no_secret_written(&[&out.all()]);
}

/// Raw HTTP/1.1 bytes inside an intercepted TLS connection to `host`; everything the client got
/// back until the agent closed the connection.
async fn raw_h1(h: &Harness, host: &str, bytes: &[u8]) -> String {
    use tokio::io::AsyncReadExt;
    let agent_ca = std::fs::read_to_string(h.state_dir().join("ca.pem")).unwrap();
    let mut tls = h
        .open_tls(host, client_tls(&agent_ca, &[b"http/1.1"]))
        .await
        .unwrap();
    tls.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(T, tls.read_to_end(&mut out))
        .await
        .expect("the agent kept the connection open")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

/// Request smuggling and protocol switches inside an intercepted connection: what a second parser
/// could read differently is refused, the connection ends there, and nothing pipelined after it
/// reaches the upstream. Checked by what the upstream received.
async fn smuggling_and_switches_never_reach_the_upstream(via: Via) {
    let h = harness_via(via).await;
    let host = format!("rules.test:{}", h.port());
    let next = format!("GET /smuggled HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    // Content-Length with Transfer-Encoding: hyper reads the chunked body, drops the length and
    // closes the connection after answering (RFC 9112 §6.3); the upstream gets it re-framed, and
    // nothing pipelined after it.
    let got = raw_h1(
        &h,
        "rules.test",
        format!(
            "POST /cl-te HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{next}"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(got.matches("\r\ndate: ").count(), 1, "one response: {got}");
    let cases: Vec<(String, &str)> = vec![
        (
            format!(
                "POST /a HTTP/1.1\r\nHost: {host}\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"
            ),
            "obfuscated-header-name",
        ),
        (
            format!(
                "POST /a HTTP/1.1\r\nHost: {host}\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
            ),
            "400",
        ),
        (
            format!(
                "GET /a HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
            ),
            "upgrade-not-allowed",
        ),
        (format!("OPTIONS * HTTP/1.1\r\nHost: {host}\r\n\r\n"), "400"),
        (
            "CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n".to_owned(),
            "400",
        ),
    ];
    for (req, want) in &cases {
        let got = raw_h1(&h, "rules.test", format!("{req}{next}").as_bytes()).await;
        assert!(got.contains(want), "{req:?} → {got}");
        assert!(
            !got.contains("\r\n\r\nok "),
            "{req:?} reached the upstream: {got}"
        );
    }
    // A request the rules refuse (DELETE on rules.test), then an allowed one: the refused one
    // never arrives, the next is parsed and checked on its own.
    let got = raw_h1(
        &h,
        "rules.test",
        format!("DELETE /x HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n{next}").as_bytes(),
    )
    .await;
    assert!(got.contains("request-denied-by-rule"), "{got}");
    // The same for a request naming another host on the intercepted connection.
    let other = format!("GET /a HTTP/1.1\r\nHost: other.test:{}\r\n\r\n", h.port());
    let got = raw_h1(&h, "rules.test", format!("{other}{next}").as_bytes()).await;
    assert!(got.contains("host-header-mismatch"), "{got}");
    let seen = h.up.requests();
    assert_eq!(
        seen.iter()
            .map(|r| (r.method.as_str(), r.target.as_str()))
            .collect::<Vec<_>>(),
        vec![
            ("POST", "/cl-te"),
            ("GET", "/smuggled"),
            ("GET", "/smuggled")
        ],
        "{seen:?}"
    );
    assert_eq!(seen[0].body_len, 0, "{seen:?}");
    assert!(
        seen[0].header("content-length").is_none_or(|v| v == "0"),
        "{seen:?}"
    );
}

/// `CONNECT` to one allowed name, then TLS naming another: refused before any byte reaches the
/// address (the CDN fronting escape class), for a pass-through host and an intercepted one.
#[tokio::test]
async fn connect_then_another_sni_is_refused() {
    let h = harness().await;
    for (target, sni) in [("plain.test", "other.test"), ("other.test", "plain.test")] {
        let (resp, s) = {
            let mut s = tokio::net::TcpStream::connect(h.proxy).await.unwrap();
            let t = format!("{target}:{}", h.port());
            s.write_all(format!("CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut buf = [0u8; 39];
            tokio::io::AsyncReadExt::read_exact(&mut s, &mut buf)
                .await
                .unwrap();
            (String::from_utf8_lossy(&buf).into_owned(), s)
        };
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        let name = rustls::pki_types::ServerName::try_from(sni).unwrap();
        // The upstream's own CA: a relayed hello would have completed and sent the request.
        let r = tokio_rustls::TlsConnector::from(client_tls(&h.test_ca.pem, &[b"http/1.1"]))
            .connect(name, s)
            .await;
        if let Ok(mut tls) = r {
            tls.write_all(format!("GET / HTTP/1.1\r\nHost: {sni}\r\n\r\n").as_bytes())
                .await
                .ok();
        }
        let ev = loop {
            let found = h
                .events
                .recent(100)
                .into_iter()
                .find(|e| e.reason == "sni-mismatch" && e.host.as_deref() == Some(sni));
            if let Some(e) = found {
                break e;
            }
            h.wait_event("sni-mismatch").await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(
            ev.context.get("connect_target").map(String::as_str),
            Some(format!("{target}:{}", h.port()).as_str())
        );
        assert!(h.up.requests().is_empty(), "arrived: {:?}", h.up.requests());
    }
}

/// The reflection matrix: an upstream that echoes the injected value (a bearer header, HTTP Basic,
/// a secret every encoding changes) in each place and encoding ([`MIRROR_FORMS`]: raw, base64,
/// base64url, JSON, JSON with `\\uXXXX`, percent upper/lower, form, hex, gzip'd, one byte per
/// chunk, a redirect's `Location`, the decoded Basic pair, an SSE event split mid-secret), over
/// HTTP/1.1 and h2. The client never sees the real value in any of those forms, and sees the
/// placeholder where the secret was; the upstream did get the secret.
async fn every_reflected_secret_is_scrubbed(via: Via) {
    let h = harness_via(via).await;
    let basic = format!("bot:{PLACEHOLDER_BASIC}");
    let sym = format!("x-api-key: {PLACEHOLDER_SYM}");
    let b = bearer();
    // (host, curl arguments, the header the upstream mirrors, what the upstream receives in it,
    // what the client holds in its place)
    let cases: [(&str, Vec<&str>, &str, String, String); 3] = [
        (
            "api.test",
            vec!["-H", &b],
            "authorization",
            format!("Bearer {SECRET}"),
            format!("Bearer {PLACEHOLDER}"),
        ),
        (
            "basic.test",
            vec!["-u", &basic],
            "authorization",
            format!("Basic {}", b64(&format!("bot:{SECRET_BASIC}"))),
            format!("Basic {}", b64(&format!("bot:{PLACEHOLDER_BASIC}"))),
        ),
        (
            "sym.test",
            vec!["-H", &sym],
            "x-api-key",
            SECRET_SYM.to_owned(),
            PLACEHOLDER_SYM.to_owned(),
        ),
    ];
    let secrets = [SECRET, SECRET_BASIC, SECRET_SYM];
    let mut outputs = Vec::new();
    for (host, args, header, sent, held) in &cases {
        for form in MIRROR_FORMS {
            for v in ["--http1.1", "--http2"] {
                let url = h.url(host, &format!("/mirror-{form}?h={header}"));
                let mut a = vec![v];
                a.extend(args.iter().copied());
                a.push(&url);
                let out = curl(&h, &a).await;
                let all = out.all();
                let case = format!("{host} {form} {v}: {}", String::from_utf8_lossy(&all));
                assert!(out.status.success(), "{case}");
                for secret in secrets {
                    for f in MIRROR_FORMS {
                        let leaked = mirror(f, secret.as_bytes());
                        assert!(!contains(&all, &leaked), "{f} form of a secret in {case}");
                    }
                }
                for f in MIRROR_FORMS {
                    let leaked = mirror(f, sent.as_bytes());
                    assert!(
                        !contains(&all, &leaked),
                        "{f} form of the sent value in {case}"
                    );
                }
                // The placeholder, in the same form, stands where the secret was.
                let want = match form {
                    "location" => mirror("percent", held.as_bytes()),
                    "gzip" | "chunks" | "sse" => held.as_bytes().to_vec(),
                    f => mirror(f, held.as_bytes()),
                };
                assert!(contains(&all, &want), "no placeholder in {case}");
                outputs.push(all);
            }
        }
    }
    let ev = h.wait_event("response-secret-scrubbed").await;
    assert!(ev.context.contains_key("count"), "{ev:?}");
    // The upstream got the real values.
    let seen = h.up.requests();
    assert!(
        seen.iter()
            .any(|r| r.header("x-api-key") == Some(SECRET_SYM)),
        "{seen:?}"
    );
    let refs: Vec<&[u8]> = outputs.iter().map(Vec::as_slice).collect();
    h.assert_no_secret_written(&refs);
}

fn b64(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// A WebSocket upstream that sends the injected header back in a frame: the client gets the
/// frame with the secret replaced (same length: the placeholder padded with `*`), then echoes
/// as usual.
async fn websocket_reflection_is_scrubbed(via: Via) {
    let h = harness_via(via).await;
    let agent_ca = std::fs::read_to_string(h.state_dir().join("ca.pem")).unwrap();
    let tls = h
        .open_tls("api.test", client_tls(&agent_ca, &[b"http/1.1"]))
        .await
        .unwrap();
    let mut req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        h.url("api.test", "/ws-reflect")
            .replace("https://", "wss://"),
    )
    .unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {PLACEHOLDER}").parse().unwrap(),
    );
    let (mut ws, resp) = tokio_tungstenite::client_async(req, tls).await.unwrap();
    assert_eq!(resp.status(), 101);
    let first = tokio::time::timeout(T, ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
        .into_text()
        .unwrap()
        .to_string();
    assert!(!first.contains(SECRET), "{first}");
    assert_eq!(first.len(), format!("Bearer {SECRET}").len(), "{first}");
    assert!(
        first.starts_with(&format!("Bearer {PLACEHOLDER}")),
        "{first}"
    );
    ws.send(tokio_tungstenite::tungstenite::Message::text("after"))
        .await
        .unwrap();
    let back = tokio::time::timeout(T, ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(back.into_text().unwrap().as_str(), "after");
    ws.close(None).await.ok();
    drop(ws);
    let ev = h.wait_event("response-secret-scrubbed").await;
    assert_eq!(
        ev.context.get("where").map(String::as_str),
        Some("websocket")
    );
    assert_secret_arrived(&h.up.requests()[0]);
}
