//! Every transition of a recorded flow under a proposed policy: allowed → denied, denied →
//! allowed, unchanged both ways, audit, DNS, an address refused at dial time (explicit and
//! transparent), IP literals, the kernel's direct and inbound connections, request rules, and
//! what is not replayable.
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use super::command::{About, to_json, to_text};
use super::*;
use crate::config::Config;
use crate::store::query::Flow;

const EP: &str = "169.254.100.1:3128";

fn proposed(toml: &str) -> Proposed {
    let c = Config::from_toml_str(&format!("[policies.p]\n{toml}"), Path::new("t.toml")).unwrap();
    let endpoint = ProxyEndpoint {
        endpoint: EP.parse().unwrap(),
        endpoint_v6: None,
    };
    Proposed::new("p", c.policy("p").unwrap(), endpoint)
}

/// A proxy flow to `host` (or, when it parses as one, an IP literal) on `port`.
fn proxy(verdict: Verdict, dest: &str, port: u16, reason: &str, rule: Option<&str>) -> Flow {
    let (host, ip) = match dest.parse::<IpAddr>() {
        Ok(ip) => (String::new(), ip.to_string()),
        Err(_) => (dest.to_owned(), String::new()),
    };
    Flow {
        verdict,
        source: "proxy".into(),
        policy: "p".into(),
        container_id: "c0ffee".into(),
        container_name: "job".into(),
        labels: BTreeMap::from([("run".to_owned(), "42".to_owned())]),
        host,
        ip,
        port,
        protocol: "connect".into(),
        reason: reason.into(),
        rule: rule.map(str::to_owned),
        count: 1,
        first_seen: UNIX_EPOCH + Duration::from_secs(1000),
        last_seen: UNIX_EPOCH + Duration::from_secs(2000),
    }
}

fn allowed(host: &str, port: u16, rule: &str) -> Flow {
    proxy(Verdict::Allow, host, port, "allowed", Some(rule))
}

fn kernel(verdict: Verdict, ip: &str, port: u16, protocol: &str, reason: &str) -> Flow {
    let mut f = proxy(verdict, ip, port, reason, None);
    f.source = "kernel".into();
    f.protocol = protocol.into();
    f.labels.insert("hook".into(), "connect4".into());
    f
}

/// Replay `flows` under `proposed`, listing every destination.
fn replay<'f>(flows: impl IntoIterator<Item = &'f Flow>, proposed: &Proposed) -> Report {
    replay_listing(flows, proposed, 0)
}

fn replay_listing<'f>(
    flows: impl IntoIterator<Item = &'f Flow>,
    proposed: &Proposed,
    limit: usize,
) -> Report {
    let mut r = Replayer::new(proposed);
    for f in flows {
        r.add(&f.view());
    }
    r.finish(limit)
}

/// The one decision of one flow: its bucket and what it now is.
fn one(p: &Proposed, f: Flow) -> (Bucket, Entry) {
    let r = replay([&f], p);
    assert_eq!(r.destinations.len(), 1, "{r:#?}");
    let e = r.destinations[0].clone();
    (e.bucket, e)
}

fn unreplayable(p: &Proposed, f: Flow) -> Unreplayed {
    let r = replay([&f], p);
    assert!(r.destinations.is_empty(), "{r:#?}");
    assert_eq!(
        r.totals.not_replayable,
        Count {
            flows: 1,
            events: f.count
        }
    );
    r.not_replayable[0].clone()
}

