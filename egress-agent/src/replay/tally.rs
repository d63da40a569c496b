//! The replayer: flows in one at a time, each decided ([`super::decide`]) and counted by bucket,
//! destination and proposed decision. Its memory follows the distinct destinations, not the
//! flows, and holds few allocations whatever their number: the text flows repeat (reasons,
//! rules, containers, proposed decisions) is kept once and referred to by id; the tallies live
//! in one `Vec`, each with three fixed example slots; destinations' and runs' text is appended
//! to two strings, a tally naming its own by offset; the map from a destination to its tally is
//! keyed by the destination's (randomly seeded) hash, tallies of one hash chained and told apart
//! by their text. The destination of the flow at hand is written into one reused buffer. The
//! report lists the `limit` destinations with the most events per bucket, chosen without sorting
//! the others (a store of a million destinations lists twenty).
use std::cmp::{Ordering, Reverse};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::SystemTime;

// Randomly seeded per map, and faster than std's SipHash on these short keys.
use foldhash::{HashMap, HashMapExt};

use super::{
    Bucket, Count, Decided, EXAMPLES, Entry, Example, Now, Proposed, Recorded, Replayed, Report,
    Totals, Unrecorded, Unreplayed, decide,
};
use crate::events::Verdict;
use crate::store::query::FlowRef;

/// No text (an absent rule, container or run).
const NONE: u32 = u32::MAX;

/// Text kept once; tallies hold its ids.
#[derive(Debug, Default)]
struct Interner {
    ids: HashMap<Rc<str>, u32>,
    all: Vec<Rc<str>>,
}

impl Interner {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = u32::try_from(self.all.len()).unwrap_or(NONE);
        let s: Rc<str> = Rc::from(s);
        self.all.push(s.clone());
        self.ids.insert(s, id);
        id
    }

    fn opt(&mut self, s: Option<&str>) -> u32 {
        s.map_or(NONE, |s| self.id(s))
    }

    fn get(&self, id: u32) -> Option<&str> {
        self.all.get(id as usize).map(|s| &**s)
    }

    fn text(&self, id: u32) -> String {
        self.get(id).unwrap_or_default().to_owned()
    }
}

/// What a flow recorded, as ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rec {
    verdict: Verdict,
    reason: u32,
    rule: u32,
}

/// An example: when (µs), the container as an id, the run as where its text is in the
/// replayer's `runs` (runs rarely repeat across destinations the way containers do, so they are
/// not looked up). Small and `Copy`: a million destinations hold three each.
#[derive(Debug, Clone, Copy, Default)]
struct Ex {
    last_us: i64,
    container: u32,
    /// Start and length in `runs`; [`NONE`] start: no run.
    run: (u32, u32),
}

impl Ex {
    /// What examples are ordered by.
    fn key<'a>(
        &self,
        text: &'a Interner,
        runs: &'a str,
    ) -> (i64, Option<&'a str>, Option<&'a str>) {
        let (at, n) = (self.run.0 as usize, self.run.1 as usize);
        let run = (self.run.0 != NONE).then(|| runs.get(at..at + n)).flatten();
        (self.last_us, text.get(self.container), run)
    }
}

/// The sources a tally may be of (`source` is an index).
const SOURCES: [&str; 3] = ["proxy", "kernel", "agent"];

/// A destination's flows in one bucket with one proposed decision (`now`, an id): ~128 bytes.
#[derive(Debug)]
struct Tally {
    bucket: Bucket,
    /// In [`SOURCES`].
    source: u8,
    /// Examples held (the first `held` of `examples`, most recently seen first).
    held: u8,
    now: u32,
    /// The next tally of the same destination hash (another bucket or decision, or rarely
    /// another destination), or [`NONE`].
    next: u32,
    /// Its destination's text in the replayer's `dests`: start, length.
    dest: (u32, u32),
    count: Count,
    /// What its flows recorded: the first, then any other (rare: boxed).
    #[expect(
        clippy::box_collection,
        reason = "8 bytes in every tally rather than a Vec's 24: a million tallies, nearly all with one outcome"
    )]
    was: (Rec, Option<Box<Vec<Rec>>>),
    examples: [Ex; EXAMPLES],
}

