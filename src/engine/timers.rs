//! `timer_create` with `SIGEV_THREAD`, interposed so that a timer's callback runs as the thread
//! that created the timer would have it (SPEC §2), not as glibc's helper thread happens to be.
//!
//! glibc starts one helper thread at the process's first `SIGEV_THREAD` timer, from whichever
//! thread creates it, and every later callback thread of every timer is that helper's child: so
//! when a worker created the first timer, a host's callbacks ran on the worker mask. Putting a
//! cpuset into the notify attributes would make each callback `explicit` and never restored, so
//! instead the notify function is wrapped: the callback thread first takes the mask of its
//! timer's creator — the worker mask while a lease is open if the creator was a worker, else the
//! creator's own mask without the library — then runs the program's function.
//!
//! The wrapper's context lives until `timer_delete`, and a little longer: a callback thread glibc
//! started just before the delete may not have read it yet.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use super::{create, ensure_init, in_own_process, lock_registry, real, registry, State};
use crate::lock::EngineLock;
use crate::registry::{Role, SharedMask};
use crate::sys;

pub type NotifyFunction = extern "C" fn(libc::sigval);
pub type TimerCreate =
    unsafe extern "C" fn(libc::clockid_t, *mut SigEvent, *mut libc::timer_t) -> c_int;
pub type TimerDelete = unsafe extern "C" fn(libc::timer_t) -> c_int;

/// glibc's `struct sigevent` (64 bytes on Linux), with the `SIGEV_THREAD` members of its union.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SigEvent {
    value: libc::sigval,
    signo: c_int,
    notify: c_int,
    function: Option<NotifyFunction>,
    attributes: *mut libc::pthread_attr_t,
    pad: [c_int; 8],
}

const _: () = assert!(std::mem::size_of::<SigEvent>() == 64);

/// What a callback needs: the program's function and value, and its timer creator's placement.
struct TimerCall {
    function: NotifyFunction,
    value: libc::sigval,
    role: Role,
    natural: SharedMask,
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

/// The interposed `timer_create`. Anything but a `SIGEV_THREAD` timer of a registered thread
/// passes through unchanged; so does everything when the library is not active.
///
/// # Safety
/// The arguments are those of `timer_create(2)`.
pub unsafe fn timer_create(
    clock: libc::clockid_t,
    event: *mut SigEvent,
    timer: *mut libc::timer_t,
) -> c_int {
    let Some(real_create) = real::timer_create() else {
        sys::set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: the caller's sigevent, when not null, is readable (timer_create(2)).
    let wanted = unsafe { event.as_ref() }
        .copied()
        .filter(|e| e.notify == libc::SIGEV_THREAD && e.function.is_some());
    let call = wanted.and_then(|e| {
        let function = e.function?;
        catch_unwind(AssertUnwindSafe(|| creator_call(function, e.value))).ok()?
    });
    let (Some(mut ours), Some(call)) = (wanted, call) else {
        // SAFETY: the caller's own arguments, passed on unchanged.
        return unsafe { real_create(clock, event, timer) };
    };
    let context = Box::new(call);
    ours.function = Some(run_callback);
    ours.value = libc::sigval {
        sival_ptr: &*context as *const TimerCall as *mut c_void,
    };
    // SAFETY: `ours` is a valid sigevent on this stack for the call; `timer` is the caller's.
    let rc = unsafe { real_create(clock, &mut ours, timer) };
    if rc == 0 {
        // SAFETY: on success glibc wrote the new timer's id through the caller's pointer.
        let id = unsafe { *timer } as usize;
        let errno = sys::errno();
        let mut contexts = CONTEXTS.lock();
        forget_expired(&mut contexts);
        contexts.push(Context {
            timer: id,
            _call: context,
            retired: None,
        });
        drop(contexts);
        sys::set_errno(errno);
    }
    rc
}

/// The interposed `timer_delete`: the real one, then the timer's context retired.
///
/// # Safety
/// The argument is that of `timer_delete(2)`.
pub unsafe fn timer_delete(timer: libc::timer_t) -> c_int {
    let Some(real_delete) = real::timer_delete() else {
        sys::set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: the caller's timer id, passed on unchanged.
    let rc = unsafe { real_delete(timer) };
    if rc == 0 && in_own_process() {
        let errno = sys::errno();
        let mut contexts = CONTEXTS.lock();
        let now = Instant::now();
        for c in contexts.iter_mut() {
            if c.timer == timer as usize && c.retired.is_none() {
                c.retired = Some(now);
            }
        }
        forget_expired(&mut contexts);
        drop(contexts);
        sys::set_errno(errno);
    }
    rc
}

fn forget_expired(contexts: &mut Vec<Context>) {
    contexts.retain(|c| c.retired.is_none_or(|at| at.elapsed() < GRACE));
}

/// The calling thread's role and natural mask, when the library knows it.
fn creator_call(function: NotifyFunction, value: libc::sigval) -> Option<TimerCall> {
    if ensure_init() != State::Active || !in_own_process() {
        return None;
    }
    let slot = create::current_slot()?;
    let reg = lock_registry();
    let creator = reg.entry(slot)?;
    Some(TimerCall {
        function,
        value,
        role: creator.role,
        natural: creator.natural.clone(),
    })
}

/// The notify function glibc runs on each callback thread: the creator's placement first, as of
/// now, then the program's function with its value.
extern "C" fn run_callback(value: libc::sigval) {
    // SAFETY: the value is a context this module made; it stays allocated until at least
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
