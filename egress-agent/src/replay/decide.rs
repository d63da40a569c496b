//! One recorded flow decided again under the proposed policy, by the calls the enforcement
//! points make (never a copy of their rules):
//!
//! - **proxy, a name** (`CONNECT`, proxied and transparent HTTP/TLS): the name's decision
//!   ([`CompiledPolicy::decide_target`]); when the flow was refused at dial time it names the
//!   refused address (in `ip`, or in the `denied_address` label of a transparent connection,
//!   whose `ip` is the original destination the proxy never dials), decided as the dial decides
//!   it ([`CompiledPolicy::decide_addr`] with `via_name`), in `check_and_dial_from`'s order;
//! - **proxy, an IP literal**: [`CompiledPolicy::decide_target`] on the address;
//! - **DNS** (protocol `dns`): [`CompiledPolicy::decide_name`], then the answer's refused
//!   address when one was recorded ([`CompiledPolicy::classify_addr`], as the responder);
//! - **a refused request** (`request-denied-by-rule`, `request-not-allowed`,
//!   `path-not-normalized`, with the `method` and `path` labels): the connection's decision,
//!   then the request rules ([`egress_policy::l7::L7Policy::check_rules`]);
//! - **kernel**: [`kernel_eval::connect`] (or [`kernel_eval::inbound`] for `direction =
//!   inbound`) on the compiled [`egress_policy::kernel::KernelPolicy`], as `explain` evaluates
//!   it: the container's own network namespace, or the host's for `exec` (container id
//!   `exec:PID`).
//!
//! Everything else is not replayable, with why: refusals no rule of a policy decides (request
//! shape, TLS, admission, interception, agent lifecycle, socket types), and what was not
//! recorded (credential placeholders are in headers).
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use super::{Decided, Now, Proposed, Replayed, Unrecorded};
use crate::events::{ALLOWED_REASON, Verdict};
use crate::store::query::FlowRef;
use egress_policy::kernel_eval::{self, KernelVerdict, Netns, Transport};
use egress_policy::name::{Destination, HostName};
use egress_policy::{CompiledPolicy, Decision, DenyReason};

/// Proxy refusals a policy's host, port and address rules decide.
const POLICY_REASONS: [DenyReason; 6] = [
    DenyReason::PolicyDenyAll,
    DenyReason::HostNotAllowed,
    DenyReason::PortNotAllowed,
    DenyReason::IpLiteralNotAllowed,
    DenyReason::AddressDenied,
    DenyReason::AddressDeniedByPolicy,
];

/// Refusals of one request by the request rules (the flow names its method and path).
const REQUEST_REASONS: [DenyReason; 3] = [
    DenyReason::RequestDeniedByRule,
    DenyReason::RequestNotAllowed,
    DenyReason::PathNotNormalized,
];

/// Refusals of an address at dial time (the flow names the address).
const ADDRESS_REASONS: [DenyReason; 2] =
    [DenyReason::AddressDenied, DenyReason::AddressDeniedByPolicy];

pub(super) const WHY_REDIRECTED: &str = "the proposed policy sends this connection to the agent (proxy endpoint, DNS responder or transparent listener), which decides on a name the kernel event does not hold";

fn is(reason: &str, among: &[DenyReason]) -> bool {
    among.iter().any(|r| r.as_str() == reason)
}

/// Why a proxy refusal is not replayable: no rule of a policy decides it, or it depends on
/// what was not recorded.
fn proxy_unreplayable(reason: &str) -> &'static str {
    match reason {
        "userinfo-not-allowed"
        | "numeric-ip-form"
        | "invalid-host"
        | "host-header-mismatch"
        | "ambiguous-framing"
        | "upgrade-not-allowed"
        | "dns-type-refused" => "the request's shape: refused under every policy",
        "tls-no-sni"
        | "tls-invalid-hello"
        | "http-no-host"
        | "unknown-protocol"
        | "sni-mismatch"
        | "agent-ca-not-trusted" => {
            "what the client sent (TLS, HTTP): refused before any rule of a policy"
        }
        "no-original-destination" | "listener-foreign-peer" | "transparent-off" => {
            "the agent's state when it arrived (admission, redirection): not a rule of a policy"
        }
        "interception-unavailable" => {
            "interception could not be had (CA, TLS setup or a secret): not a rule of a policy"
        }
        "placeholder-wrong-host" | "credential-placeholder-missing" => {
            "credential placeholders travel in headers, which are not recorded"
        }
        "response-secret-scrubbed" | "response-encoding-refused" => {
            "about a response, not a decision on the request"
        }
        _ => "not a decision of a policy's rules",
    }
}

