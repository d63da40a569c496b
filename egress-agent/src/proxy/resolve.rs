//! The proxy's own resolver (hickory): resolv.conf or configured nameservers, plus a hosts file.
//!
//! The proxy resolves once per request and dials only addresses it has checked (see
//! [`super::dial`]), so a rebinding answer between check and connect is impossible.
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Hosts, TokioResolver};

use crate::config::DnsConfig;
use crate::policy::name::HostName;

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("building the resolver: {0}")]
    Build(String),
    #[error("no address for {0}")]
    NoAddress(String),
    #[error("lookup of {0} failed: {1}")]
    Lookup(String, String),
    #[error("lookup of {0} timed out after {1:?}")]
    Timeout(String, Duration),
}

/// Clone-able DNS resolver.
#[derive(Clone)]
pub struct DnsResolver {
    inner: Arc<TokioResolver>,
    timeout: Duration,
}

impl std::fmt::Debug for DnsResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsResolver")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl DnsResolver {
    pub fn from_config(cfg: &DnsConfig) -> Result<DnsResolver, ResolveError> {
        let (config, mut opts) = match &cfg.nameservers {
            Some(servers) => (
                ResolverConfig::from_name_servers(
                    servers
                        .iter()
                        .map(|ip| NameServerConfig::udp_and_tcp(*ip))
                        .collect(),
                ),
                ResolverOpts::default(),
            ),
            None => {
                let data =
                    std::fs::read(&cfg.resolv_conf).map_err(|source| ResolveError::Read {
                        path: cfg.resolv_conf.display().to_string(),
                        source,
                    })?;
                hickory_resolver::system_conf::parse_resolv_conf(data).map_err(|e| {
                    ResolveError::Build(format!("{}: {e}", cfg.resolv_conf.display()))
                })?
            }
        };
        opts.timeout = Duration::from_millis(cfg.timeout_ms);
        opts.attempts = cfg.attempts;
        // Both families, so every address the name has is checked.
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        opts.use_hosts_file = ResolveHosts::Never;
        let mut hosts = Hosts::default();
        match std::fs::File::open(&cfg.hosts_file) {
            Ok(f) => hosts
                .read_hosts_conf(f)
                .map_err(|source| ResolveError::Read {
                    path: cfg.hosts_file.display().to_string(),
                    source,
                })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::debug!(path = %cfg.hosts_file.display(), "no hosts file")
            }
            Err(source) => {
                return Err(ResolveError::Read {
                    path: cfg.hosts_file.display().to_string(),
                    source,
                });
            }
        }
        let mut builder =
            TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
        *builder.options_mut() = opts;
        let mut resolver = builder
            .build()
            .map_err(|e| ResolveError::Build(e.to_string()))?;
        resolver.set_hosts(Arc::new(hosts));
        // Whole-lookup bound: per-query timeout × attempts × 2 families, plus slack.
        let timeout = Duration::from_millis(cfg.timeout_ms) * (cfg.attempts as u32).max(1) * 2
            + Duration::from_millis(100);
        Ok(DnsResolver {
            inner: Arc::new(resolver),
            timeout,
        })
    }

    /// All addresses of `name` (A and AAAA), deduplicated, in answer order.
    pub async fn lookup(&self, name: &HostName) -> Result<Vec<IpAddr>, ResolveError> {
        // Fully qualified: no search-list expansion, one query per family.
        let fqdn = format!("{}.", name.as_str());
        let res = tokio::time::timeout(self.timeout, self.inner.lookup_ip(fqdn.as_str()))
            .await
            .map_err(|_| ResolveError::Timeout(name.to_string(), self.timeout))?
            .map_err(|e| ResolveError::Lookup(name.to_string(), e.to_string()))?;
        let mut out: Vec<IpAddr> = Vec::with_capacity(4);
        for ip in res.iter() {
            if !out.contains(&ip) {
                out.push(ip);
            }
        }
        if out.is_empty() {
            return Err(ResolveError::NoAddress(name.to_string()));
        }
        Ok(out)
    }
}
