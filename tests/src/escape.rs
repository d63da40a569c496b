//! Ways a confined command (root or not) might try to undo its confinement or anyone else's —
//! the probe's `escape TECHNIQUE ARGS... [-- MODE ARGS...]` runs one, prints
//! `escape TECHNIQUE: ok <what happened>` or `escape TECHNIQUE: err <errno> <message>`, then the
//! egress attempt MODE. Whether the escape worked is decided by the test from what arrived at
//! its canary and from the host's enforcement afterwards, never from this line alone.
use std::ffi::CString;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

fn arg(args: &[String], i: usize) -> io::Result<&str> {
    args.get(i)
        .map(String::as_str)
        .ok_or_else(|| io::Error::other(format!("missing argument {i}")))
}

fn cvt(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn temp_dir(tag: &str) -> io::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("egress-probe-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

fn mount(src: &str, target: &Path, fstype: &str) -> io::Result<()> {
    let s = CString::new(src).expect("no NUL");
    let t = CString::new(target.as_os_str().as_bytes()).expect("no NUL");
    let f = CString::new(fstype).expect("no NUL");
    // SAFETY: NUL-terminated strings that outlive the call; no data argument.
    cvt(unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), 0, std::ptr::null()) } as _)
        .map(drop)
}

/// Files below `dir` (recursively), best effort.
fn files_below(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => files_below(&p, out),
            Ok(_) => out.push(p),
            Err(_) => {}
        }
    }
}

