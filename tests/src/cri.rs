//! The kubelet's side of CRI (v1, `k8s-cri` over tonic) against the harness's containerd
//! ([`crate::containerd`]): pods with the labels, annotations, log directory, cgroup parent and
//! namespace options a cgroupfs kubelet sends, and their containers.
//!
//! Every call makes a fresh client ([`Containerd::cri`]): a tonic channel belongs to the tokio
//! runtime it was made in, and [`Containerd::restart`] breaks open connections.
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::containerd::{Containerd, IMAGE, Qos, cgroup_parent_under};

/// The kubelet's pod labels (on the sandbox and on every container).
pub const LABEL_POD_NAME: &str = "io.kubernetes.pod.name";
pub const LABEL_POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const LABEL_POD_UID: &str = "io.kubernetes.pod.uid";
/// The kubelet's container-name label (containers only).
pub const LABEL_CONTAINER_NAME: &str = "io.kubernetes.container.name";

/// What a pod is made of, as the kubelet passes it to RunPodSandbox.
#[derive(Clone, Debug)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The pod's labels (the kubelet's `io.kubernetes.pod.*` are added).
    pub labels: BTreeMap<String, String>,
    /// The pod's annotations (`egress.*` ones reach the OCI spec of the sandbox).
    pub annotations: BTreeMap<String, String>,
    pub qos: Qos,
    /// `dns_config.servers` (the pod's /etc/resolv.conf); `None`: the host's resolv.conf.
    pub dns_nameserver: Option<Ipv4Addr>,
    /// `hostNetwork: true` (NamespaceMode::NODE): the pod runs in the *daemon's* network
    /// namespace ([`Containerd::netns`], the harness's node), no CNI; its [`Pod::ip`] is
    /// [`crate::containerd::GATEWAY`], the node's address on the pods' bridge.
    pub host_network: bool,
    /// `hostPID: true`: the host's PID namespace (and its /proc).
    pub host_pid: bool,
    /// A privileged sandbox (containerd refuses privileged containers in other pods).
    pub privileged: bool,
}

impl PodSpec {
    /// A best-effort pod `namespace/name` with a fresh uid, no labels or annotations.
    pub fn new(namespace: &str, name: &str) -> PodSpec {
        PodSpec {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: new_uid(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            qos: Qos::BestEffort,
            dns_nameserver: None,
            host_network: false,
            host_pid: false,
            privileged: false,
        }
    }

    /// With one more annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> PodSpec {
        self.annotations.insert(key.to_owned(), value.to_owned());
        self
    }

    /// With one more label.
    pub fn label(mut self, key: &str, value: &str) -> PodSpec {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }
}

/// A running pod sandbox.
#[derive(Clone, Debug)]
pub struct Pod {
    pub sandbox_id: String,
    /// The pod IP (CNI, on [`crate::containerd::SUBNET`]).
    pub ip: Ipv4Addr,
    pub spec: PodSpec,
    /// The cgroup parent given (`/kubepods/...`, see [`cgroup_parent`]).
    pub cgroup_parent: String,
    /// The pod's log directory (container logs are `<name>/0.log` under it).
    pub log_dir: PathBuf,
    /// The sandbox config it was created with (CreateContainer sends it again).
    config: cri::PodSandboxConfig,
}

/// An app container to create in a pod.
#[derive(Clone, Debug, Default)]
pub struct ContainerSpec {
    pub name: String,
    /// The image (`docker.io/library/<name>:<tag>`, imported beforehand, e.g. with
    /// [`Containerd::import_archive`]); `None`: the harness's [`IMAGE`].
    pub image: Option<String>,
    /// Replaces the image's entrypoint (Kubernetes' `command`; the harness image's default
    /// sleeps).
    pub command: Vec<String>,
    /// Container annotations (`egress.*` ones reach its OCI spec).
    pub annotations: BTreeMap<String, String>,
    pub envs: BTreeMap<String, String>,
    /// Read-only bind mounts (host path, container path).
    pub mounts: Vec<(String, String)>,
    /// Other host mounts (`hostPath` volumes with `readOnly` and `mountPropagation`).
    pub host_mounts: Vec<HostMount>,
    /// `securityContext.privileged` (the pod must be [`PodSpec::privileged`]).
    pub privileged: bool,
    /// `securityContext.runAsUser`.
    pub run_as_user: Option<i64>,
    /// `securityContext.readOnlyRootFilesystem`.
    pub readonly_rootfs: bool,
}

