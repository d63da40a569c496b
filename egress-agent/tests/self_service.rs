//! `http://egress.internal/` over the explicit proxy (no root): a real listener with the
//! agent's request registry, real upstreams on loopback, and the workload's side spoken as a
//! client would (absolute-form requests through the proxy). What arrived at the upstream is what
//! counts: a grant lets the retry through, and only on the listener that asked.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::sync::Arc;
use std::time::Duration;

use egress_agent::asks::{Asks, MAX_PENDING, Outcome, Scope};
use proxy_support::{Harness, Resp, Upstreams, get, harness_ctx, read_response, upstreams};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn listener(up: &Upstreams, asks: Option<&Arc<Asks>>) -> Harness {
    let up = Upstreams {
        echo: up.echo,
        http: up.http,
        closed: up.closed,
    };
    let asks = asks.cloned();
    harness_ctx(
        up,
        "header_timeout_ms = 2000",
        "",
        "test",
        move |ctx| match asks {
            Some(a) => ctx.with_asks(a),
            None => ctx,
        },
    )
    .await
}

/// One request through the proxy at `h`: `GET`, or `POST` with a JSON body.
async fn call(h: &Harness, method: &str, url: &str, body: Option<&Value>) -> Resp {
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let authority = url.split('/').nth(2).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {url} HTTP/1.1\r\nHost: {authority}\r\nAccept: application/json\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    read_response(&mut s, false).await.0
}

fn json_of(r: &Resp) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

fn ask(host: &str, port: u16) -> Value {
    json!({ "host": host, "port": port, "reason": "the test suite needs it", "methods": ["GET"] })
}

#[tokio::test]
async fn a_workload_reads_its_policy_asks_and_a_run_grant_lets_only_it_through() {
    let up = upstreams().await;
    let asks = Asks::new();
    let a = listener(&up, Some(&asks)).await;
    let b = listener(&up, Some(&asks)).await;
    let port = up.http.port();
    let target = format!("other.test:{port}");

    let me = call(&a, "GET", "http://egress.internal/v1/self", None).await;
    assert_eq!(me.status, 200, "{}", me.text());
    let me = json_of(&me);
    assert_eq!(me["policy"], "test", "{me}");
    assert!(
        me["allow_hosts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h == "allowed.test"),
        "{me}"
    );
    assert_eq!(me["takes_requests"], true, "{me}");
    let help = call(&a, "GET", "http://egress.internal/", None).await;
    assert!(
        help.text()
            .contains("POST http://egress.internal/v1/requests"),
        "{}",
        help.text()
    );

    // Refused, with the reason a program can read.
    let mut s = TcpStream::connect(a.addr).await.unwrap();
    let refused = get(&mut s, &target, "/").await;
    assert_eq!(
        (refused.status, refused.deny()),
        (403, Some("host-not-allowed"))
    );

    // A body naming another workload (or anything else) is refused, nothing is filed.
    let mut forged = ask("other.test", port);
    forged["workload"] = json!("someone-else");
    let r = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&forged),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(asks.list(false).is_empty());

    let filed = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&ask("other.test", port)),
    )
    .await;
    assert_eq!(filed.status, 202, "{}", filed.text());
    let id = json_of(&filed)["id"].as_u64().unwrap();
    // The same again is the same request.
    let again = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&ask("Other.Test", port)),
    )
    .await;
    assert_eq!(
        (
            json_of(&again)["id"].as_u64(),
            json_of(&again)["existing"].as_bool()
        ),
        (Some(id), Some(true))
    );
    // Another workload can't read it.
    let other = call(
        &b,
        "GET",
        &format!("http://egress.internal/v1/requests/{id}"),
        None,
    )
    .await;
    assert_eq!(other.status, 404);
    let listed = asks.list(true);
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].host.as_str(),
            listed[0].port,
            listed[0].workload.as_str()
        ),
        ("other.test", port, "policy test")
    );

    // The long-poll returns when the operator decides.
    let poll = {
        let url = format!("http://egress.internal/v1/requests/{id}?wait=30");
        let addr = a.addr;
        tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let authority = "egress.internal";
            s.write_all(format!("GET {url} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
                .await
                .unwrap();
            read_response(&mut s, false).await.0
        })
    };
    let mut changes = asks.subscribe();
    changes.borrow_and_update();
    asks.approve_run(id, "token:ops", None).unwrap();
    let decided = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .unwrap()
        .unwrap();
    let decided = json_of(&decided);
    assert_eq!(
        (
            decided["state"].as_str(),
            decided["scope"].as_str(),
            decided["by"].as_str()
        ),
        (Some("approved"), Some("run"), Some("token:ops")),
        "{decided}"
    );
    assert!(changes.has_changed().unwrap());

    // The retry reaches the upstream; the other workload under the same policy still can't.
    let mut s = TcpStream::connect(a.addr).await.unwrap();
    let through = get(&mut s, &target, "/after-grant").await;
    assert_eq!(through.status, 200, "{}", through.text());
    assert!(
        through.text().contains("line=GET /after-grant"),
        "{}",
        through.text()
    );
    let mut s = TcpStream::connect(b.addr).await.unwrap();
    let still = get(&mut s, &target, "/").await;
    assert_eq!(
        (still.status, still.deny()),
        (403, Some("host-not-allowed"))
    );
    // The grant is visible to the workload, and a reload keeps it.
    let me = json_of(&call(&a, "GET", "http://egress.internal/v1/self", None).await);
    assert_eq!(
        me["run_grants"][0]["allows"],
        format!("other.test:{port}"),
        "{me}"
    );
    a.handle.set(a.config.policy("test").unwrap());
    let mut s = TcpStream::connect(a.addr).await.unwrap();
    assert_eq!(
        get(&mut s, &target, "/").await.status,
        200,
        "a reload keeps the run grant"
    );
}

