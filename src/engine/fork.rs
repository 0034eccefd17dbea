//! Fork handling (SPEC §5, §12): the `pthread_atfork` handlers, which hold every engine lock across
//! a fork (add a new lock to their list), and the child's start: the registry keeps only the
//! forking thread and the parent's table is left to the parent. A child of `_Fork` or a raw
//! `clone`, which runs no handler, starts the same way on the first path that needs it.

use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};

use super::state::{in_own_process, lock_registry, own_this_process, state, State, REGISTRY};
use super::thread_key::current_slot;
use super::{
    configure, environ, exec, memory_effects, memory_preference, objects, publish, report,
    timer_calls,
};

use crate::{per_thread, sys};

/// The fork mark: a word set to 1 in the process the registry describes (at load, and in a fork
/// child once it started as one), which the kernel zeroes in every fork child
/// ([`sys::wipe_on_fork_word`]). Null when the kernel has no wipe-on-fork pages.
static MARK: AtomicPtr<AtomicU64> = AtomicPtr::new(ptr::null_mut());

/// Sets the fork mark up, at load.
pub(super) fn set_mark() {
    if let Some(word) = sys::wipe_on_fork_word() {
        // Set before it is published: no thread reads the new mark as a fork child's.
        word.store(1, Ordering::Release);
        MARK.store(ptr::from_ref(word).cast_mut(), Ordering::Release);
    }
}

#[inline(always)]
fn mark() -> Option<&'static AtomicU64> {
    let mark = MARK.load(Ordering::Acquire);
    // SAFETY: a non-null mark is the word of a mapping that lives as long as the process.
    (!mark.is_null()).then(|| unsafe { &*mark })
}

/// This process is the one the registry describes: the mark reads 1 here and 0 in its fork
/// children.
fn arm_mark() {
    if let Some(mark) = mark() {
        mark.store(1, Ordering::Release);
    }
}

/// Whether this process may be a fork child that has not started as one: `Some` from the fork
/// mark, a load; `None` when there is no mark, and the caller must ask otherwise.
#[inline(always)]
pub fn maybe_forked_without_handlers() -> Option<bool> {
    mark().map(|m| m.load(Ordering::Relaxed) == 0)
}

/// A child of `_Fork` or a raw `clone` ran no fork handler: it would publish into its parent's
/// table, which it still has mapped. It starts as a fork child on the first path that needs it
/// (a thread creation, a configure; never in a `vfork` child, which may only exec or exit).
/// `getpid` is a system call: the thread-creation path asks only when the fork mark reads zero
/// (or, without a mark, when its registry entry names another tid than the thread's own
/// descriptor, which `_Fork` updates).
pub fn adopt_if_forked_without_handlers() {
    if in_own_process() {
        // Not a fork child: the mark says so from now on.
        arm_mark();
    } else if state() == State::Active {
        start_as_fork_child();
    }
}

/// What a fork child does before anything else: the registry keeps only this thread (SPEC §5),
/// and the parent's table, still mapped, is left to the parent.
pub(super) fn start_as_fork_child() {
    environ::after_fork_child();
    memory_preference::clear_in_fork_child();
    memory_effects::after_fork_child();
    own_this_process();
    arm_mark();
    objects::after_fork_in_child();
    let handle = sys::pthread_self() as u64;
    {
        let mut reg = REGISTRY.lock();
        reg.reset_after_fork(current_slot(), sys::gettid(), handle);
        exec::publish_target(reg.target().map(|t| &*t.mask));
    }
    lock_registry().publish_into(None);
    publish::TABLE_PATH.lock().path = None;
    *report::NOTES.lock() = None;
    memory_preference::forget_after_fork();
    publish::TABLE_PENDING.store(true, Ordering::Release);
}

/// From the start of the prepare handler until the fork returned, in the parent and the child:
/// the engine's locks are held for the fork, and glibc then takes every malloc arena.
static IN_PROGRESS: AtomicBool = AtomicBool::new(false);

/// Whether a fork holds the engine's locks now (see [`IN_PROGRESS`]).
pub(super) fn in_progress() -> bool {
    IN_PROGRESS.load(Ordering::Acquire)
}

pub(super) fn register_fork_handlers() {
    // Every lock of the engine, so that no other thread holds one across the fork: a child
    // would spin forever on a lock its holder is not there to release. No code path holds two
    // of them at once, so the order here cannot deadlock.
    extern "C" fn prepare() {
        memory_effects::FORKS.fetch_add(1, Ordering::Relaxed);
        // A signal handler forking on a thread the library was running on, holding one of its
        // locks (the memory move's walk holds FORK_GATE for up to a few hundred ms): waiting for
        // that lock would wait for this very thread. Such a fork takes no lock; its child
        // starts as one on the first path that needs it, as a `_Fork` child does.
        if crate::lock::held_by_this_thread() {
            per_thread::with(|me| me.fork_took_no_locks.set(true));
            return;
        }
        // First, holding nothing: a walk of the memory move may hold it for a bounded while.
        memory_effects::FORK_GATE.hold_for_fork();
        IN_PROGRESS.store(true, Ordering::Release);
        objects::PUBLISHED.hold_for_fork();
        timer_calls::CONTEXTS.hold_for_fork();
        crate::placement::step::HELD.hold_for_fork();
        configure::WORKER_SETS.hold_for_fork();
        environ::shadow_lock().hold_for_fork();
        crate::host::gpus::nvml_lock().hold_for_fork();
        publish::TABLE_PATH.hold_for_fork();
        report::ADAPTERS.hold_for_fork();
        report::NOTES.hold_for_fork();
        memory_preference::PREFERRED.hold_for_fork();
        REGISTRY.hold_for_fork();
    }
    fn unlock_all() {
        // SAFETY: `prepare` of this same fork took each of them.
        unsafe {
            REGISTRY.force_unlock();
            memory_preference::PREFERRED.force_unlock();
            report::NOTES.force_unlock();
            report::ADAPTERS.force_unlock();
            publish::TABLE_PATH.force_unlock();
            crate::host::gpus::nvml_lock().force_unlock();
            environ::shadow_lock().force_unlock();
            configure::WORKER_SETS.force_unlock();
            crate::placement::step::HELD.force_unlock();
            timer_calls::CONTEXTS.force_unlock();
            objects::PUBLISHED.force_unlock();
            memory_effects::FORK_GATE.force_unlock();
        }
    }
    /// Whether this thread's `prepare` of this fork took no lock (and clears the note).
    fn took_no_locks() -> bool {
        per_thread::with(|me| me.fork_took_no_locks.replace(false))
    }
    extern "C" fn parent() {
        if took_no_locks() {
            return;
        }
        unlock_all();
        IN_PROGRESS.store(false, Ordering::Release);
    }
    extern "C" fn child() {
        if took_no_locks() {
            // Lock-free, and the child's alone: it must not run under the library's preference.
            memory_preference::clear_in_fork_child();
            return;
        }
        unlock_all();
        IN_PROGRESS.store(false, Ordering::Release);
        start_as_fork_child();
    }
    sys::at_fork(prepare, parent, child);
}