impl Tally {
    fn new(bucket: Bucket, source: &'static str, now: u32, was: Rec, dest: (u32, u32)) -> Tally {
        Tally {
            bucket,
            source: SOURCES.iter().position(|s| *s == source).unwrap_or(0) as u8,
            held: 0,
            now,
            next: NONE,
            dest,
            count: Count::default(),
            was: (was, None),
            examples: [Ex::default(); EXAMPLES],
        }
    }

    fn dest<'d>(&self, dests: &'d str) -> &'d str {
        let (at, n) = (self.dest.0 as usize, self.dest.1 as usize);
        dests.get(at..at + n).unwrap_or_default()
    }

    fn source(&self) -> &'static str {
        SOURCES
            .get(self.source as usize)
            .copied()
            .unwrap_or("proxy")
    }

    fn fits(&self, bucket: Bucket, source: &'static str, now: u32) -> bool {
        self.bucket == bucket && self.now == now && self.source() == source
    }

    fn was(&self) -> impl Iterator<Item = &Rec> {
        std::iter::once(&self.was.0).chain(self.was.1.iter().flat_map(|v| v.iter()))
    }

    fn examples(&self) -> &[Ex] {
        &self.examples[..self.held as usize]
    }

    /// Count a flow: `events`, what it recorded, and as an example (last seen, container id,
    /// run; a run taken as an example is appended to `runs`).
    fn add(
        &mut self,
        events: u64,
        was: Rec,
        ex: (SystemTime, u32, Option<&str>),
        text: &Interner,
        runs: &mut String,
    ) {
        self.count.add(events);
        if !self.was().any(|w| *w == was) {
            self.was.1.get_or_insert_default().push(was);
        }
        // Most recent first; equal times by container and run, so the examples are the same
        // whatever order the flows come in.
        let (last_seen, container, run) = ex;
        let last_us = crate::store::micros(last_seen);
        let new = (last_us, text.get(container), run);
        let held = self.examples();
        if held.iter().any(|e| e.key(text, runs) == new) {
            return;
        }
        let at = held
            .iter()
            .position(|e| new > e.key(text, runs))
            .unwrap_or(held.len());
        if at >= EXAMPLES {
            return;
        }
        let run = match run {
            Some(r) => {
                let start = u32::try_from(runs.len()).unwrap_or(NONE);
                runs.push_str(r);
                (start, u32::try_from(r.len()).unwrap_or(0))
            }
            None => (NONE, 0),
        };
        self.examples[at..].rotate_right(1);
        self.examples[at] = Ex {
            last_us,
            container,
            run,
        };
        self.held = (self.held + 1).min(EXAMPLES as u8);
    }
}

/// The order of listed destinations: most events first, then by name (and rule).
type Listed<'t> = (&'t str, &'t Tally);

/// A destination's name as a number, for choosing among equal counts without comparing text
/// (FNV-1a: fixed, so the same store lists the same destinations every time).
fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Replays flows one at a time; [`Replayer::finish`] makes the report.
#[derive(Debug)]
pub struct Replayer<'a> {
    proposed: &'a Proposed,
    text: Interner,
    /// Each distinct proposed decision, described once.
    decisions: HashMap<Now, u32>,
    decided: Vec<Decided>,
    /// A destination's hash → its first tally in `tallies` (nearly always its only one).
    index: HashMap<u64, u32>,
    /// Seeds the destinations' hashes.
    seed: foldhash::fast::RandomState,
    tallies: Vec<Tally>,
    /// Every destination's text, one after the other.
    dests: String,
    /// (source, reason, why) → count.
    unreplayed: HashMap<(u32, u32, &'static str), Count>,
    unrecorded: BTreeMap<Unrecorded, Count>,
    totals: Totals,
    all: Count,
    first: Option<SystemTime>,
    last: Option<SystemTime>,
    /// The destination of the flow being replayed.
    dest: String,
    /// The examples' runs, one after the other.
    runs: String,
}

