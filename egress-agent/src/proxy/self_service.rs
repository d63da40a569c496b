//! `http://egress.internal/`: the agent answering a confined workload about itself, through
//! the workload's own listener (issue #41, "asking for access").
//!
//! Reached as a proxied request (`HTTP_PROXY`: `GET http://egress.internal/v1/self`) or, when
//! the policy's ports send port 80 through transparent interception, as a plain request whose
//! Host is `egress.internal` ([`super::transparent`]). Never dialled, never resolved upstream:
//! the name is answered here before any policy check, and `.internal` is a name no public
//! resolver answers (RFC 6762's `.local` would go to mDNS). Who asks is the listener that
//! accepted the connection, which the kernel chose from the cgroup: nothing in the request
//! names a workload, and a request naming another one in its body is refused as an unknown
//! field.
//!
//! | method | path                       | answer |
//! |--------|----------------------------|--------|
//! | GET    | `/`                        | what this is (text) |
//! | GET    | `/v1/self`                 | this workload's policy as the listener decides it, with its run grants |
//! | POST   | `/v1/requests`             | file an access request (`{"host","port","reason","methods"?,"paths"?}`) → 202 `{id}` |
//! | GET    | `/v1/requests/{id}?wait=S` | the request, after waiting up to S (≤ 60) seconds for a decision |
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};

use super::Shared;
use super::denial::RUN_LABEL;
use crate::asks::{AskError, Requester, Wanted};

/// The name the agent answers for itself.
pub const NAME: &str = "egress.internal";
/// Longest wait a long-poll may ask for.
const MAX_WAIT: Duration = Duration::from_secs(60);
const MAX_BODY: usize = 4096;

/// Is `host` (normalised) the agent's own name?
pub fn is_self(host: &str) -> bool {
    host == NAME
}

/// Answer one request to `egress.internal` on `shared`'s listener.
pub(crate) async fn answer(req: Request<Incoming>, shared: &Arc<Shared>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (req.method().clone(), segments.as_slice()) {
        (Method::GET, [""]) => text(StatusCode::OK, help()),
        (Method::GET, ["v1", "self"]) => json_answer(StatusCode::OK, &own(shared)),
        (Method::POST, ["v1", "requests"]) => file(req, shared).await,
        (Method::GET, ["v1", "requests", id]) => match id.parse::<u64>() {
            Ok(id) => poll(id, query.as_deref(), shared).await,
            Err(_) => not_found(),
        },
        (_, ["v1", "self" | "requests"] | ["v1", "requests", _] | [""]) => json_answer(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({ "error": "method not allowed here" }),
        ),
        _ => not_found(),
    }
}

fn help() -> String {
    format!(
        "egress-agent: this workload's network policy, served to it alone.\n\
         GET  http://{NAME}/v1/self                 the policy this workload runs under\n\
         POST http://{NAME}/v1/requests             ask for access: {{\"host\", \"port\", \"reason\"}}\n\
         GET  http://{NAME}/v1/requests/ID?wait=60  the operator's decision\n\
         A refused connection is the policy, not a network failure: ask here instead of \
         working around it.\n"
    )
}

/// The workload's policy as its listener decides it now (the configured policy and its run
/// grants), without credential sources or anything else the workload need not see.
fn own(shared: &Shared) -> Value {
    let (base, grants) = {
        let o = shared
            .overlay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (o.base(), o.granted())
    };
    let identity = shared.identity.as_ref();
    json!({
        "policy": &*shared.name,
        "badge": base.badge(),
        "workload": workload_name(shared),
        "run": identity.and_then(|i| i.context.get(RUN_LABEL)),
        "allow_hosts": base.allow_hosts.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "allow_ports": base.allow_ports,
        "allow_cidrs": base.allow_cidrs.iter().map(|c| {
            let ports: Vec<String> = c.ports.iter().map(u16::to_string).collect();
            if ports.is_empty() { c.net.to_string() } else { format!("{} ports {}", c.net, ports.join(",")) }
        }).collect::<Vec<_>>(),
        // Where the agent adds a credential (the workload holds a placeholder): hosts only.
        "credentials_for": base.credentials.iter().map(|c| format!("{}:{}", c.host, c.port)).collect::<Vec<_>>(),
        "run_grants": grants.into_iter().map(|(id, what)| json!({ "request": id, "allows": what })).collect::<Vec<_>>(),
        "ask": format!("POST http://{NAME}/v1/requests"),
        "takes_requests": shared.ctx.asks().is_some() || shared.ctx.remote_asks().is_some(),
    })
}

