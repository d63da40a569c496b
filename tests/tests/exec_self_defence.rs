//! Confinement that holds against the confined command itself (issue #10, part 1).
//!
//! Root or not, a command under `egress-agent exec` must not be able to leave its cgroup, touch
//! BPF links, maps, programs or pins, reach the control API, the agent's configuration or the
//! Docker socket, signal or ptrace the agent, enter other namespaces, load modules, or get
//! raw/packet sockets through a user namespace — and neither may anything it starts through
//! setuid or file-capability binaries. Every technique is tried by the probe inside the
//! confinement and followed by a direct connection to a canary in a test namespace: **nothing
//! may arrive**. After every technique the host's enforcement is checked: the pins and links are
//! there, programs are still attached to the exec root, and a second confined command is still
//! blocked.
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_tests::agent::{BPFFS, ProbeOut, TestConfig, assert_enforcement_intact, probe_bin};
use egress_tests::canary::Canary;
use egress_tests::netns::Netns;
use egress_tests::{marker, root_or_skip};

const TCP: u16 = 7101;
/// The only destination the allowlist policy allows directly.
const ALLOWED: u16 = 7200;

/// `egress-agent exec --user USER --policy POLICY [--config C] -- probe ARGS`.
fn probe_as(user: &str, policy: &str, config: &Path, probe: &Path, args: &[&str]) -> ProbeOut {
    Command::new(egress_tests::agent::agent_bin())
        .args(["exec", "--user", user, "--policy", policy, "--config"])
        .arg(config)
        .arg("--")
        .arg(probe)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run egress-agent exec")
        .into()
}

/// The escape line the probe printed for a technique.
fn escape_line(out: &ProbeOut, tech: &str) -> String {
    let prefix = format!("escape {tech}:");
    out.stdout
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("{tech}: no escape line: {out:?}"))
        .to_owned()
}

/// A stand-in for the agent: a root process outside the sandbox the probe will signal, ptrace
/// and try to enter.
struct StandIn(std::process::Child);

