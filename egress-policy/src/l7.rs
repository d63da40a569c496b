//! Request-level decisions (credential bindings + request rules), shared by the explicit proxy,
//! transparent interception, `explain` and the API.
//!
//! - [`L7Policy::intercepts`]: is this destination TLS-terminated? Only names with a credential
//!   binding or request rules on that port are; everything else stays a pass-through tunnel.
//! - [`L7Policy::check`]: one request (intercepted, or plain HTTP through the proxy). In order:
//!   1. any placeholder of the policy's bindings seen in the request line or a header value, when
//!      this request is not an intercepted one to that binding's host:port → refused
//!      (`placeholder-wrong-host`), never forwarded;
//!   2. request rules of the host:port: the path must be in normal form
//!      (`path-not-normalized`), then the first matching rule decides (`request-denied-by-rule`,
//!      `request-not-allowed`). Read-only `allow_hosts` entries
//!      ([`crate::model::Access::ReadOnly`]) add rules of their own after the policy's, on each
//!      of `allow_ports`: allow `GET`, `HEAD`, `OPTIONS` on every path and `POST` on
//!      `/**/git-upload-pack` (git's fetch); any other request to a name such an entry matches
//!      is `request-not-allowed` — but for writes to the policy's `repos` ([`crate::forge`]) —
//!      and so is a protocol switch (WebSocket) there;
//!   3. the binding of the host:port (intercepted only): secret not loaded →
//!      `interception-unavailable` (the agent refuses such a host:port before it dials, see
//!      [`L7Policy::unavailable`]; this is the same refusal for a request already inside);
//!      `require` without the placeholder → `credential-placeholder-missing`; otherwise the
//!      binding to apply.
use http::HeaderMap;

use super::Policy;
use super::credentials::{self, CompiledBinding, Injection};
use super::name::{Destination, HostName};
use super::rules::{self, RequestRule, RuleVerdict};
use super::scrub::{ScrubSecret, Scrubber};
use super::{DenyReason, Refused, Rule};

/// The request-level part of a policy, compiled.
#[derive(Debug, Clone, Default)]
pub struct L7Policy {
    bindings: Vec<CompiledBinding>,
    /// The policy's `request_rules`, then the rules of its read-only entries.
    rules: Vec<RequestRule>,
    /// The read-only entries' names, on which ports.
    read_only: Vec<(crate::matcher::HostPattern, Vec<u16>)>,
    /// Every loaded secret of the policy's bindings with its placeholder, for the responses of
    /// every intercepted host (an upstream may echo another binding's secret it was sent
    /// earlier); `None` without bindings.
    scrubber: Option<std::sync::Arc<Scrubber>>,
}

/// One request as the decision needs it.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    pub method: &'a str,
    /// The path, without the query.
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
}

/// What to do with a request that may go on.
#[derive(Debug, Clone, Copy)]
#[must_use]
pub enum Forward<'a> {
    /// Forward as it is.
    AsIs,
    /// Put this binding's secret in place, then forward.
    Inject(&'a CompiledBinding),
}

