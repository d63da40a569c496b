//! `egress-agent mcp`: a real MCP session over stdio with the SDK's own client (rmcp
//! `TokioChildProcess`) spawning the built binary — initialize, tools/list, tools/call — against
//! the control API served by the test (the fake daemon of `api_support`). Also the CLI clients
//! (`policy`, `explain`) against the same server.
mod api_support;

use std::path::Path;
use std::process::Command;

use api_support::{is_root, serve};
use rmcp::model::CallToolRequestParams;
use rmcp::service::RunningService;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_egress-agent");

async fn session(sock: &Path, writes: bool) -> RunningService<RoleClient, ()> {
    let transport = TokioChildProcess::new(tokio::process::Command::new(BIN).configure(|c| {
        c.arg("mcp").arg("--api-socket").arg(sock);
        if writes {
            c.arg("--allow-writes");
        }
    }))
    .expect("spawn egress-agent mcp");
    ().serve(transport).await.expect("MCP initialize")
}

fn args(v: Value) -> rmcp::model::JsonObject {
    v.as_object().cloned().expect("object")
}

async fn call(c: &RunningService<RoleClient, ()>, tool: &str, a: Value) -> (bool, String) {
    let r = c
        .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args(a)))
        .await
        .expect("tools/call");
    let text = r
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n");
    (r.is_error != Some(true), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_client_lists_and_calls_the_tools() {
    if !is_root() {
        api_support::skip("needs root (the control API serves root)");
        return;
    }
    let s = serve("mcp").await;

    let c = session(&s.sock, false).await;
    let info = c.peer_info().expect("initialize result");
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("egress-agent")
    );
    assert!(info.capabilities.tools.is_some());
    let mut names: Vec<String> = c
        .list_all_tools()
        .await
        .expect("tools/list")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "explain",
            "list_changes",
            "list_containers",
            "list_policies",
            "list_presets",
            "list_requests",
            "recent_denials",
            "replay",
            "show_policy",
            "suggest"
        ],
        "read-only by default"
    );
    let (ok, t) = call(
        &c,
        "explain",
        json!({ "policy": "ci", "target": "api.github.com:443" }),
    )
    .await;
    assert!(ok, "{t}");
    let v: Value = serde_json::from_str(&t).expect("json");
    assert_eq!(v["proxy"]["verdict"], "allow", "{t}");
    assert!(
        v["proxy"]["rule"]
            .as_str()
            .unwrap_or("")
            .contains("*.github.com"),
        "{t}"
    );
    let (ok, t) = call(
        &c,
        "explain",
        json!({ "policy": "ci", "target": "example.com" }),
    )
    .await;
    assert!(ok && t.contains("host-not-allowed"), "{t}");
    let (ok, t) = call(
        &c,
        "explain",
        json!({ "policy": "missing", "target": "example.com" }),
    )
    .await;
    assert!(!ok && t.contains("no policy named"), "{t}");
    let (ok, t) = call(&c, "list_containers", json!({})).await;
    assert!(ok && t.contains("web-1") && t.contains("allowlist"), "{t}");
    let (ok, t) = call(&c, "list_policies", json!({})).await;
    assert!(
        ok && t.contains("\"ci\"") && t.contains("default_policy"),
        "{t}"
    );
    let (ok, t) = call(&c, "show_policy", json!({ "name": "ci" })).await;
    assert!(ok && t.contains("\"source\": \"config\""), "{t}");
    let (ok, t) = call(&c, "list_presets", json!({})).await;
    assert!(ok, "{t}");
    let presets: Value = serde_json::from_str(&t).expect("json");
    let python = presets
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "python"))
        .cloned()
        .unwrap_or_default();
    assert!(
        python["hosts"]
            .as_array()
            .is_some_and(|h| h.contains(&json!("files.pythonhosted.org"))),
        "{t}"
    );
    let (ok, t) = call(&c, "recent_denials", json!({ "container": "web-1" })).await;
    assert!(
        ok && t.contains("host-not-allowed") && t.contains("evil.test"),
        "{t}"
    );
    let (ok, t) = call(&c, "suggest", json!({ "policy": "ci" })).await;
    assert!(
        ok && t.contains("[policies.ci]") && t.contains("api.github.com"),
        "{t}"
    );
    // Replay: the recorded traffic of ci against a tighter ci; nothing is written.
    let (ok, t) = call(
        &c,
        "replay",
        json!({ "name": "ci", "policy": { "allow_hosts": ["github.com"] } }),
    )
    .await;
    assert!(ok, "{t}");
    let v: Value = serde_json::from_str(&t).expect("json");
    assert_eq!(v["totals"]["newly_denied"]["flows"], 1, "{t}");
    assert_eq!(
        v["destinations"][0]["destination"], "api.github.com:443",
        "{t}"
    );
    let (ok, t) = call(
        &c,
        "replay",
        json!({ "name": "ci", "policy": { "allow_hosts": ["*bad"] } }),
    )
    .await;
    assert!(!ok && t.contains("policies.ci.allow_hosts[0]"), "{t}");
    assert!(!s.dir.join("policies.d").exists());
    // A write tool is not there without --allow-writes.
    let r = c
        .call_tool(
            CallToolRequestParams::new("set_policy")
                .with_arguments(args(json!({ "name": "x", "toml": "mode = \"deny_all\"" }))),
        )
        .await;
    assert!(
        r.is_err() || r.as_ref().is_ok_and(|r| r.is_error == Some(true)),
        "{r:?}"
    );
    assert!(!s.dir.join("policies.d/x.toml").exists());
    c.cancel().await.ok();

    let c = session(&s.sock, true).await;
    let names: Vec<String> = c
        .list_all_tools()
        .await
        .expect("tools/list")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    for w in egress_agent::mcp::WRITE_TOOLS {
        assert!(
            names.iter().any(|n| n == w),
            "{w} with --allow-writes: {names:?}"
        );
    }
    let (ok, t) = call(
        &c,
        "set_policy",
        json!({ "name": "agent", "policy": { "allow_hosts": ["api.anthropic.com"], "allow_portz": [443] } }),
    )
    .await;
    assert!(
        !ok && t.contains("policies.agent.allow_portz") && t.contains("unknown field"),
        "{t}"
    );
    let (ok, t) = call(
        &c,
        "set_policy",
        json!({ "name": "agent", "policy": { "allow_hosts": ["api.anthropic.com"] } }),
    )
    .await;
    assert!(ok, "{t}");
    assert!(s.dir.join("policies.d/agent.toml").exists());
    let (ok, t) = call(&c, "set_defaults", json!({ "default_policy": "agent" })).await;
    assert!(ok, "{t}");
    let (ok, t) = call(&c, "delete_policy", json!({ "name": "agent" })).await;
    assert!(
        !ok && t.contains("agent.default_policy"),
        "the default can't go: {t}"
    );
    // Import: the diff first (nothing written), a bad bundle named by field, then applied.
    let bundle = "[policies.imported]\nallow_hosts = [\"pypi.org\"]\n";
    let (ok, t) = call(&c, "import_bundle", json!({ "toml": bundle })).await;
    assert!(ok && t.contains("+ policy imported"), "{t}");
    assert!(!s.dir.join("policies.d/imported.toml").exists());
    let (ok, t) = call(
        &c,
        "import_bundle",
        json!({ "toml": "[policies.imported]\nallow_hosts = [\"*x*\"]\n", "apply": true }),
    )
    .await;
    assert!(!ok && t.contains("policies.imported.allow_hosts[0]"), "{t}");
    assert!(!s.dir.join("policies.d/imported.toml").exists());
    let (ok, t) = call(
        &c,
        "import_bundle",
        json!({ "toml": bundle, "apply": true }),
    )
    .await;
    assert!(ok, "{t}");
    assert!(s.dir.join("policies.d/imported.toml").exists());
    // An access request a workload filed, denied from here with a reason.
    let target: std::sync::Arc<dyn egress_agent::asks::GrantTarget> =
        std::sync::Arc::new(NoListener);
    let id = s
        .asks
        .file(
            egress_agent::asks::Requester {
                listener: 1,
                policy: "ci".into(),
                workload: "web-1".into(),
                run: None,
                target: std::sync::Arc::downgrade(&target),
                durable: None,
            },
            serde_json::from_value(
                json!({ "host": "paste.test", "port": 443, "reason": "share logs" }),
            )
            .expect("request"),
            std::time::SystemTime::now(),
        )
        .expect("filed")
        .id;
    let (ok, t) = call(&c, "list_requests", json!({ "pending": true })).await;
    assert!(
        ok && t.contains("paste.test") && t.contains("share logs"),
        "{t}"
    );
    let (ok, t) = call(
        &c,
        "decide_request",
        json!({ "id": id, "decision": "approve" }),
    )
    .await;
    assert!(
        !ok && t.contains("scope"),
        "an approval names its scope: {t}"
    );
    let (ok, t) = call(
        &c,
        "decide_request",
        json!({ "id": id, "decision": "deny", "reason": "no paste sites" }),
    )
    .await;
    assert!(ok && t.contains("\"denied\""), "{t}");
    assert_eq!(
        s.asks.get(id).map(|v| v.outcome),
        Some(egress_agent::asks::Outcome::Denied {
            by: "uid 0".into(),
            reason: "no paste sites".into()
        })
    );
    // Every change, with who made it and its diff.
    let (ok, t) = call(&c, "list_changes", json!({})).await;
    assert!(ok, "{t}");
    let v: Value = serde_json::from_str(&t).expect("json");
    let actions: Vec<&str> = v
        .as_array()
        .map(|a| a.iter().filter_map(|c| c["action"].as_str()).collect())
        .unwrap_or_default();
    assert!(
        actions.contains(&"import") && actions.contains(&"set-policy"),
        "{t}"
    );
    assert!(
        v.as_array()
            .is_some_and(|a| a.iter().all(|c| c["uid"] == 0 && c.get("diff").is_some())),
        "{t}"
    );
    c.cancel().await.ok();
    s.stop().await;
}

