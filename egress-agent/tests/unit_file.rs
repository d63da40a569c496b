//! dist/egress-agent.service: the directives the agent relies on are there, and
//! `systemd-analyze verify` accepts the unit (skipped when systemd-analyze is not installed; the
//! xtask test installs Debian's systemd package). PID 1 need not be systemd: verify works offline.
use std::path::{Path, PathBuf};
use std::process::Command;

fn unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/egress-agent.service")
}

fn unit() -> String {
    std::fs::read_to_string(unit_path()).expect("read dist/egress-agent.service")
}

/// Values of `key=` lines (comments ignored).
fn values(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(str::to_owned))
        .collect()
}

#[test]
fn unit_has_the_directives_the_agent_relies_on() {
    let u = unit();
    let one = |k: &str| {
        let v = values(&u, k);
        assert_eq!(v.len(), 1, "{k}: {v:?}");
        v.into_iter().next().unwrap_or_default()
    };
    assert_eq!(one("Type"), "notify");
    // The agent a hand-over starts notifies before it is the main process (MAINPID=).
    assert_eq!(one("NotifyAccess"), "all");
    assert_eq!(
        one("ExecStart"),
        "/usr/local/bin/egress-agent run --config /etc/egress-agent/config.toml"
    );
    assert_eq!(one("ExecReload"), "/bin/kill -HUP $MAINPID");
    assert_eq!(one("Restart"), "on-failure");
    // A crash keeps the listening sockets in systemd's store (egress_agent::handover::fdstore).
    assert_eq!(one("FileDescriptorStoreMax"), "4096");
    assert_eq!(one("Wants"), "docker.service");
    // Before Docker, not after: at boot the programs must be on the Docker cgroup root before
    // Docker restarts containers (an unclassified container is then deny_all, never unconfined).
    assert!(
        one("Before")
            .split_whitespace()
            .any(|u| u == "docker.service")
    );
    assert!(
        !values(&u, "After")
            .iter()
            .flat_map(|v| v.split_whitespace())
            .any(|u| u == "docker.service"),
        "After=docker.service would leave containers restarted at boot unconfined"
    );
    assert!(
        values(&u, "Requires").is_empty(),
        "Docker must be wanted, not required"
    );
    let caps: Vec<String> = one("CapabilityBoundingSet")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        caps,
        [
            "CAP_BPF",
            "CAP_PERFMON",
            "CAP_NET_ADMIN",
            "CAP_SYS_ADMIN",
            "CAP_SYS_PTRACE"
        ]
    );
    assert_eq!(one("AmbientCapabilities"), one("CapabilityBoundingSet"));
    assert_eq!(one("ProtectSystem"), "strict");
    let rw = one("ReadWritePaths");
    assert!(
        rw.contains("/sys/fs/bpf") && rw.contains("/sys/fs/cgroup"),
        "{rw}"
    );
    assert_eq!(one("RuntimeDirectory"), "egress-agent");
    // The event store: agent.state_dir's default, writable under ProtectSystem=strict, private.
    assert_eq!(one("StateDirectory"), "egress-agent");
    assert_eq!(one("StateDirectoryMode"), "0700");
    assert_eq!(
        egress_agent::config::DEFAULT_STATE_DIR,
        "/var/lib/egress-agent"
    );
    assert_eq!(
        one("RestrictAddressFamilies"),
        "AF_UNIX AF_INET AF_INET6 AF_NETLINK"
    );
    for k in ["NoNewPrivileges", "ProtectHome", "PrivateTmp"] {
        assert_eq!(one(k), "yes", "{k}");
    }
    // Would break the agent: read-only cgroupfs, hidden container processes, a private network.
    for k in [
        "ProtectControlGroups",
        "ProtectProc",
        "PrivateNetwork",
        "PrivateUsers",
    ] {
        assert!(values(&u, k).is_empty(), "{k} must not be set");
    }
}

fn systemd_analyze() -> Option<PathBuf> {
    ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// The unit, with ExecStart pointing at the binary this test run built (verify checks that the
/// executable exists), in a scratch directory named like the unit.
/// A copy of the unit pointing at the built binary, in a directory of the calling test's own
/// (tests run in parallel and each removes its directory).
fn unit_for_verify(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("egress-unit-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let bin = env!("CARGO_BIN_EXE_egress-agent");
    let text = unit().replace("/usr/local/bin/egress-agent", bin);
    let p = dir.join("egress-agent.service");
    std::fs::write(&p, text).expect("write unit");
    p
}

#[test]
fn systemd_analyze_verify_passes() {
    let Some(sa) = systemd_analyze() else {
        eprintln!("skipping: systemd-analyze not installed");
        return;
    };
    let p = unit_for_verify("verify");
    let out = Command::new(&sa)
        .arg("verify")
        .arg(&p)
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    std::fs::remove_dir_all(p.parent().expect("dir")).ok();
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        out.status
    );
}

#[test]
fn systemd_analyze_security_exposure_is_low() {
    let Some(sa) = systemd_analyze() else {
        eprintln!("skipping: systemd-analyze not installed");
        return;
    };
    let p = unit_for_verify("security");
    let out = Command::new(&sa)
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&p)
        .output()
        .expect("run systemd-analyze security");
    std::fs::remove_dir_all(p.parent().expect("dir")).ok();
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(level) = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .and_then(|l| {
            l.split(':')
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<f32>()
                .ok()
        })
    else {
        eprintln!("skipping: this systemd-analyze has no offline security report");
        return;
    };
    assert!(level <= 4.0, "exposure {level} > 4.0:\n{text}");
}
