//! Response scrubbing: take a secret that a proxy injected into an upstream request back out
//! of the response before it reaches the sandboxed client.
//!
//! The proxy holds the real value (an API key); the sandbox only knows a harmless placeholder
//! (the *replacement*). Whatever the upstream echoes back — in a body, a header value, an SSE
//! stream or WebSocket frames — every occurrence of the secret, in any encoding listed below,
//! is replaced by **the same encoding of the replacement**, so a client that decodes the field
//! sees its own placeholder again.
//!
//! # Covered encodings (per secret, each also computed for the replacement)
//! * raw bytes;
//! * base64, standard and URL-safe alphabets, with and without `=` padding, of the secret alone;
//! * base64 of a *larger* value that contains the secret (`"user:secret"`, `"Bearer secret"`, a
//!   JSON document, ...): the secret then sits at byte offset 0, 1 or 2 modulo 3 of the encoded
//!   value. For each of those three alignments and both alphabets the **core** — the run of
//!   base64 characters whose six bits all come from the secret — is a pattern. The partial
//!   characters at both ends (they mix the secret's bits with the neighbours') are left alone,
//!   so up to 4 bits of the secret survive at each end; the core is replaced by the core of the
//!   replacement computed at the same alignment. If the secret and the replacement differ in
//!   length modulo 3 the base64 text after the core is shifted, i.e. it no longer decodes to the
//!   original neighbours; it stays valid base64 characters.
//! * explicit full base64 forms (both alphabets, padded and not) of `prefix + secret`
//!   ([`ScrubSecret::prefix`], e.g. `Bearer `) and of `user:secret`
//!   ([`ScrubSecret::basic_user`], HTTP Basic); these are replaced exactly by
//!   `base64(prefix + replacement)` / `base64("user:replacement")`;
//! * percent-encoding (upper- and lower-case hex) with the keep-sets of RFC 3986 (unreserved
//!   only), JavaScript `encodeURIComponent` and `encodeURI`, Python `quote` (unreserved and
//!   `/`), `application/x-www-form-urlencoded` (space as `+`; both the Python `quote_plus` and
//!   the WHATWG keep-set);
//! * JSON string escaping: minimal (`"`, `\`, control characters), with or without `\/`,
//!   `ensure_ascii` style (`\uXXXX` for everything from U+007F up, surrogate pairs above the
//!   BMP), Go's HTML-safe style (`\u003c \u003e \u0026 \u2028 \u2029`), short escapes
//!   (`\n`) or `\u000a`, upper- or lower-case hex — every combination;
//! * hex of the secret's bytes, lower and upper case.
//!
//! Forms that coincide are deduplicated (for an alphanumeric secret most do); the first form
//! wins, in the order raw, base64, base64 cores, percent, JSON, hex, then the prefix and Basic
//! forms, and earlier secrets before later ones. So when the percent-encoding of the secret
//! equals the raw secret, the raw replacement is used: a placeholder made of URL- and
//! JSON-safe characters (`[A-Za-z0-9_-]`) is encoded identically everywhere and avoids this.
//! A form equal to its own replacement is skipped. Patterns shorter
//! than [`MIN_PATTERN_LEN`] (4) bytes are **dropped** as too ambiguous: a secret of 1–3 bytes
//! gets no raw pattern (only its longer encodings, if any). Secrets shorter than 8 bytes are
//! accepted and matched like any other, but their short encodings invite false positives.
//! Matching is Aho-Corasick, leftmost-longest, one replacement per pattern.
//!
//! # Not covered
//! * a secret the upstream transforms: hashes, truncates, re-cases, reverses, splits into
//!   several JSON fields or lines, or escapes in any way not listed above (HTML entities,
//!   `\xNN`, quoted-printable, ...);
//! * double encodings (percent-encoded base64, base64 of base64, JSON-escaped percent-encoding,
//!   a base64 core inside a JSON string with `\/` escapes, ...);
//! * compressed bodies: decompression (or refusing `Content-Encoding`) happens outside this
//!   module; the scrubber only ever sees identity-encoded bytes;
//! * WebSocket: compressed frames (`permessage-deflate`, RSV bits) are refused, not scrubbed;
//!   a secret split across two *messages* (not fragments) is not found (see [`WsScrub`]);
//! * patterns shorter than 4 bytes (see above).
//!
//! # Streaming
//! [`ScrubStream`] produces exactly the bytes [`Scrubber::scrub`] produces on the concatenated
//! input, for any split. It only holds back the shortest tail that may still be the start of a
//! pattern (never more than `max_pattern_len() - 1` bytes), so chunks that do not end in a
//! pattern prefix — e.g. an SSE event `data: x\n\n` — are released at once.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, Input, MatchKind};
use base64::Engine as _;
use base64::engine::GeneralPurpose;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};

/// Patterns shorter than this are not matched (too ambiguous).
pub const MIN_PATTERN_LEN: usize = 4;
/// Used when [`ScrubSecret::replacement`] is empty.
pub const DEFAULT_REPLACEMENT: &[u8] = b"[scrubbed]";
/// Padding byte for same-length replacement (WebSocket frames).
pub const SAME_LEN_PAD: u8 = b'*';

/// One secret to scrub, with the placeholder that replaces it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ScrubSecret {
    /// The real value.
    pub secret: Vec<u8>,
    /// The placeholder the sandbox holds; empty means [`DEFAULT_REPLACEMENT`].
    pub replacement: Vec<u8>,
    /// Injected before the secret in the header value (e.g. `b"Bearer "`); may be empty.
    pub prefix: Vec<u8>,
    /// `Some(user)` when the secret is injected as the password of HTTP Basic.
    pub basic_user: Option<Vec<u8>>,
}

impl fmt::Debug for ScrubSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScrubSecret")
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .field("replacement", &String::from_utf8_lossy(&self.replacement))
            .field("prefix", &String::from_utf8_lossy(&self.prefix))
            .field(
                "basic_user",
                &self.basic_user.as_ref().map(|u| String::from_utf8_lossy(u)),
            )
            .finish()
    }
}

/// The compiled set of patterns of one policy. Immutable, `Send + Sync`.
pub struct Scrubber {
    ac: Option<AhoCorasick>,
    /// The same patterns in a SIMD searcher (Teddy), for the common question "is any of them in
    /// here at all?": several times faster than the automaton on text without a match. `None`
    /// when the CPU or the pattern set doesn't suit it (the automaton answers then).
    packed: Option<aho_corasick::packed::Searcher>,
    /// Sorted and deduplicated; the index is the Aho-Corasick pattern id.
    patterns: Vec<Vec<u8>>,
    replacements: Vec<Vec<u8>>,
    first_bytes: [bool; 256],
    max_len: usize,
}

impl fmt::Debug for Scrubber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scrubber")
            .field("patterns", &self.patterns.len())
            .field("max_pattern_len", &self.max_len)
            .finish()
    }
}

const B64_ENGINES: [&GeneralPurpose; 4] =
    [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD];

