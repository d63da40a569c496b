//! Workloads that hold a real key (issue #40, item 6): their environment as the runtimes learn
//! it, the check against the configuration ([`check`], over `egress_policy::exposure`), the
//! event's context, and the list `status` and `doctor` show ([`Holders`]).
//!
//! Where each runtime checks: a Docker container's `Config.Env` from every inspect (the one
//! that follows `create`, usually before the start, and the one of `start`); a pod's app
//! containers' OCI `process.env` from their containerd records (`/containers/create`, before
//! their task exists); an `exec` command's environment as the agent built it (its own variables
//! set), before it starts. Only opted-in workloads are checked (an unlabelled container is left
//! alone).
//!
//! A finding is reported either way (event [`REASON`], `status`'s `workload_secrets`, `doctor`'s
//! `workloads.secrets`); with `agent.refuse_workload_secrets` the workload is also confined
//! `deny_all` (`exec` refuses to start the command). Values are compared, never kept in a
//! finding, logged or shown: [`WorkloadEnv`]'s `Debug` prints names only, and its values live in
//! zeroizing buffers.
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use serde::Serialize;
use zeroize::Zeroizing;

use crate::config::Config;
use egress_policy::exposure::{self, Finding, Known};

/// The event's reason.
pub const REASON: &str = "workload-holds-secret";
/// Event context: the variables and why (`OPENAI_API_KEY (provider-variable), ...`).
pub const CTX_VARIABLES: &str = "variables";
/// Event context: what the agent did about it.
pub const CTX_ACTION: &str = "action";

/// One process's environment: a container's (a pod has one per container, named).
#[derive(Clone, PartialEq, Eq)]
struct Part {
    container: Option<String>,
    vars: Arc<Vec<(String, Zeroizing<Vec<u8>>)>>,
}

/// A workload's environment. `Debug` shows variable names only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct WorkloadEnv {
    parts: Vec<Part>,
    /// Not read yet: a Docker `create` event carries labels but no environment, and the
    /// inspect that reads it may return only after the start. With
    /// `agent.refuse_workload_secrets` such a workload is confined until it is read.
    unread: bool,
}

impl fmt::Debug for WorkloadEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut l = f.debug_list();
        if self.unread {
            l.entry(&format_args!("(not read yet)"));
        }
        for p in &self.parts {
            for (name, _) in p.vars.iter() {
                match &p.container {
                    Some(c) => l.entry(&format_args!("{c}/{name}")),
                    None => l.entry(&name),
                };
            }
        }
        l.finish()
    }
}

impl WorkloadEnv {
    /// `NAME=value` entries (Docker's `Config.Env`, an OCI spec's `process.env`) of one process,
    /// of `container` (a pod's) or of the workload itself. An entry without `=` is a name with
    /// an empty value.
    pub fn from_entries<'a>(
        container: Option<&str>,
        entries: impl IntoIterator<Item = &'a str>,
    ) -> WorkloadEnv {
        WorkloadEnv::from_pairs(
            container,
            entries.into_iter().map(|e| {
                let (k, v) = e.split_once('=').unwrap_or((e, ""));
                (k.to_owned(), v.as_bytes().to_vec())
            }),
        )
    }

    /// (name, value) pairs of one process.
    pub fn from_pairs(
        container: Option<&str>,
        pairs: impl IntoIterator<Item = (String, Vec<u8>)>,
    ) -> WorkloadEnv {
        let vars: Vec<_> = pairs
            .into_iter()
            .map(|(k, v)| (k, Zeroizing::new(v)))
            .collect();
        if vars.is_empty() {
            return WorkloadEnv::default();
        }
        WorkloadEnv {
            parts: vec![Part {
                container: container.map(str::to_owned),
                vars: Arc::new(vars),
            }],
            unread: false,
        }
    }

    /// Several processes' environments as one workload's (a pod's containers).
    pub fn join<'a>(parts: impl IntoIterator<Item = &'a WorkloadEnv>) -> WorkloadEnv {
        let mut joined = WorkloadEnv::default();
        for e in parts {
            joined.parts.extend(e.parts.iter().cloned());
            joined.unread |= e.unread;
        }
        joined
    }

    /// An environment not read yet (see the `unread` field).
    pub fn unread() -> WorkloadEnv {
        WorkloadEnv {
            parts: Vec::new(),
            unread: true,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty() && !self.unread
    }
}

