//! `egress-agent events` and `suggest` as an operator runs them when no daemon answers: the
//! store under the config's `agent.state_dir`, read-only, with the selection flags, `--flows`,
//! `--follow` (new rows appear as the store is written), and the errors when there is no store.
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use egress_agent::events::{ContainerRef, DenialEvent, Verdict};
use egress_agent::store::{FlowBatch, Store, add_flow};

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn setup(name: &str) -> (Dir, PathBuf) {
    let dir = std::env::temp_dir().join(format!("egress-cli-events-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\nstate_dir = \"{}\"\n[policies.ci]\nenforce = \"audit\"\nallow_hosts = [\"github.com\"]\n",
            dir.join("state").display()
        ),
    )
    .unwrap();
    (Dir(dir), config)
}

fn ev(host: &str, policy: &str, verdict: Verdict, run: &str) -> DenialEvent {
    let mut e = DenialEvent::proxy(
        policy,
        Some(host.into()),
        None,
        443,
        "connect",
        "host-not-allowed",
    )
    .with_verdict(verdict);
    e.container = Some(ContainerRef {
        id: "abcdef123456".into(),
        name: "job".into(),
    });
    e.context.insert("run".into(), run.into());
    e
}

fn write(db: &Path, events: &[DenialEvent]) {
    let mut s = Store::open(db).unwrap();
    let mut batch = FlowBatch::new();
    for e in events {
        add_flow(&mut batch, e);
    }
    s.write(events, &batch).unwrap();
}

/// `egress-agent ARGS --config CONFIG` (and, for `events`, a control socket nobody serves).
fn cli(config: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_egress-agent"));
    c.args(args).arg("--config").arg(config);
    if args[0] == "events" {
        c.args(["--api-socket", "/nonexistent/egress-agent/api.sock"]);
    }
    c.output().unwrap()
}

fn lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn events_read_the_store_when_no_daemon_answers() {
    let (dir, config) = setup("read");
    // No store yet: a clear error, non-zero.
    let o = cli(&config, &["events"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("can't reach the egress-agent daemon"), "{err}");
    assert!(err.contains("no event store at"), "{err}");

    let db = dir.0.join("state/events.db");
    write(
        &db,
        &[
            ev("a.example", "ci", Verdict::WouldDeny, "1"),
            ev("b.example", "ci", Verdict::Deny, "2"),
            {
                let mut e = ev("github.com", "ci", Verdict::Allow, "1");
                e.rule = Some("allow_hosts github.com".into());
                e
            },
            ev("c.example", "web", Verdict::WouldDeny, "1"),
        ],
    );
    let o = cli(&config, &["events", "-n", "10"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("reading the event store"));
    let all = lines(&o);
    let hosts: Vec<&str> = all.iter().map(|e| e["host"].as_str().unwrap()).collect();
    // Allowed traffic is flows, not events; oldest first.
    assert_eq!(hosts, ["a.example", "b.example", "c.example"]);
    assert_eq!(all[0]["verdict"], "would-deny");
    assert_eq!(all[0]["container"]["name"], "job");
    let o = cli(
        &config,
        &[
            "events",
            "--policy",
            "ci",
            "--verdict",
            "would-deny",
            "--run",
            "1",
        ],
    );
    let sel = lines(&o);
    assert_eq!(sel.len(), 1, "{sel:?}");
    assert_eq!(sel[0]["host"], "a.example");
    assert_eq!(
        lines(&cli(&config, &["events", "--container", "abcdef"])).len(),
        3
    );
    assert_eq!(lines(&cli(&config, &["events", "--since", "1h"])).len(), 3);
    assert!(
        lines(&cli(
            &config,
            &["events", "--since", "2000-01-01T00:00:00Z", "-n", "1"]
        ))[0]["host"]
            == "c.example"
    );
    let o = cli(&config, &["events", "--verdict", "maybe"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown verdict \"maybe\""));
    // Flows include the allowed traffic, with counts.
    let flows = lines(&cli(&config, &["events", "--flows", "--verdict", "allow"]));
    assert_eq!(flows.len(), 1);
    assert_eq!(flows[0]["host"], "github.com");
    assert_eq!(flows[0]["count"], 1);
    assert_eq!(flows[0]["rule"], "allow_hosts github.com");
    // A flow no rule decided has no `rule` field (as events have none).
    let flows = lines(&cli(&config, &["events", "--flows", "--policy", "web"]));
    assert_eq!(flows.len(), 1);
    assert!(flows[0].get("rule").is_none(), "{:?}", flows[0]);
    // suggest reads the same store.
    let o = cli(&config, &["suggest", "--run", "1", "--policy", "ci"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("[policies.ci]")
            && text.contains("\"a.example\"")
            && text.contains("\"github.com\""),
        "{text}"
    );
    assert!(
        !text.contains("b.example") && !text.contains("c.example"),
        "{text}"
    );
    let o = cli(&config, &["suggest", "--run", "1", "--diff"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--diff: the selection spans policies ci, web")
    );
}

#[test]
fn follow_without_a_daemon_tails_the_store() {
    let (dir, config) = setup("follow");
    let db = dir.0.join("state/events.db");
    write(&db, &[ev("old.example", "ci", Verdict::WouldDeny, "1")]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_egress-agent"))
        .args(["events", "--follow", "--verdict", "would-deny", "--config"])
        .arg(&config)
        .args(["--api-socket", "/nonexistent/egress-agent/api.sock"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    // Only what is written from now on, filtered.
    std::thread::sleep(Duration::from_millis(700));
    write(
        &db,
        &[
            ev("denied.example", "ci", Verdict::Deny, "1"),
            ev("new.example", "ci", Verdict::WouldDeny, "1"),
        ],
    );
    let line = rx.recv_timeout(Duration::from_secs(10));
    child.kill().ok();
    child.wait().ok();
    let line = line.expect("nothing followed within 10 s");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["host"], "new.example", "{line}");
}
