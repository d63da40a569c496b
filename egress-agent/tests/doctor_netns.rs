//! The nf_tables netlink dump against a real ruleset, in a private network namespace (root only;
//! the host's ruleset is never read or touched). Skips loudly without root, `unshare` or `nft`.
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use egress_agent::doctor::{self, Options, Status};

const CHILD_ENV: &str = "EGRESS_DOCTOR_NETNS_CHILD";

const RULESET: &str = "\
table inet egress_agent {
}
table bridge egress_agent {
}
table inet filter {
  chain input { type filter hook input priority 0; policy drop; }
  chain forward { type filter hook forward priority 0; policy accept; }
}
table ip docker_like {
  chain fwd4 { type filter hook forward priority 0; policy drop; }
}
";

fn which(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.exists())
}

fn opts() -> Options {
    let none = std::env::temp_dir().join("egress-doctor-netns-none");
    Options {
        pin_dir: none.join("pins"),
        docker_socket: none.join("docker.sock"),
        tool_path: Some("".into()),
        deadline: Duration::from_secs(5),
        ..Options::default()
    }
}

/// Runs inside the namespace (started by the parent test below).
#[test]
fn netns_child() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let r = doctor::run(opts());
    print!("{}", r.to_text());
    let get = |id: &str| {
        r.checks
            .iter()
            .find(|c| c.id == id)
            .cloned()
            .unwrap_or_else(|| panic!("{id}"))
    };
    match mode.as_str() {
        "ruleset" => {
            assert_eq!(
                get("nft.agent_table").status,
                Status::Pass,
                "{:?}",
                get("nft.agent_table")
            );
            let input = get("host.firewall_input");
            assert_eq!(input.status, Status::Pass, "{input:?}");
            assert!(
                input.summary.contains("nft inet filter input policy drop"),
                "{input:?}"
            );
            let fwd = get("host.firewall_forward");
            assert_eq!(fwd.status, Status::Warn, "{fwd:?}");
            assert!(fwd.summary.contains("accepts IPv6"), "{fwd:?}");
            assert!(
                fwd.summary.contains("nft ip docker_like fwd4 policy drop"),
                "{fwd:?}"
            );
        }
        "empty" => {
            let t = get("nft.agent_table");
            assert_eq!(t.status, Status::Fail, "{t:?}");
            assert!(
                t.summary.contains("inet egress_agent, bridge egress_agent"),
                "{t:?}"
            );
            assert!(
                get("host.firewall_input")
                    .summary
                    .contains("no base chains")
            );
        }
        other => panic!("unknown mode {other}"),
    }
}

fn run_in_netns(mode: &str, ruleset: Option<&str>) {
    let (Some(unshare), Some(nft)) = (which("unshare"), which("nft")) else {
        eprintln!("skipping: unshare or nft not installed");
        return;
    };
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: needs root (private network namespace)");
        return;
    }
    let file = std::env::temp_dir().join(format!(
        "egress-doctor-netns-{}-{mode}.nft",
        std::process::id()
    ));
    std::fs::write(&file, ruleset.unwrap_or("")).expect("write ruleset");
    let exe = std::env::current_exe().expect("current exe");
    let script = r#"[ ! -s "$1" ] || "$2" -f "$1" || exit 97; exec "$3" --exact netns_child --nocapture --test-threads=1"#;
    let out = Command::new(unshare)
        .args(["--net", "--", "/bin/sh", "-c", script, "sh"])
        .arg(&file)
        .arg(nft)
        .arg(exe)
        .env(CHILD_ENV, mode)
        .output()
        .expect("run unshare");
    std::fs::remove_file(&file).ok();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(97) || stderr.contains("unshare failed") {
        eprintln!("skipping: could not set up the namespace: {stderr}");
        return;
    }
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "child ran no test:\n{stdout}");
}

#[test]
fn reads_a_real_ruleset_over_netlink() {
    run_in_netns("ruleset", Some(RULESET));
}

#[test]
fn reports_missing_agent_tables_on_an_empty_ruleset() {
    run_in_netns("empty", None);
}
