//! The daemon's fail-closed branches for Docker workloads that no other test reaches (#42 item
//! 5), with the real daemon, a private dockerd and real faults. Root only.
//!
//! - A workload's proxy listener that can't bind: the agent's network namespace is left one
//!   ephemeral port, held by the test, so the listener's `bind(…, 0)` fails (EADDRINUSE). The
//!   container must stay confined (its kernel entry is written without a listener: the proxy
//!   endpoint is refused, nothing outside its policy opens), an event `listener-failed: …` says
//!   so, and a reload once ports are free again gives it its listener.
//! - A Docker inspect that fails (a socket in front of dockerd answers `500` to every container
//!   inspect): a container started meanwhile reaches nothing its policy doesn't allow, the
//!   failed watcher sessions are counted (`egress_agent_reconcile_errors_total`), a container
//!   enforced before keeps its policy, and once Docker answers again the new one is enforced
//!   whole.
use std::net::TcpListener;
use std::time::{Duration, Instant};

use egress_tests::docker::{Env, SERIAL, proxied_get, require_root};
use egress_tests::docker_fault::DockerFault;

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A direct connection to the canary from `container` (the canary counts what arrives).
const TO_CANARY: &str = "nc -w 2 198.18.0.1 9000 </dev/null; echo done";
/// `CONNECT` to the canary through the proxy endpoint.
const CONNECT_CANARY: &str = "(printf 'CONNECT 198.18.0.1:9000 HTTP/1.1\\r\\nHost: 198.18.0.1:9000\\r\\n\\r\\n'; sleep 1) | nc -w 3 169.254.100.1 3128; echo done";

/// Retry `script` in `container` until its output contains `want` (10 s); the last output.
fn until_contains(env: &Env, container: &str, script: &str, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = env.exec_out(container, script);
        if out.contains(want) || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Nothing `container` tries outside its policy reaches the canary.
fn assert_canary_untouched(env: &Env, container: &str, before: usize) {
    env.exec_out(container, TO_CANARY);
    env.exec_out(container, CONNECT_CANARY);
    assert_eq!(
        env.canary.count(),
        before,
        "{container} reached the canary:\n{}",
        env.log()
    );
}

const METRICS: &str = "127.0.0.1:18191";

/// One environment for both faults (a private dockerd costs an image build and a start): the
/// daemon on the fault socket (passing everything until told otherwise), with metrics, and a
/// container enforced before either fault.
#[test]
fn fail_closed_branches_keep_docker_workloads_confined() {
    if !require_root() {
        return;
    }
    let _l = lock();
    let mut env = Env::new(&[]);
    let fault = DockerFault::start(&env.d.socket, &env.dir.join("docker-fault.sock"));
    env.kill_agent();
    env.docker_socket = Some(fault.host());
    env.agent_args = vec!["--metrics-listen".into(), METRICS.into()];
    env.start_agent();
    env.run_labelled("steady", &["egress.policy=web"]);
    let out = env.exec_out("steady", &proxied_get("allowed.test", 8080));
    assert!(out.contains("hello-upstream"), "{out}");
    a_listener_that_cannot_bind_leaves_the_container_confined_and_says_so(&env);
    a_failed_docker_inspect_leaves_the_container_confined_and_is_counted(&env, &fault);
}

fn a_listener_that_cannot_bind_leaves_the_container_confined_and_says_so(env: &Env) {
    let canary = env.canary.count();

    // One ephemeral port left in the agent's namespace, and the test holds it.
    let held = env
        .d
        .netns
        .run(|| TcpListener::bind("0.0.0.0:0"))
        .expect("hold a port");
    let port = held.local_addr().expect("addr").port();
    let range = env.d.netns.sh("cat /proc/sys/net/ipv4/ip_local_port_range");
    let range = range.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        env.d.netns.sh_ok(&format!(
            "sysctl -w net.ipv4.ip_local_port_range='{port} {port}'"
        )),
        "cannot narrow the port range"
    );

    env.run_labelled("unbound", &["egress.policy=web"]);
    assert!(
        env.wait_refused("unbound", "listener-failed: ", Duration::from_secs(10)),
        "no listener-failed event: {:?}\n{}",
        env.events(),
        env.log()
    );
    let ev = env
        .events()
        .into_iter()
        .find(|e| {
            e["container"]["name"] == "unbound"
                && e["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("listener-failed: "))
        })
        .expect("the event");
    assert_eq!(
        (ev["policy"].as_str(), ev["source"].as_str()),
        (Some("web"), Some("agent")),
        "{ev}"
    );
    // No listener: the proxy endpoint answers nothing, and nothing else opened.
    let out = env.exec_out("unbound", &proxied_get("allowed.test", 8080));
    assert!(!out.contains("HTTP/1."), "the proxy answered: {out}");
    assert_canary_untouched(env, "unbound", canary);
    assert_canary_untouched(env, "steady", canary);

    // Ports free again: a reload binds the listener.
    assert!(
        env.d
            .netns
            .sh_ok(&format!("sysctl -w net.ipv4.ip_local_port_range='{range}'")),
        "cannot restore the port range"
    );
    drop(held);
    let o = env.cli(&["reload"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = until_contains(
        env,
        "unbound",
        &proxied_get("allowed.test", 8080),
        "hello-upstream",
    );
    assert!(out.contains("hello-upstream"), "{out}\n{}", env.log());
    let out = env.exec_out("steady", &proxied_get("allowed.test", 8080));
    assert!(out.contains("hello-upstream"), "{out}");
    assert_canary_untouched(env, "unbound", canary);
}

/// `egress_agent_reconcile_errors_total` on the daemon's metrics address.
fn reconcile_errors(env: &Env, addr: &str) -> u64 {
    let text = egress_tests::pods::metrics_get(&env.d.netns.path(), addr);
    text.lines()
        .find(|l| l.starts_with("egress_agent_reconcile_errors_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn a_failed_docker_inspect_leaves_the_container_confined_and_is_counted(
    env: &Env,
    fault: &DockerFault,
) {
    let canary = env.canary.count();
    let errors = reconcile_errors(env, METRICS);

    fault.set_failing(true);
    env.start_ok(
        "blind",
        &["--label", "egress.policy=web"],
        &["sleep", "600"],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while (fault.refused() < 2 || reconcile_errors(env, METRICS) < errors + 2)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        fault.refused() >= 2 && reconcile_errors(env, METRICS) >= errors + 2,
        "inspects refused {}, reconcile errors {} (from {errors}):\n{}",
        fault.refused(),
        reconcile_errors(env, METRICS),
        env.log()
    );
    // Docker can't say what `blind` is: nothing outside its policy opens for it, and the
    // container enforced before keeps its policy, both ways.
    assert!(env.wait_state("blind", "running", Duration::from_secs(10)));
    assert_canary_untouched(env, "blind", canary);
    let out = env.exec_out("steady", &proxied_get("allowed.test", 8080));
    assert!(out.contains("hello-upstream"), "{out}");
    assert_canary_untouched(env, "steady", canary);
    assert!(
        fault.refused() >= 2,
        "the fault went away during the checks"
    );

    // Docker answers again: the next session enforces `blind` whole.
    fault.set_failing(false);
    assert!(
        env.wait_enforced("blind", 2),
        "blind never enforced after the fault:\n{}",
        env.log()
    );
    assert!(env.wait_host_layer("blind"), "{}", env.log());
    let out = until_contains(
        env,
        "blind",
        &proxied_get("allowed.test", 8080),
        "hello-upstream",
    );
    assert!(out.contains("hello-upstream"), "{out}\n{}", env.log());
    assert_canary_untouched(env, "blind", canary);
}