/// One technique; `Ok` describes what happened when nothing refused it.
pub fn attempt(tech: &str, args: &[String]) -> io::Result<String> {
    match tech {
        // Leave the cgroup: write our pid into the cgroup2 root's cgroup.procs.
        "cgroup-root" => {
            let procs = Path::new(arg(args, 0)?).join("cgroup.procs");
            std::fs::write(&procs, std::process::id().to_string())?;
            let now = std::fs::read_to_string("/proc/self/cgroup")?;
            Ok(format!("wrote {}; now {}", procs.display(), now.trim()))
        }
        // Mount a cgroup2 hierarchy of our own and leave through it.
        "cgroup-mount" => {
            let d = temp_dir("cg")?;
            mount("cgroup2", &d, "cgroup2")?;
            std::fs::write(d.join("cgroup.procs"), std::process::id().to_string())?;
            Ok(format!("mounted and wrote {}", d.display()))
        }
        // Walk every BPF link on the host and detach it.
        "bpf-links" => {
            let ids = crate::bpf::link_ids()?;
            let mut detached = 0;
            let mut last = None;
            for id in &ids {
                match crate::bpf::detach_link(*id) {
                    Ok(()) => detached += 1,
                    Err(e) => last = Some(e),
                }
            }
            match (detached, last) {
                (0, Some(e)) => Err(e),
                (n, _) => Ok(format!("{} links, detached {n}", ids.len())),
            }
        }
        // Enumerate programs and maps (each a step towards rewriting them).
        "bpf-objects" => {
            let p = crate::bpf::prog_ids()?;
            let m = crate::bpf::map_ids()?;
            Ok(format!("{} programs, {} maps", p.len(), m.len()))
        }
        // Open and unlink the agent's pins.
        "bpf-pins" => {
            let dir = Path::new(arg(args, 0)?);
            let mut files = Vec::new();
            files_below(dir, &mut files);
            if files.is_empty() {
                return Err(io::Error::from_raw_os_error(
                    std::fs::read_dir(dir)
                        .err()
                        .and_then(|e| e.raw_os_error())
                        .unwrap_or(libc::ENOENT),
                ));
            }
            let mut opened = 0;
            let mut unlinked = 0;
            for f in &files {
                opened += usize::from(crate::bpf::obj_get(f).is_ok());
                unlinked += usize::from(std::fs::remove_file(f).is_ok());
            }
            Ok(format!(
                "{} pins: opened {opened}, unlinked {unlinked}",
                files.len()
            ))
        }
        // A bpffs of our own (to pin into, or to find the agent's objects).
        "mount-bpffs" => {
            let d = temp_dir("bpf")?;
            mount("bpf", &d, "bpf")?;
            Ok(format!("mounted bpffs on {}", d.display()))
        }
        // Append to a file (the agent's configuration).
        "write" => {
            let p = arg(args, 0)?;
            let mut f = std::fs::OpenOptions::new().append(true).open(p)?;
            f.write_all(b"\n# egress-probe was here\n")?;
            Ok(format!("appended to {p}"))
        }
        "signal" => {
            let pid: i32 = arg(args, 0)?.parse().map_err(io::Error::other)?;
            let sig: i32 = arg(args, 1)?.parse().map_err(io::Error::other)?;
            // SAFETY: plain kill(2).
            cvt(unsafe { libc::kill(pid, sig) } as _).map(|_| format!("sent {sig} to {pid}"))
        }
        // Attach to a process (the agent) or read its memory.
        "ptrace" => {
            let pid: i32 = arg(args, 0)?.parse().map_err(io::Error::other)?;
            // SAFETY: PTRACE_ATTACH takes no pointers.
            let attach = cvt(unsafe {
                libc::ptrace(
                    libc::PTRACE_ATTACH,
                    pid,
                    std::ptr::null_mut::<libc::c_void>(),
                    0,
                )
            });
            if attach.is_ok() {
                return Ok(format!("attached to {pid}"));
            }
            let mut mem = std::fs::File::open(format!("/proc/{pid}/mem"))?;
            let mut b = [0u8; 1];
            mem.read(&mut b).map(|_| format!("read /proc/{pid}/mem"))
        }
        // Enter another process's network and mount namespaces.
        "setns" => {
            let pid = arg(args, 0)?;
            let mut entered = Vec::new();
            for ns in ["net", "mnt", "cgroup"] {
                let f = std::fs::File::open(format!("/proc/{pid}/ns/{ns}"))?;
                // SAFETY: setns on an open namespace fd.
                cvt(unsafe { libc::setns(f.as_raw_fd(), 0) } as _)?;
                entered.push(ns);
            }
            Ok(format!("entered {entered:?} of {pid}"))
        }
        // Talk to a unix-socket service (the control API, Docker).
        "unix" => {
            let path = arg(args, 0)?;
            let request = arg(args, 1)?.replace("\\r\\n", "\r\n");
            let mut s = std::os::unix::net::UnixStream::connect(path)?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(3)))?;
            s.write_all(request.as_bytes())?;
            let mut buf = [0u8; 256];
            let n = s.read(&mut buf)?;
            let head = String::from_utf8_lossy(&buf[..n]);
            Ok(format!(
                "answered: {}",
                head.lines().next().unwrap_or_default()
            ))
        }
        // Load a kernel module.
        "module" => {
            let f = std::fs::File::open("/dev/null")?;
            let empty = CString::new("").expect("no NUL");
            // SAFETY: finit_module(fd, "", 0).
            cvt(unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), empty.as_ptr(), 0) })
                .map(|_| "module loaded".to_owned())
        }
        // A user namespace of our own (full capabilities inside it), then a packet socket in the
        // host's network namespace.
        "userns-packet" => {
            // SAFETY: unshare with flags only.
            cvt(unsafe { libc::unshare(libc::CLONE_NEWUSER) } as _)?;
            crate::packet::packet_socket().map(|_| "packet socket in the host netns".to_owned())
        }
        // A user and a network namespace: raw sockets there reach only that namespace.
        "userns-netns-raw" => {
            // SAFETY: unshare with flags only.
            cvt(unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) } as _)?;
            // SAFETY: plain socket(2).
            let fd = cvt(
                unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) } as _,
            )?;
            // SAFETY: closing the fd we just opened.
            unsafe { libc::close(fd as i32) };
            Ok("raw socket in a new netns".to_owned())
        }
        // Who are we, with what.
        "whoami" => {
            let status = std::fs::read_to_string("/proc/self/status")?;
            let pick = |k: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(k))
                    .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
                    .unwrap_or_default()
            };
            Ok(format!(
                "uid {} gid {} CapPrm {} CapEff {} CapBnd {} NoNewPrivs {}",
                pick("Uid:"),
                pick("Gid:"),
                pick("CapPrm:"),
                pick("CapEff:"),
                pick("CapBnd:"),
                pick("NoNewPrivs:")
            ))
        }
        other => Err(io::Error::other(format!("unknown technique {other}"))),
    }
}
