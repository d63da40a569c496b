//! `egress-agent policy ...` and `egress-agent explain`: clients of the control API.
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use hyper::{Method, StatusCode};
use serde_json::Value;

use crate::api;
use crate::api::client::{self, enc};

/// `egress-agent policy`.
#[derive(Debug, clap::Args)]
pub struct PolicyArgs {
    #[command(subcommand)]
    pub command: PolicyCommand,
    /// Control API socket.
    #[arg(long, global = true, default_value = api::DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
}

#[derive(Debug, clap::Subcommand)]
pub enum PolicyCommand {
    /// List the policies: badge, where each is defined, which is the default and the unlabelled.
    List {
        /// JSON (the effective policies) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one policy (TOML, as it would be written in policies.d).
    Show {
        name: String,
        /// JSON (source, file, badge, fields).
        #[arg(long)]
        json: bool,
    },
    /// Create or replace a policy from a file of its fields (TOML, or JSON with --json; `-` is
    /// standard input). It goes to policies.d/<name>.toml and is applied like a reload.
    Set {
        name: String,
        file: PathBuf,
        /// The file is JSON.
        #[arg(long)]
        json: bool,
        /// Validate only; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete a policy from policies.d (refused while containers run under it unless --force).
    Delete {
        name: String,
        /// Delete even if containers use it (they are then confined as deny_all).
        #[arg(long)]
        force: bool,
    },
    /// Show, or set, agent.default_policy and agent.unlabeled.
    Defaults {
        /// The policy of opted-in containers that name none.
        #[arg(long)]
        default_policy: Option<String>,
        /// The policy of containers without egress labels.
        #[arg(long)]
        unlabeled: Option<String>,
    },
    /// Print everything needed to reproduce this host's policies (TOML; a config fragment).
    Export {
        /// JSON instead of TOML.
        #[arg(long)]
        json: bool,
    },
    /// Show what importing a bundle (an export) would change; apply it only with --apply.
    Import {
        /// The bundle (TOML, or JSON with --json; `-` is standard input).
        file: PathBuf,
        #[arg(long)]
        json: bool,
        /// Apply the changes (default: a dry run that prints the diff).
        #[arg(long)]
        apply: bool,
        /// Also delete policies.d policies the bundle doesn't have.
        #[arg(long)]
        prune: bool,
    },
}

/// `egress-agent explain`.
#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    /// The container whose policy to use (name or id; its labels are resolved as the enforcer
    /// resolves them).
    #[arg(
        long,
        conflicts_with_all = ["policy", "pod"],
        required_unless_present_any = ["policy", "pod"]
    )]
    pub container: Option<String>,
    /// The Kubernetes pod whose policy to use, NAMESPACE/NAME (its annotations and namespace
    /// default resolved as the containerd runtime resolves them).
    #[arg(long, conflicts_with = "policy")]
    pub pod: Option<String>,
    /// The policy to use, by name.
    #[arg(long)]
    pub policy: Option<String>,
    /// HOST[:PORT] or ADDR[:PORT] ([v6]:PORT); the port defaults to 443.
    pub target: String,
    /// The client runs in the host's network namespace (`exec`), not a container's own.
    #[arg(long)]
    pub host_netns: bool,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
    /// Explain against this configuration file instead of asking the daemon (--policy only).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Control API socket.
    #[arg(long, default_value = api::DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn read_input(file: &Path) -> Result<Vec<u8>> {
    if file == Path::new("-") {
        let mut v = Vec::new();
        std::io::stdin()
            .read_to_end(&mut v)
            .context("reading standard input")?;
        return Ok(v);
    }
    std::fs::read(file).with_context(|| format!("reading {}", file.display()))
}

/// A non-2xx answer as an error with the daemon's message (`error`), and for a 422 of a
/// configuration error nothing else is needed: its `error` is `file:line:column: field: reason`.
fn check(status: StatusCode, body: &str) -> Result<Value> {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::String(body.to_owned()));
    if status.is_success() {
        return Ok(v);
    }
    let msg = v["error"]
        .as_str()
        .map_or_else(|| body.trim().to_owned(), str::to_owned);
    bail!("{msg} ({status})")
}

