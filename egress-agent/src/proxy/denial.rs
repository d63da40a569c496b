//! What a refused HTTP client is told (issue #41: denials an agent can read). One description of
//! a refusal, written by [`Shared::act`](super::Shared::act) when it records the denial, answered
//! on every HTTP path — explicit proxy (`CONNECT` and proxied requests), transparent HTTP,
//! requests on an intercepted connection — as a `403` with `X-Egress-Deny: <reason>` and a short
//! body: text for people, JSON when the client's `Accept` asks for it.
//!
//! The body names the policy, the destination, the reason code (stable: see docs/policy.md
//! "Reason codes"), the rule that refused when there is one, the run when the workload has one,
//! and how to get it changed. Nothing the client sent is echoed: the destination is the
//! normalised name (a name that didn't parse is left out) and port; the rest is the operator's
//! configuration and the workload's labels.
use bytes::Bytes;
use egress_policy::DenyReason;
use egress_policy::name::HostName;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{Either, Full};
use serde::Serialize;

/// Context label naming a workload's run (`egress.run`).
pub(crate) const RUN_LABEL: &str = "run";

/// One refusal, as the client is told it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Denial {
    /// Always `egress-denied`: tells the refusal apart from an upstream's own `403`.
    error: &'static str,
    #[serde(serialize_with = "reason_code")]
    pub(crate) reason: DenyReason,
    pub(crate) policy: String,
    host: Option<String>,
    port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    run: Option<String>,
    help: String,
}

fn reason_code<S: serde::Serializer>(r: &DenyReason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

impl Denial {
    /// `host`: kept only when it is a normalised name (never raw client bytes).
    pub(crate) fn new(
        reason: DenyReason,
        policy: &str,
        host: Option<&str>,
        port: u16,
        rule: Option<String>,
        run: Option<&str>,
    ) -> Denial {
        let host = host
            .filter(|h| HostName::parse(h).is_ok_and(|n| n.as_str() == *h))
            .map(str::to_owned);
        let target = match (&host, port) {
            (Some(h), p) if p != 0 => format!(" {h}:{p}"),
            (Some(h), _) => format!(" {h}"),
            (None, _) => String::new(),
        };
        // The workload's own host is never proxied: its services open directly or not at all.
        let local = if host.as_deref() == Some(egress_policy::model::HOST_SERVICES_NAME) {
            "host.docker.internal is this workload's own host, which the proxy never dials: a \
             policy's allow_host_services opens its ports directly, so leave the proxy out \
             (add host.docker.internal to NO_PROXY). "
        } else {
            ""
        };
        let help = format!(
            "{local}This is the network policy of this workload, not a network failure: retrying, \
             another address or another proxy is refused the same way. To ask for access: \
             POST http://egress.internal/v1/requests {{\"host\", \"port\", \"reason\"}} \
             through this proxy, then GET the request for the operator's answer. The operator \
             sees why with: egress-agent explain --policy {policy}{target}"
        );
        Denial {
            error: "egress-denied",
            reason,
            policy: policy.to_owned(),
            host,
            port,
            rule,
            run: run.map(str::to_owned),
            help,
        }
    }

    /// The text body. Its first line is what clients and scripts have always seen.
    pub(crate) fn text(&self) -> String {
        let mut out = format!(
            "egress-agent: denied by policy {}: {}\n",
            self.policy,
            self.reason.as_str()
        );
        if let Some(h) = &self.host {
            out.push_str(&format!("destination: {h}:{}\n", self.port));
        }
        if let Some(r) = &self.rule {
            out.push_str(&format!("rule: {r}\n"));
        }
        if let Some(r) = &self.run {
            out.push_str(&format!("run: {r}\n"));
        }
        out.push_str(&self.help);
        out.push('\n');
        out
    }

    /// One line, for where only a short text fits (a DNS answer's Extended DNS Error):
    /// `egress-agent: denied by policy ci: port-not-allowed (allow_hosts api.github.com)`.
    pub(crate) fn summary(&self) -> String {
        let rule = self
            .rule
            .as_ref()
            .map_or_else(String::new, |r| format!(" ({r})"));
        format!(
            "egress-agent: denied by policy {}: {}{rule}",
            self.policy,
            self.reason.as_str()
        )
    }

    /// The JSON body (one object, newline-terminated).
    pub(crate) fn json(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| {
            format!(
                "{{\"error\":\"egress-denied\",\"reason\":\"{}\"}}",
                self.reason.as_str()
            )
        });
        s.push('\n');
        s
    }
}

/// Does an `Accept` header value ask for JSON (`application/json` or a `+json` type, not
/// refused with `q=0`)? Anything else gets text.
pub(crate) fn wants_json(accept: Option<&[u8]>) -> bool {
    let Some(v) = accept.and_then(|a| std::str::from_utf8(a).ok()) else {
        return false;
    };
    v.split(',').any(|item| {
        let mut parts = item.split(';').map(str::trim);
        let ty = parts.next().unwrap_or("").to_ascii_lowercase();
        let json =
            ty == "application/json" || (ty.starts_with("application/") && ty.ends_with("+json"));
        let refused = parts.any(|p| {
            p.strip_prefix("q=")
                .is_some_and(|q| q.parse::<f32>().is_ok_and(|q| q == 0.0))
        });
        json && !refused
    })
}

