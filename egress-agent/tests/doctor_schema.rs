//! The `doctor --json` document is a stable interface: probe ids, their order, and the field names
//! are pinned here. Adding a probe means appending its id to GOLDEN; renaming or removing one is a
//! breaking change.
use std::time::Duration;

use egress_agent::doctor::{self, HostPaths, Options, PROBE_IDS};

const GOLDEN: &[&str] = &[
    "kernel.cgroup2",
    "kernel.btf",
    "kernel.bpf_lsm",
    "kernel.cgroup_bpf",
    "kernel.nf_tables",
    "kernel.unprivileged_bpf",
    "bpf.bpffs",
    "bpf.pinned",
    "proxy.listening",
    "docker.reachable",
    "docker.cgroup_driver",
    "docker.net_raw",
    "docker.privileged",
    "nft.agent_table",
    "host.firewall_input",
    "host.firewall_forward",
    "host.ip_forward",
    "containerd.pod_annotations",
    "proxy.interception",
    "workloads.secrets",
    "host.ssh_password_auth",
    "host.ssh_root_login",
    "host.fail2ban",
    "host.tailscale",
    "host.firewalld",
    "host.ufw",
    "docker.seccomp",
    "docker.userns",
    "docker.rootless",
];

#[test]
fn probe_ids_are_the_golden_list() {
    assert_eq!(PROBE_IDS, GOLDEN);
}

/// A host with nothing: every file missing, no tools, no Docker, no netlink.
fn empty_host_report() -> doctor::Report {
    let root = std::env::temp_dir().join("egress-doctor-schema-nonexistent");
    let opts = Options {
        paths: HostPaths::under(&root, "0.0.0"),
        pin_dir: root.join("bpf/egress-agent"),
        docker_socket: root.join("docker.sock"),
        docker_daemon_json: root.join("daemon.json"),
        sshd_config: root.join("sshd_config"),
        tool_path: Some("".into()),
        netlink: false,
        deadline: Duration::from_secs(5),
        ..Options::default()
    };
    doctor::run(opts)
}

/// The stable array: one object per probe, in GOLDEN order, with exactly the documented fields.
#[track_caller]
fn assert_stable_array(v: &serde_json::Value) {
    let arr = v.as_array().expect("top level is an array");
    assert_eq!(arr.len(), GOLDEN.len());
    for (obj, id) in arr.iter().zip(GOLDEN) {
        let o = obj.as_object().expect("each element is an object");
        let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["fix", "id", "status", "summary"], "{obj}");
        assert_eq!(o["id"], *id);
        let status = o["status"].as_str().expect("status is a string");
        assert!(["pass", "warn", "fail", "skip"].contains(&status), "{obj}");
        assert!(o["summary"].is_string(), "{obj}");
        if status == "pass" {
            assert!(o["fix"].is_null(), "{obj}");
        } else {
            assert!(o["fix"].is_string(), "{obj}");
        }
    }
}

#[test]
fn json_has_the_documented_shape() {
    let report = empty_host_report();
    let v: serde_json::Value = serde_json::from_str(&report.to_json()).expect("valid JSON");
    assert_stable_array(&v);
    assert_eq!(report.to_json_with(None), report.to_json());
}

#[test]
fn json_with_a_baseline_wraps_the_same_array() {
    let report = empty_host_report();
    let verdict = doctor::baseline::get("minimal")
        .expect("minimal baseline")
        .judge(&report);
    let v: serde_json::Value =
        serde_json::from_str(&report.to_json_with(Some(&verdict))).expect("valid JSON");
    let o = v.as_object().expect("top level is an object");
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["baseline", "checks"]);
    assert_stable_array(&o["checks"]);
    let plain: serde_json::Value = serde_json::from_str(&report.to_json()).expect("valid JSON");
    assert_eq!(o["checks"], plain);

    let b = o["baseline"].as_object().expect("baseline is an object");
    let mut keys: Vec<&str> = b.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["met", "missing", "name", "required"]);
    assert_eq!(b["name"], "minimal");
    // Nothing is there: the baseline is missed, each miss an {id, status}.
    assert_eq!(b["met"], false);
    assert!(b["required"].as_u64().is_some_and(|n| n > 0));
    let missing = b["missing"].as_array().expect("missing is an array");
    assert!(!missing.is_empty());
    for m in missing {
        let m = m.as_object().expect("a miss is an object");
        let mut keys: Vec<&str> = m.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["id", "status"]);
        assert!(GOLDEN.contains(&m["id"].as_str().expect("id")));
        assert_ne!(m["status"], "pass");
    }
}
