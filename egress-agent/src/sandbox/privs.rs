//! Who the command runs as, and the privileges it keeps.
//!
//! Default user: the one who invoked `exec` — `SUDO_UID`/`SUDO_GID` when started through sudo,
//! else the real uid (root when root ran it). `--user NAME|UID[:GROUP|GID]` chooses.
//!
//! A root command keeps only [`ROOT_KEEPS`] (Docker's default set without `CAP_NET_RAW` and
//! `CAP_MKNOD`), in every capability set including the bounding set, so neither it nor anything
//! it executes gets `CAP_SYS_ADMIN`, `CAP_BPF`, `CAP_NET_ADMIN`, `CAP_SYS_PTRACE`,
//! `CAP_SYS_MODULE`, `CAP_DAC_READ_SEARCH` and the rest back. A non-root command keeps nothing.
//! `no_new_privs` makes setuid and file-capability binaries (`sudo`, `ping`) run without gaining
//! anything.
use std::ffi::CString;
use std::path::PathBuf;

use caps::{CapSet, Capability, CapsHashSet};
use nix::unistd::{Gid, Group, Uid, User};
use serde::{Deserialize, Serialize};

use super::SandboxError;

/// Capabilities a root command keeps (and `CAP_NET_RAW` for `allow_all`).
pub const ROOT_KEEPS: [Capability; 12] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FOWNER,
    Capability::CAP_FSETID,
    Capability::CAP_KILL,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETPCAP,
    Capability::CAP_SETFCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_AUDIT_WRITE,
];

/// The user and groups a command runs as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
    pub name: String,
    pub home: PathBuf,
    /// Not the user `exec` itself runs as (HOME, USER and LOGNAME are then set for it).
    pub switch: bool,
}

impl Identity {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
    pub fn switched(&self) -> bool {
        self.switch
    }

    /// The identity for `--user` (`spec`), or the invoking user when `None` (see module docs).
    pub fn resolve(spec: Option<&str>) -> Result<Identity, SandboxError> {
        let invalid = |m: String| SandboxError::Invalid(m);
        let (user, group) = match spec {
            Some(s) => {
                let (u, g) = match s.split_once(':') {
                    Some((u, g)) => (u, Some(g)),
                    None => (s, None),
                };
                let user = match u.parse::<u32>() {
                    Ok(uid) => User::from_uid(Uid::from_raw(uid)),
                    Err(_) => User::from_name(u),
                }
                .map_err(|e| invalid(format!("exec --user {s:?}: {e}")))?
                .ok_or_else(|| invalid(format!("exec --user {s:?}: no such user")))?;
                let group = g
                    .map(|g| {
                        match g.parse::<u32>() {
                            Ok(gid) => Group::from_gid(Gid::from_raw(gid)),
                            Err(_) => Group::from_name(g),
                        }
                        .map_err(|e| invalid(format!("exec --user {s:?}: {e}")))?
                        .ok_or_else(|| invalid(format!("exec --user {s:?}: no such group {g:?}")))
                    })
                    .transpose()?;
                (user, group.map(|g| g.gid))
            }
            None => {
                let sudo = |var: &str| std::env::var(var).ok().and_then(|v| v.parse::<u32>().ok());
                let uid = sudo("SUDO_UID").unwrap_or_else(|| nix::unistd::getuid().as_raw());
                let user = User::from_uid(Uid::from_raw(uid))
                    .map_err(|e| invalid(format!("looking up uid {uid}: {e}")))?
                    .ok_or_else(|| {
                        invalid(format!(
                            "the invoking user (uid {uid}) has no passwd entry; choose one with --user"
                        ))
                    })?;
                let gid = sudo("SUDO_GID").filter(|_| sudo("SUDO_UID").is_some());
                (user, gid.map(Gid::from_raw))
            }
        };
        let gid = group.unwrap_or(user.gid);
        let cname = CString::new(user.name.as_bytes())
            .map_err(|_| invalid(format!("user name {:?} contains NUL", user.name)))?;
        let groups = nix::unistd::getgrouplist(&cname, gid)
            .map_err(|e| invalid(format!("groups of {}: {e}", user.name)))?
            .into_iter()
            .map(Gid::as_raw)
            .collect();
        Ok(Identity {
            uid: user.uid.as_raw(),
            gid: gid.as_raw(),
            groups,
            switch: user.uid != nix::unistd::getuid(),
            name: user.name,
            home: user.dir,
        })
    }
}

fn caps_err(what: &'static str) -> impl FnOnce(caps::errors::CapsError) -> SandboxError {
    move |e| SandboxError::Sys {
        what,
        source: std::io::Error::other(e.to_string()),
    }
}

/// Become `who` with only the capabilities it may keep, then `no_new_privs`.
pub fn drop_to(who: &Identity, keep_net_raw: bool) -> Result<(), SandboxError> {
    let mut keep: CapsHashSet = if who.is_root() {
        ROOT_KEEPS.into_iter().collect()
    } else {
        CapsHashSet::new()
    };
    if keep_net_raw && who.is_root() {
        keep.insert(Capability::CAP_NET_RAW);
    }
    // The bounding set first (needs CAP_SETPCAP, which the uid change below may take away).
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap).map_err(caps_err("dropping the bounding set"))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(caps_err("clearing ambient capabilities"))?;
    let groups: Vec<Gid> = who.groups.iter().copied().map(Gid::from_raw).collect();
    nix::unistd::setgroups(&groups).map_err(SandboxError::sys("setgroups"))?;
    let gid = Gid::from_raw(who.gid);
    nix::unistd::setresgid(gid, gid, gid).map_err(SandboxError::sys("setresgid"))?;
    let uid = Uid::from_raw(who.uid);
    nix::unistd::setresuid(uid, uid, uid).map_err(SandboxError::sys("setresuid"))?;
    // A uid change to non-root cleared permitted and effective; root keeps exactly `keep`.
    // Effective first: it must stay a subset of permitted at every step.
    for set in [CapSet::Effective, CapSet::Inheritable, CapSet::Permitted] {
        let now = caps::read(None, set).map_err(caps_err("reading capabilities"))?;
        let want: CapsHashSet = now.intersection(&keep).copied().collect();
        caps::set(None, set, &want).map_err(caps_err("setting capabilities"))?;
    }
    nix::sys::prctl::set_no_new_privs().map_err(SandboxError::sys("no_new_privs"))?;
    Ok(())
}

/// Give up every capability and gain none again (the sandbox's init, once the command runs).
pub fn drop_all() -> Result<(), SandboxError> {
    for cap in caps::all() {
        caps::drop(None, CapSet::Bounding, cap).map_err(caps_err("dropping the bounding set"))?;
    }
    for set in [
        CapSet::Ambient,
        CapSet::Inheritable,
        CapSet::Effective,
        CapSet::Permitted,
    ] {
        caps::clear(None, set).map_err(caps_err("clearing capabilities"))?;
    }
    nix::sys::prctl::set_no_new_privs().map_err(SandboxError::sys("no_new_privs"))
}
