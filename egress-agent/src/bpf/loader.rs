//! Load, pin and adopt the kernel programs.
//!
//! Pin layout under the configured bpffs directory (default `/sys/fs/bpf/egress-agent`):
//! - `maps/<MAP>`: every map of the object (reused by every later load, see aya's
//!   `default_map_pin_directory`), so any process can read and write policy state;
//! - `roots/<cgroup id>/<program>`: one link per program per enforcement root.
//!
//! [`Loader::ensure_root`] never attaches a program twice to a root: links stack (a second copy
//! would run twice), so an existing pinned link is adopted and only missing ones are attached.
//! An adopted link that runs another build's program (its tag differs from this binary's) is
//! switched to this build's program with `BPF_LINK_UPDATE`: an atomic swap, so an upgraded agent
//! enforces its own programs after a restart with no moment unenforced.
//! Loaders are serialised by an exclusive `flock` on [`LOCK_PATH`] (exec vs daemon).
use std::fs::{self, File};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::Btf;
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{
    CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSock, CgroupSockAddr, LsmCgroup,
    SockOps,
};
use aya::{Ebpf, EbpfLoader};
use egress_common::programs as prog;
use nix::fcntl::{Flock, FlockArg};

use super::BpfError;
use crate::cgroup;

/// The eBPF object built by build.rs (aya-build), embedded in the binary.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/egress"));

/// Serialises loaders on this host (regular file: bpffs cannot hold one).
pub const LOCK_PATH: &str = "/run/egress-agent/loader.lock";

/// Create (with its directory) and `flock` the lock file at `path`. `Ok(None)`: a non-blocking
/// `arg` found it held by another process.
pub(crate) fn lock_file(path: &Path, arg: FlockArg) -> Result<Option<Flock<File>>, BpfError> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(BpfError::io("creating", dir))?;
    }
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(BpfError::io("opening", path))?;
    match Flock::lock(file, arg) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(BpfError::Io {
            what: "locking",
            path: path.into(),
            source: e.into(),
        }),
    }
}

/// Where the loader keeps its own state (the lock, [`Verified`] records).
const RUN_DIR: &str = "/run/egress-agent";

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// What happened to each program of a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootReport {
    pub root: PathBuf,
    pub root_id: u64,
    /// Programs whose pinned link was adopted as it was (same program as this build's).
    pub adopted: Vec<&'static str>,
    /// Programs whose pinned link was adopted but ran another build's program: the link now runs
    /// this build's.
    pub upgraded: Vec<&'static str>,
    /// Adopted links whose program could not be swapped for this build's (why, per link): they
    /// keep enforcing with the program they had.
    pub upgrade_failed: Vec<String>,
    /// Programs attached (and pinned) by this call.
    pub attached: Vec<&'static str>,
    /// `None` when the BPF-LSM socket_create hook is enforcing; otherwise the reason it is not
    /// (the AF_PACKET hole is then open).
    pub lsm_unavailable: Option<String>,
}

/// What a build checked on one root: these links (link id, program id) ran this build's
/// programs, bound to this POLICIES map. Kept in /run (gone on reboot, like the pins). A later
/// start of the same build that finds exactly these ids adopts without loading the programs to
/// compare; anything different (another build, a replaced link or map) gets the full check.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Verified {
    pins: PathBuf,
    object: String,
    policies_map: u32,
    links: std::collections::BTreeMap<String, (u32, u32)>,
}

impl Verified {
    fn path(root_id: u64) -> PathBuf {
        Path::new(RUN_DIR).join(format!("verified-{root_id}.json"))
    }

    fn read(root_id: u64) -> Option<Verified> {
        serde_json::from_slice(&fs::read(Verified::path(root_id)).ok()?).ok()
    }

    /// Best effort: without the record the next start just checks again.
    fn write(&self, root_id: u64) {
        let path = Verified::path(root_id);
        let tmp = path.with_extension("tmp");
        let done = serde_json::to_vec(self)
            .map_err(std::io::Error::other)
            .and_then(|json| fs::write(&tmp, json))
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = done {
            tracing::debug!(path = %path.display(), error = %e, "verified-programs record not written");
        }
    }
}

