//! The daemon's answers to the newer endpoints (policies, explain, the store, doctor), as plain
//! functions of the running configuration, so the daemon's [`super::Control`] impl stays one
//! line per method.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::{Value, json};

use super::{ApiError, ExplainQuery, ReplayBody, StoreQuery};
use crate::config::Config;
use crate::manage::{self, Change, ChangeLog, Who};
use crate::store::{Store, changes::ChangeRecord};
use egress_policy::explain::{self, Chosen, Target};
use egress_policy::kernel_eval::Netns;

/// The enforced cgroups (`status`), each with its container name (Docker) and its policy's
/// badge (`allow_all`, `deny_all`, `allowlist`, `audit`).
pub fn containers(config: &Config) -> Value {
    let status = match crate::status::collect(&config.agent.bpffs) {
        Ok(s) => s,
        Err(e) => return json!({ "error": e.to_string() }),
    };
    let rows: Vec<Value> = status
        .cgroups
        .iter()
        .map(|c| {
            let mut v = serde_json::to_value(c).unwrap_or(Value::Null);
            let owner = c.owner.as_deref();
            let (kind, container) = match owner.and_then(|o| o.split_once(':')) {
                Some(("docker", name)) => (Some("docker"), Some(name)),
                Some(("pod", name)) => (Some("pod"), Some(name)),
                Some(("exec", _)) => (Some("exec"), owner),
                _ => (None, None),
            };
            let badge = match (c.policy.as_deref().and_then(|p| config.policy(p)), c.mode) {
                (Some(p), _) => p.badge(),
                // Inline (label) policies are allowlists; no entry at all is refused.
                (None, Some(m)) => m,
                (None, None) => "deny_all",
            };
            v["container"] = json!(container);
            v["kind"] = json!(kind);
            v["badge"] = json!(badge);
            v
        })
        .collect();
    Value::Array(rows)
}

/// `GET /v1/presets`: every built-in preset with all its hosts (in the `allow_hosts` forms), its
/// description, sources and the date it was checked. The data is built in: no daemon state.
pub fn presets() -> Value {
    let all: Vec<&egress_policy::presets::Preset> =
        egress_policy::presets::Presets::builtin().iter().collect();
    serde_json::to_value(all).unwrap_or(Value::Null)
}

/// Policy name → the containers running under it.
pub fn in_use(config: &Config) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Ok(s) = crate::status::collect(&config.agent.bpffs) {
        for c in s.cgroups {
            if let (Some(p), Some(o)) = (c.policy, c.owner) {
                out.entry(p).or_default().push(o);
            }
        }
    }
    out
}

pub fn defaults(config_path: &Path, config: &Config) -> Value {
    json!({
        "default_policy": config.agent.default_policy,
        "unlabeled": config.agent.unlabeled,
        "file": config_path.display().to_string(),
        "policies_dir": manage::dir::policies_dir(config_path).display().to_string(),
        // What the console may change, and why not where it can't.
        "editable": manage::sources::read(config_path, config),
    })
}

fn netns(q: &ExplainQuery) -> Result<Netns, ApiError> {
    match q.netns.as_deref() {
        None | Some("own") => Ok(Netns::Own),
        Some("host") => Ok(Netns::Host),
        Some(other) => Err(ApiError::new(
            400,
            format!("netns {other:?}: own (a container) or host (exec)"),
        )),
    }
}

