//! Credential injection under `egress-agent exec` (issue #12, items 5 and 6).
//!
//! Real clients (curl h1/h2, Debian's python3 `urllib`, node h1/h2) run under `exec --policy P`
//! with nothing but what `exec` gives them: `HTTPS_PROXY`, the agent's CA and client bundle in
//! the command's private `/run` (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `NODE_EXTRA_CA_CERTS`)
//! and the placeholders the policy's bindings name. They call a TLS upstream this test controls
//! (its own CA; on loopback, reached by name through `resolve_private`, so only through the
//! proxy). The upstream must see the real secrets; the command must never hold them: not in its
//! environment (`/proc/<pid>/environ` of every process of the command, read from outside while
//! it runs), not in its files (its `/run`, the hidden `agent.state_dir`), not in anything it
//! printed. The placeholder sent to another host is refused and never reaches it.
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_tests::agent::{ReadyOutput, TestConfig, agent_bin, exec_root};
use egress_tests::root_or_skip;
use egress_tests::tls_upstream::{TestCa, Upstream};
use egress_tests::upstreams::TempDir;

/// The real secrets: a file in the (hidden) state directory, and an environment variable of the
/// agent (scrubbed before the command starts).
const SECRET_FILE: &str = "sk-file-Hq4T9vWm2Lp8-never-inside";
const SECRET_ENV: &str = "sk-env-Zx7R3nKc5Yb1-never-inside";
const PH: &str = "egress-ph-api-51c0ffee";
const PH_ENV: &str = "egress-ph-env-a11ce";

/// The test's files (removed on drop: [`TempDir`]).
fn setup(up: &Upstream, ca: &TestCa) -> (TempDir, TestConfig) {
    let guard = TempDir::new("exec-intercept");
    let dir = guard.path().to_owned();
    let state = dir.join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let secret = state.join("secret");
    std::fs::write(&secret, format!("{SECRET_FILE}\n")).expect("secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::write(
        dir.join("hosts"),
        "127.0.0.1 api.test\n127.0.0.1 env.test\n127.0.0.1 other.test\n127.0.0.1 pass.test\n",
    )
    .expect("hosts");
    std::fs::write(dir.join("upstream-ca.pem"), &ca.pem).expect("upstream CA");
    let client_js = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../egress-agent/tests/intercept_support/client.js"
    );
    std::fs::copy(client_js, dir.join("client.js")).expect("client.js");
    std::fs::write(
        dir.join("client.py"),
        "import os, sys, urllib.request\n\
         req = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + os.environ['API_KEY']})\n\
         print(urllib.request.urlopen(req, timeout=10).read().decode(), end='')\n",
    )
    .expect("client.py");
    for f in ["client.js", "client.py", "hosts", "upstream-ca.pem"] {
        std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o644)).ok();
    }
    let p = up.port();
    let d = dir.display();
    let cfg = TestConfig::new(&format!(
        r#"connect_timeout_ms = 3000
[agent]
state_dir = "{d}/state"
[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"
[dns]
nameservers = []
hosts_file = "{d}/hosts"

[policies.agent]
# pass.test: no binding, no rule, so never intercepted.
allow_hosts = ["api.test", "env.test", "other.test", "pass.test"]
allow_ports = [{p}]
resolve_private = ["127.0.0.0/8"]

[[policies.agent.credentials]]
host = "api.test"
port = {p}
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/state/secret" }}
placeholder = "{PH}"
placeholder_env = "API_KEY"
require = true

[[policies.agent.credentials]]
host = "env.test"
port = {p}
header = "x-api-key"
source = {{ env = "EGRESS_TEST_SECRET_ENV" }}
placeholder = "{PH_ENV}"
placeholder_env = "ENV_KEY"

# other.test is intercepted (rules), so a placeholder sent there is seen and refused.
[[policies.agent.request_rules]]
host = "other.test"
port = {p}
action = "allow"
path = "/**"

[policies.plain]
allow_hosts = ["api.test"]
allow_ports = [{p}]
resolve_private = ["127.0.0.0/8"]
"#
    ));
    (guard, cfg)
}

