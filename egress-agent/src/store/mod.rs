//! The durable event store: SQLite (rusqlite, bundled) in WAL mode at
//! `<agent.state_dir>/events.db` (directory 0700, file 0600).
//!
//! Two tables (and `changes`, the policy changes made through the control API, see
//! [`changes`]):
//! - `events`: every denial and would-deny, one row each, with exactly the fields of a
//!   [`DenialEvent`] (the context labels as a JSON object; `count`, the attempts a summary of
//!   identical ones stands for, see [`crate::events::collapse`]).
//! - `flows`: every event (allowed ones too) aggregated by what it was — verdict, source, policy,
//!   container, context labels (without the pid), host or address, port, protocol, reason —
//!   with a count, first/last seen and the rule that decided it last. `suggest` reads these.
//!
//! Schema version 2 added `rule` (the rule of the policy that decided) to both, as a column
//! outside every key: [`Store::open`] migrates a version-1 file in one transaction (two `ALTER
//! TABLE ... ADD COLUMN`), and a version-1 agent still draining after a hand-over to this one
//! goes on writing the same tables unchanged (its rows have no rule). [`Store::open_read_only`]
//! reads a version-1 file as it is (no rule).
//!
//! Schema version 3 added `events.count` (how many identical attempts the row stands for,
//! [`DenialEvent::count`]; `DEFAULT 1`), the same way: one `ALTER TABLE ... ADD COLUMN` at
//! [`Store::open`], an older agent still draining writes rows of count 1 unchanged, and
//! [`Store::open_read_only`] reads an older file's rows as count 1.
//!
//! Durability: each batch is one transaction with `synchronous = FULL`, so a committed batch
//! survives a crash of the agent (kill -9) and of the machine; an interrupted one is rolled back
//! by SQLite on the next open. Writes happen off the hot path ([`writer`]); the size and age
//! bounds are kept by [`Store::prune`].
//!
//! What a row can hold is fixed by the event type: names, addresses, ports, protocol, policy,
//! reason, container and context labels. There is no column for a URL, path, query string,
//! header or body.
pub mod changes;
pub mod query;
pub mod selection;
pub mod writer;

use std::collections::BTreeMap;
use std::fs::{DirBuilder, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags, params};

use crate::events::{DenialEvent, Verdict};

/// Start the store writer for `config` on `events` (inside a tokio runtime); `None` when
/// `store.enabled = false`. An unusable store (directory, permissions, a corrupt file) is an error:
/// an agent that silently recorded nothing would mislead an operator reading it for `suggest`.
pub fn start(
    config: &crate::config::Config,
    events: &crate::events::EventSink,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
) -> Result<Option<writer::StoreHandle>, StoreError> {
    if !config.store.enabled {
        return Ok(None);
    }
    let store = Store::open(&config.agent.store_path())?;
    Ok(Some(writer::spawn(
        store,
        events,
        config.store.queue,
        config.store.record_allowed,
        writer::Bounds::from(&config.store),
        metrics,
    )))
}

/// The database file name under `agent.state_dir` (the configuration names it).
pub use crate::config::STORE_DB_FILE as DB_FILE;

/// Schema version in `PRAGMA user_version`. 1: the first; 2: `events.rule` and `flows.rule` (the
/// rule of the policy that decided, see [`DenialEvent::rule`]), `rule` part of a flow's key; 3:
/// `events.count` (the attempts a row stands for, see [`DenialEvent::count`]).
const SCHEMA_VERSION: i64 = 3;

const EVENTS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY,
    time_us INTEGER NOT NULL,
    verdict TEXT NOT NULL,
    source TEXT NOT NULL,
    policy TEXT NOT NULL,
    container_id TEXT,
    container_name TEXT,
    cgroup_id INTEGER,
    context TEXT NOT NULL DEFAULT '{}',
    host TEXT,
    ip TEXT,
    port INTEGER NOT NULL,
    protocol TEXT NOT NULL,
    reason TEXT NOT NULL,
    rule TEXT,
    count INTEGER NOT NULL DEFAULT 1
);
";

/// Made after the tables.
const INDEXES: &str = "
CREATE INDEX IF NOT EXISTS events_time ON events(time_us);
CREATE INDEX IF NOT EXISTS flows_last ON flows(last_us);
";

