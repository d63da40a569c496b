//! Request-head parsing (httparse) and target extraction, shared by the CONNECT fast path and the
//! plain-HTTP path. Pure functions over bytes: this is what `fuzz/` exercises.
//!
//! Rules:
//! - `CONNECT host:port` (authority-form, port required).
//! - Other methods need absolute-form `http://host[:port]/...`; origin-form, asterisk-form and
//!   `https://` targets are refused (HTTPS goes through CONNECT).
//! - Userinfo (`http://github.com@evil.com/`) is refused outright.
//! - A Host header must name the same host and port as the absolute URI (after normalisation), and
//!   appear at most once. CONNECT's Host header, if any, must match too.
//! - CR/LF/NUL in the request line or header values are refused by httparse.
use std::str;

use egress_policy::DenyReason;
use egress_policy::name::Destination;

/// Headers we accept in one request head.
pub const MAX_HEADERS: usize = 100;

/// A checked destination: host (normalised name or IP literal) and port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub dest: Destination,
    pub port: u16,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.dest, self.port)
    }
}

/// Why a request head was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// 400 with this short reason.
    #[error("bad request: {0}")]
    Malformed(&'static str),
    /// 431: the head exceeds the configured bound.
    #[error("request head too large")]
    TooLarge,
    /// 403: a policy-relevant refusal (numeric IP form, userinfo, Host mismatch).
    #[error("denied: {0}")]
    Denied(DenyReason),
}

/// What the first request on a connection is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// `CONNECT`: open a tunnel.
    Connect(Target),
    /// Absolute-form plain HTTP (the HTTP path re-parses and re-checks every request).
    Http { method: String, target: Target },
}

/// Outcome of feeding the bytes read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// Need more bytes.
    Partial,
    /// A complete head of `len` bytes.
    Complete { len: usize, request: Request },
}

/// Parse one request head from `buf` (which holds at most the configured head bound).
pub fn parse_head(buf: &[u8]) -> Result<Head, RequestError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let status = match req.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(RequestError::TooLarge),
        Err(_) => return Err(RequestError::Malformed("malformed request head")),
    };
    let len = match status {
        httparse::Status::Partial => return Ok(Head::Partial),
        httparse::Status::Complete(len) => len,
    };
    let method = req.method.ok_or(RequestError::Malformed("no method"))?;
    let path = req
        .path
        .ok_or(RequestError::Malformed("no request target"))?;
    if req.version != Some(1) && req.version != Some(0) {
        return Err(RequestError::Malformed("unsupported HTTP version"));
    }
    let host_header = single_host_header(req.headers.iter().map(|h| (h.name, h.value)))?;
    let request = if method == "CONNECT" {
        let target = connect_target(path)?;
        if let Some(h) = host_header {
            check_host_header(h, &target, None)?;
        }
        Request::Connect(target)
    } else {
        let target = absolute_target(path)?;
        if let Some(h) = host_header {
            check_host_header(h, &target, Some(80))?;
        }
        Request::Http {
            method: method.to_owned(),
            target,
        }
    };
    Ok(Head::Complete { len, request })
}

/// The single Host header value, if any; two or more Host headers are refused.
pub fn single_host_header<'a>(
    headers: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> Result<Option<&'a [u8]>, RequestError> {
    let mut found = None;
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("host") {
            if found.is_some() {
                return Err(RequestError::Malformed("more than one Host header"));
            }
            found = Some(value);
        }
    }
    Ok(found)
}

/// CONNECT's authority-form target: `host:port`, port required.
pub fn connect_target(authority: &str) -> Result<Target, RequestError> {
    split_authority(authority, None)
}

/// Absolute-form `http://authority/...` → target (default port 80).
pub fn absolute_target(uri: &str) -> Result<Target, RequestError> {
    let (scheme, rest) = uri
        .split_once("://")
        .ok_or(RequestError::Malformed("absolute-form URI required"))?;
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(RequestError::Malformed(
            "only http:// URIs (use CONNECT for https)",
        ));
    }
    // The authority ends at the first '/', '?' or '#'.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    // Let the `http` crate confirm the whole URI is well-formed.
    if uri.parse::<http::Uri>().is_err() {
        return Err(RequestError::Malformed("invalid URI"));
    }
    split_authority(authority, Some(80))
}

