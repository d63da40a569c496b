//! Audit → store → suggest → enforce with the real daemon (`egress-agent run`) and a private
//! dockerd (see `egress_tests::docker`). Root only.
//!
//! A container under an audit policy reaches a name its allowlist does not list (through the
//! proxy); the would-deny lands in the daemon's store with the container and its run label;
//! `events` reads it back by policy/verdict/run, `suggest --run` proposes a policy the real
//! parser accepts; a reload to enforce refuses the same request for the running container; after
//! kill -9 of the daemon the store still answers (read-only, no daemon) and is intact.
//!
//! The kernel half of audit: a direct connection the allowlist does not cover is let through by
//! the eBPF programs (POLICY_FLAG_AUDIT), arrives at the canary, and is stored as a kernel
//! would-deny (EVENT_FLAG_AUDIT).
use std::path::Path;
use std::time::{Duration, Instant};

use egress_tests::docker::{Env, SERIAL, UPSTREAM_IP, require_root};

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn get(host: &str, port: u16) -> String {
    format!(
        "(printf 'GET http://{host}:{port}/index.html?token=hunter2 HTTP/1.1\\r\\nHost: {host}:{port}\\r\\nConnection: close\\r\\n\\r\\n'; sleep 1) | nc -w 5 169.254.100.1 3128"
    )
}

fn watch_policy(enforce: &str) -> String {
    format!(
        "[policies.watch]\nenforce = \"{enforce}\"\nallow_hosts = [\"allowed.test\"]\nallow_ports = [8080]\nallow_cidrs = [\"{UPSTREAM_IP}/32\"]\n\
         [policies.canary]\nallow_cidrs = [\"198.18.0.1/32\"]\n"
    )
}

