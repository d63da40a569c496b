//! The agent FROM ITS IMAGE, run as `deploy/kubernetes/daemonset.yaml` runs it, on a private
//! containerd played as the kubelet (tests/src/cri.rs), confines a pod (root).
//!
//! The image is the archive `cargo xtask image` writes (`cargo xtask test` writes it before this
//! suite and passes its path as `EGRESS_AGENT_IMAGE`), imported with `ctr -n k8s.io images
//! import` as on a node. The agent pod is the DaemonSet's: hostNetwork (the harness's node is
//! the containerd network namespace), hostPID, a privileged container running as root with a
//! read-only root file system, the DaemonSet's command, and its host mounts: the config directory
//! (a test config in place of the ConfigMap), bpffs (`Bidirectional`; here the test's own pin
//! directory, shared for the purpose), the cgroup hierarchy, containerd's socket, the state and
//! run directories. Its pod lives under the test's own kubelet root
//! (`/egress-test-<pid>/kubepods`), like the app pod it confines: the agent runs under its own
//! enforcement root, as on a node.
//!
//! Judged by what arrived: a denied first connect of the app pod never reaches the canary, an
//! allowed CIDR port does, an allowed name over TLS goes through the agent's transparent proxy
//! (the agent's own upstream dial: its pod is `deny_all` by `unlabeled`, only its exempt cgroup
//! lets it out), and the DaemonSet's readiness command run in the agent container (CRI ExecSync)
//! is answered by the control API, while the same command from the confined app pod is refused.
//!
//! Departures from the manifest, each forced by the harness: the cgroup mount has no
//! `HostToContainer` propagation (the host's /sys/fs/cgroup is a private mount, and making it
//! shared would change it for everybody; propagation only matters for later mounts), and the
//! config's `[dns] hosts_file` names test hosts.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use egress_tests::containerd::{Containerd, GATEWAY, SharedDir, require_root};
use egress_tests::cri::{ContainerSpec, HostMount, Logs, Pod, PodSpec};
use egress_tests::tls_upstream::TestCa;
use k8s_cri::v1::MountPropagation;

/// The web policy's direct CIDR port, and a port no policy allows.
const ALLOWED_PORT: u16 = 9200;
const DENIED_PORT: u16 = 9300;
const TLS_PORT: u16 = 8443;
/// The raw TCP listeners' address (a second address on the harness bridge); the TLS upstream is
/// on the gateway address.
const CANARY_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 8, 200);
/// The DaemonSet's metrics listener (its liveness probe's target), in the node's namespace.
const METRICS: &str = "127.0.0.1:9464";

/// The test's host directories, removed on drop (declared before the harness, so dropped after
/// its pods are gone): the pin directory (removing the pins detaches the programs) and the
/// files the agent pod mounts.
struct NodeDirs {
    dir: PathBuf,
    pins: Option<SharedDir>,
}

