//! The kernel mirror proven against the kernel (issue #21, item 4): `explain`'s evaluator
//! (`egress_policy::kernel_eval`) and the real programs must give every connection the same
//! verdict.
//!
//! A seeded generator (`EGRESS_DIFF_SEED=N` replays a run; the seed is printed) draws policies —
//! allowlists with `allow_cidrs` with and without ports, overlapping rules, `allow_hosts` entries
//! with direct ports, `resolve_private`, transparent on and off, audit, `deny_all`, `allow_all`,
//! with and without an IPv6 proxy endpoint — and, per policy, cases: TCP connect, UDP sendto and
//! connected UDP to IPv4, IPv6 and v4-mapped destinations on several ports, inside and outside
//! the CIDRs (addresses of a test namespace), the host's loopback (an unconfined canary, servers
//! of the confined process itself, Docker's 127.0.0.11, the unspecified addresses), port 53, the
//! proxy endpoint and the cgroup's own listeners. Each policy's cases run in one confined process
//! (`egress-probe batch` under `egress-agent exec`).
//!
//! Both sides are reduced to one verdict class ([`Class`]):
//! - predicted: `kernel_eval::connect` on the `KernelPolicy` compiled from the configuration
//!   with the listener addresses exec wrote (the test checks that this compilation is exactly the
//!   entry in the kernel's map); `SameTreeOnly` is resolved by whether the destination is one of
//!   the probe's own servers (else its `otherwise`);
//! - observed: EPERM → deny; connected to the destination itself, or a datagram sent, and the
//!   marker arrived at the canary (or the probe's own server) → direct; connected to another
//!   address → the cgroup's listener it is (proxy, transparent, DNS); a datagram answered by the
//!   DNS responder (from the server it was sent to) and seen by no canary → DNS.
//!
//! Every disagreement is printed (policy, case, predicted, observed) and fails the test.
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use egress_agent::bpf::PinnedState;
use egress_agent::config::Config;
use egress_common::PolicyEntry;
use egress_policy::kernel::{Endpoints, InterceptAddrs, KernelPolicy};
use egress_policy::kernel_eval::{self, KernelVerdict, Netns as Where, Transport};
use egress_tests::agent::{BPFFS, StopOnDrop, TestConfig, exec_cmd, exec_root, probe_bin};
use egress_tests::batch::{Case, Op, Outcome, SelfServers};
use egress_tests::canary::Canary;
use egress_tests::netns::Netns;
use egress_tests::{root_or_skip, sh};

/// Ports of the namespace's canary (TCP and UDP); 53 is redirected to the DNS responder.
const PORTS: [u16; 6] = [22, 53, 80, 443, 5432, 8080];
/// Ports `allow_ports` is drawn from (the transparent listener's).
const WEB_PORTS: [u16; 3] = [80, 443, 8080];
const DEFAULT_SEED: u64 = 0x2104_d1ff;
const POLICIES: usize = 14;
const CASES_PER_POLICY: usize = 44;

/// splitmix64: small, seedable, the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }

    /// 1..=max distinct elements of `from`, sorted.
    fn subset<T: Copy + Ord>(&mut self, from: &[T], max: usize) -> Vec<T> {
        let n = 1 + self.below(max.min(from.len()));
        let mut out = BTreeSet::new();
        while out.len() < n {
            out.insert(self.pick(from));
        }
        out.into_iter().collect()
    }
}

/// The verdict class both sides are reduced to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Class {
    /// Reached the destination itself.
    Direct,
    /// Rewritten to the cgroup's proxy listener.
    Proxy,
    /// Rewritten to the cgroup's transparent listener.
    Transparent,
    /// Rewritten to the cgroup's DNS responder.
    Dns,
    /// Refused (EPERM).
    Deny,
    /// Anything else that was seen (a protocol error, a lost datagram, ...).
    Other(String),
}

/// Everything the test set up: the namespace with its canary, the loopback canary.
struct World {
    ns: Netns,
    v4: Vec<Ipv4Addr>,
    v6: Vec<Ipv6Addr>,
    canary: Canary,
    lo: Canary,
}

