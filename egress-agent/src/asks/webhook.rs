//! Announcing new access requests to a chat tool's incoming webhook (`[requests] webhook`,
//! issue #41): one JSON `POST` per request that waits for a decision.
//!
//! [`Webhook::run`] follows [`Asks::subscribe`]: on each change it looks for requests newer than
//! the last it saw, and queues those still pending (an auto-approved request is approved before
//! anyone can see it waiting, so it is never announced; nor are decisions). Filing never waits
//! for it: the registry only bumps a `watch` counter. The queue is bounded ([`QUEUE`]); deliveries
//! go one at a time, each within `timeout_ms`; a failed one (connect, TLS, timeout, a non-2xx
//! answer, a full queue) is logged once as a warning and counted as
//! `export_errors_total{sink="webhook"}`, and never retried. Requests filed before the task starts
//! are not announced.
//!
//! The body is what Slack, Mattermost, Rocket.Chat and Discord's Slack-compatible URL (`/slack`)
//! read — a `text` — plus the request as an object (`egress_request`) for tools that read JSON.
//! The workload writes the reason, the methods and paths (and names itself, for containers): in
//! `text` each is neutralised ([`neutral`]) — control characters (newlines) made spaces, invisible
//! formatting characters (bidi overrides, zero-width) dropped, `&`, `<`, `>` escaped (Slack's markup: no `<!here>`, `<@U…>` or link can form), `@`
//! followed by a zero-width space (no `@channel`, `@here`, `@all`, `@everyone` reaches a
//! channel), backticks replaced, so each stays inside its code span (no Markdown link or
//! formatting either) — and the reason is introduced as the workload's own words.
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;

use super::{Asks, Outcome, View};
use crate::config::webhook::{Resolved, Url, WebhookConfig};
use crate::metrics::Metrics;

/// Requests waiting to be delivered, at most.
pub const QUEUE: usize = 64;
/// The metrics' `sink` label of failed deliveries.
pub const SINK: &str = "webhook";
/// The warning a failed delivery logs (docs/troubleshooting.md is keyed by it).
pub const FAILED: &str = "access request notification failed; the webhook is not retried";
/// A field of `text` is cut to this many characters.
const MAX_FIELD_CHARS: usize = 300;
/// At most this much of the webhook's answer is read.
const MAX_ANSWER: usize = 64 * 1024;

/// Where deliveries go now (`None`: notifications are off).
struct Target {
    url: Url,
    tls: Option<TlsConnector>,
    timeout: Duration,
}

/// The webhook notifier: configured at start and on each reload, run as one task.
pub struct Webhook {
    target: Mutex<Option<Arc<Target>>>,
    metrics: Option<Arc<Metrics>>,
    /// This host's name, in each message (an operator may run many agents).
    node: String,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("on", &self.current().is_some())
            .finish_non_exhaustive()
    }
}

impl Webhook {
    pub fn new(metrics: Option<Arc<Metrics>>) -> Arc<Webhook> {
        let node = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
        Arc::new(Webhook {
            target: Mutex::new(None),
            metrics,
            node,
        })
    }

