//! tllm-affinity: role-aware CPU affinity for the threads of GPU inference servers.
//!
//! The safe core lives here: CPU masks, the host topology read from sysfs, the cgroup limits,
//! the CUDA device mapping, the policy table, the registry model of roles and placements, and the
//! engine that the preload shims in `cdylib/` call. The few modules that must be `unsafe` (raw
//! syscalls, the `pthread_create` trampoline) sit under [`engine`], NVML's `dlopen` in [`nvml`],
//! with a `// SAFETY:` line on every block.

pub mod cgroup;
pub mod cli;
pub mod device;
pub mod elf;
pub mod engine;
pub mod gpus;
pub mod launch;
pub mod lock;
pub mod log;
pub mod mask;
pub mod nvml;
pub mod plan;
pub mod policy;
pub mod probe;
pub mod pyhook;
pub mod registry;
pub mod report;
pub mod settings;
pub mod simulated;
pub mod step;
pub mod threadtable;
pub mod topology;
