//! A workload's access request (`POST http://egress.internal/v1/requests`): the body is
//! untrusted (the workload may be the prompt-injected party) and is parsed, checked and kept for
//! an operator to read. Also the operator's decision bodies. Invariants: never panics; a request
//! taken holds a normalised host name, a port, a bounded reason without control characters
//! (newlines aside) and only known methods; it is pending; decision bodies parse or are refused.
#![no_main]

use std::sync::Arc;
use std::time::SystemTime;

use egress_agent::asks::{Asks, Decision, GrantTarget, MAX_REASON, Outcome, Requester, Wanted};
use egress_policy::name::HostName;
use libfuzzer_sys::fuzz_target;

struct Nowhere;

impl GrantTarget for Nowhere {
    fn grant(&self, _: u64, _: &HostName, _: u16, _: Option<std::time::Duration>) {}
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = Decision::parse(true, &text);
    let _ = Decision::parse(false, &text);
    let Ok(wanted) = serde_json::from_slice::<Wanted>(data) else {
        return;
    };
    let asks = Asks::new();
    let target: Arc<dyn GrantTarget> = Arc::new(Nowhere);
    let who = Requester {
        listener: 1,
        policy: "p".into(),
        workload: "w".into(),
        run: None,
        target: Arc::downgrade(&target),
        durable: None,
    };
    let Ok(filed) = asks.file(who, wanted, SystemTime::now()) else {
        return;
    };
    let v = asks.get(filed.id).expect("a filed request is kept");
    assert_eq!(HostName::parse(&v.host).map(|h| h.as_str().to_owned()).ok(), Some(v.host.clone()));
    assert!(v.port != 0);
    assert!(!v.reason.is_empty() && v.reason.len() <= MAX_REASON);
    assert!(!v.reason.chars().any(|c| c.is_control() && c != '\n'), "{:?}", v.reason);
    assert!(v.methods.iter().all(|m| m.chars().all(|c| c.is_ascii_uppercase())));
    assert_eq!(v.outcome, Outcome::Pending);
});
