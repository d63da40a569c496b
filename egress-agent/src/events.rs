//! Structured events from both enforcement points (kernel hooks and the proxy): denials,
//! would-denials (a policy in `enforce = "audit"` let it through) and allowed traffic.
//!
//! [`EventSink::emit`] of a denial or would-deny writes one structured line through `tracing`
//! (target [`DENIAL_TARGET`]; the daemon's subscriber formats it as JSON and writes it off the hot
//! path), keeps the event in a bounded in-memory ring for `egress-agent events`, broadcasts it to
//! `events --follow` subscribers, and hands it to every tap ([`EventSink::tap`]: the durable
//! store, exporters). Allowed events go to the taps that asked for them and nowhere else (no log
//! line, no ring). Nothing here blocks on a slow reader: the ring drops its oldest entry, the
//! broadcast channel makes lagging receivers skip, a full tap drops the event and counts it.
//!
//! A sink made with [`EventSink::with_collapse`] (the agent's) records identical refusals within
//! a window once, then as one summary with a [`DenialEvent::count`] ([`collapse`]): a workload
//! hammering a refused destination costs the proxy a counter increment per attempt, not a log
//! line, a store row and an export.
//!
//! What an event holds is fixed by its type: destination host (normalised name, never a URL),
//! IP, port, protocol, policy, reason. There is no field for a path, query string, header or body,
//! so none can leak into an event or its log line.
pub mod collapse;

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

/// `tracing` target of denial log lines.
pub const DENIAL_TARGET: &str = "egress_agent::denial";
/// Default ring size.
pub const DEFAULT_RING: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Kernel,
    Proxy,
    /// The agent's own lifecycle decisions about a container (refused, invalid labels, host layer
    /// failed): not a connection attempt.
    Agent,
}

impl Source {
    /// The name the store, the exporters and the CLI print (as serde writes it).
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Kernel => "kernel",
            Source::Proxy => "proxy",
            Source::Agent => "agent",
        }
    }
}

/// What happened to the attempt an event describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Verdict {
    /// Refused.
    #[default]
    #[serde(rename = "deny")]
    Deny,
    /// The policy would refuse it, but audits: it went through.
    #[serde(rename = "would-deny")]
    WouldDeny,
    /// Allowed (recorded for the flow summary).
    #[serde(rename = "allow")]
    Allow,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Deny => "deny",
            Verdict::WouldDeny => "would-deny",
            Verdict::Allow => "allow",
        }
    }
}

impl std::str::FromStr for Verdict {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "deny" => Ok(Verdict::Deny),
            "would-deny" => Ok(Verdict::WouldDeny),
            "allow" => Ok(Verdict::Allow),
            other => Err(format!(
                "unknown verdict {other:?} (deny, would-deny, allow)"
            )),
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRef {
    pub id: String,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DenialEvent {
    /// RFC 3339 in JSON.
    #[serde(with = "rfc3339")]
    pub time: SystemTime,
    pub source: Source,
    pub cgroup_id: Option<u64>,
    /// Kernel events: the cgroup of the task that made the call, when it is not the entry's
    /// (a container of a pod); how [`crate::workload::Directory`] names the container. Not kept.
    #[serde(skip)]
    pub task_cgroup_id: Option<u64>,
    pub container: Option<ContainerRef>,
    /// Extra labels (e.g. `exec` = command name). Never request data.
    #[serde(default)]
    pub context: BTreeMap<String, String>,
    pub policy: String,
    pub host: Option<String>,
    pub ip: Option<IpAddr>,
    pub port: u16,
    /// `tcp`, `udp`, `http`, `connect`, ...
    pub protocol: String,
    /// Machine-readable, e.g. `host-not-allowed` (`allowed` for allowed traffic).
    pub reason: String,
    /// `deny` (absent in events written before audit mode existed), `would-deny` or `allow`.
    #[serde(default)]
    pub verdict: Verdict,
    /// The rule of the policy that decided, as configured (`allow_hosts "api.github.com"`,
    /// `deny_cidrs 10.0.0.0/8`, `mode deny_all`, ...): [`egress_policy::Rule::describe`]. `None`:
    /// no rule of the policy is behind the verdict (`host-not-allowed`, a request-shape refusal,
    /// an event written before events named their rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// How many attempts this event stands for: 1, or, for a summary of identical attempts
    /// collapsed within a window ([`collapse`]), how many there were (its `time` is the last of
    /// them). The events of one destination add up: their counts sum to its attempts. 1 when
    /// reading events of older agents.
    #[serde(default = "one")]
    pub count: u64,
}

fn one() -> u64 {
    1
}

impl DenialEvent {
    /// A proxy denial with the current time.
    pub fn proxy(
        policy: &str,
        host: Option<String>,
        ip: Option<IpAddr>,
        port: u16,
        protocol: &str,
        reason: &str,
    ) -> Self {
        DenialEvent {
            time: SystemTime::now(),
            source: Source::Proxy,
            cgroup_id: None,
            task_cgroup_id: None,
            container: None,
            context: BTreeMap::new(),
            policy: policy.to_owned(),
            host,
            ip,
            port,
            protocol: protocol.to_owned(),
            reason: reason.to_owned(),
            verdict: Verdict::Deny,
            rule: None,
            count: 1,
        }
    }

    /// The same event with another verdict.
    pub fn with_verdict(mut self, verdict: Verdict) -> Self {
        self.verdict = verdict;
        self
    }
}

/// `reason` of allowed events.
pub const ALLOWED_REASON: &str = "allowed";

/// Event context keys of a pod's events: OpenTelemetry's Kubernetes resource attributes.
pub const CTX_NAMESPACE: &str = "k8s.namespace.name";
pub const CTX_POD: &str = "k8s.pod.name";
pub const CTX_POD_UID: &str = "k8s.pod.uid";
pub const CTX_CONTAINER: &str = "k8s.container.name";

pub(crate) mod rfc3339 {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::SystemTime;

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_rfc3339_micros(*t))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&s).map_err(serde::de::Error::custom)
    }
}

