//! What the enforcer knows about a workload (a Docker container, a Kubernetes pod, a command
//! under `exec`), whatever runtime reported it: each runtime fills a [`ContainerInfo`]
//! (`docker::container` from `docker inspect`, `containerd::pod` from containerd's records,
//! [`ContainerInfo::command`] for `exec`).
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;

/// One network endpoint as the runtime reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetEndpoint {
    pub network: String,
    pub mac: [u8; 6],
    pub ipv4: Ipv4Addr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerInfo {
    pub id: String,
    /// Without the leading `/`.
    pub name: String,
    pub labels: HashMap<String, String>,
    pub running: bool,
    /// Main process pid while running.
    pub pid: Option<u32>,
    /// `HostConfig.CgroupParent` (empty: the daemon's default).
    pub cgroup_parent: String,
    /// `HostConfig.NetworkMode` (`default`, `bridge`, `host`, `none`, `container:<id>`, a network).
    pub network_mode: String,
    pub endpoints: Vec<NetEndpoint>,
    /// `--rm`: removed after it exits (no restart to prepare for).
    pub auto_remove: bool,
    /// Container TCP ports the operator published (`-p`, `HostConfig.PortBindings`), sorted.
    pub published_tcp: Vec<u16>,
    /// Reasons this container can't be confined (privileged, dangerous capabilities or mounts).
    pub unconfinable: Vec<String>,
    /// Set for a Kubernetes pod (the containerd runtime): the workload is the whole pod.
    pub pod: Option<PodPlacement>,
    /// Its environment (`Config.Env`; a pod's: its app containers'), checked for real keys
    /// (`crate::exposure`). Empty when not known yet (from a `create` event).
    pub env: crate::exposure::WorkloadEnv,
}

/// Where a pod's entry goes and what names it: a pod is enforced at its pod-level cgroup, which
/// covers the sandbox and every later container of the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPlacement {
    /// The pod's Kubernetes namespace (for `[kubernetes] namespace_defaults`).
    pub namespace: String,
    /// Event context: `k8s.namespace.name`, `k8s.pod.name`, `k8s.pod.uid`.
    pub context: std::collections::BTreeMap<String, String>,
    /// The pod-level cgroup directory, relative to the cgroup2 mount.
    pub cgroup_dir: std::path::PathBuf,
}

impl ContainerInfo {
    /// A command run by `exec` with policy `policy`: `id` is `exec:<pid of exec>`, `name` the
    /// command's. It runs in the host's network namespace (no host-layer rules: no interface of
    /// its own), nothing is published, and its environment is checked by `exec` itself (which
    /// refuses to start it rather than confining it).
    /// `labels`: the command's context labels (`exec --label`, checked by
    /// [`crate::workload::labels::command_labels`]); its policy is `policy`.
    pub fn command(
        id: String,
        name: String,
        policy: &str,
        labels: BTreeMap<String, String>,
    ) -> ContainerInfo {
        let mut labels: HashMap<String, String> = labels.into_iter().collect();
        labels.insert(
            crate::workload::labels::LABEL_POLICY.to_owned(),
            policy.to_owned(),
        );
        ContainerInfo {
            id,
            name,
            labels,
            running: true,
            pid: None,
            cgroup_parent: String::new(),
            network_mode: "host".to_owned(),
            endpoints: Vec::new(),
            auto_remove: true,
            published_tcp: Vec::new(),
            unconfinable: Vec::new(),
            pod: None,
            env: crate::exposure::WorkloadEnv::default(),
        }
    }

    pub fn host_network(&self) -> bool {
        self.network_mode == "host"
    }
}

/// `aa:bb:cc:dd:ee:ff` → bytes.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut out {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}
