//! The raw system calls the safe layers need, behind safe functions: per-thread affinity, thread
//! and process ids, errno, the log's `write(2)`, the step lock's `flock`, `atexit` and
//! `pthread_atfork`, the fork mark's wipe-on-fork page, and the CLI's `SIGPIPE` reset and
//! effective uid.
//!
//! Masks are set with the raw syscall, never through `sched_setaffinity`: inside the preloaded
//! library that symbol resolves to our own observing shim. Buffers are sized from what the kernel
//! reports (`nr_cpu_ids`), not from `cpu_set_t`, so hosts past 1024 CPUs work. The functions the
//! `pthread_create` trampoline calls (`tid_of`, `set_mask`, `errno`, `set_errno`) neither
//! allocate (up to 1024 CPUs) nor take a lock.

use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::identity::Tid;
use crate::mask::CpuMask;

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
/// write one per thread, and a new thread that moves itself must not allocate (see
/// `engine::packets`).
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

/// The mask of `tid` (0 = the calling thread); errors are positive errno values.
pub fn get_mask(tid: Tid) -> Result<CpuMask, i32> {
    with_mask(tid, CpuMask::from_kernel_bytes)
}

/// Reads `tid`'s mask and hands the kernel's bytes to `look`.
pub fn with_mask<R>(tid: Tid, look: impl FnOnce(&[u8]) -> R) -> Result<R, i32> {
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

/// Sets the mask of `tid` (0 = the calling thread) with the raw syscall.
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

/// The calling thread's mask as words, read into `out` (which bounds it, so nothing is
/// allocated); the number of words the kernel wrote, or `None` when it refused.
pub fn own_mask_words(out: &mut [u64]) -> Option<usize> {
    // SAFETY: the kernel writes at most `size_of_val(out)` bytes into `out`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_getaffinity,
            0,
            std::mem::size_of_val(out),
            out.as_mut_ptr(),
        )
    };
    (rc > 0).then(|| (rc as usize).div_ceil(8))
}

/// `MPOL_DEFAULT` and `MPOL_PREFERRED` of `set_mempolicy(2)`.
pub const MPOL_DEFAULT: i32 = 0;
pub const MPOL_PREFERRED: i32 = 1;
/// Node masks as wide as the kernel's largest `MAX_NUMNODES` (`CONFIG_NODES_SHIFT` 10).
const NODE_MASK_WORDS: usize = 1024 / 64;

/// The calling thread's memory policy: its mode and its nodes; errors are positive errno values.
pub fn memory_policy() -> Result<(i32, Vec<usize>), i32> {
    let (mode, words) = memory_policy_words()?;
    let nodes = (0..NODE_MASK_WORDS * 64)
        .filter(|&n| words[n / 64] & (1 << (n % 64)) != 0)
        .collect();
    Ok((mode, nodes))
}

/// Whether the calling thread's memory policy is `MPOL_PREFERRED` on `node` alone; errors are
/// positive errno values. No allocation: a `vfork` child and a fork child's handler may ask.
pub fn prefers_only(node: usize) -> Result<bool, i32> {
    let (mode, words) = memory_policy_words()?;
    let only = |i: usize, w: u64| w == if i == node / 64 { 1 << (node % 64) } else { 0 };
    Ok(mode == MPOL_PREFERRED && words.iter().enumerate().all(|(i, &w)| only(i, w)))
}

/// [`memory_policy`] as the kernel writes it: the mode and the node mask's words.
fn memory_policy_words() -> Result<(i32, [u64; NODE_MASK_WORDS]), i32> {
    let mut mode: libc::c_int = -1;
    let mut words = [0u64; NODE_MASK_WORDS];
    // SAFETY: the kernel writes one int to `mode` and at most `maxnode` bits into `words`, which
    // holds NODE_MASK_WORDS * 64 of them; no address is passed (flags 0: the thread's policy).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            words.as_mut_ptr(),
            (NODE_MASK_WORDS * 64) as libc::c_ulong,
            std::ptr::null_mut::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    if rc < 0 {
        return Err(errno());
    }
    Ok((mode, words))
}

