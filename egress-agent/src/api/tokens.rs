//! The console's login tokens: `console.tokens` in the state directory (0600 root), one line per
//! operator, `NAME SHA256-HEX`. Only the digest is stored: a token is printed once, when
//! `egress-agent console token NAME` makes it (or `--rotate` replaces it), and is never
//! readable again. The daemon reads the file when it changes, so issuing, rotating and revoking
//! take effect without a reload, and a session made with a token that was rotated or revoked
//! ends at its next request ([`super::session`]).
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ring::rand::SecureRandom;

/// The tokens file's name in the state directory.
pub const FILE: &str = "console.tokens";
/// A token's printed prefix (so a leaked one is recognisable in logs and scanners).
const PREFIX: &str = "egc_";

/// A token's digest.
pub type Digest = [u8; 32];

/// Errors reading or writing the tokens file.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}:{line}: {why} (expected `NAME SHA256-HEX`; remove the line or run `egress-agent console revoke NAME`)"
    )]
    Malformed {
        path: PathBuf,
        line: usize,
        why: &'static str,
    },
    #[error(
        "{0:?}: an operator's name is 1-64 letters, digits, '.', '_', '-' or '@' (it is recorded with every change it makes)"
    )]
    BadName(String),
    #[error("no console token named {0:?}")]
    NoSuchName(String),
    #[error("the system's random source failed")]
    Random,
    #[error(
        "{path} is readable or writable by others (mode {mode:o}): chmod 600 it, or revoke and issue the tokens again"
    )]
    Loose { path: PathBuf, mode: u32 },
}

/// A token's name is what every change it makes is recorded with.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'))
}

/// SHA-256 of a presented token.
pub fn digest(token: &str) -> Digest {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Equal digests, in time that does not depend on where they differ.
pub fn same(a: &Digest, b: &Digest) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `n` random bytes, base64url without padding.
pub fn random_text(n: usize) -> Result<String, TokenError> {
    use base64::Engine;
    let mut buf = vec![0u8; n];
    ring::rand::SystemRandom::new()
        .fill(&mut buf)
        .map_err(|_| TokenError::Random)?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(buf))
}

fn hex(d: &Digest) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Digest> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TokenError + '_ {
    move |source| TokenError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The file's entries (none if it does not exist). A line that does not parse is an error
/// naming it: a file someone edited by hand is never half-read.
pub fn read(path: &Path) -> Result<BTreeMap<String, Digest>, TokenError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mode = std::fs::metadata(path).map_err(io_err(path))?.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(TokenError::Loose {
            path: path.to_owned(),
            mode,
        });
    }
    parse(path, &text)
}

fn parse(path: &Path, text: &str) -> Result<BTreeMap<String, Digest>, TokenError> {
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why| TokenError::Malformed {
            path: path.to_owned(),
            line: i + 1,
            why,
        };
        let mut parts = line.split_whitespace();
        let (Some(name), Some(d), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("not two fields"));
        };
        if !valid_name(name) {
            return Err(bad("not a valid name"));
        }
        let d = unhex(d).ok_or_else(|| bad("not a SHA-256 digest in hex"))?;
        if out.insert(name.to_owned(), d).is_some() {
            return Err(bad("a name given twice"));
        }
    }
    Ok(out)
}

fn write(path: &Path, entries: &BTreeMap<String, Digest>) -> Result<(), TokenError> {
    let mut text = String::from(
        "# egress-agent console tokens: NAME SHA256(token). Managed by `egress-agent console`.\n",
    );
    for (name, d) in entries {
        text.push_str(&format!("{name} {}\n", hex(d)));
    }
    if let Some(dir) = path.parent() {
        // The state directory, as the agent makes it (0700), if this runs first.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(path))?;
    }
    let tmp = path.with_extension("tokens.tmp");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(&tmp))?;
        f.write_all(text.as_bytes()).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// What [`issue`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Issued {
    /// A new token (printed once).
    New(String),
    /// `name` has a token already and `rotate` was not asked: nothing changed.
    Exists,
}

/// Make a token for `name` — or, with `rotate`, replace the one it has (its sessions end).
pub fn issue(path: &Path, name: &str, rotate: bool) -> Result<Issued, TokenError> {
    if !valid_name(name) {
        return Err(TokenError::BadName(name.to_owned()));
    }
    let mut entries = read(path)?;
    if entries.contains_key(name) && !rotate {
        return Ok(Issued::Exists);
    }
    let token = format!("{PREFIX}{}", random_text(32)?);
    entries.insert(name.to_owned(), digest(&token));
    write(path, &entries)?;
    Ok(Issued::New(token))
}

