//! The floor: what a preloaded library costs a thread's birth when it keeps one registry entry per
//! thread the way `libtllm_affinity.so` does, and decides nothing. `scripts/bench --counts` counts
//! it beside the library, so the library's figure reads as this floor plus the rules.
//!
//! It has the library's fixed costs and only those: a Rust-std thread-local block (glibc sets one
//! up in every new thread for every module that has one), the real `pthread_create` found once,
//! `errno` kept, three lock round trips (the creator's plan, the child's registration, the exit),
//! a start packet recycled on the creator's side, the child's tid read from its descriptor, an
//! entry with three shared masks, a creator link and a count of children, a record in a thread
//! table, and a glibc cleanup buffer that unregisters the thread however it ends. Every thread is
//! its creator's kind on its creator's mask: no role, lease, placement, worker library, explicit
//! mask, fork or signal is looked at. Never preload it anywhere but in the benchmark.

use std::cell::{Cell, UnsafeCell};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

type StartRoutine = extern "C" fn(*mut c_void) -> *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut libc::pthread_t,
    *const libc::pthread_attr_t,
    Option<StartRoutine>,
    *mut c_void,
) -> c_int;

/// A mask as an entry holds it: shared with its creator's entry (a reference count taken at birth
/// and dropped at exit), or, with `plain-masks`, a number naming it.
#[cfg(not(feature = "plain-masks"))]
type Mask = std::sync::Arc<Vec<u64>>;
#[cfg(feature = "plain-masks")]
type Mask = u32;

#[cfg(not(feature = "plain-masks"))]
fn root_mask() -> Mask {
    std::sync::Arc::new(vec![u64::MAX])
}
#[cfg(feature = "plain-masks")]
fn root_mask() -> Mask {
    0
}

/// Another holder of `mask`: a reference counted in, or a copied number.
#[cfg(not(feature = "plain-masks"))]
fn share(mask: &Mask) -> Mask {
    mask.clone()
}
#[cfg(feature = "plain-masks")]
fn share(mask: &Mask) -> Mask {
    *mask
}

struct PerThread {
    locks_held: Cell<u32>,
    /// The thread's slot + 1; 0 before it has one.
    slot: Cell<usize>,
}

thread_local! {
    static PER_THREAD: PerThread = const {
        PerThread { locks_held: Cell::new(0), slot: Cell::new(0) }
    };
}

fn per_thread() -> &'static PerThread {
    // SAFETY: the block lives as long as its thread, and no caller keeps it past the thread.
    unsafe { &*PER_THREAD.with(|t| t as *const PerThread) }
}

// Written as the library writes its entries; what is never read here is the cost being measured.
#[allow(dead_code)]
struct Entry {
    tid: i32,
    role: u8,
    natural: Mask,
    current: Mask,
    born: Mask,
    creator: Option<u32>,
    live_children: u32,
    alive: bool,
}

#[derive(Default)]
struct Registry {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    births_pending: usize,
}

struct RegistryLock {
    state: AtomicU32,
    registry: UnsafeCell<Registry>,
}

// SAFETY: the registry is reached only through a guard, one thread at a time.
unsafe impl Sync for RegistryLock {}

static REGISTRY: RegistryLock = RegistryLock {
    state: AtomicU32::new(0),
    registry: UnsafeCell::new(Registry {
        slots: Vec::new(),
        free: Vec::new(),
        births_pending: 0,
    }),
};

struct Guard<'a> {
    locks_held: &'a Cell<u32>,
}

impl Guard<'_> {
    fn lock(me: &PerThread) -> Guard<'_> {
        me.locks_held.set(me.locks_held.get().wrapping_add(1));
        while REGISTRY
            .state
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        Guard {
            locks_held: &me.locks_held,
        }
    }

    #[allow(clippy::mut_from_ref)]
    fn registry(&self) -> &mut Registry {
        // SAFETY: this guard holds the lock, so no other reference to the registry is live.
        unsafe { &mut *REGISTRY.registry.get() }
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        REGISTRY.state.store(0, Ordering::Release);
        self.locks_held.set(self.locks_held.get().wrapping_sub(1));
    }
}

