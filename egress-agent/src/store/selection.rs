//! The selection flags shared by `events`, `suggest` and the API (`--since`, `--container`,
//! `--policy`, `--verdict`, `--run`, `--label`), turned into a store [`EventFilter`].
use std::collections::BTreeMap;
use std::time::SystemTime;

use anyhow::{Result, anyhow, bail};

use super::query::{EventFilter, valid_label};

/// Context label of a pod's namespace (OpenTelemetry's resource attribute name).
const K8S_NAMESPACE: &str = "k8s.namespace.name";
/// Context label of a pod's name.
const K8S_POD: &str = "k8s.pod.name";

/// The selection flags shared by `events` and `suggest`.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub since: Option<String>,
    pub container: Option<String>,
    pub policy: Option<String>,
    pub verdict: Option<String>,
    pub run: Option<String>,
    pub labels: Vec<String>,
    /// A Kubernetes namespace (the `k8s.namespace.name` context label of pod events).
    pub namespace: Option<String>,
    /// A pod: `NAME` or `NAMESPACE/NAME` (context labels `k8s.pod.name`, `k8s.namespace.name`).
    pub pod: Option<String>,
}

/// `--since`: a duration back from now (`90m`, `2h`, `7d`) or an RFC 3339 time.
pub fn parse_since(s: &str, now: SystemTime) -> Result<SystemTime> {
    if let Ok(d) = humantime::parse_duration(s) {
        return now
            .checked_sub(d)
            .ok_or_else(|| anyhow!("--since {s:?}: too far back"));
    }
    humantime::parse_rfc3339_weak(s).map_err(|_| {
        anyhow!("--since {s:?}: expected a duration (2h, 30m, 7d) or an RFC 3339 time")
    })
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        self.since.is_none()
            && self.container.is_none()
            && self.policy.is_none()
            && self.verdict.is_none()
            && self.run.is_none()
            && self.labels.is_empty()
            && self.namespace.is_none()
            && self.pod.is_none()
    }

    pub fn filter(&self) -> Result<EventFilter> {
        let mut labels = BTreeMap::new();
        if let Some(r) = &self.run {
            labels.insert("run".to_owned(), r.clone());
        }
        let (pod_ns, pod) = match self.pod.as_deref().map(|p| p.split_once('/')) {
            Some(Some((ns, name))) => (Some(ns), Some(name)),
            Some(None) => (None, self.pod.as_deref()),
            None => (None, None),
        };
        for (key, flag, value) in [
            (K8S_NAMESPACE, "--namespace", self.namespace.as_deref()),
            (K8S_NAMESPACE, "--pod", pod_ns),
            (K8S_POD, "--pod", pod),
        ] {
            let Some(v) = value else { continue };
            if v.is_empty() {
                bail!("{flag}: empty name (expected NAME or NAMESPACE/NAME)");
            }
            if let Some(other) = labels.insert(key.to_owned(), v.to_owned())
                && other != v
            {
                bail!(
                    "--namespace {other:?} and --pod {:?} name different namespaces",
                    self.pod.as_deref().unwrap_or_default()
                );
            }
        }
        for l in &self.labels {
            let (k, v) = l
                .split_once('=')
                .ok_or_else(|| anyhow!("--label {l:?}: expected NAME=VALUE"))?;
            if !valid_label(k) {
                bail!("--label {l:?}: a label name is 1-64 characters of [A-Za-z0-9_.-]");
            }
            labels.insert(k.to_owned(), v.to_owned());
        }
        Ok(EventFilter {
            since: self
                .since
                .as_deref()
                .map(|s| parse_since(s, SystemTime::now()))
                .transpose()?,
            container: self.container.clone(),
            policy: self.policy.clone(),
            verdict: self
                .verdict
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| anyhow!("--verdict: {e}"))?,
            labels,
        })
    }

    /// A readable summary for headers.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (k, v) in [
            ("container", &self.container),
            ("policy", &self.policy),
            ("run", &self.run),
            ("since", &self.since),
            ("namespace", &self.namespace),
            ("pod", &self.pod),
        ] {
            if let Some(v) = v {
                parts.push(format!("{k}={v}"));
            }
        }
        parts.extend(self.labels.iter().map(|l| format!("label {l}")));
        if parts.is_empty() {
            "everything in the store".to_owned()
        } else {
            parts.join(", ")
        }
    }
}

#[cfg(test)]
mod pod_tests {
    use super::*;

    #[test]
    fn pods_and_namespaces_select_by_their_context_labels() {
        let f = Selection {
            pod: Some("ci/build-1".into()),
            ..Selection::default()
        }
        .filter()
        .expect("filter");
        assert_eq!(f.labels.get(K8S_NAMESPACE).map(String::as_str), Some("ci"));
        assert_eq!(f.labels.get(K8S_POD).map(String::as_str), Some("build-1"));
        let f = Selection {
            namespace: Some("ci".into()),
            pod: Some("build-1".into()),
            ..Selection::default()
        }
        .filter()
        .expect("filter");
        assert_eq!(f.labels.len(), 2);
        let e = Selection {
            namespace: Some("ci".into()),
            pod: Some("other/build-1".into()),
            ..Selection::default()
        }
        .filter()
        .expect_err("conflict");
        assert!(e.to_string().contains("different namespaces"), "{e}");
        assert!(
            Selection {
                pod: Some("ci/".into()),
                ..Selection::default()
            }
            .filter()
            .is_err()
        );
    }
}
