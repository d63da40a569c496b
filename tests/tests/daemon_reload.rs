//! The real daemon (`egress-agent run`) against a private dockerd (see `egress_tests::docker`):
//! configuration reload (SIGHUP, `egress-agent reload`, and a watched `policies.d` that is a
//! Kubernetes ConfigMap volume) and the control API's clients (`status --json`, `events`,
//! `reload`, `policy`). Root only.
//!
//! Addresses (all inside the test's own namespace and its 198.18.0.0/24 network):
//! `198.18.0.1:9000` the canary (counts what *arrived*), `198.18.0.10:8080` the upstream httpd
//! (`allowed.test` and `denied.test` in the agent's hosts file), `169.254.100.1:3128` the proxy.
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use egress_tests::docker::{Env, IMAGE, NETWORK, SERIAL, UPSTREAM_IP, proxied_get, require_root};
use nix::sys::signal::Signal;

const DIRECT: &str = "nc -w 2 198.18.0.1 9000 </dev/null && echo DIRECT-OK || echo DIRECT-FAIL";

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `web` with other host/port lists (allow_cidrs: the upstream, as in the default config).
fn web_policy(hosts: &[&str], ports: &[u16]) -> String {
    let hosts: Vec<String> = hosts.iter().map(|h| format!("{h:?}")).collect();
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    format!(
        "[policies.web]\nallow_hosts = [{}]\nallow_ports = [{}]\nallow_cidrs = [\"{UPSTREAM_IP}/32\"]\n\
         [policies.canary]\nallow_cidrs = [\"198.18.0.1/32\"]\n",
        hosts.join(", "),
        ports.join(", ")
    )
}

/// `egress-agent reload`; returns (success, stdout + stderr).
fn cli_reload(env: &Env) -> (bool, String) {
    let o = env.cli(&["reload"]);
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// The daemon's reload verdicts (applied, refused or unchanged) in its log `l`.
fn verdicts(l: &str) -> Vec<String> {
    l.lines()
        .filter(|x| {
            x.contains("configuration reloaded")
                || x.contains("configuration rejected")
                || x.contains("configuration unchanged")
        })
        .map(str::to_owned)
        .collect()
}

/// Do `act`, then wait for the daemon's reload verdict in its log; returns the new verdicts.
fn verdicts_after(env: &Env, what: &str, act: impl FnOnce()) -> Vec<String> {
    let before = verdicts(&env.log()).len();
    act();
    assert!(
        env.wait_log(|l| verdicts(l).len() > before, Duration::from_secs(15)),
        "no reload verdict after {what}:\n{}",
        env.log()
    );
    verdicts(&env.log()).split_off(before)
}

/// SIGHUP, then wait for the daemon's verdict in its log; returns the new verdict lines.
fn sighup(env: &Env) -> Vec<String> {
    verdicts_after(env, "SIGHUP", || env.signal_agent(Signal::SIGHUP))
}

/// The 1-based line of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .map(|i| i + 1)
        .unwrap_or_else(|| panic!("{needle:?} not in the config"))
}

