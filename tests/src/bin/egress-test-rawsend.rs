//! Send hand-made Ethernet/IPv4/UDP frames through an AF_PACKET socket — what the cgroup hooks
//! can't see. Runs inside test containers (the Docker tests copy it into their image).
//!
//! `egress-test-rawsend IFNAME DST_MAC SRC_IP DST_IP DST_PORT PAYLOAD`
//! Prints `SENT n` or `SOCKET-DENIED <error>` / `SEND-FAILED <error>`; exits 0 either way.
use std::net::Ipv4Addr;
use std::os::fd::AsFd;

use egress_tests::packet::{ethernet_ipv4_udp, packet_socket, parse_mac, send_frame};

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
    let frame = ethernet_ipv4_udp(dst_mac, src_mac, src, dst, port, a[6].as_bytes());

    let idx = nix::net::if_::if_nametoindex(ifname.as_str()).expect("ifindex");
    let fd = match packet_socket() {
        Ok(fd) => fd,
        Err(e) => {
            println!("SOCKET-DENIED {e}");
            return;
        }
    };
    let mut sent = 0;
    for _ in 0..3 {
        if let Err(e) = send_frame(fd.as_fd(), idx, dst_mac, &frame) {
            println!("SEND-FAILED {e}");
            return;
        }
        sent += 1;
    }
    println!("SENT {sent}");
}
