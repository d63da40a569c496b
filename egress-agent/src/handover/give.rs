//! The running agent's side: offer the sockets to a successor and learn when it serves.
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use super::sockets::Sockets;
use super::wire::{Conn, Listener, Msg, VERSION};

/// How long a successor has to say hello.
const HELLO_WAIT: Duration = Duration::from_secs(10);
/// How long a successor that took the offer has to say it serves (its start, including the
/// first reconcile of every runtime, which it bounds at [`super::RECONCILE_WAIT`]).
const READY_WAIT: Duration = Duration::from_secs(120);

/// The hand-over socket of the running agent.
#[derive(Debug)]
pub struct Giver {
    listener: AsyncFd<Listener>,
    path: PathBuf,
    sockets: Arc<Sockets>,
}

/// A successor that took the sockets and serves them.
#[derive(Debug)]
pub struct Successor {
    conn: Arc<Conn>,
    pub pid: u32,
}

impl Giver {
    /// Listen on `path` (the state directory's `handover.sock`).
    pub fn listen(path: &Path, sockets: Arc<Sockets>) -> io::Result<Giver> {
        let listener = Listener::bind(path)?;
        #[expect(
            unsafe_code,
            reason = "tokio's fd registration requires the caller to vouch for the fd's lifetime"
        )]
        // SAFETY: the socket is owned by the `Listener` moved into the AsyncFd, open for the
        // AsyncFd's whole life, and `as_raw_fd` always returns that same fd.
        let listener =
            unsafe { AsyncFd::register_with_interest(listener, tokio::io::Interest::READABLE) }
                .map_err(io::Error::from)?;
        Ok(Giver {
            listener,
            path: path.to_owned(),
            sockets,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Offer the sockets to whoever connects, one at a time, until one says it serves them. A
    /// successor that fails before that (its start failed, it was killed) changes nothing here:
    /// this agent keeps serving.
    pub async fn successor(&self) -> Successor {
        loop {
            let conn = match self.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "hand-over socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let sockets = self.sockets.clone();
            let r =
                tokio::task::spawn_blocking(move || offer(&conn, &sockets).map(|pid| (conn, pid)))
                    .await;
            match r {
                Ok(Ok((conn, pid))) => {
                    return Successor {
                        conn: Arc::new(conn),
                        pid,
                    };
                }
                Ok(Err(e)) => tracing::warn!(error = %e,
                    "a new agent did not take over; this one keeps serving"),
                Err(e) => tracing::warn!(error = %e, "hand-over task failed"),
            }
        }
    }

    async fn accept(&self) -> io::Result<Conn> {
        loop {
            let mut ready = self.listener.readable().await?;
            match ready.try_io(|l| l.get_ref().accept()) {
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }
}

/// One successor's conversation up to `Ready`: its pid.
fn offer(conn: &Conn, sockets: &Sockets) -> io::Result<u32> {
    conn.set_timeout(Some(HELLO_WAIT))?;
    if conn.peer_uid()? != 0 {
        conn.send(
            &Msg::Refused {
                reason: "only root may take the agent's sockets".into(),
            },
            &[],
        )?;
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "a non-root process asked for the sockets",
        ));
    }
    let pid = match conn.recv()?.0 {
        Msg::Hello { version, pid } if version == VERSION => pid,
        Msg::Hello { version, pid } => {
            let reason = format!(
                "the running agent (pid {}) speaks hand-over version {VERSION} and the new one {version}: stop the running agent first (systemctl stop egress-agent), or upgrade through a build that speaks both",
                std::process::id()
            );
            conn.send(&Msg::Refused { reason }, &[])?;
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("pid {pid} speaks hand-over version {version}"),
            ));
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected hello, got {other:?}"),
            ));
        }
    };
    let mut fds = sockets.offer()?;
    let count = fds.len();
    // After the peer check above: only a root successor gets the env secrets.
    let secrets = super::secrets::offer()?;
    let env_secrets = secrets.len();
    fds.extend(secrets);
    tracing::info!(
        successor = pid,
        sockets = count,
        env_secrets,
        "offering the sockets (and env secrets) to a new agent"
    );
    conn.send_offer(std::process::id(), &fds)?;
    drop(fds);
    conn.set_timeout(Some(READY_WAIT))?;
    match conn.recv()?.0 {
        Msg::Ready => Ok(pid),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected ready, got {other:?}"),
        )),
    }
}

impl Successor {
    async fn send(&self, msg: Msg) -> io::Result<()> {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || conn.send(&msg, &[]))
            .await
            .map_err(io::Error::other)?
    }

    /// Tell the successor this agent stopped accepting and released what only one agent may
    /// hold (the kernel's event ring).
    pub async fn released(&self) -> io::Result<()> {
        self.send(Msg::Released).await
    }

    /// Tell the successor how many connections this agent still relays (a small packet on a
    /// socket the successor reads all the time: sent in place).
    pub fn draining(&self, connections: usize) -> io::Result<()> {
        self.conn.send(&Msg::Draining { connections }, &[])
    }
}

impl AsRawFd for Giver {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.listener.get_ref().as_raw_fd()
    }
}
