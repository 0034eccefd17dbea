//! The application's own `sched_setaffinity` / `pthread_setaffinity_np` calls, observed so that
//! the library never overrides them nor "restores" over them (SPEC §2, placement `explicit`).

use std::ffi::c_int;
use std::panic::catch_unwind;

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
    // SAFETY: the caller's own arguments, passed on unchanged.
    let rc = unsafe { real_set(pid, size, mask) };
    if rc == 0 {
        let errno = kernel::errno();
        let tid = if pid == 0 { kernel::gettid() } else { pid };
        record(
            || {
                let reg = registry().lock();
                if pid == 0 {
                    create::current_slot().filter(|&s| reg.entry(s).is_some())
                } else {
                    reg.find_tid(pid)
                }
            },
            tid,
        );
        kernel::set_errno(errno);
    }
    rc
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
    // SAFETY: the caller's own arguments, passed on unchanged.
    let rc = unsafe { real_set(thread, size, mask) };
    if rc == 0 {
        let errno = kernel::errno();
        let _ = catch_unwind(|| {
            if ensure_init() != State::Active {
                return;
            }
            let found = {
                let reg = registry().lock();
                reg.find_handle(thread)
                    .and_then(|s| reg.entry(s).map(|e| (s, e.tid)))
            };
            if let Some((slot, tid)) = found {
                record(|| Some(slot), tid);
            }
        });
        kernel::set_errno(errno);
    }
    rc
}

/// Marks the thread's placement `explicit` with the mask the kernel now holds (the request
/// intersected with what the cpuset allows).
fn record(find: impl FnOnce() -> Option<Slot> + std::panic::UnwindSafe, tid: i32) {
    let _ = catch_unwind(|| {
        if ensure_init() != State::Active {
            return;
        }
        let Some(slot) = find() else { return };
        if let Ok(actual) = kernel::get_mask(tid) {
            registry().lock().observe_explicit(slot, actual);
        }
    });
}
