//! The one "sniff → decide → intercept or relay" step every way into the proxy goes through, once
//! the target is checked and its upstream dialled (`Shared::check_and_dial`):
//!
//! | way in                     | sniffed by                         | then ([`carry`])                |
//! |----------------------------|------------------------------------|---------------------------------|
//! | explicit `CONNECT`         | [`connect_tunnel`] (first bytes)   | TLS + intercepted → [`intercept`] |
//! | transparent TLS / HTTP     | [`super::transparent`] (to decide) | plain HTTP → [`http::serve_fixed`] |
//! |                            |                                    | anything else → relay           |
//!
//! - A target the policy intercepts (a credential binding or request rules,
//!   [`intercept::intercepts`]) never gets its bytes relayed untouched: TLS is terminated and
//!   every request checked, plain HTTP is parsed and checked request by request, and anything else
//!   (an unknown protocol, a server-first one) is refused (`unknown-protocol`).
//! - Plain HTTP on any path is served request by request ([`http::serve_fixed`]): each request's
//!   Host must stay the connection's target, so a kept-alive connection can't carry a second
//!   request to another site behind the same address.
//! - A `CONNECT` tunnel's first bytes are read like a transparent connection's: a TLS SNI or an
//!   HTTP Host that isn't the `CONNECT` target after normalisation is refused (`sni-mismatch`,
//!   `host-header-mismatch`), ECH included (the outer name is what the proxy sees). A tunnel to an
//!   IP literal (an `allow_cidrs` address) names no host to compare with; a hello without SNI
//!   talks to the target it connected to. A server-first protocol (the upstream speaks before the
//!   client) is relayed without waiting.
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::act::At;
use super::denial::{Denial, forbidden_bytes, head_wants_json};
use super::prefixed::Prefixed;
use super::request::Target;
use super::sniff::{Kind, MAX_SNIFF_BYTES, Sniffed, Sniffer, TLS_ACCESS_DENIED};
use super::{Checked, Refusal, Shared, http, intercept, narrow, refuse, response, tunnel};
use egress_policy::DenyReason;
use egress_policy::name::Destination;

/// One refusal of a connection before its bytes go anywhere.
pub(crate) struct Refused<'a> {
    pub(crate) kind: Option<Kind>,
    /// The name the client sent (normalised, or raw when it didn't parse).
    pub(crate) host: Option<String>,
    pub(crate) reason: DenyReason,
    /// Where the client connected: the original destination (transparent), or the `CONNECT`
    /// target's port.
    pub(crate) orig: Option<SocketAddr>,
    pub(crate) port: u16,
    /// Extra event context (e.g. the `CONNECT` target of a mismatching SNI).
    pub(crate) context: Option<(&'static str, String)>,
    /// rustls' alert for a malformed hello (else `access_denied`).
    pub(crate) alert: &'a [u8],
    /// The bytes the client sent (an HTTP request head: its `Accept` picks the 403's body).
    pub(crate) head: &'a [u8],
}

impl Refused<'_> {
    pub(crate) fn new(kind: Option<Kind>, reason: DenyReason, port: u16) -> Refused<'static> {
        Refused {
            kind,
            host: None,
            reason,
            orig: None,
            port,
            context: None,
            alert: &[],
            head: &[],
        }
    }
}

/// Refuse: event (name, where the client connected, reason), then a TLS alert or an HTTP 403,
/// then close.
pub(crate) async fn deny(shared: &Shared, stream: &mut TcpStream, r: Refused<'_>) {
    let context = r.context.as_ref().map(|(k, v)| [(*k, v.as_str())]);
    let at = At {
        host: r.host.as_deref(),
        ip: r.orig.map(|o| o.ip()),
        port: r.orig.map_or(r.port, |o| o.port()),
        protocol: r.kind.map_or("tcp", Kind::as_str),
        context: context.as_ref().map_or(&[], |c| c.as_slice()),
        audit_once: None,
    };
    let denial = shared.refuse(&at, r.reason);
    answer(stream, r.kind, &denial, r.alert, r.head).await;
}

/// The refusal a client sees (its event is recorded already): a TLS alert (`alert`, else
/// `access_denied`), an HTTP 403 (in JSON when the request `head` asks for it), or just the
/// close; then close.
pub(crate) async fn answer(
    stream: &mut TcpStream,
    kind: Option<Kind>,
    denial: &Denial,
    alert: &[u8],
    head: &[u8],
) {
    let answer = match kind {
        Some(Kind::Http) => forbidden_bytes(denial, head_wants_json(head)),
        Some(Kind::Tls) if !alert.is_empty() => alert.to_vec(),
        Some(Kind::Tls) => TLS_ACCESS_DENIED.to_vec(),
        None => Vec::new(),
    };
    refuse(stream, &answer).await;
}