async fn call(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
) -> Result<Value> {
    let (status, text) = client::request_body(socket, method, path, body).await?;
    check(status, &text)
}

async fn call_text(socket: &Path, path: &str) -> Result<String> {
    let (status, text) = client::request_body(socket, Method::GET, path, None).await?;
    if !status.is_success() {
        check(status, &text)?;
    }
    Ok(text)
}

fn content_type(json: bool) -> &'static str {
    if json {
        "application/json"
    } else {
        "application/toml"
    }
}

fn print_change(v: &Value) {
    if let Some(d) = v["diff"].as_str().filter(|d| !d.is_empty()) {
        print!("{d}");
    }
    let files: Vec<&str> = v["files"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if v["dry_run"] == true {
        if v["would_change"] == true {
            println!("dry run: would write {}", files.join(", "));
        } else {
            println!("dry run: nothing to change");
        }
    } else if v["changed"] == true {
        println!("applied: {}", files.join(", "));
    } else {
        println!("nothing to change");
    }
}

/// `policy show`'s note under the TOML: every host each preset of the policy adds, as comments
/// (nothing when it names none).
fn preset_comment(preset_hosts: &Value) -> String {
    let Some(presets) = preset_hosts.as_object().filter(|o| !o.is_empty()) else {
        return String::new();
    };
    let mut out = String::from(
        "# presets add these allow_hosts entries (a name: allow_ports; ports: those too):\n",
    );
    for (name, hosts) in presets {
        let shown: Vec<String> = hosts
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|h| match (h.as_str(), h["host"].as_str()) {
                (Some(name), _) => name.to_owned(),
                (None, Some(host)) => {
                    let ports: Vec<String> = h["ports"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                        .iter()
                        .map(Value::to_string)
                        .collect();
                    format!("{host} (ports {})", ports.join(", "))
                }
                (None, None) => h.to_string(),
            })
            .collect();
        out.push_str(&format!("#   {name}: {}\n", shown.join(", ")));
    }
    out
}

/// Runs `egress-agent policy ...`.
// Long: one arm per `policy` subcommand, each asking the API and printing its answer.
pub fn policy(args: PolicyArgs) -> Result<()> {
    let socket = args.api_socket.clone();
    runtime()?.block_on(async move {
        match args.command {
            PolicyCommand::List { json } => {
                let all = call(&socket, Method::GET, "/v1/policies", None).await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&all)?);
                    return Ok(());
                }
                let defaults = call(&socket, Method::GET, "/v1/defaults", None).await?;
                println!("{:<24} {:<10} {:<11} ROLE", "POLICY", "BADGE", "SOURCE");
                for name in all
                    .as_object()
                    .map(|o| o.keys().cloned().collect::<Vec<_>>())
                    .unwrap_or_default()
                {
                    let d = call(
                        &socket,
                        Method::GET,
                        &format!("/v1/policies/{}", enc(&name)),
                        None,
                    )
                    .await?;
                    let mut role = Vec::new();
                    if defaults["default_policy"] == name.as_str() {
                        role.push("default");
                    }
                    if defaults["unlabeled"] == name.as_str() {
                        role.push("unlabeled");
                    }
                    println!(
                        "{:<24} {:<10} {:<11} {}",
                        name,
                        d["badge"].as_str().unwrap_or("?"),
                        d["source"].as_str().unwrap_or("?"),
                        role.join(", ")
                    );
                }
                Ok(())
            }
            PolicyCommand::Show { name, json } => {
                let d = call(
                    &socket,
                    Method::GET,
                    &format!("/v1/policies/{}", enc(&name)),
                    None,
                )
                .await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&d)?);
                } else {
                    println!(
                        "# policy {name} ({}{})",
                        d["source"].as_str().unwrap_or("?"),
                        d["file"]
                            .as_str()
                            .map(|f| format!(", {f}"))
                            .unwrap_or_default()
                    );
                    print!("{}", d["toml"].as_str().unwrap_or_default());
                    print!("{}", preset_comment(&d["preset_hosts"]));
                }
                Ok(())
            }
            PolicyCommand::Set {
                name,
                file,
                json,
                dry_run,
            } => {
                let body = read_input(&file)?;
                let q = if dry_run { "?dry_run=1" } else { "" };
                let v = call(
                    &socket,
                    Method::PUT,
                    &format!("/v1/policies/{}{q}", enc(&name)),
                    Some((content_type(json), body)),
                )
                .await?;
                print_change(&v);
                Ok(())
            }
            PolicyCommand::Delete { name, force } => {
                let q = if force { "?force=1" } else { "" };
                let v = call(
                    &socket,
                    Method::DELETE,
                    &format!("/v1/policies/{}{q}", enc(&name)),
                    None,
                )
                .await?;
                print_change(&v);
                Ok(())
            }
            PolicyCommand::Defaults {
                default_policy,
                unlabeled,
            } => {
                if default_policy.is_none() && unlabeled.is_none() {
                    let d = call(&socket, Method::GET, "/v1/defaults", None).await?;
                    println!("default_policy = {}", d["default_policy"]);
                    println!("unlabeled = {}", d["unlabeled"]);
                    return Ok(());
                }
                let body = serde_json::to_vec(&serde_json::json!({
                    "default_policy": default_policy, "unlabeled": unlabeled,
                }))?;
                let v = call(
                    &socket,
                    Method::PUT,
                    "/v1/defaults",
                    Some(("application/json", body)),
                )
                .await?;
                print_change(&v);
                Ok(())
            }
            PolicyCommand::Export { json } => {
                if json {
                    let v = call(&socket, Method::GET, "/v1/export", None).await?;
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", call_text(&socket, "/v1/export?format=toml").await?);
                }
                Ok(())
            }
            PolicyCommand::Import {
                file,
                json,
                apply,
                prune,
            } => {
                let body = read_input(&file)?;
                let mut q = vec![];
                if apply {
                    q.push("apply=1");
                }
                if prune {
                    q.push("prune=1");
                }
                let path = if q.is_empty() {
                    "/v1/import".to_owned()
                } else {
                    format!("/v1/import?{}", q.join("&"))
                };
                let v = call(
                    &socket,
                    Method::POST,
                    &path,
                    Some((content_type(json), body)),
                )
                .await?;
                print_change(&v);
                Ok(())
            }
        }
    })
}

