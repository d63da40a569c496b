//! The agent's interception CA: created on first start (rcgen, ECDSA P-256), kept in
//! `agent.state_dir` across restarts, and the leaf certificates it signs for intercepted hosts.
//!
//! Files (see [`file`] for how they are written):
//! - `ca-key.pem` — the CA's private key, **0600**, written atomically; a key file readable by
//!   group/others is refused at load, not silently used.
//! - `ca.pem` — the CA certificate (0644): what clients must trust (`NODE_EXTRA_CA_CERTS`).
//! - `ca-bundle.pem` — the system roots plus the agent CA (0644), for clients that take one
//!   bundle (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`); rewritten at each start.
//! - `ca.lock` — `flock` so a daemon and an `exec` starting together agree on one CA.
//!
//! The CA is trusted only by the confined clients it is handed to (never installed on the host).
//! It has `pathLenConstraint = 0` and signs only leaf certificates for names the policy
//! intercepts, valid [`LEAF_VALIDITY_DAYS`] days (cached per name by the proxy).
pub mod file;
pub mod trust;

use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

pub use file::FileError;

/// Default `agent.state_dir`.
pub const DEFAULT_STATE_DIR: &str = crate::config::DEFAULT_STATE_DIR;
pub const KEY_FILE: &str = "ca-key.pem";
pub const CERT_FILE: &str = "ca.pem";
pub const BUNDLE_FILE: &str = "ca-bundle.pem";
const LOCK_FILE: &str = "ca.lock";
/// Leaf certificates are valid this long (and re-issued by the proxy's cache well before).
pub const LEAF_VALIDITY_DAYS: i64 = 30;
const CA_VALIDITY_DAYS: i64 = 3650;
const CA_NAME: &str = "egress-agent interception CA";

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: not a usable CA key: {why}")]
    BadKey { path: PathBuf, why: String },
    #[error("{path}: not the certificate of {key}")]
    Mismatch { path: PathBuf, key: PathBuf },
    #[error("issuing a certificate: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("locking {path}: {errno}")]
    Lock { path: PathBuf, errno: nix::Error },
}

/// The loaded CA.
pub struct AgentCa {
    dir: PathBuf,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for AgentCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentCa")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    dn.push(DnType::OrganizationName, "egress-agent");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

impl AgentCa {
    /// Load the CA from `state_dir`, creating the directory (0700) and a new CA on first use.
    pub fn load_or_create(state_dir: &Path) -> Result<AgentCa, CaError> {
        file::ensure_private_dir(state_dir)?;
        let lock_path = state_dir.join(LOCK_FILE);
        // 0600 whatever the umask (an empty file; only its flock matters).
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|source| FileError::Io {
                path: lock_path.clone(),
                source,
            })?;
        let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).map_err(
            |(_, errno)| CaError::Lock {
                path: lock_path.clone(),
                errno,
            },
        )?;
        let key_path = state_dir.join(KEY_FILE);
        let cert_path = state_dir.join(CERT_FILE);
        let ca = if key_path.exists() && cert_path.exists() {
            Self::load(state_dir, &key_path, &cert_path)?
        } else {
            Self::create(state_dir)?
        };
        ca.write_bundle()?;
        Ok(ca)
    }

    fn load(dir: &Path, key_path: &Path, cert_path: &Path) -> Result<AgentCa, CaError> {
        let key_pem = file::read_private(key_path)?;
        let bad = |why: String| CaError::BadKey {
            path: key_path.to_owned(),
            why,
        };
        let key_pem = std::str::from_utf8(&key_pem).map_err(|_| bad("not PEM text".into()))?;
        let key = KeyPair::from_pem(key_pem).map_err(|e| bad(e.to_string()))?;
        let cert_pem = std::fs::read_to_string(cert_path).map_err(|source| FileError::Io {
            path: cert_path.to_owned(),
            source,
        })?;
        let mismatch = || CaError::Mismatch {
            path: cert_path.to_owned(),
            key: key_path.to_owned(),
        };
        let der = pem::parse(&cert_pem)
            .map_err(|_| mismatch())?
            .into_contents();
        // The certificate must carry this key (its SubjectPublicKeyInfo bit string).
        let pk = key.public_key_raw();
        if pk.is_empty() || !der.windows(pk.len()).any(|w| w == pk) {
            return Err(mismatch());
        }
        Ok(AgentCa {
            dir: dir.to_owned(),
            cert_pem,
            cert_der: CertificateDer::from(der),
            issuer: Issuer::new(ca_params(), key),
        })
    }

    fn create(dir: &Path) -> Result<AgentCa, CaError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params();
        params.not_before = now() - time::Duration::hours(1);
        params.not_after = now() + time::Duration::days(CA_VALIDITY_DAYS);
        let cert = params.self_signed(&key)?;
        let key_pem = zeroize::Zeroizing::new(key.serialize_pem());
        file::write_atomic(dir, KEY_FILE, key_pem.as_bytes(), 0o600)?;
        let cert_pem = cert.pem();
        file::write_atomic(dir, CERT_FILE, cert_pem.as_bytes(), 0o644)?;
        tracing::info!(dir = %dir.display(), "created the interception CA");
        Ok(AgentCa {
            dir: dir.to_owned(),
            cert_pem,
            cert_der: cert.der().clone(),
            issuer: Issuer::new(ca_params(), key),
        })
    }

    fn write_bundle(&self) -> Result<(), CaError> {
        file::write_atomic(
            &self.dir,
            BUNDLE_FILE,
            client_bundle_pem(&self.cert_pem).as_bytes(),
            0o644,
        )?;
        Ok(())
    }

    /// `state_dir/ca.pem`.
    pub fn cert_path(&self) -> PathBuf {
        self.dir.join(CERT_FILE)
    }

    /// `state_dir/ca-bundle.pem` (system roots + this CA).
    pub fn bundle_path(&self) -> PathBuf {
        self.dir.join(BUNDLE_FILE)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The system roots followed by this CA (what `ca-bundle.pem` holds).
    pub fn client_bundle_pem(&self) -> String {
        client_bundle_pem(&self.cert_pem)
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// A leaf certificate for `host` (DNS SAN), signed by this CA: chain (leaf, CA) and key.
    pub fn issue_leaf(
        &self,
        host: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), CaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![host.to_owned()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.not_before = now() - time::Duration::hours(1);
        params.not_after = now() + time::Duration::days(LEAF_VALIDITY_DAYS);
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone(), self.cert_der.clone()], key_der))
    }
}

