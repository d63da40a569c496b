//! What the proxy records about its decisions: denials, would-denials (a policy in
//! `enforce = "audit"`) and allowed requests/tunnels, each with the listener's identity. The one
//! place where a [`Decision`] becomes an action.
use std::net::IpAddr;

use super::Shared;
use super::request::Target;
use crate::events::{ALLOWED_REASON, DenialEvent, Verdict};
use egress_policy::name::Destination;
use egress_policy::{Decision, DenyReason};

impl Shared {
    /// Act on `decision`: `Allow` → `Ok(false)`; `WouldDeny` → would-deny event, `Ok(true)` (go
    /// on); `Deny` → denial event, `Err(reason)` (refuse).
    pub(crate) fn enforce(
        &self,
        target: &Target,
        ip: Option<IpAddr>,
        protocol: &str,
        decision: Decision,
    ) -> Result<bool, DenyReason> {
        match decision {
            Decision::Allow(_) => Ok(false),
            Decision::WouldDeny(r) => {
                self.record(target, ip, protocol, r.reason.as_str(), Verdict::WouldDeny);
                Ok(true)
            }
            Decision::Deny(r) => {
                self.record(target, ip, protocol, r.reason.as_str(), Verdict::Deny);
                Err(r.reason)
            }
        }
    }

    /// One event about `target` with this listener's identity. Only the normalised host name,
    /// address, port and protocol: never a URL, path, query string or header.
    pub(crate) fn record(
        &self,
        target: &Target,
        ip: Option<IpAddr>,
        protocol: &str,
        reason: &str,
        verdict: Verdict,
    ) {
        self.record_with(target, ip, protocol, reason, verdict, &[]);
    }

    /// Emit a prepared event (the transparent path and the DNS responder build their own) with
    /// this listener's identity (container, cgroup, context labels) filled in.
    pub(crate) fn emit_denial(&self, mut ev: DenialEvent) {
        if let Some(id) = &self.identity {
            ev.container = id.container.clone();
            ev.cgroup_id = id.cgroup_id;
            ev.context
                .extend(id.context.iter().map(|(k, v)| (k.clone(), v.clone())));
            if let Some(by) = &id.clients {
                ev.context.extend(super::client::current_names(by.as_ref()));
            }
        }
        self.ctx.events().emit(ev);
    }

    /// [`Shared::record`] with extra context fields (method and path of a refused request).
    pub(crate) fn record_with(
        &self,
        target: &Target,
        ip: Option<IpAddr>,
        protocol: &str,
        reason: &str,
        verdict: Verdict,
        extra: &[(&str, &str)],
    ) {
        let (host, ip) = match &target.dest {
            Destination::Name(n) => (Some(n.as_str().to_owned()), ip),
            Destination::Ip(lit) => (None, Some(ip.unwrap_or(*lit))),
        };
        let mut ev = DenialEvent::proxy(&self.name, host, ip, target.port, protocol, reason)
            .with_verdict(verdict);
        for (k, v) in extra {
            ev.context.insert((*k).to_owned(), (*v).to_owned());
        }
        self.emit_denial(ev);
    }

    /// A denial event about `target` (the interception path's refusals).
    pub(crate) fn deny_event(
        &self,
        target: &Target,
        ip: Option<IpAddr>,
        protocol: &str,
        reason: DenyReason,
    ) {
        self.record(target, ip, protocol, reason.as_str(), Verdict::Deny);
    }

    /// [`Shared::deny_event`] with extra context fields (never a secret, URL or header value).
    pub(crate) fn deny_event_with(
        &self,
        target: &Target,
        protocol: &str,
        reason: DenyReason,
        extra: &[(&str, &str)],
    ) {
        self.record_with(
            target,
            None,
            protocol,
            reason.as_str(),
            Verdict::Deny,
            extra,
        );
    }

    /// A refused request inside an intercepted connection (or plain HTTP): the event also
    /// carries the method and the path (never the query string or fragment).
    pub(crate) fn deny_request_event(
        &self,
        target: &Target,
        protocol: &str,
        reason: DenyReason,
        method: &str,
        path: &str,
    ) {
        let path = path.split(['?', '#']).next().unwrap_or("");
        self.record_with(
            target,
            None,
            protocol,
            reason.as_str(),
            Verdict::Deny,
            &[("method", method), ("path", path)],
        );
    }

    /// An allowed (and forwarded) request or CONNECT: the allowed counter, and an allow event
    /// for the flow summary when something records allowed traffic. `audited`: a would-deny was
    /// recorded for it already (it is not counted twice).
    pub(crate) fn allowed(
        &self,
        target: &Target,
        ip: Option<IpAddr>,
        protocol: &str,
        audited: bool,
    ) {
        if let Some(c) = &self.counters {
            c.allowed();
        }
        if !audited && self.ctx.events().wants_allowed() {
            self.record(target, ip, protocol, ALLOWED_REASON, Verdict::Allow);
        }
    }
}
