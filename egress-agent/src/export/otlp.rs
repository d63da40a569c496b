//! OTLP logs export: events as OpenTelemetry log records (the `opentelemetry-proto` crate's
//! message types, protobuf-encoded by prost), POSTed over OTLP/HTTP (`application/x-protobuf`)
//! to a collector's `/v1/logs`.
//!
//! One record per event: `time_unix_nano` = the event's time, severity WARN (deny), INFO2
//! (would-deny) or INFO (allow), `severity_text` = the verdict, body = a one-line summary, and the
//! event's fields as attributes (`egress.verdict`, `egress.source`, `egress.policy`,
//! `egress.host`, `egress.ip`, `egress.port`, `egress.protocol`, `egress.reason`, `egress.rule`
//! (the rule of the policy that decided, when the event names one), `egress.count` (the attempts
//! the event stands for: 1, more for a summary of identical ones), `egress.container.id`, `egress.container.name`, `egress.cgroup_id`, and each context label as
//! `egress.context.<name>`). Resource: `service.name = egress-agent`, `host.name`; a Kubernetes
//! pod's events are in a resource of their own that also carries OpenTelemetry's Kubernetes
//! attributes (`k8s.namespace.name`, `k8s.pod.name`, `k8s.pod.uid`, and `k8s.container.name` when
//! known) — the `k8s.*` context labels the containerd runtime puts on its events.
//!
//! A batch is whatever is queued when the exporter wakes (at most `export.otlp.batch`); a batch
//! the collector refuses or that times out is dropped and counted (`export_errors_total{sink="otlp"}`).
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::logs::v1::{LogRecord, ResourceLogs, ScopeLogs, SeverityNumber};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost::Message;

use super::OtlpConfig;
use crate::events::{DenialEvent, EventSink, Verdict};
use crate::metrics::Metrics;

/// A parsed `export.otlp.endpoint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// Path and query, e.g. `/v1/logs`.
    pub path: String,
}

/// `http://host[:port][/path]` (default port 4318, default path `/v1/logs`).
pub fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(format!(
                "{s:?}: scheme {other:?} not supported (plain http:// to a collector on this host)"
            ));
        }
        None => return Err(format!("{s:?}: expected http://host:port/v1/logs")),
    }
    let authority = uri.authority().ok_or_else(|| format!("{s:?}: no host"))?;
    if authority.as_str().contains('@') {
        return Err(format!("{s:?}: credentials in the URL are not supported"));
    }
    let path = match uri.path_and_query().map(|p| p.as_str()) {
        None | Some("/") | Some("") => "/v1/logs".to_owned(),
        Some(p) => p.to_owned(),
    };
    Ok(Endpoint {
        host: authority.host().trim_matches(['[', ']']).to_owned(),
        port: authority.port_u16().unwrap_or(4318),
        path,
    })
}

fn kv(key: &str, v: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(v) }),
        ..Default::default()
    }
}

fn s(v: impl Into<String>) -> any_value::Value {
    any_value::Value::StringValue(v.into())
}

/// The log record of one event.
pub fn record(ev: &DenialEvent) -> LogRecord {
    let nanos = ev
        .time
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let severity = match ev.verdict {
        Verdict::Deny => SeverityNumber::Warn,
        Verdict::WouldDeny => SeverityNumber::Info2,
        Verdict::Allow => SeverityNumber::Info,
    };
    let mut attributes = vec![
        kv("egress.verdict", s(ev.verdict.as_str())),
        kv("egress.source", s(ev.source.as_str())),
        kv("egress.policy", s(ev.policy.clone())),
    ];
    if let Some(h) = &ev.host {
        attributes.push(kv("egress.host", s(h.clone())));
    }
    if let Some(ip) = ev.ip {
        attributes.push(kv("egress.ip", s(ip.to_string())));
    }
    attributes.push(kv(
        "egress.port",
        any_value::Value::IntValue(ev.port.into()),
    ));
    attributes.push(kv("egress.protocol", s(ev.protocol.clone())));
    attributes.push(kv("egress.reason", s(ev.reason.clone())));
    if let Some(r) = &ev.rule {
        attributes.push(kv("egress.rule", s(r.clone())));
    }
    attributes.push(kv(
        "egress.count",
        any_value::Value::IntValue(i64::try_from(ev.count).unwrap_or(i64::MAX)),
    ));
    if let Some(c) = &ev.container {
        attributes.push(kv("egress.container.id", s(c.id.clone())));
        attributes.push(kv("egress.container.name", s(c.name.clone())));
    }
    if let Some(c) = ev.cgroup_id {
        attributes.push(kv(
            "egress.cgroup_id",
            any_value::Value::IntValue(i64::try_from(c).unwrap_or(i64::MAX)),
        ));
    }
    for (k, v) in &ev.context {
        // `k8s.*` go on the resource (see `request`).
        if !k.starts_with(K8S_PREFIX) {
            attributes.push(kv(&format!("egress.context.{k}"), s(v.clone())));
        }
    }
    LogRecord {
        time_unix_nano: nanos,
        observed_time_unix_nano: nanos,
        severity_number: severity as i32,
        severity_text: ev.verdict.as_str().to_owned(),
        body: Some(AnyValue {
            value: Some(s(super::summary(ev))),
        }),
        attributes,
        event_name: "egress.decision".to_owned(),
        ..Default::default()
    }
}

