//! TLS for interception: the client-facing server configs (a leaf per intercepted name, signed by
//! the agent CA, cached) and the upstream client configs (verified against the system roots plus
//! an optional configured CA), with ALPN carried end to end.
//!
//! ALPN: the client's offer (only `h2` and `http/1.1` are kept, in its order) is what the proxy
//! offers the upstream; the protocol the upstream picks is the only one offered back to the
//! client. So both legs always speak the same HTTP version and nothing is translated.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::ca::{self, AgentCa, CaError};
use crate::config::Config;

/// The HTTP version of an intercepted connection (both legs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    H2,
    Http1,
}

impl Proto {
    fn alpn(self) -> &'static [u8] {
        match self {
            Proto::H2 => b"h2",
            Proto::Http1 => b"http/1.1",
        }
    }
    fn from_alpn(a: &[u8]) -> Option<Proto> {
        match a {
            b"h2" => Some(Proto::H2),
            b"http/1.1" => Some(Proto::Http1),
            _ => None,
        }
    }
}

/// What the client offered (ALPN), in its order, limited to what the proxy speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Offer {
    /// No ALPN extension: HTTP/1.1.
    None,
    H2First,
    Http1First,
    H2Only,
    Http1Only,
}

impl Offer {
    pub fn from_hello(hello: &ClientHello<'_>) -> Offer {
        let Some(list) = hello.alpn() else {
            return Offer::None;
        };
        let known: Vec<Proto> = list.filter_map(Proto::from_alpn).collect();
        match known.as_slice() {
            [] => Offer::None,
            [Proto::H2] => Offer::H2Only,
            [Proto::Http1] => Offer::Http1Only,
            [Proto::H2, ..] => Offer::H2First,
            [Proto::Http1, ..] => Offer::Http1First,
        }
    }
    fn list(self) -> Vec<Vec<u8>> {
        let v: &[Proto] = match self {
            Offer::None | Offer::Http1Only => &[Proto::Http1],
            Offer::H2First => &[Proto::H2, Proto::Http1],
            Offer::Http1First => &[Proto::Http1, Proto::H2],
            Offer::H2Only => &[Proto::H2],
        };
        v.iter().map(|p| p.alpn().to_vec()).collect()
    }
    const ALL: [Offer; 5] = [
        Offer::None,
        Offer::H2First,
        Offer::Http1First,
        Offer::H2Only,
        Offer::Http1Only,
    ];
}

#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("intercept.upstream_ca_file {path}: {why}")]
    UpstreamCa { path: PathBuf, why: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("upstream verifier: {0}")]
    Verifier(String),
}

/// Whether TLS interception can be set up (the agent's CA, the upstream roots), as the last
/// attempt found: `None` while it works (or was never needed). Shared by the proxy contexts of
/// one daemon (every runtime's) and read by `status` and `doctor`. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct InterceptHealth(Arc<Mutex<HealthState>>);

#[derive(Debug, Default)]
struct HealthState {
    error: Option<String>,
    /// The last failed attempt (a retry waits [`RETRY_AFTER`] after it).
    failed_at: Option<Instant>,
}

/// How long after a failed setup the next connection that needs interception tries again (the
/// CA files, the roots are read each time): what a fix of the files waits at most.
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl InterceptHealth {
    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why interception can't be set up, if the last attempt failed.
    pub fn error(&self) -> Option<String> {
        self.lock().error.clone()
    }

    /// A setup attempt worked.
    pub(crate) fn ok(&self) {
        let mut s = self.lock();
        s.error = None;
        s.failed_at = None;
    }

    /// A setup attempt failed with `e`; true when that is news (the first failure, or another
    /// error than the last one), so it is logged once.
    pub(crate) fn failed(&self, e: &TlsSetupError) -> bool {
        let mut s = self.lock();
        let e = e.to_string();
        let news = s.error.as_deref() != Some(e.as_str());
        s.error = Some(e);
        s.failed_at = Some(Instant::now());
        news
    }

    /// Is it time to try again (nothing failed, or the last failure is [`RETRY_AFTER`] old)?
    pub(crate) fn may_retry(&self) -> bool {
        self.lock()
            .failed_at
            .is_none_or(|t| t.elapsed() >= RETRY_AFTER)
    }
}

/// What interception needs from the configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct InterceptSettings {
    pub state_dir: PathBuf,
    pub upstream_ca_file: Option<PathBuf>,
    pub leaf_cache_entries: usize,
    /// `intercept.scrub_responses`.
    pub scrub_responses: bool,
}

impl InterceptSettings {
    pub fn from_config(c: &Config) -> InterceptSettings {
        if !c.intercept.scrub_responses {
            tracing::warn!(
                "intercept.scrub_responses = false: an upstream that echoes a request hands the real secret to the sandbox"
            );
        }
        InterceptSettings {
            state_dir: c.agent.state_dir.clone(),
            upstream_ca_file: c.intercept.upstream_ca_file.clone(),
            leaf_cache_entries: c.intercept.leaf_cache_entries,
            scrub_responses: c.intercept.scrub_responses,
        }
    }
}

/// A leaf is re-issued once it is this old (it is valid for `ca::LEAF_VALIDITY_DAYS`).
const LEAF_REISSUE_AFTER: Duration = Duration::from_secs(24 * 3600);

