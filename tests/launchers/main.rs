//! The launcher tier: a real Slurm cluster and a real Ray cluster, started by the tests themselves.
//!
//! Each module is one of the tier's files; `scripts/test` runs them one module at a time
//! (`cargo test --test launchers -- <module>::`), as separate binaries ran before.

#[path = "../common/mod.rs"]
mod common;

mod ray;
mod slurm;
