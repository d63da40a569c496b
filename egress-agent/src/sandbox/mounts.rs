//! The command's view of the file system (run by the sandbox's init, in the new mount namespace).
//!
//! In order:
//! 1. nothing propagates back to the host (`/` recursively slave);
//! 2. a root command: the [`Spec::writable`] paths are bound onto themselves, then every other
//!    mount is made read-only (flags such as `nosuid`/`nodev`/`noexec` are kept);
//! 3. a private, empty `/run` (and `/var/run` when it is a directory of its own): the control
//!    API, the loader lock and every runtime socket — Docker, containerd, D-Bus, systemd — are out
//!    of reach; [`Spec::run_files`] are written into it and [`Spec::run_copies`] copied (before
//!    step 8 hides their sources);
//! 4. a private `/dev`: `null zero full random urandom tty`, a new devpts instance and its own
//!    `shm` (no block devices, no other terminals' ptys);
//! 5. a fresh `/proc` for the new pid namespace, with `/proc/sys` and `/proc/sysrq-trigger`
//!    read-only;
//! 6. a fresh read-only cgroup2 mount in the new cgroup namespace: it shows only the command's
//!    own cgroup tree;
//! 7. [`Spec::read_only`] paths bound read-only (the agent's configuration);
//! 8. every bpffs mount and [`Spec::hide`] path covered by an empty read-only tmpfs (mode 000);
//! 9. every [`Spec::secrets`] path covered the same way, a file by an empty read-only file (mode
//!    000). The cover goes where the path resolves (a mount follows symbolic links). A path that
//!    no longer resolves (`ENOENT`, `ENOTDIR`: gone, or under a cover already) has nothing to
//!    read; any other error, or a cover that can't be mounted, fails the setup: the command is
//!    not run.
//!
//! Mounts a command copies into a namespace of its own (after creating a user namespace) are
//! locked to these: it can't unmount a cover or remount a read-only mount writable.
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};
use nix::sys::statvfs::{FsFlags, statvfs};

use super::{SandboxError, Spec};
use crate::mountinfo;

const NONE: Option<&str> = None;

/// Build the view; any failure aborts before the command runs.
pub fn build(spec: &Spec) -> Result<(), SandboxError> {
    let root = Path::new("/");
    mount(NONE, root, NONE, MsFlags::MS_REC | MsFlags::MS_SLAVE, NONE).map_err(
        SandboxError::path("making mount propagation slave at", root),
    )?;
    let before = read_mounts()?;
    if spec.user.is_root() {
        for w in &spec.writable {
            bind(w, w)?;
        }
        read_only_except(&spec.writable)?;
    }
    private_tmpfs(Path::new("/run"), "mode=0755,size=16m")?;
    let var_run = Path::new("/var/run");
    if fs::symlink_metadata(var_run).is_ok_and(|m| m.is_dir()) {
        private_tmpfs(var_run, "mode=0755,size=16m")?;
    }
    for (rel, contents) in &spec.run_files {
        write_run_file(rel, contents)?;
    }
    for (rel, source) in &spec.run_copies {
        let contents = fs::read(source).map_err(io_err("reading", source))?;
        write_run_file(rel, &contents)?;
    }
    private_dev()?;
    let proc = Path::new("/proc");
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("proc"), proc, Some("proc"), flags, NONE)
        .map_err(SandboxError::path("mounting a fresh proc on", proc))?;
    for p in ["/proc/sys", "/proc/sysrq-trigger"].map(Path::new) {
        if p.exists() {
            bind_read_only(p)?;
        }
    }
    if let Some(cg) = before.iter().find(|m| m.fstype == "cgroup2") {
        // The kernel refuses the same filesystem directly on its own mount point: stack the new
        // view on a tmpfs. cgroup2 has one superblock (its flags are the mount's), so read-only
        // is set per mount afterwards.
        private_tmpfs(&cg.mount_point, "mode=0755,size=4k")?;
        mount(
            Some("cgroup2"),
            &cg.mount_point,
            Some("cgroup2"),
            flags,
            NONE,
        )
        .map_err(SandboxError::path(
            "mounting the command's cgroup2 view on",
            &cg.mount_point,
        ))?;
        remount_read_only(&cg.mount_point)
            .map_err(SandboxError::path("making read-only", &cg.mount_point))?;
    }
    for p in spec.read_only.iter().filter(|p| p.exists()) {
        bind_read_only(p)?;
    }
    let bpffs = before
        .iter()
        .filter(|m| m.fstype == "bpf")
        .map(|m| m.mount_point.clone());
    let mut covered: Vec<PathBuf> = Vec::new();
    for p in bpffs.chain(spec.hide.iter().cloned()) {
        if covered.iter().any(|c| p.starts_with(c)) || fs::symlink_metadata(&p).is_err() {
            continue;
        }
        cover(&p)?;
        covered.push(p);
    }
    for p in &spec.secrets {
        if covered.iter().any(|c| p.starts_with(c)) {
            continue;
        }
        let hide_err = |e: SandboxError| SandboxError::Secret {
            path: p.clone(),
            source: Box::new(e),
        };
        match fs::metadata(p) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                continue;
            }
            Err(e) => return Err(hide_err(io_err("resolving", p)(e))),
        }
        cover(p).map_err(hide_err)?;
        covered.push(p.clone());
    }
    Ok(())
}

fn read_mounts() -> Result<Vec<mountinfo::Mount>, SandboxError> {
    let p = Path::new("/proc/self/mountinfo");
    mountinfo::mounts(p).map_err(|source| SandboxError::Path {
        what: "reading",
        path: p.to_owned(),
        source,
    })
}

