//! The proxy's listening sockets, and the TCP options their accepted connections inherit.
//!
//! Linux copies `TCP_NODELAY` and the congestion-control algorithm from a listening socket to the
//! connections it accepts, so both are set once here instead of once per connection.
//!
//! Congestion control: the client side of every tunnel is host-local (a container's veth or
//! loopback). A pacing algorithm such as BBR — a common host default — only throttles such a link
//! (on this machine kind it halved bulk throughput over loopback), so the client-facing sockets use
//! `cubic` by default. Upstream sockets keep the host's default: they cross real networks.
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};

use crate::config::ProxyConfig;

/// `proxy.client_congestion_control` value that keeps the host's default.
pub const HOST_DEFAULT: &str = "host";
/// Used when `proxy.client_congestion_control` is not set (if the kernel has it).
pub const DEFAULT_CLIENT_CC: &str = "cubic";

#[derive(Debug, thiserror::Error)]
#[error(
    "proxy.client_congestion_control = {name:?}: the kernel refuses it ({source}); available: {available} (or use \"host\" for the host's default)"
)]
pub struct CongestionError {
    name: String,
    available: String,
    source: io::Error,
}

/// The congestion-control algorithm for client-facing sockets, checked against the kernel once:
/// unset → `cubic` if this kernel has it (else the host default, with a warning); `"host"` → the
/// host default; any other name → that algorithm, or an error naming the setting.
pub fn client_congestion_control(cfg: &ProxyConfig) -> Result<Option<Arc<str>>, CongestionError> {
    let (name, explicit) = match cfg.client_congestion_control.as_deref() {
        Some(HOST_DEFAULT) => return Ok(None),
        Some(name) => (name, true),
        None => (DEFAULT_CLIENT_CC, false),
    };
    let probe = || -> io::Result<()> {
        let socket = TcpSocket::new_v4()?;
        socket2::SockRef::from(&socket).set_tcp_congestion(name.as_bytes())
    };
    match probe() {
        Ok(()) => Ok(Some(Arc::from(name))),
        Err(source) if explicit => Err(CongestionError {
            name: name.to_owned(),
            available: std::fs::read_to_string(
                "/proc/sys/net/ipv4/tcp_available_congestion_control",
            )
            .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned()),
            source,
        }),
        Err(e) => {
            tracing::warn!(algorithm = name, error = %e,
                "client-facing proxy sockets keep the host's congestion control");
            Ok(None)
        }
    }
}

/// [`listen`] through the context's sockets when `key` is set: the listener a previous agent
/// handed over under that key (its options set again: the configuration may have changed them),
/// else a new one; with its registration, which offers it to a successor while held.
pub(crate) fn listen_as(
    ctx: &super::ProxyContext,
    key: Option<String>,
    addr: SocketAddr,
) -> io::Result<(TcpListener, Option<crate::handover::Held>)> {
    let cc = ctx.inner.client_cc.as_deref();
    let Some(key) = key else {
        return Ok((listen(addr, cc)?, None));
    };
    let (l, held) = ctx.sockets().tcp(&key, addr, |a| listen(a, cc))?;
    let s = socket2::SockRef::from(&l);
    s.set_tcp_nodelay(true)?;
    if let Some(cc) = cc {
        s.set_tcp_congestion(cc.as_bytes())?;
    }
    Ok((l, Some(held)))
}

/// A listener whose accepted connections start with `TCP_NODELAY` and congestion control `cc`
/// (`None`: the host default). `SO_REUSEADDR` and the backlog are what `TcpListener::bind` uses.
pub fn listen(addr: SocketAddr, cc: Option<&str>) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_nodelay(true)?;
    if let Some(cc) = cc {
        socket2::SockRef::from(&socket).set_tcp_congestion(cc.as_bytes())?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn available() -> String {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control").unwrap()
    }

    async fn accepted(
        cc: Option<&str>,
        addr: &str,
    ) -> Option<(tokio::net::TcpStream, tokio::net::TcpStream)> {
        let l = match listen(addr.parse().unwrap(), cc) {
            Ok(l) => l,
            Err(_) if addr.starts_with('[') => return None, // no IPv6 loopback on this host
            Err(e) => panic!("{addr}: {e}"),
        };
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let (a, _) = l.accept().await.unwrap();
        Some((a, c))
    }

    /// Accepted connections have Nagle off and the chosen algorithm, without per-connection calls.
    #[tokio::test]
    async fn accepted_connections_inherit_nodelay_and_congestion_control() {
        for addr in ["127.0.0.1:0", "[::1]:0"] {
            // reno is always built in.
            let Some((a, c)) = accepted(Some("reno"), addr).await else {
                continue;
            };
            assert!(a.nodelay().unwrap(), "{addr}: accepted socket has Nagle on");
            // A plain socket starts with Nagle on: the listener is what turned it off.
            assert!(!c.nodelay().unwrap());
            let cc = socket2::SockRef::from(&a).tcp_congestion().unwrap();
            assert_eq!(String::from_utf8_lossy(&cc).trim_end_matches('\0'), "reno");
        }
    }

    #[tokio::test]
    async fn default_is_cubic_where_available_and_host_keeps_the_default() {
        let unset = client_congestion_control(&ProxyConfig::default()).unwrap();
        if available().split_whitespace().any(|a| a == "cubic") {
            assert_eq!(unset.as_deref(), Some("cubic"));
        } else {
            assert_eq!(unset, None);
        }
        let host = ProxyConfig {
            client_congestion_control: Some("host".into()),
            ..ProxyConfig::default()
        };
        assert_eq!(client_congestion_control(&host).unwrap(), None);
        let (a, _c) = accepted(None, "127.0.0.1:0").await.unwrap();
        let got = socket2::SockRef::from(&a).tcp_congestion().unwrap();
        let want = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got).trim_end_matches('\0'),
            want.trim()
        );
    }

    #[test]
    fn an_unknown_explicit_algorithm_is_an_error_naming_the_setting() {
        let cfg = ProxyConfig {
            client_congestion_control: Some("no_such_cc".into()),
            ..ProxyConfig::default()
        };
        let e = client_congestion_control(&cfg).unwrap_err().to_string();
        assert!(e.contains("proxy.client_congestion_control"), "{e}");
        assert!(e.contains("no_such_cc") && e.contains("reno"), "{e}");
    }
}
