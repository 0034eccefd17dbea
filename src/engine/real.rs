//! The real libc functions behind our shims, found with `dlsym(RTLD_NEXT)` / `dlvsym`, and the C
//! types they take that the `libc` crate lacks.
//!
//! Resolution happens in the creating thread or at load, never inside a new thread's trampoline
//! (the loader lock may be held by whoever is creating it). `sched_setaffinity` and
//! `pthread_setaffinity_np` are asked for by version, the one [`crate::arch`] names for this
//! architecture: older x86_64 glibc hands `dlsym` callers the two-argument GLIBC_2.3.3 ABI.
//!
//! Two copies of the library in one process (`LD_PRELOAD=/a/lib.so:/b/lib.so`): the first in
//! the symbol search order acts, any later one finds at load that `tllm_affinity_version` is not
//! its own and stays inert ([`resolve_all`]). The acting copy's `RTLD_NEXT` would find the inert
//! copy's shims; what lies in another copy is asked of libc itself instead.

use std::ffi::{c_char, c_int, c_void, CStr};
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
pub type Dlclose = unsafe extern "C" fn(*mut c_void) -> c_int;
/// An `argv` or `envp`: a null-terminated array of NUL-terminated strings.
pub type Argv = *const *const c_char;
pub type Execve = unsafe extern "C" fn(*const c_char, Argv, Argv) -> c_int;
pub type Execv = unsafe extern "C" fn(*const c_char, Argv) -> c_int;
pub type Fexecve = unsafe extern "C" fn(c_int, Argv, Argv) -> c_int;
pub type System = unsafe extern "C" fn(*const c_char) -> c_int;
pub type Popen = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
pub type Setenv = unsafe extern "C" fn(*const c_char, *const c_char, c_int) -> c_int;
pub type Putenv = unsafe extern "C" fn(*mut c_char) -> c_int;
pub type Unsetenv = unsafe extern "C" fn(*const c_char) -> c_int;
pub type Clearenv = unsafe extern "C" fn() -> c_int;
pub type PthreadSetspecific = unsafe extern "C" fn(libc::pthread_key_t, *const c_void) -> c_int;
pub type CxaThreadAtexit =
    unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, *mut c_void) -> c_int;
pub type PosixSpawn = unsafe extern "C" fn(
    *mut libc::pid_t,
    *const c_char,
    *const libc::posix_spawn_file_actions_t,
    *const libc::posix_spawnattr_t,
    Argv,
    Argv,
) -> c_int;

pub type NotifyFunction = extern "C" fn(libc::sigval);
pub type TimerCreate =
    unsafe extern "C" fn(libc::clockid_t, *mut SigEvent, *mut libc::timer_t) -> c_int;
pub type TimerDelete = unsafe extern "C" fn(libc::timer_t) -> c_int;

/// glibc's `struct sigevent` (64 bytes on Linux), with the `SIGEV_THREAD` members of its union.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SigEvent {
    pub value: libc::sigval,
    signo: c_int,
    pub notify: c_int,
    pub function: Option<NotifyFunction>,
    attributes: *mut libc::pthread_attr_t,
    pad: [c_int; 8],
}

const _: () = assert!(std::mem::size_of::<SigEvent>() == 64);

static PTHREAD_CREATE: AtomicUsize = AtomicUsize::new(0);
static SCHED_SETAFFINITY: AtomicUsize = AtomicUsize::new(0);
static PTHREAD_SETAFFINITY: AtomicUsize = AtomicUsize::new(0);
static DLCLOSE: AtomicUsize = AtomicUsize::new(0);
static EXECVE: AtomicUsize = AtomicUsize::new(0);
static EXECV: AtomicUsize = AtomicUsize::new(0);
static EXECVP: AtomicUsize = AtomicUsize::new(0);
static EXECVPE: AtomicUsize = AtomicUsize::new(0);
static FEXECVE: AtomicUsize = AtomicUsize::new(0);
static POSIX_SPAWN: AtomicUsize = AtomicUsize::new(0);
static POSIX_SPAWNP: AtomicUsize = AtomicUsize::new(0);
static SYSTEM: AtomicUsize = AtomicUsize::new(0);
static POPEN: AtomicUsize = AtomicUsize::new(0);
static SETENV: AtomicUsize = AtomicUsize::new(0);
static PUTENV: AtomicUsize = AtomicUsize::new(0);
static UNSETENV: AtomicUsize = AtomicUsize::new(0);
static CLEARENV: AtomicUsize = AtomicUsize::new(0);
static TIMER_CREATE: AtomicUsize = AtomicUsize::new(0);
static TIMER_DELETE: AtomicUsize = AtomicUsize::new(0);
static PTHREAD_SETSPECIFIC: AtomicUsize = AtomicUsize::new(0);
static CXA_THREAD_ATEXIT: AtomicUsize = AtomicUsize::new(0);

