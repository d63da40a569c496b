//! The agent's TOML configuration: its sections, and the policies (whose model and checks live
//! in `egress-policy`) as the file names them.
//!
//! Default path: [`DEFAULT_CONFIG_PATH`]. Every struct refuses unknown fields; every field has a
//! documented default (see `config/example.toml`). Loading is parse → [`Config::validate`]; any
//! error names the file, the line and column, and the field, and nothing is half-applied.
//!
//! ```toml
//! [agent]
//! default_policy = "ci"          # default "deny_all"
//! [proxy]
//! endpoint = "127.0.0.1:3128"    # the stable address confined processes use
//! [policies.ci]
//! mode = "allowlist"             # allow_all | deny_all | allowlist (default allowlist)
//! allow_hosts = ["github.com", "*.github.com"]
//! allow_ports = [443]            # default [443]
//! allow_cidrs = ["192.0.2.10/32", { cidr = "10.0.0.5/32", ports = [5432] }]
//! deny_cidrs = ["203.0.113.0/24"]
//! ```
pub mod kubelet;
mod locate;
pub mod policies_dir;
mod validate;
pub mod watch;
pub mod webhook;

pub(crate) use locate::{Sources, parse_located};
use locate::{line_col, span_of_path};

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use egress_policy::{ALLOW_ALL, AUDIT, DENY_ALL, Policy, ValidationError};

/// Where `egress-agent` looks for its configuration unless told otherwise.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/egress-agent/config.toml";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub agent: AgentConfig,
    #[serde(default)]
    pub proxy: ProxyConfig,
    #[serde(default)]
    pub dns: DnsConfig,
    /// The durable event store (`<agent.state_dir>/events.db`).
    #[serde(default)]
    pub store: StoreConfig,
    /// Event export (syslog, OTLP). Default: none.
    #[serde(default)]
    pub export: crate::export::ExportConfig,
    /// TLS interception (for hosts with credential bindings or request rules).
    #[serde(default)]
    pub intercept: InterceptConfig,
    /// The control API's access and the status page (`[api]`).
    #[serde(default)]
    pub api: ApiConfig,
    /// Workloads' access requests (`[requests]`).
    #[serde(default)]
    pub requests: RequestsConfig,
    /// Kubernetes pods through containerd (`[kubernetes]`): present = the containerd runtime runs.
    #[serde(default)]
    pub kubernetes: Option<KubernetesConfig>,
    /// Named policies. `allow_all` and `deny_all` are built in.
    #[serde(default)]
    pub policies: BTreeMap<String, Policy>,
}

/// `[kubernetes]`: pods on this node, learnt from containerd (see docs/operations.md,
/// "Kubernetes"). A pod's policy comes from its `egress.*` annotations, else its namespace's
/// entry in `namespace_defaults`, else `agent.unlabeled`. Changes take effect on a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// containerd's socket. Default `/run/containerd/containerd.sock`.
    pub containerd_socket: PathBuf,
    /// The containerd namespace the CRI plugin uses. Default `k8s.io`.
    pub containerd_namespace: String,
    /// containerd's configuration file, read by `doctor` (pod annotations must reach the OCI
    /// spec). Default `/etc/containerd/config.toml`.
    pub containerd_config: PathBuf,
    /// The kubelet's cgroup root, relative to the cgroup2 mount: `/kubepods` (cgroupfs driver,
    /// the default) or `/kubepods.slice` (systemd driver). The programs attach here; a pod under
    /// it that the agent has not classified yet is `deny_all`.
    pub cgroup_root: String,
    /// Kubernetes namespace → policy for its pods without `egress.*` annotations.
    pub namespace_defaults: BTreeMap<String, String>,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            containerd_socket: PathBuf::from("/run/containerd/containerd.sock"),
            containerd_namespace: "k8s.io".to_owned(),
            containerd_config: PathBuf::from("/etc/containerd/config.toml"),
            cgroup_root: "/kubepods".to_owned(),
            namespace_defaults: BTreeMap::new(),
        }
    }
}

/// `[requests]`: workloads' access requests (`http://egress.internal/v1/requests`). By default
/// every request waits for an operator; the operator may have requests for some hosts approved
/// at once — for the asking workload's run alone (scope run), recorded as approved by
/// `auto-approve`. Applied on a reload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RequestsConfig {
    /// Hosts as in `allow_hosts`: a name or `*.suffix` alone means port 443,
    /// `{ host = "...", ports = [...] }` those ports. Default none.
    pub auto_approve_hosts: Vec<egress_policy::HostEntry>,
    /// Presets whose hosts are auto-approved likewise (`egress-agent presets show NAME`).
    /// Default none.
    pub auto_approve_presets: Vec<egress_policy::model::PresetName>,
    /// Announce each new request waiting for a decision to a chat tool's incoming webhook
    /// (Slack, Mattermost, Rocket.Chat, Discord's `/slack` URL, ...). Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<webhook::WebhookConfig>,
}

impl RequestsConfig {
    /// Every auto-approved entry, presets expanded.
    pub fn auto_approved(&self) -> Vec<egress_policy::HostEntry> {
        let mut hosts = self.auto_approve_hosts.clone();
        egress_policy::presets::expand(&mut hosts, &self.auto_approve_presets);
        hosts
    }
}

/// `[api]`: who may read the control API, and the status page's optional TCP address. Changes
/// take effect on a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// Members of this group (primary or supplementary, of the connecting process) may use the
    /// read-only endpoints (GET) and the status page; everything else stays root-only. The
    /// socket is then group-owned by it, mode 0660. Default none: root only.
    pub read_group: Option<String>,
    /// Serve the console on this TCP address: the status page and the API. Reads need no login
    /// from root and `read_group` members of this host (found by their socket); anything else —
    /// every write, a remote client — needs a token from `egress-agent console token NAME`
    /// (a session in the browser, or `Authorization: Bearer`). Confined processes get nothing.
    /// A loopback address is the safe choice (plain HTTP). Default none.
    pub ui_listen: Option<SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Where programs, maps and links are pinned. Default `/sys/fs/bpf/egress-agent`.
    pub bpffs: PathBuf,
    /// The global default policy (for opted-in containers that name none). Default `deny_all`.
    pub default_policy: String,
    /// Policy for containers without the opt-in label. Default `allow_all`.
    pub unlabeled: String,
    /// Where the agent keeps its state (the interception CA, the event store), created 0700.
    /// Default `/var/lib/egress-agent`.
    pub state_dir: PathBuf,
    /// Reload when the files of `policies.d` change (an edit, the control API's write, the
    /// kubelet's update of a ConfigMap mounted there), as SIGHUP does. Read at start: a change
    /// takes effect on a restart. Default true.
    pub watch_policies: bool,
    /// After handing its sockets to a new agent (a restart or upgrade), how long this agent
    /// keeps relaying the connections it has open (tunnels, DNS-over-TCP) before it cuts what is
    /// left and exits, in seconds. Default 300.
    pub drain_timeout_s: u64,
    /// A workload (an opted-in container or pod, an `exec` command) whose environment holds a
    /// real key — a bound secret of any policy, or a provider's key variable (`OPENAI_API_KEY`,
    /// `GITHUB_TOKEN`, ...) holding anything but a placeholder — is reported either way (event
    /// `workload-holds-secret`, `status`, `doctor`); with this set it is also confined
    /// `deny_all` (`exec` refuses to start the command). A reload applies it. Default false.
    pub refuse_workload_secrets: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            bpffs: PathBuf::from("/sys/fs/bpf/egress-agent"),
            default_policy: DENY_ALL.to_owned(),
            unlabeled: ALLOW_ALL.to_owned(),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            watch_policies: true,
            drain_timeout_s: 300,
            refuse_workload_secrets: false,
        }
    }
}