impl World {
    fn new() -> World {
        let ns = Netns::new();
        let mut v4 = vec![ns.ns_v4, ns.ns_v4_alt];
        let mut v6 = vec![ns.ns_v6, ns.ns_v6_alt];
        let [a, b, c, _] = ns.ns_v4.octets();
        let s = ns.ns_v6.segments();
        for host in 4..=7u8 {
            let a4 = Ipv4Addr::new(a, b, c, host);
            let a6 = Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, u16::from(host));
            sh(&format!(
                "ip netns exec {} ip addr add {a4}/24 dev {}",
                ns.name, ns.ns_if
            ));
            sh(&format!(
                "ip netns exec {} ip -6 addr add {a6}/64 dev {} nodad",
                ns.name, ns.ns_if
            ));
            v4.push(a4);
            v6.push(a6);
        }
        let canary = Canary::in_netns(&ns, &PORTS, &PORTS);
        let lo = Canary::loopback();
        World {
            ns,
            v4,
            v6,
            canary,
            lo,
        }
    }
}

/// One generated policy.
struct Generated {
    index: usize,
    name: String,
    toml: String,
    /// Run under the configuration with an IPv6 proxy endpoint.
    v6_endpoint: bool,
}

fn cidr4(rng: &mut Rng, w: &World) -> String {
    let prefix = rng.pick(&[32u8, 32, 31, 30, 29, 24]);
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
    let net = Ipv4Addr::from(u32::from(rng.pick(&w.v4)) & mask);
    format!("{net}/{prefix}")
}

fn cidr6(rng: &mut Rng, w: &World) -> String {
    let prefix = rng.pick(&[128u8, 128, 127, 126, 125, 64]);
    let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
    let net = Ipv6Addr::from(u128::from(rng.pick(&w.v6)) & mask);
    format!("{net}/{prefix}")
}

fn allow_cidrs(rng: &mut Rng, w: &World) -> String {
    let n = rng.below(5);
    let rules: Vec<String> = (0..n)
        .map(|_| {
            let net = if rng.chance(60) {
                cidr4(rng, w)
            } else {
                cidr6(rng, w)
            };
            if rng.chance(45) {
                format!("\"{net}\"")
            } else {
                let ports: Vec<String> = rng.subset(&PORTS, 3).iter().map(u16::to_string).collect();
                format!("{{ cidr = \"{net}\", ports = [{}] }}", ports.join(", "))
            }
        })
        .collect();
    format!("allow_cidrs = [{}]\n", rules.join(", "))
}

/// Policy `i`: the first ones cover each kind at least once, the rest are drawn.
fn policy(rng: &mut Rng, i: usize, w: &World) -> Generated {
    let kind = if i < 7 { i } else { 7 + rng.below(3) };
    let mut t = String::new();
    match kind {
        0 => t.push_str("mode = \"allow_all\"\n"),
        1 => {
            t.push_str("mode = \"deny_all\"\n");
            t.push_str(&allow_cidrs(rng, w));
        }
        _ => {
            t.push_str("mode = \"allowlist\"\n");
            let direct = kind == 3 || rng.chance(30);
            let port = rng.pick(&[22u16, 5432, 8080]);
            if direct {
                t.push_str(&format!(
                    "allow_hosts = [\"example.com\", {{ host = \"git.example\", ports = [{port}] }}]\n"
                ));
            } else {
                t.push_str("allow_hosts = [\"example.com\"]\n");
            }
            if kind == 2 || (kind >= 7 && rng.chance(25)) {
                t.push_str("enforce = \"audit\"\n");
            }
            if kind == 4 || (kind >= 7 && rng.chance(25)) {
                t.push_str("resolve_private = [\"198.19.0.0/16\", \"2001:db8::/32\"]\n");
            }
            if kind == 5 || (kind >= 7 && rng.chance(30)) {
                t.push_str("transparent = false\n");
            } else if rng.chance(30) {
                t.push_str("transparent = true\n");
            }
            if rng.chance(70) {
                let ports: Vec<String> = rng
                    .subset(&WEB_PORTS, 3)
                    .iter()
                    .map(u16::to_string)
                    .collect();
                t.push_str(&format!("allow_ports = [{}]\n", ports.join(", ")));
            }
            if kind != 6 {
                t.push_str(&allow_cidrs(rng, w));
            }
        }
    }
    Generated {
        index: i,
        name: format!("diff-{i}"),
        toml: t,
        v6_endpoint: rng.chance(50),
    }
}