/// `GET /v1/explain`: by policy name, or by container (its labels resolved as the enforcer
/// resolves them).
pub async fn explain(
    config: &Config,
    docker_socket: &str,
    q: ExplainQuery,
) -> Result<Value, ApiError> {
    let target = Target::parse(&q.target).map_err(|e| ApiError::new(400, e))?;
    let netns = netns(&q)?;
    match (&q.policy, &q.container) {
        (None, None) if q.pod.is_some() => {
            let pod = q.pod.as_deref().unwrap_or_default();
            explain_pod(config, pod, &target, netns).await
        }
        (Some(name), None) if q.pod.is_none() => {
            let policy = config
                .policy(name)
                .ok_or_else(|| ApiError::new(404, format!("no policy named {name:?}")))?;
            let chosen = Chosen {
                name: name.clone(),
                why: "asked for by name".to_owned(),
            };
            Ok(explain::explain(
                config.proxy.explain_endpoint(),
                &chosen,
                policy,
                &target,
                netns,
            ))
        }
        (None, Some(id)) if q.pod.is_none() => {
            let docker =
                bollard::Docker::connect_with_unix(docker_socket, 10, bollard::API_DEFAULT_VERSION)
                    .map_err(|e| ApiError::new(503, format!("connecting to Docker: {e}")))?;
            let c = docker
                .inspect_container(
                    id,
                    None::<bollard::query_parameters::InspectContainerOptions>,
                )
                .await
                .map_err(|e| ApiError::new(404, format!("inspecting container {id}: {e}")))?;
            let labels = c.config.and_then(|c| c.labels).unwrap_or_default();
            let resolved = crate::workload::labels::resolve(
                labels.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                config,
            );
            let why = crate::check::why(&resolved.source);
            let mut v = explain_resolved(config, &resolved, why, &target, netns);
            let name = c
                .name
                .unwrap_or_default()
                .trim_start_matches('/')
                .to_owned();
            let enforced = enforced_as(config, &format!("docker:{name}"));
            v["container"] = json!({ "id": c.id, "name": name, "enforced_as": enforced });
            Ok(v)
        }
        _ => Err(ApiError::new(
            400,
            "give exactly one of policy=NAME, container=NAME or pod=NAMESPACE/NAME",
        )),
    }
}

/// `explain` of a workload's resolved policy, with the reason it got it.
fn explain_resolved(
    config: &Config,
    resolved: &crate::workload::labels::Resolved,
    why: String,
    target: &Target,
    netns: Netns,
) -> Value {
    let chosen = Chosen {
        name: resolved.name.clone(),
        why,
    };
    explain::explain(
        config.proxy.explain_endpoint(),
        &chosen,
        &resolved.policy,
        target,
        netns,
    )
}

/// The policy name the kernel entry of `owner` (`docker:NAME`, `pod:NS/NAME`) was written with.
fn enforced_as(config: &Config, owner: &str) -> Option<String> {
    crate::status::collect(&config.agent.bpffs)
        .ok()?
        .cgroups
        .into_iter()
        .find(|g| g.owner.as_deref() == Some(owner))
        .and_then(|g| g.policy)
}

/// `explain` for a pod: its sandbox's record from containerd, its annotations resolved as the
/// containerd runtime resolves them.
async fn explain_pod(
    config: &Config,
    pod: &str,
    target: &Target,
    netns: Netns,
) -> Result<Value, ApiError> {
    use crate::containerd::{client, pod as pods};
    let Some((ns, name)) = pod.split_once('/') else {
        return Err(ApiError::new(
            400,
            format!("pod {pod:?}: expected NAMESPACE/NAME"),
        ));
    };
    let Some(k8s) = &config.kubernetes else {
        return Err(ApiError::new(
            400,
            "no [kubernetes] section in the configuration: pods are not enforced",
        ));
    };
    let c = client::Client::connect(&k8s.containerd_socket, &k8s.containerd_namespace)
        .await
        .map_err(|e| ApiError::new(503, e.to_string()))?;
    let records = c
        .list()
        .await
        .map_err(|e| ApiError::new(503, e.to_string()))?;
    let sandbox = records
        .iter()
        .filter_map(|r| {
            let (labels, spec) = client::parts(r);
            match pods::classify(&r.id, labels, spec, &k8s.cgroup_root) {
                Ok(pods::Record::Sandbox(sb)) => Some(sb),
                _ => None,
            }
        })
        .find(|sb| sb.pod.namespace == ns && sb.pod.name == name)
        .ok_or_else(|| ApiError::new(404, format!("no pod {pod} in containerd")))?;
    let resolved = crate::workload::labels::resolve_pod(
        sandbox
            .annotations
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str())),
        ns,
        config,
    );
    let why = match &resolved.source {
        crate::workload::labels::Source::Namespace => {
            format!("no egress.* annotation: namespace {ns:?}'s default applies")
        }
        crate::workload::labels::Source::Unlabeled => {
            "no egress.* annotation and no namespace default: agent.unlabeled applies".to_owned()
        }
        source => crate::workload::labels::label_to_annotation(&crate::check::why(source)),
    };
    let mut v = explain_resolved(config, &resolved, why, target, netns);
    let enforced = enforced_as(config, &format!("pod:{pod}"));
    v["pod"] = json!({ "sandbox": sandbox.id, "name": pod, "uid": sandbox.pod.uid, "enforced_as": enforced });
    Ok(v)
}