fn has(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// The pids in the exec cgroup of the `exec` process `exec_pid` (host pid namespace).
fn command_pids(exec_pid: u32) -> Vec<u32> {
    let prefix = format!("exec-{exec_pid}-");
    let mut out = Vec::new();
    for e in std::fs::read_dir(exec_root()).expect("exec root").flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let procs = std::fs::read_to_string(e.path().join("cgroup.procs")).unwrap_or_default();
            out.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
    out
}

/// Run `script` under `exec --policy agent`, stopping at its `READY` line to inspect the running
/// command from outside; returns (everything printed, what was seen at READY).
struct Inspected {
    printed: Vec<u8>,
    environs: Vec<(u32, Vec<u8>)>,
    run_ca: Vec<u8>,
    run_bundle: Vec<u8>,
    agent_environ: Vec<u8>,
    code: Option<i32>,
}

fn run_inspected(cfg: &TestConfig, user: Option<&str>, script: &str) -> Inspected {
    let mut cmd = Command::new(agent_bin());
    cmd.arg("exec");
    if let Some(u) = user {
        cmd.args(["--user", u]);
    }
    let mut child = cmd
        .args(["--policy", "agent", "--config"])
        .arg(&cfg.path)
        .args(["--", "sh", "-c", script])
        .env("EGRESS_TEST_SECRET_ENV", SECRET_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn exec");
    let exec_pid = child.id();
    let output = ReadyOutput::read(&mut child, Duration::from_secs(120));
    let ready = output.ready;
    let mut environs = Vec::new();
    let (mut run_ca, mut run_bundle) = (Vec::new(), Vec::new());
    if ready {
        let pids = command_pids(exec_pid);
        assert!(!pids.is_empty(), "no process in the command's cgroup");
        for pid in &pids {
            if let Ok(e) = std::fs::read(format!("/proc/{pid}/environ")) {
                environs.push((*pid, e));
            }
        }
        // The command's own view of /run (its mount namespace), read through /proc/<pid>/root.
        let root = format!("/proc/{}/root/run", pids[0]);
        run_ca = std::fs::read(format!("{root}/egress-agent-ca.pem")).unwrap_or_default();
        run_bundle =
            std::fs::read(format!("{root}/egress-agent-ca-bundle.pem")).unwrap_or_default();
    }
    let agent_environ = std::fs::read(format!("/proc/{exec_pid}/environ")).unwrap_or_default();
    child.stdin.take().expect("stdin").write_all(b"\n").ok();
    let (mut printed, errors) = output.finish();
    let status = child.wait().expect("wait exec");
    printed.extend(errors);
    assert!(
        ready,
        "the command never got to READY:\n{}",
        String::from_utf8_lossy(&printed)
    );
    Inspected {
        printed,
        environs,
        run_ca,
        run_bundle,
        agent_environ,
        code: status.code(),
    }
}

fn section<'a>(text: &'a str, name: &str) -> &'a str {
    let start = format!("== {name}\n");
    let i = text
        .find(&start)
        .unwrap_or_else(|| panic!("no section {name} in:\n{text}"))
        + start.len();
    let rest = &text[i..];
    &rest[..rest.find("\n== ").map_or(rest.len(), |j| j + 1)]
}

