//! Where a pod lives in the cgroup2 hierarchy, read from the path runc is given — never guessed.
//!
//! The kubelet's two cgroup drivers put a pod's containers in:
//! - cgroupfs: `/kubepods/<qos>/pod<uid>/<container-id>` (guaranteed pods have no `<qos>`
//!   level: `/kubepods/pod<uid>/<id>`); the OCI spec's `linux.cgroupsPath` is that path.
//! - systemd: `/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope`;
//!   the OCI spec says `kubepods-<qos>-pod<uid_>.slice:cri-containerd:<id>` (slice:prefix:name),
//!   and the slice's directory is made by systemd from the dashes of its name.
//!
//! The pod's directory (its entry covers every container of the pod) is the parent of the
//! container's.
use std::path::{Component, Path, PathBuf};

/// The pod's QoS class as the kubelet names its cgroup level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

/// A container's place under the kubelet's root, parsed from its cgroups path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodCgroup {
    /// The pod's directory relative to the cgroup2 mount, without a leading `/`
    /// (`kubepods/besteffort/pod<uid>`).
    pub pod_dir: PathBuf,
    /// The container's directory, relative likewise.
    pub container_dir: PathBuf,
    pub qos: Qos,
    /// The pod uid as the path spells it (dashes restored for the systemd layout).
    pub uid: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CgroupPathError {
    #[error("cgroups path {0:?} is not under the kubelet root {1:?}")]
    OutsideRoot(String, String),
    #[error(
        "cgroups path {0:?} is not a kubelet pod path (expected <root>/[<qos>/]pod<uid>/<id> or the systemd slice form)"
    )]
    NotAPod(String),
}

/// Parse the `linux.cgroupsPath` of a container's OCI spec (either driver's form) against the
/// kubelet root (`/kubepods` or `/kubepods.slice`, relative to the cgroup2 mount).
pub fn parse(cgroups_path: &str, root: &str) -> Result<PodCgroup, CgroupPathError> {
    if !cgroups_path.starts_with('/') && cgroups_path.matches(':').count() == 2 {
        return parse_systemd_triple(cgroups_path, root);
    }
    let root_rel = clean(root).ok_or_else(|| not_a_pod(cgroups_path))?;
    let path = clean(cgroups_path).ok_or_else(|| not_a_pod(cgroups_path))?;
    let rest = path
        .strip_prefix(&root_rel)
        .map_err(|_| CgroupPathError::OutsideRoot(cgroups_path.to_owned(), root.to_owned()))?;
    let parts: Vec<&str> = rest.iter().filter_map(|c| c.to_str()).collect();
    let (qos, pod, _id) = match parts.as_slice() {
        [pod, id] => (None, *pod, *id),
        [qos, pod, id] => (Some(*qos), *pod, *id),
        _ => return Err(not_a_pod(cgroups_path)),
    };
    let systemd = root_rel.extension().is_some_and(|e| e == "slice");
    let (qos, uid) = if systemd {
        systemd_pod(qos, pod).ok_or_else(|| not_a_pod(cgroups_path))?
    } else {
        let qos = match qos {
            None => Qos::Guaranteed,
            Some("burstable") => Qos::Burstable,
            Some("besteffort") => Qos::BestEffort,
            Some(_) => return Err(not_a_pod(cgroups_path)),
        };
        let uid = pod.strip_prefix("pod").filter(|u| valid_uid(u));
        (qos, uid.ok_or_else(|| not_a_pod(cgroups_path))?.to_owned())
    };
    let container_dir = path.clone();
    let pod_dir = path
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| not_a_pod(cgroups_path))?;
    Ok(PodCgroup {
        pod_dir,
        container_dir,
        qos,
        uid,
    })
}

/// `kubepods-besteffort-pod<uid_>.slice:cri-containerd:<id>` → the directories systemd makes.
fn parse_systemd_triple(triple: &str, root: &str) -> Result<PodCgroup, CgroupPathError> {
    let mut it = triple.split(':');
    let (slice, prefix, id) = match (it.next(), it.next(), it.next()) {
        (Some(s), Some(p), Some(i)) if !s.is_empty() && !i.is_empty() => (s, p, i),
        _ => return Err(not_a_pod(triple)),
    };
    let slice_dir = slice_path(slice).ok_or_else(|| not_a_pod(triple))?;
    let scope = if prefix.is_empty() {
        format!("{id}.scope")
    } else {
        format!("{prefix}-{id}.scope")
    };
    let full = format!("/{}/{scope}", slice_dir.display());
    parse(&full, root)
}

/// systemd's directory for a slice: `a-b-c.slice` is `a.slice/a-b.slice/a-b-c.slice`.
fn slice_path(slice: &str) -> Option<PathBuf> {
    let name = slice.strip_suffix(".slice")?;
    if name.is_empty() || name.contains('/') || name.starts_with('-') || name.ends_with('-') {
        return None;
    }
    let mut out = PathBuf::new();
    let mut acc = String::new();
    for part in name.split('-') {
        if part.is_empty() {
            return None;
        }
        if !acc.is_empty() {
            acc.push('-');
        }
        acc.push_str(part);
        out.push(format!("{acc}.slice"));
    }
    Some(out)
}

