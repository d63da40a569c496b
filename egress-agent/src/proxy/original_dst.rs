//! Where a transparently redirected connection was going: the [`OriginalDst`] interface the kernel
//! side implements, and [`StaticOriginalDst`], the double tests and benchmarks use.
//!
//! The proxy can't ask `SO_ORIGINAL_DST` (no netfilter NAT is involved: the cgroup connect hook
//! rewrites the destination), so the kernel keeps the original destination in a map the agent
//! reads, keyed by what both sides know of the connection: the client's address and port as the
//! accepted socket's peer, and the listener address it reached. Nothing the client *sends* is
//! trusted for it. The proxy uses the original destination for the port (the policy check runs on
//! the name from the SNI/Host and **this** port) and for the denial event; it never dials the
//! original address (see `transparent`).
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

/// The accepted connection, as the kernel's map keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnKey {
    /// The client's socket address (`getpeername` of the accepted socket).
    pub peer: SocketAddr,
    /// The listener address the kernel redirected the connection to (`getsockname`).
    pub local: SocketAddr,
}

/// The original destination of a redirected connection. Implemented by the kernel side (a map
/// written when the client's `connect()` was redirected). Asked once per accepted connection, on
/// the connection's task, before any byte is read: keep it a non-blocking lookup. An
/// implementation may delete the entry as it answers (each connection asks once); entries of
/// connections that end before the proxy asks are the kernel side's to expire.
pub trait OriginalDst: Send + Sync + 'static {
    /// `None`: the kernel has no record of redirecting this connection (it is refused).
    fn original_dst(&self, conn: &ConnKey) -> Option<SocketAddr>;
}

/// A test double: entries keyed like the kernel's (removed when asked, like a kernel
/// implementation may), and an optional fallback answer for connections without an entry (a
/// client such as curl can't choose its source port up front).
#[derive(Debug, Default)]
pub struct StaticOriginalDst {
    table: Mutex<HashMap<ConnKey, SocketAddr>>,
    fallback: Option<SocketAddr>,
}

impl StaticOriginalDst {
    /// Every connection without an entry was going to `dst`.
    pub fn fixed(dst: SocketAddr) -> StaticOriginalDst {
        StaticOriginalDst {
            table: Mutex::default(),
            fallback: Some(dst),
        }
    }

    /// Record that the connection `conn` was going to `dst`.
    pub fn insert(&self, conn: ConnKey, dst: SocketAddr) {
        if let Ok(mut t) = self.table.lock() {
            t.insert(conn, dst);
        }
    }
}

impl OriginalDst for StaticOriginalDst {
    fn original_dst(&self, conn: &ConnKey) -> Option<SocketAddr> {
        let hit = self.table.lock().ok().and_then(|mut t| t.remove(conn));
        hit.or(self.fallback)
    }
}
