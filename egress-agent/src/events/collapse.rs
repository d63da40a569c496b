//! Collapsing identical refusals (issue #38 item 5, "event flood"): a workload retrying a
//! refused destination in a loop would otherwise cost the proxy a log line, a ring entry, a
//! broadcast, a store row and an export per attempt, on the connection's CPU.
//!
//! Two attempts are identical when their events differ in nothing but their time: same source,
//! workload (policy, cgroup, container, context labels), destination (host, address, port),
//! protocol, reason, verdict and rule. Per such key, within [`Collapser::window`]:
//! - the first attempt is recorded at once, as it comes (`count` 1): an operator, the ring and
//!   `events --follow` see a new refusal without delay;
//! - the identical ones after it are only counted (a hash lookup and an increment under a lock);
//! - once the window has passed, one **summary** event is recorded for them: the same fields,
//!   `time` = the last of them, `count` = how many (more than one attempt); the window starts
//!   again from there while the attempts go on, and a key quiet for a whole window is forgotten
//!   (its next attempt is recorded at once again).
//!
//! So the events of a key add up: the sum of their `count`s is the number of attempts, and the
//! first and last of them are the first and last attempt. Nothing is dropped: summaries are
//! recorded when their window ends (at the next attempt of any key, or by the sweep
//! [`super::EventSink::collapse_sweeper`] runs), and every pending one at
//! [`super::EventSink::flush_collapsed`] (the agent's stop, before the store and the exporters
//! are flushed). Allowed events are not collapsed (the store aggregates them as flows already).
//! At most [`MAX_KEYS`] keys are tracked; an attempt of another key while that many are is
//! recorded as it comes.
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, RandomState};
use std::time::{Duration, Instant};

use super::DenialEvent;

/// Default window: at most two events per second per key in a flood (the first, then one
/// summary per window while it lasts).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(1);
/// Most keys tracked at once (a scan of distinct destinations is recorded as it comes beyond it).
pub const MAX_KEYS: usize = 4096;

/// One key's attempts since its last recorded event.
struct Pending {
    /// The key's last recorded event (its fields are the key).
    ev: DenialEvent,
    /// Attempts counted, not yet recorded.
    count: u64,
    /// When the last counted attempt happened.
    last: std::time::SystemTime,
    /// When the window ends.
    due: Instant,
}

/// The identical-attempt counter of an [`super::EventSink`].
pub(super) struct Collapser {
    window: Duration,
    hasher: RandomState,
    pending: HashMap<u64, Pending>,
    next_sweep: Instant,
}

/// What identifies an attempt: every field but the time (and the count). One list of fields
/// for both the hash and the comparison, so the two can't disagree.
#[derive(PartialEq, Eq, Hash)]
struct Key<'a> {
    source: &'static str,
    cgroup_id: Option<u64>,
    task_cgroup_id: Option<u64>,
    container: Option<(&'a str, &'a str)>,
    context: &'a std::collections::BTreeMap<String, String>,
    policy: &'a str,
    host: Option<&'a str>,
    ip: Option<std::net::IpAddr>,
    port: u16,
    protocol: &'a str,
    reason: &'a str,
    verdict: super::Verdict,
    rule: Option<&'a str>,
}

fn key(ev: &DenialEvent) -> Key<'_> {
    Key {
        source: ev.source.as_str(),
        cgroup_id: ev.cgroup_id,
        task_cgroup_id: ev.task_cgroup_id,
        container: ev
            .container
            .as_ref()
            .map(|c| (c.id.as_str(), c.name.as_str())),
        context: &ev.context,
        policy: &ev.policy,
        host: ev.host.as_deref(),
        ip: ev.ip,
        port: ev.port,
        protocol: &ev.protocol,
        reason: &ev.reason,
        verdict: ev.verdict,
        rule: ev.rule.as_deref(),
    }
}

fn key_hash(hasher: &RandomState, ev: &DenialEvent) -> u64 {
    hasher.hash_one(key(ev))
}

/// `a` and `b` are the same attempt (at other times).
fn same(a: &DenialEvent, b: &DenialEvent) -> bool {
    key(a) == key(b)
}

impl Pending {
    /// The summary of what was counted (the counter starts again from 0).
    fn summary(&mut self) -> DenialEvent {
        let mut s = self.ev.clone();
        s.time = self.last;
        s.count = std::mem::take(&mut self.count);
        s
    }
}

impl Collapser {
    pub(super) fn new(window: Duration) -> Collapser {
        let window = window.max(Duration::from_millis(1));
        Collapser {
            window,
            hasher: RandomState::new(),
            pending: HashMap::new(),
            next_sweep: Instant::now() + window,
        }
    }

