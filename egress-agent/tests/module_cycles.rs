//! No dependency cycle between the top-level modules of any crate of the workspace (issues #21,
//! #37): a module graph that is a DAG is one a newcomer can read bottom-up.
//!
//! A top-level module `a` depends on `b` when code under `src/a` (or `src/a.rs`), before its
//! `#[cfg(test)]` part, names `b` by a path: `crate::b`, `crate::{b, ..}` (a `use` group read
//! whole, across lines), or `super::…` climbing to the crate root and down into `b`. Comments,
//! string and character literals are not code. Any cycle — of two modules or of more — fails,
//! with the path and one line per edge. Between crates, cargo already refuses cycles
//! (`egress-policy` can't name the agent at all).
//!
//! Three more layout rules read from the same graph and text (issue #37): the runtimes only feed
//! the workload enforcer (no runtime module uses another's); the proxy acts on its decisions in
//! `proxy/act.rs` alone (no other proxy module builds or emits an event); and a production
//! function longer than [`MAX_FN_LINES`] says why in a `// Long:` comment above it.
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

/// `text` with comments, string literals and character literals replaced by spaces (newlines
/// kept, so offsets and line numbers stay).
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !b
                .get(i.wrapping_sub(1))
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            j += 1;
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            let end = (j + close.len()).min(b.len());
            out.extend(b[i..end].iter().map(|c| blank(*c)));
            i = end;
        } else if c == '"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != '"' {
                j += if b[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            out.extend(b[i..end].iter().map(|c| blank(*c)));
            i = end;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            let lit = match (next, b.get(i + 2)) {
                (Some('\\'), _) => b[i + 2..]
                    .iter()
                    .position(|c| *c == '\'')
                    .map(|p| i + 3 + p),
                (Some(_), Some('\'')) => Some(i + 3),
                _ => None,
            };
            match lit {
                Some(end) => {
                    out.extend(b[i..end].iter().map(|c| blank(*c)));
                    i = end;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The first segment of each path item of a `{…}` group starting after `{` in `s`.
fn group_heads(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut item = String::new();
    for c in s.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(head(&item));
                item.clear();
                continue;
            }
            _ => {}
        }
        if depth == 0 {
            item.push(c);
        }
    }
    out.push(head(&item));
    out
}

fn head(item: &str) -> String {
    item.split("::").next().unwrap_or("").trim().to_owned()
}

fn ident_at(s: &str) -> String {
    s.trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The top-level modules that `code` (of a file whose module path is `module`, e.g. `["proxy",
/// "dns"]`) names by path, each with the byte offset of the path.
fn named(code: &str, module: &[String]) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let boundary = |i: usize| {
        i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':')
    };
    for (i, _) in code.match_indices("crate::") {
        if !boundary(i) {
            continue;
        }
        let after = &code[i + "crate::".len()..];
        match after.trim_start().strip_prefix('{') {
            Some(group) => out.extend(group_heads(group).into_iter().map(|m| (m, i))),
            None => out.push((ident_at(after), i)),
        }
    }
    for (i, _) in code.match_indices("super::") {
        if !boundary(i) {
            continue;
        }
        // Climb: each `super::` is one level up from this file's module.
        let mut depth = module.len();
        let mut rest = &code[i..];
        while let Some(r) = rest.strip_prefix("super::") {
            depth = depth.saturating_sub(1);
            rest = r.trim_start();
        }
        if depth > 0 {
            // Still inside this file's own top-level module.
            continue;
        }
        match rest.strip_prefix('{') {
            Some(group) => out.extend(group_heads(group).into_iter().map(|m| (m, i))),
            None => out.push((ident_at(rest), i)),
        }
    }
    out.retain(|(n, _)| !n.is_empty() && n != "self" && n != "super");
    out
}

/// A file's module path under `src` (`proxy/dns/mod.rs` → `["proxy", "dns"]`).
fn module_path(src: &Path, f: &Path) -> Vec<String> {
    let rel = f.strip_prefix(src).unwrap_or(f).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

#[test]
fn no_module_dependency_cycles() {
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
        "dependency cycles between top-level modules (move the shared part down a layer, or \
         the caller's part up):\n{}",
        found.join("\n")
    );
}

/// (from, to) → one place that makes the edge.
type Edges = BTreeMap<(String, String), String>;

/// The cycles among the top-level modules of the crate at `src`: one per strongly connected
/// group of modules, as a path with the line that makes each edge.
fn cycles(src: &Path) -> Vec<String> {
    let (modules, edges) = graph(src);
    strongly_connected(&modules, &edges)
        .into_iter()
        .filter(|group| group.len() > 1)
        .map(|group| describe(&group, &edges))
        .collect()
}

/// The runtimes of the agent: each only feeds the workload enforcer.
const RUNTIMES: &[&str] = &["docker", "containerd", "exec"];

