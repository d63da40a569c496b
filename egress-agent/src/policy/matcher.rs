//! `allow_hosts` patterns and their matcher.
//!
//! A pattern is either an exact name (`github.com`) or a wildcard `*.suffix` (`*.github.com`).
//! **`*.github.com` matches every name strictly below `github.com`, at any depth
//! (`api.github.com`, `a.b.github.com`), and never `github.com` itself** — list both to allow both.
//! Matching is on label boundaries only: `evilgithub.com` never matches `*.github.com`, and
//! `github.com.evil.com` never matches `github.com`. Patterns are normalised exactly like request
//! targets (see [`super::name`]); IP addresses are not host patterns (use `allow_cidrs`).
use std::collections::HashSet;
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

/// A set of patterns compiled for O(labels) lookups.
#[derive(Debug, Default, Clone)]
pub struct HostMatcher {
    exact: HashSet<Box<str>>,
    suffixes: HashSet<Box<str>>,
}

impl HostMatcher {
    pub fn new<'a>(patterns: impl IntoIterator<Item = &'a HostPattern>) -> HostMatcher {
        let mut m = HostMatcher::default();
        for p in patterns {
            match p {
                HostPattern::Exact(n) => m.exact.insert(n.as_str().into()),
                HostPattern::Suffix(n) => m.suffixes.insert(n.as_str().into()),
            };
        }
        m
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.suffixes.is_empty()
    }

    /// Is `name` allowed by any pattern?
    pub fn matches(&self, name: &HostName) -> bool {
        let s = name.as_str();
        if self.exact.contains(s) {
            return true;
        }
        if self.suffixes.is_empty() {
            return false;
        }
        // Every proper suffix that starts right after a dot: "a.b.c" → "b.c", "c".
        s.match_indices('.')
            .any(|(i, _)| self.suffixes.contains(&s[i + 1..]))
    }
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
    fn display_roundtrip() {
        for p in ["github.com", "*.github.com"] {
            assert_eq!(HostPattern::parse(p).unwrap().to_string(), p);
        }
    }
}
