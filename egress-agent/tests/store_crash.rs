//! The store survives kill -9 of its writer mid-stream: a child process (this test binary,
//! re-run as the writer) emits events through a real `EventSink` → writer task → SQLite and
//! reports each commit; it is SIGKILLed while still writing; the parent then reopens the file:
//! `PRAGMA integrity_check` is `ok` and every event the child saw committed is there, in order.
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use egress_agent::events::{DenialEvent, EventSink, Verdict};
use egress_agent::store::Store;
use egress_agent::store::query::EventFilter;
use egress_agent::store::writer::{self, Bounds};

const CHILD_ENV: &str = "EGRESS_STORE_CRASH_CHILD_DB";

/// The writer half, run in a child process by the test below (ignored when run directly).
#[test]
#[ignore = "helper: runs as the child of committed_events_survive_kill_9"]
fn crash_child_writer() {
    let Some(db) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let sink = EventSink::new(16);
        let h = writer::spawn(
            Store::open(std::path::Path::new(&db)).unwrap(),
            &sink,
            1 << 20,
            true,
            Bounds {
                max_age: Duration::from_secs(3600),
                max_bytes: 1 << 30,
            },
            None,
        );
        let mut seq: u64 = 0;
        loop {
            for _ in 0..500 {
                let mut ev = DenialEvent::proxy(
                    "ci",
                    Some(format!("h{seq}.example")),
                    None,
                    443,
                    "connect",
                    "host-not-allowed",
                )
                .with_verdict(Verdict::WouldDeny);
                ev.context.insert("seq".into(), seq.to_string());
                sink.emit(ev);
                seq += 1;
            }
            h.flush().await;
            // Everything emitted so far is committed (the queue is far larger than a round).
            assert_eq!(h.stats().dropped.load(Ordering::Relaxed), 0);
            println!("committed {}", h.stats().committed.load(Ordering::Relaxed));
        }
    });
}

#[test]
fn committed_events_survive_kill_9() {
    let dir = std::env::temp_dir().join(format!("egress-store-crash-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let db = dir.join("events.db");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child_writer",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &db)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut committed = 0u64;
    // Wait for a good number of commits, then kill while it keeps writing.
    while committed < 20_000 {
        assert!(
            Instant::now() < deadline,
            "the writer is too slow ({committed})"
        );
        let Some(Ok(line)) = lines.next() else {
            panic!("the writer ended early");
        };
        if let Some(n) = line.strip_prefix("committed ") {
            committed = n.parse().unwrap();
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // Anything it printed before dying counts as committed too.
    for line in lines.map_while(Result::ok) {
        if let Some(n) = line.strip_prefix("committed ") {
            committed = committed.max(n.parse().unwrap());
        }
    }

    let store = Store::open(&db).unwrap();
    assert_eq!(store.integrity_check().unwrap(), "ok");
    let events = store
        .events(&EventFilter::default(), 0, usize::MAX >> 1)
        .unwrap();
    assert!(
        events.len() as u64 >= committed,
        "{} events after the crash, {committed} were committed",
        events.len()
    );
    // In order, none missing: seq 0..n.
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.event.context["seq"], i.to_string());
    }
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
}
