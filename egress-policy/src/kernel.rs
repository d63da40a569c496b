//! Kernel compilation of a policy: [`KernelPolicy`] is what one cgroup's [`PolicyEntry`] and its
//! CIDR rules encode, and how they are encoded (network byte order, as `struct bpf_sock_addr`
//! presents addresses). `bpf::state` writes the result into the pinned maps.
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use egress_common::{
    CIDR_ALLOW, CidrRule, MAX_RULE_PORTS, MODE_ALLOW_ALL, MODE_ALLOWLIST, MODE_DENY_ALL,
    POLICY_FLAG_AUDIT, POLICY_FLAG_DNS, POLICY_FLAG_TRANSPARENT, POLICY_FLAG_V6, PROTO_BIT_TCP,
    PROTO_BIT_UDP, PolicyEntry,
};
use ipnet::IpNet;

use super::model::{self, ALLOW_ALL, DENY_ALL, Mode};

/// Where a workload in the host's network namespace (`exec`, `--network host`) reaches its
/// own host: loopback, both families (its `allow_host_services` open there).
pub const HOST_NETNS_HOST: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::LOCALHOST),
    IpAddr::V6(Ipv6Addr::LOCALHOST),
];

/// A policy the kernel maps can't express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy can't be written to the kernel: {0}")]
pub struct KernelPolicyError(pub String);

/// The proxy addresses of one cgroup: the stable endpoint(s) confined processes connect to and
/// the listener(s) the kernel rewrites them to. `listener*: None` = no proxy for this cgroup:
/// connections to the endpoint are refused (fail closed). `intercept*`: the listener's
/// interception sockets (default: none, so redirected traffic stays refused).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Endpoints {
    pub endpoint4: Option<SocketAddr>,
    pub listener4: Option<SocketAddr>,
    pub endpoint6: Option<SocketAddr>,
    pub listener6: Option<SocketAddr>,
    pub intercept4: InterceptAddrs,
    pub intercept6: InterceptAddrs,
}

/// The interception sockets of one listener (all on the proxy listen IP, kernel-chosen ports);
/// `None` where the policy gets no such socket. The kernel sends TCP on `allow_ports` that no
/// rule allows to `transparent`, UDP to port 53 to `dns_udp`, TCP to port 53 to `dns_tcp`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InterceptAddrs {
    /// Transparent TCP (redirected connections on `allow_ports`).
    pub transparent: Option<SocketAddr>,
    /// DNS over UDP (redirected port-53 datagrams).
    pub dns_udp: Option<SocketAddr>,
    /// DNS over TCP (redirected port-53 connections).
    pub dns_tcp: Option<SocketAddr>,
}

impl InterceptAddrs {
    /// Every address that is set.
    pub fn all(&self) -> impl Iterator<Item = SocketAddr> {
        [self.transparent, self.dns_udp, self.dns_tcp]
            .into_iter()
            .flatten()
    }
}

/// The kernel's view of one policy for one cgroup: what [`PolicyEntry`] + CIDR rules encode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelPolicy {
    /// `MODE_*`.
    pub mode: u32,
    pub endpoint4: Option<SocketAddr>,
    pub listener4: Option<SocketAddr>,
    pub endpoint6: Option<SocketAddr>,
    pub listener6: Option<SocketAddr>,
    /// Direct allows: network, ports (empty = all), TCP and UDP.
    pub allow: Vec<(IpNet, Vec<u16>)>,
    /// Inbound allows: peer network, local ports (empty = all), TCP.
    pub inbound: Vec<(IpNet, Vec<u16>)>,
    /// What the policy refuses is only reported (`enforce = "audit"`, allowlist).
    pub audit: bool,
    /// TCP to `redirect_ports` goes to `intercept*.transparent` ([`model::Policy::transparent`]).
    pub transparent: bool,
    /// Port 53 goes to `intercept*.dns_*` ([`model::Policy::answers_dns`]).
    pub dns: bool,
    /// `allow_ports` (sorted, at most [`MAX_RULE_PORTS`]) when `transparent`.
    pub redirect_ports: Vec<u16>,
    pub intercept4: InterceptAddrs,
    pub intercept6: InterceptAddrs,
}

