//! Policy decisions for the proxy: an early, explicit filter with a typed reason, before any
//! upstream work ([`CompiledPolicy::check_target`]), then a dial-time check of every resolved address
//! ([`CompiledPolicy::check_addr`]).
//!
//! Rules, in order:
//! - `deny_all`: everything denied.
//! - A name: `allowlist` needs a matching `allow_hosts` pattern and a port in `allow_ports`;
//!   `allow_all` allows any name and port.
//! - Every address (from DNS or an IP literal) is unmapped (v4-mapped v6 → v4), then:
//!   `deny_cidrs` → denied (wins over everything); an `allow_cidrs` entry covering address and port
//!   → allowed; the built-in deny list → denied; an IP literal in `allowlist` mode → denied;
//!   otherwise allowed. A name with **any** denied address is refused as a whole.
pub mod addr;
pub mod credentials;
pub mod kernel;
pub mod l7;
pub mod matcher;
pub mod model;
pub mod name;
pub mod rules;

use std::net::IpAddr;

use ipnet::IpNet;

use matcher::HostMatcher;
pub use model::{ALLOW_ALL, CidrRule, DENY_ALL, Mode, Policy, ValidationError};
use name::Destination;

/// Why a request was denied. `as_str` is the machine-readable reason (`X-Egress-Deny`, events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenyReason {
    PolicyDenyAll,
    HostNotAllowed,
    PortNotAllowed,
    IpLiteralNotAllowed,
    NumericIpForm,
    InvalidHost,
    /// An address on the built-in deny list (loopback, private, link-local, metadata, ...).
    AddressDenied,
    /// An address in the policy's `deny_cidrs`.
    AddressDeniedByPolicy,
    HostHeaderMismatch,
    UserinfoNotAllowed,
    /// A credential placeholder on a request to a host other than its binding's.
    PlaceholderWrongHost,
    /// `require = true` and the request to the bound host lacks the placeholder.
    PlaceholderMissing,
    /// The binding's secret isn't loaded.
    CredentialUnavailable,
    /// A `deny` request rule matched.
    RequestDeniedByRule,
    /// The host has `allow` request rules and none matched.
    RequestNotAllowed,
    /// A path the request rules can't judge safely (dot/empty segments, encoded `/`, ...).
    PathNotNormalized,
    /// The TLS ClientHello named another server than the CONNECT target.
    SniMismatch,
    /// Interception is needed for this host but could not be set up (CA, TLS).
    InterceptionUnavailable,
}

impl DenyReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DenyReason::PolicyDenyAll => "policy-deny-all",
            DenyReason::HostNotAllowed => "host-not-allowed",
            DenyReason::PortNotAllowed => "port-not-allowed",
            DenyReason::IpLiteralNotAllowed => "ip-literal-not-allowed",
            DenyReason::NumericIpForm => "numeric-ip-form",
            DenyReason::InvalidHost => "invalid-host",
            DenyReason::AddressDenied => "address-denied",
            DenyReason::AddressDeniedByPolicy => "address-denied-by-policy",
            DenyReason::HostHeaderMismatch => "host-header-mismatch",
            DenyReason::UserinfoNotAllowed => "userinfo-not-allowed",
            DenyReason::PlaceholderWrongHost => "placeholder-wrong-host",
            DenyReason::PlaceholderMissing => "credential-placeholder-missing",
            DenyReason::CredentialUnavailable => "credential-unavailable",
            DenyReason::RequestDeniedByRule => "request-denied-by-rule",
            DenyReason::RequestNotAllowed => "request-not-allowed",
            DenyReason::PathNotNormalized => "path-not-normalized",
            DenyReason::SniMismatch => "sni-mismatch",
            DenyReason::InterceptionUnavailable => "interception-unavailable",
        }
    }
}

