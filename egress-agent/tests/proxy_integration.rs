//! Proxy integration tests on loopback (no root): real upstreams, real sockets, a hosts file the
//! test controls. Each test checks what arrived (or that nothing did), not just a status code.
#![expect(clippy::unwrap_used, reason = "test assertions")]

mod proxy_support;

use std::sync::Arc;
use std::time::Duration;

use egress_agent::events::Source;
use egress_policy::Policy;
use proxy_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test]
async fn connect_allowed_name_tunnels_bytes_both_ways() {
    let h = harness().await;
    let (r, mut s) = connect(h.addr, &format!("allowed.test:{}", h.up.echo.port())).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"hello through the tunnel").await;
    assert_echo(&mut s, &vec![7u8; 300_000]).await;
    // Half-close propagates: our EOF reaches the echo server, whose EOF comes back.
    s.shutdown().await.unwrap();
    assert_closed(&mut s, T).await;
    assert_eq!(h.events.total(), 0);
}

#[tokio::test]
async fn connect_forwards_bytes_pipelined_after_the_head() {
    let h = harness().await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let a = format!("allowed.test:{}", h.up.echo.port());
    s.write_all(format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\nEARLY-BYTES").as_bytes())
        .await
        .unwrap();
    let (r, mut rest) = read_response(&mut s, true).await;
    assert_eq!(r.status, 200);
    while rest.len() < 11 {
        let mut b = [0u8; 64];
        let n = tokio::time::timeout(T, s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        rest.extend_from_slice(&b[..n]);
    }
    assert_eq!(rest, b"EARLY-BYTES");
}

#[tokio::test]
async fn connect_wildcard_matches_subdomains_only() {
    let h = harness().await;
    let p = h.up.echo.port();
    assert_eq!(
        connect(h.addr, &format!("api.wild.test:{p}"))
            .await
            .0
            .status,
        200
    );
    assert_eq!(
        connect(h.addr, &format!("deep.api.wild.test:{p}"))
            .await
            .0
            .status,
        200
    );
    // `*.wild.test` does not match `wild.test` itself.
    let (r, _) = connect(h.addr, &format!("wild.test:{p}")).await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
}

#[tokio::test]
async fn connect_denied_host_gets_403_and_one_event() {
    let h = harness().await;
    let (r, mut s) = connect(h.addr, &format!("other.test:{}", h.up.echo.port())).await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("host-not-allowed"));
    assert!(r.text().contains("host-not-allowed"));
    assert_closed(&mut s, T).await;
    let ev = h.events.recent(10);
    assert_eq!(ev.len(), 1);
    let e = &ev[0];
    assert_eq!(e.source, Source::Proxy);
    assert_eq!(e.policy, "test");
    assert_eq!(e.host.as_deref(), Some("other.test"));
    assert_eq!(e.port, h.up.echo.port());
    assert_eq!(e.protocol, "connect");
    assert_eq!(e.reason, "host-not-allowed");
}

#[tokio::test]
async fn connect_name_confusions_are_refused() {
    let h = harness().await;
    let p = h.up.echo.port();
    for (auth, status, reason) in [
        (format!("ALLOWED.TEST.:{p}"), 200, None),
        (
            format!("allowed.test.evil.test:{p}"),
            403,
            Some("host-not-allowed"),
        ),
        (
            format!("evilallowed.test:{p}"),
            403,
            Some("host-not-allowed"),
        ),
        (
            format!("allowed.test@other.test:{p}"),
            403,
            Some("userinfo-not-allowed"),
        ),
        (format!("2130706433:{p}"), 403, Some("numeric-ip-form")),
        (format!("0x7f000001:{p}"), 403, Some("numeric-ip-form")),
        (format!("0177.0.0.1:{p}"), 403, Some("numeric-ip-form")),
        (format!("127.1:{p}"), 403, Some("numeric-ip-form")),
        (format!("allowed.test..:{p}"), 400, None),
    ] {
        let mut s = TcpStream::connect(h.addr).await.unwrap();
        s.write_all(format!("CONNECT {auth} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let (r, _) = read_response(&mut s, true).await;
        assert_eq!((r.status, r.deny()), (status, reason), "{auth}");
    }
}

#[tokio::test]
async fn connect_port_not_allowed() {
    let h = harness().await;
    let (r, _) = connect(h.addr, "allowed.test:22").await;
    assert_eq!((r.status, r.deny()), (403, Some("port-not-allowed")));
    assert_eq!(h.events.recent(1)[0].reason, "port-not-allowed");
}

/// The explicit `allow_cidrs` entry (127.0.0.1/32 on the upstream ports) is what lets IP literals
/// through; `resolve_private` alone never does.
#[tokio::test]
async fn connect_ip_literals_need_allow_cidrs() {
    let h = harness().await;
    let p = h.up.echo.port();
    let (r, _) = connect(h.addr, &format!("127.0.0.1:{p}")).await;
    assert_eq!((r.status, r.deny()), (403, Some("address-denied")));
    let up = upstreams().await;
    let cidr = format!(
        "allow_cidrs = [{{ cidr = \"127.0.0.1/32\", ports = [{}, {}, {}] }}]",
        up.echo.port(),
        up.http.port(),
        up.closed.port()
    );
    let h = harness_on(up, "header_timeout_ms = 2000", &cidr, "test", None).await;
    let p = h.up.echo.port();
    // Covered by allow_cidrs 127.0.0.1/32 on this port: allowed, also in v4-mapped form.
    let (r, mut s) = connect(h.addr, &format!("127.0.0.1:{p}")).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"ip literal").await;
    let (r, mut s) = connect(h.addr, &format!("[::ffff:127.0.0.1]:{p}")).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"mapped").await;
    for (auth, reason) in [
        (format!("127.0.0.2:{p}"), "address-denied"),
        (format!("[::1]:{p}"), "address-denied"),
        (format!("[::ffff:169.254.169.254]:{p}"), "address-denied"),
        ("169.254.169.254:80".to_owned(), "address-denied"),
        ("10.0.0.1:443".to_owned(), "address-denied"),
        // Public literal, not covered: refused before any connect (nothing leaves the machine).
        ("192.0.2.1:443".to_owned(), "address-denied"),
        ("8.8.8.8:443".to_owned(), "ip-literal-not-allowed"),
        ("127.0.0.1:22".to_owned(), "port-not-allowed"),
    ] {
        let (r, _) = connect(h.addr, &auth).await;
        assert_eq!((r.status, r.deny()), (403, Some(reason)), "{auth}");
    }
    let ev = h.events.recent(1).pop().unwrap();
    assert_eq!(ev.ip, Some("127.0.0.1".parse().unwrap()));
    assert_eq!(ev.host, None);
}

#[tokio::test]
async fn connect_rebinding_to_denied_addresses_is_refused_at_dial_time() {
    let h = harness().await;
    let p = h.up.echo.port();
    // Allowed names whose resolution lands on denied addresses (the proxy resolves, then checks).
    for (name, ip) in [
        ("rebind.test", "127.0.0.2"),
        ("metadata.test", "169.254.169.254"),
        ("private.test", "10.0.0.1"),
        ("v6loop.test", "::1"),
    ] {
        let (r, _) = connect(h.addr, &format!("{name}:{p}")).await;
        assert_eq!(
            (r.status, r.deny()),
            (403, Some("address-denied")),
            "{name}"
        );
        let ev = h.events.recent(1).pop().unwrap();
        assert_eq!(ev.host.as_deref(), Some(name));
        assert_eq!(ev.ip, Some(ip.parse().unwrap()), "{name}");
    }
    // One good and one denied address: refused as a whole.
    let (r, _) = connect(h.addr, &format!("mixed.test:{p}")).await;
    assert_eq!((r.status, r.deny()), (403, Some("address-denied")));
}

#[tokio::test]
async fn rebinding_after_the_check_cannot_redirect_the_dial() {
    // The hosts file is read once; changing it afterwards changes nothing for this context, and a
    // fresh context sees the new (denied) answer and refuses. Either way no second lookup happens.
    let h = harness().await;
    let p = h.up.echo.port();
    assert_eq!(
        connect(h.addr, &format!("allowed.test:{p}")).await.0.status,
        200
    );
    let dir = temp_dir();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.9 allowed.test\n").unwrap();
    let config = Arc::new(test_config(&h.up, &hosts, "", ""));
    let ctx = egress_agent::proxy::ProxyContext::new(&config, h.events.clone())
        .unwrap()
        .admit_any_peer();
    let proxy = egress_agent::proxy::PolicyProxy::bind(
        "127.0.0.1:0".parse().unwrap(),
        "test".into(),
        Arc::new(config.policy("test").unwrap().clone()),
        ctx,
    )
    .await
    .unwrap();
    let addr = proxy.local_addr();
    tokio::spawn(proxy.run(std::future::pending()));
    let (r, _) = connect(addr, &format!("allowed.test:{p}")).await;
    assert_eq!((r.status, r.deny()), (403, Some("address-denied")));
}

#[tokio::test]
async fn connect_upstream_refused_is_502() {
    let h = harness().await;
    let (r, _) = connect(h.addr, &format!("allowed.test:{}", h.up.closed.port())).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.header("x-egress-error"), Some("connect-failed"));
    assert_eq!(r.deny(), None);
    let (r, _) = connect(h.addr, &format!("unknown.wild.test:{}", h.up.echo.port())).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.header("x-egress-error"), Some("dns-failure"));
}

