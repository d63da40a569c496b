//! `egress-agent suggest`: the minimal allowlist that would have allowed what was observed.
//!
//! Input: the store's flows (allowed and would-deny; denied too with `--include-denied`),
//! selected by container, policy, context label and time. Output: one `[policies.NAME]` table
//! that the config parser accepts, or with `--diff` what it changes against the policy in force.
//!
//! - **Names** (proxy flows): grouped into `*.` wildcards by [`group`]'s rule (registrable domain
//!   from the Public Suffix List, at least [`group::WILDCARD_MIN_NAMES`] distinct names).
//! - **Ports**: the model has one `allow_ports` list for all names, so it is the union of the
//!   names' ports; when names used different ports, a comment lists each name's own.
//! - **Addresses**: direct connections (kernel flows) and IP literals sent to the proxy become
//!   `allow_cidrs` host entries (/32, /128) with the ports seen; public ones get a warning comment
//!   (they are reached without the proxy's name check). Inbound connections (kernel flows with
//!   `direction = inbound`: the peer's address, the cgroup's local port) become `allow_inbound`.
//! - **Rules** (`--diff`): the rule each flow's events named says which `allow_hosts` entries of
//!   the policy in force decided nothing in the window (listed as removal candidates, in
//!   comments), and which entry a `port-not-allowed` name matched (the port can go on that
//!   entry rather than in `allow_ports`).
//! - **Presets**: a built-in preset is proposed (`presets = ["github"]`) when its entries match
//!   at least [`PRESET_MIN_NAMES`] of the observed names, or every observed name (the workload's
//!   names are a subset of the preset's); the names it matches then leave `allow_hosts`. A
//!   comment says what each proposed preset covers and how many more entries it allows, since a
//!   preset allows more than was observed (`egress-agent presets show NAME` lists them).
//! - Not suggested (a comment counts them): request-shape refusals (userinfo, numeric IP forms,
//!   Host mismatch), socket types the kernel never allows, connections to the proxy endpoint,
//!   and agent lifecycle events.
pub mod command;
pub mod group;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::time::SystemTime;

use ipnet::IpNet;

use crate::events::Verdict;
use crate::store::query::Flow;
use egress_policy::matcher::HostMatcher;
use egress_policy::name::{Destination, HostName};
use egress_policy::{CompiledPolicy, DenyReason, Policy, Rule};
use group::HostEntry;

/// Proxy reasons a policy can fix (by listing the name, port or address).
const FIXABLE: &[DenyReason] = &[
    DenyReason::HostNotAllowed,
    DenyReason::PortNotAllowed,
    DenyReason::IpLiteralNotAllowed,
    DenyReason::AddressDenied,
    DenyReason::PolicyDenyAll,
];

/// What `suggest` takes into account.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Also use denied flows (default: allowed and would-deny only).
    pub include_denied: bool,
    /// The proxy endpoint(s): connections to them are the proxy path, not direct traffic.
    pub proxy_endpoints: Vec<SocketAddr>,
}

/// What was observed, reduced to what a policy can say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Name → ports (through the proxy).
    pub names: BTreeMap<String, BTreeSet<u16>>,
    /// Address → ports, and whether any came directly (kernel) rather than as an IP literal to
    /// the proxy.
    pub addrs: BTreeMap<IpAddr, BTreeSet<u16>>,
    /// Names whose answer held a private or special address (they need an `allow_cidrs` entry).
    pub name_addrs: BTreeMap<IpAddr, BTreeSet<u16>>,
    /// Peers that connected in → the cgroup's local ports.
    pub inbound: BTreeMap<IpAddr, BTreeSet<u16>>,
    /// Flows used, events they stand for, first and last seen.
    pub flows: usize,
    pub events: u64,
    pub first: Option<SystemTime>,
    pub last: Option<SystemTime>,
    /// Left out, by why → count of events.
    pub skipped: BTreeMap<String, u64>,
    /// Per policy, the rules its flows named (for `--diff`).
    pub rules: BTreeMap<String, RuleUse>,
}

/// What the flows of one policy said about its rules: the rule each event names (as
/// [`egress_policy::Rule::describe`] wrote it under that policy).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleUse {
    /// Every rule a flow named.
    pub named: BTreeSet<String>,
    /// Allowed proxy flows naming no rule: recorded before events named their rule, so the
    /// rules they stand for are unknown.
    pub allowed_unnamed: usize,
    /// `port-not-allowed` flows, by the `allow_hosts` entry that matched the name → the ports.
    pub ports_refused: BTreeMap<String, BTreeSet<u16>>,
    /// First and last seen of these flows.
    pub first: Option<SystemTime>,
    pub last: Option<SystemTime>,
}

