//! `doctor --baseline minimal|standard|strict`: which probes a baseline requires (the data table
//! `baselines.toml`, compiled in) and the verdict on a report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Report, Status};

/// The baselines, in increasing strictness (the names of `baselines.toml`'s tables).
pub const NAMES: &[&str] = &["minimal", "standard", "strict"];

const TABLE: &str = include_str!("baselines.toml");

/// Why a baseline could not be had.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    #[error("unknown baseline {0:?} (known: minimal, standard, strict)")]
    Unknown(String),
    #[error("baselines.toml: {0}")]
    Table(#[from] toml::de::Error),
}

/// One baseline: probes that must pass, and probes that must pass unless they are `skip`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    #[serde(skip)]
    pub name: String,
    pub description: String,
    /// Must be `pass`.
    #[serde(default)]
    pub require: Vec<String>,
    /// Must be `pass` or `skip` (not applicable on this host).
    #[serde(default)]
    pub if_present: Vec<String>,
}

/// A required probe that did not pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Miss {
    pub id: String,
    pub status: Status,
}

/// A baseline's verdict on a report: the `baseline` member of `doctor --json --baseline`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// The baseline's name.
    pub name: String,
    /// Every required probe passed.
    pub met: bool,
    /// How many probes the baseline required on this host (`if_present` ones that were `skip`
    /// are not counted).
    pub required: usize,
    /// The required probes that did not pass, in report order.
    pub missing: Vec<Miss>,
}

/// Every baseline of the table, by name.
pub fn all() -> Result<BTreeMap<String, Baseline>, BaselineError> {
    let mut map: BTreeMap<String, Baseline> = toml::from_str(TABLE)?;
    for (name, b) in map.iter_mut() {
        b.name = name.clone();
    }
    Ok(map)
}

/// The baseline called `name`.
pub fn get(name: &str) -> Result<Baseline, BaselineError> {
    all()?
        .remove(name)
        .ok_or_else(|| BaselineError::Unknown(name.to_owned()))
}

impl Baseline {
    /// Judge `report`. A required probe missing from the report counts as `skip`.
    pub fn judge(&self, report: &Report) -> Verdict {
        let mut required = 0;
        let mut missing = Vec::new();
        for c in &report.checks {
            let strict = self.require.iter().any(|id| id == c.id);
            let lenient = self.if_present.iter().any(|id| id == c.id);
            // An `if_present` probe that is `skip` does not apply to this host.
            let applies = strict || (lenient && c.status != Status::Skip);
            if !applies {
                continue;
            }
            required += 1;
            if c.status != Status::Pass {
                missing.push(Miss {
                    id: c.id.to_owned(),
                    status: c.status,
                });
            }
        }
        // Required ids the report does not hold (a partial run).
        for id in &self.require {
            if !report.checks.iter().any(|c| c.id == id.as_str()) {
                required += 1;
                missing.push(Miss {
                    id: id.clone(),
                    status: Status::Skip,
                });
            }
        }
        Verdict {
            name: self.name.clone(),
            met: missing.is_empty(),
            required,
            missing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Check, PROBE_IDS};
    use super::*;

    #[test]
    fn the_table_names_only_real_probes() {
        let all = all().expect("baselines.toml parses");
        let names: Vec<&str> = all.keys().map(String::as_str).collect();
        let mut expected = NAMES.to_vec();
        expected.sort_unstable();
        assert_eq!(names, expected, "baselines.toml tables vs NAMES");
        for b in all.values() {
            for id in b.require.iter().chain(&b.if_present) {
                assert!(
                    PROBE_IDS.contains(&id.as_str()),
                    "{}: no probe {id}",
                    b.name
                );
            }
            for id in &b.require {
                assert!(!b.if_present.contains(id), "{}: {id} listed twice", b.name);
            }
        }
        // Each baseline asks at least what the one before it asks.
        for pair in NAMES.windows(2) {
            let (lo, hi) = (&all[pair[0]], &all[pair[1]]);
            for id in &lo.require {
                assert!(
                    hi.require.contains(id),
                    "{} lacks {id} of {}",
                    hi.name,
                    lo.name
                );
            }
            for id in &lo.if_present {
                assert!(
                    hi.require.contains(id) || hi.if_present.contains(id),
                    "{} lacks {id} of {}",
                    hi.name,
                    lo.name
                );
            }
        }
    }

    #[test]
    fn verdicts() {
        let b = Baseline {
            name: "t".into(),
            description: String::new(),
            require: vec!["kernel.btf".into(), "host.fail2ban".into()],
            if_present: vec!["docker.seccomp".into(), "docker.privileged".into()],
        };
        let check = |id, status| Check {
            id,
            status,
            summary: String::new(),
            fix: None,
        };
        let report = |f2b, seccomp| Report {
            checks: vec![
                check("kernel.btf", Status::Pass),
                check("host.fail2ban", f2b),
                check("docker.seccomp", seccomp),
                check("docker.privileged", Status::Skip),
            ],
        };
        let v = b.judge(&report(Status::Pass, Status::Skip));
        assert!(v.met, "{v:?}");
        assert_eq!(v.required, 2);
        let v = b.judge(&report(Status::Skip, Status::Warn));
        assert!(!v.met);
        assert_eq!(v.required, 3);
        assert_eq!(
            v.missing,
            [
                Miss {
                    id: "host.fail2ban".into(),
                    status: Status::Skip
                },
                Miss {
                    id: "docker.seccomp".into(),
                    status: Status::Warn
                }
            ]
        );
        assert!(matches!(get("lax"), Err(BaselineError::Unknown(_))));
        assert!(get("strict").is_ok());
    }
}
