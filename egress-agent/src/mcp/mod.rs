//! `egress-agent mcp`: a Model Context Protocol server on stdio (the official Rust SDK, `rmcp`)
//! for AI assistants. Every tool is a client of the daemon's control API, so the API's access
//! rules apply to it (run it as root, or as a member of `api.read_group` for the read tools).
//!
//! Tools: `list_policies`, `show_policy`, `list_presets`, `explain`, `list_containers`, `recent_denials` (from
//! the event store), `suggest`, `replay` (a proposed policy against the recorded traffic; it
//! changes nothing, but is a `POST`, so the API serves it to root only), `list_changes` (who
//! changed what, with the diff). Write tools — `set_policy`, `delete_policy`, `set_defaults`,
//! `import_bundle` (its diff unless `apply`) —
//! exist only when the server is started with `--allow-writes`; without it they are not listed
//! and a call to them is refused.
use std::path::PathBuf;
use std::sync::Arc;

use hyper::Method;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::client::enc;
use crate::api::{self, client};

/// Options of `egress-agent mcp`.
#[derive(Debug, Clone, clap::Args)]
pub struct McpArgs {
    /// Control API socket.
    #[arg(long, default_value = api::DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
    /// Offer the write tools (set_policy, delete_policy, set_defaults, import_bundle). Off by
    /// default.
    #[arg(long)]
    pub allow_writes: bool,
}

/// The write tools' names.
pub const WRITE_TOOLS: [&str; 5] = [
    "set_policy",
    "delete_policy",
    "set_defaults",
    "import_bundle",
    "decide_request",
];