/// The exported symbol every copy of the library defines, which names a copy.
const MARK: &CStr = c"tllm_affinity_version";

// Inlined, the known answer costs a load: every thread birth asks for `pthread_create`.
#[inline(always)]
fn resolve(cache: &AtomicUsize, name: &CStr, version: Option<&CStr>) -> usize {
    match cache.load(Ordering::Acquire) {
        0 => resolve_first(cache, name, version),
        known => known,
    }
}

#[cold]
#[inline(never)]
fn resolve_first(cache: &AtomicUsize, name: &CStr, version: Option<&CStr>) -> usize {
    // RTLD_NEXT asks for the next definition after this object, so never our own shim.
    let mut found = lookup(libc::RTLD_NEXT, name, version);
    let next_copy = object_of(lookup(libc::RTLD_NEXT, MARK, None));
    if found != 0 && next_copy != 0 && object_of(found) == next_copy {
        // The next definition is another copy's shim (the next object that defines our mark
        // defines this too): running it would hook every thread twice. Kept when glibc's own
        // objects do not answer: the inert copy passes every call through.
        found = Some(from_libc(name, version))
            .filter(|&f| f != 0)
            .unwrap_or(found);
    }
    cache.store(found, Ordering::Release);
    found
}

fn lookup(handle: *mut c_void, name: &CStr, version: Option<&CStr>) -> usize {
    // SAFETY: both names are NUL-terminated; `handle` is RTLD_NEXT, RTLD_DEFAULT or a live
    // handle from dlopen.
    (unsafe {
        match version {
            Some(v) => libc::dlvsym(handle, name.as_ptr(), v.as_ptr()),
            None => libc::dlsym(handle, name.as_ptr()),
        }
    }) as usize
}

/// The load address of the object that holds `addr`; 0 for none.
fn object_of(addr: usize) -> usize {
    if addr == 0 {
        return 0;
    }
    // SAFETY: an all-zero Dl_info is a valid value; dladdr only writes into it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr reads no memory at `addr`, it only looks the address up.
    let found = unsafe { libc::dladdr(addr as *const c_void, &mut info) };
    if found == 0 {
        0
    } else {
        info.dli_fbase as usize
    }
}

