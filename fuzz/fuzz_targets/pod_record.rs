//! A containerd container record as the containerd runtime classifies it
//! (`containerd::pod::classify` over `containerd::cgroup_path::parse`): labels and an OCI spec
//! that a pod's author shapes in part (annotations) and a node's other tenants may write in full
//! (`ctr` in the `k8s.io` namespace). Input: the first byte picks the kubelet root (cgroupfs,
//! systemd, a nested one); the rest is `id \0 labels \0 spec-json`, labels as `k=v` lines.
//! Invariants: never panics; a pod's directory is always under the root (clean, relative, no
//! `..`) and contains the container's; only `egress.*` annotations reach the policy; a record
//! classified `OutsideRoot` has a cgroups path that is not under the root.
#![no_main]

use std::collections::HashMap;
use std::path::{Component, Path};

use egress_agent::containerd::cgroup_path::{self, CgroupPathError};
use egress_agent::containerd::pod::{Record, RecordError, classify};
use libfuzzer_sys::fuzz_target;

const ROOTS: [&str; 3] = ["/kubepods", "/kubepods.slice", "/egress/test/kubepods"];

fn clean_under(dir: &Path, root: &str) {
    assert!(dir.is_relative(), "{dir:?}");
    assert!(
        dir.components().all(|c| matches!(c, Component::Normal(_))),
        "{dir:?} is not clean"
    );
    let root = Path::new(root.trim_start_matches('/'));
    assert!(dir.starts_with(root) && dir != root, "{dir:?} is not under {root:?}");
}

fuzz_target!(|data: &[u8]| {
    let Some((pick, rest)) = data.split_first() else {
        return;
    };
    let root = ROOTS[usize::from(*pick) % ROOTS.len()];
    let mut parts = rest.splitn(3, |b| *b == 0);
    let id = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let labels: HashMap<String, String> = String::from_utf8_lossy(parts.next().unwrap_or_default())
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let spec = parts.next().unwrap_or_default();

    // The path parser alone, on the spec's cgroups path (or the raw text).
    let path = serde_json::from_slice::<serde_json::Value>(spec)
        .ok()
        .and_then(|v| v.pointer("/linux/cgroupsPath")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(spec).into_owned());
    match cgroup_path::parse(&path, root) {
        Ok(c) => {
            clean_under(&c.pod_dir, root);
            assert!(c.container_dir.starts_with(&c.pod_dir), "{c:?}");
        }
        Err(CgroupPathError::OutsideRoot(..)) | Err(CgroupPathError::NotAPod(_)) => {}
    }

    match classify(&id, &labels, spec, root) {
        Ok(Record::Sandbox(sb)) => {
            clean_under(&sb.cgroup.pod_dir, root);
            assert!(sb.cgroup.container_dir.starts_with(&sb.cgroup.pod_dir));
            assert!(
                sb.annotations
                    .keys()
                    .all(|k| k.to_ascii_lowercase().starts_with("egress.")),
                "{:?}",
                sb.annotations
            );
            let w = sb.workload(None);
            let place = w.pod.expect("a pod's workload has its placement");
            assert_eq!(place.cgroup_dir, sb.cgroup.pod_dir);
            assert!(w.labels.keys().all(|k| sb.annotations.contains_key(k)));
        }
        Ok(Record::App(app)) => {
            clean_under(&app.cgroup.pod_dir, root);
            assert!(!app.sandbox_id.is_empty());
        }
        Err(RecordError::OutsideRoot { path, .. }) => {
            assert!(
                !matches!(cgroup_path::parse(&path, root), Ok(_)),
                "{path:?} is under {root:?}"
            );
        }
        Err(_) => {}
    }
});
