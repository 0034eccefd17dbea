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
//! destructor unregisters the thread after them, as it does for every thread the library did not
//! start (the main thread, threads seen first in a call). A thread with no destructor of its own
//! thus costs glibc no thread-specific-data round at exit.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};

use super::kernel::Kernel;
use super::packets::{self, StartPacket};
use super::real::{self, StartRoutine};
use super::{load_facts, objects, registry, State};
use crate::mask::CpuMask;
use crate::registry::{ChildPlan, Slot};
use crate::sys;

/// The pthread key whose value is `slot + 1` for a registered thread whose exit the key's
/// destructor sees (with [`EXITING`] once its exit was first seen); `u32::MAX` until created.
static THREAD_KEY: AtomicU32 = AtomicU32::new(u32::MAX);

/// Marks a key value whose destructor already ran once (see [`on_thread_exit`]).
const EXITING: usize = 1 << (usize::BITS - 1);

thread_local! {
    /// This thread's registry slot plus one (0: none) in the low bits, with [`BY_TRAMPOLINE`]
    /// and [`HAS_DESTRUCTORS`]. `const`, no destructor: a plain TLS word, safe in a thread being
    /// born or exiting and in a signal handler.
    static THREAD: Cell<usize> = const { Cell::new(0) };
}

/// The trampoline does this thread's exit bookkeeping when its routine ends.
const BY_TRAMPOLINE: usize = 1 << (usize::BITS - 1);
/// The thread registered a destructor of its own (non-null thread-specific data or a
/// `thread_local` destructor): code of it may run after its routine ended.
const HAS_DESTRUCTORS: usize = 1 << (usize::BITS - 2);
const SLOT_BITS: usize = !(BY_TRAMPOLINE | HAS_DESTRUCTORS);

/// Forced unwinding (`pthread_exit`, cancellation) must be able to pass through the trampoline.
type UnwindingStart = extern "C-unwind" fn(*mut c_void) -> *mut c_void;

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
    (THREAD.with(Cell::get) & SLOT_BITS)
        .checked_sub(1)
        .map(|s| s as Slot)
}

/// Records `slot` as the calling thread's, whose exit the key's destructor will see (a thread
/// the trampoline did not start, or one it started that registered again).
pub fn set_current_slot(slot: Slot) -> bool {
    THREAD.with(|t| t.set((t.get() & HAS_DESTRUCTORS) | (slot as usize + 1)));
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
    THREAD.with(|t| t.set(t.get() | HAS_DESTRUCTORS));
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
            forget_slot();
            return;
        }
    }
    let _ = catch_unwind(|| registry().lock().thread_exited(slot as Slot));
    forget_slot();
}

/// The thread is no longer registered: later calls of it find no slot.
fn forget_slot() {
    THREAD.with(|t| t.set(t.get() & HAS_DESTRUCTORS));
}

/// The interposed `pthread_create`. Fails open: whatever happens in here, the real function
/// runs, and its return code and `errno` reach the caller untouched.
///
/// # Safety
/// The arguments are those of `pthread_create(3)`.
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
    let plan = if super::ensure_init() == State::Active {
        catch_unwind(AssertUnwindSafe(|| plan_child(attr, start))).ok()
    } else {
        None
    };
    let Some(plan) = plan else {
        sys::set_errno(saved_errno);
        // SAFETY: the caller's own arguments, passed on unchanged.
        return unsafe { real_create(thread, attr, Some(start), arg) };
    };
    let packet = packets::hand_over(StartPacket { start, arg, plan });
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
            super::lock_registry().cancel_child(packet.plan)
        }));
        sys::set_errno(errno_after);
    }
    rc
}