/// The records `ps` would read: tid and role per slot.
static TABLE: [AtomicU64; 4096] = [const { AtomicU64::new(0) }; 4096];

impl Registry {
    fn publish(&self, slot: u32) {
        let record = match &self.slots[slot as usize] {
            Some(e) if e.alive => e.tid as u32 as u64 | (e.role as u64) << 32,
            _ => 0,
        };
        TABLE[slot as usize % TABLE.len()].store(record, Ordering::Relaxed);
    }

    fn insert(&mut self, entry: Entry) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(entry);
                slot
            }
            None => {
                self.slots.push(Some(entry));
                self.slots.len() as u32 - 1
            }
        };
        self.publish(slot);
        slot
    }
}

fn tid_of(thread: libc::pthread_t) -> i32 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `thread` is the calling thread, alive; the clock id is written to a local.
    unsafe { libc::pthread_getcpuclockid(thread, &mut clock) };
    !(clock >> 3)
}

/// The calling thread's slot, registering it (as a thread nobody saw being born) the first time.
fn slot_of(me: &PerThread) -> u32 {
    if let Some(slot) = me.slot.get().checked_sub(1) {
        return slot as u32;
    }
    let guard = Guard::lock(me);
    let registry = guard.registry();
    let mask = root_mask();
    let slot = registry.insert(Entry {
        // SAFETY: pthread_self has no preconditions.
        tid: tid_of(unsafe { libc::pthread_self() }),
        role: 0,
        natural: share(&mask),
        current: share(&mask),
        born: mask,
        creator: None,
        live_children: 0,
        alive: true,
    });
    me.slot.set(slot as usize + 1);
    slot
}

static REAL_CREATE: AtomicUsize = AtomicUsize::new(0);

fn real_create() -> CreateFn {
    let mut found = REAL_CREATE.load(Ordering::Relaxed);
    if found == 0 {
        // SAFETY: a symbol lookup with a NUL-terminated name.
        found = unsafe { libc::dlsym(libc::RTLD_NEXT, c"pthread_create".as_ptr()) } as usize;
        REAL_CREATE.store(found, Ordering::Relaxed);
    }
    // SAFETY: the next `pthread_create` in the lookup order has this signature.
    unsafe { std::mem::transmute::<usize, CreateFn>(found) }
}

struct Packet {
    next: *mut Packet,
    start: StartRoutine,
    arg: *mut c_void,
    creator: Option<u32>,
}

/// Packets the started threads gave back, reused by the next creator.
static RETIRED: AtomicPtr<Packet> = AtomicPtr::new(std::ptr::null_mut());

fn hand_over(start: StartRoutine, arg: *mut c_void, creator: Option<u32>) -> *mut Packet {
    let packet = Packet {
        next: std::ptr::null_mut(),
        start,
        arg,
        creator,
    };
    let chain = if RETIRED.load(Ordering::Relaxed).is_null() {
        std::ptr::null_mut()
    } else {
        RETIRED.swap(std::ptr::null_mut(), Ordering::Acquire)
    };
    if chain.is_null() {
        return Box::into_raw(Box::new(packet));
    }
    // SAFETY: the swap made this thread the only owner of the chain, every cell a Box.
    unsafe {
        let mut rest = (*chain).next;
        while !rest.is_null() {
            let next = (*rest).next;
            drop(Box::from_raw(rest));
            rest = next;
        }
        chain.write(packet);
    }
    chain
}

fn retire(packet: *mut Packet) {
    let mut head = RETIRED.load(Ordering::Relaxed);
    loop {
        // SAFETY: the packet is this thread's until the exchange publishes it.
        unsafe { (*packet).next = head };
        match RETIRED.compare_exchange_weak(head, packet, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(now) => head = now,
        }
    }
}

