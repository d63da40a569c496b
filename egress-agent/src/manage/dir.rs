//! Writing `policies.d/` for the control API: atomic, durable replacement and removal of one
//! policy file. Reading it (and the ownership checks) is [`crate::config::policies_dir`], which
//! this module re-exports so `manage` names one place.
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

pub use crate::config::policies_dir::{
    DIR_NAME, PolicyFile, policies_dir, policy_path, read_policies,
};

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
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::path::PathBuf;

    pub(crate) fn tempdir(tag: &str) -> PathBuf {
        crate::test_dir::fresh(&format!("manage-{tag}"))
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
