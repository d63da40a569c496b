//! `explain`: for one policy and one destination, what the proxy and the kernel would each do
//! and which rule decides — computed by the decision code they run, not a copy:
//! the proxy side by [`CompiledPolicy::decide_target`] (its [`Decision`] names the rule that
//! decided, reported as `rule` in words and `matched` as data) and
//! [`super::l7::L7Policy::intercepts`], the kernel side by [`KernelPolicy::compile`] (the entry
//! and LPM rules the loader writes) evaluated by [`super::kernel_eval`].
use std::net::{IpAddr, SocketAddr};

use serde::Serialize;
use serde_json::{Value, json};

use super::kernel::{Endpoints, InterceptAddrs, KernelPolicy};
use super::kernel_eval::{self, KernelVerdict, Netns, Transport};
use super::name::Destination;
use super::{CompiledPolicy, Decision, DenyReason, Policy, PortList, Rule};

/// What to explain: `HOST[:PORT]` or `ADDR[:PORT]` (`[v6]:PORT`); the port defaults to 443.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Target {
    pub host: String,
    pub port: u16,
}

/// A malformed target.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TargetError(pub String);

impl Target {
    pub fn parse(s: &str) -> Result<Target, TargetError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(TargetError(
                "empty target: give HOST[:PORT] or ADDR[:PORT]".into(),
            ));
        }
        if let Ok(sa) = s.parse::<SocketAddr>() {
            return Ok(Target {
                host: sa.ip().to_string(),
                port: sa.port(),
            });
        }
        if s.parse::<IpAddr>().is_ok() {
            return Ok(Target {
                host: s.to_owned(),
                port: 443,
            });
        }
        let (host, port) = match s.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => {
                let port = p
                    .parse::<u16>()
                    .map_err(|_| TargetError(format!("{s:?}: the port must be 1-65535")))?;
                (h, port)
            }
            Some(_) => {
                return Err(TargetError(format!(
                    "{s:?}: an IPv6 address with a port is written [ADDR]:PORT"
                )));
            }
            None => (s, 443),
        };
        if port == 0 {
            return Err(TargetError(format!("{s:?}: the port must be 1-65535")));
        }
        Ok(Target {
            host: host.to_owned(),
            port,
        })
    }
}

/// The proxy's verdict, with the rule that decided as words (`rule`) and as data (`matched`,
/// absent when no rule of the policy is behind a refusal; its `event_rule` is the text an event
/// of this decision carries in its `rule`): all from the decision itself.
fn decision(policy: &Policy, port: u16, d: Decision) -> Value {
    let mut v = match d {
        Decision::Allow(_) => json!({ "verdict": "allow" }),
        Decision::Deny(r) => json!({ "verdict": "deny", "reason": r.reason.as_str() }),
        Decision::WouldDeny(r) => json!({ "verdict": "would-deny", "reason": r.reason.as_str() }),
    };
    v["rule"] = json!(proxy_rule(policy, port, d));
    if let Some(rule) = d.rule() {
        v["matched"] = matched(policy, rule);
        v["matched"]["event_rule"] = json!(rule.describe(policy));
    }
    v
}

