//! `cargo xtask`: the tasks that need setup or root — setup, build, run, test, bench, install,
//! image.
//!
//! Every task that needs the toolchain or system packages runs the (idempotent) setup first, so a
//! fresh machine of this project's kind goes from a clean clone to a green test run with one command.
#![forbid(unsafe_code)]

mod bench_targets;
mod image;
mod manifests;
mod setup;
mod tasks;

use clap::{Parser, Subcommand};

/// Build, load, test and benchmark egress-agent.
#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what this machine lacks: apt packages, nightly rust-src, bpf-linker, bpffs mount.
    Setup,
    /// Release build of the agent (eBPF object embedded).
    Build,
    /// Build, then run the agent as root with the given arguments (e.g. `run -- --config config/example.toml`).
    Run {
        /// Arguments passed to `egress-agent`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Unit tests, then the privileged integration tests (kernel, proxy, Docker) as root.
    Test {
        /// Only run integration tests whose name contains this filter.
        #[arg(long)]
        filter: Option<String>,
    },
    /// Benchmarks: enforced connect() cost, proxy vs squid/tinyproxy, DNS, event store, replay.
    /// Prints ratios and ends with every performance target, met or NOT met; asserts nothing.
    Bench {
        /// Shorter runs (fewer iterations), for a smoke check.
        #[arg(long)]
        quick: bool,
    },
    /// Install the binary, systemd unit and default config on this host.
    Install {
        /// Install below this root instead of / (packaging, tests).
        #[arg(long, default_value = "/")]
        destdir: std::path::PathBuf,
    },
    /// The agent's container image (release build + its libraries, nothing pulled) as a
    /// `docker save` archive in target/, tagged egress-agent:<version> (deploy/kubernetes).
    Image {
        /// Also import it into a private containerd and run `egress-agent --version` from it
        /// (root; needs containerd, ctr and runc).
        #[arg(long)]
        verify: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Setup => setup::run(),
        Task::Build => tasks::build(),
        Task::Run { args } => tasks::run(&args),
        Task::Test { filter } => tasks::test(filter.as_deref()),
        Task::Bench { quick } => tasks::bench(quick),
        Task::Install { destdir } => tasks::install(&destdir),
        Task::Image { verify } => tasks::image(verify),
    }
}