/// Default of `agent.state_dir`.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/egress-agent";

/// `[store]`: the SQLite event store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Record events and flows durably. Default true.
    pub enabled: bool,
    /// Events and flows older than this are deleted. Default 168 (7 days).
    pub max_age_hours: u64,
    /// The database is kept under this size (oldest events go first). Default 268 435 456 (256 MiB).
    pub max_bytes: u64,
    /// Events waiting to be written, at most; more are dropped and counted
    /// (`egress_agent_event_drops_total{source="store"}`). Default 65 536.
    pub queue: usize,
    /// Record allowed traffic as flows (name/address, port, protocol, counts, first/last seen).
    /// Default true.
    pub record_allowed: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            enabled: true,
            max_age_hours: 168,
            max_bytes: 256 * 1024 * 1024,
            queue: 65_536,
            record_allowed: true,
        }
    }
}

impl StoreConfig {
    pub fn max_age(&self) -> Duration {
        Duration::from_secs(self.max_age_hours.saturating_mul(3600))
    }
}

impl ProxyConfig {
    /// The endpoint(s) `explain` evaluates a confined socket's redirect with.
    pub fn explain_endpoint(&self) -> egress_policy::explain::ProxyEndpoint {
        egress_policy::explain::ProxyEndpoint {
            endpoint: self.endpoint,
            endpoint_v6: self.endpoint_v6,
        }
    }
}

/// The event store's database file name under `agent.state_dir`.
pub const STORE_DB_FILE: &str = "events.db";

impl AgentConfig {
    /// `drain_timeout_s`.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_s)
    }

    /// The event store's database file.
    pub fn store_path(&self) -> PathBuf {
        self.state_dir.join(STORE_DB_FILE)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// The stable address confined processes use (HTTP(S)_PROXY); the kernel rewrites connections
    /// to it to the policy's own listener. Default `127.0.0.1:3128`.
    pub endpoint: SocketAddr,
    /// Optional IPv6 endpoint. Default none.
    pub endpoint_v6: Option<SocketAddr>,
    /// Address the per-policy listeners bind (port 0). Default: the endpoint's IP.
    pub listen: Option<IpAddr>,
    /// Allow `listen` to be 0.0.0.0 / `::` (reachable from the LAN). Default false.
    pub allow_unspecified_listen: bool,
    /// Whole request head must arrive within this (slowloris bound). Default 10 000 ms.
    pub header_timeout_ms: u64,
    /// DNS + TCP connect to the upstream. Default 10 000 ms.
    pub connect_timeout_ms: u64,
    /// A tunnel or keep-alive connection with no bytes either way for this long is closed.
    /// Default 300 000 ms.
    pub idle_timeout_ms: u64,
    /// Largest request head (request line + headers). Default 16 384 bytes.
    pub max_header_bytes: usize,
    /// Most client connections open at once, across all policies. Default 8 192.
    pub max_connections: usize,
    /// Most client connections open at once on one listener — one container's in Docker mode, one
    /// policy's for `exec` — so a single client can't take every connection. At most
    /// `max_connections`. Default 1 024 (or `max_connections`, if that is smaller).
    pub max_connections_per_listener: Option<usize>,
    /// Largest copy buffer per tunnel direction. Buffers are allocated only while bytes flow (idle
    /// tunnels hold none), start at 16 KiB and double up to this while reads fill them.
    /// Default 262 144 bytes.
    pub tunnel_buffer_bytes: usize,
    /// TCP congestion control of the client-facing (host-local) sockets. Unset: `cubic` if the
    /// kernel has it, else the host default; `"host"`: the host default; any other name must be
    /// available (`/proc/sys/net/ipv4/tcp_available_congestion_control`) or the proxy won't start.
    /// Upstream sockets always use the host default.
    pub client_congestion_control: Option<String>,
    /// Relay allowed pass-through tunnels (CONNECT, transparent) in the kernel once they prove
    /// long-lived — both sockets in a sockhash with an `sk_skb` verdict program, so bytes no
    /// longer cross user space — instead of copying them in the proxy. `"auto"` (default):
    /// where the kernel supports it, else in user space (logged once); `"on"`: the proxy refuses
    /// to start without it; `"off"`: always in user space. TLS-intercepted tunnels always stay
    /// in user space.
    pub kernel_relay: KernelRelayMode,
    /// Reads with data (both directions together) a pass-through tunnel makes in user space
    /// before the kernel relay takes it; `0` splices every tunnel at once. Splicing costs the
    /// proxy more than a one-request tunnel's few reads (docs/benchmarks.md, "Kernel relay"), so
    /// short tunnels stay in user space. Default 16.
    pub kernel_relay_after_reads: u64,
}

/// `proxy.kernel_relay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelRelayMode {
    #[default]
    Auto,
    On,
    Off,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            endpoint: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 3128),
            endpoint_v6: None,
            listen: None,
            allow_unspecified_listen: false,
            header_timeout_ms: 10_000,
            connect_timeout_ms: 10_000,
            idle_timeout_ms: 300_000,
            max_header_bytes: 16 * 1024,
            max_connections: 8192,
            max_connections_per_listener: None,
            tunnel_buffer_bytes: 256 * 1024,
            client_congestion_control: None,
            kernel_relay: KernelRelayMode::Auto,
            kernel_relay_after_reads: 16,
        }
    }
}

