//! Local model access from Docker containers (#36 item 4), with the real daemon and a private
//! dockerd. Root only.
//!
//! A policy with `allow_host_services = [{ port = 11434 }]` lets its container reach port 11434
//! of its host at its bridge's gateway — the address the agent's DNS answers for
//! `host.docker.internal` — over TCP and UDP, and nothing else of the host: another port at the
//! gateway, the same port at another address of the host. A `lan = true` entry
//! (`gpu-box.lan`, port 8000) opens its private answer (inside `resolve_private`) on its port
//! once the agent answered it; a plain entry with ports whose answer is private stays proxy
//! only. A container of another policy gets none of it, and a reload that drops the host
//! service closes it again. Every check is judged by what arrived at a listener.
use std::net::SocketAddr;
use std::time::Duration;

use egress_tests::canary::Canary;
use egress_tests::docker::{Env, GATEWAY, SERIAL, require_root};
use egress_tests::keyed_line as line;

/// "LAN" addresses (a private range the policy's `resolve_private` covers), on the loopback of
/// the test's network namespace: reached from a container through the host, like a LAN peer.
const LAN_IP: &str = "10.77.0.2";
const DB_IP: &str = "10.77.0.3";
const SERVICE: u16 = 11434;

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn sock(s: &str) -> SocketAddr {
    s.parse().expect("test value")
}

fn policies(with_service: bool) -> String {
    let service = if with_service {
        format!("allow_host_services = [{{ port = {SERVICE}, name = \"ollama\" }}]\n")
    } else {
        String::new()
    };
    format!(
        r#"[policies.local]
{service}allow_hosts = [{{ host = "gpu-box.lan", ports = [8000], lan = true }}, {{ host = "db.lan", ports = [5432] }}]
allow_ports = [443]
resolve_private = ["10.77.0.0/16"]
[policies.plain]
allow_hosts = ["allowed.test"]
allow_ports = [8080]
"#
    )
}