#[test]
fn allowed_traffic_a_tighter_policy_refuses_is_newly_denied_with_both_rules() {
    let tighter = proposed("allow_hosts = [\"github.com\"]");
    let (b, e) = one(
        &tighter,
        allowed("api.github.com", 443, "allow_hosts *.github.com"),
    );
    assert_eq!(b, Bucket::NewlyDenied);
    assert_eq!(e.destination, "api.github.com:443");
    assert_eq!(e.was[0].rule.as_deref(), Some("allow_hosts *.github.com"));
    assert_eq!(
        e.now,
        Decided {
            verdict: Verdict::Deny,
            reason: Some("host-not-allowed"),
            rule: None
        }
    );
    // A port the proposed entry lacks: the entry that matched is named.
    let (b, e) = one(
        &tighter,
        allowed("github.com", 22, "allow_hosts github.com (ports 22)"),
    );
    assert_eq!(b, Bucket::NewlyDenied);
    assert_eq!(e.now.reason, Some("port-not-allowed"));
    assert_eq!(e.now.rule.as_deref(), Some("allow_hosts github.com"));
}

#[test]
fn refused_traffic_a_looser_policy_allows_is_newly_allowed() {
    let looser = proposed("allow_hosts = [\"github.com\", \"pypi.org\"]");
    let f = proxy(Verdict::Deny, "pypi.org", 443, "host-not-allowed", None);
    let (b, e) = one(&looser, f);
    assert_eq!(b, Bucket::NewlyAllowed);
    assert_eq!(e.now.verdict, Verdict::Allow);
    assert_eq!(e.now.rule.as_deref(), Some("allow_hosts pypi.org"));
    // A would-deny passed already: allowed now is unchanged.
    let f = proxy(
        Verdict::WouldDeny,
        "pypi.org",
        443,
        "host-not-allowed",
        None,
    );
    assert_eq!(one(&looser, f).0, Bucket::UnchangedAllowed);
}

#[test]
fn the_same_decision_is_unchanged_either_way() {
    let p = proposed("allow_hosts = [\"github.com\"]");
    let (b, e) = one(&p, allowed("github.com", 443, "allow_hosts github.com"));
    assert_eq!(b, Bucket::UnchangedAllowed);
    assert_eq!(e.now.rule.as_deref(), Some("allow_hosts github.com"));
    let f = proxy(Verdict::Deny, "evil.test", 443, "host-not-allowed", None);
    assert_eq!(one(&p, f).0, Bucket::UnchangedDenied);
    let deny_all = proposed("mode = \"deny_all\"");
    let f = allowed("github.com", 443, "allow_hosts github.com");
    let (b, e) = one(&deny_all, f);
    assert_eq!(
        (b, e.now.reason),
        (Bucket::NewlyDenied, Some("policy-deny-all"))
    );
    assert_eq!(e.now.rule.as_deref(), Some("mode deny_all"));
}

#[test]
fn an_auditing_proposal_is_would_deny_but_never_past_allow_all() {
    let audit = proposed("allow_hosts = [\"github.com\"]\nenforce = \"audit\"");
    let (b, e) = one(
        &audit,
        allowed("api.github.com", 443, "allow_hosts *.github.com"),
    );
    assert_eq!(b, Bucket::WouldDeny);
    assert_eq!(e.now.verdict, Verdict::WouldDeny);
    assert_eq!(e.now.reason, Some("host-not-allowed"));
    // Refused before and audited now: still its own bucket.
    let f = proxy(Verdict::Deny, "evil.test", 443, "host-not-allowed", None);
    assert_eq!(one(&audit, f).0, Bucket::WouldDeny);
    // The built-in deny list stays closed in audit (as under allow_all).
    let f = proxy(Verdict::Deny, "127.0.0.1", 80, "address-denied", None);
    let (b, e) = one(&audit, f);
    assert_eq!(
        (b, e.now.reason),
        (Bucket::UnchangedDenied, Some("address-denied"))
    );
    assert_eq!(
        e.now.rule.as_deref(),
        Some("the built-in deny list (loopback)")
    );
    let r = replay(
        [&allowed("github.com", 443, "allow_hosts github.com")],
        &audit,
    );
    assert!(r.audit);
}

