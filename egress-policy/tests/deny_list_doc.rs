//! docs/policy.md's "Built-in deny list" table is the crate's `BUILTIN_DENY`, both ways: every row
//! is an entry with the same label, every entry has a row, nothing twice.
use std::collections::BTreeSet;

use egress_policy::addr::BUILTIN_DENY;

/// The `(range, label)` of each row of the table under `### Built-in deny list`: the first two
/// code spans of each `| ... |` line up to the next heading.
fn doc_rows(doc: &str) -> Vec<(String, String)> {
    let start = doc
        .find("\n### Built-in deny list\n")
        .expect("docs/policy.md has a `### Built-in deny list` section");
    let section = &doc[start + 1..];
    let end = section[4..].find("\n#").map_or(section.len(), |i| i + 4);
    section[..end]
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let code = |c: &str| {
                c.strip_prefix('`')
                    .and_then(|c| c.strip_suffix('`'))
                    .unwrap_or_else(|| panic!("not a code span: {c:?} in {l:?}"))
                    .to_owned()
            };
            (code(cells[1]), code(cells[2]))
        })
        .collect()
}

#[test]
fn the_documented_deny_list_is_the_built_in_one() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/policy.md");
    let doc = std::fs::read_to_string(path).expect("read docs/policy.md");
    let rows = doc_rows(&doc);
    let documented: BTreeSet<(String, String)> = rows.iter().cloned().collect();
    assert_eq!(documented.len(), rows.len(), "a row appears twice");
    let built_in: BTreeSet<(String, String)> = BUILTIN_DENY
        .iter()
        .map(|(r, l)| ((*r).to_owned(), (*l).to_owned()))
        .collect();
    let missing: Vec<_> = built_in.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&built_in).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/policy.md's deny list differs from BUILTIN_DENY:\n  in the code, not the doc: {missing:?}\n  in the doc, not the code: {extra:?}"
    );
}

#[test]
fn the_parser_sees_a_difference() {
    let doc = "x\n### Built-in deny list\n\n| range | label |\n| --- | --- |\n| `10.0.0.0/8` | `rfc1918` | private |\n\n## Next\n| `1.1.1.1/32` | `no` |\n";
    assert_eq!(
        doc_rows(doc),
        [("10.0.0.0/8".to_owned(), "rfc1918".to_owned())]
    );
}
