//! Event export: RFC 5424 syslog ([`syslog`]) and OTLP logs over HTTP ([`otlp`]).
//!
//! Each exporter is a task fed by its own bounded [`crate::events::EventSink`] tap, so a slow or
//! unreachable receiver costs dropped exports (counted: `event_drops_total{source="export"}`,
//! `export_errors_total{sink}`), never a waiting proxy. Exported fields are the event's own —
//! no URL, path, query string, header or body exists to export.
pub mod otlp;
pub mod syslog;

use serde::{Deserialize, Serialize};

use egress_policy::ValidationError;
use egress_policy::model::verr;

/// `[export]`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExportConfig {
    /// RFC 5424 syslog. Default: off.
    pub syslog: Option<SyslogConfig>,
    /// OTLP logs (OTLP/HTTP, protobuf). Default: off.
    pub otlp: Option<OtlpConfig>,
}

/// `[export.syslog]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyslogConfig {
    /// `udp://host:port`, `tcp://host:port` (octet-counted framing, RFC 6587) or
    /// `unix:///path` (a datagram socket such as `/dev/log`). Required.
    pub address: String,
    /// Facility name (`daemon`, `local0` … `local7`, `auth`, `user`, ...). Default `daemon`.
    #[serde(default = "default_facility")]
    pub facility: String,
    /// Also export allowed traffic (one message per allowed request/tunnel). Default false.
    #[serde(default)]
    pub allowed: bool,
    /// Events waiting for the receiver, at most; more are dropped and counted. Default 8 192.
    #[serde(default = "default_queue")]
    pub queue: usize,
}

/// `[export.otlp]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// The collector's OTLP/HTTP logs endpoint, e.g. `http://127.0.0.1:4318/v1/logs`. Required.
    /// Plain HTTP only: use a collector on the host (or a local relay) for TLS to a remote one.
    pub endpoint: String,
    /// Per-request timeout. Default 5 000 ms.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Most log records per export request. Default 512.
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// Also export allowed traffic. Default false.
    #[serde(default)]
    pub allowed: bool,
    /// Events waiting for the collector, at most; more are dropped and counted. Default 8 192.
    #[serde(default = "default_queue")]
    pub queue: usize,
}

fn default_facility() -> String {
    "daemon".to_owned()
}
fn default_queue() -> usize {
    8192
}
fn default_timeout_ms() -> u64 {
    5_000
}
fn default_batch() -> usize {
    512
}

impl ExportConfig {
    pub fn validate(&self) -> Result<(), ValidationError> {
        if let Some(s) = &self.syslog {
            syslog::Target::parse(&s.address).map_err(|m| verr("export.syslog.address", m))?;
            syslog::facility(&s.facility).ok_or_else(|| {
                verr(
                    "export.syslog.facility",
                    format!("unknown facility {:?}", s.facility),
                )
            })?;
            if !(1..=1 << 20).contains(&s.queue) {
                return Err(verr("export.syslog.queue", "must be between 1 and 1048576"));
            }
        }
        if let Some(o) = &self.otlp {
            otlp::parse_endpoint(&o.endpoint).map_err(|m| verr("export.otlp.endpoint", m))?;
            if o.timeout_ms == 0 {
                return Err(verr("export.otlp.timeout_ms", "must be > 0"));
            }
            if !(1..=65_536).contains(&o.batch) {
                return Err(verr("export.otlp.batch", "must be between 1 and 65536"));
            }
            if !(1..=1 << 20).contains(&o.queue) {
                return Err(verr("export.otlp.queue", "must be between 1 and 1048576"));
            }
        }
        Ok(())
    }
}

/// A running exporter: it ends once its tap is closed ([`crate::events::EventSink::close_taps`])
/// and what was queued has been sent (or failed).
pub enum Exporter {
    /// OTLP: a tokio task.
    Otlp(tokio::task::JoinHandle<()>),
    /// syslog: a thread (blocking sockets, one reconnect per message).
    Syslog(std::thread::JoinHandle<()>),
}

impl Exporter {
    pub fn name(&self) -> &'static str {
        match self {
            Exporter::Otlp(_) => "otlp",
            Exporter::Syslog(_) => "syslog",
        }
    }

    /// Wait until the exporter has sent what it had queued and ended.
    pub async fn finished(self) {
        match self {
            Exporter::Otlp(t) => {
                t.await.ok();
            }
            Exporter::Syslog(t) => {
                tokio::task::spawn_blocking(move || t.join().ok())
                    .await
                    .ok();
            }
        }
    }
}

/// Start the configured exporters on `events` (inside a tokio runtime).
pub fn start(
    config: &ExportConfig,
    events: &crate::events::EventSink,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
) -> Result<Vec<Exporter>, String> {
    let mut running = Vec::new();
    if let Some(s) = &config.syslog {
        running.push(Exporter::Syslog(syslog::spawn(s, events, metrics.clone())?));
    }
    if let Some(o) = &config.otlp {
        running.push(Exporter::Otlp(otlp::spawn(o, events, metrics)?));
    }
    Ok(running)
}

/// The text of one event for a log line: the verdict and the destination.
pub(crate) fn summary(ev: &crate::events::DenialEvent) -> String {
    let dest = match (&ev.host, ev.ip) {
        (Some(h), _) => h.clone(),
        (None, Some(ip)) if ip.is_ipv6() => format!("[{ip}]"),
        (None, Some(ip)) => ip.to_string(),
        (None, None) => "-".to_owned(),
    };
    let count = if ev.count == 1 {
        String::new()
    } else {
        format!(" count={}", ev.count)
    };
    format!(
        "{} {} {}:{} policy={} reason={}{count}",
        ev.verdict, ev.protocol, dest, ev.port, ev.policy, ev.reason
    )
}
