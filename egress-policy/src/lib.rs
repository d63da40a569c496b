//! egress-policy: the policy model of egress-agent and every decision taken on it, with no I/O
//! (no tokio, aya, sockets, files or environment: cargo keeps it so, since nothing above it is a
//! dependency). Modules: [`model`] (the policy file's schema and validation), [`host_entry`] (an
//! `allow_hosts` entry), [`presets`] (the built-in presets and their expansion), [`name`] and
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
pub mod exposure;
pub mod forge;
pub mod host_entry;
pub mod kernel;
pub mod kernel_eval;
pub mod l7;
pub mod matcher;
pub mod model;
pub mod name;
pub mod presets;
pub mod rules;
pub mod scrub;
pub mod secret;
#[cfg(test)]
mod testing;
pub mod validation;

use std::net::IpAddr;

use ipnet::IpNet;

use matcher::HostMatcher;
pub use model::{
    ALLOW_ALL, AUDIT, CidrRule, DENY_ALL, Enforce, HostEntry, Mode, Policy, ValidationError,
};
use name::Destination;

/// Why a request was denied. `as_str` is the machine-readable reason (`X-Egress-Deny`, events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// A `deny` request rule matched.
    RequestDeniedByRule,
    /// The host has `allow` request rules and none matched.
    RequestNotAllowed,
    /// A path the request rules can't judge safely (dot/empty segments, encoded `/`, ...).
    PathNotNormalized,
    /// The TLS ClientHello named another server than the CONNECT target.
    SniMismatch,
    /// Interception is needed for this host but can't be had: the agent's CA or TLS setup
    /// failed, or the host's credential binding has no secret loaded. Refused (`502`), never
    /// relayed untouched or sent without its secret.
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
    /// A listener accepted a connection the kernel did not send it from its own workload (a
    /// host process, another workload): refused before a byte is read.
    ListenerForeignPeer,
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
            DenyReason::ListenerForeignPeer => "listener-foreign-peer",
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

impl DenyReason {
    /// Every reason (for tests and documentation checks).
    pub const ALL: [DenyReason; 30] = [
        DenyReason::PolicyDenyAll,
        DenyReason::HostNotAllowed,
        DenyReason::PortNotAllowed,
        DenyReason::IpLiteralNotAllowed,
        DenyReason::NumericIpForm,
        DenyReason::InvalidHost,
        DenyReason::AddressDenied,
        DenyReason::AddressDeniedByPolicy,
        DenyReason::HostHeaderMismatch,
        DenyReason::UserinfoNotAllowed,
        DenyReason::PlaceholderWrongHost,
        DenyReason::PlaceholderMissing,
        DenyReason::RequestDeniedByRule,
        DenyReason::RequestNotAllowed,
        DenyReason::PathNotNormalized,
        DenyReason::SniMismatch,
        DenyReason::InterceptionUnavailable,
        DenyReason::TlsNoServerName,
        DenyReason::TlsInvalidHello,
        DenyReason::HttpNoHost,
        DenyReason::UnknownProtocol,
        DenyReason::NoOriginalDestination,
        DenyReason::ListenerForeignPeer,
        DenyReason::DnsTypeRefused,
        DenyReason::TransparentOff,
        DenyReason::AmbiguousFraming,
        DenyReason::UpgradeNotAllowed,
        DenyReason::ResponseSecretScrubbed,
        DenyReason::ResponseEncodingRefused,
        DenyReason::AgentCaNotTrusted,
    ];

