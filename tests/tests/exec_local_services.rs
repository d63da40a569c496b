//! Local model access under `egress-agent exec` (#36 item 4): the command shares the host's
//! network namespace, so its host is loopback. `allow_host_services = [{ port = P }]` lets it
//! reach 127.0.0.1:P and [::1]:P (and `host.docker.internal`, which the agent's DNS answers
//! with them) — not another port, not another loopback address, not another address of the
//! host; a `lan = true` entry opens its private answer on its port once the agent answered it,
//! a plain entry with ports whose answer is private stays proxy only; a command of a policy
//! without host services reaches none of it. Judged by what arrived at each listener.
//!
//! Run as root (CI is root); unprivileged, the test says it skipped.
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use egress_tests::agent::{TestConfig, assert_enforcement_intact, exec_script};
use egress_tests::canary::Canary;
use egress_tests::upstreams::{Dnsmasq, DummyNet, TempDir};
use egress_tests::{keyed_line as line, marker, root_or_skip};

const DNS: &str = "127.0.0.1:15354";
/// "LAN" addresses (private, covered by the policy's `resolve_private`) on a local veth.
const LAN_IP: &str = "10.77.0.2";
const DB_IP: &str = "10.77.0.3";
const SERVICE: u16 = 18434;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test value")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("test value")
}

const POLICIES: &str = r#"
[policies.local]
allow_host_services = [{ port = 18434, name = "model" }]
allow_hosts = [{ host = "gpu-box.lan", ports = [18000], lan = true }, { host = "db.lan", ports = [15432] }]
allow_ports = [443]
resolve_private = ["10.77.0.0/16"]
[policies.plain]
allow_hosts = ["gpu-box.lan"]
allow_ports = [443]
resolve_private = ["10.77.0.0/16"]
"#;