#[test]
fn host_services_and_lan_entries_open_exactly_what_they_name() {
    if !require_root() {
        return;
    }
    let _l = lock();
    let mut env = Env::new(&[std::path::Path::new(env!("CARGO_BIN_EXE_egress-probe"))]);
    env.d.netns.sh(&format!(
        "ip addr add {LAN_IP}/32 dev lo; ip addr add {DB_IP}/32 dev lo"
    ));
    let hosts = env.config_path().with_file_name("hosts");
    let mut names = std::fs::read_to_string(&hosts).expect("hosts");
    names.push_str(&format!("{LAN_IP} gpu-box.lan\n{DB_IP} db.lan\n"));
    std::fs::write(&hosts, names).expect("hosts");
    let listeners = env.d.netns.run(|| {
        Canary::on(
            &[
                // The host service on every address of the host: whatever arrives is seen.
                sock(&format!("0.0.0.0:{SERVICE}")),
                sock(&format!("{GATEWAY}:{}", SERVICE + 1)),
                sock(&format!("{LAN_IP}:8000")),
                sock(&format!("{LAN_IP}:8001")),
                sock(&format!("{DB_IP}:5432")),
            ],
            &[sock(&format!("0.0.0.0:{SERVICE}"))],
        )
    });
    env.write_config(&env.config_text(&policies(true)));
    // The hosts file is read at start.
    env.kill_agent();
    env.start_agent();
    for (name, policy) in [("ls-1", "local"), ("ls-2", "plain")] {
        env.start_ok(
            name,
            &["--label", &format!("egress.policy={policy}")],
            &["sleep", "600"],
        );
    }
    assert!(
        env.wait_log(
            |l| l
                .lines()
                .any(|x| x.contains("host services opened") && x.contains("\"name\":\"ls-1\"")),
            Duration::from_secs(10)
        ),
        "the agent never opened ls-1's host services:\n{}",
        env.log()
    );
    assert!(
        env.wait_host_layer("ls-2"),
        "host layer never enforced for ls-2"
    );

    let m = std::process::id();
    let out = env.exec_out(
        "ls-1",
        &format!(
            "echo \"dns-host $(nslookup host.docker.internal 2>&1 | tr '\\n' ' ')\"; \
             echo \"hs $(egress-probe tcp {GATEWAY} {SERVICE} hs-{m})\"; \
             echo \"hsudp $(egress-probe udp {GATEWAY} {SERVICE} hsudp-{m})\"; \
             echo \"otherport $(egress-probe tcp {GATEWAY} {} otherport-{m})\"; \
             echo \"otheraddr $(egress-probe tcp {LAN_IP} {SERVICE} otheraddr-{m})\"; \
             echo \"otheraddrudp $(egress-probe udp {LAN_IP} {SERVICE} otheraddrudp-{m})\"; \
             echo \"lanbefore $(egress-probe tcp {LAN_IP} 8000 lanbefore-{m})\"; \
             echo \"dns-lan $(nslookup gpu-box.lan 2>&1 | tr '\\n' ' ')\"; \
             echo \"lan $(egress-probe tcp {LAN_IP} 8000 lan-{m})\"; \
             echo \"lanport $(egress-probe tcp {LAN_IP} 8001 lanport-{m})\"; \
             echo \"dns-db $(nslookup db.lan 2>&1 | tr '\\n' ' ')\"; \
             echo \"db $(egress-probe tcp {DB_IP} 5432 db-{m})\"; echo END",
            SERVICE + 1
        ),
    );
    let other = env.exec_out(
        "ls-2",
        &format!(
            "echo \"dns-host $(nslookup host.docker.internal 2>&1 | tr '\\n' ' ')\"; \
             echo \"hs2 $(egress-probe tcp {GATEWAY} {SERVICE} hs2-{m})\"; \
             echo \"hs2udp $(egress-probe udp {GATEWAY} {SERVICE} hs2udp-{m})\"; \
             echo \"lan2 $(egress-probe tcp {LAN_IP} 8000 lan2-{m})\"; echo END"
        ),
    );
    // host.docker.internal is the gateway, answered by the agent for the policy with host
    // services; the other policy's DNS has no such name.
    assert!(line(&out, "dns-host").contains(GATEWAY), "{out}");
    assert!(line(&other, "dns-host").contains("NXDOMAIN"), "{other}");
    assert!(line(&out, "hs").starts_with("hs ok"), "{out}");
    for refused in ["otherport", "otheraddr", "lanbefore", "lanport", "db"] {
        assert!(
            line(&out, refused).starts_with(&format!("{refused} err 1 ")),
            "{refused} must be refused at connect():\n{out}"
        );
    }
    assert!(line(&out, "dns-lan").contains(LAN_IP), "{out}");
    // db.lan is answered (its address is in resolve_private) but is no lan entry.
    assert!(line(&out, "dns-db").contains(DB_IP), "{out}");
    assert!(line(&out, "lan").starts_with("lan ok"), "{out}");
    for refused in ["hs2", "lan2"] {
        assert!(
            line(&other, refused).starts_with(&format!("{refused} err 1 ")),
            "{refused}:\n{other}"
        );
    }
    for arrived in ["hs", "hsudp", "lan"] {
        assert!(
            listeners.wait_for(&format!("{arrived}-{m}"), Duration::from_secs(3)),
            "{arrived} never arrived:\n{out}"
        );
    }
    for refused in [
        "otherport",
        "otheraddr",
        "otheraddrudp",
        "lanbefore",
        "lanport",
        "db",
        "hs2",
        "hs2udp",
        "lan2",
    ] {
        assert!(
            !listeners.saw(&format!("{refused}-{m}")),
            "{refused}: arrived at the listener"
        );
    }

    // A reload without the host service closes it again (kernel and host layer); the lan entry
    // stays.
    env.write_config(&env.config_text(&policies(false)));
    let o = env.cli(&["reload"]);
    assert!(
        o.status.success(),
        "reload: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let again = env.exec_out(
        "ls-1",
        &format!(
            "echo \"hs3 $(egress-probe tcp {GATEWAY} {SERVICE} hs3-{m})\"; \
             echo \"dns-host3 $(nslookup host.docker.internal 2>&1 | tr '\\n' ' ')\""
        ),
    );
    assert!(line(&again, "hs3").starts_with("hs3 err 1 "), "{again}");
    assert!(line(&again, "dns-host3").contains("NXDOMAIN"), "{again}");
    assert!(
        !listeners.saw(&format!("hs3-{m}")),
        "hs3 arrived after the reload"
    );
    let rules = env.d.netns.sh("nft list table inet egress_agent");
    assert!(
        !rules.contains(&format!("dport {SERVICE}")),
        "the host layer still opens the service:\n{rules}"
    );
}
