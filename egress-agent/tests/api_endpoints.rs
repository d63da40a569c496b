//! Every control API endpoint, served by the real `ApiServer` and routes over a real unix socket
//! (and the loopback TCP address), driven by a fake `Control` whose writes go through the real
//! write path (`manage::apply`: validation by the loader, atomic files, rollback) against a
//! configuration in a temporary directory, with a real event store. No daemon, no eBPF.
//!
//! Access: root gets everything; a member of the read group the GET endpoints (a real process
//! running as nobody, by python3); others nothing; the TCP address (the console) takes writes
//! only after a login (api_console.rs), and only with a loopback Host header.
mod api_support;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use api_support::{call, is_root, serve};
use egress_agent::api;
use egress_agent::config::Config;
use hyper::{Method, StatusCode};

/// A raw request over the socket by python3 as uid 65534 with primary group `gid`.
fn as_nobody(sock: &Path, gid: u32, method: &str, path: &str) -> String {
    let script = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect-error", e.errno); sys.exit(0)
s.sendall(("%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}" % (sys.argv[2], sys.argv[3])).encode())
print(s.recv(65536).decode().splitlines()[0])
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(sock)
        .args([method, path])
        .uid(65534)
        .gid(gid)
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_endpoints_answer_with_what_the_daemon_has() {
    if !is_root() {
        api_support::skip("needs root (the API serves root)");
        return;
    }
    let s = serve("read").await;
    let (st, v) = call(&s.sock, Method::GET, "/v1/status", None).await;
    assert_eq!((st, v["version"].as_str()), (StatusCode::OK, Some("test")));
    let (st, v) = call(&s.sock, Method::GET, "/v1/containers", None).await;
    assert_eq!(
        (st, v[0]["badge"].as_str()),
        (StatusCode::OK, Some("allowlist"))
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/policies", None).await;
    assert!(v["ci"].is_object() && v["allow_all"].is_object(), "{v}");
    let (st, v) = call(&s.sock, Method::GET, "/v1/policies/ci", None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        (v["source"].as_str(), v["badge"].as_str()),
        (Some("config"), Some("allowlist")),
        "{v}"
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/policies/audit", None).await;
    assert_eq!(
        (v["source"].as_str(), v["badge"].as_str()),
        (Some("built-in"), Some("audit")),
        "{v}"
    );
    let (st, _) = call(&s.sock, Method::GET, "/v1/policies/nope", None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    // A main-file and a built-in policy say up front why the console can't change them.
    assert!(
        v["read_only"]
            .as_str()
            .is_some_and(|r| r.contains("built in")),
        "{v}"
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/defaults", None).await;
    assert_eq!(v["default_policy"], "deny_all");
    let editable = &v["editable"];
    assert!(editable["settings"]["read_only"].is_null(), "{v}");
    assert_eq!(editable["new_policies"]["source"], "policies.d", "{v}");
    assert_eq!(editable["policies"]["ci"]["source"], "config", "{v}");
    assert!(
        editable["policies"]["ci"]["read_only"]
            .as_str()
            .is_some_and(|r| r.contains("defined in")),
        "{v}"
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/export", None).await;
    assert!(
        v["policies"]["ci"].is_object() && v["agent"]["unlabeled"] == "allow_all",
        "{v}"
    );
    let (st, toml) =
        api::client::request_body(&s.sock, Method::GET, "/v1/export?format=toml", None)
            .await
            .expect("export");
    assert_eq!(st, StatusCode::OK);
    Config::from_toml_str(&toml, Path::new("export.toml"))
        .expect("the TOML export is a valid config");
    let (st, v) = call(
        &s.sock,
        Method::GET,
        "/v1/explain?policy=ci&target=api.github.com:443",
        None,
    )
    .await;
    assert_eq!(
        (st, v["proxy"]["verdict"].as_str()),
        (StatusCode::OK, Some("allow")),
        "{v}"
    );
    // The rule the proxy's decision names, as data.
    assert_eq!(v["proxy"]["matched"]["list"], "allow_hosts", "{v}");
    let (_, v) = call(
        &s.sock,
        Method::GET,
        "/v1/explain?policy=ci&target=%5B%3A%3A1%5D%3A22&netns=host",
        None,
    )
    .await;
    assert_eq!(
        v["kernel"]["direct_tcp"]["verdict"], "same_tree_only",
        "{v}"
    );
    let (st, _) = call(&s.sock, Method::GET, "/v1/explain?target=x", None).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, _) = call(
        &s.sock,
        Method::GET,
        "/v1/explain?policy=ci&target=a:0",
        None,
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, v) = call(&s.sock, Method::GET, "/v1/denials?container=web-1", None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v[0]["reason"], "host-not-allowed");
    let (st, _) = call(&s.sock, Method::GET, "/v1/denials?since=forever", None).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, v) = call(&s.sock, Method::GET, "/v1/suggest?policy=ci&name=ci2", None).await;
    assert_eq!(st, StatusCode::OK);
    let t = v["toml"].as_str().expect("toml");
    assert!(
        t.contains("[policies.ci2]") && t.contains("api.github.com"),
        "{t}"
    );
    // The same suggestion as fields a PUT takes (the console makes a new policy from them).
    assert_eq!(v["policy"]["mode"], "allowlist", "{v}");
    // api.github.com alone is proposed as the github preset (the TOML says what it covers).
    assert_eq!(v["policy"]["presets"], serde_json::json!(["github"]), "{v}");
    let (st, v) = call(&s.sock, Method::GET, "/v1/changes", None).await;
    assert_eq!((st, v.as_array().map(Vec::len)), (StatusCode::OK, Some(0)));
    let (_, v) = call(&s.sock, Method::GET, "/v1/doctor", None).await;
    assert_eq!(v[0]["id"], "proxy.listening");
    let (_, v) = call(&s.sock, Method::GET, "/v1/events?n=1", None).await;
    assert_eq!(v.as_array().map(Vec::len), Some(1));
    let (st, _) = call(&s.sock, Method::GET, "/v1/events?n=x", None).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    // NDJSON and SSE streams (the fake's feed ends after two events).
    let (st, text) = api::client::request_body(&s.sock, Method::GET, "/v1/events?follow=1", None)
        .await
        .expect("follow");
    assert_eq!(st, StatusCode::OK);
    assert_eq!(text.lines().count(), 2, "{text}");
    let (st, text) = api::client::request_body(&s.sock, Method::GET, "/v1/events/sse", None)
        .await
        .expect("sse");
    assert_eq!(st, StatusCode::OK);
    assert_eq!(text.matches("event: denial\ndata: {").count(), 2, "{text}");
    // The page, with its CSP; nothing else is served from /ui/.
    let (st, html) = api::client::request_body(&s.sock, Method::GET, "/ui/", None)
        .await
        .expect("ui");
    assert!(
        st == StatusCode::OK && html.contains("<table id=\"containers\""),
        "{st} {html}"
    );
    for f in ["app.js", "app.css"] {
        let (st, _) = api::client::request_body(&s.sock, Method::GET, &format!("/ui/{f}"), None)
            .await
            .expect("asset");
        assert_eq!(st, StatusCode::OK, "{f}");
    }
    let (st, _) = call(&s.sock, Method::GET, "/ui/..%2Fconfig.toml", None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _) = call(&s.sock, Method::DELETE, "/v1/status", None).await;
    assert_eq!(st, StatusCode::METHOD_NOT_ALLOWED);
    let (st, _) = call(&s.sock, Method::GET, "/v2/nothing", None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_validate_like_the_config_file_apply_and_are_recorded() {
    if !is_root() {
        api_support::skip("needs root (the API serves root)");
        return;
    }
    let s = serve("write").await;
    let cfg = s.dir.join("config.toml");
    let file = s.dir.join("policies.d/web.toml");
    // 422: the field and the reason, exactly as the config file's error says them.
    let bad = "allow_hosts = [\"github.com\", \"10.0.0.1\"]\n";
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/web",
        Some(("application/toml", bad)),
    )
    .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let in_file = Config::from_toml_str(&format!("[policies.web]\n{bad}"), Path::new("c.toml"))
        .expect_err("invalid");
    let egress_agent::config::ConfigError::Invalid { field, message, .. } = in_file else {
        panic!("not located")
    };
    assert_eq!(
        (v["field"].as_str(), v["message"].as_str()),
        (Some(field.as_str()), Some(message.as_str())),
        "{v}"
    );
    assert!(!file.exists(), "nothing written on a 422");
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/web",
        Some((
            "application/json",
            r#"{"allow_hosts": ["x.test"], "mode": "allow-some"}"#,
        )),
    )
    .await;
    assert_eq!(
        (st, v["field"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("policies.web.mode")),
        "{v}"
    );
    let (st, _) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/..%2F..%2Fetc",
        Some(("application/toml", "mode = \"deny_all\"")),
    )
    .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY);
    // 409: the main file's policy is the operator's.
    let (st, _) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/ci",
        Some(("application/toml", "mode = \"deny_all\"")),
    )
    .await;
    assert_eq!(st, StatusCode::CONFLICT);
    // Dry run writes nothing.
    let good = "# CI runners\nallow_hosts = [\"registry.npmjs.org\"]\n";
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/web?dry_run=1",
        Some(("application/toml", good)),
    )
    .await;
    assert_eq!(
        (st, v["would_change"].as_bool()),
        (StatusCode::OK, Some(true)),
        "{v}"
    );
    assert!(!file.exists());
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/web",
        Some(("application/toml", good)),
    )
    .await;
    assert_eq!(
        (st, v["changed"].as_bool()),
        (StatusCode::OK, Some(true)),
        "{v}"
    );
    assert_eq!(std::fs::read_to_string(&file).expect("written"), good);
    assert_eq!(
        std::fs::metadata(&file).expect("meta").permissions().mode() & 0o777,
        0o600
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/policies/web", None).await;
    assert_eq!(v["source"], "policies.d", "{v}");
    // Defaults: in place in the main file, comments kept; a missing policy is a 422.
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/defaults",
        Some(("application/json", r#"{"default_policy": "nope"}"#)),
    )
    .await;
    assert_eq!(
        (st, v["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("agent.default_policy")
        ),
        "{v}"
    );
    let (st, _) = call(
        &s.sock,
        Method::PUT,
        "/v1/defaults",
        Some(("application/json", r#"{"default_policy": "web"}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let main = std::fs::read_to_string(&cfg).expect("main");
    assert!(
        main.starts_with("# the operator's file\n") && main.contains("default_policy = \"web\""),
        "{main}"
    );
    let (st, _) = call(
        &s.sock,
        Method::PUT,
        "/v1/defaults",
        Some(("application/json", r#"{"bogus": 1}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    // Delete: the default can't go; in use needs force.
    let (st, v) = call(&s.sock, Method::DELETE, "/v1/policies/web", None).await;
    assert_eq!(
        (st, v["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("agent.default_policy")
        ),
        "{v}"
    );
    call(
        &s.sock,
        Method::PUT,
        "/v1/defaults",
        Some(("application/json", r#"{"default_policy": "deny_all"}"#)),
    )
    .await;
    let (st, _) = call(&s.sock, Method::DELETE, "/v1/policies/web", None).await;
    assert_eq!(st, StatusCode::OK);
    assert!(!file.exists());
    let (st, _) = call(&s.sock, Method::DELETE, "/v1/policies/web", None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    // Import: dry run shows the diff, apply writes it.
    let bundle = "[policies.imported]\nallow_hosts = [\"pypi.org\"]\n[policies.ci]\nallow_hosts = [\"github.com\", \"*.github.com\"]\n";
    let (st, v) = call(
        &s.sock,
        Method::POST,
        "/v1/import",
        Some(("application/toml", bundle)),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(
        v["diff"]
            .as_str()
            .expect("diff")
            .contains("+ policy imported"),
        "{v}"
    );
    assert!(!s.dir.join("policies.d/imported.toml").exists());
    let (st, v) = call(
        &s.sock,
        Method::POST,
        "/v1/import?apply=1",
        Some(("application/toml", bundle)),
    )
    .await;
    assert_eq!(
        (st, v["changed"].as_bool()),
        (StatusCode::OK, Some(true)),
        "{v}"
    );
    assert!(
        Config::load(&cfg)
            .expect("loads")
            .policy("imported")
            .is_some()
    );
    // Every applied change is recorded with the peer's uid.
    let (_, v) = call(&s.sock, Method::GET, "/v1/changes?n=100", None).await;
    let rows = v.as_array().expect("rows");
    let actions: Vec<&str> = rows.iter().filter_map(|r| r["action"].as_str()).collect();
    assert_eq!(
        actions,
        [
            "set-policy",
            "set-defaults",
            "set-defaults",
            "delete-policy",
            "import"
        ],
        "{v}"
    );
    assert!(
        rows.iter()
            .all(|r| r["uid"] == 0 && r["result"] == "applied"),
        "{v}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_answers_the_report_and_refuses_bad_bodies_by_field() {
    if !is_root() {
        api_support::skip("needs root (the API serves root)");
        return;
    }
    let s = serve("replay").await;
    let cfg = s.dir.join("config.toml");
    let before = std::fs::read_to_string(&cfg).expect("config");
    let post = |body: &'static str| {
        let sock = s.sock.clone();
        async move {
            call(
                &sock,
                Method::POST,
                "/v1/replay",
                Some(("application/json", body)),
            )
            .await
        }
    };
    // The store's flows of policy ci: an allowed api.github.com, a denied evil.test.
    let (st, v) = post(r#"{"name": "ci", "policy": {"allow_hosts": ["github.com"]}}"#).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (v["schema"].as_u64(), v["policy"].as_str()),
        (Some(1), Some("ci")),
        "{v}"
    );
    assert_eq!(v["against"], "ci");
    assert_eq!(
        (v["flows"].as_u64(), v["events"].as_u64()),
        (Some(2), Some(2)),
        "{v}"
    );
    for (bucket, flows) in [
        ("newly_denied", 1),
        ("newly_allowed", 0),
        ("would_deny", 0),
        ("unchanged_denied", 1),
        ("unchanged_allowed", 0),
        ("not_replayable", 0),
    ] {
        assert_eq!(v["totals"][bucket]["flows"], flows, "{bucket}: {v}");
    }
    let d = &v["destinations"][0];
    assert_eq!(
        (
            d["bucket"].as_str(),
            d["destination"].as_str(),
            d["source"].as_str()
        ),
        (
            Some("newly_denied"),
            Some("api.github.com:443"),
            Some("proxy")
        ),
        "{v}"
    );
    assert_eq!(d["was"][0]["verdict"], "allow");
    assert_eq!(
        (d["now"]["verdict"].as_str(), d["now"]["reason"].as_str()),
        (Some("deny"), Some("host-not-allowed"))
    );
    assert_eq!(d["examples"][0]["container"], "web-1");
    assert!(v["not_replayable"].as_array().is_some_and(Vec::is_empty));
    assert!(v["unlisted"].is_object());
    // `against`, a selection, and a looser policy.
    let (st, v) = post(
        r#"{"name": "web", "policy": {"allow_hosts": ["*.github.com", "evil.test"]}, "against": "ci", "container": "web-1", "since": "1d", "labels": {}, "limit": 0}"#,
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["totals"]["newly_allowed"]["flows"], 1, "{v}");
    assert_eq!(v["totals"]["unchanged_allowed"]["flows"], 1, "{v}");
    let (_, v) = post(r#"{"name": "web", "policy": {"mode": "deny_all"}}"#).await;
    assert_eq!(v["flows"], 0, "nothing recorded under web: {v}");
    // Bad bodies: 400 naming the field; a policy the loader refuses: 422 as for PUT.
    for (body, field) in [
        (r#"{"name": "ci"}"#, "policy"),
        (r#"{"policy": {}}"#, "name"),
        (r#"{"name": "ci", "policy": {}, "bogus": 1}"#, "bogus"),
        (r#"{"name": "ci", "policy": []}"#, "policy"),
        (r#"{"name": "ci", "policy": {}, "limit": -1}"#, "limit"),
        (
            r#"{"name": "ci", "policy": {}, "since": "forever"}"#,
            "since",
        ),
        (
            r#"{"name": "ci", "policy": {}, "labels": {"no spaces": "x"}}"#,
            "labels",
        ),
        (
            r#"{"name": "ci", "policy": {}, "against": "a/b"}"#,
            "against",
        ),
        ("not json", ""),
    ] {
        let (st, v) = post(body).await;
        assert_eq!(
            (st, v["field"].as_str()),
            (StatusCode::BAD_REQUEST, Some(field)),
            "{body}: {v}"
        );
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let (st, v) =
        post(r#"{"name": "ci", "policy": {"allow_hosts": ["ok.test", "*bad.test"]}}"#).await;
    assert_eq!(
        (st, v["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("policies.ci.allow_hosts[1]")
        ),
        "{v}"
    );
    let (st, v) = post(r#"{"name": "../etc", "policy": {}}"#).await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    // Nothing changed: the files, the change record.
    assert_eq!(std::fs::read_to_string(&cfg).expect("config"), before);
    assert!(!s.dir.join("policies.d").exists());
    let (_, v) = call(&s.sock, Method::GET, "/v1/changes", None).await;
    assert_eq!(v.as_array().map(Vec::len), Some(0), "{v}");
    let (st, _) = call(&s.sock, Method::GET, "/v1/replay", None).await;
    assert_eq!(st, StatusCode::METHOD_NOT_ALLOWED);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_group_reads_others_are_refused_and_tcp_serves_get_only() {
    if !is_root() || Command::new("python3").arg("-V").output().is_err() {
        api_support::skip("needs root and python3 (clients of other users)");
        return;
    }
    let s = serve("access").await;
    let mode = std::fs::metadata(&s.sock)
        .expect("sock")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o660);
    // nobody:nogroup is in the read group (65534): GET yes, writes no.
    let sock = s.sock.clone();
    let (get, put, del, replay, other) = tokio::task::spawn_blocking(move || {
        (
            as_nobody(&sock, 65534, "GET", "/v1/policies"),
            as_nobody(&sock, 65534, "PUT", "/v1/policies/x"),
            as_nobody(&sock, 65534, "POST", "/v1/reload"),
            as_nobody(&sock, 65534, "POST", "/v1/replay"),
            as_nobody(&sock, 4242, "GET", "/v1/policies"),
        )
    })
    .await
    .expect("clients");
    assert!(get.starts_with("HTTP/1.1 200"), "{get}");
    assert!(put.starts_with("HTTP/1.1 403"), "{put}");
    assert!(del.starts_with("HTTP/1.1 403"), "{del}");
    // Replay changes nothing, but every POST is refused to the read group (GET only).
    assert!(replay.starts_with("HTTP/1.1 403"), "{replay}");
    // Not in the group: the socket's group mode refuses the connect itself.
    assert_eq!(other, "connect-error 13");
    assert!(
        !s.dir.join("policies.d/x.toml").exists(),
        "the refused write wrote nothing"
    );

    // Loopback TCP: the page and GETs for root without a login, writes only with one, loopback
    // Host only.
    let url = format!("http://{}/ui/", s.tcp);
    let curl = move |extra: &[&str], uid: Option<u32>| {
        let mut c = Command::new("curl");
        c.args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .args(extra)
            .arg(&url);
        if let Some(u) = uid {
            c.uid(u).gid(4242);
        }
        String::from_utf8_lossy(&c.output().expect("curl").stdout).into_owned()
    };
    let (ok, rebinding, write, replay, stranger) = tokio::task::spawn_blocking(move || {
        (
            curl(&[], None),
            curl(&["-H", "Host: evil.example:80"], None),
            curl(&["-X", "PUT", "--data", "x"], None),
            curl(&["-X", "POST", "--data", "{}"], None),
            curl(&[], Some(65533)),
        )
    })
    .await
    .expect("curl");
    assert_eq!(ok, "200");
    assert_eq!(rebinding, "403");
    // api.ui_listen takes no write without a login, even from root (api_console.rs logs in),
    // before any route: a POST (a replay is one) is refused.
    assert_eq!(write, "401");
    assert_eq!(replay, "401");
    // Another user gets the page (its login form), not the API behind it (api_console.rs).
    assert_eq!(stranger, "200");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presets_are_listed_and_a_policy_naming_them_shows_every_host() {
    if !is_root() {
        api_support::skip("needs root (the API serves root)");
        return;
    }
    let s = serve("presets").await;
    let (st, v) = call(&s.sock, Method::GET, "/v1/presets", None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let github = v
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "github"))
        .expect("the github preset");
    let hosts = github["hosts"].as_array().expect("hosts");
    assert!(
        hosts.contains(&serde_json::json!("api.github.com")),
        "{github}"
    );
    assert!(
        hosts.contains(&serde_json::json!({ "host": "github.com", "ports": [22] })),
        "{github}"
    );
    assert!(
        github["checked"].is_string() && github["sources"][0].is_string(),
        "{github}"
    );
    // An unknown preset is refused like any bad field: named, with the known ones.
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/agent",
        Some(("application/json", r#"{"presets": ["github", "gitlab"]}"#)),
    )
    .await;
    assert_eq!(
        (st, v["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("policies.agent.presets[1]")
        ),
        "{v}"
    );
    let message = v["message"].as_str().unwrap_or("");
    assert!(
        message.contains("unknown preset \"gitlab\"") && message.contains("github, "),
        "{v}"
    );
    let (st, v) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/agent",
        Some((
            "application/json",
            r#"{"presets": ["anthropic"], "allow_hosts": ["docs.rs"]}"#,
        )),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let written = std::fs::read_to_string(s.dir.join("policies.d/agent.toml")).expect("written");
    assert!(
        written.contains("presets = [\"anthropic\"]") && !written.contains("api.anthropic.com"),
        "the file names the preset, never its hosts: {written}"
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/policies/agent", None).await;
    assert_eq!(
        v["policy"]["presets"],
        serde_json::json!(["anthropic"]),
        "{v}"
    );
    assert_eq!(
        v["policy"]["allow_hosts"],
        serde_json::json!(["docs.rs"]),
        "{v}"
    );
    assert!(
        v["preset_hosts"]["anthropic"]
            .as_array()
            .is_some_and(|h| h.contains(&serde_json::json!("api.anthropic.com"))),
        "{v}"
    );
    let (_, v) = call(&s.sock, Method::GET, "/v1/policies", None).await;
    assert!(v["agent"]["preset_hosts"]["anthropic"].is_array(), "{v}");
    let (_, v) = call(&s.sock, Method::GET, "/v1/export", None).await;
    assert_eq!(
        (
            &v["policies"]["agent"]["presets"],
            &v["policies"]["agent"]["allow_hosts"]
        ),
        (
            &serde_json::json!(["anthropic"]),
            &serde_json::json!(["docs.rs"])
        ),
        "export keeps presets unflattened: {v}"
    );
    let (_, v) = call(
        &s.sock,
        Method::GET,
        "/v1/explain?policy=agent&target=api.anthropic.com:443",
        None,
    )
    .await;
    assert_eq!(v["proxy"]["verdict"], "allow", "{v}");
    assert_eq!(v["proxy"]["matched"]["preset"], "anthropic", "{v}");
    assert!(
        v["proxy"]["rule"].as_str().is_some_and(
            |r| r.starts_with("allow_hosts api.anthropic.com (preset anthropic) on port 443")
        ),
        "{v}"
    );
    s.stop().await;
}

/// The (method, path) pairs `docs/api.yaml` describes (each with its responses).
fn documented() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.yaml"))
        .expect("docs/api.yaml");
    let spec: serde_json::Value = serde_yaml_ng::from_str(&text).expect("docs/api.yaml is YAML");
    assert!(
        spec["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.")),
        "openapi version"
    );
    let mut out = Vec::new();
    for (path, ops) in spec["paths"].as_object().expect("paths") {
        for (method, op) in ops.as_object().expect("path item") {
            if !["get", "put", "post", "delete", "patch"].contains(&method.as_str()) {
                continue;
            }
            assert!(
                op["responses"].as_object().is_some_and(|r| !r.is_empty()),
                "{method} {path}: no responses documented"
            );
            out.push((method.to_uppercase(), path.clone()));
        }
    }
    out
}

#[test]
fn the_openapi_description_covers_every_endpoint_and_no_other() {
    let mut documented = documented();
    documented.sort();
    let mut served: Vec<(String, String)> = api::routes::ENDPOINTS
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    served.sort();
    assert_eq!(documented, served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_listed_endpoint_is_routed() {
    if !is_root() {
        api_support::skip("needs root (the API serves root)");
        return;
    }
    let s = serve("routed").await;
    for (m, p) in api::routes::ENDPOINTS {
        let path = p.replace("{name}", "ci").replace("{file}", "app.js");
        let method: Method = m.parse().expect("method");
        let (st, v) = call(&s.sock, method, &path, None).await;
        assert!(
            st != StatusCode::METHOD_NOT_ALLOWED && v["error"] != "no such endpoint",
            "{m} {path}: {st} {v}"
        );
    }
    s.stop().await;
}

/// Where a filed request's run grant would go, for the API's side of the loop.
struct NoListener;

impl egress_agent::asks::GrantTarget for NoListener {
    fn grant(
        &self,
        _: u64,
        _: &egress_policy::name::HostName,
        _: u16,
        _: Option<std::time::Duration>,
    ) {
    }
}

/// `GET /v1/requests` lists what workloads asked; `approve` with scope `policy` is a change
/// like `PUT /v1/policies/{name}` (diff, recorded with who); a bad decision body is refused by
/// field; `deny` carries its reason; a decided request can't be decided again.
#[tokio::test]
async fn access_requests_are_listed_and_decided_through_the_change_path() {
    if !is_root() {
        api_support::skip("needs root (the API serves root)");
        return;
    }
    let s = serve("asks").await;
    let (st, _) = call(
        &s.sock,
        Method::PUT,
        "/v1/policies/web",
        Some(("application/json", r#"{"allow_hosts": ["github.com"]}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let target: std::sync::Arc<dyn egress_agent::asks::GrantTarget> =
        std::sync::Arc::new(NoListener);
    let file = |host: &str| {
        s.asks
            .file(
                egress_agent::asks::Requester {
                    listener: 7,
                    policy: "web".into(),
                    workload: "web-1".into(),
                    run: Some("pr-9".into()),
                    target: std::sync::Arc::downgrade(&target),
                    durable: None,
                },
                serde_json::from_value(
                    serde_json::json!({ "host": host, "port": 443, "reason": "docs build" }),
                )
                .expect("a request body"),
                std::time::SystemTime::now(),
            )
            .expect("filed")
            .id
    };
    let (a, b) = (file("docs.rs"), file("pastebin.test"));
    let (st, v) = call(&s.sock, Method::GET, "/v1/requests?pending=1", None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v.as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(
        (
            v[0]["host"].as_str(),
            v[0]["run"].as_str(),
            v[0]["state"].as_str()
        ),
        (Some("docs.rs"), Some("pr-9"), Some("pending")),
        "{v}"
    );
    for (body, field) in [
        ("{}", "scope"),
        (r#"{"scope": "policy", "ttl": "1h"}"#, "ttl"),
        (r#"{"scope": "forever"}"#, "request body"),
    ] {
        let (st, v) = call(
            &s.sock,
            Method::POST,
            &format!("/v1/requests/{a}/approve"),
            Some(("application/json", body)),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert!(
            v["error"].as_str().unwrap_or("").starts_with(field),
            "{body}: {v}"
        );
    }
    // The dry run: the diff the approval would apply, nothing written or decided.
    let (st, v) = call(
        &s.sock,
        Method::POST,
        &format!("/v1/requests/{a}/approve?dry_run=1"),
        Some(("application/json", r#"{"scope": "policy"}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(
        v["diff"].as_str().unwrap_or("").contains("docs.rs") && v["dry_run"] == true,
        "{v}"
    );
    assert!(
        !std::fs::read_to_string(s.dir.join("policies.d/web.toml"))
            .unwrap_or_default()
            .contains("docs.rs")
    );
    assert_eq!(
        s.asks.get(a).map(|v| v.outcome),
        Some(egress_agent::asks::Outcome::Pending)
    );
    let (st, v) = call(
        &s.sock,
        Method::POST,
        &format!("/v1/requests/{a}/approve"),
        Some(("application/json", r#"{"scope": "policy"}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["request"]["state"].as_str(),
            v["request"]["scope"].as_str()
        ),
        (Some("approved"), Some("policy")),
        "{v}"
    );
    assert!(
        v["change"]["diff"]
            .as_str()
            .unwrap_or("")
            .lines()
            .any(|l| l.starts_with('+') && l.contains("docs.rs")),
        "{v}"
    );
    // The one host added, nothing else rewritten.
    let diff = v["change"]["diff"].as_str().unwrap_or("");
    let changed: Vec<&str> = diff
        .lines()
        .filter(|l| {
            (l.starts_with('+') || l.starts_with('-'))
                && !l.starts_with("+++")
                && !l.starts_with("---")
        })
        .collect();
    assert_eq!(changed.len(), 2, "{diff}");
    let written = std::fs::read_to_string(s.dir.join("policies.d/web.toml")).expect("web.toml");
    assert!(written.contains("docs.rs"), "{written}");
    let (_, changes) = call(&s.sock, Method::GET, "/v1/changes", None).await;
    assert!(
        changes.as_array().and_then(|c| c.last()).is_some_and(
            |c| c["target"] == "web" && c["diff"].as_str().unwrap_or("").contains("docs.rs")
        ),
        "{changes}"
    );
    let (st, _) = call(
        &s.sock,
        Method::POST,
        &format!("/v1/requests/{a}/deny"),
        Some(("application/json", r#"{"reason": "late"}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::CONFLICT, "decided already");
    let (st, v) = call(
        &s.sock,
        Method::POST,
        &format!("/v1/requests/{b}/deny"),
        Some(("application/json", r#"{"reason": "no paste sites"}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["request"]["state"].as_str(),
            v["request"]["reason"].as_str()
        ),
        (Some("denied"), Some("no paste sites")),
        "{v}"
    );
    let (st, _) = call(
        &s.sock,
        Method::POST,
        "/v1/requests/999/deny",
        Some(("application/json", r#"{"reason": "x"}"#)),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    s.stop().await;
}