struct Inner {
    ring: Mutex<VecDeque<DenialEvent>>,
    capacity: usize,
    tx: broadcast::Sender<DenialEvent>,
    total: AtomicU64,
    taps: ArcSwap<Vec<Arc<Tap>>>,
    /// Some tap takes allowed events (so the proxy builds them at all).
    wants_allowed: AtomicBool,
    /// Identical refusals collapsed ([`EventSink::with_collapse`]).
    collapse: Option<Mutex<collapse::Collapser>>,
}

struct Tap {
    tx: mpsc::Sender<DenialEvent>,
    allowed: bool,
    dropped: Arc<AtomicU64>,
}

/// The receiving end of [`EventSink::tap`].
#[derive(Debug)]
pub struct TapReceiver {
    pub rx: mpsc::Receiver<DenialEvent>,
    /// Events dropped because this tap's channel was full (or its reader gone).
    pub dropped: Arc<AtomicU64>,
}

/// Clone-able handle to the event ring and stream.
#[derive(Clone)]
pub struct EventSink {
    inner: Arc<Inner>,
}

impl Default for EventSink {
    fn default() -> Self {
        EventSink::new(DEFAULT_RING)
    }
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink")
            .field("capacity", &self.inner.capacity)
            .field("total", &self.total())
            .finish()
    }
}

impl EventSink {
    /// A sink that records every event as it comes.
    pub fn new(capacity: usize) -> EventSink {
        EventSink::build(capacity, None)
    }

    /// A sink that collapses identical refusals within `window` (see [`collapse`]): the
    /// agent's. Run [`EventSink::collapse_sweeper`] beside it and call
    /// [`EventSink::flush_collapsed`] before the store and the exporters are flushed at a stop.
    pub fn with_collapse(capacity: usize, window: Duration) -> EventSink {
        EventSink::build(capacity, Some(collapse::Collapser::new(window)))
    }

    fn build(capacity: usize, collapse: Option<collapse::Collapser>) -> EventSink {
        let capacity = capacity.max(1);
        let (tx, _) = broadcast::channel(capacity.min(1024));
        EventSink {
            inner: Arc::new(Inner {
                ring: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
                capacity,
                tx,
                total: AtomicU64::new(0),
                taps: ArcSwap::from_pointee(Vec::new()),
                wants_allowed: AtomicBool::new(false),
                collapse: collapse.map(Mutex::new),
            }),
        }
    }

    /// A bounded feed of every event emitted from now on (denials and would-denials; allowed
    /// events too if `allowed`). A full channel drops the event and counts it in
    /// [`TapReceiver::dropped`]: the emitter never waits.
    pub fn tap(&self, capacity: usize, allowed: bool) -> TapReceiver {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let dropped = Arc::new(AtomicU64::new(0));
        let tap = Arc::new(Tap {
            tx,
            allowed,
            dropped: dropped.clone(),
        });
        self.inner.taps.rcu(|taps| {
            let mut v = Vec::clone(taps);
            v.push(tap.clone());
            v
        });
        if allowed {
            self.inner.wants_allowed.store(true, Ordering::Relaxed);
        }
        TapReceiver { rx, dropped }
    }

