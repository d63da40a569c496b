//! The proxy address interface `egress0`.
//!
//! Containers reach the proxy at one stable address on every Docker network and for every
//! policy: a link-local `/32` (default `169.254.100.1`) on an interface of the agent's own, so it
//! is routed to the host from any bridge network (containers' default route) and never collides
//! with a Docker subnet. The interface is a `dummy`; kernels built without the dummy driver (this
//! CI's) get an empty `bridge` instead, which behaves the same for a local address. Created with
//! `ip` (iproute2, run by absolute path: [`crate::host_tool`]) because it is a one-time setup
//! step; removed by `egress-agent cleanup`.
use std::net::Ipv4Addr;
use std::process::Command;

pub const IFNAME: &str = "egress0";

#[derive(Debug, thiserror::Error)]
pub enum NetifError {
    #[error("`ip {args}` failed: {message}")]
    Ip { args: String, message: String },
    #[error("{0}: iproute2's `ip` is needed to create {IFNAME}")]
    NoIp(#[from] crate::host_tool::NotFound),
    #[error(
        "proxy endpoint {0} can't be served on {IFNAME}: use a non-loopback IPv4 address (default 169.254.100.1)"
    )]
    BadAddress(Ipv4Addr),
}

/// `ip` by absolute path.
fn ip_command() -> Result<Command, NetifError> {
    Ok(Command::new(crate::host_tool::find("ip")?))
}

fn ip(args: &[&str]) -> Result<(), NetifError> {
    let out = ip_command()?
        .args(args)
        .output()
        .map_err(|e| NetifError::Ip {
            args: args.join(" "),
            message: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetifError::Ip {
            args: args.join(" "),
            message: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn exists() -> bool {
    ip_command().is_ok_and(|mut c| {
        c.args(["link", "show", "dev", IFNAME])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Make sure `egress0` exists, is up and holds `addr/32` (idempotent).
pub fn ensure(addr: Ipv4Addr) -> Result<(), NetifError> {
    if addr.is_loopback() || addr.is_unspecified() || addr.is_multicast() || addr.is_broadcast() {
        return Err(NetifError::BadAddress(addr));
    }
    if !exists()
        && let Err(e) = ip(&["link", "add", IFNAME, "type", "dummy"])
    {
        tracing::info!(error = %e, "no dummy interface support; using an empty bridge for {IFNAME}");
        ip(&["link", "add", IFNAME, "type", "bridge"])?;
    }
    let cidr = format!("{addr}/32");
    ip(&["addr", "replace", &cidr, "dev", IFNAME])?;
    ip(&["link", "set", IFNAME, "up"])?;
    tracing::info!(%addr, "proxy address ready on {IFNAME}");
    Ok(())
}

/// Remove `egress0` (uninstall). Absent is fine.
pub fn cleanup() -> Result<(), NetifError> {
    if !exists() {
        return Ok(());
    }
    ip(&["link", "del", IFNAME])
}
