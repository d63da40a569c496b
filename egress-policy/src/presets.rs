//! Built-in presets: named, reviewed host lists (`presets = ["github", "python"]`) that a policy
//! includes beside its own `allow_hosts`.
//!
//! The data is `egress-policy/presets.toml`, embedded at build time: per preset a name, a
//! description, its sources, the date it was checked and its hosts in the `allow_hosts` forms
//! ([`HostEntry`]). Expansion happens in one place, when a [`Policy`](super::Policy) is read
//! ([`expand`]): each preset's hosts are appended to `allow_hosts`, marked with the preset they
//! came from ([`HostEntry::preset`]), so every enforcement point (proxy, transparent listeners,
//! DNS responder, kernel direct ports) sees them like any other entry, and explain names the
//! preset. A policy written back (export, the API) keeps `presets = [...]` and only its own
//! entries: the expansion is never flattened into it.
use std::collections::BTreeSet;
use std::sync::{Arc, LazyLock};

use serde::{Deserialize, Deserializer, Serialize};

pub use super::host_entry::PresetName;
use super::host_entry::{Access, HostEntry};
use super::model::Policy;

/// The reviewed data file, as shipped.
pub const DATA: &str = include_str!("../presets.toml");

/// One preset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    pub name: String,
    pub description: String,
    /// Where the hosts come from (vendor documentation, gh-aw's ecosystem list).
    pub sources: Vec<String>,
    /// When the list was last checked against its sources (`YYYY-MM-DD`).
    pub checked: String,
    pub hosts: Vec<HostEntry>,
}

/// A set of presets (the built-in one, or an older data file to compare with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presets {
    list: Vec<Preset>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    preset: Vec<Preset>,
}

/// What is wrong with a presets data file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("presets data: {0}")]
pub struct DataError(String);

impl Presets {
    /// Parses and checks a presets data file: unique names (lower-case letters, digits, `-`),
    /// at least one host each, a `YYYY-MM-DD` date, at least one source.
    pub fn parse(text: &str) -> Result<Presets, DataError> {
        let file: File = toml::from_str(text).map_err(|e| DataError(e.to_string()))?;
        let mut seen = BTreeSet::new();
        for p in &file.preset {
            let bad = |what: &str| DataError(format!("preset {:?}: {what}", p.name));
            if p.name.is_empty()
                || !p
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return Err(bad("names are lower-case letters, digits and -"));
            }
            if !seen.insert(p.name.as_str()) {
                return Err(bad("defined twice"));
            }
            if p.hosts.is_empty() {
                return Err(bad("no hosts"));
            }
            if p.sources.is_empty() {
                return Err(bad("no sources"));
            }
            let date = p.checked.as_bytes();
            let digits = [0, 1, 2, 3, 5, 6, 8, 9];
            if date.len() != 10
                || date[4] != b'-'
                || date[7] != b'-'
                || !digits.iter().all(|&i| date[i].is_ascii_digit())
            {
                return Err(bad("checked must be YYYY-MM-DD"));
            }
        }
        Ok(Presets { list: file.preset })
    }

    /// The built-in presets ([`DATA`]; a unit test proves they parse).
    pub fn builtin() -> &'static Presets {
        static BUILTIN: LazyLock<Presets> = LazyLock::new(|| {
            #[expect(clippy::expect_used, reason = "embedded data, checked by a unit test")]
            Presets::parse(DATA).expect("egress-policy/presets.toml is valid")
        });
        &BUILTIN
    }

    pub fn get(&self, name: &str) -> Option<&Preset> {
        self.list.iter().find(|p| p.name == name)
    }

    /// In the data file's order.
    pub fn iter(&self) -> impl Iterator<Item = &Preset> {
        self.list.iter()
    }

    /// The names, comma-separated (for error messages).
    pub fn names(&self) -> String {
        let names: Vec<&str> = self.list.iter().map(|p| p.name.as_str()).collect();
        names.join(", ")
    }
}