#[tokio::test]
async fn a_grant_never_opens_a_denied_address_and_a_ttl_ends_it() {
    let up = upstreams().await;
    let asks = Asks::new();
    let a = listener(&up, Some(&asks)).await;
    let port = up.http.port();
    // meta2.test resolves to the metadata address: approved, it is still refused at dial time.
    let id = json_of(
        &call(
            &a,
            "POST",
            "http://egress.internal/v1/requests",
            Some(&ask("meta2.test", port)),
        )
        .await,
    )["id"]
        .as_u64()
        .unwrap();
    asks.approve_run(id, "token:ops", None).unwrap();
    let mut s = TcpStream::connect(a.addr).await.unwrap();
    let r = get(&mut s, &format!("meta2.test:{port}"), "/").await;
    assert_eq!(
        (r.status, r.deny()),
        (403, Some("address-denied")),
        "{}",
        r.text()
    );

    // A grant with a TTL: through while it lasts, refused once it ended.
    let id = json_of(
        &call(
            &a,
            "POST",
            "http://egress.internal/v1/requests",
            Some(&ask("other.test", port)),
        )
        .await,
    )["id"]
        .as_u64()
        .unwrap();
    asks.approve_run(id, "token:ops", Some(Duration::from_secs(1)))
        .unwrap();
    let target = format!("other.test:{port}");
    let mut s = TcpStream::connect(a.addr).await.unwrap();
    assert_eq!(get(&mut s, &target, "/").await.status, 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let mut s = TcpStream::connect(a.addr).await.unwrap();
        let r = get(&mut s, &target, "/").await;
        if r.status == 403 {
            assert_eq!(r.deny(), Some("host-not-allowed"));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the grant never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_denial_carries_the_operators_reason_and_floods_are_capped() {
    let up = upstreams().await;
    let asks = Asks::new();
    let a = listener(&up, Some(&asks)).await;
    let port = up.http.port();
    let id = json_of(
        &call(
            &a,
            "POST",
            "http://egress.internal/v1/requests",
            Some(&ask("wild.test", port)),
        )
        .await,
    )["id"]
        .as_u64()
        .unwrap();
    asks.decide(
        id,
        Outcome::Denied {
            by: "token:ops".into(),
            reason: "use the internal mirror".into(),
        },
    )
    .unwrap();
    let r = json_of(
        &call(
            &a,
            "GET",
            &format!("http://egress.internal/v1/requests/{id}?wait=5"),
            None,
        )
        .await,
    );
    assert_eq!(
        (r["state"].as_str(), r["reason"].as_str()),
        (Some("denied"), Some("use the internal mirror")),
        "{r}"
    );
    assert!(!matches!(
        asks.get(id).unwrap().outcome,
        Outcome::Approved {
            scope: Scope::Run,
            ..
        }
    ));

    let mut last = None;
    for i in 0..=MAX_PENDING {
        let r = call(
            &a,
            "POST",
            "http://egress.internal/v1/requests",
            Some(&ask(&format!("h{i}.flood.test"), port)),
        )
        .await;
        last = Some(r);
    }
    let last = last.unwrap();
    assert_eq!(last.status, 429, "{}", last.text());
    assert_eq!(asks.list(true).len(), MAX_PENDING);
    // Bad fields are refused by name.
    let r = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&json!({"host": "10.0.0.1", "port": 80, "reason": "x"})),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        json_of(&r)["error"].as_str().unwrap().starts_with("host"),
        "{}",
        r.text()
    );
}

#[tokio::test]
async fn without_an_operator_the_workload_is_told_so() {
    let up = upstreams().await;
    let a = listener(&up, None).await;
    let me = json_of(&call(&a, "GET", "http://egress.internal/v1/self", None).await);
    assert_eq!(me["takes_requests"], false, "{me}");
    let r = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&ask("other.test", 80)),
    )
    .await;
    assert_eq!(r.status, 503);
    assert!(r.text().contains("no access requests"), "{}", r.text());
}

#[tokio::test]
async fn an_auto_approved_host_is_answered_approved_and_lets_the_workload_through() {
    let up = upstreams().await;
    let asks = Asks::new().configured(vec![
        serde_json::from_value(json!({ "host": "other.test", "ports": [up.http.port()] })).unwrap(),
    ]);
    let a = listener(&up, Some(&asks)).await;
    let port = up.http.port();
    let r = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&ask("other.test", port)),
    )
    .await;
    assert_eq!(
        (r.status, json_of(&r)["state"].as_str()),
        (202, Some("approved")),
        "{}",
        r.text()
    );
    let mut s = TcpStream::connect(a.addr).await.unwrap();
    assert_eq!(
        get(&mut s, &format!("other.test:{port}"), "/").await.status,
        200
    );
    // Another host still waits.
    let r = call(
        &a,
        "POST",
        "http://egress.internal/v1/requests",
        Some(&ask("wild.test", port)),
    )
    .await;
    assert_eq!(json_of(&r)["state"], "pending");
}
