//! The request-parsing path: httparse head → target extraction → Host consistency → policy check.
//! Invariants: never panics; a parsed head's length is within the input; a Complete request's target
//! re-parses to itself; a target the policy allows is never an IP form it should refuse.
#![no_main]

use egress_policy::CompiledPolicy;
use egress_policy::Policy;
use egress_policy::name::Destination;
use egress_agent::proxy::request::{self, Head, Request};
use libfuzzer_sys::fuzz_target;
use std::sync::LazyLock;

static POLICY: LazyLock<CompiledPolicy> = LazyLock::new(|| {
    let mut p = Policy::deny_all();
    p.mode = egress_policy::Mode::Allowlist;
    p.allow_hosts = vec![
        egress_policy::matcher::HostPattern::parse("github.com")
            .unwrap()
            .into(),
        egress_policy::matcher::HostPattern::parse("*.github.com")
            .unwrap()
            .into(),
    ];
    p.allow_ports = vec![443, 80];
    CompiledPolicy::new(&p)
});

fuzz_target!(|data: &[u8]| {
    let Ok(Head::Complete { len, request }) = request::parse_head(data) else {
        return;
    };
    assert!(len <= data.len());
    let target = match &request {
        Request::Connect(t) => t,
        Request::Http { target, .. } => target,
    };
    // Normalisation is idempotent.
    let again = Destination::parse(&target.dest.to_string()).expect("normalised target re-parses");
    assert_eq!(again, target.dest);
    if POLICY.check_target(&target.dest, target.port).is_ok() {
        match &target.dest {
            Destination::Name(n) => {
                let s = n.as_str();
                assert!(
                    s == "github.com" || s.ends_with(".github.com"),
                    "allowed {s}"
                );
            }
            Destination::Ip(ip) => panic!("allowlist without cidrs allowed IP literal {ip}"),
        }
    }
});