#[tokio::test]
async fn absolute_form_get_is_forwarded_in_origin_form() {
    let h = harness().await;
    let p = h.up.http.port();
    let r = exchange(
        h.addr,
        format!(
            "GET http://allowed.test:{p}/path?x=1 HTTP/1.1\r\nHost: allowed.test:{p}\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\nConnection: close, x-hop\r\nX-Hop: 1\r\nX-Keep: 1\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let t = r.text();
    assert!(t.contains("line=GET /path?x=1\n"), "{t}");
    assert!(t.contains(&format!("host=allowed.test:{p}\n")), "{t}");
    assert!(t.contains("x-keep"), "{t}");
    assert!(
        !t.contains("proxy-authorization") && !t.contains("x-hop"),
        "{t}"
    );
}

#[tokio::test]
async fn absolute_form_post_body_is_forwarded() {
    let h = harness().await;
    let p = h.up.http.port();
    let r = exchange(
        h.addr,
        format!(
            "POST http://allowed.test:{p}/u HTTP/1.1\r\nHost: allowed.test:{p}\r\nContent-Length: 11\r\n\r\nhello world"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("body=11\n"), "{}", r.text());
}

#[tokio::test]
async fn keep_alive_checks_every_request() {
    let h = harness().await;
    let p = h.up.http.port();
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let r = get(&mut s, &format!("allowed.test:{p}"), "/one").await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("line=GET /one"));
    // Same connection, a name that is not allowed (it resolves to the same upstream!).
    let r = get(&mut s, &format!("other.test:{p}"), "/two").await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
    // And an IP literal that is not covered, then an allowed one again.
    let r = get(&mut s, &format!("127.0.0.2:{p}"), "/three").await;
    assert_eq!((r.status, r.deny()), (403, Some("address-denied")));
    let r = get(&mut s, &format!("allowed.test:{p}"), "/four").await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("line=GET /four"));
    let reasons: Vec<String> = h.events.recent(10).into_iter().map(|e| e.reason).collect();
    assert_eq!(reasons, vec!["host-not-allowed", "address-denied"]);
}

#[tokio::test]
async fn pipelined_requests_are_each_checked() {
    let h = harness().await;
    let p = h.up.http.port();
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(
        format!(
            "GET http://allowed.test:{p}/a HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\nGET http://other.test:{p}/b HTTP/1.1\r\nHost: other.test:{p}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let (r1, rest) = read_response(&mut s, false).await;
    assert_eq!(r1.status, 200);
    let r2 = if rest.is_empty() {
        read_response(&mut s, false).await.0
    } else {
        // Parse the second response out of what was already read.
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        resp.parse(&rest).unwrap();
        Resp {
            status: resp.code.unwrap(),
            headers: resp
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_owned(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect(),
            body: vec![],
        }
    };
    assert_eq!((r2.status, r2.deny()), (403, Some("host-not-allowed")));
}

#[tokio::test]
async fn keep_alive_connect_after_get_is_checked_and_tunnels() {
    let h = harness().await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let hp = h.up.http.port();
    assert_eq!(
        get(&mut s, &format!("allowed.test:{hp}"), "/").await.status,
        200
    );
    let a = format!("other.test:{}", h.up.echo.port());
    s.write_all(format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (r, _) = read_response(&mut s, true).await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
    let a = format!("allowed.test:{}", h.up.echo.port());
    s.write_all(format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (r, _) = read_response(&mut s, true).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"tunnel after keep-alive").await;
}

#[tokio::test]
async fn host_header_mismatch_is_refused() {
    let h = harness().await;
    let p = h.up.http.port();
    for req in [
        format!("GET http://allowed.test:{p}/ HTTP/1.1\r\nHost: other.test:{p}\r\n\r\n"),
        format!("GET http://allowed.test:{p}/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
        format!("CONNECT allowed.test:{p} HTTP/1.1\r\nHost: other.test:{p}\r\n\r\n"),
    ] {
        let r = exchange(h.addr, req.as_bytes()).await;
        assert_eq!(
            (r.status, r.deny()),
            (403, Some("host-header-mismatch")),
            "{req}"
        );
    }
    // Second request on a kept-alive connection too.
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    assert_eq!(
        get(&mut s, &format!("allowed.test:{p}"), "/").await.status,
        200
    );
    let r = get_with_host(
        &mut s,
        &format!("allowed.test:{p}"),
        "/",
        &format!("other.test:{p}"),
    )
    .await;
    assert_eq!((r.status, r.deny()), (403, Some("host-header-mismatch")));
}

#[tokio::test]
async fn userinfo_in_absolute_uri_is_refused() {
    let h = harness().await;
    let p = h.up.http.port();
    let r = exchange(
        h.addr,
        format!("GET http://allowed.test:{p}@other.test:{p}/ HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.deny(), Some("userinfo-not-allowed"));
}

#[tokio::test]
async fn bad_requests_get_400() {
    let h = harness().await;
    let p = h.up.http.port();
    for raw in [
        "GARBAGE\r\n\r\n".to_owned(),
        "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n".to_owned(),
        "GET https://allowed.test/ HTTP/1.1\r\n\r\n".to_owned(),
        format!("GET http://allowed.test:{p}/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
        format!("GET http://allowed.test:{p}/ HTTP/1.1\r\nX: a\rb\r\n\r\n"),
        "CONNECT allowed.test HTTP/1.1\r\n\r\n".to_owned(),
        "\x16\x03\x01\x00\x7f\x01\x00\x00\x7b\x03\x03".to_owned(),
    ] {
        let r = exchange(h.addr, raw.as_bytes()).await;
        assert_eq!(r.status, 400, "{raw:?}");
    }
    assert_eq!(h.events.total(), 0, "bad requests are not denials");
}

#[tokio::test]
async fn oversized_headers_get_431_and_close() {
    let h = harness_with("max_header_bytes = 4096", "", "test").await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let big = format!(
        "GET http://allowed.test/ HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(8000)
    );
    s.write_all(big.as_bytes()).await.ok();
    let (r, _) = read_response(&mut s, false).await;
    assert_eq!(r.status, 431);
    assert_closed(&mut s, T).await;
}

#[tokio::test]
async fn slowloris_is_cut_at_the_header_deadline() {
    let h = harness_with("header_timeout_ms = 300", "", "test").await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let start = std::time::Instant::now();
    // One byte every 100 ms: each read is fast, the whole head never completes.
    let trickle = async {
        for b in b"CONNECT allowed.test:443 HTTP/1.1\r\nX: ".iter() {
            if s.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_millis(800), trickle)
        .await
        .ok();
    let mut rest = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut rest))
        .await
        .unwrap()
        .ok();
    assert!(start.elapsed() < Duration::from_secs(3));
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );
}

#[tokio::test]
async fn idle_client_that_never_sends_is_dropped() {
    let h = harness_with("header_timeout_ms = 200", "", "test").await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    assert_closed(&mut s, Duration::from_secs(2)).await;
}

#[tokio::test]
async fn idle_tunnel_is_closed() {
    let h = harness_with("idle_timeout_ms = 300", "", "test").await;
    let (r, mut s) = connect(h.addr, &format!("allowed.test:{}", h.up.echo.port())).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"x").await;
    assert_closed(&mut s, Duration::from_secs(3)).await;
}

#[tokio::test]
async fn connection_bound_holds_extra_clients_back() {
    let h = harness_with("max_connections = 2\nheader_timeout_ms = 5000", "", "test").await;
    let idle1 = TcpStream::connect(h.addr).await.unwrap();
    let _idle2 = TcpStream::connect(h.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = TcpStream::connect(h.addr).await.unwrap();
    let a = format!("allowed.test:{}", h.up.echo.port());
    assert_connect_waits(&mut third, &a, "the bound").await;
    drop(idle1);
    let (r, _) = read_response(&mut third, true).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn deny_all_listener_refuses_everything() {
    let h = harness_with("", "", "deny_all").await;
    let (r, _) = connect(h.addr, &format!("allowed.test:{}", h.up.echo.port())).await;
    assert_eq!((r.status, r.deny()), (403, Some("policy-deny-all")));
    let r = exchange(
        h.addr,
        format!(
            "GET http://127.0.0.1:{}/ HTTP/1.1\r\n\r\n",
            h.up.http.port()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!((r.status, r.deny()), (403, Some("policy-deny-all")));
}

#[tokio::test]
async fn allow_all_listener_still_refuses_host_internal_addresses() {
    let h = harness_with("", "", "allow_all").await;
    let (r, _) = connect(h.addr, &format!("other.test:{}", h.up.echo.port())).await;
    assert_eq!((r.status, r.deny()), (403, Some("address-denied")));
    let (r, _) = connect(h.addr, "169.254.169.254:80").await;
    assert_eq!((r.status, r.deny()), (403, Some("address-denied")));
}

#[tokio::test]
async fn headers_cannot_select_another_policy() {
    // Identity is the listener; nothing in the request can borrow a wider policy.
    let h = harness().await;
    let raw = format!(
        "CONNECT other.test:{p} HTTP/1.1\r\nHost: other.test:{p}\r\nX-Egress-Policy: allow_all\r\nProxy-Authorization: Basic YWxsb3dfYWxsOg==\r\n\r\n",
        p = h.up.echo.port()
    );
    let r = exchange(h.addr, raw.as_bytes()).await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
}

#[tokio::test]
async fn policy_swap_applies_to_the_next_request() {
    let h = harness().await;
    let p = h.up.http.port();
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    assert_eq!(
        get(&mut s, &format!("allowed.test:{p}"), "/").await.status,
        200
    );
    h.handle.set(&Policy::deny_all());
    let r = get(&mut s, &format!("allowed.test:{p}"), "/").await;
    assert_eq!((r.status, r.deny()), (403, Some("policy-deny-all")));
    let (r, _) = connect(h.addr, &format!("allowed.test:{}", h.up.echo.port())).await;
    assert_eq!(r.status, 403);
}

#[tokio::test]
async fn serve_binds_one_listener_per_policy() {
    let up = upstreams().await;
    let dir = temp_dir();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, HOSTS).unwrap();
    let config = Arc::new(test_config(&up, &hosts, "", ""));
    let events = egress_agent::events::EventSink::default();
    let ctx = egress_agent::proxy::ProxyContext::new(&config, events)
        .unwrap()
        .admit_any_peer();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = egress_agent::proxy::serve(config.clone(), ctx, async move {
        rx.await.ok();
    })
    .await
    .unwrap();
    let addrs = server.addrs().clone();
    assert_eq!(
        addrs.keys().map(String::as_str).collect::<Vec<_>>(),
        vec!["allow_all", "audit", "deny_all", "test"]
    );
    for a in addrs.values() {
        assert!(a.ip().is_loopback() && a.port() != 0);
    }
    let (r, _) = connect(addrs["test"], &format!("allowed.test:{}", up.echo.port())).await;
    assert_eq!(r.status, 200);
    let (r, _) = connect(
        addrs["deny_all"],
        &format!("allowed.test:{}", up.echo.port()),
    )
    .await;
    assert_eq!(r.status, 403);
    tx.send(()).unwrap();
    tokio::time::timeout(T, server.join()).await.unwrap();
    assert!(
        TcpStream::connect(addrs["test"]).await.is_err(),
        "listener still open after shutdown"
    );
}

/// #40 item 5: a reload applies to what is open. A tunnel whose target the new policy refuses
/// ends, with a denial event (`ended = policy-reload`); one whose target it still allows goes on.
/// `cargo xtask test` runs this with the kernel relay too (every tunnel spliced at once).
#[tokio::test]
async fn a_reload_that_refuses_an_open_tunnels_target_ends_it() {
    let h = harness().await;
    let echo = h.up.echo.port();
    let (r, mut refused) = connect(h.addr, &format!("allowed.test:{echo}")).await;
    assert_eq!(r.status, 200);
    let (r, mut kept) = connect(h.addr, &format!("api.wild.test:{echo}")).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut refused, b"before the reload").await;
    assert_echo(&mut kept, b"before the reload").await;
    let before = h.events.total();
    // The same policy without `allowed.test`.
    let mut narrowed: Policy = h.config.policy("test").unwrap().clone();
    narrowed
        .allow_hosts
        .retain(|e| e.pattern.to_string() != "allowed.test");
    assert!(narrowed.allow_hosts.len() < h.config.policy("test").unwrap().allow_hosts.len());
    h.handle.set(&narrowed);
    assert_closed(&mut refused, T).await;
    // The other tunnel is untouched, and relays both ways.
    assert_echo(&mut kept, b"after the reload").await;
    let ev = h
        .events
        .recent(10)
        .into_iter()
        .find(|e| e.context.get("ended").map(String::as_str) == Some("policy-reload"))
        .unwrap_or_else(|| panic!("no policy-reload event: {:?}", h.events.recent(10)));
    assert_eq!(ev.host.as_deref(), Some("allowed.test"));
    assert_eq!(ev.reason, "host-not-allowed");
    assert_eq!(
        h.events.total(),
        before + 1,
        "one event: {:?}",
        h.events.recent(10)
    );
    // A second reload that changes nothing for the kept tunnel leaves it alone too.
    h.handle.set(&narrowed);
    assert_echo(&mut kept, b"after a second reload").await;
}

#[tokio::test]
async fn serve_binds_ipv6_siblings_sharing_the_policy() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipping: no IPv6 loopback");
        return;
    }
    let up = upstreams().await;
    let dir = temp_dir();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, HOSTS).unwrap();
    let config = Arc::new(test_config(&up, &hosts, "endpoint_v6 = \"[::1]:3128\"", ""));
    let ctx =
        egress_agent::proxy::ProxyContext::new(&config, egress_agent::events::EventSink::default())
            .unwrap()
            .admit_any_peer();
    let server = egress_agent::proxy::serve(config.clone(), ctx, std::future::pending())
        .await
        .unwrap();
    let v6 = server.addrs_v6()["test"];
    assert!(v6.is_ipv6() && v6.ip().is_loopback());
    let (r, mut s) = connect(v6, &format!("allowed.test:{}", up.echo.port())).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"over v6 listener").await;
    // One swap handle covers both listeners.
    server
        .policy_handle("test")
        .unwrap()
        .set(&Policy::deny_all());
    let (r, _) = connect(v6, &format!("allowed.test:{}", up.echo.port())).await;
    assert_eq!((r.status, r.deny()), (403, Some("policy-deny-all")));
    let (r, _) = connect(
        server.addrs()["test"],
        &format!("allowed.test:{}", up.echo.port()),
    )
    .await;
    assert_eq!((r.status, r.deny()), (403, Some("policy-deny-all")));
}

#[tokio::test]
async fn get_then_connect_pipelined_in_one_write_keeps_byte_order() {
    let h = harness().await;
    let hp = h.up.http.port();
    let a = format!("allowed.test:{}", h.up.echo.port());
    // A long first request so the whole burst exceeds hyper's first read.
    let filler = "a".repeat(6000);
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let burst = format!(
        "GET http://allowed.test:{hp}/ HTTP/1.1\r\nHost: allowed.test:{hp}\r\nX-Filler: {filler}\r\n\r\nCONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n0123456789ABCDEF"
    );
    s.write_all(burst.as_bytes()).await.unwrap();
    let (r1, rest) = read_response(&mut s, false).await;
    assert_eq!(r1.status, 200);
    let mut buf = rest;
    // Read the CONNECT answer and then the echoed tunnel bytes, in order.
    let mut b = [0u8; 4096];
    while !String::from_utf8_lossy(&buf).contains("0123456789ABCDEF") {
        let n = tokio::time::timeout(T, s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&b[..n]);
    }
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("\r\n\r\n0123456789ABCDEF"), "{text}");
}

/// One client (listener) at its own bound can't take connections from another listener, and a
/// tunnel a kept-alive HTTP connection turned into still counts against the bound.
#[tokio::test]
async fn per_listener_bound_keeps_one_client_from_taking_every_connection() {
    let up = upstreams().await;
    let dir = temp_dir();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, HOSTS).unwrap();
    let config = Arc::new(test_config(
        &up,
        &hosts,
        "max_connections = 10\nmax_connections_per_listener = 1\nheader_timeout_ms = 5000",
        "",
    ));
    let ctx =
        egress_agent::proxy::ProxyContext::new(&config, egress_agent::events::EventSink::default())
            .unwrap()
            .admit_any_peer();
    let policy = Arc::new(config.policy("test").unwrap().clone());
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let p = egress_agent::proxy::PolicyProxy::bind(
            "127.0.0.1:0".parse().unwrap(),
            "test".into(),
            policy.clone(),
            ctx.clone(),
        )
        .await
        .unwrap();
        addrs.push(p.local_addr());
        tokio::spawn(p.run(std::future::pending()));
    }
    let (a, b) = (addrs[0], addrs[1]);
    // Listener a's only connection: a plain request, then a CONNECT on the same connection.
    let mut first = TcpStream::connect(a).await.unwrap();
    let hp = up.http.port();
    assert_eq!(
        get(&mut first, &format!("allowed.test:{hp}"), "/")
            .await
            .status,
        200
    );
    let target = format!("allowed.test:{}", up.echo.port());
    first
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    assert_eq!(read_response(&mut first, true).await.0.status, 200);
    assert_echo(&mut first, b"held").await;
    // A second client of listener a waits: the tunnel still holds a's only place.
    let mut second = TcpStream::connect(a).await.unwrap();
    assert_connect_waits(&mut second, &target, "listener a's bound").await;
    // Listener b is unaffected.
    let (r, mut other) = connect(b, &target).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut other, b"b still serves").await;
    // When the tunnel ends, a's waiting client gets its turn.
    drop(first);
    let (r, _) = read_response(&mut second, true).await;
    assert_eq!(r.status, 200);
}

