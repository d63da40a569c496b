//! Listener admission (issue #40 item 1): a workload's listeners serve only connections the
//! kernel sent them from that workload.
//!
//! An `exec` command runs under a policy that binds a real secret for `api.test` (a TLS upstream
//! of the test's, with its own CA, on loopback). While it runs, every TCP listener of the `exec`
//! process (explicit, transparent, DNS over TCP, found from outside like `ss` would) is tried
//! by processes that are not that workload — the test process (root, unconfined), the same
//! client as `nobody`, an `allow_all` workload (whose connect() the kernel lets through but does
//! not record) and a workload of another policy — each with a CONNECT head, an absolute-form
//! request carrying the placeholder, a DNS query over TCP and a TLS handshake followed by a
//! request with the placeholder. None of them gets a byte back, nothing arrives at the upstream
//! (so no secret was injected for them), and the refusals are recorded as
//! `listener-foreign-peer` events. Then the workload's own requests (explicit and transparent)
//! still get the secret injected: admission changes nothing for it.
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_tests::agent::{ReadyOutput, TestConfig, agent_bin, exec_cmd};
use egress_tests::foreign::{FOREIGN_PY, got_nothing};
use egress_tests::root_or_skip;
use egress_tests::tls_upstream::{TestCa, Upstream};
use egress_tests::upstreams::TempDir;

const SECRET: &str = "sk-admission-Tq3Lw8Zr5Vn1-never-sent";
const PH: &str = "egress-ph-admission-0ddba11";

fn setup(up: &Upstream, ca: &TestCa) -> (TempDir, TestConfig) {
    let owned = TempDir::new("admission");
    let dir = owned.0.clone();
    let secrets = dir.join("secrets");
    std::fs::create_dir_all(&secrets).expect("dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let secret = secrets.join("api");
    std::fs::write(&secret, SECRET).expect("secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::write(dir.join("hosts"), "127.0.0.1 api.test\n").expect("hosts");
    std::fs::write(dir.join("upstream-ca.pem"), &ca.pem).expect("upstream CA");
    std::fs::write(dir.join("foreign.py"), FOREIGN_PY).expect("foreign.py");
    for f in ["hosts", "upstream-ca.pem", "foreign.py"] {
        std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o644)).ok();
    }
    let p = up.port();
    let d = dir.display();
    let cfg = TestConfig::new(&format!(
        r#"connect_timeout_ms = 3000
[agent]
state_dir = "{d}/state"
[intercept]
upstream_ca_file = "{d}/upstream-ca.pem"
[dns]
nameservers = []
hosts_file = "{d}/hosts"

[policies.agent]
allow_hosts = ["api.test"]
allow_ports = [{p}]
resolve_private = ["127.0.0.0/8"]
[[policies.agent.credentials]]
host = "api.test"
port = {p}
header = "authorization"
prefix = "Bearer "
source = {{ file = "{d}/secrets/api" }}
placeholder = "{PH}"
placeholder_env = "API_KEY"
require = true

[policies.other]
allow_hosts = ["api.test"]
allow_ports = [{p}]
resolve_private = ["127.0.0.0/8"]

[policies.open]
mode = "allow_all"
"#
    ));
    (owned, cfg)
}

/// The listening TCP sockets of process `pid`, from its fds and `/proc/<pid>/net/tcp{,6}`.
fn listeners_of(pid: u32) -> Vec<SocketAddr> {
    let mut inodes = std::collections::HashSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .flatten()
    {
        let link = std::fs::read_link(fd.path()).unwrap_or_default();
        let link = link.to_string_lossy();
        if let Some(n) = link
            .strip_prefix("socket:[")
            .and_then(|r| r.strip_suffix(']'))
        {
            inodes.insert(n.to_owned());
        }
    }
    let mut out = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address, st (0A = LISTEN), inode.
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            let (addr, port) = f[1].split_once(':').expect("addr:port");
            let port = u16::from_str_radix(port, 16).expect("port");
            let word = |i: usize| u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16).expect("hex");
            let ip = if v6 {
                let mut b = [0u8; 16];
                for i in 0..4 {
                    b[i * 4..i * 4 + 4].copy_from_slice(&word(i).to_le_bytes());
                }
                IpAddr::V6(Ipv6Addr::from(b))
            } else {
                IpAddr::V4(Ipv4Addr::from(word(0).to_le_bytes()))
            };
            out.push(SocketAddr::new(ip, port));
        }
    }
    out
}

