//! Which loaded object holds a start routine, for `TLLM_AFFINITY_WORKER_LIBS` (SPEC §2).
//!
//! `dladdr` per thread creation would take the loader lock every time. Instead the executable
//! segments of every loaded object are kept, with their classification, in a snapshot that the
//! hook reads without any lock. `dl_iterate_phdr` runs again when the snapshot is stale (an
//! object was unloaded since: our `dlclose` shim counts unloads, and an address may now belong to
//! another object mapped in the unloaded one's place), or when an address falls outside all of
//! its segments and the loader's object count (`dlpi_adds`) says something was loaded since.
//! A new snapshot replaces the old one, which is freed once no reader can still hold it (see
//! [`publish`]). Never called with the registry lock held: a thread inside `dlopen` holds the
//! loader lock while its constructors create threads.
//!
//! A fork child never calls `dl_iterate_phdr` (nor anything else that takes the loader's
//! locks): another thread of the parent may have held them at the fork (inside `dlopen`,
//! `dlclose`, an unwinder or our own scan), and glibc resets only some of them in the child. It
//! answers from the snapshot it inherited, and where that is stale or misses, from the kernel's
//! list of its mappings (`/proc/self/maps`), which needs no lock of the process.

use std::ffi::{c_int, c_void, CStr};
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::lock::EngineLock;

#[derive(Debug, Clone, Copy)]
struct Segment {
    start: usize,
    end: usize,
    worker: bool,
}

pub(super) struct Snapshot {
    segments: Vec<Segment>,
    loads_seen: u64,
    unloads_seen: u64,
}

/// The snapshot in force; null until the first scan.
static CURRENT: AtomicPtr<Snapshot> = AtomicPtr::new(std::ptr::null_mut());

/// Lookups between reading CURRENT and their last use of the snapshot it pointed to.
static READERS: AtomicUsize = AtomicUsize::new(0);

/// `dlclose` calls that returned; a snapshot scanned before the last one is stale.
static UNLOADS: AtomicU64 = AtomicU64::new(0);

/// Snapshots replaced but perhaps still read (owned here until freed), and the lock that makes
/// publications one at a time (held across a fork by the engine's fork handlers).
#[allow(clippy::vec_box)]
pub(super) static PUBLISHED: EngineLock<Vec<Box<Snapshot>>> = EngineLock::new(Vec::new());

/// Set in a fork child, for the life of its image: the loader's locks may be held for good.
static IN_FORK_CHILD: AtomicBool = AtomicBool::new(false);

/// The last answer, packed in one word so that no reader sees half of another's update:
/// the address (user space fits in 47 bits), the answer, and the low 16 bits of the unload count
/// it was given under. Thread pools start the same routine again and again; a hit costs a load
/// and a compare instead of the snapshot's search. 0: empty.
static LAST: AtomicU64 = AtomicU64::new(0);

const ADDR_BITS: u32 = 47;

fn pack(addr: usize, worker: bool, unloads: u64) -> Option<u64> {
    let addr = addr as u64;
    (addr != 0 && addr >> ADDR_BITS == 0)
        .then_some(addr | (worker as u64) << ADDR_BITS | (unloads & 0xffff) << (ADDR_BITS + 1))
}

/// Answers whether `addr` lies in an object whose file name `is_worker` accepts.
pub fn in_worker_object(addr: usize, is_worker: &dyn Fn(&str) -> bool) -> bool {
    let unloads = UNLOADS.load(Ordering::Acquire);
    let last = LAST.load(Ordering::Relaxed);
    if let Some(key) = pack(addr, false, unloads) {
        if last & !(1 << ADDR_BITS) == key {
            return last & (1 << ADDR_BITS) != 0;
        }
    }
    let answer = lookup_uncached(addr, unloads, is_worker);
    if let Some(packed) = pack(addr, answer, unloads) {
        LAST.store(packed, Ordering::Relaxed);
    }
    answer
}

