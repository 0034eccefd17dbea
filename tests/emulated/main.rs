//! The aarch64 tier: the aarch64 build of the library and its wheel under qemu-user, in an arm64
//! root filesystem, asserting what the x86_64 process tier asserts.
//!
//! Each module is one of the tier's files; `scripts/test` runs them one module at a time
//! (`cargo test --test emulated -- <module>::`), as separate binaries ran before.

#[path = "../common/mod.rs"]
mod common;

mod aarch64;
