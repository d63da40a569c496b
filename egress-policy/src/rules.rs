//! Request rules on intercepted hosts: allow or deny by method and path glob.
//!
//! ```toml
//! [[policies.agent.request_rules]]
//! host = "api.anthropic.com"     # exact name or *.suffix
//! port = 443                     # default 443
//! action = "allow"               # allow | deny
//! methods = ["POST"]             # default: any method
//! path = "/v1/messages"          # glob; default "/**"
//! ```
//!
//! Evaluation, per request to a host:port that has rules: the **first** rule (in file order) whose
//! host, port, method and path match decides. No rule matched: denied if the host has any `allow`
//! rule (an allowlist), allowed otherwise (only `deny` rules).
//!
//! Paths are matched after [`normalize_path`], which refuses anything two servers could read
//! differently (dot segments, empty segments, encoded `/` or `\`, `\`, `;`, NUL, bad escapes), so
//! a deny rule for `/admin/**` can't be dodged with `/x/../admin`, `//admin` or `/%61dmin`.
//! Globs: `*` matches within one segment (never `/`), a `**` segment matches any number of
//! segments (zero included). The query string is never looked at.
use serde::{Deserialize, Deserializer, Serialize};

use super::matcher::HostPattern;
use super::name::HostName;
use super::validation::{ValidationError, verr};

/// Default port of credential bindings and request rules: HTTPS.
pub(crate) fn default_tls_port() -> u16 {
    443
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleAction {
    Allow,
    Deny,
}

/// One `request_rules` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestRule {
    pub host: HostPattern,
    /// Default 443.
    #[serde(default = "default_tls_port")]
    pub port: u16,
    pub action: RuleAction,
    /// Upper-case method names; empty (the default) = any method.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Default `/**` (every path).
    #[serde(default)]
    pub path: PathGlob,
}

impl std::fmt::Display for RequestRule {
    /// `deny other.test:443 /admin/**`, `allow api.test:443 GET,POST /v1/*`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let action = match self.action {
            RuleAction::Allow => "allow",
            RuleAction::Deny => "deny",
        };
        write!(f, "{action} {}:{}", self.host, self.port)?;
        if !self.methods.is_empty() {
            write!(f, " {}", self.methods.join(","))?;
        }
        write!(f, " {}", self.path.as_str())
    }
}

impl RequestRule {
    pub fn applies_to(&self, host: &HostName, port: u16) -> bool {
        self.port == port && self.host.matches(host)
    }
    fn matches(&self, method: &str, path: &NormalPath) -> bool {
        (self.methods.is_empty() || self.methods.iter().any(|m| m == method))
            && self.path.matches(path)
    }
}

/// Why a request was refused by the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum RuleVerdict {
    Allowed,
    /// A `deny` rule matched: its index in the policy's `request_rules`.
    Denied(usize),
    /// The host has `allow` rules and none matched.
    NotAllowed,
}

/// Decide one request against the rules of one host:port (`rules` already filtered to it, each
/// with its index in the policy's `request_rules`).
pub fn decide<'a>(
    rules: impl IntoIterator<Item = (usize, &'a RequestRule)>,
    method: &str,
    path: &NormalPath,
) -> RuleVerdict {
    let mut any_allow = false;
    for (index, r) in rules {
        if r.matches(method, path) {
            return match r.action {
                RuleAction::Allow => RuleVerdict::Allowed,
                RuleAction::Deny => RuleVerdict::Denied(index),
            };
        }
        any_allow |= r.action == RuleAction::Allow;
    }
    if any_allow {
        RuleVerdict::NotAllowed
    } else {
        RuleVerdict::Allowed
    }
}

/// A request path in normal form (see [`normalize_path`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormalPath(String);

