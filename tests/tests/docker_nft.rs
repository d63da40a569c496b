//! The nftables host layer against real packets, inside network namespaces this test creates
//! (the host's ruleset is never touched: checked at the end).
//!
//! Topology ("H" plays the Docker host):
//! ```text
//!   C1 (enforced) 198.18.1.2 ─ ev1 ┐
//!   C2 (unlabelled) 198.18.1.3 ─ ev2 ┴ ebr0 198.18.1.1 ── H ── eu0 198.18.2.1 ─ U 198.18.2.2
//!   H also holds the proxy address 169.254.100.1 (on egress0); U also 198.18.2.3
//! ```
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use egress_agent::nft::{self, DirectError, DirectSets, Endpoint, Enforced, ProxyPort, Ruleset};
use egress_policy::CidrRule;
use egress_tests::docker::{NetNs, require_root, sh};
use egress_tests::packet::{ethernet_ipv4_udp, packet_socket, send_frame};

const PROXY: Ipv4Addr = Ipv4Addr::new(169, 254, 100, 1);
const C1_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const C2_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 3];

struct Topo {
    h: NetNs,
    c1: NetNs,
    c2: NetNs,
    u: NetNs,
}

fn mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl Topo {
    fn new() -> Topo {
        let p = std::process::id();
        let t = Topo {
            h: NetNs::new(&format!("egd-h-{p}")),
            c1: NetNs::new(&format!("egd-c1-{p}")),
            c2: NetNs::new(&format!("egd-c2-{p}")),
            u: NetNs::new(&format!("egd-u-{p}")),
        };
        let h = &t.h.name;
        sh(&format!(
            "ip -n {h} link add ebr0 type bridge && ip -n {h} addr add 198.18.1.1/24 dev ebr0 && ip -n {h} link set ebr0 up \
             && ip -n {h} link add egress0 type bridge && ip -n {h} addr add {PROXY}/32 dev egress0 && ip -n {h} link set egress0 up \
             && ip netns exec {h} sysctl -qw net.ipv4.ip_forward=1"
        ));
        for (ns, veth, ip, m) in [
            (&t.c1, "ev1", "198.18.1.2", C1_MAC),
            (&t.c2, "ev2", "198.18.1.3", C2_MAC),
        ] {
            let c = &ns.name;
            sh(&format!(
                "ip -n {h} link add {veth} type veth peer name eth0 netns {c} \
                 && ip -n {h} link set {veth} master ebr0 up \
                 && ip -n {c} link set eth0 address {} && ip -n {c} addr add {ip}/24 dev eth0 \
                 && ip -n {c} link set eth0 up && ip -n {c} route add default via 198.18.1.1",
                mac(&m)
            ));
        }
        let u = &t.u.name;
        sh(&format!(
            "ip -n {h} link add eu0 type veth peer name eth0 netns {u} \
             && ip -n {h} addr add 198.18.2.1/24 dev eu0 && ip -n {h} link set eu0 up \
             && ip -n {u} addr add 198.18.2.2/24 dev eth0 && ip -n {u} link set eth0 up \
             && ip -n {u} route add default via 198.18.2.1"
        ));
        t
    }

    fn ruleset(&self, with_c1: bool) -> Ruleset {
        let mut r = Ruleset::new(PROXY);
        if with_c1 {
            r.containers.insert(
                "c1".repeat(32),
                Enforced {
                    listener: SocketAddrV4::new(PROXY, 4001),
                    redirects: vec![ProxyPort::Udp(4053), ProxyPort::Tcp(4054)],
                    allow_cidrs: vec![CidrRule {
                        net: "198.18.2.2/32".parse().expect("test value"),
                        ports: vec![80],
                    }],
                    allow_inbound: Vec::new(),
                    endpoints: vec![Endpoint {
                        bridge: "ebr0".into(),
                        veth: "ev1".into(),
                        mac: C1_MAC,
                        ipv4: Ipv4Addr::new(198, 18, 1, 2),
                        gateway: Some(Ipv4Addr::new(198, 18, 1, 1)),
                    }],
                    direct_ports: vec![2222],
                    host_ports: vec![11434],
                },
            );
        }
        r
    }

    fn apply(&self, r: &Ruleset) {
        self.apply_with(r, &DirectSets::new());
    }

    fn apply_with(&self, r: &Ruleset, direct: &DirectSets) {
        self.h.run(|| r.apply(direct)).expect("apply ruleset");
    }
}

