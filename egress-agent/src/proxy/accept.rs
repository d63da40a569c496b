//! The accept loop every proxy listener runs (explicit and transparent): the per-listener and
//! global connection bounds, metrics, backoff on accept errors, and admission (only connections
//! the kernel sent from the listener's own workload are served: [`super::admission`]).
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Shared;
use super::admission::{self, Admitted, Listener};
use super::client::{CLIENT, Client};

/// Accept on `listener` (the workload's `which` listener) until `shutdown` completes. Each
/// connection is admitted on a task of its own before a byte is read (refused: closed unread),
/// then handed with the kernel's record and a token cancelled when the listener stops to
/// `handle`, in a `conn` span (policy, peer) that every log line of the connection carries.
pub(crate) async fn accept_loop<F, Fut>(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()>,
    stop_rx: CancellationToken,
    which: Listener,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr, Admitted, Arc<Shared>, CancellationToken) -> Fut
        + Clone
        + Send
        + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let conns = shared.ctx.inner.conns.clone();
    let mine = shared.conns.clone();
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
                let client = shared
                    .identity
                    .as_ref()
                    .and_then(|i| i.clients.as_ref())
                    .and_then(|_| stream.local_addr().ok())
                    .map(|local| Client::tcp(peer, local));
                let (handle, shared, stop) = (handle.clone(), shared.clone(), stop_rx.clone());
                // Counted until it ends: after a hand-over, this process drains it.
                let open = shared.ctx.sockets().open_one();
                // The connection's future is made inside the task's: awaiting one made outside
                // would keep it twice in the task (as the captured value and as the awaited
                // state), doubling every connection's memory.
                tokio::spawn(
                    async move {
                        // A map lookup: on the connection's task, not the accept loop's.
                        if let Some(admitted) = admission::admit(&shared, &stream, peer, which) {
                            let served = handle(stream, peer, admitted, shared, stop);
                            match client {
                                Some(c) => CLIENT.scope(c, served).await,
                                None => served.await,
                            }
                        }
                        drop(permits);
                        drop(open);
                    }
                    .instrument(span),
                );
            }
            Err(e) => {
                // EMFILE/ENFILE and friends: back off instead of spinning.
                tracing::warn!(policy = %shared.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
