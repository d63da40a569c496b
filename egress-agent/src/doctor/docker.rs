//! Docker probes over a minimal Engine API client (HTTP/1.1 on the unix socket, read-only GETs,
//! bounded bodies, timeouts).
//!
//! CAP_NET_RAW: upstream dockerd has no daemon-wide setting for the default capability set (moby
//! issue 39149 / PR 39297 were never merged); the default set (moby `oci/caps/defaults.go`) includes
//! NET_RAW, so every container keeps it unless run with `--cap-drop NET_RAW` (or `ALL`). Some
//! distributions patch dockerd with a `default-capabilities` key in daemon.json (Bottlerocket); it is
//! honoured when present. The probe therefore looks at daemon.json and at each running container's
//! `HostConfig.CapAdd/CapDrop/Privileged`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

use super::{Ctx, Outcome};

/// Largest response body read (a `/info` is a few KiB; a container list of thousands is a few MiB).
const MAX_BODY: usize = 8 << 20;
/// At most this many running containers are inspected.
const MAX_CONTAINERS: usize = 512;

/// Why the Docker API gave no answer.
#[derive(Clone, Debug, thiserror::Error)]
pub enum DockerError {
    #[error("no Docker socket at {0}")]
    NoSocket(String),
    #[error("permission denied on {0}")]
    PermissionDenied(String),
    #[error("cannot connect to {0}: {1}")]
    Connect(String, String),
    #[error("Docker API {0}: {1}")]
    Http(String, String),
    #[error("Docker API {0} answered HTTP {1}")]
    Status(String, u16),
    #[error("Docker API {0}: no answer within {ms}ms", ms = .1.as_millis())]
    Timeout(String, Duration),
}

async fn get_once(socket: &Path, path: &str) -> Result<Value, DockerError> {
    let sock = socket.display().to_string();
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => DockerError::NoSocket(sock.clone()),
            std::io::ErrorKind::PermissionDenied => DockerError::PermissionDenied(sock.clone()),
            _ => DockerError::Connect(sock.clone(), e.to_string()),
        })?;
    let http = |e: &dyn std::fmt::Display| DockerError::Http(path.to_owned(), e.to_string());
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http(&e))?;
    let driver = tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, "docker")
        .body(Empty::<Bytes>::new())
        .map_err(|e| http(&e))?;
    let resp = sender.send_request(req).await.map_err(|e| http(&e))?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| http(&e))?
        .to_bytes();
    driver.abort();
    if !status.is_success() {
        return Err(DockerError::Status(path.to_owned(), status.as_u16()));
    }
    serde_json::from_slice(&body).map_err(|e| http(&e))
}

async fn get(ctx: &Ctx, path: &str) -> Result<Value, DockerError> {
    let t = ctx.opts.probe_timeout.mul_f32(0.6);
    tokio::time::timeout(t, get_once(&ctx.opts.docker_socket, path))
        .await
        .unwrap_or_else(|_| Err(DockerError::Timeout(path.to_owned(), t)))
}

pub(super) async fn info(ctx: &Arc<Ctx>) -> Result<Value, DockerError> {
    ctx.docker_info
        .get_or_init(|| get(ctx, "/info"))
        .await
        .clone()
}

/// What the probes need of one running container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerSummary {
    pub id: String,
    pub name: String,
    pub privileged: bool,
    /// Normalised: upper case, without `CAP_`.
    pub cap_add: Vec<String>,
    pub cap_drop: Vec<String>,
    /// `HostConfig.PidMode == "host"`.
    pub pid_host: bool,
    /// Host paths bind-mounted into the container.
    pub mount_sources: Vec<String>,
    /// `HostConfig.SecurityOpt` has `seccomp=unconfined` (or the old `seccomp:unconfined`).
    pub seccomp_unconfined: bool,
}

