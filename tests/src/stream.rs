//! Content-checked byte streams for relay tests and benchmarks.
//!
//! A stream is a sequence of 8-byte little-endian words; word `i` of the stream with seed `s` is
//! `mix(i ^ s)`, a bijection on `u64`, so the bytes look random (no run, no period a repeated or
//! skipped chunk could hide in) and any 8 received bytes can be traced back to the offset they were
//! sent at ([`Checker`] does that on a mismatch). The sender writes with [`Source`], the receiver
//! checks every read with [`Checker`]: a repeated, lost, reordered or altered byte is reported at
//! the first offset where it happens, with where the received bytes came from.
use std::fmt;

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xBF58_476D_1CE4_E5B9;

/// Multiplicative inverse of an odd `k` modulo 2^64 (Newton's iteration: each step doubles the
/// correct low bits, 3 → 6 → … → 96).
const fn inverse(k: u64) -> u64 {
    let mut x = k;
    let mut i = 0;
    while i < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(k.wrapping_mul(x)));
        i += 1;
    }
    x
}
const K1_INV: u64 = inverse(K1);
const K2_INV: u64 = inverse(K2);
const _: () = assert!(K1.wrapping_mul(K1_INV) == 1 && K2.wrapping_mul(K2_INV) == 1);

fn mix(x: u64) -> u64 {
    let y = x.wrapping_mul(K1);
    (y ^ (y >> 32)).wrapping_mul(K2)
}

fn unmix(z: u64) -> u64 {
    let y = z.wrapping_mul(K2_INV);
    (y ^ (y >> 32)).wrapping_mul(K1_INV)
}

/// The byte at `offset` of the stream with `seed`.
fn byte_at(seed: u64, offset: u64) -> u8 {
    mix((offset / 8) ^ seed).to_le_bytes()[(offset % 8) as usize]
}

/// Fill `buf` with the stream `seed` from byte `offset` on.
pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    let mut i = 0;
    let mut off = offset;
    // Up to the next word boundary byte by byte, then whole words.
    while i < buf.len() && !off.is_multiple_of(8) {
        buf[i] = byte_at(seed, off);
        i += 1;
        off += 1;
    }
    let mut word = off / 8;
    let mut chunks = buf[i..].chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&mix(word ^ seed).to_le_bytes());
        word += 1;
    }
    let rest = chunks.into_remainder();
    let w = mix(word ^ seed).to_le_bytes();
    rest.copy_from_slice(&w[..rest.len()]);
}

/// The sending side: the next bytes of one stream.
#[derive(Debug, Clone)]
pub struct Source {
    seed: u64,
    offset: u64,
}

impl Source {
    pub fn new(seed: u64) -> Source {
        Source { seed, offset: 0 }
    }
    /// Fill `buf` with the next `buf.len()` bytes.
    pub fn next(&mut self, buf: &mut [u8]) {
        fill(self.seed, self.offset, buf);
        self.offset += buf.len() as u64;
    }
    /// Bytes produced so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// What a [`Checker`] found: the first byte that differs from what was sent there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Stream offset of the first wrong byte.
    pub at: u64,
    /// Offset in the sent stream the received bytes from `at` on were sent at, when 16 bytes
    /// around them decode to consecutive words of this stream (`None`: bytes not of this stream).
    pub came_from: Option<u64>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.came_from {
            Some(from) if from < self.at => write!(
                f,
                "bytes repeated: at offset {} the stream restarts at offset {from} ({} bytes delivered twice)",
                self.at,
                self.at - from
            ),
            Some(from) => write!(
                f,
                "bytes lost: at offset {} the stream continues at offset {from} ({} bytes skipped)",
                self.at,
                from - self.at
            ),
            None => write!(
                f,
                "bytes altered: at offset {} the received bytes differ from those sent (their origin could not be traced)",
                self.at
            ),
        }
    }
}

impl std::error::Error for Mismatch {}

/// The receiving side: checks each read against the stream, in order.
#[derive(Debug, Clone)]
pub struct Checker {
    seed: u64,
    offset: u64,
    /// The first mismatch (the stream is out of step from there).
    failed: Option<Mismatch>,
}

impl Checker {
    pub fn new(seed: u64) -> Checker {
        Checker::at(seed, 0)
    }

    /// A checker whose next byte is the stream's byte at `offset` (the bytes before it were
    /// checked another way).
    pub fn at(seed: u64, offset: u64) -> Checker {
        Checker {
            seed,
            offset,
            failed: None,
        }
    }

    /// Bytes received (and checked) so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The first mismatch, if any.
    pub fn failed(&self) -> Option<&Mismatch> {
        self.failed.as_ref()
    }

