//! What confinement must still allow: the proxy endpoint (rewritten to the policy's own
//! listener), `allow_cidrs` destinations, servers inside the cgroup answering outside clients,
//! and everything in cgroups that are not enforced. Plus listener isolation between policies
//! (docs/threat-model.md item 9): a confined process cannot reach another policy's listener
//! directly.
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use egress_tests::agent::{
    StopOnDrop, TestConfig, cgroup2_mount, exec_cmd, probe_bin, probe_exec, probe_outside,
    status_json,
};
use egress_tests::canary::Canary;
use egress_tests::netns::Netns;
use egress_tests::{marker, root_or_skip, sh_quiet};

const ALLOWED: u16 = 7300;
const OTHER: u16 = 7301;

fn allowlist_config() -> TestConfig {
    TestConfig::new(&format!(
        "[policies.pos-allow]\nmode = \"allowlist\"\nallow_hosts = [\"example.com\"]\nallow_ports = [443]\n\
         allow_cidrs = [{{ cidr = \"198.19.0.0/16\", ports = [{ALLOWED}] }}, {{ cidr = \"2001:db8:19::/48\", ports = [{ALLOWED}] }}]\n\n\
         [policies.pos-other]\nmode = \"allowlist\"\nallow_hosts = [\"example.org\"]\n"
    ))
}

#[test]
fn allow_cidrs_destination_is_reachable() {
    if !root_or_skip("kernel positive: allow_cidrs") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[ALLOWED], &[ALLOWED]);
    let cfg = allowlist_config();
    let (alt4, alt6, port) = (
        ns.ns_v4_alt.to_string(),
        ns.ns_v6_alt.to_string(),
        ALLOWED.to_string(),
    );
    for (name, args) in [
        ("tcp-v4", vec!["tcp", alt4.as_str(), &port]),
        ("tcp-v6", vec!["tcp", alt6.as_str(), &port]),
        ("tcp-v4-mapped", vec!["tcp-mapped", alt4.as_str(), &port]),
        ("udp-v4", vec!["udp", alt4.as_str(), &port]),
        ("udp-v6", vec!["udp", alt6.as_str(), &port]),
        ("udp-connected", vec!["udp-connected", alt4.as_str(), &port]),
        ("udp-v4-mapped", vec!["udp-mapped", alt4.as_str(), &port]),
    ] {
        let m = marker(name);
        let mut a = args.clone();
        a.push(&m);
        let out = probe_exec("pos-allow", Some(&cfg.path), &a);
        assert!(out.ok, "{name}: allowed destination refused: {out:?}");
        assert!(
            canary.wait_for(&m, Duration::from_secs(3)),
            "{name}: allowed traffic did not arrive"
        );
        eprintln!("[pos-allow] {name:<14} to allow_cidrs destination: arrived");
    }
}

/// A CONNECT from `pos-allow` to the endpoint `ip:port` tunnels to `target` (the bytes arrive).
/// Nothing listens on an endpoint port: only the kernel's rewrite to the policy's in-process
/// listener can make it succeed.
fn tunnels_via(cfg: &TestConfig, canary: &Canary, ip: &str, port: &str, target: &str) {
    let m = marker(&format!("via-{ip}"));
    let out = probe_exec(
        "pos-allow",
        Some(&cfg.path),
        &["http-connect", ip, port, target, &m],
    );
    assert!(out.ok, "CONNECT through the endpoint {ip} failed: {out:?}");
    assert!(
        canary.wait_for(&m, Duration::from_secs(3)),
        "tunnelled bytes (endpoint {ip}) did not arrive"
    );
}

