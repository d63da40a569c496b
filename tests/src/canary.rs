//! Canaries: listeners and a packet capture that record what actually arrived.
//!
//! A bypass test asserts on *arrival*, not on the sender's syscall result: the canary keeps every
//! TCP accept, every byte received on TCP/UDP, and (with a capture) every frame seen on an
//! interface, and [`Canary::saw`] looks for the attempt's unique marker in all of them.
use std::io::Read;
use std::mem::{size_of, zeroed};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::Netns;

#[derive(Default)]
struct Record {
    /// Payloads received on TCP connections and UDP sockets, and captured frames.
    blobs: Vec<Vec<u8>>,
    /// Accepted TCP connections: (local port, peer).
    accepts: Vec<(u16, SocketAddr)>,
    /// TCP SYNs seen by the capture: destination port.
    syns: Vec<u16>,
}

pub struct Canary {
    rec: Arc<Mutex<Record>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// TCP ports listened on (same index as given).
    pub tcp_ports: Vec<u16>,
    pub udp_ports: Vec<u16>,
}

fn bind_tcp(addr: SocketAddr) -> TcpListener {
    let l = TcpListener::bind(addr).unwrap_or_else(|e| panic!("canary: bind tcp {addr}: {e}"));
    l.set_nonblocking(true).expect("nonblocking");
    l
}

fn bind_udp(addr: SocketAddr) -> UdpSocket {
    let u = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("canary: bind udp {addr}: {e}"));
    u.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    u
}

/// An AF_PACKET socket receiving every frame on `ifname` (in the caller's netns).
fn packet_capture(ifname: &str) -> OwnedFd {
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from(proto),
        )
    };
    assert!(
        fd >= 0,
        "capture socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: fd is a fresh socket we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(ifname).expect("ifname");
    // SAFETY: NUL-terminated name.
    let idx = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert!(idx != 0, "if_nametoindex({ifname})");
    // SAFETY: zeroed sockaddr_ll is valid.
    let mut sll: libc::sockaddr_ll = unsafe { zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = idx as i32;
    // SAFETY: valid sockaddr_ll and its size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sll).cast(),
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert!(rc == 0, "bind capture: {}", std::io::Error::last_os_error());
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 50_000,
    };
    // SAFETY: valid timeval and its size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as u32,
        )
    };
    fd
}

