//! `relay-floor`: the least work a CONNECT relay can do per tunnel on Linux, as a benchmark
//! reference for `proxy-bench` (peer `floor`). It is **not a proxy**: no policy, no logging, no
//! timeouts or bounds, no name resolution (`bench.test:PORT` means 127.0.0.1:PORT; anything else is
//! closed). What it keeps is the TCP work every CONNECT proxy must do per tunnel — accept, read
//! the request, connect upstream, answer 200, relay both ways, half-close, close — issued through
//! one io_uring on one thread (multishot accept, batched submissions, deferred task work), so
//! there is no readiness polling and almost no user-space work. Its CPU per tunnel is therefore
//! close to the kernel's own cost, and `floor/squid` bounds what any proxy can reach against
//! squid on the machine the bench runs on.
//!
//! Usage: `relay-floor ADDR_FILE` (binds 127.0.0.1:0, writes `bench ADDR` to ADDR_FILE, runs
//! until killed).

use std::io;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, IntoRawFd};

use io_uring::{IoUring, cqueue, opcode, squeue, types};

/// Per-direction relay buffer (the agent's default tunnel buffer is of this order).
const BUF: usize = 16 * 1024;
/// Request heads longer than this are refused (the tunnel bench sends ~60 bytes).
const HEAD_MAX: usize = 4096;
const ACCEPT: u64 = u64::MAX;
const OK200: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// A relay direction: `Up` reads the client and writes the upstream, `Down` the reverse.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Up = 0,
    Down = 1,
}

impl Dir {
    fn other(self) -> Dir {
        match self {
            Dir::Up => Dir::Down,
            Dir::Down => Dir::Up,
        }
    }
}

/// What a completion belongs to (low byte of `user_data`; the rest is the tunnel's slot).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    RecvHead,
    Connect,
    Send200,
    Recv(Dir),
    Send(Dir),
    Shutdown,
}

impl Op {
    fn code(self) -> u64 {
        match self {
            Op::RecvHead => 1,
            Op::Connect => 2,
            Op::Send200 => 3,
            Op::Recv(d) => 4 + d as u64,
            Op::Send(d) => 6 + d as u64,
            Op::Shutdown => 8,
        }
    }

    fn from_user_data(v: u64) -> Option<Op> {
        Some(match v & 0xff {
            1 => Op::RecvHead,
            2 => Op::Connect,
            3 => Op::Send200,
            4 => Op::Recv(Dir::Up),
            5 => Op::Recv(Dir::Down),
            6 => Op::Send(Dir::Up),
            7 => Op::Send(Dir::Down),
            8 => Op::Shutdown,
            _ => return None,
        })
    }
}

/// One direction's bytes: `buf[sent..len]` is still to be written.
struct Flow {
    buf: [u8; BUF],
    len: usize,
    sent: usize,
    eof: bool,
}

/// One tunnel. Boxed, so the buffers and the address the kernel reads stay put while the slot
/// table grows.
struct Tunnel {
    client: i32,
    upstream: i32,
    /// The request head is read into `flows[Up].buf`; the 200 answer's progress is
    /// `flows[Down].sent`.
    head_len: usize,
    flows: [Flow; 2],
    addr: libc::sockaddr_in,
    inflight: u32,
    dead: bool,
}

impl Tunnel {
    /// Where direction `d` reads from and writes to.
    fn ends(&self, d: Dir) -> (i32, i32) {
        match d {
            Dir::Up => (self.client, self.upstream),
            Dir::Down => (self.upstream, self.client),
        }
    }
}

struct Relay {
    ring: IoUring,
    slots: Vec<Option<Box<Tunnel>>>,
    free: Vec<usize>,
    listener: i32,
}

fn user_data(slot: usize, op: Op) -> u64 {
    ((slot as u64) << 8) | op.code()
}