impl Drop for NodeDirs {
    fn drop(&mut self) {
        if let Some(pins) = self.pins.take() {
            let path = pins.path().to_owned();
            drop(pins);
            std::fs::remove_dir_all(&path).ok();
        }
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The agent's configuration: deploy/kubernetes/configmap.yaml's, with the test's kubelet root,
/// hosts and policy, and `unlabeled = "deny_all"` (the agent's own pod is then denied, so only
/// its exemption lets the agent's own connections out).
fn config(root: &str) -> String {
    format!(
        r#"[agent]
bpffs = "/sys/fs/bpf/egress-agent"
default_policy = "deny_all"
unlabeled = "deny_all"
state_dir = "/var/lib/egress-agent"
[proxy]
endpoint = "169.254.100.1:3128"
[dns]
hosts_file = "/etc/egress-agent/hosts"
nameservers = []
[kubernetes]
containerd_socket = "/run/containerd/containerd.sock"
cgroup_root = "{root}"
"#
    )
}

/// policies.d/web.toml.
fn web_policy() -> String {
    format!(
        r#"allow_hosts = ["allowed.test"]
allow_ports = [{TLS_PORT}]
allow_cidrs = [{{ cidr = "{CANARY_IP}/32", ports = [{ALLOWED_PORT}] }}]
resolve_private = ["{GATEWAY}/32"]
"#
    )
}

fn image_archive() -> PathBuf {
    let Some(path) = std::env::var_os("EGRESS_AGENT_IMAGE") else {
        panic!(
            "EGRESS_AGENT_IMAGE is not set: it names the agent's image archive. `cargo xtask test` \
             writes it and sets it; by hand: `cargo xtask image`, then \
             EGRESS_AGENT_IMAGE=target/egress-agent-<version>.image.tar"
        );
    };
    let path = PathBuf::from(path);
    assert!(
        path.is_file(),
        "EGRESS_AGENT_IMAGE={} is not a file (`cargo xtask image` writes it)",
        path.display()
    );
    path
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn output(code: i32, logs: &Logs) -> String {
    format!(
        "exit {code}; stdout: {}; stderr: {}",
        logs.stdout, logs.stderr
    )
}

/// The agent pod as daemonset.yaml describes it.
fn agent_pod_spec() -> PodSpec {
    let mut spec = PodSpec::new("egress-agent", "egress-agent-node1");
    spec.labels
        .insert("app.kubernetes.io/name".into(), "egress-agent".into());
    spec.host_network = true;
    spec.host_pid = true;
    spec.privileged = true;
    // dnsPolicy: Default (the node's resolv.conf): no dns_config.
    spec
}

/// The agent container: the DaemonSet's command, securityContext and volume mounts.
fn agent_container(image: &str, dir: &Path, pins: &Path, socket: &Path) -> ContainerSpec {
    let mut spec = ContainerSpec::new(
        "agent",
        &[
            "egress-agent",
            "run",
            "--config",
            "/etc/egress-agent/config.toml",
            "--no-docker",
            "--metrics-listen",
            METRICS,
        ],
    );
    spec.image = Some(image.to_owned());
    spec.privileged = true;
    spec.run_as_user = Some(0);
    spec.readonly_rootfs = true;
    spec.host_mounts = vec![
        HostMount::ro(dir.join("config"), "/etc/egress-agent"),
        HostMount {
            propagation: MountPropagation::PropagationBidirectional,
            ..HostMount::rw(pins, "/sys/fs/bpf")
        },
        HostMount::rw("/sys/fs/cgroup", "/sys/fs/cgroup"),
        HostMount::rw(socket, "/run/containerd/containerd.sock"),
        HostMount::rw(dir.join("state"), "/var/lib/egress-agent"),
        HostMount::rw(dir.join("run"), "/run/egress-agent"),
    ];
    spec
}

/// Run `script` (sh) in a new container of `pod` to its end.
fn run_in(
    rt: &tokio::runtime::Runtime,
    c: &Containerd,
    pod: &Pod,
    name: &str,
    script: &str,
    ca: &Path,
) -> (i32, Logs) {
    rt.block_on(async {
        let mut spec = ContainerSpec::new(name, &["sh", "-c", script]);
        spec.mounts = vec![(ca.display().to_string(), "/ca".to_owned())];
        let id = c.create_container_spec(pod, &spec).await;
        c.start_container(&id).await;
        let code = c.wait_exit(&id, Duration::from_secs(30)).await;
        (code, c.logs(pod, name))
    })
}

#[test]
fn the_daemonset_image_confines_a_pod() {
    if !require_root() {
        return;
    }
    let archive = image_archive();
    let t0 = Instant::now();
    let pid = std::process::id();
    // Before the harness: dropped after it (its Drop removes the pods, the agent's first).
    let dir = PathBuf::from(format!("/tmp/egress-test-ds-{pid}"));
    let mut node = NodeDirs {
        dir: dir.clone(),
        pins: None,
    };
    for d in ["config/policies.d", "state", "run", "ca"] {
        std::fs::create_dir_all(dir.join(d)).expect("test dirs");
    }
    node.pins = Some(SharedDir::new(Path::new(&format!(
        "/sys/fs/bpf/egress-test-ds-{pid}"
    ))));
    let pins = node
        .pins
        .as_ref()
        .map(|p| p.path().to_owned())
        .expect("pins");

    // The agent's binary in the app image too: a confined caller of the control API.
    let agent_bin = egress_tests::agent::agent_bin();
    let mut c =
        Containerd::start_with(&[Path::new(env!("CARGO_BIN_EXE_egress-probe")), &agent_bin]);
    c.kubelet_root = format!("/egress-test-{pid}/kubepods");
    let names = c.import_archive(&archive);
    let image = names
        .iter()
        .find(|n| n.starts_with("docker.io/library/egress-agent:"))
        .unwrap_or_else(|| panic!("the archive imported as {names:?}, not egress-agent:<version>"))
        .clone();

    std::fs::write(dir.join("config/config.toml"), config(&c.kubelet_root)).expect("config");
    std::fs::write(dir.join("config/policies.d/web.toml"), web_policy()).expect("policy");
    std::fs::write(
        dir.join("config/hosts"),
        format!("{GATEWAY} allowed.test\n{GATEWAY} denied.test\n"),
    )
    .expect("hosts");
    let ca = TestCa::new();
    std::fs::write(dir.join("ca/ca.pem"), &ca.pem).expect("CA");

    let (canary, upstream) =
        egress_tests::pods::listeners(&c, &ca, &["allowed.test", "denied.test"]);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");

    // The agent pod, as the kubelet starts a DaemonSet's pod.
    let agent_pod = rt.block_on(c.run_pod(&agent_pod_spec()));
    let agent_id = rt.block_on(async {
        let id = c
            .create_container_spec(
                &agent_pod,
                &agent_container(&image, &dir, &pins, c.socket()),
            )
            .await;
        c.start_container(&id).await;
        id
    });
    let agent_log = || c.logs(&agent_pod, "agent");
    let agent_tail = || {
        let l = agent_log();
        format!(
            "agent log (tail):\n{}\n{}",
            tail(&l.stdout, 40),
            tail(&l.stderr, 60)
        )
    };
    // Ready: reconciled (its log, the CRI log file), then the DaemonSet's startup probe.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !agent_log().stderr.contains("containerd reconciled")
        && !agent_log().stdout.contains("containerd reconciled")
    {
        let state = rt
            .block_on(c.container_status(&agent_id))
            .status
            .map(|s| s.state)
            .unwrap_or_default();
        assert!(
            state != k8s_cri::v1::ContainerState::ContainerExited as i32,
            "the agent container exited before reconciling\n{}",
            agent_tail()
        );
        assert!(
            Instant::now() < deadline,
            "the agent pod did not reconcile containerd in 60 s\n{}",
            agent_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("agent pod reconciled {:?} after the start", t0.elapsed());
    let all = format!("{}{}", agent_log().stdout, agent_log().stderr);
    assert!(
        all.contains("its own cgroup is exempt"),
        "the agent in its pod did not exempt its own cgroup\n{}",
        agent_tail()
    );

    // The readiness probe's command in the agent container: the API trusts its own cgroup
    // (under the enforcement root, like every pod's).
    let (code, out) = rt.block_on(c.exec_sync(
        &agent_id,
        &["egress-agent", "policy", "list", "--json"],
        Duration::from_secs(5),
    ));
    assert_eq!(
        code,
        0,
        "readiness command in the agent container: {}\n{}",
        output(code, &out),
        agent_tail()
    );
    assert!(
        out.stdout.contains("web"),
        "`policy list --json` does not list policies.d/web.toml: {}",
        out.stdout
    );
    // What makes the exemption matter: the agent's pod (no annotation) is deny_all by
    // `unlabeled`, its own container's cgroup allow_all (the nearest entry wins).
    let (code, out) = rt.block_on(c.exec_sync(
        &agent_id,
        &["egress-agent", "status", "--json"],
        Duration::from_secs(5),
    ));
    assert_eq!(
        code,
        0,
        "status in the agent container: {}",
        output(code, &out)
    );
    let status: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", out.stdout));
    let policy_of = |suffix: &str| {
        status["kernel"]["cgroups"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["path"].as_str().is_some_and(|p| p.ends_with(suffix)))
            .map(|e| e["policy"].as_str().unwrap_or_default().to_owned())
    };
    let own = format!("{}/{agent_id}", agent_pod.cgroup_parent);
    assert_eq!(
        (
            policy_of(&agent_pod.cgroup_parent).as_deref(),
            policy_of(&own).as_deref()
        ),
        (Some("deny_all"), Some("allow_all")),
        "entries of the agent's pod and of its own container ({own}): {:#}",
        status["kernel"]["cgroups"]
    );
    // The liveness probe's target, from the node.
    let response = egress_tests::pods::metrics_get(&c.netns().path(), METRICS);
    let status = response.lines().next().unwrap_or_default();
    assert!(
        status.contains(" 200"),
        "GET http://{METRICS}/metrics from the node: {status:?}\n{}",
        agent_tail()
    );

    // An app pod with the web policy: its first instruction to a denied address gets nothing
    // out; a second container reaches the allowed CIDR port, and an allowed name over TLS
    // through the agent's transparent proxy (no proxy variables).
    let mut spec = PodSpec::new("ci", "app").annotation("egress.policy", "web");
    spec.dns_nameserver = Some(GATEWAY);
    let app = rt.block_on(c.run_pod(&spec));
    let ca_dir = dir.join("ca");
    let (code, logs) = run_in(
        &rt,
        &c,
        &app,
        "first",
        &format!("egress-probe tcp {CANARY_IP} {DENIED_PORT} FIRST-{pid}"),
        &ca_dir,
    );
    assert_ne!(
        code,
        0,
        "the app pod's denied first connect succeeded: {}\n{}",
        output(code, &logs),
        agent_tail()
    );
    let (code, logs) = run_in(
        &rt,
        &c,
        &app,
        "allowed",
        &format!(
            "egress-probe tcp {CANARY_IP} {ALLOWED_PORT} ALLOWED-{pid} && \
             egress-probe tls-get allowed.test allowed.test {TLS_PORT} /ca/ca.pem"
        ),
        &ca_dir,
    );
    let out = output(code, &logs);
    assert_eq!(
        code,
        0,
        "allowed CIDR port and name: {out}\n{}",
        agent_tail()
    );
    assert!(
        canary.wait_for(&format!("ALLOWED-{pid}"), Duration::from_secs(5)),
        "the allowed connect did not arrive: {out}"
    );
    assert!(out.contains("TLS-OK"), "allowed name over TLS: {out}");
    assert!(
        upstream
            .requests()
            .iter()
            .any(|r| r.header("host") == Some("allowed.test")),
        "no allowed.test request reached the upstream: {out}"
    );
    assert!(
        !canary.saw(&format!("FIRST-{pid}")),
        "the denied first connect arrived"
    );
    // The API's trust is the agent's own cgroup's, not every caller's under the root: the same
    // command on the same socket from the confined pod is refused.
    let (code, logs) = rt.block_on(async {
        let mut spec = ContainerSpec::new(
            "api",
            &[
                "egress-agent",
                "policy",
                "list",
                "--json",
                "--api-socket",
                "/run/egress-agent/api.sock",
            ],
        );
        spec.host_mounts = vec![HostMount::rw(dir.join("run"), "/run/egress-agent")];
        let id = c.create_container_spec(&app, &spec).await;
        c.start_container(&id).await;
        let code = c.wait_exit(&id, Duration::from_secs(30)).await;
        (code, c.logs(&app, "api"))
    });
    let out = output(code, &logs);
    assert!(
        code != 0 && out.contains("confined"),
        "a confined pod's API call was not refused as confined: {out}"
    );
    eprintln!("done in {:?}", t0.elapsed());
}
