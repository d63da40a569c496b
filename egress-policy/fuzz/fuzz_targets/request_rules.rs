//! The request-rule matcher: arbitrary (glob, method, path) triples. Invariants: never panics;
//! path normalisation is idempotent and its output has no dot/empty segments, no encoded `/`
//! or `\`, no escaped unreserved character and only upper-case escapes; the glob matcher agrees
//! with a naive recursive reference; `/**` matches every normal path; a normal path read as a
//! glob matches itself; a `deny /**` rule denies everything.
#![no_main]

use egress_policy::matcher::HostPattern;
use egress_policy::rules::{
    self, NormalPath, PathGlob, RequestRule, RuleAction, RuleVerdict, normalize_path,
};
use libfuzzer_sys::fuzz_target;

fn seg_ref(p: &[u8], s: &[u8]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => seg_ref(&p[1..], s) || (!s.is_empty() && seg_ref(p, &s[1..])),
        (Some(a), Some(b)) if a == b => seg_ref(&p[1..], &s[1..]),
        _ => false,
    }
}

fn glob_ref(g: &[&str], p: &[&str]) -> bool {
    match g.first() {
        None => p.is_empty(),
        Some(&"**") => glob_ref(&g[1..], p) || (!p.is_empty() && glob_ref(g, &p[1..])),
        Some(seg) => {
            !p.is_empty() && seg_ref(seg.as_bytes(), p[0].as_bytes()) && glob_ref(&g[1..], &p[1..])
        }
    }
}

fn check_normal(n: &NormalPath) {
    let s = n.as_str();
    assert!(s.starts_with('/'));
    let segs: Vec<&str> = s[1..].split('/').collect();
    for (i, seg) in segs.iter().enumerate() {
        assert!(*seg != "." && *seg != "..", "{s}");
        assert!(!seg.is_empty() || i == segs.len() - 1, "{s}");
    }
    let b = s.as_bytes();
    for (i, c) in b.iter().enumerate() {
        assert!(c.is_ascii_graphic() && !b"\\;?#".contains(c), "{s}");
        if *c == b'%' {
            let hex = &s[i + 1..i + 3];
            assert_eq!(hex, hex.to_ascii_uppercase(), "{s}");
            let v = u8::from_str_radix(hex, 16).expect("escape");
            assert!(
                !(v.is_ascii_alphanumeric() || b"-._~/\\".contains(&v)),
                "{s}"
            );
        }
    }
    assert_eq!(normalize_path(s).as_ref(), Ok(n), "not idempotent: {s}");
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let mut parts = s.splitn(3, '\n');
    let (glob, method, path) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or("GET"),
        parts.next().unwrap_or("/"),
    );
    let Ok(norm) = normalize_path(path) else {
        return;
    };
    check_normal(&norm);
    let segs: Vec<&str> = norm.as_str()[1..].split('/').collect();
    assert!(PathGlob::default().matches(&norm));
    // Within the glob bounds (32 segments, 512 characters), a normal path is a glob of itself.
    if !norm.as_str().contains('*') && segs.len() <= 32 && norm.as_str().len() <= 512 {
        let own = PathGlob::parse(norm.as_str()).expect("a normal path is a glob");
        assert!(own.matches(&norm));
    }
    if let Ok(g) = PathGlob::parse(glob) {
        let gsegs: Vec<&str> = g.as_str()[1..].split('/').collect();
        assert_eq!(
            g.matches(&norm),
            glob_ref(&gsegs, &segs),
            "{glob} vs {}",
            norm.as_str()
        );
        let host = HostPattern::parse("api.test").expect("pattern");
        let rule = |action, path: PathGlob| RequestRule {
            host: host.clone(),
            port: 443,
            action,
            methods: vec![],
            path,
        };
        let rs = [rule(RuleAction::Allow, g.clone())];
        let want = if g.matches(&norm) {
            RuleVerdict::Allowed
        } else {
            RuleVerdict::NotAllowed
        };
        assert_eq!(rules::decide(rs.iter().enumerate(), method, &norm), want);
        let deny = [
            rule(RuleAction::Deny, PathGlob::default()),
            rule(RuleAction::Allow, g),
        ];
        assert_eq!(
            rules::decide(deny.iter().enumerate(), method, &norm),
            RuleVerdict::Denied(0)
        );
    }
});