impl Relay {
    fn push(&mut self, e: squeue::Entry) -> io::Result<()> {
        // SAFETY: every entry points into a boxed `Tunnel` (or a static) that outlives the
        // operation: a tunnel is freed only when it has no operation in flight.
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            self.ring.submit()?;
        }
        Ok(())
    }

    fn arm_accept(&mut self) -> io::Result<()> {
        let e = opcode::AcceptMulti::new(types::Fd(self.listener))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(ACCEPT);
        self.push(e)
    }

    fn tunnel(&mut self, slot: usize) -> &mut Tunnel {
        self.slots[slot].as_mut().expect("live slot")
    }

    fn submit(&mut self, slot: usize, op: Op) -> io::Result<()> {
        let t = self.tunnel(slot);
        let e = match op {
            Op::RecvHead => opcode::Recv::new(
                types::Fd(t.client),
                t.flows[Dir::Up as usize].buf[t.head_len..].as_mut_ptr(),
                (HEAD_MAX - t.head_len) as u32,
            )
            .build(),
            Op::Connect => opcode::Connect::new(
                types::Fd(t.upstream),
                (&raw const t.addr).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            )
            .build(),
            Op::Send200 => {
                let sent = t.flows[Dir::Down as usize].sent;
                opcode::Send::new(
                    types::Fd(t.client),
                    OK200[sent..].as_ptr(),
                    (OK200.len() - sent) as u32,
                )
                .build()
            }
            Op::Recv(d) => {
                let (from, _) = t.ends(d);
                let f = &mut t.flows[d as usize];
                opcode::Recv::new(types::Fd(from), f.buf.as_mut_ptr(), BUF as u32).build()
            }
            Op::Send(d) => {
                let (_, to) = t.ends(d);
                let f = &t.flows[d as usize];
                opcode::Send::new(
                    types::Fd(to),
                    f.buf[f.sent..].as_ptr(),
                    (f.len - f.sent) as u32,
                )
                .build()
            }
            Op::Shutdown => unreachable!("use shutdown()"),
        };
        t.inflight += 1;
        self.push(e.user_data(user_data(slot, op)))
    }

    /// Half-close `fd` (a peer's EOF passed on).
    fn shutdown(&mut self, slot: usize, fd: i32) -> io::Result<()> {
        self.tunnel(slot).inflight += 1;
        let e = opcode::Shutdown::new(types::Fd(fd), libc::SHUT_WR)
            .build()
            .user_data(user_data(slot, Op::Shutdown));
        self.push(e)
    }

    /// Abort: wake every pending read with EOF; the slot is freed once nothing is in flight.
    fn kill(&mut self, slot: usize) {
        let t = self.tunnel(slot);
        if !t.dead {
            t.dead = true;
            for fd in [t.client, t.upstream] {
                if fd >= 0 {
                    // SAFETY: plain syscall on a descriptor this tunnel owns.
                    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                }
            }
        }
    }

    fn close_if_done(&mut self, slot: usize) {
        let t = self.tunnel(slot);
        if t.inflight == 0 && (t.dead || t.flows.iter().all(|f| f.eof)) {
            let t = self.slots[slot].take().expect("live slot");
            for fd in [t.client, t.upstream] {
                if fd >= 0 {
                    // SAFETY: the tunnel owns these descriptors and no operation uses them.
                    unsafe { libc::close(fd) };
                }
            }
            self.free.push(slot);
        }
    }

    fn accepted(&mut self, fd: i32) -> io::Result<()> {
        let flow = || Flow {
            buf: [0; BUF],
            len: 0,
            sent: 0,
            eof: false,
        };
        let t = Box::new(Tunnel {
            client: fd,
            upstream: -1,
            head_len: 0,
            flows: [flow(), flow()],
            // SAFETY: all-zero is a valid sockaddr_in.
            addr: unsafe { std::mem::zeroed() },
            inflight: 0,
            dead: false,
        });
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s] = Some(t);
                s
            }
            None => {
                self.slots.push(Some(t));
                self.slots.len() - 1
            }
        };
        self.submit(slot, Op::RecvHead)
    }

    /// The request head so far: wait for more, or dial `bench.test:PORT` on 127.0.0.1.
    fn head(&mut self, slot: usize, res: i32) -> io::Result<()> {
        if res <= 0 {
            self.kill(slot);
            return Ok(());
        }
        let t = self.tunnel(slot);
        t.head_len += res as usize;
        let head = &t.flows[Dir::Up as usize].buf[..t.head_len];
        if !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if t.head_len == HEAD_MAX {
                self.kill(slot);
                return Ok(());
            }
            return self.submit(slot, Op::RecvHead);
        }
        let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
        let port = std::str::from_utf8(line)
            .ok()
            .and_then(|l| l.strip_prefix("CONNECT bench.test:"))
            .and_then(|rest| rest.split(' ').next())
            .and_then(|p| p.parse::<u16>().ok());
        let Some(port) = port.filter(|p| *p != 0) else {
            self.kill(slot);
            return Ok(());
        };
        // SAFETY: plain syscalls; the descriptor is owned by the tunnel from here on.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            self.kill(slot);
            return Ok(());
        }
        set_nodelay(fd);
        t.upstream = fd;
        t.addr.sin_family = libc::AF_INET as libc::sa_family_t;
        t.addr.sin_port = port.to_be();
        t.addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        self.submit(slot, Op::Connect)
    }

    fn complete(&mut self, ud: u64, res: i32, flags: u32) -> io::Result<()> {
        if ud == ACCEPT {
            if res >= 0 {
                self.accepted(res)?;
            }
            if !cqueue::more(flags) {
                self.arm_accept()?;
            }
            return Ok(());
        }
        let slot = (ud >> 8) as usize;
        let Some(op) = Op::from_user_data(ud) else {
            return Ok(());
        };
        let t = self.tunnel(slot);
        t.inflight -= 1;
        if t.dead {
            self.close_if_done(slot);
            return Ok(());
        }
        match op {
            Op::RecvHead => self.head(slot, res)?,
            Op::Connect if res < 0 => self.kill(slot),
            Op::Connect => self.submit(slot, Op::Send200)?,
            Op::Send200 if res <= 0 => self.kill(slot),
            Op::Send200 => {
                let t = self.tunnel(slot);
                let f = &mut t.flows[Dir::Down as usize];
                f.sent += res as usize;
                if f.sent < OK200.len() {
                    self.submit(slot, Op::Send200)?;
                } else {
                    f.sent = 0;
                    self.submit(slot, Op::Recv(Dir::Up))?;
                    self.submit(slot, Op::Recv(Dir::Down))?;
                }
            }
            Op::Recv(d) if res > 0 => {
                let f = &mut self.tunnel(slot).flows[d as usize];
                (f.len, f.sent) = (res as usize, 0);
                self.submit(slot, Op::Send(d))?;
            }
            Op::Recv(d) => {
                let t = self.tunnel(slot);
                t.flows[d as usize].eof = true;
                // Pass the EOF on, unless the other side has finished too: then both sockets
                // are about to be closed and a shutdown would be wasted.
                if !t.flows[d.other() as usize].eof {
                    let (_, to) = t.ends(d);
                    self.shutdown(slot, to)?;
                }
            }
            Op::Send(_) if res <= 0 => self.kill(slot),
            Op::Send(d) => {
                let f = &mut self.tunnel(slot).flows[d as usize];
                f.sent += res as usize;
                let next = if f.sent < f.len {
                    Op::Send(d)
                } else {
                    Op::Recv(d)
                };
                self.submit(slot, next)?;
            }
            Op::Shutdown => {}
        }
        self.close_if_done(slot);
        Ok(())
    }
}

