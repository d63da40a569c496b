//! The agent's DNS responder: one per policy listener identity, answering only allowed names.
//!
//! The kernel redirects a confined cgroup's UDP and TCP to port 53 (any address: Docker's
//! `127.0.0.11`, the host's resolver, `8.8.8.8`) to the responder of that cgroup's own listener
//! identity and restores the reply's source (see docs/architecture.md, "Transparent interception
//! and DNS: kernel interface"). The responder ([`DnsResponder`]) reads UDP in batches
//! ([`udp`]: `recvmmsg`/`sendmmsg`) and TCP per connection ([`tcp`], bounded), parses with
//! hickory ([`wire`]), and answers both through the same steps ([`handler`]), per query:
//!
//! 1. [`decide`] — before anything leaves the agent: one question, opcode QUERY, class IN, type A
//!    or AAAA (else REFUSED, with a `dns-type-refused` denial event for other types/classes); the
//!    name normalised like every host name ([`egress_policy::name`]) and matched against
//!    `allow_hosts` ([`egress_policy::CompiledPolicy::decide_name`]). Anything not allowed is
//!    answered **NXDOMAIN** with a denial event and is **never sent to any resolver**: labels of a
//!    denied name can't carry data out (DNS tunnelling).
//! 2. [`answer`] — the allowed name is resolved by the proxy's own resolver (same cache, hosts
//!    file and nameservers, A and AAAA together), and **every address of both families** is
//!    checked with the proxy's dial-time check ([`egress_policy::CompiledPolicy::classify_addr`]):
//!    one denied address refuses the name whole (NXDOMAIN + event with that address), exactly as
//!    the proxy refuses to dial it. Otherwise the asked family's records (CNAME chain included)
//!    are answered with one TTL: the remaining cache lifetime, capped at [`MAX_ANSWER_TTL`].
//! 3. Before the answer is sent, the [`AnswerSink`] hears of it (identity, client, name,
//!    addresses, TTL, the ports the name's `allow_hosts` entries carry): the kernel side uses it
//!    to allow direct TCP to those addresses on those ports until the TTL runs out.
//!
//! Why NXDOMAIN for denied names (not REFUSED): a stub resolver takes NXDOMAIN as final and fails
//! at once ("could not resolve host"); REFUSED makes glibc and others try the next nameserver,
//! and every one of them is this responder again. REFUSED is kept for what is not a name decision
//! (other record types, classes, opcodes) and `deny_all` (a listener whose policy was reloaded to
//! `deny_all`; such policies get no responder at bind time). Upstream failures are SERVFAIL.
//!
//! What needs no network is answered on the UDP receive loop, synchronously: refusals, denials
//! and allowed names whose records the resolver caches. The loop keeps those answers' bytes
//! ([`memo`]): the same query bytes again (any id) are answered from them with the same effects
//! (events, sink report, counters) until the policy changes, the records expire or the TTL's
//! second passes. A miss is resolved on a task of its own
//! (at most `proxy.max_connections_per_listener` at once per responder; beyond it SERVFAIL) that
//! sends its answer when done.
//!
//! Malformed packets: fewer than 12 bytes, or cut off by the 4 KiB receive buffer, are dropped; a
//! header that parses but a body that doesn't gets FORMERR; responses (QR=1) are dropped; nothing
//! panics (`fuzz/fuzz_targets/dns_query.rs` drives [`wire::read`], [`decide`], the answer plan
//! and [`wire::encode`] with arbitrary bytes). Each outcome is counted (`dns_answers_total`,
//! `dns_dropped_total`, see [`crate::metrics`]).
pub mod answer;
mod batch;
pub mod decide;
mod handler;
mod memo;
pub mod responder;
pub mod tcp;
mod udp;
pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

pub use answer::MAX_ANSWER_TTL;
pub use decide::{Decision, decide};
pub use responder::DnsResponder;

use crate::proxy::Identity;
use egress_policy::name::HostName;

/// Port of DNS denial events (the query's destination, whatever address the client used).
pub const DNS_PORT: u16 = 53;

/// One answer the responder is about to give a client, reported to the [`AnswerSink`] before it is
/// sent.
#[derive(Debug, Clone)]
pub struct Answer<'a> {
    /// The listener's policy name.
    pub policy: &'a str,
    /// The listener's identity (container, cgroup id), when it serves one known client.
    pub identity: Option<&'a Identity>,
    /// The client socket the query came from (as the responder saw it: the kernel redirected it).
    pub client: SocketAddr,
    /// The normalised name asked for (not the CNAME targets).
    pub name: &'a HostName,
    /// The A or AAAA addresses answered, in answer order. Never empty.
    pub addrs: &'a [IpAddr],
    /// The TTL answered (every record of the answer carries it).
    pub ttl: Duration,
    /// The ports the matching `allow_hosts` entries carry (sorted; empty for most names): the
    /// kernel may allow direct TCP on these to [`Answer::direct_addrs`] until `ttl` runs out.
    pub direct_ports: &'a [u16],
    /// The subset of `addrs` that may be opened directly: those that passed the address check as
    /// public addresses. Addresses allowed only through `resolve_private` (proxy only) or covered
    /// by `allow_cidrs` (already allowed directly) are not in it.
    pub direct_addrs: &'a [IpAddr],
}

/// Hears of every answer before it is sent. The kernel side implements it (the lead's part: a map
/// of allowed addresses per cgroup for names whose entries carry ports). Called on the responder's
/// task: keep it short and non-blocking (a map update); it can't veto the answer.
pub trait AnswerSink: Send + Sync + 'static {
    fn answered(&self, answer: &Answer<'_>);
}

/// An [`AnswerSink`] that forgets everything (a responder without kernel support).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoAnswerSink;

impl AnswerSink for NoAnswerSink {
    fn answered(&self, _: &Answer<'_>) {}
}
