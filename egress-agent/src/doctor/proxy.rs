//! Proxy listeners accept connections.
//!
//! Confined processes connect to the stable endpoint and the kernel rewrites the connection to their
//! policy's own listener (bound on port 0), so nothing has to listen on the endpoint itself. The
//! listeners are taken from the options (e.g. the control API's status) or discovered: the TCP
//! sockets in LISTEN state held by processes named `egress-agent` (`/proc/<pid>/fd` → socket inode →
//! `/proc/<pid>/net/tcp{,6}`). Listeners are judged by their LISTEN state, never connected to:
//! a listener serves only its own workload and records anyone else as `listener-foreign-peer`
//! (the status page runs these probes every few seconds). Only the stable endpoint is connected
//! to: nothing listens there (the kernel rewrites confined connections), and the doctor runs
//! outside any enforcement root, so its connect is not rewritten.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use tokio::net::TcpStream;

use super::{Ctx, Outcome, blocking};

/// Parse `/proc/net/tcp` or `tcp6` text: local addresses of sockets in LISTEN state, with inodes.
pub(super) fn parse_proc_net_tcp(text: &str) -> Vec<(SocketAddr, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // sl local rem st tx:rx tr:tm retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "0A" {
                return None;
            }
            let (ip, port) = f[1].split_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            // The kernel prints the address as native-endian u32 words of network-order bytes.
            let ip = match ip.len() {
                8 => IpAddr::V4(Ipv4Addr::from(
                    u32::from_str_radix(ip, 16).ok()?.to_ne_bytes(),
                )),
                32 => {
                    let mut b = [0u8; 16];
                    for i in 0..4 {
                        let w = u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok()?;
                        b[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
                    }
                    IpAddr::V6(Ipv6Addr::from(b))
                }
                _ => return None,
            };
            Some((SocketAddr::new(ip, port), f[9].parse().ok()?))
        })
        .collect()
}

/// What the /proc scan found.
#[derive(Debug, Default)]
pub(super) struct Discovery {
    pub pids: Vec<u32>,
    pub listeners: Vec<SocketAddr>,
    /// Some agent process's fds could not be read (not root).
    pub denied: bool,
}

pub(super) fn discover(proc_dir: &Path, comm: &str) -> std::io::Result<Discovery> {
    let mut d = Discovery::default();
    let mut seen = HashSet::new();
    for e in std::fs::read_dir(proc_dir)? {
        let Ok(e) = e else { continue };
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // `egress-agent doctor` is itself an egress-agent process.
        if pid == std::process::id() {
            continue;
        }
        let dir = e.path();
        let Ok(c) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if c.trim_end() != comm {
            continue;
        }
        d.pids.push(pid);
        let inodes: HashSet<u64> = match std::fs::read_dir(dir.join("fd")) {
            Ok(fds) => fds
                .filter_map(|f| std::fs::read_link(f.ok()?.path()).ok())
                .filter_map(|l| {
                    l.to_str()?
                        .strip_prefix("socket:[")?
                        .strip_suffix(']')?
                        .parse()
                        .ok()
                })
                .collect(),
            Err(_) => {
                d.denied = true;
                continue;
            }
        };
        for f in ["net/tcp", "net/tcp6"] {
            let text = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            for (addr, inode) in parse_proc_net_tcp(&text) {
                if inodes.contains(&inode) && seen.insert(addr) {
                    d.listeners.push(addr);
                }
            }
        }
    }
    d.listeners.sort();
    Ok(d)
}

/// The address to connect to for a listener (wildcards → loopback of the same family).
fn connect_addr(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), a.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), a.port())
        }
        _ => a,
    }
}

/// The sockets in LISTEN state of this network namespace (`<proc>/net/tcp{,6}`).
fn listening_sockets(proc_dir: &Path) -> Vec<SocketAddr> {
    ["net/tcp", "net/tcp6"]
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(proc_dir.join(f)).unwrap_or_default();
            parse_proc_net_tcp(&text)
        })
        .map(|(addr, _)| addr)
        .collect()
}

/// Does one of `listening` accept connections to `a` (the same address and port, or a wildcard
/// of its family — an IPv6 wildcard takes both — on its port)?
fn covered(listening: &[SocketAddr], a: SocketAddr) -> bool {
    listening.iter().any(|l| {
        l.port() == a.port()
            && (l.ip() == a.ip()
                || (l.ip().is_unspecified() && (l.is_ipv6() || l.is_ipv4() == a.is_ipv4())))
    })
}

async fn accepts(ctx: &Ctx, a: SocketAddr) -> bool {
    let t = ctx.opts.probe_timeout / 3;
    matches!(
        tokio::time::timeout(t, TcpStream::connect(connect_addr(a))).await,
        Ok(Ok(_))
    )
}

