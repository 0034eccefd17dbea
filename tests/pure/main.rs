//! The pure tier: checks that start no process under the library (the layers read from the
//! sources, proptest over the parsers and the table's readers). Seconds.
//!
//! Each module is one of the tier's files; `scripts/test` runs them one module at a time
//! (`cargo test --test pure -- <module>::`), as separate binaries ran before.

mod layers;
mod parsers_proptest;
mod readers_proptest;
