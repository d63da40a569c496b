//! The policy model: what a policy says ([`Policy`], [`Mode`], [`CidrRule`]) and its own checks.
//!
//! Parsing files and locating errors in them is `config`'s job; this module knows nothing of
//! files. The proxy ([`super::CompiledPolicy`]) and the kernel ([`super::kernel`]) compile a
//! [`Policy`] into what each of them needs.
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use super::credentials::CredentialBinding;
pub use super::host_entry::{Access, HostEntry, MAX_ENTRY_PORTS, PresetName};
use super::matcher::HostPattern;
use super::rules::RequestRule;
pub use super::validation::{ValidationError, verr};

/// Built-in policy names; always present, cannot be redefined.
pub const ALLOW_ALL: &str = "allow_all";
pub const DENY_ALL: &str = "deny_all";
/// Built-in audit policy: an allowlist that allows nothing, in `enforce = "audit"`. Nothing is
/// blocked (beyond what `allow_all` refuses) and everything is recorded as would-deny: the policy
/// to watch a workload you have never watched (`agent.default_policy = "audit"`).
pub const AUDIT: &str = "audit";

/// Policy mode, shared with the kernel side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Everything allowed (the proxy still refuses the built-in deny list: it runs in the host's
    /// network namespace, so its loopback and private ranges are the host's).
    AllowAll,
    /// Nothing allowed.
    DenyAll,
    /// Only `allow_hosts` on `allow_ports` (through the proxy) and `allow_cidrs` (direct).
    #[default]
    Allowlist,
}

/// Whether a policy's refusals are enforced or only recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Enforce {
    /// Refuse what the policy does not allow (the default).
    #[default]
    Enforce,
    /// Let it through, and record a would-deny event with the same fields a denial has. Only for
    /// `allowlist`: what is let through is bounded by what `allow_all` allows (the proxy still
    /// refuses the built-in deny list, `deny_cidrs` and malformed requests).
    Audit,
}

impl Enforce {
    fn is_enforce(&self) -> bool {
        *self == Enforce::Enforce
    }
}

fn default_ports() -> Vec<u16> {
    vec![443]
}