fn is_alnum(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

/// Percent-encoding styles: (extra bytes kept besides ASCII alphanumerics, space as `+`).
const PCT_STYLES: [(&[u8], bool); 6] = [
    (b"-._~", false),                 // RFC 3986 unreserved
    (b"-_.!~*'()", false),            // JavaScript encodeURIComponent
    (b"-_.!~*'();/?:@&=+$,#", false), // JavaScript encodeURI
    (b"-._~/", false),                // Python urllib.parse.quote (safe='/')
    (b"-._~", true),                  // Python quote_plus / urlencode
    (b"*-._", true),                  // WHATWG application/x-www-form-urlencoded
];

fn percent(v: &[u8], keep: &[u8], plus: bool, upper: bool) -> Vec<u8> {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    let mut o = Vec::with_capacity(v.len() * 3);
    for &b in v {
        if is_alnum(b) || keep.contains(&b) {
            o.push(b);
        } else if plus && b == b' ' {
            o.push(b'+');
        } else {
            o.extend_from_slice(&[b'%', digits[(b >> 4) as usize], digits[(b & 15) as usize]]);
        }
    }
    o
}

fn hex(v: &[u8], upper: bool) -> Vec<u8> {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    v.iter()
        .flat_map(|&b| [digits[(b >> 4) as usize], digits[(b & 15) as usize]])
        .collect()
}

/// JSON string escaping; `style` bits: 1 = `\/`, 2 = ensure_ascii, 4 = HTML-safe (Go),
/// 8 = upper-case hex, 16 = no short escapes (`\u000a` instead of `\n`).
fn json(v: &[u8], style: u8) -> Vec<u8> {
    let (slash, ascii, html, upper, long) = (
        style & 1 != 0,
        style & 2 != 0,
        style & 4 != 0,
        style & 8 != 0,
        style & 16 != 0,
    );
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    let mut o = Vec::with_capacity(v.len() + 8);
    let u = |o: &mut Vec<u8>, c: u16| {
        o.extend_from_slice(b"\\u");
        for shift in [12, 8, 4, 0] {
            o.push(digits[((c >> shift) & 15) as usize]);
        }
    };
    for chunk in v.utf8_chunks() {
        for ch in chunk.valid().chars() {
            let c = ch as u32;
            match ch {
                '"' => o.extend_from_slice(b"\\\""),
                '\\' => o.extend_from_slice(b"\\\\"),
                '/' if slash => o.extend_from_slice(b"\\/"),
                '\u{8}' if !long => o.extend_from_slice(b"\\b"),
                '\u{c}' if !long => o.extend_from_slice(b"\\f"),
                '\n' if !long => o.extend_from_slice(b"\\n"),
                '\r' if !long => o.extend_from_slice(b"\\r"),
                '\t' if !long => o.extend_from_slice(b"\\t"),
                '<' | '>' | '&' | '\u{2028}' | '\u{2029}' if html => u(&mut o, c as u16),
                _ if c < 0x20 => u(&mut o, c as u16),
                _ if ascii && c >= 0x7f => {
                    let mut buf = [0u16; 2];
                    for unit in ch.encode_utf16(&mut buf) {
                        u(&mut o, *unit);
                    }
                }
                _ => {
                    let mut buf = [0u8; 4];
                    o.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        if !chunk.invalid().is_empty() {
            if ascii {
                u(&mut o, 0xfffd); // what ensure_ascii encoders emit for undecodable input
            } else {
                o.extend_from_slice(chunk.invalid());
            }
        }
    }
    o
}

/// The base64 characters fully determined by `v` when it starts at byte offset `align`
/// (0..3) of the encoded value.
fn b64_core(v: &[u8], align: usize, url: bool) -> Vec<u8> {
    let mut buf = vec![0u8; align];
    buf.extend_from_slice(v);
    let engine = if url {
        &URL_SAFE_NO_PAD
    } else {
        &STANDARD_NO_PAD
    };
    let enc = engine.encode(&buf);
    let start = (8 * align).div_ceil(6);
    let end = 8 * buf.len() / 6;
    enc.as_bytes().get(start..end).unwrap_or_default().to_vec()
}

/// Every encoding of one value, in a fixed order so that the forms of a secret and of its
/// replacement line up index by index.
fn encodings(v: &[u8]) -> Vec<Vec<u8>> {
    let mut f = Vec::with_capacity(64);
    f.push(v.to_vec());
    for e in B64_ENGINES {
        f.push(e.encode(v).into_bytes());
    }
    for url in [false, true] {
        for align in 0..3 {
            f.push(b64_core(v, align, url));
        }
    }
    for (keep, plus) in PCT_STYLES {
        for upper in [true, false] {
            f.push(percent(v, keep, plus, upper));
        }
    }
    for style in 0..32 {
        f.push(json(v, style));
    }
    f.push(hex(v, false));
    f.push(hex(v, true));
    f
}

fn full_b64(v: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    B64_ENGINES
        .into_iter()
        .map(move |e| e.encode(v).into_bytes())
}

/// Appends `rep` cut or padded with [`SAME_LEN_PAD`] to exactly `n` bytes (cut on a UTF-8
/// character boundary when `rep` is UTF-8).
fn push_same_len(rep: &[u8], n: usize, out: &mut Vec<u8>) {
    let mut k = rep.len().min(n);
    if let Ok(s) = std::str::from_utf8(rep) {
        while !s.is_char_boundary(k) {
            k -= 1;
        }
    }
    out.extend_from_slice(&rep[..k]);
    out.resize(out.len() + (n - k), SAME_LEN_PAD);
}

impl Scrubber {
    pub fn new(secrets: &[ScrubSecret]) -> Scrubber {
        let mut seen: HashSet<Vec<u8>> = HashSet::new();
        let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut add = |p: Vec<u8>, r: Vec<u8>| {
            if p.len() >= MIN_PATTERN_LEN && p != r && !seen.contains(&p) {
                seen.insert(p.clone());
                pairs.push((p, r));
            }
        };
        for s in secrets {
            if s.secret.is_empty() {
                continue;
            }
            let rep: &[u8] = if s.replacement.is_empty() {
                DEFAULT_REPLACEMENT
            } else {
                &s.replacement
            };
            for (p, r) in encodings(&s.secret).into_iter().zip(encodings(rep)) {
                add(p, r);
            }
            if !s.prefix.is_empty() {
                let p = [&s.prefix[..], &s.secret].concat();
                let r = [&s.prefix[..], rep].concat();
                for (p, r) in full_b64(&p).zip(full_b64(&r)) {
                    add(p, r);
                }
            }
            if let Some(user) = &s.basic_user {
                let p = [&user[..], b":", &s.secret].concat();
                let r = [&user[..], b":", rep].concat();
                for (p, r) in full_b64(&p).zip(full_b64(&r)) {
                    add(p, r);
                }
            }
        }
        pairs.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let (patterns, replacements): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
        let mut first_bytes = [false; 256];
        for p in &patterns {
            first_bytes[p[0] as usize] = true;
        }
        let max_len = patterns.iter().map(Vec::len).max().unwrap_or(0);
        let ac = (!patterns.is_empty()).then(|| {
            // A DFA without a prefilter: the encoded forms start with common letters and digits,
            // so a rare-byte prefilter fires on ordinary text (JSON, base64) and restarts the
            // search far more often than a straight scan costs (measured: proxy-bench
            // --intercept, `docs/benchmarks.md`).
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .kind(Some(aho_corasick::AhoCorasickKind::DFA))
                .prefilter(false)
                .build(&patterns)
                .expect("scrub patterns are few and short")
        });
        let packed = aho_corasick::packed::Config::new()
            .match_kind(aho_corasick::packed::MatchKind::LeftmostFirst)
            .builder()
            .extend(&patterns)
            .build();
        Scrubber {
            ac,
            packed,
            patterns,
            replacements,
            first_bytes,
            max_len,
        }
    }

    /// No patterns at all (no secrets, or all too short): scrubbing is the identity.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Number of distinct patterns.
    pub fn pattern_count(&self) -> usize {
        self.patterns.len()
    }

    pub fn max_pattern_len(&self) -> usize {
        self.max_len
    }

    pub fn contains(&self, haystack: &[u8]) -> bool {
        match (&self.packed, &self.ac) {
            (Some(p), _) => p.find(haystack).is_some(),
            (None, Some(ac)) => ac.is_match(haystack),
            (None, None) => false,
        }
    }

    /// Whole-buffer scrub: `None` when nothing was found, else the scrubbed bytes and the
    /// number of replacements.
    pub fn scrub(&self, haystack: &[u8]) -> Option<(Vec<u8>, usize)> {
        self.scrub_mode(haystack, false)
    }

    /// Like [`Scrubber::scrub`], but every match is replaced by exactly as many bytes
    /// (the replacement cut, or padded with `*`).
    pub fn scrub_same_len(&self, haystack: &[u8]) -> Option<(Vec<u8>, usize)> {
        self.scrub_mode(haystack, true)
    }

    fn scrub_mode(&self, haystack: &[u8], same_len: bool) -> Option<(Vec<u8>, usize)> {
        if !self.contains(haystack) {
            return None;
        }
        let mut out = Vec::with_capacity(haystack.len());
        let n = self.scrub_into(haystack, &mut out, same_len);
        Some((out, n))
    }

    fn push_replacement(&self, id: usize, matched: usize, same_len: bool, out: &mut Vec<u8>) {
        let rep = &self.replacements[id];
        if same_len {
            push_same_len(rep, matched, out);
        } else {
            out.extend_from_slice(rep);
        }
    }

    /// Scrubs all of `hay` into `out`; returns the number of replacements.
    fn scrub_into(&self, hay: &[u8], out: &mut Vec<u8>, same_len: bool) -> usize {
        let Some(ac) = &self.ac else {
            out.extend_from_slice(hay);
            return 0;
        };
        let mut last = 0;
        let mut n = 0;
        for m in ac.find_iter(hay) {
            out.extend_from_slice(&hay[last..m.start()]);
            self.push_replacement(m.pattern().as_usize(), m.len(), same_len, out);
            last = m.end();
            n += 1;
        }
        out.extend_from_slice(&hay[last..]);
        n
    }

    /// Is `s` a proper prefix of some pattern?
    fn is_proper_prefix(&self, s: &[u8]) -> bool {
        let i = self.patterns.partition_point(|p| p.as_slice() < s);
        // Patterns starting with `s` are contiguous from `i`; at most one equals `s`.
        self.patterns[i..]
            .iter()
            .take(2)
            .any(|p| p.len() > s.len() && p.starts_with(s))
    }

    /// The smallest position `>= from` whose suffix of `buf` is a proper prefix of a pattern
    /// (`buf.len()` if none).
    fn hold_start(&self, buf: &[u8], from: usize) -> usize {
        let lo = from.max(buf.len().saturating_sub(self.max_len.saturating_sub(1)));
        (lo..buf.len())
            .find(|&i| self.first_bytes[buf[i] as usize] && self.is_proper_prefix(&buf[i..]))
            .unwrap_or(buf.len())
    }

    /// Emits the scrubbed part of `buf` that no later input can change; returns how much of
    /// `buf` was consumed (the rest must be held).
    ///
    /// Every match that is not entirely inside `buf` starts at or after `hold_start`, so the
    /// leftmost-longest choices made for matches starting before it are final.
    fn release(&self, buf: &[u8], out: &mut Vec<u8>, same_len: bool, found: &mut usize) -> usize {
        let Some(ac) = &self.ac else {
            out.extend_from_slice(buf);
            return buf.len();
        };
        let mut cursor = 0;
        let mut hold = self.hold_start(buf, 0);
        if !self.contains(buf) {
            // No match anywhere in `buf` (the usual case): no automaton walk. (Not `buf[..hold]`:
            // a match may start before `hold` and end after it.)
            out.extend_from_slice(&buf[..hold]);
            return hold;
        }
        loop {
            if hold < cursor {
                hold = self.hold_start(buf, cursor);
            }
            match ac.find(Input::new(buf).span(cursor..buf.len())) {
                Some(m) if m.start() < hold => {
                    out.extend_from_slice(&buf[cursor..m.start()]);
                    self.push_replacement(m.pattern().as_usize(), m.len(), same_len, out);
                    *found += 1;
                    cursor = m.end();
                }
                _ => {
                    out.extend_from_slice(&buf[cursor..hold]);
                    return hold;
                }
            }
        }
    }
}

/// Streaming state shared by [`ScrubStream`] and [`WsScrub`].
#[derive(Default)]
struct Core {
    pending: Vec<u8>,
    found: usize,
}

impl Core {
    fn push(&mut self, sc: &Scrubber, input: &[u8], out: &mut Vec<u8>, same_len: bool) {
        if self.pending.is_empty() {
            let used = sc.release(input, out, same_len, &mut self.found);
            self.pending.extend_from_slice(&input[used..]);
        } else {
            self.pending.extend_from_slice(input);
            let used = sc.release(&self.pending, out, same_len, &mut self.found);
            self.pending.drain(..used);
        }
    }

    fn finish(&mut self, sc: &Scrubber, out: &mut Vec<u8>, same_len: bool) {
        self.found += sc.scrub_into(&self.pending, out, same_len);
        self.pending.clear();
    }
}

/// Scrubs one response body delivered in chunks.
pub struct ScrubStream {
    scrubber: Arc<Scrubber>,
    core: Core,
}

impl ScrubStream {
    pub fn new(scrubber: Arc<Scrubber>) -> Self {
        ScrubStream {
            scrubber,
            core: Core::default(),
        }
    }

    /// Appends to `out` everything that can be released now; holds back only the shortest
    /// tail that could still be the start of a pattern.
    pub fn push(&mut self, input: &[u8], out: &mut Vec<u8>) {
        self.core.push(&self.scrubber, input, out, false);
    }

    /// End of stream: flushes the held tail (scrubbed).
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        self.core.finish(&self.scrubber, out, false);
    }

    /// Replacements so far.
    pub fn found(&self) -> usize {
        self.core.found
    }

    /// Bytes currently held back (always `< max_pattern_len()`).
    pub fn held(&self) -> usize {
        self.core.pending.len()
    }
}

/// A server→client WebSocket stream that cannot be scrubbed safely.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WsError {
    /// A server frame with the MASK bit (RFC 6455 §5.1 forbids it).
    MaskedServerFrame,
    /// RSV1-3 set: an extension such as permessage-deflate is in use; refuse rather than pass
    /// compressed payloads through unscrubbed.
    ReservedBits,
    /// Opcode 3-7 or 0xB-0xF.
    ReservedOpcode(u8),
    /// A control frame that is fragmented or longer than 125 bytes.
    BadControlFrame,
    /// A 64-bit payload length with the most significant bit set.
    LengthOverflow,
}

impl fmt::Display for WsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WsError::MaskedServerFrame => f.write_str("masked WebSocket frame from the server"),
            WsError::ReservedBits => {
                f.write_str("WebSocket frame with RSV bits set (compression extension?)")
            }
            WsError::ReservedOpcode(op) => {
                write!(f, "WebSocket frame with reserved opcode {op:#x}")
            }
            WsError::BadControlFrame => {
                f.write_str("fragmented or oversized WebSocket control frame")
            }
            WsError::LengthOverflow => f.write_str("WebSocket payload length overflow"),
        }
    }
}

