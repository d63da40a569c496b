//! Privileged harness for the Docker tests: network namespaces and a **private** dockerd.
//!
//! Nothing here touches the host's network: the private dockerd runs inside a network namespace
//! the test creates (its bridge, its containers' veths, the agent's `egress0` and nftables tables
//! all live there), with its own data-root, exec-root, pidfile, unix socket and cgroup parent,
//! `--iptables=false --ip6tables=false --bridge=none`, plus one bridge network on a TEST-NET
//! subnet (198.18.0.0/24) created by the test. The image is built locally from busybox-static
//! (`docker import` of a rootfs tar); nothing is pulled. Everything is stopped and removed in
//! `Drop`.
use std::fs::File;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Docker tests share one fixed subnet and socket naming; run them one at a time per process.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub use crate::{is_root, sh, sh_quiet as sh_ok};

/// `true` when the test may run; prints the skip reason otherwise.
pub fn require_root() -> bool {
    crate::root_or_skip("docker")
}

/// A named network namespace (`ip netns add`), deleted on drop.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(name: &str) -> NetNs {
        if sh_ok(&format!("ip netns pids {name} >/dev/null 2>&1")) {
            sh(&format!("ip netns del {name}"));
        }
        sh(&format!(
            "ip netns add {name} && ip -n {name} link set lo up"
        ));
        NetNs {
            name: name.to_owned(),
        }
    }
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name))
    }
    /// `ip netns exec <name> <cmd>` through bash.
    pub fn sh(&self, cmd: &str) -> String {
        sh(&format!(
            "ip netns exec {} bash -c {}",
            self.name,
            shell_quote(cmd)
        ))
    }
    pub fn sh_ok(&self, cmd: &str) -> bool {
        sh_ok(&format!(
            "ip netns exec {} bash -c {}",
            self.name,
            shell_quote(cmd)
        ))
    }
    /// Run `f` on a thread inside this namespace (sockets it creates belong here).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(&self.path(), f)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _deleted = sh_ok(&format!("ip netns del {}", self.name));
    }
}

pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Run `f` on a scoped thread that first enters the network namespace at `path`.
pub fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> T {
    let ns = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread panicked")
    })
}

/// Install docker.io and busybox-static if missing, without starting any service
/// (a policy-rc.d that refuses, removed afterwards if we created it).
pub fn ensure_installed() {
    let have = |bin: &str| sh_ok(&format!("command -v {bin}"));
    if have("dockerd")
        && have("docker")
        && Path::new("/bin/busybox").exists()
        && have("docker-proxy")
    {
        return;
    }
    let rc = Path::new("/usr/sbin/policy-rc.d");
    let created = !rc.exists();
    if created {
        let mut f = File::create(rc).expect("policy-rc.d");
        f.write_all(
            b"#!/bin/sh\n# egress-agent tests: never start services while installing\nexit 101\n",
        )
        .expect("write policy-rc.d");
        std::fs::set_permissions(rc, std::fs::Permissions::from_mode(0o755))
            .expect("chmod policy-rc.d");
    }
    let install = "DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io busybox-static";
    let ok = sh_ok(install) || (sh_ok("apt-get update -q") && sh_ok(install));
    if created {
        let _removed = std::fs::remove_file(rc);
    }
    assert!(ok, "installing docker.io busybox-static failed");
}

pub const IMAGE: &str = "egress-test-busybox:latest";
pub const NETWORK: &str = "egress-test";
pub const BRIDGE: &str = "egd-br0";
pub const SUBNET: &str = "198.18.0.0/24";
pub const GATEWAY: &str = "198.18.0.1";
/// A public address `direct.test` resolves to (the tests put it on the dockerd namespace's `lo`).
pub const DIRECT_IP: &str = "45.90.0.1";

/// A private dockerd in its own network namespace.
pub struct Dockerd {
    pub netns: NetNs,
    pub dir: PathBuf,
    /// `unix:///run/egress-test-docker-<pid>.sock`
    pub host: String,
    pub socket: PathBuf,
    /// cgroup parent (relative to the cgroup2 mount) of all its containers.
    pub cgroup_parent: String,
    child: Option<Child>,
}

