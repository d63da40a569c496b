//! The doctor's text report: the gaps (or every probe), a neutral tally, and — with a baseline —
//! its verdict (coloured on a terminal) and what it misses.

use super::baseline::Verdict;
use super::{Report, Status};

/// How to print the text report.
#[derive(Clone, Copy, Debug, Default)]
pub struct TextView<'a> {
    /// Print passing probes too (default: only `warn`, `fail` and `skip`).
    pub all: bool,
    /// The baseline verdict to add under the tally.
    pub baseline: Option<&'a Verdict>,
    /// ANSI colour on the verdict line.
    pub color: bool,
}

const GREEN: &str = "\x1b[32m";
const RED: &str = "\x1b[31m";
const RESET: &str = "\x1b[0m";

impl Report {
    /// The report as text, per `view`.
    pub fn render_text(&self, view: &TextView<'_>) -> String {
        let mut out = String::new();
        for c in self
            .checks
            .iter()
            .filter(|c| view.all || c.status != Status::Pass)
        {
            out.push_str(&format!(
                "[{:<4}] {:<24} {}\n",
                c.status.as_str(),
                c.id,
                c.summary
            ));
            if let Some(fix) = &c.fix {
                out.push_str(&format!("       {:<24} fix: {}\n", "", fix));
            }
        }
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        let passed = count(Status::Pass);
        out.push_str(&format!(
            "{} pass, {} warn, {} fail, {} skip{}\n",
            passed,
            count(Status::Warn),
            count(Status::Fail),
            count(Status::Skip),
            if view.all || passed == 0 {
                ""
            } else {
                " (passing probes not shown: --all)"
            }
        ));
        if let Some(v) = view.baseline {
            out.push_str(&verdict_lines(v, view.color));
        }
        out
    }
}

fn verdict_lines(v: &Verdict, color: bool) -> String {
    let (line, paint) = if v.met {
        (
            format!(
                "baseline {}: met ({} required probes pass)",
                v.name, v.required
            ),
            GREEN,
        )
    } else {
        (
            format!(
                "baseline {}: missed ({} of {} required probes do not pass)",
                v.name,
                v.missing.len(),
                v.required
            ),
            RED,
        )
    };
    let mut out = if color {
        format!("{paint}{line}{RESET}\n")
    } else {
        format!("{line}\n")
    };
    for m in &v.missing {
        out.push_str(&format!("  missing: {} ({})\n", m.id, m.status.as_str()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Check;
    use super::super::baseline::Miss;
    use super::*;

    fn report() -> Report {
        let check = |id, status: Status| Check {
            id,
            status,
            summary: format!("{id} summary"),
            fix: (status != Status::Pass).then(|| "do it".to_owned()),
        };
        Report {
            checks: vec![
                check("kernel.btf", Status::Pass),
                check("host.fail2ban", Status::Skip),
                check("host.ufw", Status::Warn),
            ],
        }
    }

    #[test]
    fn gaps_only_unless_all() {
        let r = report();
        let gaps = r.render_text(&TextView::default());
        assert!(!gaps.contains("kernel.btf"), "{gaps}");
        assert!(
            gaps.contains("host.fail2ban") && gaps.contains("host.ufw"),
            "{gaps}"
        );
        assert!(gaps.contains("1 pass, 1 warn, 0 fail, 1 skip (passing probes not shown"));
        assert!(
            !gaps.contains("baseline") && !gaps.contains('\x1b'),
            "{gaps}"
        );
        let all = r.render_text(&TextView {
            all: true,
            ..TextView::default()
        });
        assert!(all.contains("kernel.btf"), "{all}");
        assert_eq!(all, r.to_text());
    }

    #[test]
    fn baseline_line_is_coloured_and_lists_misses() {
        let r = report();
        let missed = Verdict {
            name: "standard".into(),
            met: false,
            required: 2,
            missing: vec![Miss {
                id: "host.fail2ban".into(),
                status: Status::Skip,
            }],
        };
        let text = r.render_text(&TextView {
            baseline: Some(&missed),
            color: true,
            ..TextView::default()
        });
        assert!(
            text.contains(
                "\x1b[31mbaseline standard: missed (1 of 2 required probes do not pass)\x1b[0m"
            ),
            "{text}"
        );
        assert!(text.contains("  missing: host.fail2ban (skip)\n"), "{text}");
        let met = Verdict {
            met: true,
            missing: Vec::new(),
            ..missed
        };
        let text = r.render_text(&TextView {
            baseline: Some(&met),
            ..TextView::default()
        });
        assert!(
            text.ends_with("baseline standard: met (2 required probes pass)\n"),
            "{text}"
        );
    }
}
