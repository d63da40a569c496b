//! Access requests and run grants across a restart (issue #41), with real listeners and a real
//! upstream (no root): a workload files and is approved for its run; the agent restarts the way
//! the daemon does it — a new registry kept in the same state directory, a new listener for the
//! same workload (container id, cgroup id, policy) — and the retry still reaches the upstream,
//! the pending request still answers under its id, and nobody else gets anything: not another
//! workload under the same policy, not the same container in another cgroup.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use egress_agent::asks::{Asks, FILE_NAME};
use egress_agent::events::ContainerRef;
use egress_agent::proxy::Identity;
use proxy_support::{Harness, Resp, Upstreams, get, harness_for, read_response, upstreams};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn workload(id: &str, cgroup_id: u64) -> Identity {
    Identity {
        container: Some(ContainerRef {
            id: id.to_owned(),
            name: format!("{id}-name"),
        }),
        cgroup_id: Some(cgroup_id),
        context: BTreeMap::new(),
        clients: None,
    }
}

/// A workload's listener (policy `test`) taking requests into `asks`.
async fn listener(up: &Upstreams, asks: &Arc<Asks>, who: Identity) -> Harness {
    let up = Upstreams {
        echo: up.echo,
        http: up.http,
        closed: up.closed,
    };
    let asks = asks.clone();
    harness_for(
        up,
        "header_timeout_ms = 2000",
        "",
        "test",
        Some(who),
        move |ctx| ctx.with_asks(asks),
    )
    .await
}

/// A registry kept in `dir`, as the daemon starts it.
fn registry(dir: &Path) -> Arc<Asks> {
    let asks = Asks::new();
    asks.keep_in(dir);
    asks
}

async fn call(h: &Harness, method: &str, url: &str, body: Option<&Value>) -> Resp {
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {url} HTTP/1.1\r\nHost: egress.internal\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    read_response(&mut s, false).await.0
}

fn json_of(r: &Resp) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

async fn file(h: &Harness, host: &str, port: u16) -> u64 {
    let r = call(
        h,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&json!({ "host": host, "port": port, "reason": "the test suite needs it" })),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    json_of(&r)["id"].as_u64().unwrap()
}

async fn status_through(h: &Harness, target: &str, path: &str) -> Resp {
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    get(&mut s, target, path).await
}

#[tokio::test]
async fn a_run_grant_and_a_pending_request_survive_a_restart_for_the_same_workload_only() {
    let up = upstreams().await;
    let state = proxy_support::temp_dir();
    let port = up.http.port();
    let granted = format!("other.test:{port}");
    let later = format!("wild.test:{port}");

    // Before: the workload asks twice, one is approved for its run (with a TTL).
    let (grant_id, pending_id) = {
        let asks = registry(&state);
        let a = listener(&up, &asks, workload("job-a", 1001)).await;
        let grant_id = file(&a, "other.test", port).await;
        let pending_id = file(&a, "wild.test", port).await;
        asks.approve_run(grant_id, "token:ops", Some(Duration::from_secs(3600)))
            .unwrap();
        assert_eq!(status_through(&a, &granted, "/").await.status, 200);
        (grant_id, pending_id)
        // The listener and the registry end here: the old agent is gone.
    };
    assert!(state.join(FILE_NAME).is_file());

    // After: a new registry from the same state directory, new listeners.
    let asks = registry(&state);
    let a = listener(&up, &asks, workload("job-a", 1001)).await;
    let b = listener(&up, &asks, workload("job-b", 1002)).await;
    // The same container in another cgroup is another workload (it was restarted).
    let a_again = listener(&up, &asks, workload("job-a", 1003)).await;

    let through = status_through(&a, &granted, "/after-restart").await;
    assert_eq!(through.status, 200, "{}", through.text());
    assert!(
        through.text().contains("line=GET /after-restart"),
        "{}",
        through.text()
    );
    for other in [&b, &a_again] {
        let r = status_through(other, &granted, "/").await;
        assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
    }
    let me = json_of(&call(&a, "GET", "http://egress.internal/v1/self", None).await);
    assert_eq!(me["run_grants"][0]["request"], grant_id, "{me}");
    assert_eq!(me["run_grants"][0]["allows"], granted.as_str(), "{me}");

    // The pending request answers under its id, to this workload alone.
    let url = format!("http://egress.internal/v1/requests/{pending_id}");
    let r = call(&a, "GET", &url, None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (json_of(&r)["state"].as_str(), json_of(&r)["host"].as_str()),
        (Some("pending"), Some("wild.test"))
    );
    for other in [&b, &a_again] {
        assert_eq!(call(other, "GET", &url, None).await.status, 404);
    }

    // Its long-poll still ends with the operator's decision, and the grant goes to it.
    let poll = {
        let addr = a.addr;
        let url = format!("{url}?wait=30");
        tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {url} HTTP/1.1\r\nHost: egress.internal\r\n\r\n").as_bytes())
                .await
                .unwrap();
            read_response(&mut s, false).await.0
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    asks.approve_run(pending_id, "token:ops", None).unwrap();
    let decided = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(json_of(&decided)["state"], "approved", "{}", decided.text());
    assert_eq!(status_through(&a, &later, "/").await.status, 200);
    let r = status_through(&b, &later, "/").await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));

    // New requests are numbered after the restored ones.
    let new_id = file(&b, "allowed-not.test", port).await;
    assert!(new_id > pending_id, "{new_id} after {pending_id}");
}

#[tokio::test]
async fn a_file_open_to_others_is_ignored_and_nothing_is_granted() {
    let up = upstreams().await;
    let state = proxy_support::temp_dir();
    let port = up.http.port();
    {
        let asks = registry(&state);
        let a = listener(&up, &asks, workload("job-a", 2001)).await;
        let id = file(&a, "other.test", port).await;
        asks.approve_run(id, "token:ops", None).unwrap();
    }
    let path = state.join(FILE_NAME);
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let asks = registry(&state);
    assert!(asks.list(false).is_empty());
    let a = listener(&up, &asks, workload("job-a", 2001)).await;
    let r = status_through(&a, &format!("other.test:{port}"), "/").await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
}
