//! A `docker save` archive ("docker-archive") of a one-layer image, written without a daemon:
//! `manifest.json` naming the image config and the layer, the config (`<sha256>.json`) and the
//! layer (`<sha256>/layer.tar`, uncompressed). `docker load` and `ctr images import` both read
//! this format. Everything is deterministic (entries sorted, owner root, a fixed mtime), so the
//! same files give the same image id.
use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{Context, Result, bail};
use serde_json::json;
use sha2::{Digest, Sha256};

/// Modification time of every entry and the image's creation time: the Unix epoch, for
/// reproducible image ids.
const EPOCH: u64 = 0;
const CREATED: &str = "1970-01-01T00:00:00Z";

/// What a path in the image is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    File { data: Vec<u8>, mode: u32 },
    Dir { mode: u32 },
}

/// The file system of the layer: absolute paths in the image. Parent directories that are not
/// listed are added (0755).
#[derive(Debug, Default)]
pub struct Rootfs {
    nodes: BTreeMap<String, Node>,
}

impl Rootfs {
    /// Add a file at `path` (absolute). The same path twice with different contents is an error.
    pub fn file(&mut self, path: &str, data: Vec<u8>, mode: u32) -> Result<()> {
        self.insert(path, Node::File { data, mode })
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> Result<()> {
        self.insert(path, Node::Dir { mode })
    }

    fn insert(&mut self, path: &str, node: Node) -> Result<()> {
        let rel = relative(path)?;
        if let Some(old) = self.nodes.get(&rel)
            && *old != node
        {
            bail!("{path} is in the image twice, with different contents");
        }
        self.nodes.insert(rel, node);
        Ok(())
    }

    /// The layer: an uncompressed tar, parents before children.
    pub fn layer(&self) -> Result<Vec<u8>> {
        let mut all = self.nodes.clone();
        for rel in self.nodes.keys() {
            let mut parent = rel.as_str();
            while let Some((p, _)) = parent.rsplit_once('/') {
                all.entry(p.to_owned()).or_insert(Node::Dir { mode: 0o755 });
                parent = p;
            }
        }
        let mut tar = tar::Builder::new(Vec::new());
        // BTreeMap order is byte order: "a" < "a/b", so a directory precedes its entries.
        for (rel, node) in &all {
            let mut h = tar::Header::new_ustar();
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(EPOCH);
            match node {
                Node::File { data, mode } => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(*mode);
                    h.set_size(data.len() as u64);
                    tar.append_data(&mut h, rel, data.as_slice())
                }
                Node::Dir { mode } => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(*mode);
                    h.set_size(0);
                    tar.append_data(&mut h, format!("{rel}/"), std::io::empty())
                }
            }
            .with_context(|| format!("adding /{rel} to the layer"))?;
        }
        tar.into_inner().context("finishing the layer")
    }
}

/// `/usr/bin/x` → `usr/bin/x`; refuses relative paths and `..`.
fn relative(path: &str) -> Result<String> {
    let rel = path
        .strip_prefix('/')
        .with_context(|| format!("image path {path} is not absolute"))?
        .trim_end_matches('/');
    if rel.is_empty()
        || rel
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        bail!("image path {path} is not a plain absolute path");
    }
    Ok(rel.to_owned())
}

/// The image config's `config` part (what runs).
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// OCI architecture (`amd64`, `arm64`).
    pub architecture: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The image config (OCI image config / Docker image JSON) for one layer.
pub fn image_config(run: &RunConfig, layer: &[u8]) -> serde_json::Value {
    json!({
        "architecture": run.architecture,
        "os": "linux",
        "created": CREATED,
        "config": {
            "Entrypoint": run.entrypoint,
            "Cmd": run.cmd,
            "Env": run.env,
            "Labels": run.labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(layer))]},
        "history": [{"created": CREATED, "created_by": "cargo xtask image"}],
    })
}