/// Plain HTTP inside a `CONNECT` tunnel is read like a transparent connection: each request's
/// Host must be the tunnel's target (no second site behind the same address on a kept-alive
/// tunnel). Checked by what the upstream answered.
#[tokio::test]
async fn plain_http_inside_a_tunnel_must_name_the_target() {
    let h = harness().await;
    let p = h.up.http.port();
    let (r, mut s) = connect(h.addr, &format!("allowed.test:{p}")).await;
    assert_eq!(r.status, 200);
    s.write_all(
        format!(
            "GET /one HTTP/1.1\r\nHost: allowed.test:{p}\r\n\r\n\
             GET /two HTTP/1.1\r\nHost: other.test:{p}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut resp = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut resp))
        .await
        .unwrap()
        .unwrap();
    assert!(resp.contains("line=GET /one"), "{resp}");
    assert!(
        resp.contains("x-egress-deny: host-header-mismatch"),
        "{resp}"
    );
    assert!(!resp.contains("line=GET /two"), "{resp}");
    // The first bytes already naming another host: refused before anything is forwarded.
    let (r, mut s) = connect(h.addr, &format!("allowed.test:{p}")).await;
    assert_eq!(r.status, 200);
    s.write_all(format!("GET /x HTTP/1.1\r\nHost: other.test:{p}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut resp = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut resp))
        .await
        .unwrap()
        .unwrap();
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    assert!(resp.contains("host-header-mismatch"), "{resp}");
    assert!(!resp.contains("line="), "{resp}");
    let ev = h
        .events
        .recent(10)
        .into_iter()
        .find(|e| e.context.contains_key("connect_target"))
        .expect("the mismatch event");
    assert_eq!(ev.host.as_deref(), Some("other.test"));
}

/// Every event of the explicit listener names the rule that decided, as configured: the
/// `allow_hosts` entry (most specific first) or `allow_cidrs` entry that let a `CONNECT` or a
/// proxied request through (a kept-alive request decided again included), the entry that matched
/// a name on a port it doesn't list, the `deny_cidrs` entry or built-in range that refused an
/// address; a name no entry matches names none.
#[tokio::test]
async fn every_explicit_decision_names_its_rule() {
    let up = upstreams().await;
    let (echo, http) = (up.echo.port(), up.http.port());
    let extra = format!(
        "allow_cidrs = [{{ cidr = \"127.0.0.1/32\", ports = [{echo}] }}]\ndeny_cidrs = [\"10.0.0.0/8\"]"
    );
    let h = harness_on(up, "header_timeout_ms = 2000", &extra, "test", None).await;
    let mut tap = h.events.tap(64, true);
    let mut next = async || {
        tokio::time::timeout(T, tap.rx.recv())
            .await
            .unwrap()
            .unwrap()
    };
    let mut expect = async |protocol: &str, verdict, reason: &str, rule: Option<&str>| {
        let ev = next().await;
        assert_eq!(
            (
                ev.protocol.as_str(),
                ev.verdict,
                ev.reason.as_str(),
                ev.rule.as_deref()
            ),
            (protocol, verdict, reason, rule),
            "{ev:?}"
        );
    };
    use egress_agent::events::Verdict::{Allow, Deny};

    let (r, _s) = connect(h.addr, &format!("allowed.test:{echo}")).await;
    assert_eq!(r.status, 200);
    expect(
        "connect",
        Allow,
        "allowed",
        Some("allow_hosts allowed.test"),
    )
    .await;
    let (r, _s) = connect(h.addr, &format!("deep.api.wild.test:{echo}")).await;
    assert_eq!(r.status, 200);
    expect("connect", Allow, "allowed", Some("allow_hosts *.wild.test")).await;
    let (r, _s) = connect(h.addr, &format!("127.0.0.1:{echo}")).await;
    assert_eq!(r.status, 200);
    let cidr = format!("allow_cidrs 127.0.0.1/32 (ports {echo})");
    expect("connect", Allow, "allowed", Some(&cidr)).await;

    // Proxied HTTP: the first request dials, the second reuses the connection (decided again).
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    for _ in 0..2 {
        let r = get(&mut s, &format!("allowed.test:{http}"), "/x").await;
        assert_eq!(r.status, 200);
        expect("http", Allow, "allowed", Some("allow_hosts allowed.test")).await;
    }

    let r = exchange(h.addr, b"CONNECT allowed.test:9 HTTP/1.1\r\n\r\n").await;
    assert_eq!(r.status, 403);
    expect(
        "connect",
        Deny,
        "port-not-allowed",
        Some("allow_hosts allowed.test"),
    )
    .await;
    let r = exchange(
        h.addr,
        format!("CONNECT rebind.test:{echo} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    expect(
        "connect",
        Deny,
        "address-denied",
        Some("the built-in deny list (loopback)"),
    )
    .await;
    let r = exchange(h.addr, b"CONNECT 10.9.9.9:443 HTTP/1.1\r\n\r\n").await;
    assert_eq!(r.status, 403);
    expect(
        "connect",
        Deny,
        "address-denied-by-policy",
        Some("deny_cidrs 10.0.0.0/8"),
    )
    .await;
    let r = exchange(
        h.addr,
        format!("CONNECT nowhere.test:{echo} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    expect("connect", Deny, "host-not-allowed", None).await;
    assert!(tap.rx.try_recv().is_err(), "one event per decision");
}

/// A refused client is told why in a body it can read (issue #41): text naming the policy, the
/// destination, the reason and the rule, or JSON when its `Accept` asks — on a proxied request
/// and on a `CONNECT`; `X-Egress-Deny` as before. Nothing the client sent is echoed.
#[tokio::test]
async fn refusals_say_why_in_text_or_json() {
    let h = harness().await;
    let json = |r: &Resp| -> serde_json::Value {
        assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
        serde_json::from_slice(&r.body).unwrap()
    };
    // Proxied HTTP, a name no entry matches: text by default.
    let r = exchange(
        h.addr,
        b"GET http://nowhere.test/x?secret=1 HTTP/1.1\r\nHost: nowhere.test\r\n\r\n",
    )
    .await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
    let text = r.text();
    assert!(
        text.starts_with("egress-agent: denied by policy test: host-not-allowed\n"),
        "{text}"
    );
    assert!(text.contains("destination: nowhere.test:80\n"), "{text}");
    assert!(
        text.contains("egress-agent explain --policy test nowhere.test:80"),
        "{text}"
    );
    assert!(
        !text.contains("rule:") && !text.contains("secret"),
        "{text}"
    );
    // The same in JSON.
    let r = exchange(
        h.addr,
        b"GET http://nowhere.test/ HTTP/1.1\r\nHost: nowhere.test\r\nAccept: application/json\r\n\r\n",
    )
    .await;
    let j = json(&r);
    assert_eq!(
        (
            j["error"].as_str(),
            j["reason"].as_str(),
            j["policy"].as_str(),
            j["host"].as_str(),
            j["port"].as_u64()
        ),
        (
            Some("egress-denied"),
            Some("host-not-allowed"),
            Some("test"),
            Some("nowhere.test"),
            Some(80)
        )
    );
    assert!(j.get("rule").is_none(), "{j}");
    // A port the matching entry doesn't allow: the rule is named.
    let r = exchange(
        h.addr,
        b"GET http://allowed.test:9/ HTTP/1.1\r\nHost: allowed.test:9\r\nAccept: application/json\r\n\r\n",
    )
    .await;
    assert_eq!(json(&r)["rule"], "allow_hosts allowed.test");
    // CONNECT: text, or JSON when its head asks.
    let r = exchange(h.addr, b"CONNECT allowed.test:9 HTTP/1.1\r\n\r\n").await;
    assert_eq!((r.status, r.deny()), (403, Some("port-not-allowed")));
    assert!(
        r.text().contains("rule: allow_hosts allowed.test\n"),
        "{}",
        r.text()
    );
    let r = exchange(
        h.addr,
        b"CONNECT allowed.test:9 HTTP/1.1\r\nAccept: application/json\r\n\r\n",
    )
    .await;
    let j = json(&r);
    assert_eq!(
        (j["reason"].as_str(), j["port"].as_u64()),
        (Some("port-not-allowed"), Some(9))
    );
    // An allowed request asking for JSON gets the upstream's answer untouched: only the
    // proxy's own refusals are shaped.
    let r = exchange(
        h.addr,
        format!(
            "GET http://allowed.test:{p}/ok HTTP/1.1\r\nHost: allowed.test:{p}\r\nAccept: application/json\r\n\r\n",
            p = h.up.http.port()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!((r.status, r.deny()), (200, None), "{r:?}");
    assert!(r.text().contains("line=GET /ok"), "{}", r.text());
}

#[tokio::test]
async fn a_preset_s_host_is_allowed_and_a_host_of_another_preset_is_not() {
    let h = harness_with(
        "header_timeout_ms = 2000",
        "presets = [\"anthropic\"]",
        "test",
    )
    .await;
    let p = h.up.echo.port();
    let (r, mut s) = connect(h.addr, &format!("api.anthropic.com:{p}")).await;
    assert_eq!(r.status, 200);
    assert_echo(&mut s, b"through a preset's entry").await;
    // Resolves to the same upstream, but no preset of this policy names it.
    let (r, mut s) = connect(h.addr, &format!("api.openai.com:{p}")).await;
    assert_eq!((r.status, r.deny()), (403, Some("host-not-allowed")));
    assert_closed(&mut s, T).await;
    let ev = h.events.recent(10);
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].host.as_deref(), Some("api.openai.com"));
    // Plain HTTP (absolute form) on the same entry.
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let authority = format!("api.anthropic.com:{}", h.up.http.port());
    let r = get(&mut s, &authority, "/preset").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("line=GET /preset"), "{}", r.text());
}
