//! Container labels → the policy a container gets.
//!
//! Opt-in is by label; any key starting with `egress.` (compared case-insensitively, so a typo like
//! `Egress.Policy` can never silently mean "unlabelled") makes the container *opted in*:
//!
//! | labels                                               | policy                                   |
//! |------------------------------------------------------|------------------------------------------|
//! | no `egress.*` label                                  | `agent.unlabeled` (default `allow_all`)  |
//! | `egress.policy=<name>`                               | that named policy (or built-in)          |
//! | `egress.allow_hosts=a.com,*.b.com` [`egress.allow_ports=443,80`] | an inline allowlist (ports default `[443]`) |
//! | `egress.presets=github,python` (with or without `egress.allow_hosts`) | an inline allowlist with those presets |
//! | only context labels (`egress.agent`, ...)            | `agent.default_policy` (default `deny_all`) |
//! | anything invalid (unknown policy, malformed list, conflicting or unknown `egress.*` keys) | `deny_all` + a reason |
//!
//! A labelled container gets exactly its policy: it replaces the global default whole, nothing
//! is merged. Invalid labels never fall back to a wider policy.
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::config::Config;
use egress_policy::matcher::HostPattern;
use egress_policy::presets::PresetName;
use egress_policy::{self as policy, Mode, Policy};

pub const LABEL_POLICY: &str = "egress.policy";
pub const LABEL_ALLOW_HOSTS: &str = "egress.allow_hosts";
pub const LABEL_ALLOW_PORTS: &str = "egress.allow_ports";
/// Built-in presets of an inline allowlist (`github,python`), expanded like a policy's `presets`.
pub const LABEL_PRESETS: &str = "egress.presets";
/// Context labels: copied (without the `egress.` prefix) into every event of the container.
pub const CONTEXT_LABELS: [&str; 4] = [
    "egress.agent",
    "egress.workspace",
    "egress.repo",
    "egress.run",
];
/// Longest context value copied into events (longer ones are cut on a char boundary).
pub const MAX_CONTEXT_VALUE: usize = 256;
/// Most entries accepted in an inline `egress.allow_hosts` list.
pub const MAX_INLINE_HOSTS: usize = 256;
const PREFIX: &str = "egress.";
/// Inline policies are named `inline:<hash>`; `:` can't appear in a configured policy name, so
/// an inline policy can never be confused with (or borrow) a named one.
pub const INLINE_PREFIX: &str = "inline:";

/// Why a container got the policy it got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// No `egress.*` label: `agent.unlabeled`.
    Unlabeled,
    /// Opted in with context labels only: `agent.default_policy`.
    Default,
    /// A pod without `egress.*` annotations in a namespace with a default
    /// (`[kubernetes] namespace_defaults`).
    Namespace,
    /// `egress.policy=<name>`.
    Named,
    /// `egress.allow_hosts` (+ `egress.allow_ports`).
    Inline,
    /// Labels could not be honoured: confined as `deny_all`. The reason goes into an event.
    Invalid(String),
}

/// The policy resolved for one container.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Policy name: a configured name, a built-in, or `inline:<hash>`.
    pub name: String,
    pub policy: Arc<Policy>,
    pub source: Source,
    /// Context labels, keys without the `egress.` prefix (`agent`, `workspace`, `repo`, `run`).
    pub context: BTreeMap<String, String>,
    /// Real keys its environment holds (filled in by the enforcer, which knows the environment;
    /// empty here): with `agent.refuse_workload_secrets` it is confined `deny_all`.
    pub exposure: crate::exposure::Exposure,
}

impl Resolved {
    /// Opted in = has any `egress.*` label (even an invalid one).
    pub fn opted_in(&self) -> bool {
        self.source != Source::Unlabeled
    }
    /// The reason the labels were refused, if they were.
    pub fn invalid_reason(&self) -> Option<&str> {
        match &self.source {
            Source::Invalid(r) => Some(r),
            _ => None,
        }
    }
}

