//! Builds the eBPF objects (`egress-ebpf`, binaries `egress` and `egress-relay`) for the BPF target
//! with aya-build on the nightly toolchain and leaves them in `OUT_DIR`, where the loaders embed
//! them with `include_bytes_aligned!`. `AYA_BUILD_SKIP=1` skips it (check/clippy without
//! bpf-linker); the binary then embeds empty objects and refuses to load them.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir)
        .parent()
        .ok_or_else(|| anyhow!("no workspace dir"))?
        .join("egress-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("non-UTF-8 path {ebpf_dir:?}"))?;
    let out_dir = std::env::var("OUT_DIR").context("OUT_DIR")?;
    let object = std::path::Path::new(&out_dir).join("egress");
    let skip = std::env::var("AYA_BUILD_SKIP")
        .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
        .unwrap_or(false);
    if skip {
        // Keep include_bytes_aligned! compiling; the loaders reject an empty object.
        for object in [object, std::path::Path::new(&out_dir).join("egress-relay")] {
            if !object.exists() {
                std::fs::write(&object, [])
                    .with_context(|| format!("write {}", object.display()))?;
            }
        }
    }
    aya_build::build_ebpf(
        [Package {
            name: "egress-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        Toolchain::default(),
    )
}
