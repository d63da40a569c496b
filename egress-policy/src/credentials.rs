//! Credential bindings: the real secret for a host is added at the egress boundary, so the
//! container only ever holds a placeholder.
//!
//! ```toml
//! [[policies.agent.credentials]]
//! host = "api.anthropic.com"          # exact name or *.suffix; must be allowed by allow_hosts
//! port = 443                          # default 443
//! header = "x-api-key"                # where the secret goes: header (+ prefix), basic_user or query
//! # prefix = "Bearer "                # with header = "authorization"
//! # basic_user = "api"                # HTTP Basic: user "api", password = the secret
//! # query = "key"                     # a query parameter, only where the API leaves no other way
//! source = { file = "/etc/egress-agent/secrets/anthropic" }   # or { env = "..." }, { credential = "..." }
//! placeholder = "egress-placeholder-anthropic-7f3a"           # what the container sends instead
//! placeholder_env = "ANTHROPIC_API_KEY"                       # `exec` sets it to the placeholder
//! require = true                      # refuse requests to the host that lack the placeholder
//! ```
//!
//! Per request to the bound host:port (intercepted TLS only; never over plain HTTP):
//! - a placeholder is configured and present in the binding's place (the header's value, the
//!   Basic password, the query parameter) → that place is replaced with the secret;
//! - configured but absent → `require = true`: refused (`credential-placeholder-missing`);
//!   otherwise the request goes on unchanged;
//! - no placeholder configured → the secret is always set (any value the client sent is replaced).
//!
//! The placeholder check for **other** destinations is in [`super::l7`].
use base64::Engine as _;
use http::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

use super::matcher::{HostMatcher, HostPattern};
use super::name::HostName;
use super::rules::default_tls_port;
use super::validation::{ValidationError, verr};
use crate::secret::{Secret, SecretSource};

/// One `credentials` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialBinding {
    pub host: HostPattern,
    /// Default 443.
    #[serde(default = "default_tls_port")]
    pub port: u16,
    /// Header the secret goes into (lower-cased), e.g. `x-api-key` or `authorization`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Written before the secret in `header`, e.g. `"Bearer "`. Default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// HTTP Basic with this user name; the secret is the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub basic_user: Option<String>,
    /// A query parameter (only for APIs that accept nothing else).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    pub source: SecretSource,
    /// The value the container holds instead of the secret. Default none (always inject).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placeholder: Option<String>,
    /// Environment variable `exec` sets to the placeholder for the command. Default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placeholder_env: Option<String>,
    /// Refuse requests to this host that don't carry the placeholder. Default false.
    #[serde(default)]
    pub require: bool,
    /// Loaded from `source` by [`resolve`] (at load and every reload); never serialised.
    #[serde(skip)]
    pub secret: Option<Secret>,
    /// Why [`resolve`] could not load the secret (the field and what went wrong; names the
    /// source, never its content). Such a binding serves nothing: its host:port is refused
    /// (`interception-unavailable`), never forwarded without the secret.
    #[serde(skip)]
    pub unavailable: Option<ValidationError>,
}

/// Where the secret goes, checked and compiled.
#[derive(Debug, Clone)]
pub enum Place {
    /// Header name, and the complete value to set (prefix + secret; marked sensitive).
    Header(HeaderName, HeaderValue),
    /// `Authorization: Basic …` with the secret as password.
    Basic(HeaderValue),
    /// Query parameter name and the percent-encoded secret.
    Query(String, SecretText),
}

/// A percent-encoded secret for a query string. `Debug` shows nothing.
#[derive(Clone)]
pub struct SecretText(zeroize::Zeroizing<String>);

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A binding ready for the hot path.
#[derive(Debug, Clone)]
pub struct CompiledBinding {
    pub host: HostPattern,
    pub port: u16,
    /// `None`: the secret was not loaded (the binding fails closed: requests are refused).
    pub place: Option<Place>,
    placeholder: Option<String>,
    pub require: bool,
    /// Why the secret is not loaded (with `place` `None`), for the refusal's event.
    unavailable: Option<std::sync::Arc<str>>,
}

