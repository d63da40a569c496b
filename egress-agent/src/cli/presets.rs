//! `egress-agent presets`: the built-in presets, every host of each (nothing hidden), and what a
//! the docs' generated list of them. Reads the embedded data only: no daemon. (What a newer data
//! file changed is `check --presets-from`, in `check`.)
use std::fmt::Write as _;

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};
use serde_json::Value;

use egress_policy::presets::{Preset, Presets};

#[derive(Debug, Args)]
pub struct PresetsArgs {
    #[command(subcommand)]
    pub command: Option<PresetsCommand>,
    /// JSON output.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum PresetsCommand {
    /// Name, description and host count of each preset (the default).
    List,
    /// Every host of a preset with its ports, and where the list comes from.
    Show {
        /// The preset's name.
        name: String,
    },
}

pub fn run(args: &PresetsArgs) -> Result<()> {
    let all = Presets::builtin();
    let out = match &args.command {
        None | Some(PresetsCommand::List) if args.json => {
            let list: Vec<Value> = all.iter().map(Preset::summary).collect();
            format!("{}\n", serde_json::to_string_pretty(&list)?)
        }
        None | Some(PresetsCommand::List) => list_text(all),
        Some(PresetsCommand::Show { name }) => {
            let preset = all.get(name).ok_or_else(|| {
                anyhow!("no preset named {name:?}; the presets are: {}", all.names())
            })?;
            if args.json {
                format!("{}\n", serde_json::to_string_pretty(preset)?)
            } else {
                show_text(preset)
            }
        }
    };
    print!("{out}");
    Ok(())
}

fn list_text(all: &Presets) -> String {
    let width = all.iter().map(|p| p.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for p in all.iter() {
        writeln!(
            out,
            "{:width$}  {:>2} hosts  {}",
            p.name,
            p.hosts.len(),
            p.description
        )
        .ok();
    }
    out.push_str("\n`egress-agent presets show NAME` prints every host of one.\n");
    out
}

fn show_text(p: &Preset) -> String {
    let mut out = format!("{}: {}\n\n", p.name, p.description);
    let width = p
        .hosts
        .iter()
        .map(|h| h.pattern.to_string().len())
        .max()
        .unwrap_or(0);
    for h in &p.hosts {
        let ports = if h.ports.is_empty() {
            "allow_ports".to_owned()
        } else {
            let own: Vec<String> = h.ports.iter().map(u16::to_string).collect();
            format!("allow_ports and {}", own.join(", "))
        };
        writeln!(out, "  {:width$}  {ports}", h.pattern.to_string()).ok();
    }
    writeln!(out, "\nchecked {} against:", p.checked).ok();
    for s in &p.sources {
        writeln!(out, "  {s}").ok();
    }
    out
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use std::path::Path;

    use egress_policy::presets;

    use super::*;

    /// docs/policy.md carries the generated list between these markers.
    const BEGIN: &str = "<!-- presets:begin: generated from egress-policy/presets.toml -->\n";
    const END: &str = "<!-- presets:end -->";

    #[test]
    fn policy_md_lists_the_presets() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/policy.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let (head, rest) = doc.split_once(BEGIN).expect("the begin marker");
        let (block, tail) = rest.split_once(END).expect("the end marker");
        let want = presets::markdown(Presets::builtin());
        if block == want {
            return;
        }
        if std::env::var_os("EGRESS_UPDATE_DOCS").is_some() {
            std::fs::write(&path, format!("{head}{BEGIN}{want}{END}{tail}")).unwrap();
            return;
        }
        panic!(
            "docs/policy.md's preset list differs from egress-policy/presets.toml; regenerate it: \
             EGRESS_UPDATE_DOCS=1 cargo test -p egress-agent --lib policy_md_lists_the_presets"
        );
    }

    #[test]
    fn list_and_show_name_every_host() {
        let all = Presets::builtin();
        let list = list_text(all);
        for p in all.iter() {
            assert!(
                list.contains(&p.name) && list.contains(&p.description),
                "{list}"
            );
        }
        let github = show_text(all.get("github").unwrap());
        assert!(github.contains("  github.com "), "{github}");
        assert!(github.contains("allow_ports and 22"), "{github}");
        for h in &all.get("github").unwrap().hosts {
            assert!(github.contains(&h.pattern.to_string()), "{h} in {github}");
        }
        assert!(github.contains("checked 20"), "{github}");
    }
}