#[test]
fn real_clients_get_the_secret_injected_and_never_hold_it() {
    if !root_or_skip("exec interception") {
        return;
    }
    let ca = TestCa::new();
    let up = Upstream::start(
        &ca,
        &["api.test", "env.test", "other.test", "pass.test"],
        "127.0.0.1:0".parse().expect("test value"),
    );
    let (dir, cfg) = setup(&up, &ca);
    let p = up.port();
    let d = dir.0.display();
    let curl = "curl -sS --max-time 15";
    let script = format!(
        r#"echo "== curl-h1"; {curl} --http1.1 -H "Authorization: Bearer $API_KEY" https://api.test:{p}/v1/curl-h1
echo "== curl-h2"; {curl} --http2 -H "Authorization: Bearer $API_KEY" https://api.test:{p}/v1/curl-h2
echo "== python"; /usr/bin/python3 {d}/client.py https://api.test:{p}/v1/python
echo "== node-h1"; node {d}/client.js h1 GET https://api.test:{p}/v1/node-h1 "authorization=Bearer $API_KEY"
echo "== node-h2"; node {d}/client.js h2 GET https://api.test:{p}/v1/node-h2 "authorization=Bearer $API_KEY"
echo "== env-binding"; {curl} -H "x-api-key: $ENV_KEY" https://env.test:{p}/v1/env
echo "== wrong-host"; {curl} -o /dev/null -D - -H "Authorization: Bearer $API_KEY" https://other.test:{p}/leak
echo "== pass-own-ca"; {curl} -v --cacert {d}/upstream-ca.pem -H "x-pass: sent-by-the-client" https://pass.test:{p}/v1/pass-curl 2>&1
echo "== pass-agent-bundle"; {curl} https://pass.test:{p}/v1/pass-bundle 2>&1; echo "bundle-rc=$?"
echo "== pass-python"; /usr/bin/python3 -c 'import ssl, sys, urllib.request as u; c = ssl.create_default_context(cafile=sys.argv[2]); print(u.urlopen(sys.argv[1], context=c, timeout=10).read().decode())' https://pass.test:{p}/v1/pass-python {d}/upstream-ca.pem
echo "== direct"; {curl} --noproxy '*' -k https://127.0.0.1:{p}/direct; echo "direct-rc=$?"
echo "== t-curl-h1"; {curl} --noproxy '*' --http1.1 -H "Authorization: Bearer $API_KEY" https://api.test:{p}/v1/t-curl-h1
echo "== t-curl-h2"; {curl} --noproxy '*' --http2 -H "Authorization: Bearer $API_KEY" https://api.test:{p}/v1/t-curl-h2
echo "== t-python"; env -u HTTPS_PROXY -u https_proxy -u HTTP_PROXY -u http_proxy /usr/bin/python3 {d}/client.py https://api.test:{p}/v1/t-python
echo "== t-node-h2"; env -u HTTPS_PROXY EGRESS_TEST_CONNECT_TO=127.0.0.1:{p} node {d}/client.js h2 GET https://api.test:{p}/v1/t-node-h2 "authorization=Bearer $API_KEY"
echo "== t-wrong-host"; {curl} --noproxy '*' -o /dev/null -D - -H "Authorization: Bearer $API_KEY" https://other.test:{p}/t-leak
echo "== t-no-placeholder"; {curl} --noproxy '*' -o /dev/null -D - https://api.test:{p}/v1/t-bare
echo "== reflect"; {curl} -H "Authorization: Bearer $API_KEY" https://api.test:{p}/reflect/proxy
echo "== t-reflect"; {curl} --noproxy '*' -H "Authorization: Bearer $API_KEY" https://api.test:{p}/reflect/transparent
echo "== state"; ls -A {d}/state; cat {d}/state/secret 2>/dev/null || echo STATE-UNREADABLE
echo "== env"; env | sort
echo READY; read x
"#
    );
    let got = run_inspected(&cfg, None, &script);
    let text = String::from_utf8_lossy(&got.printed).into_owned();
    assert_eq!(got.code, Some(0), "{text}");

    // Every client got the upstream's answer over the protocol it asked for.
    for (name, want) in [
        ("curl-h1", "upstream-ok HTTP/1.1 /v1/curl-h1"),
        ("curl-h2", "upstream-ok HTTP/2.0 /v1/curl-h2"),
        ("python", "upstream-ok HTTP/1.1 /v1/python"),
        ("node-h1", "upstream-ok HTTP/1.1 /v1/node-h1"),
        ("node-h2", "upstream-ok HTTP/2.0 /v1/node-h2"),
        ("env-binding", "/v1/env"),
        // The same clients with no proxy variables: the kernel redirects them to the transparent
        // listener, which intercepts the bound host exactly like a CONNECT to it.
        ("t-curl-h1", "upstream-ok HTTP/1.1 /v1/t-curl-h1"),
        ("t-curl-h2", "upstream-ok HTTP/2.0 /v1/t-curl-h2"),
        ("t-python", "upstream-ok HTTP/1.1 /v1/t-python"),
        ("t-node-h2", "upstream-ok HTTP/2.0 /v1/t-node-h2"),
    ] {
        assert!(section(&text, name).contains(want), "{name}:\n{text}");
    }
    // ... and the upstream saw the real secrets, never a placeholder.
    for path in [
        "/v1/curl-h1",
        "/v1/curl-h2",
        "/v1/python",
        "/v1/node-h1",
        "/v1/node-h2",
        "/v1/t-curl-h1",
        "/v1/t-curl-h2",
        "/v1/t-python",
        "/v1/t-node-h2",
        "/reflect/proxy",
        "/reflect/transparent",
    ] {
        let r = up
            .request(path)
            .unwrap_or_else(|| panic!("upstream never got {path}"));
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {SECRET_FILE}").as_str()),
            "{path}: {r:?}"
        );
    }
    assert_eq!(
        up.request("/v1/curl-h2").map(|r| r.version),
        Some("HTTP/2.0".to_owned())
    );
    let r = up.request("/v1/env").expect("env binding request");
    assert_eq!(r.header("x-api-key"), Some(SECRET_ENV), "{r:?}");
    for r in up
        .requests()
        .into_iter()
        .filter(|r| !r.target.starts_with("/v1/pass"))
    {
        let t = r.text();
        assert!(
            !t.contains(PH) && !t.contains(PH_ENV),
            "placeholder upstream: {t}"
        );
    }

    // The placeholder sent to another (intercepted, allowed) host: refused, never forwarded.
    let wrong = section(&text, "wrong-host").to_ascii_lowercase();
    assert!(
        wrong.contains(" 403") && wrong.contains("placeholder-wrong-host"),
        "wrong host: {wrong}"
    );
    assert!(
        up.request("/leak").is_none(),
        "the placeholder reached other.test"
    );
    // The same without the proxy variables; and `require = true` holds there too.
    let wrong = section(&text, "t-wrong-host").to_ascii_lowercase();
    assert!(
        wrong.contains(" 403") && wrong.contains("placeholder-wrong-host"),
        "wrong host, transparent: {wrong}"
    );
    assert!(
        up.request("/t-leak").is_none(),
        "the placeholder reached other.test"
    );
    let bare = section(&text, "t-no-placeholder").to_ascii_lowercase();
    assert!(
        bare.contains(" 403") && bare.contains("credential-placeholder-missing"),
        "no placeholder, transparent: {bare}"
    );
    assert!(up.request("/v1/t-bare").is_none(), "{bare}");
    // An upstream that echoes the injected header (raw and hex): the command sees the
    // placeholder where the secret was, on both ways in.
    let ph_hex: String = format!("Bearer {PH}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    for name in ["reflect", "t-reflect"] {
        let r = section(&text, name);
        assert!(
            r.contains(&format!("auth=[Bearer {PH}]")) && r.contains(&ph_hex),
            "{name}: {r}"
        );
    }
    // A host without a binding or rule is passed through, TLS and all: the client verifies the
    // upstream's own certificate (issued by the test's CA, not the agent's), the agent's bundle
    // does not verify it, and what the client sent arrives untouched (the proxy never saw it).
    let pass = section(&text, "pass-own-ca");
    assert!(
        pass.contains("issuer: CN=egress-tests upstream CA")
            && pass.contains("upstream-ok HTTP/2.0 /v1/pass-curl"),
        "pass-through host: {pass}"
    );
    let r = up.request("/v1/pass-curl").expect("pass-through request");
    assert_eq!(r.header("x-pass"), Some("sent-by-the-client"), "{r:?}");
    let bundle = section(&text, "pass-agent-bundle");
    assert!(
        bundle.contains("bundle-rc=60") && up.request("/v1/pass-bundle").is_none(),
        "the agent's bundle verified the upstream's own certificate: {bundle}"
    );
    assert!(
        section(&text, "pass-python").contains("upstream-ok HTTP/1.1 /v1/pass-python"),
        "python through the pass-through host:\n{text}"
    );
    assert!(up.request("/v1/pass-python").is_some());
    // Loopback is reachable by name through the proxy only: the kernel refuses it directly.
    assert!(
        !section(&text, "direct").contains("direct-rc=0") && up.request("/direct").is_none(),
        "direct to the upstream: {}",
        section(&text, "direct")
    );

    // What exec set for the command (and only placeholders).
    let env = section(&text, "env");
    for want in [
        "SSL_CERT_FILE=/run/egress-agent-ca-bundle.pem".to_owned(),
        "REQUESTS_CA_BUNDLE=/run/egress-agent-ca-bundle.pem".to_owned(),
        "CURL_CA_BUNDLE=/run/egress-agent-ca-bundle.pem".to_owned(),
        "NODE_EXTRA_CA_CERTS=/run/egress-agent-ca-extra.pem".to_owned(),
        "PIP_CERT=/run/egress-agent-ca-bundle.pem".to_owned(),
        "NPM_CONFIG_CAFILE=/run/egress-agent-ca-bundle.pem".to_owned(),
        "GIT_SSL_CAINFO=/run/egress-agent-ca-bundle.pem".to_owned(),
        "CARGO_HTTP_CAINFO=/run/egress-agent-ca-bundle.pem".to_owned(),
        "AWS_CA_BUNDLE=/run/egress-agent-ca-bundle.pem".to_owned(),
        format!("API_KEY={PH}"),
        format!("ENV_KEY={PH_ENV}"),
        format!("HTTPS_PROXY=http://127.0.0.1:{}", cfg.endpoint_port),
    ] {
        assert!(env.lines().any(|l| l == want), "{want} missing:\n{env}");
    }
    assert!(!env.contains("EGRESS_TEST_SECRET_ENV"), "{env}");
    // agent.state_dir (a non-default one here) is hidden: empty, the secret file gone.
    let state = section(&text, "state");
    assert_eq!(
        state.trim(),
        "STATE-UNREADABLE",
        "state dir visible: {state}"
    );

    // The CA and bundle in the command's /run are the agent's (the bundle = system roots + CA).
    let ca_pem = std::fs::read(dir.0.join("state/ca.pem")).expect("agent CA");
    assert_eq!(got.run_ca, ca_pem, "/run/egress-agent-ca.pem");
    assert!(
        got.run_bundle.ends_with(&ca_pem),
        "bundle must end with the CA"
    );
    assert!(
        String::from_utf8_lossy(&got.run_bundle)
            .matches("BEGIN CERTIFICATE")
            .count()
            > 1,
        "bundle without the system roots"
    );

    // Never inside: the environment of every process of the command, its files, its output.
    assert!(!got.environs.is_empty());
    for (pid, e) in &got.environs {
        for s in [SECRET_FILE, SECRET_ENV] {
            assert!(!has(e, s), "secret in /proc/{pid}/environ");
        }
        assert!(has(e, PH), "/proc/{pid}/environ lacks the placeholder");
    }
    for s in [SECRET_FILE, SECRET_ENV] {
        assert!(
            !has(&got.printed, s),
            "the command printed a secret:\n{text}"
        );
        assert!(!has(&got.run_bundle, s) && !has(&got.run_ca, s));
        // The agent scrubbed the env source before starting anything.
        assert!(!has(&got.agent_environ, s), "secret in exec's own environ");
    }
    drop(up);
}

