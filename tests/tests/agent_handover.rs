//! Restarts and upgrades that lose nothing (issue #23; `egress_agent::handover`). Root only: the
//! real daemon, a private dockerd, a labelled container running `egress-workload` (DNS and an
//! HTTP request through the proxy every 20 ms, a busy tunnel the proxy splices into the kernel
//! relay and a quiet one it keeps in user space, to echo servers in the dockerd namespace).
//!
//! - SIGUSR2 (the systemd unit's restart and upgrade): the running agent starts a new copy of its
//!   binary, which takes the sockets; the old one names it the main process (`MAINPID=`, on a
//!   notify socket the test reads), drains its tunnels and exits when they end.
//! - an upgrade to another build, started next to the running one (a DaemonSet roll): the same.
//!
//! Each asserts that the workload lost no DNS query, no request and no tunnel, that the echo
//! servers saw no reconnect, that no query got past the kernel's DNS redirect ([`DnsLeak`]),
//! that the old agent relayed both tunnels to their end (kernel and user space), and that a
//! container started and one removed during the hand-over are handled.
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egress_tests::docker::{Env, SERIAL, require_root};
use egress_tests::workload::{self, DnsLeak, Echo, Seen, Workload};
use nix::sys::signal::Signal;

const WAIT: Duration = Duration::from_secs(60);

fn env_new() -> Env {
    let mut env = Env::new(&[Path::new(env!("CARGO_BIN_EXE_egress-workload"))]);
    env.write_config(&env.config_text(&workload::policies()));
    let o = env.cli(&["reload"]);
    assert!(
        o.status.success(),
        "reload: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    env.agent_env.clear();
    env
}

/// A notify socket standing in for systemd: every datagram the agents send.
fn notify_socket(env: &mut Env) -> Arc<Mutex<Vec<String>>> {
    let path = env.dir.join("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("notify socket");
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let keep = got.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf) {
            keep.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    });
    env.agent_env
        .push(("NOTIFY_SOCKET".into(), path.display().to_string()));
    got
}

fn pid_of(env: &Env) -> u32 {
    env.serving_pid().expect("the agent answers status")
}