/// Remove every [`Verified`] record (with the pins gone they describe nothing). Returns how many.
pub fn forget_verified() -> usize {
    fs::read_dir(RUN_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("verified-") && name.ends_with(".json")
        })
        .filter(|e| fs::remove_file(e.path()).is_ok())
        .count()
}

/// This build's eBPF object, as a short id (SipHash with fixed keys: same bytes, same id).
fn object_id() -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    OBJECT.hash(&mut h);
    format!("{:016x}-{}", h.finish(), OBJECT.len())
}

/// What adopting one pinned link did.
enum Adoption {
    /// It already ran this build's program against the pinned maps.
    Kept,
    /// It now runs this build's program (swapped in place).
    Switched,
    /// Swapping failed (why); the old program, which uses the pinned maps, keeps enforcing.
    SwitchFailed(String),
}

/// Holds the loader lock; created by [`Loader::lock`].
pub struct Loader {
    bpffs: PathBuf,
    _lock: Flock<File>,
    ebpf: Option<Ebpf>,
}

/// Program kinds, for attaching.
enum Kind {
    SockAddr,
    Skb(CgroupSkbAttachType),
    Sock,
    SockOps,
    Lsm,
}

fn kind(name: &str) -> Kind {
    match name {
        prog::SKB_EGRESS => Kind::Skb(CgroupSkbAttachType::Egress),
        prog::SKB_INGRESS => Kind::Skb(CgroupSkbAttachType::Ingress),
        prog::SOCK_CREATE => Kind::Sock,
        prog::SOCK_OPS => Kind::SockOps,
        prog::LSM_SOCKET_CREATE => Kind::Lsm,
        _ => Kind::SockAddr,
    }
}

/// Fail early and clearly when not root.
pub fn require_root() -> Result<(), BpfError> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 {
        Err(BpfError::NotRoot { euid })
    } else {
        Ok(())
    }
}

/// Is `path` on a bpf filesystem?
fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type() == nix::sys::statfs::FsType(BPF_FS_MAGIC as _))
        .unwrap_or(false)
}

/// Make sure `dir` (e.g. `/sys/fs/bpf/egress-agent`) is on bpffs: mount bpffs on its nearest
/// existing parent below `/sys/fs` if needed (the usual `/sys/fs/bpf`), then create `dir`.
pub fn ensure_bpffs(dir: &Path) -> Result<(), BpfError> {
    if dir.exists() {
        return if is_bpffs(dir) {
            Ok(())
        } else {
            Err(BpfError::NotBpffs {
                path: dir.to_owned(),
            })
        };
    }
    let parent = dir.parent().ok_or_else(|| BpfError::NotBpffs {
        path: dir.to_owned(),
    })?;
    if !is_bpffs(parent) {
        fs::create_dir_all(parent).map_err(BpfError::io("creating", parent))?;
        nix::mount::mount(
            Some("bpf"),
            parent,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|e| BpfError::BpffsMount {
            path: parent.to_owned(),
            source: e.into(),
        })?;
        if !is_bpffs(parent) {
            return Err(BpfError::NotBpffs {
                path: parent.to_owned(),
            });
        }
    }
    fs::create_dir_all(dir).map_err(BpfError::io("creating", dir))
}

pub fn maps_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("maps")
}

pub fn roots_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("roots")
}

pub fn root_pin_dir(bpffs: &Path, root_id: u64) -> PathBuf {
    roots_dir(bpffs).join(root_id.to_string())
}

/// Can the BPF-LSM hook work here? Needs kernel BTF (the hook is found by BTF id) and the "bpf"
/// LSM active (`/sys/kernel/security/lsm` when securityfs is mounted; else let the load tell).
/// The cgroup programs need neither.
fn lsm_active() -> Result<(), String> {
    if let Err(e) = fs::metadata("/sys/kernel/btf/vmlinux") {
        return Err(format!(
            "no kernel BTF at /sys/kernel/btf/vmlinux ({e}); needs CONFIG_DEBUG_INFO_BTF=y"
        ));
    }
    match fs::read_to_string("/sys/kernel/security/lsm") {
        Ok(list) if list.trim().split(',').any(|l| l == "bpf") => Ok(()),
        Ok(list) => Err(format!(
            "\"bpf\" is not in the active LSM list ({})",
            list.trim()
        )),
        Err(_) => Ok(()),
    }
}

