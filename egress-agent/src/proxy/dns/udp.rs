//! The responder's UDP loop: a batch of queries per `recvmmsg`, each answered on the loop when no
//! network is needed ([`Core::now`]: denied names, refused types, malformed queries, allowed
//! names whose records are cached; the same query bytes again from the loop's [`Memo`] through
//! [`Core::reuse`]), the answers of the batch sent with one `sendmmsg`. A miss
//! takes a slot of the in-flight bound and is resolved on a task of its own, which sends its
//! answer when done; without a slot it is SERVFAIL in the same batch. Hits keep flowing while
//! misses resolve.
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use super::batch::{BATCH, RecvBatch, SendBatch};
use super::handler::{Core, Now, Reuse};
use super::memo::{self, Memo};
use super::wire;
use super::wire::Transport;
use crate::metrics::DnsDrop;
use crate::proxy::client::{CLIENT, Client};
use egress_policy::CompiledPolicy;

/// Pause after a receive error that is not `WouldBlock` (the socket stays readable: without it
/// the loop would spin).
const ERROR_BACKOFF: Duration = Duration::from_millis(10);

pub(crate) async fn serve(socket: Arc<UdpSocket>, core: Arc<Core>, stop: CancellationToken) {
    let fd = socket.as_raw_fd();
    // Where the identity has several workloads (a pod), each query's events name its client.
    let local = core
        .shared
        .identity
        .as_ref()
        .and_then(|i| i.clients.as_ref())
        .and_then(|_| socket.local_addr().ok());
    let mut rx = RecvBatch::default();
    let mut tx = SendBatch::default();
    let mut memo = Memo::default();
    loop {
        if stop.is_cancelled() {
            return;
        }
        tokio::select! {
            biased;
            r = socket.readable() => {
                if let Err(e) = r {
                    tracing::warn!(policy = %core.shared.name, error = %e, "dns responder: UDP socket failed");
                    return;
                }
            }
            () = stop.cancelled() => return,
        }
        // A batch shorter than the most one call takes drained the socket: its readiness is
        // cleared with it (try_io clears it on `WouldBlock`), rather than by one more
        // `recvmmsg` that would find nothing. A datagram that came in meanwhile is not lost:
        // its epoll event is still pending (edge-triggered), and tokio clears only the
        // readiness of the event this receive answered.
        let mut got = 0;
        let drained = socket.try_io(Interest::READABLE, || {
            got = rx.recv(fd)?;
            if got < BATCH {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(())
        });
        match drained {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::debug!(policy = %core.shared.name, error = %e, "dns: receive failed");
                tokio::time::sleep(ERROR_BACKOFF).await;
                continue;
            }
        }
        let policy = core.shared.policy.load_full();
        memo.follow(&policy);
        for (r, bytes) in rx.iter() {
            let Some(src) = r.src else {
                core.dropped(DnsDrop::BadSource);
                continue;
            };
            if r.cut {
                core.dropped(DnsDrop::Malformed);
                continue;
            }
            let mut answer = || answer(&core, &mut memo, &policy, bytes, src, &mut tx);
            let now = match local {
                Some(local) => CLIENT.sync_scope(Client::udp(src, local), answer),
                None => answer(),
            };
            match now {
                None | Some(Now::Send(..) | Now::Drop) => {}
                Some(Now::Miss(miss)) => match core.admit() {
                    Some(permit) => {
                        let (core, socket) = (core.clone(), socket.clone());
                        // A successor may serve the socket now: this process stays until the
                        // answer is sent.
                        let open = core.shared.ctx.sockets().open_one();
                        core.shared.tasks.clone().spawn(async move {
                            let resolve = core.resolve(&miss, Transport::Udp);
                            let out = match local {
                                Some(local) => CLIENT.scope(Client::udp(src, local), resolve).await,
                                None => resolve.await,
                            };
                            drop(permit);
                            let _open = open;
                            if let Some(out) = out
                                && let Err(e) = socket.send_to(&out, src).await
                            {
                                tracing::debug!(error = %e, "dns: answer not delivered");
                                core.dropped(DnsDrop::SendFailed);
                            }
                        });
                    }
                    None => {
                        if let Some(out) = core.servfail(&miss, Transport::Udp) {
                            tx.push(&out, src);
                        }
                    }
                },
            }
        }
        flush(&socket, &core, &mut tx).await;
    }
}

/// One query from `src`, answered from the memo when it holds the answer, else through
/// [`Core::now`] (its answer kept when it may be). An answer is queued on `tx`; what is left
/// (a miss) is returned.
fn answer(
    core: &Core,
    memo: &mut Memo,
    policy: &CompiledPolicy,
    bytes: &[u8],
    src: SocketAddr,
    tx: &mut SendBatch,
) -> Option<Now> {
    if let (Some(entry), Some(id)) = (memo.get(bytes), memo::id(bytes))
        && wire::answerable(src)
    {
        match core.reuse(entry, policy, src) {
            Reuse::Send => {
                tx.push_with(src, |out| entry.write(id, out));
                return None;
            }
            Reuse::Stale => memo.forget(bytes),
        }
    }
    match core.now(bytes, src, Transport::Udp) {
        Now::Send(out, kept) => {
            tx.push(&out, src);
            if let Some(kept) = kept {
                memo.keep(bytes, &out, kept);
            }
            None
        }
        other => Some(other),
    }
}

/// Send every queued answer: in `sendmmsg` batches, waiting for the socket when its buffer is
/// full; an answer the kernel refuses is dropped (counted), the rest still go.
async fn flush(socket: &UdpSocket, core: &Core, tx: &mut SendBatch) {
    let fd = socket.as_raw_fd();
    let mut at = 0;
    while at < tx.len() {
        match socket.try_io(Interest::WRITABLE, || tx.send(fd, at)) {
            Ok(n) => at += n.max(1),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if socket.writable().await.is_err() {
                    break;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "dns: answer not delivered");
                core.dropped(DnsDrop::SendFailed);
                at += 1;
            }
        }
    }
    tx.clear();
}
