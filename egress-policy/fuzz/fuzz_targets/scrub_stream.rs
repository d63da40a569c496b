//! Response scrubbing (`policy::scrub`): a random printable secret, encoded one of the ways an
//! upstream echoes it (raw, hex, base64 of `Bearer `+secret, base64url of `user:`+secret, base64
//! of the secret behind 0–2 random bytes, strict percent-encoding, JSON string escaping), planted
//! in filler bytes that no encoding can overlap (all ≥ 0x80). Invariants:
//! - no false negative: decoding what is left of the planted text never yields the secret;
//! - streaming equals whole: pushing the bytes through a `ScrubStream` split at any two points
//!   gives exactly the whole-buffer result and count;
//! - the held tail stays below the longest pattern.
#![no_main]

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use egress_policy::scrub::{ScrubSecret, ScrubStream, Scrubber};
use libfuzzer_sys::fuzz_target;

fn hex(b: &[u8]) -> Vec<u8> {
    b.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
        .into_bytes()
}

fn unhex(t: &[u8]) -> Vec<u8> {
    t.chunks(2)
        .filter_map(|c| u8::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
        .collect()
}

fn percent(b: &[u8]) -> Vec<u8> {
    let mut s = String::new();
    for &c in b {
        if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
            s.push(c as char);
        } else {
            s.push_str(&format!("%{c:02X}"));
        }
    }
    s.into_bytes()
}

fn unpercent(t: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        if t[i] == b'%' && i + 2 < t.len() + 1 && i + 3 <= t.len() {
            if let Some(b) = std::str::from_utf8(&t[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(t[i]);
        i += 1;
    }
    out
}

fn json(b: &[u8]) -> Vec<u8> {
    let mut s = Vec::new();
    for &c in b {
        match c {
            b'"' => s.extend_from_slice(b"\\\""),
            b'\\' => s.extend_from_slice(b"\\\\"),
            _ => s.push(c),
        }
    }
    s
}

fn unjson(t: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut it = t.iter().copied();
    while let Some(c) = it.next() {
        if c == b'\\' {
            if let Some(n) = it.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Decode a base64 run leniently (either alphabet, padding or not, trailing bits allowed), so a
/// secret that survived anywhere in it shows up.
fn b64_any(t: &[u8]) -> Vec<u8> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    let cfg = GeneralPurposeConfig::new()
        .with_decode_allow_trailing_bits(true)
        .with_decode_padding_mode(DecodePaddingMode::Indifferent);
    let mut clean: Vec<u8> = t.iter().copied().filter(|c| *c != b'=').collect();
    clean.truncate(clean.len() - usize::from(clean.len() % 4 == 1));
    let mut out = Vec::new();
    for alphabet in [&base64::alphabet::STANDARD, &base64::alphabet::URL_SAFE] {
        out.extend(
            GeneralPurpose::new(alphabet, cfg)
                .decode(&clean)
                .unwrap_or_default(),
        );
        out.push(0);
    }
    out
}

fn found_in(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fuzz_target!(|data: &[u8]| {
    let [len, enc, at, cut1, cut2, lead, rest @ ..] = data else {
        return;
    };
    let n = 8 + *len as usize % 33;
    if rest.len() < n {
        return;
    }
    let (sec, body) = rest.split_at(n);
    // Printable ASCII: every encoding above is ASCII, the filler never is.
    let secret: Vec<u8> = sec.iter().map(|b| 0x20 + b % 95).collect();
    let body: Vec<u8> = body.iter().map(|b| b | 0x80).collect();
    let lead_bytes = &b"xyz"[..*lead as usize % 3];
    let which = enc % 7;
    let needle = match which {
        0 => secret.clone(),
        1 => hex(&secret),
        2 => STANDARD
            .encode([&b"Bearer "[..], &secret].concat())
            .into_bytes(),
        3 => URL_SAFE_NO_PAD
            .encode([&b"user:"[..], &secret].concat())
            .into_bytes(),
        4 => STANDARD.encode([lead_bytes, &secret].concat()).into_bytes(),
        5 => percent(&secret),
        _ => json(&secret),
    };
    let at = *at as usize * body.len() / 256;
    let hay = [&body[..at], &needle, &body[at..]].concat();
    let sc = Arc::new(Scrubber::new(&[ScrubSecret {
        secret: secret.clone(),
        replacement: b"ph-0000-fuzz".to_vec(),
        prefix: b"Bearer ".to_vec(),
        basic_user: Some(b"user".to_vec()),
    }]));

    let (whole, found) = sc.scrub(&hay).expect("planted secret not found");
    assert!(found >= 1);
    // What the planted text became: the ASCII run where it was (the filler is never ASCII).
    let run: Vec<u8> = whole[at..]
        .iter()
        .copied()
        .take_while(u8::is_ascii)
        .collect();
    let decoded = match which {
        0 => run.clone(),
        1 => unhex(&run),
        2..=4 => b64_any(&run),
        5 => unpercent(&run),
        _ => unjson(&run),
    };
    assert!(
        !found_in(&decoded, &secret),
        "the secret survived (form {which})"
    );
    assert!(
        !found_in(&run, &needle),
        "the encoded secret survived (form {which})"
    );

    let (i, j) = (
        *cut1 as usize * hay.len() / 256,
        *cut2 as usize * hay.len() / 256,
    );
    let (i, j) = (i.min(j), i.max(j));
    let mut stream = ScrubStream::new(sc.clone());
    let mut out = Vec::new();
    for part in [&hay[..i], &hay[i..j], &hay[j..]] {
        stream.push(part, &mut out);
        assert!(stream.held() < sc.max_pattern_len());
    }
    stream.finish(&mut out);
    assert_eq!(out, whole);
    assert_eq!(stream.found(), found);
});