/// Run the foreign client against `listener` with `prefix` (a user switch or an `exec`), and
/// return what it printed.
fn foreign(prefix: &mut Command, dir: &Path, listener: SocketAddr, api_port: u16) -> String {
    let out = prefix
        // Debian's, not a per-user shim (`nobody` can't run root's pyenv).
        .arg("/usr/bin/python3")
        .arg(dir.join("foreign.py"))
        .arg(listener.ip().to_string())
        .arg(listener.port().to_string())
        .arg(api_port.to_string())
        .arg(PH)
        .stdin(Stdio::null())
        .output()
        .expect("run the foreign client");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.lines().count() == 4,
        "the foreign client did not run through ({listener}): {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn host_processes_and_other_workloads_get_nothing_through_a_workloads_listeners() {
    if !root_or_skip("listener admission") {
        return;
    }
    let ca = TestCa::new();
    let up = Upstream::start(&ca, &["api.test"], "127.0.0.1:0".parse().expect("addr"));
    let (dir, cfg) = setup(&up, &ca);
    let p = up.port();
    // The workload: waits at READY while the others try, then makes its own requests.
    let script = format!(
        "echo READY; read go; \
         curl -sS --max-time 15 -H \"Authorization: Bearer $API_KEY\" https://api.test:{p}/v1/own; echo; \
         curl -sS --max-time 15 --noproxy '*' -H \"Authorization: Bearer $API_KEY\" https://api.test:{p}/v1/own-t; echo"
    );
    let mut child = exec_cmd("agent", Some(&cfg.path))
        .args(["sh", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn exec");
    let exec_pid = child.id();
    let output = ReadyOutput::read(&mut child, Duration::from_secs(60));
    assert!(
        output.ready,
        "the workload never got to READY: {}",
        String::from_utf8_lossy(&output.printed)
    );
    let listeners = listeners_of(exec_pid);
    // Explicit, transparent and DNS over TCP, at least.
    assert!(
        listeners.len() >= 3,
        "expected the workload's explicit, transparent and DNS listeners: {listeners:?}"
    );
    for &l in &listeners {
        // Unconfined, as root (this process) and as nobody.
        let printed = foreign(&mut Command::new("env"), &dir.0, l, p);
        got_nothing("a host process (root)", l, &printed);
        // Not refused at connect(): the listener accepted, then closed without a byte.
        assert!(
            printed.lines().all(|line| line.ends_with("=0")),
            "a host process should reach {l} and get it closed unread: {printed}"
        );
        let printed = foreign(
            Command::new("setpriv").args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "--",
            ]),
            &dir.0,
            l,
            p,
        );
        got_nothing("a host process (nobody)", l, &printed);
        // Workloads: allow_all (its connect() passes the hook, unrecorded) and another policy
        // (its connect hook sends it only to its own listeners).
        for policy in ["open", "other"] {
            let printed = foreign(&mut exec_cmd(policy, Some(&cfg.path)), &dir.0, l, p);
            got_nothing(&format!("an exec workload of policy {policy}"), l, &printed);
        }
    }
    assert!(
        up.requests().is_empty(),
        "something reached the upstream for a foreign peer: {:?}",
        up.requests().iter().map(|r| r.text()).collect::<Vec<_>>()
    );
    // The workload's own traffic is unchanged: the secret is injected on both paths.
    child.stdin.take().expect("stdin").write_all(b"go\n").ok();
    let (printed, err) = output.finish();
    let status = child.wait().expect("wait exec");
    let rest = String::from_utf8_lossy(&printed).into_owned();
    let err = String::from_utf8_lossy(&err).into_owned();
    assert!(status.success(), "exec failed: {rest}\n{err}");
    for path in ["/v1/own", "/v1/own-t"] {
        let r = up
            .request(path)
            .unwrap_or_else(|| panic!("{path} never arrived: {rest}\n{err}"));
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {SECRET}").as_str()),
            "{r:?}"
        );
    }
    assert_eq!(up.requests().len(), 2, "only the workload's own requests");
    // The refusals are on record: the store of this exec run holds listener-foreign-peer events
    // naming each peer.
    let events = Command::new(agent_bin())
        .args([
            "events", "--json", "-n", "1000", "--policy", "agent", "--config",
        ])
        .arg(&cfg.path)
        .output()
        .expect("events");
    let text = String::from_utf8_lossy(&events.stdout);
    let foreign_events = text
        .lines()
        .filter(|l| l.contains("\"listener-foreign-peer\""))
        .count();
    assert!(
        foreign_events >= listeners.len(),
        "expected listener-foreign-peer events for the refused peers: {text}{}",
        String::from_utf8_lossy(&events.stderr)
    );
    assert!(
        text.contains("\"peer\""),
        "the events name the peer: {text}"
    );
    drop(dir);
}
