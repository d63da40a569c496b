//! Find a workload's host-side veth and bridge, for the nftables host layer.
//!
//! Neither Docker nor containerd reports the host-side interface. It is found through the
//! workload's network namespace: there, the workload's interface has `link_index` = the ifindex
//! of its veth peer in the agent's namespace, whose `master` is the bridge. A Docker container's
//! interfaces are the ones with its endpoints' MACs; a pod's are every veth of its sandbox's
//! namespace with an IPv4 address (the CNI plugin's, whatever it is). Both listings come from
//! `ip -j addr show` (netlink, so they reflect the namespace of the caller, unlike /sys).
use std::fs::File;
use std::process::Command;

use serde::Deserialize;

use super::info::{NetEndpoint, parse_mac};
use crate::nft::Endpoint;

#[derive(Debug, thiserror::Error)]
pub enum NetInfoError {
    #[error("opening the network namespace of pid {pid}: {source}")]
    Netns { pid: u32, source: std::io::Error },
    #[error("entering the network namespace of pid {pid}: {source}")]
    Setns { pid: u32, source: nix::Error },
    #[error("running `ip -j addr show`: {0}")]
    Ip(String),
    #[error("container interface with MAC {mac} not found in its network namespace")]
    NoContainerIf { mac: String },
    #[error("host-side peer (ifindex {0}) not found or not on a bridge")]
    NoPeer(u32),
    #[error(
        "pod interface {ifname} is a veth whose host side {veth} is not on a bridge: the nftables host layer covers bridge CNIs (e.g. the `bridge` plugin); run with --no-nft on nodes whose CNI routes veths (the cgroup programs still confine the pod)"
    )]
    NotBridged { ifname: String, veth: String },
    #[error(
        "no veth with an IPv4 address in the pod's network namespace (pid {pid}): the CNI plugin has not set it up"
    )]
    NoPodIf { pid: u32 },
}

#[derive(Debug, Deserialize)]
struct AddrInfo {
    family: String,
    /// Either family's address (parsed per `family`).
    #[serde(default)]
    local: Option<String>,
    #[serde(default)]
    prefixlen: Option<u8>,
}

#[derive(Debug, Deserialize)]
struct Link {
    ifindex: u32,
    ifname: String,
    #[serde(default)]
    link_index: Option<u32>,
    #[serde(default)]
    master: Option<String>,
    #[serde(default)]
    address: Option<String>,
    #[serde(default)]
    addr_info: Vec<AddrInfo>,
}

impl Link {
    fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        self.addr_info
            .iter()
            .filter(|a| a.family == "inet")
            .find_map(|a| a.local.as_deref()?.parse().ok())
    }
}

/// The IPv4 address of `bridge` (in the agent's namespace) on the subnet of `inside`: the
/// endpoint's gateway, where it reaches the host. The first IPv4 address when none is on that
/// subnet; `None` for a bridge without one.
fn gateway(host: &[Link], bridge: &str, inside: std::net::Ipv4Addr) -> Option<std::net::Ipv4Addr> {
    let link = host.iter().find(|l| l.ifname == bridge)?;
    let addrs: Vec<(std::net::Ipv4Addr, u8)> = link
        .addr_info
        .iter()
        .filter(|a| a.family == "inet")
        .filter_map(|a| Some((a.local.as_deref()?.parse().ok()?, a.prefixlen.unwrap_or(32))))
        .collect();
    addrs
        .iter()
        .find(|(a, len)| ipnet::Ipv4Net::new(*a, *len).is_ok_and(|n| n.trunc().contains(&inside)))
        .or(addrs.first())
        .map(|(a, _)| *a)
}

fn ip_links() -> Result<Vec<Link>, NetInfoError> {
    let exe = crate::host_tool::find("ip").map_err(|e| NetInfoError::Ip(e.to_string()))?;
    let out = Command::new(exe)
        .args(["-j", "addr", "show"])
        .output()
        .map_err(|e| NetInfoError::Ip(e.to_string()))?;
    if !out.status.success() {
        return Err(NetInfoError::Ip(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| NetInfoError::Ip(e.to_string()))
}

/// Links of the network namespace of `pid` (read from a short-lived thread that enters it, so
/// the agent's own threads never change namespace).
fn links_of_pid(pid: u32) -> Result<Vec<Link>, NetInfoError> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))
        .map_err(|source| NetInfoError::Netns { pid, source })?;
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|source| NetInfoError::Setns { pid, source })?;
            ip_links()
        })
        .join()
        .map_err(|_| NetInfoError::Ip("netns thread panicked".to_owned()))?
    })
}

