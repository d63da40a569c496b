//! RFC 5424 syslog export. The message format is fasyslog's (`SyslogContext::format_rfc5424`:
//! header, structured data with RFC 5424 §6.3.3 escaping); the transport is ours so framing and
//! reconnects are explicit: UDP (one datagram per message), TCP with octet-counted framing
//! (RFC 6587 §3.4.1, which every rsyslog `imtcp` accepts) and unix datagram sockets (`/dev/log`).
//!
//! One message per event:
//! `<PRI>1 TIME HOST egress-agent PID would-deny [egress@32473 verdict=".." source=".." policy=".."
//! host=".." ip=".." port=".." protocol=".." reason=".." rule=".." count=".." container_id=".."
//! container_name=".." cgroup_id=".." time=".."][context@32473 run=".." ...] would-deny connect evil.example:443 ...`.
//! Severity: deny → warning, would-deny → notice, allow → info. `32473` is the private
//! enterprise number RFC 5612 reserves for documentation; SD-IDs with it are never registered.
use std::io::Write;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fasyslog::format::SyslogContext;
use fasyslog::{Facility, SDElement, Severity};

use super::SyslogConfig;
use crate::events::{DenialEvent, EventSink, Verdict};
use crate::metrics::Metrics;

/// SD-ID of the event's fields.
pub const SD_EVENT: &str = "egress@32473";
/// SD-ID of the event's context labels.
pub const SD_CONTEXT: &str = "context@32473";

/// Where messages go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Udp(SocketAddr),
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl Target {
    /// `udp://ip:port`, `tcp://ip:port`, `unix:///path`.
    pub fn parse(s: &str) -> Result<Target, String> {
        let (scheme, rest) = s.split_once("://").ok_or_else(|| {
            format!("{s:?}: expected udp://ip:port, tcp://ip:port or unix:///path")
        })?;
        let addr = || {
            rest.parse::<SocketAddr>()
                .map_err(|_| format!("{s:?}: expected an IP address and port after {scheme}://"))
        };
        match scheme {
            "udp" => Ok(Target::Udp(addr()?)),
            "tcp" => Ok(Target::Tcp(addr()?)),
            "unix" if rest.starts_with('/') => Ok(Target::Unix(PathBuf::from(rest))),
            "unix" => Err(format!("{s:?}: unix:// needs an absolute path")),
            other => Err(format!("{s:?}: unknown scheme {other:?} (udp, tcp, unix)")),
        }
    }
}

/// A facility by name.
pub fn facility(name: &str) -> Option<Facility> {
    name.parse().ok()
}

fn severity(v: Verdict) -> Severity {
    match v {
        Verdict::Deny => Severity::WARNING,
        Verdict::WouldDeny => Severity::NOTICE,
        Verdict::Allow => Severity::INFORMATIONAL,
    }
}

/// The RFC 5424 message of one event.
pub fn format(ctx: &SyslogContext, ev: &DenialEvent) -> String {
    let mut fields = match SDElement::new(SD_EVENT) {
        Ok(e) => e,
        Err(_) => return String::new(),
    };
    let add = |e: &mut SDElement, k: &str, v: String| {
        // Names here are fixed and valid; values are escaped by the formatter.
        e.add_param(k, v).ok();
    };
    add(&mut fields, "verdict", ev.verdict.as_str().to_owned());
    add(&mut fields, "source", ev.source.as_str().to_owned());
    add(&mut fields, "policy", ev.policy.clone());
    if let Some(h) = &ev.host {
        add(&mut fields, "host", h.clone());
    }
    if let Some(ip) = ev.ip {
        add(&mut fields, "ip", ip.to_string());
    }
    add(&mut fields, "port", ev.port.to_string());
    add(&mut fields, "protocol", ev.protocol.clone());
    add(&mut fields, "reason", ev.reason.clone());
    if let Some(r) = &ev.rule {
        add(&mut fields, "rule", r.clone());
    }
    add(&mut fields, "count", ev.count.to_string());
    if let Some(c) = &ev.container {
        add(&mut fields, "container_id", c.id.clone());
        add(&mut fields, "container_name", c.name.clone());
    }
    if let Some(c) = ev.cgroup_id {
        add(&mut fields, "cgroup_id", c.to_string());
    }
    add(
        &mut fields,
        "time",
        humantime::format_rfc3339_micros(ev.time).to_string(),
    );
    let mut elements = vec![fields];
    if !ev.context.is_empty()
        && let Ok(mut c) = SDElement::new(SD_CONTEXT)
    {
        for (k, v) in &ev.context {
            // A label name that is no SD-NAME is left out rather than mangled.
            c.add_param(k.as_str(), v.as_str()).ok();
        }
        elements.push(c);
    }
    ctx.format_rfc5424(
        severity(ev.verdict),
        Some(ev.verdict.as_str()),
        elements,
        Some(super::summary(ev)),
    )
    .to_string()
}

enum Conn {
    Udp(UdpSocket, SocketAddr),
    Tcp(TcpStream),
    Unix(UnixDatagram, PathBuf),
}

fn connect(t: &Target) -> std::io::Result<Conn> {
    match t {
        Target::Udp(a) => {
            let bind: SocketAddr = if a.is_ipv6() {
                "[::]:0".parse().map_err(std::io::Error::other)?
            } else {
                "0.0.0.0:0".parse().map_err(std::io::Error::other)?
            };
            Ok(Conn::Udp(UdpSocket::bind(bind)?, *a))
        }
        Target::Tcp(a) => {
            let s = TcpStream::connect_timeout(a, Duration::from_secs(5))?;
            s.set_write_timeout(Some(Duration::from_secs(5)))?;
            s.set_nodelay(true).ok();
            Ok(Conn::Tcp(s))
        }
        Target::Unix(p) => Ok(Conn::Unix(UnixDatagram::unbound()?, p.clone())),
    }
}