/// The old policy (`web`: allowed.test:8080 only, no direct connections) still enforces on the
/// running container `name`: a direct bypass doesn't arrive, the allowed request passes, another
/// host is refused.
fn assert_web_enforced(env: &Env, name: &str, what: &str) {
    let before = env.canary.count();
    let out = env.exec_out(name, DIRECT);
    assert!(
        out.contains("DIRECT-FAIL") && !out.contains("DIRECT-OK"),
        "{what}: direct connection: {out}"
    );
    assert_eq!(
        env.canary.count(),
        before,
        "{what}: a direct connection arrived at the canary"
    );
    let out = env.exec_out(name, &proxied_get("allowed.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "{what}: allowed request through the proxy: {out}"
    );
    let out = env.exec_out(name, &proxied_get("denied.test", 8080));
    assert!(
        out.contains("403") && out.contains("host-not-allowed") && !out.contains("hello-upstream"),
        "{what}: denied.test must stay refused: {out}"
    );
}

/// A direct connection from container `name` to the canary succeeds and arrives.
fn assert_direct_arrives(env: &Env, name: &str, what: &str) {
    let before = env.canary.count();
    let out = env.exec_out(name, DIRECT);
    assert!(out.contains("DIRECT-OK"), "{what}: direct must pass: {out}");
    assert!(env.canary.count() > before, "{what}: nothing arrived");
}

#[test]
fn broken_config_is_refused_and_the_old_policy_stays() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = Env::new(&[]);
    env.run_labelled("keep", &["egress.policy=web", "egress.repo=org/keep"]);
    assert_web_enforced(&env, "keep", "before any reload");
    let path = env.config_path().display().to_string();

    // A syntax error (unterminated table header) and an unknown field, each via SIGHUP and via
    // `egress-agent reload`.
    let syntax = format!("{}[policies.broken\n", env.config_text(""));
    let unknown = env.config_text("").replace(
        "allow_ports = [8080]",
        "allow_ports = [8080]\nallow_hostz = [\"denied.test\"]",
    );
    assert!(unknown.contains("allow_hostz"));
    let cases = [
        (
            "syntax error",
            syntax.clone(),
            line_of(&syntax, "[policies.broken"),
            "unclosed table",
        ),
        (
            "unknown field",
            unknown.clone(),
            line_of(&unknown, "allow_hostz"),
            "allow_hostz",
        ),
    ];
    for (what, text, line, needle) in &cases {
        env.write_config(text);
        let located = format!("{path}:{line}:");

        let verdict = sighup(&env);
        assert!(
            verdict.len() == 1 && verdict[0].contains("configuration rejected"),
            "{what}: SIGHUP must be refused: {verdict:?}"
        );
        assert!(
            verdict[0].contains(&located),
            "{what}: the log must name {located}: {verdict:?}"
        );
        assert_web_enforced(&env, "keep", &format!("{what} after SIGHUP"));

        let (ok, out) = cli_reload(&env);
        assert!(!ok, "{what}: `egress-agent reload` must fail: {out}");
        assert!(
            out.contains(&located) && out.contains(needle),
            "{what}: `reload` must name the file and line ({located}) and {needle:?}: {out}"
        );
        assert_web_enforced(&env, "keep", &format!("{what} after `egress-agent reload`"));
    }

    // A valid file that changes a setting which needs a restart is refused whole too.
    std::fs::write(
        env.dir.join("hosts2"),
        format!("{UPSTREAM_IP} denied.test\n"),
    )
    .expect("hosts2");
    let dns = env.config_text("").replace(
        &env.dir.join("hosts").display().to_string(),
        &env.dir.join("hosts2").display().to_string(),
    );
    env.write_config(&dns);
    let (ok, out) = cli_reload(&env);
    assert!(
        !ok && out.contains("[dns]") && out.contains("restart"),
        "[dns] change: {out}"
    );
    assert_web_enforced(&env, "keep", "after a refused [dns] change");

    // The original file again: accepted, same behaviour.
    env.write_config(&env.config_text(""));
    let (ok, out) = cli_reload(&env);
    assert!(ok, "valid config refused: {out}");
    assert_web_enforced(&env, "keep", "after reloading the original file");

    // Refusals are counted, nothing else changed: the container is still listed with `web`.
    let containers = status_containers(&env);
    assert!(
        containers.iter().any(|c| c["owner"] == "docker:keep"
            && c["policy"] == "web"
            && c["mode"] == "allowlist"),
        "keep not listed with policy web: {containers:?}"
    );
}

/// `egress-agent status --json` → the kernel's view of the enforced cgroups.
fn status_containers(env: &Env) -> Vec<serde_json::Value> {
    let o = env.cli(&["status", "--json"]);
    assert!(
        o.status.success(),
        "status --json: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "status --json is not JSON ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    });
    v["kernel"]["cgroups"]
        .as_array()
        .unwrap_or_else(|| panic!("no kernel.cgroups in status: {v}"))
        .clone()
}

