//! The live thread table a process publishes for `tllm-affinity ps` (in `/dev/shm`), and the one
//! way to open what other local users can touch ([`untrusted`]). Uses the root's leaves and the
//! host's kernel texts.

pub mod threadtable;
#[allow(unsafe_code)]
pub mod untrusted;
