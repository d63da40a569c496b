//! Idempotent machine setup: everything a fresh machine of this project's kind lacks.
//!
//! - Debian packages (build: libnftnl/libmnl/pkg-config; runtime and tests: nftables, iproute2,
//!   docker.io, busybox-static; benchmark peers: squid-openssl, tinyproxy; unit check:
//!   systemd-analyze; the interception tests' clients: curl, python3, nodejs; the CRI harness:
//!   containerd, runc, containernetworking-plugins, protobuf-compiler; the real-client matrix:
//!   python3-pip, git, golang-go, dpkg-dev, and Debian's npm where nodejs has none).
//! - mitmproxy (PyPI, pinned) in its own venv: the interception benchmark's second peer.
//! - kubernetes-validate (PyPI, pinned) in its own venv: offline schema validation of
//!   `deploy/kubernetes/` by `cargo xtask test`.
//! - `rust-src` for the nightly toolchain (the eBPF object is built with `-Z build-std=core`).
//! - bpf-linker 0.13, built against the nightly toolchain's own libLLVM with an rpath (a plain
//!   `cargo install bpf-linker` can't find `-lLLVM` here).
//! - bpffs mounted at /sys/fs/bpf.
//!
//! Each step checks first and does nothing when already satisfied.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

/// Debian packages the build, the tests and the benchmark need.
const APT_PACKAGES: &[&str] = &[
    "pkg-config",
    "libnftnl-dev",
    "libmnl-dev",
    "nftables",
    "iproute2",
    "docker.io",
    "busybox-static",
    // squid with OpenSSL (ssl-bump: the interception benchmark's peer); replaces `squid`.
    "squid-openssl",
    "tinyproxy",
    "systemd",
    "libcap2-bin",
    // export tests: a private rsyslogd receives the RFC 5424 syslog export
    "rsyslog",
    // Real clients of the interception tests, and the venv mitmproxy is installed into.
    "curl",
    "python3",
    "python3-venv",
    "nodejs",
    // DNS responder tests and dns-bench: dnsmasq as the recording upstream and the peer,
    // dig as the client.
    "dnsmasq-base",
    "bind9-dnsutils",
    // The status page test: headless Chromium renders the page (driven over its DevTools
    // protocol by node), and takes the screenshot in docs/.
    "chromium",
    // `cargo xtask image` puts the CA bundle into the agent's image (upstream verification of
    // intercepted hosts) and `ip` (iproute2, above), with the libraries `ldd` lists.
    "ca-certificates",
    // The CRI harness (tests/src/containerd.rs) plays the kubelet against a private containerd
    // 1.6 (CRI plugin built in) with runc and the CNI bridge/host-local plugins (installed to
    // /usr/lib/cni); protoc builds the CRI client (k8s-cri, tonic). The packaged containerd
    // service is never started (policy-rc.d below): tests start private instances.
    "containerd",
    "runc",
    "containernetworking-plugins",
    "protobuf-compiler",
    // The real-client matrix (tests/tests/real_clients.rs) runs Debian's clients against local
    // registries it builds: pip (Debian's python3), git (clone and push through `git
    // http-backend`), Go 1.19 (a GOPROXY module proxy), and dpkg-scanpackages for the apt
    // repository (apt-get itself is always there). npm comes with nodejs (see `npm()`), cargo
    // with the toolchain.
    "python3-pip",
    "git",
    "golang-go",
    "dpkg-dev",
];

/// mitmproxy (PyPI, pinned) for the interception benchmark, in a venv of its own.
pub const MITMPROXY_VERSION: &str = "11.0.2";
pub const MITMPROXY_VENV: &str = "/opt/egress-bench/mitmproxy-11.0.2";

/// kubernetes-validate (PyPI, pinned; it carries the Kubernetes JSON schemas, so validation is
/// offline) for the manifests in deploy/kubernetes, in a venv of its own.
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";
pub const KUBERNETES_VALIDATE_VENV: &str = "/opt/egress-tools/kubernetes-validate-1.37.0";

const BPF_LINKER_VERSION: &str = "0.13.0";

