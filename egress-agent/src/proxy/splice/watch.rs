//! What wakes a spliced tunnel's task: one epoll instance for every spliced socket's hang-ups,
//! and the verdict program's credit/park ring buffer — both pumped by one task.
//!
//! The sockets are registered for `EPOLLRDHUP` only (edge-triggered; `EPOLLERR`/`EPOLLHUP` are
//! always reported), never `EPOLLIN`/`EPOLLOUT`: the relay's data path still wakes the socket's
//! wait queue per burst (`sk_psock_verdict_data_ready` → `sock_def_readable`), and epoll drops
//! those wake-ups in its callback because their mask doesn't match. So a busy tunnel costs user
//! space nothing; a FIN, a reset or a close costs one wake-up.
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use aya::maps::{MapData, RingBuf};
use egress_common::relay::{EVENT_PARKED, RelayEvent};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// `Signal::take` bits.
pub(crate) const HANGUP: u32 = 1;
pub(crate) const CREDIT: u32 = 2;
pub(crate) const PARKED: u32 = 4;

/// One tunnel's wake-up: what happened since it last looked, and a [`Notify`] (a permit is kept
/// if nobody waits, so nothing is lost between looks).
#[derive(Default)]
pub(crate) struct Signal {
    bits: AtomicU32,
    notify: Notify,
}

impl Signal {
    fn raise(&self, bits: u32) {
        self.bits.fetch_or(bits, Ordering::AcqRel);
        self.notify.notify_one();
    }
    /// What was raised since the last call (and clears it).
    pub(crate) fn take(&self) -> u32 {
        self.bits.swap(0, Ordering::AcqRel)
    }
    pub(crate) async fn wait(&self) {
        self.notify.notified().await;
    }
}

type Registry = Arc<Mutex<HashMap<u64, Arc<Signal>>>>;

/// The epoll fd, shared by the watcher (epoll_ctl) and the pump (epoll_wait).
struct EpollFd(Arc<Epoll>);

impl AsRawFd for EpollFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.0.as_raw_fd()
    }
}

