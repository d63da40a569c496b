//! Kernel feature probes: cgroup2, BTF, BPF LSM, cgroup BPF, nf_tables, unprivileged BPF.

use std::io::ErrorKind;
use std::sync::Arc;

use super::host::{self, KernelConfig};
use super::{Ctx, Outcome, blocking};

/// The kernel config, read once per run (it may be a gzip of a few hundred KiB).
pub(super) async fn config(ctx: &Arc<Ctx>) -> Option<KernelConfig> {
    ctx.kernel_config
        .get_or_init(|| async {
            let paths = ctx.opts.paths.kernel_configs.clone();
            blocking(move || host::kernel_config(&paths))
                .await
                .flatten()
        })
        .await
        .clone()
}

pub(super) async fn cgroup2(ctx: Arc<Ctx>) -> Outcome {
    let path = ctx.opts.paths.mountinfo.clone();
    let Some(res) = blocking(move || crate::mountinfo::mounts(&path)).await else {
        return Outcome::skip("could not read mountinfo", "re-run");
    };
    let mounts = match res {
        Ok(m) => m,
        Err(e) => {
            return Outcome::skip(
                format!("cannot read {}: {e}", ctx.opts.paths.mountinfo.display()),
                "run on the host with /proc mounted",
            );
        }
    };
    let Some(m) = mounts.iter().rev().find(|m| m.fstype == "cgroup2") else {
        return Outcome::fail(
            "no cgroup2 mount: the agent attaches its programs to cgroup2 directories",
            "boot with systemd.unified_cgroup_hierarchy=1 (pure cgroup2), or mount -t cgroup2 none /sys/fs/cgroup",
        );
    };
    let at = m.mount_point.display();
    if m.read_only() {
        return Outcome::warn(
            format!("cgroup2 mounted read-only at {at}: the agent can't create its cgroups"),
            format!("remount read-write: mount -o remount,rw {at}"),
        );
    }
    let layout = if mounts.iter().any(|m| m.fstype == "cgroup") {
        " (hybrid layout with cgroup v1)"
    } else {
        ""
    };
    Outcome::pass(format!("cgroup2 mounted at {at}{layout}"))
}

pub(super) async fn btf(ctx: Arc<Ctx>) -> Outcome {
    let path = ctx.opts.paths.btf_vmlinux.clone();
    match tokio::fs::metadata(&path).await {
        Ok(md) if md.is_file() && md.len() > 0 => Outcome::pass(format!(
            "kernel BTF at {} ({} KiB)",
            path.display(),
            md.len() / 1024
        )),
        Ok(_) => Outcome::fail(
            format!("{} is empty", path.display()),
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        ),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let sysfs = path
                .ancestors()
                .nth(3)
                .is_some_and(|p| p.join("kernel").exists());
            if !sysfs {
                return Outcome::skip(
                    format!("{} not readable (sysfs not mounted?)", path.display()),
                    "mount sysfs on /sys",
                );
            }
            Outcome::fail(
                "no kernel BTF: the agent refuses to load its programs without it (the BPF-LSM hook needs it)",
                "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (the default on current distribution kernels)",
            )
        }
        Err(e) => Outcome::skip(
            format!("cannot stat {}: {e}", path.display()),
            "run as root",
        ),
    }
}