/// The listener addresses of a cgroup, from its policy entry.
#[derive(Debug, Clone, Copy, Default)]
struct Listeners {
    endpoints: Endpoints,
}

fn v4(addr: u32, port: u16) -> Option<SocketAddr> {
    (port != 0).then(|| SocketAddr::new(IpAddr::from(addr.to_ne_bytes()), u16::from_be(port)))
}

fn v6(words: [u32; 4], port: u16) -> Option<SocketAddr> {
    (port != 0).then(|| {
        let mut o = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        SocketAddr::new(IpAddr::from(o), u16::from_be(port))
    })
}

impl Listeners {
    fn of(e: &PolicyEntry) -> Listeners {
        Listeners {
            endpoints: Endpoints {
                endpoint4: v4(e.endpoint4_addr, e.endpoint4_port),
                listener4: v4(e.listener4_addr, e.listener4_port),
                endpoint6: v6(e.endpoint6_addr, e.endpoint6_port),
                listener6: v6(e.listener6_addr, e.listener6_port),
                intercept4: InterceptAddrs {
                    transparent: v4(e.transparent4_addr, e.transparent4_port),
                    dns_udp: v4(e.dns_udp4_addr, e.dns_udp4_port),
                    dns_tcp: v4(e.dns_tcp4_addr, e.dns_tcp4_port),
                },
                intercept6: InterceptAddrs {
                    transparent: v6(e.transparent6_addr, e.transparent6_port),
                    dns_udp: v6(e.dns_udp6_addr, e.dns_udp6_port),
                    dns_tcp: v6(e.dns_tcp6_addr, e.dns_tcp6_port),
                },
            },
        }
    }

    /// Which of the cgroup's listeners `addr` is.
    fn class_of(&self, addr: SocketAddr) -> Class {
        let a = Some(unmapped(addr));
        let e = &self.endpoints;
        if a == e.listener4 || a == e.listener6 {
            Class::Proxy
        } else if a == e.intercept4.transparent || a == e.intercept6.transparent {
            Class::Transparent
        } else if [
            e.intercept4.dns_udp,
            e.intercept4.dns_tcp,
            e.intercept6.dns_udp,
            e.intercept6.dns_tcp,
        ]
        .contains(&a)
        {
            Class::Dns
        } else {
            Class::Other(format!(
                "rewritten to {addr}, none of the cgroup's listeners"
            ))
        }
    }
}

fn unmapped(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// Is `peer` the destination the case connected to? (connect() to the unspecified address
/// reaches the host's loopback.)
fn same_dest(peer: SocketAddr, dst: SocketAddr) -> bool {
    let (p, d) = (unmapped(peer), unmapped(dst));
    p == d || (d.ip().is_unspecified() && p.ip().is_loopback() && p.port() == d.port())
}

fn mapped(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        IpAddr::V6(_) => a,
    }
}

/// Where a case's payload would be seen if it went straight to its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Observer {
    Namespace,
    Loopback,
    OwnServer,
    /// Nothing records it (the endpoint, a listener, 127.0.0.11, ...).
    Nobody,
}

struct Run<'a> {
    w: &'a World,
    own: SelfServers,
    listeners: Listeners,
    ep4: SocketAddr,
    ep6: Option<SocketAddr>,
}

