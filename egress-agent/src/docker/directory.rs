//! Cgroup id → container, for attributing kernel denial events to a container, its policy and
//! its context labels. Written by the enforcer, read by the event drain.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::events::{ContainerRef, DenialEvent};

/// Shared view cgroup id → container, for attributing kernel events. Entries of released cgroups
/// are kept for [`Directory::GRACE`] so events drained from the ring buffer after a container
/// exits are still attributed (cgroup ids are inode numbers: not reused that fast).
#[derive(Debug, Clone, Default)]
pub struct Directory {
    inner: Arc<RwLock<DirInner>>,
}

#[derive(Debug, Default)]
struct DirInner {
    live: HashMap<u64, DirEntry>,
    released: VecDeque<(Instant, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub container: ContainerRef,
    pub policy: String,
    pub context: BTreeMap<String, String>,
}

impl Directory {
    pub const GRACE: Duration = Duration::from_secs(10);

    pub fn get(&self, cgroup_id: u64) -> Option<DirEntry> {
        self.inner.read().ok()?.live.get(&cgroup_id).cloned()
    }
    /// Fill container, context and policy of a kernel event from its cgroup id.
    pub fn enrich(&self, ev: &mut DenialEvent) {
        if let Some(id) = ev.cgroup_id
            && let Some(e) = self.get(id)
        {
            ev.container = Some(e.container);
            ev.context.extend(e.context);
            ev.policy = e.policy;
        }
    }
    pub(super) fn set(&self, cgroup_id: u64, e: DirEntry) {
        if let Ok(mut m) = self.inner.write() {
            m.purge();
            m.released.retain(|(_, id)| *id != cgroup_id);
            m.live.insert(cgroup_id, e);
        }
    }
    pub(super) fn remove(&self, cgroup_id: u64) {
        if let Ok(mut m) = self.inner.write() {
            m.purge();
            m.released.push_back((Instant::now(), cgroup_id));
        }
    }
    /// Live (not released) cgroups.
    pub fn len(&self) -> usize {
        self.inner
            .read()
            .map(|m| m.live.len() - m.released.len().min(m.live.len()))
            .unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DirInner {
    fn purge(&mut self) {
        while let Some((t, id)) = self.released.front().copied() {
            if t.elapsed() < Directory::GRACE {
                break;
            }
            self.released.pop_front();
            self.live.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str) -> DirEntry {
        DirEntry {
            container: ContainerRef {
                id: format!("{name}-id"),
                name: name.to_owned(),
            },
            policy: "web".to_owned(),
            context: BTreeMap::from([("run".to_owned(), "7".to_owned())]),
        }
    }

    #[test]
    fn directory_attributes_kernel_events_and_keeps_released_entries_for_a_while() {
        let d = Directory::default();
        d.set(10, entry("a"));
        let mut ev = DenialEvent::proxy("deny_all", None, None, 9000, "tcp", "x");
        ev.cgroup_id = Some(10);
        ev.context.insert("comm".to_owned(), "nc".to_owned());
        d.enrich(&mut ev);
        assert_eq!(ev.container.as_ref().map(|c| c.name.as_str()), Some("a"));
        assert_eq!(ev.policy, "web");
        assert_eq!(ev.context.get("run").map(String::as_str), Some("7"));
        assert_eq!(
            ev.context.get("comm").map(String::as_str),
            Some("nc"),
            "kernel context kept"
        );
        // Released: still attributed during the grace period.
        d.remove(10);
        assert!(d.get(10).is_some());
        assert_eq!(d.len(), 0);
        // Re-set (restart with the same id) cancels the release.
        d.set(10, entry("a"));
        assert_eq!(d.len(), 1);
        let mut other = DenialEvent::proxy("deny_all", None, None, 1, "tcp", "x");
        other.cgroup_id = Some(11);
        d.enrich(&mut other);
        assert!(other.container.is_none() && other.policy == "deny_all");
    }
}
