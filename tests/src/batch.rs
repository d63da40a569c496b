//! `egress-probe batch`: many socket operations in one confined process, for the kernel
//! differential test (`tests/tests/kernel_differential.rs`).
//!
//! Protocol, over the probe's stdin/stdout (both pass through `egress-agent exec`):
//! 1. the probe binds its own servers on the host's loopback — the "same confined tree" servers
//!    the kernel lets the tree reach — and prints one [`SelfServers`] line (`self ...`);
//! 2. the test writes one [`Case`] line per operation (`case ID OP ADDR MARKER`), then closes
//!    stdin;
//! 3. the probe runs each case in order and prints `res ID OUTCOME` ([`Outcome`]);
//! 4. after the last case it prints `selfrx PAYLOAD` for everything its own servers received,
//!    then `done`.
//!
//! Whether anything reached a destination outside the probe is decided by the test's canaries.
use std::io::{self, BufRead, Read, Write};
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a TCP connect may take before the case is reported as `err 110` (ETIMEDOUT).
const CONNECT_TIMEOUT_MS: i32 = 2000;
/// How long a UDP case to port 53 waits for a DNS answer.
const DNS_REPLY_WAIT: Duration = Duration::from_millis(400);

/// The socket operation of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `connect()`, then send the marker.
    Tcp,
    /// Unconnected `sendto()` of the marker (a DNS query naming it, to port 53).
    Udp,
    /// `connect()` + `send()` on a UDP socket.
    UdpConnected,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Tcp => "tcp",
            Op::Udp => "udp",
            Op::UdpConnected => "udp-connected",
        }
    }

    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "tcp" => Op::Tcp,
            "udp" => Op::Udp,
            "udp-connected" => Op::UdpConnected,
            _ => return None,
        })
    }

    pub fn is_tcp(self) -> bool {
        self == Op::Tcp
    }
}

/// One operation. `dst` is used as given: a v4-mapped IPv6 address goes out of an AF_INET6
/// socket, a plain IPv4 one out of an AF_INET socket.
#[derive(Debug, Clone)]
pub struct Case {
    pub id: usize,
    pub op: Op,
    pub dst: SocketAddr,
    /// Unique, DNS-label safe (at most 63 characters, letters, digits and `-`).
    pub marker: String,
}

impl Case {
    pub fn line(&self) -> String {
        format!(
            "case {} {} {} {}",
            self.id,
            self.op.as_str(),
            self.dst,
            self.marker
        )
    }

    fn parse(line: &str) -> Option<Case> {
        let mut it = line.split_whitespace();
        if it.next()? != "case" {
            return None;
        }
        Some(Case {
            id: it.next()?.parse().ok()?,
            op: Op::parse(it.next()?)?,
            dst: it.next()?.parse().ok()?,
            marker: it.next()?.to_owned(),
        })
    }
}

/// What the sender saw of one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The connect (or sendto) failed with this errno (1 = EPERM: the kernel refused).
    Failed(i32),
    /// Connected; the kernel's peer address of the socket (the rewritten one if redirected),
    /// and the errno of the send after it, if that failed.
    Connected {
        peer: SocketAddr,
        send_errno: Option<i32>,
        reply_from: Option<SocketAddr>,
    },
    /// An unconnected datagram went out; the source of a DNS answer, if one came back.
    Sent { reply_from: Option<SocketAddr> },
}

impl Outcome {
    fn line(&self) -> String {
        let opt = |a: &Option<SocketAddr>| a.map_or("-".to_owned(), |a| a.to_string());
        match self {
            Outcome::Failed(e) => format!("failed {e}"),
            Outcome::Connected {
                peer,
                send_errno,
                reply_from,
            } => format!(
                "connected {peer} {} {}",
                send_errno.map_or("-".to_owned(), |e| e.to_string()),
                opt(reply_from)
            ),
            Outcome::Sent { reply_from } => format!("sent {}", opt(reply_from)),
        }
    }

