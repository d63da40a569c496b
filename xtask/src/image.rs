//! `cargo xtask image`: the agent's container image, from the release build and this host's
//! files, nothing pulled. One layer: the binary, the shared libraries it and `ip` need (as `ldd`
//! lists them) with their loader, `ip` (iproute2: the agent creates `egress0` with it), the CA
//! bundle (upstream verification of intercepted hosts), and a root-only `/etc/passwd` and
//! `/etc/group`. Written as a `docker save` archive into `target/` (see [`archive`]), tagged
//! `egress-agent:<workspace version>`, which `deploy/kubernetes/daemonset.yaml` runs.
//!
//! `/etc/resolv.conf` and `/etc/hosts` are not in the image: the kubelet (and Docker) mount them
//! into every container; the agent refuses to start without them (`ctr run` needs them mounted).
//!
//! The image runs as root: the daemon loads BPF programs, writes other users' cgroups and
//! programs nftables (see the DaemonSet's comments); a non-root user can't.
//!
//! `--verify` imports the archive into a private containerd (own root, state and socket in a
//! temporary directory) and runs `egress-agent --version` from it.

mod archive;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::setup::workspace_root;

/// The image's name; its tag is the workspace version.
pub const NAME: &str = "egress-agent";
/// Where the binary is in the image (on PATH).
const AGENT_PATH: &str = "/usr/local/bin/egress-agent";
/// The configuration file the image's default command reads (the DaemonSet mounts it there).
pub const CONFIG_PATH: &str = "/etc/egress-agent/config.toml";
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Programs the agent runs (by absolute path on PATH, egress-agent/src/host_tool.rs):
/// egress-agent/src/netif.rs, workload/netinfo.rs.
const TOOLS: &[&str] = &["ip"];
/// Where `TOOLS` are looked for on this host, in order; they are put at the same path.
const TOOL_DIRS: &[&str] = &["/usr/sbin", "/usr/bin", "/sbin", "/bin"];
/// Debian's CA bundle (package ca-certificates); rustls-native-certs finds it at this path.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// `egress-agent:<version>`.
pub fn tag() -> String {
    format!("{NAME}:{}", env!("CARGO_PKG_VERSION"))
}

/// `target/egress-agent-<version>.image.tar`.
pub fn archive_path() -> PathBuf {
    workspace_root().join(format!(
        "target/{NAME}-{}.image.tar",
        env!("CARGO_PKG_VERSION")
    ))
}

/// Write the image of the agent binary `agent` to [`archive_path`].
pub fn write_image(agent: &Path) -> Result<PathBuf> {
    let fs = rootfs(agent)?;
    let layer = fs.layer()?;
    let out = archive_path();
    let file =
        std::fs::File::create(&out).with_context(|| format!("creating {}", out.display()))?;
    let id = archive::write(std::io::BufWriter::new(file), &tag(), &run_config(), &layer)?;
    eprintln!(
        "image {tag} (id sha256:{id}, layer {mb} MB) written to {out}\n  docker load -i {out}\n  \
         on a Kubernetes node: ctr -n k8s.io images import {out}",
        tag = tag(),
        id = &id[..12],
        mb = layer.len() / 1_000_000,
        out = out.display()
    );
    Ok(out)
}

fn run_config() -> archive::RunConfig {
    let labels = BTreeMap::from([
        ("org.opencontainers.image.title".to_owned(), NAME.to_owned()),
        (
            "org.opencontainers.image.version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        ),
        (
            "org.opencontainers.image.licenses".to_owned(),
            env!("CARGO_PKG_LICENSE").to_owned(),
        ),
    ]);
    archive::RunConfig {
        architecture: oci_architecture(std::env::consts::ARCH).to_owned(),
        // The daemon by default; any other subcommand by replacing the command
        // (`docker run IMAGE --version`, `kubectl exec ... -- egress-agent status`).
        entrypoint: vec![AGENT_PATH.to_owned()],
        cmd: ["run", "--config", CONFIG_PATH].map(str::to_owned).to_vec(),
        env: vec![PATH_ENV.to_owned()],
        labels,
    }
}

/// The OCI name of the architecture the release binary (this host's) is built for.
fn oci_architecture(rust_arch: &str) -> &str {
    match rust_arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The image's files, read from this host.
fn rootfs(agent: &Path) -> Result<archive::Rootfs> {
    let mut fs = archive::Rootfs::default();
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    fs.file(AGENT_PATH, read(agent)?, 0o755)?;
    let mut elves = vec![agent.to_owned()];
    for tool in TOOLS {
        let host = TOOL_DIRS
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.is_file())
            .with_context(|| {
                format!("`{tool}` not found in {TOOL_DIRS:?} (apt-get install iproute2)")
            })?;
        fs.file(&path_str(&host)?, read(&host)?, 0o755)?;
        elves.push(host);
    }
    for elf in &elves {
        for lib in shared_libraries(elf)? {
            // At the path the loader looks for (the soname's), with the content it points to.
            fs.file(&path_str(&lib)?, read(&lib)?, 0o755)?;
        }
    }
    fs.file(CA_BUNDLE, read(Path::new(CA_BUNDLE))?, 0o644)?;
    fs.file(
        "/etc/passwd",
        b"root:x:0:0:root:/root:/usr/sbin/nologin\n".to_vec(),
        0o644,
    )?;
    fs.file("/etc/group", b"root:x:0:\n".to_vec(), 0o644)?;
    fs.file(
        "/etc/nsswitch.conf",
        b"passwd: files\ngroup: files\nhosts: files dns\n".to_vec(),
        0o644,
    )?;
    fs.dir("/tmp", 0o1777)?;
    fs.dir("/root", 0o700)?;
    Ok(fs)
}

fn path_str(p: &Path) -> Result<String> {
    p.to_str()
        .map(str::to_owned)
        .with_context(|| format!("{} is not UTF-8", p.display()))
}

/// The shared libraries `elf` loads, and its loader, as `ldd` resolves them on this host.
fn shared_libraries(elf: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(elf)
        .output()
        .context("running ldd")?;
    if !out.status.success() {
        bail!(
            "ldd {} failed: {}",
            elf.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_ldd(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| format!("libraries of {}", elf.display()))
}

/// `ldd` output → library paths. `name => /path (addr)` and `/path (addr)` (the loader) give a
/// path; the vDSO (`linux-vdso.so.1 (addr)`) has none; `name => not found` is an error.
fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let target = match line.split_once(" => ") {
            Some((name, rest)) => {
                if rest.starts_with("not found") {
                    bail!("{name} not found by ldd");
                }
                rest
            }
            None => line,
        };
        let path = target.split(" (").next().unwrap_or(target).trim();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        } else if line.contains("statically linked") {
            continue;
        } else if !path.starts_with("linux-vdso") && !path.starts_with("linux-gate") {
            bail!("unexpected ldd line: {line}");
        }
    }
    Ok(libs)
}

