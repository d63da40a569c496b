//! Kubernetes pods confined by the agent's containerd runtime (root): a private containerd played
//! as a kubelet (tests/src/cri.rs) and `egress-agent run --no-docker` with `[kubernetes]`, both in
//! the harness's network namespace. Every check is judged by what *arrived* at a listener.
//!
//! One test (one containerd, one agent): the steps share the daemon, the image and the agent.
//! The pods live under a kubelet root of this test's own (`/egress-test-<pid>/kubepods`), so the
//! programs it attaches never cover anything else on the host; removing the test's bpffs pins
//! detaches them.
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use egress_tests::containerd::{Containerd, GATEWAY, require_root};
use egress_tests::cri::Pod;
use egress_tests::pods::{
    ALLOWED_PORT, Agent, CANARY_IP, DENIED_PORT, HOST_SERVICE_PORT, STATUS_PAGE, context_of,
    listener_ports, output, pod_in, run_in,
};
use egress_tests::tls_upstream::TestCa;

#[test]
fn pods_are_confined_per_pod_through_containerd() {
    if !require_root() {
        return;
    }
    let pid = std::process::id();
    let mut c = Containerd::start_with(&[
        Path::new(env!("CARGO_BIN_EXE_egress-probe")),
        // Debian's curl (its libraries come along), for the read-only host under interception.
        Path::new("/usr/bin/curl"),
    ]);
    c.kubelet_root = format!("/egress-test-{pid}/kubepods");

    let ca = TestCa::new();
    let mut agent = Agent::new(&c, &ca.pem);
    let dir = agent.dir.clone();

    // What arrives: raw TCP on the gateway (allowed CIDR port, denied port), and the TLS
    // upstream serving the names.
    let (canary, upstream) = egress_tests::pods::listeners(
        &c,
        &ca,
        &["allowed.test", "denied.test", "other.test", "ro.test"],
    );
    // policies.d as a ConfigMap volume (the kubelet's ..data layout): policy `swap`.
    let policies = dir.join("policies.d");
    let swap_policy =
        |port: u16| format!("allow_cidrs = [{{ cidr = \"{CANARY_IP}/32\", ports = [{port}] }}]\n");
    let mut version = 0;
    let mut kubelet = |text: &str| {
        version += 1;
        egress_agent::config::kubelet::update(
            &policies,
            &format!("2026_12_03_08_00_00.{version:09}"),
            &[("swap.toml", text)],
        )
        .expect("the kubelet's update");
    };
    kubelet(&swap_policy(ALLOWED_PORT));
    agent.start();
    // doctor reads the test containerd's config: its runtime handler passes egress.* pod
    // annotations (the harness sets pod_annotations), and says so.
    let doctor = Command::new(&agent.bin)
        .args(["doctor", "--json", "--config"])
        .arg(dir.join("config.toml"))
        .output()
        .expect("doctor");
    let report: serde_json::Value =
        serde_json::from_slice(&doctor.stdout).expect("doctor --json prints JSON");
    let probe = report
        .as_array()
        .or_else(|| report["checks"].as_array())
        .and_then(|cs| cs.iter().find(|c| c["id"] == "containerd.pod_annotations"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        probe["status"], "pass",
        "doctor's containerd probe: {probe}"
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let ca_mount = vec![(dir.join("ca").display().to_string(), "/ca".to_owned())];
    let run = |c: &Containerd, pod: &Pod, name: &str, script: &str| {
        run_in(&rt, c, pod, name, script, &ca_mount)
    };
    let pod_with = |c: &Containerd, ns: &str, name: &str, annotations: &[(&str, &str)]| {
        pod_in(&rt, c, ns, name, annotations)
    };

    // 1. A pod's first instruction to a denied address gets nothing out; an allowed one does.
    //    "first" runs as the kubelet runs an init container: CRI has no init kind, the kubelet
    //    creates and starts it like any container and waits for its exit before the next one.
    let a = pod_with(&c, "ci", "a", &[("egress.policy", "web")]);
    let (code, logs) = run(
        &c,
        &a,
        "first",
        &format!("egress-probe tcp {CANARY_IP} {DENIED_PORT} FIRST-A-{pid}"),
    );
    assert_ne!(
        code,
        0,
        "denied first connect succeeded: {}",
        output(code, &logs)
    );
    let (code, logs) = run(
        &c,
        &a,
        "direct",
        &format!("egress-probe tcp {CANARY_IP} {ALLOWED_PORT} DIRECT-A-{pid}"),
    );
    assert_eq!(code, 0, "allowed CIDR port: {}", output(code, &logs));
    assert!(canary.wait_for(&format!("DIRECT-A-{pid}"), Duration::from_secs(5)));

    // 2. An allowed HTTPS name with no proxy variables (transparent + the agent's DNS), from a
    //    second container of the same pod: the pod's policy holds for every container.
    let (code, logs) = run(
        &c,
        &a,
        "tls",
        "env | grep -i proxy; grep nameserver /etc/resolv.conf; \
         egress-probe tls-get allowed.test allowed.test 8443 /ca/ca.pem; \
         nslookup denied.test >/dev/null 2>&1 && echo RESOLVED-DENIED || echo NX-DENIED; \
         egress-probe tls-get denied.test 198.18.8.1 8443 /ca/ca.pem || echo SNI-REFUSED",
    );
    let out = output(code, &logs);
    assert!(
        !out.to_lowercase().contains("proxy="),
        "no proxy variables: {out}"
    );
    assert!(out.contains("TLS-OK"), "allowed name over TLS: {out}");
    assert!(
        out.contains("NX-DENIED"),
        "denied name must be NXDOMAIN: {out}"
    );
    assert!(out.contains("SNI-REFUSED"), "denied SNI: {out}");
    assert!(
        upstream
            .requests()
            .iter()
            .all(|r| r.header("host") != Some("denied.test")),
        "a denied.test request reached the upstream"
    );
    assert!(
        !canary.saw(&format!("FIRST-A-{pid}")),
        "the denied first instruction arrived"
    );
    // 2a. Its policy's host service (a local model server on the node): at the pod's gateway
    //     (host.docker.internal, answered by the agent), not another port, not another address
    //     of the node.
    let node = c.netns().run(|| {
        egress_tests::canary::Canary::on(
            &[
                std::net::SocketAddr::from((GATEWAY, HOST_SERVICE_PORT)),
                std::net::SocketAddr::from((GATEWAY, HOST_SERVICE_PORT + 1)),
                std::net::SocketAddr::from((CANARY_IP, HOST_SERVICE_PORT)),
            ],
            &[],
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent.log().contains("host services opened") {
        assert!(
            Instant::now() < deadline,
            "the agent never opened pod a's host service:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, logs) = run(
        &c,
        &a,
        "model",
        &format!(
            "nslookup host.docker.internal; \
             egress-probe tcp {GATEWAY} {HOST_SERVICE_PORT} HS-A-{pid}; \
             egress-probe tcp {GATEWAY} {} HS-PORT-{pid} || echo HS-PORT-REFUSED; \
             egress-probe tcp {CANARY_IP} {HOST_SERVICE_PORT} HS-ADDR-{pid} || echo HS-ADDR-REFUSED",
            HOST_SERVICE_PORT + 1
        ),
    );
    let out = output(code, &logs);
    assert!(
        out.contains(&GATEWAY.to_string()),
        "host.docker.internal is the pod's gateway: {out}"
    );
    assert!(
        out.contains("HS-PORT-REFUSED") && out.contains("HS-ADDR-REFUSED"),
        "{out}"
    );
    assert!(
        node.wait_for(&format!("HS-A-{pid}"), Duration::from_secs(5)),
        "the host service never got pod a's connection: {out}"
    );
    for refused in ["HS-PORT", "HS-ADDR"] {
        assert!(
            !node.saw(&format!("{refused}-{pid}")),
            "{refused} arrived: {out}"
        );
    }

    // 2c. A read-only host (TLS interception, transparent: pods get no proxy variables): a read
    //     arrives, a write is refused and never arrives. The pod trusts the agent's CA bundle.
    let bundle = dir.join("state/ca-bundle.pem");
    std::fs::copy(&bundle, dir.join("ca/agent-bundle.pem"))
        .unwrap_or_else(|e| panic!("the agent's CA bundle {}: {e}", bundle.display()));
    let (code, logs) = run(
        &c,
        &a,
        "readonly",
        &format!(
            "C='curl -sS --max-time 15 --cacert /ca/agent-bundle.pem'; \
             echo \"ro-get $($C https://ro.test:8443/v1/pod-ro-get-{pid})\"; \
             echo \"ro-post $($C -o /dev/null -w '%{{http_code}}' -X POST --data leak https://ro.test:8443/v1/pod-ro-post-{pid})\"; \
             echo \"ro-put $($C -o /dev/null -w '%{{http_code}}' -X PUT --data leak https://ro.test:8443/v1/pod-ro-put-{pid})\""
        ),
    );
    let out = output(code, &logs);
    assert!(
        out.contains(&format!("ro-get upstream-ok HTTP/2.0 /v1/pod-ro-get-{pid}")),
        "a read of the read-only host: {out}"
    );
    assert!(
        out.contains("ro-post 403") && out.contains("ro-put 403"),
        "writes to the read-only host: {out}"
    );
    let paths: Vec<String> = upstream.requests().into_iter().map(|r| r.target).collect();
    assert!(
        paths.contains(&format!("/v1/pod-ro-get-{pid}")),
        "the read never arrived: {paths:?}"
    );
    assert!(
        !paths
            .iter()
            .any(|p| p.contains("pod-ro-post") || p.contains("pod-ro-put")),
        "a write arrived: {paths:?}"
    );

    // 2b. The pod reads its policy and asks for a host at egress.internal through its proxy;
    //     the daemon holds the request under the pod's name, as its listener identifies it.
    let ask = r#"{"host": "other.test", "port": 8443, "reason": "the pod test asks"}"#;
    let (code, logs) = run(
        &c,
        &a,
        "ask",
        &format!(
            "{}; {}",
            egress_tests::docker::egress_internal("GET", "/v1/self", ""),
            egress_tests::docker::egress_internal("POST", "/v1/requests", ask)
        ),
    );
    let out = output(code, &logs);
    assert!(
        out.contains(r#""policy":"web""#),
        "the pod's own policy: {out}"
    );
    assert!(out.contains("HTTP/1.1 202"), "the request is taken: {out}");
    let listed = agent.cli(&["requests", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap_or_default();
    let first = &listed[0];
    assert_eq!(
        (
            first["host"].as_str(),
            first["policy"].as_str(),
            first["state"].as_str()
        ),
        (Some("other.test"), Some("web"), Some("pending")),
        "{listed}"
    );
    let workload = first["workload"].as_str().unwrap_or_default();
    assert!(
        out.contains(&format!(r#""workload":"{workload}""#)) && !workload.is_empty(),
        "the same workload in /v1/self and the operator's list: {workload} / {out}"
    );
    // Approved for this pod's run: its long-poll reads the approval and its retry arrives; a
    // second pod under the same policy is still refused, and nothing of it arrives.
    let id = first["id"].as_u64().expect("request id").to_string();
    let o = agent.cli(&["requests", "approve", &id, "--scope", "run"]);
    assert!(o.status.success(), "approve: {o:?}");
    let other_hits = || {
        upstream
            .requests()
            .iter()
            .filter(|r| {
                r.header("host")
                    .is_some_and(|h| h.starts_with("other.test"))
            })
            .count()
    };
    let before = other_hits();
    let (code, logs) = run(
        &c,
        &a,
        "granted",
        &format!(
            "{}; egress-probe tls-get other.test other.test 8443 /ca/ca.pem",
            egress_tests::docker::egress_internal("GET", &format!("/v1/requests/{id}?wait=5"), "")
        ),
    );
    let out = output(code, &logs);
    assert!(
        out.contains(r#""state":"approved""#),
        "the long-poll: {out}"
    );
    assert!(
        out.contains("TLS-OK"),
        "the retry after the approval: {out}"
    );
    assert_eq!(other_hits(), before + 1, "the granted request arrived once");
    let a2 = pod_with(&c, "ci", "a2", &[("egress.policy", "web")]);
    let (code, logs) = run(
        &c,
        &a2,
        "c",
        "egress-probe tls-get other.test other.test 8443 /ca/ca.pem || echo A2-REFUSED",
    );
    assert!(
        output(code, &logs).contains("A2-REFUSED"),
        "{}",
        output(code, &logs)
    );
    assert_eq!(other_hits(), before + 1, "the second pod's request arrived");
    assert!(
        agent.wait_event(
            |e| e["host"] == "denied.test"
                && context_of(e, "k8s.namespace.name") == "ci"
                && context_of(e, "k8s.pod.name") == "a"
                && !context_of(e, "k8s.pod.uid").is_empty(),
            Duration::from_secs(5)
        ),
        "no denial event naming the pod: {:#?}",
        agent.events()
    );
    // The kernel's refusal of the first instruction names the container it came from.
    assert!(
        agent.wait_event(
            |e| e["source"] == "kernel"
                && e["port"] == DENIED_PORT
                && context_of(e, "k8s.pod.name") == "a"
                && context_of(e, "k8s.container.name") == "first",
            Duration::from_secs(5)
        ),
        "no kernel denial naming pod a's container \"first\": {:#?}",
        agent.events()
    );
    // The pod's denials in its own metrics series (namespace, pod, verdict), and the enforced
    // gauge counts pods on a node without Docker (it is refreshed every second).
    let value = |metrics: &str, series: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let series = r#"egress_agent_pod_denials_total{namespace="ci",pod="a",verdict="deny"}"#;
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let m = agent.metrics();
        if value(&m, series) >= 1.0 && value(&m, "egress_agent_enforced_containers") >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no {series} >= 1 or no enforced pod in /metrics:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The agent's DNS and the transparent proxy name the container too (the pod's containers
    // share its listener; the client socket's cgroup says which one asked).
    for (what, dns) in [("DNS refusal", true), ("SNI refusal", false)] {
        assert!(
            agent.wait_event(
                |e| e["host"] == "denied.test"
                    && (e["protocol"] == "dns") == dns
                    && context_of(e, "k8s.pod.name") == "a"
                    && context_of(e, "k8s.container.name") == "tls",
                Duration::from_secs(5)
            ),
            "no {what} naming pod a's container \"tls\": {:#?}",
            agent.events()
        );
    }

    // The status page shows the pod (kind pod) and names the container in its denials.
    {
        let mut b = egress_tests::browser::Browser::open(
            &c.netns().path(),
            &format!("http://{STATUS_PAGE}/ui/"),
            dir.join("chromium-profile"),
        );
        let dom = b.wait_dom("pod ci/a and its container's denial", |d| {
            egress_tests::browser::container_row(d, "ci/a")
                .is_some_and(|r| r.contains("data-kind=\"pod\""))
                && d.contains(">ci/a (first)<")
        });
        assert!(
            egress_tests::browser::container_row(&dom, "ci/a")
                .is_some_and(|r| r.contains("data-badge=\"allowlist\"")),
            "{dom}"
        );
    }

    // `explain`, `events` and the containers list take pods like containers.
    let o = agent.cli(&["explain", "--pod", "ci/a", "allowed.test:8443", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "explain --pod: {e}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    assert_eq!(v["policy"]["name"], "web", "{v:#}");
    assert_eq!(v["pod"]["enforced_as"], "web", "{v:#}");
    // The store is written off the hot path: wait for the pod's refusals to land.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let config = dir.join("config.toml");
        let o = agent.cli(&[
            "events",
            "--pod",
            "ci/a",
            "--verdict",
            "deny",
            "--config",
            config.to_str().expect("utf-8 path"),
        ]);
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success() && text.contains("denied.test") {
            assert!(
                !text.contains("ci/b"),
                "events --pod ci/a showed another pod: {text}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "events --pod ci/a: {text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // 3. A second pod with another policy in the same namespace can't borrow the first's
    //    listener: every proxy listener, asked for the first pod's allowed CIDR port.
    let b = pod_with(&c, "ci", "b", &[("egress.policy", "other")]);
    let ports = listener_ports(&c);
    assert!(!ports.is_empty(), "no pod listeners");
    // A CONNECT to the first pod's allowed CIDR port through every proxy listener.
    let borrow = |tag: &str| -> String {
        ports
            .iter()
            .map(|p| {
                format!(
                    "printf 'CONNECT {CANARY_IP}:{ALLOWED_PORT} HTTP/1.1\\r\\nHost: {CANARY_IP}:{ALLOWED_PORT}\\r\\n\\r\\nBORROW-{tag}-{p}-{pid}' | nc -w 2 169.254.100.1 {p}; "
                )
            })
            .collect()
    };
    let script: String = borrow("B")
        + &format!(
            "egress-probe tcp {CANARY_IP} {ALLOWED_PORT} DIRECT-B-{pid}; \
             egress-probe tls-get other.test other.test 8443 /ca/ca.pem; \
             egress-probe tls-get allowed.test allowed.test 8443 /ca/ca.pem || echo B-ALLOWED-REFUSED; \
             egress-probe tcp {GATEWAY} {HOST_SERVICE_PORT} HS-B-{pid} || echo B-HS-REFUSED"
        );
    let (code, logs) = run(&c, &b, "borrow", &script);
    let out = output(code, &logs);
    assert!(
        out.contains("B-HS-REFUSED") && !node.saw(&format!("HS-B-{pid}")),
        "pod b reached pod a's host service: {out}"
    );
    assert!(out.contains("TLS-OK"), "pod b's own policy: {out}");
    assert!(
        out.contains("B-ALLOWED-REFUSED"),
        "pod b used pod a's name: {out}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !canary.saw("BORROW-"),
        "pod b borrowed a listener (ports {ports:?}): {out}"
    );
    assert!(
        !canary.saw(&format!("DIRECT-B-{pid}")),
        "pod b's direct connect arrived"
    );

    // 4. An unannotated pod is untouched (agent.unlabeled = allow_all); a namespace default applies.
    let plain = pod_with(&c, "plain", "p", &[]);
    let (code, logs) = run(
        &c,
        &plain,
        "c",
        &format!("egress-probe tcp {CANARY_IP} {DENIED_PORT} PLAIN-{pid}"),
    );
    assert_eq!(code, 0, "unannotated pod: {}", output(code, &logs));
    assert!(canary.wait_for(&format!("PLAIN-{pid}"), Duration::from_secs(5)));
    // The nftables host layer covers pod interfaces: the cgroup programs let an unannotated
    // pod do anything, yet it can't use an annotated pod's listener (and its credentials):
    // the proxy address is reachable only from enforced pods, each on its own ports.
    let (code, logs) = run(&c, &plain, "borrow", &borrow("PLAIN"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !canary.saw("BORROW-PLAIN-"),
        "an unannotated pod used a pod's listener (ports {ports:?}): {}",
        output(code, &logs)
    );
    // #40 item 1: processes of the node itself — root and nobody — are no pod: a listener
    // admits only connections the kernel sent from its own pod, so the same CONNECT through
    // every pod listener gets nothing through (closed unread: the peer sees a reset, hence
    // `|| true`).
    let host_borrow = |tag: &str| -> String {
        ports
            .iter()
            .map(|p| {
                format!(
                    "(exec 3<>/dev/tcp/169.254.100.1/{p} && printf 'CONNECT {CANARY_IP}:{ALLOWED_PORT} HTTP/1.1\\r\\nHost: {CANARY_IP}:{ALLOWED_PORT}\\r\\n\\r\\nBORROW-{tag}-{p}-{pid}' >&3 && timeout 2 cat <&3) 2>&1 || true; "
                )
            })
            .collect()
    };
    let got_root = c.netns().sh(&host_borrow("NODEROOT"));
    let got_nobody = c.netns().sh(&format!(
        "setpriv --reuid=65534 --regid=65534 --clear-groups -- bash -c {}",
        egress_tests::docker::shell_quote(&host_borrow("NODENOBODY"))
    ));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !canary.saw("BORROW-NODE") && !format!("{got_root}{got_nobody}").contains("HTTP/1.1"),
        "a node process used a pod's listener (ports {ports:?}): {got_root}{got_nobody}"
    );
    assert!(
        agent.wait_event(
            |e| e["reason"] == "listener-foreign-peer" && e["context"]["peer"].is_string(),
            Duration::from_secs(10)
        ),
        "no listener-foreign-peer event: {:#?}",
        agent.events()
    );
    let rules = host_rules(&c);
    for (pod, what) in [(&a, "pod a"), (&b, "pod b")] {
        assert!(
            rules.contains(short(pod)),
            "no host rules for {what} ({}):\n{rules}",
            short(pod)
        );
    }
    // A hostNetwork pod shares the node's interfaces (no veth of its own for the host layer):
    // the cgroup programs confine it from its first instruction all the same.
    let mut spec =
        egress_tests::cri::PodSpec::new("ci", "hostnet").annotation("egress.policy", "web");
    spec.host_network = true;
    let hostnet = rt.block_on(c.run_pod(&spec));
    let (code, logs) = run(
        &c,
        &hostnet,
        "c",
        &format!(
            "egress-probe tcp {CANARY_IP} {DENIED_PORT} HOSTNET-DENIED-{pid} || echo HOSTNET-REFUSED; \
             egress-probe tcp {CANARY_IP} {ALLOWED_PORT} HOSTNET-ALLOWED-{pid}; \
             egress-probe tls-get denied.test denied.test 8443 /ca/ca.pem || echo HOSTNET-NAME-REFUSED"
        ),
    );
    let out = output(code, &logs);
    assert!(
        out.contains("HOSTNET-REFUSED") && out.contains("HOSTNET-NAME-REFUSED"),
        "hostNetwork pod: {out}"
    );
    assert!(
        canary.wait_for(&format!("HOSTNET-ALLOWED-{pid}"), Duration::from_secs(5)),
        "hostNetwork pod's allowed port: {out}"
    );
    assert!(!canary.saw(&format!("HOSTNET-DENIED-{pid}")));
    assert!(
        upstream
            .requests()
            .iter()
            .all(|r| r.header("host") != Some("denied.test")),
        "hostNetwork pod reached a name outside its policy"
    );
    let team = pod_with(&c, "team", "t", &[]);
    let (code, logs) = run(
        &c,
        &team,
        "c",
        &format!(
            "egress-probe tls-get other.test other.test 8443 /ca/ca.pem; \
             egress-probe tcp {CANARY_IP} {DENIED_PORT} TEAM-{pid} || echo TEAM-REFUSED"
        ),
    );
    let out = output(code, &logs);
    assert!(
        out.contains("TLS-OK") && out.contains("TEAM-REFUSED"),
        "namespace default: {out}"
    );

    // 5. Malformed and unknown-policy annotations: deny_all, and the event says why.
    for (name, key, value, says) in [
        (
            "bad1",
            "egress.policy",
            "nope",
            "unknown policy \"nope\" in annotation egress.policy",
        ),
        (
            "bad2",
            "egress.polcy",
            "web",
            "unknown annotation \"egress.polcy\"",
        ),
    ] {
        let bad = pod_with(&c, "ci", name, &[(key, value)]);
        let (code, logs) = run(
            &c,
            &bad,
            "c",
            &format!("egress-probe tcp {CANARY_IP} {ALLOWED_PORT} BAD-{name}-{pid}"),
        );
        assert_ne!(code, 0, "{name}: {}", output(code, &logs));
        assert!(
            agent.wait_event(
                |e| e["reason"].as_str().is_some_and(|r| r.contains(says))
                    && context_of(e, "k8s.pod.name") == name,
                Duration::from_secs(5)
            ),
            "no event for {name} saying {says:?}: {:#?}",
            agent.events()
        );
        rt.block_on(async {
            c.stop_pod(&bad).await;
            c.remove_pod(&bad).await;
        });
    }
    assert!(!canary.saw("BAD-"), "a pod with bad annotations got out");
    // #40 item 6: an app container holding a provider's key in its environment is reported
    // (named by container, never by value) when its containerd record is created; the agent's
    // setting here is the default (reported, not confined), so its allowed connection arrives.
    const PROVIDER_KEY: &str = "sk-proj-Pz4Lq8Wd2Kv6-never-shown";
    let holder = pod_with(&c, "ci", "holder", &[("egress.policy", "web")]);
    let (code, logs) = rt.block_on(async {
        let mut cs = egress_tests::cri::ContainerSpec::new(
            "main",
            &[
                "egress-probe",
                "tcp",
                &CANARY_IP.to_string(),
                &ALLOWED_PORT.to_string(),
                &format!("HOLDER-{pid}"),
            ],
        );
        cs.envs
            .insert("OPENAI_API_KEY".to_owned(), PROVIDER_KEY.to_owned());
        let id = c.create_container_spec(&holder, &cs).await;
        c.start_container(&id).await;
        let code = c.wait_exit(&id, Duration::from_secs(30)).await;
        (code, c.logs(&holder, "main"))
    });
    assert_eq!(code, 0, "holder: {}", output(code, &logs));
    assert!(
        agent.wait_event(
            |e| e["reason"] == "workload-holds-secret"
                && context_of(e, "k8s.pod.name") == "holder"
                && context_of(e, "variables").contains("main/OPENAI_API_KEY (provider-variable)")
                && context_of(e, "action").starts_with("reported"),
            Duration::from_secs(10)
        ),
        "no workload-holds-secret event for the holder pod: {:#?}",
        agent.events()
    );
    assert!(
        canary.saw(&format!("HOLDER-{pid}")),
        "the holder pod's allowed connection did not arrive"
    );
    let shown = format!("{:?}{}", agent.events(), agent.log());
    assert!(!shown.contains(PROVIDER_KEY), "a key's value was shown");
    rt.block_on(async {
        c.stop_pod(&holder).await;
        c.remove_pod(&holder).await;
    });
    // An annotated pod whose cgroup is outside the kubelet root the agent enforces: nothing
    // would confine it, so it never runs (killed at task create).
    let enforced_root = std::mem::replace(
        &mut c.kubelet_root,
        format!("/egress-test-{pid}/elsewhere/kubepods"),
    );
    let mut spec =
        egress_tests::cri::PodSpec::new("ci", "outside").annotation("egress.policy", "web");
    spec.dns_nameserver = Some(GATEWAY);
    let outside = rt.block_on(c.try_run_pod(&spec));
    c.kubelet_root = enforced_root;
    if let Ok(pod) = &outside {
        let out = rt.block_on(async {
            let mut cs = egress_tests::cri::ContainerSpec::new(
                "c",
                &[
                    "egress-probe",
                    "tcp",
                    &CANARY_IP.to_string(),
                    &DENIED_PORT.to_string(),
                    &format!("OUTSIDE-{pid}"),
                ],
            );
            cs.mounts = Vec::new();
            match c.try_create_container_spec(pod, &cs).await {
                Ok(id) => c.try_start_container(&id).await,
                Err(e) => Err(e),
            }
        });
        eprintln!("outside pod's container start: {out:?}");
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !canary.saw(&format!("OUTSIDE-{pid}")),
        "an annotated pod outside the kubelet root ran (sandbox start: {:?})",
        outside.as_ref().map(|p| p.sandbox_id.clone())
    );
    assert!(
        agent.log().contains("is outside [kubernetes] cgroup_root"),
        "no refusal logged for the pod outside the root"
    );

    // 6. Killed agent: running pods stay confined, a pod started meanwhile is denied, and both
    //    get their policy when the agent is back.
    agent.kill();
    let (code, _) = run(
        &c,
        &a,
        "while-down",
        &format!("egress-probe tcp {CANARY_IP} {DENIED_PORT} DOWN-A-{pid}"),
    );
    assert_ne!(code, 0);
    let late = pod_with(&c, "ci", "late", &[("egress.policy", "web")]);
    let (code, logs) = run(
        &c,
        &late,
        "c",
        &format!("egress-probe tcp {CANARY_IP} {ALLOWED_PORT} LATE-DOWN-{pid}"),
    );
    assert_ne!(
        code,
        0,
        "a pod started without the agent got out: {}",
        output(code, &logs)
    );
    agent.start();
    let (code, logs) = run(
        &c,
        &late,
        "c2",
        &format!("egress-probe tcp {CANARY_IP} {ALLOWED_PORT} LATE-UP-{pid}"),
    );
    assert_eq!(
        code,
        0,
        "late pod after the agent came back: {}",
        output(code, &logs)
    );
    assert!(canary.wait_for(&format!("LATE-UP-{pid}"), Duration::from_secs(5)));
    // Its host rules were written by the reconcile (its sandbox ran before the agent was back).
    assert!(
        host_rules(&c).contains(short(&late)),
        "no host rules for the pod started while the agent was away"
    );
    let (code, logs) = run(
        &c,
        &a,
        "after",
        &format!("egress-probe tcp {CANARY_IP} {ALLOWED_PORT} AFTER-A-{pid}"),
    );
    assert_eq!(code, 0, "pod a after the restart: {}", output(code, &logs));
    assert!(!canary.saw(&format!("DOWN-A-{pid}")) && !canary.saw(&format!("LATE-DOWN-{pid}")));

    // 7. containerd restarted under the agent: it reconnects and reconciles; a new pod gets its
    //    policy.
    let reconciled = agent.log().matches("containerd reconciled").count();
    c.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    while agent.log().matches("containerd reconciled").count() <= reconciled {
        assert!(
            Instant::now() < deadline,
            "no reconcile after containerd restarted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let again = pod_with(&c, "ci", "again", &[("egress.policy", "web")]);
    let (code, logs) = run(
        &c,
        &again,
        "c",
        &format!(
            "egress-probe tcp {CANARY_IP} {ALLOWED_PORT} AGAIN-{pid}; \
             egress-probe tcp {CANARY_IP} {DENIED_PORT} AGAIN-DENIED-{pid} || echo AGAIN-REFUSED"
        ),
    );
    assert!(output(code, &logs).contains("AGAIN-REFUSED"));
    assert!(canary.wait_for(&format!("AGAIN-{pid}"), Duration::from_secs(5)));

    // 8. A ConfigMap swap changes a running pod's policy; a bad swap is refused and the old
    //    policy holds.
    let sw = pod_with(&c, "ci", "sw", &[("egress.policy", "swap")]);
    let probe = |c: &Containerd, name: &str, port: u16| {
        let (code, _) = run(
            c,
            &sw,
            name,
            &format!("egress-probe tcp {CANARY_IP} {port} {name}-{pid}"),
        );
        code == 0 && canary.wait_for(&format!("{name}-{pid}"), Duration::from_secs(5))
    };
    assert!(
        probe(&c, "SW1", ALLOWED_PORT),
        "the ConfigMap's policy at start"
    );
    let wait_reload = |what: &str, before: usize| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let log = agent.log();
            let n = log.matches("configuration reloaded").count()
                + log.matches("configuration rejected").count();
            if n > before {
                return log;
            }
            assert!(Instant::now() < deadline, "no reload after {what}:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let count = |log: &str| {
        log.matches("configuration reloaded").count()
            + log.matches("configuration rejected").count()
    };
    let before = count(&agent.log());
    kubelet(&swap_policy(DENIED_PORT));
    wait_reload("the swap", before);
    assert!(probe(&c, "SW2", DENIED_PORT), "the swapped policy");
    assert!(
        !probe(&c, "SW3", ALLOWED_PORT),
        "the old policy's port after the swap"
    );
    let before = count(&agent.log());
    kubelet("allow_cidrs = [ not toml");
    let log = wait_reload("the bad swap", before);
    let rejected = log
        .lines()
        .find(|l| l.contains("configuration rejected"))
        .unwrap_or_default();
    assert!(
        rejected.contains("swap.toml"),
        "the bad swap must be refused naming its file: {rejected:?}"
    );
    assert!(
        probe(&c, "SW4", DENIED_PORT),
        "the policy in force before the bad swap"
    );
    rt.block_on(async {
        c.stop_pod(&sw).await;
        c.remove_pod(&sw).await;
    });

    // 9. Pods removed leave no entries, no listeners, no host rules and no metrics series
    // behind.
    let removed = [&a, &a2, &b, &plain, &team, &late, &again, &hostnet];
    let pod_series = |metrics: &str| -> Vec<String> {
        removed
            .iter()
            .map(|p| {
                format!(
                    "egress_agent_pod_denials_total{{namespace=\"{}\",pod=\"{}\",",
                    p.spec.namespace, p.spec.name
                )
            })
            .filter(|s| metrics.contains(s.as_str()))
            .collect()
    };
    let had_series = pod_series(&agent.metrics());
    assert!(
        !had_series.is_empty(),
        "none of the pods denied since the agent's restart has a pod_denials series:\n{}",
        agent.metrics()
    );
    for pod in removed {
        rt.block_on(async {
            c.stop_pod(pod).await;
            c.remove_pod(pod).await;
        });
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = agent.cli(&["status", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap_or_default();
        let left: Vec<String> = v["kernel"]["cgroups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["path"].as_str())
            .filter(|p| p.contains(&format!("egress-test-{pid}")))
            .map(str::to_owned)
            .collect();
        let ports = listener_ports(&c);
        let rules = host_rules(&c);
        let ruled: Vec<&str> = removed
            .iter()
            .map(|p| short(p))
            .filter(|id| rules.contains(id))
            .collect();
        let series = pod_series(&agent.metrics());
        if left.is_empty() && ports.is_empty() && ruled.is_empty() && series.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "removed pods left entries {left:?}, listeners {ports:?}, host rules {ruled:?} or metrics series {series:?} (before removal: {had_series:?})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!canary.saw(&format!("AGAIN-DENIED-{pid}")));
}

/// The agent's nftables tables in the harness's namespace (rules carry the workload's short id).
fn host_rules(c: &Containerd) -> String {
    c.netns()
        .sh("nft list table bridge egress_agent; nft list table inet egress_agent")
}

/// A pod's id as its host rules' comments carry it.
fn short(pod: &Pod) -> &str {
    &pod.sandbox_id[..12]
}
