//! `policies.d/`: one TOML file per policy next to the configuration file
//! (`/etc/egress-agent/policies.d/<policy>.toml`), holding that policy's fields at the top level
//! (`mode = "allowlist"`, `allow_hosts = [...]`). Loaded after the main file by
//! [`crate::config::Config::load`] (this module: reading, with the ownership checks); written by the
//! control API through `manage::dir::write_atomic`.
//!
//! What is read: regular files named `<policy>.toml` (the policy is named by the file). Names
//! starting with `.` (the writer's temporary files, editor swap files) and names not ending in
//! `.toml` are skipped. A `.toml` entry that is not a regular file (a directory, a symbolic link),
//! or a directory or file writable by group or others or owned by another user than root (or the
//! agent's own user) is refused: whoever could write there could change the policy.
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::ConfigError;

/// The directory's name, next to the configuration file.
pub const DIR_NAME: &str = "policies.d";

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
fn policy_name(file_name: &str) -> Option<&str> {
    if file_name.starts_with('.') {
        return None;
    }
    file_name.strip_suffix(".toml")
}

/// Refuse what others could have written: owner root or us, no group/other write bit.
fn check_owner(path: &Path, meta: &std::fs::Metadata) -> Result<(), ConfigError> {
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
    if meta.mode() & 0o022 != 0 {
        return Err(refused(format!(
            "mode {:o} is writable by group or others; chmod go-w it",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// The policy files of `dir`, sorted by name. A missing directory has none.
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
    check_owner(dir, &meta)?;
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| read_err(dir, e))? {
        let entry = entry.map_err(|e| read_err(dir, e))?;
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        let Some(name) = policy_name(file_name) else {
            continue;
        };
        let path = entry.path();
        // Never through a symbolic link, and only a regular file.
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => ConfigError::Refused {
                    path: path.clone(),
                    message: "is a symbolic link; policy files must be regular files".to_owned(),
                },
                _ => read_err(&path, e),
            })?;
        let meta = file.metadata().map_err(|e| read_err(&path, e))?;
        if !meta.is_file() {
            return Err(ConfigError::Refused {
                path,
                message: "is not a regular file".to_owned(),
            });
        }
        check_owner(&path, &meta)?;
        let text = io::read_to_string(file).map_err(|e| read_err(&path, e))?;
        out.push(PolicyFile {
            name: name.to_owned(),
            path,
            text,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}