fn open_store(config: &Config) -> Result<Store, ApiError> {
    if !config.store.enabled {
        return Err(ApiError::new(
            503,
            "the event store is off (store.enabled = false)",
        ));
    }
    Store::open_read_only(&config.agent.store_path())
        .map_err(|e| ApiError::new(503, format!("the event store: {e}")))
}

/// Stored denials and would-denials (never allowed traffic) for a selection.
pub fn denials(config: &Config, q: &StoreQuery) -> Result<Vec<Value>, ApiError> {
    let store = open_store(config)?;
    let filter = q.selection.filter().map_err(|e| ApiError::new(400, e))?;
    if filter.verdict == Some(crate::events::Verdict::Allow) {
        return Err(ApiError::new(
            400,
            "denials are deny and would-deny events; allowed traffic is in flows",
        ));
    }
    let events = store
        .events(&filter, 0, q.n)
        .map_err(|e| ApiError::new(500, e))?;
    Ok(events
        .into_iter()
        .filter_map(|e| serde_json::to_value(e.event).ok())
        .collect())
}

/// `suggest` for a selection: the TOML `egress-agent suggest` prints.
pub fn suggest(config: &Config, q: &StoreQuery) -> Result<String, ApiError> {
    let store = open_store(config)?;
    let filter = q.selection.filter().map_err(|e| ApiError::new(400, e))?;
    let flows = store.flows(&filter).map_err(|e| ApiError::new(500, e))?;
    let opts = crate::suggest::command::SuggestOptions {
        selection: q.selection.clone(),
        include_denied: q.include_denied,
        diff: false,
        name: q.name.clone(),
        config: None,
    };
    crate::suggest::command::suggest_from(&flows, config, &opts).map_err(|e| ApiError::new(400, e))
}

/// The fields of the one policy a `suggest` answer renders (`[policies.NAME]` …) as JSON, as
/// `PUT /v1/policies/{name}` takes them: the console makes a new policy from them. `None` if the
/// text holds no single policy (the `--diff` form).
pub fn suggested_fields(rendered: &str) -> Option<Value> {
    let table: toml::Table = toml::from_str(rendered).ok()?;
    let policies = table.get("policies")?.as_table()?;
    match policies.values().collect::<Vec<_>>().as_slice() {
        [one] => serde_json::to_value(one).ok(),
        _ => None,
    }
}

/// Where a replayed policy's errors say it came from.
const REPLAY_ORIGIN: &str = "<request body>";

/// `POST /v1/replay`: the store's flows of the body's selection decided again under its policy;
/// the report as `egress-agent replay --json` prints it. Reads the store off the runtime's
/// threads (a large store takes a second or two); changes nothing.
pub async fn replay(config: std::sync::Arc<Config>, body: ReplayBody) -> Result<Value, ApiError> {
    match tokio::task::spawn_blocking(move || replay_now(&config, body)).await {
        Ok(answer) => answer,
        Err(e) => Err(ApiError::new(500, format!("replay: {e}"))),
    }
}

fn replay_now(config: &Config, body: ReplayBody) -> Result<Value, ApiError> {
    use crate::replay::command::{self as cmd, ReplayError};
    let origin = Path::new(REPLAY_ORIGIN);
    let text = manage::json_to_toml(&Value::Object(body.policy))
        .map_err(|m| ApiError::field(400, "policy", format!("request body: policy: {m}")))?;
    // Loaded as the policies.d file `PUT /v1/policies/{name}` would write: a 422 names the field
    // exactly as the configuration's loader does.
    let file = crate::config::policies_dir::PolicyFile {
        name: body.name.clone(),
        path: origin.to_owned(),
        text,
    };
    let loaded = Config::load_parts_with(origin, "", vec![file], crate::config::Secrets::Skip)
        .map_err(|e| ApiError::from(manage::ManageError::Invalid(e)))?;
    let policy = loaded
        .policies
        .get(&body.name)
        .ok_or_else(|| ApiError::new(500, "replay: the policy did not load"))?;
    let proposed =
        crate::replay::Proposed::new(&body.name, policy, config.proxy.explain_endpoint());
    let opts = cmd::ReplayOptions {
        selection: crate::store::selection::Selection {
            since: body.since,
            container: body.container,
            run: body.run,
            labels: body
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect(),
            namespace: body.namespace,
            pod: body.pod,
            ..Default::default()
        },
        against: body.against,
        limit: body.limit.unwrap_or(cmd::DEFAULT_LIMIT),
    };
    let store = open_store(config)?;
    let report = cmd::replay_store(&store, &proposed, &opts).map_err(|e| match e {
        // `--since "x": ...` names the command's flag: the body's field has the same name.
        ReplayError::Selection(m) => {
            let flag = m
                .trim_start_matches("--")
                .split([' ', ':'])
                .next()
                .unwrap_or("");
            let field = if flag == "label" { "labels" } else { flag };
            ApiError::field(400, field, m.replacen("--", "", 1))
        }
        ReplayError::Against(_) => ApiError::field(400, "against", e),
        other => ApiError::new(500, other),
    })?;
    Ok(cmd::to_json(&report, &cmd::About::new(&proposed, &opts)))
}

