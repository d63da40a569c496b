//! The proxy's own resolver (hickory): resolv.conf or configured nameservers, plus a hosts file.
//!
//! The proxy resolves once per request and dials only addresses it has checked (see
//! [`super::dial`]), so a rebinding answer between check and connect is impossible.
//!
//! Both the proxy ([`DnsResolver::lookup`]) and the DNS responder ([`crate::dns`]) take a name's
//! whole records — the CNAME chain and A/AAAA answers with their remaining lifetime — from
//! [`DnsResolver::lookup_records`], for both families at once and through one cache
//! ([`RecordsCache`]): the responder checks every address of a name exactly as the proxy does
//! before answering either family, and a connection dials the addresses the workload's DNS
//! answer named.
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::lookup::Lookup;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::proto::op::Query;
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::{Name, Record, RecordType};
use hickory_resolver::{Hosts, TokioResolver};

use super::records_cache::RecordsCache;
use crate::config::DnsConfig;
use egress_policy::name::HostName;

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
    /// [`DnsResolver::lookup_records`] answers, for the DNS responder's hot path.
    records: Arc<RecordsCache>,
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
                        .map(|ns| {
                            let mut c = NameServerConfig::udp_and_tcp(ns.0.ip());
                            for conn in &mut c.connections {
                                conn.port = ns.0.port();
                            }
                            c
                        })
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
            records: Arc::default(),
        })
    }

    /// All addresses of `name` (A and AAAA), deduplicated, in answer order: the addresses of
    /// [`DnsResolver::lookup_records`]'s answer, so a connection dials what the DNS responder
    /// answered the workload for that name (the same records, the same cache), and a cached name
    /// costs one map lookup rather than a trip through hickory's lookup machinery. A family with
    /// no data is kept as long as [`RecordsCache`] keeps negative answers even when its answer
    /// carried no SOA (hickory would ask again for every connection: its default negative TTL
    /// is 0).
    pub async fn lookup(&self, name: &HostName) -> Result<Vec<IpAddr>, ResolveError> {
        let records = match self.records.get(name, Instant::now()) {
            Some(hit) => hit,
            // Boxed: hickory's lookup state (~1 KiB) would otherwise size every future that
            // awaits a dial, an idle tunnel's among them, for the connection's whole life.
            None => Box::pin(self.lookup_records(name)).await,
        };
        addresses(name, &records)
    }
}

/// The addresses of `records`, A then AAAA, without repeats. None: why — a family's failure
/// (timeout, SERVFAIL, ...) if there was one, else [`ResolveError::NoAddress`].
fn addresses(name: &HostName, records: &NameRecords) -> Result<Vec<IpAddr>, ResolveError> {
    distinct(name, records.addrs()).map_err(|none| match (&records.v4, &records.v6) {
        (Family::Failed(why), _) | (_, Family::Failed(why)) => {
            ResolveError::Lookup(name.to_string(), why.clone())
        }
        _ => none,
    })
}

/// What the resolver said for one record type of a name.
#[derive(Debug, Clone)]
pub enum Family {
    /// The answer: the CNAME chain (if any) then the records of the asked type, as the resolver
    /// returned them, and when its cache stops holding them.
    Records {
        records: Vec<Record>,
        valid_until: Instant,
    },
    /// The name exists, but has no record of this type.
    NoData,
    /// The name does not exist (upstream NXDOMAIN, or not in the hosts file and no nameservers).
    NxDomain,
    /// Timeout, SERVFAIL, REFUSED, no reachable nameserver, ...
    Failed(String),
}

impl Family {
    /// The addresses of the asked type in this answer (CNAME records skipped).
    pub fn addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let records = match self {
            Family::Records { records, .. } => records.as_slice(),
            _ => &[],
        };
        records.iter().filter_map(|r| r.data.ip_addr())
    }
}