    /// Check the next received bytes. After the first mismatch every later call returns it
    /// again (the stream is out of step from there).
    pub fn check(&mut self, data: &[u8]) -> Result<(), Mismatch> {
        if let Some(m) = &self.failed {
            return Err(m.clone());
        }
        let start = self.offset;
        let mut i = 0;
        let mut off = start;
        while i < data.len() && !off.is_multiple_of(8) {
            if data[i] != byte_at(self.seed, off) {
                return Err(self.fail(data, i));
            }
            i += 1;
            off += 1;
        }
        let mut word = off / 8;
        let mut chunks = data[i..].chunks_exact(8);
        let mut at = i;
        for c in &mut chunks {
            if c != mix(word ^ self.seed).to_le_bytes() {
                let j = c
                    .iter()
                    .zip(mix(word ^ self.seed).to_le_bytes())
                    .position(|(a, b)| *a != b)
                    .unwrap_or(0);
                return Err(self.fail(data, at + j));
            }
            word += 1;
            at += 8;
        }
        let rest = chunks.remainder();
        let w = mix(word ^ self.seed).to_le_bytes();
        if let Some(j) = rest.iter().zip(w).position(|(a, b)| *a != b) {
            return Err(self.fail(data, at + j));
        }
        self.offset += data.len() as u64;
        Ok(())
    }

    fn fail(&mut self, data: &[u8], i: usize) -> Mismatch {
        let at = self.offset + i as u64;
        let came_from = self.locate(&data[i..]);
        let m = Mismatch { at, came_from };
        self.failed = Some(m.clone());
        m
    }

    /// Where the bytes of `tail` (received from the mismatch on) were sent: the shift `s` at
    /// which two consecutive whole words decode to consecutive word indexes.
    fn locate(&self, tail: &[u8]) -> Option<u64> {
        for s in 0..8usize {
            if tail.len() < s + 16 {
                return None;
            }
            let w = |k: usize| {
                let b: [u8; 8] = tail[s + 8 * k..s + 8 * k + 8].try_into().ok()?;
                Some(unmix(u64::from_le_bytes(b)) ^ self.seed)
            };
            let (a, b) = (w(0)?, w(1)?);
            if b == a.wrapping_add(1) {
                return (8 * a).checked_sub(s as u64);
            }
        }
        None
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn a_stream_checks_in_any_split_and_mix_round_trips() {
        for x in [0u64, 1, 7, u64::MAX, 0x1234_5678_9abc_def0] {
            assert_eq!(unmix(mix(x)), x);
        }
        let mut src = Source::new(42);
        let mut sent = vec![0u8; 100_003];
        src.next(&mut sent[..13]);
        src.next(&mut sent[13..]);
        let mut whole = vec![0u8; sent.len()];
        fill(42, 0, &mut whole);
        assert_eq!(sent, whole);
        let mut c = Checker::new(42);
        for part in sent.chunks(977) {
            c.check(part).unwrap();
        }
        assert_eq!(c.offset(), sent.len() as u64);
    }

    #[test]
    fn a_repeated_chunk_is_named_with_its_offsets() {
        // What issue #34 saw: one MSS (65,483 bytes) delivered twice.
        let mut sent = vec![0u8; 300_000];
        fill(7, 0, &mut sent);
        let mut got = sent[..200_000].to_vec();
        got.extend_from_slice(&sent[200_000 - 65_483..]);
        let mut c = Checker::new(7);
        let mut err = None;
        for part in got.chunks(4096) {
            if let Err(e) = c.check(part) {
                err = Some(e);
                break;
            }
        }
        let e = err.expect("the repeat is found");
        assert_eq!(
            e,
            Mismatch {
                at: 200_000,
                came_from: Some(200_000 - 65_483)
            }
        );
        assert!(e.to_string().contains("65483 bytes delivered twice"), "{e}");
    }

    #[test]
    fn lost_and_altered_bytes_are_named() {
        let mut sent = vec![0u8; 50_000];
        fill(3, 0, &mut sent);
        let mut lost = sent[..1000].to_vec();
        lost.extend_from_slice(&sent[1500..]);
        let e = Checker::new(3).check(&lost).unwrap_err();
        assert_eq!((e.at, e.came_from), (1000, Some(1500)));
        let mut altered = sent.clone();
        altered[777] ^= 1;
        let e = Checker::new(3).check(&altered).unwrap_err();
        assert_eq!(e.at, 777);
        // Another stream's bytes are not this one's.
        let mut other = vec![0u8; 64];
        fill(4, 0, &mut other);
        let e = Checker::new(3).check(&other).unwrap_err();
        assert_eq!((e.at, e.came_from), (0, None));
    }
}
