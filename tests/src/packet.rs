//! Hand-made Ethernet/IPv4/UDP frames sent through AF_PACKET: what the cgroup hooks can't see.
//! Shared by the probe, the in-container sender and the nftables tests.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The Internet checksum (RFC 1071) of `data`.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            u16::from_be_bytes([chunk[0], 0])
        };
        sum += u32::from(word);
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// IPv4 header + UDP datagram (source port 40000, no UDP checksum) carrying `payload`.
pub fn ipv4_udp(src: Ipv4Addr, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let total = 20 + udp_len;
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = libc::IPPROTO_UDP as u8;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&p[..20]);
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&dport.to_be_bytes());
    p[24..26].copy_from_slice(&(udp_len as u16).to_be_bytes());
    p[28..].copy_from_slice(payload);
    p
}

/// An Ethernet frame `src_mac` → `dst_mac` around [`ipv4_udp`].
pub fn ethernet_ipv4_udp(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut frame = dst_mac.to_vec();
    frame.extend_from_slice(&src_mac);
    frame.extend_from_slice(&(libc::ETH_P_IP as u16).to_be_bytes());
    frame.extend_from_slice(&ipv4_udp(src, dst, dport, payload));
    frame
}

/// `aa:bb:cc:dd:ee:ff` (surrounding whitespace allowed, as read from sysfs).
pub fn parse_mac(s: &str) -> io::Result<[u8; 6]> {
    let bad = || io::Error::other(format!("bad MAC address {s:?}"));
    let mut m = [0u8; 6];
    let mut it = s.trim().split(':');
    for b in &mut m {
        *b = u8::from_str_radix(it.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
    }
    if it.next().is_some() {
        return Err(bad());
    }
    Ok(m)
}

/// An AF_PACKET raw socket for every protocol (what an attacker with CAP_NET_RAW opens).
pub fn packet_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Send `frame` out of interface `ifindex` to `dst_mac`; the bytes sent.
pub fn send_frame(
    fd: BorrowedFd<'_>,
    ifindex: u32,
    dst_mac: [u8; 6],
    frame: &[u8],
) -> io::Result<usize> {
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&dst_mac);
    // SAFETY: a live buffer and a sockaddr_ll with its size.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&raw const sll).cast(),
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
