//! The first bytes of a transparently intercepted connection and the name they carry: a TLS
//! ClientHello read with rustls' [`Acceptor`] **without terminating TLS** (the SNI is taken, the
//! bytes are replayed to the upstream untouched), or an HTTP/1 request head (httparse) and its
//! Host header. Pure over bytes: `fuzz/fuzz_targets/client_hello.rs` drives it.
//!
//! Rules:
//! - First byte `0x16` (TLS handshake record): the ClientHello may span several records and
//!   segments; rustls buffers and joins them. No SNI, or an IP address as SNI (rustls drops those,
//!   RFC 6066) → `tls-no-sni`; a hello rustls refuses (malformed, SSLv2, no signature algorithms)
//!   → `tls-invalid-hello`. **ECH**: the ClientHello the proxy sees is the outer one, whose SNI is
//!   the provider's public name (ECH's `public_name`); the decision is on that name, like any SNI.
//! - First byte an ASCII letter: an HTTP/1.x request head. Exactly one Host header is required
//!   (`http-no-host` without, `host-header-mismatch` with two, or with a port other than the one
//!   the client connected to, or an absolute-form target naming another authority). `CONNECT`
//!   is not a transparent request (`unknown-protocol`).
//! - Anything else, or no decision within [`MAX_SNIFF_BYTES`] → `unknown-protocol` (TLS:
//!   `tls-invalid-hello`).
use rustls::server::Acceptor;

use super::request::{self, MAX_HEADERS, Target};
use egress_policy::DenyReason;
use egress_policy::name::Destination;

/// Most bytes read before a decision (a post-quantum ClientHello is ~2 KiB; browsers pad to 512).
pub const MAX_SNIFF_BYTES: usize = 32 * 1024;

/// TLS record content type `handshake`.
const TLS_HANDSHAKE: u8 = 0x16;

/// A fatal `access_denied` alert (RFC 8446 §6: record type 21, legacy version 3.3, length 2,
/// level fatal, description 49): how a transparent TLS client learns of a refusal.
pub const TLS_ACCESS_DENIED: &[u8] = &[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49];

/// What the connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tls,
    Http,
}

impl Kind {
    /// Protocol name in denial events.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Tls => "tls",
            Kind::Http => "http",
        }
    }
}

/// The outcome of the bytes so far.
#[derive(Debug, PartialEq, Eq)]
#[must_use]
pub enum Sniffed {
    /// Read more.
    More,
    /// The name (SNI or Host), normalised, on the connection's original port.
    Target { kind: Kind, target: Target },
    /// Refused: the connection can't be decided on. `host`: the raw name when there was one that
    /// didn't parse (for the event, cut to 253 bytes); `alert`: bytes to send back (rustls' own
    /// alert for a malformed hello).
    Refused {
        kind: Option<Kind>,
        reason: DenyReason,
        host: Option<String>,
        alert: Vec<u8>,
    },
}

enum State {
    Start,
    Tls(Box<Acceptor>),
    Http,
    Done,
}

/// Feed it the connection's bytes as they arrive.
pub struct Sniffer {
    state: State,
    /// The port the client connected to (from the kernel's original destination).
    port: u16,
}

fn refused(kind: Option<Kind>, reason: DenyReason) -> Sniffed {
    Sniffed::Refused {
        kind,
        reason,
        host: None,
        alert: Vec::new(),
    }
}

impl Sniffer {
    pub fn new(port: u16) -> Sniffer {
        Sniffer {
            state: State::Start,
            port,
        }
    }

    /// `buf` holds every byte read so far; `buf[new_from..]` arrived since the last call. After a
    /// result other than [`Sniffed::More`] the sniffer is done (further calls refuse).
    pub fn feed(&mut self, buf: &[u8], new_from: usize) -> Sniffed {
        let out = self.step(buf, new_from);
        if out != Sniffed::More {
            self.state = State::Done;
        } else if buf.len() >= MAX_SNIFF_BYTES {
            let kind = match self.state {
                State::Tls(_) => Some(Kind::Tls),
                _ => None,
            };
            self.state = State::Done;
            return refused(
                kind,
                if kind == Some(Kind::Tls) {
                    DenyReason::TlsInvalidHello
                } else {
                    DenyReason::UnknownProtocol
                },
            );
        }
        out
    }

