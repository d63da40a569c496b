//! containerd probe: pod annotations reach the agent only if containerd's CRI runtime handler
//! passes them into the OCI spec (`pod_annotations = ["egress.*"]`). Without it every pod looks
//! unannotated and gets its namespace default or `agent.unlabeled` — so the probe fails loudly.
use std::sync::Arc;

use super::{Ctx, Outcome};

/// The fix, named once.
const FIX: &str = "in containerd's config add pod_annotations = [\"egress.*\"] to the CRI runtime handler (containerd 1.x: [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]; 2.x: [plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc]) and restart containerd";

pub(super) async fn pod_annotations(ctx: Arc<Ctx>) -> Outcome {
    let Some(path) = ctx.opts.containerd_config.clone() else {
        return Outcome::skip(
            "no [kubernetes] section: pods are not enforced",
            "add [kubernetes] to the agent's configuration to confine pods (docs/operations.md, \"Kubernetes\")",
        );
    };
    match tokio::fs::read_to_string(&path).await {
        Ok(text) => check(&text),
        Err(e) => Outcome::warn(
            format!("cannot read containerd's config {}: {e}", path.display()),
            format!("run doctor where containerd's config is readable, then: {FIX}"),
        ),
    }
}

/// Judge containerd's configuration text.
fn check(text: &str) -> Outcome {
    let value: toml::Table = match text.parse() {
        Ok(v) => v,
        Err(e) => {
            return Outcome::fail(format!("containerd's config does not parse: {e}"), FIX);
        }
    };
    let plugins = value.get("plugins").and_then(|p| p.as_table());
    let cri = plugins.and_then(|p| {
        p.get("io.containerd.grpc.v1.cri")
            .or_else(|| p.get("io.containerd.cri.v1.runtime"))
    });
    let containerd = cri.and_then(|c| c.get("containerd"));
    let runtime = containerd
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(|n| n.as_str())
        .unwrap_or("runc");
    let patterns: Vec<&str> = containerd
        .and_then(|c| c.get("runtimes"))
        .and_then(|r| r.get(runtime))
        .and_then(|r| r.get("pod_annotations"))
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    if patterns
        .iter()
        .any(|p| matches!(*p, "egress.*" | "*" | "egress*"))
    {
        Outcome::pass(format!(
            "runtime {runtime:?} passes egress.* pod annotations ({patterns:?})"
        ))
    } else {
        Outcome::fail(
            format!(
                "runtime {runtime:?} drops pod annotations egress.* (pod_annotations = {patterns:?}): annotated pods would get their namespace default or agent.unlabeled"
            ),
            FIX,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    #[test]
    fn pod_annotations_must_include_egress() {
        let ok = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
runtime_type = "io.containerd.runc.v2"
pod_annotations = ["egress.*"]
"#;
        assert_eq!(check(ok).status, Status::Pass);
        let v3 = "version = 3\n[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc]\npod_annotations = [\"*\"]\n";
        assert_eq!(check(v3).status, Status::Pass);
        let missing = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\nruntime_type = \"io.containerd.runc.v2\"\n";
        let out = check(missing);
        assert_eq!(out.status, Status::Fail);
        assert!(
            out.fix
                .as_deref()
                .is_some_and(|f| f.contains("pod_annotations = [\"egress.*\"]"))
        );
        // Another default runtime: its own list counts, not runc's.
        let other = "[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"crun\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\npod_annotations = [\"egress.*\"]\n";
        assert_eq!(check(other).status, Status::Fail);
        assert_eq!(check("not [toml").status, Status::Fail);
        assert_eq!(check("").status, Status::Fail);
    }
}
