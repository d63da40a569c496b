//! bpffs and the agent's pins (layout of `bpf::loader`): maps under `<pin_dir>/maps/`, program links
//! under `<pin_dir>/roots/<enforcement root cgroup id>/<program>`.

use std::io::ErrorKind;
use std::path::Path;
use std::sync::Arc;


use super::{Ctx, Outcome, blocking};

/// Sub-directory of the pin dir holding pinned maps.
pub const MAPS_DIR: &str = "maps";
/// Sub-directory of the pin dir holding one directory of pinned links per enforcement root.
pub const LINKS_DIR: &str = "roots";

pub(super) async fn bpffs(ctx: Arc<Ctx>) -> Outcome {
    let mi = ctx.opts.paths.mountinfo.clone();
    let Some(res) = blocking(move || crate::mountinfo::mounts(&mi)).await else {
        return Outcome::skip("could not read mountinfo", "re-run");
    };
    let mounts = match res {
        Ok(m) => m,
        Err(e) => {
            return Outcome::skip(
                format!("cannot read mountinfo: {e}"),
                "run on the host with /proc mounted",
            );
        }
    };
    let pin_dir = &ctx.opts.pin_dir;
    let fix = format!(
        "mount -t bpf bpf {} (the agent also mounts it at start; add it to /etc/fstab to keep pins across restarts of the agent)",
        pin_dir.parent().unwrap_or(pin_dir).display()
    );
    match crate::mountinfo::mount_of(&mounts, pin_dir) {
        Some(m) if m.fstype == "bpf" => {
            Outcome::pass(format!("bpffs mounted at {}", m.mount_point.display()))
        }
        _ => {
            let elsewhere: Vec<String> = mounts
                .iter()
                .filter(|m| m.fstype == "bpf")
                .map(|m| m.mount_point.display().to_string())
                .collect();
            if elsewhere.is_empty() {
                Outcome::warn(
                    format!("no bpffs mounted (pin dir {})", pin_dir.display()),
                    fix,
                )
            } else {
                Outcome::warn(
                    format!(
                        "pin dir {} is not on bpffs (bpffs at {})",
                        pin_dir.display(),
                        elsewhere.join(", ")
                    ),
                    fix,
                )
            }
        }
    }
}

/// `(sub-directories, files)` in `dir`, counting the files one level down too (per-root links).
fn count_pins(dir: &Path) -> std::io::Result<(usize, usize)> {
    let (mut dirs, mut files) = (0, 0);
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            dirs += 1;
            files += std::fs::read_dir(e.path())?.count();
        } else {
            files += 1;
        }
    }
    Ok((dirs, files))
}

pub(super) async fn pinned(ctx: Arc<Ctx>) -> Outcome {
    let dir = ctx.opts.pin_dir.clone();
    let Some(res) = blocking(move || {
        let maps = count_pins(&dir.join(MAPS_DIR));
        let links = count_pins(&dir.join(LINKS_DIR));
        (std::fs::metadata(&dir).map(|_| ()), maps, links)
    })
    .await
    else {
        return Outcome::skip("could not read the pin dir", "re-run");
    };
    let dir = ctx.opts.pin_dir.display();
    let start =
        "start the agent (systemctl start egress-agent) and check `journalctl -u egress-agent`";
    match res {
        (Err(e), _, _) if e.kind() == ErrorKind::NotFound => Outcome::fail(
            format!("nothing pinned: {dir} does not exist (programs not loaded)"),
            start,
        ),
        (Err(e), _, _) if e.kind() == ErrorKind::PermissionDenied => Outcome::skip(
            format!("cannot read {dir}: permission denied"),
            "run doctor as root",
        ),
        (Err(e), _, _) => Outcome::skip(format!("cannot read {dir}: {e}"), "run doctor as root"),
        (Ok(()), Err(e), _) | (Ok(()), _, Err(e)) if e.kind() == ErrorKind::PermissionDenied => {
            Outcome::skip(
                format!("cannot list {dir}: permission denied"),
                "run doctor as root",
            )
        }
        (Ok(()), maps, links) => {
            let maps = maps.map(|(_, f)| f).unwrap_or(0);
            let (roots, links) = links.unwrap_or((0, 0));
            if links == 0 {
                Outcome::fail(
                    format!(
                        "{maps} maps but no program links pinned under {dir}/{LINKS_DIR}: nothing is enforced"
                    ),
                    start,
                )
            } else if maps == 0 {
                Outcome::fail(
                    format!("{links} links but no maps pinned under {dir}/{MAPS_DIR}"),
                    start,
                )
            } else {
                Outcome::pass(format!(
                    "{links} program links on {roots} enforcement root(s) and {maps} maps pinned under {dir}"
                ))
            }
        }
    }
}