#[test]
fn proxy_endpoint_is_rewritten_to_the_policy_listener() {
    if !root_or_skip("kernel positive: proxy endpoint") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[ALLOWED], &[]);
    let cfg = allowlist_config();
    let target = format!("{}:{ALLOWED}", ns.ns_v4_alt);
    let ep = cfg.endpoint_port.to_string();
    tunnels_via(&cfg, &canary, "127.0.0.1", &ep, &target);
    // The same endpoint from an IPv6 socket (v4-mapped): connect6 rewrites it the same way.
    tunnels_via(&cfg, &canary, "::ffff:127.0.0.1", &ep, &target);
    // Outside the cgroup the endpoint is just a closed port (no rewrite).
    let outside = probe_outside(&[
        "http-connect",
        "127.0.0.1",
        &ep,
        &target,
        &marker("ep-outside"),
    ]);
    assert!(
        !outside.ok,
        "endpoint port answered outside the cgroup: {outside:?}"
    );
    // The proxy itself still refuses what the policy does not allow (IP literal not in allow_cidrs).
    let denied = probe_exec(
        "pos-allow",
        Some(&cfg.path),
        &[
            "http-connect",
            "127.0.0.1",
            &ep,
            &format!("{}:{OTHER}", ns.ns_v4),
            &marker("deny"),
        ],
    );
    assert!(
        !denied.ok,
        "proxy tunnelled to a destination the policy does not allow: {denied:?}"
    );
}

#[test]
fn ipv6_proxy_endpoint_is_rewritten_to_the_policy_v6_listener() {
    if !root_or_skip("kernel positive: IPv6 proxy endpoint") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[ALLOWED], &[]);
    // A port nothing listens on, as for the v4 endpoint.
    let ep6 = std::net::TcpListener::bind("[::1]:0")
        .and_then(|l| l.local_addr())
        .expect("IPv6 loopback")
        .port();
    let cfg = TestConfig::new(&format!(
        "endpoint_v6 = \"[::1]:{ep6}\"\n\n\
         [policies.pos-allow]\nmode = \"allowlist\"\nallow_hosts = [\"example.com\"]\n\
         allow_cidrs = [{{ cidr = \"198.19.0.0/16\", ports = [{ALLOWED}] }}]\n"
    ));
    let ep6 = ep6.to_string();
    let target = format!("{}:{ALLOWED}", ns.ns_v4_alt);
    tunnels_via(&cfg, &canary, "::1", &ep6, &target);
    let outside = probe_outside(&["http-connect", "::1", &ep6, &target, &marker("ep6-outside")]);
    assert!(
        !outside.ok,
        "IPv6 endpoint port answered outside the cgroup: {outside:?}"
    );
}