/// Sets the calling thread's memory policy: `MPOL_PREFERRED` on `node`, or `MPOL_DEFAULT`.
pub fn set_memory_policy(preferred: Option<usize>) -> Result<(), i32> {
    let mut words = [0u64; NODE_MASK_WORDS];
    let mode = match preferred {
        Some(node) if node < NODE_MASK_WORDS * 64 => {
            words[node / 64] |= 1 << (node % 64);
            MPOL_PREFERRED
        }
        Some(_) => return Err(libc::EINVAL),
        None => MPOL_DEFAULT,
    };
    let (mask, maxnode) = match preferred {
        Some(_) => (words.as_ptr(), (NODE_MASK_WORDS * 64) as libc::c_ulong),
        None => (std::ptr::null(), 0),
    };
    // SAFETY: the kernel reads at most `maxnode` bits from `mask`, a live array of that many
    // (or nothing, for MPOL_DEFAULT); the policy is the calling thread's alone.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, mask, maxnode) };
    if rc < 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

/// `MPOL_MF_MOVE` of `move_pages(2)`: only pages this process alone maps (a page shared with
/// another process answers `-EACCES`), never `MPOL_MF_MOVE_ALL`.
const MPOL_MF_MOVE: libc::c_int = 1 << 1;

/// This process's pages at `addresses`: `status[i]` is the node page `i` lies on, or a negative
/// errno (`-ENOENT`: not present; `-EFAULT`: no such page). Nothing moves. Errors are positive
/// errno values (`ENOSYS` on a kernel without NUMA).
pub fn page_nodes(addresses: &[usize], status: &mut [i32]) -> Result<(), i32> {
    move_pages(addresses, None, status).map(|_| ())
}

/// Moves this process's pages at `addresses` to `node`; `status[i]` is then the node page `i`
/// lies on, or a negative errno (`-EBUSY`, `-EACCES` for a page shared with another process,
/// `-ENOMEM`), or [`NO_STATUS`] where the kernel wrote none. Returns the count the kernel gave
/// of pages it did not move: when a page of a group cannot migrate (long-term pinned, busy) it
/// gives up on the group and the pages after it, and writes no status for them, so after a
/// positive count the pages must be asked where they lie. Errors of the whole call are
/// positive errno values.
pub fn move_pages_to(addresses: &[usize], node: usize, status: &mut [i32]) -> Result<usize, i32> {
    let node = libc::c_int::try_from(node).map_err(|_| libc::EINVAL)?;
    let nodes = vec![node; addresses.len()];
    move_pages(addresses, Some(&nodes), status)
}

/// What `status` holds for a page `move_pages(2)` wrote nothing for: no node, no errno.
pub const NO_STATUS: i32 = i32::MIN;

/// The `/proc/self/pagemap` entries of this process's pages from `start` (page aligned, pages of
/// `page_bytes`): one 64-bit word per page into `out` (bit 63 present, bit 61 a file page or
/// shared anonymous memory, bit 56 mapped by this process alone). Reading it changes nothing.
pub fn pagemap_entries(
    pagemap: &std::fs::File,
    start: usize,
    page_bytes: usize,
    out: &mut [u64],
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut bytes = vec![0u8; out.len() * 8];
    pagemap.read_exact_at(&mut bytes, (start / page_bytes.max(1)) as u64 * 8)?;
    for (word, chunk) in out.iter_mut().zip(bytes.chunks_exact(8)) {
        *word = u64::from_ne_bytes(chunk.try_into().expect("chunks of 8"));
    }
    Ok(())
}

/// Reads one byte of each of this process's pages at `addresses` through `process_vm_readv(2)`
/// on itself: the kernel faults each page in as a read access would, so a page automatic NUMA
/// balancing marked for a hinting fault is made accessible again (after which `move_pages` sees
/// it), while an address unmapped meanwhile is an error, never a signal. Nothing is written.
/// Returns the bytes read; errors are positive errno values (`EPERM` under a seccomp profile).
pub fn read_one_byte_of_each(addresses: &[usize]) -> Result<usize, i32> {
    // IOV_MAX: the most iovecs one call takes.
    const IOV_MAX: usize = 1024;
    let mut sink = [0u8; IOV_MAX];
    let mut total = 0;
    for chunk in addresses.chunks(IOV_MAX) {
        let local = libc::iovec {
            iov_base: sink.as_mut_ptr().cast(),
            iov_len: chunk.len(),
        };
        let remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|&address| libc::iovec {
                iov_base: address as *mut libc::c_void,
                iov_len: 1,
            })
            .collect();
        // SAFETY: the kernel writes at most `chunk.len()` bytes into `sink` (the one local
        // iovec, of that length, inside the live array) and reads the remote addresses itself,
        // answering EFAULT for one not mapped; `remote` lives across the call.
        let rc = unsafe {
            libc::process_vm_readv(
                getpid(),
                &local,
                1,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if rc < 0 {
            return Err(errno());
        }
        total += rc as usize;
    }
    Ok(total)
}

/// Moves every page of this process that lies on one of `from` and is mapped by it alone to
/// `to` (`migrate_pages(2)` on itself, `MPOL_MF_MOVE` semantics): the kernel walks the page
/// tables itself and writes no memory policy. Returns the pages it could not move; errors are
/// positive errno values.
pub fn migrate_own_pages(from: &[usize], to: usize) -> Result<u64, i32> {
    let mut old = [0u64; NODE_MASK_WORDS];
    let mut new = [0u64; NODE_MASK_WORDS];
    for &node in from {
        if node >= NODE_MASK_WORDS * 64 {
            return Err(libc::EINVAL);
        }
        old[node / 64] |= 1 << (node % 64);
    }
    if to >= NODE_MASK_WORDS * 64 {
        return Err(libc::EINVAL);
    }
    new[to / 64] |= 1 << (to % 64);
    // SAFETY: pid 0 is this process; the kernel reads NODE_MASK_WORDS * 64 bits from each of
    // `old` and `new`, live arrays of that many, and changes where pages lie, never their
    // contents nor any memory policy.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_migrate_pages,
            0 as libc::pid_t,
            (NODE_MASK_WORDS * 64) as libc::c_ulong,
            old.as_ptr(),
            new.as_ptr(),
        )
    };
    if rc < 0 {
        Err(errno())
    } else {
        Ok(rc as u64)
    }
}

