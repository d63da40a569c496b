//! `[requests] webhook`: where new access requests are announced (a chat tool's incoming
//! webhook), and the checks of its URL. The delivery is [`crate::asks::webhook`].
//!
//! A chat webhook's URL is a secret (whoever holds it posts to the channel), so it may come from a
//! file, a systemd credential or an environment variable as well as inline — the sources of a
//! credential binding ([`SecretSource`], loaded by [`crate::secrets::load`]). Nothing here puts the
//! URL in an error message or a `Debug` output.
use std::net::IpAddr;
use std::path::PathBuf;

use egress_policy::ValidationError;
use egress_policy::model::verr;
use egress_policy::secret::SecretSource;
use rustls::pki_types::CertificateDer;
use serde::{Deserialize, Serialize};

/// Default of `timeout_ms`.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;
/// The longest `timeout_ms` accepted.
pub const MAX_TIMEOUT_MS: u64 = 60_000;

/// `[requests.webhook]` (or `webhook = { url = ..., ... }`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// `"https://..."`, or `{ file = "/path" }`, `{ credential = "name" }`, `{ env = "VAR" }`.
    pub url: WebhookUrl,
    /// PEM file of extra CAs trusted for the webhook's certificate (beside the system's roots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// How long one delivery may take (connect, TLS, answer), in milliseconds. Default 5000.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}

/// The webhook's URL: inline, or from a secret source.
#[derive(Clone, PartialEq, Eq)]
pub enum WebhookUrl {
    Inline(String),
    Source(SecretSource),
}

impl std::fmt::Debug for WebhookUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WebhookUrl::Inline(_) => f.write_str("Inline(<redacted>)"),
            WebhookUrl::Source(s) => f.debug_tuple("Source").field(s).finish(),
        }
    }
}

impl Serialize for WebhookUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            WebhookUrl::Inline(u) => s.serialize_str(u),
            WebhookUrl::Source(src) => src.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for WebhookUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = WebhookUrl;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a URL (\"https://...\") or where to read it: { file = \"/path\" }, \
                     { credential = \"name\" } or { env = \"VAR\" }",
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<WebhookUrl, E> {
                Ok(WebhookUrl::Inline(v.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<WebhookUrl, A::Error> {
                SecretSource::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(WebhookUrl::Source)
            }
        }
        d.deserialize_any(V)
    }
}

/// A checked webhook URL. Its `Debug` names the host alone (the path is the secret part).
#[derive(Clone, PartialEq, Eq)]
pub struct Url {
    pub https: bool,
    /// Host name or IP address (no brackets).
    pub host: String,
    pub port: u16,
    /// Path and query (`/` when none).
    pub path: String,
}

impl std::fmt::Debug for Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Url")
            .field("https", &self.https)
            .field("host", &self.host)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl Url {
    /// The `Host` header's value.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Is `host` (of a URL) a loopback address or `localhost`?
pub fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Check a webhook URL. The error never quotes it (it is a secret).
pub fn parse_url(s: &str) -> Result<Url, String> {
    let uri: http::Uri = s.trim().parse().map_err(|_| {
        "not a URL: expected https://host/path (as the chat tool gave it)".to_owned()
    })?;
    let https = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => {
            return Err("must start with https:// (http:// only to a loopback address)".to_owned());
        }
    };
    let authority = uri
        .authority()
        .ok_or_else(|| "has no host: expected https://host/path".to_owned())?;
    if authority.as_str().contains('@') {
        return Err(
            "must not carry user:password@ (a chat webhook's secret is its path; \
                    put the URL in a file: url = { file = \"...\" })"
                .to_owned(),
        );
    }
    let host = authority.host().trim_matches(['[', ']']).to_owned();
    if host.is_empty() {
        return Err("has no host: expected https://host/path".to_owned());
    }
    if !https && !is_loopback(&host) {
        return Err(
            "must be https:// (plain http:// is accepted only to a loopback address: \
                    127.0.0.1, [::1], localhost)"
                .to_owned(),
        );
    }
    let path = match uri.path_and_query().map(|p| p.as_str()) {
        None | Some("") => "/".to_owned(),
        Some(p) => p.to_owned(),
    };
    Ok(Url {
        https,
        port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
        host,
        path,
    })
}

/// What a delivery needs: the URL read and checked, the extra CAs read.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub url: Url,
    pub extra_roots: Vec<CertificateDer<'static>>,
    pub timeout: std::time::Duration,
}