fn lookup_uncached(addr: usize, unloads: u64, is_worker: &dyn Fn(&str) -> bool) -> bool {
    READERS.fetch_add(1, Ordering::SeqCst);
    // SAFETY: a non-null CURRENT points to a snapshot leaked from a Box; a writer frees it only
    // after replacing it and then seeing no reader in flight, and this reader is counted from
    // before its load of CURRENT until after its last use (the argument is at [`publish`]).
    // Snapshots are immutable once published.
    let seen = unsafe { CURRENT.load(Ordering::SeqCst).as_ref() }
        .filter(|s| s.unloads_seen == unloads)
        .map(|s| (lookup(&s.segments, addr), s.loads_seen));
    READERS.fetch_sub(1, Ordering::SeqCst);
    if let Some((Some(worker), _)) = seen {
        return worker;
    }
    let forked = IN_FORK_CHILD.load(Ordering::Relaxed);
    // A miss, and nothing was loaded since the scan: the address is in no object.
    if !forked && seen.is_some_and(|(_, loads_seen)| loads_seen == loads_so_far()) {
        return false;
    }
    let snapshot = if forked {
        scan_mappings(is_worker)
    } else {
        scan(is_worker)
    };
    let answer = lookup(&snapshot.segments, addr).unwrap_or(false);
    publish(Box::new(snapshot));
    answer
}

/// Makes `snapshot` CURRENT and frees the replaced ones no reader can still hold.
///
/// Why a zero count frees every retired snapshot: all the accesses to CURRENT and READERS here
/// and in [`in_worker_object`] are SeqCst, so they fall in one total order. A reader that got a
/// retired pointer P loaded CURRENT before the swap that replaced P, which is at or before this
/// swap, which is before this load of READERS; its increment came before its load. So this load
/// sees its increment, and reads zero only if its decrement (after its last use of P) came
/// before too, which then happens-before the free. Readers that come later load a newer pointer.
fn publish(snapshot: Box<Snapshot>) {
    let fresh = Box::into_raw(snapshot);
    let mut retired = PUBLISHED.lock();
    let old = CURRENT.swap(fresh, Ordering::SeqCst);
    if !old.is_null() {
        // SAFETY: every non-null CURRENT came from Box::into_raw above, and the swap took it out
        // of CURRENT, so this is its only owner.
        retired.push(unsafe { Box::from_raw(old) });
    }
    let free = if READERS.load(Ordering::SeqCst) == 0 {
        std::mem::take(&mut *retired)
    } else {
        Vec::new()
    };
    drop(retired);
    // Freed outside the lock: nothing can reach them any more.
    drop(free);
}

/// After the real `dlclose` returned: every snapshot scanned before is stale.
pub fn unloaded() {
    UNLOADS.fetch_add(1, Ordering::Release);
    LAST.store(0, Ordering::Relaxed);
}

/// The interposed `dlclose`: the real one, then the snapshot marked stale. Its return value,
/// `errno` and `dlerror` state reach the caller untouched (the counter touches none of them).
///
/// # Safety
/// The argument is that of `dlclose(3)`.
pub unsafe fn dlclose(handle: *mut c_void) -> c_int {
    let Some(real) = super::real::dlclose() else {
        return -1;
    };
    // SAFETY: the caller's handle, passed on unchanged.
    let rc = unsafe { real(handle) };
    unloaded();
    rc
}

/// In a fork child only the forking thread exists, and it is in no lookup (none calls out of
/// the library): readers counted by the parent's other threads are gone with them.
pub(super) fn after_fork_in_child() {
    READERS.store(0, Ordering::SeqCst);
    IN_FORK_CHILD.store(true, Ordering::Relaxed);
}

fn lookup(segments: &[Segment], addr: usize) -> Option<bool> {
    let i = segments.partition_point(|s| s.start <= addr);
    let s = segments.get(i.checked_sub(1)?)?;
    (addr < s.end).then_some(s.worker)
}