/// No runtime module uses another runtime's module, and the enforcer uses none of them
/// (docs/architecture.md, "Workloads and runtimes"): a pod fix never means editing Docker files.
#[test]
fn runtimes_only_feed_the_workload_enforcer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (modules, edges) = graph(&src);
    for m in RUNTIMES.iter().chain(&["workload"]) {
        assert!(modules.contains(*m), "no module {m} in {}", src.display());
    }
    let crossing: Vec<String> = edges
        .iter()
        .filter(|((from, to), _)| {
            RUNTIMES.contains(&to.as_str())
                && (RUNTIMES.contains(&from.as_str()) || from == "workload")
        })
        .map(|((from, to), at)| format!("{from} → {to}: {at}"))
        .collect();
    assert!(
        crossing.is_empty(),
        "a runtime (or the enforcer) uses a runtime's module; move the shared part into workload/:\n{}",
        crossing.join("\n")
    );
}

/// The crate's top-level modules and the edges between them (unit tests left out).
fn graph(src: &Path) -> (BTreeSet<String>, Edges) {
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
    let mut edges = Edges::new();
    for m in &modules {
        let mut files = Vec::new();
        rs_files(&src.join(m), &mut files);
        rs_files(&src.join(format!("{m}.rs")), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).expect("read");
            let mut code = code_only(&text);
            // Unit tests (at the end of a file, by convention) may reach up the layers.
            if let Some(t) = code.find("#[cfg(test)]") {
                code.truncate(t);
            }
            let module = module_path(src, &f);
            for (to, at) in named(&code, &module) {
                if &to != m && modules.contains(&to) {
                    edges.entry((m.clone(), to)).or_insert_with(|| {
                        let line = code[..at].matches('\n').count();
                        format!(
                            "{}:{}: {}",
                            f.strip_prefix(src).unwrap_or(&f).display(),
                            line + 1,
                            text.lines().nth(line).unwrap_or("").trim()
                        )
                    });
                }
            }
        }
    }
    (modules, edges)
}

/// Tarjan's strongly connected components of the module graph.
fn strongly_connected(modules: &BTreeSet<String>, edges: &Edges) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        groups: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        let next: Vec<&'a str> = s
            .edges
            .keys()
            .filter(|(a, _)| a == v)
            .map(|(_, b)| b.as_str())
            .collect();
        for w in next {
            if !s.index.contains_key(w) {
                visit(s, w);
                let l = s.low[w].min(s.low[v]);
                s.low.insert(v, l);
            } else if s.on_stack.contains(w) {
                let l = s.index[w].min(s.low[v]);
                s.low.insert(v, l);
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            group.sort();
            s.groups.push(group);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        groups: Vec::new(),
    };
    for m in modules {
        if !s.index.contains_key(m.as_str()) {
            visit(&mut s, m);
        }
    }
    s.groups
}

/// One cycle through `group` (a shortest one from its first module back to it), edge by edge.
fn describe(group: &[String], edges: &Edges) -> String {
    let inside: BTreeSet<&str> = group.iter().map(String::as_str).collect();
    let start = group[0].as_str();
    // Breadth-first from `start` inside the group until an edge returns to it.
    let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
    let mut frontier = vec![start];
    let mut last = None;
    'search: while !frontier.is_empty() {
        let mut next = Vec::new();
        for v in frontier {
            for (a, b) in edges.keys() {
                if a != v || !inside.contains(b.as_str()) {
                    continue;
                }
                if b == start {
                    last = Some(v);
                    break 'search;
                }
                if !prev.contains_key(b.as_str()) {
                    prev.insert(b.as_str(), v);
                    next.push(b.as_str());
                }
            }
        }
        frontier = next;
    }
    let mut path = vec![start];
    let mut v = last.unwrap_or(start);
    let mut back = vec![v];
    while v != start {
        v = prev[v];
        back.push(v);
    }
    back.pop();
    back.reverse();
    path.extend(back);
    path.push(start);
    let mut text = format!(
        "{} (modules in the cycle: {})",
        path.join(" -> "),
        group.join(", ")
    );
    for w in path.windows(2) {
        text.push_str(&format!(
            "\n  {} -> {}: {}",
            w[0],
            w[1],
            edges[&(w[0].to_owned(), w[1].to_owned())]
        ));
    }
    text
}

#[test]
fn paths_are_read_whole_and_comments_are_not_code() {
    let code = code_only(
        "use crate::{\n    a::X,\n    b::{c, d},\n};\n// crate::nope\nlet s = \"crate::str\";\n/* crate::blk */ let c = '\"'; crate::e::f();\nlet r = r#\"crate::raw\"#;\n",
    );
    let got: Vec<String> = named(&code, &["m".to_owned()])
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(got, ["a", "b", "e"]);
    // `super::` climbs from the file's module: from proxy/dns/tcp.rs, two levels stay in proxy,
    // three reach the crate root.
    let m = ["proxy".to_owned(), "dns".to_owned(), "tcp".to_owned()];
    let got: Vec<String> = named(
        "super::super::X; super::super::super::{store, config::C};",
        &m,
    )
    .into_iter()
    .map(|(n, _)| n)
    .collect();
    assert_eq!(got, ["store", "config"]);
}

