//! `workloads.secrets`: do running workloads hold a real key? A container or pod whose
//! environment holds a bound secret (of any policy) or a provider's key variable that is not a
//! placeholder can spend that key on every host its policy allows, past every binding
//! (`crate::exposure`). Only the running daemon knows its workloads: the view is its status's
//! `workload_secrets`.
use std::sync::Arc;

use serde_json::Value;

use super::{Ctx, Outcome};

/// What the probe judges: the daemon's workloads holding a real key, one line each.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadSecretsView {
    /// `docker container web-1 (policy web): OPENAI_API_KEY (provider-variable)`.
    pub held: Vec<String>,
    /// How many of them are confined `deny_all` (`agent.refuse_workload_secrets`).
    pub confined: usize,
}

impl WorkloadSecretsView {
    /// The daemon's view: the `workload_secrets` array of its status (`None` for a daemon that
    /// does not report it).
    pub fn from_status(v: &Value) -> Option<WorkloadSecretsView> {
        let list = v.get("workload_secrets")?.as_array()?;
        let mut view = WorkloadSecretsView::default();
        for w in list {
            let s = |k: &str| w.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
            let kind = if w.get("runtime").and_then(Value::as_str) == Some("docker") {
                "container"
            } else {
                "pod"
            };
            let vars: Vec<&str> = w
                .get("variables")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let confined = w.get("confined").and_then(Value::as_bool) == Some(true);
            view.confined += usize::from(confined);
            view.held.push(format!(
                "{kind} {} (policy {}{}): {}",
                s("name"),
                s("policy"),
                if confined { ", confined deny_all" } else { "" },
                vars.join(", ")
            ));
        }
        Some(view)
    }
}

pub(super) async fn workload_secrets(ctx: Arc<Ctx>) -> Outcome {
    let Some(v) = ctx.opts.workload_secrets.clone() else {
        return Outcome::skip(
            "no running daemon answered: only it knows its workloads' environments",
            "run it with the daemon running (its control API socket: --api-socket)",
        );
    };
    if v.held.is_empty() {
        return Outcome::pass(
            "no running workload holds a real key in its environment (the running daemon)",
        );
    }
    let open = v.held.len() - v.confined;
    Outcome::warn(
        format!(
            "{} workload(s) hold a real key in their environment ({open} can use it on the hosts their policy allows): {}",
            v.held.len(),
            v.held.join("; ")
        ),
        "bind the key instead (policies.<name>.credentials, the workload holding its placeholder) and recreate the workload without it; [agent] refuse_workload_secrets = true confines such workloads deny_all",
    )
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::doctor::{Options, Status};

    async fn probe(view: Option<WorkloadSecretsView>) -> Outcome {
        let ctx = Arc::new(Ctx::new(Options {
            workload_secrets: view,
            ..Options::default()
        }));
        workload_secrets(ctx).await
    }

    #[tokio::test]
    async fn names_each_workload_and_variable() {
        let status = serde_json::json!({ "workload_secrets": [
            { "runtime": "docker", "id": "c1", "name": "web-1", "policy": "web",
              "variables": ["OPENAI_API_KEY (provider-variable)"], "confined": false },
            { "runtime": "kubernetes", "id": "s1", "name": "ci/a", "policy": "agent",
              "variables": ["main/K (bound-secret policies.a.credentials[0])"], "confined": true },
        ]});
        let v = WorkloadSecretsView::from_status(&status).unwrap();
        let o = probe(Some(v)).await;
        assert_eq!(o.status, Status::Warn);
        assert!(
            o.summary.contains("2 workload(s)")
                && o.summary.contains("1 can use it")
                && o.summary
                    .contains("container web-1 (policy web): OPENAI_API_KEY (provider-variable)")
                && o.summary
                    .contains("pod ci/a (policy agent, confined deny_all): main/K"),
            "{}",
            o.summary
        );
        let none = WorkloadSecretsView::from_status(&serde_json::json!({ "workload_secrets": [] }));
        assert_eq!(probe(none).await.status, Status::Pass);
        assert_eq!(probe(None).await.status, Status::Skip);
        assert!(WorkloadSecretsView::from_status(&serde_json::json!({})).is_none());
    }
}
