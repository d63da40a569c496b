//! Event export against real receivers on loopback:
//! - RFC 5424 syslog into a private **rsyslogd** (Debian's, installed by `cargo xtask setup`)
//!   started with its own config on UDP, TCP and a unix socket; the test reads what rsyslog
//!   parsed and wrote (facility, severity, app name, MSGID, structured data, message).
//! - OTLP/HTTP logs into a receiver built here from the `opentelemetry-proto` crate's generated
//!   message types (no OpenTelemetry collector is packaged for this machine's Debian): it decodes
//!   each `ExportLogsServiceRequest` and the test checks the records and their attributes.
#![expect(clippy::unwrap_used, reason = "test assertions")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_agent::events::{ContainerRef, DenialEvent, EventSink, Verdict};
use egress_agent::export::{OtlpConfig, SyslogConfig, otlp, syslog};
use egress_agent::metrics::Metrics;
use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message;

struct Rsyslog {
    child: Child,
    dir: PathBuf,
}

impl Drop for Rsyslog {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

fn free_port(udp: bool) -> u16 {
    if udp {
        std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    } else {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}

fn rsyslogd(dir: &Path, udp: u16, tcp: u16) -> Rsyslog {
    let bin = ["/usr/sbin/rsyslogd", "/sbin/rsyslogd"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("rsyslogd not installed: run `cargo xtask setup` (Debian package rsyslog)");
    let conf = dir.join("rsyslog.conf");
    std::fs::write(
        &conf,
        format!(
            r#"global(workDirectory="{d}")
module(load="imudp")
module(load="imtcp")
module(load="imuxsock" SysSock.Use="off")
input(type="imudp" address="127.0.0.1" port="{udp}")
input(type="imtcp" address="127.0.0.1" port="{tcp}")
input(type="imuxsock" Socket="{d}/log" UseSpecialParser="off")
template(name="fields" type="string" string="%syslogfacility-text% %syslogseverity-text% %app-name% %msgid% %structured-data% %msg%\n")
*.* action(type="omfile" file="{d}/out.log" template="fields")
"#,
            d = dir.display()
        ),
    )
    .unwrap();
    let child = Command::new(bin)
        .arg("-n")
        .arg("-f")
        .arg(&conf)
        .arg("-i")
        .arg(dir.join("rsyslogd.pid"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let r = Rsyslog {
        child,
        dir: dir.to_owned(),
    };
    // Ready when the TCP input accepts and the unix socket exists.
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::net::TcpStream::connect(("127.0.0.1", tcp)).is_err() || !dir.join("log").exists() {
        assert!(Instant::now() < deadline, "rsyslogd did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    r
}

fn event(host: &str, verdict: Verdict) -> DenialEvent {
    let mut ev = DenialEvent::proxy(
        "ci",
        Some(host.into()),
        None,
        443,
        "connect",
        "host-not-allowed",
    )
    .with_verdict(verdict);
    ev.container = Some(ContainerRef {
        id: "c0ffee".into(),
        name: "job".into(),
    });
    ev.cgroup_id = Some(77);
    ev.context.insert("run".into(), "42".into());
    ev.context.insert("repo".into(), "acme/\"api]".into());
    ev
}

fn wait_lines(file: &Path, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "rsyslog wrote {} of {n} lines: {text}",
            lines.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn syslog_rfc5424_reaches_rsyslog_over_udp_tcp_and_unix() {
    let dir = std::env::temp_dir().join(format!("egress-rsyslog-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let (udp, tcp) = (free_port(true), free_port(false));
    let rs = rsyslogd(&dir, udp, tcp);
    let out = rs.dir.join("out.log");
    let metrics = Arc::new(Metrics::new());
    let targets = [
        format!("udp://127.0.0.1:{udp}"),
        format!("tcp://127.0.0.1:{tcp}"),
        format!("unix://{}/log", dir.display()),
    ];
    for (i, address) in targets.iter().enumerate() {
        let sink = EventSink::new(16);
        syslog::spawn(
            &SyslogConfig {
                address: address.clone(),
                facility: "local3".into(),
                allowed: false,
                queue: 64,
            },
            &sink,
            Some(metrics.clone()),
        )
        .unwrap();
        sink.emit(event(&format!("t{i}.example"), Verdict::WouldDeny));
        // Not exported unless asked: allowed traffic.
        sink.emit(event("allowed.example", Verdict::Allow));
        sink.emit(event(&format!("d{i}.example"), Verdict::Deny));
        let lines = wait_lines(&out, 2 * (i + 1));
        let want_would = format!(
            "local3 notice egress-agent would-deny [egress@32473 verdict=\"would-deny\" source=\"proxy\" policy=\"ci\" host=\"t{i}.example\" port=\"443\" protocol=\"connect\" reason=\"host-not-allowed\" count=\"1\" container_id=\"c0ffee\" container_name=\"job\" cgroup_id=\"77\" time=\""
        );
        let line = lines
            .iter()
            .find(|l| l.contains(&format!("t{i}.example")))
            .unwrap_or_else(|| panic!("{address}: not received: {lines:?}"));
        assert!(line.starts_with(&want_would), "{address}: {line}");
        assert!(
            line.contains(
                "[context@32473 repo=\"acme/\\\"api\\]\" run=\"42\"] would-deny connect t"
            ),
            "{address}: {line}"
        );
        let deny = lines
            .iter()
            .find(|l| l.contains(&format!("d{i}.example")))
            .unwrap_or_else(|| panic!("{address}: denial not received: {lines:?}"));
        assert!(
            deny.starts_with("local3 warning egress-agent deny "),
            "{deny}"
        );
        assert!(
            !lines.iter().any(|l| l.contains("allowed.example")),
            "{lines:?}"
        );
    }
    let text = metrics.encode().unwrap();
    assert!(
        !text.contains("egress_agent_export_errors_total{sink=\"syslog\"}"),
        "{text}"
    );
}

/// A loopback OTLP/HTTP logs receiver: decodes every request with the opentelemetry-proto
/// types and hands it to the test.
async fn otlp_receiver() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<ExportLogsServiceRequest>,
) {
    use http_body_util::{BodyExt, Full};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let tx = tx.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let tx = tx.clone();
                        async move {
                            assert_eq!(req.uri().path(), "/v1/logs");
                            assert_eq!(
                                req.headers()["content-type"].to_str().unwrap(),
                                "application/x-protobuf"
                            );
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let decoded = ExportLogsServiceRequest::decode(body).unwrap();
                            tx.send(decoded).ok();
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                                hyper::body::Bytes::new(),
                            )))
                        }
                    },
                );
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await
                    .ok();
            });
        }
    });
    (addr, rx)
}

