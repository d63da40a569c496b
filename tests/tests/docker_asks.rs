//! Asking for access from inside a container (#41), with the real daemon and a private dockerd.
//! Root only.
//!
//! A container reads its policy at `http://egress.internal/v1/self` through its proxy, is
//! refused a name, files a request for it; the operator approves with `egress-agent requests
//! approve ID --scope run`: the container's retry reaches the upstream, a second container
//! under the same policy is still refused, and a new container in the first one's place is
//! refused again (the grant went with the workload). `--scope policy` writes the policy (a
//! change with its diff in `/v1/changes`) and lets the second container through; a denial's
//! reason reaches the workload's long-poll; a run grant and a pending request survive
//! `egress-agent restart`. Without the proxy, `http://egress.internal/`
//! resolves through the agent's DNS and reaches the container's own listener (kernel redirect
//! of the endpoint's port 80).
use egress_tests::docker::{Env, SERIAL, egress_internal as internal, proxied_get, require_root};
use serde_json::Value;

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The JSON body of an HTTP answer `nc` printed.
fn body_of(out: &str) -> Value {
    let start = out.find("\r\n\r\n").map_or(0, |i| i + 4);
    let text = out[start..].lines().next().unwrap_or("");
    serde_json::from_str(text).unwrap_or(Value::Null)
}

fn file(env: &Env, container: &str, host: &str) -> u64 {
    let body =
        format!(r#"{{"host": "{host}", "port": 8080, "reason": "the build fetches from it"}}"#);
    let out = env.exec_out(container, &internal("POST", "/v1/requests", &body));
    assert!(out.starts_with("HTTP/1.1 202"), "{out}");
    body_of(&out)["id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no id: {out}"))
}

