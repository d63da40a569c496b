//! The tasks behind `cargo xtask build | run | test | bench | install` (`image`: image.rs).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::setup::{self, is_root, sh, workspace_root};
use crate::{bench_targets, image, manifests};

/// `== what (t+Ns)` on stderr: a phase of `cargo xtask test` and when it began (CI's time is
/// budgeted: this says where it goes).
fn phase(what: &str) {
    static START: OnceLock<Instant> = OnceLock::new();
    let t = START.get_or_init(Instant::now).elapsed().as_secs();
    eprintln!("== {what} (t+{t}s)");
}

fn ensure_setup() -> Result<()> {
    if setup::needed() {
        setup::run()?;
    }
    Ok(())
}

fn cargo(args: &[&str]) -> Result<()> {
    cargo_with(args, &[])
}

/// `cargo ARGS` in the workspace with extra environment variables.
fn cargo_with(args: &[&str], envs: &[(&str, &std::ffi::OsStr)]) -> Result<()> {
    let status = Command::new(env!("CARGO"))
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(workspace_root())
        .status()
        .context("running cargo")?;
    if !status.success() {
        bail!("`cargo {}` failed with {status}", args.join(" "));
    }
    Ok(())
}

pub fn release_bin(name: &str) -> PathBuf {
    workspace_root().join("target/release").join(name)
}

/// The one release build every command uses (`build`, `run`, `test`, `bench`, `install`, `image`): the
/// agent and the benchmark binaries of egress-tests in one invocation. Cargo unifies dependency
/// features over the packages one invocation selects, so a second command that selected other
/// packages (the agent alone, then the agent with egress-tests) would rebuild the agent with other
/// dependency features (rmcp's client side, for one). With one selection, the second command
/// compiles nothing.
const RELEASE_BUILD: [&str; 7] = [
    "build",
    "--release",
    "-p",
    "egress-agent",
    "-p",
    "egress-tests",
    "--bins",
];

pub fn build() -> Result<()> {
    ensure_setup()?;
    cargo(&RELEASE_BUILD)
}

pub fn run(args: &[String]) -> Result<()> {
    build()?;
    let bin = release_bin("egress-agent");
    let mut cmd = if is_root() {
        Command::new(&bin)
    } else {
        let mut c = Command::new("sudo");
        c.arg("-E").arg(&bin);
        c
    };
    let status = cmd
        .args(args)
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    if !status.success() {
        bail!("egress-agent exited with {status}");
    }
    Ok(())
}

/// The proxy test files run a second time on the kernel relay (`kernel_relay.rs` itself is on
/// it in the unit phase already).
const KERNEL_RELAY_TESTS: [&str; 5] = [
    "proxy_integration",
    "proxy_metrics",
    "proxy_no_leaks",
    "proxy_audit",
    "transparent",
];

/// The privileged suite's selection, optimized: `cargo test --release -p egress-tests`. Its
/// library and binaries are [`RELEASE_BUILD`]'s (the same packages' features), so only the test
/// files compile; in the debug profile the suite resolved other features than the unit phase and
/// compiled ~60 crates, the agent and its eBPF objects a third time (~4 min of CI's two cores).
/// Optimized, `relay_integrity` runs too (ignored in debug builds: a debug checking client is too
/// slow to reach the kernel relay's hand-back), and the bench suites share the build.
const SUITE: [&str; 3] = ["--release", "-p", "egress-tests"];

/// The packages of the unit phase. The relay pass selects the same ones (and only its test
/// files), so cargo resolves the same features and reuses the unit phase's build instead of
/// compiling egress-common and egress-agent again (~40 s on CI's two cores).
const UNIT_PACKAGES: [&str; 5] = [
    "--workspace",
    "--exclude",
    "egress-ebpf",
    "--exclude",
    "egress-tests",
];

