//! Listener admission: a listener serves only connections the kernel sent it from its own
//! workload, and learns there where a redirected one was going.
//!
//! A listener's address is reachable by more than its workload: any host process (root or not)
//! can connect to `127.0.0.1:<port>` or `169.254.100.1:<port>`, and so can `allow_all`,
//! unlabelled and `--network host` containers — none of which runs the workload's connect hook.
//! So a listener never trusts the peer's address: connect4/6 records every connection it sends
//! to one of a cgroup's listeners (the explicit listener through the endpoint or directly, the
//! transparent listener, DNS over TCP), sock_ops re-keys the record by the 4-tuple once the
//! connection is established, and the accepting task takes (reads and deletes) the record
//! before it reads a byte. No record: the connection is closed unread and a
//! `listener-foreign-peer` event names the peer (docs/threat-model.md, "Listener admission").
//! A record admits one connection; nothing the client *sends* takes part.
//!
//! The connect hook sends a cgroup only to its own listeners, so a record proves the peer is a
//! workload this listener serves. The record also carries the original destination of a
//! transparently redirected connection: the proxy can't ask `SO_ORIGINAL_DST` (no netfilter NAT
//! is involved: the cgroup connect hook rewrites the destination). The proxy uses it for the
//! port (the policy check runs on the name from the SNI/Host and **this** port) and for the
//! denial event; it never dials the original address (see `transparent`).
//!
//! [`Admission`] is the interface the kernel side implements (`kernel_hooks`); [`StaticAdmission`]
//! is the double tests and benchmarks use. A proxy context without [`super::InterceptHooks`]
//! admits nobody unless it was built with [`super::ProxyContext::admit_any_peer`] (tests and
//! benchmarks, where no kernel sends anything).
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use super::Shared;
use super::act::At;
use egress_policy::DenyReason;

/// The accepted connection, as the kernel's map keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnKey {
    /// The client's socket address (`getpeername` of the accepted socket).
    pub peer: SocketAddr,
    /// The listener address the kernel sent the connection to (`getsockname`).
    pub local: SocketAddr,
}

/// What the kernel recorded when it sent an accepted connection to one of the agent's listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Admitted {
    /// Where a redirected connection was going; `None` for one sent to the explicit listener
    /// (through the proxy endpoint or straight to it).
    pub original: Option<SocketAddr>,
}

/// The kernel's records of connections sent to the agent's listeners. Asked once per accepted
/// connection, on the connection's task, before any byte is read: keep it a non-blocking
/// lookup. An implementation deletes the record as it answers (a record admits one
/// connection); records of connections that end before the proxy asks are the kernel side's to
/// expire.
pub trait Admission: Send + Sync + 'static {
    /// `None`: the kernel has no record of sending this connection here (it is refused).
    fn admit(&self, conn: &ConnKey) -> Option<Admitted>;
}

/// A test double: records keyed like the kernel's (removed when asked, like the kernel's), and
/// an optional answer for connections without a record (a client such as curl can't choose its
/// source port up front).
#[derive(Debug, Default)]
pub struct StaticAdmission {
    table: Mutex<HashMap<ConnKey, Admitted>>,
    fallback: Option<Admitted>,
}

impl StaticAdmission {
    /// Every connection without a record was redirected from `dst`.
    pub fn fixed(dst: SocketAddr) -> StaticAdmission {
        StaticAdmission {
            table: Mutex::default(),
            fallback: Some(Admitted {
                original: Some(dst),
            }),
        }
    }

    /// Every connection without a record was sent to the explicit listener (DNS over TCP and
    /// explicit-proxy tests).
    pub fn any() -> StaticAdmission {
        StaticAdmission {
            table: Mutex::default(),
            fallback: Some(Admitted { original: None }),
        }
    }

    /// Record that the connection `conn` was redirected from `dst`.
    pub fn insert(&self, conn: ConnKey, dst: SocketAddr) {
        if let Ok(mut t) = self.table.lock() {
            t.insert(
                conn,
                Admitted {
                    original: Some(dst),
                },
            );
        }
    }
}

impl Admission for StaticAdmission {
    fn admit(&self, conn: &ConnKey) -> Option<Admitted> {
        let hit = self.table.lock().ok().and_then(|mut t| t.remove(conn));
        hit.or(self.fallback)
    }
}

/// Which of a workload's listeners accepted a connection (named in the refusal event).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Listener {
    Explicit,
    Transparent,
    DnsTcp,
}

impl Listener {
    fn as_str(self) -> &'static str {
        match self {
            Listener::Explicit => "explicit",
            Listener::Transparent => "transparent",
            Listener::DnsTcp => "dns-tcp",
        }
    }
}

/// Admit the connection accepted from `peer` at `local` on `which` listener of `shared`, or
/// refuse it: an event naming the peer, and `None` — the caller closes the connection without
/// reading from it. `local` unknown: refused.
pub(crate) fn admit(
    shared: &Shared,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    which: Listener,
) -> Option<Admitted> {
    let found = match (shared.ctx.interception(), local) {
        (Some(hooks), Some(local)) => hooks.admission.admit(&ConnKey { peer, local }),
        // No kernel records: only a context built for tests and benchmarks admits anyone.
        (None, _) if shared.ctx.admits_any_peer() => Some(Admitted { original: None }),
        _ => None,
    };
    if found.is_none() {
        refused(shared, peer, local, which);
    }
    found
}

fn refused(shared: &Shared, peer: SocketAddr, local: Option<SocketAddr>, which: Listener) {
    // No destination (the peer never got to say one): host, ip and port stay empty, so
    // nothing turns the event into a rule (`suggest`); the peer is in the context.
    let (peer_s, local_s) = (peer.to_string(), local.map(|l| l.to_string()));
    let mut context = vec![("peer", peer_s.as_str()), ("listener", which.as_str())];
    if let Some(local) = &local_s {
        context.push(("listener_addr", local.as_str()));
    }
    let _ = shared.refuse(
        &At::nowhere("tcp").context(&context),
        DenyReason::ListenerForeignPeer,
    );
    tracing::debug!(
        policy = %shared.name,
        %peer,
        listener = which.as_str(),
        "refused a connection the kernel did not send from this listener's workload"
    );
}