/// Whether `pid` runs (an exited child of this test that is not reaped yet does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// Run a hand-over with `how` under load and check that nothing was lost. Returns the pids
/// (old, new) and what the workload saw.
fn hand_over_under_load(env: &mut Env, how: impl FnOnce(&mut Env, u32)) -> (u32, u32, Seen) {
    let echo = Echo::start(env);
    let leak = DnsLeak::start(env);
    let w = Workload::start(env, "workload");
    assert!(env.wait_enforced("workload", 1), "{}", env.log());
    // The busy tunnel has been spliced (16 reads) and everything flows.
    let before = w
        .wait(env, WAIT, |s| {
            s.dns_ok >= 50
                && s.http_ok >= 50
                && s.tunnels.len() == 2
                && s.tunnels[0].0 >= 30
                && s.tunnels[1].0 >= 1
        })
        .unwrap_or_else(|s| panic!("workload never got going: {}\n{}", s.line(), env.log()));
    env.start_ok(
        "leaving",
        &["--label", &format!("egress.policy={}", workload::POLICY)],
        &["sleep", "600"],
    );
    assert!(env.wait_enforced("leaving", 1), "{}", env.log());
    let old = pid_of(env);
    let echo_before = echo.connections();
    let took = workload::took_over(env);
    let t0 = Instant::now();
    how(env, old);
    // One container leaves and one arrives while the agents change.
    env.d.docker_ok(&["rm", "-f", "leaving"]);
    env.start_ok(
        "arriving",
        &["--label", &format!("egress.policy={}", workload::POLICY)],
        &workload::COMMAND,
    );
    assert!(
        workload::wait_took_over(env, took),
        "no hand-over:\n{}",
        env.log()
    );
    let handed = t0.elapsed();
    let new = pid_of(env);
    assert_ne!(old, new, "the same agent still serves");
    // The old agent drains the two tunnels it relays (status and metrics show it).
    let status = env.cli(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status");
    assert_eq!(
        v["previous_agent"]["pid"].as_u64(),
        Some(u64::from(old)),
        "{v}"
    );
    assert!(alive(old), "the old agent exited with tunnels open");
    let after = w.progressed(env, &before, 150, WAIT).unwrap_or_else(|s| {
        panic!(
            "workload stalled after the hand-over: {}\n{}",
            s.line(),
            env.log()
        )
    });
    eprintln!("hand-over in {handed:?}; workload: {}", after.line());
    // Counted from `before`: a query the container sent in its first milliseconds, before the
    // agent classified it, is refused like any unclassified workload's (deny_all).
    assert_eq!(
        after.dns_lost,
        before.dns_lost,
        "DNS queries lost: {}",
        after.line()
    );
    assert_eq!(
        after.http_failed,
        before.http_failed,
        "requests failed: {}",
        after.line()
    );
    for (i, t) in after.tunnels.iter().enumerate() {
        assert!(!t.1, "tunnel {i} cut: {}\n{}", after.line(), env.log());
    }
    assert_eq!(
        echo.connections(),
        echo_before,
        "a tunnel reconnected during the hand-over"
    );
    // The arriving container is enforced by the new agent and its DNS and requests work; the
    // leaving one's sockets are gone.
    let arriving = Workload {
        name: "arriving".into(),
    };
    arriving
        .wait(env, WAIT, |s| s.dns_ok >= 20 && s.http_ok >= 20)
        .unwrap_or_else(|s| {
            panic!(
                "the container started during the hand-over: {}\n{}",
                s.line(),
                env.log()
            )
        });
    let containers = egress_tests::sh(&format!(
        "curl -s --unix-socket {} http://agent/v1/containers",
        env.api_socket().display()
    ));
    assert!(
        containers.contains("\"arriving\"") && !containers.contains("\"leaving\""),
        "{containers}"
    );
    // The tunnels end when the workload does: the old agent relayed each to its end, the busy
    // one in the kernel and the quiet one in user space, then exited.
    env.d.docker_ok(&["rm", "-f", "workload", "arriving"]);
    assert!(
        env.wait_log(|l| l.contains("drained; exiting"), WAIT),
        "the old agent did not finish draining:\n{}",
        env.log()
    );
    let log = env.log();
    let closed = |port: u16, relay: &str| {
        log.lines().any(|l| {
            l.contains("tunnel closed")
                && l.contains(&format!("tls.test:{port}"))
                && l.contains(&format!("\"relay\":\"{relay}\""))
        })
    };
    assert!(
        closed(workload::ECHO_PORTS[0], "kernel"),
        "busy tunnel not relayed in the kernel to its end:\n{log}"
    );
    assert!(
        closed(workload::ECHO_PORTS[1], "user"),
        "quiet tunnel not relayed in user space to its end:\n{log}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(old) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !alive(old),
        "the old agent is still running after its drain"
    );
    assert_eq!(pid_of(env), new);
    assert_eq!(
        leak.arrived(),
        0,
        "DNS queries got past the kernel's redirect during the hand-over"
    );
    (old, new, after)
}

#[test]
fn sigusr2_restart_loses_nothing() {
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut env = env_new();
    // Restart on the notify socket, so the hand-over's MAINPID= can be seen.
    let notes = notify_socket(&mut env);
    env.signal_agent(Signal::SIGTERM);
    if let Some(mut c) = env.agent.take() {
        c.wait().ok();
    }
    env.start_agent();
    let (_old, new, _) = hand_over_under_load(&mut env, |env, _| env.signal_agent(Signal::SIGUSR2));
    let notes = notes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        notes.iter().any(|n| n.contains(&format!("MAINPID={new}"))),
        "no MAINPID={new} on the notify socket: {notes:?}"
    );
    // The new agent's own READY=1 reached the notify socket (NotifyAccess=all in the unit).
    assert!(
        notes.iter().filter(|n| n.contains("READY=1")).count() >= 2,
        "{notes:?}"
    );
    kill(new);
}

