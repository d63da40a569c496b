//! The agent core's ordered stop (`agent::Agent::shutdown`, issue #21): events that are still
//! queued for the exporters when the daemon gets SIGTERM reach the OTLP and syslog receivers
//! before it exits. Root only (the real daemon, a private dockerd, a labelled container).
//!
//! The OTLP receiver answers each request only after [`OTLP_DELAY`] and the exporter sends one
//! record per request, so when SIGTERM arrives most of the refusals are still queued in the
//! daemon: without the flush they would be lost with the process. Receivers listen on the
//! loopback of the daemon's own network namespace (the test dockerd's).
use std::collections::BTreeSet;
use std::io::Read;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use egress_tests::docker::{Env, SERIAL, require_root};
use http_body_util::{BodyExt, Full};
use nix::sys::signal::Signal;

/// Refusals the container causes, each to its own name (`denied-N.test`).
const REFUSALS: usize = 30;
/// How long the OTLP receiver takes to answer each export request.
const OTLP_DELAY: Duration = Duration::from_millis(150);

/// Everything a receiver got, as bytes (protobuf strings and syslog text hold the names as-is).
type Received = Arc<Mutex<Vec<u8>>>;

/// Which of `denied-1.test` .. `denied-REFUSALS.test` appear in `got`.
fn names_in(got: &Received) -> BTreeSet<usize> {
    let got = got.lock().unwrap_or_else(|p| p.into_inner());
    let text = String::from_utf8_lossy(&got);
    (1..=REFUSALS)
        .filter(|i| text.contains(&format!("denied-{i}.test")))
        .collect()
}

/// An OTLP/HTTP receiver (hyper) that answers 200 after `delay`, keeping every request body.
fn otlp_receiver(listener: TcpListener, delay: Duration) -> Received {
    let got: Received = Arc::default();
    let keep = got.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            listener.set_nonblocking(true).expect("nonblocking");
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let keep = keep.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let keep = keep.clone();
                            async move {
                                let body = req.into_body().collect().await?.to_bytes();
                                tokio::time::sleep(delay).await;
                                keep.lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .extend_from_slice(&body);
                                Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::new())))
                            }
                        },
                    );
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await
                        .ok();
                });
            }
        });
    });
    got
}

/// A syslog TCP receiver (octet-counted frames, kept as received).
fn syslog_receiver(listener: TcpListener) -> Received {
    let got: Received = Arc::default();
    let keep = got.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let keep = keep.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    keep.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    got
}

#[test]
fn queued_events_reach_the_exporters_after_sigterm() {
    if !require_root() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut env = Env::new(&[]);
    // Receivers on the daemon's loopback (it runs in the test dockerd's namespace).
    let (otlp_l, syslog_l) = env.d.netns.run(|| {
        (
            TcpListener::bind("127.0.0.1:0").expect("otlp listener"),
            TcpListener::bind("127.0.0.1:0").expect("syslog listener"),
        )
    });
    let (otlp_port, syslog_port) = (
        otlp_l.local_addr().expect("addr").port(),
        syslog_l.local_addr().expect("addr").port(),
    );
    let otlp = otlp_receiver(otlp_l, OTLP_DELAY);
    let syslog = syslog_receiver(syslog_l);
    let config = format!(
        "{}\n[export.otlp]\nendpoint = \"http://127.0.0.1:{otlp_port}/v1/logs\"\nbatch = 1\n\
         [export.syslog]\naddress = \"tcp://127.0.0.1:{syslog_port}\"\n",
        env.config_text("")
    );
    env.write_config(&config);
    // The exporters start with the daemon: restart it on this configuration.
    env.signal_agent(Signal::SIGTERM);
    if let Some(mut c) = env.agent.take() {
        c.wait().expect("first daemon exits");
    }
    env.start_agent();

    env.start_ok(
        "shutdown-client",
        &["--label", "egress.policy=web"],
        &["sleep", "600"],
    );
    assert!(
        env.wait_enforced("shutdown-client", 1),
        "never enforced:\n{}",
        env.log()
    );
    let script = format!(
        "for i in $(seq 1 {REFUSALS}); do printf 'GET http://denied-'$i'.test:8080/ HTTP/1.1\\r\\nHost: denied-'$i'.test:8080\\r\\nConnection: close\\r\\n\\r\\n' | nc -w 2 169.254.100.1 3128 >/dev/null; done; echo done"
    );
    let out = env.exec_out("shutdown-client", &script);
    assert!(out.contains("done"), "{out}");
    // What the daemon recorded (the API's ring; each refusal is recorded before its 403 is
    // written, and every `nc` has ended). A request busybox `nc` cuts off before the proxy read
    // it is no refusal at all, so the receivers must hold exactly what was recorded.
    let recorded: BTreeSet<usize> = env
        .events()
        .iter()
        .filter_map(|e| {
            e["host"]
                .as_str()?
                .strip_prefix("denied-")?
                .strip_suffix(".test")?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        recorded.len() >= REFUSALS / 2,
        "only {} of {REFUSALS} refusals were recorded:\n{out}\n{}",
        recorded.len(),
        env.log()
    );
    let before_stop = names_in(&otlp).len();
    let stop = Instant::now();
    env.signal_agent(Signal::SIGTERM);
    let mut child = env.agent.take().expect("daemon running");
    let status = child.wait().expect("daemon exits");
    let took = stop.elapsed();
    eprintln!(
        "SIGTERM with {} of {} recorded refusals still queued for OTLP; the daemon exited ({status}) after {took:?}",
        recorded.len() - before_stop.min(recorded.len()),
        recorded.len()
    );
    assert!(status.success(), "daemon exit: {status}\n{}", env.log());
    assert!(
        before_stop < recorded.len(),
        "nothing was queued at SIGTERM (the receiver's delay is too short for this test to show the flush)"
    );
    // What the receivers got by the time the daemon had exited.
    assert!(
        names_in(&otlp).is_superset(&recorded),
        "OTLP receiver missed refusals queued at SIGTERM: {:?}\n{}",
        recorded.difference(&names_in(&otlp)).collect::<Vec<_>>(),
        env.log()
    );
    // The syslog thread writes to a TCP socket: give the receiver's reader a moment to read what
    // the kernel already holds for it (the daemon is gone; nothing more can be sent).
    let deadline = Instant::now() + Duration::from_secs(2);
    while !names_in(&syslog).is_superset(&recorded) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        names_in(&syslog).is_superset(&recorded),
        "syslog receiver missed refusals queued at SIGTERM: {:?}\n{}",
        recorded.difference(&names_in(&syslog)).collect::<Vec<_>>(),
        env.log()
    );
    assert!(
        env.log().contains("stopped: events recorded and exported"),
        "{}",
        env.log()
    );
}
