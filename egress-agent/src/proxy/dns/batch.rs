//! Many datagrams per system call: `recvmmsg(2)` and `sendmmsg(2)` through nix's safe wrappers
//! (no `unsafe` here). Non-blocking (`MSG_DONTWAIT`): the caller runs them inside tokio's
//! readiness (`UdpSocket::try_io`), so `WouldBlock` clears the socket's readiness as usual.
//!
//! Batches are small when clients wait for each answer (one or two datagrams per wake-up), so
//! what a call allocates is paid per query: the slices and addresses live on the stack, the
//! send headers are made once per thread ([`SEND_HEADERS`]). The receive headers are made per
//! call: nix leaves each header's address length as the kernel last wrote it, so a reused
//! header would cut an IPv6 source after an IPv4 one.
use std::cell::RefCell;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::RawFd;

use nix::sys::socket::{
    ControlMessage, MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg, sendmmsg,
};

/// Most datagrams per system call.
pub const BATCH: usize = 32;
/// Receive buffer per datagram: a query larger than this is cut off (and dropped as malformed);
/// hickory-server's UDP buffer is the same size.
pub const DATAGRAM: usize = 4096;

/// One received datagram's place in a [`RecvBatch`].
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub len: usize,
    /// `None`: not an IPv4/IPv6 source.
    pub src: Option<SocketAddr>,
    /// The datagram was larger than [`DATAGRAM`] (`MSG_TRUNC`).
    pub cut: bool,
}

fn socket_addr(s: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    s.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}

/// Buffers for one `recvmmsg` call, reused from call to call.
pub struct RecvBatch {
    bufs: Vec<u8>,
    got: Vec<Received>,
}

impl Default for RecvBatch {
    fn default() -> Self {
        RecvBatch {
            bufs: vec![0; BATCH * DATAGRAM],
            got: Vec::with_capacity(BATCH),
        }
    }
}

impl RecvBatch {
    /// Receive up to [`BATCH`] datagrams waiting on `fd` without blocking; how many.
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        self.got.clear();
        let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(BATCH, None);
        let mut chunks = self.bufs.chunks_mut(DATAGRAM);
        let mut iovs: [[IoSliceMut<'_>; 1]; BATCH] =
            std::array::from_fn(|_| [IoSliceMut::new(chunks.next().unwrap_or_default())]);
        let results = recvmmsg(
            fd,
            &mut headers,
            iovs.iter_mut(),
            MsgFlags::MSG_DONTWAIT,
            None,
        )
        .map_err(io::Error::from)?;
        for m in results {
            self.got.push(Received {
                len: m.bytes.min(DATAGRAM),
                src: m.address.as_ref().and_then(socket_addr),
                cut: m.flags.contains(MsgFlags::MSG_TRUNC),
            });
        }
        Ok(self.got.len())
    }

    /// The datagrams of the last [`RecvBatch::recv`].
    pub fn iter(&self) -> impl Iterator<Item = (Received, &[u8])> + '_ {
        self.got
            .iter()
            .enumerate()
            .map(|(i, r)| (*r, &self.bufs[i * DATAGRAM..i * DATAGRAM + r.len]))
    }
}

thread_local! {
    /// `sendmmsg` headers, made once per thread: each call sets every field the kernel reads
    /// (the slice, the address and its length), and the kernel writes none back but the count.
    /// Per thread, not per responder: they hold raw pointers (not `Send`), and a responder's
    /// loop is a future that moves between threads.
    static SEND_HEADERS: RefCell<Option<MultiHeaders<SockaddrStorage>>> =
        const { RefCell::new(None) };
}

/// Answers waiting to go out in one `sendmmsg` call, in one buffer reused from batch to batch.
#[derive(Default)]
pub struct SendBatch {
    bytes: Vec<u8>,
    out: Vec<(Range<usize>, SocketAddr)>,
}

impl SendBatch {
    pub fn push(&mut self, bytes: &[u8], to: SocketAddr) {
        self.push_with(to, |out| out.extend_from_slice(bytes));
    }

    /// Queue for `to` what `write` appends to the batch's buffer.
    pub fn push_with(&mut self, to: SocketAddr, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.bytes.len();
        write(&mut self.bytes);
        self.out.push((start..self.bytes.len(), to));
    }

    pub fn len(&self) -> usize {
        self.out.len()
    }