/// Both families of a name, looked up together ([`DnsResolver::lookup_records`]).
#[derive(Debug, Clone)]
pub struct NameRecords {
    pub v4: Family,
    pub v6: Family,
}

impl NameRecords {
    /// The family of `record_type` (A → `v4`, anything else → `v6`).
    pub fn family(&self, record_type: RecordType) -> &Family {
        if record_type == RecordType::A {
            &self.v4
        } else {
            &self.v6
        }
    }

    /// Every address of the name, A then AAAA (what the proxy's dial-time check sees).
    pub fn addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.v4.addrs().chain(self.v6.addrs())
    }
}

impl DnsResolver {
    /// A and AAAA records of `name` (CNAME chains included), looked up concurrently through the
    /// same resolver, cache and hosts file as [`DnsResolver::lookup`]. Bounded by the same whole-
    /// lookup timeout; a family that times out is [`Family::Failed`]. Answers are kept for reuse
    /// no longer than their records live ([`RecordsCache`]).
    pub async fn lookup_records(&self, name: &HostName) -> Arc<NameRecords> {
        let now = Instant::now();
        if let Some(hit) = self.records.get(name, now) {
            return hit;
        }
        let fresh = Arc::new(self.lookup_records_uncached(name).await);
        self.records.put(name, fresh.clone(), Instant::now());
        fresh
    }

    /// The [`DnsResolver::lookup_records`] answer for `name` if it is still cached, without
    /// waiting (the DNS responder answers such queries on its receive loop), with the instant
    /// they stop being reused.
    pub fn cached_records(&self, name: &HostName) -> Option<(Instant, Arc<NameRecords>)> {
        self.records.get_until(name, Instant::now())
    }

    async fn lookup_records_uncached(&self, name: &HostName) -> NameRecords {
        let fqdn = match Name::from_ascii(format!("{}.", name.as_str())) {
            Ok(n) => n,
            Err(e) => {
                let f = Family::Failed(format!("{name}: {e}"));
                return NameRecords {
                    v4: f.clone(),
                    v6: f,
                };
            }
        };
        let (v4, v6) = tokio::join!(
            self.family(&fqdn, RecordType::A),
            self.family(&fqdn, RecordType::AAAA)
        );
        if self.no_nameservers {
            // Hosts file only: a name it lists in one family has no data in the other.
            match (&v4, &v6) {
                (Family::Records { .. }, Family::NxDomain) => {
                    return NameRecords {
                        v4,
                        v6: Family::NoData,
                    };
                }
                (Family::NxDomain, Family::Records { .. }) => {
                    return NameRecords {
                        v4: Family::NoData,
                        v6,
                    };
                }
                _ => {}
            }
        }
        NameRecords { v4, v6 }
    }

    async fn family(&self, fqdn: &Name, rt: RecordType) -> Family {
        let query = Query::query(fqdn.clone(), rt);
        if let Some(lookup) = self.hosts.lookup_static_host(&query) {
            return records_of(&lookup, rt);
        }
        if self.no_nameservers && !special_use(&fqdn.to_ascii()) {
            return Family::NxDomain;
        }
        match tokio::time::timeout(self.timeout, self.inner.lookup(fqdn.clone(), rt)).await {
            Err(_) => Family::Failed(format!("timed out after {:?}", self.timeout)),
            Ok(Ok(lookup)) => records_of(&lookup, rt),
            Ok(Err(NetError::Dns(DnsError::NoRecordsFound(nr)))) => {
                if nr.response_code == ResponseCode::NXDomain {
                    Family::NxDomain
                } else {
                    Family::NoData
                }
            }
            Ok(Err(e)) => Family::Failed(e.to_string()),
        }
    }
}

