//! Double faults fail closed at start (issue #10, item 3b): when the nftables host layer can't be
//! set up, the daemon must never report READY (without the layer the proxy address is reachable
//! from the LAN) and must exit with an error that names the nftables cause.
//!
//! The failure is real, not simulated: in a network namespace of the test's own, another netlink
//! socket (`nft -i`, kept open) holds `table inet egress_agent { flags owner; }`. The kernel
//! refuses every change to an owned table from anyone else (EPERM, nf_tables `NFT_TABLE_F_OWNER`,
//! Linux 5.12+), so the agent's first atomic batch is rejected. (Dropping CAP_NET_ADMIN instead
//! fails earlier, at `ip addr replace` on egress0, so it would not test this path.) Once the
//! owner lets go, the same daemon starts and reports READY: the control case.
use std::io::Write as _;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use egress_tests::agent::{agent_bin, cgroup2_mount};
use egress_tests::docker::NetNs;
use egress_tests::root_or_skip;

struct Fixture {
    ns: NetNs,
    dir: PathBuf,
    bpffs: PathBuf,
    cgroup_parent: String,
}

impl Fixture {
    fn new() -> Fixture {
        let pid = std::process::id();
        let dir = PathBuf::from(format!("/tmp/egress-test-nftfault-{pid}"));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("dir");
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/egress-test-nftfault-{pid}"));
        let f = Fixture {
            ns: NetNs::new(&format!("egd-nftf-{pid}")),
            dir,
            bpffs,
            cgroup_parent: format!("egress-test-nftfault-{pid}"),
        };
        std::fs::write(
            f.config(),
            format!(
                "[agent]\nbpffs = \"{}\"\nstate_dir = \"{}\"\n[proxy]\nendpoint = \"169.254.100.1:3128\"\n[dns]\nnameservers = []\n",
                f.bpffs.display(),
                f.dir.join("state").display()
            ),
        )
        .expect("config");
        f
    }

    fn config(&self) -> PathBuf {
        self.dir.join("config.toml")
    }

    /// `egress-agent run` in the namespace, with a notify socket of the test's; output to `log`.
    fn spawn_agent(&self, notify: &Path, log: &Path) -> Child {
        let out = std::fs::File::create(log).expect("log");
        let err = out.try_clone().expect("log fd");
        Command::new("nsenter")
            .arg(format!("--net={}", self.ns.path().display()))
            .arg(agent_bin())
            .arg("run")
            .arg("--config")
            .arg(self.config())
            // No Docker at all: readiness must not depend on it.
            .args([
                "--docker-socket",
                &format!("unix://{}", self.dir.join("no-docker.sock").display()),
            ])
            .args(["--cgroup-parent", &format!("/{}", self.cgroup_parent)])
            .arg("--api-socket")
            .arg(self.dir.join("api.sock"))
            .env("NOTIFY_SOCKET", notify)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .expect("spawn agent")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Unpinning detaches the programs from the test's cgroup parent.
        std::fs::remove_dir_all(&self.bpffs).ok();
        std::fs::remove_dir(cgroup2_mount().join(&self.cgroup_parent)).ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Everything sent to the notify socket until `until` returns true or `timeout` passes.
fn notifications(sock: &UnixDatagram, timeout: Duration, until: impl Fn(&str) -> bool) -> String {
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let mut all = String::new();
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline && !until(&all) {
        if let Ok(n) = sock.recv(&mut buf) {
            all.push_str(&String::from_utf8_lossy(&buf[..n]));
            all.push('\n');
        }
    }
    all
}

fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn host_layer_failing_at_start_never_reports_ready() {
    if !root_or_skip("daemon start faults") {
        return;
    }
    let f = Fixture::new();

    // Another socket owns our inet table in this namespace.
    let mut owner = Command::new("ip")
        .args(["netns", "exec", &f.ns.name, "nft", "-i"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nft -i");
    owner
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"add table inet egress_agent { flags owner; }\n")
        .expect("write to nft");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f.ns.sh("nft list tables").contains("inet egress_agent") {
        assert!(Instant::now() < deadline, "the owned table never appeared");
        std::thread::sleep(Duration::from_millis(50));
    }

    let notify_path = f.dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    let log = f.dir.join("agent-1.log");
    let mut agent = f.spawn_agent(&notify_path, &log);
    let status = wait_exit(&mut agent, Duration::from_secs(60));
    let said = notifications(&notify, Duration::from_millis(300), |_| false);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let Some(status) = status else {
        agent.kill().ok();
        agent.wait().ok();
        panic!("the daemon kept running without its host layer:\n{text}");
    };
    assert!(!status.success(), "exited successfully:\n{text}");
    assert!(
        !said.contains("READY=1"),
        "READY reported without the host layer: {said:?}\n{text}"
    );
    assert!(!text.contains("egress-agent enforcing"), "{text}");
    // The error names the layer and the kernel's reason.
    assert!(
        text.contains("nftables host layer could not be set up")
            && text.contains("Operation not permitted"),
        "the error does not name the nftables cause:\n{text}"
    );
    assert!(!text.contains("channel closed"), "{text}");
    // ... once: not repeated by each level of the error chain.
    let last = text
        .lines()
        .rev()
        .find(|l| l.contains("error"))
        .unwrap_or_default();
    assert_eq!(
        last.matches("Operation not permitted").count(),
        1,
        "the cause is repeated: {last}"
    );

    // Control: once the owner is gone, the same start succeeds.
    drop(owner.stdin.take());
    owner.wait().ok();
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.ns.sh("nft list tables").contains("inet egress_agent") {
        assert!(Instant::now() < deadline, "the owned table stayed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = f.dir.join("agent-2.log");
    let mut agent = f.spawn_agent(&notify_path, &log);
    let said = notifications(&notify, Duration::from_secs(60), |s| s.contains("READY=1"));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(agent.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .ok();
    if wait_exit(&mut agent, Duration::from_secs(20)).is_none() {
        agent.kill().ok();
        agent.wait().ok();
    }
    assert!(
        said.contains("READY=1"),
        "control start did not become ready: {said:?}\n{text}"
    );
    assert!(
        f.ns.sh("nft list tables").contains("inet egress_agent"),
        "the control start wrote no tables"
    );
}
