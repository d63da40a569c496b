//! TLS interception of one client connection to an intercepted host: terminate the client's TLS
//! with a leaf for the target name, open TLS to the upstream (verified), and forward every
//! request through hyper with the policy's request-level decisions ([`egress_policy::l7`]):
//! request rules, placeholder checks, credential injection.
//!
//! Entry point for both ways a connection arrives: [`serve`] takes the client stream with any
//! bytes already read replayed first ([`Prefixed`]: after an explicit `CONNECT`'s 200, or a
//! ClientHello peeked by transparent interception), the checked [`Target`] and the first upstream
//! TCP connection (dialled by [`Shared::check_and_dial`], so every address check has passed).
//! Whether to call it is [`intercepts`]: only destinations with a credential binding or request
//! rules; everything else stays a pass-through tunnel.
//!
//! Per connection:
//! 1. read the ClientHello (rustls `Acceptor`) under the head deadline; an SNI naming another
//!    server than the target is refused (`sni-mismatch`: no domain fronting into a binding);
//! 2. TLS to the upstream offering the client's ALPN (`h2`, `http/1.1`), verified against the
//!    system roots + `intercept.upstream_ca_file`; the protocol it picks is the only one offered
//!    to the client, so both legs speak the same version (see [`super::tls`]);
//! 3. finish the client handshake with the cached leaf, then serve HTTP/1.1 or h2 (hyper).
//!
//! Per request: the target is re-decided against the current policy (reloads apply to kept-alive
//! connections; an audited refusal is a would-deny, recorded once per connection, and goes on);
//! the Host header (HTTP/1.1) or `:authority` (h2) must name the target; then
//! [`egress_policy::l7::L7Policy::check`]; a refusal is a 403 with `X-Egress-Deny` and an event
//! carrying method and path (never the query). Bodies stream both ways (hyper; never buffered
//! whole), an HTTP/1.1 `Upgrade` (WebSocket) is forwarded and, after the upstream's 101, the two
//! upgraded streams are relayed. Response headers that contain the secret are dropped.
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1 as client1, http2 as client2};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::LazyConfigAcceptor;
use tokio_rustls::client::TlsStream;
use tokio_util::task::TaskTracker;

use super::act::{Act, At, Stage, request_context};
use super::denial::Denial;
use super::prefixed::Prefixed;
use super::request::{self, Target};
use super::scrub_body::{self, Report, ScrubBody, Scrubbed};
use super::tls::{self, Interceptor, Offer, Proto};
use super::{Checked, Refusal, Shared};
use egress_policy::credentials::CompiledBinding;
use egress_policy::l7::{Forward, RequestView};
use egress_policy::name::{Destination, HostName};
use egress_policy::{CompiledPolicy, DenyReason};

/// Upstream bodies as they are (no binding), scrubbed as they stream, or the agent's own.
type Body = Either<Either<Incoming, Box<ScrubBody>>, Full<Bytes>>;

/// Does the current policy TLS-terminate connections to `target`?
pub(crate) fn intercepts(shared: &Shared, target: &Target) -> bool {
    shared
        .policy
        .load()
        .l7()
        .intercepts(&target.dest, target.port)
}

enum Sender {
    H1(client1::SendRequest<Incoming>),
    H2(client2::SendRequest<Incoming>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }
}

struct Session {
    shared: Arc<Shared>,
    target: Target,
    host: HostName,
    icpt: Arc<Interceptor>,
    proto: Proto,
    /// The upstream connection (HTTP/1.1: taken out while a request is in flight).
    upstream: tokio::sync::Mutex<Option<Sender>>,
    /// Why the first upstream TLS failed (every request then gets a 502 with this code).
    failed: Option<&'static str>,
    /// Upgraded (WebSocket) relays, awaited before the connection's slot is released.
    relays: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// A would-deny for this connection's target is recorded (when it was dialled, or by a
    /// request after a reload): an audited connection records one, not one per request.
    would_deny_recorded: AtomicBool,
}