    fn step(&mut self, buf: &[u8], new_from: usize) -> Sniffed {
        if let State::Start = self.state {
            match buf.first() {
                None => return Sniffed::More,
                Some(&TLS_HANDSHAKE) => {
                    self.state = State::Tls(Box::default());
                    // Everything read so far is new to the acceptor.
                    return self.tls(buf, 0);
                }
                Some(b) if b.is_ascii_alphabetic() => self.state = State::Http,
                Some(_) => return refused(None, DenyReason::UnknownProtocol),
            }
        }
        match self.state {
            State::Tls(_) => self.tls(buf, new_from),
            State::Http => http(buf, self.port),
            State::Start | State::Done => refused(None, DenyReason::UnknownProtocol),
        }
    }

    fn tls(&mut self, buf: &[u8], new_from: usize) -> Sniffed {
        let State::Tls(acceptor) = &mut self.state else {
            return refused(None, DenyReason::UnknownProtocol);
        };
        let mut new = buf.get(new_from..).unwrap_or_default();
        while !new.is_empty() {
            match acceptor.read_tls(&mut new) {
                Ok(0) | Err(_) => return refused(Some(Kind::Tls), DenyReason::TlsInvalidHello),
                Ok(_) => {}
            }
        }
        match acceptor.accept() {
            Ok(None) => Sniffed::More,
            Ok(Some(accepted)) => match accepted.client_hello().server_name() {
                None => refused(Some(Kind::Tls), DenyReason::TlsNoServerName),
                Some(sni) => match Destination::parse(sni) {
                    Ok(dest @ Destination::Name(_)) => Sniffed::Target {
                        kind: Kind::Tls,
                        target: Target {
                            dest,
                            port: self.port,
                        },
                    },
                    Ok(Destination::Ip(_)) => refused(Some(Kind::Tls), DenyReason::TlsNoServerName),
                    Err(e) => Sniffed::Refused {
                        kind: Some(Kind::Tls),
                        reason: e.into(),
                        host: Some(cut(sni)),
                        alert: Vec::new(),
                    },
                },
            },
            Err((_, mut alert)) => {
                let mut bytes = Vec::new();
                alert.write_all(&mut bytes).ok();
                Sniffed::Refused {
                    kind: Some(Kind::Tls),
                    reason: DenyReason::TlsInvalidHello,
                    host: None,
                    alert: bytes,
                }
            }
        }
    }
}

/// An HTTP/1 request head: the Host header as a target on `port`.
fn http(buf: &[u8], port: u16) -> Sniffed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => return Sniffed::More,
        Ok(httparse::Status::Complete(_)) => {}
        Err(_) => return refused(None, DenyReason::UnknownProtocol),
    }
    let http = Some(Kind::Http);
    if req.method == Some("CONNECT") || !matches!(req.version, Some(0 | 1)) {
        return refused(None, DenyReason::UnknownProtocol);
    }
    let host = match request::single_host_header(req.headers.iter().map(|h| (h.name, h.value))) {
        Ok(Some(h)) => h,
        Ok(None) => return refused(http, DenyReason::HttpNoHost),
        Err(_) => return refused(http, DenyReason::HostHeaderMismatch),
    };
    let Ok(text) = std::str::from_utf8(host) else {
        return refused(http, DenyReason::InvalidHost);
    };
    let text = text.trim_matches(|c| c == ' ' || c == '\t');
    let target = match request::split_authority(text, Some(port)) {
        Ok(t) => t,
        Err(request::RequestError::Denied(reason)) => return refused(http, reason),
        Err(_) => {
            return Sniffed::Refused {
                kind: http,
                reason: DenyReason::InvalidHost,
                host: Some(cut(text)),
                alert: Vec::new(),
            };
        }
    };
    if target.port != port {
        return refused(http, DenyReason::HostHeaderMismatch);
    }
    // An absolute-form target (a proxy-style request) must name the same authority.
    if let Some(path) = req.path
        && path.contains("://")
        && request::absolute_target(path).is_ok_and(|t| t != target)
    {
        return refused(http, DenyReason::HostHeaderMismatch);
    }
    Sniffed::Target {
        kind: Kind::Http,
        target,
    }
}

