//! Policy management: the writes of the control API (create, replace, delete a policy; set
//! `agent.default_policy` / `agent.unlabeled`; import a bundle), and export.
//!
//! Where writes go (see docs/operations.md, "Managing policies"):
//! - a policy is one file, `policies.d/<name>.toml` next to the configuration file
//!   ([`dir`]), written atomically (temporary file 0600 + `O_EXCL`, fsync, rename, fsync the
//!   directory); policies defined in the main file are the operator's and are not touched (409);
//! - the two defaults are keys of the main file's `[agent]` table, edited in place with
//!   `toml_edit` (comments and layout kept) and written the same atomic way ([`defaults`]).
//!
//! A change is validated by loading the files it would write through the one loader,
//! [`Config::load_parts`] (so a 422 names the field and the reason exactly as the config file
//! would), then written, then applied by the daemon's reload; if the reload is refused, the files
//! are restored and the running policy stays in force ([`apply`]). A change to a read-only
//! directory (a Kubernetes ConfigMap volume) is refused before anything is written
//! ([`writable`]).
pub mod bundle;
pub mod defaults;
pub mod dir;
pub mod sources;
pub mod writable;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Value, json};

use crate::config::{Config, ConfigError, check_policy_name};
use dir::PolicyFile;
use egress_policy::Policy;

/// A request to change the policies.
#[derive(Debug, Clone)]
pub enum Change {
    /// Create or replace `policies.d/<name>.toml`.
    SetPolicy { name: String, body: Body },
    /// Remove a policy from `policies.d`. `force`: even if containers run under it (they are
    /// then confined as `deny_all`: their label names a policy that no longer exists).
    DeletePolicy { name: String, force: bool },
    /// Set `agent.default_policy` and/or `agent.unlabeled`.
    SetDefaults {
        default_policy: Option<String>,
        unlabeled: Option<String>,
    },
    /// Make this host's policies what the bundle says (see [`bundle`]).
    Import { bundle: Body, prune: bool },
}

impl Change {
    /// What the change is, for the record.
    pub fn action(&self) -> &'static str {
        match self {
            Change::SetPolicy { .. } => "set-policy",
            Change::DeletePolicy { .. } => "delete-policy",
            Change::SetDefaults { .. } => "set-defaults",
            Change::Import { .. } => "import",
        }
    }
    pub fn target(&self) -> String {
        match self {
            Change::SetPolicy { name, .. } | Change::DeletePolicy { name, .. } => name.clone(),
            Change::SetDefaults { .. } => "agent".to_owned(),
            Change::Import { .. } => "bundle".to_owned(),
        }
    }
}

/// A request body: TOML text or JSON.
#[derive(Debug, Clone)]
pub enum Body {
    Toml(String),
    Json(String),
}

impl Body {
    /// By content type: `application/json` is JSON, anything TOML-ish or text is TOML.
    pub fn from_content_type(content_type: Option<&str>, text: String) -> Body {
        match content_type.map(|c| c.split(';').next().unwrap_or("").trim()) {
            Some(c) if c.eq_ignore_ascii_case("application/json") => Body::Json(text),
            _ => Body::Toml(text),
        }
    }
}

/// Who asked for a change (the control API's peer).
#[derive(Debug, Clone, Serialize)]
pub struct Who {
    pub uid: u32,
    pub pid: Option<u32>,
    /// The console's authenticated operator (`console:NAME` for a browser session, `token:NAME`
    /// for a bearer token); `None` on the unix socket, where the uid is the identity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

/// Why a change was not made. [`ManageError::status`] is its HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    /// What the change would write does not load: the loader's own error.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    /// Written, but the reload was refused: the files were restored, nothing changed.
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Io(String),
    /// The directory a change would write is read-only or managed by Kubernetes (see
    /// [`writable`]); nothing was written.
    #[error("{0}")]
    ReadOnly(String),
}

impl ManageError {
    pub fn status(&self) -> u16 {
        match self {
            ManageError::Invalid(_) | ManageError::Refused(_) => 422,
            ManageError::BadRequest(_) => 400,
            ManageError::NotFound(_) => 404,
            ManageError::Conflict(_) | ManageError::ReadOnly(_) => 409,
            ManageError::Io(_) => 500,
        }
    }

    /// The JSON body of the API's answer: `error` always; for a configuration error also
    /// `file`, `line`, `column`, `field` and `message` (the same field and reason as the
    /// config file's error).
    pub fn body(&self) -> Value {
        match self {
            ManageError::Invalid(ConfigError::Invalid {
                path,
                line,
                column,
                field,
                message,
            }) => json!({
                "error": self.to_string(),
                "file": path.display().to_string(),
                "line": line,
                "column": column,
                "field": field,
                "message": message,
            }),
            _ => json!({ "error": self.to_string() }),
        }
    }
}