impl ProxyConfig {
    /// The IP the per-policy listeners bind.
    pub fn listen_ip(&self) -> IpAddr {
        self.listen.unwrap_or(self.endpoint.ip())
    }
    pub fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms)
    }
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    /// `max_connections_per_listener`, or its default.
    pub fn per_listener_connections(&self) -> usize {
        self.max_connections_per_listener
            .unwrap_or(1024.min(self.max_connections))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsConfig {
    /// resolv.conf to read nameservers/search/options from. Default `/etc/resolv.conf`.
    pub resolv_conf: PathBuf,
    /// If set, these nameservers (UDP+TCP; `"192.0.2.53"` is port 53, `"127.0.0.1:5353"` /
    /// `"[::1]:5353"` name a port) replace resolv.conf's. `[]` = hosts file only.
    pub nameservers: Option<Vec<NameServer>>,
    /// Static hosts file consulted before DNS. Default `/etc/hosts`.
    pub hosts_file: PathBuf,
    /// Per-query timeout. Default 5 000 ms.
    pub timeout_ms: u64,
    /// Attempts per query. Default 2.
    pub attempts: usize,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            resolv_conf: PathBuf::from("/etc/resolv.conf"),
            nameservers: None,
            hosts_file: PathBuf::from("/etc/hosts"),
            timeout_ms: 5_000,
            attempts: 2,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InterceptConfig {
    /// PEM file of extra CAs trusted for upstream servers of intercepted hosts, besides the
    /// system roots. Default none.
    pub upstream_ca_file: Option<PathBuf>,
    /// Leaf certificates kept (one per intercepted name). Default 1 024.
    pub leaf_cache_entries: usize,
    /// Replace every bound secret an intercepted host's response carries (headers, bodies,
    /// trailers, WebSocket frames; raw, base64, percent- and JSON-encoded) by its placeholder
    /// before the client sees it. Default true; `false` only to measure its cost (a warning is
    /// logged: a reflecting upstream then hands the real secret to the sandbox).
    pub scrub_responses: bool,
}

impl Default for InterceptConfig {
    fn default() -> Self {
        InterceptConfig {
            upstream_ca_file: None,
            leaf_cache_entries: 1024,
            scrub_responses: true,
        }
    }
}

/// A `[dns] nameservers` entry: an address (port 53) or an address with a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameServer(pub SocketAddr);

impl From<IpAddr> for NameServer {
    fn from(ip: IpAddr) -> Self {
        NameServer(SocketAddr::new(ip, 53))
    }
}

impl std::fmt::Display for NameServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.port() == 53 {
            write!(f, "{}", self.0.ip())
        } else {
            write!(f, "{}", self.0)
        }
    }
}

impl Serialize for NameServer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NameServer {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(ip.into());
        }
        match s.parse::<SocketAddr>() {
            Ok(sa) if sa.port() != 0 => Ok(NameServer(sa)),
            _ => Err(serde::de::Error::custom(format!(
                "invalid nameserver {s:?}: an IP address, or IP:port (\"[v6]:port\")"
            ))),
        }
    }
}

/// A configuration error, always naming the file; line, column and field when known.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file or directory the agent won't read (owner, mode, kind).
    #[error("{path}: {message}")]
    Refused { path: PathBuf, message: String },
    #[error("{path}:{line}:{column}: {field}: {message}")]
    Invalid {
        path: PathBuf,
        line: usize,
        column: usize,
        field: String,
        message: String,
    },
}

impl Config {
    /// Read, parse and validate `path`, then the policy files of its `policies.d/` directory
    /// (see [`policies_dir`]): one `<policy>.toml` per policy, loaded after the main file.
    /// A policy defined in both is an error. Every error names its own file, line and column.
    /// `--config` if given, else [`DEFAULT_CONFIG_PATH`] if it exists, else the defaults (what
    /// every command that takes `--config` loads).
    pub fn load_or_default(path: Option<&Path>) -> Result<Config, ConfigError> {
        match path {
            Some(p) => Config::load(p),
            None => {
                let p = Path::new(DEFAULT_CONFIG_PATH);
                if p.exists() {
                    Config::load(p)
                } else {
                    Ok(Config::default())
                }
            }
        }
    }

    /// [`Config::load_with`] for serving ([`Secrets::Lenient`]).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(path, Secrets::Lenient)
    }

    /// Read, parse and validate `path` and its `policies.d`, loading the credential bindings'
    /// secrets as `secrets` says.
    pub fn load_with(path: &Path, secrets: Secrets) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let files = policies_dir::read_policies(&policies_dir::policies_dir(path))?;
        Config::load_parts_with(path, &text, files, secrets)
    }

    /// [`Config::load`] of texts already read: the main file's and the policy files'. The
    /// control API validates a change by loading the files it would write through this.
    pub fn load_parts(
        path: &Path,
        text: &str,
        files: Vec<policies_dir::PolicyFile>,
    ) -> Result<Config, ConfigError> {
        Config::load_parts_with(path, text, files, Secrets::Lenient)
    }

    /// [`Config::load_parts`], loading the secrets as `secrets` says.
    pub fn load_parts_with(
        path: &Path,
        text: &str,
        files: Vec<policies_dir::PolicyFile>,
        secrets: Secrets,
    ) -> Result<Config, ConfigError> {
        let mut config: Config = parse_located(text, path, "")?;
        let mut sources = Sources::main(path, text);
        for file in files {
            let base = format!("policies.{}", file.name);
            if config.policies.contains_key(&file.name) {
                let (line, column) = span_of_path(text, &base)
                    .map(|r| line_col(text, r.start))
                    .unwrap_or((0, 0));
                return Err(ConfigError::Invalid {
                    path: path.to_owned(),
                    line,
                    column,
                    field: base,
                    message: format!(
                        "also defined in {}; define a policy in one place",
                        file.path.display()
                    ),
                });
            }
            if let Err(message) = check_policy_name(&file.name) {
                return Err(ConfigError::Invalid {
                    path: file.path,
                    line: 1,
                    column: 1,
                    field: base,
                    message: message.to_owned(),
                });
            }
            let policy: Policy = parse_located(&file.text, &file.path, &format!("{base}."))?;
            config.policies.insert(file.name.clone(), policy);
            sources.files.insert(file.name, (file.path, file.text));
        }
        config.finish(&sources, secrets)
    }

    /// Parse and validate TOML text ([`Secrets::Lenient`]); `origin` names the file in errors.
    pub fn from_toml_str(s: &str, origin: &Path) -> Result<Config, ConfigError> {
        Config::from_toml_str_with(s, origin, Secrets::Lenient)
    }

    /// [`Config::from_toml_str`], loading the secrets as `secrets` says.
    pub fn from_toml_str_with(
        s: &str,
        origin: &Path,
        secrets: Secrets,
    ) -> Result<Config, ConfigError> {
        let config: Config = parse_located(s, origin, "")?;
        config.finish(&Sources::main(origin, s), secrets)
    }

    /// Validate and load the credentials' secrets; errors are located in the file each policy
    /// came from.
    fn finish(mut self, sources: &Sources<'_>, secrets: Secrets) -> Result<Config, ConfigError> {
        self.validate().map_err(|v| sources.locate(v))?;
        self.resolve_secrets(secrets)
            .map_err(|v| sources.locate(v))?;
        Ok(self)
    }

    /// A policy by name, including the built-ins `allow_all` and `deny_all`.
    pub fn policy(&self, name: &str) -> Option<&Policy> {
        static ALLOW: std::sync::LazyLock<Policy> = std::sync::LazyLock::new(Policy::allow_all);
        static DENY: std::sync::LazyLock<Policy> = std::sync::LazyLock::new(Policy::deny_all);
        static AUDITS: std::sync::LazyLock<Policy> = std::sync::LazyLock::new(Policy::audit);
        match name {
            ALLOW_ALL => Some(&ALLOW),
            DENY_ALL => Some(&DENY),
            AUDIT => Some(&AUDITS),
            other => self.policies.get(other),
        }
    }

    /// All policy names, built-ins first.
    pub fn policy_names(&self) -> impl Iterator<Item = &str> {
        [ALLOW_ALL, DENY_ALL, AUDIT]
            .into_iter()
            .chain(self.policies.keys().map(String::as_str))
    }

    /// Load the secrets the policies' credential bindings name (see `policy::credentials`): the
    /// one place that decides what a secret that can't be loaded does ([`Secrets`]).
    fn resolve_secrets(&mut self, mode: Secrets) -> Result<(), ValidationError> {
        if mode == Secrets::Skip {
            return Ok(());
        }
        // The webhook's URL (a secret too): `check` reads and checks it; serving reads it when
        // the notifier is configured, and a failure there leaves notifications off (logged).
        if mode == Secrets::Strict
            && let Some(w) = &self.requests.webhook
        {
            w.resolve("requests.webhook")?;
        }
        for (name, policy) in &mut self.policies {
            let failed = egress_policy::credentials::resolve(
                &mut policy.credentials,
                &format!("policies.{name}"),
                crate::secrets::load,
            );
            match (mode, failed.into_iter().next()) {
                (Secrets::Strict, Some(first)) => return Err(first),
                // Each binding keeps why ([`Config::unavailable_bindings`]) and refuses its host.
                (Secrets::Lenient | Secrets::Skip, _) | (_, None) => {}
            }
        }
        Ok(())
    }

    /// Every credential binding whose secret a lenient load could not load, in policy order:
    /// what `status` and `doctor` name, and what the proxy refuses (`interception-unavailable`).
    pub fn unavailable_bindings(&self) -> Vec<UnavailableBinding<'_>> {
        self.policies
            .iter()
            .flat_map(|(name, p)| {
                p.credentials.iter().enumerate().filter_map(move |(i, b)| {
                    Some(UnavailableBinding {
                        policy: name,
                        index: i,
                        binding: b,
                        why: b.unavailable.as_ref()?,
                    })
                })
            })
            .collect()
    }
}

