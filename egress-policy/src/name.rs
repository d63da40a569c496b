//! Host names as the proxy sees them: one normalised form, or an IP literal, or a refusal.
//!
//! Normalisation (applied identically to policy patterns and to request targets):
//! 1. IDN → punycode and case folding through UTS #46 (`idna`), which also maps full-width dots;
//! 2. one trailing dot removed (`github.com.` is `github.com`);
//! 3. only `[a-z0-9-_]` labels of 1..=63 bytes, 253 bytes in all, no leading/trailing `-`;
//! 4. anything that *ends in a number* (WHATWG URL rule: last label all digits or `0x`+hex) is an IP
//!    form: a canonical dotted quad becomes [`Destination::Ip`], every other numeric form (decimal
//!    `2130706433`, octal `0177.0.0.1`, hex `0x7f.1`, short `127.1`) is refused, never interpreted.
//! 5. `[v6]` is an IPv6 literal (zone ids refused).
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

/// Longest DNS name in presentation form without the trailing dot.
pub const MAX_NAME_LEN: usize = 253;
const MAX_LABEL_LEN: usize = 63;

/// Why a host string was refused. Each maps to a machine-readable reason string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("empty host")]
    Empty,
    #[error("host is not a valid DNS name")]
    Invalid,
    #[error(
        "host is a numeric IP form other than a canonical address (decimal, octal, hex or short)"
    )]
    NumericIpForm,
    #[error("host is longer than {MAX_NAME_LEN} bytes or has a label longer than 63")]
    TooLong,
}

impl NameError {
    /// The machine-readable reason used in responses and events.
    pub fn reason(self) -> &'static str {
        match self {
            NameError::Empty | NameError::Invalid | NameError::TooLong => "invalid-host",
            NameError::NumericIpForm => "numeric-ip-form",
        }
    }
}

/// A normalised DNS name: lowercase ASCII (punycode), no trailing dot, validated labels.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostName(Arc<str>);