/// The CNAME chain and the `rt` records of a lookup, in answer order, without repeats (a hosts
/// file may list an address twice).
fn records_of(lookup: &Lookup, rt: RecordType) -> Family {
    let mut records: Vec<Record> = Vec::with_capacity(lookup.answers().len());
    for r in lookup.answers() {
        let wanted = r.record_type() == rt || r.record_type() == RecordType::CNAME;
        if wanted && !records.iter().any(|k| k.name == r.name && k.data == r.data) {
            records.push(r.clone());
        }
    }
    if !records.iter().any(|r| r.record_type() == rt) {
        return Family::NoData;
    }
    Family::Records {
        records,
        valid_until: lookup.valid_until(),
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
/// (loopback answers) and reverse zones. Without nameservers, other names missing from the hosts
/// file fail at once; these still go to hickory.
fn special_use(fqdn: &str) -> bool {
    let ends = |suffix: &str| {
        fqdn.len() >= suffix.len()
            && fqdn.as_bytes()[fqdn.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
    };
    fqdn.eq_ignore_ascii_case("localhost.") || ends(".localhost.") || ends(".arpa.")
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn resolver(hosts: &str, nameservers: Option<Vec<IpAddr>>) -> DnsResolver {
        let nameservers = nameservers.map(|v| v.into_iter().map(Into::into).collect::<Vec<_>>());
        // Unique per call: tests run in parallel and each removes its file.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "egress-agent-resolve-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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

    #[tokio::test]
    async fn records_of_both_families_from_the_hosts_file() {
        let r = resolver(HOSTS, Some(vec![]));
        let n = |s: &str| HostName::parse(s).unwrap();
        let both = r.lookup_records(&n("both.test")).await;
        let v4: Vec<IpAddr> = both.v4.addrs().collect();
        assert_eq!(
            v4,
            ["10.0.0.1", "10.0.0.2"].map(|a| a.parse::<IpAddr>().unwrap())
        );
        assert_eq!(both.v6.addrs().count(), 1);
        assert_eq!(both.addrs().count(), 3);
        let v4only = r.lookup_records(&n("v4.test")).await;
        assert!(matches!(v4only.v6, Family::NoData), "{v4only:?}");
        assert!(matches!(
            v4only.family(RecordType::A),
            Family::Records { .. }
        ));
        let none = r.lookup_records(&n("none.test")).await;
        assert!(matches!(
            (&none.v4, &none.v6),
            (Family::NxDomain, Family::NxDomain)
        ));
    }

    /// `lookup` (the records the DNS responder answers from) gives a connection exactly what
    /// hickory's own `lookup_ip` would (addresses, order, which names fail), from the hosts file
    /// with and without nameservers, the special-use names hickory answers itself included.
    #[tokio::test]
    async fn lookup_answers_what_hickory_lookup_ip_answers() {
        for nameservers in [Some(vec![]), Some(vec!["127.0.0.1".parse().unwrap()])] {
            let r = resolver(HOSTS, nameservers.clone());
            for n in [
                "v4.test",
                "both.test",
                "v6.test",
                "localhost",
                "a.localhost",
                "none.test",
            ] {
                let name = HostName::parse(n).unwrap();
                let hickory = r
                    .inner
                    .lookup_ip(format!("{n}."))
                    .await
                    .ok()
                    .and_then(|l| distinct(&name, l.iter()).ok());
                let ours = r.lookup(&name).await.ok();
                assert_eq!(ours, hickory, "{n} with nameservers {nameservers:?}");
                // Again, from the cache: the same.
                assert_eq!(r.lookup(&name).await.ok(), hickory, "{n} cached");
            }
        }
    }

    #[test]
    fn special_use_names_in_any_case() {
        for n in [
            "localhost.",
            "LocalHost.",
            "a.localhost.",
            "1.0.0.127.in-addr.ARPA.",
        ] {
            assert!(special_use(n), "{n}");
        }
        for n in [
            "notlocalhost.",
            "arpa.",
            "localhost.test.",
            "x.arpa.test.",
            ".",
        ] {
            assert!(!special_use(n), "{n}");
        }
    }
}
