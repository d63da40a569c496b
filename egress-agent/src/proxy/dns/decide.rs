//! The first decision on a DNS query, made before anything leaves the agent. Pure: a policy and a
//! parsed request in, a [`Decision`] out (the fuzz target drives it with arbitrary packets).
use hickory_server::proto::op::{MessageType, OpCode, ResponseCode};
use hickory_server::proto::rr::{DNSClass, RecordType};
use hickory_server::zone_handler::MessageRequest;

use egress_policy::name::{HostName, MAX_NAME_LEN};
use egress_policy::{CompiledPolicy, Decision as PolicyDecision, DenyReason, Refused};

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Decision {
    /// Answer `code` with no records; `denied` is the denial to report, if it is one.
    Reply {
        code: ResponseCode,
        denied: Option<Denied>,
    },
    /// Send nothing (a response packet: never answered, against reflection loops).
    Drop,
    /// The agent's own name (`egress.internal`): answered by the agent with its endpoint's
    /// address, under any policy, never resolved upstream and never an event.
    Agent { record_type: RecordType },
    /// `host.docker.internal` under a policy with `allow_host_services`: answered with the
    /// address at which the workload reaches its host, never resolved upstream.
    Host { record_type: RecordType },
    /// The name is allowed: resolve it (both families) and answer `record_type` after the address
    /// check. `direct_ports`: the ports its `allow_hosts` entries carry. `decision`: the policy's
    /// on the name, `Allow` or — the policy audits and would refuse it — `WouldDeny` (answered
    /// and reported).
    Resolve {
        name: HostName,
        record_type: RecordType,
        direct_ports: Vec<u16>,
        /// A `lan = true` entry's name: its answers in `resolve_private` open directly too.
        lan: bool,
        decision: PolicyDecision,
    },
}

/// A denial: the normalised name when there is one, and why (with the rule, when a rule of the
/// policy refused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub host: Option<HostName>,
    pub refused: Refused,
}

fn reply(code: ResponseCode, host: Option<HostName>, reason: Option<DenyReason>) -> Decision {
    refused(code, host, reason.map(Refused::because))
}

fn refused(code: ResponseCode, host: Option<HostName>, refused: Option<Refused>) -> Decision {
    Decision::Reply {
        code,
        denied: refused.map(|refused| Denied { host, refused }),
    }
}

