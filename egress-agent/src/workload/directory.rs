//! Cgroup id → container, for attributing kernel denial events to a container, its policy and
//! its context labels. Written by the enforcer, read by the event drain.
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::events::{CTX_NAMESPACE, CTX_POD, ContainerRef, DenialEvent};

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
    /// Cgroups *inside* an enforced one (a pod's containers, whose entry is the pod's) → the
    /// context that names them (`k8s.container.name`), for events that carry the caller's
    /// cgroup.
    members: HashMap<u64, BTreeMap<String, String>>,
    released_members: VecDeque<(Instant, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub container: ContainerRef,
    pub policy: String,
    /// Where the policy came from: `label`, `annotation`, `default`, `namespace default`,
    /// `unlabeled`, `inline`, `exec --policy`, `fail-closed` (the console shows it).
    pub source: String,
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
        if let Some(task) = ev.task_cgroup_id
            && let Ok(m) = self.inner.read()
            && let Some(names) = m.members.get(&task)
        {
            ev.context.extend(names.clone());
        }
    }
    /// A cgroup inside an enforced one, and the context that names it (a pod's container).
    pub fn set_member(&self, cgroup_id: u64, context: BTreeMap<String, String>) {
        if let Ok(mut m) = self.inner.write() {
            m.purge();
            m.released_members.retain(|(_, id)| *id != cgroup_id);
            m.members.insert(cgroup_id, context);
        }
    }
    /// Forget a member (after the grace period, like an entry).
    pub fn remove_member(&self, cgroup_id: u64) {
        if let Ok(mut m) = self.inner.write() {
            m.purge();
            m.released_members.push_back((Instant::now(), cgroup_id));
        }
    }
    /// The context naming a member cgroup, if it is one.
    pub fn member(&self, cgroup_id: u64) -> Option<BTreeMap<String, String>> {
        self.inner.read().ok()?.members.get(&cgroup_id).cloned()
    }
    /// Members known now (tests, status).
    pub fn members(&self) -> usize {
        self.inner.read().map(|m| m.members.len()).unwrap_or(0)
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
    /// The pods (namespace, name) with a live entry (not released).
    pub fn pods(&self) -> HashSet<(String, String)> {
        let Ok(m) = self.inner.read() else {
            return HashSet::new();
        };
        let released: HashSet<u64> = m.released.iter().map(|(_, id)| *id).collect();
        m.live
            .iter()
            .filter(|(id, _)| !released.contains(id))
            .filter_map(|(_, e)| {
                Some((
                    e.context.get(CTX_NAMESPACE)?.clone(),
                    e.context.get(CTX_POD)?.clone(),
                ))
            })
            .collect()
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
        while let Some((t, id)) = self.released_members.front().copied() {
            if t.elapsed() < Directory::GRACE {
                break;
            }
            self.released_members.pop_front();
            self.members.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str) -> DirEntry {
        DirEntry {
            source: "label".to_owned(),
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
        assert!(d.pods().is_empty(), "a container is not a pod");
        let mut pod = entry("p");
        pod.context.extend([
            (CTX_NAMESPACE.to_owned(), "ci".to_owned()),
            (CTX_POD.to_owned(), "p".to_owned()),
        ]);
        d.set(12, pod);
        assert_eq!(d.pods(), HashSet::from([("ci".to_owned(), "p".to_owned())]));
        d.remove(12);
        assert!(d.pods().is_empty(), "a released pod is gone");
        // Released: still attributed during the grace period.
        d.remove(10);
        assert!(d.get(10).is_some());
        assert_eq!(d.len(), 0);
        // A member cgroup (a pod's container) adds the context that names it.
        d.set_member(
            11,
            BTreeMap::from([("k8s.container.name".to_owned(), "main".to_owned())]),
        );
        let mut ev = DenialEvent::proxy("deny_all", None, None, 9000, "tcp", "x");
        ev.cgroup_id = Some(10);
        ev.task_cgroup_id = Some(11);
        d.enrich(&mut ev);
        assert_eq!(ev.policy, "web");
        assert_eq!(
            ev.context.get("k8s.container.name").map(String::as_str),
            Some("main")
        );
        d.remove_member(11);
        assert_eq!(d.members(), 1, "kept for the grace period");
        // Re-set (restart with the same id) cancels the release.
        d.set(10, entry("a"));
        assert_eq!(d.len(), 1);
        let mut other = DenialEvent::proxy("deny_all", None, None, 1, "tcp", "x");
        other.cgroup_id = Some(11);
        d.enrich(&mut other);
        assert!(other.container.is_none() && other.policy == "deny_all");
    }
}
