//! systemd's file-descriptor store: the sockets survive a crash of the agent.
//!
//! Under systemd (`NOTIFY_SOCKET` set; the unit allows `FileDescriptorStoreMax=`), every socket
//! the agent binds itself is also handed to the service manager (`FDSTORE=1`, `FDNAME=<key>`) and
//! taken back out when its workload goes (`FDSTOREREMOVE=1`). When the agent dies, systemd keeps
//! them open: connections queue in their backlogs, DNS queries in their receive buffers, and the
//! agent systemd restarts gets them back (`LISTEN_FDS`, `LISTEN_FDNAMES`) and adopts them by key
//! like a hand-over's. What a workload sees of a crash is then a delay, not a refusal.
//!
//! Sockets taken over (from a hand-over or from the store) are not stored again: their names are
//! in the store already.
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

/// Whether a service manager listens (`NOTIFY_SOCKET`).
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Hand a duplicate of `fd` to the store under `key`.
pub fn store(key: &str, fd: &impl AsFd) {
    let states = [
        sd_notify::NotifyState::FdStore,
        sd_notify::NotifyState::FdName(key),
    ];
    if let Err(e) = sd_notify::notify_with_fds(&states, &[fd.as_fd()]) {
        tracing::debug!(key, error = %e, "FDSTORE failed: the socket does not survive a crash");
    }
}

/// Take every socket named `key` out of the store.
pub fn remove(key: &str) {
    let states = [
        sd_notify::NotifyState::FdStoreRemove,
        sd_notify::NotifyState::FdName(key),
    ];
    if let Err(e) = sd_notify::notify(&states) {
        tracing::debug!(key, error = %e, "FDSTOREREMOVE failed");
    }
}

/// The sockets the service manager passed to this process (`LISTEN_FDS` for its pid), by name.
pub fn passed() -> Vec<(String, OwnedFd)> {
    match sd_notify::listen_fds_with_names() {
        Ok(fds) => fds
            .map(|(fd, name)| {
                #[expect(
                    unsafe_code,
                    reason = "descriptors the service manager passed (LISTEN_FDS)"
                )]
                // SAFETY: LISTEN_PID names this process, so fds 3.. are the service manager's,
                // passed to it alone; each is taken exactly once here.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                (name, fd)
            })
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "LISTEN_FDS from the service manager unreadable; binding new sockets");
            Vec::new()
        }
    }
}
