//! The CRI harness itself (root): a private containerd runs a Kubernetes-like pod as a kubelet
//! would, and everything the agent's containerd runtime will rely on holds:
//!
//! - RunPodSandbox + CreateContainer/StartContainer run a pod (sandbox + app containers);
//! - the app container's cgroup2 path is `/kubepods/besteffort/pod<uid>/<id>` (cgroupfs), in
//!   the OCI spec's `linux.cgroupsPath` and in the process's `/proc/<pid>/cgroup`; a guaranteed
//!   pod's sandbox is under `/kubepods/pod<uid>/`, and its `dns_config` is its resolv.conf;
//! - `egress.*` pod and container annotations reach the OCI spec (`ctr containers info`), other
//!   annotations do not; the kubelet's pod labels are containerd container labels;
//! - an app container (with an extra host binary, `egress-probe`, in its image) reaches a TCP
//!   listener on the bridge gateway in the daemon's namespace, which *receives* the bytes from
//!   the pod IP; a second container of the pod has the same IP and network namespace;
//! - pods survive a containerd restart; stop/remove leave no containers, sandboxes or cgroups.
//!
//! One test (one containerd): the steps share the daemon and the image import.
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use egress_tests::canary::Canary;
use egress_tests::containerd::{Containerd, GATEWAY, Qos, cgroup2_mount, require_root};
use egress_tests::cri::{self, ContainerSpec, PodSpec};
use egress_tests::marker;
use k8s_cri::v1::{ContainerState, PodSandboxState};

/// The fields of `ctr containers info` the agent's runtime reads, for the log.
fn abridged(info: &serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "Labels": info["Labels"],
        "Spec.annotations": info["Spec"]["annotations"],
        "Spec.linux.cgroupsPath": info["Spec"]["linux"]["cgroupsPath"],
        "Spec.linux.namespaces": info["Spec"]["linux"]["namespaces"],
    })
}

