//! The accept loop every proxy listener runs (explicit and transparent): the per-listener and
//! global connection bounds, metrics, backoff on accept errors, and the [`Slot`] through which
//! each handler admits its connection before reading a byte (only connections the kernel sent
//! from the listener's own workload are served: [`super::admission`]).
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Shared;
use super::admission::{self, Admitted, Listener};
use super::client::{CLIENT, Client};
use crate::handover::Open;

/// What an accepted connection holds until it ends: its places in the connection bounds (this
/// listener's and the global one), and its count among the open connections (after a hand-over,
/// this process drains them). The handler keeps it in its future, so it goes when the
/// connection's task ends or is dropped. It also knows which listener accepted the connection:
/// every handler's first step is [`Slot::admit`].
pub(crate) struct Slot {
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    _open: Open,
    which: Listener,
    /// The connection's local address (the listener's, when it is bound to one address).
    local: Option<SocketAddr>,
}

impl Slot {
    /// A connection of `shared`'s listener holding `permits` (its own, the global one), counted
    /// as open from now on.
    pub(crate) fn new(
        shared: &Shared,
        permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
        which: Listener,
        local: Option<SocketAddr>,
    ) -> Slot {
        Slot {
            _permits: permits,
            _open: shared.ctx.sockets().open_one(),
            which,
            local,
        }
    }

    /// Admit the connection (accepted from `peer`) by the kernel's record, before a byte of it
    /// is read; `None`: refused (an event was recorded), close it unread. A map lookup, on the
    /// connection's task rather than the accept loop's.
    pub(crate) fn admit(&self, shared: &Shared, peer: SocketAddr) -> Option<Admitted> {
        admission::admit(shared, peer, self.local, self.which)
    }
}

/// Accept on `listener` (the workload's `which` listener) until `shutdown` completes, handing
/// each connection (with a token cancelled when the listener stops, and its [`Slot`], which
/// `handle` admits it with first) to `handle` on a task of its own (kept by the listener's
/// tracker, `Shared::tasks`), in a `conn` span (policy, peer) that every log line of the
/// connection carries.
pub(crate) async fn accept_loop<F, Fut>(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()>,
    stop_rx: CancellationToken,
    which: Listener,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr, Arc<Shared>, CancellationToken, Slot) -> Fut
        + Clone
        + Send
        + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let conns = shared.ctx.inner.conns.clone();
    let mine = shared.conns.clone();
    // A listener bound to one address: every connection's local address is that one (no
    // `getsockname` per connection); bound to a wildcard, each connection is asked.
    let bound = listener
        .local_addr()
        .ok()
        .filter(|a| !a.ip().is_unspecified());
    tokio::pin!(shutdown);
    loop {
        // Backpressure: at this listener's bound, then at the global one, stop accepting (the
        // kernel backlog holds the rest). This listener's permit comes first, so a listener
        // at its own bound holds no global permit while it waits.
        let permits = tokio::select! {
            p = async {
                let mine = mine.clone().acquire_owned().await?;
                let global = conns.clone().acquire_owned().await?;
                Ok::<_, tokio::sync::AcquireError>((mine, global))
            } => match p { Ok(p) => p, Err(_) => break },
            () = &mut shutdown => break,
        };
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = &mut shutdown => break,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Some(c) = &shared.counters {
                    c.connection();
                }
                let span = tracing::debug_span!("conn", policy = %shared.name, %peer);
                // Where the identity has several workloads (a pod), its events name the client.
                let local = bound.or_else(|| stream.local_addr().ok());
                let client = shared
                    .identity
                    .as_ref()
                    .and_then(|i| i.clients.as_ref())
                    .and(local)
                    .map(|local| Client::tcp(peer, local));
                let slot = Slot::new(&shared, permits, which, local);
                // The handler's future is the task's (no block around it): a block awaiting it
                // would hold the handler's arguments (and the client) once more beside the
                // future made from them, for the connection's whole life, and awaiting a future
                // made outside would hold that future twice.
                let conn = handle(stream, peer, shared.clone(), stop_rx.clone(), slot);
                match client {
                    Some(c) => shared.tasks.spawn(CLIENT.scope(c, conn).instrument(span)),
                    None => shared.tasks.spawn(conn.instrument(span)),
                };
            }
            Err(e) => {
                // EMFILE/ENFILE and friends: back off instead of spinning.
                tracing::warn!(policy = %shared.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
