//! One responder's sockets: a UDP socket ([`super::udp`], batched) and a TCP listener
//! ([`super::tcp`], bounded) on the proxy's listen IP, each on a kernel-chosen port, both
//! answering through this listener identity's [`Core`].
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
    /// The sockets are taken through the context's [`crate::handover::Sockets`] when the
    /// listener has a key (a previous agent's, if it handed them over); `held` gets their
    /// registrations.
    pub(crate) async fn bind(
        ip: IpAddr,
        shared: Arc<Shared>,
        sink: Arc<dyn AnswerSink>,
        held: &mut Vec<crate::handover::Held>,
    ) -> io::Result<DnsResponder> {
        let any = SocketAddr::new(ip, 0);
        let sockets = shared.ctx.sockets().clone();
        let udp = match shared.socket_key("dns-udp") {
            Some(key) => {
                let (udp, h) = sockets.udp(&key, any, std::net::UdpSocket::bind)?;
                held.push(h);
                udp
            }
            None => UdpSocket::bind(any).await?,
        };
        if let Err(e) = socket2::SockRef::from(&udp).set_recv_buffer_size(UDP_RECV_BUFFER) {
            tracing::debug!(error = %e, "dns: keeping the default UDP receive buffer");
        }
        let tcp = match shared.socket_key("dns-tcp") {
            Some(key) => {
                let (tcp, h) = sockets.tcp(&key, any, |a| {
                    let l = std::net::TcpListener::bind(a)?;
                    l.set_nonblocking(true)?;
                    TcpListener::from_std(l)
                })?;
                held.push(h);
                tcp
            }
            None => TcpListener::bind(any).await?,
        };
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

    /// Serve until `accepting` is cancelled (the listener stops, or a successor took the
    /// sockets): queries already read are answered, and DNS-over-TCP connections open then go
    /// on until they end or `cut`. A DNS-over-TCP connection idle for `proxy.header_timeout_ms`
    /// is closed.
    pub async fn run(self, accepting: CancellationToken, cut: CancellationToken) {
        tracing::debug!(policy = %self.core.shared.name, udp = %self.udp_addr, tcp = %self.tcp_addr, "dns responder listening");
        let tasks = self.core.shared.tasks.clone();
        let udp = tasks.spawn(udp::serve(
            Arc::new(self.udp),
            self.core.clone(),
            accepting.clone(),
        ));
        let tcp = tasks.spawn(tcp::serve(
            self.tcp,
            self.core,
            self.tcp_timeout,
            accepting,
            cut,
        ));
        udp.await.ok();
        tcp.await.ok();
    }
}
