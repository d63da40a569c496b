//! `allow_hosts` patterns and their matcher.
//!
//! A pattern is either an exact name (`github.com`) or a wildcard `*.suffix` (`*.github.com`).
//! **`*.github.com` matches every name strictly below `github.com`, at any depth
//! (`api.github.com`, `a.b.github.com`), and never `github.com` itself** — list both to allow both.
//! Matching is on label boundaries only: `evilgithub.com` never matches `*.github.com`, and
//! `github.com.evil.com` never matches `github.com`. Patterns are normalised exactly like request
//! targets (see [`super::name`]); IP addresses are not host patterns (use `allow_cidrs`).
use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::name::{Destination, HostName, NameError};

/// One `allow_hosts` entry.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// Exactly this name.
    Exact(HostName),
    /// Any name strictly below this one (`*.suffix`).
    Suffix(HostName),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("invalid host pattern {0:?}: {1}")]
    Name(String, NameError),
    #[error("invalid host pattern {0:?}: IP addresses go in allow_cidrs, not allow_hosts")]
    IpAddress(String),
    #[error(
        "invalid host pattern {0:?}: only a leading `*.` wildcard is supported (use mode = \"allow_all\" for everything)"
    )]
    Wildcard(String),
}

impl HostPattern {
    pub fn parse(s: &str) -> Result<HostPattern, PatternError> {
        let (wild, rest) = match s.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        if rest.contains('*') {
            return Err(PatternError::Wildcard(s.to_owned()));
        }
        let name = match Destination::parse(rest) {
            Ok(Destination::Name(n)) => n,
            Ok(Destination::Ip(_)) | Err(NameError::NumericIpForm) => {
                return Err(PatternError::IpAddress(s.to_owned()));
            }
            Err(e) => return Err(PatternError::Name(s.to_owned(), e)),
        };
        Ok(if wild {
            HostPattern::Suffix(name)
        } else {
            HostPattern::Exact(name)
        })
    }

    pub fn matches(&self, name: &HostName) -> bool {
        match self {
            HostPattern::Exact(p) => p == name,
            HostPattern::Suffix(p) => name.is_strict_subdomain_of(p),
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(n) => write!(f, "{n}"),
            HostPattern::Suffix(n) => write!(f, "*.{n}"),
        }
    }
}

impl fmt::Debug for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostPattern({self})")
    }
}

impl Serialize for HostPattern {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HostPattern::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A set of patterns compiled for O(labels) lookups, each with the ports its `allow_hosts` entry
/// carries (`{ host = "github.com", ports = [22] }`; none for a plain string entry) and its index
/// in the list it was built from (so a decision can name the entry that matched).
#[derive(Debug, Default, Clone)]
pub struct HostMatcher {
    exact: HashMap<Box<str>, Vec<Entry>>,
    suffixes: HashMap<Box<str>, Vec<Entry>>,
}

/// One entry of the list the matcher was built from.
#[derive(Debug, Clone)]
struct Entry {
    index: usize,
    /// Sorted, deduplicated.
    ports: Box<[u16]>,
}

impl HostMatcher {
    /// Patterns without ports of their own.
    pub fn new<'a>(patterns: impl IntoIterator<Item = &'a HostPattern>) -> HostMatcher {
        HostMatcher::with_ports(patterns.into_iter().map(|p| (p, &[][..])))
    }

    /// Patterns with the ports of their entries; an entry's index is its position in `entries`.
    /// A pattern listed twice keeps both entries (and [`HostMatcher::entry_ports`] gives both
    /// entries' ports).
    pub fn with_ports<'a>(
        entries: impl IntoIterator<Item = (&'a HostPattern, &'a [u16])>,
    ) -> HostMatcher {
        let mut m = HostMatcher::default();
        for (index, (p, ports)) in entries.into_iter().enumerate() {
            let (map, name) = match p {
                HostPattern::Exact(n) => (&mut m.exact, n),
                HostPattern::Suffix(n) => (&mut m.suffixes, n),
            };
            map.entry(name.as_str().into()).or_default().push(Entry {
                index,
                ports: union(ports, &[]),
            });
        }
        m
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.suffixes.is_empty()
    }

    /// Is `name` allowed by any pattern?
    pub fn matches(&self, name: &HostName) -> bool {
        let s = name.as_str();
        if self.exact.contains_key(s) {
            return true;
        }
        if self.suffixes.is_empty() {
            return false;
        }
        proper_suffixes(s).any(|suffix| self.suffixes.contains_key(suffix))
    }

    /// The entries matching `name`, most specific first: exact entries, then wildcards from the
    /// longest suffix to the shortest; entries of one pattern in list order. Each is its index
    /// and its own ports (sorted). Allocates nothing.
    pub fn matching<'a>(&'a self, name: &'a HostName) -> impl Iterator<Item = (usize, &'a [u16])> {
        let s = name.as_str();
        let suffixes = (!self.suffixes.is_empty())
            .then(|| proper_suffixes(s).filter_map(|x| self.suffixes.get(x)))
            .into_iter()
            .flatten();
        self.exact
            .get(s)
            .into_iter()
            .chain(suffixes)
            .flatten()
            .map(|e| (e.index, &*e.ports))
    }

    /// The ports the entries matching `name` carry (the union over every matching pattern,
    /// sorted), or `None` when no pattern matches. `Some([])`: matched, no ports of its own.
    pub fn entry_ports(&self, name: &HostName) -> Option<Vec<u16>> {
        let mut found: Option<Vec<u16>> = None;
        for (_, p) in self.matching(name) {
            found = Some(union(found.as_deref().unwrap_or(&[]), p).into_vec());
        }
        found
    }
}

