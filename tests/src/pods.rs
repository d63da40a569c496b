//! The agent as a Kubernetes node runs it, for the containerd tests and benchmark: `egress-agent
//! run --no-docker` with `[kubernetes]`, as a host process in the CRI harness's network namespace,
//! and helpers to run pods and containers through the harness.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::containerd::{Containerd, GATEWAY};
use crate::cri::{ContainerSpec, Logs, Pod, PodSpec};

pub const PROXY: &str = "169.254.100.1:3128";
/// The web policy's direct CIDR port, and a port no policy allows.
pub const ALLOWED_PORT: u16 = 9200;
pub const DENIED_PORT: u16 = 9300;
pub const TLS_PORT: u16 = 8443;
/// The web policy's host service (`allow_host_services`): a port of the node at the pods'
/// gateway.
pub const HOST_SERVICE_PORT: u16 = 9400;
/// The raw TCP listeners' address (a second address on the harness bridge); the TLS upstream
/// is on the gateway address.
/// The status page of the pod tests' agent (in the harness's namespace).
pub const STATUS_PAGE: &str = "127.0.0.1:18182";
/// Its metrics listener (`--metrics-listen`), in the same namespace.
pub const METRICS: &str = "127.0.0.1:18183";
pub const CANARY_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 8, 200);

/// The daemon under test and its files.
pub struct Agent {
    pub child: Option<Child>,
    pub dir: PathBuf,
    pub bpffs: PathBuf,
    pub netns: PathBuf,
    pub bin: PathBuf,
}

impl Agent {
    /// The agent's directory, hosts file, CA (`ca/ca.pem`, mounted into pods as `/ca`) and
    /// configuration for the harness's containerd `c` (its kubelet root, socket and config);
    /// not started yet.
    pub fn new(c: &Containerd, ca_pem: &str) -> Agent {
        let pid = std::process::id();
        let dir = PathBuf::from(format!("/tmp/egress-test-k8s-agent-{pid}"));
        std::fs::create_dir_all(dir.join("ca")).expect("agent dir");
        std::fs::write(dir.join("ca/ca.pem"), ca_pem).expect("CA");
        std::fs::write(
            dir.join("hosts"),
            format!(
                "{GATEWAY} allowed.test\n{GATEWAY} denied.test\n{GATEWAY} other.test\n{GATEWAY} ro.test\n"
            ),
        )
        .expect("hosts");
        std::fs::write(dir.join("containerd-config.toml"), c.config_toml())
            .expect("containerd config");
        let agent = Agent {
            child: None,
            bpffs: PathBuf::from(format!("/sys/fs/bpf/egress-test-k8s-{pid}")),
            netns: c.netns().path(),
            bin: crate::agent::agent_bin(),
            dir,
        };
        std::fs::write(
            agent.dir.join("config.toml"),
            agent.config(c.socket(), &c.kubelet_root),
        )
        .expect("config");
        agent
    }