#[test]
fn reload_narrows_and_widens_running_containers() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = Env::new(&[]);
    env.run_labelled("rl", &["egress.policy=web"]);
    env.run_labelled("cn", &["egress.policy=canary"]);

    // Before: web = allowed.test:8080; canary = direct to 198.18.0.1.
    assert_web_enforced(&env, "rl", "initial");
    assert_direct_arrives(&env, "cn", "canary policy");

    // Widen (via `egress-agent reload`): denied.test becomes allowed for the running container.
    env.write_config(&env.config_text(&web_policy(&["allowed.test", "denied.test"], &[8080])));
    let (ok, out) = cli_reload(&env);
    assert!(ok, "widening reload refused: {out}");
    let out = env.exec_out("rl", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "widened: denied.test must now pass: {out}"
    );
    let out = env.exec_out("rl", &proxied_get("allowed.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "widened: allowed.test: {out}"
    );

    // Narrow by host (via SIGHUP): allowed.test removed → 403 for new connections.
    env.write_config(&env.config_text(&web_policy(&["denied.test"], &[8080])));
    let verdict = sighup(&env);
    assert!(
        verdict.iter().any(|l| l.contains("configuration reloaded")),
        "narrowing reload refused: {verdict:?}"
    );
    let out = env.exec_out("rl", &proxied_get("allowed.test", 8080));
    assert!(
        out.contains("403") && out.contains("host-not-allowed") && !out.contains("hello-upstream"),
        "narrowed: allowed.test must be refused now: {out}"
    );
    let out = env.exec_out("rl", &proxied_get("denied.test", 8080));
    assert!(
        out.contains("hello-upstream"),
        "narrowed: denied.test still allowed: {out}"
    );

    // Narrow by port: allowed.test back, but only on 443 → 8080 is port-not-allowed.
    env.write_config(&env.config_text(&web_policy(&["allowed.test"], &[443])));
    let (ok, out) = cli_reload(&env);
    assert!(ok, "port reload refused: {out}");
    let out = env.exec_out("rl", &proxied_get("allowed.test", 8080));
    assert!(
        out.contains("403") && out.contains("port-not-allowed") && !out.contains("hello-upstream"),
        "allow_ports narrowed: {out}"
    );

    // Kernel side: the canary policy loses its allow_cidrs entry → direct connections of the
    // running container stop arriving; widening it again lets them through (kernel and nft).
    let narrowed = web_policy(&["allowed.test"], &[8080]).replace(
        "allow_cidrs = [\"198.18.0.1/32\"]",
        "allow_cidrs = [\"198.18.0.99/32\"]",
    );
    assert!(narrowed.contains("198.18.0.99/32"));
    env.write_config(&env.config_text(&narrowed));
    let (ok, out) = cli_reload(&env);
    assert!(ok, "cidr reload refused: {out}");
    let before = env.canary.count();
    let out = env.exec_out("cn", DIRECT);
    assert!(
        out.contains("DIRECT-FAIL") && !out.contains("DIRECT-OK"),
        "allow_cidrs narrowed: direct must fail: {out}"
    );
    assert_eq!(
        env.canary.count(),
        before,
        "allow_cidrs narrowed: a connection arrived"
    );
    // And web is back to the original: allowed.test:8080 passes again.
    assert_web_enforced(&env, "rl", "web restored");

    env.write_config(&env.config_text(""));
    let (ok, out) = cli_reload(&env);
    assert!(ok, "restoring reload refused: {out}");
    assert_direct_arrives(&env, "cn", "allow_cidrs widened again");

    // Still one listener per opted-in container (same-name policies are swapped in place).
    assert_eq!(
        env.listener_ports().len(),
        2 * Env::TCP_SOCKETS_PER_CONTAINER,
        "listeners: {:?}",
        env.listener_ports()
    );
}