/// How loading a configuration treats a credential binding whose secret can't be loaded (a
/// missing or empty file, an unset variable, no `$CREDENTIALS_DIRECTORY`, a secret holding its
/// placeholder). Decided in one place, [`Config::resolve_secrets`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secrets {
    /// `egress-agent check`: the load fails, naming the field
    /// (`policies.p.credentials[0].source: can't read secret file …`).
    Strict,
    /// Serving (`run` and its reloads, `exec`, the control API's changes) and every other
    /// command: the binding is kept without its secret and says why
    /// ([`Config::unavailable_bindings`]); the proxy refuses its host:port
    /// (`interception-unavailable`) and everything else is served. A later load that can read
    /// the secret restores it.
    Lenient,
    /// A policy that only decides on recorded traffic (`replay`: nothing is sent, no request is
    /// ever given a secret): bindings are validated like the others, no secret is read, and none
    /// is reported missing.
    Skip,
}

/// A credential binding a lenient load kept without its secret ([`Config::unavailable_bindings`]).
#[derive(Debug, Clone, Copy)]
pub struct UnavailableBinding<'a> {
    pub policy: &'a str,
    /// Its index in the policy's `credentials`.
    pub index: usize,
    pub binding: &'a egress_policy::credentials::CredentialBinding,
    /// The field and what went wrong (names the source, never the secret).
    pub why: &'a ValidationError,
}

impl UnavailableBinding<'_> {
    /// What `status --json` shows for it.
    pub fn to_json(&self) -> serde_json::Value {
        let b = self.binding;
        serde_json::json!({
            "policy": self.policy,
            "binding": self.index,
            "host": b.host.to_string(),
            "port": b.port,
            "source": source_label(&b.source),
            "field": self.why.field,
            "error": self.why.message,
            "summary": self.describe(),
        })
    }

    /// The agent's event about it (at start and at each reload that leaves it so): reason
    /// `interception-unavailable`, the binding's host and port, and why (never the secret).
    pub fn event(&self) -> crate::events::DenialEvent {
        let b = self.binding;
        let mut ev = crate::events::DenialEvent::proxy(
            self.policy,
            Some(b.host.to_string()),
            None,
            b.port,
            "https",
            egress_policy::DenyReason::InterceptionUnavailable.as_str(),
        );
        ev.source = crate::events::Source::Agent;
        ev.context.insert(
            "binding".to_owned(),
            format!("policies.{}.credentials[{}]", self.policy, self.index),
        );
        ev.context
            .insert("source".to_owned(), source_label(&b.source));
        ev.context
            .insert("unavailable".to_owned(), self.why.to_string());
        ev
    }

    /// One line: `policy p, binding 0 (api.test:443, file /x): can't read secret file …`.
    pub fn describe(&self) -> String {
        let b = self.binding;
        format!(
            "policy {}, binding {} ({}:{}, {}): {}",
            self.policy,
            self.index,
            b.host,
            b.port,
            source_label(&b.source),
            self.why
        )
    }
}

/// A secret source in words (`file /x`, `env VAR`, `credential name`): never the secret.
pub fn source_label(s: &egress_policy::secret::SecretSource) -> String {
    use egress_policy::secret::SecretSource;
    match s {
        SecretSource::File(p) => format!("file {}", p.display()),
        SecretSource::Env(v) => format!("env {v}"),
        SecretSource::Credential(c) => format!("credential {c}"),
    }
}