/// hyper's HTTP/2 executor (its per-stream tasks) on the listener's tracker: they end with their
/// connection, which ends at the listener's stop.
#[derive(Clone)]
struct Tracked(TaskTracker);

impl<F> hyper::rt::Executor<F> for Tracked
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        self.0.spawn(fut);
    }
}

/// The upstream connection's driver runs on a task the listener's tracker keeps; it ends when
/// the [`Sender`] is dropped (with the client connection's session).
async fn handshake(
    tls: TlsStream<TcpStream>,
    proto: Proto,
    tasks: &TaskTracker,
) -> Result<Sender, hyper::Error> {
    let io = TokioIo::new(tls);
    Ok(match proto {
        Proto::H2 => {
            let (sender, conn) = client2::Builder::new(Tracked(tasks.clone()))
                .timer(TokioTimer::new())
                .handshake(io)
                .await?;
            tasks.spawn(async move {
                conn.await.ok();
            });
            Sender::H2(sender)
        }
        Proto::Http1 => {
            let (sender, conn) = client1::handshake(io).await?;
            tasks.spawn(async move {
                conn.with_upgrades().await.ok();
            });
            Sender::H1(sender)
        }
    })
}

impl Session {
    /// A new upstream connection: the target re-checked and dialled, TLS in this connection's
    /// protocol.
    async fn redial(&self) -> Result<Sender, Refusal> {
        let tcp = self
            .shared
            .check_and_dial(&self.target, "https")
            .await?
            .stream;
        let limits = self.shared.ctx.limits();
        let (tls, proto) = tokio::time::timeout(
            limits.connect_timeout,
            self.icpt
                .connect_upstream(tcp, self.host.as_str(), tls::offer_for(self.proto)),
        )
        .await
        .map_err(|_| Refusal::Upstream("upstream-tls-timeout"))?
        .map_err(|e| {
            tracing::warn!(target = %self.target, error = %e, "upstream TLS failed");
            Refusal::Upstream("upstream-tls")
        })?;
        if proto != self.proto {
            return Err(Refusal::Upstream("upstream-protocol-changed"));
        }
        handshake(tls, proto, &self.shared.tasks)
            .await
            .map_err(|_| Refusal::Upstream("upstream-handshake"))
    }

    async fn send(&self, req: Request<Incoming>) -> Result<Response<Incoming>, Refusal> {
        if let Some(code) = self.failed {
            return Err(Refusal::Upstream(code));
        }
        let mut slot = self.upstream.lock().await;
        let mut sender = match slot.take() {
            Some(s) if !s.is_closed() => s,
            _ => self.redial().await?,
        };
        match &mut sender {
            Sender::H2(s) => {
                let mut s2 = s.clone();
                *slot = Some(sender);
                drop(slot);
                s2.ready()
                    .await
                    .map_err(|_| Refusal::Upstream("upstream-failed"))?;
                s2.send_request(req).await.map_err(|e| {
                    tracing::debug!(target = %self.target, error = %e, "upstream request failed");
                    Refusal::Upstream("upstream-failed")
                })
            }
            Sender::H1(s) => {
                if s.ready().await.is_err() {
                    sender = self.redial().await?;
                }
                let Sender::H1(s) = &mut sender else {
                    return Err(Refusal::Upstream("upstream-failed"));
                };
                let r = s.send_request(req).await;
                *slot = Some(sender);
                r.map_err(|e| {
                    tracing::debug!(target = %self.target, error = %e, "upstream request failed");
                    Refusal::Upstream("upstream-failed")
                })
            }
        }
    }
}