/// Decide BPF-LSM activity from (in order of authority) the active LSM list in securityfs, the
/// `lsm=` boot parameter, and the kernel config's defaults. Pure, for fixture tests.
pub(super) fn bpf_lsm_verdict(
    lsm_file: Option<&str>,
    cmdline: Option<&str>,
    config: Option<&KernelConfig>,
) -> Outcome {
    const FIX: &str = "add bpf to the lsm= boot parameter (e.g. lsm=landlock,lockdown,yama,apparmor,bpf) and reboot";
    let has_bpf = |list: &str| list.trim().split(',').any(|l| l.trim() == "bpf");
    if let Some(list) = lsm_file {
        return if has_bpf(list) {
            Outcome::pass(format!("BPF LSM active (active LSMs: {})", list.trim()))
        } else {
            Outcome::warn(
                format!(
                    "BPF LSM not active (active LSMs: {}): raw/packet sockets aren't blocked by the LSM hook",
                    list.trim()
                ),
                FIX,
            )
        };
    }
    if let Some(cfg) = config
        && cfg.get("CONFIG_BPF_LSM").is_none()
        && cfg.get("CONFIG_BPF_SYSCALL").is_some()
    {
        return Outcome::warn(
            format!(
                "kernel built without CONFIG_BPF_LSM ({})",
                cfg.source.display()
            ),
            "use a kernel with CONFIG_BPF_LSM=y and bpf in lsm=",
        );
    }
    if let Some(list) = cmdline.and_then(|c| host::cmdline_param(c, "lsm")) {
        return if has_bpf(list) {
            Outcome::pass(format!(
                "BPF LSM enabled by the boot parameter lsm={list} (securityfs not mounted to confirm)"
            ))
        } else {
            Outcome::warn(
                format!("boot parameter lsm={list} does not include bpf"),
                FIX,
            )
        };
    }
    if let Some(cfg) = config
        && let Some(list) = cfg.get("CONFIG_LSM")
    {
        return if has_bpf(list) {
            Outcome::pass(format!(
                "BPF LSM enabled by the kernel's default CONFIG_LSM={list} ({}; securityfs not mounted to confirm)",
                cfg.source.display()
            ))
        } else {
            Outcome::warn(
                format!("the kernel's default CONFIG_LSM={list} does not include bpf"),
                FIX,
            )
        };
    }
    Outcome::skip(
        "can't tell whether the BPF LSM is active: securityfs is not mounted and no kernel config was found",
        "mount -t securityfs securityfs /sys/kernel/security, then re-run",
    )
}

pub(super) async fn bpf_lsm(ctx: Arc<Ctx>) -> Outcome {
    let lsm = tokio::fs::read_to_string(&ctx.opts.paths.lsm).await.ok();
    let cmdline = tokio::fs::read_to_string(&ctx.opts.paths.cmdline)
        .await
        .ok();
    let cfg = if lsm.is_none() {
        config(&ctx).await
    } else {
        None
    };
    bpf_lsm_verdict(lsm.as_deref(), cmdline.as_deref(), cfg.as_ref())
}

pub(super) async fn cgroup_bpf(ctx: Arc<Ctx>) -> Outcome {
    const FIX: &str = "use a kernel built with CONFIG_CGROUP_BPF=y";
    if let Some(cfg) = config(&ctx).await {
        return if cfg.enabled("CONFIG_CGROUP_BPF") {
            Outcome::pass(format!("CONFIG_CGROUP_BPF=y ({})", cfg.source.display()))
        } else {
            Outcome::fail(
                format!(
                    "kernel built without CONFIG_CGROUP_BPF ({})",
                    cfg.source.display()
                ),
                FIX,
            )
        };
    }
    // No config: the cgroup BPF run functions only exist with CONFIG_CGROUP_BPF.
    let path = ctx.opts.paths.kallsyms.clone();
    match blocking(move || host::kallsyms_has(&path, "__cgroup_bpf_run_filter_sock_addr"))
        .await
        .flatten()
    {
        Some(true) => Outcome::pass("cgroup BPF hooks present in the kernel symbols"),
        Some(false) => Outcome::fail("no cgroup BPF hooks in the kernel symbols", FIX),
        None => Outcome::skip(
            "can't tell: no kernel config and /proc/kallsyms unreadable",
            "provide /boot/config-$(uname -r) or /proc/config.gz (CONFIG_IKCONFIG_PROC)",
        ),
    }
}

/// How nf_tables is present. Used to avoid loading the module as a side effect of probing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NfTables {
    /// Loaded module or built in: querying it changes nothing.
    Present(&'static str),
    /// Available as a module that is not loaded: there is no ruleset yet.
    ModuleNotLoaded,
    Absent,
    Unknown,
}

