//! One place per decision for both transports: the UDP batch loop ([`super::udp`]) and the
//! DNS-over-TCP connections ([`super::tcp`]) call the same [`Core`] functions, in the same order:
//!
//! 1. [`Core::now`] — [`wire::read`], [`decide`], denial events, and, for an allowed name whose
//!    records the resolver still caches, [`Core::finish`] at once: everything that needs no
//!    network is answered here, synchronously.
//! 2. Otherwise a [`Miss`]: [`Core::admit`] takes a slot of the in-flight bound (none left:
//!    [`Core::servfail`]), and [`Core::resolve`] asks the resolver and calls [`Core::finish`].
//!
//! [`Core::finish`] is the only place that [`plan`]s an answer, decides truncation, reports to the
//! [`AnswerSink`] (before the bytes exist, so before any client can see the addresses), emits the
//! address denial, and counts the outcome. Every path answers or drops; none panics.
//!
//! The UDP loop keeps what [`Core::now`] answered without the network ([`Kept`]) in its
//! [`super::memo`], and answers the same query bytes again through [`Core::reuse`]: the same
//! act on the name, denial event, sink report and counters, the kept bytes.
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use hickory_server::proto::op::ResponseCode;
use hickory_server::proto::rr::{RData, Record, RecordType};
use hickory_server::server::Request;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::answer::{Planned, plan, ttl_secs};
use super::decide::{Decision, Denied, decide};
use super::memo::{Answered, Entry, Kept, Kind};
use super::wire::{self, Read, Reply, Transport};
use super::{Answer, AnswerSink, DNS_PORT};
use crate::metrics::{DnsCounters, DnsDrop, DnsOutcome};
use crate::proxy::Shared;
use crate::proxy::act::{Act, At, KeptDenial, Stage};
use crate::proxy::resolve::NameRecords;
use egress_policy::name::HostName;
use egress_policy::{CompiledPolicy, Decision as PolicyDecision};

/// TTL of the `egress.internal` answer (seconds).
const AGENT_NAME_TTL: u32 = 60;

/// The name the request asked for, as asked (the owner of the records answered for it).
fn question_name(request: &Request) -> Option<hickory_server::proto::rr::Name> {
    request
        .queries
        .queries()
        .first()
        .map(|q| hickory_server::proto::rr::Name::from(q.name().clone()))
}

pub(crate) struct Core {
    pub(crate) shared: Arc<Shared>,
    pub(crate) sink: Arc<dyn AnswerSink>,
    /// Resolutions in flight on this responder (a flood of allowed, uncached names can't pile up
    /// tasks without bound: beyond it, SERVFAIL at once).
    pub(crate) inflight: Arc<Semaphore>,
    pub(crate) counters: Option<DnsCounters>,
}

/// An allowed name whose records are not cached: to be resolved, then [`Core::finish`]ed.
pub(crate) struct Miss {
    pub(crate) request: Box<Request>,
    pending: Pending,
}

struct Pending {
    policy: Arc<CompiledPolicy>,
    name: HostName,
    record_type: RecordType,
    direct_ports: Vec<u16>,
    lan: bool,
    decision: PolicyDecision,
}

/// What [`Core::now`] made of one message.
pub(crate) enum Now {
    /// Send these bytes; the same query may get them again while `Kept` holds.
    Send(Vec<u8>, Option<Kept>),
    /// Send nothing (counted).
    Drop,
    /// Needs the resolver.
    Miss(Miss),
}

impl Core {
    pub(crate) fn count(&self, outcome: DnsOutcome) {
        if let Some(c) = &self.counters {
            c.answer(outcome);
        }
    }

    pub(crate) fn dropped(&self, reason: DnsDrop) {
        if let Some(c) = &self.counters {
            c.dropped(reason);
        }
    }

    /// The encoded response, or nothing (counted) when it can't be encoded.
    fn encode(&self, request: &Request, transport: Transport, reply: &Reply) -> Option<Vec<u8>> {
        let out = wire::encode(request, transport, reply);
        if out.is_none() {
            self.dropped(DnsDrop::SendFailed);
        }
        out
    }

