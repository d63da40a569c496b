//! `egress-agent` command line: parse, then dispatch into the library modules.
use std::ffi::OsString;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use egress_agent::{
    api,
    config::DEFAULT_CONFIG_PATH,
    daemon::{DockerOptions, HostOptions},
};
use hyper::Method;

/// Network egress policy for containers and commands: eBPF confinement + hostname-checking proxy.
#[derive(Debug, Parser)]
#[command(name = "egress-agent", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon: enforce Docker containers by label (and Kubernetes pods through containerd
    /// when the configuration has a `[kubernetes]` section), serve the proxy and the control API.
    Run {
        /// Configuration file.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Docker API socket.
        #[arg(long, default_value = "unix:///var/run/docker.sock")]
        docker_socket: String,
        /// Docker's cgroup parent, relative to the cgroup2 mount (dockerd's --cgroup-parent;
        /// `/docker` for the cgroupfs driver's default).
        #[arg(long, default_value = "/docker")]
        cgroup_parent: String,
        /// Don't maintain the nftables host layer (not recommended: AF_PACKET frames are then
        /// stopped only by the BPF-LSM hook).
        #[arg(long)]
        no_nft: bool,
        /// Don't watch Docker (a Kubernetes node whose pods run on containerd: `[kubernetes]`).
        #[arg(long)]
        no_docker: bool,
        /// Refuse to start without the BPF-LSM socket hook (closes AF_PACKET/raw in the kernel).
        #[arg(long)]
        require_lsm: bool,
        /// Control API socket.
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
        /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464). Off by default.
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
        /// Allow a non-loopback metrics address.
        #[arg(long)]
        metrics_allow_non_loopback: bool,
        /// After handing the sockets to a new agent and draining, wait for SIGTERM instead of
        /// exiting: for a container that would be restarted when it exits (a DaemonSet pod; the
        /// roll deletes the old pod once the new one is ready).
        #[arg(long)]
        stay_after_handover: bool,
    },
    /// Run CMD in a fresh cgroup confined by a policy (standalone: no daemon needed).
    Exec {
        /// Policy name (from the config, or the built-ins allow_all / deny_all).
        #[arg(long)]
        policy: String,
        /// Configuration file (default /etc/egress-agent/config.toml if it exists).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Run the command as this user: NAME, UID, NAME:GROUP or UID:GID. Default: the user who
        /// invoked exec (the sudo caller under sudo).
        #[arg(long)]
        user: Option<String>,
        /// A root command sees a read-only file system except its working directory, HOME, /tmp
        /// and /var/tmp; make PATH writable too (repeatable).
        #[arg(long = "rw", value_name = "PATH")]
        writable: Vec<PathBuf>,
        /// A context label for the command's events, denials and store records, as on a Docker
        /// container (repeatable): egress.run=ID, egress.repo=..., egress.agent=...,
        /// egress.workspace=... (`--run` and `--label run=ID` filters find them).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
        /// Control API socket of a running daemon: when one answers, the command's access
        /// requests (`POST http://egress.internal/v1/requests`) wait there for an operator;
        /// without one they are refused.
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
    /// Show what is pinned and attached, and each enforced cgroup with its policy and counters.
    /// Asks the daemon; without one, reads the pins directly.
    Status {
        /// Configuration file (for `agent.bpffs`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Control API socket.
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
    },
    /// Print denial and would-deny events: the daemon's recent ones, or from the event store
    /// (with a selection, `--flows`, or when no daemon answers). JSON lines unless on a terminal.
    Events {
        /// How many recent events.
        #[arg(short = 'n', long, default_value_t = 100)]
        count: usize,
        /// Keep streaming new events.
        #[arg(short, long)]
        follow: bool,
        /// Aggregated flows (allowed traffic included) instead of events.
        #[arg(long)]
        flows: bool,
        /// JSON lines even on a terminal.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        selection: SelectionArgs,
        /// Configuration file (for `agent.state_dir`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Control API socket.
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
    },
    /// Print a minimal allowlist policy (TOML) that would have allowed the observed traffic.
    Suggest {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Also use denied attempts (default: allowed and would-deny traffic only).
        #[arg(long)]
        include_denied: bool,
        /// Show what the suggestion changes against the policy in force (--policy, or the one
        /// policy of the selection) instead of the policy itself.
        #[arg(long)]
        diff: bool,
        /// Name of the suggested policy (default: --policy, or "suggested").
        #[arg(long)]
        name: Option<String>,
        /// Configuration file (state_dir, proxy endpoint, the policy for --diff).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Replay the recorded flows against a proposed policy, with the decision code the proxy and
    /// the kernel run: what it would newly allow, newly deny and leave unchanged, per destination.
    /// Reads the event store; changes nothing.
    Replay {
        /// TOML file holding the proposed policy as a `[policies.NAME]` table (as in the
        /// configuration file; a whole configuration file works too).
        #[arg(long = "policy", value_name = "FILE")]
        file: PathBuf,
        /// Which policy of FILE, when it holds several.
        #[arg(long)]
        name: Option<String>,
        /// Which flows: those recorded under this policy (default: the proposed policy's name),
        /// or `any` for every flow of the selection.
        #[arg(long, value_name = "POLICY")]
        against: Option<String>,
        #[command(flatten)]
        scope: ScopeArgs,
        /// Destinations listed per bucket (0: all).
        #[arg(long, default_value_t = egress_agent::cli::events::REPLAY_LIMIT)]
        limit: usize,
        /// The report as JSON (schema in docs/api.yaml, ReplayReport).
        #[arg(long)]
        json: bool,
        /// Configuration file (state_dir, proxy endpoint).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Ask the daemon to re-read its configuration (a bad file is refused, the running policy stays).
    Reload {
        /// Control API socket.
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
    },
    /// Restart or upgrade the daemon without loss: a new agent from the installed binary takes
    /// the running one's sockets, which then drains its tunnels and exits. Waits until the new
    /// agent serves.
    Restart {
        /// Control API socket.
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
        /// How long to wait for the new agent to take over, in seconds.
        #[arg(long, default_value_t = 120)]
        wait: u64,
    },
    /// Validate a configuration file and print the effective policies.
    Check {
        /// Configuration file.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Also show the policy this container would get, and why.
        #[arg(long)]
        container: Option<String>,
        /// Docker API socket (for --container).
        #[arg(long, default_value = "unix:///var/run/docker.sock")]
        docker_socket: String,
        /// An older presets data file (egress-policy/presets.toml of another version): also
        /// print, per preset, the hosts this version adds and removes, and the policies using it.
        #[arg(long)]
        presets_from: Option<PathBuf>,
    },
    /// The built-in presets (`presets = ["github"]` in a policy): list them, or `show NAME` for
    /// every host of one.
    Presets(egress_agent::cli::presets::PresetsArgs),
    /// Survey the host: kernel features, pins, proxy, Docker, firewall, interception. Changes
    /// nothing.
    Doctor {
        /// Configuration file (pin directory, proxy endpoint, credential bindings).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Stable JSON output (every probe; with --baseline, an object holding the verdict and
        /// the array).
        #[arg(long)]
        json: bool,
        /// Control API socket (the daemon's view of interception, when it answers).
        #[arg(long, default_value = api::DEFAULT_SOCKET)]
        api_socket: PathBuf,
        /// Print passing probes too (by default only the gaps: warn, fail and skip).
        #[arg(long)]
        all: bool,
        /// Judge the report against a baseline (which probes must pass): the summary line says
        /// met or missed, in colour on a terminal, and lists the probes it misses.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(egress_agent::doctor::baseline::NAMES))]
        baseline: Option<String>,
        /// Always exit 0 (informational use); otherwise 1 if any probe failed.
        #[arg(long)]
        exit_zero: bool,
    },
    /// Uninstall: remove the pinned programs and maps, the nftables tables, the proxy interface and
    /// the agent's cgroups. Stopping the agent does not do this, on purpose.
    Cleanup {
        /// Configuration file (for `agent.bpffs`).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print the interception CA: its certificate path, the client bundle path (system roots +
    /// the CA) and the certificate PEM. Creates the CA in `agent.state_dir` on first use.
    Ca {
        /// Configuration file (for `agent.state_dir`; default /etc/egress-agent/config.toml if it
        /// exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print the `docker run` flags a container needs for POLICY: the label, the proxy
    /// variables and, when the policy intercepts, the agent's CA bundle mount, every CA variable
    /// common clients read, and each binding's placeholder variable.
    Wire {
        /// The policy's name.
        policy: String,
        /// Configuration file (default /etc/egress-agent/config.toml if it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The console's login tokens (api.ui_listen): make, rotate, revoke, list.
    Console(egress_agent::cli::console::ConsoleArgs),
    /// Manage policies through the daemon: list, show, set, delete, defaults, export, import.
    Policy(egress_agent::cli::manage::PolicyArgs),
    /// Workloads' access requests (asked from inside at http://egress.internal/): list,
    /// approve for one run or into the policy, deny with a reason.
    Requests(egress_agent::cli::requests::RequestsArgs),
    /// Which policy applies to a destination and why: what the proxy and the kernel would do.
    Explain(egress_agent::cli::manage::ExplainArgs),
    /// An MCP server on stdio (for AI assistants): policies, explain, containers, denials,
    /// suggest; write tools only with --allow-writes.
    Mcp(egress_agent::mcp::McpArgs),
    /// Internal: `exec`'s sandbox, stage 1 (cgroup, namespaces).
    #[command(name = "__exec-child", hide = true)]
    ExecChild {
        spec: String,
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
    /// Internal: `exec`'s sandbox, stage 2 (pid 1: file system view, reaping).
    #[command(name = "__exec-init", hide = true)]
    ExecInit {
        spec: String,
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
    /// Internal: `exec`'s sandbox, stage 3 (privileges, then the command).
    #[command(name = "__exec-run", hide = true)]
    ExecRun {
        spec: String,
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
}

/// Which events: shared by `events` and `suggest`.
#[derive(Debug, clap::Args)]
struct SelectionArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    /// Only this policy.
    #[arg(long)]
    policy: Option<String>,
    /// Only this verdict: deny, would-deny, allow (allow: with --flows).
    #[arg(long)]
    verdict: Option<String>,
}

/// Which workloads and since when: shared by `events`, `suggest` and `replay` (whose `--policy`
/// is the proposed policy's file).
#[derive(Debug, clap::Args)]
struct ScopeArgs {
    /// Only since then: a duration back from now (30m, 2h, 7d) or an RFC 3339 time.
    #[arg(long)]
    since: Option<String>,
    /// Only this container (name, id, or id prefix).
    #[arg(long)]
    container: Option<String>,
    /// Only this run (the `run` context label: Docker label `egress.run`).
    #[arg(long)]
    run: Option<String>,
    /// Only events with this context label, NAME=VALUE (repeatable).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// Only this Kubernetes namespace's pods.
    #[arg(long)]
    namespace: Option<String>,
    /// Only this Kubernetes pod: NAME or NAMESPACE/NAME.
    #[arg(long)]
    pod: Option<String>,
}

impl From<ScopeArgs> for egress_agent::store::selection::Selection {
    fn from(a: ScopeArgs) -> Self {
        egress_agent::store::selection::Selection {
            since: a.since,
            container: a.container,
            policy: None,
            verdict: None,
            run: a.run,
            labels: a.labels,
            namespace: a.namespace,
            pod: a.pod,
        }
    }
}

impl From<SelectionArgs> for egress_agent::store::selection::Selection {
    fn from(a: SelectionArgs) -> Self {
        egress_agent::store::selection::Selection {
            policy: a.policy,
            verdict: a.verdict,
            ..a.scope.into()
        }
    }
}

// Long: the dispatch table, one arm per subcommand turning its flags into a call.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::ExecChild { spec, command } => {
            return exit_code(egress_agent::sandbox::child(&spec, &command));
        }
        Command::ExecInit { spec, command } => {
            return exit_code(egress_agent::sandbox::init(&spec, &command));
        }
        Command::ExecRun { spec, command } => {
            return exit_code(egress_agent::sandbox::run(&spec, &command));
        }
        Command::Exec {
            policy,
            config,
            user,
            writable,
            labels,
            api_socket,
            command,
        } => {
            init_cli_tracing();
            egress_agent::exec::run(egress_agent::exec::ExecOptions {
                policy,
                config,
                user,
                writable,
                labels,
                api_socket,
                command,
            })
            .map(|code| ExitCode::from(code.clamp(0, 255) as u8))
        }
        Command::Run {
            config,
            docker_socket,
            cgroup_parent,
            no_nft,
            no_docker,
            require_lsm,
            api_socket,
            metrics_listen,
            metrics_allow_non_loopback,
            stay_after_handover,
        } => {
            let _log_flush = init_daemon_tracing();
            let opts = egress_agent::daemon::RunOptions {
                config,
                docker: DockerOptions {
                    socket: docker_socket,
                    cgroup_parent,
                },
                host: HostOptions {
                    nft: !no_nft,
                    require_lsm,
                    // Kept in systemd's fd store too, when run under systemd.
                    sockets: egress_agent::handover::Sockets::with_fdstore(),
                    ..HostOptions::default()
                },
                watch_docker: !no_docker,
                api_socket,
                metrics: metrics_listen,
                metrics_allow_non_loopback,
                stay_after_handover,
            };
            runtime()
                .and_then(|rt| rt.block_on(egress_agent::daemon::run(opts)))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Status {
            config,
            json,
            api_socket,
        } => {
            init_cli_tracing();
            status(config.as_deref(), json, &api_socket)
        }
        Command::Events {
            count,
            follow,
            flows,
            json,
            selection,
            config,
            api_socket,
        } => {
            init_cli_tracing();
            let opts = egress_agent::cli::events::EventsOptions {
                count,
                follow,
                flows,
                json,
                selection: selection.into(),
                config,
                api_socket,
            };
            runtime()
                .and_then(|rt| rt.block_on(egress_agent::cli::events::events(opts)))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Suggest {
            selection,
            include_denied,
            diff,
            name,
            config,
        } => {
            init_cli_tracing();
            egress_agent::cli::events::suggest(&egress_agent::suggest::command::SuggestOptions {
                selection: selection.into(),
                include_denied,
                diff,
                name,
                config,
            })
            .map(|text| {
                print!("{text}");
                ExitCode::SUCCESS
            })
        }
        Command::Replay {
            file,
            name,
            against,
            scope,
            limit,
            json,
            config,
        } => {
            init_cli_tracing();
            egress_agent::cli::events::replay(&egress_agent::cli::events::ReplayArgs {
                file,
                name,
                selection: scope.into(),
                against,
                limit,
                json,
                config,
            })
            .map(|text| {
                print!("{text}");
                ExitCode::SUCCESS
            })
        }
        Command::Reload { api_socket } => {
            init_cli_tracing();
            runtime()
                .and_then(|rt| {
                    rt.block_on(async {
                        let body =
                            api::client::request(&api_socket, Method::POST, "/v1/reload").await?;
                        print!("{body}");
                        anyhow::Ok(())
                    })
                })
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Restart { api_socket, wait } => {
            init_cli_tracing();
            runtime()
                .and_then(|rt| {
                    rt.block_on(restart(&api_socket, std::time::Duration::from_secs(wait)))
                })
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Policy(args) => {
            init_cli_tracing();
            egress_agent::cli::manage::policy(args).map(|()| ExitCode::SUCCESS)
        }
        Command::Requests(args) => {
            init_cli_tracing();
            egress_agent::cli::requests::run(args).map(|()| ExitCode::SUCCESS)
        }
        Command::Explain(args) => {
            init_cli_tracing();
            egress_agent::cli::manage::explain(args).map(|()| ExitCode::SUCCESS)
        }
        Command::Mcp(args) => {
            // stdout is the MCP channel: logs go to stderr only.
            init_cli_tracing();
            runtime()
                .and_then(|rt| rt.block_on(egress_agent::mcp::serve_stdio(args)))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Ca { config } => {
            init_cli_tracing();
            print_ca(config.as_deref()).map(|()| ExitCode::SUCCESS)
        }
        Command::Console(args) => {
            init_cli_tracing();
            egress_agent::cli::console::run(&args).map(|()| ExitCode::SUCCESS)
        }
        Command::Wire { policy, config } => {
            init_cli_tracing();
            print_wire(config.as_deref(), &policy).map(|()| ExitCode::SUCCESS)
        }
        Command::Check {
            config,
            container,
            docker_socket,
            presets_from,
        } => {
            init_cli_tracing();
            runtime()
                .and_then(|rt| {
                    rt.block_on(egress_agent::check::run(
                        &config,
                        container.as_deref(),
                        &docker_socket,
                        presets_from.as_deref(),
                    ))
                })
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Presets(args) => {
            init_cli_tracing();
            egress_agent::cli::presets::run(&args).map(|()| ExitCode::SUCCESS)
        }
        Command::Doctor {
            config,
            json,
            api_socket,
            all,
            baseline,
            exit_zero,
        } => {
            init_cli_tracing();
            let mut opts = match egress_agent::config::Config::load_or_default(config.as_deref()) {
                Ok(c) => egress_agent::doctor::Options::from_config(&c),
                Err(e) => {
                    eprintln!("egress-agent: warning: {e:#}; using default paths");
                    egress_agent::doctor::Options::default()
                }
            };
            // The daemon knows what it really loaded (its env secrets included) and what its
            // workloads hold.
            let status = daemon_status(&api_socket);
            if let Some(view) = status
                .as_ref()
                .and_then(egress_agent::doctor::interception::InterceptionView::from_status)
            {
                opts.interception = Some(view);
            }
            opts.workload_secrets = status
                .as_ref()
                .and_then(egress_agent::doctor::workloads::WorkloadSecretsView::from_status);
            doctor_report(opts, json, all, baseline.as_deref(), exit_zero)
        }
        Command::Cleanup { config } => {
            init_cli_tracing();
            egress_agent::config::Config::load_or_default(config.as_deref())
                .map_err(anyhow::Error::from)
                .and_then(|c| egress_agent::cleanup::run(&c.agent.bpffs))
                .and_then(|report| {
                    for r in &report.removed {
                        println!("removed {r}");
                    }
                    for f in &report.failed {
                        eprintln!("egress-agent: cleanup: could not remove {f}");
                    }
                    if report.failed.is_empty() {
                        Ok(ExitCode::SUCCESS)
                    } else {
                        Err(anyhow::anyhow!(
                            "cleanup left {} item(s) behind",
                            report.failed.len()
                        ))
                    }
                })
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("egress-agent: error: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// Run the doctor, print its report (JSON, or the gaps / every probe as text) with the baseline's
/// verdict, and choose the exit status: 1 if a probe failed, unless `exit_zero`.
fn doctor_report(
    opts: egress_agent::doctor::Options,
    json: bool,
    all: bool,
    baseline: Option<&str>,
    exit_zero: bool,
) -> anyhow::Result<ExitCode> {
    use std::io::IsTerminal;
    let baseline = baseline
        .map(egress_agent::doctor::baseline::get)
        .transpose()?;
    let report = egress_agent::doctor::run(opts);
    let verdict = baseline.map(|b| b.judge(&report));
    if json {
        print!("{}", report.to_json_with(verdict.as_ref()));
    } else {
        let color = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
        print!(
            "{}",
            report.render_text(&egress_agent::doctor::TextView {
                all,
                baseline: verdict.as_ref(),
                color,
            })
        );
    }
    if exit_zero {
        return Ok(ExitCode::SUCCESS);
    }
    Ok(ExitCode::from(report.exit_code().clamp(0, 255) as u8))
}

/// The daemon's `GET /v1/status`, if one answers on `api_socket`.
fn daemon_status(api_socket: &Path) -> Option<serde_json::Value> {
    if !api_socket.exists() {
        return None;
    }
    let body = runtime()
        .ok()?
        .block_on(api::client::request(api_socket, Method::GET, "/v1/status"))
        .ok()?;
    serde_json::from_str(&body).ok()
}

/// `status`'s lines about interception: a CA/TLS setup that failed, and each credential binding
/// served without its secret (`v` is the daemon's status).
fn print_interception(v: &serde_json::Value) {
    let i = &v["interception"];
    if let Some(e) = i["setup_error"].as_str() {
        println!(
            "interception: unavailable: {e}; hosts with credential bindings or request rules are refused (interception-unavailable)"
        );
    }
    for b in i["unavailable_bindings"].as_array().into_iter().flatten() {
        println!(
            "credential binding unavailable: {}; requests to {}:{} are refused (interception-unavailable)",
            b["summary"].as_str().unwrap_or("?"),
            b["host"].as_str().unwrap_or("?"),
            b["port"]
        );
    }
}

/// `status`: the daemon's view if it answers, else the pins read directly.
fn status(config: Option<&Path>, json: bool, api_socket: &Path) -> anyhow::Result<ExitCode> {
    if api_socket.exists() {
        let answer =
            runtime()?.block_on(api::client::request(api_socket, Method::GET, "/v1/status"));
        match answer {
            Ok(body) if json => {
                print!("{body}");
                return Ok(ExitCode::SUCCESS);
            }
            Ok(body) => {
                let v: serde_json::Value = serde_json::from_str(&body).context("daemon status")?;
                println!(
                    "daemon: pid {}, running {}s, config {}, proxy endpoint {}, {} denial events",
                    v["pid"], v["uptime_s"], v["config"], v["proxy_endpoint"], v["events_total"]
                );
                if let Some(p) = v.get("previous_agent").filter(|p| !p.is_null()) {
                    println!(
                        "previous agent: pid {} (handed over), draining {} connections",
                        p["pid"], p["draining_connections"]
                    );
                }
                print_interception(&v);
                // Workloads holding a real key (names and why, never values).
                if let Some(view) =
                    egress_agent::doctor::workloads::WorkloadSecretsView::from_status(&v)
                {
                    for w in &view.held {
                        println!("holds a real key (workload-holds-secret): {w}");
                    }
                }
            }
            Err(e) => {
                eprintln!("egress-agent: daemon not reachable ({e}); reading the pins directly")
            }
        }
    } else if !json {
        println!(
            "daemon: not running (no {}); reading the pins directly",
            api_socket.display()
        );
    }
    let c = egress_agent::config::Config::load_or_default(config)?;
    egress_agent::status::run(&c.agent.bpffs, json)?;
    Ok(ExitCode::SUCCESS)
}

/// `restart`: ask the daemon for a successor, then wait until that one serves the API.
async fn restart(api_socket: &Path, wait: std::time::Duration) -> anyhow::Result<()> {
    let body = api::client::request(api_socket, Method::POST, "/v1/restart").await?;
    let v: serde_json::Value = serde_json::from_str(&body).context("restart answer")?;
    let (old, new) = (v["pid"].as_u64(), v["new_pid"].as_u64());
    let new = new.context("the daemon did not name the new agent")?;
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Ok(body) = api::client::request(api_socket, Method::GET, "/v1/status").await
            && let Ok(s) = serde_json::from_str::<serde_json::Value>(&body)
            && s["pid"].as_u64() == Some(new)
        {
            let draining = s["previous_agent"]["draining_connections"]
                .as_u64()
                .unwrap_or(0);
            println!(
                "handed over: pid {} → pid {new}; the old agent drains {draining} connections, then exits",
                old.map_or_else(|| "?".to_owned(), |p| p.to_string())
            );
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "the new agent (pid {new}) did not take over within {wait:?}; the running agent keeps serving (its log says why, e.g. `a new agent did not take over`)"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// CLI commands: human-readable warnings on stderr.
fn init_cli_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    if tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init()
        .is_err()
    {
        eprintln!("egress-agent: logging was already initialised");
    }
}

/// The daemon: JSON lines on stdout (journald keeps them), human format on a terminal.
/// Lines go through a non-blocking writer (a bounded queue drained by its own thread), so
/// logging never sits on the proxy's hot path; the guard flushes it at exit. hickory-server logs
/// every DNS request at `info` (query names included): the agent's own denial events cover what
/// matters, so it is held at `warn` by default.
fn init_daemon_tracing() -> tracing_appender::non_blocking::WorkerGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,hickory_server=warn"));
    let tty = std::io::stdout().is_terminal();
    let (writer, guard) = tracing_appender::non_blocking(std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    let result = if tty {
        builder.try_init()
    } else {
        builder
            .json()
            .flatten_event(true)
            // The container / connection a line is about (per-container and per-connection spans).
            .with_current_span(true)
            .with_span_list(false)
            .try_init()
    };
    if result.is_err() {
        eprintln!("egress-agent: logging was already initialised");
    }
    guard
}

/// `egress-agent ca`.
/// One flag per line, shell-quoted, each line but the last ending in ` \\`: paste after
/// `docker run` and before the image.
fn print_wire(config: Option<&std::path::Path>, policy: &str) -> anyhow::Result<()> {
    use egress_agent::cli::wire;
    let config = egress_agent::config::Config::load_or_default(config)?;
    let flags = wire::docker_flags(&config, policy)?;
    if flags.iter().any(|f| f == "-v") {
        // The mounted files must exist: the CA and its bundle are made on first use.
        egress_agent::ca::AgentCa::load_or_create(&config.agent.state_dir)?;
    }
    let lines: Vec<String> = flags
        .chunks(2)
        .map(|pair| {
            pair.iter()
                .map(|w| wire::shell_word(w))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    println!("{}", lines.join(" \\\n"));
    Ok(())
}

fn print_ca(config: Option<&std::path::Path>) -> anyhow::Result<()> {
    let config = egress_agent::config::Config::load_or_default(config)?;
    let ca = egress_agent::ca::AgentCa::load_or_create(&config.agent.state_dir)?;
    println!("certificate: {}", ca.cert_path().display());
    println!("bundle: {}", ca.bundle_path().display());
    print!("{}", ca.cert_pem());
    Ok(())
}
