//! A fresh fixture directory for the doctor's tests (files, directories, executable scripts),
//! removed on drop, and the doctor's options for a host rooted there: shared by
//! doctor_fixtures.rs and doctor_perimeter.rs.
#![allow(dead_code)]
use std::path::PathBuf;
use std::time::Duration;

use egress_agent::doctor::{HostPaths, Options};

pub struct Root(pub PathBuf);

impl Root {
    /// `<tmp>/egress-<tag>-<pid>`, empty.
    pub fn new(tag: &str) -> Root {
        let p = std::env::temp_dir().join(format!("egress-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&p).ok();
        std::fs::create_dir_all(&p).expect("create fixture root");
        Root(p)
    }
    pub fn write(&self, rel: &str, content: &str) -> &Self {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content).expect("write fixture");
        self
    }
    pub fn mkdir(&self, rel: &str) -> &Self {
        std::fs::create_dir_all(self.0.join(rel)).expect("mkdir");
        self
    }
    /// An executable shell script `bin/<name>`.
    pub fn tool(&self, name: &str, body: &str) -> &Self {
        use std::os::unix::fs::PermissionsExt;
        self.write(&format!("bin/{name}"), &format!("#!/bin/sh\n{body}\n"));
        let p = self.0.join("bin").join(name);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        self
    }
    pub fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
    /// The doctor's options for a host rooted here: its files, pins, Docker socket and sshd
    /// config under the root, no external tool (an empty PATH), no netlink, short timeouts.
    pub fn options(&self) -> Options {
        Options {
            paths: HostPaths::under(&self.0, "9.9.9"),
            pin_dir: self.path("bpf/egress-agent"),
            docker_socket: self.path("docker.sock"),
            docker_daemon_json: self.path("etc/docker/daemon.json"),
            sshd_config: self.path("etc/ssh/sshd_config"),
            tool_path: Some("".into()),
            netlink: false,
            probe_timeout: Duration::from_secs(2),
            deadline: Duration::from_secs(5),
            ..Options::default()
        }
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}
