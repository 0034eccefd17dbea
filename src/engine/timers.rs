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
//! The wrapper and the context it reads live in [`super::timer_calls`].

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::init::ensure_init;
use super::real::{self, NotifyFunction, SigEvent};
use super::state::{in_own_process, lock_registry, State};
use super::thread_key::current_slot;
use super::timer_calls::{self, TimerCall};
use crate::sys;

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
        return real::not_found();
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
    ours.function = Some(timer_calls::run_callback);
    ours.value = libc::sigval {
        sival_ptr: &*context as *const TimerCall as *mut c_void,
    };
    // SAFETY: `ours` is a valid sigevent on this stack for the call; `timer` is the caller's.
    let rc = unsafe { real_create(clock, &mut ours, timer) };
    if rc == 0 {
        // SAFETY: on success glibc wrote the new timer's id through the caller's pointer.
        let id = unsafe { *timer } as usize;
        let errno = sys::errno();
        timer_calls::keep(id, context);
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
        return real::not_found();
    };
    // SAFETY: the caller's timer id, passed on unchanged.
    let rc = unsafe { real_delete(timer) };
    if rc == 0 && in_own_process() {
        let errno = sys::errno();
        timer_calls::retire(timer as usize);
        sys::set_errno(errno);
    }
    rc
}

/// The calling thread's role and natural mask, when the library knows it.
fn creator_call(function: NotifyFunction, value: libc::sigval) -> Option<TimerCall> {
    if ensure_init() != State::Active || !in_own_process() {
        return None;
    }
    let slot = current_slot()?;
    let reg = lock_registry();
    let creator = reg.entry(slot)?;
    Some(TimerCall {
        function,
        value,
        role: creator.role,
        natural: creator.natural.clone(),
    })
}