impl L7Policy {
    pub fn new(p: &Policy) -> L7Policy {
        let mut secrets: Vec<ScrubSecret> = Vec::new();
        for b in &p.credentials {
            let Some(secret) = b.secret.as_ref() else {
                continue;
            };
            let placeholder = b.placeholder.clone().unwrap_or_default();
            secrets.push(ScrubSecret {
                secret: secret.expose().to_vec(),
                replacement: placeholder.clone().into_bytes(),
                prefix: b.prefix.clone().unwrap_or_default().into_bytes(),
                basic_user: b.basic_user.clone().map(String::into_bytes),
            });
            // HTTP Basic: the header's base64 pair is a value of its own, which an upstream may
            // encode again (base64 of the whole `Authorization` value).
            if let Some(user) = &b.basic_user {
                use base64::Engine as _;
                let b64 = base64::engine::general_purpose::STANDARD;
                let pair = |pw: &[u8]| b64.encode([user.as_bytes(), b":", pw].concat());
                secrets.push(ScrubSecret {
                    secret: pair(secret.expose()).into_bytes(),
                    replacement: pair(placeholder.as_bytes()).into_bytes(),
                    prefix: b"Basic ".to_vec(),
                    basic_user: None,
                });
            }
        }
        let scrubber = Some(Scrubber::new(&secrets))
            .filter(|s| !s.is_empty())
            .map(std::sync::Arc::new);
        let read_only: Vec<_> = p
            .allow_hosts
            .iter()
            .filter(|h| h.access.is_read_only())
            .map(|h| (h.pattern.clone(), p.allow_ports.clone()))
            .collect();
        let mut rules = p.request_rules.clone();
        rules.extend(read_only.iter().flat_map(|(host, ports)| {
            read_only_rules(host, ports).chain(crate::forge::write_rules(host, ports, &p.repos))
        }));
        L7Policy {
            bindings: p.credentials.iter().map(CompiledBinding::new).collect(),
            rules,
            read_only,
            scrubber,
        }
    }

    /// What responses of this policy's intercepted hosts are scrubbed of (see [`super::scrub`]).
    pub fn scrubber(&self) -> Option<&std::sync::Arc<Scrubber>> {
        self.scrubber.as_ref()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty() && self.rules.is_empty()
    }

    /// TLS-terminate connections to this destination?
    pub fn intercepts(&self, dest: &Destination, port: u16) -> bool {
        let Destination::Name(host) = dest else {
            return false;
        };
        self.binding(host, port).is_some() || self.rules.iter().any(|r| r.applies_to(host, port))
    }

    /// Does a read-only entry match `host` on `port`?
    pub fn read_only(&self, host: &HostName, port: u16) -> bool {
        self.read_only
            .iter()
            .any(|(p, ports)| ports.contains(&port) && p.matches(host))
    }

    fn binding(&self, host: &HostName, port: u16) -> Option<&CompiledBinding> {
        self.bindings.iter().find(|b| b.applies_to(host, port))
    }

    /// Why connections to `dest:port` can't be served: its binding's secret is not loaded (a
    /// lenient load kept the binding, see [`credentials::resolve`]). Such a destination is
    /// refused whole — never relayed untouched, never sent without its secret.
    pub fn unavailable(&self, dest: &Destination, port: u16) -> Option<&str> {
        let Destination::Name(host) = dest else {
            return None;
        };
        self.binding(host, port)?.unavailable()
    }

    /// Placeholders the policy's bindings define (for `exec`'s environment: see `ca::command_env`).
    pub fn placeholders(&self) -> impl Iterator<Item = &str> {
        self.bindings
            .iter()
            .filter_map(CompiledBinding::placeholder)
    }

