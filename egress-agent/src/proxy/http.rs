//! Absolute-form plain HTTP through hyper, keep-alive included: **every** request is parsed,
//! checked against the (current) policy and dialled on its own; an upstream connection is reused
//! only for the next request to the very same host and port.
//!
//! Requests are forwarded in origin-form with the hop-by-hop headers removed (`Connection` and the
//! headers it names, `Proxy-Connection`, `Proxy-Authorization`, `Keep-Alive`, `TE`, `Trailer`,
//! `Transfer-Encoding` — hyper re-frames the body — and `Upgrade`: no protocol switches on plain
//! HTTP). A `CONNECT` later on a kept-alive connection is checked the same way and tunnelled.
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use super::prefixed::Prefixed;
use super::request::{self, RequestError, Target};
use super::{Refusal, Shared};
use crate::policy::DenyReason;

type Body = Either<Incoming, Full<Bytes>>;

/// An upstream HTTP connection that counts the bytes written to it (`upstream`) and read from it
/// (`downstream`), as on the wire, into the listener's metrics as they go (a long download shows
/// up while it runs).
struct Counted {
    inner: TcpStream,
    shared: Arc<Shared>,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        if n > 0 {
            self.shared.relayed(0, n);
        }
        r
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = r {
            self.shared.relayed(n as u64, 0);
        }
        r
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            self.shared.relayed(n as u64, 0);
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

struct ConnState {
    shared: Arc<Shared>,
    /// The upstream of the previous request, reused only for the same target.
    upstream: Mutex<Option<(Target, SendRequest<Incoming>)>>,
    /// The tunnel a CONNECT on this connection became. [`serve`] waits for it, so the tunnel keeps
    /// the connection's place in the connection bounds and ends on proxy shutdown.
    tunnel: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Serve a plain-HTTP client connection; `prefix` holds the bytes already read.
pub(crate) async fn serve(
    stream: TcpStream,
    prefix: Vec<u8>,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let limits = shared.ctx.limits().clone();
    // The bytes already read for the first head are replayed first; the activity clock drives
    // the idle timeout.
    let io = Prefixed::new(prefix, stream);
    let activity = io.activity();
    let state = Arc::new(ConnState {
        shared,
        upstream: Mutex::new(None),
        tunnel: std::sync::Mutex::new(None),
    });
    let tunnel_of = state.clone();
    let service = hyper::service::service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(handle(req, &state).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .max_headers(request::MAX_HEADERS)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let idle = limits.idle_timeout;
    let watchdog = activity.idle_for(idle);
    let mut shutdown = std::pin::pin!(shutdown);
    let stopped = tokio::select! {
        r = conn => {
            if let Err(e) = r { tracing::debug!(error = %e, "http connection ended") }
            false
        }
        () = watchdog => { tracing::debug!("http connection idle"); false }
        () = &mut shutdown => true,
    };
    let tunnel = tunnel_of
        .tunnel
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(mut tunnel) = tunnel {
        if stopped {
            tunnel.abort();
        } else {
            tokio::select! {
                _ = &mut tunnel => {}
                () = &mut shutdown => tunnel.abort(),
            }
        }
    }
}

fn text(status: StatusCode, header: (&'static str, &'static str), body: String) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    if let Ok(v) = HeaderValue::from_str(header.1) {
        h.insert(HeaderName::from_static(header.0), v);
    }
    resp
}

fn forbidden(reason: DenyReason, policy: &str) -> Response<Body> {
    text(
        StatusCode::FORBIDDEN,
        ("x-egress-deny", reason.as_str()),
        format!(
            "egress-agent: denied by policy {policy}: {}\n",
            reason.as_str()
        ),
    )
}

fn error(status: StatusCode, code: &'static str) -> Response<Body> {
    text(
        status,
        ("x-egress-error", code),
        format!("egress-agent: {code}\n"),
    )
}

fn refusal(r: Refusal, policy: &str) -> Response<Body> {
    match r {
        Refusal::Denied(reason) => forbidden(reason, policy),
        Refusal::Upstream(code) => error(StatusCode::BAD_GATEWAY, code),
    }
}

fn request_error(e: RequestError, state: &ConnState, protocol: &str) -> Response<Body> {
    match e {
        RequestError::Malformed(_) => error(StatusCode::BAD_REQUEST, "malformed-request"),
        RequestError::TooLarge => error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "header-too-large",
        ),
        RequestError::Denied(reason) => {
            let name = &state.shared.name;
            state
                .shared
                .ctx
                .events()
                .emit(crate::events::DenialEvent::proxy(
                    name,
                    None,
                    None,
                    0,
                    protocol,
                    reason.as_str(),
                ));
            forbidden(reason, name)
        }
    }
}

/// The request's target and Host-header consistency, as for the first head.
fn target_of(req: &Request<Incoming>) -> Result<Target, RequestError> {
    let hosts = req.headers().get_all(header::HOST);
    let mut it = hosts.iter();
    let host = it.next();
    if it.next().is_some() {
        return Err(RequestError::Malformed("more than one Host header"));
    }
    let uri = req.uri();
    if req.method() == Method::CONNECT {
        let authority = uri
            .authority()
            .ok_or(RequestError::Malformed("CONNECT needs host:port"))?;
        let target = request::connect_target(authority.as_str())?;
        if let Some(h) = host {
            request::check_host_header(h.as_bytes(), &target, None)?;
        }
        return Ok(target);
    }
    match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") => {}
        Some(_) => {
            return Err(RequestError::Malformed(
                "only http:// URIs (use CONNECT for https)",
            ));
        }
        None => return Err(RequestError::Malformed("absolute-form URI required")),
    }
    let authority = uri
        .authority()
        .ok_or(RequestError::Malformed("absolute-form URI required"))?;
    let target = request::split_authority(authority.as_str(), Some(80))?;
    if let Some(h) = host {
        request::check_host_header(h.as_bytes(), &target, Some(80))?;
    }
    Ok(target)
}