const FLOWS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS flows(
    id INTEGER PRIMARY KEY,
    verdict TEXT NOT NULL,
    source TEXT NOT NULL,
    policy TEXT NOT NULL,
    container_id TEXT NOT NULL,
    container_name TEXT NOT NULL,
    labels TEXT NOT NULL,
    host TEXT NOT NULL,
    ip TEXT NOT NULL,
    port INTEGER NOT NULL,
    protocol TEXT NOT NULL,
    reason TEXT NOT NULL,
    count INTEGER NOT NULL,
    first_us INTEGER NOT NULL,
    last_us INTEGER NOT NULL,
    rule TEXT NOT NULL DEFAULT '',
    UNIQUE(verdict, source, policy, container_id, container_name, labels, host, ip, port,
           protocol, reason)
);
";

/// Does `table` exist and have `column`?
fn has_column(conn: &Connection, table: &str, column: &str) -> Result<bool, rusqlite::Error> {
    conn.query_row(
        "SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2",
        params![table, column],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n > 0)
}

/// Bring an older file's tables to this version (inside the caller's transaction). Decided by
/// the columns, not the version alone: a version-1 agent stamped the version after creating its
/// tables, so a file it crashed in between has version-1 tables and version 0.
fn migrate(conn: &Connection) -> Result<(), rusqlite::Error> {
    if has_table(conn, "events")? && !has_column(conn, "events", "rule")? {
        conn.execute_batch("ALTER TABLE events ADD COLUMN rule TEXT;")?;
    }
    if has_table(conn, "flows")? && !has_column(conn, "flows", "rule")? {
        conn.execute_batch("ALTER TABLE flows ADD COLUMN rule TEXT NOT NULL DEFAULT '';")?;
    }
    if has_table(conn, "events")? && !has_column(conn, "events", "count")? {
        conn.execute_batch("ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;")?;
    }
    Ok(())
}

fn has_table(conn: &Connection, table: &str) -> Result<bool, rusqlite::Error> {
    conn.query_row(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        params![table],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n > 0)
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Sql {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("{path}: schema version {found} is newer than this agent's ({SCHEMA_VERSION})")]
    Version { path: PathBuf, found: i64 },
}

/// An open store (one connection).
pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// The tables have `rule` (version 2). Always after [`Store::open`] (which migrates); a
    /// version-1 file opened with [`Store::open_read_only`] has not, and reads as `rule` unknown.
    has_rule: bool,
    /// `events` has `count` (version 3). As `has_rule`; an older file reads as count 1.
    has_count: bool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

/// Microseconds since the epoch (0 before it).
pub fn micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The inverse of [`micros`].
pub fn from_micros(us: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

/// Context keys left out of a flow's labels (unbounded: one flow per process otherwise).
const NOT_FLOW_LABELS: &[&str] = &["pid"];

/// What a flow is keyed by, from one event.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    pub verdict: &'static str,
    pub source: &'static str,
    pub policy: String,
    pub container_id: String,
    pub container_name: String,
    /// JSON object of the context labels (sorted keys).
    pub labels: String,
    pub host: String,
    /// Empty for allowed traffic to a name (its addresses change with DNS); kept for refusals,
    /// whose reason may be the address (a name resolving to a private address).
    pub ip: String,
    pub port: u16,
    pub protocol: String,
    pub reason: String,
}

impl FlowKey {
    pub fn of(ev: &DenialEvent) -> FlowKey {
        let labels: BTreeMap<&str, &str> = ev
            .context
            .iter()
            .filter(|(k, _)| !NOT_FLOW_LABELS.contains(&k.as_str()))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        FlowKey {
            verdict: ev.verdict.as_str(),
            source: ev.source.as_str(),
            policy: ev.policy.clone(),
            container_id: ev.container.as_ref().map_or("", |c| &c.id).to_owned(),
            container_name: ev.container.as_ref().map_or("", |c| &c.name).to_owned(),
            labels: serde_json::to_string(&labels).unwrap_or_else(|_| "{}".to_owned()),
            host: ev.host.clone().unwrap_or_default(),
            ip: match (&ev.host, ev.ip, ev.verdict) {
                (Some(_), _, Verdict::Allow) | (_, None, _) => String::new(),
                (_, Some(ip), _) => ip.to_string(),
            },
            port: ev.port,
            protocol: ev.protocol.clone(),
            reason: ev.reason.clone(),
        }
    }
}

