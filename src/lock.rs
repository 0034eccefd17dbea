//! The one lock type of the library: a futex mutex that a preloaded library can take anywhere.
//!
//! Why not the obvious ones: `std::sync::Mutex` cannot be unlocked in a fork child whose parent
//! took it in a `pthread_atfork` prepare handler, and `parking_lot` parks through a thread-local
//! with a destructor (registering it takes the loader lock, which a new thread in our trampoline
//! must never wait for). A spinning lock has no such problem, but a `SCHED_FIFO` thread spinning
//! on it starves a lower-priority holder on its core forever: `sched_yield` only yields to equal
//! priorities. So waiters spin briefly, then sleep in the kernel (`FUTEX_WAIT`), which lets any
//! holder run; the lock neither allocates nor touches a thread-local with a destructor.
//!
//! A signal handler may call an interposed function (`sched_setaffinity` is async-signal-safe)
//! while its thread is inside the library holding a lock: waiting then would wait forever. Every
//! acquisition counts itself in a plain thread-local counter *before* it takes the lock, so code
//! reachable from a handler asks [`held_by_this_thread`] and takes another way.

use std::cell::{Cell, UnsafeCell};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::per_thread;

const UNLOCKED: u32 = 0;
const LOCKED: u32 = 1;
/// Locked, and somebody may be asleep waiting for it: unlocking must wake one.
const CONTENDED: u32 = 2;

/// Spins before sleeping: the critical sections are short, and a futex round trip is not.
const SPINS_BEFORE_SLEEP: u32 = 100;

/// Whether this thread holds, or is acquiring, any [`EngineLock`]. True in a signal handler that
/// interrupted the library on this thread.
pub fn held_by_this_thread() -> bool {
    per_thread::with(|t| t.locks_held.get()) > 0
}

/// Adds `by` to this thread's count of locks held; `count` is the caller's block when it has
/// looked it up already (see [`crate::per_thread`]). Plain wrapping arithmetic, one instruction:
/// every count comes from a guard whose drop takes it back, so it neither overflows nor goes
/// below zero (saturating arithmetic cost ~30 instructions a thread's birth and exit).
fn count_held(count: Option<&Cell<u32>>, by: i32) {
    let add = |held: &Cell<u32>| held.set(held.get().wrapping_add_signed(by));
    match count {
        Some(held) => add(held),
        None => per_thread::with(|t| add(&t.locks_held)),
    }
}

pub struct EngineLock<T> {
    state: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and the state word admits one guard at a
// time, so sharing the lock shares `T` between threads one at a time, as a Mutex does.
unsafe impl<T: Send> Sync for EngineLock<T> {}
// SAFETY: moving the lock moves the `T` it owns.
unsafe impl<T: Send> Send for EngineLock<T> {}

impl<T> EngineLock<T> {
    pub const fn new(value: T) -> Self {
        EngineLock {
            state: AtomicU32::new(UNLOCKED),
            value: UnsafeCell::new(value),
        }
    }

    pub fn lock(&self) -> EngineGuard<'_, T> {
        self.lock_with_count(None)
    }

    /// [`Self::lock`] for a caller that holds its thread's block already (`locks_held` of
    /// [`crate::per_thread::with`]): no thread-local lookup to take it, none to let it go.
    pub fn lock_counted<'a>(&'a self, locks_held: &'a Cell<u32>) -> EngineGuard<'a, T> {
        self.lock_with_count(Some(locks_held))
    }

    #[inline]
    fn lock_with_count<'a>(&'a self, count: Option<&'a Cell<u32>>) -> EngineGuard<'a, T> {
        // Counted first: a signal arriving between the acquisition and the count would otherwise
        // find the lock taken by its own thread and not know it.
        count_held(count, 1);
        if self
            .state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        EngineGuard { lock: self, count }
    }

