//! nftables and legacy iptables, read-only: the agent's tables, the input/forward default policies,
//! and IP forwarding.
//!
//! nf_tables is read with two netlink dumps (`NFT_MSG_GETTABLE`, `NFT_MSG_GETCHAIN`) on a
//! `NETLINK_NETFILTER` socket, so no `nft` binary is needed. Only done when nf_tables is loaded or
//! built in: on a host where it is a module that isn't loaded, opening the socket would load it.
//! Legacy iptables (`iptables-legacy -S`) is only consulted when `/proc/net/ip_tables_names` lists
//! `filter` (likewise, so listing does not load `ip_tables`).

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
    setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;

use super::kernel::{NfTables, nf_tables_state};
use super::{Ctx, Outcome, blocking, host, tool};

// linux/netlink.h, linux/netfilter/nfnetlink.h, linux/netfilter/nf_tables.h
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NF_DROP: u32 = 0;
// NFPROTO_*
pub(super) const FAMILY_INET: u8 = 1;
pub(super) const FAMILY_IPV4: u8 = 2;
pub(super) const FAMILY_BRIDGE: u8 = 7;
pub(super) const FAMILY_IPV6: u8 = 10;
// NF_INET_*
pub(super) const HOOK_INPUT: u32 = 1;
pub(super) const HOOK_FORWARD: u32 = 2;

pub(super) fn family_name(f: u8) -> &'static str {
    match f {
        FAMILY_INET => "inet",
        FAMILY_IPV4 => "ip",
        3 => "arp",
        5 => "netdev",
        FAMILY_BRIDGE => "bridge",
        FAMILY_IPV6 => "ip6",
        _ => "unknown",
    }
}

/// A base chain of the ruleset (or a legacy iptables built-in chain).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct BaseChain {
    /// `nft:inet filter input`, `iptables-legacy filter INPUT`, ...
    pub origin: String,
    pub family: u8,
    pub hook: u32,
    pub drop_policy: bool,
}

/// What the firewall probes need, gathered once per run.
#[derive(Clone, Debug, Default)]
pub(super) struct Snapshot {
    /// `(family, name)` of every nf_tables table; `None` if nf_tables could not be read.
    pub tables: Option<Vec<(u8, String)>>,
    /// Base chains at the input and forward hooks (nft + legacy).
    pub chains: Vec<BaseChain>,
    /// Why nf_tables could not be read, if it couldn't.
    pub nft_error: Option<String>,
    /// Whether any legacy iptables table was read, and why not.
    pub legacy_error: Option<String>,
    pub legacy_read: bool,
}

// ---- netlink -------------------------------------------------------------------------------

fn nl_request(msg_type: u16, seq: u32) -> Vec<u8> {
    let len: u32 = 16 + 4;
    let mut b = Vec::with_capacity(len as usize);
    b.extend_from_slice(&len.to_ne_bytes());
    b.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg_type).to_ne_bytes());
    b.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes()); // pid: kernel fills
    b.extend_from_slice(&[
        0, /* AF_UNSPEC: all families */
        0, /* NFNETLINK_V0 */
        0, 0,
    ]);
    b
}

/// Netlink attributes of one message body: `(type without flags, payload)`.
fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((ty, &b[4..len]));
        let adv = (len + 3) & !3;
        b = b.get(adv..).unwrap_or_default();
    }
    out
}

fn attr_str(v: &[u8]) -> String {
    String::from_utf8_lossy(v.split(|c| *c == 0).next().unwrap_or_default()).into_owned()
}

fn attr_u32_be(v: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(v.get(..4)?.try_into().ok()?))
}

/// One dump: every message body after the nfgenmsg, with its family. Errors carry the errno.
fn dump(msg_type: u16, timeout: Duration) -> Result<Vec<(u8, Vec<u8>)>, nix::Error> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
    let tv = TimeVal::new(timeout.as_secs() as i64, timeout.subsec_micros().into());
    setsockopt(&fd, sockopt::ReceiveTimeout, &tv)?;
    setsockopt(&fd, sockopt::SendTimeout, &tv)?;
    let seq = 1;
    send(
        fd.as_raw_fd(),
        &nl_request(msg_type, seq),
        MsgFlags::empty(),
    )?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    // Bound the number of reads: a dump of a huge ruleset still ends, a confused socket doesn't loop.
    for _ in 0..10_000 {
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        if n == 0 {
            return Ok(out);
        }
        let mut b = &buf[..n];
        while b.len() >= 16 {
            let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
            let ty = u16::from_ne_bytes([b[4], b[5]]);
            if len < 16 || len > b.len() {
                break;
            }
            let body = &b[16..len];
            match ty {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let errno = body
                        .get(..4)
                        .map(|e| i32::from_ne_bytes([e[0], e[1], e[2], e[3]]))
                        .unwrap_or(0);
                    if errno == 0 {
                        return Ok(out);
                    }
                    return Err(nix::Error::from_raw(-errno));
                }
                _ if body.len() >= 4 => out.push((body[0], body[4..].to_vec())),
                _ => {}
            }
            b = b.get(((len + 3) & !3)..).unwrap_or_default();
        }
    }
    Ok(out)
}

