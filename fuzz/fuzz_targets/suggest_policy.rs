//! `suggest` on attacker-chosen traffic: under audit a confined process can make the proxy see any
//! name and port. Input: lines `NAME PORT` (through the proxy) or `IP PORT` (direct). Invariants:
//! never panics; the printed policy parses with the real config parser; it allows every observed
//! name on its port and every address on its port; no line of it comes from a name unquoted (the
//! names are quoted TOML strings, so a name can't add a key or a table).
#![no_main]

use std::path::Path;
use std::time::UNIX_EPOCH;

use egress_agent::config::Config;
use egress_agent::events::Verdict;
use egress_policy::CompiledPolicy;
use egress_policy::name::Destination;
use egress_agent::store::selection::Selection;
use egress_agent::suggest::command::{SuggestOptions, suggest_from};
use egress_agent::store::query::Flow;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let mut flows = Vec::new();
    for line in s.lines().take(64) {
        let Some((dest, port)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(port) = port.parse::<u16>() else {
            continue;
        };
        if port == 0 {
            continue;
        }
        let (source, host, ip) = match Destination::parse(dest) {
            Ok(Destination::Name(n)) => ("proxy", n.as_str().to_owned(), String::new()),
            Ok(Destination::Ip(ip)) => ("kernel", String::new(), ip.to_string()),
            Err(_) => continue,
        };
        flows.push(Flow {
            verdict: Verdict::WouldDeny,
            source: source.into(),
            policy: "audit".into(),
            container_id: String::new(),
            container_name: String::new(),
            labels: Default::default(),
            host,
            ip,
            port,
            protocol: "connect".into(),
            reason: "host-not-allowed".into(),
            rule: None,
            count: 1,
            first_seen: UNIX_EPOCH,
            last_seen: UNIX_EPOCH,
        });
    }
    let opts = SuggestOptions {
        selection: Selection::default(),
        include_denied: false,
        diff: false,
        name: Some("p".into()),
        config: None,
    };
    let text = suggest_from(&flows, &Config::default(), &opts).expect("suggest");
    let parsed = Config::from_toml_str(&text, Path::new("suggested.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(parsed.policies.len(), 1, "{text}");
    let policy = parsed.policy("p").expect("the policy");
    let compiled = CompiledPolicy::new(policy);
    for f in &flows {
        if f.host.is_empty() {
            let ip: std::net::IpAddr = f.ip.parse().expect("ip");
            let ip = egress_policy::addr::unmap(ip);
            assert!(
                policy
                    .allow_cidrs
                    .iter()
                    .any(|r| r.net.contains(&ip) && r.allows_port(f.port)),
                "{f:?}\n{text}"
            );
        } else {
            let d = Destination::parse(&f.host).expect("name");
            assert_eq!(compiled.check_target(&d, f.port), Ok(()), "{f:?}\n{text}");
        }
    }
});
