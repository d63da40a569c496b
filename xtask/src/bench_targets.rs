//! The performance targets of `cargo xtask bench`: each benchmark binary prints a line per
//! target (`egress_tests::bench::Target`, tests/src/bench.rs):
//!
//! `target: <metric> | <measured> | <= or >= <bound> | met` (or `NOT met`, or `-` and
//! `not measured` without a figure),
//!
//! computed from the medians of its rounds. [`run_capturing`] runs a benchmark with its stdout
//! passed through line by line as it comes and keeps those lines; [`summary`] is the table
//! printed after every benchmark ran. A target not met fails nothing (the benchmarks assert
//! nothing); a benchmark that fails still fails the run.
use std::io::{BufRead as _, BufReader, Write};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result};

/// Keep in step with `egress_tests::bench::TARGET_PREFIX`.
const PREFIX: &str = "target: ";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Met,
    NotMet,
    /// No figure, or a line this parser does not understand: never counted as met.
    NotMeasured,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::NotMet => "NOT met",
            Verdict::NotMeasured => "not measured",
        }
    }
}

/// One `target:` line and the benchmark (binary and arguments) that printed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetLine {
    pub bench: String,
    pub name: String,
    pub measured: String,
    pub bound: String,
    pub verdict: Verdict,
}

/// The target of `line`, when it is a `target:` line. One that doesn't have the four fields or
/// a known verdict is kept whole as the name, [`Verdict::NotMeasured`].
pub fn parse(bench: &str, line: &str) -> Option<TargetLine> {
    let rest = line.trim_end().strip_prefix(PREFIX)?;
    let fields: Vec<&str> = rest.split(" | ").map(str::trim).collect();
    let verdict = match fields.get(3).copied() {
        Some("met") => Some(Verdict::Met),
        Some("NOT met") => Some(Verdict::NotMet),
        Some("not measured") => Some(Verdict::NotMeasured),
        _ => None,
    };
    let t = match (fields.as_slice(), verdict) {
        ([name, measured, bound, _], Some(verdict)) => TargetLine {
            bench: bench.to_owned(),
            name: (*name).to_owned(),
            measured: (*measured).to_owned(),
            bound: (*bound).to_owned(),
            verdict,
        },
        _ => TargetLine {
            bench: bench.to_owned(),
            name: format!("(unreadable target line) {rest}"),
            measured: "-".to_owned(),
            bound: "-".to_owned(),
            verdict: Verdict::NotMeasured,
        },
    };
    Some(t)
}

/// How long the output may stay open after the benchmark exited (a process it started and left
/// behind holding its stdout) before the rest is no longer waited for.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(5);

/// Run `cmd` with its stdout passed through to `pass_to` (ours) line by line as it comes
/// (stderr untouched), keeping the `target:` lines it prints, tagged with `bench`.
pub fn run_capturing(
    cmd: &mut Command,
    bench: &str,
    mut pass_to: impl Write + Send + 'static,
) -> Result<(ExitStatus, Vec<TargetLine>)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {bench}"))?;
    let out = child.stdout.take().context("the benchmark's stdout")?;
    let (tx, rx) = mpsc::channel();
    let label = bench.to_owned();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(out);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            pass_to.write_all(&line).ok();
            pass_to.flush().ok();
            if let Some(t) = parse(&label, &String::from_utf8_lossy(&line))
                && tx.send(t).is_err()
            {
                break;
            }
        }
    });
    let status = child
        .wait()
        .with_context(|| format!("waiting for {bench}"))?;
    let mut targets = Vec::new();
    loop {
        match rx.recv_timeout(DRAIN_AFTER_EXIT) {
            Ok(t) => targets.push(t),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                eprintln!(
                    "warning: {bench} exited but its stdout is still open (a process it left behind?); not waiting for the rest"
                );
                break;
            }
        }
    }
    Ok((status, targets))
}