/// A [`Rule`] as data: the list (`allow_hosts`, `allow_cidrs`, `deny_cidrs`,
/// `resolve_private`, `mode`, `builtin`, `none`), the entry's index and text, its own ports, and
/// for a name where its port was found (`allow_ports`, `entry`; `null`: in neither).
fn matched(policy: &Policy, rule: Rule) -> Value {
    match rule {
        Rule::AllowAll => json!({ "list": "mode", "entry": "allow_all" }),
        Rule::DenyAll => json!({ "list": "mode", "entry": "deny_all" }),
        Rule::Host { index, port } => {
            let e = policy.allow_hosts.get(index);
            json!({
                "list": "allow_hosts",
                "index": index,
                "entry": e.map(|e| e.pattern.to_string()),
                "ports": e.map(|e| e.ports.clone()),
                // The preset the entry came from (null: the policy's own).
                "preset": e.and_then(|e| e.preset.as_ref()).map(|p| p.as_str()),
                "port_in": port.map(|p| match p {
                    PortList::AllowPorts => "allow_ports",
                    PortList::Entry => "entry",
                }),
            })
        }
        Rule::Cidr { index } => {
            let e = policy.allow_cidrs.get(index);
            json!({
                "list": "allow_cidrs",
                "index": index,
                "entry": e.map(|e| e.net.to_string()),
                "ports": e.map(|e| e.ports.clone()),
            })
        }
        Rule::DenyCidr { index } => json!({
            "list": "deny_cidrs",
            "index": index,
            "entry": policy.deny_cidrs.get(index).map(ToString::to_string),
        }),
        Rule::ResolvePrivate { index } => json!({
            "list": "resolve_private",
            "index": index,
            "entry": policy.resolve_private.get(index).map(ToString::to_string),
        }),
        Rule::Builtin(label) => json!({ "list": "builtin", "entry": label }),
        Rule::Unlisted => json!({ "list": "none" }),
        Rule::Request { index } => json!({
            "list": "request_rules",
            "index": index,
            "entry": policy.request_rules.get(index).map(ToString::to_string),
        }),
    }
}

/// The proxy's rule for a decision, in words: the rule the decision names.
fn proxy_rule(policy: &Policy, port: u16, d: Decision) -> String {
    match d {
        Decision::Allow(rule) => match rule {
            Rule::AllowAll => {
                "allow_all: any name and port (the built-in deny list still applies to every address the name resolves to)".to_owned()
            }
            Rule::Host { port: Some(list), .. } => format!(
                "{} on port {port} ({}; every address the name resolves to is then checked against the deny lists)",
                rule.describe(policy),
                match list {
                    PortList::AllowPorts => "in allow_ports",
                    PortList::Entry => "one of the entry's own ports",
                }
            ),
            Rule::Cidr { .. } => format!("{} covers this address and port", rule.describe(policy)),
            _ => rule.describe(policy),
        },
        Decision::Deny(r) | Decision::WouldDeny(r) => match (r.reason, r.rule) {
            (DenyReason::PolicyDenyAll, _) => "deny_all refuses everything".to_owned(),
            (DenyReason::HostNotAllowed, _) => "no allow_hosts entry matches".to_owned(),
            (DenyReason::PortNotAllowed, Some(rule @ Rule::Host { .. })) => format!(
                "{} matches, but port {port} is neither in allow_ports {:?} nor in the entry's own ports",
                rule.describe(policy),
                policy.allow_ports
            ),
            (DenyReason::PortNotAllowed, Some(rule @ Rule::Cidr { .. })) => format!(
                "{} covers the address, but not port {port}",
                rule.describe(policy)
            ),
            (DenyReason::IpLiteralNotAllowed, _) => {
                "an IP address in an allowlist needs an allow_cidrs entry".to_owned()
            }
            (DenyReason::AddressDenied, rule) => format!(
                "the address is on the built-in deny list{} (loopback, private, link-local, metadata, ...)",
                match rule {
                    Some(Rule::Builtin(label)) => format!(" ({label})"),
                    _ => String::new(),
                }
            ),
            (DenyReason::AddressDeniedByPolicy, Some(rule)) => {
                format!("the address is in {}", rule.describe(policy))
            }
            (DenyReason::AddressDeniedByPolicy, None) => "the address is in deny_cidrs".to_owned(),
            (other, _) => other.as_str().to_owned(),
        },
    }
}

fn kernel(v: &KernelVerdict) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// How the policy was chosen (`--policy`: asked for by name).
#[derive(Debug, Clone, Serialize)]
pub struct Chosen {
    pub name: String,
    pub why: String,
}

