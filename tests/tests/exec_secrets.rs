//! No secret is readable inside an `exec` workload (issue #40, item 2).
//!
//! The configuration binds secrets from every kind of source, in two policies (the command runs
//! under one; the other's secrets must be out of reach too): a file in a directory of secrets
//! (with a private neighbour the configuration does not name), a file directly in a broad
//! `/etc`-like directory (next to a `hosts` file the command may read), a symbolic link to a
//! file in another broad directory, a systemd credential (`$CREDENTIALS_DIRECTORY`) and an
//! environment variable. The secret files belong to `nobody`, so that without the sandbox the
//! `nobody` command could read every one of them, as root can (checked first, outside).
//!
//! Under `exec`, as root and as `nobody`, the command tries to read each source (by its name and
//! where it leads), everything below the test's directory, its own environment, every
//! `/proc/<pid>/{environ,cmdline,mem}` it can see, and the `exec` supervisor's by its host pid;
//! then, while it runs, the host adds files to the covered directories and replaces the secret
//! in the secrets directory by a rename (rotation), and it reads again. The secret bytes never
//! appear in anything it printed. Its own requests still get the secrets injected upstream.
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_tests::agent::{ReadyOutput, StopOnDrop, TestConfig, agent_bin};
use egress_tests::root_or_skip;
use egress_tests::tls_upstream::{TestCa, Upstream};
use egress_tests::upstreams::TempDir;

const SECRET_DIR: &str = "sk-dir-Vt3q8Rw1-never-inside";
const SECRET_NEIGHBOUR: &str = "sk-neighbour-Bn5x2Pk7-never-inside";
const SECRET_BROAD: &str = "sk-broad-Lm9c4Hs6-never-inside";
const SECRET_LINK: &str = "sk-link-Qe2w7Zd3-never-inside";
const SECRET_CRED: &str = "sk-cred-Yu6j1Fg8-never-inside";
const SECRET_ENV: &str = "sk-env-Ko4t9Nb2-never-inside";
const SECRET_LATE: &str = "sk-late-Wr8m3Xc5-never-inside";
const SECRET_ROTATED: &str = "sk-rotated-Ja1v6Ep4-never-inside";
const ALL: [&str; 8] = [
    SECRET_DIR,
    SECRET_NEIGHBOUR,
    SECRET_BROAD,
    SECRET_LINK,
    SECRET_CRED,
    SECRET_ENV,
    SECRET_LATE,
    SECRET_ROTATED,
];
const PH_DIR: &str = "egress-ph-dir-5ec2e7";
const PH_CRED: &str = "egress-ph-cred-5ec2e7";
const PH_LINK: &str = "egress-ph-link-5ec2e7";
const NOBODY: u32 = 65534;

/// The test's directory tree; removed on drop ([`TempDir`]).
struct Tree(TempDir);

impl Tree {
    fn dir(&self, rel: &str, mode: u32, owner: u32) -> PathBuf {
        let p = self.0.path().join(rel);
        std::fs::create_dir_all(&p).expect("dir");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        std::os::unix::fs::chown(&p, Some(owner), Some(owner)).expect("chown");
        p
    }
    fn file(&self, rel: &str, text: &str, mode: u32, owner: u32) -> PathBuf {
        let p = self.0.path().join(rel);
        std::fs::write(&p, text).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        std::os::unix::fs::chown(&p, Some(owner), Some(owner)).expect("chown");
        p
    }
    /// Every secret file, by the names the command will try.
    fn secret_files(&self) -> Vec<PathBuf> {
        [
            "secrets/t",
            "secrets/other.key",
            "etc/api.key",
            "etc/linked.key",
            "vault/real.key",
            "creds/cred1",
        ]
        .iter()
        .map(|r| self.0.path().join(r))
        .collect()
    }
}