/// The host's trusted roots (rustls-native-certs: the distribution's store, e.g.
/// `/etc/ssl/certs/ca-certificates.crt`, or `SSL_CERT_FILE`/`SSL_CERT_DIR` of the agent), read
/// once. Used to verify upstreams and to build the clients' bundle, so both trust the same roots.
pub fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let r = rustls_native_certs::load_native_certs();
        for e in &r.errors {
            tracing::warn!(error = %e, "reading the system's trusted roots");
        }
        r.certs
    })
}

/// PEM of the system roots followed by the agent CA: the bundle a confined client trusts.
pub fn client_bundle_pem(ca_pem: &str) -> String {
    let cfg = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    let mut out = String::new();
    for der in system_roots() {
        out.push_str(&pem::encode_config(
            &pem::Pem::new("CERTIFICATE", der.as_ref()),
            cfg,
        ));
    }
    out.push_str(ca_pem);
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// The environment a confined command needs for interception: every CA variable of
/// [`trust::CA_VARIABLES`] (pointing at `bundle`, or `extra` for `NODE_EXTRA_CA_CERTS`, as the
/// command sees them) and, for each credential binding of `policy` that names a
/// `placeholder_env`, that variable set to the placeholder. Empty when the policy intercepts
/// nothing.
pub fn command_env(
    policy: &egress_policy::Policy,
    bundle: &Path,
    extra: &Path,
) -> Vec<(String, String)> {
    if !policy.intercepts_some_host() {
        return Vec::new();
    }
    let mut env: Vec<(String, String)> = trust::CA_VARIABLES
        .iter()
        .map(|v| {
            let file = if v.extra { extra } else { bundle };
            (v.name.to_owned(), file.display().to_string())
        })
        .collect();
    for b in &policy.credentials {
        if let (Some(var), Some(ph)) = (&b.placeholder_env, &b.placeholder) {
            env.push((var.clone(), ph.clone()));
        }
    }
    env
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn command_env_names_the_ca_files_and_placeholders() {
        let c = crate::config::Config::from_toml_str(
            "[policies.p]\nallow_hosts = [\"a.test\"]\n[[policies.p.request_rules]]\nhost = \"a.test\"\naction = \"deny\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let env = command_env(
            c.policy("p").unwrap(),
            Path::new("/run/b.pem"),
            Path::new("/run/ca.pem"),
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("SSL_CERT_FILE"), Some("/run/b.pem"));
        assert_eq!(get("REQUESTS_CA_BUNDLE"), Some("/run/b.pem"));
        for v in [
            "PIP_CERT",
            "NPM_CONFIG_CAFILE",
            "GIT_SSL_CAINFO",
            "CARGO_HTTP_CAINFO",
            "AWS_CA_BUNDLE",
        ] {
            assert_eq!(get(v), Some("/run/b.pem"), "{v}");
        }
        assert_eq!(get("NODE_EXTRA_CA_CERTS"), Some("/run/ca.pem"));
        // A policy that intercepts nothing needs nothing.
        assert!(
            command_env(
                &egress_policy::Policy::allow_all(),
                Path::new("/b"),
                Path::new("/c")
            )
            .is_empty()
        );
    }

    #[test]
    fn bundle_ends_with_the_agent_ca() {
        let dir = crate::test_dir::fresh("ca-unit");
        let ca = AgentCa::load_or_create(&dir).unwrap();
        let b = ca.client_bundle_pem();
        assert!(b.ends_with(ca.cert_pem()) || b.ends_with(&format!("{}\n", ca.cert_pem())));
        let (chain, _) = ca.issue_leaf("api.test").unwrap();
        assert_eq!(chain.len(), 2);
        assert_eq!(&chain[1], ca.cert_der());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The CA's files in the state directory and their modes, as docs/operations.md's "State
    /// directory" table lists them (whatever the umask: the test process's is usually 0022).
    #[test]
    fn state_dir_files_have_the_documented_modes() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("egress-ca-modes-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        AgentCa::load_or_create(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        let mut found: Vec<(String, u32)> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    mode(&e.path()),
                )
            })
            .collect();
        found.sort();
        let expected = [
            (BUNDLE_FILE, 0o644),
            (KEY_FILE, 0o600),
            (LOCK_FILE, 0o600),
            (CERT_FILE, 0o644),
        ];
        let expected: Vec<(String, u32)> = expected
            .iter()
            .map(|(n, m)| ((*n).to_owned(), *m))
            .collect();
        assert_eq!(found, expected);
        std::fs::remove_dir_all(&dir).ok();
    }
}