/// `(network, ports)` checked against the kernel map's per-rule port limit.
fn fits(what: &str, net: &IpNet, ports: &[u16]) -> Result<(IpNet, Vec<u16>), KernelPolicyError> {
    if ports.len() > MAX_RULE_PORTS {
        return Err(KernelPolicyError(format!(
            "{what} {net}: at most {MAX_RULE_PORTS} ports per rule in the kernel map"
        )));
    }
    Ok((net.trunc(), ports.to_vec()))
}

/// Who may connect in, as (peer network, local ports; empty = all): `allow_inbound`, the
/// `allow_cidrs` entries without ports (a network trusted on every port is trusted both ways),
/// and — if the policy allows it — the published ports from anywhere. The kernel's inbound rules
/// and the nftables host layer are both built from this.
pub fn inbound_allows(
    policy: &model::Policy,
    published: &[u16],
) -> Result<Vec<(IpNet, Vec<u16>)>, KernelPolicyError> {
    if policy.mode == Mode::AllowAll {
        return Ok(Vec::new());
    }
    let mut inbound = Vec::new();
    for rule in policy.allow_cidrs.iter().filter(|r| r.ports.is_empty()) {
        inbound.push((rule.net.trunc(), Vec::new()));
    }
    for rule in &policy.allow_inbound {
        inbound.push(fits("allow_inbound", &rule.net, &rule.ports)?);
    }
    if policy.allow_published_ports && !published.is_empty() {
        let mut ports = published.to_vec();
        ports.sort_unstable();
        ports.dedup();
        for any in [
            IpNet::V4(ipnet::Ipv4Net::default()),
            IpNet::V6(ipnet::Ipv6Net::default()),
        ] {
            inbound.push(fits("published ports", &any, &ports)?);
        }
    }
    Ok(inbound)
}

impl KernelPolicy {
    /// Compile a configured policy for one cgroup: its proxy addresses, and the TCP ports the
    /// operator published for it (Docker `-p`; open to every peer if the policy allows that).
    pub fn compile(
        policy: &model::Policy,
        endpoints: Endpoints,
        published: &[u16],
    ) -> Result<KernelPolicy, KernelPolicyError> {
        let Endpoints {
            endpoint4,
            listener4,
            endpoint6,
            listener6,
            intercept4,
            intercept6,
        } = endpoints;
        let mode = match policy.mode {
            Mode::AllowAll => MODE_ALLOW_ALL,
            Mode::DenyAll => MODE_DENY_ALL,
            Mode::Allowlist => MODE_ALLOWLIST,
        };
        let [t4, u4, d4] = [
            intercept4.transparent,
            intercept4.dns_udp,
            intercept4.dns_tcp,
        ];
        let [t6, u6, d6] = [
            intercept6.transparent,
            intercept6.dns_udp,
            intercept6.dns_tcp,
        ];
        for (what, a) in [
            ("endpoint", endpoint4),
            ("listener", listener4),
            ("transparent listener", t4),
            ("DNS listener", u4),
            ("DNS listener", d4),
        ] {
            if matches!(a, Some(SocketAddr::V6(_))) {
                return Err(KernelPolicyError(format!(
                    "IPv4 {what} expected, got {a:?}"
                )));
            }
        }
        for (what, a) in [
            ("endpoint_v6", endpoint6),
            ("listener_v6", listener6),
            ("transparent listener", t6),
            ("DNS listener", u6),
            ("DNS listener", d6),
        ] {
            if matches!(a, Some(SocketAddr::V4(_))) {
                return Err(KernelPolicyError(format!(
                    "IPv6 {what} expected, got {a:?}"
                )));
            }
        }
        let mut allow = Vec::new();
        for rule in &policy.allow_cidrs {
            allow.push(fits("allow_cidrs", &rule.net, &rule.ports)?);
        }
        let inbound = inbound_allows(policy, published)?;
        let transparent = policy.transparent();
        let mut redirect_ports = Vec::new();
        if transparent {
            redirect_ports = policy.allow_ports.clone();
            redirect_ports.sort_unstable();
            redirect_ports.dedup();
            if redirect_ports.len() > MAX_RULE_PORTS {
                return Err(KernelPolicyError(format!(
                    "transparent interception takes at most {MAX_RULE_PORTS} allow_ports ({} given); set transparent = false or list fewer ports",
                    redirect_ports.len()
                )));
            }
        }
        Ok(KernelPolicy {
            mode,
            endpoint4,
            listener4,
            endpoint6,
            listener6,
            allow,
            inbound,
            audit: policy.audits() && policy.mode == Mode::Allowlist,
            transparent,
            dns: policy.answers_dns(),
            redirect_ports,
            intercept4,
            intercept6,
        })
    }