/// A TCP server in `ns` answering "ok"; counts accepted connections.
fn tcp_server(ns: &NetNs, addr: &str) -> Arc<AtomicUsize> {
    let addr: SocketAddr = addr.parse().expect("test value");
    let l = ns
        .run(|| TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            n2.fetch_add(1, Ordering::SeqCst);
            let mut s = s;
            s.write_all(b"ok").ok();
        }
    });
    n
}

/// A UDP sink in `ns`; counts datagrams.
fn udp_sink(ns: &NetNs, addr: &str) -> Arc<AtomicUsize> {
    let addr: SocketAddr = addr.parse().expect("test value");
    let s = ns.run(|| UdpSocket::bind(addr)).expect("bind udp");
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while s.recv(&mut buf).is_ok() {
            n2.fetch_add(1, Ordering::SeqCst);
        }
    });
    n
}

/// Can `ns` open a TCP connection to `addr` and read "ok"?
fn reach(ns: &NetNs, addr: &str) -> bool {
    let addr: SocketAddr = addr.parse().expect("test value");
    ns.run(|| {
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(700)) else {
            return false;
        };
        s.set_read_timeout(Some(Duration::from_millis(700))).ok();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).is_ok() && &buf == b"ok"
    })
}

/// Send one hand-made Ethernet/IPv4/UDP frame with AF_PACKET from `ns`'s eth0: what the cgroup
/// hooks can't see.
fn send_raw_udp(ns: &NetNs, src_mac: [u8; 6], dst_mac: [u8; 6], src: Ipv4Addr, dst: SocketAddrV4) {
    let frame = ethernet_ipv4_udp(dst_mac, src_mac, src, *dst.ip(), dst.port(), b"exfiltrated");
    ns.run(|| {
        let eth0 = nix::net::if_::if_nametoindex("eth0").expect("ifindex");
        let fd = packet_socket().expect("AF_PACKET socket");
        for _ in 0..3 {
            let n = send_frame(fd.as_fd(), eth0, dst_mac, &frame).expect("sendto");
            assert_eq!(n, frame.len(), "short send");
        }
    });
}

fn bridge_mac(h: &NetNs) -> [u8; 6] {
    let s = h.sh(
        "cat /sys/class/net/ebr0/address 2>/dev/null || ip -br link show ebr0 | awk '{print $3}'",
    );
    // /sys in `ip netns exec` is remounted for the namespace, so this is ebr0 of H.
    let s = s.trim();
    let mut m = [0u8; 6];
    for (i, p) in s.split(':').enumerate() {
        m[i] = u8::from_str_radix(p, 16).expect("test value");
    }
    m
}

