//! One HTTP/1.1 `POST` on a connection the caller opened: the OTLP exporter's (plain TCP to a
//! collector) and the access-request webhook's (TCP or TLS). The answer is read — at most
//! `max_answer` bytes — so the connection closes cleanly; a status other than 2xx is an error.
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;

/// What to send, and how an answer is judged.
pub struct Post<'a> {
    pub path: &'a str,
    /// The `Host` header.
    pub authority: &'a str,
    pub content_type: &'static str,
    pub user_agent: Option<&'static str>,
    pub body: Vec<u8>,
    pub max_answer: usize,
    /// Who answered, as an error names it ("collector", "the webhook").
    pub peer: &'static str,
}

/// Send `p` on `io` and read the answer (the caller bounds the time).
pub async fn post_on<S>(io: S, p: Post<'_>) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
    let mut req = hyper::Request::post(p.path)
        .header(hyper::header::HOST, p.authority)
        .header(hyper::header::CONTENT_TYPE, p.content_type);
    if let Some(ua) = p.user_agent {
        req = req.header(hyper::header::USER_AGENT, ua);
    }
    let req = req
        .body(Full::new(Bytes::from(p.body)))
        .map_err(|e| e.to_string())?;
    let (max_answer, peer) = (p.max_answer, p.peer);
    let exchange = async move {
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("request: {e}"))?;
        let status = resp.status();
        http_body_util::Limited::new(resp.into_body(), max_answer)
            .collect()
            .await
            .ok();
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("{peer} answered {status}"))
        }
    };
    // The connection is driven beside the exchange, on this task (no task of its own to
    // outlive the caller): it closes once the exchange is over and `sender` dropped.
    let (result, _) = tokio::join!(exchange, conn);
    result
}
