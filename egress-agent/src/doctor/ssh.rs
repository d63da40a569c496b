//! SSH probes: password authentication and root login in sshd's effective configuration
//! (`sshd -T -f <config>` for the global values where it runs — it needs root for the host keys —
//! else the files; `Match` blocks always from the files, see [`sshd_config`](super::sshd_config)).

use std::sync::Arc;

use super::sshd_config::{self, SshdConfig};
use super::{Ctx, Outcome, blocking, tool};

/// What the SSH probes know of sshd.
#[derive(Clone, Debug)]
pub(super) enum SshdView {
    /// Neither an `sshd` binary nor its configuration file.
    Absent(String),
    /// sshd is there but neither `sshd -T` nor the file could be read.
    Unreadable(String),
    /// The configuration, from `sshd -T` (global) or the files.
    Found(SshdConfig),
}

async fn load(ctx: &Arc<Ctx>) -> SshdView {
    let root = ctx.opts.sshd_config.clone();
    let files = {
        let root = root.clone();
        blocking(move || sshd_config::read_files(&root)).await
    };
    let Some(files) = files else {
        return SshdView::Unreadable("reading the configuration failed".into());
    };
    let dump = match tool::find(ctx, "sshd") {
        Some(_) => {
            let root = root.display().to_string();
            Some(tool::run(ctx, "sshd", &["-T", "-f", &root]).await)
        }
        None => None,
    };
    match (dump, files) {
        (Some(Ok(text)), files) => {
            let mut cfg = files.unwrap_or_default();
            cfg.global = sshd_config::parse_dump(&text);
            SshdView::Found(cfg)
        }
        (_, Ok(cfg)) => SshdView::Found(cfg),
        (None, Err(e)) if e.kind() == std::io::ErrorKind::NotFound => SshdView::Absent(format!(
            "no sshd on this host (no `sshd` on PATH, no {})",
            root.display()
        )),
        (Some(Err(te)), Err(e)) => SshdView::Unreadable(format!("{te}; {}: {e}", root.display())),
        (None, Err(e)) => SshdView::Unreadable(format!("{}: {e}", root.display())),
    }
}

/// sshd's configuration, read once per run.
pub(super) async fn view(ctx: &Arc<Ctx>) -> SshdView {
    ctx.sshd.get_or_init(|| load(ctx)).await.clone()
}

/// Where a global value came from, for summaries.
fn origin(cfg: &SshdConfig, key: &str) -> String {
    match cfg.get(key) {
        Some(s) => format!("from {}", s.source),
        None => "sshd's default".into(),
    }
}

fn value<'a>(cfg: &'a SshdConfig, key: &str, default: &'a str) -> &'a str {
    cfg.get(key).map(|s| s.value.as_str()).unwrap_or(default)
}

/// `Match` criteria that set `key` to a value `bad` accepts, and whether one of them is `Match all`.
fn bad_matches(cfg: &SshdConfig, key: &str, bad: impl Fn(&str) -> bool) -> (Vec<String>, bool) {
    let hits: Vec<_> = cfg
        .match_values(key)
        .into_iter()
        .filter(|(_, v)| bad(&v.to_ascii_lowercase()))
        .collect();
    let all = hits.iter().any(|(m, _)| m.is_all());
    let list = hits
        .iter()
        .map(|(m, v)| format!("Match {} ({v})", m.criteria))
        .collect();
    (list, all)
}

fn unreadable_note(cfg: &SshdConfig) -> Option<String> {
    cfg.unreadable
        .first()
        .map(|e| format!("could not read {e} (run as root)"))
}