/// Host header value vs the request's target: same host and port after normalisation.
pub fn check_host_header(
    value: &[u8],
    target: &Target,
    default_port: Option<u16>,
) -> Result<(), RequestError> {
    let s =
        str::from_utf8(value).map_err(|_| RequestError::Malformed("Host header is not UTF-8"))?;
    let s = s.trim_matches(|c| c == ' ' || c == '\t');
    let host = match split_authority(s, default_port.or(Some(target.port))) {
        Ok(t) => t,
        Err(RequestError::Denied(_))
        | Err(RequestError::Malformed(_))
        | Err(RequestError::TooLarge) => {
            return Err(RequestError::Denied(DenyReason::HostHeaderMismatch));
        }
    };
    if host != *target {
        return Err(RequestError::Denied(DenyReason::HostHeaderMismatch));
    }
    Ok(())
}

/// `host[:port]` / `[v6][:port]` → target. `default_port: None` means the port is required.
pub fn split_authority(authority: &str, default_port: Option<u16>) -> Result<Target, RequestError> {
    if authority.contains('@') {
        return Err(RequestError::Denied(DenyReason::UserinfoNotAllowed));
    }
    let (host, port) = if authority.starts_with('[') {
        let close = authority
            .find(']')
            .ok_or(RequestError::Malformed("unclosed IPv6 literal"))?;
        let (host, rest) = authority.split_at(close + 1);
        match rest {
            "" => (host, None),
            _ => match rest.strip_prefix(':') {
                Some(p) => (host, Some(p)),
                None => return Err(RequestError::Malformed("garbage after IPv6 literal")),
            },
        }
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => parse_port(p)?,
        None => default_port.ok_or(RequestError::Malformed("port required"))?,
    };
    let dest = Destination::parse(host).map_err(|e| match e {
        egress_policy::name::NameError::NumericIpForm => {
            RequestError::Denied(DenyReason::NumericIpForm)
        }
        _ => RequestError::Malformed("invalid host"),
    })?;
    Ok(Target { dest, port })
}

