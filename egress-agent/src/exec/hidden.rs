//! What `exec` hides from the command ([`crate::sandbox`] covers it): the agent's state, the pins,
//! and every secret the host holds for credential bindings.
//!
//! Secret sources, whichever policy the command runs under (a root command reads any file it
//! can see, so the selected policy's bindings are not enough):
//! - every `{ file = … }` source of every policy of the configuration;
//! - the same of the default configuration when `exec` runs with another one (a daemon's
//!   secrets), read without validating or loading anything ([`file_sources_in`]);
//! - `$CREDENTIALS_DIRECTORY` (systemd `LoadCredential=`, where `{ credential = … }` sources
//!   are), whenever `exec` has one.
//!
//! `{ env = … }` sources are not files: loading the configuration takes them out of `exec`'s
//! environment ([`crate::secrets`]), so the command never inherits them.
//!
//! A source is covered where it is named and where it resolves (a symbolic link's target). Its
//! directory is covered instead when that is safe: the directory holds nothing but secret
//! material (every entry a secret source or a regular file only its owner may read, mode
//! `0600`/`0400`) and is not a broad one ([`coverable_dir`]): not `/` or a top-level directory
//! (`/etc`, `/root`, `/home`, …), not a directory right below `/home`, `/var`, `/usr` or
//! `/usr/local`, and not the command's working directory, home, writable or read-only paths or
//! an ancestor of one (the configuration's directory is one of those). The credentials directory
//! is secret material by definition: covered unless it is such a broad directory.
//!
//! Why directories: a cover on a file stays on that file. A file created later next to it, or
//! one that replaces it (renamed over it: secret rotation, an editor's save), is a new entry the
//! cover is not on, and the command would read it. A cover on the directory hides whatever the
//! directory holds later too. A secret file hidden on its own gets a note saying so.
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use crate::config::{self, Config};
use egress_policy::secret::SecretSource;

/// Where the agent keeps what a command must never see (CA key, event store, pins): the
/// configured `agent.state_dir` and `agent.bpffs`, and the default state directory too (a daemon
/// with the default configuration may keep its CA there while this exec runs with another).
pub(super) fn state(config: &Config) -> Vec<PathBuf> {
    let mut hide = vec![config.agent.bpffs.clone(), config.agent.state_dir.clone()];
    let default = PathBuf::from(config::DEFAULT_STATE_DIR);
    if !hide.contains(&default) {
        hide.push(default);
    }
    hide
}

/// The `{ file = … }` sources of every policy of `config`.
pub(super) fn file_sources(config: &Config) -> Vec<PathBuf> {
    config
        .policies
        .values()
        .flat_map(|p| &p.credentials)
        .filter_map(|b| match &b.source {
            SecretSource::File(p) => Some(p.clone()),
            SecretSource::Env(_) | SecretSource::Credential(_) => None,
        })
        .collect()
}

/// The `{ file = … }` sources named in the configuration file `path` and its `policies.d`, by a
/// loose reading: nothing is validated or loaded (no secret read, no environment variable taken),
/// so a file this build would refuse still gives up its secret paths.
pub(super) fn file_sources_in(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    use anyhow::Context as _;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let main: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut out = Vec::new();
    if let Some(policies) = main.get("policies").and_then(toml::Value::as_table) {
        for policy in policies.values() {
            binding_files(policy, &mut out);
        }
    }
    let dir = config::policies_dir::policies_dir(path);
    if dir.exists() {
        for file in config::policies_dir::read_policies(&dir)? {
            let policy: toml::Value = toml::from_str(&file.text)
                .with_context(|| format!("parsing {}", file.path.display()))?;
            binding_files(&policy, &mut out);
        }
    }
    Ok(out)
}

