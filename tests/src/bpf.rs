//! Raw `bpf(2)` calls the tests make, independent of the agent's own loader on purpose: list the
//! programs attached to a cgroup, and stand in for another build of the agent (load a different,
//! allow-everything program, swap it into a pinned link, read program tags).
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a zero-initialised bpf_attr of `attr.len()` bytes laid out for `cmd` by
    // the callers below; pointers inside it refer to buffers that outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            attr.len() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

fn put_u32(attr: &mut [u8], at: usize, v: u32) {
    attr[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(attr: &mut [u8], at: usize, v: u64) {
    attr[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

fn owned(fd: libc::c_long) -> OwnedFd {
    // SAFETY: the bpf command returned a new file descriptor nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// Load `r0 = 1; exit` as a cgroup sock_addr program for `expected_attach_type` (e.g.
/// `BPF_CGROUP_INET4_CONNECT` = 10, `BPF_CGROUP_UDP4_SENDMSG` = 14): allows everything, rewrites
/// nothing.
pub fn load_allow_all_sock_addr(expected_attach_type: u32) -> OwnedFd {
    load_allow_all(prog_type::CGROUP_SOCK_ADDR, expected_attach_type)
        .expect("BPF_PROG_LOAD allow-all sock_addr")
}

/// `bpf_prog_type` values used here.
pub mod prog_type {
    pub const CGROUP_SKB: u32 = 8;
    pub const CGROUP_SOCK: u32 = 9;
    pub const SOCK_OPS: u32 = 13;
    pub const CGROUP_SOCK_ADDR: u32 = 18;
}

/// Load `r0 = 1; exit` as a program of `prog_type` for `expected_attach_type`: every cgroup hook
/// reads 1 as "allow" (sock_ops ignores it), so it does nothing but be run.
pub fn load_allow_all(prog_type: u32, expected_attach_type: u32) -> std::io::Result<OwnedFd> {
    // struct bpf_insn { u8 code; u8 dst:4, src:4; s16 off; s32 imm; }
    let insns: [u8; 16] = [
        0xb7, 0x00, 0, 0, 1, 0, 0, 0, // BPF_ALU64 | BPF_MOV | BPF_K: r0 = 1
        0x95, 0x00, 0, 0, 0, 0, 0, 0, // BPF_JMP | BPF_EXIT
    ];
    let license = b"GPL\0";
    let mut attr = [0u8; 128];
    put_u32(&mut attr, 0, prog_type);
    put_u32(&mut attr, 4, 2); // insn_cnt
    put_u64(&mut attr, 8, insns.as_ptr() as u64);
    put_u64(&mut attr, 16, license.as_ptr() as u64);
    put_u32(&mut attr, 68, expected_attach_type);
    bpf(5, &mut attr).map(owned) // BPF_PROG_LOAD
}

/// `BPF_PROG_ATTACH` of `prog` to the cgroup directory `cgroup` with `BPF_F_ALLOW_MULTI`. The
/// attachment lasts until the cgroup is removed (or the program is detached).
pub fn attach_to_cgroup(cgroup: &Path, prog: &OwnedFd, attach_type: u32) -> std::io::Result<()> {
    let dir = std::fs::File::open(cgroup)?;
    // target_fd, attach_bpf_fd, attach_type, attach_flags
    let mut attr = [0u8; 20];
    put_u32(&mut attr, 0, dir.as_raw_fd() as u32);
    put_u32(&mut attr, 4, prog.as_raw_fd() as u32);
    put_u32(&mut attr, 8, attach_type);
    put_u32(&mut attr, 12, 2); // BPF_F_ALLOW_MULTI
    bpf(8, &mut attr).map(drop) // BPF_PROG_ATTACH
}

/// `BPF_ENABLE_STATS(BPF_STATS_RUN_TIME)`: the kernel counts every program's runs and run time
/// while the returned fd is open (no sysctl is changed).
pub fn enable_run_time_stats() -> std::io::Result<OwnedFd> {
    let mut attr = [0u8; 4]; // stats_type: BPF_STATS_RUN_TIME = 0
    bpf(32, &mut attr).map(owned) // BPF_ENABLE_STATS
}

/// Make the link pinned at `pin` run `prog` (BPF_OBJ_GET, then BPF_LINK_UPDATE).
pub fn swap_pinned_link_program(pin: &Path, prog: &OwnedFd) {
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes()).expect("path");
    let mut attr = [0u8; 24];
    put_u64(&mut attr, 0, path.as_ptr() as u64);
    let link = owned(bpf(7, &mut attr).expect("BPF_OBJ_GET pinned link")); // BPF_OBJ_GET
    let mut attr = [0u8; 16];
    put_u32(&mut attr, 0, link.as_raw_fd() as u32);
    put_u32(&mut attr, 4, prog.as_raw_fd() as u32);
    bpf(29, &mut attr).expect("BPF_LINK_UPDATE"); // BPF_LINK_UPDATE
}

/// The kernel's tag (hash of the instructions) of loaded program `id`.
pub fn prog_tag(id: u32) -> [u8; 8] {
    let mut attr = [0u8; 12];
    put_u32(&mut attr, 0, id);
    let fd = owned(bpf(13, &mut attr).expect("BPF_PROG_GET_FD_BY_ID")); // BPF_PROG_GET_FD_BY_ID
    let info = prog_info(&fd).expect("BPF_OBJ_GET_INFO_BY_FD");
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&info[8..16]);
    tag
}

/// (run_cnt, run_time_ns) of program `prog`: what the kernel counted while run-time stats were
/// on ([`enable_run_time_stats`]).
pub fn prog_run_stats(prog: &OwnedFd) -> std::io::Result<(u64, u64)> {
    let info = prog_info(prog)?;
    let u64_at = |at: usize| u64::from_ne_bytes(info[at..at + 8].try_into().expect("8 bytes"));
    Ok((u64_at(200), u64_at(192)))
}

/// The start of `struct bpf_prog_info` (type, id, tag[8] at 8, …, run_time_ns at 192, run_cnt
/// at 200).
fn prog_info(prog: &OwnedFd) -> std::io::Result<[u8; 256]> {
    let mut info = [0u8; 256];
    let mut attr = [0u8; 16];
    put_u32(&mut attr, 0, prog.as_raw_fd() as u32);
    put_u32(&mut attr, 4, info.len() as u32);
    put_u64(&mut attr, 8, info.as_mut_ptr() as u64);
    bpf(15, &mut attr)?; // BPF_OBJ_GET_INFO_BY_FD
    Ok(info)
}

/// Program ids attached directly to `cgroup` for `attach_type` (BPF_PROG_QUERY, what
/// `bpftool cgroup show` lists), independent of the agent's own bookkeeping.
pub fn attached_programs(cgroup: &Path, attach_type: u32) -> Vec<u32> {
    let dir = std::fs::File::open(cgroup).expect("open cgroup");
    let mut ids = vec![0u32; 64];
    // BPF_LSM_CGROUP queries require per-program attach flags to be requested too.
    let mut flags = vec![0u32; 64];
    // target_fd, attach_type, query_flags, attach_flags, prog_ids, prog_cnt, pad,
    // prog_attach_flags, link_ids, link_attach_flags, revision.
    let mut attr = [0u8; 64];
    put_u32(&mut attr, 0, dir.as_raw_fd() as u32);
    put_u32(&mut attr, 4, attach_type);
    put_u64(&mut attr, 16, ids.as_mut_ptr() as u64);
    put_u32(&mut attr, 24, ids.len() as u32);
    put_u64(&mut attr, 32, flags.as_mut_ptr() as u64);
    bpf(16, &mut attr).expect("BPF_PROG_QUERY"); // BPF_PROG_QUERY
    let mut cnt = [0u8; 4];
    cnt.copy_from_slice(&attr[24..28]);
    ids.truncate((u32::from_ne_bytes(cnt) as usize).min(64));
    ids
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_MAP_GET_NEXT_ID: libc::c_long = 12;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
const BPF_LINK_GET_NEXT_ID: libc::c_long = 31;
const BPF_LINK_DETACH: libc::c_long = 34;

/// Ids of every loaded program (`BPF_PROG_GET_NEXT_ID`), map (`..._MAP_...`) or link
/// (`..._LINK_...`) on the host — what a process escaping confinement would walk.
fn next_ids(cmd: libc::c_long) -> std::io::Result<Vec<u32>> {
    let mut ids = Vec::new();
    let mut start = 0u32;
    loop {
        let mut attr = [0u8; 16];
        put_u32(&mut attr, 0, start);
        match bpf(cmd, &mut attr) {
            Ok(_) => {
                let next = u32::from_ne_bytes(attr[4..8].try_into().expect("4 bytes"));
                ids.push(next);
                start = next;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(ids),
            Err(e) => return Err(e),
        }
    }
}

pub fn link_ids() -> std::io::Result<Vec<u32>> {
    next_ids(BPF_LINK_GET_NEXT_ID)
}

pub fn prog_ids() -> std::io::Result<Vec<u32>> {
    next_ids(BPF_PROG_GET_NEXT_ID)
}

pub fn map_ids() -> std::io::Result<Vec<u32>> {
    next_ids(BPF_MAP_GET_NEXT_ID)
}

/// `BPF_LINK_GET_FD_BY_ID`, then `BPF_LINK_DETACH` on it.
pub fn detach_link(id: u32) -> std::io::Result<()> {
    let mut attr = [0u8; 16];
    put_u32(&mut attr, 0, id);
    let fd = owned(bpf(BPF_LINK_GET_FD_BY_ID, &mut attr)?);
    let mut attr = [0u8; 16];
    put_u32(&mut attr, 0, fd.as_raw_fd() as u32);
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

/// `BPF_OBJ_GET` on a bpffs path.
pub fn obj_get(path: &Path) -> std::io::Result<OwnedFd> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("no NUL");
    let mut attr = [0u8; 16];
    put_u64(&mut attr, 0, c.as_ptr() as u64);
    bpf(BPF_OBJ_GET, &mut attr).map(owned)
}