/// The prefix [`egress_policy::Rule::describe`] gives an `allow_hosts` entry.
const HOST_RULE: &str = "allow_hosts ";

/// Count `f` (a flow [`observe`] used) in its policy's [`RuleUse`].
fn note_rule(o: &mut Observed, f: &Flow) {
    let u = o.rules.entry(f.policy.clone()).or_default();
    u.first = Some(u.first.map_or(f.first_seen, |t| t.min(f.first_seen)));
    u.last = Some(u.last.map_or(f.last_seen, |t| t.max(f.last_seen)));
    let Some(rule) = &f.rule else {
        if f.verdict == Verdict::Allow && f.source == "proxy" {
            u.allowed_unnamed += 1;
        }
        return;
    };
    u.named.insert(rule.clone());
    if reason_is(f, DenyReason::PortNotAllowed) && rule.starts_with(HOST_RULE) {
        u.ports_refused
            .entry(rule.clone())
            .or_default()
            .insert(f.port);
    }
}

fn reason_is(flow: &Flow, r: DenyReason) -> bool {
    flow.reason == r.as_str()
}

/// Reduce flows to what a policy can allow.
pub fn observe(flows: &[Flow], opts: &Options) -> Observed {
    let mut o = Observed::default();
    for f in flows {
        let mut skip = |why: &str| {
            *o.skipped.entry(why.to_owned()).or_default() += f.count;
        };
        match f.verdict {
            Verdict::Deny if !opts.include_denied => {
                skip("denied (use --include-denied)");
                continue;
            }
            _ => {}
        }
        let ip: Option<IpAddr> = f.ip.parse().ok();
        match f.source.as_str() {
            "proxy" => {
                let fixable =
                    f.verdict == Verdict::Allow || FIXABLE.iter().any(|r| reason_is(f, *r));
                if !fixable || f.port == 0 {
                    skip(&format!("proxy refusal {} (not a policy matter)", f.reason));
                    continue;
                }
                if !f.host.is_empty() {
                    o.names.entry(f.host.clone()).or_default().insert(f.port);
                    if let Some(ip) = ip
                        && egress_policy::addr::builtin_denied(egress_policy::addr::unmap(ip))
                            .is_some()
                    {
                        o.name_addrs.entry(ip).or_default().insert(f.port);
                    }
                } else if let Some(ip) = ip {
                    o.addrs
                        .entry(egress_policy::addr::unmap(ip))
                        .or_default()
                        .insert(f.port);
                } else {
                    skip("proxy event without a destination");
                    continue;
                }
            }
            "kernel" => {
                let Some(ip) = ip else {
                    skip(&format!("kernel {} (no address)", f.reason));
                    continue;
                };
                let ip = egress_policy::addr::unmap(ip);
                if opts
                    .proxy_endpoints
                    .iter()
                    .any(|e| e.ip() == ip && e.port() == f.port)
                {
                    skip("connections to the proxy endpoint");
                    continue;
                }
                if f.protocol.starts_with("socket(") || f.port == 0 {
                    skip(&format!("kernel {} ({})", f.reason, f.protocol));
                    continue;
                }
                if f.labels.get("direction").is_some_and(|d| d == "inbound") {
                    o.inbound.entry(ip).or_default().insert(f.port);
                } else {
                    o.addrs.entry(ip).or_default().insert(f.port);
                }
            }
            _ => {
                skip("agent events");
                continue;
            }
        }
        note_rule(&mut o, f);
        o.flows += 1;
        o.events += f.count;
        o.first = Some(o.first.map_or(f.first_seen, |t| t.min(f.first_seen)));
        o.last = Some(o.last.map_or(f.last_seen, |t| t.max(f.last_seen)));
    }
    o
}

/// Observed names a preset must match to be proposed, unless it matches every observed name.
pub const PRESET_MIN_NAMES: usize = 2;

/// A proposed preset and the observed names it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresetFit {
    pub name: String,
    pub covers: BTreeSet<String>,
    /// Entries of the preset that matched no observed name.
    pub unused_entries: usize,
}

