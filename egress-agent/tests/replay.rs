//! `egress-agent replay` on a real event store, as an operator runs it: a realistic mix of
//! recorded traffic (proxy names, IP literals, DNS, an address refused at dial time, a refused
//! request, direct and refused kernel connections, refusals no policy decides, another policy's
//! flows) written in batches through `Store::write`, then replayed under a tighter, a looser and
//! the unchanged policy. Each bucket's numbers must equal what the store itself holds for the
//! flows that by construction land there (sums of `flows.count` by SQL, in this test), and the
//! unchanged policy must change nothing. Then the command's errors and its text.
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, SystemTime};

use egress_agent::events::{ContainerRef, DenialEvent, Source, Verdict};
use egress_agent::store::{FlowBatch, Store, add_flow};
use serde_json::Value;

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// The policy the traffic was recorded under.
const RECORDED: &str = r#"[policies.ci]
allow_hosts = ["github.com", "*.github.com", "pypi.org", "files.pythonhosted.org"]
allow_cidrs = [{ cidr = "10.0.0.5/32", ports = [5432] }]
[[policies.ci.request_rules]]
host = "api.github.com"
action = "deny"
methods = ["DELETE"]
path = "/repos/**"
"#;

/// Drops `*.github.com` and files.pythonhosted.org.
const TIGHTER: &str = r#"[policies.ci]
allow_hosts = ["github.com", "pypi.org"]
allow_cidrs = [{ cidr = "10.0.0.5/32", ports = [5432] }]
"#;

/// Adds evil.example, port 22, the address 8.8.8.8, and drops the request rule.
const LOOSER: &str = r#"[policies.ci]
allow_hosts = ["github.com", "*.github.com", "pypi.org", "files.pythonhosted.org", "evil.example"]
allow_ports = [443, 22]
allow_cidrs = [{ cidr = "10.0.0.5/32", ports = [5432] }, { cidr = "8.8.8.8/32", ports = [443] }]
"#;

fn setup(name: &str) -> (Dir, PathBuf) {
    let dir = std::env::temp_dir().join(format!("egress-replay-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\nstate_dir = \"{}\"\n{RECORDED}",
            dir.join("state").display()
        ),
    )
    .unwrap();
    (Dir(dir), config)
}

/// One kind of recorded traffic: `n` events.
struct Traffic {
    n: usize,
    source: Source,
    verdict: Verdict,
    policy: &'static str,
    host: Option<&'static str>,
    ip: Option<&'static str>,
    port: u16,
    protocol: &'static str,
    reason: &'static str,
    rule: Option<&'static str>,
    labels: &'static [(&'static str, &'static str)],
}

const T: Traffic = Traffic {
    n: 1,
    source: Source::Proxy,
    verdict: Verdict::Allow,
    policy: "ci",
    host: None,
    ip: None,
    port: 443,
    protocol: "connect",
    reason: "allowed",
    rule: None,
    labels: &[],
};

