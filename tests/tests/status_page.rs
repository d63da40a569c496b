//! The real daemon with real containers (see `egress_tests::docker::Env`), root only:
//! - policies from `policies.d` at start; a policy written through the control API (curl
//!   `--unix-socket`, a real client) takes effect for a running container like a reload (the
//!   proxy lets through what it refused a moment before); a bad one is a 422 naming the field and
//!   changes nothing; each change is in the event store with uid 0; `explain --container`
//!   resolves the container's labels through Docker;
//! - the status page on `api.ui_listen`, rendered by headless Chromium (driven over its DevTools
//!   protocol by node, tests/status_page/cdp.js): the containers with their policy badges
//!   (allowlist, deny_all, audit, allow_all), the doctor's probes as the daemon sees itself
//!   (`proxy.listening`, `docker.reachable` pass) and a denial appearing live (SSE). With
//!   `EGRESS_STATUS_SCREENSHOT=PATH` it also saves a screenshot there (docs/status-page.png).

use egress_tests::browser::{Browser, container_row, row};
use egress_tests::docker::{Env, SERIAL, UPSTREAM_IP, proxied_get, require_root};
use serde_json::Value;

const UI: &str = "127.0.0.1:18181";

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn policies_through_the_api_and_the_status_page() {
    if !require_root() {
        return;
    }
    egress_tests::browser::require_chromium();
    let _l = lock();
    let mut env = Env::new(&[]);
    // `web` lives in policies.d (loaded after the main file); the page listens on loopback.
    let dir = env.restart_with_managed_web(&format!(
        "[policies.canary]\nallow_cidrs = [\"198.18.0.1/32\"]\n[api]\nui_listen = \"{UI}\"\n"
    ));

    env.run_labelled("web-1", &["egress.policy=web"]);
    env.run_labelled("locked-1", &["egress.policy=deny_all"]);
    env.run_labelled("watch-1", &["egress.policy=audit"]);
    env.start_ok("plain-1", &[], &["sleep", "600"]);
    assert!(
        env.wait_enforced("plain-1", 2),
        "plain-1 never enforced:\n{}",
        env.log()
    );

    // The page: containers with their badges.
    let profile = env.dir.join("chromium-profile");
    let mut b = Browser::open(&env.d.netns.path(), &format!("http://{UI}/ui/"), profile);
    let dom = b.wait_dom("the four containers", |d| {
        ["web-1", "locked-1", "watch-1", "plain-1"]
            .iter()
            .all(|n| container_row(d, n).is_some())
    });
    for (name, badge) in [
        ("web-1", "allowlist"),
        ("locked-1", "deny_all"),
        ("watch-1", "audit"),
        ("plain-1", "allow_all"),
    ] {
        let row = container_row(&dom, name).unwrap_or_default();
        assert!(
            row.contains(&format!("data-badge=\"{badge}\"")),
            "{name} should be {badge}: {row}"
        );
    }
    assert!(
        dom.contains("<tr data-policy=\"web\""),
        "policies table: {dom}"
    );
    // The doctor as the daemon sees itself: its own listeners are up, its Docker is reachable.
    let dom = b.wait_dom("the doctor's probes", |d| {
        row(d, "probe", "proxy.listening").is_some()
    });
    for probe in ["proxy.listening", "docker.reachable"] {
        let r = row(&dom, "probe", probe).unwrap_or_default();
        assert!(
            r.contains("class=\"status-pass\""),
            "{probe} should pass: {r}"
        );
    }
    assert!(
        dom.contains("class=\"up\""),
        "the header's proxy state: {dom}"
    );
    // Probing its own listeners is no foreign peer's connection: the doctor reads their LISTEN
    // state instead of connecting (a connection would be refused and recorded, #40 item 1).
    assert!(
        !env.events()
            .iter()
            .any(|e| e["reason"] == "listener-foreign-peer"),
        "the doctor's probes were recorded as denials: {:?}",
        env.events()
    );

    // A refusal shows up live (the page is already open: SSE, not a reload).
    let before = b
        .dom()
        .matches("class=\"fresh\" data-reason=\"host-not-allowed\"")
        .count();
    let out = env.exec_out("web-1", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("403") && out.contains("host-not-allowed"),
        "{out}"
    );
    let dom = b.wait_dom("the live denial", |d| {
        d.matches("class=\"fresh\" data-reason=\"host-not-allowed\"")
            .count()
            > before
    });
    assert!(dom.contains("denied.test:8080"), "{dom}");
    assert!(dom.contains("class=\"live-on\""), "the live badge: {dom}");
    drop(b);

    // The API: a bad policy is refused with the config's own field and reason; nothing changes.
    let (code, body) = env.api_call(
        "PUT",
        "/v1/policies/web",
        Some((
            "application/toml",
            "allow_hosts = [\"allowed.test\", \"*denied.test\"]\n",
        )),
    );
    assert_eq!(code, 422, "{body}");
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["field"], "policies.web.allow_hosts[1]", "{body}");
    let out = env.exec_out("web-1", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("host-not-allowed"),
        "unchanged after a 422: {out}"
    );

    // A good one is applied to the running container like a reload.
    let good = format!(
        "allow_hosts = [\"allowed.test\", \"denied.test\"]\nallow_ports = [8080]\nallow_cidrs = [\"{UPSTREAM_IP}/32\"]\n"
    );
    let (code, body) = env.api_call("PUT", "/v1/policies/web", Some(("application/toml", &good)));
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        std::fs::read_to_string(dir.join("web.toml")).expect("web.toml"),
        good
    );
    let out = env.exec_out("web-1", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "allowed after the change: {out}"
    );

    // Deleting a policy in use is refused; the defaults can be set; every change is recorded.
    let (code, body) = env.api_call("DELETE", "/v1/policies/web", None);
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("docker:web-1"), "{body}");
    let (code, body) = env.api_call(
        "PUT",
        "/v1/defaults",
        Some(("application/json", "{\"default_policy\": \"audit\"}")),
    );
    assert_eq!(code, 200, "{body}");
    let (_, body) = env.api_call("GET", "/v1/changes", None);
    let rows: Value = serde_json::from_str(&body).expect("changes");
    let rows = rows.as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{body}");
    assert!(
        rows.iter()
            .all(|r| r["uid"] == 0 && r["result"] == "applied"),
        "{body}"
    );
    assert_eq!(rows[0]["action"], "set-policy");

    // explain --container: the container's labels, resolved through Docker by the daemon.
    let o = env.cli(&[
        "explain",
        "--container",
        "web-1",
        "denied.test:8080",
        "--json",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["policy"]["name"], "web", "{out}");
    assert_eq!(v["container"]["enforced_as"], "web", "{out}");
    assert_eq!(v["proxy"]["verdict"], "allow", "{out}");
    let o = env.cli(&["explain", "--container", "locked-1", "allowed.test:8080"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("deny_all") && out.contains("policy-deny-all"),
        "{out}"
    );
}