/// The presets to propose for `names` (see the module's rule), in the data file's order.
fn fit_presets(names: &BTreeMap<String, BTreeSet<u16>>) -> Vec<PresetFit> {
    let parsed: Vec<(&String, HostName)> = names
        .keys()
        .filter_map(|n| HostName::parse(n).ok().map(|h| (n, h)))
        .collect();
    let mut out = Vec::new();
    for preset in egress_policy::presets::Presets::builtin().iter() {
        let mut covers = BTreeSet::new();
        let mut used = 0;
        for entry in &preset.hosts {
            let one = HostMatcher::new(std::iter::once(&entry.pattern));
            let matched: Vec<&String> = parsed
                .iter()
                .filter(|(_, h)| one.matches(h))
                .map(|(n, _)| *n)
                .collect();
            used += usize::from(!matched.is_empty());
            covers.extend(matched.into_iter().cloned());
        }
        let all = !names.is_empty() && covers.len() == names.len();
        if covers.len() >= PRESET_MIN_NAMES || (all && !covers.is_empty()) {
            out.push(PresetFit {
                name: preset.name.clone(),
                covers,
                unused_entries: preset.hosts.len() - used,
            });
        }
    }
    out
}

/// The suggested policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Suggestion {
    /// Proposed presets; the names they cover are not in `hosts`.
    pub presets: Vec<PresetFit>,
    pub hosts: Vec<HostEntry>,
    pub ports: BTreeSet<u16>,
    /// Host networks (/32, /128) and their ports.
    pub cidrs: BTreeMap<IpNet, BTreeSet<u16>>,
    /// Per-name ports, when they differ between names.
    pub ports_by_name: Option<BTreeMap<String, BTreeSet<u16>>>,
    /// Public addresses among `cidrs`.
    pub public: BTreeSet<IpNet>,
    /// Inbound peers (/32, /128) and the local ports they connected to.
    pub inbound: BTreeMap<IpNet, BTreeSet<u16>>,
}

pub fn suggest(o: &Observed) -> Suggestion {
    let presets = fit_presets(&o.names);
    let names: BTreeSet<String> = o
        .names
        .keys()
        .filter(|n| !presets.iter().any(|p| p.covers.contains(*n)))
        .cloned()
        .collect();
    let hosts = group::group(&names);
    let ports: BTreeSet<u16> = o.names.values().flatten().copied().collect();
    let uniform = o.names.values().all(|p| *p == ports);
    let mut cidrs: BTreeMap<IpNet, BTreeSet<u16>> = BTreeMap::new();
    let mut public = BTreeSet::new();
    for (ip, p) in o.addrs.iter().chain(o.name_addrs.iter()) {
        let net = IpNet::from(*ip);
        cidrs.entry(net).or_default().extend(p.iter().copied());
        if egress_policy::addr::builtin_denied(*ip).is_none() {
            public.insert(net);
        }
    }
    let inbound = o
        .inbound
        .iter()
        .map(|(ip, p)| (IpNet::from(*ip), p.clone()))
        .collect();
    Suggestion {
        presets,
        hosts,
        ports,
        cidrs,
        ports_by_name: (!uniform).then(|| o.names.clone()),
        public,
        inbound,
    }
}

