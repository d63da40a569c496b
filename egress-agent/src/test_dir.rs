//! One fresh private directory per unit test.
//!
//! A name made of the pid alone is not unique across runs: a CI container starts its pid
//! namespace over, so a second run of the test binary can get the first run's pid and find that
//! run's files in a `/tmp` that was kept (stop 37's CI failed that way: `manage` tests found a
//! `policies.d/ci.toml` from an earlier run). The name adds a nanosecond stamp and a sequence
//! number, and anything already at that path is removed first.
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// A new, empty directory (mode 0700) under the temporary directory, named for `tag`.
pub(crate) fn fresh(tag: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let d = std::env::temp_dir().join(format!(
        "egress-{tag}-{}-{stamp}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).expect("creating a test directory");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
        .expect("making a test directory private");
    d
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_calls_give_two_empty_directories() {
        let a = super::fresh("t");
        let b = super::fresh("t");
        assert_ne!(a, b);
        assert_eq!(std::fs::read_dir(&a).expect("a").count(), 0);
        assert_eq!(std::fs::read_dir(&b).expect("b").count(), 0);
    }
}