#[test]
fn upgrade_to_another_build_started_alongside_loses_nothing() {
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut env = env_new();
    // Another build: a different file (its bytes differ), installed where the new one runs from.
    let other: PathBuf = env.dir.join("egress-agent-upgrade");
    let mut bytes = std::fs::read(env.agent_bin()).expect("agent binary");
    bytes.extend_from_slice(b"\0another build of egress-agent\0");
    std::fs::write(&other, &bytes).expect("write the other build");
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let (old, new, _) = hand_over_under_load(&mut env, |env, _| {
        env.set_agent_bin(other.clone());
        // `egress-agent run` next to the running one, as a DaemonSet roll starts the new pod.
        let first = env.agent.take();
        env.start_agent();
        // Reaped once it drained (a zombie until then counts as exited).
        if let Some(mut c) = first {
            std::thread::spawn(move || c.wait());
        }
    });
    let exe = std::fs::read_link(format!("/proc/{new}/exe")).expect("new agent's binary");
    assert_eq!(
        exe, other,
        "the new agent does not run the other build (old pid {old})"
    );
    kill(new);
}

fn kill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
        Signal::SIGTERM,
    )
    .ok();
}

/// A crash (kill -9) can't hand anything over: the sockets close with the process. What a
/// workload sees is bounded and fails closed: while no agent runs, each query and request fails
/// within its own timeout (a refusal, never a hang), nothing reaches a destination the policy
/// denies (the pinned programs keep enforcing: checked at the canary listener), and once a new
/// agent runs (on new sockets, the stale hand-over socket noticed) DNS and requests work again.
/// The tunnels are cut; the test reports them. Prints the measured gap.
#[test]
fn kill_9_gap_is_bounded_and_fails_closed() {
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut env = env_new();
    let _echo = Echo::start(&env);
    let leak = DnsLeak::start(&env);
    let w = Workload::start(&env, "workload");
    assert!(env.wait_enforced("workload", 1), "{}", env.log());
    // A neighbour under `web` keeps trying the canary (denied to it) directly and through the
    // proxy during the outage.
    env.start_ok(
        "prober",
        &["--label", "egress.policy=web"],
        &[
            "sh",
            "-c",
            "while true; do nc -w 1 198.18.0.1 9000 </dev/null; printf 'CONNECT 198.18.0.1:9000 HTTP/1.1\\r\\n\\r\\n' | nc -w 1 169.254.100.1 3128 >/dev/null; sleep 0.05; done",
        ],
    );
    assert!(env.wait_enforced("prober", 1), "{}", env.log());
    let canary_before = env.canary.count();
    let before = w
        .wait(&env, WAIT, |s| {
            s.dns_ok >= 50 && s.http_ok >= 50 && s.tunnels.len() == 2
        })
        .unwrap_or_else(|s| panic!("workload never got going: {}\n{}", s.line(), env.log()));
    let killed = Instant::now();
    env.kill_agent();
    // No agent for a while: failures pile up, each bounded by its timeout.
    let outage = w
        .wait(&env, WAIT, |s| {
            s.dns_lost >= before.dns_lost + 2 && s.http_failed >= before.http_failed + 2
        })
        .unwrap_or_else(|s| panic!("nothing failed without an agent: {}", s.line()));
    // Queries and requests go on failing, and none succeeds: with no agent, an answer could only
    // come from past the redirect (DNS) or the pinned entries (HTTP). Attempts are sequential
    // per kind, so any success after `outage` began after the kill.
    let still_down = w
        .wait(&env, WAIT, |s| {
            s.dns_lost >= outage.dns_lost + 5 && s.http_failed >= outage.http_failed + 5
        })
        .unwrap_or_else(|s| panic!("the workload stopped trying: {}", s.line()));
    assert_eq!(
        (still_down.dns_ok, still_down.http_ok),
        (outage.dns_ok, outage.http_ok),
        "a query or request succeeded while no agent ran: {}",
        still_down.line()
    );
    let restarted = Instant::now();
    env.start_agent();
    let (serving, start, down) = (killed.elapsed(), restarted.elapsed(), restarted - killed);
    let after = w
        .progressed(&env, &outage, 50, WAIT)
        .unwrap_or_else(|s| panic!("no recovery after the restart: {}\n{}", s.line(), env.log()));
    let cut = after.tunnels.iter().filter(|t| t.1).count();
    eprintln!(
        "kill -9: a new agent (started {down:?} after the kill) served {start:?} after its start, {serving:?} after the kill; longest gap dns={} ms http={} ms; lost queries={} failed requests={}; slowest failure {} ms; tunnels cut={cut} of {}",
        after.dns_gap_ms,
        after.http_gap_ms,
        after.dns_lost - before.dns_lost,
        after.http_failed - before.http_failed,
        after.slowest_failure_ms,
        after.tunnels.len(),
    );
    // Never a hang: a DNS query waits 1 s, a request 2 s for its connect and 2 s for its answer.
    assert!(
        after.slowest_failure_ms <= 4_500,
        "a failure took {} ms (a hang?)",
        after.slowest_failure_ms
    );
    assert_eq!(
        env.canary.count(),
        canary_before,
        "something reached the canary while no agent ran"
    );
    assert_eq!(
        leak.arrived(),
        0,
        "DNS queries got past the kernel's redirect while no agent ran"
    );
    // The listener does hear what is not redirected: a container the agent does not confine
    // (no label) reaches it.
    env.start_ok("unconfined", &[], &workload::COMMAND);
    let deadline = Instant::now() + WAIT;
    while leak.arrived() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        leak.arrived() > 0,
        "the DNS leak listener heard nothing from an unconfined container either"
    );
    assert!(
        env.log().contains("hand-over socket is stale"),
        "the new agent did not notice the stale hand-over socket:\n{}",
        env.log()
    );
}