    /// Decide one request to `dest:port`; `intercepted`: it arrived inside a terminated TLS
    /// connection to exactly that destination (plain HTTP never gets a secret).
    pub fn check<'a>(
        &'a self,
        dest: &Destination,
        port: u16,
        intercepted: bool,
        req: &RequestView<'_>,
    ) -> Result<Forward<'a>, Refused> {
        let host = match dest {
            Destination::Name(n) => Some(n),
            Destination::Ip(_) => None,
        };
        let own = if intercepted {
            host.and_then(|h| self.binding(h, port))
        } else {
            None
        };
        for b in &self.bindings {
            let Some(ph) = b.placeholder() else { continue };
            if own.is_some_and(|o| std::ptr::eq(o, b)) {
                continue;
            }
            if carries(req, ph.as_bytes()) {
                return Err(Refused::because(DenyReason::PlaceholderWrongHost));
            }
        }
        if let Some(h) = host {
            self.check_rules(h, port, req.method, req.path)?;
            // A protocol switch writes as much as it likes: never on a read-only name.
            if req.headers.contains_key(http::header::UPGRADE) && self.read_only(h, port) {
                return Err(Refused::because(DenyReason::RequestNotAllowed));
            }
        }
        let Some(b) = own else {
            return Ok(Forward::AsIs);
        };
        match b.decide(req.headers, req.query) {
            Injection::Inject => Ok(Forward::Inject(b)),
            Injection::Unchanged => Ok(Forward::AsIs),
            Injection::MissingPlaceholder => Err(Refused::because(DenyReason::PlaceholderMissing)),
            Injection::Unavailable => Err(Refused::because(DenyReason::InterceptionUnavailable)),
        }
    }

    /// Step 2 of [`L7Policy::check`] alone: the request rules of `host:port` on a request's
    /// method and path (without the query). `Ok` when the host:port has no rules. `replay`
    /// decides recorded requests with it (their headers are not recorded).
    pub fn check_rules(
        &self,
        host: &HostName,
        port: u16,
        method: &str,
        path: &str,
    ) -> Result<(), Refused> {
        let mut of_host = self
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.applies_to(host, port))
            .peekable();
        if of_host.peek().is_none() {
            return Ok(());
        }
        let path = rules::normalize_path(path)
            .map_err(|_| Refused::because(DenyReason::PathNotNormalized))?;
        match rules::decide(of_host, method, &path) {
            RuleVerdict::Allowed => Ok(()),
            RuleVerdict::Denied(index) => Err(Refused {
                reason: DenyReason::RequestDeniedByRule,
                rule: Some(Rule::Request { index }),
            }),
            RuleVerdict::NotAllowed => Err(Refused::because(DenyReason::RequestNotAllowed)),
        }
    }
}

/// The rules of a read-only entry for `host` on `ports`: reads, and git's fetch.
fn read_only_rules(
    host: &crate::matcher::HostPattern,
    ports: &[u16],
) -> impl Iterator<Item = RequestRule> {
    // (A glob that did not parse would leave its rule out: fewer allows, never more.)
    let rule = |port: u16, methods: &[&str], path: &str| {
        Some(RequestRule {
            host: host.clone(),
            port,
            action: rules::RuleAction::Allow,
            methods: methods.iter().map(|m| (*m).to_owned()).collect(),
            path: rules::PathGlob::parse(path).ok()?,
        })
    };
    ports.iter().flat_map(move |&port| {
        [
            rule(port, &["GET", "HEAD", "OPTIONS"], "/**"),
            rule(port, &["POST"], "/**/git-upload-pack"),
        ]
        .into_iter()
        .flatten()
    })
}