/// `name` from glibc's own objects, asked by handle so that no preloaded object answers: libc,
/// then libpthread and libdl for glibc before 2.34, which kept pthread_create and dlclose there.
fn from_libc(name: &CStr, version: Option<&CStr>) -> usize {
    for object in [c"libc.so.6", c"libpthread.so.0", c"libdl.so.2"] {
        // SAFETY: a NUL-terminated name; RTLD_NOLOAD only finds an object already loaded (glibc's
        // are never unloaded, so the handle is not closed).
        let handle = unsafe { libc::dlopen(object.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if handle.is_null() {
            continue;
        }
        let found = lookup(handle, name, version);
        if found != 0 {
            return found;
        }
    }
    0
}

pub fn pthread_create() -> Option<PthreadCreate> {
    let addr = resolve(&PTHREAD_CREATE, c"pthread_create", None);
    // SAFETY: a non-null address from dlsym for this name is glibc's pthread_create, whose ABI
    // is the declared type.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, PthreadCreate>(addr) })
}

/// Declares each resolver from its cache, its name, the version asked for (`None`: whatever
/// `dlsym` finds) and its type.
macro_rules! resolvers {
    ($($fn:ident, $cache:ident, $name:literal, $version:expr, $ty:ty;)*) => {$(
        pub fn $fn() -> Option<$ty> {
            let addr = resolve(&$cache, $name, $version);
            // SAFETY: a non-null address from dlsym (dlvsym, for a version) for this name is
            // glibc's function of that name (and version), whose ABI is the declared type.
            (addr != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(addr) })
        }
    )*};
}

// By version, the architecture's own (x86_64's older glibc hands `dlsym` callers a two-argument
// ABI; aarch64's glibc has none of x86_64's versions).
resolvers! {
    sched_setaffinity, SCHED_SETAFFINITY, c"sched_setaffinity",
        Some(crate::arch::AFFINITY_SYMBOL_VERSION), SchedSetaffinity;
    pthread_setaffinity_np, PTHREAD_SETAFFINITY, c"pthread_setaffinity_np",
        Some(crate::arch::AFFINITY_SYMBOL_VERSION), PthreadSetaffinity;
}

pub fn dlclose() -> Option<Dlclose> {
    let addr = resolve(&DLCLOSE, c"dlclose", None);
    // SAFETY: a non-null address from dlsym for this name is glibc's dlclose, whose ABI is the
    // declared type.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, Dlclose>(addr) })
}

/// What a shim returns when the real function it stands for cannot be found: -1 with `errno`
/// `ENOSYS`, as glibc's stubs for a missing function do.
pub fn not_found() -> c_int {
    crate::sys::set_errno(libc::ENOSYS);
    -1
}

/// Functions looked up by name alone, resolved at load: a `vfork` child (which may exec or set
/// its environment) must never enter the loader, nor a thread registering its exit destructors
/// while another thread's `dlopen` holds the loader lock.
macro_rules! by_name {
    ($($fn:ident, $cache:ident, $name:literal, $ty:ty;)*) => {
        resolvers! { $($fn, $cache, $name, None, $ty;)* }
    };
}

by_name! {
    setenv, SETENV, c"setenv", Setenv;
    putenv, PUTENV, c"putenv", Putenv;
    unsetenv, UNSETENV, c"unsetenv", Unsetenv;
    clearenv, CLEARENV, c"clearenv", Clearenv;
    execve, EXECVE, c"execve", Execve;
    execv, EXECV, c"execv", Execv;
    execvp, EXECVP, c"execvp", Execv;
    execvpe, EXECVPE, c"execvpe", Execve;
    fexecve, FEXECVE, c"fexecve", Fexecve;
    posix_spawn, POSIX_SPAWN, c"posix_spawn", PosixSpawn;
    posix_spawnp, POSIX_SPAWNP, c"posix_spawnp", PosixSpawn;
    system, SYSTEM, c"system", System;
    popen, POPEN, c"popen", Popen;
    timer_create, TIMER_CREATE, c"timer_create", TimerCreate;
    timer_delete, TIMER_DELETE, c"timer_delete", TimerDelete;
    pthread_setspecific, PTHREAD_SETSPECIFIC, c"pthread_setspecific", PthreadSetspecific;
    cxa_thread_atexit_impl, CXA_THREAD_ATEXIT, c"__cxa_thread_atexit_impl", CxaThreadAtexit;
}

/// Resolves everything up front, from the constructor, so that hooks rarely need the loader.
/// False when another copy of the library comes first in the symbol search order: this one
/// then stays inert, and the program's calls reach the other.
pub fn resolve_all() -> bool {
    pthread_create();
    sched_setaffinity();
    pthread_setaffinity_np();
    dlclose();
    execve();
    execv();
    execvp();
    execvpe();
    fexecve();
    posix_spawn();
    posix_spawnp();
    system();
    popen();
    setenv();
    putenv();
    unsetenv();
    clearenv();
    timer_create();
    timer_delete();
    pthread_setspecific();
    cxa_thread_atexit_impl();
    let first = object_of(lookup(libc::RTLD_DEFAULT, MARK, None));
    // Null when no copy is in the global scope (this one loaded RTLD_LOCAL): it acts.
    let acting = first == 0 || first == object_of(resolve_all as fn() -> bool as usize);
    if !acting {
        crate::log_debug!(
            "another copy of the library comes first in the search order: this one stays inert"
        );
    }
    acting
}

#[cfg(test)]
mod tests {
    /// glibc has both affinity functions at the version this architecture asks for: with a
    /// version it never had, `dlvsym` finds nothing and every program's own call under the
    /// library fails with ENOSYS.
    #[test]
    fn the_affinity_functions_resolve_at_this_architectures_version() {
        assert!(
            super::sched_setaffinity().is_some(),
            "sched_setaffinity@{:?} on {}",
            crate::arch::AFFINITY_SYMBOL_VERSION,
            crate::arch::NAME
        );
        assert!(
            super::pthread_setaffinity_np().is_some(),
            "pthread_setaffinity_np@{:?} on {}",
            crate::arch::AFFINITY_SYMBOL_VERSION,
            crate::arch::NAME
        );
    }
}
