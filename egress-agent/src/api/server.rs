//! Serves the control API on a root-only unix socket.

use std::{
    convert::Infallible,
    future::Future,
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Frame, Incoming},
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tracing::{debug, info, warn};

use super::Control;

type Body = BoxBody<Bytes, Infallible>;

/// Errors binding the control socket.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("another egress-agent is already serving {0}")]
    InUse(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A bound control socket; [`ApiServer::run`] serves it until `shutdown` resolves.
pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
    /// Enforcement roots: a peer whose cgroup is at or below one of them is a confined process
    /// and is refused, whatever its uid.
    refused_roots: Vec<PathBuf>,
}

/// Who is on the other end of a control connection (`SO_PEERCRED`, then its cgroup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Peer {
    uid: Option<u32>,
    /// In an enforcement root — or its cgroup could not be read (refused as well).
    confined: bool,
}

impl Peer {
    fn of(stream: &UnixStream, roots: &[PathBuf]) -> Peer {
        let cred = stream.peer_cred().ok();
        let confined = match cred.and_then(|c| c.pid()) {
            Some(pid) if pid > 0 => match crate::cgroup::cgroup_of_pid(pid as u32) {
                Ok(cg) => roots.iter().any(|r| cg.starts_with(r)),
                Err(_) => true,
            },
            _ => true,
        };
        Peer {
            uid: cred.map(|c| c.uid()),
            confined,
        }
    }
}

impl ApiServer {
    /// Binds `path` (mode 0600). A stale socket file left by a crashed agent is replaced; a live
    /// one (something answers on it) is an error.
    pub async fn bind(path: &Path) -> Result<Self, BindError> {
        let io_err = |source| BindError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_err)?;
        }
        if path.exists() {
            if UnixStream::connect(path).await.is_ok() {
                return Err(BindError::InUse(path.to_owned()));
            }
            std::fs::remove_file(path).map_err(io_err)?;
        }
        let listener = UnixListener::bind(path).map_err(io_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io_err)?;
        info!(socket = %path.display(), "control API listening");
        Ok(Self {
            listener,
            path: path.to_owned(),
            // `exec` commands always; the daemon adds its Docker root.
            refused_roots: crate::exec::exec_root().into_iter().collect(),
        })
    }

    /// Also refuse peers running in these enforcement roots (confined processes), even as root.
    pub fn refusing_roots(mut self, roots: impl IntoIterator<Item = PathBuf>) -> Self {
        self.refused_roots.extend(roots);
        self
    }

    pub async fn run(self, control: Arc<dyn Control>, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let stream = tokio::select! {
                _ = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        warn!(error = %e, "control API accept failed");
                        continue;
                    }
                },
            };
            let control = control.clone();
            let peer = Peer::of(&stream, &self.refused_roots);
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let control = control.clone();
                    async move { Ok::<_, Infallible>(route(req, peer, control.as_ref()).await) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    debug!(error = %e, "control API connection ended");
                }
            });
        }
        std::fs::remove_file(&self.path).ok();
    }
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(status, &json!({ "error": message }))
}

fn query_param<'a>(query: Option<&'a str>, key: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

async fn route(req: Request<Incoming>, peer: Peer, control: &dyn Control) -> Response<Body> {
    if peer.uid != Some(0) {
        warn!(
            peer_uid = ?peer.uid,
            path = req.uri().path(),
            "control API refused a non-root client"
        );
        return error(StatusCode::FORBIDDEN, "the control API is root-only");
    }
    if peer.confined {
        warn!(
            path = req.uri().path(),
            "control API refused a confined process (its cgroup is in an enforcement root)"
        );
        return error(
            StatusCode::FORBIDDEN,
            "the control API refuses confined processes",
        );
    }
    let query = req.uri().query();
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/status") => json_response(StatusCode::OK, &control.status()),
        (&Method::GET, "/v1/containers") => json_response(StatusCode::OK, &control.containers()),
        (&Method::GET, "/v1/policies") => json_response(StatusCode::OK, &control.policies()),
        (&Method::GET, "/v1/events") => {
            if matches!(query_param(query, "follow"), Some("1" | "true")) {
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
            let n = match query_param(query, "n").map(str::parse::<usize>) {
                None => 100,
                Some(Ok(n)) => n,
                Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "n must be a number"),
            };
            json_response(StatusCode::OK, &Value::Array(control.events(n)))
        }
        (&Method::POST, "/v1/reload") => match control.reload().await {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(msg) => error(StatusCode::UNPROCESSABLE_ENTITY, &msg),
        },
        (_, "/v1/status" | "/v1/containers" | "/v1/policies" | "/v1/events" | "/v1/reload") => {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
    }
}