/// Does a raw HTTP/1 request head (the bytes a transparent or `CONNECT` connection sent) ask
/// for JSON in its `Accept` ([`wants_json`])?
pub(crate) fn head_wants_json(head: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    if req.parse(head).is_err() {
        return false;
    }
    let accept = req
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("accept"));
    wants_json(accept.map(|h| h.value))
}

/// A `403` for `d`: `X-Egress-Deny`, the text body, and `d` itself in the response's
/// extensions (never sent), so [`negotiated`] can answer in JSON instead.
pub(crate) fn forbidden<L>(d: Denial) -> Response<Either<L, Full<Bytes>>> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(d.text()))));
    *resp.status_mut() = StatusCode::FORBIDDEN;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert("x-egress-deny", HeaderValue::from_static(d.reason.as_str()));
    resp.extensions_mut().insert(d);
    resp
}

/// `resp` as the client asked for it: a denial's body in JSON when `accept` wants JSON; any
/// other response unchanged.
pub(crate) fn negotiated<L>(
    resp: Response<Either<L, Full<Bytes>>>,
    accept: Option<&HeaderValue>,
) -> Response<Either<L, Full<Bytes>>> {
    if !wants_json(accept.map(HeaderValue::as_bytes)) {
        return resp;
    }
    let Some(d) = resp.extensions().get::<Denial>().cloned() else {
        return resp;
    };
    let (mut parts, _) = resp.into_parts();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Either::Right(Full::new(Bytes::from(d.json()))))
}

/// A raw HTTP/1.1 `403` for `d` (the paths that answer before hyper: a `CONNECT`, a transparent
/// connection's first request), in JSON when `json` ([`head_wants_json`]); the connection
/// closes.
pub(crate) fn forbidden_bytes(d: &Denial, json: bool) -> Vec<u8> {
    let (ty, body) = if json {
        ("application/json", d.json())
    } else {
        ("text/plain; charset=utf-8", d.text())
    };
    format!(
        "HTTP/1.1 403 Forbidden\r\nX-Egress-Deny: {}\r\nContent-Type: {ty}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        d.reason.as_str(),
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn the_body_names_the_refusal_and_echoes_nothing_raw() {
        let d = Denial::new(
            DenyReason::PortNotAllowed,
            "ci",
            Some("api.github.com"),
            8443,
            Some("allow_hosts api.github.com".into()),
            Some("77"),
        );
        let t = d.text();
        assert!(
            t.starts_with("egress-agent: denied by policy ci: port-not-allowed\n"),
            "{t}"
        );
        assert!(t.contains("destination: api.github.com:8443\n"), "{t}");
        assert!(t.contains("rule: allow_hosts api.github.com\n"), "{t}");
        assert!(t.contains("run: 77\n"), "{t}");
        assert!(
            t.contains("egress-agent explain --policy ci api.github.com:8443"),
            "{t}"
        );
        let j: serde_json::Value = serde_json::from_str(&d.json()).unwrap();
        assert_eq!(j["error"], "egress-denied");
        assert_eq!(j["reason"], "port-not-allowed");
        assert_eq!(j["policy"], "ci");
        assert_eq!(j["host"], "api.github.com");
        assert_eq!(j["port"], 8443);
        assert_eq!(j["rule"], "allow_hosts api.github.com");
        assert_eq!(j["run"], "77");
        // A name that isn't a normalised host name (raw client bytes) is never echoed.
        for raw in ["EVIL.test", "a\r\nx-injected: 1", "<script>", "a b"] {
            let d = Denial::new(DenyReason::InvalidHost, "ci", Some(raw), 80, None, None);
            assert!(!d.text().contains(raw), "{raw:?}");
            assert!(!d.json().contains(raw), "{raw:?}");
            let j: serde_json::Value = serde_json::from_str(&d.json()).unwrap();
            assert_eq!(j["host"], serde_json::Value::Null);
            assert!(j.get("rule").is_none());
        }
    }

    #[test]
    fn json_only_when_asked() {
        for (accept, json) in [
            (None, false),
            (Some("*/*"), false),
            (Some("text/html,application/xhtml+xml"), false),
            (Some("application/json"), true),
            (Some("text/plain;q=0.5, Application/JSON"), true),
            (Some("application/problem+json"), true),
            (Some("application/json;q=0"), false),
            (Some("application/jsonx"), false),
        ] {
            assert_eq!(wants_json(accept.map(str::as_bytes)), json, "{accept:?}");
        }
        let head = b"GET / HTTP/1.1\r\nHost: a.test\r\nAccept: application/json\r\n\r\n";
        assert!(head_wants_json(head));
        assert!(!head_wants_json(
            b"GET / HTTP/1.1\r\nHost: a.test\r\nAccept: text/html\r\n\r\n"
        ));
        assert!(!head_wants_json(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(!head_wants_json(b"\x16\x03\x01garbage"));
    }

    #[test]
    fn the_hosts_own_name_says_to_leave_the_proxy_out() {
        let d = Denial::new(
            DenyReason::HostNotAllowed,
            "local",
            Some("host.docker.internal"),
            11434,
            None,
            None,
        );
        assert!(
            d.text().contains("add host.docker.internal to NO_PROXY"),
            "{}",
            d.text()
        );
        let other = Denial::new(
            DenyReason::HostNotAllowed,
            "local",
            Some("a.test"),
            443,
            None,
            None,
        );
        assert!(!other.text().contains("NO_PROXY"), "{}", other.text());
    }
}