fn network_ns_path(info: &serde_json::Value) -> String {
    info["Spec"]["linux"]["namespaces"]
        .as_array()
        .and_then(|ns| ns.iter().find(|n| n["type"] == "network"))
        .and_then(|n| n["path"].as_str())
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn pod_lifecycle_through_cri() {
    if !require_root() {
        return;
    }
    let t = Instant::now();
    let mut c = Containerd::start_with(&[std::path::Path::new(env!("CARGO_BIN_EXE_egress-probe"))]);
    eprintln!(
        "timing: containerd up + image imported in {:?}",
        t.elapsed()
    );

    let listen: SocketAddr = (GATEWAY, 9100).into();
    let canary = c.netns().run(|| Canary::on(&[listen], &[]));

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let spec = PodSpec::new("egress-test", "web")
            .label("app", "web")
            .annotation("egress.policy", "web-egress")
            // containerd matches the handler's patterns with Go's path.Match: `*` stops at `/`,
            // so "egress.*" does not pass a prefixed key.
            .annotation("egress.example/policy", "not-passed")
            .annotation("other.example/ignored", "not-passed");
        let t = Instant::now();
        let pod = c.run_pod(&spec).await;
        let pod_start = t.elapsed();
        eprintln!(
            "timing: RunPodSandbox {pod_start:?} (sandbox {}, ip {})",
            pod.sandbox_id, pod.ip
        );

        // App container 1: the extra binary sends a marker to the gateway listener, then it
        // stays up (for its cgroup and spec).
        let m1 = marker("cri-app");
        let mut app = ContainerSpec::new(
            "app",
            &[
                "sh",
                "-c",
                &format!("egress-probe tcp {GATEWAY} 9100 {m1}; exec sleep 2147483647"),
            ],
        );
        app.annotations
            .insert("egress.container".into(), "app-value".into());
        app.annotations
            .insert("io.example/unlisted".into(), "not-passed".into());
        let t = Instant::now();
        let app_id = c.create_container_spec(&pod, &app).await;
        c.start_container(&app_id).await;
        eprintln!("timing: CreateContainer + StartContainer {:?}", t.elapsed());
        eprintln!(
            "timing: pod start (sandbox + first container running) {:?}",
            t.elapsed() + pod_start
        );
        assert!(
            canary.wait_for(&m1, Duration::from_secs(10)),
            "the gateway listener {listen} did not receive {m1} from the app container; \
             its log: {:?}",
            c.logs(&pod, "app")
        );
        assert!(
            canary.peers().iter().any(|p| p.ip() == pod.ip),
            "no connection from the pod IP {}: peers {:?}",
            pod.ip,
            canary.peers()
        );

        // Its cgroup: cgroupfs layout under the pod cgroup the harness created.
        let want = format!("/kubepods/besteffort/pod{}/{app_id}", spec.uid);
        let pid = c.container_pid(&app_id).await;
        assert_eq!(cri::cgroup2_of(pid), want, "app container's cgroup2 path");
        assert!(cgroup2_mount().join(want.trim_start_matches('/')).is_dir());

        // What containerd's own API shows (the agent's runtime reads this).
        let sandbox_info = c.container_info(&pod.sandbox_id);
        let app_info = c.container_info(&app_id);
        eprintln!(
            "sandbox `ctr containers info` (abridged):\n{:#}",
            abridged(&sandbox_info)
        );
        eprintln!(
            "app `ctr containers info` (abridged):\n{:#}",
            abridged(&app_info)
        );
        assert_eq!(app_info["Spec"]["linux"]["cgroupsPath"], want.as_str());
        assert_eq!(
            sandbox_info["Spec"]["linux"]["cgroupsPath"],
            format!("/kubepods/besteffort/pod{}/{}", spec.uid, pod.sandbox_id).as_str()
        );
        let sandbox_ann = &sandbox_info["Spec"]["annotations"];
        let app_ann = &app_info["Spec"]["annotations"];
        assert_eq!(
            sandbox_ann["egress.policy"], "web-egress",
            "sandbox: pod annotation"
        );
        assert_eq!(
            app_ann["egress.policy"], "web-egress",
            "app: pod annotation"
        );
        assert_eq!(
            app_ann["egress.container"], "app-value",
            "app: its own annotation"
        );
        for ann in [sandbox_ann, app_ann] {
            for key in [
                "egress.example/policy",
                "other.example/ignored",
                "io.example/unlisted",
            ] {
                assert!(
                    ann.get(key).is_none(),
                    "{key} passed into the OCI spec: {ann}"
                );
            }
        }
        for (key, value) in [
            (cri::LABEL_POD_NAME, "web"),
            (cri::LABEL_POD_NAMESPACE, "egress-test"),
            (cri::LABEL_POD_UID, spec.uid.as_str()),
        ] {
            assert_eq!(sandbox_info["Labels"][key], value, "sandbox label {key}");
            assert_eq!(app_info["Labels"][key], value, "app label {key}");
        }
        assert_eq!(app_info["Labels"][cri::LABEL_CONTAINER_NAME], "app");
        // The sandbox's spec names the CNI netns (under our state dir), the app's names the
        // sandbox process's (`/proc/<pid>/ns/net`): the same namespace.
        let ns_id = |path: &str| {
            let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("stat {path}: {e}"));
            (m.dev(), m.ino())
        };
        assert_eq!(
            ns_id(&format!("/proc/{pid}/ns/net")),
            ns_id(&network_ns_path(&sandbox_info)),
            "the app container is not in the sandbox's network namespace"
        );
        assert_eq!(
            ns_id(&network_ns_path(&app_info)),
            ns_id(&network_ns_path(&sandbox_info))
        );

        // Container 2 of the same pod (busybox only): same IP, reaches the listener too.
        let m2 = marker("cri-second");
        let (code, logs) = c
            .run_to_exit(
                &pod,
                "second",
                &[
                    "sh",
                    "-c",
                    &format!(
                        "ip -4 -o addr show dev eth0; echo {m2} | nc -w 2 {GATEWAY} 9100 \
                         && echo SENT"
                    ),
                ],
                Duration::from_secs(20),
            )
            .await;
        assert_eq!(code, 0, "second container: {logs:?}");
        assert!(
            logs.stdout.contains(&format!("inet {}/24", pod.ip)) && logs.stdout.contains("SENT"),
            "second container does not share the pod IP {}: {logs:?}",
            pod.ip
        );
        assert!(
            canary.wait_for(&m2, Duration::from_secs(5)),
            "the listener did not receive {m2} from the second container"
        );

        // A guaranteed pod (no QoS level in its cgroup parent) with a DNS server of its own.
        let mut g = PodSpec::new("egress-test", "guaranteed");
        g.qos = Qos::Guaranteed;
        g.dns_nameserver = Some(GATEWAY);
        let gpod = c.run_pod(&g).await;
        let ginfo = c.container_info(&gpod.sandbox_id);
        assert_eq!(
            ginfo["Spec"]["linux"]["cgroupsPath"],
            format!("/kubepods/pod{}/{}", g.uid, gpod.sandbox_id).as_str()
        );
        let (code, logs) = c
            .run_to_exit(
                &gpod,
                "dns",
                &["cat", "/etc/resolv.conf"],
                Duration::from_secs(20),
            )
            .await;
        assert_eq!(code, 0, "{logs:?}");
        assert!(
            logs.stdout.contains(&format!("nameserver {GATEWAY}")),
            "the pod's resolv.conf lacks its dns_config: {logs:?}"
        );
        c.stop_pod(&gpod).await;
        c.remove_pod(&gpod).await;
    });

    // A containerd restart leaves the pod running (the shims outlive the daemon).
    let t = Instant::now();
    c.restart();
    eprintln!("timing: containerd restart {:?}", t.elapsed());
    rt.block_on(async {
        let pods = c.list_pods().await;
        assert_eq!(pods.len(), 1, "pods after restart: {pods:?}");
        assert_eq!(
            pods[0].state,
            PodSandboxState::SandboxReady as i32,
            "pod not ready after restart"
        );
        let running: Vec<_> = c
            .list_containers()
            .await
            .into_iter()
            .filter(|x| x.state == ContainerState::ContainerRunning as i32)
            .collect();
        assert_eq!(running.len(), 1, "the app container runs on: {running:?}");

        let pod_cgroup = cgroup2_mount().join(format!(
            "kubepods/besteffort/pod{}",
            pods[0]
                .labels
                .get(cri::LABEL_POD_UID)
                .expect("pod uid label")
        ));
        let t = Instant::now();
        c.remove_all_pods().await;
        eprintln!(
            "timing: StopPodSandbox + RemovePodSandbox {:?}",
            t.elapsed()
        );
        assert!(c.list_pods().await.is_empty(), "sandboxes left");
        assert!(c.list_containers().await.is_empty(), "CRI containers left");
        assert_eq!(
            c.container_ids(),
            Vec::<String>::new(),
            "containerd containers left"
        );
        let children: Vec<_> = std::fs::read_dir(&pod_cgroup)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            children.is_empty(),
            "container cgroups left in {}: {children:?}",
            pod_cgroup.display()
        );
    });
}