/// Carry a checked, dialled connection on: `early` holds the client's bytes already read,
/// `kind` what they are (`None`: neither TLS nor HTTP, or nothing yet).
///
/// A function returning an `async move` block, not an `async fn`: the block uses its arguments
/// where they were captured, an `async fn` keeps each one used across an `.await` twice; every
/// tunnel's future holds this one (see `tunnel::copy`).
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
)]
pub(crate) fn carry(
    mut client: TcpStream,
    upstream: Checked,
    early: Vec<u8>,
    kind: Option<Kind>,
    target: Target,
    shared: &Arc<Shared>,
    stop: CancellationToken,
) -> impl Future<Output = ()> {
    async move {
        let intercepted = intercept::intercepts(shared, &target);
        // Ends the connection on `stop`, or when a reload refuses its target (`narrow`).
        let addr = Some(upstream.addr.ip());
        let until = |target: &Target| {
            narrow::until_stopped_or_refused(shared.clone(), target.clone(), addr, stop.clone())
        };
        match kind {
            Some(Kind::Tls) if intercepted => {
                // Boxed: interception's state (TLS both ways, hyper) is ~12 KiB, and inline it
                // would size every connection's task, idle pass-through tunnels included.
                Box::pin(intercept::serve(
                    Prefixed::new(early, client),
                    upstream,
                    target.clone(),
                    shared.clone(),
                    until(&target),
                ))
                .await;
            }
            Some(Kind::Http) => {
                Box::pin(http::serve_fixed(
                    client,
                    early,
                    upstream.stream,
                    target.clone(),
                    shared.clone(),
                    stop.clone(),
                    until(&target),
                ))
                .await;
            }
            _ if intercepted => {
                // Bytes that are neither TLS nor HTTP can't be checked request by request: nothing
                // of them reaches an intercepted host.
                let r = Refused {
                    host: host_of(&target),
                    ..Refused::new(None, DenyReason::UnknownProtocol, target.port)
                };
                deny(shared, &mut client, r).await;
            }
            _ => {
                // Pinned here, once: the relay's layers pass it down by reference.
                let shutdown = std::pin::pin!(until(&target));
                shared
                    .relay(client, upstream.stream, early, &target, shutdown)
                    .await;
            }
        }
    }
}

/// The name of a target, for an event (`None` for an IP literal).
pub(crate) fn host_of(t: &Target) -> Option<String> {
    match &t.dest {
        Destination::Name(n) => Some(n.as_str().to_owned()),
        Destination::Ip(_) => None,
    }
}

/// What a `CONNECT` tunnel's first bytes said.
enum Opening {
    /// Go on; `kind` as for [`carry`].
    Carry(Option<Kind>),
    /// Refused (already answered) or the client went away.
    Closed,
}

/// An explicit `CONNECT` whose head is read (`early`: the bytes the client pipelined after it):
/// check and dial the target (a refusal is answered), write the `200`, then go on as
/// [`connect_tunnel`].
///
/// Boxed (and `dyn`, see [`connect_tunnel`]): the dial and the tunnel are steps of one future,
/// so they share one allocation, and the connection's task holds only the head reading's state
/// and this box. An idle tunnel's memory is this box, its task and its sockets.
pub(crate) fn connect(
    mut client: TcpStream,
    mut early: Vec<u8>,
    target: Target,
    json: bool,
    shared: Arc<Shared>,
    stop: CancellationToken,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        let upstream = match shared.check_and_dial(&target, "connect").await {
            Ok(s) => s,
            Err(Refusal::Denied(denial)) => {
                refuse(&mut client, &forbidden_bytes(&denial, json)).await;
                return;
            }
            Err(Refusal::Upstream(code)) => {
                refuse(&mut client, &response::error(502, code)).await;
                return;
            }
        };
        if tunnel::write_all(&client, response::CONNECT_OK)
            .await
            .is_err()
        {
            return;
        }
        // [`connect_tunnel`]'s steps, written out here: through an `async fn` taking the
        // sockets, the target and the early bytes, the box would hold them once more.
        match opening(
            &mut client,
            &upstream.stream,
            &mut early,
            &target,
            &shared,
            &stop,
        )
        .await
        {
            Opening::Carry(kind) => {
                carry(client, upstream, early, kind, target, &shared, stop).await;
            }
            Opening::Closed => {}
        }
    })
}

/// A `CONNECT` tunnel whose `200` has been sent: read its first bytes (`early`: those the client
/// pipelined after its head) like a transparent connection's, refuse a name that isn't the
/// target, then [`carry`] it.
///
/// Boxed (and `dyn`): a tunnel's state stays out of the accepting task, and plain HTTP inside a
/// tunnel is served by [`http`], whose `CONNECT` handling starts a tunnel in turn — the trait
/// object ends that cycle of future types.
pub(crate) fn connect_tunnel(
    mut client: TcpStream,
    upstream: Checked,
    mut early: Vec<u8>,
    target: Target,
    shared: Arc<Shared>,
    stop: CancellationToken,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        match opening(
            &mut client,
            &upstream.stream,
            &mut early,
            &target,
            &shared,
            &stop,
        )
        .await
        {
            Opening::Carry(kind) => {
                carry(client, upstream, early, kind, target, &shared, stop).await;
            }
            Opening::Closed => {}
        }
    })
}

