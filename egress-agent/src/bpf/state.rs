//! The pinned maps: per-cgroup policy entries, CIDR rules, counters.
//!
//! [`PinnedState::open`] opens the maps pinned under `<bpffs>/maps/` (works without the daemon,
//! from any process). Writes are ordered so a cgroup is never less restricted than its policy:
//! CIDR rules first, then the entry; removal deletes the entry first, then the rules.
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuHashMap};
use egress_common::{
    CIDR_ALLOW, CIDR_ID_BITS, Cidr4Data, Cidr6Data, CidrRule, Counters, GlobalConfig,
    MAX_RULE_PORTS, MODE_ALLOW_ALL, MODE_ALLOWLIST, MODE_DENY_ALL, POLICY_FLAG_V6, PROTO_BIT_TCP,
    PROTO_BIT_UDP, PolicyEntry, PolicyName, maps,
};
use ipnet::IpNet;

use super::BpfError;
use super::loader::maps_dir;
use crate::config::{self, Mode};

/// The kernel's view of one policy for one cgroup: what [`PolicyEntry`] + CIDR rules encode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelPolicy {
    /// `MODE_*`.
    pub mode: u32,
    /// Stable endpoint(s) and this policy's listener(s). `listener*: None` = the proxy is not
    /// running: connections to the endpoint are refused (fail closed).
    pub endpoint4: Option<SocketAddr>,
    pub listener4: Option<SocketAddr>,
    pub endpoint6: Option<SocketAddr>,
    pub listener6: Option<SocketAddr>,
    /// Direct allows: network, ports (empty = all), TCP and UDP.
    pub allow: Vec<(IpNet, Vec<u16>)>,
}

impl KernelPolicy {
    /// From a configured policy and the proxy endpoints/listeners of this policy.
    pub fn from_config(
        policy: &config::Policy,
        endpoint4: Option<SocketAddr>,
        listener4: Option<SocketAddr>,
        endpoint6: Option<SocketAddr>,
        listener6: Option<SocketAddr>,
    ) -> Result<KernelPolicy, BpfError> {
        let mode = match policy.mode {
            Mode::AllowAll => MODE_ALLOW_ALL,
            Mode::DenyAll => MODE_DENY_ALL,
            Mode::Allowlist => MODE_ALLOWLIST,
        };
        for (what, a) in [("endpoint", endpoint4), ("listener", listener4)] {
            if matches!(a, Some(SocketAddr::V6(_))) {
                return Err(BpfError::Policy(format!("IPv4 {what} expected, got {a:?}")));
            }
        }
        for (what, a) in [("endpoint_v6", endpoint6), ("listener_v6", listener6)] {
            if matches!(a, Some(SocketAddr::V4(_))) {
                return Err(BpfError::Policy(format!("IPv6 {what} expected, got {a:?}")));
            }
        }
        let mut allow = Vec::new();
        for rule in &policy.allow_cidrs {
            if rule.ports.len() > MAX_RULE_PORTS {
                return Err(BpfError::Policy(format!(
                    "allow_cidrs {}: at most {MAX_RULE_PORTS} ports per rule in the kernel map",
                    rule.net
                )));
            }
            allow.push((rule.net.trunc(), rule.ports.clone()));
        }
        Ok(KernelPolicy {
            mode,
            endpoint4,
            listener4,
            endpoint6,
            listener6,
            allow,
        })
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
        PolicyEntry {
            mode: self.mode,
            flags: if self.endpoint6.is_some() {
                POLICY_FLAG_V6
            } else {
                0
            },
            rules_id,
            endpoint4_addr: e4,
            listener4_addr: l4,
            endpoint4_port: e4p,
            listener4_port: l4p,
            endpoint6_port: e6p,
            listener6_port: l6p,
            endpoint6_addr: e6,
            listener6_addr: l6,
        }
    }

