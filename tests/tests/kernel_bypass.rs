//! Bypass matrix (docs/threat-model.md items 1–5) for `deny_all` and an allowlist policy.
//!
//! Every case runs the probe twice: outside any enforced cgroup (the canary must see the
//! attempt's marker: proves the canary and the path work), then under `egress-agent exec` (the
//! canary must see nothing: no marker in any TCP/UDP payload or captured frame, no new TCP
//! accept, no SYN). Targets are a network namespace the test creates (veth, TEST-NET
//! 198.19.K.0/24 + 2001:db8:19:K::/64) and the host's loopback.
use std::time::Duration;

use egress_tests::agent::{TestConfig, probe_exec, probe_outside};
use egress_tests::canary::Canary;
use egress_tests::netns::Netns;
use egress_tests::{marker, root_or_skip};

const TCP: u16 = 7101;
const UDP: u16 = 7102;
const DNS: u16 = 53;
const QUIC: u16 = 443;
/// The only destination the allowlist policy allows directly (on `ns_v4_alt` / `ns_v6_alt`).
const ALLOWED: u16 = 7200;

/// One bypass attempt: probe arguments with `{M}` standing for the marker.
struct Case {
    name: &'static str,
    threat: u8,
    args: Vec<String>,
    /// TCP port whose accepts/SYNs must not increase when confined.
    tcp_port: Option<u16>,
    lo: bool,
}

fn case(name: &'static str, threat: u8, args: &[&str], tcp_port: Option<u16>) -> Case {
    Case {
        name,
        threat,
        args: args.iter().map(|s| s.to_string()).collect(),
        tcp_port,
        lo: false,
    }
}

fn matrix(ns: &Netns, lo: &Canary) -> Vec<Case> {
    let v4 = ns.ns_v4.to_string();
    let v6 = ns.ns_v6.to_string();
    let ll = ns.ns_v6_ll.to_string();
    let (tcp, udp, dns, quic) = (
        TCP.to_string(),
        UDP.to_string(),
        DNS.to_string(),
        QUIC.to_string(),
    );
    let (lo_tcp4, lo_tcp6) = (lo.tcp_ports[0].to_string(), lo.tcp_ports[1].to_string());
    let (lo_udp4, lo_udp6) = (lo.udp_ports[0].to_string(), lo.udp_ports[1].to_string());
    let mut cases = vec![
        // 1. direct connections by IP, v4 and v6.
        case("tcp-v4", 1, &["tcp", &v4, &tcp, "{M}"], Some(TCP)),
        case("tcp-v6", 1, &["tcp", &v6, &tcp, "{M}"], Some(TCP)),
        // 2. v4-mapped v6, dual stack, link-local, loopback.
        case(
            "tcp-v4-mapped",
            2,
            &["tcp-mapped", &v4, &tcp, "{M}"],
            Some(TCP),
        ),
        case(
            "tcp-v6-link-local",
            2,
            &["tcp-scoped", &ll, &ns.host_if, &tcp, "{M}"],
            Some(TCP),
        ),
        case("udp-v4-mapped", 2, &["udp-mapped", &v4, &udp, "{M}"], None),
        // 3. UDP: sendto, connected, DNS, QUIC port.
        case("udp-v4-sendto", 3, &["udp", &v4, &udp, "{M}"], None),
        case("udp-v6-sendto", 3, &["udp", &v6, &udp, "{M}"], None),
        case(
            "udp-v4-connected",
            3,
            &["udp-connected", &v4, &udp, "{M}"],
            None,
        ),
        case(
            "udp-v6-connected",
            3,
            &["udp-connected", &v6, &udp, "{M}"],
            None,
        ),
        case("udp-dns", 3, &["udp", &v4, &dns, "{M}"], None),
        case("udp-quic", 3, &["udp", &v6, &quic, "{M}"], None),
        // 4. raw sockets and AF_PACKET.
        case("raw-icmp", 4, &["icmp-raw", &v4, "{M}"], None),
        case("ping", 4, &["ping", &v4, "{M}"], None),
        case(
            "raw-tcp-syn",
            4,
            &["tcp-raw-syn", &v4, &tcp, "{M}"],
            Some(TCP),
        ),
        case("ip-hdrincl", 4, &["hdrincl", &v4, &udp, "{M}"], None),
        case(
            "af-packet",
            4,
            &["packet", &ns.host_if, &v4, &udp, "{M}"],
            None,
        ),
        // 5. TCP Fast Open, io_uring.
        case("tcp-fast-open", 5, &["tfo", &v4, &tcp, "{M}"], Some(TCP)),
        case(
            "io-uring-connect",
            5,
            &["uring-connect", &v4, &tcp, "{M}"],
            Some(TCP),
        ),
        case(
            "io-uring-sendmsg",
            5,
            &["uring-sendto", &v4, &udp, "{M}"],
            None,
        ),
    ];
    // 2. the host's own loopback (exec runs in the host network namespace).
    for (name, args) in [
        (
            "host-loopback-tcp-v4",
            vec!["tcp", "127.0.0.1", &lo_tcp4, "{M}"],
        ),
        ("host-loopback-tcp-v6", vec!["tcp", "::1", &lo_tcp6, "{M}"]),
        (
            "host-loopback-tcp-mapped",
            vec!["tcp-mapped", "127.0.0.1", &lo_tcp4, "{M}"],
        ),
        (
            "host-loopback-udp-v4",
            vec!["udp", "127.0.0.1", &lo_udp4, "{M}"],
        ),
        ("host-loopback-udp-v6", vec!["udp", "::1", &lo_udp6, "{M}"]),
        (
            "host-loopback-udp-connected",
            vec!["udp-connected", "127.0.0.1", &lo_udp4, "{M}"],
        ),
    ] {
        let mut c = case(name, 2, &args, None);
        c.lo = true;
        cases.push(c);
    }
    cases
}

