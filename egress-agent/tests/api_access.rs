//! The control API answers root and refuses everybody else: by file mode, and by peer
//! credentials if the mode is loosened.

use std::{os::unix::fs::PermissionsExt, process::Command, sync::Arc};

use egress_agent::api::{self, BoxFuture, Control, server::ApiServer};
use hyper::Method;
use serde_json::{Value, json};

struct Fake;

impl Control for Fake {
    fn status(&self) -> Value {
        json!({ "ok": true })
    }
    fn containers(&self) -> Value {
        json!([])
    }
    fn policies(&self) -> Value {
        json!({ "deny_all": { "mode": "deny_all" } })
    }
    fn events(&self, n: usize) -> Vec<Value> {
        (0..n.min(3)).map(|i| json!({ "seq": i })).collect()
    }
    fn subscribe(&self) -> tokio::sync::mpsc::Receiver<Value> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            for i in 0..2 {
                if tx.send(json!({ "live": i })).await.is_err() {
                    return;
                }
            }
        });
        rx
    }
    fn reload(&self) -> BoxFuture<'_, Result<Value, String>> {
        Box::pin(async { Err("config.toml:3: unknown field `mod`".to_owned()) })
    }
}

fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Runs a raw HTTP request over the socket as uid/gid 65534 (nobody) with python3's socket
/// module; returns what it printed (the status line, or the connect error).
fn request_as_nobody(socket: &std::path::Path) -> String {
    let script = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect-error", e.errno); sys.exit(0)
s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
print(s.recv(4096).decode().splitlines()[0])
"#;
    use std::os::unix::process::CommandExt;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(socket)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 runs");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

// The non-root client is a blocking child process: the server needs its own worker thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_is_served_others_are_refused() {
    let dir = tempdir();
    let sock = dir.join("api.sock");
    let server = ApiServer::bind(&sock).await.expect("bind");
    let mode = std::fs::metadata(&sock)
        .expect("socket exists")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "socket must be root-only");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(Arc::new(Fake), async {
        stop_rx.await.ok();
    }));

    if is_root() {
        let body = api::client::request(&sock, Method::GET, "/v1/status")
            .await
            .expect("status");
        assert_eq!(
            serde_json::from_str::<Value>(&body).expect("json")["ok"],
            true
        );
        let events = api::client::request(&sock, Method::GET, "/v1/events?n=2")
            .await
            .expect("events");
        assert_eq!(
            serde_json::from_str::<Value>(&events)
                .expect("json")
                .as_array()
                .map(Vec::len),
            Some(2)
        );
        let err = api::client::request(&sock, Method::POST, "/v1/reload")
            .await
            .expect_err("reload fails");
        assert!(err.to_string().contains("unknown field `mod`"), "{err}");
        let err = api::client::request(&sock, Method::DELETE, "/v1/status")
            .await
            .expect_err("405");
        assert!(err.to_string().contains("405"), "{err}");

        if Command::new("python3").arg("-V").output().is_ok() {
            // The parent directory must let nobody reach the socket for this check to mean
            // anything: only the socket's own mode stands in the way.
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
                .expect("chmod dir");
            let refused = request_as_nobody(&sock);
            assert_eq!(
                refused, "connect-error 13",
                "file mode must refuse a non-root client"
            );
            // Loosened by hand: the peer-credential check still refuses.
            std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))
                .expect("chmod sock");
            let refused = request_as_nobody(&sock);
            assert!(refused.starts_with("HTTP/1.1 403"), "got {refused:?}");
        } else {
            eprintln!("skipping non-root client check: python3 not installed");
        }
    } else {
        eprintln!("skipping: needs root (the client must be root to be served)");
        let err = api::client::request(&sock, Method::GET, "/v1/status")
            .await
            .expect_err("refused");
        assert!(err.to_string().contains("403"), "{err}");
    }
    stop_tx.send(()).ok();
    task.await.expect("server task");
    assert!(!sock.exists(), "socket removed on shutdown");
}

#[tokio::test]
async fn a_live_socket_is_not_stolen() {
    let dir = tempdir();
    let sock = dir.join("api.sock");
    let _first = ApiServer::bind(&sock).await.expect("bind");
    let second = ApiServer::bind(&sock).await;
    assert!(matches!(second, Err(api::server::BindError::InUse(_))));
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "egress-api-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}