/// Decide on `request` under `policy`. Only [`Decision::Resolve`] lets a name reach a resolver,
/// and only for a name `allow_hosts` matches — or, under an auditing policy, any valid name
/// (reported as a would-deny).
pub fn decide(policy: &CompiledPolicy, request: &MessageRequest) -> Decision {
    if request.metadata.message_type != MessageType::Query {
        return Decision::Drop;
    }
    if request.metadata.op_code != OpCode::Query {
        return reply(ResponseCode::NotImp, None, None);
    }
    let [query] = request.queries.queries() else {
        // RFC 9619: exactly one question.
        return reply(ResponseCode::FormErr, None, None);
    };
    // The name first, so a refused type still reports which name it was for.
    let ascii = query.name().to_ascii();
    let name = match ascii.strip_suffix('.').unwrap_or(&ascii) {
        s if s.len() > MAX_NAME_LEN => Err(DenyReason::InvalidHost),
        s => HostName::parse(s).map_err(DenyReason::from),
    };
    let type_ok = matches!(query.query_type(), RecordType::A | RecordType::AAAA)
        && query.query_class() == DNSClass::IN;
    if !type_ok {
        return reply(
            ResponseCode::Refused,
            name.ok(),
            Some(DenyReason::DnsTypeRefused),
        );
    }
    let name = match name {
        Ok(n) => n,
        Err(reason) => return reply(ResponseCode::NXDomain, None, Some(reason)),
    };
    if name.as_str() == crate::proxy::self_service::NAME {
        return Decision::Agent {
            record_type: query.query_type(),
        };
    }
    if name.as_str() == egress_policy::model::HOST_SERVICES_NAME && policy.has_host_services() {
        return Decision::Host {
            record_type: query.query_type(),
        };
    }
    // The policy's decision on the name, audit applied as at every enforcement point: an
    // audited refusal is resolved and reported as a would-deny.
    let record_type = query.query_type();
    match policy.decide_name(&name) {
        (PolicyDecision::Deny(r), _) => {
            // `deny_all` is refused outright; a name no entry allows does not exist.
            let code = match r.reason {
                DenyReason::PolicyDenyAll => ResponseCode::Refused,
                _ => ResponseCode::NXDomain,
            };
            refused(code, Some(name), Some(r))
        }
        (decision, direct_ports) => Decision::Resolve {
            lan: !direct_ports.is_empty() && policy.is_lan_name(&name),
            name,
            record_type,
            direct_ports,
            decision,
        },
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;
    use egress_policy::Rule;
    use hickory_server::net::xfer::Protocol;
    use hickory_server::proto::op::{Message, Query};
    use hickory_server::proto::rr::Name;
    use hickory_server::server::Request;
    use std::path::Path;

    fn policy(toml: &str) -> CompiledPolicy {
        let c =
            Config::from_toml_str(&format!("[policies.p]\n{toml}"), Path::new("t.toml")).unwrap();
        CompiledPolicy::new(c.policy("p").unwrap())
    }

    fn parse(m: &Message) -> Request {
        let src = "127.0.0.1:5353".parse().unwrap();
        Request::from_bytes(m.to_vec().unwrap(), src, Protocol::Udp).unwrap()
    }

    fn request(name: &str, rt: RecordType) -> Request {
        let mut m = Message::query();
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), rt));
        parse(&m)
    }

    fn denied(d: Decision) -> (ResponseCode, Option<String>, Option<&'static str>) {
        match d {
            Decision::Reply { code, denied } => (
                code,
                denied
                    .as_ref()
                    .and_then(|d| d.host.as_ref().map(ToString::to_string)),
                denied.map(|d| d.refused.reason.as_str()),
            ),
            other => panic!("not a reply: {other:?}"),
        }
    }

    #[test]
    fn allowed_names_resolve_everything_else_is_answered_here() {
        let p = policy("allow_hosts = [\"allowed.test\", { host = \"*.ssh.test\", ports = [22] }]");
        assert_eq!(
            decide(&p, &request("Allowed.TEST.", RecordType::A)),
            Decision::Resolve {
                name: HostName::parse("allowed.test").unwrap(),
                record_type: RecordType::A,
                direct_ports: vec![],
                lan: false,
                decision: PolicyDecision::Allow(Rule::Host {
                    index: 0,
                    port: None
                }),
            }
        );
        assert_eq!(
            decide(&p, &request("git.ssh.test", RecordType::AAAA)),
            Decision::Resolve {
                name: HostName::parse("git.ssh.test").unwrap(),
                record_type: RecordType::AAAA,
                direct_ports: vec![22],
                lan: false,
                decision: PolicyDecision::Allow(Rule::Host {
                    index: 1,
                    port: None
                }),
            }
        );
        for (name, rt, want) in [
            (
                "c2VjcmV0.evil.test.",
                RecordType::A,
                (
                    ResponseCode::NXDomain,
                    Some("c2vjcmv0.evil.test"),
                    Some("host-not-allowed"),
                ),
            ),
            (
                "allowed.test.evil.test.",
                RecordType::A,
                (
                    ResponseCode::NXDomain,
                    Some("allowed.test.evil.test"),
                    Some("host-not-allowed"),
                ),
            ),
            (
                "allowed.test.",
                RecordType::TXT,
                (
                    ResponseCode::Refused,
                    Some("allowed.test"),
                    Some("dns-type-refused"),
                ),
            ),
            (
                "allowed.test.",
                RecordType::NULL,
                (
                    ResponseCode::Refused,
                    Some("allowed.test"),
                    Some("dns-type-refused"),
                ),
            ),
            (
                "allowed.test.",
                RecordType::ANY,
                (
                    ResponseCode::Refused,
                    Some("allowed.test"),
                    Some("dns-type-refused"),
                ),
            ),
            (
                "allowed.test.",
                RecordType::MX,
                (
                    ResponseCode::Refused,
                    Some("allowed.test"),
                    Some("dns-type-refused"),
                ),
            ),
            (
                "2130706433.",
                RecordType::A,
                (ResponseCode::NXDomain, None, Some("numeric-ip-form")),
            ),
            (
                ".",
                RecordType::A,
                (ResponseCode::NXDomain, None, Some("invalid-host")),
            ),
        ] {
            let (code, host, reason) = denied(decide(&p, &request(name, rt)));
            assert_eq!((code, host.as_deref(), reason), want, "{name} {rt}");
        }
    }

    #[test]
    fn labels_with_odd_bytes_are_refused_not_resolved() {
        let p = policy("allow_hosts = [\"*.allowed.test\"]");
        // A label with a dot, a space and binary inside: escaped by to_ascii, so never a name.
        let mut m = Message::query();
        let name = Name::from_labels(vec![&b"a.b c\x00"[..], b"allowed", b"test"]).unwrap();
        m.add_query(Query::query(name, RecordType::A));
        let req = parse(&m);
        assert_eq!(
            denied(decide(&p, &req)),
            (ResponseCode::NXDomain, None, Some("invalid-host"))
        );
    }

    #[test]
    fn deny_all_opcodes_counts_and_responses() {
        let none = CompiledPolicy::new(&egress_policy::Policy::deny_all());
        assert_eq!(
            denied(decide(&none, &request("allowed.test.", RecordType::A))).2,
            Some("policy-deny-all")
        );
        let p = policy("allow_hosts = [\"allowed.test\"]");
        let mut m = Message::query();
        m.add_query(Query::query(
            Name::from_ascii("allowed.test.").unwrap(),
            RecordType::A,
        ));
        m.add_query(Query::query(
            Name::from_ascii("other.test.").unwrap(),
            RecordType::A,
        ));
        let two = parse(&m);
        assert_eq!(denied(decide(&p, &two)).0, ResponseCode::FormErr);
        let mut m = Message::query();
        m.metadata.op_code = OpCode::Update;
        m.add_query(Query::query(
            Name::from_ascii("allowed.test.").unwrap(),
            RecordType::A,
        ));
        let upd = parse(&m);
        assert_eq!(denied(decide(&p, &upd)).0, ResponseCode::NotImp);
        let mut m = Message::query();
        m.metadata.message_type = MessageType::Response;
        m.add_query(Query::query(
            Name::from_ascii("allowed.test.").unwrap(),
            RecordType::A,
        ));
        let resp = parse(&m);
        assert_eq!(decide(&p, &resp), Decision::Drop);
    }

    #[test]
    fn auditing_policies_answer_names_they_would_refuse() {
        let p = policy("enforce = \"audit\"\nallow_hosts = [\"allowed.test\"]");
        assert_eq!(
            decide(&p, &request("other.test.", RecordType::A)),
            Decision::Resolve {
                name: HostName::parse("other.test").unwrap(),
                record_type: RecordType::A,
                direct_ports: vec![],
                lan: false,
                decision: PolicyDecision::WouldDeny(Refused::because(DenyReason::HostNotAllowed)),
            }
        );
        // Not a name decision: still refused.
        assert!(matches!(
            decide(&p, &request("other.test.", RecordType::TXT)),
            Decision::Reply { .. }
        ));
    }

    #[test]
    fn host_docker_internal_is_the_agents_only_under_host_services_and_lan_names_say_so() {
        let with = policy(
            "allow_host_services = [{ port = 11434 }]\nallow_hosts = [{ host = \"gpu-box.lan\", ports = [8000], lan = true }]\nresolve_private = [\"192.168.0.0/16\"]",
        );
        for rt in [RecordType::A, RecordType::AAAA] {
            assert_eq!(
                decide(&with, &request("Host.Docker.Internal.", rt)),
                Decision::Host { record_type: rt }
            );
        }
        let Decision::Resolve {
            lan, direct_ports, ..
        } = decide(&with, &request("gpu-box.lan", RecordType::A))
        else {
            panic!("gpu-box.lan is allowed")
        };
        assert!(lan);
        assert_eq!(direct_ports, vec![8000]);
        // Without host services the name is like any other: not allowed, not answered here.
        let without = policy("allow_hosts = [\"allowed.test\"]");
        assert_eq!(
            denied(decide(
                &without,
                &request("host.docker.internal", RecordType::A)
            )),
            (
                ResponseCode::NXDomain,
                Some("host.docker.internal".to_owned()),
                Some("host-not-allowed")
            )
        );
    }
}
