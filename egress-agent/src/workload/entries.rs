//! The containers' kernel entries (pinned policy map) and the cgroup-id directory that
//! attributes kernel events to containers.
//!
//! Fail closed: when a container's policy can't be written, `deny_all` is written in its place;
//! only when that fails too is the container refused ([`Written::Failed`]: the caller stops it).
//!
//! The map is reached through [`KernelMap`], implemented by [`PinnedState`] (the only
//! implementation outside tests): a seam so unit tests can make writes fail.
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::Path;

use super::directory::{DirEntry, Directory};
use super::listeners::Bound;
use crate::bpf::{BpfError, PinnedState};
use crate::cgroup;
use crate::events::ContainerRef;
use egress_policy::kernel::{Endpoints, KernelPolicy};
use egress_policy::{DENY_ALL, Policy};

/// What was written for a container's cgroup.
#[must_use = "a container whose entry could not be written must be stopped"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// The policy asked for.
    Policy,
    /// `deny_all` instead, because writing the policy failed (why).
    DenyAll(String),
    /// Not even `deny_all` could be written (why): the container must be stopped.
    Failed(String),
}

/// The pinned maps as the entries use them ([`PinnedState`]'s methods of the same names).
pub trait KernelMap: Send {
    fn set_policy(&mut self, cgroup_id: u64, policy: &KernelPolicy) -> Result<(), BpfError>;
    fn remove_policy(&mut self, cgroup_id: u64) -> Result<(), BpfError>;
    fn set_name(&mut self, cgroup_id: u64, policy: &str, owner: &str) -> Result<(), BpfError>;
    /// See [`PinnedState::prune`]: `existing` is called after the keys were read.
    fn prune(&mut self, existing: &mut dyn FnMut() -> HashSet<u64>) -> Result<Vec<u64>, BpfError>;
}

impl KernelMap for PinnedState {
    fn set_policy(&mut self, cgroup_id: u64, policy: &KernelPolicy) -> Result<(), BpfError> {
        PinnedState::set_policy(self, cgroup_id, policy)
    }
    fn remove_policy(&mut self, cgroup_id: u64) -> Result<(), BpfError> {
        PinnedState::remove_policy(self, cgroup_id)
    }
    fn set_name(&mut self, cgroup_id: u64, policy: &str, owner: &str) -> Result<(), BpfError> {
        PinnedState::set_name(self, cgroup_id, policy, owner)
    }
    fn prune(&mut self, existing: &mut dyn FnMut() -> HashSet<u64>) -> Result<Vec<u64>, BpfError> {
        PinnedState::prune(self, existing)
    }
}

/// An error with its sources (the errno of a map write is two levels down).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

pub struct Entries {
    state: Box<dyn KernelMap>,
    directory: Directory,
    endpoint4: Option<SocketAddrV4>,
    endpoint6: Option<SocketAddr>,
    /// How the pinned names call this runtime's workloads (`docker:NAME`, `pod:NS/NAME`, or
    /// `exec:PID` for a command).
    runtime: &'static str,
}

impl Entries {
    pub fn new(
        state: PinnedState,
        directory: Directory,
        endpoint4: Option<SocketAddrV4>,
        endpoint6: Option<SocketAddr>,
        runtime: &'static str,
    ) -> Entries {
        Entries::with_map(Box::new(state), directory, endpoint4, endpoint6, runtime)
    }

    /// [`Entries::new`] on any [`KernelMap`] (tests inject failing ones).
    pub fn with_map(
        state: Box<dyn KernelMap>,
        directory: Directory,
        endpoint4: Option<SocketAddrV4>,
        endpoint6: Option<SocketAddr>,
        runtime: &'static str,
    ) -> Entries {
        Entries {
            state,
            directory,
            endpoint4,
            endpoint6,
            runtime,
        }
    }

    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// Write `policy` for `cgroup_id` with the workload's `listener` (and its interception
    /// sockets), `published` TCP ports and the addresses at which it reaches its `host` (where
    /// the policy's host services open).
    fn write(
        &mut self,
        cgroup_id: u64,
        policy: &Policy,
        listener: Bound,
        (published, host): (&[u16], &[IpAddr]),
    ) -> Result<(), String> {
        let v4 = listener.v4.filter(|(a, _)| a.is_ipv4());
        let v6 = listener.v6.filter(|(a, _)| a.is_ipv6());
        let endpoints = Endpoints {
            endpoint4: self.endpoint4.map(SocketAddr::V4),
            listener4: v4.map(|(a, _)| a),
            endpoint6: self.endpoint6,
            listener6: v6.map(|(a, _)| a),
            intercept4: v4.map(|(_, i)| i).unwrap_or_default(),
            intercept6: v6.map(|(_, i)| i).unwrap_or_default(),
        };
        let kp = KernelPolicy::compile(policy, endpoints, published)
            .and_then(|k| k.with_host_services(policy, host))
            .map_err(|e| with_sources(&e))?;
        self.state
            .set_policy(cgroup_id, &kp)
            .map_err(|e| with_sources(&e))
    }

