//! What the agent takes from `docker inspect` (and from a `create` event) into the workload's
//! [`ContainerInfo`], and the checks that make an opted-in container impossible to confine
//! (→ refused).
use std::collections::HashMap;

use bollard::models::ContainerInspectResponse;

use crate::workload::info::{ContainerInfo, NetEndpoint, parse_mac};

impl ContainerInfo {
    pub fn from_inspect(c: &ContainerInspectResponse) -> Option<ContainerInfo> {
        let id = c.id.clone()?;
        let name = c
            .name
            .clone()
            .unwrap_or_default()
            .trim_start_matches('/')
            .to_owned();
        let labels = c
            .config
            .as_ref()
            .and_then(|cfg| cfg.labels.clone())
            .unwrap_or_default();
        let state = c.state.as_ref();
        let running = state.and_then(|s| s.running).unwrap_or(false);
        let pid = state
            .and_then(|s| s.pid)
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| running && *p > 0);
        let hc = c.host_config.as_ref();
        let cgroup_parent = hc.and_then(|h| h.cgroup_parent.clone()).unwrap_or_default();
        let network_mode = hc.and_then(|h| h.network_mode.clone()).unwrap_or_default();
        let auto_remove = hc.and_then(|h| h.auto_remove).unwrap_or(false);
        let published_tcp = hc
            .and_then(|h| h.port_bindings.as_ref())
            .map(published_tcp)
            .unwrap_or_default();
        let mut endpoints = Vec::new();
        if let Some(nets) = c
            .network_settings
            .as_ref()
            .and_then(|n| n.networks.as_ref())
        {
            for (network, ep) in nets {
                let ip = ep
                    .ip_address
                    .as_deref()
                    .and_then(|s| s.parse::<std::net::Ipv4Addr>().ok());
                let mac = ep.mac_address.as_deref().and_then(parse_mac);
                if let (Some(ipv4), Some(mac)) = (ip, mac) {
                    endpoints.push(NetEndpoint {
                        network: network.clone(),
                        mac,
                        ipv4,
                    });
                }
            }
        }
        endpoints.sort_by(|a, b| a.network.cmp(&b.network));
        let mut unconfinable = Vec::new();
        if let Some(h) = hc {
            if h.privileged == Some(true) {
                unconfinable.push("privileged".to_owned());
            }
            for cap in h.cap_add.iter().flatten() {
                let c = cap.to_ascii_uppercase();
                let c = c.strip_prefix("CAP_").unwrap_or(&c);
                if matches!(
                    c,
                    "ALL" | "NET_ADMIN" | "SYS_ADMIN" | "BPF" | "SYS_MODULE" | "SYS_PTRACE"
                ) {
                    unconfinable.push(format!("cap-add {c}"));
                }
            }
            if h.pid_mode.as_deref() == Some("host") {
                // Host pid namespace + root could ptrace/nsenter host processes outside the root.
                unconfinable.push("pid=host".to_owned());
            }
        }
        for m in c.mounts.iter().flatten() {
            if let Some(src) = m.source.as_deref()
                && dangerous_mount(src)
            {
                unconfinable.push(format!("mount of {src}"));
            }
        }
        let env = crate::exposure::WorkloadEnv::from_entries(
            None,
            c.config
                .as_ref()
                .and_then(|cfg| cfg.env.as_ref())
                .into_iter()
                .flatten()
                .map(String::as_str),
        );
        Some(ContainerInfo {
            env,
            id,
            name,
            labels,
            running,
            pid,
            cgroup_parent,
            network_mode,
            endpoints,
            auto_remove,
            published_tcp,
            unconfinable,
            pod: None,
        })
    }

    /// What a `create` event tells without asking the daemon (which holds the container's lock
    /// while `start` runs: an inspect right after `create` would return only after the start).
    /// Labels come from the event's attributes; the cgroup parent is assumed to be the default
    /// (the full inspect that follows corrects it).
    pub fn from_event(id: &str, attributes: &HashMap<String, String>) -> ContainerInfo {
        ContainerInfo {
            id: id.to_owned(),
            name: attributes.get("name").cloned().unwrap_or_default(),
            labels: attributes.clone(),
            running: false,
            pid: None,
            cgroup_parent: String::new(),
            network_mode: String::new(),
            endpoints: Vec::new(),
            auto_remove: false,
            published_tcp: Vec::new(),
            unconfinable: Vec::new(),
            pod: None,
            // Read by the inspect that follows; until then `refuse_workload_secrets` confines.
            env: crate::exposure::WorkloadEnv::unread(),
        }
    }
}

