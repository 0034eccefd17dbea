//! tllm-affinity: role-aware CPU affinity for the threads of GPU inference servers.
//!
//! The safe core lives here: CPU masks, the host topology read from sysfs, the cgroup limits,
//! the CUDA device mapping, the policy table, the registry model of roles and placements, and the
//! engine that the preload shims in `cdylib/` call. The compiler refuses `unsafe` everywhere but
//! in the modules marked `allow(unsafe_code)` below:
//! - [`sys`]: the raw system calls every safe layer uses (affinity, ids, errno, the log's
//!   `write`, the step lock's `flock`, the CLI's `SIGPIPE` and user id), each behind a safe fn;
//! - [`engine`]: the `pthread_create` trampoline, the interposed functions resolved with
//!   `dlsym`, the pthread key, the shared-memory thread table, the exec and spawn shims;
//! - [`lock`]: the futex mutex's `UnsafeCell` and its fork-time `force_unlock`;
//! - [`nvml`]: NVML's `dlopen` and the foreign calls through it;
//! - [`untrusted`]: the one way to open what other local users can touch (`openat`, `openat2`,
//!   `fstat`): no link followed, nothing but a regular file of the right owner opened.
//!
//! Every unsafe block carries a `// SAFETY:` line, and an unsafe fn's body is checked like any
//! other code. `tests/layers.rs` holds these modules to that list and the layers to their order.

#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod arch;
pub mod cgroup;
pub mod device;
pub mod elf;
#[allow(unsafe_code)]
pub mod engine;
pub mod gpus;
pub mod identity;
pub mod kernel_text;
pub mod launch;
pub mod load_facts;
#[allow(unsafe_code)]
pub mod lock;
pub mod log;
pub mod mask;
pub mod memory_decision;
#[allow(unsafe_code)]
pub mod nvml;
pub mod per_thread;
pub mod plan;
pub mod policy;
pub mod probe;
pub mod pyhook;
pub mod registry;
pub mod report;
pub mod settings;
#[cfg(any(test, feature = "simulated"))]
pub mod simulated;
pub mod slice;
pub mod step;
#[allow(unsafe_code)]
pub mod sys;
pub mod threadtable;
pub mod topology;
#[allow(unsafe_code)]
pub mod untrusted;
