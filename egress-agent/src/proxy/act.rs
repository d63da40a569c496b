//! The one place where a decision becomes an action. Every enforcement point of the proxy —
//! `CONNECT`, proxied and transparent HTTP, transparent TLS, requests on an intercepted
//! connection, DNS, a reload narrowing what is open, and the refusals that are no rule of the
//! policy (request shape, TLS, admission) — hands its [`Decision`] to [`Shared::act`] with an
//! [`At`] (what an event about it names) and a [`Stage`], and does what the [`Act`] says.
//!
//! Here and only here:
//! - a denial becomes a denial event and a refusal;
//! - an audited refusal (`WouldDeny`) becomes a would-deny event — once per connection when the
//!   point says so ([`At::audit_once`]) — and goes on;
//! - carried traffic ([`Stage::Carried`]) is counted as allowed, with an allow event when
//!   something records allowed traffic (not for an audited one: its would-deny stands for it);
//! - every event carries the rule that decided, described as configured
//!   ([`CompiledPolicy::describe`]), and the listener's identity.
//!
//! Events name only the normalised host name, address, port and protocol, and the context the
//! point adds: never a URL, query string, header or secret.
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Shared;
use super::denial::{Denial, RUN_LABEL};
use super::request::Target;
use crate::events::{ALLOWED_REASON, DenialEvent, Verdict};
use egress_policy::name::Destination;
use egress_policy::{CompiledPolicy, Decision, DenyReason, Refused};

/// Where a decision was taken: what an event about it names.
pub(crate) struct At<'a> {
    /// The normalised name, when there is one.
    pub(crate) host: Option<&'a str>,
    /// The address concerned: an IP literal, the address dialled or refused, or the original
    /// destination of a redirected connection.
    pub(crate) ip: Option<IpAddr>,
    pub(crate) port: u16,
    /// `connect`, `http`, `https`, `tls`, `tcp`, `dns`, ...
    pub(crate) protocol: &'a str,
    /// Extra event context (method, path without query, `denied_address`, `ended`, ...).
    pub(crate) context: &'a [(&'a str, &'a str)],
    /// Set once this connection's would-deny is recorded: a later one on it records nothing.
    pub(crate) audit_once: Option<&'a AtomicBool>,
}

impl<'a> At<'a> {
    /// A decision about `target` (its name, or its IP literal as the address).
    pub(crate) fn target(target: &'a Target, protocol: &'a str) -> At<'a> {
        let (host, ip) = match &target.dest {
            Destination::Name(n) => (Some(n.as_str()), None),
            Destination::Ip(ip) => (None, Some(*ip)),
        };
        At {
            host,
            ip,
            port: target.port,
            protocol,
            context: &[],
            audit_once: None,
        }
    }

    /// Before the client named any destination (a malformed request, a foreign peer).
    pub(crate) fn nowhere(protocol: &'a str) -> At<'a> {
        At {
            host: None,
            ip: None,
            port: 0,
            protocol,
            context: &[],
            audit_once: None,
        }
    }

    /// The same place, naming `ip` (when there is one; an IP literal stays otherwise).
    pub(crate) fn ip(self, ip: Option<IpAddr>) -> At<'a> {
        At {
            ip: ip.or(self.ip),
            ..self
        }
    }

    pub(crate) fn context(self, context: &'a [(&'a str, &'a str)]) -> At<'a> {
        At { context, ..self }
    }

    pub(crate) fn audit_once(self, flag: &'a AtomicBool) -> At<'a> {
        At {
            audit_once: Some(flag),
            ..self
        }
    }
}

/// What a decision's point does with what it decided on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// The traffic goes on now (a dialled upstream, a reused one): counted as allowed.
    Carried,
    /// A check of traffic counted elsewhere (a request on an intercepted connection, a DNS
    /// answer, an open connection decided again).
    Checked,
}

/// What to do next.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Act {
    /// Go on; `audited`: the policy refused it and audits (its would-deny is recorded).
    Go { audited: bool },
    /// Refuse (its denial is recorded); what the client is told.
    Refuse(Denial),
}

impl Shared {
    /// Act on `decision`, taken under `policy` at `at`: see the module docs.
    pub(crate) fn act(
        &self,
        policy: &CompiledPolicy,
        at: &At<'_>,
        decision: Decision,
        stage: Stage,
    ) -> Act {
        let act = match decision {
            Decision::Deny(r) => return Act::Refuse(self.deny(policy, at, r)),
            Decision::Allow(_) => Act::Go { audited: false },
            Decision::WouldDeny(r) => {
                self.would_deny(policy, at, r);
                Act::Go { audited: true }
            }
        };
        if stage == Stage::Carried {
            if let Some(c) = &self.counters {
                c.allowed();
            }
            if let Decision::Allow(rule) = decision
                && self.ctx.events().wants_allowed()
            {
                let rule = Some(policy.describe(rule));
                self.event(at, ALLOWED_REASON, Verdict::Allow, rule);
            }
        }
        act
    }

