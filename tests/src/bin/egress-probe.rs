//! `egress-probe MODE [ARGS]`: one egress attempt per invocation, for the bypass matrix.
//!
//! Prints one line: `ok` (the attempt went through as far as the sender can tell) or
//! `err <errno> <message>`; exits 0 / 1 accordingly. Whether anything *arrived* is decided by
//! the test's canary, never by this exit code. Every payload carries MARKER so the canary can
//! recognise it among other traffic.
//!
//! Modes (ADDR is an IP literal, PORT a number):
//! - `tcp ADDR PORT MARKER`              connect() (v4 or v6 socket per ADDR), then send MARKER
//! - `tcp-mapped V4ADDR PORT MARKER`     AF_INET6 socket to ::ffff:V4ADDR (dual stack)
//! - `tcp-scoped V6ADDR IFACE PORT MARKER` link-local with scope id
//! - `udp ADDR PORT MARKER`              unconnected sendto()
//! - `udp-connected ADDR PORT MARKER`    connect() + send()
//! - `udp-mapped V4ADDR PORT MARKER`     AF_INET6 sendto ::ffff:V4ADDR
//! - `tfo ADDR PORT MARKER`              sendto(MSG_FASTOPEN) on a fresh TCP socket
//! - `uring-connect ADDR PORT MARKER`    io_uring IORING_OP_CONNECT, then IORING_OP_SEND
//! - `uring-sendto ADDR PORT MARKER`     io_uring IORING_OP_SENDMSG on an unconnected UDP socket
//! - `icmp-raw V4ADDR MARKER`            SOCK_RAW/IPPROTO_ICMP echo request
//! - `ping V4ADDR MARKER`                SOCK_DGRAM/IPPROTO_ICMP ("ping socket")
//! - `tcp-raw-syn V4ADDR PORT MARKER`    SOCK_RAW/IPPROTO_TCP hand-made SYN carrying MARKER
//! - `hdrincl V4ADDR PORT MARKER`        SOCK_RAW/IPPROTO_RAW (IP_HDRINCL), hand-made IPv4+UDP
//! - `packet IFACE V4ADDR PORT MARKER`   AF_PACKET frame (broadcast MAC, IPv4+UDP) on IFACE
//! - `packet-loop SECS IFACE DST_MAC SRC_V4 DST_V4 PORT MARKER`: AF_PACKET frames (own MAC as
//!   source, DST_MAC as destination, IPv4+UDP from SRC_V4 — `own` = the address of IFACE —
//!   payload `MARKER-<seq>`) in a tight loop for SECS seconds from the first instruction
//!   (~5000 frames/s; socket/send errors are retried). Prints `sent N errors E first-error ...`.
//! - `http-connect PROXY_ADDR PROXY_PORT TARGET MARKER`: CONNECT TARGET through a proxy, then
//!   send MARKER
//! - `serve PORT MARKER`: TCP server on [::]:PORT (dual stack): prints `listening`, answers one
//!   client with MARKER, exits
//! - `tls-get SERVER_NAME ADDR PORT CA_PEM`: GET / over TLS with SERVER_NAME in the ClientHello
//!   (an IP literal: no SNI), no proxy variables; prints `TLS-OK BODY`
//! - `cgroup`: prints /proc/self/cgroup's v2 line and the id of the cgroup at the root of its
//!   cgroup2 mount, then `ok`
//! - `batch`: many TCP/UDP operations read from stdin, one outcome line each
//!   (`egress_tests::batch`, for the kernel differential test)
//! - `sleep-then SECS MODE ARGS...`      sleep, then run MODE (for lifecycle tests)
//! - `escape TECHNIQUE ARGS... [-- MODE ARGS...]`: try to leave confinement (`egress_tests::escape`),
//!   print `escape TECHNIQUE: ok ...|err ...`, then run MODE

use std::ffi::CString;
use std::io::{self, Read, Write};
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use egress_tests::batch::sockaddr;
use egress_tests::packet::{
    checksum, ethernet_ipv4_udp, ipv4_udp, packet_socket, parse_mac, send_frame,
};
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = run(&args);
    match result {
        Ok(()) => {
            println!("ok");
            std::process::exit(0);
        }
        Err(e) => {
            println!("err {} {}", e.raw_os_error().unwrap_or(0), e);
            std::process::exit(1);
        }
    }
}

fn arg(args: &[String], i: usize) -> io::Result<&str> {
    args.get(i)
        .map(String::as_str)
        .ok_or_else(|| io::Error::other(format!("missing argument {i}")))
}

