//! cgroup v2 helpers: find the mount, create/remove cgroups, ids.
//!
//! The cgroup2 mount is read from /proc/self/mountinfo (hybrid hosts mount it at
//! /sys/fs/cgroup/unified, pure v2 hosts at /sys/fs/cgroup): never hard-coded. A cgroup's id (what
//! `bpf_get_current_cgroup_id()` returns) is the inode number of its directory.
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::mountinfo;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup2 filesystem in /proc/self/mountinfo")]
    NotMounted,
    #[error("reading /proc/self/mountinfo: {0}")]
    Mountinfo(#[source] io::Error),
}

/// Mount point of the (first) cgroup2 filesystem.
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(CgroupError::Mountinfo)?;
    parse_mountinfo(&info).ok_or(CgroupError::NotMounted)
}

fn parse_mountinfo(info: &str) -> Option<PathBuf> {
    mountinfo::parse(info)
        .into_iter()
        .find(|m| m.fstype == "cgroup2")
        .map(|m| m.mount_point)
}


/// The cgroup id of a cgroup2 directory.
pub fn cgroup_id(path: &Path) -> io::Result<u64> {
    Ok(std::fs::metadata(path)?.ino())
}

/// The cgroup2 path of a process (from /proc/<pid>/cgroup, the `0::` line).
pub fn cgroup_of_pid(pid: u32) -> io::Result<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| io::Error::other("no cgroup2 line in /proc/<pid>/cgroup"))?;
    let mount = cgroup2_mount().map_err(io::Error::other)?;
    Ok(mount.join(rel.trim_start_matches('/')))
}

/// Every cgroup under `mount`: id → path (bounded depth).
pub fn all_ids(mount: &Path) -> HashMap<u64, PathBuf> {
    let mut out = HashMap::new();
    let mut stack = vec![(mount.to_owned(), 0u32)];
    while let Some((dir, depth)) = stack.pop() {
        if let Ok(md) = std::fs::metadata(&dir) {
            out.insert(md.ino(), dir.clone());
        }
        if depth >= egress_common::MAX_CGROUP_DEPTH {
            continue;
        }
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    stack.push((e.path(), depth + 1));
                }
            }
        }
    }
    out
}

/// Move process `pid` (0 = the caller) into the cgroup at `path`.
pub fn move_pid(path: &Path, pid: u32) -> io::Result<()> {
    std::fs::write(path.join("cgroup.procs"), pid.to_string())
}

/// Pids in a cgroup.
pub fn pids(path: &Path) -> io::Result<Vec<u32>> {
    Ok(std::fs::read_to_string(path.join("cgroup.procs"))?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect())
}

/// Kill everything in the cgroup (cgroup.kill, 5.14+; else SIGKILL each pid), wait until it is
/// empty, then remove it. Gives up after `timeout`.
pub fn kill_and_remove(path: &Path, timeout: Duration) -> io::Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let deadline = Instant::now() + timeout;
    loop {
        match std::fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        if std::fs::write(path.join("cgroup.kill"), "1").is_err() {
            for pid in pids(path).unwrap_or_default() {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .ok();
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_layout() {
        let info = "25 30 0:23 / /sys rw - sysfs sysfs rw\n\
                    41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n\
                    42 31 0:39 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(
            parse_mountinfo(info),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn unescape_takes_only_three_octal_digits_of_a_byte() {
        for (raw, want) in [
            ("a\\040b", "a b"),
            ("end\\134", "end\\"),
            ("\\011tab", "\ttab"),
            ("short\\04", "short\\04"),
            ("not\\089", "not\\089"),
            ("big\\777", "big\\777"),
            ("sign\\+12", "sign\\+12"),
        ] {
            assert_eq!(mountinfo::unescape(raw), want, "{raw}");
        }
    }

    #[test]
    fn unescapes_mount_points() {
        let info = "41 31 0:38 / /mnt/my\\040cg rw - cgroup2 none rw\n";
        assert_eq!(parse_mountinfo(info), Some(PathBuf::from("/mnt/my cg")));
        assert_eq!(
            parse_mountinfo("25 30 0:23 / /sys rw - sysfs sysfs rw\n"),
            None
        );
    }
}