impl Run<'_> {
    fn own_server(&self, case: &Case) -> bool {
        let d = unmapped(case.dst);
        if case.op.is_tcp() {
            d == self.own.tcp4 || d == self.own.tcp6
        } else {
            d == self.own.udp4 || d == self.own.udp6
        }
    }

    fn observer(&self, case: &Case) -> Observer {
        let d = unmapped(case.dst);
        let (lo4, lo6) = if case.op.is_tcp() {
            (self.w.lo.tcp_ports[0], self.w.lo.tcp_ports[1])
        } else {
            (self.w.lo.udp_ports[0], self.w.lo.udp_ports[1])
        };
        match d.ip() {
            _ if self.own_server(case) => Observer::OwnServer,
            IpAddr::V4(a) if self.w.v4.contains(&a) => Observer::Namespace,
            IpAddr::V6(a) if self.w.v6.contains(&a) => Observer::Namespace,
            IpAddr::V4(a)
                if (a == Ipv4Addr::LOCALHOST || a.is_unspecified()) && d.port() == lo4 =>
            {
                Observer::Loopback
            }
            IpAddr::V6(a)
                if (a == Ipv6Addr::LOCALHOST || a.is_unspecified()) && d.port() == lo6 =>
            {
                Observer::Loopback
            }
            _ => Observer::Nobody,
        }
    }

    /// Draw one case.
    fn case(&self, rng: &mut Rng, id: usize, m: &str) -> Case {
        let op = rng.pick(&[Op::Tcp, Op::Tcp, Op::Udp, Op::UdpConnected]);
        let w = self.w;
        let (lo4, lo6) = if op.is_tcp() {
            (w.lo.tcp_ports[0], w.lo.tcp_ports[1])
        } else {
            (w.lo.udp_ports[0], w.lo.udp_ports[1])
        };
        let (own4, own6) = if op.is_tcp() {
            (self.own.tcp4, self.own.tcp6)
        } else {
            (self.own.udp4, self.own.udp6)
        };
        let sa = |ip: IpAddr, port: u16| SocketAddr::new(ip, port);
        let roll = rng.below(100);
        let dst = if roll < 55 {
            let port = rng.pick(&PORTS);
            match rng.below(3) {
                0 => sa(IpAddr::V4(rng.pick(&w.v4)), port),
                1 => sa(IpAddr::V6(rng.pick(&w.v6)), port),
                _ => mapped(sa(IpAddr::V4(rng.pick(&w.v4)), port)),
            }
        } else if roll < 63 {
            match rng.below(7) {
                // Nothing listens there: a transparent port of the host's loopback.
                5 => sa(Ipv4Addr::LOCALHOST.into(), rng.pick(&WEB_PORTS)),
                6 => sa(Ipv6Addr::LOCALHOST.into(), rng.pick(&WEB_PORTS)),
                0 => sa(Ipv4Addr::LOCALHOST.into(), lo4),
                1 => sa(Ipv6Addr::LOCALHOST.into(), lo6),
                2 => mapped(sa(Ipv4Addr::LOCALHOST.into(), lo4)),
                3 => sa(Ipv4Addr::UNSPECIFIED.into(), lo4),
                _ => sa(Ipv6Addr::UNSPECIFIED.into(), lo6),
            }
        } else if roll < 73 {
            match rng.below(3) {
                0 => own4,
                1 => own6,
                _ => mapped(own4),
            }
        } else if roll < 81 {
            let docker: IpAddr = Ipv4Addr::new(127, 0, 0, 11).into();
            match rng.below(6) {
                0 => sa(docker, 53),
                1 => sa(docker, lo4),
                2 => sa(Ipv4Addr::LOCALHOST.into(), 53),
                3 => sa(Ipv6Addr::LOCALHOST.into(), 53),
                4 => mapped(sa(docker, 53)),
                _ => sa(Ipv4Addr::new(127, 0, 0, 53).into(), 53),
            }
        } else {
            let e = &self.listeners.endpoints;
            let choices: Vec<SocketAddr> = [
                Some(self.ep4),
                Some(mapped(self.ep4)),
                self.ep6,
                e.listener4,
                e.listener6,
                e.intercept4.transparent,
                e.intercept4.dns_udp,
                e.intercept4.dns_tcp,
                e.intercept6.transparent,
            ]
            .into_iter()
            .flatten()
            .collect();
            rng.pick(&choices)
        };
        Case {
            id,
            op,
            dst,
            marker: m.to_owned(),
        }
    }

    /// The mirror's verdict, reduced to a class.
    fn predict(&self, kp: &KernelPolicy, case: &Case) -> (Class, KernelVerdict) {
        let t = if case.op.is_tcp() {
            Transport::Tcp
        } else {
            Transport::Udp
        };
        let v = kernel_eval::connect(kp, case.dst, t, Where::Host);
        let class = self.reduce(&v, case);
        (class, v)
    }

    fn reduce(&self, v: &KernelVerdict, case: &Case) -> Class {
        match v {
            KernelVerdict::Allow { .. } | KernelVerdict::WouldDeny { .. } => Class::Direct,
            KernelVerdict::SameTreeOnly { .. } if self.own_server(case) => Class::Direct,
            KernelVerdict::SameTreeOnly { otherwise, .. } => self.reduce(otherwise, case),
            KernelVerdict::Deny { .. } => Class::Deny,
            KernelVerdict::Redirect { rule } => rule
                .split_whitespace()
                .find_map(|w| w.trim_end_matches([',', ')']).parse::<SocketAddr>().ok())
                .map_or_else(
                    || Class::Other(format!("redirect without an address: {rule}")),
                    |a| self.listeners.class_of(a),
                ),
        }
    }

    /// What the kernel did, from the probe's outcome and the canaries.
    fn observe(&self, case: &Case, out: &Outcome, own_rx: &[String]) -> Class {
        let m = case.marker.as_str();
        let seen_by = |o: Observer| match o {
            Observer::Namespace => self.w.canary.saw(m),
            Observer::Loopback => self.w.lo.saw(m),
            Observer::OwnServer => own_rx.iter().any(|r| r.contains(m)),
            Observer::Nobody => false,
        };
        let anywhere = || {
            seen_by(Observer::Namespace)
                || seen_by(Observer::Loopback)
                || seen_by(Observer::OwnServer)
        };
        let observer = self.observer(case);
        let dns_answer = |from: &Option<SocketAddr>| match from {
            Some(f) if unmapped(*f) == unmapped(case.dst) => Class::Dns,
            Some(f) => Class::Other(format!("a DNS answer from {f}, not from the server asked")),
            None => Class::Other("sent; nothing arrived and no DNS answer".to_owned()),
        };
        match out {
            Outcome::Failed(libc::EPERM) => Class::Deny,
            // Let through to a destination where nothing listens (the endpoint itself, ...).
            Outcome::Failed(libc::ECONNREFUSED) if observer == Observer::Nobody => Class::Direct,
            Outcome::Failed(e) => {
                Class::Other(format!("failed: {}", std::io::Error::from_raw_os_error(*e)))
            }
            Outcome::Connected {
                peer, send_errno, ..
            } if same_dest(*peer, case.dst) => match (send_errno, observer) {
                (Some(e), _) => Class::Other(format!(
                    "connected directly, then send failed: {}",
                    std::io::Error::from_raw_os_error(*e)
                )),
                (None, Observer::Nobody) => Class::Direct,
                (None, o) if seen_by(o) => Class::Direct,
                (None, _) => Class::Other("connected directly; nothing arrived".to_owned()),
            },
            Outcome::Connected {
                peer,
                send_errno,
                reply_from,
            } => {
                if anywhere() {
                    return Class::Other(format!(
                        "rewritten to {peer}, yet the payload arrived at a canary"
                    ));
                }
                let class = self.listeners.class_of(*peer);
                match (class, case.op, send_errno) {
                    (_, _, Some(e)) => Class::Other(format!(
                        "rewritten to {peer}, then send failed: {}",
                        std::io::Error::from_raw_os_error(*e)
                    )),
                    (Class::Dns, Op::UdpConnected, None) => dns_answer(reply_from),
                    (c, _, None) => c,
                }
            }
            Outcome::Sent { reply_from } => {
                if observer != Observer::Nobody && seen_by(observer) {
                    Class::Direct
                } else if anywhere() {
                    Class::Other("sent; arrived somewhere else".to_owned())
                } else if reply_from.is_some() {
                    dns_answer(reply_from)
                } else if observer == Observer::Nobody {
                    // Nothing records it and nothing answered: it went out (a refusal would
                    // have been EPERM, the DNS responder would have answered).
                    Class::Direct
                } else {
                    Class::Other("sent; nothing arrived".to_owned())
                }
            }
        }
    }
}

