//! Doctor against constructed hosts (no root needed): statuses on fixture files, a fake Docker
//! Engine API on a unix socket, real loopback listeners; and termination when what a probe needs is
//! missing or hangs.
mod fixture_root;
use fixture_root::Root;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use egress_agent::doctor::{self, Check, HostPaths, Report, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn get<'a>(r: &'a Report, id: &str) -> &'a Check {
    r.checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no check {id}"))
}

#[track_caller]
fn expect(r: &Report, id: &str, status: Status, needle: &str) {
    let c = get(r, id);
    assert_eq!(c.status, status, "{id}: {c:?}\n{}", r.to_text());
    assert!(
        c.summary.contains(needle),
        "{id}: {:?} lacks {needle:?}",
        c.summary
    );
}

/// [`expect`] for each `(id, status, needle)` row.
fn expect_all(r: &Report, rows: &[(&str, Status, &str)]) {
    for &(id, status, needle) in rows {
        expect(r, id, status, needle);
    }
}

fn good_host(root: &Root) {
    let bpf = root.path("bpf");
    root.write(
        "proc/self/mountinfo",
        &format!(
            "22 1 0:21 / /sys rw - sysfs sysfs rw\n\
             30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n\
             40 1 0:33 / {} rw,relatime - bpf bpf rw\n",
            bpf.display()
        ),
    )
    .write("proc/cmdline", "ro quiet\n")
    .write(
        "sys/kernel/security/lsm",
        "lockdown,capability,landlock,bpf",
    )
    .write("sys/kernel/btf/vmlinux", "BTF-blob")
    .mkdir("sys/module/nf_tables")
    .write(
        "boot/config-9.9.9",
        "CONFIG_BPF_SYSCALL=y\nCONFIG_CGROUP_BPF=y\nCONFIG_BPF_LSM=y\nCONFIG_NF_TABLES=m\n",
    )
    .write("proc/sys/kernel/unprivileged_bpf_disabled", "2\n")
    .write("proc/sys/net/ipv4/ip_forward", "0\n")
    .write("proc/sys/net/ipv6/conf/all/forwarding", "0\n")
    .write("bpf/egress-agent/maps/POLICIES", "")
    .write("bpf/egress-agent/maps/EVENTS", "")
    .write("bpf/egress-agent/roots/4242/connect4", "")
    .write("bpf/egress-agent/roots/4242/connect6", "")
    .write(
        "etc/docker/daemon.json",
        r#"{"default-capabilities": ["CHOWN", "KILL", "NET_BIND_SERVICE"]}"#,
    );
}

/// A fake Docker Engine API: answers `GET path` from `routes`, 404 otherwise. `hang`: accept and
/// never answer.
async fn fake_docker(sock: &Path, routes: Vec<(&'static str, String)>, hang: bool) {
    let l = tokio::net::UnixListener::bind(sock).expect("bind fake docker socket");
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            if hang {
                held.push(s);
                continue;
            }
            let routes = routes.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf);
                let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                let (status, body) = match routes.iter().find(|(p, _)| *p == path) {
                    Some((_, b)) => ("200 OK", b.clone()),
                    None => ("404 Not Found", r#"{"message":"not found"}"#.to_owned()),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                s.write_all(resp.as_bytes()).await.ok();
            });
        }
    });
}

