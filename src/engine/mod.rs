//! The engine behind the preload shims: load-time set-up, the C ABI's behaviour, and the hooks.
//!
//! Initialisation is an explicit state machine (uninitialised → initialising → active, passive or
//! disabled), run by the constructor and, lazily, by every entry point, because another library's
//! constructor can create a thread before ours has run. Every entry point fails open.
//!
//! Which file holds which concern:
//! - [`init`]: the state machine, initialisation at load (settings, cpuset, the main thread's
//!   registration), what the launch handed over and what this image hands on, and the dedicated
//!   worker (`TLLM_AFFINITY_PROCESS_ROLE=worker`) configured at load;
//! - [`api`]: what the C ABI's calls do (configure, worker scopes, release, role, adapters, the
//!   report, step and result pins) and the log lines they print;
//! - [`fork`]: the fork handlers, the list of every engine lock they hold across a fork, and the
//!   fork child's start (also for children of `_Fork` or `clone` that ran no handler);
//! - [`publish`]: the thread table `tllm-affinity ps` reads (its mapping, its path, when it is
//!   published) and the clean-up and report at exit;
//! - [`step_pin`]: pinning a step or result thread under the registry lock;
//! - [`scope_memory`]: the memory policy of a worker scope's caller while the scope is open;
//! - [`create`], [`packets`]: the `pthread_create` trampoline and its start packets;
//! - [`observe`], [`environ`], [`exec`], [`objects`], [`timers`], [`pyhook`]: the other interposed
//!   functions (affinity calls, the environment, exec and spawn, `dlclose`, `SIGEV_THREAD` timers,
//!   the Python hook);
//! - [`real`]: the libc functions the shims call through; [`kernel`]: the registry's kernel.
//!
//! This file keeps the state every one of them shares: the state, the load facts, the registry
//! and the pid it describes.

pub mod api;
pub mod create;
pub mod environ;
pub mod exec;
pub mod fork;
pub mod init;
pub mod kernel;
pub mod objects;
pub mod observe;
pub mod packets;
pub mod publish;
pub mod pyhook;
pub mod real;
pub mod scope_memory;
pub mod step_pin;
pub mod timers;

pub use api::{
    begin_worker_scope, configure, end_worker_scope, note_adapter, note_adapter_detail,
    pin_step_or_result, release, report_json, role,
};
pub use fork::adopt_if_forked_without_handlers;
pub use init::{alone, ensure_init};
pub use publish::publish_table_if_pending;

use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::load_facts::LoadFacts;
use crate::lock::{EngineGuard, EngineLock};
use crate::registry::Registry;
use crate::sys;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    Uninitialised = 0,
    Initialising = 1,
    /// Tracking roles and placing worker threads.
    Active = 2,
    /// A setting was malformed: nothing is tracked or changed, the program runs on.
    Passive = 3,
    /// Secure execution, or the platform refused what the library needs.
    Disabled = 4,
}

static STATE: AtomicU8 = AtomicU8::new(State::Uninitialised as u8);

static LOAD_FACTS: OnceLock<LoadFacts> = OnceLock::new();

/// One lock over the registry: an [`EngineLock`], which never parks through a thread-local with a
/// destructor (a new thread in our trampoline must never wait for the loader lock); see
/// `lock.rs` for why.
static REGISTRY: EngineLock<Registry> = EngineLock::new(Registry::new());

pub fn registry() -> &'static EngineLock<Registry> {
    &REGISTRY
}

/// The registry, with the application's mask changes that the observing shims queued taken in
/// first. Every path takes it this way except a thread's birth and exit, which must not allocate
/// (they use [`registry`]): a change queued then is taken in by the next operation, before it
/// decides anything from that thread's mask.
pub fn lock_registry() -> EngineGuard<'static, Registry> {
    let mut reg = REGISTRY.lock();
    observe::take_queued(&mut reg);
    reg
}

/// The pid the registry describes: set at load and in a fork child. A `vfork` or
/// `clone(CLONE_VM)` child runs on our memory with another pid until it execs.
static OWN_PID: AtomicI32 = AtomicI32::new(0);

/// Whether the caller runs in the process the registry describes (not in a child sharing its
/// memory, nor in a child of `_Fork`/`clone` that skipped the fork handlers).
pub fn in_own_process() -> bool {
    OWN_PID.load(Ordering::Relaxed) == sys::getpid()
}

/// The load-time facts; only called after `ensure_init` returned `Active`.
pub fn load_facts() -> &'static LoadFacts {
    LOAD_FACTS.get().expect("engine used before initialisation")
}

pub fn state() -> State {
    match STATE.load(Ordering::Acquire) {
        0 => State::Uninitialised,
        1 => State::Initialising,
        2 => State::Active,
        3 => State::Passive,
        _ => State::Disabled,
    }
}