    /// Close every tap: their readers get what is queued — the pending counts of identical
    /// refusals too ([`EventSink::flush_collapsed`]) — then the end of the stream (how the
    /// agent's shutdown lets the store and the exporters finish). Taps opened later work as usual.
    pub fn close_taps(&self) {
        self.flush_collapsed();
        self.inner.taps.store(Arc::new(Vec::new()));
    }

    fn collapser(&self) -> Option<std::sync::MutexGuard<'_, collapse::Collapser>> {
        let c = self.inner.collapse.as_ref()?;
        Some(c.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Record every pending count of identical refusals now, as summary events (a stop: nothing
    /// counted is lost). A no-op on a sink that does not collapse.
    pub fn flush_collapsed(&self) {
        let mut due = Vec::new();
        if let Some(mut c) = self.collapser() {
            c.flush(&mut due);
        }
        for ev in due {
            self.record(ev);
        }
    }

    /// Records the summaries of identical refusals whose window has ended when no further
    /// attempt comes to do it: every half window, for as long as it runs (the agent runs it as
    /// a task until its stop). Ends at once on a sink that does not collapse.
    pub fn collapse_sweeper(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let sink = self.clone();
        let period = self.collapser().map(|c| c.window() / 2);
        async move {
            let Some(period) = period else { return };
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let mut due = Vec::new();
                if let Some(mut c) = sink.collapser() {
                    c.sweep(Instant::now(), &mut due);
                }
                for ev in due {
                    sink.record(ev);
                }
            }
        }
    }

    /// True when some tap records allowed traffic (build allowed events only then).
    pub fn wants_allowed(&self) -> bool {
        self.inner.wants_allowed.load(Ordering::Relaxed)
    }

    fn to_taps(&self, ev: &DenialEvent) {
        let allowed = ev.verdict == Verdict::Allow;
        for tap in self.inner.taps.load().iter() {
            if allowed && !tap.allowed {
                continue;
            }
            if tap.tx.try_send(ev.clone()).is_err() {
                tap.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Record one event. Denials and would-denials: log line, ring, subscribers, taps (on a
    /// collapsing sink, an identical one within the window is only counted, see [`collapse`]);
    /// allowed events: the taps that take them. Never blocks on readers.
    pub fn emit(&self, ev: DenialEvent) {
        if ev.verdict == Verdict::Allow {
            self.to_taps(&ev);
            return;
        }
        self.inner.total.fetch_add(ev.count, Ordering::Relaxed);
        let mut due = Vec::new();
        let now = match self.collapser() {
            Some(mut c) => c.note(ev, Instant::now(), &mut due),
            None => Some(ev),
        };
        for summary in due {
            self.record(summary);
        }
        if let Some(ev) = now {
            self.record(ev);
        }
    }

    /// Record another attempt identical to `template` but for its time (now): what
    /// [`EventSink::emit`] of a copy would record, without building the copy while a collapsing
    /// sink only counts the attempt (its key's window is open). For a caller that refuses the
    /// same thing again and again and keeps the event it built the first time (the DNS
    /// responder's kept refusals: no allocation per refused query in a flood).
    pub fn emit_again(&self, template: &DenialEvent) {
        if template.verdict != Verdict::Allow {
            let mut due = Vec::new();
            let counted = self.collapser().is_some_and(|mut c| {
                c.count_again(template, SystemTime::now(), Instant::now(), &mut due)
            });
            for summary in due {
                self.record(summary);
            }
            if counted {
                self.inner.total.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let mut ev = template.clone();
        ev.time = SystemTime::now();
        ev.count = 1;
        self.emit(ev);
    }

    /// A denial or would-deny, recorded: taps, log line, ring, subscribers.
    fn record(&self, ev: DenialEvent) {
        self.to_taps(&ev);
        // Context labels as one JSON object in a string field (tracing fields have static names).
        let context = (!ev.context.is_empty())
            .then(|| serde_json::to_string(&ev.context).ok())
            .flatten();
        tracing::warn!(
            target: DENIAL_TARGET,
            source = ?ev.source,
            policy = %ev.policy,
            host = ev.host.as_deref(),
            ip = ev.ip.map(tracing::field::display),
            port = ev.port,
            protocol = %ev.protocol,
            reason = %ev.reason,
            rule = ev.rule.as_deref(),
            count = ev.count,
            cgroup_id = ev.cgroup_id,
            container_id = ev.container.as_ref().map(|c| c.id.as_str()),
            container_name = ev.container.as_ref().map(|c| c.name.as_str()),
            context = context.as_deref(),
            verdict = ev.verdict.as_str(),
            "{}",
            match ev.verdict {
                Verdict::WouldDeny => "would deny (audit)",
                _ => "denied",
            }
        );
        {
            let mut ring = match self.inner.ring.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            if ring.len() >= self.inner.capacity {
                ring.pop_front();
            }
            ring.push_back(ev.clone());
        }
        // Err only means "no subscriber right now".
        self.inner.tx.send(ev).ok();
    }

    /// The newest `n` events, oldest first.
    pub fn recent(&self, n: usize) -> Vec<DenialEvent> {
        let ring = match self.inner.ring.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let skip = ring.len().saturating_sub(n);
        ring.iter().skip(skip).cloned().collect()
    }

    /// Live stream of events emitted from now on (for `events --follow`). A receiver that falls
    /// behind gets `RecvError::Lagged` and continues.
    pub fn subscribe(&self) -> broadcast::Receiver<DenialEvent> {
        self.inner.tx.subscribe()
    }

    /// Denials and would-denials emitted since start: every attempt, including those the ring
    /// no longer holds and identical ones counted but not yet (or only as a summary) recorded.
    pub fn total(&self) -> u64 {
        self.inner.total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn ring_is_bounded_and_ordered() {
        let sink = EventSink::new(3);
        for port in 1..=5 {
            sink.emit(DenialEvent::proxy(
                "p",
                Some("h.example".into()),
                None,
                port,
                "connect",
                "host-not-allowed",
            ));
        }
        let ports: Vec<u16> = sink.recent(10).iter().map(|e| e.port).collect();
        assert_eq!(ports, vec![3, 4, 5]);
        assert_eq!(sink.recent(1)[0].port, 5);
        assert_eq!(sink.total(), 5);
    }

    #[tokio::test]
    async fn subscribers_get_events() {
        let sink = EventSink::new(8);
        let mut rx = sink.subscribe();
        sink.emit(DenialEvent::proxy(
            "p",
            None,
            Some("10.0.0.1".parse().unwrap()),
            443,
            "connect",
            "address-denied",
        ));
        let ev = rx.recv().await.unwrap();
        assert_eq!(ev.reason, "address-denied");
    }

    #[test]
    fn json_shape() {
        let ev = DenialEvent::proxy(
            "ci",
            Some("evil.example".into()),
            None,
            443,
            "connect",
            "host-not-allowed",
        );
        let j = serde_json::to_value(&ev).unwrap();
        assert_eq!(j["source"], "proxy");
        assert_eq!(j["policy"], "ci");
        assert!(j["time"].as_str().unwrap().ends_with('Z'));
        assert_eq!(j["verdict"], "deny");
        let back: DenialEvent = serde_json::from_value(j.clone()).unwrap();
        assert_eq!(back.host.as_deref(), Some("evil.example"));
        // Events written before the verdict field existed read as denials.
        let mut old = j;
        old.as_object_mut().unwrap().remove("verdict");
        let back: DenialEvent = serde_json::from_value(old).unwrap();
        assert_eq!(back.verdict, Verdict::Deny);
        let wd = serde_json::to_value(back.with_verdict(Verdict::WouldDeny)).unwrap();
        assert_eq!(wd["verdict"], "would-deny");
    }

    #[tokio::test]
    async fn taps_get_what_they_asked_for_and_count_drops() {
        let sink = EventSink::new(8);
        let mut all = sink.tap(2, true);
        let mut denials = sink.tap(8, false);
        assert!(sink.wants_allowed());
        let ev = |v| {
            DenialEvent::proxy("p", Some("h.example".into()), None, 443, "connect", "x")
                .with_verdict(v)
        };
        sink.emit(ev(Verdict::Allow));
        sink.emit(ev(Verdict::WouldDeny));
        sink.emit(ev(Verdict::Deny));
        // The first tap holds 2: the third event was dropped, counted, and nobody waited.
        assert_eq!(all.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(all.rx.recv().await.unwrap().verdict, Verdict::Allow);
        assert_eq!(all.rx.recv().await.unwrap().verdict, Verdict::WouldDeny);
        assert_eq!(denials.rx.recv().await.unwrap().verdict, Verdict::WouldDeny);
        assert_eq!(denials.rx.recv().await.unwrap().verdict, Verdict::Deny);
        assert!(denials.rx.try_recv().is_err());
        // Allowed events stay out of the ring and the totals.
        assert_eq!(sink.total(), 2);
        assert_eq!(sink.recent(10).len(), 2);
    }
}