impl StandIn {
    fn start() -> StandIn {
        StandIn(Command::new("sleep").arg("300").spawn().expect("sleep"))
    }
    fn pid(&self) -> String {
        self.0.id().to_string()
    }
    fn alive(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

/// A unix socket under /run standing in for the control API and the Docker socket; counts the
/// connections it accepted.
struct UnixCanary {
    path: PathBuf,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl UnixCanary {
    fn start(name: &str) -> UnixCanary {
        let path = PathBuf::from(format!(
            "/run/egress-tests-{}-{name}.sock",
            std::process::id()
        ));
        std::fs::remove_file(&path).ok();
        let l = std::os::unix::net::UnixListener::bind(&path).expect("bind unix canary");
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let a = accepted.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::io::Write::write_all(&mut s, b"HTTP/1.1 200 OK\r\n\r\n").ok();
            }
        });
        UnixCanary { path, accepted }
    }
    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for UnixCanary {
    fn drop(&mut self) {
        std::fs::remove_file(&self.path).ok();
    }
}

/// One technique: its probe arguments, and whether it must be refused outright.
struct Technique {
    name: &'static str,
    args: Vec<String>,
    must_fail: bool,
}

fn technique(name: &'static str, args: &[&str], must_fail: bool) -> Technique {
    Technique {
        name,
        args: args.iter().map(|s| s.to_string()).collect(),
        must_fail,
    }
}

fn techniques(
    config: &Path,
    api: &UnixCanary,
    docker: &UnixCanary,
    agent: &StandIn,
) -> Vec<Technique> {
    let cg2 = egress_tests::agent::cgroup2_mount();
    let cg2 = cg2.to_str().expect("utf-8");
    let config = config.to_str().expect("utf-8");
    let reload = "POST /v1/reload HTTP/1.1\\r\\nHost: agent\\r\\n\\r\\n";
    let info = "GET /info HTTP/1.1\\r\\nHost: docker\\r\\n\\r\\n";
    let pid = agent.pid();
    vec![
        technique("cgroup-root", &[cg2], true),
        technique("cgroup-mount", &[], true),
        technique("bpf-links", &[], true),
        technique("bpf-objects", &[], true),
        technique("bpf-pins", &[BPFFS], true),
        technique("mount-bpffs", &[], true),
        technique("write", &[config], true),
        technique("unix", &[api.path.to_str().expect("utf-8"), reload], true),
        technique("unix", &[docker.path.to_str().expect("utf-8"), info], true),
        technique("signal", &[&pid, "9"], true),
        technique("ptrace", &[&pid], true),
        technique("setns", &[&pid], true),
        technique("module", &[], true),
        technique("userns-packet", &[], true),
        // A raw socket in a network namespace of its own may open; it reaches nothing (the
        // direct connection after it shows that).
        technique("userns-netns-raw", &[], false),
    ]
}

/// Every technique as `user` under `policy`, then the checks.
fn run_matrix(user: &str, policy: &str, cfg: &TestConfig) {
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[TCP, ALLOWED], &[]);
    let api = UnixCanary::start("api");
    let docker = UnixCanary::start("docker");
    let mut agent = StandIn::start();
    let probe = probe_bin();
    let target = ns.ns_v4.to_string();
    let tcp = TCP.to_string();
    let mut markers = Vec::new();
    let mut failures = Vec::new();
    for t in techniques(&cfg.path, &api, &docker, &agent) {
        let m = marker(t.name);
        let mut args: Vec<&str> = vec!["escape", t.name];
        args.extend(t.args.iter().map(String::as_str));
        args.extend(["--", "tcp", &target, &tcp, &m]);
        let out = probe_as(user, policy, &cfg.path, &probe, &args);
        assert!(
            !out.stderr.contains("egress-agent: error") && !out.stderr.contains("exec sandbox"),
            "[{user}/{policy}] {}: exec failed: {out:?}",
            t.name
        );
        let line = escape_line(&out, t.name);
        eprintln!("[{user}/{policy}] {:<18} {line}", t.name);
        if t.must_fail && !line.contains(": err ") {
            failures.push(format!("{}: not refused: {line}", t.name));
        }
        markers.push((t.name, m));
        assert_enforcement_intact(&format!("[{user}/{policy}] after {}", t.name));
        // Another confined command is still blocked.
        let m2 = marker("second");
        probe_as(
            "root",
            "deny_all",
            &cfg.path,
            &probe,
            &["tcp", &target, &tcp, &m2],
        );
        markers.push(("second command", m2));
    }
    // Late parts of an attempt land within a few hundred ms.
    std::thread::sleep(Duration::from_millis(500));
    for (name, m) in &markers {
        if canary.saw(m) {
            failures.push(format!("{name}: BYPASS, the direct connection arrived"));
        }
    }
    if api.accepted() + docker.accepted() > 0 {
        failures.push(format!(
            "unix services reached: api {} docker {}",
            api.accepted(),
            docker.accepted()
        ));
    }
    if !agent.alive() {
        failures.push("the stand-in agent process was killed".into());
    }
    assert!(
        failures.is_empty(),
        "[{user}/{policy}] self-defence:\n{}",
        failures.join("\n")
    );
    // The configuration is untouched.
    let text = std::fs::read_to_string(&cfg.path).expect("config");
    assert!(!text.contains("egress-probe"), "config was modified");
}

fn allowlist_config() -> TestConfig {
    TestConfig::new(&format!(
        "[policies.selfdef]\nmode = \"allowlist\"\nallow_hosts = [\"example.com\"]\n\
         allow_cidrs = [{{ cidr = \"198.19.0.0/16\", ports = [{ALLOWED}] }}]\n"
    ))
}

/// What the command runs as: its ids, capabilities and no_new_privs.
fn whoami(user: &str, policy: &str, cfg: &TestConfig, probe: &Path) -> String {
    let out = probe_as(user, policy, &cfg.path, probe, &["escape", "whoami"]);
    escape_line(&out, "whoami")
}

#[test]
fn root_commands_cannot_undo_confinement() {
    if !root_or_skip("exec self-defence (root)") {
        return;
    }
    let cfg = allowlist_config();
    for policy in ["deny_all", "selfdef"] {
        run_matrix("root", policy, &cfg);
    }
    let w = whoami("root", "deny_all", &cfg, &probe_bin());
    assert!(w.contains("uid 0 0 0 0"), "{w}");
    assert!(w.contains("NoNewPrivs 1"), "{w}");
    // Docker's default set without CAP_NET_RAW and CAP_MKNOD, and the bounding set the same.
    assert!(w.contains("CapEff 00000000a00405fb"), "{w}");
    assert!(w.contains("CapBnd 00000000a00405fb"), "{w}");
    // allow_all keeps CAP_NET_RAW (bit 13), nothing else.
    let w = whoami("root", "allow_all", &cfg, &probe_bin());
    assert!(w.contains("CapEff 00000000a00425fb"), "{w}");
}

