//! Forge scoping: `repos = ["acme/api", "acme/*"]` in a policy lets its read-only hosts take
//! writes to those repositories only (issue #36).
//!
//! A forge (GitHub, or any host that speaks git's smart HTTP and a GitHub-shaped REST API) is
//! the exfiltration channel every confined agent has: allowed at all, it takes a push to any
//! repository, an issue anywhere, a gist. With the forge's hosts read-only
//! ([`crate::host_entry::Access::ReadOnly`]: reads and git fetch only), `repos` names where
//! writes may go. On each read-only name and `allow_ports` port, per repository `owner/repo`,
//! any method is allowed on:
//! - `/owner/repo/**` and `/owner/repo.git/**`: git over HTTPS (`git-receive-pack`, i.e. push,
//!   and LFS's `info/lfs/**`);
//! - `/repos/owner/repo/**`: the REST API (issues, pulls, contents, releases; release asset
//!   uploads on `uploads.github.com` have the same shape).
//!
//! Everything else that is not a read stays `request-not-allowed`: another repository's push,
//! `POST /gists`, `POST /user/repos`, and GraphQL (`POST /graphql` can't be scoped by path: its
//! mutations name objects by id). `repo` may be `*` (every repository of that owner); the owner
//! can't be a wildcard (that would be every repository again).
use std::fmt;

use super::host_entry::PresetName;

use serde::{Deserialize, Deserializer, Serialize};

use super::matcher::HostPattern;
use super::rules::{PathGlob, RequestRule, RuleAction};

/// Presets that are a forge: with `repos` set, a policy's presets among these are read-only
/// whether or not `read_only_presets` names them (`presets = ["github"]` + `repos` is scoped).
pub const FORGE_PRESETS: &[&str] = &["github"];

/// The presets of a policy whose hosts are read-only: `read_only_presets`, and with `repos`
/// set, the forges of `presets` ([`FORGE_PRESETS`]).
pub fn read_only_presets(
    presets: &[PresetName],
    read_only: &[PresetName],
    repos: &[RepoPattern],
) -> Vec<PresetName> {
    let mut out = read_only.to_vec();
    if !repos.is_empty() {
        for p in presets {
            if FORGE_PRESETS.contains(&p.as_str()) && !out.contains(p) {
                out.push(p.clone());
            }
        }
    }
    out
}

/// One `repos` entry: `owner/repo` or `owner/*`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RepoPattern {
    owner: String,
    /// `None`: every repository of `owner`.
    repo: Option<String>,
}

/// A name git forges accept for an owner or a repository (and that a path glob reads
/// literally): letters, digits, `.`, `_`, `-`, not `.` or `..`.
fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

impl RepoPattern {
    pub fn parse(s: &str) -> Result<RepoPattern, String> {
        let (owner, repo) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected \"owner/repo\" or \"owner/*\""))?;
        if owner == "*" {
            return Err(format!(
                "{s:?}: the owner can't be a wildcard (that would be every repository); name the owner"
            ));
        }
        if !plain_name(owner) {
            return Err(format!(
                "{s:?}: the owner {owner:?} is not a name (letters, digits, '.', '_', '-')"
            ));
        }
        let repo = match repo {
            "*" => None,
            r if plain_name(r) && !r.ends_with(".git") => Some(r.to_owned()),
            r => {
                return Err(format!(
                    "{s:?}: the repository {r:?} is not a name (letters, digits, '.', '_', '-'; without \".git\") or \"*\""
                ));
            }
        };
        Ok(RepoPattern {
            owner: owner.to_owned(),
            repo,
        })
    }

    /// The path globs a write to this repository may take (see the module docs).
    fn globs(&self) -> Vec<String> {
        let o = &self.owner;
        match &self.repo {
            Some(r) => vec![
                format!("/{o}/{r}/**"),
                format!("/{o}/{r}.git/**"),
                format!("/repos/{o}/{r}/**"),
            ],
            None => vec![format!("/{o}/*/**"), format!("/repos/{o}/*/**")],
        }
    }
}

impl fmt::Display for RepoPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.owner, self.repo.as_deref().unwrap_or("*"))
    }
}

impl Serialize for RepoPattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RepoPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        RepoPattern::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The allow rules `repos` adds for one read-only name on `ports` (a glob that did not parse
/// would leave its rule out: fewer allows, never more).
pub fn write_rules(host: &HostPattern, ports: &[u16], repos: &[RepoPattern]) -> Vec<RequestRule> {
    let mut out = Vec::new();
    for &port in ports {
        for repo in repos {
            for glob in repo.globs() {
                if let Ok(path) = PathGlob::parse(&glob) {
                    out.push(RequestRule {
                        host: host.clone(),
                        port,
                        action: RuleAction::Allow,
                        methods: Vec::new(),
                        path,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn repo_patterns_are_owner_and_repo_names() {
        for ok in ["acme/api", "acme/*", "a-b.c_d/e.f-g", "acme/.github"] {
            assert_eq!(RepoPattern::parse(ok).unwrap().to_string(), ok);
        }
        for (bad, why) in [
            ("acme", "expected"),
            ("*/api", "owner can't be a wildcard"),
            ("*/*", "owner can't be a wildcard"),
            ("acme/api.git", "without"),
            ("acme/a/b", "not a name"),
            ("acme/..", "not a name"),
            ("../x", "not a name"),
            ("acme/a*", "not a name"),
            ("acme/", "not a name"),
            ("ac me/api", "not a name"),
            ("acme/%2e%2e", "not a name"),
        ] {
            let e = RepoPattern::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // Every glob a pattern makes parses (so no rule is ever left out).
        for p in ["acme/api", "acme/*", "a.b/c-d"] {
            for g in RepoPattern::parse(p).unwrap().globs() {
                PathGlob::parse(&g).unwrap();
            }
        }
    }
}
