//! Privileged harness for Kubernetes-like pods: a **private** containerd (Debian's 1.6, its CRI
//! plugin built in, runc, the CNI plugins in /usr/lib/cni) that the tests drive as a kubelet
//! would, through [`crate::cri`].
//!
//! Nothing here touches the host's network or the packaged containerd: the daemon runs inside a
//! network namespace the test creates, with its own root (`/tmp/egress-test-containerd-<pid>`),
//! state and socket (`/run/egress-test-containerd-<pid>/`), and a config written whole
//! ([`Containerd::config_toml`]): CNI bridge on a TEST-NET subnet ([`SUBNET`], the Docker tests use
//! 198.18.0.0/24), pod network namespaces under its state dir, a locally built sandbox image,
//! cgroupfs, and the runc handler passing `egress.*` pod and container annotations into the OCI
//! spec (where the agent's containerd runtime reads them). The image is built here from
//! busybox-static as a `docker save` archive and imported with `ctr` (nothing can be pulled).
//! Everything is stopped and removed in `Drop`: pods (through CRI, so CNI DEL runs), the daemon,
//! its shims, mounts, directories and the pod cgroups it created.
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use crate::docker::{NetNs, cgroup_mounts, cgroup2_mount};
use crate::{sh, sh_quiet};

/// `true` when the test may run; prints the skip reason otherwise.
pub fn require_root() -> bool {
    crate::root_or_skip("containerd")
}

/// The containerd namespace the CRI plugin uses (images must be imported here).
pub const NAMESPACE: &str = "k8s.io";
/// The image every pod uses, as sandbox ("pause": its default command sleeps) and for its app
/// containers (busybox applets in `/bin`, plus the extra binaries of [`Containerd::start_with`]).
pub const IMAGE: &str = "docker.io/library/egress-test-busybox:latest";
/// The pods' subnet (host-local IPAM) on the bridge [`BRIDGE`] in the daemon's namespace.
pub const SUBNET: &str = "198.18.8.0/24";
/// The bridge's own address (the harness puts it there): pods' default gateway, and where a test
/// in the daemon's namespace ([`Containerd::netns`]) listens for what pods send.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 8, 1);
/// The CNI bridge, created by the harness before any pod (the plugin then only adds veths).
pub const BRIDGE: &str = "egc-br0";
/// The CNI network name (also host-local's allocation directory name, under our own dataDir).
pub const CNI_NETWORK: &str = "egress-test-pods";

/// A pod's QoS class: it picks the kubelet's cgroup parent (cgroupfs driver).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qos {
    BestEffort,
    Burstable,
    Guaranteed,
}

/// The cgroup parent a cgroupfs kubelet gives a pod (`LinuxPodSandboxConfig.cgroup_parent`):
/// `/kubepods/besteffort/pod<uid>`, `/kubepods/burstable/pod<uid>`, `/kubepods/pod<uid>`.
pub fn cgroup_parent(qos: Qos, uid: &str) -> String {
    cgroup_parent_under(DEFAULT_KUBELET_ROOT, qos, uid)
}

/// The kubelet's cgroup root (cgroupfs driver) unless a test picks its own.
pub const DEFAULT_KUBELET_ROOT: &str = "/kubepods";

/// [`cgroup_parent`] under another kubelet root (e.g. `/egress-test-<pid>/kubepods`).
pub fn cgroup_parent_under(root: &str, qos: Qos, uid: &str) -> String {
    let root = root.trim_end_matches('/');
    match qos {
        Qos::BestEffort => format!("{root}/besteffort/pod{uid}"),
        Qos::Burstable => format!("{root}/burstable/pod{uid}"),
        Qos::Guaranteed => format!("{root}/pod{uid}"),
    }
}

/// A private containerd in its own network namespace. The CRI calls are in [`crate::cri`]
/// (`impl Containerd`, async).
pub struct Containerd {
    netns: NetNs,
    /// Root, config, CNI config, image build, pod logs: `/tmp/egress-test-containerd-<pid>`.
    pub dir: PathBuf,
    /// State and socket: `/run/egress-test-containerd-<pid>`.
    run_dir: PathBuf,
    socket: PathBuf,
    child: Option<Child>,
    /// Pod cgroup parents the harness created (relative to a cgroup mount), removed on drop.
    pub(crate) pod_cgroups: Mutex<Vec<String>>,
    /// Where pods go ([`DEFAULT_KUBELET_ROOT`]); a test that attaches programs picks its own
    /// root so nothing else on the host is under them. Set it before running pods.
    pub kubelet_root: String,
}