fn mac_str(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The host-side endpoints of the running container `pid`, one per Docker endpoint.
/// Blocking (spawns `ip` twice); call from `spawn_blocking`.
pub fn host_endpoints(pid: u32, endpoints: &[NetEndpoint]) -> Result<Vec<Endpoint>, NetInfoError> {
    if endpoints.is_empty() {
        return Ok(Vec::new());
    }
    let inside = links_of_pid(pid)?;
    let host = ip_links()?;
    let mut out = Vec::new();
    for ep in endpoints {
        let mac = mac_str(&ep.mac);
        let cif = inside
            .iter()
            .find(|l| {
                l.address
                    .as_deref()
                    .is_some_and(|a| a.eq_ignore_ascii_case(&mac))
            })
            .ok_or_else(|| NetInfoError::NoContainerIf { mac: mac.clone() })?;
        let peer_index = cif.link_index.ok_or(NetInfoError::NoPeer(0))?;
        let peer = host_peer(host.as_slice(), peer_index)?;
        let bridge = peer
            .master
            .clone()
            .ok_or(NetInfoError::NoPeer(peer_index))?;
        out.push(Endpoint {
            gateway: gateway(&host, &bridge, ep.ipv4),
            bridge,
            veth: peer.ifname.clone(),
            mac: ep.mac,
            ipv4: ep.ipv4,
        });
    }
    Ok(out)
}

/// The agent-side link with index `peer_index` (a veth's other end).
fn host_peer(host: &[Link], peer_index: u32) -> Result<&Link, NetInfoError> {
    host.iter()
        .find(|l| l.ifindex == peer_index)
        .ok_or(NetInfoError::NoPeer(peer_index))
}

/// The host-side endpoints of a pod whose sandbox runs as `pid`: every interface of its network
/// namespace that has a peer in the agent's namespace (a veth) and an IPv4 address. Blocking
/// (spawns `ip` twice); call from `spawn_blocking`.
pub fn pod_endpoints(pid: u32) -> Result<Vec<Endpoint>, NetInfoError> {
    let inside = links_of_pid(pid)?;
    let host = ip_links()?;
    pod_endpoints_of(pid, &inside, &host)
}

fn pod_endpoints_of(
    pid: u32,
    inside: &[Link],
    host: &[Link],
) -> Result<Vec<Endpoint>, NetInfoError> {
    let mut out = Vec::new();
    for l in inside {
        let (Some(peer_index), Some(ipv4), Some(mac)) = (
            l.link_index,
            l.ipv4(),
            l.address.as_deref().and_then(parse_mac),
        ) else {
            continue;
        };
        let peer = host_peer(host, peer_index)?;
        let bridge = peer
            .master
            .clone()
            .ok_or_else(|| NetInfoError::NotBridged {
                ifname: l.ifname.clone(),
                veth: peer.ifname.clone(),
            })?;
        out.push(Endpoint {
            gateway: gateway(host, &bridge, ipv4),
            bridge,
            veth: peer.ifname.clone(),
            mac,
            ipv4,
        });
    }
    if out.is_empty() {
        return Err(NetInfoError::NoPodIf { pid });
    }
    Ok(out)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    /// `ip -j addr show` as iproute2 prints it: inside a CNI bridge pod, and on the host.
    const INSIDE: &str = r#"[{"ifindex":1,"ifname":"lo","flags":["LOOPBACK","UP"],"mtu":65536,"link_type":"loopback","address":"00:00:00:00:00:00","addr_info":[{"family":"inet","local":"127.0.0.1","prefixlen":8}]},
      {"ifindex":2,"link_index":17,"ifname":"eth0","flags":["BROADCAST","UP"],"mtu":1500,"link_type":"ether","address":"5a:0c:2e:91:aa:01","link_netnsid":0,"addr_info":[{"family":"inet","local":"198.18.8.5","prefixlen":24},{"family":"inet6","local":"fe80::1","prefixlen":64}]}]"#;
    const HOST: &str = r#"[{"ifindex":16,"ifname":"cni0","flags":["UP"],"address":"aa:bb:cc:dd:ee:ff","addr_info":[{"family":"inet","local":"10.9.0.1","prefixlen":16},{"family":"inet","local":"198.18.8.1","prefixlen":24}]},
      {"ifindex":17,"link_index":2,"ifname":"veth1a2b3c4d","master":"cni0","address":"d2:00:00:00:00:01","link_netnsid":1,"addr_info":[]}]"#;

    fn links(json: &str) -> Vec<Link> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_bridge_pods_veth_and_address_are_found() {
        let eps = pod_endpoints_of(7, &links(INSIDE), &links(HOST)).unwrap();
        assert_eq!(
            eps,
            vec![Endpoint {
                bridge: "cni0".to_owned(),
                veth: "veth1a2b3c4d".to_owned(),
                mac: [0x5a, 0x0c, 0x2e, 0x91, 0xaa, 0x01],
                ipv4: "198.18.8.5".parse().unwrap(),
                // The bridge's address on the pod's subnet, not its first one.
                gateway: Some("198.18.8.1".parse().unwrap()),
            }]
        );
        // A bridge without an address of its own: no gateway (no host services open).
        let bare = HOST.replace(
            r#"[{"family":"inet","local":"10.9.0.1","prefixlen":16},{"family":"inet","local":"198.18.8.1","prefixlen":24}]"#,
            "[]",
        );
        let eps = pod_endpoints_of(7, &links(INSIDE), &links(&bare)).unwrap();
        assert_eq!(eps[0].gateway, None);
    }

    #[test]
    fn a_routed_veth_or_a_missing_interface_is_an_error_that_says_why() {
        let routed = HOST.replace(r#""master":"cni0","#, "");
        let e = pod_endpoints_of(7, &links(INSIDE), &links(&routed)).unwrap_err();
        assert!(e.to_string().contains("--no-nft"), "{e}");
        let no_ip = INSIDE.replace(
            r#"{"family":"inet","local":"198.18.8.5","prefixlen":24},"#,
            "",
        );
        let e = pod_endpoints_of(7, &links(&no_ip), &links(HOST)).unwrap_err();
        assert!(e.to_string().contains("CNI"), "{e}");
        let gone = HOST.replace(r#""ifindex":17"#, r#""ifindex":18"#);
        assert!(matches!(
            pod_endpoints_of(7, &links(INSIDE), &links(&gone)),
            Err(NetInfoError::NoPeer(17))
        ));
    }
}