/// A variable holding a real key in a workload: which container (a pod's), the variable, why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holding {
    pub container: Option<String>,
    pub finding: Finding,
}

impl fmt::Display for Holding {
    /// `OPENAI_API_KEY (provider-variable)`; a pod's: `main/OPENAI_API_KEY (provider-variable)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(c) = &self.container {
            write!(f, "{c}/")?;
        }
        write!(f, "{}", self.finding)
    }
}

/// What a workload holds under a configuration, and whether it is confined for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exposure {
    pub holdings: Vec<Holding>,
    /// `agent.refuse_workload_secrets` and something is held, or the environment was not read
    /// yet: `deny_all`.
    pub confine: bool,
}

impl Exposure {
    pub fn is_empty(&self) -> bool {
        self.holdings.is_empty()
    }

    /// `A (why), main/B (why)`: names and reasons, never values.
    pub fn variables(&self) -> String {
        self.holdings
            .iter()
            .map(Holding::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The event's context: the variables, and what was done (`confined deny_all` or
    /// `reported`).
    pub fn context(&self, refused_action: &str) -> BTreeMap<String, String> {
        let action = if self.confine {
            format!("{refused_action} (agent.refuse_workload_secrets = true)")
        } else {
            "reported (agent.refuse_workload_secrets = false)".to_owned()
        };
        BTreeMap::from([
            (CTX_VARIABLES.to_owned(), self.variables()),
            (CTX_ACTION.to_owned(), action),
        ])
    }
}

/// Which variables of `env` hold a real key under `config` (every policy's bound secrets and
/// placeholders), and whether the workload is to be confined for it.
#[must_use = "a workload holding a real key must be reported"]
pub fn check(config: &Config, env: &WorkloadEnv) -> Exposure {
    if env.is_empty() {
        return Exposure::default();
    }
    let known = Known::of(config.policies.iter().map(|(n, p)| (n.as_str(), p)));
    let mut holdings = Vec::new();
    for part in &env.parts {
        let found = exposure::findings(
            part.vars.iter().map(|(k, v)| (k.as_str(), v.as_slice())),
            &known,
        );
        holdings.extend(found.into_iter().map(|finding| Holding {
            container: part.container.clone(),
            finding,
        }));
    }
    Exposure {
        // Not read yet: nothing to report, but nothing gets out before it is read (fail closed).
        confine: config.agent.refuse_workload_secrets && (!holdings.is_empty() || env.unread),
        holdings,
    }
}

/// A workload holding a real key, as `status` lists it (`workload_secrets`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holder {
    /// `docker` or `containerd`.
    pub runtime: String,
    /// The container id (a pod: its sandbox id).
    pub id: String,
    /// The container name (a pod: `namespace/name`).
    pub name: String,
    /// The policy its configuration gives it (what it runs under unless confined).
    pub policy: String,
    /// `VAR (why)` per variable (a pod's: `container/VAR (why)`).
    pub variables: Vec<String>,
    /// Confined `deny_all` for it (`agent.refuse_workload_secrets`).
    pub confined: bool,
}

/// The workloads of the running daemon that hold a real key, kept by the runtimes' enforcer,
/// read by `status`. Clones share one list.
#[derive(Debug, Clone, Default)]
pub struct Holders(Arc<RwLock<BTreeMap<String, Holder>>>);

impl Holders {
    /// Record `holder` (replacing what was known of its id), or forget the id when `exposure`
    /// holds nothing.
    pub fn set(&self, holder: Holder) {
        if let Ok(mut m) = self.0.write() {
            if holder.variables.is_empty() {
                m.remove(&holder.id);
            } else {
                m.insert(holder.id.clone(), holder);
            }
        }
    }