/// The proxy endpoint(s) a confined socket is redirected from (`proxy.endpoint`,
/// `proxy.endpoint_v6`).
#[derive(Debug, Clone, Copy)]
pub struct ProxyEndpoint {
    pub endpoint: SocketAddr,
    pub endpoint_v6: Option<SocketAddr>,
}

/// Explain `target` under `policy` (chosen as `chosen`), with the proxy endpoint `config`.
/// `netns`: where the client socket lives (`own` for a container, `host` for `exec`).
pub fn explain(
    config: ProxyEndpoint,
    chosen: &Chosen,
    policy: &Policy,
    target: &Target,
    netns: Netns,
) -> Value {
    let compiled = CompiledPolicy::new(policy);
    let endpoints = endpoints(config);
    let kp = KernelPolicy::compile(policy, endpoints, &[])
        .and_then(|k| k.with_host_services(policy, &host_addrs(netns)));
    // An address as written (`::1` too, without brackets) is an IP destination.
    let dest = match target.host.parse::<IpAddr>() {
        Ok(ip) => Ok(Destination::Ip(ip)),
        Err(_) => Destination::parse(&target.host),
    };
    let port = target.port;
    let base = json!({
        "policy": { "name": chosen.name, "why": chosen.why, "badge": policy.badge(),
                    "audit": policy.audits() },
        "target": target,
        "authority": "the kernel programs and the proxy decide at run time; this is their decision code run on the compiled policy",
    });
    let mut out = base;
    if let Some(h) = host_services(policy) {
        out["host_services"] = h;
    }
    let dest = match dest {
        Ok(d) => d,
        Err(e) => {
            let r = DenyReason::from(e);
            out["proxy"] = json!({ "verdict": "deny", "reason": r.as_str(),
                                   "rule": "not a host name the proxy accepts" });
            out["summary"] = json!(format!("refused: {} ({})", target.host, r.as_str()));
            return out;
        }
    };
    let kp = match kp {
        Ok(k) => k,
        Err(e) => {
            out["kernel"] = json!({ "verdict": "deny", "reason": "policy-not-loadable", "rule": e.to_string() });
            out["summary"] = json!(format!("the kernel can't load this policy: {e}"));
            return out;
        }
    };
    let via_proxy = compiled.decide_target(&dest, port);
    let mut proxy = decision(policy, port, via_proxy);
    proxy["intercepted"] = json!(compiled.l7().intercepts(&dest, port));
    let endpoint_verdict = kernel_eval::connect(&kp, config.endpoint, Transport::Tcp, netns);
    let summary;
    match &dest {
        Destination::Ip(ip) => {
            let dst = SocketAddr::new(*ip, port);
            let tcp = kernel_eval::connect(&kp, dst, Transport::Tcp, netns);
            let udp = kernel_eval::connect(&kp, dst, Transport::Udp, netns);
            let direct_ok = matches!(tcp, KernelVerdict::Allow { .. });
            let redirected = matches!(tcp, KernelVerdict::Redirect { .. });
            let audited = matches!(tcp, KernelVerdict::WouldDeny { .. });
            out["kernel"] = json!({
                "direct_tcp": kernel(&tcp),
                "direct_udp": kernel(&udp),
                "to_proxy_endpoint": kernel(&endpoint_verdict),
            });
            summary = match (direct_ok, via_proxy) {
                (true, _) => format!("allowed directly by the kernel ({})", rule_of(&tcp)),
                _ if redirected => format!(
                    "redirected by the kernel ({}); the agent then decides on the name the client sends, not on this address",
                    rule_of(&tcp)
                ),
                _ if audited => format!(
                    "audit: the kernel lets it through and records a would-deny ({})",
                    reason_of(&tcp)
                ),
                (false, Decision::Allow(_)) => {
                    "refused directly by the kernel; allowed through the proxy (CONNECT to the address)".to_owned()
                }
                (false, Decision::WouldDeny(r)) => format!(
                    "audit: let through the proxy and recorded as would-deny ({})",
                    r.reason.as_str()
                ),
                (false, Decision::Deny(r)) => format!(
                    "refused: directly by the kernel ({}), and by the proxy ({})",
                    reason_of(&tcp),
                    r.reason.as_str()
                ),
            };
        }
        Destination::Name(_) => {
            out["kernel"] = json!({
                "to_proxy_endpoint": kernel(&endpoint_verdict),
                "direct": "the kernel sees addresses, not names: a name is reached through the proxy (or, for allow_hosts entries with their own ports, at the addresses the agent's DNS answered, until their TTL runs out)",
            });
            summary = match via_proxy {
                Decision::Allow(_) => format!(
                    "allowed through the proxy ({})",
                    proxy["rule"].as_str().unwrap_or("")
                ),
                Decision::WouldDeny(r) => format!(
                    "audit: let through and recorded as would-deny ({})",
                    r.reason.as_str()
                ),
                Decision::Deny(r) => format!("refused by the proxy ({})", r.reason.as_str()),
            };
        }
    }
    out["proxy"] = proxy;
    out["summary"] = json!(summary);
    out
}

