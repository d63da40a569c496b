//! Reading the store: [`EventFilter`] (what `events` and `suggest` select by), events and flows.
//! The same filter also matches live events (`events --follow`), so both views agree.
use std::collections::BTreeMap;
use std::time::SystemTime;

use rusqlite::types::Value;

use super::{Store, StoreError, from_micros, micros};
use crate::events::{ContainerRef, DenialEvent, Source, Verdict};

/// What to select. Every field set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// At or after this time.
    pub since: Option<SystemTime>,
    /// A container's name, its id, or a prefix of its id.
    pub container: Option<String>,
    pub policy: Option<String>,
    pub verdict: Option<Verdict>,
    /// Context labels that must be present with these values (e.g. `run` = `1234`).
    pub labels: BTreeMap<String, String>,
}

/// A context label name usable in a filter.
pub fn valid_label(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 64
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

impl EventFilter {
    /// Does a live event match?
    pub fn matches(&self, ev: &DenialEvent) -> bool {
        self.since.is_none_or(|t| ev.time >= t)
            && self.policy.as_ref().is_none_or(|p| &ev.policy == p)
            && self.verdict.is_none_or(|v| ev.verdict == v)
            && self.container.as_ref().is_none_or(|c| {
                ev.container
                    .as_ref()
                    .is_some_and(|r| &r.name == c || r.id.starts_with(c.as_str()))
            })
            && self
                .labels
                .iter()
                .all(|(k, v)| ev.context.get(k).is_some_and(|x| x == v))
    }

    /// SQL conditions (joined by AND, `1` if none) and their parameters, for `table`'s columns
    /// (`time` is `time_us` for events, `last_us` for flows; labels live in `context`/`labels`).
    fn sql(&self, time_col: &str, labels_col: &str) -> (String, Vec<Value>) {
        let mut conds = vec!["1".to_owned()];
        let mut params: Vec<Value> = Vec::new();
        // Each `?` in `cond` takes the next value, numbered after those already pushed.
        let mut push = |cond: String, vals: Vec<Value>| {
            let mut parts = cond.split('?');
            let mut c = parts.next().unwrap_or_default().to_owned();
            for (part, v) in parts.zip(vals) {
                params.push(v);
                c.push_str(&format!("?{}{part}", params.len()));
            }
            conds.push(c);
        };
        if let Some(t) = self.since {
            push(format!("{time_col} >= ?"), vec![Value::Integer(micros(t))]);
        }
        if let Some(p) = &self.policy {
            push("policy = ?".into(), vec![Value::Text(p.clone())]);
        }
        if let Some(v) = self.verdict {
            push("verdict = ?".into(), vec![Value::Text(v.as_str().into())]);
        }
        if let Some(c) = &self.container {
            push(
                "(container_name = ? OR substr(container_id, 1, length(?)) = ?)".into(),
                vec![
                    Value::Text(c.clone()),
                    Value::Text(c.clone()),
                    Value::Text(c.clone()),
                ],
            );
        }
        for (k, v) in &self.labels {
            // Names are checked by `valid_label`; the JSON path quotes them anyway.
            push(
                format!("json_extract({labels_col}, ?) = ?"),
                vec![Value::Text(format!("$.\"{k}\"")), Value::Text(v.clone())],
            );
        }
        (conds.join(" AND "), params)
    }
}

/// A stored event and its row id (for following new rows).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEvent {
    pub id: i64,
    pub event: DenialEvent,
}

/// One aggregated flow.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Flow {
    pub verdict: Verdict,
    pub source: String,
    pub policy: String,
    pub container_id: String,
    pub container_name: String,
    pub labels: BTreeMap<String, String>,
    pub host: String,
    pub ip: String,
    pub port: u16,
    pub protocol: String,
    pub reason: String,
    /// The rule that decided, as the event named it ([`DenialEvent::rule`]); `None` when none
    /// did, for flows recorded before events named their rule, and in a version-1 store read
    /// without migrating it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    pub count: u64,
    #[serde(serialize_with = "ser_time")]
    pub first_seen: SystemTime,
    #[serde(serialize_with = "ser_time")]
    pub last_seen: SystemTime,
}

