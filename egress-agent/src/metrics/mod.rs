//! Prometheus metrics and the opt-in `/metrics` listener.
//!
//! Metric families (OpenMetrics text, prefix `egress_agent_`):
//! - `decisions_total{verdict, reason, policy}`: proxy and kernel decisions (`verdict` =
//!   allow|deny|would-deny; `would-deny` counts what a policy in `enforce = "audit"` let through).
//!   `allow` (reason `allowed`) counts proxy requests/CONNECTs forwarded (kernel allows are in the
//!   per-cgroup kernel counters, not here); `deny` counts every denial event, both sources.
//! - `kernel_denials_total{hook}`: denials reported by the kernel programs (connect4, sendmsg6, ...).
//! - `proxy_connections_total{policy}`: client connections accepted by the policy's listener.
//! - `proxy_bytes_total{policy, direction}`: bytes relayed (`direction` = upstream|downstream),
//!   added as each chunk is written on, so a long-lived tunnel or download moves while it runs.
//! - `enforced_containers`: containers and pods with a policy entry in the kernel (gauge).
//! - `draining_connections`: connections the previous agent still relays after handing its
//!   sockets to this one (a restart or upgrade; gauge, 0 once it exited).
//! - `pod_denials_total{namespace, pod, verdict}`: a Kubernetes pod's denials (`deny`, and
//!   `would-deny` under audit), both sources. The one family with workload names in its labels,
//!   as the kubelet's own per-pod metrics have them: a node runs a bounded number of pods
//!   (kubelet `maxPods`, 110 by default), and a pod's series are dropped once it is gone
//!   ([`Metrics::retain_pods`]), so they come and go with the node's pods. Docker containers
//!   are counted in `decisions_total` only.
//! - `event_drops_total{source}`: events lost (`kernel` ring buffer overflow, `ring` in-memory ring,
//!   `store` the event store's queue full, `export` an exporter's queue full).
//! - `store_bytes`: the event store's size on disk (database + WAL); `store_write_errors_total`:
//!   failed store transactions (their events are lost).
//! - `export_errors_total{sink}`: events a syslog or OTLP exporter could not deliver; `webhook`:
//!   access request announcements `[requests] webhook` could not deliver.
//! - `reconcile_errors_total`: Docker watcher sessions that failed (Docker unreachable, reconcile
//!   failed, event stream lost); each is followed by a reconnect with backoff.
//! - `dns_answers_total{policy, outcome}`: answers the DNS responder sent ([`DnsOutcome`]:
//!   `allowed` addresses answered and reported to the kernel side, `empty` an allowed name without
//!   addresses of that type, `denied` NXDOMAIN/REFUSED with a denial event, `truncated` TC set for
//!   a UDP client, `servfail`, `formerr` malformed or unsupported queries).
//! - `dns_dropped_total{policy, reason}`: datagrams and messages the responder did not answer
//!   (`malformed` shorter than a header or cut off, `response` QR=1, `bad-source` port 0 or an
//!   unspecified/broadcast source, `send-failed` the answer could not be sent).
//! - `dns_tcp_refused_total{policy}`: DNS-over-TCP connections closed at once because the
//!   responder already had its most open (`dns::tcp::MAX_TCP_CONNECTIONS`).
//!
//! Label values are bounded by construction: `verdict`, `reason`, `hook`, `direction`, `source` are
//! `&'static str` from typed enums; `policy` is a configured policy name. Never put hostnames,
//! addresses or container names in a label (unbounded cardinality, and they are data, not metrics);
//! `pod_denials_total` is the bounded exception above.
//!
//! The listener ([`listener`]) is opt-in and loopback-only: [`bind`] refuses any other address unless the caller
//! passes `allow_non_loopback` (a config flag the operator has to set). It serves `GET /metrics` and
//! nothing else, reads request heads under a timeout, and bounds concurrent connections.

mod listener;