fn q(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

fn port_list(p: &BTreeSet<u16>) -> String {
    p.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")
}

/// The suggestion as a `[policies.NAME]` table; `header` lines become comments.
pub fn render(s: &Suggestion, name: &str, header: &[String]) -> String {
    let mut out = String::new();
    for h in header {
        writeln!(out, "# {h}").ok();
    }
    writeln!(out, "[policies.{name}]").ok();
    writeln!(out, "mode = \"allowlist\"").ok();
    if !s.presets.is_empty() {
        for p in &s.presets {
            let covers: Vec<&str> = p.covers.iter().map(String::as_str).collect();
            writeln!(
                out,
                "# preset {} covers {}; it allows {} more entries (egress-agent presets show {})",
                p.name,
                covers.join(", "),
                p.unused_entries,
                p.name
            )
            .ok();
        }
        let names: Vec<String> = s.presets.iter().map(|p| q(&p.name)).collect();
        writeln!(out, "presets = [{}]", names.join(", ")).ok();
    }
    if s.hosts.is_empty() && s.presets.is_empty() {
        writeln!(out, "allow_hosts = []").ok();
    } else if s.hosts.is_empty() {
        writeln!(out, "allow_ports = [{}]", port_list(&s.ports)).ok();
    } else {
        writeln!(out, "allow_hosts = [").ok();
        for h in &s.hosts {
            if h.pattern.starts_with("*.") {
                let covers: Vec<&str> = h.covers.iter().map(String::as_str).collect();
                writeln!(out, "    {},  # {}", q(&h.pattern), covers.join(", ")).ok();
            } else {
                writeln!(out, "    {},", q(&h.pattern)).ok();
            }
        }
        writeln!(out, "]").ok();
        if let Some(by_name) = &s.ports_by_name {
            writeln!(
                out,
                "# allow_ports applies to every name; ports seen per name (per-host ports: #11):"
            )
            .ok();
            for (n, p) in by_name {
                writeln!(out, "#   {n}: {}", port_list(p)).ok();
            }
        }
        writeln!(out, "allow_ports = [{}]", port_list(&s.ports)).ok();
    }
    if !s.cidrs.is_empty() {
        writeln!(out, "allow_cidrs = [").ok();
        for (net, ports) in &s.cidrs {
            let warn = if s.public.contains(net) {
                "  # public address reached without a name: prefer a name through the proxy"
            } else {
                ""
            };
            writeln!(
                out,
                "    {{ cidr = {}, ports = [{}] }},{warn}",
                q(&net.to_string()),
                port_list(ports)
            )
            .ok();
        }
        writeln!(out, "]").ok();
    }
    if !s.inbound.is_empty() {
        writeln!(out, "allow_inbound = [").ok();
        for (net, ports) in &s.inbound {
            writeln!(
                out,
                "    {{ cidr = {}, ports = [{}] }},",
                q(&net.to_string()),
                port_list(ports)
            )
            .ok();
        }
        writeln!(out, "]").ok();
    }
    out
}

/// The header comment lines for `o`.
pub fn header(o: &Observed, selection: &str) -> Vec<String> {
    let t = |t: Option<SystemTime>| {
        t.map_or_else(
            || "-".to_owned(),
            |t| humantime::format_rfc3339_seconds(t).to_string(),
        )
    };
    let mut h = vec![
        format!(
            "Suggested by egress-agent suggest from {} flows ({} events), {} .. {}",
            o.flows,
            o.events,
            t(o.first),
            t(o.last)
        ),
        format!("Selection: {selection}"),
    ];
    for (why, n) in &o.skipped {
        h.push(format!("Not included: {n} events: {why}"));
    }
    h
}

/// What the suggestion changes against `current` (one line each; `+` needed, `-` unused,
/// ` ` already allowed).
///
/// "Already allowed" is the policy's own decision ([`CompiledPolicy`], enforce semantics: what
/// an audited policy would refuse is not allowed) for each observed name on each of its ports,
/// and for each observed address and port, so per-entry ports, `allow_ports`, `deny_cidrs`,
/// `resolve_private` and the mode all count.
///
/// From the rules the flows named (their events' [`crate::events::DenialEvent::rule`]), as
/// comments: the `allow_hosts` entries no flow decided under `current` named (removal
/// candidates for the observed window, never taken out), and next to a needed `allow_ports`
/// port, the entries whose names were refused on it (`port-not-allowed`), which could list the
/// port themselves.
pub fn diff(s: &Suggestion, o: &Observed, current: &Policy, current_name: &str) -> String {
    let mut out = String::new();
    writeln!(out, "--- policy {current_name} (in force)").ok();
    writeln!(out, "+++ suggested from observed traffic").ok();
    let compiled = CompiledPolicy::new(current);
    let allowed_on = |n: &str, port: u16| {
        HostName::parse(n).is_ok_and(|h| compiled.check_target(&Destination::Name(h), port).is_ok())
    };
    // Every port the name was seen on.
    let allowed = |n: &str| {
        o.names
            .get(n)
            .is_some_and(|ports| ports.iter().all(|p| allowed_on(n, *p)))
    };
    preset_lines(&mut out, s, current);
    for h in &s.hosts {
        let mark = if h.covers.iter().all(|n| allowed(n)) {
            ' '
        } else {
            '+'
        };
        writeln!(out, "{mark} allow_hosts {}", q(&h.pattern)).ok();
    }
    for p in current.own_hosts().map(|e| &e.pattern) {
        let one = HostMatcher::new(std::iter::once(p));
        let used = o
            .names
            .keys()
            .any(|n| HostName::parse(n).is_ok_and(|h| one.matches(&h)));
        if !used {
            writeln!(
                out,
                "- allow_hosts {}  # nothing observed",
                q(&p.to_string())
            )
            .ok();
        }
    }
    unused_hosts(&mut out, o, current, current_name);
    if !s.hosts.is_empty() || !s.presets.is_empty() {
        for p in &s.ports {
            // Listed, or not needed: every name seen on it is allowed there already (by its
            // entry's own ports).
            let needed = o
                .names
                .iter()
                .any(|(n, ports)| ports.contains(p) && !allowed_on(n, *p));
            if current.allow_ports.contains(p) || !needed {
                writeln!(out, "  allow_ports {p}").ok();
            } else {
                let note = entry_ports_note(o, current, current_name, *p);
                writeln!(out, "+ allow_ports {p}{note}").ok();
            }
        }
    }
    for p in &current.allow_ports {
        if !s.ports.contains(p) && !current.allow_hosts.is_empty() {
            writeln!(out, "- allow_ports {p}  # no name used it").ok();
        }
    }
    for (net, ports) in &s.cidrs {
        let ip = net.addr();
        for port in ports {
            // An address seen directly (or as an IP literal) is decided as one; an address only
            // a name resolved to, as a name's (`resolve_private` counts).
            let direct = o.addrs.get(&ip).is_some_and(|p| p.contains(port));
            let (mark, note) = match compiled.check_addr(ip, *port, !direct) {
                Ok(()) => (' ', ""),
                Err(DenyReason::AddressDeniedByPolicy) => ('+', "  # refused by deny_cidrs"),
                Err(_) => ('+', ""),
            };
            writeln!(out, "{mark} allow_cidrs {net} port {port}{note}").ok();
        }
    }
    for r in &current.allow_cidrs {
        let used = s.cidrs.keys().any(|n| r.net.contains(&n.addr()));
        if !used {
            writeln!(out, "- allow_cidrs {}  # nothing observed", r.net).ok();
        }
    }
    for (net, ports) in &s.inbound {
        for port in ports {
            let covered = current
                .allow_inbound
                .iter()
                .any(|r| r.net.contains(&net.addr()) && r.allows_port(*port));
            let mark = if covered { ' ' } else { '+' };
            writeln!(out, "{mark} allow_inbound {net} port {port}").ok();
        }
    }
    for r in &current.allow_inbound {
        if !s.inbound.keys().any(|n| r.net.contains(&n.addr())) {
            writeln!(out, "- allow_inbound {}  # nothing observed", r.net).ok();
        }
    }
    if current.audits() {
        writeln!(
            out,
            "# policy {current_name} audits; once nothing above starts with '+', set enforce = \"enforce\""
        )
        .ok();
    }
    out
}

/// `diff`'s preset lines: `+ presets "NAME"` for a proposed preset the policy lacks (with the
/// names it covers), `  ` for one it has, `- presets "NAME"` for one of its own not proposed.
fn preset_lines(out: &mut String, s: &Suggestion, current: &Policy) {
    for p in &s.presets {
        let mark = if current.presets.iter().any(|c| c.as_str() == p.name) {
            ' '
        } else {
            '+'
        };
        let covers: Vec<&str> = p.covers.iter().map(String::as_str).collect();
        writeln!(
            out,
            "{mark} presets {}  # {}",
            q(&p.name),
            covers.join(", ")
        )
        .ok();
    }
    for p in &current.presets {
        if !s.presets.iter().any(|x| x.name == p.as_str()) {
            writeln!(out, "- presets {}  # not proposed", q(p.as_str())).ok();
        }
    }
}

/// The description of each `allow_hosts` entry of `policy`, as events name it.
fn host_rules(policy: &Policy) -> impl Iterator<Item = (String, &egress_policy::model::HostEntry)> {
    policy.allow_hosts.iter().enumerate().map(|(index, e)| {
        let rule = Rule::Host { index, port: None };
        (rule.describe(policy), e)
    })
}

fn window(u: &RuleUse) -> String {
    let t = |t: Option<SystemTime>| {
        t.map_or_else(
            || "-".to_owned(),
            |t| humantime::format_rfc3339_seconds(t).to_string(),
        )
    };
    format!("{} .. {}", t(u.first), t(u.last))
}

/// The `allow_hosts` entries of `current` that no flow decided under it named: comments, as
/// removal candidates (nothing is taken out of the policy). Said to be unknown rather than
/// listed when the selection has no flow of that policy, or allowed proxy flows that name no
/// rule (recorded before events named it).
fn unused_hosts(out: &mut String, o: &Observed, current: &Policy, name: &str) {
    if current.allow_hosts.is_empty() {
        return;
    }
    let head = "# allow_hosts entries unused in the observed window";
    let Some(u) = o.rules.get(name) else {
        writeln!(
            out,
            "{head}: not known (no flow of the selection was decided under policy {name})"
        )
        .ok();
        return;
    };
    if u.allowed_unnamed > 0 {
        writeln!(
            out,
            "{head} ({}): not known ({} allowed flows of policy {name} were recorded before \
             events named their rule)",
            window(u),
            u.allowed_unnamed
        )
        .ok();
        return;
    }
    // A preset's entries are the preset's: only the policy's own are candidates.
    let unused: Vec<String> = host_rules(current)
        .filter(|(_, e)| e.preset.is_none())
        .map(|(rule, _)| rule)
        .filter(|rule| !u.named.contains(rule))
        .collect();
    if unused.is_empty() {
        writeln!(out, "{head} ({}): none", window(u)).ok();
    } else {
        writeln!(
            out,
            "{head} ({}): no flow of policy {name} was decided by these; candidates for \
             removal, left in the policy:",
            window(u)
        )
        .ok();
        for rule in unused {
            writeln!(out, "#   {rule}").ok();
        }
    }
    if !current.allow_cidrs.is_empty() {
        writeln!(
            out,
            "# allow_cidrs entries are decided in the kernel, whose events name no rule yet: not \
             listed as unused"
        )
        .ok();
    }
}

/// `  # allow_hosts entry NAME: add port N` for each entry of `current` whose names were refused
/// on `port` (`port-not-allowed` flows under it that named the entry), or nothing: the narrower
/// alternative to listing the port in `allow_ports` for every name.
fn entry_ports_note(o: &Observed, current: &Policy, name: &str, port: u16) -> String {
    let Some(u) = o.rules.get(name) else {
        return String::new();
    };
    let notes: Vec<String> = host_rules(current)
        .filter(|(rule, _)| u.ports_refused.get(rule).is_some_and(|p| p.contains(&port)))
        .map(|(_, e)| format!("allow_hosts entry {e}: add port {port}"))
        .collect();
    if notes.is_empty() {
        String::new()
    } else {
        format!("  # {}", notes.join("; "))
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;

    fn policy(toml: &str) -> Policy {
        let p: Policy = toml::from_str(toml).unwrap();
        p.validate("test").unwrap();
        p
    }

    fn observed(names: &[(&str, &[u16])], addrs: &[(&str, &[u16])]) -> Observed {
        let set = |p: &[u16]| p.iter().copied().collect::<BTreeSet<u16>>();
        Observed {
            names: names
                .iter()
                .map(|(n, p)| ((*n).to_owned(), set(p)))
                .collect(),
            addrs: addrs
                .iter()
                .map(|(a, p)| (a.parse().unwrap(), set(p)))
                .collect(),
            ..Observed::default()
        }
    }

    fn lines(d: &str) -> Vec<&str> {
        d.lines().skip(2).collect()
    }

    /// The old check asked only whether a pattern matched the name: a name allowed by
    /// `allow_hosts` on a port neither `allow_ports` nor its entry allows was shown as already
    /// allowed. Now the policy decides each observed (name, port).
    #[test]
    fn already_allowed_is_the_policys_decision_per_name_and_port() {
        let current = policy(
            r#"
allow_hosts = [{ host = "git.example.com", ports = [22] }, "api.example.org", "ok.example.net"]
allow_ports = [443]
allow_cidrs = [{ cidr = "10.0.0.0/24", ports = [5432] }]
deny_cidrs = ["192.0.2.0/24"]
"#,
        );
        let o = observed(
            &[
                // Allowed by its entry's own port and allow_ports.
                ("git.example.com", &[22, 443]),
                // Matched by allow_hosts, but 8443 is in neither list: needed.
                ("api.example.org", &[443, 8443]),
                ("ok.example.net", &[443]),
            ],
            &[("10.0.0.5", &[5432, 22]), ("192.0.2.7", &[443])],
        );
        let d = diff(&suggest(&o), &o, &current, "p");
        let l = lines(&d);
        assert!(l.contains(&"  allow_hosts \"git.example.com\""), "{d}");
        assert!(l.contains(&"+ allow_hosts \"api.example.org\""), "{d}");
        assert!(l.contains(&"  allow_hosts \"ok.example.net\""), "{d}");
        // 22 is allowed for the one name that used it (its entry's ports): not needed.
        assert!(l.contains(&"  allow_ports 22"), "{d}");
        assert!(l.contains(&"  allow_ports 443"), "{d}");
        assert!(l.contains(&"+ allow_ports 8443"), "{d}");
        assert!(l.contains(&"  allow_cidrs 10.0.0.5/32 port 5432"), "{d}");
        assert!(l.contains(&"+ allow_cidrs 10.0.0.5/32 port 22"), "{d}");
        assert!(
            l.contains(&"+ allow_cidrs 192.0.2.7/32 port 443  # refused by deny_cidrs"),
            "{d}"
        );
    }

    fn at(t: &str) -> SystemTime {
        humantime::parse_rfc3339(t).unwrap()
    }

    /// A proxy flow of `policy` seen once at 10:00 UTC (`rule`: what its events named).
    fn flow(policy: &str, host: &str, port: u16, verdict: Verdict, rule: Option<&str>) -> Flow {
        let reason = match verdict {
            Verdict::Allow => "allowed",
            _ if rule.is_some() => "port-not-allowed",
            _ => "host-not-allowed",
        };
        Flow {
            verdict,
            source: "proxy".into(),
            policy: policy.into(),
            container_id: String::new(),
            container_name: String::new(),
            labels: BTreeMap::new(),
            host: host.into(),
            ip: String::new(),
            port,
            protocol: "connect".into(),
            reason: reason.into(),
            rule: rule.map(str::to_owned),
            count: 1,
            first_seen: at("2026-11-30T10:00:00Z"),
            last_seen: at("2026-11-30T10:00:00Z"),
        }
    }

    fn diff_of(flows: &[Flow], current: &Policy, name: &str) -> String {
        let o = observe(flows, &Options::default());
        diff(&suggest(&o), &o, current, name)
    }

    /// The entries of the policy in force that decided nothing in the window are listed as
    /// removal candidates, compared by the rule the events named — a wildcard an exact entry
    /// shadows too, and only flows decided under that policy count.
    #[test]
    fn entries_no_flow_named_are_removal_candidates() {
        let current = policy(
            r#"
allow_hosts = ["api.github.com", "*.github.com", "crates.io", "pypi.org", { host = "git.example.com", ports = [22] }]
allow_cidrs = [{ cidr = "10.0.0.0/24", ports = [5432] }]
"#,
        );
        let mut flows = vec![
            flow(
                "ci",
                "api.github.com",
                443,
                Verdict::Allow,
                Some("allow_hosts api.github.com"),
            ),
            flow(
                "ci",
                "git.example.com",
                22,
                Verdict::Allow,
                Some("allow_hosts git.example.com (ports 22)"),
            ),
            // A would-deny naming an entry (its port refused): the entry is in use.
            flow(
                "ci",
                "pypi.org",
                8443,
                Verdict::WouldDeny,
                Some("allow_hosts pypi.org"),
            ),
            flow("ci", "evil.example", 443, Verdict::WouldDeny, None),
            // Another policy's entry of the same text says nothing about this one.
            flow(
                "web",
                "crates.io",
                443,
                Verdict::Allow,
                Some("allow_hosts crates.io"),
            ),
        ];
        flows[1].last_seen = at("2026-11-30T11:30:00Z");
        // Direct traffic: decided in the kernel, no rule, and that is no gap.
        let mut direct = flow("ci", "", 5432, Verdict::Allow, None);
        direct.source = "kernel".into();
        direct.ip = "10.0.0.5".into();
        flows.push(direct);
        let d = diff_of(&flows, &current, "ci");
        let l = lines(&d);
        let head = l
            .iter()
            .position(|x| x.starts_with("# allow_hosts entries unused"))
            .unwrap();
        assert_eq!(
            l[head],
            "# allow_hosts entries unused in the observed window (2026-11-30T10:00:00Z .. \
             2026-11-30T11:30:00Z): no flow of policy ci was decided by these; candidates for \
             removal, left in the policy:",
            "{d}"
        );
        assert_eq!(
            l[head + 1..head + 4],
            [
                "#   allow_hosts *.github.com",
                "#   allow_hosts crates.io",
                "# allow_cidrs entries are decided in the kernel, whose events name no rule yet: \
                 not listed as unused",
            ],
            "{d}"
        );
        // Never taken out: the candidates are comments, not '-' lines.
        assert!(!l.iter().any(|x| x.starts_with("- allow_hosts")), "{d}");
        // Every entry used: said so.
        let all = policy("allow_hosts = [\"api.github.com\"]");
        let d = diff_of(&flows, &all, "ci");
        assert!(
            d.contains("# allow_hosts entries unused in the observed window (2026-11-30T10:00:00Z .. 2026-11-30T11:30:00Z): none\n"),
            "{d}"
        );
    }

    /// Flows recorded before events named their rule, or no flow of the compared policy: the
    /// list would be wrong, so it is said to be unknown instead.
    #[test]
    fn unused_entries_are_not_listed_when_the_rules_are_not_known() {
        let current = policy("allow_hosts = [\"api.github.com\", \"crates.io\"]");
        let flows = [
            flow(
                "ci",
                "api.github.com",
                443,
                Verdict::Allow,
                Some("allow_hosts api.github.com"),
            ),
            // An older agent's flow: allowed, no rule.
            flow("ci", "crates.io", 443, Verdict::Allow, None),
        ];
        let d = diff_of(&flows, &current, "ci");
        assert!(
            d.contains(
                "# allow_hosts entries unused in the observed window (2026-11-30T10:00:00Z .. \
                 2026-11-30T10:00:00Z): not known (1 allowed flows of policy ci were recorded \
                 before events named their rule)\n"
            ),
            "{d}"
        );
        assert!(!d.contains("#   allow_hosts"), "{d}");
        // Compared with a policy none of the flows was decided under.
        let d = diff_of(&flows[..1], &current, "prod");
        assert!(
            d.contains(
                "# allow_hosts entries unused in the observed window: not known (no flow of the \
                 selection was decided under policy prod)\n"
            ),
            "{d}"
        );
        assert!(!d.contains("#   allow_hosts"), "{d}");
    }

    /// A name refused on a port names the entry that matched it: the diff says that entry could
    /// take the port, next to the `allow_ports` line.
    #[test]
    fn a_refused_port_names_the_entry_that_could_take_it() {
        let current = policy(
            r#"
allow_hosts = [{ host = "git.example.com", ports = [22] }, "api.example.org"]
allow_ports = [443]
"#,
        );
        let git = "allow_hosts git.example.com (ports 22)";
        let api = "allow_hosts api.example.org";
        let flows = [
            flow("ci", "git.example.com", 443, Verdict::Allow, Some(git)),
            flow("ci", "git.example.com", 2222, Verdict::WouldDeny, Some(git)),
            flow("ci", "api.example.org", 2222, Verdict::WouldDeny, Some(api)),
            flow("ci", "api.example.org", 8443, Verdict::WouldDeny, Some(api)),
            // Under another policy, or an entry the policy in force no longer has: no note.
            flow(
                "web",
                "api.example.org",
                9000,
                Verdict::WouldDeny,
                Some(api),
            ),
            flow(
                "ci",
                "old.example.org",
                9443,
                Verdict::WouldDeny,
                Some("allow_hosts old.example.org"),
            ),
        ];
        let d = diff_of(&flows, &current, "ci");
        let l = lines(&d);
        assert!(l.contains(&"  allow_ports 443"), "{d}");
        assert!(
            l.contains(
                &"+ allow_ports 2222  # allow_hosts entry git.example.com (ports 22): add port \
                  2222; allow_hosts entry api.example.org: add port 2222"
            ),
            "{d}"
        );
        assert!(
            l.contains(&"+ allow_ports 8443  # allow_hosts entry api.example.org: add port 8443"),
            "{d}"
        );
        assert!(l.contains(&"+ allow_ports 9000"), "{d}");
        assert!(l.contains(&"+ allow_ports 9443"), "{d}");
    }

    #[test]
    fn a_preset_is_proposed_for_two_of_its_names_or_all_the_names_observed() {
        let s = suggest(&observed(
            &[
                ("api.github.com", &[443]),
                ("codeload.github.com", &[443]),
                ("pypi.org", &[443]),
                ("example.org", &[443]),
            ],
            &[],
        ));
        let names: Vec<&str> = s.presets.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            ["github"],
            "pypi.org alone of several names: no python"
        );
        let hosts: Vec<&str> = s.hosts.iter().map(|h| h.pattern.as_str()).collect();
        assert_eq!(hosts, ["example.org", "pypi.org"]);
        let text = render(&s, "w", &[]);
        assert!(text.contains("presets = [\"github\"]\n"), "{text}");
        assert!(
            text.contains("# preset github covers api.github.com, codeload.github.com; it allows"),
            "{text}"
        );
        let back: Config = Config::from_toml_str(&text, std::path::Path::new("s.toml")).unwrap();
        let w = CompiledPolicy::new(back.policy("w").unwrap());
        for n in [
            "api.github.com",
            "codeload.github.com",
            "pypi.org",
            "example.org",
        ] {
            let d = Destination::parse(n).unwrap();
            assert_eq!(w.check_target(&d, 443), Ok(()), "{n}");
        }
        // Every observed name inside one preset: proposed even for one name; no hosts left,
        // allow_ports still said.
        let only = suggest(&observed(&[("api.anthropic.com", &[443])], &[]));
        assert_eq!(only.presets.len(), 1);
        assert!(only.hosts.is_empty());
        let text = render(&only, "w", &[]);
        assert!(
            text.contains("presets = [\"anthropic\"]\nallow_ports = [443]\n"),
            "{text}"
        );
    }
}
