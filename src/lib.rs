//! tllm-affinity: role-aware CPU affinity for the threads of GPU inference servers.
//!
//! The safe core lives here: CPU masks, the host topology read from sysfs, the cgroup limits,
//! the CUDA device mapping, the policy table, the registry model of roles and placements, and the
//! engine that the preload shims in `cdylib/` call. The compiler refuses `unsafe` everywhere but
//! in the modules marked `allow(unsafe_code)` below: the engine (raw syscalls, the
//! `pthread_create` trampoline, the interposed functions), the lock, NVML's `dlopen`, the log's
//! raw `write` and the step lock's `flock`. Every unsafe
//! block carries a `// SAFETY:` line, and an unsafe fn's body is checked like any other code.

#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod cgroup;
pub mod device;
pub mod elf;
#[allow(unsafe_code)]
pub mod engine;
pub mod gpus;
pub mod launch;
#[allow(unsafe_code)]
pub mod lock;
#[allow(unsafe_code)]
pub mod log;
pub mod mask;
#[allow(unsafe_code)]
pub mod nvml;
pub mod plan;
pub mod policy;
pub mod probe;
pub mod pyhook;
pub mod registry;
pub mod report;
pub mod settings;
#[cfg(any(test, feature = "simulated"))]
pub mod simulated;
#[allow(unsafe_code)]
pub mod step;
pub mod threadtable;
pub mod topology;
