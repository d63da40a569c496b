//! Access requests of a command under `egress-agent exec` while a daemon runs (issue #41): the
//! command asks from inside (`POST http://egress.internal/v1/requests` through its own
//! listener, which lives in the exec process), the exec files it with the daemon on the control
//! socket, the operator decides with the CLI, and the exec applies the decision to the
//! command's listener before the command can read it.
//!
//! Real daemon (`egress-agent run`, no Docker), real `exec`, real curl inside; every allowed or
//! refused request is checked at the upstream web server, which logs what arrived.
//!
//! Run as root (CI is root); unprivileged, the test says it skipped.
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use egress_tests::agent::{
    StopOnDrop, TestConfig, agent_bin, api_cli, api_ready, assert_enforcement_intact,
};
use egress_tests::docker::NetNs;
use egress_tests::upstreams::{TempDir, WebServer};
use egress_tests::{marker, root_or_skip};

const PORT: u16 = 18090;

/// The daemon: `egress-agent run` in a network namespace of its own (its proxy endpoint is
/// added there), with the test's policies under its own pins and a Docker socket nobody serves
/// (it waits for Docker; its control API answers meanwhile), no host layer. The command's
/// exec, on the host's network, reaches it on its control socket only.
struct Daemon {
    child: StopOnDrop,
    socket: PathBuf,
    log: PathBuf,
    /// Its cgroup parent (under the cgroup2 mount) and pins, removed when it stops.
    parent: String,
    bpffs: PathBuf,
    /// `policies.d/web.toml`: where a `policy` approval is written.
    web: PathBuf,
    _netns: NetNs,
}

impl Daemon {
    /// Start it on `config` (the exec's), its endpoint and pins made its own.
    fn start(dir: &Path, exec_config: &TestConfig) -> Daemon {
        let socket = dir.join("api.sock");
        let log = dir.join("daemon.log");
        let out = std::fs::File::create(&log).expect("log");
        let err = out.try_clone().expect("log fd");
        let pid = std::process::id();
        let parent = format!("egress-test-execreq-{pid}");
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/egress-test-execreq-{pid}"));
        let config = dir.join("daemon.toml");
        let text = std::fs::read_to_string(&exec_config.path)
            .expect("config")
            .replace(
                &format!("endpoint = \"127.0.0.1:{}\"", exec_config.endpoint_port),
                "endpoint = \"169.254.100.1:3128\"",
            )
            .replace(
                "[agent]\n",
                &format!("[agent]\nbpffs = \"{}\"\n", bpffs.display()),
            );
        // `web` in policies.d, where a `policy` approval writes it.
        let (main, web) = text.split_once("[policies.web]\n").expect("the web policy");
        std::fs::write(&config, main).expect("daemon config");
        let managed = dir.join("policies.d");
        std::fs::create_dir_all(&managed).expect("policies.d");
        std::fs::write(managed.join("web.toml"), web).expect("web.toml");
        let netns = NetNs::new(&format!("egt-execreq-{pid}"));
        let child = Command::new("nsenter")
            .arg(format!("--net={}", netns.path().display()))
            .arg(agent_bin())
            .arg("run")
            .arg("--config")
            .arg(&config)
            .args([
                "--docker-socket",
                &format!("unix://{}", dir.join("no-docker.sock").display()),
            ])
            .args(["--no-nft", "--cgroup-parent", &format!("/{parent}")])
            .arg("--api-socket")
            .arg(&socket)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .expect("spawn the daemon");
        let d = Daemon {
            child: StopOnDrop(child),
            socket,
            log,
            parent,
            bpffs,
            web: dir.join("policies.d").join("web.toml"),
            _netns: netns,
        };
        if let Err(stderr) = api_ready(&agent_bin(), &d.socket, Duration::from_secs(30)) {
            panic!("the daemon did not answer: {stderr}\n{}", d.log());
        }
        d
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        api_cli(&agent_bin(), &self.socket, args)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `egress-agent requests --json`.
    fn requests(&self) -> Vec<serde_json::Value> {
        let o = self.cli(&["requests", "--json"]);
        assert!(o.status.success(), "requests: {o:?}");
        serde_json::from_slice(&o.stdout).expect("requests JSON")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .ok();
        self.child.0.wait().ok();
        std::fs::remove_dir_all(&self.bpffs).ok();
        std::fs::remove_dir(egress_tests::agent::cgroup2_mount().join(&self.parent)).ok();
    }
}

/// A command under `exec` whose stdout is read line by line while it runs; it waits for the
/// test on stdin (`read`).
struct Running {
    child: StopOnDrop,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(cfg: &TestConfig, socket: &Path, run: &str, script: &str) -> Running {
        let mut child: Child = Command::new(agent_bin())
            .args(["exec", "--policy", "web", "--config"])
            .arg(&cfg.path)
            .arg("--api-socket")
            .arg(socket)
            .args(["--label", &format!("egress.run={run}")])
            .args(["--", "sh", "-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run egress-agent exec");
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Running {
            child: StopOnDrop(child),
            stdin,
            lines,
            seen: Vec::new(),
        }
    }

    /// The rest of the first line starting with `prefix` (waits for it).
    fn line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if let Some(rest) = l.strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(_) => panic!(
                    "no {prefix:?} line; the command printed:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn json(&mut self, prefix: &str) -> serde_json::Value {
        let l = self.line(prefix);
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("{prefix} {l:?}: {e}"))
    }

    fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin.write_all(b"go\n").expect("tell the command");
        stdin.flush().expect("flush");
    }

    fn wait(mut self) {
        self.stdin.take();
        let status = self.child.0.wait().expect("wait for exec");
        assert!(status.success(), "exec: {status}\n{}", self.seen.join("\n"));
    }
}

/// The command's script: ask, wait for the decision, retry, for each step the test drives.
fn script(proxy: &str, m: &str) -> String {
    let ask = |host: &str, extra: &str| {
        format!(
            "curl -sS -m 10 -x {proxy} -H 'content-type: application/json' \
             -d '{{\"host\":\"{host}\",\"port\":{PORT},\"reason\":\"the tests need it\"{extra}}}' \
             http://egress.internal/v1/requests"
        )
    };
    let poll = |var: &str| {
        format!(
            "curl -sS -m 70 -x {proxy} \"http://egress.internal/v1/requests/$(echo \"${var}\" | sed 's/.*\"id\":\\([0-9]*\\).*/\\1/')?wait=60\""
        )
    };
    let get = |host: &str, tag: &str| {
        format!(
            "curl -sS -m 10 -x {proxy} -H 'accept: application/json' http://{host}:{PORT}/{tag}-{m}"
        )
    };
    format!(
        r#"
echo "refused: $({get_before})"
f1=$({ask1}); echo "filed: $f1"
echo "decided: $({poll1})"
echo "retry: $({get_after})"
read go
f2=$({ask2}); echo "filed2: $f2"
echo "decided2: $({poll2})"
f3=$({ask3}); echo "filed3: $f3"
echo "decided3: $({poll3})"
echo "retry3: $({get_policy})"
echo "foreign: $({ask_foreign})"
n=0; i=0; while [ $i -lt 12 ]; do
  c=$(curl -sS -o /dev/null -w '%{{http_code}}' -m 10 -x {proxy} -H 'content-type: application/json' -d "{{\"host\":\"flood$i.test\",\"port\":{PORT},\"reason\":\"flood\"}}" http://egress.internal/v1/requests)
  [ "$c" = 429 ] && n=$((n+1)); i=$((i+1))
done
echo "flood-429: $n"
echo "api: $(curl -sS -m 5 --unix-socket {socket} -X POST -d '{{}}' http://egress-agent/v1/exec/requests 2>&1)"
read go
"#,
        get_before = get("granted.test", "before"),
        ask1 = ask("granted.test", ""),
        poll1 = poll("f1"),
        get_after = get("granted.test", "after"),
        ask2 = ask("denied.test", ""),
        poll2 = poll("f2"),
        ask3 = ask("policy.test", ""),
        poll3 = poll("f3"),
        get_policy = get("policy.test", "policy"),
        ask_foreign = ask("other.test", ",\"workload\":\"exec:1\""),
        socket = "SOCKET",
    )
}

#[test]
fn a_command_under_exec_asks_and_the_operator_decides() {
    if !root_or_skip("exec requests") {
        return;
    }
    let dir = TempDir::new("exec-requests");
    let upstream = WebServer::start(
        format!("127.0.0.1:{PORT}").parse().expect("addr"),
        None,
        "granted",
    );
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        "127.0.0.1 granted.test denied.test policy.test other.test\n",
    )
    .expect("hosts");
    let cfg = TestConfig::new(&format!(
        "[dns]\nnameservers = []\nhosts_file = \"{}\"\n[agent]\nstate_dir = \"{}\"\n\n\
         [policies.web]\nallow_hosts = [\"allowed.test\"]\nallow_ports = [{PORT}]\n\
         resolve_private = [\"127.0.0.0/8\"]\n",
        hosts.display(),
        dir.path().join("state").display()
    ));
    let daemon = Daemon::start(dir.path(), &cfg);
    let m = marker("execreq");
    let proxy = format!("http://127.0.0.1:{}", cfg.endpoint_port);
    let socket = daemon.socket.display().to_string();
    let text = script(&proxy, &m).replace("SOCKET", &socket);
    let mut first = Running::start(&cfg, &daemon.socket, "run-a", &text);

    // Refused, with the reason in JSON; nothing arrived.
    let refused = first.json("refused: ");
    assert_eq!(refused["reason"], "host-not-allowed", "{refused}");
    assert!(!upstream.saw(&format!("before-{m}")));

    // Filed: the operator sees it under the exec's name and run.
    let filed = first.json("filed: ");
    assert_eq!(filed["state"], "pending", "{filed}");
    let id = filed["id"].as_u64().expect("id");
    let listed = daemon.requests();
    let mine = listed
        .iter()
        .find(|r| r["id"] == id)
        .unwrap_or_else(|| panic!("request {id} not listed: {listed:?}"));
    assert_eq!(mine["host"], "granted.test");
    assert_eq!(mine["run"], "run-a", "{mine}");
    assert_eq!(mine["workload"], "sh", "the command's name: {mine}");
    let o = daemon.cli(&["requests", "approve", &id.to_string(), "--scope", "run"]);
    assert!(o.status.success(), "approve: {o:?}");

    // The long-poll returns the approval; the retry passes and arrives.
    let decided = first.json("decided: ");
    assert_eq!(
        (decided["state"].as_str(), decided["scope"].as_str()),
        (Some("approved"), Some("run")),
        "{decided}"
    );
    let retry = first.line("retry: ");
    assert!(retry.contains("upstream-ok"), "{retry}");
    assert!(upstream.saw(&format!("after-{m}")), "{:?}", upstream.hits());

    // Another command under the same policy is still refused (the grant is the run's).
    let other = Command::new(agent_bin())
        .args(["exec", "--policy", "web", "--config"])
        .arg(&cfg.path)
        .arg("--api-socket")
        .arg(&daemon.socket)
        .args(["--", "curl", "-sS", "-m", "10", "-x", &proxy])
        .arg(format!("http://granted.test:{PORT}/second-{m}"))
        .stdin(Stdio::null())
        .output()
        .expect("second exec");
    let body = String::from_utf8_lossy(&other.stdout);
    assert!(body.contains("host-not-allowed"), "{body}");
    assert!(
        !upstream.saw(&format!("second-{m}")),
        "the second command's request arrived"
    );
    first.go();

    // Denied with a reason: the command reads it.
    let id2 = first.json("filed2: ")["id"].as_u64().expect("id");
    let o = daemon.cli(&[
        "requests",
        "deny",
        &id2.to_string(),
        "--reason",
        "not for tests",
    ]);
    assert!(o.status.success(), "deny: {o:?}");
    let decided2 = first.json("decided2: ");
    assert_eq!(decided2["state"], "denied", "{decided2}");
    assert_eq!(decided2["reason"], "not for tests");

    // Scope policy: written to the daemon's policy as a change with its diff; this run gets it.
    let id3 = first.json("filed3: ")["id"].as_u64().expect("id");
    let o = daemon.cli(&["requests", "approve", &id3.to_string(), "--scope", "policy"]);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && said.contains("policy.test"),
        "approve policy: {o:?}"
    );
    let decided3 = first.json("decided3: ");
    assert_eq!(decided3["scope"], "policy", "{decided3}");
    assert!(first.line("retry3: ").contains("upstream-ok"));
    assert!(upstream.saw(&format!("policy-{m}")));
    let config = std::fs::read_to_string(&daemon.web).expect("web.toml");
    assert!(
        config.contains("policy.test"),
        "the policy was not written:\n{config}"
    );
    let changes = Command::new("curl")
        .args(["-sS", "-m", "5", "--unix-socket"])
        .arg(&daemon.socket)
        .arg("http://egress-agent/v1/changes")
        .output()
        .expect("curl /v1/changes");
    let changes = String::from_utf8_lossy(&changes.stdout);
    assert!(
        changes.contains("+allow_hosts") || changes.contains("policy.test"),
        "no recorded change with its diff: {changes}"
    );

    // A body naming a workload is refused; a flood is capped; the control socket refuses the
    // confined command.
    let foreign = first.line("foreign: ");
    assert!(foreign.contains("unknown field"), "{foreign}");
    assert!(!daemon.requests().iter().any(|r| r["host"] == "other.test"));
    let flood: usize = first.line("flood-429: ").trim().parse().expect("count");
    assert!(
        flood >= 1,
        "12 requests at once: some must be refused (429)"
    );
    let api = first.line("api: ");
    assert!(
        !api.contains("\"id\""),
        "the confined command filed through the control socket: {api}"
    );
    let pending: Vec<u64> = daemon
        .requests()
        .iter()
        .filter(|r| r["state"] == "pending" && r["run"] == "run-a")
        .filter_map(|r| r["id"].as_u64())
        .collect();
    assert!(!pending.is_empty(), "the flood's first requests wait");

    // An unprivileged host process can't file for a command.
    let nobody = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "curl",
            "-sS",
            "-m",
            "5",
            "--unix-socket",
        ])
        .arg(&daemon.socket)
        .args([
            "-X",
            "POST",
            "-d",
            "{}",
            "http://egress-agent/v1/exec/requests",
        ])
        .output()
        .expect("setpriv curl");
    assert!(
        !String::from_utf8_lossy(&nobody.stdout).contains("\"id\""),
        "{nobody:?}"
    );

    // The command ends: a run approval of its request has nothing to go to.
    first.go();
    first.wait();
    let o = daemon.cli(&[
        "requests",
        "approve",
        &pending[0].to_string(),
        "--scope",
        "run",
    ]);
    assert!(
        !o.status.success(),
        "approved for an exec that ended: {o:?}"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("has ended"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    drop(daemon);
    assert_enforcement_intact("after exec requests");
}
