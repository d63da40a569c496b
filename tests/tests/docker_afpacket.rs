//! AF_PACKET from a container's first instruction, on a kernel where BPF-LSM can't load (so
//! nothing refuses `socket(AF_PACKET)` in an enforced container): the nftables guard drops every
//! frame entering a Docker bridge from a port the agent has not classified, so a container's
//! hand-made frames go nowhere until its `start` has been handled — fail closed, like a cgroup
//! without entry.
//!
//! Setup: the private dockerd of `egress_tests::docker` (its network namespace, bridge `egd-br0`
//! on 198.18.0.0/24), the real daemon, the probe (`egress-probe packet-loop`) in the image as
//! the containers' entrypoint. The canary is a UDP socket on the bridge's address
//! `198.18.0.1:9999` inside the dockerd namespace (reachable only through the bridge); every frame
//! carries a unique marker and a sequence number, and the canary records what *arrived*.
use std::net::UdpSocket;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_tests::docker::{BRIDGE, Env, IMAGE, NETWORK, NetNs, SERIAL, UPSTREAM_IP, require_root};

const SINK: &str = "198.18.0.1:9999";
const SENDER_IP: &str = "198.18.0.50";

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records every UDP payload that arrives on an address inside a namespace.
struct Sink {
    got: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sink {
    fn start(ns: &NetNs, addr: &str) -> Sink {
        let addr: std::net::SocketAddr = addr.parse().expect("test value");
        let s = ns.run(|| UdpSocket::bind(addr)).expect("bind udp sink");
        s.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (g, st) = (got.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !st.load(Ordering::SeqCst) {
                if let Ok(n) = s.recv(&mut buf) {
                    g.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(String::from_utf8_lossy(&buf[..n]).into_owned());
                }
            }
        });
        Sink {
            got,
            stop,
            thread: Some(thread),
        }
    }

    /// Sequence numbers of the frames that arrived carrying `marker` (payload `marker-<seq>`),
    /// after letting in-flight frames land.
    fn arrived(&self, marker: &str) -> Vec<u64> {
        std::thread::sleep(Duration::from_millis(300));
        let prefix = format!("{marker}-");
        let mut v: Vec<u64> = self
            .got
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|p| p.strip_prefix(&prefix)?.parse().ok())
            .collect();
        v.sort_unstable();
        v
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().ok();
        }
    }
}

