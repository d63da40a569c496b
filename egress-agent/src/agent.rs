//! The agent core that the daemon (`egress-agent run`) and `egress-agent exec` share: the event
//! sink with its durable store and exporters, the kernel's denial events, the tasks that serve
//! confined workloads (proxy listeners, DNS, a runtime's watcher, the API), and one ordered stop.
//!
//! A runtime (Docker, containerd, or `exec` with its one command) plugs into it: it hands its
//! task to [`Agent::spawn`], and names the policy and workload of kernel events through the
//! attribution it gives [`Agent::pump_kernel_events`].
//!
//! One shutdown idiom: everything the agent runs is given a [`Stop`] — a token derived from the
//! one root token, and the agent's task tracker. A task ends once its token is cancelled, and
//! what it starts that outlives its own call (a workload's proxy listener) it starts with
//! [`Stop::spawn`], so the stop waits for that too. Below that, each owner awaits what it
//! spawned: a proxy listener its connections (`proxy::PolicyProxy::run`), the API and metrics
//! listeners theirs ([`crate::tasks::end_connections`]).
//!
//! [`Agent::shutdown`] stops in this order, so every event that was emitted is recorded:
//! 1. the root token is cancelled: listeners stop accepting, watchers and the API stop;
//! 2. the tasks given to [`Agent::spawn`] are awaited (each at most [`TASK_DEADLINE`]), the
//!    kernel event pump last, so it drains what the ring buffer still holds;
//! 3. every other task on the tracker (the workloads' listeners, each with its connections) is
//!    awaited, at most [`TASK_DEADLINE`] in all; after a hand-over they ended with the drain;
//! 4. the counts of identical refusals not yet recorded are recorded
//!    ([`EventSink::flush_collapsed`]), and the store writes everything emitted so far
//!    ([`StoreHandle::shutdown`]);
//! 5. the sink's taps are closed and every exporter sends what it has queued, together at most
//!    [`EXPORT_DEADLINE`]; what a dead receiver could not take by then is logged as lost.
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;

use crate::bpf;
use crate::config::Config;
use crate::events::{DenialEvent, EventSink};
use crate::export::Exporter;
use crate::metrics::Metrics;
use crate::store::writer::StoreHandle;

/// How long one task may take to stop once cancelled.
pub const TASK_DEADLINE: Duration = Duration::from_secs(2);
/// How long the exporters may take, together, to send what is queued at stop.
pub const EXPORT_DEADLINE: Duration = Duration::from_secs(10);

/// Why the core could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(
        "opening the event store: {0} (store.enabled = false runs without one; `egress-agent doctor` checks the state directory)"
    )]
    Store(#[from] crate::store::StoreError),
    #[error("starting event export: {0}")]
    Export(String),
}

/// How a task of the agent is stopped, and where the tasks it starts are kept: a token cancelled
/// at the agent's stop (derived from its root) and the agent's task tracker, which
/// [`Agent::shutdown`] waits on.
#[derive(Clone, Debug)]
pub struct Stop {
    token: CancellationToken,
    tasks: TaskTracker,
}

impl Stop {
    /// Cancelled at the agent's stop (or when this part of it is stopped alone).
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Completes once [`Stop::token`] is cancelled.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// [`Stop::cancelled`], owning the token (for a `shutdown: impl Future` argument).
    pub fn cancelled_owned(self) -> WaitForCancellationFutureOwned {
        self.token.cancelled_owned()
    }

    /// The stop of a part of what this one stops (a workload's listener): cancelled with it, or
    /// alone; what it spawns is kept by the same tracker.
    pub fn child(&self) -> Stop {
        Stop {
            token: self.token.child_token(),
            tasks: self.tasks.clone(),
        }
    }

    /// Run `task` on a task of its own, kept by the agent: [`Agent::shutdown`] waits for it
    /// (at most [`TASK_DEADLINE`]). `task` must end once [`Stop::token`] is cancelled.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(task)
    }

    /// A stop of its own, for a test that runs part of the agent without one: nobody waits for
    /// its tasks.
    #[cfg(test)]
    pub(crate) fn detached() -> Stop {
        Stop {
            token: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }
}

/// A task of the core, stopped by the root token.
struct Task {
    name: &'static str,
    handle: JoinHandle<()>,
}

/// The running core. Dropping it without [`Agent::shutdown`] cancels the tasks but flushes
/// nothing; every caller ends with `shutdown`.
pub struct Agent {
    events: EventSink,
    root: CancellationToken,
    /// Every task the agent runs, those in `named` and `pump` included.
    tasks: TaskTracker,
    named: Vec<Task>,
    pump: Option<Task>,
    store: Option<StoreHandle>,
    exporters: Vec<Exporter>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field(
                "tasks",
                &self.named.iter().map(|t| t.name).collect::<Vec<_>>(),
            )
            .field("running", &self.tasks.len())
            .field("store", &self.store.is_some())
            .field("exporters", &self.exporters.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.root.cancel();
    }
}

