//! DNS over TCP (RFC 7766): at most [`MAX_TCP_CONNECTIONS`] connections per responder (more are
//! closed at once, counted in `dns_tcp_refused_total` and logged at most every
//! [`REFUSAL_LOG_EVERY`]), each read as 2-byte length-prefixed messages (RFC 1035 §4.2.2), one
//! at a time, through the same [`Core`] steps as UDP. A connection that sends nothing for the
//! idle timeout (`proxy.header_timeout_ms`), or doesn't take its answer within it, is closed.
//! Only connections the kernel sent from the responder's own workload are served
//! (`proxy::admission`).
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::handler::{Core, Now};
use super::wire::Transport;
use crate::proxy::admission::{self, Listener};
use crate::proxy::client::{CLIENT, Client};

/// Most DNS-over-TCP connections open at once on one responder (one per confined listener
/// identity). Stub resolvers use TCP only after a truncated answer, and close it after the answer.
pub const MAX_TCP_CONNECTIONS: usize = 64;
/// Refusals are logged at most this often (each is counted).
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// Pause after an accept error (EMFILE and the like), so the loop doesn't spin on it.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

pub(crate) async fn serve(
    listener: TcpListener,
    core: Arc<Core>,
    idle: Duration,
    accepting: CancellationToken,
    cut: CancellationToken,
) {
    let open = Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS));
    let last_warn: Mutex<Option<Instant>> = Mutex::new(None);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(policy = %core.shared.name, error = %e, "dns: accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = accepting.cancelled() => return,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(stream);
            if let Some(c) = &core.counters {
                c.tcp_refused();
            }
            let now = Instant::now();
            if let Ok(mut last) = last_warn.lock()
                && last.is_none_or(|t| now.duration_since(t) >= REFUSAL_LOG_EVERY)
            {
                *last = Some(now);
                tracing::warn!(
                    policy = %core.shared.name,
                    %peer,
                    max = MAX_TCP_CONNECTIONS,
                    "dns: DNS-over-TCP connection refused: the responder has its most connections open (counted in egress_agent_dns_tcp_refused_total)"
                );
            }
            continue;
        };
        let client = core
            .shared
            .identity
            .as_ref()
            .and_then(|i| i.clients.as_ref())
            .and_then(|_| stream.local_addr().ok())
            .map(|local| Client::tcp(peer, local));
        let (core, cut) = (core.clone(), cut.clone());
        let open = core.shared.ctx.sockets().open_one();
        core.shared.tasks.clone().spawn(async move {
            // Only connections the kernel sent from this responder's workload (port 53 over
            // TCP) are answered; anyone else is closed unread (`proxy::admission`).
            if admission::admit(
                &core.shared,
                peer,
                stream.local_addr().ok(),
                Listener::DnsTcp,
            )
            .is_none()
            {
                drop(permit);
                drop(open);
                return;
            }
            let served = async {
                tokio::select! {
                    () = connection(stream, peer, &core, idle) => {}
                    () = cut.cancelled() => {}
                }
            };
            match client {
                Some(c) => CLIENT.scope(c, served).await,
                None => served.await,
            }
            drop(permit);
            drop(open);
        });
    }
}

async fn connection(mut stream: TcpStream, peer: SocketAddr, core: &Core, idle: Duration) {
    let mut buf = Vec::new();
    loop {
        let Ok(Ok(len)) = tokio::time::timeout(idle, stream.read_u16()).await else {
            return;
        };
        buf.resize(usize::from(len), 0);
        if !matches!(
            tokio::time::timeout(idle, stream.read_exact(&mut buf)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let out = match core.now(&buf, peer, Transport::Tcp) {
            Now::Send(out, _) => Some(out),
            Now::Drop => None,
            Now::Miss(miss) => match core.admit() {
                Some(_permit) => core.resolve(&miss, Transport::Tcp).await,
                None => core.servfail(&miss, Transport::Tcp),
            },
        };
        let Some(out) = out else { continue };
        let Ok(len) = u16::try_from(out.len()) else {
            continue;
        };
        let mut framed = Vec::with_capacity(2 + out.len());
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(&out);
        if !matches!(
            tokio::time::timeout(idle, stream.write_all(&framed)).await,
            Ok(Ok(()))
        ) {
            return;
        }
    }
}
