//! The aarch64 builds of the wheel and the test programs (tests/emulated/aarch64.rs, tests/guests/guest_aarch64.rs).

use super::*;

/// `scripts/wheel aarch64`: the wheel, built once per test binary (cargo rebuilds only what
/// changed); the native files stay in [`aarch64_natives`].
pub fn aarch64_wheel() -> PathBuf {
    let out = Command::new(repo().join("scripts/wheel"))
        .arg("aarch64")
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/wheel");
    assert!(out.status.success(), "scripts/wheel aarch64 failed");
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    assert!(path.is_file(), "scripts/wheel printed {}", path.display());
    path
}

/// A C program of tests/programs, cross-compiled for aarch64 by zig against glibc 2.17 (as the
/// wheel's library is linked), into test-programs/aarch64/.
pub fn arm64_program(source: &str) -> PathBuf {
    for_aarch64(Program::c(source))
        .named(&format!("aarch64/{source}"))
        .build()
}

/// A shared object of tests/programs (`lib<source>.so.2`), cross-compiled as [`arm64_program`].
pub fn arm64_shared_object(source: &str) -> PathBuf {
    for_aarch64(Program::c(source).shared())
        .named(&format!("aarch64/lib{source}.so.2"))
        .build()
}

/// `program` compiled by zig's `cc` for aarch64 and glibc 2.17.
pub fn for_aarch64(program: Program) -> Program {
    let python = python();
    program.compiler(&[
        python.to_str().unwrap(),
        "-m",
        "ziglang",
        "cc",
        "-target",
        "aarch64-linux-gnu.2.17",
    ])
}

/// Where `scripts/wheel aarch64` leaves the native files the aarch64 wheel is assembled from
/// (`libtllm_affinity.so`, `tllm-affinity`).
pub fn aarch64_natives() -> PathBuf {
    repo().join("target/zig/aarch64-unknown-linux-gnu/wheel")
}
