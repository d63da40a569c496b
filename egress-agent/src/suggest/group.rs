//! Which observed names become a `*.` wildcard.
//!
//! The rule, per registrable domain (the Public Suffix List's "domain": `github.com`,
//! `example.co.uk`, `mybucket.s3.amazonaws.com` — ICANN and private sections, via the `psl`
//! crate):
//! 1. Take the observed names strictly below the registrable domain `D`.
//! 2. If there are at least [`WILDCARD_MIN_NAMES`] distinct ones, replace them with one wildcard
//!    `*.S`, where `S` is the longest label suffix they all share (`D` or deeper: three names
//!    under `x.github.com` give `*.x.github.com`, not `*.github.com`).
//! 3. Otherwise, and always for `D` itself, list the names exactly.
//!
//! So a wildcard never sits on a public suffix (`*.com`, `*.co.uk`, `*.github.io`), never spans
//! two registrable domains, and needs a spread of names to justify it; names the PSL does not
//! know a suffix for (`.test`, `.internal`, single labels) are never grouped.
use std::collections::{BTreeMap, BTreeSet};

/// Distinct names under one registrable domain that justify a wildcard.
pub const WILDCARD_MIN_NAMES: usize = 3;

/// One `allow_hosts` entry and the observed names it covers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct HostEntry {
    /// `name` or `*.suffix`.
    pub pattern: String,
    pub covers: BTreeSet<String>,
}

/// The registrable domain of `name`, if the PSL knows its suffix and the name is below it.
pub fn registrable(name: &str) -> Option<&str> {
    // The PSL's default rule (`*`) would make any unknown TLD a suffix: not good enough here.
    if !psl::suffix(name.as_bytes())?.is_known() {
        return None;
    }
    let d = psl::domain_str(name)?;
    // A name that is itself a public suffix has no registrable domain.
    (d.len() <= name.len()).then_some(d)
}

fn common_suffix<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut common: Option<Vec<&str>> = None;
    for n in names {
        let labels: Vec<&str> = n.rsplit('.').collect();
        common = Some(match common {
            None => labels,
            Some(c) => c
                .iter()
                .zip(labels.iter())
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| *a)
                .collect(),
        });
    }
    let mut c = common.unwrap_or_default();
    c.reverse();
    c
}

/// Group normalised names into `allow_hosts` entries, sorted by registrable domain then pattern.
pub fn group(names: &BTreeSet<String>) -> Vec<HostEntry> {
    // registrable domain (or the name itself when unknown) → names
    let mut by_domain: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for n in names {
        let key = registrable(n).unwrap_or(n).to_owned();
        by_domain.entry(key).or_default().insert(n);
    }
    let mut out = Vec::new();
    for (domain, members) in by_domain {
        let below: BTreeSet<&str> = members
            .iter()
            .copied()
            .filter(|n| n.len() > domain.len() && registrable(n) == Some(domain.as_str()))
            .collect();
        let exact: Vec<&str> = members
            .iter()
            .copied()
            .filter(|n| !below.contains(n))
            .collect();
        let mut entries: Vec<HostEntry> = exact
            .iter()
            .map(|n| HostEntry {
                pattern: (*n).to_owned(),
                covers: [(*n).to_owned()].into(),
            })
            .collect();
        if below.len() >= WILDCARD_MIN_NAMES {
            let mut suffix = common_suffix(below.iter().copied());
            // Strictly below every member: a common suffix equal to one of them moves up a label.
            while below.contains(suffix.join(".").as_str()) {
                suffix.remove(0);
            }
            let s = suffix.join(".");
            // Never above the registrable domain.
            let s = if s.len() < domain.len() {
                domain.clone()
            } else {
                s
            };
            entries.push(HostEntry {
                pattern: format!("*.{s}"),
                covers: below.iter().map(|n| (*n).to_owned()).collect(),
            });
        } else {
            entries.extend(below.iter().map(|n| HostEntry {
                pattern: (*n).to_owned(),
                covers: [(*n).to_owned()].into(),
            }));
        }
        entries.sort();
        out.extend(entries);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(names: &[&str]) -> Vec<String> {
        group(&names.iter().map(|s| (*s).to_owned()).collect())
            .into_iter()
            .map(|e| e.pattern)
            .collect()
    }

    #[test]
    fn psl_decides_the_registrable_domain() {
        assert_eq!(registrable("api.github.com"), Some("github.com"));
        assert_eq!(registrable("a.b.example.co.uk"), Some("example.co.uk"));
        assert_eq!(registrable("x.alice.github.io"), Some("alice.github.io"));
        assert_eq!(registrable("com"), None);
        assert_eq!(registrable("github.io"), None);
    }

    #[test]
    fn wildcards_need_spread_and_stay_below_the_registrable_domain() {
        // Two names: listed exactly.
        assert_eq!(
            g(&["api.github.com", "uploads.github.com"]),
            ["api.github.com", "uploads.github.com"]
        );
        // Three: one wildcard; the domain itself stays exact.
        assert_eq!(
            g(&[
                "github.com",
                "api.github.com",
                "uploads.github.com",
                "codeload.github.com"
            ]),
            ["*.github.com", "github.com"]
        );
        // The narrowest shared suffix.
        assert_eq!(
            g(&[
                "a.cdn.example.com",
                "b.cdn.example.com",
                "c.cdn.example.com"
            ]),
            ["*.cdn.example.com"]
        );
        // A member equal to the common suffix would not be covered by `*.`: move up.
        assert_eq!(
            g(&["cdn.example.com", "a.cdn.example.com", "b.cdn.example.com"]),
            ["*.example.com"]
        );
        // Different registrable domains never merge, even under one public suffix.
        assert_eq!(
            g(&["a.alice.github.io", "bob.github.io", "carol.github.io"]),
            ["a.alice.github.io", "bob.github.io", "carol.github.io"]
        );
        assert_eq!(
            g(&[
                "x.example.co.uk",
                "y.example.co.uk",
                "z.example.co.uk",
                "other.co.uk"
            ]),
            ["*.example.co.uk", "other.co.uk"]
        );
    }

    #[test]
    fn unknown_suffixes_are_never_grouped() {
        assert_eq!(
            g(&["a.svc.internal", "b.svc.internal", "c.svc.internal"]),
            ["a.svc.internal", "b.svc.internal", "c.svc.internal"]
        );
    }
}