pub(super) async fn nf_tables_state(ctx: &Arc<Ctx>) -> NfTables {
    let paths = &ctx.opts.paths;
    if tokio::fs::metadata(paths.sys_module.join("nf_tables"))
        .await
        .is_ok()
    {
        return NfTables::Present("module loaded");
    }
    let builtin = tokio::fs::read_to_string(paths.modules_dir.join("modules.builtin"))
        .await
        .ok();
    if builtin
        .as_deref()
        .is_some_and(|b| b.lines().any(|l| l.ends_with("/nf_tables.ko")))
    {
        return NfTables::Present("built in");
    }
    if let Some(cfg) = config(ctx).await {
        return match cfg.get("CONFIG_NF_TABLES") {
            Some("y") => NfTables::Present("built in"),
            Some("m") => NfTables::ModuleNotLoaded,
            _ => NfTables::Absent,
        };
    }
    let dep = tokio::fs::read_to_string(paths.modules_dir.join("modules.dep"))
        .await
        .ok();
    match (builtin, dep) {
        (_, Some(dep)) if dep.lines().any(|l| l.contains("/nf_tables.ko")) => {
            NfTables::ModuleNotLoaded
        }
        (Some(_), Some(_)) => NfTables::Absent,
        _ => NfTables::Unknown,
    }
}

pub(super) async fn nf_tables(ctx: Arc<Ctx>) -> Outcome {
    match nf_tables_state(&ctx).await {
        NfTables::Present(how) => Outcome::pass(format!("nf_tables {how}")),
        NfTables::ModuleNotLoaded => {
            Outcome::pass("nf_tables available as a module (loaded on first use)")
        }
        NfTables::Absent => Outcome::fail(
            "kernel has no nf_tables: the host-side nftables layer can't be installed",
            "use a kernel with CONFIG_NF_TABLES and CONFIG_NF_TABLES_INET",
        ),
        NfTables::Unknown => Outcome::skip(
            "can't tell: nf_tables not loaded and no kernel config or module list found",
            "provide /boot/config-$(uname -r) or /proc/config.gz, or run `nft list tables` as root",
        ),
    }
}

pub(super) async fn unprivileged_bpf(ctx: Arc<Ctx>) -> Outcome {
    match host::sysctl(
        &ctx.opts.paths.sysctl_dir,
        "kernel/unprivileged_bpf_disabled",
    ) {
        Ok(v) if v == "1" || v == "2" => Outcome::pass(format!(
            "unprivileged BPF disabled (kernel.unprivileged_bpf_disabled={v})"
        )),
        Ok(v) => Outcome::warn(
            format!("unprivileged BPF allowed (kernel.unprivileged_bpf_disabled={v})"),
            "sysctl -w kernel.unprivileged_bpf_disabled=2 (and persist it in /etc/sysctl.d/)",
        ),
        Err(e) => Outcome::skip(
            format!("cannot read kernel.unprivileged_bpf_disabled: {e}"),
            "run on the host with /proc mounted",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Status;
    use super::*;

    #[test]
    fn bpf_lsm_sources_in_order() {
        let cfg_on = KernelConfig::parse(
            "c".into(),
            "CONFIG_BPF_SYSCALL=y\nCONFIG_BPF_LSM=y\nCONFIG_LSM=\"yama,bpf\"\n",
        );
        let cfg_def_off = KernelConfig::parse(
            "c".into(),
            "CONFIG_BPF_SYSCALL=y\nCONFIG_BPF_LSM=y\nCONFIG_LSM=\"yama\"\n",
        );
        let cfg_none = KernelConfig::parse("c".into(), "CONFIG_BPF_SYSCALL=y\n");
        assert_eq!(
            bpf_lsm_verdict(Some("lockdown,bpf\n"), None, None).status,
            Status::Pass
        );
        assert_eq!(
            bpf_lsm_verdict(Some("lockdown,yama\n"), Some("lsm=bpf"), Some(&cfg_on)).status,
            Status::Warn
        );
        assert_eq!(
            bpf_lsm_verdict(None, Some("ro lsm=yama,bpf"), Some(&cfg_def_off)).status,
            Status::Pass
        );
        assert_eq!(
            bpf_lsm_verdict(None, Some("ro lsm=yama"), Some(&cfg_on)).status,
            Status::Warn
        );
        assert_eq!(
            bpf_lsm_verdict(None, Some("ro"), Some(&cfg_on)).status,
            Status::Pass
        );
        assert_eq!(
            bpf_lsm_verdict(None, Some("ro"), Some(&cfg_def_off)).status,
            Status::Warn
        );
        assert_eq!(
            bpf_lsm_verdict(None, Some("lsm=bpf"), Some(&cfg_none)).status,
            Status::Warn
        );
        assert_eq!(bpf_lsm_verdict(None, Some("ro"), None).status, Status::Skip);
    }
}
