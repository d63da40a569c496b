//! Serves the control API on a root-only unix socket (and, optionally, the console — the page
//! and the API behind its own authentication — on a TCP address). Routing and access are in [`super::routes`] and
//! [`super::peer`].

use std::{
    convert::Infallible,
    future::Future,
    io,
    net::SocketAddr,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tracing::{debug, info, warn};

use super::Control;
use super::console::Console;
use super::peer::Peer;
use super::routes::{self, Transport};
use super::tokens::Tokens;

/// The control socket's hand-over key.
const API_KEY: &str = "api";
/// The status page's hand-over key.
const UI_KEY: &str = "ui";

/// Errors binding the control socket.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("another egress-agent is already serving {0}")]
    InUse(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The cause is the source (printed after `: ` by `{:#}`), not repeated in the message.
    #[error("cannot serve the console on {0} (api.ui_listen)")]
    Ui(SocketAddr, #[source] io::Error),
}

/// A bound control socket; [`ApiServer::run`] serves it until `shutdown` resolves.
pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
    /// Enforcement roots: a peer whose cgroup is at or below one of them is a confined process
    /// and is refused, whatever its uid.
    refused_roots: Vec<PathBuf>,
    /// `api.read_group`: its members get the GET endpoints.
    read_gid: Option<u32>,
    /// `api.ui_listen`: the console (the page and the API, see [`super::console`]) on TCP.
    tcp: Option<TcpListener>,
    /// The console's sessions (and the tokens file they are made from).
    console: Option<Arc<Console>>,
    /// The daemon's sockets (taken from a previous agent, offered to a successor), with the
    /// registrations of this server's.
    sockets: Option<Arc<crate::handover::Sockets>>,
    held: Vec<crate::handover::Held>,
}

impl ApiServer {
    /// Binds `path` (mode 0600). A stale socket file left by a crashed agent is replaced; a live
    /// one (something answers on it) is an error.
    pub async fn bind(path: &Path) -> Result<Self, BindError> {
        let io_err = |source| BindError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_err)?;
        }
        if path.exists() {
            if UnixStream::connect(path).await.is_ok() {
                return Err(BindError::InUse(path.to_owned()));
            }
            std::fs::remove_file(path).map_err(io_err)?;
        }
        let listener = UnixListener::bind(path).map_err(io_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io_err)?;
        info!(socket = %path.display(), "control API listening");
        Ok(Self::serving(listener, path))
    }

    fn serving(listener: UnixListener, path: &Path) -> Self {
        Self {
            listener,
            path: path.to_owned(),
            // `exec` commands always; the daemon adds its Docker root.
            refused_roots: crate::exec::exec_root().into_iter().collect(),
            read_gid: None,
            tcp: None,
            console: None,
            sockets: None,
            held: Vec::new(),
        }
    }

    /// [`ApiServer::bind`] through the daemon's sockets: the socket a previous agent handed over
    /// (the same file, never unlinked: clients connecting during a restart are queued, not
    /// refused), else a new one. It is offered to a successor while this server runs.
    pub async fn bind_handed(
        path: &Path,
        sockets: &Arc<crate::handover::Sockets>,
    ) -> Result<Self, BindError> {
        let io_err = |source| BindError::Io {
            path: path.to_owned(),
            source,
        };
        let taken = sockets
            .unix(API_KEY, path, || {
                Err(io::Error::from(io::ErrorKind::NotFound))
            })
            .ok();
        let mut server = match taken {
            Some((listener, held)) => {
                info!(socket = %path.display(), "control API listening (handed over)");
                let mut s = Self::serving(listener, path);
                s.held.push(held);
                s
            }
            None => {
                let mut s = Self::bind(path).await?;
                s.held
                    .push(sockets.hold(API_KEY, &s.listener).map_err(io_err)?);
                s
            }
        };
        server.sockets = Some(sockets.clone());
        Ok(server)
    }

    /// Also refuse peers running in these enforcement roots (confined processes), even as root.
    pub fn refusing_roots(mut self, roots: impl IntoIterator<Item = PathBuf>) -> Self {
        self.refused_roots.extend(roots);
        self
    }

    /// Let members of group `gid` use the GET endpoints: the socket becomes `root:gid` 0660.
    pub fn read_group(mut self, gid: u32) -> Result<Self, BindError> {
        let io_err = |source| BindError::Io {
            path: self.path.clone(),
            source,
        };
        std::os::unix::fs::chown(&self.path, Some(0), Some(gid)).map_err(io_err)?;
        std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o660))
            .map_err(io_err)?;
        self.read_gid = Some(gid);
        Ok(self)
    }

    /// Also serve the console on `addr`: the page, reads for root and the read group of this
    /// host, everything for a session made with a token of `tokens` (`console.tokens`).
    pub async fn ui_listen(mut self, addr: SocketAddr, tokens: &Path) -> Result<Self, BindError> {
        let err = |source| BindError::Ui(addr, source);
        if !addr.ip().is_loopback() {
            warn!(address = %addr, "the console is served over plain HTTP on a non-loopback address: its token and session cookie cross the network in clear text; prefer a loopback address reached through an SSH tunnel");
        }
        let l = match self.sockets.clone() {
            Some(sockets) => {
                let (l, held) = sockets
                    .tcp(UI_KEY, addr, |a| {
                        let l = std::net::TcpListener::bind(a)?;
                        l.set_nonblocking(true)?;
                        TcpListener::from_std(l)
                    })
                    .map_err(err)?;
                self.held.push(held);
                l
            }
            None => TcpListener::bind(addr).await.map_err(err)?,
        };
        info!(address = %addr, tokens = %tokens.display(), "console listening");
        self.tcp = Some(l);
        self.console = Some(Arc::new(Console::new(Tokens::new(tokens.to_owned()))));
        Ok(self)
    }

    /// The TCP address actually bound, if any.
    pub fn ui_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub async fn run(self, control: Arc<dyn Control>, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let roots = Arc::new(self.refused_roots);
        let read_gid = self.read_gid;
        let tcp = self.tcp;
        let console = self.console.clone();
        let handed_over = self.sockets.clone().unwrap_or_default();
        let mut conns = tokio::task::JoinSet::new();
        loop {
            while conns.try_join_next().is_some() {}
            let (io, peer, transport) = tokio::select! {
                _ = &mut shutdown => break,
                () = handed_over.handed_over() => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let peer = Peer::of_unix(&stream, &roots);
                        (Stream::Unix(stream), peer, Transport::Unix)
                    }
                    Err(e) => {
                        warn!(error = %e, "control API accept failed");
                        continue;
                    }
                },
                accepted = accept_tcp(tcp.as_ref()) => match accepted {
                    Ok((stream, remote)) => {
                        if let Some(c) = &console {
                            c.accepted();
                        }
                        let Ok(local) = stream.local_addr() else { continue };
                        let roots = roots.clone();
                        // The /proc lookups block: off the runtime's threads. A failed lookup
                        // is a refused peer.
                        let peer = tokio::task::spawn_blocking(move || {
                            Peer::of_tcp(local, remote, &roots)
                        })
                        .await
                        .unwrap_or(Peer { confined: true, ..Peer::default() });
                        (Stream::Tcp(stream), peer, Transport::Tcp(local))
                    }
                    Err(e) => {
                        warn!(error = %e, "status page accept failed");
                        continue;
                    }
                },
            };
            let control = control.clone();
            let console = console.clone();
            conns.spawn(async move {
                let peer = Arc::new(peer);
                let service = service_fn(move |req| {
                    let control = control.clone();
                    let peer = peer.clone();
                    let console = console.clone();
                    async move {
                        let on = (transport, console.as_deref());
                        Ok::<_, Infallible>(
                            routes::route(req, &peer, read_gid, on, control.as_ref()).await,
                        )
                    }
                });
                let builder = hyper::server::conn::http1::Builder::new();
                let result = match io {
                    Stream::Unix(s) => builder.serve_connection(TokioIo::new(s), service).await,
                    Stream::Tcp(s) => builder.serve_connection(TokioIo::new(s), service).await,
                };
                if let Err(e) = result {
                    debug!(error = %e, "control API connection ended");
                }
            });
        }
        // A request in flight gets a moment to finish; a stream (`events --follow`) ends here.
        crate::tasks::end_connections(conns, crate::tasks::CONNECTION_DRAIN).await;
        // After a hand-over the successor serves this same file: it stays.
        if !self.sockets.as_ref().is_some_and(|s| s.is_handed_over()) {
            std::fs::remove_file(&self.path).ok();
        }
        drop(self.held);
    }
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