// Long: one probe's cases (configured or discovered listeners, the endpoint up or not), each
// ending in its own outcome, in the order they are told apart.
pub(super) async fn listening(ctx: Arc<Ctx>) -> Outcome {
    const START: &str =
        "start the agent (systemctl start egress-agent) and check `journalctl -u egress-agent`";
    let endpoint_up = accepts(&ctx, ctx.opts.proxy_endpoint).await;
    let mut pids = Vec::new();
    let (listeners, source) = if ctx.opts.proxy_listeners.is_empty() {
        let proc_dir = ctx.opts.paths.proc_dir.clone();
        let comm = ctx.opts.agent_process_name.clone();
        let d = match blocking(move || discover(&proc_dir, &comm)).await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                return Outcome::skip(
                    format!("cannot scan /proc: {e}"),
                    "run on the host with /proc mounted",
                );
            }
            None => return Outcome::skip("cannot scan /proc", "re-run"),
        };
        if d.pids.is_empty() {
            return if endpoint_up {
                Outcome::pass(format!(
                    "endpoint {} accepts connections",
                    ctx.opts.proxy_endpoint
                ))
            } else {
                Outcome::fail(
                    format!("no {} process is running", ctx.opts.agent_process_name),
                    START,
                )
            };
        }
        if d.listeners.is_empty() && d.denied {
            return if endpoint_up {
                Outcome::pass(format!(
                    "endpoint {} accepts connections",
                    ctx.opts.proxy_endpoint
                ))
            } else {
                Outcome::skip(
                    format!(
                        "{} runs (pid {:?}) but its sockets are not readable",
                        ctx.opts.agent_process_name, d.pids
                    ),
                    "run doctor as root",
                )
            };
        }
        pids = d.pids;
        let ignore = &ctx.opts.ignore_listeners;
        (
            d.listeners
                .into_iter()
                .filter(|a| !ignore.contains(a))
                .collect(),
            "discovered",
        )
    } else {
        (ctx.opts.proxy_listeners.clone(), "configured")
    };
    if listeners.is_empty() {
        return if endpoint_up {
            Outcome::pass(format!(
                "endpoint {} accepts connections",
                ctx.opts.proxy_endpoint
            ))
        } else {
            Outcome::fail(
                format!(
                    "{} runs (pid {}) but has no listening socket (no policy listeners)",
                    ctx.opts.agent_process_name,
                    pids.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                START,
            )
        };
    }
    // Discovered listeners are in LISTEN state: the kernel completes their handshakes.
    // Configured ones (the daemon's own, from its status) are looked up in this namespace's
    // LISTEN sockets. Neither is connected to: a probe would be a `listener-foreign-peer`
    // denial (see the module's comment).
    let mut down = Vec::new();
    if source == "configured" {
        let proc_dir = ctx.opts.paths.proc_dir.clone();
        let listening = blocking(move || listening_sockets(&proc_dir))
            .await
            .unwrap_or_default();
        down = listeners
            .iter()
            .filter(|a| !covered(&listening, **a))
            .map(ToString::to_string)
            .collect();
    }
    let exposed: Vec<String> = listeners
        .iter()
        .filter(|a| a.ip().is_unspecified())
        .map(ToString::to_string)
        .collect();
    let list = listeners
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if !down.is_empty() {
        return Outcome::fail(
            format!(
                "{} of {} {source} listeners are not listening: {}",
                down.len(),
                listeners.len(),
                down.join(", ")
            ),
            START,
        );
    }
    if !exposed.is_empty() {
        return Outcome::warn(
            format!(
                "listeners bound to a wildcard address ({}) are reachable from the network",
                exposed.join(", ")
            ),
            "set proxy.listen to the endpoint's IP (e.g. 127.0.0.1 or the Docker bridge address)",
        );
    }
    Outcome::pass(format!(
        "{} {source} listeners are listening ({list})",
        listeners.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_endian = "little")]
    fn parses_listen_sockets() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:0C38 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n   1: 0100007F:0C38 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 999 1\n";
        let got = parse_proc_net_tcp(v4);
        assert_eq!(got, vec![("127.0.0.1:3128".parse().expect("addr"), 12345)]);
        let v6 = "hdr\n   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1\n";
        assert_eq!(
            parse_proc_net_tcp(v6),
            vec![("[::1]:8080".parse().expect("addr"), 777)]
        );
    }

    #[test]
    fn a_configured_listener_is_covered_by_its_own_or_a_wildcard_socket() {
        let a = |s: &str| -> SocketAddr { s.parse().expect("addr") };
        let listening = [a("127.0.0.1:4000"), a("0.0.0.0:4001"), a("[::]:4002")];
        assert!(covered(&listening, a("127.0.0.1:4000")));
        assert!(!covered(&listening, a("127.0.0.2:4000")));
        assert!(covered(&listening, a("169.254.100.1:4001")));
        assert!(!covered(&listening, a("[::1]:4001")));
        assert!(covered(&listening, a("[::1]:4002")));
        assert!(covered(&listening, a("10.0.0.1:4002")));
        assert!(!covered(&listening, a("127.0.0.1:4003")));
    }
}
