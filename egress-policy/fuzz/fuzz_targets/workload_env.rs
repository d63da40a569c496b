//! Real keys in a workload's environment (`egress_policy::exposure::findings`): an environment
//! the workload chose (`NAME=value` lines) against one bound secret and one placeholder, both
//! chosen too. Invariants: never panics; the findings are exactly those of a naive reference
//! (the value is the secret, or contains it when it is at least `MIN_CONTAINED` bytes long; else
//! a provider's variable), in order; an empty value, the placeholder or an oversized value is
//! never a finding; what a finding prints is the variable's name and why, nothing of a value.
#![no_main]

use egress_policy::exposure::{
    BoundSecret, Finding, Known, MAX_VALUE, MIN_CONTAINED, Why, findings, is_provider_variable,
};
use egress_policy::secret::Secret;
use libfuzzer_sys::fuzz_target;

const BINDING: &str = "policies.p.credentials[0]";

fn naive_holds(value: &[u8], secret: &[u8]) -> bool {
    !secret.is_empty()
        && (value == secret
            || (secret.len() >= MIN_CONTAINED && value.windows(secret.len()).any(|w| w == secret)))
}

fuzz_target!(|data: &[u8]| {
    let mut lines = data.split(|b| *b == b'\n');
    let secret = lines.next().unwrap_or_default().to_vec();
    let Ok(placeholder) = std::str::from_utf8(lines.next().unwrap_or_default()) else {
        return;
    };
    let env: Vec<(String, Vec<u8>)> = lines
        .filter_map(|l| {
            let i = l.iter().position(|b| *b == b'=').unwrap_or(l.len());
            let name = std::str::from_utf8(&l[..i]).ok()?.to_owned();
            Some((name, l.get(i + 1..).unwrap_or_default().to_vec()))
        })
        .collect();
    let s = Secret::new(secret.clone());
    let known = Known {
        secrets: vec![BoundSecret {
            binding: BINDING.to_owned(),
            secret: &s,
        }],
        placeholders: vec![placeholder],
    };
    let got = findings(env.iter().map(|(k, v)| (k.as_str(), v.as_slice())), &known);
    let want: Vec<Finding> = env
        .iter()
        .filter(|(_, v)| {
            !v.is_empty() && v.len() <= MAX_VALUE && v.as_slice() != placeholder.as_bytes()
        })
        .filter_map(|(name, v)| {
            let why = if naive_holds(v, &secret) {
                Why::BoundSecret(BINDING.to_owned())
            } else if is_provider_variable(name) {
                Why::ProviderVariable
            } else {
                return None;
            };
            Some(Finding {
                variable: name.clone(),
                why,
            })
        })
        .collect();
    assert_eq!(got, want);
    // What a finding prints is the variable's name and why: nothing of any value.
    for f in &got {
        let why = match &f.why {
            Why::BoundSecret(_) => format!("bound-secret {BINDING}"),
            Why::ProviderVariable => "provider-variable".to_owned(),
        };
        assert_eq!(f.to_string(), format!("{} ({why})", f.variable));
    }
});
