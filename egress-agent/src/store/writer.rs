//! The store's writer: a task fed by a bounded [`EventSink`] tap, writing batches off the hot
//! path.
//!
//! It waits for an event, lets [`COALESCE`] pass, takes whatever is queued (up to [`BATCH_MAX`]), aggregates the
//! batch's flows in memory, and writes it in one transaction on a blocking thread. Under load the
//! batches grow, so the per-event cost falls; an idle agent writes nothing. A full queue drops
//! events at the sink (counted there, never waited for). Every [`PRUNE_EVERY`] the age and size
//! bounds are applied. A failed write is logged and counted and the batch is dropped: the store
//! never holds up enforcement.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, oneshot};

use super::{FlowBatch, Store, add_flow};
use crate::events::{DenialEvent, EventSink, TapReceiver};
use crate::metrics::Metrics;

/// Most events in one transaction.
pub const BATCH_MAX: usize = 8192;
/// How long the first event of a batch waits for others (events are in memory that long before
/// they are committed; a crash loses at most this window, as it would lose the queue).
pub const COALESCE: Duration = Duration::from_millis(50);
/// How often the age and size bounds are applied.
pub const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Bounds the writer keeps.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_age: Duration,
    pub max_bytes: u64,
}

impl From<&crate::config::StoreConfig> for Bounds {
    fn from(c: &crate::config::StoreConfig) -> Self {
        Bounds {
            max_age: c.max_age(),
            max_bytes: c.max_bytes,
        }
    }
}

/// Counters of a running writer (cheap to read from anywhere).
#[derive(Debug, Default)]
pub struct WriterStats {
    /// Events committed (denials, would-denials and allowed ones).
    pub committed: AtomicU64,
    /// Failed transactions.
    pub write_errors: AtomicU64,
    /// Events dropped because the queue was full.
    pub dropped: Arc<AtomicU64>,
}

/// Handle to the writer task.
#[derive(Debug)]
pub struct StoreHandle {
    flush_tx: mpsc::Sender<oneshot::Sender<()>>,
    stats: Arc<WriterStats>,
    task: tokio::task::JoinHandle<()>,
}

impl StoreHandle {
    /// Wait until every event emitted before this call has been written (or dropped).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.flush_tx.send(tx).await.is_ok() {
            rx.await.ok();
        }
    }

    pub fn stats(&self) -> &Arc<WriterStats> {
        &self.stats
    }

    /// Write what is queued, then stop.
    pub async fn shutdown(self) {
        self.flush().await;
        self.task.abort();
        self.task.await.ok();
    }
}

/// Start writing what `sink` emits into `store` (allowed events too when `record_allowed`),
/// with at most `queue` events waiting. Must be called inside a tokio runtime.
pub fn spawn(
    store: Store,
    sink: &EventSink,
    queue: usize,
    record_allowed: bool,
    bounds: Bounds,
    metrics: Option<Arc<Metrics>>,
) -> StoreHandle {
    let tap = sink.tap(queue, record_allowed);
    let stats = Arc::new(WriterStats {
        dropped: tap.dropped.clone(),
        ..WriterStats::default()
    });
    let (flush_tx, flush_rx) = mpsc::channel(16);
    let task = tokio::spawn(run(store, tap, flush_rx, bounds, stats.clone(), metrics));
    StoreHandle {
        flush_tx,
        stats,
        task,
    }
}