fn ser_time<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_micros(*t))
}

fn parse_source(s: &str) -> Source {
    match s {
        "kernel" => Source::Kernel,
        "agent" => Source::Agent,
        _ => Source::Proxy,
    }
}

impl Store {
    /// `rule`, or `absent` (an SQL value) in a version-1 file read without migrating it.
    fn rule_column(&self, absent: &'static str) -> &'static str {
        if self.has_rule() { "rule" } else { absent }
    }

    /// `count`, or 1 in a file older than version 3 read without migrating it.
    fn count_column(&self) -> &'static str {
        if self.has_count() { "count" } else { "1" }
    }

    /// The newest `limit` events matching `filter` with an id above `after`, oldest first.
    pub fn events(
        &self,
        filter: &EventFilter,
        after: i64,
        limit: usize,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        let (cond, mut params) = filter.sql("time_us", "context");
        params.push(Value::Integer(after));
        let after_n = params.len();
        params.push(Value::Integer(i64::try_from(limit).unwrap_or(i64::MAX)));
        let limit_n = params.len();
        let rule = self.rule_column("NULL");
        let count = self.count_column();
        let sql = format!(
            "SELECT id, time_us, verdict, source, policy, container_id, container_name, cgroup_id,
                    context, host, ip, port, protocol, reason, {rule}, {count}
             FROM (SELECT * FROM events WHERE {cond} AND id > ?{after_n}
                   ORDER BY id DESC LIMIT ?{limit_n})
             ORDER BY id"
        );
        let conn = self.conn();
        let mut stmt = conn.prepare(&sql).map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params), |r| {
                let verdict: String = r.get(2)?;
                let source: String = r.get(3)?;
                let cid: Option<String> = r.get(5)?;
                let cname: Option<String> = r.get(6)?;
                let cgroup: Option<i64> = r.get(7)?;
                let context: String = r.get(8)?;
                let ip: Option<String> = r.get(10)?;
                Ok(StoredEvent {
                    id: r.get(0)?,
                    event: DenialEvent {
                        time: from_micros(r.get(1)?),
                        source: parse_source(&source),
                        cgroup_id: cgroup.map(|c| c as u64),
                        task_cgroup_id: None,
                        container: cid.map(|id| ContainerRef {
                            id,
                            name: cname.unwrap_or_default(),
                        }),
                        context: serde_json::from_str(&context).unwrap_or_default(),
                        policy: r.get(4)?,
                        host: r.get(9)?,
                        ip: ip.and_then(|s| s.parse().ok()),
                        port: r.get(11)?,
                        protocol: r.get(12)?,
                        reason: r.get(13)?,
                        verdict: verdict.parse().unwrap_or_default(),
                        rule: r.get(14)?,
                        count: u64::try_from(r.get::<_, i64>(15)?).unwrap_or(1),
                    },
                })
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// Flows matching `filter` (`since`: last seen at or after), in a stable order.
    pub fn flows(&self, filter: &EventFilter) -> Result<Vec<Flow>, StoreError> {
        let rule = self.rule_column("''");
        let order = format!(
            "ORDER BY host, ip, port, protocol, verdict, policy, container_name, labels, source,
                      reason, {rule}"
        );
        let mut out = Vec::new();
        self.select_flows(filter, &order, |f| out.push(f.to_flow()))?;
        Ok(out)
    }

    /// Every flow matching `filter`, handed to `each` as it is read — borrowing the row, in no
    /// particular order, none kept: for a reader of many flows (`replay` reads a whole store
    /// without an allocation per column). The number read.
    pub fn each_flow(
        &self,
        filter: &EventFilter,
        each: impl FnMut(&FlowRef<'_>),
    ) -> Result<u64, StoreError> {
        self.select_flows(filter, "", each)
    }

    fn select_flows(
        &self,
        filter: &EventFilter,
        order: &str,
        mut each: impl FnMut(&FlowRef<'_>),
    ) -> Result<u64, StoreError> {
        let (cond, params) = filter.sql("last_us", "labels");
        let rule = self.rule_column("''");
        let sql = format!(
            "SELECT verdict, source, policy, container_id, container_name, labels, host, ip, port,
                    protocol, reason, count, first_us, last_us, {rule}
             FROM flows WHERE {cond} {order}"
        );
        let conn = self.conn();
        let mut stmt = conn.prepare(&sql).map_err(|e| self.err(e))?;
        let mut rows = stmt
            .query(rusqlite::params_from_iter(params))
            .map_err(|e| self.err(e))?;
        let mut n = 0;
        while let Some(r) = rows.next().map_err(|e| self.err(e))? {
            each(&flow_row(r).map_err(|e| self.err(e))?);
            n += 1;
        }
        Ok(n)
    }
}

/// A flow as [`Store::each_flow`] reads it, borrowing the row's text; [`Flow::view`] gives the
/// same view of an owned flow, [`FlowRef::to_flow`] an owned copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRef<'a> {
    pub verdict: Verdict,
    pub source: &'a str,
    pub policy: &'a str,
    pub container_id: &'a str,
    pub container_name: &'a str,
    pub labels: Labels<'a>,
    pub host: &'a str,
    pub ip: &'a str,
    pub port: u16,
    pub protocol: &'a str,
    pub reason: &'a str,
    pub rule: Option<&'a str>,
    pub count: u64,
    pub first_seen: SystemTime,
    pub last_seen: SystemTime,
}

/// A flow's context labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Labels<'a> {
    /// A row's `labels` as the store writes them — a compact JSON object of strings — when it
    /// holds no escape: each string then runs to the next `"`, so the members are read in place
    /// ([`Labels::get`]), nothing parsed into a map or allocated.
    Plain(&'a str),
    /// A row's `labels` with escapes, parsed.
    Owned(BTreeMap<String, String>),
    /// An owned [`Flow`]'s.
    Of(&'a BTreeMap<String, String>),
}

impl<'a> Labels<'a> {
    /// The labels of a row's `labels` text.
    pub fn of_text(text: &'a str) -> Labels<'a> {
        if text.contains('\\') {
            Labels::Owned(serde_json::from_str(text).unwrap_or_default())
        } else {
            Labels::Plain(text)
        }
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        match self {
            Labels::Plain(text) => plain_get(text, key),
            Labels::Owned(m) => m.get(key).map(String::as_str),
            Labels::Of(m) => m.get(key).map(String::as_str),
        }
    }

    /// The labels as an owned map.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        match self {
            Labels::Plain(text) => serde_json::from_str(text).unwrap_or_default(),
            Labels::Owned(m) => m.clone(),
            Labels::Of(m) => (*m).clone(),
        }
    }
}

/// `key`'s value in a [`Labels::Plain`] text, read member by member: `{"k":"v","k":"v"}`,
/// each string running to the next quote (there is no escape). `None` for a missing key, and for
/// text of another shape.
fn plain_get<'t>(text: &'t str, key: &str) -> Option<&'t str> {
    let mut rest = text.strip_prefix('{')?;
    loop {
        let (k, after) = rest.strip_prefix('"')?.split_once('"')?;
        let (v, after) = after.strip_prefix(":\"")?.split_once('"')?;
        if k == key {
            return Some(v);
        }
        rest = after.strip_prefix(',')?;
    }
}

