//! The control API's routes: access first (typed, before any work), then the endpoint.
use std::convert::Infallible;

use http_body_util::{BodyExt, Full, Limited, StreamBody, combinators::BoxBody};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Frame, Incoming},
};
use serde_json::{Value, json};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tracing::warn;

use super::peer::{Access, Peer};
use super::{ApiError, Control, ExplainQuery, ReplayBody, StoreQuery};
use crate::manage::{Body as ChangeBody, Change, Who};

pub type Body = BoxBody<Bytes, Infallible>;

/// Every endpoint [`route`] serves, as (method, OpenAPI path). `docs/api.yaml` must describe each
/// (tests/api_endpoints.rs checks both ways).
pub const ENDPOINTS: &[(&str, &str)] = &[
    ("GET", "/"),
    ("GET", "/ui/{file}"),
    ("GET", "/v1/status"),
    ("GET", "/v1/containers"),
    ("GET", "/v1/policies"),
    ("GET", "/v1/policies/{name}"),
    ("PUT", "/v1/policies/{name}"),
    ("DELETE", "/v1/policies/{name}"),
    ("GET", "/v1/defaults"),
    ("PUT", "/v1/defaults"),
    ("GET", "/v1/export"),
    ("POST", "/v1/import"),
    ("GET", "/v1/explain"),
    ("GET", "/v1/denials"),
    ("GET", "/v1/suggest"),
    ("POST", "/v1/replay"),
    ("GET", "/v1/changes"),
    ("GET", "/v1/doctor"),
    ("GET", "/v1/events"),
    ("GET", "/v1/events/sse"),
    ("POST", "/v1/reload"),
    ("POST", "/v1/restart"),
];

/// Largest request body (a policy, a bundle).
pub const MAX_BODY: usize = 1 << 20;

/// How the request arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Unix,
    /// The loopback TCP address: GET only, loopback `Host` only.
    Tcp(std::net::SocketAddr),
}

pub fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    bytes_response(status, "application/json", body)
}

fn bytes_response(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("cache-control", "no-store")
        .header("x-content-type-options", "nosniff")
        .body(Full::new(Bytes::from(body)).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

pub fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(status, &json!({ "error": message }))
}

fn api_error(e: ApiError) -> Response<Body> {
    json_response(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &e.body,
    )
}

/// A query parameter, percent-decoded.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    form_urlencoded::parse(query?.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

fn flag(query: Option<&str>, key: &str) -> bool {
    matches!(
        query_param(query, key).as_deref(),
        Some("1" | "true" | "yes")
    )
}

fn store_query(query: Option<&str>) -> Result<StoreQuery, ApiError> {
    let n = match query_param(query, "n").map(|n| n.parse::<usize>()) {
        None => 100,
        Some(Ok(n)) => n.min(10_000),
        Some(Err(_)) => return Err(ApiError::new(400, "n must be a number")),
    };
    Ok(StoreQuery {
        selection: crate::store::selection::Selection {
            since: query_param(query, "since"),
            container: query_param(query, "container"),
            policy: query_param(query, "policy"),
            verdict: query_param(query, "verdict"),
            run: query_param(query, "run"),
            labels: form_urlencoded::parse(query.unwrap_or("").as_bytes())
                .filter(|(k, _)| k == "label")
                .map(|(_, v)| v.into_owned())
                .collect(),
            namespace: query_param(query, "namespace"),
            pod: query_param(query, "pod"),
        },
        n,
        include_denied: flag(query, "include_denied"),
        name: query_param(query, "name"),
    })
}

/// The `Host` header of a TCP request must name the loopback address it arrived on: a page of
/// another site that resolves its name to 127.0.0.1 (DNS rebinding) is refused.
fn loopback_host(req: &Request<Incoming>, local: std::net::SocketAddr) -> bool {
    let Some(host) = req.headers().get("host").and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let port = local.port();
    let ok = [
        format!("{}:{port}", local.ip()),
        format!("[{}]:{port}", local.ip()),
        format!("localhost:{port}"),
    ];
    ok.iter().any(|o| o.eq_ignore_ascii_case(host))
}

async fn read_body(req: Request<Incoming>) -> Result<(Option<String>, String), ApiError> {
    let ct = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| ApiError::new(413, format!("request body: {e} (at most {MAX_BODY} bytes)")))?
        .to_bytes();
    let text = String::from_utf8(bytes.to_vec())
        .map_err(|_| ApiError::new(400, "request body: not UTF-8"))?;
    Ok((ct, text))
}

