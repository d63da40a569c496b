//! One packet on the hand-over socket (`egress_agent::handover::wire`), as a successor or the
//! running agent would receive it. The socket is root-only, but a bug or a mismatched build on
//! the other end sends anything. Invariants: receiving never panics; a message that is understood
//! sends and receives again as the same message.
#![no_main]

use egress_agent::handover::wire::Conn;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (a, b) = Conn::pair().expect("socketpair");
    if a.send_raw(data).is_err() {
        return; // larger than the socket takes
    }
    if let Ok((msg, fds)) = b.recv() {
        assert!(fds.is_empty());
        a.send(&msg, &[]).expect("send again");
        let (again, _) = b.recv().expect("receive again");
        assert_eq!(msg, again);
    }
});