#[test]
fn host_services_and_lan_entries_open_exactly_what_they_name() {
    if !root_or_skip("exec local services") {
        return;
    }
    let dir = TempDir::new("local-services");
    let dns = Dnsmasq::start(
        dir.path(),
        addr(DNS),
        &[("gpu-box.lan", ip(LAN_IP)), ("db.lan", ip(DB_IP))],
    );
    let _lan = DummyNet::new("egt-lan0", &[ip(LAN_IP), ip(DB_IP)]);
    let listeners = Canary::on(
        &[
            addr(&format!("127.0.0.1:{SERVICE}")),
            addr(&format!("[::1]:{SERVICE}")),
            addr(&format!("127.0.0.1:{}", SERVICE + 1)),
            addr(&format!("127.0.0.2:{SERVICE}")),
            addr(&format!("{LAN_IP}:{SERVICE}")),
            addr(&format!("{LAN_IP}:18000")),
            addr(&format!("{LAN_IP}:18001")),
            addr(&format!("{DB_IP}:15432")),
        ],
        &[addr(&format!("127.0.0.1:{SERVICE}"))],
    );
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "").expect("hosts");
    let cfg = TestConfig::new(&format!(
        "[dns]\nnameservers = [\"{DNS}\"]\nhosts_file = \"{}\"\n{POLICIES}",
        hosts.display()
    ));
    let probe = env!("CARGO_BIN_EXE_egress-probe");
    let m = marker("local");
    let out = exec_script(
        &cfg,
        "local",
        &format!(
            "echo \"no-proxy $NO_PROXY\"; \
             echo \"proxied $(curl -sS -m 5 --noproxy '' -x \"$HTTP_PROXY\" http://host.docker.internal:{SERVICE}/proxied-{m} | tr '\\n' ' ')\"; \
             echo \"dns-host $(getent ahosts host.docker.internal | tr '\\n' ' ')\"; \
             echo \"hs $({probe} tcp 127.0.0.1 {SERVICE} hs-{m})\"; \
             echo \"hs6 $({probe} tcp ::1 {SERVICE} hs6-{m})\"; \
             echo \"hsudp $({probe} udp 127.0.0.1 {SERVICE} hsudp-{m})\"; \
             echo \"otherport $({probe} tcp 127.0.0.1 {} otherport-{m})\"; \
             echo \"otherloop $({probe} tcp 127.0.0.2 {SERVICE} otherloop-{m})\"; \
             echo \"otheraddr $({probe} tcp {LAN_IP} {SERVICE} otheraddr-{m})\"; \
             echo \"lanbefore $({probe} tcp {LAN_IP} 18000 lanbefore-{m})\"; \
             echo \"dns-lan $(getent ahostsv4 gpu-box.lan | tr '\\n' ' ')\"; \
             echo \"lan $({probe} tcp {LAN_IP} 18000 lan-{m})\"; \
             echo \"lanport $({probe} tcp {LAN_IP} 18001 lanport-{m})\"; \
             echo \"lanproxy $(curl -sS -m 5 -o /dev/null -w '%{{http_code}}' --noproxy '' -x \"$HTTP_PROXY\" http://gpu-box.lan:18000/lanproxy-{m})\"; \
             echo \"dns-db $(getent ahostsv4 db.lan | tr '\\n' ' ')\"; \
             echo \"db $({probe} tcp {DB_IP} 15432 db-{m})\"",
            SERVICE + 1
        ),
    );
    let other = exec_script(
        &cfg,
        "plain",
        &format!(
            "echo \"dns-host $(getent ahosts host.docker.internal || echo none)\"; \
             echo \"hs2 $({probe} tcp 127.0.0.1 {SERVICE} hs2-{m})\"; \
             echo \"hs2udp $({probe} udp 127.0.0.1 {SERVICE} hs2udp-{m})\"; \
             echo \"dns-lan2 $(getent ahostsv4 gpu-box.lan | tr '\\n' ' ')\"; \
             echo \"lan2 $({probe} tcp {LAN_IP} 18000 lan2-{m})\""
        ),
    );
    // The command is told to reach the host directly, not through its proxy.
    assert!(
        line(&out, "no-proxy").contains("host.docker.internal"),
        "{out}"
    );
    // Through the proxy the host is refused, with the way to reach it directly.
    assert!(
        line(&out, "proxied").contains("host-not-allowed")
            && line(&out, "proxied").contains("NO_PROXY"),
        "{out}"
    );
    // host.docker.internal: the agent answers loopback, both families.
    let dns_host = line(&out, "dns-host");
    assert!(
        dns_host.contains("127.0.0.1") && dns_host.contains("::1"),
        "{out}"
    );
    assert!(line(&other, "dns-host").contains("none"), "{other}");
    for ok in ["hs", "hs6", "hsudp", "lan"] {
        assert!(
            line(&out, ok).starts_with(&format!("{ok} ok")),
            "{ok} must connect:\n{out}"
        );
    }
    for refused in [
        "otherport",
        "otherloop",
        "otheraddr",
        "lanbefore",
        "lanport",
        "db",
    ] {
        assert!(
            line(&out, refused).starts_with(&format!("{refused} err 1 ")),
            "{refused} must be refused at connect():\n{out}"
        );
    }
    assert!(line(&out, "dns-lan").contains(LAN_IP), "{out}");
    assert!(line(&out, "dns-db").contains(DB_IP), "{out}");
    // The plain policy allows the name through the proxy only (no ports of its own).
    assert!(line(&other, "dns-lan2").contains(LAN_IP), "{other}");
    for refused in ["hs2", "lan2"] {
        assert!(
            line(&other, refused).starts_with(&format!("{refused} err 1 ")),
            "{refused}:\n{other}"
        );
    }
    // The lan entry's name through the proxy too (the proxy dials it: resolve_private).
    for arrived in ["hs", "hs6", "hsudp", "lan", "lanproxy"] {
        assert!(
            listeners.wait_for(&format!("{arrived}-{m}"), Duration::from_secs(3)),
            "{arrived} never arrived:\n{out}"
        );
    }
    for refused in [
        "otherport",
        "otherloop",
        "otheraddr",
        "lanbefore",
        "lanport",
        "db",
        "proxied",
        "hs2",
        "hs2udp",
        "lan2",
    ] {
        assert!(
            !listeners.saw(&format!("{refused}-{m}")),
            "{refused}: arrived at a listener"
        );
    }
    // The names were resolved by the agent's upstream, host.docker.internal never.
    assert!(dns.queries_for("gpu-box.lan") > 0, "{}", dns.log());
    assert_eq!(dns.queries_for("host.docker.internal"), 0, "{}", dns.log());
    assert_enforcement_intact("after local services");
}
