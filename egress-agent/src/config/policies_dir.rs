//! `policies.d/`: one TOML file per policy next to the configuration file
//! (`/etc/egress-agent/policies.d/<policy>.toml`), holding that policy's fields at the top level
//! (`mode = "allowlist"`, `allow_hosts = [...]`). Loaded after the main file by
//! [`crate::config::Config::load`] (this module: reading, with the ownership checks); written by the
//! control API through `manage::dir::write_atomic`; watched by [`crate::config::watch`].
//!
//! What is read: regular files named `<policy>.toml` (the policy is named by the file). Names
//! starting with `.` (the writer's temporary files, editor swap files, the kubelet's `..data`,
//! `..data_tmp` and `..<timestamp>` entries) and names not ending in `.toml` are skipped. A
//! `.toml` entry that is not a regular file (a directory, a symbolic link), or a directory or
//! file writable by group or others or owned by another user than root (or the agent's own user)
//! is refused: whoever could write there could change the policy. The group/other write bits
//! are not held against a directory or file on a read-only mount (no one can write there
//! through it; a Kubernetes ConfigMap volume's root is mode 0777 on a read-only mount).
//!
//! A directory with a `..data` link is a Kubernetes ConfigMap (or Secret, projected) volume:
//! the kubelet keeps the content in a timestamped directory `..<timestamp>/`, points `..data`
//! at it and links `<key> -> ..data/<key>`; an update writes a new timestamped directory and
//! renames a new link over `..data` (one atomic step). Such a directory is read through
//! `..data`, resolved once, so one load sees one version of every file even while the kubelet
//! swaps; the per-key links are not followed (the policy files are that version's `*.toml`).
//! Paths in errors stay `<dir>/<policy>.toml`, the name the operator knows.
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::ConfigError;

/// The directory's name, next to the configuration file.
pub const DIR_NAME: &str = "policies.d";

/// The kubelet's link to the current version of a ConfigMap volume.
pub const DATA_LINK: &str = "..data";

/// One policy file's name and text.
#[derive(Debug, Clone)]
pub struct PolicyFile {
    pub name: String,
    pub path: PathBuf,
    pub text: String,
}

/// `policies.d` next to `config_path`.
pub fn policies_dir(config_path: &Path) -> PathBuf {
    match config_path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.join(DIR_NAME),
        _ => PathBuf::from(DIR_NAME),
    }
}

/// The file of policy `name` in `dir`.
pub fn policy_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.toml"))
}

/// Is this directory entry a policy file (by name)? `Some(policy name)`.
pub fn policy_name(file_name: &str) -> Option<&str> {
    if file_name.starts_with('.') {
        return None;
    }
    file_name.strip_suffix(".toml")
}

/// Is `dir` laid out by the kubelet (a `..data` symbolic link in it)?
pub fn kubernetes_managed(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join(DATA_LINK)).is_ok_and(|m| m.file_type().is_symlink())
}

/// Is `path` on a read-only mount?
pub fn on_read_only_mount(path: &Path) -> bool {
    nix::sys::statvfs::statvfs(path)
        .is_ok_and(|s| s.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
}

/// Refuse what others could have written: owner root or us, no group/other write bit (unless
/// `read_only`: the mount refuses every write).
fn check_owner(path: &Path, meta: &std::fs::Metadata, read_only: bool) -> Result<(), ConfigError> {
    let me = nix::unistd::geteuid().as_raw();
    let refused = |message: String| ConfigError::Refused {
        path: path.to_owned(),
        message,
    };
    if meta.uid() != 0 && meta.uid() != me {
        return Err(refused(format!(
            "owned by uid {}; policy files must be owned by root",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 && !read_only {
        return Err(refused(format!(
            "mode {:o} is writable by group or others; chmod go-w it",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// The directory the files of `dir` are read from: `dir` itself, or for a kubelet layout the
/// version `..data` points at (resolved once; it must be an entry of `dir`).
fn content_dir(dir: &Path) -> Result<PathBuf, ConfigError> {
    let link = dir.join(DATA_LINK);
    let target = match std::fs::read_link(&link) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(dir.to_owned()),
        // Not a link (EINVAL): an ordinary dot-entry, skipped like any other.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(dir.to_owned()),
        Err(e) => {
            return Err(ConfigError::Read {
                path: link,
                source: e,
            });
        }
    };
    // The kubelet's link is relative and names a sibling (`..2026_12_03_07_00_00.123456789`).
    let mut parts = target.components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(name)), None) if name != DATA_LINK => Ok(dir.join(name)),
        _ => Err(ConfigError::Refused {
            path: link,
            message: format!(
                "points at {}; a kubelet's ..data link names a directory next to it",
                target.display()
            ),
        }),
    }
}

/// The policy files of `dir`, sorted by name. A missing directory has none. A kubelet layout
/// is read through `..data` (see the module documentation).
pub fn read_policies(dir: &Path) -> Result<Vec<PolicyFile>, ConfigError> {
    let read_err = |path: &Path, source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(read_err(dir, e)),
    };
    if !meta.is_dir() {
        return Err(ConfigError::Refused {
            path: dir.to_owned(),
            message: "is not a directory".to_owned(),
        });
    }
    let read_only = on_read_only_mount(dir);
    check_owner(dir, &meta, read_only)?;
    let content = content_dir(dir)?;
    if content != dir {
        // The version directory: a real directory (never through another link), checked too.
        let meta = std::fs::symlink_metadata(&content).map_err(|e| read_err(&content, e))?;
        if !meta.is_dir() {
            return Err(ConfigError::Refused {
                path: content,
                message: "is not a directory (the target of ..data)".to_owned(),
            });
        }
        check_owner(&content, &meta, read_only)?;
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&content).map_err(|e| read_err(&content, e))? {
        let entry = entry.map_err(|e| read_err(&content, e))?;
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        let Some(name) = policy_name(file_name) else {
            continue;
        };
        let path = entry.path();
        // What errors name: the file as the operator knows it (`<dir>/<policy>.toml`).
        let shown = dir.join(file_name);
        // Never through a symbolic link, and only a regular file.
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => ConfigError::Refused {
                    path: shown.clone(),
                    message: "is a symbolic link; policy files must be regular files".to_owned(),
                },
                _ => read_err(&shown, e),
            })?;
        let meta = file.metadata().map_err(|e| read_err(&shown, e))?;
        if !meta.is_file() {
            return Err(ConfigError::Refused {
                path: shown,
                message: "is not a regular file".to_owned(),
            });
        }
        check_owner(&shown, &meta, read_only)?;
        let text = io::read_to_string(file).map_err(|e| read_err(&shown, e))?;
        out.push(PolicyFile {
            name: name.to_owned(),
            path: shown,
            text,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
pub(crate) mod tests;