fn args_with(c: &Case, m: &str) -> Vec<String> {
    c.args
        .iter()
        .map(|a| if a == "{M}" { m.to_owned() } else { a.clone() })
        .collect()
}

/// Run the whole matrix for `policy`; returns a report of failures (empty = all closed).
fn run_matrix(policy: &str, config: Option<&TestConfig>, extra: Vec<Case>) {
    let ns = Netns::new();
    let canary = Canary::in_netns(&ns, &[TCP, ALLOWED], &[UDP, DNS, QUIC, ALLOWED]);
    let lo = Canary::loopback();
    let mut cases = matrix(&ns, &lo);
    cases.extend(extra.into_iter().map(|mut c| {
        // Extra cases name their targets with placeholders for the namespace addresses.
        c.args = c
            .args
            .iter()
            .map(|a| match a.as_str() {
                "{ALT4}" => ns.ns_v4_alt.to_string(),
                "{ALT6}" => ns.ns_v6_alt.to_string(),
                "{IF}" => ns.host_if.clone(),
                _ => a.clone(),
            })
            .collect();
        c
    }));
    let mut failures = Vec::new();
    let mut checked = 0;
    for c in &cases {
        let target = if c.lo { &lo } else { &canary };
        // Outside: must arrive (proves the canary sees this kind of traffic).
        let m_out = marker(c.name);
        let out = probe_outside(
            &args_with(c, &m_out)
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        if !target.wait_for(&m_out, Duration::from_secs(3)) {
            if c.name == "ping" {
                eprintln!(
                    "note: {}: ping sockets disabled on this host (net.ipv4.ping_group_range), case not applicable",
                    c.name
                );
                continue;
            }
            failures.push(format!(
                "{}: canary did not see the unconfined attempt ({:?})",
                c.name, out
            ));
            continue;
        }
        // Let late parts of the unconfined attempt land (the capture can see the marker before
        // the listener has accepted), so they are not counted against the confined run.
        std::thread::sleep(Duration::from_millis(300));
        // Confined: nothing may arrive.
        let accepts_before = target.accepts();
        let syns_before = c.tcp_port.map(|p| target.syns_to(p)).unwrap_or(0);
        let m_in = marker(c.name);
        let cfg = config.map(|c| c.path.as_path());
        let res = probe_exec(
            policy,
            cfg,
            &args_with(c, &m_in)
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        std::thread::sleep(Duration::from_millis(400));
        let leaked = target.saw(&m_in);
        let new_accepts = target.accepts() - accepts_before;
        let new_syns = c.tcp_port.map(|p| target.syns_to(p)).unwrap_or(0) - syns_before;
        eprintln!(
            "[{policy}] threat {} {:<28} unconfined: arrived   confined: probe {}  arrived={} accepts+{} syns+{}",
            c.threat,
            c.name,
            res.stdout.lines().last().unwrap_or("?"),
            leaked,
            new_accepts,
            new_syns
        );
        if leaked || new_accepts > 0 || new_syns > 0 {
            failures.push(format!(
                "{}: BYPASS under {policy}: marker arrived={leaked}, new accepts={new_accepts}, new SYNs={new_syns}; probe: {:?}",
                c.name, res
            ));
        }
        assert!(
            !res.stderr.contains("egress-agent: error"),
            "{}: egress-agent exec failed: {}",
            c.name,
            res.stderr
        );
        checked += 1;
    }
    assert!(
        failures.is_empty(),
        "bypass matrix for {policy}:\n{}",
        failures.join("\n")
    );
    assert!(
        checked >= cases.len() - 1,
        "only {checked} of {} cases were checked",
        cases.len()
    );
}

fn allowlist_config() -> TestConfig {
    // The namespace's addresses are chosen at runtime inside 198.19.0.0/16 / 2001:db8:19::/48:
    // allow that range on port ALLOWED only; every matrix case uses other ports or protocols.
    TestConfig::new(&format!(
        "[policies.bypass-allowlist]\nmode = \"allowlist\"\nallow_hosts = [\"example.com\"]\nallow_ports = [443]\n\
         allow_cidrs = [{{ cidr = \"198.19.0.0/16\", ports = [{ALLOWED}] }}, {{ cidr = \"2001:db8:19::/48\", ports = [{ALLOWED}] }}]\n"
    ))
}

#[test]
fn bypass_matrix_deny_all() {
    if !root_or_skip("kernel bypass matrix (deny_all)") {
        return;
    }
    run_matrix("deny_all", None, Vec::new());
}

#[test]
fn bypass_matrix_allowlist() {
    if !root_or_skip("kernel bypass matrix (allowlist)") {
        return;
    }
    let cfg = allowlist_config();
    let allowed = ALLOWED.to_string();
    // Allowlist-specific: the allowed address on a port that is not allowed, and non-TCP/UDP
    // ways to the allowed address and port.
    let extra = vec![
        case(
            "allowed-addr-other-port-tcp",
            1,
            &["tcp", "{ALT4}", &TCP.to_string(), "{M}"],
            Some(TCP),
        ),
        case(
            "allowed-addr-other-port-udp",
            3,
            &["udp", "{ALT6}", &UDP.to_string(), "{M}"],
            None,
        ),
        case(
            "allowed-dst-raw-tcp-syn",
            4,
            &["tcp-raw-syn", "{ALT4}", &allowed, "{M}"],
            Some(ALLOWED),
        ),
        case(
            "allowed-dst-hdrincl",
            4,
            &["hdrincl", "{ALT4}", &allowed, "{M}"],
            None,
        ),
        case(
            "allowed-dst-af-packet",
            4,
            &["packet", "{IF}", "{ALT4}", &allowed, "{M}"],
            None,
        ),
        case(
            "allowed-dst-raw-icmp",
            4,
            &["icmp-raw", "{ALT4}", "{M}"],
            None,
        ),
    ];
    run_matrix("bypass-allowlist", Some(&cfg), extra);
}
