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

use super::console::{Console, Grant, Refusal};
use super::peer::{Access, Peer};
use super::session::{LoginRefused, Sessions};
use super::{ApiError, Control, ExplainQuery, ReplayBody, StoreQuery};
use crate::manage::{Body as ChangeBody, Change, Who};

pub type Body = BoxBody<Bytes, Infallible>;

/// Every endpoint [`route`] serves, as (method, OpenAPI path). `docs/api.yaml` must describe each
/// (tests/api_endpoints.rs checks both ways).
pub const ENDPOINTS: &[(&str, &str)] = &[
    ("GET", "/"),
    ("GET", "/ui/{file}"),
    ("GET", "/v1/session"),
    ("POST", "/v1/session"),
    ("DELETE", "/v1/session"),
    ("GET", "/v1/status"),
    ("GET", "/v1/containers"),
    ("GET", "/v1/policies"),
    ("GET", "/v1/policies/{name}"),
    ("PUT", "/v1/policies/{name}"),
    ("DELETE", "/v1/policies/{name}"),
    ("GET", "/v1/presets"),
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
    ("GET", "/v1/requests"),
    ("GET", "/v1/requests/{id}"),
    ("POST", "/v1/requests/{id}/approve"),
    ("POST", "/v1/requests/{id}/deny"),
    ("POST", "/v1/exec/requests"),
];

/// Largest request body (a policy, a bundle).
pub const MAX_BODY: usize = 1 << 20;

/// How the request arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Unix,
    /// `api.ui_listen` (the address it arrived on): see [`super::console`].
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