fn ip(s: &str) -> io::Result<IpAddr> {
    s.parse()
        .map_err(|_| io::Error::other(format!("bad address {s}")))
}

fn port(s: &str) -> io::Result<u16> {
    s.parse()
        .map_err(|_| io::Error::other(format!("bad port {s}")))
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn cvt_l(rc: isize) -> io::Result<isize> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn socket(domain: i32, ty: i32, proto: i32) -> io::Result<OwnedFd> {
    let fd = cvt(unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) })?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn connect_fd(fd: RawFd, addr: SocketAddr, scope: u32) -> io::Result<()> {
    let (ss, len) = sockaddr(addr, scope);
    cvt(unsafe { libc::connect(fd, (&raw const ss).cast(), len) }).map(drop)
}

fn sendto_fd(fd: RawFd, buf: &[u8], flags: i32, addr: SocketAddr) -> io::Result<()> {
    let (ss, len) = sockaddr(addr, 0);
    cvt_l(unsafe {
        libc::sendto(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            flags,
            (&raw const ss).cast(),
            len,
        )
    })
    .map(drop)
}

fn family(a: &IpAddr) -> i32 {
    if a.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    }
}

fn mapped(v4: &str) -> io::Result<IpAddr> {
    match ip(v4)? {
        IpAddr::V4(a) => Ok(IpAddr::V6(a.to_ipv6_mapped())),
        IpAddr::V6(_) => Err(io::Error::other("expected an IPv4 address")),
    }
}

fn tcp_send(fd: OwnedFd, marker: &str) -> io::Result<()> {
    let mut s = TcpStream::from(fd);
    s.write_all(marker.as_bytes())?;
    s.flush()?;
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}

fn iface_index(name: &str) -> io::Result<u32> {
    let c = CString::new(name).map_err(io::Error::other)?;
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(idx)
    }
}

