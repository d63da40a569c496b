//! Readers for the host files the probes look at. Pure parsing is split from I/O so fixtures can test it.

use std::collections::HashMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};


/// Every host file or directory the doctor reads. [`HostPaths::default`] is the real host;
/// [`HostPaths::under`] re-roots them all (fixtures in tests).
#[derive(Clone, Debug)]
pub struct HostPaths {
    /// `/proc/self/mountinfo`.
    pub mountinfo: PathBuf,
    /// `/sys/kernel/security/lsm` (only present when securityfs is mounted).
    pub lsm: PathBuf,
    /// `/proc/cmdline`.
    pub cmdline: PathBuf,
    /// Kernel configs to try, in order (`/proc/config.gz`, `/boot/config-<release>`); `.gz` is inflated.
    pub kernel_configs: Vec<PathBuf>,
    /// `/proc/kallsyms` (symbol names are visible without root; addresses are not needed).
    pub kallsyms: PathBuf,
    /// `/sys/kernel/btf/vmlinux`.
    pub btf_vmlinux: PathBuf,
    /// `/sys/module` (a loaded module, or a built-in one with parameters, has a directory here).
    pub sys_module: PathBuf,
    /// `/lib/modules/<release>` (`modules.builtin`, `modules.dep`).
    pub modules_dir: PathBuf,
    /// `/proc` (process scan for the agent's listening sockets).
    pub proc_dir: PathBuf,
    /// `/proc/sys` (sysctls).
    pub sysctl_dir: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        HostPaths::under(Path::new("/"), &release)
    }
}

impl HostPaths {
    /// All paths re-rooted under `root`, for kernel release `release`.
    pub fn under(root: &Path, release: &str) -> Self {
        let p = |s: &str| root.join(s);
        let mut kernel_configs = vec![p("proc/config.gz")];
        if !release.is_empty() {
            kernel_configs.push(p(&format!("boot/config-{release}")));
        }
        HostPaths {
            mountinfo: p("proc/self/mountinfo"),
            lsm: p("sys/kernel/security/lsm"),
            cmdline: p("proc/cmdline"),
            kernel_configs,
            kallsyms: p("proc/kallsyms"),
            btf_vmlinux: p("sys/kernel/btf/vmlinux"),
            sys_module: p("sys/module"),
            modules_dir: p(&format!("lib/modules/{release}")),
            proc_dir: p("proc"),
            sysctl_dir: p("proc/sys"),
        }
    }
}

/// A parsed kernel config: `CONFIG_X` → value (`y`, `m`, `"..."`); "is not set" lines are absent.
#[derive(Clone, Debug, Default)]
pub struct KernelConfig {
    pub source: PathBuf,
    pub values: HashMap<String, String>,
}

impl KernelConfig {
    pub fn parse(source: PathBuf, text: &str) -> Self {
        let values = text
            .lines()
            .filter_map(|l| {
                let (k, v) = l.trim().split_once('=')?;
                k.starts_with("CONFIG_")
                    .then(|| (k.to_owned(), v.trim_matches('"').to_owned()))
            })
            .collect();
        KernelConfig { source, values }
    }

    /// `Some(true)` for `=y`/`=m`, `Some(false)` when absent (not set).
    pub fn enabled(&self, key: &str) -> bool {
        matches!(self.values.get(key).map(String::as_str), Some("y" | "m"))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }
}

/// The first readable kernel config among `paths` (gzip-inflated when the name ends in `.gz`).
pub fn kernel_config(paths: &[PathBuf]) -> Option<KernelConfig> {
    for p in paths {
        let Ok(file) = std::fs::File::open(p) else {
            continue;
        };
        // Cap what we read: a real config is ~300 KiB.
        let limit = 16 << 20;
        let mut text = String::new();
        let ok = if p.extension().is_some_and(|e| e == "gz") {
            flate2::read::GzDecoder::new(file)
                .take(limit)
                .read_to_string(&mut text)
                .is_ok()
        } else {
            file.take(limit).read_to_string(&mut text).is_ok()
        };
        if ok && text.contains("CONFIG_") {
            return Some(KernelConfig::parse(p.clone(), &text));
        }
    }
    None
}

/// Whether `/proc/kallsyms`-format text at `path` names `symbol`. `None` if unreadable.
pub fn kallsyms_has(path: &Path, symbol: &str) -> Option<bool> {
    let text = std::fs::read_to_string(path).ok()?;
    if text.is_empty() {
        return None;
    }
    Some(
        text.lines()
            .any(|l| l.split_whitespace().nth(2) == Some(symbol)),
    )
}

/// Read a sysctl under `sysctl_dir` (e.g. `net/ipv4/ip_forward`), trimmed.
pub fn sysctl(sysctl_dir: &Path, name: &str) -> io::Result<String> {
    Ok(std::fs::read_to_string(sysctl_dir.join(name))?
        .trim()
        .to_owned())
}

/// Value of the last `key=` parameter on a kernel command line.
pub fn cmdline_param<'a>(cmdline: &'a str, key: &str) -> Option<&'a str> {
    cmdline
        .split_whitespace()
        .take_while(|w| *w != "--")
        .filter_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .last()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
25 1 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
40 25 0:33 / /sys/fs/bpf rw,relatime - bpf bpf rw
41 1 0:34 / /mnt/with\\040space rw - ext4 /dev/vda1 rw
";

    #[test]
    fn parses_mountinfo() {
        let m = crate::mountinfo::parse(MOUNTINFO);
        assert_eq!(m.len(), 5);
        let cg2 = m.iter().find(|m| m.fstype == "cgroup2").expect("cgroup2");
        assert_eq!(cg2.mount_point, Path::new("/sys/fs/cgroup/unified"));
        assert!(!cg2.read_only());
        assert_eq!(m[4].mount_point, Path::new("/mnt/with space"));
        let bpf = crate::mountinfo::mount_of(&m, Path::new("/sys/fs/bpf/egress-agent")).expect("mount");
        assert_eq!(bpf.fstype, "bpf");
        assert_eq!(
            crate::mountinfo::mount_of(&m, Path::new("/sys/kernel")).map(|m| m.fstype.as_str()),
            Some("sysfs")
        );
    }

    #[test]
    fn parses_kernel_config_and_cmdline() {
        let c = KernelConfig::parse(
            "x".into(),
            "CONFIG_BPF_LSM=y\n# CONFIG_FOO is not set\nCONFIG_LSM=\"yama,bpf\"\nCONFIG_NF_TABLES=m\n",
        );
        assert!(c.enabled("CONFIG_BPF_LSM"));
        assert!(c.enabled("CONFIG_NF_TABLES"));
        assert!(!c.enabled("CONFIG_FOO"));
        assert_eq!(c.get("CONFIG_LSM"), Some("yama,bpf"));
        assert_eq!(
            cmdline_param("quiet lsm=a,b lsm=c,bpf -- lsm=x", "lsm"),
            Some("c,bpf")
        );
        assert_eq!(cmdline_param("quiet", "lsm"), None);
    }
}
