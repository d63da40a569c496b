//! The transparent path's first bytes: a TLS ClientHello (rustls `Acceptor`) or an HTTP/1 head,
//! fed to `proxy::sniff::Sniffer` whole and in segments whose sizes come from the input.
//! Invariants: never panics; the outcome does not depend on how the bytes were segmented; a name
//! it returns is normalised and on the original port.
#![no_main]

use egress_policy::name::Destination;
use egress_agent::proxy::sniff::{Sniffed, Sniffer};
use libfuzzer_sys::fuzz_target;

fn run(data: &[u8], pieces: &[usize]) -> Sniffed {
    let mut s = Sniffer::new(443);
    let mut buf = Vec::new();
    let mut rest = data;
    let mut sizes = pieces.iter().cycle();
    while !rest.is_empty() {
        let n = (*sizes.next().unwrap_or(&1)).clamp(1, rest.len());
        let from = buf.len();
        buf.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        match s.feed(&buf, from) {
            Sniffed::More => {}
            done => return done,
        }
    }
    Sniffed::More
}

fuzz_target!(|input: &[u8]| {
    // First byte: a segment-size pattern; the rest: the connection's bytes.
    let Some((&pattern, data)) = input.split_first() else {
        return;
    };
    let pieces = [
        usize::from(pattern % 17) + 1,
        usize::from(pattern / 17) + 1,
        3,
    ];
    let whole = run(data, &[data.len().max(1)]);
    let split = run(data, &pieces);
    assert_eq!(whole, split, "segmentation changed the outcome");
    if let Sniffed::Target { target, .. } = &whole {
        assert_eq!(target.port, 443);
        assert_eq!(
            Destination::parse(&target.dest.to_string()).as_ref(),
            Ok(&target.dest),
            "normalised"
        );
    }
});