/// The per-mount flags of `path`'s mount that a bind remount must repeat (leaving one out would
/// clear it: a remount without `MS_NOSUID` turns `nosuid` off).
fn kept_flags(path: &Path) -> Result<MsFlags, SandboxError> {
    let st = statvfs(path).map_err(SandboxError::path("statvfs", path))?;
    let f = st.flags();
    let mut out = MsFlags::empty();
    for (fs_flag, ms) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if f.contains(fs_flag) {
            out |= ms;
        }
    }
    Ok(out)
}

fn remount_read_only(path: &Path) -> Result<(), nix::errno::Errno> {
    let kept = kept_flags(path).map_err(|_| nix::errno::Errno::ENOENT)?;
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | kept;
    mount(NONE, path, NONE, flags, NONE)
}

fn bind(src: &Path, dst: &Path) -> Result<(), SandboxError> {
    mount(
        Some(src),
        dst,
        NONE,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        NONE,
    )
    .map_err(SandboxError::path("bind-mounting", dst))
}

fn bind_read_only(path: &Path) -> Result<(), SandboxError> {
    bind(path, path)?;
    remount_read_only(path).map_err(SandboxError::path("making read-only", path))
}

/// Make every mount read-only but those at or below `keep`. A mount point that is no longer
/// reachable by its path (shadowed by a later mount) is skipped: nothing can reach it either.
fn read_only_except(keep: &[PathBuf]) -> Result<(), SandboxError> {
    let mut points: Vec<PathBuf> = read_mounts()?.into_iter().map(|m| m.mount_point).collect();
    points.sort();
    points.dedup();
    for mp in points {
        if keep.iter().any(|k| mp.starts_with(k)) {
            continue;
        }
        match remount_read_only(&mp) {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(SandboxError::path("making read-only", &mp)(e)),
        }
    }
    Ok(())
}

fn private_tmpfs(path: &Path, options: &str) -> Result<(), SandboxError> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(Some("tmpfs"), path, Some("tmpfs"), flags, Some(options))
        .map_err(SandboxError::path("mounting a private tmpfs on", path))
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> SandboxError + 'a {
    move |source| SandboxError::Path {
        what,
        path: path.to_owned(),
        source,
    }
}

fn write_run_file(rel: &Path, contents: &[u8]) -> Result<(), SandboxError> {
    if rel.is_absolute() || rel.components().any(|c| c.as_os_str() == "..") {
        return Err(SandboxError::Invalid(format!(
            "run file {} must be a relative path below /run",
            rel.display()
        )));
    }
    let path = Path::new("/run").join(rel);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    }
    fs::write(&path, contents).map_err(io_err("writing", &path))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).map_err(io_err("chmod", &path))
}

/// Cover `path` with something empty and read-only: a tmpfs of mode 000 for a directory, an
/// empty unreadable file for anything else (a socket, a file).
fn cover(path: &Path) -> Result<(), SandboxError> {
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    if fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return mount(
            Some("tmpfs"),
            path,
            Some("tmpfs"),
            ro,
            Some("mode=000,size=4k"),
        )
        .map_err(SandboxError::path("covering", path));
    }
    let empty = Path::new("/run/.egress-empty");
    if !empty.exists() {
        fs::write(empty, b"").map_err(io_err("creating", empty))?;
        fs::set_permissions(empty, fs::Permissions::from_mode(0o000))
            .map_err(io_err("chmod", empty))?;
    }
    bind(empty, path)?;
    remount_read_only(path).map_err(SandboxError::path("making read-only", path))
}

/// A private `/dev`, built in the private `/run` and moved over `/dev`.
fn private_dev() -> Result<(), SandboxError> {
    let stage = Path::new("/run/.egress-dev");
    fs::create_dir_all(stage).map_err(io_err("creating", stage))?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
    mount(
        Some("tmpfs"),
        stage,
        Some("tmpfs"),
        flags,
        Some("mode=0755,size=64k"),
    )
    .map_err(SandboxError::path("mounting a private /dev on", stage))?;
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        let host = Path::new("/dev").join(name);
        if !host.exists() {
            continue;
        }
        let node = stage.join(name);
        fs::write(&node, b"").map_err(io_err("creating", &node))?;
        bind(&host, &node)?;
    }
    let pts = stage.join("pts");
    fs::create_dir(&pts).map_err(io_err("creating", &pts))?;
    let tty_gid = nix::unistd::Group::from_name("tty")
        .ok()
        .flatten()
        .map_or(5, |g| g.gid.as_raw());
    let opts = format!("newinstance,ptmxmode=0666,mode=0620,gid={tty_gid}");
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        flags,
        Some(opts.as_str()),
    )
    .map_err(SandboxError::path(
        "mounting a new devpts instance on",
        &pts,
    ))?;
    let shm = stage.join("shm");
    fs::create_dir(&shm).map_err(io_err("creating", &shm))?;
    let shm_flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some("tmpfs"),
        &shm,
        Some("tmpfs"),
        shm_flags,
        Some("mode=1777"),
    )
    .map_err(SandboxError::path("mounting a private tmpfs on", &shm))?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let at = stage.join(link);
        symlink(target, &at).map_err(io_err("creating", &at))?;
    }
    mount(NONE, stage, NONE, MsFlags::MS_PRIVATE, NONE)
        .map_err(SandboxError::path("making private", stage))?;
    let dev = Path::new("/dev");
    mount(Some(stage), dev, NONE, MsFlags::MS_MOVE, NONE)
        .map_err(SandboxError::path("moving the private /dev onto", dev))
}