/// A TCP SYN segment (no IP header) carrying `payload`, checksummed for src/dst.
fn tcp_syn(src: Ipv4Addr, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut t = vec![0u8; 20 + payload.len()];
    t[0..2].copy_from_slice(&40001u16.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = 0x02; // SYN
    t[14..16].copy_from_slice(&65535u16.to_be_bytes());
    t[20..].copy_from_slice(payload);
    let mut pseudo = Vec::with_capacity(12 + t.len());
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.push(0);
    pseudo.push(libc::IPPROTO_TCP as u8);
    pseudo.extend_from_slice(&(t.len() as u16).to_be_bytes());
    pseudo.extend_from_slice(&t);
    let c = checksum(&pseudo);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

/// The local source address the kernel would use towards `dst`.
fn source_for(dst: Ipv4Addr) -> Ipv4Addr {
    // A UDP connect only does a route lookup; it may itself be refused when confined, in
    // which case any source will do for a packet that must not arrive anyway.
    UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| {
            s.connect((dst, 9))?;
            s.local_addr()
        })
        .ok()
        .and_then(|a| match a.ip() {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
        .unwrap_or(Ipv4Addr::UNSPECIFIED)
}

fn run(args: &[String]) -> io::Result<()> {
    let mode = arg(args, 0)?;
    match mode {
        "tcp" => {
            let a = ip(arg(args, 1)?)?;
            let fd = socket(family(&a), libc::SOCK_STREAM, 0)?;
            connect_fd(fd.as_raw_fd(), SocketAddr::new(a, port(arg(args, 2)?)?), 0)?;
            tcp_send(fd, arg(args, 3)?)
        }
        "tcp-mapped" => {
            let a = mapped(arg(args, 1)?)?;
            let fd = socket(libc::AF_INET6, libc::SOCK_STREAM, 0)?;
            connect_fd(fd.as_raw_fd(), SocketAddr::new(a, port(arg(args, 2)?)?), 0)?;
            tcp_send(fd, arg(args, 3)?)
        }
        "tcp-scoped" => {
            let a = ip(arg(args, 1)?)?;
            let scope = iface_index(arg(args, 2)?)?;
            let fd = socket(libc::AF_INET6, libc::SOCK_STREAM, 0)?;
            connect_fd(
                fd.as_raw_fd(),
                SocketAddr::new(a, port(arg(args, 3)?)?),
                scope,
            )?;
            tcp_send(fd, arg(args, 4)?)
        }
        "udp" => {
            let a = ip(arg(args, 1)?)?;
            let fd = socket(family(&a), libc::SOCK_DGRAM, 0)?;
            sendto_fd(
                fd.as_raw_fd(),
                arg(args, 3)?.as_bytes(),
                0,
                SocketAddr::new(a, port(arg(args, 2)?)?),
            )
        }
        "udp-connected" => {
            let a = ip(arg(args, 1)?)?;
            let fd = socket(family(&a), libc::SOCK_DGRAM, 0)?;
            connect_fd(fd.as_raw_fd(), SocketAddr::new(a, port(arg(args, 2)?)?), 0)?;
            let m = arg(args, 3)?;
            cvt_l(unsafe { libc::send(fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) }).map(drop)
        }
        "udp-mapped" => {
            let a = mapped(arg(args, 1)?)?;
            let fd = socket(libc::AF_INET6, libc::SOCK_DGRAM, 0)?;
            sendto_fd(
                fd.as_raw_fd(),
                arg(args, 3)?.as_bytes(),
                0,
                SocketAddr::new(a, port(arg(args, 2)?)?),
            )
        }
        "tfo" => {
            let a = ip(arg(args, 1)?)?;
            let fd = socket(family(&a), libc::SOCK_STREAM, 0)?;
            sendto_fd(
                fd.as_raw_fd(),
                arg(args, 3)?.as_bytes(),
                libc::MSG_FASTOPEN,
                SocketAddr::new(a, port(arg(args, 2)?)?),
            )?;
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        }
        "uring-connect" => uring_connect(ip(arg(args, 1)?)?, port(arg(args, 2)?)?, arg(args, 3)?),
        "uring-sendto" => uring_sendto(ip(arg(args, 1)?)?, port(arg(args, 2)?)?, arg(args, 3)?),
        "icmp-raw" | "ping" => {
            let a = ip(arg(args, 1)?)?;
            let marker = arg(args, 2)?;
            let ty = if mode == "ping" {
                libc::SOCK_DGRAM
            } else {
                libc::SOCK_RAW
            };
            let fd = socket(libc::AF_INET, ty, libc::IPPROTO_ICMP)?;
            let mut msg = vec![8u8, 0, 0, 0, 0x12, 0x34, 0, 1];
            msg.extend_from_slice(marker.as_bytes());
            let c = checksum(&msg);
            msg[2..4].copy_from_slice(&c.to_be_bytes());
            sendto_fd(fd.as_raw_fd(), &msg, 0, SocketAddr::new(a, 0))
        }
        "tcp-raw-syn" => {
            let IpAddr::V4(dst) = ip(arg(args, 1)?)? else {
                return Err(io::Error::other("v4 only"));
            };
            let p = port(arg(args, 2)?)?;
            let fd = socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP)?;
            let seg = tcp_syn(source_for(dst), dst, p, arg(args, 3)?.as_bytes());
            sendto_fd(fd.as_raw_fd(), &seg, 0, SocketAddr::new(IpAddr::V4(dst), 0))
        }
        "hdrincl" => {
            let IpAddr::V4(dst) = ip(arg(args, 1)?)? else {
                return Err(io::Error::other("v4 only"));
            };
            let p = port(arg(args, 2)?)?;
            let fd = socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW)?;
            let one: libc::c_int = 1;
            cvt(unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::IPPROTO_IP,
                    libc::IP_HDRINCL,
                    (&raw const one).cast(),
                    size_of::<libc::c_int>() as u32,
                )
            })?;
            let pkt = ipv4_udp(source_for(dst), dst, p, arg(args, 3)?.as_bytes());
            sendto_fd(fd.as_raw_fd(), &pkt, 0, SocketAddr::new(IpAddr::V4(dst), 0))
        }
        "packet" => {
            let ifindex = iface_index(arg(args, 1)?)?;
            let IpAddr::V4(dst) = ip(arg(args, 2)?)? else {
                return Err(io::Error::other("v4 only"));
            };
            let p = port(arg(args, 3)?)?;
            let fd = packet_socket()?;
            let frame = ethernet_ipv4_udp(
                [0xff; 6],
                [0x02, 0, 0, 0, 0, 1],
                Ipv4Addr::new(198, 18, 255, 254),
                dst,
                p,
                arg(args, 4)?.as_bytes(),
            );
            send_frame(fd.as_fd(), ifindex, [0xff; 6], &frame).map(drop)
        }
        "packet-loop" => packet_loop(args),
        "batch" => egress_tests::batch::run(),
        "http-connect" => {
            let proxy = SocketAddr::new(ip(arg(args, 1)?)?, port(arg(args, 2)?)?);
            let target = arg(args, 3)?;
            let marker = arg(args, 4)?;
            let mut s = TcpStream::connect_timeout(&proxy, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n")?;
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
                if s.read(&mut byte)? == 0 {
                    break;
                }
                head.push(byte[0]);
            }
            let status = String::from_utf8_lossy(&head);
            let code = status.split_whitespace().nth(1).unwrap_or("");
            if code != "200" {
                return Err(io::Error::other(format!(
                    "proxy answered {:?}",
                    status.lines().next()
                )));
            }
            s.write_all(marker.as_bytes())?;
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        }
        "serve" => {
            let p = port(arg(args, 1)?)?;
            let marker = arg(args, 2)?.to_owned();
            let l = TcpListener::bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), p))
                .or_else(|_| {
                    TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), p))
                })?;
            println!("listening");
            io::stdout().flush()?;
            let (mut c, _) = l.accept()?;
            c.write_all(marker.as_bytes())?;
            c.flush()?;
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        }
        "tls-get" => {
            // tls-get SERVER_NAME ADDR PORT CA_PEM: a TLS client that ignores every proxy
            // variable. ADDR is a name (resolved with the system resolver) or an address;
            // SERVER_NAME is what the ClientHello carries — an IP literal sends no SNI.
            let server_name = arg(args, 1)?;
            let target = arg(args, 2)?;
            let p = port(arg(args, 3)?)?;
            let body = tls_get(server_name, target, p, arg(args, 4)?)?;
            println!("TLS-OK {body}");
            Ok(())
        }
        "cgroup" => {
            let text = std::fs::read_to_string("/proc/self/cgroup")?;
            for l in text.lines().filter(|l| l.starts_with("0::")) {
                println!("{l}");
            }
            // The id of the cgroup at the root of this process's cgroup2 view: under `exec` (a
            // cgroup namespace with a cgroup2 mount of its own) that is the command's cgroup.
            let mount = egress_tests::agent::cgroup2_mount();
            let id = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&mount)?);
            println!("cgroup-root-id {id}");
            Ok(())
        }
        "sleep-then" => {
            let secs: f64 = arg(args, 1)?.parse().map_err(io::Error::other)?;
            std::thread::sleep(Duration::from_secs_f64(secs));
            run(&args[2..])
        }
        "escape" => {
            let tech = arg(args, 1)?;
            let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
            match egress_tests::escape::attempt(tech, &args[2..split]) {
                Ok(what) => println!("escape {tech}: ok {what}"),
                Err(e) => println!("escape {tech}: err {} {e}", e.raw_os_error().unwrap_or(0)),
            }
            match args.get(split + 1..) {
                Some(rest) if !rest.is_empty() => run(rest),
                _ => Ok(()),
            }
        }
        other => Err(io::Error::other(format!("unknown mode {other}"))),
    }
}