#[test]
fn dns_queries_are_decided_as_the_responder_decides_them() {
    let dns = |verdict, host: &str, ip: &str, reason: &str| {
        let mut f = proxy(verdict, host, 53, reason, None);
        f.protocol = "dns".into();
        f.ip = ip.into();
        f
    };
    let p = proposed("allow_hosts = [\"evil.test\"]");
    let (b, e) = one(&p, dns(Verdict::Deny, "evil.test", "", "host-not-allowed"));
    assert_eq!(
        (b, e.destination.as_str()),
        (Bucket::NewlyAllowed, "evil.test (DNS)")
    );
    assert_eq!(e.now.rule.as_deref(), Some("allow_hosts evil.test"));
    // An answer on the built-in list: refused, unless the name may resolve privately.
    let f = dns(Verdict::Deny, "evil.test", "10.0.0.5", "address-denied");
    let (b, e) = one(&p, f.clone());
    assert_eq!(
        (b, e.now.reason),
        (Bucket::UnchangedDenied, Some("address-denied"))
    );
    assert_eq!(e.destination, "evil.test (DNS, answer 10.0.0.5)");
    let private = proposed("allow_hosts = [\"evil.test\"]\nresolve_private = [\"10.0.0.0/8\"]");
    assert_eq!(one(&private, f).0, Bucket::NewlyAllowed);
    // A query type no policy answers.
    let u = unreplayable(&p, dns(Verdict::Deny, "evil.test", "", "dns-type-refused"));
    assert_eq!(u.reason, "dns-type-refused");
    assert!(u.why.contains("every policy"), "{}", u.why);
}

#[test]
fn an_address_refused_at_dial_time_is_decided_again_by_the_dial() {
    let mut f = proxy(
        Verdict::Deny,
        "internal.example",
        443,
        "address-denied",
        Some("the built-in deny list (rfc1918)"),
    );
    f.ip = "10.0.0.5".into();
    let plain = proposed("allow_hosts = [\"internal.example\"]");
    let (b, e) = one(&plain, f.clone());
    assert_eq!(b, Bucket::UnchangedDenied);
    assert_eq!(e.destination, "internal.example:443 (address 10.0.0.5)");
    assert_eq!(
        e.now.rule.as_deref(),
        Some("the built-in deny list (rfc1918)")
    );
    let private =
        proposed("allow_hosts = [\"internal.example\"]\nresolve_private = [\"10.0.0.0/8\"]");
    let (b, e) = one(&private, f.clone());
    // Allowed: the name's rule, as an allow event of the proxy names it.
    assert_eq!(b, Bucket::NewlyAllowed);
    assert_eq!(e.now.rule.as_deref(), Some("allow_hosts internal.example"));
    // A refused name is refused before any dial.
    let other = proposed("allow_hosts = [\"other.example\"]\nresolve_private = [\"10.0.0.0/8\"]");
    assert_eq!(
        one(&other, f.clone()).1.now.reason,
        Some("host-not-allowed")
    );
    // deny_cidrs is checked first.
    let denied = proposed("allow_hosts = [\"internal.example\"]\ndeny_cidrs = [\"10.0.0.0/24\"]");
    let e = one(&denied, f.clone()).1;
    assert_eq!(e.now.reason, Some("address-denied-by-policy"));
    assert_eq!(e.now.rule.as_deref(), Some("deny_cidrs 10.0.0.0/24"));
    // Transparent: `ip` is where the client was going; the dial's address is `denied_address`.
    let mut t = f;
    t.protocol = "tls".into();
    t.ip = "203.0.113.9".into();
    t.labels.insert("denied_address".into(), "10.0.0.5".into());
    let e = one(&private, t).1;
    assert_eq!(e.destination, "internal.example:443 (address 10.0.0.5)");
    assert_eq!(e.bucket, Bucket::NewlyAllowed);
}