/// Wait until the running exec `pid` has written its entry; returns (cgroup path, listeners).
fn wait_entry(pid: u32) -> (String, Vec<String>) {
    let owner = format!("exec:{pid}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let st = status_json();
        if let Some(c) = st["cgroups"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["owner"] == owner.as_str()))
        {
            let path = c["path"].as_str().unwrap_or("").to_owned();
            let listeners = c["listener"]
                .as_array()
                .map(|l| {
                    l.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            return (path, listeners);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no policy entry for {owner} appeared in status");
}

fn kill_wait(mut child: Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .ok();
    child.wait().ok();
}

#[test]
fn other_policys_listener_is_unreachable() {
    if !root_or_skip("kernel positive: listener isolation") {
        return;
    }
    let cfg = allowlist_config();
    let a = exec_cmd("pos-other", Some(&cfg.path))
        .arg("sleep")
        .arg("20")
        .stdout(Stdio::null())
        .spawn()
        .expect("exec A");
    let (_, listeners) = wait_entry(a.id());
    let listener: SocketAddr = listeners
        .first()
        .expect("A has a listener")
        .parse()
        .expect("addr");
    let port = listener.port().to_string();
    let b = probe_exec(
        "pos-allow",
        Some(&cfg.path),
        &["tcp", &listener.ip().to_string(), &port, &marker("steal")],
    );
    let outside = probe_outside(&["tcp", &listener.ip().to_string(), &port, &marker("outside")]);
    kill_wait(a);
    assert!(
        !b.ok,
        "policy pos-allow reached pos-other's listener {listener} directly: {b:?}"
    );
    assert!(b.stdout.contains("err 1 "), "expected EPERM, got {b:?}");
    assert!(
        outside.ok,
        "the listener should be reachable from outside the cgroups: {outside:?}"
    );
}

/// Start `probe serve` confined; returns the child once it listens.
fn serve_confined(policy: &str, config: &TestConfig, port: u16, m: &str) -> StopOnDrop {
    let mut child = exec_cmd(policy, Some(&config.path))
        .arg(probe_bin())
        .args(["serve", &port.to_string(), m])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("exec serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "listening", "server did not start");
    // Keep the pipe drained in the background.
    std::thread::spawn(move || for _ in lines {});
    StopOnDrop(child)
}

fn read_reply(mut s: TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok();
    buf
}

#[test]
fn server_in_cgroup_answers_allowed_inbound_clients() {
    if !root_or_skip("kernel positive: inbound server") {
        return;
    }
    let ns = Netns::new();
    // Inbound connections are policy: the clients below are the allowed peers of this deny_all
    // policy (exec_inbound.rs checks that everyone else is refused).
    // The namespace's networks (its clients may pick either of its addresses as source).
    let [a, b, c, _] = ns.ns_v4.octets();
    let s6 = ns.ns_v6.segments();
    let cfg = TestConfig::new(&format!(
        "[policies.served]\nmode = \"deny_all\"\nallow_inbound = [\"127.0.0.1/32\", \"{a}.{b}.{c}.0/24\", \"{:x}:{:x}:{:x}:{:x}::/64\"]\n",
        s6[0], s6[1], s6[2], s6[3]
    ));
    // A client in the host namespace (outside any enforced cgroup) over loopback.
    let port = 7310;
    let m = marker("reply-lo");
    let mut server = serve_confined("served", &cfg, port, &m);
    let reply =
        read_reply(TcpStream::connect(("127.0.0.1", port)).expect("connect to confined server"));
    assert!(
        reply.contains(&m),
        "no reply from the confined server over loopback: {reply:?}"
    );
    assert!(server.0.wait().expect("wait").success());

    // A client in another namespace (like a published port), over the veth, v4 and v6.
    for (i, host) in [ns.host_v4.to_string(), format!("[{}]", ns.host_v6)]
        .into_iter()
        .enumerate()
    {
        let port = 7311 + i as u16;
        let m = marker("reply-ns");
        let mut server = serve_confined("served", &cfg, port, &m);
        let addr: SocketAddr = format!("{host}:{port}").parse().expect("addr");
        let reply = ns.run(move || {
            read_reply(
                TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                    .expect("connect from netns"),
            )
        });
        assert!(
            reply.contains(&m),
            "no reply from the confined server to {addr}: {reply:?}"
        );
        assert!(server.0.wait().expect("wait").success());
    }
}

#[test]
fn other_cgroups_are_untouched() {
    if !root_or_skip("kernel positive: other cgroups") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[OTHER], &[OTHER]);
    // An enforced command runs meanwhile.
    let running = exec_cmd("deny_all", None)
        .arg("sleep")
        .arg("20")
        .stdout(Stdio::null())
        .spawn()
        .expect("exec");
    let _ = wait_entry(running.id());
    // A sibling cgroup outside the enforcement root.
    let sibling = cgroup2_mount().join(format!("egress-tests-{}", std::process::id()));
    std::fs::create_dir_all(&sibling).expect("sibling cgroup");
    let (v4, port) = (ns.ns_v4.to_string(), OTHER.to_string());
    let mut results = Vec::new();
    for (name, args) in [
        ("tcp", vec!["tcp", v4.as_str(), &port]),
        ("udp", vec!["udp", v4.as_str(), &port]),
    ] {
        // Same cgroup as the test.
        let m = marker(name);
        let mut a = args.clone();
        a.push(&m);
        let out = probe_outside(&a);
        results.push((
            format!("{name} from the test's cgroup"),
            out.ok && canary.wait_for(&m, Duration::from_secs(3)),
        ));
        // Sibling cgroup.
        let m = marker(name);
        let script = format!(
            "echo $$ > {}/cgroup.procs && exec {} {} {m}",
            sibling.display(),
            probe_bin().display(),
            args.join(" ")
        );
        let ok = std::process::Command::new("sh")
            .args(["-c", &script])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        results.push((
            format!("{name} from a sibling cgroup"),
            ok && canary.wait_for(&m, Duration::from_secs(3)),
        ));
    }
    kill_wait(running);
    sh_quiet(&format!("rmdir {}", sibling.display()));
    for (what, ok) in &results {
        assert!(ok, "{what}: blocked although not enforced");
        eprintln!("untouched: {what}: arrived");
    }
}

#[test]
fn own_netns_loopback_works_but_not_dockers_resolver() {
    if !root_or_skip("kernel positive: own-netns loopback") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[7320], &[53, 7320]);
    let probe = probe_bin().display().to_string();
    // A confined process that entered its own network namespace (like a container). Entering a
    // namespace needs CAP_SYS_ADMIN, which an `exec` command doesn't have (exec_self_defence.rs):
    // so a shell of the test joins the cgroup of a running `exec --policy deny_all` command — the
    // kernel programs and its entry apply to it — and enters the namespace itself.
    let mut holder = exec_cmd("deny_all", None)
        .args(["sleep", "60"])
        .stdin(Stdio::null())
        .spawn()
        .expect("exec sleep");
    let prefix = format!("exec-{}-", holder.id());
    let deadline = Instant::now() + Duration::from_secs(10);
    let confined = loop {
        let found = std::fs::read_dir(egress_tests::agent::exec_root())
            .expect("exec root")
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path());
        match found {
            Some(p)
                if std::fs::read_to_string(p.join("cgroup.procs"))
                    .is_ok_and(|s| !s.trim().is_empty()) =>
            {
                break p;
            }
            _ if Instant::now() > deadline => panic!("no cgroup for the holder exec"),
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let in_ns = |policy: Option<&str>, args: &[&str]| {
        let run = format!("exec ip netns exec {} {probe} {}", ns.name, args.join(" "));
        let script = match policy {
            Some(_) => format!("echo $$ > {}/cgroup.procs && {run}", confined.display()),
            None => run,
        };
        let out = std::process::Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .output()
            .expect("run");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for (name, args) in [
        ("tcp", ["tcp", "127.0.0.1", "7320"]),
        ("udp", ["udp", "127.0.0.1", "7320"]),
    ] {
        let m = marker(name);
        let out = in_ns(Some("deny_all"), &[args[0], args[1], args[2], &m]);
        assert!(
            canary.wait_for(&m, Duration::from_secs(3)),
            "own-netns loopback {name} blocked under deny_all: {out}"
        );
        eprintln!("own-netns loopback {name} under deny_all: arrived");
    }
    // 127.0.0.11 is Docker's embedded resolver (forwards to the host's resolvers): not "own".
    for (name, args) in [
        ("dns-udp", ["udp", "127.0.0.11", "53"]),
        ("dns-tcp", ["tcp", "127.0.0.11", "7320"]),
    ] {
        let m_out = marker(name);
        in_ns(None, &[args[0], args[1], args[2], &m_out]);
        assert!(
            canary.wait_for(&m_out, Duration::from_secs(3)),
            "{name}: canary did not see the unconfined attempt"
        );
        let m = marker(name);
        let out = in_ns(Some("deny_all"), &[args[0], args[1], args[2], &m]);
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            !canary.saw(&m),
            "{name}: reached 127.0.0.11 from a confined process: {out}"
        );
        assert!(out.contains("err 1 "), "{name}: expected EPERM, got {out}");
        eprintln!("127.0.0.11 {name} under deny_all: refused, nothing arrived");
    }
    // SIGTERM: exec forwards it and removes the cgroup and entry.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(holder.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .ok();
    holder.wait().ok();
}

#[test]
fn allow_all_policy_allows_direct_egress() {
    if !root_or_skip("kernel positive: allow_all") {
        return;
    }
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[OTHER], &[OTHER]);
    let (v4, v6, port) = (
        ns.ns_v4.to_string(),
        ns.ns_v6.to_string(),
        OTHER.to_string(),
    );
    for (name, args) in [
        ("tcp-v4", vec!["tcp", v4.as_str(), &port]),
        ("tcp-v6", vec!["tcp", v6.as_str(), &port]),
        ("udp-v4", vec!["udp", v4.as_str(), &port]),
        ("raw-icmp", vec!["icmp-raw", v4.as_str()]),
    ] {
        let m = marker(name);
        let mut a = args.clone();
        a.push(&m);
        let out = probe_exec("allow_all", None, &a);
        assert!(out.ok, "{name} refused under allow_all: {out:?}");
        assert!(
            canary.wait_for(&m, Duration::from_secs(3)),
            "{name} did not arrive under allow_all"
        );
    }
}
