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
//!   (c) an enforced container reaches no other host port — but its policy's
//!   `allow_host_services` ports at its bridge's own address (the gateway); (d) nor, whatever
//!   its `allow_cidrs` or host services say, the agent's own services (the console on
//!   `api.ui_listen`, metrics).
//!
//! **The guard (unclassified ports).** Until the agent has handled a container's `start`, its
//! frames must get nowhere — the kernel can't refuse `socket(AF_PACKET)` where BPF-LSM does not
//! load, and the per-endpoint rules above need the veth, which exists only once the container
//! runs. So every port (veth) of a container the agent classified is *known*: enforced
//! endpoints, and the ports of unlabelled containers ([`Ruleset::unrestricted`]). Frames of any
//! other port are tagged with [`GUARD_MARK`] in the bridge prerouting hook (a mark set in the
//! bridge input hook does not survive to the IP layer on this kernel, and `meta ibrname` is not
//! built: no CONFIG_NFT_BRIDGE_META). Then:
//! - `inet prerouting` (priority -350): tagged packets that came up through a **Docker bridge**
//!   ([`Ruleset::guarded_bridges`], learned from the Docker API) are dropped — nothing is routed
//!   anywhere or reaches a host service; on any other interface the tag is cleared.
//! - `bridge forward`: frames of an unknown port to a known port (a classified container) are
//!   dropped; what passes has its tag cleared.
//!
//! So frames of non-Docker bridges pass untouched, and a container on a Docker bridge is cut off
//! from its first instruction until its rules are written — fail closed, like a cgroup without a
//! kernel entry. Not covered: frames between two unclassified ports of the same bridge (two
//! containers that both just started; or an uplink enslaved to a Docker bridge), and ARP from an
//! unclassified port to the host (it can't leave the host; the per-endpoint ARP rules apply once
//! classified).
//!
//! Every change rebuilds both tables in **one atomic netlink batch** (add, delete, add again with
//! all rules), so packets see the old or the new ruleset, never a half-built one, and no rule
//! handles have to be tracked. `cleanup` (uninstall) deletes both tables; a mere stop leaves them
//! (while the agent is down, classified containers keep their network and new ones have none).
//! The rules apply in the network namespace of the calling thread.
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CStr, CString};
use std::net::{Ipv4Addr, SocketAddrV4};

use nftnl::expr::{CmpOp, InterfaceName};
use nftnl::{
    Batch, Chain, FinalizedBatch, Hook, MsgType, Policy, ProtoFamily, Rule, Table, nft_expr,
};

use egress_policy::CidrRule;

pub mod direct;
pub use direct::{DirectError, DirectSets};

/// Name of both of the agent's tables.
pub const TABLE: &CStr = c"egress_agent";
/// Priority of our base chains: before the default filter priority (0), so our drops are seen
/// whatever other tables accept (a drop anywhere wins; an accept only ends one chain).
const PRIORITY: i32 = -10;
/// The inet prerouting chain that drops what the bridge prerouting hook tagged: before
/// everything (raw is -300), so the tag never reaches other tables.
const PRE_PRIORITY: i32 = -350;
/// Set by the bridge prerouting hook on frames from unclassified ports; consumed (dropped or
/// cleared) by the bridge forward hook or the inet prerouting chain, so it never outlives the way
/// through the bridge. (A veth's frames arrive from another network namespace with mark 0: the
/// cross-namespace scrub clears it.)
pub const GUARD_MARK: u32 = 0x1000_0000;

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
    /// The bridge's own IPv4 address in the agent's namespace (the endpoint's gateway: where
    /// it reaches the host, and the `allow_host_services` rules open), if it has one.
    pub gateway: Option<Ipv4Addr>,
}

/// A port on the proxy address an enforced container may reach besides its listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProxyPort {
    Tcp(u16),
    Udp(u16),
}