/// The files a configuration is made of: the main file and `policies.d`.
#[derive(Debug, Clone, PartialEq)]
pub struct Parts {
    pub main_path: PathBuf,
    pub main_text: String,
    pub dir: PathBuf,
    /// Policy name → file text.
    pub files: BTreeMap<String, String>,
}

impl Parts {
    /// Read the configuration's files as they are on disk.
    pub fn read(config_path: &Path) -> Result<Parts, ManageError> {
        let main_text =
            std::fs::read_to_string(config_path).map_err(|source| ConfigError::Read {
                path: config_path.to_owned(),
                source,
            })?;
        let dir = dir::policies_dir(config_path);
        let files = dir::read_policies(&dir)?
            .into_iter()
            .map(|f| (f.name, f.text))
            .collect();
        Ok(Parts {
            main_path: config_path.to_owned(),
            main_text,
            dir,
            files,
        })
    }

    /// Load these texts exactly as [`Config::load`] loads the files.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let files = self
            .files
            .iter()
            .map(|(name, text)| PolicyFile {
                name: name.clone(),
                path: dir::policy_path(&self.dir, name),
                text: text.clone(),
            })
            .collect();
        Config::load_parts(&self.main_path, &self.main_text, files)
    }

    /// The policies of the main file alone (parsed, not validated).
    pub fn main_policies(&self) -> Result<BTreeMap<String, Policy>, ConfigError> {
        let c: Config = crate::config::parse_located(&self.main_text, &self.main_path, "")?;
        Ok(c.policies)
    }

    /// Where policy `name` is defined: `"built-in"`, `"config"` (the main file) or
    /// `"policies.d"`; `None` if nowhere.
    pub fn source_of(&self, name: &str) -> Option<&'static str> {
        if [
            egress_policy::ALLOW_ALL,
            egress_policy::DENY_ALL,
            egress_policy::AUDIT,
        ]
        .contains(&name)
        {
            return Some("built-in");
        }
        if self.files.contains_key(name) {
            return Some("policies.d");
        }
        if self.main_policies().is_ok_and(|m| m.contains_key(name)) {
            return Some("config");
        }
        None
    }
}

/// One file a change writes (`after: Some`) or removes (`after: None`), with what was there.
#[derive(Debug, Clone, PartialEq)]
pub struct FileOp {
    pub path: PathBuf,
    pub before: Option<String>,
    pub after: Option<String>,
}

/// A validated change: the files to write and the configuration they load to.
#[derive(Debug)]
pub struct Plan {
    pub ops: Vec<FileOp>,
    pub config: Config,
    /// What the change does, for a person: an import's summary per policy, otherwise a line
    /// diff of each file it writes or removes.
    pub diff: String,
}

/// A policy body as the text of its `policies.d` file. TOML is kept as written (comments
/// too); JSON is converted to TOML (the loader then parses it like any file, so errors name
/// the same fields).
pub fn policy_text(name: &str, body: &Body) -> Result<String, ManageError> {
    match body {
        Body::Toml(t) => Ok(t.clone()),
        Body::Json(j) => {
            let v: Value = serde_json::from_str(j)
                .map_err(|e| ManageError::BadRequest(format!("request body: {e}")))?;
            json_to_toml(&v).map_err(|message| {
                ManageError::Invalid(ConfigError::Invalid {
                    path: PathBuf::from("<request body>"),
                    line: 0,
                    column: 0,
                    field: format!("policies.{name}"),
                    message,
                })
            })
        }
    }
}

/// A JSON object as TOML text (`null` has no TOML form: refused).
pub fn json_to_toml(v: &Value) -> Result<String, String> {
    if !v.is_object() {
        return Err("the body must be a JSON object (the policy's fields)".to_owned());
    }
    toml::to_string(v).map_err(|e| format!("not expressible in TOML: {e}"))
}

fn check_name(name: &str) -> Result<(), ManageError> {
    check_policy_name(name).map_err(|m| {
        ManageError::Invalid(ConfigError::Invalid {
            path: PathBuf::from("<request>"),
            line: 0,
            column: 0,
            field: format!("policies.{name}"),
            message: m.to_owned(),
        })
    })
}

