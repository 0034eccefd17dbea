//! Every decision, each in one function: the settings parsed from the environment, the policy
//! table, which host GPU a CUDA device is, the CPU plan and its per-GPU slices, where step and
//! result threads go, whether and where memory moves, and the hand-off probe. Pure rules over
//! masks and host facts: uses the root's leaves, `handoff` and `host`, never the table, the
//! registry or the engine.

pub mod device;
pub mod load_facts;
pub mod memory_decision;
pub mod plan;
pub mod policy;
pub mod probe;
pub mod settings;
pub mod slice;
pub mod step;
