//! What each callback thread of a wrapped `SIGEV_THREAD` timer runs ([`super::timers`]): its timer
//! creator's placement first, then the program's function, from a context kept here until the
//! timer is deleted, and a little longer: a callback thread glibc started just before the delete
//! may not have read it yet. The fork handlers hold this store's lock.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use super::real::NotifyFunction;
use super::state::registry;
use crate::lock::EngineLock;
use crate::registry::{Role, SharedMask};
use crate::sys;

/// What a callback needs: the program's function and value, and its timer creator's placement.
pub(super) struct TimerCall {
    pub(super) function: NotifyFunction,
    pub(super) value: libc::sigval,
    pub(super) role: Role,
    pub(super) natural: SharedMask,
}

// SAFETY: the value is the program's opaque pointer, handed back to its own function only.
unsafe impl Send for TimerCall {}

/// How long a deleted timer's context outlives it.
const GRACE: Duration = Duration::from_secs(2);

/// A timer's context, boxed so that its address (the callbacks' value) never moves.
pub(super) struct Context {
    timer: usize,
    /// Owned here, read by the callbacks through the pointer in their value.
    _call: Box<TimerCall>,
    /// When its timer was deleted.
    retired: Option<Instant>,
}

/// The contexts of live timers and of recently deleted ones. Held across a fork by the engine's
/// fork handlers.
pub(super) static CONTEXTS: EngineLock<Vec<Context>> = EngineLock::new(Vec::new());

/// Keeps `call`, the context of the new timer `timer`, for its callbacks.
pub(super) fn keep(timer: usize, call: Box<TimerCall>) {
    let mut contexts = CONTEXTS.lock();
    forget_expired(&mut contexts);
    contexts.push(Context {
        timer,
        _call: call,
        retired: None,
    });
}

/// The timer `timer` was deleted: its context goes after the grace.
pub(super) fn retire(timer: usize) {
    let mut contexts = CONTEXTS.lock();
    let now = Instant::now();
    for c in contexts.iter_mut() {
        if c.timer == timer && c.retired.is_none() {
            c.retired = Some(now);
        }
    }
    forget_expired(&mut contexts);
}

fn forget_expired(contexts: &mut Vec<Context>) {
    contexts.retain(|c| c.retired.is_none_or(|at| at.elapsed() < GRACE));
}

/// The notify function glibc runs on each callback thread: the creator's placement first, as of
/// now, then the program's function with its value.
pub(super) extern "C" fn run_callback(value: libc::sigval) {
    // SAFETY: the value is a context `timers` boxed and [`keep`] holds; it stays allocated until at least
    // `GRACE` after its timer's deletion, and is never written after creation.
    let call = unsafe { &*(value.sival_ptr as *const TimerCall) };
    let (function, program_value) = (call.function, call.value);
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let worker_mask = (call.role == Role::Worker)
            .then(|| registry().lock().target().map(|t| t.mask.clone()))
            .flatten();
        let mask = worker_mask.unwrap_or_else(|| call.natural.clone());
        let _ = sys::set_mask(sys::gettid(), &mask);
    }));
    function(program_value)
}