impl Agent {
    /// Start the record side (sink, store, exporters) before anything that emits. Inside a
    /// tokio runtime. `metrics`: the daemon's registry (denials counted, drops and export
    /// errors); `exec` runs without one.
    pub fn start(config: &Config, metrics: Option<Arc<Metrics>>) -> Result<Agent, AgentError> {
        // Identical refusals within a second are recorded once, then as a count (issue #38
        // item 5: a workload retrying a refused destination must not cost every attempt a log
        // line, a store row and an export).
        let events = EventSink::with_collapse(
            crate::events::DEFAULT_RING,
            crate::events::collapse::DEFAULT_WINDOW,
        );
        let sweeper = events.collapse_sweeper();
        let counter = metrics
            .as_ref()
            .map(|m| crate::metrics::denial_counter(&events, m.clone()));
        let store = crate::store::start(config, &events, metrics.clone())?;
        let exporters =
            crate::export::start(&config.export, &events, metrics).map_err(AgentError::Export)?;
        let mut agent = Agent {
            events,
            root: CancellationToken::new(),
            tasks: TaskTracker::new(),
            named: Vec::new(),
            pump: None,
            store,
            exporters,
        };
        agent.spawn("event collapse", |stop| async move {
            tokio::select! {
                () = sweeper => {}
                () = stop.cancelled() => {}
            }
        });
        if let Some(counter) = counter {
            agent.spawn("denial counter", |stop| async move {
                tokio::select! {
                    () = counter => {}
                    () = stop.cancelled() => {}
                }
            });
        }
        Ok(agent)
    }

    /// The sink every enforcement point emits into.
    pub fn events(&self) -> &EventSink {
        &self.events
    }

    /// A stop cancelled when the agent stops (its token a child of the root: cancelling it
    /// stops only what was given it).
    pub fn stop(&self) -> Stop {
        Stop {
            token: self.root.child_token(),
            tasks: self.tasks.clone(),
        }
    }

    /// Run `task(stop)` until it returns; `stop` is cancelled at [`Agent::shutdown`], which
    /// then waits for it (and for what it started with [`Stop::spawn`]).
    pub fn spawn<F>(&mut self, name: &'static str, task: impl FnOnce(Stop) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.tasks.spawn(task(self.stop()));
        self.named.push(Task { name, handle });
    }

    /// Deliver the kernel's denial events into the sink, each named by `attribute` (which sets
    /// the policy and the workload from `ev.cgroup_id`). `Ok(false)`: another process holds the
    /// ring buffer (another `exec`, or the daemon), and it delivers them.
    pub fn pump_kernel_events(
        &mut self,
        bpffs: &Path,
        attribute: impl Fn(&mut DenialEvent) + Send + Sync + 'static,
    ) -> Result<bool, bpf::BpfError> {
        let Some(reader) = bpf::events::KernelEvents::try_open(bpffs)? else {
            return Ok(false);
        };
        let sink = self.events.clone();
        let stop = self.stop().token;
        let handle = self.tasks.spawn(async move {
            let deliver = |reader: &bpf::events::KernelEvents, batch: Vec<egress_common::Event>| {
                for ev in batch {
                    let mut d = bpf::events::to_denial(&ev, reader.time_of(&ev), "unknown");
                    attribute(&mut d);
                    sink.emit(d);
                }
            };
            if let Err(e) = reader.pump(deliver, stop.cancelled_owned()).await {
                tracing::error!(error = %e, "kernel event pump failed; denials are still counted in the kernel");
            }
        });
        self.pump = Some(Task {
            name: "kernel events",
            handle,
        });
        Ok(true)
    }

