//! Before a change writes: is every directory it writes to one the API may write? A policies
//! directory laid out by the kubelet (a ConfigMap volume: `..data`) or on a read-only mount is
//! refused with the reason and the fix (edit the ConfigMap), before anything is written,
//! instead of an `EROFS`/`EACCES` error halfway.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::{FileOp, ManageError};
use crate::config::policies_dir::kubernetes_managed;

/// Refuse `ops` if a directory they write to can't or mustn't be written.
pub fn check(ops: &[FileOp]) -> Result<(), ManageError> {
    let dirs: BTreeSet<PathBuf> = ops
        .iter()
        .filter_map(|o| o.path.parent().map(Path::to_owned))
        .collect();
    dirs.iter().try_for_each(|d| check_dir(d))
}

pub(super) fn check_dir(dir: &Path) -> Result<(), ManageError> {
    if kubernetes_managed(dir) {
        return Err(ManageError::ReadOnly(format!(
            "{} is managed by Kubernetes (a ConfigMap volume) and read-only: its policies can't \
             be changed through the API; edit the ConfigMap instead (kubectl edit configmap \
             <name>), the agent reloads when the kubelet updates the volume. Nothing was changed",
            dir.display()
        )));
    }
    // A directory the write would create: the nearest one that exists decides.
    let existing = dir.ancestors().find(|a| a.exists()).unwrap_or(dir);
    match nix::unistd::access(existing, nix::unistd::AccessFlags::W_OK) {
        Ok(()) => Ok(()),
        Err(nix::Error::EROFS) => Err(ManageError::ReadOnly(format!(
            "{} is on a read-only mount: its policies can't be changed through the API; change \
             them where the mount comes from (a ConfigMap: kubectl edit configmap <name>), the \
             agent reloads when the files change. Nothing was changed",
            dir.display()
        ))),
        Err(e @ (nix::Error::EACCES | nix::Error::EPERM)) => Err(ManageError::ReadOnly(format!(
            "{} is not writable by the agent ({e}): its policies can't be changed through the \
             API. Nothing was changed",
            existing.display()
        ))),
        // Anything else shows up as the write's own error.
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::kubelet;

    fn op(path: PathBuf) -> FileOp {
        FileOp {
            path,
            before: None,
            after: Some("mode = \"allow_all\"\n".to_owned()),
        }
    }

    #[test]
    fn a_kubelet_layout_is_refused_and_a_plain_or_missing_directory_is_not() {
        let (d, k8s) = kubelet::volume("writable", &[("web.toml", "mode = \"allow_all\"\n")]);
        let e = check(&[op(k8s.join("ci.toml"))]).unwrap_err();
        assert_eq!(e.status(), 409);
        let e = e.to_string();
        assert!(
            e.contains("managed by Kubernetes") && e.contains("edit the ConfigMap"),
            "{e}"
        );
        check(&[op(d.join("plain/ci.toml"))]).unwrap();
        std::fs::create_dir(d.join("plain")).unwrap();
        check(&[op(d.join("plain/ci.toml"))]).unwrap();
        std::fs::remove_dir_all(&d).ok();
    }
}
