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
use super::matcher::HostPattern;
use super::rules::RequestRule;

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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Default `allowlist`.
    #[serde(default)]
    pub mode: Mode,
    /// Exact names and `*.suffix` wildcards (strictly below the suffix: `*.x` does not match `x`).
    #[serde(default)]
    pub allow_hosts: Vec<HostPattern>,
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
}

fn default_true() -> bool {
    true
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
            allow_hosts: Vec::new(),
            allow_ports: default_ports(),
            allow_cidrs: Vec::new(),
            deny_cidrs: Vec::new(),
            allow_inbound: Vec::new(),
            allow_published_ports: true,
            enforce: Enforce::Enforce,
            credentials: Vec::new(),
            request_rules: Vec::new(),
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

/// A semantic error found by [`Config::validate`], before it is located in the source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// Dotted path, e.g. `policies.ci.deny_cidrs[1]`.
    pub field: String,
    pub message: String,
}

pub(crate) fn verr(field: impl Into<String>, message: impl Into<String>) -> ValidationError {
    ValidationError {
        field: field.into(),
        message: message.into(),
    }
}

impl Policy {
    /// Checks one policy; `base` is its dotted path for error messages.
    pub fn validate(&self, base: &str) -> Result<(), ValidationError> {
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
        super::credentials::validate(self, base)?;
        super::rules::validate(&self.request_rules, base)?;
        Ok(())
    }
}