impl Containerd {
    /// Start it (the image holds busybox only).
    pub fn start() -> Containerd {
        Containerd::start_with(&[])
    }

    /// Like [`Containerd::start`], with extra host binaries in the image's `/bin` (their shared
    /// libraries, found with `ldd`, are copied too, as the Docker harness does).
    pub fn start_with(extra_bins: &[&Path]) -> Containerd {
        for bin in [
            "/usr/bin/containerd",
            "/usr/bin/ctr",
            "/usr/bin/containerd-shim-runc-v2",
            "/usr/sbin/runc",
            "/usr/lib/cni/bridge",
            "/usr/lib/cni/host-local",
            "/usr/lib/cni/loopback",
            "/bin/busybox",
        ] {
            assert!(
                Path::new(bin).exists(),
                "{bin} is missing: run `cargo xtask setup` (packages containerd, runc, \
                 containernetworking-plugins, busybox-static)"
            );
        }
        let pid = std::process::id();
        let dir = PathBuf::from(format!("/tmp/egress-test-containerd-{pid}"));
        let run_dir = PathBuf::from(format!("/run/egress-test-containerd-{pid}"));
        for d in [&dir, &run_dir] {
            if d.exists() {
                unmount_under(d);
                std::fs::remove_dir_all(d).ok();
            }
        }
        for d in ["root", "cni", "cni-ipam", "pods", "image"] {
            std::fs::create_dir_all(dir.join(d)).expect("containerd dirs");
        }
        std::fs::create_dir_all(run_dir.join("state")).expect("containerd state dir");
        let netns = NetNs::new(&format!("egc-{pid}"));
        // The bridge with the gateway address exists before any pod: a test can listen on
        // GATEWAY right away, and the CNI plugin (isGateway = false) leaves the address alone.
        netns.sh(&format!(
            "ip link add {BRIDGE} type bridge && ip addr add {GATEWAY}/24 dev {BRIDGE} \
             && ip link set {BRIDGE} up"
        ));
        let mut c = Containerd {
            netns,
            socket: run_dir.join("containerd.sock"),
            dir,
            run_dir,
            child: None,
            pod_cgroups: Mutex::new(Vec::new()),
            kubelet_root: DEFAULT_KUBELET_ROOT.to_owned(),
        };
        std::fs::write(c.dir.join("config.toml"), c.config_toml()).expect("write config.toml");
        std::fs::write(c.dir.join("cni/10-egress-test.conflist"), c.cni_conflist())
            .expect("write CNI conflist");
        c.spawn_daemon();
        let t = Instant::now();
        c.import_image(extra_bins);
        eprintln!(
            "containerd harness: image built and imported in {:?}",
            t.elapsed()
        );
        c
    }

    /// containerd's gRPC socket (the CRI and containerd APIs).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The network namespace the daemon, the bridge and the pods' host-side veths live in.
    pub fn netns(&self) -> &NetNs {
        &self.netns
    }