/// `TCP_NODELAY` on `fd`, as every proxy in the bench sets it (best effort, like theirs).
fn set_nodelay(fd: i32) {
    let one: libc::c_int = 1;
    // SAFETY: valid option pointer and length.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as u32,
        )
    };
}

fn main() -> io::Result<()> {
    let Some(out) = std::env::args().nth(1) else {
        eprintln!("usage: relay-floor ADDR_FILE");
        std::process::exit(2);
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    set_nodelay(listener.as_raw_fd()); // accepted sockets inherit it
    let addr = listener.local_addr()?;
    let ring = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_cqsize(16384)
        .build(4096)?;
    let mut relay = Relay {
        ring,
        slots: Vec::with_capacity(1024),
        free: Vec::new(),
        listener: listener.into_raw_fd(),
    };
    relay.arm_accept()?;
    let tmp = format!("{out}.tmp");
    std::fs::write(&tmp, format!("bench {addr}\n"))?;
    std::fs::rename(&tmp, &out)?;
    let mut batch: Vec<(u64, i32, u32)> = Vec::with_capacity(512);
    loop {
        relay.ring.submit_and_wait(1)?;
        loop {
            batch.clear();
            batch.extend(
                relay
                    .ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            if batch.is_empty() {
                break;
            }
            for &(ud, res, flags) in &batch {
                relay.complete(ud, res, flags)?;
            }
        }
    }
}