/// Route one request from `peer` (`console`: when `api.ui_listen` is served).
pub async fn route(
    req: Request<Incoming>,
    peer: &Peer,
    read_gid: Option<u32>,
    (transport, console): (Transport, Option<&Console>),
    control: &dyn Control,
) -> Response<Body> {
    let sessions = console.map(|c| &c.sessions);
    let grant = match admit(&req, peer, read_gid, transport, sessions) {
        Ok(g) => g,
        Err(refusal) => return *refusal,
    };
    let who = Who {
        uid: peer.uid.unwrap_or(u32::MAX),
        pid: peer.pid,
        identity: grant.identity.clone(),
    };
    let query = req.uri().query().map(str::to_owned);
    let query = query.as_deref();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (&method, segments.as_slice()) {
        (&Method::GET, [""]) => to_status_page(),
        (&Method::GET, ["ui", file]) => ui_asset(file),
        (_, ["v1", "session"]) => session(req, &grant, peer, transport, sessions).await,
        (&Method::GET, ["v1", "status"]) => status(control, console),
        (&Method::GET, ["v1", "containers"]) => {
            json_response(StatusCode::OK, &control.containers())
        }
        (&Method::GET, ["v1", "policies"]) => json_response(StatusCode::OK, &control.policies()),
        (&Method::GET, ["v1", "policies", name]) => match control.policy(name) {
            Some(v) => json_response(StatusCode::OK, &v),
            None => error(StatusCode::NOT_FOUND, &format!("no policy named {name:?}")),
        },
        (&Method::PUT, ["v1", "policies", name]) => {
            set_policy(req, name, who, query, control).await
        }
        (&Method::DELETE, ["v1", "policies", name]) => {
            let change = Change::DeletePolicy {
                name: (*name).to_owned(),
                force: flag(query, "force"),
            };
            answer(control.change(change, who, flag(query, "dry_run")).await)
        }
        (&Method::GET, ["v1", "presets"]) => {
            json_response(StatusCode::OK, &super::backend::presets())
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
                .map(|t| json!({ "policy": super::backend::suggested_fields(&t), "toml": t })),
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
        (_, ["v1", "requests", ..] | ["v1", "exec", "requests"]) => {
            let at = (peer, transport, query);
            access_requests(req, &segments[1..], who, at, control).await
        }
        (
            _,
            [
                "v1",
                "status" | "containers" | "policies" | "presets" | "events" | "reload" | "restart"
                | "defaults" | "export" | "import" | "explain" | "denials" | "suggest" | "replay"
                | "changes" | "doctor",
            ],
        )
        | (_, ["v1", "policies", _])
        | (_, ["v1", "events", "sse"])
        | (_, ["ui", _]) => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
    }
}

/// Who may ask what, before any work: on the unix socket by the peer's uid, on the TCP
/// address by [`super::console::admit`]; a write without the right to write is refused.
fn admit(
    req: &Request<Incoming>,
    peer: &Peer,
    read_gid: Option<u32>,
    transport: Transport,
    sessions: Option<&Sessions>,
) -> Result<Grant, Refusal> {
    let path = req.uri().path();
    let grant = match (transport, sessions) {
        (Transport::Tcp(local), Some(sessions)) => {
            super::console::admit(req, peer, read_gid, local, sessions)
        }
        (Transport::Tcp(_), None) => Err(Box::new(error(
            StatusCode::FORBIDDEN,
            "the console has no tokens file configured",
        ))),
        (Transport::Unix, _) => {
            let access = peer.access(read_gid);
            Grant::of_access(access).ok_or_else(|| {
                let why = match access {
                    Access::Refused(why) => why,
                    _ => "refused",
                };
                Box::new(error(StatusCode::FORBIDDEN, why))
            })
        }
    };
    let grant = match grant {
        Ok(g) => g,
        Err(refusal) => {
            warn!(peer_uid = ?peer.uid, peer_pid = ?peer.pid, remote = peer.remote, path,
                status = %refusal.status(), "control API refused a request");
            return Err(refusal);
        }
    };
    let read = matches!(*req.method(), Method::GET | Method::HEAD);
    // The login and logout are writes of their own kind (checked by `console::admit`).
    let session_call = path == "/v1/session";
    if !read && !grant.write && !session_call {
        let why = if transport == Transport::Unix {
            "read-only access (api.read_group): GET only"
        } else {
            "log in to change anything (a session and its CSRF token, or a bearer token)"
        };
        return Err(Box::new(error(StatusCode::FORBIDDEN, why)));
    }
    Ok(grant)
}

/// `/v1/session`: who the caller is to the API (GET), a console login (POST) or logout
/// (DELETE). Sessions exist on the TCP address only; on the unix socket the peer's uid is the
/// identity.
async fn session(
    req: Request<Incoming>,
    grant: &Grant,
    peer: &Peer,
    transport: Transport,
    sessions: Option<&Sessions>,
) -> Response<Body> {
    let method = req.method().clone();
    let Some(sessions) = sessions.filter(|_| matches!(transport, Transport::Tcp(_))) else {
        return match method {
            Method::GET => json_response(
                StatusCode::OK,
                &json!({ "via": "peer", "uid": peer.uid, "write": grant.write }),
            ),
            _ => error(
                StatusCode::BAD_REQUEST,
                "the control socket knows its clients by uid; sessions are for api.ui_listen",
            ),
        };
    };
    match method {
        Method::GET => match (&grant.session, &grant.identity) {
            (Some(s), _) => json_response(
                StatusCode::OK,
                &json!({ "via": "session", "name": s.name, "csrf": s.csrf, "write": true }),
            ),
            (None, Some(id)) => json_response(
                StatusCode::OK,
                &json!({ "via": "token", "name": id, "write": grant.write }),
            ),
            (None, None) => json_response(
                StatusCode::UNAUTHORIZED,
                &json!({
                    "error": "not logged in",
                    "tokens": sessions.tokens().any(),
                    "read": !peer.remote && Grant::of_access(peer.access(None)).is_some(),
                }),
            ),
        },
        Method::POST => login(req, sessions).await,
        Method::DELETE => match &grant.session {
            Some(_) => {
                if let Some(c) = super::session::cookie_value(
                    req.headers()
                        .get_all("cookie")
                        .iter()
                        .filter_map(|h| h.to_str().ok()),
                ) {
                    sessions.logout(c);
                }
                let mut r = json_response(StatusCode::OK, &json!({ "logged_out": true }));
                if let Ok(v) = hyper::header::HeaderValue::from_str(&super::session::clear_cookie())
                {
                    r.headers_mut().insert("set-cookie", v);
                }
                r
            }
            None => error(StatusCode::BAD_REQUEST, "no session to end"),
        },
        _ => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
    }
}

/// `POST /v1/session` with `{"token": "..."}`: a session cookie and its CSRF token.
async fn login(req: Request<Incoming>, sessions: &Sessions) -> Response<Body> {
    let text = match read_body(req).await {
        Ok((_, t)) => t,
        Err(e) => return api_error(e),
    };
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        token: String,
    }
    let body: Body = match serde_json::from_str(&text) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("request body: {e} (a JSON object with token)"),
            );
        }
    };
    match sessions.login(&body.token) {
        Ok(l) => {
            tracing::info!(name = %l.session.name, "console login");
            let mut r = json_response(
                StatusCode::OK,
                &json!({ "name": l.session.name, "csrf": l.session.csrf }),
            );
            if let Ok(v) =
                hyper::header::HeaderValue::from_str(&super::session::set_cookie(&l.cookie))
            {
                r.headers_mut().insert("set-cookie", v);
            }
            r
        }
        Err(LoginRefused::Wrong) => {
            warn!("console login refused: not a console token");
            error(
                StatusCode::UNAUTHORIZED,
                "not a console token (`egress-agent console token NAME --rotate` as root on the host gives a new one)",
            )
        }
        Err(LoginRefused::TooMany) => error(
            StatusCode::TOO_MANY_REQUESTS,
            "too many wrong tokens in the last minute: wait, then try again",
        ),
        Err(LoginRefused::Unavailable) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the system's random source failed",
        ),
    }
}