/// What a binding does to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Injection {
    /// The secret replaces the placeholder (or is set: no placeholder configured).
    Inject,
    /// No placeholder in the request and none required: forwarded unchanged.
    Unchanged,
    /// `require = true` and no placeholder: refuse.
    MissingPlaceholder,
    /// The secret isn't loaded: refuse.
    Unavailable,
}

fn percent_encode_component(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            s.push(b as char);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            s.push('%');
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        }
    }
    s
}

fn sensitive(mut v: HeaderValue) -> HeaderValue {
    v.set_sensitive(true);
    v
}

impl CompiledBinding {
    pub fn new(b: &CredentialBinding) -> CompiledBinding {
        let place = b.secret.as_ref().and_then(|s| compile_place(b, s));
        let unavailable = place.is_none().then(|| {
            let why = b.unavailable.as_ref().map_or_else(
                || "its secret is not loaded".to_owned(),
                ValidationError::to_string,
            );
            std::sync::Arc::from(why)
        });
        CompiledBinding {
            host: b.host.clone(),
            port: b.port,
            place,
            placeholder: b.placeholder.clone(),
            require: b.require,
            unavailable,
        }
    }

    /// Why this binding can't inject (its secret is not loaded), or `None` when it can. Names
    /// the field and the source, never the secret.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    pub fn applies_to(&self, host: &HostName, port: u16) -> bool {
        self.port == port && self.host.matches(host)
    }

    pub fn placeholder(&self) -> Option<&str> {
        self.placeholder.as_deref()
    }

    /// Is the placeholder in the binding's place of this request?
    fn placeholder_in_place(&self, headers: &HeaderMap, query: Option<&str>) -> bool {
        let Some(ph) = self.placeholder.as_deref() else {
            return false;
        };
        match &self.place {
            Some(Place::Header(name, _)) => headers
                .get_all(name)
                .iter()
                .any(|v| contains(v.as_bytes(), ph.as_bytes())),
            Some(Place::Basic(_)) => headers.get_all(AUTHORIZATION).iter().any(|v| {
                contains(v.as_bytes(), ph.as_bytes()) || basic_password_is(v.as_bytes(), ph)
            }),
            Some(Place::Query(name, _)) => query.is_some_and(|q| {
                q.split('&').any(|kv| {
                    kv.split_once('=')
                        .is_some_and(|(k, v)| k == name && decode_eq(v, ph))
                })
            }),
            None => false,
        }
    }

    /// What this binding does to a request (`query` = the raw query string, if any).
    pub fn decide(&self, headers: &HeaderMap, query: Option<&str>) -> Injection {
        if self.place.is_none() {
            return Injection::Unavailable;
        }
        if self.placeholder.is_none() || self.placeholder_in_place(headers, query) {
            Injection::Inject
        } else if self.require {
            Injection::MissingPlaceholder
        } else {
            Injection::Unchanged
        }
    }

    /// Put the secret in place: replaces the header(s), or the query parameter (returns the new
    /// path-and-query when it changed).
    pub fn inject(&self, headers: &mut HeaderMap, path_and_query: &str) -> Option<String> {
        match self.place.as_ref()? {
            Place::Header(name, value) => {
                headers.insert(name.clone(), value.clone());
                None
            }
            Place::Basic(value) => {
                headers.insert(AUTHORIZATION, value.clone());
                None
            }
            Place::Query(name, value) => {
                let (path, query) = match path_and_query.split_once('?') {
                    Some((p, q)) => (p, Some(q)),
                    None => (path_and_query, None),
                };
                let mut out = String::with_capacity(path_and_query.len() + value.0.len());
                out.push_str(path);
                out.push('?');
                let mut first = true;
                for kv in query.into_iter().flat_map(|q| q.split('&')) {
                    let k = kv.split_once('=').map_or(kv, |(k, _)| k);
                    if k == name || kv.is_empty() {
                        continue;
                    }
                    if !first {
                        out.push('&');
                    }
                    out.push_str(kv);
                    first = false;
                }
                if !first {
                    out.push('&');
                }
                out.push_str(name);
                out.push('=');
                out.push_str(&value.0);
                Some(out)
            }
        }
    }
}