/// A policy. Read through [`Policy`]'s `Deserialize`, which expands `presets` into
/// `allow_hosts` (see `presets`, where its `Deserialize` is); written back, `allow_hosts` holds only the policy's own
/// entries and `presets` keeps the names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, remote = "Self")]
pub struct Policy {
    /// Default `allowlist`.
    #[serde(default)]
    pub mode: Mode,
    /// Built-in presets (`["github", "python"]`) whose hosts are added to `allow_hosts` when the
    /// policy is read, each entry marked with its preset ([`HostEntry::preset`]). Default none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub presets: Vec<PresetName>,
    /// Presets of `presets` whose hosts are read-only ([`HostEntry::access`]): reads and git
    /// fetch only, under TLS interception. Their entries lose ports of their own (git over
    /// SSH): no proxy reads those connections. Default none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read_only_presets: Vec<PresetName>,
    /// Repositories (`"acme/api"`, `"acme/*"`) the policy's read-only hosts take writes to: git
    /// push, the REST API, uploads (see `forge`). Makes the forge presets of `presets` read-only
    /// (`forge::FORGE_PRESETS`); needs read-only entries. Default none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repos: Vec<crate::forge::RepoPattern>,
    /// Exact names and `*.suffix` wildcards (strictly below the suffix: `*.x` does not match `x`),
    /// each a string or `{ host = "github.com", ports = [22] }` (ports of its own, see
    /// [`HostEntry`]). Once read, also the entries of `presets` (after the policy's own).
    #[serde(default, serialize_with = "own_hosts")]
    pub allow_hosts: Vec<HostEntry>,
    /// Ports allowed for `allow_hosts`. Default `[443]`.
    #[serde(default = "default_ports")]
    pub allow_ports: Vec<u16>,
    /// Direct (kernel-level) allows; also the only way to reach a private or special address
    /// through the proxy, or to CONNECT to an IP literal in allowlist mode.
    #[serde(default)]
    pub allow_cidrs: Vec<CidrRule>,
    /// Added to the built-in deny list; wins over everything. May not overlap `allow_cidrs`.
    #[serde(default)]
    pub deny_cidrs: Vec<IpNet>,
    /// Peers that may connect *in* to the cgroup's TCP listeners: `"10.0.0.0/24"` (any local port)
    /// or `{ cidr = "10.0.0.0/24", ports = [8080] }` (those local ports). Every other inbound
    /// connection is refused by the kernel before it is accepted. `allow_cidrs` entries without
    /// ports count as inbound allows too. Not for `allow_all`, which allows everything.
    #[serde(default)]
    pub allow_inbound: Vec<CidrRule>,
    /// Docker: the TCP ports the operator published (`docker run -p`) accept connections from
    /// anyone (publishing is an explicit operator decision). Default true; false refuses them
    /// like any other inbound connection.
    #[serde(default = "default_true")]
    pub allow_published_ports: bool,
    /// `enforce` (default) or `audit` (record would-deny events, block nothing the allowlist
    /// refuses). `allowlist` only.
    #[serde(default, skip_serializing_if = "Enforce::is_enforce")]
    pub enforce: Enforce,
    /// Credential bindings: the secret a host gets, added by the proxy (TLS interception for
    /// that host). Default none. See `policy::credentials`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<CredentialBinding>,
    /// Method/path rules for hosts (TLS interception for those hosts). Default none. See
    /// `policy::rules`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_rules: Vec<RequestRule>,
    /// Ranges of the built-in deny list (private, loopback, ...) that names in `allow_hosts` may
    /// resolve into, reached **through the proxy only**: no direct kernel allow (unlike
    /// `allow_cidrs`), never for IP literals, never as a direct-port address. Default `[]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resolve_private: Vec<IpNet>,
    /// Transparent interception (allowlist only): TCP from the confined cgroup to any address on
    /// an `allow_ports` port is redirected by the kernel to this policy's transparent listener,
    /// which decides on the TLS SNI or HTTP Host exactly as for CONNECT. Unset = `true` for
    /// `allowlist`; setting it for another mode is an error. See [`Policy::transparent`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transparent: Option<bool>,
    /// Services of the workload's own host it may reach directly (a local inference server):
    /// `[{ port = 11434 }]`, optionally `{ port = 11434, name = "ollama" }`. Reached at the
    /// host's address as the workload sees it and nowhere else: the gateway of its bridge
    /// network (what the agent's DNS answers for `host.docker.internal`), loopback for `exec`
    /// and host-network workloads. TCP and UDP to that port only. Allowlist only. Default none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_host_services: Vec<HostService>,
}

/// One `allow_host_services` entry: a port of the workload's own host, and an optional label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostService {
    pub port: u16,
    /// What it is (`"ollama"`): shown where the policy is shown, nothing else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl fmt::Display for HostService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(n) => write!(f, "host port {} ({n})", self.port),
            None => write!(f, "host port {}", self.port),
        }
    }
}

/// The name the agent's DNS answers with the workload's host address when its policy allows
/// host services (`allow_host_services`); Docker Desktop's name for the host.
pub const HOST_SERVICES_NAME: &str = "host.docker.internal";

fn default_true() -> bool {
    true
}

/// `allow_hosts` as written: the policy's own entries, not those its presets added.
fn own_hosts<S: serde::Serializer>(hosts: &[HostEntry], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(hosts.iter().filter(|h| h.preset.is_none()))
}

impl Policy {
    pub fn allow_all() -> Policy {
        Policy {
            mode: Mode::AllowAll,
            ..Policy::deny_all()
        }
    }
    pub fn deny_all() -> Policy {
        Policy {
            mode: Mode::DenyAll,
            presets: Vec::new(),
            read_only_presets: Vec::new(),
            repos: Vec::new(),
            allow_hosts: Vec::new(),
            allow_ports: default_ports(),
            allow_cidrs: Vec::new(),
            deny_cidrs: Vec::new(),
            allow_inbound: Vec::new(),
            allow_published_ports: true,
            enforce: Enforce::Enforce,
            credentials: Vec::new(),
            request_rules: Vec::new(),
            resolve_private: Vec::new(),
            transparent: None,
            allow_host_services: Vec::new(),
        }
    }
    /// The built-in [`AUDIT`] policy.
    pub fn audit() -> Policy {
        Policy {
            mode: Mode::Allowlist,
            enforce: Enforce::Audit,
            ..Policy::deny_all()
        }
    }
    /// True when refusals are only recorded.
    pub fn audits(&self) -> bool {
        self.enforce == Enforce::Audit
    }

