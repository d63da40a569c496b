//! The UDP loop's memo of finished answers: the hot path of a responder answers a query it has
//! answered before from the response's wire bytes, with the query's id written in, instead of
//! parsing, deciding, planning and encoding again.
//!
//! The key is the query's bytes after its id (flags, counts, the question as the client spelled
//! it, its EDNS record): the same bytes always get the same answer from [`super::handler::Core`]
//! while nothing it depends on changes, which is what an entry records:
//! - the policy it was decided under (any reload or grant swaps the listener's policy: the memo
//!   is emptied on the next batch — [`Memo::follow`]);
//! - for an allowed name, until when the resolver's cache keeps the records it was planned from
//!   (`until`), and the TTL in whole seconds it answered ([`Clock`]): when either has run out,
//!   the query takes the full path again and its new answer replaces the entry.
//!
//! What each reuse still does, as the full path does ([`super::handler::Core::reuse`]): the
//! policy's act on the name (an audited name's would-deny event), the denial event of a denied
//! name (built once per entry, then copied or, while the sink collapses it, only counted), the
//! [`super::AnswerSink`] report (direct ports follow every answer), the counters.
//! Only answers that need no network are kept: cached allowed names (not truncated) and names
//! refused by the policy. Entries are per responder (one loop, no lock), at most
//! [`MAX_ENTRIES`]; a full memo is emptied (a flood of distinct names costs the flood, not the
//! names others ask for twice a second).
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use foldhash::HashMap;

use super::answer::Clock;
use super::decide::Denied;
use crate::proxy::act::KeptDenial;
use egress_policy::name::HostName;
use egress_policy::{CompiledPolicy, Decision as PolicyDecision};

/// Most answers kept per responder.
pub const MAX_ENTRIES: usize = 256;
/// Bytes of a DNS header's id.
const ID: usize = 2;

/// An answer the full path produced and the memo may keep, with the policy it was decided under.
pub(crate) struct Kept {
    pub(crate) policy: Arc<CompiledPolicy>,
    pub(crate) kind: Kind,
}

/// What an answer was.
pub(crate) enum Kind {
    /// A name the policy refuses: NXDOMAIN (or REFUSED) and a denial event per query — built
    /// once, at the first reuse, into the cell (the entry lives under one policy and one
    /// listener, so the event is the same every time but for its time; see
    /// `Shared::deny_again`).
    Denied(Denied, KeptDenial),
    /// An allowed name's records.
    Answer(Answered),
}

/// An allowed name's answer, as reported to the answer sink.
pub(crate) struct Answered {
    pub(crate) name: HostName,
    pub(crate) decision: PolicyDecision,
    pub(crate) direct_ports: Vec<u16>,
    pub(crate) addrs: Vec<IpAddr>,
    pub(crate) direct_addrs: Vec<IpAddr>,
    pub(crate) clock: Clock,
    /// The TTL the bytes carry (whole seconds).
    pub(crate) secs: u32,
    /// When the resolver's cache stops reusing the records.
    pub(crate) until: Instant,
}

/// One kept answer.
pub(crate) struct Entry {
    /// The response as first sent.
    bytes: Box<[u8]>,
    pub(crate) kind: Kind,
}

impl Entry {
    /// The response to a query with `id` (its first two bytes).
    pub(crate) fn write(&self, id: [u8; ID], out: &mut Vec<u8>) {
        out.extend_from_slice(&id);
        out.extend_from_slice(self.bytes.get(ID..).unwrap_or_default());
    }
}

/// The memo of one responder's UDP loop.
#[derive(Default)]
pub(crate) struct Memo {
    policy: Option<Arc<CompiledPolicy>>,
    entries: HashMap<Box<[u8]>, Entry>,
}

/// A query's key: its bytes after the id (none: too short to be kept).
fn key(query: &[u8]) -> Option<&[u8]> {
    query.get(ID..)
}

/// A query's id.
pub(crate) fn id(query: &[u8]) -> Option<[u8; ID]> {
    query.get(..ID)?.try_into().ok()
}

