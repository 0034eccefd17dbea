//! The process state every part of the engine reads: where initialisation stands, the load facts,
//! the registry (with the mask changes the observing shims queued for it), and the pid the
//! registry describes. It names no other file of the engine, so every one of them can see it.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::lock::{EngineGuard, EngineLock};
use crate::per_thread::PerThread;
use crate::placement::load_facts::LoadFacts;
use crate::registry::{Registry, Tid};
use crate::sys;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    Uninitialised = 0,
    Initialising = 1,
    /// Tracking roles and placing worker threads.
    Active = 2,
    /// A setting was malformed: nothing is tracked or changed, the program runs on.
    Passive = 3,
    /// Secure execution, or the platform refused what the library needs.
    Disabled = 4,
    /// `TLLM_AFFINITY_DISABLE=1`: loaded and inert, every call passes through, the C API answers
    /// `-ENOTSUP` (SPEC §8).
    Off = 5,
}

/// Written only by `init::ensure_init`.
pub(super) static STATE: AtomicU8 = AtomicU8::new(State::Uninitialised as u8);

pub fn state() -> State {
    match STATE.load(Ordering::Acquire) {
        0 => State::Uninitialised,
        1 => State::Initialising,
        2 => State::Active,
        3 => State::Passive,
        5 => State::Off,
        _ => State::Disabled,
    }
}

pub(super) static LOAD_FACTS: OnceLock<LoadFacts> = OnceLock::new();

/// The load-time facts; only called after `ensure_init` returned `Active`.
pub fn load_facts() -> &'static LoadFacts {
    LOAD_FACTS.get().expect("engine used before initialisation")
}

/// One lock over the registry: an [`EngineLock`], which never parks through a thread-local with a
/// destructor (a new thread in our trampoline must never wait for the loader lock); see
/// `lock.rs` for why.
pub(super) static REGISTRY: EngineLock<Registry> = EngineLock::new(Registry::new());

pub fn registry() -> &'static EngineLock<Registry> {
    &REGISTRY
}

/// The registry, with the application's mask changes that the observing shims queued taken in
/// first. Every path takes it this way except a thread's birth and exit, which must not allocate
/// (they use [`registry`]): a change queued then is taken in by the next operation, before it
/// decides anything from that thread's mask.
pub fn lock_registry() -> EngineGuard<'static, Registry> {
    let mut reg = REGISTRY.lock();
    take_queued(&mut reg);
    reg
}

/// [`lock_registry`] for a caller that holds its thread's block already (see
/// [`crate::per_thread`]).
pub fn lock_registry_as(me: &PerThread) -> EngineGuard<'_, Registry> {
    let mut reg = REGISTRY.lock_counted(&me.locks_held);
    take_queued(&mut reg);
    reg
}

/// Threads whose masks the application set (`observe.rs`) and the registry has not taken in yet.
/// Far more than can be outstanding between two registry operations; when it is full, the change
/// is still found later, as any change behind the library's back is (placement `external`), and
/// never overridden.
const QUEUE_LEN: usize = 64;
static QUEUED: [AtomicI32; QUEUE_LEN] = [const { AtomicI32::new(0) }; QUEUE_LEN];
static ANY_QUEUED: AtomicBool = AtomicBool::new(false);

/// Queues `tid` for [`lock_registry`] to take in; lock-free and allocation-free, for a shim that
/// may run in a signal handler or a `vfork` child.
pub(super) fn queue_observed(tid: Tid) {
    for cell in &QUEUED {
        if cell
            .compare_exchange(0, tid, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            ANY_QUEUED.store(true, Ordering::Release);
            return;
        }
    }
}

/// Takes the queued observations into `reg`: each named thread becomes `explicit` with the mask
/// the kernel holds now. Called with the registry lock held, outside births and exits (it reads
/// masks into new allocations).
#[inline]
fn take_queued(reg: &mut Registry) {
    if ANY_QUEUED.load(Ordering::Acquire) {
        take_queued_now(reg);
    }
}

#[cold]
fn take_queued_now(reg: &mut Registry) {
    ANY_QUEUED.store(false, Ordering::Release);
    for cell in &QUEUED {
        let tid = cell.swap(0, Ordering::AcqRel);
        if tid == 0 {
            continue;
        }
        if let (Some(slot), Ok(actual)) = (reg.find_tid(tid), sys::get_mask(tid)) {
            reg.observe_explicit(slot, actual);
        }
    }
}

/// The pid the registry describes: set at load and in a fork child. A `vfork` or
/// `clone(CLONE_VM)` child runs on our memory with another pid until it execs.
static OWN_PID: AtomicI32 = AtomicI32::new(0);

/// Makes the calling process the one the registry describes (at load, and in a fork child), and
/// returns its pid.
pub(super) fn own_this_process() -> i32 {
    let pid = sys::getpid();
    OWN_PID.store(pid, Ordering::Relaxed);
    pid
}

/// Whether the caller runs in the process the registry describes (not in a child sharing its
/// memory, nor in a child of `_Fork`/`clone` that skipped the fork handlers).
pub fn in_own_process() -> bool {
    OWN_PID.load(Ordering::Relaxed) == sys::getpid()
}