    /// Open the policy's `allow_host_services` ports (TCP and UDP, as every direct allow) at
    /// `host`: the addresses at which this cgroup reaches its own host (its bridge's gateway;
    /// loopback for a workload in the host's network namespace). Nothing for a policy without
    /// host services, or a mode whose direct allows the kernel doesn't read.
    pub fn with_host_services(
        mut self,
        policy: &model::Policy,
        host: &[IpAddr],
    ) -> Result<KernelPolicy, KernelPolicyError> {
        let ports = policy.host_service_ports();
        if ports.is_empty() {
            return Ok(self);
        }
        for ip in host {
            self.allow
                .push(fits("allow_host_services", &IpNet::from(*ip), &ports)?);
        }
        Ok(self)
    }

    /// The map entry for a cgroup whose rules are keyed by `rules_id`.
    pub fn entry(&self, rules_id: u64) -> PolicyEntry {
        let v4 = |a: Option<SocketAddr>| match a {
            Some(SocketAddr::V4(a)) => (u32::from_ne_bytes(a.ip().octets()), a.port().to_be()),
            _ => (0, 0),
        };
        let v6 = |a: Option<SocketAddr>| match a {
            Some(SocketAddr::V6(a)) => (ip6_words(a.ip()), a.port().to_be()),
            _ => ([0; 4], 0),
        };
        let (e4, e4p) = v4(self.endpoint4);
        let (l4, l4p) = v4(self.listener4);
        let (e6, e6p) = v6(self.endpoint6);
        let (l6, l6p) = v6(self.listener6);
        let (t4, t4p) = v4(self.intercept4.transparent.filter(|_| self.transparent));
        let (u4, u4p) = v4(self.intercept4.dns_udp.filter(|_| self.dns));
        let (d4, d4p) = v4(self.intercept4.dns_tcp.filter(|_| self.dns));
        let (t6, t6p) = v6(self.intercept6.transparent.filter(|_| self.transparent));
        let (u6, u6p) = v6(self.intercept6.dns_udp.filter(|_| self.dns));
        let (d6, d6p) = v6(self.intercept6.dns_tcp.filter(|_| self.dns));
        let mut flags = 0;
        for (on, flag) in [
            (self.endpoint6.is_some(), POLICY_FLAG_V6),
            (self.audit, POLICY_FLAG_AUDIT),
            (self.transparent, POLICY_FLAG_TRANSPARENT),
            (self.dns, POLICY_FLAG_DNS),
        ] {
            if on {
                flags |= flag;
            }
        }
        let mut redirect_ports = [0u16; MAX_RULE_PORTS];
        let n = self.redirect_ports.len().min(MAX_RULE_PORTS);
        redirect_ports[..n].copy_from_slice(&self.redirect_ports[..n]);
        PolicyEntry {
            mode: self.mode,
            flags,
            rules_id,
            endpoint4_addr: e4,
            listener4_addr: l4,
            endpoint4_port: e4p,
            listener4_port: l4p,
            endpoint6_port: e6p,
            listener6_port: l6p,
            endpoint6_addr: e6,
            listener6_addr: l6,
            transparent4_addr: t4,
            dns_udp4_addr: u4,
            dns_tcp4_addr: d4,
            transparent4_port: t4p,
            dns_udp4_port: u4p,
            dns_tcp4_port: d4p,
            nredirect: n as u16,
            transparent6_addr: t6,
            dns_udp6_addr: u6,
            dns_tcp6_addr: d6,
            transparent6_port: t6p,
            dns_udp6_port: u6p,
            dns_tcp6_port: d6p,
            _pad: 0,
            redirect_ports,
        }
    }