/// The source and the proposed policy's decision; the destination as people read it is
/// written into `dest` (a buffer the caller reuses: most flows are of a destination seen
/// before).
pub(super) fn flow(p: &Proposed, f: &FlowRef<'_>, dest: &mut String) -> (&'static str, Replayed) {
    match f.source {
        "proxy" => ("proxy", proxy(p, f, dest)),
        "kernel" => ("kernel", kernel(p, f, dest)),
        _ => {
            dest.push_str(f.host);
            (
                "agent",
                Replayed::NotReplayable(
                    "an agent lifecycle event (a workload refused, its labels, the host layer): not traffic",
                ),
            )
        }
    }
}

fn decided(d: Decision, unrecorded: Option<Unrecorded>) -> Replayed {
    Replayed::Decided {
        now: Now::Proxy(d),
        unrecorded,
    }
}

/// The name's decision, then the dial's on an address, in `check_and_dial_from`'s order: a
/// refusal of the name stands; then a refused address; then an audited refusal of either;
/// else the name's allow (which an allow event names).
fn then_dial(name: Decision, dial: Option<Decision>) -> Decision {
    match (name, dial) {
        (Decision::Deny(_), _) => name,
        (_, Some(d @ Decision::Deny(_))) => d,
        (Decision::WouldDeny(_), _) => name,
        (_, Some(d @ Decision::WouldDeny(_))) => d,
        _ => name,
    }
}

/// The address a proxy flow's dial refused: a transparent connection names it in
/// `denied_address` (its `ip` is the original destination, which the proxy never dials), the
/// others in `ip`. Only refusals of an address carry one.
fn dial_address(f: &FlowRef<'_>) -> Option<IpAddr> {
    let of_address = is(f.reason, &ADDRESS_REASONS)
        || (f.reason == DenyReason::PortNotAllowed.as_str()
            && f.rule.is_some_and(|r| r.starts_with("allow_cidrs ")));
    if f.verdict == Verdict::Allow || !of_address {
        return None;
    }
    f.labels.get("denied_address").unwrap_or(f.ip).parse().ok()
}

fn proxy(p: &Proposed, f: &FlowRef<'_>, dest: &mut String) -> Replayed {
    let c = &p.compiled;
    let ip: Option<IpAddr> = f.ip.parse().ok();
    match (f.host, ip) {
        ("", Some(ip)) => write!(dest, "{}", SocketAddr::new(ip, f.port)),
        ("", None) => write!(dest, "-"),
        (h, _) if f.protocol == "dns" => write!(dest, "{h} (DNS)"),
        (h, _) => write!(dest, "{h}:{}", f.port),
    }
    .ok();
    let passed = f.verdict == Verdict::Allow && f.reason == ALLOWED_REASON;
    let request = is(f.reason, &REQUEST_REASONS);
    if !passed && !request && !is(f.reason, &POLICY_REASONS) {
        return Replayed::NotReplayable(proxy_unreplayable(f.reason));
    }
    if f.protocol == "dns" {
        return dns(c, f, dest);
    }
    if f.port == 0 {
        return Replayed::NotReplayable("no port: refused before a destination was named");
    }
    if f.host.is_empty() {
        return match ip {
            Some(ip) => decided(c.decide_target(&Destination::Ip(ip), f.port), None),
            None => Replayed::NotReplayable("no destination was recorded"),
        };
    }
    let Ok(name) = HostName::parse(f.host) else {
        return Replayed::NotReplayable("not a host name the proxy accepts");
    };
    let on_name = c.decide_target(&Destination::Name(name.clone()), f.port);
    if request {
        return request_flow(c, f, &name, on_name, dest);
    }
    let addr = dial_address(f);
    let dial = addr.map(|a| c.decide_addr(a, f.port, true));
    let d = then_dial(on_name, dial);
    if let Some(a) = addr {
        write!(dest, " (address {a})").ok();
    }
    let unrecorded =
        (addr.is_none() && !matches!(d, Decision::Deny(_))).then_some(Unrecorded::Address);
    decided(d, unrecorded)
}

/// A request the request rules refused: the connection's decision, then the rules on its
/// method and path.
fn request_flow(
    c: &CompiledPolicy,
    f: &FlowRef<'_>,
    name: &HostName,
    on_name: Decision,
    dest: &mut String,
) -> Replayed {
    let (Some(method), Some(path)) = (f.labels.get("method"), f.labels.get("path")) else {
        return Replayed::NotReplayable("a request refusal without its method and path");
    };
    write!(dest, " {method} {path}").ok();
    let d = match on_name {
        Decision::Deny(_) => on_name,
        _ => match c.l7().check_rules(name, f.port, method, path) {
            Ok(()) => on_name,
            Err(refused) => Decision::Deny(refused),
        },
    };
    decided(d, Some(Unrecorded::Headers))
}