impl PresetName {
    /// A built-in preset's name, or an error naming the known ones.
    pub fn parse(s: &str) -> Result<PresetName, String> {
        let presets = Presets::builtin();
        match presets.get(s) {
            Some(p) => Ok(PresetName(Arc::from(p.name.as_str()))),
            None => Err(format!(
                "unknown preset {s:?}; the presets are: {} (`egress-agent presets` lists them)",
                presets.names()
            )),
        }
    }

    /// The built-in preset it names.
    pub fn preset(&self) -> Option<&'static Preset> {
        Presets::builtin().get(self.as_str())
    }
}

impl<'de> Deserialize<'de> for PresetName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PresetName::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Policy {
    /// The fields, then the one expansion of `presets` into `allow_hosts`.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut policy = Policy::deserialize(d)?;
        let read_only = crate::forge::read_only_presets(
            &policy.presets,
            &policy.read_only_presets,
            &policy.repos,
        );
        expand_read_only(&mut policy.allow_hosts, &policy.presets, &read_only);
        Ok(policy)
    }
}

impl Serialize for Policy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Policy::serialize(self, s)
    }
}

impl Policy {
    /// Sets `presets` and expands them into `allow_hosts` (for policies built in code, e.g. from
    /// labels; a policy read from a file or a body is expanded as it is read).
    pub fn with_presets(mut self, presets: Vec<PresetName>) -> Policy {
        self.presets = presets;
        let read_only =
            crate::forge::read_only_presets(&self.presets, &self.read_only_presets, &self.repos);
        expand_read_only(&mut self.allow_hosts, &self.presets, &read_only);
        self
    }
}

/// Appends the hosts of `presets` to `hosts`, each marked with its preset. An entry equal to one
/// already there (the policy's own, or an earlier preset's) is not added twice: the first one
/// keeps its provenance. Entries already marked (an earlier expansion) are dropped first, so
/// expanding twice changes nothing.
pub fn expand(hosts: &mut Vec<HostEntry>, presets: &[PresetName]) {
    expand_read_only(hosts, presets, &[]);
}

/// A preset's entry as a policy with that `access` to the preset gets it: read-only, an entry
/// loses the ports of its own (they open direct connections no proxy reads, e.g. git over SSH)
/// and keeps its name on `allow_ports`.
fn read_as(entry: &HostEntry, access: Access) -> HostEntry {
    match access {
        Access::Full => entry.clone(),
        Access::ReadOnly => HostEntry {
            ports: Vec::new(),
            access,
            ..entry.clone()
        },
    }
}

/// [`expand`], the entries of the presets in `read_only` marked [`Access::ReadOnly`] (without
/// ports of their own: [`read_as`]). An entry equal to one
/// already there but for its access is added too: a read-only entry covers every name it
/// matches, whatever other entries say (see `l7`).
pub fn expand_read_only(
    hosts: &mut Vec<HostEntry>,
    presets: &[PresetName],
    read_only: &[PresetName],
) {
    hosts.retain(|h| h.preset.is_none());
    for name in presets {
        let Some(preset) = name.preset() else {
            continue;
        };
        let access = if read_only.contains(name) {
            Access::ReadOnly
        } else {
            Access::Full
        };
        for entry in &preset.hosts {
            let entry = read_as(entry, access);
            if hosts
                .iter()
                .any(|h| h.pattern == entry.pattern && h.ports == entry.ports && h.access == access)
            {
                continue;
            }
            hosts.push(HostEntry {
                preset: Some(name.clone()),
                ..entry
            });
        }
    }
}

impl Preset {
    /// What `egress-agent presets --json` shows of it: name, description, host count, date
    /// checked, sources (`presets show` and `GET /v1/presets` give the whole preset).
    pub fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "description": self.description,
            "hosts": self.hosts.len(),
            "checked": self.checked,
            "sources": self.sources,
        })
    }
}