/// Refuse touching a policy the main file defines (the operator's, edited by hand).
fn not_in_main(parts: &Parts, name: &str) -> Result<(), ManageError> {
    if parts.main_policies()?.contains_key(name) {
        return Err(ManageError::Conflict(format!(
            "policies.{name} is defined in {}; only policies in {} are managed through the API (move it there to manage it)",
            parts.main_path.display(),
            parts.dir.display()
        )));
    }
    Ok(())
}

/// Validate `change` against `parts`: the directories it writes must be writable
/// ([`writable`]), the new texts must load; `in_use` names the containers running under each
/// policy (for delete).
pub fn plan(
    parts: &Parts,
    change: &Change,
    in_use: &BTreeMap<String, Vec<String>>,
) -> Result<Plan, ManageError> {
    let mut next = parts.clone();
    let mut diff = String::new();
    match change {
        Change::SetPolicy { name, body } => {
            check_name(name)?;
            not_in_main(parts, name)?;
            next.files.insert(name.clone(), policy_text(name, body)?);
        }
        Change::DeletePolicy { name, force } => {
            check_name(name)?;
            not_in_main(parts, name)?;
            if !parts.files.contains_key(name) {
                return Err(ManageError::NotFound(format!("no policy named {name:?}")));
            }
            if let Some(users) = in_use.get(name).filter(|u| !u.is_empty())
                && !force
            {
                return Err(ManageError::Conflict(format!(
                    "policy {name:?} is in use by {}; they would be confined as deny_all (force to delete anyway)",
                    users.join(", ")
                )));
            }
            next.files.remove(name);
        }
        Change::SetDefaults {
            default_policy,
            unlabeled,
        } => {
            if default_policy.is_none() && unlabeled.is_none() {
                return Err(ManageError::BadRequest(
                    "nothing to set: give default_policy and/or unlabeled".to_owned(),
                ));
            }
            next.main_text = defaults::set(
                &parts.main_text,
                &parts.main_path,
                default_policy.as_deref(),
                unlabeled.as_deref(),
            )?;
        }
        Change::Import { bundle, prune } => {
            let b = bundle::Bundle::parse(bundle)?;
            let (n, d) = b.apply_to(parts, *prune)?;
            next = n;
            diff = d;
        }
    }
    let ops = ops(parts, &next);
    // Where it can't write, that is the answer, whatever the files hold (a broken ConfigMap).
    writable::check(&ops)?;
    let config = next.load()?;
    if diff.is_empty() {
        diff = files_diff(&ops);
    }
    Ok(Plan { ops, config, diff })
}

/// A line diff of each file the change writes (`--- a/PATH`, `+++ b/PATH`, then `-`/`+`/` `
/// lines; a new file against `/dev/null`, a removed one to it).
fn files_diff(ops: &[FileOp]) -> String {
    let mut out = String::new();
    for op in ops {
        let path = op.path.display();
        let (a, b) = (op.before.as_deref(), op.after.as_deref());
        out.push_str(&match a {
            Some(_) => format!("--- a/{path}\n"),
            None => "--- /dev/null\n".to_owned(),
        });
        out.push_str(&match b {
            Some(_) => format!("+++ b/{path}\n"),
            None => "+++ /dev/null\n".to_owned(),
        });
        let d = similar::TextDiff::from_lines(a.unwrap_or(""), b.unwrap_or(""));
        for change in d.iter_all_changes() {
            let sign = match change.tag() {
                similar::ChangeTag::Delete => '-',
                similar::ChangeTag::Insert => '+',
                similar::ChangeTag::Equal => ' ',
            };
            out.push(sign);
            out.push_str(change.value());
            if !change.value().ends_with('\n') {
                out.push('\n');
            }
        }
    }
    out
}

/// The file operations that turn `from` into `to`.
fn ops(from: &Parts, to: &Parts) -> Vec<FileOp> {
    let mut out = Vec::new();
    if from.main_text != to.main_text {
        out.push(FileOp {
            path: from.main_path.clone(),
            before: Some(from.main_text.clone()),
            after: Some(to.main_text.clone()),
        });
    }
    let names: std::collections::BTreeSet<&String> =
        from.files.keys().chain(to.files.keys()).collect();
    for name in names {
        let (a, b) = (from.files.get(name), to.files.get(name));
        if a != b {
            out.push(FileOp {
                path: dir::policy_path(&from.dir, name),
                before: a.cloned(),
                after: b.cloned(),
            });
        }
    }
    out
}

/// Carry out `ops`; on a failure, undo those done and report it.
pub fn commit(ops: &[FileOp]) -> Result<(), ManageError> {
    for (i, op) in ops.iter().enumerate() {
        if let Err(e) = write_op(&op.path, op.after.as_deref()) {
            rollback(&ops[..i]);
            return Err(ManageError::Io(format!("{}: {e}", op.path.display())));
        }
    }
    Ok(())
}