    /// The proxy's reason for what a kernel refusal (`egress_common::REASON_*`, named by
    /// [`egress_common::reason_name`]) means, where the proxy refuses for that cause too; `None`
    /// for the kernel's own causes (no policy entry, no listener, socket type, inbound).
    ///
    /// The two vocabularies keep their names: both are public (`X-Egress-Deny`, events, metrics
    /// labels, docs/troubleshooting.md), and a kernel event says `kernel-*` so that its
    /// source shows in the name. This is the one place where they meet; the test
    /// `kernel_and_proxy_reasons_map_one_way` pins it.
    /// - `kernel-deny-cidr` ([`egress_common::REASON_DENY_CIDR`]): a deny rule covers the
    ///   address = `address-denied-by-policy`.
    /// - `kernel-host-loopback`: the host's loopback (or unspecified) address = the proxy's
    ///   `address-denied` (the built-in deny list, of which the kernel enforces this range itself).
    /// - `kernel-destination-not-allowed`: no `allow_cidrs` rule allows the address and port (or
    ///   `deny_all`, or Docker's resolver 127.0.0.11) = `ip-literal-not-allowed`, what the
    ///   proxy says of an address nothing allows.
    pub fn from_kernel(reason: u32) -> Option<DenyReason> {
        match reason {
            egress_common::REASON_DENY_CIDR => Some(DenyReason::AddressDeniedByPolicy),
            egress_common::REASON_HOST_LOOPBACK => Some(DenyReason::AddressDenied),
            egress_common::REASON_NOT_ALLOWED => Some(DenyReason::IpLiteralNotAllowed),
            _ => None,
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

/// The outcome of one decision of the policy in force, with the rule that decided it (so
/// `explain`, `suggest` and the API report what the enforcement points decided, rather than
/// working it out again). `Copy`, allocation-free: taken per connection.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Allowed by this rule.
    Allow(Rule),
    /// Refused (enforced).
    Deny(Refused),
    /// Refused by the allowlist, let through because the policy audits.
    WouldDeny(Refused),
}

impl Decision {
    /// The refusal's reason (`None` when allowed).
    pub fn reason(self) -> Option<DenyReason> {
        match self {
            Decision::Allow(_) => None,
            Decision::Deny(r) | Decision::WouldDeny(r) => Some(r.reason),
        }
    }

    /// The rule that decided: the one that allowed, or the one that refused when there is one
    /// (`None`: nothing in the policy matched, e.g. `host-not-allowed`).
    pub fn rule(self) -> Option<Rule> {
        match self {
            Decision::Allow(rule) => Some(rule),
            Decision::Deny(r) | Decision::WouldDeny(r) => r.rule,
        }
    }
}

/// A refusal: why, and the rule of the policy that refused or fell short, when there is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Refused {
    pub reason: DenyReason,
    /// - [`Rule::DenyAll`] for `policy-deny-all`;
    /// - [`Rule::DenyCidr`] for `address-denied-by-policy`;
    /// - [`Rule::Builtin`] for `address-denied`;
    /// - for `port-not-allowed`, the [`Rule::Host`] entry that matched the name (its
    ///   `port` is `None`: neither `allow_ports` nor its own ports have the port) or the
    ///   [`Rule::Cidr`] entry that covers the address on other ports;
    /// - `None` otherwise (no entry matched: `host-not-allowed`, `ip-literal-not-allowed`, a
    ///   port 0).
    pub rule: Option<Rule>,
}

impl Refused {
    /// A refusal no rule of the policy is behind.
    pub fn because(reason: DenyReason) -> Refused {
        Refused { reason, rule: None }
    }

    fn by(reason: DenyReason, rule: Rule) -> Refused {
        Refused {
            reason,
            rule: Some(rule),
        }
    }
}

/// Which list a name's port was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortList {
    /// `allow_ports` (for every `allow_hosts` entry).
    AllowPorts,
    /// The matching entry's own `ports`.
    Entry,
}