    /// Parse the part of a `res` line after the id.
    pub fn parse(s: &str) -> Option<Outcome> {
        let w: Vec<&str> = s.split_whitespace().collect();
        let opt = |t: &str| (t != "-").then(|| t.parse().ok()).flatten();
        Some(match *w.first()? {
            "failed" => Outcome::Failed(w.get(1)?.parse().ok()?),
            "connected" => Outcome::Connected {
                peer: w.get(1)?.parse().ok()?,
                send_errno: (w.get(2)? != &"-").then(|| w[2].parse().ok()).flatten(),
                reply_from: opt(w.get(3)?),
            },
            "sent" => Outcome::Sent {
                reply_from: opt(w.get(1)?),
            },
            _ => return None,
        })
    }
}

/// The probe's own servers on the host's loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelfServers {
    pub tcp4: SocketAddr,
    pub tcp6: SocketAddr,
    pub udp4: SocketAddr,
    pub udp6: SocketAddr,
}

impl SelfServers {
    pub fn line(&self) -> String {
        format!(
            "self {} {} {} {}",
            self.tcp4, self.tcp6, self.udp4, self.udp6
        )
    }

    pub fn parse(line: &str) -> Option<SelfServers> {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() != 5 || w[0] != "self" {
            return None;
        }
        Some(SelfServers {
            tcp4: w[1].parse().ok()?,
            tcp6: w[2].parse().ok()?,
            udp4: w[3].parse().ok()?,
            udp6: w[4].parse().ok()?,
        })
    }
}

/// A DNS query (type A, recursion desired) for `<marker>.diff.invalid`.
pub fn dns_query(marker: &str) -> Vec<u8> {
    let mut q = vec![0x51, 0x7e, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in [marker, "diff", "invalid"] {
        let l = &label.as_bytes()[..label.len().min(63)];
        q.push(l.len() as u8);
        q.extend_from_slice(l);
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

fn socket(v6: bool, ty: i32) -> io::Result<OwnedFd> {
    let domain = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: plain socket(2).
    let fd = cvt(unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A sockaddr for `addr` (v4, or v6 with `scope` as its scope id); the probe's too.
pub fn sockaddr(addr: SocketAddr, scope: u32) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in.
            let sin = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            (ss, size_of::<libc::sockaddr_in>() as u32)
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = scope;
            (ss, size_of::<libc::sockaddr_in6>() as u32)
        }
    }
}

fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin =
                unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::new(
                IpAddr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 =
                unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::new(
                IpAddr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
            ))
        }
        _ => None,
    }
}

fn peer(fd: RawFd) -> io::Result<SocketAddr> {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: buffer and its length.
    cvt(unsafe { libc::getpeername(fd, (&raw mut ss).cast(), &raw mut len) })?;
    from_sockaddr(&ss).ok_or_else(|| io::Error::other("unknown peer family"))
}

/// `connect()` with a timeout (non-blocking connect + poll), back to blocking afterwards.
fn connect_timeout(fd: RawFd, addr: SocketAddr) -> io::Result<()> {
    let (ss, len) = sockaddr(addr, 0);
    // SAFETY: fcntl on an owned descriptor.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    // SAFETY: a valid sockaddr of `len` bytes.
    let rc = unsafe { libc::connect(fd, (&raw const ss).cast(), len) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one pollfd.
        let n = cvt(unsafe { libc::poll(&raw mut pfd, 1, CONNECT_TIMEOUT_MS) })?;
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::ETIMEDOUT));
        }
        let mut err: libc::c_int = 0;
        let mut elen = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: an int and its length.
        cvt(unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&raw mut err).cast(),
                &raw mut elen,
            )
        })?;
        if err != 0 {
            return Err(io::Error::from_raw_os_error(err));
        }
    }
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags) })?;
    Ok(())
}

