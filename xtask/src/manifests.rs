//! The Kubernetes manifests in `deploy/kubernetes/`: schema validation (`kubernetes-validate`,
//! offline, strict: unknown fields are errors) against the oldest and the newest Kubernetes
//! version we support, and the cross-file facts no schema knows: the DaemonSet runs the image
//! `cargo xtask image` builds (tag = workspace version), with the configuration where the image's
//! command reads it, every policy of the policies ConfigMap mounted into `policies.d/`, and the
//! containerd socket and state directory the configuration names mounted from the node.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use yaml_rust2::{Yaml, YamlLoader};

use crate::image;
use crate::setup::{KUBERNETES_VALIDATE_VENV, workspace_root};

/// Kubernetes versions the manifests are validated against: the oldest supported (1.31) and the
/// newest `kubernetes-validate` knows.
pub const KUBERNETES_VERSIONS: &[&str] = &["1.31.0", "1.37.0"];

/// The configuration's Kubernetes names, in one place (config.toml in configmap.yaml).
const KUBERNETES_SECTION: &str = "kubernetes";
const CONTAINERD_SOCKET_KEY: &str = "containerd_socket";

const CONFIG_MAP: &str = "egress-agent-config";
const POLICIES_MAP: &str = "egress-agent-policies";
/// The configuration's key in `CONFIG_MAP`.
const CONFIG_KEY: &str = "config.toml";
/// The agent reads policy files from this directory next to its configuration file.
const POLICIES_DIR: &str = "policies.d";
const AGENT_CONTAINER: &str = "agent";

pub fn dir() -> PathBuf {
    workspace_root().join("deploy/kubernetes")
}

/// Kubernetes resources (not kustomization.yaml, which has no schema).
fn manifest_files() -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir()).with_context(|| format!("reading {}", dir().display()))? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".yaml") && name != "kustomization.yaml" {
            files.push(p);
        }
    }
    files.sort();
    ensure!(!files.is_empty(), "no manifests in {}", dir().display());
    Ok(files)
}

/// `kubernetes-validate --strict` on every manifest, for each of [`KUBERNETES_VERSIONS`].
pub fn validate() -> Result<()> {
    let tool = Path::new(KUBERNETES_VALIDATE_VENV).join("bin/kubernetes-validate");
    let files = manifest_files()?;
    for version in KUBERNETES_VERSIONS {
        let out = Command::new(&tool)
            .args(["--strict", "--quiet", "--kubernetes-version", version])
            .args(&files)
            .output()
            .with_context(|| {
                format!("running {} (cargo xtask setup installs it)", tool.display())
            })?;
        if !out.status.success() {
            bail!(
                "deploy/kubernetes does not validate against Kubernetes {version}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    eprintln!(
        "deploy/kubernetes: {} manifests valid for Kubernetes {}",
        files.len(),
        KUBERNETES_VERSIONS.join(", ")
    );
    Ok(())
}

/// The cross-file checks on the files in [`dir`].
pub fn check() -> Result<()> {
    let read = |name: &str| {
        let p = dir().join(name);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    check_texts(&read("daemonset.yaml")?, &read("configmap.yaml")?)
}

fn docs(text: &str, file: &str) -> Result<Vec<Yaml>> {
    YamlLoader::load_from_str(text).with_context(|| format!("parsing {file}"))
}

fn str_of<'a>(y: &'a Yaml, what: &str) -> Result<&'a str> {
    y.as_str()
        .with_context(|| format!("{what}: missing or not a string"))
}

fn vec_of<'a>(y: &'a Yaml, what: &str) -> Result<&'a [Yaml]> {
    y.as_vec()
        .map(Vec::as_slice)
        .with_context(|| format!("{what}: missing or not a list"))
}

/// The `data` keys of the ConfigMap `name`, and their values.
fn config_map<'a>(maps: &'a [Yaml], name: &str) -> Result<Vec<(&'a str, &'a str)>> {
    let map = maps
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("ConfigMap") && d["metadata"]["name"].as_str() == Some(name)
        })
        .with_context(|| format!("configmap.yaml has no ConfigMap {name}"))?;
    let data = map["data"]
        .as_hash()
        .with_context(|| format!("ConfigMap {name} has no data"))?;
    data.iter()
        .map(|(k, v)| Ok((str_of(k, "data key")?, str_of(v, "data value")?)))
        .collect()
}