pub use listener::{CONTENT_TYPE, bind, bind_handed, serve};

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error(
        "metrics address {0} is not a loopback address; metrics are served on loopback only unless explicitly allowed"
    )]
    NotLoopback(SocketAddr),
    /// The cause is the source (printed after `: ` by `{:#}`), not repeated in the message.
    #[error("cannot listen for metrics on {0} (--metrics-listen)")]
    Bind(SocketAddr, #[source] std::io::Error),
    #[error("encoding metrics failed")]
    Encode(#[from] std::fmt::Error),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    verdict: &'static str,
    reason: String,
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    namespace: String,
    pod: String,
    verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookLabels {
    hook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BytesLabels {
    policy: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsLabels {
    policy: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsDropLabels {
    policy: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: &'static str,
}

/// Verdict label values: the event's own verdict (`allow`, `deny`, `would-deny`).
pub use crate::events::Verdict;

/// Direction of relayed bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client → upstream.
    Upstream,
    /// Upstream → client.
    Downstream,
}

/// Where events were lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropSource {
    /// The kernel ring buffer was full.
    Kernel,
    /// The in-memory event ring overwrote unread events.
    Ring,
    /// The event store's queue was full.
    Store,
    /// An exporter's queue was full (or its receiver unreachable).
    Export,
}

/// `outcome` of a DNS answer (`dns_answers_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnsOutcome {
    /// Addresses answered (the answer sink heard of them).
    Allowed,
    /// An allowed name, no addresses of the asked type (NODATA, or the upstream's NXDOMAIN).
    Empty,
    /// NXDOMAIN or REFUSED with a denial event.
    Denied,
    /// The answer did not fit the UDP client's payload: TC set, no records.
    Truncated,
    /// The upstream failed, or too many lookups were in flight.
    ServFail,
    /// FORMERR or NOTIMP: a malformed or unsupported query.
    FormErr,
}

impl DnsOutcome {
    pub const ALL: [DnsOutcome; 6] = [
        DnsOutcome::Allowed,
        DnsOutcome::Empty,
        DnsOutcome::Denied,
        DnsOutcome::Truncated,
        DnsOutcome::ServFail,
        DnsOutcome::FormErr,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DnsOutcome::Allowed => "allowed",
            DnsOutcome::Empty => "empty",
            DnsOutcome::Denied => "denied",
            DnsOutcome::Truncated => "truncated",
            DnsOutcome::ServFail => "servfail",
            DnsOutcome::FormErr => "formerr",
        }
    }
}

/// Why the DNS responder sent nothing (`dns_dropped_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnsDrop {
    /// Shorter than a header, or cut off (larger than the receive buffer).
    Malformed,
    /// A response (QR=1): never answered, against reflection loops.
    Response,
    /// From port 0 or an unspecified/broadcast address: nowhere to answer.
    BadSource,
    /// The answer was built but the socket refused it.
    SendFailed,
}

impl DnsDrop {
    pub const ALL: [DnsDrop; 4] = [
        DnsDrop::Malformed,
        DnsDrop::Response,
        DnsDrop::BadSource,
        DnsDrop::SendFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DnsDrop::Malformed => "malformed",
            DnsDrop::Response => "response",
            DnsDrop::BadSource => "bad-source",
            DnsDrop::SendFailed => "send-failed",
        }
    }
}

/// One DNS responder's counters (see [`Metrics::dns_counters`]): label lookups done once, at bind,
/// so the responder's hot path is a relaxed atomic add.
#[derive(Clone, Debug)]
pub struct DnsCounters {
    answers: [Counter; 6],
    dropped: [Counter; 4],
    tcp_refused: Counter,
}

impl DnsCounters {
    pub fn answer(&self, outcome: DnsOutcome) {
        self.answers[outcome as usize].inc();
    }

    pub fn dropped(&self, reason: DnsDrop) {
        self.dropped[reason as usize].inc();
    }

    pub fn tcp_refused(&self) {
        self.tcp_refused.inc();
    }
}

/// `reason` label of allowed proxy decisions.
pub const ALLOWED: &str = "allowed";

/// One policy listener's counters (see [`Metrics::proxy_counters`]). Clones share the values;
/// the series exist (at 0) from the moment the handles are created.
#[derive(Clone, Debug)]
pub struct ProxyCounters {
    connections: Counter,
    allowed: Counter,
    bytes_upstream: Counter,
    bytes_downstream: Counter,
}

impl ProxyCounters {
    /// A client connection accepted.
    pub fn connection(&self) {
        self.connections.inc();
    }

