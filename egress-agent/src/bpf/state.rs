//! The pinned maps: per-cgroup policy entries, CIDR rules, counters.
//!
//! [`PinnedState::open`] opens the maps pinned under `<bpffs>/maps/` (works without the daemon,
//! from any process). Writes are ordered so a cgroup is never less restricted than its policy:
//! CIDR rules first, then the entry; removal deletes the entry first, then the rules.
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuHashMap};
use egress_common::{
    CIDR_ID_BITS, Cidr4Data, Cidr6Data, CidrRule, Counters, Direct4Key, Direct6Key, GlobalConfig,
    PolicyEntry, PolicyName, maps,
};
use ipnet::IpNet;

use super::BpfError;
use super::loader::maps_dir;
use egress_policy::kernel::{KernelPolicy, ip6_words};

/// One pair of LPM tries keyed by (entry id, address): `allow_cidrs` rules or inbound allows.
struct RuleTries {
    v4: LpmTrie<MapData, Cidr4Data, CidrRule>,
    v6: LpmTrie<MapData, Cidr6Data, CidrRule>,
    names: (&'static str, &'static str),
}

impl RuleTries {
    fn open(dir: &Path, names: (&'static str, &'static str)) -> Result<RuleTries, BpfError> {
        Ok(RuleTries {
            v4: open_map(dir, names.0)?
                .try_into()
                .map_err(map_err(names.0, "open"))?,
            v6: open_map(dir, names.1)?
                .try_into()
                .map_err(map_err(names.1, "open"))?,
            names,
        })
    }

    fn insert_all(
        &mut self,
        cgroup_id: u64,
        rules: Vec<(IpNet, CidrRule)>,
    ) -> Result<(), BpfError> {
        for (net, rule) in rules {
            match net {
                IpNet::V4(n) => {
                    let key = Key::new(
                        CIDR_ID_BITS + u32::from(n.prefix_len()),
                        Cidr4Data::new(cgroup_id, u32::from_ne_bytes(n.network().octets())),
                    );
                    self.v4
                        .insert(&key, rule, 0)
                        .map_err(map_err(self.names.0, "insert"))?;
                }
                IpNet::V6(n) => {
                    let key = Key::new(
                        CIDR_ID_BITS + u32::from(n.prefix_len()),
                        Cidr6Data::new(cgroup_id, ip6_words(&n.network())),
                    );
                    self.v6
                        .insert(&key, rule, 0)
                        .map_err(map_err(self.names.1, "insert"))?;
                }
            }
        }
        Ok(())
    }

    fn remove_all(&mut self, cgroup_id: u64) -> Result<(), BpfError> {
        let id = egress_common::split_id(cgroup_id);
        let keys4: Vec<Key<Cidr4Data>> = self
            .v4
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.data().id == id)
            .collect();
        for k in keys4 {
            match self.v4.remove(&k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(self.names.0, "remove")(e)),
            }
        }
        let keys6: Vec<Key<Cidr6Data>> = self
            .v6
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.data().id == id)
            .collect();
        for k in keys6 {
            match self.v6.remove(&k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(self.names.1, "remove")(e)),
            }
        }
        Ok(())
    }
}

/// Handles on the pinned maps.
pub struct PinnedState {
    dir: PathBuf,
    policies: HashMap<MapData, u64, PolicyEntry>,
    /// Direct allows (`EGRESS_CIDR4/6`).
    cidr: RuleTries,
    /// Inbound allows (`EGRESS_INBOUND4/6`).
    inbound: RuleTries,
    counters: PerCpuHashMap<MapData, u64, Counters>,
    config: Array<MapData, GlobalConfig>,
    names: HashMap<MapData, u64, PolicyName>,
    /// Direct allowances from DNS answers (removed with their entry).
    direct4: HashMap<MapData, Direct4Key, u64>,
    direct6: HashMap<MapData, Direct6Key, u64>,
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

/// Open the pinned map `name` under `dir` as the typed map `T`.
pub(crate) fn open_typed<T>(dir: &Path, name: &'static str) -> Result<T, BpfError>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    open_map(dir, name)?
        .try_into()
        .map_err(map_err(name, "open"))
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
            cidr: RuleTries::open(&dir, (maps::CIDR4, maps::CIDR6))?,
            inbound: RuleTries::open(&dir, (maps::INBOUND4, maps::INBOUND6))?,
            counters: open_map(&dir, maps::COUNTERS)?
                .try_into()
                .map_err(conv(maps::COUNTERS))?,
            config: open_map(&dir, maps::CONFIG)?
                .try_into()
                .map_err(conv(maps::CONFIG))?,
            names: open_map(&dir, maps::NAMES)?
                .try_into()
                .map_err(conv(maps::NAMES))?,
            direct4: open_typed(&dir, maps::DIRECT4)?,
            direct6: open_typed(&dir, maps::DIRECT6)?,
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
        self.cidr.insert_all(cgroup_id, policy.rules())?;
        self.inbound.insert_all(cgroup_id, policy.inbound_rules())?;
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
        self.cidr.remove_all(cgroup_id)?;
        self.inbound.remove_all(cgroup_id)?;
        self.remove_direct(cgroup_id)
    }

    /// Drop the DNS-answer allowances of `cgroup_id` (a new policy starts with none; they come
    /// back with the next answers).
    fn remove_direct(&mut self, cgroup_id: u64) -> Result<(), BpfError> {
        let keys4: Vec<Direct4Key> = self
            .direct4
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.entry_id == cgroup_id)
            .collect();
        for k in keys4 {
            match self.direct4.remove(&k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(maps::DIRECT4, "remove")(e)),
            }
        }
        let keys6: Vec<Direct6Key> = self
            .direct6
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.entry_id == cgroup_id)
            .collect();
        for k in keys6 {
            match self.direct6.remove(&k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(maps::DIRECT6, "remove")(e)),
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

    #[test]
    fn names_are_truncated_on_char_boundaries() {
        let long = "é".repeat(40);
        let f: [u8; 64] = fixed(&long);
        assert_eq!(unfixed(&f), "é".repeat(32));
    }
}