async fn handle(mut req: Request<Incoming>, state: &ConnState) -> Response<Body> {
    let shared = &state.shared;
    let protocol = if req.method() == Method::CONNECT {
        "connect"
    } else {
        "http"
    };
    let target = match target_of(&req) {
        Ok(t) => t,
        Err(e) => return request_error(e, state, protocol),
    };
    if req.method() == Method::CONNECT {
        let upstream = match shared.check_and_dial(&target, protocol).await {
            Ok(s) => s,
            Err(r) => return refusal(r, &shared.name),
        };
        let on_upgrade = hyper::upgrade::on(&mut req);
        let shared = shared.clone();
        let tunnel = tokio::spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            // Recover the raw client socket so the tunnel is the same as the fast path's.
            let Ok(parts) = upgraded.downcast::<TokioIo<Prefixed<TcpStream>>>() else {
                return;
            };
            let (rest, client) = parts.io.into_inner().into_parts();
            // hyper's buffered bytes were read before whatever is left of our prefix.
            let mut pending = parts.read_buf.to_vec();
            pending.extend_from_slice(&rest);
            if super::intercept::intercepts(&shared, &target) {
                let client = Prefixed::new(pending, client);
                // Boxed, as in `handle_connection`: the tunnel task stays small.
                Box::pin(super::intercept::serve(
                    client,
                    upstream,
                    target,
                    shared.clone(),
                    std::future::pending::<()>(),
                ))
                .await;
                return;
            }
            // Shutdown: `serve` aborts this task.
            shared
                .relay(
                    client,
                    upstream,
                    pending,
                    &target,
                    std::future::pending::<()>(),
                )
                .await;
        });
        *state
            .tunnel
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tunnel);
        return Response::new(Either::Right(Full::new(Bytes::new())));
    }

    // Request-level rules and placeholders (plain HTTP never gets a secret: a placeholder of any
    // binding is refused here).
    {
        let policy = shared.policy.load();
        let uri = req.uri();
        let view = crate::policy::l7::RequestView {
            method: req.method().as_str(),
            path: uri.path(),
            query: uri.query(),
            headers: req.headers(),
        };
        if let Err(reason) = policy
            .l7()
            .check(&target.dest, target.port, false, &view)
            .map(|_| ())
        {
            shared.deny_request_event(&target, protocol, reason, req.method().as_str(), uri.path());
            return forbidden(reason, &shared.name);
        }
    }

    // Reuse the previous upstream only for the same target, and only after this request's check.
    let mut cached = state.upstream.lock().await;
    let reuse = match cached.take() {
        Some((t, mut sender)) if t == target && !sender.is_closed() => {
            // Policy may have changed since: re-check the target before reusing.
            let decision = shared
                .policy
                .load()
                .decide_target(&target.dest, target.port);
            match shared.enforce(&target, None, protocol, decision) {
                Ok(audited) => match sender.ready().await {
                    Ok(()) => {
                        shared.allowed(&target, None, protocol, audited);
                        Some(sender)
                    }
                    Err(_) => None,
                },
                Err(reason) => return forbidden(reason, &shared.name),
            }
        }
        _ => None,
    };
    let mut sender = match reuse {
        Some(s) => s,
        None => {
            let upstream = match shared.check_and_dial(&target, protocol).await {
                Ok(s) => s,
                Err(r) => return refusal(r, &shared.name),
            };
            let upstream = Counted {
                inner: upstream,
                shared: shared.clone(),
            };
            let (sender, conn) =
                match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
                    Ok(x) => x,
                    Err(_) => return error(StatusCode::BAD_GATEWAY, "upstream-handshake"),
                };
            tokio::spawn(async move {
                conn.await.ok();
            });
            sender
        }
    };

    // Origin-form, hop-by-hop headers removed.
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let pq = if pq.starts_with('/') {
        pq.to_owned()
    } else {
        format!("/{pq}")
    };
    match Uri::builder().path_and_query(pq).build() {
        Ok(uri) => *req.uri_mut() = uri,
        Err(_) => return error(StatusCode::BAD_REQUEST, "malformed-request"),
    }
    let authority = match target_of_authority(&target) {
        Some(v) => v,
        None => return error(StatusCode::BAD_REQUEST, "malformed-request"),
    };
    strip_hop_by_hop(req.headers_mut());
    req.headers_mut().insert(header::HOST, authority);
    let resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(policy = %shared.name, %target, error = %e, "upstream request failed");
            return error(StatusCode::BAD_GATEWAY, "upstream-failed");
        }
    };
    *cached = Some((target, sender));
    drop(cached);
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, Either::Left(body))
}

fn target_of_authority(t: &Target) -> Option<HeaderValue> {
    let s = if t.port == 80 {
        t.dest.to_string()
    } else {
        t.to_string()
    };
    HeaderValue::from_str(&s).ok()
}

pub(crate) fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        header::CONNECTION,
        HeaderName::from_static("proxy-connection"),
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        h.remove(n);
    }
}