/// Serve one intercepted client connection until it ends, idles out or `shutdown` completes.
/// `upstream` is the first upstream TCP connection, already checked and dialled.
pub(crate) async fn serve<C>(
    client: Prefixed<C>,
    upstream: Checked,
    target: Target,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()>,
) where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Destination::Name(host) = &target.dest else {
        return;
    };
    let host = host.clone();
    let limits = shared.ctx.limits().clone();
    let Some(icpt) = shared.ctx.interceptor() else {
        let _ = shared.refuse(
            &At::target(&target, "https"),
            DenyReason::InterceptionUnavailable,
        );
        return;
    };
    let activity = client.activity();
    let acceptor = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), client);
    let start = match tokio::time::timeout(limits.header_timeout, acceptor).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(%target, error = %e, "no TLS ClientHello from the client");
            return;
        }
        Err(_) => return,
    };
    let (offer, sni_ok) = {
        let hello = start.client_hello();
        let sni_ok = hello
            .server_name()
            .is_none_or(|s| HostName::parse(s).is_ok_and(|n| n == host));
        (Offer::from_hello(&hello), sni_ok)
    };
    if !sni_ok {
        let _ = shared.refuse(&At::target(&target, "https"), DenyReason::SniMismatch);
        return;
    }
    let up = tokio::time::timeout(
        limits.connect_timeout,
        icpt.connect_upstream(upstream.stream, host.as_str(), offer),
    )
    .await;
    let fallback = match offer {
        Offer::H2Only => Proto::H2,
        _ => Proto::Http1,
    };
    let (first, proto, failed) = match up {
        Ok(Ok((tls, proto))) => (Some(tls), proto, None),
        Ok(Err(e)) => {
            tracing::warn!(%target, error = %e, "upstream TLS failed");
            (None, fallback, Some("upstream-tls"))
        }
        Err(_) => (None, fallback, Some("upstream-tls-timeout")),
    };
    let client_proto = (offer != Offer::None).then_some(proto);
    let config = match icpt.server_config(host.as_str(), client_proto) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%target, error = %e, "no leaf certificate");
            let _ = shared.refuse(
                &At::target(&target, "https"),
                DenyReason::InterceptionUnavailable,
            );
            return;
        }
    };
    let tls = match tokio::time::timeout(limits.header_timeout, start.into_stream(config)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(%target, error = %e, "client TLS handshake failed");
            if let Some(why) = refused_our_certificate(&e) {
                // Fail closed, and say why: nothing reaches the upstream without the handshake.
                let context = [("client_tls", why), ("fix", TRUST_THE_CA)];
                let at = At::target(&target, "https").context(&context);
                let _ = shared.refuse(&at, DenyReason::AgentCaNotTrusted);
            }
            return;
        }
        Err(_) => return,
    };
    let (sender, failed) = match first {
        Some(tls) => match handshake(tls, proto, &shared.tasks).await {
            Ok(s) => (Some(s), failed),
            Err(_) => (None, Some("upstream-handshake")),
        },
        None => (None, failed),
    };
    let session = Arc::new(Session {
        shared,
        target,
        host,
        icpt,
        proto,
        upstream: tokio::sync::Mutex::new(sender),
        failed,
        relays: std::sync::Mutex::new(Vec::new()),
        // The dial that brought the connection here recorded its would-deny, if it was one.
        would_deny_recorded: AtomicBool::new(upstream.audited),
    });
    let conn = client_connection(&session, TokioIo::new(tls), &limits);
    let mut shutdown = std::pin::pin!(shutdown);
    let stopped = tokio::select! {
        r = conn => {
            if let Err(e) = r { tracing::debug!(error = %e, "intercepted connection ended") }
            false
        }
        () = activity.idle_for(limits.idle_timeout) => false,
        () = &mut shutdown => true,
    };
    end_relays(&session, stopped, shutdown).await;
}

/// The client's side of an intercepted connection: hyper serving [`handle`] for each request
/// over `io` (the terminated TLS), in the protocol agreed with the upstream.
fn client_connection<IO>(
    session: &Arc<Session>,
    io: TokioIo<IO>,
    limits: &super::Limits,
) -> Pin<Box<dyn Future<Output = Result<(), hyper::Error>> + Send>>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let s = session.clone();
    let service = hyper::service::service_fn(move |req| {
        let s = s.clone();
        async move {
            let accept = req.headers().get(header::ACCEPT).cloned();
            let resp = handle(req, &s).await;
            Ok::<_, Infallible>(super::denial::negotiated(resp, accept.as_ref()))
        }
    });
    match session.proto {
        Proto::H2 => Box::pin(
            hyper::server::conn::http2::Builder::new(Tracked(session.shared.tasks.clone()))
                .timer(TokioTimer::new())
                .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
                .serve_connection(io, service),
        ),
        Proto::Http1 => Box::pin(
            hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(limits.max_header_bytes.max(8192))
                .max_headers(request::MAX_HEADERS)
                .serve_connection(io, service)
                .with_upgrades(),
        ),
    }
}