fn out(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `sent N errors E ...` from the probe: N.
fn sent(out: &str) -> Option<u64> {
    let l = out.lines().find(|l| l.starts_with("sent "))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

fn bridge_mac(env: &Env) -> String {
    env.d
        .netns
        .sh(&format!("cat /sys/class/net/{BRIDGE}/address"))
        .trim()
        .to_owned()
}

/// The probe's arguments: frames for ~`secs` s from `src` (`own` or an IPv4) to the sink.
fn loop_args(secs: &str, br_mac: &str, src: &str, marker: &str) -> Vec<String> {
    [
        "egress-probe",
        "packet-loop",
        secs,
        "eth0",
        br_mac,
        src,
        "198.18.0.1",
        "9999",
        marker,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Start an unlabelled long-running container and wait until the agent has classified it.
fn start_classified(env: &Env, name: &str) {
    env.start_ok(name, &[], &["sleep", "600"]);
    assert!(
        wait_classified(env, name, 1),
        "{name} never classified:\n{}",
        env.log()
    );
}

/// `docker run --rm` with the probe as the container's entrypoint (its first instruction).
fn run_sender(env: &Env, extra: &[&str], args: &[String]) -> String {
    let mut a: Vec<&str> = vec!["run", "--rm", "--network", NETWORK, "--ip", SENDER_IP];
    a.extend_from_slice(extra);
    a.push(IMAGE);
    a.extend(args.iter().map(String::as_str));
    out(&env.d.docker(&a))
}

fn exec_sender(env: &Env, container: &str, args: &[String]) -> String {
    let mut a: Vec<&str> = vec!["exec", container];
    a.extend(args.iter().map(String::as_str));
    out(&env.d.docker(&a))
}

fn wait_classified(env: &Env, name: &str, n: usize) -> bool {
    let needle = format!("\"name\":\"{name}\"");
    env.wait_log(
        |l| {
            l.lines()
                .filter(|x| x.contains("host ports classified") && x.contains(&needle))
                .count()
                >= n
        },
        Duration::from_secs(20),
    )
}

#[test]
fn afpacket_frames_from_the_first_instruction_never_arrive() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = Env::new(&[Path::new(env!("CARGO_BIN_EXE_egress-probe"))]);
    let sink = Sink::start(&env.d.netns, SINK);
    let br_mac = bridge_mac(&env);
    let lsm = !env.log().contains("BPF-LSM socket hook unavailable");
    let ruleset = env.d.netns.sh("nft list table inet egress_agent");
    assert!(
        ruleset.contains(&format!("iifname \"{BRIDGE}\" meta mark & 0x10000000")),
        "the Docker bridge is not guarded:\n{ruleset}"
    );

    // Opted-in containers whose entrypoint sends from its first instruction: nothing arrives,
    // neither with its own address nor spoofing the upstream container's, over several starts.
    let cases: [(&str, &str); 6] = [
        ("egress.policy=deny_all", "own"),
        ("egress.policy=web", "own"),
        ("egress.policy=deny_all", UPSTREAM_IP),
        ("egress.policy=web", UPSTREAM_IP),
        ("egress.allow_hosts=allowed.test", "own"),
        ("egress.policy=canary", UPSTREAM_IP),
    ];
    for (i, (label, src)) in cases.iter().enumerate() {
        let marker = egress_tests::marker(&format!("optin{i}"));
        let o = run_sender(
            &env,
            &["--label", label],
            &loop_args("1", &br_mac, src, &marker),
        );
        let n = sent(&o).unwrap_or_else(|| panic!("{label}: the probe did not run: {o}"));
        assert!(
            n > 0 || lsm,
            "{label}: no frame could be sent (expected AF_PACKET to be open here): {o}"
        );
        let got = sink.arrived(&marker);

        assert!(
            got.is_empty(),
            "{label} src {src}: AF_PACKET frames from the first instruction arrived: {} of {n} (seq {:?}..) ({o})",
            got.len(),
            got.first()
        );
        eprintln!("{label} src {src}: {n} frames sent, none arrived");
    }

    // Policy `canary` allows UDP to the sink's address (allow_cidrs 198.18.0.1/32): once its
    // rules are written, its own-address frames are allowed and arrive — but not the ones sent
    // before (the guard), although the policy would have allowed them.
    let marker = egress_tests::marker("canary");
    let o = run_sender(
        &env,
        &["--label", "egress.policy=canary"],
        &loop_args("1", &br_mac, "own", &marker),
    );
    let got = sink.arrived(&marker);
    assert!(
        !got.is_empty(),
        "canary policy: allowed frames must arrive after start: {o}"
    );
    assert!(
        got[0] > 0,
        "canary policy: the first frame arrived before the agent handled the container"
    );
    eprintln!("canary policy: first arrived seq {}", got[0]);

    // Control, same sender unlabelled: once the agent has classified its port, frames arrive —
    // and the first ones (before that) did not: unlabelled containers are dropped until then too.
    let marker = egress_tests::marker("control");
    let o = run_sender(&env, &[], &loop_args("1.5", &br_mac, "own", &marker));
    let got = sink.arrived(&marker);
    let n = sent(&o).unwrap_or(0);
    assert!(
        !got.is_empty(),
        "control: frames from a classified unlabelled container must arrive ({n} sent): {o}"
    );
    assert!(
        got[0] > 0,
        "control: the first frame arrived: its port was not guarded before the agent classified it"
    );
    eprintln!(
        "control: {n} sent, {} arrived, first arrived seq {} (seq = loop iteration)",
        got.len(),
        got[0]
    );

    // An unlabelled container works normally after start: a direct TCP connection right away
    // (its first ARP may be dropped; the kernel retries) arrives at the TCP canary.
    let before = env.canary.count();
    let o = env.run_out(
        &[],
        "nc -w 5 198.18.0.1 9000 </dev/null && echo DIRECT-OK || echo DIRECT-FAIL",
    );
    assert!(o.contains("DIRECT-OK"), "unlabelled direct connection: {o}");
    assert!(env.canary.count() > before, "unlabelled: nothing arrived");

    // A classified, running unlabelled container: every frame arrives, from the first one.
    start_classified(&env, "plain");
    let marker = egress_tests::marker("plain");
    let o = exec_sender(&env, "plain", &loop_args("0.2", &br_mac, "own", &marker));
    let got = sink.arrived(&marker);
    let n = sent(&o).unwrap_or(u64::MAX);
    assert!(
        n > 0 && got.first() == Some(&0) && got.len() as u64 * 10 >= n * 9,
        "plain (classified): {} of {n} frames arrived (first {:?}): {o}",
        got.len(),
        got.first()
    );
}

#[test]
fn agent_down_fails_closed_and_restart_reclassifies() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let mut env = Env::new(&[Path::new(env!("CARGO_BIN_EXE_egress-probe"))]);
    let sink = Sink::start(&env.d.netns, SINK);
    let br_mac = bridge_mac(&env);
    start_classified(&env, "plain");
    let all_arrive = |env: &Env, name: &str, what: &str| {
        let marker = egress_tests::marker(what);
        let o = exec_sender(env, name, &loop_args("0.2", &br_mac, "own", &marker));
        let got = sink.arrived(&marker);
        let n = sent(&o).unwrap_or(u64::MAX);
        // From the first frame on (a dropped start would show as a missing seq 0); the count
        // leaves room for a UDP receive buffer overflow.
        assert!(
            n > 0 && got.first() == Some(&0) && got.len() as u64 * 10 >= n * 9,
            "{what}: {} of {n} frames arrived (first {:?}): {o}",
            got.len(),
            got.first()
        );
    };
    all_arrive(&env, "plain", "before-kill");

    // Agent down: the tables stay; a classified container keeps its network, the upstream web
    // server too, ...
    env.kill_agent();
    all_arrive(&env, "plain", "agent-down");
    let web = env.d.netns.sh_ok(&format!(
        "wget -q -T 5 -O- http://{UPSTREAM_IP}:8080/ | grep -q hello-upstream"
    ));
    assert!(
        web,
        "the upstream container lost its network while the agent was down"
    );
    // ... and a container started meanwhile has none (fail closed), labelled or not.
    env.start_ok("late", &[], &["sleep", "600"]);
    let marker = egress_tests::marker("late-down");
    let o = exec_sender(&env, "late", &loop_args("0.3", &br_mac, "own", &marker));
    assert!(
        sent(&o).is_some_and(|n| n > 0),
        "late: probe did not send: {o}"
    );
    assert!(
        sink.arrived(&marker).is_empty(),
        "a container started while the agent was down sent frames: {o}"
    );
    let marker = egress_tests::marker("optin-down");
    let o = run_sender(
        &env,
        &["--label", "egress.policy=deny_all"],
        &loop_args("0.5", &br_mac, "own", &marker),
    );
    assert!(
        sink.arrived(&marker).is_empty(),
        "an opted-in container started while the agent was down sent frames: {o}"
    );

    // Restart: the reconcile classifies `late`; `plain` never lost anything.
    env.start_agent();
    assert!(
        wait_classified(&env, "late", 1),
        "late not classified after restart:\n{}",
        env.log()
    );
    all_arrive(&env, "late", "late-after-restart");
    all_arrive(&env, "plain", "plain-after-restart");

    // A new network (custom bridge name) is guarded from its creation, and no longer once removed.
    env.d.docker_ok(&["rm", "-f", "late"]);
    env.d.docker_ok(&[
        "network",
        "create",
        "--driver",
        "bridge",
        "--subnet",
        "198.19.7.0/24",
        "-o",
        "com.docker.network.bridge.name=egt-afp-br",
        "egt-afp",
    ]);
    let guarded = |env: &Env| {
        env.d
            .netns
            .sh("nft list table inet egress_agent")
            .contains("iifname \"egt-afp-br\" meta mark")
    };
    assert!(
        env.wait_log(|_| guarded(&env), Duration::from_secs(10)),
        "new network's bridge not guarded:\n{}",
        env.log()
    );
    env.d.docker_ok(&["network", "rm", "egt-afp"]);
    assert!(
        env.wait_log(|_| !guarded(&env), Duration::from_secs(10)),
        "removed network still guarded"
    );
}

#[test]
fn non_docker_bridges_are_untouched() {
    if !require_root() {
        return;
    }
    let _g = lock();
    let env = Env::new(&[Path::new(env!("CARGO_BIN_EXE_egress-probe"))]);
    // A bridge of somebody else's in the same namespace, with a veth port to a namespace of its
    // own: the agent never learns it, so its frames pass (raw ones included).
    let pid = std::process::id() % 100_000;
    let other = NetNs::new(&format!("egt-afp-o-{pid}"));
    let (br, a, b) = (
        format!("egtob{pid}"),
        format!("egtoa{pid}"),
        format!("egtoc{pid}"),
    );
    env.d.netns.sh(&format!(
        "ip link add {br} type bridge && ip addr add 192.0.2.1/24 dev {br} && ip link set {br} up && \
         ip link add {a} type veth peer name {b} && ip link set {a} master {br} && ip link set {a} up && \
         ip link set {b} netns {}",
        other.name
    ));
    other.sh(&format!(
        "ip addr add 192.0.2.2/24 dev {b} && ip link set {b} up"
    ));
    let sink = Sink::start(&env.d.netns, "192.0.2.1:9998");
    let mac = env
        .d
        .netns
        .sh(&format!("cat /sys/class/net/{br}/address"))
        .trim()
        .to_owned();
    let probe = env!("CARGO_BIN_EXE_egress-probe");
    let marker = egress_tests::marker("other");
    let o = other.sh(&format!(
        "{probe} packet-loop 0.2 {b} {mac} own 192.0.2.1 9998 {marker}"
    ));
    let got = sink.arrived(&marker);
    let n = sent(&o).unwrap_or(u64::MAX);
    assert!(
        n > 0 && got.first() == Some(&0) && got.len() as u64 * 10 >= n * 9,
        "non-Docker bridge: {} of {n} frames arrived (first {:?}): {o}",
        got.len(),
        got.first()
    );
    let ruleset = env.d.netns.sh("nft list ruleset");
    assert!(!ruleset.contains(&br) && !ruleset.contains(&a), "{ruleset}");
}