impl Dockerd {
    /// Start it, build the image and create the test network.
    pub fn start() -> Dockerd {
        Dockerd::start_with(&[])
    }

    /// Like [`Dockerd::start`], with extra host binaries in the image's `/bin` (their shared
    /// libraries, found with `ldd`, are copied too).
    pub fn start_with(extra_bins: &[&Path]) -> Dockerd {
        ensure_installed();
        let pid = std::process::id();
        let dir = PathBuf::from(format!("/tmp/egress-test-docker-{pid}"));
        let socket = PathBuf::from(format!("/run/egress-test-docker-{pid}.sock"));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(dir.join("data")).expect("data-root");
        std::fs::create_dir_all(dir.join("exec")).expect("exec-root");
        let netns = NetNs::new(&format!("egd-docker-{pid}"));
        let mut d = Dockerd {
            netns,
            host: format!("unix://{}", socket.display()),
            socket,
            cgroup_parent: format!("egress-test-{pid}"),
            dir,
            child: None,
        };
        d.spawn_daemon();
        d.build_image(extra_bins);
        d.docker_ok(&[
            "network",
            "create",
            "--driver",
            "bridge",
            "--subnet",
            SUBNET,
            "--gateway",
            GATEWAY,
            "-o",
            &format!("com.docker.network.bridge.name={BRIDGE}"),
            NETWORK,
        ]);
        d
    }