#[test]
fn ordinary_users_cannot_undo_confinement() {
    if !root_or_skip("exec self-defence (nobody)") {
        return;
    }
    let cfg = allowlist_config();
    // The probe must be executable by nobody (the target dir may be private).
    let dir = std::env::temp_dir().join(format!("egress-selfdef-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let probe = dir.join("egress-probe");
    std::fs::copy(probe_bin(), &probe).expect("copy probe");
    for policy in ["deny_all", "selfdef"] {
        run_matrix_with_probe("nobody", policy, &cfg, &probe);
    }
    let w = whoami("nobody", "deny_all", &cfg, &probe);
    assert!(w.contains("uid 65534 65534 65534 65534"), "{w}");
    assert!(
        w.contains("CapEff 0000000000000000") && w.contains("NoNewPrivs 1"),
        "{w}"
    );

    // setuid root and file capabilities gain nothing (no_new_privs, empty bounding set).
    let suid = dir.join("probe-suid");
    std::fs::copy(&probe, &suid).expect("copy");
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).expect("setuid");
    let w = whoami("nobody", "deny_all", &cfg, &suid);
    assert!(
        w.contains("uid 65534 65534 65534 65534"),
        "setuid root gave privileges: {w}"
    );
    // File capabilities: an "effective" binary can't be granted them, so the kernel refuses to
    // run it at all (EPERM, exit 126); a permitted-only one runs with none.
    let fcap = dir.join("probe-fcap");
    std::fs::copy(&probe, &fcap).expect("copy");
    std::fs::set_permissions(&fcap, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let caps = "cap_net_raw,cap_net_admin,cap_sys_admin,cap_bpf";
    egress_tests::sh(&format!("setcap {caps}+ep {}", fcap.display()));
    let out = probe_as(
        "nobody",
        "deny_all",
        &cfg.path,
        &fcap,
        &["escape", "bpf-links"],
    );
    assert!(
        out.code == Some(126) && out.stderr.contains("Operation not permitted"),
        "an effective file-capability binary ran: {out:?}"
    );
    egress_tests::sh(&format!("setcap {caps}+p {}", fcap.display()));
    let w = whoami("nobody", "deny_all", &cfg, &fcap);
    assert!(
        w.contains("CapPrm 0000000000000000") && w.contains("CapEff 0000000000000000"),
        "file capabilities were granted: {w}"
    );
    let out = probe_as(
        "nobody",
        "deny_all",
        &cfg.path,
        &fcap,
        &["escape", "bpf-links"],
    );
    assert!(escape_line(&out, "bpf-links").contains(": err "), "{out:?}");
    std::fs::remove_dir_all(&dir).ok();
}

fn run_matrix_with_probe(user: &str, policy: &str, cfg: &TestConfig, probe: &Path) {
    // run_matrix finds the probe through EGRESS_PROBE_BIN.
    let _guard = ProbeOverride::set(probe);
    run_matrix(user, policy, cfg);
}

/// Points `probe_bin()` at another copy of the probe for the duration of a matrix run.
struct ProbeOverride(Option<std::ffi::OsString>);

impl ProbeOverride {
    fn set(p: &Path) -> ProbeOverride {
        let old = std::env::var_os("EGRESS_PROBE_BIN");
        // SAFETY: tests in this binary run on one thread (`--test-threads=1`, as xtask runs them).
        unsafe { std::env::set_var("EGRESS_PROBE_BIN", p) };
        ProbeOverride(old)
    }
}

impl Drop for ProbeOverride {
    fn drop(&mut self) {
        // SAFETY: as in `set`.
        unsafe {
            match self.0.take() {
                Some(v) => std::env::set_var("EGRESS_PROBE_BIN", v),
                None => std::env::remove_var("EGRESS_PROBE_BIN"),
            }
        }
    }
}