    /// A request or CONNECT allowed and forwarded (`decisions_total{verdict="allow",reason="allowed"}`).
    pub fn allowed(&self) {
        self.allowed.inc();
    }

    /// Bytes relayed (one chunk, or the bytes a client pipelined after its CONNECT head).
    pub fn bytes(&self, upstream: u64, downstream: u64) {
        if upstream > 0 {
            self.bytes_upstream.inc_by(upstream);
        }
        if downstream > 0 {
            self.bytes_downstream.inc_by(downstream);
        }
    }
}

/// Count every denial event of `events` from now on into `metrics` (both sources), until the
/// sink closes: run it on a task of its own, off the hot path (the agent runs it until its
/// stop). Events a slow counter missed are counted as `event_drops{source="ring"}`.
pub fn denial_counter(
    events: &crate::events::EventSink,
    metrics: Arc<Metrics>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = events.subscribe();
    async move {
        loop {
            match rx.recv().await {
                Ok(ev) => metrics.record_denial(&ev),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    metrics.event_drops(DropSource::Ring, n);
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

/// The agent's metrics. Cheap to update from any thread; share it as `Arc<Metrics>`.
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    kernel_denials: Family<HookLabels, Counter>,
    proxy_connections: Family<PolicyLabels, Counter>,
    proxy_bytes: Family<BytesLabels, Counter>,
    enforced_containers: Gauge,
    draining_connections: Gauge,
    event_drops: Family<SourceLabels, Counter>,
    reconcile_errors: Counter,
    reload_errors: Counter,
    store_bytes: Gauge,
    store_write_errors: Counter,
    export_errors: Family<SinkLabels, Counter>,
    dns_answers: Family<DnsLabels, Counter>,
    dns_dropped: Family<DnsDropLabels, Counter>,
    dns_tcp_refused: Family<PolicyLabels, Counter>,
    pod_denials: Family<PodLabels, Counter>,
    /// The pods (namespace, name) `pod_denials` has series for.
    pods: Mutex<HashSet<(String, String)>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SinkLabels {
    sink: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("egress_agent");
        let decisions = Family::default();
        let kernel_denials = Family::default();
        let proxy_connections = Family::default();
        let proxy_bytes = Family::default();
        let enforced_containers = Gauge::default();
        let draining_connections = Gauge::default();
        let event_drops = Family::default();
        let reconcile_errors = Counter::default();
        let reload_errors = Counter::default();
        let store_bytes = Gauge::default();
        let store_write_errors = Counter::default();
        let export_errors = Family::default();
        let dns_answers = Family::default();
        let dns_dropped = Family::default();
        let dns_tcp_refused = Family::default();
        let pod_denials = Family::default();
        registry.register(
            "pod_denials",
            "Denials of a Kubernetes pod, by namespace, pod and verdict (series of removed pods are dropped)",
            pod_denials.clone(),
        );
        registry.register(
            "dns_answers",
            "Answers of the DNS responder, by policy and outcome",
            dns_answers.clone(),
        );
        registry.register(
            "dns_dropped",
            "DNS queries the responder did not answer, by policy and reason",
            dns_dropped.clone(),
        );
        registry.register(
            "dns_tcp_refused",
            "DNS-over-TCP connections refused because the responder had its most open",
            dns_tcp_refused.clone(),
        );
        registry.register(
            "store_bytes",
            "Size of the event store on disk (database and WAL)",
            store_bytes.clone(),
        );
        registry.register(
            "store_write_errors",
            "Event store transactions that failed (their events were dropped)",
            store_write_errors.clone(),
        );
        registry.register(
            "export_errors",
            "Events an exporter could not deliver, by sink (syslog, otlp, webhook)",
            export_errors.clone(),
        );
        registry.register(
            "decisions",
            "Egress decisions by verdict, reason and policy",
            decisions.clone(),
        );
        registry.register(
            "kernel_denials",
            "Denials reported by the kernel programs, by hook",
            kernel_denials.clone(),
        );
        registry.register(
            "proxy_connections",
            "Client connections accepted by the proxy, by policy",
            proxy_connections.clone(),
        );
        registry.register(
            "proxy_bytes",
            "Bytes relayed by the proxy, by policy and direction",
            proxy_bytes.clone(),
        );
        registry.register(
            "enforced_containers",
            "Containers and pods with a policy entry in the kernel",
            enforced_containers.clone(),
        );
        registry.register(
            "draining_connections",
            "Connections the previous agent still relays after a hand-over (restart, upgrade)",
            draining_connections.clone(),
        );
        registry.register(
            "event_drops",
            "Denial events lost, by where they were lost",
            event_drops.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Docker watcher sessions that failed (reconnect and full reconcile follow)",
            reconcile_errors.clone(),
        );
        registry.register(
            "reload_errors",
            "Configuration reloads rejected (the running policy stayed in force)",
            reload_errors.clone(),
        );
        Metrics {
            registry,
            decisions,
            kernel_denials,
            proxy_connections,
            proxy_bytes,
            enforced_containers,
            draining_connections,
            event_drops,
            reconcile_errors,
            reload_errors,
            store_bytes,
            store_write_errors,
            export_errors,
            dns_answers,
            dns_dropped,
            dns_tcp_refused,
            pod_denials,
            pods: Mutex::default(),
        }
    }

    /// Drop the `pod_denials` series of every pod not in `live` (namespace, name): a removed
    /// pod's series go with it.
    pub fn retain_pods(&self, live: &HashSet<(String, String)>) {
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        pods.retain(|(namespace, pod)| {
            if live.contains(&(namespace.clone(), pod.clone())) {
                return true;
            }
            for verdict in [Verdict::Deny, Verdict::WouldDeny] {
                self.pod_denials.remove(&PodLabels {
                    namespace: namespace.clone(),
                    pod: pod.clone(),
                    verdict: verdict.as_str(),
                });
            }
            false
        });
    }

    /// Counter handles of one policy's DNS responder; every series exists (at 0) from here on.
    pub fn dns_counters(&self, policy: &str) -> DnsCounters {
        DnsCounters {
            answers: DnsOutcome::ALL.map(|outcome| {
                self.dns_answers
                    .get_or_create(&DnsLabels {
                        policy: policy.to_owned(),
                        outcome: outcome.as_str(),
                    })
                    .clone()
            }),
            dropped: DnsDrop::ALL.map(|reason| {
                self.dns_dropped
                    .get_or_create(&DnsDropLabels {
                        policy: policy.to_owned(),
                        reason: reason.as_str(),
                    })
                    .clone()
            }),
            tcp_refused: self
                .dns_tcp_refused
                .get_or_create(&PolicyLabels {
                    policy: policy.to_owned(),
                })
                .clone(),
        }
    }

    /// The event store's size on disk.
    pub fn set_store_bytes(&self, n: u64) {
        self.store_bytes.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A failed event store transaction.
    pub fn store_write_error(&self) {
        self.store_write_errors.inc();
    }

    /// `n` events an exporter (`sink` = `syslog` | `otlp` | `webhook`) could not deliver.
    pub fn export_errors(&self, sink: &'static str, n: u64) {
        self.export_errors
            .get_or_create(&SinkLabels { sink })
            .inc_by(n);
    }

    /// One decision. `reason` comes from a typed reason (`as_str()`), `policy` is a configured name.
    pub fn decision(&self, verdict: Verdict, reason: &'static str, policy: &str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                verdict: verdict.as_str(),
                reason: reason.to_owned(),
                policy: policy.to_owned(),
            })
            .inc();
    }

    /// A denial reported by the kernel program at `hook` (e.g. `connect4`).
    pub fn kernel_denial(&self, hook: &'static str) {
        self.kernel_denials
            .get_or_create(&HookLabels {
                hook: hook.to_owned(),
            })
            .inc();
    }

    /// A client connection accepted by `policy`'s listener.
    pub fn proxy_connection(&self, policy: &str) {
        self.proxy_connections
            .get_or_create(&PolicyLabels {
                policy: policy.to_owned(),
            })
            .inc();
    }

    /// `n` bytes relayed for `policy` in `direction`.
    pub fn proxy_bytes(&self, policy: &str, direction: Direction, n: u64) {
        let direction = match direction {
            Direction::Upstream => "upstream",
            Direction::Downstream => "downstream",
        };
        self.proxy_bytes
            .get_or_create(&BytesLabels {
                policy: policy.to_owned(),
                direction,
            })
            .inc_by(n);
    }

    /// Counter handles of one policy's proxy listener, resolved once (at bind time) so the
    /// proxy's hot path is a relaxed atomic add per update, with no label lookup or allocation.
    pub fn proxy_counters(&self, policy: &str) -> ProxyCounters {
        let bytes = |direction| {
            self.proxy_bytes
                .get_or_create(&BytesLabels {
                    policy: policy.to_owned(),
                    direction,
                })
                .clone()
        };
        ProxyCounters {
            connections: self
                .proxy_connections
                .get_or_create(&PolicyLabels {
                    policy: policy.to_owned(),
                })
                .clone(),
            allowed: self
                .decisions
                .get_or_create(&DecisionLabels {
                    verdict: Verdict::Allow.as_str(),
                    reason: ALLOWED.to_owned(),
                    policy: policy.to_owned(),
                })
                .clone(),
            bytes_upstream: bytes("upstream"),
            bytes_downstream: bytes("downstream"),
        }
    }

    /// The number of containers currently enforced.
    pub fn set_enforced_containers(&self, n: u64) {
        self.enforced_containers
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Connections the previous agent still relays.
    pub fn set_draining_connections(&self, n: usize) {
        self.draining_connections
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// `n` events lost at `source`.
    pub fn event_drops(&self, source: DropSource, n: u64) {
        let source = match source {
            DropSource::Kernel => "kernel",
            DropSource::Ring => "ring",
            DropSource::Store => "store",
            DropSource::Export => "export",
        };
        self.event_drops
            .get_or_create(&SourceLabels { source })
            .inc_by(n);
    }

    /// A reconcile pass failed.
    pub fn reconcile_error(&self) {
        self.reconcile_errors.inc();
    }

    /// A configuration reload was rejected (the running policy stayed in force).
    pub fn reload_error(&self) {
        self.reload_errors.inc();
    }

    /// Counts one denial event — its [`count`](crate::events::DenialEvent::count) attempts: a
    /// summary of identical ones counts them all — as `deny` decisions by reason and policy, and
    /// for kernel events the hook. Kernel and proxy reasons and hooks come from typed enums; agent reasons carry a
    /// free-text detail after `:` (`labels-invalid: unknown policy "x"`), which is cut off so the
    /// label values stay bounded.
    /// Would-deny events (audit) count as `verdict="would-deny"`, not as kernel denials; allowed
    /// events are not counted here (the proxy counts its own, the kernel keeps per-cgroup counters).
    pub fn record_denial(&self, ev: &crate::events::DenialEvent) {
        let verdict = match ev.verdict {
            Verdict::Allow => return,
            refused => refused,
        };
        let reason = ev.reason.split(':').next().unwrap_or_default().trim();
        self.decisions
            .get_or_create(&DecisionLabels {
                verdict: verdict.as_str(),
                reason: reason.to_owned(),
                policy: ev.policy.clone(),
            })
            .inc_by(ev.count);
        if let (Some(namespace), Some(pod)) = (
            ev.context.get(crate::events::CTX_NAMESPACE),
            ev.context.get(crate::events::CTX_POD),
        ) {
            // Registered before the count: a concurrent `retain_pods` that removes the series
            // also forgets the pod, so it never keeps a series it doesn't know of.
            let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            pods.insert((namespace.clone(), pod.clone()));
            self.pod_denials
                .get_or_create(&PodLabels {
                    namespace: namespace.clone(),
                    pod: pod.clone(),
                    verdict: verdict.as_str(),
                })
                .inc_by(ev.count);
        }
        if ev.source == crate::events::Source::Kernel && verdict == Verdict::Deny {
            let hook = ev.context.get("hook").map_or("unknown", String::as_str);
            self.kernel_denials
                .get_or_create(&HookLabels {
                    hook: hook.to_owned(),
                })
                .inc_by(ev.count);
        }
    }

    /// The OpenMetrics text exposition (ends with `# EOF`).
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_pods_denials_are_counted_by_pod_until_the_pod_is_gone() {
        let m = Metrics::new();
        let denial =
            || crate::events::DenialEvent::proxy("web", None, None, 443, "tls", "host-not-allowed");
        let pod = |name: &str, verdict| {
            let mut ev = denial().with_verdict(verdict);
            ev.context.extend([
                (crate::events::CTX_NAMESPACE.to_owned(), "ci".to_owned()),
                (crate::events::CTX_POD.to_owned(), name.to_owned()),
            ]);
            ev
        };
        m.record_denial(&pod("a", crate::events::Verdict::Deny));
        m.record_denial(&pod("a", crate::events::Verdict::Deny));
        m.record_denial(&pod("a", crate::events::Verdict::WouldDeny));
        m.record_denial(&pod("b", crate::events::Verdict::Deny));
        // Allowed events and a Docker container's denials have no per-pod series.
        m.record_denial(&pod("c", crate::events::Verdict::Allow));
        m.record_denial(&denial());
        let text = m.encode().expect("encode");
        for want in [
            r#"egress_agent_pod_denials_total{namespace="ci",pod="a",verdict="deny"} 2"#,
            r#"egress_agent_pod_denials_total{namespace="ci",pod="a",verdict="would-deny"} 1"#,
            r#"egress_agent_pod_denials_total{namespace="ci",pod="b",verdict="deny"} 1"#,
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert!(!text.contains(r#"pod="c""#), "{text}");
        assert_eq!(
            text.matches("egress_agent_pod_denials_total{").count(),
            3,
            "{text}"
        );
        // Pod a is gone: its series go; b's stay.
        m.retain_pods(&HashSet::from([("ci".to_owned(), "b".to_owned())]));
        let text = m.encode().expect("encode");
        assert!(!text.contains(r#"pod="a""#), "{text}");
        assert!(
            text.contains(
                r#"egress_agent_pod_denials_total{namespace="ci",pod="b",verdict="deny"} 1"#
            ),
            "{text}"
        );
    }

    #[test]
    fn would_deny_counts_by_policy_and_reason_not_as_kernel_denials() {
        let m = Metrics::new();
        let mut ev = crate::events::DenialEvent::proxy(
            "watch",
            None,
            None,
            443,
            "connect",
            "host-not-allowed",
        )
        .with_verdict(crate::events::Verdict::WouldDeny);
        m.record_denial(&ev);
        m.record_denial(&ev);
        ev.source = crate::events::Source::Kernel;
        ev.reason = "kernel-destination-not-allowed".into();
        ev.context.insert("hook".into(), "connect4".into());
        m.record_denial(&ev);
        // Allowed events are not decisions counted here.
        m.record_denial(&ev.clone().with_verdict(crate::events::Verdict::Allow));
        m.set_store_bytes(4096);
        m.store_write_error();
        m.event_drops(DropSource::Store, 3);
        let text = m.encode().expect("encode");
        for want in [
            r#"egress_agent_decisions_total{verdict="would-deny",reason="host-not-allowed",policy="watch"} 2"#,
            r#"egress_agent_decisions_total{verdict="would-deny",reason="kernel-destination-not-allowed",policy="watch"} 1"#,
            "egress_agent_store_bytes 4096",
            "egress_agent_store_write_errors_total 1",
            r#"egress_agent_event_drops_total{source="store"} 3"#,
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert!(
            !text.contains("egress_agent_kernel_denials_total{"),
            "{text}"
        );
        assert!(
            !text.contains("verdict=\"allow\",reason=\"allowed\",policy=\"watch\""),
            "{text}"
        );
    }

    #[test]
    fn denial_reasons_are_cut_to_their_code() {
        let m = Metrics::new();
        for detail in ["unknown policy \"a\"", "unknown policy \"b\""] {
            let mut ev =
                crate::events::DenialEvent::proxy("deny_all", None, None, 0, "docker", "x");
            ev.source = crate::events::Source::Agent;
            ev.reason = format!("labels-invalid: {detail}");
            m.record_denial(&ev);
        }
        let text = m.encode().expect("encode");
        assert!(
            text.contains(r#"egress_agent_decisions_total{verdict="deny",reason="labels-invalid",policy="deny_all"} 2"#),
            "{text}"
        );
        assert!(
            !text.contains("unknown policy"),
            "free text must not become a label: {text}"
        );
    }

    #[test]
    fn encodes_every_family() {
        let m = Metrics::new();
        m.decision(Verdict::Deny, "host_not_allowed", "ci");
        m.decision(Verdict::Allow, "allowed", "ci");
        m.kernel_denial("connect4");
        m.proxy_connection("ci");
        m.proxy_bytes("ci", Direction::Upstream, 100);
        m.proxy_bytes("ci", Direction::Downstream, 2000);
        m.set_enforced_containers(3);
        m.event_drops(DropSource::Kernel, 7);
        m.reconcile_error();
        let text = m.encode().expect("encode");
        for line in [
            r#"egress_agent_decisions_total{verdict="deny",reason="host_not_allowed",policy="ci"} 1"#,
            r#"egress_agent_kernel_denials_total{hook="connect4"} 1"#,
            r#"egress_agent_proxy_connections_total{policy="ci"} 1"#,
            r#"egress_agent_proxy_bytes_total{policy="ci",direction="downstream"} 2000"#,
            "egress_agent_enforced_containers 3",
            r#"egress_agent_event_drops_total{source="kernel"} 7"#,
            "egress_agent_reconcile_errors_total 1",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn proxy_counter_handles_share_the_registered_series() {
        let m = Metrics::new();
        let c = m.proxy_counters("ci");
        let again = m.proxy_counters("ci");
        c.connection();
        again.connection();
        c.allowed();
        c.bytes(10, 0);
        again.bytes(5, 7);
        // The functions without a cached handle add to the same series.
        m.decision(Verdict::Allow, ALLOWED, "ci");
        m.proxy_bytes("ci", Direction::Downstream, 1);
        let text = m.encode().expect("encode");
        for line in [
            r#"egress_agent_proxy_connections_total{policy="ci"} 2"#,
            r#"egress_agent_decisions_total{verdict="allow",reason="allowed",policy="ci"} 2"#,
            r#"egress_agent_proxy_bytes_total{policy="ci",direction="upstream"} 15"#,
            r#"egress_agent_proxy_bytes_total{policy="ci",direction="downstream"} 8"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    /// The text `run` prints when the metrics port is taken (docs/troubleshooting.md quotes it).
    #[tokio::test]
    async fn a_port_in_use_says_so_once() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("addr");
        let e = bind(addr, false).await.expect_err("port in use");
        assert_eq!(
            format!("{:#}", anyhow::Error::from(e)),
            format!(
                "cannot listen for metrics on {addr} (--metrics-listen): Address already in use (os error 98)"
            )
        );
    }

    #[tokio::test]
    async fn refuses_non_loopback_unless_allowed() {
        let e = bind("0.0.0.0:0".parse().expect("addr"), false)
            .await
            .expect_err("must refuse");
        assert!(matches!(e, MetricsError::NotLoopback(_)), "{e}");
        assert!(
            bind("127.0.0.1:0".parse().expect("addr"), false)
                .await
                .is_ok()
        );
        assert!(bind("[::1]:0".parse().expect("addr"), false).await.is_ok() || !ipv6_available());
    }

    async fn http(addr: SocketAddr, request: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(request.as_bytes()).await.expect("write");
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
            .await
            .expect("response in time")
            .expect("read");
        out
    }

    #[tokio::test]
    async fn scrape_over_loopback() {
        let m = Arc::new(Metrics::new());
        m.decision(Verdict::Deny, "ip_literal_denied", "reviewer");
        m.set_enforced_containers(2);
        let listener = bind("127.0.0.1:0".parse().expect("addr"), false)
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Arc::clone(&m), async move {
            stopped.await.ok();
        }));

        let resp = http(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains(CONTENT_TYPE), "{resp}");
        assert!(resp.contains(r#"egress_agent_decisions_total{verdict="deny",reason="ip_literal_denied",policy="reviewer"} 1"#), "{resp}");
        assert!(
            resp.contains("egress_agent_enforced_containers 2"),
            "{resp}"
        );
        assert!(resp.trim_end().ends_with("# EOF"), "{resp}");

        // Updates show up in the next scrape.
        m.set_enforced_containers(5);
        let resp = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(
            resp.contains("egress_agent_enforced_containers 5"),
            "{resp}"
        );

        let resp = http(addr, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
        let resp = http(
            addr,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 405"), "{resp}");

        stop.send(()).expect("stop");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("server stops")
            .expect("join");
    }

    fn ipv6_available() -> bool {
        std::net::TcpListener::bind("[::1]:0").is_ok()
    }
}