fn loads_so_far() -> u64 {
    extern "C" fn first(info: *mut libc::dl_phdr_info, _size: usize, out: *mut c_void) -> c_int {
        // SAFETY: the loader passes a valid info record; `out` is the u64 passed below.
        unsafe { *(out as *mut u64) = (*info).dlpi_adds };
        1
    }
    let mut adds: u64 = 0;
    // SAFETY: the callback writes only through the pointer to `adds`, alive for the call.
    unsafe { libc::dl_iterate_phdr(Some(first), &mut adds as *mut u64 as *mut c_void) };
    adds
}

/// Every loaded object's executable segments, with the loader's object count and the unload
/// count as they were before the walk (so an object that comes or goes during it is seen late
/// at worst: the snapshot is then stale, never wrong for long).
fn scan(is_worker: &dyn Fn(&str) -> bool) -> Snapshot {
    struct Scan<'a> {
        is_worker: &'a dyn Fn(&str) -> bool,
        segments: Vec<Segment>,
        loads: Option<u64>,
    }
    extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: `data` is the `Scan` passed below, alive for the call; the loader passes a valid
        // info record whose name is a NUL-terminated string (or null) and whose program headers
        // are `dlpi_phnum` entries long.
        unsafe {
            let scan = &mut *(data as *mut Scan);
            let info = &*info;
            scan.loads.get_or_insert(info.dlpi_adds);
            let name = if info.dlpi_name.is_null() {
                ""
            } else {
                CStr::from_ptr(info.dlpi_name).to_str().unwrap_or("")
            };
            let file = name.rsplit('/').next().unwrap_or("");
            let worker = !file.is_empty() && (scan.is_worker)(file);
            let headers = std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize);
            for h in headers {
                if h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_X != 0 {
                    let start = info.dlpi_addr as usize + h.p_vaddr as usize;
                    scan.segments.push(Segment {
                        start,
                        end: start + h.p_memsz as usize,
                        worker,
                    });
                }
            }
        }
        0
    }
    let unloads_seen = UNLOADS.load(Ordering::Acquire);
    let mut scan = Scan {
        is_worker,
        segments: Vec::new(),
        loads: None,
    };
    // SAFETY: the callback only touches `scan`, alive for the call.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut scan as *mut Scan as *mut c_void) };
    scan.segments.sort_by_key(|s| s.start);
    Snapshot {
        segments: scan.segments,
        loads_seen: scan.loads.unwrap_or(0),
        unloads_seen,
    }
}

/// [`scan`] without the loader: every executable mapping of a file, from `/proc/self/maps`, read
/// in pieces on the stack. In a fork child only (see the module's doc). The kernel names the file
/// itself where the loader has the name it was opened by (a symlink such as `libnccl.so.2`
/// resolves to `libnccl.so.2.18.1`): the worker globs match both. Unreadable, it finds nothing,
/// and the thread is classified as its creator's child.
fn scan_mappings(is_worker: &dyn Fn(&str) -> bool) -> Snapshot {
    let unloads_seen = UNLOADS.load(Ordering::Acquire);
    let mut segments = Vec::new();
    if let Ok(mut maps) = std::fs::File::open("/proc/self/maps") {
        let mut buf = [0u8; 4096];
        let mut kept = 0;
        while let Ok(n) = maps.read(&mut buf[kept..]) {
            if n == 0 {
                break;
            }
            let filled = kept + n;
            let mut start = 0;
            while let Some(end) = buf[start..filled].iter().position(|&b| b == b'\n') {
                segments.extend(executable_file_mapping(&buf[start..start + end], is_worker));
                start += end + 1;
            }
            // A line longer than the buffer (a path of thousands of bytes) is skipped whole.
            kept = if start == 0 && filled == buf.len() {
                0
            } else {
                buf.copy_within(start..filled, 0);
                filled - start
            };
        }
    }
    segments.sort_by_key(|s| s.start);
    Snapshot {
        segments,
        loads_seen: 0,
        unloads_seen,
    }
}

