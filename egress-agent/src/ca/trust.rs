//! What a command under `exec` is told to trust when its policy intercepts: one bundle per run
//! — the host's roots, the CA files the caller already pointed its tools at, and the agent's CA
//! — named by every variable common clients read ([`CA_VARIABLES`]).
//!
//! A client that reads one of these variables takes it as *the* set of roots (except
//! `NODE_EXTRA_CA_CERTS`, which adds to node's own): so a variable the caller had set (a
//! corporate CA for pip, say) is replaced, and the certificates of the file it named go into the
//! run's bundle so nothing the caller trusted is lost. npm's `cafile` setting (global or user
//! `npmrc`, as corporate hosts have) would override the agent's CA the same way; the
//! `NPM_CONFIG_CAFILE` variable wins over any `npmrc`, and the file `cafile` named goes into the
//! bundle too. Each replacement is reported to the caller (a line on stderr).
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// A variable that names CA certificates for some clients.
#[derive(Debug, Clone, Copy)]
pub struct CaVariable {
    pub name: &'static str,
    /// Who reads it (for the documentation and the report).
    pub read_by: &'static str,
    /// It adds roots to the client's own (`NODE_EXTRA_CA_CERTS`) rather than replacing them.
    pub extra: bool,
}

const fn var(name: &'static str, read_by: &'static str) -> CaVariable {
    CaVariable {
        name,
        read_by,
        extra: false,
    }
}

/// Every variable the run sets, from a survey of common clients (docs/policy.md, "Under
/// `exec`").
pub const CA_VARIABLES: &[CaVariable] = &[
    var(
        "SSL_CERT_FILE",
        "OpenSSL, Python ssl, Go, Ruby, Rust native-tls/rustls-native-certs, uv, httpx",
    ),
    var("REQUESTS_CA_BUNDLE", "Python requests, pip, conda"),
    var("CURL_CA_BUNDLE", "curl, conda"),
    var("PIP_CERT", "pip"),
    var("NPM_CONFIG_CAFILE", "npm (wins over any npmrc `cafile`)"),
    var("npm_config_cafile", "npm"),
    var("GIT_SSL_CAINFO", "git"),
    var("CARGO_HTTP_CAINFO", "cargo"),
    var("AWS_CA_BUNDLE", "AWS CLI and SDKs"),
    var("COMPOSER_CAFILE", "Composer"),
    var("BUNDLE_SSL_CA_CERT", "Bundler"),
    var("DENO_CERT", "Deno"),
    var("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "gRPC"),
    var("HTTPLIB2_CA_CERTS", "httplib2 (gcloud, Google API clients)"),
    CaVariable {
        name: "NODE_EXTRA_CA_CERTS",
        read_by: "Node.js, Bun (added to their own roots)",
        extra: true,
    },
];

/// A CA file the caller pointed a tool at, and where it was named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallerCa {
    /// `PIP_CERT`, or `cafile in /etc/npmrc`.
    pub named_by: String,
    pub path: PathBuf,
}

/// The npm configuration files `cafile` may be set in, in npm's order of precedence (highest
/// first): the user's, then the global ones (`NPM_CONFIG_GLOBALCONFIG`, or the usual prefixes'
/// `etc/npmrc`).
fn npmrc_files(get: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut files = Vec::new();
    match get("NPM_CONFIG_USERCONFIG").or_else(|| get("npm_config_userconfig")) {
        Some(p) => files.push(PathBuf::from(p)),
        None => {
            if let Some(home) = get("HOME") {
                files.push(Path::new(&home).join(".npmrc"));
            }
        }
    }
    match get("NPM_CONFIG_GLOBALCONFIG").or_else(|| get("npm_config_globalconfig")) {
        Some(p) => files.push(PathBuf::from(p)),
        None => files.extend(
            ["/etc/npmrc", "/usr/etc/npmrc", "/usr/local/etc/npmrc"]
                .iter()
                .map(PathBuf::from),
        ),
    }
    files
}