impl NormalPath {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why a path can't be matched safely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("path must start with /")]
    NotAbsolute,
    #[error("dot segment")]
    DotSegment,
    #[error("empty segment")]
    EmptySegment,
    #[error("encoded slash or backslash")]
    EncodedSeparator,
    #[error("character not allowed")]
    BadChar,
    #[error("malformed percent escape")]
    BadEscape,
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The path (no query) in normal form: `%XX` of unreserved characters decoded, other escapes
/// upper-cased; refused: no leading `/`, `.`/`..` segments, empty segments other than a final
/// one (a trailing `/`), `%2F`/`%5C`/`%00`, a raw `\`, `;` or control/non-ASCII byte, a bad escape.
pub fn normalize_path(raw: &str) -> Result<NormalPath, PathError> {
    let b = raw.as_bytes();
    if b.first() != Some(&b'/') {
        return Err(PathError::NotAbsolute);
    }
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            ) else {
                return Err(PathError::BadEscape);
            };
            let v = h * 16 + l;
            match v {
                b'/' | b'\\' => return Err(PathError::EncodedSeparator),
                0 => return Err(PathError::BadChar),
                v if unreserved(v) => out.push(v as char),
                v => {
                    out.push('%');
                    out.push(char::from(b"0123456789ABCDEF"[usize::from(v >> 4)]));
                    out.push(char::from(b"0123456789ABCDEF"[usize::from(v & 15)]));
                }
            }
            i += 3;
            continue;
        }
        if c <= 0x20 || c >= 0x7f || matches!(c, b'\\' | b';' | b'?' | b'#') {
            return Err(PathError::BadChar);
        }
        out.push(c as char);
        i += 1;
    }
    let segs: Vec<&str> = out[1..].split('/').collect();
    let last = segs.len() - 1;
    for (n, s) in segs.iter().enumerate() {
        if *s == "." || *s == ".." {
            return Err(PathError::DotSegment);
        }
        if s.is_empty() && n != last {
            return Err(PathError::EmptySegment);
        }
    }
    Ok(NormalPath(out))
}

/// A path glob (`/v1/*/messages`, `/v1/**`). Validated at load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathGlob {
    text: String,
    segs: Vec<Seg>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    /// `**`: any number of segments.
    Any,
    /// A segment pattern, `*` matching within the segment.
    One(String),
}

impl Default for PathGlob {
    fn default() -> Self {
        PathGlob {
            text: "/**".to_owned(),
            segs: vec![Seg::Any],
        }
    }
}

/// Most segments and characters in one glob (keeps matching cheap: O(segments × path segments)).
const MAX_GLOB_SEGMENTS: usize = 32;
const MAX_GLOB_LEN: usize = 512;