/// Route one request from `peer`.
pub async fn route(
    req: Request<Incoming>,
    peer: &Peer,
    read_gid: Option<u32>,
    transport: Transport,
    control: &dyn Control,
) -> Response<Body> {
    if let Some(refusal) = refusal(&req, peer, read_gid, transport) {
        return refusal;
    }
    let who = Who {
        uid: peer.uid.unwrap_or(u32::MAX),
        pid: peer.pid,
    };
    let query = req.uri().query().map(str::to_owned);
    let query = query.as_deref();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (&method, segments.as_slice()) {
        (&Method::GET, [""]) => to_status_page(),
        (&Method::GET, ["ui", file]) => ui_asset(file),
        (&Method::GET, ["v1", "status"]) => json_response(StatusCode::OK, &control.status()),
        (&Method::GET, ["v1", "containers"]) => {
            json_response(StatusCode::OK, &control.containers())
        }
        (&Method::GET, ["v1", "policies"]) => json_response(StatusCode::OK, &control.policies()),
        (&Method::GET, ["v1", "policies", name]) => match control.policy(name) {
            Some(v) => json_response(StatusCode::OK, &v),
            None => error(StatusCode::NOT_FOUND, &format!("no policy named {name:?}")),
        },
        (&Method::PUT, ["v1", "policies", name]) => {
            let name = (*name).to_owned();
            let (ct, text) = match read_body(req).await {
                Ok(b) => b,
                Err(e) => return api_error(e),
            };
            let change = Change::SetPolicy {
                name,
                body: ChangeBody::from_content_type(ct.as_deref(), text),
            };
            answer(control.change(change, who, flag(query, "dry_run")).await)
        }
        (&Method::DELETE, ["v1", "policies", name]) => {
            let change = Change::DeletePolicy {
                name: (*name).to_owned(),
                force: flag(query, "force"),
            };
            answer(control.change(change, who, flag(query, "dry_run")).await)
        }
        (&Method::GET, ["v1", "defaults"]) => answer(control.defaults()),
        (&Method::PUT, ["v1", "defaults"]) => set_defaults(req, who, query, control).await,
        (&Method::GET, ["v1", "export"]) => export(query, control),
        (&Method::POST, ["v1", "import"]) => {
            let (ct, text) = match read_body(req).await {
                Ok(b) => b,
                Err(e) => return api_error(e),
            };
            let change = Change::Import {
                bundle: ChangeBody::from_content_type(ct.as_deref(), text),
                prune: flag(query, "prune"),
            };
            answer(control.change(change, who, !flag(query, "apply")).await)
        }
        (&Method::GET, ["v1", "explain"]) => {
            let q = ExplainQuery {
                policy: query_param(query, "policy"),
                container: query_param(query, "container"),
                pod: query_param(query, "pod"),
                target: query_param(query, "target").unwrap_or_default(),
                netns: query_param(query, "netns"),
            };
            answer(control.explain(q).await)
        }
        (&Method::GET, ["v1", "denials"]) => answer(
            store_query(query)
                .and_then(|q| control.denials(&q))
                .map(Value::Array),
        ),
        (&Method::GET, ["v1", "suggest"]) => answer(
            store_query(query)
                .and_then(|q| control.suggest(&q))
                .map(|t| json!({ "toml": t })),
        ),
        (&Method::POST, ["v1", "replay"]) => replay(req, control).await,
        (&Method::GET, ["v1", "changes"]) => answer(
            store_query(query)
                .and_then(|q| control.changes(q.n))
                .map(Value::Array),
        ),
        (&Method::GET, ["v1", "doctor"]) => json_response(StatusCode::OK, &control.doctor().await),
        (&Method::GET, ["v1", "events", "sse"]) => events_sse(control),
        (&Method::GET, ["v1", "events"]) => events(query, control),
        (&Method::POST, ["v1", "reload"]) => match control.reload().await {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(msg) => error(StatusCode::UNPROCESSABLE_ENTITY, &msg),
        },
        (&Method::POST, ["v1", "restart"]) => answer(control.restart().await),
        (
            _,
            [
                "v1",
                "status" | "containers" | "policies" | "events" | "reload" | "restart" | "defaults"
                | "export" | "import" | "explain" | "denials" | "suggest" | "replay" | "changes"
                | "doctor",
            ],
        )
        | (_, ["v1", "policies", _])
        | (_, ["v1", "events", "sse"])
        | (_, ["ui", _]) => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
    }
}

/// Who may ask what: the refusal for a client the API does not serve, a TCP client naming
/// another host, or a write from a read-only client; `None` to go on.
fn refusal(
    req: &Request<Incoming>,
    peer: &Peer,
    read_gid: Option<u32>,
    transport: Transport,
) -> Option<Response<Body>> {
    let path = req.uri().path();
    let access = peer.access(read_gid);
    if let Access::Refused(why) = access {
        warn!(peer_uid = ?peer.uid, peer_pid = ?peer.pid, path, why, "control API refused a client");
        return Some(error(StatusCode::FORBIDDEN, why));
    }
    let read_only = access == Access::ReadOnly || matches!(transport, Transport::Tcp(_));
    if let Transport::Tcp(local) = transport
        && !loopback_host(req, local)
    {
        return Some(error(
            StatusCode::FORBIDDEN,
            "the Host header must be the loopback address this listens on",
        ));
    }
    if read_only && !matches!(*req.method(), Method::GET | Method::HEAD) {
        let why = if access == Access::ReadOnly {
            "read-only access (api.read_group): GET only"
        } else {
            "the TCP address serves GET only; changes go through the unix socket"
        };
        return Some(error(StatusCode::FORBIDDEN, why));
    }
    None
}