fn uring_connect(a: IpAddr, p: u16, marker: &str) -> io::Result<()> {
    use io_uring::{IoUring, opcode, types};
    let fd = socket(family(&a), libc::SOCK_STREAM, 0)?;
    let (ss, len) = sockaddr(SocketAddr::new(a, p), 0);
    let mut ring = IoUring::new(8)?;
    let connect = opcode::Connect::new(types::Fd(fd.as_raw_fd()), (&raw const ss).cast(), len)
        .build()
        .user_data(1);
    unsafe { ring.submission().push(&connect).map_err(io::Error::other)? };
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("no completion"))?;
    if cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    let send = opcode::Send::new(
        types::Fd(fd.as_raw_fd()),
        marker.as_ptr(),
        marker.len() as u32,
    )
    .build()
    .user_data(2);
    unsafe { ring.submission().push(&send).map_err(io::Error::other)? };
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("no completion"))?;
    if cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}

fn uring_sendto(a: IpAddr, p: u16, marker: &str) -> io::Result<()> {
    use io_uring::{IoUring, opcode, types};
    let fd = socket(family(&a), libc::SOCK_DGRAM, 0)?;
    let (mut ss, len) = sockaddr(SocketAddr::new(a, p), 0);
    let mut iov = libc::iovec {
        iov_base: marker.as_ptr() as *mut _,
        iov_len: marker.len(),
    };
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_name = (&raw mut ss).cast();
    msg.msg_namelen = len;
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    let mut ring = IoUring::new(8)?;
    let op = opcode::SendMsg::new(types::Fd(fd.as_raw_fd()), &raw const msg)
        .build()
        .user_data(1);
    unsafe { ring.submission().push(&op).map_err(io::Error::other)? };
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("no completion"))?;
    if cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    Ok(())
}

