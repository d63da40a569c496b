//! A policy body from the control API (PUT /v1/policies/NAME, TOML or JSON) and an `explain`
//! target, both attacker-shaped text. Input: the first byte picks TOML (even) or JSON (odd), the
//! rest is the body; its first line, without a leading `#` (a TOML comment), is also an explain
//! target (seeds: `0# github.com:22` then TOML, `1{...}` JSON). Invariants: never panics; a body that loads
//! gives a policy whose canonical TOML (what import writes) loads again to the same policy; an
//! error is always located (a field is named); explain on any parsed target never panics.
#![no_main]

use std::path::Path;

use egress_agent::config::{Config, ConfigError};
use egress_agent::manage::{Body, dir::PolicyFile, policy_text};
use egress_policy::explain::{Chosen, Target, explain};
use egress_policy::kernel_eval::Netns;
use libfuzzer_sys::fuzz_target;

fn load(text: String) -> Result<Config, ConfigError> {
    Config::load_parts(
        Path::new("/etc/egress-agent/config.toml"),
        "",
        vec![PolicyFile {
            name: "p".to_owned(),
            path: "/etc/egress-agent/policies.d/p.toml".into(),
            text,
        }],
    )
}

fuzz_target!(|data: &[u8]| {
    let Some((kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(s) = std::str::from_utf8(rest) else {
        return;
    };
    // Never credentials: a fuzzer must not read arbitrary files as secrets.
    if s.contains("credentials") {
        return;
    }
    let body = if kind & 1 == 0 {
        Body::Toml(s.to_owned())
    } else {
        Body::Json(s.to_owned())
    };
    let Ok(text) = policy_text("p", &body) else {
        return;
    };
    match load(text) {
        Ok(c) => {
            let p = c.policy("p").expect("loaded policy");
            let again = load(egress_agent::manage::bundle::canonical(p)).expect("canonical loads");
            assert_eq!(again.policy("p"), Some(p));
            let first = s.lines().next().unwrap_or("");
            if let Ok(t) = Target::parse(first.trim_start().trim_start_matches('#')) {
                let chosen = Chosen {
                    name: "p".into(),
                    why: "fuzz".into(),
                };
                let _ = explain(c.proxy.explain_endpoint(), &chosen, p, &t, Netns::Own);
                let _ = explain(c.proxy.explain_endpoint(), &chosen, p, &t, Netns::Host);
            }
        }
        Err(ConfigError::Invalid { field, .. }) => assert!(!field.is_empty()),
        Err(_) => {}
    }
});
