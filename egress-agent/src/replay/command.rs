//! Around the pure replay, for `egress-agent replay` and the API's `POST /v1/replay`: the
//! proposed policy (TOML `[policies.NAME]` tables or a request body, loaded by the
//! configuration's own loader, so errors name file:line:column and field exactly as for the
//! configuration), the flows (the event store, read as it is streamed), and the report as text
//! for people or as JSON (`docs/api.yaml`, `ReplayReport`).
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{Bucket, Decided, Proposed, Recorded, Replayer, Report};
use crate::config::{Config, ConfigError, Secrets};
use crate::events::Verdict;
use crate::store::selection::Selection;
use crate::store::{Store, StoreError};
use egress_policy::Policy;

/// Version of the JSON report's schema (`schema` in it); raised when a field changes meaning
/// or goes.
pub const SCHEMA: u32 = 1;

/// `--against any`: every flow of the selection, whatever policy it was recorded under.
pub const AGAINST_ANY: &str = "any";

/// Destinations listed per bucket unless asked otherwise (`--limit`, `limit`).
pub const DEFAULT_LIMIT: usize = 20;

/// Why a replay could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The proposed policy does not load: the loader's own error (file:line:column: field).
    #[error(transparent)]
    Policy(#[from] ConfigError),
    #[error(
        "{}: no [policies.NAME] table: write the proposed policy as in the configuration file",
        .0.display()
    )]
    NoPolicy(PathBuf),
    #[error("{}: holds policies {names}; pick one with --name", file.display())]
    SeveralPolicies { file: PathBuf, names: String },
    #[error("{}: no policy named {name:?} (it holds {names})", file.display())]
    NoSuchPolicy {
        file: PathBuf,
        name: String,
        names: String,
    },
    /// A selection flag (`--since`, `--label`, `--pod`, ...) is malformed.
    #[error("{0}")]
    Selection(String),
    #[error("--against {0:?}: a policy name, or `any`")]
    Against(String),
    #[error("no event store at {} (is agent.state_dir right? is store.enabled on?)", .0.display())]
    NoStore(PathBuf),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Which flows, and how much of the report to list.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// Its `policy` and `verdict` are not used: `against` picks the policy.
    pub selection: Selection,
    /// The flows recorded under this policy; `None`: the proposed policy's name;
    /// [`AGAINST_ANY`]: all of the selection.
    pub against: Option<String>,
    /// Destinations listed per bucket (0: all).
    pub limit: usize,
}

impl ReplayOptions {
    /// The policy the flows were recorded under (`None`: any).
    fn against<'a>(&'a self, proposed: &'a Proposed) -> Result<Option<&'a str>, ReplayError> {
        match self.against.as_deref() {
            None => Ok(Some(proposed.name())),
            Some(AGAINST_ANY) => Ok(None),
            Some(p) if crate::config::check_policy_name(p).is_ok() || is_builtin(p) => Ok(Some(p)),
            Some(p) => Err(ReplayError::Against(p.to_owned())),
        }
    }

    fn against_text(&self, proposed: &Proposed) -> String {
        self.against
            .clone()
            .unwrap_or_else(|| proposed.name().to_owned())
    }
}

fn is_builtin(name: &str) -> bool {
    [
        egress_policy::ALLOW_ALL,
        egress_policy::DENY_ALL,
        egress_policy::AUDIT,
    ]
    .contains(&name)
}

