//! The Docker enforcement root and containers' cgroup2 directories.
//!
//! With the cgroupfs driver (the only one that runs on this host; hybrid and pure cgroup2 alike)
//! runc puts a container in `<cgroup2>/<cgroup parent>/<id>` (parent default `/docker`) and
//! **reuses a directory that already exists**, which is what lets the agent prepare the cgroup —
//! and its policy entry — from the `create` event, before `start`. Checked on Docker 20.10 /
//! runc 1.1 in hybrid mode: the pre-created directory keeps its inode (= cgroup id) and runc
//! removes it when the container stops, so every start needs preparing again.
use std::io;
use std::path::{Path, PathBuf};

use crate::cgroup;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadRoot {
    /// The cgroup2 mount (from /proc/self/mountinfo).
    pub mount: PathBuf,
    /// The cgroup parent relative to the mount, without leading `/` (default `docker`).
    pub parent: String,
}

impl WorkloadRoot {
    pub fn new(mount: impl Into<PathBuf>, parent: &str) -> WorkloadRoot {
        WorkloadRoot {
            mount: mount.into(),
            parent: parent.trim_matches('/').to_owned(),
        }
    }

    /// The enforcement root (where the programs are attached).
    pub fn path(&self) -> PathBuf {
        self.mount.join(&self.parent)
    }

    /// Create the root if Docker has not yet (runc reuses it).
    pub fn ensure(&self) -> io::Result<PathBuf> {
        let p = self.path();
        std::fs::create_dir_all(&p)?;
        Ok(p)
    }

    /// Where runc will put container `id`, given its `HostConfig.CgroupParent`; `None` when that
    /// is outside the enforcement root (then the container is not confined by the root's programs).
    pub fn expected_dir(&self, id: &str, cgroup_parent: &str) -> Option<PathBuf> {
        let parent = cgroup_parent.trim_matches('/');
        let parent = if parent.is_empty() {
            self.parent.as_str()
        } else {
            parent
        };
        if !is_valid_id(id) || parent.split('/').any(|s| s == ".." || s == ".") {
            return None;
        }
        let dir = self.mount.join(parent).join(id);
        self.contains(&dir).then_some(dir)
    }

    /// Is `path` strictly below the root?
    pub fn contains(&self, path: &Path) -> bool {
        let root = self.path();
        path != root && path.starts_with(&root)
    }

    /// Create the container's (or pod's) directory before runc does (existing is fine; missing
    /// levels in between are made too, as runc would) and return its id.
    pub fn precreate(&self, dir: &Path) -> io::Result<u64> {
        match std::fs::create_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        cgroup::cgroup_id(dir)
    }

    /// Remove a directory the agent pre-created for a container that never ran (or was
    /// destroyed). Only removes it when empty; anything else is left alone.
    pub fn remove_if_unused(&self, dir: &Path) -> io::Result<()> {
        if !self.contains(dir) {
            return Ok(());
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Docker ids are 64 lowercase hex characters.
pub fn is_valid_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "394a915ef40ab609cd0fd0b73b77d8a44883f06ecf51fe68eb153cc6b31b4729";

    #[test]
    fn expected_dirs() {
        let r = WorkloadRoot::new("/sys/fs/cgroup/unified", "/docker");
        assert_eq!(r.path(), Path::new("/sys/fs/cgroup/unified/docker"));
        assert_eq!(
            r.expected_dir(ID, ""),
            Some(PathBuf::from(format!("/sys/fs/cgroup/unified/docker/{ID}")))
        );
        assert_eq!(
            r.expected_dir(ID, "/docker/ci"),
            Some(PathBuf::from(format!(
                "/sys/fs/cgroup/unified/docker/ci/{ID}"
            )))
        );
        assert_eq!(r.expected_dir(ID, "/elsewhere"), None, "outside the root");
        assert_eq!(r.expected_dir(ID, "/docker/../x"), None);
        assert_eq!(r.expected_dir("../../etc", ""), None);
        assert!(!r.contains(Path::new("/sys/fs/cgroup/unified/docker")));
        assert!(!r.contains(Path::new("/sys/fs/cgroup/unified/dockerx/a")));
    }
}