    /// Steps 1 and 2 of the stop: cancel the root and wait for every task given to
    /// [`Agent::spawn`] (the kernel event pump last). The sink, store and exporters keep
    /// recording, and the listeners' connections go on after a hand-over (it stops the tasks,
    /// then drains its connections, whose events are still recorded, before
    /// [`Agent::shutdown`]).
    pub async fn stop_tasks(&mut self) {
        self.root.cancel();
        let tasks = std::mem::take(&mut self.named);
        for task in tasks.into_iter().rev().chain(self.pump.take()) {
            match tokio::time::timeout(TASK_DEADLINE, task.handle).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(task = task.name, error = %e, "task ended abnormally"),
                Err(_) => {
                    tracing::warn!(task = task.name, "task did not stop in time; left behind")
                }
            }
        }
    }

    /// Stop everything in order (see the module documentation) and flush the store and the
    /// exporters.
    pub async fn shutdown(mut self) {
        self.stop_tasks().await;
        self.tasks.close();
        if tokio::time::timeout(TASK_DEADLINE, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                tasks = self.tasks.len(),
                "listeners or their connections did not stop in time; left behind"
            );
        }
        // The counts of identical refusals not yet recorded, before the store's last write.
        self.events.flush_collapsed();
        if let Some(store) = self.store.take() {
            store.shutdown().await;
        }
        self.events.close_taps();
        let exporters = std::mem::take(&mut self.exporters);
        let names: Vec<&str> = exporters.iter().map(Exporter::name).collect();
        let all = futures_util::future::join_all(exporters.into_iter().map(Exporter::finished));
        if tokio::time::timeout(EXPORT_DEADLINE, all).await.is_err() {
            tracing::warn!(exporters = ?names, deadline = ?EXPORT_DEADLINE,
                "exporters did not deliver everything queued before the stop deadline; the rest is lost");
        }
    }
}