fn nft_tables(timeout: Duration) -> Result<Vec<(u8, String)>, nix::Error> {
    Ok(dump(NFT_MSG_GETTABLE, timeout)?
        .into_iter()
        .filter_map(|(fam, body)| {
            let name = attrs(&body)
                .into_iter()
                .find(|(t, _)| *t == NFTA_TABLE_NAME)?
                .1;
            Some((fam, attr_str(name)))
        })
        .collect())
}

fn nft_chains(timeout: Duration) -> Result<Vec<BaseChain>, nix::Error> {
    Ok(dump(NFT_MSG_GETCHAIN, timeout)?
        .into_iter()
        .filter_map(|(fam, body)| {
            let a = attrs(&body);
            let get = |t| a.iter().find(|(ty, _)| *ty == t).map(|(_, v)| *v);
            let hook = attrs(get(NFTA_CHAIN_HOOK)?)
                .into_iter()
                .find(|(t, _)| *t == NFTA_HOOK_HOOKNUM)
                .and_then(|(_, v)| attr_u32_be(v))?;
            let ty = get(NFTA_CHAIN_TYPE).map(attr_str).unwrap_or_default();
            if ty != "filter" || !matches!(fam, FAMILY_INET | FAMILY_IPV4 | FAMILY_IPV6) {
                return None;
            }
            let policy = get(NFTA_CHAIN_POLICY).and_then(attr_u32_be);
            Some(BaseChain {
                origin: format!(
                    "nft {} {} {}",
                    family_name(fam),
                    get(NFTA_CHAIN_TABLE).map(attr_str).unwrap_or_default(),
                    get(NFTA_CHAIN_NAME).map(attr_str).unwrap_or_default()
                ),
                family: fam,
                hook,
                drop_policy: policy == Some(NF_DROP),
            })
        })
        .collect())
}

// ---- legacy iptables ------------------------------------------------------------------------

/// Parse `-P CHAIN POLICY` lines of `iptables -S`.
pub(super) fn parse_iptables_s(text: &str, tool: &str, family: u8) -> Vec<BaseChain> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "-P").then_some(())?;
            let chain = w.next()?;
            let policy = w.next()?;
            let hook = match chain {
                "INPUT" => HOOK_INPUT,
                "FORWARD" => HOOK_FORWARD,
                _ => return None,
            };
            Some(BaseChain {
                origin: format!("{tool} filter {chain}"),
                family,
                hook,
                drop_policy: policy == "DROP",
            })
        })
        .collect()
}

async fn legacy(ctx: &Arc<Ctx>, snap: &mut Snapshot) {
    for (names, tool, family) in [
        ("net/ip_tables_names", "iptables-legacy", FAMILY_IPV4),
        ("net/ip6_tables_names", "ip6tables-legacy", FAMILY_IPV6),
    ] {
        let names = tokio::fs::read_to_string(ctx.opts.paths.proc_dir.join(names))
            .await
            .unwrap_or_default();
        if !names.lines().any(|l| l.trim() == "filter") {
            continue;
        }
        match tool::run(ctx, tool, &["-w", "1", "-t", "filter", "-S"]).await {
            Ok(out) => {
                snap.legacy_read = true;
                snap.chains.extend(parse_iptables_s(&out, tool, family));
            }
            Err(e) => {
                snap.legacy_error = Some(format!("legacy iptables filter table present but {e}"))
            }
        }
    }
}