#[test]
fn a_name_refused_before_its_dial_keeps_no_address() {
    // A transparent refusal of the name names the original destination in `ip`: never dialled
    // by the proxy, so not an address to decide.
    let mut f = proxy(Verdict::Deny, "pypi.org", 443, "host-not-allowed", None);
    f.protocol = "tls".into();
    f.ip = "151.101.0.223".into();
    let p = proposed("allow_hosts = [\"pypi.org\"]\ndeny_cidrs = [\"151.101.0.0/16\"]");
    let r = replay([&f], &p);
    assert_eq!(r.destinations[0].bucket, Bucket::NewlyAllowed);
    assert_eq!(r.destinations[0].destination, "pypi.org:443");
    // Allowed by the name alone: said in a note.
    assert!(
        r.notes[0].contains("replayed by the name alone"),
        "{:?}",
        r.notes
    );
}

#[test]
fn ip_literals_are_decided_as_addresses() {
    let f = proxy(
        Verdict::Deny,
        "1.2.3.4",
        443,
        "ip-literal-not-allowed",
        None,
    );
    let p = proposed(
        "allow_hosts = [\"github.com\"]\nallow_cidrs = [{ cidr = \"1.2.3.4/32\", ports = [443] }]",
    );
    let (b, e) = one(&p, f.clone());
    assert_eq!(
        (b, e.destination.as_str()),
        (Bucket::NewlyAllowed, "1.2.3.4:443")
    );
    assert_eq!(
        e.now.rule.as_deref(),
        Some("allow_cidrs 1.2.3.4/32 (ports 443)")
    );
    let other_port = proposed("allow_cidrs = [{ cidr = \"1.2.3.4/32\", ports = [8443] }]");
    let e = one(&other_port, f).1;
    assert_eq!(e.now.reason, Some("port-not-allowed"));
    assert_eq!(
        e.now.rule.as_deref(),
        Some("allow_cidrs 1.2.3.4/32 (ports 8443)")
    );
    let v6 = proxy(
        Verdict::Allow,
        "2606:4700::1111",
        443,
        "allowed",
        Some("mode allow_all"),
    );
    let e = one(&proposed("allow_hosts = [\"x.test\"]"), v6).1;
    assert_eq!(
        (e.bucket, e.destination.as_str(), e.now.reason),
        (
            Bucket::NewlyDenied,
            "[2606:4700::1111]:443",
            Some("ip-literal-not-allowed")
        )
    );
}

#[test]
fn kernel_direct_connections_are_decided_by_the_kernels_evaluation() {
    let f = kernel(
        Verdict::Deny,
        "10.1.2.3",
        5432,
        "tcp",
        "kernel-destination-not-allowed",
    );
    let p = proposed("allow_cidrs = [{ cidr = \"10.1.2.0/24\", ports = [5432] }]");
    let (b, e) = one(&p, f.clone());
    assert_eq!(
        (b, e.source, e.destination.as_str()),
        (Bucket::NewlyAllowed, "kernel", "10.1.2.3:5432/tcp")
    );
    assert_eq!(
        e.now.rule.as_deref(),
        Some("allow_cidrs 10.1.2.0/24 (ports 5432)")
    );
    // An audited direct connection that the kernel allowed, under a policy that no longer has it.
    let mut a = kernel(Verdict::Allow, "10.1.2.3", 5432, "tcp", "allowed");
    a.count = 7;
    let tight = proposed("allow_hosts = [\"github.com\"]");
    let (b, e) = one(&tight, a);
    assert_eq!((b, e.events), (Bucket::NewlyDenied, 7));
    assert_eq!(e.now.reason, Some("kernel-destination-not-allowed"));
    // UDP, by an entry without ports.
    let u = kernel(Verdict::Allow, "10.1.2.3", 5000, "udp", "allowed");
    let any_port = proposed("allow_cidrs = [\"10.0.0.0/8\"]");
    let e = one(&any_port, u).1;
    assert_eq!(
        (e.bucket, e.now.rule.as_deref()),
        (
            Bucket::UnchangedAllowed,
            Some("allow_cidrs 10.0.0.0/8 (all ports)")
        )
    );
    // The host's loopback under exec: refused for another tree's server.
    let mut l = kernel(
        Verdict::Deny,
        "127.0.0.1",
        8080,
        "tcp",
        "kernel-host-loopback",
    );
    l.container_id = "exec:4242".into();
    let (b, e) = one(&tight, l);
    assert_eq!(
        (b, e.now.reason),
        (Bucket::UnchangedDenied, Some("kernel-host-loopback"))
    );
    // Sent to the proxy endpoint: the proxy decides, on a name the kernel never saw.
    let ep = kernel(Verdict::Allow, "169.254.100.1", 3128, "tcp", "allowed");
    assert_eq!(unreplayable(&tight, ep).why, decide::WHY_REDIRECTED);
}

