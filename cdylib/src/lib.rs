//! `libtllm_affinity.so`: the exported C ABI (SPEC §7) and the interposed libc functions.
//!
//! Every function here only translates arguments and calls the engine in
//! `tllm_affinity_core::engine`; the rules live there. All symbols are exported unversioned.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_int, c_void, CStr};

use tllm_affinity_core::engine::{
    self, create, environ, exec, objects, observe,
    real::{SigEvent, StartRoutine},
    thread_key, timers,
};

#[ctor::ctor(unsafe)]
fn load() {
    engine::ensure_init();
    // Fails open: a panic here must not reach the loader.
    let _ = std::panic::catch_unwind(engine::pyhook::at_load);
}

/// # Safety
/// Called by the program as `pthread_create(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: Option<StartRoutine>,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: the caller's arguments, forwarded unchanged.
    unsafe { create::pthread_create(thread, attr, start, arg) }
}

/// # Safety
/// Called by the program as `pthread_setspecific(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_setspecific(
    key: libc::pthread_key_t,
    value: *const c_void,
) -> c_int {
    // SAFETY: the caller's arguments, forwarded unchanged.
    unsafe { thread_key::pthread_setspecific(key, value) }
}

/// # Safety
/// Called by the C++ runtime (and Rust's std) as glibc's `__cxa_thread_atexit_impl`.
#[no_mangle]
pub unsafe extern "C" fn __cxa_thread_atexit_impl(
    dtor: unsafe extern "C" fn(*mut c_void),
    obj: *mut c_void,
    dso: *mut c_void,
) -> c_int {
    // SAFETY: the caller's arguments, forwarded unchanged.
    unsafe { thread_key::cxa_thread_atexit_impl(dtor, obj, dso) }
}

/// Declares each interposed function that only hands its arguments to the engine: exported
/// unmangled, its doc (a `# Safety` section) as given, its one unsafe call forwarding the
/// caller's arguments unchanged.
macro_rules! forward {
    ($(
        $(#[doc = $doc:literal])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $call:expr;
    )*) => {$(
        $(#[doc = $doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: the caller's arguments, forwarded unchanged under the contract the
            // function's `# Safety` section states.
            unsafe { $call }
        }
    )*};
}

type Argv = *const *const c_char;
type SpawnActions = *const libc::posix_spawn_file_actions_t;
type SpawnAttr = *const libc::posix_spawnattr_t;

forward! {
    /// # Safety
    /// Called by the program as `sched_setaffinity(2)`.
    fn sched_setaffinity(pid: libc::pid_t, size: libc::size_t, mask: *const libc::cpu_set_t)
        -> c_int = observe::sched_setaffinity(pid, size, mask);
    /// # Safety
    /// Called by the program as `pthread_setaffinity_np(3)`.
    fn pthread_setaffinity_np(
        thread: libc::pthread_t, size: libc::size_t, mask: *const libc::cpu_set_t,
    ) -> c_int = observe::pthread_setaffinity_np(thread, size, mask);
    /// # Safety
    /// Called by the program as `dlclose(3)`.
    fn dlclose(handle: *mut c_void) -> c_int = objects::dlclose(handle);
    /// # Safety
    /// Called by the program as `timer_create(2)`.
    fn timer_create(clock: libc::clockid_t, event: *mut SigEvent, timer: *mut libc::timer_t)
        -> c_int = timers::timer_create(clock, event, timer);
    /// # Safety
    /// Called by the program as `timer_delete(2)`.
    fn timer_delete(timer: libc::timer_t) -> c_int = timers::timer_delete(timer);
    /// # Safety
    /// Called by the program as `execve(2)`.
    fn execve(path: *const c_char, argv: Argv, envp: Argv)
        -> c_int = exec::execve(path, argv, envp);
    /// # Safety
    /// Called by the program as `execv(3)`.
    fn execv(path: *const c_char, argv: Argv) -> c_int = exec::execv(path, argv);
    /// # Safety
    /// Called by the program as `execvp(3)`.
    fn execvp(file: *const c_char, argv: Argv) -> c_int = exec::execvp(file, argv);
    /// # Safety
    /// Called by the program as `execvpe(3)`.
    fn execvpe(file: *const c_char, argv: Argv, envp: Argv)
        -> c_int = exec::execvpe(file, argv, envp);
    /// # Safety
    /// Called by the program as `fexecve(3)`.
    fn fexecve(fd: c_int, argv: Argv, envp: Argv) -> c_int = exec::fexecve(fd, argv, envp);
    /// # Safety
    /// Called by the program as `posix_spawn(3)`.
    fn posix_spawn(
        pid: *mut libc::pid_t, path: *const c_char, actions: SpawnActions, attr: SpawnAttr,
        argv: Argv, envp: Argv,
    ) -> c_int = exec::posix_spawn(false, pid, path, actions, attr, argv, envp);
    /// # Safety
    /// Called by the program as `posix_spawnp(3)`.
    fn posix_spawnp(
        pid: *mut libc::pid_t, file: *const c_char, actions: SpawnActions, attr: SpawnAttr,
        argv: Argv, envp: Argv,
    ) -> c_int = exec::posix_spawn(true, pid, file, actions, attr, argv, envp);
    /// # Safety
    /// Called by the program as `system(3)`.
    fn system(command: *const c_char) -> c_int = exec::system(command);
    /// # Safety
    /// Called by the program as `popen(3)`.
    fn popen(command: *const c_char, mode: *const c_char)
        -> *mut libc::FILE = exec::popen(command, mode);
    /// # Safety
    /// Called by the program as `setenv(3)`.
    fn setenv(name: *const c_char, value: *const c_char, overwrite: c_int)
        -> c_int = environ::setenv(name, value, overwrite);
    /// # Safety
    /// Called by the program as `putenv(3)`.
    fn putenv(string: *mut c_char) -> c_int = environ::putenv(string);
    /// # Safety
    /// Called by the program as `unsetenv(3)`.
    fn unsetenv(name: *const c_char) -> c_int = environ::unsetenv(name);
    /// # Safety
    /// Called by the program as `clearenv(3)`.
    fn clearenv() -> c_int = environ::clearenv();
}

// The library's own C API (SPEC §7). Each body runs under `engine::fail_open`: a panic in the
// library answers an error code, never aborts the host (tests/resources.rs checks every export).

#[no_mangle]
pub extern "C" fn tllm_affinity_configure(device_id: i32) -> i64 {
    engine::fail_open(-EFAULT64, || engine::configure(device_id))
}

#[no_mangle]
pub extern "C" fn tllm_affinity_begin_worker_scope(device_id: i32) -> i64 {
    engine::fail_open(-EFAULT64, || engine::begin_worker_scope(device_id))
}

#[no_mangle]
pub extern "C" fn tllm_affinity_end_worker_scope(lease: i64) -> i32 {
    engine::fail_open(-libc::EFAULT, || engine::end_worker_scope(lease))
}

#[no_mangle]
pub extern "C" fn tllm_affinity_release(lease: i64) -> i32 {
    engine::fail_open(-libc::EFAULT, || engine::release(lease))
}

#[no_mangle]
pub extern "C" fn tllm_affinity_role(tid: i32) -> i32 {
    engine::fail_open(-libc::EFAULT, || engine::role(tid))
}

#[no_mangle]
pub extern "C" fn tllm_affinity_pin_step_thread(device_id: i32) -> i32 {
    engine::fail_open(-libc::EFAULT, || {
        engine::pin_step_or_result(device_id, false)
    })
}

#[no_mangle]
pub extern "C" fn tllm_affinity_pin_result_thread(device_id: i32) -> i32 {
    engine::fail_open(-libc::EFAULT, || {
        engine::pin_step_or_result(device_id, true)
    })
}

/// Records what a language adapter did (the report's `adapters`).
///
/// # Safety
/// `adapter` and `state` are null or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn tllm_affinity_note_adapter(
    adapter: *const c_char,
    state: *const c_char,
) -> i32 {
    engine::fail_open(-libc::EFAULT, || {
        // SAFETY: the caller's strings, under the contract above.
        unsafe { with_strings(adapter, state, engine::note_adapter) }
    })
}

