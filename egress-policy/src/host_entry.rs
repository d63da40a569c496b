//! One `allow_hosts` entry ([`HostEntry`]) and the name of the preset an entry came from
//! ([`PresetName`]). Below both `model` (a policy's entries) and `presets` (a preset's), so
//! neither depends on the other for them; a [`PresetName`] is checked against the built-in
//! presets when it is read (its `Deserialize` is in `presets`).
use std::fmt;
use std::sync::Arc;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use super::matcher::HostPattern;

/// A preset's name in a policy. Read, it is one of the built-in presets (see `presets`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PresetName(pub(crate) Arc<str>);

impl PresetName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PresetName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for PresetName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// What an `allow_hosts` entry lets a workload do with its host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    /// Every request the policy's other rules allow.
    #[default]
    Full,
    /// Reads only: `GET`, `HEAD`, `OPTIONS`, and git's fetch (`POST …/git-upload-pack`);
    /// nothing else, no protocol switch (WebSocket). Enforced by the request rules under TLS
    /// interception on every path (see `l7`).
    ReadOnly,
}

impl Access {
    pub fn is_read_only(self) -> bool {
        self == Access::ReadOnly
    }
}

/// Most ports one `allow_hosts` entry may carry (the kernel's per-rule bound for CIDR rules).
pub const MAX_ENTRY_PORTS: usize = 30;

/// One `allow_hosts` entry: `"github.com"` or `{ host = "github.com", ports = [22] }`.
///
/// An entry's own `ports` allow that name on those ports in addition to `allow_ports`: through
/// the proxy (CONNECT) like any allowed port, and **directly** (plain TCP, any protocol) to the
/// addresses the agent's DNS responder answered for the name to that cgroup, until the answer's
/// TTL runs out (the kernel keeps those addresses; see docs/architecture.md). Addresses that are
/// allowed only through `resolve_private` are never opened directly — unless the entry says
/// `lan = true` (a named endpoint on the operator's network, e.g. an inference server): then
/// the answered addresses inside `resolve_private` open directly on its ports too (never
/// loopback or link-local ones: the host is `allow_host_services`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    pub pattern: HostPattern,
    /// Sorted, deduplicated; empty for a plain string entry.
    pub ports: Vec<u16>,
    /// The preset this entry came from (`None`: the policy's own). Never written back: a policy
    /// serializes its own entries and its `presets`.
    pub preset: Option<PresetName>,
    /// `{ host = "...", access = "read-only" }`, or an entry of a preset in `read_only_presets`.
    pub access: Access,
    /// `{ host = "gpu-box.lan", ports = [8000], lan = true }`: its private answers (inside
    /// `resolve_private`) open directly on its ports, like public ones.
    pub lan: bool,
}

impl From<HostPattern> for HostEntry {
    fn from(pattern: HostPattern) -> Self {
        HostEntry {
            pattern,
            ports: Vec::new(),
            preset: None,
            access: Access::Full,
            lan: false,
        }
    }
}

impl fmt::Display for HostEntry {
    /// The pattern alone for a plain entry; `pattern (ports 22, 2222)` otherwise; `(preset
    /// github)` after an entry a preset added.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.pattern)?;
        if !self.ports.is_empty() {
            let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
            write!(f, " (ports {})", ports.join(", "))?;
        }
        if self.access.is_read_only() {
            write!(f, " (read-only)")?;
        }
        if self.lan {
            write!(f, " (lan)")?;
        }
        if let Some(p) = &self.preset {
            write!(f, " (preset {p})")?;
        }
        Ok(())
    }
}

impl Serialize for HostEntry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        if self.ports.is_empty() && !self.access.is_read_only() {
            return s.collect_str(&self.pattern);
        }
        let mut st = s.serialize_struct("HostEntry", 4)?;
        st.serialize_field("host", &self.pattern.to_string())?;
        if !self.ports.is_empty() {
            st.serialize_field("ports", &self.ports)?;
        }
        if self.access.is_read_only() {
            st.serialize_field("access", &self.access)?;
        }
        if self.lan {
            st.serialize_field("lan", &true)?;
        }
        st.end()
    }
}

impl<'de> Deserialize<'de> for HostEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HostEntry;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a host pattern or { host = \"...\", ports = [...] } (with lan = true for a private address) or { host = \"...\", access = \"read-only\" }",
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<HostEntry, E> {
                Ok(HostPattern::parse(s).map_err(E::custom)?.into())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HostEntry, A::Error> {
                let mut host: Option<String> = None;
                let mut ports: Option<Vec<u16>> = None;
                let mut access: Option<Access> = None;
                let mut lan: Option<bool> = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "host" if host.is_none() => host = Some(map.next_value()?),
                        "ports" if ports.is_none() => ports = Some(map.next_value()?),
                        "access" if access.is_none() => access = Some(map.next_value()?),
                        "lan" if lan.is_none() => lan = Some(map.next_value()?),
                        "host" | "ports" | "access" | "lan" => {
                            return Err(de::Error::duplicate_field("host/ports/access/lan"));
                        }
                        other => {
                            return Err(de::Error::unknown_field(
                                other,
                                &["host", "ports", "access", "lan"],
                            ));
                        }
                    }
                }
                let lan = lan.unwrap_or(false);
                let host = host.ok_or_else(|| de::Error::missing_field("host"))?;
                let pattern = HostPattern::parse(&host).map_err(de::Error::custom)?;
                let access = access.unwrap_or_default();
                if lan && (access.is_read_only() || ports.is_none()) {
                    return Err(de::Error::custom(
                        "lan = true opens the entry's own ports directly to its private addresses: give it ports (and no access)",
                    ));
                }
                if access.is_read_only() {
                    if ports.is_some() {
                        return Err(de::Error::custom(
                            "a read-only entry can't carry its own ports: they open direct connections no proxy reads (list the host alone; allow_ports gives the ports)",
                        ));
                    }
                    return Ok(HostEntry {
                        access,
                        ..HostEntry::from(pattern)
                    });
                }
                let mut ports = ports.ok_or_else(|| de::Error::missing_field("ports"))?;
                if ports.contains(&0) {
                    return Err(de::Error::custom("port 0 is not a port"));
                }
                ports.sort_unstable();
                ports.dedup();
                if ports.is_empty() {
                    return Err(de::Error::custom(
                        "ports = [] gives nothing: write the entry as a plain string",
                    ));
                }
                if ports.len() > MAX_ENTRY_PORTS {
                    return Err(de::Error::custom(format!(
                        "at most {MAX_ENTRY_PORTS} ports per allow_hosts entry"
                    )));
                }
                if lan && pattern.to_string().starts_with('*') {
                    return Err(de::Error::custom(
                        "a lan entry names one endpoint: no wildcards",
                    ));
                }
                Ok(HostEntry {
                    pattern,
                    ports,
                    preset: None,
                    access,
                    lan,
                })
            }
        }
        d.deserialize_any(V)
    }
}
