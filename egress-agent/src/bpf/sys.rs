//! The syscalls aya 0.14 does not wrap: `getsockopt(SO_NETNS_COOKIE)`, `BPF_PROG_QUERY` on a
//! cgroup, `BPF_LINK_UPDATE` and `BPF_OBJ_GET`. Kept small and checked; the agent's other `unsafe`
//! code is listed in docs/architecture.md, "Kernel enforcement model".
use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// Network namespace cookie of the calling thread's netns (`SO_NETNS_COOKIE`, Linux 5.14):
/// the same value `bpf_get_netns_cookie()` returns for sockets in that namespace.
pub fn current_netns_cookie() -> io::Result<u64> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))?;
    cookie_sockopt(sock.as_fd(), libc::SO_NETNS_COOKIE, "SO_NETNS_COOKIE")
}

/// `getsockopt(SOL_SOCKET, opt)` of a u64 cookie option (`SO_COOKIE`, `SO_NETNS_COOKIE`): an
/// error unless the kernel wrote a whole non-zero u64. `name` names `opt` in the error.
pub fn cookie_sockopt(
    fd: std::os::fd::BorrowedFd<'_>,
    opt: libc::c_int,
    name: &str,
) -> io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid socket fd, `cookie` is a u64 and `len` its size, as the cookie options
    // expect.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<u64>() || cookie == 0 {
        return Err(io::Error::other(format!("{name} returned no cookie")));
    }
    Ok(cookie)
}

/// `bpf(cmd, attr, sizeof attr)`: the non-negative result (0, or a new fd), or the errno.
///
/// # Safety
/// `attr` must be laid out as the prefix of `union bpf_attr` that `cmd` reads
/// (include/uapi/linux/bpf.h), and every pointer in it must be valid for the call.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: the caller vouches for `attr`; its size is passed with it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// `union bpf_attr` layout of the BPF_PROG_QUERY command (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct ProgQueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

const BPF_PROG_QUERY: libc::c_long = 16;

/// IDs of the programs attached directly to `cgroup` for one attach type (`BPF_PROG_QUERY`
/// without `BPF_F_QUERY_EFFECTIVE`): what `bpftool cgroup show` lists.
pub fn query_cgroup_programs(cgroup: impl AsFd, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    // BPF_LSM_CGROUP queries require per-program attach flags to be requested too.
    let mut flags = vec![0u32; 64];
    let mut attr = ProgQueryAttr {
        target_fd: cgroup.as_fd().as_raw_fd() as u32,
        attach_type,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        prog_attach_flags: flags.as_mut_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: `attr` is a correctly laid out bpf_attr prefix with its size passed; `prog_ids`
    // and `prog_attach_flags` point to `prog_cnt` writable u32s that outlive the call.
    unsafe { bpf(BPF_PROG_QUERY, &mut attr) }?;
    ids.truncate(attr.prog_cnt.min(64) as usize);
    Ok(ids)
}

/// `union bpf_attr` layout of the BPF_LINK_UPDATE command.
#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

const BPF_LINK_UPDATE: libc::c_long = 29;

/// Make the bpf link `link` run `new_prog` instead of its current program (`BPF_LINK_UPDATE`):
/// one atomic swap, the hook never runs without a program. The program must have the link's
/// program type and attach type.
pub fn link_update(link: impl AsFd, new_prog: impl AsFd) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_fd().as_raw_fd() as u32,
        new_prog_fd: new_prog.as_fd().as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    // SAFETY: `attr` is a correctly laid out bpf_attr prefix for BPF_LINK_UPDATE with its size
    // passed; both fds are borrowed for the duration of the call.
    unsafe { bpf(BPF_LINK_UPDATE, &mut attr) }?;
    Ok(())
}

/// `union bpf_attr` layout of the BPF_OBJ_GET command.
#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

const BPF_OBJ_GET: libc::c_long = 7;

/// Open a pinned bpf object (here: a link) by its bpffs path (`BPF_OBJ_GET`).
pub fn obj_get(path: &std::path::Path) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::other("path contains a NUL byte"))?;
    let mut attr = ObjGetAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        _pad: 0,
    };
    // SAFETY: `attr` is a correctly laid out bpf_attr prefix for BPF_OBJ_GET with its size
    // passed; `pathname` points to a NUL-terminated string that outlives the call.
    let fd = unsafe { bpf(BPF_OBJ_GET, &mut attr) }?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("bpf returned an invalid fd"))?;
    // SAFETY: BPF_OBJ_GET returned a new file descriptor that nothing else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Kernel `enum bpf_attach_type` values used with [`query_cgroup_programs`].
pub mod attach_type {
    pub const CGROUP_INET_INGRESS: u32 = 0;
    pub const CGROUP_INET_EGRESS: u32 = 1;
    pub const CGROUP_INET_SOCK_CREATE: u32 = 2;
    pub const CGROUP_SOCK_OPS: u32 = 3;
    pub const CGROUP_INET4_CONNECT: u32 = 10;
    pub const CGROUP_INET6_CONNECT: u32 = 11;
    pub const CGROUP_UDP4_SENDMSG: u32 = 14;
    pub const CGROUP_UDP6_SENDMSG: u32 = 15;
    pub const LSM_CGROUP: u32 = 43;
}