/// The host-layer view of one enforced container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enforced {
    /// The container's policy listener (`proxy_ip:port`); with `redirects`, the only proxy
    /// ports it may reach.
    pub listener: SocketAddrV4,
    /// Its transparent listener and DNS responder ports on the listener's address (what the
    /// kernel redirects its connections and port-53 datagrams to).
    pub redirects: Vec<ProxyPort>,
    /// The policy's direct allows (IPv4 entries apply here; IPv6 is dropped for enforced
    /// endpoints at the bridge layer).
    pub allow_cidrs: Vec<CidrRule>,
    /// Peers allowed to connect in (`policy::kernel::inbound_allows`: `ports` are the
    /// container's local TCP ports): the container's replies to them may cross the bridge.
    pub allow_inbound: Vec<CidrRule>,
    /// Empty for `--network host` / `none` containers: those are confined by cgroup only.
    pub endpoints: Vec<Endpoint>,
    /// The ports of its policy's `{ host, ports }` entries (sorted, deduplicated): TCP to them is
    /// let through to the addresses in the container's direct set of that port
    /// ([`direct`]: filled from the agent's DNS answers, each until its TTL).
    pub direct_ports: Vec<u16>,
    /// Its policy's `allow_host_services` ports (sorted, deduplicated): TCP and UDP to them on
    /// each endpoint's [`Endpoint::gateway`] reach the host; no other address of the host.
    pub host_ports: Vec<u16>,
}

/// The whole ruleset: built from scratch on every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    /// The address the proxy listeners are bound to (the stable endpoint's IP).
    pub proxy_ip: Ipv4Addr,
    /// Enforced containers by id.
    pub containers: BTreeMap<String, Enforced>,
    /// Classified containers that are not restricted (unlabelled, `agent.unlabeled`): their
    /// host-side ports are known, so their frames pass the guard below untouched.
    pub unrestricted: BTreeMap<String, Vec<Endpoint>>,
    /// Bridges of Docker's bridge networks (`docker0`, `br-<id>`, custom names). A frame entering
    /// one of them from a port (veth) that belongs to no classified container is dropped.
    pub guarded_bridges: BTreeSet<String>,
    /// TCP ports of the agent's own services on this host (the console, metrics): no enforced
    /// container reaches them, whatever its `allow_cidrs` say (they come before (b)).
    pub agent_ports: BTreeSet<u16>,
}

impl Ruleset {
    pub fn new(proxy_ip: Ipv4Addr) -> Ruleset {
        Ruleset {
            proxy_ip,
            containers: BTreeMap::new(),
            unrestricted: BTreeMap::new(),
            guarded_bridges: BTreeSet::new(),
            agent_ports: BTreeSet::new(),
        }
    }

    /// Check the interface names of one container's endpoints (what [`Ruleset::apply`] would
    /// refuse), so a bad name is charged to its container rather than to the whole batch.
    pub fn check_endpoints(endpoints: &[Endpoint]) -> Result<(), NftError> {
        for ep in endpoints {
            ifname(&ep.veth)?;
            ifname(&ep.bridge)?;
        }
        Ok(())
    }

    /// Replace both tables with this ruleset, atomically, with the live elements of `direct`.
    pub fn apply(&self, direct: &DirectSets) -> Result<(), NftError> {
        direct.rebuild(self.direct_sets(), |live| {
            let batch = self.build(&live.sets)?;
            send(&batch)
        })?;
        tracing::debug!(
            containers = self.containers.len(),
            "nftables host layer applied"
        );
        Ok(())
    }

    /// The direct sets this ruleset creates: (container, port).
    fn direct_sets(&self) -> BTreeSet<direct::SetKey> {
        self.containers
            .iter()
            .filter(|(_, c)| !c.endpoints.is_empty())
            .flat_map(|(id, c)| c.direct_ports.iter().map(|p| (id.clone(), *p)))
            .collect()
    }