impl std::fmt::Display for DenyReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<name::NameError> for DenyReason {
    fn from(e: name::NameError) -> Self {
        match e {
            name::NameError::NumericIpForm => DenyReason::NumericIpForm,
            _ => DenyReason::InvalidHost,
        }
    }
}

/// A [`Policy`] prepared for the hot path.
#[derive(Debug, Clone)]
pub struct CompiledPolicy {
    mode: Mode,
    hosts: HostMatcher,
    ports: Vec<u16>,
    allow_cidrs: Vec<CidrRule>,
    deny_cidrs: Vec<IpNet>,
    l7: l7::L7Policy,
}

impl CompiledPolicy {
    pub fn new(p: &Policy) -> CompiledPolicy {
        let mut ports = p.allow_ports.clone();
        ports.sort_unstable();
        ports.dedup();
        CompiledPolicy {
            mode: p.mode,
            hosts: HostMatcher::new(&p.allow_hosts),
            ports,
            allow_cidrs: p.allow_cidrs.clone(),
            deny_cidrs: p.deny_cidrs.clone(),
            l7: l7::L7Policy::new(p),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Request-level decisions (credential bindings, request rules).
    pub fn l7(&self) -> &l7::L7Policy {
        &self.l7
    }

    /// The early check, before resolution. IP literals get their full address check here.
    pub fn check_target(&self, dest: &Destination, port: u16) -> Result<(), DenyReason> {
        if self.mode == Mode::DenyAll {
            return Err(DenyReason::PolicyDenyAll);
        }
        if port == 0 {
            return Err(DenyReason::PortNotAllowed);
        }
        match dest {
            Destination::Ip(ip) => self.check_addr(*ip, port, false),
            Destination::Name(n) => match self.mode {
                Mode::AllowAll => Ok(()),
                Mode::DenyAll => Err(DenyReason::PolicyDenyAll),
                Mode::Allowlist => {
                    if !self.hosts.matches(n) {
                        Err(DenyReason::HostNotAllowed)
                    } else if self.ports.binary_search(&port).is_err() {
                        Err(DenyReason::PortNotAllowed)
                    } else {
                        Ok(())
                    }
                }
            },
        }
    }

    /// The dial-time check of one address. `via_name`: the address came from resolving an allowed
    /// name (as opposed to an IP literal in the request).
    pub fn check_addr(&self, ip: IpAddr, port: u16, via_name: bool) -> Result<(), DenyReason> {
        if self.mode == Mode::DenyAll {
            return Err(DenyReason::PolicyDenyAll);
        }
        let ip = addr::unmap(ip);
        if addr::any_contains(&self.deny_cidrs, ip) {
            return Err(DenyReason::AddressDeniedByPolicy);
        }
        let mut cidr_covers_ip = false;
        for rule in &self.allow_cidrs {
            if rule.net.contains(&ip) {
                if rule.allows_port(port) {
                    return Ok(());
                }
                cidr_covers_ip = true;
            }
        }
        if addr::builtin_denied(ip).is_some() {
            return Err(if cidr_covers_ip {
                DenyReason::PortNotAllowed
            } else {
                DenyReason::AddressDenied
            });
        }
        if !via_name && self.mode == Mode::Allowlist {
            return Err(if cidr_covers_ip {
                DenyReason::PortNotAllowed
            } else {
                DenyReason::IpLiteralNotAllowed
            });
        }
        Ok(())
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    fn policy(toml: &str) -> CompiledPolicy {
        let c =
            Config::from_toml_str(&format!("[policies.p]\n{toml}"), Path::new("t.toml")).unwrap();
        CompiledPolicy::new(c.policy("p").unwrap())
    }

    fn target(p: &CompiledPolicy, host: &str, port: u16) -> Result<(), DenyReason> {
        let d = Destination::parse(host)?;
        p.check_target(&d, port)
    }

    #[test]
    fn allowlist_hosts_and_ports() {
        let p = policy("allow_hosts = [\"github.com\", \"*.github.com\"]\nallow_ports = [443, 80]");
        assert_eq!(target(&p, "github.com", 443), Ok(()));
        assert_eq!(target(&p, "api.github.com", 80), Ok(()));
        assert_eq!(
            target(&p, "github.com", 22),
            Err(DenyReason::PortNotAllowed)
        );
        assert_eq!(
            target(&p, "evilgithub.com", 443),
            Err(DenyReason::HostNotAllowed)
        );
        assert_eq!(target(&p, "github.com", 0), Err(DenyReason::PortNotAllowed));
        assert_eq!(
            target(&p, "2130706433", 443),
            Err(DenyReason::NumericIpForm)
        );
        assert_eq!(
            target(&p, "1.1.1.1", 443),
            Err(DenyReason::IpLiteralNotAllowed)
        );
        assert_eq!(target(&p, "127.0.0.1", 443), Err(DenyReason::AddressDenied));
        assert_eq!(
            target(&p, "[::ffff:127.0.0.1]", 443),
            Err(DenyReason::AddressDenied)
        );
    }

    #[test]
    fn resolved_addresses() {
        let p = policy("allow_hosts = [\"github.com\"]");
        for denied in [
            "127.0.0.1",
            "10.0.0.1",
            "169.254.169.254",
            "169.254.170.2",
            "::1",
            "fd00:ec2::254",
            "::ffff:192.168.0.1",
            "100.64.0.1",
            "0.0.0.0",
        ] {
            assert_eq!(
                p.check_addr(denied.parse().unwrap(), 443, true),
                Err(DenyReason::AddressDenied),
                "{denied}"
            );
        }
        assert_eq!(
            p.check_addr("140.82.112.3".parse().unwrap(), 443, true),
            Ok(())
        );
    }

    #[test]
    fn allow_cidrs_open_private_addresses_with_ports() {
        let p = policy(
            "allow_hosts = [\"db.internal\"]\nallow_cidrs = [{ cidr = \"10.0.0.0/24\", ports = [5432] }, \"127.0.0.1/32\"]\ndeny_cidrs = [\"1.2.3.0/24\"]",
        );
        assert_eq!(
            p.check_addr("10.0.0.7".parse().unwrap(), 5432, true),
            Ok(())
        );
        assert_eq!(
            p.check_addr("10.0.0.7".parse().unwrap(), 443, true),
            Err(DenyReason::PortNotAllowed)
        );
        assert_eq!(
            p.check_addr("10.0.1.7".parse().unwrap(), 5432, true),
            Err(DenyReason::AddressDenied)
        );
        assert_eq!(target(&p, "10.0.0.7", 5432), Ok(()));
        assert_eq!(target(&p, "127.0.0.1", 8080), Ok(()));
        assert_eq!(target(&p, "[::ffff:127.0.0.1]", 8080), Ok(()));
        assert_eq!(
            p.check_addr("1.2.3.4".parse().unwrap(), 443, true),
            Err(DenyReason::AddressDeniedByPolicy)
        );
    }

    #[test]
    fn modes() {
        let all = CompiledPolicy::new(&Policy::allow_all());
        assert_eq!(target(&all, "anything.example", 22), Ok(()));
        assert_eq!(target(&all, "1.1.1.1", 22), Ok(()));
        // The proxy runs in the host's netns: allow_all still refuses host-internal addresses.
        assert_eq!(
            target(&all, "127.0.0.1", 22),
            Err(DenyReason::AddressDenied)
        );
        assert_eq!(
            all.check_addr("169.254.169.254".parse().unwrap(), 80, true),
            Err(DenyReason::AddressDenied)
        );
        let none = CompiledPolicy::new(&Policy::deny_all());
        assert_eq!(
            target(&none, "github.com", 443),
            Err(DenyReason::PolicyDenyAll)
        );
        assert_eq!(
            none.check_addr("1.1.1.1".parse().unwrap(), 443, true),
            Err(DenyReason::PolicyDenyAll)
        );
    }
}
