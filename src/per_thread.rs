//! The library's per-thread state: one `const` thread-local block with no destructor.
//!
//! Why one block, looked up once: a preloaded library reaches its thread-locals through
//! `__tls_get_addr` (stable Rust cannot ask for the initial-exec model), about a dozen
//! instructions a lookup. A thread's birth takes the registry lock on both sides and its exit
//! once more, and every acquisition counts itself; looked up at each use, that was nine lookups a
//! birth. The hot paths look the block up once and hand it on ([`EngineLock::lock_counted`]).
//!
//! Plain `Cell`s with no destructor: safe in a thread being born or exiting, in a signal handler
//! and in a `vfork` child (which shares its parent's block).
//!
//! [`EngineLock::lock_counted`]: crate::lock::EngineLock::lock_counted

use std::cell::Cell;

pub struct PerThread {
    /// Engine locks this thread holds or is acquiring (see [`crate::lock`]).
    pub locks_held: Cell<u32>,
    /// The thread's registry slot and exit bookkeeping flags (see `engine::thread_key`).
    pub registry_word: Cell<usize>,
    /// The NUMA node this thread prefers because the library set its memory policy, plus one; 0:
    /// its policy is not the library's (see `engine::memory_preference`).
    pub preferred_node: Cell<usize>,
    /// This thread's fork in progress took none of the engine's locks: it forked from a signal
    /// handler that interrupted the library on this thread (see `engine::fork`).
    pub fork_took_no_locks: Cell<bool>,
}

thread_local! {
    static PER_THREAD: PerThread = const {
        PerThread {
            locks_held: Cell::new(0),
            registry_word: Cell::new(0),
            preferred_node: Cell::new(0),
            fork_took_no_locks: Cell::new(false),
        }
    };
}

/// Runs `f` with the calling thread's block.
#[inline]
pub fn with<R>(f: impl FnOnce(&PerThread) -> R) -> R {
    PER_THREAD.with(f)
}

/// The calling thread's block as a pointer, valid until the thread ends: for the engine to hand
/// on where a closure cannot reach (a cleanup buffer's argument) or would cost a copy of what it
/// returns (the hook's plan).
#[inline]
pub fn current() -> *const PerThread {
    PER_THREAD.with(|t| t as *const PerThread)
}