/// One shutdown (issue #37 item 3): `Agent::shutdown` leaves no task of the agent running — a
/// workload's proxy listener and its open connection, the exporter, the denial counter, the
/// collapse sweeper, a task started on the agent's stop — and every event emitted before the
/// exporters are flushed reaches the OTLP collector: those still queued when the stop began, one
/// a task of the agent records after the stop (which only a stop that waits for its tasks gets),
/// and the count of identical refusals still pending at the stop (issue #38 item 5).
#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::Agent;
    use crate::config::Config;
    use crate::events::DenialEvent;
    use crate::metrics::Metrics;
    use crate::proxy::ProxyContext;
    use crate::workload::info::ContainerInfo;
    use crate::workload::listeners::Listener;
    use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value;
    use prost::Message;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// How long the collector takes to answer each request: with one event per request, what was
    /// emitted just before the stop is still queued when it begins.
    const COLLECTOR_DELAY: Duration = Duration::from_millis(60);
    /// Events emitted straight into the sink before the stop (besides the listener's denial).
    const EMITTED: usize = 25;
    /// How long after the stop a task of the agent records its last event.
    const LATE: Duration = Duration::from_millis(300);
    /// Identical refusals emitted before the stop (one event and one summary).
    const DUPLICATES: i64 = 40;

    /// A slow loopback OTLP/HTTP logs collector on a thread and runtime of its own (so its tasks are
    /// not the agent's): the `egress.host` and `egress.count` attributes of every record it took,
    /// in order.
    fn collector() -> (std::net::SocketAddr, mpsc::Receiver<(String, i64)>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                use http_body_util::{BodyExt, Full};
                let l = tokio::net::TcpListener::from_std(l).unwrap();
                loop {
                    let Ok((s, _)) = l.accept().await else { return };
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(
                            move |req: hyper::Request<hyper::body::Incoming>| {
                                let tx = tx.clone();
                                async move {
                                    let body = req.into_body().collect().await.unwrap().to_bytes();
                                    let decoded = ExportLogsServiceRequest::decode(body).unwrap();
                                    tokio::time::sleep(COLLECTOR_DELAY).await;
                                    for r in decoded
                                        .resource_logs
                                        .iter()
                                        .flat_map(|r| &r.scope_logs)
                                        .flat_map(|s| &s.log_records)
                                    {
                                        let host = r
                                            .attributes
                                            .iter()
                                            .find(|a| a.key == "egress.host")
                                            .and_then(|a| a.value.as_ref()?.value.as_ref());
                                        let host = match host {
                                            Some(any_value::Value::StringValue(h)) => h.clone(),
                                            other => format!("{other:?}"),
                                        };
                                        let count = r
                                            .attributes
                                            .iter()
                                            .find(|a| a.key == "egress.count")
                                            .and_then(|a| a.value.as_ref()?.value.as_ref());
                                        let count = match count {
                                            Some(any_value::Value::IntValue(n)) => *n,
                                            _ => -1,
                                        };
                                        tx.send((host, count)).ok();
                                    }
                                    Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                        Full::new(hyper::body::Bytes::new()),
                                    ))
                                }
                            },
                        );
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                            .await
                            .ok();
                    });
                }
            });
        });
        (addr, rx)
    }

    /// The workload the listener serves (a command's record: no runtime behind it).
    fn container() -> ContainerInfo {
        ContainerInfo::command("exec:1".into(), "web".into(), "p", Default::default())
    }

    fn alive() -> usize {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    }

    #[tokio::test]
    async fn a_stop_leaves_no_task_running_and_flushes_the_exporters() {
        let (collector, received) = collector();
        let config = Config::from_toml_str(
            &format!(
                "[store]\nenabled = false\n\
                 [proxy]\nkernel_relay = \"off\"\n\
                 [export.otlp]\nendpoint = \"http://{collector}/v1/logs\"\nbatch = 1\n\
                 [policies.p]\nmode = \"allowlist\"\nallow_hosts = [\"a.test\"]\nallow_ports = [443]\n"
            ),
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let baseline = alive();

        let agent = Agent::start(&config, Some(Arc::new(Metrics::new()))).unwrap();
        // A workload's listener, as the enforcer binds it: on a task of the agent's tracker.
        let ctx = ProxyContext::new(&config, agent.events().clone())
            .unwrap()
            .admit_any_peer();
        let listener = Listener::bind(
            &[IpAddr::V4(Ipv4Addr::LOCALHOST)],
            &container(),
            7,
            "p",
            &Arc::new(config.policies["p"].clone()),
            &BTreeMap::new(),
            &ctx,
            None,
            &agent.stop(),
        )
        .await
        .unwrap();
        let addr = listener.bound.v4.unwrap().0;

        // A refused CONNECT: one denial event, from the listener.
        let mut refused = tokio::net::TcpStream::connect(addr).await.unwrap();
        refused
            .write_all(b"CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        refused.read_to_end(&mut answer).await.unwrap();
        assert!(
            String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 403"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
        // A connection still open at the stop, its head not sent yet: a task of the listener.
        let mut open = tokio::net::TcpStream::connect(addr).await.unwrap();
        open.write_all(b"CONNECT a.test:443 HTTP/1.1\r\n")
            .await
            .unwrap();

        let mut expected: BTreeSet<String> = BTreeSet::from(["denied.test".to_owned()]);
        for i in 0..EMITTED {
            let host = format!("e{i}.test");
            agent.events().emit(DenialEvent::proxy(
                "p",
                Some(host.clone()),
                None,
                443,
                "tls",
                "host-not-allowed",
            ));
            expected.insert(host);
        }
        // A refusal retried in a loop: recorded at once, then counted; its count is recorded by
        // the sweep once the window has passed or, at the latest, by the stop.
        for _ in 0..DUPLICATES {
            agent.events().emit(DenialEvent::proxy(
                "p",
                Some("again.test".into()),
                None,
                443,
                "tls",
                "host-not-allowed",
            ));
        }
        expected.insert("again.test".to_owned());
        // A task started on the agent's stop that records an event a while after the stop (as a
        // connection records its end): the stop waits for it before it flushes the exporters.
        let stop = agent.stop();
        let events = agent.events().clone();
        stop.clone().spawn(async move {
            stop.cancelled().await;
            tokio::time::sleep(LATE).await;
            events.emit(DenialEvent::proxy(
                "p",
                Some("late.test".into()),
                None,
                443,
                "tls",
                "host-not-allowed",
            ));
        });
        expected.insert("late.test".to_owned());
        // The listener, its open connection, the exporter, the denial counter and that task run now.
        tokio::task::yield_now().await;
        let running = alive();
        assert!(
            running >= baseline + 5,
            "{running} tasks alive (baseline {baseline}): the listener, its connection, the exporter, the denial counter and the late task should be"
        );
        let mut exported: Vec<(String, i64)> = received.try_iter().collect();
        let before_stop = exported.len();
        assert!(
            before_stop < expected.len() / 2,
            "{before_stop} of {} events already exported: the queue should still hold most at the stop",
            expected.len()
        );

        // The listener stays bound (as the enforcer holds it) while the agent stops.
        agent.shutdown().await;

        assert_eq!(
            alive(),
            baseline,
            "tasks still alive after the stop (listener, connection or exporter left behind)"
        );
        // The open connection was ended by the stop (closed, no answer).
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(1), open.read_to_end(&mut rest))
            .await
            .expect("the open connection was not closed by the stop")
            .unwrap();
        assert_eq!(n, 0, "{}", String::from_utf8_lossy(&rest));
        // Every event emitted before the stop reached the collector, once, by the time `shutdown`
        // returned; the retried refusal as its first attempt and the summary of the others.
        exported.extend(received.try_iter());
        let (again, exported): (Vec<_>, Vec<_>) =
            exported.into_iter().partition(|(h, _)| h == "again.test");
        assert_eq!(
            again.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
            [1, DUPLICATES - 1],
            "{again:?}"
        );
        assert!(exported.iter().all(|(_, n)| *n == 1), "{exported:?}");
        assert_eq!(exported.len() + 1, expected.len(), "{exported:?}");
        let mut hosts: BTreeSet<String> = exported.into_iter().map(|(h, _)| h).collect();
        hosts.insert("again.test".to_owned());
        assert_eq!(hosts, expected);
        drop(listener);
    }
}