    pub(super) fn window(&self) -> Duration {
        self.window
    }

    /// One attempt at `now`: the event to record for it now, if any (`None`: counted). Summaries
    /// whose window has ended are pushed to `due` (record them first).
    pub(super) fn note(
        &mut self,
        ev: DenialEvent,
        now: Instant,
        due: &mut Vec<DenialEvent>,
    ) -> Option<DenialEvent> {
        if now >= self.next_sweep {
            self.sweep(now, due);
        }
        let key = key_hash(&self.hasher, &ev);
        if let Some(p) = self.pending.get_mut(&key) {
            if !same(&p.ev, &ev) {
                // Another attempt with the same hash: recorded as it comes.
                return Some(ev);
            }
            if now < p.due {
                p.count += 1;
                p.last = ev.time;
                return None;
            }
            // This key's window ended before the sweep came round to it.
            p.due = now + self.window;
            if p.count > 0 {
                due.push(p.summary());
                p.count = 1;
                p.last = ev.time;
                return None;
            }
            p.ev = ev.clone();
            return Some(ev);
        }
        if self.pending.len() < MAX_KEYS {
            self.pending.insert(
                key,
                Pending {
                    ev: ev.clone(),
                    count: 0,
                    last: ev.time,
                    due: now + self.window,
                },
            );
        }
        Some(ev)
    }

    /// [`Collapser::note`] for an attempt identical to `ev` but for its time (`time`), known by
    /// reference: `true` when it is only counted — its key's window is open — so nothing is
    /// built or recorded; `false`: record it through [`Collapser::note`] (which decides the same
    /// for every other case: a first attempt, a window that ended, a hash shared with another
    /// key).
    pub(super) fn count_again(
        &mut self,
        ev: &DenialEvent,
        time: std::time::SystemTime,
        now: Instant,
        due: &mut Vec<DenialEvent>,
    ) -> bool {
        if now >= self.next_sweep {
            self.sweep(now, due);
        }
        let key = key_hash(&self.hasher, ev);
        match self.pending.get_mut(&key) {
            Some(p) if now < p.due && same(&p.ev, ev) => {
                p.count += 1;
                p.last = time;
                true
            }
            _ => false,
        }
    }

    /// The summaries of the windows ended by `now`; forget the keys that were quiet in theirs.
    pub(super) fn sweep(&mut self, now: Instant, due: &mut Vec<DenialEvent>) {
        let window = self.window;
        self.pending.retain(|_, p| {
            if now < p.due {
                return true;
            }
            if p.count == 0 {
                return false;
            }
            due.push(p.summary());
            p.due = now + window;
            true
        });
        // Half a window: a summary is recorded at most 1.5 windows after its first attempt.
        self.next_sweep = now + window / 2;
    }