fn rule_of(v: &KernelVerdict) -> String {
    match v {
        KernelVerdict::Allow { rule }
        | KernelVerdict::Redirect { rule }
        | KernelVerdict::SameTreeOnly { rule, .. }
        | KernelVerdict::Deny { rule, .. }
        | KernelVerdict::WouldDeny { rule, .. } => rule.clone(),
    }
}

fn reason_of(v: &KernelVerdict) -> &'static str {
    match v {
        KernelVerdict::Deny { reason, .. } | KernelVerdict::WouldDeny { reason, .. } => reason,
        _ => "allowed",
    }
}

/// Where a workload reaches its host, as far as `explain` can know: loopback in the host's
/// network namespace; a bridge workload's gateway is learned at run time (none here).
fn host_addrs(netns: Netns) -> Vec<IpAddr> {
    match netns {
        Netns::Host => super::kernel::HOST_NETNS_HOST.to_vec(),
        Netns::Own => Vec::new(),
    }
}

/// The policy's host services, said where they open (`None` without any).
fn host_services(policy: &Policy) -> Option<Value> {
    let ports = policy.host_service_ports();
    (!ports.is_empty()).then(|| {
        json!({
            "ports": ports,
            "at": "the workload's own host only: its bridge's gateway (what the agent's DNS answers for host.docker.internal), loopback under exec or --network host; TCP and UDP",
        })
    })
}