/// Gather the snapshot once per run.
pub(super) async fn snapshot(ctx: &Arc<Ctx>) -> Snapshot {
    ctx.firewall
        .get_or_init(|| async {
            let mut snap = Snapshot::default();
            if !ctx.opts.netlink {
                snap.nft_error = Some("netlink queries disabled".into());
            } else {
                match nf_tables_state(ctx).await {
                    NfTables::Present(_) => {
                        let t = ctx.opts.probe_timeout / 2;
                        match blocking(move || {
                            nft_tables(t).and_then(|tables| Ok((tables, nft_chains(t)?)))
                        })
                        .await
                        {
                            Some(Ok((tables, chains))) => {
                                snap.tables = Some(tables);
                                snap.chains = chains;
                            }
                            Some(Err(nix::Error::EPERM)) => {
                                snap.nft_error =
                                    Some("reading nf_tables needs CAP_NET_ADMIN".into());
                            }
                            Some(Err(e)) => {
                                snap.nft_error = Some(format!("nf_tables netlink dump failed: {e}"))
                            }
                            None => snap.nft_error = Some("nf_tables netlink dump failed".into()),
                        }
                    }
                    // No nf_tables loaded: there is no ruleset at all (and probing would load the module).
                    NfTables::ModuleNotLoaded | NfTables::Absent => snap.tables = Some(Vec::new()),
                    NfTables::Unknown => {
                        snap.nft_error = Some("can't tell whether nf_tables is available".into())
                    }
                }
            }
            legacy(ctx, &mut snap).await;
            snap
        })
        .await
        .clone()
}

// ---- probes ---------------------------------------------------------------------------------

fn skip_fix(snap: &Snapshot) -> &'static str {
    match snap.nft_error.as_deref() {
        Some(e) if e.contains("CAP_NET_ADMIN") => "run doctor as root",
        Some(e) if e.contains("disabled") => "re-run without disabling netlink queries",
        _ => "see kernel.nf_tables; run doctor as root",
    }
}

pub(super) async fn agent_table(ctx: Arc<Ctx>) -> Outcome {
    let snap = snapshot(&ctx).await;
    let name = &ctx.opts.nft_table;
    let Some(tables) = &snap.tables else {
        return Outcome::skip(
            format!(
                "can't list nftables tables: {}",
                snap.nft_error.as_deref().unwrap_or("unknown error")
            ),
            skip_fix(&snap),
        );
    };
    let want = [FAMILY_INET, FAMILY_BRIDGE];
    let missing: Vec<String> = want
        .iter()
        .filter(|f| !tables.iter().any(|(tf, tn)| tf == *f && tn == name))
        .map(|f| format!("{} {name}", family_name(*f)))
        .collect();
    if missing.is_empty() {
        Outcome::pass(format!(
            "nftables tables inet {name} and bridge {name} present"
        ))
    } else {
        Outcome::fail(
            format!(
                "nftables table(s) missing: {} (the host-side layer is not installed)",
                missing.join(", ")
            ),
            "start the agent (it creates them) and check `journalctl -u egress-agent` for nftables errors",
        )
    }
}

/// Effective default policy at one hook for v4 and v6: a packet is dropped if any base chain at the
/// hook drops it, so one drop policy covering the family is enough. Pure, for tests.
pub(super) fn hook_policy(chains: &[BaseChain], hook: u32) -> (bool, bool, Vec<String>) {
    let at: Vec<&BaseChain> = chains.iter().filter(|c| c.hook == hook).collect();
    let v4 = at
        .iter()
        .any(|c| c.drop_policy && matches!(c.family, FAMILY_INET | FAMILY_IPV4));
    let v6 = at
        .iter()
        .any(|c| c.drop_policy && matches!(c.family, FAMILY_INET | FAMILY_IPV6));
    let seen = at
        .iter()
        .map(|c| {
            format!(
                "{} policy {}",
                c.origin,
                if c.drop_policy { "drop" } else { "accept" }
            )
        })
        .collect();
    (v4, v6, seen)
}