/// The systemd layout's QoS and pod levels: (`kubepods-besteffort.slice`,
/// `kubepods-besteffort-pod<uid_>.slice`), or for a guaranteed pod no QoS level and
/// `kubepods-pod<uid_>.slice`.
fn systemd_pod(qos: Option<&str>, pod: &str) -> Option<(Qos, String)> {
    let pod = pod.strip_suffix(".slice")?;
    let (qos, prefix) = match qos {
        None => (Qos::Guaranteed, "kubepods-pod"),
        Some("kubepods-burstable.slice") => (Qos::Burstable, "kubepods-burstable-pod"),
        Some("kubepods-besteffort.slice") => (Qos::BestEffort, "kubepods-besteffort-pod"),
        Some(_) => return None,
    };
    let uid = pod.strip_prefix(prefix)?.replace('_', "-");
    valid_uid(&uid).then_some((qos, uid))
}

/// A pod uid as the kubelet writes it into paths: a UUID's characters (hex and dashes), or for
/// static pods a hash (hex). Anything else is not a path this code should trust.
fn valid_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.len() <= 64 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// `path` relative to the mount, normal components only (no `..`, `.`, empty).
fn clean(path: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in Path::new(path).components() {
        match c {
            Component::RootDir => {}
            Component::Normal(s) => out.push(s),
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

fn not_a_pod(p: &str) -> CgroupPathError {
    CgroupPathError::NotAPod(p.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "8f1c2a6e-3b1d-4c55-9a0b-0c1d2e3f4a5b";
    const ID: &str = "4b8e5f0a1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f";

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn cgroupfs_layouts() {
        let c = parse(&format!("/kubepods/besteffort/pod{UID}/{ID}"), "/kubepods").expect("ok");
        assert_eq!(c.pod_dir, p(&format!("kubepods/besteffort/pod{UID}")));
        assert_eq!(
            c.container_dir,
            p(&format!("kubepods/besteffort/pod{UID}/{ID}"))
        );
        assert_eq!((c.qos, c.uid.as_str()), (Qos::BestEffort, UID));
        let c = parse(&format!("/kubepods/burstable/pod{UID}/{ID}"), "/kubepods").expect("ok");
        assert_eq!(c.qos, Qos::Burstable);
        // Guaranteed pods have no QoS level.
        let c = parse(&format!("/kubepods/pod{UID}/{ID}"), "kubepods/").expect("ok");
        assert_eq!(c.pod_dir, p(&format!("kubepods/pod{UID}")));
        assert_eq!(c.qos, Qos::Guaranteed);
    }

    #[test]
    fn systemd_layouts_by_path_and_by_triple() {
        let uid_ = UID.replace('-', "_");
        let path = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{ID}.scope"
        );
        let c = parse(&path, "/kubepods.slice").expect("path form");
        assert_eq!(
            c.pod_dir,
            p(&format!(
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice"
            ))
        );
        assert_eq!((c.qos, c.uid.as_str()), (Qos::BestEffort, UID));
        // The OCI spec's form for the systemd driver names the same directories.
        let triple = format!("kubepods-besteffort-pod{uid_}.slice:cri-containerd:{ID}");
        assert_eq!(parse(&triple, "/kubepods.slice").expect("triple"), c);
        let guaranteed = format!("kubepods-pod{uid_}.slice:cri-containerd:{ID}");
        let g = parse(&guaranteed, "/kubepods.slice").expect("guaranteed");
        assert_eq!(g.qos, Qos::Guaranteed);
        assert_eq!(
            g.pod_dir,
            p(&format!("kubepods.slice/kubepods-pod{uid_}.slice"))
        );
        let burst = format!("kubepods-burstable-pod{uid_}.slice:cri-containerd:{ID}");
        assert_eq!(
            parse(&burst, "/kubepods.slice").expect("b").qos,
            Qos::Burstable
        );
    }

    #[test]
    fn anything_else_is_refused() {
        for bad in [
            format!("/docker/{ID}"),
            format!("/kubepods/besteffort/pod{UID}"),
            format!("/kubepods/weird/pod{UID}/{ID}"),
            format!("/kubepods/besteffort/pod{UID}/{ID}/extra"),
            format!("/kubepods/besteffort/pod../{ID}"),
            format!("/kubepods/besteffort/../pod{UID}/{ID}"),
            format!("/kubepods/besteffort/podNOT_A_UID/{ID}"),
            format!("/kubepods/besteffort/x{UID}/{ID}"),
            "/kubepods".to_owned(),
            String::new(),
            "a:b:c".to_owned(),
            format!("kubepods-besteffort-pod{UID}.slice::"),
            format!("-kubepods.slice:cri-containerd:{ID}"),
        ] {
            assert!(parse(&bad, "/kubepods").is_err(), "{bad:?} accepted");
        }
        // A cgroupfs path under the systemd root name (and back) is not mixed up.
        assert!(
            parse(
                &format!("/kubepods/besteffort/pod{UID}/{ID}"),
                "/kubepods.slice"
            )
            .is_err()
        );
        assert!(matches!(
            parse(
                &format!("/kubepods-x/besteffort/pod{UID}/{ID}"),
                "/kubepods"
            ),
            Err(CgroupPathError::OutsideRoot(..))
        ));
    }
}
