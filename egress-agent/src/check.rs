//! `egress-agent check`: validate a config file and print the effective policies, or the policy a
//! given container would get and why.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::{config::Config, workload::labels};

/// The effective policies of `config` (built-ins included), as JSON.
pub fn effective_policies(config: &Config) -> Value {
    let mut out = serde_json::Map::new();
    for name in config.policy_names() {
        if let Some(p) = config.policy(name) {
            out.insert(
                name.to_owned(),
                serde_json::to_value(p).unwrap_or(Value::Null),
            );
        }
    }
    Value::Object(out)
}

/// Why a workload got its policy, in words (`explain`, `check --container`).
pub fn why(source: &labels::Source) -> String {
    match source {
        labels::Source::Unlabeled => "no egress.* label: agent.unlabeled applies".to_owned(),
        labels::Source::Default => {
            "opted in without a policy label: agent.default_policy applies".to_owned()
        }
        labels::Source::Namespace => {
            "a pod without egress.* annotations: its namespace's default applies".to_owned()
        }
        labels::Source::Named => "egress.policy label".to_owned(),
        labels::Source::Inline => {
            "inline egress.allow_hosts / egress.allow_ports labels".to_owned()
        }
        labels::Source::Invalid(reason) => {
            format!("labels refused, confined as deny_all: {reason}")
        }
    }
}

/// What a container with these labels gets under `config`.
pub fn explain_labels<'a>(
    labels: impl IntoIterator<Item = (&'a str, &'a str)>,
    config: &Config,
) -> Value {
    let r = labels::resolve(labels, config);
    let why = why(&r.source);
    json!({
        "policy": r.name,
        "why": why,
        "effective": serde_json::to_value(r.policy.as_ref()).unwrap_or(Value::Null),
        "context": r.context,
    })
}

/// Runs `check`. Prints JSON; errors (the config's own, with file/line/field) go to the caller.
/// Strict: a credential binding whose secret can't be loaded is an error naming its field
/// (serving would keep the rest running and refuse that binding's host).
pub async fn run(config_path: &Path, container: Option<&str>, docker_socket: &str) -> Result<()> {
    let config = Config::load_with(config_path, crate::config::Secrets::Strict)?;
    let out = match container {
        None => json!({
            "config": config_path.display().to_string(),
            "valid": true,
            "default_policy": config.agent.default_policy,
            "unlabeled": config.agent.unlabeled,
            "proxy_endpoint": config.proxy.endpoint.to_string(),
            "policies": effective_policies(&config),
        }),
        Some(id) => {
            let docker =
                bollard::Docker::connect_with_unix(docker_socket, 10, bollard::API_DEFAULT_VERSION)
                    .with_context(|| format!("connecting to Docker at {docker_socket}"))?;
            let c = docker
                .inspect_container(
                    id,
                    None::<bollard::query_parameters::InspectContainerOptions>,
                )
                .await
                .with_context(|| format!("inspecting container {id}"))?;
            let labels = c.config.and_then(|c| c.labels).unwrap_or_default();
            let mut v = explain_labels(
                labels.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                &config,
            );
            v["container"] =
                json!({ "id": c.id, "name": c.name.map(|n| n.trim_start_matches('/').to_owned()) });
            v
        }
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::from_toml_str(
            "[agent]\ndefault_policy = \"ci\"\n[policies.ci]\nallow_hosts = [\"github.com\"]\n",
            Path::new("test.toml"),
        )
        .expect("valid config")
    }

    #[test]
    fn lists_builtins_and_named() {
        let v = effective_policies(&config());
        assert_eq!(v["ci"]["mode"], "allowlist");
        assert_eq!(v["ci"]["allow_ports"], json!([443]));
        assert_eq!(v["deny_all"]["mode"], "deny_all");
        assert_eq!(v["allow_all"]["mode"], "allow_all");
    }

    #[test]
    fn explains_each_source() {
        let c = config();
        assert_eq!(explain_labels([], &c)["policy"], "allow_all");
        assert_eq!(explain_labels([("egress.repo", "a/b")], &c)["policy"], "ci");
        assert_eq!(
            explain_labels([("egress.policy", "ci")], &c)["policy"],
            "ci"
        );
        let bad = explain_labels([("egress.policy", "nope")], &c);
        assert_eq!(bad["policy"], "deny_all");
        assert!(
            bad["why"].as_str().is_some_and(|w| w.contains("nope")),
            "{bad}"
        );
        let inline = explain_labels([("egress.allow_hosts", "a.com")], &c);
        assert!(
            inline["policy"]
                .as_str()
                .is_some_and(|p| p.starts_with("inline:")),
            "{inline}"
        );
    }
}
