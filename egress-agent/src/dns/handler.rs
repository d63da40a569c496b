//! The hickory-server [`RequestHandler`] of one responder: [`decide`], resolve, [`plan`], report
//! to the [`AnswerSink`], send. Every path answers or drops; none panics.
use std::sync::Arc;
use std::time::Instant;

use hickory_server::net::runtime::Time;
use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{Edns, Header, HeaderCounts, Metadata, ResponseCode};
use hickory_server::proto::rr::Record;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use tokio::sync::Semaphore;

use super::answer::{Planned, plan};
use super::decide::{Decision, Denied, decide};
use super::{Answer, AnswerSink, DNS_PORT};
use crate::events::{DenialEvent, Verdict};
use crate::policy::DenyReason;
use crate::policy::name::HostName;
use crate::proxy::Shared;

/// Largest UDP answer offered to EDNS clients (the DNS flag day 2020 value: no fragmentation).
pub const MAX_UDP_PAYLOAD: u16 = 1232;
/// Answers without EDNS (RFC 1035).
const PLAIN_UDP_PAYLOAD: u16 = 512;

pub(crate) struct Handler {
    pub(crate) shared: Arc<Shared>,
    pub(crate) sink: Arc<dyn AnswerSink>,
    /// Resolutions in flight on this responder (a flood of allowed names can't pile up tasks
    /// without bound: beyond it, SERVFAIL at once).
    pub(crate) inflight: Arc<Semaphore>,
}

impl Handler {
    /// A name the auditing policy would refuse, answered anyway.
    fn report(&self, host: &HostName, reason: DenyReason, verdict: Verdict) {
        self.shared.emit_denial(
            DenialEvent::proxy(
                &self.shared.name,
                Some(host.as_str().to_owned()),
                None,
                DNS_PORT,
                "dns",
                reason.as_str(),
            )
            .with_verdict(verdict),
        );
    }

    fn deny(&self, host: Option<&HostName>, ip: Option<std::net::IpAddr>, reason: DenyReason) {
        self.shared.emit_denial(DenialEvent::proxy(
            &self.shared.name,
            host.map(|h| h.as_str().to_owned()),
            ip,
            DNS_PORT,
            "dns",
            reason.as_str(),
        ));
    }
}

/// Upper bound of the encoded size of a response with `records` (no name compression assumed):
/// header, the question, and each record's owner name, fixed fields and data.
fn size_bound(request: &Request, records: &[Record]) -> usize {
    let question: usize = request
        .queries
        .queries()
        .iter()
        .map(|q| q.name().len() + 2 + 4)
        .sum();
    let answers: usize = records
        .iter()
        .map(|r| {
            let data = match r.data.ip_addr() {
                Some(std::net::IpAddr::V4(_)) => 4,
                Some(std::net::IpAddr::V6(_)) => 16,
                None => 255 + 2, // a CNAME target: at most one full name
            };
            r.name.len() + 2 + 10 + data
        })
        .sum();
    // OPT record of the response.
    12 + question + answers + 11
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let mut meta = Metadata::response_from_request(&request.metadata);
        meta.recursion_available = true;
        let edns = request.edns.as_ref().map(|req| {
            let mut e = Edns::new();
            e.set_max_payload(req.max_payload().clamp(PLAIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD));
            e
        });
        let budget = match (request.protocol(), &edns) {
            (Protocol::Udp, Some(e)) => usize::from(e.max_payload()),
            (Protocol::Udp, None) => usize::from(PLAIN_UDP_PAYLOAD),
            _ => usize::from(u16::MAX),
        };
        let mut builder = MessageResponseBuilder::new(&request.queries, None);
        if let Some(e) = &edns {
            builder.edns(e);
        }
        let policy = self.shared.policy.load_full();
        let (name, record_type, direct_ports) = match decide(&policy, request) {
            Decision::Drop => {
                return ResponseInfo::from(Header {
                    metadata: meta,
                    counts: HeaderCounts::default(),
                });
            }
            Decision::Reply { code, denied } => {
                if let Some(Denied { host, reason }) = denied {
                    self.deny(host.as_ref(), None, reason);
                }
                meta.response_code = code;
                return send(&mut response, builder.build_no_records(meta)).await;
            }
            Decision::Resolve {
                name,
                record_type,
                direct_ports,
                would_deny,
            } => {
                if let Some(reason) = would_deny {
                    self.report(&name, reason, Verdict::WouldDeny);
                }
                (name, record_type, direct_ports)
            }
        };
        let Ok(_permit) = self.inflight.try_acquire() else {
            tracing::debug!(policy = %self.shared.name, "dns: too many lookups in flight");
            meta.response_code = ResponseCode::ServFail;
            return send(&mut response, builder.build_no_records(meta)).await;
        };
        let names = self.shared.ctx.resolver().lookup_records(&name).await;
        match plan(&policy, &names, record_type, Instant::now()) {
            Planned::Answer {
                records,
                addrs,
                direct_addrs,
                ttl,
            } => {
                if size_bound(request, &records) > budget {
                    // Too big for this UDP client: truncated, it retries over TCP.
                    meta.truncation = true;
                    return send(&mut response, builder.build_no_records(meta)).await;
                }
                // Before the client can see the addresses (and connect to them).
                self.sink.answered(&Answer {
                    policy: &self.shared.name,
                    identity: self.shared.identity.as_ref(),
                    client: request.src(),
                    name: &name,
                    addrs: &addrs,
                    ttl,
                    direct_ports: &direct_ports,
                    direct_addrs: &direct_addrs,
                });
                let none: [&Record; 0] = [];
                let msg = builder.build(meta, records.iter(), none, none, none);
                send(&mut response, msg).await
            }
            Planned::NoData => send(&mut response, builder.build_no_records(meta)).await,
            Planned::NxDomain => {
                meta.response_code = ResponseCode::NXDomain;
                send(&mut response, builder.build_no_records(meta)).await
            }
            Planned::Denied { reason, ip } => {
                self.deny(Some(&name), Some(ip), reason);
                meta.response_code = ResponseCode::NXDomain;
                send(&mut response, builder.build_no_records(meta)).await
            }
            Planned::Failed(why) => {
                tracing::debug!(policy = %self.shared.name, %name, why, "dns: lookup failed");
                meta.response_code = ResponseCode::ServFail;
                send(&mut response, builder.build_no_records(meta)).await
            }
        }
    }
}

async fn send<'a, R: ResponseHandler>(
    response: &mut R,
    msg: hickory_server::zone_handler::MessageResponse<
        '_,
        'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
    >,
) -> ResponseInfo {
    let meta = *msg.metadata();
    match response.send_response(msg).await {
        Ok(info) => info,
        Err(e) => {
            tracing::debug!(error = %e, "dns: answer not delivered");
            let mut m = meta;
            m.response_code = ResponseCode::ServFail;
            ResponseInfo::from(Header {
                metadata: m,
                counts: HeaderCounts::default(),
            })
        }
    }
}
