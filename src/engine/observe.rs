//! The application's own `sched_setaffinity` / `pthread_setaffinity_np` calls, observed so that
//! the library never overrides them nor "restores" over them (SPEC §2, placement `explicit`).
//!
//! The real call runs under the registry lock: a `configure` sweeping the process holds that lock
//! while it reads a thread's mask and writes the worker mask, so the application's call can never
//! land between the two and be overwritten.

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::kernel;
use super::{create, ensure_init, real, registry, State};
use crate::registry::Slot;

/// # Safety
/// The arguments are those of `sched_setaffinity(2)`.
pub unsafe fn sched_setaffinity(
    pid: libc::pid_t,
    size: libc::size_t,
    mask: *const libc::cpu_set_t,
) -> c_int {
    let Some(real_set) = real::sched_setaffinity() else {
        kernel::set_errno(libc::ENOSYS);
        return -1;
    };
    let tid = if pid == 0 { kernel::gettid() } else { pid };
    let ok = observed(
        // SAFETY: the caller's own arguments, passed on unchanged.
        || unsafe { real_set(pid, size, mask) } == 0,
        |reg| {
            if pid == 0 {
                create::current_slot().filter(|&s| reg.entry(s).is_some())
            } else {
                reg.find_tid(pid)
            }
            .map(|s| (s, tid))
        },
    );
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
        |reg| {
            reg.find_handle(thread)
                .and_then(|s| reg.entry(s).map(|e| (s, e.tid)))
        },
    );
    rc
}

/// Runs `call` (the real function; true on success) and, when it succeeded, marks the thread
/// `find` names `explicit` with the mask the kernel now holds (the request intersected with what
/// the cpuset allows). Both happen under the registry lock once the library is active. `errno`
/// is the real call's. Returns whether the call succeeded.
fn observed(
    call: impl FnOnce() -> bool,
    find: impl FnOnce(&crate::registry::Registry) -> Option<(Slot, i32)>,
) -> bool {
    if ensure_init() != State::Active {
        return call();
    }
    let mut reg = registry().lock();
    if !call() {
        return false;
    }
    let errno = kernel::errno();
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if let Some((slot, tid)) = find(&reg) {
            if let Ok(actual) = kernel::get_mask(tid) {
                reg.observe_explicit(slot, actual);
            }
        }
    }));
    drop(reg);
    kernel::set_errno(errno);
    true
}
