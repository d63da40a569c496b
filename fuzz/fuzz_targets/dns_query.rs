//! The DNS responder's query path: hickory's request parsing → `dns::decide` → (for allowed
//! names) `dns::answer::plan` over a fixed resolver answer → the response encoded as sent.
//! Invariants: never panics; only names `allow_hosts` matches are ever handed to a resolver, and
//! only for A/AAAA; a denial names a normalised name or none; every response we build encodes and
//! re-parses with the request's id.
#![no_main]

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use egress_agent::dns::answer::{Planned, plan};
use egress_agent::dns::{Decision, decide};
use egress_agent::policy::matcher::HostPattern;
use egress_agent::policy::name::HostName;
use egress_agent::policy::{CompiledPolicy, HostEntry, Mode, Policy};
use egress_agent::proxy::resolve::{Family, NameRecords};
use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{Message, Metadata, ResponseCode};
use hickory_server::proto::rr::rdata::{A, CNAME};
use hickory_server::proto::rr::{Name, RData, Record, RecordType};
use hickory_server::proto::serialize::binary::BinEncoder;
use hickory_server::server::Request;
use hickory_server::zone_handler::MessageResponseBuilder;
use libfuzzer_sys::fuzz_target;

static POLICY: LazyLock<CompiledPolicy> = LazyLock::new(|| {
    let mut p = Policy::deny_all();
    p.mode = Mode::Allowlist;
    p.allow_hosts = vec![
        HostPattern::parse("allowed.test").unwrap().into(),
        HostEntry {
            pattern: HostPattern::parse("*.wild.test").unwrap(),
            ports: vec![22],
        },
    ];
    CompiledPolicy::new(&p)
});

fn allowed(n: &HostName) -> bool {
    n.as_str() == "allowed.test" || n.as_str().ends_with(".wild.test")
}

fn emit<'a>(
    msg: hickory_server::zone_handler::MessageResponse<
        '_,
        'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
    >,
    id: u16,
) {
    let mut bytes = Vec::new();
    let mut enc = BinEncoder::new(&mut bytes);
    msg.destructive_emit(&mut enc).expect("response encodes");
    let back = Message::from_vec(&bytes).expect("response re-parses");
    assert_eq!(back.metadata.id, id);
}

fuzz_target!(|data: &[u8]| {
    let src: SocketAddr = "127.0.0.1:5353".parse().unwrap();
    let Ok(req) = Request::from_bytes(data.to_vec(), src, Protocol::Udp) else {
        return;
    };
    let id = req.metadata.id;
    let mut meta = Metadata::response_from_request(&req.metadata);
    match decide(&POLICY, &req) {
        Decision::Drop => {}
        Decision::Reply { code, denied } => {
            if let Some(d) = &denied
                && let Some(h) = &d.host
            {
                assert_eq!(HostName::parse(h.as_str()).as_ref(), Ok(h), "normalised");
            }
            assert_ne!(code, ResponseCode::NoError);
            meta.response_code = code;
            emit(
                MessageResponseBuilder::new(&req.queries, None).build_no_records(meta),
                id,
            );
        }
        Decision::Resolve {
            name,
            record_type,
            direct_ports,
            would_deny,
        } => {
            assert!(would_deny.is_none(), "the fuzzed policy does not audit");
            assert!(allowed(&name), "{name} would reach a resolver");
            assert!(matches!(record_type, RecordType::A | RecordType::AAAA));
            assert_eq!(direct_ports.is_empty(), name.as_str() == "allowed.test");
            let owner = Name::from_ascii(format!("{name}.")).unwrap();
            let now = Instant::now();
            let names = NameRecords {
                v4: Family::Records {
                    records: vec![
                        Record::from_rdata(
                            owner.clone(),
                            60,
                            RData::CNAME(CNAME(Name::from_ascii("edge.cdn.test.").unwrap())),
                        ),
                        Record::from_rdata(
                            Name::from_ascii("edge.cdn.test.").unwrap(),
                            60,
                            RData::A(A::new(140, 82, 112, 3)),
                        ),
                    ],
                    valid_until: now + Duration::from_secs(60),
                },
                v6: Family::NoData,
            };
            match plan(&POLICY, &names, record_type, now) {
                Planned::Answer { records, .. } => {
                    let none: [&Record; 0] = [];
                    emit(
                        MessageResponseBuilder::new(&req.queries, None).build(
                            meta,
                            records.iter(),
                            none,
                            none,
                            none,
                        ),
                        id,
                    );
                }
                Planned::NoData => assert_eq!(record_type, RecordType::AAAA),
                other => panic!("unexpected plan {other:?}"),
            }
        }
    }
});
