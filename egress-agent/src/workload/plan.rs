//! What a container gets, decided from what Docker says about it and its resolved labels: pure
//! decisions, no I/O. [`super::enforce::Enforcer`] carries them out.
use std::net::SocketAddrV4;
use std::sync::Arc;

use super::host_layer::HostEntry;
use super::info::ContainerInfo;
use super::labels::Resolved;
use crate::nft;
use egress_policy::kernel::InterceptAddrs;
use egress_policy::{CidrRule, DENY_ALL, Mode, Policy};

/// The kernel side of a container.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The policy its entry gets (and the name recorded for it).
    pub policy_name: String,
    pub policy: Arc<Policy>,
    /// It needs a proxy listener of its own: opted in, not refused, and its policy proxies.
    pub listener: bool,
    /// Published TCP ports its entry opens.
    pub published: Vec<u16>,
    /// It can't be confined (privileged, dangerous capabilities or mounts): stop it. Reasons.
    pub refuse: Option<String>,
}

/// Decide the kernel side. A refused container is `deny_all` (until it is stopped) and, like
/// one whose labels were refused or one confined for a real key it holds, gets no published
/// ports: all are fail-closed states.
pub fn plan(info: &ContainerInfo, resolved: &Resolved) -> Plan {
    let refuse = (resolved.opted_in() && !info.unconfinable.is_empty())
        .then(|| info.unconfinable.join(", "));
    let confined_for_secret = resolved.opted_in() && resolved.exposure.confine;
    let (policy_name, policy) = if refuse.is_some() || confined_for_secret {
        (DENY_ALL.to_owned(), Arc::new(Policy::deny_all()))
    } else {
        (resolved.name.clone(), resolved.policy.clone())
    };
    let published =
        if refuse.is_some() || confined_for_secret || resolved.invalid_reason().is_some() {
            Vec::new()
        } else {
            info.published_tcp.clone()
        };
    Plan {
        listener: resolved.opted_in() && refuse.is_none() && policy.mode != Mode::DenyAll,
        policy_name,
        policy,
        published,
        refuse,
    }
}

