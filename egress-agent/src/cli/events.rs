//! The command-line views of the store: `egress-agent events`, `egress-agent suggest` and
//! `egress-agent replay`.
//!
//! `events` asks the running daemon (control API) for `-n` and `--follow` as before; with a
//! selection (`--since`, `--container`, `--policy`, `--verdict`, `--run`, `--label`) or `--flows`,
//! or when no daemon answers, it reads the store directly, read-only. Output: JSON lines when
//! stdout is not a terminal or with `--json`, one readable line per event otherwise.
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use hyper::Method;

use crate::config::Config;
use crate::events::DenialEvent;
use crate::replay::command::{self as replay_cmd, About, ReplayOptions};
use crate::store::Store;
use crate::store::query::{EventFilter, Flow};
use crate::store::selection::Selection;
use crate::suggest::command::{SuggestOptions, suggest_from};

/// Options of `egress-agent events`.
#[derive(Debug, Clone)]
pub struct EventsOptions {
    pub count: usize,
    pub follow: bool,
    pub flows: bool,
    pub json: bool,
    pub selection: Selection,
    pub config: Option<PathBuf>,
    pub api_socket: PathBuf,
}

fn store_path(config: Option<&Path>) -> Result<PathBuf> {
    let c: Config = Config::load_or_default(config)?;
    Ok(c.agent.store_path())
}

fn open_store(path: &Path) -> Result<Store> {
    if !path.exists() {
        bail!(
            "no event store at {} (is agent.state_dir right? is store.enabled on?)",
            path.display()
        );
    }
    Store::open_read_only(path)
        .with_context(|| format!("reading the event store {}", path.display()))
}

/// One line for a person.
pub fn human(ev: &DenialEvent) -> String {
    let dest = match (&ev.host, ev.ip) {
        (Some(h), Some(ip)) => format!("{h}:{} ({ip})", ev.port),
        (Some(h), None) => format!("{h}:{}", ev.port),
        (None, Some(ip)) if ip.is_ipv6() => format!("[{ip}]:{}", ev.port),
        (None, Some(ip)) => format!("{ip}:{}", ev.port),
        (None, None) => "-".to_owned(),
    };
    let who = ev
        .container
        .as_ref()
        .map(|c| format!(" container={}", c.name))
        .unwrap_or_default();
    let labels: Vec<String> = ev.context.iter().map(|(k, v)| format!("{k}={v}")).collect();
    // A summary of identical attempts (its time is the last of them).
    let count = if ev.count == 1 {
        String::new()
    } else {
        format!(" count={}", ev.count)
    };
    format!(
        "{} {:<10} {:<6} policy={}{who} {} {dest} {}{}{count}{}",
        humantime::format_rfc3339_millis(ev.time),
        ev.verdict.as_str(),
        ev.source.as_str(),
        ev.policy,
        ev.protocol,
        ev.reason,
        rule_field(ev.rule.as_deref()),
        if labels.is_empty() {
            String::new()
        } else {
            format!(" [{}]", labels.join(" "))
        }
    )
}

/// ` rule="allow_hosts api.github.com"` (quoted: a rule has spaces), or nothing.
fn rule_field(rule: Option<&str>) -> String {
    rule.map(|r| format!(" rule={r:?}")).unwrap_or_default()
}

fn flow_line(f: &Flow) -> String {
    let dest = if f.host.is_empty() {
        f.ip.clone()
    } else {
        f.host.clone()
    };
    format!(
        "{:>8} {:<10} {:<6} policy={} container={} {} {dest}:{} {}{} first={} last={}",
        f.count,
        f.verdict.as_str(),
        f.source,
        f.policy,
        if f.container_name.is_empty() {
            "-"
        } else {
            &f.container_name
        },
        f.protocol,
        f.port,
        f.reason,
        rule_field(f.rule.as_deref()),
        humantime::format_rfc3339_seconds(f.first_seen),
        humantime::format_rfc3339_seconds(f.last_seen),
    )
}

