//! Send hand-made Ethernet/IPv4/UDP frames through an AF_PACKET socket — what the cgroup hooks
//! can't see. Runs inside test containers (the Docker tests copy it into their image).
//!
//! `egress-test-rawsend IFNAME DST_MAC SRC_IP DST_IP DST_PORT PAYLOAD`
//! Prints `SENT n` or `SOCKET-DENIED <error>` / `SEND-FAILED <error>`; exits 0 either way.
use std::net::Ipv4Addr;

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut it = s.trim().split(':');
    for b in &mut m {
        *b = u8::from_str_radix(it.next()?, 16).ok()?;
    }
    Some(m)
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from(c[0]) << 8
        };
        sum += u32::from(w);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 7 {
        eprintln!("usage: egress-test-rawsend IFNAME DST_MAC SRC_IP DST_IP DST_PORT PAYLOAD");
        std::process::exit(2);
    }
    let ifname = &a[1];
    let dst_mac = parse_mac(&a[2]).expect("dst mac");
    let src_mac = parse_mac(
        &std::fs::read_to_string(format!("/sys/class/net/{ifname}/address")).expect("own mac"),
    )
    .expect("own mac");
    let src: Ipv4Addr = a[3].parse().expect("src ip");
    let dst: Ipv4Addr = a[4].parse().expect("dst ip");
    let port: u16 = a[5].parse().expect("port");
    let payload = a[6].as_bytes();

    let mut frame = Vec::new();
    frame.extend_from_slice(&dst_mac);
    frame.extend_from_slice(&src_mac);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    let udp_len = 8 + payload.len() as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&40000u16.to_be_bytes());
    frame.extend_from_slice(&port.to_be_bytes());
    frame.extend_from_slice(&udp_len.to_be_bytes());
    frame.extend_from_slice(&[0, 0]);
    frame.extend_from_slice(payload);

    let idx = nix::net::if_::if_nametoindex(ifname.as_str()).expect("ifindex");
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        )
    };
    if fd < 0 {
        println!("SOCKET-DENIED {}", std::io::Error::last_os_error());
        return;
    }
    let mut sent = 0;
    for _ in 0..3 {
        // SAFETY: zeroed sockaddr_ll is valid; sendto with a live buffer and the struct's size.
        let n = unsafe {
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_ifindex = idx as i32;
            sll.sll_halen = 6;
            sll.sll_addr[..6].copy_from_slice(&dst_mac);
            libc::sendto(
                fd,
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            println!("SEND-FAILED {}", std::io::Error::last_os_error());
            return;
        }
        sent += 1;
    }
    println!("SENT {sent}");
}