/// A host path mounted into a container (recursive bind, as containerd's CRI does).
#[derive(Clone, Debug)]
pub struct HostMount {
    pub host: PathBuf,
    pub container: String,
    pub readonly: bool,
    /// `Bidirectional` needs a shared mount at `host` and `HostToContainer` a shared or slave
    /// one (containerd checks); this machine's mounts are private: see
    /// [`crate::containerd::SharedDir`].
    pub propagation: cri::MountPropagation,
}

impl HostMount {
    /// A read-write mount without propagation.
    pub fn rw(host: impl Into<PathBuf>, container: &str) -> HostMount {
        HostMount {
            host: host.into(),
            container: container.to_owned(),
            readonly: false,
            propagation: cri::MountPropagation::PropagationPrivate,
        }
    }

    /// A read-only mount without propagation.
    pub fn ro(host: impl Into<PathBuf>, container: &str) -> HostMount {
        HostMount {
            readonly: true,
            ..HostMount::rw(host, container)
        }
    }
}

impl ContainerSpec {
    pub fn new(name: &str, command: &[&str]) -> ContainerSpec {
        ContainerSpec {
            name: name.to_owned(),
            command: command.iter().map(|s| (*s).to_owned()).collect(),
            ..ContainerSpec::default()
        }
    }
}

/// A container's output from its CRI log file (`<time> <stream> <P|F> <text>` lines).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Logs {
    pub stdout: String,
    pub stderr: String,
}

/// CRI clients on one connection.
pub struct Cri {
    pub runtime: RuntimeServiceClient<Channel>,
    pub image: ImageServiceClient<Channel>,
}