impl Loader {
    /// Check root, mount bpffs if needed, and take the loader lock (blocking).
    pub fn lock(bpffs: &Path) -> Result<Loader, BpfError> {
        require_root()?;
        ensure_bpffs(bpffs)?;
        // A blocking lock waits instead of reporting "held elsewhere".
        let lock = lock_file(Path::new(LOCK_PATH), FlockArg::LockExclusive)?.ok_or_else(|| {
            BpfError::Io {
                what: "locking",
                path: LOCK_PATH.into(),
                source: std::io::ErrorKind::WouldBlock.into(),
            }
        })?;
        Ok(Loader {
            bpffs: bpffs.to_owned(),
            _lock: lock,
            ebpf: None,
        })
    }

    pub fn bpffs(&self) -> &Path {
        &self.bpffs
    }

    /// Load the object (maps reuse/create pins under `maps/`), once per Loader.
    fn ebpf(&mut self) -> Result<&mut Ebpf, BpfError> {
        if self.ebpf.is_none() {
            if OBJECT.is_empty() {
                return Err(BpfError::NoObject);
            }
            let maps = maps_dir(&self.bpffs);
            fs::create_dir_all(&maps).map_err(BpfError::io("creating", &maps))?;
            check_pins(&maps)?;
            let ebpf = EbpfLoader::new()
                .default_map_pin_directory(&maps)
                .load(OBJECT)
                .map_err(|e| BpfError::Object(Box::new(e)))?;
            self.ebpf = Some(ebpf);
        }
        self.ebpf.as_mut().ok_or(BpfError::NoObject)
    }