#[derive(Debug, Clone)]
pub struct EgressMcp {
    socket: Arc<PathBuf>,
    allow_writes: bool,
    tool_router: ToolRouter<Self>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct NameArg {
    /// The policy's name.
    pub name: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ExplainArg {
    /// Explain under this policy (or give `container`).
    #[serde(default)]
    pub policy: Option<String>,
    /// Explain under this container's policy (name or id).
    #[serde(default)]
    pub container: Option<String>,
    /// HOST[:PORT] or ADDR[:PORT]; the port defaults to 443.
    pub target: String,
    /// The client runs in the host's network namespace (`exec`), not a container's.
    #[serde(default)]
    pub host_netns: bool,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct SelectionArg {
    /// How many (newest), default 50.
    #[serde(default)]
    pub n: Option<usize>,
    /// Only since then: 30m, 2h, 7d, or an RFC 3339 time.
    #[serde(default)]
    pub since: Option<String>,
    /// Only this container (name or id prefix).
    #[serde(default)]
    pub container: Option<String>,
    /// Only this policy.
    #[serde(default)]
    pub policy: Option<String>,
    /// Only this verdict: deny or would-deny.
    #[serde(default)]
    pub verdict: Option<String>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct SuggestArg {
    /// Only traffic of this policy.
    #[serde(default)]
    pub policy: Option<String>,
    /// Only traffic of this container.
    #[serde(default)]
    pub container: Option<String>,
    /// Only since then: 30m, 2h, 7d, or an RFC 3339 time.
    #[serde(default)]
    pub since: Option<String>,
    /// Also use denied attempts (default: allowed and would-deny traffic only).
    #[serde(default)]
    pub include_denied: bool,
    /// Name of the suggested policy.
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SetPolicyArg {
    /// The policy's name.
    pub name: String,
    /// The policy's fields as a JSON object (`{"allow_hosts": ["github.com"]}`), or give `toml`.
    #[serde(default)]
    pub policy: Option<serde_json::Map<String, Value>>,
    /// The policy's fields as TOML text (as in a policies.d file).
    #[serde(default)]
    pub toml: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct DeleteArg {
    /// The policy's name.
    pub name: String,
    /// Delete even if containers run under it (they are then confined as deny_all).
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct DefaultsArg {
    /// agent.default_policy: the policy of opted-in containers that name none.
    #[serde(default)]
    pub default_policy: Option<String>,
    /// agent.unlabeled: the policy of containers without egress labels.
    #[serde(default)]
    pub unlabeled: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ImportArg {
    /// The bundle: TOML as `egress-agent policy export` prints it (`[agent]`, `[policies.NAME]`).
    pub toml: String,
    /// Write it; without this only its diff is answered (nothing written).
    #[serde(default)]
    pub apply: bool,
    /// Also remove the policies.d policies the bundle does not name.
    #[serde(default)]
    pub prune: bool,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RequestsArg {
    /// Only the requests waiting for a decision.
    #[serde(default)]
    pub pending: bool,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DecideArg {
    /// The request's id (list_requests).
    pub id: u64,
    /// `approve` or `deny`.
    pub decision: String,
    /// To approve: `run` (the workload that asked, until it ends or the TTL) or `policy`
    /// (written to its policy: a change with its diff).
    #[serde(default)]
    pub scope: Option<String>,
    /// A run grant's lifetime (30m, 2h).
    #[serde(default)]
    pub ttl: Option<String>,
    /// To deny: why (the workload reads it).
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ChangesArg {
    /// How many (the newest; default 100).
    #[serde(default)]
    pub n: Option<usize>,
}

fn text(v: &Value) -> CallToolResult {
    let t = match v {
        Value::String(s) => s.clone(),
        other => serde_json::to_string_pretty(other).unwrap_or_default(),
    };
    CallToolResult::success(vec![ContentBlock::text(t)])
}

fn failure(msg: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(msg.into())])
}

fn selection_query(s: &SelectionArg) -> String {
    let mut q = vec![format!("n={}", s.n.unwrap_or(50))];
    for (k, v) in [
        ("since", &s.since),
        ("container", &s.container),
        ("policy", &s.policy),
        ("verdict", &s.verdict),
    ] {
        if let Some(v) = v {
            q.push(format!("{k}={}", enc(v)));
        }
    }
    q.join("&")
}

impl EgressMcp {
    pub fn new(socket: PathBuf, allow_writes: bool) -> Self {
        let mut tool_router = Self::tool_router();
        if !allow_writes {
            for t in WRITE_TOOLS {
                tool_router.remove_route(t);
            }
        }
        EgressMcp {
            socket: Arc::new(socket),
            allow_writes,
            tool_router,
        }
    }

    /// One API call; a non-2xx answer is the tool's error (with the daemon's message).
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> CallToolResult {
        match client::request_body(&self.socket, method, path, body).await {
            Ok((status, body)) => {
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::String(body.clone()));
                if status.is_success() {
                    text(&v)
                } else {
                    failure(format!(
                        "{} ({status})",
                        v["error"].as_str().unwrap_or(body.trim())
                    ))
                }
            }
            Err(e) => failure(e.to_string()),
        }
    }

    fn writes_allowed(&self) -> Option<CallToolResult> {
        (!self.allow_writes).then(|| {
            failure("write tools are off: start `egress-agent mcp --allow-writes` to use them")
        })
    }
}

#[tool_router]
impl EgressMcp {
    #[tool(
        description = "List the egress policies of this host (effective fields, built-ins included) with the default and unlabelled policy."
    )]
    async fn list_policies(&self) -> CallToolResult {
        let p = self.call(Method::GET, "/v1/policies", None).await;
        let d = self.call(Method::GET, "/v1/defaults", None).await;
        let failed = p.is_error == Some(true) || d.is_error == Some(true);
        let mut content = p.content;
        content.extend(d.content);
        if failed {
            CallToolResult::error(content)
        } else {
            CallToolResult::success(content)
        }
    }

    #[tool(
        description = "List the built-in presets a policy can name (presets = [\"github\", \"python\"]): each with its description, every host it adds to allow_hosts (a plain name on the policy's allow_ports, {host, ports} also on its own ports), its sources and the date it was checked."
    )]
    async fn list_presets(&self) -> CallToolResult {
        self.call(Method::GET, "/v1/presets", None).await
    }

    #[tool(
        description = "Show one policy: where it is defined (built-in, config file, policies.d), its badge and fields, and its TOML."
    )]
    async fn show_policy(&self, Parameters(a): Parameters<NameArg>) -> CallToolResult {
        self.call(Method::GET, &format!("/v1/policies/{}", enc(&a.name)), None)
            .await
    }

    #[tool(
        description = "Explain what egress-agent does with a destination (HOST[:PORT] or ADDR[:PORT]) under a policy or a container's policy: which policy applies and why, which rule decides, what the proxy and the kernel would each do."
    )]
    async fn explain(&self, Parameters(a): Parameters<ExplainArg>) -> CallToolResult {
        let mut q = format!("/v1/explain?target={}", enc(&a.target));
        if let Some(p) = &a.policy {
            q.push_str(&format!("&policy={}", enc(p)));
        }
        if let Some(c) = &a.container {
            q.push_str(&format!("&container={}", enc(c)));
        }
        if a.host_netns {
            q.push_str("&netns=host");
        }
        self.call(Method::GET, &q, None).await
    }