/// Runs every setup step.
pub fn run() -> Result<()> {
    apt_packages()?;
    npm()?;
    nightly_rust_src()?;
    bpf_linker()?;
    bpffs()?;
    mitmproxy()?;
    kubernetes_validate()?;
    eprintln!("xtask setup: done");
    Ok(())
}

/// Whether a quick look says setup is complete (used by the other tasks to decide to run it).
pub fn needed() -> bool {
    missing_packages().map(|m| !m.is_empty()).unwrap_or(true)
        || !npm_ok()
        || !bpf_linker_ok()
        || !rust_src_installed().unwrap_or(false)
        || !bpffs_mounted()
        || !mitmproxy_ok()
        || !kubernetes_validate_ok()
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn missing_packages() -> Result<Vec<&'static str>> {
    let mut missing = Vec::new();
    for pkg in APT_PACKAGES {
        let out = Command::new("dpkg-query")
            .args(["-W", "-f=${Status}", pkg])
            .output()
            .context("running dpkg-query (is this a Debian-based machine?)")?;
        if !String::from_utf8_lossy(&out.stdout).contains("install ok installed") {
            missing.push(*pkg);
        }
    }
    Ok(missing)
}

fn apt_packages() -> Result<()> {
    let missing = missing_packages()?;
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("xtask setup: packages {missing:?} are missing and installing them needs root");
    }
    eprintln!("xtask setup: installing {missing:?}");
    // Package scripts must not start services (dockerd, containerd, squid, tinyproxy) on the
    // host: tests start private instances of their own. policy-rc.d exit 101 = "action
    // forbidden".
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let created_policy = !policy.exists();
    if created_policy {
        std::fs::write(
            policy,
            "#!/bin/sh\n# written by cargo xtask setup\nexit 101\n",
        )?;
        sh("chmod", &["+x", "/usr/sbin/policy-rc.d"])?;
    }
    let result = (|| {
        sh("apt-get", &["update", "-qq"])?;
        let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
        args.extend(missing.iter().copied());
        Command::new("apt-get")
            .args(&args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get install")?
            .success()
            .then_some(())
            .context("apt-get install failed")
    })();
    if created_policy {
        std::fs::remove_file(policy).ok();
    }
    result
}

fn npm_ok() -> bool {
    Command::new("npm")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// npm for the real-client matrix. NodeSource's nodejs (this machine kind's) ships it; Debian's
/// nodejs does not, and Debian's `npm` package would conflict with NodeSource's: install it only
/// when there is no `npm` at all.
fn npm() -> Result<()> {
    if npm_ok() {
        return Ok(());
    }
    if !is_root() {
        bail!("xtask setup: npm is missing and installing it needs root");
    }
    eprintln!("xtask setup: installing Debian's npm");
    Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends", "npm"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get install npm")?
        .success()
        .then_some(())
        .context("apt-get install npm failed")
}

fn mitmproxy_ok() -> bool {
    Command::new(format!("{MITMPROXY_VENV}/bin/mitmdump"))
        .arg("--version")
        .output()
        .is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(MITMPROXY_VERSION)
        })
}

/// `python3 -m venv` + `pip install mitmproxy==<pinned>` (Debian's python3).
fn mitmproxy() -> Result<()> {
    if mitmproxy_ok() {
        return Ok(());
    }
    eprintln!("xtask setup: installing mitmproxy {MITMPROXY_VERSION} into {MITMPROXY_VENV}");
    sh("/usr/bin/python3", &["-m", "venv", MITMPROXY_VENV])?;
    sh(
        &format!("{MITMPROXY_VENV}/bin/pip"),
        &[
            "install",
            "-q",
            "--disable-pip-version-check",
            &format!("mitmproxy=={MITMPROXY_VERSION}"),
        ],
    )
}

fn kubernetes_validate_ok() -> bool {
    Command::new(format!(
        "{KUBERNETES_VALIDATE_VENV}/bin/kubernetes-validate"
    ))
    .arg("--version")
    .output()
    .is_ok_and(|o| {
        o.status.success()
            && String::from_utf8_lossy(&o.stdout).contains(KUBERNETES_VALIDATE_VERSION)
    })
}

