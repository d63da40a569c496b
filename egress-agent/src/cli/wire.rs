//! `egress-agent wire POLICY`: the exact `docker run` flags that give a container everything a
//! policy needs from it — the label, the proxy variables, and when the policy intercepts, the
//! agent's CA bundle mounted over the image's default bundle with every CA variable common
//! clients read ([`crate::ca::trust::CA_VARIABLES`]) naming it, and each binding's placeholder
//! variable. Docker has no hook that could add mounts and variables to a container it did not
//! create (the agent sees containers after `create`), so this prints them for the operator.
use anyhow::{Result, bail};

use crate::ca::trust::CA_VARIABLES;
use crate::config::Config;

/// Where the bundle is mounted: the default bundle of Debian/Ubuntu and Alpine images (tools
/// that read no variable use it too).
pub const BUNDLE_IN_CONTAINER: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Where the agent's CA alone is mounted (`NODE_EXTRA_CA_CERTS`).
pub const CA_IN_CONTAINER: &str = "/etc/ssl/certs/egress-agent-ca.pem";

/// The flags, one per element pair (`-e`, `NAME=value`), for `policy` of `config`.
pub fn docker_flags(config: &Config, policy: &str) -> Result<Vec<String>> {
    let Some(p) = config.policy(policy) else {
        let known: Vec<&str> = config.policy_names().collect();
        bail!(
            "no policy named {policy:?} (known: {}); add it to the configuration or policies.d",
            known.join(", ")
        );
    };
    let mut out = vec!["--label".to_owned(), format!("egress.policy={policy}")];
    let mut env = |k: &str, v: &str| {
        out.push("-e".to_owned());
        out.push(format!("{k}={v}"));
    };
    if p.mode == egress_policy::Mode::Allowlist {
        let url = format!("http://{}", config.proxy.endpoint);
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env(k, &url);
        }
        for k in ["NO_PROXY", "no_proxy"] {
            env(k, "localhost,127.0.0.1,::1");
        }
    }
    let intercepts = p.intercepts_some_host();
    if intercepts && p.mode == egress_policy::Mode::Allowlist {
        for v in CA_VARIABLES {
            env(
                v.name,
                if v.extra {
                    CA_IN_CONTAINER
                } else {
                    BUNDLE_IN_CONTAINER
                },
            );
        }
        for b in &p.credentials {
            if let (Some(var), Some(ph)) = (&b.placeholder_env, &b.placeholder) {
                env(var, ph);
            }
        }
        let state = config.agent.state_dir.display();
        out.push("-v".to_owned());
        out.push(format!("{state}/ca-bundle.pem:{BUNDLE_IN_CONTAINER}:ro"));
        out.push("-v".to_owned());
        out.push(format!("{state}/ca.pem:{CA_IN_CONTAINER}:ro"));
    }
    Ok(out)
}

/// Quote one flag for a POSIX shell (single quotes unless it is plain).
pub fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,@+%".contains(&b));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::path::Path;

    fn config() -> Config {
        let secret = std::env::temp_dir().join(format!("egress-wire-{}", std::process::id()));
        std::fs::write(&secret, "s3cret").unwrap();
        Config::from_toml_str(
            &format!(
                r#"
[agent]
state_dir = "/var/lib/egress-agent"
[proxy]
endpoint = "169.254.100.1:3128"
[policies.agent]
allow_hosts = ["api.test"]
[[policies.agent.credentials]]
host = "api.test"
header = "x-api-key"
source = {{ file = "{}" }}
placeholder = "egress-ph-1"
placeholder_env = "API_KEY"
[policies.plain]
allow_hosts = ["a.test"]
"#,
                secret.display()
            ),
            Path::new("t.toml"),
        )
        .unwrap()
    }

    #[test]
    fn an_intercepting_policy_gets_the_bundle_every_ca_variable_and_its_placeholders() {
        let f = docker_flags(&config(), "agent").unwrap();
        let has = |a: &str, b: &str| f.windows(2).any(|w| w[0] == a && w[1] == b);
        assert!(has("--label", "egress.policy=agent"));
        assert!(has("-e", "HTTPS_PROXY=http://169.254.100.1:3128"));
        assert!(has("-e", "API_KEY=egress-ph-1"));
        for v in [
            "SSL_CERT_FILE",
            "PIP_CERT",
            "NPM_CONFIG_CAFILE",
            "GIT_SSL_CAINFO",
        ] {
            assert!(
                has("-e", &format!("{v}={BUNDLE_IN_CONTAINER}")),
                "{v}: {f:?}"
            );
        }
        assert!(has("-e", &format!("NODE_EXTRA_CA_CERTS={CA_IN_CONTAINER}")));
        assert!(has(
            "-v",
            &format!("/var/lib/egress-agent/ca-bundle.pem:{BUNDLE_IN_CONTAINER}:ro")
        ));
    }

    #[test]
    fn a_plain_policy_gets_only_the_label_and_the_proxy() {
        let f = docker_flags(&config(), "plain").unwrap();
        assert!(!f.iter().any(|x| x.contains("CERT") || x == "-v"), "{f:?}");
        assert!(
            f.iter()
                .any(|x| x == "HTTPS_PROXY=http://169.254.100.1:3128")
        );
        let e = docker_flags(&config(), "nope").unwrap_err().to_string();
        assert!(e.contains("no policy named \"nope\""), "{e}");
    }

    #[test]
    fn words_are_quoted_for_a_shell() {
        assert_eq!(shell_word("API_KEY=abc"), "API_KEY=abc");
        assert_eq!(shell_word("a b'c"), r"'a b'\''c'");
    }
}