    pub fn config(&self, socket: &Path, root: &str) -> String {
        let d = self.dir.display();
        format!(
            r#"
[agent]
bpffs = "{bpffs}"
state_dir = "{d}/state"
unlabeled = "allow_all"
[api]
ui_listen = "{STATUS_PAGE}"
[proxy]
endpoint = "{PROXY}"
[dns]
hosts_file = "{d}/hosts"
nameservers = []
[intercept]
upstream_ca_file = "{d}/ca/ca.pem"
[kubernetes]
containerd_socket = "{socket}"
containerd_config = "{d}/containerd-config.toml"
cgroup_root = "{root}"
namespace_defaults = {{ team = "other" }}
[policies.web]
allow_hosts = ["allowed.test", {{ host = "ro.test", access = "read-only" }}]
allow_ports = [{TLS_PORT}]
allow_cidrs = [{{ cidr = "{CANARY_IP}/32", ports = [{ALLOWED_PORT}] }}]
resolve_private = ["{GATEWAY}/32"]
allow_host_services = [{{ port = {HOST_SERVICE_PORT}, name = "model" }}]
[policies.other]
allow_hosts = ["other.test"]
allow_ports = [{TLS_PORT}]
resolve_private = ["{GATEWAY}/32"]
"#,
            bpffs = self.bpffs.display(),
            socket = socket.display(),
        )
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn api(&self) -> PathBuf {
        self.dir.join("api.sock")
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        crate::agent::api_cli(&self.bin, &self.api(), args)
    }

    /// Start the daemon in the containerd namespace and wait until it has reconciled.
    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log");
        let log2 = log.try_clone().expect("log fd");
        let before = self.log().matches("containerd reconciled").count();
        // `nsenter` execs the daemon: the child's pid is the daemon's (kill -9 hits it).
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            .arg(&self.bin)
            .args(["run", "--no-docker", "--config"])
            .arg(self.dir.join("config.toml"))
            .arg("--api-socket")
            .arg(self.api())
            .args(["--metrics-listen", METRICS])
            .env("RUST_LOG", "info,egress_agent=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .expect("spawn agent");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.log().matches("containerd reconciled").count() <= before {
            assert!(
                Instant::now() < deadline,
                "agent did not reconcile containerd:\n{}",
                self.log()
            );
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("agent exited ({status}):\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its `/metrics` response (empty if nothing answered).
    pub fn metrics(&self) -> String {
        metrics_get(&self.netns, METRICS)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().ok();
            c.wait().ok();
        }
    }

    /// The agent's recent events (JSON lines of `egress-agent events`).
    pub fn events(&self) -> Vec<serde_json::Value> {
        crate::agent::api_events(&self.bin, &self.api())
    }

    pub fn wait_event(&self, f: impl Fn(&serde_json::Value) -> bool, timeout: Duration) -> bool {
        crate::agent::api_wait_event(&self.bin, &self.api(), f, timeout)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", self.log());
        }
        // Unpinning the links detaches the programs from the test's kubelet root.
        std::fs::remove_dir_all(&self.bpffs).ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The listening sockets of the agent on the proxy address, but the endpoint.
pub fn listener_ports(c: &Containerd) -> Vec<u16> {
    let out = c.netns().sh("ss -Hltn 'src 169.254.100.1'");
    out.lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.rsplit(':').next()?.parse().ok())
        .filter(|p| *p != 3128)
        .collect()
}

pub fn output(code: i32, logs: &Logs) -> String {
    format!(
        "exit {code}; stdout: {}; stderr: {}",
        logs.stdout, logs.stderr
    )
}

/// Run `script` (sh) in a new container of `pod` to its end: (exit code, output).
pub fn run_in(
    rt: &tokio::runtime::Runtime,
    c: &Containerd,
    pod: &Pod,
    name: &str,
    script: &str,
    mounts: &[(String, String)],
) -> (i32, Logs) {
    rt.block_on(async {
        let mut spec = ContainerSpec::new(name, &["sh", "-c", script]);
        spec.mounts = mounts.to_vec();
        let id = c.create_container_spec(pod, &spec).await;
        c.start_container(&id).await;
        let code = c.wait_exit(&id, Duration::from_secs(30)).await;
        (code, c.logs(pod, name))
    })
}

/// A pod in `ns` with `annotations`, its DNS server the gateway (the agent answers).
pub fn pod_in(
    rt: &tokio::runtime::Runtime,
    c: &Containerd,
    ns: &str,
    name: &str,
    annotations: &[(&str, &str)],
) -> Pod {
    let mut spec = PodSpec::new(ns, name);
    spec.dns_nameserver = Some(GATEWAY);
    for (k, v) in annotations {
        spec = spec.annotation(k, v);
    }
    rt.block_on(c.run_pod(&spec))
}

pub fn context_of<'a>(ev: &'a serde_json::Value, key: &str) -> &'a str {
    ev["context"][key].as_str().unwrap_or_default()
}

/// What the pod tests judge by, in the harness's namespace: a second address ([`CANARY_IP`]) on
/// the bridge with raw TCP listeners on [`ALLOWED_PORT`] and [`DENIED_PORT`], and a TLS upstream
/// on the gateway's [`TLS_PORT`] serving `names` (certificates from `ca`).
pub fn listeners(
    c: &Containerd,
    ca: &crate::tls_upstream::TestCa,
    names: &[&str],
) -> (crate::canary::Canary, crate::tls_upstream::Upstream) {
    c.netns().sh(&format!(
        "ip addr add {CANARY_IP}/24 dev {}",
        crate::containerd::BRIDGE
    ));
    let canary = c.netns().run(|| {
        crate::canary::Canary::on(
            &[
                std::net::SocketAddr::from((CANARY_IP, ALLOWED_PORT)),
                std::net::SocketAddr::from((CANARY_IP, DENIED_PORT)),
            ],
            &[],
        )
    });
    let upstream = crate::tls_upstream::Upstream::start_in(
        ca,
        names,
        std::net::SocketAddr::from((GATEWAY, TLS_PORT)),
        &c.netns().path(),
    );
    (canary, upstream)
}

/// `GET /metrics` on an agent's metrics listener `addr`, from the network namespace at `netns`:
/// the whole response (status line, headers, the OpenMetrics text), empty if nothing answered.
pub fn metrics_get(netns: &std::path::Path, addr: &str) -> String {
    use std::io::{Read as _, Write as _};
    crate::docker::in_netns(netns, || {
        let mut s = std::net::TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        Some(text)
    })
    .unwrap_or_default()
}
