//! Absolute-form plain HTTP through hyper, keep-alive included: **every** request is parsed,
//! checked against the (current) policy and dialled on its own; an upstream connection is reused
//! only for the next request to the very same host and port.
//!
//! Requests are forwarded in origin-form with the hop-by-hop headers removed (`Connection` and the
//! headers it names, `Proxy-Connection`, `Proxy-Authorization`, `Keep-Alive`, `TE`, `Trailer`,
//! `Transfer-Encoding` — hyper re-frames the body — and `Upgrade`: no protocol switches on plain
//! HTTP). A `CONNECT` later on a kept-alive connection is checked the same way and tunnelled.
//!
//! The same code serves a connection to one checked target ([`serve_fixed`]: transparent plain
//! HTTP, plain HTTP inside a `CONNECT` tunnel): origin-form requests, each Host naming the target,
//! each checked against the request rules and placeholders, WebSocket handshakes forwarded.
//! Framing the proxy won't re-frame safely is refused ([`super::framing`]); every refusal closes
//! the connection, so nothing pipelined after it reaches the upstream.
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

use super::act::{Act, At, Stage, request_context};
use super::denial::Denial;
use super::prefixed::Prefixed;
use super::request::{self, RequestError, Target};
use super::{Refusal, Shared};
use egress_policy::{Decision, DenyReason};
use tokio_util::sync::CancellationToken;

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

/// Which requests a client connection may carry.
enum Route {
    /// The explicit proxy: absolute-form requests to any host, each checked on its own
    /// (`egress.internal` answered by the agent: [`super::self_service`]).
    Forward,
    /// A transparent connection whose Host is `egress.internal`: every request is the agent's.
    Agent,
    /// A connection to one checked target (transparent HTTP, plain HTTP inside a `CONNECT`
    /// tunnel): origin-form requests whose Host, when present, names that target.
    Fixed(Target),
}

/// The upstream of the previous request, reused only for the same target.
struct Upstream {
    target: Target,
    sender: SendRequest<Incoming>,
    /// Dialled (and recorded as allowed) for the connection's first request: not re-recorded.
    fresh: bool,
}

struct ConnState {
    shared: Arc<Shared>,
    route: Route,
    upstream: Mutex<Option<Upstream>>,
    /// The tunnel a CONNECT on this connection became, or a WebSocket relay. [`serve`] waits for
    /// it, so it keeps the connection's place in the connection bounds and ends on proxy
    /// shutdown.
    tunnel: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The connection's stop (the listener's), which a `CONNECT` tunnel gets.
    stop: CancellationToken,
}

/// Serve a plain-HTTP client connection of the explicit proxy; `prefix` holds the bytes already
/// read.
pub(crate) async fn serve(
    stream: TcpStream,
    prefix: Vec<u8>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    serve_route(stream, prefix, shared, stop, Route::Forward).await;
}

/// A client connection whose requests `route` allows, nothing dialled yet.
async fn serve_route(
    stream: TcpStream,
    prefix: Vec<u8>,
    shared: Arc<Shared>,
    stop: CancellationToken,
    route: Route,
) {
    let shutdown = stop.clone().cancelled_owned();
    let state = ConnState {
        shared,
        route,
        upstream: Mutex::new(None),
        tunnel: std::sync::Mutex::new(None),
        stop,
    };
    run(stream, prefix, state, shutdown).await;
}

/// Serve a plain-HTTP connection to one checked `target` whose `upstream` is dialled (transparent
/// HTTP, or plain HTTP inside a `CONNECT` tunnel): every request is parsed and checked like the
/// explicit proxy's (request rules, placeholders), and each must name `target`.
pub(crate) async fn serve_fixed(
    stream: TcpStream,
    prefix: Vec<u8>,
    upstream: TcpStream,
    target: Target,
    shared: Arc<Shared>,
    stop: CancellationToken,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let Some(sender) = upstream_handshake(upstream, &shared).await else {
        return;
    };
    let state = ConnState {
        upstream: Mutex::new(Some(Upstream {
            target: target.clone(),
            sender,
            fresh: true,
        })),
        shared,
        route: Route::Fixed(target),
        tunnel: std::sync::Mutex::new(None),
        stop,
    };
    run(stream, prefix, state, shutdown).await;
}