fn cli(sock: &Path, a: &[&str]) -> (bool, String) {
    let o = Command::new(BIN)
        .args(a)
        .arg("--api-socket")
        .arg(sock)
        .output()
        .expect("egress-agent");
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_and_explain_commands_drive_the_api() {
    if !is_root() {
        api_support::skip("needs root (the control API serves root)");
        return;
    }
    let s = serve("cli").await;
    let sock = s.sock.clone();
    let dir = s.dir.clone();
    tokio::task::spawn_blocking(move || {
        let (ok, out) = cli(&sock, &["policy", "list"]);
        assert!(ok, "{out}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("ci ") && l.contains("allowlist") && l.contains("config")),
            "{out}"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("deny_all") && l.contains("default")),
            "{out}"
        );
        let f = dir.join("web.toml");
        std::fs::write(
            &f,
            "allow_hosts = [\n  \"pypi.org\",\n  \"*pypi.org\",\n]\n",
        )
        .expect("file");
        let (ok, out) = cli(&sock, &["policy", "set", "web", f.to_str().expect("path")]);
        assert!(!ok, "{out}");
        assert!(
            out.contains("policies.d/web.toml:3:3: policies.web.allow_hosts[1]:"),
            "{out}"
        );
        std::fs::write(&f, "allow_hosts = [\"pypi.org\"]\n").expect("file");
        let (ok, out) = cli(
            &sock,
            &[
                "policy",
                "set",
                "web",
                f.to_str().expect("path"),
                "--dry-run",
            ],
        );
        assert!(ok && out.contains("dry run: would write"), "{out}");
        let (ok, out) = cli(&sock, &["policy", "set", "web", f.to_str().expect("path")]);
        assert!(ok && out.contains("applied:"), "{out}");
        let (ok, out) = cli(&sock, &["policy", "show", "web"]);
        assert!(
            ok && out.contains("pypi.org") && out.contains("policies.d"),
            "{out}"
        );
        let (ok, out) = cli(&sock, &["policy", "defaults", "--default-policy", "web"]);
        assert!(ok, "{out}");
        let (ok, out) = cli(&sock, &["policy", "export"]);
        assert!(
            ok && out.contains("[policies.web]") && out.contains("default_policy = \"web\""),
            "{out}"
        );
        let bundle = dir.join("bundle.toml");
        std::fs::write(&bundle, out.replace("pypi.org", "files.pythonhosted.org")).expect("bundle");
        let (ok, out) = cli(&sock, &["policy", "import", bundle.to_str().expect("path")]);
        assert!(
            ok && out.contains("~ policy web") && out.contains("files.pythonhosted.org"),
            "{out}"
        );
        assert!(out.contains("dry run"), "{out}");
        assert!(
            std::fs::read_to_string(dir.join("policies.d/web.toml"))
                .expect("web")
                .contains("\"pypi.org\"")
        );
        let (ok, out) = cli(
            &sock,
            &[
                "policy",
                "import",
                bundle.to_str().expect("path"),
                "--apply",
            ],
        );
        assert!(ok && out.contains("applied:"), "{out}");
        assert!(
            std::fs::read_to_string(dir.join("policies.d/web.toml"))
                .expect("web")
                .contains("files.pythonhosted.org")
        );
        let (ok, out) = cli(&sock, &["policy", "delete", "web"]);
        assert!(!ok && out.contains("agent.default_policy"), "{out}");
        let (ok, out) = cli(&sock, &["explain", "--policy", "ci", "api.github.com"]);
        assert!(
            ok && out.contains("proxy:   allow") && out.contains("*.github.com"),
            "{out}"
        );
        let (ok, out) = cli(
            &sock,
            &["explain", "--policy", "ci", "10.0.0.1:5432", "--json"],
        );
        assert!(ok, "{out}");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(
            v["kernel"]["direct_tcp"]["reason"],
            "kernel-destination-not-allowed"
        );
        let (ok, out) = cli(&sock, &["explain", "--policy", "nope", "x.test"]);
        assert!(!ok && out.contains("no policy named"), "{out}");
    })
    .await
    .expect("cli");
    // Offline: explain against a file.
    let cfg = s.dir.join("config.toml");
    let o = Command::new(BIN)
        .args(["explain", "--policy", "ci", "github.com:22", "--config"])
        .arg(&cfg)
        .output()
        .expect("explain");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("port-not-allowed"),
        "{out}"
    );
    s.stop().await;
}

/// A request's run grant target (the MCP test denies; nothing is granted).
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