/// Renders an explanation for people.
pub fn render_explanation(v: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
    let verdict = |k: &Value| {
        let mut out = s(&k["verdict"]);
        if let Some(r) = k["reason"].as_str() {
            out.push_str(&format!(" ({r})"));
        }
        if let Some(r) = k["rule"].as_str() {
            out.push_str(&format!(": {r}"));
        }
        // same_tree_only: what another tree's (or an unconfined) server gets.
        if let Some(o) = k["otherwise"]["verdict"].as_str() {
            out.push_str(&format!("; otherwise {o}"));
            if let Some(r) = k["otherwise"]["reason"].as_str() {
                out.push_str(&format!(" ({r})"));
            }
        }
        out
    };
    let mut out = format!(
        "policy:  {} [{}] — {}\n",
        s(&v["policy"]["name"]),
        s(&v["policy"]["badge"]),
        s(&v["policy"]["why"])
    );
    if let Some(c) = v.get("pod") {
        out.push_str(&format!(
            "pod:     {} (enforced as {})\n",
            s(&c["name"]),
            c["enforced_as"].as_str().unwrap_or("-")
        ));
    }
    if let Some(c) = v.get("container") {
        out.push_str(&format!(
            "container: {} (enforced as {})\n",
            s(&c["name"]),
            c["enforced_as"].as_str().unwrap_or("-")
        ));
    }
    out.push_str(&format!(
        "target:  {}:{}\n",
        s(&v["target"]["host"]),
        v["target"]["port"]
    ));
    if v["proxy"].is_object() {
        out.push_str(&format!("proxy:   {}", verdict(&v["proxy"])));
        if v["proxy"]["intercepted"] == true {
            out.push_str(" [TLS intercepted: credentials / request rules]");
        }
        out.push('\n');
    }
    let k = &v["kernel"];
    for (key, label) in [
        ("direct_tcp", "kernel:  direct TCP"),
        ("direct_udp", "kernel:  direct UDP"),
        ("to_proxy_endpoint", "kernel:  to the proxy endpoint"),
    ] {
        if k[key].is_object() {
            out.push_str(&format!("{label}: {}\n", verdict(&k[key])));
        }
    }
    if let Some(d) = k["direct"].as_str() {
        out.push_str(&format!("kernel:  {d}\n"));
    }
    if let Some(h) = v.get("host_services") {
        out.push_str(&format!(
            "host services: ports {} at {}\n",
            h["ports"],
            s(&h["at"])
        ));
    }
    out.push_str(&format!("summary: {}\n", s(&v["summary"])));
    out
}