impl PathGlob {
    pub fn parse(s: &str) -> Result<PathGlob, String> {
        if s.len() > MAX_GLOB_LEN {
            return Err(format!("longer than {MAX_GLOB_LEN} characters"));
        }
        // A glob must be a normal path itself (with `*` standing for characters).
        let probe = s.replace('*', "x");
        let norm = normalize_path(&probe).map_err(|e| format!("{s:?}: {e}"))?;
        if norm.as_str() != probe {
            return Err(format!(
                "{s:?} is not in normal form; write it as {:?}",
                norm.as_str()
            ));
        }
        let segs: Vec<Seg> = s[1..]
            .split('/')
            .map(|seg| {
                if seg == "**" {
                    Ok(Seg::Any)
                } else if seg.contains("**") {
                    Err(format!("{s:?}: `**` must be a whole segment"))
                } else {
                    Ok(Seg::One(seg.to_owned()))
                }
            })
            .collect::<Result<_, _>>()?;
        if segs.len() > MAX_GLOB_SEGMENTS {
            return Err(format!("more than {MAX_GLOB_SEGMENTS} segments"));
        }
        Ok(PathGlob {
            text: s.to_owned(),
            segs,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn matches(&self, path: &NormalPath) -> bool {
        let parts: Vec<&str> = path.as_str()[1..].split('/').collect();
        // reach[j]: the first i glob segments can match the first j path segments.
        let mut reach = vec![false; parts.len() + 1];
        reach[0] = true;
        for seg in &self.segs {
            let mut next = vec![false; parts.len() + 1];
            match seg {
                Seg::Any => {
                    let mut on = false;
                    for j in 0..=parts.len() {
                        on |= reach[j];
                        next[j] = on;
                    }
                }
                Seg::One(p) => {
                    for j in 0..parts.len() {
                        if reach[j] && segment_matches(p.as_bytes(), parts[j].as_bytes()) {
                            next[j + 1] = true;
                        }
                    }
                }
            }
            reach = next;
        }
        reach[parts.len()]
    }
}

/// `*` matches any run of bytes (the segment has no `/`); everything else literally.
fn segment_matches(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == b'*')
}

impl Serialize for PathGlob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for PathGlob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PathGlob::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Checks `request_rules` of one policy (`base` = its dotted path).
pub fn validate(rules: &[RequestRule], base: &str) -> Result<(), ValidationError> {
    for (i, r) in rules.iter().enumerate() {
        let at = format!("{base}.request_rules[{i}]");
        if r.port == 0 {
            return Err(verr(format!("{at}.port"), "port 0 is not a port"));
        }
        for (k, m) in r.methods.iter().enumerate() {
            if m.is_empty() || m.len() > 32 || !m.bytes().all(|b| b.is_ascii_uppercase()) {
                return Err(verr(
                    format!("{at}.methods[{k}]"),
                    format!("{m:?}: methods are upper-case names like \"POST\""),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn p(s: &str) -> NormalPath {
        normalize_path(s).unwrap()
    }

    #[test]
    fn normal_form() {
        assert_eq!(p("/v1/%6Dessages").as_str(), "/v1/messages");
        assert_eq!(p("/a%2db/%7e").as_str(), "/a-b/~");
        assert_eq!(p("/x%3a%3Fy").as_str(), "/x%3A%3Fy");
        assert_eq!(p("/").as_str(), "/");
        assert_eq!(p("/v1/").as_str(), "/v1/");
        for (bad, e) in [
            ("", PathError::NotAbsolute),
            ("*", PathError::NotAbsolute),
            ("v1", PathError::NotAbsolute),
            ("/a/../admin", PathError::DotSegment),
            ("/a/./b", PathError::DotSegment),
            ("/a/%2e%2E/b", PathError::DotSegment),
            ("/..", PathError::DotSegment),
            ("//admin", PathError::EmptySegment),
            ("/a//b", PathError::EmptySegment),
            ("/a%2Fb", PathError::EncodedSeparator),
            ("/a%5cb", PathError::EncodedSeparator),
            ("/a\\b", PathError::BadChar),
            ("/admin;x=1", PathError::BadChar),
            ("/a%00", PathError::BadChar),
            ("/a b", PathError::BadChar),
            ("/%zz", PathError::BadEscape),
            ("/%4", PathError::BadEscape),
            ("/é", PathError::BadChar),
        ] {
            assert_eq!(normalize_path(bad), Err(e), "{bad:?}");
        }
    }

    #[test]
    fn globs() {
        let g = |s: &str| PathGlob::parse(s).unwrap();
        assert!(g("/v1/messages").matches(&p("/v1/messages")));
        assert!(!g("/v1/messages").matches(&p("/v1/messages/")));
        assert!(!g("/v1/messages").matches(&p("/v1/messages/x")));
        assert!(g("/v1/*").matches(&p("/v1/messages")));
        assert!(!g("/v1/*").matches(&p("/v1/a/b")));
        assert!(g("/v1/**").matches(&p("/v1/a/b")));
        assert!(g("/v1/**").matches(&p("/v1")));
        assert!(g("/**").matches(&p("/")));
        assert!(g("/v1/**/count").matches(&p("/v1/a/b/count")));
        assert!(g("/v1/**/count").matches(&p("/v1/count")));
        assert!(g("/v1/models/*:generate*").matches(&p("/v1/models/gemini:generateContent")));
        assert!(!g("/v1/models/*:generate*").matches(&p("/v1/models/gemini:count")));
        assert!(g("/a*b*c").matches(&p("/aXXbYYc")));
        assert!(!g("/a*b*c").matches(&p("/aXXbYY")));
        for bad in [
            "v1",
            "/a/../b",
            "//x",
            "/a**",
            "/a;b",
            "/%61",
            &"/a".repeat(40),
        ] {
            assert!(PathGlob::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn first_match_decides_and_allow_rules_make_an_allowlist() {
        let rule = |action, methods: &[&str], path: &str| RequestRule {
            host: HostPattern::parse("api.test").unwrap(),
            port: 443,
            action,
            methods: methods.iter().map(|m| (*m).to_owned()).collect(),
            path: PathGlob::parse(path).unwrap(),
        };
        let rules = [
            rule(RuleAction::Deny, &[], "/v1/admin/**"),
            rule(RuleAction::Allow, &["POST"], "/v1/messages"),
            rule(RuleAction::Allow, &["GET"], "/v1/models/*"),
        ];
        assert_eq!(
            decide(rules.iter().enumerate(), "POST", &p("/v1/messages")),
            RuleVerdict::Allowed
        );
        assert_eq!(
            decide(rules.iter().enumerate(), "GET", &p("/v1/messages")),
            RuleVerdict::NotAllowed
        );
        assert_eq!(
            decide(rules.iter().enumerate(), "GET", &p("/v1/models/x")),
            RuleVerdict::Allowed
        );
        assert_eq!(
            decide(rules.iter().enumerate(), "POST", &p("/v1/admin/keys")),
            RuleVerdict::Denied(0)
        );
        let deny_only = [rule(RuleAction::Deny, &["DELETE"], "/**")];
        assert_eq!(
            decide(deny_only.iter().enumerate(), "GET", &p("/x")),
            RuleVerdict::Allowed
        );
        assert_eq!(
            decide(deny_only.iter().enumerate(), "DELETE", &p("/x")),
            RuleVerdict::Denied(0)
        );
    }
}