fn send(c: &mut Conn, msg: &str) -> std::io::Result<()> {
    match c {
        Conn::Udp(s, a) => s.send_to(msg.as_bytes(), *a).map(|_| ()),
        Conn::Tcp(s) => s.write_all(format!("{} {msg}", msg.len()).as_bytes()),
        Conn::Unix(s, p) => s.send_to(msg.as_bytes(), &*p).map(|_| ()),
    }
}

/// Start exporting what `sink` emits to `cfg.address`, on a thread of its own.
pub fn spawn(
    cfg: &SyslogConfig,
    sink: &EventSink,
    metrics: Option<Arc<Metrics>>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let target = Target::parse(&cfg.address)?;
    let facility =
        facility(&cfg.facility).ok_or_else(|| format!("unknown facility {:?}", cfg.facility))?;
    let mut ctx = SyslogContext::new();
    ctx.facility(facility).appname("egress-agent");
    let mut tap = sink.tap(cfg.queue, cfg.allowed);
    std::thread::Builder::new()
        .name("export-syslog".into())
        .spawn(move || {
            let mut conn: Option<Conn> = None;
            let mut reported = 0u64;
            while let Some(ev) = tap.rx.blocking_recv() {
                let msg = format(&ctx, &ev);
                // One reconnect per message at most: a dead receiver costs one try, not a loop.
                let mut ok = false;
                for _ in 0..2 {
                    if conn.is_none() {
                        conn = connect(&target).ok();
                    }
                    match conn.as_mut().map(|c| send(c, &msg)) {
                        Some(Ok(())) => {
                            ok = true;
                            break;
                        }
                        _ => conn = None,
                    }
                }
                if let Some(m) = &metrics {
                    if !ok {
                        m.export_errors("syslog", 1);
                    }
                    let d = tap.dropped.load(Ordering::Relaxed);
                    if d > reported {
                        m.event_drops(crate::metrics::DropSource::Export, d - reported);
                        reported = d;
                    }
                }
                if !ok {
                    tracing::debug!(target = ?target, "syslog receiver unreachable; event not exported");
                }
            }
        })
        .map_err(|e| format!("starting the syslog exporter: {e}"))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(
            Target::parse("udp://127.0.0.1:514"),
            Ok(Target::Udp("127.0.0.1:514".parse().unwrap()))
        );
        assert_eq!(
            Target::parse("tcp://[::1]:601"),
            Ok(Target::Tcp("[::1]:601".parse().unwrap()))
        );
        assert_eq!(
            Target::parse("unix:///dev/log"),
            Ok(Target::Unix("/dev/log".into()))
        );
        for bad in [
            "127.0.0.1:514",
            "udp://host:514",
            "unix://dev/log",
            "http://1.2.3.4:1",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
        assert!(facility("local3").is_some());
        assert!(facility("nope").is_none());
    }

    #[test]
    fn message_shape_and_escaping() {
        let mut ctx = SyslogContext::new();
        ctx.facility(Facility::LOCAL0)
            .appname("egress-agent")
            .hostname("h");
        let mut ev = DenialEvent::proxy(
            "ci",
            Some("evil.example".into()),
            None,
            443,
            "connect",
            "host-not-allowed",
        )
        .with_verdict(Verdict::WouldDeny);
        ev.context.insert("run".into(), "a]b\"c\\".into());
        ev.context.insert("bad name".into(), "x".into());
        let m = format(&ctx, &ev);
        // local0 (16) * 8 + notice (5) = 133
        assert!(m.starts_with("<133>1 "), "{m}");
        assert!(m.contains(" h egress-agent "), "{m}");
        assert!(
            m.contains(" would-deny [egress@32473 verdict=\"would-deny\""),
            "{m}"
        );
        assert!(m.contains("host=\"evil.example\" port=\"443\""), "{m}");
        assert!(m.contains("[context@32473 run=\"a\\]b\\\"c\\\\\"]"), "{m}");
        assert!(!m.contains("bad name"), "{m}");
        assert!(
            m.ends_with("] would-deny connect evil.example:443 policy=ci reason=host-not-allowed"),
            "{m}"
        );
        // No rule behind host-not-allowed: no field.
        assert!(!m.contains("rule="), "{m}");
        // One attempt; a summary of identical ones says how many (`time` is the last).
        assert!(m.contains("reason=\"host-not-allowed\" count=\"1\""), "{m}");
        ev.count = 40;
        let m = format(&ctx, &ev);
        assert!(
            m.contains("reason=\"host-not-allowed\" count=\"40\""),
            "{m}"
        );
        assert!(m.ends_with("reason=host-not-allowed count=40"), "{m}");
    }

    #[test]
    fn the_rule_is_a_field_when_the_event_names_one() {
        let mut ctx = SyslogContext::new();
        ctx.facility(Facility::LOCAL0)
            .appname("egress-agent")
            .hostname("h");
        let mut ev = DenialEvent::proxy(
            "ci",
            Some("pkg.example.com".into()),
            None,
            8443,
            "connect",
            "port-not-allowed",
        )
        .with_verdict(Verdict::WouldDeny);
        ev.rule = Some("allow_hosts *.example.com (ports 443, 8443]\"".into());
        let m = format(&ctx, &ev);
        // After the reason, escaped like the other values (RFC 5424 §6.3.3: `"`, `\`, `]`).
        assert!(
            m.contains(
                "reason=\"port-not-allowed\" rule=\"allow_hosts *.example.com (ports 443, 8443\\]\\\"\""
            ),
            "{m}"
        );
    }
}