#[test]
fn a_non_root_command_trusts_the_ca_too() {
    if !root_or_skip("exec interception (nobody)") {
        return;
    }
    let ca = TestCa::new();
    let up = Upstream::start(
        &ca,
        &["api.test", "env.test", "other.test", "pass.test"],
        "127.0.0.1:0".parse().expect("test value"),
    );
    let (dir, cfg) = setup(&up, &ca);
    let p = up.port();
    let d = dir.0.display();
    let script = format!(
        r#"echo "== whoami"; id -u
echo "== curl"; curl -sS --max-time 15 -H "Authorization: Bearer $API_KEY" https://api.test:{p}/v1/nobody-curl
echo "== python"; /usr/bin/python3 {d}/client.py https://api.test:{p}/v1/nobody-python
echo READY; read x
"#
    );
    let got = run_inspected(&cfg, Some("nobody"), &script);
    let text = String::from_utf8_lossy(&got.printed).into_owned();
    assert_eq!(got.code, Some(0), "{text}");
    assert_eq!(section(&text, "whoami").trim(), "65534", "{text}");
    assert!(section(&text, "curl").contains("upstream-ok"), "{text}");
    assert!(section(&text, "python").contains("upstream-ok"), "{text}");
    for path in ["/v1/nobody-curl", "/v1/nobody-python"] {
        let r = up.request(path).unwrap_or_else(|| panic!("no {path}"));
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {SECRET_FILE}").as_str())
        );
    }
    for s in [SECRET_FILE, SECRET_ENV] {
        assert!(!has(&got.printed, s));
        for (pid, e) in &got.environs {
            assert!(!has(e, s), "secret in /proc/{pid}/environ");
        }
    }
}