impl Memo {
    /// Start a batch under `policy`: a policy other than the entries' empties the memo.
    pub(crate) fn follow(&mut self, policy: &Arc<CompiledPolicy>) {
        if !self.policy.as_ref().is_some_and(|p| Arc::ptr_eq(p, policy)) {
            self.entries.clear();
            self.policy = Some(policy.clone());
        }
    }

    pub(crate) fn get(&self, query: &[u8]) -> Option<&Entry> {
        self.entries.get(key(query)?)
    }

    /// Forget the answer to `query` (it ran out).
    pub(crate) fn forget(&mut self, query: &[u8]) {
        if let Some(k) = key(query) {
            self.entries.remove(k);
        }
    }

    /// Keep `response` to `query`, if it was decided under the memo's policy.
    pub(crate) fn keep(&mut self, query: &[u8], response: &[u8], kept: Kept) {
        let (Some(k), Some(policy)) = (key(query), &self.policy) else {
            return;
        };
        if !Arc::ptr_eq(policy, &kept.policy) || response.len() < ID {
            return;
        }
        if self.entries.len() >= MAX_ENTRIES && !self.entries.contains_key(k) {
            self.entries.clear();
        }
        self.entries.insert(
            k.into(),
            Entry {
                bytes: response.into(),
                kind: kept.kind,
            },
        );
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;
    use egress_policy::{DenyReason, Refused};
    use std::path::Path;

    fn policy(body: &str) -> Arc<CompiledPolicy> {
        let c =
            Config::from_toml_str(&format!("[policies.p]\n{body}"), Path::new("t.toml")).unwrap();
        Arc::new(CompiledPolicy::new(c.policy("p").unwrap()))
    }

    fn denied() -> Kind {
        Kind::Denied(
            Denied {
                host: HostName::parse("evil.test").ok(),
                refused: Refused::because(DenyReason::HostNotAllowed),
            },
            KeptDenial::default(),
        )
    }

    /// The same query bytes under another id get the kept response with their own id; other
    /// bytes (another name, other flags) miss; a new policy empties the memo; a response
    /// decided under an older policy is not kept.
    #[test]
    fn kept_by_the_bytes_after_the_id_and_only_under_one_policy() {
        let (a, b) = (
            policy("allow_hosts = [\"a.test\"]"),
            policy("allow_hosts = [\"b.test\"]"),
        );
        let mut m = Memo::default();
        m.follow(&a);
        let query = [0x12, 0x34, 1, 0, 0, 1, 9, 9];
        m.keep(
            &query,
            &[0x12, 0x34, 0x81, 0x83],
            Kept {
                policy: a.clone(),
                kind: denied(),
            },
        );
        let mut out = Vec::new();
        m.get(&[0xab, 0xcd, 1, 0, 0, 1, 9, 9])
            .unwrap()
            .write([0xab, 0xcd], &mut out);
        assert_eq!(out, [0xab, 0xcd, 0x81, 0x83]);
        assert!(m.get(&[0xab, 0xcd, 1, 0, 0, 1, 9, 8]).is_none());
        assert!(m.get(&[0x12]).is_none());
        m.follow(&a);
        assert_eq!(m.len(), 1);
        m.follow(&b);
        assert_eq!(m.len(), 0);
        m.keep(
            &query,
            &[0x12, 0x34, 0x81, 0x83],
            Kept {
                policy: a,
                kind: denied(),
            },
        );
        assert_eq!(m.len(), 0, "decided under the old policy");
        m.keep(
            &query,
            &[0x12, 0x34, 0x81, 0x83],
            Kept {
                policy: b.clone(),
                kind: denied(),
            },
        );
        assert_eq!(m.len(), 1);
        m.forget(&query);
        assert_eq!(m.len(), 0);
    }

    /// A flood of distinct queries never holds more than [`MAX_ENTRIES`].
    #[test]
    fn bounded() {
        let p = policy("allow_hosts = [\"a.test\"]");
        let mut m = Memo::default();
        m.follow(&p);
        for i in 0..(MAX_ENTRIES * 3) as u32 {
            let mut q = vec![0, 0];
            q.extend_from_slice(&i.to_be_bytes());
            m.keep(
                &q,
                &[0, 0, 1],
                Kept {
                    policy: p.clone(),
                    kind: denied(),
                },
            );
            assert!(m.len() <= MAX_ENTRIES);
        }
    }
}
