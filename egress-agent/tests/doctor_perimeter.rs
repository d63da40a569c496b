//! Perimeter probes against constructed hosts (no root needed): sshd_config fixtures with `Include`
//! and `Match`, and fake `sshd`, `fail2ban-client`, `tailscale`, `firewall-cmd` and `ufw` scripts on
//! the probe context's PATH. Each probe's pass, gap (fail or warn) and skip.
mod fixture_root;
use fixture_root::Root;

use std::sync::Mutex;
use std::time::Duration;

use egress_agent::doctor::{self, Options, Report, Status};

/// Scripts are written then executed: one test at a time, so no other test's fork holds a script
/// open for writing while it is exec'd (ETXTBSY).
static SERIAL: Mutex<()> = Mutex::new(());

/// The doctor's options for the host rooted at `root`, with its `bin/` (the fake tools) as the
/// PATH.
fn options(root: &Root) -> Options {
    std::fs::create_dir_all(root.path("bin")).expect("mkdir bin");
    Options {
        tool_path: Some(root.path("bin").into_os_string()),
        ..root.options()
    }
}

/// Run the probes `ids` on the host rooted at `root`.
fn run(root: &Root, ids: &[&str]) -> Report {
    let r = doctor::run_only(options(root), ids);
    print!("{}", r.to_text());
    r
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
    let root = Root::new("doctor-perimeter-ssh-good");
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
    let r = run(&root, SSH);
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
    let root = Root::new("doctor-perimeter-ssh-bad");
    root.write(
        "etc/ssh/sshd_config",
        "Include /NONEXISTENT/*.conf\nInclude sshd_config.d/*.conf\nPasswordAuthentication no\n",
    )
    .write(
        "etc/ssh/sshd_config.d/50-cloud-init.conf",
        "PasswordAuthentication yes\nPermitRootLogin yes\n",
    );
    let r = run(&root, SSH);
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
    let root = Root::new("doctor-perimeter-ssh-match");
    root.write(
        "etc/ssh/sshd_config",
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin no\n\
         Match Address 192.168.0.0/16\n  Include match.d/lan.conf\n\
         Match all\n  PermitRootLogin yes\n",
    )
    // Included inside a Match block: its settings belong to that block.
    .write("etc/ssh/match.d/lan.conf", "PasswordAuthentication yes\n");
    let r = run(&root, SSH);
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
    let root = Root::new("doctor-perimeter-ssh-defaults");
    root.write("etc/ssh/sshd_config", "# nothing\n");
    let r = run(&root, SSH);
    expect(&r, "host.ssh_password_auth", Status::Fail, "sshd's default");
    expect(
        &r,
        "host.ssh_root_login",
        Status::Warn,
        "PermitRootLogin prohibit-password (sshd's default)",
    );

    // `sshd -T -f <config>` where it runs wins over the files for global values.
    let root = Root::new("doctor-perimeter-ssh-dump");
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
    let r = run(&root, SSH);
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
    let root = Root::new("doctor-perimeter-ssh-none");
    let r = run(&root, SSH);
    expect(&r, "host.ssh_password_auth", Status::Skip, "no sshd");
    expect(&r, "host.ssh_root_login", Status::Skip, "no sshd");
}

#[test]
fn fail2ban_states() {
    let _g = lock();
    let id = ["host.fail2ban"];
    let root = Root::new("doctor-perimeter-f2b");
    expect(&run(&root, &id), id[0], Status::Skip, "not installed");

    root.tool(
        "fail2ban-client",
        "[ \"$1\" = status ] || exit 2\nprintf 'Status\\n|- Number of jail:\\t2\\n`- Jail list:\\tsshd, recidive\\n'",
    );
    expect(
        &run(&root, &id),
        id[0],
        Status::Pass,
        "2 jail(s): sshd, recidive",
    );

    root.tool(
        "fail2ban-client",
        "printf 'Status\\n|- Number of jail:\\t0\\n`- Jail list:\\t\\n'",
    );
    expect(&run(&root, &id), id[0], Status::Warn, "no jail");

    root.tool(
        "fail2ban-client",
        "echo 'ERROR   Failed to access socket path: /var/run/fail2ban/fail2ban.sock. Is fail2ban running?' >&2; exit 255",
    );
    expect(&run(&root, &id), id[0], Status::Fail, "not running");

    root.tool(
        "fail2ban-client",
        "echo 'ERROR   Permission denied to socket: /var/run/fail2ban/fail2ban.sock, (you must be root)' >&2; exit 255",
    );
    expect(&run(&root, &id), id[0], Status::Skip, "Permission denied");
}