/// Put back what `ops` replaced (best effort; each failure is logged).
pub fn rollback(ops: &[FileOp]) {
    for op in ops.iter().rev() {
        if let Err(e) = write_op(&op.path, op.before.as_deref()) {
            tracing::error!(file = %op.path.display(), error = %e,
                "could not restore a policy file after a refused change");
        }
    }
}

fn write_op(path: &Path, text: Option<&str>) -> std::io::Result<()> {
    match text {
        Some(t) => {
            // The main file keeps its mode (it may be 0644); new policy files are 0600.
            let mode = std::fs::metadata(path)
                .ok()
                .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777);
            dir::write_atomic(path, t.as_bytes())?;
            if let Some(mode) = mode.filter(|m| *m != 0o600 && m & 0o022 == 0) {
                std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
            }
            Ok(())
        }
        None => dir::remove_durable(path),
    }
}

/// Where changes are recorded (the event store's `changes` table in the daemon).
pub trait ChangeLog: Send + Sync {
    /// `diff`: what the change does ([`Plan::diff`]); `result`: `applied` or `refused: …`.
    fn record(&self, who: &Who, change: &Change, files: &[PathBuf], diff: &str, result: &str);
}

/// Validate, write, reload; restore the files if the reload is refused. `reload` is the
/// daemon's reload (which re-reads the files just written). Every write that reached the disk
/// is recorded with `who`, applied or not.
pub async fn apply<F, Fut>(
    config_path: &Path,
    change: &Change,
    who: &Who,
    in_use: &BTreeMap<String, Vec<String>>,
    log: &dyn ChangeLog,
    reload: F,
) -> Result<Value, ManageError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Value, String>>,
{
    let parts = Parts::read(config_path)?;
    let plan = plan(&parts, change, in_use)?;
    let files: Vec<PathBuf> = plan.ops.iter().map(|o| o.path.clone()).collect();
    let names = |c: &Config| c.policy_names().map(str::to_owned).collect::<Vec<_>>();
    if plan.ops.is_empty() {
        return Ok(json!({
            "changed": false,
            "files": files,
            "diff": plan.diff,
            "policies": names(&plan.config),
        }));
    }
    commit(&plan.ops)?;
    match reload().await {
        Ok(_) => {
            log.record(who, change, &files, &plan.diff, "applied");
            tracing::info!(uid = who.uid, identity = ?who.identity, action = change.action(),
                target = %change.target(), "policy change applied");
            Ok(json!({
                "changed": true,
                "files": files,
                "diff": plan.diff,
                "policies": names(&plan.config),
            }))
        }
        Err(e) => {
            rollback(&plan.ops);
            log.record(who, change, &files, &plan.diff, &format!("refused: {e}"));
            Err(ManageError::Refused(format!(
                "the change was refused, the running policy stays in force: {e}"
            )))
        }
    }
}

/// The dry run of a change: what it would write (a diff), validated, nothing written.
pub fn dry_run(
    config_path: &Path,
    change: &Change,
    in_use: &BTreeMap<String, Vec<String>>,
) -> Result<Value, ManageError> {
    let parts = Parts::read(config_path)?;
    let plan = plan(&parts, change, in_use)?;
    Ok(json!({
        "changed": false,
        "dry_run": true,
        "would_change": !plan.ops.is_empty(),
        "files": plan.ops.iter().map(|o| o.path.clone()).collect::<Vec<_>>(),
        "diff": plan.diff,
    }))
}

/// A policy as the API shows it: where it is defined, and its effective fields.
pub fn describe(config_path: &Path, config: &Config, name: &str) -> Option<Value> {
    let policy = config.policy(name)?;
    let editable = sources::read(config_path, config).policies.remove(name);
    let (source, file, read_only) =
        editable.map_or(("unknown", None, None), |e| (e.source, e.file, e.read_only));
    Some(json!({
        "name": name,
        "source": source,
        "file": file,
        "read_only": read_only,
        "badge": policy.badge(),
        "default": config.agent.default_policy == name,
        "unlabeled": config.agent.unlabeled == name,
        "policy": serde_json::to_value(policy).unwrap_or(Value::Null),
        // Every host each of its presets adds (`{}` without presets); `policy` keeps the names.
        "preset_hosts": egress_policy::presets::expansion(policy),
        "toml": toml::to_string(policy).unwrap_or_default(),
    }))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests;