    /// Make sure every program is attached exactly once to `root` (a cgroup2 directory),
    /// adopting pinned links. `require_lsm`: fail instead of warning when BPF-LSM is missing.
    pub fn ensure_root(&mut self, root: &Path, require_lsm: bool) -> Result<RootReport, BpfError> {
        let root_id = cgroup::cgroup_id(root).map_err(BpfError::io("reading cgroup", root))?;
        let pin_dir = root_pin_dir(&self.bpffs, root_id);
        fs::create_dir_all(&pin_dir).map_err(BpfError::io("creating", &pin_dir))?;
        let mut report = RootReport {
            root: root.to_owned(),
            root_id,
            adopted: Vec::new(),
            upgraded: Vec::new(),
            upgrade_failed: Vec::new(),
            attached: Vec::new(),
            lsm_unavailable: None,
        };

        let mut wanted: Vec<&'static str> = prog::CGROUP.to_vec();
        match lsm_active() {
            Ok(()) => wanted.push(prog::LSM_SOCKET_CREATE),
            Err(reason) => {
                if require_lsm {
                    return Err(BpfError::LsmUnavailable { reason });
                }
                report.lsm_unavailable = Some(reason);
            }
        }

        // Same build, same links, same maps as this build last verified: adopt without loading
        // anything (a start then costs no program loads; `exec` stays fast).
        let pinned = |names: &[&'static str]| -> Vec<&'static str> {
            names
                .iter()
                .copied()
                .filter(|n| pin_dir.join(n).exists())
                .collect()
        };
        let verified = Verified::read(root_id);
        let now = self.current(&pin_dir, &pinned(&wanted));
        let trusted = now.is_some() && now == verified;
        if trusted {
            tracing::debug!(
                root_id,
                "pinned links verified by this build before: adopted without loading"
            );
        }

        for &name in &wanted {
            let pin = pin_dir.join(name);
            if pin.exists() && trusted {
                report.adopted.push(name);
                continue;
            }
            if pin.exists() {
                match self.adopt(name, &pin)? {
                    Adoption::Kept => report.adopted.push(name),
                    Adoption::Switched => {
                        tracing::info!(program = name, pin = %pin.display(),
                            "pinned link switched to this build's program");
                        report.upgraded.push(name);
                    }
                    Adoption::SwitchFailed(why) => {
                        tracing::warn!(program = name, "{why}");
                        report.upgrade_failed.push(why);
                        report.adopted.push(name);
                    }
                }
                continue;
            }
            match self.attach(name, root, &pin) {
                Ok(()) => report.attached.push(name),
                Err(err) if name == prog::LSM_SOCKET_CREATE && !require_lsm => {
                    report.lsm_unavailable = Some(err.to_string());
                }
                Err(err) => return Err(err),
            }
        }
        let changed = !trusted || !report.attached.is_empty();
        if changed && report.upgrade_failed.is_empty() {
            match self.current(&pin_dir, &pinned(&wanted)) {
                Some(v) => v.write(root_id),
                None => tracing::debug!(root_id, "links changed while checking; not recorded"),
            }
        }
        Ok(report)
    }

    /// The links pinned in `pin_dir` for `names` and the pinned POLICIES map, as a [`Verified`]
    /// record of this build. `None` if any is unreadable.
    fn current(&self, pin_dir: &Path, names: &[&str]) -> Option<Verified> {
        let policies = maps_dir(&self.bpffs).join(egress_common::maps::POLICIES);
        let map_id = aya::maps::MapData::from_pin(&policies)
            .and_then(|m| m.info())
            .ok()?
            .id();
        let mut links = std::collections::BTreeMap::new();
        for name in names {
            let link: FdLink = PinnedLink::from_pin(pin_dir.join(name)).ok()?.into();
            let info = link.info().ok()?;
            links.insert((*name).to_owned(), (info.id(), info.program_id()));
        }
        Some(Verified {
            pins: pin_dir.to_owned(),
            object: object_id(),
            policies_map: map_id,
            links,
        })
    }

    /// Adopt the pinned link at `pin`. It keeps its program if that is this build's `name`
    /// program (same tag) using the pinned POLICIES map; otherwise — another build's program, or
    /// one bound to maps that are no longer pinned (it would enforce against maps nobody can
    /// write) — the link is switched to this build's program in one atomic `BPF_LINK_UPDATE`.
    fn adopt(&mut self, name: &'static str, pin: &Path) -> Result<Adoption, BpfError> {
        let link = PinnedLink::from_pin(pin).map_err(|source| BpfError::Adopt {
            path: pin.to_owned(),
            source,
        })?;
        // Dropping an FdLink that came from a pin only closes our fd; the pin keeps it attached.
        let fd_link: FdLink = link.into();
        let info = fd_link.info().map_err(|source| BpfError::Adopt {
            path: pin.to_owned(),
            source,
        })?;
        let pinned_maps = pinned_map_ids(&maps_dir(&self.bpffs))?;
        let prog_id = info.program_id();
        let pinned = aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == prog_id);
        // Every map the program uses is one of the pinned maps (not every program uses POLICIES:
        // sock_ops only touches the original-destination maps).
        let uses_pinned_maps = pinned
            .as_ref()
            .and_then(|p| p.map_ids().ok().flatten())
            .is_some_and(|ids| !ids.is_empty() && ids.iter().all(|id| pinned_maps.contains(id)));
        let maps = maps_dir(&self.bpffs);
        let ours = self.load(name)?;
        let ours_tag = ours
            .info()
            .map_err(|e| BpfError::Load {
                program: name,
                source: e,
            })?
            .tag();
        if uses_pinned_maps && pinned.is_some_and(|p| p.tag() == ours_tag) {
            return Ok(Adoption::Kept);
        }
        let swap = || -> std::io::Result<()> {
            let fd = ours
                .fd()
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            super::sys::link_update(super::sys::obj_get(pin)?, fd.as_fd())
        };
        match swap() {
            Ok(()) => Ok(Adoption::Switched),
            // The old program still works against the pinned maps: it keeps enforcing.
            Err(source) if uses_pinned_maps => Ok(Adoption::SwitchFailed(
                BpfError::Upgrade {
                    path: pin.to_owned(),
                    source,
                }
                .to_string(),
            )),
            Err(_) => Err(BpfError::StaleLink {
                path: pin.to_owned(),
                maps,
            }),
        }
    }

