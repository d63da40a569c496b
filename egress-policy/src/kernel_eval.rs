//! What the kernel programs would do with a connection, evaluated over a compiled
//! [`KernelPolicy`] — the same entry and LPM rules `bpf::state` writes into the maps — for
//! `explain`. The programs themselves (`egress-ebpf`) are the authority; this mirrors their
//! documented order, and the tests below pin it:
//!
//! connect4/connect6 (`egress-ebpf/src/connect.rs`, then `addr.rs` `check`):
//! 1. `allow_all` → allowed, nothing else is looked at;
//! 2. only kernel TCP and UDP sockets go on (others: `kernel-socket-type-not-allowed`);
//! 3. allowlist, TCP: the proxy endpoint is rewritten to the cgroup's listener (no listener:
//!    `kernel-proxy-not-running`); the listener itself is allowed;
//! 4. port 53 (TCP or UDP, any address) → the cgroup's DNS responder, when the policy answers DNS
//!    (UDP straight to that responder is allowed: a v4-mapped socket connect6 redirected there
//!    sends through sendmsg4 with the responder's address);
//! 5. allowlist: the **longest** matching CIDR rule decides alone (an allow rule whose ports
//!    don't include the port is no match; the loader merges wider rules' ports into narrower ones
//!    so that nothing is lost);
//! 6. loopback or unspecified: Docker's resolver 127.0.0.11 is refused; the socket's own network
//!    namespace's loopback is allowed; in the host's namespace only a server of the same
//!    confined tree (decided per socket at run time, [`KernelVerdict::SameTreeOnly`]) — anyone
//!    else's server is refused with `kernel-host-loopback`, and goes on to 7–9 like every
//!    refusal (a transparent port is redirected, an auditing policy lets it through);
//! 7. (TCP to an address the agent's DNS answered for a name with this port: allowed until the
//!    answer's TTL ends — run-time state, not evaluated here);
//! 8. TCP to a port of `allow_ports` of a transparent policy → the transparent listener (the proxy
//!    then decides on the SNI / Host); so is TCP to the endpoint's own address on port 80, where
//!    `http://egress.internal/` leads (the agent's DNS answers the name with that address);
//! 9. anything else: `kernel-destination-not-allowed` — or, for an auditing policy, let through
//!    and reported as a would-deny.
//!
//! Inbound (`egress-ebpf/src/inbound.rs`, TCP to a listening socket): `allow_all` passes; the
//! longest matching inbound rule allowing the local port passes; a loopback peer passes in the
//! socket's own namespace (or, in the host's, from the same confined tree); everything else is
//! dropped (`kernel-inbound-not-allowed`) — or, for an auditing policy, let in and reported.
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use egress_common::{
    AGENT_HTTP_PORT, CIDR_ALLOW, CIDR_DENY, CidrRule, MODE_ALLOW_ALL, MODE_ALLOWLIST,
    PROTO_BIT_TCP, PROTO_BIT_UDP, REASON_DENY_CIDR, REASON_HOST_LOOPBACK, REASON_INBOUND,
    REASON_NO_LISTENER, REASON_NOT_ALLOWED,
};
use ipnet::IpNet;
use serde::Serialize;

use super::kernel::KernelPolicy;

/// The transport of the connection being explained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Tcp,
    Udp,
}

impl Transport {
    fn bit(self) -> u32 {
        match self {
            Transport::Tcp => PROTO_BIT_TCP,
            Transport::Udp => PROTO_BIT_UDP,
        }
    }
}

/// Where the connecting socket lives: the kernel's loopback rule depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Netns {
    /// A container's own network namespace (Docker).
    Own,
    /// The host's (`egress-agent exec`).
    Host,
}

/// The kernel's verdict, with the rule that gave it.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum KernelVerdict {
    Allow {
        rule: String,
    },
    /// The connection is rewritten to the cgroup's proxy listener (the proxy then decides).
    Redirect {
        rule: String,
    },
    /// Allowed only for a server of the same confined tree (decided per socket at run time);
    /// `otherwise` is the verdict for anyone else's server (refused, audited, or — TCP on a
    /// transparent port — redirected).
    SameTreeOnly {
        rule: String,
        otherwise: Box<KernelVerdict>,
    },
    Deny {
        reason: &'static str,
        rule: String,
    },
    /// An auditing policy: what [`KernelVerdict::Deny`] would refuse is let through and reported.
    WouldDeny {
        reason: &'static str,
        rule: String,
    },
}