/// `credentials[*].source.file` of one policy table.
fn binding_files(policy: &toml::Value, out: &mut Vec<PathBuf>) {
    let bindings = policy
        .get("credentials")
        .and_then(toml::Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for b in bindings {
        if let Some(f) = b
            .get("source")
            .and_then(|s| s.get("file"))
            .and_then(toml::Value::as_str)
        {
            out.push(PathBuf::from(f));
        }
    }
}

/// What to cover for the secrets, and what the operator should know about it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct SecretCovers {
    /// For [`crate::sandbox::Spec::secrets`]: directories and files, shortest first.
    pub paths: Vec<PathBuf>,
    /// Secret files hidden on their own, and why their directory is not.
    pub notes: Vec<String>,
}

/// Plan the covers of `sources` (secret files) and `credentials_dir`. `keep`: paths the command
/// needs (never covered, nor their ancestors; canonical); `hidden`: directories covered anyway
/// (the agent's state), whose secrets need nothing more.
pub(super) fn secret_covers(
    sources: &[PathBuf],
    credentials_dir: Option<&Path>,
    keep: &[PathBuf],
    hidden: &[PathBuf],
) -> SecretCovers {
    let hidden: Vec<PathBuf> = hidden
        .iter()
        .flat_map(|h| [h.clone(), canonical(h)])
        .collect();
    let under_hidden = |p: &Path| hidden.iter().any(|h| p.starts_with(h));
    // Every name a secret goes by, as given and resolved (to tell a directory's entries apart).
    let mut secrets: HashSet<PathBuf> = HashSet::new();
    for s in sources {
        secrets.insert(s.clone());
        secrets.insert(canonical(s));
    }
    let mut out = SecretCovers::default();
    if let Some(dir) = credentials_dir {
        for d in both(dir) {
            if under_hidden(&d) {
                continue;
            }
            match coverable_dir(&d, keep) {
                Ok(()) => out.paths.push(d),
                Err(why) => {
                    // Each credential on its own (what is there now; a broad directory can't be
                    // covered, see the module docs).
                    let entries = std::fs::read_dir(&d).into_iter().flatten().flatten();
                    out.paths.extend(entries.map(|e| e.path()));
                    out.notes.push(format!(
                        "the credentials directory {} is hidden file by file, not as a whole ({why})",
                        d.display()
                    ));
                }
            }
        }
    }
    for source in sources {
        for p in both(source) {
            if under_hidden(&p) {
                continue;
            }
            let dir = p.parent().unwrap_or(Path::new("/"));
            let why = coverable_dir(dir, keep).and_then(|()| {
                if holds_only_secrets(dir, &secrets) {
                    Ok(())
                } else {
                    Err(format!("{} holds other files", dir.display()))
                }
            });
            match why {
                Ok(()) => out.paths.push(dir.to_owned()),
                Err(why) => {
                    if std::fs::metadata(&p).is_ok() {
                        out.notes.push(format!(
                            "the secret file {} is hidden on its own, not with its directory ({why}): a file that replaces it while the command runs would be visible; keep secret files in a directory of their own",
                            p.display()
                        ));
                    }
                    out.paths.push(p);
                }
            }
        }
    }
    out.paths
        .sort_by(|a, b| (a.components().count(), a).cmp(&(b.components().count(), b)));
    out.paths.dedup();
    out.notes.dedup();
    out
}

/// `p`, and where it resolves if that differs.
fn both(p: &Path) -> Vec<PathBuf> {
    let c = canonical(p);
    if c == p {
        vec![c]
    } else {
        vec![p.to_owned(), c]
    }
}

/// Where `p` resolves, or `p` when it does not (yet) exist.
fn canonical(p: &Path) -> PathBuf {
    p.canonicalize().unwrap_or_else(|_| p.to_owned())
}

/// Directories right below these are broad too (homes, `/var/lib`, `/usr/share`, …).
const BROAD_PARENTS: [&str; 4] = ["/home", "/var", "/usr", "/usr/local"];

