//! The engine behind the preload shims: load-time set-up, the C ABI's behaviour, and the hooks.
//!
//! Initialisation is an explicit state machine (uninitialised → initialising → active, passive or
//! disabled), run by the constructor and, lazily, by every entry point, because another library's
//! constructor can create a thread before ours has run. Every entry point fails open.
//!
//! The files stand in floors, each naming only the floors below it (`tests/layers.rs` holds them
//! to it; docs/design.md draws the order), from the top:
//! - [`api`]: what the C ABI's calls do (configure, worker scopes, release, role, the report,
//!   step and result pins); it calls [`init`], never the reverse;
//! - [`create`], [`observe`], [`timers`], [`pyhook`]: the interposed functions that may run
//!   before our constructor (`pthread_create`, the affinity calls, `timer_create`) and so start
//!   initialisation themselves, and the Python hook at load;
//! - [`init`]: the state machine, initialisation at load (settings, cpuset, the main thread's
//!   registration), what the launch handed over and what this image hands on, and the dedicated
//!   worker (`TLLM_AFFINITY_PROCESS_ROLE=worker`) configured at load;
//! - [`fork`]: the fork handlers, the list of every engine lock they hold across a fork, and the
//!   fork child's start (also for children of `_Fork` or `clone` that ran no handler);
//! - [`publish`]: the thread table `tllm-affinity ps` reads (its mapping, its path, when it is
//!   published) and the clean-up and report at exit;
//! - [`environ`]: the device variables as the program sets them, and the dedicated worker that
//!   follows them;
//! - [`configure`]: opening a lease (the worker set, the policy, the log lines); [`report`]: the
//!   report and what adapters said (also the notes `ps` shows); [`step_pin`]: pinning a step or
//!   result thread; [`memory_preference`]: a worker scope's caller's memory policy while it is open;
//!   [`memory_effects`]: a dedicated worker's pages moved to its node at configure;
//!   [`thread_key`]: each thread's registry slot and its exit; [`timer_calls`]: what a wrapped
//!   timer's callback runs; [`exec`], [`objects`]: the exec and spawn shims, `dlclose` and the
//!   loaded objects; [`packets`]: the start packets of the `pthread_create` trampoline;
//! - [`state`]: where initialisation stands, the load facts, the registry and the pid it
//!   describes; [`real`]: the libc functions the shims call through; [`kernel`]: the registry's
//!   kernel.
//!
//! This file holds nothing of its own: it names the files and hands the preload crate the C
//! ABI's functions.

pub mod api;
pub mod cleanup;
pub mod configure;
pub mod create;
pub mod environ;
pub mod exec;
pub mod fork;
pub mod init;
pub mod kernel;
pub mod memory_effects;
pub mod memory_preference;
pub mod objects;
pub mod observe;
pub mod packets;
pub mod publish;
pub mod pyhook;
pub mod real;
pub mod report;
pub mod state;
pub mod step_pin;
pub mod thread_key;
pub mod timer_calls;
pub mod timers;

pub use api::note_adapter;
pub use api::{
    begin_worker_scope, configure, end_worker_scope, fail_open, pin_step_or_result, release,
    report_json, role,
};
pub use fork::adopt_if_forked_without_handlers;
pub use init::{alone, ensure_init};
pub use publish::publish_table_if_pending;
pub use report::note_adapter_detail;