impl<'a> Replayer<'a> {
    pub fn new(proposed: &'a Proposed) -> Replayer<'a> {
        Replayer {
            proposed,
            text: Interner::default(),
            decisions: HashMap::new(),
            decided: Vec::new(),
            index: HashMap::new(),
            seed: foldhash::fast::RandomState::default(),
            tallies: Vec::new(),
            dests: String::new(),
            unreplayed: HashMap::new(),
            unrecorded: BTreeMap::new(),
            totals: Totals::default(),
            all: Count::default(),
            first: None,
            last: None,
            dest: String::new(),
            runs: String::new(),
        }
    }

    fn decision_id(&mut self, now: Now) -> u32 {
        if let Some(&id) = self.decisions.get(&now) {
            return id;
        }
        let id = u32::try_from(self.decided.len()).unwrap_or(NONE);
        self.decided.push(now.described(&self.proposed.compiled));
        self.decisions.insert(now, id);
        id
    }

    /// Replay one flow.
    pub fn add(&mut self, f: &FlowRef<'_>) {
        self.all.add(f.count);
        self.first = Some(self.first.map_or(f.first_seen, |t| t.min(f.first_seen)));
        self.last = Some(self.last.map_or(f.last_seen, |t| t.max(f.last_seen)));
        self.dest.clear();
        let (source, replayed) = decide::flow(self.proposed, f, &mut self.dest);
        let (now, unrecorded) = match replayed {
            Replayed::NotReplayable(why) => {
                self.totals.not_replayable.add(f.count);
                let key = (self.text.id(f.source), self.text.id(f.reason), why);
                self.unreplayed.entry(key).or_default().add(f.count);
                return;
            }
            Replayed::Decided { now, unrecorded } => (now, unrecorded),
        };
        let bucket = Bucket::of(f.verdict, now.verdict());
        self.totals.of_mut(bucket).add(f.count);
        if let Some(u) = unrecorded {
            self.unrecorded.entry(u).or_default().add(f.count);
        }
        let now = self.decision_id(now);
        let was = Rec {
            verdict: f.verdict,
            reason: self.text.id(f.reason),
            rule: self.text.opt(f.rule),
        };
        let container = (!f.container_name.is_empty()).then_some(f.container_name);
        let ex = (f.last_seen, self.text.opt(container), f.labels.get("run"));
        let at = self.tally(bucket, source, now, was);
        if let Some(t) = self.tallies.get_mut(at) {
            t.add(f.count, was, ex, &self.text, &mut self.runs);
        }
    }

    /// The tally of this flow's destination (in `dest`) for this bucket and decision: found,
    /// or made.
    fn tally(&mut self, bucket: Bucket, source: &'static str, now: u32, was: Rec) -> usize {
        use std::hash::BuildHasher as _;
        let dest = self.dest.as_str();
        let hash = self.seed.hash_one(dest);
        let new = u32::try_from(self.tallies.len()).unwrap_or(NONE);
        let mut at = match self.index.get(&hash) {
            Some(&first) => first,
            None => {
                self.index.insert(hash, new);
                NONE
            }
        };
        let mut last = None;
        while let Some(t) = self.tallies.get(at as usize) {
            if t.fits(bucket, source, now) && t.dest(&self.dests) == dest {
                return at as usize;
            }
            last = Some(at as usize);
            at = t.next;
        }
        if let Some(t) = last.and_then(|l| self.tallies.get_mut(l)) {
            t.next = new;
        }
        let start = u32::try_from(self.dests.len()).unwrap_or(NONE);
        self.dests.push_str(dest);
        let span = (start, u32::try_from(dest.len()).unwrap_or(0));
        self.tallies
            .push(Tally::new(bucket, source, now, was, span));
        new as usize
    }

    /// The report, listing at most `limit` destinations per bucket (0: all), those with the
    /// most events.
    pub fn finish(self, limit: usize) -> Report {
        let mut per_bucket: [Vec<(u64, Listed<'_>)>; 5] = Default::default();
        for t in &self.tallies {
            let dest = t.dest(&self.dests);
            per_bucket[t.bucket as usize].push((name_hash(dest), (dest, t)));
        }
        let rule = |t: &Tally| {
            self.decided
                .get(t.now as usize)
                .and_then(|d| d.rule.as_deref())
        };
        let listed = |a: &Listed<'_>, b: &Listed<'_>| -> Ordering {
            (Reverse(a.1.count.events), a.0, rule(a.1)).cmp(&(
                Reverse(b.1.count.events),
                b.0,
                rule(b.1),
            ))
        };
        // Which ones: most events; among equal counts by the name's hash (numbers, where a
        // million tied names would be a million string comparisons).
        let chosen = |a: &(u64, Listed<'_>), b: &(u64, Listed<'_>)| -> Ordering {
            (Reverse(a.1.1.count.events), a.0)
                .cmp(&(Reverse(b.1.1.count.events), b.0))
                .then_with(|| listed(&a.1, &b.1))
        };
        let mut destinations = Vec::new();
        let mut unlisted = BTreeMap::new();
        for (bucket, mut all) in Bucket::ALL.into_iter().zip(per_bucket) {
            let n = all.len();
            if limit > 0 && n > limit {
                all.select_nth_unstable_by(limit - 1, chosen);
                all.truncate(limit);
                unlisted.insert(bucket, n - limit);
            }
            let mut all: Vec<Listed<'_>> = all.into_iter().map(|(_, l)| l).collect();
            all.sort_by(listed);
            destinations.extend(all.into_iter().map(|(dest, t)| self.entry(dest, t)));
        }
        let mut not_replayable: Vec<Unreplayed> = self
            .unreplayed
            .iter()
            .map(|(&(source, reason, why), c)| Unreplayed {
                source: self.text.text(source),
                reason: self.text.text(reason),
                why,
                flows: c.flows,
                events: c.events,
            })
            .collect();
        not_replayable.sort_by(|a, b| {
            (Reverse(a.events), &a.source, &a.reason, a.why).cmp(&(
                Reverse(b.events),
                &b.source,
                &b.reason,
                b.why,
            ))
        });
        Report {
            policy: self.proposed.name.clone(),
            audit: self.proposed.audits(),
            flows: self.all.flows,
            events: self.all.events,
            first_seen: self.first,
            last_seen: self.last,
            totals: self.totals.clone(),
            destinations,
            unlisted,
            not_replayable,
            notes: self.unrecorded.iter().map(|(u, c)| u.note(*c)).collect(),
        }
    }

    /// One listed destination, its text taken from the ids.
    fn entry(&self, dest: &str, t: &Tally) -> Entry {
        let recorded = |r: &Rec| Recorded {
            verdict: r.verdict,
            reason: self.text.text(r.reason),
            rule: self.text.get(r.rule).map(str::to_owned),
        };
        let mut was: Vec<Recorded> = t.was().map(recorded).collect();
        was.sort_by(|a, b| {
            (a.verdict.as_str(), &a.reason, &a.rule).cmp(&(b.verdict.as_str(), &b.reason, &b.rule))
        });
        Entry {
            bucket: t.bucket,
            source: t.source(),
            destination: dest.to_owned(),
            flows: t.count.flows,
            events: t.count.events,
            was,
            now: self
                .decided
                .get(t.now as usize)
                .cloned()
                .unwrap_or(Decided {
                    verdict: Verdict::Deny,
                    reason: None,
                    rule: None,
                }),
            examples: t
                .examples()
                .iter()
                .map(|e| {
                    let (_, container, run) = e.key(&self.text, &self.runs);
                    Example {
                        container: container.map(str::to_owned),
                        run: run.map(str::to_owned),
                        last_seen: crate::store::from_micros(e.last_us),
                    }
                })
                .collect(),
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use std::hash::BuildHasher as _;
    use std::path::Path;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::store::query::Flow;

    fn proposed() -> Proposed {
        let c = crate::config::Config::from_toml_str(
            "[policies.p]\nallow_hosts = [\"github.com\"]\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let endpoint = egress_policy::explain::ProxyEndpoint {
            endpoint: "169.254.100.1:3128".parse().unwrap(),
            endpoint_v6: None,
        };
        Proposed::new("p", c.policy("p").unwrap(), endpoint)
    }

    fn flow(host: &str, verdict: Verdict, reason: &str, count: u64) -> Flow {
        Flow {
            verdict,
            source: "proxy".into(),
            policy: "p".into(),
            container_id: String::new(),
            container_name: "job".into(),
            labels: Default::default(),
            host: host.into(),
            ip: String::new(),
            port: 443,
            protocol: "connect".into(),
            reason: reason.into(),
            rule: None,
            count,
            first_seen: UNIX_EPOCH,
            last_seen: UNIX_EPOCH + Duration::from_secs(count),
        }
    }

    fn counts(r: &Report) -> Vec<(Bucket, &str, u64)> {
        r.destinations
            .iter()
            .map(|e| (e.bucket, e.destination.as_str(), e.events))
            .collect()
    }

    /// One destination in two buckets: two tallies on one hash, both counted.
    #[test]
    fn a_destination_in_two_buckets_has_a_tally_in_each() {
        let p = proposed();
        let mut r = Replayer::new(&p);
        r.add(&flow("a.test", Verdict::Allow, "allowed", 3).view());
        r.add(&flow("a.test", Verdict::Deny, "host-not-allowed", 2).view());
        r.add(&flow("a.test", Verdict::Allow, "allowed", 4).view());
        assert_eq!(r.index.len(), 1);
        assert_eq!(r.tallies.len(), 2);
        let report = r.finish(0);
        assert_eq!(
            counts(&report),
            [
                (Bucket::NewlyDenied, "a.test:443", 7),
                (Bucket::UnchangedDenied, "a.test:443", 2)
            ]
        );
    }

    /// Two destinations whose hashes collide (made to, here) keep apart: the chain is told
    /// apart by the text.
    #[test]
    fn destinations_of_one_hash_are_told_apart_by_their_text() {
        let p = proposed();
        let mut r = Replayer::new(&p);
        r.add(&flow("a.test", Verdict::Allow, "allowed", 3).view());
        let b = r.seed.hash_one("b.test:443");
        r.index.insert(b, 0);
        r.add(&flow("b.test", Verdict::Allow, "allowed", 5).view());
        r.add(&flow("b.test", Verdict::Allow, "allowed", 1).view());
        r.add(&flow("a.test", Verdict::Allow, "allowed", 1).view());
        assert_eq!(r.tallies.len(), 2);
        assert_eq!(r.tallies[0].next, 1, "b.test chained after a.test");
        let report = r.finish(0);
        assert_eq!(
            counts(&report),
            [
                (Bucket::NewlyDenied, "b.test:443", 6),
                (Bucket::NewlyDenied, "a.test:443", 4)
            ]
        );
    }

    /// The limit lists the destinations with the most events per bucket, the same whatever
    /// order the flows come in; the others are counted.
    #[test]
    fn the_limit_lists_the_most_events_per_bucket() {
        let p = proposed();
        let mut flows: Vec<Flow> = (1..=30)
            .map(|i| {
                flow(
                    &format!("h{i:02}.test"),
                    Verdict::Allow,
                    "allowed",
                    i % 7 + 1,
                )
            })
            .collect();
        flows.push(flow("github.com", Verdict::Allow, "allowed", 1));
        let run = |flows: &[Flow]| {
            let mut r = Replayer::new(&p);
            for f in flows {
                r.add(&f.view());
            }
            r.finish(5)
        };
        let forward = run(&flows);
        flows.reverse();
        assert_eq!(run(&flows), forward);
        let denied: Vec<u64> = forward
            .destinations
            .iter()
            .filter(|e| e.bucket == Bucket::NewlyDenied)
            .map(|e| e.events)
            .collect();
        assert_eq!(denied, [7, 7, 7, 7, 6], "{forward:#?}");
        assert_eq!(forward.unlisted.get(&Bucket::NewlyDenied), Some(&25));
        assert_eq!(forward.unlisted.get(&Bucket::UnchangedAllowed), None);
        assert_eq!(forward.totals.newly_denied.flows, 30);
    }
}
