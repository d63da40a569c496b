//! Responses of intercepted hosts, scrubbed of the policy's bound secrets before the client sees
//! them ([`egress_policy::scrub`] finds every encoded form; this module applies it to HTTP).
//!
//! - Requests to an intercepted host ask for `Accept-Encoding: identity` ([`ask_identity`]): the
//!   scrubber reads the bytes it forwards, and decoding costs CPU the upstream can spare. An
//!   upstream that compresses anyway with `gzip`/`deflate` is decoded as it streams; any other
//!   coding (`br`, `zstd`, stacked codings) is refused with a 502 (`response-encoding-refused`):
//!   bytes the scrubber can't read never reach the sandbox.
//! - Header values carrying a secret are rewritten (the placeholder in place; `Location`
//!   included: the proxy never follows redirects, the client sees the placeholder in them).
//! - A body with a known length up to [`WHOLE_BODY_MAX`] is read whole, scrubbed and sent with
//!   `x-egress-scrubbed: <count>` when anything was replaced. Other bodies stream
//!   ([`ScrubBody`]): each chunk goes on at once except the shortest tail that may still be the
//!   start of an encoded secret (at most the longest pattern minus one byte), so SSE events are
//!   not held back; the count goes out as the `x-egress-scrubbed` trailer where the protocol
//!   carries trailers (h2, and chunked HTTP/1.1 to clients that asked with `TE: trailers`).
//! - Every response that had something replaced gives one `response-secret-scrubbed` event with
//!   where it was found and how many; never the secret.
//! - WebSocket: server frames are scrubbed in place with same-length replacements
//!   ([`egress_policy::scrub::WsScrub`]); the request's `Sec-WebSocket-Extensions` is dropped so
//!   no compressed frames are negotiated.
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};

use super::Shared;
use super::act::At;
use super::request::Target;
use egress_policy::DenyReason;
use egress_policy::scrub::{ScrubStream, Scrubber};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Bodies of at most this many bytes (by `Content-Length`) are read whole before they go on, so
/// the response can say in a header that it was scrubbed.
pub const WHOLE_BODY_MAX: u64 = 64 * 1024;

/// The header (and trailer) naming how many secrets were replaced.
pub const SCRUBBED_HEADER: &str = "x-egress-scrubbed";

/// Ask the upstream for an uncompressed response.
pub fn ask_identity(h: &mut HeaderMap) {
    h.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
}

/// Say in `h` (headers or trailers) how many secrets were replaced, when any were.
fn mark(h: &mut HeaderMap, count: usize) {
    if count > 0 {
        h.insert(
            HeaderName::from_static(SCRUBBED_HEADER),
            HeaderValue::from(count),
        );
    }
}

/// Scrub header values in place; the number of secrets replaced. A value that would not be a
/// valid header value after the swap is dropped with its header.
pub fn scrub_headers(scrubber: &Scrubber, h: &mut HeaderMap) -> usize {
    let mut found = 0;
    let mut changes: Vec<(HeaderName, Vec<HeaderValue>)> = Vec::new();
    for name in h.keys() {
        let values: Vec<&HeaderValue> = h.get_all(name).iter().collect();
        if !values.iter().any(|v| scrubber.contains(v.as_bytes())) {
            continue;
        }
        let mut new = Vec::with_capacity(values.len());
        for v in values {
            match scrubber.scrub(v.as_bytes()) {
                Some((bytes, n)) => {
                    found += n;
                    if let Ok(v) = HeaderValue::from_bytes(&bytes) {
                        new.push(v);
                    }
                }
                None => new.push(v.clone()),
            }
        }
        changes.push((name.clone(), new));
    }
    for (name, values) in changes {
        h.remove(&name);
        for v in values {
            h.append(name.clone(), v);
        }
    }
    found
}

/// How the upstream encoded the body.
enum Coding {
    Identity,
    Gzip(flate2::write::GzDecoder<Vec<u8>>),
    Deflate(flate2::write::ZlibDecoder<Vec<u8>>),
}

impl Coding {
    /// From `Content-Encoding`: `Err(())` for a coding the scrubber can't read.
    fn of(h: &HeaderMap) -> Result<Coding, ()> {
        let mut values = h.get_all(header::CONTENT_ENCODING).iter();
        let Some(v) = values.next() else {
            return Ok(Coding::Identity);
        };
        if values.next().is_some() {
            return Err(());
        }
        let v = v.to_str().map_err(|_| ())?.trim().to_ascii_lowercase();
        match v.as_str() {
            "" | "identity" => Ok(Coding::Identity),
            "gzip" | "x-gzip" => Ok(Coding::Gzip(flate2::write::GzDecoder::new(Vec::new()))),
            "deflate" => Ok(Coding::Deflate(flate2::write::ZlibDecoder::new(Vec::new()))),
            _ => Err(()),
        }
    }

    /// Decode one chunk (`last`: the end of the body).
    fn decode(&mut self, data: &[u8], last: bool) -> std::io::Result<Vec<u8>> {
        use std::io::Write;
        match self {
            Coding::Identity => Ok(data.to_vec()),
            Coding::Gzip(d) => {
                d.write_all(data)?;
                if last {
                    d.try_finish()?;
                }
                Ok(std::mem::take(d.get_mut()))
            }
            Coding::Deflate(d) => {
                d.write_all(data)?;
                if last {
                    d.try_finish()?;
                }
                Ok(std::mem::take(d.get_mut()))
            }
        }
    }
}