/// `cafile` of one npmrc (`key = value` lines, `;`/`#` comments), if set.
fn npmrc_cafile(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with(';') && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| k.trim().eq_ignore_ascii_case("cafile"))
        .map(|(_, v)| v.trim().trim_matches('"').to_owned())
        .rfind(|v| !v.is_empty())
}

/// The CA files the caller's environment (`get`) names: every [`CA_VARIABLES`] entry that is
/// set, then npm's `cafile` from the first npmrc that sets it (unless a variable already sets
/// npm's). Paths are as given; [`bundle`] reads them.
pub fn caller_cas(get: &dyn Fn(&str) -> Option<String>) -> Vec<CallerCa> {
    let mut out: Vec<CallerCa> = CA_VARIABLES
        .iter()
        .filter_map(|v| {
            let path = get(v.name).filter(|p| !p.is_empty())?;
            Some(CallerCa {
                named_by: v.name.to_owned(),
                path: PathBuf::from(path),
            })
        })
        .collect();
    let npm_var = out
        .iter()
        .any(|c| c.named_by.eq_ignore_ascii_case("NPM_CONFIG_CAFILE"));
    if !npm_var {
        let found = npmrc_files(get).into_iter().find_map(|f| {
            let text = std::fs::read_to_string(&f).ok()?;
            Some((npmrc_cafile(&text)?, f))
        });
        if let Some((path, file)) = found {
            out.push(CallerCa {
                named_by: format!("cafile in {}", file.display()),
                path: PathBuf::from(path),
            });
        }
    }
    out
}

/// The run's trust files: `bundle` (system roots, the caller's CAs, the agent's CA) for the
/// variables that replace a client's roots, `extra` (the caller's `NODE_EXTRA_CA_CERTS` and the
/// agent's CA) for `NODE_EXTRA_CA_CERTS`, and what to tell the caller.
#[derive(Debug)]
pub struct RunTrust {
    pub bundle: String,
    pub extra: String,
    pub notes: Vec<String>,
}

fn pem_of(der: &CertificateDer<'_>) -> String {
    let cfg = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der.as_ref()), cfg)
}

