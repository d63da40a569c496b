//! nftables host layer: the second line of defence behind the cgroup programs.
//!
//! The agent owns exactly two tables, both named `egress_agent`, and never reads, flushes or edits
//! anyone else's:
//!
//! - `bridge egress_agent` — sees each container's **host-side veth** (a bridge port), which the
//!   `inet` family can't (there, bridged traffic arrives on the bridge device). For every enforced
//!   endpoint it drops frames whose Ethernet source, ARP sender or IPv4 source is not the
//!   container's own (so the inet rules below can trust `ip saddr`), and every ether type but
//!   IPv4 and ARP (IPv6, raw L2 protocols). Frames bridged to another port of the same bridge
//!   (container to container) are dropped unless they go to the policy's `allow_cidrs`. This
//!   catches what the cgroup hooks cannot see: AF_PACKET frames.
//! - `inet egress_agent` — with conntrack, keyed by (bridge, container IPv4):
//!   (a) the proxy address (`proxy_ip`) is reachable only over loopback and from enforced
//!   containers, each only on its own policy's listener port — not from the LAN, not from
//!   unlabelled containers; (b) forwarded traffic from an enforced container goes only to its
//!   `allow_cidrs` (replies of inbound connections, e.g. published ports, pass as established);
//!   (c) an enforced container reaches no other host port.
//!
//! Every change rebuilds both tables in **one atomic netlink batch** (add, delete, add again with
//! all rules), so packets see the old or the new ruleset, never a half-built one, and no rule
//! handles have to be tracked. `cleanup` (uninstall) deletes both tables; a mere stop leaves them.
//! The rules apply in the network namespace of the calling thread.
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::net::{Ipv4Addr, SocketAddrV4};

use nftnl::expr::{CmpOp, InterfaceName};
use nftnl::{
    Batch, Chain, FinalizedBatch, Hook, MsgType, Policy, ProtoFamily, Rule, Table, nft_expr,
};

use crate::config::CidrRule;

/// Name of both of the agent's tables.
pub const TABLE: &CStr = c"egress_agent";
/// Priority of our base chains: before the default filter priority (0), so our drops are seen
/// whatever other tables accept (a drop anywhere wins; an accept only ends one chain).
const PRIORITY: i32 = -10;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_ARP: u16 = 0x0806;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
/// ARP sender protocol address: 8-byte header + 6-byte sender MAC (Ethernet/IPv4 ARP).
const ARP_SPA_OFFSET: u32 = 14;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("nftables batch rejected by the kernel: {0}")]
    Rejected(std::io::Error),
    #[error("interface name {0:?} is not valid")]
    BadIfName(String),
    #[error("rule comment: {0}")]
    Comment(&'static str),
    #[error("ruleset does not fit one netlink message ({0} bytes)")]
    TooLarge(usize),
}

/// One network endpoint of a container as seen from the host network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The bridge the endpoint is on (`docker0`, `br-…`).
    pub bridge: String,
    /// The host-side veth (the bridge port).
    pub veth: String,
    pub mac: [u8; 6],
    pub ipv4: Ipv4Addr,
}

/// The host-layer view of one enforced container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enforced {
    /// The container's policy listener (`proxy_ip:port`); the only proxy port it may reach.
    pub listener: SocketAddrV4,
    /// The policy's direct allows (IPv4 entries apply here; IPv6 is dropped for enforced
    /// endpoints at the bridge layer).
    pub allow_cidrs: Vec<CidrRule>,
    /// Empty for `--network host` / `none` containers: those are confined by cgroup only.
    pub endpoints: Vec<Endpoint>,
}

/// The whole ruleset: built from scratch on every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    /// The address the proxy listeners are bound to (the stable endpoint's IP).
    pub proxy_ip: Ipv4Addr,
    /// Enforced containers by id.
    pub containers: BTreeMap<String, Enforced>,
}

impl Ruleset {
    pub fn new(proxy_ip: Ipv4Addr) -> Ruleset {
        Ruleset {
            proxy_ip,
            containers: BTreeMap::new(),
        }
    }

    /// Replace both tables with this ruleset, atomically.
    pub fn apply(&self) -> Result<(), NftError> {
        let batch = self.build()?;
        send(&batch)?;
        tracing::debug!(
            containers = self.containers.len(),
            "nftables host layer applied"
        );
        Ok(())
    }

