//! Request framing the proxy refuses before any rule, on every path that parses requests (plain
//! HTTP, transparent HTTP, intercepted TLS). hyper parsed the request once and the proxy re-frames
//! it to the upstream (hop-by-hop headers dropped, the body's length set by hyper), so the upstream
//! never sees the client's framing; what is refused here is what a second parser downstream might
//! still read differently (RFC 9112 §6.3, the CL.TE / TE.CL / H2.CL families):
//! - `Content-Length` together with `Transfer-Encoding`;
//! - more than one `Content-Length` (hyper folds equal duplicates; an upstream might not);
//! - a header name that becomes a framing or hop-by-hop name once `_` is read as `-`
//!   (`Transfer_Encoding`, `Content_Length`: CGI-style servers and some frameworks merge them).
//!
//! A refusal closes the connection (HTTP/1.1 `Connection: close`): no request pipelined after a
//! refused one reaches the upstream.
use http::HeaderMap;
use http::header;

/// Names whose `_` spelling is refused.
const GUARDED: [&str; 9] = [
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
];

/// Why a request's framing is refused (the `X-Egress-Error` code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum FramingError {
    LengthAndChunked,
    DuplicateLength,
    ObfuscatedHeader,
}

impl FramingError {
    pub fn as_str(self) -> &'static str {
        match self {
            FramingError::LengthAndChunked => "content-length-with-transfer-encoding",
            FramingError::DuplicateLength => "duplicate-content-length",
            FramingError::ObfuscatedHeader => "obfuscated-header-name",
        }
    }
}

/// Check one request's headers (as hyper parsed them).
pub fn check(headers: &HeaderMap) -> Result<(), FramingError> {
    let lengths = headers.get_all(header::CONTENT_LENGTH).iter().count();
    if lengths > 0 && headers.contains_key(header::TRANSFER_ENCODING) {
        return Err(FramingError::LengthAndChunked);
    }
    if lengths > 1
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes().contains(&b','))
    {
        return Err(FramingError::DuplicateLength);
    }
    for name in headers.keys() {
        let n = name.as_str();
        if n.contains('_') {
            let dashed = n.replace('_', "-");
            if GUARDED.contains(&dashed.as_str()) {
                return Err(FramingError::ObfuscatedHeader);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn h(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(*k, HeaderValue::from_static(v));
        }
        m
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        assert_eq!(check(&h(&[("content-length", "5")])), Ok(()));
        assert_eq!(check(&h(&[("transfer-encoding", "chunked")])), Ok(()));
        assert_eq!(check(&h(&[("x_custom", "1"), ("accept", "*/*")])), Ok(()));
        for (pairs, want) in [
            (
                &[("content-length", "5"), ("transfer-encoding", "chunked")][..],
                FramingError::LengthAndChunked,
            ),
            (
                &[("content-length", "5"), ("content-length", "5")],
                FramingError::DuplicateLength,
            ),
            (&[("content-length", "5, 6")], FramingError::DuplicateLength),
            (
                &[("transfer_encoding", "chunked")],
                FramingError::ObfuscatedHeader,
            ),
            (&[("content_length", "0")], FramingError::ObfuscatedHeader),
            (&[("proxy_connection", "x")], FramingError::ObfuscatedHeader),
        ] {
            assert_eq!(check(&h(pairs)), Err(want), "{pairs:?}");
        }
    }
}
