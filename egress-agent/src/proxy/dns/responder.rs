//! One responder's sockets: a UDP socket ([`super::udp`], batched) and a TCP listener
//! ([`super::tcp`], bounded) on the proxy's listen IP, each on a kernel-chosen port, both
//! answering through this listener identity's [`Core`].
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::AnswerSink;
use super::handler::Core;
use super::{tcp, udp};
use crate::proxy::Shared;

/// Receive buffer asked for the UDP socket (the kernel caps it at `net.core.rmem_max`): a burst
/// of queries from many clients waits here for the next batch instead of being dropped.
pub const UDP_RECV_BUFFER: usize = 1 << 20;

/// A bound, not yet running responder.
pub struct DnsResponder {
    udp: UdpSocket,
    tcp: TcpListener,
    udp_addr: SocketAddr,
    tcp_addr: SocketAddr,
    core: Arc<Core>,
    tcp_timeout: Duration,
}

impl DnsResponder {
    /// Bind UDP and TCP on `ip` (kernel-chosen ports) for the listener `shared` belongs to.
    pub(crate) async fn bind(
        ip: IpAddr,
        shared: Arc<Shared>,
        sink: Arc<dyn AnswerSink>,
    ) -> io::Result<DnsResponder> {
        let udp = UdpSocket::bind(SocketAddr::new(ip, 0)).await?;
        if let Err(e) = socket2::SockRef::from(&udp).set_recv_buffer_size(UDP_RECV_BUFFER) {
            tracing::debug!(error = %e, "dns: keeping the default UDP receive buffer");
        }
        let tcp = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let limits = shared.ctx.limits();
        let tcp_timeout = limits.header_timeout;
        let inflight = Arc::new(Semaphore::new(limits.max_connections_per_listener));
        let counters = shared.ctx.metrics().map(|m| m.dns_counters(&shared.name));
        Ok(DnsResponder {
            udp_addr: udp.local_addr()?,
            tcp_addr: tcp.local_addr()?,
            udp,
            tcp,
            core: Arc::new(Core {
                shared,
                sink,
                inflight,
                counters,
            }),
            tcp_timeout,
        })
    }

    pub fn udp_addr(&self) -> SocketAddr {
        self.udp_addr
    }

    pub fn tcp_addr(&self) -> SocketAddr {
        self.tcp_addr
    }

    /// Serve until `shutdown` completes. A DNS-over-TCP connection idle for
    /// `proxy.header_timeout_ms` is closed.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let stop = CancellationToken::new();
        tracing::debug!(policy = %self.core.shared.name, udp = %self.udp_addr, tcp = %self.tcp_addr, "dns responder listening");
        let udp = tokio::spawn(udp::serve(
            Arc::new(self.udp),
            self.core.clone(),
            stop.clone(),
        ));
        let tcp = tokio::spawn(tcp::serve(
            self.tcp,
            self.core,
            self.tcp_timeout,
            stop.clone(),
        ));
        shutdown.await;
        stop.cancel();
        udp.await.ok();
        tcp.await.ok();
    }
}
