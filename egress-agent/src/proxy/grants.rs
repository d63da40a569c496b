//! A listener's run grants: host:port pairs an operator approved for this workload alone
//! ([`crate::asks`], scope `run`), laid over the configured policy. The listener's compiled
//! policy is always the union of the two: a reload replaces the configured part and keeps the
//! grants; a grant's TTL ending removes it; the workload ending drops the listener and its
//! grants with it. Every change is announced like a reload, so connections the narrower policy
//! refuses end ([`super::narrow`]).
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use egress_policy::matcher::HostPattern;
use egress_policy::name::HostName;
use egress_policy::{CompiledPolicy, HostEntry, Policy};

use super::Shared;

/// The configured policy and the grants on top of it.
pub(crate) struct Overlay {
    base: Arc<Policy>,
    grants: Vec<(u64, HostEntry)>,
}

impl Overlay {
    pub(crate) fn new(base: Arc<Policy>) -> Overlay {
        Overlay {
            base,
            grants: Vec::new(),
        }
    }

    /// The policy the listener decides with. A grant is an `allow_hosts` entry with its one
    /// port; a `deny_all` policy stays `deny_all` (its listener is never asked: nothing reaches
    /// it), an `allow_all` one needs none.
    fn effective(&self) -> Policy {
        let mut p = (*self.base).clone();
        p.allow_hosts
            .extend(self.grants.iter().map(|(_, e)| e.clone()));
        p
    }

    /// The configured policy, for `/v1/self`.
    pub(crate) fn base(&self) -> Arc<Policy> {
        self.base.clone()
    }

    /// The run grants, for `/v1/self`.
    pub(crate) fn granted(&self) -> Vec<(u64, String)> {
        self.grants
            .iter()
            .map(|(id, e)| {
                (
                    *id,
                    format!("{}:{}", e.pattern, e.ports.first().copied().unwrap_or(0)),
                )
            })
            .collect()
    }
}

impl Shared {
    /// A reload: the configured part is `policy` now, the grants stay.
    pub(crate) fn set_base(&self, policy: &Policy) {
        let mut o = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        o.base = Arc::new(policy.clone());
        self.recompile(&o);
    }

    /// A new listener of a workload the registry kept across a restart: it owns that
    /// workload's requests again and gets its run grants back ([`crate::asks::Asks::adopt`]).
    pub(crate) fn adopt_requests(&self) {
        let (Some(asks), Some(key), Some(me)) =
            (self.ctx.asks(), self.durable.as_ref(), self.me.upgrade())
        else {
            return;
        };
        let me: Arc<dyn crate::asks::GrantTarget> = me;
        let n = asks.adopt(key, self.listener_id, &Arc::downgrade(&me));
        if n > 0 {
            tracing::info!(policy = %self.name, container = %key.container, requests = n,
                "access requests restored to this workload's listener");
        }
    }

    fn recompile(&self, o: &Overlay) {
        self.policy
            .store(Arc::new(CompiledPolicy::new(&o.effective())));
        self.policy_changed.send_replace(());
    }

    fn revoke(&self, id: u64) {
        let mut o = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let before = o.grants.len();
        o.grants.retain(|(g, _)| *g != id);
        if o.grants.len() != before {
            tracing::info!(policy = %self.name, grant = id, "run grant ended (its TTL)");
            self.recompile(&o);
        }
    }
}

impl crate::asks::GrantTarget for Shared {
    fn grant(&self, id: u64, host: &HostName, port: u16, ttl: Option<Duration>) {
        let mut entry = HostEntry::from(HostPattern::Exact(host.clone()));
        entry.ports = vec![port];
        {
            let mut o = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
            o.grants.push((id, entry));
            self.recompile(&o);
        }
        tracing::info!(policy = %self.name, grant = id, host = %host, port, ?ttl, "run grant");
        if let Some(ttl) = ttl {
            let me = self.me.clone();
            // Holds only a weak reference: a listener that ends takes its grants with it.
            tokio::spawn(async move {
                tokio::time::sleep(ttl).await;
                if let Some(s) = me.upgrade() {
                    s.revoke(id);
                }
            });
        }
    }
}