    /// The direct-allow LPM rules (`allow_cidrs`; allowlist only).
    pub fn rules(&self) -> Vec<(IpNet, CidrRule)> {
        if self.mode != MODE_ALLOWLIST {
            return Vec::new();
        }
        lpm_rules(&self.allow, PROTO_BIT_TCP | PROTO_BIT_UDP)
    }

    /// The inbound LPM rules (peer network → local ports; every mode but allow_all).
    pub fn inbound_rules(&self) -> Vec<(IpNet, CidrRule)> {
        if self.mode == MODE_ALLOW_ALL {
            return Vec::new();
        }
        lpm_rules(&self.inbound, PROTO_BIT_TCP)
    }
}

/// LPM rules from (network, ports) allows, with the ports of less specific rules merged into more
/// specific ones (the kernel only looks at the longest match).
fn lpm_rules(allows: &[(IpNet, Vec<u16>)], protos: u32) -> Vec<(IpNet, CidrRule)> {
    // Merge identical networks first.
    let mut by_net: BTreeMap<IpNet, Option<Vec<u16>>> = BTreeMap::new();
    for (net, ports) in allows {
        let slot = by_net.entry(*net).or_insert_with(|| Some(Vec::new()));
        merge(slot, ports);
    }
    let nets: Vec<IpNet> = by_net.keys().copied().collect();
    let mut out = Vec::new();
    for net in &nets {
        let mut ports: Option<Vec<u16>> = Some(Vec::new());
        for other in &nets {
            if other.contains(net)
                && let Some(p) = by_net.get(other)
            {
                match p {
                    None => ports = None,
                    Some(list) => merge(&mut ports, list),
                }
            }
        }
        let mut rule = CidrRule {
            action: CIDR_ALLOW,
            protos,
            ..CidrRule::default()
        };
        if let Some(list) = ports {
            // More than MAX_RULE_PORTS after merging: fall back to the rule's own ports
            // (never wider than configured).
            let own = by_net.get(net).cloned().flatten().unwrap_or_default();
            let list = if list.len() > MAX_RULE_PORTS {
                own
            } else {
                list
            };
            rule.nports = list.len() as u32;
            for (i, p) in list.iter().take(MAX_RULE_PORTS).enumerate() {
                rule.ports[i] = *p;
            }
            if rule.nports == 0 {
                // An empty merged list can only come from "all ports" (None) above.
                continue;
            }
        }
        out.push((*net, rule));
    }
    out
}

/// `None` = all ports. Merge `ports` (empty = all) into `slot`.
fn merge(slot: &mut Option<Vec<u16>>, ports: &[u16]) {
    if ports.is_empty() {
        *slot = None;
        return;
    }
    if let Some(list) = slot {
        for p in ports {
            if !list.contains(p) {
                list.push(*p);
            }
        }
        list.sort_unstable();
    }
}

pub fn ip6_words(ip: &Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
}

