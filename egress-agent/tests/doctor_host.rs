//! Doctor on the real host: whatever the host is, every probe answers before the deadline and the
//! report is well formed. Prints the report (run with `--nocapture` to read it).
use std::time::{Duration, Instant};

use egress_agent::doctor::{self, Options, PROBE_IDS};

#[test]
fn real_host_run_finishes_before_the_deadline() {
    let mut opts = Options {
        deadline: Duration::from_secs(6),
        ..Options::default()
    };
    // Point it at a private Docker daemon, e.g. one started by the privileged test harness.
    if let Some(sock) = std::env::var_os("EGRESS_DOCTOR_DOCKER_SOCKET") {
        opts.docker_socket = sock.into();
    }
    let start = Instant::now();
    let report = doctor::run(opts);
    let took = start.elapsed();
    print!("{}", report.to_text());
    assert!(took < Duration::from_secs(7), "doctor took {took:?}");
    assert_eq!(
        report.checks.iter().map(|c| c.id).collect::<Vec<_>>(),
        PROBE_IDS
    );
    for c in &report.checks {
        assert!(
            !c.summary.is_empty() && !c.summary.contains('\n'),
            "{}: {:?}",
            c.id,
            c.summary
        );
        assert_eq!(
            c.fix.is_none(),
            c.status == doctor::Status::Pass,
            "{}: fix iff not pass",
            c.id
        );
        assert!(
            !c.summary.contains("global deadline"),
            "{} did not finish: {}",
            c.id,
            c.summary
        );
    }
}
