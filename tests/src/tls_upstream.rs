//! A TLS upstream the test controls, for the interception tests under `exec` and Docker: its own
//! CA (rcgen), a leaf for the names given, HTTP/1.1 and h2 by ALPN (hyper), and a record of every
//! request it received (method, target, version, headers). It answers `upstream-ok <version>
//! <path>` and reflects no request header — except under `/reflect/`, where it echoes the
//! `Authorization` value raw and hex-encoded (the agent must scrub both before the client sees
//! them).
//!
//! It runs on a thread of its own (a current-thread tokio runtime); the listening socket is bound
//! by the caller's thread or inside a network namespace ([`Upstream::start_in`]).
use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A test CA (the upstream's issuer; the agent trusts it through `intercept.upstream_ca_file`).
pub struct TestCa {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Default for TestCa {
    fn default() -> Self {
        TestCa::new()
    }
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = KeyPair::generate().expect("CA key");
        let mut p = CertificateParams::default();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "egress-tests upstream CA");
        let cert = p.self_signed(&key).expect("CA certificate");
        TestCa {
            pem: cert.pem(),
            issuer: Issuer::new(p, key),
        }
    }

    /// A leaf for `names` (DNS SANs).
    pub fn leaf(&self, names: &[&str]) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().expect("leaf key");
        let p = CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
            .expect("leaf params");
        let cert = p.signed_by(&key, &self.issuer).expect("leaf certificate");
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    /// Path and query.
    pub target: String,
    /// `HTTP/1.1`, `HTTP/2.0`.
    pub version: String,
    /// Lower-case names; `:authority` for h2.
    pub headers: Vec<(String, String)>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    /// Everything received, as text (for searching a placeholder or a secret).
    pub fn text(&self) -> String {
        let mut s = format!("{} {} {}\n", self.method, self.target, self.version);
        for (k, v) in &self.headers {
            s.push_str(&format!("{k}: {v}\n"));
        }
        s
    }
}

/// The recording upstream; stops when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Received>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstream {
    /// Listen on `addr` (port 0: any) in the caller's network namespace.
    pub fn start(ca: &TestCa, names: &[&str], addr: SocketAddr) -> Upstream {
        let l = TcpListener::bind(addr).expect("bind the upstream");
        Upstream::serve(ca, names, l)
    }

    /// Listen on `addr` inside the network namespace at `netns` (e.g. `/run/netns/<name>`).
    pub fn start_in(ca: &TestCa, names: &[&str], addr: SocketAddr, netns: &Path) -> Upstream {
        let l = crate::docker::in_netns(netns, || TcpListener::bind(addr)).expect("bind upstream");
        Upstream::serve(ca, names, l)
    }

    fn serve(ca: &TestCa, names: &[&str], l: TcpListener) -> Upstream {
        let (chain, key) = ca.leaf(names);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("upstream certificate");
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        l.set_nonblocking(true).expect("nonblocking");
        let addr = l.local_addr().expect("upstream address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let seen2 = seen.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("upstream runtime");
            rt.block_on(accept_loop(l, acceptor, seen2, stopped));
        });
        Upstream {
            addr,
            seen,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// What it has received so far.
    pub fn requests(&self) -> Vec<Received> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The request whose path starts with `path`, if it came.
    pub fn request(&self, path: &str) -> Option<Received> {
        self.requests()
            .into_iter()
            .find(|r| r.target.starts_with(path))
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            s.send(()).ok();
        }
        if let Some(t) = self.thread.take() {
            t.join().ok();
        }
    }
}

async fn accept_loop(
    l: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    seen: Arc<Mutex<Vec<Received>>>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let l = tokio::net::TcpListener::from_std(l).expect("tokio listener");
    loop {
        let (tcp, _) = tokio::select! {
            _ = &mut stopped => return,
            a = l.accept() => match a {
                Ok(a) => a,
                Err(_) => continue,
            },
        };
        let acceptor = acceptor.clone();
        let seen = seen.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
            let svc = hyper::service::service_fn(move |req| record(req, seen.clone()));
            let io = TokioIo::new(tls);
            if h2 {
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(io, svc)
                    .await
                    .ok();
            } else {
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await
                    .ok();
            }
        });
    }
}

async fn record(
    req: hyper::Request<Incoming>,
    seen: Arc<Mutex<Vec<Received>>>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let method = req.method().as_str().to_owned();
    let target = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let version = match req.version() {
        hyper::Version::HTTP_2 => "HTTP/2.0",
        hyper::Version::HTTP_10 => "HTTP/1.0",
        _ => "HTTP/1.1",
    }
    .to_owned();
    let mut headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    if let Some(a) = req.uri().authority() {
        headers.push((":authority".to_owned(), a.as_str().to_owned()));
    }
    let path = req.uri().path().to_owned();
    let reflected = path.starts_with("/reflect/").then(|| {
        let v = req
            .headers()
            .get("authorization")
            .map(|v| v.as_bytes().to_vec())
            .unwrap_or_default();
        let hex: String = v.iter().map(|b| format!("{b:02x}")).collect();
        format!(" auth=[{}] hex=[{hex}]", String::from_utf8_lossy(&v))
    });
    // Read the body to its end (not kept).
    let mut body = req.into_body();
    while let Some(Ok(_)) = body.frame().await {}
    seen.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(Received {
            method,
            target,
            version: version.clone(),
            headers,
        });
    Ok(hyper::Response::new(Full::new(Bytes::from(format!(
        "upstream-ok {version} {path}{}\n",
        reflected.unwrap_or_default()
    )))))
}