/// `GET /`: the status page.
fn to_status_page() -> Response<Body> {
    Response::builder()
        .status(StatusCode::SEE_OTHER)
        .header("location", "/ui/")
        .body(Full::new(Bytes::new()).boxed())
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "redirect"))
}

/// `GET /v1/export`: every policy and the defaults, as JSON or (`format=toml`) TOML.
fn export(query: Option<&str>, control: &dyn Control) -> Response<Body> {
    match control.export() {
        Ok(b) if query_param(query, "format").as_deref() == Some("toml") => {
            bytes_response(StatusCode::OK, "application/toml", b.to_toml().into_bytes())
        }
        Ok(b) => json_response(
            StatusCode::OK,
            &serde_json::to_value(b).unwrap_or(Value::Null),
        ),
        Err(e) => api_error(e),
    }
}

/// A file of the status page, with its content security policy.
fn ui_asset(file: &str) -> Response<Body> {
    match crate::ui::asset(file) {
        Some((ct, body)) => {
            let mut r = bytes_response(StatusCode::OK, ct, body.as_bytes().to_vec());
            r.headers_mut().insert(
                "content-security-policy",
                hyper::header::HeaderValue::from_static(crate::ui::CSP),
            );
            r.headers_mut().insert(
                "x-frame-options",
                hyper::header::HeaderValue::from_static("DENY"),
            );
            r
        }
        None => error(StatusCode::NOT_FOUND, "no such file"),
    }
}

/// `PUT /v1/defaults`: `default_policy` and/or `unlabeled`.
async fn set_defaults(
    req: Request<Incoming>,
    who: Who,
    query: Option<&str>,
    control: &dyn Control,
) -> Response<Body> {
    let text = match read_body(req).await {
        Ok((_, t)) => t,
        Err(e) => return api_error(e),
    };
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Defaults {
        default_policy: Option<String>,
        unlabeled: Option<String>,
    }
    let d: Defaults = match serde_json::from_str(&text) {
        Ok(d) => d,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("request body: {e} (a JSON object with default_policy and/or unlabeled)"),
            );
        }
    };
    let change = Change::SetDefaults {
        default_policy: d.default_policy,
        unlabeled: d.unlabeled,
    };
    answer(control.change(change, who, flag(query, "dry_run")).await)
}

/// `POST /v1/replay`: the report, or 400 naming the body's field that is wrong.
async fn replay(req: Request<Incoming>, control: &dyn Control) -> Response<Body> {
    let body = match read_body(req).await {
        Ok((_, text)) => ReplayBody::parse(&text),
        Err(e) => Err(e),
    };
    match body {
        Ok(b) => answer(control.replay(b).await),
        Err(e) => api_error(e),
    }
}

/// `GET /v1/events/sse`: denials as server-sent events, for the status page.
fn events_sse(control: &dyn Control) -> Response<Body> {
    let rx = control.subscribe();
    // A comment first, so the client's EventSource opens at once.
    let hello = tokio_stream::once(Ok::<_, Infallible>(Frame::data(Bytes::from_static(
        b": egress-agent denials\n\n",
    ))));
    let stream = hello.chain(ReceiverStream::new(rx).map(|ev| {
        let data = serde_json::to_string(&ev).unwrap_or_default();
        Ok::<_, Infallible>(Frame::data(Bytes::from(format!(
            "event: denial\ndata: {data}\n\n"
        ))))
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-store")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "stream"))
}

/// `GET /v1/events`: the last `n` (default 100), or a stream of new ones with `follow`.
fn events(query: Option<&str>, control: &dyn Control) -> Response<Body> {
    if flag(query, "follow") {
        let rx = control.subscribe();
        let stream = ReceiverStream::new(rx).map(|ev| {
            let mut line = serde_json::to_vec(&ev).unwrap_or_default();
            line.push(b'\n');
            Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
        });
        return Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/x-ndjson")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "stream"));
    }
    let n = match query_param(query, "n").map(|n| n.parse::<usize>()) {
        None => 100,
        Some(Ok(n)) => n,
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "n must be a number"),
    };
    json_response(StatusCode::OK, &Value::Array(control.events(n)))
}

fn answer(r: Result<Value, ApiError>) -> Response<Body> {
    match r {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => api_error(e),
    }
}
