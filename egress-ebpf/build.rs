//! Rebuild the eBPF object when the `bpf-linker` binary changes (an undeclared build input).
use which::which;

fn main() {
    match which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        // The host-side library build (as a build-dependency of egress-agent) does not link BPF
        // code; the BPF build itself will fail loudly without the linker.
        Err(err) => println!("cargo:warning=bpf-linker not found: {err}"),
    }
}