impl KernelVerdict {
    fn deny(reason: u32, rule: impl Into<String>) -> Self {
        KernelVerdict::Deny {
            reason: egress_common::reason_name(reason),
            rule: rule.into(),
        }
    }
}

/// The longest rule of `rules` whose network contains `ip` (the LPM trie's answer).
fn longest(rules: &[(IpNet, CidrRule)], ip: IpAddr) -> Option<&(IpNet, CidrRule)> {
    rules
        .iter()
        .filter(|(net, _)| net.contains(&ip))
        .max_by_key(|(net, _)| net.prefix_len())
}

fn rule_ports(r: &CidrRule) -> Vec<u16> {
    r.ports[..(r.nports as usize).min(r.ports.len())].to_vec()
}

fn describe(net: &IpNet, r: &CidrRule) -> String {
    if r.nports == 0 {
        format!("{net} (all ports)")
    } else {
        let p: Vec<String> = rule_ports(r).iter().map(u16::to_string).collect();
        format!("{net} (ports {})", p.join(", "))
    }
}

enum Lpm {
    Allow(String),
    Deny(String),
    NoMatch(Option<String>),
}

/// `rule_verdict` of `egress-ebpf/src/addr.rs` on the longest match.
fn lpm(rules: &[(IpNet, CidrRule)], ip: IpAddr, bit: u32, port: u16) -> Lpm {
    let Some((net, r)) = longest(rules, ip) else {
        return Lpm::NoMatch(None);
    };
    if r.action == CIDR_DENY {
        return Lpm::Deny(describe(net, r));
    }
    if r.action != CIDR_ALLOW || r.protos & bit == 0 {
        return Lpm::NoMatch(Some(describe(net, r)));
    }
    if r.nports == 0 || rule_ports(r).contains(&port) {
        return Lpm::Allow(describe(net, r));
    }
    Lpm::NoMatch(Some(describe(net, r)))
}

fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn is_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.octets()[0] == 127 || v4.is_unspecified(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.is_unspecified(),
    }
}

const DOCKER_DNS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 11);
const DNS_PORT: u16 = 53;

