//! The containers' kernel entries (pinned policy map) and the cgroup-id directory that
//! attributes kernel events to containers.
//!
//! Fail closed: when a container's policy can't be written, `deny_all` is written in its place;
//! only when that fails too is the container refused ([`Written::Failed`]: the caller stops it).
use std::net::{SocketAddr, SocketAddrV4};
use std::path::Path;

use super::directory::{DirEntry, Directory};
use crate::bpf::PinnedState;
use crate::cgroup;
use crate::events::ContainerRef;
use crate::policy::kernel::{Endpoints, InterceptAddrs, KernelPolicy};
use crate::policy::{DENY_ALL, Policy};

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

pub struct Entries {
    state: PinnedState,
    directory: Directory,
    endpoint4: SocketAddrV4,
    endpoint6: Option<SocketAddr>,
}

impl Entries {
    pub fn new(
        state: PinnedState,
        directory: Directory,
        endpoint4: SocketAddrV4,
        endpoint6: Option<SocketAddr>,
    ) -> Entries {
        Entries {
            state,
            directory,
            endpoint4,
            endpoint6,
        }
    }

    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// Write `policy` for `cgroup_id` with the container's `listener` (and its interception
    /// sockets) and `published` TCP ports.
    fn write(
        &mut self,
        cgroup_id: u64,
        policy: &Policy,
        listener: Option<(SocketAddr, InterceptAddrs)>,
        published: &[u16],
    ) -> Result<(), String> {
        let listener = listener.filter(|(a, _)| a.is_ipv4());
        let endpoints = Endpoints {
            endpoint4: Some(SocketAddr::V4(self.endpoint4)),
            listener4: listener.map(|(a, _)| a),
            endpoint6: self.endpoint6,
            listener6: None,
            intercept4: listener.map(|(_, i)| i).unwrap_or_default(),
            intercept6: InterceptAddrs::default(),
        };
        let kp = KernelPolicy::compile(policy, endpoints, published).map_err(|e| e.to_string())?;
        self.state
            .set_policy(cgroup_id, &kp)
            .map_err(|e| e.to_string())
    }

    /// Write the container's policy, or `deny_all` (no listener, no published ports) if that
    /// fails.
    pub fn write_or_deny(
        &mut self,
        cgroup_id: u64,
        policy: &Policy,
        listener: Option<(SocketAddr, InterceptAddrs)>,
        published: &[u16],
    ) -> Written {
        match self.write(cgroup_id, policy, listener, published) {
            Ok(()) => Written::Policy,
            Err(why) => self.deny(cgroup_id, why),
        }
    }

    /// Confine `cgroup_id` as `deny_all` because of `why`.
    pub fn deny(&mut self, cgroup_id: u64, why: String) -> Written {
        match self.write(cgroup_id, &Policy::deny_all(), None, &[]) {
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
        policy: &str,
        container: ContainerRef,
        context: std::collections::BTreeMap<String, String>,
    ) {
        let owner = format!("docker:{}", container.name);
        if let Err(e) = self.state.set_name(cgroup_id, policy, &owner) {
            tracing::warn!(container = %container.id, cgroup_id, error = %e, "recording the policy name failed");
        }
        self.directory.set(
            cgroup_id,
            DirEntry {
                container,
                policy: policy.to_owned(),
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
        self.record(cgroup_id, DENY_ALL, container, context);
    }

    /// Remove the entries of cgroups that no longer exist (anywhere in the hierarchy).
    pub fn prune(&mut self, mount: &Path) {
        // The cgroup listing must be taken after the map keys are read (bpf::PinnedState::prune):
        // a listing taken first would prune entries written meanwhile for new cgroups.
        let mount = mount.to_owned();
        match self
            .state
            .prune(|| cgroup::all_ids(&mount).into_keys().collect())
        {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "pruned entries of vanished cgroups")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "prune failed"),
        }
    }
}