/// Per preset a policy names, every host of the preset in the `allow_hosts` forms:
/// `{"github": ["api.github.com", {"host": "github.com", "ports": [22]}, ...]}` (empty object
/// for a policy without presets). What the CLI, the API and MCP show beside a policy.
pub fn expansion(policy: &super::Policy) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    let read_only_presets =
        crate::forge::read_only_presets(&policy.presets, &policy.read_only_presets, &policy.repos);
    for name in &policy.presets {
        let read_only = read_only_presets.contains(name);
        let hosts = name
            .preset()
            .map(|p| {
                let access = if read_only {
                    Access::ReadOnly
                } else {
                    Access::Full
                };
                let hosts: Vec<HostEntry> = p.hosts.iter().map(|h| read_as(h, access)).collect();
                serde_json::to_value(&hosts).unwrap_or_default()
            })
            .unwrap_or_default();
        out.insert(name.to_string(), hosts);
    }
    serde_json::Value::Object(out)
}

/// What changed in one preset between two data files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PresetChange {
    pub name: String,
    /// `added`, `removed` (the whole preset) or `changed`.
    pub kind: &'static str,
    /// Entries as `allow_hosts` shows them (`github.com (ports 22)`).
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

/// Per preset, the entries `new` adds to and removes from `old` (presets that did not change
/// are left out), in `new`'s order then the removed presets.
pub fn diff(old: &Presets, new: &Presets) -> Vec<PresetChange> {
    let shown = |p: Option<&Preset>| -> BTreeSet<String> {
        p.map(|p| p.hosts.iter().map(HostEntry::to_string).collect())
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    let names = new
        .iter()
        .map(|p| p.name.as_str())
        .chain(old.iter().map(|p| p.name.as_str()))
        .collect::<Vec<_>>();
    let mut done = BTreeSet::new();
    for name in names {
        if !done.insert(name) {
            continue;
        }
        let (o, n) = (old.get(name), new.get(name));
        let (before, after) = (shown(o), shown(n));
        let added: Vec<String> = after.difference(&before).cloned().collect();
        let removed: Vec<String> = before.difference(&after).cloned().collect();
        let kind = match (o, n) {
            (None, _) => "added",
            (_, None) => "removed",
            _ if added.is_empty() && removed.is_empty() => continue,
            _ => "changed",
        };
        out.push(PresetChange {
            name: name.to_owned(),
            kind,
            added,
            removed,
        });
    }
    out
}

/// The Markdown list docs/policy.md carries between its `presets:begin` / `presets:end`
/// markers: per preset its name, description, sources, date and every host.
pub fn markdown(presets: &Presets) -> String {
    let mut out = String::new();
    for p in presets.iter() {
        out.push_str(&format!("### `{}`\n\n{}.\n\n", p.name, p.description));
        for h in &p.hosts {
            out.push_str(&format!("- `{}`", h.pattern));
            if !h.ports.is_empty() {
                let ports: Vec<String> = h.ports.iter().map(u16::to_string).collect();
                out.push_str(&format!(" — ports {} as well", ports.join(", ")));
            }
            out.push('\n');
        }
        out.push_str(&format!("\nChecked {} against:", p.checked));
        for s in &p.sources {
            out.push_str(&format!(" <{s}>"));
        }
        out.push_str("\n\n");
    }
    out
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_data_parses_and_holds_the_required_presets() {
        let p = Presets::parse(DATA).unwrap();
        for name in [
            "github",
            "anthropic",
            "openai",
            "python",
            "node",
            "rust",
            "debian",
            "containers",
            "go",
            "certificates",
        ] {
            let preset = p.get(name).unwrap_or_else(|| panic!("preset {name}"));
            assert!(!preset.hosts.is_empty() && !preset.sources.is_empty());
            assert!(preset.hosts.iter().all(|h| h.preset.is_none()));
        }
        let shown = |name: &str| -> Vec<String> {
            p.get(name)
                .unwrap()
                .hosts
                .iter()
                .map(HostEntry::to_string)
                .collect()
        };
        let github = shown("github");
        for h in [
            "github.com (ports 22)",
            "ssh.github.com (ports 443)",
            "api.github.com",
            "codeload.github.com",
            "*.githubcopilot.com",
        ] {
            assert!(github.contains(&h.to_owned()), "{h} in {github:?}");
        }
        assert!(
            shown("certificates")
                .iter()
                .all(|h| h.ends_with("(ports 80)")),
            "revocation checks are plain HTTP"
        );
    }

    #[test]
    fn bad_data_is_refused_with_the_preset_named() {
        let one = |extra: &str| {
            format!(
                "[[preset]]\nname = \"x\"\ndescription = \"d\"\nsources = [\"s\"]\nchecked = \"2026-01-02\"\nhosts = [\"a.test\"]\n{extra}"
            )
        };
        assert!(Presets::parse(&one("")).is_ok());
        let twice = format!("{}{}", one(""), one(""));
        assert!(
            Presets::parse(&twice)
                .unwrap_err()
                .to_string()
                .contains("\"x\": defined twice")
        );
        let e = Presets::parse(&one("").replace("2026-01-02", "Jan 2")).unwrap_err();
        assert!(e.to_string().contains("YYYY-MM-DD"), "{e}");
        let e = Presets::parse(&one("").replace("name = \"x\"", "name = \"X y\"")).unwrap_err();
        assert!(e.to_string().contains("lower-case"), "{e}");
        let e = Presets::parse(&one("").replace("[\"a.test\"]", "[]")).unwrap_err();
        assert!(e.to_string().contains("no hosts"), "{e}");
        let e = Presets::parse(&one("").replace("a.test", "10.0.0.1")).unwrap_err();
        assert!(e.to_string().contains("allow_cidrs"), "{e}");
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = PresetName::parse("gitlab").unwrap_err();
        assert!(e.starts_with("unknown preset \"gitlab\""), "{e}");
        assert!(e.contains("github") && e.contains("python"), "{e}");
        assert_eq!(PresetName::parse("github").unwrap().as_str(), "github");
    }

    #[test]
    fn expansion_marks_provenance_skips_duplicates_and_is_idempotent() {
        let own: HostEntry = super::super::matcher::HostPattern::parse("api.github.com")
            .unwrap()
            .into();
        let mut hosts = vec![own.clone()];
        let names = [
            PresetName::parse("github").unwrap(),
            PresetName::parse("containers").unwrap(),
        ];
        expand(&mut hosts, &names);
        assert_eq!(
            hosts[0], own,
            "the policy's own entry stays first, unmarked"
        );
        let api = hosts
            .iter()
            .filter(|h| h.pattern.to_string() == "api.github.com")
            .count();
        assert_eq!(api, 1, "the preset's copy of an own entry is not added");
        let ghcr = hosts
            .iter()
            .find(|h| h.pattern.to_string() == "ghcr.io")
            .unwrap();
        assert_eq!(
            ghcr.preset.as_ref().map(PresetName::as_str),
            Some("containers")
        );
        let pkg = hosts
            .iter()
            .filter(|h| h.pattern.to_string() == "pkg-containers.githubusercontent.com")
            .count();
        assert_eq!(pkg, 1);
        let before = hosts.clone();
        expand(&mut hosts, &names);
        assert_eq!(hosts, before);
    }

    #[test]
    fn diff_names_added_and_removed_hosts_per_preset() {
        let file = |name: &str, hosts: &str| {
            format!(
                "[[preset]]\nname = \"{name}\"\ndescription = \"d\"\nsources = [\"s\"]\nchecked = \"2026-01-02\"\nhosts = [{hosts}]\n"
            )
        };
        let old = Presets::parse(&format!(
            "{}{}",
            file("a", "\"x.test\", \"y.test\""),
            file("gone", "\"g.test\"")
        ))
        .unwrap();
        let new = Presets::parse(&format!(
            "{}{}",
            file("a", "\"y.test\", { host = \"x.test\", ports = [22] }"),
            file("fresh", "\"f.test\"")
        ))
        .unwrap();
        let d = diff(&old, &new);
        assert_eq!(
            d,
            vec![
                PresetChange {
                    name: "a".into(),
                    kind: "changed",
                    added: vec!["x.test (ports 22)".into()],
                    removed: vec!["x.test".into()],
                },
                PresetChange {
                    name: "fresh".into(),
                    kind: "added",
                    added: vec!["f.test".into()],
                    removed: vec![],
                },
                PresetChange {
                    name: "gone".into(),
                    kind: "removed",
                    added: vec![],
                    removed: vec!["g.test".into()],
                },
            ]
        );
        assert!(diff(&new, &new).is_empty());
    }

    #[test]
    fn a_policy_reads_expanded_and_writes_back_its_presets_unflattened() {
        let p = crate::testing::policy("presets = [\"github\"]\nallow_hosts = [\"example.com\"]");
        assert_eq!(p.own_hosts().count(), 1);
        assert!(p.allow_hosts.len() > 10, "{:?}", p.allow_hosts);
        let toml_text = toml::to_string(&p).unwrap();
        assert!(toml_text.contains("presets = [\"github\"]"), "{toml_text}");
        assert!(!toml_text.contains("api.github.com"), "{toml_text}");
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["allow_hosts"], serde_json::json!(["example.com"]));
        assert_eq!(json["presets"], serde_json::json!(["github"]));
        let back: crate::Policy = toml::from_str(&toml_text).unwrap();
        assert_eq!(back, p, "the round trip expands the same hosts again");
        let built = crate::Policy {
            mode: crate::Mode::Allowlist,
            ..crate::Policy::deny_all()
        }
        .with_presets(vec![PresetName::parse("github").unwrap()]);
        assert_eq!(built.allow_hosts.len(), p.allow_hosts.len() - 1);
    }

    #[test]
    fn preset_hosts_are_allowed_by_the_matcher_and_named_by_their_rule() {
        let name = |s: &str| crate::name::HostName::parse(s).unwrap();
        let p = crate::CompiledPolicy::new(&crate::testing::policy(
            "presets = [\"github\", \"certificates\"]",
        ));
        for (host, port) in [
            ("api.github.com", 443),
            ("github.com", 22),
            ("raw.githubusercontent.com", 443),
            ("ocsp.digicert.com", 80),
        ] {
            let d = crate::name::Destination::parse(host).unwrap();
            assert_eq!(p.check_target(&d, port), Ok(()), "{host}:{port}");
        }
        let d = crate::name::Destination::parse("api.github.com").unwrap();
        assert_eq!(
            p.check_target(&crate::name::Destination::parse("gitlab.com").unwrap(), 443),
            Err(crate::DenyReason::HostNotAllowed)
        );
        assert_eq!(
            p.check_target(&d, 80),
            Err(crate::DenyReason::PortNotAllowed)
        );
        let (decision, _) = p.decide_name(&name("api.github.com"));
        assert_eq!(
            p.describe(decision.rule().unwrap()),
            "allow_hosts api.github.com (preset github)"
        );
    }

    #[test]
    fn read_only_presets_mark_their_entries_without_ports_of_their_own() {
        let p = crate::testing::policy(
            "presets = [\"github\", \"python\"]\nread_only_presets = [\"github\"]\nallow_hosts = [\"github.com\"]",
        );
        p.validate("policies.p").unwrap();
        let of = |preset: &str| -> Vec<&HostEntry> {
            p.allow_hosts
                .iter()
                .filter(|h| h.preset.as_ref().is_some_and(|n| n.as_str() == preset))
                .collect()
        };
        let github = of("github");
        assert!(!github.is_empty());
        assert!(
            github
                .iter()
                .all(|h| h.access.is_read_only() && h.ports.is_empty())
        );
        // The SSH entries lose their own ports (github.com stays, on allow_ports); the policy's
        // own full github.com stays beside the preset's read-only one (read-only wins in `l7`).
        assert!(!p.allow_hosts.iter().any(|h| h.ports == [22]));
        assert!(github.iter().any(|h| h.pattern.to_string() == "github.com"));
        assert!(of("python").iter().all(|h| !h.access.is_read_only()));
        let l7 = crate::l7::L7Policy::new(&p);
        let host = crate::name::HostName::parse("github.com").unwrap();
        assert!(l7.read_only(&host, 443));
        // Shown as read-only; written back as names.
        let shown = expansion(&p);
        assert!(
            shown["github"]
                .as_array()
                .unwrap()
                .iter()
                .all(|h| h["access"] == "read-only"),
            "{shown}"
        );
        let text = toml::to_string(&p).unwrap();
        assert!(text.contains("read_only_presets = [\"github\"]"), "{text}");
        let back: crate::Policy = toml::from_str(&text).unwrap();
        assert_eq!(back, p);
        // Only presets the policy uses, each once.
        let read = |t: &str| toml::from_str::<crate::Policy>(t).unwrap();
        let e = read("presets = [\"go\"]\nread_only_presets = [\"github\"]")
            .validate("policies.p")
            .unwrap_err();
        assert_eq!(e.field, "policies.p.read_only_presets[0]");
        assert!(e.message.contains("not in presets"), "{e}");
        let e = read("presets = [\"go\"]\nread_only_presets = [\"go\", \"go\"]")
            .validate("policies.p")
            .unwrap_err();
        assert_eq!(e.field, "policies.p.read_only_presets[1]");
    }

    #[test]
    fn read_only_host_entries_parse_show_and_round_trip() {
        let p = crate::testing::policy(
            "allow_hosts = [{ host = \"git.example\", access = \"read-only\" }, \"full.example\"]",
        );
        assert!(p.allow_hosts[0].access.is_read_only());
        assert_eq!(p.allow_hosts[0].to_string(), "git.example (read-only)");
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(
            json["allow_hosts"],
            serde_json::json!([{ "host": "git.example", "access": "read-only" }, "full.example"])
        );
        let back: crate::Policy = serde_json::from_value(json).unwrap();
        assert_eq!(back, p);
        let read = |t: &str| toml::from_str::<crate::Policy>(t);
        let e =
            read("allow_hosts = [{ host = \"g.example\", access = \"read-only\", ports = [22] }]")
                .unwrap_err();
        assert!(e.message().contains("can't carry its own ports"), "{e}");
        let e = read("allow_hosts = [{ host = \"g.example\", access = \"write\" }]").unwrap_err();
        assert!(e.message().contains("read-only"), "{e}");
        let e = read("allow_hosts = [{ host = \"g.example\", access = \"full\" }]").unwrap_err();
        assert!(e.message().contains("ports"), "{e}");
    }

    #[test]
    fn presets_are_checked_with_their_field() {
        let read = |t: &str| toml::from_str::<crate::Policy>(t);
        let e = read("presets = [\"github\", \"gitlab\"]").unwrap_err();
        assert!(e.message().contains("unknown preset \"gitlab\""), "{e}");
        let twice: crate::Policy = read("presets = [\"go\", \"go\"]").unwrap();
        let e = twice.validate("policies.p").unwrap_err();
        assert_eq!(e.field, "policies.p.presets[1]");
        assert!(e.message.contains("listed twice"), "{e}");
        let sealed: crate::Policy = read("mode = \"deny_all\"\npresets = [\"go\"]").unwrap();
        let e = sealed.validate("policies.p").unwrap_err();
        assert_eq!(e.field, "policies.p.presets[0]");
        assert!(e.message.contains("allowlist"), "{e}");
    }

    #[test]
    fn a_credential_may_bind_a_host_its_policy_has_from_a_preset() {
        let p = crate::testing::policy(
            "presets = [\"anthropic\"]\n[[credentials]]\nhost = \"api.anthropic.com\"\nheader = \"x-api-key\"\nsource = { env = \"ANTHROPIC_API_KEY\" }\n",
        );
        assert_eq!(p.credentials.len(), 1);
        let outside: crate::Policy = toml::from_str(
            "presets = [\"openai\"]\n[[credentials]]\nhost = \"api.anthropic.com\"\nheader = \"x-api-key\"\nsource = { env = \"K\" }\n",
        )
        .unwrap();
        let e = outside.validate("policies.p").unwrap_err();
        assert!(e.field.starts_with("policies.p.credentials[0]"), "{e}");
    }
}