/// Count and first/last seen (µs) of one flow in a batch, and the rule that decided it last
/// ([`DenialEvent::rule`]; empty for none). The rule is not part of what a flow is: after a
/// policy change the flow goes on, decided by the new rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowStats {
    pub count: u64,
    pub first_us: i64,
    pub last_us: i64,
    pub rule: String,
}

/// Flows aggregated in memory before a write.
pub type FlowBatch = std::collections::HashMap<FlowKey, FlowStats>;

/// Add one event (its [`DenialEvent::count`] attempts) to a batch of flows.
pub fn add_flow(batch: &mut FlowBatch, ev: &DenialEvent) {
    let t = micros(ev.time);
    let rule = || ev.rule.clone().unwrap_or_default();
    batch
        .entry(FlowKey::of(ev))
        .and_modify(|s| {
            s.count += ev.count;
            s.first_us = s.first_us.min(t);
            if t >= s.last_us {
                s.last_us = t;
                s.rule = rule();
            }
        })
        .or_insert_with(|| FlowStats {
            count: ev.count,
            first_us: t,
            last_us: t,
            rule: rule(),
        });
}

/// What [`Store::prune`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    pub events: u64,
    pub flows: u64,
}

impl Store {
    /// Open (creating the directory 0700, the file 0600 and the schema) for writing.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let io = |source| StoreError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            if !dir.exists() {
                DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(io)?;
            }
            // A directory others can write to (say, /tmp) would let them swap the files: refused.
            // An existing directory is never chmod-ed (it may be shared, like /var/lib itself).
            let meta = std::fs::metadata(dir).map_err(io)?;
            if meta.permissions().mode() & 0o022 != 0 {
                return Err(StoreError::Io {
                    path: dir.to_owned(),
                    source: std::io::Error::other(
                        "writable by group or others; agent.state_dir must be a private directory",
                    ),
                });
            }
        }
        // Create the file 0600 ourselves (SQLite gives -wal/-shm the database file's mode), and
        // never through a symbolic link.
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(io)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| StoreError::Sql {
            path: path.to_owned(),
            source,
        })?;
        let store = Store {
            conn,
            path: path.to_owned(),
            // `init` migrates.
            has_rule: true,
            has_count: true,
        };
        store.init().map_err(|source| store.err(source))?;
        Ok(store)
    }

    /// Open an existing store read-only (the CLI when the daemon is not running).
    pub fn open_read_only(path: &Path) -> Result<Store, StoreError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| StoreError::Sql {
            path: path.to_owned(),
            source,
        })?;
        conn.busy_timeout(Duration::from_secs(5))
            .map_err(|source| StoreError::Sql {
                path: path.to_owned(),
                source,
            })?;
        let mut store = Store {
            conn,
            path: path.to_owned(),
            has_rule: false,
            has_count: false,
        };
        let found: i64 = store
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|source| store.err(source))?;
        if found > SCHEMA_VERSION {
            return Err(StoreError::Version {
                path: path.to_owned(),
                found,
            });
        }
        // Not migrated here (read-only): an older daemon's store is read as it is.
        store.has_rule = store.read_has_rule()?;
        store.has_count = has_column(&store.conn, "events", "count").map_err(|e| store.err(e))?;
        Ok(store)
    }

    fn read_has_rule(&self) -> Result<bool, StoreError> {
        let has = |t| has_column(&self.conn, t, "rule").map_err(|e| self.err(e));
        Ok(has("events")? && has("flows")?)
    }

    /// Do the tables have `rule`? (No: a version-1 file opened read-only.)
    pub(crate) fn has_rule(&self) -> bool {
        self.has_rule
    }

    /// Does `events` have `count`? (No: a file older than version 3 opened read-only.)
    pub(crate) fn has_count(&self) -> bool {
        self.has_count
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sql {
            path: self.path.clone(),
            source,
        }
    }

    fn init(&self) -> Result<(), rusqlite::Error> {
        self.conn.busy_timeout(Duration::from_secs(5))?;
        // Before any table exists; a no-op on an existing file (which already has it).
        self.conn
            .pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
        let mode: String = self
            .conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(rusqlite::Error::InvalidParameterName(format!(
                "journal_mode is {mode}, WAL expected"
            )));
        }
        self.conn.pragma_update(None, "synchronous", "FULL")?;
        // Read, migrated and stamped in one transaction: a crash leaves the old version whole.
        let tx = rusqlite::Transaction::new_unchecked(
            &self.conn,
            rusqlite::TransactionBehavior::Immediate,
        )?;
        let found: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if found > SCHEMA_VERSION {
            return Err(rusqlite::Error::InvalidParameterName(format!(
                "schema version {found} is newer than this agent's ({SCHEMA_VERSION})"
            )));
        }
        if found < SCHEMA_VERSION {
            migrate(&tx)?;
        }
        tx.execute_batch(EVENTS_TABLE)?;
        tx.execute_batch(FLOWS_TABLE)?;
        tx.execute_batch(INDEXES)?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        tx.commit()
    }

    /// Write `events` (denials and would-denials: one row each) and `flows` in one transaction.
    pub fn write(&mut self, events: &[DenialEvent], flows: &FlowBatch) -> Result<(), StoreError> {
        self.write_inner(events, flows)
            .map_err(|source| self.err(source))
    }

    fn write_inner(
        &mut self,
        events: &[DenialEvent],
        flows: &FlowBatch,
    ) -> Result<(), rusqlite::Error> {
        let tx = self.conn.transaction()?;
        {
            let mut ins = tx.prepare_cached(
                "INSERT INTO events(time_us, verdict, source, policy, container_id,
                    container_name, cgroup_id, context, host, ip, port, protocol, reason, rule,
                    count)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
            )?;
            for ev in events.iter().filter(|e| e.verdict != Verdict::Allow) {
                ins.execute(params![
                    micros(ev.time),
                    ev.verdict.as_str(),
                    ev.source.as_str(),
                    ev.policy,
                    ev.container.as_ref().map(|c| c.id.as_str()),
                    ev.container.as_ref().map(|c| c.name.as_str()),
                    ev.cgroup_id.map(|c| c as i64),
                    serde_json::to_string(&ev.context).unwrap_or_else(|_| "{}".to_owned()),
                    ev.host,
                    ev.ip.map(|ip| ip.to_string()),
                    ev.port,
                    ev.protocol,
                    ev.reason,
                    ev.rule,
                    i64::try_from(ev.count).unwrap_or(i64::MAX),
                ])?;
            }
            let mut up = tx.prepare_cached(
                "INSERT INTO flows(verdict, source, policy, container_id, container_name, labels,
                    host, ip, port, protocol, reason, rule, count, first_us, last_us)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
                 ON CONFLICT(verdict, source, policy, container_id, container_name, labels, host,
                    ip, port, protocol, reason)
                 DO UPDATE SET count = count + excluded.count,
                    first_us = min(first_us, excluded.first_us),
                    rule = CASE WHEN excluded.last_us >= last_us THEN excluded.rule ELSE rule END,
                    last_us = max(last_us, excluded.last_us)",
            )?;
            for (k, s) in flows {
                up.execute(params![
                    k.verdict,
                    k.source,
                    k.policy,
                    k.container_id,
                    k.container_name,
                    k.labels,
                    k.host,
                    k.ip,
                    k.port,
                    k.protocol,
                    k.reason,
                    s.rule,
                    i64::try_from(s.count).unwrap_or(i64::MAX),
                    s.first_us,
                    s.last_us,
                ])?;
            }
        }
        tx.commit()
    }

    /// Bytes the database holds (pages in use; the file may be larger until it is vacuumed).
    pub fn used_bytes(&self) -> Result<u64, StoreError> {
        let q = |p: &str| -> Result<i64, StoreError> {
            self.conn
                .query_row(&format!("PRAGMA {p}"), [], |r| r.get(0))
                .map_err(|e| self.err(e))
        };
        let used = (q("page_count")? - q("freelist_count")?) * q("page_size")?;
        Ok(u64::try_from(used).unwrap_or(0))
    }

    /// Size on disk: the database file and its WAL.
    pub fn file_bytes(&self) -> u64 {
        let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        let mut wal = self.path.clone().into_os_string();
        wal.push("-wal");
        len(&self.path) + len(Path::new(&wal))
    }

    /// Delete events and flows last seen before `now - max_age`, then the oldest events (and,
    /// if that is not enough, the oldest flows) until the pages in use fit in `max_bytes`;
    /// give the freed pages back to the file system.
    pub fn prune(
        &mut self,
        now: SystemTime,
        max_age: Duration,
        max_bytes: u64,
    ) -> Result<Pruned, StoreError> {
        let cutoff = micros(now.checked_sub(max_age).unwrap_or(UNIX_EPOCH));
        let mut pruned = Pruned::default();
        let exec = |s: &Store, sql: &str, p: &[&dyn rusqlite::ToSql]| -> Result<u64, StoreError> {
            s.conn
                .execute(sql, p)
                .map(|n| n as u64)
                .map_err(|e| s.err(e))
        };
        pruned.events += exec(self, "DELETE FROM events WHERE time_us < ?1", &[&cutoff])?;
        pruned.flows += exec(self, "DELETE FROM flows WHERE last_us < ?1", &[&cutoff])?;
        // Size: cut to 90% so the next prune isn't right away.
        let target = max_bytes / 10 * 9;
        for (table, order) in [("events", "id"), ("flows", "last_us")] {
            while self.used_bytes()? > target {
                let rows: i64 = self
                    .conn
                    .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
                    .map_err(|e| self.err(e))?;
                if rows == 0 {
                    break;
                }
                let n = (rows / 10).max(100);
                let sql = format!(
                    "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} ORDER BY {order} LIMIT ?1)"
                );
                let removed = exec(self, &sql, &[&n])?;
                if table == "events" {
                    pruned.events += removed;
                } else {
                    pruned.flows += removed;
                }
            }
        }
        if pruned.events + pruned.flows > 0 {
            self.conn
                .execute_batch("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")
                .map_err(|e| self.err(e))?;
        }
        Ok(pruned)
    }

    /// `PRAGMA integrity_check` (`"ok"` when the file is sound).
    pub fn integrity_check(&self) -> Result<String, StoreError> {
        self.conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .map_err(|e| self.err(e))
    }

    pub(crate) fn conn(&self) -> &Connection {
        &self.conn
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::events::{ContainerRef, DenialEvent, Verdict};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    pub(crate) fn temp_db(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "egress-store-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::remove_dir_all(&dir).ok();
        dir.join("state").join(DB_FILE)
    }

    fn ev(host: &str, port: u16, verdict: Verdict) -> DenialEvent {
        let mut e = DenialEvent::proxy("ci", Some(host.into()), None, port, "connect", "r")
            .with_verdict(verdict);
        e.container = Some(ContainerRef {
            id: "abc123".into(),
            name: "job".into(),
        });
        e.context.insert("run".into(), "42".into());
        e.context.insert("pid".into(), "7".into());
        e
    }

    #[test]
    fn creates_private_files_in_wal_mode() {
        let path = temp_db("perm");
        let s = Store::open(&path).unwrap();
        assert_eq!(
            std::fs::metadata(path.parent().unwrap()).unwrap().mode() & 0o777,
            0o700
        );
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let mode: String = s
            .conn()
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        drop(s);
        // Reopening an existing store works (schema is idempotent).
        Store::open(&path).unwrap();
        // Never through a symlink, never in a directory others can write to.
        let dir = path.parent().unwrap();
        let link = dir.join("link.db");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(Store::open(&link).is_err());
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = Store::open(&path).unwrap_err().to_string();
        assert!(e.contains("writable by group or others"), "{e}");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    #[test]
    fn flows_aggregate_across_batches_without_pids() {
        let path = temp_db("flows");
        let mut s = Store::open(&path).unwrap();
        let mut batch = FlowBatch::new();
        let mut a = ev("github.com", 443, Verdict::Allow);
        a.time = from_micros(1_000);
        add_flow(&mut batch, &a);
        let mut b = ev("github.com", 443, Verdict::Allow);
        b.time = from_micros(3_000);
        b.context.insert("pid".into(), "8".into());
        add_flow(&mut batch, &b);
        assert_eq!(batch.len(), 1, "pid is not part of a flow");
        s.write(&[a.clone(), b], &batch).unwrap();
        let mut batch = FlowBatch::new();
        let mut c = a.clone();
        c.time = from_micros(500);
        add_flow(&mut batch, &c);
        s.write(&[], &batch).unwrap();
        let (count, first, last): (i64, i64, i64) = s
            .conn()
            .query_row("SELECT count, first_us, last_us FROM flows", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .unwrap();
        assert_eq!((count, first, last), (3, 500, 3_000));
        // Allowed events are flows only, never event rows.
        let rows: i64 = s
            .conn()
            .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows, 0);
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    /// A flow decided by another rule (the policy changed) is the same flow, naming the newer
    /// rule; events keep theirs.
    #[test]
    fn a_flow_keeps_the_rule_that_decided_it_last() {
        let path = temp_db("rule");
        let mut s = Store::open(&path).unwrap();
        let mut a = ev("api.github.com", 443, Verdict::Allow);
        a.rule = Some("allow_hosts api.github.com".into());
        let mut b = a.clone();
        b.time += Duration::from_secs(1);
        b.rule = Some("allow_hosts *.github.com".into());
        let mut d = ev("api.github.com", 22, Verdict::WouldDeny);
        d.rule = Some("allow_hosts api.github.com".into());
        // The newer event first: the batch still keeps the newer rule.
        let mut batch = FlowBatch::new();
        for e in [&b, &a, &d] {
            add_flow(&mut batch, e);
        }
        assert_eq!(batch.len(), 2);
        s.write(&[a.clone(), b, d], &batch).unwrap();
        // An older batch written later does not take the rule back.
        let mut older = FlowBatch::new();
        add_flow(&mut older, &a);
        s.write(&[], &older).unwrap();
        let flows: Vec<(u16, String, i64)> = s
            .conn()
            .prepare("SELECT port, rule, count FROM flows ORDER BY port")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            flows,
            [
                (22, "allow_hosts api.github.com".to_owned(), 1),
                (443, "allow_hosts *.github.com".to_owned(), 3),
            ]
        );
        let rules: Vec<Option<String>> = s
            .conn()
            .prepare("SELECT rule FROM events ORDER BY id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        // Only the would-deny is an event (allowed traffic is kept as flows).
        assert_eq!(rules, [Some("allow_hosts api.github.com".to_owned())]);
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    /// A version-1 file as the first agent wrote it: its schema, an event and a flow.
    fn write_v1(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::set_permissions(
            path.parent().unwrap(),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        let c = Connection::open(path).unwrap();
        c.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE events(id INTEGER PRIMARY KEY, time_us INTEGER NOT NULL,
                verdict TEXT NOT NULL, source TEXT NOT NULL, policy TEXT NOT NULL,
                container_id TEXT, container_name TEXT, cgroup_id INTEGER,
                context TEXT NOT NULL DEFAULT '{}', host TEXT, ip TEXT, port INTEGER NOT NULL,
                protocol TEXT NOT NULL, reason TEXT NOT NULL);
             CREATE INDEX events_time ON events(time_us);
             CREATE TABLE flows(id INTEGER PRIMARY KEY, verdict TEXT NOT NULL,
                source TEXT NOT NULL, policy TEXT NOT NULL, container_id TEXT NOT NULL,
                container_name TEXT NOT NULL, labels TEXT NOT NULL, host TEXT NOT NULL,
                ip TEXT NOT NULL, port INTEGER NOT NULL, protocol TEXT NOT NULL,
                reason TEXT NOT NULL, count INTEGER NOT NULL, first_us INTEGER NOT NULL,
                last_us INTEGER NOT NULL,
                UNIQUE(verdict, source, policy, container_id, container_name, labels, host, ip,
                       port, protocol, reason));
             CREATE INDEX flows_last ON flows(last_us);
             INSERT INTO events(time_us, verdict, source, policy, container_id, container_name,
                context, host, port, protocol, reason)
             VALUES (1000, 'would-deny', 'proxy', 'ci', 'abc123', 'job', '{\"run\":\"42\"}',
                'evil.example', 443, 'connect', 'host-not-allowed');
             INSERT INTO flows(verdict, source, policy, container_id, container_name, labels,
                host, ip, port, protocol, reason, count, first_us, last_us)
             VALUES ('allow', 'proxy', 'ci', 'abc123', 'job', '{\"run\":\"42\"}',
                'github.com', '', 443, 'connect', 'allowed', 5, 1000, 2000);
             PRAGMA user_version = 1;",
        )
        .unwrap();
    }

    /// What a version-1 agent writes in one batch: an event and a flow upsert, in its words.
    const V1_WRITES: &str = "
        BEGIN;
        INSERT INTO events(time_us, verdict, source, policy, container_id, container_name,
            cgroup_id, context, host, ip, port, protocol, reason)
        VALUES (3000, 'deny', 'proxy', 'ci', 'abc123', 'job', NULL, '{}', 'evil.example', NULL,
            443, 'connect', 'host-not-allowed');
        INSERT INTO flows(verdict, source, policy, container_id, container_name, labels,
            host, ip, port, protocol, reason, count, first_us, last_us)
        VALUES ('allow', 'proxy', 'ci', 'abc123', 'job', '{\"run\":\"42\"}', 'github.com', '',
            443, 'connect', 'allowed', 1, 3000, 3000)
        ON CONFLICT(verdict, source, policy, container_id, container_name, labels, host,
            ip, port, protocol, reason)
        DO UPDATE SET count = count + excluded.count,
            first_us = min(first_us, excluded.first_us),
            last_us = max(last_us, excluded.last_us);
        COMMIT;";

    /// What a version-2 agent inserts: an event with its rule, without a count.
    const V2_INSERT: &str = "
        INSERT INTO events(time_us, verdict, source, policy, container_id, container_name,
            cgroup_id, context, host, ip, port, protocol, reason, rule)
        VALUES (4000, 'deny', 'proxy', 'ci', 'abc123', 'job', NULL, '{}', 'evil.example', NULL,
            443, 'connect', 'policy-deny-all', 'mode deny_all');";

    /// A summary of identical attempts is one row keeping its count; its flow counts every
    /// attempt.
    #[test]
    fn a_summary_is_one_row_with_its_count_and_its_flow_counts_every_attempt() {
        use crate::store::query::EventFilter;
        let path = temp_db("count");
        let mut s = Store::open(&path).unwrap();
        let mut first = ev("denied.example", 443, Verdict::Deny);
        first.time = from_micros(1_000_000);
        let mut summary = first.clone();
        summary.time = from_micros(2_000_000);
        summary.count = 4_999;
        let mut batch = FlowBatch::new();
        add_flow(&mut batch, &first);
        add_flow(&mut batch, &summary);
        s.write(&[first, summary.clone()], &batch).unwrap();
        let events = s.events(&EventFilter::default(), 0, 10).unwrap();
        assert_eq!(
            events.iter().map(|e| e.event.count).collect::<Vec<_>>(),
            [1, 4_999]
        );
        assert_eq!(events[1].event, summary);
        let flows = s.flows(&EventFilter::default()).unwrap();
        assert_eq!(flows.len(), 1);
        assert_eq!(flows[0].count, 5_000);
        assert_eq!(flows[0].last_seen, summary.time);
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    #[test]
    fn a_version_1_store_is_migrated_in_place() {
        use crate::store::query::EventFilter;
        let path = temp_db("v1");
        write_v1(&path);
        let mut s = Store::open(&path).unwrap();
        let version: i64 = s
            .conn()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        assert!(has_column(s.conn(), "events", "rule").unwrap());
        assert!(has_column(s.conn(), "flows", "rule").unwrap());
        assert!(has_column(s.conn(), "events", "count").unwrap());
        let index: i64 = s
            .conn()
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = 'flows_last'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(index, 1);
        // The old rows, with no rule.
        let events = s.events(&EventFilter::default(), 0, 10).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].event.host.as_deref(), Some("evil.example"));
        assert_eq!(events[0].event.rule, None);
        assert_eq!(events[0].event.count, 1);
        let flows = s.flows(&EventFilter::default()).unwrap();
        assert_eq!(flows.len(), 1);
        assert_eq!((flows[0].host.as_str(), flows[0].count), ("github.com", 5));
        assert_eq!(flows[0].rule, None);
        // The old flow goes on counting, and names its rule from now on.
        let mut named = ev("github.com", 443, Verdict::Allow);
        named.reason = "allowed".into();
        named.context.remove("pid");
        named.protocol = "connect".into();
        named.rule = Some("allow_hosts github.com".into());
        let mut batch = FlowBatch::new();
        add_flow(&mut batch, &named);
        s.write(&[], &batch).unwrap();
        let flows = s.flows(&EventFilter::default()).unwrap();
        let counts: Vec<(u64, Option<&str>)> =
            flows.iter().map(|f| (f.count, f.rule.as_deref())).collect();
        assert_eq!(counts, [(6, Some("allow_hosts github.com"))]);
        // A version-1 agent still draining after a hand-over writes on, unchanged: its insert
        // and upsert (without `rule`) match the migrated tables.
        let old = Connection::open(&path).unwrap();
        old.execute_batch(V1_WRITES).unwrap();
        let flows = s.flows(&EventFilter::default()).unwrap();
        let counts: Vec<(u64, Option<&str>)> =
            flows.iter().map(|f| (f.count, f.rule.as_deref())).collect();
        assert_eq!(counts, [(7, Some("allow_hosts github.com"))]);
        assert_eq!(s.events(&EventFilter::default(), 0, 10).unwrap().len(), 2);
        // So does a version-2 agent (its insert names the rule, not the count): one attempt.
        old.execute_batch(V2_INSERT).unwrap();
        let events = s.events(&EventFilter::default(), 0, 10).unwrap();
        let last = &events.last().unwrap().event;
        assert_eq!(
            (last.rule.as_deref(), last.count),
            (Some("mode deny_all"), 1)
        );
        drop(s);
        // Opening again changes nothing.
        Store::open(&path).unwrap();
        assert_eq!(Store::open(&path).unwrap().integrity_check().unwrap(), "ok");
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    /// `events`/`suggest` on an older daemon's store: read as it is, without a rule.
    #[test]
    fn a_version_1_store_is_read_only_without_a_rule() {
        use crate::store::query::EventFilter;
        let path = temp_db("v1ro");
        write_v1(&path);
        let s = Store::open_read_only(&path).unwrap();
        assert!(!s.has_rule());
        assert!(!s.has_count());
        let events = s.events(&EventFilter::default(), 0, 10).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].event.rule, None);
        assert_eq!(events[0].event.count, 1);
        let flows = s.flows(&EventFilter::default()).unwrap();
        assert_eq!(flows.len(), 1);
        assert_eq!(flows[0].rule, None);
        drop(s);
        // Not migrated by reading.
        let c = Connection::open(&path).unwrap();
        let version: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 1);
        assert!(!has_column(&c, "events", "rule").unwrap());
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    #[test]
    fn a_store_newer_than_the_agent_is_refused() {
        let path = temp_db("newer");
        drop(Store::open(&path).unwrap());
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        let e = Store::open(&path).unwrap_err().to_string();
        assert!(e.contains("is newer than this agent's"), "{e}");
        let e = Store::open_read_only(&path).unwrap_err().to_string();
        assert!(e.contains("is newer than this agent's"), "{e}");
        // Refusing left it as it was.
        let version: i64 = Connection::open(&path)
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION + 1);
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }

    #[test]
    fn prune_keeps_age_and_size_bounds() {
        let path = temp_db("prune");
        let mut s = Store::open(&path).unwrap();
        let now = SystemTime::now();
        let mut old = ev("old.example", 443, Verdict::Deny);
        old.time = now - Duration::from_secs(3 * 3600);
        let mut batch = FlowBatch::new();
        add_flow(&mut batch, &old);
        s.write(&[old], &batch).unwrap();
        let mut fresh = Vec::new();
        let mut batch = FlowBatch::new();
        for i in 0..20_000u32 {
            let mut e = ev(&format!("h{i}.example"), 443, Verdict::WouldDeny);
            e.time = now;
            if i < 10 {
                add_flow(&mut batch, &e);
            }
            fresh.push(e);
        }
        s.write(&fresh, &batch).unwrap();
        let before = s.used_bytes().unwrap();
        let max = 2 * 1024 * 1024;
        assert!(
            before > max,
            "test needs more than {max} bytes, has {before}"
        );
        let p = s.prune(now, Duration::from_secs(3600), max).unwrap();
        assert!(p.events >= 1 && p.flows >= 1, "{p:?}");
        // Events go first; recent flows stay while events can make room.
        let flows: i64 = s
            .conn()
            .query_row("SELECT count(*) FROM flows", [], |r| r.get(0))
            .unwrap();
        assert_eq!(flows, 10);
        assert!(
            s.used_bytes().unwrap() <= max,
            "{}",
            s.used_bytes().unwrap()
        );
        let old_left: i64 = s
            .conn()
            .query_row(
                "SELECT count(*) FROM events WHERE host = 'old.example'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(old_left, 0);
        // The newest events are the ones kept.
        let newest: String = s
            .conn()
            .query_row(
                "SELECT host FROM events ORDER BY id DESC LIMIT 1",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(newest, "h19999.example");
        // The freed pages went back: the file is near the bound, not at its peak.
        assert!(s.file_bytes() <= max + 1024 * 1024, "{}", s.file_bytes());
        assert_eq!(s.integrity_check().unwrap(), "ok");
        std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap()).ok();
    }
}