/// Destination port of a TCP SYN in an Ethernet frame (IPv4 or IPv6, no extension headers).
fn syn_port(frame: &[u8]) -> Option<u16> {
    if frame.len() < 14 {
        return None;
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let (l4, proto) = match ethertype {
        0x0800 if frame.len() >= 34 => (14 + usize::from(frame[14] & 0x0f) * 4, frame[23]),
        0x86dd if frame.len() >= 54 => (54, frame[20]),
        _ => return None,
    };
    if proto != 6 || frame.len() < l4 + 14 {
        return None;
    }
    let flags = frame[l4 + 13];
    (flags & 0x02 != 0 && flags & 0x10 == 0)
        .then(|| u16::from_be_bytes([frame[l4 + 2], frame[l4 + 3]]))
}

impl Canary {
    fn start(tcps: Vec<TcpListener>, udps: Vec<UdpSocket>, capture: Option<OwnedFd>) -> Canary {
        let rec = Arc::new(Mutex::new(Record::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let tcp_ports = tcps
            .iter()
            .map(|l| l.local_addr().expect("addr").port())
            .collect();
        let udp_ports = udps
            .iter()
            .map(|u| u.local_addr().expect("addr").port())
            .collect();
        for l in tcps {
            let (rec, stop) = (rec.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
                while !stop.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((mut s, peer)) => {
                            rec.lock().expect("lock").accepts.push((port, peer));
                            let rec = rec.clone();
                            std::thread::spawn(move || {
                                s.set_nonblocking(false).ok();
                                s.set_read_timeout(Some(Duration::from_millis(1500))).ok();
                                let mut buf = Vec::new();
                                let mut chunk = [0u8; 4096];
                                while let Ok(n) = s.read(&mut chunk) {
                                    if n == 0 {
                                        break;
                                    }
                                    buf.extend_from_slice(&chunk[..n]);
                                    rec.lock().expect("lock").blobs.push(buf.clone());
                                }
                            });
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            }));
        }
        for u in udps {
            let (rec, stop) = (rec.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, _)) = u.recv_from(&mut buf) {
                        rec.lock().expect("lock").blobs.push(buf[..n].to_vec());
                    }
                }
            }));
        }
        if let Some(fd) = capture {
            let (rec, stop) = (rec.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: buffer and its length.
                    let n = unsafe {
                        libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                    };
                    if n > 0 {
                        let frame = buf[..n as usize].to_vec();
                        let mut r = rec.lock().expect("lock");
                        if let Some(p) = syn_port(&frame) {
                            r.syns.push(p);
                        }
                        r.blobs.push(frame);
                    }
                }
            }));
        }
        Canary {
            rec,
            stop,
            threads,
            tcp_ports,
            udp_ports,
        }
    }

    /// Listeners inside `ns` on [::]:port (dual stack) for each port, plus a capture on the
    /// namespace side of the veth.
    pub fn in_netns(ns: &Netns, tcp: &[u16], udp: &[u16]) -> Canary {
        let (tcp, udp, ifname) = (tcp.to_vec(), udp.to_vec(), ns.ns_if.clone());
        let (tcps, udps, cap) = ns.run(move || {
            let tcps: Vec<TcpListener> = tcp
                .iter()
                .map(|p| bind_tcp(format!("[::]:{p}").parse().expect("addr")))
                .collect();
            let udps: Vec<UdpSocket> = udp
                .iter()
                .map(|p| bind_udp(format!("[::]:{p}").parse().expect("addr")))
                .collect();
            (tcps, udps, packet_capture(&ifname))
        });
        Canary::start(tcps, udps, Some(cap))
    }

    /// Listeners on the host's loopback: TCP and UDP on 127.0.0.1 and [::1], kernel-chosen
    /// ports (see `tcp_ports` / `udp_ports`: [v4, v6]).
    pub fn loopback() -> Canary {
        let tcps = vec![
            bind_tcp("127.0.0.1:0".parse().expect("a")),
            bind_tcp("[::1]:0".parse().expect("a")),
        ];
        let udps = vec![
            bind_udp("127.0.0.1:0".parse().expect("a")),
            bind_udp("[::1]:0".parse().expect("a")),
        ];
        Canary::start(tcps, udps, None)
    }

    /// Listeners on specific addresses in the caller's namespace.
    pub fn on(tcp: &[SocketAddr], udp: &[SocketAddr]) -> Canary {
        Canary::start(
            tcp.iter().map(|a| bind_tcp(*a)).collect(),
            udp.iter().map(|a| bind_udp(*a)).collect(),
            None,
        )
    }

    /// Did anything carrying `marker` arrive (TCP data, UDP datagram, captured frame)?
    pub fn saw(&self, marker: &str) -> bool {
        let m = marker.as_bytes();
        self.rec
            .lock()
            .expect("lock")
            .blobs
            .iter()
            .any(|b| b.windows(m.len()).any(|w| w == m))
    }

    /// Wait up to `timeout` for `marker` to arrive.
    pub fn wait_for(&self, marker: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.saw(marker) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.saw(marker)
    }

    /// TCP connections accepted so far.
    pub fn accepts(&self) -> usize {
        self.rec.lock().expect("lock").accepts.len()
    }

    /// Peers of the TCP connections accepted so far.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.rec
            .lock()
            .expect("lock")
            .accepts
            .iter()
            .map(|(_, peer)| *peer)
            .collect()
    }

    /// TCP SYNs to `port` seen by the capture so far.
    pub fn syns_to(&self, port: u16) -> usize {
        self.rec
            .lock()
            .expect("lock")
            .syns
            .iter()
            .filter(|p| **p == port)
            .count()
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().ok();
        }
    }
}
