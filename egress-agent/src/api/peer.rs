//! Who is on the other end of a control connection, and what they may do.
//!
//! - Unix socket: `SO_PEERCRED` (uid, gid, pid at `connect()` time), then the process's cgroup
//!   and supplementary groups from `/proc/<pid>/{cgroup,status}` (its uid there must still be the
//!   credential's, or the peer is refused: the pid was reused).
//! - Loopback TCP (the status page's optional address): the client socket is found in
//!   `/proc/net/tcp{,6}` by its address pair (uid, inode), its process by the inode among
//!   `/proc/<pid>/fd`, then the same checks. Not found: a remote client (`remote`), which gets
//!   only what a console token gives it ([`super::console`]).
//!
//! Access: root outside every enforcement root gets everything; a member of `api.read_group`
//! (outside them) gets the GET endpoints; everybody else, and every confined process whatever
//! its uid, is refused.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

/// A control connection's peer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Peer {
    pub uid: Option<u32>,
    pub pid: Option<u32>,
    /// Effective gid and supplementary groups.
    pub groups: Vec<u32>,
    /// In an enforcement root — or its cgroup could not be read (refused as well).
    pub confined: bool,
    /// A TCP client the agent could not attribute to a process of its network namespace: a
    /// remote host (when `api.ui_listen` is not loopback). It gets what a token gives it.
    pub remote: bool,
}

/// What a peer may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Full,
    /// GET only (`api.read_group`).
    ReadOnly,
    Refused(&'static str),
}

impl Peer {
    /// The peer of a unix stream (`SO_PEERCRED`).
    pub fn of_unix(stream: &tokio::net::UnixStream, roots: &[PathBuf]) -> Peer {
        match stream.peer_cred() {
            Ok(c) => Peer::of_process(
                c.uid(),
                Some(c.gid()),
                c.pid().and_then(|p| u32::try_from(p).ok()),
                roots,
            ),
            Err(_) => Peer {
                confined: true,
                ..Peer::default()
            },
        }
    }

    /// The peer of a loopback TCP connection accepted on `local` from `remote`.
    pub fn of_tcp(local: SocketAddr, remote: SocketAddr, roots: &[PathBuf]) -> Peer {
        match tcp_owner(local, remote) {
            Some((uid, pid)) => Peer::of_process(uid, None, pid, roots),
            None => Peer {
                remote: true,
                ..Peer::default()
            },
        }
    }

    fn of_process(uid: u32, gid: Option<u32>, pid: Option<u32>, roots: &[PathBuf]) -> Peer {
        let Some(pid) = pid.filter(|p| *p > 0) else {
            return Peer {
                uid: Some(uid),
                confined: true,
                ..Peer::default()
            };
        };
        // The agent's own cgroup is never a confined workload's: it may lie under a root (a
        // DaemonSet pod under /kubepods), and its own container runs the probes and `kubectl
        // exec` commands that use the API. Its kernel entry is `allow_all` (`exempt_self`).
        let own = crate::cgroup::cgroup_of_pid(std::process::id()).ok();
        let confined = match crate::cgroup::cgroup_of_pid(pid) {
            Ok(cg) => own.as_ref() != Some(&cg) && roots.iter().any(|r| cg.starts_with(r)),
            Err(_) => true,
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let ids = |key: &str| -> Vec<u32> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|rest| {
                    rest.split_whitespace()
                        .filter_map(|n| n.parse().ok())
                        .collect()
                })
                .unwrap_or_default()
        };
        // Uid: real, effective, saved, fs. The credential's uid is the effective one at connect.
        let still_same = ids("Uid:").get(1) == Some(&uid);
        let mut groups = Vec::new();
        if still_same {
            groups.extend(gid.or_else(|| ids("Gid:").get(1).copied()));
            groups.extend(ids("Groups:"));
        }
        Peer {
            uid: Some(uid),
            pid: Some(pid),
            groups,
            confined: confined || !still_same,
            remote: false,
        }
    }

    /// What this peer may do, given the read-only group's gid.
    pub fn access(&self, read_gid: Option<u32>) -> Access {
        if self.confined {
            return Access::Refused("the control API refuses confined processes");
        }
        if self.uid == Some(0) {
            return Access::Full;
        }
        if let Some(g) = read_gid
            && self.groups.contains(&g)
        {
            return Access::ReadOnly;
        }
        Access::Refused("the control API is root-only")
    }
}

