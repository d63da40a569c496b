//! `egress-agent console`: the console's login tokens (`console.tokens` in the state directory,
//! see [`crate::api::tokens`]). Run as root on the host; the daemon sees a change at once.
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

use crate::api::tokens::{self, Issued};
use crate::config::Config;

/// Console tokens: who may log in to the console on `api.ui_listen` and change policies there.
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    #[command(subcommand)]
    pub command: ConsoleCommand,
    /// Configuration file (default /etc/egress-agent/config.toml if it exists): its
    /// `agent.state_dir` holds the tokens.
    #[arg(long, global = true)]
    pub config: Option<std::path::PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum ConsoleCommand {
    /// Make a token for NAME and print it (once: only its digest is kept). With --rotate,
    /// replace NAME's token; its sessions end at their next request.
    Token {
        /// The operator's name, recorded with every change made with this token.
        name: String,
        /// Replace the token NAME has.
        #[arg(long)]
        rotate: bool,
    },
    /// Remove NAME's token; its sessions end at their next request.
    Revoke {
        /// The operator's name.
        name: String,
    },
    /// The names that have a token.
    List,
}

/// Run a `console` subcommand.
pub fn run(args: &ConsoleArgs) -> Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!("console tokens are root's to manage: run this as root on the agent's host");
    }
    let config = Config::load_or_default(args.config.as_deref())?;
    let path = config.agent.state_dir.join(tokens::FILE);
    match &args.command {
        ConsoleCommand::Token { name, rotate } => {
            match tokens::issue(&path, name, *rotate).with_context(|| path.display().to_string())? {
                Issued::New(token) => {
                    println!("{token}");
                    eprintln!(
                        "console token for {name:?} (shown once; log in at the console on api.ui_listen{})",
                        config
                            .api
                            .ui_listen
                            .map(|a| format!(", http://{a}/"))
                            .unwrap_or_else(
                                || ", which is not set in this configuration".to_owned()
                            )
                    );
                }
                Issued::Exists => {
                    bail!("{name:?} has a token already; --rotate replaces it (its sessions end)")
                }
            }
        }
        ConsoleCommand::Revoke { name } => {
            tokens::revoke(&path, name)?;
            eprintln!("revoked the console token of {name:?}");
        }
        ConsoleCommand::List => {
            for name in tokens::read(&path)?.keys() {
                println!("{name}");
            }
        }
    }
    Ok(())
}