/// Records one line of detail for an adapter that noted its state (the report's
/// `adapter_details`).
///
/// # Safety
/// `adapter` and `detail` are null or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn tllm_affinity_note_adapter_detail(
    adapter: *const c_char,
    detail: *const c_char,
) -> i32 {
    engine::fail_open(-libc::EFAULT, || {
        // SAFETY: the caller's strings, under the contract above.
        unsafe { with_strings(adapter, detail, engine::note_adapter_detail) }
    })
}

/// Writes the JSON report into `buf` like `snprintf`: at most `len - 1` bytes and a NUL, and
/// returns the length the whole report needs.
///
/// # Safety
/// `buf` is null or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tllm_affinity_report(buf: *mut c_char, len: u64) -> i64 {
    engine::fail_open(-EFAULT64, || {
        let json = engine::report_json();
        if !buf.is_null() && len > 0 {
            let n = json.len().min(len as usize - 1);
            // SAFETY: the caller promises `len` writable bytes at `buf`; we write
            // `n + 1 <= len`.
            unsafe {
                std::ptr::copy_nonoverlapping(json.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        json.len() as i64
    })
}

/// `-EFAULT` for the entry points that answer 64 bits.
const EFAULT64: i64 = libc::EFAULT as i64;

/// `call` with the bytes of two C strings, or `-EINVAL` when either is null.
///
/// # Safety
/// `a` and `b` are null or NUL-terminated strings.
unsafe fn with_strings(a: *const c_char, b: *const c_char, call: fn(&[u8], &[u8]) -> i32) -> i32 {
    if a.is_null() || b.is_null() {
        return -libc::EINVAL;
    }
    // SAFETY: both are non-null and, per the contract, NUL-terminated.
    let (a, b) = unsafe { (CStr::from_ptr(a), CStr::from_ptr(b)) };
    call(a.to_bytes(), b.to_bytes())
}

#[no_mangle]
pub extern "C" fn tllm_affinity_version() -> *const c_char {
    engine::fail_open(std::ptr::null(), || {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
    })
}
