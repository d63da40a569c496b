//! The command-line views of the store: `egress-agent events` and `egress-agent suggest`.
//!
//! `events` asks the running daemon (control API) for `-n` and `--follow` as before; with a
//! selection (`--since`, `--container`, `--policy`, `--verdict`, `--run`, `--label`) or `--flows`,
//! or when no daemon answers, it reads the store directly, read-only. Output: JSON lines when
//! stdout is not a terminal or with `--json`, one readable line per event otherwise.
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use hyper::Method;

use super::Store;
use super::query::{EventFilter, Flow, valid_label};
use crate::config::Config;
use crate::events::DenialEvent;

/// The selection flags shared by `events` and `suggest`.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub since: Option<String>,
    pub container: Option<String>,
    pub policy: Option<String>,
    pub verdict: Option<String>,
    pub run: Option<String>,
    pub labels: Vec<String>,
}

/// `--since`: a duration back from now (`90m`, `2h`, `7d`) or an RFC 3339 time.
pub fn parse_since(s: &str, now: SystemTime) -> Result<SystemTime> {
    if let Ok(d) = humantime::parse_duration(s) {
        return now
            .checked_sub(d)
            .ok_or_else(|| anyhow!("--since {s:?}: too far back"));
    }
    humantime::parse_rfc3339_weak(s).map_err(|_| {
        anyhow!("--since {s:?}: expected a duration (2h, 30m, 7d) or an RFC 3339 time")
    })
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        self.since.is_none()
            && self.container.is_none()
            && self.policy.is_none()
            && self.verdict.is_none()
            && self.run.is_none()
            && self.labels.is_empty()
    }

    pub fn filter(&self) -> Result<EventFilter> {
        let mut labels = BTreeMap::new();
        if let Some(r) = &self.run {
            labels.insert("run".to_owned(), r.clone());
        }
        for l in &self.labels {
            let (k, v) = l
                .split_once('=')
                .ok_or_else(|| anyhow!("--label {l:?}: expected NAME=VALUE"))?;
            if !valid_label(k) {
                bail!("--label {l:?}: a label name is 1-64 characters of [A-Za-z0-9_.-]");
            }
            labels.insert(k.to_owned(), v.to_owned());
        }
        Ok(EventFilter {
            since: self
                .since
                .as_deref()
                .map(|s| parse_since(s, SystemTime::now()))
                .transpose()?,
            container: self.container.clone(),
            policy: self.policy.clone(),
            verdict: self
                .verdict
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| anyhow!("--verdict: {e}"))?,
            labels,
        })
    }

    /// A readable summary for headers.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (k, v) in [
            ("container", &self.container),
            ("policy", &self.policy),
            ("run", &self.run),
            ("since", &self.since),
        ] {
            if let Some(v) = v {
                parts.push(format!("{k}={v}"));
            }
        }
        parts.extend(self.labels.iter().map(|l| format!("label {l}")));
        if parts.is_empty() {
            "everything in the store".to_owned()
        } else {
            parts.join(", ")
        }
    }
}

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
    format!(
        "{} {:<10} {:<6} policy={}{who} {} {dest} {}{}",
        humantime::format_rfc3339_millis(ev.time),
        ev.verdict.as_str(),
        crate::store::source_str(ev.source),
        ev.policy,
        ev.protocol,
        ev.reason,
        if labels.is_empty() {
            String::new()
        } else {
            format!(" [{}]", labels.join(" "))
        }
    )
}

fn flow_line(f: &Flow) -> String {
    let dest = if f.host.is_empty() {
        f.ip.clone()
    } else {
        f.host.clone()
    };
    format!(
        "{:>8} {:<10} {:<6} policy={} container={} {} {dest}:{} {} first={} last={}",
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

/// Options of `egress-agent suggest`.
#[derive(Debug, Clone)]
pub struct SuggestOptions {
    pub selection: Selection,
    pub include_denied: bool,
    pub diff: bool,
    pub name: Option<String>,
    pub config: Option<PathBuf>,
}

/// `egress-agent suggest`: print the suggested policy (or its diff) for the selection.
pub fn suggest(opts: &SuggestOptions) -> Result<String> {
    let config = Config::load_or_default(opts.config.as_deref())?;
    let store = open_store(&config.agent.store_path())?;
    let filter = opts.selection.filter()?;
    let flows = store.flows(&filter)?;
    suggest_from(&flows, &config, opts)
}

/// The text `suggest` prints for `flows` (separate from the store for tests).
pub fn suggest_from(flows: &[Flow], config: &Config, opts: &SuggestOptions) -> Result<String> {
    let mut endpoints = vec![config.proxy.endpoint];
    endpoints.extend(config.proxy.endpoint_v6);
    let observed = crate::suggest::observe(
        flows,
        &crate::suggest::Options {
            include_denied: opts.include_denied,
            proxy_endpoints: endpoints,
        },
    );
    let s = crate::suggest::suggest(&observed);
    if opts.diff {
        let name = match &opts.selection.policy {
            Some(p) => p.clone(),
            None => {
                let mut names: Vec<&str> = flows.iter().map(|f| f.policy.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                match names.as_slice() {
                    [one] => (*one).to_owned(),
                    [] => bail!("--diff: nothing observed for this selection"),
                    many => bail!(
                        "--diff: the selection spans policies {}; name one with --policy",
                        many.join(", ")
                    ),
                }
            }
        };
        let current = config
            .policy(&name)
            .ok_or_else(|| anyhow!("--diff: no policy named {name:?} in the configuration"))?;
        return Ok(crate::suggest::diff(&s, &observed, current, &name));
    }
    let name = opts
        .name
        .clone()
        .or_else(|| opts.selection.policy.clone())
        .unwrap_or_else(|| "suggested".to_owned());
    let header = crate::suggest::header(&observed, &opts.selection.describe());
    Ok(crate::suggest::render(&s, &name, &header))
}