    /// The daemon's log (stdout and stderr).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("containerd.log")
    }

    /// The last 40 lines of the daemon's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The whole config (containerd 1.6, version 2); unset keys keep containerd's defaults
    /// (`containerd config default`).
    pub fn config_toml(&self) -> String {
        let cri = r#"[plugins."io.containerd.grpc.v1.cri"]"#;
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

{cri}
  sandbox_image = "{IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: without this, the sandbox's negative oom_score_adj makes
  # runc fail ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  # Pod network namespaces under our state dir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  enable_selinux = false
  systemd_cgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
    max_conf_num = 1

  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    snapshotter = "overlayfs"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      # Pod (sandbox config) and container annotations matching these reach the OCI spec;
      # pod annotations reach every container's spec too. Go's path.Match: `*` stops at `/`,
      # so "egress.*" passes `egress.policy` but not `egress.example.com/policy`.
      pod_annotations = ["egress.*"]
      container_annotations = ["egress.*"]

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        # runc's state (default /run/containerd/runc) under ours. The shims' sockets stay in
        # /run/containerd/s/ (fixed in 1.6; named by a hash of our socket path).
        Root = "{runc}"
"#,
            root = self.dir.join("root").display(),
            state = self.run_dir.join("state").display(),
            socket = self.socket.display(),
            opt = self.dir.join("opt").display(),
            cni = self.dir.join("cni").display(),
            runc = self.run_dir.join("runc").display(),
        )
    }

    /// The CNI network: the harness's bridge, host-local IPAM on [`SUBNET`] with its allocations
    /// under our directory, a default route through [`GATEWAY`], no masquerading.
    pub fn cni_conflist(&self) -> String {
        serde_json::json!({
            "cniVersion": "0.4.0",
            "name": CNI_NETWORK,
            "plugins": [{
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": false,
                "ipMasq": false,
                "hairpinMode": false,
                "ipam": {
                    "type": "host-local",
                    "dataDir": self.dir.join("cni-ipam").display().to_string(),
                    "ranges": [[{ "subnet": SUBNET, "gateway": GATEWAY.to_string() }]],
                    "routes": [{ "dst": "0.0.0.0/0", "gw": GATEWAY.to_string() }]
                }
            }]
        })
        .to_string()
    }

    fn spawn_daemon(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("containerd.log");
        let log2 = log.try_clone().expect("log fd");
        std::fs::remove_file(&self.socket).ok();
        // `nsenter` execs containerd: the child's pid is the daemon's.
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.path().display()))
            .arg("containerd")
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .expect("spawn containerd");
        self.child = Some(child);
        // Up when the CRI plugin answers (it comes after the socket): `ctr plugins ls` lists it
        // as `ok` once it initialised (`error`/`skip` otherwise: then the log says why).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "containerd exited ({status}) while starting:\n{}",
                    self.log_tail()
                );
            }
            if self.socket.exists() {
                let o = self.ctr_output(&["plugins", "ls"]);
                let text = String::from_utf8_lossy(&o.stdout);
                if let Some(line) = text.lines().find(|l| {
                    l.contains("io.containerd.grpc.v1")
                        && l.split_whitespace().nth(1) == Some("cri")
                }) {
                    assert!(
                        line.trim_end().ends_with("ok"),
                        "containerd's CRI plugin did not load ({line}):\n{}",
                        self.log_tail()
                    );
                    self.wait_cri_serving(deadline);
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not come up in 60 s (socket {}):\n{}",
                self.socket.display(),
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The plugin is `ok` before the CRI server has initialised (recovered its state): calls
    /// fail with "server is not initialized yet" until then (seen after a restart). Wait until
    /// CRI `Status` answers; on a thread with its own runtime (callers may be inside one).
    fn wait_cri_serving(&self, deadline: Instant) {
        crate::block_on_own_thread(async {
            loop {
                let status = self
                    .cri()
                    .await
                    .runtime
                    .status(k8s_cri::v1::StatusRequest { verbose: false })
                    .await;
                match status {
                    Ok(_) => return,
                    Err(e) => assert!(
                        Instant::now() < deadline,
                        "containerd's CRI did not serve in 60 s ({} {}):\n{}",
                        e.code(),
                        e.message(),
                        self.log_tail()
                    ),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    }

    fn stop_daemon(&mut self) {
        if let Some(mut child) = self.child.take() {
            crate::stop_child(&mut child, Duration::from_secs(30));
        }
    }

    /// Stop (SIGTERM) and start the daemon. Pods keep running (their shims outlive it); open
    /// CRI clients must reconnect ([`Containerd::cri`] makes a new one).
    pub fn restart(&mut self) {
        self.stop_daemon();
        self.spawn_daemon();
    }

    /// `ctr --address <socket> -n k8s.io <args>`.
    pub fn ctr_output(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", NAMESPACE])
            .args(args)
            .output()
            .expect("spawn ctr")
    }

    /// [`Containerd::ctr_output`] that must succeed; its stdout.
    pub fn ctr(&self, args: &[&str]) -> String {
        let o = self.ctr_output(args);
        assert!(
            o.status.success(),
            "ctr {args:?} failed ({}): {}{}\ncontainerd log:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            self.log_tail()
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `ctr containers info <id>`: the containerd container record (`Labels`, `Spec` = the OCI
    /// spec with `annotations` and `linux.cgroupsPath`, ...) as the agent's runtime reads it.
    pub fn container_info(&self, id: &str) -> serde_json::Value {
        let text = self.ctr(&["containers", "info", id]);
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("`ctr containers info {id}` is not JSON ({e}): {text}"))
    }

    /// Ids of every containerd container in the `k8s.io` namespace (sandboxes and apps).
    pub fn container_ids(&self) -> Vec<String> {
        self.ctr(&["containers", "ls", "-q"])
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    }

    /// Build the image (a `docker save` archive written here) and import it into `k8s.io`.
    ///
    /// Why by hand: `ctr images import` takes a docker-archive, which is four small files
    /// around one `tar` of the rootfs, so no dockerd, umoci or skopeo is needed (each of those
    /// would be one more daemon or package for a 1 MB image).
    fn import_image(&self, extra_bins: &[&Path]) {
        let build = self.dir.join("image");
        let rootfs = build.join("rootfs");
        crate::docker::build_rootfs(&rootfs, extra_bins);
        let archive = build.join("archive");
        std::fs::create_dir_all(&archive).expect("archive dir");
        let layer = archive.join("layer.tar");
        // Numeric owners, fixed order: the layer digest depends only on the content.
        sh(&format!(
            "tar --numeric-owner --owner=0 --group=0 --sort=name -C {} -cf {} .",
            rootfs.display(),
            layer.display()
        ));
        let diff_id = sha256_file(&layer);
        let config = serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/bin"],
                // The sandbox runs this (as a pause container does); app containers give a
                // command of their own. sleep as PID 1 ignores SIGTERM: stops end in SIGKILL.
                "Cmd": ["/bin/sleep", "2147483647"],
                "WorkingDir": "/"
            },
            "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{diff_id}")] },
            "history": [{ "created_by": "egress-tests containerd harness" }]
        })
        .to_string();
        let config_id = sha256_bytes(config.as_bytes());
        std::fs::write(archive.join(format!("{config_id}.json")), &config).expect("config");
        let tag = IMAGE.trim_start_matches("docker.io/library/");
        let manifest = serde_json::json!([{
            "Config": format!("{config_id}.json"),
            "RepoTags": [tag],
            "Layers": ["layer.tar"]
        }]);
        std::fs::write(archive.join("manifest.json"), manifest.to_string()).expect("manifest");
        let tar = build.join("image.tar");
        sh(&format!(
            "tar -C {} -cf {} manifest.json {config_id}.json layer.tar",
            archive.display(),
            tar.display()
        ));
        let out = self.ctr(&[
            "images",
            "import",
            "--snapshotter",
            "overlayfs",
            &tar.display().to_string(),
        ]);
        let listed = self.ctr(&["images", "ls", "-q"]);
        assert!(
            listed.lines().any(|l| l == IMAGE),
            "imported image not listed as {IMAGE}: import said {out}; images: {listed}"
        );
        std::fs::remove_dir_all(&build).ok();
    }

    /// Import another `docker save` archive into `k8s.io` as a node operator does
    /// (`ctr -n k8s.io images import`); the names it was imported as
    /// (`docker.io/library/<name>:<tag>`).
    pub fn import_archive(&self, archive: &Path) -> Vec<String> {
        let before = self.ctr(&["images", "ls", "-q"]);
        let out = self.ctr(&[
            "images",
            "import",
            "--snapshotter",
            "overlayfs",
            &archive.display().to_string(),
        ]);
        let names: Vec<String> = self
            .ctr(&["images", "ls", "-q"])
            .lines()
            .filter(|l| !before.lines().any(|b| b == *l))
            .map(str::to_owned)
            .collect();
        assert!(
            !names.is_empty(),
            "importing {} added no image: ctr said {out}",
            archive.display()
        );
        names
    }

    /// Create the pod-level cgroup in cgroup2 as the kubelet does before RunPodSandbox
    /// (runc creates it in the v1 hierarchies of this hybrid host itself); removed on drop.
    pub(crate) fn create_pod_cgroup(&self, parent: &str) {
        let path = cgroup2_mount().join(parent.trim_start_matches('/'));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("create pod cgroup {}: {e}", path.display()));
        self.pod_cgroups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(parent.to_owned());
    }

    /// Remove a pod's cgroup (its emptied children first) in every hierarchy; the kubelet
    /// root's levels stay (Drop removes them).
    pub(crate) fn remove_pod_cgroup(&self, parent: &str) {
        for mount in cgroup_mounts() {
            let path = mount.join(parent.trim_start_matches('/'));
            if path.exists() {
                let _removed = sh_quiet(&format!(
                    "find {} -depth -type d -exec rmdir {{}} \\;",
                    path.display()
                ));
            }
        }
    }

    /// Where the kubelet would put a pod's logs (`/var/log/pods/<ns>_<name>_<uid>`), under ours.
    pub fn pod_log_dir(&self, namespace: &str, name: &str, uid: &str) -> PathBuf {
        self.dir
            .join("pods")
            .join(format!("{namespace}_{name}_{uid}"))
    }

    /// The pids of our containerd's shims (their command line names our socket).
    fn shim_pids(&self) -> Vec<i32> {
        let sock = self.socket.display().to_string();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                    args.first()
                        .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"))
                        && args.contains(&sock.as_bytes())
                })
            })
            .collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- containerd log (tail) ---\n{}", self.log_tail());
        }
        // Pods through CRI first (CNI DEL, unmounts), on a thread of its own: Drop may run
        // inside a test's tokio runtime.
        if self.child.is_some() {
            let this = &*self;
            crate::block_on_own_thread(async {
                let cleanup = this.remove_all_pods();
                if tokio::time::timeout(Duration::from_secs(30), cleanup)
                    .await
                    .is_err()
                {
                    eprintln!("containerd harness: removing pods timed out");
                }
            })
            .ok();
        }
        self.stop_daemon();
        for pid in self.shim_pids() {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .ok();
        }
        unmount_under(&self.run_dir);
        unmount_under(&self.dir);
        std::fs::remove_dir_all(&self.dir).ok();
        std::fs::remove_dir_all(&self.run_dir).ok();
        // The pod cgroups (and their emptied ancestors up to /kubepods) in every hierarchy.
        let pods = std::mem::take(&mut *self.pod_cgroups.lock().unwrap_or_else(|p| p.into_inner()));
        for mount in cgroup_mounts() {
            for parent in &pods {
                let mut path = mount.join(parent.trim_start_matches('/'));
                if path.exists() {
                    let _removed = sh_quiet(&format!(
                        "find {} -mindepth 1 -depth -type d -exec rmdir {{}} \\;",
                        path.display()
                    ));
                }
                // Up to and including the kubelet root's first level (`kubepods`, or a test's
                // own `egress-test-<pid>`); stops at the first non-empty one.
                let top = self
                    .kubelet_root
                    .trim_start_matches('/')
                    .split('/')
                    .next()
                    .unwrap_or("kubepods")
                    .to_owned();
                // A pod directory already gone (the agent removes the ones it pre-created when
                // their pod goes) is no reason to stop: its emptied parents must go too.
                while path.starts_with(mount.join(&top))
                    && std::fs::remove_dir(&path)
                        .or_else(|e| match e.kind() {
                            std::io::ErrorKind::NotFound => Ok(()),
                            _ => Err(e),
                        })
                        .is_ok()
                {
                    path.pop();
                }
            }
        }
    }
}