    /// Every pending summary, now; forget every key.
    pub(super) fn flush(&mut self, due: &mut Vec<DenialEvent>) {
        for (_, mut p) in self.pending.drain() {
            if p.count > 0 {
                due.push(p.summary());
            }
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::events::{EventSink, Verdict};
    use std::time::SystemTime;

    fn refusal(host: &str, port: u16) -> DenialEvent {
        let mut ev = DenialEvent::proxy(
            "ci",
            Some(host.into()),
            None,
            port,
            "connect",
            "host-not-allowed",
        );
        ev.context.insert("run".into(), "7".into());
        ev
    }

    /// Every distinct refusal is recorded as it comes, however many there are in the window
    /// (and the ring, the taps and the subscribers all see each).
    #[tokio::test]
    async fn distinct_refusals_are_all_recorded() {
        let sink = EventSink::with_collapse(8192, Duration::from_secs(3600));
        let mut tap = sink.tap(8192, false);
        let mut follow = sink.subscribe();
        let mut n = 0;
        for host in ["a.example", "b.example"] {
            for port in [443, 8443] {
                for reason in ["host-not-allowed", "port-not-allowed"] {
                    let mut ev = refusal(host, port);
                    ev.reason = reason.into();
                    sink.emit(ev.clone());
                    // Another workload, another verdict, another rule: other attempts too.
                    let mut other = ev.clone();
                    other.context.insert("run".into(), "8".into());
                    sink.emit(other);
                    sink.emit(ev.clone().with_verdict(Verdict::WouldDeny));
                    let mut ruled = ev;
                    ruled.rule = Some("allow_hosts a.example".into());
                    sink.emit(ruled);
                    n += 4;
                }
            }
        }
        assert_eq!(sink.recent(1000).len(), n);
        assert!(sink.recent(1000).iter().all(|e| e.count == 1));
        assert_eq!(sink.total(), n as u64);
        for _ in 0..n {
            assert_eq!(tap.rx.try_recv().unwrap().count, 1);
            assert_eq!(follow.try_recv().unwrap().count, 1);
        }
        assert!(tap.rx.try_recv().is_err());
    }

    /// N identical refusals in one window: the first at once, then one summary with the other
    /// N - 1 once the window is over — the counts add up to N, first and last times kept.
    #[test]
    fn identical_refusals_in_a_window_become_the_first_and_a_count() {
        let mut c = Collapser::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let first_time = SystemTime::now();
        let mut due = Vec::new();
        let mut recorded = Vec::new();
        for i in 0..1000u64 {
            let mut ev = refusal("denied.test", 443);
            ev.time = first_time + Duration::from_millis(i);
            let now = t0 + Duration::from_micros(i * 100);
            recorded.extend(c.note(ev, now, &mut due));
        }
        assert_eq!(recorded.len(), 1, "only the first is recorded at once");
        assert_eq!((recorded[0].count, recorded[0].time), (1, first_time));
        assert!(due.is_empty(), "nothing is due inside the window");
        c.sweep(t0 + Duration::from_secs(1), &mut due);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].count, 999);
        assert_eq!(due[0].time, first_time + Duration::from_millis(999));
        assert_eq!(due[0].host.as_deref(), Some("denied.test"));
        // Still flooding: counted in the next window, summarised when it ends.
        let mut due = Vec::new();
        let mut ev = refusal("denied.test", 443);
        ev.time = first_time + Duration::from_secs(1);
        assert!(
            c.note(ev, t0 + Duration::from_millis(1500), &mut due)
                .is_none()
        );
        // Its window ended without a sweep: the next attempt brings its summary out.
        let late = t0 + Duration::from_millis(2600);
        let mut ev = refusal("denied.test", 443);
        ev.time = first_time + Duration::from_secs(2);
        assert!(c.note(ev, late, &mut due).is_none());
        assert_eq!(due.iter().map(|e| e.count).collect::<Vec<_>>(), [1]);
        // Quiet for a whole window: forgotten, and the next attempt is recorded at once again.
        let mut due = Vec::new();
        c.sweep(late + Duration::from_secs(1), &mut due);
        assert_eq!(due.iter().map(|e| e.count).collect::<Vec<_>>(), [1]);
        let mut due = Vec::new();
        c.sweep(late + Duration::from_secs(2), &mut due);
        assert!(due.is_empty() && c.pending.is_empty());
        let again = c.note(
            refusal("denied.test", 443),
            late + Duration::from_secs(3),
            &mut due,
        );
        assert_eq!(again.map(|e| e.count), Some(1));
    }

