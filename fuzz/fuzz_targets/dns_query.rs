//! The DNS responder's query path, as both transports run it: `dns::wire::read` (hickory's
//! parser, FORMERR or drop for what doesn't parse) → `dns::decide` → (for allowed names)
//! `dns::answer::plan` over a fixed resolver answer → `dns::wire::fits` → `dns::wire::encode`.
//! The first byte picks the transport (UDP with its payload limit, or TCP).
//! Invariants: never panics; only names `allow_hosts` matches are ever handed to a resolver, and
//! only for A/AAAA; a denial names a normalised name or none; every response we build encodes
//! within the transport's budget and re-parses with the request's id; a UDP answer that doesn't
//! fit is truncated (TC) and carries no records.
#![no_main]

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use egress_agent::proxy::dns::answer::{Planned, plan};
use egress_agent::proxy::dns::{Decision, decide};
use egress_policy::matcher::HostPattern;
use egress_policy::name::HostName;
use egress_policy::{CompiledPolicy, HostEntry, Mode, Policy};
use egress_agent::proxy::resolve::{Family, NameRecords};
use egress_agent::proxy::dns::wire::{Read, Reply, Transport, budget, encode, fits, read};
use hickory_server::proto::op::{Message, ResponseCode};
use hickory_server::proto::rr::rdata::{A, CNAME};
use hickory_server::proto::rr::{Name, RData, Record, RecordType};
use libfuzzer_sys::fuzz_target;

static POLICY: LazyLock<CompiledPolicy> = LazyLock::new(|| {
    let mut p = Policy::deny_all();
    p.mode = Mode::Allowlist;
    p.allow_hosts = vec![
        HostPattern::parse("allowed.test").unwrap().into(),
        HostEntry {
            pattern: HostPattern::parse("*.wild.test").unwrap(),
            ports: vec![22],
            preset: None,
            access: Default::default(),
            lan: false,
        },
    ];
    p.allow_host_services = vec![egress_policy::model::HostService {
        port: 11434,
        name: None,
    }];
    CompiledPolicy::new(&p)
});

fn allowed(n: &HostName) -> bool {
    n.as_str() == "allowed.test" || n.as_str().ends_with(".wild.test")
}

fn check(bytes: Option<Vec<u8>>, id: u16, max: usize) -> Message {
    let bytes = bytes.expect("response encodes");
    assert!(bytes.len() <= max, "{} > {max}", bytes.len());
    let back = Message::from_vec(&bytes).expect("response re-parses");
    assert_eq!(back.metadata.id, id);
    back
}

fuzz_target!(|data: &[u8]| {
    let Some((&t, data)) = data.split_first() else {
        return;
    };
    let transport = if t & 1 == 0 {
        Transport::Udp
    } else {
        Transport::Tcp
    };
    let src: SocketAddr = "127.0.0.1:5353".parse().unwrap();
    let req = match read(data, src, transport) {
        Read::Message(r) => r,
        Read::FormErr(out) => {
            let m = Message::from_vec(&out).expect("FORMERR re-parses");
            assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
            assert_eq!(&out[..2], &data[..2], "same id");
            return;
        }
        Read::Drop(_) => return,
    };
    let id = req.metadata.id;
    let max = budget(&req, transport);
    match decide(&POLICY, &req) {
        Decision::Drop => {}
        Decision::Agent { record_type } => {
            // Only the agent's own name, and only a type the responder answers.
            assert!(matches!(record_type, RecordType::A | RecordType::AAAA));
            assert!(req.queries.queries().iter().all(|q| {
                q.name().to_ascii().trim_end_matches('.').eq_ignore_ascii_case("egress.internal")
            }));
        }
        Decision::Host { record_type } => {
            // Only the host's own name (the fuzzed policy has host services).
            assert!(matches!(record_type, RecordType::A | RecordType::AAAA));
            assert!(req.queries.queries().iter().all(|q| {
                q.name().to_ascii().trim_end_matches('.').eq_ignore_ascii_case("host.docker.internal")
            }));
        }
        Decision::Reply { code, denied } => {
            if let Some(d) = &denied
                && let Some(h) = &d.host
            {
                assert_eq!(HostName::parse(h.as_str()).as_ref(), Ok(h), "normalised");
            }
            assert_ne!(code, ResponseCode::NoError);
            // A refusal carries its Extended DNS Error (longest text the responder sends).
            let reply = match &denied {
                Some(_) => Reply::refused(code, &"x".repeat(300)),
                None => Reply::code(code),
            };
            check(encode(&req, transport, &reply), id, max);
        }
        Decision::Resolve {
            name,
            record_type,
            direct_ports,
            lan,
            decision,
        } => {
            assert!(!lan, "the fuzzed policy has no lan entry");
            assert!(
                matches!(decision, egress_policy::Decision::Allow(_)),
                "the fuzzed policy does not audit: {decision:?}"
            );
            assert!(allowed(&name), "{name} would reach a resolver");
            assert!(matches!(record_type, RecordType::A | RecordType::AAAA));
            assert_eq!(direct_ports.is_empty(), name.as_str() == "allowed.test");
            let owner = Name::from_ascii(format!("{name}.")).unwrap();
            let now = Instant::now();
            // A long CNAME chain, so small UDP payloads truncate.
            let mut records = Vec::new();
            let mut from = owner.clone();
            for i in 0..(usize::from(t >> 1) % 24) {
                let to = Name::from_ascii(format!("hop{i}.edge.cdn.test.")).unwrap();
                records.push(Record::from_rdata(from, 60, RData::CNAME(CNAME(to.clone()))));
                from = to;
            }
            records.push(Record::from_rdata(from, 60, RData::A(A::new(140, 82, 112, 3))));
            let names = NameRecords {
                v4: Family::Records {
                    records,
                    valid_until: now + Duration::from_secs(60),
                },
                v6: Family::NoData,
            };
            match plan(&POLICY, &names, record_type, false, now) {
                Planned::Answer { records, .. } => {
                    let reply = if fits(&req, transport, &records) {
                        Reply {
                            records,
                            ..Reply::code(ResponseCode::NoError)
                        }
                    } else {
                        assert_eq!(transport, Transport::Udp, "TCP takes any answer");
                        Reply {
                            truncated: true,
                            ..Reply::code(ResponseCode::NoError)
                        }
                    };
                    let back = check(encode(&req, transport, &reply), id, max);
                    assert_eq!(back.metadata.truncation, reply.truncated);
                    assert_eq!(back.answers.len(), reply.records.len());
                }
                Planned::NoData => assert_eq!(record_type, RecordType::AAAA),
                other => panic!("unexpected plan {other:?}"),
            }
        }
    }
});
