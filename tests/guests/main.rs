//! The guest tiers: real multi-node kernels booted under QEMU (x86_64 two- and four-node machines,
//! a GB200-shaped arm64 machine), the library's placement and memory moves checked inside.
//!
//! Each module is one of the tier's files; `scripts/test` runs them one module at a time
//! (`cargo test --test guests -- <module>::`), as separate binaries ran before.

#[path = "../common/mod.rs"]
mod common;

mod guest;
mod guest_aarch64;
