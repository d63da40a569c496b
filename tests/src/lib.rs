//! Helpers for the privileged integration tests (package `egress-tests`, run as root by
//! `cargo xtask test`, one test thread).
//!
//! - [`netns`]: a network namespace + veth pair on a TEST-NET range, removed on drop.
//! - [`canary`]: TCP/UDP listeners and an AF_PACKET capture that record what *arrived*.
//! - [`packet`]: hand-made Ethernet/IPv4/UDP frames sent through AF_PACKET.
//! - [`upstreams`]: a test CA, python web servers, a recording dnsmasq, local "public" addresses.
//! - [`registries`]: local TLS package registries (pip, npm, cargo, go, apt, git) for the
//!   real-client matrix, recording every request.
//! - [`tls_upstream`]: a recording TLS upstream with its own CA (interception tests).
//! - [`relay_check`]: content-checked tunnels through an in-process proxy (relay test, soak).
//! - [`stream`]: content-checked byte streams (relay tests and benchmarks compare content).
//! - [`batch`]: the probe's batch mode (many socket operations per confined process).
//! - [`containerd`], [`cri`]: a private containerd (CRI, runc, CNI bridge) in its own network
//!   namespace, and the kubelet's CRI calls to run pods in it.
//! - [`docker_fault`]: a Docker API socket that can refuse container inspects (fail-closed tests).
//! - [`agent`]: locating the built `egress-agent` / `egress-probe` binaries, running the probe
//!   inside or outside `egress-agent exec`, test config files, attached-program counts.
pub mod agent;
pub mod batch;
pub mod bench;
pub mod bpf;
pub mod browser;
pub mod canary;
pub mod containerd;
pub mod cri;
pub mod escape;
pub mod foreign;
pub mod netns;
pub mod packet;
pub mod pods;
pub mod registries;
pub mod relay_check;
pub mod stream;
pub mod tls_upstream;
pub mod upstreams;
pub mod workload;

/// Is the effective user root?
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `true` when the group may run; otherwise prints `skipping: needs root` (once per call) so an
/// unprivileged `cargo test` says clearly why nothing was checked.
pub fn root_or_skip(group: &str) -> bool {
    if is_root() {
        true
    } else {
        // Straight to the stderr fd: libtest's output capture only intercepts `eprintln!`, and
        // this line must be visible in a normal (captured) run.
        use std::io::Write as _;
        std::io::stderr()
            .write_all(format!("skipping: needs root ({group})\n").as_bytes())
            .ok();
        false
    }
}

/// SIGTERM `child`, wait up to `grace` for it to exit, then SIGKILL it (a daemon under test:
/// dockerd, containerd).
pub fn stop_child(child: &mut std::process::Child, grace: std::time::Duration) {
    let Ok(pid) = i32::try_from(child.id()) else {
        child.kill().ok();
        child.wait().ok();
        return;
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .ok();
    let deadline = std::time::Instant::now() + grace;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Run `fut` to completion on a thread of its own with its own tokio runtime (the caller may
/// be inside a runtime already: a `Drop`, a sync helper called from async code). A panic in
/// `fut` comes back as `Err`.
pub fn block_on_own_thread<F>(fut: F) -> std::thread::Result<F::Output>
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime")
                .block_on(fut)
        })
        .join()
    })
}

/// Run a command line through `bash -c`; panic with its output on failure; return stdout.
pub fn sh(cmd: &str) -> String {
    let out = std::process::Command::new("bash")
        .args(["-c", cmd])
        .output()
        .expect("spawn bash");
    assert!(
        out.status.success(),
        "`{cmd}` failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run a command line through `bash -c` with its output discarded; whether it succeeded.
pub fn sh_quiet(cmd: &str) -> bool {
    std::process::Command::new("bash")
        .args(["-c", cmd])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The line of `text` that starts with `key` and a space (a probe script's `echo "key $(...)"`),
/// empty if there is none.
pub fn keyed_line(text: &str, key: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(&format!("{key} ")))
        .unwrap_or_default()
        .to_owned()
}

/// A unique marker for one attempt (payload tag the canary looks for).
pub fn marker(case: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "EGT-{}-{}-{case}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
pub mod docker;
pub mod docker_fault;
