//! `egress-agent` command line: parse, then dispatch into the library modules.
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Network egress policy for containers and commands: eBPF confinement + hostname-checking proxy.
#[derive(Debug, Parser)]
#[command(name = "egress-agent", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run CMD in a fresh cgroup confined by a policy (standalone: no daemon needed).
    Exec {
        /// Policy name (from the config, or the built-ins allow_all / deny_all).
        #[arg(long)]
        policy: String,
        /// Configuration file (default /etc/egress-agent/config.toml if it exists).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
    /// Show what is pinned and attached, and each enforced cgroup with its policy and counters.
    Status {
        /// Configuration file (for `agent.bpffs`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Internal: second half of `exec` (enter the cgroup, then exec CMD).
    #[command(name = "__exec-child", hide = true)]
    ExecChild {
        #[arg(long)]
        drop_net_raw: bool,
        cgroup: PathBuf,
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::ExecChild { cgroup, drop_net_raw, command } => {
            return ExitCode::from(egress_agent::exec::child(&cgroup, drop_net_raw, &command) as u8);
        }
        Command::Exec { policy, config, command } => {
            init_tracing();
            egress_agent::exec::run(egress_agent::exec::ExecOptions { policy, config, command })
                .map(|code| ExitCode::from(code.clamp(0, 255) as u8))
        }
        Command::Status { config, json } => egress_agent::exec::load_config(config.as_deref())
            .and_then(|c| egress_agent::status::run(&c.agent.bpffs, json))
            .map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("egress-agent: error: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init().ok();
}