    /// This build's `name` program, loaded into the kernel (once per Loader).
    fn load(&mut self, name: &'static str) -> Result<&mut aya::programs::Program, BpfError> {
        let loaded = self
            .ebpf()?
            .program(name)
            .ok_or(BpfError::MissingProgram { program: name })?
            .fd()
            .is_ok();
        // Parsing the kernel's BTF is only needed to load the LSM program, once.
        let btf = match kind(name) {
            Kind::Lsm if !loaded => Some(Btf::from_sys_fs().map_err(|e| BpfError::NoBtf {
                path: "/sys/kernel/btf/vmlinux".into(),
                source: std::io::Error::other(e.to_string()),
            })?),
            _ => None,
        };
        let program = self
            .ebpf()?
            .program_mut(name)
            .ok_or(BpfError::MissingProgram { program: name })?;
        if loaded {
            return Ok(program);
        }
        let load_err = |e| BpfError::Load {
            program: name,
            source: e,
        };
        match kind(name) {
            Kind::SockAddr => {
                let p: &mut CgroupSockAddr = program.try_into().map_err(load_err)?;
                p.load().map_err(|e| BpfError::from_load(name, e))?;
            }
            Kind::Skb(_) => {
                let p: &mut CgroupSkb = program.try_into().map_err(load_err)?;
                p.load().map_err(|e| BpfError::from_load(name, e))?;
            }
            Kind::Sock => {
                let p: &mut CgroupSock = program.try_into().map_err(load_err)?;
                p.load().map_err(|e| BpfError::from_load(name, e))?;
            }
            Kind::SockOps => {
                let p: &mut SockOps = program.try_into().map_err(load_err)?;
                p.load().map_err(|e| BpfError::from_load(name, e))?;
            }
            Kind::Lsm => {
                let btf = btf.ok_or(BpfError::MissingProgram { program: name })?;
                let p: &mut LsmCgroup = program.try_into().map_err(load_err)?;
                p.load("socket_create", &btf)
                    .map_err(|e| BpfError::from_load(name, e))?;
            }
        }
        Ok(program)
    }

    fn attach(&mut self, name: &'static str, root: &Path, pin: &Path) -> Result<(), BpfError> {
        let cgroup_dir = File::open(root).map_err(BpfError::io("opening cgroup", root))?;
        let attach_err = |source| BpfError::Attach {
            program: name,
            cgroup: root.to_owned(),
            source,
        };
        let load_err = |e| BpfError::Load {
            program: name,
            source: e,
        };
        let program = self.load(name)?;
        let link: FdLink = match kind(name) {
            Kind::SockAddr => {
                let p: &mut CgroupSockAddr = program.try_into().map_err(load_err)?;
                let id = p
                    .attach(cgroup_dir.as_fd(), CgroupAttachMode::Single)
                    .map_err(attach_err)?;
                let link = p.take_link(id).map_err(attach_err)?;
                FdLink::try_from(link).map_err(|e| pin_err(name, pin, e))?
            }
            Kind::Skb(direction) => {
                let p: &mut CgroupSkb = program.try_into().map_err(load_err)?;
                let id = p
                    .attach(cgroup_dir.as_fd(), direction, CgroupAttachMode::Single)
                    .map_err(attach_err)?;
                let link = p.take_link(id).map_err(attach_err)?;
                FdLink::try_from(link).map_err(|e| pin_err(name, pin, e))?
            }
            Kind::Sock => {
                let p: &mut CgroupSock = program.try_into().map_err(load_err)?;
                let id = p
                    .attach(cgroup_dir.as_fd(), CgroupAttachMode::Single)
                    .map_err(attach_err)?;
                let link = p.take_link(id).map_err(attach_err)?;
                FdLink::try_from(link).map_err(|e| pin_err(name, pin, e))?
            }
            Kind::SockOps => {
                let p: &mut SockOps = program.try_into().map_err(load_err)?;
                let id = p
                    .attach(cgroup_dir.as_fd(), CgroupAttachMode::Single)
                    .map_err(attach_err)?;
                let link = p.take_link(id).map_err(attach_err)?;
                FdLink::try_from(link).map_err(|e| pin_err(name, pin, e))?
            }
            Kind::Lsm => {
                let p: &mut LsmCgroup = program.try_into().map_err(load_err)?;
                let id = p.attach(cgroup_dir.as_fd()).map_err(attach_err)?;
                let link = p.take_link(id).map_err(attach_err)?;
                FdLink::from(link)
            }
        };
        // If pinning fails the FdLink is dropped here, which detaches: nothing half-attached.
        link.pin(pin).map_err(|e| pin_err(name, pin, e))?;
        Ok(())
    }
}

