//! The sockets this process serves confined workloads on, by name, and the lifecycle a hand-over
//! gives them.
//!
//! Every listening socket a workload reaches (a container's proxy, transparent and DNS sockets,
//! the control API, the metrics and status-page listeners) is bound through [`Sockets`] under a
//! stable key. What a previous agent handed over ([`Sockets::adopt`]) is taken by key instead of
//! binding: the same socket, so the same port, so the kernel's entries and redirect maps, which
//! store the ports, stay right and nothing queued on the socket is lost. What this process holds
//! is what it offers a successor ([`Sockets::offer`]).
//!
//! After a hand-over this process stops accepting ([`Sockets::handed_over`]) but keeps its open
//! connections ([`Sockets::open`]) until they end or the drain deadline cuts them
//! ([`Sockets::cut`]).
use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::sys::socket::{SockType, getsockopt, sockopt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The sockets of one agent process.
#[derive(Debug, Default)]
pub struct Sockets {
    /// What this process serves, by key: a duplicate of each (what [`Sockets::offer`] sends).
    held: Mutex<BTreeMap<String, OwnedFd>>,
    /// What the previous agent handed over and nothing has claimed yet.
    taken: Mutex<BTreeMap<String, OwnedFd>>,
    /// Cancelled when a successor took the sockets: stop accepting, keep connections.
    handed_over: CancellationToken,
    /// Cancelled at the end of the drain: the connections still open are cut.
    cut: CancellationToken,
    open: AtomicUsize,
    closed: Notify,
    /// Runtimes that completed a reconcile (a successor waits for every one before it says it
    /// serves: by then each workload's sockets are claimed).
    reconciled: Mutex<Vec<&'static str>>,
    reconciled_changed: Notify,
    /// Also keep the sockets in systemd's file-descriptor store ([`super::fdstore`]).
    fdstore: bool,
}

/// Keeps a socket in the offer until dropped (when the socket is closed or its workload goes).
#[derive(Debug)]
#[must_use = "the socket is offered to a successor only while this is held"]
pub struct Held {
    sockets: Arc<Sockets>,
    key: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.sockets.held).remove(&self.key);
        // After a hand-over the successor serves (and stored) this socket: it stays stored.
        if self.sockets.fdstore && !self.sockets.is_handed_over() {
            super::fdstore::remove(&self.key);
        }
    }
}

/// One open connection (or DNS query in flight) of this process; the drain waits for it.
#[derive(Debug)]
pub struct Open {
    sockets: Arc<Sockets>,
}