fn move_pages(
    addresses: &[usize],
    nodes: Option<&[i32]>,
    status: &mut [i32],
) -> Result<usize, i32> {
    if status.len() != addresses.len() || nodes.is_some_and(|n| n.len() != addresses.len()) {
        return Err(libc::EINVAL);
    }
    if addresses.is_empty() {
        return Ok(0);
    }
    // A status the kernel leaves unwritten must not read as node 0.
    status.fill(NO_STATUS);
    let nodes_ptr = nodes.map_or(std::ptr::null(), |n| n.as_ptr());
    // SAFETY: pid 0 is this process; the kernel reads `addresses.len()` addresses (values, never
    // dereferenced by us: an unmapped one answers -EFAULT in its status) and as many nodes when
    // given, and writes as many statuses into `status`, whose lengths were checked above.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::pid_t,
            addresses.len() as libc::c_ulong,
            addresses.as_ptr(),
            nodes_ptr,
            status.as_mut_ptr(),
            if nodes.is_some() { MPOL_MF_MOVE } else { 0 },
        )
    };
    // A positive count: pages not moved, which `status` may not tell (see `move_pages_to`).
    if rc < 0 {
        Err(errno())
    } else {
        Ok(rc as usize)
    }
}

/// The kernel's base page size (4, 16 or 64 KiB).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// The kernel thread id of `thread`, without a syscall: glibc answers `pthread_getcpuclockid`
/// from the tid the kernel stored in the thread's descriptor at clone, and the clock id encodes
/// it by the kernel's ABI (`CPUCLOCK_PID`: the bitwise complement of the tid, shifted left by
/// 3, with the low bits naming a per-thread scheduler clock). A syscall answers otherwise.
/// `thread` must be a live thread's handle (the caller's own, in practice).
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

/// A word the kernel gives every fork child as zero (a page under `MADV_WIPEONFORK`, Linux
/// 4.14): whatever a process writes there, the child of any fork of it (`_Fork`, a raw `clone`,
/// a `fork` with handlers) reads 0, while a `vfork` child, which shares the page, reads the same.
/// `None` when the kernel refuses the mapping or the advice.
pub fn wipe_on_fork_word() -> Option<&'static AtomicU64> {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    // SAFETY: a new anonymous private mapping; no existing memory is named.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `addr` is the page just mapped, `page` bytes long.
    if unsafe { libc::madvise(addr, page, libc::MADV_WIPEONFORK) } != 0 {
        // SAFETY: the same mapping, used by nothing yet.
        unsafe { libc::munmap(addr, page) };
        return None;
    }
    // SAFETY: the mapping is never unmapped, so it lives as long as the process; it is page
    // aligned, zeroed and writable, and an `AtomicU64` is a `u64` in memory.
    Some(unsafe { &*(addr as *const AtomicU64) })
}

/// The calling thread's pthread handle.
#[inline]
pub fn pthread_self() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() }
}

/// `AT_SECURE`: a setuid/setgid or capability-raising exec, where a preloaded library must not act.
pub fn is_secure_execution() -> bool {
    // SAFETY: getauxval only reads the auxiliary vector.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

#[inline]
pub fn errno() -> i32 {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() }
}

#[inline]
pub fn set_errno(value: i32) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = value }
}

/// Ends the process at once with `status`: no atexit handler, no destructor, no flush.
pub fn exit_now(status: i32) -> ! {
    // SAFETY: _exit has no preconditions and does not return.
    unsafe { libc::_exit(status) }
}

/// Runs `handler` at process exit (`atexit`), after `main` returns or at `exit`.
pub fn at_exit(handler: extern "C" fn()) {
    // SAFETY: registering a plain extern "C" function with no arguments; code of a program or of
    // a preloaded library (which is never unloaded) lives as long as the process.
    unsafe { libc::atexit(handler) };
}

/// Registers fork handlers (`pthread_atfork`): `prepare` before a fork, `parent` and `child`
/// after it in each process.
pub fn at_fork(prepare: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) {
    // SAFETY: three plain extern "C" functions with no arguments, living as long as the process
    // (as in `at_exit`).
    unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
}