/// A name a configured policy may have: not a built-in, 1-64 characters of `[A-Za-z0-9_-]`
/// (so it is also a safe file name in `policies.d`).
pub fn check_policy_name(name: &str) -> Result<(), &'static str> {
    if name == ALLOW_ALL || name == DENY_ALL || name == AUDIT {
        return Err("is a built-in policy and cannot be redefined");
    }
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err("policy names are 1-64 characters of [A-Za-z0-9_-]");
    }
    Ok(())
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use egress_policy::{CidrRule, Mode};

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(s, Path::new("/etc/egress-agent/test.toml"))
    }

    fn err(s: &str) -> String {
        match parse(s) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.agent.default_policy, "deny_all");
        assert_eq!(c.agent.unlabeled, "allow_all");
        assert!(!c.agent.refuse_workload_secrets);
        assert_eq!(c.agent.bpffs, PathBuf::from("/sys/fs/bpf/egress-agent"));
        assert_eq!(c.proxy.endpoint, "127.0.0.1:3128".parse().unwrap());
        assert_eq!(c.proxy.listen_ip(), "127.0.0.1".parse::<IpAddr>().unwrap());
        assert!(c.policy("allow_all").is_some());
        assert_eq!(c.policy("deny_all").unwrap().mode, Mode::DenyAll);
        assert!(c.policy("nope").is_none());
    }

    #[test]
    fn full_policy() {
        let c = parse(
            r#"
[agent]
default_policy = "ci"
[policies.ci]
mode = "allowlist"
allow_hosts = ["GitHub.com.", "*.githubusercontent.com", "bücher.example"]
allow_cidrs = ["192.0.2.10", { cidr = "10.0.0.0/24", ports = [5432] }]
deny_cidrs = ["203.0.113.0/24"]
"#,
        )
        .unwrap();
        let p = c.policy("ci").unwrap();
        assert_eq!(p.allow_ports, vec![443]);
        assert_eq!(p.allow_hosts[0].to_string(), "github.com");
        assert_eq!(p.allow_hosts[1].to_string(), "*.githubusercontent.com");
        assert_eq!(p.allow_hosts[2].to_string(), "xn--bcher-kva.example");
        assert_eq!(
            p.allow_cidrs[0],
            CidrRule {
                net: "192.0.2.10/32".parse().unwrap(),
                ports: vec![]
            }
        );
        assert_eq!(p.allow_cidrs[1].ports, vec![5432]);
        assert!(p.allow_cidrs[1].allows_port(5432) && !p.allow_cidrs[1].allows_port(5433));
        // Round-trips through serde.
        let again: Config = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn unknown_field_names_file_line_and_field() {
        let e = err("[proxy]\nendpoint = \"127.0.0.1:3128\"\nhedaer_timeout_ms = 5\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:3:1: proxy.hedaer_timeout_ms:"),
            "{e}"
        );
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn bad_host_pattern_is_located() {
        let e = err("[policies.ci]\nallow_hosts = [\n  \"github.com\",\n  \"10.0.0.1\",\n]\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:4:3: policies.ci.allow_hosts[1]:"),
            "{e}"
        );
        assert!(e.contains("allow_cidrs"), "{e}");
        let e = err("[policies.ci]\nallow_hosts = [\"*github.com\"]\n");
        assert!(e.contains(":2:") && e.contains("wildcard"), "{e}");
    }

    #[test]
    fn bad_values() {
        let e = err("[policies.ci]\nmode = \"allow-some\"\n");
        assert!(e.contains(":2:") && e.contains("policies.ci.mode"), "{e}");
        let e = err("[policies.ci]\nallow_cidrs = [\"10.0.0.1/8\"]\n");
        assert!(e.contains("host bits") && e.contains("10.0.0.0/8"), "{e}");
        let e = err("[policies.ci]\nallow_cidrs = [{ cidr = \"10.0.0.0/8\", port = [1] }]\n");
        assert!(e.contains("unknown field"), "{e}");
        let e = err("[policies.ci]\nallow_ports = [0]\n");
        assert!(
            e.contains("policies.ci.allow_ports[0]") && e.contains(":2:"),
            "{e}"
        );
        let e = err("[policies.ci]\nallow_ports = [70000]\n");
        assert!(e.contains("policies.ci.allow_ports"), "{e}");
        let e = err("[proxy]\nendpoint = \"localhost:3128\"\n");
        assert!(e.contains("proxy.endpoint"), "{e}");
        let e = err("[agent]\nrefuse_workload_secrets = \"yes\"\n");
        assert!(
            e.contains(":2:") && e.contains("agent.refuse_workload_secrets"),
            "{e}"
        );
        assert!(
            parse("[agent]\nrefuse_workload_secrets = true\n")
                .unwrap()
                .agent
                .refuse_workload_secrets
        );
    }

    #[test]
    fn cross_field_errors_are_located() {
        let e = err("[agent]\n\ndefault_policy = \"missing\"\n");
        assert_eq!(
            e,
            "/etc/egress-agent/test.toml:3:1: agent.default_policy: no policy named \"missing\""
        );
        let e = err("[policies.allow_all]\nmode = \"deny_all\"\n");
        assert!(e.contains("built-in"), "{e}");
        let e = err(
            "[policies.ci]\nallow_cidrs = [\"10.0.0.0/8\"]\ndeny_cidrs = [\"192.0.2.0/24\", \"10.1.0.0/16\"]\n",
        );
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:3:31: policies.ci.deny_cidrs[1]: "),
            "{e}"
        );
        assert!(e.contains("overlaps"), "{e}");
    }

    #[test]
    fn kubernetes_errors_are_located() {
        let e = err("[kubernetes]\nnamespace_defaults = { ci = \"nope\" }\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:2:")
                && e.contains("kubernetes.namespace_defaults.ci: no policy named \"nope\""),
            "{e}"
        );
        let e = err("[kubernetes]\ncgroup_root = \"/kubepods/../x\"\n");
        assert!(
            e.contains("kubernetes.cgroup_root") && e.contains("/kubepods.slice"),
            "{e}"
        );
        let e = err("[kubernetes]\ncontainerd_socket = \"run/c.sock\"\n");
        assert!(e.contains("kubernetes.containerd_socket"), "{e}");
        let e = err("[kubernetes]\ncgroup_parent = \"/kubepods\"\n");
        assert!(e.contains("cgroup_parent"), "{e}");
        let c = parse("[kubernetes]\n").expect("config");
        let k = c.kubernetes.expect("section");
        assert_eq!(
            (k.cgroup_root.as_str(), k.containerd_namespace.as_str()),
            ("/kubepods", "k8s.io")
        );
    }

    #[test]
    fn host_entries_resolve_private_and_transparent() {
        let c = parse(
            r#"
[policies.ci]
allow_hosts = ["example.com", { host = "GitHub.com.", ports = [2222, 22, 22] }]
resolve_private = ["10.0.0.0/8", "127.0.0.1/32"]
[policies.explicit]
allow_hosts = ["example.com"]
transparent = false
"#,
        )
        .unwrap();
        let p = c.policy("ci").unwrap();
        assert_eq!(p.allow_hosts[0].to_string(), "example.com");
        assert!(p.allow_hosts[0].ports.is_empty());
        assert_eq!(p.allow_hosts[1].pattern.to_string(), "github.com");
        assert_eq!(p.allow_hosts[1].ports, vec![22, 2222]);
        assert_eq!(p.allow_hosts[1].to_string(), "github.com (ports 22, 2222)");
        assert!(p.transparent() && p.answers_dns());
        let e = c.policy("explicit").unwrap();
        assert!(!e.transparent() && e.answers_dns());
        assert!(!c.policy("allow_all").unwrap().transparent());
        assert!(!c.policy("deny_all").unwrap().answers_dns());
        let again: Config = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn nameservers_with_and_without_ports() {
        let c =
            parse("[dns]\nnameservers = [\"192.0.2.53\", \"127.0.0.1:5353\", \"[::1]:5354\"]\n")
                .unwrap();
        let ns = c.dns.nameservers.clone().unwrap();
        assert_eq!(ns[0].0, "192.0.2.53:53".parse().unwrap());
        assert_eq!(ns[1].0, "127.0.0.1:5353".parse().unwrap());
        assert_eq!(ns[2].to_string(), "[::1]:5354");
        let again: Config = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
        for bad in ["\"localhost\"", "\"127.0.0.1:0\"", "\"1.2.3.4:x\""] {
            let e = err(&format!("[dns]\nnameservers = [{bad}]\n"));
            assert!(
                e.contains("dns.nameservers[0]") && e.contains(":2:"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn host_entry_and_range_errors_are_located() {
        for (text, start, needle) in [
            (
                "[policies.ci]\nallow_hosts = [\"a.com\",\n  { host = \"b.com\", ports = [0] }]\n",
                "/etc/egress-agent/test.toml:3:3: policies.ci.allow_hosts[1]:",
                "port 0",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"b.com\", port = [22] }]\n",
                "/etc/egress-agent/test.toml:2:",
                "unknown field",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"10.0.0.1\", ports = [22] }]\n",
                "/etc/egress-agent/test.toml:2:",
                "allow_cidrs",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"b.com\" }]\n",
                "/etc/egress-agent/test.toml:2:",
                "ports",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"b.com\", ports = [] }]\n",
                "/etc/egress-agent/test.toml:2:",
                "plain string",
            ),
            (
                "[policies.ci]\nresolve_private = [\"10.0.0.0/8\", \"8.8.8.0/24\"]\n",
                "/etc/egress-agent/test.toml:2:34: policies.ci.resolve_private[1]:",
                "built-in deny list",
            ),
            (
                "[policies.ci]\nresolve_private = [\"10.0.0.1/8\"]\n",
                "/etc/egress-agent/test.toml:2:20: policies.ci.resolve_private[0]:",
                "host bits",
            ),
            (
                "[policies.ci]\nresolve_private = [\"10.0.0.0/8\"]\ndeny_cidrs = [\"10.1.0.0/16\"]\n",
                "/etc/egress-agent/test.toml:2:20: policies.ci.resolve_private[0]:",
                "overlaps",
            ),
            (
                "[policies.ci]\nmode = \"deny_all\"\ntransparent = true\n",
                "/etc/egress-agent/test.toml:3:1: policies.ci.transparent:",
                "allowlist",
            ),
        ] {
            let e = err(text);
            assert!(e.starts_with(start) && e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn host_services_and_lan_entries_are_checked_where_they_are_written() {
        let ok = parse(
            "[policies.local]\nallow_host_services = [{ port = 11434, name = \"ollama\" }, { port = 8080 }]\nallow_hosts = [{ host = \"gpu-box.lan\", ports = [8000], lan = true }]\nresolve_private = [\"192.168.0.0/16\"]\n",
        )
        .unwrap();
        let p = ok.policy("local").unwrap();
        assert_eq!(p.host_service_ports(), vec![8080, 11434]);
        assert!(p.allow_hosts[0].lan);
        assert_eq!(
            p.allow_hosts[0].to_string(),
            "gpu-box.lan (ports 8000) (lan)"
        );
        // Written back as read.
        let back = toml::to_string(p).unwrap();
        assert!(
            back.contains("lan = true") && back.contains("name = \"ollama\""),
            "{back}"
        );
        for (text, start, needle) in [
            (
                "[policies.ci]\nallow_host_services = [{ port = 0 }]\n",
                "/etc/egress-agent/test.toml:2:",
                "port 0",
            ),
            (
                "[policies.ci]\nallow_host_services = [{ port = 53 }]\n",
                "/etc/egress-agent/test.toml:2:",
                "DNS responder",
            ),
            (
                "[policies.ci]\nallow_host_services = [{ port = 80 }, { port = 80 }]\n",
                "/etc/egress-agent/test.toml:2:",
                "listed twice",
            ),
            (
                "[policies.ci]\nallow_host_services = [{ port = 80, host = \"x\" }]\n",
                "/etc/egress-agent/test.toml:2:",
                "unknown field",
            ),
            (
                "[policies.ci]\nmode = \"deny_all\"\nallow_host_services = [{ port = 80 }]\n",
                "/etc/egress-agent/test.toml:3:",
                "allowlist",
            ),
            (
                "[api]\nui_listen = \"127.0.0.1:9400\"\n[policies.ci]\nallow_host_services = [{ port = 9400 }]\n",
                "/etc/egress-agent/test.toml:4:",
                "console",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"gpu-box.lan\", ports = [8000], lan = true }]\n",
                "/etc/egress-agent/test.toml:2:",
                "resolve_private is empty",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"gpu-box.lan\", lan = true }]\nresolve_private = [\"10.0.0.0/8\"]\n",
                "/etc/egress-agent/test.toml:2:",
                "give it ports",
            ),
            (
                "[policies.ci]\nallow_hosts = [{ host = \"*.lan\", ports = [8000], lan = true }]\nresolve_private = [\"10.0.0.0/8\"]\n",
                "/etc/egress-agent/test.toml:2:",
                "no wildcards",
            ),
        ] {
            let e = err(text);
            assert!(e.starts_with(start) && e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn unspecified_listen_is_refused_unless_explicit() {
        let e = err("[proxy]\nlisten = \"0.0.0.0\"\n");
        assert!(e.contains("proxy.listen") && e.contains(":2:"), "{e}");
        let e = err("[proxy]\nendpoint = \"[::]:3128\"\n");
        assert!(e.contains("proxy.endpoint"), "{e}");
        parse("[proxy]\nlisten = \"0.0.0.0\"\nallow_unspecified_listen = true\n").unwrap();
    }

    #[test]
    fn per_listener_bound_fits_in_the_global_one() {
        let e = err("[proxy]\nmax_connections = 10\nmax_connections_per_listener = 11\n");
        assert!(
            e.contains("proxy.max_connections_per_listener") && e.contains("(10)"),
            "{e}"
        );
        let e = err("[proxy]\nmax_connections_per_listener = 0\n");
        assert!(e.contains("proxy.max_connections_per_listener"), "{e}");
        parse("[proxy]\nmax_connections = 10\nmax_connections_per_listener = 10\n").unwrap();
        let c = parse("[proxy]\nmax_connections = 10\n").unwrap();
        assert_eq!(c.proxy.per_listener_connections(), 10);
        assert_eq!(parse("").unwrap().proxy.per_listener_connections(), 1024);
    }

    #[test]
    fn congestion_control_names_are_checked() {
        for bad in ["", "Cubic", "bbr;reno", "a_very_long_cc_name"] {
            let e = err(&format!("[proxy]\nclient_congestion_control = {bad:?}\n"));
            assert!(
                e.contains("proxy.client_congestion_control") && e.contains(":2:"),
                "{bad}: {e}"
            );
        }
        for good in ["host", "cubic", "bbr", "reno"] {
            parse(&format!("[proxy]\nclient_congestion_control = {good:?}\n")).unwrap();
        }
    }

    #[test]
    fn kernel_relay_modes() {
        assert_eq!(ProxyConfig::default().kernel_relay, KernelRelayMode::Auto);
        assert_eq!(ProxyConfig::default().kernel_relay_after_reads, 16);
        for (text, mode) in [
            ("auto", KernelRelayMode::Auto),
            ("on", KernelRelayMode::On),
            ("off", KernelRelayMode::Off),
        ] {
            let c = parse(&format!("[proxy]\nkernel_relay = {text:?}\n")).unwrap();
            assert_eq!(c.proxy.kernel_relay, mode);
        }
        let e = err("[proxy]\nkernel_relay = \"yes\"\n");
        assert!(e.contains(":2:") && e.contains("kernel_relay"), "{e}");
        let c = parse("[proxy]\nkernel_relay_after_reads = 0\n").unwrap();
        assert_eq!(c.proxy.kernel_relay_after_reads, 0);
        let e = err("[proxy]\nkernel_relay_after_reads = -1\n");
        assert!(
            e.contains(":2:") && e.contains("kernel_relay_after_reads"),
            "{e}"
        );
    }

    #[test]
    fn duplicate_key_is_named() {
        let e = err("[proxy]\nmax_connections = 5\nmax_connections = 6\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:3:1: max_connections:"),
            "{e}"
        );
        assert!(e.contains("duplicate"), "{e}");
    }

    #[test]
    fn load_reports_missing_file() {
        let e = Config::load(Path::new("/nonexistent/egress.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/nonexistent/egress.toml: cannot read"),
            "{e}"
        );
    }

    /// The commented interception example in config/example.toml is valid once uncommented (with
    /// its secret file present), and its secret is loaded, not serialised.
    #[test]
    fn shipped_interception_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/example.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let (head, example) = text.split_once("# [policies.agent]").unwrap();
        let secret = std::env::temp_dir().join(format!("egress-example-{}", std::process::id()));
        std::fs::write(&secret, "sk-example\n").unwrap();
        let example: String = format!("# [policies.agent]{example}")
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| !l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
            .replace(
                "/etc/egress-agent/secrets/anthropic",
                &secret.display().to_string(),
            );
        let c =
            Config::from_toml_str(&format!("{head}{example}"), Path::new("example.toml")).unwrap();
        std::fs::remove_file(&secret).ok();
        let p = c.policy("agent").unwrap();
        assert_eq!(p.credentials.len(), 1);
        assert_eq!(p.request_rules.len(), 1);
        assert_eq!(
            p.credentials[0].secret.as_ref().map(|s| s.expose()),
            Some(&b"sk-example"[..])
        );
        assert!(!toml::to_string(&c).unwrap().contains("sk-example"));
    }

    fn err_strict(s: &str) -> String {
        match Config::from_toml_str_with(
            s,
            Path::new("/etc/egress-agent/test.toml"),
            Secrets::Strict,
        ) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn credential_errors_are_located() {
        let base = "[policies.p]\nallow_hosts = [\"api.test\"]\n[[policies.p.credentials]]\nhost = \"api.test\"\nheader = \"x-api-key\"\n";
        let e = err_strict(&format!(
            "{base}source = {{ file = \"/nonexistent/key\" }}\n"
        ));
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:6:1: policies.p.credentials[0].source: can't read secret file /nonexistent/key"),
            "{e}"
        );
        let e = err_strict(&format!(
            "{base}source = {{ env = \"EGRESS_SURELY_UNSET\" }}\n"
        ));
        assert!(
            e.contains("policies.p.credentials[0].source") && e.contains("EGRESS_SURELY_UNSET"),
            "{e}"
        );
        let e = err(
            "[policies.p]\nallow_hosts = [\"a.test\"]\n[[policies.p.credentials]]\nhost = \"b.test\"\nheader = \"x-k\"\nsource = { env = \"X\" }\n",
        );
        assert!(
            e.contains(":4:1: policies.p.credentials[0].host") && e.contains("allow_hosts"),
            "{e}"
        );
        let e = err(
            "[policies.p]\nallow_hosts = [\"a.test\"]\n[[policies.p.credentials]]\nhost = \"a.test\"\nheader = \"content-length\"\nsource = { env = \"X\" }\n",
        );
        assert!(e.contains("policies.p.credentials[0].header"), "{e}");
        let e = err(
            "[policies.p]\nallow_hosts = [\"a.test\"]\n[[policies.p.credentials]]\nhost = \"a.test\"\nheader = \"x-k\"\nrequire = true\nsource = { env = \"X\" }\n",
        );
        assert!(e.contains("policies.p.credentials[0].require"), "{e}");
        let e = err(
            "[policies.p]\nallow_hosts = [\"a.test\"]\n[[policies.p.request_rules]]\nhost = \"a.test\"\naction = \"allow\"\nmethods = [\"post\"]\n",
        );
        assert!(e.contains("policies.p.request_rules[0].methods[0]"), "{e}");
        let e = err(
            "[policies.p]\n[[policies.p.request_rules]]\nhost = \"a.test\"\naction = \"allow\"\npath = \"/a/../b\"\n",
        );
        assert!(
            e.contains(":5:") && e.contains("policies.p.request_rules[0].path"),
            "{e}"
        );
    }

    /// Strict (`check`) refuses the configuration at the first binding it can't load; lenient
    /// (serving) keeps every policy, leaves each such binding without a secret and names it, and
    /// a later load that can read the secret restores it. Validation errors stay errors in both.
    #[test]
    fn lenient_load_keeps_unloadable_bindings_and_names_them() {
        let dir = crate::test_dir::fresh("lenient");
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        let good = dir.join("good");
        std::fs::write(&good, "sk-good\n").unwrap();
        std::fs::remove_file(&key).ok();
        let text = format!(
            r#"[policies.p]
allow_hosts = ["api.test", "pass.test"]
[[policies.p.credentials]]
host = "api.test"
header = "x-api-key"
source = {{ file = "{key}" }}
[[policies.p.credentials]]
host = "pass.test"
header = "x-api-key"
source = {{ env = "EGRESS_SURELY_UNSET_TOO" }}
[policies.q]
allow_hosts = ["api.test"]
[[policies.q.credentials]]
host = "api.test"
header = "x-api-key"
source = {{ file = "{good}" }}
"#,
            key = key.display(),
            good = good.display()
        );
        let e = err_strict(&text);
        assert!(
            e.contains(":6:1: policies.p.credentials[0].source: can't read secret file")
                && e.contains(&key.display().to_string()),
            "{e}"
        );
        let c = parse(&text).unwrap();
        let un = c.unavailable_bindings();
        assert_eq!(un.len(), 2, "{un:?}");
        assert_eq!((un[0].policy, un[0].index), ("p", 0));
        assert_eq!(un[0].why.field, "policies.p.credentials[0].source");
        assert!(un[0].why.message.starts_with("can't read secret file"));
        let j = un[0].to_json();
        assert_eq!(j["source"], format!("file {}", key.display()));
        assert_eq!(
            (j["host"].as_str(), j["port"].as_u64()),
            (Some("api.test"), Some(443))
        );
        assert_eq!(un[1].why.field, "policies.p.credentials[1].source");
        assert!(
            un[1].describe().contains("env EGRESS_SURELY_UNSET_TOO"),
            "{}",
            un[1].describe()
        );
        assert!(c.policy("p").unwrap().credentials[0].secret.is_none());
        assert!(c.policy("q").unwrap().credentials[0].secret.is_some());
        // The file appears: the next load serves the binding.
        std::fs::write(&key, "sk-now\n").unwrap();
        let c2 = parse(&text).unwrap();
        assert_eq!(c2.unavailable_bindings().len(), 1);
        assert_ne!(c2, c, "a reload must see the secret appear");
        assert_eq!(
            c2.policy("p").unwrap().credentials[0]
                .secret
                .as_ref()
                .map(|s| s.expose()),
            Some(&b"sk-now"[..])
        );
        // An invalid binding is a configuration error either way.
        let e = err(&text.replace(
            "header = \"x-api-key\"\nsource = { file",
            "header = \"host\"\nsource = { file",
        ));
        assert!(e.contains("policies.p.credentials[0].header"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn presets_expand_and_their_errors_are_located() {
        let c = parse("[policies.ci]\npresets = [\"rust\"]\nallow_hosts = [\"a.test\"]\n").unwrap();
        let ci = c.policy("ci").unwrap();
        assert_eq!(ci.own_hosts().count(), 1);
        assert!(
            ci.allow_hosts
                .iter()
                .any(|h| h.to_string() == "index.crates.io (preset rust)"),
            "{:?}",
            ci.allow_hosts
        );
        let e = err("[policies.ci]\npresets = [\n  \"github\",\n  \"gitlab\",\n]\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:4:3: policies.ci.presets[1]: unknown preset \"gitlab\"; the presets are: github, "),
            "{e}"
        );
        let e = err("[policies.ci]\npresets = [\"go\", \"go\"]\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:2:")
                && e.contains("policies.ci.presets[1]: preset \"go\" is listed twice"),
            "{e}"
        );
        let file = policies_dir::PolicyFile {
            name: "web".to_owned(),
            path: PathBuf::from("/etc/egress-agent/policies.d/web.toml"),
            text: "allow_hosts = [\"a.test\"]\npresets = [\"pyhton\"]\n".to_owned(),
        };
        let e = Config::load_parts(Path::new("/etc/egress-agent/config.toml"), "", vec![file])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/etc/egress-agent/policies.d/web.toml:2:")
                && e.contains("policies.web.presets[0]: unknown preset \"pyhton\""),
            "{e}"
        );
    }

    #[test]
    fn enforce_audit_only_on_allowlists_with_location() {
        let c =
            parse("[policies.w]\nenforce = \"audit\"\nallow_hosts = [\"a.example\"]\n").unwrap();
        assert!(c.policy("w").unwrap().audits());
        assert!(
            !parse("[policies.w]\n")
                .unwrap()
                .policy("w")
                .unwrap()
                .audits()
        );
        assert!(c.policy("audit").unwrap().audits());
        let e = err("[policies.w]\nmode = \"allow_all\"\nenforce = \"audit\"\n");
        assert_eq!(
            e,
            "/etc/egress-agent/test.toml:3:1: policies.w.enforce: audit needs mode = \"allowlist\" (allow_all refuses nothing to audit)"
        );
        let e = err("[policies.w]\nmode = \"deny_all\"\nenforce = \"audit\"\n");
        assert!(e.contains(":3:1: policies.w.enforce: audit needs mode = \"allowlist\"; an allowlist with no allow_hosts"), "{e}");
        let e = err("[policies.w]\nenforce = \"watch\"\n");
        assert!(
            e.starts_with("/etc/egress-agent/test.toml:2:11: policies.w.enforce: unknown variant"),
            "{e}"
        );
        let e = err("[policies.audit]\nmode = \"allowlist\"\n");
        assert!(e.contains("policies.audit: is a built-in policy"), "{e}");
        let c = parse("[agent]\ndefault_policy = \"audit\"\n").unwrap();
        assert_eq!(c.agent.default_policy, "audit");
    }

    #[test]
    fn store_and_export_sections() {
        let c = parse("").unwrap();
        assert_eq!(c.agent.state_dir, PathBuf::from("/var/lib/egress-agent"));
        assert_eq!(
            c.agent.store_path(),
            PathBuf::from("/var/lib/egress-agent/events.db")
        );
        assert!(c.store.enabled && c.store.record_allowed);
        assert_eq!(c.store.max_bytes, 256 * 1024 * 1024);
        assert_eq!(c.store.max_age_hours, 168);
        assert!(c.export.syslog.is_none() && c.export.otlp.is_none());
        let e = err("[agent]\nstate_dir = \"var/lib\"\n");
        assert!(
            e.contains(":2:1: agent.state_dir: must be an absolute path"),
            "{e}"
        );
        let e = err("[store]\nmax_bytes = 10\n");
        assert!(e.contains(":2:1: store.max_bytes: must be at least"), "{e}");
        let e = err("[export.syslog]\naddress = \"syslog.example:514\"\n");
        assert!(e.contains(":2:1: export.syslog.address: "), "{e}");
        let e = err("[export.otlp]\nendpoint = \"https://c.example/v1/logs\"\n");
        assert!(e.contains(":2:1: export.otlp.endpoint: "), "{e}");
        let e = err("[export.syslog]\naddress = \"udp://127.0.0.1:514\"\nfacility = \"nope\"\n");
        assert!(
            e.contains(":3:1: export.syslog.facility: unknown facility"),
            "{e}"
        );
        let c = parse("[export.syslog]\naddress = \"unix:///dev/log\"\n[export.otlp]\nendpoint = \"http://127.0.0.1:4318\"\n").unwrap();
        assert_eq!(c.export.syslog.unwrap().facility, "daemon");
        assert_eq!(c.export.otlp.unwrap().batch, 512);
    }

    #[test]
    fn shipped_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/example.toml");
        let c = Config::load(&path).unwrap();
        assert!(!c.policies.is_empty());
    }
}