    fn build(&self) -> Result<FinalizedBatch, NftError> {
        // One page for the whole batch: the kernel needs begin..end in a single datagram (mnl
        // sends each page separately). ~40 rules of < 1 KiB per endpoint, generously.
        let endpoints: usize = self
            .containers
            .values()
            .map(|c| c.endpoints.len() + c.allow_cidrs.len())
            .sum();
        let page = (endpoints * 24 * 1024 + (256 << 10)).next_power_of_two();
        let page = u32::try_from(page).map_err(|_| NftError::TooLarge(page))?;
        let mut batch = Batch::with_page_size(page.max(nftnl::default_batch_page_size()));
        let bridge = Table::new(TABLE, ProtoFamily::Bridge);
        let inet = Table::new(TABLE, ProtoFamily::Inet);
        for t in [&bridge, &inet] {
            // Adding an existing table is a no-op, so add + delete works whether or not it exists.
            batch.add(t, MsgType::Add);
            batch.add(t, MsgType::Del);
            batch.add(t, MsgType::Add);
        }
        let b_in = base_chain(&bridge, c"input", Hook::In);
        let b_fwd = base_chain(&bridge, c"forward", Hook::Forward);
        let i_in = base_chain(&inet, c"input", Hook::In);
        let i_fwd = base_chain(&inet, c"forward", Hook::Forward);
        for c in [&b_in, &b_fwd, &i_in, &i_fwd] {
            batch.add(c, MsgType::Add);
        }

        for (id, c) in &self.containers {
            let short: String = id.chars().take(12).collect();
            for ep in &c.endpoints {
                let veth = ifname(&ep.veth)?;
                let br = ifname(&ep.bridge)?;
                // bridge layer: the same anti-spoofing in both hooks.
                for chain in [&b_in, &b_fwd] {
                    let mut r = rule(chain, &short)?;
                    iif(&mut r, &veth);
                    r.add_expr(&nft_expr!(payload ethernet saddr));
                    r.add_expr(&nftnl::expr::Cmp::new(CmpOp::Neq, &ep.mac[..]));
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);

                    let mut r = rule(chain, &short)?;
                    iif(&mut r, &veth);
                    ether_type(&mut r, ETH_P_ARP);
                    r.add_expr(&nft_expr!(payload_raw nh ARP_SPA_OFFSET, 4));
                    r.add_expr(&nft_expr!(cmp != ep.ipv4));
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);

                    let mut r = rule(chain, &short)?;
                    iif(&mut r, &veth);
                    ether_type(&mut r, ETH_P_ARP);
                    r.add_expr(&nft_expr!(verdict accept));
                    batch.add(&r, MsgType::Add);

                    let mut r = rule(chain, &short)?;
                    iif(&mut r, &veth);
                    r.add_expr(&nft_expr!(payload ethernet ethertype));
                    r.add_expr(&nft_expr!(cmp != ETH_P_IP.to_be()));
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);

                    let mut r = rule(chain, &short)?;
                    iif(&mut r, &veth);
                    r.add_expr(&nft_expr!(payload ipv4 saddr));
                    r.add_expr(&nft_expr!(cmp != ep.ipv4));
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);
                }
                // bridge forward: to another port of the same bridge only for allow_cidrs.
                for cidr in &c.allow_cidrs {
                    for r in cidr_rules(&b_fwd, &short, |r| iif(r, &veth), cidr)? {
                        batch.add(&r, MsgType::Add);
                    }
                }
                let mut r = rule(&b_fwd, &short)?;
                iif(&mut r, &veth);
                drop_(&mut r);
                batch.add(&r, MsgType::Add);

                // inet layer, keyed by (bridge, source IPv4) — trustworthy after the above.
                let from = |r: &mut Rule<'_>| {
                    iif(r, &br);
                    ipv4(r);
                    r.add_expr(&nft_expr!(payload ipv4 saddr));
                    r.add_expr(&nft_expr!(cmp == ep.ipv4));
                };
                for chain in [&i_in, &i_fwd] {
                    let mut r = rule(chain, &short)?;
                    from(&mut r);
                    established(&mut r);
                    r.add_expr(&nft_expr!(verdict accept));
                    batch.add(&r, MsgType::Add);
                }
                // (a) its own listener only.
                let mut r = rule(&i_in, &short)?;
                from(&mut r);
                r.add_expr(&nft_expr!(payload ipv4 daddr));
                r.add_expr(&nft_expr!(cmp == *c.listener.ip()));
                l4(&mut r, IPPROTO_TCP);
                r.add_expr(&nft_expr!(payload tcp dport));
                r.add_expr(&nft_expr!(cmp == c.listener.port().to_be()));
                r.add_expr(&nft_expr!(verdict accept));
                batch.add(&r, MsgType::Add);
                // (b) allow_cidrs, forwarded or local.
                for chain in [&i_in, &i_fwd] {
                    for cidr in &c.allow_cidrs {
                        for r in cidr_rules(chain, &short, from, cidr)? {
                            batch.add(&r, MsgType::Add);
                        }
                    }
                    // (b)/(c) everything else from it.
                    let mut r = rule(chain, &short)?;
                    from(&mut r);
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);
                }
            }
        }

        // (a) the proxy address: loopback (host processes, `exec`, host-network containers) and
        // the enforced containers above; nobody else.
        let proxy = |r: &mut Rule<'_>| {
            ipv4(r);
            r.add_expr(&nft_expr!(payload ipv4 daddr));
            r.add_expr(&nft_expr!(cmp == self.proxy_ip));
        };
        let mut r = rule(&i_in, "proxy")?;
        proxy(&mut r);
        iif(&mut r, &ifname("lo")?);
        r.add_expr(&nft_expr!(verdict accept));
        batch.add(&r, MsgType::Add);
        let mut r = rule(&i_in, "proxy")?;
        proxy(&mut r);
        drop_(&mut r);
        batch.add(&r, MsgType::Add);

        let batch = batch.finalize();
        if batch.iter().count() != 1 {
            return Err(NftError::TooLarge(page as usize));
        }
        Ok(batch)
    }
}