/// One line of `/proc/<pid>/maps` (`start-end perms offset dev inode path`) as a segment, when it
/// maps a file executable.
fn executable_file_mapping(line: &[u8], is_worker: &dyn Fn(&str) -> bool) -> Option<Segment> {
    let line = std::str::from_utf8(line).ok()?;
    // Five fields one space apart, then the path after padding (it may hold spaces).
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    let path = fields.nth(3)?.trim_start();
    if perms.as_bytes().get(2) != Some(&b'x') || !path.starts_with('/') {
        return None;
    }
    let file = path.rsplit('/').next().unwrap_or("");
    Some(Segment {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        worker: !file.is_empty() && is_worker(file),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the tests of this module share the snapshot.
    #[test]
    fn a_hit_is_never_older_than_the_last_unload_and_replaced_snapshots_are_freed() {
        let in_libc = libc::getpid as *const () as usize;
        let here = a_hit_is_never_older_than_the_last_unload_and_replaced_snapshots_are_freed
            as *const () as usize;
        let libc_is_worker = |f: &str| f.starts_with("libc.so");
        assert!(in_worker_object(in_libc, &libc_is_worker));
        assert!(!in_worker_object(here, &libc_is_worker));
        assert!(!in_worker_object(1, &|_| true));
        // A hit answers from the snapshot: the classifier is not asked again...
        assert!(in_worker_object(in_libc, &|_| false));
        // ...until an unload makes it stale.
        unloaded();
        assert!(!in_worker_object(in_libc, &|_| false));
        for _ in 0..100 {
            unloaded();
            assert!(in_worker_object(in_libc, &libc_is_worker));
        }
        assert!(
            PUBLISHED.lock().is_empty(),
            "replaced snapshots must be freed when no reader is in flight"
        );
    }

    #[test]
    fn the_kernels_mappings_name_the_same_objects_as_the_loader() {
        let libc_is_worker = |f: &str| f.starts_with("libc.so") || f.starts_with("libc-");
        let from_kernel = scan_mappings(&libc_is_worker);
        let in_libc = libc::getpid as *const () as usize;
        let here = the_kernels_mappings_name_the_same_objects_as_the_loader as *const () as usize;
        assert_eq!(lookup(&from_kernel.segments, in_libc), Some(true));
        assert_eq!(lookup(&from_kernel.segments, here), Some(false));
        assert_eq!(lookup(&from_kernel.segments, 1), None);
    }

    #[test]
    fn a_maps_line_is_a_segment_only_when_it_maps_a_file_executable() {
        let yes = |_: &str| true;
        let seg = executable_file_mapping(
            b"7f00a000-7f00b000 r-xp 00001000 08:01 1234   /opt/nccl/lib/libnccl.so.2.18.1",
            &|f| f == "libnccl.so.2.18.1",
        )
        .unwrap();
        assert_eq!(
            (seg.start, seg.end, seg.worker),
            (0x7f00a000, 0x7f00b000, true)
        );
        let spaced = executable_file_mapping(
            b"1000-2000 r-xp 00000000 08:01 99                         /opt/my libs/libucp.so.0",
            &|f| f == "libucp.so.0",
        );
        assert!(spaced.is_some_and(|s| s.worker), "a path with a space");
        for line in [
            &b"7f00a000-7f00b000 r--p 00000000 08:01 1234 /usr/lib/libc.so.6"[..],
            b"7f00a000-7f00b000 r-xp 00000000 00:00 0",
            b"7ffd000-7ffe000 r-xp 00000000 00:00 0 [vdso]",
            b"garbage",
            b"",
        ] {
            assert!(executable_file_mapping(line, &yes).is_none(), "{line:?}");
        }
    }
}
