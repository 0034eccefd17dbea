//! Links the unwinder into `libtllm_affinity.so` instead of needing `libgcc_s.so.1`.
//!
//! A preloaded library that needs a library the image lacks stops *every* program from starting
//! (exit 127), and container images without libgcc exist (distroless, Go and static images with a
//! glibc layer). Rust's std asks for the unwinder as `-lgcc_s`; `panic = "abort"` would drop it,
//! but the engine's fail-open `catch_unwind` needs unwinding. So the link search path of this
//! crate starts with a directory whose `libgcc_s.so` is a linker script naming gcc's static
//! unwinder (`libgcc_eh.a`, built position-independent for exactly this use by `-static-libgcc`):
//! the unwinder's code lands in the library, hidden behind the cdylib's export list, and the
//! `NEEDED` entries are glibc's alone.
//!
//! A build with its own linker (the wheel's `cargo zigbuild`, which links LLVM's libunwind
//! statically already) is left alone, as is a toolchain whose compiler has no `libgcc_eh.a`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    let gnu_linux = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    if !gnu_linux || std::env::var_os("RUSTC_LINKER").is_some() {
        return;
    }
    let Some(unwinder) = static_unwinder() else {
        println!(
            "cargo:warning=gcc's libgcc_eh.a not found: libtllm_affinity.so will need libgcc_s.so.1"
        );
        return;
    };
    let dir =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("unwind");
    std::fs::create_dir_all(&dir).expect("create OUT_DIR/unwind");
    let script = format!("INPUT({})\n", unwinder.display());
    std::fs::write(dir.join("libgcc_s.so"), script).expect("write OUT_DIR/unwind/libgcc_s.so");
    println!("cargo:rustc-link-search=native={}", dir.display());
    // The compiler driver adds its own -lgcc_s to a shared link unless told otherwise.
    println!("cargo:rustc-cdylib-link-arg=-static-libgcc");
}

/// The absolute path of `libgcc_eh.a` as the C compiler that links this crate knows it.
fn static_unwinder() -> Option<PathBuf> {
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let out = Command::new(cc)
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && path.is_absolute() && path.is_file()).then_some(path)
}
