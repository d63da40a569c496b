//! Where each policy and the runtime settings live, and whether the API may change them: the
//! console says so before an operator edits (not only when a save fails), with the reason and
//! what to do instead. The reasons are the ones a write would be refused with ([`writable`],
//! the main file's own policies, the built-ins).
use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::{Parts, dir, writable};
use crate::config::Config;

/// The answer for one thing the console can edit: `read_only` is `None` when the API may write
/// it, else why not (and what to do).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Editable {
    /// `built-in`, `config` (the main file), `policies.d`, or `unknown`.
    pub source: &'static str,
    /// The file it is written to, when it has one.
    pub file: Option<String>,
    pub read_only: Option<String>,
}

/// The whole configuration's answers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sources {
    /// The runtime settings (`agent.default_policy`, `agent.unlabeled`): the main file.
    pub settings: Editable,
    /// New policies (`policies.d`).
    pub new_policies: Editable,
    /// Every effective policy by name.
    pub policies: BTreeMap<String, Editable>,
}

/// The answers for `config` as loaded from `config_path`.
pub fn read(config_path: &Path, config: &Config) -> Sources {
    let parts = Parts::read(config_path);
    let policies_dir = dir::policies_dir(config_path);
    let dir_refusal = writable::check_dir(&policies_dir)
        .err()
        .map(|e| e.to_string());
    let main_dir = config_path.parent().unwrap_or(Path::new("/"));
    let main_refusal = writable::check_dir(main_dir).err().map(|e| e.to_string());
    let settings = Editable {
        source: "config",
        file: Some(config_path.display().to_string()),
        read_only: main_refusal,
    };
    let new_policies = Editable {
        source: "policies.d",
        file: Some(policies_dir.display().to_string()),
        read_only: dir_refusal.clone(),
    };
    let mut names: Vec<String> = config.policies.keys().cloned().collect();
    names.extend(
        [
            egress_policy::ALLOW_ALL,
            egress_policy::DENY_ALL,
            egress_policy::AUDIT,
        ]
        .map(str::to_owned),
    );
    let policies = names
        .into_iter()
        .map(|name| {
            let e = match &parts {
                Ok(parts) => of(parts, &name, dir_refusal.as_deref()),
                Err(err) => Editable {
                    source: "unknown",
                    file: None,
                    read_only: Some(format!(
                        "the configuration's files could not be read: {err}"
                    )),
                },
            };
            (name, e)
        })
        .collect();
    Sources {
        settings,
        new_policies,
        policies,
    }
}

/// One policy's answer; `dir_refusal`: why `policies.d` can't be written, if it can't.
pub fn of(parts: &Parts, name: &str, dir_refusal: Option<&str>) -> Editable {
    match parts.source_of(name) {
        Some(source @ "built-in") => Editable {
            source,
            file: None,
            read_only: Some(format!(
                "{name} is built in and can't be changed; duplicate it to make a policy of your own"
            )),
        },
        Some(source @ "config") => Editable {
            source,
            file: Some(parts.main_path.display().to_string()),
            read_only: Some(format!(
                "policies.{name} is defined in {}, which the agent only reads for policies: edit \
                 it there (export gives text to paste), or move it to {} to manage it here",
                parts.main_path.display(),
                parts.dir.display()
            )),
        },
        Some(source) => Editable {
            source,
            file: Some(dir::policy_path(&parts.dir, name).display().to_string()),
            read_only: dir_refusal.map(str::to_owned),
        },
        None => Editable {
            source: "unknown",
            file: None,
            read_only: Some(format!("policy {name:?} is in no file the agent knows")),
        },
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::kubelet;

    const MAIN: &str = "[agent]\ndefault_policy = \"deny_all\"\n\n[policies.handmade]\nallow_hosts = [\"example.com\"]\n";

    #[test]
    fn built_ins_and_main_file_policies_are_read_only_and_policies_d_is_not() {
        let d = crate::test_dir::fresh("sources");
        let cfg = d.join("config.toml");
        std::fs::write(&cfg, MAIN).unwrap();
        dir::write_atomic(
            &d.join("policies.d/ci.toml"),
            b"allow_hosts = [\"github.com\"]\n",
        )
        .unwrap();
        let s = read(&cfg, &Config::load(&cfg).unwrap());
        assert_eq!(s.settings.read_only, None);
        assert_eq!(s.new_policies.read_only, None);
        assert_eq!(s.policies["ci"].source, "policies.d");
        assert_eq!(s.policies["ci"].read_only, None);
        assert!(
            s.policies["ci"]
                .file
                .as_deref()
                .unwrap()
                .ends_with("policies.d/ci.toml")
        );
        let main = &s.policies["handmade"];
        assert_eq!(main.source, "config");
        assert!(
            main.read_only.as_deref().unwrap().contains("defined in"),
            "{main:?}"
        );
        let builtin = &s.policies["allow_all"];
        assert_eq!(builtin.source, "built-in");
        assert!(
            builtin.read_only.as_deref().unwrap().contains("duplicate"),
            "{builtin:?}"
        );
    }

    #[test]
    fn a_configmap_policies_d_makes_its_policies_and_new_ones_read_only() {
        let (d, policies) = kubelet::volume(
            "sources-k8s",
            &[("ci.toml", "allow_hosts = [\"github.com\"]\n")],
        );
        let cfg = d.join("config.toml");
        std::fs::write(&cfg, MAIN).unwrap();
        assert_eq!(dir::policies_dir(&cfg), policies);
        let s = read(&cfg, &Config::load(&cfg).unwrap());
        for e in [&s.policies["ci"], &s.new_policies] {
            assert!(
                e.read_only.as_deref().unwrap().contains("ConfigMap"),
                "{e:?}"
            );
        }
        // The settings live in the main file, which is not in the volume.
        assert_eq!(s.settings.read_only, None);
    }
}
