//! What a containerd container record says about a Kubernetes pod: pure parsing, no I/O.
//!
//! The CRI plugin makes one containerd container per pod sandbox (the "pause" container) and one
//! per app, init or ephemeral container. Both carry the kubelet's labels
//! (`io.kubernetes.pod.{namespace,name,uid}`) and the plugin's kind label
//! (`io.cri-containerd.kind` = `sandbox` | `container`); the OCI spec carries the cgroups path
//! and the pod's annotations that the runtime handler lets through (`pod_annotations =
//! ["egress.*"]` in containerd's CRI configuration: see docs/operations.md, "Kubernetes").
use std::collections::{BTreeMap, HashMap};

use super::cgroup_path::{self, CgroupPathError, PodCgroup};
use crate::workload::info::ContainerInfo;

pub const LABEL_KIND: &str = "io.cri-containerd.kind";
pub const LABEL_POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const LABEL_POD_NAME: &str = "io.kubernetes.pod.name";
pub const LABEL_POD_UID: &str = "io.kubernetes.pod.uid";
pub const LABEL_CONTAINER_NAME: &str = "io.kubernetes.container.name";
/// The spec annotation naming an app container's sandbox.
pub const ANNOTATION_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The spec annotation naming an app container (the kubelet's container name).
pub const ANNOTATION_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";

/// Event context keys for pods (in [`crate::events`], which metrics and the directory read).
pub use crate::events::{CTX_CONTAINER, CTX_NAMESPACE, CTX_POD, CTX_POD_UID};

/// The pod a record belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A containerd container of the CRI plugin, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A pod's sandbox: the pod starts (and its entry is written) here.
    Sandbox(Sandbox),
    /// An app, init or ephemeral container of a pod.
    App(App),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// The sandbox id (containerd container id).
    pub id: String,
    pub pod: PodRef,
    /// The pod's `egress.*` annotations (as the OCI spec carries them).
    pub annotations: BTreeMap<String, String>,
    pub cgroup: PodCgroup,
    /// `hostNetwork: true`: the sandbox has no network namespace of its own (its OCI spec lists
    /// none), so the pod's sockets are the node's: the cgroup programs confine it, and it has
    /// no interface for the host layer.
    pub host_network: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct App {
    pub id: String,
    pub sandbox_id: String,
    pub name: String,
    pub pod: PodRef,
    pub cgroup: PodCgroup,
    /// Its environment (the OCI spec's `process.env`, named by the container), checked for real
    /// keys (`crate::exposure`).
    pub env: crate::exposure::WorkloadEnv,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Not made by the CRI plugin (e.g. `ctr run` in the same namespace): not a pod.
    #[error("container {0} has no {LABEL_KIND} label: not a CRI pod container")]
    NotCri(String),
    #[error("container {id}: label {label} is missing")]
    MissingLabel { id: String, label: &'static str },
    #[error("container {id}: its OCI spec is unreadable: {why}")]
    Spec { id: String, why: String },
    #[error("container {id}: {source}")]
    Cgroup {
        id: String,
        #[source]
        source: CgroupPathError,
    },
    /// A CRI container whose cgroup is not under the kubelet root the programs are attached to:
    /// nothing confines it. `opted_in`: its pod has `egress.*` annotations (then it must not
    /// run: the watcher kills it).
    #[error(
        "container {id}: cgroup {path:?} is outside [kubernetes] cgroup_root {root:?}: it is not confined (is cgroup_root the kubelet's root?)"
    )]
    OutsideRoot {
        id: String,
        path: String,
        root: String,
        opted_in: bool,
    },
}