/// `python3 -m venv` + `pip install kubernetes-validate==<pinned>`.
fn kubernetes_validate() -> Result<()> {
    if kubernetes_validate_ok() {
        return Ok(());
    }
    eprintln!(
        "xtask setup: installing kubernetes-validate {KUBERNETES_VALIDATE_VERSION} into {KUBERNETES_VALIDATE_VENV}"
    );
    sh(
        "/usr/bin/python3",
        &["-m", "venv", KUBERNETES_VALIDATE_VENV],
    )?;
    sh(
        &format!("{KUBERNETES_VALIDATE_VENV}/bin/pip"),
        &[
            "install",
            "-q",
            "--disable-pip-version-check",
            &format!("kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}"),
        ],
    )
}

fn rust_src_installed() -> Result<bool> {
    let out = Command::new("rustup")
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .context("running rustup (the nightly toolchain is needed for the eBPF build)")?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with("rust-src")))
}

fn nightly_rust_src() -> Result<()> {
    if rust_src_installed()? {
        return Ok(());
    }
    eprintln!("xtask setup: adding rust-src to the nightly toolchain");
    sh(
        "rustup",
        &["component", "add", "rust-src", "--toolchain", "nightly"],
    )
}

fn bpf_linker_ok() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .map(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION)
        })
        .unwrap_or(false)
}

fn bpf_linker() -> Result<()> {
    if bpf_linker_ok() {
        return Ok(());
    }
    let sysroot = capture("rustc", &["+nightly", "--print", "sysroot"])?;
    let sysroot = PathBuf::from(sysroot.trim());
    let verbose = capture("rustc", &["+nightly", "-vV"])?;
    let llvm_major = verbose
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("`rustc +nightly -vV` printed no LLVM version")?
        .to_owned();
    let lib_dir = sysroot.join("lib");
    let libllvm = std::fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM") && n.contains(".so"))
        })
        .with_context(|| {
            format!(
                "no libLLVM shared library in {} (is the nightly toolchain complete?)",
                lib_dir.display()
            )
        })?;
    // bpf-linker's build looks for `<LLVM_PREFIX>/lib/libLLVM.so`.
    let prefix = workspace_root().join("target/xtask/llvm-prefix");
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    std::fs::remove_file(&link).ok();
    std::os::unix::fs::symlink(&libllvm, &link)
        .with_context(|| format!("symlinking {}", link.display()))?;
    eprintln!(
        "xtask setup: building bpf-linker {BPF_LINKER_VERSION} against {} (about a minute)",
        libllvm.display()
    );
    let status = Command::new("cargo")
        .args([
            "+nightly",
            "install",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--force",
            "--no-default-features",
            "--features",
            &format!("llvm-{llvm_major}"),
        ])
        .env("LLVM_PREFIX", &prefix)
        .env(
            "RUSTFLAGS",
            format!("-C link-arg=-Wl,-rpath,{}", lib_dir.display()),
        )
        .status()
        .context("running cargo install bpf-linker")?;
    if !status.success() || !bpf_linker_ok() {
        bail!("bpf-linker {BPF_LINKER_VERSION} did not install (see the cargo output above)");
    }
    Ok(())
}

fn bpffs_mounted() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| {
            m.lines().any(|l| {
                let mut parts = l.split(" - ");
                let left = parts.next().unwrap_or("");
                let right = parts.next().unwrap_or("");
                left.split_whitespace().nth(4) == Some("/sys/fs/bpf")
                    && right.split_whitespace().next() == Some("bpf")
            })
        })
        .unwrap_or(false)
}

fn bpffs() -> Result<()> {
    if bpffs_mounted() {
        return Ok(());
    }
    if !is_root() {
        eprintln!("xtask setup: /sys/fs/bpf is not a bpffs and mounting it needs root; skipped");
        return Ok(());
    }
    std::fs::create_dir_all("/sys/fs/bpf").ok();
    sh("mount", &["-t", "bpf", "bpf", "/sys/fs/bpf"])
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

pub fn sh(program: &str, args: &[&str]) -> Result<()> {
    let status = Command::new(program)
        .args(args)
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("`{program} {}` failed with {status}", args.join(" "));
    }
    Ok(())
}

fn capture(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