/// Write the archive of `layer` with `run`, tagged `repo_tag` (`name:tag`), to `out`.
/// Returns the image id (the config's sha256).
pub fn write(out: impl Write, repo_tag: &str, run: &RunConfig, layer: &[u8]) -> Result<String> {
    let config = serde_json::to_vec(&image_config(run, layer))?;
    let config_id = sha256_hex(&config);
    let layer_id = sha256_hex(layer);
    let config_name = format!("{config_id}.json");
    let layer_name = format!("{layer_id}/layer.tar");
    let manifest = serde_json::to_vec(&json!([{
        "Config": config_name,
        "RepoTags": [repo_tag],
        "Layers": [layer_name],
    }]))?;
    let (repo, tag) = repo_tag
        .rsplit_once(':')
        .with_context(|| format!("image reference {repo_tag} has no tag"))?;
    let repositories = serde_json::to_vec(&json!({ repo: { tag: layer_id } }))?;

    let mut tar = tar::Builder::new(out);
    let mut add = |name: &str, data: &[u8], dir: bool| -> Result<()> {
        let mut h = tar::Header::new_ustar();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(EPOCH);
        if dir {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
        } else {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o644);
        }
        h.set_size(data.len() as u64);
        tar.append_data(&mut h, name, data)
            .with_context(|| format!("adding {name} to the archive"))
    };
    add(&format!("{layer_id}/"), &[], true)?;
    add(&layer_name, layer, false)?;
    add(&config_name, &config, false)?;
    add("manifest.json", &manifest, false)?;
    add("repositories", &repositories, false)?;
    tar.into_inner()
        .context("finishing the archive")?
        .flush()
        .context("writing the archive")?;
    Ok(config_id)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::io::Read;

    use super::*;

    fn entries(tar_bytes: &[u8]) -> Vec<(String, tar::EntryType, u32, Vec<u8>)> {
        let mut a = tar::Archive::new(tar_bytes);
        a.entries()
            .expect("entries")
            .map(|e| {
                let mut e = e.expect("entry");
                let path = e.path().expect("path").to_string_lossy().into_owned();
                let h = e.header();
                let (kind, mode) = (h.entry_type(), h.mode().expect("mode"));
                assert_eq!(h.uid().expect("uid"), 0);
                assert_eq!(h.mtime().expect("mtime"), EPOCH);
                let mut data = Vec::new();
                e.read_to_end(&mut data).expect("read");
                (path, kind, mode, data)
            })
            .collect()
    }

    fn run_config() -> RunConfig {
        RunConfig {
            architecture: "amd64".into(),
            entrypoint: vec!["/usr/local/bin/egress-agent".into()],
            cmd: vec!["run".into()],
            env: vec!["PATH=/usr/bin".into()],
            labels: BTreeMap::new(),
        }
    }

    #[test]
    fn layer_has_parents_first_and_keeps_modes() {
        let mut fs = Rootfs::default();
        fs.file("/usr/local/bin/egress-agent", b"ELF".to_vec(), 0o755)
            .expect("file");
        fs.file("/etc/passwd", b"root".to_vec(), 0o644)
            .expect("file");
        fs.dir("/tmp", 0o1777).expect("dir");
        let got = entries(&fs.layer().expect("layer"));
        let names: Vec<&str> = got.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "etc/",
                "etc/passwd",
                "tmp/",
                "usr/",
                "usr/local/",
                "usr/local/bin/",
                "usr/local/bin/egress-agent"
            ]
        );
        let agent = got.last().expect("agent");
        assert_eq!(
            (agent.1, agent.2, agent.3.as_slice()),
            (tar::EntryType::Regular, 0o755, &b"ELF"[..])
        );
        assert_eq!((got[2].1, got[2].2), (tar::EntryType::Directory, 0o1777));
        assert_eq!((got[0].1, got[0].2), (tar::EntryType::Directory, 0o755));
    }

    #[test]
    fn paths_must_be_plain_absolute_and_unique() {
        let mut fs = Rootfs::default();
        assert!(fs.file("usr/bin/x", vec![], 0o755).is_err());
        assert!(fs.file("/usr/../etc/x", vec![], 0o755).is_err());
        assert!(fs.file("/", vec![], 0o755).is_err());
        fs.file("/a", b"1".to_vec(), 0o644).expect("first");
        fs.file("/a", b"1".to_vec(), 0o644)
            .expect("the same file twice is fine");
        assert!(fs.file("/a", b"2".to_vec(), 0o644).is_err());
    }

    #[test]
    fn archive_names_config_and_layer_by_digest() {
        let mut fs = Rootfs::default();
        fs.file("/bin/x", b"x".to_vec(), 0o755).expect("file");
        let layer = fs.layer().expect("layer");
        let mut out = Vec::new();
        let id = write(&mut out, "egress-agent:1.2.3", &run_config(), &layer).expect("write");
        let got: BTreeMap<String, Vec<u8>> = entries(&out)
            .into_iter()
            .map(|(p, _, _, d)| (p, d))
            .collect();
        let manifest: serde_json::Value =
            serde_json::from_slice(&got["manifest.json"]).expect("manifest");
        let m = &manifest[0];
        assert_eq!(m["RepoTags"], json!(["egress-agent:1.2.3"]));
        let config_name = m["Config"].as_str().expect("Config");
        assert_eq!(config_name, format!("{id}.json"));
        let config_bytes = &got[config_name];
        assert_eq!(
            sha256_hex(config_bytes),
            id,
            "the id is the config's digest"
        );
        let layer_name = m["Layers"][0].as_str().expect("Layers");
        assert_eq!(got[layer_name], layer);
        let config: serde_json::Value = serde_json::from_slice(config_bytes).expect("config");
        assert_eq!(
            config["rootfs"]["diff_ids"],
            json!([format!("sha256:{}", sha256_hex(&layer))])
        );
        assert_eq!(layer_name, format!("{}/layer.tar", sha256_hex(&layer)));
        assert_eq!(
            config["config"]["Entrypoint"],
            json!(["/usr/local/bin/egress-agent"])
        );
        assert_eq!(
            (config["os"].as_str(), config["architecture"].as_str()),
            (Some("linux"), Some("amd64"))
        );
        let repos: serde_json::Value =
            serde_json::from_slice(&got["repositories"]).expect("repositories");
        assert_eq!(repos["egress-agent"]["1.2.3"], json!(sha256_hex(&layer)));
    }

    #[test]
    fn same_input_same_image_id() {
        let mut fs = Rootfs::default();
        fs.file("/bin/x", b"x".to_vec(), 0o755).expect("file");
        let layer = fs.layer().expect("layer");
        let a = write(Vec::new(), "x:1", &run_config(), &layer).expect("a");
        let b = write(
            Vec::new(),
            "x:1",
            &run_config(),
            &fs.layer().expect("layer"),
        )
        .expect("b");
        assert_eq!(a, b);
    }
}