/// #40 item 7: a caller's own CA settings don't shut the agent's CA out, and they aren't lost.
/// The caller points pip at its "corporate" CA (`PIP_CERT`) and has a global npmrc with
/// `cafile` set, as corporate hosts do. Under `exec` every CA variable names the run's bundle
/// (the caller is told which it replaced), which holds the caller's CA too: a pass-through host
/// signed by that CA still verifies with `$PIP_CERT`, an intercepted one verifies with the same
/// file, and npm — despite the npmrc's `cafile` — reaches an intercepted registry.
#[test]
fn a_callers_ca_settings_are_kept_and_npm_with_a_global_cafile_trusts_the_agent() {
    if !root_or_skip("exec interception (caller CAs)") {
        return;
    }
    let ca = TestCa::new();
    let up = Upstream::start(
        &ca,
        &["api.test", "env.test", "other.test", "pass.test"],
        "127.0.0.1:0".parse().expect("test value"),
    );
    let (dir, cfg) = setup(&up, &ca);
    let p = up.port();
    // The caller's corporate CA: the upstream's own CA (pass.test is passed through, so only a
    // client that trusts it reaches pass.test).
    let corp = dir.0.join("corp-ca.pem");
    std::fs::write(&corp, &ca.pem).expect("corp CA");
    let npmrc = dir.0.join("global-npmrc");
    std::fs::write(&npmrc, format!("cafile={}\n", corp.display())).expect("npmrc");
    for f in [&corp, &npmrc] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    let py = |url: &str| {
        format!(
            "/usr/bin/python3 -c \"import os, ssl, urllib.request; c = ssl.create_default_context(cafile=os.environ['PIP_CERT']); print(urllib.request.urlopen('{url}', context=c, timeout=10).read().decode())\""
        )
    };
    let script = format!(
        r#"echo "== env"; env | sort
echo "== pass"; {pass}
echo "== intercepted"; {intercepted}
echo "== npm"; npm ping --registry https://other.test:{p}/ --fetch-retries=0 --fetch-timeout=15000 --cache /tmp/egress-npm-$$ 2>&1; echo "npm-rc=$?"
echo "== npm-cafile"; npm config get cafile
echo "== done"
"#,
        pass = py(&format!("https://pass.test:{p}/v1/pass-corp")),
        intercepted = py(&format!("https://other.test:{p}/v1/other-corp")),
    );
    let out = Command::new(agent_bin())
        .args(["exec", "--policy", "agent", "--config"])
        .arg(&cfg.path)
        .args(["--", "sh", "-c", &script])
        .env("EGRESS_TEST_SECRET_ENV", SECRET_ENV)
        .env("PIP_CERT", &corp)
        .env("NPM_CONFIG_GLOBALCONFIG", &npmrc)
        .stdin(Stdio::null())
        .output()
        .expect("exec");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{text}{err}");
    let env = section(&text, "env");
    assert!(
        env.lines()
            .any(|l| l == "PIP_CERT=/run/egress-agent-ca-bundle.pem"),
        "{env}"
    );
    // The caller is told what was replaced, and that its CAs are kept.
    assert!(
        err.contains(&format!("PIP_CERT ({})", corp.display()))
            && err.contains(&format!("cafile in {}", npmrc.display())),
        "{err}"
    );
    assert!(
        section(&text, "pass").contains("upstream-ok"),
        "{text}{err}"
    );
    assert!(up.request("/v1/pass-corp").is_some());
    assert!(
        section(&text, "intercepted").contains("upstream-ok"),
        "{text}{err}"
    );
    assert!(up.request("/v1/other-corp").is_some());
    assert!(
        section(&text, "npm").contains("npm-rc=0"),
        "npm with a global cafile: {text}{err}"
    );
    assert!(
        up.requests().iter().any(|r| r.text().contains("/-/ping")),
        "npm's ping never reached the registry"
    );
    assert_eq!(
        section(&text, "npm-cafile").trim(),
        "/run/egress-agent-ca-bundle.pem",
        "{text}"
    );
}

