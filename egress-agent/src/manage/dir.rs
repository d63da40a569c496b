//! `policies.d/`: one TOML file per policy next to the configuration file
//! (`/etc/egress-agent/policies.d/<policy>.toml`), holding that policy's fields at the top level
//! (`mode = "allowlist"`, `allow_hosts = [...]`). Loaded after the main file by
//! [`crate::config::Config::load`]; written by the control API through [`write_atomic`].
//!
//! What is read: regular files named `<policy>.toml` (the policy is named by the file). Names
//! starting with `.` (the writer's temporary files, editor swap files) and names not ending in
//! `.toml` are skipped. A `.toml` entry that is not a regular file (a directory, a symbolic link),
//! or a directory or file writable by group or others or owned by another user than root (or the
//! agent's own user) is refused: whoever could write there could change the policy.
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::config::ConfigError;

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

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Write `contents` to `path` atomically and durably: a new temporary file in the same
/// directory (0600, `O_EXCL`, never through a link), fsync, rename over `path`, fsync the
/// directory. Readers see the old file or the new one, never a part; a crash leaves at most a
/// `.`-named temporary file, which the loader skips. Creates the directory (0700) if needed.
pub fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("no parent directory"))?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other("no file name"))?;
    let tmp = dir.join(format!(
        ".{file_name}.tmp-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(contents)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        std::fs::remove_file(&tmp).ok();
    }
    result
}

/// Remove `path` durably (fsync the directory). A missing file is not an error.
pub fn remove_durable(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    pub(crate) fn tempdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "egress-manage-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        d
    }

    #[test]
    fn atomic_write_is_private_and_leaves_no_temporary_file() {
        let d = tempdir("write");
        let p = d.join(DIR_NAME).join("ci.toml");
        write_atomic(&p, b"mode = \"deny_all\"\n").unwrap();
        write_atomic(&p, b"mode = \"allow_all\"\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "mode = \"allow_all\"\n"
        );
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("ci.toml")]);
        let files = read_policies(p.parent().unwrap()).unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].name, "ci");
        remove_durable(&p).unwrap();
        remove_durable(&p).unwrap();
        assert!(read_policies(p.parent().unwrap()).unwrap().is_empty());
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn skips_temporary_and_foreign_names_and_refuses_links_and_loose_modes() {
        let d = tempdir("read");
        let dir = d.join(DIR_NAME);
        assert!(
            read_policies(&dir).unwrap().is_empty(),
            "missing dir = none"
        );
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.join(".ci.toml.tmp-1-2"), "garbage").unwrap();
        std::fs::write(dir.join("README"), "notes").unwrap();
        std::fs::write(dir.join("ci.toml~"), "backup").unwrap();
        std::fs::write(dir.join("b.toml"), "mode = \"deny_all\"\n").unwrap();
        std::fs::write(dir.join("a.toml"), "mode = \"allow_all\"\n").unwrap();
        let names: Vec<String> = read_policies(&dir)
            .unwrap()
            .into_iter()
            .map(|f| f.name)
            .collect();
        assert_eq!(names, ["a", "b"]);

        std::fs::set_permissions(dir.join("a.toml"), std::fs::Permissions::from_mode(0o666))
            .unwrap();
        let e = read_policies(&dir).unwrap_err().to_string();
        assert!(
            e.contains("a.toml") && e.contains("writable by group or others"),
            "{e}"
        );
        std::fs::set_permissions(dir.join("a.toml"), std::fs::Permissions::from_mode(0o600))
            .unwrap();

        std::os::unix::fs::symlink(d.join("elsewhere.toml"), dir.join("c.toml")).unwrap();
        let e = read_policies(&dir).unwrap_err().to_string();
        assert!(e.contains("c.toml") && e.contains("symbolic link"), "{e}");
        std::fs::remove_file(dir.join("c.toml")).unwrap();

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = read_policies(&dir).unwrap_err().to_string();
        assert!(e.contains("writable by group or others"), "{e}");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn the_directory_is_next_to_the_config_file() {
        assert_eq!(
            policies_dir(Path::new("/etc/egress-agent/config.toml")),
            PathBuf::from("/etc/egress-agent/policies.d")
        );
        assert_eq!(
            policies_dir(Path::new("config.toml")),
            PathBuf::from("policies.d")
        );
    }
}