/// Writes all of `bytes` to fd 2 with raw `write(2)` calls: no buffered stream, no lock that a
/// fork or a signal could leave held. A closed or failing fd 2 drops the rest.
pub fn write_stderr(mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe a live byte slice; fd 2 may be closed, in
        // which case write fails and the line is dropped.
        let n = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// An exclusive, non-blocking `flock` on `file`; `EWOULDBLOCK` when another open file holds it.
pub fn try_flock_exclusive(file: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: flock on a file descriptor the caller keeps open across the call; no memory is
    // passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Gives `SIGPIPE` its default action back (Rust ignores it). Call before any thread exists.
pub fn default_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL; the caller runs before any thread
    // exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// The effective user id (`geteuid`, which cannot fail).
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid takes nothing and only reads the process's credentials.
    unsafe { libc::geteuid() }
}

/// `mkfifo` with mode 0644, for tests that plant a FIFO where a file is expected.
/// The width in columns of the terminal on descriptor `fd` (`TIOCGWINSZ`); `None` when `fd` is
/// not a terminal or the terminal reports no width.
pub fn terminal_columns(fd: std::os::unix::io::RawFd) -> Option<usize> {
    let mut size = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the struct the pointer names, which lives
    // for the call; an fd that is no terminal fails with ENOTTY and writes nothing.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut size as *mut libc::winsize) };
    (rc == 0 && size.ws_col > 0).then_some(usize::from(size.ws_col))
}

#[cfg(test)]
pub fn make_fifo(path: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: mkfifo reads a NUL-terminated path that lives across the call.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o644) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
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
                let mut words = [0u64; 16];
                let n = own_mask_words(&mut words).unwrap();
                let bytes: Vec<u8> = words[..n].iter().flat_map(|w| w.to_le_bytes()).collect();
                assert_eq!(CpuMask::from_kernel_bytes(&bytes), one);
            });
        });
        assert_eq!(get_mask(tid).unwrap(), before);
        assert_eq!(set_mask(tid, &CpuMask::new()), Err(libc::EINVAL));
    }

    #[test]
    fn tid_of_a_thread_handle_is_its_kernel_tid() {
        assert_eq!(tid_of(pthread_self()), gettid());
        let from_inside = std::thread::spawn(|| (tid_of(pthread_self()), gettid()))
            .join()
            .unwrap();
        assert_eq!(from_inside.0, from_inside.1);
        assert_ne!(from_inside.0, gettid());
    }

    /// On this machine's kernel, whatever its nodes: a page this thread touched lies on a node
    /// the kernel answers; moving it to that node keeps it there; a node the kernel cannot have
    /// is refused.
    #[test]
    fn page_nodes_and_moves_on_the_real_kernel() {
        let page = vec![1u8; 1 << 16];
        let address = (page.as_ptr() as usize) & !4095;
        let mut status = [0i32; 1];
        match page_nodes(&[address], &mut status) {
            // A kernel without NUMA.
            Err(libc::ENOSYS) => return,
            Err(e) => panic!("move_pages: errno {e}"),
            Ok(()) => {}
        }
        assert!(status[0] >= 0, "status {}", status[0]);
        let node = status[0] as usize;
        assert_eq!(move_pages_to(&[address], node, &mut status), Ok(0));
        assert_eq!(status[0], node as i32);
        assert_eq!(memory_policy().map(|(mode, _)| mode), Ok(MPOL_DEFAULT));
        assert_eq!(page_nodes(&[address], &mut []), Err(libc::EINVAL));
        // pagemap: the touched page is present and this process's alone; reading a byte of it
        // through process_vm_readv changes nothing; an unmapped address is an error.
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut entry = [0u64; 1];
        pagemap_entries(&pagemap, address, 4096, &mut entry).unwrap();
        assert_eq!(entry[0] >> 63, 1, "present: {:#x}", entry[0]);
        assert_eq!((entry[0] >> 56) & 1, 1, "exclusive: {:#x}", entry[0]);
        assert_eq!(read_one_byte_of_each(&[address, address + 4096]), Ok(2));
        assert_eq!(read_one_byte_of_each(&[8]), Err(libc::EFAULT));
        assert_eq!(page.iter().map(|&b| b as usize).sum::<usize>(), 1 << 16);
    }

    #[test]
    fn the_effective_uid_owns_this_processs_proc_entry() {
        use std::os::unix::fs::MetadataExt;
        let proc_self = std::fs::metadata("/proc/self").unwrap();
        assert_eq!(effective_uid(), proc_self.uid());
    }

    #[test]
    fn a_file_has_no_terminal_width() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(terminal_columns(file.as_raw_fd()), None);
    }
}