/// A `connect()` (or a UDP send) from a cgroup under `kp` to `dst`.
pub fn connect(
    kp: &KernelPolicy,
    dst: SocketAddr,
    transport: Transport,
    netns: Netns,
) -> KernelVerdict {
    if kp.mode == MODE_ALLOW_ALL {
        return KernelVerdict::Allow {
            rule: "allow_all: the kernel lets every connection through".to_owned(),
        };
    }
    let ip = unmap(dst.ip());
    let port = dst.port();
    let bit = transport.bit();
    if kp.mode == MODE_ALLOWLIST && transport == Transport::Tcp {
        let (endpoint, listener) = match ip {
            IpAddr::V4(_) => (kp.endpoint4, kp.listener4),
            IpAddr::V6(_) => (kp.endpoint6, kp.listener6),
        };
        if endpoint.is_some_and(|e| e.ip() == ip && e.port() == port && port != 0) {
            return match listener {
                Some(l) => KernelVerdict::Redirect {
                    rule: format!("the proxy endpoint: rewritten to this cgroup's listener {l}"),
                },
                None => KernelVerdict::deny(
                    REASON_NO_LISTENER,
                    "the proxy endpoint, but this cgroup has no listener",
                ),
            };
        }
        if listener.is_some_and(|l| l.ip() == ip && l.port() == port && port != 0) {
            return KernelVerdict::Allow {
                rule: "this cgroup's own proxy listener".to_owned(),
            };
        }
    }
    let intercept = match ip {
        IpAddr::V4(_) => kp.intercept4,
        IpAddr::V6(_) => kp.intercept6,
    };
    let own_dns = SocketAddr::new(ip, port);
    if transport == Transport::Udp
        && kp.mode == MODE_ALLOWLIST
        && kp.dns
        && intercept.dns_udp == Some(own_dns)
    {
        return KernelVerdict::Allow {
            rule: format!(
                "this cgroup's own DNS responder {own_dns} (where port 53 is rewritten to; it answers only allowed names)"
            ),
        };
    }
    if port == DNS_PORT && kp.dns {
        let responder = match transport {
            Transport::Tcp => intercept.dns_tcp,
            Transport::Udp => intercept.dns_udp,
        };
        if let Some(r) = responder {
            return KernelVerdict::Redirect {
                rule: format!(
                    "port 53: rewritten to this cgroup's DNS responder {r} (any address, allow_cidrs too)"
                ),
            };
        }
    }
    let endpoint = match ip {
        IpAddr::V4(_) => kp.endpoint4,
        IpAddr::V6(_) => kp.endpoint6,
    };
    // `http://egress.internal/`: the agent's DNS answers the name with the endpoint's address.
    let agent_name = port == AGENT_HTTP_PORT && endpoint.is_some_and(|e| e.ip() == ip);
    let transparent = (transport == Transport::Tcp
        && kp.mode == MODE_ALLOWLIST
        && kp.transparent
        && (kp.redirect_ports.contains(&port) || agent_name))
        .then_some(intercept.transparent)
        .flatten();
    let why = if kp.redirect_ports.contains(&port) {
        format!("allow_ports {port}")
    } else {
        format!("the agent's own address on port {AGENT_HTTP_PORT} (http://egress.internal/)")
    };
    refused(kp, &why, transparent, checked(kp, ip, port, bit, netns))
}

/// What `connect4/6` and `sendmsg4/6` do after `check` refused (steps 7–9 above): the
/// transparent listener for TCP on a transparent port, else audited or refused. A host-loopback
/// verdict refuses only other trees' servers, so its `otherwise` goes the same way.
fn refused(
    kp: &KernelPolicy,
    why: &str,
    transparent: Option<SocketAddr>,
    verdict: KernelVerdict,
) -> KernelVerdict {
    match verdict {
        KernelVerdict::Deny { .. } if let Some(t) = transparent => KernelVerdict::Redirect {
            rule: format!(
                "{why}: rewritten to this cgroup's transparent listener {t} (the proxy decides on the TLS SNI or HTTP Host, and dials that name's own addresses)"
            ),
        },
        KernelVerdict::Deny { reason, rule } if kp.audit => {
            KernelVerdict::WouldDeny { reason, rule }
        }
        KernelVerdict::SameTreeOnly { rule, otherwise } => KernelVerdict::SameTreeOnly {
            rule,
            otherwise: Box::new(refused(kp, why, transparent, *otherwise)),
        },
        v => v,
    }
}

/// `check` of `egress-ebpf/src/addr.rs`: the CIDR rules, then loopback.
fn checked(kp: &KernelPolicy, ip: IpAddr, port: u16, bit: u32, netns: Netns) -> KernelVerdict {
    let mut near = None;
    if kp.mode == MODE_ALLOWLIST {
        match lpm(&kp.rules(), ip, bit, port) {
            Lpm::Allow(r) => {
                return KernelVerdict::Allow {
                    rule: format!("allow_cidrs {r}"),
                };
            }
            Lpm::Deny(r) => return KernelVerdict::deny(REASON_DENY_CIDR, format!("deny rule {r}")),
            Lpm::NoMatch(r) => near = r,
        }
    }
    if is_local(ip) {
        if ip == IpAddr::V4(DOCKER_DNS) {
            return KernelVerdict::deny(
                REASON_NOT_ALLOWED,
                "Docker's embedded resolver 127.0.0.11 (forwards to the host's resolvers)",
            );
        }
        return match netns {
            Netns::Own => KernelVerdict::Allow {
                rule: "the container's own loopback".to_owned(),
            },
            Netns::Host if ip.is_loopback() => KernelVerdict::SameTreeOnly {
                rule: "the host's loopback: only a server of the same confined tree".to_owned(),
                otherwise: Box::new(KernelVerdict::deny(
                    REASON_HOST_LOOPBACK,
                    "the host's loopback: another tree's or an unconfined server",
                )),
            },
            Netns::Host => KernelVerdict::deny(REASON_HOST_LOOPBACK, "the host's loopback"),
        };
    }
    let rule = match near {
        Some(r) => {
            format!("no rule allows it (the closest, {r}, does not cover this port/protocol)")
        }
        None if kp.mode == MODE_ALLOWLIST => {
            "no allow_cidrs rule covers it; names go through the proxy".to_owned()
        }
        None => "deny_all".to_owned(),
    };
    KernelVerdict::deny(REASON_NOT_ALLOWED, rule)
}