/// Wait for `path`'s `exec-<pid>-*` cgroup; its id (the inode).
fn exec_cgroup(pid: u32) -> u64 {
    let prefix = format!("exec-{pid}-");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = std::fs::read_dir(exec_root())
            .expect("exec root")
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with(&prefix));
        if let Some(e) = found {
            return std::os::unix::fs::MetadataExt::ino(&e.metadata().expect("cgroup metadata"));
        }
        assert!(Instant::now() < deadline, "no cgroup for exec {pid}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Disagreement {
    policy: String,
    case: String,
    predicted: String,
    observed: String,
}

/// Run one policy's cases; returns (cases run, disagreements).
fn run_policy(
    rng: &mut Rng,
    w: &World,
    g: &Generated,
    cfg: &TestConfig,
    seed: u64,
) -> (usize, Vec<Disagreement>) {
    let config = Config::load(&cfg.path).expect("the generated configuration loads");
    let policy = config.policy(&g.name).expect("generated policy").clone();
    let mut child = StopOnDrop(
        exec_cmd(&g.name, Some(&cfg.path))
            .arg(probe_bin())
            .arg("batch")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("exec the probe"),
    );
    let mut stderr = child.0.stderr.take().expect("stderr");
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        stderr.read_to_string(&mut s).ok();
        s
    });
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    let Some(own) = SelfServers::parse(&first) else {
        drop(child);
        panic!(
            "{}: the probe did not start ({first:?}): {}",
            g.name,
            errs.join().unwrap_or_default()
        );
    };
    let id = exec_cgroup(child.0.id());
    let entry = PinnedState::open(Path::new(BPFFS))
        .expect("open the pinned maps")
        .policy(id)
        .expect("read the entry")
        .expect("exec wrote an entry before starting the command");
    let listeners = Listeners::of(&entry);
    let kp = KernelPolicy::compile(&policy, listeners.endpoints, &[]).expect("compiles");
    assert_eq!(
        kp.entry(entry.rules_id),
        entry,
        "{}: the mirror's input is not what exec wrote into the kernel's map",
        g.name
    );
    let run = Run {
        w,
        own,
        listeners,
        ep4: config.proxy.endpoint,
        ep6: config.proxy.endpoint_v6,
    };
    let cases: Vec<Case> = (0..CASES_PER_POLICY)
        .map(|i| {
            let m = format!("EGD{seed:x}p{}c{i}e", g.index);
            run.case(rng, i, &m)
        })
        .collect();
    {
        let mut stdin = child.0.stdin.take().expect("stdin");
        for c in &cases {
            writeln!(stdin, "{}", c.line()).expect("write a case");
        }
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; cases.len()];
    let mut own_rx = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("probe output");
        if let Some(rest) = line.strip_prefix("res ") {
            let (id, out) = rest.split_once(' ').expect("res ID OUTCOME");
            let id: usize = id.parse().expect("case id");
            outcomes[id] = Some(Outcome::parse(out).expect("an outcome"));
        } else if let Some(p) = line.strip_prefix("selfrx ") {
            own_rx.push(p.to_owned());
        } else if line == "done" {
            break;
        }
    }
    let status = child.0.wait().expect("wait for exec");
    let errs = errs.join().unwrap_or_default();
    assert!(
        status.success(),
        "{}: exec failed ({status}): {errs}",
        g.name
    );
    // Give the canaries a moment for what went straight out.
    let deadline = Instant::now() + Duration::from_millis(1500);
    for (c, o) in cases.iter().zip(&outcomes) {
        let delivered = matches!(o, Some(Outcome::Sent { .. }))
            || matches!(o, Some(Outcome::Connected { peer, send_errno: None, .. }) if same_dest(*peer, c.dst));
        if delivered {
            let left = deadline.saturating_duration_since(Instant::now());
            match run.observer(c) {
                Observer::Namespace => {
                    w.canary.wait_for(&c.marker, left);
                }
                Observer::Loopback => {
                    w.lo.wait_for(&c.marker, left);
                }
                Observer::OwnServer | Observer::Nobody => {}
            }
        }
    }
    let mut bad = Vec::new();
    for (c, o) in cases.iter().zip(&outcomes) {
        let (predicted, verdict) = run.predict(&kp, c);
        let observed = match o {
            Some(o) => run.observe(c, o, &own_rx),
            None => Class::Other("no outcome reported".to_owned()),
        };
        if predicted != observed {
            bad.push(Disagreement {
                policy: g.name.clone(),
                case: format!("{} {}", c.op.as_str(), c.dst),
                predicted: format!("{predicted:?} ({verdict:?})"),
                observed: format!("{observed:?} ({o:?})"),
            });
        }
    }
    (cases.len(), bad)
}