    /// Write the container's policy, or `deny_all` (no listener, no published ports, no host
    /// services) if that fails. `reach`: its published TCP ports and its host's addresses.
    pub fn write_or_deny(
        &mut self,
        cgroup_id: u64,
        policy: &Policy,
        listener: Bound,
        reach: (&[u16], &[IpAddr]),
    ) -> Written {
        match self.write(cgroup_id, policy, listener, reach) {
            Ok(()) => Written::Policy,
            Err(why) => self.deny(cgroup_id, why),
        }
    }

    /// The agent's own cgroup: `allow_all`, no listener (see [`super::Enforcer::exempt_self`]).
    pub fn write_self(&mut self, cgroup_id: u64) -> Result<(), String> {
        self.write(
            cgroup_id,
            &Policy::allow_all(),
            Bound::default(),
            (&[], &[]),
        )
    }

    /// Confine `cgroup_id` as `deny_all` because of `why`.
    pub fn deny(&mut self, cgroup_id: u64, why: String) -> Written {
        match self.write(cgroup_id, &Policy::deny_all(), Bound::default(), (&[], &[])) {
            Ok(()) => Written::DenyAll(why),
            Err(again) => Written::Failed(format!("{why}; writing deny_all failed too: {again}")),
        }
    }

    pub fn remove(&mut self, cgroup_id: u64) {
        if let Err(e) = self.state.remove_policy(cgroup_id) {
            tracing::error!(cgroup_id, error = %e, "removing kernel entry failed");
        }
        self.directory.remove(cgroup_id);
    }

    /// Record who a cgroup belongs to: the policy name and owner in the pinned names (for
    /// `status`; bookkeeping only, a failure is logged) and the event directory.
    pub fn record(
        &mut self,
        cgroup_id: u64,
        (policy, source): (&str, String),
        container: ContainerRef,
        context: std::collections::BTreeMap<String, String>,
    ) {
        // `pod:NAMESPACE/NAME` for a Kubernetes pod (its context names it), `exec:PID` for a
        // command (its id), `docker:NAME` else.
        let owner = if self.runtime == "exec" {
            container.id.clone()
        } else if context.contains_key("k8s.pod.name") {
            format!("pod:{}", container.name)
        } else {
            format!("docker:{}", container.name)
        };
        if let Err(e) = self.state.set_name(cgroup_id, policy, &owner) {
            tracing::warn!(container = %container.id, cgroup_id, error = %e, "recording the policy name failed");
        }
        self.directory.set(
            cgroup_id,
            DirEntry {
                container,
                policy: policy.to_owned(),
                source,
                context,
            },
        );
    }

    /// Record a fail-closed `deny_all`.
    pub fn record_denied(
        &mut self,
        cgroup_id: u64,
        container: ContainerRef,
        context: std::collections::BTreeMap<String, String>,
    ) {
        self.record(
            cgroup_id,
            (DENY_ALL, "fail-closed".to_owned()),
            container,
            context,
        );
    }

    /// Remove the entries of cgroups that no longer exist (anywhere in the hierarchy).
    pub fn prune(&mut self, mount: &Path) {
        // The cgroup listing must be taken after the map keys are read (bpf::PinnedState::prune):
        // a listing taken first would prune entries written meanwhile for new cgroups.
        let mount = mount.to_owned();
        match self
            .state
            .prune(&mut || cgroup::all_ids(&mount).into_keys().collect())
        {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "pruned entries of vanished cgroups")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "prune failed"),
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use egress_policy::kernel::InterceptAddrs;
    use std::sync::{Arc, Mutex};

    /// A map whose `set_policy` fails for the first `fail` calls (as a full map does: E2BIG),
    /// recording every write that succeeded.
    #[derive(Clone, Default)]
    struct FailingMap {
        fail: Arc<Mutex<usize>>,
        written: Arc<Mutex<Vec<(u64, KernelPolicy)>>>,
    }