/// `GET /v1/status`: the daemon's, with the console's own counters when it is served.
fn status(control: &dyn Control, console: Option<&Console>) -> Response<Body> {
    let mut status = control.status();
    if let (Some(c), Some(obj)) = (console, status.as_object_mut()) {
        obj.insert("console".to_owned(), c.status());
    }
    json_response(StatusCode::OK, &status)
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

/// `PUT /v1/policies/{name}`: the body (TOML or JSON by its content type) as the policy.
async fn set_policy(
    req: Request<Incoming>,
    name: &str,
    who: Who,
    query: Option<&str>,
    control: &dyn Control,
) -> Response<Body> {
    let (ct, text) = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return api_error(e),
    };
    let change = Change::SetPolicy {
        name: name.to_owned(),
        body: ChangeBody::from_content_type(ct.as_deref(), text),
    };
    answer(control.change(change, who, flag(query, "dry_run")).await)
}

/// Workloads' access requests: `GET /v1/requests[/{id}]`, `POST /v1/requests/{id}/approve|deny`,
/// `POST /v1/exec/requests` (`path`: after `v1/`).
async fn access_requests(
    req: Request<Incoming>,
    path: &[&str],
    who: Who,
    (peer, transport, query): (&Peer, Transport, Option<&str>),
    control: &dyn Control,
) -> Response<Body> {
    let method = req.method().clone();
    match (&method, path) {
        (&Method::GET, ["requests"]) => answer(control.requests(flag(query, "pending"))),
        (&Method::GET, ["requests", id]) => match id.parse::<u64>() {
            Ok(id) => {
                let wait = query_param(query, "wait")
                    .and_then(|w| w.parse::<u64>().ok())
                    .map_or(std::time::Duration::ZERO, |s| {
                        std::time::Duration::from_secs(s.min(MAX_REQUEST_WAIT_S))
                    });
                answer(control.request(id, wait).await)
            }
            Err(_) => error(StatusCode::NOT_FOUND, "no such request"),
        },
        (&Method::POST, ["requests", id, action @ ("approve" | "deny")]) => {
            decide(req, id, *action == "approve", who, query, control).await
        }
        (&Method::POST, ["exec", "requests"]) => {
            file_for_command(req, peer, transport, control).await
        }
        (_, ["requests"] | ["requests", _] | ["requests", _, "approve" | "deny"])
        | (_, ["exec", "requests"]) => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
    }
}

/// Longest wait `GET /v1/requests/{id}?wait=S` takes.
const MAX_REQUEST_WAIT_S: u64 = 60;

/// `POST /v1/exec/requests`: a command under `egress-agent exec` files an access request
/// through its exec ([`crate::asks::commands`]). The requester is the connection's process (its
/// `SO_PEERCRED` pid), so only the control socket takes it.
async fn file_for_command(
    req: Request<Incoming>,
    peer: &Peer,
    transport: Transport,
    control: &dyn Control,
) -> Response<Body> {
    let (Transport::Unix, Some(pid)) = (transport, peer.pid) else {
        return error(
            StatusCode::FORBIDDEN,
            "only an exec on the control socket files requests for its command",
        );
    };
    let body = match read_body(req).await {
        Ok((_, text)) => serde_json::from_str::<crate::asks::commands::CommandRequest>(&text)
            .map_err(|e| {
                ApiError::new(
                    400,
                    format!("request body: {e} (expected {{\"workload\", \"policy\", \"run\"?, \"request\": {{\"host\", \"port\", \"reason\"}}}})"),
                )
            }),
        Err(e) => Err(e),
    };
    match body {
        Ok(r) => match control.file_for_command(pid, r) {
            Ok(v) => json_response(StatusCode::ACCEPTED, &v),
            Err(e) => api_error(e),
        },
        Err(e) => api_error(e),
    }
}

/// `POST /v1/requests/{id}/approve|deny`: a workload's access request decided as `who`.
async fn decide(
    req: Request<Incoming>,
    id: &str,
    approve: bool,
    who: Who,
    query: Option<&str>,
    control: &dyn Control,
) -> Response<Body> {
    let Ok(id) = id.parse::<u64>() else {
        return error(StatusCode::NOT_FOUND, "no such request");
    };
    let decision = match read_body(req).await {
        Ok((_, text)) => crate::asks::Decision::parse(approve, &text).map_err(ApiError::from),
        Err(e) => Err(e),
    };
    match decision {
        Ok(d) => answer(control.decide(id, d, who, flag(query, "dry_run")).await),
        Err(e) => api_error(e),
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
