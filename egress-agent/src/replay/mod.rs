//! `egress-agent replay` (issue #35, "impact before saving"): the flows the event store recorded,
//! decided again under a proposed policy by the decision code the enforcement points run, and
//! what that changes — newly allowed, newly denied, unchanged either way, would-deny (the
//! proposed policy audits), not replayable. What makes tightening a policy safe.
//!
//! Pure: flows and a [`Proposed`] policy in, a [`Report`] out. [`Replayer`] takes the flows one
//! at a time, as the store reads them (a whole store is never held in memory), and keeps one
//! tally per destination ([`tally`]); [`decide`] decides one flow. Reading the store, the CLI's
//! and the API's options and printing are [`command`]'s.
//!
//! A flow's recorded outcome *passed* when it was allowed or let through as a would-deny, and
//! was *refused* when denied. The proposed outcome comes from [`decide`]; a proposed would-deny
//! passes too, but is its own bucket ([`Bucket::WouldDeny`]), whatever was recorded.
pub mod command;
mod decide;
mod tally;

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::Serialize;

use crate::events::Verdict;
use egress_policy::explain::ProxyEndpoint;
use egress_policy::kernel::KernelPolicy;
use egress_policy::{CompiledPolicy, Decision, Policy};

/// Examples kept per destination.
pub const EXAMPLES: usize = 3;

/// A proposed policy, compiled once for the proxy's decisions and the kernel's.
#[derive(Debug)]
pub struct Proposed {
    name: String,
    compiled: CompiledPolicy,
    /// What the kernel programs would load, or why they can't.
    kernel: Result<KernelPolicy, String>,
    /// `allow_published_ports`: its ports are a container's, not recorded.
    published_ports: bool,
}

impl Proposed {
    /// `policy` under `name`; `endpoint`: the proxy endpoint(s) confined sockets are redirected
    /// from (the kernel's evaluation needs them, as `explain`'s does).
    pub fn new(name: &str, policy: &Policy, endpoint: ProxyEndpoint) -> Proposed {
        let endpoints = egress_policy::explain::endpoints(endpoint);
        Proposed {
            name: name.to_owned(),
            compiled: CompiledPolicy::new(policy),
            kernel: KernelPolicy::compile(policy, endpoints, &[]).map_err(|e| e.to_string()),
            published_ports: policy.allow_published_ports,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The proposed policy audits (its refusals would be would-denies).
    pub fn audits(&self) -> bool {
        self.compiled.audits()
    }
}

/// The proposed policy's decision on a recorded flow.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Decided {
    pub verdict: Verdict,
    /// The refusal's reason (`None` when allowed): the proxy's, or the kernel's `kernel-*`.
    pub reason: Option<&'static str>,
    /// The rule that decided: described as configured ([`CompiledPolicy::describe`], the text an
    /// event of the decision carries) for the proxy, as the kernel's evaluation words it for a
    /// direct connection. `None` when no rule is behind a refusal (`host-not-allowed`).
    pub rule: Option<String>,
}

/// A proposed decision as [`decide`] takes it: the proxy's own [`Decision`] (a `Copy` value:
/// its rule is described once per distinct decision, not per flow), or the kernel's, in the
/// kernel evaluation's words.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Now {
    Proxy(Decision),
    Kernel(Decided),
}

impl Now {
    pub fn verdict(&self) -> Verdict {
        match self {
            Now::Proxy(Decision::Allow(_)) => Verdict::Allow,
            Now::Proxy(Decision::WouldDeny(_)) => Verdict::WouldDeny,
            Now::Proxy(Decision::Deny(_)) => Verdict::Deny,
            Now::Kernel(d) => d.verdict,
        }
    }

    /// The decision in the report's terms, its rule described as configured.
    fn described(&self, p: &CompiledPolicy) -> Decided {
        let (verdict, reason, rule) = match *self {
            Now::Kernel(ref d) => return d.clone(),
            Now::Proxy(Decision::Allow(rule)) => (Verdict::Allow, None, Some(rule)),
            Now::Proxy(Decision::Deny(r)) => (Verdict::Deny, Some(r.reason.as_str()), r.rule),
            Now::Proxy(Decision::WouldDeny(r)) => {
                (Verdict::WouldDeny, Some(r.reason.as_str()), r.rule)
            }
        };
        Decided {
            verdict,
            reason,
            rule: rule.map(|r| p.describe(r)),
        }
    }
}

/// What replaying one flow gives.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replayed {
    /// Decided; `unrecorded`: what the decision could not see.
    Decided {
        now: Now,
        unrecorded: Option<Unrecorded>,
    },
    /// Not a decision of a policy's rules, or not one that can be taken from what was
    /// recorded: why.
    NotReplayable(&'static str),
}

/// What a replayed decision could not see (each becomes a note of the report).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unrecorded {
    /// Allowed traffic to a name keeps no address (DNS answers rotate): decided by the name.
    Address,
    /// A request refusal: its headers are not recorded (request rules decide by method and
    /// path only).
    Headers,
    /// An inbound connection under a policy with `allow_published_ports`: the container's
    /// published ports are not recorded.
    PublishedPorts,
}

impl Unrecorded {
    pub(super) fn note(self, c: Count) -> String {
        let (flows, events) = (c.flows, c.events);
        match self {
            Unrecorded::Address => format!(
                "{flows} flows ({events} events) to names that passed were replayed by the name alone: allowed traffic keeps no address (DNS answers rotate), so the proposed deny_cidrs, resolve_private and the built-in deny list were not applied to the addresses it reached"
            ),
            Unrecorded::Headers => format!(
                "{flows} request flows ({events} events) were replayed by method and path: headers are not recorded, so credential placeholders were not checked"
            ),
            Unrecorded::PublishedPorts => format!(
                "{flows} inbound flows ({events} events) were replayed without the containers' published ports (not recorded): allow_published_ports could not open any"
            ),
        }
    }
}

