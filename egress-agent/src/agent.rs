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
//! listeners theirs ([`end_connections`]).
//!
//! [`Agent::shutdown`] stops in this order, so every event that was emitted is recorded:
//! 1. the root token is cancelled: listeners stop accepting, watchers and the API stop;
//! 2. the tasks given to [`Agent::spawn`] are awaited (each at most [`TASK_DEADLINE`]), the
//!    kernel event pump last, so it drains what the ring buffer still holds;
//! 3. every other task on the tracker (the workloads' listeners, each with its connections) is
//!    awaited, at most [`TASK_DEADLINE`] in all; after a hand-over they ended with the drain;
//! 4. the store writes everything emitted so far ([`StoreHandle::shutdown`]);
//! 5. the sink's taps are closed and every exporter sends what it has queued, together at most
//!    [`EXPORT_DEADLINE`]; what a dead receiver could not take by then is logged as lost.
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
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

/// A server's connections once it stopped accepting (the API, the metrics listener): those
/// still open get `within` to finish, the rest are aborted; every one is awaited.
pub async fn end_connections(mut conns: JoinSet<()>, within: Duration) {
    let drained = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(within, drained).await.is_err() {
        tracing::debug!(
            connections = conns.len(),
            "connections still open at the stop: ended"
        );
        conns.shutdown().await;
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
        let events = EventSink::new(crate::events::DEFAULT_RING);
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