    pub fn remove(&self, id: &str) {
        if let Ok(mut m) = self.0.write() {
            m.remove(id);
        }
    }

    pub fn list(&self) -> Vec<Holder> {
        self.0
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    const SECRET: &str = "sk-agent-side-Hw5Pq1Zt9";

    fn config(refuse: bool) -> Config {
        std::fs::create_dir_all("/tmp/holdsecret-unit").unwrap();
        let path = format!("/tmp/holdsecret-unit/secret-{}", std::process::id());
        std::fs::write(&path, SECRET).unwrap();
        Config::from_toml_str(
            &format!(
                "[agent]\nrefuse_workload_secrets = {refuse}\n[policies.a]\nallow_hosts = [\"api.test\"]\n[[policies.a.credentials]]\nhost = \"api.test\"\nheader = \"x-api-key\"\nsource = {{ file = \"{path}\" }}\nplaceholder = \"egress-ph-a\"\n"
            ),
            std::path::Path::new("t.toml"),
        )
        .unwrap()
    }

    #[test]
    fn a_pods_containers_are_named_and_values_never_shown() {
        let c = config(false);
        let main = WorkloadEnv::from_entries(
            Some("main"),
            [
                "PATH=/bin",
                "OPENAI_API_KEY=sk-real-one",
                "ANTHROPIC_API_KEY=egress-ph-a",
            ],
        );
        let side = WorkloadEnv::from_entries(Some("side"), [format!("K={SECRET}").as_str(), "X"]);
        let env = WorkloadEnv::join([&main, &side]);
        let e = check(&c, &env);
        assert_eq!(
            e.variables(),
            "main/OPENAI_API_KEY (provider-variable), side/K (bound-secret policies.a.credentials[0])"
        );
        assert!(!e.confine);
        let shown = format!("{env:?} {e:?} {:?}", e.context("confined deny_all"));
        assert!(
            shown.contains("main/OPENAI_API_KEY") && shown.contains("reported"),
            "{shown}"
        );
        assert!(
            !shown.contains(SECRET) && !shown.contains("sk-real-one"),
            "{shown}"
        );
        let e = check(&config(true), &env);
        assert!(e.confine);
        assert!(e.context("confined deny_all")[CTX_ACTION].starts_with("confined deny_all"));
        // Nothing held: nothing to confine, whatever the setting.
        let clean = WorkloadEnv::from_entries(None, ["OPENAI_API_KEY=egress-ph-a", "GH_TOKEN="]);
        assert_eq!(check(&config(true), &clean), Exposure::default());
    }

    #[test]
    fn an_unread_environment_is_confined_only_when_refusing_and_reports_nothing() {
        let unread = WorkloadEnv::unread();
        assert!(!unread.is_empty());
        let e = check(&config(true), &unread);
        assert!(e.confine && e.holdings.is_empty(), "{e:?}");
        assert_eq!(check(&config(false), &unread), Exposure::default());
        // Joined with a read part (a pod), still unread.
        let read = WorkloadEnv::from_entries(Some("main"), ["PATH=/bin"]);
        assert!(check(&config(true), &WorkloadEnv::join([&read, &unread])).confine);
        assert!(!check(&config(true), &read).confine);
    }

    #[test]
    fn holders_list_what_is_held_now() {
        let h = Holders::default();
        let holder = |id: &str, vars: &[&str]| Holder {
            runtime: "docker".into(),
            id: id.into(),
            name: format!("n-{id}"),
            policy: "web".into(),
            variables: vars.iter().map(|v| (*v).to_owned()).collect(),
            confined: false,
        };
        h.set(holder("a", &["OPENAI_API_KEY (provider-variable)"]));
        h.set(holder("b", &["GH_TOKEN (provider-variable)"]));
        h.set(holder("b", &[]));
        h.remove("nope");
        assert_eq!(
            h.list().iter().map(|x| x.id.as_str()).collect::<Vec<_>>(),
            ["a"]
        );
        h.remove("a");
        assert!(h.list().is_empty());
    }
}