pub fn test(filter: Option<&str>) -> Result<()> {
    ensure_setup()?;
    phase("Kubernetes manifests (deploy/kubernetes): schema and cross-file checks");
    manifests::validate()?;
    manifests::check().context("deploy/kubernetes")?;
    phase("unit tests (all crates but the eBPF object and the privileged suite)");
    // Line tables are all a failing test's backtrace needs; full debug info makes the cold debug
    // build of every dependency noticeably slower on CI's two cores.
    let debug: &std::ffi::OsStr = "line-tables-only".as_ref();
    let dev = [("CARGO_PROFILE_DEV_DEBUG", debug)];
    let mut unit = vec!["test"];
    unit.extend(UNIT_PACKAGES);
    cargo_with(&unit, &dev)?;
    phase("release build (the binaries the privileged suite drives)");
    if !is_root() {
        eprintln!("skipping privileged integration tests: needs root (each test says so too)");
    }
    // The integration tests drive the release binary like an operator would (the build `run`
    // and `bench` use too).
    cargo(&RELEASE_BUILD)?;
    // The DaemonSet's image of this release build, before the suite: containerd_daemonset runs
    // the agent from it (EGRESS_AGENT_IMAGE) as a pod on the test's containerd.
    let archive = image::write_image(&release_bin(image::NAME))?;
    if is_root() {
        // Start from no pins: the agent would switch links an earlier build left to this build's
        // programs anyway, but a clean start keeps earlier runs' roots and entries out of the tests.
        phase("removing pins of earlier runs (egress-agent cleanup)");
        let status = Command::new(release_bin("egress-agent"))
            .args(["cleanup", "--config", "/dev/null"])
            .status()
            .context("running egress-agent cleanup")?;
        if !status.success() {
            bail!(
                "egress-agent cleanup failed ({status}): earlier runs' pins would stay in the tests' way"
            );
        }
    }
    if is_root() && filter.is_none() {
        // The unit phase ran the proxy tests on the user-space relay; again with every
        // pass-through tunnel spliced in the kernel (`proxy.kernel_relay = "on"`, #15).
        phase("proxy tests on the kernel relay (EGRESS_TEST_KERNEL_RELAY=on)");
        let mut args = vec!["test"];
        args.extend(UNIT_PACKAGES);
        for t in KERNEL_RELAY_TESTS {
            args.extend(["--test", t]);
        }
        cargo_with(
            &args,
            &[("EGRESS_TEST_KERNEL_RELAY", "on".as_ref()), dev[0]],
        )
        .context("proxy tests on the kernel relay failed")?;
    }
    if filter.is_none() {
        image_smoke_test(&archive)?;
    }
    // The fuzz targets compile meanwhile, on one job: the suite mostly waits on dockerd,
    // containerd and its clients.
    let fuzz = FuzzCheck::spawn()?;
    phase("privileged integration tests (egress-tests, optimized)");
    // --no-fail-fast: one failing suite must not hide what the suites after it would say.
    let mut args = vec!["test", "--no-fail-fast"];
    args.extend(SUITE);
    args.push("--");
    if let Some(f) = filter {
        args.push(f);
    }
    // Tests share cgroups, netns names and one private dockerd: run them one at a time.
    args.push("--test-threads=1");
    let agent = release_bin("egress-agent");
    let suite = cargo_with(
        &args,
        &[
            ("EGRESS_AGENT_BIN", agent.as_os_str()),
            ("EGRESS_AGENT_IMAGE", archive.as_os_str()),
        ],
    )
    .context("privileged integration tests failed");
    let fuzz = fuzz.finish();
    phase("done");
    suite.and(fuzz)
}

/// `cargo check` of the fuzz targets of both fuzz workspaces (`fuzz/`, `egress-policy/fuzz/`:
/// their own workspaces, which cargo-fuzz builds with nightly), so an API change can't leave one
/// behind (running them: docs/development.md). No eBPF objects needed for a check. Run in the
/// background on one job, output to `target/fuzz-check.log`, shown if it fails.
struct FuzzCheck {
    worker: std::thread::JoinHandle<Result<()>>,
    log: PathBuf,
}