/// Verdict on password logins. Pure, for tests.
pub(super) fn password_auth_verdict(cfg: &SshdConfig, config_path: &str) -> Outcome {
    let fix = format!(
        "set `PasswordAuthentication no` in {config_path} (the first value read wins: check its Include files and Match blocks) and reload sshd"
    );
    let global = value(cfg, "passwordauthentication", "yes").to_ascii_lowercase();
    if global != "no" {
        return Outcome::fail(
            format!(
                "sshd accepts passwords: PasswordAuthentication {global} ({})",
                origin(cfg, "passwordauthentication")
            ),
            fix,
        );
    }
    let (matches, all) = bad_matches(cfg, "passwordauthentication", |v| v != "no");
    if all {
        return Outcome::fail(
            format!("sshd accepts passwords: {}", matches.join(", ")),
            fix,
        );
    }
    if !matches.is_empty() {
        return Outcome::warn(
            format!(
                "PasswordAuthentication no globally, but passwords are accepted for {}",
                matches.join(", ")
            ),
            fix,
        );
    }
    let kbd = cfg
        .get("kbdinteractiveauthentication")
        .or_else(|| cfg.get("challengeresponseauthentication"))
        .map(|s| s.value.to_ascii_lowercase())
        .unwrap_or_else(|| "yes".into());
    let pam = value(cfg, "usepam", "no").to_ascii_lowercase();
    if kbd == "yes" && pam == "yes" {
        return Outcome::warn(
            "PasswordAuthentication no, but KbdInteractiveAuthentication and UsePAM are on: PAM can still ask for a password",
            format!("set `KbdInteractiveAuthentication no` in {config_path} and reload sshd"),
        );
    }
    let summary = format!(
        "password logins off: PasswordAuthentication no ({})",
        origin(cfg, "passwordauthentication")
    );
    match unreadable_note(cfg) {
        Some(note) => Outcome::warn(format!("{summary}; {note}"), "run doctor as root"),
        None => Outcome::pass(summary),
    }
}

/// Verdict on root logins. Pure, for tests.
pub(super) fn root_login_verdict(cfg: &SshdConfig, config_path: &str) -> Outcome {
    let fix = format!(
        "set `PermitRootLogin no` in {config_path} (log in as a user, then sudo) and reload sshd"
    );
    let global = value(cfg, "permitrootlogin", "prohibit-password").to_ascii_lowercase();
    let from = origin(cfg, "permitrootlogin");
    match global.as_str() {
        "no" => {}
        "yes" => {
            return Outcome::fail(
                format!("root can log in with a password: PermitRootLogin yes ({from})"),
                fix,
            );
        }
        other => {
            return Outcome::warn(
                format!("root can log in with a key: PermitRootLogin {other} ({from})"),
                fix,
            );
        }
    }
    let (matches, all) = bad_matches(cfg, "permitrootlogin", |v| v != "no");
    if !matches.is_empty() {
        let summary = format!(
            "PermitRootLogin no globally, but root can log in for {}",
            matches.join(", ")
        );
        return if all {
            Outcome::fail(summary, fix)
        } else {
            Outcome::warn(summary, fix)
        };
    }
    let summary = format!("root logins off: PermitRootLogin no ({from})");
    match unreadable_note(cfg) {
        Some(note) => Outcome::warn(format!("{summary}; {note}"), "run doctor as root"),
        None => Outcome::pass(summary),
    }
}

fn config_or_skip(view: SshdView) -> Result<SshdConfig, Outcome> {
    match view {
        SshdView::Found(cfg) => Ok(cfg),
        SshdView::Absent(why) => Err(Outcome::skip(
            why,
            "nothing to do if this host runs no SSH server",
        )),
        SshdView::Unreadable(why) => Err(Outcome::skip(
            format!("sshd's configuration could not be read: {why}"),
            "run doctor as root",
        )),
    }
}

pub(super) async fn password_auth(ctx: Arc<Ctx>) -> Outcome {
    match config_or_skip(view(&ctx).await) {
        Ok(cfg) => password_auth_verdict(&cfg, &ctx.opts.sshd_config.display().to_string()),
        Err(o) => o,
    }
}

pub(super) async fn root_login(ctx: Arc<Ctx>) -> Outcome {
    match config_or_skip(view(&ctx).await) {
        Ok(cfg) => root_login_verdict(&cfg, &ctx.opts.sshd_config.display().to_string()),
        Err(o) => o,
    }
}