/// Remove the agent's tables (uninstall). Returns after the kernel confirmed.
pub fn cleanup() -> Result<(), NftError> {
    let mut batch = Batch::new();
    for family in [ProtoFamily::Bridge, ProtoFamily::Inet] {
        let t = Table::new(TABLE, family);
        batch.add(&t, MsgType::Add);
        batch.add(&t, MsgType::Del);
    }
    send(&batch.finalize())?;
    tracing::info!("nftables tables egress_agent removed");
    Ok(())
}

fn base_chain<'a>(table: &'a Table, name: &CStr, hook: Hook) -> Chain<'a> {
    let mut c = Chain::new(name, table);
    c.set_hook(hook, PRIORITY);
    c.set_policy(Policy::Accept);
    c
}

fn rule<'a>(chain: &'a Chain<'_>, comment: &str) -> Result<Rule<'a>, NftError> {
    let mut r = Rule::new(chain);
    let c = CString::new(comment).map_err(|_| NftError::Comment("NUL in comment"))?;
    r.set_comment(c).map_err(NftError::Comment)?;
    Ok(r)
}

fn ifname(name: &str) -> Result<InterfaceName, NftError> {
    if name.is_empty() || name.len() >= 16 || name.contains('/') {
        return Err(NftError::BadIfName(name.to_owned()));
    }
    CString::new(name)
        .map(InterfaceName::Exact)
        .map_err(|_| NftError::BadIfName(name.to_owned()))
}

fn iif(r: &mut Rule<'_>, name: &InterfaceName) {
    r.add_expr(&nft_expr!(meta iifname));
    r.add_expr(&nft_expr!(cmp == name));
}

fn ether_type(r: &mut Rule<'_>, ty: u16) {
    r.add_expr(&nft_expr!(payload ethernet ethertype));
    r.add_expr(&nft_expr!(cmp == ty.to_be()));
}

/// `meta nfproto ipv4` (inet) / ether type IPv4 (bridge): both are covered by `meta protocol`.
fn ipv4(r: &mut Rule<'_>) {
    r.add_expr(&nftnl::expr::Meta::Protocol);
    r.add_expr(&nft_expr!(cmp == ETH_P_IP.to_be()));
}

fn l4(r: &mut Rule<'_>, proto: u8) {
    r.add_expr(&nft_expr!(meta l4proto));
    r.add_expr(&nft_expr!(cmp == proto));
}

fn established(r: &mut Rule<'_>) {
    use nftnl::expr::States;
    r.add_expr(&nft_expr!(ct state));
    let mask = (States::ESTABLISHED | States::RELATED).bits();
    r.add_expr(&nft_expr!(bitwise mask mask, xor 0u32));
    r.add_expr(&nft_expr!(cmp != 0u32));
}

fn drop_(r: &mut Rule<'_>) {
    r.add_expr(&nft_expr!(counter));
    r.add_expr(&nft_expr!(verdict drop));
}

/// Accept rules for one IPv4 `allow_cidrs` entry (one per port and protocol, or one for all ports).
fn cidr_rules<'a>(
    chain: &'a Chain<'_>,
    comment: &str,
    from: impl Fn(&mut Rule<'a>),
    cidr: &CidrRule,
) -> Result<Vec<Rule<'a>>, NftError> {
    let ipnet::IpNet::V4(net) = cidr.net else {
        return Ok(Vec::new());
    };
    let dst = |r: &mut Rule<'a>| {
        from(r);
        ipv4(r);
        r.add_expr(&nft_expr!(payload ipv4 daddr));
        r.add_expr(&nft_expr!(bitwise mask net.netmask(), xor Ipv4Addr::UNSPECIFIED));
        r.add_expr(&nft_expr!(cmp == net.network()));
    };
    let mut out = Vec::new();
    if cidr.ports.is_empty() {
        let mut r = rule(chain, comment)?;
        dst(&mut r);
        r.add_expr(&nft_expr!(verdict accept));
        out.push(r);
        return Ok(out);
    }
    for port in &cidr.ports {
        for proto in [IPPROTO_TCP, IPPROTO_UDP] {
            let mut r = rule(chain, comment)?;
            dst(&mut r);
            l4(&mut r, proto);
            // tcp and udp dport are both at offset 2 of the transport header.
            r.add_expr(&nft_expr!(payload tcp dport));
            r.add_expr(&nft_expr!(cmp == port.to_be()));
            r.add_expr(&nft_expr!(verdict accept));
            out.push(r);
        }
    }
    Ok(out)
}