/// A rule of a [`Policy`]: an index into one of its lists (the [`Policy`] the
/// [`CompiledPolicy`] was built from), or the mode, or the built-in deny list. `Copy`: naming it
/// costs nothing on the hot path; [`Rule::describe`] writes it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// `mode = "allow_all"`: any name and port, and IP literals on no deny list.
    AllowAll,
    /// `mode = "deny_all"`.
    DenyAll,
    /// `allow_hosts[index]` matches the name; `port`: the list that has the port (`None` in a
    /// `port-not-allowed` refusal). The most specific entry is named: an exact entry before a
    /// wildcard, a longer wildcard before a shorter one, an entry with the port among its own
    /// ports before one allowed through `allow_ports`.
    Host {
        index: usize,
        port: Option<PortList>,
    },
    /// `allow_cidrs[index]` covers the address and port (in a `port-not-allowed` refusal: the
    /// address only).
    Cidr { index: usize },
    /// `deny_cidrs[index]` covers the address.
    DenyCidr { index: usize },
    /// `resolve_private[index]` covers the address a name resolved to (on the built-in list:
    /// through the proxy only).
    ResolvePrivate { index: usize },
    /// The built-in deny list: the label of its range (`loopback`, `rfc1918`, ...).
    Builtin(&'static str),
    /// An address on no list: a resolved address of a name the policy allowed.
    Unlisted,
    /// `request_rules[index]`, a `deny` rule, matched the request.
    Request { index: usize },
}

