//! Start packets: how the hook hands a new thread the user's routine and its plan.
//!
//! The new thread never frees its packet. A `free` there would make glibc build that thread's
//! malloc cache (a tcache of about 600 bytes, and an arena attachment) in a thread that may never
//! allocate otherwise, and tear it down again at exit: measured as most of the library's cost per
//! thread and ~800 bytes of RSS per parked thread (issue 6). Instead the new thread reads the
//! packet in place, drops it and pushes the empty cell onto a lock-free list; the next hook
//! takes the whole list with one swap, reuses its first cell and frees the rest on the creator's
//! side, whose malloc cache is warm. Pushes and a take-everything swap cannot suffer ABA, so no lock is
//! needed, and a fork child simply inherits the list.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use super::real::StartRoutine;
use crate::registry::ChildPlan;

pub struct StartPacket {
    pub start: StartRoutine,
    pub arg: *mut c_void,
    pub plan: ChildPlan,
    /// The creator's mark of a memory policy the library set (`PerThread::preferred_node`): the
    /// kernel copies the policy into the new thread, so the mark goes with it.
    pub preferred_node: usize,
}

/// The library's start packets.
static PACKETS: RecycledCells<StartPacket> = RecycledCells::new();

/// Creator side: a cell holding `start`, `arg`, the creator's policy mark and the plan `plan` makes, as the pointer the
/// trampoline receives. The plan is made into the cell, not moved there. A panic in `plan`
/// leaves the cell to the allocator (a bug's path; the hook then fails open).
#[inline(always)]
pub fn hand_over(
    start: StartRoutine,
    arg: *mut c_void,
    preferred_node: usize,
    plan: impl FnOnce() -> ChildPlan,
) -> *mut c_void {
    PACKETS.hand_over(|| StartPacket {
        start,
        arg,
        plan: plan(),
        preferred_node,
    })
}

/// New-thread side: the packet, read in place (a copy of the plan would cost more than using
/// it). The thread retires it with [`retire`] once it has registered.
///
/// # Safety
/// As [`RecycledCells::open`].
#[inline(always)]
pub unsafe fn open<'a>(raw: *mut c_void) -> &'a mut StartPacket {
    // SAFETY: the caller's promise, passed on.
    unsafe { RecycledCells::open(raw) }
}

/// New-thread side: drops what is left of the packet in place and retires its cell.
///
/// # Safety
/// As [`RecycledCells::retire`].
#[inline(always)]
pub unsafe fn retire(raw: *mut c_void) {
    // SAFETY: the caller's promise, passed on.
    unsafe { PACKETS.retire(raw) }
}

/// Creator side, when the real `pthread_create` failed: the packet comes back, the cell is freed.
///
/// # Safety
/// As [`RecycledCells::reclaim`].
pub unsafe fn reclaim(raw: *mut c_void) -> StartPacket {
    // SAFETY: the caller's promise, passed on.
    unsafe { RecycledCells::reclaim(raw) }
}

/// Cells handed from a creator to the thread it starts, and given back without a `free` in that
/// thread (see the module's documentation). Pushes and a take-everything swap cannot suffer ABA,
/// so no lock is needed.
pub struct RecycledCells<T> {
    /// Empty cells given back by started threads.
    retired: AtomicPtr<Cell<T>>,
}

struct Cell<T> {
    next: *mut Cell<T>,
    value: MaybeUninit<T>,
}