fn compile_place(b: &CredentialBinding, secret: &Secret) -> Option<Place> {
    let s = secret.expose();
    if let Some(user) = &b.basic_user {
        let mut plain = zeroize::Zeroizing::new(Vec::with_capacity(user.len() + 1 + s.len()));
        plain.extend_from_slice(user.as_bytes());
        plain.push(b':');
        plain.extend_from_slice(s);
        let value = zeroize::Zeroizing::new(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(&*plain)
        ));
        return HeaderValue::from_str(&value)
            .ok()
            .map(|v| Place::Basic(sensitive(v)));
    }
    if let Some(q) = &b.query {
        return Some(Place::Query(
            q.clone(),
            SecretText(zeroize::Zeroizing::new(percent_encode_component(s))),
        ));
    }
    let name = HeaderName::from_bytes(b.header.as_deref()?.as_bytes()).ok()?;
    let mut value = zeroize::Zeroizing::new(Vec::new());
    value.extend_from_slice(b.prefix.as_deref().unwrap_or("").as_bytes());
    value.extend_from_slice(s);
    let value = HeaderValue::from_bytes(&value).ok()?;
    Some(Place::Header(name, sensitive(value)))
}

pub(crate) fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty()
        && hay.len() >= needle.len()
        && hay.windows(needle.len()).any(|w| w == needle)
}

fn basic_password_is(value: &[u8], placeholder: &str) -> bool {
    let Some(b64) = value
        .strip_prefix(b"Basic ")
        .or_else(|| value.strip_prefix(b"basic "))
    else {
        return false;
    };
    let Ok(plain) = base64::engine::general_purpose::STANDARD.decode(b64.trim_ascii()) else {
        return false;
    };
    let plain = zeroize::Zeroizing::new(plain);
    contains(&plain, placeholder.as_bytes())
}

/// Percent-decode `v` and compare with `want`.
fn decode_eq(v: &str, want: &str) -> bool {
    percent_decode(v).as_deref() == Some(want.as_bytes())
}

/// `%XX` and `+` decoded (query-string rules); `None` on a malformed escape.
pub(crate) fn percent_decode(v: &str) -> Option<Vec<u8>> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = char::from(*b.get(i + 1)?).to_digit(16)?;
                let l = char::from(*b.get(i + 2)?).to_digit(16)?;
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Some(out)
}

fn header_name_ok(h: &str) -> bool {
    HeaderName::from_bytes(h.as_bytes()).is_ok_and(|n| n.as_str() == h)
}

/// Hop-by-hop and framing headers a secret must never go into.
const FORBIDDEN_HEADERS: &[&str] = &[
    "host",
    "connection",
    "content-length",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
];

/// What of its policy the bindings must fit (the policy's `validate` fills it in).
pub struct Scope<'a> {
    /// A `deny_all` policy: no binding can be used.
    pub deny_all: bool,
    /// An allowlist: each binding's host and port must be allowed.
    pub allowlist: bool,
    pub allow_hosts: &'a [HostPattern],
    pub allow_ports: &'a [u16],
}