fn norm_caps(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(|c| {
                    c.trim()
                        .to_ascii_uppercase()
                        .trim_start_matches("CAP_")
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Parse `GET /containers/{id}/json`.
pub(super) fn parse_inspect(v: &Value) -> ContainerSummary {
    let hc = &v["HostConfig"];
    ContainerSummary {
        id: v["Id"]
            .as_str()
            .unwrap_or_default()
            .chars()
            .take(12)
            .collect(),
        name: v["Name"]
            .as_str()
            .unwrap_or_default()
            .trim_start_matches('/')
            .to_owned(),
        privileged: hc["Privileged"].as_bool().unwrap_or(false),
        cap_add: norm_caps(&hc["CapAdd"]),
        cap_drop: norm_caps(&hc["CapDrop"]),
        pid_host: hc["PidMode"].as_str() == Some("host"),
        mount_sources: v["Mounts"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["Source"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
        seccomp_unconfined: hc["SecurityOpt"].as_array().is_some_and(|a| {
            a.iter().filter_map(Value::as_str).any(|o| {
                let o = o.trim().to_ascii_lowercase();
                o == "seccomp=unconfined" || o == "seccomp:unconfined"
            })
        }),
    }
}

/// Why a container can undo or escape enforcement. Mirrors `docker::container`'s "unconfinable"
/// list (the agent refuses to claim those are confined), plus the Docker socket (root on the host).
pub(super) fn unconfinable(c: &ContainerSummary) -> Vec<String> {
    let mut why = Vec::new();
    if c.privileged {
        why.push("privileged".to_owned());
    }
    for cap in &c.cap_add {
        if matches!(
            cap.as_str(),
            "ALL" | "NET_ADMIN" | "SYS_ADMIN" | "BPF" | "SYS_MODULE" | "SYS_PTRACE"
        ) {
            why.push(format!("cap-add {cap}"));
        }
    }
    if c.pid_host {
        why.push("pid=host".to_owned());
    }
    for src in &c.mount_sources {
        let p = src.trim_end_matches('/');
        let p = if p.is_empty() { "/" } else { p };
        let dangerous = matches!(p, "/" | "/sys" | "/sys/fs" | "/proc")
            || p.starts_with("/sys/fs/cgroup")
            || p.starts_with("/sys/fs/bpf")
            || p.starts_with("/run/egress-agent")
            || p.ends_with("/docker.sock");
        if dangerous {
            why.push(format!("mount of {src}"));
        }
    }
    why
}

pub(super) async fn containers(ctx: &Arc<Ctx>) -> Result<Vec<ContainerSummary>, DockerError> {
    ctx.docker_containers
        .get_or_init(|| async {
            let list = get(ctx, "/containers/json").await?;
            let ids: Vec<String> = list
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|c| c["Id"].as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            let mut set = tokio::task::JoinSet::new();
            let sem = Arc::new(tokio::sync::Semaphore::new(8));
            for id in ids.into_iter().take(MAX_CONTAINERS) {
                // Container ids are hex; anything else is not put into a request path.
                if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
                    continue;
                }
                let ctx = Arc::clone(ctx);
                let sem = Arc::clone(&sem);
                set.spawn(async move {
                    let _permit = sem.acquire_owned().await;
                    get(&ctx, &format!("/containers/{id}/json"))
                        .await
                        .map(|v| parse_inspect(&v))
                });
            }
            let mut out = Vec::new();
            while let Some(r) = set.join_next().await {
                match r {
                    Ok(Ok(c)) => out.push(c),
                    // A container that went away between list and inspect answers 404: skip it.
                    Ok(Err(DockerError::Status(_, 404))) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {}
                }
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(out)
        })
        .await
        .clone()
}

pub(super) fn unreachable_outcome(e: &DockerError) -> Outcome {
    match e {
        DockerError::NoSocket(_) => Outcome::skip(
            format!("{e} (Docker not installed or not running)"),
            "nothing to do if this host runs no Docker",
        ),
        DockerError::PermissionDenied(_) => Outcome::skip(e.to_string(), "run doctor as root"),
        _ => Outcome::fail(
            e.to_string(),
            "check the Docker daemon: systemctl status docker; journalctl -u docker",
        ),
    }
}

pub(super) async fn reachable(ctx: Arc<Ctx>) -> Outcome {
    match info(&ctx).await {
        Ok(v) => Outcome::pass(format!(
            "Docker {} reachable at {} ({} containers running)",
            v["ServerVersion"].as_str().unwrap_or("?"),
            ctx.opts.docker_socket.display(),
            v["ContainersRunning"].as_u64().unwrap_or(0)
        )),
        Err(e) => unreachable_outcome(&e),
    }
}

/// Verdict on Docker's cgroup setup, from `/info`. The agent follows the cgroupfs layout
/// (`<cgroup2>/<cgroup parent>/<id>`, see `workload::root`); under the systemd driver containers
/// live in `system.slice/docker-<id>.scope`, outside its enforcement root. Pure, for tests.
pub(super) fn cgroup_driver_verdict(info: &Value) -> Outcome {
    const FIX: &str = r#"set "exec-opts": ["native.cgroupdriver=cgroupfs"] in /etc/docker/daemon.json and restart Docker"#;
    let driver = info["CgroupDriver"].as_str().unwrap_or("");
    let version = info["CgroupVersion"].as_str().unwrap_or("");
    let v = if version.is_empty() {
        String::new()
    } else {
        format!(", cgroup v{version}")
    };
    match driver {
        "cgroupfs" if version == "1" => Outcome::pass(format!(
            "cgroup driver cgroupfs{v} (hybrid host): containers also get <cgroup2>/docker/<id>, where the agent enforces"
        )),
        "cgroupfs" => Outcome::pass(format!(
            "cgroup driver cgroupfs{v}: containers live under <cgroup2>/docker/<id>"
        )),
        "" => Outcome::warn(
            "Docker did not report its cgroup driver",
            "check `docker info` (Cgroup Driver)",
        ),
        other => Outcome::fail(
            format!(
                "cgroup driver {other}{v}: containers are placed outside the agent's enforcement root (<cgroup2>/docker)"
            ),
            FIX,
        ),
    }
}

pub(super) async fn cgroup_driver(ctx: Arc<Ctx>) -> Outcome {
    match info(&ctx).await {
        Ok(v) => cgroup_driver_verdict(&v),
        Err(e) => Outcome::skip(format!("Docker not reachable: {e}"), "see docker.reachable"),
    }
}

/// Whether a container created with these settings has CAP_NET_RAW.
fn keeps_net_raw(c: &ContainerSummary, defaults_have_it: bool) -> bool {
    let has = |l: &[String], cap: &str| l.iter().any(|c| c == cap || c == "ALL");
    c.privileged || has(&c.cap_add, "NET_RAW") || (defaults_have_it && !has(&c.cap_drop, "NET_RAW"))
}

/// Names, at most five, then `+N more`.
pub(super) fn names(list: &[&ContainerSummary]) -> String {
    let mut s: Vec<String> = list
        .iter()
        .take(5)
        .map(|c| {
            if c.name.is_empty() {
                c.id.clone()
            } else {
                c.name.clone()
            }
        })
        .collect();
    if list.len() > 5 {
        s.push(format!("+{} more", list.len() - 5));
    }
    s.join(", ")
}

/// `Some(includes NET_RAW)` when daemon.json has a (non-upstream) `default-capabilities` key.
pub(super) fn daemon_json_default_caps(text: &str) -> Option<bool> {
    let v: Value = serde_json::from_str(text).ok()?;
    let caps = v.get("default-capabilities")?;
    Some(norm_caps(caps).iter().any(|c| c == "NET_RAW" || c == "ALL"))
}

/// Verdict on CAP_NET_RAW. Pure, for tests.
pub(super) fn net_raw_verdict(
    daemon_default: Option<bool>,
    running: &[ContainerSummary],
) -> Outcome {
    let defaults_have_it = daemon_default.unwrap_or(true);
    let keep: Vec<&ContainerSummary> = running
        .iter()
        .filter(|c| keeps_net_raw(c, defaults_have_it))
        .collect();
    const FIX: &str = "run untrusted containers with --cap-drop NET_RAW (raw and packet sockets; ping still works through ping_group_range)";
    let defaults = match daemon_default {
        None => {
            "Docker's default capabilities include CAP_NET_RAW (no daemon-wide setting in upstream dockerd)"
        }
        Some(true) => "daemon.json default-capabilities include NET_RAW",
        Some(false) => "daemon.json default-capabilities drop NET_RAW",
    };
    if keep.is_empty() && !defaults_have_it {
        return Outcome::pass(format!("{defaults}; no running container has it"));
    }
    if keep.is_empty() {
        return Outcome::warn(
            format!(
                "{defaults}; no running container has it now ({} running)",
                running.len()
            ),
            FIX,
        );
    }
    Outcome::warn(
        format!(
            "{defaults}; {} of {} running containers have it: {}",
            keep.len(),
            running.len(),
            names(&keep)
        ),
        FIX,
    )
}

pub(super) async fn net_raw(ctx: Arc<Ctx>) -> Outcome {
    let daemon_default = tokio::fs::read_to_string(&ctx.opts.docker_daemon_json)
        .await
        .ok()
        .and_then(|t| daemon_json_default_caps(&t));
    match containers(&ctx).await {
        Ok(list) => net_raw_verdict(daemon_default, &list),
        Err(e) => Outcome::skip(format!("Docker not reachable: {e}"), "see docker.reachable"),
    }
}

/// Verdict on containers the agent cannot confine (privileged, dangerous capabilities, host pid
/// namespace, mounts of cgroupfs/bpffs/the agent's socket/the Docker socket). Pure, for tests.
pub(super) fn privileged_verdict(running: &[ContainerSummary]) -> Outcome {
    let bad: Vec<String> = running
        .iter()
        .filter_map(|c| {
            let why = unconfinable(c);
            let name = if c.name.is_empty() { &c.id } else { &c.name };
            (!why.is_empty()).then(|| format!("{name} ({})", why.join(", ")))
        })
        .collect();
    if bad.is_empty() {
        return Outcome::pass(format!(
            "no privileged or unconfinable containers ({} running)",
            running.len()
        ));
    }
    let mut list: Vec<String> = bad.iter().take(5).cloned().collect();
    if bad.len() > 5 {
        list.push(format!("+{} more", bad.len() - 5));
    }
    Outcome::warn(
        format!(
            "{} running container(s) can detach the agent's programs or leave their cgroup, so egress can't be enforced on them: {}",
            bad.len(),
            list.join("; ")
        ),
        "run them without --privileged, --cap-add SYS_ADMIN/NET_ADMIN/BPF/SYS_PTRACE/SYS_MODULE/ALL, --pid host and host mounts of /sys, /proc or sockets, or keep them off hosts that rely on egress-agent",
    )
}

pub(super) async fn privileged(ctx: Arc<Ctx>) -> Outcome {
    match containers(&ctx).await {
        Ok(list) => privileged_verdict(&list),
        Err(e) => Outcome::skip(format!("Docker not reachable: {e}"), "see docker.reachable"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Status;
    use super::*;
    use serde_json::json;

    #[test]
    fn net_raw_and_privileged() {
        let plain = parse_inspect(
            &json!({"Id": "abcdef0123456789", "Name": "/web", "HostConfig": {"Privileged": false, "CapAdd": null, "CapDrop": null}}),
        );
        let dropped = parse_inspect(
            &json!({"Id": "1", "Name": "/safe", "HostConfig": {"CapDrop": ["CAP_NET_RAW"]}}),
        );
        let all =
            parse_inspect(&json!({"Id": "2", "Name": "/none", "HostConfig": {"CapDrop": ["all"]}}));
        let priv_ = parse_inspect(
            &json!({"Id": "3", "Name": "/dind", "HostConfig": {"Privileged": true, "CapDrop": ["ALL"]}}),
        );
        assert_eq!(plain.id, "abcdef012345");
        assert_eq!(plain.name, "web");

        let v = net_raw_verdict(None, &[dropped.clone(), all.clone()]);
        assert_eq!(v.status, Status::Warn);
        assert!(v.summary.contains("no running container"), "{}", v.summary);
        let v = net_raw_verdict(None, &[plain.clone(), dropped.clone(), priv_.clone()]);
        assert!(v.summary.contains("2 of 3"), "{}", v.summary);
        assert!(
            v.summary.contains("web") && v.summary.contains("dind"),
            "{}",
            v.summary
        );
        assert_eq!(
            net_raw_verdict(Some(false), std::slice::from_ref(&plain)).status,
            Status::Pass
        );
        assert_eq!(
            net_raw_verdict(Some(false), std::slice::from_ref(&priv_)).status,
            Status::Warn
        );
        assert_eq!(
            daemon_json_default_caps(r#"{"default-capabilities": ["CAP_KILL"]}"#),
            Some(false)
        );
        assert_eq!(
            daemon_json_default_caps(r#"{"default-capabilities": ["NET_RAW"]}"#),
            Some(true)
        );
        assert_eq!(
            daemon_json_default_caps(r#"{"log-driver": "json-file"}"#),
            None
        );

        assert_eq!(
            privileged_verdict(&[plain.clone(), dropped]).status,
            Status::Pass
        );
        let v = privileged_verdict(&[plain, priv_]);
        assert_eq!(v.status, Status::Warn);
        assert!(
            v.summary.contains("1 running container(s)") && v.summary.contains("dind (privileged)"),
            "{}",
            v.summary
        );
        let mounts = parse_inspect(
            &json!({"Id": "4", "Name": "/ci", "HostConfig": {"PidMode": "host", "CapAdd": ["CAP_NET_ADMIN"]},
            "Mounts": [{"Source": "/var/run/docker.sock"}, {"Source": "/sys/fs/cgroup/"}, {"Source": "/home/x"}]}),
        );
        assert_eq!(
            unconfinable(&mounts),
            [
                "cap-add NET_ADMIN",
                "pid=host",
                "mount of /var/run/docker.sock",
                "mount of /sys/fs/cgroup/"
            ]
        );
    }

    #[test]
    fn cgroup_drivers() {
        assert_eq!(
            cgroup_driver_verdict(&json!({"CgroupDriver": "cgroupfs", "CgroupVersion": "2"}))
                .status,
            Status::Pass
        );
        assert_eq!(
            cgroup_driver_verdict(&json!({"CgroupDriver": "systemd", "CgroupVersion": "2"})).status,
            Status::Fail
        );
        assert_eq!(
            cgroup_driver_verdict(&json!({"CgroupDriver": "cgroupfs", "CgroupVersion": "1"}))
                .status,
            Status::Pass
        );
        assert_eq!(
            cgroup_driver_verdict(&json!({"CgroupDriver": "systemd", "CgroupVersion": "1"})).status,
            Status::Fail
        );
        assert_eq!(
            cgroup_driver_verdict(&json!({"CgroupDriver": "none"})).status,
            Status::Fail
        );
    }
}