pub fn changes(config: &Config, n: usize) -> Result<Vec<Value>, ApiError> {
    let store = open_store(config)?;
    let rows = store.changes(n).map_err(|e| ApiError::new(500, e))?;
    Ok(rows
        .into_iter()
        .filter_map(|r| serde_json::to_value(r).ok())
        .collect())
}

/// The doctor's probes as the running daemon sees itself, run off the runtime's threads. The
/// doctor's own discovery skips the calling process (it is meant for `egress-agent doctor`), so
/// the daemon names its policy listeners (from the pins) and the Docker socket it really uses.
/// `interception`: the daemon's own view of interception (what it loaded, `env` secrets
/// included), for `proxy.interception`.
pub async fn doctor(
    config: &Config,
    docker_socket: &str,
    interception: Option<crate::doctor::interception::InterceptionView>,
    workload_secrets: Option<crate::doctor::workloads::WorkloadSecretsView>,
) -> Value {
    let mut opts = crate::doctor::Options::from_config(config);
    if interception.is_some() {
        opts.interception = interception;
    }
    opts.workload_secrets = workload_secrets;
    opts.docker_socket = PathBuf::from(
        docker_socket
            .strip_prefix("unix://")
            .unwrap_or(docker_socket),
    );
    let bpffs = config.agent.bpffs.clone();
    let run = move || {
        if let Ok(s) = crate::status::collect(&bpffs) {
            let mut listeners: Vec<std::net::SocketAddr> = s
                .cgroups
                .iter()
                .flat_map(|c| c.listener.iter().filter_map(|l| l.parse().ok()))
                .collect();
            listeners.sort();
            listeners.dedup();
            opts.proxy_listeners = listeners;
        }
        crate::doctor::run(opts)
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(report) => serde_json::to_value(&report).unwrap_or(Value::Null),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

/// Records changes in the event store's `changes` table (and the log, always).
pub struct StoreChangeLog {
    /// `None`: the store is off; changes are only logged.
    pub db: Option<PathBuf>,
}

impl ChangeLog for StoreChangeLog {
    fn record(&self, who: &Who, change: &Change, files: &[PathBuf], diff: &str, result: &str) {
        tracing::info!(uid = who.uid, pid = ?who.pid, identity = ?who.identity,
            action = change.action(), target = %change.target(), result, "policy change");
        let Some(db) = &self.db else { return };
        let rec = ChangeRecord {
            id: 0,
            time: SystemTime::now(),
            uid: who.uid,
            pid: who.pid,
            identity: who.identity.clone(),
            action: change.action().to_owned(),
            target: change.target(),
            files: files.iter().map(|f| f.display().to_string()).collect(),
            diff: diff.to_owned(),
            result: result.to_owned(),
        };
        if let Err(e) = Store::open(db).and_then(|s| s.record_change(&rec)) {
            tracing::error!(error = %e, "could not record a policy change in the event store");
        }
    }
}

/// Decide access request `id` as `who` ([`crate::asks`]): a run grant goes to the listener that
/// asked; a policy approval is the change `PUT /v1/policies/{name}` would make with the host
/// added (made through `change`: validated, written, reloaded, recorded with who and the diff),
/// recorded on the request only once it applied; a denial carries its reason back.
/// `dry_run`: decide nothing; answer what an approval would do (a policy approval's diff, made
/// by `change` as a dry run — the console shows it before anyone applies).
#[expect(
    clippy::too_many_arguments,
    reason = "one call per Control implementation"
)]
pub async fn decide<'a, F, Fut>(
    asks: &crate::asks::Asks,
    id: u64,
    decision: crate::asks::Decision,
    who: manage::Who,
    change: F,
    config_path: &Path,
    config: &Config,
    dry_run: bool,
) -> Result<Value, ApiError>
where
    F: FnOnce(manage::Change, manage::Who) -> Fut,
    Fut: std::future::Future<Output = Result<Value, ApiError>> + 'a,
{
    use crate::asks::{Decision, Outcome, Scope};
    let by = who
        .identity
        .clone()
        .unwrap_or_else(|| format!("uid {}", who.uid));
    if dry_run {
        let v = asks.pending(id)?;
        return match decision {
            Decision::Approve {
                scope: Scope::Policy,
                ..
            } => {
                let c = grant_change(config_path, config, &v.policy, &v.host, v.port)?;
                change(c, who).await
            }
            Decision::Approve { .. } => Ok(json!({
                "dry_run": true,
                "would_change": true,
                "grant": format!("{}:{} for {} alone, while it runs", v.host, v.port, v.workload),
                "diff": "",
            })),
            Decision::Deny { .. } => {
                Ok(json!({ "dry_run": true, "would_change": false, "diff": "" }))
            }
        };
    }
    let view = match decision {
        Decision::Deny { reason } => asks.decide(id, Outcome::Denied { by, reason })?,
        Decision::Approve {
            scope: Scope::Run,
            ttl,
        } => asks.approve_run(id, &by, ttl)?,
        Decision::Approve {
            scope: Scope::Policy,
            ..
        } => {
            let v = asks.pending(id)?;
            let c = grant_change(config_path, config, &v.policy, &v.host, v.port)?;
            let applied = change(c, who).await?;
            let view = asks.decide(
                id,
                Outcome::Approved {
                    scope: Scope::Policy,
                    by,
                    until: None,
                },
            )?;
            return Ok(json!({ "request": view, "change": applied }));
        }
    };
    Ok(json!({ "request": view }))
}