fn settle() {
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn host_layer_filters_real_packets() {
    if !require_root() {
        return;
    }
    let host_before = sh("nft list ruleset");
    let t = Topo::new();
    let own = tcp_server(&t.h, "169.254.100.1:4001");
    let _other = tcp_server(&t.h, "169.254.100.1:4002");
    let _host_port = tcp_server(&t.h, "198.18.1.1:2222");
    // A host service (allow_host_services = [{ port = 11434 }]) on every address of H.
    let host_service = tcp_server(&t.h, "0.0.0.0:11434");
    let host_service_udp = udp_sink(&t.h, "0.0.0.0:11434");
    let _u80 = tcp_server(&t.u, "198.18.2.2:80");
    let _u81 = tcp_server(&t.u, "198.18.2.2:81");
    let _c1_server = tcp_server(&t.c1, "198.18.1.2:8080");
    let udp = udp_sink(&t.u, "198.18.2.2:9999");
    let _transparent = tcp_server(&t.h, "169.254.100.1:4054");
    let dns = udp_sink(&t.h, "169.254.100.1:4053");
    let other_udp = udp_sink(&t.h, "169.254.100.1:4055");

    // Without rules everything is reachable (the topology works).
    for (ns, addr) in [
        (&t.c1, "169.254.100.1:4002"),
        (&t.c1, "198.18.1.1:2222"),
        (&t.c1, "198.18.2.2:81"),
    ] {
        assert!(reach(ns, addr), "baseline: {} -> {addr}", ns.name);
    }

    t.apply(&t.ruleset(true));
    // Applying twice is an atomic replace, not a duplicate.
    t.apply(&t.ruleset(true));
    let listing = t.h.sh("nft list tables");
    assert_eq!(listing.matches("egress_agent").count(), 2, "{listing}");
    eprintln!("{}", t.h.sh("nft list ruleset"));

    // (a) the proxy address: C1 only its own listener; C2 (unlabelled) nothing; loopback yes.
    assert!(
        reach(&t.c1, "169.254.100.1:4001"),
        "enforced container reaches its listener"
    );
    assert!(
        !reach(&t.c1, "169.254.100.1:4002"),
        "enforced container must not reach another policy's listener"
    );
    assert!(
        !reach(&t.c2, "169.254.100.1:4001"),
        "unlabelled container must not reach the proxy"
    );
    assert!(
        reach(&t.h, "169.254.100.1:4001"),
        "host loopback reaches the proxy"
    );
    // Its transparent listener (TCP) and DNS responder (UDP) too — nothing else on UDP.
    assert!(
        reach(&t.c1, "169.254.100.1:4054"),
        "enforced container reaches its transparent listener"
    );
    assert!(
        !reach(&t.c2, "169.254.100.1:4054"),
        "unlabelled container must not reach a transparent listener"
    );
    let send_udp = |ns: &NetNs, to: &str| {
        let to: SocketAddr = to.parse().expect("test value");
        ns.run(|| {
            let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
            for _ in 0..3 {
                s.send_to(b"query", to).ok();
            }
        });
    };
    send_udp(&t.c1, "169.254.100.1:4053");
    send_udp(&t.c1, "169.254.100.1:4055");
    send_udp(&t.c2, "169.254.100.1:4055");
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while dns.load(Ordering::SeqCst) < 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        dns.load(Ordering::SeqCst),
        3,
        "datagrams to its DNS port arrive"
    );
    settle();
    assert_eq!(
        other_udp.load(Ordering::SeqCst),
        0,
        "no other UDP port on the proxy address is reachable from containers"
    );
    assert!(
        !reach(&t.u, "169.254.100.1:4001"),
        "the LAN must not reach the proxy"
    );
    // (c) no other host port for C1; C2 unaffected.
    assert!(
        !reach(&t.c1, "198.18.1.1:2222"),
        "enforced container must not reach host ports"
    );
    // ... but its policy's host service, at its gateway only (TCP and UDP).
    assert!(
        reach(&t.c1, "198.18.1.1:11434"),
        "the host service at the gateway"
    );
    let served = host_service.load(Ordering::SeqCst);
    for elsewhere in ["198.18.2.1:11434", "169.254.100.1:11434"] {
        assert!(
            !reach(&t.c1, elsewhere),
            "the host service at another address of the host: {elsewhere}"
        );
    }
    send_udp(&t.c1, "198.18.1.1:11434");
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while host_service_udp.load(Ordering::SeqCst) < 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        host_service_udp.load(Ordering::SeqCst),
        3,
        "UDP to the host service"
    );
    send_udp(&t.c1, "198.18.2.1:11434");
    settle();
    assert_eq!(
        host_service.load(Ordering::SeqCst),
        served,
        "nothing arrived at the host service by another address"
    );
    assert_eq!(
        host_service_udp.load(Ordering::SeqCst),
        3,
        "no datagram arrived by another address"
    );
    assert!(reach(&t.c2, "198.18.1.1:2222"));
    // (b) forwarded: only allow_cidrs (198.18.2.2:80).
    assert!(reach(&t.c1, "198.18.2.2:80"), "allow_cidrs entry");
    assert!(!reach(&t.c1, "198.18.2.2:81"), "port outside allow_cidrs");
    assert!(
        reach(&t.c2, "198.18.2.2:81"),
        "unlabelled container unaffected"
    );
    // Inbound to the enforced container (published-port path) and its replies work.
    assert!(
        reach(&t.u, "198.18.1.2:8080"),
        "inbound connection + replies to an enforced container"
    );
    // Same bridge: C1 can't reach C2 (not in allow_cidrs); C2 -> C1 replies are dropped too.
    let _c2_server = tcp_server(&t.c2, "198.18.1.3:8081");
    assert!(
        !reach(&t.c1, "198.18.1.3:8081"),
        "container to container on the same bridge"
    );

    // AF_PACKET frames: own addresses, and spoofing the unlabelled neighbour. Nothing arrives.
    let br = bridge_mac(&t.h);
    let dst = SocketAddrV4::new(Ipv4Addr::new(198, 18, 2, 2), 9999);
    send_raw_udp(&t.c1, C1_MAC, br, Ipv4Addr::new(198, 18, 1, 2), dst);
    send_raw_udp(&t.c1, C2_MAC, br, Ipv4Addr::new(198, 18, 1, 3), dst);
    send_raw_udp(&t.c1, C1_MAC, br, Ipv4Addr::new(198, 18, 1, 3), dst);
    settle();
    assert_eq!(
        udp.load(Ordering::SeqCst),
        0,
        "raw frames from the enforced container arrived"
    );
    // Control: the same frame from the unlabelled container does arrive (the frame is valid).
    send_raw_udp(&t.c2, C2_MAC, br, Ipv4Addr::new(198, 18, 1, 3), dst);
    settle();
    assert!(
        udp.load(Ordering::SeqCst) > 0,
        "control frame from the unlabelled container did not arrive"
    );
    // A spoofed source address over a normal socket: dropped as well.
    let before = udp.load(Ordering::SeqCst);
    sh(&format!(
        "ip -n {} addr add 198.18.1.50/24 dev eth0",
        t.c1.name
    ));
    t.c1.run(|| {
        let s = UdpSocket::bind("198.18.1.50:0").expect("bind spoofed");
        for _ in 0..3 {
            s.send_to(b"x", "198.18.2.2:9999").ok();
        }
    });
    settle();
    assert_eq!(
        udp.load(Ordering::SeqCst),
        before,
        "spoofed source address arrived"
    );

    // The container leaves: its rules go, the proxy stays protected.
    t.apply(&t.ruleset(false));
    assert!(reach(&t.c1, "198.18.2.2:81"), "rules follow containers out");
    assert!(!reach(&t.c1, "169.254.100.1:4001"), "unenforced: no proxy");
    assert!(own.load(Ordering::SeqCst) >= 2);

    // Uninstall removes both tables.
    t.h.run(nft::cleanup).expect("cleanup");
    let listing = t.h.sh("nft list tables");
    assert!(!listing.contains("egress_agent"), "{listing}");
    t.h.run(nft::cleanup).expect("cleanup is idempotent");

    assert_eq!(
        sh("nft list ruleset"),
        host_before,
        "the host's ruleset changed"
    );
}

