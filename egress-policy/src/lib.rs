//! egress-policy: the policy model of egress-agent and every decision taken on it, with no I/O
//! (no tokio, aya, sockets, files or environment: cargo keeps it so, since nothing above it is a
//! dependency). Modules: [`model`] (the policy file's schema and validation), [`name`] and
//! [`matcher`] (hostnames), [`addr`] (the address deny list), [`rules`] and [`l7`] (request
//! rules), [`credentials`] and [`secret`] (bindings and the secret type; loading is the agent's),
//! [`scrub`] (response scrubbing), [`kernel`] (the entry the kernel programs read) and
//! [`kernel_eval`] + [`explain`] (the kernel's verdict mirrored, and `explain`'s answer).
//!
//! Decisions for the proxy (this module): an early, explicit filter with a typed reason, before any
//! upstream work ([`CompiledPolicy::check_target`]), then a dial-time check of every resolved address
//! ([`CompiledPolicy::check_addr`]).
//!
//! Rules, in order:
//! - `deny_all`: everything denied.
//! - A name: `allowlist` needs a matching `allow_hosts` pattern and a port in `allow_ports` or in
//!   the matching entries' own `ports`; `allow_all` allows any name and port.
//! - Every address (from DNS or an IP literal) is unmapped (v4-mapped v6 → v4), then:
//!   `deny_cidrs` → denied (wins over everything); an `allow_cidrs` entry covering address and port
//!   → allowed; the built-in deny list → denied, unless the address came from resolving a name and
//!   lies in `resolve_private` (allowed, through the proxy only); an IP literal in `allowlist` mode
//!   → denied; otherwise allowed. A name with **any** denied address is refused as a whole — by
//!   the proxy at dial time and by the DNS responder ([`CompiledPolicy::classify_addr`] is the one
//!   check both use).
//!
//! Audit (`enforce = "audit"`, allowlist only): [`CompiledPolicy::decide_target`] and
//! [`CompiledPolicy::decide_addr`] take the same decision, then ask whether `allow_all` with the
//! same `allow_cidrs`/`deny_cidrs` would refuse too. If it would, the refusal stands ([`Decision::Deny`]:
//! audit never reaches further than `allow_all`, so host-internal addresses and `deny_cidrs` stay
//! closed); otherwise it becomes [`Decision::WouldDeny`] and the enforcement point records it and
//! goes on. Request-shape refusals (userinfo, numeric IP forms, Host mismatch, malformed heads) are
//! not policy decisions and are refused in every mode.
#![forbid(unsafe_code)]
pub mod addr;
pub mod credentials;
pub mod explain;
pub mod kernel;
pub mod kernel_eval;
pub mod l7;
pub mod matcher;
pub mod model;
pub mod name;
pub mod rules;
pub mod scrub;
pub mod secret;
#[cfg(test)]
mod testing;

use std::net::IpAddr;

use ipnet::IpNet;

use matcher::HostMatcher;
pub use model::{
    ALLOW_ALL, AUDIT, CidrRule, DENY_ALL, Enforce, HostEntry, Mode, Policy, ValidationError,
};
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
    /// Transparent TLS without a server name (no SNI, or an IP address as SNI).
    TlsNoServerName,
    /// Transparent bytes that start like TLS but are no ClientHello rustls accepts.
    TlsInvalidHello,
    /// Transparent plain HTTP without a Host header.
    HttpNoHost,
    /// Transparent bytes that are neither TLS nor an HTTP/1 request.
    UnknownProtocol,
    /// The kernel has no original destination for a transparently accepted connection.
    NoOriginalDestination,
    /// A DNS query of another type than A/AAAA (TXT, NULL, ANY, ...), or not class IN.
    DnsTypeRefused,
    /// A redirected connection reached a policy whose `transparent` is off (after a reload).
    TransparentOff,
    /// A request whose framing a second parser could read differently (`Content-Length` with
    /// `Transfer-Encoding`, duplicate lengths, `Transfer_Encoding`-style names).
    AmbiguousFraming,
    /// A protocol switch other than WebSocket (`Upgrade: h2c`, ...) inside an intercepted
    /// connection.
    UpgradeNotAllowed,
    /// Not a refusal of the request: the response carried a bound secret, which was replaced by
    /// its placeholder before the client saw it.
    ResponseSecretScrubbed,
    /// A compressed response the scrubber can't read (`br`, `zstd`, ...) from an intercepted host.
    ResponseEncodingRefused,
    /// The client gave up the intercepted TLS handshake (it doesn't trust the agent's CA).
    AgentCaNotTrusted,
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
            DenyReason::TlsNoServerName => "tls-no-sni",
            DenyReason::TlsInvalidHello => "tls-invalid-hello",
            DenyReason::HttpNoHost => "http-no-host",
            DenyReason::UnknownProtocol => "unknown-protocol",
            DenyReason::NoOriginalDestination => "no-original-destination",
            DenyReason::DnsTypeRefused => "dns-type-refused",
            DenyReason::TransparentOff => "transparent-off",
            DenyReason::AmbiguousFraming => "ambiguous-framing",
            DenyReason::UpgradeNotAllowed => "upgrade-not-allowed",
            DenyReason::ResponseSecretScrubbed => "response-secret-scrubbed",
            DenyReason::ResponseEncodingRefused => "response-encoding-refused",
            DenyReason::AgentCaNotTrusted => "agent-ca-not-trusted",
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

