//! sshd's effective configuration: `sshd -T` where it runs, else the configuration files read the
//! way sshd reads them. Pure parsing is split from I/O so fixtures can test it.
//!
//! How sshd reads its files (OpenSSH `servconf.c`):
//! - keywords are case-insensitive; a value follows whitespace or `=`; `#` starts a comment;
//! - for most keywords the first value obtained wins (`ListenAddress` accumulates);
//! - `Include` reads files (relative paths are under sshd's directory, `/etc/ssh`; globs sorted) in
//!   place, in the current context, at most 16 levels deep; a `Match` inside an included file ends
//!   with that file;
//! - `Match` starts a conditional block that lasts to the next `Match` or the end of the file; its
//!   settings override the global ones for the connections it matches (`Match all`: all of them).
//!   `sshd -T` without `-C` applies no `Match` block, so those are always read from the files.

use std::path::{Path, PathBuf};

/// sshd's `READCONF_MAX_DEPTH`.
const MAX_INCLUDE_DEPTH: usize = 16;

/// One `keyword value` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Setting {
    /// Lower case.
    pub key: String,
    pub value: String,
    /// The file it came from (`sshd -T` for its output).
    pub source: String,
}

/// A `Match` block: its criteria as written and its settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct MatchBlock {
    pub criteria: String,
    pub settings: Vec<Setting>,
}

impl MatchBlock {
    /// `Match all` applies to every connection.
    pub fn is_all(&self) -> bool {
        self.criteria.eq_ignore_ascii_case("all")
    }
}

/// The settings found, global and per `Match` block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct SshdConfig {
    /// Global settings in the order read.
    pub global: Vec<Setting>,
    pub matches: Vec<MatchBlock>,
    /// Files (or includes) that could not be read, with why.
    pub unreadable: Vec<String>,
}

impl SshdConfig {
    /// The effective global value of `key` (lower case): the first one read.
    pub fn get(&self, key: &str) -> Option<&Setting> {
        self.global.iter().find(|s| s.key == key)
    }

    /// Every global value of `key`, for accumulating keywords (`listenaddress`).
    pub fn all(&self, key: &str) -> Vec<&str> {
        self.global
            .iter()
            .filter(|s| s.key == key)
            .map(|s| s.value.as_str())
            .collect()
    }

    /// `Match` blocks that set `key`, with the value each sets (the first in the block).
    pub fn match_values(&self, key: &str) -> Vec<(&MatchBlock, &str)> {
        self.matches
            .iter()
            .filter_map(|m| {
                let s = m.settings.iter().find(|s| s.key == key)?;
                Some((m, s.value.as_str()))
            })
            .collect()
    }
}

/// Split a line into its lower-case keyword and its value (`None` for blank lines and comments).
fn split_line(line: &str) -> Option<(String, String)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let end = line
        .find(|c: char| c.is_whitespace() || c == '=')
        .unwrap_or(line.len());
    let key = line[..end].to_ascii_lowercase();
    let rest = line[end..].trim_start();
    let rest = rest.strip_prefix('=').unwrap_or(rest).trim();
    // A token starting with '#' ends the line.
    let value = match rest.find(" #").or_else(|| rest.find("\t#")) {
        Some(i) => rest[..i].trim_end(),
        None => rest,
    };
    Some((key, value.trim_matches('"').to_owned()))
}

/// `*` and `?` wildcard match of one path component.
fn wildcard(pattern: &[u8], name: &[u8]) -> bool {
    match (pattern.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            wildcard(&pattern[1..], name) || (!name.is_empty() && wildcard(pattern, &name[1..]))
        }
        (Some(b'?'), Some(_)) => wildcard(&pattern[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => wildcard(&pattern[1..], &name[1..]),
        _ => false,
    }
}

/// The files an `Include` pattern names, sorted (globs in the last component only, as sshd's
/// configurations use them; dot files are not matched by a wildcard).
fn expand(pattern: &Path) -> Vec<PathBuf> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !name.contains(['*', '?']) {
        return vec![pattern.to_owned()];
    }
    let dir = pattern.parent().unwrap_or(Path::new("/"));
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    !n.starts_with('.') && wildcard(name.as_bytes(), n.as_bytes())
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Reads files into an [`SshdConfig`].
struct Reader {
    /// sshd's directory: relative `Include` paths are under it.
    base: PathBuf,
    config: SshdConfig,
}

impl Reader {
    /// Read `file` in context `block` (`None`: global; `Some(i)`: `config.matches[i]`).
    fn read(&mut self, file: &Path, mut block: Option<usize>, depth: usize) {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                self.config
                    .unreadable
                    .push(format!("{}: {e}", file.display()));
                return;
            }
        };
        let source = file.display().to_string();
        for line in text.lines() {
            let Some((key, value)) = split_line(line) else {
                continue;
            };
            match key.as_str() {
                "match" => {
                    self.config.matches.push(MatchBlock {
                        criteria: value,
                        settings: Vec::new(),
                    });
                    block = Some(self.config.matches.len() - 1);
                }
                "include" if depth < MAX_INCLUDE_DEPTH => {
                    for pattern in value.split_whitespace() {
                        let p = Path::new(pattern.trim_matches('"'));
                        let p = if p.is_absolute() {
                            p.to_owned()
                        } else {
                            self.base.join(p)
                        };
                        for f in expand(&p) {
                            // The included file's Match blocks end with it: `block` is ours.
                            self.read(&f, block, depth + 1);
                        }
                    }
                }
                "include" => self.config.unreadable.push(format!(
                    "{source}: Include nested deeper than {MAX_INCLUDE_DEPTH} levels"
                )),
                _ => {
                    let s = Setting {
                        key,
                        value,
                        source: source.clone(),
                    };
                    match block {
                        Some(i) => self.config.matches[i].settings.push(s),
                        None => self.config.global.push(s),
                    }
                }
            }
        }
    }
}

/// Read `root` (e.g. `/etc/ssh/sshd_config`) and what it includes; an error if `root` itself can't
/// be read (included files that can't be read are listed in [`SshdConfig::unreadable`]).
pub(super) fn read_files(root: &Path) -> Result<SshdConfig, std::io::Error> {
    std::fs::File::open(root)?;
    let mut r = Reader {
        base: root.parent().unwrap_or(Path::new("/")).to_owned(),
        config: SshdConfig::default(),
    };
    r.read(root, None, 0);
    Ok(r.config)
}

/// Parse `sshd -T` output (`keyword value` lines, already lower case) as global settings.
pub(super) fn parse_dump(text: &str) -> Vec<Setting> {
    text.lines()
        .filter_map(split_line)
        .map(|(key, value)| Setting {
            key,
            value,
            source: "sshd -T".into(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_wildcards() {
        assert_eq!(
            split_line("  PasswordAuthentication=no # cloud"),
            Some(("passwordauthentication".into(), "no".into()))
        );
        assert_eq!(
            split_line("PermitRootLogin\tprohibit-password"),
            Some(("permitrootlogin".into(), "prohibit-password".into()))
        );
        assert_eq!(split_line("# PasswordAuthentication yes"), None);
        assert_eq!(split_line("   "), None);
        assert!(wildcard(b"*.conf", b"50-cloud-init.conf"));
        assert!(!wildcard(b"*.conf", b"50-cloud-init.conf.bak"));
        assert!(wildcard(b"a?c", b"abc"));
    }
}