/// May `dir` be covered as a whole? Not a broad directory (see the module docs), where it is
/// named or where it resolves. `Err`: why not.
fn coverable_dir(dir: &Path, keep: &[PathBuf]) -> Result<(), String> {
    for d in both(dir) {
        if !d.is_absolute()
            || d.components().count() <= 2
            || d.parent()
                .is_some_and(|p| BROAD_PARENTS.iter().any(|b| p == Path::new(b)))
        {
            return Err(format!("{} is a system or home directory", d.display()));
        }
        if let Some(k) = keep.iter().find(|k| k.starts_with(&d)) {
            return Err(format!(
                "{} holds {}, which the command uses",
                d.display(),
                k.display()
            ));
        }
    }
    Ok(())
}

/// Does `dir` hold nothing but secret material: secret sources and regular files only their
/// owner may read (a dangling link reads nothing)? A directory that can't be read: no.
fn holds_only_secrets(dir: &Path, secrets: &HashSet<PathBuf>) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    for e in entries {
        let Ok(e) = e else { return false };
        let p = e.path();
        if secrets.contains(&p) || secrets.contains(&canonical(&p)) {
            continue;
        }
        match std::fs::metadata(&p) {
            Ok(m) if m.is_file() && m.mode() & 0o077 == 0 => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt as _, symlink};

    /// A scratch directory below /tmp (three components deep, so coverable by location).
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let d = std::env::temp_dir()
                .canonicalize()
                .unwrap()
                .join(format!("egress-hidden-{}-{name}", std::process::id()));
            std::fs::remove_dir_all(&d).ok();
            std::fs::create_dir_all(&d).unwrap();
            Scratch(d)
        }
        fn file(&self, rel: &str, mode: u32) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, "x").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            std::fs::remove_dir_all(&self.0).ok();
        }
    }

    #[test]
    fn a_directory_of_private_files_is_covered_whole() {
        let s = Scratch::new("dir");
        let t = s.file("secrets/t", 0o600);
        s.file("secrets/other-tool.key", 0o400);
        let c = secret_covers(&[t], None, &[], &[]);
        assert_eq!(c.paths, vec![s.0.join("secrets")]);
        assert!(c.notes.is_empty(), "{:?}", c.notes);
    }

    #[test]
    fn a_secret_beside_other_files_is_covered_alone_with_a_note() {
        let s = Scratch::new("broad");
        let t = s.file("etc/api.key", 0o600);
        s.file("etc/hosts", 0o644);
        let c = secret_covers(std::slice::from_ref(&t), None, &[], &[]);
        assert_eq!(c.paths, vec![t.clone()]);
        assert_eq!(c.notes.len(), 1);
        assert!(c.notes[0].contains("holds other files"), "{:?}", c.notes);
        // A subdirectory is not secret material either.
        let u = s.file("keys/u", 0o600);
        std::fs::create_dir(s.0.join("keys/old")).unwrap();
        assert_eq!(
            secret_covers(std::slice::from_ref(&u), None, &[], &[]).paths,
            vec![u]
        );
    }

    #[test]
    fn broad_and_needed_directories_are_never_covered() {
        let s = Scratch::new("keep");
        let t = s.file("work/t", 0o600);
        // The working directory (or any path below the candidate) stays.
        let keep = [s.0.join("work")];
        let c = secret_covers(std::slice::from_ref(&t), None, &keep, &[]);
        assert_eq!(c.paths, vec![t.clone()]);
        assert!(
            c.notes[0].contains("which the command uses"),
            "{:?}",
            c.notes
        );
        let keep = [s.0.join("work/sub/deeper")];
        assert_eq!(
            secret_covers(std::slice::from_ref(&t), None, &keep, &[]).paths,
            vec![t]
        );
        for d in [
            "/",
            "/etc",
            "/root",
            "/home",
            "/tmp",
            "/home/alice",
            "/var/lib",
            "/usr/share",
        ] {
            assert!(coverable_dir(Path::new(d), &[]).is_err(), "{d}");
        }
        assert!(coverable_dir(Path::new("/etc/egress-agent/secrets"), &[]).is_ok());
        // A link to a broad directory is judged where it leads.
        symlink("/root", s.0.join("to-root")).unwrap();
        assert!(coverable_dir(&s.0.join("to-root"), &[]).is_err());
    }

    #[test]
    fn a_symlinked_source_is_covered_where_it_leads_too() {
        let s = Scratch::new("link");
        let real = s.file("vault/real.key", 0o600);
        s.file("vault/README", 0o644);
        s.file("etc/hosts", 0o644);
        let link = s.0.join("etc/linked.key");
        symlink("../vault/real.key", &link).unwrap();
        let c = secret_covers(std::slice::from_ref(&link), None, &[], &[]);
        assert_eq!(c.paths, vec![link.clone(), real.clone()]);
        // In a directory of its own, the target's directory is covered.
        let s2 = Scratch::new("link2");
        let real = s2.file("secrets/real.key", 0o600);
        let link = s2.0.join("etc/linked.key");
        s2.file("etc/hosts", 0o644);
        symlink(&real, &link).unwrap();
        let c = secret_covers(std::slice::from_ref(&link), None, &[], &[]);
        assert_eq!(c.paths, vec![s2.0.join("secrets"), link]);
    }

    #[test]
    fn missing_sources_hide_their_directory_when_it_holds_only_secrets() {
        let s = Scratch::new("missing");
        s.file("secrets/present", 0o600);
        let later = s.0.join("secrets/later");
        let c = secret_covers(&[later], None, &[], &[]);
        assert_eq!(c.paths, vec![s.0.join("secrets")]);
        // Nowhere to put it: passed on as is (the sandbox skips what does not resolve), no note.
        let nowhere = s.0.join("no/such/file");
        let c = secret_covers(std::slice::from_ref(&nowhere), None, &[], &[]);
        assert_eq!(c.paths, vec![nowhere]);
        assert!(c.notes.is_empty());
    }

    #[test]
    fn the_credentials_directory_and_hidden_state() {
        let s = Scratch::new("creds");
        let creds = s.0.join("creds");
        s.file("creds/token", 0o644);
        let c = secret_covers(&[], Some(&creds), &[], &[]);
        assert_eq!(c.paths, vec![creds.clone()]);
        // Under a broad or needed directory: file by file.
        let keep = [creds.join("x")];
        let c = secret_covers(&[], Some(&creds), &keep, &[]);
        assert_eq!(c.paths, vec![creds.join("token")]);
        assert_eq!(c.notes.len(), 1);
        // Secrets in the agent's (hidden) state need nothing more.
        let t = s.file("state/secret", 0o600);
        s.file("state/ca.pem", 0o644);
        let c = secret_covers(&[t], None, &[], &[s.0.join("state")]);
        assert_eq!(c, SecretCovers::default());
    }

    #[test]
    fn loose_reading_finds_file_sources_of_an_invalid_configuration() {
        let s = Scratch::new("loose");
        let cfg = s.0.join("config.toml");
        std::fs::write(
            &cfg,
            r#"
unknown_field = 1
[policies.a]
allow_hosts = ["api.test"]
[[policies.a.credentials]]
host = "api.test"
source = { file = "/etc/egress-agent/secrets/a" }
[[policies.a.credentials]]
host = "env.test"
source = { env = "NOT_A_FILE" }
[policies.b]
credentials = [{ host = "b.test", source = { file = "/srv/b.key" } }]
"#,
        )
        .unwrap();
        std::fs::create_dir(s.0.join("policies.d")).unwrap();
        std::fs::set_permissions(
            s.0.join("policies.d"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::write(
            s.0.join("policies.d/c.toml"),
            "[[credentials]]\nhost = \"c.test\"\nsource = { file = \"/srv/c.key\" }\n",
        )
        .unwrap();
        let mut got = file_sources_in(&cfg).unwrap();
        got.sort();
        assert_eq!(
            got,
            ["/etc/egress-agent/secrets/a", "/srv/b.key", "/srv/c.key"].map(PathBuf::from)
        );
    }
}