/// Classify a containerd container from its labels and its OCI spec (JSON), against the
/// kubelet's cgroup root.
pub fn classify(
    id: &str,
    labels: &HashMap<String, String>,
    spec_json: &[u8],
    cgroup_root: &str,
) -> Result<Record, RecordError> {
    let kind = labels
        .get(LABEL_KIND)
        .ok_or_else(|| RecordError::NotCri(id.to_owned()))?;
    let label = |label: &'static str| {
        labels
            .get(label)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or(RecordError::MissingLabel {
                id: id.to_owned(),
                label,
            })
    };
    let pod = PodRef {
        namespace: label(LABEL_POD_NAMESPACE)?,
        name: label(LABEL_POD_NAME)?,
        uid: label(LABEL_POD_UID)?,
    };
    let spec: serde_json::Value =
        serde_json::from_slice(spec_json).map_err(|e| RecordError::Spec {
            id: id.to_owned(),
            why: e.to_string(),
        })?;
    let cgroups_path = spec
        .pointer("/linux/cgroupsPath")
        .and_then(|v| v.as_str())
        .ok_or_else(|| RecordError::Spec {
            id: id.to_owned(),
            why: "no linux.cgroupsPath".to_owned(),
        })?;
    let annotations: BTreeMap<String, String> = spec
        .get("annotations")
        .and_then(|a| a.as_object())
        .map(|a| {
            a.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    let cgroup = cgroup_path::parse(cgroups_path, cgroup_root).map_err(|source| match source {
        CgroupPathError::OutsideRoot(path, root) => RecordError::OutsideRoot {
            id: id.to_owned(),
            path,
            root,
            opted_in: annotations
                .keys()
                .any(|k| k.to_ascii_lowercase().starts_with("egress.")),
        },
        source => RecordError::Cgroup {
            id: id.to_owned(),
            source,
        },
    })?;
    if kind == "sandbox" {
        let host_network = !spec
            .pointer("/linux/namespaces")
            .and_then(|n| n.as_array())
            .is_some_and(|n| n.iter().any(|ns| ns["type"] == "network"));
        let egress = annotations
            .into_iter()
            .filter(|(k, _)| k.to_ascii_lowercase().starts_with("egress."))
            .collect();
        return Ok(Record::Sandbox(Sandbox {
            id: id.to_owned(),
            pod,
            annotations: egress,
            cgroup,
            host_network,
        }));
    }
    let sandbox_id = annotations
        .get(ANNOTATION_SANDBOX_ID)
        .cloned()
        .ok_or_else(|| RecordError::Spec {
            id: id.to_owned(),
            why: format!("no {ANNOTATION_SANDBOX_ID} annotation"),
        })?;
    let name = annotations
        .get(ANNOTATION_CONTAINER_NAME)
        .or_else(|| labels.get(LABEL_CONTAINER_NAME))
        .cloned()
        .unwrap_or_default();
    let env = crate::exposure::WorkloadEnv::from_entries(
        Some(&name),
        spec.pointer("/process/env")
            .and_then(|e| e.as_array())
            .into_iter()
            .flatten()
            .filter_map(|e| e.as_str()),
    );
    Ok(Record::App(App {
        id: id.to_owned(),
        sandbox_id,
        name,
        pod,
        cgroup,
        env,
    }))
}

impl PodRef {
    /// `namespace/name`: how pods are named in events, `status` and the CLI.
    pub fn display_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The context keys every event of this pod carries.
    pub fn context(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (CTX_NAMESPACE.to_owned(), self.namespace.clone()),
            (CTX_POD.to_owned(), self.name.clone()),
            (CTX_POD_UID.to_owned(), self.uid.clone()),
        ])
    }
}

