//! Export and import: a bundle is everything needed to reproduce a host's policies — the two
//! defaults and every configured policy — in the configuration file's own shape:
//!
//! ```toml
//! [agent]
//! default_policy = "ci"
//! unlabeled = "allow_all"
//! [policies.ci]
//! allow_hosts = ["github.com"]
//! ```
//!
//! (JSON: the same object.) A bundle is a valid configuration fragment, so `export` output can
//! also be pasted into a config file. Secrets are never in it: credential bindings name their
//! source (`{ file = ... }`, `{ env = ... }`), which the importing host must provide.
//!
//! Import makes the host's policies what the bundle says: policies are created or replaced in
//! `policies.d`; with `prune`, `policies.d` policies the bundle lacks are removed. A policy the
//! main file defines is left alone if the bundle has it unchanged, and is a conflict otherwise.
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Body, ManageError, Parts, check_name, json_to_toml};
use crate::config::{Config, ConfigError, parse_located};
use egress_policy::Policy;

/// The `[agent]` keys a bundle carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BundleAgent {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unlabeled: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Bundle {
    #[serde(default)]
    pub agent: BundleAgent,
    #[serde(default)]
    pub policies: BTreeMap<String, Policy>,
}

/// A policy's canonical text (what import writes, and what diffs compare).
pub fn canonical(p: &Policy) -> String {
    toml::to_string(p).unwrap_or_default()
}

impl Bundle {
    /// The bundle of a loaded configuration.
    pub fn export(config: &Config) -> Bundle {
        Bundle {
            agent: BundleAgent {
                default_policy: Some(config.agent.default_policy.clone()),
                unlabeled: Some(config.agent.unlabeled.clone()),
            },
            policies: config.policies.clone(),
        }
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }

    /// Parse a bundle; errors are located like a config file's (`policies.ci.allow_hosts[0]`).
    pub fn parse(body: &Body) -> Result<Bundle, ManageError> {
        let (text, origin) = match body {
            Body::Toml(t) => (t.clone(), "<bundle>"),
            Body::Json(j) => {
                let v: serde_json::Value = serde_json::from_str(j)
                    .map_err(|e| ManageError::BadRequest(format!("request body: {e}")))?;
                let t = json_to_toml(&v).map_err(|message| {
                    ManageError::Invalid(ConfigError::Invalid {
                        path: PathBuf::from("<bundle>"),
                        line: 0,
                        column: 0,
                        field: "-".to_owned(),
                        message,
                    })
                })?;
                (t, "<bundle>")
            }
        };
        Ok(parse_located(&text, &PathBuf::from(origin), "")?)
    }

    /// `parts` changed to hold this bundle's policies and defaults, and the diff.
    pub fn apply_to(&self, parts: &Parts, prune: bool) -> Result<(Parts, String), ManageError> {
        let mut next = parts.clone();
        let mut diff = String::new();
        let main = parts.main_policies()?;
        let current = parts.load()?;
        for (k, want) in [
            ("default_policy", &self.agent.default_policy),
            ("unlabeled", &self.agent.unlabeled),
        ] {
            let have = if k == "default_policy" {
                &current.agent.default_policy
            } else {
                &current.agent.unlabeled
            };
            if let Some(w) = want
                && w != have
            {
                diff.push_str(&format!("~ agent.{k}: {have:?} -> {w:?}\n"));
            }
        }
        let dp = self
            .agent
            .default_policy
            .as_deref()
            .filter(|d| **d != current.agent.default_policy);
        let ul = self
            .agent
            .unlabeled
            .as_deref()
            .filter(|u| **u != current.agent.unlabeled);
        if dp.is_some() || ul.is_some() {
            next.main_text = super::defaults::set(&parts.main_text, &parts.main_path, dp, ul)?;
        }
        for (name, policy) in &self.policies {
            check_name(name)?;
            let text = canonical(policy);
            if let Some(m) = main.get(name) {
                if canonical(m) != text {
                    return Err(ManageError::Conflict(format!(
                        "policies.{name} is defined in {} and differs from the bundle; change it there by hand, or move it to {}",
                        parts.main_path.display(),
                        parts.dir.display()
                    )));
                }
                diff.push_str(&format!("= policy {name} (unchanged, in the main file)\n"));
                continue;
            }
            match current.policies.get(name) {
                Some(have) if canonical(have) == text => {
                    diff.push_str(&format!("= policy {name} (unchanged)\n"));
                }
                Some(have) => {
                    diff.push_str(&format!("~ policy {name}\n"));
                    diff.push_str(&unified(&canonical(have), &text));
                    next.files.insert(name.clone(), text);
                }
                None => {
                    diff.push_str(&format!("+ policy {name}\n"));
                    for l in text.lines() {
                        diff.push_str(&format!("+   {l}\n"));
                    }
                    next.files.insert(name.clone(), text);
                }
            }
        }
        for name in parts.files.keys() {
            if self.policies.contains_key(name) {
                continue;
            }
            if prune {
                diff.push_str(&format!("- policy {name}\n"));
                next.files.remove(name);
            } else {
                diff.push_str(&format!(
                    "= policy {name} (not in the bundle; kept, prune to remove)\n"
                ));
            }
        }
        for name in main.keys() {
            if !self.policies.contains_key(name) {
                diff.push_str(&format!(
                    "= policy {name} (not in the bundle; defined in the main file, kept)\n"
                ));
            }
        }
        Ok((next, diff))
    }
}

/// A line diff of two policy texts (`-`/`+` lines, unchanged ones indented).
fn unified(a: &str, b: &str) -> String {
    let d = similar::TextDiff::from_lines(a, b);
    let mut out = String::new();
    for change in d.iter_all_changes() {
        let sign = match change.tag() {
            similar::ChangeTag::Delete => "-",
            similar::ChangeTag::Insert => "+",
            similar::ChangeTag::Equal => " ",
        };
        out.push_str(&format!("{sign}   {}", change.value()));
        if !change.value().ends_with('\n') {
            out.push('\n');
        }
    }
    out
}