impl Flow {
    /// This flow as [`Store::each_flow`] hands flows over.
    pub fn view(&self) -> FlowRef<'_> {
        FlowRef {
            verdict: self.verdict,
            source: &self.source,
            policy: &self.policy,
            container_id: &self.container_id,
            container_name: &self.container_name,
            labels: Labels::Of(&self.labels),
            host: &self.host,
            ip: &self.ip,
            port: self.port,
            protocol: &self.protocol,
            reason: &self.reason,
            rule: self.rule.as_deref(),
            count: self.count,
            first_seen: self.first_seen,
            last_seen: self.last_seen,
        }
    }
}

impl FlowRef<'_> {
    pub fn to_flow(&self) -> Flow {
        Flow {
            verdict: self.verdict,
            source: self.source.to_owned(),
            policy: self.policy.to_owned(),
            container_id: self.container_id.to_owned(),
            container_name: self.container_name.to_owned(),
            labels: self.labels.to_map(),
            host: self.host.to_owned(),
            ip: self.ip.to_owned(),
            port: self.port,
            protocol: self.protocol.to_owned(),
            reason: self.reason.to_owned(),
            rule: self.rule.map(str::to_owned),
            count: self.count,
            first_seen: self.first_seen,
            last_seen: self.last_seen,
        }
    }
}