impl HostName {
    /// Normalise and validate a *name*; IP literals and numeric forms are refused here.
    pub fn parse(input: &str) -> Result<HostName, NameError> {
        match Destination::parse(input)? {
            Destination::Name(n) => Ok(n),
            Destination::Ip(_) => Err(NameError::NumericIpForm),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Does this name end in `.suffix` on a label boundary (strictly below `suffix`)?
    pub fn is_strict_subdomain_of(&self, suffix: &HostName) -> bool {
        let n = self.as_str();
        let s = suffix.as_str();
        n.len() > s.len() + 1 && n.ends_with(s) && n.as_bytes()[n.len() - s.len() - 1] == b'.'
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostName({})", &self.0)
    }
}

/// Where a request wants to go, before resolution.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Destination {
    Name(HostName),
    Ip(IpAddr),
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Destination::Name(n) => f.write_str(n.as_str()),
            Destination::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]"),
            Destination::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

impl Destination {
    /// Parse the host part of an authority (no port, no userinfo).
    pub fn parse(input: &str) -> Result<Destination, NameError> {
        if input.is_empty() {
            return Err(NameError::Empty);
        }
        if let Some(rest) = input.strip_prefix('[') {
            let inner = rest.strip_suffix(']').ok_or(NameError::Invalid)?;
            // `Ipv6Addr::from_str` refuses zone ids (`%eth0`) and anything non-canonical-ish.
            let ip: Ipv6Addr = inner.parse().map_err(|_| NameError::Invalid)?;
            return Ok(Destination::Ip(IpAddr::V6(ip)));
        }
        if input.len() > 4 * (MAX_NAME_LEN + 1) {
            return Err(NameError::TooLong);
        }
        // Cheap pre-filter: bytes that never belong in a host, whatever idna would map them to.
        if input
            .bytes()
            .any(|b| b.is_ascii_control() || b == b' ' || b"@/\\:%?#[]<>^|\"'`{}".contains(&b))
        {
            return Err(NameError::Invalid);
        }
        let ascii = idna::domain_to_ascii_cow(input.as_bytes(), idna::AsciiDenyList::URL)
            .map_err(|_| NameError::Invalid)?;
        let mut s: &str = &ascii;
        if let Some(stripped) = s.strip_suffix('.') {
            s = stripped;
        }
        if s.is_empty() {
            return Err(NameError::Empty);
        }
        if s.len() > MAX_NAME_LEN {
            return Err(NameError::TooLong);
        }
        let last = s.rsplit('.').next().unwrap_or(s);
        if ends_in_number(last) {
            // Only the canonical dotted quad is an address; std's parser refuses leading zeros,
            // short forms and out-of-range octets.
            return match s.parse::<Ipv4Addr>() {
                Ok(ip) => Ok(Destination::Ip(IpAddr::V4(ip))),
                Err(_) => Err(NameError::NumericIpForm),
            };
        }
        for label in s.split('.') {
            if label.is_empty() {
                return Err(NameError::Invalid);
            }
            if label.len() > MAX_LABEL_LEN {
                return Err(NameError::TooLong);
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(NameError::Invalid);
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            {
                return Err(NameError::Invalid);
            }
        }
        Ok(Destination::Name(HostName(Arc::from(s))))
    }
}

/// WHATWG URL "ends in a number": all ASCII digits, or `0x`/`0X` followed by hex digits (or nothing).
fn ends_in_number(label: &str) -> bool {
    if !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    if let Some(hex) = label
        .strip_prefix("0x")
        .or_else(|| label.strip_prefix("0X"))
    {
        return hex.bytes().all(|b| b.is_ascii_hexdigit());
    }
    false
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn name(s: &str) -> String {
        match Destination::parse(s) {
            Ok(Destination::Name(n)) => n.as_str().to_owned(),
            other => panic!("{s:?} → {other:?}"),
        }
    }

    #[test]
    fn case_and_trailing_dot_are_normalised() {
        assert_eq!(name("GitHub.COM"), "github.com");
        assert_eq!(name("github.com."), "github.com");
        assert_eq!(name("API.GitHub.com."), "api.github.com");
    }

    #[test]
    fn double_trailing_dot_and_empty_labels_are_refused() {
        assert!(Destination::parse("github.com..").is_err());
        assert!(Destination::parse(".github.com").is_err());
        assert!(Destination::parse("a..b").is_err());
        assert!(Destination::parse(".").is_err());
        assert!(Destination::parse("").is_err());
    }

    #[test]
    fn idn_becomes_punycode() {
        assert_eq!(name("bücher.example"), "xn--bcher-kva.example");
        assert_eq!(name("BÜCHER.example"), "xn--bcher-kva.example");
        assert_eq!(name("xn--bcher-kva.example"), "xn--bcher-kva.example");
        // Full-width letters and ideographic full stop fold to the ASCII name (one canonical form).
        assert_eq!(name("ｇｉｔｈｕｂ。com"), "github.com");
        // Cyrillic 'а' in "githubа" is a different name, not github.
        assert_ne!(name("githubа.com"), "github.com");
    }

    #[test]
    fn userinfo_ports_paths_and_controls_are_refused() {
        for bad in [
            "github.com@evil.com",
            "github.com:443",
            "github.com/evil",
            "github.com\\evil.com",
            "github.com\r\nHost: evil.com",
            "github.com evil.com",
            "github.com%2eevil.com",
            "github.com\0.evil.com",
            "-github.com",
            "github-.com",
        ] {
            assert!(Destination::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn numeric_ip_forms_are_refused() {
        for bad in [
            "2130706433",
            "0x7f000001",
            "0X7F.0.0.1",
            "0177.0.0.1",
            "127.1",
            "127.0.1",
            "127.000.000.001",
            "1.2.3.04",
            "256.1.1.1",
            "1.2.3.4.5",
            "example.0x10",
            "example.123",
            "0x",
        ] {
            assert_eq!(
                Destination::parse(bad),
                Err(NameError::NumericIpForm),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn ip_literals_are_recognised() {
        assert_eq!(
            Destination::parse("127.0.0.1"),
            Ok(Destination::Ip("127.0.0.1".parse().unwrap()))
        );
        assert_eq!(
            Destination::parse("[::1]"),
            Ok(Destination::Ip("::1".parse().unwrap()))
        );
        assert_eq!(
            Destination::parse("[::ffff:127.0.0.1]"),
            Ok(Destination::Ip("::ffff:127.0.0.1".parse().unwrap()))
        );
        assert!(Destination::parse("[fe80::1%eth0]").is_err());
        assert!(Destination::parse("[::1").is_err());
        assert!(Destination::parse("::1").is_err());
        // Names starting with digits are fine when the last label is not numeric.
        assert_eq!(name("1e100.net"), "1e100.net");
        assert_eq!(name("123.example.com"), "123.example.com");
        assert_eq!(name("0x7f.example"), "0x7f.example");
    }

    #[test]
    fn length_limits() {
        let label = "a".repeat(63);
        assert!(Destination::parse(&format!("{label}.com")).is_ok());
        assert_eq!(
            Destination::parse(&format!("a{label}.com")),
            Err(NameError::TooLong)
        );
        let long = vec!["abcdefghi"; 30].join(".");
        assert_eq!(Destination::parse(&long), Err(NameError::TooLong));
    }

    #[test]
    fn strict_subdomain_is_label_bounded() {
        let gh = HostName::parse("github.com").unwrap();
        assert!(
            HostName::parse("api.github.com")
                .unwrap()
                .is_strict_subdomain_of(&gh)
        );
        assert!(
            HostName::parse("a.b.github.com")
                .unwrap()
                .is_strict_subdomain_of(&gh)
        );
        assert!(
            !HostName::parse("evilgithub.com")
                .unwrap()
                .is_strict_subdomain_of(&gh)
        );
        assert!(
            !HostName::parse("github.com")
                .unwrap()
                .is_strict_subdomain_of(&gh)
        );
        assert!(
            !HostName::parse("github.com.evil.com")
                .unwrap()
                .is_strict_subdomain_of(&gh)
        );
    }
}