/// Context labels that are OpenTelemetry Kubernetes resource attributes.
const K8S_PREFIX: &str = "k8s.";

/// A pod's `k8s.*` attributes (empty: not a pod).
type K8sAttributes = Vec<(String, String)>;

/// One export request for `events`: one resource for the agent's own events and containers,
/// and one per Kubernetes pod (its `k8s.*` attributes), in the order they first appear.
pub fn request(events: &[DenialEvent], host_name: &str) -> ExportLogsServiceRequest {
    let mut groups: Vec<(K8sAttributes, Vec<LogRecord>)> = Vec::new();
    for ev in events {
        let k8s: K8sAttributes = ev
            .context
            .iter()
            .filter(|(k, _)| k.starts_with(K8S_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        match groups.iter_mut().find(|(key, _)| *key == k8s) {
            Some((_, records)) => records.push(record(ev)),
            None => groups.push((k8s, vec![record(ev)])),
        }
    }
    let resource_logs = groups
        .into_iter()
        .map(|(k8s, log_records)| {
            let mut attributes = vec![
                kv("service.name", s("egress-agent")),
                kv("service.version", s(env!("CARGO_PKG_VERSION"))),
                kv("host.name", s(host_name)),
            ];
            attributes.extend(k8s.into_iter().map(|(k, v)| kv(&k, s(v))));
            ResourceLogs {
                resource: Some(Resource {
                    attributes,
                    ..Default::default()
                }),
                scope_logs: vec![ScopeLogs {
                    scope: Some(InstrumentationScope {
                        name: "egress-agent".to_owned(),
                        version: env!("CARGO_PKG_VERSION").to_owned(),
                        ..Default::default()
                    }),
                    log_records,
                    ..Default::default()
                }],
                ..Default::default()
            }
        })
        .collect();
    ExportLogsServiceRequest { resource_logs }
}

async fn post(ep: &Endpoint, body: Vec<u8>, timeout: Duration) -> Result<(), String> {
    let go = async {
        let stream = tokio::net::TcpStream::connect((ep.host.as_str(), ep.port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let host = if ep.host.contains(':') {
            format!("[{}]:{}", ep.host, ep.port)
        } else {
            format!("{}:{}", ep.host, ep.port)
        };
        let post = crate::http_post::Post {
            path: &ep.path,
            authority: &host,
            content_type: "application/x-protobuf",
            user_agent: None,
            body,
            // The collector's (small) answer, whole.
            max_answer: usize::MAX,
            peer: "collector",
        };
        crate::http_post::post_on(stream, post).await
    };
    tokio::time::timeout(timeout, go)
        .await
        .map_err(|_| format!("timed out after {timeout:?}"))?
}

/// Start exporting what `sink` emits to the collector (a task; call inside a tokio runtime).
pub fn spawn(
    cfg: &OtlpConfig,
    sink: &EventSink,
    metrics: Option<Arc<Metrics>>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let ep = parse_endpoint(&cfg.endpoint)?;
    let timeout = Duration::from_millis(cfg.timeout_ms);
    let batch_max = cfg.batch;
    let mut tap = sink.tap(cfg.queue, cfg.allowed);
    let host_name = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default();
    Ok(tokio::spawn(async move {
        let mut reported = 0u64;
        while let Some(first) = tap.rx.recv().await {
            let mut batch = vec![first];
            while batch.len() < batch_max {
                match tap.rx.try_recv() {
                    Ok(ev) => batch.push(ev),
                    Err(_) => break,
                }
            }
            let body = request(&batch, &host_name).encode_to_vec();
            if let Err(e) = post(&ep, body, timeout).await {
                tracing::debug!(error = %e, events = batch.len(), "OTLP export failed; batch dropped");
                if let Some(m) = &metrics {
                    m.export_errors("otlp", batch.len() as u64);
                }
            }
            if let Some(m) = &metrics {
                let d = tap.dropped.load(Ordering::Relaxed);
                if d > reported {
                    m.event_drops(crate::metrics::DropSource::Export, d - reported);
                    reported = d;
                }
            }
        }
    }))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("http://127.0.0.1:4318/v1/logs").unwrap(),
            Endpoint {
                host: "127.0.0.1".into(),
                port: 4318,
                path: "/v1/logs".into()
            }
        );
        let e = parse_endpoint("http://[::1]").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.path.as_str()),
            ("::1", 4318, "/v1/logs")
        );
        for bad in [
            "https://c:4318",
            "c:4318",
            "http://u:p@c:4318/v1/logs",
            "ftp://c/",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    fn string_attr(r: &LogRecord, key: &str) -> Option<String> {
        r.attributes.iter().find(|a| a.key == key).and_then(|a| {
            match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => Some(s.clone()),
                _ => None,
            }
        })
    }

    #[test]
    fn the_rule_is_an_attribute_when_the_event_names_one() {
        let mut ev = DenialEvent::proxy(
            "ci",
            Some("api.github.com".into()),
            None,
            22,
            "connect",
            "port-not-allowed",
        );
        assert_eq!(string_attr(&record(&ev), "egress.rule"), None);
        assert_eq!(
            string_attr(&record(&ev), "egress.reason").as_deref(),
            Some("port-not-allowed")
        );
        ev.rule = Some("allow_hosts api.github.com".into());
        assert_eq!(
            string_attr(&record(&ev), "egress.rule").as_deref(),
            Some("allow_hosts api.github.com")
        );
    }

    /// `egress.count`: 1, or the attempts a summary of identical ones stands for.
    #[test]
    fn the_count_is_an_attribute() {
        let count = |ev: &DenialEvent| {
            record(ev)
                .attributes
                .iter()
                .find(|a| a.key == "egress.count")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    any_value::Value::IntValue(n) => Some(*n),
                    _ => None,
                })
        };
        let mut ev = DenialEvent::proxy("ci", Some("a.test".into()), None, 443, "connect", "x");
        assert_eq!(count(&ev), Some(1));
        ev.count = 250;
        assert_eq!(count(&ev), Some(250));
    }

    #[test]
    fn a_pods_events_are_a_resource_with_the_kubernetes_attributes() {
        let plain = DenialEvent::proxy("web", Some("a.test".into()), None, 443, "tls", "x");
        let mut pod = plain.clone();
        pod.context.extend([
            ("k8s.namespace.name".to_owned(), "ci".to_owned()),
            ("k8s.pod.name".to_owned(), "build-1".to_owned()),
            ("k8s.pod.uid".to_owned(), "u-1".to_owned()),
            ("run".to_owned(), "42".to_owned()),
        ]);
        let req = request(&[plain.clone(), pod.clone(), pod], "node-1");
        assert_eq!(
            req.resource_logs.len(),
            2,
            "one resource per pod, one for the rest"
        );
        let attrs = |i: usize| -> Vec<(String, String)> {
            req.resource_logs[i]
                .resource
                .as_ref()
                .unwrap()
                .attributes
                .iter()
                .map(|kv| {
                    let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                        Some(any_value::Value::StringValue(s)) => s.clone(),
                        _ => String::new(),
                    };
                    (kv.key.clone(), v)
                })
                .collect()
        };
        assert!(!attrs(0).iter().any(|(k, _)| k.starts_with("k8s.")));
        for want in [
            ("k8s.namespace.name", "ci"),
            ("k8s.pod.name", "build-1"),
            ("k8s.pod.uid", "u-1"),
        ] {
            assert!(
                attrs(1).contains(&(want.0.to_owned(), want.1.to_owned())),
                "{want:?} missing from {:?}",
                attrs(1)
            );
        }
        let records = &req.resource_logs[1].scope_logs[0].log_records;
        assert_eq!(records.len(), 2);
        let keys: Vec<&str> = records[0]
            .attributes
            .iter()
            .map(|a| a.key.as_str())
            .collect();
        assert!(keys.contains(&"egress.context.run"), "{keys:?}");
        assert!(!keys.iter().any(|k| k.contains("k8s.")), "{keys:?}");
    }
}