#[test]
fn control_api_is_root_only_and_reports_containers_and_events() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = Env::new(&[]);

    // The socket: root's, mode 0600; a non-root client can't even connect.
    let meta = std::fs::metadata(env.api_socket()).expect("api socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "api socket mode");
    assert_eq!(meta.uid(), 0, "api socket owner");
    let o = std::process::Command::new(egress_tests::agent::agent_bin())
        .args(["events", "-n", "1", "--api-socket"])
        .arg(env.api_socket())
        .uid(65534)
        .gid(65534)
        .output()
        .expect("run the CLI as nobody");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("Permission denied"),
        "a non-root client reached the control API: {}{err}",
        String::from_utf8_lossy(&o.stdout)
    );

    // A labelled container with context labels: a direct attempt is denied by the kernel.
    env.run_labelled(
        "ctx-1",
        &[
            "egress.policy=web",
            "egress.repo=org/ctx",
            "egress.run=42",
            "egress.agent=runner-3",
        ],
    );
    let before = env.canary.count();
    let out = env.exec_out("ctx-1", DIRECT);
    assert!(out.contains("DIRECT-FAIL"), "{out}");
    assert_eq!(env.canary.count(), before);

    // status --json: the container's cgroup with its policy.
    let containers = status_containers(&env);
    let cg = containers
        .iter()
        .find(|c| c["owner"] == "docker:ctx-1")
        .unwrap_or_else(|| panic!("ctx-1 not in status: {containers:?}"));
    assert_eq!(cg["policy"], "web", "{cg}");
    assert_eq!(cg["mode"], "allowlist", "{cg}");
    assert!(
        cg["path"]
            .as_str()
            .is_some_and(|p| p.contains(&env.d.cgroup_parent)),
        "{cg}"
    );
    assert!(
        cg["denied"].as_u64().is_some_and(|n| n >= 1),
        "denied counter: {cg}"
    );

    // events: the kernel denial with container name, policy and context labels.
    let want = |e: &serde_json::Value| {
        e["source"] == "kernel"
            && e["container"]["name"] == "ctx-1"
            && e["policy"] == "web"
            && e["port"] == 9000
            && e["context"]["repo"] == "org/ctx"
            && e["context"]["run"] == "42"
            && e["context"]["agent"] == "runner-3"
            && e["context"]["hook"].is_string()
    };
    assert!(
        env.wait_event(want, Duration::from_secs(5)),
        "no kernel denial event with container and context from `egress-agent events`: {:?}",
        env.events()
    );
    // The same event as the daemon's JSON log line: context labels included.
    let logged = env.log().lines().any(|l| {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
            return false;
        };
        let ctx: serde_json::Value = v["context"]
            .as_str()
            .and_then(|c| serde_json::from_str(c).ok())
            .unwrap_or_default();
        v["message"] == "denied"
            && v["container_name"] == "ctx-1"
            && v["policy"] == "web"
            && ctx["repo"] == "org/ctx"
            && ctx["agent"] == "runner-3"
    });
    assert!(
        logged,
        "no denial log line with container and context:\n{}",
        env.log()
    );

    // `check --container`: the policy this running container gets, and why.
    let o = std::process::Command::new(egress_tests::agent::agent_bin())
        .args(["check", "--config"])
        .arg(env.config_path())
        .args(["--container", "ctx-1", "--docker-socket", &env.d.host])
        .output()
        .expect("run egress-agent check --container");
    assert!(
        o.status.success(),
        "check --container: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("check json");
    assert_eq!(v["policy"], "web", "{v}");
    assert_eq!(v["why"], "egress.policy label", "{v}");
    assert_eq!(v["container"]["name"], "ctx-1", "{v}");
    assert_eq!(v["context"]["repo"], "org/ctx", "{v}");
    assert_eq!(v["effective"]["mode"], "allowlist", "{v}");

    // Invalid labels: an agent lifecycle event, with the context labels.
    let o = env.d.docker(&[
        "run",
        "--rm",
        "--name",
        "bad-ctx",
        "--network",
        NETWORK,
        "--label",
        "egress.policy=nope",
        "--label",
        "egress.run=43",
        IMAGE,
        "true",
    ]);
    assert!(o.status.success(), "{o:?}");
    assert!(
        env.wait_event(
            |e| e["source"] == "agent"
                && e["container"]["name"] == "bad-ctx"
                && e["policy"] == "deny_all"
                && e["context"]["run"] == "43"
                && e["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("labels-invalid")),
            Duration::from_secs(5)
        ),
        "no agent event for invalid labels: {:?}",
        env.events()
    );
}

/// A read-only bind mount of `src` at `at`: a ConfigMap volume as the pod sees it (the kubelet
/// writes `src`, the host side). Unmounted on drop.
struct ReadOnlyBind(PathBuf);

impl ReadOnlyBind {
    fn new(src: &Path, at: &Path) -> ReadOnlyBind {
        use nix::mount::{MsFlags, mount};
        std::fs::create_dir_all(at).expect("mount point");
        mount(Some(src), at, None::<&str>, MsFlags::MS_BIND, None::<&str>).expect("bind mount");
        let guard = ReadOnlyBind(at.to_owned());
        mount(
            None::<&str>,
            at,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .expect("remount read-only");
        guard
    }
}

impl Drop for ReadOnlyBind {
    fn drop(&mut self) {
        nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH).ok();
    }
}

/// `policies.d` is a ConfigMap volume (the kubelet's `..data` layout, its root 0777, mounted
/// read-only): its policy applies at start; the kubelet's update is watched and applied
/// without a signal; a broken update (syntax error, unknown field) is refused with
/// file:line and field in the log and the old policy keeps enforcing; API writes are refused
/// naming the ConfigMap, and change nothing.
#[test]
fn configmap_policies_are_watched_and_read_only() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let mut env = Env::new(&[]);
    env.kill_agent();
    let volume = env.dir.join("configmap-volume");
    let cm = |hosts: &str| {
        format!(
            "allow_hosts = [\"{hosts}\"]\nallow_ports = [8080]\nallow_cidrs = [\"{UPSTREAM_IP}/32\"]\n"
        )
    };
    let mut version = 0;
    let mut kubelet = |text: &str| {
        version += 1;
        egress_agent::config::kubelet::update(
            &volume,
            &format!("2026_12_03_07_00_00.{version:09}"),
            &[("cm.toml", text)],
        )
        .expect("the kubelet's update");
    };
    kubelet(&cm("allowed.test"));
    std::fs::set_permissions(&volume, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let policies = env.dir.join("policies.d");
    // Declared after `env`: unmounted before the agent's directory is removed.
    let _mount = ReadOnlyBind::new(&volume, &policies);
    env.start_agent();
    assert!(
        env.log().contains("watching the policies directory"),
        "{}",
        env.log()
    );

    // The ConfigMap's policy, read through ..data at start.
    env.run_labelled("cmc", &["egress.policy=cm"]);
    let allowed = |what: &str, host: &str| {
        let out = env.exec_out("cmc", &proxied_get(host, 8080));
        assert!(
            out.contains("hello-upstream"),
            "{what}: {host} must pass: {out}"
        );
    };
    let refused = |what: &str, host: &str| {
        let out = env.exec_out("cmc", &proxied_get(host, 8080));
        assert!(
            out.contains("403")
                && out.contains("host-not-allowed")
                && !out.contains("hello-upstream"),
            "{what}: {host} must be refused: {out}"
        );
    };
    allowed("at start", "allowed.test");
    refused("at start", "denied.test");

    // A good update: applied without a signal, the running container follows.
    let v = verdicts_after(&env, "the kubelet's update", || kubelet(&cm("denied.test")));
    assert!(
        v.len() == 1 && v[0].contains("configuration reloaded") && v[0].contains("policies.d"),
        "{v:?}"
    );
    allowed("after the update", "denied.test");
    refused("after the update", "allowed.test");
    let o = env.cli(&["policy", "show", "cm", "--json"]);
    let shown = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && shown.contains("denied.test"),
        "{shown}"
    );

    // Broken updates: refused, located in the ConfigMap's file, the updated policy stays.
    let file = policies.join("cm.toml").display().to_string();
    let syntax = format!("{}[broken\n", cm("allowed.test"));
    let unknown = format!("{}allow_hostz = [\"allowed.test\"]\n", cm("allowed.test"));
    for (what, text, line, needle) in [
        (
            "syntax error",
            &syntax,
            line_of(&syntax, "[broken"),
            "cm.toml",
        ),
        (
            "unknown field",
            &unknown,
            line_of(&unknown, "allow_hostz"),
            "policies.cm.allow_hostz",
        ),
    ] {
        let v = verdicts_after(&env, what, || kubelet(text));
        let located = format!("{file}:{line}:");
        assert!(
            v.len() == 1 && v[0].contains("configuration rejected"),
            "{what}: the update must be refused: {v:?}"
        );
        assert!(
            v[0].contains(&located) && v[0].contains(needle),
            "{what}: the log must name {located} and {needle:?}: {v:?}"
        );
        allowed(what, "denied.test");
        refused(what, "allowed.test");
    }

    // The API can't write there: refused with the reason and the fix; nothing changed.
    let before = std::fs::read_to_string(policies.join("cm.toml")).expect("cm.toml");
    let body = env.dir.join("new-cm.toml");
    std::fs::write(&body, cm("allowed.test")).expect("body");
    let body = body.display().to_string();
    for args in [
        vec!["policy", "set", "cm", body.as_str()],
        vec!["policy", "set", "other", body.as_str()],
        vec!["policy", "delete", "cm", "--force"],
    ] {
        let o = env.cli(&args);
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            !o.status.success()
                && out.contains("managed by Kubernetes")
                && out.contains("edit the ConfigMap"),
            "{args:?}: {out}"
        );
        assert!(!out.contains("Read-only file system"), "{args:?}: {out}");
    }
    assert_eq!(
        std::fs::read_to_string(policies.join("cm.toml")).expect("cm.toml"),
        before
    );
    assert!(!policies.join("other.toml").exists());
    allowed("after the refused writes", "denied.test");
    refused("after the refused writes", "allowed.test");
}

