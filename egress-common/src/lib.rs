//! Types shared by the kernel programs (`egress-ebpf`) and the loader (`egress-agent`).
//!
//! Every map key/value is `#[repr(C)]`, `Copy`, with explicit padding and no `bool`/`Option`/enum
//! fields, so both sides agree on the layout byte for byte.
#![no_std]
