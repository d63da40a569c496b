//! The agent core that the daemon (`egress-agent run`) and `egress-agent exec` share: the event
//! sink with its durable store and exporters, the kernel's denial events, the tasks that serve
//! confined workloads (proxy listeners, DNS, a runtime's watcher, the API), and one ordered stop.
//!
//! A runtime (Docker, containerd, or `exec` with its one command) plugs into it: it takes
//! [`Agent::stop_token`] (a child of the one root token) for what it spawns, or hands its task
//! to [`Agent::spawn`], and names the policy and workload of kernel events through the
//! attribution it gives [`Agent::pump_kernel_events`].
//!
//! [`Agent::shutdown`] stops in this order, so every event that was emitted is recorded:
//! 1. the root token is cancelled: listeners stop accepting, watchers and the API stop;
//! 2. the spawned tasks are awaited (each at most [`TASK_DEADLINE`]), the kernel event pump last,
//!    so it drains what the ring buffer still holds;
//! 3. the store writes everything emitted so far ([`StoreHandle::shutdown`]);
//! 4. the sink's taps are closed and every exporter sends what it has queued, together at most
//!    [`EXPORT_DEADLINE`]; what a dead receiver could not take by then is logged as lost.
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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
    tasks: Vec<Task>,
    pump: Option<Task>,
    store: Option<StoreHandle>,
    exporters: Vec<Exporter>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field(
                "tasks",
                &self.tasks.iter().map(|t| t.name).collect::<Vec<_>>(),
            )
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
        if let Some(m) = &metrics {
            crate::metrics::spawn_denial_counter(&events, m.clone());
        }
        let store = crate::store::start(config, &events, metrics.clone())?;
        let exporters =
            crate::export::start(&config.export, &events, metrics).map_err(AgentError::Export)?;
        Ok(Agent {
            events,
            root: CancellationToken::new(),
            tasks: Vec::new(),
            pump: None,
            store,
            exporters,
        })
    }

    /// The sink every enforcement point emits into.
    pub fn events(&self) -> &EventSink {
        &self.events
    }

    /// A token cancelled when the agent stops (a child of the root: cancelling it stops only
    /// what was given it).
    pub fn stop_token(&self) -> CancellationToken {
        self.root.child_token()
    }

    /// Run `task(stop)` until it returns; `stop` is cancelled at [`Agent::shutdown`], which
    /// then waits for it.
    pub fn spawn<F>(&mut self, name: &'static str, task: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = tokio::spawn(task(self.stop_token()));
        self.tasks.push(Task { name, handle });
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
        let stop = self.stop_token();
        let handle = tokio::spawn(async move {
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

    /// Steps 1 and 2 of the stop: cancel the root and wait for every task (the kernel event
    /// pump last). The sink, store and exporters keep recording (a hand-over stops the tasks,
    /// then drains its connections, whose events are still recorded, before
    /// [`Agent::shutdown`]).
    pub async fn stop_tasks(&mut self) {
        self.root.cancel();
        let tasks = std::mem::take(&mut self.tasks);
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