/// Who to tell about a scrubbed response.
#[derive(Clone)]
pub(crate) struct Report {
    pub(crate) shared: Arc<Shared>,
    pub(crate) target: Target,
}

impl Report {
    pub(crate) fn found(&self, place: &str, count: usize) {
        if count == 0 {
            return;
        }
        let count = count.to_string();
        let context = [("where", place), ("count", count.as_str())];
        let at = At::target(&self.target, "https").context(&context);
        let _ = self.shared.refuse(&at, DenyReason::ResponseSecretScrubbed);
    }
}

/// The response body to send on instead of `body`: scrubbed (and decoded).
pub(crate) enum Scrubbed {
    /// No body to read: passed on as it is.
    Passed(Incoming),
    /// Read whole and scrubbed.
    Whole(Bytes),
    /// Streaming.
    Stream(Box<ScrubBody>),
}

/// Prepare a response of an intercepted host for the client: decode, scrub headers, and either
/// read the (small) body whole or wrap it in a [`ScrubBody`]. `Err`: the coding can't be read
/// (the caller answers 502) or the body failed. `bodiless`: an answer to `HEAD`, or a 204/304,
/// whose headers describe a body that isn't sent (only the headers are scrubbed).
pub(crate) async fn response(
    scrubber: &Arc<Scrubber>,
    report: &Report,
    parts: &mut http::response::Parts,
    body: Incoming,
    bodiless: bool,
) -> Result<Scrubbed, DenyReason> {
    let bodiless = bodiless
        || parts.status == http::StatusCode::NO_CONTENT
        || parts.status == http::StatusCode::NOT_MODIFIED;
    if bodiless {
        let n = scrub_headers(scrubber, &mut parts.headers);
        report.found("headers", n);
        mark(&mut parts.headers, n);
        return Ok(Scrubbed::Passed(body));
    }
    let coding = Coding::of(&parts.headers).map_err(|()| {
        let at = At::target(&report.target, "https");
        report
            .shared
            .refuse(&at, DenyReason::ResponseEncodingRefused)
            .reason
    })?;
    let decoded = !matches!(coding, Coding::Identity);
    let in_headers = scrub_headers(scrubber, &mut parts.headers);
    report.found("headers", in_headers);
    let small = !decoded
        && parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_some_and(|n| n <= WHOLE_BODY_MAX);
    parts.headers.remove(header::CONTENT_LENGTH);
    if decoded {
        parts.headers.remove(header::CONTENT_ENCODING);
    }
    if small {
        let bytes = body
            .collect()
            .await
            .map_err(|_| DenyReason::ResponseEncodingRefused)?
            .to_bytes();
        let (out, n) = scrubber
            .scrub(&bytes)
            .map_or((bytes, 0), |(b, n)| (Bytes::from(b), n));
        report.found("body", n);
        mark(&mut parts.headers, n + in_headers);
        return Ok(Scrubbed::Whole(out));
    }
    mark(&mut parts.headers, in_headers);
    Ok(Scrubbed::Stream(Box::new(ScrubBody {
        inner: body,
        stream: ScrubStream::new(scrubber.clone()),
        scrubber: scrubber.clone(),
        coding,
        trailers: None,
        done: false,
        report: Some(report.clone()),
    })))
}

/// A response body scrubbed as it streams.
pub(crate) struct ScrubBody {
    inner: Incoming,
    stream: ScrubStream,
    scrubber: Arc<Scrubber>,
    coding: Coding,
    /// Trailers held while the last scrubbed bytes go out first.
    trailers: Option<HeaderMap>,
    done: bool,
    /// Reported (once) when the body ends or is dropped.
    report: Option<Report>,
}

impl ScrubBody {
    fn report(&mut self) {
        if let Some(r) = self.report.take() {
            r.found("body", self.stream.found());
        }
    }

    /// The body ended (with `trailers`, if any): the held tail, then the trailers.
    fn end(&mut self, trailers: Option<HeaderMap>) -> Result<Option<Frame<Bytes>>, BoxError> {
        let mut out = self.coding.decode(&[], true)?;
        let mut tail = Vec::new();
        self.stream.push(&out, &mut tail);
        self.stream.finish(&mut tail);
        out = tail;
        let mut trailers = trailers.unwrap_or_default();
        let in_trailers = scrub_headers(&self.scrubber, &mut trailers);
        if let Some(r) = &self.report {
            r.found("trailers", in_trailers);
        }
        mark(&mut trailers, self.stream.found() + in_trailers);
        self.report();
        self.done = true;
        let trailers = (!trailers.is_empty()).then_some(trailers);
        if out.is_empty() {
            return Ok(trailers.map(Frame::trailers));
        }
        self.trailers = trailers;
        Ok(Some(Frame::data(Bytes::from(out))))
    }
}

impl Drop for ScrubBody {
    fn drop(&mut self) {
        self.report();
    }
}

impl Body for ScrubBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(this.end(None).transpose()),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(Some(Ok(f))) => f,
            };
            match frame.into_data() {
                Ok(data) => {
                    let plain = match this.coding.decode(&data, false) {
                        Ok(p) => p,
                        Err(e) => return Poll::Ready(Some(Err(e.into()))),
                    };
                    let mut out = Vec::new();
                    this.stream.push(&plain, &mut out);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        return Poll::Ready(this.end(Some(t)).transpose());
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