fn setup(tag: &str, up: &Upstream, ca: &TestCa) -> (Tree, TestConfig) {
    let root =
        std::env::temp_dir().join(format!("egress-exec-secrets-{}-{tag}", std::process::id()));
    std::fs::remove_dir_all(&root).ok();
    let t = Tree(TempDir(root));
    t.dir("", 0o755, 0);
    t.dir("state", 0o700, 0);
    // A directory of secrets: the bound one and one of another tool.
    t.dir("secrets", 0o700, NOBODY);
    t.file("secrets/t", &format!("{SECRET_DIR}\n"), 0o600, NOBODY);
    t.file("secrets/other.key", SECRET_NEIGHBOUR, 0o600, NOBODY);
    // A broad directory: a secret directly in it, next to what the command may read.
    t.dir("etc", 0o755, 0);
    t.file(
        "etc/hosts",
        "127.0.0.1 api.test\n127.0.0.1 cred.test\n127.0.0.1 link.test\n",
        0o644,
        0,
    );
    t.file("etc/api.key", SECRET_BROAD, 0o600, NOBODY);
    // A link from the broad directory to a secret in another broad directory.
    t.dir("vault", 0o755, 0);
    t.file("vault/README", "vault-readme-not-a-secret\n", 0o644, 0);
    t.file("vault/real.key", SECRET_LINK, 0o600, NOBODY);
    std::os::unix::fs::symlink("../vault/real.key", t.0.path().join("etc/linked.key"))
        .expect("link");
    // The systemd credentials directory.
    t.dir("creds", 0o700, NOBODY);
    t.file("creds/cred1", SECRET_CRED, 0o600, NOBODY);
    t.file("upstream-ca.pem", &ca.pem, 0o644, 0);
    t.file("scan.py", SCAN, 0o644, 0);
    let (p, d) = (up.port(), t.0.path().display());
    let cfg = TestConfig::new(&format!(
        r#"connect_timeout_ms = 3000
[agent]
state_dir = "{d}/state"
[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"
[dns]
nameservers = []
hosts_file = "{d}/etc/hosts"

[policies.cred]
allow_hosts = ["api.test", "cred.test", "link.test"]
allow_ports = [{p}]
resolve_private = ["127.0.0.0/8"]

[[policies.cred.credentials]]
host = "api.test"
port = {p}
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/secrets/t" }}
placeholder = "{PH_DIR}"
placeholder_env = "DIR_KEY"

[[policies.cred.credentials]]
host = "cred.test"
port = {p}
header = "x-api-key"
source = {{ credential = "cred1" }}
placeholder = "{PH_CRED}"
placeholder_env = "CRED_KEY"

[[policies.cred.credentials]]
host = "link.test"
port = {p}
header = "x-api-key"
source = {{ file = "{d}/etc/linked.key" }}
placeholder = "{PH_LINK}"
placeholder_env = "LINK_KEY"

# Not the command's policy: its secrets must be out of reach all the same.
[policies.other]
allow_hosts = ["broad.test", "envh.test"]
allow_ports = [{p}]

[[policies.other.credentials]]
host = "broad.test"
port = {p}
header = "x-api-key"
source = {{ file = "{d}/etc/api.key" }}

[[policies.other.credentials]]
host = "envh.test"
port = {p}
header = "x-api-key"
source = {{ env = "EGRESS_TEST_HIDDEN_ENV" }}
"#
    ));
    (t, cfg)
}

/// Run by the command: every process it can see, its environ, cmdline and readable memory
/// (`/proc/<pid>/mem`), searched for the secrets (given in hex, so that no process but this one
/// holds them in clear; this one is skipped); and the supervisor's files by its host pid.
const SCAN: &str = r#"import os, sys
exec_pid = sys.argv[1]
pats = [bytes.fromhex(h) for h in sys.argv[2:]]
me = os.getpid()
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print('pids', ' '.join(map(str, pids)))
print('supervisor visible', os.path.exists('/proc/' + exec_pid))
for name in ['environ', 'cmdline', 'mem', 'maps']:
    try:
        open('/proc/%s/%s' % (exec_pid, name), 'rb').read(1)
        print('supervisor', name, 'READ')
    except OSError as e:
        print('supervisor', name, 'errno', e.errno)
found = 0
for pid in pids:
    if pid == me:
        continue
    for name in ['environ', 'cmdline']:
        try:
            data = open('/proc/%d/%s' % (pid, name), 'rb').read()
        except OSError as e:
            print(name, pid, 'errno', e.errno)
            continue
        print(name, pid, 'read', len(data))
        for i, p in enumerate(pats):
            if p in data:
                print('FOUND', i, pid, name)
                found += 1
    try:
        maps = open('/proc/%d/maps' % pid).read().splitlines()
        mem = open('/proc/%d/mem' % pid, 'rb', 0)
    except OSError as e:
        print('mem', pid, 'errno', e.errno)
        continue
    n = 0
    for line in maps:
        addr, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in addr.split('-'))
        if 'r' not in perms or hi - lo > (256 << 20):
            continue
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        n += len(data or b'')
        for i, p in enumerate(pats):
            if data and p in data:
                print('FOUND', i, pid, 'mem', line)
                found += 1
    print('mem', pid, 'read', n)
