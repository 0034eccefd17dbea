//! Raw per-thread affinity syscalls, sized from the kernel.
//!
//! The engine sets masks with the raw syscall, never through `sched_setaffinity`: inside the
//! preloaded library that symbol resolves to our own observing shim. Buffers are sized from what
//! the kernel reports (`nr_cpu_ids`), not from `cpu_set_t`, so hosts past 1024 CPUs work.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::mask::CpuMask;
use crate::registry::{ThreadMasks, Tid};

static MASK_BYTES: AtomicUsize = AtomicUsize::new(0);

/// The kernel's affinity mask size in bytes (`nr_cpu_ids` rounded up to whole longs).
#[inline]
pub fn mask_bytes() -> usize {
    match MASK_BYTES.load(Ordering::Relaxed) {
        0 => find_mask_bytes(),
        known => known,
    }
}

/// Grows the buffer until `sched_getaffinity` stops answering `EINVAL`; runs once.
#[cold]
fn find_mask_bytes() -> usize {
    let mut len = 128;
    let found = loop {
        let mut buf = vec![0u8; len];
        // SAFETY: the kernel writes at most `len` bytes into `buf`, which is `len` bytes long.
        let rc = unsafe { libc::syscall(libc::SYS_sched_getaffinity, 0, len, buf.as_mut_ptr()) };
        if rc > 0 {
            break rc as usize;
        }
        if errno() != libc::EINVAL || len >= 1 << 20 {
            break 128;
        }
        len *= 2;
    };
    MASK_BYTES.store(found, Ordering::Relaxed);
    found
}

/// Masks of hosts up to 1024 CPUs go through a stack buffer: configure and release read and
/// write one per thread, and a new thread that moves itself must not allocate (see `packets`).
const STACK_MASK_BYTES: usize = 128;

/// Runs `f` on a zeroed buffer of the kernel's mask size.
fn with_buffer<R>(f: impl FnOnce(&mut [u8]) -> R) -> R {
    let len = mask_bytes();
    if len <= STACK_MASK_BYTES {
        f(&mut [0u8; STACK_MASK_BYTES][..len])
    } else {
        f(&mut vec![0u8; len])
    }
}

pub fn get_mask(tid: Tid) -> Result<CpuMask, i32> {
    with_mask(tid, CpuMask::from_kernel_bytes)
}

/// Reads `tid`'s mask and hands the kernel's bytes to `look`.
fn with_mask<R>(tid: Tid, look: impl FnOnce(&[u8]) -> R) -> Result<R, i32> {
    with_buffer(|buf| {
        // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getaffinity,
                tid,
                buf.len(),
                buf.as_mut_ptr(),
            )
        };
        if rc < 0 {
            Err(errno())
        } else {
            Ok(look(&buf[..rc as usize]))
        }
    })
}

pub fn set_mask(tid: Tid, mask: &CpuMask) -> Result<(), i32> {
    with_buffer(|buf| {
        mask.write_kernel_bytes(buf);
        // SAFETY: the kernel reads `buf.len()` bytes from a live buffer of that length.
        let rc =
            unsafe { libc::syscall(libc::SYS_sched_setaffinity, tid, buf.len(), buf.as_ptr()) };
        if rc < 0 {
            Err(errno())
        } else {
            Ok(())
        }
    })
}

/// The kernel thread id of `thread`, without a syscall: glibc answers `pthread_getcpuclockid`
/// from the tid the kernel stored in the thread's descriptor at clone, and the clock id encodes
/// it by the kernel's ABI (`CPUCLOCK_PID`: the bitwise complement of the tid, shifted left by
/// 3, with the low bits naming a per-thread scheduler clock). A syscall answers otherwise.
pub fn tid_of(thread: libc::pthread_t) -> Tid {
    const PER_THREAD_SCHED_CLOCK: libc::clockid_t = 6;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `thread` is a live thread's handle (the caller's own); `clock` is a valid
    // out-pointer.
    let rc = unsafe { libc::pthread_getcpuclockid(thread, &mut clock) };
    let tid = !(clock >> 3);
    if rc == 0 && clock & 7 == PER_THREAD_SCHED_CLOCK && tid > 0 {
        tid
    } else {
        gettid()
    }
}

pub fn gettid() -> Tid {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as Tid }
}

pub fn getpid() -> Tid {
    // SAFETY: getpid takes no arguments and cannot fail.
    unsafe { libc::getpid() }
}

/// `AT_SECURE`: a setuid/setgid or capability-raising exec, where a preloaded library must not act.
pub fn is_secure_execution() -> bool {
    // SAFETY: getauxval only reads the auxiliary vector.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

pub fn errno() -> i32 {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() }
}

pub fn set_errno(value: i32) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = value }
}

/// The real kernel, for the registry model.
pub struct Kernel;

impl ThreadMasks for Kernel {
    fn get(&self, tid: Tid) -> Result<CpuMask, i32> {
        get_mask(tid)
    }
    fn set(&self, tid: Tid, mask: &CpuMask) -> Result<(), i32> {
        set_mask(tid, mask)
    }
    fn thread_count(&self) -> usize {
        // Field 20 of /proc/self/stat, counted from the last ')' (the name may hold spaces).
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let after = &stat[stat.rfind(')')? + 1..];
                after.split_whitespace().nth(17)?.parse().ok()
            })
            .unwrap_or_else(|| self.thread_ids().len())
    }
    fn thread_ids(&self) -> Vec<Tid> {
        std::fs::read_dir("/proc/self/task")
            .map(|dir| {
                dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
    fn differs_from(&self, tid: Tid, expected: &CpuMask) -> Result<Option<CpuMask>, i32> {
        with_mask(tid, |bytes| {
            (!expected.equals_kernel_bytes(bytes)).then(|| CpuMask::from_kernel_bytes(bytes))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_sets_this_threads_real_mask() {
        let before = get_mask(0).unwrap();
        assert!(!before.is_empty());
        assert!(mask_bytes() >= 8 && mask_bytes().is_multiple_of(8));
        let one = CpuMask::from_cpus([before.first().unwrap()]);
        let tid = gettid();
        std::thread::scope(|s| {
            s.spawn(|| {
                let me = gettid();
                assert_ne!(me, tid);
                set_mask(me, &one).unwrap();
                assert_eq!(get_mask(0).unwrap(), one);
            });
        });
        assert_eq!(get_mask(tid).unwrap(), before);
        assert_eq!(set_mask(tid, &CpuMask::new()), Err(libc::EINVAL));
    }

    #[test]
    fn tid_of_a_thread_handle_is_its_kernel_tid() {
        // SAFETY: pthread_self has no preconditions.
        assert_eq!(tid_of(unsafe { libc::pthread_self() }), gettid());
        let from_inside = std::thread::spawn(|| {
            // SAFETY: as above.
            (tid_of(unsafe { libc::pthread_self() }), gettid())
        })
        .join()
        .unwrap();
        assert_eq!(from_inside.0, from_inside.1);
        assert_ne!(from_inside.0, gettid());
    }
}