impl<T> RecycledCells<T> {
    pub const fn new() -> Self {
        RecycledCells {
            retired: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Creator side: a cell holding what `make` makes (made into the cell, not moved there), as
    /// the pointer the new thread receives.
    #[inline(always)]
    pub fn hand_over(&self, make: impl FnOnce() -> T) -> *mut c_void {
        // A plain load first: an empty list needs no read-modify-write of a shared line.
        let chain = if self.retired.load(Ordering::Relaxed).is_null() {
            ptr::null_mut()
        } else {
            self.retired.swap(ptr::null_mut(), Ordering::Acquire)
        };
        let cell = if chain.is_null() {
            Box::into_raw(Box::new(Cell {
                next: ptr::null_mut(),
                value: MaybeUninit::uninit(),
            }))
        } else {
            // SAFETY: the swap made this thread the only owner of every cell in the chain; their
            // values were dropped by `retire`, so freeing a cell drops nothing but the allocation.
            unsafe {
                let mut rest = (*chain).next;
                while !rest.is_null() {
                    let next = (*rest).next;
                    drop(Box::from_raw(rest));
                    rest = next;
                }
            }
            chain
        };
        // SAFETY: `cell` is owned by this thread alone (fresh, or taken from the list above).
        unsafe {
            (*cell).next = ptr::null_mut();
            (*cell).value.write(make());
        }
        cell.cast()
    }

    /// New-thread side: the value, in place.
    ///
    /// # Safety
    /// `raw` came from `hand_over` of a `RecycledCells<T>`, is opened once, by the thread it was
    /// handed to, and the reference is not used after [`Self::retire`].
    #[inline(always)]
    pub unsafe fn open<'a>(raw: *mut c_void) -> &'a mut T {
        // SAFETY: the caller owns the cell, whose value `hand_over` initialised.
        unsafe { (*(raw as *mut Cell<T>)).value.assume_init_mut() }
    }

    /// New-thread side: drops the value in place and gives the cell back. Neither allocates nor
    /// frees.
    ///
    /// # Safety
    /// `raw` came from this list's `hand_over` and is retired once, by the thread it was handed
    /// to, after which nothing of it is used.
    #[inline(always)]
    pub unsafe fn retire(&self, raw: *mut c_void) {
        let cell = raw as *mut Cell<T>;
        // SAFETY: the caller owns the cell, whose value is initialised; dropping it leaves the
        // cell's value logically uninitialised, which is how a retired cell is kept.
        unsafe { (*cell).value.assume_init_drop() };
        let mut head = self.retired.load(Ordering::Relaxed);
        loop {
            // SAFETY: the cell is still ours until the exchange below publishes it.
            unsafe { (*cell).next = head };
            match self.retired.compare_exchange_weak(
                head,
                cell,
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Creator side, when no thread was started with the cell: the value comes back, the cell is
    /// freed.
    ///
    /// # Safety
    /// `raw` came from `hand_over` of a `RecycledCells<T>` and no thread received it.
    pub unsafe fn reclaim(raw: *mut c_void) -> T {
        // SAFETY: no thread received the cell, so it is still the creator's alone, value included.
        let cell = unsafe { Box::from_raw(raw as *mut Cell<T>) };
        // SAFETY: `hand_over` initialised the value and nothing moved it out.
        unsafe { cell.value.assume_init_read() }
    }

    /// The cells given back and not yet reused: how many, taking them all (for the tests).
    /// The cells given back and not yet reused: how many, taking them all (for the tests).
    #[cfg(test)]
    fn take_retired(&self) -> usize {
        let mut count = 0;
        let mut cell = self.retired.swap(ptr::null_mut(), Ordering::Acquire);
        while !cell.is_null() {
            count += 1;
            // SAFETY: the swap made the chain ours; the values were dropped by `retire`.
            let boxed = unsafe { Box::from_raw(cell) };
            cell = boxed.next;
        }
        count
    }
}

impl<T> Default for RecycledCells<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;

    extern "C" fn routine(arg: *mut c_void) -> *mut c_void {
        arg
    }

    fn packet(arg: usize) -> *mut c_void {
        hand_over(routine, arg as *mut c_void, arg + 1, || {
            Registry::default().plan_child(None, false, None)
        })
    }

    #[test]
    fn cells_are_reused_and_packets_survive_the_trip() {
        let first = packet(1);
        // SAFETY: handed over above, opened once.
        let opened = unsafe { open(first) };
        assert_eq!((opened.arg as usize, opened.preferred_node), (1, 2));
        // SAFETY: opened above, retired once.
        unsafe { retire(first) };
        let second = packet(2);
        assert_eq!(first, second, "a retired cell is reused");
        // SAFETY: handed over above, never started.
        assert_eq!(unsafe { reclaim(second) }.arg as usize, 2);
    }

    #[test]
    fn concurrent_retirements_lose_no_cell() {
        // A list of its own: the library's packets are process-wide, and other tests use them.
        static CELLS: RecycledCells<usize> = RecycledCells::new();
        let handed: Vec<usize> = (0..64).map(|i| CELLS.hand_over(|| i) as usize).collect();
        std::thread::scope(|s| {
            for chunk in handed.chunks(16) {
                s.spawn(move || {
                    for &raw in chunk {
                        // SAFETY: each cell is opened and retired once, by one thread.
                        unsafe {
                            assert!(*RecycledCells::<usize>::open(raw as *mut c_void) < 64);
                            CELLS.retire(raw as *mut c_void);
                        }
                    }
                });
            }
        });
        assert_eq!(
            CELLS.take_retired(),
            64,
            "every retired cell is on the list"
        );
    }
}
