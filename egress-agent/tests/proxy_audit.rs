//! Audit mode through the real proxy on loopback: what the allowlist refuses goes through and is
//! recorded as would-deny with exactly the fields a denial has; what `allow_all` refuses stays
//! refused (nothing arrives); switching the running listener to enforce refuses at once (and ends
//! the tunnel it opened under audit); allowed
//! traffic and would-denials land in a real store as flows, with no path, query string or
//! credential anywhere in its files; the suggestion from it parses and allows what was seen.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::path::Path;
use std::time::Duration;

use egress_agent::events::{DenialEvent, Verdict};
use egress_agent::store::Store;
use egress_agent::store::query::EventFilter;
use egress_agent::store::selection::Selection;
use egress_agent::store::writer::{self, Bounds};
use egress_agent::suggest::command::{SuggestOptions, suggest_from};
use egress_policy::Enforce;
use proxy_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn last(h: &Harness) -> DenialEvent {
    h.events.recent(1).pop().expect("an event")
}

/// Same event but for time and verdict.
fn same_fields(a: &DenialEvent, b: &DenialEvent) {
    let mut a = a.clone();
    let mut b = b.clone();
    a.time = b.time;
    a.verdict = Verdict::Deny;
    b.verdict = Verdict::Deny;
    assert_eq!(a, b);
}