/// What systemd's file-descriptor store gets from the agent, played by the test: `FDSTORE=1`
/// datagrams with their descriptor by `FDNAME`, and `FDSTOREREMOVE=1`.
type Store = Arc<Mutex<Vec<(String, std::os::fd::OwnedFd)>>>;

fn fd_store(env: &mut Env) -> Store {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let path = env.dir.join("notify-store.sock");
    let sock = UnixDatagram::bind(&path).expect("notify socket");
    let store: Store = Arc::default();
    let keep = store.clone();
    std::thread::spawn(move || {
        loop {
            let mut buf = [0u8; 4096];
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 8]);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let Ok(r) = recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) else {
                return;
            };
            let mut fds = Vec::new();
            for c in r.cmsgs().into_iter().flatten() {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: just received for this process; owned here alone.
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            let n = r.bytes;
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            let name = text
                .lines()
                .find_map(|l| l.strip_prefix("FDNAME="))
                .unwrap_or_default()
                .to_owned();
            let mut s = keep.lock().unwrap_or_else(|p| p.into_inner());
            if text.lines().any(|l| l == "FDSTOREREMOVE=1") {
                s.retain(|(k, _)| *k != name);
            } else if text.lines().any(|l| l == "FDSTORE=1") {
                s.extend(fds.into_iter().map(|f| (name.clone(), f)));
            }
        }
    });
    env.agent_env
        .push(("NOTIFY_SOCKET".into(), path.display().to_string()));
    store
}