/// The WebSocket relays the connection started: aborted when the agent stops, else waited for
/// (each until it ends or the stop comes).
async fn end_relays(session: &Session, stopped: bool, shutdown: impl Future<Output = ()>) {
    let mut shutdown = std::pin::pin!(shutdown);
    let relays = std::mem::take(
        &mut *session
            .relays
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    for mut relay in relays {
        if stopped {
            relay.abort();
            continue;
        }
        tokio::select! {
            _ = &mut relay => {}
            () = &mut shutdown => relay.abort(),
        }
    }
}

/// What an `agent-ca-not-trusted` event tells the operator to do.
const TRUST_THE_CA: &str = "make the client trust the agent's CA (`egress-agent ca` prints its files): \
     SSL_CERT_FILE/REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE = ca-bundle.pem, NODE_EXTRA_CA_CERTS = ca.pem; \
     see docs/troubleshooting.md, \"agent-ca-not-trusted\"";

/// Did the client end the intercepted handshake because of the agent's certificate? The alert
/// it sent (or its silent close right after our certificate), for the event.
fn refused_our_certificate(e: &std::io::Error) -> Option<&'static str> {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        return Some("closed-during-handshake");
    }
    let tls = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    use rustls::AlertDescription as A;
    match tls {
        rustls::Error::AlertReceived(A::UnknownCA) => Some("unknown_ca"),
        rustls::Error::AlertReceived(A::BadCertificate) => Some("bad_certificate"),
        rustls::Error::AlertReceived(A::CertificateUnknown) => Some("certificate_unknown"),
        rustls::Error::AlertReceived(A::UnsupportedCertificate) => Some("unsupported_certificate"),
        rustls::Error::AlertReceived(A::DecryptError) => Some("decrypt_error"),
        _ => None,
    }
}

