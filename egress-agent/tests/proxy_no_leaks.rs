//! No request body, credential header, userinfo, path or query string ever reaches a denial event
//! or any log line, whatever the request and whatever the outcome.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use proxy_support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture() -> Capture {
    static C: OnceLock<Capture> = OnceLock::new();
    C.get_or_init(|| {
        let c = Capture::default();
        let w = c.clone();
        tracing_subscriber::fmt()
            .json()
            .with_env_filter("egress_agent=trace,info")
            .with_writer(move || w.clone())
            .init();
        c
    })
    .clone()
}

const SECRETS: &str = "Authorization: Bearer SECRET-AUTH\r\nCookie: session=SECRET-COOKIE\r\nX-Api-Key: SECRET-APIKEY\r\nProxy-Authorization: Basic SECRET-PROXYAUTH\r\nX-Auth-Token: SECRET-TOKEN\r\n";

#[tokio::test]
async fn secrets_never_reach_events_or_logs() {
    let cap = capture();
    let h = harness().await;
    let hp = h.up.http.port();
    let ep = h.up.echo.port();
    let body = "password=SECRET-BODY";
    let requests = vec![
        // Denied host, absolute-form POST with a body and a query string.
        format!(
            "POST http://other.test:{hp}/login?token=SECRET-QUERY HTTP/1.1\r\nHost: other.test:{hp}\r\n{SECRETS}Content-Length: {}\r\n\r\n{body}",
            body.len()
        ),
        // Allowed request (logged at debug/trace only), same secrets.
        format!(
            "POST http://allowed.test:{hp}/login?token=SECRET-QUERY HTTP/1.1\r\nHost: allowed.test:{hp}\r\n{SECRETS}Content-Length: {}\r\n\r\n{body}",
            body.len()
        ),
        // Denied CONNECT with credentials.
        format!("CONNECT other.test:{ep} HTTP/1.1\r\nHost: other.test:{ep}\r\n{SECRETS}\r\n"),
        // Userinfo.
        format!(
            "GET http://user:SECRET-USERINFO@allowed.test:{hp}/?q=SECRET-QUERY HTTP/1.1\r\n{SECRETS}\r\n"
        ),
        // Host mismatch.
        format!(
            "GET http://allowed.test:{hp}/SECRET-PATH?q=SECRET-QUERY HTTP/1.1\r\nHost: other.test\r\n{SECRETS}\r\n"
        ),
        // Rebinding, port, IP literal denials.
        format!(
            "GET http://rebind.test:{hp}/SECRET-PATH?q=SECRET-QUERY HTTP/1.1\r\nHost: rebind.test:{hp}\r\n{SECRETS}\r\n"
        ),
        format!(
            "GET http://allowed.test:1/SECRET-PATH?q=SECRET-QUERY HTTP/1.1\r\nHost: allowed.test:1\r\n{SECRETS}\r\n"
        ),
        format!(
            "GET http://10.9.9.9/SECRET-PATH?q=SECRET-QUERY HTTP/1.1\r\nHost: 10.9.9.9\r\n{SECRETS}\r\n"
        ),
        // Malformed.
        format!("GET /SECRET-PATH?q=SECRET-QUERY HTTP/1.1\r\n{SECRETS}\r\n"),
        format!(
            "GET http://allowed.test:{hp}/SECRET-PATH?q=SECRET-QUERY HTTP/1.1\r\nBad Header SECRET-BAD\r\n{SECRETS}\r\n"
        ),
    ];
    for raw in &requests {
        let mut s = TcpStream::connect(h.addr).await.unwrap();
        s.write_all(raw.as_bytes()).await.unwrap();
        read_response(&mut s, raw.starts_with("CONNECT")).await;
    }
    // Keep-alive: allowed then denied on one connection.
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(
        format!("GET http://allowed.test:{hp}/?a=SECRET-QUERY HTTP/1.1\r\nHost: allowed.test:{hp}\r\n{SECRETS}\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    read_response(&mut s, false).await;
    s.write_all(
        format!("GET http://other.test:{hp}/?a=SECRET-QUERY HTTP/1.1\r\nHost: other.test:{hp}\r\n{SECRETS}\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    read_response(&mut s, false).await;

    let events = h.events.recent(100);
    assert!(events.len() >= 7, "expected denial events, got {events:?}");
    let json = serde_json::to_string(&events).unwrap();
    assert!(!json.contains("SECRET"), "event leaked: {json}");
    assert!(
        !json.contains("login") && !json.contains('?'),
        "event has a path or query: {json}"
    );

    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let logs = String::from_utf8(cap.0.lock().unwrap().clone()).unwrap();
    let denial_lines = logs
        .lines()
        .filter(|l| l.contains("egress_agent::denial"))
        .count();
    assert!(denial_lines >= events.len(), "denials not logged:\n{logs}");
    for line in logs.lines() {
        assert!(!line.contains("SECRET"), "log line leaked: {line}");
        // Every log line is one JSON object.
        serde_json::from_str::<serde_json::Value>(line).unwrap();
    }
}