impl FuzzCheck {
    fn spawn() -> Result<FuzzCheck> {
        phase(
            "fuzz targets compile, in the background (cargo check -j 1; log: target/fuzz-check.log)",
        );
        let log = workspace_root().join("target/fuzz-check.log");
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let worker = std::thread::spawn(move || {
            for manifest in ["fuzz/Cargo.toml", "egress-policy/fuzz/Cargo.toml"] {
                let status = Command::new(env!("CARGO"))
                    .args(["check", "--manifest-path", manifest, "--bins"])
                    .args(["--target-dir", "target/fuzz-check", "-j", "1"])
                    .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only")
                    .env("AYA_BUILD_SKIP", "1")
                    .current_dir(workspace_root())
                    .stdin(Stdio::null())
                    .stdout(out.try_clone()?)
                    .stderr(out.try_clone()?)
                    .status()
                    .context("running cargo check of the fuzz targets")?;
                if !status.success() {
                    bail!("the fuzz targets of {manifest} don't compile ({status})");
                }
            }
            Ok(())
        });
        Ok(FuzzCheck { worker, log })
    }

    fn finish(self) -> Result<()> {
        let result = self
            .worker
            .join()
            .map_err(|_| anyhow::anyhow!("the fuzz targets' check panicked"))?;
        match result {
            Ok(()) => {
                phase("fuzz targets compile: ok");
                Ok(())
            }
            Err(e) => {
                eprintln!("{}", std::fs::read_to_string(&self.log).unwrap_or_default());
                Err(e.context(format!("output above, also in {}", self.log.display())))
            }
        }
    }
}

/// `cargo xtask image`: the release build, then the archive; `verify` also imports and runs it.
pub fn image(verify: bool) -> Result<()> {
    build()?;
    let out = image::write_image(&release_bin(image::NAME))?;
    if verify {
        image::verify_with_containerd(&out)?;
    }
    Ok(())
}

/// The DaemonSet's image `archive` (from this release build), imported into a private
/// containerd as a node would and run (`egress-agent --version`, `ip -V`). Skipped, loudly,
/// without root or containerd. Kept next to containerd_daemonset (which runs the agent from the
/// same archive as a pod): it is the quick check without CRI, and the only one that says the
/// image itself is broken rather than the pod around it.
fn image_smoke_test(archive: &Path) -> Result<()> {
    phase("container image (cargo xtask image --verify)");
    let have = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !is_root() {
        eprintln!("skipping the image check: needs root (a private containerd)");
        return Ok(());
    }
    if let Some(missing) = ["containerd", "ctr", "runc"].into_iter().find(|t| !have(t)) {
        eprintln!("skipping the image check: {missing} is not installed");
        return Ok(());
    }
    image::verify_with_containerd(archive).context("the container image")
}

/// The benchmark binaries `cargo xtask bench` runs, in order, with their arguments (besides
/// `--agent` and `--quick`).
const BENCH_RUNS: [(&str, &[&str]); 9] = [
    ("connect-bench", &[]),
    ("proxy-bench", &[]),
    // 200 content-checked tunnels at once through the kernel relay (#34): mismatches and
    // resets must be 0 (a failure of the run), hand-backs and fallbacks counted.
    ("relay-soak", &[]),
    // Every proxy with the same half CPU, so tunnels/s compares the proxies rather than the
    // client's ceiling on this machine's two cores.
    ("proxy-bench", &["--rate-only", "--cpu-quota", "50"]),
    // TLS interception (credential injection) vs squid ssl-bump and mitmproxy.
    ("proxy-bench", &["--intercept"]),
    // Event store ingest, and allowed tunnels/s with and without a flood of refusals.
    ("store-bench", &[]),
    // `egress-agent replay` of 1M stored events (target: 2 s), in 20k flows and in 1M.
    ("replay-bench", &[]),
    // The agent's DNS responder vs dnsmasq; transparent tunnels vs explicit CONNECT.
    ("dns-bench", &[]),
    ("transparent-bench", &[]),
];