fn docker_routes() -> Vec<(&'static str, String)> {
    let a = "a".repeat(64);
    let b = "b".repeat(64);
    vec![
        ("/info", r#"{"ServerVersion":"27.3.1","CgroupDriver":"cgroupfs","CgroupVersion":"2","ContainersRunning":2,"SecurityOptions":["name=apparmor","name=seccomp,profile=builtin","name=cgroupns"]}"#.into()),
        ("/containers/json", format!(r#"[{{"Id":"{a}"}},{{"Id":"{b}"}},{{"Id":"../../etc"}}]"#)),
        (
            Box::leak(format!("/containers/{a}/json").into_boxed_str()),
            format!(r#"{{"Id":"{a}","Name":"/dind","HostConfig":{{"Privileged":true,"CapAdd":null,"CapDrop":null}}}}"#),
        ),
        (
            Box::leak(format!("/containers/{b}/json").into_boxed_str()),
            format!(r#"{{"Id":"{b}","Name":"/build","HostConfig":{{"Privileged":false,"CapAdd":null,"CapDrop":["NET_RAW"],"SecurityOpt":["seccomp=unconfined"]}}}}"#),
        ),
    ]
}

/// `/proc/net/tcp` with one IPv4 socket in LISTEN state at `addr` (the kernel prints the address
/// as a native-endian u32 of network-order bytes).
fn proc_net_tcp_listening(addr: std::net::SocketAddr) -> String {
    let std::net::IpAddr::V4(ip) = addr.ip() else {
        panic!("IPv4 only: {addr}")
    };
    format!(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: {:08X}:{:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1\n",
        u32::from_ne_bytes(ip.octets()),
        addr.port()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn good_host_statuses() {
    let root = Root::new("doctor-good");
    good_host(&root);
    fake_docker(&root.path("docker.sock"), docker_routes(), false).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // The daemon's listeners are judged by their LISTEN state in its namespace, never connected
    // to (a connection would be a listener-foreign-peer denial): the fixture's /proc/net/tcp.
    root.write("proc/net/tcp", &proc_net_tcp_listening(addr));
    let mut opts = root.options();
    opts.proxy_listeners = vec![addr];

    let r = doctor::run_async(opts).await;
    println!("{}", r.to_text());
    expect_all(
        &r,
        &[
            ("kernel.cgroup2", Status::Pass, "/sys/fs/cgroup"),
            ("kernel.btf", Status::Pass, "kernel BTF"),
            (
                "kernel.bpf_lsm",
                Status::Pass,
                "active LSMs: lockdown,capability,landlock,bpf",
            ),
            ("kernel.cgroup_bpf", Status::Pass, "CONFIG_CGROUP_BPF=y"),
            ("kernel.nf_tables", Status::Pass, "module loaded"),
            ("kernel.unprivileged_bpf", Status::Pass, "=2"),
            ("bpf.bpffs", Status::Pass, "bpffs mounted"),
            (
                "bpf.pinned",
                Status::Pass,
                "2 program links on 1 enforcement root(s) and 2 maps",
            ),
            (
                "proxy.listening",
                Status::Pass,
                "1 configured listeners are listening",
            ),
            ("docker.reachable", Status::Pass, "Docker 27.3.1"),
            ("docker.cgroup_driver", Status::Pass, "cgroupfs, cgroup v2"),
        ],
    );
    // daemon.json drops NET_RAW by default, but the privileged container has every capability.
    expect_all(
        &r,
        &[
            (
                "docker.net_raw",
                Status::Warn,
                "1 of 2 running containers have it: dind",
            ),
            (
                "docker.privileged",
                Status::Warn,
                "1 running container(s) can detach",
            ),
            ("nft.agent_table", Status::Skip, "netlink queries disabled"),
            (
                "host.firewall_input",
                Status::Skip,
                "can't read the firewall",
            ),
            ("host.ip_forward", Status::Pass, "disabled"),
            (
                "docker.seccomp",
                Status::Warn,
                "profile builtin), but 1 running container(s) have seccomp=unconfined: build",
            ),
            ("docker.userns", Status::Warn, "no user namespace remapping"),
            ("docker.rootless", Status::Pass, "rootful"),
            ("host.ssh_password_auth", Status::Skip, "no sshd"),
        ],
    );
    assert_eq!(r.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weak_host_statuses() {
    let root = Root::new("doctor-weak");
    root.write("proc/self/mountinfo", "22 1 0:21 / /sys rw - sysfs sysfs rw\n31 22 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
        .write("proc/cmdline", "ro quiet lsm=yama,apparmor\n")
        .write("boot/config-9.9.9", "CONFIG_BPF_SYSCALL=y\nCONFIG_BPF_LSM=y\nCONFIG_LSM=\"yama,apparmor\"\n# CONFIG_CGROUP_BPF is not set\n")
        .mkdir("sys/kernel")
        .write("proc/sys/kernel/unprivileged_bpf_disabled", "0\n")
        .write("proc/sys/net/ipv4/ip_forward", "1\n")
        .write("bpf/egress-agent/maps/POLICIES", "")
        .mkdir("bpf/egress-agent/roots/4242");
    // A port that was just free: nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    // Listening elsewhere only: another port of the same address.
    let elsewhere = std::net::SocketAddr::new(closed.ip(), closed.port().wrapping_add(1));
    root.write("proc/net/tcp", &proc_net_tcp_listening(elsewhere));
    let mut opts = root.options();
    opts.proxy_listeners = vec![closed];

    let r = doctor::run_async(opts).await;
    println!("{}", r.to_text());
    expect_all(
        &r,
        &[
            ("kernel.cgroup2", Status::Fail, "no cgroup2 mount"),
            ("kernel.btf", Status::Fail, "no kernel BTF"),
            ("kernel.bpf_lsm", Status::Warn, "lsm=yama,apparmor"),
            (
                "kernel.cgroup_bpf",
                Status::Fail,
                "without CONFIG_CGROUP_BPF",
            ),
            ("kernel.nf_tables", Status::Fail, "no nf_tables"),
            ("kernel.unprivileged_bpf", Status::Warn, "allowed"),
            ("bpf.bpffs", Status::Warn, "no bpffs mounted"),
            ("bpf.pinned", Status::Fail, "no program links"),
            ("proxy.listening", Status::Fail, "are not listening"),
            ("docker.reachable", Status::Skip, "no Docker socket"),
            ("docker.privileged", Status::Skip, "Docker not reachable"),
            ("docker.seccomp", Status::Skip, "Docker not reachable"),
            ("docker.userns", Status::Skip, "Docker not reachable"),
            ("docker.rootless", Status::Skip, "Docker not reachable"),
            ("host.ip_forward", Status::Warn, "forward policy unknown"),
        ],
    );
    assert_eq!(r.exit_code(), 1);
    assert!(
        r.checks
            .iter()
            .filter(|c| c.status != Status::Pass)
            .all(|c| c.fix.is_some())
    );
}

#[test]
fn terminates_quickly_when_everything_is_missing() {
    let root = Root::new("doctor-missing");
    let mut opts = root.options();
    opts.paths = HostPaths::under(&root.path("does-not-exist"), "");
    opts.pin_dir = root.path("nope/egress-agent");
    opts.netlink = true; // would be skipped for want of nf_tables evidence, never hang
    let start = Instant::now();
    let r = doctor::run(opts);
    let took = start.elapsed();
    println!("{}", r.to_text());
    assert!(took < Duration::from_secs(2), "took {took:?}");
    for id in [
        "docker.reachable",
        "docker.cgroup_driver",
        "docker.net_raw",
        "docker.privileged",
        "kernel.cgroup2",
        "kernel.bpf_lsm",
    ] {
        assert_eq!(get(&r, id).status, Status::Skip, "{id}: {:?}", get(&r, id));
    }
    assert!(
        r.checks
            .iter()
            .all(|c| !c.summary.contains("deadline") && !c.summary.contains("no answer"))
    );
}

#[test]
fn a_hung_docker_daemon_is_a_timely_fail() {
    let root = Root::new("doctor-hung");
    good_host(&root);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(fake_docker(&root.path("docker.sock"), Vec::new(), true));
    let mut opts = root.options();
    opts.probe_timeout = Duration::from_millis(800);
    let start = Instant::now();
    let r = doctor::run(opts);
    let took = start.elapsed();
    println!("{}", r.to_text());
    assert!(took < Duration::from_secs(2), "took {took:?}");
    expect(&r, "docker.reachable", Status::Fail, "no answer within");
    expect(&r, "docker.privileged", Status::Skip, "no answer within");
}

#[test]
fn a_hung_file_read_does_not_hang_the_doctor() {
    // A FIFO with no writer blocks open(2) forever: the probes reading it must still give an answer
    // in time, and the run must return (the stuck thread is left behind).
    let root = Root::new("doctor-fifo");
    good_host(&root);
    let fifo = root.path("proc/self/mountinfo");
    std::fs::remove_file(&fifo).expect("rm");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    let mut opts = root.options();
    opts.probe_timeout = Duration::from_millis(500);
    opts.deadline = Duration::from_secs(2);
    let start = Instant::now();
    let r = doctor::run(opts);
    let took = start.elapsed();
    println!("{}", r.to_text());
    assert!(took < Duration::from_secs(3), "took {took:?}");
    expect(&r, "kernel.cgroup2", Status::Warn, "no answer within");
    expect(&r, "bpf.bpffs", Status::Warn, "no answer within");
    // Unblock the stuck reader so the test process exits promptly.
    std::fs::OpenOptions::new().write(true).open(&fifo).ok();
}

/// Write an executable shell script `name` into `dir`.
fn fake_tool(dir: &Path, name: &str, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).expect("mkdir");
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).expect("write tool");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn legacy_iptables_policies_through_the_tool() {
    let root = Root::new("doctor-legacy");
    good_host(&root);
    root.write("proc/net/ip_tables_names", "nat\nfilter\n")
        .write("proc/net/ip6_tables_names", "filter\n");
    root.write("proc/sys/net/ipv4/ip_forward", "1\n");
    let bin = root.path("bin");
    fake_tool(
        &bin,
        "iptables-legacy",
        "echo '-P INPUT DROP'; echo '-P FORWARD DROP'; echo '-P OUTPUT ACCEPT'",
    );
    fake_tool(
        &bin,
        "ip6tables-legacy",
        "echo '-P INPUT ACCEPT'; echo '-P FORWARD DROP'",
    );
    let mut opts = root.options();
    opts.tool_path = Some(bin.into_os_string());
    let r = doctor::run(opts);
    println!("{}", r.to_text());
    expect_all(
        &r,
        &[
            (
                "host.firewall_input",
                Status::Warn,
                "accepts IPv6 (iptables-legacy filter INPUT policy drop; ip6tables-legacy filter INPUT policy accept",
            ),
            ("host.firewall_forward", Status::Pass, "drops IPv4 and IPv6"),
            ("host.ip_forward", Status::Pass, "IPv4 forwarding enabled"),
        ],
    );
}

#[test]
fn a_hung_tool_is_killed_in_time() {
    let root = Root::new("doctor-hungtool");
    good_host(&root);
    root.write("proc/net/ip_tables_names", "filter\n");
    let bin = root.path("bin");
    fake_tool(&bin, "iptables-legacy", "exec sleep 60");
    let mut opts = root.options();
    opts.tool_path = Some(bin.into_os_string());
    opts.probe_timeout = Duration::from_millis(600);
    let start = Instant::now();
    let r = doctor::run(opts);
    let took = start.elapsed();
    println!("{}", r.to_text());
    assert!(took < Duration::from_secs(2), "took {took:?}");
    // netlink is off and the only other source timed out: nothing to judge by.
    expect(
        &r,
        "host.firewall_input",
        Status::Skip,
        "did not finish within",
    );
}

/// Child mode of the discovery test: a process whose name is `egress-agent`, listening on loopback.
#[test]
fn listener_child() {
    if std::env::var_os("EGRESS_DOCTOR_LISTENER_CHILD").is_none() {
        return;
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    println!("PORT={}", l.local_addr().expect("addr").port());
    std::thread::sleep(Duration::from_secs(20));
}

#[test]
fn discovers_the_agents_listeners_through_proc() {
    use std::io::BufRead;
    let root = Root::new("doctor-discover");
    let exe = root.path("egress-agent");
    std::fs::copy(std::env::current_exe().expect("exe"), &exe).expect("copy test binary");
    let mut child = std::process::Command::new(&exe)
        .args([
            "--exact",
            "listener_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("EGRESS_DOCTOR_LISTENER_CHILD", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let port = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split("PORT=").nth(1).map(|p| p.trim().to_owned()))
        .expect("child port");
    let mut opts = root.options();
    opts.paths.proc_dir = PathBuf::from("/proc");
    let r = doctor::run(opts);
    child.kill().ok();
    child.wait().ok();
    println!("{}", r.to_text());
    expect(
        &r,
        "proxy.listening",
        Status::Pass,
        &format!("discovered listeners are listening (127.0.0.1:{port})"),
    );
}