/// The proxy endpoint(s), with a placeholder listener (the real one is per cgroup): what
/// [`KernelPolicy::compile`] needs to evaluate a policy without a cgroup (`explain`, `replay`).
pub fn endpoints(config: ProxyEndpoint) -> Endpoints {
    let listener = |ep: SocketAddr| Some(SocketAddr::new(ep.ip(), 0));
    let (e4, e6) = match config.endpoint {
        SocketAddr::V4(_) => (Some(config.endpoint), config.endpoint_v6),
        SocketAddr::V6(_) => (None, Some(config.endpoint)),
    };
    // Interception sockets live next to the listener; the policy decides whether the kernel
    // uses them (`KernelPolicy::transparent` / `dns`).
    let intercept = |l: Option<SocketAddr>| InterceptAddrs {
        transparent: l,
        dns_udp: l,
        dns_tcp: l,
    };
    Endpoints {
        endpoint4: e4,
        listener4: e4.and_then(listener),
        endpoint6: e6,
        listener6: e6.and_then(listener),
        intercept4: intercept(e4.and_then(listener)),
        intercept6: intercept(e6.and_then(listener)),
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn policy(name: &str) -> Policy {
        match name {
            crate::ALLOW_ALL => return Policy::allow_all(),
            crate::DENY_ALL => return Policy::deny_all(),
            crate::AUDIT => return Policy::audit(),
            _ => {}
        }
        crate::testing::policy(match name {
            "ci" => {
                r#"
allow_hosts = ["github.com", "*.githubusercontent.com", { host = "ssh.github.com", ports = [22] }]
allow_cidrs = [{ cidr = "10.0.0.0/8", ports = [5432] }]
deny_cidrs = ["192.0.2.0/24"]
"#
            }
            "watch" => "allow_hosts = [\"github.com\"]\nenforce = \"audit\"",
            "agent" => "presets = [\"anthropic\"]\nallow_hosts = [\"example.com\"]",
            "local" => "allow_host_services = [{ port = 11434 }]",
            other => panic!("no test policy {other}"),
        })
    }

    fn run(policy_name: &str, target: &str) -> Value {
        run_in(policy_name, target, Netns::Own)
    }

    fn run_in(policy_name: &str, target: &str, netns: Netns) -> Value {
        let chosen = Chosen {
            name: policy_name.to_owned(),
            why: "asked for".to_owned(),
        };
        explain(
            ProxyEndpoint {
                endpoint: "169.254.100.1:3128".parse().unwrap(),
                endpoint_v6: None,
            },
            &chosen,
            &policy(policy_name),
            &Target::parse(target).unwrap(),
            netns,
        )
    }

    #[test]
    fn host_services_are_said_and_open_at_loopback_in_the_hosts_namespace() {
        let exec = run_in("local", "127.0.0.1:11434", Netns::Host);
        assert_eq!(exec["host_services"]["ports"], json!([11434]), "{exec:#}");
        assert!(
            exec["summary"]
                .as_str()
                .is_some_and(|s| s.starts_with("allowed directly by the kernel")),
            "{exec:#}"
        );
        let other_port = run_in("local", "127.0.0.1:11435", Netns::Host);
        assert!(
            other_port["summary"]
                .as_str()
                .is_some_and(|s| s.starts_with("refused")),
            "{other_port:#}"
        );
        // A bridge workload's gateway is learned at run time: not opened here, but said.
        let bridge = run("local", "172.17.0.1:11434");
        assert!(
            bridge["host_services"]["at"]
                .as_str()
                .is_some_and(|s| s.contains("gateway"))
        );
    }

    #[test]
    fn targets_parse_with_default_port() {
        assert_eq!(
            Target::parse("github.com").unwrap(),
            Target {
                host: "github.com".into(),
                port: 443
            }
        );
        assert_eq!(Target::parse("github.com:22").unwrap().port, 22);
        assert_eq!(
            Target::parse("[::1]:80").unwrap(),
            Target {
                host: "::1".into(),
                port: 80
            }
        );
        assert_eq!(Target::parse("::1").unwrap().port, 443);
        assert!(Target::parse("github.com:0").is_err());
        assert!(Target::parse("github.com:x").is_err());
        assert!(Target::parse("").is_err());
    }

    #[test]
    fn names_are_decided_by_the_proxy_with_the_matching_entry() {
        let v = run("ci", "raw.githubusercontent.com:443");
        assert_eq!(v["proxy"]["verdict"], "allow", "{v:#}");
        assert!(
            v["proxy"]["rule"]
                .as_str()
                .unwrap()
                .contains("*.githubusercontent.com"),
            "{v:#}"
        );
        assert_eq!(
            v["kernel"]["to_proxy_endpoint"]["verdict"], "redirect",
            "{v:#}"
        );
        assert_eq!(
            v["proxy"]["matched"],
            json!({ "list": "allow_hosts", "index": 1, "entry": "*.githubusercontent.com",
                    "ports": [], "port_in": "allow_ports", "preset": null,
                    "event_rule": "allow_hosts *.githubusercontent.com" }),
            "{v:#}"
        );
        let v = run("ci", "github.com:80");
        assert_eq!(v["proxy"]["reason"], "port-not-allowed", "{v:#}");
        assert_eq!(v["proxy"]["matched"]["entry"], "github.com", "{v:#}");
        assert_eq!(v["proxy"]["matched"]["port_in"], Value::Null, "{v:#}");
        assert!(
            v["proxy"]["rule"]
                .as_str()
                .unwrap()
                .starts_with("allow_hosts github.com matches, but port 80"),
            "{v:#}"
        );
        let v = run("ci", "ssh.github.com:22");
        assert_eq!(v["proxy"]["verdict"], "allow", "{v:#}");
        assert_eq!(v["proxy"]["matched"]["index"], 2, "{v:#}");
        assert_eq!(v["proxy"]["matched"]["port_in"], "entry", "{v:#}");
        assert!(
            v["proxy"]["rule"].as_str().unwrap().starts_with(
                "allow_hosts ssh.github.com (ports 22) on port 22 (one of the entry's own ports"
            ),
            "{v:#}"
        );
        let v = run("ci", "example.com");
        assert_eq!(v["proxy"]["reason"], "host-not-allowed", "{v:#}");
        assert!(v["proxy"].get("matched").is_none(), "{v:#}");
        assert!(
            v["summary"]
                .as_str()
                .unwrap()
                .starts_with("refused by the proxy"),
            "{v:#}"
        );
    }

    #[test]
    fn addresses_get_both_the_kernel_and_the_proxy_view() {
        let v = run("ci", "10.1.2.3:5432");
        assert_eq!(v["kernel"]["direct_tcp"]["verdict"], "allow", "{v:#}");
        assert!(
            v["summary"]
                .as_str()
                .unwrap()
                .contains("allowed directly by the kernel"),
            "{v:#}"
        );
        let v = run("ci", "10.1.2.3:22");
        assert_eq!(
            v["kernel"]["direct_tcp"]["reason"], "kernel-destination-not-allowed",
            "{v:#}"
        );
        assert_eq!(v["proxy"]["reason"], "port-not-allowed", "{v:#}");
        assert_eq!(
            v["proxy"]["rule"],
            "allow_cidrs 10.0.0.0/8 (ports 5432) covers the address, but not port 22",
            "{v:#}"
        );
        // deny_cidrs: the proxy refuses (the kernel has no rule for it either).
        let v = run("ci", "192.0.2.1:443");
        assert_eq!(v["proxy"]["reason"], "address-denied-by-policy", "{v:#}");
        assert_eq!(
            v["proxy"]["matched"],
            json!({ "list": "deny_cidrs", "index": 0, "entry": "192.0.2.0/24",
                    "event_rule": "deny_cidrs 192.0.2.0/24" }),
            "{v:#}"
        );
        let v = run("ci", "10.1.2.3:5432");
        assert_eq!(v["proxy"]["verdict"], "allow", "{v:#}");
        assert_eq!(v["proxy"]["matched"]["list"], "allow_cidrs", "{v:#}");
        let v = run("ci", "8.8.8.8:443");
        assert_eq!(v["proxy"]["reason"], "ip-literal-not-allowed", "{v:#}");
    }

    #[test]
    fn audit_policies_say_would_deny_and_numeric_forms_are_refused() {
        let v = run("watch", "example.com");
        assert_eq!(v["proxy"]["verdict"], "would-deny", "{v:#}");
        assert_eq!(v["policy"]["badge"], "audit");
        let v = run("ci", "0x7f.1:443");
        assert_eq!(v["proxy"]["reason"], "numeric-ip-form", "{v:#}");
        let v = run("allow_all", "10.0.0.1:22");
        assert_eq!(v["kernel"]["direct_tcp"]["verdict"], "allow", "{v:#}");
    }

    #[test]
    fn a_preset_entry_is_named_with_its_preset() {
        let v = run("agent", "api.anthropic.com:443");
        assert_eq!(v["proxy"]["matched"]["preset"], "anthropic", "{v:#}");
        assert_eq!(
            v["proxy"]["matched"]["event_rule"], "allow_hosts api.anthropic.com (preset anthropic)",
            "{v:#}"
        );
        let own = run("agent", "example.com:443");
        assert_eq!(own["proxy"]["matched"]["preset"], Value::Null, "{own:#}");
    }
}