/// Remove `name`'s token (its sessions end).
pub fn revoke(path: &Path, name: &str) -> Result<(), TokenError> {
    let mut entries = read(path)?;
    if entries.remove(name).is_none() {
        return Err(TokenError::NoSuchName(name.to_owned()));
    }
    write(path, &entries)
}

/// The tokens file as the daemon sees it: re-read when its identity (inode, size, mtime)
/// changes. A file that can't be read or parsed admits nobody (logged once per change).
/// A file's identity: inode, size, mtime (s, ns).
type Stamp = (u64, u64, i64, i64);

pub struct Tokens {
    path: PathBuf,
    cache: Mutex<(Option<Stamp>, BTreeMap<String, Digest>)>,
}

impl Tokens {
    pub fn new(path: PathBuf) -> Self {
        Tokens {
            path,
            cache: Mutex::new((None, BTreeMap::new())),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn current(&self) -> BTreeMap<String, Digest> {
        let stamp = std::fs::metadata(&self.path)
            .ok()
            .map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec()));
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.0 != stamp || stamp.is_none() {
            let entries = match read(&self.path) {
                Ok(e) => e,
                Err(e) => {
                    if cache.0 != stamp {
                        tracing::error!(error = %e, "console tokens unreadable: nobody can log in");
                    }
                    BTreeMap::new()
                }
            };
            *cache = (stamp, entries);
        }
        cache.1.clone()
    }

    /// The operator a presented token belongs to, with the digest it matched.
    pub fn verify(&self, token: &str) -> Option<(String, Digest)> {
        let d = digest(token);
        self.current()
            .into_iter()
            .find(|(_, stored)| same(stored, &d))
            .map(|(name, _)| (name, d))
    }

    /// Whether `name` still holds the token with digest `d` (not rotated, not revoked).
    pub fn still(&self, name: &str, d: &Digest) -> bool {
        self.current().get(name).is_some_and(|s| same(s, d))
    }

    /// Whether any operator has a token (the login form says how to make one otherwise).
    pub fn any(&self) -> bool {
        !self.current().is_empty()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("egress-tokens-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_token_is_stored_as_its_digest_only_and_verifies_until_rotated_or_revoked() {
        let path = dir("issue").join(FILE);
        let Issued::New(t1) = issue(&path, "alice", false).unwrap() else {
            panic!("a first token is new")
        };
        assert!(t1.starts_with(PREFIX) && t1.len() > 40, "{t1}");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains(&t1) && !text.contains(&t1[PREFIX.len()..]),
            "{text}"
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(issue(&path, "alice", false).unwrap(), Issued::Exists);
        let tokens = Tokens::new(path.clone());
        let (name, d1) = tokens.verify(&t1).unwrap();
        assert_eq!(name, "alice");
        assert!(tokens.verify("egc_wrong").is_none());
        assert!(tokens.verify("").is_none());
        let Issued::New(t2) = issue(&path, "alice", true).unwrap() else {
            panic!("rotate gives a new token")
        };
        assert_ne!(t1, t2);
        assert!(tokens.verify(&t1).is_none(), "the old token is gone");
        assert!(!tokens.still("alice", &d1), "sessions of the old token end");
        let (_, d2) = tokens.verify(&t2).unwrap();
        assert!(tokens.still("alice", &d2));
        revoke(&path, "alice").unwrap();
        assert!(!tokens.still("alice", &d2));
        assert!(!tokens.any());
        assert!(matches!(
            revoke(&path, "alice"),
            Err(TokenError::NoSuchName(_))
        ));
    }

    #[test]
    fn bad_names_and_hand_edited_lines_are_refused_by_line() {
        let path = dir("bad").join(FILE);
        for n in ["", "a b", "x\ny", "é", &"a".repeat(65)] {
            assert!(
                matches!(issue(&path, n, false), Err(TokenError::BadName(_))),
                "{n:?}"
            );
        }
        for (text, why) in [
            ("alice\n", "not two fields"),
            ("alice 00 extra\n", "not two fields"),
            ("alice zz\n", "not a SHA-256 digest in hex"),
            ("al ice 00\n", "not two fields"),
            (
                "# c\n\nbad/name 0000000000000000000000000000000000000000000000000000000000000000\n",
                "not a valid name",
            ),
        ] {
            match parse(&path, text) {
                Err(TokenError::Malformed { why: w, .. }) => assert_eq!(w, why, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
        let d = hex(&digest("x"));
        assert!(
            parse(&path, &format!("a {d}\na {d}\n")).is_err(),
            "a name twice"
        );
        // A file others can read admits nobody, and says why.
        std::fs::write(&path, format!("a {d}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(read(&path), Err(TokenError::Loose { .. })));
        assert!(Tokens::new(path.clone()).verify("x").is_none());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Tokens::new(path).verify("x").is_some());
    }
}