// Long: a checklist of the manifests' invariants, each an `ensure!` naming what is wrong.
fn check_texts(daemonset: &str, configmap: &str) -> Result<()> {
    let ds_docs = docs(daemonset, "daemonset.yaml")?;
    let ds = ds_docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("DaemonSet"))
        .context("daemonset.yaml has no DaemonSet")?;
    let maps = docs(configmap, "configmap.yaml")?;
    let pod = &ds["spec"]["template"]["spec"];
    let agent = vec_of(&pod["containers"], "containers")?
        .iter()
        .find(|c| c["name"].as_str() == Some(AGENT_CONTAINER))
        .with_context(|| format!("no container {AGENT_CONTAINER}"))?;

    // The image `cargo xtask image` tags, never pulled.
    let image_ref = str_of(&agent["image"], "image")?;
    ensure!(
        image_ref == image::tag(),
        "the DaemonSet runs {image_ref}, but `cargo xtask image` builds {} (the workspace version)",
        image::tag()
    );
    ensure!(
        agent["imagePullPolicy"].as_str() == Some("Never"),
        "imagePullPolicy must be Never: the image is imported into each node's containerd"
    );

    // The configuration where the command reads it, from the config volume.
    let command: Vec<&str> = vec_of(&agent["command"], "command")?
        .iter()
        .map(|a| str_of(a, "command argument"))
        .collect::<Result<_>>()?;
    ensure!(
        command.starts_with(&["egress-agent", "run", "--config", image::CONFIG_PATH]),
        "the agent's command must start with `egress-agent run --config {}`, not {command:?}",
        image::CONFIG_PATH
    );
    let config_path = Path::new(image::CONFIG_PATH);
    let config_dir = config_path.parent().and_then(Path::to_str).unwrap_or("/");
    let mounts = vec_of(&agent["volumeMounts"], "volumeMounts")?;
    let mount_of = |path: &str| {
        mounts
            .iter()
            .find(|m| m["mountPath"].as_str() == Some(path))
    };
    let volumes = vec_of(&pod["volumes"], "volumes")?;
    let volume = |name: &str| {
        volumes
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .with_context(|| format!("no volume {name}"))
    };
    // config.toml: the config ConfigMap's key, mounted file by file (subPath).
    let config_mount = mount_of(image::CONFIG_PATH)
        .with_context(|| format!("nothing is mounted at {}", image::CONFIG_PATH))?;
    ensure!(
        config_mount["subPath"].as_str() == Some(CONFIG_KEY),
        "{} must be mounted with subPath {CONFIG_KEY}",
        image::CONFIG_PATH
    );
    let config_volume = volume(str_of(&config_mount["name"], "volumeMount name")?)?;
    ensure!(
        config_volume["configMap"]["name"].as_str() == Some(CONFIG_MAP),
        "{} must come from ConfigMap {CONFIG_MAP}",
        image::CONFIG_PATH
    );

    // policies.d: the whole policies ConfigMap as a directory, every key a policy file, no
    // `items` (a key added to the ConfigMap must appear without a DaemonSet change, and the
    // kubelet's atomic swap of the directory is what the agent watches).
    let policies_path = format!("{config_dir}/{POLICIES_DIR}");
    let policies_mount = mount_of(&policies_path)
        .with_context(|| format!("nothing is mounted at {policies_path}"))?;
    ensure!(
        policies_mount["subPath"].is_badvalue(),
        "{policies_path} must not be a subPath mount: the kubelet never updates those"
    );
    let policies_volume = volume(str_of(&policies_mount["name"], "volumeMount name")?)?;
    ensure!(
        policies_volume["configMap"]["name"].as_str() == Some(POLICIES_MAP),
        "{policies_path} must be ConfigMap {POLICIES_MAP}"
    );
    ensure!(
        policies_volume["configMap"]["items"].is_badvalue(),
        "ConfigMap {POLICIES_MAP} must be mounted whole (no items): every key is a policy file"
    );
    let policy_keys = config_map(&maps, POLICIES_MAP)?;
    for (key, _) in &policy_keys {
        ensure!(
            key.ends_with(".toml"),
            "ConfigMap {POLICIES_MAP}: key {key} must be <policy>.toml"
        );
    }

    // The node paths the configuration names, mounted from the node at the same path.
    let (_, config_text) = config_map(&maps, CONFIG_MAP)?
        .into_iter()
        .find(|(k, _)| *k == CONFIG_KEY)
        .with_context(|| format!("ConfigMap {CONFIG_MAP} has no {CONFIG_KEY}"))?;
    let config: toml::Table = config_text
        .parse()
        .context("parsing config.toml of configmap.yaml")?;
    let host_mount = |path: &str, kind: &str| -> Result<()> {
        let mount = mount_of(path)
            .with_context(|| format!("{path} (from config.toml) is not mounted into the agent"))?;
        let v = volume(str_of(&mount["name"], "volumeMount name")?)?;
        ensure!(
            v["hostPath"]["path"].as_str() == Some(path)
                && v["hostPath"]["type"].as_str() == Some(kind),
            "{path} must be the node's {path} (hostPath, type {kind})"
        );
        Ok(())
    };
    let socket = config
        .get(KUBERNETES_SECTION)
        .and_then(|s| s.get(CONTAINERD_SOCKET_KEY))
        .and_then(|v| v.as_str())
        .with_context(|| {
            format!("config.toml has no [{KUBERNETES_SECTION}] {CONTAINERD_SOCKET_KEY}")
        })?;
    host_mount(socket, "Socket")?;
    let state = config
        .get("agent")
        .and_then(|a| a.get("state_dir"))
        .and_then(|v| v.as_str())
        .context("config.toml has no agent.state_dir")?;
    host_mount(state, "DirectoryOrCreate")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> (String, String) {
        let read = |n: &str| std::fs::read_to_string(dir().join(n)).expect("manifest");
        (read("daemonset.yaml"), read("configmap.yaml"))
    }

    #[test]
    fn the_shipped_manifests_are_consistent() {
        check().expect("deploy/kubernetes");
    }

    #[test]
    fn the_manifests_validate_offline() {
        let tool = Path::new(KUBERNETES_VALIDATE_VENV).join("bin/kubernetes-validate");
        if !tool.exists() {
            eprintln!(
                "skipping: {} is not installed (cargo xtask setup)",
                tool.display()
            );
            return;
        }
        validate().expect("kubernetes-validate");
    }

    #[test]
    fn another_image_tag_is_refused() {
        let (ds, cm) = files();
        let ds = ds.replace(
            &format!("image: {}", image::tag()),
            "image: egress-agent:0.0.9",
        );
        let err = check_texts(&ds, &cm).expect_err("must fail");
        assert!(err.to_string().contains("egress-agent:0.0.9"), "{err}");
    }

    #[test]
    fn policies_mounted_by_items_or_subpath_are_refused() {
        let (ds, cm) = files();
        let items = ds.replace(
            "            name: egress-agent-policies\n            defaultMode: 0400\n",
            "            name: egress-agent-policies\n            defaultMode: 0400\n            items:\n              - key: ci.toml\n                path: ci.toml\n",
        );
        assert_ne!(items, ds, "the test's edit must apply");
        let err = check_texts(&items, &cm).expect_err("must fail");
        assert!(err.to_string().contains("no items"), "{err}");
        let sub = ds.replace(
            "              mountPath: /etc/egress-agent/policies.d\n",
            "              mountPath: /etc/egress-agent/policies.d\n              subPath: x\n",
        );
        assert_ne!(sub, ds, "the test's edit must apply");
        let err = check_texts(&sub, &cm).expect_err("must fail");
        assert!(err.to_string().contains("subPath"), "{err}");
    }

    #[test]
    fn a_socket_the_daemonset_does_not_mount_is_refused() {
        let (ds, cm) = files();
        let cm = cm.replace(
            "containerd_socket = \"/run/containerd/containerd.sock\"",
            "containerd_socket = \"/run/k3s/containerd/containerd.sock\"",
        );
        let err = check_texts(&ds, &cm).expect_err("must fail");
        assert!(err.to_string().contains("/run/k3s/containerd"), "{err}");
    }
}