/// A raw name for an event: at most 253 bytes, on a char boundary.
fn cut(s: &str) -> String {
    let mut end = s.len().min(egress_policy::name::MAX_NAME_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    /// Feed `bytes` in `chunk`-sized pieces; the first decision.
    fn sniff(bytes: &[u8], chunk: usize, port: u16) -> Sniffed {
        let mut s = Sniffer::new(port);
        let mut buf = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            let from = buf.len();
            buf.extend_from_slice(piece);
            match s.feed(&buf, from) {
                Sniffed::More => {}
                done => return done,
            }
        }
        Sniffed::More
    }

    fn name(kind: Kind, host: &str, port: u16) -> Sniffed {
        Sniffed::Target {
            kind,
            target: Target {
                dest: Destination::parse(host).unwrap(),
                port,
            },
        }
    }

    fn reason(s: Sniffed) -> &'static str {
        match s {
            Sniffed::Refused { reason, .. } => reason.as_str(),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn http_host_is_the_name_on_the_original_port() {
        let req = b"GET /x HTTP/1.1\r\nHost: Allowed.Test\r\nAccept: */*\r\n\r\n";
        for chunk in [1, 7, req.len()] {
            assert_eq!(sniff(req, chunk, 80), name(Kind::Http, "allowed.test", 80));
        }
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: a.test:8080\r\n\r\n", 64, 8080),
            name(Kind::Http, "a.test", 8080)
        );
        for (req, why) in [
            (&b"GET / HTTP/1.1\r\n\r\n"[..], "http-no-host"),
            (b"GET / HTTP/1.0\r\nAccept: x\r\n\r\n", "http-no-host"),
            (
                b"GET / HTTP/1.1\r\nHost: a.test:81\r\n\r\n",
                "host-header-mismatch",
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
                "host-header-mismatch",
            ),
            (
                b"GET http://b.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
                "host-header-mismatch",
            ),
            (
                b"GET / HTTP/1.1\r\nHost: a.test@b.test\r\n\r\n",
                "userinfo-not-allowed",
            ),
            (
                b"GET / HTTP/1.1\r\nHost: 2130706433\r\n\r\n",
                "numeric-ip-form",
            ),
            (b"GET / HTTP/1.1\r\nHost: a..test\r\n\r\n", "invalid-host"),
            (
                b"CONNECT a.test:80 HTTP/1.1\r\nHost: a.test:80\r\n\r\n",
                "unknown-protocol",
            ),
            (b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n", "unknown-protocol"),
            (b"\x00\x01binary", "unknown-protocol"),
        ] {
            assert_eq!(
                reason(sniff(req, 5, 80)),
                why,
                "{:?}",
                String::from_utf8_lossy(req)
            );
        }
        // A head that never ends is cut at the bound.
        let mut long = b"GET / HTTP/1.1\r\nX: ".to_vec();
        long.resize(MAX_SNIFF_BYTES + 10, b'a');
        assert_eq!(reason(sniff(&long, 4096, 80)), "unknown-protocol");
    }

    #[test]
    fn tls_garbage_is_an_invalid_hello() {
        // A handshake record header announcing a ClientHello, then nonsense.
        let bad = b"\x16\x03\x01\x00\x08\x01\x00\x00\x04\xff\xff\xff\xff";
        assert_eq!(reason(sniff(bad, 3, 443)), "tls-invalid-hello");
        // An alert record instead of a handshake: not TLS as far as the first byte goes.
        assert_eq!(
            reason(sniff(b"\x15\x03\x03\x00\x02\x02\x28", 7, 443)),
            "unknown-protocol"
        );
    }
}
