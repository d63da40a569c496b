//! The opt-in `/metrics` listener: loopback only unless allowed, `GET /metrics` and nothing
//! else, request heads under a timeout, a bounded number of connections.
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::{Metrics, MetricsError};

/// Content type of the OpenMetrics text exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Most scrapes served at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 16;
/// A request head must arrive within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Bind the metrics listener. Refuses a non-loopback address unless `allow_non_loopback`.
pub async fn bind(addr: SocketAddr, allow_non_loopback: bool) -> Result<TcpListener, MetricsError> {
    check(addr, allow_non_loopback)?;
    TcpListener::bind(addr)
        .await
        .map_err(|e| MetricsError::Bind(addr, e))
}

fn check(addr: SocketAddr, allow_non_loopback: bool) -> Result<(), MetricsError> {
    if !addr.ip().is_loopback() && !allow_non_loopback {
        return Err(MetricsError::NotLoopback(addr));
    }
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "metrics served on a non-loopback address (explicitly allowed)");
    }
    Ok(())
}

/// [`bind`] through the agent's sockets: the listener a previous agent handed over, or a new
/// one, offered to a successor while the registration is held.
pub fn bind_handed(
    addr: SocketAddr,
    allow_non_loopback: bool,
    sockets: &std::sync::Arc<crate::handover::Sockets>,
) -> Result<(TcpListener, crate::handover::Held), MetricsError> {
    check(addr, allow_non_loopback)?;
    sockets
        .tcp("metrics", addr, |a| {
            let l = std::net::TcpListener::bind(a)?;
            l.set_nonblocking(true)?;
            TcpListener::from_std(l)
        })
        .map_err(|e| MetricsError::Bind(addr, e))
}

fn respond(metrics: &Metrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/plain"),
        );
        r
    };
    if req.uri().path() != "/metrics" {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return r;
    }
    match metrics.encode() {
        Ok(text) => {
            let mut r = Response::new(Full::new(Bytes::from(text)));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(CONTENT_TYPE),
            );
            r
        }
        Err(e) => {
            tracing::warn!(error = %e, "metrics encoding failed");
            plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n")
        }
    }
}

/// Serve `GET /metrics` on `listener` until `shutdown` completes; then scrapes in flight get
/// [`crate::tasks::CONNECTION_DRAIN`] to finish before they are ended.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while conns.try_join_next().is_some() {}
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            p = Arc::clone(&slots).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = Arc::clone(&metrics);
        conns.spawn(async move {
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| {
                let r = respond(&metrics, &req);
                async move { Ok::<_, std::convert::Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), svc);
            // A scrape that stalls mid-response is cut off too.
            match tokio::time::timeout(Duration::from_secs(30), conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics connection error"),
                Err(_) => tracing::debug!(%peer, "metrics connection timed out"),
            }
        });
    }
    crate::tasks::end_connections(conns, crate::tasks::CONNECTION_DRAIN).await;
}