async fn accept_tcp(l: Option<&TcpListener>) -> io::Result<(TcpStream, SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Apply `[api]`: the read-only group (resolved now: an unknown group fails the start) and the
/// console's address, with its tokens in `state_dir`.
pub async fn with_config(
    server: ApiServer,
    api: &crate::config::ApiConfig,
    state_dir: &Path,
) -> Result<ApiServer, BindError> {
    let mut server = server;
    if let Some(name) = &api.read_group {
        let gid = match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => g.gid.as_raw(),
            Ok(None) => {
                return Err(BindError::Io {
                    path: server.path.clone(),
                    source: io::Error::other(format!("api.read_group: no group named {name:?}")),
                });
            }
            Err(e) => {
                return Err(BindError::Io {
                    path: server.path.clone(),
                    source: io::Error::other(format!("api.read_group {name:?}: {e}")),
                });
            }
        };
        server = server.read_group(gid)?;
    }
    if let Some(addr) = api.ui_listen {
        server = server
            .ui_listen(addr, &state_dir.join(super::tokens::FILE))
            .await?;
    }
    Ok(server)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text `run` prints when the status page's port is taken (docs/troubleshooting.md
    /// quotes it).
    #[tokio::test]
    async fn a_taken_console_port_says_so_once() {
        let dir = std::env::temp_dir().join(format!("egress-api-ui-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("addr");
        let server = ApiServer::bind(&dir.join("api.sock"))
            .await
            .expect("api socket");
        let Err(e) = server.ui_listen(addr, &dir.join("console.tokens")).await else {
            panic!("port in use")
        };
        assert_eq!(
            format!("{:#}", anyhow::Error::from(e)),
            format!(
                "cannot serve the console on {addr} (api.ui_listen): Address already in use (os error 98)"
            )
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
