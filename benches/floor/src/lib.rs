//! The floor: what a preloaded library costs a thread's birth when it keeps one registry entry per
//! thread the way `libtllm_affinity.so` does, and decides nothing. `scripts/bench --counts` counts
//! it beside the library, so the library's figure reads as this floor plus the rules.
//!
//! It has the library's fixed costs and only those. From the library itself: its thread-local
//! block (glibc sets one up in every new thread for every module that has one), its lock, taken
//! three times a birth (the creator's plan, the child's registration, the exit), its thread-id
//! read, its real `pthread_create`, its start-packet cells recycled on the creator's side and its
//! cleanup buffer, with `errno` kept as the hook keeps it. Written here in the library's shape:
//! room for every pending birth made by the creator, an entry with three shared masks, a creator
//! link and a count of children, and a record in a thread table. Every thread is its creator's
//! kind on its creator's mask: no state, role, lease, placement, worker library, explicit mask or
//! fork is looked at. Never preload it anywhere but in the benchmark.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use tllm_affinity_core::engine::cleanup::{self, CleanupBuffer};
use tllm_affinity_core::engine::packets::RecycledCells;
use tllm_affinity_core::engine::real::{self, StartRoutine};
use tllm_affinity_core::identity::{Placement, Role, Tid};
use tllm_affinity_core::lock::EngineLock;
use tllm_affinity_core::per_thread::{self, PerThread};
use tllm_affinity_core::sys;
use tllm_affinity_core::table::threadtable;

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

// Written as the library writes its entries; what is never read here is the cost being measured.
#[allow(dead_code)]
struct Entry {
    tid: Tid,
    role: Role,
    natural: Mask,
    current: Mask,
    born: Mask,
    creator: Option<u32>,
    live_children: u32,
    alive: bool,
}

impl Entry {
    /// A thread nobody saw being born, or born of one the registry no longer holds.
    fn root(tid: Tid) -> Entry {
        let mask = root_mask();
        Entry {
            tid,
            role: Role::Host,
            natural: share(&mask),
            current: share(&mask),
            born: mask,
            creator: None,
            live_children: 0,
            alive: true,
        }
    }

    /// A child of `creator` (in `slot`): its kind, on its mask.
    fn child_of(creator: &Entry, slot: u32, tid: Tid) -> Entry {
        Entry {
            tid,
            role: creator.role,
            natural: share(&creator.natural),
            current: share(&creator.current),
            born: share(&creator.current),
            creator: Some(slot),
            live_children: 0,
            alive: true,
        }
    }
}

struct Registry {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    births_pending: usize,
}

static REGISTRY: EngineLock<Registry> = EngineLock::new(Registry {
    slots: Vec::new(),
    free: Vec::new(),
    births_pending: 0,
});

/// The records `ps` would read, one per slot, encoded as the library encodes them.
static TABLE: [AtomicU64; 4096] = [const { AtomicU64::new(0) }; 4096];