impl std::error::Error for WsError {}

struct Frame {
    fin: bool,
    remaining: u64,
    /// Payload of a control frame being collected (`None` for data frames).
    control: Option<Vec<u8>>,
}

enum Queued {
    Bytes(Vec<u8>),
    /// This many data-payload bytes, to be taken from the scrubbed data stream.
    Data(u64),
}

/// Scrubs the server→client direction of a WebSocket connection (the bytes after the 101
/// response), frame by frame, without changing any frame's length.
///
/// * The payloads of the data frames of one message (text/binary frame plus continuation
///   frames) are scrubbed as one stream, so a secret split across fragments is found. The
///   stream ends with the FIN frame: a secret split across two *messages* is not found — the
///   alternative would delay a message that ends in a pattern prefix until the next message,
///   possibly forever.
/// * Replacement is same-length: the replacement cut, or padded with `*`, to the length of the
///   match (cut on a UTF-8 boundary, so a text frame stays valid UTF-8 when the replacement
///   is). Frame headers are therefore passed through unchanged.
/// * Headers and payload bytes are forwarded as soon as they are final. Only payload bytes
///   that could start a pattern are held (at most `max_pattern_len() - 1`), and everything
///   behind them — the rest of the frame, later frames including control frames — waits in
///   order until the ambiguity is resolved by more payload or by the FIN frame's end.
/// * Control frames (ping/pong/close, at most 125 bytes) are collected whole and scrubbed
///   on their own, same-length.
/// * Masked frames, RSV bits and reserved opcodes are errors; after an error the connection
///   must be dropped (every later push returns the same error).
pub struct WsScrub {
    scrubber: Arc<Scrubber>,
    core: Core,
    header: Vec<u8>,
    frame: Option<Frame>,
    queue: VecDeque<Queued>,
    /// Scrubbed data-payload bytes not yet written (they belong to `Queued::Data` items).
    data: Vec<u8>,
    failed: Option<WsError>,
}

