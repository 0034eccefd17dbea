//! tllm-affinity: role-aware CPU affinity for the threads of GPU inference servers.
//!
//! The safe core lives here, in folders by concern, each below the ones that use it:
//! - the leaves at this root: CPU masks ([`mask`]), a thread's identity ([`identity`]), the log
//!   ([`log`]), the per-architecture facts ([`arch`]), the one lock type ([`lock`]) and its
//!   per-thread state ([`per_thread`]), and the raw system calls ([`sys`]);
//! - [`handoff`]: what a process hands to the programs it starts (the launch variable, the
//!   Python hook's path);
//! - [`host`]: what the machine is (topology, cgroup, GPUs, NVML, kernel texts, the simulated
//!   hosts);
//! - [`table`]: the shared thread table and the one way to open what others can touch;
//! - [`placement`]: every decision (settings, policy, plan, slices, step threads, memory);
//! - [`registry`]: the model of roles, placements and leases, and its report;
//! - [`engine`]: the preload's hooks, which the shims in `cdylib/` call.
//!
//! The compiler refuses `unsafe` everywhere but in these modules, marked `allow(unsafe_code)`
//! where they are declared:
//! - [`sys`]: the raw system calls every safe layer uses (affinity, ids, errno, the log's
//!   `write`, the step lock's `flock`, the CLI's `SIGPIPE` and user id), each behind a safe fn;
//! - [`engine`]: the `pthread_create` trampoline, the interposed functions resolved with
//!   `dlsym`, the pthread key, the shared-memory thread table, the exec and spawn shims;
//! - [`lock`]: the futex mutex's `UnsafeCell` and its fork-time `force_unlock`;
//! - [`host::nvml`]: NVML's `dlopen` and the foreign calls through it;
//! - [`table::untrusted`]: the one way to open what other local users can touch (`openat`,
//!   `openat2`, `fstat`): no link followed, nothing but a regular file of the right owner opened.
//!
//! Every unsafe block carries a `// SAFETY:` line, and an unsafe fn's body is checked like any
//! other code. `tests/layers.rs` holds these modules to that list and the folders to their order.

#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod arch;
pub mod identity;
#[allow(unsafe_code)]
pub mod lock;
pub mod log;
pub mod mask;
pub mod per_thread;
#[allow(unsafe_code)]
pub mod sys;

pub mod handoff;
pub mod host;
pub mod placement;
pub mod registry;
pub mod table;

#[allow(unsafe_code)]
pub mod engine;
