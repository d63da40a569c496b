//! Host-side stub: `egress-agent` has a build-dependency on this crate so that cargo rebuilds it
//! when the kernel programs change. The programs themselves are the `egress` binary (src/main.rs),
//! built for the BPF target by `egress-agent/build.rs`.
#![no_std]
