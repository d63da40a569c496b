//! Files in `agent.state_dir`: the directory (0700), and atomic writes that never expose a file
//! with a wider mode than asked, not even for a moment.
//!
//! A write creates a temporary name in the same directory with `O_CREAT|O_EXCL|O_NOFOLLOW` and
//! the final mode given to `open` itself (the umask can only narrow it; no `chmod` after
//! create), writes, `fsync`s, renames over the final name and `fsync`s the directory.
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a state file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "{path} is not a directory owned by this user (uid {uid}); refusing to keep keys there"
    )]
    NotOwned { path: PathBuf, uid: u32 },
    #[error(
        "{path} has mode {mode:04o}; a private key must not be readable by others (chmod 0600)"
    )]
    TooOpen { path: PathBuf, mode: u32 },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Create `dir` (and missing parents) with mode 0700; an existing one must be a real directory
/// owned by us, and is narrowed to 0700.
pub fn ensure_private_dir(dir: &Path) -> Result<(), FileError> {
    if let Some(parent) = dir.parent()
        && !parent.as_os_str().is_empty()
    {
        fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(dir)(e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != uid {
        return Err(FileError::NotOwned {
            path: dir.to_owned(),
            uid,
        });
    }
    if meta.mode() & 0o777 != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err(dir))?;
    }
    Ok(())
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// Write `bytes` to `dir/name` atomically with `mode` (e.g. 0o600 for a key).
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> Result<PathBuf, FileError> {
    let final_path = dir.join(name);
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let write = || -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        // The umask may have narrowed `mode` (the unit's UMask=0077 would make the public
        // certificate unreadable for containers): set exactly `mode`, still under the temporary
        // name. This never widens a key beyond what was asked (0600).
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, &final_path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|e| {
        fs::remove_file(&tmp).ok();
        io_err(&final_path)(e)
    })?;
    Ok(final_path)
}

/// Read a private file: must be a regular file (no symlink) with no group/other bits.
pub fn read_private(path: &Path) -> Result<zeroize::Zeroizing<Vec<u8>>, FileError> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err(path))?;
    let meta = f.metadata().map_err(io_err(path))?;
    if meta.mode() & 0o077 != 0 || !meta.is_file() {
        return Err(FileError::TooOpen {
            path: path.to_owned(),
            mode: meta.mode() & 0o7777,
        });
    }
    let mut out = zeroize::Zeroizing::new(Vec::with_capacity(meta.len() as usize));
    io::Read::read_to_end(&mut &f, &mut out).map_err(io_err(path))?;
    Ok(out)
}