/// The kernel ACKs every message of a batch (nftnl sets NLM_F_ACK on each) only after the whole
/// batch is processed, so the receive buffer must hold all ACKs at once (~1 KiB of accounting
/// each): thousands of rules overflow the default buffer (ENOBUFS).
/// The whole batch also goes out as one datagram, which must fit the send buffer.
fn size_buffers(socket: &mnl::Socket, messages: usize, batch_bytes: usize) -> Result<(), NftError> {
    use nix::sys::socket::{setsockopt, sockopt};
    use std::os::fd::AsRawFd;
    let rcv = (messages.saturating_mul(1024) + (1 << 20)).min(256 << 20);
    let snd = (batch_bytes.saturating_mul(2) + (1 << 20)).min(256 << 20);
    let raw = socket.as_raw_fd();
    #[expect(
        unsafe_code,
        reason = "mnl::Socket only exposes a RawFd; it outlives this borrow"
    )]
    // SAFETY: `raw` is the open fd of `socket`, which is borrowed for the whole call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
    let err = |e: nix::Error| NftError::Socket(std::io::Error::from(e));
    setsockopt(&fd, sockopt::RcvBufForce, &rcv).map_err(err)?;
    setsockopt(&fd, sockopt::SndBufForce, &snd).map_err(err)?;
    Ok(())
}

fn send(batch: &FinalizedBatch) -> Result<(), NftError> {
    let socket = mnl::Socket::new(mnl::Bus::Netfilter).map_err(NftError::Socket)?;
    let bytes: usize = batch.iter().map(<[u8]>::len).sum();
    size_buffers(&socket, batch.sequence_numbers().len(), bytes)?;
    let portid = socket.portid();
    socket.send_all(batch).map_err(NftError::Socket)?;
    let mut buffer = vec![0; nftnl::nft_nlmsg_maxsize() as usize];
    let mut expected = batch.sequence_numbers();
    while !expected.is_empty() {
        for message in socket.recv(&mut buffer[..]).map_err(NftError::Socket)? {
            let message = message.map_err(NftError::Socket)?;
            let Some(seq) = expected.next() else {
                return Err(NftError::Rejected(std::io::Error::other(
                    "unexpected extra netlink ACK",
                )));
            };
            mnl::cb_run(message, seq, portid).map_err(NftError::Rejected)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ruleset(n: usize) -> Ruleset {
        let mut r = Ruleset::new(Ipv4Addr::new(169, 254, 100, 1));
        for i in 0..n {
            r.containers.insert(
                format!("{i:064x}"),
                Enforced {
                    listener: SocketAddrV4::new(Ipv4Addr::new(169, 254, 100, 1), 40000 + i as u16),
                    allow_cidrs: vec![
                        CidrRule {
                            net: "198.18.0.10/32".parse().expect("test value"),
                            ports: vec![80, 443],
                        },
                        CidrRule {
                            net: "2001:db8::/32".parse().expect("test value"),
                            ports: vec![],
                        },
                    ],
                    endpoints: vec![Endpoint {
                        bridge: "br-0123456789ab".into(),
                        veth: format!("veth{i:07x}"),
                        mac: [2, 0x42, 198, 18, 0, i as u8],
                        ipv4: Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250) as u8 + 2),
                    }],
                },
            );
        }
        r
    }

    #[test]
    fn batch_is_one_datagram_with_room_to_spare() {
        for n in [0, 1, 50, 300] {
            let b = ruleset(n).build().expect("test value");
            assert_eq!(b.iter().count(), 1, "{n} containers");
            let bytes: usize = b.iter().map(<[u8]>::len).sum();
            // The estimate (24 KiB per endpoint/cidr) must cover the real size.
            assert!(
                bytes < (n * 3 * 24 * 1024 + (256 << 10)),
                "{n}: {bytes} bytes"
            );
            eprintln!(
                "{n} containers: {bytes} bytes, {} messages",
                b.sequence_numbers().len()
            );
        }
    }

    #[test]
    fn bad_interface_names_are_refused() {
        let mut r = ruleset(1);
        if let Some(c) = r.containers.values_mut().next() {
            c.endpoints[0].veth = "x".repeat(16);
        }
        assert!(matches!(r.build(), Err(NftError::BadIfName(_))));
    }
}