fn text(status: StatusCode, header: (&'static str, &'static str), body: String) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(header.0, HeaderValue::from_static(header.1));
    if status == StatusCode::BAD_REQUEST {
        // HTTP/1.1: nothing pipelined after a request that could not be read safely reaches the
        // upstream (h2 frames each request itself; hyper drops the header there).
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A `403` for `d` ([`super::denial::forbidden`]; [`super::denial::negotiated`] answers it in
/// JSON when the request asks).
fn forbidden(d: Denial) -> Response<Body> {
    super::denial::forbidden(d)
}

fn refusal(r: Refusal) -> Response<Body> {
    match r {
        Refusal::Denied(d) => forbidden(d),
        Refusal::Upstream(code) => text(
            StatusCode::BAD_GATEWAY,
            ("x-egress-error", code),
            format!("egress-agent: {code}\n"),
        ),
    }
}

fn bad_request() -> Response<Body> {
    bad_request_because("malformed-request")
}

fn bad_request_because(code: &'static str) -> Response<Body> {
    text(
        StatusCode::BAD_REQUEST,
        ("x-egress-error", code),
        format!("egress-agent: {code}\n"),
    )
}

/// The request's authority must be the target: `Host` (HTTP/1.1), `:authority` (h2), and both
/// when both are present.
/// `Err(true)`: names another host; `Err(false)`: missing or malformed.
fn authority_ok(req: &Request<Incoming>, target: &Target) -> Result<(), bool> {
    let mut seen = false;
    if let Some(a) = req.uri().authority() {
        seen = true;
        request::check_host_header(a.as_str().as_bytes(), target, Some(443)).map_err(|_| true)?;
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    if let Some(h) = hosts.next() {
        if hosts.next().is_some() {
            return Err(false);
        }
        seen = true;
        request::check_host_header(h.as_bytes(), target, Some(443)).map_err(|_| true)?;
    }
    if seen { Ok(()) } else { Err(false) }
}

fn authority_value(t: &Target) -> String {
    if t.port == 443 {
        t.dest.to_string()
    } else {
        t.to_string()
    }
}

async fn handle(mut req: Request<Incoming>, s: &Session) -> Response<Body> {
    let shared = &s.shared;
    let policy = shared.policy.load_full();
    // Every secret of the policy is scrubbed from this host's responses (see `scrub_body`).
    let scrubber = policy
        .l7()
        .scrubber()
        .filter(|_| shared.ctx.scrubs_responses())
        .cloned();
    if let Some(refused) = refused_target(s, &policy) {
        return refused;
    }
    let binding = match checked_request(&req, s, &policy) {
        Ok(b) => b,
        Err(answer) => return *answer,
    };
    // Any other protocol switch was refused above.
    let upgrade = s.proto == Proto::Http1 && super::http::is_websocket(&req);
    let head = req.method() == http::Method::HEAD;
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let upstream = match upstream_request(req, s, binding, scrubber.is_some(), upgrade) {
        Ok(r) => r,
        Err(answer) => return *answer,
    };
    let mut resp = match s.send(upstream).await {
        Ok(r) => r,
        Err(r) => return refusal(r),
    };
    let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(client_up)) = (switching, client_upgrade) {
        relay_upgrade(s, &mut resp, client_up, scrubber.clone());
    }
    client_response(resp, s, scrubber, switching, head).await
}

/// The connection's target against the current policy (a reload applies to kept-alive
/// connections), decided as at every enforcement point: an audited policy's refusal is a
/// would-deny (recorded once per connection) and the request goes on, as the connection itself
/// did. `Some`: the refusal to answer with.
fn refused_target(s: &Session, policy: &CompiledPolicy) -> Option<Response<Body>> {
    let shared = &s.shared;
    let at = At::target(&s.target, "https").audit_once(&s.would_deny_recorded);
    let decision = policy.decide_target(&s.target.dest, s.target.port);
    match shared.act(policy, &at, decision, Stage::Checked) {
        Act::Go { .. } => None,
        Act::Refuse(reason) => Some(forbidden(reason)),
    }
}

/// What may go on, checked before anything is sent: no tunnel or `OPTIONS *`, unambiguous
/// framing, no protocol switch but WebSocket, the authority the connection was decided for,
/// and the request rules. `Ok`: the binding whose secret goes in, if any; `Err`: the answer.
fn checked_request<'p>(
    req: &Request<Incoming>,
    s: &Session,
    policy: &'p CompiledPolicy,
) -> Result<Option<&'p CompiledBinding>, Box<Response<Body>>> {
    let shared = &s.shared;
    // No tunnels inside an intercepted connection (h2 CONNECT, or HTTP/1.1 CONNECT after TLS),
    // and no `OPTIONS *` (nothing for the target to answer on the client's behalf).
    if req.method() == http::Method::CONNECT || req.uri().path() == "*" {
        return Err(Box::new(bad_request()));
    }
    if let Err(e) = super::framing::check(req.headers()) {
        let context = request_context(req.method().as_str(), req.uri().path());
        let _ = shared.refuse(
            &At::target(&s.target, "https").context(&context),
            DenyReason::AmbiguousFraming,
        );
        return Err(Box::new(bad_request_because(e.as_str())));
    }
    // The only protocol switch forwarded is WebSocket: `Upgrade: h2c` (or anything else) would
    // turn the connection into one whose later requests the proxy no longer parses.
    if req.headers().contains_key(header::UPGRADE) && !super::http::is_websocket(req) {
        let context = request_context(req.method().as_str(), req.uri().path());
        let _ = shared.refuse(
            &At::target(&s.target, "https").context(&context),
            DenyReason::UpgradeNotAllowed,
        );
        return Err(Box::new(bad_request_because(
            DenyReason::UpgradeNotAllowed.as_str(),
        )));
    }
    if let Err(mismatch) = authority_ok(req, &s.target) {
        if mismatch {
            let context = request_context(req.method().as_str(), req.uri().path());
            let denial = shared.refuse(
                &At::target(&s.target, "https").context(&context),
                DenyReason::HostHeaderMismatch,
            );
            return Err(Box::new(forbidden(denial)));
        }
        return Err(Box::new(bad_request()));
    }
    let view = RequestView {
        method: req.method().as_str(),
        path: req.uri().path(),
        query: req.uri().query(),
        headers: req.headers(),
    };
    match policy
        .l7()
        .check(&s.target.dest, s.target.port, true, &view)
    {
        Ok(Forward::AsIs) => Ok(None),
        Ok(Forward::Inject(b)) => Ok(Some(b)),
        Err(r) if r.reason == DenyReason::InterceptionUnavailable => {
            // A reload left the binding without its secret while this connection was open:
            // refused as a new connection would be (`502`), never forwarded without it.
            let reason = DenyReason::InterceptionUnavailable;
            let why = policy
                .l7()
                .unavailable(&s.target.dest, s.target.port)
                .unwrap_or("its secret is not loaded");
            let [method, path] = request_context(req.method().as_str(), req.uri().path());
            let context = [method, path, ("unavailable", why)];
            let _ = shared.refuse(&At::target(&s.target, "https").context(&context), reason);
            Err(Box::new(refusal(Refusal::Upstream(reason.as_str()))))
        }
        Err(refused) => {
            let context = request_context(req.method().as_str(), req.uri().path());
            let at = At::target(&s.target, "https").context(&context);
            let reason = shared.deny(policy, &at, refused);
            Err(Box::new(forbidden(reason)))
        }
    }
}