fn send(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    // SAFETY: buffer and its length.
    let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn sendto(fd: RawFd, buf: &[u8], addr: SocketAddr) -> io::Result<()> {
    let (ss, len) = sockaddr(addr, 0);
    // SAFETY: buffer, sockaddr and their lengths.
    let n = unsafe {
        libc::sendto(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            0,
            (&raw const ss).cast(),
            len,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Wait for one datagram (a DNS answer); its source as `recvfrom` reports it.
fn reply(fd: RawFd) -> Option<SocketAddr> {
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: DNS_REPLY_WAIT.as_micros() as libc::suseconds_t,
    };
    // SAFETY: a timeval and its size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as u32,
        )
    };
    let mut buf = [0u8; 1500];
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: buffers and their lengths.
    let n = unsafe {
        libc::recvfrom(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            0,
            (&raw mut ss).cast(),
            &raw mut len,
        )
    };
    (n > 0).then(|| from_sockaddr(&ss)).flatten()
}

/// Run one case.
pub fn run_case(case: &Case) -> Outcome {
    let v6 = case.dst.is_ipv6();
    let dns = case.dst.port() == 53;
    let payload = if dns && case.op != Op::Tcp {
        dns_query(&case.marker)
    } else {
        case.marker.clone().into_bytes()
    };
    let ty = if case.op == Op::Tcp {
        libc::SOCK_STREAM
    } else {
        libc::SOCK_DGRAM
    };
    let fd = match socket(v6, ty) {
        Ok(fd) => fd,
        Err(e) => return Outcome::Failed(errno(&e)),
    };
    let raw = fd.as_raw_fd();
    match case.op {
        Op::Udp => match sendto(raw, &payload, case.dst) {
            Err(e) => Outcome::Failed(errno(&e)),
            Ok(()) => Outcome::Sent {
                reply_from: dns.then(|| reply(raw)).flatten(),
            },
        },
        Op::Tcp | Op::UdpConnected => {
            if let Err(e) = connect_timeout(raw, case.dst) {
                return Outcome::Failed(errno(&e));
            }
            let peer = match peer(raw) {
                Ok(p) => p,
                Err(e) => return Outcome::Failed(errno(&e)),
            };
            let send_errno = send(raw, &payload).err().map(|e| errno(&e));
            let reply_from = (dns && case.op == Op::UdpConnected && send_errno.is_none())
                .then(|| reply(raw))
                .flatten();
            Outcome::Connected {
                peer,
                send_errno,
                reply_from,
            }
        }
    }
}

/// Servers on the host's loopback that record what they receive.
fn serve_self(rx: &Arc<Mutex<Vec<String>>>) -> io::Result<SelfServers> {
    let tcp4 = TcpListener::bind("127.0.0.1:0")?;
    let tcp6 = TcpListener::bind("[::1]:0")?;
    let udp4 = UdpSocket::bind("127.0.0.1:0")?;
    let udp6 = UdpSocket::bind("[::1]:0")?;
    let servers = SelfServers {
        tcp4: tcp4.local_addr()?,
        tcp6: tcp6.local_addr()?,
        udp4: udp4.local_addr()?,
        udp6: udp6.local_addr()?,
    };
    for l in [tcp4, tcp6] {
        let rx = rx.clone();
        std::thread::spawn(move || {
            for mut s in l.incoming().flatten() {
                let rx = rx.clone();
                std::thread::spawn(move || {
                    s.set_read_timeout(Some(Duration::from_secs(2))).ok();
                    let mut buf = Vec::new();
                    s.read_to_end(&mut buf).ok();
                    rx.lock()
                        .expect("lock")
                        .push(String::from_utf8_lossy(&buf).into_owned());
                });
            }
        });
    }
    for u in [udp4, udp6] {
        let rx = rx.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while let Ok(n) = u.recv(&mut buf) {
                rx.lock()
                    .expect("lock")
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        });
    }
    Ok(servers)
}

/// `egress-probe batch`: the protocol above.
pub fn run() -> io::Result<()> {
    let rx = Arc::new(Mutex::new(Vec::new()));
    let servers = serve_self(&rx)?;
    let mut out = io::stdout().lock();
    writeln!(out, "{}", servers.line())?;
    out.flush()?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        let Some(case) = Case::parse(&line) else {
            continue;
        };
        writeln!(out, "res {} {}", case.id, run_case(&case).line())?;
    }
    // Let the last TCP payloads reach the own servers.
    std::thread::sleep(Duration::from_millis(300));
    for payload in rx.lock().expect("lock").iter() {
        // Payloads are markers (or DNS queries naming one): print them on one line each.
        let clean: String = payload
            .chars()
            .map(|c| if c.is_ascii_graphic() { c } else { ' ' })
            .collect();
        writeln!(out, "selfrx {clean}")?;
    }
    writeln!(out, "done")?;
    out.flush()
}
