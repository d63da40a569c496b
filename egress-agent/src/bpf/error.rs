//! Loader errors: each names what failed, keeps the errno, and for verifier rejections the log.
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error(
        "egress-agent must run as root (euid {euid}): loading eBPF programs and managing cgroups needs CAP_SYS_ADMIN/CAP_BPF"
    )]
    NotRoot { euid: u32 },
    #[error(
        "no cgroup2 filesystem mounted (looked in /proc/self/mountinfo); mount one, e.g. `mount -t cgroup2 none /sys/fs/cgroup`"
    )]
    NoCgroup2,
    #[error("kernel BTF not available ({path}: {source}); needs CONFIG_DEBUG_INFO_BTF=y")]
    NoBtf { path: PathBuf, source: io::Error },
    #[error("bpffs: cannot mount a bpf filesystem at {path}: {source} (errno {errno})", errno = source.raw_os_error().unwrap_or(0))]
    BpffsMount { path: PathBuf, source: io::Error },
    #[error("{path} is not on a bpf filesystem (pins there would not work)")]
    NotBpffs { path: PathBuf },
    #[error("the embedded eBPF object is empty: this binary was built with AYA_BUILD_SKIP=1")]
    NoObject,
    #[error(
        "pinned map {path} was created by another egress-agent build ({pinned}; this build needs {built}); run `egress-agent cleanup` to remove the old pins (enforcement stops until the agent starts again), then start the agent"
    )]
    IncompatiblePin {
        path: PathBuf,
        pinned: String,
        built: String,
    },
    #[error("parsing/creating maps of the eBPF object: {0}")]
    Object(#[source] Box<aya::EbpfError>),
    #[error("program {program} missing from the eBPF object")]
    MissingProgram { program: &'static str },
    #[error("the kernel verifier rejected {program} (errno {errno}): {source}\nverifier log:\n{log}", errno = source.raw_os_error().unwrap_or(0))]
    Verifier {
        program: &'static str,
        source: io::Error,
        log: String,
    },
    #[error("the kernel refused to load {program} before verification (errno {errno}: {source}); on this host BPF programs of that type may not be loaded (e.g. a locked-down or sandboxed kernel)", errno = source.raw_os_error().unwrap_or(0))]
    LoadRefused {
        program: &'static str,
        source: io::Error,
    },
    #[error("loading {program}: {source}")]
    Load {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("attaching {program} to {cgroup}: {source}")]
    Attach {
        program: &'static str,
        cgroup: PathBuf,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinning {what} at {path}: {message}")]
    Pin {
        what: String,
        path: PathBuf,
        message: String,
    },
    #[error("adopting pinned link {path}: {source}")]
    Adopt {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error(
        "pinned link {path} runs another build's program and swapping in this build's failed ({source}); the old program keeps enforcing: run `egress-agent cleanup` in a maintenance window and start again"
    )]
    Upgrade {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pinned link {path} runs a program that does not use the pinned maps under {maps}; remove the stale pins (`egress-agent cleanup`) and start again"
    )]
    StaleLink { path: PathBuf, maps: PathBuf },
    #[error("opening pinned map {path}: {source}")]
    OpenMap {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("nothing is pinned at {path}: no egress-agent programs are loaded")]
    NotLoaded { path: PathBuf },
    #[error("map {map}: {op}: {source}")]
    Map {
        map: &'static str,
        op: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error(
        "BPF LSM is not available ({reason}): the AF_PACKET/raw-socket hole stays open for families cgroup/sock_create cannot see; boot with lsm=...,bpf to close it"
    )]
    LsmUnavailable { reason: String },
    #[error("policy: {0}")]
    Policy(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl BpfError {
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(io::Error) -> BpfError {
        let path = path.into();
        move |source| BpfError::Io { what, path, source }
    }

    /// Turn an aya load error into a verifier error with its log when it is one.
    pub(crate) fn from_load(program: &'static str, err: aya::programs::ProgramError) -> BpfError {
        match err {
            aya::programs::ProgramError::LoadError {
                io_error,
                verifier_log,
            } => {
                let log = verifier_log.to_string();
                if log.trim().is_empty() {
                    BpfError::LoadRefused {
                        program,
                        source: io_error,
                    }
                } else {
                    BpfError::Verifier {
                        program,
                        source: io_error,
                        log,
                    }
                }
            }
            other => BpfError::Load {
                program,
                source: other,
            },
        }
    }
}
