//! The host matcher: arbitrary (pattern, host) pairs. Invariants: never panics; the compiled
//! matcher agrees with the per-pattern definition; a match is always on a label boundary;
//! normalisation is idempotent.
#![no_main]

use egress_policy::matcher::{HostMatcher, HostPattern};
use egress_policy::name::Destination;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let (pat, host) = s.split_once('\n').unwrap_or((s, s));
    let Ok(pattern) = HostPattern::parse(pat) else {
        return;
    };
    let m = HostMatcher::new([&pattern]);
    let Ok(Destination::Name(name)) = Destination::parse(host) else {
        return;
    };
    assert_eq!(
        Destination::parse(name.as_str()),
        Ok(Destination::Name(name.clone()))
    );
    let hit = m.matches(&name);
    assert_eq!(hit, pattern.matches(&name));
    if hit {
        let n = name.as_str();
        match &pattern {
            HostPattern::Exact(p) => assert_eq!(n, p.as_str()),
            HostPattern::Suffix(p) => {
                assert!(n.len() > p.as_str().len() + 1);
                assert!(n.ends_with(&format!(".{}", p.as_str())), "{n} vs *.{p}");
            }
        }
    }
});