fn words_ip6(w: &[u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, word) in w.iter().enumerate() {
        o[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

/// Decode an entry's addresses for display.
pub fn entry_listener4(e: &PolicyEntry) -> Option<SocketAddr> {
    (e.listener4_port != 0).then(|| {
        SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(e.listener4_addr.to_ne_bytes())),
            u16::from_be(e.listener4_port),
        )
    })
}

pub fn entry_listener6(e: &PolicyEntry) -> Option<SocketAddr> {
    (e.listener6_port != 0).then(|| {
        SocketAddr::new(
            IpAddr::V6(words_ip6(&e.listener6_addr)),
            u16::from_be(e.listener6_port),
        )
    })
}

pub fn mode_name(mode: u32) -> &'static str {
    match mode {
        MODE_ALLOW_ALL => ALLOW_ALL,
        MODE_DENY_ALL => DENY_ALL,
        MODE_ALLOWLIST => "allowlist",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[(&str, &[u16])]) -> KernelPolicy {
        KernelPolicy {
            mode: MODE_ALLOWLIST,
            endpoint4: Some("127.0.0.1:3128".parse().expect("addr")),
            listener4: Some("127.0.0.1:40000".parse().expect("addr")),
            endpoint6: None,
            listener6: None,
            allow: allow
                .iter()
                .map(|(n, p)| (n.parse().expect("net"), p.to_vec()))
                .collect(),
            inbound: Vec::new(),
            audit: false,
            transparent: false,
            dns: false,
            redirect_ports: Vec::new(),
            intercept4: InterceptAddrs::default(),
            intercept6: InterceptAddrs::default(),
        }
    }

    fn ports(r: &CidrRule) -> Vec<u16> {
        r.ports[..r.nports as usize].to_vec()
    }

    #[test]
    fn more_specific_rules_inherit_less_specific_ports() {
        let rules = policy(&[("10.0.0.0/8", &[443]), ("10.1.0.0/16", &[5432])]).rules();
        let by: BTreeMap<String, Vec<u16>> = rules
            .iter()
            .map(|(n, r)| (n.to_string(), ports(r)))
            .collect();
        assert_eq!(by["10.0.0.0/8"], vec![443]);
        assert_eq!(by["10.1.0.0/16"], vec![443, 5432]);
    }

    #[test]
    fn all_ports_wins_when_merging() {
        let rules = policy(&[("10.0.0.0/8", &[]), ("10.1.0.0/16", &[5432])]).rules();
        for (_, r) in &rules {
            assert_eq!(r.nports, 0, "all ports expected");
            assert_eq!(r.action, CIDR_ALLOW);
            assert_eq!(r.protos, PROTO_BIT_TCP | PROTO_BIT_UDP);
        }
        // A narrower rule does not widen a wider one.
        let rules = policy(&[("10.0.0.0/8", &[80]), ("10.1.0.0/16", &[])]).rules();
        let wide = rules
            .iter()
            .find(|(n, _)| n.to_string() == "10.0.0.0/8")
            .expect("rule");
        assert_eq!(ports(&wide.1), vec![80]);
    }

    #[test]
    fn non_allowlist_policies_have_no_rules() {
        let mut p = policy(&[("10.0.0.0/8", &[])]);
        p.mode = MODE_DENY_ALL;
        assert!(p.rules().is_empty());
    }

    #[test]
    fn entry_uses_network_byte_order() {
        let e = policy(&[]).entry(42);
        assert_eq!(e.rules_id, 42);
        assert_eq!(e.endpoint4_addr.to_ne_bytes(), [127, 0, 0, 1]);
        assert_eq!(u16::from_be(e.endpoint4_port), 3128);
        assert_eq!(u16::from_be(e.listener4_port), 40000);
        assert_eq!(
            entry_listener4(&e),
            Some("127.0.0.1:40000".parse().expect("addr"))
        );
        assert_eq!(e.flags & POLICY_FLAG_V6, 0);
        assert_eq!(entry_listener6(&e), None);
    }

    fn intercepted(p: &model::Policy) -> Result<KernelPolicy, KernelPolicyError> {
        let addr = |s: &str| Some(s.parse::<SocketAddr>().expect("addr"));
        let endpoints = Endpoints {
            endpoint4: addr("127.0.0.1:3128"),
            listener4: addr("127.0.0.1:40000"),
            intercept4: InterceptAddrs {
                transparent: addr("127.0.0.1:40001"),
                dns_udp: addr("127.0.0.1:40002"),
                dns_tcp: addr("127.0.0.1:40003"),
            },
            ..Endpoints::default()
        };
        KernelPolicy::compile(p, endpoints, &[])
    }

    #[test]
    fn allowlists_are_intercepted_and_answer_dns() {
        let p = model::Policy {
            mode: Mode::Allowlist,
            allow_ports: vec![443, 80, 443],
            ..model::Policy::deny_all()
        };
        let e = intercepted(&p).expect("compiles").entry(7);
        assert_eq!(
            e.flags & (POLICY_FLAG_TRANSPARENT | POLICY_FLAG_DNS | POLICY_FLAG_AUDIT),
            POLICY_FLAG_TRANSPARENT | POLICY_FLAG_DNS
        );
        assert_eq!(&e.redirect_ports[..e.nredirect as usize], &[80, 443]);
        assert_eq!(u16::from_be(e.transparent4_port), 40001);
        assert_eq!(u16::from_be(e.dns_udp4_port), 40002);
        assert_eq!(u16::from_be(e.dns_tcp4_port), 40003);
        assert_eq!(e.transparent4_addr.to_ne_bytes(), [127, 0, 0, 1]);
        assert_eq!(
            e.transparent6_port, 0,
            "no IPv6 listener: IPv6 stays refused"
        );

        // transparent = false keeps DNS (entries with ports need the agent's answers).
        let off = model::Policy {
            transparent: Some(false),
            ..p.clone()
        };
        let e = intercepted(&off).expect("compiles").entry(7);
        assert_eq!(e.flags & POLICY_FLAG_TRANSPARENT, 0);
        assert_eq!((e.transparent4_port, e.nredirect), (0, 0));
        assert_ne!(e.flags & POLICY_FLAG_DNS, 0);

        // Audit is flagged.
        let audit = model::Policy {
            enforce: model::Enforce::Audit,
            ..p
        };
        let e = intercepted(&audit).expect("compiles").entry(7);
        assert_ne!(e.flags & POLICY_FLAG_AUDIT, 0);
    }

    #[test]
    fn deny_all_and_allow_all_get_no_redirects() {
        for p in [model::Policy::deny_all(), model::Policy::allow_all()] {
            let e = intercepted(&p).expect("compiles").entry(7);
            assert_eq!(e.flags & (POLICY_FLAG_TRANSPARENT | POLICY_FLAG_DNS), 0);
            assert_eq!(
                (e.transparent4_port, e.dns_udp4_port, e.dns_tcp4_port),
                (0, 0, 0)
            );
        }
    }

    #[test]
    fn transparent_needs_at_most_30_ports() {
        let p = model::Policy {
            mode: Mode::Allowlist,
            allow_ports: (1..=31).collect(),
            ..model::Policy::deny_all()
        };
        let err = intercepted(&p).expect_err("31 ports");
        assert!(err.to_string().contains("transparent = false"), "{err}");
        let off = model::Policy {
            transparent: Some(false),
            ..p
        };
        assert!(intercepted(&off).is_ok());
    }

    #[test]
    fn too_many_ports_are_rejected() {
        let rule = model::CidrRule {
            net: "10.0.0.0/8".parse().expect("net"),
            ports: (1..=40).collect(),
        };
        let p = model::Policy {
            allow_cidrs: vec![rule],
            ..model::Policy::deny_all()
        };
        assert!(KernelPolicy::compile(&p, Endpoints::default(), &[]).is_err());
    }

    #[test]
    fn host_services_open_their_ports_at_the_host_addresses_only() {
        let p = model::Policy {
            mode: Mode::Allowlist,
            allow_host_services: vec![
                model::HostService {
                    port: 11434,
                    name: Some("ollama".into()),
                },
                model::HostService {
                    port: 8080,
                    name: None,
                },
            ],
            ..model::Policy::deny_all()
        };
        let host: Vec<IpAddr> = vec!["172.17.0.1".parse().expect("ip")];
        let k = KernelPolicy::compile(&p, Endpoints::default(), &[])
            .and_then(|k| k.with_host_services(&p, &host))
            .expect("compiles");
        let rules = k.rules();
        assert_eq!(rules.len(), 1, "{rules:?}");
        let (net, rule) = &rules[0];
        assert_eq!(net.to_string(), "172.17.0.1/32");
        let ports: Vec<u16> = rule.ports[..rule.nports as usize].to_vec();
        assert_eq!(ports, vec![8080, 11434]);
        // Without a host address (not learned yet), nothing opens; nor for another mode.
        let none = KernelPolicy::compile(&p, Endpoints::default(), &[])
            .and_then(|k| k.with_host_services(&p, &[]))
            .expect("compiles");
        assert!(none.rules().is_empty());
        let deny = model::Policy {
            mode: Mode::DenyAll,
            ..p.clone()
        };
        let k = KernelPolicy::compile(&deny, Endpoints::default(), &[])
            .and_then(|k| k.with_host_services(&deny, &host))
            .expect("compiles");
        assert!(k.rules().is_empty());
    }
}