impl WsScrub {
    pub fn new(scrubber: Arc<Scrubber>) -> Self {
        WsScrub {
            scrubber,
            core: Core::default(),
            header: Vec::with_capacity(14),
            frame: None,
            queue: VecDeque::new(),
            data: Vec::new(),
            failed: None,
        }
    }

    pub fn push(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), WsError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.push_inner(input);
        self.drain(out);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    /// End of the connection: flushes everything held (a truncated last frame as far as it
    /// came).
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        self.core.finish(&self.scrubber, &mut self.data, true);
        if let Some(Frame {
            control: Some(buf), ..
        }) = self.frame.take()
        {
            self.core.found += self.scrubber.scrub_into(&buf, &mut self.data, true);
            self.queue.push_back(Queued::Data(buf.len() as u64));
        }
        self.drain(out);
        // Whatever is left waits for payload bytes that never came.
        for q in self.queue.drain(..) {
            if let Queued::Bytes(b) = q {
                out.extend_from_slice(&b);
            }
        }
        out.append(&mut self.data);
        out.append(&mut self.header);
    }

    /// Replacements so far.
    pub fn found(&self) -> usize {
        self.core.found
    }

    /// Bytes received but not yet written out.
    pub fn held(&self) -> usize {
        let queued: usize = self
            .queue
            .iter()
            .map(|q| match q {
                Queued::Bytes(b) => b.len(),
                Queued::Data(_) => 0,
            })
            .sum();
        let control = match &self.frame {
            Some(Frame {
                control: Some(b), ..
            }) => b.len(),
            _ => 0,
        };
        self.core.pending.len() + self.header.len() + queued + control + self.data.len()
    }

    fn push_inner(&mut self, mut input: &[u8]) -> Result<(), WsError> {
        while !input.is_empty() || self.frame.as_ref().is_some_and(|f| f.remaining == 0) {
            let Some(frame) = &mut self.frame else {
                self.header.push(input[0]);
                input = &input[1..];
                if let Some(f) = parse_header(&self.header)? {
                    self.queue
                        .push_back(Queued::Bytes(std::mem::take(&mut self.header)));
                    if f.control.is_none() {
                        self.queue.push_back(Queued::Data(f.remaining));
                    }
                    self.frame = Some(f);
                }
                continue;
            };
            let n = frame.remaining.min(input.len() as u64) as usize;
            let (chunk, rest) = input.split_at(n);
            input = rest;
            frame.remaining -= n as u64;
            match &mut frame.control {
                Some(buf) => buf.extend_from_slice(chunk),
                None => self.core.push(&self.scrubber, chunk, &mut self.data, true),
            }
            if frame.remaining == 0 {
                let frame = self.frame.take().expect("frame in progress");
                match frame.control {
                    Some(buf) => {
                        let mut o = Vec::with_capacity(buf.len());
                        self.core.found += self.scrubber.scrub_into(&buf, &mut o, true);
                        self.queue.push_back(Queued::Bytes(o));
                    }
                    None if frame.fin => self.core.finish(&self.scrubber, &mut self.data, true),
                    None => {}
                }
            }
        }
        Ok(())
    }

    fn drain(&mut self, out: &mut Vec<u8>) {
        let mut used = 0;
        while let Some(front) = self.queue.front_mut() {
            match front {
                Queued::Bytes(b) => out.extend_from_slice(b),
                Queued::Data(n) => {
                    let k = (*n).min((self.data.len() - used) as u64) as usize;
                    out.extend_from_slice(&self.data[used..used + k]);
                    used += k;
                    *n -= k as u64;
                    if *n > 0 {
                        break;
                    }
                }
            }
            self.queue.pop_front();
        }
        self.data.drain(..used);
    }
}