fn cli_ok(env: &Env, args: &[&str]) -> String {
    let o = env.cli(args);
    assert!(
        o.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_container_asks_and_a_run_grant_opens_only_it_for_its_lifetime() {
    if !require_root() {
        return;
    }
    let _l = lock();
    let mut env = Env::new(&[]);
    // `web` in policies.d (a policy approval writes it); the main file keeps only the canary.
    env.restart_with_managed_web(CANARY);
    env.run_labelled("ask-1", &["egress.policy=web", "egress.run=run-5"]);
    env.run_labelled("ask-2", &["egress.policy=web"]);

    let me = env.exec_out("ask-1", &internal("GET", "/v1/self", ""));
    let me = body_of(&me);
    assert_eq!(
        (
            me["policy"].as_str(),
            me["run"].as_str(),
            me["workload"].as_str()
        ),
        (Some("web"), Some("run-5"), Some("ask-1")),
        "{me}"
    );
    // Without the proxy: the name resolves through the agent's DNS to the endpoint, and the
    // kernel sends port 80 there to the container's transparent listener (port 80 is not in
    // the policy's allow_ports). Each container is answered as itself; a host process in the
    // agent's namespace reaches nothing there.
    for (container, name) in [("ask-1", "ask-1"), ("ask-2", "ask-2")] {
        let out = env.exec_out(
            container,
            "unset http_proxy; wget -q -O- http://egress.internal/v1/self",
        );
        let me: Value = serde_json::from_str(out.trim()).unwrap_or(Value::Null);
        assert_eq!(
            (me["policy"].as_str(), me["workload"].as_str()),
            (Some("web"), Some(name)),
            "{out}"
        );
    }
    let host = env.d.netns.sh(
        "(printf 'GET /v1/self HTTP/1.1\\r\\nHost: egress.internal\\r\\n\\r\\n'; sleep 1) | nc -w 2 169.254.100.1 80; echo rc=$?",
    );
    assert!(
        !host.contains("HTTP/1."),
        "a host process was answered: {host}"
    );
    let out = env.exec_out("ask-1", &proxied_get("denied.test", 8080));
    assert!(out.contains("host-not-allowed"), "{out}");

    let id = file(&env, "ask-1", "denied.test");
    let listed = cli_ok(&env, &["requests", "--pending", "--json"]);
    let listed: Value = serde_json::from_str(&listed).unwrap_or(Value::Null);
    assert_eq!(
        (
            listed[0]["workload"].as_str(),
            listed[0]["run"].as_str(),
            listed[0]["host"].as_str()
        ),
        (Some("ask-1"), Some("run-5"), Some("denied.test")),
        "{listed}"
    );
    let decided = cli_ok(
        &env,
        &["requests", "approve", &id.to_string(), "--scope", "run"],
    );
    assert!(decided.contains("approved (scope run)"), "{decided}");
    let poll = env.exec_out(
        "ask-1",
        &internal("GET", &format!("/v1/requests/{id}?wait=5"), ""),
    );
    assert_eq!(body_of(&poll)["state"], "approved", "{poll}");

    let out = env.exec_out("ask-1", &proxied_get("denied.test", 8080));
    assert!(out.contains("hello-upstream"), "the retry passes: {out}");
    let out = env.exec_out("ask-2", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("host-not-allowed"),
        "another container is still refused: {out}"
    );

    // `egress-agent restart` (a hand-over to a new process): the run grant and a pending
    // request survive it (kept in the state directory under the workload's identity), and
    // still for that container alone.
    let waiting = file(&env, "ask-1", "pending.test");
    let o = env.cli(&["restart"]);
    assert!(
        o.status.success(),
        "{}{}
{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        env.log()
    );
    let out = env.exec_out("ask-1", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "the grant survives the restart: {out}\n{}",
        env.log()
    );
    let poll = env.exec_out(
        "ask-1",
        &internal("GET", &format!("/v1/requests/{waiting}?wait=0"), ""),
    );
    assert_eq!(body_of(&poll)["state"], "pending", "{poll}");
    let out = env.exec_out("ask-2", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("host-not-allowed"),
        "another container is still refused after the restart: {out}"
    );

    // The workload ends: its grant with it. A new container in its place is refused.
    env.d.docker(&["rm", "-f", "ask-1"]);
    env.run_labelled("ask-1", &["egress.policy=web", "egress.run=run-5"]);
    let out = env.exec_out("ask-1", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("host-not-allowed"),
        "the grant ended with the workload: {out}"
    );

    // A denial's reason reaches the workload.
    let id = file(&env, "ask-1", "tls.test");
    cli_ok(
        &env,
        &[
            "requests",
            "deny",
            &id.to_string(),
            "--reason",
            "use the mirror",
        ],
    );
    let poll = env.exec_out(
        "ask-1",
        &internal("GET", &format!("/v1/requests/{id}?wait=5"), ""),
    );
    let poll = body_of(&poll);
    assert_eq!(
        (poll["state"].as_str(), poll["reason"].as_str()),
        (Some("denied"), Some("use the mirror")),
        "{poll}"
    );

    // Scope policy: the policy is written (a change with its diff) and every workload under it
    // passes.
    let id = file(&env, "ask-2", "denied.test");
    let decided = cli_ok(
        &env,
        &["requests", "approve", &id.to_string(), "--scope", "policy"],
    );
    assert!(
        decided
            .lines()
            .any(|l| l.starts_with('+') && l.contains("denied.test")),
        "{decided}"
    );
    let (_, changes) = env.api_call("GET", "/v1/changes", None);
    let changes: Value = serde_json::from_str(&changes).unwrap_or(Value::Null);
    let last = changes
        .as_array()
        .and_then(|c| c.last())
        .cloned()
        .unwrap_or_default();
    assert!(
        last["target"] == "web" && last["diff"].as_str().unwrap_or("").contains("denied.test"),
        "{changes}"
    );
    for c in ["ask-1", "ask-2"] {
        let out = env.exec_out(c, &proxied_get("denied.test", 8080));
        assert!(
            out.contains("hello-upstream"),
            "{c} after the policy change: {out}"
        );
    }
    // `[requests]` auto-approval, applied by a reload: answered approved at once, for the run.
    env.write_config(&env.config_text(&format!(
        "{CANARY}[requests]\nauto_approve_hosts = [{{ host = \"tls.test\", ports = [8080] }}]\n"
    )));
    cli_ok(&env, &["reload"]);
    let body = r#"{"host": "tls.test", "port": 8080, "reason": "auto"}"#;
    let out = env.exec_out("ask-2", &internal("POST", "/v1/requests", body));
    assert_eq!(body_of(&out)["state"], "approved", "{out}");
    let listed = cli_ok(&env, &["requests", "--json"]);
    assert!(listed.contains("auto-approve ([requests])"), "{listed}");
}

/// The main file's policies in this test (`web` lives in policies.d).
const CANARY: &str = "[policies.canary]\nallow_cidrs = [\"198.18.0.1/32\"]\n";