/// One row of [`Store::select_flows`]'s query.
fn flow_row<'r>(r: &'r rusqlite::Row<'_>) -> Result<FlowRef<'r>, rusqlite::Error> {
    let text = |i: usize| -> Result<&'r str, rusqlite::Error> {
        r.get_ref(i)?.as_str().map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e))
        })
    };
    let labels = Labels::of_text(text(5)?);
    let count: i64 = r.get(11)?;
    let rule = text(14)?;
    Ok(FlowRef {
        verdict: text(0)?.parse().unwrap_or_default(),
        source: text(1)?,
        policy: text(2)?,
        container_id: text(3)?,
        container_name: text(4)?,
        labels,
        host: text(6)?,
        ip: text(7)?,
        port: r.get(8)?,
        protocol: text(9)?,
        reason: text(10)?,
        rule: (!rule.is_empty()).then_some(rule),
        count: u64::try_from(count).unwrap_or(0),
        first_seen: from_micros(r.get(12)?),
        last_seen: from_micros(r.get(13)?),
    })
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    /// A row's labels read in place answer as the parsed JSON does, escapes or not.
    #[test]
    fn labels_read_in_place_are_the_parsed_ones() {
        let maps: [&[(&str, &str)]; 5] = [
            &[],
            &[("run", "42")],
            &[("comm", "curl"), ("hook", "connect4"), ("run", "7")],
            &[("a", "run"), ("brun", "x"), ("run", ""), ("xrun", "y")],
            &[("path", "/a\"b"), ("run", "r\\1"), ("é", "ü")],
        ];
        for m in maps {
            let map: BTreeMap<String, String> =
                m.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
            let text = serde_json::to_string(&map).unwrap();
            let labels = Labels::of_text(&text);
            for key in ["run", "a", "brun", "path", "hook", "missing", "é", "\"", ""] {
                assert_eq!(
                    labels.get(key),
                    map.get(key).map(String::as_str),
                    "{text} {key}"
                );
            }
            assert_eq!(labels.to_map(), map);
        }
    }

    /// The same, on many maps of keys and values made of the characters that matter (quotes,
    /// backslashes, the JSON punctuation, a key inside another, non-ASCII): every key and
    /// every fragment of the text looked up answers as the parsed map. (`fuzz/`'s `flow_labels`
    /// does this with chosen inputs.)
    #[test]
    fn labels_read_in_place_agree_on_tricky_maps() {
        const ALPHABET: [&str; 12] = ["r", "u", "n", "\"", "\\", ",", ":", "{", "}", "é", " ", "a"];
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..5_000 {
            let mut word = |max: usize| -> String {
                (0..next(max + 1))
                    .map(|_| ALPHABET[next(ALPHABET.len())])
                    .collect()
            };
            let map: BTreeMap<String, String> = (0..4).map(|_| (word(4), word(4))).collect();
            let text = serde_json::to_string(&map).unwrap();
            let labels = Labels::of_text(&text);
            let fragments = (0..text.len())
                .filter(|&i| text.is_char_boundary(i))
                .filter_map(|i| text.get(i..(i + 3).min(text.len())));
            for key in map
                .keys()
                .map(String::as_str)
                .chain(fragments)
                .chain(["run", "ru"])
            {
                assert_eq!(
                    labels.get(key),
                    map.get(key).map(String::as_str),
                    "{text} {key:?}"
                );
            }
        }
    }
    use crate::store::tests::temp_db;
    use crate::store::{FlowBatch, add_flow};
    use std::time::Duration;

    fn ev(name: &str, id: &str, policy: &str, verdict: Verdict, run: &str) -> DenialEvent {
        let mut e = DenialEvent::proxy(policy, Some("x.example".into()), None, 443, "connect", "r")
            .with_verdict(verdict);
        e.container = Some(ContainerRef {
            id: id.into(),
            name: name.into(),
        });
        e.context.insert("run".into(), run.into());
        e
    }

    #[test]
    fn stored_events_round_trip_and_filter_like_live_ones() {
        let path = temp_db("query");
        let mut s = Store::open(&path).unwrap();
        let t0 = SystemTime::now() - Duration::from_secs(60);
        let mut all = vec![
            ev("a", "aaaa1111", "ci", Verdict::Deny, "1"),
            ev("b", "bbbb2222", "ci", Verdict::WouldDeny, "2"),
            ev("a", "aaaa1111", "web", Verdict::WouldDeny, "1"),
        ];
        all[0].time = t0;
        all[0].ip = Some("10.0.0.1".parse().unwrap());
        all[0].cgroup_id = Some(77);
        all[1].rule = Some("mode deny_all".into());
        let mut batch = FlowBatch::new();
        for e in &all {
            add_flow(&mut batch, e);
        }
        s.write(&all, &batch).unwrap();
        let filters = [
            EventFilter::default(),
            EventFilter {
                container: Some("aaaa".into()),
                ..Default::default()
            },
            EventFilter {
                container: Some("b".into()),
                ..Default::default()
            },
            EventFilter {
                policy: Some("ci".into()),
                verdict: Some(Verdict::WouldDeny),
                ..Default::default()
            },
            EventFilter {
                since: Some(t0 + Duration::from_secs(1)),
                ..Default::default()
            },
            EventFilter {
                labels: [("run".to_owned(), "1".to_owned())].into(),
                ..Default::default()
            },
            EventFilter {
                container: Some("%".into()),
                ..Default::default()
            },
        ];
        for f in &filters {
            let stored: Vec<DenialEvent> = s
                .events(f, 0, 100)
                .unwrap()
                .into_iter()
                .map(|e| e.event)
                .collect();
            let live: Vec<DenialEvent> = all.iter().filter(|e| f.matches(e)).cloned().collect();
            // Time is kept to the microsecond.
            let trunc = |v: Vec<DenialEvent>| -> Vec<DenialEvent> {
                v.into_iter()
                    .map(|mut e| {
                        e.time = from_micros(micros(e.time));
                        e
                    })
                    .collect()
            };
            assert_eq!(trunc(stored), trunc(live), "{f:?}");
            let flows = s.flows(f).unwrap();
            let rules: Vec<Option<String>> = flows.iter().map(|f| f.rule.clone()).collect();
            let mut want: Vec<Option<String>> = all
                .iter()
                .filter(|e| f.matches(e))
                .map(|e| e.rule.clone())
                .collect();
            want.sort();
            let mut got = rules;
            got.sort();
            assert_eq!(got, want, "{f:?}");
            // Streamed: the same flows, in no particular order.
            let mut streamed = Vec::new();
            let n = s
                .each_flow(f, |flow| streamed.push(flow.to_flow()))
                .unwrap();
            assert_eq!(n as usize, flows.len());
            streamed.sort_by_key(|f| (f.host.clone(), f.policy.clone(), f.verdict.as_str()));
            let mut ordered = flows.clone();
            ordered.sort_by_key(|f| (f.host.clone(), f.policy.clone(), f.verdict.as_str()));
            assert_eq!(streamed, ordered, "{f:?}");
        }
        // Limit keeps the newest, oldest first; `after` skips what was seen.
        let last2 = s.events(&EventFilter::default(), 0, 2).unwrap();
        assert_eq!(last2.len(), 2);
        assert!(last2[0].id < last2[1].id);
        assert_eq!(last2[1].event.policy, "web");
        let newer = s.events(&EventFilter::default(), last2[0].id, 10).unwrap();
        assert_eq!(newer.len(), 1);
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }
}