#[test]
fn inbound_connections_are_decided_by_the_inbound_rules() {
    let mut f = kernel(
        Verdict::Deny,
        "192.168.1.9",
        22,
        "tcp",
        "kernel-inbound-not-allowed",
    );
    f.labels.insert("direction".into(), "inbound".into());
    f.labels.insert("hook".into(), "skb_ingress".into());
    let open = proposed("allow_inbound = [{ cidr = \"192.168.1.0/24\", ports = [22] }]");
    let (b, e) = one(&open, f.clone());
    assert_eq!(
        (b, e.destination.as_str()),
        (
            Bucket::NewlyAllowed,
            "inbound from 192.168.1.9 to port 22/tcp"
        )
    );
    assert_eq!(
        e.now.rule.as_deref(),
        Some("inbound allow 192.168.1.0/24 (ports 22)")
    );
    let closed = proposed(
        "allow_inbound = [{ cidr = \"192.168.1.0/24\", ports = [80] }]\nallow_published_ports = false",
    );
    let e = one(&closed, f.clone()).1;
    assert_eq!(
        (e.bucket, e.now.reason),
        (Bucket::UnchangedDenied, Some("kernel-inbound-not-allowed"))
    );
    // Published ports are a container's, not recorded: said when the policy would open them.
    let published = proposed("allow_hosts = [\"github.com\"]");
    let r = replay([&f], &published);
    assert!(
        r.notes.iter().any(|n| n.contains("published ports")),
        "{:?}",
        r.notes
    );
    assert!(replay([&f], &closed).notes.is_empty());
}

#[test]
fn request_refusals_are_decided_by_the_request_rules_on_method_and_path() {
    let req = |reason: &str, method: &str, path: &str| {
        let mut f = proxy(Verdict::Deny, "api.test", 443, reason, None);
        f.protocol = "https".into();
        f.labels.insert("method".into(), method.into());
        f.labels.insert("path".into(), path.into());
        f
    };
    let rules = |action: &str, path: &str| {
        proposed(&format!(
            "allow_hosts = [\"api.test\"]\n[[policies.p.request_rules]]\nhost = \"api.test\"\naction = \"{action}\"\npath = \"{path}\"\n"
        ))
    };
    let f = req("request-denied-by-rule", "DELETE", "/v1/files/1");
    let (b, e) = one(&rules("deny", "/admin/**"), f.clone());
    assert_eq!(
        (b, e.destination.as_str()),
        (Bucket::NewlyAllowed, "api.test:443 DELETE /v1/files/1")
    );
    let e = one(&rules("deny", "/v1/**"), f.clone()).1;
    assert_eq!(
        (e.bucket, e.now.reason),
        (Bucket::UnchangedDenied, Some("request-denied-by-rule"))
    );
    assert_eq!(
        e.now.rule.as_deref(),
        Some("request_rules deny api.test:443 /v1/**")
    );
    let e = one(&rules("allow", "/v2/**"), f.clone()).1;
    assert_eq!(e.now.reason, Some("request-not-allowed"));
    // A path the rules can't judge, and no rules at all (the connection decides).
    let odd = req("path-not-normalized", "GET", "/a/../admin");
    assert_eq!(
        one(&rules("deny", "/admin/**"), odd.clone()).1.now.reason,
        Some("path-not-normalized")
    );
    assert_eq!(
        one(&proposed("allow_hosts = [\"api.test\"]"), odd).0,
        Bucket::NewlyAllowed
    );
    // The connection is decided first.
    let e = one(&proposed("allow_hosts = [\"other.test\"]"), f.clone()).1;
    assert_eq!(e.now.reason, Some("host-not-allowed"));
    // Headers are not recorded: said.
    let r = replay([&f], &rules("deny", "/admin/**"));
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("headers are not recorded")),
        "{:?}",
        r.notes
    );
    // Without method and path there is nothing to decide on.
    let mut bare = f;
    bare.labels.clear();
    assert!(
        unreplayable(&rules("deny", "/x"), bare)
            .why
            .contains("method and path")
    );
}

