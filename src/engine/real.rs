//! The real libc functions behind our shims, found with `dlsym(RTLD_NEXT)` / `dlvsym`.
//!
//! Resolution happens in the creating thread or at load, never inside a new thread's trampoline
//! (the loader lock may be held by whoever is creating it). `sched_setaffinity` and
//! `pthread_setaffinity_np` are asked for by version: older glibc hands `dlsym` callers the
//! two-argument GLIBC_2.3.3 ABI.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

pub type StartRoutine = extern "C" fn(*mut c_void) -> *mut c_void;
pub type PthreadCreate = unsafe extern "C" fn(
    *mut libc::pthread_t,
    *const libc::pthread_attr_t,
    Option<StartRoutine>,
    *mut c_void,
) -> c_int;
pub type SchedSetaffinity =
    unsafe extern "C" fn(libc::pid_t, libc::size_t, *const libc::cpu_set_t) -> c_int;
pub type PthreadSetaffinity =
    unsafe extern "C" fn(libc::pthread_t, libc::size_t, *const libc::cpu_set_t) -> c_int;

static PTHREAD_CREATE: AtomicUsize = AtomicUsize::new(0);
static SCHED_SETAFFINITY: AtomicUsize = AtomicUsize::new(0);
static PTHREAD_SETAFFINITY: AtomicUsize = AtomicUsize::new(0);

fn resolve(cache: &AtomicUsize, name: &CStr, version: Option<&CStr>) -> usize {
    let known = cache.load(Ordering::Acquire);
    if known != 0 {
        return known;
    }
    // SAFETY: both names are NUL-terminated; RTLD_NEXT asks for the next definition after this
    // object, so it never returns our own shim.
    let found = unsafe {
        match version {
            Some(v) => libc::dlvsym(libc::RTLD_NEXT, name.as_ptr(), v.as_ptr()),
            None => libc::dlsym(libc::RTLD_NEXT, name.as_ptr()),
        }
    } as usize;
    cache.store(found, Ordering::Release);
    found
}

pub fn pthread_create() -> Option<PthreadCreate> {
    let addr = resolve(&PTHREAD_CREATE, c"pthread_create", None);
    // SAFETY: a non-null address from dlsym for this name is glibc's pthread_create, whose ABI
    // is the declared type.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, PthreadCreate>(addr) })
}

pub fn sched_setaffinity() -> Option<SchedSetaffinity> {
    let addr = resolve(
        &SCHED_SETAFFINITY,
        c"sched_setaffinity",
        Some(c"GLIBC_2.3.4"),
    );
    // SAFETY: the GLIBC_2.3.4 version of sched_setaffinity has the declared three-argument ABI.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, SchedSetaffinity>(addr) })
}

pub fn pthread_setaffinity_np() -> Option<PthreadSetaffinity> {
    let addr = resolve(
        &PTHREAD_SETAFFINITY,
        c"pthread_setaffinity_np",
        Some(c"GLIBC_2.3.4"),
    );
    // SAFETY: the GLIBC_2.3.4 version of pthread_setaffinity_np has the declared ABI.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, PthreadSetaffinity>(addr) })
}

/// Resolves everything up front, from the constructor, so that hooks rarely need the loader.
pub fn resolve_all() {
    pthread_create();
    sched_setaffinity();
    pthread_setaffinity_np();
}