fn mix() -> Vec<Traffic> {
    let deny = Verdict::Deny;
    vec![
        Traffic {
            n: 50,
            host: Some("github.com"),
            rule: Some("allow_hosts github.com"),
            ..T
        },
        Traffic {
            n: 120,
            host: Some("api.github.com"),
            rule: Some("allow_hosts *.github.com"),
            ..T
        },
        Traffic {
            n: 30,
            host: Some("codeload.github.com"),
            rule: Some("allow_hosts *.github.com"),
            protocol: "tls",
            ..T
        },
        Traffic {
            n: 40,
            host: Some("pypi.org"),
            rule: Some("allow_hosts pypi.org"),
            ..T
        },
        Traffic {
            n: 60,
            host: Some("files.pythonhosted.org"),
            rule: Some("allow_hosts files.pythonhosted.org"),
            ..T
        },
        Traffic {
            n: 5,
            verdict: deny,
            host: Some("evil.example"),
            reason: "host-not-allowed",
            ..T
        },
        Traffic {
            n: 3,
            verdict: deny,
            host: Some("github.com"),
            port: 22,
            reason: "port-not-allowed",
            rule: Some("allow_hosts github.com"),
            ..T
        },
        Traffic {
            n: 2,
            verdict: deny,
            ip: Some("8.8.8.8"),
            reason: "ip-literal-not-allowed",
            ..T
        },
        Traffic {
            n: 4,
            verdict: deny,
            host: Some("registry.github.com"),
            ip: Some("10.1.1.1"),
            reason: "address-denied",
            rule: Some("the built-in deny list (rfc1918)"),
            ..T
        },
        Traffic {
            n: 7,
            verdict: deny,
            host: Some("evil.example"),
            port: 53,
            protocol: "dns",
            reason: "host-not-allowed",
            ..T
        },
        Traffic {
            n: 2,
            verdict: deny,
            host: Some("api.github.com"),
            protocol: "https",
            reason: "request-denied-by-rule",
            rule: Some("request_rules deny api.github.com:443 DELETE /repos/**"),
            labels: &[("method", "DELETE"), ("path", "/repos/acme/api")],
            ..T
        },
        Traffic {
            n: 3,
            verdict: deny,
            ip: Some("1.2.3.4"),
            protocol: "tls",
            reason: "tls-no-sni",
            ..T
        },
        Traffic {
            n: 10,
            source: Source::Kernel,
            ip: Some("10.0.0.5"),
            port: 5432,
            protocol: "tcp",
            labels: &[("hook", "connect4")],
            ..T
        },
        Traffic {
            n: 6,
            source: Source::Kernel,
            verdict: deny,
            ip: Some("1.1.1.1"),
            port: 8443,
            protocol: "tcp",
            reason: "kernel-destination-not-allowed",
            labels: &[("hook", "connect4")],
            ..T
        },
        Traffic {
            n: 1,
            source: Source::Kernel,
            verdict: deny,
            ip: Some("1.1.1.1"),
            port: 53,
            protocol: "udp",
            reason: "kernel-destination-not-allowed",
            labels: &[("hook", "sendmsg4")],
            ..T
        },
        Traffic {
            n: 2,
            source: Source::Kernel,
            verdict: deny,
            port: 0,
            protocol: "socket(family=17, type=3)",
            reason: "kernel-socket-type-not-allowed",
            labels: &[("hook", "sock_create")],
            ..T
        },
        Traffic {
            n: 1,
            source: Source::Agent,
            verdict: deny,
            host: Some("api.github.com"),
            protocol: "https",
            reason: "interception-unavailable",
            ..T
        },
        Traffic {
            n: 9,
            policy: "web",
            host: Some("github.com"),
            rule: Some("allow_hosts github.com"),
            ..T
        },
    ]
}

/// The mix as events: spread over two containers and runs and the last hour, written in
/// batches of 100 as the store's writer commits them.
fn record(db: &Path) {
    let mut store = Store::open(db).unwrap();
    let now = SystemTime::now();
    let mut events = Vec::new();
    for t in mix() {
        for i in 0..t.n {
            let mut e = DenialEvent::proxy(
                t.policy,
                t.host.map(str::to_owned),
                t.ip.map(|ip| ip.parse().unwrap()),
                t.port,
                t.protocol,
                t.reason,
            )
            .with_verdict(t.verdict);
            e.source = t.source;
            e.rule = t.rule.map(str::to_owned);
            let job = i % 2;
            e.container = Some(ContainerRef {
                id: format!("c0ffee{job}"),
                name: format!("job-{job}"),
            });
            e.context.insert("run".into(), format!("{}", 100 + job));
            e.context.insert("pid".into(), format!("{}", 1000 + i));
            for (k, v) in t.labels {
                e.context.insert((*k).into(), (*v).into());
            }
            e.time = now - Duration::from_secs(3600) + Duration::from_secs(i as u64);
            events.push(e);
        }
    }
    for chunk in events.chunks(100) {
        let mut batch = FlowBatch::new();
        for e in chunk {
            add_flow(&mut batch, e);
        }
        store.write(chunk, &batch).unwrap();
    }
}

fn cli(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_egress-agent"))
        .arg("replay")
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap()
}