/// The change that adds `host:port` to policy `name`: its host alone when the policy allows
/// that port everywhere, else `{ host, ports = [port] }`.
fn grant_change(
    config_path: &Path,
    config: &Config,
    name: &str,
    host: &str,
    port: u16,
) -> Result<manage::Change, ApiError> {
    let described = manage::describe(config_path, config, name)
        .ok_or_else(|| ApiError::new(409, format!("policy {name:?} no longer exists")))?;
    if let Some(why) = described["read_only"].as_str() {
        return Err(ApiError::new(
            409,
            format!("scope policy: {why}; approve with scope run, or change the source"),
        ));
    }
    let mut body = described["policy"].as_object().cloned().unwrap_or_default();
    if body.get("mode").and_then(Value::as_str) == Some("deny_all") {
        body.remove("mode");
    }
    // The fields at their defaults are left out, so the file says what the policy does and the
    // diff shows the one host added (as the console writes policies).
    body.retain(|k, v| match (k.as_str(), v) {
        ("allow_hosts", _) => true,
        ("allow_ports", Value::Array(a)) => a.as_slice() != [json!(443)],
        (_, Value::Array(a)) => !a.is_empty(),
        ("allow_published_ports", Value::Bool(true)) => false,
        ("mode", Value::String(m)) => m != "allowlist",
        _ => true,
    });
    let everywhere = body
        .get("allow_ports")
        .and_then(Value::as_array)
        .is_some_and(|p| p.iter().any(|p| p.as_u64() == Some(u64::from(port))));
    let entry = if everywhere {
        json!(host)
    } else {
        json!({ "host": host, "ports": [port] })
    };
    match body.get_mut("allow_hosts").and_then(Value::as_array_mut) {
        Some(list) => list.push(entry),
        None => {
            body.insert("allow_hosts".to_owned(), json!([entry]));
        }
    }
    Ok(manage::Change::SetPolicy {
        name: name.to_owned(),
        body: manage::Body::Json(Value::Object(body).to_string()),
    })
}
