//! A flow's labels read in place (`store::query::Labels`, what `replay` reads a million rows
//! with): the labels a workload chose (a process name, a label value) as the store writes them
//! (serde_json of the map), and any text at all as a row's `labels`. Input: lines `KEY=VALUE`;
//! the first line's key and every line's key are looked up. Invariants: never panics; for the
//! store's own text, every lookup answers exactly as the parsed JSON, and the map read back is
//! the map written; for arbitrary text, a lookup never panics.
#![no_main]

use std::collections::BTreeMap;

use egress_agent::store::query::Labels;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let map: BTreeMap<String, String> = s
        .lines()
        .take(32)
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let text = serde_json::to_string(&map).expect("a map of strings serializes");
    let labels = Labels::of_text(&text);
    let probes = s.lines().take(32).map(|l| l.split_once('=').map_or(l, |(k, _)| k));
    for key in probes.chain(map.keys().map(String::as_str)) {
        assert_eq!(labels.get(key), map.get(key).map(String::as_str), "{text} {key:?}");
    }
    let back = labels.to_map();
    assert_eq!(back, map, "{text}");
    // Any text as a row's labels: never a panic.
    let raw = Labels::of_text(s);
    for key in s.lines().take(8) {
        let _ = raw.get(key);
    }
});