fn attr<'a>(
    r: &'a opentelemetry_proto::tonic::logs::v1::LogRecord,
    k: &str,
) -> &'a any_value::Value {
    r.attributes
        .iter()
        .find(|a| a.key == k)
        .and_then(|a| a.value.as_ref())
        .and_then(|v| v.value.as_ref())
        .unwrap_or_else(|| panic!("no attribute {k}"))
}

#[tokio::test]
async fn otlp_logs_reach_a_receiver_and_failures_are_counted() {
    let (addr, mut rx) = otlp_receiver().await;
    let sink = EventSink::new(16);
    let metrics = Arc::new(Metrics::new());
    let cfg = OtlpConfig {
        endpoint: format!("http://{addr}/v1/logs"),
        timeout_ms: 2000,
        batch: 512,
        allowed: true,
        queue: 64,
    };
    otlp::spawn(&cfg, &sink, Some(metrics.clone())).unwrap();
    sink.emit(event("a.example", Verdict::WouldDeny));
    sink.emit(event("b.example", Verdict::Allow));
    sink.emit(event("c.example", Verdict::Deny));
    let mut records = Vec::new();
    while records.len() < 3 {
        let req = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no export request")
            .unwrap();
        let rl = &req.resource_logs[0];
        let service = rl
            .resource
            .as_ref()
            .unwrap()
            .attributes
            .iter()
            .find(|a| a.key == "service.name")
            .unwrap();
        assert_eq!(
            service.value.as_ref().unwrap().value,
            Some(any_value::Value::StringValue("egress-agent".into()))
        );
        records.extend(rl.scope_logs[0].log_records.clone());
    }
    let hosts: Vec<&any_value::Value> = records.iter().map(|r| attr(r, "egress.host")).collect();
    assert_eq!(
        hosts,
        [
            &any_value::Value::StringValue("a.example".into()),
            &any_value::Value::StringValue("b.example".into()),
            &any_value::Value::StringValue("c.example".into())
        ]
    );
    let r = &records[0];
    assert_eq!(r.severity_text, "would-deny");
    assert_eq!(r.event_name, "egress.decision");
    assert_eq!(attr(r, "egress.port"), &any_value::Value::IntValue(443));
    assert_eq!(
        attr(r, "egress.reason"),
        &any_value::Value::StringValue("host-not-allowed".into())
    );
    assert_eq!(
        attr(r, "egress.context.run"),
        &any_value::Value::StringValue("42".into())
    );
    assert_eq!(
        attr(r, "egress.container.name"),
        &any_value::Value::StringValue("job".into())
    );
    assert!(r.time_unix_nano > 0);
    assert_eq!(records[2].severity_number, 13, "deny is WARN");

    // A collector that is not there: the batch is dropped and counted, nothing waits.
    let dead = free_port(false);
    let sink = EventSink::new(16);
    otlp::spawn(
        &OtlpConfig {
            endpoint: format!("http://127.0.0.1:{dead}/v1/logs"),
            ..cfg
        },
        &sink,
        Some(metrics.clone()),
    )
    .unwrap();
    sink.emit(event("x.example", Verdict::Deny));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics.encode().unwrap();
        if text.contains("egress_agent_export_errors_total{sink=\"otlp\"} 1") {
            break;
        }
        assert!(Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
