//! Watching `policies.d` (see [`super::policies_dir`]) so the daemon reloads when its files
//! change: an edit of a plain directory, or the kubelet's update of a ConfigMap volume.
//!
//! inotify (nix's `sys::inotify` on tokio's `AsyncFd`: no new dependency, no polling; the
//! descriptor is non-blocking and woken by the kernel). Watched:
//! - the directory: `IN_MOVED_TO` of `..data` (the kubelet renames `..data_tmp` over it: one
//!   event per ConfigMap update), and `IN_CLOSE_WRITE`, `IN_MOVED_TO`, `IN_MOVED_FROM`,
//!   `IN_CREATE`, `IN_DELETE` of `<policy>.toml` names (an editor's save, the control API's
//!   rename, a new or removed ConfigMap key); the directory's own removal or move. Other
//!   dot-names (`..data_tmp`, `..<timestamp>`, `.x.toml.tmp-*`, `.x.toml.swp`) are ignored;
//! - its parent (the configuration file's directory), for `policies.d` appearing (created by
//!   the first managed write, or by hand) or going away: the directory is then (re)watched.
//!
//! A burst (the kubelet's steps, an editor's write + rename, an import of many files) is
//! coalesced: after the first relevant event, events are collected until [`QUIET`] passes
//! without one (at most [`MAX_DELAY`] after the first), then one change is reported. An event
//! queue overflow counts as a change. The reload reads the directory as it is then, through
//! `..data` resolved once, so it never sees half of an update.
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

use super::policies_dir::{DATA_LINK, policy_name};

/// The quiet time that ends a burst of events.
pub const QUIET: Duration = Duration::from_millis(200);
/// A burst is reported at the latest this long after its first event.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// Why the directory can't be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("inotify: {0} (fs.inotify.max_user_instances may be exhausted)")]
    Init(nix::Error),
    #[error("watching {path}: {source}")]
    Watch { path: PathBuf, source: nix::Error },
    #[error("reading inotify events: {0}")]
    Read(io::Error),
}

/// The inotify descriptor, for `AsyncFd` (which wants `AsRawFd`).
struct Fd(Inotify);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

const DIR_EVENTS: AddWatchFlags = AddWatchFlags::IN_CLOSE_WRITE
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_CREATE)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_DELETE_SELF)
    .union(AddWatchFlags::IN_MOVE_SELF)
    .union(AddWatchFlags::IN_ONLYDIR);

const PARENT_EVENTS: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_ONLYDIR);

/// Does an event in the policies directory change what the loader reads?
pub fn relevant(mask: AddWatchFlags, name: Option<&str>) -> bool {
    if mask.intersects(
        AddWatchFlags::IN_Q_OVERFLOW | AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF,
    ) {
        return true;
    }
    match name {
        Some(DATA_LINK) => mask.intersects(AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_CREATE),
        Some(n) => policy_name(n).is_some() && !mask.contains(AddWatchFlags::IN_ISDIR),
        None => false,
    }
}

/// A watch on one policies directory.
pub struct PolicyWatch {
    fd: AsyncFd<Fd>,
    dir: PathBuf,
    dir_name: Option<String>,
    dir_wd: Option<WatchDescriptor>,
    parent_wd: Option<WatchDescriptor>,
}

impl std::fmt::Debug for PolicyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyWatch")
            .field("dir", &self.dir)
            .field("watching", &self.dir_wd.is_some())
            .finish_non_exhaustive()
    }
}

