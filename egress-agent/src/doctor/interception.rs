//! `proxy.interception`: can the agent intercept what its policies bind? The CA and TLS setup,
//! and every credential binding's secret. A binding whose secret can't be loaded is served
//! without it — its host refused (`interception-unavailable`), every other host served — so
//! this is where an operator learns which one and why.
//!
//! The view comes from the running daemon (its status: what it really loaded, `env` secrets
//! included) or, without one, from this process's own load of the configuration, where `env`
//! sources can't be judged (they are the daemon's environment, not the caller's).
use std::sync::Arc;

use serde_json::Value;

use super::{Ctx, Outcome};
use crate::config::Config;

/// What the probe judges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterceptionView {
    /// Where the view comes from, for the summary (`the running daemon`, `the configuration`).
    pub from: String,
    /// Credential bindings configured.
    pub bindings: usize,
    /// Why TLS interception can't be set up (`None`: it can, or this view can't tell).
    pub setup_error: Option<String>,
    /// One line per binding without its secret (policy, binding, host, source, why).
    pub unavailable: Vec<String>,
    /// Bindings this view can't judge (`env` sources, without the daemon).
    pub unchecked: usize,
}

impl InterceptionView {
    /// The configuration as this process loaded it (leniently): `env` sources are not judged.
    pub fn from_config(config: &Config) -> InterceptionView {
        use egress_policy::secret::SecretSource;
        let is_env = |s: &SecretSource| matches!(s, SecretSource::Env(_));
        let all = config.policies.values().flat_map(|p| p.credentials.iter());
        InterceptionView {
            from: "the configuration (no daemon answered)".to_owned(),
            bindings: all.clone().count(),
            setup_error: None,
            unavailable: config
                .unavailable_bindings()
                .iter()
                .filter(|u| !is_env(&u.binding.source))
                .map(crate::config::UnavailableBinding::describe)
                .collect(),
            unchecked: all.filter(|b| is_env(&b.source)).count(),
        }
    }

    /// The daemon's view: the `interception` object of its status.
    pub fn from_status(v: &Value) -> Option<InterceptionView> {
        let i = v.get("interception")?.as_object()?;
        Some(InterceptionView {
            from: "the running daemon".to_owned(),
            bindings: i.get("bindings").and_then(Value::as_u64).unwrap_or(0) as usize,
            setup_error: i
                .get("setup_error")
                .and_then(Value::as_str)
                .map(str::to_owned),
            unavailable: i
                .get("unavailable_bindings")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|b| b.get("summary")?.as_str().map(str::to_owned))
                .collect(),
            unchecked: 0,
        })
    }
}

pub(super) async fn interception(ctx: Arc<Ctx>) -> Outcome {
    let Some(v) = ctx.opts.interception.clone() else {
        return Outcome::skip(
            "no configuration to judge",
            "run it with the daemon's --config (or with the daemon running)",
        );
    };
    if let Some(e) = &v.setup_error {
        return Outcome::fail(
            format!(
                "TLS interception can't be set up ({}): {e}; hosts with credential bindings or request rules are refused (interception-unavailable)",
                v.from
            ),
            "fix what the error names (the CA files in agent.state_dir: owner root, 0700 directory, 0600 key; intercept.upstream_ca_file); the next request to such a host tries again",
        );
    }
    if !v.unavailable.is_empty() {
        return Outcome::fail(
            format!(
                "{} of {} credential binding(s) without their secret ({}); requests to their hosts are refused (interception-unavailable), every other host is served: {}",
                v.unavailable.len(),
                v.bindings,
                v.from,
                v.unavailable.join("; ")
            ),
            "make each secret loadable (the file, root-owned 0600; the agent's Environment=; LoadCredential=), then `egress-agent reload`",
        );
    }
    if v.bindings == 0 {
        return Outcome::pass(format!("no credential bindings ({})", v.from));
    }
    if v.unchecked > 0 {
        return Outcome::warn(
            format!(
                "{} credential binding(s) load their secret; {} from the agent's environment (env) can't be judged without the daemon",
                v.bindings - v.unchecked,
                v.unchecked
            ),
            "start the daemon (its status says whether its env secrets loaded)",
        );
    }
    Outcome::pass(format!(
        "every credential binding has its secret ({} binding(s), {})",
        v.bindings, v.from
    ))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::doctor::{Options, Status};

    async fn probe(view: Option<InterceptionView>) -> Outcome {
        let ctx = Arc::new(Ctx::new(Options {
            interception: view,
            ..Options::default()
        }));
        interception(ctx).await
    }

    /// The daemon's status names each binding without its secret (and a CA that can't be set
    /// up): the probe fails with policy, binding and why; the configuration's own view can't
    /// judge `env` sources and says so.
    #[tokio::test]
    async fn names_each_unavailable_binding_and_the_ca() {
        let status = serde_json::json!({ "interception": {
            "setup_error": null,
            "bindings": 2,
            "unavailable_bindings": [{
                "policy": "p", "binding": 0, "host": "api.test", "port": 443,
                "summary": "policy p, binding 0 (api.test:443, file /x): policies.p.credentials[0].source: can't read secret file /x: entity not found",
            }],
        }});
        let v = InterceptionView::from_status(&status).unwrap();
        let o = probe(Some(v.clone())).await;
        assert_eq!(o.status, Status::Fail);
        assert!(
            o.summary.starts_with(
                "1 of 2 credential binding(s) without their secret (the running daemon)"
            ) && o
                .summary
                .contains("policy p, binding 0 (api.test:443, file /x)"),
            "{}",
            o.summary
        );
        let o = probe(Some(InterceptionView {
            setup_error: Some("/s/ca-key.pem has mode 0644".into()),
            ..v.clone()
        }))
        .await;
        assert!(
            o.status == Status::Fail && o.summary.contains("0644"),
            "{}",
            o.summary
        );
        let o = probe(Some(InterceptionView {
            unavailable: Vec::new(),
            ..v
        }))
        .await;
        assert_eq!(o.status, Status::Pass, "{}", o.summary);
        assert_eq!(probe(None).await.status, Status::Skip);

        let c = Config::from_toml_str(
            "[policies.p]\nallow_hosts = [\"a.test\", \"b.test\"]\n[[policies.p.credentials]]\nhost = \"a.test\"\nheader = \"x-k\"\nsource = { env = \"EGRESS_DOCTOR_UNSET\" }\n[[policies.p.credentials]]\nhost = \"b.test\"\nheader = \"x-k\"\nsource = { file = \"/nonexistent/doctor\" }\n",
            std::path::Path::new("d.toml"),
        )
        .unwrap();
        let v = InterceptionView::from_config(&c);
        assert_eq!((v.bindings, v.unchecked, v.unavailable.len()), (2, 1, 1));
        let o = probe(Some(v)).await;
        assert!(
            o.status == Status::Fail && o.summary.contains("/nonexistent/doctor"),
            "{}",
            o.summary
        );
    }
}