fn firewall_outcome(snap: &Snapshot, hook: u32, hook_name: &str, fix: &str) -> Outcome {
    if snap.tables.is_none() && !snap.legacy_read {
        return Outcome::skip(
            format!(
                "can't read the firewall: {}",
                [snap.nft_error.as_deref(), snap.legacy_error.as_deref()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            skip_fix(snap),
        );
    }
    let (v4, v6, seen) = hook_policy(&snap.chains, hook);
    let chains = if seen.is_empty() {
        "no base chains".to_owned()
    } else {
        seen.join("; ")
    };
    let partial = snap
        .legacy_error
        .as_deref()
        .map(|e| format!(" ({e})"))
        .unwrap_or_default();
    match (v4, v6) {
        (true, true) => Outcome::pass(format!(
            "{hook_name} default policy drops IPv4 and IPv6 ({chains}){partial}"
        )),
        _ => {
            let open = match (v4, v6) {
                (false, false) => "IPv4 and IPv6",
                (false, true) => "IPv4",
                _ => "IPv6",
            };
            Outcome::warn(
                format!(
                    "{hook_name} default policy accepts {open} ({chains}; default policies only, rules not analysed){partial}"
                ),
                fix,
            )
        }
    }
}

pub(super) async fn firewall_input(ctx: Arc<Ctx>) -> Outcome {
    let snap = snapshot(&ctx).await;
    firewall_outcome(
        &snap,
        HOOK_INPUT,
        "input",
        "give the host an input chain with policy drop that accepts only what it serves (ssh, established)",
    )
}

pub(super) async fn firewall_forward(ctx: Arc<Ctx>) -> Outcome {
    let snap = snapshot(&ctx).await;
    firewall_outcome(
        &snap,
        HOOK_FORWARD,
        "forward",
        "set the forward policy to drop (iptables -P FORWARD DROP, or policy drop in an nft forward chain); Docker adds its own accepts",
    )
}

pub(super) async fn ip_forward(ctx: Arc<Ctx>) -> Outcome {
    let dir = &ctx.opts.paths.sysctl_dir;
    let v4 = host::sysctl(dir, "net/ipv4/ip_forward");
    let v6 = host::sysctl(dir, "net/ipv6/conf/all/forwarding");
    let v4 = match v4 {
        Ok(v) => v == "1",
        Err(e) => {
            return Outcome::skip(
                format!("cannot read net.ipv4.ip_forward: {e}"),
                "run on the host with /proc mounted",
            );
        }
    };
    let v6 = v6.is_ok_and(|v| v == "1");
    if !v4 && !v6 {
        return Outcome::pass("IP forwarding disabled");
    }
    let which = match (v4, v6) {
        (true, true) => "IPv4 and IPv6",
        (true, false) => "IPv4",
        _ => "IPv6",
    };
    let snap = snapshot(&ctx).await;
    if snap.tables.is_none() && !snap.legacy_read {
        return Outcome::warn(
            format!(
                "{which} forwarding enabled; forward policy unknown ({})",
                snap.nft_error.as_deref().unwrap_or("?")
            ),
            "run doctor as root to check that the forward policy drops",
        );
    }
    let (d4, d6) = {
        let (d4, d6, _) = hook_policy(&snap.chains, HOOK_FORWARD);
        (d4 || !v4, d6 || !v6)
    };
    if d4 && d6 {
        Outcome::pass(format!(
            "{which} forwarding enabled (Docker bridge networking needs it) and the forward policy drops"
        ))
    } else {
        Outcome::warn(
            format!(
                "{which} forwarding enabled and the forward default policy accepts: the host routes traffic for anyone who points a route at it"
            ),
            "set the forward policy to drop, or sysctl -w net.ipv4.ip_forward=0 if no container needs bridge networking",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_a_dump_request() {
        let r = nl_request(NFT_MSG_GETCHAIN, 7);
        assert_eq!(r.len(), 20);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 0x0a04);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), 0x301);
    }

    #[test]
    fn parses_attributes() {
        // NFTA_TABLE_NAME "filter\0" (len 11, padded to 12), then a u32 attr.
        let mut b = Vec::new();
        b.extend_from_slice(&11u16.to_ne_bytes());
        b.extend_from_slice(&1u16.to_ne_bytes());
        b.extend_from_slice(b"filter\0\0");
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&(5u16 | 0x8000).to_ne_bytes());
        b.extend_from_slice(&0u32.to_be_bytes());
        let a = attrs(&b);
        assert_eq!(a.len(), 2);
        assert_eq!(attr_str(a[0].1), "filter");
        assert_eq!(a[1].0, 5);
        assert_eq!(attr_u32_be(a[1].1), Some(0));
    }

    #[test]
    fn effective_policy_is_drop_if_any_chain_drops() {
        let legacy = parse_iptables_s(
            "-P INPUT ACCEPT\n-P FORWARD DROP\n-P OUTPUT ACCEPT\n-A INPUT -j X\n",
            "iptables-legacy",
            FAMILY_IPV4,
        );
        assert_eq!(legacy.len(), 2);
        let (v4, v6, _) = hook_policy(&legacy, HOOK_FORWARD);
        assert!(v4 && !v6);
        let mut chains = legacy.clone();
        chains.push(BaseChain {
            origin: "nft inet f fwd".into(),
            family: FAMILY_INET,
            hook: HOOK_FORWARD,
            drop_policy: true,
        });
        let (v4, v6, seen) = hook_policy(&chains, HOOK_FORWARD);
        assert!(v4 && v6);
        assert_eq!(seen.len(), 2);
        let (v4, v6, _) = hook_policy(&chains, HOOK_INPUT);
        assert!(!v4 && !v6);
    }
}