/// Runs `egress-agent explain`.
pub fn explain(args: ExplainArgs) -> Result<()> {
    let v = match &args.config {
        Some(path) => {
            let Some(name) = &args.policy else {
                bail!("--config explains a --policy (a container's policy comes from the daemon)");
            };
            let config = crate::config::Config::load(path)?;
            let policy = config
                .policy(name)
                .ok_or_else(|| anyhow!("no policy named {name:?} in {}", path.display()))?;
            let target = egress_policy::explain::Target::parse(&args.target)?;
            let netns = if args.host_netns {
                egress_policy::kernel_eval::Netns::Host
            } else {
                egress_policy::kernel_eval::Netns::Own
            };
            let chosen = egress_policy::explain::Chosen {
                name: name.clone(),
                why: "asked for by name".to_owned(),
            };
            egress_policy::explain::explain(
                config.proxy.explain_endpoint(),
                &chosen,
                policy,
                &target,
                netns,
            )
        }
        None => {
            let mut q = format!("/v1/explain?target={}", enc(&args.target));
            if let Some(p) = &args.policy {
                q.push_str(&format!("&policy={}", enc(p)));
            }
            if let Some(c) = &args.container {
                q.push_str(&format!("&container={}", enc(c)));
            }
            if let Some(p) = &args.pod {
                q.push_str(&format!("&pod={}", enc(p)));
            }
            if args.host_netns {
                q.push_str("&netns=host");
            }
            let socket = args.api_socket.clone();
            runtime()?.block_on(async move { call(&socket, Method::GET, &q, None).await })?
        }
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", render_explanation(&v));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn policy_show_notes_every_host_of_its_presets() {
        assert_eq!(super::preset_comment(&json!({})), "");
        assert_eq!(super::preset_comment(&serde_json::Value::Null), "");
        let note = super::preset_comment(&json!({
            "github": ["api.github.com", { "host": "github.com", "ports": [22] }],
            "go": ["proxy.golang.org"],
        }));
        assert_eq!(
            note,
            "# presets add these allow_hosts entries (a name: allow_ports; ports: those too):\n\
             #   github: api.github.com, github.com (ports 22)\n\
             #   go: proxy.golang.org\n"
        );
    }

    #[test]
    fn explain_text_says_where_host_services_open() {
        let v = json!({
            "policy": {"name": "agent", "badge": "allowlist", "why": "asked for"},
            "target": {"host": "172.17.0.1", "port": 11434},
            "kernel": {},
            "host_services": {"ports": [11434], "at": "the workload's own host only"},
            "summary": "refused",
        });
        let text = super::render_explanation(&v);
        assert!(
            text.contains("host services: ports [11434] at the workload's own host only\n"),
            "{text}"
        );
    }
}
