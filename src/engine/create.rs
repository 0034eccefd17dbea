//! The `pthread_create` hook and the new thread's trampoline.
//!
//! The creator decides the child's role (SPEC §2) and hands the plan over in a boxed start packet;
//! the child registers itself, moves onto its mask when inheritance did not already put it there,
//! and calls the user's routine with nothing of ours alive on its stack. The rules of the
//! trampoline, each learned the hard way by preload libraries:
//! - the start packet is never freed by the child (see [`super::packets`]), and by the creator
//!   only when the real create fails;
//! - no `dlsym`/`dladdr`/TLS-with-destructor in the child (a `dlopen` in progress holds the
//!   loader lock while its constructors create threads); the registry lock only spins;
//! - the user routine is never wrapped in `catch_unwind` and no `Drop` value lives across it:
//!   `pthread_exit` and cancellation unwind through this frame.
//!
//! Exit bookkeeping (docs/design.md, "Thread exit"): a thread the trampoline started is
//! unregistered when its routine returns, or, on `pthread_exit` and cancellation, by a glibc
//! cleanup buffer in the trampoline's frame, which the forced unwind runs as it leaves the frame.
//! Code of the thread can still run after that only in destructors it registered itself
//! (thread-specific data, C++/Rust `thread_local`): the shims of `pthread_setspecific` and
//! `__cxa_thread_atexit_impl` mark such a thread, and for it the pthread key is armed instead, whose
//! destructor unregisters the thread after them ([`super::thread_key`]), as it does for every thread the library did not
//! start (the main thread, threads seen first in a call). A thread with no destructor of its own
//! thus costs glibc no thread-specific-data round at exit.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::cleanup::{self, CleanupBuffer};
use super::fork::{adopt_if_forked_without_handlers, maybe_forked_without_handlers};
use super::init::ensure_init;
use super::kernel::Kernel;
use super::objects;
use super::packets;
use super::publish::publish_table_if_pending;
use super::real::{self, StartRoutine};
use super::report;
use super::state::{load_facts, lock_registry, lock_registry_as, registry, State};
use super::thread_key::{registered_by_trampoline, routine_ended, slot_of};
use crate::mask::CpuMask;
use crate::per_thread::{self, PerThread};
use crate::registry::ChildPlan;
use crate::sys;

/// Forced unwinding (`pthread_exit`, cancellation) must be able to pass through the trampoline.
type UnwindingStart = extern "C-unwind" fn(*mut c_void) -> *mut c_void;

/// The interposed `pthread_create`. Fails open: whatever happens in here, the real function
/// runs, and its return code and `errno` reach the caller untouched.
///
/// # Safety
/// The arguments are those of `pthread_create(3)`.
#[inline(always)]
pub unsafe fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: Option<StartRoutine>,
    arg: *mut c_void,
) -> c_int {
    let Some(real_create) = real::pthread_create() else {
        return libc::EAGAIN;
    };
    let Some(start) = start else {
        // Let glibc meet the null routine exactly as it would without us.
        // SAFETY: the caller's own arguments, passed on unchanged.
        return unsafe { real_create(thread, attr, None, arg) };
    };
    let saved_errno = sys::errno();
    // The plan is written straight into the packet: a copy of it costs more than the rest.
    let packet = if ensure_init() == State::Active {
        // SAFETY: the calling thread's own block, which lives as long as the thread.
        let me = unsafe { &*per_thread::current() };
        catch_unwind(AssertUnwindSafe(|| {
            packets::hand_over(start, arg, me.preferred_node.get(), || {
                plan_child(me, attr, start)
            })
        }))
        .ok()
    } else {
        None
    };
    let Some(packet) = packet else {
        sys::set_errno(saved_errno);
        // SAFETY: the caller's own arguments, passed on unchanged.
        return unsafe { real_create(thread, attr, Some(start), arg) };
    };
    sys::set_errno(saved_errno);
    // SAFETY: the trampoline has the start-routine ABI (C-unwind only adds permission to unwind)
    // and takes ownership of the packet, which stays alive until it does.
    let rc = unsafe {
        real_create(
            thread,
            attr,
            Some(std::mem::transmute::<UnwindingStart, StartRoutine>(
                trampoline,
            )),
            packet,
        )
    };
    if rc != 0 {
        let errno_after = sys::errno();
        // SAFETY: the thread was not created, so the packet is still ours alone.
        let packet = unsafe { packets::reclaim(packet) };
        let _ = catch_unwind(AssertUnwindSafe(|| {
            lock_registry().cancel_child(packet.plan)
        }));
        sys::set_errno(errno_after);
    }
    rc
}

