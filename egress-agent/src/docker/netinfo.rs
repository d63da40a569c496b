//! Find a container's host-side veth and bridge, for the nftables host layer.
//!
//! Docker does not report the host-side interface. It is found through the container's network
//! namespace: there, the interface with the container's MAC has `link_index` = the ifindex of
//! its veth peer in the agent's namespace, whose `master` is the bridge. Both listings come from
//! `ip -j link show` (netlink, so they reflect the namespace of the caller, unlike /sys).
use std::fs::File;
use std::process::Command;

use serde::Deserialize;

use super::container::NetEndpoint;
use crate::nft::Endpoint;

#[derive(Debug, thiserror::Error)]
pub enum NetInfoError {
    #[error("opening the network namespace of pid {pid}: {source}")]
    Netns { pid: u32, source: std::io::Error },
    #[error("entering the network namespace of pid {pid}: {source}")]
    Setns { pid: u32, source: nix::Error },
    #[error("running `ip -j link show`: {0}")]
    Ip(String),
    #[error("container interface with MAC {mac} not found in its network namespace")]
    NoContainerIf { mac: String },
    #[error("host-side peer (ifindex {0}) not found or not on a bridge")]
    NoPeer(u32),
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
}

fn ip_links() -> Result<Vec<Link>, NetInfoError> {
    let out = Command::new("ip")
        .args(["-j", "link", "show"])
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
        let peer = host
            .iter()
            .find(|l| l.ifindex == peer_index)
            .ok_or(NetInfoError::NoPeer(peer_index))?;
        let bridge = peer
            .master
            .clone()
            .ok_or(NetInfoError::NoPeer(peer_index))?;
        out.push(Endpoint {
            bridge,
            veth: peer.ifname.clone(),
            mac: ep.mac,
            ipv4: ep.ipv4,
        });
    }
    Ok(out)
}
