//! The socket calls the spliced relay needs that neither std, tokio, socket2 nor nix wrap:
//! `TCP_INFO`, the `SIOCINQ`/`SIOCOUTQ` queue sizes and `SO_RCVLOWAT` (`SO_COOKIE` goes through
//! `bpf::sys::cookie_sockopt`), and for the hand-back the quiescing socket filter
//! (`SO_ATTACH_FILTER`/`SO_DETACH_FILTER`) and `SO_LINGER` 0, all through one checked
//! `setsockopt`. Each call checked; the relay's only other `unsafe` is the fd
//! registration with tokio in `watch`.
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// What the relay reads from `struct tcp_info` (include/uapi/linux/tcp.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpInfo {
    /// `TCP_ESTABLISHED` = 1, ... (`tcpi_state`).
    pub state: u8,
    /// `snd_una` advanced (bytes the peer acknowledged, the SYN and FIN included).
    pub bytes_acked: u64,
    /// `rcv_nxt` advanced (bytes received, a received FIN included).
    pub bytes_received: u64,
    /// Milliseconds since data was last received on the socket.
    pub last_data_recv_ms: u32,
}

pub const TCP_CLOSE_WAIT: u8 = 8;
pub const TCP_LAST_ACK: u8 = 9;
pub const TCP_CLOSING: u8 = 11;
pub const TCP_TIME_WAIT: u8 = 6;
pub const TCP_CLOSE: u8 = 7;

/// `getsockopt(TCP_INFO)`.
pub fn tcp_info(fd: BorrowedFd<'_>) -> io::Result<TcpInfo> {
    // SAFETY: all-zero is a valid `tcp_info` (plain integers).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: valid fd; `info` is a `tcp_info` and `len` its size (the kernel writes at most
    // `len` bytes and reports how many).
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // tcpi_bytes_received ends at offset 136 (Linux 4.1+); older kernels can't splice anyway.
    if (len as usize) < 136 {
        return Err(io::Error::other(
            "TCP_INFO too short (kernel older than 4.1)",
        ));
    }
    Ok(TcpInfo {
        state: info.tcpi_state,
        bytes_acked: info.tcpi_bytes_acked,
        bytes_received: info.tcpi_bytes_received,
        last_data_recv_ms: info.tcpi_last_data_recv,
    })
}

/// `getsockopt(SO_COOKIE)`: the socket's cookie, what `bpf_get_socket_cookie` returns for it.
pub fn socket_cookie(fd: BorrowedFd<'_>) -> io::Result<u64> {
    crate::bpf::sys::cookie_sockopt(fd, libc::SO_COOKIE, "SO_COOKIE")
}

fn ioctl_int(fd: BorrowedFd<'_>, req: libc::Ioctl) -> io::Result<u32> {
    let mut n: libc::c_int = 0;
    // SAFETY: valid fd; SIOCINQ/SIOCOUTQ write one int.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), req, &raw mut n) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as u32)
}

/// `SIOCINQ`: received bytes not yet consumed (a received FIN not counted).
pub fn inq(fd: BorrowedFd<'_>) -> io::Result<u32> {
    ioctl_int(fd, libc::FIONREAD)
}

/// `SIOCOUTQ`: bytes written but not yet acknowledged (`write_seq - snd_una`).
pub fn outq(fd: BorrowedFd<'_>) -> io::Result<u32> {
    ioctl_int(fd, libc::TIOCOUTQ)
}

/// `setsockopt(SO_RCVLOWAT)`. For TCP this also runs the socket's data-ready callback if bytes
/// are queued (`tcp_set_rcvlowat` → `tcp_data_ready`), which is how queued bytes are handed to
/// a verdict program attached after they arrived.
pub fn set_rcvlowat(fd: BorrowedFd<'_>, bytes: i32) -> io::Result<()> {
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, &bytes)
}

/// `setsockopt(fd, level, name, value)` for a plain-data `value` the option takes whole.
fn setsockopt<T>(fd: BorrowedFd<'_>, level: i32, name: i32, value: &T) -> io::Result<()> {
    // SAFETY: valid fd; `value` is a `T`, the type the option takes, and `len` its size (the
    // kernel reads at most `len` bytes and copies what it keeps).
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(value).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The classic BPF socket filter [`quiesce`] attaches: drop every TCP segment that carries
/// payload (`skb->len` past the header's `doff × 4`), keep the rest (ACKs, window updates, FIN
/// and RST without data). A TCP socket's filter runs in `tcp_v4_rcv`/`tcp_v6_rcv` (`tcp_filter`)
/// before the segment reaches TCP, with `skb->data` at the TCP header; a dropped segment was
/// never received (not acknowledged), so its sender sends it again later: nothing is lost.
const QUIESCE_FILTER: [libc::sock_filter; 7] = [
    // A = th->doff << 4 | reserved (byte 12 of the TCP header)
    bpf_stmt(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 12),
    // A = doff × 4 (header length in bytes)
    bpf_stmt(libc::BPF_ALU | libc::BPF_RSH | libc::BPF_K, 4),
    bpf_stmt(libc::BPF_ALU | libc::BPF_LSH | libc::BPF_K, 2),
    // X = header length; A = segment length
    bpf_stmt(libc::BPF_MISC | libc::BPF_TAX, 0),
    bpf_stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_LEN, 0),
    // payload? → drop (0 bytes kept); else keep the whole segment.
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_X) as u16,
        jt: 1,
        jf: 0,
        k: 0,
    },
    bpf_stmt(libc::BPF_RET | libc::BPF_K, u32::MAX),
];
const QUIESCE_DROP: libc::sock_filter = bpf_stmt(libc::BPF_RET | libc::BPF_K, 0);

const fn bpf_stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

/// Stop `fd` from receiving payload until [`unquiesce`]: segments with data are dropped before
/// TCP sees them (their senders retransmit), so no byte can reach the socket's receive path —
/// and so the relay program — while its sockmap entries change. See [`QUIESCE_FILTER`].
pub fn quiesce(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut prog = [QUIESCE_DROP; QUIESCE_FILTER.len() + 1];
    prog[..QUIESCE_FILTER.len()].copy_from_slice(&QUIESCE_FILTER);
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // `fprog` points at `prog`, which outlives the call (the kernel copies the program).
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fprog)
}

/// Remove the [`quiesce`] filter.
pub fn unquiesce(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SO_DETACH_FILTER ignores its value.
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_DETACH_FILTER, &0i32)
}

/// `SO_LINGER` with a zero timeout: closing the socket then resets the connection (RST) instead
/// of a FIN, so the peer sees an error, never a clean end of a stream that lost bytes.
pub fn reset_on_close(fd: BorrowedFd<'_>) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, &linger)
}
