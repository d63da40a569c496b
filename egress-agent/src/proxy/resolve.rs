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
use hickory_resolver::proto::op::Query;
use hickory_resolver::proto::rr::{Name, RecordType};
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
    /// The hosts file the resolver consults first (same `Arc` as the resolver's).
    hosts: Arc<Hosts>,
    /// No nameservers configured: a family missing from the hosts file can only fail.
    no_nameservers: bool,
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
        let no_nameservers = config.name_servers().is_empty();
        let hosts = Arc::new(hosts);
        let mut builder =
            TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
        *builder.options_mut() = opts;
        let mut resolver = builder
            .build()
            .map_err(|e| ResolveError::Build(e.to_string()))?;
        resolver.set_hosts(hosts.clone());
        // Whole-lookup bound: per-query timeout × attempts × 2 families, plus slack.
        let timeout = Duration::from_millis(cfg.timeout_ms) * (cfg.attempts as u32).max(1) * 2
            + Duration::from_millis(100);
        Ok(DnsResolver {
            inner: Arc::new(resolver),
            hosts,
            no_nameservers,
            timeout,
        })
    }

    /// The answer hickory would give from the hosts file alone, without its lookup machinery:
    /// both families in the hosts file, or one family and no nameservers to ask for the other
    /// (outside the special-use zones hickory answers itself). `None`: ask hickory.
    fn hosts_answer(&self, fqdn: &str) -> Option<Vec<IpAddr>> {
        let name = Name::from_ascii(fqdn).ok()?;
        let a = self
            .hosts
            .lookup_static_host(&Query::query(name.clone(), RecordType::A));
        let aaaa = self
            .hosts
            .lookup_static_host(&Query::query(name, RecordType::AAAA));
        let complete = match (&a, &aaaa) {
            (Some(_), Some(_)) => true,
            (Some(_), None) | (None, Some(_)) => self.no_nameservers && !special_use(fqdn),
            (None, None) => false,
        };
        if !complete {
            return None;
        }
        // hickory's order: A answers, then AAAA answers ([`distinct`] drops repeats).
        let mut ips = Vec::with_capacity(4);
        for lookup in [a, aaaa].into_iter().flatten() {
            ips.extend(lookup.answers().iter().filter_map(|r| r.data.ip_addr()));
        }
        Some(ips)
    }

    /// All addresses of `name` (A and AAAA), deduplicated, in answer order.
    pub async fn lookup(&self, name: &HostName) -> Result<Vec<IpAddr>, ResolveError> {
        // Fully qualified: no search-list expansion, one query per family.
        let fqdn = format!("{}.", name.as_str());
        if let Some(ips) = self.hosts_answer(&fqdn) {
            return distinct(name, ips);
        }
        self.lookup_hickory(name, &fqdn).await
    }

    /// The full hickory lookup (hosts file, special-use names, cache, nameservers).
    async fn lookup_hickory(
        &self,
        name: &HostName,
        fqdn: &str,
    ) -> Result<Vec<IpAddr>, ResolveError> {
        let res = tokio::time::timeout(self.timeout, self.inner.lookup_ip(fqdn))
            .await
            .map_err(|_| ResolveError::Timeout(name.to_string(), self.timeout))?
            .map_err(|e| ResolveError::Lookup(name.to_string(), e.to_string()))?;
        distinct(name, res.iter())
    }
}

/// `ips` without repeats, in order; none at all is [`ResolveError::NoAddress`].
fn distinct(
    name: &HostName,
    ips: impl IntoIterator<Item = IpAddr>,
) -> Result<Vec<IpAddr>, ResolveError> {
    let mut out: Vec<IpAddr> = Vec::with_capacity(4);
    for ip in ips {
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    if out.is_empty() {
        return Err(ResolveError::NoAddress(name.to_string()));
    }
    Ok(out)
}

/// Names hickory answers (or refuses) itself instead of asking a nameserver: the localhost zone
/// (loopback answers) and reverse zones. Conservative: the hosts fast path skips them.
fn special_use(fqdn: &str) -> bool {
    let f = fqdn.to_ascii_lowercase();
    f == "localhost." || f.ends_with(".localhost.") || f.ends_with(".arpa.")
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn resolver(hosts: &str, nameservers: Option<Vec<IpAddr>>) -> DnsResolver {
        let path = std::env::temp_dir().join(format!(
            "egress-agent-resolve-test-{}-{}",
            std::process::id(),
            nameservers.as_ref().map_or(0, Vec::len)
        ));
        std::fs::write(&path, hosts).unwrap();
        let cfg = DnsConfig {
            nameservers,
            hosts_file: path,
            timeout_ms: 200,
            attempts: 1,
            ..DnsConfig::default()
        };
        let r = DnsResolver::from_config(&cfg).unwrap();
        std::fs::remove_file(&cfg.hosts_file).ok();
        r
    }

    const HOSTS: &str = "127.0.0.1 v4.test localhost\n::1 localhost\n\
        10.0.0.1 both.test\n2001:db8::1 both.test\n10.0.0.2 both.test\n10.0.0.1 both.test\n\
        2001:db8::2 v6.test\n127.0.0.2 a.localhost\n";

    /// The hosts fast path answers exactly what hickory answers (addresses, order, errors).
    #[tokio::test]
    async fn hosts_fast_path_matches_hickory() {
        for nameservers in [Some(vec![]), Some(vec!["127.0.0.1".parse().unwrap()])] {
            let no_ns = nameservers.as_ref().is_some_and(Vec::is_empty);
            let r = resolver(HOSTS, nameservers);
            for n in [
                "v4.test",
                "both.test",
                "v6.test",
                "localhost",
                "a.localhost",
                "none.test",
            ] {
                let name = HostName::parse(n).unwrap();
                let fqdn = format!("{n}.");
                let fast = r.hosts_answer(&fqdn);
                match n {
                    "both.test" => assert!(fast.is_some(), "{n}"),
                    "v4.test" | "v6.test" => assert_eq!(fast.is_some(), no_ns, "{n}"),
                    _ => {}
                }
                if no_ns || fast.is_some() {
                    let slow = r.lookup_hickory(&name, &fqdn).await.ok();
                    let fast = r.lookup(&name).await.ok();
                    assert_eq!(fast, slow, "{n}");
                }
            }
        }
    }
}