/// A crash under systemd: the agent kept its sockets in the file-descriptor store, so while it
/// is down a request waits in its listener's backlog and is answered once systemd has restarted
/// the agent with them (`LISTEN_FDS`): no request fails, no port changes. DNS queries wait in
/// their socket's buffer; those older than the client's timeout (1 s here) when the agent is
/// back are reported. Tunnels die with the process, as in any crash.
#[test]
fn kill_9_under_systemd_keeps_the_sockets() {
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut env = env_new();
    let store = fd_store(&mut env);
    env.signal_agent(Signal::SIGTERM);
    if let Some(mut c) = env.agent.take() {
        c.wait().ok();
    }
    env.start_agent();
    let _echo = Echo::start(&env);
    let leak = DnsLeak::start(&env);
    let w = Workload::start(&env, "workload");
    assert!(env.wait_enforced("workload", 1), "{}", env.log());
    let before = w
        .wait(&env, WAIT, |s| {
            s.dns_ok >= 50 && s.http_ok >= 50 && s.tunnels.len() == 2
        })
        .unwrap_or_else(|s| panic!("workload never got going: {}\n{}", s.line(), env.log()));
    let stored: Vec<String> = store
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    assert!(
        stored.iter().any(|k| k == "api")
            && stored.iter().filter(|k| k.starts_with("workload/")).count() >= 4,
        "the agent did not store its sockets: {stored:?}"
    );
    let killed = Instant::now();
    env.kill_agent();
    // systemd's RestartSec=500ms, then the agent with the stored descriptors at 3.. .
    std::thread::sleep(Duration::from_millis(500));
    let passed: Vec<(String, i32)> = store
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(k, fd)| {
            let dup = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD(100)).expect("dup");
            (k.clone(), dup)
        })
        .collect();
    let redirects: Vec<String> = passed
        .iter()
        .enumerate()
        .map(|(i, (_, fd))| format!("{}<&{fd} {fd}<&-", i + 3))
        .collect();
    let names: Vec<&str> = passed.iter().map(|(k, _)| k.as_str()).collect();
    env.agent_prefix = vec![
        "bash".into(),
        "-c".into(),
        format!(
            "exec {}; export LISTEN_FDS={} LISTEN_FDNAMES={} LISTEN_PID=$$; exec \"$@\"",
            redirects.join(" "),
            passed.len(),
            names.join(":")
        ),
        "bash".into(),
    ];
    env.start_agent();
    for (_, fd) in &passed {
        nix::unistd::close(*fd).ok();
    }
    let serving = killed.elapsed();
    assert!(
        env.log()
            .contains("adopting the sockets the service manager kept"),
        "{}",
        env.log()
    );
    let after = w
        .progressed(&env, &before, 100, WAIT)
        .unwrap_or_else(|s| panic!("no recovery: {}\n{}", s.line(), env.log()));
    eprintln!(
        "kill -9 under systemd (fd store): serving again {serving:?} after the kill; longest gap dns={} ms http={} ms; lost queries={} failed requests={}; tunnels cut={} ({})",
        after.dns_gap_ms,
        after.http_gap_ms,
        after.dns_lost - before.dns_lost,
        after.http_failed - before.http_failed,
        after.tunnels.iter().filter(|t| t.1).count(),
        after.line()
    );
    // The one request in flight at the kill (its connection accepted by the process that died)
    // may be lost with it; every later one waits in the kept listener's backlog. Requests run
    // one after another, so two failures mean a request sent after the kill failed.
    assert!(
        after.http_failed - before.http_failed <= 1,
        "requests failed although the sockets were kept: {}",
        after.line()
    );
    assert_eq!(
        leak.arrived(),
        0,
        "DNS queries got past the kernel's redirect while no agent ran"
    );
}

