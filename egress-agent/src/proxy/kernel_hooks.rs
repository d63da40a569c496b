//! The proxy's [`InterceptHooks`] backed by the kernel's redirect maps
//! ([`KernelRedirects`]): listener admission and original destinations come from `ORIG_BY_TUPLE`, and every DNS answer
//! with direct ports becomes a per-cgroup allowance in `DIRECT4`/`DIRECT6`. The kernel side
//! (`bpf`) knows nothing of the proxy; this adapter is where the two meet.
use std::sync::Arc;

use super::InterceptHooks;
use super::admission::{Admission, Admitted, ConnKey};
use super::dns::{Answer, AnswerSink};
use crate::bpf::redirects::KernelRedirects;

impl InterceptHooks {
    /// Hooks backed by the kernel's maps (the daemon and `exec`).
    pub fn kernel(redirects: &Arc<KernelRedirects>) -> InterceptHooks {
        InterceptHooks {
            admission: Arc::new(Kernel(redirects.clone())),
            answers: Arc::new(Kernel(redirects.clone())),
        }
    }
}

struct Kernel(Arc<KernelRedirects>);

impl Admission for Kernel {
    fn admit(&self, conn: &ConnKey) -> Option<Admitted> {
        let original = self.0.take_record(conn.peer, conn.local)?;
        Some(Admitted { original })
    }
}

impl AnswerSink for Kernel {
    fn answered(&self, answer: &Answer<'_>) {
        if answer.direct_ports.is_empty() || answer.direct_addrs.is_empty() {
            return;
        }
        // Allowances are per confined cgroup: a listener that serves no one cgroup (the
        // daemon's shared per-policy listeners) allows nothing directly.
        let Some(entry_id) = answer.identity.and_then(|i| i.cgroup_id) else {
            return;
        };
        let failed = self.0.allow_direct(
            entry_id,
            answer.direct_addrs,
            answer.direct_ports,
            answer.ttl,
        );
        if failed > 0 {
            tracing::warn!(
                policy = answer.policy,
                name = %answer.name,
                failed,
                "writing direct allowances failed; those addresses stay behind the proxy"
            );
        }
    }
}
