//! The device variables as the program sets them (SPEC §4): `setenv`, `putenv`, `unsetenv` and
//! `clearenv` are interposed for them.
//!
//! Why interpose rather than `getenv` at `configure`: the program may set the environment while
//! another of its threads calls `configure` (Ray assigns `CUDA_VISIBLE_DEVICES` from Python while
//! its C++ threads run), and glibc's `setenv` may move `environ` under a concurrent `getenv`,
//! which then reads freed memory. A copy of the device variables, captured at load and kept up to
//! date by these shims from their arguments, is read under our own lock instead. It also tells a
//! dedicated worker process (`TLLM_AFFINITY_PROCESS_ROLE=worker`) the moment the program changes
//! which GPU it has, so its worker threads follow: Python's `os.environ[...] =` is libc `setenv`
//! (and `del` is `unsetenv`), which is how Ray, `torch.multiprocessing` recipes and scripts set it.
//!
//! Each shim makes the real call first and acts only after it returned 0, with `errno` as the
//! real call left it; in a `vfork` or `clone(CLONE_VM)` child (its pid is not ours, though it
//! shares our memory) it only makes the real call. Names other than the device variables cost one
//! comparison per variable.

use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use super::configure::configure_for;
use super::kernel::Kernel;
use super::state::{in_own_process, lock_registry, state, State};
use crate::lock::EngineLock;
use crate::placement::device::{DeviceEnv, LOCAL_RANK_VARS};
use crate::registry::LeaseKind;
use crate::sys;
use crate::{log_debug, log_warn};

/// The variables that decide which GPU a device number (or `-1`) means.
const CUDA_VARS: [&str; 3] = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "TLLM_AFFINITY_GPU",
];

fn tracked(name: &[u8]) -> Option<&'static str> {
    CUDA_VARS
        .iter()
        .chain(LOCAL_RANK_VARS.iter())
        .copied()
        .find(|v| v.as_bytes() == name)
}

/// The device variables as they are now; empty until [`capture`] ran at load.
static SHADOW: EngineLock<Vec<(&'static str, Option<String>)>> = EngineLock::new(Vec::new());
static CAPTURED: AtomicBool = AtomicBool::new(false);

/// For the engine's fork handlers.
pub fn shadow_lock() -> &'static EngineLock<Vec<(&'static str, Option<String>)>> {
    &SHADOW
}

/// Reads the device variables from the environment, at load (before any thread of the program
/// can be setting it through our shims).
pub fn capture() {
    let values = CUDA_VARS
        .iter()
        .chain(LOCAL_RANK_VARS.iter())
        .map(|&name| {
            let value = std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
            (name, value)
        })
        .collect();
    *SHADOW.lock() = values;
    CAPTURED.store(true, Ordering::Release);
}

/// The device variables as the program last set them (the environment itself before load).
pub fn device_env() -> DeviceEnv {
    if !CAPTURED.load(Ordering::Acquire) {
        return DeviceEnv::from_env();
    }
    let values = SHADOW.lock().clone();
    DeviceEnv::from_lookup(|name| {
        values
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.clone())
    })
}

/// Records `name = value` (`None`: unset); `keep` is `setenv`'s `overwrite == 0`, where a value
/// already set stays. True when the value changed.
fn record(name: &'static str, value: Option<String>, keep: bool) -> bool {
    let mut shadow = SHADOW.lock();
    let Some(slot) = shadow.iter_mut().find(|(n, _)| *n == name) else {
        return false;
    };
    if keep && slot.1.is_some() {
        return false;
    }
    let changed = slot.1 != value;
    slot.1 = value;
    changed
}

/// Whether this call, made after the real one succeeded, should be acted on: not before the
/// library is active (the copy made at load will see the value), not in a child sharing our
/// memory, and not on a thread that is already inside the library holding one of its locks (a
/// signal handler that interrupted it: waiting for that lock would wait forever).
fn acting() -> bool {
    state() == State::Active
        && CAPTURED.load(Ordering::Acquire)
        && in_own_process()
        && !crate::lock::held_by_this_thread()
}

/// After a successful real call: `changes` are the tracked variables it set or unset.
fn after(changes: impl FnOnce() -> Vec<(&'static str, Option<String>, bool)>) {
    if !acting() {
        return;
    }
    let saved = sys::errno();
    // Fails open like every entry point: the program's setenv already happened.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let mut changed = Vec::new();
        for (name, value, keep) in changes() {
            if record(name, value.clone(), keep) {
                changed.push((name, value));
            }
        }
        if !changed.is_empty() {
            follow(&changed);
        }
    }));
    sys::set_errno(saved);
}

fn name_of(ptr: *const c_char) -> Option<&'static str> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: a non-null name passed to setenv/unsetenv is a NUL-terminated string, and the real
    // call that just returned 0 read it the same way.
    tracked(unsafe { CStr::from_ptr(ptr) }.to_bytes())
}

