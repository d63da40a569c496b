//! No two-way dependency between top-level modules of any crate of the workspace (issue #21).
//!
//! A top-level module `a` depends on `b` when a non-comment line of a file under `src/a` (or
//! `src/a.rs`), before its `#[cfg(test)]` part, names `crate::b` (`use crate::b::..`,
//! `crate::{b, ..}`, a path in an expression). Two modules that depend on each other form a
//! cycle; any cycle fails, with the lines that make each direction. Between crates, cargo already
//! refuses cycles (`egress-policy` can't name the agent at all).
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose `src/` is checked (paths from the workspace root).
const CRATES: &[&str] = &[
    "egress-agent",
    "egress-policy",
    "egress-common",
    "egress-ebpf",
    "xtask",
    "tests",
];

fn rs_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)
            .expect("read src")
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for e in entries {
            rs_files(&e, out);
        }
    } else if p.is_file() && p.extension().is_some_and(|e| e == "rs") {
        out.push(p.to_owned());
    }
}

/// The modules a line names after `crate::` (single paths and `crate::{a, b::c}` groups).
fn named(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(item.split("::").next().unwrap_or("").trim().to_owned());
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            out.push(item.split("::").next().unwrap_or("").trim().to_owned());
        } else {
            let name: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
        rest = after;
    }
    out.retain(|n| !n.is_empty() && n != "self");
    out
}

#[test]
fn no_two_way_module_dependencies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let mut found = Vec::new();
    for krate in CRATES {
        let src = root.join(krate).join("src");
        assert!(src.is_dir(), "{} is not a directory", src.display());
        found.extend(cycles(&src).into_iter().map(|c| format!("{krate}: {c}")));
    }
    assert!(
        found.is_empty(),
        "two-way dependencies between top-level modules (move the shared part down a layer, or \
         the caller's part up):\n{}",
        found.join("\n")
    );
}

/// The cycles among the top-level modules of the crate at `src`, each with one line per
/// direction.
fn cycles(src: &Path) -> Vec<String> {
    let mut modules = BTreeSet::new();
    for e in std::fs::read_dir(src).expect("src").flatten() {
        let p = e.path();
        let name = p
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("")
            .to_owned();
        if (p.is_dir() || p.extension().is_some_and(|x| x == "rs"))
            && name != "lib"
            && name != "main"
        {
            modules.insert(name);
        }
    }
    // (from, to) → one line that makes the edge, for the message.
    let mut edges: BTreeMap<(String, String), String> = BTreeMap::new();
    for m in &modules {
        let mut files = Vec::new();
        rs_files(&src.join(m), &mut files);
        rs_files(&src.join(format!("{m}.rs")), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).expect("read");
            for (i, line) in text.lines().enumerate() {
                let code = line.trim_start();
                // Unit tests (at the end of a file, by convention) may reach up the layers.
                if code.starts_with("#[cfg(test)]") {
                    break;
                }
                if code.starts_with("//") {
                    continue;
                }
                for to in named(code) {
                    if &to != m && modules.contains(&to) {
                        edges.entry((m.clone(), to)).or_insert_with(|| {
                            format!(
                                "{}:{}: {}",
                                f.strip_prefix(src).unwrap_or(&f).display(),
                                i + 1,
                                code.trim()
                            )
                        });
                    }
                }
            }
        }
    }
    let mut cycles = BTreeSet::new();
    for (a, b) in edges.keys() {
        if a < b && edges.contains_key(&(b.clone(), a.clone())) {
            cycles.insert((a.clone(), b.clone()));
        }
    }
    cycles
        .iter()
        .map(|(a, b)| {
            format!(
                "{a} <-> {b}\n  {}\n  {}",
                edges[&(a.clone(), b.clone())],
                edges[&(b.clone(), a.clone())]
            )
        })
        .collect()
}