impl Drop for Open {
    fn drop(&mut self) {
        if self.sockets.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.sockets.closed.notify_waiters();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Why a handed-over socket was not adopted (it is closed and a new one bound).
fn mismatch(key: &str, why: &str) {
    tracing::warn!(
        key,
        why,
        "a handed-over socket does not fit its new use; binding a new one"
    );
}

fn kind_is(fd: &impl AsFd, want: SockType) -> bool {
    getsockopt(fd, sockopt::SockType).is_ok_and(|t| t == want)
}

impl Sockets {
    pub fn new() -> Arc<Sockets> {
        Arc::new(Sockets::default())
    }

    /// The daemon's: sockets it binds are kept in systemd's file-descriptor store too, when a
    /// service manager listens ([`super::fdstore::enabled`]).
    pub fn with_fdstore() -> Arc<Sockets> {
        Arc::new(Sockets {
            fdstore: super::fdstore::enabled(),
            ..Sockets::default()
        })
    }

    /// Take what the previous agent handed over (each claimed later by its key).
    pub fn adopt(&self, fds: impl IntoIterator<Item = (String, OwnedFd)>) {
        lock(&self.taken).extend(fds);
    }

    fn claim(&self, key: &str) -> Option<OwnedFd> {
        lock(&self.taken).remove(key)
    }

    /// Offer `fd` (bound by the caller) under `key` while the registration is held.
    pub fn hold(self: &Arc<Self>, key: &str, fd: &impl AsFd) -> io::Result<Held> {
        self.register(key, fd, true)
    }

    /// `fresh`: bound by this process (kept in the fd store too); else taken over, whose name
    /// the store has already.
    fn register(self: &Arc<Self>, key: &str, fd: &impl AsFd, fresh: bool) -> io::Result<Held> {
        let dup = fd.as_fd().try_clone_to_owned()?;
        lock(&self.held).insert(key.to_owned(), dup);
        if self.fdstore && fresh {
            super::fdstore::store(key, fd);
        }
        Ok(Held {
            sockets: self.clone(),
            key: key.to_owned(),
        })
    }

    /// A TCP listener for `key` on `addr` (port 0: any): the handed-over one if it is a listening
    /// TCP socket on that address, else `bind(addr)`.
    pub fn tcp(
        self: &Arc<Self>,
        key: &str,
        addr: SocketAddr,
        bind: impl FnOnce(SocketAddr) -> io::Result<tokio::net::TcpListener>,
    ) -> io::Result<(tokio::net::TcpListener, Held)> {
        let (listener, fresh) = match self.claim(key).and_then(|fd| adopt_tcp(key, fd, addr)) {
            Some(l) => (l, false),
            None => (bind(addr)?, true),
        };
        let held = self.register(key, &listener, fresh)?;
        Ok((listener, held))
    }

    /// A UDP socket for `key` on `addr` (port 0: any), like [`Sockets::tcp`].
    pub fn udp(
        self: &Arc<Self>,
        key: &str,
        addr: SocketAddr,
        bind: impl FnOnce(SocketAddr) -> io::Result<std::net::UdpSocket>,
    ) -> io::Result<(tokio::net::UdpSocket, Held)> {
        let (socket, fresh) = match self.claim(key).and_then(|fd| adopt_udp(key, fd, addr)) {
            Some(s) => (s, false),
            None => (bind(addr)?, true),
        };
        socket.set_nonblocking(true)?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let held = self.register(key, &socket, fresh)?;
        Ok((socket, held))
    }

    /// A unix stream listener for `key` at `path`: the handed-over one if it is bound there, else
    /// `bind()`.
    pub fn unix(
        self: &Arc<Self>,
        key: &str,
        path: &Path,
        bind: impl FnOnce() -> io::Result<tokio::net::UnixListener>,
    ) -> io::Result<(tokio::net::UnixListener, Held)> {
        let (listener, fresh) = match self.claim(key).and_then(|fd| adopt_unix(key, fd, path)) {
            Some(l) => (l, false),
            None => (bind()?, true),
        };
        let held = self.register(key, &listener, fresh)?;
        Ok((listener, held))
    }

    /// Whether a socket was handed over for `key` (not yet claimed).
    pub fn has_taken(&self, key: &str) -> bool {
        lock(&self.taken).contains_key(key)
    }

    /// Close what was handed over and nothing claimed (its workload went while no agent watched,
    /// or its policy changed); returns their keys. Their names leave the fd store too.
    pub fn close_unclaimed(&self) -> Vec<String> {
        let keys: Vec<String> = std::mem::take(&mut *lock(&self.taken))
            .into_keys()
            .collect();
        if self.fdstore {
            for k in &keys {
                super::fdstore::remove(k);
            }
        }
        keys
    }

    /// Duplicates of every socket this process holds, for a successor.
    pub fn offer(&self) -> io::Result<Vec<(String, OwnedFd)>> {
        lock(&self.held)
            .iter()
            .map(|(k, fd)| Ok((k.clone(), fd.try_clone()?)))
            .collect()
    }

    /// How many sockets this process holds.
    pub fn held(&self) -> usize {
        lock(&self.held).len()
    }

    /// A successor took the sockets: every accept loop stops (connections stay).
    pub fn hand_over(&self) {
        self.handed_over.cancel();
    }

    pub fn is_handed_over(&self) -> bool {
        self.handed_over.is_cancelled()
    }

    /// Completes when a successor took the sockets.
    pub async fn handed_over(&self) {
        self.handed_over.cancelled().await;
    }

    /// End the drain: every connection still open is cut.
    pub fn cut(&self) {
        self.cut.cancel();
    }

    /// Completes at [`Sockets::cut`].
    pub async fn cut_done(&self) {
        self.cut.cancelled().await;
    }

    /// Count one open connection (or DNS query in flight) until the guard is dropped.
    pub fn open_one(self: &Arc<Self>) -> Open {
        self.open.fetch_add(1, Ordering::AcqRel);
        Open {
            sockets: self.clone(),
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Wait until no connection is open, or `deadline`; report the count every `every` through
    /// `report`. Returns what is still open.
    pub async fn drain(
        &self,
        deadline: Duration,
        every: Duration,
        mut report: impl FnMut(usize),
    ) -> usize {
        let end = tokio::time::Instant::now() + deadline;
        let mut tick = tokio::time::interval(every);
        loop {
            let closed = self.closed.notified();
            let n = self.open();
            if n == 0 {
                report(0);
                return 0;
            }
            tokio::select! {
                () = closed => {}
                _ = tick.tick() => report(n),
                () = tokio::time::sleep_until(end) => return self.open(),
            }
        }
    }

    /// Runtime `name` completed a reconcile.
    pub fn reconciled(&self, name: &'static str) {
        let mut r = lock(&self.reconciled);
        if !r.contains(&name) {
            r.push(name);
            self.reconciled_changed.notify_waiters();
        }
    }

    /// Wait until every runtime in `names` completed a reconcile, at most `deadline`; returns the
    /// ones that had not.
    pub async fn wait_reconciled(
        &self,
        names: &[&'static str],
        deadline: Duration,
    ) -> Vec<&'static str> {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            let changed = self.reconciled_changed.notified();
            let missing: Vec<_> = {
                let r = lock(&self.reconciled);
                names.iter().copied().filter(|n| !r.contains(n)).collect()
            };
            if missing.is_empty() {
                return missing;
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(end) => return missing,
            }
        }
    }
}

fn adopt_tcp(key: &str, fd: OwnedFd, want: SocketAddr) -> Option<tokio::net::TcpListener> {
    if !kind_is(&fd, SockType::Stream) || !getsockopt(&fd, sockopt::AcceptConn).unwrap_or(false) {
        mismatch(key, "not a listening TCP socket");
        return None;
    }
    let l = std::net::TcpListener::from(fd);
    let local = l.local_addr().ok()?;
    if local.ip() != want.ip() || (want.port() != 0 && local.port() != want.port()) {
        mismatch(key, "bound to another address");
        return None;
    }
    l.set_nonblocking(true).ok()?;
    tokio::net::TcpListener::from_std(l).ok()
}

fn adopt_udp(key: &str, fd: OwnedFd, want: SocketAddr) -> Option<std::net::UdpSocket> {
    if !kind_is(&fd, SockType::Datagram) {
        mismatch(key, "not a UDP socket");
        return None;
    }
    let s = std::net::UdpSocket::from(fd);
    let local = s.local_addr().ok()?;
    if local.ip() != want.ip() || (want.port() != 0 && local.port() != want.port()) {
        mismatch(key, "bound to another address");
        return None;
    }
    Some(s)
}

fn adopt_unix(key: &str, fd: OwnedFd, path: &Path) -> Option<tokio::net::UnixListener> {
    if !kind_is(&fd, SockType::Stream) || !getsockopt(&fd, sockopt::AcceptConn).unwrap_or(false) {
        mismatch(key, "not a listening unix socket");
        return None;
    }
    let l = std::os::unix::net::UnixListener::from(fd);
    let bound = l.local_addr().ok();
    if bound.as_ref().and_then(|a| a.as_pathname()) != Some(path) {
        mismatch(key, "bound to another path");
        return None;
    }
    l.set_nonblocking(true).ok()?;
    tokio::net::UnixListener::from_std(l).ok()
}

/// The raw fd numbers of `fds`, for `SCM_RIGHTS`.
pub(super) fn raw(fds: &[(String, OwnedFd)]) -> Vec<i32> {
    fds.iter().map(|(_, f)| f.as_raw_fd()).collect()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn listen(addr: SocketAddr) -> io::Result<tokio::net::TcpListener> {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(l)
    }

    /// A socket bound by one `Sockets` and offered is what another adopts: same port, and a
    /// connection queued before the adoption is accepted by the adopter.
    #[tokio::test]
    async fn an_offered_listener_is_adopted_with_its_queue() {
        let old = Sockets::new();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (l, _held) = old.tcp("a", any, listen).unwrap();
        let port = l.local_addr().unwrap().port();
        let offer = old.offer().unwrap();
        assert_eq!(offer.len(), 1);
        let queued = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        drop(l); // the old process stops serving it
        let new = Sockets::new();
        new.adopt(offer);
        let (l2, _held2) = new.tcp("a", any, |_| panic!("bound anew")).unwrap();
        assert_eq!(l2.local_addr().unwrap().port(), port);
        let (accepted, _) = l2.accept().await.unwrap();
        assert_eq!(accepted.peer_addr().unwrap(), queued.local_addr().unwrap());
        assert!(new.close_unclaimed().is_empty());
    }

    /// A handed-over socket on another address, or of another kind, is not adopted: a new one
    /// is bound and the old one closed.
    #[tokio::test]
    async fn a_socket_that_does_not_fit_is_replaced() {
        let old = Sockets::new();
        let (_u, _h) = old
            .udp(
                "k",
                "127.0.0.1:0".parse().unwrap(),
                std::net::UdpSocket::bind,
            )
            .unwrap();
        let new = Sockets::new();
        new.adopt(old.offer().unwrap());
        let mut bound = false;
        let (_l, _h2) = new
            .tcp("k", "127.0.0.1:0".parse().unwrap(), |a| {
                bound = true;
                listen(a)
            })
            .unwrap();
        assert!(bound, "a UDP socket was adopted as a TCP listener");
    }

    /// Dropping the registration takes a socket out of the offer; unclaimed ones are reported.
    #[tokio::test]
    async fn the_offer_follows_what_is_held() {
        let s = Sockets::new();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (_a, ha) = s.tcp("a", any, listen).unwrap();
        let (_b, _hb) = s.tcp("b", any, listen).unwrap();
        assert_eq!(s.held(), 2);
        drop(ha);
        let keys: Vec<String> = s.offer().unwrap().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["b"]);
        let n = Sockets::new();
        n.adopt(s.offer().unwrap());
        assert!(n.has_taken("b"));
        assert_eq!(n.close_unclaimed(), ["b"]);
    }

    /// The drain ends when the last connection closes, or at the deadline with the count left.
    #[tokio::test]
    async fn the_drain_waits_for_open_connections() {
        let s = Sockets::new();
        let a = s.open_one();
        let b = s.open_one();
        assert_eq!(s.open(), 2);
        let left = s
            .drain(Duration::from_millis(50), Duration::from_millis(10), |_| {})
            .await;
        assert_eq!(left, 2);
        drop(a);
        let s2 = s.clone();
        let waiter = tokio::spawn(async move {
            s2.drain(Duration::from_secs(10), Duration::from_secs(1), |_| {})
                .await
        });
        tokio::task::yield_now().await;
        drop(b);
        assert_eq!(waiter.await.unwrap(), 0);
    }
}