/// A containerd of its own: root, state, socket and config in a temporary directory. Killed
/// (and the directory removed) on drop.
struct PrivateContainerd {
    dir: PathBuf,
    child: Child,
}

impl PrivateContainerd {
    fn start() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("egress-image-verify-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let sock = dir.join("containerd.sock");
        // No CRI plugin: only the image store, snapshots and runc tasks are used.
        let config = format!(
            "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
             [grpc]\n  address = \"{sock}\"\n",
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            sock = sock.display(),
        );
        std::fs::write(dir.join("config.toml"), config)?;
        let log = std::fs::File::create(dir.join("containerd.log"))?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting containerd")?;
        let me = PrivateContainerd { dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !me.ctr(&["version"]).is_ok_and(|o| o.status.success()) {
            if Instant::now() > deadline {
                bail!(
                    "the private containerd did not answer within 20 s; its log: {}",
                    std::fs::read_to_string(me.dir.join("containerd.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(me)
    }

    fn ctr(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        Command::new("ctr")
            .arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", "k8s.io"])
            .args(args)
            .stdin(Stdio::null())
            .output()
    }

    fn ctr_ok(&self, args: &[&str]) -> Result<String> {
        let out = self
            .ctr(args)
            .with_context(|| format!("running ctr {}", args.join(" ")))?;
        if !out.status.success() {
            bail!(
                "`ctr {}` failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for PrivateContainerd {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
        // The snapshotter's mounts are gone with the task; anything left keeps its files.
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Import `archive` as a Kubernetes node would (`ctr -n k8s.io images import`) and run
/// `egress-agent --version` from it.
pub fn verify_with_containerd(archive: &Path) -> Result<()> {
    for tool in ["containerd", "ctr", "runc"] {
        if !Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            bail!("verifying the image needs {tool} (apt-get install containerd runc)");
        }
    }
    if !crate::setup::is_root() {
        bail!("verifying the image starts a private containerd: run as root");
    }
    let containerd = PrivateContainerd::start()?;
    let archive = path_str(archive)?;
    containerd.ctr_ok(&["images", "import", &archive])?;
    let reference = format!("docker.io/library/{}", tag());
    let list = containerd.ctr_ok(&["images", "list", "-q"])?;
    if !list.lines().any(|l| l.trim() == reference) {
        bail!("after the import containerd has {list:?}, not {reference}");
    }
    let id = format!("egress-image-verify-{}", std::process::id());
    let out = containerd.ctr_ok(&["run", "--rm", &reference, &id, AGENT_PATH, "--version"])?;
    let want = format!("{NAME} {}", env!("CARGO_PKG_VERSION"));
    if out.trim() != want {
        bail!("`egress-agent --version` in the image printed {out:?}, expected {want:?}");
    }
    // The tool the agent runs, with the libraries the image carries.
    containerd.ctr_ok(&["run", "--rm", &reference, &format!("{id}-ip"), "ip", "-V"])?;
    eprintln!(
        "image verified: imported as {reference} into a private containerd; it runs `{want}`"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_libraries_and_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibnftnl.so.11 => /lib/x86_64-linux-gnu/libnftnl.so.11 (0x00007f1)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        assert_eq!(
            parse_ldd(text).expect("parse"),
            [
                "/lib/x86_64-linux-gnu/libnftnl.so.11",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn a_missing_library_is_an_error() {
        let err = parse_ldd("\tlibnftnl.so.11 => not found\n").expect_err("must fail");
        assert!(err.to_string().contains("libnftnl.so.11"), "{err}");
        assert!(
            parse_ldd("\tstatically linked\n")
                .expect("static")
                .is_empty()
        );
    }

    #[test]
    fn default_command_is_the_daemon_with_the_mounted_config() {
        let run = run_config();
        let mut argv = run.entrypoint.clone();
        argv.extend(run.cmd.clone());
        assert_eq!(argv, [AGENT_PATH, "run", "--config", CONFIG_PATH]);
        assert_eq!(tag(), format!("egress-agent:{}", env!("CARGO_PKG_VERSION")));
    }
}
