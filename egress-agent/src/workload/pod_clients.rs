//! Which container of a pod a proxy client is: the cgroup of the client's socket, asked of the
//! pod's network namespace through `sock_diag` (`INET_DIAG_CGROUP_ID`, Linux 5.8+), named by the
//! [`Directory`]'s members (the containerd runtime names each app container's cgroup there).
//!
//! The netlink socket is opened once per pod, inside the sandbox's network namespace (a
//! short-lived thread enters it, so the agent's own threads never change namespace); a
//! `sock_diag` socket answers for the namespace it was made in. Until the sandbox runs, and for
//! any client the kernel can't find (it closed already), events name the pod alone.
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::sync::Mutex;

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP};
use netlink_packet_sock_diag::inet::{
    ExtensionFlags, InetRequest, SocketId, StateFlags, nlas::Nla,
};
use netlink_sys::{Socket, protocols::NETLINK_SOCK_DIAG};

use super::directory::Directory;
use crate::proxy::client::ClientNames;

/// `INET_DIAG_CGROUP_ID` (include/uapi/linux/inet_diag.h): the socket's cgroup v2 id, u64.
const INET_DIAG_CGROUP_ID: u16 = 21;
/// `INET_DIAG_NOCOOKIE`: match by addresses, not by socket cookie.
const NO_COOKIE: [u8; 8] = [0xff; 8];

/// A pod's clients, named by their container.
#[derive(Debug)]
pub struct PodClients {
    diag: Mutex<Option<Socket>>,
    directory: Directory,
}

impl PodClients {
    pub fn new(directory: Directory) -> PodClients {
        PodClients {
            diag: Mutex::new(None),
            directory,
        }
    }

    /// The pod's sandbox runs as `pid`: open the `sock_diag` socket in its network namespace.
    pub fn attach(&self, pid: u32) -> io::Result<()> {
        let ns = File::open(format!("/proc/{pid}/ns/net"))?;
        let socket = std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(io::Error::from)?;
                let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
                socket.bind_auto()?;
                socket.connect(&netlink_sys::SocketAddr::new(0, 0))?;
                Ok::<_, io::Error>(socket)
            })
            .join()
            .map_err(|_| io::Error::other("netns thread panicked"))?
        })?;
        *self.diag.lock().unwrap_or_else(|p| p.into_inner()) = Some(socket);
        Ok(())
    }

    /// The cgroup of the pod's socket connected from `client` to `local` (TCP), or bound to
    /// `client`'s port (UDP: a resolver's socket may be connected to the address it meant,
    /// before the kernel's redirect, so it is found by its local port).
    fn cgroup_of(
        &self,
        client: SocketAddr,
        local: SocketAddr,
        udp: bool,
    ) -> io::Result<Option<u64>> {
        let guard = self.diag.lock().unwrap_or_else(|p| p.into_inner());
        let Some(socket) = guard.as_ref() else {
            return Ok(None);
        };
        let mut id = if client.is_ipv4() {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        };
        id.source_port = client.port();
        id.source_address = client.ip();
        id.destination_port = local.port();
        id.destination_address = local.ip();
        id.cookie = NO_COOKIE;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | if udp { NLM_F_DUMP } else { 0 };
        let mut packet = NetlinkMessage::new(
            header,
            SockDiagMessage::InetRequest(InetRequest {
                family: if client.is_ipv4() { AF_INET } else { AF_INET6 },
                protocol: if udp { IPPROTO_UDP } else { IPPROTO_TCP },
                extensions: ExtensionFlags::empty(),
                states: StateFlags::all(),
                socket_id: id,
            })
            .into(),
        );
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        socket.send(&buf, 0)?;
        let mut found = None;
        let mut rx = vec![0u8; 16 << 10];
        loop {
            let n = socket.recv(&mut &mut rx[..], 0)?;
            let mut at = 0;
            while at < n {
                let msg = <NetlinkMessage<SockDiagMessage>>::deserialize(&rx[at..n])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = msg.header.length as usize;
                match msg.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                        let is_client = !udp || r.header.socket_id.source_port == client.port();
                        if is_client && found.is_none() {
                            found = r.nlas.iter().find_map(cgroup_id);
                        }
                        if !udp {
                            return Ok(found);
                        }
                    }
                    // ENOENT (gone) and the end of a dump alike: what was found, if anything.
                    NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => return Ok(found),
                    _ => {}
                }
                if len == 0 {
                    return Ok(found);
                }
                at += len;
            }
        }
    }
}

fn cgroup_id(nla: &Nla) -> Option<u64> {
    use netlink_packet_core::Nla as _;
    match nla {
        Nla::Other(a) if a.kind() == INET_DIAG_CGROUP_ID && a.value_len() == 8 => {
            let mut v = [0u8; 8];
            a.emit_value(&mut v);
            Some(u64::from_ne_bytes(v))
        }
        _ => None,
    }
}

impl ClientNames for PodClients {
    fn names(&self, client: SocketAddr, local: SocketAddr, udp: bool) -> BTreeMap<String, String> {
        match self.cgroup_of(client, local, udp) {
            Ok(Some(cgroup)) => self.directory.member(cgroup).unwrap_or_default(),
            Ok(None) => BTreeMap::new(),
            Err(e) => {
                tracing::debug!(error = %e, %client, "sock_diag: the client's cgroup is unknown");
                BTreeMap::new()
            }
        }
    }
}