async fn opening(
    client: &mut TcpStream,
    upstream: &TcpStream,
    buf: &mut Vec<u8>,
    target: &Target,
    shared: &Shared,
    stop: &CancellationToken,
) -> Opening {
    let mut sniffer = Sniffer::new(target.port);
    let deadline = tokio::time::Instant::now() + shared.ctx.limits().header_timeout;
    let mut fed = 0;
    loop {
        if buf.len() > fed {
            if !may_be_http_or_tls(buf) {
                return Opening::Carry(None);
            }
            match sniffer.feed(buf, fed) {
                Sniffed::More => {}
                Sniffed::Target { kind, target: seen } => {
                    if names_target(&seen, target) {
                        return Opening::Carry(Some(kind));
                    }
                    let reason = match kind {
                        Kind::Tls => DenyReason::SniMismatch,
                        Kind::Http => DenyReason::HostHeaderMismatch,
                    };
                    let r = Refused {
                        host: host_of(&seen),
                        context: Some(("connect_target", target.to_string())),
                        head: buf,
                        ..Refused::new(Some(kind), reason, target.port)
                    };
                    deny(shared, client, r).await;
                    return Opening::Closed;
                }
                Sniffed::Refused {
                    kind,
                    reason,
                    host,
                    alert,
                } => {
                    return match (kind, reason) {
                        // No name: the client talks to the target it connected to.
                        (Some(Kind::Tls), DenyReason::TlsNoServerName) => {
                            Opening::Carry(Some(Kind::Tls))
                        }
                        (Some(Kind::Http), DenyReason::HttpNoHost) => {
                            Opening::Carry(Some(Kind::Http))
                        }
                        // Neither TLS nor HTTP: [`carry`] relays it, or refuses it for an
                        // intercepted target.
                        (None, DenyReason::UnknownProtocol) => Opening::Carry(None),
                        _ => {
                            let r = Refused {
                                host,
                                context: Some(("connect_target", target.to_string())),
                                alert: &alert,
                                head: buf,
                                ..Refused::new(kind, reason, target.port)
                            };
                            deny(shared, client, r).await;
                            Opening::Closed
                        }
                    };
                }
            }
            fed = buf.len();
        }
        let room = MAX_SNIFF_BYTES.saturating_sub(buf.len()).max(1);
        let mut chunk = (&mut *client).take(room as u64);
        let silent = buf.is_empty();
        tokio::select! {
            r = tokio::time::timeout_at(deadline, chunk.read_buf(buf)) => match r {
                // Nothing at all by the deadline: a client waiting for something (a protocol
                // this proxy doesn't know); carry decides. Part of a hello or head: refuse.
                Err(_) if silent => return Opening::Carry(None),
                Err(_) => {
                    tracing::debug!(policy = %shared.name, %target, "tunnel: first bytes timed out");
                    return Opening::Closed;
                }
                Ok(Err(_)) | Ok(Ok(0)) => return Opening::Closed,
                Ok(Ok(_)) => {}
            },
            // The upstream spoke first (SSH, SMTP, a database): not TLS or HTTP from the client.
            Ok(()) = upstream.readable(), if silent => return Opening::Carry(None),
            () = stop.cancelled() => return Opening::Closed,
        }
    }
}

/// Request methods a tunnel's plain HTTP is recognised by (RFC 9110 and the WebDAV/CalDAV ones in
/// IANA's registry).
const METHODS: [&[u8]; 19] = [
    b"GET",
    b"HEAD",
    b"POST",
    b"PUT",
    b"DELETE",
    b"OPTIONS",
    b"TRACE",
    b"PATCH",
    b"CONNECT",
    b"PROPFIND",
    b"PROPPATCH",
    b"MKCOL",
    b"COPY",
    b"MOVE",
    b"LOCK",
    b"UNLOCK",
    b"REPORT",
    b"SEARCH",
    b"MKCALENDAR",
];

/// Could a tunnel's first bytes still be a TLS hello or an HTTP request? A client-first protocol
/// of its own (a line that starts like no HTTP method) is not held back waiting for a request
/// head that never comes: it is relayed, or refused for an intercepted target ([`carry`]).
/// Plain HTTP with a method outside [`METHODS`] is therefore relayed unchecked to a target that
/// has no request rules or bindings (the `CONNECT` target itself was checked).
fn may_be_http_or_tls(buf: &[u8]) -> bool {
    match buf.first() {
        None => true,
        Some(b) if !b.is_ascii_alphabetic() => true,
        Some(_) => {
            let token = buf.split(|&b| b == b' ').next().unwrap_or(buf);
            let complete = token.len() < buf.len();
            METHODS.iter().any(|m| {
                if complete {
                    *m == token
                } else {
                    m.starts_with(token)
                }
            })
        }
    }
}

/// Does the name the client's bytes carry (SNI, Host) name the `CONNECT` target? Names compare
/// normalised; a tunnel to an IP literal has no name to compare with.
fn names_target(seen: &Target, target: &Target) -> bool {
    match &target.dest {
        Destination::Ip(_) => true,
        Destination::Name(_) => seen.dest == target.dest,
    }
}
