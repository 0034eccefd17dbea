//! The pthread key that tells each registered thread its registry slot, and the thread's exit,
//! which the key's destructor sees on every way out (return, `pthread_exit`, cancellation).
//! Created at load, before the application's keys, so its destructor runs first in a round.

use std::ffi::c_void;
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicU32, Ordering};

use super::state::registry;
use crate::registry::Slot;

/// The pthread key whose value is `slot + 1` for every registered thread (with [`EXITING`] once
/// its exit was first seen); `u32::MAX` until created.
static THREAD_KEY: AtomicU32 = AtomicU32::new(u32::MAX);

/// Marks a key value whose destructor already ran once (see [`on_thread_exit`]).
const EXITING: usize = 1 << (usize::BITS - 1);

pub fn create_thread_key() -> bool {
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: `key` is a valid out-pointer; the destructor has the signature pthread expects.
    let rc = unsafe { libc::pthread_key_create(&mut key, Some(on_thread_exit)) };
    if rc == 0 {
        THREAD_KEY.store(key, Ordering::Release);
    }
    rc == 0
}

/// The calling thread's registry slot, if the library registered it.
pub fn current_slot() -> Option<Slot> {
    let key = THREAD_KEY.load(Ordering::Acquire);
    if key == u32::MAX {
        return None;
    }
    // SAFETY: `key` came from pthread_key_create and is never deleted.
    let value = unsafe { libc::pthread_getspecific(key) } as usize;
    (value & !EXITING).checked_sub(1).map(|s| s as Slot)
}

pub fn set_current_slot(slot: Slot) -> bool {
    let key = THREAD_KEY.load(Ordering::Acquire);
    // SAFETY: as in `current_slot`; the value is an integer, never dereferenced.
    key != u32::MAX
        && unsafe { libc::pthread_setspecific(key, (slot as usize + 1) as *const c_void) } == 0
}

/// The key's destructor. Other thread-specific-data destructors may run after ours in the same
/// round and create threads (SPEC §2: such a thread is its creator's child like any other), so
/// for a thread whose children differ from an unknown creator's (a worker) the first call only
/// sets the value again, marked [`EXITING`]: glibc then runs another round of destructors (it
/// allows `PTHREAD_DESTRUCTOR_ITERATIONS`, at least four), and the second call, after every
/// destructor of the first round, unregisters the thread. A host thread is unregistered at once:
/// a thread it creates after that is a host on its mask all the same, and its exit costs no
/// second round.
extern "C" fn on_thread_exit(value: *mut c_void) {
    let value = value as usize;
    let Some(slot) = (value & !EXITING).checked_sub(1) else {
        return;
    };
    if value & EXITING == 0 {
        let done = catch_unwind(|| registry().lock().thread_exiting(slot as Slot)).unwrap_or(false);
        if done {
            return;
        }
        let key = THREAD_KEY.load(Ordering::Acquire);
        // SAFETY: the key is ours and live; the value is an integer, never dereferenced.
        if unsafe { libc::pthread_setspecific(key, (value | EXITING) as *const c_void) } == 0 {
            return;
        }
    }
    let _ = catch_unwind(|| registry().lock().thread_exited(slot as Slot));
}