    /// The LPM rules, with the ports of less specific allow rules merged into more specific ones
    /// (the kernel only looks at the longest match).
    pub fn rules(&self) -> Vec<(IpNet, CidrRule)> {
        if self.mode != MODE_ALLOWLIST {
            return Vec::new();
        }
        // Merge identical networks first.
        let mut by_net: BTreeMap<IpNet, Option<Vec<u16>>> = BTreeMap::new();
        for (net, ports) in &self.allow {
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
                protos: PROTO_BIT_TCP | PROTO_BIT_UDP,
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

fn ip6_words(ip: &Ipv6Addr) -> [u32; 4] {
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
        MODE_ALLOW_ALL => config::ALLOW_ALL,
        MODE_DENY_ALL => config::DENY_ALL,
        MODE_ALLOWLIST => "allowlist",
        _ => "unknown",
    }
}

/// Handles on the pinned maps.
pub struct PinnedState {
    dir: PathBuf,
    policies: HashMap<MapData, u64, PolicyEntry>,
    cidr4: LpmTrie<MapData, Cidr4Data, CidrRule>,
    cidr6: LpmTrie<MapData, Cidr6Data, CidrRule>,
    counters: PerCpuHashMap<MapData, u64, Counters>,
    config: Array<MapData, GlobalConfig>,
    names: HashMap<MapData, u64, PolicyName>,
}

fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    // Truncate on a char boundary so the stored prefix stays valid UTF-8.
    let mut end = s.len().min(N);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out[..end].copy_from_slice(&s.as_bytes()[..end]);
    out
}

fn unfixed(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn open_map(dir: &Path, name: &'static str) -> Result<Map, BpfError> {
    let path = dir.join(name);
    if !path.exists() {
        return Err(BpfError::NotLoaded {
            path: dir.to_owned(),
        });
    }
    let data = MapData::from_pin(&path).map_err(|source| BpfError::OpenMap {
        path: path.clone(),
        source,
    })?;
    Map::from_map_data(data).map_err(|source| BpfError::OpenMap { path, source })
}

fn map_err(map: &'static str, op: &'static str) -> impl FnOnce(aya::maps::MapError) -> BpfError {
    move |source| BpfError::Map { map, op, source }
}

/// Whether a map error is "no such key".
fn is_not_found(e: &aya::maps::MapError) -> bool {
    matches!(e, aya::maps::MapError::KeyNotFound)
        || matches!(e, aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOENT))
}

impl PinnedState {
    /// Open the maps pinned under `<bpffs>/maps/`.
    pub fn open(bpffs: &Path) -> Result<PinnedState, BpfError> {
        let dir = maps_dir(bpffs);
        let conv = |name: &'static str| map_err(name, "open");
        Ok(PinnedState {
            policies: open_map(&dir, maps::POLICIES)?
                .try_into()
                .map_err(conv(maps::POLICIES))?,
            cidr4: open_map(&dir, maps::CIDR4)?
                .try_into()
                .map_err(conv(maps::CIDR4))?,
            cidr6: open_map(&dir, maps::CIDR6)?
                .try_into()
                .map_err(conv(maps::CIDR6))?,
            counters: open_map(&dir, maps::COUNTERS)?
                .try_into()
                .map_err(conv(maps::COUNTERS))?,
            config: open_map(&dir, maps::CONFIG)?
                .try_into()
                .map_err(conv(maps::CONFIG))?,
            names: open_map(&dir, maps::NAMES)?
                .try_into()
                .map_err(conv(maps::NAMES))?,
            dir,
        })
    }

    pub fn maps_dir(&self) -> &Path {
        &self.dir
    }

    /// Record the host network namespace (the caller's) so own-netns loopback can be told apart.
    pub fn set_host_netns_cookie(&mut self, cookie: u64) -> Result<(), BpfError> {
        let cfg = GlobalConfig {
            host_netns_cookie: cookie,
            flags: 0,
        };
        self.config
            .set(0, cfg, 0)
            .map_err(map_err(maps::CONFIG, "set"))
    }

    pub fn global_config(&self) -> Result<GlobalConfig, BpfError> {
        self.config.get(&0, 0).map_err(map_err(maps::CONFIG, "get"))
    }

    /// Write (or replace) the policy of `cgroup_id`.
    pub fn set_policy(&mut self, cgroup_id: u64, policy: &KernelPolicy) -> Result<(), BpfError> {
        // Rules first (keyed by this cgroup id), then the entry that makes them reachable.
        self.remove_rules(cgroup_id)?;
        for (net, rule) in policy.rules() {
            match net {
                IpNet::V4(n) => {
                    let key = Key::new(
                        CIDR_ID_BITS + u32::from(n.prefix_len()),
                        Cidr4Data::new(cgroup_id, u32::from_ne_bytes(n.network().octets())),
                    );
                    self.cidr4
                        .insert(&key, rule, 0)
                        .map_err(map_err(maps::CIDR4, "insert"))?;
                }
                IpNet::V6(n) => {
                    let key = Key::new(
                        CIDR_ID_BITS + u32::from(n.prefix_len()),
                        Cidr6Data::new(cgroup_id, ip6_words(&n.network())),
                    );
                    self.cidr6
                        .insert(&key, rule, 0)
                        .map_err(map_err(maps::CIDR6, "insert"))?;
                }
            }
        }
        self.policies
            .insert(cgroup_id, policy.entry(cgroup_id), 0)
            .map_err(map_err(maps::POLICIES, "insert"))
    }

    /// Record the policy name and owner of `cgroup_id` (for `status` and events).
    pub fn set_name(&mut self, cgroup_id: u64, policy: &str, owner: &str) -> Result<(), BpfError> {
        let v = PolicyName {
            policy: fixed(policy),
            owner: fixed(owner),
        };
        self.names
            .insert(cgroup_id, v, 0)
            .map_err(map_err(maps::NAMES, "insert"))
    }