impl WebhookConfig {
    /// The checks that need no file: fields are named as `field` (`requests.webhook`).
    pub fn validate(&self, field: &str) -> Result<(), ValidationError> {
        if let WebhookUrl::Inline(u) = &self.url {
            parse_url(u).map_err(|m| verr(format!("{field}.url"), m))?;
        }
        if !(1..=MAX_TIMEOUT_MS).contains(&self.timeout_ms) {
            return Err(verr(
                format!("{field}.timeout_ms"),
                format!("must be between 1 and {MAX_TIMEOUT_MS} (default {DEFAULT_TIMEOUT_MS})"),
            ));
        }
        if let Some(p) = &self.ca_file
            && !p.is_absolute()
        {
            return Err(verr(
                format!("{field}.ca_file"),
                "must be an absolute path to a PEM file",
            ));
        }
        Ok(())
    }

    /// Read the URL (from its source) and the CA file, and check them. Errors name the field and
    /// the source, never the URL.
    pub fn resolve(&self, field: &str) -> Result<Resolved, ValidationError> {
        let url = match &self.url {
            WebhookUrl::Inline(u) => u.clone(),
            WebhookUrl::Source(src) => {
                let secret = crate::secrets::load(src)
                    .map_err(|e| verr(format!("{field}.url"), e.to_string()))?;
                String::from_utf8(secret.expose().to_vec()).map_err(|_| {
                    verr(
                        format!("{field}.url"),
                        format!("{} holds no UTF-8 URL", super::source_label(src)),
                    )
                })?
            }
        };
        let url = parse_url(&url).map_err(|m| {
            let from = match &self.url {
                WebhookUrl::Inline(_) => String::new(),
                WebhookUrl::Source(src) => format!(" (read from {})", super::source_label(src)),
            };
            verr(format!("{field}.url"), format!("{m}{from}"))
        })?;
        let extra_roots = match &self.ca_file {
            None => Vec::new(),
            Some(path) => read_pem_certs(path).map_err(|m| {
                verr(
                    format!("{field}.ca_file"),
                    format!("{}: {m}", path.display()),
                )
            })?,
        };
        Ok(Resolved {
            url,
            extra_roots,
            timeout: std::time::Duration::from_millis(self.timeout_ms),
        })
    }
}