impl PolicyWatch {
    /// Watch `dir` (if it exists) and its parent (for `dir` appearing). Inside a tokio runtime.
    pub fn new(dir: &Path) -> Result<PolicyWatch, WatchError> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(WatchError::Init)?;
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let parent_wd = match inotify.add_watch(&parent, PARENT_EVENTS) {
            Ok(wd) => Some(wd),
            // No parent: only the directory itself (if any) is watched.
            Err(nix::Error::ENOENT) => None,
            Err(source) => {
                return Err(WatchError::Watch {
                    path: parent,
                    source,
                });
            }
        };
        #[expect(
            unsafe_code,
            reason = "tokio's fd registration requires the caller to vouch for the fd's lifetime"
        )]
        // SAFETY: the inotify fd is owned by the `Inotify` moved into the AsyncFd, open for the
        // AsyncFd's whole life, and `as_raw_fd` always returns that same fd.
        let fd = unsafe { AsyncFd::register_with_interest(Fd(inotify), Interest::READABLE) }
            .map_err(|e| WatchError::Read(io::Error::from(e)))?;
        let mut w = PolicyWatch {
            fd,
            dir: dir.to_owned(),
            dir_name: dir.file_name().and_then(|n| n.to_str()).map(str::to_owned),
            dir_wd: None,
            parent_wd,
        };
        w.watch_dir()?;
        Ok(w)
    }

    /// The directory watched.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Is the directory itself watched (it exists)?
    pub fn watching_dir(&self) -> bool {
        self.dir_wd.is_some()
    }

    /// (Re)watch the directory; a missing one is not an error (the parent's watch sees it
    /// appear).
    fn watch_dir(&mut self) -> Result<(), WatchError> {
        match self.fd.get_ref().0.add_watch(&self.dir, DIR_EVENTS) {
            Ok(wd) => {
                self.dir_wd = Some(wd);
                Ok(())
            }
            Err(nix::Error::ENOENT | nix::Error::ENOTDIR) => {
                self.dir_wd = None;
                Ok(())
            }
            Err(source) => Err(WatchError::Watch {
                path: self.dir.clone(),
                source,
            }),
        }
    }

    async fn read(&self) -> Result<Vec<InotifyEvent>, WatchError> {
        loop {
            let mut guard = self.fd.readable().await.map_err(WatchError::Read)?;
            match guard.try_io(|fd| fd.get_ref().0.read_events().map_err(io::Error::from)) {
                Ok(r) => return r.map_err(WatchError::Read),
                Err(_would_block) => continue,
            }
        }
    }

    /// Handle one event: is it a change of the policies? Keeps the watches up to date.
    fn handle(&mut self, ev: &InotifyEvent, seen: &mut Vec<String>) -> Result<bool, WatchError> {
        let name = ev.name.as_ref().and_then(|n| n.to_str());
        let mut changed = false;
        if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            changed = true;
        } else if Some(ev.wd) == self.dir_wd {
            if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                // Removed, moved or unmounted: the parent's watch sees it come back.
                self.dir_wd = None;
                changed = true;
            } else {
                changed = relevant(ev.mask, name);
            }
        } else if Some(ev.wd) == self.parent_wd {
            if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                self.parent_wd = None;
            } else if name.is_some() && name == self.dir_name.as_deref() {
                changed = true;
                if ev
                    .mask
                    .intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
                {
                    self.watch_dir()?;
                }
            }
        }
        if changed {
            let what = name.unwrap_or(if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                "(event queue overflow)"
            } else {
                "(the directory)"
            });
            if seen.len() < 16 && !seen.iter().any(|s| s == what) {
                seen.push(what.to_owned());
            }
        }
        Ok(changed)
    }

    /// Wait for a change of the policies, then for the burst it starts to end (see the module
    /// documentation). Returns the names that changed (at most 16).
    pub async fn changed(&mut self) -> Result<Vec<String>, WatchError> {
        let mut seen = Vec::new();
        let mut first: Option<Instant> = None;
        loop {
            let events = match first {
                None => self.read().await?,
                Some(t0) => {
                    let until = (Instant::now() + QUIET).min(t0 + MAX_DELAY);
                    match tokio::time::timeout_at(until, self.read()).await {
                        Ok(r) => r?,
                        Err(_) => return Ok(seen),
                    }
                }
            };
            for ev in &events {
                if self.handle(ev, &mut seen)? && first.is_none() {
                    first = Some(Instant::now());
                }
            }
        }
    }
}

/// Report each change of the watched directory to `on_change` (awaited before the next is
/// looked at, so reloads never overlap) until `stop` is cancelled. A watch that breaks is
/// logged and ends; SIGHUP still reloads.
pub async fn run<F, Fut>(
    mut watch: PolicyWatch,
    stop: tokio_util::sync::CancellationToken,
    mut on_change: F,
) where
    F: FnMut(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        let changed = tokio::select! {
            _ = stop.cancelled() => return,
            r = watch.changed() => r,
        };
        match changed {
            Ok(names) => on_change(names).await,
            Err(e) => {
                tracing::error!(dir = %watch.dir().display(), error = %e,
                    "watching the policies directory failed; changes now take a reload (SIGHUP)");
                return;
            }
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests;
