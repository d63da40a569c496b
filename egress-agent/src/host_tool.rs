//! External programs the agent runs (`ip`; the doctor's probes): found by absolute path on the
//! absolute entries of a search path, never run by bare name. A relative `PATH` entry (`.`, an
//! empty one) or the working directory can't substitute a program, and the path that was run can
//! be named in errors and logs.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

/// Searched when the process has no `PATH` (the image's and systemd's default directories).
pub const DEFAULT_SEARCH_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A program that is not on the search path.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{name}` not found (searched the absolute entries of {path})")]
pub struct NotFound {
    pub name: String,
    pub path: String,
}

/// `name` on the absolute entries of `path`, in order: the first regular file there.
pub fn find_on(path: &OsStr, name: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .filter(|d| d.is_absolute())
        .map(|d| d.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
}

/// The search path: this process's `PATH`, else [`DEFAULT_SEARCH_PATH`].
pub fn search_path() -> OsString {
    std::env::var_os("PATH")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| DEFAULT_SEARCH_PATH.into())
}

/// `name` by absolute path on [`search_path`].
pub fn find(name: &str) -> Result<PathBuf, NotFound> {
    let path = search_path();
    find_on(&path, name).ok_or_else(|| NotFound {
        name: name.to_owned(),
        path: path.to_string_lossy().into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_absolute_entries_are_searched() {
        let dir = crate::test_dir::fresh("host-tool");
        std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
        std::fs::write(dir.join("bin/tool"), "").expect("write");
        // A relative entry that would find it from the right working directory is skipped.
        let rel = OsString::from("bin");
        assert_eq!(find_on(&rel, "tool"), None);
        let abs = std::env::join_paths([
            PathBuf::from("relative"),
            dir.join("nothing"),
            dir.join("bin"),
        ])
        .expect("join");
        assert_eq!(find_on(&abs, "tool"), Some(dir.join("bin/tool")));
        // A directory of that name is not a program.
        std::fs::create_dir_all(dir.join("bin2/tool")).expect("mkdir");
        assert_eq!(find_on(dir.join("bin2").as_os_str(), "tool"), None);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn finds_sh_by_absolute_path() {
        let p = find("sh").expect("sh on the search path");
        assert!(p.is_absolute(), "{}", p.display());
        let e = find_on(OsStr::new("/nonexistent"), "sh");
        assert_eq!(e, None);
    }
}