    fn spawn_daemon(&mut self) {
        let log = File::create(self.dir.join("dockerd.log")).expect("dockerd.log");
        let log2 = log.try_clone().expect("log fd");
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.path().display()))
            .arg("dockerd")
            .arg(format!("--data-root={}", self.dir.join("data").display()))
            .arg(format!("--exec-root={}", self.dir.join("exec").display()))
            .arg(format!(
                "--pidfile={}",
                self.dir.join("docker.pid").display()
            ))
            .arg(format!("--host={}", self.host))
            .arg("--iptables=false")
            .arg("--ip6tables=false")
            .arg("--bridge=none")
            .arg("--exec-opt=native.cgroupdriver=cgroupfs")
            .arg(format!("--cgroup-parent=/{}", self.cgroup_parent))
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .expect("spawn dockerd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.socket.exists() && self.docker(&["version"]).status.success() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("dockerd did not come up:\n{}", self.log_tail());
    }

    fn stop_daemon(&mut self) {
        if let Some(mut child) = self.child.take() {
            crate::stop_child(&mut child, Duration::from_secs(30));
        }
    }

    /// Stop and start the daemon (containers without a restart policy stay stopped).
    pub fn restart(&mut self) {
        self.stop_daemon();
        self.spawn_daemon();
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    fn build_image(&self, extra_bins: &[&Path]) {
        let rootfs = self.dir.join("rootfs");
        build_rootfs(&rootfs, extra_bins);
        let tar = self.dir.join("rootfs.tar");
        sh(&format!(
            "tar -C {} -cf {} .",
            rootfs.display(),
            tar.display()
        ));
        self.docker_ok(&[
            "import",
            "-c",
            "ENV PATH=/bin",
            "-c",
            "CMD [\"/bin/sh\"]",
            &tar.display().to_string(),
            IMAGE,
        ]);
    }

    pub fn docker(&self, args: &[&str]) -> Output {
        Command::new("docker")
            .arg("-H")
            .arg(&self.host)
            .args(args)
            .output()
            .expect("spawn docker")
    }

    /// Run docker; panic on failure; return trimmed stdout.
    pub fn docker_ok(&self, args: &[&str]) -> String {
        let out = self.docker(args);
        assert!(
            out.status.success(),
            "docker {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `docker inspect -f <format> <id>`.
    pub fn inspect(&self, id: &str, format: &str) -> String {
        self.docker_ok(&["inspect", "-f", format, id])
    }

    /// The container's IPv4 on the test network.
    pub fn ip_of(&self, id: &str) -> String {
        self.inspect(
            id,
            &format!("{{{{(index .NetworkSettings.Networks \"{NETWORK}\").IPAddress}}}}"),
        )
    }

    /// Absolute cgroup2 path of the container's main process.
    pub fn cgroup_of(&self, id: &str) -> PathBuf {
        let pid = self.inspect(id, "{{.State.Pid}}");
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("read cgroup");
        let rel = text
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("cgroup2 line")
            .to_owned();
        cgroup2_mount().join(rel.trim_start_matches('/'))
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let ids = String::from_utf8_lossy(&self.docker(&["ps", "-aq"]).stdout).into_owned();
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if !ids.is_empty() {
            let mut args = vec!["rm", "-f"];
            args.extend(ids);
            let _out = self.docker(&args);
        }
        self.stop_daemon();
        // Leftover mounts (overlay, netns bind mounts) under our directories.
        let dir = self.dir.display().to_string();
        let _unmounted = sh_ok(&format!(
            "findmnt -rn -o TARGET | grep '^{dir}' | sort -r | xargs -r -n1 umount -l"
        ));
        std::fs::remove_dir_all(&self.dir).ok();
        std::fs::remove_file(&self.socket).ok();
        // The cgroup parent exists in cgroup2 and in every v1 hierarchy (hybrid hosts).
        for mount in cgroup_mounts() {
            let parent = mount.join(&self.cgroup_parent);
            if parent.exists() {
                let _removed = sh_ok(&format!(
                    "find {} -mindepth 1 -depth -type d -exec rmdir {{}} \\;",
                    parent.display()
                ));
                std::fs::remove_dir(&parent).ok();
            }
        }
    }
}

/// Write the test image's root filesystem at `rootfs`: busybox-static with its applets as
/// symlinks in `/bin`, the `extra_bins` (with the shared libraries `ldd` names), a minimal
/// `/etc/passwd` and `/etc/group`. Shared by the Docker and containerd harnesses.
pub fn build_rootfs(rootfs: &Path, extra_bins: &[&Path]) {
    std::fs::create_dir_all(rootfs.join("bin")).expect("rootfs");
    for d in ["etc", "tmp", "proc", "sys", "dev"] {
        std::fs::create_dir_all(rootfs.join(d)).expect("rootfs dir");
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("copy busybox");
    let list = sh("/bin/busybox --list");
    for applet in list.lines().filter(|a| !a.is_empty() && *a != "busybox") {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).ok();
    }
    for bin in extra_bins {
        let name = bin.file_name().expect("binary name");
        std::fs::copy(bin, rootfs.join("bin").join(name))
            .unwrap_or_else(|e| panic!("copy {} into the image: {e}", bin.display()));
        let libs = sh(&format!("ldd {} | grep -o '/[^ ]*' || true", bin.display()));
        for lib in libs.lines().filter(|l| l.starts_with('/')) {
            let dst = rootfs.join(lib.trim_start_matches('/'));
            std::fs::create_dir_all(dst.parent().expect("lib dir")).expect("lib dir");
            std::fs::copy(lib, &dst).unwrap_or_else(|e| panic!("copy {lib}: {e}"));
        }
    }
    std::fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
    )
    .expect("passwd");
    std::fs::write(rootfs.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").expect("group");
}

/// Mount points of every cgroup filesystem (v1 hierarchies and cgroup2).
pub fn cgroup_mounts() -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            (fstype == "cgroup" || fstype == "cgroup2")
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .collect()
}

pub use crate::agent::cgroup2_mount;

// ---------------------------------------------------------------------------------------------
// The agent under test against the private dockerd.

pub const PROXY: &str = "169.254.100.1:3128";
pub const UPSTREAM_IP: &str = "198.18.0.10";
pub const CANARY: &str = "198.18.0.1:9000";

/// Counts TCP connections accepted on the canary address.
pub struct Canary {
    n: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Canary {
    pub fn start(d: &Dockerd) -> Canary {
        let addr: SocketAddr = CANARY.parse().expect("test value");
        let l = d
            .netns
            .run(|| TcpListener::bind(addr))
            .expect("bind canary");
        l.set_nonblocking(true).expect("nonblocking");
        let n = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (n2, stop2) = (n.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok(_) => {
                        n2.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Canary { n, stop }
    }
    pub fn count(&self) -> usize {
        // Let in-flight handshakes land.
        std::thread::sleep(Duration::from_millis(200));
        self.n.load(Ordering::SeqCst)
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A shell command for a container: a GET of `http://HOST:PORT/` through the proxy endpoint;
/// prints the whole answer (status line, `X-Egress-Deny`, body).
pub fn proxied_get(host: &str, port: u16) -> String {
    format!(
        "(printf 'GET http://{host}:{port}/ HTTP/1.1\\r\\nHost: {host}:{port}\\r\\nConnection: close\\r\\n\\r\\n'; sleep 1) | nc -w 5 169.254.100.1 3128"
    )
}

/// A shell command: `METHOD http://egress.internal/PATH` through the container's proxy, with a
/// JSON `body` (empty for none); prints the whole answer.
pub fn egress_internal(method: &str, path: &str, body: &str) -> String {
    format!(
        "(printf '{method} http://egress.internal{path} HTTP/1.1\\r\\nHost: egress.internal\\r\\nContent-Type: application/json\\r\\nContent-Length: {}\\r\\nConnection: close\\r\\n\\r\\n{body}'; sleep 1) | nc -w 5 169.254.100.1 3128",
        body.len()
    )
}

/// The policies every [`Env`] starts with: `web` (allowed.test:8080 via allow_cidrs to the
/// upstream) and `canary` (the canary's address).
pub fn default_policies() -> String {
    format!(
        r#"[policies.web]
allow_hosts = ["allowed.test"]
allow_ports = [8080]
allow_cidrs = ["{UPSTREAM_IP}/32"]
[policies.canary]
allow_cidrs = ["198.18.0.1/32"]
"#
    )
}

pub struct Env {
    /// The daemon under test: `egress-agent run` (the binary from [`crate::agent::agent_bin`]).
    pub agent: Option<Child>,
    pub canary: Canary,
    pub dir: PathBuf,
    pub bpffs: PathBuf,
    agent_bin: PathBuf,
    /// Extra environment of the daemons [`Env::start_agent`] starts (e.g. `NOTIFY_SOCKET`).
    pub agent_env: Vec<(String, String)>,
    /// A command the daemon is started through (it ends by exec'ing its arguments), e.g. a
    /// shell that plays the service manager passing descriptors; used once, then cleared.
    pub agent_prefix: Vec<String>,
    /// The `--docker-socket` the daemon is given instead of the dockerd's own (a test's fault
    /// socket in front of it: [`crate::docker_fault`]).
    pub docker_socket: Option<String>,
    /// Extra arguments of `egress-agent run` (e.g. `--metrics-listen`), kept for every start.
    pub agent_args: Vec<String>,
    pub d: Dockerd,
}

/// Arguments of [`Env::start`].
fn start_args<'a>(name: &'a str, extra: &[&'a str], cmd: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["run", "-d", "--name", name, "--network", NETWORK];
    args.extend_from_slice(extra);
    args.push(IMAGE);
    args.extend_from_slice(cmd);
    args
}

impl Env {
    /// A private dockerd, the upstream container, the canary and a running daemon
    /// (`egress-agent run`, located by [`crate::agent::agent_bin`]); `extra_bins` go into the image.
    pub fn new(extra_bins: &[&Path]) -> Env {
        let agent_bin = crate::agent::agent_bin();
        let d = Dockerd::start_with(extra_bins);
        let pid = std::process::id();
        let dir = PathBuf::from(format!("/tmp/egress-test-docker-agent-{pid}"));
        std::fs::create_dir_all(&dir).expect("agent dir");
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/egress-test-docker-{pid}"));
        std::fs::write(
            dir.join("hosts"),
            format!(
                "{UPSTREAM_IP} allowed.test\n{UPSTREAM_IP} denied.test\n{GATEWAY} tls.test\n{DIRECT_IP} direct.test\n"
            ),
        )
        .expect("hosts");
        let config = Env::config_with(&bpffs, &dir, "");
        std::fs::write(dir.join("config.toml"), config).expect("config");
        // The upstream web server (unlabelled).
        d.docker_ok(&[
            "run", "-d", "--name", "upstream", "--restart", "always", "--network", NETWORK, "--ip", UPSTREAM_IP, IMAGE, "sh", "-c",
            "mkdir -p /www && echo hello-upstream > /www/index.html && exec httpd -f -p 8080 -h /www",
        ]);
        let canary = Canary::start(&d);
        let mut env = Env {
            agent: None,
            canary,
            dir,
            bpffs,
            agent_bin,
            agent_env: Vec::new(),
            agent_prefix: Vec::new(),
            docker_socket: None,
            agent_args: Vec::new(),
            d,
        };
        env.start_agent();
        env
    }

    /// The test configuration: `[agent]`, `[proxy]`, `[dns]` as every test uses them, then
    /// `policies` (TOML text) if not empty, else the default policies `web` (allowed.test:8080 via
    /// allow_cidrs to the upstream) and `canary` (the canary's address).
    fn config_with(bpffs: &Path, dir: &Path, policies: &str) -> String {
        let policies = if policies.is_empty() {
            default_policies()
        } else {
            policies.to_owned()
        };
        format!(
            r#"
[agent]
bpffs = "{}"
state_dir = "{}"
[proxy]
endpoint = "{PROXY}"
[dns]
hosts_file = "{}"
nameservers = []
{policies}"#,
            bpffs.display(),
            dir.join("state").display(),
            dir.join("hosts").display()
        )
    }

    /// The daemon's configuration file.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("config.toml")
    }

    /// The configuration [`Env::new`] starts with, with `policies` (TOML text) in place of the
    /// default policies (empty: the defaults).
    pub fn config_text(&self, policies: &str) -> String {
        Env::config_with(&self.bpffs, &self.dir, policies)
    }

    /// Replace the configuration file (the daemon reads it on SIGHUP / `egress-agent reload`).
    pub fn write_config(&self, text: &str) {
        let tmp = self.dir.join("config.toml.new");
        std::fs::write(&tmp, text).expect("write config");
        std::fs::rename(&tmp, self.config_path()).expect("replace config");
    }

    /// The daemon's control API socket.
    pub fn api_socket(&self) -> PathBuf {
        self.dir.join("api.sock")
    }

    /// Run `egress-agent <args> --api-socket <ours>` (a client of the daemon's control API).
    pub fn cli(&self, args: &[&str]) -> Output {
        crate::agent::api_cli(&self.agent_bin, &self.api_socket(), args)
    }

    /// Send a signal to the running daemon.
    pub fn signal_agent(&self, sig: nix::sys::signal::Signal) {
        let child = self.agent.as_ref().expect("the agent is running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal the agent");
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn start_agent(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log");
        let log2 = log.try_clone().expect("log fd");
        let before = self.log().matches("docker reconcile done").count();
        let enforcing = self.log().matches("egress-agent enforcing").count();
        // `nsenter` execs the daemon: the child's pid is the daemon's (kill -9 hits it).
        let prefix = std::mem::take(&mut self.agent_prefix);
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg("nsenter");
                c
            }
            None => Command::new("nsenter"),
        };
        let child = cmd
            .arg(format!("--net={}", self.d.netns.path().display()))
            .arg(&self.agent_bin)
            .arg("run")
            .arg("--config")
            .arg(self.config_path())
            .args([
                "--docker-socket",
                self.docker_socket.as_deref().unwrap_or(&self.d.host),
            ])
            .args(["--cgroup-parent", &format!("/{}", self.d.cgroup_parent)])
            .arg("--api-socket")
            .arg(self.api_socket())
            .args(&self.agent_args)
            .env("RUST_LOG", "info,egress_agent=debug")
            .envs(self.agent_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .expect("spawn agent");
        self.agent = Some(child);
        assert!(
            self.wait_log(
                |l| l.matches("docker reconcile done").count() > before
                    && l.matches("egress-agent enforcing").count() > enforcing,
                Duration::from_secs(60)
            ),
            "agent did not come up:\n{}",
            self.log()
        );
        // The control API answers once the daemon is ready.
        if let Err(stderr) =
            crate::agent::api_ready(&self.agent_bin, &self.api_socket(), Duration::from_secs(10))
        {
            panic!("control API not answering: {stderr}\n{}", self.log());
        }
    }

    /// The binary the next [`Env::start_agent`] runs (an upgrade test's other build).
    pub fn set_agent_bin(&mut self, bin: PathBuf) {
        self.agent_bin = bin;
    }

    pub fn agent_bin(&self) -> &Path {
        &self.agent_bin
    }

    /// The pid of the daemon that serves the control API now (after a hand-over, not
    /// necessarily [`Env::agent`]'s).
    pub fn serving_pid(&self) -> Option<u32> {
        let o = self.cli(&["status", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        v["pid"].as_u64().and_then(|p| u32::try_from(p).ok())
    }

    pub fn kill_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            c.kill().ok(); // SIGKILL
            c.wait().ok();
        }
    }

    /// The running daemon's recent denial events (`egress-agent events -n 1000`, one JSON object
    /// a line), oldest first. Empty while no daemon answers (the CLI's fallback, the event store
    /// under the default `agent.state_dir`, is not this environment's: each Env has its own).
    pub fn events(&self) -> Vec<serde_json::Value> {
        crate::agent::api_events(&self.agent_bin, &self.api_socket())
    }

    /// Wait for an event matching `f`.
    pub fn wait_event(&self, f: impl Fn(&serde_json::Value) -> bool, timeout: Duration) -> bool {
        crate::agent::api_wait_event(&self.agent_bin, &self.api_socket(), f, timeout)
    }

    pub fn wait_log(&self, f: impl Fn(&str) -> bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if f(&self.log()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// `docker run --rm` on the test network with the proxy variables set.
    pub fn run(&self, extra: &[&str], script: &str) -> Output {
        let mut args = vec!["run", "--rm", "--network", NETWORK, "-e"];
        let proxy = format!("http_proxy=http://{PROXY}");
        args.push(&proxy);
        args.extend_from_slice(extra);
        args.extend_from_slice(&[IMAGE, "sh", "-c", script]);
        self.d.docker(&args)
    }

    pub fn run_out(&self, extra: &[&str], script: &str) -> String {
        let o = self.run(extra, script);
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    pub fn exec_out(&self, container: &str, script: &str) -> String {
        let proxy = format!("http_proxy=http://{PROXY}");
        let o = self
            .d
            .docker(&["exec", "-e", &proxy, container, "sh", "-c", script]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    /// `docker run -d --name NAME --network NETWORK EXTRA… IMAGE CMD…` (not checked: a refused
    /// container may fail to start at all).
    pub fn start(&self, name: &str, extra: &[&str], cmd: &[&str]) -> Output {
        self.d.docker(&start_args(name, extra, cmd))
    }

    /// [`Env::start`] that must succeed; the container's id.
    pub fn start_ok(&self, name: &str, extra: &[&str], cmd: &[&str]) -> String {
        self.d.docker_ok(&start_args(name, extra, cmd))
    }

    /// Wait for the agent's refusal event for container `name` whose reason contains `reason`.
    pub fn wait_refused(&self, name: &str, reason: &str, timeout: Duration) -> bool {
        self.wait_event(
            |e| {
                e["container"]["name"] == name
                    && e["reason"].as_str().is_some_and(|r| r.contains(reason))
            },
            timeout,
        )
    }

    /// Wait until a container's state is `want` (`running`, `exited`).
    pub fn wait_state(&self, name: &str, want: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let o = self.d.docker(&["inspect", "-f", "{{.State.Status}}", name]);
            if String::from_utf8_lossy(&o.stdout).trim() == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// A request to the daemon's control API by `curl --unix-socket` (a real client):
    /// (status, body). `body`: (content type, text).
    pub fn api_call(&self, method: &str, path: &str, body: Option<(&str, &str)>) -> (u16, String) {
        let mut c = Command::new("curl");
        c.args(["-s", "-w", "\n%{http_code}", "--unix-socket"])
            .arg(self.api_socket())
            .args(["-X", method]);
        if let Some((ct, b)) = body {
            c.args(["-H", &format!("content-type: {ct}"), "--data-binary", b]);
        }
        c.arg(format!("http://egress-agent{path}"));
        let out = String::from_utf8_lossy(&c.output().expect("curl").stdout).into_owned();
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }

    /// Restart the daemon with `web` (allowed.test:8080, the upstream's address) in
    /// `policies.d` — where the API and the console write — and `extra` TOML after the other
    /// policies (e.g. `[api]`). Returns the `policies.d` directory.
    pub fn restart_with_managed_web(&mut self, extra: &str) -> PathBuf {
        let dir = self.dir.join("policies.d");
        std::fs::create_dir_all(&dir).expect("policies.d");
        std::fs::write(
            dir.join("web.toml"),
            format!("allow_hosts = [\"allowed.test\"]\nallow_ports = [8080]\nallow_cidrs = [\"{UPSTREAM_IP}/32\"]\n"),
        )
        .expect("web.toml");
        self.write_config(&self.config_text(extra));
        self.kill_agent();
        self.start_agent();
        dir
    }

    /// Start a long-running container with `labels` on the test network and wait until it is
    /// enforced (from `create` and from `start`).
    pub fn run_labelled(&self, name: &str, labels: &[&str]) {
        let args: Vec<&str> = labels.iter().flat_map(|l| ["--label", l]).collect();
        self.start_ok(name, &args, &["sleep", "600"]);
        assert!(
            self.wait_enforced(name, 2),
            "{name} never enforced:\n{}",
            self.log()
        );
    }

    /// Wait until the agent logged "container enforced" for `name` `n` times in total.
    pub fn wait_enforced(&self, name: &str, n: usize) -> bool {
        let needle = format!("\"name\":\"{name}\"");
        self.wait_log(
            |l| {
                l.lines()
                    .filter(|x| x.contains("container enforced") && x.contains(&needle))
                    .count()
                    >= n
            },
            Duration::from_secs(30),
        )
    }

    /// Wait (10 s) until the agent logged `host layer enforced` for container `name`: its
    /// nftables rules are in place (before that, on hosts without BPF-LSM, the L2 guard drops
    /// its frames).
    pub fn wait_host_layer(&self, name: &str) -> bool {
        let needle = format!("\"name\":\"{name}\"");
        self.wait_log(
            |l| {
                l.lines()
                    .any(|x| x.contains("host layer enforced") && x.contains(&needle))
            },
            Duration::from_secs(10),
        )
    }

    /// Ports of the proxy listeners on the proxy address.
    /// TCP sockets the agent listens on per opted-in allowlist container: the explicit proxy
    /// listener, the transparent listener and DNS over TCP ([`Env::listener_ports`] counts all).
    pub const TCP_SOCKETS_PER_CONTAINER: usize = 3;

    pub fn listener_ports(&self) -> Vec<u16> {
        let out = self.d.netns.sh("ss -Hltn 'src 169.254.100.1'");
        out.lines()
            .filter_map(|l| l.split_whitespace().nth(3))
            .filter_map(|a| a.rsplit(':').next()?.parse().ok())
            .filter(|p| *p != 3128)
            .collect()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.kill_agent();
        // Agents a hand-over started are not our children: every process running on this
        // environment's configuration goes.
        let config = self.config_path();
        let needle = config.as_os_str().as_encoded_bytes();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if cmdline.windows(needle.len()).any(|w| w == needle) {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .ok();
            }
        }
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", self.log());
            eprintln!("--- dockerd log ---\n{}", self.d.log_tail());
        }
        // Unpinning the links detaches the programs from the test's cgroup parent.
        std::fs::remove_dir_all(&self.bpffs).ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