/// A DNS query: the name's decision as the responder takes it, then the answer's refused
/// address (enforce-only, as the responder checks answers).
fn dns(c: &CompiledPolicy, f: &FlowRef<'_>, dest: &mut String) -> Replayed {
    let Ok(name) = HostName::parse(f.host) else {
        return Replayed::NotReplayable("not a host name the proxy accepts");
    };
    let (on_name, _) = c.decide_name(&name);
    let Ok(ip) = f.ip.parse::<IpAddr>() else {
        return decided(on_name, None);
    };
    let answer = c.classify_addr(ip, None, true).err().map(Decision::Deny);
    dest.truncate(dest.len() - ")".len());
    write!(dest, ", answer {ip})").ok();
    decided(then_dial(on_name, answer), None)
}

fn kernel(p: &Proposed, f: &FlowRef<'_>, dest: &mut String) -> Replayed {
    let ip: Option<IpAddr> = f.ip.parse().ok();
    let inbound = f.labels.get("direction") == Some("inbound");
    match (ip, inbound) {
        (Some(ip), true) => write!(dest, "inbound from {ip} to port {}/{}", f.port, f.protocol),
        (Some(ip), false) => write!(dest, "{}/{}", SocketAddr::new(ip, f.port), f.protocol),
        (None, _) => write!(dest, "{}", f.protocol),
    }
    .ok();
    if f.protocol.starts_with("socket(") || f.reason == "kernel-socket-type-not-allowed" {
        return Replayed::NotReplayable(
            "a socket type the kernel programs refuse under every policy but allow_all",
        );
    }
    if f.reason == "kernel-no-policy-entry" || f.reason == "kernel-proxy-not-running" {
        return Replayed::NotReplayable(
            "the agent's state (no policy entry or no proxy listener for the cgroup)",
        );
    }
    let transport = match f.protocol {
        "tcp" => Transport::Tcp,
        "udp" => Transport::Udp,
        _ => {
            return Replayed::NotReplayable("only TCP and UDP connections are decided by a policy");
        }
    };
    let (Some(ip), true) = (ip, f.port != 0) else {
        return Replayed::NotReplayable("no address or port was recorded");
    };
    let Ok(kp) = &p.kernel else {
        return Replayed::NotReplayable("the kernel programs can't load the proposed policy");
    };
    let netns = if f.container_id.starts_with("exec:") {
        Netns::Host
    } else {
        Netns::Own
    };
    let (verdict, unrecorded) = if inbound {
        let published = p.published_ports.then_some(Unrecorded::PublishedPorts);
        (kernel_eval::inbound(kp, ip, f.port, netns), published)
    } else {
        let dst = SocketAddr::new(ip, f.port);
        (kernel_eval::connect(kp, dst, transport, netns), None)
    };
    match kernel_decided(verdict, f.reason) {
        Ok(decided) => Replayed::Decided {
            now: Now::Kernel(decided),
            unrecorded,
        },
        Err(why) => Replayed::NotReplayable(why),
    }
}

/// The kernel's verdict as a decision. A server on the host's loopback is allowed for the same
/// confined tree only: a flow refused as `kernel-host-loopback` was another tree's, so it gets
/// the verdict for those.
fn kernel_decided(v: KernelVerdict, recorded_reason: &str) -> Result<Decided, &'static str> {
    let d = |verdict, reason, rule| Decided {
        verdict,
        reason,
        rule: Some(rule),
    };
    match v {
        KernelVerdict::Allow { rule } => Ok(d(Verdict::Allow, None, rule)),
        KernelVerdict::Redirect { .. } => Err(WHY_REDIRECTED),
        KernelVerdict::SameTreeOnly { otherwise, .. }
            if recorded_reason == "kernel-host-loopback" =>
        {
            kernel_decided(*otherwise, recorded_reason)
        }
        KernelVerdict::SameTreeOnly { rule, .. } => Ok(d(Verdict::Allow, None, rule)),
        KernelVerdict::Deny { reason, rule } => Ok(d(Verdict::Deny, Some(reason), rule)),
        KernelVerdict::WouldDeny { reason, rule } => Ok(d(Verdict::WouldDeny, Some(reason), rule)),
    }
}
