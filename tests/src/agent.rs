//! Driving the built binaries: `egress-agent` (exec, status) and `egress-probe`.
//!
//! The binaries are found next to the test executable (`target/<profile>/`), or through
//! `EGRESS_AGENT_BIN` / `EGRESS_PROBE_BIN`. `cargo test -p egress-tests` builds the probe;
//! the agent binary must be built first (`cargo build -p egress-agent`, which `cargo xtask test`
//! does) — a nested cargo build from inside a test would deadlock on the target-dir lock.
use std::ffi::OsStr;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test>-<hash>
    let deps = exe.parent().expect("deps dir");
    if deps.file_name() == Some(OsStr::new("deps")) {
        deps.parent().expect("profile dir").to_owned()
    } else {
        deps.to_owned()
    }
}

/// `$env`, else the most recently built of `target/{debug,release}/<name>` (`cargo xtask test`
/// builds the release agent and runs the tests in the debug profile).
fn locate(env: &str, name: &str, hint: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let own = profile_dir();
    let target = own
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| own.clone());
    let candidates = [
        own.join(name),
        target.join("debug").join(name),
        target.join("release").join(name),
    ];
    candidates
        .into_iter()
        .filter_map(|p| {
            let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
            Some((t, p))
        })
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
        .unwrap_or_else(|| {
            panic!(
                "{name} not found near {} (set {env}, or build it: {hint})",
                own.display()
            )
        })
}

/// The `egress-agent` binary under test.
pub fn agent_bin() -> PathBuf {
    locate(
        "EGRESS_AGENT_BIN",
        "egress-agent",
        "cargo build -p egress-agent",
    )
}

/// The `egress-probe` binary.
pub fn probe_bin() -> PathBuf {
    locate(
        "EGRESS_PROBE_BIN",
        "egress-probe",
        "cargo build -p egress-tests --bins",
    )
}

/// The cgroup2 mount, from /proc/self/mountinfo.
pub fn cgroup2_mount() -> PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    for line in info.lines() {
        if let Some((left, right)) = line.split_once(" - ")
            && right.split_whitespace().next() == Some("cgroup2")
            && let Some(mp) = left.split_whitespace().nth(4)
        {
            return PathBuf::from(mp.replace("\\040", " "));
        }
    }
    panic!("no cgroup2 mount");
}

/// The exec enforcement root (`<cgroup2>/egress-agent`).
pub fn exec_root() -> PathBuf {
    cgroup2_mount().join("egress-agent")
}

/// Default bpffs pin directory of the agent.
pub const BPFFS: &str = "/sys/fs/bpf/egress-agent";

/// A config file in a temp dir, removed on drop.
pub struct TestConfig {
    dir: PathBuf,
    pub path: PathBuf,
    /// The stable proxy endpoint written into it.
    pub endpoint_port: u16,
}

