//! The successor's side: take the running agent's sockets, then tell it when this agent serves.
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use super::wire::{Conn, Msg, VERSION};

/// How long the running agent has to offer its sockets.
const OFFER_WAIT: Duration = Duration::from_secs(10);
/// How long it has, once told this agent serves, to stop accepting and release the event ring.
const RELEASE_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum TakeError {
    #[error(
        "a running agent answers on {path} but did not hand over its sockets: {source} (stop it first: systemctl stop egress-agent)"
    )]
    Offer { path: PathBuf, source: io::Error },
    #[error("the previous agent (pid {pid}) did not let go of its sockets: {source}")]
    Release { pid: u32, source: io::Error },
}

/// Sockets taken from a running agent, which serves them too until [`Taking::serving`].
#[derive(Debug)]
pub struct Taking {
    conn: Conn,
    pub from_pid: u32,
    fds: Vec<(String, OwnedFd)>,
    /// Its env secrets, by variable name (sealed memfds, see [`super::secrets`]).
    env_secrets: Vec<(String, OwnedFd)>,
}

/// The agent that handed over, while it drains (what `status` and the metrics show).
#[derive(Debug, Default)]
pub struct Previous {
    pid: AtomicU32,
    draining: AtomicUsize,
}

impl Previous {
    /// The previous agent's pid while it still runs (0 once it exited).
    pub fn pid(&self) -> u32 {
        self.pid.load(Ordering::Acquire)
    }

    /// Connections it still relays.
    pub fn draining(&self) -> usize {
        self.draining.load(Ordering::Acquire)
    }
}

/// Take the sockets of the agent serving on `path`. `None`: no agent runs there (no socket, or
/// a stale one left by an agent that died).
pub async fn take(path: &Path) -> Result<Option<Taking>, TakeError> {
    let p = path.to_owned();
    let r = tokio::task::spawn_blocking(move || -> io::Result<Option<Taking>> {
        let conn = match Conn::connect(&p) {
            Ok(c) => c,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                if e.kind() == io::ErrorKind::ConnectionRefused {
                    tracing::info!(socket = %p.display(),
                        "the previous agent's hand-over socket is stale (it did not stop cleanly); binding new sockets");
                }
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        conn.set_timeout(Some(OFFER_WAIT))?;
        conn.send(
            &Msg::Hello {
                version: VERSION,
                pid: std::process::id(),
            },
            &[],
        )?;
        let (from_pid, fds) = conn.recv_offer()?;
        let (fds, env_secrets) = super::secrets::split(fds);
        Ok(Some(Taking {
            conn,
            from_pid,
            fds,
            env_secrets,
        }))
    })
    .await
    .map_err(io::Error::other)
    .and_then(|r| r);
    r.map_err(|source| TakeError::Offer {
        path: path.to_owned(),
        source,
    })
}

impl Taking {
    /// The sockets, by name (for [`super::Sockets::adopt`]).
    pub fn sockets(&mut self) -> Vec<(String, OwnedFd)> {
        std::mem::take(&mut self.fds)
    }

    /// Install the running agent's env secrets in this process's table (before the
    /// configuration is resolved with them); returns the variables installed.
    pub fn install_env_secrets(&mut self) -> Vec<String> {
        super::secrets::install(std::mem::take(&mut self.env_secrets))
    }

    /// This agent serves every socket it took: the previous one stops accepting and releases
    /// the event ring. Its drain is followed in the returned [`Previous`] until it exits.
    pub async fn serving(self) -> Result<Arc<Previous>, TakeError> {
        let pid = self.from_pid;
        let conn = Arc::new(self.conn);
        let c = conn.clone();
        let released = tokio::task::spawn_blocking(move || -> io::Result<()> {
            c.send(&Msg::Ready, &[])?;
            c.set_timeout(Some(RELEASE_WAIT))?;
            match c.recv()?.0 {
                Msg::Released => Ok(()),
                other => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected released, got {other:?}"),
                )),
            }
        })
        .await
        .map_err(io::Error::other)
        .and_then(|r| r);
        released.map_err(|source| TakeError::Release { pid, source })?;
        let previous = Arc::new(Previous {
            pid: AtomicU32::new(pid),
            draining: AtomicUsize::new(0),
        });
        let p = previous.clone();
        tokio::task::spawn_blocking(move || {
            if conn.set_timeout(None).is_err() {
                return;
            }
            loop {
                match conn.recv() {
                    Ok((Msg::Draining { connections }, _)) => {
                        p.draining.store(connections, Ordering::Release);
                    }
                    Ok((other, _)) => {
                        tracing::debug!(msg = ?other, "unexpected hand-over message");
                    }
                    Err(_) => break,
                }
            }
            p.draining.store(0, Ordering::Release);
            p.pid.store(0, Ordering::Release);
            tracing::info!(pid, "the previous agent has exited");
        });
        Ok(previous)
    }
}