    fn full() -> BpfError {
        BpfError::Map {
            map: "EGRESS_POLICIES",
            op: "insert",
            source: aya::maps::MapError::SyscallError(aya::sys::SyscallError {
                call: "bpf_map_update_elem",
                io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
            }),
        }
    }

    impl KernelMap for FailingMap {
        fn set_policy(&mut self, cgroup_id: u64, policy: &KernelPolicy) -> Result<(), BpfError> {
            let mut fail = self.fail.lock().unwrap();
            if *fail > 0 {
                *fail -= 1;
                return Err(full());
            }
            self.written
                .lock()
                .unwrap()
                .push((cgroup_id, policy.clone()));
            Ok(())
        }
        fn remove_policy(&mut self, _: u64) -> Result<(), BpfError> {
            Ok(())
        }
        fn set_name(&mut self, _: u64, _: &str, _: &str) -> Result<(), BpfError> {
            Ok(())
        }
        fn prune(&mut self, _: &mut dyn FnMut() -> HashSet<u64>) -> Result<Vec<u64>, BpfError> {
            Ok(Vec::new())
        }
    }

    fn entries(fail: usize) -> (Entries, FailingMap) {
        let map = FailingMap::default();
        *map.fail.lock().unwrap() = fail;
        let e = Entries::with_map(
            Box::new(map.clone()),
            Directory::default(),
            Some("169.254.100.1:3128".parse().unwrap()),
            None,
            "docker",
        );
        (e, map)
    }

    fn allowlist() -> Policy {
        let c = crate::config::Config::from_toml_str(
            "[policies.web]\nallow_hosts = [\"a.test\"]\nallow_cidrs = [\"10.1.0.0/16\"]\n",
            Path::new("t.toml"),
        )
        .unwrap();
        c.policy("web").unwrap().clone()
    }

    const LISTENER: &str = "169.254.100.1:40000";

    #[test]
    fn the_policy_when_it_can_be_written() {
        let (mut e, map) = entries(0);
        let w = e.write_or_deny(
            7,
            &allowlist(),
            Bound {
                v4: Some((LISTENER.parse().unwrap(), InterceptAddrs::default())),
                v6: None,
            },
            (&[8080], &["172.17.0.1".parse().unwrap()]),
        );
        assert_eq!(w, Written::Policy);
        let written = map.written.lock().unwrap();
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].0, 7);
        assert_eq!(written[0].1.mode, egress_common::MODE_ALLOWLIST);
    }

    #[test]
    fn deny_all_when_the_policy_write_fails() {
        let (mut e, map) = entries(1);
        let w = e.write_or_deny(
            7,
            &allowlist(),
            Bound {
                v4: Some((LISTENER.parse().unwrap(), InterceptAddrs::default())),
                v6: None,
            },
            (&[8080], &["172.17.0.1".parse().unwrap()]),
        );
        let Written::DenyAll(why) = w else {
            panic!("expected deny_all, got {w:?}");
        };
        // The cause is named down to the errno.
        assert!(
            why.contains("EGRESS_POLICIES") && why.contains("os error 7"),
            "{why}"
        );
        let written = map.written.lock().unwrap();
        assert_eq!(written.len(), 1, "exactly the fallback was written");
        let (id, kp) = &written[0];
        assert_eq!(*id, 7);
        assert_eq!(kp.mode, egress_common::MODE_DENY_ALL);
        // deny_all: no listener, no direct allows, no published ports from anywhere.
        assert_eq!(kp.listener4, None);
        assert!(kp.allow.is_empty() && kp.inbound.is_empty(), "{kp:?}");
    }

    #[test]
    fn failed_when_deny_all_fails_too() {
        let (mut e, map) = entries(2);
        let w = e.write_or_deny(
            7,
            &allowlist(),
            Bound {
                v4: Some((LISTENER.parse().unwrap(), InterceptAddrs::default())),
                v6: None,
            },
            (&[8080], &["172.17.0.1".parse().unwrap()]),
        );
        let Written::Failed(why) = w else {
            panic!("expected a failure, got {w:?}");
        };
        assert!(why.contains("writing deny_all failed too"), "{why}");
        assert!(map.written.lock().unwrap().is_empty());
        // `deny` alone (the host layer's fallback) reports the double fault the same way.
        *map.fail.lock().unwrap() = 1;
        assert!(matches!(
            e.deny(8, "host layer failed".into()),
            Written::Failed(w) if w.starts_with("host layer failed; writing deny_all failed too")
        ));
    }
}
