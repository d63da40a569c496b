//! From the resolver's records of an allowed name to the answer: the address check (every
//! address of both families, the proxy's own dial-time check) and one TTL. Pure.
use std::net::IpAddr;
use std::time::{Duration, Instant};

use hickory_server::proto::rr::{Record, RecordType};

use crate::proxy::resolve::{Family, NameRecords};
use egress_policy::{AddrClass, CompiledPolicy, Refused};

/// Longest TTL answered (a hosts-file entry has hickory's one day): the kernel's allowance for
/// direct ports follows the answered TTL, so it is kept short.
pub const MAX_ANSWER_TTL: Duration = Duration::from_secs(300);
/// Shortest TTL answered: a TTL-0 answer would let the direct-port allowance lapse before the
/// client has connected.
pub const MIN_ANSWER_TTL: Duration = Duration::from_secs(5);

/// What to answer for one allowed name.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub enum Planned {
    /// NOERROR with `records` (CNAME chain, then the asked type), each with TTL `ttl`.
    Answer {
        records: Vec<Record>,
        addrs: Vec<IpAddr>,
        direct_addrs: Vec<IpAddr>,
        ttl: Duration,
        /// How `ttl` goes down: an answer kept for reuse is re-planned when it would change.
        clock: Clock,
    },
    /// NOERROR, no records of the asked type.
    NoData,
    /// The name doesn't exist (the resolver said so).
    NxDomain,
    /// An address of the name is denied: the name is refused whole (NXDOMAIN + event).
    Denied { refused: Refused, ip: IpAddr },
    /// The resolver failed for the asked family (SERVFAIL).
    Failed(String),
}

/// What an answer's TTL follows: the asked family's cache lifetime and its records' lowest TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    valid_until: Instant,
    /// `None`: no records (the cache lifetime alone).
    lowest: Option<Duration>,
}

impl Clock {
    /// The TTL to answer at `now`: the remaining cache lifetime, no more than the lowest record
    /// TTL, within [`MIN_ANSWER_TTL`]..=[`MAX_ANSWER_TTL`].
    pub fn ttl(&self, now: Instant) -> Duration {
        let remaining = self.valid_until.saturating_duration_since(now);
        remaining
            .min(self.lowest.unwrap_or(remaining))
            .clamp(MIN_ANSWER_TTL, MAX_ANSWER_TTL)
    }
}

/// Whole seconds of a TTL, as a record carries them.
pub fn ttl_secs(ttl: Duration) -> u32 {
    u32::try_from(ttl.as_secs()).unwrap_or(u32::MAX)
}

/// Check every address of `names` (both families) and shape the `record_type` answer. `lan`:
/// the name is a `lan = true` entry's, so its addresses inside `resolve_private` may be opened
/// directly too ([`lan_direct`]).
pub fn plan(
    policy: &CompiledPolicy,
    names: &NameRecords,
    record_type: RecordType,
    lan: bool,
    now: Instant,
) -> Planned {
    let mut public: Vec<IpAddr> = Vec::new();
    for ip in names.addrs() {
        // Enforce-only on purpose, in audit too: a name's address (`via_name`) is decided the
        // same under the allowlist as under `allow_all` (the audit floor), so `decide_addr`
        // could only give the same refusal.
        match policy.classify_addr(ip, None, true) {
            Ok(AddrClass::Public) => public.push(ip),
            Ok(AddrClass::ResolvePrivate) if lan && lan_direct(ip) => public.push(ip),
            Ok(AddrClass::Cidr | AddrClass::ResolvePrivate) => {}
            Err(refused) => return Planned::Denied { refused, ip },
        }
    }
    match names.family(record_type) {
        Family::NoData => Planned::NoData,
        Family::NxDomain => Planned::NxDomain,
        Family::Failed(why) => Planned::Failed(why.clone()),
        Family::Records {
            records,
            valid_until,
        } => {
            let clock = Clock {
                valid_until: *valid_until,
                lowest: records
                    .iter()
                    .map(|r| Duration::from_secs(u64::from(r.ttl)))
                    .min(),
            };
            let ttl = clock.ttl(now);
            let secs = ttl_secs(ttl);
            let mut out = records.clone();
            for r in &mut out {
                r.ttl = secs;
            }
            let addrs: Vec<IpAddr> = out.iter().filter_map(|r| r.data.ip_addr()).collect();
            let direct_addrs = addrs
                .iter()
                .copied()
                .filter(|ip| public.contains(ip))
                .collect();
            Planned::Answer {
                records: out,
                addrs,
                direct_addrs,
                ttl,
                clock,
            }
        }
    }
}

