//! Raw per-thread affinity syscalls, sized from the kernel.
//!
//! The engine sets masks with the raw syscall, never through `sched_setaffinity`: inside the
//! preloaded library that symbol resolves to our own observing shim. Buffers are sized from what
//! the kernel reports (`nr_cpu_ids`), not from `cpu_set_t`, so hosts past 1024 CPUs work.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::mask::CpuMask;
use crate::registry::{ThreadMasks, Tid};

static MASK_BYTES: AtomicUsize = AtomicUsize::new(0);

/// The kernel's affinity mask size in bytes, found once by growing the buffer until
/// `sched_getaffinity` stops answering `EINVAL`.
pub fn mask_bytes() -> usize {
    let known = MASK_BYTES.load(Ordering::Relaxed);
    if known != 0 {
        return known;
    }
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
/// write one per thread.
const STACK_MASK_BYTES: usize = 128;

pub fn get_mask(tid: Tid) -> Result<CpuMask, i32> {
    let len = mask_bytes();
    let mut small = [0u8; STACK_MASK_BYTES];
    let mut large = Vec::new();
    let buf: &mut [u8] = if len <= STACK_MASK_BYTES {
        &mut small[..len]
    } else {
        large.resize(len, 0);
        &mut large
    };
    // SAFETY: the kernel writes at most `len` bytes into `buf`, which is `len` bytes long.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getaffinity, tid, len, buf.as_mut_ptr()) };
    if rc < 0 {
        return Err(errno());
    }
    Ok(CpuMask::from_kernel_bytes(&buf[..rc as usize]))
}

pub fn set_mask(tid: Tid, mask: &CpuMask) -> Result<(), i32> {
    let bytes = mask.to_kernel_bytes(mask_bytes());
    // SAFETY: the kernel reads `bytes.len()` bytes from a live buffer of that length.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_setaffinity,
            tid,
            bytes.len(),
            bytes.as_ptr(),
        )
    };
    if rc < 0 {
        Err(errno())
    } else {
        Ok(())
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
}