#[test]
fn tailscale_states() {
    let _g = lock();
    let id = ["host.tailscale"];
    let root = Root::new("doctor-perimeter-ts");
    expect(&run(&root, &id), id[0], Status::Skip, "not installed");

    let up = r#"{"BackendState":"Running","Self":{"TailscaleIPs":["100.101.102.103","fd7a:115c:a1e0::1"]}}"#;
    root.tool(
        "tailscale",
        &format!("[ \"$1 $2\" = 'status --json' ] || exit 2\necho '{up}'"),
    );
    // No sshd: nothing else to reach.
    expect(&run(&root, &id), id[0], Status::Pass, "no sshd");

    root.write(
        "etc/ssh/sshd_config",
        "ListenAddress 100.101.102.103:22\nListenAddress [fd7a:115c:a1e0::1]:22\nListenAddress 127.0.0.1\n",
    );
    expect(
        &run(&root, &id),
        id[0],
        Status::Pass,
        "sshd listens only on the tailnet",
    );

    // sshd's default: every address.
    root.write("etc/ssh/sshd_config", "PasswordAuthentication no\n");
    expect(
        &run(&root, &id),
        id[0],
        Status::Warn,
        "sshd also listens on 0.0.0.0, ::",
    );

    root.tool(
        "tailscale",
        r#"echo '{"BackendState":"NeedsLogin","Self":{}}'"#,
    );
    expect(
        &run(&root, &id),
        id[0],
        Status::Warn,
        "not up (state NeedsLogin)",
    );

    root.tool(
        "tailscale",
        "echo 'failed to connect to local tailscaled; it doesn'\\''t appear to be running' >&2; exit 1",
    );
    expect(
        &run(&root, &id),
        id[0],
        Status::Warn,
        "tailscaled did not answer",
    );
}

#[test]
fn firewalld_states() {
    let _g = lock();
    let id = ["host.firewalld"];
    let root = Root::new("doctor-perimeter-firewalld");
    expect(&run(&root, &id), id[0], Status::Skip, "not installed");

    root.tool(
        "firewall-cmd",
        "[ \"$1\" = --state ] || exit 2\necho running",
    );
    expect(&run(&root, &id), id[0], Status::Pass, "firewalld running");

    // What firewall-cmd does when the daemon is stopped.
    root.tool("firewall-cmd", "echo 'not running' >&2; exit 252");
    expect(&run(&root, &id), id[0], Status::Warn, "not running");

    // "not running" is not "running", whatever the exit status.
    root.tool("firewall-cmd", "echo 'not running'");
    expect(
        &run(&root, &id),
        id[0],
        Status::Warn,
        "state \"not running\"",
    );
}

#[test]
fn ufw_states() {
    let _g = lock();
    let id = ["host.ufw"];
    let root = Root::new("doctor-perimeter-ufw");
    expect(&run(&root, &id), id[0], Status::Skip, "not installed");

    root.tool(
        "ufw",
        "[ \"$1\" = status ] || exit 2\nprintf 'Status: active\\n\\nTo Action From\\n22/tcp ALLOW Anywhere\\n'",
    );
    expect(&run(&root, &id), id[0], Status::Pass, "ufw active");

    root.tool("ufw", "echo 'Status: inactive'");
    expect(&run(&root, &id), id[0], Status::Warn, "status inactive");

    root.tool(
        "ufw",
        "echo 'ERROR: You need to be root to run this script' >&2; exit 1",
    );
    expect(&run(&root, &id), id[0], Status::Skip, "need to be root");
}

#[test]
fn a_hung_client_is_a_timely_warn() {
    let _g = lock();
    let root = Root::new("doctor-perimeter-hung");
    root.tool("fail2ban-client", "exec sleep 60");
    let mut opts = options(&root);
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