/// Does the request line or any header value carry `needle` (raw, or percent-decoded in the
/// path/query)?
fn carries(req: &RequestView<'_>, needle: &[u8]) -> bool {
    let in_text = |s: &str| {
        credentials::contains(s.as_bytes(), needle)
            || (s.contains('%') || s.contains('+'))
                && credentials::percent_decode(s).is_some_and(|d| credentials::contains(&d, needle))
    };
    in_text(req.path)
        || req.query.is_some_and(in_text)
        || req
            .headers
            .iter()
            .any(|(_, v)| credentials::contains(v.as_bytes(), needle))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn l7() -> L7Policy {
        let mut p = crate::testing::policy(
            r#"
allow_hosts = ["api.test", "other.test", "*.rules.test"]
allow_ports = [443, 8443]
[[credentials]]
host = "api.test"
header = "x-api-key"
source = { env = "UNUSED" }
placeholder = "PH-0123456789"
require = true
[[request_rules]]
host = "api.test"
action = "allow"
methods = ["POST"]
path = "/v1/messages"
[[request_rules]]
host = "*.rules.test"
action = "deny"
path = "/admin/**"
"#,
        );
        p.credentials[0].secret = Some(crate::secret::Secret::new(b"real-secret".to_vec()));
        L7Policy::new(&p)
    }

    fn dest(s: &str) -> Destination {
        Destination::parse(s).unwrap()
    }

    fn view<'a>(method: &'a str, path: &'a str, h: &'a HeaderMap) -> RequestView<'a> {
        let (path, query) = match path.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path, None),
        };
        RequestView {
            method,
            path,
            query,
            headers: h,
        }
    }

    /// A read-only entry: reads and git fetch on every `allow_ports` port, under interception;
    /// writes, git push and protocol switches refused; the policy's own rules first; a full
    /// entry for the same name does not widen it; other names untouched.
    #[test]
    fn read_only_entries_take_reads_and_git_fetch_only() {
        let p = crate::testing::policy(
            r#"
allow_hosts = [{ host = "*.forge.test", access = "read-only" }, "api.forge.test", "free.test"]
allow_ports = [443, 80]
[[request_rules]]
host = "*.forge.test"
action = "deny"
path = "/secret/**"
"#,
        );
        let l = L7Policy::new(&p);
        let h = HeaderMap::new();
        let check = |host: &str, port: u16, method: &str, path: &str| {
            l.check(&dest(host), port, true, &view(method, path, &h))
                .map(|_| ())
                .map_err(|r| r.reason.as_str())
        };
        for port in [443, 80] {
            assert!(l.intercepts(&dest("git.forge.test"), port));
            for (method, path) in [
                ("GET", "/acme/api"),
                ("HEAD", "/"),
                ("OPTIONS", "/x"),
                ("GET", "/acme/api.git/info/refs"),
                ("POST", "/acme/api.git/git-upload-pack"),
                ("POST", "/acme/api/git-upload-pack"),
            ] {
                assert_eq!(
                    check("git.forge.test", port, method, path),
                    Ok(()),
                    "{method} {path}"
                );
            }
            for (method, path) in [
                ("POST", "/acme/api.git/git-receive-pack"),
                ("POST", "/repos/acme/api/issues"),
                ("PUT", "/x"),
                ("PATCH", "/x"),
                ("DELETE", "/x"),
                ("POST", "/git-upload-pack/../git-receive-pack"),
            ] {
                assert!(
                    check("git.forge.test", port, method, path).is_err(),
                    "{method} {path}"
                );
            }
            // A full entry for a name the read-only one matches does not widen it.
            assert_eq!(
                check("api.forge.test", port, "POST", "/graphql"),
                Err("request-not-allowed")
            );
        }
        assert_eq!(
            check("git.forge.test", 443, "POST", "/x"),
            Err("request-not-allowed")
        );
        // The policy's own rules come first.
        assert_eq!(
            check("git.forge.test", 443, "GET", "/secret/a"),
            Err("request-denied-by-rule")
        );
        // A protocol switch is a write channel.
        let mut ws = HeaderMap::new();
        ws.insert("upgrade", HeaderValue::from_static("websocket"));
        assert_eq!(
            l.check(
                &dest("git.forge.test"),
                443,
                true,
                &view("GET", "/socket", &ws)
            )
            .map(|_| ())
            .map_err(|r| r.reason.as_str()),
            Err("request-not-allowed")
        );
        // Other names and ports: not intercepted, anything goes.
        assert!(!l.intercepts(&dest("free.test"), 443));
        assert!(!l.intercepts(&dest("git.forge.test"), 22));
        assert_eq!(check("free.test", 443, "POST", "/x"), Ok(()));
        assert!(p.intercepts_some_host());
    }

    /// `repos`: writes to those repositories on the read-only names (git push, REST, uploads),
    /// nothing else written; reads everywhere as before.
    #[test]
    fn repos_open_writes_to_those_repositories_only() {
        let p = crate::testing::policy(
            r#"
presets = ["github"]
repos = ["acme/api", "tools/*"]
"#,
        );
        p.validate("policies.p").unwrap();
        // `repos` alone makes the forge preset read-only (no read_only_presets needed).
        assert!(
            p.allow_hosts
                .iter()
                .filter(|h| h.preset.is_some())
                .all(|h| h.access.is_read_only())
        );
        let l = L7Policy::new(&p);
        let h = HeaderMap::new();
        let check = |host: &str, method: &str, path: &str| {
            l.check(&dest(host), 443, true, &view(method, path, &h))
                .map(|_| ())
                .map_err(|r| r.reason.as_str())
        };
        for (host, method, path) in [
            ("github.com", "POST", "/acme/api.git/git-receive-pack"),
            ("github.com", "POST", "/acme/api/git-receive-pack"),
            ("github.com", "POST", "/tools/lint.git/git-receive-pack"),
            ("github.com", "POST", "/acme/api.git/info/lfs/objects/batch"),
            ("api.github.com", "POST", "/repos/acme/api/issues"),
            ("api.github.com", "PATCH", "/repos/tools/x/pulls/3"),
            (
                "uploads.github.com",
                "POST",
                "/repos/acme/api/releases/1/assets",
            ),
            ("api.github.com", "GET", "/repos/other/repo"),
            ("github.com", "POST", "/other/repo.git/git-upload-pack"),
        ] {
            assert_eq!(check(host, method, path), Ok(()), "{host} {method} {path}");
        }
        for (host, method, path) in [
            ("github.com", "POST", "/acme/other.git/git-receive-pack"),
            ("github.com", "POST", "/acme/api2.git/git-receive-pack"),
            ("github.com", "POST", "/acme/api.git.evil/git-receive-pack"),
            ("api.github.com", "POST", "/repos/acme/other/issues"),
            ("api.github.com", "DELETE", "/repos/evil/api"),
            ("api.github.com", "POST", "/gists"),
            ("api.github.com", "POST", "/user/repos"),
            ("api.github.com", "POST", "/graphql"),
            ("api.github.com", "POST", "/repos/acme/api/../other/issues"),
            ("api.github.com", "POST", "/repos/acme%2fapi/issues"),
        ] {
            assert!(check(host, method, path).is_err(), "{host} {method} {path}");
        }
        let bad =
            toml::from_str::<crate::Policy>("allow_hosts = [\"a.test\"]\nrepos = [\"acme/api\"]")
                .unwrap()
                .validate("policies.p")
                .unwrap_err();
        assert_eq!(bad.field, "policies.p.repos");
        assert!(bad.message.contains("read-only"), "{bad}");
        let e = toml::from_str::<crate::Policy>("repos = [\"*/api\"]").unwrap_err();
        assert!(e.message().contains("owner can't be a wildcard"), "{e}");
    }

    /// A binding without its secret makes its host:port unavailable (and only that one); a
    /// request inside is refused as `interception-unavailable`, never forwarded.
    #[test]
    fn a_binding_without_its_secret_is_unavailable_and_refuses() {
        let mut p = crate::testing::policy(
            r#"
allow_hosts = ["api.test", "other.test"]
[[credentials]]
host = "api.test"
header = "x-api-key"
source = { file = "/nonexistent" }
"#,
        );
        p.credentials[0].unavailable = Some(crate::model::verr(
            "policies.p.credentials[0].source",
            "can't read secret file /nonexistent: entity not found",
        ));
        let l = L7Policy::new(&p);
        assert!(l.intercepts(&dest("api.test"), 443));
        assert_eq!(
            l.unavailable(&dest("api.test"), 443),
            Some(
                "policies.p.credentials[0].source: can't read secret file /nonexistent: entity not found"
            )
        );
        assert_eq!(l.unavailable(&dest("api.test"), 8443), None);
        assert_eq!(l.unavailable(&dest("other.test"), 443), None);
        assert_eq!(l7().unavailable(&dest("api.test"), 443), None);
        let h = HeaderMap::new();
        assert!(matches!(
            l.check(&dest("api.test"), 443, true, &view("GET", "/", &h)),
            Err(Refused {
                reason: DenyReason::InterceptionUnavailable,
                rule: None
            })
        ));
    }

    #[test]
    fn interception_only_for_bound_or_ruled_hosts() {
        let l = l7();
        assert!(l.intercepts(&dest("api.test"), 443));
        assert!(!l.intercepts(&dest("api.test"), 8443));
        assert!(l.intercepts(&dest("x.rules.test"), 443));
        assert!(!l.intercepts(&dest("rules.test"), 443));
        assert!(!l.intercepts(&dest("other.test"), 443));
        assert!(!l.intercepts(&dest("1.2.3.4"), 443));
    }

    #[test]
    fn placeholder_goes_only_to_its_host() {
        let l = l7();
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("PH-0123456789"));
        let v = view("POST", "/v1/messages", &h);
        assert!(matches!(
            l.check(&dest("api.test"), 443, true, &v),
            Ok(Forward::Inject(_))
        ));
        // Same host over plain HTTP, another port, another host: refused.
        for (d, port, i) in [
            ("api.test", 443, false),
            ("api.test", 8443, true),
            ("other.test", 443, true),
            ("other.test", 443, false),
        ] {
            assert_eq!(
                l.check(&dest(d), port, i, &v).err(),
                Some(Refused::because(DenyReason::PlaceholderWrongHost)),
                "{d}:{port} {i}"
            );
        }
        // In the path or query, also percent-encoded.
        let empty = HeaderMap::new();
        for p in [
            "/x?k=PH-0123456789",
            "/PH-0123456789",
            "/x?k=PH%2D0123456789",
        ] {
            assert_eq!(
                l.check(&dest("other.test"), 443, true, &view("GET", p, &empty))
                    .err(),
                Some(Refused::because(DenyReason::PlaceholderWrongHost)),
                "{p}"
            );
        }
        assert!(matches!(
            l.check(&dest("other.test"), 443, true, &view("GET", "/x", &empty)),
            Ok(Forward::AsIs)
        ));
    }

    #[test]
    fn rules_and_require() {
        let l = l7();
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("PH-0123456789"));
        let d = dest("api.test");
        assert_eq!(
            l.check(&d, 443, true, &view("GET", "/v1/messages", &h))
                .err(),
            Some(Refused::because(DenyReason::RequestNotAllowed))
        );
        assert_eq!(
            l.check(&d, 443, true, &view("POST", "/v1/x/../messages", &h))
                .err(),
            Some(Refused::because(DenyReason::PathNotNormalized))
        );
        let empty = HeaderMap::new();
        assert_eq!(
            l.check(&d, 443, true, &view("POST", "/v1/messages", &empty))
                .err(),
            Some(Refused::because(DenyReason::PlaceholderMissing))
        );
        let r = dest("a.rules.test");
        assert_eq!(
            l.check(&r, 443, true, &view("GET", "/admin/keys", &empty))
                .err(),
            Some(Refused {
                reason: DenyReason::RequestDeniedByRule,
                rule: Some(Rule::Request { index: 1 })
            })
        );
        assert!(matches!(
            l.check(&r, 443, true, &view("GET", "/public?x=1", &empty)),
            Ok(Forward::AsIs)
        ));
    }

    /// The rules alone (what `replay` has of a recorded request: no headers) decide as `check`
    /// does, and a host:port without rules passes.
    #[test]
    fn the_rules_alone_decide_as_check_does() {
        let l = l7();
        let empty = HeaderMap::new();
        for (host, method, path) in [
            ("a.rules.test", "GET", "/admin/keys"),
            ("a.rules.test", "GET", "/public"),
            ("a.rules.test", "GET", "/x/../admin"),
            ("other.test", "DELETE", "/anything"),
        ] {
            let Destination::Name(name) = dest(host) else {
                panic!("a name")
            };
            let by_check = l
                .check(&dest(host), 443, false, &view(method, path, &empty))
                .map(|_| ());
            assert_eq!(
                l.check_rules(&name, 443, method, path),
                by_check,
                "{host} {path}"
            );
        }
        let Destination::Name(api) = dest("api.test") else {
            panic!("a name")
        };
        assert_eq!(
            l.check_rules(&api, 443, "GET", "/v1/messages"),
            Err(Refused::because(DenyReason::RequestNotAllowed))
        );
        assert_eq!(l.check_rules(&api, 8443, "GET", "/v1/messages"), Ok(()));
    }
}