    /// [`Shared::act`] on a refusal the policy audits: its would-deny event (once per
    /// connection with [`At::audit_once`]). The caller goes on.
    pub(crate) fn would_deny(&self, policy: &CompiledPolicy, at: &At<'_>, r: Refused) {
        let first = at
            .audit_once
            .is_none_or(|done| !done.swap(true, Ordering::Relaxed));
        if first {
            let rule = r.rule.map(|rule| policy.describe(rule));
            self.event(at, r.reason.as_str(), Verdict::WouldDeny, rule);
        }
    }

    /// [`Shared::act`] on a refusal: its denial event (with the rule that refused). Returns
    /// what the client is told.
    pub(crate) fn deny(&self, policy: &CompiledPolicy, at: &At<'_>, r: Refused) -> Denial {
        let rule = self.deny_recorded(policy, at, r);
        self.denial(at, r.reason, rule)
    }

    /// [`Shared::deny`]'s event alone, for a refusal whose answer the caller kept (the DNS
    /// responder's memo). Returns the rule described.
    pub(crate) fn deny_recorded(
        &self,
        policy: &CompiledPolicy,
        at: &At<'_>,
        r: Refused,
    ) -> Option<String> {
        let rule = r.rule.map(|rule| policy.describe(rule));
        self.event(at, r.reason.as_str(), Verdict::Deny, rule.clone());
        rule
    }

    /// A refusal that is no rule of the policy (request shape, TLS, admission, a missing
    /// secret): its denial event. Returns what the client is told.
    pub(crate) fn refuse(&self, at: &At<'_>, reason: DenyReason) -> Denial {
        self.event(at, reason.as_str(), Verdict::Deny, None);
        self.denial(at, reason, None)
    }

    fn denial(&self, at: &At<'_>, reason: DenyReason, rule: Option<String>) -> Denial {
        let run = self
            .identity
            .as_ref()
            .and_then(|id| id.context.get(RUN_LABEL))
            .map(String::as_str);
        Denial::new(reason, &self.name, at.host, at.port, rule, run)
    }

    /// [`Shared::deny_recorded`] once more for a refusal its caller keeps (the DNS responder's
    /// memo, `template` held in the kept entry, which lives under one policy): the event is built
    /// into `template` the first time, and each attempt after that is recorded as a copy of it
    /// or, while the sink collapses identical refusals, only counted — no event built. A
    /// listener that names the client within its workload builds each event (the client's
    /// names belong to the attempt).
    pub(crate) fn deny_again(
        &self,
        policy: &CompiledPolicy,
        at: &At<'_>,
        r: Refused,
        template: &KeptDenial,
    ) {
        if self
            .identity
            .as_ref()
            .is_some_and(|id| id.clients.is_some())
        {
            let _rule = self.deny_recorded(policy, at, r);
            return;
        }
        let ev = template.0.get_or_init(|| {
            let rule = r.rule.map(|rule| policy.describe(rule));
            Box::new(self.build_event(at, r.reason.as_str(), Verdict::Deny, rule))
        });
        self.ctx.events().emit_again(ev);
    }

    /// One event with this listener's identity (container, cgroup, context labels, the
    /// client within the workload).
    fn event(&self, at: &At<'_>, reason: &str, verdict: Verdict, rule: Option<String>) {
        let ev = self.build_event(at, reason, verdict, rule);
        self.ctx.events().emit(ev);
    }

    /// The event [`Shared::event`] records.
    fn build_event(
        &self,
        at: &At<'_>,
        reason: &str,
        verdict: Verdict,
        rule: Option<String>,
    ) -> DenialEvent {
        let mut ev = DenialEvent::proxy(
            &self.name,
            at.host.map(str::to_owned),
            at.ip,
            at.port,
            at.protocol,
            reason,
        )
        .with_verdict(verdict);
        ev.rule = rule;
        for (k, v) in at.context {
            ev.context.insert((*k).to_owned(), (*v).to_owned());
        }
        if let Some(id) = &self.identity {
            ev.container = id.container.clone();
            ev.cgroup_id = id.cgroup_id;
            ev.context
                .extend(id.context.iter().map(|(k, v)| (k.clone(), v.clone())));
            if let Some(by) = &id.clients {
                ev.context.extend(super::client::current_names(by.as_ref()));
            }
        }
        ev
    }
}

/// The denial event of a refusal its caller keeps and repeats (a DNS memo entry's), built at
/// the first repeat by [`Shared::deny_again`]; opaque outside this module (events are made
/// here only).
#[derive(Default)]
pub(crate) struct KeptDenial(std::cell::OnceCell<Box<DenialEvent>>);

/// A request's event context: its method and path (never the query string or fragment).
pub(crate) fn request_context<'a>(method: &'a str, path: &'a str) -> [(&'static str, &'a str); 2] {
    let path = path.split(['?', '#']).next().unwrap_or("");
    [("method", method), ("path", path)]
}