/// An inbound TCP connection from `peer` to the cgroup's listener on `local_port`.
pub fn inbound(kp: &KernelPolicy, peer: IpAddr, local_port: u16, netns: Netns) -> KernelVerdict {
    if kp.mode == MODE_ALLOW_ALL {
        return KernelVerdict::Allow {
            rule: "allow_all: the kernel lets every connection in".to_owned(),
        };
    }
    let ip = unmap(peer);
    if let Lpm::Allow(r) = lpm(&kp.inbound_rules(), ip, PROTO_BIT_TCP, local_port) {
        return KernelVerdict::Allow {
            rule: format!("inbound allow {r}"),
        };
    }
    // `inbound.rs` refuses through `refuse`: an auditing policy lets the peer in, reported.
    let refused = |rule: &str| refused(kp, "", None, KernelVerdict::deny(REASON_INBOUND, rule));
    if ip.is_loopback() {
        return match netns {
            Netns::Own => KernelVerdict::Allow {
                rule: "a peer on the container's own loopback".to_owned(),
            },
            Netns::Host => KernelVerdict::SameTreeOnly {
                rule: "a peer on the host's loopback: only from the same confined tree".to_owned(),
                otherwise: Box::new(refused(
                    "a peer on the host's loopback of another tree or unconfined",
                )),
            },
        };
    }
    refused("no inbound rule allows this peer and port")
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::kernel::Endpoints;

    fn kp(toml: &str, published: &[u16]) -> KernelPolicy {
        KernelPolicy::compile(
            &crate::testing::policy(toml),
            Endpoints {
                endpoint4: Some("169.254.100.1:3128".parse().unwrap()),
                listener4: Some("169.254.100.1:40001".parse().unwrap()),
                endpoint6: None,
                listener6: None,
                intercept4: crate::kernel::InterceptAddrs {
                    transparent: Some("169.254.100.1:40002".parse().unwrap()),
                    dns_udp: Some("169.254.100.1:40003".parse().unwrap()),
                    dns_tcp: Some("169.254.100.1:40004".parse().unwrap()),
                },
                intercept6: crate::kernel::InterceptAddrs::default(),
            },
            published,
        )
        .unwrap()
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn reason(v: &KernelVerdict) -> &'static str {
        match v {
            KernelVerdict::Deny { reason, .. } => reason,
            _ => "",
        }
    }

    #[test]
    fn allow_all_is_decided_first() {
        let k = kp("mode = \"allow_all\"", &[]);
        for dst in ["127.0.0.1:22", "10.0.0.1:5432", "127.0.0.11:53"] {
            assert!(matches!(
                connect(&k, sa(dst), Transport::Tcp, Netns::Host),
                KernelVerdict::Allow { .. }
            ));
        }
    }

    #[test]
    fn the_endpoint_is_redirected_and_the_listener_allowed_tcp_only() {
        let k = kp("allow_hosts = [\"github.com\"]", &[]);
        assert!(matches!(
            connect(&k, sa("169.254.100.1:3128"), Transport::Tcp, Netns::Own),
            KernelVerdict::Redirect { .. }
        ));
        assert!(matches!(
            connect(&k, sa("169.254.100.1:40001"), Transport::Tcp, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        assert_eq!(
            reason(&connect(
                &k,
                sa("169.254.100.1:3128"),
                Transport::Udp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
        // A v4-mapped endpoint is the endpoint (connect6 unmaps first).
        assert!(matches!(
            connect(
                &k,
                sa("[::ffff:169.254.100.1]:3128"),
                Transport::Tcp,
                Netns::Own
            ),
            KernelVerdict::Redirect { .. }
        ));
        let mut none = k.clone();
        none.listener4 = None;
        assert_eq!(
            reason(&connect(
                &none,
                sa("169.254.100.1:3128"),
                Transport::Tcp,
                Netns::Own
            )),
            "kernel-proxy-not-running"
        );
    }

    #[test]
    fn the_longest_cidr_match_decides_alone() {
        // The loader merges 10/8's port 443 into 10.1/16: 443 stays allowed there.
        let k = kp(
            "allow_cidrs = [{ cidr = \"10.0.0.0/8\", ports = [443] }, { cidr = \"10.1.0.0/16\", ports = [5432] }]",
            &[],
        );
        for (dst, ok) in [
            ("10.1.2.3:5432", true),
            ("10.1.2.3:443", true),
            ("10.2.0.1:443", true),
            ("10.2.0.1:5432", false),
            ("10.1.2.3:22", false),
        ] {
            let v = connect(&k, sa(dst), Transport::Tcp, Netns::Own);
            assert_eq!(matches!(v, KernelVerdict::Allow { .. }), ok, "{dst}: {v:?}");
        }
        // UDP too (allow_cidrs rules carry both protocols).
        assert!(matches!(
            connect(&k, sa("10.1.2.3:5432"), Transport::Udp, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
    }

    #[test]
    fn cidr_rules_come_before_loopback_and_loopback_depends_on_the_namespace() {
        let k = kp("allow_cidrs = [\"127.0.0.5/32\"]", &[]);
        assert!(matches!(
            connect(&k, sa("127.0.0.5:9"), Transport::Tcp, Netns::Host),
            KernelVerdict::Allow { .. }
        ));
        assert!(matches!(
            connect(&k, sa("127.0.0.1:9"), Transport::Tcp, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        assert!(matches!(
            connect(&k, sa("127.0.0.1:9"), Transport::Tcp, Netns::Host),
            KernelVerdict::SameTreeOnly { .. }
        ));
        assert_eq!(
            reason(&connect(&k, sa("0.0.0.0:9"), Transport::Tcp, Netns::Host)),
            "kernel-host-loopback"
        );
        assert!(matches!(
            connect(&k, sa("[::1]:9"), Transport::Tcp, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        // Docker's embedded resolver: only through the agent's DNS (port 53 is redirected first).
        assert_eq!(
            reason(&connect(
                &k,
                sa("127.0.0.11:40000"),
                Transport::Udp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
        assert!(redirected(
            &connect(&k, sa("127.0.0.11:53"), Transport::Udp, Netns::Own),
            "DNS responder"
        ));
    }

    #[test]
    fn everything_else_is_refused_and_deny_all_has_no_rules() {
        let k = kp("allow_hosts = [\"github.com\"]\ntransparent = false", &[]);
        assert_eq!(
            reason(&connect(
                &k,
                sa("140.82.112.3:443"),
                Transport::Tcp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
        let d = kp("mode = \"deny_all\"\nallow_cidrs = [\"10.0.0.0/8\"]", &[]);
        assert_eq!(
            reason(&connect(&d, sa("10.0.0.1:443"), Transport::Tcp, Netns::Own)),
            "kernel-destination-not-allowed"
        );
        assert!(matches!(
            connect(&d, sa("127.0.0.1:80"), Transport::Tcp, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
    }

    fn redirected(v: &KernelVerdict, to: &str) -> bool {
        matches!(v, KernelVerdict::Redirect { rule } if rule.contains(to))
    }

    #[test]
    fn dns_and_transparent_redirects_follow_the_ebpf_order() {
        let k = kp(
            "allow_hosts = [\"github.com\"]\nallow_ports = [443]\nallow_cidrs = [\"10.0.0.0/8\"]",
            &[],
        );
        // Port 53 goes to the responder at any address, allow_cidrs included, both transports.
        for dst in [
            "8.8.8.8:53",
            "127.0.0.11:53",
            "10.0.0.2:53",
            "127.0.0.53:53",
        ] {
            assert!(
                redirected(&connect(&k, sa(dst), Transport::Udp, Netns::Own), "40003"),
                "{dst}"
            );
            assert!(
                redirected(&connect(&k, sa(dst), Transport::Tcp, Netns::Own), "40004"),
                "{dst}"
            );
        }
        // allow_cidrs stay direct; a transparent port elsewhere goes to the transparent listener,
        // another port or UDP on it stays refused.
        assert!(matches!(
            connect(&k, sa("10.1.2.3:443"), Transport::Tcp, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        assert!(redirected(
            &connect(&k, sa("140.82.112.3:443"), Transport::Tcp, Netns::Own),
            "40002"
        ));
        assert_eq!(
            reason(&connect(
                &k,
                sa("140.82.112.3:22"),
                Transport::Tcp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
        assert_eq!(
            reason(&connect(
                &k,
                sa("140.82.112.3:443"),
                Transport::Udp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
        // deny_all answers no DNS and redirects nothing.
        let d = kp("mode = \"deny_all\"", &[]);
        for t in [Transport::Udp, Transport::Tcp] {
            assert_eq!(
                reason(&connect(&d, sa("8.8.8.8:53"), t, Netns::Own)),
                "kernel-destination-not-allowed"
            );
        }
    }

    #[test]
    fn the_agents_own_name_on_port_80_goes_to_the_transparent_listener() {
        // http://egress.internal/ resolves to the endpoint's address: port 80 there goes to the
        // transparent listener even when 80 is not in allow_ports; nothing else of that address
        // opens, and a policy without transparent interception gets no such redirect.
        let k = kp("allow_hosts = [\"github.com\"]\nallow_ports = [443]", &[]);
        let v = connect(&k, sa("169.254.100.1:80"), Transport::Tcp, Netns::Own);
        assert!(redirected(&v, "40002"), "{v:?}");
        assert!(matches!(&v, KernelVerdict::Redirect { rule } if rule.contains("egress.internal")));
        for (dst, t) in [
            ("169.254.100.1:81", Transport::Tcp),
            ("169.254.100.1:80", Transport::Udp),
            ("169.254.100.2:80", Transport::Tcp),
        ] {
            assert_eq!(
                reason(&connect(&k, sa(dst), t, Netns::Own)),
                "kernel-destination-not-allowed",
                "{dst} {t:?}"
            );
        }
        let off = kp(
            "allow_hosts = [\"github.com\"]\nallow_ports = [443]\ntransparent = false",
            &[],
        );
        assert_eq!(
            reason(&connect(
                &off,
                sa("169.254.100.1:80"),
                Transport::Tcp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
        let d = kp("mode = \"deny_all\"", &[]);
        assert_eq!(
            reason(&connect(
                &d,
                sa("169.254.100.1:80"),
                Transport::Tcp,
                Netns::Own
            )),
            "kernel-destination-not-allowed"
        );
    }

    #[test]
    fn an_auditing_policy_reports_what_it_would_refuse() {
        let k = kp(
            "allow_hosts = [\"github.com\"]\nallow_ports = [443]\nenforce = \"audit\"",
            &[],
        );
        assert!(matches!(
            connect(&k, sa("140.82.112.3:22"), Transport::Tcp, Netns::Own),
            KernelVerdict::WouldDeny {
                reason: "kernel-destination-not-allowed",
                ..
            }
        ));
        // What the enforcing policy redirects stays redirected.
        assert!(redirected(
            &connect(&k, sa("140.82.112.3:443"), Transport::Tcp, Netns::Own),
            "40002"
        ));
    }

    fn otherwise(v: KernelVerdict) -> KernelVerdict {
        match v {
            KernelVerdict::SameTreeOnly { otherwise, .. } => *otherwise,
            v => panic!("not same-tree-only: {v:?}"),
        }
    }

    #[test]
    fn another_trees_host_loopback_goes_on_like_every_refusal() {
        // Found by tests/tests/kernel_differential.rs: after `check` refuses the host's loopback
        // (not the same tree), connect4/6 and sendmsg4/6 go on — transparent port, audit.
        let k = kp("allow_hosts = [\"github.com\"]\nallow_ports = [443]", &[]);
        assert!(redirected(
            &otherwise(connect(
                &k,
                sa("127.0.0.1:443"),
                Transport::Tcp,
                Netns::Host
            )),
            "40002"
        ));
        for (dst, t) in [
            ("127.0.0.1:22", Transport::Tcp),
            ("[::1]:443", Transport::Udp),
        ] {
            assert_eq!(
                reason(&otherwise(connect(&k, sa(dst), t, Netns::Host))),
                "kernel-host-loopback"
            );
        }
        let a = kp(
            "allow_hosts = [\"github.com\"]\nenforce = \"audit\"\ntransparent = false",
            &[],
        );
        assert!(matches!(
            otherwise(connect(&a, sa("[::1]:22"), Transport::Udp, Netns::Host)),
            KernelVerdict::WouldDeny {
                reason: "kernel-host-loopback",
                ..
            }
        ));
        // inbound.rs refuses through `refuse` too: an auditing policy lets peers in.
        assert!(matches!(
            inbound(&a, "192.0.2.1".parse().unwrap(), 80, Netns::Own),
            KernelVerdict::WouldDeny {
                reason: "kernel-inbound-not-allowed",
                ..
            }
        ));
        assert!(matches!(
            otherwise(inbound(&a, "127.0.0.1".parse().unwrap(), 80, Netns::Host)),
            KernelVerdict::WouldDeny { .. }
        ));
    }

    #[test]
    fn udp_straight_to_the_own_dns_responder_passes() {
        // Found by the differential test: a v4-mapped UDP socket connect6 redirected to the
        // responder sends through sendmsg4 with the responder's address.
        let k = kp("allow_hosts = [\"github.com\"]", &[]);
        for dst in ["169.254.100.1:40003", "[::ffff:169.254.100.1]:40003"] {
            assert!(matches!(
                connect(&k, sa(dst), Transport::Udp, Netns::Host),
                KernelVerdict::Allow { .. }
            ));
        }
        assert_eq!(
            reason(&connect(
                &k,
                sa("169.254.100.1:40003"),
                Transport::Tcp,
                Netns::Host
            )),
            "kernel-destination-not-allowed"
        );
        let d = kp("mode = \"deny_all\"", &[]);
        assert_eq!(
            reason(&connect(
                &d,
                sa("169.254.100.1:40003"),
                Transport::Udp,
                Netns::Host
            )),
            "kernel-destination-not-allowed"
        );
    }

    #[test]
    fn inbound_follows_the_rules_the_loader_writes() {
        let k = kp(
            "allow_inbound = [{ cidr = \"192.0.2.0/24\", ports = [8080] }]\nallow_cidrs = [\"198.51.100.7/32\", { cidr = \"203.0.113.0/24\", ports = [22] }]",
            &[9000],
        );
        assert!(matches!(
            inbound(&k, "192.0.2.9".parse().unwrap(), 8080, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        assert_eq!(
            reason(&inbound(&k, "192.0.2.9".parse().unwrap(), 8081, Netns::Own)),
            "kernel-inbound-not-allowed"
        );
        // allow_cidrs without ports: trusted both ways; with ports: outbound only.
        assert!(matches!(
            inbound(&k, "198.51.100.7".parse().unwrap(), 1, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        assert_eq!(
            reason(&inbound(&k, "203.0.113.1".parse().unwrap(), 22, Netns::Own)),
            "kernel-inbound-not-allowed"
        );
        // Published ports: from anywhere.
        assert!(matches!(
            inbound(&k, "8.8.8.8".parse().unwrap(), 9000, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
        assert!(matches!(
            inbound(&k, "127.0.0.1".parse().unwrap(), 5, Netns::Host),
            KernelVerdict::SameTreeOnly { .. }
        ));
        let a = kp("mode = \"allow_all\"", &[]);
        assert!(matches!(
            inbound(&a, "8.8.8.8".parse().unwrap(), 1, Netns::Own),
            KernelVerdict::Allow { .. }
        ));
    }
}