/// Every proper suffix that starts right after a dot: "a.b.c" → "b.c", "c".
fn proper_suffixes(s: &str) -> impl Iterator<Item = &str> {
    s.match_indices('.').map(move |(i, _)| &s[i + 1..])
}

/// Sorted, deduplicated union of two port lists.
fn union(a: &[u16], b: &[u16]) -> Box<[u16]> {
    let mut v: Vec<u16> = a.iter().chain(b).copied().collect();
    v.sort_unstable();
    v.dedup();
    v.into_boxed_slice()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn m(patterns: &[&str]) -> HostMatcher {
        let ps: Vec<HostPattern> = patterns
            .iter()
            .map(|p| HostPattern::parse(p).unwrap())
            .collect();
        HostMatcher::new(&ps)
    }

    fn allowed(m: &HostMatcher, host: &str) -> bool {
        match Destination::parse(host) {
            Ok(Destination::Name(n)) => m.matches(&n),
            _ => false,
        }
    }

    #[test]
    fn exact_and_wildcard() {
        let m = m(&["github.com", "*.githubusercontent.com"]);
        assert!(allowed(&m, "github.com"));
        assert!(allowed(&m, "GITHUB.com."));
        assert!(!allowed(&m, "api.github.com"));
        assert!(allowed(&m, "raw.githubusercontent.com"));
        assert!(allowed(&m, "a.b.githubusercontent.com"));
        // Decision: `*.x` does not match `x`.
        assert!(!allowed(&m, "githubusercontent.com"));
    }

    #[test]
    fn threat_item_7_confusions() {
        let m = m(&["*.github.com", "github.com"]);
        for (host, ok) in [
            ("github.com", true),
            ("api.github.com", true),
            ("GitHub.Com", true),
            ("github.com.", true),
            ("api.github.com.", true),
            ("evilgithub.com", false),
            ("evil-github.com", false),
            ("github.com.evil.com", false),
            ("api.github.com.evil.com", false),
            ("github.co", false),
            ("github.com@evil.com", false),
            ("evil.com@github.com", false),
            ("github.com:443", false),
            ("github.com..", false),
            ("xn--github-.com", false),
            ("githubа.com", false), // Cyrillic а
            ("2130706433", false),
            ("0x7f000001", false),
            ("0177.0.0.1", false),
            ("127.1", false),
            ("127.0.0.1", false),
            ("*.github.com", false),
        ] {
            assert_eq!(allowed(&m, host), ok, "{host:?}");
        }
    }

    #[test]
    fn idn_patterns_match_punycode_and_unicode() {
        let m = m(&["bücher.example"]);
        assert!(allowed(&m, "xn--bcher-kva.example"));
        assert!(allowed(&m, "BÜCHER.example"));
        assert!(!allowed(&m, "bucher.example"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in [
            "*",
            "*.",
            "**.github.com",
            "*github.com",
            "a.*.com",
            "github.*",
            "1.2.3.4",
            "[::1]",
            "2130706433",
            "",
            "http://github.com",
            "github.com:443",
            "*.*.com",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            HostPattern::parse("10.0.0.1"),
            Err(PatternError::IpAddress(_))
        ));
    }

    #[test]
    fn entry_ports_are_the_union_over_matching_patterns() {
        let ps = [
            (HostPattern::parse("github.com").unwrap(), vec![22]),
            (HostPattern::parse("*.github.com").unwrap(), vec![9418, 22]),
            (HostPattern::parse("*.api.github.com").unwrap(), vec![2222]),
            (HostPattern::parse("plain.test").unwrap(), vec![]),
        ];
        let m = HostMatcher::with_ports(ps.iter().map(|(p, v)| (p, v.as_slice())));
        let ports = |h: &str| m.entry_ports(&HostName::parse(h).unwrap());
        assert_eq!(ports("github.com"), Some(vec![22]));
        assert_eq!(ports("x.github.com"), Some(vec![22, 9418]));
        assert_eq!(ports("v3.api.github.com"), Some(vec![22, 2222, 9418]));
        assert_eq!(ports("plain.test"), Some(vec![]));
        assert_eq!(ports("evilgithub.com"), None);
        assert!(m.matches(&HostName::parse("plain.test").unwrap()));
    }

    #[test]
    fn matching_names_entries_most_specific_first() {
        let ps = [
            (HostPattern::parse("*.github.com").unwrap(), vec![]),
            (HostPattern::parse("api.github.com").unwrap(), vec![22]),
            (HostPattern::parse("*.api.github.com").unwrap(), vec![]),
            (
                HostPattern::parse("api.github.com").unwrap(),
                vec![9418, 2222],
            ),
        ];
        let m = HostMatcher::with_ports(ps.iter().map(|(p, v)| (p, v.as_slice())));
        let found = |h: &str| {
            let n = HostName::parse(h).unwrap();
            m.matching(&n)
                .map(|(i, p)| (i, p.to_vec()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            found("api.github.com"),
            vec![(1, vec![22]), (3, vec![2222, 9418]), (0, vec![])]
        );
        assert_eq!(found("v3.api.github.com"), vec![(2, vec![]), (0, vec![])]);
        assert_eq!(found("github.com"), vec![]);
    }

    #[test]
    fn display_roundtrip() {
        for p in ["github.com", "*.github.com"] {
            assert_eq!(HostPattern::parse(p).unwrap().to_string(), p);
        }
    }
}