#[test]
fn cycles_of_any_length_are_found() {
    let e = |a: &str, b: &str| {
        (
            (a.to_owned(), b.to_owned()),
            format!("{a}.rs:1: use crate::{b};"),
        )
    };
    let edges: Edges = [e("a", "b"), e("b", "c"), e("c", "a"), e("c", "d")]
        .into_iter()
        .collect();
    let modules: BTreeSet<String> = ["a", "b", "c", "d"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let groups: Vec<_> = strongly_connected(&modules, &edges)
        .into_iter()
        .filter(|g| g.len() > 1)
        .collect();
    assert_eq!(groups, [["a", "b", "c"]]);
    let text = describe(&groups[0], &edges);
    assert!(text.starts_with("a -> b -> c -> a"), "{text}");
}

/// Production code (unit tests and the test crate aside) whose functions are held to
/// [`MAX_FN_LINES`].
const PRODUCTION: &[&str] = &[
    "egress-agent",
    "egress-policy",
    "egress-common",
    "egress-ebpf",
    "xtask",
];

/// Longer functions need a reason, in a `// Long: ...` comment just above them (among their
/// doc comments and attributes).
const MAX_FN_LINES: usize = 120;

/// Every function of the production code longer than [`MAX_FN_LINES`] without a `// Long:`
/// comment: `file:line name (n lines)`.
fn long_functions(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rs_files(src, &mut files);
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read");
        let mut code = code_only(&text);
        if let Some(t) = code.find("#[cfg(test)]") {
            code.truncate(t);
        }
        let lines: Vec<&str> = text.lines().collect();
        for (name, start, end) in functions(&code) {
            let n = end - start + 1;
            if n <= MAX_FN_LINES {
                continue;
            }
            let reasoned = lines[..start]
                .iter()
                .rev()
                .map(|l| l.trim())
                .take_while(|l| l.starts_with("//") || l.starts_with("#[") || l.starts_with(')'))
                .any(|l| l.starts_with("// Long:"));
            if !reasoned {
                found.push(format!(
                    "{}:{} fn {name} ({n} lines)",
                    f.strip_prefix(src).unwrap_or(&f).display(),
                    start + 1
                ));
            }
        }
    }
    found
}

/// Each function with a body in `code` (comments and strings blanked): its name and its first
/// and last line (0-based).
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let bytes = code.as_bytes();
    let line_of = |at: usize| code[..at].matches('\n').count();
    let mut out = Vec::new();
    for (i, _) in code.match_indices("fn ") {
        let word_start = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if !word_start {
            continue;
        }
        let name = ident_at(&code[i + 3..]);
        if name.is_empty() {
            continue;
        }
        // The body opens at the first `{` before any `;` (a declaration has none).
        let Some(open) = code[i..].find(['{', ';']).map(|o| i + o) else {
            continue;
        };
        if bytes[open] == b';' {
            continue;
        }
        let mut depth = 0usize;
        let mut close = None;
        for (j, b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(j);
                        break;
                    }
                }
                _ => {}
            }
        }
        if let Some(close) = close {
            out.push((name, line_of(i), line_of(close)));
        }
    }
    out
}

#[test]
fn long_functions_say_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let mut found = Vec::new();
    for krate in PRODUCTION {
        let src = root.join(krate).join("src");
        found.extend(
            long_functions(&src)
                .into_iter()
                .map(|l| format!("{krate}/src/{l}")),
        );
    }
    assert!(
        found.is_empty(),
        "functions over {MAX_FN_LINES} lines: split them into named steps, or say why not in a \
         `// Long: ...` comment above them:\n{}",
        found.join("\n")
    );
}

#[test]
fn function_lengths_are_measured_from_code() {
    let code = code_only(
        "fn a() {\n    let s = \"}\";\n    // }\n}\nfn b();\nimpl X { fn c(&self) -> u8 {\n 1\n } }\n",
    );
    let f = functions(&code);
    assert_eq!(
        f,
        vec![("a".to_owned(), 0, 3), ("c".to_owned(), 5, 7)],
        "{code}"
    );
}

/// What only `proxy/act.rs` does with a decision: build an event, reach the event sink, name a
/// verdict, count the traffic as allowed (issue #37: one place acts on a decision).
const ACTING: &[&str] = &["DenialEvent", ".events()", "Verdict::", ".allowed()"];

/// The proxy acts on its decisions in one place: no other module of `proxy/` builds or emits an
/// event or counts allowed traffic (production code; unit tests and the test harness may).
#[test]
fn the_proxy_acts_on_decisions_in_one_place() {
    let proxy = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/proxy");
    let mut files = Vec::new();
    rs_files(&proxy, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("act.rs")),
        "no proxy/act.rs"
    );
    let mut found = Vec::new();
    for f in files {
        if f.ends_with("act.rs") || f.ends_with("run_tests.rs") {
            continue;
        }
        let mut code = code_only(&std::fs::read_to_string(&f).expect("read"));
        if let Some(t) = code.find("#[cfg(test)]") {
            code.truncate(t);
        }
        for (n, line) in code.lines().enumerate() {
            for what in ACTING.iter().filter(|w| line.contains(**w)) {
                found.push(format!("{}:{}: {what}", f.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "acting on a decision outside proxy/act.rs (hand the decision to Shared::act):\n{}",
        found.join("\n")
    );
}