#[test]
fn a_policy_without_bindings_changes_nothing() {
    if !root_or_skip("exec interception (no bindings)") {
        return;
    }
    let ca = TestCa::new();
    let up = Upstream::start(
        &ca,
        &["api.test"],
        "127.0.0.1:0".parse().expect("test value"),
    );
    let (dir, cfg) = setup(&up, &ca);
    // api.test has a binding in the other policy, none in this one: passed through, so the
    // client verifies the upstream's own certificate and what it sends arrives as sent.
    let script = format!(
        "env; ls -A /run; curl -sS --max-time 15 --cacert {d}/upstream-ca.pem \
         -H 'Authorization: Bearer {PH}' https://api.test:{p}/v1/plain; echo; echo DONE",
        d = dir.0.display(),
        p = up.port()
    );
    let out = Command::new(agent_bin())
        .args(["exec", "--policy", "plain", "--config"])
        .arg(&cfg.path)
        .args(["--", "sh", "-c", &script])
        // The configuration's other policy has an env-sourced binding: its source must exist.
        .env("EGRESS_TEST_SECRET_ENV", SECRET_ENV)
        .stdin(Stdio::null())
        .output()
        .expect("exec");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.contains("DONE"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Whatever the caller's environment had stays as it was (this CI sets SSL_CERT_FILE to
    // the host's bundle, for one); nothing points into the command's /run, no placeholder.
    for (k, v) in std::env::vars() {
        if [
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "NODE_EXTRA_CA_CERTS",
        ]
        .contains(&k.as_str())
        {
            assert!(
                text.lines().any(|l| l == format!("{k}={v}")),
                "{k} changed:\n{text}"
            );
        }
    }
    assert!(!text.lines().any(|l| l.starts_with("API_KEY=")), "{text}");
    assert!(!text.contains("egress-agent-ca"), "{text}");
    assert!(text.contains("HTTPS_PROXY="), "{text}");
    assert!(text.contains("upstream-ok HTTP/2.0 /v1/plain"), "{text}");
    let r = up.request("/v1/plain").expect("the plain request");
    assert_eq!(
        r.header("authorization"),
        Some(format!("Bearer {PH}").as_str()),
        "{r:?}"
    );
}