    /// Send the queued answers from index `from` without blocking; how many went out (at least
    /// one, or an error for the first of them).
    pub fn send(&self, fd: RawFd, from: usize) -> io::Result<usize> {
        let rest = self.out.get(from..).unwrap_or_default();
        if rest.is_empty() {
            return Ok(0);
        }
        let rest = &rest[..rest.len().min(BATCH)];
        let iovs: [[IoSlice<'_>; 1]; BATCH] = std::array::from_fn(|i| {
            let bytes = rest.get(i).and_then(|(at, _)| self.bytes.get(at.clone()));
            [IoSlice::new(bytes.unwrap_or_default())]
        });
        let addrs: [Option<SockaddrStorage>; BATCH] =
            std::array::from_fn(|i| rest.get(i).map(|(_, to)| SockaddrStorage::from(*to)));
        let none: [ControlMessage<'_>; 0] = [];
        SEND_HEADERS.with(|h| {
            let mut h = h.borrow_mut();
            let headers = h.get_or_insert_with(|| MultiHeaders::preallocate(BATCH, None));
            // The first `rest.len()` slices and addresses: sendmmsg sends as many as it zips.
            let sent = sendmmsg(
                fd,
                headers,
                &iovs[..rest.len()],
                &addrs[..rest.len()],
                none,
                MsgFlags::MSG_DONTWAIT,
            )
            .map_err(io::Error::from)?;
            Ok(sent.count())
        })
    }

    pub fn clear(&mut self) {
        self.bytes.clear();
        self.out.clear();
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_batch_in_and_out_keeps_sources_and_cut_datagrams_are_flagged() {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let clients: Vec<_> = (0..3)
            .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        for (i, c) in clients.iter().enumerate() {
            c.send_to(&[i as u8; 20], server.local_addr().unwrap())
                .unwrap();
        }
        clients[0]
            .send_to(&vec![9u8; DATAGRAM + 10], server.local_addr().unwrap())
            .unwrap();
        let mut rx = RecvBatch::default();
        let mut got = Vec::new();
        while got.len() < 4 {
            match rx.recv(server.as_raw_fd()) {
                Ok(_) => got.extend(rx.iter().map(|(r, b)| (r, b.to_vec()))),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        for (i, (r, b)) in got.iter().take(3).enumerate() {
            assert_eq!(r.src, Some(clients[i].local_addr().unwrap()));
            assert_eq!((r.len, r.cut, b[0]), (20, false, i as u8));
        }
        assert!(got[3].0.cut, "{:?}", got[3].0);
        let mut tx = SendBatch::default();
        for (r, b) in got.iter().take(3) {
            tx.push(b, r.src.unwrap());
        }
        assert_eq!(tx.send(server.as_raw_fd(), 0).unwrap(), 3);
        assert_eq!(tx.send(server.as_raw_fd(), 3).unwrap(), 0);
        for (i, c) in clients.iter().enumerate() {
            let mut b = [0u8; 64];
            let n = c.recv(&mut b).unwrap();
            assert_eq!(&b[..n], &[i as u8; 20]);
        }
    }

    /// The send headers are reused from call to call on a thread: batches to IPv6 and IPv4
    /// clients, one after the other, each reach their own client whole.
    #[test]
    fn send_headers_reused_across_families_and_sizes() {
        let Ok(server6) = std::net::UdpSocket::bind("[::1]:0") else {
            eprintln!("skipping: no IPv6 loopback");
            return;
        };
        let server4 = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let c6 = std::net::UdpSocket::bind("[::1]:0").unwrap();
        let c4: Vec<_> = (0..3)
            .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        for round in 0..3u8 {
            let mut tx = SendBatch::default();
            tx.push(&[round; 300], c6.local_addr().unwrap());
            assert_eq!(tx.send(server6.as_raw_fd(), 0).unwrap(), 1);
            let mut tx = SendBatch::default();
            for (i, c) in c4.iter().enumerate() {
                tx.push(&vec![round + i as u8; 10 + i], c.local_addr().unwrap());
            }
            assert_eq!(tx.send(server4.as_raw_fd(), 0).unwrap(), 3);
            let mut b = [0u8; 512];
            let n = c6.recv(&mut b).unwrap();
            assert_eq!(&b[..n], &[round; 300][..]);
            for (i, c) in c4.iter().enumerate() {
                let n = c.recv(&mut b).unwrap();
                assert_eq!(&b[..n], &vec![round + i as u8; 10 + i][..]);
            }
        }
    }
}