    /// `(policy, owner)` recorded for `cgroup_id`.
    pub fn name(&self, cgroup_id: u64) -> Option<(String, String)> {
        self.names
            .get(&cgroup_id, 0)
            .ok()
            .map(|n| (unfixed(&n.policy), unfixed(&n.owner)))
    }

    /// Remove the policy of `cgroup_id`, its rules, name and counters. Missing entries are fine.
    pub fn remove_policy(&mut self, cgroup_id: u64) -> Result<(), BpfError> {
        match self.policies.remove(&cgroup_id) {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(map_err(maps::POLICIES, "remove")(e)),
        }
        self.remove_rules(cgroup_id)?;
        match self.names.remove(&cgroup_id) {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(map_err(maps::NAMES, "remove")(e)),
        }
        match self.counters.remove(&cgroup_id) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(map_err(maps::COUNTERS, "remove")(e)),
        }
    }

    fn remove_rules(&mut self, cgroup_id: u64) -> Result<(), BpfError> {
        let id = egress_common::split_id(cgroup_id);
        let keys4: Vec<Key<Cidr4Data>> = self
            .cidr4
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.data().id == id)
            .collect();
        for k in keys4 {
            match self.cidr4.remove(&k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(maps::CIDR4, "remove")(e)),
            }
        }
        let keys6: Vec<Key<Cidr6Data>> = self
            .cidr6
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.data().id == id)
            .collect();
        for k in keys6 {
            match self.cidr6.remove(&k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(maps::CIDR6, "remove")(e)),
            }
        }
        Ok(())
    }

    pub fn policy(&self, cgroup_id: u64) -> Result<Option<PolicyEntry>, BpfError> {
        match self.policies.get(&cgroup_id, 0) {
            Ok(e) => Ok(Some(e)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(map_err(maps::POLICIES, "get")(e)),
        }
    }

    /// All policy entries.
    pub fn policies(&self) -> Result<Vec<(u64, PolicyEntry)>, BpfError> {
        self.policies
            .iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_err(maps::POLICIES, "iterate"))
    }

    /// Summed counters of a cgroup (zero when it has none yet).
    pub fn counters(&self, cgroup_id: u64) -> Result<Counters, BpfError> {
        match self.counters.get(&cgroup_id, 0) {
            Ok(per_cpu) => Ok(per_cpu.iter().fold(Counters::default(), |a, c| Counters {
                allowed: a.allowed + c.allowed,
                denied: a.denied + c.denied,
                proxied: a.proxied + c.proxied,
                events_lost: a.events_lost + c.events_lost,
            })),
            Err(e) if is_not_found(&e) => Ok(Counters::default()),
            Err(e) => Err(map_err(maps::COUNTERS, "get")(e)),
        }
    }

    /// Cgroup ids that have counters (includes cgroups denied for lack of an entry).
    pub fn counter_ids(&self) -> Vec<u64> {
        self.counters.keys().filter_map(Result::ok).collect()
    }

    /// Remove entries, rules, names and counters of cgroups that no longer exist.
    ///
    /// `existing` lists the cgroups that exist; it is called only *after* the map keys have been
    /// read. Writers create a cgroup before writing its entry, so any entry read here belongs to
    /// a cgroup created before the listing starts: a concurrent writer's fresh entry can never be
    /// mistaken for a stale one (the race a snapshot taken first would have).
    pub fn prune(
        &mut self,
        existing: impl FnOnce() -> std::collections::HashSet<u64>,
    ) -> Result<Vec<u64>, BpfError> {
        let mut ids: Vec<u64> = self.policies.keys().filter_map(Result::ok).collect();
        ids.extend(self.counter_ids());
        ids.extend(self.names.keys().filter_map(Result::ok));
        ids.sort_unstable();
        ids.dedup();
        let existing = existing();
        let mut removed = Vec::new();
        for id in ids {
            if !existing.contains(&id) {
                self.remove_policy(id)?;
                removed.push(id);
            }
        }
        Ok(removed)
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

    #[test]
    fn too_many_ports_are_rejected() {
        let rule = config::CidrRule {
            net: "10.0.0.0/8".parse().expect("net"),
            ports: (1..=40).collect(),
        };
        let p = config::Policy {
            allow_cidrs: vec![rule],
            ..config::Policy::deny_all()
        };
        assert!(KernelPolicy::from_config(&p, None, None, None, None).is_err());
    }

    #[test]
    fn names_are_truncated_on_char_boundaries() {
        let long = "é".repeat(40);
        let f: [u8; 64] = fixed(&long);
        assert_eq!(unfixed(&f), "é".repeat(32));
    }
}