    /// Through the sink: the ring, the taps, the subscribers and the total see the first event
    /// and the summary; the sweep records a summary without another attempt.
    #[tokio::test]
    async fn the_sink_records_the_first_and_the_summary() {
        let sink = EventSink::with_collapse(64, Duration::from_millis(50));
        let mut tap = sink.tap(64, false);
        for _ in 0..500 {
            sink.emit(refusal("denied.test", 443));
        }
        assert_eq!(sink.total(), 500, "every attempt is counted at once");
        assert_eq!(sink.recent(10).len(), 1);
        let sweeper = tokio::spawn(sink.collapse_sweeper());
        let summary = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let ev = tap.rx.recv().await.unwrap();
                if ev.count > 1 {
                    return ev;
                }
            }
        })
        .await
        .unwrap();
        sweeper.abort();
        assert_eq!(summary.count, 499);
        let ring = sink.recent(10);
        assert_eq!(ring.iter().map(|e| e.count).sum::<u64>(), 500);
        assert_eq!(sink.total(), 500, "a summary adds nothing to the total");
    }

    /// `count_again` (with `note` of a copy when it declines) decides what `note` of a copy
    /// decides, attempt for attempt: the first recorded, the rest of a window counted, a window
    /// that ended without a sweep, a quiet key forgotten, another key between them.
    #[test]
    fn count_again_decides_what_note_of_a_copy_decides() {
        let t0 = Instant::now();
        let base = SystemTime::now();
        let template = refusal("kept.example", 443);
        let other = refusal("other.example", 443);
        // Attempts (ms after t0, which key): inside the first window, past it without a sweep,
        // then after a quiet spell long enough to be forgotten.
        let mut plan: Vec<(u64, bool)> = (0..50).map(|i| (i * 10, i % 7 == 0)).collect();
        plan.extend((0..20).map(|i| (1200 + i * 20, false)));
        plan.extend((0..5).map(|i| (5000 + i, i == 2)));
        let run = |again: bool| {
            let mut c = Collapser::new(Duration::from_secs(1));
            let mut recorded = Vec::new();
            for &(ms, is_other) in &plan {
                let now = t0 + Duration::from_millis(ms);
                let time = base + Duration::from_millis(ms);
                let ev = if is_other { &other } else { &template };
                let mut due = Vec::new();
                if !(again && c.count_again(ev, time, now, &mut due)) {
                    let mut copy = ev.clone();
                    copy.time = time;
                    recorded.extend(c.note(copy, now, &mut due));
                }
                recorded.extend(due);
            }
            let mut due = Vec::new();
            c.flush(&mut due);
            recorded.extend(due);
            recorded
                .into_iter()
                .map(|e| (e.host.unwrap(), e.count, e.time))
                .collect::<Vec<_>>()
        };
        // (Summaries due at one sweep come in the map's order: compared sorted.)
        let (mut again, mut copies) = (run(true), run(false));
        again.sort();
        copies.sort();
        assert_eq!(again, copies);
        let total = |host: &str| {
            again
                .iter()
                .filter(|e| e.0 == host)
                .map(|e| e.1)
                .sum::<u64>()
        };
        assert_eq!(total("kept.example"), 66);
        assert_eq!(total("other.example"), 9);
        assert!(again.len() < 10, "collapsed: {again:?}");
    }

    /// Through the sink: `emit_again` of a kept event is counted in the total and recorded as
    /// the copies `emit` records would be (on a plain sink, every attempt), each with the
    /// attempt's time, not the template's.
    #[tokio::test]
    async fn emit_again_records_copies_with_their_own_time() {
        let mut template = refusal("kept.example", 443);
        template.time = SystemTime::UNIX_EPOCH;
        let started = SystemTime::now();
        for collapse in [true, false] {
            let sink = match collapse {
                true => EventSink::with_collapse(64, Duration::from_secs(3600)),
                false => EventSink::new(64),
            };
            let mut tap = sink.tap(64, false);
            for _ in 0..30 {
                sink.emit_again(&template);
            }
            assert_eq!(sink.total(), 30);
            sink.close_taps();
            let mut got = Vec::new();
            while let Some(ev) = tap.rx.recv().await {
                assert!(ev.time >= started, "the attempt's time: {ev:?}");
                let mut like = ev.clone();
                (like.time, like.count) = (template.time, 1);
                assert_eq!(like, template);
                got.push(ev.count);
            }
            let expected = if collapse { vec![1, 29] } else { vec![1; 30] };
            assert_eq!(got, expected, "collapse {collapse}");
        }
    }

    /// The stop loses nothing: pending counts are recorded by `flush_collapsed` (the agent calls
    /// it before it flushes the store and the exporters), before the taps close.
    #[tokio::test]
    async fn pending_counts_are_flushed_at_the_stop() {
        let sink = EventSink::with_collapse(64, Duration::from_secs(3600));
        let mut tap = sink.tap(64, false);
        for _ in 0..3 {
            sink.emit(refusal("a.example", 443));
        }
        for _ in 0..5 {
            sink.emit(refusal("b.example", 443));
        }
        sink.emit(refusal("c.example", 443));
        sink.close_taps();
        let mut got = Vec::new();
        while let Some(ev) = tap.rx.recv().await {
            got.push((ev.host.unwrap(), ev.count));
        }
        got.sort();
        assert_eq!(
            got,
            [
                ("a.example".to_owned(), 1),
                ("a.example".to_owned(), 2),
                ("b.example".to_owned(), 1),
                ("b.example".to_owned(), 4),
                ("c.example".to_owned(), 1),
            ]
        );
        // Nothing is left to flush.
        sink.flush_collapsed();
        assert_eq!(sink.recent(100).iter().map(|e| e.count).sum::<u64>(), 9);
    }

    /// Beyond MAX_KEYS distinct keys, attempts are recorded as they come (not collapsed, not
    /// lost).
    #[test]
    fn past_the_key_bound_attempts_are_recorded_as_they_come() {
        let mut c = Collapser::new(Duration::from_secs(1));
        let now = Instant::now();
        let mut due = Vec::new();
        for port in 0..MAX_KEYS as u16 {
            assert!(c.note(refusal("a.example", port), now, &mut due).is_some());
        }
        for _ in 0..3 {
            let ev = refusal("over.example", 1);
            assert!(c.note(ev, now, &mut due).is_some());
        }
        assert_eq!(c.pending.len(), MAX_KEYS);
        assert!(due.is_empty());
    }
}