/// The host-layer entry of a running container whose endpoints are known. An opted-in one is
/// enforced: `listener` is its proxy listener — or, for `deny_all` (and refused labels), the
/// proxy address with port 0, which matches no connection. `Err`: an opted-in container that
/// should have a listener has none.
pub fn host_entry(
    opted_in: bool,
    plan: &Plan,
    listener: Option<(SocketAddrV4, InterceptAddrs)>,
    proxy_ip: std::net::Ipv4Addr,
    endpoints: Vec<nft::Endpoint>,
) -> Result<HostEntry, String> {
    if !opted_in {
        return Ok(HostEntry::Unrestricted(endpoints));
    }
    let (listener, intercept) = match listener {
        Some(l) => l,
        None if !plan.listener => (SocketAddrV4::new(proxy_ip, 0), InterceptAddrs::default()),
        None => return Err("no proxy listener".to_owned()),
    };
    // What the kernel redirects to on the proxy address: the transparent listener (TCP) and
    // the DNS responder (UDP and TCP), as the policy uses them.
    let mut redirects = Vec::new();
    let on_proxy = |a: Option<std::net::SocketAddr>| match a {
        Some(std::net::SocketAddr::V4(a)) if a.ip() == listener.ip() => Some(a.port()),
        _ => None,
    };
    if plan.policy.transparent()
        && let Some(port) = on_proxy(intercept.transparent)
    {
        redirects.push(nft::ProxyPort::Tcp(port));
    }
    if plan.policy.answers_dns() {
        if let Some(port) = on_proxy(intercept.dns_udp) {
            redirects.push(nft::ProxyPort::Udp(port));
        }
        if let Some(port) = on_proxy(intercept.dns_tcp) {
            redirects.push(nft::ProxyPort::Tcp(port));
        }
    }
    // An auditing policy refuses nothing (the kernel lets it through and reports it): neither
    // does the host layer.
    let everything = || {
        vec![CidrRule {
            net: ipnet::IpNet::V4(ipnet::Ipv4Net::default()),
            ports: Vec::new(),
        }]
    };
    let allow_cidrs = match plan.policy.mode {
        Mode::AllowAll => everything(),
        Mode::Allowlist if plan.policy.audits() => everything(),
        Mode::Allowlist => plan.policy.allow_cidrs.clone(),
        Mode::DenyAll => Vec::new(),
    };
    let allow_inbound = egress_policy::kernel::inbound_allows(&plan.policy, &plan.published)
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|(net, ports)| CidrRule { net, ports })
        .collect();
    // Direct ports (`{ host, ports }`): to the addresses the agent's DNS answers this container,
    // each for its TTL (an auditing policy is open anyway).
    let (direct_ports, host_ports) = if plan.policy.audits() {
        (Vec::new(), Vec::new())
    } else {
        (plan.policy.direct_ports(), plan.policy.host_service_ports())
    };
    Ok(HostEntry::Enforced(nft::Enforced {
        listener,
        redirects,
        allow_cidrs,
        allow_inbound,
        endpoints,
        direct_ports,
        host_ports,
    }))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::collections::HashMap;

    fn info(labels: &[(&str, &str)], unconfinable: &[&str], published: &[u16]) -> ContainerInfo {
        let mut i = ContainerInfo::from_event(
            "c1",
            &labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<HashMap<_, _>>(),
        );
        i.unconfinable = unconfinable.iter().map(|s| (*s).to_owned()).collect();
        i.published_tcp = published.to_vec();
        i
    }

    fn resolve(i: &ContainerInfo, config: &Config) -> Resolved {
        super::super::labels::resolve(
            i.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            config,
        )
    }

    fn config() -> Config {
        Config::from_toml_str(
            "[policies.ci]\nallow_hosts = [\"github.com\"]\nallow_cidrs = [\"10.0.0.0/8\"]\n\
             [policies.sealed]\nmode = \"deny_all\"\nallow_published_ports = false\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap()
    }

    #[test]
    fn refused_containers_are_deny_all_without_listener_or_published_ports() {
        let c = config();
        let i = info(&[("egress.policy", "ci")], &["privileged"], &[8080]);
        let p = plan(&i, &resolve(&i, &c));
        assert_eq!(p.refuse.as_deref(), Some("privileged"));
        assert_eq!(p.policy.mode, Mode::DenyAll);
        assert!(!p.listener && p.published.is_empty());
    }

    #[test]
    fn a_container_confined_for_a_real_key_is_deny_all_and_runs_on() {
        let c = config();
        let i = info(&[("egress.policy", "ci")], &[], &[8080]);
        let mut r = resolve(&i, &c);
        r.exposure.confine = true;
        let p = plan(&i, &r);
        assert!(p.refuse.is_none());
        assert_eq!(
            (p.policy_name.as_str(), p.policy.mode),
            ("deny_all", Mode::DenyAll)
        );
        assert!(!p.listener && p.published.is_empty());
        // Unlabelled: never confined by the agent.
        let i = info(&[], &[], &[]);
        let mut r = resolve(&i, &c);
        r.exposure.confine = true;
        assert_ne!(plan(&i, &r).policy_name, "deny_all");
    }

    #[test]
    fn invalid_labels_open_no_published_ports() {
        let c = config();
        let i = info(&[("egress.policy", "nope")], &[], &[8080]);
        let p = plan(&i, &resolve(&i, &c));
        assert_eq!(p.policy.mode, Mode::DenyAll);
        assert!(p.published.is_empty() && !p.listener);
    }

    #[test]
    fn host_entries() {
        let c = config();
        let ip = std::net::Ipv4Addr::new(169, 254, 100, 1);
        let l = SocketAddrV4::new(ip, 40000);
        let i = info(&[("egress.policy", "ci")], &[], &[8080]);
        let p = plan(&i, &resolve(&i, &c));
        assert_eq!(
            host_entry(true, &p, None, ip, Vec::new()),
            Err("no proxy listener".to_owned())
        );
        let on = |port| Some(std::net::SocketAddr::V4(SocketAddrV4::new(ip, port)));
        let intercept = InterceptAddrs {
            transparent: on(40001),
            dns_udp: on(40002),
            dns_tcp: on(40003),
        };
        let HostEntry::Enforced(e) =
            host_entry(true, &p, Some((l, intercept)), ip, Vec::new()).unwrap()
        else {
            panic!("enforced expected");
        };
        assert_eq!(e.listener, l);
        assert_eq!(
            e.redirects,
            vec![
                nft::ProxyPort::Tcp(40001),
                nft::ProxyPort::Udp(40002),
                nft::ProxyPort::Tcp(40003)
            ]
        );
        // allow_cidrs without ports count as inbound, and the published port from anywhere.
        let inbound: Vec<String> = e
            .allow_inbound
            .iter()
            .map(|r| format!("{} {:?}", r.net, r.ports))
            .collect();
        assert!(inbound.contains(&"10.0.0.0/8 []".to_owned()), "{inbound:?}");
        assert!(
            inbound.contains(&"0.0.0.0/0 [8080]".to_owned()),
            "{inbound:?}"
        );
        // A sealed policy refuses published ports; deny_all gets the port-0 listener.
        let i = info(&[("egress.policy", "sealed")], &[], &[8080]);
        let p = plan(&i, &resolve(&i, &c));
        let HostEntry::Enforced(e) = host_entry(true, &p, None, ip, Vec::new()).unwrap() else {
            panic!("enforced expected");
        };
        assert_eq!(e.listener.port(), 0);
        assert!(
            e.redirects.is_empty(),
            "deny_all reaches nothing on the proxy address"
        );
        assert!(e.allow_inbound.is_empty() && e.allow_cidrs.is_empty());
        // Unlabelled: known ports, unrestricted.
        let i = info(&[], &[], &[]);
        let p = plan(&i, &resolve(&i, &c));
        assert!(matches!(
            host_entry(false, &p, None, ip, Vec::new()),
            Ok(HostEntry::Unrestricted(_))
        ));
    }
}