#[test]
fn what_no_rule_decides_is_not_replayable_and_counted_by_reason() {
    let p = proposed("allow_hosts = [\"github.com\"]");
    let mut flows = vec![
        proxy(Verdict::Deny, "github.com", 443, "tls-no-sni", None),
        proxy(Verdict::Deny, "github.com", 443, "tls-no-sni", None),
        proxy(
            Verdict::Deny,
            "github.com",
            443,
            "placeholder-wrong-host",
            None,
        ),
        proxy(
            Verdict::Deny,
            "github.com",
            443,
            "userinfo-not-allowed",
            None,
        ),
        kernel(
            Verdict::Deny,
            "",
            0,
            "socket(family=17, type=3)",
            "kernel-socket-type-not-allowed",
        ),
        kernel(
            Verdict::Deny,
            "8.8.8.8",
            0,
            "icmp",
            "kernel-destination-not-allowed",
        ),
        kernel(
            Verdict::Deny,
            "10.0.0.1",
            80,
            "tcp",
            "kernel-proxy-not-running",
        ),
    ];
    flows[1].count = 4;
    let mut agent = proxy(
        Verdict::Deny,
        "api.test",
        443,
        "interception-unavailable",
        None,
    );
    agent.source = "agent".into();
    flows.push(agent);
    let r = replay(&flows, &p);
    assert!(r.destinations.is_empty());
    assert_eq!(
        r.totals.not_replayable,
        Count {
            flows: 8,
            events: 11
        }
    );
    assert_eq!(r.not_replayable[0].reason, "tls-no-sni");
    assert_eq!(
        (r.not_replayable[0].flows, r.not_replayable[0].events),
        (2, 5)
    );
    let why = |reason: &str| {
        r.not_replayable
            .iter()
            .find(|u| u.reason == reason)
            .map(|u| u.why)
            .unwrap()
    };
    assert!(why("placeholder-wrong-host").contains("headers"));
    assert!(why("kernel-socket-type-not-allowed").contains("socket type"));
    assert!(why("interception-unavailable").contains("lifecycle"));
    assert!(why("kernel-proxy-not-running").contains("agent's state"));
}