/// The outcome of one decision of the policy in force.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// Refused (enforced).
    Deny(DenyReason),
    /// Refused by the allowlist, let through because the policy audits.
    WouldDeny(DenyReason),
}

/// How an address passed [`CompiledPolicy::classify_addr`]. The kernel side needs the
/// difference: only [`AddrClass::Public`] addresses of a name may be opened directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum AddrClass {
    /// Not on any deny list.
    Public,
    /// Covered by an `allow_cidrs` entry (already allowed directly by the kernel).
    Cidr,
    /// On the built-in deny list, reachable because the name resolved into `resolve_private`:
    /// through the proxy only.
    ResolvePrivate,
}

/// A [`Policy`] prepared for the hot path.
#[derive(Debug, Clone)]
pub struct CompiledPolicy {
    mode: Mode,
    audit: bool,
    hosts: HostMatcher,
    ports: Vec<u16>,
    allow_cidrs: Vec<CidrRule>,
    deny_cidrs: Vec<IpNet>,
    resolve_private: Vec<IpNet>,
    transparent: bool,
    l7: l7::L7Policy,
}

impl CompiledPolicy {
    pub fn new(p: &Policy) -> CompiledPolicy {
        let mut ports = p.allow_ports.clone();
        ports.sort_unstable();
        ports.dedup();
        CompiledPolicy {
            mode: p.mode,
            audit: p.audits() && p.mode == Mode::Allowlist,
            hosts: HostMatcher::with_ports(
                p.allow_hosts
                    .iter()
                    .map(|e| (&e.pattern, e.ports.as_slice())),
            ),
            ports,
            allow_cidrs: p.allow_cidrs.clone(),
            deny_cidrs: p.deny_cidrs.clone(),
            resolve_private: p.resolve_private.clone(),
            transparent: p.transparent(),
            l7: l7::L7Policy::new(p),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Transparent interception on (see [`Policy::transparent`]).
    pub fn transparent(&self) -> bool {
        self.transparent
    }

    /// The early check of a name the DNS responder was asked for (no port: a DNS answer is for
    /// every port). Same rules as [`CompiledPolicy::check_target`] for names. On success, the
    /// ports the matching `allow_hosts` entries carry for direct TCP (empty for most names).
    pub fn check_name(&self, name: &name::HostName) -> Result<Vec<u16>, DenyReason> {
        match self.mode {
            Mode::DenyAll => Err(DenyReason::PolicyDenyAll),
            Mode::AllowAll => Ok(Vec::new()),
            Mode::Allowlist => self
                .hosts
                .entry_ports(name)
                .ok_or(DenyReason::HostNotAllowed),
        }
    }

    /// True when refusals of the allowlist are recorded, not enforced.
    pub fn audits(&self) -> bool {
        self.audit
    }

    /// [`CompiledPolicy::check_target`] with the audit rule applied (see the module docs).
    pub fn decide_target(&self, dest: &Destination, port: u16) -> Decision {
        self.decide(self.check_target(dest, port), || {
            self.target_in(Mode::AllowAll, dest, port)
        })
    }

    /// [`CompiledPolicy::check_addr`] with the audit rule applied (see the module docs).
    pub fn decide_addr(&self, ip: IpAddr, port: u16, via_name: bool) -> Decision {
        self.decide(self.check_addr(ip, port, via_name), || {
            self.addr_in(Mode::AllowAll, ip, port, via_name)
        })
    }

    fn decide(
        &self,
        enforced: Result<(), DenyReason>,
        floor: impl FnOnce() -> Result<(), DenyReason>,
    ) -> Decision {
        match enforced {
            Ok(()) => Decision::Allow,
            Err(reason) if self.audit => match floor() {
                Ok(()) => Decision::WouldDeny(reason),
                Err(floor_reason) => Decision::Deny(floor_reason),
            },
            Err(reason) => Decision::Deny(reason),
        }
    }

    /// Request-level decisions (credential bindings, request rules).
    pub fn l7(&self) -> &l7::L7Policy {
        &self.l7
    }

    /// The early check, before resolution. IP literals get their full address check here.
    /// Enforce semantics: a refusal here is a refusal whatever `enforce` says (use
    /// [`CompiledPolicy::decide_target`] at an enforcement point).
    pub fn check_target(&self, dest: &Destination, port: u16) -> Result<(), DenyReason> {
        self.target_in(self.mode, dest, port)
    }

    fn target_in(&self, mode: Mode, dest: &Destination, port: u16) -> Result<(), DenyReason> {
        if mode == Mode::DenyAll {
            return Err(DenyReason::PolicyDenyAll);
        }
        if port == 0 {
            return Err(DenyReason::PortNotAllowed);
        }
        match dest {
            Destination::Ip(ip) => self.addr_in(mode, *ip, port, false),
            Destination::Name(n) => match mode {
                Mode::AllowAll => Ok(()),
                Mode::DenyAll => Err(DenyReason::PolicyDenyAll),
                Mode::Allowlist => {
                    if !self.hosts.matches(n) {
                        Err(DenyReason::HostNotAllowed)
                    } else if self.ports.binary_search(&port).is_ok()
                        || self
                            .hosts
                            .entry_ports(n)
                            .is_some_and(|p| p.binary_search(&port).is_ok())
                    {
                        Ok(())
                    } else {
                        Err(DenyReason::PortNotAllowed)
                    }
                }
            },
        }
    }

    /// The dial-time check of one address. `via_name`: the address came from resolving an allowed
    /// name (as opposed to an IP literal in the request).
    pub fn check_addr(&self, ip: IpAddr, port: u16, via_name: bool) -> Result<(), DenyReason> {
        self.classify_addr(ip, Some(port), via_name).map(|_| ())
    }

    /// The one address check (proxy dial time, DNS answers, transparent dials). `port: None`
    /// asks for any port (a DNS answer): an `allow_cidrs` entry then covers the address whatever
    /// its ports.
    pub fn classify_addr(
        &self,
        ip: IpAddr,
        port: Option<u16>,
        via_name: bool,
    ) -> Result<AddrClass, DenyReason> {
        self.classify_in(self.mode, ip, port, via_name)
    }

    fn addr_in(&self, mode: Mode, ip: IpAddr, port: u16, via_name: bool) -> Result<(), DenyReason> {
        self.classify_in(mode, ip, Some(port), via_name).map(|_| ())
    }

    fn classify_in(
        &self,
        mode: Mode,
        ip: IpAddr,
        port: Option<u16>,
        via_name: bool,
    ) -> Result<AddrClass, DenyReason> {
        if mode == Mode::DenyAll {
            return Err(DenyReason::PolicyDenyAll);
        }
        let ip = addr::unmap(ip);
        if addr::any_contains(&self.deny_cidrs, ip) {
            return Err(DenyReason::AddressDeniedByPolicy);
        }
        let mut cidr_covers_ip = false;
        for rule in &self.allow_cidrs {
            if rule.net.contains(&ip) {
                if port.is_none_or(|p| rule.allows_port(p)) {
                    return Ok(AddrClass::Cidr);
                }
                cidr_covers_ip = true;
            }
        }
        if addr::builtin_denied(ip).is_some() {
            if via_name && addr::any_contains(&self.resolve_private, ip) {
                return Ok(AddrClass::ResolvePrivate);
            }
            return Err(if cidr_covers_ip {
                DenyReason::PortNotAllowed
            } else {
                DenyReason::AddressDenied
            });
        }
        if !via_name && mode == Mode::Allowlist {
            return Err(if cidr_covers_ip {
                DenyReason::PortNotAllowed
            } else {
                DenyReason::IpLiteralNotAllowed
            });
        }
        Ok(AddrClass::Public)
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn policy(toml: &str) -> CompiledPolicy {
        CompiledPolicy::new(&crate::testing::policy(toml))
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
    fn audit_turns_allowlist_refusals_into_would_deny_within_allow_all() {
        let p = policy(
            "enforce = \"audit\"\nallow_hosts = [\"github.com\"]\nallow_cidrs = [{ cidr = \"10.0.0.0/24\", ports = [5432] }]\ndeny_cidrs = [\"1.2.3.0/24\"]",
        );
        assert!(p.audits());
        let d = |h: &str, port| p.decide_target(&Destination::parse(h).unwrap(), port);
        assert_eq!(d("github.com", 443), Decision::Allow);
        assert_eq!(
            d("evil.example", 443),
            Decision::WouldDeny(DenyReason::HostNotAllowed)
        );
        assert_eq!(
            d("github.com", 22),
            Decision::WouldDeny(DenyReason::PortNotAllowed)
        );
        assert_eq!(
            d("1.1.1.1", 443),
            Decision::WouldDeny(DenyReason::IpLiteralNotAllowed)
        );
        // allow_all refuses these too: audit never reaches further.
        assert_eq!(
            d("127.0.0.1", 22),
            Decision::Deny(DenyReason::AddressDenied)
        );
        assert_eq!(
            d("1.2.3.4", 443),
            Decision::Deny(DenyReason::AddressDeniedByPolicy)
        );
        assert_eq!(
            p.decide_addr("169.254.169.254".parse().unwrap(), 80, true),
            Decision::Deny(DenyReason::AddressDenied)
        );
        // A CIDR-covered private address on another port: the built-in list still holds.
        assert_eq!(
            p.decide_addr("10.0.0.7".parse().unwrap(), 443, true),
            Decision::Deny(DenyReason::PortNotAllowed)
        );
        assert_eq!(
            p.decide_addr("10.0.0.7".parse().unwrap(), 5432, true),
            Decision::Allow
        );
        assert_eq!(
            p.decide_addr("140.82.112.3".parse().unwrap(), 443, true),
            Decision::Allow
        );
        // The enforce-semantics check is unchanged (explain, API).
        assert_eq!(
            target(&p, "evil.example", 443),
            Err(DenyReason::HostNotAllowed)
        );
        // The same policy enforcing: every refusal is a denial.
        let e = policy("allow_hosts = [\"github.com\"]");
        assert!(!e.audits());
        assert_eq!(
            e.decide_target(&Destination::parse("evil.example").unwrap(), 443),
            Decision::Deny(DenyReason::HostNotAllowed)
        );
        let builtin = CompiledPolicy::new(&Policy::audit());
        assert_eq!(
            builtin.decide_target(&Destination::parse("anything.example").unwrap(), 8080),
            Decision::WouldDeny(DenyReason::HostNotAllowed)
        );
    }

    #[test]
    fn entry_ports_allow_that_name_on_those_ports_only() {
        let p = policy(
            "allow_hosts = [{ host = \"github.com\", ports = [22] }, \"example.com\"]\nallow_ports = [443]",
        );
        assert_eq!(target(&p, "github.com", 22), Ok(()));
        assert_eq!(target(&p, "github.com", 443), Ok(()));
        assert_eq!(
            target(&p, "example.com", 22),
            Err(DenyReason::PortNotAllowed)
        );
        let name = |s: &str| name::HostName::parse(s).unwrap();
        assert_eq!(p.check_name(&name("github.com")), Ok(vec![22]));
        assert_eq!(p.check_name(&name("example.com")), Ok(vec![]));
        assert_eq!(
            p.check_name(&name("evil.example")),
            Err(DenyReason::HostNotAllowed)
        );
    }

    #[test]
    fn resolve_private_opens_names_not_literals() {
        let p = policy(
            "allow_hosts = [\"registry.internal\"]\nresolve_private = [\"10.0.0.0/8\", \"127.0.0.1/32\"]",
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            p.classify_addr(ip("10.1.2.3"), Some(443), true),
            Ok(AddrClass::ResolvePrivate)
        );
        assert_eq!(
            p.classify_addr(ip("::ffff:10.1.2.3"), None, true),
            Ok(AddrClass::ResolvePrivate)
        );
        assert_eq!(
            p.classify_addr(ip("127.0.0.1"), Some(8080), true),
            Ok(AddrClass::ResolvePrivate)
        );
        // Outside the ranges, and IP literals: still denied.
        assert_eq!(
            p.check_addr(ip("127.0.0.2"), 443, true),
            Err(DenyReason::AddressDenied)
        );
        assert_eq!(
            p.check_addr(ip("192.168.0.1"), 443, true),
            Err(DenyReason::AddressDenied)
        );
        assert_eq!(target(&p, "10.1.2.3", 443), Err(DenyReason::AddressDenied));
        assert_eq!(
            p.classify_addr(ip("140.82.112.3"), None, true),
            Ok(AddrClass::Public)
        );
    }

    #[test]
    fn dns_answers_ignore_cidr_ports() {
        let p = policy(
            "allow_hosts = [\"db.internal\"]\nallow_cidrs = [{ cidr = \"10.0.0.0/24\", ports = [5432] }]",
        );
        let ip = "10.0.0.7".parse().unwrap();
        assert_eq!(p.classify_addr(ip, None, true), Ok(AddrClass::Cidr));
        assert_eq!(
            p.classify_addr(ip, Some(443), true),
            Err(DenyReason::PortNotAllowed)
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