fn plan_child(attr: *const libc::pthread_attr_t, start: StartRoutine) -> ChildPlan {
    super::publish_table_if_pending();
    let settings = &load_facts().settings;
    let explicit = explicit_mask(attr);
    let in_worker_lib = !settings.worker_libs.is_empty()
        && objects::in_worker_object(start as usize, &|file| settings.is_worker_lib(file));
    let creator = current_slot();
    let me = sys::tid_of(sys::pthread_self());
    let mut reg = super::lock_registry();
    // The creator's entry names another tid than its descriptor: a child of `_Fork` or a raw
    // `clone`, where no fork handler ran.
    if creator
        .and_then(|s| reg.entry(s))
        .is_some_and(|e| e.tid != me)
    {
        drop(reg);
        super::adopt_if_forked_without_handlers();
        super::publish_table_if_pending();
        reg = super::lock_registry();
    }
    reg.plan_child(creator, in_worker_lib, explicit)
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

/// glibc's cleanup buffer (`struct _pthread_cleanup_buffer`), as `_pthread_cleanup_push` links
/// it into the thread's list; the forced unwind of `pthread_exit` and cancellation runs its
/// routine when it leaves the frame that holds it.
#[repr(C)]
struct CleanupBuffer {
    routine: Option<extern "C" fn(*mut c_void)>,
    arg: *mut c_void,
    canceltype: c_int,
    prev: *mut CleanupBuffer,
}

extern "C" {
    fn _pthread_cleanup_push(
        buffer: *mut CleanupBuffer,
        routine: extern "C" fn(*mut c_void),
        arg: *mut c_void,
    );
    fn _pthread_cleanup_pop(buffer: *mut CleanupBuffer, execute: c_int);
}

extern "C-unwind" fn trampoline(raw: *mut c_void) -> *mut c_void {
    // SAFETY: `raw` is the packet the hook handed to this thread and to no one else. Its contents
    // are moved out here; nothing of it stays owned by this frame while the user routine runs.
    let StartPacket { start, arg, plan } = unsafe { packets::take(raw) };
    let _ = catch_unwind(AssertUnwindSafe(|| register_self(plan)));
    // SAFETY: the user's routine with the user's argument, as pthread_create was asked to run.
    // Nothing with a destructor is alive in this frame.
    let start: UnwindingStart =
        unsafe { std::mem::transmute::<StartRoutine, UnwindingStart>(start) };
    let mut buffer = CleanupBuffer {
        routine: None,
        arg: std::ptr::null_mut(),
        canceltype: 0,
        prev: std::ptr::null_mut(),
    };
    // SAFETY: the buffer lives in this frame until the pop below, or until the forced unwind,
    // which runs (and unlinks) it as it leaves this frame; the routine takes no argument.
    unsafe { _pthread_cleanup_push(&mut buffer, routine_ended, std::ptr::null_mut()) };
    let ret = start(arg);
    // SAFETY: the buffer pushed above, still the thread's innermost: the routine returned, so
    // every buffer it pushed was popped.
    unsafe { _pthread_cleanup_pop(&mut buffer, 1) };
    ret
}

/// The thread's routine ended (returned, `pthread_exit` or cancellation): its exit bookkeeping,
/// unless a destructor of its own may still run, in which case the key's destructor does it
/// after them.
extern "C" fn routine_ended(_: *mut c_void) {
    let state = THREAD.with(Cell::get);
    if state & BY_TRAMPOLINE == 0 {
        return;
    }
    let Some(slot) = (state & SLOT_BITS).checked_sub(1) else {
        return;
    };
    THREAD.with(|t| t.set(state & !BY_TRAMPOLINE));
    if state & HAS_DESTRUCTORS != 0 && arm_key((slot + 1) as *const c_void) {
        return;
    }
    let _ = catch_unwind(|| registry().lock().thread_exited(slot as Slot));
    forget_slot();
}

fn register_self(mut plan: ChildPlan) {
    let handle = sys::pthread_self();
    let tid = sys::tid_of(handle);
    // Outside the registry lock: the move can migrate this thread to another CPU.
    if plan
        .move_at_birth()
        .is_some_and(|mask| sys::set_mask(tid, mask).is_ok())
    {
        plan.mark_moved();
    }
    let slot = registry()
        .lock()
        .register_child(plan, tid, handle as u64, &Kernel);
    THREAD.with(|t| t.set((t.get() & HAS_DESTRUCTORS) | BY_TRAMPOLINE | (slot as usize + 1)));
}