impl Registry {
    fn publish(&self, slot: u32) {
        let record = match &self.slots[slot as usize] {
            Some(e) if e.alive => threadtable::encode(e.tid, e.role, Placement::Inherited),
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

    /// The plan: the creator counts the child it is about to have, and makes room for it.
    fn plan_child(&mut self, creator: u32) -> Option<u32> {
        self.births_pending += 1;
        self.slots.reserve(self.births_pending);
        let most_free = self.slots.len() + self.births_pending;
        self.free.reserve(most_free.saturating_sub(self.free.len()));
        match self.slots.get_mut(creator as usize) {
            Some(Some(e)) if e.alive => {
                e.live_children += 1;
                Some(creator)
            }
            _ => None,
        }
    }

    fn register_child(&mut self, creator: Option<u32>, tid: Tid) -> u32 {
        self.births_pending -= 1;
        let entry = match creator.and_then(|c| Some((c, self.slots[c as usize].as_ref()?))) {
            Some((slot, c)) => Entry::child_of(c, slot, tid),
            None => Entry::root(tid),
        };
        self.insert(entry)
    }

    fn thread_exited(&mut self, slot: usize) {
        let Some(Some(e)) = self.slots.get_mut(slot) else {
            return;
        };
        e.alive = false;
        let (leaf, creator) = (e.live_children == 0, e.creator);
        self.publish(slot as u32);
        // A thread with children stays as a tombstone; nothing here has children that outlive
        // it, so the floor never frees one.
        if leaf {
            if let Some(Some(c)) = creator.and_then(|c| self.slots.get_mut(c as usize)) {
                c.live_children = c.live_children.saturating_sub(1);
            }
            self.slots[slot] = None;
            self.free.push(slot as u32);
        }
    }
}

/// The calling thread's slot (kept in its registry word, + 1), registering it as a root the
/// first time.
fn slot_of(me: &PerThread) -> u32 {
    if let Some(slot) = me.registry_word.get().checked_sub(1) {
        return slot as u32;
    }
    let tid = sys::tid_of(sys::pthread_self());
    let slot = REGISTRY
        .lock_counted(&me.locks_held)
        .insert(Entry::root(tid));
    me.registry_word.set(slot as usize + 1);
    slot
}

struct Packet {
    start: StartRoutine,
    arg: *mut c_void,
    creator: Option<u32>,
}

/// Start packets, handed over and given back as the library's are.
static PACKETS: RecycledCells<Packet> = RecycledCells::new();

/// # Safety
/// The arguments are those of `pthread_create(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: Option<StartRoutine>,
    arg: *mut c_void,
) -> c_int {
    let Some(real_create) = real::pthread_create() else {
        return libc::EAGAIN;
    };
    let Some(start) = start else {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe { real_create(thread, attr, None, arg) };
    };
    let saved_errno = sys::errno();
    // SAFETY: the calling thread's own block, which lives as long as the thread.
    let me = unsafe { &*per_thread::current() };
    let creator = slot_of(me);
    let creator = REGISTRY.lock_counted(&me.locks_held).plan_child(creator);
    let packet = PACKETS.hand_over(|| Packet {
        start,
        arg,
        creator,
    });
    sys::set_errno(saved_errno);
    // SAFETY: the trampoline takes the packet, which lives until it is given back.
    unsafe { real_create(thread, attr, Some(trampoline), packet) }
}

extern "C" fn trampoline(raw: *mut c_void) -> *mut c_void {
    // SAFETY: the packet the hook handed to this thread alone, opened once and retired below.
    let packet = unsafe { RecycledCells::<Packet>::open(raw) };
    let (start, arg, creator) = (packet.start, packet.arg, packet.creator);
    let me = per_thread::current();
    // SAFETY: the calling thread's own block, which lives as long as the thread.
    let block = unsafe { &*me };
    let tid = sys::tid_of(sys::pthread_self());
    let slot = REGISTRY
        .lock_counted(&block.locks_held)
        .register_child(creator, tid);
    block.registry_word.set(slot as usize + 1);
    // SAFETY: opened above; nothing of it is used after this.
    unsafe { PACKETS.retire(raw) };
    let mut buffer = CleanupBuffer::new();
    // SAFETY: the buffer lives in this frame until the pop below or the forced unwind; the
    // argument is this thread's block, which outlives the frame.
    unsafe { cleanup::push(&mut buffer, routine_ended, me as *mut c_void) };
    let ret = start(arg);
    // SAFETY: the buffer pushed above, the innermost: the routine returned.
    unsafe { cleanup::pop(&mut buffer, true) };
    ret
}

extern "C" fn routine_ended(block: *mut c_void) {
    // SAFETY: the thread's own block, handed to the cleanup buffer by the trampoline.
    let me = unsafe { &*(block as *const PerThread) };
    let Some(slot) = me.registry_word.get().checked_sub(1) else {
        return;
    };
    me.registry_word.set(0);
    REGISTRY.lock_counted(&me.locks_held).thread_exited(slot);
}