// Long: the writer's one loop (batch, flush on demand, prune, stop), whose arms share the
// batch and the store.
async fn run(
    store: Store,
    mut tap: TapReceiver,
    mut flush_rx: mpsc::Receiver<oneshot::Sender<()>>,
    bounds: Bounds,
    stats: Arc<WriterStats>,
    metrics: Option<Arc<Metrics>>,
) {
    let mut store = Some(store);
    let mut next_prune = tokio::time::Instant::now();
    let mut reported_drops = 0u64;
    let mut batch: Vec<DenialEvent> = Vec::new();
    loop {
        let mut waiting_flush = None;
        tokio::select! {
            ev = tap.rx.recv() => match ev {
                Some(ev) => batch.push(ev),
                None => return,
            },
            f = flush_rx.recv() => match f {
                Some(f) => waiting_flush = Some(f),
                None => return,
            },
            () = tokio::time::sleep_until(next_prune) => {}
        }
        // Let a burst gather (one transaction and one fsync for it, not one per event), unless
        // someone waits for a flush.
        if !batch.is_empty() && waiting_flush.is_none() && tap.rx.len() < BATCH_MAX {
            tokio::select! {
                () = tokio::time::sleep(COALESCE) => {}
                f = flush_rx.recv() => match f {
                    Some(f) => waiting_flush = Some(f),
                    None => return,
                },
            }
        }
        while batch.len() < BATCH_MAX {
            match tap.rx.try_recv() {
                Ok(ev) => batch.push(ev),
                Err(_) => break,
            }
        }
        let prune = tokio::time::Instant::now() >= next_prune;
        if prune {
            next_prune = tokio::time::Instant::now() + PRUNE_EVERY;
        }
        let Some(mut s) = store.take() else { return };
        let events = std::mem::take(&mut batch);
        let (s, events, result, size) = match tokio::task::spawn_blocking(move || {
            let result = write_batch(&mut s, &events, prune, bounds);
            let size = s.file_bytes();
            (s, events, result, size)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "event store writer failed; events are no longer stored");
                return;
            }
        };
        store = Some(s);
        match result {
            Ok(n) => {
                stats.committed.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(m) = &metrics {
                    m.store_write_error();
                }
                tracing::warn!(error = %e, events = events.len(), "event store write failed; batch dropped");
            }
        }
        batch = events;
        batch.clear();
        if let Some(m) = &metrics {
            m.set_store_bytes(size);
            let drops = stats.dropped.load(Ordering::Relaxed);
            if drops > reported_drops {
                m.event_drops(crate::metrics::DropSource::Store, drops - reported_drops);
                reported_drops = drops;
            }
        }
        if let Some(f) = waiting_flush {
            // Events queued before the flush request are in the queue now: write them first.
            while !tap.rx.is_empty() {
                let mut pending: Vec<DenialEvent> = Vec::new();
                while let Ok(ev) = tap.rx.try_recv() {
                    pending.push(ev);
                    if pending.len() >= BATCH_MAX {
                        break;
                    }
                }
                let Some(mut s) = store.take() else { return };
                let Ok((s, r)) = tokio::task::spawn_blocking(move || {
                    let r = write_batch(&mut s, &pending, false, bounds);
                    (s, r)
                })
                .await
                else {
                    return;
                };
                store = Some(s);
                match r {
                    Ok(n) => {
                        stats.committed.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => {
                        stats.write_errors.fetch_add(1, Ordering::Relaxed);
                        if let Some(m) = &metrics {
                            m.store_write_error();
                        }
                        tracing::warn!(error = %e, "event store write failed; batch dropped");
                    }
                }
            }
            f.send(()).ok();
        }
    }
}

/// One transaction for `events` (and their flows); prune afterwards if asked. Returns the number
/// of events committed.
fn write_batch(
    store: &mut Store,
    events: &[DenialEvent],
    prune: bool,
    bounds: Bounds,
) -> Result<u64, super::StoreError> {
    let mut n = 0;
    if !events.is_empty() {
        let mut flows = FlowBatch::new();
        for ev in events {
            add_flow(&mut flows, ev);
        }
        store.write(events, &flows)?;
        n = events.len() as u64;
    }
    if prune {
        let p = store.prune(SystemTime::now(), bounds.max_age, bounds.max_bytes)?;
        if p.events + p.flows > 0 {
            tracing::info!(
                events = p.events,
                flows = p.flows,
                "event store pruned to its age/size bounds"
            );
        }
    }
    Ok(n)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::events::Verdict;
    use crate::store::query::EventFilter;
    use crate::store::tests::temp_db;

    #[tokio::test]
    async fn writes_what_the_sink_emits_and_counts_drops() {
        let path = temp_db("writer");
        let sink = EventSink::new(16);
        let metrics = Arc::new(Metrics::new());
        let h = spawn(
            Store::open(&path).unwrap(),
            &sink,
            100_000,
            true,
            Bounds {
                max_age: Duration::from_secs(3600),
                max_bytes: 1 << 30,
            },
            Some(metrics.clone()),
        );
        for i in 0..1000u16 {
            let v = match i % 3 {
                0 => Verdict::Deny,
                1 => Verdict::WouldDeny,
                _ => Verdict::Allow,
            };
            sink.emit(
                DenialEvent::proxy("ci", Some("a.example".into()), None, i, "connect", "r")
                    .with_verdict(v),
            );
        }
        h.flush().await;
        assert_eq!(h.stats().committed.load(Ordering::Relaxed), 1000);
        let r = Store::open_read_only(&path).unwrap();
        assert_eq!(
            r.events(&EventFilter::default(), 0, 10_000).unwrap().len(),
            667
        );
        assert_eq!(r.flows(&EventFilter::default()).unwrap().len(), 1000);
        drop(r);

        // A tiny queue overflows: the emitter never waits, the loss is counted.
        let sink2 = EventSink::new(16);
        let h2 = spawn(
            Store::open(&path).unwrap(),
            &sink2,
            16,
            false,
            Bounds {
                max_age: Duration::from_secs(3600),
                max_bytes: 1 << 30,
            },
            Some(metrics.clone()),
        );
        for i in 0..5000u16 {
            sink2.emit(DenialEvent::proxy("ci", None, None, i, "connect", "r"));
        }
        h2.flush().await;
        let dropped = h2.stats().dropped.load(Ordering::Relaxed);
        let committed = h2.stats().committed.load(Ordering::Relaxed);
        assert!(dropped > 0, "no drops with a 16-event queue");
        assert_eq!(dropped + committed, 5000);
        // One more batch reports the drops to the metrics.
        sink2.emit(DenialEvent::proxy("ci", None, None, 1, "connect", "r"));
        h2.flush().await;
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(&format!(
                "egress_agent_event_drops_total{{source=\"store\"}} {dropped}"
            )),
            "{text}"
        );
        assert!(text.contains("egress_agent_store_bytes "), "{text}");
        h.shutdown().await;
        h2.shutdown().await;
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }
}