/// `egress-agent events`.
pub async fn events(opts: EventsOptions) -> Result<()> {
    let json = opts.json || !std::io::stdout().is_terminal();
    let filter = opts.selection.filter()?;
    let print = move |ev: &DenialEvent| {
        let line = if json {
            serde_json::to_string(ev).unwrap_or_default()
        } else {
            human(ev)
        };
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").ok();
        out.flush().ok();
    };
    if opts.flows {
        let store = open_store(&store_path(opts.config.as_deref())?)?;
        for f in store.flows(&filter)? {
            if json {
                println!("{}", serde_json::to_string(&f)?);
            } else {
                println!("{}", flow_line(&f));
            }
        }
        return Ok(());
    }
    if opts.follow {
        let f = filter.clone();
        let live = crate::api::client::stream_lines(&opts.api_socket, "/v1/events?follow=1", |l| {
            match serde_json::from_str::<DenialEvent>(l) {
                Ok(ev) if f.matches(&ev) => print(&ev),
                Ok(_) => {}
                // `{"lagged": n}` and anything newer than this client: shown as is.
                Err(_) if json => println!("{l}"),
                Err(_) => eprintln!("egress-agent: {l}"),
            }
        })
        .await;
        let Err(e) = live else { return Ok(()) };
        let path = store_path(opts.config.as_deref())?;
        eprintln!(
            "egress-agent: {e}; following the event store {} instead",
            path.display()
        );
        let store = open_store(&path)?;
        let mut last = store
            .events(&EventFilter::default(), 0, 1)?
            .last()
            .map_or(0, |e| e.id);
        loop {
            for e in store.events(&filter, last, 10_000)? {
                last = last.max(e.id);
                print(&e.event);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    if opts.selection.is_empty() {
        match crate::api::client::request(
            &opts.api_socket,
            Method::GET,
            &format!("/v1/events?n={}", opts.count),
        )
        .await
        {
            Ok(body) => {
                let events: Vec<serde_json::Value> = serde_json::from_str(&body)?;
                for e in events {
                    match serde_json::from_value::<DenialEvent>(e.clone()) {
                        Ok(ev) if !json => print(&ev),
                        _ => println!("{e}"),
                    }
                }
                return Ok(());
            }
            Err(e) => {
                let path = store_path(opts.config.as_deref())?;
                eprintln!(
                    "egress-agent: {e}; reading the event store {} instead",
                    path.display()
                );
            }
        }
    }
    let store = open_store(&store_path(opts.config.as_deref())?)?;
    for e in store.events(&filter, 0, opts.count)? {
        print(&e.event);
    }
    Ok(())
}

/// `egress-agent suggest`: print the suggested policy (or its diff) for the selection.
pub fn suggest(opts: &SuggestOptions) -> Result<String> {
    let config = Config::load_or_default(opts.config.as_deref())?;
    let store = open_store(&config.agent.store_path())?;
    let filter = opts.selection.filter()?;
    let flows = store.flows(&filter)?;
    suggest_from(&flows, &config, opts)
}

/// Destinations `replay` lists per bucket by default.
pub const REPLAY_LIMIT: usize = replay_cmd::DEFAULT_LIMIT;

/// Options of `egress-agent replay`.
#[derive(Debug, Clone)]
pub struct ReplayArgs {
    /// The TOML file with the proposed policy (`[policies.NAME]` tables).
    pub file: PathBuf,
    /// Which table of `file` (needed when it holds several).
    pub name: Option<String>,
    /// Which flows: the workloads and time (its `policy` and `verdict` are not used).
    pub selection: Selection,
    /// The flows recorded under this policy; default the proposed one's name; `any`: all.
    pub against: Option<String>,
    /// Destinations listed per bucket (0: all).
    pub limit: usize,
    pub json: bool,
    /// Configuration file (`agent.state_dir`, the proxy endpoint).
    pub config: Option<PathBuf>,
}

/// `egress-agent replay`: the report for the proposed policy, as text or JSON.
pub fn replay(args: &ReplayArgs) -> Result<String> {
    let (name, policy) = replay_cmd::policy_from_file(&args.file, args.name.as_deref())?;
    let config = Config::load_or_default(args.config.as_deref())?;
    let store = replay_cmd::open_store(&config.agent.store_path())?;
    let proposed = crate::replay::Proposed::new(&name, &policy, config.proxy.explain_endpoint());
    let opts = ReplayOptions {
        selection: args.selection.clone(),
        against: args.against.clone(),
        limit: args.limit,
    };
    let report = replay_cmd::replay_store(&store, &proposed, &opts)?;
    let about = About::new(&proposed, &opts);
    Ok(if args.json {
        let mut text = serde_json::to_string_pretty(&replay_cmd::to_json(&report, &about))?;
        text.push('\n');
        text
    } else {
        replay_cmd::to_text(&report, &about)
    })
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::events::Verdict;

    #[test]
    fn the_rule_is_a_quoted_field_after_the_reason() {
        let mut ev = DenialEvent::proxy(
            "ci",
            Some("api.github.com".into()),
            None,
            22,
            "connect",
            "port-not-allowed",
        )
        .with_verdict(Verdict::WouldDeny);
        ev.context.insert("run".into(), "42".into());
        assert!(
            human(&ev).ends_with(" api.github.com:22 port-not-allowed [run=42]"),
            "{}",
            human(&ev)
        );
        ev.rule = Some("allow_hosts api.github.com".into());
        assert!(
            human(&ev).ends_with(
                " api.github.com:22 port-not-allowed rule=\"allow_hosts api.github.com\" [run=42]"
            ),
            "{}",
            human(&ev)
        );
        // JSON (`--json`, a pipe) has it as a field, and none without one.
        let v = serde_json::to_value(&ev).unwrap();
        assert_eq!(v["rule"], "allow_hosts api.github.com");
        ev.rule = None;
        let v = serde_json::to_value(&ev).unwrap();
        assert!(v.get("rule").is_none(), "{v}");
        assert_eq!(v["count"], 1, "{v}");
        // A summary of identical attempts says how many, after the rule.
        ev.count = 12;
        assert!(
            human(&ev).ends_with(" api.github.com:22 port-not-allowed count=12 [run=42]"),
            "{}",
            human(&ev)
        );
        assert_eq!(serde_json::to_value(&ev).unwrap()["count"], 12);
    }

    #[test]
    fn a_flows_line_names_its_rule() {
        let f = Flow {
            verdict: Verdict::Allow,
            source: "proxy".into(),
            policy: "ci".into(),
            container_id: String::new(),
            container_name: "job".into(),
            labels: Default::default(),
            host: "github.com".into(),
            ip: String::new(),
            port: 443,
            protocol: "connect".into(),
            reason: "allowed".into(),
            rule: Some("allow_hosts github.com".into()),
            count: 3,
            first_seen: std::time::UNIX_EPOCH,
            last_seen: std::time::UNIX_EPOCH,
        };
        let l = flow_line(&f);
        assert!(
            l.contains(" github.com:443 allowed rule=\"allow_hosts github.com\" first="),
            "{l}"
        );
        let l = flow_line(&Flow { rule: None, ..f });
        assert!(l.contains(" github.com:443 allowed first="), "{l}");
    }
}