    #[tool(
        description = "List the enforced containers and cgroups with their policy, badge (allow_all, deny_all, allowlist, audit) and counters."
    )]
    async fn list_containers(&self) -> CallToolResult {
        self.call(Method::GET, "/v1/containers", None).await
    }

    #[tool(
        description = "Recent denials and would-denials from the durable event store, newest last; filter by since, container, policy, verdict."
    )]
    async fn recent_denials(&self, Parameters(a): Parameters<SelectionArg>) -> CallToolResult {
        self.call(
            Method::GET,
            &format!("/v1/denials?{}", selection_query(&a)),
            None,
        )
        .await
    }

    #[tool(
        description = "Suggest a minimal allowlist policy (TOML) that would have allowed the traffic observed for a policy or container."
    )]
    async fn suggest(&self, Parameters(a): Parameters<SuggestArg>) -> CallToolResult {
        let mut q = Vec::new();
        for (k, v) in [
            ("policy", &a.policy),
            ("container", &a.container),
            ("since", &a.since),
            ("name", &a.name),
        ] {
            if let Some(v) = v {
                q.push(format!("{k}={}", enc(v)));
            }
        }
        if a.include_denied {
            q.push("include_denied=1".to_owned());
        }
        let r = self
            .call(Method::GET, &format!("/v1/suggest?{}", q.join("&")), None)
            .await;
        // The TOML itself, not its JSON wrapping.
        let toml = r
            .content
            .first()
            .and_then(|c| c.as_text())
            .and_then(|t| serde_json::from_str::<Value>(&t.text).ok())
            .and_then(|v| v["toml"].as_str().map(str::to_owned));
        match (r.is_error, toml) {
            (Some(false), Some(t)) => text(&Value::String(t)),
            _ => r,
        }
    }

    #[tool(
        description = "Before changing a policy: replay the traffic the event store recorded against a proposed policy (the proxy's and the kernel's own decision code) and see what it would newly deny, newly allow and leave unchanged, per destination, with the rule before and after. Changes nothing."
    )]
    async fn replay(&self, Parameters(a): Parameters<api::ReplayBody>) -> CallToolResult {
        self.call(
            Method::POST,
            "/v1/replay",
            Some((
                "application/json",
                serde_json::to_vec(&a).unwrap_or_default(),
            )),
        )
        .await
    }

    #[tool(
        description = "Create or replace a policy (in policies.d), validated exactly like the config file and applied like a reload. Only with --allow-writes."
    )]
    async fn set_policy(&self, Parameters(a): Parameters<SetPolicyArg>) -> CallToolResult {
        if let Some(refused) = self.writes_allowed() {
            return refused;
        }
        let body = match (a.policy, a.toml) {
            (Some(p), None) => (
                "application/json",
                serde_json::to_vec(&p).unwrap_or_default(),
            ),
            (None, Some(t)) => ("application/toml", t.into_bytes()),
            _ => return failure("give exactly one of `policy` (a JSON object) or `toml`"),
        };
        self.call(
            Method::PUT,
            &format!("/v1/policies/{}", enc(&a.name)),
            Some(body),
        )
        .await
    }

    #[tool(description = "Delete a policy from policies.d. Only with --allow-writes.")]
    async fn delete_policy(&self, Parameters(a): Parameters<DeleteArg>) -> CallToolResult {
        if let Some(refused) = self.writes_allowed() {
            return refused;
        }
        let q = if a.force { "?force=1" } else { "" };
        self.call(
            Method::DELETE,
            &format!("/v1/policies/{}{q}", enc(&a.name)),
            None,
        )
        .await
    }

    #[tool(
        description = "The policy changes made through the control API, the console and this server: when, who (uid, and the console operator), what, the diff, applied or refused."
    )]
    async fn list_changes(&self, Parameters(a): Parameters<ChangesArg>) -> CallToolResult {
        self.call(
            Method::GET,
            &format!("/v1/changes?n={}", a.n.unwrap_or(100)),
            None,
        )
        .await
    }

    #[tool(
        description = "Access requests workloads filed from inside (http://egress.internal/v1/requests): who (the workload, its policy and run, as the kernel identified it), what host:port, why, and the decision."
    )]
    async fn list_requests(&self, Parameters(a): Parameters<RequestsArg>) -> CallToolResult {
        let path = if a.pending {
            "/v1/requests?pending=1"
        } else {
            "/v1/requests"
        };
        self.call(Method::GET, path, None).await
    }

    #[tool(
        description = "Decide an access request: approve it for the workload that asked (scope run, optional ttl) or into its policy (scope policy: a change with its diff), or deny it with a reason the workload reads. Only with --allow-writes."
    )]
    async fn decide_request(&self, Parameters(a): Parameters<DecideArg>) -> CallToolResult {
        if let Some(refused) = self.writes_allowed() {
            return refused;
        }
        let (action, body) = match a.decision.as_str() {
            "approve" => ("approve", json!({ "scope": a.scope, "ttl": a.ttl })),
            "deny" => ("deny", json!({ "reason": a.reason })),
            other => return failure(format!("decision {other:?}: approve or deny")),
        };
        // Absent fields are left out (the API refuses a null scope as missing, by name).
        let body: serde_json::Map<String, Value> = body
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        self.call(
            Method::POST,
            &format!("/v1/requests/{}/{action}", a.id),
            Some((
                "application/json",
                serde_json::to_vec(&body).unwrap_or_default(),
            )),
        )
        .await
    }

    #[tool(
        description = "Import a bundle of policies and defaults (TOML, as export prints it): answers the diff; with apply, writes it and reloads. Only with --allow-writes."
    )]
    async fn import_bundle(&self, Parameters(a): Parameters<ImportArg>) -> CallToolResult {
        if let Some(refused) = self.writes_allowed() {
            return refused;
        }
        let mut q = Vec::new();
        if a.apply {
            q.push("apply=1");
        }
        if a.prune {
            q.push("prune=1");
        }
        self.call(
            Method::POST,
            &format!("/v1/import?{}", q.join("&")),
            Some(("application/toml", a.toml.into_bytes())),
        )
        .await
    }

    #[tool(
        description = "Set agent.default_policy and/or agent.unlabeled. Only with --allow-writes."
    )]
    async fn set_defaults(&self, Parameters(a): Parameters<DefaultsArg>) -> CallToolResult {
        if let Some(refused) = self.writes_allowed() {
            return refused;
        }
        let body = json!({ "default_policy": a.default_policy, "unlabeled": a.unlabeled });
        self.call(
            Method::PUT,
            "/v1/defaults",
            Some((
                "application/json",
                serde_json::to_vec(&body).unwrap_or_default(),
            )),
        )
        .await
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for EgressMcp {
    fn get_info(&self) -> ServerConfig {
        let writes = if self.allow_writes {
            "Write tools are on: set_policy, delete_policy, set_defaults, import_bundle change this host's policies; decide_request answers workloads' access requests."
        } else {
            "Read-only: the write tools are off (egress-agent mcp --allow-writes)."
        };
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("egress-agent", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "egress-agent confines containers' network egress by policy. Use explain to see why a destination is allowed or refused, recent_denials and suggest to build an allowlist, replay to see what a changed policy would break before saving it. {writes}"
            ))
    }
}

/// Serve MCP on stdin/stdout until the client closes it.
pub async fn serve_stdio(args: McpArgs) -> anyhow::Result<()> {
    let server = EgressMcp::new(args.api_socket, args.allow_writes);
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| anyhow::anyhow!("MCP initialisation: {e}"))?;
    running
        .waiting()
        .await
        .map_err(|e| anyhow::anyhow!("MCP server: {e}"))?;
    Ok(())
}
