//! [`PolicyProxy::run`] owns its connections: when it returns, every task of the listener has
//! ended.
#![expect(clippy::unwrap_used, reason = "test assertions")]

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

#[tokio::test]
async fn a_stopped_listener_returns_once_its_connections_ended() {
    let config = Config::from_toml_str(
        "[proxy]\nkernel_relay = \"off\"\n[policies.p]\nmode = \"allowlist\"\n\
         allow_hosts = [\"a.test\"]\nallow_ports = [443]\n",
        std::path::Path::new("t.toml"),
    )
    .unwrap();
    let ctx = ProxyContext::new(&config, EventSink::default())
        .unwrap()
        .admit_any_peer();
    let policy = Arc::new(config.policies["p"].clone());
    let proxy = PolicyProxy::bind(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        "p".into(),
        policy,
        ctx,
    )
    .await
    .unwrap();
    let (addr, shared) = (proxy.local_addr(), proxy.shared.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(proxy.run(async move {
        stopped.await.ok();
    }));
    // Two connections open at the stop, one with half a head.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(b"CONNECT a.test:443 HTTP/1.1\r\n")
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while shared.tasks.len() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("both connections run on the listener's tracker");

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("run returns after the stop")
        .unwrap();
    assert!(shared.tasks.is_closed());
    assert_eq!(shared.tasks.len(), 0, "a connection task outlived run");
    for s in [&mut idle, &mut partial] {
        // Closed unanswered (reset, when bytes it sent were left unread).
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest).await {
            Ok(n) => assert_eq!(n, 0, "{}", String::from_utf8_lossy(&rest)),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
}