impl Rule {
    /// The rule as configured, for people (`explain`): `allow_hosts "ssh.github.com"
    /// (ports [22])`, `allow_cidrs 10.0.0.0/8 (ports [5432])`, ... `policy` is the one the
    /// decision was taken under.
    pub fn describe(self, policy: &Policy) -> String {
        fn nth<T: std::fmt::Display>(list: &[T], i: usize) -> String {
            list.get(i).map_or_else(|| format!("#{i}"), T::to_string)
        }
        match self {
            Rule::AllowAll => "mode allow_all".to_owned(),
            Rule::DenyAll => "mode deny_all".to_owned(),
            Rule::Host { index, .. } => format!("allow_hosts {}", nth(&policy.allow_hosts, index)),
            Rule::Cidr { index } => match policy.allow_cidrs.get(index) {
                Some(r) if r.ports.is_empty() => format!("allow_cidrs {} (any port)", r.net),
                Some(r) => {
                    let ports: Vec<String> = r.ports.iter().map(u16::to_string).collect();
                    format!("allow_cidrs {} (ports {})", r.net, ports.join(", "))
                }
                None => format!("allow_cidrs #{index}"),
            },
            Rule::DenyCidr { index } => format!("deny_cidrs {}", nth(&policy.deny_cidrs, index)),
            Rule::ResolvePrivate { index } => {
                format!("resolve_private {}", nth(&policy.resolve_private, index))
            }
            Rule::Builtin(label) => format!("the built-in deny list ({label})"),
            Rule::Unlisted => "on no deny list".to_owned(),
            Rule::Request { index } => {
                format!("request_rules {}", nth(&policy.request_rules, index))
            }
        }
    }
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
    /// The names of `lan = true` entries: their private answers open directly.
    lan: Vec<matcher::HostPattern>,
    /// The policy has `allow_host_services` (the DNS answers `host.docker.internal`).
    host_services: bool,
    transparent: bool,
    l7: l7::L7Policy,
    /// What it was built from: [`CompiledPolicy::describe`] names a decision's rule as
    /// configured (an event carries that text, so a reload never renames a past rule).
    source: std::sync::Arc<Policy>,
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
            lan: p
                .allow_hosts
                .iter()
                .filter(|e| e.lan)
                .map(|e| e.pattern.clone())
                .collect(),
            host_services: !p.host_service_ports().is_empty(),
            transparent: p.transparent(),
            l7: l7::L7Policy::new(p),
            source: std::sync::Arc::new(p.clone()),
        }
    }

    /// `rule` (of a decision this policy took) as configured: [`Rule::describe`].
    pub fn describe(&self, rule: Rule) -> String {
        rule.describe(&self.source)
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Transparent interception on (see [`Policy::transparent`]).
    pub fn transparent(&self) -> bool {
        self.transparent
    }

    /// A name asked of the DNS responder (no port yet), with the audit rule applied as at
    /// every enforcement point: the decision, with the most specific `allow_hosts` entry that
    /// matches (its `port` is `None`: no port was asked), and the ports the matching entries
    /// carry (the kernel may open those directly to the answered addresses).
    pub fn decide_name(&self, name: &name::HostName) -> (Decision, Vec<u16>) {
        let enforced = match self.mode {
            Mode::DenyAll => Err(Refused::by(DenyReason::PolicyDenyAll, Rule::DenyAll)),
            Mode::AllowAll => Ok(Rule::AllowAll),
            Mode::Allowlist => match self.hosts.matching(name).next() {
                Some((index, _)) => Ok(Rule::Host { index, port: None }),
                None => Err(Refused::because(DenyReason::HostNotAllowed)),
            },
        };
        let ports = match enforced {
            Ok(Rule::Host { .. }) => self.hosts.entry_ports(name).unwrap_or_default(),
            _ => Vec::new(),
        };
        (self.decide(enforced, || Ok(Rule::AllowAll)), ports)
    }

    /// Is `name` a `lan = true` entry's (its answers in `resolve_private` open directly)?
    pub fn is_lan_name(&self, name: &name::HostName) -> bool {
        self.lan.iter().any(|p| p.matches(name))
    }

    /// Does the policy allow host services (`allow_host_services`)?
    pub fn has_host_services(&self) -> bool {
        self.host_services
    }

    /// True when refusals of the allowlist are recorded, not enforced.
    pub fn audits(&self) -> bool {
        self.audit
    }

    /// [`CompiledPolicy::check_target`] with the audit rule applied (see the module docs), and
    /// the rule that decided.
    pub fn decide_target(&self, dest: &Destination, port: u16) -> Decision {
        self.decide(self.target_in(self.mode, dest, port), || {
            self.target_in(Mode::AllowAll, dest, port)
        })
    }

    /// [`CompiledPolicy::check_addr`] with the audit rule applied (see the module docs), and
    /// the rule that decided.
    pub fn decide_addr(&self, ip: IpAddr, port: u16, via_name: bool) -> Decision {
        self.decide(self.addr_in(self.mode, ip, Some(port), via_name), || {
            self.addr_in(Mode::AllowAll, ip, Some(port), via_name)
        })
    }

    fn decide(
        &self,
        enforced: Result<Rule, Refused>,
        floor: impl FnOnce() -> Result<Rule, Refused>,
    ) -> Decision {
        match enforced {
            Ok(rule) => Decision::Allow(rule),
            Err(refused) if self.audit => match floor() {
                Ok(_) => Decision::WouldDeny(refused),
                Err(floor_refused) => Decision::Deny(floor_refused),
            },
            Err(refused) => Decision::Deny(refused),
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
            .map(|_| ())
            .map_err(|r| r.reason)
    }

    fn target_in(&self, mode: Mode, dest: &Destination, port: u16) -> Result<Rule, Refused> {
        if mode == Mode::DenyAll {
            return Err(Refused::by(DenyReason::PolicyDenyAll, Rule::DenyAll));
        }
        if port == 0 {
            return Err(Refused::because(DenyReason::PortNotAllowed));
        }
        match dest {
            Destination::Ip(ip) => self.addr_in(mode, *ip, Some(port), false),
            Destination::Name(n) => match mode {
                Mode::AllowAll => Ok(Rule::AllowAll),
                Mode::DenyAll => Err(Refused::by(DenyReason::PolicyDenyAll, Rule::DenyAll)),
                Mode::Allowlist => self.host_rule(n, port),
            },
        }
    }

    /// The `allow_hosts` entry that lets `name` through on `port` (see [`Rule::Host`] for
    /// which one is named).
    fn host_rule(&self, name: &name::HostName, port: u16) -> Result<Rule, Refused> {
        let mut first = None;
        for (index, own) in self.hosts.matching(name) {
            if own.binary_search(&port).is_ok() {
                return Ok(Rule::Host {
                    index,
                    port: Some(PortList::Entry),
                });
            }
            first.get_or_insert(index);
        }
        let Some(index) = first else {
            return Err(Refused::because(DenyReason::HostNotAllowed));
        };
        if self.ports.binary_search(&port).is_ok() {
            Ok(Rule::Host {
                index,
                port: Some(PortList::AllowPorts),
            })
        } else {
            Err(Refused::by(
                DenyReason::PortNotAllowed,
                Rule::Host { index, port: None },
            ))
        }
    }

    /// The dial-time check of one address. `via_name`: the address came from resolving an allowed
    /// name (as opposed to an IP literal in the request).
    pub fn check_addr(&self, ip: IpAddr, port: u16, via_name: bool) -> Result<(), DenyReason> {
        self.addr_in(self.mode, ip, Some(port), via_name)
            .map(|_| ())
            .map_err(|r| r.reason)
    }

    /// The one address check (proxy dial time, DNS answers, transparent dials). `port: None`
    /// asks for any port (a DNS answer): an `allow_cidrs` entry then covers the address whatever
    /// its ports.
    pub fn classify_addr(
        &self,
        ip: IpAddr,
        port: Option<u16>,
        via_name: bool,
    ) -> Result<AddrClass, Refused> {
        match self.addr_in(self.mode, ip, port, via_name)? {
            Rule::Cidr { .. } => Ok(AddrClass::Cidr),
            Rule::ResolvePrivate { .. } => Ok(AddrClass::ResolvePrivate),
            _ => Ok(AddrClass::Public),
        }
    }

    fn addr_in(
        &self,
        mode: Mode,
        ip: IpAddr,
        port: Option<u16>,
        via_name: bool,
    ) -> Result<Rule, Refused> {
        if mode == Mode::DenyAll {
            return Err(Refused::by(DenyReason::PolicyDenyAll, Rule::DenyAll));
        }
        let ip = addr::unmap(ip);
        if let Some(index) = self.deny_cidrs.iter().position(|n| n.contains(&ip)) {
            return Err(Refused::by(
                DenyReason::AddressDeniedByPolicy,
                Rule::DenyCidr { index },
            ));
        }
        // An entry covering the address on other ports.
        let mut near = None;
        for (index, rule) in self.allow_cidrs.iter().enumerate() {
            if rule.net.contains(&ip) {
                if port.is_none_or(|p| rule.allows_port(p)) {
                    return Ok(Rule::Cidr { index });
                }
                near.get_or_insert(index);
            }
        }
        let port_refused = |index| Refused::by(DenyReason::PortNotAllowed, Rule::Cidr { index });
        if let Some(label) = addr::builtin_denied(ip) {
            if via_name
                && let Some(index) = self.resolve_private.iter().position(|n| n.contains(&ip))
            {
                return Ok(Rule::ResolvePrivate { index });
            }
            return Err(match near {
                Some(index) => port_refused(index),
                None => Refused::by(DenyReason::AddressDenied, Rule::Builtin(label)),
            });
        }
        if via_name {
            return Ok(Rule::Unlisted);
        }
        if mode == Mode::Allowlist {
            return Err(match near {
                Some(index) => port_refused(index),
                None => Refused::because(DenyReason::IpLiteralNotAllowed),
            });
        }
        Ok(Rule::AllowAll)
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

    /// A decision without its rule (the rules have their own test).
    #[derive(Debug, PartialEq)]
    enum V {
        Allow,
        Deny(DenyReason),
        WouldDeny(DenyReason),
    }

    fn v(d: Decision) -> V {
        match d {
            Decision::Allow(_) => V::Allow,
            Decision::Deny(r) => V::Deny(r.reason),
            Decision::WouldDeny(r) => V::WouldDeny(r.reason),
        }
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
        let d = |h: &str, port| v(p.decide_target(&Destination::parse(h).unwrap(), port));
        assert_eq!(d("github.com", 443), V::Allow);
        assert_eq!(
            d("evil.example", 443),
            V::WouldDeny(DenyReason::HostNotAllowed)
        );
        assert_eq!(
            d("github.com", 22),
            V::WouldDeny(DenyReason::PortNotAllowed)
        );
        assert_eq!(
            d("1.1.1.1", 443),
            V::WouldDeny(DenyReason::IpLiteralNotAllowed)
        );
        // allow_all refuses these too: audit never reaches further.
        assert_eq!(d("127.0.0.1", 22), V::Deny(DenyReason::AddressDenied));
        assert_eq!(
            d("1.2.3.4", 443),
            V::Deny(DenyReason::AddressDeniedByPolicy)
        );
        assert_eq!(
            v(p.decide_addr("169.254.169.254".parse().unwrap(), 80, true)),
            V::Deny(DenyReason::AddressDenied)
        );
        // A CIDR-covered private address on another port: the built-in list still holds.
        assert_eq!(
            v(p.decide_addr("10.0.0.7".parse().unwrap(), 443, true)),
            V::Deny(DenyReason::PortNotAllowed)
        );
        assert_eq!(
            v(p.decide_addr("10.0.0.7".parse().unwrap(), 5432, true)),
            V::Allow
        );
        assert_eq!(
            v(p.decide_addr("140.82.112.3".parse().unwrap(), 443, true)),
            V::Allow
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
            v(e.decide_target(&Destination::parse("evil.example").unwrap(), 443)),
            V::Deny(DenyReason::HostNotAllowed)
        );
        let builtin = CompiledPolicy::new(&Policy::audit());
        assert_eq!(
            v(builtin.decide_target(&Destination::parse("anything.example").unwrap(), 8080)),
            V::WouldDeny(DenyReason::HostNotAllowed)
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
        let host = |index| Decision::Allow(Rule::Host { index, port: None });
        assert_eq!(p.decide_name(&name("github.com")), (host(0), vec![22]));
        assert_eq!(p.decide_name(&name("example.com")), (host(1), vec![]));
        assert_eq!(
            p.decide_name(&name("evil.example")),
            (
                Decision::Deny(Refused::because(DenyReason::HostNotAllowed)),
                vec![]
            )
        );
    }

    /// Reason codes are an API (docs/policy.md "Reason codes"): every code `as_str` can give
    /// is documented there.
    #[test]
    fn every_reason_code_is_documented() {
        let doc = include_str!("../../docs/policy.md");
        let src = include_str!("lib.rs");
        let start = src.find("impl DenyReason {").unwrap();
        let end = start + src[start..].find("\n}\n").unwrap();
        let codes: Vec<&str> = src[start..end]
            .lines()
            .filter_map(|l| l.split("=> \"").nth(1)?.split('"').next())
            .collect();
        assert!(codes.len() >= 30, "{codes:?}");
        let missing: Vec<&&str> = codes
            .iter()
            .filter(|c| !doc.contains(&format!("| `{c}` |")))
            .collect();
        assert!(
            missing.is_empty(),
            "not in docs/policy.md's reason codes: {missing:?}"
        );
    }

    #[test]
    fn a_name_is_decided_with_its_rule_and_the_audit() {
        let name = |s: &str| name::HostName::parse(s).unwrap();
        let p = policy("allow_hosts = [\"*.example.com\", \"api.example.com\"]");
        let (d, _) = p.decide_name(&name("api.example.com"));
        // The most specific entry: the exact one, not the wildcard listed first.
        assert_eq!(
            d,
            Decision::Allow(Rule::Host {
                index: 1,
                port: None
            })
        );
        assert_eq!(p.describe(d.rule().unwrap()), "allow_hosts api.example.com");
        let audited = policy("allow_hosts = [\"a.test\"]\nenforce = \"audit\"");
        assert_eq!(
            audited.decide_name(&name("b.test")).0,
            Decision::WouldDeny(Refused::because(DenyReason::HostNotAllowed))
        );
        let closed = policy("mode = \"deny_all\"");
        let (d, _) = closed.decide_name(&name("a.test"));
        assert_eq!(
            d,
            Decision::Deny(Refused::by(DenyReason::PolicyDenyAll, Rule::DenyAll))
        );
        assert_eq!(closed.describe(d.rule().unwrap()), "mode deny_all");
        assert_eq!(
            policy("mode = \"allow_all\"")
                .decide_name(&name("a.test"))
                .0,
            Decision::Allow(Rule::AllowAll)
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
            Err(Refused::by(
                DenyReason::PortNotAllowed,
                Rule::Cidr { index: 0 }
            ))
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

    #[test]
    fn decisions_name_the_rule_that_decided() {
        let p = policy(
            r#"
allow_hosts = ["*.github.com", { host = "ssh.github.com", ports = [22] }, "github.com", "*.api.github.com"]
allow_ports = [443]
allow_cidrs = ["192.0.2.0/28", { cidr = "10.0.0.0/24", ports = [5432] }]
deny_cidrs = ["198.51.100.0/24", "1.2.3.0/24"]
resolve_private = ["127.0.0.1/32"]
"#,
        );
        let d = |h: &str, port| p.decide_target(&Destination::parse(h).unwrap(), port);
        let host = |index, port| Rule::Host {
            index,
            port: Some(port),
        };
        // The entry's own ports before allow_ports, the exact entry before a wildcard, the
        // longest wildcard first.
        assert_eq!(
            d("ssh.github.com", 22),
            Decision::Allow(host(1, PortList::Entry))
        );
        assert_eq!(
            d("ssh.github.com", 443),
            Decision::Allow(host(1, PortList::AllowPorts))
        );
        assert_eq!(
            d("x.github.com", 443),
            Decision::Allow(host(0, PortList::AllowPorts))
        );
        assert_eq!(
            d("v3.api.github.com", 443),
            Decision::Allow(host(3, PortList::AllowPorts))
        );
        assert_eq!(
            d("github.com", 443),
            Decision::Allow(host(2, PortList::AllowPorts))
        );
        // A port neither list has: the entry that matched is named.
        assert_eq!(
            d("x.github.com", 22),
            Decision::Deny(Refused {
                reason: DenyReason::PortNotAllowed,
                rule: Some(Rule::Host {
                    index: 0,
                    port: None
                }),
            })
        );
        assert_eq!(
            d("example.com", 443),
            Decision::Deny(Refused::because(DenyReason::HostNotAllowed))
        );
        // Addresses.
        assert_eq!(
            d("192.0.2.1", 8080),
            Decision::Allow(Rule::Cidr { index: 0 })
        );
        assert_eq!(
            d("10.0.0.9", 5432),
            Decision::Allow(Rule::Cidr { index: 1 })
        );
        assert_eq!(
            d("10.0.0.9", 22),
            Decision::Deny(Refused {
                reason: DenyReason::PortNotAllowed,
                rule: Some(Rule::Cidr { index: 1 }),
            })
        );
        assert_eq!(
            d("1.2.3.4", 443),
            Decision::Deny(Refused {
                reason: DenyReason::AddressDeniedByPolicy,
                rule: Some(Rule::DenyCidr { index: 1 }),
            })
        );
        assert_eq!(
            d("169.254.169.254", 80),
            Decision::Deny(Refused {
                reason: DenyReason::AddressDenied,
                rule: Some(Rule::Builtin("link-local")),
            })
        );
        assert_eq!(
            d("8.8.8.8", 443),
            Decision::Deny(Refused::because(DenyReason::IpLiteralNotAllowed))
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            p.decide_addr(ip("127.0.0.1"), 443, true),
            Decision::Allow(Rule::ResolvePrivate { index: 0 })
        );
        assert_eq!(
            p.decide_addr(ip("140.82.112.3"), 443, true),
            Decision::Allow(Rule::Unlisted)
        );
        // The modes.
        let all = CompiledPolicy::new(&Policy::allow_all());
        assert_eq!(
            all.decide_target(&Destination::parse("a.example").unwrap(), 22),
            Decision::Allow(Rule::AllowAll)
        );
        assert_eq!(
            all.decide_target(&Destination::parse("8.8.8.8").unwrap(), 22),
            Decision::Allow(Rule::AllowAll)
        );
        let none = CompiledPolicy::new(&Policy::deny_all());
        assert_eq!(
            none.decide_target(&Destination::parse("a.example").unwrap(), 443),
            Decision::Deny(Refused {
                reason: DenyReason::PolicyDenyAll,
                rule: Some(Rule::DenyAll),
            })
        );
        // Audit: the would-deny carries the allowlist's refusal, a denial the floor's.
        let a = policy("enforce = \"audit\"\nallow_hosts = [\"github.com\"]");
        assert_eq!(
            a.decide_target(&Destination::parse("github.com").unwrap(), 22),
            Decision::WouldDeny(Refused {
                reason: DenyReason::PortNotAllowed,
                rule: Some(Rule::Host {
                    index: 0,
                    port: None
                }),
            })
        );
        // Described as configured.
        let pol = crate::testing::policy(
            "allow_hosts = [\"*.github.com\", { host = \"ssh.github.com\", ports = [22] }]\nallow_cidrs = [{ cidr = \"10.0.0.0/24\", ports = [5432] }]\ndeny_cidrs = [\"1.2.3.0/24\"]",
        );
        assert_eq!(
            host(1, PortList::Entry).describe(&pol),
            "allow_hosts ssh.github.com (ports 22)"
        );
        assert_eq!(
            Rule::Cidr { index: 0 }.describe(&pol),
            "allow_cidrs 10.0.0.0/24 (ports 5432)"
        );
        assert_eq!(
            Rule::DenyCidr { index: 0 }.describe(&pol),
            "deny_cidrs 1.2.3.0/24"
        );
    }

    #[test]
    fn every_reason_has_its_own_name() {
        let mut names: Vec<&str> = DenyReason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DenyReason::ALL.len());
    }

    /// One vocabulary across the kernel and the proxy: the kernel's `REASON_*` codes and the
    /// proxy's reasons never share a name with different meanings, and each kernel code whose
    /// cause the proxy also refuses maps to that proxy reason.
    #[test]
    fn kernel_and_proxy_reasons_map_one_way() {
        use egress_common::{
            REASON_DENY_CIDR, REASON_HOST_LOOPBACK, REASON_INBOUND, REASON_NO_LISTENER,
            REASON_NO_POLICY, REASON_NOT_ALLOWED, REASON_SOCKET_TYPE, reason_name,
        };
        let pinned = [
            (
                REASON_NOT_ALLOWED,
                "kernel-destination-not-allowed",
                Some("ip-literal-not-allowed"),
            ),
            (REASON_NO_POLICY, "kernel-no-policy-entry", None),
            (REASON_NO_LISTENER, "kernel-proxy-not-running", None),
            (REASON_SOCKET_TYPE, "kernel-socket-type-not-allowed", None),
            (
                REASON_HOST_LOOPBACK,
                "kernel-host-loopback",
                Some("address-denied"),
            ),
            (
                REASON_DENY_CIDR,
                "kernel-deny-cidr",
                Some("address-denied-by-policy"),
            ),
            (REASON_INBOUND, "kernel-inbound-not-allowed", None),
        ];
        for (code, kernel, proxy) in pinned {
            assert_eq!(reason_name(code), kernel);
            assert_eq!(
                DenyReason::from_kernel(code).map(DenyReason::as_str),
                proxy,
                "{kernel}"
            );
        }
        // Every code the kernel has is pinned above (codes are 1..; 0 and beyond are unknown).
        assert_eq!(pinned.len(), 7);
        assert_eq!(reason_name(0), "kernel-denied");
        assert_eq!(reason_name(8), "kernel-denied");
        assert_eq!(DenyReason::from_kernel(8), None);
        // No name means one thing to the kernel and another to the proxy.
        for r in DenyReason::ALL {
            for code in 0..=8 {
                assert_ne!(r.as_str(), reason_name(code), "{r:?}");
            }
        }
    }
}