    /// Step 1 for one message from `src`: everything that needs no network.
    pub(crate) fn now(&self, bytes: &[u8], src: SocketAddr, transport: Transport) -> Now {
        if !wire::answerable(src) {
            self.dropped(DnsDrop::BadSource);
            return Now::Drop;
        }
        let request = match wire::read(bytes, src, transport) {
            Read::Message(r) => r,
            Read::FormErr(out) => {
                self.count(DnsOutcome::FormErr);
                return Now::Send(out, None);
            }
            Read::Drop(why) => {
                self.dropped(why);
                return Now::Drop;
            }
        };
        let policy = self.shared.policy.load_full();
        let pending = match decide(&policy, &request) {
            Decision::Drop => {
                self.dropped(DnsDrop::Response);
                return Now::Drop;
            }
            Decision::Agent { record_type } => {
                let reply = self.agent_name(&request, record_type);
                return self.send(&request, transport, &reply, None);
            }
            Decision::Host { record_type } => {
                let reply = self.host_name(&request, record_type);
                return self.send(&request, transport, &reply, None);
            }
            Decision::Reply { code, denied } => {
                let Some(denied) = denied else {
                    self.count(DnsOutcome::FormErr);
                    return self.send(&request, transport, &Reply::code(code), None);
                };
                let at = at(denied.host.as_ref(), None);
                let denial = self.shared.deny(&policy, &at, denied.refused);
                self.count(DnsOutcome::Denied);
                let reply = Reply::refused(code, &denial.summary());
                let kept = Kept {
                    policy: policy.clone(),
                    kind: Kind::Denied(denied, KeptDenial::default()),
                };
                return self.send(&request, transport, &reply, Some(kept));
            }
            Decision::Resolve {
                name,
                record_type,
                direct_ports,
                lan,
                decision,
            } => {
                // An allowed name goes on (counted when answered); an audited one is reported.
                if let Act::Refuse(denial) =
                    self.shared
                        .act(&policy, &at(Some(&name), None), decision, Stage::Checked)
                {
                    // `decide` hands over no denial here; refused all the same if it did.
                    self.count(DnsOutcome::Denied);
                    let reply = Reply::refused(ResponseCode::NXDomain, &denial.summary());
                    return self.send(&request, transport, &reply, None);
                }
                Pending {
                    policy,
                    name,
                    record_type,
                    direct_ports,
                    lan,
                    decision,
                }
            }
        };
        match self.shared.ctx.resolver().cached_records(&pending.name) {
            Some((until, names)) => {
                let (reply, answered) =
                    self.finish(&request, transport, &pending, &names, Some(until));
                let kept = answered.map(|a| Kept {
                    policy: pending.policy.clone(),
                    kind: Kind::Answer(a),
                });
                self.send(&request, transport, &reply, kept)
            }
            None => Now::Miss(Miss { request, pending }),
        }
    }

    fn send(
        &self,
        request: &Request,
        transport: Transport,
        reply: &Reply,
        kept: Option<Kept>,
    ) -> Now {
        match self.encode(request, transport, reply) {
            Some(out) => Now::Send(out, kept),
            None => Now::Drop,
        }
    }

    /// A kept answer for the same query bytes again, from `src`, under `policy` (the one the
    /// memo follows): [`Reuse::Stale`] when its records or its TTL's second ran out (the full
    /// path answers then, and its answer replaces the entry).
    pub(crate) fn reuse(&self, entry: &Entry, policy: &CompiledPolicy, src: SocketAddr) -> Reuse {
        match &entry.kind {
            Kind::Denied(Denied { host, refused }, event) => {
                self.shared
                    .deny_again(policy, &at(host.as_ref(), None), *refused, event);
                self.count(DnsOutcome::Denied);
            }
            Kind::Answer(a) => {
                let now = Instant::now();
                let ttl = a.clock.ttl(now);
                if now >= a.until || ttl_secs(ttl) != a.secs {
                    return Reuse::Stale;
                }
                let at = at(Some(&a.name), None);
                if let Act::Refuse(_) = self.shared.act(policy, &at, a.decision, Stage::Checked) {
                    // `decide` kept no denial here; the full path answers if it did.
                    return Reuse::Stale;
                }
                self.sink.answered(&Answer {
                    policy: &self.shared.name,
                    identity: self.shared.identity.as_ref(),
                    client: src,
                    name: &a.name,
                    addrs: &a.addrs,
                    ttl,
                    direct_ports: &a.direct_ports,
                    direct_addrs: &a.direct_addrs,
                });
                self.count(DnsOutcome::Allowed);
            }
        }
        Reuse::Send
    }

    /// `egress.internal`: the endpoint's IPv4 address for `A` (no `AAAA`: the name leads to the
    /// IPv4 endpoint only). Never reported to the answer sink — it opens nothing directly: the
    /// kernel sends port 80 there to the transparent listener, which serves the name by Host.
    fn agent_name(&self, request: &Request, record_type: RecordType) -> Reply {
        let owner = question_name(request);
        match (record_type, self.shared.ctx.agent_v4(), owner) {
            (RecordType::A, Some(ip), Some(owner)) => {
                self.count(DnsOutcome::Allowed);
                Reply {
                    records: vec![Record::from_rdata(
                        owner,
                        AGENT_NAME_TTL,
                        RData::A(ip.into()),
                    )],
                    ..Reply::code(ResponseCode::NoError)
                }
            }
            _ => {
                self.count(DnsOutcome::Empty);
                Reply::code(ResponseCode::NoError)
            }
        }
    }