fn plan_child(me: &PerThread, attr: *const libc::pthread_attr_t, start: StartRoutine) -> ChildPlan {
    publish_table_if_pending();
    report::say_if_python_hook_missing(false);
    let settings = &load_facts().settings;
    let explicit = explicit_mask(attr);
    let in_worker_lib = !settings.worker_libs.is_empty()
        && objects::in_worker_object(start as usize, &|file| settings.is_worker_lib(file));
    let creator = slot_of(me);
    // A child of `_Fork` or a raw `clone`, where no fork handler ran, starts as a fork child
    // first: the fork mark reads zero there (a load, before any lock), or, where the kernel gave
    // no mark, the creator's entry names another tid than its descriptor.
    let forked = maybe_forked_without_handlers().unwrap_or_else(|| {
        let my_tid = sys::tid_of(sys::pthread_self());
        let reg = lock_registry_as(me);
        creator
            .and_then(|s| reg.entry(s))
            .is_some_and(|e| e.tid != my_tid)
    });
    if forked {
        adopt_if_forked_without_handlers();
        publish_table_if_pending();
    }
    lock_registry_as(me).plan_child(creator, in_worker_lib, explicit)
}

/// The affinity set in the attr, if any; glibc reports "none set" as all ones.
fn explicit_mask(attr: *const libc::pthread_attr_t) -> Option<CpuMask> {
    if attr.is_null() {
        return None;
    }
    // Most hosts fit in 1024 CPUs: try a stack buffer first, so the common attr (stack size
    // only) costs no allocation.
    let mut small = [0u8; 128];
    // SAFETY: `attr` is the caller's initialised attr; the buffer is `small.len()` bytes.
    let rc =
        unsafe { libc::pthread_attr_getaffinity_np(attr, small.len(), small.as_mut_ptr().cast()) };
    if rc == 0 {
        let unset = small.iter().all(|&b| b == 0xff);
        return (!unset).then(|| CpuMask::from_kernel_bytes(&small));
    }
    let mut big = vec![0u8; sys::mask_bytes().max(256)];
    // SAFETY: as above with a buffer of `big.len()` bytes.
    let rc = unsafe { libc::pthread_attr_getaffinity_np(attr, big.len(), big.as_mut_ptr().cast()) };
    let unset = big.iter().all(|&b| b == 0xff);
    (rc == 0 && !unset).then(|| CpuMask::from_kernel_bytes(&big))
}

extern "C-unwind" fn trampoline(raw: *mut c_void) -> *mut c_void {
    // SAFETY: `raw` is the packet the hook handed to this thread and to no one else; it is read
    // in place for the registration, then retired, before the user routine runs.
    let packet = unsafe { packets::open(raw) };
    // This thread's block, looked up once for the registration, both locks and the exit.
    let me = per_thread::current();
    if packet.preferred_node != 0 {
        // SAFETY: this thread's own block, which lives as long as the thread.
        unsafe { &*me }.preferred_node.set(packet.preferred_node);
    }
    register_failing_open(me, &mut packet.plan);
    let (start, arg) = (packet.start, packet.arg);
    // SAFETY: opened above; nothing of the packet is used after this.
    unsafe { packets::retire(raw) };
    // SAFETY: the user's routine with the user's argument, as pthread_create was asked to run.
    // Nothing with a destructor is alive in this frame.
    let start: UnwindingStart =
        unsafe { std::mem::transmute::<StartRoutine, UnwindingStart>(start) };
    let mut buffer = CleanupBuffer::new();
    // SAFETY: the buffer lives in this frame until the pop below, or until the forced unwind,
    // which runs (and unlinks) it as it leaves this frame; the routine's argument is this
    // thread's block, which outlives the frame.
    unsafe { cleanup::push(&mut buffer, routine_ended, me as *mut c_void) };
    let ret = start(arg);
    // SAFETY: the buffer pushed above, still the thread's innermost: the routine returned, so
    // every buffer it pushed was popped.
    unsafe { cleanup::pop(&mut buffer, true) };
    ret
}

/// [`register_self`], a panic in it caught (the thread runs its routine all the same). Never
/// inlined: the catch gives its frame a personality routine, and the trampoline's frame must have
/// none. A thread that ends by `pthread_exit` or cancellation is unwound by libgcc_s's forced
/// unwind, which calls the personality of every frame it passes; the wheel links LLVM's unwinder
/// statically, whose `_Unwind_*` calls in our personality cannot read libgcc_s's unwind context
/// (the process crashed). A frame without one is only stepped over.
#[inline(never)]
fn register_failing_open(me: *const PerThread, plan: &mut ChildPlan) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the calling thread's own block, which lives as long as the thread.
        register_self(unsafe { &*me }, plan)
    }));
}

fn register_self(me: &PerThread, plan: &mut ChildPlan) {
    let handle = sys::pthread_self();
    let tid = sys::tid_of(handle);
    // Outside the registry lock: the move can migrate this thread to another CPU.
    if plan
        .move_at_birth()
        .is_some_and(|mask| sys::set_mask(tid, mask).is_ok())
    {
        plan.mark_moved();
    }
    let slot =
        registry()
            .lock_counted(&me.locks_held)
            .register_child(plan, tid, handle as u64, &Kernel);
    registered_by_trampoline(me, slot);
}
