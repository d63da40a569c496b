//! One responder's sockets: a UDP socket and a TCP listener on the proxy's listen IP, each on a
//! kernel-chosen port, served by hickory-server with this listener identity's [`Handler`].
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_server::Server;
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Semaphore;

use super::AnswerSink;
use super::handler::Handler;
use crate::proxy::Shared;

/// Response buffer per DNS-over-TCP connection (hickory-server's outgoing queue).
const TCP_RESPONSE_BUFFER: usize = 32;

/// A bound, not yet running responder.
pub struct DnsResponder {
    udp: UdpSocket,
    tcp: TcpListener,
    udp_addr: SocketAddr,
    tcp_addr: SocketAddr,
    handler: Handler,
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
        let tcp = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let limits = shared.ctx.limits();
        let tcp_timeout = limits.header_timeout;
        let inflight = Arc::new(Semaphore::new(limits.max_connections_per_listener));
        Ok(DnsResponder {
            udp_addr: udp.local_addr()?,
            tcp_addr: tcp.local_addr()?,
            udp,
            tcp,
            handler: Handler {
                shared,
                sink,
                inflight,
            },
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
        let name = self.handler.shared.name.clone();
        let mut server = Server::new(self.handler);
        server.register_socket(self.udp);
        server.register_listener(self.tcp, self.tcp_timeout, TCP_RESPONSE_BUFFER);
        tracing::debug!(policy = %name, udp = %self.udp_addr, tcp = %self.tcp_addr, "dns responder listening");
        let token = server.shutdown_token().clone();
        tokio::select! {
            r = server.block_until_done() => {
                if let Err(e) = r {
                    tracing::warn!(policy = %name, error = %e, "dns responder stopped");
                }
            }
            () = shutdown => {
                token.cancel();
                server.block_until_done().await.ok();
            }
        }
    }
}