    /// The one-word kind the CLI, the API and the status page show: `allow_all`, `deny_all`,
    /// `audit` or `allowlist`.
    pub fn badge(&self) -> &'static str {
        match self.mode {
            Mode::AllowAll => "allow_all",
            Mode::DenyAll => "deny_all",
            Mode::Allowlist if self.audits() => "audit",
            Mode::Allowlist => "allowlist",
        }
    }

    /// Is transparent interception on? Only ever for `allowlist` (default on).
    pub fn transparent(&self) -> bool {
        self.mode == Mode::Allowlist && self.transparent.unwrap_or(true)
    }

    /// Does this policy get a DNS responder? Every `allowlist` policy (also with `transparent =
    /// false`: entries with ports need the agent's answers); `allow_all` is untouched by the
    /// kernel and `deny_all` gets no DNS at all.
    pub fn answers_dns(&self) -> bool {
        self.mode == Mode::Allowlist
    }

    /// Does any host of this policy need TLS interception: a credential binding, request rules,
    /// or a read-only entry?
    pub fn intercepts_some_host(&self) -> bool {
        !self.credentials.is_empty()
            || !self.request_rules.is_empty()
            || self.allow_hosts.iter().any(|h| h.access.is_read_only())
    }

    /// The policy's own `allow_hosts` entries (what it says itself, without its presets').
    pub fn own_hosts(&self) -> impl Iterator<Item = &HostEntry> {
        self.allow_hosts.iter().filter(|h| h.preset.is_none())
    }

    /// The ports of `allow_host_services` (sorted, deduplicated); empty unless the policy is an
    /// allowlist (the only mode whose direct allows the kernel reads).
    pub fn host_service_ports(&self) -> Vec<u16> {
        if self.mode != Mode::Allowlist {
            return Vec::new();
        }
        let mut ports: Vec<u16> = self.allow_host_services.iter().map(|s| s.port).collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// The ports of `{ host, ports }` entries (sorted, deduplicated): direct TCP to the addresses
    /// the agent's DNS answers for those names. Empty unless the policy answers DNS.
    pub fn direct_ports(&self) -> Vec<u16> {
        if !self.answers_dns() {
            return Vec::new();
        }
        let mut ports: Vec<u16> = self
            .allow_hosts
            .iter()
            .flat_map(|h| h.ports.iter().copied())
            .collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }
}

/// An `allow_cidrs` entry: `"10.0.0.5/32"` (all ports) or `{ cidr = "10.0.0.5/32", ports = [5432] }`.
/// A bare address means a single host (/32 or /128).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrRule {
    pub net: IpNet,
    /// Empty = all ports.
    pub ports: Vec<u16>,
}

impl CidrRule {
    pub fn allows_port(&self, port: u16) -> bool {
        self.ports.is_empty() || self.ports.contains(&port)
    }
}

fn parse_net(s: &str) -> Result<IpNet, String> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    let net: IpNet = s.parse().map_err(|_| format!("invalid CIDR {s:?}"))?;
    if net.trunc() != net {
        return Err(format!(
            "CIDR {s:?} has host bits set; did you mean \"{}\"?",
            net.trunc()
        ));
    }
    Ok(net)
}

impl Serialize for CidrRule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        if self.ports.is_empty() {
            return s.collect_str(&self.net);
        }
        let mut st = s.serialize_struct("CidrRule", 2)?;
        st.serialize_field("cidr", &self.net.to_string())?;
        st.serialize_field("ports", &self.ports)?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for CidrRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CidrRule;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a CIDR string or { cidr = \"...\", ports = [...] }")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<CidrRule, E> {
                Ok(CidrRule {
                    net: parse_net(s).map_err(E::custom)?,
                    ports: Vec::new(),
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<CidrRule, A::Error> {
                let mut cidr: Option<String> = None;
                let mut ports: Option<Vec<u16>> = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "cidr" if cidr.is_none() => cidr = Some(map.next_value()?),
                        "ports" if ports.is_none() => ports = Some(map.next_value()?),
                        "cidr" | "ports" => return Err(de::Error::duplicate_field("cidr/ports")),
                        other => return Err(de::Error::unknown_field(other, &["cidr", "ports"])),
                    }
                }
                let cidr = cidr.ok_or_else(|| de::Error::missing_field("cidr"))?;
                let net = parse_net(&cidr).map_err(de::Error::custom)?;
                let ports = ports.unwrap_or_default();
                if ports.contains(&0) {
                    return Err(de::Error::custom("port 0 is not a port"));
                }
                Ok(CidrRule { net, ports })
            }
        }
        d.deserialize_any(V)
    }
}

