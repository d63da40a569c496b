//! The hand-over protocol: JSON messages on a unix `SOCK_SEQPACKET` socket (one message per
//! packet, so the descriptors of an offer travel with its names in `SCM_RIGHTS`).
//!
//! ```text
//! successor                         running agent
//!   Hello {version, pid}       →
//!                              ←    Offer {names, last} + fds   (repeated until last)
//!   (binds nothing it was given; reconciles; serves)
//!   Ready                      →
//!                                   stops accepting, stops its tasks, releases the kernel
//!                              ←    Released                    event ring
//!                              ←    Draining {connections}      (every second, until 0)
//!                                   exits (EOF)
//! ```
//! A running agent that can't hand over answers `Refused {reason}`. An offer's descriptors are
//! its listening sockets, and its `env` secrets as sealed memfds named `env-secret/<VAR>`
//! ([`super::secrets`]).
use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, accept4, bind, connect, getsockopt, listen, recvmsg, sendmsg, setsockopt, socket,
    sockopt,
};
use serde::{Deserialize, Serialize};

/// This build's protocol version: a successor speaking another is refused (and says so).
pub const VERSION: u32 = 1;
/// Descriptors per packet (the kernel's limit is 253).
const FDS_PER_PACKET: usize = 200;
/// Largest message.
const MAX_MSG: usize = 256 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum Msg {
    Hello {
        version: u32,
        pid: u32,
    },
    Offer {
        version: u32,
        pid: u32,
        names: Vec<String>,
        last: bool,
    },
    Refused {
        reason: String,
    },
    Ready,
    Released,
    Draining {
        connections: usize,
    },
}

/// One end of a hand-over connection (blocking; [`Conn::set_timeout`] bounds each receive).
#[derive(Debug)]
pub struct Conn(OwnedFd);

fn errno(e: nix::Error) -> io::Error {
    io::Error::from(e)
}

fn seqpacket(flags: SockFlag) -> io::Result<OwnedFd> {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | flags,
        None,
    )
    .map_err(errno)
}

impl Conn {
    /// Two connected ends (tests and the fuzz target).
    pub fn pair() -> io::Result<(Conn, Conn)> {
        let (a, b) = nix::sys::socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(errno)?;
        Ok((Conn(a), Conn(b)))
    }

    /// Send raw bytes as one message (the fuzz target's input).
    pub fn send_raw(&self, bytes: &[u8]) -> io::Result<()> {
        nix::sys::socket::send(self.0.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL).map_err(errno)?;
        Ok(())
    }

    /// Connect to the running agent's hand-over socket.
    pub fn connect(path: &Path) -> io::Result<Conn> {
        let fd = seqpacket(SockFlag::empty())?;
        connect(fd.as_raw_fd(), &UnixAddr::new(path).map_err(errno)?).map_err(errno)?;
        Ok(Conn(fd))
    }

    /// Bound every receive (`None`: wait forever).
    pub fn set_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        let tv = nix::sys::time::TimeVal::from(libc::timeval {
            tv_sec: t.map_or(0, |t| i64::try_from(t.as_secs()).unwrap_or(i64::MAX)),
            tv_usec: t.map_or(0, |t| i64::from(t.subsec_micros())),
        });
        setsockopt(&self.0, sockopt::ReceiveTimeout, &tv).map_err(errno)
    }

    /// The peer's uid (only root may take the sockets).
    pub fn peer_uid(&self) -> io::Result<u32> {
        Ok(getsockopt(&self.0, sockopt::PeerCredentials)
            .map_err(errno)?
            .uid())
    }

    pub fn send(&self, msg: &Msg, fds: &[RawFd]) -> io::Result<()> {
        let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
        let iov = [IoSlice::new(&bytes)];
        let cmsg = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
        sendmsg::<UnixAddr>(
            self.0.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(errno)?;
        Ok(())
    }

    /// The next message and the descriptors that came with it. End of stream is
    /// `UnexpectedEof`; a receive timeout is `WouldBlock`.
    pub fn recv(&self) -> io::Result<(Msg, Vec<OwnedFd>)> {
        let mut buf = vec![0u8; MAX_MSG];
        let mut cmsg = nix::cmsg_space!([RawFd; FDS_PER_PACKET]);
        let (len, fds, truncated) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let r = recvmsg::<UnixAddr>(
                self.0.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(errno)?;
            let mut fds = Vec::new();
            for c in r.cmsgs().map_err(errno)? {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: the kernel just installed these descriptors in this process for
                    // us; nothing else owns them.
                    #[expect(unsafe_code, reason = "descriptors received with SCM_RIGHTS")]
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            let truncated = r
                .flags
                .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
            (r.bytes, fds, truncated)
        };
        if len == 0 && fds.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the other agent closed the hand-over connection",
            ));
        }
        if truncated {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a hand-over message was truncated",
            ));
        }
        let msg = serde_json::from_slice(&buf[..len]).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a hand-over message is not understood: {e}"),
            )
        })?;
        Ok((msg, fds))
    }

    /// Send every socket in `fds` by name, in packets of at most [`FDS_PER_PACKET`].
    pub fn send_offer(&self, pid: u32, fds: &[(String, OwnedFd)]) -> io::Result<()> {
        let mut chunks = fds.chunks(FDS_PER_PACKET).peekable();
        if chunks.peek().is_none() {
            return self.send(
                &Msg::Offer {
                    version: VERSION,
                    pid,
                    names: Vec::new(),
                    last: true,
                },
                &[],
            );
        }
        while let Some(chunk) = chunks.next() {
            let msg = Msg::Offer {
                version: VERSION,
                pid,
                names: chunk.iter().map(|(n, _)| n.clone()).collect(),
                last: chunks.peek().is_none(),
            };
            self.send(&msg, &super::sockets::raw(chunk))?;
        }
        Ok(())
    }

    /// Receive a whole offer (after `Hello`): the giver's pid and its sockets by name.
    pub fn recv_offer(&self) -> io::Result<(u32, Vec<(String, OwnedFd)>)> {
        let mut out = Vec::new();
        loop {
            let (msg, fds) = self.recv()?;
            match msg {
                Msg::Offer {
                    version,
                    pid,
                    names,
                    last,
                } => {
                    if version != VERSION {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "the running agent speaks hand-over version {version}, this build {VERSION}"
                            ),
                        ));
                    }
                    if names.len() != fds.len() {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "an offer named {} sockets and carried {}",
                                names.len(),
                                fds.len()
                            ),
                        ));
                    }
                    out.extend(names.into_iter().zip(fds));
                    if last {
                        return Ok((pid, out));
                    }
                }
                Msg::Refused { reason } => {
                    return Err(io::Error::new(io::ErrorKind::PermissionDenied, reason));
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("expected an offer, got {other:?}"),
                    ));
                }
            }
        }
    }
}