    // Long: one nftables batch in the order the kernel must receive it (tables, chains, sets
    // before the rules that look them up, per-endpoint rules, the guard, the proxy address);
    // the chains and sets every part uses are its locals, borrowed by each rule.
    fn build(
        &self,
        live: &BTreeMap<direct::SetKey, BTreeMap<Ipv4Addr, std::time::Instant>>,
    ) -> Result<FinalizedBatch, NftError> {
        // One page for the whole batch: the kernel needs begin..end in a single datagram (mnl
        // sends each page separately). ~40 rules of < 1 KiB per endpoint, generously.
        let endpoints: usize = self
            .containers
            .values()
            .map(|c| {
                c.endpoints.len() * (1 + c.host_ports.len().div_ceil(8)) + c.allow_cidrs.len()
            })
            .sum::<usize>()
            // Known ports and guarded bridges: two small rules each (< 1 KiB), counted generously.
            + self.unrestricted.values().map(Vec::len).sum::<usize>().div_ceil(8)
            + self.guarded_bridges.len().div_ceil(8);
        // Direct sets: a set and one rule per endpoint and port, and ~64 bytes per element.
        let direct: usize = self
            .containers
            .values()
            .map(|c| c.direct_ports.len() * (c.endpoints.len() + 1))
            .sum::<usize>()
            .div_ceil(8)
            + live
                .values()
                .map(BTreeMap::len)
                .sum::<usize>()
                .div_ceil(256);
        let page = ((endpoints + direct) * 24 * 1024 + (256 << 10)).next_power_of_two();
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
        let b_pre = base_chain(&bridge, c"prerouting", Hook::PreRouting);
        let b_in = base_chain(&bridge, c"input", Hook::In);
        let b_fwd = base_chain(&bridge, c"forward", Hook::Forward);
        let i_in = base_chain(&inet, c"input", Hook::In);
        let i_fwd = base_chain(&inet, c"forward", Hook::Forward);
        let mut i_pre = base_chain(&inet, c"prerouting", Hook::PreRouting);
        i_pre.set_hook(Hook::PreRouting, PRE_PRIORITY);
        for c in [&b_pre, &b_in, &b_fwd, &i_in, &i_fwd, &i_pre] {
            batch.add(c, MsgType::Add);
        }
        // Direct sets, before the rules that look them up, with the elements still alive.
        let now = std::time::Instant::now();
        let mut set_id = 0u32;
        let mut sets = BTreeMap::new();
        for key in self.direct_sets() {
            set_id += 1;
            let name = direct::set_name(&key.0, key.1);
            let mut set = direct::timeout_set(&name, set_id, &inet);
            batch.add(&set, MsgType::Add);
            if let Some(addrs) = live.get(&key) {
                for (addr, deadline) in addrs {
                    if let Some(left) = deadline
                        .checked_duration_since(now)
                        .filter(|d| !d.is_zero())
                    {
                        direct::push_element(&mut set, *addr, Some(left));
                    }
                }
                if addrs.values().any(|d| *d > now) {
                    batch.add(&direct::Elements(&set), MsgType::Add);
                }
            }
            sets.insert(key, nftnl::expr::Lookup::new(&set));
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
                // bridge forward: to another port of the same bridge only for allow_cidrs, and
                // replies (from an allowed local port) to peers allowed to connect in.
                for cidr in &c.allow_cidrs {
                    for r in cidr_rules(&b_fwd, &short, |r| iif(r, &veth), cidr, Port::Dst)? {
                        batch.add(&r, MsgType::Add);
                    }
                }
                for cidr in &c.allow_inbound {
                    for r in cidr_rules(&b_fwd, &short, |r| iif(r, &veth), cidr, Port::SrcTcp)? {
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
                // (a) its own listener, transparent listener and DNS responder only.
                let own = std::iter::once(ProxyPort::Tcp(c.listener.port()))
                    .chain(c.redirects.iter().copied());
                for port in own {
                    let mut r = rule(&i_in, &short)?;
                    from(&mut r);
                    r.add_expr(&nft_expr!(payload ipv4 daddr));
                    r.add_expr(&nft_expr!(cmp == *c.listener.ip()));
                    match port {
                        ProxyPort::Tcp(p) => {
                            l4(&mut r, IPPROTO_TCP);
                            r.add_expr(&nft_expr!(payload tcp dport));
                            r.add_expr(&nft_expr!(cmp == p.to_be()));
                        }
                        ProxyPort::Udp(p) => {
                            l4(&mut r, IPPROTO_UDP);
                            r.add_expr(&nft_expr!(payload udp dport));
                            r.add_expr(&nft_expr!(cmp == p.to_be()));
                        }
                    }
                    r.add_expr(&nft_expr!(verdict accept));
                    batch.add(&r, MsgType::Add);
                }
                // (d) the agent's own services (console, metrics) on any address of the host:
                // never, before allow_cidrs could let it through.
                for port in &self.agent_ports {
                    let mut r = rule(&i_in, &short)?;
                    from(&mut r);
                    l4(&mut r, IPPROTO_TCP);
                    r.add_expr(&nft_expr!(payload tcp dport));
                    r.add_expr(&nft_expr!(cmp == port.to_be()));
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);
                }
                // (c) the host services its policy allows, at its gateway only.
                if let Some(gw) = ep.gateway {
                    for port in &c.host_ports {
                        for proto in [IPPROTO_TCP, IPPROTO_UDP] {
                            let mut r = rule(&i_in, &short)?;
                            from(&mut r);
                            r.add_expr(&nft_expr!(payload ipv4 daddr));
                            r.add_expr(&nft_expr!(cmp == gw));
                            l4(&mut r, proto);
                            if proto == IPPROTO_TCP {
                                r.add_expr(&nft_expr!(payload tcp dport));
                            } else {
                                r.add_expr(&nft_expr!(payload udp dport));
                            }
                            r.add_expr(&nft_expr!(cmp == port.to_be()));
                            r.add_expr(&nft_expr!(verdict accept));
                            batch.add(&r, MsgType::Add);
                        }
                    }
                }
                // (b) allow_cidrs, forwarded or local; direct ports to the addresses in their set.
                for chain in [&i_in, &i_fwd] {
                    for cidr in &c.allow_cidrs {
                        for r in cidr_rules(chain, &short, from, cidr, Port::Dst)? {
                            batch.add(&r, MsgType::Add);
                        }
                    }
                    for port in &c.direct_ports {
                        let Some(lookup) = sets.get(&(id.clone(), *port)) else {
                            continue;
                        };
                        let mut r = rule(chain, &short)?;
                        from(&mut r);
                        l4(&mut r, IPPROTO_TCP);
                        r.add_expr(&nft_expr!(payload tcp dport));
                        r.add_expr(&nft_expr!(cmp == port.to_be()));
                        r.add_expr(&nft_expr!(payload ipv4 daddr));
                        r.add_expr(lookup);
                        r.add_expr(&nft_expr!(verdict accept));
                        batch.add(&r, MsgType::Add);
                    }
                    // (b)/(c) everything else from it.
                    let mut r = rule(chain, &short)?;
                    from(&mut r);
                    drop_(&mut r);
                    batch.add(&r, MsgType::Add);
                }
            }
        }

        // The guard: frames from a bridge port (veth) that no classified container owns — a
        // container the agent has not handled yet — get nowhere through a Docker bridge (fail
        // closed, like a cgroup without entry). This kernel has no `meta ibrname` (no
        // CONFIG_NFT_BRIDGE_META), so the bridge family can't tell which bridge a port belongs to;
        // the inet family can (the bridge is the input interface there) but can't see the port.
        // So: (1) the bridge prerouting hook tags every frame of an unknown port with GUARD_MARK
        // (a mark set in the bridge *input* hook does not reach the IP layer on this kernel:
        // measured); the inet prerouting chain drops tagged packets that came up through a Docker
        // bridge (to be routed anywhere, or for host services) and clears the tag on every other
        // interface. (2) The bridge forward hook drops frames of unknown ports to known ports
        // (every known port is a Docker container's) and clears the tag of what it lets through
        // (non-Docker bridges: untouched).
        let known = self
            .containers
            .values()
            .flat_map(|c| c.endpoints.iter())
            .chain(self.unrestricted.values().flatten());
        let mut known_ports: Vec<&str> = known.map(|ep| ep.veth.as_str()).collect();
        known_ports.sort_unstable();
        known_ports.dedup();
        let known_ports = known_ports
            .into_iter()
            .map(ifname)
            .collect::<Result<Vec<_>, _>>()?;
        for chain in [&b_pre, &b_fwd] {
            for port in &known_ports {
                let mut r = rule(chain, "known-port")?;
                iif(&mut r, port);
                r.add_expr(&nft_expr!(verdict accept));
                batch.add(&r, MsgType::Add);
            }
        }
        let mut r = rule(&b_pre, "unclassified-port")?;
        r.add_expr(&nft_expr!(meta mark));
        r.add_expr(&nft_expr!(bitwise mask !GUARD_MARK, xor GUARD_MARK));
        r.add_expr(&nft_expr!(meta mark set));
        batch.add(&r, MsgType::Add);
        for port in &known_ports {
            let mut r = rule(&b_fwd, "unclassified-port")?;
            r.add_expr(&nft_expr!(meta oifname));
            r.add_expr(&nft_expr!(cmp == port));
            drop_(&mut r);
            batch.add(&r, MsgType::Add);
        }
        let tagged = |r: &mut Rule<'_>| {
            r.add_expr(&nft_expr!(meta mark));
            r.add_expr(&nft_expr!(bitwise mask GUARD_MARK, xor 0u32));
            r.add_expr(&nft_expr!(cmp != 0u32));
        };
        for br in &self.guarded_bridges {
            let mut r = rule(&i_pre, "unclassified-port")?;
            iif(&mut r, &ifname(br)?);
            tagged(&mut r);
            drop_(&mut r);
            batch.add(&r, MsgType::Add);
        }
        for chain in [&i_pre, &b_fwd] {
            let mut r = rule(chain, "unclassified-port")?;
            tagged(&mut r);
            r.add_expr(&nft_expr!(meta mark));
            r.add_expr(&nft_expr!(bitwise mask !GUARD_MARK, xor 0u32));
            r.add_expr(&nft_expr!(meta mark set));
            batch.add(&r, MsgType::Add);
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

/// Whether the agent's tables exist (the bridge one is written in the same batch as the inet
/// one, so it stands for both). Asks the kernel for exactly that table, never lists others.
pub fn tables_exist() -> Result<bool, NftError> {
    const NFNL_SUBSYS_NFTABLES: u16 = 10;
    const NFT_MSG_GETTABLE: u16 = 1;
    const NFTA_TABLE_NAME: u16 = 1;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    let socket = mnl::Socket::new(mnl::Bus::Netfilter).map_err(NftError::Socket)?;
    let seq: u32 = 1;
    let name = TABLE.to_bytes_with_nul();
    let attr_len = 4 + name.len();
    let padded = attr_len.div_ceil(4) * 4;
    let total = 16 + 4 + padded;
    let mut msg = Vec::with_capacity(total);
    msg.extend_from_slice(&(total as u32).to_ne_bytes());
    msg.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE).to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family, version, resource id (big endian).
    msg.extend_from_slice(&[ProtoFamily::Bridge as u8, 0, 0, 0]);
    msg.extend_from_slice(&(attr_len as u16).to_ne_bytes());
    msg.extend_from_slice(&NFTA_TABLE_NAME.to_ne_bytes());
    msg.extend_from_slice(name);
    msg.resize(total, 0);
    socket.send(&msg).map_err(NftError::Socket)?;
    let mut buffer = vec![0u8; nftnl::nft_nlmsg_maxsize() as usize];
    let mut found = false;
    loop {
        let n = socket.recv_raw(&mut buffer).map_err(NftError::Socket)?;
        if n == 0 {
            return Err(NftError::Rejected(std::io::Error::other(
                "netlink socket closed",
            )));
        }
        let mut off = 0;
        while off + 16 <= n {
            let len = u32::from_ne_bytes([
                buffer[off],
                buffer[off + 1],
                buffer[off + 2],
                buffer[off + 3],
            ]) as usize;
            let ty = u16::from_ne_bytes([buffer[off + 4], buffer[off + 5]]);
            if len < 16 || off + len > n {
                return Err(NftError::Rejected(std::io::Error::other(
                    "malformed netlink reply",
                )));
            }
            match ty {
                NLMSG_ERROR if len >= 20 => {
                    let b = &buffer[off + 16..off + 20];
                    let err = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                    return match err {
                        0 => Ok(found),
                        e if -e == libc::ENOENT => Ok(false),
                        e => Err(NftError::Rejected(std::io::Error::from_raw_os_error(-e))),
                    };
                }
                NLMSG_DONE => return Ok(found),
                _ => found = true,
            }
            off += len.div_ceil(4) * 4;
        }
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

/// Which port of a packet a CIDR rule's ports are matched against.
#[derive(Clone, Copy)]
enum Port {
    /// The destination port, TCP and UDP (`allow_cidrs`: services the container may reach).
    Dst,
    /// The TCP source port (inbound allows: the container's listener answering a peer).
    SrcTcp,
}

/// Accept rules for one IPv4 rule towards `cidr.net` (one per port and protocol, or one for all
/// ports).
fn cidr_rules<'a>(
    chain: &'a Chain<'_>,
    comment: &str,
    from: impl Fn(&mut Rule<'a>),
    cidr: &CidrRule,
    port: Port,
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
    let protos: &[u8] = match port {
        Port::Dst => &[IPPROTO_TCP, IPPROTO_UDP],
        Port::SrcTcp => &[IPPROTO_TCP],
    };
    if cidr.ports.is_empty() {
        for proto in protos.iter().filter(|_| matches!(port, Port::SrcTcp)) {
            let mut r = rule(chain, comment)?;
            dst(&mut r);
            l4(&mut r, *proto);
            r.add_expr(&nft_expr!(verdict accept));
            out.push(r);
        }
        if matches!(port, Port::Dst) {
            let mut r = rule(chain, comment)?;
            dst(&mut r);
            r.add_expr(&nft_expr!(verdict accept));
            out.push(r);
        }
        return Ok(out);
    }
    for p in &cidr.ports {
        for proto in protos {
            let mut r = rule(chain, comment)?;
            dst(&mut r);
            l4(&mut r, *proto);
            // tcp and udp ports sit at the same offsets (sport 0, dport 2) of the header.
            match port {
                Port::Dst => r.add_expr(&nft_expr!(payload tcp dport)),
                Port::SrcTcp => r.add_expr(&nft_expr!(payload tcp sport)),
            }
            r.add_expr(&nft_expr!(cmp == p.to_be()));
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
                    redirects: vec![ProxyPort::Udp(41000 + i as u16)],
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
                    allow_inbound: vec![CidrRule {
                        net: "198.18.0.0/24".parse().expect("test value"),
                        ports: vec![8080],
                    }],
                    endpoints: vec![Endpoint {
                        bridge: "br-0123456789ab".into(),
                        veth: format!("veth{i:07x}"),
                        mac: [2, 0x42, 198, 18, 0, i as u8],
                        ipv4: Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250) as u8 + 2),
                        gateway: Some(Ipv4Addr::new(198, 18, 0, 1)),
                    }],
                    direct_ports: vec![22, 2222],
                    host_ports: vec![11434],
                },
            );
            // As many unlabelled containers, known ports on the same bridge.
            r.unrestricted.insert(
                format!("u{i:063x}"),
                vec![Endpoint {
                    bridge: "br-0123456789ab".into(),
                    veth: format!("vethu{i:06x}"),
                    mac: [2, 0x42, 198, 19, 0, i as u8],
                    ipv4: Ipv4Addr::new(198, 19, (i / 250) as u8, (i % 250) as u8 + 2),
                    gateway: None,
                }],
            );
        }
        r.guarded_bridges.insert("docker0".into());
        r.guarded_bridges.insert("br-0123456789ab".into());
        r
    }

    #[test]
    fn batch_is_one_datagram_with_room_to_spare() {
        for n in [0, 1, 50, 300] {
            let b = ruleset(n).build(&BTreeMap::new()).expect("test value");
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
    fn direct_sets_and_their_elements_fit_the_batch() {
        let r = ruleset(50);
        let now = std::time::Instant::now();
        let mut live = BTreeMap::new();
        for id in r.containers.keys() {
            let addrs: BTreeMap<Ipv4Addr, std::time::Instant> = (0..200u32)
                .map(|i| {
                    (
                        Ipv4Addr::from(0x2d5a_0000 + i),
                        now + std::time::Duration::from_secs(60),
                    )
                })
                .collect();
            live.insert((id.clone(), 22), addrs);
        }
        let b = r.build(&live).expect("test value");
        assert_eq!(b.iter().count(), 1);
        assert_eq!(r.direct_sets().len(), 100, "two ports of 50 containers");
    }

    #[test]
    fn guard_rules_need_no_containers() {
        // Bridges guarded before any container is classified: still one valid datagram.
        let mut r = Ruleset::new(Ipv4Addr::new(169, 254, 100, 1));
        r.guarded_bridges.insert("egd-br0".into());
        let b = r.build(&BTreeMap::new()).expect("test value");
        assert_eq!(b.iter().count(), 1);
        r.guarded_bridges.insert("x".repeat(16));
        assert!(matches!(
            r.build(&BTreeMap::new()),
            Err(NftError::BadIfName(_))
        ));
        let mut r = ruleset(1);
        if let Some(eps) = r.unrestricted.values_mut().next() {
            eps[0].veth = "a/b".into();
        }
        assert!(matches!(
            r.build(&BTreeMap::new()),
            Err(NftError::BadIfName(_))
        ));
        assert!(
            Ruleset::check_endpoints(&r.unrestricted.values().next().cloned().unwrap_or_default())
                .is_err()
        );
    }

    #[test]
    fn bad_interface_names_are_refused() {
        let mut r = ruleset(1);
        if let Some(c) = r.containers.values_mut().next() {
            c.endpoints[0].veth = "x".repeat(16);
        }
        assert!(matches!(
            r.build(&BTreeMap::new()),
            Err(NftError::BadIfName(_))
        ));
    }
}
