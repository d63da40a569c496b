//! The operator console (#35) in headless Chromium against the real daemon with a real
//! container, root only. The console listens on the Docker network's gateway address — a
//! non-loopback address an operator chose — and:
//! - a confined container reaches nothing there: not with its own policy (the kernel refuses),
//!   not with a policy whose `allow_cidrs` covers that address (the host layer drops it); the
//!   console's connection counter does not move;
//! - the page asks for a token (made by `egress-agent console token`); a write without a login,
//!   and one with the session but without its CSRF token, are refused from the page itself;
//! - a denial of the running container becomes a rule from the page: the diff is shown before
//!   anything is written, the replay of the recorded traffic counts the denials the store holds,
//!   applying it lets the container through, and the change is recorded with the operator; a
//!   tighter policy replayed from the editor counts as newly denied what the store recorded;
//! - the policy editor refuses a bad host next to its field (nothing written), creates a policy,
//!   the global default is changed from the settings form, an edit turns the container's badge
//!   to `audit`, and a bad import is refused naming its field.
//!
//! With `EGRESS_CONSOLE_SCREENSHOTS=DIR` it saves a screenshot of each screen there
//! (docs/console-*.png).
use std::process::Command;
use std::time::Duration;

use egress_tests::browser::{Browser, container_row};
use egress_tests::docker::{Env, GATEWAY, SERIAL, UPSTREAM_IP, proxied_get, require_root};
use serde_json::Value;

const UI_PORT: u16 = 18182;

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A GET of the daemon's control API: the body, parsed.
fn api(env: &Env, path: &str) -> Value {
    serde_json::from_str(&env.api_call("GET", path, None).1).unwrap_or(Value::Null)
}

/// A POST of a JSON body to the daemon's control API: the answer, parsed.
fn api_post(env: &Env, path: &str, body: &Value) -> Value {
    let body = body.to_string();
    serde_json::from_str(
        &env.api_call("POST", path, Some(("application/json", &body)))
            .1,
    )
    .unwrap_or(Value::Null)
}

fn connections(env: &Env) -> u64 {
    api(env, "/v1/status")["console"]["connections"]
        .as_u64()
        .expect("console.connections in /v1/status")
}

fn shot(b: &mut Browser, name: &str) {
    if let Ok(dir) = std::env::var("EGRESS_CONSOLE_SCREENSHOTS") {
        let path = format!("{dir}/console-{name}.png");
        b.ask(&format!("shot {path}"));
        eprintln!("screenshot: {path}");
    }
}

/// Click the element `selector` names.
fn click(b: &mut Browser, selector: &str) {
    let js = format!(
        "(() => {{ const e = document.querySelector({selector:?}); if (!e) throw new Error('no ' + {selector:?}); e.click(); return true; }})()"
    );
    b.eval(&js);
}

fn set_value(b: &mut Browser, id: &str, value: &str) {
    b.eval(&format!(
        "(() => {{ const e = document.getElementById({id:?}); e.value = {value:?}; e.dispatchEvent(new Event('input')); return true; }})()"
    ));
}