/// A host directory bind-mounted onto itself as a **shared** mount, so that containerd admits it
/// as the source of a `Bidirectional` (or `HostToContainer`) mount: this machine's mounts are
/// private, and making a system mount shared would change it for everyone. Mounts a container
/// makes under it propagate back here. Unmounted (with whatever was mounted under it) on drop;
/// the directory itself stays.
pub struct SharedDir {
    path: PathBuf,
}

impl SharedDir {
    /// Create `path` if needed and make it a shared mount point.
    pub fn new(path: &Path) -> SharedDir {
        std::fs::create_dir_all(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        let p = path.display();
        sh(&format!("mount --bind {p} {p} && mount --make-shared {p}"));
        SharedDir {
            path: path.to_owned(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        unmount_under(&self.path);
        let _unmounted = sh_quiet(&format!(
            "while mountpoint -q {p}; do umount -l {p} || break; done",
            p = self.path.display()
        ));
    }
}

/// Lazily unmount everything mounted under `dir` (deepest first).
fn unmount_under(dir: &Path) {
    let d = dir.display().to_string();
    let _unmounted = sh_quiet(&format!(
        "findmnt -rn -o TARGET | grep '^{d}/' | sort -r | xargs -r -n1 umount -l"
    ));
}

fn sha256_file(path: &Path) -> String {
    let out = sh(&format!("sha256sum {}", path.display()));
    out.split_whitespace()
        .next()
        .expect("sha256sum output")
        .to_owned()
}

fn sha256_bytes(data: &[u8]) -> String {
    use std::io::Write as _;
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sha256sum");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(data)
        .expect("write sha256sum");
    let out = child.wait_with_output().expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum output")
        .to_owned()
}