/// The container TCP ports of `HostConfig.PortBindings` (keys `80/tcp`, `53/udp`, ...) that are
/// bound to at least one host port.
fn published_tcp(
    bindings: &HashMap<String, Option<Vec<bollard::models::PortBinding>>>,
) -> Vec<u16> {
    let mut ports: Vec<u16> = bindings
        .iter()
        .filter(|(_, b)| b.as_ref().is_some_and(|b| !b.is_empty()))
        .filter_map(|(k, _)| {
            let (port, proto) = k.split_once('/').unwrap_or((k.as_str(), "tcp"));
            (proto == "tcp").then(|| port.parse::<u16>().ok()).flatten()
        })
        .filter(|p| *p != 0)
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Host paths that would let a root process in the container leave its cgroup or edit the
/// agent's maps and pins.
fn dangerous_mount(src: &str) -> bool {
    let p = src.trim_end_matches('/');
    let p = if p.is_empty() { "/" } else { p };
    p == "/"
        || p == "/sys"
        || p == "/sys/fs"
        || p.starts_with("/sys/fs/cgroup")
        || p.starts_with("/sys/fs/bpf")
        || p == "/proc"
        || p.starts_with("/run/egress-agent")
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::{ContainerConfig, ContainerState, HostConfig, MountPoint};

    #[test]
    fn unconfinable_reasons() {
        let c = ContainerInspectResponse {
            id: Some("abc".into()),
            name: Some("/web".into()),
            config: Some(ContainerConfig {
                labels: Some(HashMap::from([("egress.policy".into(), "ci".into())])),
                ..Default::default()
            }),
            state: Some(ContainerState {
                running: Some(true),
                pid: Some(42),
                ..Default::default()
            }),
            host_config: Some(HostConfig {
                privileged: Some(true),
                cap_add: Some(vec![
                    "net_admin".into(),
                    "CAP_SYS_ADMIN".into(),
                    "CHOWN".into(),
                ]),
                ..Default::default()
            }),
            mounts: Some(vec![
                MountPoint {
                    source: Some("/sys/fs/cgroup/".into()),
                    ..Default::default()
                },
                MountPoint {
                    source: Some("/srv/data".into()),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        };
        let i = ContainerInfo::from_inspect(&c).expect("test value");
        assert_eq!(i.name, "web");
        assert_eq!(i.pid, Some(42));
        assert_eq!(
            i.unconfinable,
            [
                "privileged",
                "cap-add NET_ADMIN",
                "cap-add SYS_ADMIN",
                "mount of /sys/fs/cgroup/"
            ]
        );
        let plain = ContainerInspectResponse {
            id: Some("x".into()),
            ..Default::default()
        };
        let i = ContainerInfo::from_inspect(&plain).expect("test value");
        assert!(i.unconfinable.is_empty() && !i.running && i.pid.is_none());
    }

    #[test]
    fn published_tcp_ports_come_from_the_port_bindings() {
        use bollard::models::PortBinding;
        let bound = || {
            Some(vec![PortBinding {
                host_ip: Some("0.0.0.0".into()),
                host_port: Some("8080".into()),
            }])
        };
        let b = HashMap::from([
            ("80/tcp".to_owned(), bound()),
            ("443".to_owned(), bound()),
            ("53/udp".to_owned(), bound()),
            ("9000/tcp".to_owned(), Some(vec![])),
            ("9001/tcp".to_owned(), None),
            ("x/tcp".to_owned(), bound()),
        ]);
        assert_eq!(published_tcp(&b), vec![80, 443]);
    }

    #[test]
    fn macs() {
        assert_eq!(
            parse_mac("02:42:c6:12:00:02"),
            Some([2, 0x42, 0xc6, 0x12, 0, 2])
        );
        assert_eq!(parse_mac("02:42:c6:12:00"), None);
        assert_eq!(parse_mac("02:42:c6:12:00:02:03"), None);
        assert_eq!(parse_mac(""), None);
    }
}