/// `== targets`, a table (benchmark, target, measured, bound, verdict) and the count line,
/// e.g. `targets: 9 met, 2 NOT met, 1 not measured`.
pub fn summary(targets: &[TargetLine]) -> String {
    let head = ["benchmark", "target", "measured", "bound", "verdict"];
    let rows: Vec<[&str; 5]> = targets
        .iter()
        .map(|t| {
            [
                t.bench.as_str(),
                t.name.as_str(),
                t.measured.as_str(),
                t.bound.as_str(),
                t.verdict.as_str(),
            ]
        })
        .collect();
    let mut width = head.map(|h| h.chars().count());
    for r in &rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let row = |cells: [&str; 5]| {
        let mut s = String::from("|");
        for (cell, w) in cells.iter().zip(width) {
            let pad = w - cell.chars().count();
            s += &format!(" {cell}{} |", " ".repeat(pad));
        }
        s + "\n"
    };
    let mut out = String::from("== targets (from the medians of each benchmark's rounds)\n");
    out += &row(head);
    out += "|";
    for w in width {
        out += &format!("{}|", "-".repeat(w + 2));
    }
    out += "\n";
    for r in rows {
        out += &row(r);
    }
    let count = |v: Verdict| targets.iter().filter(|t| t.verdict == v).count();
    out += &format!(
        "targets: {} met, {} NOT met, {} not measured\n",
        count(Verdict::Met),
        count(Verdict::NotMet),
        count(Verdict::NotMeasured)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_lines_are_read_with_their_verdict() {
        let t = parse(
            "connect-bench",
            "target: connect() inside/outside an enforced cgroup (median of rounds) | 1.045× | <= 1.050× | met\n",
        )
        .expect("a target line");
        assert_eq!(
            t,
            TargetLine {
                bench: "connect-bench".into(),
                name: "connect() inside/outside an enforced cgroup (median of rounds)".into(),
                measured: "1.045×".into(),
                bound: "<= 1.050×".into(),
                verdict: Verdict::Met,
            }
        );
        let not = parse("b", "target: x | 0.898× | >= 0.950× | NOT met").expect("line");
        assert_eq!(not.verdict, Verdict::NotMet);
        let none = parse("b", "target: x | - | <= 2.000 s | not measured").expect("line");
        assert_eq!(none.verdict, Verdict::NotMeasured);
        // Other lines, including the benchmarks' own prose about targets, are not targets.
        assert_eq!(parse("b", "targets: 1 met"), None);
        assert_eq!(
            parse("b", "(target: 1000000 events replayed in <= 2 s)"),
            None
        );
    }

    /// A `Write` whose bytes the test can read afterwards.
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_benchmarks_output_passes_through_and_its_targets_are_kept() {
        let out = Shared::default();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(
            "echo '| a table |'; echo 'target: a | 1.000× | <= 2.000× | met'; \
             printf 'target: b | - | >= 1.000× | not measured\nno newline at the end'; exit 3",
        );
        let (status, targets) =
            run_capturing(&mut cmd, "fake-bench --x", out.clone()).expect("run");
        assert_eq!(status.code(), Some(3));
        assert_eq!(
            targets
                .iter()
                .map(|t| (t.bench.as_str(), t.name.as_str(), t.verdict))
                .collect::<Vec<_>>(),
            [
                ("fake-bench --x", "a", Verdict::Met),
                ("fake-bench --x", "b", Verdict::NotMeasured)
            ]
        );
        let passed = String::from_utf8(out.0.lock().expect("lock").clone()).expect("utf-8");
        assert_eq!(
            passed,
            "| a table |\ntarget: a | 1.000× | <= 2.000× | met\ntarget: b | - | >= 1.000× | not measured\nno newline at the end"
        );
    }

    #[test]
    fn an_unreadable_target_line_is_never_met() {
        for line in [
            "target: x | 1.0× | <= 2.0× | probably",
            "target: x | 1.0× | met",
            "target: a | b | 1.0× | <= 2.0× | met",
        ] {
            let t = parse("b", line).expect("a target line");
            assert_eq!(t.verdict, Verdict::NotMeasured, "{line}");
            assert!(t.name.starts_with("(unreadable target line)"), "{line}");
        }
    }

    #[test]
    fn the_summary_has_a_row_per_target_and_counts_them() {
        let t = |bench: &str, line: &str| parse(bench, line).expect("line");
        let s = summary(&[
            t(
                "connect-bench",
                "target: connect() in/out | 1.045× | <= 1.050× | met",
            ),
            t(
                "proxy-bench --rate-only --cpu-quota 50",
                "target: tunnels/s, agent/squid | 1.790× | >= 2.000× | NOT met",
            ),
            t(
                "dns-bench",
                "target: DNS µs, agent/mmsg | - | <= 1.150× | not measured",
            ),
            t("store-bench", "target: flood | 1.002× | >= 0.950× | met"),
        ]);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(
            lines[0],
            "== targets (from the medians of each benchmark's rounds)"
        );
        assert_eq!(lines.len(), 1 + 2 + 4 + 1, "{s}");
        assert!(lines[1].starts_with("| benchmark "), "{s}");
        assert!(lines[3].contains("| connect-bench "), "{s}");
        assert!(lines[4].trim_end().ends_with("| NOT met      |"), "{s}");
        // Aligned: every row as wide as the header, in characters.
        let w = lines[1].chars().count();
        assert!(lines[1..7].iter().all(|l| l.chars().count() == w), "{s}");
        assert_eq!(lines[7], "targets: 2 met, 1 NOT met, 1 not measured");
        assert_eq!(
            summary(&[]).lines().last(),
            Some("targets: 0 met, 0 NOT met, 0 not measured")
        );
    }
}