async fn upstream_handshake(
    upstream: TcpStream,
    shared: &Arc<Shared>,
) -> Option<SendRequest<Incoming>> {
    let upstream = Counted {
        inner: upstream,
        shared: shared.clone(),
    };
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(upstream))
        .await
        .ok()?;
    // Ends when the connection's state (holding `sender`) is dropped.
    shared.tasks.spawn(async move {
        conn.with_upgrades().await.ok();
    });
    Some(sender)
}

async fn run(
    stream: TcpStream,
    prefix: Vec<u8>,
    state: ConnState,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let limits = state.shared.ctx.limits().clone();
    // The bytes already read for the first head are replayed first; the activity clock drives
    // the idle timeout.
    let io = Prefixed::new(prefix, stream);
    let activity = io.activity();
    let state = Arc::new(state);
    let tunnel_of = state.clone();
    let service = hyper::service::service_fn(move |req| {
        let state = state.clone();
        async move {
            let accept = req.headers().get(header::ACCEPT).cloned();
            let resp = handle(req, &state).await;
            Ok::<_, Infallible>(super::denial::negotiated(resp, accept.as_ref()))
        }
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

/// A refusal (`close`: the connection ends after it, so nothing pipelined after a request that
/// could not be parsed or framed safely reaches an upstream).
fn text(
    status: StatusCode,
    header: (&'static str, &'static str),
    body: String,
    close: bool,
) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    if let Ok(v) = HeaderValue::from_str(header.1) {
        h.insert(HeaderName::from_static(header.0), v);
    }
    if close {
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A `403` for `d` ([`super::denial::forbidden`]; [`super::denial::negotiated`] answers it in
/// JSON when the request asks).
fn forbidden(d: Denial) -> Response<Body> {
    super::denial::forbidden(d)
}

fn error(status: StatusCode, code: &'static str) -> Response<Body> {
    text(
        status,
        ("x-egress-error", code),
        format!("egress-agent: {code}\n"),
        status == StatusCode::BAD_REQUEST,
    )
}

fn refusal(r: Refusal) -> Response<Body> {
    match r {
        Refusal::Denied(d) => forbidden(d),
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
            // With the listener's identity, like every other refusal.
            forbidden(state.shared.refuse(&At::nowhere(protocol), reason))
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

/// A request on a connection to one `target`: origin-form (or absolute-form naming `target`),
/// at most one Host, which names `target` (its port defaults to the connection's); no `CONNECT`
/// and no `OPTIONS *` (nothing for the target to answer on the client's behalf).
fn fixed_target_of(req: &Request<Incoming>, target: &Target) -> Result<Target, RequestError> {
    if req.method() == Method::CONNECT {
        return Err(RequestError::Malformed(
            "no CONNECT inside a connection to one host",
        ));
    }
    if req.uri().path() == "*" {
        return Err(RequestError::Malformed("no asterisk-form requests"));
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(RequestError::Malformed("more than one Host header"));
    }
    if req.uri().authority().is_some() {
        let uri = req.uri().to_string();
        if request::absolute_target(&uri)? != *target {
            return Err(RequestError::Denied(DenyReason::HostHeaderMismatch));
        }
    }
    if let Some(h) = host {
        request::check_host_header(h.as_bytes(), target, Some(target.port))?;
    }
    Ok(target.clone())
}

/// A WebSocket handshake (`Connection: upgrade`, `Upgrade: websocket`): the only protocol switch
/// forwarded (on a connection to one host); any other `Upgrade` (h2c, ...) is dropped.
pub(crate) fn is_websocket<B>(req: &Request<B>) -> bool {
    req.version() == http::Version::HTTP_11
        && req
            .headers()
            .get(header::UPGRADE)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"))
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

async fn handle(mut req: Request<Incoming>, state: &ConnState) -> Response<Body> {
    let shared = &state.shared;
    let protocol = if req.method() == Method::CONNECT {
        "connect"
    } else {
        "http"
    };
    let target = match &state.route {
        Route::Forward => target_of(&req),
        Route::Fixed(t) => fixed_target_of(&req, t),
        Route::Agent => return self_answer(req, shared).await,
    };
    let target = match target {
        Ok(t) => t,
        Err(e) => return request_error(e, state, protocol),
    };
    if let Err(e) = super::framing::check(req.headers()) {
        let context = request_context(req.method().as_str(), req.uri().path());
        let at = At::target(&target, protocol).context(&context);
        let _ = shared.refuse(&at, DenyReason::AmbiguousFraming);
        return error(StatusCode::BAD_REQUEST, e.as_str());
    }
    if req.method() == Method::CONNECT {
        return connect(&mut req, state, target, protocol).await;
    }
    // The agent's own name: answered here, never checked against the policy or dialled.
    if let (Route::Forward, egress_policy::name::Destination::Name(n)) =
        (&state.route, &target.dest)
        && super::self_service::is_self(n.as_str())
    {
        return self_answer(req, shared).await;
    }

    if let Some(refused) = refused_request(&req, shared, &target, protocol) {
        return refused;
    }

    // Reuse the previous upstream only for the same target, and only after this request's check.
    let mut cached = state.upstream.lock().await;
    let mut sender = match upstream_sender(&mut cached, shared, &target, protocol).await {
        Ok(s) => s,
        Err(answer) => return answer,
    };

    let authority = match origin_form(&mut req, &target) {
        Ok(a) => a,
        Err(answer) => return *answer,
    };
    // A WebSocket handshake on a connection to one host keeps its protocol switch.
    let websocket = matches!(state.route, Route::Fixed(_)) && is_websocket(&req);
    let client_upgrade = websocket.then(|| hyper::upgrade::on(&mut req));
    strip_hop_by_hop(req.headers_mut());
    req.headers_mut().insert(header::HOST, authority);
    if websocket {
        let h = req.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    }
    let resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(policy = %shared.name, %target, error = %e, "upstream request failed");
            return error(StatusCode::BAD_GATEWAY, "upstream-failed");
        }
    };
    let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(client_up)) = (switching, client_upgrade) {
        // The upstream connection is the WebSocket's now: not reused.
        drop(cached);
        return relay_websocket(state, resp, client_up);
    }
    *cached = Some(Upstream {
        target,
        sender,
        fresh: false,
    });
    drop(cached);
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, Either::Left(body))
}

async fn self_answer(req: Request<Incoming>, shared: &Arc<Shared>) -> Response<Body> {
    super::self_service::answer(req, shared)
        .await
        .map(Either::Right)
}

/// Serve a transparent connection whose first request names `egress.internal` (`prefix`: the
/// bytes already read): each request on it is answered by the agent, none leaves the host.
pub(crate) async fn serve_agent(
    stream: TcpStream,
    prefix: Vec<u8>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    serve_route(stream, prefix, shared, stop, Route::Agent).await;
}

/// `CONNECT`: checked and dialled, then the client's socket, recovered from hyper once the
/// `200` is sent, is relayed as a tunnel (the fast path's tunnel, on the listener's tracker).
async fn connect(
    req: &mut Request<Incoming>,
    state: &ConnState,
    target: Target,
    protocol: &'static str,
) -> Response<Body> {
    let shared = &state.shared;
    let upstream = match shared.check_and_dial(&target, protocol).await {
        Ok(c) => c,
        Err(r) => return refusal(r),
    };
    let on_upgrade = hyper::upgrade::on(req);
    let (shared, stop) = (shared.clone(), state.stop.clone());
    let tunnel = shared.tasks.clone().spawn(async move {
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
        // Shutdown: `stop` ends it, and `serve` aborts this task.
        super::route::connect_tunnel(client, upstream, pending, target, shared, stop).await;
    });
    *state
        .tunnel
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tunnel);
    Response::new(Either::Right(Full::new(Bytes::new())))
}

/// Request-level rules and placeholders (plain HTTP never gets a secret: a placeholder of any
/// binding is refused here). `Some`: the refusal.
fn refused_request(
    req: &Request<Incoming>,
    shared: &Shared,
    target: &Target,
    protocol: &str,
) -> Option<Response<Body>> {
    let policy = shared.policy.load();
    let uri = req.uri();
    let view = egress_policy::l7::RequestView {
        method: req.method().as_str(),
        path: uri.path(),
        query: uri.query(),
        headers: req.headers(),
    };
    if let Err(refused) = policy
        .l7()
        .check(&target.dest, target.port, false, &view)
        .map(|_| ())
    {
        let context = request_context(req.method().as_str(), uri.path());
        let at = At::target(target, protocol).context(&context);
        return Some(forbidden(shared.deny(&policy, &at, refused)));
    }
    None
}

/// The upstream connection for this request: the previous one of this client connection, for
/// the same target only, with the target decided again (a reload may have refused it since);
/// else a new one, checked and dialled. `Err`: the answer.
async fn upstream_sender(
    cached: &mut Option<Upstream>,
    shared: &Arc<Shared>,
    target: &Target,
    protocol: &str,
) -> Result<SendRequest<Incoming>, Response<Body>> {
    let reuse = match cached.take() {
        Some(Upstream {
            target: t,
            sender,
            fresh: true,
        }) if t == *target && !sender.is_closed() => Some(sender),
        Some(Upstream {
            target: t,
            mut sender,
            fresh: _,
        }) if t == *target && !sender.is_closed() => {
            // Policy may have changed since: re-check the target before reusing.
            let policy = shared.policy.load_full();
            let at = At::target(target, protocol);
            let decision = policy.decide_target(&target.dest, target.port);
            if let Decision::Deny(r) = decision {
                return Err(forbidden(shared.deny(&policy, &at, r)));
            }
            match sender.ready().await {
                Ok(()) => match shared.act(&policy, &at, decision, Stage::Carried) {
                    Act::Go { .. } => Some(sender),
                    Act::Refuse(reason) => return Err(forbidden(reason)),
                },
                Err(_) => None,
            }
        }
        _ => None,
    };
    let mut sender = match reuse {
        Some(s) => s,
        None => {
            let upstream = match shared.check_and_dial(target, protocol).await {
                Ok(c) => c.stream,
                Err(r) => return Err(refusal(r)),
            };
            match upstream_handshake(upstream, shared).await {
                Some(s) => s,
                None => return Err(error(StatusCode::BAD_GATEWAY, "upstream-handshake")),
            }
        }
    };
    if sender.ready().await.is_err() {
        return Err(error(StatusCode::BAD_GATEWAY, "upstream-failed"));
    }
    Ok(sender)
}

/// The request in origin form, for `target` (the `Host` value its authority gives): `Err` for a
/// request that can't be written so.
fn origin_form(
    req: &mut Request<Incoming>,
    target: &Target,
) -> Result<HeaderValue, Box<Response<Body>>> {
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
        Err(_) => {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                "malformed-request",
            )));
        }
    }
    let authority = match target_of_authority(target) {
        Some(v) => v,
        None => {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                "malformed-request",
            )));
        }
    };
    Ok(authority)
}

/// A WebSocket the upstream switched to: both sides relayed as is once upgraded (on the
/// listener's tracker), and the `101` passed on.
fn relay_websocket(
    state: &ConnState,
    mut resp: Response<Incoming>,
    client_up: hyper::upgrade::OnUpgrade,
) -> Response<Body> {
    let shared = &state.shared;
    let upstream_up = hyper::upgrade::on(&mut resp);
    let relay = shared.tasks.spawn(async move {
        let (Ok(c), Ok(u)) = tokio::join!(client_up, upstream_up) else {
            return;
        };
        let (mut c, mut u) = (TokioIo::new(c), TokioIo::new(u));
        tokio::io::copy_bidirectional(&mut c, &mut u).await.ok();
    });
    *state
        .tunnel
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(relay);
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts
        .headers
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    parts
        .headers
        .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
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