fn reload(env: &Env, text: &str) {
    env.write_config(text);
    let o = env.cli(&["reload"]);
    assert!(
        o.status.success(),
        "reload refused: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `egress-agent ARGS --config <env's>` (the store: the daemon's own `agent.state_dir`).
fn store_cli(env: &Env, args: &[&str]) -> std::process::Output {
    std::process::Command::new(egress_tests::agent::agent_bin())
        .args(args)
        .arg("--config")
        .arg(env.config_path())
        .output()
        .expect("run the CLI")
}

fn json_lines(o: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

/// Wait until `events --json ARGS` (from the store) has an event matching `f`.
fn wait_stored(
    env: &Env,
    args: &[&str],
    f: impl Fn(&serde_json::Value) -> bool,
) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut a = vec!["events", "--json"];
        a.extend_from_slice(args);
        let o = store_cli(env, &a);
        let evs = if o.status.success() {
            json_lines(&o)
        } else {
            Vec::new()
        };
        if evs.iter().any(&f) {
            return evs;
        }
        assert!(
            Instant::now() < deadline,
            "no matching stored event for {args:?}: {evs:?} {}\n{}",
            String::from_utf8_lossy(&o.stderr),
            env.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn audit_store_suggest_enforce_with_the_daemon() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let mut env = Env::new(&[]);
    reload(&env, &env.config_text(&watch_policy("audit")));
    env.start_ok(
        "aud",
        &["--label", "egress.policy=watch", "--label", "egress.run=77"],
        &["sleep", "600"],
    );
    assert!(
        env.wait_enforced("aud", 2),
        "aud never enforced:\n{}",
        env.log()
    );

    // Audit: the unlisted name goes through, the listed one too.
    let out = env.exec_out("aud", &get("denied.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "audit must let denied.test through: {out}"
    );
    let out = env.exec_out("aud", &get("allowed.test", 8080));
    assert!(out.contains("hello-upstream"), "allowed.test: {out}");

    // The would-deny is in the store, with the container and its run label.
    let evs = wait_stored(
        &env,
        &[
            "--policy",
            "watch",
            "--verdict",
            "would-deny",
            "--run",
            "77",
        ],
        |e| e["host"] == "denied.test",
    );
    let e = evs
        .iter()
        .find(|e| e["host"] == "denied.test")
        .expect("event");
    assert_eq!(e["verdict"], "would-deny");
    assert_eq!(e["reason"], "host-not-allowed");
    assert_eq!(e["port"], 8080);
    assert_eq!(e["container"]["name"], "aud");
    assert_eq!(e["context"]["run"], "77");
    // No entry matched the name: no rule behind it. The allowed request's flow names the entry
    // that let it through (the rule travels from the proxy's decision into the store).
    assert!(e.get("rule").is_none(), "{e}");
    let flows = wait_stored(
        &env,
        &["--flows", "--policy", "watch", "--run", "77"],
        |f| f["host"] == "allowed.test" && f["verdict"] == "allow",
    );
    let f = flows
        .iter()
        .find(|f| f["host"] == "allowed.test" && f["verdict"] == "allow")
        .expect("flow");
    assert_eq!(f["rule"], "allow_hosts allowed.test", "{f}");
    assert!(
        !serde_json::to_string(&evs)
            .expect("json")
            .contains("hunter2")
    );

    // suggest --run: a policy the real parser accepts, with both names on 8080.
    let o = store_cli(&env, &["suggest", "--run", "77", "--name", "watch"]);
    assert!(
        o.status.success(),
        "suggest: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let parsed = egress_agent::config::Config::from_toml_str(&text, Path::new("suggested.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    let p = parsed.policy("watch").expect("policy");
    let hosts: Vec<String> = p.allow_hosts.iter().map(ToString::to_string).collect();
    assert_eq!(hosts, ["allowed.test", "denied.test"], "{text}");
    assert_eq!(p.allow_ports, [8080], "{text}");
    let o = store_cli(
        &env,
        &["suggest", "--run", "77", "--policy", "watch", "--diff"],
    );
    let diff = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(diff.contains("+ allow_hosts \"denied.test\""), "{diff}");
    assert!(diff.contains("  allow_hosts \"allowed.test\""), "{diff}");

    // Reload to enforce: the running container is refused at once.
    reload(&env, &env.config_text(&watch_policy("enforce")));
    let out = env.exec_out("aud", &get("denied.test", 8080));
    assert!(
        out.contains("403") && out.contains("host-not-allowed") && !out.contains("hello-upstream"),
        "enforce after reload: {out}"
    );
    // The refusal's body tells the workload its run and the destination (issue #41).
    assert!(
        out.contains("run: 77") && out.contains("destination: denied.test:8080"),
        "the 403's body: {out}"
    );
    wait_stored(&env, &["--policy", "watch", "--verdict", "deny"], |e| {
        e["host"] == "denied.test"
    });

    // kill -9: the store answers without the daemon and is intact.
    env.kill_agent();
    let o = env.cli(&[
        "events",
        "-n",
        "100",
        "--config",
        &env.config_path().display().to_string(),
    ]);
    assert!(
        o.status.success(),
        "events without a daemon: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let evs = json_lines(&o);
    assert!(
        evs.iter()
            .any(|e| e["verdict"] == "would-deny" && e["host"] == "denied.test")
            && evs
                .iter()
                .any(|e| e["verdict"] == "deny" && e["host"] == "denied.test"),
        "{evs:?}"
    );
    let db = env.config_path().with_file_name("state").join("events.db");
    let store = egress_agent::store::Store::open(&db).expect("reopen the store");
    assert_eq!(store.integrity_check().expect("integrity_check"), "ok");
}

/// A direct connection of an audit-policy container reaches the canary and is reported as a
/// would-deny (EVENT_FLAG_AUDIT) by the kernel.
#[test]
fn kernel_audit_direct_connections_are_reported() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = Env::new(&[]);
    reload(&env, &env.config_text(&watch_policy("audit")));
    env.start_ok(
        "kaud",
        &["--label", "egress.policy=watch"],
        &["sleep", "600"],
    );
    assert!(env.wait_enforced("kaud", 2));
    let before = env.canary.count();
    let out = env.exec_out(
        "kaud",
        "nc -w 2 198.18.0.1 9000 </dev/null && echo DIRECT-OK || echo DIRECT-FAIL",
    );
    assert!(
        out.contains("DIRECT-OK"),
        "audit must let the direct connection through: {out}"
    );
    assert!(env.canary.count() > before, "nothing arrived at the canary");
    wait_stored(
        &env,
        &["--policy", "watch", "--verdict", "would-deny"],
        |e| e["source"] == "kernel" && e["ip"] == "198.18.0.1" && e["port"] == 9000,
    );
}
