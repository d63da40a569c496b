//! `egress-agent check`: a valid file prints the effective policies; a broken one is refused with
//! the file, line and field, and a non-zero exit.

use std::process::Command;

fn check(config: &str) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!(
        "egress-cli-check-{}-{}",
        std::process::id(),
        config.len()
    ));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join("config.toml");
    std::fs::write(&path, config).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_egress-agent"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .expect("run egress-agent check");
    std::fs::remove_dir_all(&dir).ok();
    out
}

#[test]
fn valid_config_prints_effective_policies() {
    let out = check(
        "[agent]\ndefault_policy = \"reviewer\"\n\n[policies.reviewer]\nallow_hosts = [\"github.com\", \"*.github.com\"]\n",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["valid"], true);
    assert_eq!(v["default_policy"], "reviewer");
    assert_eq!(v["policies"]["reviewer"]["mode"], "allowlist");
    assert_eq!(
        v["policies"]["reviewer"]["allow_ports"],
        serde_json::json!([443])
    );
    assert_eq!(
        v["policies"]["reviewer"]["allow_hosts"],
        serde_json::json!(["github.com", "*.github.com"])
    );
    assert_eq!(v["policies"]["deny_all"]["mode"], "deny_all");
}

#[test]
fn broken_config_names_file_line_and_field() {
    let out = check(
        "[policies.ci]\nmode = \"allowlist\"\nallow_hosts = [\"github.com\"]\nallow_port = [443]\n",
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config.toml"), "names the file: {err}");
    assert!(err.contains(":4:"), "names the line: {err}");
    assert!(err.contains("allow_port"), "names the field: {err}");
    assert!(
        out.stdout.is_empty(),
        "prints no policies for a refused file"
    );
}

#[test]
fn unknown_default_policy_is_refused() {
    let out = check("[agent]\ndefault_policy = \"nope\"\n");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope"), "{err}");
}

/// `check` stays strict about secrets (serving keeps the other policies running and refuses the
/// binding's host): a binding whose secret can't be loaded fails it, naming the field and the
/// source, never anything of a secret.
#[test]
fn a_binding_whose_secret_cannot_load_fails_check() {
    let out = check(
        "[policies.p]\nallow_hosts = [\"api.test\"]\n[[policies.p.credentials]]\nhost = \"api.test\"\nheader = \"x-api-key\"\nsource = { file = \"/nonexistent/egress-check-secret\" }\n",
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(":6:1: policies.p.credentials[0].source: can't read secret file /nonexistent/egress-check-secret"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_egress-agent"))
        .args(args)
        .output()
        .expect("run egress-agent")
}

#[test]
fn presets_lists_them_and_show_prints_every_host() {
    let out = run(&["presets"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for name in ["github", "anthropic", "openai", "python", "certificates"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(name) && l.contains("hosts")),
            "{name} in {text}"
        );
    }
    let out = run(&["presets", "show", "github", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["name"], "github");
    assert!(
        v["hosts"].as_array().is_some_and(
            |h| h.contains(&serde_json::json!({ "host": "ssh.github.com", "ports": [443] }))
        ),
        "{v}"
    );
    let out = run(&["presets", "show", "gitlab"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no preset named \"gitlab\"") && err.contains("github"),
        "{err}"
    );
}

#[test]
fn a_policy_with_presets_is_shown_unflattened_and_an_unknown_one_is_located() {
    let out = check("[policies.agent]\npresets = [\"openai\"]\nallow_hosts = [\"docs.rs\"]\n");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let agent = &v["policies"]["agent"];
    assert_eq!(agent["presets"], serde_json::json!(["openai"]), "{agent}");
    assert_eq!(
        agent["allow_hosts"],
        serde_json::json!(["docs.rs"]),
        "{agent}"
    );
    assert!(
        agent["preset_hosts"]["openai"]
            .as_array()
            .is_some_and(|h| h.contains(&serde_json::json!("api.openai.com"))),
        "{agent}"
    );
    let out = check("[policies.agent]\npresets = [\"openai\", \"gitlab\"]\n");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.toml:2:")
            && err.contains("policies.agent.presets[1]: unknown preset \"gitlab\""),
        "{err}"
    );
}
