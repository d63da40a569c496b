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
            out.insert(name.to_owned(), policy_json(p));
        }
    }
    Value::Object(out)
}

/// A policy as `check` and `GET /v1/policies` show it: its fields as written (`presets` by
/// name, `allow_hosts` its own entries), and for a policy with presets `preset_hosts`, every host
/// each preset adds.
pub fn policy_json(p: &egress_policy::Policy) -> Value {
    let mut v = serde_json::to_value(p).unwrap_or(Value::Null);
    if !p.presets.is_empty() {
        v["preset_hosts"] = egress_policy::presets::expansion(p);
    }
    v
}

/// What the built-in presets changed since the data file at `path` (an older `presets.toml`),
/// with the policies of `config` that name each changed preset: `check --presets-from`.
pub fn changes_since(path: &Path, config: &Config) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading presets data {}", path.display()))?;
    let old = egress_policy::presets::Presets::parse(&text)
        .with_context(|| path.display().to_string())?;
    let changes: Vec<Value> =
        egress_policy::presets::diff(&old, egress_policy::presets::Presets::builtin())
            .iter()
            .map(|c| change_json(c, config))
            .collect();
    Ok(json!({ "from": path.display().to_string(), "changes": changes }))
}

fn change_json(c: &egress_policy::presets::PresetChange, config: &Config) -> Value {
    let used_by: Vec<&str> = config
        .policy_names()
        .filter(|n| {
            config
                .policy(n)
                .is_some_and(|p| p.presets.iter().any(|x| x.as_str() == c.name))
        })
        .collect();
    json!({
        "preset": c.name,
        "kind": c.kind,
        "added": c.added,
        "removed": c.removed,
        "used_by": used_by,
    })
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
            "inline egress.allow_hosts / egress.allow_ports / egress.presets labels".to_owned()
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
        "effective": policy_json(r.policy.as_ref()),
        "context": r.context,
    })
}

/// Runs `check`. Prints JSON; errors (the config's own, with file/line/field) go to the caller.
/// Strict: a credential binding whose secret can't be loaded is an error naming its field
/// (serving would keep the rest running and refuse that binding's host).
/// `presets_from`: an older presets data file; the output then says what each preset changed.
pub async fn run(
    config_path: &Path,
    container: Option<&str>,
    docker_socket: &str,
    presets_from: Option<&Path>,
) -> Result<()> {
    let config = Config::load_with(config_path, crate::config::Secrets::Strict)?;
    let mut out = match container {
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
    if let Some(path) = presets_from {
        out["presets_changed"] = changes_since(path, &config)?;
    }
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

    #[test]
    fn changes_since_an_older_file_name_the_policies_using_them() {
        let dir = crate::test_dir::fresh("presets-from");
        let old = egress_policy::presets::DATA
            .replace("  \"sum.golang.org\",\n", "  \"gone.golang.test\",\n");
        assert_ne!(old, egress_policy::presets::DATA);
        let path = dir.join("old.toml");
        std::fs::write(&path, old).expect("write");
        let config = Config::from_toml_str(
            "[policies.build]\npresets = [\"go\"]\n[policies.web]\nallow_hosts = [\"a.test\"]\n",
            Path::new("test.toml"),
        )
        .expect("valid config");
        let v = changes_since(&path, &config).expect("changes");
        assert_eq!(
            v["changes"],
            json!([{ "preset": "go", "kind": "changed", "added": ["sum.golang.org"],
                     "removed": ["gone.golang.test"], "used_by": ["build"] }])
        );
        std::fs::remove_dir_all(&dir).ok();
        let build = effective_policies(&config)["build"].clone();
        assert_eq!(build["presets"], json!(["go"]));
        assert_eq!(build["allow_hosts"], json!([]), "not flattened: {build}");
        assert_eq!(
            build["preset_hosts"],
            json!({ "go": ["proxy.golang.org", "sum.golang.org"] })
        );
        assert!(
            effective_policies(&config)["web"]
                .get("preset_hosts")
                .is_none()
        );
    }
}
