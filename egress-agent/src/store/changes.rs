//! The `changes` table: every policy change made through the control API (or `egress-agent
//! policy` / MCP, its clients), with the uid and pid of the process that asked (and, through the
//! console, the operator's token name), what it changed, the files written, the diff, and
//! whether the daemon applied it. A few rows per change: they are the
//! audit trail of who changed the policy and are not pruned with the events.
use std::time::SystemTime;

use rusqlite::params;
use serde::Serialize;

use super::{Store, StoreError, from_micros, micros};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS changes(
    id INTEGER PRIMARY KEY,
    time_us INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    pid INTEGER,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    files TEXT NOT NULL,
    result TEXT NOT NULL
);
";

/// Columns added after the table's first version (a store written by an older agent gets them,
/// empty, at its first change).
const ADDED: &[(&str, &str)] = &[("identity", "TEXT"), ("diff", "TEXT NOT NULL DEFAULT ''")];

fn columns(conn: &rusqlite::Connection) -> rusqlite::Result<Vec<String>> {
    conn.prepare("SELECT name FROM pragma_table_info('changes')")?
        .query_map([], |r| r.get(0))?
        .collect()
}

fn ensure(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    conn.execute_batch(SCHEMA)?;
    let have = columns(conn)?;
    for (col, ty) in ADDED {
        if !have.iter().any(|h| h == col) {
            conn.execute_batch(&format!("ALTER TABLE changes ADD COLUMN {col} {ty}"))?;
        }
    }
    Ok(())
}

/// One recorded change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChangeRecord {
    pub id: i64,
    #[serde(with = "crate::events::rfc3339")]
    pub time: SystemTime,
    pub uid: u32,
    pub pid: Option<u32>,
    /// The console operator (`console:NAME`, `token:NAME`); `None` on the unix socket.
    pub identity: Option<String>,
    /// `set-policy`, `delete-policy`, `set-defaults`, `import`.
    pub action: String,
    /// The policy name, `agent`, or `bundle`.
    pub target: String,
    /// The files written or removed.
    pub files: Vec<String>,
    /// What the change did (a line diff of each file; an import's summary).
    pub diff: String,
    /// `applied`, or `refused: <why>` (the files were restored).
    pub result: String,
}

impl Store {
    /// Record one change (its own transaction, `synchronous = FULL` like the events).
    pub fn record_change(&self, c: &ChangeRecord) -> Result<(), StoreError> {
        let conn = self.conn();
        ensure(conn).map_err(|e| self.err(e))?;
        conn.execute(
            "INSERT INTO changes(time_us, uid, pid, action, target, files, result, identity, diff)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                micros(c.time),
                c.uid,
                c.pid,
                c.action,
                c.target,
                serde_json::to_string(&c.files).unwrap_or_default(),
                c.result,
                c.identity,
                c.diff
            ],
        )
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The newest `limit` changes, oldest first (none if the table does not exist yet).
    pub fn changes(&self, limit: usize) -> Result<Vec<ChangeRecord>, StoreError> {
        let conn = self.conn();
        let exists: bool = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'changes'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n > 0)
            .map_err(|e| self.err(e))?;
        if !exists {
            return Ok(Vec::new());
        }
        // A table an older agent wrote, read read-only, lacks the added columns: NULL for them.
        let have = columns(conn).map_err(|e| self.err(e))?;
        let col = |c: &str| {
            if have.iter().any(|h| h == c) {
                c.to_owned()
            } else {
                "NULL".to_owned()
            }
        };
        let mut stmt = conn
            .prepare(&format!(
                "SELECT id, time_us, uid, pid, action, target, files, result, {}, {} FROM
                 (SELECT * FROM changes ORDER BY id DESC LIMIT ?1) ORDER BY id",
                col("identity"),
                col("diff")
            ))
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([i64::try_from(limit).unwrap_or(i64::MAX)], |r| {
                let files: String = r.get(6)?;
                Ok(ChangeRecord {
                    id: r.get(0)?,
                    time: from_micros(r.get(1)?),
                    uid: r.get(2)?,
                    pid: r.get(3)?,
                    action: r.get(4)?,
                    target: r.get(5)?,
                    files: serde_json::from_str(&files).unwrap_or_default(),
                    result: r.get(7)?,
                    identity: r.get(8)?,
                    diff: r.get::<_, Option<String>>(9)?.unwrap_or_default(),
                })
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn changes_are_recorded_with_the_peer_and_read_back_in_order() {
        let dir = std::env::temp_dir().join(format!("egress-changes-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        let path = dir.join("events.db");
        let store = Store::open(&path).unwrap();
        assert!(store.changes(10).unwrap().is_empty());
        // A table as an older agent made it, with one change in it.
        store
            .conn()
            .execute_batch(
                "CREATE TABLE changes(id INTEGER PRIMARY KEY, time_us INTEGER NOT NULL,
                 uid INTEGER NOT NULL, pid INTEGER, action TEXT NOT NULL, target TEXT NOT NULL,
                 files TEXT NOT NULL, result TEXT NOT NULL);
                 INSERT INTO changes(time_us, uid, action, target, files, result)
                 VALUES (1, 0, 'set-policy', 'old', '[]', 'applied');",
            )
            .unwrap();
        let old = Store::open_read_only(&path).unwrap().changes(10).unwrap();
        assert_eq!(
            (old[0].identity.as_deref(), old[0].diff.as_str()),
            (None, "")
        );
        store.conn().execute_batch("DELETE FROM changes").unwrap();
        for (i, result) in ["applied", "refused: [proxy] changed"].iter().enumerate() {
            store
                .record_change(&ChangeRecord {
                    id: 0,
                    time: SystemTime::now(),
                    uid: 1000 + i as u32,
                    pid: Some(42),
                    identity: (i == 1).then(|| "console:ops".to_owned()),
                    action: "set-policy".to_owned(),
                    target: "ci".to_owned(),
                    files: vec!["/etc/egress-agent/policies.d/ci.toml".to_owned()],
                    diff: "+allow_hosts = [\"a.test\"]\n".to_owned(),
                    result: (*result).to_owned(),
                })
                .unwrap();
        }
        let ro = Store::open_read_only(&path).unwrap();
        let got = ro.changes(10).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].uid, 1000);
        assert_eq!(got[1].result, "refused: [proxy] changed");
        assert_eq!(got[0].files, ["/etc/egress-agent/policies.d/ci.toml"]);
        assert_eq!(got[0].identity, None);
        assert_eq!(got[1].identity.as_deref(), Some("console:ops"));
        assert_eq!(got[1].diff, "+allow_hosts = [\"a.test\"]\n");
        assert_eq!(ro.changes(1).unwrap()[0].uid, 1001, "the newest one");
        std::fs::remove_dir_all(&dir).ok();
    }
}
