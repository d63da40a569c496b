//! The agent never runs an external program by bare name (`Command::new("ip")`): a program is run
//! by an absolute path found on the absolute entries of the search path (`host_tool.rs`, the
//! doctor's `tool.rs`), or is the agent itself (`/proc/self/exe`). This reads the sources: any
//! `Command::new("<literal>")` whose literal is not an absolute path fails, with its file and line.
use std::path::{Path, PathBuf};

fn rs_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        for e in std::fs::read_dir(p).expect("read src").flatten() {
            rs_files(&e.path(), out);
        }
    } else if p.extension().is_some_and(|e| e == "rs") {
        out.push(p.to_owned());
    }
}

/// `(line, literal)` of every `Command::new("...")` in `text`.
fn literal_commands(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("Command::new(") {
            rest = &rest[at + "Command::new(".len()..];
            let arg = rest.trim_start();
            if let Some(lit) = arg.strip_prefix('"') {
                let end = lit.find('"').unwrap_or(lit.len());
                out.push((i + 1, lit[..end].to_owned()));
            }
        }
    }
    out
}

#[test]
fn no_program_is_run_by_bare_name() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut bad = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read source");
        for (line, lit) in literal_commands(&text) {
            if !lit.starts_with('/') {
                bad.push(format!("{}:{line}: Command::new({lit:?})", f.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "programs run by bare name (use host_tool::find):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_scanner_sees_a_bare_name() {
    let text = "let a = Command::new(\"ip\");\nlet b = tokio::process::Command::new( \"/proc/self/exe\");\nCommand::new(exe);\n";
    assert_eq!(
        literal_commands(text),
        [(1, "ip".to_owned()), (2, "/proc/self/exe".to_owned())]
    );
}