impl TestConfig {
    /// `[proxy] endpoint = 127.0.0.1:<free port>` plus `extra` TOML (policies; keys before its
    /// first table header still belong to `[proxy]`).
    pub fn new(extra: &str) -> TestConfig {
        let dir = std::env::temp_dir().join(format!(
            "egress-tests-{}-{}",
            std::process::id(),
            crate::marker("cfg")
        ));
        // A kept /tmp may hold a directory of this name from a run that had the same pid.
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("temp dir");
        // A port nothing listens on: the endpoint is only ever rewritten, never bound.
        let endpoint_port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let path = dir.join("config.toml");
        let text = format!("[proxy]\nendpoint = \"127.0.0.1:{endpoint_port}\"\n\n{extra}\n");
        File::create(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .expect("write config");
        TestConfig {
            dir,
            path,
            endpoint_port,
        }
    }
}

impl Drop for TestConfig {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Result of one probe run.
#[derive(Debug)]
pub struct ProbeOut {
    /// The probe reported `ok`.
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    pub code: Option<i32>,
}

impl From<Output> for ProbeOut {
    fn from(o: Output) -> Self {
        let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
        ProbeOut {
            ok: o.status.success() && stdout.lines().any(|l| l == "ok"),
            stdout,
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
            code: o.status.code(),
        }
    }
}

/// Run the probe in the caller's cgroup (unconfined).
pub fn probe_outside(args: &[&str]) -> ProbeOut {
    Command::new(probe_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run probe")
        .into()
}

/// Run the probe under `egress-agent exec --policy <policy> [--config <config>]`.
pub fn probe_exec(policy: &str, config: Option<&Path>, args: &[&str]) -> ProbeOut {
    let mut cmd = exec_cmd(policy, config);
    cmd.arg(probe_bin()).args(args);
    cmd.stdin(Stdio::null())
        .output()
        .expect("run egress-agent exec")
        .into()
}

/// Run `script` with `sh -c` under `exec --policy <policy> --config <cfg>`, no stdin: what it
/// prints (stdout, then stderr after a `--- stderr ---` line).
pub fn exec_script(cfg: &TestConfig, policy: &str, script: &str) -> String {
    let out = exec_cmd(policy, Some(&cfg.path))
        .args(["sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .expect("run egress-agent exec");
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `egress-agent exec --policy P [--config F] --` (append the command).
pub fn exec_cmd(policy: &str, config: Option<&Path>) -> Command {
    let mut cmd = Command::new(agent_bin());
    cmd.arg("exec").arg("--policy").arg(policy);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    cmd.arg("--");
    cmd
}

/// `egress-agent status --json`, parsed.
pub fn status_json() -> serde_json::Value {
    let out = Command::new(agent_bin())
        .args(["status", "--json"])
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status json")
}

/// Kernel attach types (`enum bpf_attach_type`) of the agent's cgroup programs.
pub const ATTACH_TYPES: [(&str, u32); 11] = [
    ("skb_ingress", 0),
    ("skb_egress", 1),
    ("sock_create", 2),
    ("sock_ops", 3),
    ("connect4", 10),
    ("connect6", 11),
    ("sendmsg4", 14),
    ("sendmsg6", 15),
    ("recvmsg4", 19),
    ("recvmsg6", 20),
    ("lsm_cgroup", 43),
];

pub use crate::bpf::attached_programs;

/// The host's enforcement on the exec root: pins present, programs attached.
pub fn assert_enforcement_intact(what: &str) {
    let root_id = std::fs::metadata(exec_root())
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .expect("exec root");
    let pins = Path::new(BPFFS).join("roots").join(root_id.to_string());
    for prog in egress_common::programs::CGROUP {
        assert!(
            pins.join(prog).exists(),
            "{what}: pin {}/{prog} is gone",
            pins.display()
        );
    }
    let policies = Path::new(BPFFS).join("maps").join("EGRESS_POLICIES");
    assert!(policies.exists(), "{what}: {} is gone", policies.display());
    for (name, ty) in ATTACH_TYPES.iter().filter(|(n, _)| *n != "lsm_cgroup") {
        assert!(
            !crate::bpf::attached_programs(&exec_root(), *ty).is_empty(),
            "{what}: nothing attached to the exec root for {name}"
        );
    }
}

/// `egress-agent <args> --api-socket <socket>`: a client of a running daemon's control API.
pub fn api_cli(bin: &Path, socket: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin)
        .args(args)
        .arg("--api-socket")
        .arg(socket)
        .output()
        .expect("spawn egress-agent")
}

/// The daemon's recent events (`egress-agent events -n 1000`, JSON lines); none when it does not
/// answer. A line that is not JSON fails the test.
pub fn api_events(bin: &Path, socket: &Path) -> Vec<serde_json::Value> {
    let o = api_cli(bin, socket, &["events", "-n", "1000"]);
    if !o.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("`events` printed a non-JSON line {l:?}: {e}"))
        })
        .collect()
}

/// Wait up to `timeout` for an event of the daemon matching `f`.
pub fn api_wait_event(
    bin: &Path,
    socket: &Path,
    f: impl Fn(&serde_json::Value) -> bool,
    timeout: std::time::Duration,
) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if api_events(bin, socket).iter().any(&f) {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Wait until the daemon on `socket` answers its own status (`uptime_s`: `status` falls back to
/// reading the pins, `events` to the event store, when no daemon answers). `Err`: the last
/// attempt's stderr when `timeout` passed.
pub fn api_ready(bin: &Path, socket: &Path, timeout: std::time::Duration) -> Result<(), String> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let o = api_cli(bin, socket, &["status", "--json"]);
        if o.status.success()
            && serde_json::from_slice::<serde_json::Value>(&o.stdout)
                .is_ok_and(|v| v.get("uptime_s").is_some())
        {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(String::from_utf8_lossy(&o.stderr).into_owned());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A child (an `exec`) stopped with SIGTERM when dropped, so `exec` cleans up and a failing
/// assertion does not leave it behind holding ports and the kernel events lock.
pub struct StopOnDrop(pub Child);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.0.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            )
            .ok();
            self.0.wait().ok();
        }
    }
}

/// A spawned `exec`'s output while its command runs: stderr collected on a thread, stdout read
/// line by line up to the command's `READY` line (or its end, or `timeout`, checked between
/// lines). The test then looks at the running command, tells it to go on, and
/// [`ReadyOutput::finish`]es.
pub struct ReadyOutput {
    /// What stdout printed so far (up to and including `READY`).
    pub printed: Vec<u8>,
    /// Did the command print `READY` in time?
    pub ready: bool,
    out: std::io::BufReader<std::process::ChildStdout>,
    err: std::thread::JoinHandle<Vec<u8>>,
}

impl ReadyOutput {
    /// Take `child`'s stdout and stderr (both piped) and read up to `READY`.
    pub fn read(child: &mut Child, timeout: std::time::Duration) -> ReadyOutput {
        use std::io::{BufRead as _, Read as _};
        let mut stderr = child.stderr.take().expect("stderr");
        let err = std::thread::spawn(move || {
            let mut b = Vec::new();
            stderr.read_to_end(&mut b).ok();
            b
        });
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let (mut printed, mut line, mut ready) = (Vec::new(), Vec::new(), false);
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            line.clear();
            if out.read_until(b'\n', &mut line).unwrap_or(0) == 0 {
                break;
            }
            printed.extend_from_slice(&line);
            if line == b"READY\n" {
                ready = true;
                break;
            }
        }
        ReadyOutput {
            printed,
            ready,
            out,
            err,
        }
    }

    /// Read stdout to its end (the command's exit) and all of stderr: (everything stdout
    /// printed, `READY` included; stderr).
    pub fn finish(mut self) -> (Vec<u8>, Vec<u8>) {
        use std::io::Read as _;
        self.out.read_to_end(&mut self.printed).ok();
        let err = self.err.join().expect("stderr thread");
        (self.printed, err)
    }
}