/// The request as it goes upstream: hop-by-hop headers gone, `binding`'s secret injected, an
/// uncompressed answer asked for when it is to be scrubbed, the URI and `Host` of the
/// connection's target, a WebSocket upgrade kept.
fn upstream_request(
    req: Request<Incoming>,
    s: &Session,
    binding: Option<&CompiledBinding>,
    scrubbing: bool,
    upgrade: bool,
) -> Result<Request<Incoming>, Box<Response<Body>>> {
    let mut pq = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let (mut parts, body) = req.into_parts();
    let upgrade_to = parts.headers.get(header::UPGRADE).cloned();
    super::http::strip_hop_by_hop(&mut parts.headers);
    if let Some(b) = binding
        && let Some(new) = b.inject(&mut parts.headers, &pq)
    {
        pq = new;
    }
    if scrubbing {
        // The scrubber reads what comes back: uncompressed, and no compressed WebSocket frames.
        scrub_body::ask_identity(&mut parts.headers);
        parts
            .headers
            .remove(http::HeaderName::from_static("sec-websocket-extensions"));
    }
    let authority = authority_value(&s.target);
    let uri = match s.proto {
        Proto::Http1 => pq.parse::<Uri>(),
        Proto::H2 => format!("https://{authority}{pq}").parse::<Uri>(),
    };
    let Ok(uri) = uri else {
        return Err(Box::new(bad_request()));
    };
    parts.uri = uri;
    match s.proto {
        Proto::Http1 => {
            parts.version = Version::HTTP_11;
            let Ok(host) = HeaderValue::from_str(&authority) else {
                return Err(Box::new(bad_request()));
            };
            parts.headers.insert(header::HOST, host);
            if let (true, Some(to)) = (upgrade, upgrade_to) {
                parts
                    .headers
                    .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                parts.headers.insert(header::UPGRADE, to);
            }
        }
        Proto::H2 => {
            parts.version = Version::HTTP_2;
            parts.headers.remove(header::HOST);
        }
    }
    Ok(Request::from_parts(parts, body))
}

