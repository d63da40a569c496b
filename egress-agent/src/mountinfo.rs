//! `/proc/self/mountinfo` (proc(5)): one parser for cgroup discovery, the doctor and the exec
//! sandbox.
use std::io;
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub root: String,
    pub mount_point: PathBuf,
    pub options: String,
    pub fstype: String,
    pub source: String,
    pub super_options: String,
}

impl Mount {
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// Parse mountinfo (proc(5)): `id parent maj:min root mount_point options [optional...] - fstype source super`.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            if l.len() < 6 || r.len() < 2 {
                return None;
            }
            Some(Mount {
                root: unescape(l[3]),
                mount_point: PathBuf::from(unescape(l[4])),
                options: l[5].to_owned(),
                fstype: r[0].to_owned(),
                source: unescape(r[1]),
                super_options: r.get(2).copied().unwrap_or_default().to_owned(),
            })
        })
        .collect()
}

/// Read and parse mountinfo.
pub fn mounts(path: &Path) -> io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string(path)?))
}

/// The mount that holds `path` (longest mount point that is a prefix of it), if any.
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    // Later mounts on the same point shadow earlier ones: iterate in order and keep the last best.
    let mut best: Option<&Mount> = None;
    for m in mounts {
        if path.starts_with(&m.mount_point)
            && best
                .is_none_or(|b| m.mount_point.as_os_str().len() >= b.mount_point.as_os_str().len())
        {
            best = Some(m);
        }
    }
    best
}


/// Undo mountinfo's octal escapes (space, tab, newline and backslash appear as `\ooo`). Anything
/// that is not exactly three octal digits of a byte value stays as it is.
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = b.get(i + 1..i + 4).and_then(|d| {
            d.iter()
                .all(|c| (b'0'..=b'7').contains(c))
                .then(|| d.iter().fold(0u16, |v, c| v * 8 + u16::from(c - b'0')))
                .and_then(|v| u8::try_from(v).ok())
        });
        match code {
            Some(v) if b[i] == b'\\' => {
                out.push(v);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