/// Build [`RunTrust`] from the host's `roots`, the caller's CA files and the agent's CA (PEM).
/// A caller file that can't be read or holds no certificate is reported, never fatal: the
/// command then trusts the host's roots and the agent's CA, as before.
pub fn bundle(roots: &[CertificateDer<'_>], callers: &[CallerCa], agent_ca_pem: &str) -> RunTrust {
    let mut seen: BTreeSet<Vec<u8>> = BTreeSet::new();
    let mut bundle = String::new();
    let mut extra = String::new();
    let mut notes = Vec::new();
    for der in roots {
        if seen.insert(der.as_ref().to_vec()) {
            bundle.push_str(&pem_of(der));
        }
    }
    for c in callers {
        let certs: Result<Vec<CertificateDer<'static>>, _> =
            CertificateDer::pem_file_iter(&c.path).and_then(Iterator::collect);
        match certs {
            Ok(certs) if !certs.is_empty() => {
                let node_extra = c.named_by == "NODE_EXTRA_CA_CERTS";
                for der in &certs {
                    if node_extra {
                        extra.push_str(&pem_of(der));
                    }
                    if seen.insert(der.as_ref().to_vec()) {
                        bundle.push_str(&pem_of(der));
                    }
                }
                notes.push(format!(
                    "{} ({}) is replaced by the run's CA bundle, which holds its {} certificate(s), the host's roots and the agent's CA",
                    c.named_by,
                    c.path.display(),
                    certs.len()
                ));
            }
            Ok(_) => notes.push(format!(
                "{} ({}) holds no certificate: not added to the run's CA bundle",
                c.named_by,
                c.path.display()
            )),
            Err(e) => notes.push(format!(
                "{} ({}) can't be read ({e}): not added to the run's CA bundle",
                c.named_by,
                c.path.display()
            )),
        }
    }
    for s in [&mut bundle, &mut extra] {
        s.push_str(agent_ca_pem);
        if !s.ends_with('\n') {
            s.push('\n');
        }
    }
    RunTrust {
        bundle,
        extra,
        notes,
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn cert(name: &str) -> (String, Vec<u8>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let c = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (c.pem(), c.der().to_vec())
    }

    #[test]
    fn npmrc_cafile_is_read_like_npm() {
        assert_eq!(
            npmrc_cafile("registry=https://r/\n; cafile=/commented\ncafile = \"/etc/corp.pem\"\n"),
            Some("/etc/corp.pem".into())
        );
        assert_eq!(npmrc_cafile("# cafile=/x\nstrict-ssl=true\n"), None);
        assert_eq!(npmrc_cafile("cafile=\n"), None);
    }

    #[test]
    fn the_bundle_keeps_every_caller_ca_once_and_ends_with_the_agents() {
        let dir = crate::test_dir::fresh("trust");
        std::fs::create_dir_all(&dir).unwrap();
        let (corp_pem, corp_der) = cert("corp.test");
        let (node_pem, node_der) = cert("node.test");
        let (agent_pem, _) = cert("agent.test");
        std::fs::write(dir.join("corp.pem"), &corp_pem).unwrap();
        std::fs::write(dir.join("node.pem"), &node_pem).unwrap();
        std::fs::write(
            dir.join("npmrc"),
            format!("cafile={}\n", dir.join("corp.pem").display()),
        )
        .unwrap();
        std::fs::write(dir.join("empty.pem"), "").unwrap();
        let env = |k: &str| -> Option<String> {
            match k {
                "PIP_CERT" => Some(dir.join("corp.pem").display().to_string()),
                "NODE_EXTRA_CA_CERTS" => Some(dir.join("node.pem").display().to_string()),
                "GIT_SSL_CAINFO" => Some(dir.join("empty.pem").display().to_string()),
                "AWS_CA_BUNDLE" => Some(dir.join("missing.pem").display().to_string()),
                "NPM_CONFIG_GLOBALCONFIG" => Some(dir.join("npmrc").display().to_string()),
                "HOME" => Some(dir.join("nohome").display().to_string()),
                _ => None,
            }
        };
        let callers = caller_cas(&env);
        let named: Vec<&str> = callers.iter().map(|c| c.named_by.as_str()).collect();
        assert_eq!(named.len(), 5, "{named:?}");
        assert!(
            named.iter().any(|n| n.starts_with("cafile in ")),
            "{named:?}"
        );
        let root = CertificateDer::from(corp_der.clone());
        let t = bundle(&[root], &callers, &agent_pem);
        // The corporate CA (a root, PIP_CERT and npm's cafile) appears once.
        assert_eq!(t.bundle.matches(corp_pem.trim()).count(), 1, "{}", t.bundle);
        assert!(t.bundle.contains(node_pem.trim()));
        assert!(t.bundle.trim_end().ends_with(agent_pem.trim()));
        assert!(
            t.extra.contains(node_pem.trim()) && t.extra.trim_end().ends_with(agent_pem.trim())
        );
        assert!(!t.extra.contains(corp_pem.trim()));
        assert!(
            t.notes
                .iter()
                .any(|n| n.contains("GIT_SSL_CAINFO") && n.contains("no certificate"))
        );
        assert!(
            t.notes
                .iter()
                .any(|n| n.contains("AWS_CA_BUNDLE") && n.contains("can't be read"))
        );
        assert!(t.notes.iter().any(|n| n.starts_with("PIP_CERT")));
        let _ = node_der;
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_variable_for_npm_wins_over_npmrc() {
        let env =
            |k: &str| -> Option<String> { (k == "npm_config_cafile").then(|| "/x.pem".to_owned()) };
        let c = caller_cas(&env);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].named_by, "npm_config_cafile");
    }
}