fn report(config: &Path, file: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["--policy", file.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    if !extra.contains(&"--limit") {
        args.extend(["--limit", "0"]);
    }
    let o = cli(config, &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Sum of `flows.count` where `cond`, straight from the store's file.
fn sum(db: &Path, cond: &str) -> u64 {
    let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .unwrap();
    let n: i64 = c
        .query_row(
            &format!("SELECT coalesce(sum(count), 0) FROM flows WHERE {cond}"),
            [],
            |r| r.get(0),
        )
        .unwrap();
    n as u64
}

fn events(v: &Value, bucket: &str) -> u64 {
    v["totals"][bucket]["events"].as_u64().unwrap()
}

/// What no proposed policy here decides: TLS without SNI, a socket type, an agent event, and
/// DNS to any address (the kernel sends it to the agent's responder under every allowlist).
const NOT_REPLAYABLE: &str = "(reason IN ('tls-no-sni', 'kernel-socket-type-not-allowed') OR source = 'agent' OR (source = 'kernel' AND port = 53))";
const PASSED: &str = "verdict != 'deny'";

#[test]
fn each_bucket_holds_what_the_store_counts_for_it() {
    let (dir, config) = setup("counts");
    let db = dir.0.join("state/events.db");
    record(&db);
    let ci = "policy = 'ci'";
    let all_ci = sum(&db, ci);
    assert_eq!(all_ci, 346, "the mix");
    let file = |name: &str, text: &str| {
        let f = dir.0.join(name);
        std::fs::write(&f, text).unwrap();
        f
    };

    // Tighter: what passed to *.github.com and files.pythonhosted.org breaks.
    let v = report(&config, &file("tighter.toml", TIGHTER), &[]);
    assert_eq!(v["events"].as_u64(), Some(all_ci));
    let newly_denied = sum(
        &db,
        &format!(
            "{ci} AND {PASSED} AND source = 'proxy' AND (host LIKE '%.github.com' OR host = 'files.pythonhosted.org')"
        ),
    );
    assert_eq!(newly_denied, 210);
    assert_eq!(events(&v, "newly_denied"), newly_denied);
    assert_eq!(events(&v, "newly_allowed"), 0);
    assert_eq!(
        events(&v, "unchanged_allowed"),
        sum(
            &db,
            &format!(
                "{ci} AND {PASSED} AND (host IN ('github.com', 'pypi.org') OR ip = '10.0.0.5')"
            )
        )
    );
    assert_eq!(
        events(&v, "not_replayable"),
        sum(&db, &format!("{ci} AND {NOT_REPLAYABLE}"))
    );
    assert_eq!(
        events(&v, "unchanged_denied"),
        sum(
            &db,
            &format!("{ci} AND verdict = 'deny' AND NOT {NOT_REPLAYABLE}")
        )
    );
    let first = &v["destinations"][0];
    assert_eq!(
        (
            first["bucket"].as_str(),
            first["destination"].as_str(),
            first["events"].as_u64()
        ),
        (Some("newly_denied"), Some("api.github.com:443"), Some(120))
    );
    assert_eq!(first["was"][0]["rule"], "allow_hosts *.github.com");
    assert_eq!(first["now"]["reason"], "host-not-allowed");
    let runs: Vec<&str> = first["examples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["run"].as_str().unwrap())
        .collect();
    assert_eq!(runs.len(), 2, "two containers' flows: {first}");

    // Looser: what was refused for evil.example, port 22, 8.8.8.8 and the request passes.
    let v = report(&config, &file("looser.toml", LOOSER), &[]);
    let newly_allowed = sum(
        &db,
        &format!(
            "{ci} AND verdict = 'deny' AND (host = 'evil.example' OR port = 22 OR ip = '8.8.8.8' OR reason = 'request-denied-by-rule')"
        ),
    );
    assert_eq!(newly_allowed, 19);
    assert_eq!(events(&v, "newly_allowed"), newly_allowed);
    assert_eq!(events(&v, "newly_denied"), 0);
    assert_eq!(
        events(&v, "unchanged_denied"),
        sum(
            &db,
            &format!("{ci} AND verdict = 'deny' AND (ip = '10.1.1.1' OR port = 8443)")
        )
    );

    // The policy in force: nothing changes.
    let v = report(&config, &file("same.toml", RECORDED), &[]);
    for b in ["newly_denied", "newly_allowed", "would_deny"] {
        assert_eq!(events(&v, b), 0, "{b}: {v}");
    }
    assert_eq!(
        events(&v, "unchanged_allowed"),
        sum(&db, &format!("{ci} AND {PASSED}"))
    );
    assert_eq!(
        events(&v, "unchanged_allowed")
            + events(&v, "unchanged_denied")
            + events(&v, "not_replayable"),
        all_ci
    );
    // The recorded rule and the replayed one are the same text.
    for d in v["destinations"].as_array().unwrap() {
        if d["bucket"] == "unchanged_allowed" && d["source"] == "proxy" {
            assert_eq!(d["was"][0]["rule"], d["now"]["rule"], "{d}");
        }
    }

    // Audited: what the proposed allowlist refuses passes as would-deny, except what audit
    // never lets through (an address on the built-in list, as under allow_all).
    let audit = format!("{TIGHTER}enforce = \"audit\"\n");
    let v = report(&config, &file("audit.toml", &audit), &[]);
    assert_eq!(v["audit"], true);
    let builtin = "ip = '10.1.1.1'";
    assert_eq!(
        events(&v, "would_deny"),
        newly_denied
            + sum(
                &db,
                &format!("{ci} AND verdict = 'deny' AND NOT {NOT_REPLAYABLE} AND NOT {builtin}")
            )
    );
    assert_eq!(
        events(&v, "unchanged_denied"),
        sum(&db, &format!("{ci} AND {builtin}"))
    );

    // Every flow of the selection, whatever it was recorded under; and a selection.
    let v = report(
        &config,
        &file("tighter.toml", TIGHTER),
        &["--against", "any"],
    );
    assert_eq!(v["events"].as_u64(), Some(sum(&db, "1")));
    assert_eq!(v["against"], "any");
    let v = report(
        &config,
        &file("tighter.toml", TIGHTER),
        &["--run", "101", "--since", "2h"],
    );
    assert_eq!(
        v["events"].as_u64(),
        Some(sum(
            &db,
            &format!("{ci} AND json_extract(labels, '$.run') = '101'")
        ))
    );
    assert_eq!(v["selection"], "run=101, since=2h");
    let v = report(
        &config,
        &file("tighter.toml", TIGHTER),
        &["--against", "web"],
    );
    assert_eq!(events(&v, "unchanged_allowed"), 9);
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_policy_file_that_does_not_load_is_an_error_naming_its_line_and_field() {
    let (dir, config) = setup("errors");
    let f = dir.0.join("proposed.toml");
    let path = f.to_str().unwrap();
    // No store yet.
    std::fs::write(&f, TIGHTER).unwrap();
    let o = cli(&config, &["--policy", path]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no event store at"), "{}", stderr(&o));
    record(&dir.0.join("state/events.db"));
    // The configuration's own error: file:line:column: field: why. Exit non-zero.
    std::fs::write(
        &f,
        "[policies.ci]\nallow_hosts = [\n  \"github.com\",\n  \"*github.com\",\n]\n",
    )
    .unwrap();
    let o = cli(&config, &["--policy", path, "--json"]);
    assert_eq!(o.status.code(), Some(125), "{}", stderr(&o));
    assert!(o.stdout.is_empty());
    assert!(
        stderr(&o).contains(&format!("{path}:4:3: policies.ci.allow_hosts[1]:")),
        "{}",
        stderr(&o)
    );
    std::fs::write(&f, "[policies.ci]\nallow_portz = [443]\n").unwrap();
    let o = cli(&config, &["--policy", path]);
    assert!(
        !o.status.success() && stderr(&o).contains(&format!("{path}:2:1: policies.ci.allow_portz")),
        "{}",
        stderr(&o)
    );
    // Several policies: --name picks one, else the error names them.
    std::fs::write(
        &f,
        format!("{TIGHTER}[policies.web]\nmode = \"deny_all\"\n"),
    )
    .unwrap();
    let o = cli(&config, &["--policy", path]);
    assert!(
        !o.status.success() && stderr(&o).contains("holds policies ci, web; pick one with --name"),
        "{}",
        stderr(&o)
    );
    let o = cli(&config, &["--policy", path, "--name", "nope"]);
    assert!(
        stderr(&o).contains("no policy named \"nope\" (it holds ci, web)"),
        "{}",
        stderr(&o)
    );
    let o = cli(&config, &["--policy", path, "--name", "web", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["policy"].as_str(), v["against"].as_str()),
        (Some("web"), Some("web"))
    );
    assert_eq!(
        (v["flows"].as_u64(), v["events"].as_u64()),
        (Some(2), Some(9)),
        "what was recorded under web"
    );
    // Selection and --against errors; a file that isn't there.
    let o = cli(
        &config,
        &["--policy", path, "--name", "ci", "--since", "forever"],
    );
    assert!(stderr(&o).contains("--since \"forever\""), "{}", stderr(&o));
    let o = cli(
        &config,
        &["--policy", path, "--name", "ci", "--against", "a/b"],
    );
    assert!(
        stderr(&o).contains("--against \"a/b\": a policy name, or `any`"),
        "{}",
        stderr(&o)
    );
    let o = cli(&config, &["--policy", "/nonexistent/p.toml"]);
    assert!(
        stderr(&o).contains("/nonexistent/p.toml: cannot read"),
        "{}",
        stderr(&o)
    );
    // --policy is the file here; the selection flags are the events/suggest ones.
    let o = cli(
        &config,
        &["--policy", path, "--name", "ci", "--verdict", "deny"],
    );
    assert!(
        !o.status.success() && stderr(&o).contains("--verdict"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn the_json_report_has_its_documented_shape_and_the_text_leads_with_what_breaks() {
    let (dir, config) = setup("shape");
    record(&dir.0.join("state/events.db"));
    let f = dir.0.join("tighter.toml");
    std::fs::write(&f, TIGHTER).unwrap();
    let v = report(&config, &f, &["--limit", "1"]);
    for k in [
        "schema",
        "policy",
        "audit",
        "against",
        "selection",
        "flows",
        "events",
        "first_seen",
        "last_seen",
        "totals",
        "destinations",
        "unlisted",
        "not_replayable",
        "notes",
    ] {
        assert!(v.get(k).is_some(), "{k}: {v}");
    }
    assert_eq!(v["schema"], 1);
    // One listed per bucket; the rest counted.
    assert_eq!(v["unlisted"]["newly_denied"], 2, "{}", v["unlisted"]);
    let d = &v["destinations"][0];
    for k in [
        "bucket",
        "source",
        "destination",
        "flows",
        "events",
        "was",
        "now",
        "examples",
    ] {
        assert!(d.get(k).is_some(), "{k}: {d}");
    }
    for k in ["verdict", "reason", "rule"] {
        assert!(d["now"].get(k).is_some(), "{k}: {d}");
    }
    let u = &v["not_replayable"][0];
    for k in ["source", "reason", "why", "flows", "events"] {
        assert!(u.get(k).is_some(), "{k}: {u}");
    }
    // The text: totals, then newly denied first with the rule before and after.
    let o = cli(&config, &["--policy", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = String::from_utf8_lossy(&o.stdout);
    assert!(
        t.starts_with("# replay of policy ci on 32 flows (346 events) recorded under policy ci"),
        "{t}"
    );
    let denied = t.find("\nnewly denied (what breaks a job):\n  api.github.com:443 — 2 flows, 120 events\n      was: allowed by `allow_hosts *.github.com`\n      now: denied (host-not-allowed): no allow_hosts entry matches\n");
    let unchanged = t.find("\nunchanged denied:");
    assert!(denied.is_some() && denied < unchanged, "{t}");
    assert!(
        t.contains("now: denied (kernel-destination-not-allowed): no allow_cidrs rule covers it"),
        "{t}"
    );
    assert!(
        t.contains("\nnot replayable:\n  proxy tls-no-sni — 2 flows, 3 events: "),
        "{t}"
    );
}