/// Checks the `credentials` of one policy (`base` = its dotted path) against what it allows.
/// Sources are not read here (see [`resolve`]).
// Long: independent checks of each binding (host, port, header, placeholder, secret source)
// and of the bindings together, each naming the field it refuses.
pub fn validate(
    credentials: &[CredentialBinding],
    p: &Scope<'_>,
    base: &str,
) -> Result<(), ValidationError> {
    if credentials.is_empty() {
        return Ok(());
    }
    if p.deny_all {
        return Err(verr(
            format!("{base}.credentials"),
            "a deny_all policy reaches no host to send credentials to",
        ));
    }
    let patterns = p.allow_hosts;
    let allowed = HostMatcher::new(patterns);
    let mut placeholders: Vec<&str> = Vec::new();
    let mut envs: Vec<&str> = Vec::new();
    for (i, b) in credentials.iter().enumerate() {
        let at = format!("{base}.credentials[{i}]");
        if b.port == 0 {
            return Err(verr(format!("{at}.port"), "port 0 is not a port"));
        }
        if p.allowlist && !pattern_allowed(&b.host, patterns, &allowed) {
            return Err(verr(
                format!("{at}.host"),
                format!(
                    "{} is not covered by allow_hosts: the proxy would refuse it before any credential is added",
                    b.host
                ),
            ));
        }
        if p.allowlist && !p.allow_ports.contains(&b.port) {
            return Err(verr(
                format!("{at}.port"),
                format!("port {} is not in allow_ports", b.port),
            ));
        }
        let places = [
            b.header.is_some(),
            b.basic_user.is_some(),
            b.query.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if places != 1 {
            return Err(verr(
                at,
                "set exactly one of header, basic_user or query (where the secret goes)",
            ));
        }
        if let Some(h) = &b.header {
            if !header_name_ok(h) {
                return Err(verr(
                    format!("{at}.header"),
                    format!("{h:?} is not a lower-case header name"),
                ));
            }
            if FORBIDDEN_HEADERS.contains(&h.as_str()) {
                return Err(verr(
                    format!("{at}.header"),
                    format!("{h:?} is a connection header; a secret can't go there"),
                ));
            }
        }
        if let Some(prefix) = &b.prefix {
            if b.header.is_none() {
                return Err(verr(format!("{at}.prefix"), "prefix needs header"));
            }
            if HeaderValue::from_str(prefix).is_err() {
                return Err(verr(
                    format!("{at}.prefix"),
                    "not allowed in a header value",
                ));
            }
        }
        if let Some(u) = &b.basic_user
            && (u.contains(':') || u.bytes().any(|c| c < 0x20 || c == 0x7f))
        {
            return Err(verr(
                format!("{at}.basic_user"),
                "a Basic user name has no ':' or control characters",
            ));
        }
        if let Some(q) = &b.query
            && (q.is_empty() || percent_encode_component(q.as_bytes()) != *q)
        {
            return Err(verr(
                format!("{at}.query"),
                "a query parameter name of [A-Za-z0-9-._~]",
            ));
        }
        match &b.placeholder {
            Some(ph) => {
                if ph.len() < 8
                    || ph.len() > 256
                    || !ph
                        .bytes()
                        .all(|c| c.is_ascii_graphic() && c != b'%' && c != b'+')
                {
                    return Err(verr(
                        format!("{at}.placeholder"),
                        "8-256 visible ASCII characters (no %, + or spaces) that occur nowhere else in requests",
                    ));
                }
                if placeholders
                    .iter()
                    .any(|o| o.contains(ph.as_str()) || ph.contains(o))
                {
                    return Err(verr(
                        format!("{at}.placeholder"),
                        "placeholders of one policy must differ (and not contain each other)",
                    ));
                }
                placeholders.push(ph);
            }
            None if b.require => {
                return Err(verr(
                    format!("{at}.require"),
                    "require = true needs a placeholder",
                ));
            }
            None if b.placeholder_env.is_some() => {
                return Err(verr(
                    format!("{at}.placeholder_env"),
                    "placeholder_env needs a placeholder",
                ));
            }
            None => {}
        }
        if let Some(e) = &b.placeholder_env {
            let mut bytes = e.bytes();
            let ok = matches!(bytes.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
                && bytes.all(|c| c.is_ascii_alphanumeric() || c == b'_');
            if !ok {
                return Err(verr(
                    format!("{at}.placeholder_env"),
                    format!("{e:?} is not an environment variable name"),
                ));
            }
            if envs.contains(&e.as_str()) {
                return Err(verr(
                    format!("{at}.placeholder_env"),
                    format!("{e} is set by another binding"),
                ));
            }
            envs.push(e);
        }
        if credentials[..i]
            .iter()
            .any(|o| o.port == b.port && o.host == b.host)
        {
            return Err(verr(
                format!("{at}.host"),
                format!("a second binding for {}:{}", b.host, b.port),
            ));
        }
    }
    Ok(())
}

/// Is every name `pat` matches allowed by `allow_hosts`?
fn pattern_allowed(pat: &HostPattern, list: &[HostPattern], m: &HostMatcher) -> bool {
    match pat {
        HostPattern::Exact(n) => m.matches(n),
        HostPattern::Suffix(s) => list.iter().any(|a| match a {
            HostPattern::Suffix(t) => t == s || s.is_strict_subdomain_of(t),
            HostPattern::Exact(_) => false,
        }),
    }
}

/// Load every binding's secret with `load` (the agent's `secrets::load`, at start and at each
/// reload). Returns every binding whose secret can't be used — the source can't be read, or the
/// secret holds the placeholder — as an error naming its field; such a binding is left without
/// a secret and records why ([`CredentialBinding::unavailable`]), so it refuses its host rather
/// than send a request without its credential. Whether that refuses the whole configuration
/// (`check`) or only the binding (serving) is the caller's decision.
pub fn resolve<E: std::fmt::Display>(
    credentials: &mut [CredentialBinding],
    base: &str,
    load: impl Fn(&SecretSource) -> Result<Secret, E>,
) -> Vec<ValidationError> {
    let mut failed = Vec::new();
    for (i, b) in credentials.iter_mut().enumerate() {
        b.secret = None;
        b.unavailable = None;
        let loaded = load(&b.source)
            .map_err(|e| verr(format!("{base}.credentials[{i}].source"), e.to_string()))
            .and_then(|secret| match &b.placeholder {
                Some(ph) if contains(secret.expose(), ph.as_bytes()) => Err(verr(
                    format!("{base}.credentials[{i}].placeholder"),
                    "the secret contains the placeholder; choose another placeholder",
                )),
                _ => Ok(secret),
            });
        match loaded {
            Ok(secret) => b.secret = Some(secret),
            Err(e) => {
                b.unavailable = Some(e.clone());
                failed.push(e);
            }
        }
    }
    failed
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn binding(extra: &str) -> CompiledBinding {
        let b: CredentialBinding = toml::from_str(&format!(
            "host = \"api.test\"\nsource = {{ env = \"X\" }}\n{extra}"
        ))
        .unwrap();
        let mut b = b;
        b.secret = Some(Secret::new(b"s3cr3t/+=".to_vec()));
        CompiledBinding::new(&b)
    }

    fn headers(kv: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in kv {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn header_with_prefix_replaces_the_placeholder() {
        let b = binding(
            "header = \"authorization\"\nprefix = \"Bearer \"\nplaceholder = \"PH-abcdefgh\"\nrequire = true",
        );
        let mut h = headers(&[("authorization", "Bearer PH-abcdefgh")]);
        assert_eq!(b.decide(&h, None), Injection::Inject);
        assert_eq!(b.inject(&mut h, "/"), None);
        assert_eq!(h["authorization"], "Bearer s3cr3t/+=");
        assert!(h["authorization"].is_sensitive());
        let h = headers(&[("authorization", "Bearer other")]);
        assert_eq!(b.decide(&h, None), Injection::MissingPlaceholder);
        // The placeholder in another header doesn't count.
        let h = headers(&[("x-api-key", "PH-abcdefgh")]);
        assert_eq!(b.decide(&h, None), Injection::MissingPlaceholder);
    }

    #[test]
    fn basic_and_query_places() {
        let b = binding("basic_user = \"api\"\nplaceholder = \"PH-abcdefgh\"");
        let enc = base64::engine::general_purpose::STANDARD.encode("api:PH-abcdefgh");
        let mut h = headers(&[("authorization", &format!("Basic {enc}"))]);
        assert_eq!(b.decide(&h, None), Injection::Inject);
        b.inject(&mut h, "/").ok_or(()).unwrap_err();
        let want = base64::engine::general_purpose::STANDARD.encode("api:s3cr3t/+=");
        assert_eq!(h["authorization"], format!("Basic {want}").as_str());
        assert_eq!(b.decide(&headers(&[]), None), Injection::Unchanged);

        let b = binding("query = \"key\"\nplaceholder = \"PH-abcdefgh\"");
        let h = headers(&[]);
        assert_eq!(b.decide(&h, Some("a=1&key=PH-abcdefgh")), Injection::Inject);
        assert_eq!(b.decide(&h, Some("a=PH-abcdefgh")), Injection::Unchanged);
        let mut h2 = h.clone();
        assert_eq!(
            b.inject(&mut h2, "/v1/x?a=1&key=PH-abcdefgh&b=2")
                .as_deref(),
            Some("/v1/x?a=1&b=2&key=s3cr3t%2F%2B%3D")
        );
    }

    #[test]
    fn without_placeholder_always_injects_and_unloaded_fails_closed() {
        let b = binding("header = \"x-api-key\"");
        let mut h = headers(&[("x-api-key", "whatever")]);
        assert_eq!(b.decide(&h, None), Injection::Inject);
        b.inject(&mut h, "/").ok_or(()).unwrap_err();
        assert_eq!(h.get_all("x-api-key").iter().count(), 1);
        assert_eq!(h["x-api-key"], "s3cr3t/+=");
        let raw: CredentialBinding =
            toml::from_str("host = \"api.test\"\nheader = \"x-api-key\"\nsource = { env = \"X\" }")
                .unwrap();
        let c = CompiledBinding::new(&raw);
        assert_eq!(c.decide(&h, None), Injection::Unavailable);
        // Debug of a compiled binding never shows the secret.
        assert!(!format!("{b:?}").contains("s3cr3t"));
    }

    /// `resolve` loads what it can and names every binding it can't load; those stay without a
    /// secret, say why, and fail closed. A later resolve that loads the secret clears it.
    #[test]
    fn resolve_names_each_unloadable_binding_and_keeps_the_others() {
        let mut p = crate::testing::policy(
            r#"
allow_hosts = ["a.test", "b.test", "c.test"]
[[credentials]]
host = "a.test"
header = "x-k"
source = { env = "A" }
[[credentials]]
host = "b.test"
header = "x-k"
source = { env = "MISSING" }
[[credentials]]
host = "c.test"
header = "x-k"
source = { env = "C" }
placeholder = "ph-c-000001"
"#,
        );
        let load = |s: &SecretSource| match s {
            SecretSource::Env(n) if n == "A" => Ok(Secret::new(b"sa".to_vec())),
            SecretSource::Env(n) if n == "C" => Ok(Secret::new(b"x-ph-c-000001-x".to_vec())),
            SecretSource::Env(n) => Err(format!("{n} is not set")),
            _ => Err("?".to_owned()),
        };
        let failed = resolve(&mut p.credentials, "policies.p", load);
        let fields: Vec<&str> = failed.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "policies.p.credentials[1].source",
                "policies.p.credentials[2].placeholder"
            ]
        );
        assert_eq!(failed[0].message, "MISSING is not set");
        assert!(p.credentials[0].secret.is_some() && p.credentials[0].unavailable.is_none());
        assert!(p.credentials[1].secret.is_none());
        assert_eq!(p.credentials[1].unavailable.as_ref(), Some(&failed[0]));
        // The secret holding the placeholder is never kept.
        assert!(p.credentials[2].secret.is_none());
        let c = CompiledBinding::new(&p.credentials[1]);
        assert_eq!(
            c.unavailable(),
            Some("policies.p.credentials[1].source: MISSING is not set")
        );
        assert_eq!(c.decide(&headers(&[]), None), Injection::Unavailable);
        assert_eq!(CompiledBinding::new(&p.credentials[0]).unavailable(), None);
        // Loadable again: the binding serves, nothing is left of the failure.
        let failed = resolve(&mut p.credentials, "policies.p", |_: &SecretSource| {
            Ok::<_, String>(Secret::new(b"now".to_vec()))
        });
        assert!(failed.is_empty());
        assert!(
            p.credentials
                .iter()
                .all(|b| b.secret.is_some() && b.unavailable.is_none())
        );
    }
}