/// `egress-agent restart`: the control API starts the successor (as SIGUSR2), the command
/// waits until it serves and says so.
#[test]
fn restart_command_hands_over() {
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let env = env_new();
    let old = pid_of(&env);
    let o = env.cli(&["restart"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        env.log()
    );
    let new = pid_of(&env);
    assert_ne!(new, old);
    assert!(
        out.contains(&format!("handed over: pid {old} → pid {new}")),
        "{out}"
    );
    // Nothing was open: the old agent drains at once and exits.
    assert!(
        env.wait_log(|l| l.contains("drained; exiting"), WAIT),
        "{}",
        env.log()
    );
    kill(new);
}

/// `egress-agent restart` keeps `{ env = … }` secrets (#40 item 4). The agent took the variable
/// out of its environment, so the successor it starts inherits none: it gets the secret over the
/// hand-over socket (a sealed memfd, never an environment or a file) before it resolves its
/// configuration. A labelled container requests the bound host through the proxy every 100 ms
/// across the restart: every request succeeds, and every one that reached the upstream carried
/// the real secret — none was served without it; the new agent's status names no unavailable
/// binding and its environment holds no secret either.
#[test]
fn restart_keeps_env_secrets() {
    use egress_tests::tls_upstream::{TestCa, Upstream};
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    const VAR: &str = "EGRESS_TEST_HANDOVER_SECRET";
    const SECRET: &str = "sk-env-Vb4Nw9Kc2-survives-restart";
    const PH: &str = "egress-ph-handover-0001";
    let mut env = Env::new(&[Path::new("/usr/bin/curl")]);
    let ca = TestCa::new();
    let up = Upstream::start_in(
        &ca,
        &["api.test"],
        "198.18.0.1:8443".parse().expect("address"),
        &env.d.netns.path(),
    );
    let dir = env.dir.clone();
    let d = dir.display().to_string();
    std::fs::write(dir.join("upstream-ca.pem"), &ca.pem).expect("upstream CA");
    let hosts = std::fs::read_to_string(dir.join("hosts")).expect("hosts");
    std::fs::write(dir.join("hosts"), format!("{hosts}198.18.0.1 api.test\n")).expect("hosts");
    env.write_config(&env.config_text(&format!(
        r#"[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"

[policies.agent]
allow_hosts = ["api.test"]
allow_ports = [8443]
resolve_private = ["198.18.0.1/32"]
[[policies.agent.credentials]]
host = "api.test"
port = 8443
header = "authorization"
prefix = "Bearer "
source = {{ env = "{VAR}" }}
placeholder = "{PH}"
"#
    )));
    env.kill_agent();
    env.agent_env.push((VAR.into(), SECRET.into()));
    env.start_agent();
    env.agent_env.clear();
    let environ = |pid: u32| std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let holds = |b: &[u8]| b.windows(SECRET.len()).any(|w| w == SECRET.as_bytes());
    let old = pid_of(&env);
    assert!(
        !holds(&environ(old)),
        "the secret is in the agent's environment"
    );

    let loop_script = format!(
        "i=0; while true; do i=$((i+1)); echo \"code $(curl -sS --max-time 5 -o /dev/null -w '%{{http_code}}' -H 'Authorization: Bearer {PH}' https://api.test:8443/v1/loop/$i 2>&1)\"; sleep 0.1; done"
    );
    env.start_ok(
        "looper",
        &[
            "--label",
            "egress.policy=agent",
            "-v",
            &format!("{d}/state/ca-bundle.pem:/etc/ssl/certs/ca-certificates.crt:ro"),
            "-e",
            "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
            "-e",
            "HTTPS_PROXY=http://169.254.100.1:3128",
        ],
        &["sh", "-c", &loop_script],
    );
    assert!(env.wait_enforced("looper", 1), "{}", env.log());
    let codes = |env: &Env| -> Vec<String> {
        env.d
            .docker_ok(&["logs", "looper"])
            .lines()
            .filter_map(|l| l.strip_prefix("code ").map(str::to_owned))
            .collect()
    };
    let wait_codes = |env: &Env, n: usize| {
        let deadline = Instant::now() + WAIT;
        while codes(env).iter().filter(|c| *c == "200").count() < n {
            assert!(
                Instant::now() < deadline,
                "the looper got no answers: {:?}\n{}",
                codes(env),
                env.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_codes(&env, 5);
    let before = codes(&env).len();

    let o = env.cli(&["restart"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        env.log()
    );
    let new = pid_of(&env);
    assert_ne!(new, old);
    assert!(
        env.log()
            .contains("took the running agent's env secrets over"),
        "{}",
        env.log()
    );
    assert!(
        !holds(&environ(new)),
        "the secret is in the new agent's environment"
    );
    let v: serde_json::Value =
        serde_json::from_slice(&env.cli(&["status", "--json"]).stdout).expect("status");
    assert_eq!(
        v["interception"]["unavailable_bindings"],
        serde_json::json!([]),
        "{v}"
    );
    // Requests go on through the new agent (the old one has stopped accepting).
    assert!(
        env.wait_log(|l| l.contains("drained; exiting"), WAIT),
        "{}",
        env.log()
    );
    let served = codes(&env).iter().filter(|c| *c == "200").count();
    wait_codes(&env, served + 10);
    let all = codes(&env);
    env.d.docker_ok(&["rm", "-f", "looper"]);
    assert!(all.len() > before + 10, "{all:?}");
    assert!(
        all.iter().all(|c| c == "200"),
        "requests failed across the restart: {all:?}\n{}",
        env.log()
    );
    let loops: Vec<_> = up
        .requests()
        .into_iter()
        .filter(|r| r.target.starts_with("/v1/loop/"))
        .collect();
    assert!(loops.len() >= all.len(), "{} of {}", loops.len(), all.len());
    for r in &loops {
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {SECRET}").as_str()),
            "{} reached the upstream without the secret",
            r.target
        );
    }
    assert!(!env.log().contains(SECRET), "the secret is in the log");
    eprintln!(
        "env secret across the restart: {} requests, {} after it began, every one with the secret",
        all.len(),
        all.len() - before
    );
    kill(new);
}
