//! The Docker side of the agent as a standalone process, for the Docker tests (kill -9, restart).
//! The daemon wires `egress_agent::docker::serve` the same way.
//!
//! `egress-test-docker-agent --config FILE --socket unix:///... --cgroup-parent /P [--events FILE] [--no-nft]`
//!
//! `--events` appends every denial event as one JSON object per line (the whole `DenialEvent`,
//! context labels included), for the tests to inspect.
use std::path::PathBuf;
use std::sync::Arc;

use egress_agent::config::Config;
use egress_agent::docker::{DockerOptions, serve};
use egress_agent::events::EventSink;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let mut config = None;
    let mut opts = DockerOptions::default();
    let mut events_file: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" => config = args.next().map(PathBuf::from),
            "--socket" => opts.socket = args.next().unwrap_or_default(),
            "--cgroup-parent" => opts.cgroup_parent = args.next().unwrap_or_default(),
            "--no-nft" => opts.nft = false,
            "--events" => events_file = args.next().map(PathBuf::from),
            other => {
                eprintln!("unknown argument {other}");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let Some(path) = config else {
        eprintln!("--config is required");
        return std::process::ExitCode::from(2);
    };
    let config = match Config::load(&path) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        let shutdown = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(_) => return std::future::pending::<()>().await,
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        let events = EventSink::default();
        if let Some(path) = events_file {
            let mut rx = events.subscribe();
            tokio::spawn(async move {
                use std::io::Write;
                let Ok(mut f) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                else {
                    eprintln!("cannot open {}", path.display());
                    return;
                };
                loop {
                    match rx.recv().await {
                        Ok(ev) => {
                            if let Ok(line) = serde_json::to_string(&ev) {
                                let _written = writeln!(f, "{line}").is_ok();
                            }
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            eprintln!("events: lagged {n}")
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    }
                }
            });
        }
        serve(config, opts, events, shutdown).await
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress-test-docker-agent: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