fn workload_name(shared: &Shared) -> String {
    match shared.identity.as_ref().and_then(|i| i.container.as_ref()) {
        Some(c) if !c.name.is_empty() => c.name.clone(),
        Some(c) => c.id.clone(),
        None => format!("policy {}", shared.name),
    }
}

async fn file(req: Request<Incoming>, shared: &Arc<Shared>) -> Response<Full<Bytes>> {
    if shared.ctx.asks().is_none() && shared.ctx.remote_asks().is_none() {
        return json_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({ "error": "this agent takes no access requests (a standalone `egress-agent exec` has no operator to decide them): ask the person who started it for a wider policy" }),
        );
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return json_answer(
                StatusCode::PAYLOAD_TOO_LARGE,
                &json!({ "error": format!("at most {MAX_BODY} bytes") }),
            );
        }
    };
    let wanted: Wanted = match serde_json::from_slice(&body) {
        Ok(w) => w,
        Err(e) => {
            return json_answer(
                StatusCode::BAD_REQUEST,
                &json!({ "error": format!("request body: {e} (expected {{\"host\", \"port\", \"reason\", \"methods\"?, \"paths\"?}})") }),
            );
        }
    };
    let me: Arc<dyn crate::asks::GrantTarget> = shared.clone();
    let who = Requester {
        listener: shared.listener_id,
        policy: shared.name.to_string(),
        workload: workload_name(shared),
        run: shared
            .identity
            .as_ref()
            .and_then(|i| i.context.get(RUN_LABEL).cloned()),
        target: Arc::downgrade(&me),
        durable: shared.durable.clone(),
    };
    let filed = match (shared.ctx.asks(), shared.ctx.remote_asks()) {
        (Some(asks), _) => asks.file(who, wanted, SystemTime::now()),
        (None, Some(remote)) => remote.file(who, wanted).await,
        (None, None) => return not_found(),
    };
    match filed {
        Ok(f) => {
            tracing::info!(policy = %shared.name, request = f.id, existing = f.existing, "access request filed");
            json_answer(
                StatusCode::ACCEPTED,
                &json!({
                    "id": f.id,
                    // `[requests]` approved it at once (for this workload's run), or it waits.
                    "state": if f.auto_approved { "approved" } else { "pending" },
                    "existing": f.existing,
                    "poll": format!("http://{NAME}/v1/requests/{}?wait=60", f.id),
                }),
            )
        }
        Err(e) => ask_error(&e),
    }
}

async fn poll(id: u64, query: Option<&str>, shared: &Arc<Shared>) -> Response<Full<Bytes>> {
    let wait = query
        .and_then(|q| form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "wait"))
        .and_then(|(_, v)| v.parse::<u64>().ok())
        .map_or(Duration::ZERO, |s| Duration::from_secs(s).min(MAX_WAIT))
        // Answered before the connection's idle timeout would cut it (`proxy.idle_timeout_ms`).
        .min(
            shared
                .ctx
                .limits()
                .idle_timeout
                .saturating_sub(Duration::from_secs(1)),
        );
    let view = match (shared.ctx.asks(), shared.ctx.remote_asks()) {
        (Some(asks), _) => asks
            .wait(id, shared.listener_id, wait)
            .await
            .map(|v| serde_json::to_value(v).unwrap_or(Value::Null)),
        (None, Some(remote)) => remote.wait(id, shared.listener_id, wait).await,
        (None, None) => None,
    };
    match view {
        Some(v) => json_answer(StatusCode::OK, &v),
        None => not_found(),
    }
}

fn ask_error(e: &AskError) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
    json_answer(status, &json!({ "error": e.to_string() }))
}

fn not_found() -> Response<Full<Bytes>> {
    json_answer(
        StatusCode::NOT_FOUND,
        &json!({ "error": "no such request or path" }),
    )
}

fn json_answer(status: StatusCode, v: &Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(format!("{v}\n"))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}
