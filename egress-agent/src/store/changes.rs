//! The `changes` table: every policy change made through the control API (or `egress-agent
//! policy` / MCP, its clients), with the uid and pid of the process that asked, what it changed,
//! the files written, and whether the daemon applied it. A few rows per change: they are the
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

/// One recorded change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChangeRecord {
    pub id: i64,
    #[serde(with = "crate::events::rfc3339")]
    pub time: SystemTime,
    pub uid: u32,
    pub pid: Option<u32>,
    /// `set-policy`, `delete-policy`, `set-defaults`, `import`.
    pub action: String,
    /// The policy name, `agent`, or `bundle`.
    pub target: String,
    /// The files written or removed.
    pub files: Vec<String>,
    /// `applied`, or `refused: <why>` (the files were restored).
    pub result: String,
}

impl Store {
    /// Record one change (its own transaction, `synchronous = FULL` like the events).
    pub fn record_change(&self, c: &ChangeRecord) -> Result<(), StoreError> {
        let conn = self.conn();
        conn.execute_batch(SCHEMA).map_err(|e| self.err(e))?;
        conn.execute(
            "INSERT INTO changes(time_us, uid, pid, action, target, files, result)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                micros(c.time),
                c.uid,
                c.pid,
                c.action,
                c.target,
                serde_json::to_string(&c.files).unwrap_or_default(),
                c.result
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
        let mut stmt = conn
            .prepare(
                "SELECT id, time_us, uid, pid, action, target, files, result FROM
                 (SELECT * FROM changes ORDER BY id DESC LIMIT ?1) ORDER BY id",
            )
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
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        let path = dir.join("events.db");
        let store = Store::open(&path).unwrap();
        assert!(store.changes(10).unwrap().is_empty());
        for (i, result) in ["applied", "refused: [proxy] changed"].iter().enumerate() {
            store
                .record_change(&ChangeRecord {
                    id: 0,
                    time: SystemTime::now(),
                    uid: 1000 + i as u32,
                    pid: Some(42),
                    action: "set-policy".to_owned(),
                    target: "ci".to_owned(),
                    files: vec!["/etc/egress-agent/policies.d/ci.toml".to_owned()],
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
        assert_eq!(ro.changes(1).unwrap()[0].uid, 1001, "the newest one");
        std::fs::remove_dir_all(&dir).ok();
    }
}