impl Sandbox {
    /// The pod as the shared enforcer sees a workload: its sandbox id, `namespace/name`, its
    /// `egress.*` annotations in the place of labels, and its pod-level cgroup.
    /// `pid`: the sandbox's process, once its task runs (the host layer finds the pod's
    /// interfaces through it).
    pub fn workload(&self, pid: Option<u32>) -> ContainerInfo {
        let mut info = ContainerInfo::from_event(&self.id, &HashMap::new());
        info.name = self.pod.display_name();
        info.pid = pid;
        info.running = pid.is_some();
        if self.host_network {
            info.network_mode = "host".to_owned();
        }
        info.labels = self
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        info.pod = Some(crate::workload::info::PodPlacement {
            namespace: self.pod.namespace.clone(),
            context: self.pod.context(),
            cgroup_dir: self.cgroup.pod_dir.clone(),
        });
        info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SANDBOX: &str = "1f2e3d4c5b6a79880f1e2d3c4b5a69788f9e0d1c2b3a49586f7e8d9c0b1a2938";
    const APP: &str = "aa2e3d4c5b6a79880f1e2d3c4b5a69788f9e0d1c2b3a49586f7e8d9c0b1a29bb";
    const UID: &str = "0b9c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3";

    fn labels(kind: &str) -> HashMap<String, String> {
        HashMap::from([
            (LABEL_KIND.to_owned(), kind.to_owned()),
            (LABEL_POD_NAMESPACE.to_owned(), "ci".to_owned()),
            (LABEL_POD_NAME.to_owned(), "build-1".to_owned()),
            (LABEL_POD_UID.to_owned(), UID.to_owned()),
        ])
    }

    fn spec(path: &str, annotations: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "linux": { "cgroupsPath": path },
            "annotations": annotations,
        }))
        .expect("json")
    }

    #[test]
    fn a_sandbox_is_a_pod_with_its_egress_annotations() {
        let s = spec(
            &format!("/kubepods/besteffort/pod{UID}/{SANDBOX}"),
            serde_json::json!({
                "io.kubernetes.cri.container-type": "sandbox",
                "egress.policy": "web",
                "other": "x",
            }),
        );
        let Ok(Record::Sandbox(sb)) = classify(SANDBOX, &labels("sandbox"), &s, "/kubepods") else {
            panic!("not a sandbox");
        };
        assert_eq!(sb.pod.display_name(), "ci/build-1");
        assert_eq!(
            sb.annotations,
            BTreeMap::from([("egress.policy".to_owned(), "web".to_owned())])
        );
        // This spec lists no network namespace: a hostNetwork pod.
        assert!(sb.host_network);
        let w = sb.workload(Some(42));
        assert!(w.host_network() && w.running && w.pid == Some(42));
        assert_eq!(w.id, SANDBOX);
        assert_eq!(
            w.labels.get("egress.policy").map(String::as_str),
            Some("web")
        );
        let place = w.pod.expect("pod placement");
        assert_eq!(
            place.cgroup_dir,
            std::path::PathBuf::from(format!("kubepods/besteffort/pod{UID}"))
        );
        assert_eq!(
            place.context.get(CTX_POD_UID).map(String::as_str),
            Some(UID)
        );
    }

    #[test]
    fn a_sandbox_with_a_network_namespace_is_on_the_pod_network() {
        let s = serde_json::to_vec(&serde_json::json!({
            "linux": {
                "cgroupsPath": format!("/kubepods/besteffort/pod{UID}/{SANDBOX}"),
                "namespaces": [
                    { "type": "pid" },
                    { "type": "network", "path": "/var/run/netns/cni-0b9c1d2e" },
                ],
            },
        }))
        .expect("json");
        let Ok(Record::Sandbox(sb)) = classify(SANDBOX, &labels("sandbox"), &s, "/kubepods") else {
            panic!("not a sandbox");
        };
        assert!(!sb.host_network);
        assert!(!sb.workload(None).host_network());
    }

    #[test]
    fn an_app_container_names_its_sandbox_and_itself() {
        let s = spec(
            &format!("/kubepods/besteffort/pod{UID}/{APP}"),
            serde_json::json!({
                ANNOTATION_SANDBOX_ID: SANDBOX,
                ANNOTATION_CONTAINER_NAME: "main",
            }),
        );
        let Ok(Record::App(app)) = classify(APP, &labels("container"), &s, "/kubepods") else {
            panic!("not an app container");
        };
        assert_eq!(
            (app.sandbox_id.as_str(), app.name.as_str()),
            (SANDBOX, "main")
        );
        assert!(app.env.is_empty());
        // Its environment, named by the container; values never in `Debug`.
        let mut with_env: serde_json::Value = serde_json::from_slice(&s).expect("json");
        with_env["process"] =
            serde_json::json!({ "env": ["PATH=/bin", "OPENAI_API_KEY=sk-pod-value"] });
        let s = serde_json::to_vec(&with_env).expect("json");
        let Ok(Record::App(app)) = classify(APP, &labels("container"), &s, "/kubepods") else {
            panic!("not an app container");
        };
        let shown = format!("{app:?}");
        assert!(
            shown.contains("main/OPENAI_API_KEY") && !shown.contains("sk-pod-value"),
            "{shown}"
        );
    }

    #[test]
    fn records_that_are_not_pods_are_refused_with_the_reason() {
        let s = spec(
            &format!("/kubepods/besteffort/pod{UID}/{SANDBOX}"),
            serde_json::json!({}),
        );
        assert!(matches!(
            classify(SANDBOX, &HashMap::new(), &s, "/kubepods"),
            Err(RecordError::NotCri(_))
        ));
        let mut l = labels("sandbox");
        l.remove(LABEL_POD_UID);
        assert!(matches!(
            classify(SANDBOX, &l, &s, "/kubepods"),
            Err(RecordError::MissingLabel {
                label: LABEL_POD_UID,
                ..
            })
        ));
        assert!(matches!(
            classify(SANDBOX, &labels("sandbox"), b"{not json", "/kubepods"),
            Err(RecordError::Spec { .. })
        ));
        let elsewhere = spec(&format!("/docker/{SANDBOX}"), serde_json::json!({}));
        assert!(matches!(
            classify(SANDBOX, &labels("sandbox"), &elsewhere, "/kubepods"),
            Err(RecordError::OutsideRoot {
                opted_in: false,
                ..
            })
        ));
        // An annotated pod outside the root is flagged: the watcher must not let it run.
        let annotated = spec(
            &format!("/other/besteffort/pod{UID}/{SANDBOX}"),
            serde_json::json!({ "egress.policy": "web" }),
        );
        assert!(matches!(
            classify(SANDBOX, &labels("sandbox"), &annotated, "/kubepods"),
            Err(RecordError::OutsideRoot { opted_in: true, .. })
        ));
        let garbled = spec(&format!("/kubepods/x/y/z/{SANDBOX}"), serde_json::json!({}));
        assert!(matches!(
            classify(SANDBOX, &labels("sandbox"), &garbled, "/kubepods"),
            Err(RecordError::Cgroup { .. })
        ));
        // An app container without its sandbox id can't be attributed.
        assert!(matches!(
            classify(APP, &labels("container"), &s, "/kubepods"),
            Err(RecordError::Spec { .. })
        ));
    }
}
