//! Perimeter probes against constructed hosts (no root needed): sshd_config fixtures with `Include`
//! and `Match`, and fake `sshd`, `fail2ban-client`, `tailscale`, `firewall-cmd` and `ufw` scripts on
//! the probe context's PATH. Each probe's pass, gap (fail or warn) and skip.
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use egress_agent::doctor::{self, HostPaths, Options, Report, Status};

/// Scripts are written then executed: one test at a time, so no other test's fork holds a script
/// open for writing while it is exec'd (ETXTBSY).
static SERIAL: Mutex<()> = Mutex::new(());

/// A fresh fixture directory, removed on drop.
struct Root(PathBuf);

impl Root {
    fn new(tag: &str) -> Root {
        let p = std::env::temp_dir().join(format!(
            "egress-doctor-perimeter-{tag}-{}",
            std::process::id()
        ));
        std::fs::remove_dir_all(&p).ok();
        std::fs::create_dir_all(&p).expect("create fixture root");
        Root(p)
    }
    fn write(&self, rel: &str, content: &str) -> &Self {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content).expect("write fixture");
        self
    }
    /// An executable shell script `bin/<name>`.
    fn tool(&self, name: &str, body: &str) -> &Self {
        use std::os::unix::fs::PermissionsExt;
        self.write(&format!("bin/{name}"), &format!("#!/bin/sh\n{body}\n"));
        let p = self.0.join("bin").join(name);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        self
    }
    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
    fn options(&self) -> Options {
        std::fs::create_dir_all(self.path("bin")).expect("mkdir bin");
        Options {
            paths: HostPaths::under(&self.0, "9.9.9"),
            pin_dir: self.path("bpf/egress-agent"),
            docker_socket: self.path("docker.sock"),
            docker_daemon_json: self.path("etc/docker/daemon.json"),
            sshd_config: self.path("etc/ssh/sshd_config"),
            tool_path: Some(self.path("bin").into_os_string()),
            netlink: false,
            probe_timeout: Duration::from_secs(2),
            deadline: Duration::from_secs(5),
            ..Options::default()
        }
    }
    /// Run the probes `ids` on this host.
    fn run(&self, ids: &[&str]) -> Report {
        let r = doctor::run_only(self.options(), ids);
        print!("{}", r.to_text());
        r
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

#[track_caller]
fn expect(r: &Report, id: &str, status: Status, needle: &str) {
    let c = r
        .checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no check {id}"));
    assert_eq!(c.status, status, "{id}: {c:?}");
    assert!(
        c.summary.contains(needle),
        "{id}: {:?} lacks {needle:?}",
        c.summary
    );
    assert_eq!(
        c.fix.is_none(),
        status == Status::Pass,
        "{id}: fix iff not pass"
    );
}

const SSH: &[&str] = &["host.ssh_password_auth", "host.ssh_root_login"];

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn ssh_hardened_through_includes_and_matches() {
    let _g = lock();
    let root = Root::new("ssh-good");
    // Ubuntu's layout: the drop-ins first, so their values win over the main file's.
    root.write(
        "etc/ssh/sshd_config",
        "Include sshd_config.d/*.conf\n\
         PasswordAuthentication yes\n\
         PermitRootLogin no\n\
         Match User backup\n\
         \tPasswordAuthentication no\n",
    )
    .write(
        "etc/ssh/sshd_config.d/10-hard.conf",
        "# hardened\nPasswordAuthentication=no\nKbdInteractiveAuthentication no\n\
         # a Match here ends with this file: the main file's PermitRootLogin stays global\n\
         Match Address 10.0.0.0/8\n  PermitRootLogin no\n",
    )
    // Not matched by the glob.
    .write(
        "etc/ssh/sshd_config.d/20-old.conf.bak",
        "PasswordAuthentication yes\n",
    );
    let r = root.run(SSH);
    expect(
        &r,
        "host.ssh_password_auth",
        Status::Pass,
        "PasswordAuthentication no (from ",
    );
    expect(&r, "host.ssh_password_auth", Status::Pass, "10-hard.conf");
    expect(
        &r,
        "host.ssh_root_login",
        Status::Pass,
        "root logins off: PermitRootLogin no",
    );
}

#[test]
fn ssh_cloud_init_drop_in_turns_passwords_on() {
    let _g = lock();
    let root = Root::new("ssh-bad");
    root.write(
        "etc/ssh/sshd_config",
        "Include /NONEXISTENT/*.conf\nInclude sshd_config.d/*.conf\nPasswordAuthentication no\n",
    )
    .write(
        "etc/ssh/sshd_config.d/50-cloud-init.conf",
        "PasswordAuthentication yes\nPermitRootLogin yes\n",
    );
    let r = root.run(SSH);
    expect(
        &r,
        "host.ssh_password_auth",
        Status::Fail,
        "PasswordAuthentication yes (from ",
    );
    expect(
        &r,
        "host.ssh_password_auth",
        Status::Fail,
        "50-cloud-init.conf",
    );
    expect(
        &r,
        "host.ssh_root_login",
        Status::Fail,
        "PermitRootLogin yes",
    );
}

#[test]
fn ssh_match_blocks_are_gaps() {
    let _g = lock();
    let root = Root::new("ssh-match");
    root.write(
        "etc/ssh/sshd_config",
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin no\n\
         Match Address 192.168.0.0/16\n  Include match.d/lan.conf\n\
         Match all\n  PermitRootLogin yes\n",
    )
    // Included inside a Match block: its settings belong to that block.
    .write("etc/ssh/match.d/lan.conf", "PasswordAuthentication yes\n");
    let r = root.run(SSH);
    expect(
        &r,
        "host.ssh_password_auth",
        Status::Warn,
        "accepted for Match Address 192.168.0.0/16 (yes)",
    );
    expect(&r, "host.ssh_root_login", Status::Fail, "Match all (yes)");
}

#[test]
fn ssh_defaults_and_sshd_dump() {
    let _g = lock();
    // An empty config: sshd's defaults (passwords on, root by key).
    let root = Root::new("ssh-defaults");
    root.write("etc/ssh/sshd_config", "# nothing\n");
    let r = root.run(SSH);
    expect(&r, "host.ssh_password_auth", Status::Fail, "sshd's default");
    expect(
        &r,
        "host.ssh_root_login",
        Status::Warn,
        "PermitRootLogin prohibit-password (sshd's default)",
    );

    // `sshd -T -f <config>` where it runs wins over the files for global values.
    let root = Root::new("ssh-dump");
    let cfg = root.path("etc/ssh/sshd_config");
    root.write("etc/ssh/sshd_config", "PasswordAuthentication yes\n")
        .tool(
            "sshd",
            &format!(
                "[ \"$1 $2 $3\" = \"-T -f {}\" ] || exit 3\n\
             echo 'passwordauthentication no'; echo 'kbdinteractiveauthentication no'; \
             echo 'permitrootlogin without-password'",
                cfg.display()
            ),
        );
    let r = root.run(SSH);
    expect(&r, "host.ssh_password_auth", Status::Pass, "(from sshd -T)");
    expect(
        &r,
        "host.ssh_root_login",
        Status::Warn,
        "PermitRootLogin without-password (from sshd -T)",
    );
}

#[test]
fn ssh_absent_is_skip() {
    let _g = lock();
    let root = Root::new("ssh-none");
    let r = root.run(SSH);
    expect(&r, "host.ssh_password_auth", Status::Skip, "no sshd");
    expect(&r, "host.ssh_root_login", Status::Skip, "no sshd");
}

#[test]
fn fail2ban_states() {
    let _g = lock();
    let id = ["host.fail2ban"];
    let root = Root::new("f2b");
    expect(&root.run(&id), id[0], Status::Skip, "not installed");

    root.tool(
        "fail2ban-client",
        "[ \"$1\" = status ] || exit 2\nprintf 'Status\\n|- Number of jail:\\t2\\n`- Jail list:\\tsshd, recidive\\n'",
    );
    expect(
        &root.run(&id),
        id[0],
        Status::Pass,
        "2 jail(s): sshd, recidive",
    );

    root.tool(
        "fail2ban-client",
        "printf 'Status\\n|- Number of jail:\\t0\\n`- Jail list:\\t\\n'",
    );
    expect(&root.run(&id), id[0], Status::Warn, "no jail");

    root.tool(
        "fail2ban-client",
        "echo 'ERROR   Failed to access socket path: /var/run/fail2ban/fail2ban.sock. Is fail2ban running?' >&2; exit 255",
    );
    expect(&root.run(&id), id[0], Status::Fail, "not running");

    root.tool(
        "fail2ban-client",
        "echo 'ERROR   Permission denied to socket: /var/run/fail2ban/fail2ban.sock, (you must be root)' >&2; exit 255",
    );
    expect(&root.run(&id), id[0], Status::Skip, "Permission denied");
}

#[test]
fn tailscale_states() {
    let _g = lock();
    let id = ["host.tailscale"];
    let root = Root::new("ts");
    expect(&root.run(&id), id[0], Status::Skip, "not installed");

    let up = r#"{"BackendState":"Running","Self":{"TailscaleIPs":["100.101.102.103","fd7a:115c:a1e0::1"]}}"#;
    root.tool(
        "tailscale",
        &format!("[ \"$1 $2\" = 'status --json' ] || exit 2\necho '{up}'"),
    );
    // No sshd: nothing else to reach.
    expect(&root.run(&id), id[0], Status::Pass, "no sshd");

    root.write(
        "etc/ssh/sshd_config",
        "ListenAddress 100.101.102.103:22\nListenAddress [fd7a:115c:a1e0::1]:22\nListenAddress 127.0.0.1\n",
    );
    expect(
        &root.run(&id),
        id[0],
        Status::Pass,
        "sshd listens only on the tailnet",
    );

    // sshd's default: every address.
    root.write("etc/ssh/sshd_config", "PasswordAuthentication no\n");
    expect(
        &root.run(&id),
        id[0],
        Status::Warn,
        "sshd also listens on 0.0.0.0, ::",
    );

    root.tool(
        "tailscale",
        r#"echo '{"BackendState":"NeedsLogin","Self":{}}'"#,
    );
    expect(
        &root.run(&id),
        id[0],
        Status::Warn,
        "not up (state NeedsLogin)",
    );

    root.tool(
        "tailscale",
        "echo 'failed to connect to local tailscaled; it doesn'\\''t appear to be running' >&2; exit 1",
    );
    expect(
        &root.run(&id),
        id[0],
        Status::Warn,
        "tailscaled did not answer",
    );
}

#[test]
fn firewalld_states() {
    let _g = lock();
    let id = ["host.firewalld"];
    let root = Root::new("firewalld");
    expect(&root.run(&id), id[0], Status::Skip, "not installed");

    root.tool(
        "firewall-cmd",
        "[ \"$1\" = --state ] || exit 2\necho running",
    );
    expect(&root.run(&id), id[0], Status::Pass, "firewalld running");

    // What firewall-cmd does when the daemon is stopped.
    root.tool("firewall-cmd", "echo 'not running' >&2; exit 252");
    expect(&root.run(&id), id[0], Status::Warn, "not running");

    // "not running" is not "running", whatever the exit status.
    root.tool("firewall-cmd", "echo 'not running'");
    expect(&root.run(&id), id[0], Status::Warn, "state \"not running\"");
}

#[test]
fn ufw_states() {
    let _g = lock();
    let id = ["host.ufw"];
    let root = Root::new("ufw");
    expect(&root.run(&id), id[0], Status::Skip, "not installed");

    root.tool(
        "ufw",
        "[ \"$1\" = status ] || exit 2\nprintf 'Status: active\\n\\nTo Action From\\n22/tcp ALLOW Anywhere\\n'",
    );
    expect(&root.run(&id), id[0], Status::Pass, "ufw active");

    root.tool("ufw", "echo 'Status: inactive'");
    expect(&root.run(&id), id[0], Status::Warn, "status inactive");

    root.tool(
        "ufw",
        "echo 'ERROR: You need to be root to run this script' >&2; exit 1",
    );
    expect(&root.run(&id), id[0], Status::Skip, "need to be root");
}

#[test]
fn a_hung_client_is_a_timely_warn() {
    let _g = lock();
    let root = Root::new("hung");
    root.tool("fail2ban-client", "exec sleep 60");
    let mut opts = root.options();
    opts.probe_timeout = Duration::from_millis(600);
    let start = std::time::Instant::now();
    let r = doctor::run_only(opts, &["host.fail2ban"]);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    expect(&r, "host.fail2ban", Status::Warn, "did not finish within");
}