#[test]
fn flows_of_a_destination_are_counted_together_with_their_newest_examples() {
    let p = proposed("allow_hosts = [\"github.com\"]");
    let mut flows = Vec::new();
    for (i, (container, run)) in [("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")]
        .iter()
        .enumerate()
    {
        let mut f = allowed("api.github.com", 443, "allow_hosts *.github.com");
        f.container_name = (*container).into();
        f.labels.insert("run".into(), (*run).into());
        f.count = 10;
        f.last_seen = UNIX_EPOCH + Duration::from_secs(3000 + i as u64);
        flows.push(f);
    }
    let mut older_rule = flows[0].clone();
    older_rule.rule = None;
    older_rule.count = 1;
    older_rule.container_name = "e".into();
    flows.push(older_rule);
    flows.push(allowed("github.com", 443, "allow_hosts github.com"));
    flows.push(proxy(
        Verdict::Deny,
        "evil.test",
        443,
        "host-not-allowed",
        None,
    ));
    let forward = replay(&flows, &p);
    flows.reverse();
    let backward = replay(&flows, &p);
    assert_eq!(forward, backward, "the order flows come in changes nothing");
    let e = &forward.destinations[0];
    assert_eq!((e.bucket, e.flows, e.events), (Bucket::NewlyDenied, 5, 41));
    let runs: Vec<_> = e
        .examples
        .iter()
        .map(|x| x.run.as_deref().unwrap())
        .collect();
    assert_eq!(runs, ["4", "3", "2"]);
    // Both rules its flows recorded (one recorded before events named their rule).
    let rules: Vec<_> = e.was.iter().map(|w| w.rule.as_deref()).collect();
    assert_eq!(rules, [None, Some("allow_hosts *.github.com")]);
    let buckets: Vec<Bucket> = forward.destinations.iter().map(|e| e.bucket).collect();
    assert_eq!(
        buckets,
        [
            Bucket::NewlyDenied,
            Bucket::UnchangedDenied,
            Bucket::UnchangedAllowed
        ]
    );
    assert_eq!(
        forward.totals.newly_denied,
        Count {
            flows: 5,
            events: 41
        }
    );
    assert_eq!((forward.flows, forward.events), (7, 43));
    assert_eq!(
        forward.first_seen,
        Some(UNIX_EPOCH + Duration::from_secs(1000))
    );
}

#[test]
fn the_text_puts_what_breaks_first_and_the_json_has_every_bucket() {
    let p = proposed("allow_hosts = [\"github.com\", \"pypi.org\"]");
    let flows = [
        allowed("github.com", 443, "allow_hosts github.com"),
        allowed("api.github.com", 443, "allow_hosts *.github.com"),
        allowed("codeload.github.com", 443, "allow_hosts *.github.com"),
        proxy(Verdict::Deny, "pypi.org", 443, "host-not-allowed", None),
        proxy(Verdict::Deny, "github.com", 443, "tls-no-sni", None),
    ];
    let r = replay_listing(&flows, &p, 1);
    let about = About {
        against: "p".into(),
        selection: "run=42".into(),
    };
    let t = to_text(&r, &about);
    let denied = t.find("newly denied (what breaks a job):").unwrap();
    let allowed_at = t.find("\nnewly allowed:").unwrap();
    assert!(denied < allowed_at, "{t}");
    assert!(
        t.contains("was: allowed by `allow_hosts *.github.com`")
            && t.contains("now: denied (host-not-allowed): no allow_hosts entry matches"),
        "{t}"
    );
    assert!(t.contains("... and 1 more (--limit 0 lists all)"), "{t}");
    assert!(t.contains("e.g. job run=42 at 1970-01-01T00:33:20Z"), "{t}");
    assert!(t.contains("proxy tls-no-sni — 1 flow, 1 event"), "{t}");
    let v = to_json(&r, &about);
    assert_eq!(v["schema"], 1);
    assert_eq!(v["against"], "p");
    for k in [
        "newly_denied",
        "newly_allowed",
        "would_deny",
        "unchanged_denied",
        "unchanged_allowed",
        "not_replayable",
    ] {
        assert!(v["totals"][k]["flows"].is_u64(), "{k}: {v}");
    }
    assert_eq!(v["totals"]["newly_denied"]["events"], 2);
    assert_eq!(v["unlisted"]["newly_denied"], 1);
    let d = &v["destinations"][0];
    assert_eq!(d["bucket"], "newly_denied");
    assert_eq!(d["now"]["verdict"], "deny");
    assert_eq!(d["now"]["reason"], "host-not-allowed");
    assert!(d["now"]["rule"].is_null());
    assert_eq!(d["was"][0]["verdict"], "allow");
    assert_eq!(d["examples"][0]["container"], "job");
    assert_eq!(v["not_replayable"][0]["reason"], "tls-no-sni");
    // Nothing recorded: said, and how to replay everything.
    let empty = replay([], &p);
    let t = to_text(&empty, &about);
    assert!(
        t.contains("nothing to replay") && t.contains("--against any"),
        "{t}"
    );
}