impl Policy {
    /// Checks one policy; `base` is its dotted path for error messages.
    // Long: independent checks, a few lines each, in the order of the policy's fields.
    pub fn validate(&self, base: &str) -> Result<(), ValidationError> {
        for (i, name) in self.presets.iter().enumerate() {
            let field = format!("{base}.presets[{i}]");
            if self.mode != Mode::Allowlist {
                return Err(verr(
                    field,
                    "presets add allow_hosts: they need mode = \"allowlist\"",
                ));
            }
            if self.presets[..i].contains(name) {
                return Err(verr(
                    field,
                    format!("preset {:?} is listed twice", name.as_str()),
                ));
            }
        }
        for (i, name) in self.read_only_presets.iter().enumerate() {
            let field = format!("{base}.read_only_presets[{i}]");
            if !self.presets.contains(name) {
                return Err(verr(
                    field,
                    format!(
                        "preset {:?} is not in presets: add it there too (read_only_presets narrows presets the policy uses)",
                        name.as_str()
                    ),
                ));
            }
            if self.read_only_presets[..i].contains(name) {
                return Err(verr(
                    field,
                    format!("preset {:?} is listed twice", name.as_str()),
                ));
            }
        }
        if !self.repos.is_empty() && !self.allow_hosts.iter().any(|h| h.access.is_read_only()) {
            return Err(verr(
                format!("{base}.repos"),
                "repos lets read-only hosts take writes to those repositories, and this policy has none: add presets = [\"github\"] (a forge preset is read-only with repos), read_only_presets, or { host = \"...\", access = \"read-only\" } entries",
            ));
        }
        for (i, repo) in self.repos.iter().enumerate() {
            if self.repos[..i].contains(repo) {
                return Err(verr(
                    format!("{base}.repos[{i}]"),
                    format!("{repo} is listed twice"),
                ));
            }
        }
        for (i, port) in self.allow_ports.iter().enumerate() {
            if *port == 0 {
                return Err(verr(
                    format!("{base}.allow_ports[{i}]"),
                    "port 0 is not a port",
                ));
            }
        }
        if self.mode == Mode::Allowlist
            && !self.allow_hosts.is_empty()
            && self.allow_ports.is_empty()
        {
            return Err(verr(
                format!("{base}.allow_ports"),
                "allow_hosts given but no allow_ports",
            ));
        }
        if self.enforce == Enforce::Audit && self.mode != Mode::Allowlist {
            return Err(verr(
                format!("{base}.enforce"),
                match self.mode {
                    Mode::AllowAll => {
                        "audit needs mode = \"allowlist\" (allow_all refuses nothing to audit)"
                    }
                    _ => {
                        "audit needs mode = \"allowlist\"; an allowlist with no allow_hosts (or the built-in \"audit\" policy) audits everything"
                    }
                },
            ));
        }
        for (field, rules) in [
            ("allow_cidrs", &self.allow_cidrs),
            ("allow_inbound", &self.allow_inbound),
        ] {
            for (i, rule) in rules.iter().enumerate() {
                if rule.ports.len() > egress_common::MAX_RULE_PORTS {
                    return Err(verr(
                        format!("{base}.{field}[{i}]"),
                        format!(
                            "at most {} ports per entry (split it into several entries)",
                            egress_common::MAX_RULE_PORTS
                        ),
                    ));
                }
            }
        }
        if self.transparent.is_some() && self.mode != Mode::Allowlist {
            return Err(verr(
                format!("{base}.transparent"),
                "only allowlist policies are intercepted (allow_all is untouched, deny_all gets nothing)",
            ));
        }
        if self.transparent() {
            let mut ports = self.allow_ports.clone();
            ports.sort_unstable();
            ports.dedup();
            if ports.len() > egress_common::MAX_RULE_PORTS {
                return Err(verr(
                    format!("{base}.allow_ports"),
                    format!(
                        "transparent interception takes at most {} ports ({} given); set transparent = false to list more (clients then need the proxy variables)",
                        egress_common::MAX_RULE_PORTS,
                        ports.len()
                    ),
                ));
            }
        }
        for (i, net) in self.resolve_private.iter().enumerate() {
            let field = format!("{base}.resolve_private[{i}]");
            if net.trunc() != *net {
                return Err(verr(
                    field,
                    format!(
                        "CIDR {net} has host bits set; did you mean \"{}\"?",
                        net.trunc()
                    ),
                ));
            }
            if !super::addr::builtin_covers(net) {
                return Err(verr(
                    field,
                    format!(
                        "{net} is not inside one range of the built-in deny list; addresses outside it need no entry"
                    ),
                ));
            }
            if let Some(d) = self
                .deny_cidrs
                .iter()
                .find(|d| d.contains(net) || net.contains(*d))
            {
                return Err(verr(
                    field,
                    format!("{net} overlaps deny_cidrs entry {d}; an address can't be both"),
                ));
            }
        }
        for (i, net) in self.deny_cidrs.iter().enumerate() {
            if net.trunc() != *net {
                return Err(verr(
                    format!("{base}.deny_cidrs[{i}]"),
                    format!(
                        "CIDR {net} has host bits set; did you mean \"{}\"?",
                        net.trunc()
                    ),
                ));
            }
            for rule in &self.allow_cidrs {
                if net.contains(&rule.net) || rule.net.contains(net) {
                    return Err(verr(
                        format!("{base}.deny_cidrs[{i}]"),
                        format!(
                            "{net} overlaps allow_cidrs entry {}; an address can't be both",
                            rule.net
                        ),
                    ));
                }
            }
        }
        self.validate_local(base)?;
        let patterns: Vec<HostPattern> =
            self.allow_hosts.iter().map(|e| e.pattern.clone()).collect();
        let scope = super::credentials::Scope {
            deny_all: self.mode == Mode::DenyAll,
            allowlist: self.mode == Mode::Allowlist,
            allow_hosts: &patterns,
            allow_ports: &self.allow_ports,
        };
        super::credentials::validate(&self.credentials, &scope, base)?;
        super::rules::validate(&self.request_rules, base)?;
        Ok(())
    }
}