/// The proposed policy of `text` (TOML: `[policies.NAME]` tables, as in the configuration
/// file; `origin` names it in errors): `name`'s table, or its only one. No secret of a
/// credential binding is read (a replay sends nothing).
pub fn policy_from_toml(
    origin: &Path,
    text: &str,
    name: Option<&str>,
) -> Result<(String, Policy), ReplayError> {
    let config = Config::from_toml_str_with(text, origin, Secrets::Skip)?;
    let names = || {
        config
            .policies
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let name = match (name, config.policies.len()) {
        (Some(n), _) => n.to_owned(),
        (None, 0) => return Err(ReplayError::NoPolicy(origin.to_owned())),
        (None, 1) => config.policies.keys().next().cloned().unwrap_or_default(),
        (None, _) => {
            return Err(ReplayError::SeveralPolicies {
                file: origin.to_owned(),
                names: names(),
            });
        }
    };
    match config.policies.get(&name) {
        Some(p) => Ok((name, p.clone())),
        None if config.policies.is_empty() => Err(ReplayError::NoPolicy(origin.to_owned())),
        None => Err(ReplayError::NoSuchPolicy {
            file: origin.to_owned(),
            name,
            names: names(),
        }),
    }
}

/// [`policy_from_toml`] of a file.
pub fn policy_from_file(path: &Path, name: Option<&str>) -> Result<(String, Policy), ReplayError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    policy_from_toml(path, &text, name)
}

/// Open the event store at `path` read-only (as `events` and `suggest` do).
pub fn open_store(path: &Path) -> Result<Store, ReplayError> {
    if !path.exists() {
        return Err(ReplayError::NoStore(path.to_owned()));
    }
    Ok(Store::open_read_only(path)?)
}

/// Replay the flows `opts` selects from `store` under `proposed`, one at a time as they are
/// read.
pub fn replay_store(
    store: &Store,
    proposed: &Proposed,
    opts: &ReplayOptions,
) -> Result<Report, ReplayError> {
    let mut filter = opts
        .selection
        .filter()
        .map_err(|e| ReplayError::Selection(format!("{e:#}")))?;
    filter.policy = opts.against(proposed)?.map(str::to_owned);
    filter.verdict = None;
    let mut r = Replayer::new(proposed);
    store.each_flow(&filter, |f| r.add(f))?;
    Ok(r.finish(opts.limit))
}

/// What the report is about, beside the replay itself.
#[derive(Debug, Clone)]
pub struct About {
    /// The policy the flows were recorded under, or `any`.
    pub against: String,
    /// [`Selection::describe`].
    pub selection: String,
}

impl About {
    pub fn new(proposed: &Proposed, opts: &ReplayOptions) -> About {
        About {
            against: opts.against_text(proposed),
            selection: opts.selection.describe(),
        }
    }
}

/// The JSON report: the report, and what it is about.
#[derive(serde::Serialize)]
struct JsonReport<'a> {
    schema: u32,
    policy: &'a str,
    audit: bool,
    against: &'a str,
    selection: &'a str,
    flows: u64,
    events: u64,
    #[serde(serialize_with = "super::ser_opt_time")]
    first_seen: Option<std::time::SystemTime>,
    #[serde(serialize_with = "super::ser_opt_time")]
    last_seen: Option<std::time::SystemTime>,
    totals: &'a super::Totals,
    destinations: &'a [super::Entry],
    /// Per bucket, the destinations the limit left out.
    unlisted: &'a std::collections::BTreeMap<Bucket, usize>,
    not_replayable: &'a [super::Unreplayed],
    notes: &'a [String],
}

/// The report as JSON (schema [`SCHEMA`], `docs/api.yaml`'s `ReplayReport`).
pub fn to_json(report: &Report, about: &About) -> Value {
    let view = JsonReport {
        schema: SCHEMA,
        policy: &report.policy,
        audit: report.audit,
        against: &about.against,
        selection: &about.selection,
        flows: report.flows,
        events: report.events,
        first_seen: report.first_seen,
        last_seen: report.last_seen,
        totals: &report.totals,
        destinations: &report.destinations,
        unlisted: &report.unlisted,
        not_replayable: &report.not_replayable,
        notes: &report.notes,
    };
    serde_json::to_value(view).unwrap_or(Value::Null)
}

fn plural(n: u64, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}