/// The epoll instance and the cookie → tunnel registry; the pump task runs until this is
/// dropped.
pub(crate) struct Watcher {
    epoll: Arc<Epoll>,
    tunnels: Registry,
    stop: CancellationToken,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn lock(r: &Registry) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Signal>>> {
    r.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Watcher {
    /// Create the epoll instance and start the pump on the current tokio runtime (must be called
    /// inside one). `events` is the program's ring buffer.
    pub(crate) fn start(events: RingBuf<MapData>) -> io::Result<Watcher> {
        let epoll = Arc::new(Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?);
        let tunnels: Registry = Arc::default();
        // Not derived from the agent's stop: spliced tunnels need the pump until they end, and
        // after a hand-over they outlive that stop while they drain. The pump ends when the
        // relay (held by the proxy contexts, so by every listener and connection) is dropped;
        // it records nothing, so no stop waits for it.
        let stop = CancellationToken::new();
        #[expect(
            unsafe_code,
            reason = "tokio's fd registration requires the caller to vouch for the fd's lifetime"
        )]
        // SAFETY: each fd is owned by the value moved into its AsyncFd (the epoll instance, kept
        // alive by the Arc; the ring buffer map), open for the AsyncFd's whole life, and
        // `as_raw_fd` always returns that same fd.
        let (ep, ring) = unsafe {
            (
                AsyncFd::register_with_interest(EpollFd(epoll.clone()), Interest::READABLE),
                AsyncFd::register_with_interest(events, Interest::READABLE),
            )
        };
        let (ep, ring) = (ep.map_err(io::Error::from)?, ring.map_err(io::Error::from)?);
        let (reg, token) = (tunnels.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = pump(ep, ring, reg) => {}
                () = token.cancelled() => {}
            }
        });
        Ok(Watcher {
            epoll,
            tunnels,
            stop,
        })
    }

    /// Watch both sockets of a tunnel (keyed by their cookies, which are unique on the host).
    pub(crate) fn register(
        &self,
        socks: [(u64, BorrowedFd<'_>); 2],
        signal: &Arc<Signal>,
    ) -> io::Result<()> {
        {
            let mut t = lock(&self.tunnels);
            for (cookie, _) in socks {
                t.insert(cookie, signal.clone());
            }
        }
        for (i, (cookie, fd)) in socks.into_iter().enumerate() {
            let ev = EpollEvent::new(EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLET, cookie);
            if let Err(e) = self.epoll.add(fd, ev) {
                if i == 1 {
                    self.epoll.delete(socks[0].1).ok();
                }
                self.forget(&[socks[0].0, socks[1].0]);
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Stop watching (before the sockets are closed or handed back to tokio).
    pub(crate) fn deregister(&self, socks: [(u64, BorrowedFd<'_>); 2]) {
        for (_, fd) in socks {
            self.epoll.delete(fd).ok();
        }
        self.forget(&[socks[0].0, socks[1].0]);
    }

    /// Drop the registry entries (the fds leave epoll when they close).
    pub(crate) fn forget(&self, cookies: &[u64]) {
        let mut t = lock(&self.tunnels);
        for c in cookies {
            t.remove(c);
        }
    }
}

fn raise(reg: &Registry, cookie: u64, bits: u32) {
    let signal = lock(reg).get(&cookie).cloned();
    if let Some(s) = signal {
        s.raise(bits);
    }
}

fn drain_epoll(epoll: &Epoll, reg: &Registry) -> io::Result<()> {
    let mut events = [EpollEvent::empty(); 64];
    loop {
        let n = epoll.wait(&mut events, EpollTimeout::ZERO)?;
        for ev in &events[..n] {
            raise(reg, ev.data(), HANGUP);
        }
        if n < events.len() {
            return Ok(());
        }
    }
}

/// Forward epoll and ring-buffer readiness to the tunnels concerned.
async fn pump(epoll: AsyncFd<EpollFd>, mut ring: AsyncFd<RingBuf<MapData>>, reg: Registry) {
    loop {
        tokio::select! {
            // Each branch drains, clears the readiness, then drains once more: a record or an
            // event that arrived between the first drain and the clear would otherwise wait
            // for a wake-up that never comes. The ring buffer wakes its reader only when the
            // reader had caught up (adaptive notification), so one record missed this way
            // silenced every later credit notice of every tunnel (measured: a bulk tunnel's
            // task saw one notice, then none for 6 ms and 15 MiB, and the tunnel parked).
            ready = epoll.readable() => {
                let Ok(mut guard) = ready else { return };
                if let Err(e) = drain_epoll(&epoll.get_ref().0, &reg) {
                    tracing::warn!(error = %e, "kernel relay: epoll_wait failed");
                    return;
                }
                guard.clear_ready();
                if let Err(e) = drain_epoll(&epoll.get_ref().0, &reg) {
                    tracing::warn!(error = %e, "kernel relay: epoll_wait failed");
                    return;
                }
            }
            ready = ring.readable_mut() => {
                let Ok(mut guard) = ready else { return };
                drain_ring(guard.get_inner_mut(), &reg);
                guard.clear_ready();
                drain_ring(guard.get_inner_mut(), &reg);
            }
        }
    }
}

/// Pass every record in the ring buffer on to its tunnel.
fn drain_ring(rb: &mut RingBuf<MapData>, reg: &Registry) {
    while let Some(item) = rb.next() {
        if let Some((cookie, kind)) = decode(&item) {
            raise(
                reg,
                cookie,
                if kind == EVENT_PARKED { PARKED } else { CREDIT },
            );
        }
    }
}

/// A [`RelayEvent`] record: (cookie, kind).
fn decode(item: &[u8]) -> Option<(u64, u32)> {
    if item.len() < std::mem::size_of::<RelayEvent>() {
        return None;
    }
    let cookie = u64::from_ne_bytes(item.get(0..8)?.try_into().ok()?);
    let kind = u32::from_ne_bytes(item.get(8..12)?.try_into().ok()?);
    Some((cookie, kind))
}
