//! A Docker API socket in front of a test's dockerd that can refuse container inspects
//! (`GET /v…/containers/{id}/json` answered `500`), for the agent's fail-closed branch when
//! Docker answers its events but not the inspect that completes them.
//!
//! Every other request goes through to the real socket unchanged, except that it asks for
//! `Connection: close`: one request per connection, so each one is seen here (a kept-alive
//! connection would carry later requests past the check).
use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct DockerFault {
    path: PathBuf,
    failing: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl DockerFault {
    /// Serve on `path` (replaced), forwarding to the real API socket `real`.
    pub fn start(real: &Path, path: &Path) -> DockerFault {
        std::fs::remove_file(path).ok();
        let listener = UnixListener::bind(path).expect("bind the fault socket");
        listener.set_nonblocking(true).expect("nonblocking");
        let f = DockerFault {
            path: path.to_owned(),
            failing: Arc::new(AtomicBool::new(false)),
            refused: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (failing, refused, stop) = (f.failing.clone(), f.refused.clone(), f.stop.clone());
        let real = real.to_owned();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let (real, failing, refused) =
                            (real.clone(), failing.clone(), refused.clone());
                        std::thread::spawn(move || serve(client, &real, &failing, &refused));
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        });
        f
    }

    /// The `--docker-socket` value for the agent.
    pub fn host(&self) -> String {
        format!("unix://{}", self.path.display())
    }

    /// Refuse every container inspect from now on (`true`), or none.
    pub fn set_failing(&self, on: bool) {
        self.failing.store(on, Ordering::SeqCst);
    }

    /// How many inspects were refused so far.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for DockerFault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        std::fs::remove_file(&self.path).ok();
    }
}

/// `GET /v1.47/containers/<id>/json` (with or without a query).
fn is_inspect(request_line: &str) -> bool {
    let mut parts = request_line.split(' ');
    let (Some("GET"), Some(target)) = (parts.next(), parts.next()) else {
        return false;
    };
    let path = target.split('?').next().unwrap_or("");
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let versioned = segments.first().is_some_and(|v| v.starts_with('v'));
    let rest = if versioned {
        &segments[1..]
    } else {
        &segments[..]
    };
    matches!(rest, ["containers", id, "json"] if !id.is_empty())
}

fn serve(mut client: UnixStream, real: &Path, failing: &AtomicBool, refused: &AtomicUsize) {
    let mut head = Vec::new();
    let mut buf = [0u8; 8192];
    let end = loop {
        let Ok(n) = client.read(&mut buf) else { return };
        if n == 0 {
            return;
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if head.len() > 64 * 1024 {
            return;
        }
    };
    let text = String::from_utf8_lossy(&head[..end]).into_owned();
    let first = text.lines().next().unwrap_or("");
    if failing.load(Ordering::SeqCst) && is_inspect(first) {
        refused.fetch_add(1, Ordering::SeqCst);
        let body = r#"{"message":"injected by the test: inspect refused"}"#;
        let answer = format!(
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        client.write_all(answer.as_bytes()).ok();
        return;
    }
    let mut forwarded = String::new();
    for line in text.trim_end_matches("\r\n").split("\r\n") {
        if !line.to_ascii_lowercase().starts_with("connection:") {
            forwarded.push_str(line);
            forwarded.push_str("\r\n");
        }
    }
    forwarded.push_str("Connection: close\r\n\r\n");
    let Ok(mut upstream) = UnixStream::connect(real) else {
        return;
    };
    if upstream.write_all(forwarded.as_bytes()).is_err()
        || upstream.write_all(&head[end..]).is_err()
    {
        return;
    }
    let (Ok(mut client_in), Ok(mut upstream_out)) = (client.try_clone(), upstream.try_clone())
    else {
        return;
    };
    // The request's body (if any) and the client's close; the answer runs until dockerd closes.
    std::thread::spawn(move || {
        std::io::copy(&mut client_in, &mut upstream_out).ok();
        upstream_out.shutdown(std::net::Shutdown::Write).ok();
    });
    std::io::copy(&mut upstream, &mut client).ok();
    client.shutdown(std::net::Shutdown::Both).ok();
}

#[cfg(test)]
mod tests {
    use super::is_inspect;

    #[test]
    fn inspects_are_recognised() {
        assert!(is_inspect("GET /v1.47/containers/abc/json HTTP/1.1"));
        assert!(is_inspect("GET /containers/abc/json?size=false HTTP/1.1"));
        assert!(!is_inspect("GET /v1.47/containers/json HTTP/1.1"));
        assert!(!is_inspect("GET /v1.47/networks/abc HTTP/1.1"));
        assert!(!is_inspect("POST /v1.47/containers/abc/stop HTTP/1.1"));
    }
}