/// Why labels were refused. Rendered into the deny_all event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("unknown policy {0:?} in label egress.policy")]
    UnknownPolicy(String),
    #[error("label egress.policy is empty")]
    EmptyPolicy,
    #[error("labels egress.policy and egress.allow_hosts conflict: use one or the other")]
    PolicyAndInline,
    #[error("labels egress.policy and egress.presets conflict: name the presets in the policy")]
    PolicyAndPresets,
    #[error("label egress.allow_ports without egress.allow_hosts")]
    PortsWithoutHosts,
    #[error("label {0:?} given more than once (differing only in case)")]
    Duplicate(String),
    #[error(
        "unknown label {0:?}: known egress labels are egress.policy, egress.allow_hosts, egress.allow_ports, egress.presets, egress.agent, egress.workspace, egress.repo, egress.run"
    )]
    UnknownLabel(String),
    #[error("malformed egress.allow_hosts: {0}")]
    Hosts(String),
    #[error("malformed egress.allow_ports: {0}")]
    Ports(String),
    #[error("malformed egress.presets: {0}")]
    Presets(String),
    #[error("inline policy is invalid: {0}")]
    Inline(String),
}

/// Resolve a container's labels against the configuration. Never fails: refused labels give
/// `deny_all` with [`Source::Invalid`].
pub fn resolve<'a, I>(labels: I, config: &Config) -> Resolved
where
    I: IntoIterator<Item = (&'a str, &'a str)>,
{
    let mut egress: BTreeMap<String, &str> = BTreeMap::new();
    let mut dup: Option<String> = None;
    let mut bad_case: Option<String> = None;
    for (k, v) in labels {
        let lower = k.to_ascii_lowercase();
        if !lower.starts_with(PREFIX) {
            continue;
        }
        if lower != k && bad_case.is_none() {
            bad_case = Some(k.to_owned());
        }
        if egress.insert(lower.clone(), v).is_some() && dup.is_none() {
            dup = Some(lower);
        }
    }
    if egress.is_empty() {
        return named(
            &config.agent.unlabeled,
            config,
            Source::Unlabeled,
            BTreeMap::new(),
        );
    }
    let context = context_of(&egress);
    let invalid = |e: LabelError, context: BTreeMap<String, String>| {
        tracing::warn!(reason = %e, "egress labels refused; container confined as deny_all");
        Resolved {
            name: policy::DENY_ALL.to_owned(),
            policy: Arc::new(Policy::deny_all()),
            source: Source::Invalid(e.to_string()),
            context,
            exposure: Default::default(),
        }
    };
    if let Some(d) = dup {
        return invalid(LabelError::Duplicate(d), context);
    }
    if let Some(k) = bad_case {
        return invalid(LabelError::UnknownLabel(k), context);
    }
    for k in egress.keys() {
        let known = k == LABEL_POLICY
            || k == LABEL_ALLOW_HOSTS
            || k == LABEL_ALLOW_PORTS
            || k == LABEL_PRESETS
            || CONTEXT_LABELS.contains(&k.as_str());
        if !known {
            return invalid(LabelError::UnknownLabel(k.clone()), context);
        }
    }
    let policy = egress.get(LABEL_POLICY).copied();
    let hosts = egress.get(LABEL_ALLOW_HOSTS).copied();
    let ports = egress.get(LABEL_ALLOW_PORTS).copied();
    let presets = egress.get(LABEL_PRESETS).copied();
    if policy.is_some() && presets.is_some() {
        return invalid(LabelError::PolicyAndPresets, context);
    }
    // Presets alone make an inline allowlist as hosts do.
    let hosts = match (hosts, presets) {
        (None, Some(_)) => Some(""),
        (h, _) => h,
    };
    match (policy, hosts, ports) {
        (Some(_), Some(_), _) => invalid(LabelError::PolicyAndInline, context),
        (Some(_), None, Some(_)) | (None, None, Some(_)) => {
            invalid(LabelError::PortsWithoutHosts, context)
        }
        (Some(name), None, None) => {
            let name = name.trim();
            if name.is_empty() {
                return invalid(LabelError::EmptyPolicy, context);
            }
            if config.policy(name).is_none() {
                return invalid(LabelError::UnknownPolicy(name.to_owned()), context);
            }
            named(name, config, Source::Named, context)
        }
        (None, Some(hosts), ports) => match inline(hosts, ports, presets) {
            Ok((name, policy)) => Resolved {
                name,
                policy: Arc::new(policy),
                source: Source::Inline,
                context,
                exposure: Default::default(),
            },
            Err(e) => invalid(e, context),
        },
        (None, None, None) => named(
            &config.agent.default_policy,
            config,
            Source::Default,
            context,
        ),
    }
}