#[tokio::test]
async fn audit_records_would_deny_lets_it_through_and_reload_enforces() {
    let up = upstreams().await;
    // A canary on 127.0.0.2, which only `rebind.test` resolves to and no allow_cidrs covers.
    let canary = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let canary_port = canary.local_addr().unwrap().port();
    let extra = format!(
        r#"
[policies.watch]
mode = "allowlist"
enforce = "audit"
allow_hosts = ["allowed.test"]
allow_ports = [{echo}, {http}]
allow_cidrs = [{{ cidr = "127.0.0.1/32", ports = [{echo}, {http}, {closed}] }}]
"#,
        echo = up.echo.port(),
        http = up.http.port(),
        closed = up.closed.port(),
    );
    let (echo, http, closed) = (up.echo.port(), up.http.port(), up.closed.port());
    let h = harness_on(up, "", &extra, "watch", None).await;

    let dir = temp_dir();
    let db = dir.join("state/events.db");
    let store = writer::spawn(
        Store::open(&db).unwrap(),
        &h.events,
        4096,
        true,
        Bounds {
            max_age: Duration::from_secs(3600),
            max_bytes: 1 << 30,
        },
        None,
    );

    // A name the allowlist does not list: through, and a would-deny.
    let (r, mut s) = connect(h.addr, &format!("other.test:{echo}")).await;
    assert_eq!(r.status, 200);
    proxy_support::assert_echo(&mut s, b"ping").await;
    let would = last(&h);
    assert_eq!(would.verdict, Verdict::WouldDeny);
    assert_eq!(would.reason, "host-not-allowed");
    assert_eq!(would.host.as_deref(), Some("other.test"));
    assert_eq!((would.port, would.protocol.as_str()), (echo, "connect"));
    assert_eq!(would.policy, "watch");

    // A port it does not list: a would-deny, then the upstream's own refusal (502).
    let r = exchange(
        h.addr,
        format!("CONNECT allowed.test:{closed} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 502);
    assert_eq!(last(&h).reason, "port-not-allowed");
    assert_eq!(last(&h).verdict, Verdict::WouldDeny);

    // Plain HTTP with a path, query string and credentials: forwarded, none of it recorded.
    let mut c = TcpStream::connect(h.addr).await.unwrap();
    c.write_all(
        format!(
            "GET http://other.test:{http}/private/path?token=hunter2 HTTP/1.1\r\nHost: other.test:{http}\r\nAuthorization: Bearer s3cr3tvalue\r\nCookie: session=c00kie\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let (r, _) = read_response(&mut c, false).await;
    assert_eq!(r.status, 200);
    assert!(
        r.text().contains("line=GET /private/path?token=hunter2"),
        "{}",
        r.text()
    );
    assert_eq!(last(&h).verdict, Verdict::WouldDeny);
    assert_eq!(last(&h).protocol, "http");
    // And allowed traffic (a flow, not an event).
    let r = get(&mut c, &format!("allowed.test:{http}"), "/ok?q=1").await;
    assert_eq!(r.status, 200);

    // What allow_all refuses stays refused in audit: an address no allow_cidrs covers.
    let r = exchange(
        h.addr,
        format!("CONNECT rebind.test:{canary_port} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("address-denied"));
    assert_eq!(last(&h).verdict, Verdict::Deny);
    // Request-shape refusals too.
    let r = exchange(
        h.addr,
        format!("GET http://allowed.test@other.test:{http}/ HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("userinfo-not-allowed"));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), canary.accept())
            .await
            .is_err(),
        "a connection arrived at the canary"
    );

    // Reload to enforce on the running listener: the same request is refused now, and its
    // denial has exactly the would-deny's fields.
    let mut enforce = h.config.policy("watch").unwrap().clone();
    enforce.enforce = Enforce::Enforce;
    h.handle.set(&enforce);
    // The tunnel opened under audit goes to a target the enforced policy refuses: the reload
    // ends it (#40 item 5, `proxy/narrow.rs`), recorded as a denial.
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(T, s.read(&mut b))
        .await
        .expect("the reload ends the audited tunnel")
        .unwrap_or(0);
    assert_eq!(n, 0, "the refused tunnel kept relaying");
    let ended = last(&h);
    assert_eq!(
        (ended.verdict, ended.reason.as_str()),
        (Verdict::Deny, "host-not-allowed")
    );
    assert_eq!(
        ended.context.get("ended").map(String::as_str),
        Some("policy-reload")
    );
    let r = exchange(
        h.addr,
        format!("CONNECT other.test:{echo} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("host-not-allowed"));
    let denied = last(&h);
    assert_eq!(denied.verdict, Verdict::Deny);
    same_fields(&would, &denied);

    // The store has it all, and nothing it must not have.
    store.flush().await;
    let ro = Store::open_read_only(&db).unwrap();
    let stored: Vec<DenialEvent> = ro
        .events(&EventFilter::default(), 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.event)
        .collect();
    let verdicts: Vec<Verdict> = stored.iter().map(|e| e.verdict).collect();

    assert_eq!(
        verdicts,
        [
            Verdict::WouldDeny,
            Verdict::WouldDeny,
            Verdict::WouldDeny,
            Verdict::Deny,
            Verdict::Deny,
            Verdict::Deny,
            Verdict::Deny
        ]
    );
    let flows = ro.flows(&EventFilter::default()).unwrap();
    assert!(
        flows.iter().any(|f| f.verdict == Verdict::Allow
            && f.host == "allowed.test"
            && f.protocol == "http"
            && f.port == http),
        "{flows:#?}"
    );
    drop(ro);
    store.shutdown().await;
    for file in ["events.db", "events.db-wal"] {
        let Ok(bytes) = std::fs::read(dir.join("state").join(file)) else {
            continue;
        };
        let text = String::from_utf8_lossy(&bytes);
        for secret in [
            "hunter2",
            "s3cr3tvalue",
            "c00kie",
            "/private/path",
            "token=",
            "?q=1",
        ] {
            assert!(!text.contains(secret), "{secret:?} is in {file}");
        }
    }

    // The suggestion from what was observed parses and lists what the workload reached.
    let opts = SuggestOptions {
        selection: Selection::default(),
        include_denied: false,
        diff: false,
        name: Some("watch".into()),
        config: None,
    };
    let text = suggest_from(&flows, &h.config, &opts).unwrap();
    let parsed = egress_agent::config::Config::from_toml_str(&text, Path::new("s.toml")).unwrap();
    let p = parsed.policy("watch").unwrap();
    let hosts: Vec<String> = p.allow_hosts.iter().map(|h| h.to_string()).collect();
    assert_eq!(hosts, ["allowed.test", "other.test"], "{text}");
    for port in [echo, http, closed] {
        assert!(p.allow_ports.contains(&port), "{text}");
    }
}