    /// `host.docker.internal` (the policy allows host services): the addresses at which this
    /// listener's workload reaches its host, of the asked family (none known yet, or none of
    /// that family: NOERROR without records). Not reported to the answer sink: the kernel
    /// entry opens the host services at these addresses already.
    fn host_name(&self, request: &Request, record_type: RecordType) -> Reply {
        let owner = question_name(request);
        let host = self.shared.host.load();
        let records: Vec<Record> = owner
            .map(|owner| {
                host.iter()
                    .filter_map(|ip| match (record_type, ip) {
                        (RecordType::A, IpAddr::V4(a)) => Some(RData::A((*a).into())),
                        (RecordType::AAAA, IpAddr::V6(a)) => Some(RData::AAAA((*a).into())),
                        _ => None,
                    })
                    .map(|rdata| Record::from_rdata(owner.clone(), AGENT_NAME_TTL, rdata))
                    .collect()
            })
            .unwrap_or_default();
        self.count(if records.is_empty() {
            DnsOutcome::Empty
        } else {
            DnsOutcome::Allowed
        });
        Reply {
            records,
            ..Reply::code(ResponseCode::NoError)
        }
    }

    /// A slot of the in-flight bound for one resolution, if one is free.
    pub(crate) fn admit(&self) -> Option<OwnedSemaphorePermit> {
        let permit = self.inflight.clone().try_acquire_owned().ok();
        if permit.is_none() {
            tracing::debug!(policy = %self.shared.name, "dns: too many lookups in flight");
        }
        permit
    }

    /// SERVFAIL for a miss that got no slot.
    pub(crate) fn servfail(&self, miss: &Miss, transport: Transport) -> Option<Vec<u8>> {
        self.count(DnsOutcome::ServFail);
        self.encode(
            &miss.request,
            transport,
            &Reply::code(ResponseCode::ServFail),
        )
    }

    /// Step 2: resolve a miss (the caller holds its slot) and answer it.
    pub(crate) async fn resolve(&self, miss: &Miss, transport: Transport) -> Option<Vec<u8>> {
        let names = self
            .shared
            .ctx
            .resolver()
            .lookup_records(&miss.pending.name)
            .await;
        let (reply, _) = self.finish(&miss.request, transport, &miss.pending, &names, None);
        self.encode(&miss.request, transport, &reply)
    }

    /// The answer to an allowed name from its records: the address check, truncation, the sink
    /// report, events and counters. The only place an answer is planned. With `until` (the
    /// records come from the cache and are reused until then), an answer also says what the
    /// memo may keep of it.
    fn finish(
        &self,
        request: &Request,
        transport: Transport,
        pending: &Pending,
        names: &NameRecords,
        until: Option<Instant>,
    ) -> (Reply, Option<Answered>) {
        let name = &pending.name;
        let planned = plan(
            &pending.policy,
            names,
            pending.record_type,
            pending.lan,
            Instant::now(),
        );
        let reply = match planned {
            Planned::Answer {
                records,
                addrs,
                direct_addrs,
                ttl,
                clock,
            } => {
                if !wire::fits(request, transport, &records) {
                    // Too big for this UDP client: truncated, it retries over TCP (and is
                    // reported to the sink then, with the addresses it gets).
                    self.count(DnsOutcome::Truncated);
                    let reply = Reply {
                        truncated: true,
                        ..Reply::code(ResponseCode::NoError)
                    };
                    return (reply, None);
                }
                // Before the client can see the addresses (and connect to them).
                self.sink.answered(&Answer {
                    policy: &self.shared.name,
                    identity: self.shared.identity.as_ref(),
                    client: request.src(),
                    name,
                    addrs: &addrs,
                    ttl,
                    direct_ports: &pending.direct_ports,
                    direct_addrs: &direct_addrs,
                });
                self.count(DnsOutcome::Allowed);
                let reply = Reply {
                    records,
                    ..Reply::code(ResponseCode::NoError)
                };
                let answered = until.map(|until| Answered {
                    name: name.clone(),
                    decision: pending.decision,
                    direct_ports: pending.direct_ports.clone(),
                    addrs,
                    direct_addrs,
                    clock,
                    secs: ttl_secs(ttl),
                    until,
                });
                return (reply, answered);
            }
            Planned::NoData => {
                self.count(DnsOutcome::Empty);
                Reply::code(ResponseCode::NoError)
            }
            Planned::NxDomain => {
                self.count(DnsOutcome::Empty);
                Reply::code(ResponseCode::NXDomain)
            }
            Planned::Denied { refused, ip } => {
                let denial = self
                    .shared
                    .deny(&pending.policy, &at(Some(name), Some(ip)), refused);
                self.count(DnsOutcome::Denied);
                Reply::refused(ResponseCode::NXDomain, &denial.summary())
            }
            Planned::Failed(why) => {
                tracing::debug!(policy = %self.shared.name, %name, why, "dns: lookup failed");
                self.count(DnsOutcome::ServFail);
                Reply::code(ResponseCode::ServFail)
            }
        };
        (reply, None)
    }
}

/// What [`Core::reuse`] made of a kept answer.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reuse {
    /// Send its bytes (everything else is done).
    Send,
    /// It ran out: answer the query through [`Core::now`].
    Stale,
}

/// Where a DNS decision is taken, for [`Shared::act`]: the name asked (an address of its answer:
/// `ip`), on the DNS port.
fn at(host: Option<&HostName>, ip: Option<IpAddr>) -> At<'_> {
    At {
        host: host.map(HostName::as_str),
        ip,
        port: DNS_PORT,
        protocol: "dns",
        context: &[],
        audit_once: None,
    }
}