/// The running agent's hand-over socket.
#[derive(Debug)]
pub struct Listener(OwnedFd);

impl Listener {
    /// Bind `path` (root only, mode 0600; its directory is created 0700 if missing), replacing a
    /// file left there; non-blocking.
    pub fn bind(path: &Path) -> io::Result<Listener> {
        if let Some(dir) = path.parent()
            && !dir.exists()
        {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        let fd = seqpacket(SockFlag::SOCK_NONBLOCK)?;
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        bind(fd.as_raw_fd(), &UnixAddr::new(path).map_err(errno)?).map_err(errno)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        listen(&fd, Backlog::new(4).map_err(errno)?).map_err(errno)?;
        Ok(Listener(fd))
    }

    /// Accept one connection (`WouldBlock` when none is waiting); the connection is blocking.
    pub fn accept(&self) -> io::Result<Conn> {
        let fd = accept4(self.0.as_raw_fd(), SockFlag::SOCK_CLOEXEC).map_err(errno)?;
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        #[expect(unsafe_code, reason = "the descriptor accept4 returned")]
        Ok(Conn(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

impl std::os::fd::AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn pair() -> (Conn, Conn) {
        Conn::pair().unwrap()
    }

    /// An offer larger than one packet arrives whole, each descriptor with its name.
    #[test]
    fn an_offer_arrives_whole_and_in_order() {
        let (a, b) = pair();
        let fds: Vec<(String, OwnedFd)> = (0..FDS_PER_PACKET + 7)
            .map(|i| {
                let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                (format!("s{i}"), OwnedFd::from(s))
            })
            .collect();
        let ports: Vec<u16> = fds
            .iter()
            .map(|(_, f)| {
                std::net::UdpSocket::from(f.try_clone().unwrap())
                    .local_addr()
                    .unwrap()
                    .port()
            })
            .collect();
        let t = std::thread::spawn(move || {
            a.send_offer(7, &fds).unwrap();
        });
        let (pid, got) = b.recv_offer().unwrap();
        t.join().unwrap();
        assert_eq!(pid, 7);
        assert_eq!(got.len(), ports.len());
        for (i, ((name, fd), port)) in got.into_iter().zip(ports).enumerate() {
            assert_eq!(name, format!("s{i}"));
            assert_eq!(
                std::net::UdpSocket::from(fd).local_addr().unwrap().port(),
                port
            );
        }
    }

    #[test]
    fn an_empty_offer_is_one_packet() {
        let (a, b) = pair();
        a.send_offer(1, &[]).unwrap();
        assert!(b.recv_offer().unwrap().1.is_empty());
    }

    /// Another version, a refusal, a mismatch of names and descriptors, garbage and EOF are
    /// errors that say what happened.
    #[test]
    fn bad_offers_are_errors() {
        let (a, b) = pair();
        a.send(
            &Msg::Offer {
                version: VERSION + 1,
                pid: 1,
                names: vec![],
                last: true,
            },
            &[],
        )
        .unwrap();
        assert!(b.recv_offer().unwrap_err().to_string().contains("version"));
        a.send(
            &Msg::Offer {
                version: VERSION,
                pid: 1,
                names: vec!["x".into()],
                last: true,
            },
            &[],
        )
        .unwrap();
        assert!(b.recv_offer().unwrap_err().to_string().contains("named 1"));
        a.send(
            &Msg::Refused {
                reason: "busy".into(),
            },
            &[],
        )
        .unwrap();
        assert_eq!(b.recv_offer().unwrap_err().to_string(), "busy");
        a.send_raw(b"{not json").unwrap();
        assert!(b.recv().unwrap_err().to_string().contains("not understood"));
        drop(a);
        assert_eq!(b.recv().unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    /// The running agent's socket: created with its directory, refused to non-root by the
    /// mode, and a successor that connects gets what was offered.
    #[test]
    fn the_listener_creates_its_directory_and_serves_one_connection() {
        let dir = crate::test_dir::fresh("handover");
        let path = dir.join("state").join("handover.sock");
        let l = Listener::bind(&path).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let c = Conn::connect(&path).unwrap();
        let s = loop {
            match l.accept() {
                Ok(s) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        };
        s.send_offer(3, &[]).unwrap();
        assert_eq!(c.recv_offer().unwrap().0, 3);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_receive_times_out() {
        let (_a, b) = pair();
        b.set_timeout(Some(Duration::from_millis(20))).unwrap();
        assert_eq!(b.recv().unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }
}
