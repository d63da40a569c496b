//! `suggest` on recorded traffic: the events of a CI run in the built-in `audit` policy
//! (`fixtures/suggest/ci-audit-run.jsonl`, JSON lines as `egress-agent events` prints them) go
//! through the real store (flows aggregated by SQLite), and the suggestion must be exactly
//! `ci-audit-run.toml`, parse with the real config parser and allow everything observed; the
//! diff against `ci-config.toml`'s policy must be exactly `ci-audit-run.diff`.
//! `UPDATE_FIXTURES=1` rewrites the expected files (review the diff before committing).
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::path::{Path, PathBuf};

use egress_agent::config::Config;
use egress_agent::events::{DenialEvent, Verdict};
use egress_agent::store::query::Flow;
use egress_agent::store::selection::Selection;
use egress_agent::store::{FlowBatch, Store, add_flow};
use egress_agent::suggest::command::{SuggestOptions, suggest_from};
use egress_policy::CompiledPolicy;
use egress_policy::name::Destination;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/suggest")
        .join(name)
}

fn expect_file(name: &str, actual: &str) {
    let path = fixture(name);
    if std::env::var_os("UPDATE_FIXTURES").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        actual,
        expected,
        "{} differs; actual:\n{actual}",
        path.display()
    );
}

fn recorded() -> Vec<DenialEvent> {
    std::fs::read_to_string(fixture("ci-audit-run.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The recorded events through a real store, then its flows for `selection`.
fn flows(selection: &Selection) -> Vec<Flow> {
    let dir = std::env::temp_dir().join(format!(
        "egress-suggest-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::remove_dir_all(&dir).ok();
    let path = dir.join("events.db");
    let mut store = Store::open(&path).unwrap();
    let events = recorded();
    let mut batch = FlowBatch::new();
    for e in &events {
        add_flow(&mut batch, e);
    }
    store.write(&events, &batch).unwrap();
    let flows = store.flows(&selection.filter().unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    flows
}

fn config() -> Config {
    Config::load(&fixture("ci-config.toml")).unwrap()
}

fn run_selection() -> Selection {
    Selection {
        run: Some("1842".into()),
        ..Selection::default()
    }
}

#[test]
fn suggestion_for_a_recorded_audit_run_is_exact_and_allows_what_was_observed() {
    let flows = flows(&run_selection());
    let opts = SuggestOptions {
        selection: run_selection(),
        include_denied: false,
        diff: false,
        name: Some("ci".into()),
        config: None,
    };
    let text = suggest_from(&flows, &config(), &opts).unwrap();
    expect_file("ci-audit-run.toml", &text);

    // The real parser takes it, and the policy allows every allowed / would-deny flow.
    let parsed = Config::from_toml_str(&text, Path::new("suggested.toml")).unwrap();
    let policy = parsed.policy("ci").unwrap();
    let compiled = CompiledPolicy::new(policy);
    let mut checked = 0;
    for f in flows.iter().filter(|f| f.verdict != Verdict::Deny) {
        assert_ne!(
            f.container_name, "other",
            "the selection leaked another run"
        );
        match (f.source.as_str(), f.host.is_empty()) {
            ("proxy", false) => {
                let d = Destination::parse(&f.host).unwrap();
                assert_eq!(compiled.check_target(&d, f.port), Ok(()), "{f:?}");
            }
            ("proxy", true) => {
                let d = Destination::Ip(f.ip.parse().unwrap());
                assert_eq!(compiled.check_target(&d, f.port), Ok(()), "{f:?}");
            }
            ("kernel", _) => {
                let ip: std::net::IpAddr = f.ip.parse().unwrap();
                let rules = if f.labels.get("direction").is_some_and(|d| d == "inbound") {
                    &policy.allow_inbound
                } else {
                    &policy.allow_cidrs
                };
                assert!(
                    rules
                        .iter()
                        .any(|r| r.net.contains(&ip) && r.allows_port(f.port)),
                    "{f:?}"
                );
            }
            other => panic!("unexpected flow {other:?}"),
        }
        checked += 1;
    }
    assert_eq!(
        checked, 14,
        "every allowed/would-deny flow of the run was checked"
    );
    // What the run did not do stays closed.
    for (host, port) in [
        ("evil.example", 443),
        ("github.com", 8080),
        ("example.org", 443),
    ] {
        assert!(
            compiled
                .check_target(&Destination::parse(host).unwrap(), port)
                .is_err(),
            "{host}:{port} allowed"
        );
    }
}

#[test]
fn diff_against_the_policy_in_force_is_exact() {
    let flows = flows(&run_selection());
    let mut selection = run_selection();
    // The run was audited under `audit`; compare with `ci`, the policy it is meant to get.
    let opts = SuggestOptions {
        selection: selection.clone(),
        include_denied: false,
        diff: true,
        name: None,
        config: None,
    };
    // Without --policy the selection's one policy (`audit`) is compared.
    let d = suggest_from(&flows, &config(), &opts).unwrap();
    assert!(d.starts_with("--- policy audit (in force)\n"), "{d}");
    selection.policy = Some("ci".into());
    let opts = SuggestOptions { selection, ..opts };
    let d = suggest_from(&flows, &config(), &opts).unwrap();
    expect_file("ci-audit-run.diff", &d);
}

#[test]
fn include_denied_adds_what_was_refused_only_when_asked() {
    let flows = flows(&run_selection());
    let opts = SuggestOptions {
        selection: run_selection(),
        include_denied: true,
        diff: false,
        name: Some("ci".into()),
        config: None,
    };
    let text = suggest_from(&flows, &config(), &opts).unwrap();
    // The name that resolved to the metadata address needs its address listed: the suggestion
    // says so explicitly instead of hiding it.
    assert!(text.contains("\"metadata.google.internal\""), "{text}");
    assert!(
        text.contains("{ cidr = \"169.254.169.254/32\", ports = [80] }"),
        "{text}"
    );
    Config::from_toml_str(&text, Path::new("suggested.toml")).unwrap();
}