/// Every `CERTIFICATE` of a PEM file (at least one).
fn read_pem_certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let text = std::fs::read(path).map_err(|e| e.to_string())?;
    let certs: Vec<CertificateDer<'static>> = pem::parse_many(&text)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|p| p.tag() == "CERTIFICATE")
        .map(|p| CertificateDer::from(p.into_contents()))
        .collect();
    if certs.is_empty() {
        return Err("no CERTIFICATE in the file".to_owned());
    }
    Ok(certs)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    const SECRET_PATH: &str = "T000/B000/very-secret-token";

    fn load(toml: &str) -> Result<Config, String> {
        Config::from_toml_str(toml, Path::new("/etc/egress-agent/config.toml"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn urls() {
        let u = parse_url("https://hooks.slack.com/services/T0/B0/x?a=1").unwrap();
        assert_eq!(
            (u.https, u.host.as_str(), u.port, u.path.as_str()),
            (true, "hooks.slack.com", 443, "/services/T0/B0/x?a=1")
        );
        let u = parse_url("http://[::1]:8065/hooks/abc").unwrap();
        assert_eq!((u.https, u.host.as_str(), u.port), (false, "::1", 8065));
        assert_eq!(u.authority(), "[::1]:8065");
        assert!(parse_url("http://localhost/x").is_ok());
        assert!(parse_url("http://127.0.0.2:9/x").is_ok());
        assert_eq!(parse_url("https://h.test").unwrap().path, "/");
        for bad in [
            "http://hooks.slack.com/services/x",
            "http://10.0.0.1/x",
            "https://user:pw@hooks.test/x",
            "ftp://hooks.test/x",
            "hooks.test/x",
            "",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        let e = parse_url(&format!("http://hooks.test/{SECRET_PATH}")).unwrap_err();
        assert!(!e.contains(SECRET_PATH), "{e}");
        assert!(format!("{u:?}").contains("::1") && !format!("{u:?}").contains("hooks/abc"));
    }

    #[test]
    fn config_shapes_and_errors_name_the_field() {
        let c = load(
            "[requests.webhook]\nurl = { file = \"/etc/egress-agent/webhook-url\" }\nca_file = \"/etc/ca.pem\"\n",
        )
        .unwrap();
        let w = c.requests.webhook.as_ref().unwrap();
        assert_eq!(
            w.url,
            WebhookUrl::Source(SecretSource::File("/etc/egress-agent/webhook-url".into()))
        );
        assert_eq!(w.timeout_ms, DEFAULT_TIMEOUT_MS);
        let c = load(
            "[requests]\nwebhook = { url = { credential = \"webhook\" }, timeout_ms = 2000 }\n",
        )
        .unwrap();
        assert_eq!(c.requests.webhook.unwrap().timeout_ms, 2000);
        let inline = format!("[requests.webhook]\nurl = \"https://hooks.test/{SECRET_PATH}\"\n");
        let c = load(&inline).unwrap();
        assert!(
            !format!("{c:?}").contains(SECRET_PATH),
            "Debug shows the URL"
        );
        // Round trip (what writes a configuration back).
        let again: Config = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);

        for (toml, field, says) in [
            (
                format!("[requests.webhook]\nurl = \"http://hooks.test/{SECRET_PATH}\"\n"),
                "requests.webhook.url",
                "https://",
            ),
            (
                format!("[requests.webhook]\nurl = \"https://u:p@hooks.test/{SECRET_PATH}\"\n"),
                "requests.webhook.url",
                "user:password@",
            ),
            (
                "[requests.webhook]\nurl = \"https://h.test/x\"\ntimeout_ms = 0\n".to_owned(),
                "requests.webhook.timeout_ms",
                "between 1 and",
            ),
            (
                "[requests.webhook]\nurl = \"https://h.test/x\"\nca_file = \"ca.pem\"\n".to_owned(),
                "requests.webhook.ca_file",
                "absolute",
            ),
            (
                "[requests.webhook]\nurl = \"https://h.test/x\"\nretries = 3\n".to_owned(),
                "retries",
                "unknown field",
            ),
            (
                "[requests.webhook]\nurl = { path = \"/x\" }\n".to_owned(),
                "path",
                "unknown variant",
            ),
            (
                "[requests.webhook]\nurl = 3\n".to_owned(),
                "requests.webhook.url",
                "{ file = ",
            ),
        ] {
            let e = load(&toml).unwrap_err();
            assert!(e.contains(field) && e.contains(says), "{toml}: {e}");
            assert!(!e.contains(SECRET_PATH), "the error quotes the URL: {e}");
        }
    }

    #[test]
    fn resolve_reads_the_source_and_checks_what_it_holds() {
        let dir = crate::test_dir::fresh("webhook-cfg");
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("url");
        let cfg = |ca: Option<PathBuf>| WebhookConfig {
            url: WebhookUrl::Source(SecretSource::File(f.clone())),
            ca_file: ca,
            timeout_ms: 1500,
        };
        let e = cfg(None).resolve("requests.webhook").unwrap_err();
        assert_eq!(e.field, "requests.webhook.url");
        assert!(e.message.contains("url"), "{e}");
        std::fs::write(&f, format!("http://hooks.test/{SECRET_PATH}\n")).unwrap();
        let e = cfg(None).resolve("requests.webhook").unwrap_err();
        assert!(
            e.message.contains("https://") && e.message.contains("read from file"),
            "{e}"
        );
        assert!(!e.to_string().contains(SECRET_PATH), "{e}");
        std::fs::write(&f, format!("https://hooks.test/{SECRET_PATH}\n")).unwrap();
        let r = cfg(None).resolve("requests.webhook").unwrap();
        assert_eq!(r.url.path, format!("/{SECRET_PATH}"));
        assert_eq!(r.timeout, std::time::Duration::from_millis(1500));
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, "not a pem").unwrap();
        let e = cfg(Some(ca.clone()))
            .resolve("requests.webhook")
            .unwrap_err();
        assert_eq!(e.field, "requests.webhook.ca_file");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// `egress-agent check` (strict) reads the URL's file and fails naming the field; serving
    /// (lenient) loads the configuration and leaves the reading to the notifier.
    #[test]
    fn check_reads_the_url_serving_does_not_fail_on_it() {
        let toml = "[requests.webhook]\nurl = { file = \"/nonexistent/egress-webhook-url\" }\n";
        let origin = Path::new("/etc/egress-agent/config.toml");
        let e = Config::from_toml_str_with(toml, origin, crate::config::Secrets::Strict)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("requests.webhook.url") && e.contains("egress-webhook-url"),
            "{e}"
        );
        assert!(Config::from_toml_str(toml, origin).is_ok());
    }
}
