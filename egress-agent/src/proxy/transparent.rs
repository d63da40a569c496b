//! Transparent TCP: a connection the kernel redirected to this listener identity (any address, a
//! port of `allow_ports`), decided on the name it carries.
//!
//! Per connection: the original destination from the kernel's record ([`super::admission`];
//! refused without one) → read the first bytes under `proxy.header_timeout_ms` and [`MAX_SNIFF_BYTES`]
//! ([`Sniffer`]: TLS SNI without terminating TLS, or the HTTP Host) → the policy check of CONNECT
//! on that name and the **original port** → resolve the name, check every address → dial **the
//! name's own addresses** → [`route::carry`]: TLS to an intercepted host is terminated and
//! checked request by request exactly like a `CONNECT` to it, plain HTTP is served request by
//! request (each Host must stay the name decided on), anything else is relayed.
//!
//! Domain fronting: the original IP is never dialed. A client that connected to an address of
//! its choosing (a pinned IP, a fronting CDN, a rebinding answer) reaches whatever the *name* it
//! sent resolves to for the agent, or nothing. Every refusal emits a denial event with the name
//! (when there is one), the original IP and port, protocol `tls`/`http`, and the reason, and the
//! client gets a TLS `access_denied` alert or an HTTP 403 (`X-Egress-Deny`) before the close.
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::act::At;
use super::admission::Admitted;
use super::route::{self, Refused};
use super::sniff::{Kind, MAX_SNIFF_BYTES, Sniffed, Sniffer};
use super::{Refusal, Shared, refuse, response};
use egress_policy::DenyReason;

/// A connection accepted on the transparent listener and admitted ([`super::admission`]): the
/// kernel's record carries where it was going.
pub(crate) async fn handle(
    mut stream: TcpStream,
    peer: SocketAddr,
    admitted: Admitted,
    shared: &Arc<Shared>,
    stop: CancellationToken,
) {
    let span = tracing::debug_span!("transparent", policy = %shared.name, %peer);
    // A record without an original destination: the connection was sent to the explicit
    // listener, never here (fail closed).
    let Some(orig) = admitted.original else {
        let _ = shared.refuse(&At::nowhere("tcp"), DenyReason::NoOriginalDestination);
        tracing::debug!(policy = %shared.name, %peer, "transparent: no original destination");
        refuse(&mut stream, &[]).await;
        return;
    };
    intercepted(stream, orig, Vec::new(), shared, stop)
        .instrument(span)
        .await;
}

/// Refuse a redirected connection (event with its original destination, alert or 403, close).
async fn deny(shared: &Shared, stream: &mut TcpStream, orig: SocketAddr, mut r: Refused<'_>) {
    r.orig = Some(orig);
    route::deny(shared, stream, r).await;
}

/// A redirected connection whose original destination is `orig`; `buf` holds bytes already read
/// from it (the explicit listener's fallback passes what it read).
pub(crate) async fn intercepted(
    mut stream: TcpStream,
    orig: SocketAddr,
    mut buf: Vec<u8>,
    shared: &Arc<Shared>,
    stop: CancellationToken,
) {
    let limits = shared.ctx.limits().clone();
    let mut sniffer = Sniffer::new(orig.port());
    let deadline = tokio::time::Instant::now() + limits.header_timeout;
    buf.reserve(4096);
    let mut fed = 0;
    let (kind, target) = loop {
        if buf.len() > fed {
            match sniffer.feed(&buf, fed) {
                Sniffed::More => {}
                Sniffed::Target { kind, target } => break (kind, target),
                Sniffed::Refused {
                    kind,
                    reason,
                    host,
                    alert,
                } => {
                    let r = Refused {
                        host,
                        alert: &alert,
                        head: &buf,
                        ..Refused::new(kind, reason, orig.port())
                    };
                    deny(shared, &mut stream, orig, r).await;
                    return;
                }
            }
            fed = buf.len();
        }
        let room = MAX_SNIFF_BYTES.saturating_sub(buf.len()).max(1);
        let mut chunk = (&mut stream).take(room as u64);
        let read = tokio::select! {
            r = tokio::time::timeout_at(deadline, chunk.read_buf(&mut buf)) => r,
            () = stop.clone().cancelled_owned() => return,
        };
        match read {
            Err(_) => {
                tracing::debug!(policy = %shared.name, %orig, "transparent: first bytes timed out");
                return;
            }
            Ok(Err(_)) | Ok(Ok(0)) => return,
            Ok(Ok(_)) => {}
        }
    };
    // `egress.internal` over plain HTTP: the agent answers (no policy check, nothing dialled).
    if kind == Kind::Http
        && route::host_of(&target).is_some_and(|h| super::self_service::is_self(&h))
    {
        super::http::serve_agent(stream, buf, shared.clone(), stop).await;
        return;
    }
    if !shared.policy.load().transparent() {
        // The policy was reloaded with `transparent = false` while the kernel still redirected.
        let r = Refused {
            host: route::host_of(&target),
            head: &buf,
            ..Refused::new(Some(kind), DenyReason::TransparentOff, orig.port())
        };
        deny(shared, &mut stream, orig, r).await;
        return;
    }
    // The same decide → dial → record as for `CONNECT` (audit included): the name on the
    // original port, events naming the original destination.
    let upstream = match shared
        .check_and_dial_from(&target, kind.as_str(), Some(orig))
        .await
    {
        Ok(s) => s,
        Err(Refusal::Denied(denial)) => {
            route::answer(&mut stream, Some(kind), &denial, &[], &buf).await;
            return;
        }
        Err(Refusal::Upstream(code)) => {
            tracing::debug!(policy = %shared.name, %target, code, "transparent: upstream unreachable");
            let answer = match kind {
                Kind::Http => response::error(502, code),
                Kind::Tls => Vec::new(),
            };
            refuse(&mut stream, &answer).await;
            return;
        }
    };
    // The bytes read (the whole ClientHello, or the request head) go first: to the interception
    // session, the per-request HTTP path, or untouched through a tunnel (see [`route`]).
    route::carry(stream, upstream, buf, Some(kind), target, shared, stop).await;
}
