//! Each registered thread's registry slot (a plain TLS word) and its exit bookkeeping.
//!
//! A thread the trampoline started is unregistered when its routine ends ([`routine_ended`], run
//! by the trampoline on return and by its cleanup buffer on `pthread_exit` and cancellation).
//! Code of the thread can still run after that only in destructors it registered itself: the
//! shims of `pthread_setspecific` and `__cxa_thread_atexit_impl` mark such a thread, and for it
//! (and for every thread the library did not start: the main thread, threads first seen in a
//! call) the pthread key is armed instead, whose destructor unregisters the thread after them.
//! The key is created at load, before the application's keys, so its destructor runs first in a
//! round.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};

use super::real;
use super::state::registry;
use crate::per_thread::{self, PerThread};
use crate::registry::Slot;

/// The pthread key whose value is `slot + 1` for a registered thread whose exit the key's
/// destructor sees (with [`EXITING`] once its exit was first seen); `u32::MAX` until created.
static THREAD_KEY: AtomicU32 = AtomicU32::new(u32::MAX);

/// Marks a key value whose destructor already ran once (see [`on_thread_exit`]).
const EXITING: usize = 1 << (usize::BITS - 1);

// A thread's `registry_word` (crate::per_thread): its registry slot plus one (0: none) in the low
// bits, with the two flags below.

/// The trampoline does this thread's exit bookkeeping when its routine ends.
const BY_TRAMPOLINE: usize = 1 << (usize::BITS - 1);
/// The thread registered a destructor of its own (non-null thread-specific data or a
/// `thread_local` destructor): code of it may run after its routine ended.
const HAS_DESTRUCTORS: usize = 1 << (usize::BITS - 2);
const SLOT_BITS: usize = !(BY_TRAMPOLINE | HAS_DESTRUCTORS);

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
    per_thread::with(slot_of)
}

/// The registry slot of the thread whose block `me` is.
pub fn slot_of(me: &PerThread) -> Option<Slot> {
    (me.registry_word.get() & SLOT_BITS)
        .checked_sub(1)
        .map(|s| s as Slot)
}

/// Records `slot` as the calling thread's, whose exit the key's destructor will see (a thread
/// the trampoline did not start, or one it started that registered again).
pub fn set_current_slot(slot: Slot) -> bool {
    per_thread::with(|t| {
        let word = &t.registry_word;
        word.set((word.get() & HAS_DESTRUCTORS) | (slot as usize + 1));
    });
    arm_key((slot as usize + 1) as *const c_void)
}

/// Sets the library's key to `value` through the real `pthread_setspecific` (our shim would take
/// the library's own key for a destructor of the program's).
fn arm_key(value: *const c_void) -> bool {
    let key = THREAD_KEY.load(Ordering::Acquire);
    let Some(set) = real::pthread_setspecific() else {
        return false;
    };
    // SAFETY: the key came from pthread_key_create and is never deleted; the value is an
    // integer, never dereferenced.
    key != u32::MAX && unsafe { set(key, value) } == 0
}

/// The shims of `pthread_setspecific` (with a non-null value) and `__cxa_thread_atexit_impl`:
/// this thread now has a destructor of its own, which runs after its routine and may create
/// threads or set masks, so its entry must outlive it.
pub fn note_own_destructor() {
    per_thread::with(|t| t.registry_word.set(t.registry_word.get() | HAS_DESTRUCTORS));
}

/// The interposed `pthread_setspecific`: the real one, after noting a destructor to come.
///
/// # Safety
/// The arguments are those of `pthread_setspecific(3)`.
pub unsafe fn pthread_setspecific(key: libc::pthread_key_t, value: *const c_void) -> c_int {
    if !value.is_null() {
        note_own_destructor();
    }
    match real::pthread_setspecific() {
        // SAFETY: the caller's arguments, passed on unchanged.
        Some(set) => unsafe { set(key, value) },
        None => libc::EINVAL,
    }
}

/// The interposed `__cxa_thread_atexit_impl` (C++ and Rust `thread_local` destructors).
///
/// # Safety
/// The arguments are those of glibc's `__cxa_thread_atexit_impl`.
pub unsafe fn cxa_thread_atexit_impl(
    dtor: unsafe extern "C" fn(*mut c_void),
    obj: *mut c_void,
    dso: *mut c_void,
) -> c_int {
    note_own_destructor();
    match real::cxa_thread_atexit_impl() {
        // SAFETY: the caller's arguments, passed on unchanged.
        Some(register) => unsafe { register(dtor, obj, dso) },
        None => -1,
    }
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
        if !done && arm_key((value | EXITING) as *const c_void) {
            return;
        }
        if done {
            per_thread::with(forget_slot);
            return;
        }
    }
    let _ = catch_unwind(|| registry().lock().thread_exited(slot as Slot));
    per_thread::with(forget_slot);
}

/// The thread is no longer registered: later calls of it find no slot.
fn forget_slot(me: &PerThread) {
    me.registry_word
        .set(me.registry_word.get() & HAS_DESTRUCTORS);
}

/// The trampoline registered the thread whose block `me` is in `slot`: it does the thread's exit
/// bookkeeping when the routine ends.
pub fn registered_by_trampoline(me: &PerThread, slot: Slot) {
    let word = &me.registry_word;
    word.set((word.get() & HAS_DESTRUCTORS) | BY_TRAMPOLINE | (slot as usize + 1));
}

/// The thread's routine ended (returned, `pthread_exit` or cancellation): its exit bookkeeping,
/// unless a destructor of its own may still run, in which case the key's destructor does it
/// after them. `block` is the thread's own [`PerThread`], as the trampoline's cleanup buffer
/// hands it over.
pub extern "C" fn routine_ended(block: *mut c_void) {
    // SAFETY: the trampoline passes the block of the thread this runs on (on return, or as the
    // forced unwind leaves its frame); a thread's block lives as long as the thread.
    let me = unsafe { &*(block as *const PerThread) };
    let state = me.registry_word.get();
    if state & BY_TRAMPOLINE == 0 {
        return;
    }
    let Some(slot) = (state & SLOT_BITS).checked_sub(1) else {
        return;
    };
    me.registry_word.set(state & !BY_TRAMPOLINE);
    if state & HAS_DESTRUCTORS != 0 && arm_key((slot + 1) as *const c_void) {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        registry()
            .lock_counted(&me.locks_held)
            .thread_exited(slot as Slot)
    }));
    forget_slot(me);
}