/// Relay a switched (WebSocket) connection once both sides have upgraded, on the listener's
/// tracker: as is, or scrubbed upstream → client when the policy scrubs.
fn relay_upgrade(
    s: &Session,
    resp: &mut Response<Incoming>,
    client_up: hyper::upgrade::OnUpgrade,
    scrubber: Option<Arc<egress_policy::scrub::Scrubber>>,
) {
    let shared = &s.shared;
    let upstream_up = hyper::upgrade::on(resp);
    let scrub = scrubber.map(|sc| {
        let report = Report {
            shared: shared.clone(),
            target: s.target.clone(),
        };
        (sc, report)
    });
    let relay = shared.tasks.spawn(async move {
        let (Ok(c), Ok(u)) = tokio::join!(client_up, upstream_up) else {
            return;
        };
        let (mut c, mut u) = (TokioIo::new(c), TokioIo::new(u));
        match scrub {
            Some((sc, report)) => ws_relay(c, u, sc, report).await,
            None => {
                tokio::io::copy_bidirectional(&mut c, &mut u).await.ok();
            }
        }
    });
    s.relays
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(relay);
}

/// The upstream's response as the client gets it: hop-by-hop headers gone (but a switch's),
/// the version of the client's connection, and every secret of the policy scrubbed from the body.
async fn client_response(
    resp: Response<Incoming>,
    s: &Session,
    scrubber: Option<Arc<egress_policy::scrub::Scrubber>>,
    switching: bool,
    head: bool,
) -> Response<Body> {
    let shared = &s.shared;
    let (mut parts, body) = resp.into_parts();
    let keep = switching.then(|| {
        (
            parts.headers.get(header::CONNECTION).cloned(),
            parts.headers.get(header::UPGRADE).cloned(),
        )
    });
    super::http::strip_hop_by_hop(&mut parts.headers);
    if let Some((conn, up)) = keep {
        if let Some(c) = conn {
            parts.headers.insert(header::CONNECTION, c);
        }
        if let Some(u) = up {
            parts.headers.insert(header::UPGRADE, u);
        }
    }
    parts.version = match s.proto {
        Proto::H2 => Version::HTTP_2,
        Proto::Http1 => Version::HTTP_11,
    };
    let Some(scrubber) = scrubber.filter(|_| !switching) else {
        return Response::from_parts(parts, Either::Left(Either::Left(body)));
    };
    // An upstream that reflects a credential must not hand it to the client.
    let report = Report {
        shared: shared.clone(),
        target: s.target.clone(),
    };
    match scrub_body::response(&scrubber, &report, &mut parts, body, head).await {
        Ok(Scrubbed::Passed(b)) => Response::from_parts(parts, Either::Left(Either::Left(b))),
        Ok(Scrubbed::Whole(bytes)) => Response::from_parts(parts, Either::Right(Full::new(bytes))),
        Ok(Scrubbed::Stream(b)) => Response::from_parts(parts, Either::Left(Either::Right(b))),
        Err(reason) => refusal(Refusal::Upstream(reason.as_str())),
    }
}

/// A WebSocket after the swap: client → upstream as is, upstream → client scrubbed frame by
/// frame ([`egress_policy::scrub::WsScrub`], same-length replacements). A frame the scrubber
/// can't read (compressed, masked by the server) ends the connection.
async fn ws_relay<C, U>(
    client: C,
    upstream: U,
    scrubber: Arc<egress_policy::scrub::Scrubber>,
    report: Report,
) where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = tokio::io::split(upstream);
    let up = async {
        tokio::io::copy(&mut cr, &mut uw).await.ok();
        uw.shutdown().await.ok();
    };
    let mut ws = egress_policy::scrub::WsScrub::new(scrubber);
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut out = Vec::with_capacity(16 * 1024);
        loop {
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            out.clear();
            if let Err(e) = ws.push(&buf[..n], &mut out) {
                tracing::debug!(target = %report.target, error = %e, "WebSocket frame not scrubbable: closed");
                return;
            }
            if cw.write_all(&out).await.is_err() {
                return;
            }
        }
        out.clear();
        ws.finish(&mut out);
        cw.write_all(&out).await.ok();
        cw.shutdown().await.ok();
    };
    tokio::select! {
        () = async { tokio::join!(up, down); } => {}
    }
    report.found("websocket", ws.found());
}