#[test]
fn kernel_mirror_agrees_with_the_kernel() {
    if !root_or_skip("kernel differential") {
        return;
    }
    let started = Instant::now();
    let seed = std::env::var("EGRESS_DIFF_SEED")
        .ok()
        .map(|s| {
            let s = s.trim();
            s.strip_prefix("0x")
                .map_or_else(|| s.parse(), |h| u64::from_str_radix(h, 16))
                .expect("EGRESS_DIFF_SEED: a number")
        })
        .unwrap_or(DEFAULT_SEED);
    eprintln!("kernel differential: seed {seed:#x} (EGRESS_DIFF_SEED={seed:#x} replays this run)");
    let mut rng = Rng(seed);
    let w = World::new();
    let generated: Vec<Generated> = (0..POLICIES).map(|i| policy(&mut rng, i, &w)).collect();
    let tables: String = generated
        .iter()
        .map(|g| format!("[policies.{}]\n{}\n", g.name, g.toml))
        .collect();
    // No upstream resolver (hosts file only): the agent's DNS sends nothing out of the host.
    let common = format!("[dns]\nnameservers = []\n\n[store]\nenabled = false\n\n{tables}");
    let ep6 = std::net::TcpListener::bind("[::1]:0")
        .and_then(|l| l.local_addr())
        .expect("IPv6 loopback")
        .port();
    let with_v6 = TestConfig::new(&format!("endpoint_v6 = \"[::1]:{ep6}\"\n\n{common}"));
    let without_v6 = TestConfig::new(&common);
    let mut total = 0;
    let mut disagreements = Vec::new();
    for g in &generated {
        let cfg = if g.v6_endpoint { &with_v6 } else { &without_v6 };
        let t = Instant::now();
        let (n, bad) = run_policy(&mut rng, &w, g, cfg, seed);
        eprintln!(
            "[{}] {n} cases, {} disagreements, {:.1} s{}: {}",
            g.name,
            bad.len(),
            t.elapsed().as_secs_f64(),
            if g.v6_endpoint { ", IPv6 endpoint" } else { "" },
            g.toml.trim().replace('\n', "; ")
        );
        total += n;
        disagreements.extend(bad);
    }
    if !disagreements.is_empty() {
        eprintln!(
            "\ndisagreements (policy | case | predicted by the mirror | observed in the kernel):"
        );
        for d in &disagreements {
            eprintln!(
                "  {} | {} | {} | {}",
                d.policy, d.case, d.predicted, d.observed
            );
        }
    }
    eprintln!(
        "kernel differential: {total} cases, {} policies, {} disagreements ({:.1} s, seed {seed:#x}, namespace {})",
        generated.len(),
        disagreements.len(),
        started.elapsed().as_secs_f64(),
        w.ns.name
    );
    assert!(
        disagreements.is_empty(),
        "the kernel mirror and the kernel disagree on {} of {total} cases (seed {seed:#x})",
        disagreements.len()
    );
}