/// # Safety
/// The arguments are those of `pthread_create(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: Option<StartRoutine>,
    arg: *mut c_void,
) -> c_int {
    let real = real_create();
    let Some(start) = start else {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe { real(thread, attr, None, arg) };
    };
    // SAFETY: this thread's errno slot.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above.
    let saved_errno = unsafe { *errno };
    let me = per_thread();
    let creator = slot_of(me);
    let creator = {
        let guard = Guard::lock(me);
        let registry = guard.registry();
        registry.births_pending += 1;
        // The child registers without allocating: room for every pending birth.
        registry.slots.reserve(registry.births_pending);
        let most_free = registry.slots.len() + registry.births_pending;
        registry
            .free
            .reserve(most_free.saturating_sub(registry.free.len()));
        match registry.slots.get_mut(creator as usize) {
            Some(Some(e)) if e.alive => {
                e.live_children += 1;
                Some(creator)
            }
            _ => None,
        }
    };
    let packet = hand_over(start, arg, creator);
    // SAFETY: as above.
    unsafe { *errno = saved_errno };
    // SAFETY: the trampoline takes the packet, which lives until it is retired.
    unsafe { real(thread, attr, Some(trampoline), packet.cast()) }
}

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

extern "C" fn trampoline(raw: *mut c_void) -> *mut c_void {
    let packet = raw as *mut Packet;
    // SAFETY: the packet the hook handed to this thread alone.
    let (start, arg, creator) = unsafe { ((*packet).start, (*packet).arg, (*packet).creator) };
    let me = per_thread();
    // SAFETY: pthread_self has no preconditions.
    let tid = tid_of(unsafe { libc::pthread_self() });
    let slot = {
        let guard = Guard::lock(me);
        let registry = guard.registry();
        registry.births_pending -= 1;
        let entry = match creator.and_then(|c| registry.slots[c as usize].as_ref()) {
            Some(c) => Entry {
                tid,
                role: c.role,
                natural: share(&c.natural),
                current: share(&c.current),
                born: share(&c.current),
                creator,
                live_children: 0,
                alive: true,
            },
            None => {
                let mask = root_mask();
                Entry {
                    tid,
                    role: 0,
                    natural: share(&mask),
                    current: share(&mask),
                    born: mask,
                    creator: None,
                    live_children: 0,
                    alive: true,
                }
            }
        };
        registry.insert(entry)
    };
    me.slot.set(slot as usize + 1);
    retire(packet);
    let mut buffer = CleanupBuffer {
        routine: None,
        arg: std::ptr::null_mut(),
        canceltype: 0,
        prev: std::ptr::null_mut(),
    };
    // SAFETY: the buffer lives in this frame until the pop below or the forced unwind.
    unsafe { _pthread_cleanup_push(&mut buffer, routine_ended, me as *const _ as *mut c_void) };
    let ret = start(arg);
    // SAFETY: the buffer pushed above, the innermost.
    unsafe { _pthread_cleanup_pop(&mut buffer, 1) };
    ret
}

extern "C" fn routine_ended(block: *mut c_void) {
    // SAFETY: the thread's own block, handed to the cleanup buffer by the trampoline.
    let me = unsafe { &*(block as *const PerThread) };
    let Some(slot) = me.slot.get().checked_sub(1) else {
        return;
    };
    me.slot.set(0);
    let guard = Guard::lock(me);
    let registry = guard.registry();
    let Some(Some(e)) = registry.slots.get_mut(slot) else {
        return;
    };
    e.alive = false;
    let (leaf, creator) = (e.live_children == 0, e.creator);
    registry.publish(slot as u32);
    // A thread with children stays as a tombstone; the floor never frees one (nothing here has
    // children that outlive it).
    if leaf {
        if let Some(Some(c)) = creator.and_then(|c| registry.slots.get_mut(c as usize)) {
            c.live_children = c.live_children.saturating_sub(1);
        }
        registry.slots[slot] = None;
        registry.free.push(slot as u32);
    }
}
