//! The DNS responder's hot path: [`super::resolve::DnsResolver::lookup_records`] answers kept per
//! name until the earliest record in them expires, so a cached answer costs one map lookup instead
//! of two trips through hickory's lookup machinery (measured ~45 µs of CPU per answer on this
//! machine kind; see `dns-bench`). Never longer than the resolver itself would keep them:
//! positive families until their `valid_until`, negative ones (NODATA/NXDOMAIN) for at most
//! [`NEGATIVE_SECS`], a failed family (SERVFAIL, REFUSED, timeout) for [`FAILURE_SECS`] — RFC 9520's
//! floor for caching resolution failures, so a nameserver that refuses one family isn't asked
//! again for every query of the other.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::resolve::{Family, NameRecords};
use egress_policy::name::HostName;

/// Longest a negative family is kept here (hickory keeps its own negative answers, too).
pub const NEGATIVE_SECS: u64 = 5;
/// How long a failed family is kept (RFC 9520 §3.2: at least 1 s).
pub const FAILURE_SECS: u64 = 1;
/// Most names kept; when full, expired entries go, and if none had expired, all of them.
pub const MAX_NAMES: usize = 4096;

#[derive(Default)]
pub struct RecordsCache {
    map: Mutex<HashMap<HostName, (Instant, Arc<NameRecords>)>>,
}

impl std::fmt::Debug for RecordsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordsCache").finish_non_exhaustive()
    }
}

/// Until when `records` may be reused.
fn expiry(records: &NameRecords, now: Instant) -> Instant {
    let one = |f: &Family| match f {
        Family::Records { valid_until, .. } => *valid_until,
        Family::NoData | Family::NxDomain => now + Duration::from_secs(NEGATIVE_SECS),
        Family::Failed(_) => now + Duration::from_secs(FAILURE_SECS),
    };
    one(&records.v4).min(one(&records.v6))
}

impl RecordsCache {
    pub fn get(&self, name: &HostName, now: Instant) -> Option<Arc<NameRecords>> {
        self.get_until(name, now).map(|(_, r)| r)
    }

    /// [`RecordsCache::get`] with the instant the entry stops being reused: what is built from
    /// it (the responder's memo of answers) lives no longer.
    pub fn get_until(&self, name: &HostName, now: Instant) -> Option<(Instant, Arc<NameRecords>)> {
        let map = self.map.lock().ok()?;
        match map.get(name) {
            Some((until, r)) if *until > now => Some((*until, r.clone())),
            _ => None,
        }
    }

    pub fn put(&self, name: &HostName, records: Arc<NameRecords>, now: Instant) {
        let until = expiry(&records, now);
        if until <= now {
            return;
        }
        let Ok(mut map) = self.map.lock() else {
            return;
        };
        if map.len() >= MAX_NAMES && !map.contains_key(name) {
            map.retain(|_, (u, _)| *u > now);
            if map.len() >= MAX_NAMES {
                map.clear();
            }
        }
        map.insert(name.clone(), (until, records));
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn kept_until_the_earliest_family_expires_failures_one_second() {
        let c = RecordsCache::default();
        let n = HostName::parse("a.test").unwrap();
        let now = Instant::now();
        let positive = |secs| Family::Records {
            records: Vec::new(),
            valid_until: now + Duration::from_secs(secs),
        };
        c.put(
            &n,
            Arc::new(NameRecords {
                v4: positive(60),
                v6: Family::NoData,
            }),
            now,
        );
        assert!(c.get(&n, now + Duration::from_secs(4)).is_some());
        assert!(
            c.get(&n, now + Duration::from_secs(NEGATIVE_SECS))
                .is_none()
        );
        c.put(
            &n,
            Arc::new(NameRecords {
                v4: positive(2),
                v6: positive(60),
            }),
            now,
        );
        assert!(c.get(&n, now + Duration::from_secs(1)).is_some());
        assert_eq!(
            c.get_until(&n, now).map(|(until, _)| until),
            Some(now + Duration::from_secs(2))
        );
        assert!(c.get(&n, now + Duration::from_secs(2)).is_none());
        let m = HostName::parse("b.test").unwrap();
        c.put(
            &m,
            Arc::new(NameRecords {
                v4: positive(60),
                v6: Family::Failed("timeout".into()),
            }),
            now,
        );
        assert!(c.get(&m, now).is_some());
        assert!(c.get(&m, now + Duration::from_secs(FAILURE_SECS)).is_none());
    }
}