/// How a flow's outcome changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bucket {
    /// Passed, would be refused: what breaks a job (first in every listing).
    NewlyDenied,
    /// Refused, would pass.
    NewlyAllowed,
    /// The proposed policy audits and would refuse it: let through, recorded as would-deny.
    WouldDeny,
    UnchangedDenied,
    UnchangedAllowed,
}

impl Bucket {
    /// Every bucket, in the order of a report.
    pub const ALL: [Bucket; 5] = [
        Bucket::NewlyDenied,
        Bucket::NewlyAllowed,
        Bucket::WouldDeny,
        Bucket::UnchangedDenied,
        Bucket::UnchangedAllowed,
    ];

    pub fn of(recorded: Verdict, now: Verdict) -> Bucket {
        let passed = recorded != Verdict::Deny;
        match (passed, now) {
            (_, Verdict::WouldDeny) => Bucket::WouldDeny,
            (true, Verdict::Allow) => Bucket::UnchangedAllowed,
            (false, Verdict::Allow) => Bucket::NewlyAllowed,
            (true, Verdict::Deny) => Bucket::NewlyDenied,
            (false, Verdict::Deny) => Bucket::UnchangedDenied,
        }
    }

    /// For people: `newly denied`, ...
    pub fn title(self) -> &'static str {
        match self {
            Bucket::NewlyDenied => "newly denied",
            Bucket::NewlyAllowed => "newly allowed",
            Bucket::WouldDeny => "would-deny",
            Bucket::UnchangedDenied => "unchanged denied",
            Bucket::UnchangedAllowed => "unchanged allowed",
        }
    }
}

/// Flows, and the events they stand for (the sum of their counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Count {
    pub flows: u64,
    pub events: u64,
}

impl Count {
    pub(super) fn add(&mut self, events: u64) {
        self.flows += 1;
        self.events += events;
    }
}

/// The count of every bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub newly_denied: Count,
    pub newly_allowed: Count,
    pub would_deny: Count,
    pub unchanged_denied: Count,
    pub unchanged_allowed: Count,
    pub not_replayable: Count,
}

impl Totals {
    pub fn of(&self, b: Bucket) -> Count {
        match b {
            Bucket::NewlyDenied => self.newly_denied,
            Bucket::NewlyAllowed => self.newly_allowed,
            Bucket::WouldDeny => self.would_deny,
            Bucket::UnchangedDenied => self.unchanged_denied,
            Bucket::UnchangedAllowed => self.unchanged_allowed,
        }
    }

    pub(super) fn of_mut(&mut self, b: Bucket) -> &mut Count {
        match b {
            Bucket::NewlyDenied => &mut self.newly_denied,
            Bucket::NewlyAllowed => &mut self.newly_allowed,
            Bucket::WouldDeny => &mut self.would_deny,
            Bucket::UnchangedDenied => &mut self.unchanged_denied,
            Bucket::UnchangedAllowed => &mut self.unchanged_allowed,
        }
    }
}

/// What a flow's events recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recorded {
    pub verdict: Verdict,
    pub reason: String,
    /// As the events named it (`None`: no rule, a kernel event, or recorded before events
    /// named their rule).
    pub rule: Option<String>,
}

/// A flow standing for a destination's traffic: who, and when last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Example {
    pub container: Option<String>,
    /// The `run` context label.
    pub run: Option<String>,
    #[serde(serialize_with = "ser_time")]
    pub last_seen: SystemTime,
}

/// One destination in one bucket, with one proposed decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    pub bucket: Bucket,
    /// `proxy` or `kernel`.
    pub source: &'static str,
    /// `host:port`, `addr:port`, `host:port METHOD /path`, `host (DNS)`, `10.0.0.5:5432/tcp`,
    /// `inbound from 10.0.0.9 to port 22/tcp`, ...
    pub destination: String,
    pub flows: u64,
    pub events: u64,
    /// What its flows recorded (distinct, sorted).
    pub was: Vec<Recorded>,
    pub now: Decided,
    /// The [`EXAMPLES`] most recently seen flows.
    pub examples: Vec<Example>,
}

/// Flows no policy decision can be replayed for, by what they recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unreplayed {
    pub source: String,
    pub reason: String,
    pub why: &'static str,
    pub flows: u64,
    pub events: u64,
}

/// What replaying a selection of flows under a proposed policy gives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The proposed policy's name.
    pub policy: String,
    /// The proposed policy audits.
    pub audit: bool,
    /// Every flow replayed (not replayable included), and its events.
    pub flows: u64,
    pub events: u64,
    #[serde(serialize_with = "ser_opt_time")]
    pub first_seen: Option<SystemTime>,
    #[serde(serialize_with = "ser_opt_time")]
    pub last_seen: Option<SystemTime>,
    pub totals: Totals,
    /// Newly denied first, then by events (most first) and destination; at most the `limit`
    /// with the most events per bucket ([`Replayer::finish`]).
    pub destinations: Vec<Entry>,
    /// Per bucket, the destinations the limit left out (none: not there).
    pub unlisted: BTreeMap<Bucket, usize>,
    /// By events (most first).
    pub not_replayable: Vec<Unreplayed>,
    /// What the replay could not see, with the flows concerned.
    pub notes: Vec<String>,
}

fn ser_time<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_micros(*t))
}

fn ser_opt_time<S: serde::Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => ser_time(t, s),
        None => s.serialize_none(),
    }
}

pub use tally::Replayer;

#[cfg(test)]
mod tests;