impl Policy {
    /// `allow_host_services` and the `lan` entries of `allow_hosts` (local model access).
    fn validate_local(&self, base: &str) -> Result<(), ValidationError> {
        for (i, s) in self.allow_host_services.iter().enumerate() {
            let field = format!("{base}.allow_host_services[{i}]");
            if self.mode != Mode::Allowlist {
                return Err(verr(
                    field,
                    "host services are direct allows: they need mode = \"allowlist\"",
                ));
            }
            match s.port {
                0 => return Err(verr(field, "port 0 is not a port")),
                53 => {
                    return Err(verr(
                        field,
                        "port 53 always goes to the agent's DNS responder; a host resolver can't be allowed",
                    ));
                }
                _ => {}
            }
            if self.allow_host_services[..i]
                .iter()
                .any(|o| o.port == s.port)
            {
                return Err(verr(field, format!("port {} is listed twice", s.port)));
            }
            if let Some(n) = &s.name
                && (n.is_empty() || n.len() > 64 || n.chars().any(char::is_control))
            {
                return Err(verr(
                    field,
                    "name: 1 to 64 characters, no control characters",
                ));
            }
        }
        if self.allow_host_services.len() > egress_common::MAX_RULE_PORTS {
            return Err(verr(
                format!("{base}.allow_host_services"),
                format!(
                    "at most {} host services per policy",
                    egress_common::MAX_RULE_PORTS
                ),
            ));
        }
        for (i, e) in self.allow_hosts.iter().enumerate() {
            if e.lan && self.resolve_private.is_empty() {
                return Err(verr(
                    format!("{base}.allow_hosts[{i}]"),
                    format!(
                        "{} is a LAN entry, and resolve_private is empty: list the private ranges its addresses may be in (e.g. resolve_private = [\"192.168.0.0/16\"])",
                        e.pattern
                    ),
                ));
            }
        }
        Ok(())
    }
}