/// The ids of the maps pinned in `dir` (the agent's maps directory).
fn pinned_map_ids(dir: &Path) -> Result<std::collections::BTreeSet<u32>, BpfError> {
    let mut ids = std::collections::BTreeSet::new();
    let entries =
        std::fs::read_dir(dir).map_err(BpfError::io("reading the maps directory", dir))?;
    for entry in entries {
        let path = entry
            .map_err(BpfError::io("reading the maps directory", dir))?
            .path();
        let id = aya::maps::MapData::from_pin(&path)
            .and_then(|m| m.info())
            .map(|i| i.id())
            .map_err(|source| BpfError::OpenMap {
                path: path.clone(),
                source,
            })?;
        ids.insert(id);
    }
    Ok(ids)
}

/// The shape of a map: (type, key size, value size, max entries).
type Shape = (u32, u32, u32, u32);

fn shape_text((t, k, v, n): Shape) -> String {
    format!("type {t}, key {k} B, value {v} B, {n} entries")
}

/// Every pinned map under `dir` has the shape this build's object defines. aya reuses a pin
/// without comparing, so an older build's map (e.g. a smaller `PolicyEntry`) would otherwise
/// fail later with a verifier error that does not say why — or, worse, load.
fn check_pins(dir: &Path) -> Result<(), BpfError> {
    let object = aya_obj::Object::parse(OBJECT).map_err(|e| BpfError::Pin {
        what: "the embedded eBPF object".into(),
        path: dir.to_owned(),
        message: format!("cannot parse it to check pinned maps: {e}"),
    })?;
    for (name, def) in &object.maps {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let built: Shape = (
            def.map_type(),
            def.key_size(),
            def.value_size(),
            def.max_entries(),
        );
        let data = aya::maps::MapData::from_pin(&path).map_err(|source| BpfError::OpenMap {
            path: path.clone(),
            source,
        })?;
        let info = data.info().map_err(|source| BpfError::OpenMap {
            path: path.clone(),
            source,
        })?;
        let pinned: Shape = (
            raw_map_type(&info),
            info.key_size(),
            info.value_size(),
            info.max_entries(),
        );
        if pinned != built {
            return Err(BpfError::IncompatiblePin {
                path,
                pinned: shape_text(pinned),
                built: shape_text(built),
            });
        }
    }
    Ok(())
}

/// The kernel's map type number (`u32::MAX` for a type aya does not know).
fn raw_map_type(info: &aya::maps::MapInfo) -> u32 {
    info.map_type().map_or(u32::MAX, |t| t as u32)
}

fn pin_err(name: &str, pin: &Path, e: impl std::fmt::Display) -> BpfError {
    BpfError::Pin {
        what: format!("link of {name}"),
        path: pin.to_owned(),
        message: e.to_string(),
    }
}

/// Roots with pinned links: `(root cgroup id, pinned program names)`.
pub fn pinned_roots(bpffs: &Path) -> Vec<(u64, Vec<String>)> {
    let mut out = Vec::new();
    let Ok(dir) = fs::read_dir(roots_dir(bpffs)) else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(id) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let mut progs: Vec<String> = fs::read_dir(entry.path())
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        progs.sort();
        out.push((id, progs));
    }
    out.sort();
    out
}