/// Direct ports in the host layer: C1's set for port 2222 lets it reach exactly the addresses an
/// answer put there, for the answer's TTL, across ruleset rebuilds; nothing else on that port,
/// no other port, and nothing once the container's rules are gone.
#[test]
fn direct_sets_follow_answers_and_expire() {
    if !require_root() {
        return;
    }
    let host_before = sh("nft list ruleset");
    let t = Topo::new();
    sh(&format!(
        "ip -n {} addr add 198.18.2.3/24 dev eth0",
        t.u.name
    ));
    let answered = tcp_server(&t.u, "198.18.2.2:2222");
    let other_addr = tcp_server(&t.u, "198.18.2.3:2222");
    let other_port = tcp_server(&t.u, "198.18.2.2:2223");
    let c1 = "c1".repeat(32);
    let direct = DirectSets::new();
    let allow = |addr: Ipv4Addr, port: u16, ttl: Duration| {
        t.h.run(|| direct.allow(&c1, port, &[addr], ttl))
    };
    // No set before the container's rules are written: refused, and nothing is opened.
    let e =
        allow(Ipv4Addr::new(198, 18, 2, 2), 2222, Duration::from_secs(30)).expect_err("no set yet");
    assert!(matches!(e, DirectError::NoSet { .. }), "{e}");
    t.apply_with(&t.ruleset(true), &direct);
    assert!(!reach(&t.c1, "198.18.2.2:2222"), "before any answer");
    assert!(
        matches!(
            allow(Ipv4Addr::new(198, 18, 2, 2), 2223, Duration::from_secs(30)),
            Err(DirectError::NoSet { port: 2223, .. })
        ),
        "a port the policy doesn't carry has no set"
    );

    allow(Ipv4Addr::new(198, 18, 2, 2), 2222, Duration::from_secs(30)).expect("allow");
    assert!(reach(&t.c1, "198.18.2.2:2222"), "the answered address");
    assert!(
        !reach(&t.c1, "198.18.2.3:2222"),
        "another address, same port"
    );
    assert!(
        !reach(&t.c1, "198.18.2.2:2223"),
        "the answered address, another port"
    );
    assert_eq!(
        other_addr.load(Ordering::SeqCst),
        0,
        "the unanswered address got nothing"
    );
    assert!(
        reach(&t.c2, "198.18.2.3:2222"),
        "the unlabelled neighbour is unaffected"
    );
    let listing = t.h.sh("nft list set inet egress_agent dc1c1c1c1c1c1p2222");
    assert!(
        listing.contains("198.18.2.2") && listing.contains("expires"),
        "the element carries its timeout: {listing}"
    );

    // A rebuild (another container came or went) keeps the live element, with its time left.
    t.apply_with(&t.ruleset(true), &direct);
    assert!(reach(&t.c1, "198.18.2.2:2222"), "kept across a rebuild");
    let listing = t.h.sh("nft list set inet egress_agent dc1c1c1c1c1c1p2222");
    assert!(
        listing.contains("198.18.2.2") && listing.contains("expires"),
        "{listing}"
    );

    // A shorter answer for an address held longer changes nothing; a new short one expires.
    allow(Ipv4Addr::new(198, 18, 2, 2), 2222, Duration::from_secs(1)).expect("allow again");
    allow(Ipv4Addr::new(198, 18, 2, 3), 2222, Duration::from_secs(2)).expect("allow .3");
    assert!(reach(&t.c1, "198.18.2.3:2222"), "the second answer");
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    while reach(&t.c1, "198.18.2.3:2222") {
        assert!(
            std::time::Instant::now() < deadline,
            "the element did not expire with its TTL"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let listing = t.h.sh("nft list set inet egress_agent dc1c1c1c1c1c1p2222");
    assert!(
        !listing.contains("198.18.2.3"),
        "expired element still listed: {listing}"
    );
    let after_expiry = other_addr.load(Ordering::SeqCst);
    assert!(!reach(&t.c1, "198.18.2.3:2222"));
    assert_eq!(
        other_addr.load(Ordering::SeqCst),
        after_expiry,
        "arrived after the TTL"
    );
    assert!(
        reach(&t.c1, "198.18.2.2:2222"),
        "the longer one is still there"
    );
    let arrived_other_port = other_port.load(Ordering::SeqCst);
    assert_eq!(
        arrived_other_port, 0,
        "nothing arrived on the port without a set"
    );

    // The container's rules go: its set with them, and no answer can open it again.
    t.apply_with(&t.ruleset(false), &direct);
    assert!(direct.addresses(&c1, 2222).is_empty());
    assert!(matches!(
        allow(Ipv4Addr::new(198, 18, 2, 2), 2222, Duration::from_secs(30)),
        Err(DirectError::NoSet { .. })
    ));
    assert!(answered.load(Ordering::SeqCst) >= 3);
    assert!(
        other_addr.load(Ordering::SeqCst) >= 2,
        "reached while allowed and by C2"
    );
    t.h.run(nft::cleanup).expect("cleanup");
    assert_eq!(
        sh("nft list ruleset"),
        host_before,
        "the host's ruleset changed"
    );
}
