//! The configuration's cross-field and semantic checks ([`Config::validate`]): every subsystem's
//! settings, then each policy's own `validate` (egress-policy). Errors name the field; the
//! loader locates them in the file they came from ([`super::locate::Sources`]).
use egress_policy::ValidationError;
use egress_policy::model::verr;

use super::{Config, check_policy_name};

impl Config {
    /// Cross-field and semantic checks.
    // Long: independent checks, a few lines each, in the order of the file's sections.
    pub fn validate(&self) -> Result<(), ValidationError> {
        for (field, name) in [
            ("agent.default_policy", &self.agent.default_policy),
            ("agent.unlabeled", &self.agent.unlabeled),
        ] {
            if self.policy(name).is_none() {
                return Err(verr(field, format!("no policy named {name:?}")));
            }
        }
        let p = &self.proxy;
        if p.endpoint.port() == 0 {
            return Err(verr("proxy.endpoint", "port 0 is not a stable endpoint"));
        }
        if let Some(v6) = p.endpoint_v6 {
            if !v6.is_ipv6() {
                return Err(verr("proxy.endpoint_v6", "must be an IPv6 socket address"));
            }
            if v6.port() == 0 {
                return Err(verr("proxy.endpoint_v6", "port 0 is not a stable endpoint"));
            }
        }
        if p.listen_ip().is_unspecified() && !p.allow_unspecified_listen {
            return Err(verr(
                if p.listen.is_some() {
                    "proxy.listen"
                } else {
                    "proxy.endpoint"
                },
                "refusing to listen on 0.0.0.0/:: (reachable from the network); set proxy.allow_unspecified_listen = true to insist",
            ));
        }
        for (field, v) in [
            ("proxy.header_timeout_ms", p.header_timeout_ms),
            ("proxy.connect_timeout_ms", p.connect_timeout_ms),
            ("proxy.idle_timeout_ms", p.idle_timeout_ms),
            ("dns.timeout_ms", self.dns.timeout_ms),
        ] {
            if v == 0 {
                return Err(verr(field, "must be > 0"));
            }
        }
        if !(1024..=1024 * 1024).contains(&p.max_header_bytes) {
            return Err(verr(
                "proxy.max_header_bytes",
                "must be between 1024 and 1048576",
            ));
        }
        if p.max_connections == 0 {
            return Err(verr("proxy.max_connections", "must be > 0"));
        }
        if let Some(n) = p.max_connections_per_listener
            && !(1..=p.max_connections).contains(&n)
        {
            return Err(verr(
                "proxy.max_connections_per_listener",
                format!(
                    "must be between 1 and proxy.max_connections ({})",
                    p.max_connections
                ),
            ));
        }
        if !(1024..=4 * 1024 * 1024).contains(&p.tunnel_buffer_bytes) {
            return Err(verr(
                "proxy.tunnel_buffer_bytes",
                "must be between 1024 and 4194304",
            ));
        }
        if let Some(cc) = &p.client_congestion_control
            && (cc.is_empty()
                || cc.len() > 15
                || !cc
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'))
        {
            return Err(verr(
                "proxy.client_congestion_control",
                "must be an algorithm name (1-15 characters of [a-z0-9_]) or \"host\"",
            ));
        }
        if self.intercept.leaf_cache_entries == 0 {
            return Err(verr("intercept.leaf_cache_entries", "must be > 0"));
        }
        if !self.agent.state_dir.is_absolute() {
            return Err(verr("agent.state_dir", "must be an absolute path"));
        }
        if self.store.max_age_hours == 0 {
            return Err(verr("store.max_age_hours", "must be > 0"));
        }
        if self.store.max_bytes < 1024 * 1024 {
            return Err(verr("store.max_bytes", "must be at least 1048576 (1 MiB)"));
        }
        if !(16..=1 << 22).contains(&self.store.queue) {
            return Err(verr("store.queue", "must be between 16 and 4194304"));
        }
        self.export.validate()?;
        if let Some(w) = &self.requests.webhook {
            w.validate("requests.webhook")?;
        }
        if let Some(a) = self.api.ui_listen
            && a.port() == 0
        {
            return Err(verr(
                "api.ui_listen",
                "must have a port (127.0.0.1:PORT, [::1]:PORT, or another address of the host)",
            ));
        }
        if let Some(g) = &self.api.read_group
            && (g.is_empty()
                || g.len() > 32
                || !g
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.'))
        {
            return Err(verr("api.read_group", "must be a group name"));
        }
        if self.dns.attempts == 0 {
            return Err(verr("dns.attempts", "must be > 0"));
        }
        if let Some(k) = &self.kubernetes {
            self.validate_kubernetes(k)?;
        }
        for (name, policy) in &self.policies {
            let base = format!("policies.{name}");
            check_policy_name(name).map_err(|m| verr(&base, m))?;
            policy.validate(&base)?;
            if let Some(ui) = self.api.ui_listen
                && let Some(i) = policy
                    .allow_host_services
                    .iter()
                    .position(|s| s.port == ui.port())
            {
                return Err(verr(
                    format!("{base}.allow_host_services[{i}]"),
                    format!(
                        "port {} is the agent's own console (api.ui_listen): no workload reaches it",
                        ui.port()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_kubernetes(&self, k: &super::KubernetesConfig) -> Result<(), ValidationError> {
        let root = k.cgroup_root.trim_matches('/');
        if root.is_empty()
            || root
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(verr(
                "kubernetes.cgroup_root",
                "must be the kubelet's cgroup root under the cgroup2 mount, e.g. \"/kubepods\" (cgroupfs driver) or \"/kubepods.slice\" (systemd driver)",
            ));
        }
        if k.containerd_namespace.is_empty() {
            return Err(verr(
                "kubernetes.containerd_namespace",
                "must name containerd's CRI namespace (\"k8s.io\")",
            ));
        }
        if !k.containerd_socket.is_absolute() {
            return Err(verr(
                "kubernetes.containerd_socket",
                "must be an absolute path (e.g. /run/containerd/containerd.sock)",
            ));
        }
        for (ns, policy) in &k.namespace_defaults {
            if self.policy(policy).is_none() {
                return Err(verr(
                    format!("kubernetes.namespace_defaults.{ns}"),
                    format!("no policy named {policy:?}"),
                ));
            }
        }
        Ok(())
    }
}
