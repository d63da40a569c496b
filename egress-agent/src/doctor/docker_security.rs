//! Docker's security options, from `SecurityOptions` of `GET /info` (e.g. `name=seccomp,profile=builtin`,
//! `name=userns`, `name=rootless`) and each running container's `HostConfig.SecurityOpt`.
//! `docker.userns` and `docker.rootless` are information: they never fail.

use std::sync::Arc;

use serde_json::Value;

use super::docker::{self, ContainerSummary};
use super::{Ctx, Outcome};

/// `SecurityOptions` entries as `(name, [(key, value)])`.
fn security_options(info: &Value) -> Vec<(String, Vec<(String, String)>)> {
    info["SecurityOptions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(|entry| {
                    let mut name = String::new();
                    let mut kv = Vec::new();
                    for part in entry.split(',') {
                        let (k, v) = part.split_once('=').unwrap_or((part, ""));
                        if k == "name" {
                            name = v.to_owned();
                        } else {
                            kv.push((k.to_owned(), v.to_owned()));
                        }
                    }
                    (name, kv)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn has_option(info: &Value, name: &str) -> bool {
    security_options(info).iter().any(|(n, _)| n == name)
}

/// Verdict on seccomp: Docker's default profile on, and no running container unconfined. Pure, for tests.
pub(super) fn seccomp_verdict(info: &Value, running: &[ContainerSummary]) -> Outcome {
    let opts = security_options(info);
    let Some((_, kv)) = opts.iter().find(|(n, _)| n == "seccomp") else {
        return Outcome::fail(
            "Docker runs containers without seccomp (no seccomp in its SecurityOptions)",
            "use a kernel with CONFIG_SECCOMP_FILTER and a dockerd built with seccomp",
        );
    };
    let profile = kv
        .iter()
        .find(|(k, _)| k == "profile")
        .map(|(_, v)| v.as_str())
        .unwrap_or("default");
    if profile == "unconfined" {
        return Outcome::fail(
            "Docker's default seccomp profile is unconfined",
            r#"remove "seccomp-profile": "unconfined" from /etc/docker/daemon.json and restart Docker"#,
        );
    }
    let bad: Vec<&ContainerSummary> = running.iter().filter(|c| c.seccomp_unconfined).collect();
    if bad.is_empty() {
        return Outcome::pass(format!(
            "seccomp on (profile {profile}); no running container unconfined ({} running)",
            running.len()
        ));
    }
    Outcome::warn(
        format!(
            "seccomp on (profile {profile}), but {} running container(s) have seccomp=unconfined: {}",
            bad.len(),
            docker::names(&bad)
        ),
        "run them without --security-opt seccomp=unconfined (or with a profile that allows what they need)",
    )
}

/// Verdict on user namespace remapping (information). Pure, for tests.
pub(super) fn userns_verdict(info: &Value) -> Outcome {
    if has_option(info, "userns") {
        Outcome::pass(
            "user namespace remapping on: root in a container is an unprivileged uid on the host",
        )
    } else if has_option(info, "rootless") {
        Outcome::pass("rootless daemon: containers run in the daemon user's namespace")
    } else {
        Outcome::warn(
            "no user namespace remapping (information): uid 0 in a container is uid 0 on the host",
            r#"consider "userns-remap": "default" in /etc/docker/daemon.json (file ownership on volumes changes)"#,
        )
    }
}

/// Whether the daemon runs rootless (information, never a gap). Pure, for tests.
pub(super) fn rootless_verdict(info: &Value) -> Outcome {
    if has_option(info, "rootless") {
        Outcome::pass(
            "Docker daemon runs rootless (see docker.cgroup_driver for where its containers live)",
        )
    } else {
        Outcome::pass("Docker daemon runs as root (rootful; see docker.userns)")
    }
}

fn unreachable(e: &docker::DockerError) -> Outcome {
    Outcome::skip(format!("Docker not reachable: {e}"), "see docker.reachable")
}

pub(super) async fn seccomp(ctx: Arc<Ctx>) -> Outcome {
    let info = match docker::info(&ctx).await {
        Ok(v) => v,
        Err(e) => return unreachable(&e),
    };
    match docker::containers(&ctx).await {
        Ok(list) => seccomp_verdict(&info, &list),
        Err(e) => unreachable(&e),
    }
}

pub(super) async fn userns(ctx: Arc<Ctx>) -> Outcome {
    match docker::info(&ctx).await {
        Ok(v) => userns_verdict(&v),
        Err(e) => unreachable(&e),
    }
}

pub(super) async fn rootless(ctx: Arc<Ctx>) -> Outcome {
    match docker::info(&ctx).await {
        Ok(v) => rootless_verdict(&v),
        Err(e) => unreachable(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Status;
    use super::*;
    use serde_json::json;

    fn container(name: &str, opts: Value) -> ContainerSummary {
        docker::parse_inspect(
            &json!({"Id": "1", "Name": name, "HostConfig": {"SecurityOpt": opts}}),
        )
    }

    #[test]
    fn seccomp_states() {
        let on = json!({"SecurityOptions": ["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"]});
        let plain = container("/web", Value::Null);
        let loose = container("/dev", json!(["seccomp=unconfined"]));
        let old = container("/old", json!(["seccomp:unconfined"]));
        assert!(loose.seccomp_unconfined && old.seccomp_unconfined && !plain.seccomp_unconfined);

        let v = seccomp_verdict(&on, std::slice::from_ref(&plain));
        assert_eq!(v.status, Status::Pass, "{v:?}");
        assert!(v.summary.contains("profile builtin"), "{}", v.summary);
        let v = seccomp_verdict(&on, &[plain.clone(), loose]);
        assert_eq!(v.status, Status::Warn);
        assert!(
            v.summary.contains("1 running container(s)") && v.summary.contains("dev"),
            "{}",
            v.summary
        );
        let off = json!({"SecurityOptions": ["name=seccomp,profile=unconfined"]});
        assert_eq!(seccomp_verdict(&off, &[]).status, Status::Fail);
        let none = json!({"SecurityOptions": ["name=apparmor"]});
        assert_eq!(seccomp_verdict(&none, &[]).status, Status::Fail);
    }

    #[test]
    fn userns_and_rootless_are_information() {
        let remap = json!({"SecurityOptions": ["name=seccomp,profile=builtin", "name=userns"]});
        let rootless =
            json!({"SecurityOptions": ["name=seccomp,profile=builtin", "name=rootless"]});
        let plain = json!({"SecurityOptions": ["name=seccomp,profile=builtin"]});
        assert_eq!(userns_verdict(&remap).status, Status::Pass);
        assert_eq!(userns_verdict(&rootless).status, Status::Pass);
        assert_eq!(userns_verdict(&plain).status, Status::Warn);
        assert!(rootless_verdict(&rootless).summary.contains("rootless"));
        assert!(rootless_verdict(&plain).summary.contains("rootful"));
        for v in [&remap, &rootless, &plain] {
            assert_ne!(userns_verdict(v).status, Status::Fail);
            assert_eq!(rootless_verdict(v).status, Status::Pass);
        }
    }
}