    /// [`Self::lock`], giving up after `patience`, for code a signal handler may run: the thread
    /// it interrupted may hold what this lock's holder is waiting for (a malloc arena that
    /// `fork` locks after its prepare handlers took this lock, or that the holder's next
    /// allocation needs), and then waiting for the holder would wait forever.
    ///
    /// `give_up` is asked at least every millisecond while it waits: true ends the wait at once
    /// (the caller knows the holder will not let go soon).
    pub fn lock_within(
        &self,
        patience: std::time::Duration,
        give_up: impl Fn() -> bool,
    ) -> Option<EngineGuard<'_, T>> {
        count_held(None, 1);
        if self
            .state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return Some(EngineGuard {
                lock: self,
                count: None,
            });
        }
        // The monotonic clock is read through the vDSO: async-signal-safe.
        let deadline = std::time::Instant::now() + patience;
        loop {
            if self.state.swap(CONTENDED, Ordering::Acquire) == UNLOCKED {
                return Some(EngineGuard {
                    lock: self,
                    count: None,
                });
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || give_up() {
                count_held(None, -1);
                return None;
            }
            let slice = std::time::Duration::from_millis(1);
            futex_wait(&self.state, CONTENDED, Some(left.min(slice)));
        }
    }

    #[cold]
    fn lock_contended(&self) {
        for _ in 0..SPINS_BEFORE_SLEEP {
            if self.state.load(Ordering::Relaxed) == UNLOCKED
                && self
                    .state
                    .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
            std::hint::spin_loop();
        }
        // Drepper's "mutex 2": whoever takes the lock from here on marks it contended, so the
        // holder's unlock wakes a sleeper.
        while self.state.swap(CONTENDED, Ordering::Acquire) != UNLOCKED {
            futex_wait(&self.state, CONTENDED, None);
        }
    }

    fn unlock(&self, count: Option<&Cell<u32>>) {
        if self.state.swap(UNLOCKED, Ordering::Release) == CONTENDED {
            futex_wake_one(&self.state);
        }
        count_held(count, -1);
    }

    /// Takes the lock for a fork: the guard is forgotten, so that the lock stays held until the
    /// fork handlers release it with [`Self::force_unlock`] in the parent and in the child.
    pub fn hold_for_fork(&self) {
        std::mem::forget(self.lock());
    }

    /// Releases a lock taken by [`Self::hold_for_fork`].
    ///
    /// # Safety
    /// This thread took the lock with `hold_for_fork` and holds no guard of it.
    pub unsafe fn force_unlock(&self) {
        self.unlock(None);
    }
}

pub struct EngineGuard<'a, T> {
    lock: &'a EngineLock<T>,
    /// The holder's count, when it handed it over at locking.
    count: Option<&'a Cell<u32>>,
}

impl<T> Deref for EngineGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while its thread holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for EngineGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for EngineGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.unlock(self.count);
    }
}

/// Sleeps while `word` holds `expected`, until a wake, a signal or `timeout` (none: no limit).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<std::time::Duration>) {
    let relative = timeout.map(|left| libc::timespec {
        tv_sec: left.as_secs() as libc::time_t,
        tv_nsec: left.subsec_nanos() as libc::c_long,
    });
    // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word`, which outlives the call; it returns
    // at once when the word no longer holds `expected`, and on a wake, a signal or the timeout
    // otherwise; the relative timeout, when given, lives on this stack for the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            relative
                .as_ref()
                .map_or(std::ptr::null(), |t| t as *const libc::timespec),
        );
    }
}

fn futex_wake_one(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; it touches no memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn excludes_and_counts_what_this_thread_holds() {
        let lock = EngineLock::new(0u64);
        assert!(!held_by_this_thread());
        {
            let mut g = lock.lock();
            *g += 1;
            assert!(held_by_this_thread());
        }
        assert!(!held_by_this_thread());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20_000 {
                        *lock.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*lock.lock(), 80_001);
    }

    #[test]
    fn a_lock_taken_with_the_threads_block_counts_there_as_any_other() {
        let lock = EngineLock::new(());
        crate::per_thread::with(|me| {
            let guard = lock.lock_counted(&me.locks_held);
            assert!(held_by_this_thread());
            let inner = EngineLock::new(());
            drop(inner.lock());
            assert!(held_by_this_thread(), "counted once each way");
            drop(guard);
        });
        assert!(!held_by_this_thread());
    }

    #[test]
    fn a_patient_waiter_gives_up_on_a_holder_that_never_lets_go_and_counts_nothing() {
        let lock = &EngineLock::new(0u64);
        let held = &std::sync::Barrier::new(2);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                let _g = lock.lock();
                held.wait();
                let _ = rx.recv();
            });
            held.wait();
            let started = std::time::Instant::now();
            assert!(lock
                .lock_within(Duration::from_millis(20), || false)
                .is_none());
            assert!(started.elapsed() >= Duration::from_millis(20));
            let started = std::time::Instant::now();
            assert!(lock.lock_within(Duration::from_secs(30), || true).is_none());
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "give_up ends the wait"
            );
            assert!(
                !held_by_this_thread(),
                "a waiter that gave up holds nothing"
            );
            tx.send(()).unwrap();
            let mut g = lock
                .lock_within(Duration::from_secs(10), || false)
                .expect("free once the holder let go");
            *g += 1;
        });
        assert_eq!(*lock.lock(), 1);
    }

    #[test]
    fn a_lock_held_for_fork_is_released_by_force() {
        let lock = EngineLock::new(());
        lock.hold_for_fork();
        assert!(held_by_this_thread());
        // SAFETY: taken by hold_for_fork on this thread just above.
        unsafe { lock.force_unlock() };
        assert!(!held_by_this_thread());
        drop(lock.lock());
    }

    #[test]
    fn a_sleeping_waiter_is_woken() {
        let lock = EngineLock::new(0u32);
        let g = lock.lock();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| *lock.lock() + 1);
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(g);
            assert_eq!(waiter.join().unwrap(), 1);
        });
    }
}