/// Resolve a pod's `egress.*` annotations (the same keys as container labels): without any,
/// its namespace's default (`[kubernetes] namespace_defaults`) applies, else `agent.unlabeled`.
/// A refusal names annotations, not labels, so its event points at what to fix.
pub fn resolve_pod<'a, I>(annotations: I, namespace: &str, config: &Config) -> Resolved
where
    I: IntoIterator<Item = (&'a str, &'a str)>,
{
    let annotations: Vec<(&str, &str)> = annotations.into_iter().collect();
    let opted_in = annotations
        .iter()
        .any(|(k, _)| k.to_ascii_lowercase().starts_with(PREFIX));
    let default = config
        .kubernetes
        .as_ref()
        .and_then(|k| k.namespace_defaults.get(namespace));
    let mut r = match (opted_in, default) {
        (false, Some(name)) => named(name, config, Source::Namespace, BTreeMap::new()),
        _ => resolve(annotations, config),
    };
    if let Source::Invalid(why) = &r.source {
        r.source = Source::Invalid(label_to_annotation(why));
    }
    r
}

/// A text about labels (a refusal, `explain`'s why), reworded for a pod's annotations.
pub(crate) fn label_to_annotation(why: &str) -> String {
    why.split(' ')
        .map(|w| match w {
            "label" => "annotation",
            "labels" => "annotations",
            w => w,
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A configured (validated) policy by name. `Config::validate` guarantees `agent.unlabeled` and
/// `agent.default_policy` exist; should one not, the container still gets `deny_all`.
fn named(
    name: &str,
    config: &Config,
    source: Source,
    context: BTreeMap<String, String>,
) -> Resolved {
    match config.policy(name) {
        Some(p) => Resolved {
            name: name.to_owned(),
            policy: Arc::new(p.clone()),
            source,
            context,
            exposure: Default::default(),
        },
        None => {
            let e = LabelError::UnknownPolicy(name.to_owned());
            tracing::error!(
                policy = name,
                "configured policy missing; confining as deny_all"
            );
            Resolved {
                name: policy::DENY_ALL.to_owned(),
                policy: Arc::new(Policy::deny_all()),
                source: Source::Invalid(e.to_string()),
                context,
                exposure: Default::default(),
            }
        }
    }
}

/// `exec --label KEY=VALUE` items → the labels of the command's workload: context labels only
/// (`egress.run`, `egress.repo`, `egress.agent`, `egress.workspace`; keys compared
/// case-insensitively, each once). The policy comes from `--policy`, never from a label.
pub fn command_labels(items: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for item in items {
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!(
                "--label {item:?}: expected KEY=VALUE (e.g. egress.run=4711)"
            ));
        };
        let key = key.trim().to_ascii_lowercase();
        if key == LABEL_POLICY || key == LABEL_ALLOW_HOSTS || key == LABEL_ALLOW_PORTS {
            return Err(format!(
                "--label {key}: exec takes its policy from --policy; labels only carry context ({})",
                CONTEXT_LABELS.join(", ")
            ));
        }
        if !CONTEXT_LABELS.contains(&key.as_str()) {
            return Err(format!(
                "--label {key}: not a context label; use one of {}",
                CONTEXT_LABELS.join(", ")
            ));
        }
        if value.is_empty() {
            return Err(format!("--label {key}: empty value"));
        }
        if out.insert(key.clone(), value.to_owned()).is_some() {
            return Err(format!("--label {key}: given twice"));
        }
    }
    Ok(out)
}

fn context_of(egress: &BTreeMap<String, &str>) -> BTreeMap<String, String> {
    CONTEXT_LABELS
        .iter()
        .filter_map(|k| {
            let v = egress.get(*k)?;
            let mut end = v.len().min(MAX_CONTEXT_VALUE);
            while !v.is_char_boundary(end) {
                end -= 1;
            }
            Some((k[PREFIX.len()..].to_owned(), v[..end].to_owned()))
        })
        .collect()
}

/// Parse an inline allowlist. The name is a stable hash of the canonical lists, so identical
/// labels share one proxy identity and a restarted agent recomputes the same name. `hosts` is
/// empty (not absent) when only `egress.presets` was given.
fn inline(
    hosts: &str,
    ports: Option<&str>,
    presets: Option<&str>,
) -> Result<(String, Policy), LabelError> {
    let presets = inline_presets(presets)?;
    let mut patterns: Vec<HostPattern> = Vec::new();
    for item in hosts.split(',') {
        if hosts.is_empty() && !presets.is_empty() {
            break;
        }
        let item = item.trim();
        if item.is_empty() {
            return Err(LabelError::Hosts(format!("empty entry in {hosts:?}")));
        }
        let p = HostPattern::parse(item).map_err(|e| LabelError::Hosts(e.to_string()))?;
        if !patterns.contains(&p) {
            patterns.push(p);
        }
    }
    if patterns.len() > MAX_INLINE_HOSTS {
        return Err(LabelError::Hosts(format!(
            "more than {MAX_INLINE_HOSTS} entries"
        )));
    }
    let ports = match ports {
        None => Policy::deny_all().allow_ports, // the configured default ([443])
        Some(list) => {
            let mut out: Vec<u16> = Vec::new();
            for item in list.split(',') {
                let item = item.trim();
                let port: u16 = item
                    .parse()
                    .map_err(|_| LabelError::Ports(format!("{item:?} is not a port number")))?;
                if port == 0 {
                    return Err(LabelError::Ports("port 0 is not a port".to_owned()));
                }
                if !out.contains(&port) {
                    out.push(port);
                }
            }
            out
        }
    };
    let mut canon: Vec<String> = patterns.iter().map(ToString::to_string).collect();
    canon.sort();
    let mut sorted_ports = ports.clone();
    sorted_ports.sort_unstable();
    let mut key = format!("{}|{:?}", canon.join(","), sorted_ports);
    if !presets.is_empty() {
        // Only then: the names of lists without presets stay what they were.
        let mut names: Vec<&str> = presets.iter().map(|p| p.as_str()).collect();
        names.sort_unstable();
        key.push_str(&format!("|presets:{}", names.join(",")));
    }
    let policy = Policy {
        mode: Mode::Allowlist,
        allow_hosts: patterns.into_iter().map(Into::into).collect(),
        allow_ports: ports,
        ..Policy::deny_all()
    }
    .with_presets(presets);
    policy
        .validate("egress.allow_hosts")
        .map_err(|e| LabelError::Inline(e.to_string()))?;
    Ok((
        format!("{INLINE_PREFIX}{:016x}", fnv1a64(key.as_bytes())),
        policy,
    ))
}

/// The presets of `egress.presets` (comma-separated, each once), or none.
fn inline_presets(list: Option<&str>) -> Result<Vec<PresetName>, LabelError> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    let mut out: Vec<PresetName> = Vec::new();
    for item in list.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(LabelError::Presets(format!("empty entry in {list:?}")));
        }
        let p = PresetName::parse(item).map_err(LabelError::Presets)?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Unlabeled => f.write_str("unlabeled"),
            Source::Default => f.write_str("default"),
            Source::Namespace => f.write_str("namespace default"),
            Source::Named => f.write_str("label"),
            Source::Inline => f.write_str("inline"),
            Source::Invalid(r) => write!(f, "invalid: {r}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn config() -> Config {
        Config::from_toml_str(
            r#"
[agent]
default_policy = "ci"
unlabeled = "allow_all"
[policies.ci]
allow_hosts = ["github.com", "*.github.com"]
allow_ports = [443, 80]
allow_cidrs = ["198.18.0.10/32"]
"#,
            Path::new("test.toml"),
        )
        .expect("test value")
    }

    fn r(labels: &[(&str, &str)]) -> Resolved {
        resolve(labels.iter().copied(), &config())
    }

    fn assert_denied(res: &Resolved, needle: &str) {
        assert_eq!(res.name, "deny_all", "{res:?}");
        assert_eq!(res.policy.mode, Mode::DenyAll);
        assert!(res.opted_in());
        let reason = res.invalid_reason().expect("a reason");
        assert!(
            reason.contains(needle),
            "{reason:?} should mention {needle:?}"
        );
    }

    #[test]
    fn unlabeled_gets_configured_unlabeled_policy() {
        let res = r(&[("com.example.other", "x"), ("maintainer", "me")]);
        assert_eq!(res.source, Source::Unlabeled);
        assert_eq!(res.name, "allow_all");
        assert_eq!(res.policy.mode, Mode::AllowAll);
        assert!(!res.opted_in());
        assert!(res.context.is_empty());

        let mut c = config();
        c.agent.unlabeled = "deny_all".into();
        let res = resolve([("a", "b")], &c);
        assert_eq!(
            (res.name.as_str(), res.policy.mode),
            ("deny_all", Mode::DenyAll)
        );
        assert_eq!(res.source, Source::Unlabeled);
    }

    #[test]
    fn named_policy_replaces_default_whole() {
        let res = r(&[("egress.policy", "deny_all")]);
        assert_eq!(
            (res.name.as_str(), &res.source),
            ("deny_all", &Source::Named)
        );
        let res = r(&[("egress.policy", "allow_all")]);
        assert_eq!(
            (res.name.as_str(), res.policy.mode),
            ("allow_all", Mode::AllowAll)
        );
        let res = r(&[("egress.policy", " ci ")]);
        assert_eq!(res.name, "ci");
        assert_eq!(res.policy.allow_ports, vec![443, 80]);
        assert_eq!(res.policy.allow_cidrs.len(), 1);
    }

    #[test]
    fn inline_allowlist() {
        let res = r(&[("egress.allow_hosts", "a.com, *.B.com,a.com")]);
        assert_eq!(res.source, Source::Inline);
        assert!(res.name.starts_with("inline:"), "{}", res.name);
        let p = &res.policy;
        assert_eq!(p.mode, Mode::Allowlist);
        let hosts: Vec<String> = p.allow_hosts.iter().map(ToString::to_string).collect();
        assert_eq!(hosts, ["a.com", "*.b.com"]);
        assert_eq!(p.allow_ports, vec![443], "default ports");
        // Nothing of the configured default policy is merged in.
        assert!(p.allow_cidrs.is_empty() && p.deny_cidrs.is_empty());

        let with_ports = r(&[
            ("egress.allow_hosts", "a.com,*.b.com"),
            ("egress.allow_ports", "443, 80"),
        ]);
        assert_eq!(with_ports.policy.allow_ports, vec![443, 80]);
        assert_ne!(
            with_ports.name, res.name,
            "different ports, different identity"
        );
        // Same lists in another order and case: the same identity.
        let again = r(&[
            ("egress.allow_ports", "80,443"),
            ("egress.allow_hosts", "*.b.com,A.COM"),
        ]);
        assert_eq!(again.name, with_ports.name);
    }

    #[test]
    fn unknown_policy_is_deny_all() {
        assert_denied(&r(&[("egress.policy", "cii")]), "unknown policy \"cii\"");
        assert_denied(&r(&[("egress.policy", "")]), "empty");
        assert_denied(
            &r(&[("egress.policy", "inline:0000000000000000")]),
            "unknown policy",
        );
    }

    #[test]
    fn malformed_inline_is_deny_all() {
        assert_denied(&r(&[("egress.allow_hosts", "a.com,,b.com")]), "empty entry");
        assert_denied(&r(&[("egress.allow_hosts", "")]), "empty entry");
        assert_denied(&r(&[("egress.allow_hosts", "10.0.0.1")]), "allow_cidrs");
        assert_denied(&r(&[("egress.allow_hosts", "a*.com")]), "wildcard");
        assert_denied(&r(&[("egress.allow_hosts", "*")]), "egress.allow_hosts");
        assert_denied(
            &r(&[
                ("egress.allow_hosts", "a.com"),
                ("egress.allow_ports", "443,x"),
            ]),
            "not a port",
        );
        assert_denied(
            &r(&[
                ("egress.allow_hosts", "a.com"),
                ("egress.allow_ports", "70000"),
            ]),
            "not a port",
        );
        assert_denied(
            &r(&[("egress.allow_hosts", "a.com"), ("egress.allow_ports", "0")]),
            "port 0",
        );
        assert_denied(
            &r(&[("egress.allow_hosts", "a.com"), ("egress.allow_ports", "")]),
            "not a port",
        );
        let many = (0..=MAX_INLINE_HOSTS)
            .map(|i| format!("h{i}.com"))
            .collect::<Vec<_>>()
            .join(",");
        assert_denied(&r(&[("egress.allow_hosts", many.as_str())]), "more than");
    }

    #[test]
    fn conflicting_or_unknown_labels_are_deny_all() {
        assert_denied(
            &r(&[("egress.policy", "ci"), ("egress.allow_hosts", "a.com")]),
            "conflict",
        );
        assert_denied(
            &r(&[("egress.allow_ports", "443")]),
            "without egress.allow_hosts",
        );
        assert_denied(
            &r(&[("egress.policy", "ci"), ("egress.allow_ports", "443")]),
            "without",
        );
        // A typo must not mean "unlabelled" (allow_all).
        assert_denied(
            &r(&[("egress.polciy", "ci")]),
            "unknown label \"egress.polciy\"",
        );
        assert_denied(&r(&[("Egress.Policy", "ci")]), "unknown label");
        assert_denied(
            &r(&[("egress.policy", "ci"), ("EGRESS.POLICY", "allow_all")]),
            "more than once",
        );
    }

    #[test]
    fn exec_labels_carry_context_only() {
        let ok = command_labels(&["egress.run=4711".into(), "Egress.Repo=org/app".into()])
            .expect("valid");
        assert_eq!(
            ok,
            BTreeMap::from([
                ("egress.repo".to_owned(), "org/app".to_owned()),
                ("egress.run".to_owned(), "4711".to_owned())
            ])
        );
        for (bad, says) in [
            ("egress.run", "KEY=VALUE"),
            ("egress.policy=web", "--policy"),
            ("egress.allow_hosts=a.test", "--policy"),
            ("egress.runn=1", "not a context label"),
            ("run=1", "not a context label"),
            ("egress.run=", "empty value"),
        ] {
            let e = command_labels(&[bad.to_owned()]).expect_err("refused");
            assert!(e.contains(says), "{bad}: {e}");
        }
        let twice =
            command_labels(&["egress.run=1".into(), "EGRESS.RUN=2".into()]).expect_err("refused");
        assert!(twice.contains("given twice"), "{twice}");
        // What they become on the workload: the same context as a container's labels.
        let info =
            crate::workload::info::ContainerInfo::command("exec:1".into(), "sh".into(), "web", ok);
        let config = Config::from_toml_str(
            "[policies.web]\nallow_hosts = [\"a.test\"]",
            std::path::Path::new("t.toml"),
        )
        .expect("valid");
        let res = resolve(
            info.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &config,
        );
        assert_eq!(res.context.get("run").map(String::as_str), Some("4711"));
        assert_eq!(res.context.get("repo").map(String::as_str), Some("org/app"));
        assert_eq!(res.name, "web");
    }

    #[test]
    fn context_labels() {
        let res = r(&[
            ("egress.policy", "ci"),
            ("egress.agent", "runner-7"),
            ("egress.repo", "org/repo"),
            ("egress.run", "42"),
            ("egress.workspace", "ws"),
            ("unrelated", "x"),
        ]);
        assert_eq!(res.name, "ci");
        let want: BTreeMap<String, String> = [
            ("agent", "runner-7"),
            ("repo", "org/repo"),
            ("run", "42"),
            ("workspace", "ws"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(res.context, want);
        // Context is kept even when the labels are refused.
        let bad = r(&[("egress.policy", "nope"), ("egress.run", "7")]);
        assert_eq!(bad.context.get("run").map(String::as_str), Some("7"));
        // Long values are cut on a char boundary.
        let long = "é".repeat(MAX_CONTEXT_VALUE);
        let res = r(&[("egress.policy", "ci"), ("egress.repo", long.as_str())]);
        assert!(res.context["repo"].len() <= MAX_CONTEXT_VALUE);
    }

    #[test]
    fn context_only_opts_in_with_default_policy() {
        let res = r(&[("egress.agent", "a")]);
        assert_eq!(res.source, Source::Default);
        assert_eq!(res.name, "ci");
        assert!(res.opted_in());
        let res = resolve([("egress.run", "1")], &Config::default());
        assert_eq!(
            (res.name.as_str(), res.policy.mode),
            ("deny_all", Mode::DenyAll)
        );
    }

    fn k8s_config() -> Config {
        Config::from_toml_str(
            r#"
[agent]
unlabeled = "allow_all"
[kubernetes]
namespace_defaults = { ci = "web" }
[policies.web]
allow_hosts = ["example.com"]
[policies.api]
allow_hosts = ["api.example.com"]
"#,
            Path::new("t.toml"),
        )
        .expect("config")
    }

    #[test]
    fn a_pod_gets_its_annotation_then_its_namespace_default_then_unlabeled() {
        let c = k8s_config();
        let r = resolve_pod([("egress.policy", "api")], "ci", &c);
        assert_eq!((r.name.as_str(), &r.source), ("api", &Source::Named));
        // No egress.* annotation: the namespace's default, opted in (it gets a listener).
        let r = resolve_pod([("other", "x")], "ci", &c);
        assert_eq!((r.name.as_str(), &r.source), ("web", &Source::Namespace));
        assert!(r.opted_in());
        // Context annotations alone opt in with agent.default_policy, as labels do.
        let r = resolve_pod([("egress.repo", "a/b")], "ci", &c);
        assert_eq!(r.source, Source::Default);
        let r = resolve_pod(std::iter::empty(), "other-ns", &c);
        assert_eq!(
            (r.name.as_str(), &r.source),
            ("allow_all", &Source::Unlabeled)
        );
    }

    #[test]
    fn label_words_become_annotation_words() {
        assert_eq!(
            label_to_annotation("egress.policy label"),
            "egress.policy annotation"
        );
        assert_eq!(
            label_to_annotation("labels refused, the labels stay; relabel"),
            "annotations refused, the annotations stay; relabel"
        );
    }

    #[test]
    fn a_pods_bad_annotations_are_deny_all_and_the_reason_names_the_annotation() {
        let c = k8s_config();
        for (annotations, says) in [
            (
                vec![("egress.policy", "nope")],
                "unknown policy \"nope\" in annotation egress.policy",
            ),
            (
                vec![("egress.polcy", "web")],
                "unknown annotation \"egress.polcy\": known egress annotations are",
            ),
            (
                vec![("egress.allow_ports", "443")],
                "annotation egress.allow_ports without egress.allow_hosts",
            ),
            (
                vec![("egress.allow_hosts", "bad host!")],
                "malformed egress.allow_hosts",
            ),
        ] {
            // In a namespace with a default too: bad annotations never fall back to it.
            let r = resolve_pod(annotations.clone(), "ci", &c);
            assert_eq!(r.name, policy::DENY_ALL, "{annotations:?}");
            let why = r.invalid_reason().expect("refused");
            assert!(why.contains(says), "{annotations:?}: {why}");
            assert!(!why.contains("label"), "{annotations:?}: {why}");
        }
    }

    #[test]
    fn presets_make_an_inline_allowlist_alone_or_with_hosts() {
        let res = r(&[("egress.presets", "github, python,github")]);
        assert_eq!(res.source, Source::Inline);
        let p = &res.policy;
        let names: Vec<&str> = p.presets.iter().map(|n| n.as_str()).collect();
        assert_eq!(names, ["github", "python"]);
        assert_eq!(p.own_hosts().count(), 0);
        assert!(
            p.allow_hosts
                .iter()
                .any(|h| h.to_string() == "pypi.org (preset python)"),
            "{:?}",
            p.allow_hosts
        );
        let with_hosts = r(&[
            ("egress.allow_hosts", "a.com"),
            ("egress.presets", "python"),
            ("egress.allow_ports", "443,8443"),
        ]);
        assert_eq!(with_hosts.policy.own_hosts().count(), 1);
        assert_eq!(with_hosts.policy.allow_ports, vec![443, 8443]);
        assert_ne!(with_hosts.name, res.name);
        // The name of a list without presets is what it always was.
        let plain = r(&[("egress.allow_hosts", "a.com")]);
        let plus = r(&[("egress.allow_hosts", "a.com"), ("egress.presets", "go")]);
        assert_ne!(plain.name, plus.name);
        assert_eq!(plain.name, inline("a.com", None, None).expect("valid").0);
        assert_denied(
            &r(&[("egress.presets", "gitlab")]),
            "unknown preset \"gitlab\"",
        );
        assert_denied(&r(&[("egress.presets", "go,,rust")]), "empty entry");
        assert_denied(
            &r(&[("egress.policy", "ci"), ("egress.presets", "go")]),
            "egress.policy and egress.presets conflict",
        );
    }
}