/// `cargo xtask bench`: the benchmark binaries, then the benchmarks that are ignored tests, then
/// the summary of every target the binaries reported (docs/benchmarks.md, "Targets"). A target
/// not met fails nothing; a benchmark that fails fails the run, after the summary.
pub fn bench(quick: bool) -> Result<()> {
    ensure_setup()?;
    if !is_root() {
        bail!("the benchmarks load eBPF programs and pin CPUs: run as root");
    }
    cargo(&RELEASE_BUILD)?;
    let mut failed = Vec::new();
    let mut targets = Vec::new();
    for (bench, extra) in BENCH_RUNS {
        let bin = release_bin(bench);
        if !bin.exists() {
            failed.push(format!("{bench}: binary missing"));
            continue;
        }
        let label = std::iter::once(bench)
            .chain(extra.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        eprintln!("== {label}");
        let mut cmd = Command::new(&bin);
        cmd.arg("--agent")
            .arg(release_bin("egress-agent"))
            .args(extra);
        if quick {
            cmd.arg("--quick");
        }
        let (status, reported) = bench_targets::run_capturing(&mut cmd, &label, std::io::stdout())?;
        targets.extend(reported);
        if !status.success() {
            failed.push(format!("{label}: {status}"));
        }
    }
    failed.extend(bench_suites(quick));
    print!("{}", bench_targets::summary(&targets));
    if !failed.is_empty() {
        bail!("benchmarks failed: {}", failed.join("; "));
    }
    Ok(())
}

/// Benchmarks that are ignored tests of egress-tests (a private dockerd or containerd), each
/// with its size: Docker start → enforced and memory with N containers; the same for Kubernetes
/// pods; restarts under load, the hand-over beside a stop and start. They report no `target:`
/// lines. Returns what failed.
fn bench_suites(quick: bool) -> Vec<String> {
    let agent = release_bin("egress-agent");
    let suites: [(&str, &str, &str, &str); 3] = [
        ("docker_bench", "EGRESS_BENCH_CONTAINERS", "20", "200"),
        ("containerd_bench", "EGRESS_BENCH_PODS", "20", "100"),
        ("handover_bench", "EGRESS_BENCH_RESTARTS", "3", "5"),
    ];
    let mut failed = Vec::new();
    for (suite, size_var, small, full) in suites {
        eprintln!("== {suite}");
        let size = if quick { small } else { full };
        let mut args = vec!["test"];
        args.extend(SUITE);
        args.extend(["--test", suite, "--", "--ignored", "--nocapture"]);
        args.push("--test-threads=1");
        if let Err(e) = cargo_with(
            &args,
            &[
                ("EGRESS_AGENT_BIN", agent.as_os_str()),
                (size_var, size.as_ref()),
            ],
        ) {
            failed.push(format!("{suite}: {e}"));
        }
    }
    failed
}

pub fn install(destdir: &Path) -> Result<()> {
    build()?;
    let root = workspace_root();
    let place = |from: &Path, to: &str, mode: u32, overwrite: bool| -> Result<()> {
        let to = destdir.join(to.trim_start_matches('/'));
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if !overwrite && to.exists() {
            eprintln!("kept existing {}", to.display());
            return Ok(());
        }
        std::fs::copy(from, &to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))?;
        eprintln!("installed {}", to.display());
        Ok(())
    };
    place(
        &release_bin("egress-agent"),
        "/usr/local/bin/egress-agent",
        0o755,
        true,
    )?;
    place(
        &root.join("dist/egress-agent.service"),
        "/etc/systemd/system/egress-agent.service",
        0o644,
        true,
    )?;
    // Never overwrite an operator's config on upgrade.
    place(
        &root.join("config/example.toml"),
        "/etc/egress-agent/config.toml",
        0o600,
        false,
    )?;
    if destdir == Path::new("/") && Path::new("/run/systemd/system").exists() {
        sh("systemctl", &["daemon-reload"])?;
        eprintln!("next: systemctl enable --now egress-agent");
    } else {
        eprintln!("systemd is not PID 1 here: the unit is installed but not started");
    }
    Ok(())
}
