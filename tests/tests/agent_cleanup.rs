//! `egress-agent cleanup` (the uninstall step) removes what the agent left on the host: the pins
//! (detaching the programs), the nftables tables, the proxy interface and its own cgroups.

use std::{path::Path, process::Command};

use egress_tests::{
    agent::{ATTACH_TYPES, TestConfig, agent_bin, attached_programs, exec_cmd, exec_root},
    root_or_skip, sh_quiet,
};

fn attached_on(root: &Path) -> usize {
    ATTACH_TYPES
        .iter()
        .map(|(_, t)| attached_programs(root, *t).len())
        .sum()
}

#[test]
fn cleanup_removes_pins_tables_interface_and_cgroups() {
    if !root_or_skip("agent cleanup") {
        return;
    }
    // A pin directory of this test's own, so the rest of the suite's pins are not touched.
    let bpffs = format!("/sys/fs/bpf/egress-test-cleanup-{}", std::process::id());
    let cfg = TestConfig::new(&format!("[agent]\nbpffs = \"{bpffs}\"\n"));

    // 1. Something to clean: programs pinned by an exec run, and the host-side pieces the
    //    daemon creates (nftables tables, the proxy interface), made here by the agent's own code
    //    paths through a first `exec` + an explicit table.
    let before_any = if exec_root().exists() {
        attached_on(&exec_root())
    } else {
        0
    };
    let out = exec_cmd("deny_all", Some(&cfg.path))
        .arg("true")
        .output()
        .expect("exec");
    assert!(
        out.status.success(),
        "exec failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        Path::new(&bpffs).join("maps").exists(),
        "exec pinned its maps under {bpffs}"
    );
    let with_ours = attached_on(&exec_root());
    assert!(
        with_ours > before_any,
        "exec attached programs on the exec root ({before_any} -> {with_ours})"
    );
    assert!(
        sh_quiet("nft add table inet egress_agent"),
        "create the agent table"
    );
    assert!(
        sh_quiet("ip link add egress0 type bridge || ip link show egress0"),
        "create the agent interface"
    );

    // 2. cleanup.
    let out = Command::new(agent_bin())
        .args(["cleanup", "--config"])
        .arg(&cfg.path)
        .output()
        .expect("cleanup");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cleanup failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("removed pins"), "{stdout}");

    // 3. Nothing of it is left.
    assert!(!Path::new(&bpffs).exists(), "pins under {bpffs} removed");
    assert!(
        !sh_quiet("nft list table inet egress_agent"),
        "inet table removed"
    );
    assert!(
        !sh_quiet("nft list table bridge egress_agent"),
        "bridge table removed"
    );
    assert!(!sh_quiet("ip link show egress0"), "egress0 removed");
    if exec_root().exists() {
        // Another pin set (the suite's default one) may still be attached there; ours is gone.
        assert_eq!(
            attached_on(&exec_root()),
            before_any,
            "our programs detached"
        );
    }

    // 4. Running it again is harmless (idempotent uninstall).
    let again = Command::new(agent_bin())
        .args(["cleanup", "--config"])
        .arg(&cfg.path)
        .output()
        .expect("cleanup again");
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}
