//! Scratch probe of kernel behaviour (root). Not committed.
#![expect(clippy::unwrap_used, reason = "probe")]
use super::sys;
use crate::bpf::relay::RelayProgram;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::Duration;

fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fn info(s: &TcpStream, name: &str) {
    let i = sys::tcp_info(s.as_fd()).unwrap();
    eprintln!(
        "{name}: state {} acked {} recv {} inq {} outq {} lastrecv {}",
        i.state,
        i.bytes_acked,
        i.bytes_received,
        sys::inq(s.as_fd()).unwrap(),
        sys::outq(s.as_fd()).unwrap(),
        i.last_data_recv_ms
    );
}

#[test]
#[ignore = "probe"]
fn probe() {
    let relay = RelayProgram::load(16).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let (mut client, c) = pair(&l);
    let (u, mut server) = pair(&l);
    info(&c, "C fresh");
    info(&u, "U fresh");
    client.write_all(b"HEAD").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mut b = [0u8; 4];
    (&c).read_exact(&mut b).unwrap();
    client.write_all(b"PRE").unwrap();
    server.write_all(b"SRVFIRST").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    info(&c, "C before");
    info(&u, "U before");
    let cc = sys::socket_cookie(c.as_fd()).unwrap();
    let uc = sys::socket_cookie(u.as_fd()).unwrap();
    relay.set_peer(cc, &u).unwrap();
    relay.set_peer(uc, &c).unwrap();
    relay.splice(cc, &c).unwrap();
    relay.splice(uc, &u).unwrap();
    eprintln!("entries {:?}", relay.entries());
    std::thread::sleep(Duration::from_millis(20));
    info(&c, "C after splice, no kick");
    sys::set_rcvlowat(c.as_fd(), 1).unwrap();
    sys::set_rcvlowat(u.as_fd(), 1).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    info(&c, "C after kick");
    server.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut got = [0u8; 3];
    server.read_exact(&mut got).unwrap();
    eprintln!("server got {:?}", std::str::from_utf8(&got));
    let mut got = [0u8; 8];
    client.read_exact(&mut got).unwrap();
    eprintln!("client got {:?}", std::str::from_utf8(&got));
    // epoll with RDHUP only
    let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).unwrap();
    ep.add(&c, EpollEvent::new(EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLET, 1))
        .unwrap();
    ep.add(&u, EpollEvent::new(EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLET, 2))
        .unwrap();
    let mut evs = [EpollEvent::empty(); 8];
    for i in 0..100u32 {
        client.write_all(&vec![1u8; 10_000]).unwrap();
        let mut sink = vec![0u8; 10_000];
        server.read_exact(&mut sink).unwrap();
        let _ = i;
    }
    let n = ep.wait(&mut evs, 50u16).unwrap();
    eprintln!("events during data: {n}");
    info(&c, "C after 1MB");
    info(&u, "U after 1MB");
    client.shutdown(Shutdown::Write).unwrap();
    let n = ep.wait(&mut evs, 500u16).unwrap();
    for e in &evs[..n] {
        eprintln!("event {:?} data {}", e.events(), e.data());
    }
    info(&c, "C after client FIN");
    eprintln!("stats {:?}", relay.stats());
    // backpressure: server stops reading; client writes nonblocking
    let (mut client2, c2) = pair(&l);
    let (u2, server2) = pair(&l);
    let cc = sys::socket_cookie(c2.as_fd()).unwrap();
    let uc = sys::socket_cookie(u2.as_fd()).unwrap();
    relay.set_peer(cc, &u2).unwrap();
    relay.set_peer(uc, &c2).unwrap();
    relay.splice(cc, &c2).unwrap();
    relay.splice(uc, &u2).unwrap();
    client2.set_nonblocking(true).unwrap();
    let buf = vec![2u8; 65536];
    let mut total = 0usize;
    let mem = || {
        let m = std::fs::read_to_string("/proc/meminfo").unwrap();
        let l = m.lines().find(|l| l.starts_with("MemAvailable")).unwrap().to_owned();
        l
    };
    eprintln!("before: {}", mem());
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(3) && total < 1_000_000_000 {
        match client2.write(&buf) {
            Ok(n) => total += n,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    eprintln!("after write: {}", mem());
    std::thread::sleep(Duration::from_millis(500));
    eprintln!("after 500ms: {}", mem());
    let mut server2 = server2;
    server2.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut got = 0usize;
    let mut rb = vec![0u8; 1 << 20];
    loop {
        match server2.read(&mut rb) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
        if got >= total { break; }
    }
    eprintln!("server2 read {got} of {total}");
    eprintln!("client wrote {total} bytes into a non-reading upstream");
    info(&c2, "C2");
    info(&u2, "U2");
    eprintln!(
        "sockstat: {}",
        std::fs::read_to_string("/proc/net/sockstat").unwrap()
    );
}