print('scan found', found)
"#;

fn has(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
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

/// `cat` of every secret file as `user`, outside any sandbox.
fn read_outside(user: &str, t: &Tree) -> Vec<u8> {
    let files: Vec<String> = t
        .secret_files()
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let mut cmd = if user == "root" {
        Command::new("cat")
    } else {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid",
            user,
            "--regid",
            user,
            "--clear-groups",
            "--",
            "cat",
        ]);
        c
    };
    let out = cmd.args(&files).output().expect("cat outside");
    assert!(out.status.success(), "{out:?}");
    out.stdout
}

/// The whole check as `user`.
fn secrets_stay_hidden(user: &str) {
    let ca = TestCa::new();
    let up = Upstream::start(
        &ca,
        &["api.test", "cred.test", "link.test"],
        "127.0.0.1:0".parse().expect("test value"),
    );
    let (t, cfg) = setup(user, &up, &ca);
    let d = t.0.path().display().to_string();
    let p = up.port();

    // Without the sandbox, this user reads every secret file.
    let outside = read_outside(if user == "root" { "root" } else { "65534" }, &t);
    for s in [
        SECRET_DIR,
        SECRET_NEIGHBOUR,
        SECRET_BROAD,
        SECRET_LINK,
        SECRET_CRED,
    ] {
        assert!(has(&outside, s), "[{user}] the setup does not expose {s}");
    }

    let hex: Vec<String> = ALL
        .iter()
        .map(|s| s.bytes().map(|b| format!("{b:02x}")).collect())
        .collect();
    let hex = hex.join(" ");
    let curl = "curl -sS --max-time 15";
    let reads = "secrets/t secrets/other.key etc/api.key etc/linked.key vault/real.key creds/cred1";
    let script = format!(
        r#"read EXEC_PID
echo "== whoami"; id -u
echo "== inject"
{curl} -H "Authorization: Bearer $DIR_KEY" https://api.test:{p}/v1/dir; echo
{curl} -H "x-api-key: $CRED_KEY" https://cred.test:{p}/v1/cred; echo
{curl} -H "x-api-key: $LINK_KEY" https://link.test:{p}/v1/link; echo
echo "== read"
for f in {reads}; do echo "-- $f"; cat {d}/$f 2>&1; echo; done
ls -la {d}/secrets {d}/creds 2>&1
grep -R --exclude=scan.py . {d} 2>&1
echo "== neighbours"; cat {d}/etc/hosts {d}/vault/README
echo "== config"; cat {config}
echo "== env"; env
echo "== proc"; /usr/bin/python3 {d}/scan.py "$EXEC_PID" {hex}
echo READY; read x
echo "== late"
for f in secrets/late creds/late secrets/t; do echo "-- $f"; cat {d}/$f 2>&1; echo; done
grep -R --exclude=scan.py . {d} 2>&1
echo "== end"
"#,
        config = cfg.path.display(),
    );
    let child = Command::new(agent_bin())
        .args(["exec", "--user", user, "--policy", "cred", "--config"])
        .arg(&cfg.path)
        .args(["--", "sh", "-c", &script])
        .env("CREDENTIALS_DIRECTORY", t.0.path().join("creds"))
        .env("EGRESS_TEST_HIDDEN_ENV", SECRET_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn exec");
    let mut child = StopOnDrop(child);
    let exec_pid = child.0.id();
    let mut stdin = child.0.stdin.take().expect("stdin");
    stdin
        .write_all(format!("{exec_pid}\n").as_bytes())
        .expect("exec pid");
    let output = ReadyOutput::read(&mut child.0, Duration::from_secs(120));
    let ready = output.ready;
    if ready {
        // While the command runs: new secrets in the covered directories, and the bound secret
        // replaced by a rename (what rotation does).
        t.file("secrets/late", SECRET_LATE, 0o644, NOBODY);
        t.file("creds/late", SECRET_LATE, 0o644, NOBODY);
        t.file("secrets/t.new", SECRET_ROTATED, 0o644, NOBODY);
        std::fs::rename(
            t.0.path().join("secrets/t.new"),
            t.0.path().join("secrets/t"),
        )
        .expect("rotate");
    }
    stdin.write_all(b"\n").ok();
    drop(stdin);
    let (printed, errors) = output.finish();
    let status = child.0.wait().expect("wait exec");
    let text = String::from_utf8_lossy(&printed).into_owned();
    let err_text = String::from_utf8_lossy(&errors).into_owned();
    assert!(ready, "[{user}] never got to READY:\n{text}\n{err_text}");
    assert_eq!(status.code(), Some(0), "[{user}]\n{text}\n{err_text}");
    eprintln!("[{user}] command output:\n{text}\n[{user}] exec stderr:\n{err_text}");

    let uid = if user == "root" { "0" } else { "65534" };
    assert_eq!(section(&text, "whoami").trim(), uid, "{text}");
    // Never inside: not in anything the command printed (its reads, its environment, the scan
    // of every process it can see), not in what exec printed.
    for s in ALL {
        assert!(!has(&printed, s), "[{user}] the command read {s}:\n{text}");
        assert!(!has(&errors, s), "[{user}] exec printed {s}:\n{err_text}");
    }
    // Hiding did not break injection: the upstream got the real secrets.
    for (path, header, want) in [
        ("/v1/dir", "authorization", format!("Bearer {SECRET_DIR}")),
        ("/v1/cred", "x-api-key", SECRET_CRED.to_owned()),
        ("/v1/link", "x-api-key", SECRET_LINK.to_owned()),
    ] {
        let r = up
            .request(path)
            .unwrap_or_else(|| panic!("[{user}] upstream never got {path}:\n{text}"));
        assert_eq!(r.header(header), Some(want.as_str()), "[{user}] {path}");
    }
    assert_eq!(section(&text, "inject").matches("upstream-ok").count(), 3);
    // What is not secret stays readable: the broad directories' other files, the configuration.
    let neighbours = section(&text, "neighbours");
    assert!(
        neighbours.contains("127.0.0.1 api.test") && neighbours.contains("vault-readme"),
        "[{user}] {neighbours}"
    );
    let config = section(&text, "config");
    assert!(
        config.contains("[policies.cred]") && config.contains("secrets/t"),
        "[{user}] {config}"
    );
    // The environment: placeholders only, no env secret, no credentials directory.
    let env = section(&text, "env");
    for want in [
        format!("DIR_KEY={PH_DIR}"),
        format!("CRED_KEY={PH_CRED}"),
        format!("LINK_KEY={PH_LINK}"),
    ] {
        assert!(env.lines().any(|l| l == want), "[{user}] {want}:\n{env}");
    }
    for gone in ["EGRESS_TEST_HIDDEN_ENV", "CREDENTIALS_DIRECTORY"] {
        assert!(!env.contains(gone), "[{user}] {gone} in:\n{env}");
    }
    // The supervisor is out of sight, and the scan saw every process of the command.
    let proc = section(&text, "proc");
    assert!(
        proc.contains("supervisor visible False") && proc.contains("scan found 0"),
        "[{user}] {proc}"
    );
    for name in ["environ", "cmdline", "mem", "maps"] {
        assert!(
            !proc.contains(&format!("supervisor {name} READ")),
            "[{user}] {proc}"
        );
    }
    assert!(proc.contains("cmdline 1 read"), "[{user}] {proc}");
    if user == "root" {
        // Root reads the memory of the sandbox's init (pid 1, a re-exec of the agent).
        assert!(
            proc.lines()
                .any(|l| l.starts_with("mem 1 read ") && l != "mem 1 read 0"),
            "[{user}] {proc}"
        );
    }
    // Files that came later, and the rotated secret: still nothing.
    let late = section(&text, "late");
    assert!(late.contains("-- secrets/late"), "[{user}] {late}");
}

#[test]
fn exec_hides_every_secret_source_from_a_root_command() {
    if !root_or_skip("exec secret hiding (root)") {
        return;
    }
    secrets_stay_hidden("root");
}

#[test]
fn exec_hides_every_secret_source_from_an_unprivileged_command() {
    if !root_or_skip("exec secret hiding (nobody)") {
        return;
    }
    secrets_stay_hidden("nobody");
}

/// A secret source that can't be checked or covered (here the credentials directory is a
/// symbolic link loop): the command is not run.
#[test]
fn exec_refuses_to_run_when_a_secret_cannot_be_hidden() {
    if !root_or_skip("exec secret hiding (fail closed)") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("egress-exec-secrets-{}-loop", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("dir");
    let t = Tree(TempDir(dir));
    let lp = t.0.path().join("loop");
    std::os::unix::fs::symlink(&lp, &lp).expect("loop");
    let cfg = TestConfig::new("");
    let out = Command::new(agent_bin())
        .args(["exec", "--user", "root", "--policy", "deny_all", "--config"])
        .arg(&cfg.path)
        .args(["--", "sh", "-c", "echo COMMAND-RAN"])
        .env("CREDENTIALS_DIRECTORY", &lp)
        .stdin(Stdio::null())
        .output()
        .expect("exec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stdout.contains("COMMAND-RAN"), "{stdout}\n{stderr}");
    assert_eq!(out.status.code(), Some(125), "{stdout}\n{stderr}");
    let want = format!("cannot hide the secret source {}", lp.display());
    assert!(
        stderr.contains(&want) && stderr.contains("it was not run"),
        "{stderr}"
    );
}

/// #40 item 6: a real key in the command's environment. Reported (the event names the
/// variables and why; the command runs and reaches what its policy allows), and with
/// `agent.refuse_workload_secrets` the command is not run: nothing arrives. Neither exec's
/// stderr, nor the events, nor the store's files ever hold a value. A placeholder (or an empty
/// provider variable) is no finding, even with the setting on.
#[test]
fn exec_reports_and_refuses_a_real_key_in_the_environment() {
    use egress_tests::agent::{exec_cmd, probe_bin};
    use egress_tests::canary::Canary;
    use egress_tests::marker;
    use egress_tests::netns::Netns;
    const PORT: u16 = 7350;
    const BOUND: &str = "sk-bound-Rf7Yc2Nq9Lw4-never-shown";
    const PROVIDER: &str = "sk-proj-Dk3Hv8Tz5Mb1-never-shown";
    const PH_HOLD: &str = "egress-ph-holds-7a11";
    if !root_or_skip("exec: a real key in the command's environment") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[PORT], &[]);
    let dir = std::env::temp_dir().join(format!("egress-exec-holds-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let t = Tree(TempDir(dir));
    t.dir("", 0o755, 0);
    t.dir("state", 0o700, 0);
    t.file("state/secret", BOUND, 0o600, 0);
    let config = |refuse: bool| {
        let d = t.0.path().display();
        TestConfig::new(&format!(
            r#"[agent]
state_dir = "{d}/state"
refuse_workload_secrets = {refuse}
[policies.holds]
allow_hosts = ["api.test"]
allow_cidrs = [{{ cidr = "198.19.0.0/16", ports = [{PORT}] }}]
[[policies.holds.credentials]]
host = "api.test"
header = "x-api-key"
source = {{ file = "{d}/state/secret" }}
placeholder = "{PH_HOLD}"
placeholder_env = "HOLDS_KEY"
"#
        ))
    };
    let alt = ns.ns_v4_alt.to_string();
    let run = |cfg: &TestConfig, env: &[(&str, &str)], m: &str| {
        let mut cmd = exec_cmd("holds", Some(&cfg.path));
        cmd.arg(probe_bin())
            .args(["tcp", &alt, &PORT.to_string(), m])
            .envs(env.iter().copied())
            .stdin(Stdio::null());
        let out = cmd.output().expect("exec");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for v in [BOUND, PROVIDER] {
            assert!(!text.contains(v), "exec printed a value:\n{text}");
        }
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let events = |cfg: &TestConfig| -> Vec<serde_json::Value> {
        let out = Command::new(agent_bin())
            // A selection: read from this run's store, never a daemon's ring.
            .args([
                "events", "--json", "-n", "1000", "--policy", "holds", "--config",
            ])
            .arg(&cfg.path)
            .output()
            .expect("events");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        for v in [BOUND, PROVIDER] {
            assert!(!text.contains(v), "the events hold a value:\n{text}");
        }
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["reason"] == "workload-holds-secret")
            .collect()
    };
    let holding = [("OPENAI_API_KEY", PROVIDER), ("LEAKED_COPY", BOUND)];

    // Reported: the command runs and its allowed destination gets its bytes.
    let cfg = config(false);
    let m = marker("holds-reported");
    let (code, err) = run(&cfg, &holding, &m);
    assert_eq!(code, Some(0), "{err}");
    assert!(canary.wait_for(&m, Duration::from_secs(3)), "{err}");
    assert!(
        err.contains("OPENAI_API_KEY (provider-variable)")
            && err.contains("LEAKED_COPY (bound-secret policies.holds.credentials[0])"),
        "{err}"
    );
    let evs = events(&cfg);
    let ev = evs
        .last()
        .unwrap_or_else(|| panic!("no workload-holds-secret event"));
    assert!(ev["policy"] == "holds" && ev["source"] == "agent", "{ev}");
    let vars = ev["context"]["variables"].as_str().unwrap_or_default();
    assert!(
        vars.contains("OPENAI_API_KEY (provider-variable)") && vars.contains("LEAKED_COPY"),
        "{ev}"
    );
    assert!(
        ev["context"]["action"]
            .as_str()
            .is_some_and(|a| a.starts_with("reported")),
        "{ev}"
    );

    // Refused: not run, nothing arrives; the error names the variable and the setting.
    let cfg = config(true);
    let m = marker("holds-refused");
    let (code, err) = run(&cfg, &holding, &m);
    assert_eq!(code, Some(125), "{err}");
    assert!(
        err.contains("OPENAI_API_KEY (provider-variable)")
            && err.contains("refuse_workload_secrets = true")
            && err.contains("it was not run"),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(!canary.saw(&m), "the refused command's bytes arrived");
    let evs = events(&cfg);
    assert!(
        evs.iter().any(|e| e["context"]["action"]
            .as_str()
            .is_some_and(|a| a.starts_with("refused to start"))),
        "{evs:?}"
    );
    let before = evs.len();

    // Placeholders and empty provider variables are fine, setting on or not; and a binding's
    // `placeholder_env` is judged as the command gets it (exec sets it to the placeholder).
    let m = marker("holds-placeholder");
    let (code, err) = run(
        &cfg,
        &[
            ("OPENAI_API_KEY", PH_HOLD),
            ("GITHUB_TOKEN", ""),
            ("HOLDS_KEY", BOUND),
        ],
        &m,
    );
    assert_eq!(code, Some(0), "a placeholder was refused: {err}");
    assert!(canary.wait_for(&m, Duration::from_secs(3)), "{err}");
    assert_eq!(events(&cfg).len(), before, "an event for placeholders");

    // The store's files never hold a value.
    for f in ["events.db", "events.db-wal"] {
        let bytes = std::fs::read(t.0.path().join("state").join(f)).unwrap_or_default();
        for v in [BOUND, PROVIDER] {
            assert!(!has(&bytes, v), "{f} holds a value");
        }
    }
}