struct Leaf {
    issued: Instant,
    /// Server configs by the ALPN protocol offered to the client (`None`: no ALPN).
    configs: HashMap<Option<Proto>, Arc<ServerConfig>>,
    key: Arc<CertifiedKey>,
}

#[derive(Debug)]
struct OneCert(Arc<CertifiedKey>);

impl ResolvesServerCert for OneCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// CA, leaf cache and upstream configs: one per proxy context.
pub struct Interceptor {
    ca: AgentCa,
    provider: Arc<CryptoProvider>,
    leaves: Mutex<HashMap<String, Leaf>>,
    max_leaves: usize,
    upstream: HashMap<Offer, TlsConnector>,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

fn upstream_roots(extra: Option<&Path>) -> Result<RootCertStore, TlsSetupError> {
    let mut roots = RootCertStore::empty();
    let (_, ignored) = roots.add_parsable_certificates(ca::system_roots().iter().cloned());
    if ignored > 0 {
        tracing::debug!(ignored, "system roots rustls can't use");
    }
    if let Some(path) = extra {
        let bad = |why: String| TlsSetupError::UpstreamCa {
            path: path.to_owned(),
            why,
        };
        let text = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let pems = pem::parse_many(&text).map_err(|e| bad(e.to_string()))?;
        let certs: Vec<CertificateDer<'static>> = pems
            .into_iter()
            .filter(|p| p.tag() == "CERTIFICATE")
            .map(|p| CertificateDer::from(p.into_contents()))
            .collect();
        if certs.is_empty() {
            return Err(bad("no CERTIFICATE in the file".into()));
        }
        for c in certs {
            roots.add(c).map_err(|e| bad(e.to_string()))?;
        }
    }
    Ok(roots)
}

impl Interceptor {
    pub fn new(s: &InterceptSettings) -> Result<Interceptor, TlsSetupError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca = AgentCa::load_or_create(&s.state_dir)?;
        let roots = Arc::new(upstream_roots(s.upstream_ca_file.as_deref())?);
        let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| TlsSetupError::Verifier(e.to_string()))?;
        let mut upstream = HashMap::new();
        for offer in Offer::ALL {
            let mut cfg = ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()?
                .with_webpki_verifier(verifier.clone())
                .with_no_client_auth();
            cfg.alpn_protocols = offer.list();
            upstream.insert(offer, TlsConnector::from(Arc::new(cfg)));
        }
        Ok(Interceptor {
            ca,
            provider,
            leaves: Mutex::new(HashMap::new()),
            max_leaves: s.leaf_cache_entries.max(1),
            upstream,
        })
    }

    pub fn ca(&self) -> &AgentCa {
        &self.ca
    }

    /// The client-facing config for `host`, offering `proto` (or no ALPN).
    pub fn server_config(
        &self,
        host: &str,
        proto: Option<Proto>,
    ) -> Result<Arc<ServerConfig>, TlsSetupError> {
        let mut leaves = self
            .leaves
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if leaves
            .get(host)
            .is_some_and(|l| l.issued.elapsed() > LEAF_REISSUE_AFTER)
        {
            leaves.remove(host);
        }
        if !leaves.contains_key(host) {
            if leaves.len() >= self.max_leaves {
                // Bounded: drop the oldest (the cache is small and re-issuing is cheap).
                if let Some(oldest) = leaves
                    .iter()
                    .min_by_key(|(_, l)| l.issued)
                    .map(|(k, _)| k.clone())
                {
                    leaves.remove(&oldest);
                }
            }
            let (chain, key) = self.ca.issue_leaf(host)?;
            let key = Arc::new(CertifiedKey::from_der(chain, key, &self.provider)?);
            leaves.insert(
                host.to_owned(),
                Leaf {
                    issued: Instant::now(),
                    configs: HashMap::new(),
                    key,
                },
            );
        }
        let Some(leaf) = leaves.get_mut(host) else {
            return Err(TlsSetupError::Verifier("leaf cache".into()));
        };
        if let Some(c) = leaf.configs.get(&proto) {
            return Ok(c.clone());
        }
        let mut cfg = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(OneCert(leaf.key.clone())));
        cfg.alpn_protocols = proto.map(|p| vec![p.alpn().to_vec()]).unwrap_or_default();
        let cfg = Arc::new(cfg);
        leaf.configs.insert(proto, cfg.clone());
        Ok(cfg)
    }

    /// TLS to the upstream for `host`, offering `offer`; the protocol it chose.
    pub async fn connect_upstream(
        &self,
        tcp: TcpStream,
        host: &str,
        offer: Offer,
    ) -> std::io::Result<(TlsStream<TcpStream>, Proto)> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let connector = self
            .upstream
            .get(&offer)
            .ok_or_else(|| std::io::Error::other("no upstream config"))?;
        let tls = connector.connect(name, tcp).await?;
        let proto = tls
            .get_ref()
            .1
            .alpn_protocol()
            .and_then(Proto::from_alpn)
            .unwrap_or(Proto::Http1);
        Ok((tls, proto))
    }
}

/// The offer that asks for exactly `proto` (re-dials keep the connection's version).
pub fn offer_for(proto: Proto) -> Offer {
    match proto {
        Proto::H2 => Offer::H2Only,
        Proto::Http1 => Offer::Http1Only,
    }
}