/// What a refusal without a rule means, in words.
fn no_rule(reason: &str) -> Option<&'static str> {
    Some(match reason {
        "host-not-allowed" => "no allow_hosts entry matches",
        "ip-literal-not-allowed" => "no allow_cidrs entry covers the address",
        "request-not-allowed" => "the host has allow request rules and none matches",
        "path-not-normalized" => "the path is not in normal form, which request rules refuse",
        "port-not-allowed" => "no port 0",
        _ => return None,
    })
}

fn was_text(w: &Recorded) -> String {
    let by = |r: &Option<String>| r.as_ref().map(|r| format!(" by `{r}`")).unwrap_or_default();
    match w.verdict {
        Verdict::Allow => format!("allowed{}", by(&w.rule)),
        Verdict::WouldDeny => format!("let through as would-deny ({}){}", w.reason, by(&w.rule)),
        Verdict::Deny => format!("denied ({}){}", w.reason, by(&w.rule)),
    }
}

/// The proposed decision in words. A kernel refusal's rule is the kernel evaluation's account
/// of why (`no allow_cidrs rule covers it; ...`), not a configured rule.
fn now_text(source: &str, d: &Decided) -> String {
    let reason = d.reason.unwrap_or("");
    let why = match (&d.rule, no_rule(reason)) {
        (Some(r), _) if source == "kernel" && d.verdict != Verdict::Allow => format!(": {r}"),
        (Some(r), _) => format!(" by `{r}`"),
        (None, Some(w)) => format!(": {w}"),
        (None, None) => String::new(),
    };
    match d.verdict {
        Verdict::Allow => format!("allowed{why}"),
        Verdict::WouldDeny => format!("would-deny ({reason}){why}"),
        Verdict::Deny => format!("denied ({reason}){why}"),
    }
}

fn count_line(out: &mut String, title: &str, destinations: Option<usize>, c: super::Count) {
    let dests = destinations
        .map(|n| plural(n as u64, "destination"))
        .unwrap_or_default();
    writeln!(
        out,
        "  {title:<18} {dests:>16} {:>14} {:>16}",
        plural(c.flows, "flow"),
        plural(c.events, "event")
    )
    .ok();
}

/// The report for people: the totals, then each bucket's destinations (newly denied first:
/// what breaks a job), what could not be replayed, and what the replay could not see.
pub fn to_text(report: &Report, about: &About) -> String {
    let mut out = String::new();
    let window = match (report.first_seen, report.last_seen) {
        (Some(a), Some(b)) => format!(
            ", {} .. {}",
            humantime::format_rfc3339_seconds(a),
            humantime::format_rfc3339_seconds(b)
        ),
        _ => String::new(),
    };
    let recorded = if about.against == AGAINST_ANY {
        "recorded under any policy".to_owned()
    } else {
        format!("recorded under policy {}", about.against)
    };
    writeln!(
        out,
        "# replay of policy {}{} on {} ({}) {recorded}{window}",
        report.policy,
        if report.audit { " (audits)" } else { "" },
        plural(report.flows, "flow"),
        plural(report.events, "event"),
    )
    .ok();
    writeln!(out, "# selection: {}", about.selection).ok();
    if report.flows == 0 {
        writeln!(
            out,
            "nothing to replay: no flow {recorded} in this selection{}",
            if about.against == AGAINST_ANY {
                ""
            } else {
                " (--against any replays every flow of the selection)"
            }
        )
        .ok();
        return out;
    }
    for b in Bucket::ALL {
        let listed = report.destinations.iter().filter(|e| e.bucket == b).count();
        let n = listed + report.unlisted.get(&b).copied().unwrap_or(0);
        count_line(&mut out, b.title(), Some(n), report.totals.of(b));
    }
    count_line(
        &mut out,
        "not replayable",
        None,
        report.totals.not_replayable,
    );
    write_buckets(&mut out, report);
    if !report.not_replayable.is_empty() {
        writeln!(out, "\nnot replayable:").ok();
        for u in &report.not_replayable {
            writeln!(
                out,
                "  {} {} — {}, {}: {}",
                u.source,
                u.reason,
                plural(u.flows, "flow"),
                plural(u.events, "event"),
                u.why
            )
            .ok();
        }
    }
    if !report.notes.is_empty() {
        writeln!(out, "\nnotes:").ok();
        for n in &report.notes {
            writeln!(out, "  - {n}").ok();
        }
    }
    out
}