/// A private address a `lan = true` entry may open directly: anything `resolve_private` covers
/// but the host itself (loopback, unspecified: that is `allow_host_services`) and link-local
/// ranges (metadata services live there).
fn lan_direct(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(a) => !(a.is_loopback() || a.is_unspecified() || a.is_link_local()),
        IpAddr::V6(a) => !(a.is_loopback() || a.is_unspecified() || a.is_unicast_link_local()),
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;
    use hickory_server::proto::rr::rdata::{A, CNAME};
    use hickory_server::proto::rr::{Name, RData};
    use std::path::Path;

    fn policy(toml: &str) -> CompiledPolicy {
        let c =
            Config::from_toml_str(&format!("[policies.p]\n{toml}"), Path::new("t.toml")).unwrap();
        CompiledPolicy::new(c.policy("p").unwrap())
    }

    fn a(name: &str, ip: &str, ttl: u32) -> Record {
        Record::from_rdata(
            Name::from_ascii(name).unwrap(),
            ttl,
            RData::A(A(ip.parse().unwrap())),
        )
    }

    fn family(records: Vec<Record>, secs: u64, now: Instant) -> Family {
        Family::Records {
            records,
            valid_until: now + Duration::from_secs(secs),
        }
    }

    #[test]
    fn cname_chain_is_kept_with_one_capped_ttl() {
        let p = policy("allow_hosts = [\"www.test\"]");
        let now = Instant::now();
        let cname = Record::from_rdata(
            Name::from_ascii("www.test.").unwrap(),
            3600,
            RData::CNAME(CNAME(Name::from_ascii("edge.cdn.test.").unwrap())),
        );
        let names = NameRecords {
            v4: family(
                vec![cname, a("edge.cdn.test.", "140.82.112.3", 600)],
                86_400,
                now,
            ),
            v6: Family::NoData,
        };
        match plan(&p, &names, RecordType::A, false, now) {
            Planned::Answer {
                records,
                addrs,
                direct_addrs,
                ttl,
                clock,
            } => {
                assert_eq!(clock.ttl(now + Duration::from_secs(86_000)), MAX_ANSWER_TTL);
                assert_eq!(
                    clock.ttl(now + Duration::from_secs(86_340)),
                    Duration::from_secs(60)
                );
                assert_eq!(clock.ttl(now + Duration::from_secs(86_399)), MIN_ANSWER_TTL);
                assert_eq!(records.len(), 2);
                assert_eq!(records[0].record_type(), RecordType::CNAME);
                assert!(records.iter().all(|r| r.ttl == 300));
                assert_eq!(ttl, MAX_ANSWER_TTL);
                assert_eq!(addrs, vec!["140.82.112.3".parse::<IpAddr>().unwrap()]);
                assert_eq!(direct_addrs, addrs);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            plan(&p, &names, RecordType::AAAA, false, now),
            Planned::NoData
        );
        // Short TTLs are raised to the floor, remaining cache time counts.
        let short = NameRecords {
            v4: family(vec![a("www.test.", "140.82.112.3", 0)], 0, now),
            v6: Family::NoData,
        };
        let Planned::Answer { ttl, .. } = plan(&p, &short, RecordType::A, false, now) else {
            panic!()
        };
        assert_eq!(ttl, MIN_ANSWER_TTL);
        let mid = NameRecords {
            v4: family(vec![a("www.test.", "140.82.112.3", 120)], 60, now),
            v6: Family::NoData,
        };
        let Planned::Answer { ttl, .. } = plan(&p, &mid, RecordType::A, false, now) else {
            panic!()
        };
        assert_eq!(ttl, Duration::from_secs(60));
    }

    #[test]
    fn one_denied_address_in_either_family_refuses_the_name_whole() {
        let p = policy("allow_hosts = [\"mixed.test\"]");
        let now = Instant::now();
        let v6 = Record::from_rdata(
            Name::from_ascii("mixed.test.").unwrap(),
            60,
            RData::AAAA("::1".parse::<std::net::Ipv6Addr>().unwrap().into()),
        );
        let names = NameRecords {
            v4: family(vec![a("mixed.test.", "140.82.112.3", 60)], 60, now),
            v6: family(vec![v6], 60, now),
        };
        // Asking for A alone still sees the loopback AAAA.
        assert_eq!(
            plan(&p, &names, RecordType::A, false, now),
            Planned::Denied {
                refused: Refused {
                    reason: egress_policy::DenyReason::AddressDenied,
                    rule: Some(egress_policy::Rule::Builtin("loopback")),
                },
                ip: "::1".parse().unwrap()
            }
        );
    }

    #[test]
    fn resolve_private_addresses_are_answered_but_never_direct() {
        let p = policy(
            "allow_hosts = [{ host = \"reg.test\", ports = [22] }]\nresolve_private = [\"10.0.0.0/8\"]",
        );
        let now = Instant::now();
        let names = NameRecords {
            v4: family(
                vec![
                    a("reg.test.", "10.1.2.3", 60),
                    a("reg.test.", "140.82.112.3", 60),
                ],
                60,
                now,
            ),
            v6: Family::Failed("timeout".into()),
        };
        let Planned::Answer {
            addrs,
            direct_addrs,
            ..
        } = plan(&p, &names, RecordType::A, false, now)
        else {
            panic!()
        };
        assert_eq!(addrs.len(), 2);
        assert_eq!(
            direct_addrs,
            vec!["140.82.112.3".parse::<IpAddr>().unwrap()]
        );
        assert!(matches!(
            plan(&p, &names, RecordType::AAAA, false, now),
            Planned::Failed(_)
        ));
    }

    #[test]
    fn a_lan_entry_opens_its_private_answers_but_never_the_host_or_link_local() {
        let p = policy(
            "allow_hosts = [{ host = \"gpu-box.lan\", ports = [8000], lan = true }]\nresolve_private = [\"192.168.0.0/16\", \"127.0.0.0/8\", \"169.254.0.0/16\"]",
        );
        let now = Instant::now();
        let names = |ips: &[&str]| NameRecords {
            v4: family(
                ips.iter().map(|ip| a("gpu-box.lan.", ip, 60)).collect(),
                60,
                now,
            ),
            v6: Family::NoData,
        };
        let direct = |n: &NameRecords, lan: bool| match plan(&p, n, RecordType::A, lan, now) {
            Planned::Answer { direct_addrs, .. } => direct_addrs,
            other => panic!("{other:?}"),
        };
        let lan = names(&["192.168.1.50"]);
        assert_eq!(
            direct(&lan, true),
            vec!["192.168.1.50".parse::<IpAddr>().unwrap()]
        );
        // The same answer for a name that is not a lan entry's: proxy only, as before.
        assert!(direct(&lan, false).is_empty());
        // Loopback and link-local are answered (resolve_private covers them) but never opened.
        let host = names(&["127.0.0.1", "169.254.169.254", "192.168.1.51"]);
        assert_eq!(
            direct(&host, true),
            vec!["192.168.1.51".parse::<IpAddr>().unwrap()]
        );
        // Outside resolve_private: refused whole, lan or not.
        let other = names(&["10.0.0.5"]);
        assert!(matches!(
            plan(&p, &other, RecordType::A, true, now),
            Planned::Denied { .. }
        ));
        assert!(!lan_direct("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!lan_direct("fe80::1".parse().unwrap()));
        assert!(lan_direct("fd00::5".parse().unwrap()));
    }
}