/// `/proc/net/tcp` address field `0100007F:1F90` (v4) or 32 hex digits + port (v6).
fn parse_proc_addr(s: &str) -> Option<SocketAddr> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match addr.len() {
        8 => {
            let n = u32::from_str_radix(addr, 16).ok()?;
            IpAddr::V4(Ipv4Addr::from(n.to_ne_bytes()))
        }
        32 => {
            let mut o = [0u8; 16];
            for i in 0..4 {
                let w = u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16).ok()?;
                o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(o))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn same(a: SocketAddr, b: SocketAddr) -> bool {
    let canon = |s: SocketAddr| match s.ip() {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(s, |v4| SocketAddr::new(IpAddr::V4(v4), s.port())),
        _ => s,
    };
    canon(a) == canon(b)
}

/// The uid and process of the client socket `remote` → `local` (our listener's side).
fn tcp_owner(local: SocketAddr, remote: SocketAddr) -> Option<(u32, Option<u32>)> {
    let mut found = None;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                continue;
            }
            let (Some(l), Some(r)) = (parse_proc_addr(f[1]), parse_proc_addr(f[2])) else {
                continue;
            };
            // The client's socket: its local end is our remote, its remote end our local.
            if same(l, remote) && same(r, local) {
                let uid = f[7].parse::<u32>().ok()?;
                let inode = f[9].parse::<u64>().ok()?;
                found = Some((uid, inode));
                break;
            }
        }
        if found.is_some() {
            break;
        }
    }
    let (uid, inode) = found?;
    Some((uid, pid_of_socket(inode)))
}

/// The process holding socket `inode` (the first found).
fn pid_of_socket(inode: u64) -> Option<u32> {
    let want = format!("socket:[{inode}]");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| t.as_os_str() == want.as_str()) {
                return Some(pid);
            }
        }
    }
    None
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn proc_net_addresses() {
        assert_eq!(
            parse_proc_addr("0100007F:1F90"),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            parse_proc_addr("00000000000000000000000001000000:0050"),
            Some("[::1]:80".parse().unwrap())
        );
        assert_eq!(parse_proc_addr("zz:1"), None);
    }

    #[test]
    fn access_rules() {
        let root = Peer {
            uid: Some(0),
            pid: Some(1),
            groups: vec![0],
            confined: false,
            remote: false,
        };
        assert_eq!(root.access(None), Access::Full);
        let confined_root = Peer {
            confined: true,
            ..root.clone()
        };
        assert!(matches!(confined_root.access(Some(0)), Access::Refused(_)));
        let member = Peer {
            uid: Some(1000),
            pid: Some(2),
            groups: vec![1000, 4242],
            confined: false,
            remote: false,
        };
        assert_eq!(member.access(Some(4242)), Access::ReadOnly);
        assert!(matches!(member.access(None), Access::Refused(_)));
        assert!(matches!(member.access(Some(7)), Access::Refused(_)));
    }

    /// Our own loopback connection is found in /proc/net/tcp with our uid and pid.
    #[test]
    fn a_loopback_client_is_found_by_its_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, remote) = l.accept().unwrap();
        let peer = Peer::of_tcp(l.local_addr().unwrap(), remote, &[]);
        assert_eq!(peer.uid, Some(nix::unistd::geteuid().as_raw()));
        assert_eq!(peer.pid, Some(std::process::id()));
        assert!(!peer.confined);
        drop(c);
    }
}