/// A random RFC 4122 v4 uid (as the API server assigns).
pub fn new_uid() -> String {
    let mut b = [0u8; 16];
    getrandom(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .expect("read /dev/urandom");
}

fn hashmap(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn namespace_options(spec: &PodSpec) -> Option<cri::NamespaceOption> {
    // The kubelet's defaults: network and IPC shared in the pod, a PID namespace per container;
    // the node's for hostNetwork and hostPID.
    let node = cri::NamespaceMode::Node as i32;
    Some(cri::NamespaceOption {
        network: if spec.host_network {
            node
        } else {
            cri::NamespaceMode::Pod as i32
        },
        pid: if spec.host_pid {
            node
        } else {
            cri::NamespaceMode::Container as i32
        },
        ipc: cri::NamespaceMode::Pod as i32,
        ..Default::default()
    })
}

/// Parse a CRI log file's text into stdout and stderr (partial `P` lines join the next).
pub fn parse_cri_log(text: &str) -> Logs {
    let mut logs = Logs::default();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (_time, stream, tag) = (parts.next(), parts.next(), parts.next());
        let msg = parts.next().unwrap_or("");
        let out = match stream {
            Some("stdout") => &mut logs.stdout,
            Some("stderr") => &mut logs.stderr,
            _ => continue,
        };
        out.push_str(msg);
        if tag != Some("P") {
            out.push('\n');
        }
    }
    logs
}

impl Containerd {
    /// A CRI client on the daemon's socket (call inside a tokio runtime).
    pub async fn cri(&self) -> Cri {
        let path = self.socket().to_path_buf();
        let channel = Endpoint::try_from("http://[::]:50051")
            .expect("static uri")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "connect to containerd's CRI at {}: {e}\ncontainerd log:\n{}",
                    self.socket().display(),
                    self.log_tail()
                )
            });
        Cri {
            runtime: RuntimeServiceClient::new(channel.clone()),
            image: ImageServiceClient::new(channel),
        }
    }

    fn failed(&self, what: &str, e: &tonic::Status) -> ! {
        panic!(
            "CRI {what} failed: {} {}\ncontainerd log:\n{}",
            e.code(),
            e.message(),
            self.log_tail()
        )
    }

    /// RunPodSandbox as a cgroupfs kubelet does it (after creating the pod cgroup in cgroup2);
    /// returns when the sandbox runs, with its IP.
    pub async fn run_pod(&self, spec: &PodSpec) -> Pod {
        match self.try_run_pod(spec).await {
            Ok(pod) => pod,
            Err(e) => self.failed("RunPodSandbox", &e),
        }
    }

    /// [`Containerd::run_pod`], with RunPodSandbox's refusal as an error (a test that expects
    /// the sandbox not to start).
    pub async fn try_run_pod(&self, spec: &PodSpec) -> Result<Pod, tonic::Status> {
        let parent = cgroup_parent_under(&self.kubelet_root, spec.qos, &spec.uid);
        self.create_pod_cgroup(&parent);
        let log_dir = self.pod_log_dir(&spec.namespace, &spec.name, &spec.uid);
        std::fs::create_dir_all(&log_dir).expect("pod log dir");
        let mut labels = hashmap(&spec.labels);
        labels.insert(LABEL_POD_NAME.into(), spec.name.clone());
        labels.insert(LABEL_POD_NAMESPACE.into(), spec.namespace.clone());
        labels.insert(LABEL_POD_UID.into(), spec.uid.clone());
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: spec.name.clone(),
                uid: spec.uid.clone(),
                namespace: spec.namespace.clone(),
                attempt: 0,
            }),
            // runc can't set a hostname in the node's UTS namespace (containerd 1.6 shares it
            // with the node's network): none for hostNetwork.
            hostname: if spec.host_network {
                String::new()
            } else {
                spec.name.clone()
            },
            log_directory: log_dir.display().to_string(),
            dns_config: spec.dns_nameserver.map(|ns| cri::DnsConfig {
                servers: vec![ns.to_string()],
                searches: vec![],
                options: vec![],
            }),
            labels,
            annotations: hashmap(&spec.annotations),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: parent.clone(),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: namespace_options(spec),
                    privileged: spec.privileged,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut c = self.cri().await;
        let id = c
            .runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await?
            .into_inner()
            .pod_sandbox_id;
        let status = c
            .runtime
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: id.clone(),
                verbose: false,
            })
            .await
            .unwrap_or_else(|e| self.failed("PodSandboxStatus", &e))
            .into_inner();
        let ip = status
            .status
            .and_then(|s| s.network)
            .map(|n| n.ip)
            .unwrap_or_default();
        let parsed = if spec.host_network {
            Ok(crate::containerd::GATEWAY)
        } else {
            ip.parse()
        };
        let ip = parsed.unwrap_or_else(|_| {
            panic!(
                "sandbox {id} has no IPv4 address ({ip:?})\ncontainerd log:\n{}",
                self.log_tail()
            )
        });
        Ok(Pod {
            sandbox_id: id,
            ip,
            spec: spec.clone(),
            cgroup_parent: parent,
            log_dir,
            config,
        })
    }

    /// CreateContainer of a busybox container running `command` in `pod`; its id.
    pub async fn create_container(&self, pod: &Pod, name: &str, command: &[&str]) -> String {
        self.create_container_spec(pod, &ContainerSpec::new(name, command))
            .await
    }

    /// CreateContainer with the kubelet's container labels and log path (`<name>/0.log`).
    pub async fn create_container_spec(&self, pod: &Pod, spec: &ContainerSpec) -> String {
        match self.try_create_container_spec(pod, spec).await {
            Ok(id) => id,
            Err(e) => self.failed(&format!("CreateContainer {}", spec.name), &e),
        }
    }

    /// [`Containerd::create_container_spec`], with CreateContainer's refusal as an error.
    pub async fn try_create_container_spec(
        &self,
        pod: &Pod,
        spec: &ContainerSpec,
    ) -> Result<String, tonic::Status> {
        let mut labels = HashMap::new();
        labels.insert(LABEL_POD_NAME.into(), pod.spec.name.clone());
        labels.insert(LABEL_POD_NAMESPACE.into(), pod.spec.namespace.clone());
        labels.insert(LABEL_POD_UID.into(), pod.spec.uid.clone());
        labels.insert(LABEL_CONTAINER_NAME.into(), spec.name.clone());
        std::fs::create_dir_all(pod.log_dir.join(&spec.name)).expect("container log dir");
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: spec.name.clone(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: spec.image.clone().unwrap_or_else(|| IMAGE.to_owned()),
                ..Default::default()
            }),
            command: spec.command.clone(),
            envs: spec
                .envs
                .iter()
                .map(|(k, v)| cri::KeyValue {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            labels,
            annotations: hashmap(&spec.annotations),
            mounts: spec
                .mounts
                .iter()
                .map(|(host, container)| cri::Mount {
                    container_path: container.clone(),
                    host_path: host.clone(),
                    readonly: true,
                    ..Default::default()
                })
                .chain(spec.host_mounts.iter().map(|m| cri::Mount {
                    container_path: m.container.clone(),
                    host_path: m.host.display().to_string(),
                    readonly: m.readonly,
                    propagation: m.propagation as i32,
                    ..Default::default()
                }))
                .collect(),
            log_path: format!("{}/0.log", spec.name),
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: namespace_options(&pod.spec),
                    privileged: spec.privileged,
                    run_as_user: spec.run_as_user.map(|value| cri::Int64Value { value }),
                    readonly_rootfs: spec.readonly_rootfs,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.cri()
            .await
            .runtime
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod.sandbox_id.clone(),
                config: Some(config),
                sandbox_config: Some(pod.config.clone()),
            })
            .await
            .map(|r| r.into_inner().container_id)
    }

    /// StartContainer.
    pub async fn start_container(&self, id: &str) {
        if let Err(e) = self.try_start_container(id).await {
            self.failed(&format!("StartContainer {id}"), &e);
        }
    }

    /// StartContainer, its refusal as an error.
    pub async fn try_start_container(&self, id: &str) -> Result<(), tonic::Status> {
        self.cri()
            .await
            .runtime
            .start_container(cri::StartContainerRequest {
                container_id: id.to_owned(),
            })
            .await
            .map(drop)
    }

    /// Create and start; the container's id.
    pub async fn run_container(&self, pod: &Pod, name: &str, command: &[&str]) -> String {
        let id = self.create_container(pod, name, command).await;
        self.start_container(&id).await;
        id
    }

    /// ContainerStatus (verbose: `info["info"]` is containerd's JSON with `pid`,
    /// `runtimeSpec`, ...).
    pub async fn container_status(&self, id: &str) -> cri::ContainerStatusResponse {
        self.cri()
            .await
            .runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: id.to_owned(),
                verbose: true,
            })
            .await
            .unwrap_or_else(|e| self.failed(&format!("ContainerStatus {id}"), &e))
            .into_inner()
    }

    /// The host pid of a running container's init process (from the verbose status).
    pub async fn container_pid(&self, id: &str) -> u32 {
        let status = self.container_status(id).await;
        let info = status.info.get("info").cloned().unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&info)
            .ok()
            .and_then(|v| v["pid"].as_u64())
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p != 0)
            .unwrap_or_else(|| panic!("container {id} has no pid in its status info: {info}"))
    }

    /// Wait until the container exited; its exit code. Panics after `timeout`.
    pub async fn wait_exit(&self, id: &str, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.container_status(id).await.status.unwrap_or_default();
            if status.state == cri::ContainerState::ContainerExited as i32 {
                return status.exit_code;
            }
            assert!(
                Instant::now() < deadline,
                "container {id} still {:?} after {timeout:?}",
                cri::ContainerState::try_from(status.state)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The container's output so far (its CRI log file under the pod's log directory).
    pub fn logs(&self, pod: &Pod, name: &str) -> Logs {
        let path = pod.log_dir.join(name).join("0.log");
        parse_cri_log(&std::fs::read_to_string(&path).unwrap_or_default())
    }

    /// Run `command` in a new container of `pod` to its end: (exit code, output).
    pub async fn run_to_exit(
        &self,
        pod: &Pod,
        name: &str,
        command: &[&str],
        timeout: Duration,
    ) -> (i32, Logs) {
        let id = self.run_container(pod, name, command).await;
        let code = self.wait_exit(&id, timeout).await;
        (code, self.logs(pod, name))
    }

    /// ExecSync (a probe's or `kubectl exec`'s way): run `cmd` in the running container `id`;
    /// (exit code, output). A CRI error (the command could not be started) panics.
    pub async fn exec_sync(&self, id: &str, cmd: &[&str], timeout: Duration) -> (i32, Logs) {
        let out = self
            .cri()
            .await
            .runtime
            .exec_sync(cri::ExecSyncRequest {
                container_id: id.to_owned(),
                cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
                timeout: i64::try_from(timeout.as_secs().max(1)).unwrap_or(i64::MAX),
            })
            .await
            .unwrap_or_else(|e| self.failed(&format!("ExecSync {cmd:?} in {id}"), &e))
            .into_inner();
        (
            out.exit_code,
            Logs {
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            },
        )
    }

    /// StopContainer with the given grace period (0: SIGKILL).
    pub async fn stop_container(&self, id: &str, timeout: Duration) {
        self.cri()
            .await
            .runtime
            .stop_container(cri::StopContainerRequest {
                container_id: id.to_owned(),
                timeout: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            })
            .await
            .unwrap_or_else(|e| self.failed(&format!("StopContainer {id}"), &e));
    }

    /// StopPodSandbox: stops its containers and the sandbox, tears its network down (CNI DEL).
    pub async fn stop_pod(&self, pod: &Pod) {
        self.stop_pod_id(&pod.sandbox_id).await;
    }

    async fn stop_pod_id(&self, id: &str) {
        self.cri()
            .await
            .runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: id.to_owned(),
            })
            .await
            .unwrap_or_else(|e| self.failed(&format!("StopPodSandbox {id}"), &e));
    }

    /// RemovePodSandbox: removes the sandbox and its containers; then the pod's cgroup, as the
    /// kubelet does once a pod is gone (an agent prunes entries of vanished cgroups).
    pub async fn remove_pod(&self, pod: &Pod) {
        self.remove_pod_id(&pod.sandbox_id).await;
        self.remove_pod_cgroup(&pod.cgroup_parent);
    }

    async fn remove_pod_id(&self, id: &str) {
        self.cri()
            .await
            .runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: id.to_owned(),
            })
            .await
            .unwrap_or_else(|e| self.failed(&format!("RemovePodSandbox {id}"), &e));
    }

    /// ListPodSandbox (all states).
    pub async fn list_pods(&self) -> Vec<cri::PodSandbox> {
        self.cri()
            .await
            .runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .unwrap_or_else(|e| self.failed("ListPodSandbox", &e))
            .into_inner()
            .items
    }

    /// ListContainers (all states).
    pub async fn list_containers(&self) -> Vec<cri::Container> {
        self.cri()
            .await
            .runtime
            .list_containers(cri::ListContainersRequest { filter: None })
            .await
            .unwrap_or_else(|e| self.failed("ListContainers", &e))
            .into_inner()
            .containers
    }

    /// Stop and remove every pod (the harness's Drop; tests may call it too).
    pub async fn remove_all_pods(&self) {
        for pod in self.list_pods().await {
            self.stop_pod_id(&pod.id).await;
            self.remove_pod_id(&pod.id).await;
        }
    }
}

/// The cgroup2 path (relative to the cgroup2 mount, leading `/`) of a process.
pub fn cgroup2_of(pid: u32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/cgroup: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_else(|| panic!("no cgroup2 line in /proc/{pid}/cgroup: {text}"))
        .to_owned()
}