/// The IPv4 address of `iface` (SIOCGIFADDR).
fn iface_v4(iface: &str) -> io::Result<Ipv4Addr> {
    let fd = socket(libc::AF_INET, libc::SOCK_DGRAM, 0)?;
    let mut req: libc::ifreq = unsafe { zeroed() };
    for (d, b) in req.ifr_name.iter_mut().zip(iface.bytes().take(15)) {
        *d = b as libc::c_char;
    }
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFADDR, &raw mut req) })?;
    let sin = unsafe { &*(&raw const req.ifr_ifru).cast::<libc::sockaddr_in>() };
    Ok(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
}

fn packet_loop(args: &[String]) -> io::Result<()> {
    let secs: f64 = arg(args, 1)?.parse().map_err(io::Error::other)?;
    let iface = arg(args, 2)?;
    let dst_mac = parse_mac(arg(args, 3)?)?;
    let src_arg = arg(args, 4)?;
    let IpAddr::V4(dst) = ip(arg(args, 5)?)? else {
        return Err(io::Error::other("v4 only"));
    };
    let p = port(arg(args, 6)?)?;
    let marker = arg(args, 7)?;
    let deadline = std::time::Instant::now() + Duration::from_secs_f64(secs);
    let (mut sent, mut errors, mut first_err) = (0u64, 0u64, None::<String>);
    let mut fd: Option<OwnedFd> = None;
    let mut seq = 0u64;
    while std::time::Instant::now() < deadline {
        let attempt = (|| -> io::Result<()> {
            let ifindex = iface_index(iface)?;
            let src_mac = parse_mac(&std::fs::read_to_string(format!(
                "/sys/class/net/{iface}/address"
            ))?)?;
            let src = if src_arg == "own" {
                iface_v4(iface)?
            } else {
                match ip(src_arg)? {
                    IpAddr::V4(a) => a,
                    IpAddr::V6(_) => return Err(io::Error::other("v4 only")),
                }
            };
            if fd.is_none() {
                fd = Some(packet_socket()?);
            }
            let Some(f) = fd.as_ref() else {
                return Err(io::Error::other("no socket"));
            };
            let payload = format!("{marker}-{seq}");
            let frame = ethernet_ipv4_udp(dst_mac, src_mac, src, dst, p, payload.as_bytes());
            send_frame(f.as_fd(), ifindex, dst_mac, &frame).map(drop)
        })();
        match attempt {
            Ok(()) => sent += 1,
            Err(e) => {
                errors += 1;
                if first_err.is_none() {
                    first_err = Some(format!("seq {seq}: {e}"));
                }
            }
        }
        seq += 1;
        std::thread::sleep(Duration::from_micros(200));
    }
    println!(
        "sent {sent} errors {errors} first-error {}",
        first_err.as_deref().unwrap_or("none")
    );
    Ok(())
}

/// `GET /` over TLS to `target:port` with `server_name` in the ClientHello, trusting only the CA
/// in `ca_file`; the response's body (the head dropped).
fn tls_get(server_name: &str, target: &str, port: u16, ca_file: &str) -> io::Result<String> {
    use std::net::ToSocketAddrs;
    use std::sync::Arc;
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read_to_string(ca_file)?;
    for p in pem::parse_many(pem).map_err(io::Error::other)? {
        if p.tag() == "CERTIFICATE" {
            roots
                .add(rustls::pki_types::CertificateDer::from(p.into_contents()))
                .map_err(io::Error::other)?;
        }
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(io::Error::other)?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
        .map_err(io::Error::other)?;
    let mut conn = rustls::ClientConnection::new(Arc::new(cfg), name).map_err(io::Error::other)?;
    let addr = (target, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::other(format!("{target}: no address")))?;
    let mut sock = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    write!(
        tls,
        "GET / HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = Vec::new();
    match tls.read_to_end(&mut out) {
        Ok(_) => {}
        // Servers that close without close_notify: what arrived is the answer.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && !out.is_empty() => {}
        Err(e) => return Err(e),
    }
    let text = String::from_utf8_lossy(&out);
    Ok(text
        .split_once("\r\n\r\n")
        .map_or(text.as_ref(), |(_, b)| b)
        .trim()
        .to_owned())
}
