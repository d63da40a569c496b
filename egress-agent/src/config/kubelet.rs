//! The kubelet's update of a ConfigMap volume (`pkg/volume/util/atomic_writer.go`,
//! `AtomicWriter.Write`), step by step, for tests that play the kubelet (no kubelet runs on the
//! test machines): the unit tests of [`super::policies_dir`] and [`super::watch`], and the
//! privileged daemon test (`tests/tests/daemon_reload.rs`). Nothing in the agent calls it.
use std::io;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use super::policies_dir::DATA_LINK;

/// One update of the volume at `dir` to `files` (key → content), as the kubelet makes it:
/// a new timestamped directory `..<ts>` with the payload (files 0644, directory 0755),
/// `..data_tmp` pointing at it, renamed over `..data`, a `<key> -> ..data/<key>` link for each
/// new key, the links of removed keys removed, then the old timestamped directory removed.
/// `ts` names the new version (`2026_12_03_07_00_00.123456789`). The first update makes the
/// layout (and `dir`).
pub fn update(dir: &Path, ts: &str, files: &[(&str, &str)]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let old: Option<PathBuf> = std::fs::read_link(dir.join(DATA_LINK)).ok();
    let mut old_keys = Vec::new();
    if let Some(o) = &old {
        for e in std::fs::read_dir(dir.join(o))? {
            old_keys.push(e?.file_name().to_string_lossy().into_owned());
        }
    }
    let ts_name = format!("..{ts}");
    let ts_dir = dir.join(&ts_name);
    std::fs::create_dir(&ts_dir)?;
    for (key, text) in files {
        let p = ts_dir.join(key);
        std::fs::write(&p, text)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644))?;
    }
    std::fs::set_permissions(&ts_dir, std::fs::Permissions::from_mode(0o755))?;
    let tmp = dir.join("..data_tmp");
    symlink(&ts_name, &tmp)?;
    std::fs::rename(&tmp, dir.join(DATA_LINK))?;
    for (key, _) in files {
        let link = dir.join(key);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(Path::new(DATA_LINK).join(key), &link)?;
        }
    }
    for key in old_keys {
        if !files.iter().any(|(k, _)| *k == key) {
            std::fs::remove_file(dir.join(&key))?;
        }
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(dir.join(old))?;
    }
    Ok(())
}

/// A fresh private directory for one test.
#[cfg(test)]
pub(crate) fn tempdir(tag: &str) -> PathBuf {
    crate::test_dir::fresh(&format!("config-{tag}"))
}

/// A fresh directory holding `policies.d` as a ConfigMap volume with `files` (its first
/// version, `..2026_12_03_07_00_00.1`): (the test's directory, `policies.d`).
#[cfg(test)]
pub(crate) fn volume(tag: &str, files: &[(&str, &str)]) -> (PathBuf, PathBuf) {
    let d = tempdir(tag);
    let dir = d.join(super::policies_dir::DIR_NAME);
    update(&dir, FIRST, files).expect("the kubelet's first update");
    (d, dir)
}

/// The timestamp of [`volume`]'s first version.
#[cfg(test)]
pub(crate) const FIRST: &str = "2026_12_03_07_00_00.1";
