//! At load, a library that brings its own Python start-up hook beside it (the container layout
//! of `tllm-affinity cdi`: `/opt/tllm-affinity/libtllm_affinity.so` and
//! `/opt/tllm-affinity/python/`) puts the hook in front of `PYTHONPATH`, keeping the image's own
//! entries ([`crate::handoff::pyhook::python_path_at_load`] decides). Every process of the container loads
//! the library through `/etc/ld.so.preload`, so every interpreter reads the variable after this
//! ran, and its children inherit it.

use std::ffi::{c_int, c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use super::init::alone;
use super::report;
use super::state::{state, State};
use crate::handoff::pyhook;

/// Called once from the library's constructor, after initialisation.
pub fn at_load() {
    if state() != State::Active {
        return;
    }
    let Some(library) = own_file() else { return };
    let existing = std::env::var_os("PYTHONPATH");
    let switch = std::env::var_os(pyhook::SWITCH);
    if !switch.as_deref().is_some_and(pyhook::switched_off) && interpreter_yet_to_start() {
        report::watch_interpreter(interpreter_started);
    }
    // Decided first: on a host (no hook beside the library) this is one stat, and nothing more.
    let Some(value) =
        pyhook::python_path_at_load(Path::new(&library), existing.as_deref(), switch.as_deref())
    else {
        return;
    };
    if alone() {
        std::env::set_var("PYTHONPATH", value);
    }
}

/// The file this library was loaded from, as the loader names it.
fn own_file() -> Option<std::ffi::OsString> {
    // SAFETY: a zeroed Dl_info is a valid out-parameter; dladdr only reads the address (a
    // function of this object) and fills the struct. The name it points to belongs to the loader
    // and lives as long as the object, which is loaded for the process's life; it is copied at once.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let here = at_load as fn() as *const c_void;
        if libc::dladdr(here, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(OsStr::from_bytes(CStr::from_ptr(info.dli_fname).to_bytes()).to_os_string())
    }
}

/// CPython's `int Py_IsInitialized(void)`, found at load.
type IsInitialized = unsafe extern "C" fn() -> c_int;
static IS_INITIALIZED: OnceLock<IsInitialized> = OnceLock::new();

/// Whether the program has CPython's API in its global symbol scope (the `python` executable,
/// static or shared; a program linked to libpython) and its interpreter has not started yet.
/// Called once, from the constructor, on the only thread.
fn interpreter_yet_to_start() -> bool {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads the loader's tables;
    // the constructor runs before the program's code, on one thread, outside any trampoline.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"Py_IsInitialized".as_ptr()) };
    if found.is_null() {
        return false;
    }
    // SAFETY: the symbol is CPython's `int Py_IsInitialized(void)`, a function of that type.
    let function = unsafe { std::mem::transmute::<*mut c_void, IsInitialized>(found) };
    let _ = IS_INITIALIZED.set(function);
    !interpreter_started()
}

/// `Py_IsInitialized()`: it reads one word of the runtime's state, safe from any thread at any
/// time (before, during and after the interpreter's life).
fn interpreter_started() -> bool {
    // SAFETY: set only to CPython's `Py_IsInitialized`, which takes nothing and only reads.
    IS_INITIALIZED
        .get()
        .is_some_and(|function| unsafe { function() } != 0)
}