fn text_of(ptr: *const c_char) -> String {
    // SAFETY: setenv's value is a NUL-terminated string the real call has just copied.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// # Safety
/// The arguments are those of `setenv(3)`.
pub unsafe fn setenv(name: *const c_char, value: *const c_char, overwrite: c_int) -> c_int {
    let Some(real_setenv) = super::real::setenv() else {
        return super::real::not_found();
    };
    // SAFETY: the caller's arguments, passed on unchanged.
    let rc = unsafe { real_setenv(name, value, overwrite) };
    if rc == 0 && !value.is_null() {
        after(|| match name_of(name) {
            Some(var) => vec![(var, Some(text_of(value)), overwrite == 0)],
            None => Vec::new(),
        });
    }
    rc
}

/// # Safety
/// The argument is that of `putenv(3)`.
pub unsafe fn putenv(string: *mut c_char) -> c_int {
    let Some(real_putenv) = super::real::putenv() else {
        return super::real::not_found();
    };
    // SAFETY: the caller's argument, passed on unchanged.
    let rc = unsafe { real_putenv(string) };
    if rc == 0 && !string.is_null() {
        after(|| {
            // SAFETY: putenv's argument is a NUL-terminated string the caller keeps alive.
            let text = unsafe { CStr::from_ptr(string) }.to_bytes();
            // glibc: "NAME=value" sets, a bare "NAME" unsets.
            let (name, value) = match text.iter().position(|&b| b == b'=') {
                Some(i) => (
                    &text[..i],
                    Some(String::from_utf8_lossy(&text[i + 1..]).into_owned()),
                ),
                None => (text, None),
            };
            match tracked(name) {
                Some(var) => vec![(var, value, false)],
                None => Vec::new(),
            }
        });
    }
    rc
}

/// # Safety
/// The argument is that of `unsetenv(3)`.
pub unsafe fn unsetenv(name: *const c_char) -> c_int {
    let Some(real_unsetenv) = super::real::unsetenv() else {
        return super::real::not_found();
    };
    // SAFETY: the caller's argument, passed on unchanged.
    let rc = unsafe { real_unsetenv(name) };
    if rc == 0 {
        after(|| match name_of(name) {
            Some(var) => vec![(var, None, false)],
            None => Vec::new(),
        });
    }
    rc
}

/// # Safety
/// As `clearenv(3)`.
pub unsafe fn clearenv() -> c_int {
    let Some(real_clearenv) = super::real::clearenv() else {
        return super::real::not_found();
    };
    // SAFETY: no arguments.
    let rc = unsafe { real_clearenv() };
    if rc == 0 {
        after(|| {
            CUDA_VARS
                .iter()
                .chain(LOCAL_RANK_VARS.iter())
                .map(|&var| (var, None, false))
                .collect()
        });
    }
    rc
}

/// The lease a dedicated worker process was configured with at load, while it follows the device
/// variables; 0 when there is none (not a dedicated worker, or the program released it: the
/// program decides from then on).
static DEDICATED: AtomicI64 = AtomicI64::new(0);
/// A retarget is running / another change arrived meanwhile: changes from several threads are
/// applied one after another, without a lock held across the engine's own locks.
static BUSY: AtomicBool = AtomicBool::new(false);
static AGAIN: AtomicBool = AtomicBool::new(false);

/// Called by the load-time configure of a dedicated worker with its lease.
pub fn note_dedicated_lease(lease: i64) {
    DEDICATED.store(lease, Ordering::Release);
}

/// In a fork child: a retarget the parent was running is not running here.
pub fn after_fork_child() {
    BUSY.store(false, Ordering::Release);
}

fn follow(changed: &[(&'static str, Option<String>)]) {
    if DEDICATED.load(Ordering::Acquire) <= 0 {
        return;
    }
    for (name, value) in changed {
        match value {
            Some(v) => log_debug!("{name} set to '{v}': the dedicated worker follows it"),
            None => log_debug!("{name} unset: the dedicated worker follows it"),
        }
    }
    AGAIN.store(true, Ordering::Release);
    while AGAIN.load(Ordering::Acquire) {
        if BUSY.swap(true, Ordering::AcqRel) {
            // The thread retargeting now sees AGAIN and runs once more with the new values.
            return;
        }
        AGAIN.store(false, Ordering::Release);
        retarget_dedicated();
        BUSY.store(false, Ordering::Release);
    }
}

/// Opens a lease for the device the variables now name, for the main thread as at load, then
/// releases the previous one (not the last, so nothing is restored in between): the worker
/// threads move at once from the old GPU's set to the new one, and the log says so.
fn retarget_dedicated() {
    let old = DEDICATED.load(Ordering::Acquire);
    if old <= 0 {
        return;
    }
    if !lock_registry().leases().iter().any(|l| l.id == old) {
        // The program released the load-time lease itself: its own configure calls decide now.
        DEDICATED.store(0, Ordering::Release);
        return;
    }
    let pid = sys::getpid();
    let Some(main) = lock_registry().find_tid(pid) else {
        return;
    };
    // As at load, without NVML: the call may come from a library's constructor, under the
    // loader lock, where NVML must not be loaded.
    let lease = configure_for(main, -1, LeaseKind::Configure, false, device_env());
    if lease < 0 {
        let target = lock_registry().target().map(|t| t.device.clone());
        log_warn!(
            "TLLM_AFFINITY_PROCESS_ROLE=worker: the device variables changed but name no usable GPU; worker threads stay on {}",
            target.as_deref().unwrap_or("their masks")
        );
        return;
    }
    let _ = lock_registry().release(old, &Kernel);
    DEDICATED.store(lease, Ordering::Release);
    log_debug!("TLLM_AFFINITY_PROCESS_ROLE=worker: following the device variables (lease {lease})");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_device_variables_are_tracked() {
        assert_eq!(
            tracked(b"CUDA_VISIBLE_DEVICES"),
            Some("CUDA_VISIBLE_DEVICES")
        );
        assert_eq!(tracked(b"SLURM_LOCALID"), Some("SLURM_LOCALID"));
        assert_eq!(tracked(b"LOCAL_RANK"), Some("LOCAL_RANK"));
        assert_eq!(tracked(b"CUDA_VISIBLE_DEVICE"), None);
        assert_eq!(tracked(b"PATH"), None);
    }
}