/// Failures stay local (#40 item 3): the daemon starts with one credential binding whose secret
/// file is missing. It serves: the other policies (one with a binding of its own), the same
/// policy's pass-through host; the bound host is refused (`502 X-Egress-Error:
/// interception-unavailable` to a `CONNECT`, nothing to the upstream, transparent included) with
/// an event; `status` (JSON and text) and `doctor` name the policy, the binding and the file, never
/// a secret. Once the file is written, `egress-agent reload` brings the binding back: the
/// upstream gets the secret.
#[test]
fn a_binding_without_its_secret_fails_alone_until_reload() {
    use egress_tests::tls_upstream::{TestCa, Upstream};
    if !require_root() {
        return;
    }
    let _g = lock();
    const SECRET: &str = "sk-late-Qw7Zx1-arrives-after-start";
    const GOOD: &str = "sk-good-Lm3Pq8-loads-at-start";
    const PH: &str = "egress-ph-isolation-0001";
    let mut env = Env::new(&[Path::new("/usr/bin/curl")]);
    let ca = TestCa::new();
    let up = Upstream::start_in(
        &ca,
        &["api.test", "pass.test", "good.test"],
        "198.18.0.1:8443".parse().expect("address"),
        &env.d.netns.path(),
    );
    let dir = env.dir.clone();
    let d = dir.display().to_string();
    std::fs::write(dir.join("upstream-ca.pem"), &ca.pem).expect("upstream CA");
    let missing = dir.join("secret-late");
    std::fs::remove_file(&missing).ok();
    std::fs::write(dir.join("secret-good"), GOOD).expect("secret");
    let hosts = std::fs::read_to_string(dir.join("hosts")).expect("hosts");
    std::fs::write(
        dir.join("hosts"),
        format!("{hosts}198.18.0.1 api.test pass.test good.test\n"),
    )
    .expect("hosts");
    let policies = format!(
        r#"[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"

{web}
[policies.agent]
allow_hosts = ["api.test", "pass.test"]
allow_ports = [8443]
resolve_private = ["198.18.0.1/32"]
[[policies.agent.credentials]]
host = "api.test"
port = 8443
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/secret-late" }}
placeholder = "{PH}"

[policies.good]
allow_hosts = ["good.test"]
allow_ports = [8443]
resolve_private = ["198.18.0.1/32"]
[[policies.good.credentials]]
host = "good.test"
port = 8443
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/secret-good" }}
placeholder = "{PH}"
"#,
        web = web_policy(&["allowed.test"], &[8080]),
    );
    env.write_config(&env.config_text(&policies));
    // `[intercept]` takes a restart; the start must not be refused for the missing file.
    env.kill_agent();
    env.start_agent();

    // status names the binding and why (JSON and text), never a secret.
    let o = env.cli(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status json");
    let un = v["interception"]["unavailable_bindings"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(un.len(), 1, "{v}");
    assert_eq!(
        (
            un[0]["policy"].as_str(),
            un[0]["binding"].as_u64(),
            un[0]["host"].as_str()
        ),
        (Some("agent"), Some(0), Some("api.test")),
        "{v}"
    );
    assert_eq!(
        un[0]["field"], "policies.agent.credentials[0].source",
        "{v}"
    );
    let err = un[0]["error"].as_str().unwrap_or_default();
    assert!(
        err.starts_with("can't read secret file") && err.contains(&missing.display().to_string()),
        "{v}"
    );
    assert!(v["interception"]["setup_error"].is_null(), "{v}");
    assert!(!v.to_string().contains(GOOD), "a secret in the status: {v}");
    let text = String::from_utf8_lossy(&env.cli(&["status"]).stdout).into_owned();
    assert!(
        text.contains(
            "credential binding unavailable: policy agent, binding 0 (api.test:8443, file "
        ) && text.contains("refused (interception-unavailable)"),
        "{text}"
    );
    let o = env.cli(&[
        "doctor",
        "--json",
        "--config",
        &env.config_path().display().to_string(),
    ]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("doctor json");
    let probe = doc
        .as_array()
        .and_then(|a| a.iter().find(|p| p["id"] == "proxy.interception"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(probe["status"], "fail", "{probe}");
    let summary = probe["summary"].as_str().unwrap_or_default();
    assert!(
        summary.contains("(the running daemon)") && summary.contains("policy agent, binding 0"),
        "{probe}"
    );

    let mounts = [
        "-v",
        &format!("{d}/state/ca-bundle.pem:/etc/ssl/certs/ca-certificates.crt:ro"),
        "-e",
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
        "-v",
        &format!("{d}/upstream-ca.pem:/upstream-ca.pem:ro"),
        "-e",
        "HTTPS_PROXY=http://169.254.100.1:3128",
    ]
    .map(str::to_owned);
    let run = |policy: &str, script: &str| {
        let mut args: Vec<String> = vec!["--label".into(), format!("egress.policy={policy}")];
        args.extend(mounts.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        env.run_out(&args, script)
    };
    let out = run(
        "agent",
        &format!(
            r#"C="curl -sS --max-time 15"
echo "== bound"; $C -H "Authorization: Bearer {PH}" https://api.test:8443/v1/bound; echo "rc=$?"
echo "== connect"; printf 'CONNECT api.test:8443 HTTP/1.1\r\nHost: api.test:8443\r\n\r\n' | nc -w 5 169.254.100.1 3128
echo "== t-bound"; $C --noproxy '*' -H "Authorization: Bearer {PH}" https://api.test:8443/v1/t-bound; echo "rc=$?"
echo "== pass"; $C --cacert /upstream-ca.pem https://pass.test:8443/v1/pass"#
        ),
    );
    assert!(
        out.contains("== connect\nHTTP/1.1 502 ")
            && out.contains("X-Egress-Error: interception-unavailable"),
        "{out}\n{}",
        env.log()
    );
    assert!(
        out.contains("upstream-ok HTTP/2.0 /v1/pass"),
        "{out}\n{}",
        env.log()
    );
    assert!(
        up.requests().iter().all(|r| !r.target.contains("bound")),
        "an unavailable binding's request reached the upstream: {:?}",
        up.requests()
    );
    assert!(
        env.wait_event(
            |e| e["reason"] == "interception-unavailable"
                && e["policy"] == "agent"
                && e["host"] == "api.test",
            Duration::from_secs(10)
        ),
        "no interception-unavailable event"
    );
    // Another policy with a binding of its own keeps injecting.
    let out = run(
        "good",
        &format!(
            "curl -sS --max-time 15 -H 'Authorization: Bearer {PH}' https://good.test:8443/v1/good"
        ),
    );
    assert!(out.contains("upstream-ok"), "{out}\n{}", env.log());
    let r = up.request("/v1/good").expect("/v1/good arrived");
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {GOOD}").as_str())
    );
    // And a policy without bindings is unaffected (curl: its SYN is retried if the container's
    // first packets beat its host-layer rules, see `Env::wait_host_layer`).
    let out = run("web", "curl -sS --max-time 15 http://allowed.test:8080/");
    assert!(out.contains("hello-upstream"), "{out}");

    // The secret appears; a reload restores the binding.
    std::fs::write(&missing, format!("{SECRET}\n")).expect("secret");
    let (ok, said) = cli_reload(&env);
    assert!(ok, "{said}");
    let v: serde_json::Value =
        serde_json::from_slice(&env.cli(&["status", "--json"]).stdout).expect("status json");
    assert_eq!(
        v["interception"]["unavailable_bindings"],
        serde_json::json!([]),
        "{v}"
    );
    assert!(
        env.log().contains("credential binding restored"),
        "{}",
        env.log()
    );
    let out = run(
        "agent",
        &format!(
            "curl -sS --max-time 15 -H 'Authorization: Bearer {PH}' https://api.test:8443/v1/restored"
        ),
    );
    assert!(out.contains("upstream-ok"), "{out}\n{}", env.log());
    let r = up.request("/v1/restored").expect("/v1/restored arrived");
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str())
    );
    assert!(
        !env.log().contains(SECRET) && !env.log().contains(GOOD),
        "a secret in the log"
    );
}