fn text_of(b: &mut Browser, id: &str) -> String {
    b.eval(&format!("document.getElementById({id:?}).textContent"))
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn the_console_turns_a_denial_into_a_rule_after_login() {
    if !require_root() {
        return;
    }
    egress_tests::browser::require_chromium();
    let _l = lock();
    let mut env = Env::new(&[]);
    let ui = format!("{GATEWAY}:{UI_PORT}");
    let dir = env.restart_with_managed_web(&format!(
        "[policies.canary]\nallow_cidrs = [\"{GATEWAY}/32\"]\n[api]\nui_listen = \"{ui}\"\n"
    ));
    assert!(
        env.log().contains("plain HTTP on a non-loopback address"),
        "the non-loopback console is warned about:\n{}",
        env.log()
    );

    // A token, made as an operator would.
    let o = Command::new(env.agent_bin())
        .args(["console", "token", "ops", "--config"])
        .arg(env.config_path())
        .output()
        .expect("console token");
    let token = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    assert!(
        o.status.success() && token.starts_with("egc_"),
        "{token} {}",
        String::from_utf8_lossy(&o.stderr)
    );

    env.run_labelled("web-1", &["egress.policy=web", "egress.run=run-77"]);
    env.run_labelled("cidr-1", &["egress.policy=canary"]);

    // Confined containers get nothing at the console's address, whatever their policy allows.
    let before = connections(&env);
    for name in ["web-1", "cidr-1"] {
        let out = env.exec_out(
            name,
            &format!(
                "(printf 'GET /v1/status HTTP/1.1\\r\\nHost: {ui}\\r\\n\\r\\n'; sleep 1) | nc -w 3 {GATEWAY} {UI_PORT}; echo rc=$?"
            ),
        );
        assert!(
            !out.contains("HTTP/1.1"),
            "{name} reached the console: {out}"
        );
    }
    assert_eq!(
        connections(&env),
        before,
        "a confined container's connection arrived at the console"
    );

    // Two allowed requests and two denials the store will hold.
    for _ in 0..2 {
        let out = env.exec_out("web-1", &proxied_get("allowed.test", 8080));
        assert!(out.contains("hello-upstream"), "{out}");
    }
    for _ in 0..2 {
        let out = env.exec_out("web-1", &proxied_get("denied.test", 8080));
        assert!(out.contains("host-not-allowed"), "{out}");
    }
    let stored = |env: &Env| {
        api(env, "/v1/denials?policy=web")
            .as_array()
            .map(|a| a.iter().filter(|e| e["host"] == "denied.test").count())
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while stored(&env) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the store never held the two denials"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let profile = env.dir.join("chromium-console");
    let mut b = Browser::open(&env.d.netns.path(), &format!("http://{ui}/ui/"), profile);
    b.wait_true(
        "the sign-in form",
        "document.getElementById('auth').dataset.auth === 'none'",
    );
    shot(&mut b, "signin");
    // A write from the page without a login: refused.
    let put = "fetch('/v1/policies/web', {method: 'PUT', headers: {'content-type': 'application/json'}, body: JSON.stringify({allow_hosts: ['x.test']})}).then(r => r.status)";
    assert_eq!(b.eval(put), Value::from(401));
    // A wrong token: refused, and the form says so.
    set_value(&mut b, "token", "egc_wrong");
    click(&mut b, "#auth button");
    b.wait_true(
        "the refused sign-in",
        "document.getElementById('auth-note').className === 'error'",
    );
    set_value(&mut b, "token", &token);
    click(&mut b, "#auth button");
    b.wait_true(
        "signed in",
        "document.getElementById('auth').dataset.auth === 'session'",
    );
    // Each workload with its policy and where that came from.
    let dom = b.wait_dom("web-1 with its policy's source", |d| {
        container_row(d, "web-1").is_some_and(|r| r.contains("(label)"))
    });
    assert!(
        container_row(&dom, "cidr-1").is_some_and(|r| r.contains("canary")),
        "{dom}"
    );
    // What the console can't change says so up front (the main file's policy, a built-in),
    // with no Edit or Delete; the main file's offers its export to paste there.
    b.wait_true(
        "canary and allow_all marked read-only",
        "['canary', 'allow_all'].every(n => { const r = document.querySelector('tr[data-policy=\"' + n + '\"]'); return r && r.querySelector('.ro') && ![...r.querySelectorAll('button')].some(x => x.textContent === 'Edit' || x.textContent === 'Delete'); })",
    );
    assert_eq!(
        b.eval(
            "document.querySelector('tr[data-policy=\"canary\"] .ro').title.includes('defined in')"
        ),
        Value::from(true)
    );
    assert_eq!(
        b.eval("!!document.querySelector('tr[data-policy=\"canary\"] a[href=\"/v1/export?format=toml\"]')"),
        Value::from(true)
    );
    assert_eq!(
        b.eval("[...document.querySelectorAll('tr[data-policy=\"web\"] button')].map(x => x.textContent).join(',')"),
        Value::from("Edit,Delete,Duplicate")
    );
    // The filter finds a run's workloads and denials by its id, in every list.
    set_value(&mut b, "filter", "run-77");
    b.wait_true(
        "only run-77's workload and denials",
        "(() => { const v = [...document.querySelectorAll('#containers tbody tr, #denials tbody tr')].filter(r => !r.hidden).map(r => r.dataset.container || r.dataset.destination); return v.includes('web-1') && v.includes('denied.test:8080') && !v.includes('cidr-1'); })()",
    );
    set_value(&mut b, "filter", "");
    // The session's cookie alone does not make a write: the CSRF token is missing.
    assert_eq!(b.eval(put), Value::from(403));
    assert!(!dir.join("x.toml").exists());

    // From denial to rule: the diff first, the replay, then apply.
    b.wait_true(
        "an Allow action on the denial",
        "!!document.querySelector('tr[data-destination=\"denied.test:8080\"] button.allow')",
    );
    click(
        &mut b,
        "tr[data-destination=\"denied.test:8080\"] button.allow",
    );
    b.wait_true(
        "the diff",
        "document.getElementById('change-diff').textContent.includes('denied.test')",
    );
    let diff = text_of(&mut b, "change-diff");
    assert!(
        diff.lines()
            .any(|l| l.starts_with('+') && l.contains("denied.test")),
        "{diff}"
    );
    assert!(
        std::fs::read_to_string(dir.join("web.toml"))
            .expect("web.toml")
            .contains("allowed.test")
            && !std::fs::read_to_string(dir.join("web.toml"))
                .expect("web.toml")
                .contains("denied.test"),
        "nothing is written before Apply"
    );
    click(&mut b, "#change-replay-run");
    b.wait_true(
        "the replay's totals",
        "!!document.querySelector('#replay-totals tr[data-bucket=\"newly_allowed\"]')",
    );
    let newly = b.eval(
        "Number(document.querySelector('#replay-totals tr[data-bucket=\"newly_allowed\"]').children[2].textContent)",
    );
    assert_eq!(
        newly,
        Value::from(stored(&env) as u64),
        "the replay counts the denials the store holds"
    );
    shot(&mut b, "denial-to-rule");
    click(&mut b, "#change-apply");
    b.wait_true("applied", "!document.getElementById('change-done').hidden");
    let out = env.exec_out("web-1", &proxied_get("denied.test", 8080));
    assert!(out.contains("hello-upstream"), "allowed after Apply: {out}");
    let changes = api(&env, "/v1/changes");
    let last = changes
        .as_array()
        .and_then(|a| a.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(last["identity"], "console:ops", "{changes}");
    assert!(
        last["diff"].as_str().unwrap_or("").contains("denied.test"),
        "{last}"
    );
    b.wait_true(
        "the change in the page's list",
        "document.getElementById('changes').textContent.includes('console:ops')",
    );
    allow_a_group(&mut b, &env, &dir);
    new_policy_from_a_run(&mut b, &env, &dir);
    requests_decided_from_the_page(&mut b, &env, &dir);

    // A tighter web (without allowed.test), replayed from the editor before saving: its
    // newly denied count is what the store recorded as allowed to allowed.test.
    click(&mut b, "tr[data-policy=\"web\"] button");
    b.wait_true(
        "the editor on web",
        "document.getElementById('ed-name').value === 'web'",
    );
    set_value(&mut b, "ed-hosts", "denied.test");
    let tighter = serde_json::json!({
        "name": "web",
        "policy": { "allow_hosts": ["denied.test"], "allow_ports": [8080],
                    "allow_cidrs": [format!("{UPSTREAM_IP}/32")] },
    });
    let from_store =
        api_post(&env, "/v1/replay", &tighter)["totals"]["newly_denied"]["events"].clone();
    assert_eq!(
        from_store,
        Value::from(2u64),
        "the store's two allowed requests"
    );
    click(&mut b, "#ed-preview");
    b.wait_true(
        "the tighter diff",
        "document.getElementById('change-diff').textContent.includes('-allow_hosts')",
    );
    click(&mut b, "#change-replay-run");
    b.wait_true(
        "the tighter replay",
        "!!document.querySelector('#replay-totals tr[data-bucket=\"newly_denied\"]')",
    );
    let newly_denied = b.eval(
        "Number(document.querySelector('#replay-totals tr[data-bucket=\"newly_denied\"]').children[2].textContent)",
    );
    assert_eq!(
        newly_denied, from_store,
        "the page's replay and the store agree"
    );
    click(&mut b, "#change-cancel");
    click(&mut b, "#ed-close");
    assert!(
        std::fs::read_to_string(dir.join("web.toml"))
            .expect("web.toml")
            .contains("allowed.test"),
        "a replay writes nothing"
    );

    // The editor: a bad host is refused next to its field, nothing written; then a policy.
    click(&mut b, "#policy-new");
    set_value(&mut b, "ed-name", "tight");
    set_value(&mut b, "ed-hosts", "allowed.test\n*bad*host");
    set_value(&mut b, "ed-ports", "8080");
    click(&mut b, "#ed-preview");
    b.wait_true(
        "the field's error",
        "document.querySelector('.field-error[data-field=\"allow_hosts\"]').textContent.length > 0",
    );
    shot(&mut b, "editor-error");
    assert!(
        !dir.join("tight.toml").exists(),
        "a refused policy wrote nothing"
    );
    set_value(&mut b, "ed-hosts", "allowed.test\nmirror.test 8443");
    click(&mut b, "#ed-preview");
    b.wait_true(
        "the new policy's diff",
        "document.getElementById('change-diff').textContent.includes('mirror.test')",
    );
    click(&mut b, "#change-apply");
    b.wait_true(
        "the new policy in the list",
        "!!document.querySelector('tr[data-policy=\"tight\"]')",
    );
    let written = std::fs::read_to_string(dir.join("tight.toml")).expect("tight.toml");
    assert!(
        written.contains("mirror.test") && written.contains("8443"),
        "{written}"
    );

    // The global default, from the settings form.
    b.eval("(() => { const s = document.getElementById('set-default'); s.value = 'tight'; s.dispatchEvent(new Event('change')); return true; })()");
    click(&mut b, "#set-save");
    b.wait_true(
        "the defaults' diff",
        "document.getElementById('change-diff').textContent.includes('tight')",
    );
    click(&mut b, "#change-apply");
    b.wait_true(
        "tight as the default",
        "document.querySelector('tr[data-policy=\"tight\"]').children[2].textContent.includes('default')",
    );
    assert_eq!(api(&env, "/v1/defaults")["default_policy"], "tight");

    // An edit changes the running container's badge.
    b.wait_true(
        "web's Edit button",
        "!!document.querySelector('tr[data-policy=\"web\"] button')",
    );
    click(&mut b, "tr[data-policy=\"web\"] button");
    b.wait_true(
        "the editor on web",
        "document.getElementById('ed-name').value === 'web'",
    );
    b.eval("(() => { document.getElementById('ed-enforce').value = 'audit'; return true; })()");
    click(&mut b, "#ed-preview");
    b.wait_true(
        "the audit diff",
        "document.getElementById('change-diff').textContent.includes('audit')",
    );
    click(&mut b, "#change-apply");
    let dom = b.wait_dom("web-1 in audit", |d| {
        container_row(d, "web-1").is_some_and(|r| r.contains("data-badge=\"audit\""))
    });
    assert!(dom.contains("data-badge=\"audit\""));

    // A bad import is refused, naming the field; nothing changes.
    let policies_before = api(&env, "/v1/policies");
    b.eval(
        "(() => { const dt = new DataTransfer(); dt.items.add(new File(['[policies.imp]\\nallow_hosts = [\"a.test\", \"*x*\"]\\n'], 'bad.toml')); const i = document.getElementById('import-file'); i.files = dt.files; i.dispatchEvent(new Event('change')); return true; })()",
    );
    b.wait_true(
        "the import's refusal",
        "!document.getElementById('change-error').hidden && document.getElementById('change-error').textContent.includes('allow_hosts')",
    );
    shot(&mut b, "import-refused");
    assert_eq!(
        api(&env, "/v1/policies"),
        policies_before,
        "nothing changed"
    );
    assert!(!dir.join("imp.toml").exists());
    drop(b);
}

/// Several denials, selected, become one change: both hosts in one diff and one file.
fn allow_a_group(b: &mut Browser, env: &Env, dir: &std::path::Path) {
    for host in ["g1.test", "g2.test"] {
        let out = env.exec_out("web-1", &proxied_get(host, 8080));
        assert!(out.contains("host-not-allowed"), "{out}");
    }
    // They arrive live (the page loaded before they happened).
    b.wait_true(
        "the two live denials with their boxes",
        "['g1.test', 'g2.test'].every(h => document.querySelector('tr.fresh[data-destination=\"' + h + ':8080\"] input.pick'))",
    );
    click(b, "tr[data-destination=\"g1.test:8080\"] input.pick");
    click(b, "tr[data-destination=\"g2.test:8080\"] input.pick");
    b.wait_true(
        "the group action",
        "document.getElementById('denials-allow-selected').textContent === 'Allow 2 selected' && !document.getElementById('denials-allow-selected').hidden",
    );
    click(b, "#denials-allow-selected");
    b.wait_true(
        "one diff with both",
        "(() => { const d = document.getElementById('change-diff').textContent; return d.includes('g1.test') && d.includes('g2.test'); })()",
    );
    click(b, "#change-apply");
    b.wait_true("applied", "!document.getElementById('change-done').hidden");
    let web = std::fs::read_to_string(dir.join("web.toml")).expect("web.toml");
    assert!(
        web.contains("g1.test") && web.contains("g2.test") && web.contains("denied.test"),
        "{web}"
    );
    for host in ["g1.test", "g2.test"] {
        let out = env.exec_out("web-1", &proxied_get(host, 8080));
        assert!(
            !out.contains("host-not-allowed"),
            "{host} still refused: {out}"
        );
    }
}

/// A denial of run-77 becomes a new policy made from what run-77 did (allowed and refused),
/// reviewed in the editor, replayed against run-77's recorded traffic (the same numbers as the
/// API's replay), and saved; the page says how a workload comes to use it.
fn new_policy_from_a_run(b: &mut Browser, env: &Env, dir: &std::path::Path) {
    click(
        b,
        "tr[data-destination=\"denied.test:8080\"] button.suggest",
    );
    b.wait_true(
        "the editor with run-77's suggestion",
        "document.getElementById('ed-name').value === 'from-run-77' && document.getElementById('ed-hosts').value.includes('allowed.test')",
    );
    assert!(
        text_of(b, "editor-title").contains("run run-77"),
        "{}",
        text_of(b, "editor-title")
    );
    let hosts = b
        .eval("document.getElementById('ed-hosts').value")
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        hosts.contains("denied.test"),
        "the refused host is in the suggestion: {hosts}"
    );
    click(b, "#ed-preview");
    b.wait_true(
        "the new policy's diff",
        "document.getElementById('change-diff').textContent.includes('from-run-77')",
    );
    assert!(
        !dir.join("from-run-77.toml").exists(),
        "nothing is written before Apply"
    );
    let body = b.eval("JSON.stringify(pending.replay)");
    let body: Value = serde_json::from_str(body.as_str().unwrap_or("{}")).expect("replay body");
    assert_eq!(
        (body["run"].as_str(), body["against"].as_str()),
        (Some("run-77"), Some("any")),
        "{body}"
    );
    let from_api = api_post(env, "/v1/replay", &body)["totals"]["newly_allowed"]["events"].clone();
    click(b, "#change-replay-run");
    b.wait_true(
        "the run's replay",
        "!!document.querySelector('#replay-totals tr[data-bucket=\"newly_allowed\"]')",
    );
    let newly = b.eval(
        "Number(document.querySelector('#replay-totals tr[data-bucket=\"newly_allowed\"]').children[2].textContent)",
    );
    assert_eq!(newly, from_api, "the page's replay and the API's agree");
    assert!(
        newly.as_u64().unwrap_or(0) >= 2,
        "run-77's refusals under web would be allowed: {newly}"
    );
    click(b, "#change-apply");
    b.wait_true("applied", "!document.getElementById('change-done').hidden");
    assert!(
        text_of(b, "change-done").contains("egress.policy=from-run-77"),
        "{}",
        text_of(b, "change-done")
    );
    let written = std::fs::read_to_string(dir.join("from-run-77.toml")).expect("from-run-77.toml");
    assert!(written.contains("allowed.test"), "{written}");
}

/// `POST http://egress.internal/v1/requests` from a container, through its proxy.
fn ask_from(env: &Env, container: &str, host: &str) {
    let body =
        format!(r#"{{"host": "{host}", "port": 8080, "reason": "the docs build needs it"}}"#);
    let out = env.exec_out(
        container,
        &egress_tests::docker::egress_internal("POST", "/v1/requests", &body),
    );
    assert!(out.starts_with("HTTP/1.1 202"), "{out}");
}

/// A workload's access requests in the page: approving one into its policy shows the diff
/// first and writes it on Apply (recorded as the operator's); denying one sends the reason.
fn requests_decided_from_the_page(b: &mut Browser, env: &Env, dir: &std::path::Path) {
    ask_from(env, "web-1", "asked.test");
    b.wait_true(
        "the pending request with its actions",
        "!!document.querySelector('#requests tr[data-state=\"pending\"] button.allow-policy')",
    );
    click(
        b,
        "#requests tr[data-state=\"pending\"] button.allow-policy",
    );
    b.wait_true(
        "the approval's diff",
        "document.getElementById('change-diff').textContent.includes('asked.test')",
    );
    assert!(
        !std::fs::read_to_string(dir.join("web.toml"))
            .expect("web.toml")
            .contains("asked.test"),
        "nothing is written before Apply"
    );
    shot(b, "request-approval");
    click(b, "#change-apply");
    b.wait_true("applied", "!document.getElementById('change-done').hidden");
    assert!(
        std::fs::read_to_string(dir.join("web.toml"))
            .expect("web.toml")
            .contains("asked.test")
    );
    let listed = api(env, "/v1/requests");
    let first = listed
        .as_array()
        .and_then(|a| a.first())
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (
            first["state"].as_str(),
            first["scope"].as_str(),
            first["by"].as_str(),
            first["workload"].as_str()
        ),
        (
            Some("approved"),
            Some("policy"),
            Some("console:ops"),
            Some("web-1")
        ),
        "{listed}"
    );

    ask_from(env, "web-1", "asked2.test");
    b.wait_true(
        "the second request",
        "!!document.querySelector('#requests tr[data-state=\"pending\"] button.deny')",
    );
    set_value_in(
        b,
        "#requests tr[data-state=\"pending\"] input.deny-reason",
        "use the mirror",
    );
    click(b, "#requests tr[data-state=\"pending\"] button.deny");
    b.wait_true(
        "the denial in the list",
        "!!document.querySelector('#requests tr[data-state=\"denied\"]')",
    );
    let listed = api(env, "/v1/requests");
    let second = listed
        .as_array()
        .and_then(|a| a.get(1))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (second["state"].as_str(), second["reason"].as_str()),
        (Some("denied"), Some("use the mirror")),
        "{listed}"
    );
}

fn set_value_in(b: &mut Browser, selector: &str, value: &str) {
    b.eval(&format!(
        "(() => {{ const e = document.querySelector({selector:?}); e.value = {value:?}; return true; }})()"
    ));
}
