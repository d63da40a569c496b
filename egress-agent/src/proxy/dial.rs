//! Resolve → check every address → connect to a checked address. No second lookup.
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;

use super::request::Target;
use super::resolve::{DnsResolver, ResolveError};
use egress_policy::name::Destination;
use egress_policy::{CompiledPolicy, Decision, Refused};

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("denied: {} ({ip})", refused.reason)]
    Denied { refused: Refused, ip: IpAddr },
    #[error("dns: {0}")]
    Dns(#[from] ResolveError),
    #[error("connect timed out after {0:?}")]
    Timeout(Duration),
    #[error("connect failed: {0}")]
    Connect(io::Error),
}

impl DialError {
    /// Short machine-readable code for the 502 `X-Egress-Error` header.
    pub fn code(&self) -> &'static str {
        match self {
            DialError::Denied { refused, .. } => refused.reason.as_str(),
            DialError::Dns(_) => "dns-failure",
            DialError::Timeout(_) => "connect-timeout",
            DialError::Connect(_) => "connect-failed",
        }
    }
}

/// A connected upstream.
#[derive(Debug)]
pub struct Dialed {
    pub stream: TcpStream,
    pub addr: SocketAddr,
    /// The first address the allowlist refused and the audit let through (its refusal).
    pub would_deny: Option<(Refused, IpAddr)>,
}

/// Resolve (if a name), check each address ([`CompiledPolicy::decide_addr`]), connect.
/// `policy.decide_target` must already have let the target through.
pub async fn dial(
    policy: &CompiledPolicy,
    resolver: &DnsResolver,
    target: &Target,
    connect_timeout: Duration,
) -> Result<Dialed, DialError> {
    let deadline = tokio::time::Instant::now() + connect_timeout;
    let (addrs, via_name) = match &target.dest {
        Destination::Ip(ip) => (vec![*ip], false),
        Destination::Name(name) => {
            let addrs = tokio::time::timeout_at(deadline, resolver.lookup(name))
                .await
                .map_err(|_| DialError::Timeout(connect_timeout))??;
            (addrs, true)
        }
    };
    // Every address is checked before any connect: a name with one denied address is refused whole
    // (a rebinding answer mixing public and private addresses gets nothing).
    let mut would_deny = None;
    for ip in &addrs {
        match policy.decide_addr(*ip, target.port, via_name) {
            Decision::Allow(_) => {}
            Decision::WouldDeny(r) => {
                would_deny.get_or_insert((r, *ip));
            }
            Decision::Deny(refused) => {
                return Err(DialError::Denied { refused, ip: *ip });
            }
        }
    }
    let mut last_err = None;
    for ip in addrs {
        let sa = SocketAddr::new(egress_policy::addr::unmap(ip), target.port);
        match tokio::time::timeout_at(deadline, TcpStream::connect(sa)).await {
            Err(_) => return Err(DialError::Timeout(connect_timeout)),
            Ok(Ok(stream)) => {
                stream.set_nodelay(true).ok();
                return Ok(Dialed {
                    stream,
                    addr: sa,
                    would_deny,
                });
            }
            Ok(Err(e)) => last_err = Some(e),
        }
    }
    Err(DialError::Connect(
        last_err.unwrap_or_else(|| io::Error::other("no address")),
    ))
}
