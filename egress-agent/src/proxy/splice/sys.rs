//! The socket calls the spliced relay needs that neither std, tokio, socket2 nor nix wrap:
//! `TCP_INFO`, the `SIOCINQ`/`SIOCOUTQ` queue sizes and `SO_RCVLOWAT` (`SO_COOKIE` goes through
//! `bpf::sys::cookie_sockopt`). Each call checked; the relay's only other `unsafe` is the fd
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
    // SAFETY: valid fd; SO_RCVLOWAT takes an int.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const bytes).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
