//! Secrets and keys on the host: an environment secret leaves no trace in `/proc/<pid>/environ`
//! nor in child processes, and the CA key is never visible with a wider mode than 0600, not even
//! for a moment (with umask 0).
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use egress_agent::config::Config;

const VAR: &str = "EGRESS_TEST_ENV_SECRET";
const VALUE: &str = "env-secret-Hk29xQ-must-vanish";

/// Child half of `env_secret_is_scrubbed_from_proc_and_children` (runs only when spawned by it).
#[test]
#[ignore = "spawned by env_secret_is_scrubbed_from_proc_and_children"]
fn env_secret_child() {
    if std::env::var_os("EGRESS_TEST_CHILD").is_none() {
        return;
    }
    let toml = format!(
        r#"
[policies.p]
allow_hosts = ["api.test"]
[[policies.p.credentials]]
host = "api.test"
header = "x-api-key"
source = {{ env = "{VAR}" }}
"#
    );
    let c = Config::from_toml_str(&toml, Path::new("env.toml")).unwrap();
    let s = c.policy("p").unwrap().credentials[0]
        .secret
        .clone()
        .unwrap();
    assert_eq!(s.expose(), VALUE.as_bytes());
    // A reload finds it again though it is gone from the environment.
    let again = Config::from_toml_str(&toml, Path::new("env.toml")).unwrap();
    assert_eq!(again.policy("p").unwrap().credentials[0].secret, Some(s));
    assert!(std::env::var_os(VAR).is_none());
    let child = Command::new("sh")
        .args([
            "-c",
            &format!("echo \"child:[${VAR}]\"; cat /proc/self/environ"),
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&child.stdout).into_owned();
    println!("{}", out.lines().next().unwrap_or(""));
    assert!(!out.contains(VALUE));
    println!("READY");
    // Stay alive until the parent closes our stdin.
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).ok();
}

#[test]
fn env_secret_is_scrubbed_from_proc_and_children() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "env_secret_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(VAR, VALUE)
        .env("EGRESS_TEST_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = Vec::new();
    loop {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "child ended early: {seen:?}"
        );
        if l.trim() == "READY" {
            break;
        }
        seen.push(l);
    }
    assert!(seen.iter().any(|l| l.contains("child:[]")), "{seen:?}");
    let environ = std::fs::read(format!("/proc/{}/environ", child.id())).unwrap();
    let needle = VALUE.as_bytes();
    assert!(
        !environ.windows(needle.len()).any(|w| w == needle),
        "the secret is still in /proc/<pid>/environ"
    );
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn key_files_never_appear_with_a_wider_mode() {
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    let dir = std::env::temp_dir().join(format!("egress-keymode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (dir, stop) = (dir.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut looks = 0u64;
            let mut wide = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let Ok(subs) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for sub in subs.flatten() {
                    let Ok(files) = std::fs::read_dir(sub.path()) else {
                        continue;
                    };
                    for f in files.flatten() {
                        let name = f.file_name().to_string_lossy().into_owned();
                        if !name.contains("ca-key") {
                            continue;
                        }
                        if let Ok(m) = std::fs::symlink_metadata(f.path()) {
                            looks += 1;
                            if m.mode() & 0o077 != 0 {
                                wide.push(format!("{name} {:o}", m.mode()));
                            }
                        }
                    }
                }
            }
            (looks, wide)
        })
    };
    for i in 0..40 {
        let state = dir.join(format!("s{i}"));
        let ca = egress_agent::ca::AgentCa::load_or_create(&state).unwrap();
        assert!(ca.cert_pem().contains("BEGIN CERTIFICATE"));
        assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o777, 0o700);
        assert_eq!(
            std::fs::metadata(state.join("ca-key.pem")).unwrap().mode() & 0o777,
            0o600
        );
    }
    stop.store(true, Ordering::Relaxed);
    let (looks, wide) = watcher.join().unwrap();
    assert!(wide.is_empty(), "seen with a wider mode: {wide:?}");
    assert!(looks > 0, "the watcher never saw a key file");
    // Under systemd's UMask=0077 the public certificate is still readable (0644), the key 0600.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let state = dir.join("umask077");
    egress_agent::ca::AgentCa::load_or_create(&state).unwrap();
    let mode = |f: &str| std::fs::metadata(state.join(f)).unwrap().mode() & 0o777;
    assert_eq!(
        (mode("ca-key.pem"), mode("ca.pem"), mode("ca-bundle.pem")),
        (0o600, 0o644, 0o644)
    );
    std::fs::remove_dir_all(&dir).ok();
}