    fn current(&self) -> Option<Arc<Target>> {
        self.target
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Deliver to `cfg` from now on (`None`: stop). The URL is read from its source again (a
    /// rotated URL is picked up). On an error notifications are off until a later configuration
    /// works; the error names the field, never the URL.
    pub fn configure(
        &self,
        cfg: Option<&WebhookConfig>,
    ) -> Result<bool, egress_policy::ValidationError> {
        let next = cfg.map(|c| c.resolve("requests.webhook").and_then(target));
        let (now, result) = match next {
            None => (None, Ok(false)),
            Some(Ok(t)) => (Some(Arc::new(t)), Ok(true)),
            Some(Err(e)) => (None, Err(e)),
        };
        *self.target.lock().unwrap_or_else(PoisonError::into_inner) = now;
        result
    }

    /// Follow `asks` and deliver, until `stop`.
    pub async fn run(self: Arc<Self>, asks: Arc<Asks>, stop: impl Future<Output = ()>) {
        let (tx, rx) = mpsc::channel::<View>(QUEUE);
        tokio::select! {
            () = stop => {}
            () = self.watch(&asks, tx) => {}
            () = self.deliver(rx) => {}
        }
    }

    /// Queue each new pending request once.
    async fn watch(&self, asks: &Asks, tx: mpsc::Sender<View>) {
        let mut changes = asks.subscribe();
        changes.borrow_and_update();
        let newest = |views: &[View]| views.iter().map(|v| v.id).max();
        let mut seen = newest(&asks.list(false)).unwrap_or(0);
        while changes.changed().await.is_ok() {
            let views = asks.list(false);
            let on = self.current().is_some();
            for v in views.iter().filter(|v| v.id > seen) {
                if !on || v.outcome != Outcome::Pending {
                    continue;
                }
                if tx.try_send(v.clone()).is_err() {
                    self.failed(v.id, &format!("{QUEUE} notifications wait already"));
                }
            }
            seen = newest(&views).unwrap_or(0).max(seen);
        }
    }

    async fn deliver(&self, mut rx: mpsc::Receiver<View>) {
        while let Some(v) = rx.recv().await {
            // A reload may have removed or changed the webhook since the request was queued.
            let Some(t) = self.current() else { continue };
            let body = body(&v, &self.node).to_string();
            match tokio::time::timeout(t.timeout, post(&t, body)).await {
                Ok(Ok(())) => tracing::debug!(request = v.id, "access request notified"),
                Ok(Err(e)) => self.failed(v.id, &e),
                Err(_) => self.failed(v.id, &format!("timed out after {:?}", t.timeout)),
            }
        }
    }

    fn failed(&self, id: u64, error: &str) {
        tracing::warn!(request = id, error, "{FAILED}");
        if let Some(m) = &self.metrics {
            m.export_errors(SINK, 1);
        }
    }
}

/// The delivery settings of a resolved configuration: the system's roots plus `ca_file`.
fn target(r: Resolved) -> Result<Target, egress_policy::ValidationError> {
    let tls = if r.url.https {
        let bad = |m: String| egress_policy::model::verr("requests.webhook.ca_file", m);
        let mut roots = RootCertStore::empty();
        roots.add_parsable_certificates(crate::ca::system_roots().iter().cloned());
        for c in r.extra_roots {
            roots.add(c).map_err(|e| bad(e.to_string()))?;
        }
        let mut cfg =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| bad(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Some(TlsConnector::from(Arc::new(cfg)))
    } else {
        None
    };
    Ok(Target {
        url: r.url,
        tls,
        timeout: r.timeout,
    })
}

/// One `POST` of `body` (the caller bounds the time). Errors never name the URL's path.
async fn post(t: &Target, body: String) -> Result<(), String> {
    let mut addrs: Vec<_> = tokio::net::lookup_host((t.url.host.as_str(), t.url.port))
        .await
        .map_err(|e| format!("resolving {}: {e}", t.url.host))?
        .collect();
    if t.tls.is_none() {
        // Plain HTTP goes to loopback only, whatever the name resolves to.
        addrs.retain(|a| a.ip().is_loopback());
    }
    let mut last = format!("{} has no usable address", t.url.host);
    let mut tcp = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = format!("connect {addr}: {e}"),
        }
    }
    let tcp = tcp.ok_or(last)?;
    match &t.tls {
        None => exchange(t, tcp, body).await,
        Some(tls) => {
            let name = ServerName::try_from(t.url.host.clone())
                .map_err(|e| format!("{}: {e}", t.url.host))?;
            let stream = tls
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS with {}: {e}", t.url.host))?;
            exchange(t, stream, body).await
        }
    }
}

async fn exchange<S>(t: &Target, io: S, body: String) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let authority = t.url.authority();
    let post = crate::http_post::Post {
        path: &t.url.path,
        authority: &authority,
        content_type: "application/json",
        user_agent: Some(concat!("egress-agent/", env!("CARGO_PKG_VERSION"))),
        body: body.into_bytes(),
        max_answer: MAX_ANSWER,
        peer: "the webhook",
    };
    crate::http_post::post_on(io, post).await
}

/// `s` safe to show inside a code span of a chat message, on one line (see the module's doc).
pub fn neutral(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let chars = s
        .chars()
        .filter(|c| !invisible(*c))
        .map(|c| if c.is_control() { ' ' } else { c });
    for (n, c) in chars.enumerate() {
        if n == MAX_FIELD_CHARS {
            out.push('…');
            break;
        }
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '`' => out.push('\''),
            '@' => out.push_str("@\u{200b}"),
            c => out.push(c),
        }
    }
    out
}

/// The invisible characters that reorder or hide text (control characters become spaces).
fn invisible(c: char) -> bool {
    matches!(c,
            '\u{00ad}' | '\u{061c}' | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}')
}

/// A neutralised value as a code span.
fn code(s: &str) -> String {
    format!("`{}`", neutral(s))
}

/// The JSON a delivery posts for request `v` of agent `node`.
pub fn body(v: &View, node: &str) -> Value {
    let approve = format!("egress-agent requests approve {} --scope run", v.id);
    let approve_policy = format!("egress-agent requests approve {} --scope policy", v.id);
    let deny = format!("egress-agent requests deny {} --reason \"...\"", v.id);
    let mut who = format!("workload {} (policy {}", code(&v.workload), code(&v.policy));
    if let Some(run) = &v.run {
        who.push_str(&format!(", run {}", code(run)));
    }
    who.push(')');
    let mut wants = code(&format!("{}:{}", v.host, v.port));
    if !v.methods.is_empty() {
        wants.push_str(&format!(", methods {}", code(&v.methods.join(" "))));
    }
    if !v.paths.is_empty() {
        wants.push_str(&format!(", paths {}", code(&v.paths.join(" "))));
    }
    let text = format!(
        "egress-agent on {}: access request {} waits for a decision.\n{who} asks for {wants}.\n\
         Reason, in the workload's own words (unverified): {}\n\
         Approve for this run: `{approve}` · for the policy: `{approve_policy}` · deny: `{deny}`",
        code(node),
        v.id,
        code(&v.reason),
    );
    json!({
        "text": text,
        "egress_request": {
            "id": v.id,
            "time": v.time,
            "node": node,
            "policy": v.policy,
            "workload": v.workload,
            "run": v.run,
            "host": v.host,
            "port": v.port,
            "methods": v.methods,
            "paths": v.paths,
            "reason": v.reason,
            "approve": approve,
            "approve_policy": approve_policy,
            "deny": deny,
        },
    })
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests;
