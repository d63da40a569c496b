//! A small client for the control API ([`crate::api`]), used by the CLI subcommands and by
//! `exec` to file its command's access requests with a daemon ([`crate::asks::remote`]).

use std::path::{Path, PathBuf};

use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode, body::Bytes};
use hyper_util::rt::TokioIo;
use tokio::{io::AsyncWriteExt, net::UnixStream};

/// Errors talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "can't reach the egress-agent daemon at {path}: {source} (is it running? `systemctl status egress-agent`)"
    )]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("control API: {0}")]
    Http(#[from] hyper::Error),
    #[error("control API answered {status}: {body}")]
    Status { status: StatusCode, body: String },
    #[error("control API request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
}

async fn send(
    socket: &Path,
    method: Method,
    path: &str,
) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
    send_body(socket, method, path, None).await
}

/// A request with an optional body (`(content type, bytes)`).
async fn send_body(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
) -> Result<hyper::Response<hyper::body::Incoming>, ClientError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| ClientError::Connect {
            path: socket.to_owned(),
            source,
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "control API client connection ended");
        }
    });
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "egress-agent");
    let body = match body {
        Some((ct, bytes)) => {
            req = req.header("content-type", ct);
            Full::new(Bytes::from(bytes))
        }
        None => Full::new(Bytes::new()),
    };
    Ok(sender.send_request(req.body(body)?).await?)
}

/// One request; returns the body of a 2xx answer, or the error the daemon gave.
pub async fn request(socket: &Path, method: Method, path: &str) -> Result<String, ClientError> {
    let resp = send(socket, method, path).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    if !status.is_success() {
        return Err(ClientError::Status { status, body });
    }
    Ok(body)
}

/// One request with a body; returns the status and the body whatever the status (the caller
/// shows a 422's field and reason).
pub async fn request_body(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
) -> Result<(StatusCode, String), ClientError> {
    let resp = send_body(socket, method, path, body).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Streams a response body (NDJSON) to stdout until the daemon closes it.
pub async fn stream_to_stdout(socket: &Path, path: &str) -> Result<(), ClientError> {
    let mut resp = send(socket, Method::GET, path).await?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.into_body().collect().await?.to_bytes();
        return Err(ClientError::Status {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    let mut out = tokio::io::stdout();
    while let Some(frame) = resp.body_mut().frame().await {
        if let Ok(data) = frame?.into_data() {
            out.write_all(&data).await?;
            out.flush().await?;
        }
    }
    Ok(())
}

/// Streams a response body (NDJSON) line by line to `line` until the daemon closes it.
pub async fn stream_lines(
    socket: &Path,
    path: &str,
    mut line: impl FnMut(&str),
) -> Result<(), ClientError> {
    let mut resp = send(socket, Method::GET, path).await?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.into_body().collect().await?.to_bytes();
        return Err(ClientError::Status {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    let mut pending: Vec<u8> = Vec::new();
    while let Some(frame) = resp.body_mut().frame().await {
        if let Ok(data) = frame?.into_data() {
            pending.extend_from_slice(&data);
            while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
                let l: Vec<u8> = pending.drain(..=nl).collect();
                line(String::from_utf8_lossy(&l[..nl]).trim());
            }
        }
    }
    Ok(())
}

/// A path segment or query value, percent-encoded.
pub fn enc(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}