/// Parses a complete frame header, `Ok(None)` if more bytes are needed.
fn parse_header(h: &[u8]) -> Result<Option<Frame>, WsError> {
    let [b0, b1, ..] = *h else {
        return Ok(None);
    };
    if b0 & 0x70 != 0 {
        return Err(WsError::ReservedBits);
    }
    if b1 & 0x80 != 0 {
        return Err(WsError::MaskedServerFrame);
    }
    let fin = b0 & 0x80 != 0;
    let opcode = b0 & 0x0f;
    let control = match opcode {
        0..=2 => false,
        8..=10 => true,
        op => return Err(WsError::ReservedOpcode(op)),
    };
    let len7 = b1 & 0x7f;
    if control && (!fin || len7 > 125) {
        return Err(WsError::BadControlFrame);
    }
    let need = match len7 {
        126 => 4,
        127 => 10,
        _ => 2,
    };
    if h.len() < need {
        return Ok(None);
    }
    let len = match len7 {
        126 => u16::from_be_bytes([h[2], h[3]]) as u64,
        127 => {
            let l = u64::from_be_bytes(h[2..10].try_into().expect("8 bytes"));
            if l >> 63 != 0 {
                return Err(WsError::LengthOverflow);
            }
            l
        }
        l => l as u64,
    };
    Ok(Some(Frame {
        fin,
        remaining: len,
        control: control.then(|| Vec::with_capacity(len as usize)),
    }))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    /// splitmix64: deterministic, no dev-dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn range(&mut self, lo: usize, hi: usize) -> usize {
            lo + self.below(hi - lo)
        }
        fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
            &xs[self.below(xs.len())]
        }
    }

    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    const SYMBOLS: &[u8] = b"+/=&\"<>'\\~!*()_.-% ?#:;@,$[]{}|^`";
    const NON_ASCII: [&str; 9] = [
        "\u{e9}",
        "\u{df}",
        "\u{6f22}",
        "\u{5b57}",
        "\u{1f600}",
        "\u{f1}",
        "\u{2028}",
        "\u{20ac}",
        "\u{7f}",
    ];

    /// class 0: alphanumeric; 1: with ASCII symbols; 2: also non-ASCII and control chars.
    fn secret(rng: &mut Rng, class: usize, len: usize) -> Vec<u8> {
        let mut s = Vec::new();
        while s.len() < len {
            let piece: Vec<u8> = match (class, rng.below(10)) {
                (1.., 0..=2) => vec![*rng.pick(SYMBOLS)],
                (2, 3) => rng.pick(&NON_ASCII).as_bytes().to_vec(),
                (2, 4) if rng.below(4) == 0 => vec![*rng.pick(b"\n\t\r\x01\x08\x0c")],
                _ => vec![*rng.pick(ALNUM)],
            };
            if s.len() + piece.len() <= len {
                s.extend(piece);
            }
        }
        s
    }

    fn placeholder(rng: &mut Rng) -> Vec<u8> {
        if rng.below(5) == 0 {
            return Vec::new(); // default replacement
        }
        let len = rng.range(4, 30);
        (0..len)
            .map(|_| *rng.pick(b"abcdefXYZ0123456789-_"))
            .collect()
    }

    /// Random surrounding text: printable, sometimes arbitrary bytes.
    fn filler(rng: &mut Rng, max: usize) -> Vec<u8> {
        let n = rng.below(max + 1);
        let binary = rng.below(4) == 0;
        (0..n)
            .map(|_| {
                if binary {
                    rng.next() as u8
                } else {
                    rng.range(0x20, 0x7f) as u8
                }
            })
            .collect()
    }

    // ---- reference encoders, written independently of the implementation ----

    fn ref_pct(s: &[u8], safe: &str, plus: bool, upper: bool) -> Vec<u8> {
        let mut o = String::new();
        for &b in s {
            if b.is_ascii_alphanumeric() || (b.is_ascii() && safe.contains(b as char)) {
                o.push(b as char);
            } else if plus && b == b' ' {
                o.push('+');
            } else if upper {
                o += &format!("%{b:02X}");
            } else {
                o += &format!("%{b:02x}");
            }
        }
        o.into_bytes()
    }

    const REF_PCT: [(&str, bool); 6] = [
        ("-._~", false),
        ("-_.!~*'()", false),
        ("-_.!~*'();/?:@&=+$,#", false),
        ("-._~/", false),
        ("-._~", true),
        ("*-._", true),
    ];

    fn ref_json(s: &[u8], style: u8) -> Vec<u8> {
        let s = std::str::from_utf8(s).expect("test secrets are UTF-8");
        let (slash, ascii, html, upper, long) = (
            style & 1 != 0,
            style & 2 != 0,
            style & 4 != 0,
            style & 8 != 0,
            style & 16 != 0,
        );
        let esc = |u: u32| {
            if upper {
                format!("\\u{u:04X}")
            } else {
                format!("\\u{u:04x}")
            }
        };
        let mut o = String::new();
        for c in s.chars() {
            let shortform = match c {
                '\n' => Some("\\n"),
                '\r' => Some("\\r"),
                '\t' => Some("\\t"),
                '\u{8}' => Some("\\b"),
                '\u{c}' => Some("\\f"),
                _ => None,
            };
            if c == '"' {
                o += "\\\"";
            } else if c == '\\' {
                o += "\\\\";
            } else if c == '/' && slash {
                o += "\\/";
            } else if let (Some(sf), false) = (shortform, long) {
                o += sf;
            } else if (c as u32) < 0x20 || (html && "<>&\u{2028}\u{2029}".contains(c)) {
                o += &esc(c as u32);
            } else if ascii && c as u32 >= 0x7f {
                for unit in c.encode_utf16(&mut [0; 2]) {
                    o += &esc(*unit as u32);
                }
            } else {
                o.push(c);
            }
        }
        o.into_bytes()
    }

    fn ref_hex(s: &[u8], upper: bool) -> Vec<u8> {
        s.iter()
            .map(|b| {
                if upper {
                    format!("{b:02X}")
                } else {
                    format!("{b:02x}")
                }
            })
            .collect::<String>()
            .into_bytes()
    }

    #[derive(Clone, Copy, Debug)]
    enum Enc {
        Raw,
        B64(usize),
        /// base64 (url alphabet?, padded?) of a JSON document with the secret at offset ≡ k mod 3
        B64Doc {
            url: bool,
            pad: bool,
            align: usize,
        },
        Bearer(usize),
        Basic(usize),
        Pct(usize, bool),
        Json(u8),
        Hex(bool),
    }

    fn all_encs() -> Vec<Enc> {
        let mut v = vec![Enc::Raw, Enc::Hex(false), Enc::Hex(true)];
        for e in 0..4 {
            v.extend([Enc::B64(e), Enc::Bearer(e), Enc::Basic(e)]);
        }
        for url in [false, true] {
            for pad in [false, true] {
                for align in 0..3 {
                    v.push(Enc::B64Doc { url, pad, align });
                }
            }
        }
        for style in 0..REF_PCT.len() {
            v.extend([Enc::Pct(style, false), Enc::Pct(style, true)]);
        }
        v.extend((0..32).map(Enc::Json));
        v
    }

    const USER: &[u8] = b"alice";
    const PREFIX: &[u8] = b"Bearer ";

    fn spec(secret: &[u8], rep: &[u8]) -> ScrubSecret {
        ScrubSecret {
            secret: secret.to_vec(),
            replacement: rep.to_vec(),
            prefix: PREFIX.to_vec(),
            basic_user: Some(USER.to_vec()),
        }
    }

    /// (encoded piece, bytes that must not survive, exact expected replacement if known)
    fn encode(
        rng: &mut Rng,
        enc: Enc,
        s: &[u8],
        rep: &[u8],
    ) -> (Vec<u8>, Vec<u8>, Option<Vec<u8>>) {
        let rep = if rep.is_empty() { None } else { Some(rep) };
        let full = |v: &[u8], r: Option<&[u8]>, f: &dyn Fn(&[u8]) -> Vec<u8>| {
            let p = f(v);
            (p.clone(), p, r.map(f))
        };
        let cat = |a: &[u8], b: &[u8]| [a, b].concat();
        match enc {
            Enc::Raw => full(s, rep, &|v| v.to_vec()),
            Enc::Hex(upper) => full(s, rep, &|v| ref_hex(v, upper)),
            Enc::B64(e) => full(s, rep, &|v| B64_ENGINES[e].encode(v).into_bytes()),
            Enc::Bearer(e) => full(s, rep, &|v| {
                B64_ENGINES[e].encode(cat(PREFIX, v)).into_bytes()
            }),
            Enc::Basic(e) => full(s, rep, &|v| {
                B64_ENGINES[e].encode(cat(b"alice:", v)).into_bytes()
            }),
            Enc::Pct(style, upper) => {
                let (safe, plus) = REF_PCT[style];
                full(s, rep, &|v| ref_pct(v, safe, plus, upper))
            }
            Enc::Json(style) => full(s, rep, &|v| ref_json(v, style)),
            Enc::B64Doc { url, pad, align } => {
                let mut doc = b"{\"id\":17,\"note\":\"".to_vec();
                doc.extend(std::iter::repeat_n(b'x', rng.below(6)));
                while doc.len() % 3 != align {
                    doc.push(b'y');
                }
                doc.extend_from_slice(b"\",\"key\":\"");
                while doc.len() % 3 != align {
                    doc.insert(0, b' ');
                }
                let a = doc.len();
                doc.extend_from_slice(s);
                doc.extend_from_slice(b"\"}");
                let engine = B64_ENGINES[usize::from(url) * 2 + usize::from(!pad)];
                let piece = engine.encode(&doc).into_bytes();
                let needle = piece[(8 * a).div_ceil(6)..8 * (a + s.len()) / 6].to_vec();
                (piece, needle, None)
            }
        }
    }

    fn find(h: &[u8], n: &[u8]) -> bool {
        n.is_empty() || h.windows(n.len()).any(|w| w == n)
    }

    fn stream_all(sc: &Arc<Scrubber>, chunks: &[&[u8]]) -> (Vec<u8>, usize) {
        let mut st = ScrubStream::new(sc.clone());
        let mut out = Vec::new();
        for c in chunks {
            st.push(c, &mut out);
            assert!(
                st.held() < sc.max_pattern_len().max(1),
                "held {}",
                st.held()
            );
        }
        st.finish(&mut out);
        assert_eq!(st.held(), 0);
        (out, st.found())
    }

    fn whole(sc: &Scrubber, h: &[u8]) -> (Vec<u8>, usize) {
        sc.scrub(h).unwrap_or_else(|| (h.to_vec(), 0))
    }

    fn split_at_points<'a>(h: &'a [u8], points: &[usize]) -> Vec<&'a [u8]> {
        let mut pts: Vec<usize> = points.iter().map(|&p| p.min(h.len())).collect();
        pts.sort_unstable();
        let mut v = Vec::new();
        let mut last = 0;
        for p in pts {
            v.push(&h[last..p]);
            last = p;
        }
        v.push(&h[last..]);
        v
    }

    #[test]
    fn every_encoding_found_and_replaced() {
        let mut rng = Rng(1);
        for class in 0..3 {
            for round in 0..4 {
                let s = secret(&mut rng, class, 8 + 8 * round);
                let rep = placeholder(&mut rng);
                let sc = Scrubber::new(&[spec(&s, &rep)]);
                for enc in all_encs() {
                    let (piece, needle, expect) = encode(&mut rng, enc, &s, &rep);
                    let hay = [
                        filler(&mut rng, 40),
                        b"<".to_vec(),
                        piece,
                        b">".to_vec(),
                        filler(&mut rng, 40),
                    ]
                    .concat();
                    let ctx = format!(
                        "class {class} enc {enc:?} secret {:?}",
                        String::from_utf8_lossy(&s)
                    );
                    assert!(sc.contains(&hay), "{ctx}");
                    let (out, n) = sc.scrub(&hay).unwrap_or_else(|| panic!("not found: {ctx}"));
                    assert!(n >= 1);
                    assert!(
                        !find(&out, &needle),
                        "{ctx}: {:?}",
                        String::from_utf8_lossy(&out)
                    );
                    assert!(!find(&out, &s), "{ctx}");
                    if let Some(e) = expect {
                        assert!(
                            find(&out, &e),
                            "{ctx}: expected {:?} in {:?}",
                            String::from_utf8_lossy(&e),
                            String::from_utf8_lossy(&out)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn b64_prefix_basic_and_json_doc_at_each_offset() {
        let s = b"sk-live-0123456789abcdefXYZ".to_vec(); // 27 bytes
        let rep = b"PLACEHOLDER-00000000000000X".to_vec(); // same length: output decodes cleanly
        assert_eq!(s.len(), rep.len());
        let sc = Scrubber::new(&[spec(&s, &rep)]);
        for e in B64_ENGINES {
            for (input, expected) in [
                (b"Bearer ".to_vec(), b"Bearer ".to_vec()),
                (b"alice:".to_vec(), b"alice:".to_vec()),
            ] {
                let hay = e.encode([&input[..], &s].concat());
                let (out, n) = sc.scrub(hay.as_bytes()).expect("found");
                assert_eq!(n, 1);
                assert_eq!(out, e.encode([&expected[..], &rep].concat()).into_bytes());
            }
        }
        for lead in 0..3 {
            let doc = [
                &b"{\"user\":\"bob\",\"token\":\""[..],
                &b"xx"[..lead],
                &s,
                b"\",\"ok\":true}",
            ]
            .concat();
            let at = 23 + lead;
            for e in [&STANDARD, &URL_SAFE] {
                let enc = e.encode(&doc);
                let (out, n) = sc.scrub(enc.as_bytes()).expect("found");
                assert_eq!(n, 1, "lead {lead}");
                assert_eq!(out.len(), enc.len());
                let dec = e.decode(&out).expect("still valid base64");
                assert_eq!(dec.len(), doc.len());
                assert_eq!(dec[..at], doc[..at], "context before intact");
                assert_eq!(
                    dec[at + s.len()..],
                    doc[at + s.len()..],
                    "context after intact"
                );
                // Only the boundary bytes may keep a few bits of the secret.
                assert_eq!(dec[at + 1..at + s.len() - 1], rep[1..rep.len() - 1]);
                assert!(!find(&dec, &s));
            }
        }
    }

    #[test]
    fn different_length_replacement_keeps_base64_alphabet() {
        let s = b"ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8".to_vec();
        let sc = Scrubber::new(&[ScrubSecret {
            secret: s.clone(),
            ..Default::default()
        }]);
        for lead in 0..3 {
            let doc = [&b"abc"[..lead], &s, b" tail"].concat();
            let enc = STANDARD.encode(&doc);
            let (out, _) = sc.scrub(enc.as_bytes()).expect("found");
            assert!(
                out.iter()
                    .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(b))
            );
            assert!(!find(&out, &b64_core(&s, lead, false)));
        }
    }

    #[test]
    fn default_replacement_and_short_secrets() {
        let sc = Scrubber::new(&[ScrubSecret {
            secret: b"abcdefgh12".to_vec(),
            ..Default::default()
        }]);
        assert_eq!(
            sc.scrub(b"x abcdefgh12 y").unwrap(),
            (b"x [scrubbed] y".to_vec(), 1)
        );
        // 5 bytes: still matched raw.
        let sc = Scrubber::new(&[ScrubSecret {
            secret: b"k3y5z".to_vec(),
            replacement: b"PH".to_vec(),
            ..Default::default()
        }]);
        assert_eq!(sc.scrub(b"<k3y5z>").unwrap().0, b"<PH>");
        // 3 bytes: raw pattern below MIN_PATTERN_LEN is dropped; longer encodings remain.
        let sc = Scrubber::new(&[ScrubSecret {
            secret: b"a&b".to_vec(),
            replacement: b"xyz".to_vec(),
            ..Default::default()
        }]);
        assert!(!sc.contains(b"a&b"));
        assert_eq!(sc.scrub(b"q=a%26b").unwrap().0, b"q=xyz");
        assert!(sc.max_pattern_len() >= MIN_PATTERN_LEN);
        // Nothing at all.
        let sc = Scrubber::new(&[]);
        assert!(sc.is_empty());
        assert_eq!(sc.max_pattern_len(), 0);
        assert!(sc.scrub(b"anything").is_none());
        let (out, n) = stream_all(&Arc::new(sc), &[b"any", b"thing"]);
        assert_eq!((out.as_slice(), n), (&b"anything"[..], 0));
    }

    #[test]
    fn multiple_secrets_and_counts() {
        let sc = Scrubber::new(&[
            ScrubSecret {
                secret: b"first-secret-123".to_vec(),
                replacement: b"P1".to_vec(),
                ..Default::default()
            },
            ScrubSecret {
                secret: b"second/secret+456".to_vec(),
                replacement: b"P2".to_vec(),
                ..Default::default()
            },
        ]);
        let hay =
            b"a first-secret-123 b second%2Fsecret%2B456 c second\\/secret+456 d first-secret-123";
        let (out, n) = sc.scrub(hay).unwrap();
        assert_eq!(out, b"a P1 b P2 c P2 d P1");
        assert_eq!(n, 4);
    }

    #[test]
    fn stream_equals_whole_for_every_split() {
        let s = b"tok_9f8e7d6c5b4a3210/+=&".to_vec();
        let sc = Arc::new(Scrubber::new(&[spec(&s, b"PH")]));
        let inputs: Vec<Vec<u8>> = vec![
            [&b"data: "[..], &s, b"\n\n"].concat(),
            [&b"tok_9f8e"[..], &s, b"tok_9f", &s[..s.len() - 1]].concat(),
            [
                &b"{\"a\":\""[..],
                &ref_json(&s, 1),
                b"\",\"b\":\"",
                STANDARD.encode([&b"Bearer "[..], &s].concat()).as_bytes(),
                b"\",\"c\":\"",
                &ref_pct(&s, "-._~", false, true),
                b"\"} ",
                &s[..10],
            ]
            .concat(),
            b"no secret here at all, just tok_ and tok_9f8e7d and dG9r".to_vec(),
        ];
        for hay in &inputs {
            let w = whole(&sc, hay);
            for i in 0..=hay.len() {
                assert_eq!(stream_all(&sc, &[&hay[..i], &hay[i..]]), w, "split {i}");
            }
            if hay.len() <= 80 {
                for i in 0..=hay.len() {
                    for j in i..=hay.len() {
                        assert_eq!(stream_all(&sc, &split_at_points(hay, &[i, j])), w);
                    }
                }
            }
            let bytes: Vec<&[u8]> = hay.chunks(1).collect();
            assert_eq!(stream_all(&sc, &bytes), w, "byte by byte");
        }
    }

    #[test]
    fn no_hold_back_unless_pattern_prefix() {
        let s = b"sk-proj-abcdefghijklmnop".to_vec();
        let sc = Arc::new(Scrubber::new(&[spec(&s, b"PH")]));
        let mut st = ScrubStream::new(sc.clone());
        let mut out = Vec::new();
        st.push(b"data: hello\n\n", &mut out);
        assert_eq!(out, b"data: hello\n\n");
        assert_eq!(st.held(), 0);
        out.clear();
        st.push(b"data: {\"k\":\"sk-proj-ab", &mut out);
        assert_eq!(out, b"data: {\"k\":\"");
        assert_eq!(st.held(), 10);
        out.clear();
        st.push(b"cdefghijklmnop\"}\n\n", &mut out);
        assert_eq!(out, b"PH\"}\n\n");
        assert_eq!(st.held(), 0);
        out.clear();
        st.push(b"data: sk-pro", &mut out);
        st.push(b"ject\n\n", &mut out); // the prefix did not continue: released unchanged
        assert_eq!(out, b"data: sk-project\n\n");
        assert_eq!(st.held(), 0);
        assert_eq!(st.found(), 1);
    }

    #[test]
    fn no_false_positives() {
        let mut rng = Rng(7);
        let mut secrets = Vec::new();
        for i in 0..20 {
            let len = rng.range(8, 41);
            let s = secret(&mut rng, i % 3, len);
            secrets.push(spec(&s, b""));
        }
        let sc = Scrubber::new(&secrets);
        for _ in 0..20 {
            let text = filler(&mut rng, 20_000);
            assert!(!sc.contains(&text));
            assert!(sc.scrub(&text).is_none());
        }
        // Near misses: one byte changed / truncated.
        for sec in &secrets {
            let mut s = sec.secret.clone();
            let i = rng.below(s.len());
            s[i] = if s[i] == b'#' { b'@' } else { b'#' };
            assert!(!sc.contains(&s), "{:?}", sec);
            assert!(!sc.contains(&sec.secret[..sec.secret.len() - 1]) || sec.secret.len() < 4);
        }
    }

    #[test]
    fn sample_pattern_count() {
        let s = b"sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWxYz".to_vec();
        assert_eq!(s.len(), 40 - 1);
        let s40 = [&s[..], b"0"].concat();
        let plain = Scrubber::new(&[ScrubSecret {
            secret: s40.clone(),
            ..Default::default()
        }]);
        let full = Scrubber::new(&[spec(&s40, b"")]);
        let sym = Scrubber::new(&[ScrubSecret {
            secret: "Ab+/=&\"<>\\x\u{e9}\u{1f600}0123456789abcdefghijklmn"
                .as_bytes()
                .to_vec(),
            ..Default::default()
        }]);
        println!(
            "40-char alnum-ish secret: {} patterns (max len {}); with Bearer prefix + basic user: {}; 40-byte symbol/non-ASCII secret: {} (max len {})",
            plain.pattern_count(),
            plain.max_pattern_len(),
            full.pattern_count(),
            sym.pattern_count(),
            sym.max_pattern_len()
        );
        assert!(plain.pattern_count() >= 8);
        let mut rng = Rng(40);
        for _ in 0..3 {
            let r = Scrubber::new(&[spec(&secret(&mut rng, 0, 40), b"")]);
            println!(
                "random 40-char alphanumeric secret with prefix + basic user: {} patterns",
                r.pattern_count()
            );
        }
    }

    #[test]
    fn send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Scrubber>();
        assert_send_sync::<ScrubStream>();
        assert_send_sync::<WsScrub>();
    }

    // ---- WebSocket ----

    fn ws_frame(fin: bool, opcode: u8, payload: &[u8], wide: bool) -> Vec<u8> {
        let mut f = vec![(u8::from(fin) << 7) | opcode];
        let n = payload.len();
        if wide {
            f.push(127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        } else if n < 126 {
            f.push(n as u8);
        } else if n < 65536 {
            f.push(126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            f.push(127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
        f.extend_from_slice(payload);
        f
    }

    /// (first header byte, header length, payload) of each frame.
    fn ws_parse(mut b: &[u8]) -> Vec<(u8, usize, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            let (hl, n) = match b[1] & 0x7f {
                126 => (4, u16::from_be_bytes([b[2], b[3]]) as usize),
                127 => (
                    10,
                    u64::from_be_bytes(b[2..10].try_into().unwrap()) as usize,
                ),
                n => (2, n as usize),
            };
            v.push((b[0], hl, b[hl..hl + n].to_vec()));
            b = &b[hl + n..];
        }
        v
    }

    fn ws_run(sc: &Arc<Scrubber>, chunks: &[&[u8]]) -> Result<Vec<u8>, WsError> {
        let mut ws = WsScrub::new(sc.clone());
        let mut out = Vec::new();
        for c in chunks {
            ws.push(c, &mut out)?;
        }
        ws.finish(&mut out);
        assert_eq!(ws.held(), 0);
        Ok(out)
    }

    #[test]
    fn ws_secret_across_fragments_every_split() {
        let s = b"xoxb-1234-5678-abcdefghij".to_vec();
        let sc = Arc::new(Scrubber::new(&[spec(&s, b"REDACTED")]));
        let msg = [&b"{\"echo\":\""[..], &s, b"\"}"].concat();
        let (m1, m2) = msg.split_at(15); // the secret straddles the two fragments
        let stream = [
            ws_frame(false, 1, m1, false),
            ws_frame(true, 9, b"ping!", false), // control frame between fragments
            ws_frame(true, 0, m2, true),        // 64-bit length encoding
            ws_frame(true, 2, &[&s[..], &[0u8; 200]].concat(), false), // 16-bit length
            ws_frame(true, 10, &s, false),      // pong echoing the secret
            ws_frame(true, 8, b"\x03\xe8bye", false),
        ]
        .concat();
        let expected = ws_run(&sc, &[&stream]).unwrap();
        let frames = ws_parse(&expected);
        let inframes = ws_parse(&stream);
        assert_eq!(frames.len(), 6);
        for (a, b) in frames.iter().zip(&inframes) {
            assert_eq!(
                (a.0, a.1, a.2.len()),
                (b.0, b.1, b.2.len()),
                "headers unchanged"
            );
        }
        let payload = [&frames[0].2[..], &frames[2].2].concat();
        assert_eq!(payload, sc.scrub_same_len(&msg).unwrap().0);
        assert!(find(&payload, b"\"REDACTED*****************\"}"));
        assert_eq!(frames[1].2, b"ping!");
        assert_eq!(&frames[3].2[..25], b"REDACTED*****************");
        assert_eq!(&frames[4].2[..], b"REDACTED*****************");
        assert_eq!(frames[5].2, b"\x03\xe8bye");
        assert!(!find(&expected, &s));
        for i in 0..=stream.len() {
            assert_eq!(
                ws_run(&sc, &[&stream[..i], &stream[i..]]).unwrap(),
                expected,
                "split {i}"
            );
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(ws_run(&sc, &bytes).unwrap(), expected);
    }

    #[test]
    fn ws_holds_only_while_ambiguous() {
        let s = b"xoxb-1234-5678-abcdefghij".to_vec();
        let sc = Arc::new(Scrubber::new(&[spec(&s, b"R")]));
        let mut ws = WsScrub::new(sc);
        let mut out = Vec::new();
        let f1 = ws_frame(true, 1, b"hello", false);
        ws.push(&f1, &mut out).unwrap();
        assert_eq!(out, f1);
        out.clear();
        // A fragment ending in a pattern prefix: the tail and everything after waits.
        let f2 = ws_frame(false, 1, b"abc xoxb-12", false);
        let ping = ws_frame(true, 9, b"p", false);
        ws.push(&[&f2[..], &ping].concat(), &mut out).unwrap();
        assert_eq!(out, f2[..f2.len() - 7]);
        assert_eq!(ws.held(), 7 + ping.len());
        let f3 = ws_frame(true, 0, b"!", false);
        ws.push(&f3, &mut out).unwrap();
        assert_eq!(out, [&f2[..], &ping, &f3].concat());
        assert_eq!(ws.held(), 0);
        // Same-length replacement cuts on a UTF-8 boundary and pads.
        let mut o = Vec::new();
        push_same_len("\u{e9}\u{e9}".as_bytes(), 3, &mut o);
        assert_eq!(o, "\u{e9}*".as_bytes());
    }

    #[test]
    fn ws_errors() {
        let sc = Arc::new(Scrubber::new(&[spec(b"secretsecret", b"")]));
        let mut masked = ws_frame(true, 1, b"abcd", false);
        masked[1] |= 0x80;
        assert_eq!(
            ws_run(&sc, &[&masked[..1], &masked[1..]]),
            Err(WsError::MaskedServerFrame)
        );
        let mut rsv = ws_frame(true, 1, b"abcd", false);
        rsv[0] |= 0x40;
        assert_eq!(ws_run(&sc, &[&rsv]), Err(WsError::ReservedBits));
        assert_eq!(
            ws_run(&sc, &[&ws_frame(true, 3, b"", false)]),
            Err(WsError::ReservedOpcode(3))
        );
        assert_eq!(
            ws_run(&sc, &[&ws_frame(false, 9, b"", false)]),
            Err(WsError::BadControlFrame)
        );
        assert_eq!(
            ws_run(&sc, &[&ws_frame(true, 9, &[0; 126], false)]),
            Err(WsError::BadControlFrame)
        );
        let mut huge = ws_frame(true, 2, b"", true);
        huge[2] = 0x80;
        assert_eq!(ws_run(&sc, &[&huge]), Err(WsError::LengthOverflow));
        // Errors are sticky.
        let mut ws = WsScrub::new(sc);
        let mut out = Vec::new();
        assert!(ws.push(&masked, &mut out).is_err());
        assert_eq!(
            ws.push(&ws_frame(true, 1, b"ok", false), &mut out),
            Err(WsError::MaskedServerFrame)
        );
    }

    /// Fuzz-style property: random secret, encoding, surroundings and split points.
    #[test]
    fn property_random_cases() {
        let mut rng = Rng(0x5eed);
        let encs = all_encs();
        for case in 0..2000 {
            let class = rng.below(3);
            let len = rng.range(8, 41);
            let s = secret(&mut rng, class, len);
            let rep = placeholder(&mut rng);
            let sc = Arc::new(Scrubber::new(&[spec(&s, &rep)]));
            let enc = *rng.pick(&encs);
            let (piece, needle, _) = encode(&mut rng, enc, &s, &rep);
            let mut hay = filler(&mut rng, 60);
            hay.push(b' ');
            hay.extend_from_slice(&piece);
            hay.push(b' ');
            hay.extend(filler(&mut rng, 60));
            if rng.below(3) == 0 {
                hay.extend_from_slice(&piece[..rng.below(piece.len())]); // truncated tail
            }
            let ctx = format!(
                "case {case} enc {enc:?} secret {:?}",
                String::from_utf8_lossy(&s)
            );
            let w = whole(&sc, &hay);
            assert!(w.1 >= 1, "{ctx}");
            assert!(!find(&w.0, &needle), "{ctx}");
            let points: Vec<usize> = (0..rng.range(1, 6))
                .map(|_| rng.below(hay.len() + 1))
                .collect();
            assert_eq!(
                stream_all(&sc, &split_at_points(&hay, &points)),
                w,
                "{ctx} {points:?}"
            );

            // The same bytes as one fragmented WebSocket message.
            if case % 4 == 0 {
                let cuts: Vec<usize> = (0..rng.range(0, 4))
                    .map(|_| rng.below(hay.len() + 1))
                    .collect();
                let parts = split_at_points(&hay, &cuts);
                let mut wire = Vec::new();
                for (i, p) in parts.iter().enumerate() {
                    let op = if i == 0 { 2 } else { 0 };
                    wire.extend(ws_frame(i + 1 == parts.len(), op, p, rng.below(2) == 0));
                    if rng.below(3) == 0 {
                        wire.extend(ws_frame(true, 9, b"keepalive", false));
                    }
                }
                let points: Vec<usize> = (0..rng.range(1, 6))
                    .map(|_| rng.below(wire.len() + 1))
                    .collect();
                let out = ws_run(&sc, &split_at_points(&wire, &points)).unwrap();
                let frames = ws_parse(&out);
                let payload: Vec<u8> = frames
                    .iter()
                    .filter(|f| f.0 & 0x0f != 9)
                    .flat_map(|f| f.2.clone())
                    .collect();
                let same = sc.scrub_same_len(&hay).map_or(hay.clone(), |r| r.0);
                assert_eq!(payload, same, "{ctx}");
                assert!(
                    frames
                        .iter()
                        .filter(|f| f.0 & 0x0f == 9)
                        .all(|f| f.2 == b"keepalive")
                );
                assert_eq!(out.len(), wire.len());
            }
        }
    }
}
