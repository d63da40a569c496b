//! `egress-agent requests`: the operator's side of workloads' access requests (a client of the
//! control API: `GET /v1/requests`, `POST /v1/requests/{id}/approve|deny`).
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use hyper::Method;
use serde_json::{Value, json};

use crate::api;
use crate::api::client;

/// `egress-agent requests`.
#[derive(Debug, clap::Args)]
pub struct RequestsArgs {
    #[command(subcommand)]
    pub command: Option<RequestsCommand>,
    /// Only the requests waiting for a decision (the list).
    #[arg(long)]
    pub pending: bool,
    /// JSON instead of a table (the list).
    #[arg(long)]
    pub json: bool,
    /// Control API socket.
    #[arg(long, global = true, default_value = api::DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
}

#[derive(Debug, clap::Subcommand)]
pub enum RequestsCommand {
    /// Approve request ID: for the workload that asked alone (`--scope run`, until it ends or
    /// the TTL), or written to its policy for every workload under it (`--scope policy`: a
    /// change with its diff, recorded with who made it).
    Approve {
        id: u64,
        /// run or policy.
        #[arg(long, value_parser = ["run", "policy"])]
        scope: String,
        /// A run grant's lifetime (30m, 2h); without it, the workload's.
        #[arg(long)]
        ttl: Option<String>,
    },
    /// Deny request ID; the workload reads the reason.
    Deny {
        id: u64,
        #[arg(long)]
        reason: String,
    },
}

/// Runs `egress-agent requests ...`.
pub fn run(args: RequestsArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let (method, path, body) = match &args.command {
            None => {
                let path = if args.pending {
                    "/v1/requests?pending=1"
                } else {
                    "/v1/requests"
                };
                (Method::GET, path.to_owned(), None)
            }
            Some(RequestsCommand::Approve { id, scope, ttl }) => {
                let mut b = json!({ "scope": scope });
                if let Some(t) = ttl {
                    b["ttl"] = json!(t);
                }
                (
                    Method::POST,
                    format!("/v1/requests/{id}/approve"),
                    Some(b.to_string()),
                )
            }
            Some(RequestsCommand::Deny { id, reason }) => (
                Method::POST,
                format!("/v1/requests/{id}/deny"),
                Some(json!({ "reason": reason }).to_string()),
            ),
        };
        let (status, text) = client::request_body(
            &args.api_socket,
            method,
            &path,
            body.map(|b| ("application/json", b.into_bytes())),
        )
        .await?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        if !status.is_success() {
            let msg = v["error"].as_str().unwrap_or(text.trim());
            bail!("{msg} ({status})");
        }
        match &args.command {
            None if args.json => println!("{}", serde_json::to_string_pretty(&v)?),
            None => print_table(&v),
            Some(_) => print_decided(&v),
        }
        Ok(())
    })
}

fn print_table(v: &Value) {
    let rows = v.as_array().cloned().unwrap_or_default();
    if rows.is_empty() {
        println!("no access requests");
        return;
    }
    println!(
        "{:>5}  {:<9} {:<24} {:<14} {:<30} REASON",
        "ID", "STATE", "WORKLOAD", "POLICY", "WANTS"
    );
    for r in rows {
        let wants = format!("{}:{}", r["host"].as_str().unwrap_or("?"), r["port"]);
        println!(
            "{:>5}  {:<9} {:<24} {:<14} {:<30} {}",
            r["id"],
            r["state"].as_str().unwrap_or("?"),
            r["workload"].as_str().unwrap_or("?"),
            r["policy"].as_str().unwrap_or("?"),
            wants,
            r["reason"].as_str().unwrap_or("").replace('\n', " "),
        );
    }
}

fn print_decided(v: &Value) {
    let r = &v["request"];
    println!(
        "request {}: {}{}",
        r["id"],
        r["state"].as_str().unwrap_or("?"),
        r["scope"]
            .as_str()
            .map(|s| format!(" (scope {s})"))
            .unwrap_or_default()
    );
    if let Some(d) = v["change"]["diff"].as_str().filter(|d| !d.is_empty()) {
        print!("{d}");
    }
}