fn write_buckets(out: &mut String, report: &Report) {
    for b in Bucket::ALL {
        let entries: Vec<_> = report
            .destinations
            .iter()
            .filter(|e| e.bucket == b)
            .collect();
        if entries.is_empty() {
            continue;
        }
        let title = match b {
            Bucket::NewlyDenied => "newly denied (what breaks a job)",
            other => other.title(),
        };
        writeln!(out, "\n{title}:").ok();
        for e in entries {
            writeln!(
                out,
                "  {} — {}, {}",
                e.destination,
                plural(e.flows, "flow"),
                plural(e.events, "event")
            )
            .ok();
            let was: Vec<String> = e.was.iter().map(was_text).collect();
            writeln!(out, "      was: {}", was.join("; ")).ok();
            writeln!(out, "      now: {}", now_text(e.source, &e.now)).ok();
            let examples: Vec<String> = e
                .examples
                .iter()
                .map(|x| {
                    format!(
                        "{}{} at {}",
                        x.container.as_deref().unwrap_or("-"),
                        x.run
                            .as_ref()
                            .map(|r| format!(" run={r}"))
                            .unwrap_or_default(),
                        humantime::format_rfc3339_seconds(x.last_seen)
                    )
                })
                .collect();
            writeln!(out, "      e.g. {}", examples.join("; ")).ok();
        }
        if let Some(n) = report.unlisted.get(&b) {
            writeln!(out, "  ... and {n} more (--limit 0 lists all)").ok();
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn a_file_with_several_policies_needs_a_name_and_errors_are_located() {
        let origin = Path::new("proposed.toml");
        let two =
            "[policies.a]\nallow_hosts = [\"a.test\"]\n[policies.b]\nallow_hosts = [\"b.test\"]\n";
        let e = policy_from_toml(origin, two, None).unwrap_err().to_string();
        assert_eq!(
            e,
            "proposed.toml: holds policies a, b; pick one with --name"
        );
        let (name, p) = policy_from_toml(origin, two, Some("b")).unwrap();
        assert_eq!((name.as_str(), p.allow_hosts.len()), ("b", 1));
        let e = policy_from_toml(origin, two, Some("c"))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "proposed.toml: no policy named \"c\" (it holds a, b)");
        let e = policy_from_toml(origin, "[agent]\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no [policies.NAME] table"), "{e}");
        // The configuration's loader: file:line:column: field: why.
        let bad = "[policies.a]\nallow_hosts = [\"ok.test\", \"*bad.test\"]\n";
        let e = policy_from_toml(origin, bad, None).unwrap_err().to_string();
        assert!(e.starts_with("proposed.toml:2:"), "{e}");
        assert!(e.contains("policies.a.allow_hosts[1]"), "{e}");
        let e = policy_from_toml(origin, "[policies.a]\nallow_portz = [1]\n", None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("policies.a.allow_portz") || e.contains("allow_portz"),
            "{e}"
        );
    }

    #[test]
    fn no_secret_is_read_for_a_replay() {
        // A binding whose secret file does not exist loads (nothing is read, nothing sent).
        let text = "[policies.a]\nallow_hosts = [\"api.test\"]\n[[policies.a.credentials]]\nhost = \"api.test\"\nsource = { file = \"/nonexistent/secret\" }\nplaceholder = \"PLACEHOLDER-1\"\nheader = \"authorization\"\nprefix = \"Bearer \"\n";
        let r = policy_from_toml(Path::new("p.toml"), text, None);
        let (_, p) = r.unwrap();
        assert!(p.credentials.iter().all(|b| b.secret.is_none()));
    }
}
