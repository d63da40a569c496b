//! A reload applies to what is open: every connection carried to one checked target (a
//! pass-through tunnel, kernel-spliced or not; an intercepted TLS connection; transparent plain
//! HTTP) ends when a reload makes its listener's policy refuse that target.
//!
//! [`PolicyHandle::set`](super::PolicyHandle::set) swaps the policy, then announces it on the
//! listener's `policy_changed` channel. Each carried connection waits on that channel (no cost
//! while nothing changes: one receiver in its task) and decides its target again with the
//! listener's current policy — the name and port (`decide_target`), and the address the
//! upstream connection reached (`decide_addr`). An enforced refusal ends the connection as a
//! listener stop does (a spliced tunnel is reset) and is recorded as a denial with
//! `context.ended = "policy-reload"`; an audited policy's would-deny lets it run.
//!
//! Requests on kept-alive connections were already decided one by one against the current
//! policy; this is for what a single decision opened.
use std::net::IpAddr;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::Shared;
use super::act::At;
use super::request::Target;
use egress_policy::Decision;
use egress_policy::name::Destination;

/// Resolves when `stop` is cancelled, or when the listener's policy, reloaded, refuses `target`
/// (reached at `addr`), after recording that refusal.
///
/// Every open tunnel holds this future: a function returning an `async move` block (an `async
/// fn` would keep each argument twice), and the waiting loop inline.
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` stores arguments used across `.await` twice; per-tunnel memory"
)]
pub(crate) fn until_stopped_or_refused(
    shared: Arc<Shared>,
    target: Target,
    addr: Option<IpAddr>,
    stop: CancellationToken,
) -> impl Future<Output = ()> + Send {
    async move {
        let mut reloads = shared.policy_changed.subscribe();
        let refused = async {
            loop {
                // Decided again at once (a reload between the connection's decision and the
                // subscription is not missed: the same decision as at dial time otherwise), then
                // at every reload.
                if refused_now(&shared, &target, addr) {
                    return;
                }
                if reloads.changed().await.is_err() {
                    // The listener is gone: `stop` ends the connection.
                    return std::future::pending().await;
                }
            }
        };
        tokio::select! {
            () = stop.cancelled() => {}
            () = refused => {}
        }
    }
}

/// Whether the listener's current policy refuses `target` (at `addr`), enforced; if so, the
/// refusal is recorded (with `context.ended = "policy-reload"`).
#[must_use]
fn refused_now(shared: &Shared, target: &Target, addr: Option<IpAddr>) -> bool {
    let policy = shared.policy.load();
    let via_name = matches!(target.dest, Destination::Name(_));
    let refused = match policy.decide_target(&target.dest, target.port) {
        Decision::Deny(r) => r,
        _ => match addr.map(|ip| policy.decide_addr(ip, target.port, via_name)) {
            Some(Decision::Deny(r)) => r,
            _ => return false,
        },
    };
    let at = At::target(target, "tcp")
        .ip(addr)
        .context(&[("ended", "policy-reload")]);
    let denial = shared.deny(&policy, &at, refused);
    tracing::info!(
        policy = %shared.name,
        %target,
        reason = denial.reason.as_str(),
        "connection closed: the reloaded policy refuses its target"
    );
    true
}
