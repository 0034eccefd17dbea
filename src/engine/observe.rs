//! The application's own `sched_setaffinity` / `pthread_setaffinity_np` calls, observed so that
//! the library never overrides them nor "restores" over them (SPEC §2, placement `explicit`).
//!
//! These shims can run where little is allowed: in a signal handler (`sched_setaffinity` is
//! async-signal-safe, so a handler may call it while its thread is inside the library), and in a
//! `vfork` or `clone(CLONE_VM)` child, which shares the parent's memory and thread-local state
//! until it execs. So a shim never allocates and never waits for a lock its own thread holds: it
//! makes the real call and queues the thread's tid in a fixed, lock-free queue; the next registry
//! operation outside a thread's birth or exit takes the queue in (see [`super::state::lock_registry`])
//! and marks those threads `explicit` with the mask the kernel then holds. A child sharing our
//! memory (its pid is not ours) only makes the real call: it changes nothing of the parent's.
//!
//! Outside a signal handler the real call still runs under the registry lock: a `configure`
//! sweeping the process takes the queue in and then holds that lock while it reads a thread's
//! mask and writes the worker mask, so the application's call can never land between the two and
//! be overwritten.

use std::ffi::c_int;

use super::fork;
use super::init::ensure_init;
use super::real;
use super::report;
use super::state::{in_own_process, queue_observed, registry, State};
use crate::lock;
use crate::registry::Tid;
use crate::sys;

/// # Safety
/// The arguments are those of `sched_setaffinity(2)`.
pub unsafe fn sched_setaffinity(
    pid: libc::pid_t,
    size: libc::size_t,
    mask: *const libc::cpu_set_t,
) -> c_int {
    let Some(real_set) = real::sched_setaffinity() else {
        return real::not_found();
    };
    // SAFETY: the caller's own arguments, passed on unchanged.
    let call = || unsafe { real_set(pid, size, mask) } == 0;
    // The raw syscall, not a cached tid: a vfork child has its parent's thread-local state.
    let ok = observed(call, || if pid == 0 { sys::gettid() } else { pid });
    if ok {
        0
    } else {
        -1
    }
}

/// # Safety
/// The arguments are those of `pthread_setaffinity_np(3)`.
pub unsafe fn pthread_setaffinity_np(
    thread: libc::pthread_t,
    size: libc::size_t,
    mask: *const libc::cpu_set_t,
) -> c_int {
    let Some(real_set) = real::pthread_setaffinity_np() else {
        return libc::ENOSYS;
    };
    let mut rc = 0;
    observed(
        || {
            // SAFETY: the caller's own arguments, passed on unchanged.
            rc = unsafe { real_set(thread, size, mask) };
            rc == 0
        },
        || sys::tid_of(thread),
    );
    rc
}

/// How long a shim waits for the registry before it makes its call without it. Far longer than
/// any registry operation holds the lock; reached only where waiting would never end: a signal
/// handler whose thread was interrupted inside `malloc` while the holder (an operation that
/// allocates) waits for that very arena. While a fork holds the registry (it then takes every
/// arena) the shim does not wait at all: the fork changes no mask.
const PATIENCE: std::time::Duration = std::time::Duration::from_millis(50);

/// Runs `call` (the real function; true on success) and, when it succeeded, queues the thread
/// `tid` names. `errno` is the real call's. Returns whether the call succeeded.
fn observed(call: impl FnOnce() -> bool, tid: impl FnOnce() -> Tid) -> bool {
    if ensure_init() != State::Active || !in_own_process() {
        return call();
    }
    // A signal handler that interrupted the library on this thread: its lock is ours already.
    // Past the patience the call is made unlocked and still queued: the next registry operation
    // marks the thread `explicit` all the same.
    let guard = if lock::held_by_this_thread() {
        None
    } else {
        // A fork past its prepare handlers holds the registry until the child exists, and it
        // may be waiting for the malloc arena this very thread was interrupted in: no wait.
        registry().lock_within(PATIENCE, fork::in_progress)
    };
    let ok = call();
    if ok {
        let errno = sys::errno();
        let tid = tid();
        queue_observed(tid);
        if tid != sys::gettid() {
            report::note_another_threads_mask_set();
        }
        if let Some(mut reg) = guard {
            reg.mark_explicit(tid);
        }
        sys::set_errno(errno);
    }
    ok
}