fn parse_port(p: &str) -> Result<u16, RequestError> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RequestError::Malformed("invalid port"));
    }
    match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(RequestError::Malformed("invalid port")),
        Ok(port) => Ok(port),
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn complete(s: &str) -> Result<Request, RequestError> {
        match parse_head(s.as_bytes())? {
            Head::Complete { len, request } => {
                assert_eq!(len, s.len());
                Ok(request)
            }
            Head::Partial => panic!("partial: {s:?}"),
        }
    }

    fn name_target(host: &str, port: u16) -> Target {
        Target {
            dest: Destination::parse(host).unwrap(),
            port,
        }
    }

    #[test]
    fn connect() {
        assert_eq!(
            complete("CONNECT GitHub.com.:443 HTTP/1.1\r\nHost: github.com:443\r\n\r\n"),
            Ok(Request::Connect(name_target("github.com", 443)))
        );
        assert_eq!(
            complete("CONNECT [::1]:8443 HTTP/1.1\r\n\r\n"),
            Ok(Request::Connect(Target {
                dest: Destination::Ip("::1".parse().unwrap()),
                port: 8443
            }))
        );
        assert_eq!(
            complete("CONNECT github.com HTTP/1.1\r\n\r\n"),
            Err(RequestError::Malformed("port required"))
        );
        assert_eq!(
            complete("CONNECT github.com:0 HTTP/1.1\r\n\r\n"),
            Err(RequestError::Malformed("invalid port"))
        );
        assert_eq!(
            complete("CONNECT github.com:+443 HTTP/1.1\r\n\r\n"),
            Err(RequestError::Malformed("invalid port"))
        );
        assert_eq!(
            complete("CONNECT github.com:65536 HTTP/1.1\r\n\r\n"),
            Err(RequestError::Malformed("invalid port"))
        );
        assert_eq!(
            complete("CONNECT github.com@evil.com:443 HTTP/1.1\r\n\r\n"),
            Err(RequestError::Denied(DenyReason::UserinfoNotAllowed))
        );
        assert_eq!(
            complete("CONNECT 2130706433:443 HTTP/1.1\r\n\r\n"),
            Err(RequestError::Denied(DenyReason::NumericIpForm))
        );
        assert_eq!(
            complete("CONNECT github.com:443 HTTP/1.1\r\nHost: evil.com:443\r\n\r\n"),
            Err(RequestError::Denied(DenyReason::HostHeaderMismatch))
        );
    }

    #[test]
    fn absolute_form() {
        assert_eq!(
            complete("GET http://Example.COM/a?b=c HTTP/1.1\r\nHost: example.com\r\n\r\n"),
            Ok(Request::Http {
                method: "GET".into(),
                target: name_target("example.com", 80)
            })
        );
        assert_eq!(
            complete("GET http://example.com:8080/ HTTP/1.1\r\nHost: example.com:8080\r\n\r\n"),
            Ok(Request::Http {
                method: "GET".into(),
                target: name_target("example.com", 8080)
            })
        );
        // Host without port means 80, which disagrees with :8080.
        assert_eq!(
            complete("GET http://example.com:8080/ HTTP/1.1\r\nHost: example.com\r\n\r\n"),
            Err(RequestError::Denied(DenyReason::HostHeaderMismatch))
        );
        assert_eq!(
            complete("GET http://allowed.example/ HTTP/1.1\r\nHost: evil.example\r\n\r\n"),
            Err(RequestError::Denied(DenyReason::HostHeaderMismatch))
        );
        assert_eq!(
            complete("GET http://github.com@evil.com/ HTTP/1.1\r\n\r\n"),
            Err(RequestError::Denied(DenyReason::UserinfoNotAllowed))
        );
        assert_eq!(
            complete(
                "GET http://a.example/ HTTP/1.1\r\nHost: a.example\r\nhost: b.example\r\n\r\n"
            ),
            Err(RequestError::Malformed("more than one Host header"))
        );
        assert!(matches!(
            complete("GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"),
            Err(RequestError::Malformed(_))
        ));
        assert!(matches!(
            complete("GET https://example.com/ HTTP/1.1\r\n\r\n"),
            Err(RequestError::Malformed(_))
        ));
        assert!(matches!(
            complete("OPTIONS * HTTP/1.1\r\n\r\n"),
            Err(RequestError::Malformed(_))
        ));
    }

    #[test]
    fn crlf_injection_and_garbage_are_refused() {
        for bad in [
            "GET http://a.example/\r\nHost: b HTTP/1.1\r\n\r\n",
            "GET http://a.example/ HTTP/1.1\r\nX: a\rHost: evil\r\n\r\n",
            "GET http://a.example/ HTTP/1.1\r\nX: a\0b\r\n\r\n",
            "GET http://a example/ HTTP/1.1\r\n\r\n",
            "\x16\x03\x01\x02\x00\x01\x00",
            "GET http://a.example/ HTTP/2.0\r\n\r\n",
        ] {
            assert!(parse_head(bad.as_bytes()).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn partial_heads() {
        assert_eq!(
            parse_head(b"CONNECT github.com:443 HTTP/1.1\r\nHost: git"),
            Ok(Head::Partial)
        );
        assert_eq!(parse_head(b""), Ok(Head::Partial));
    }

    #[test]
    fn too_many_headers() {
        let mut s = String::from("GET http://a.example/ HTTP/1.1\r\n");
        for i in 0..=MAX_HEADERS {
            s.push_str(&format!("X-{i}: y\r\n"));
        }
        s.push_str("\r\n");
        assert_eq!(parse_head(s.as_bytes()), Err(RequestError::TooLarge));
    }
}
