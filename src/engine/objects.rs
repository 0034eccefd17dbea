//! Which loaded object holds a start routine, for `TLLM_AFFINITY_WORKER_LIBS` (SPEC §2).
//!
//! `dladdr` per thread creation would take the loader lock every time. Instead the executable
//! segments of every loaded object are kept, with their classification, in a snapshot that the
//! hook reads without any lock. `dl_iterate_phdr` runs again only when an address falls outside
//! all of them and the loader's object count (`dlpi_adds`) says something was loaded since; the
//! new snapshot replaces the old one, which stays allocated because a creator may still be
//! reading it: one per such rescan, bounded by the `dlopen`s that load new objects. Never called
//! with the registry lock held: a thread inside `dlopen` holds the loader lock while its
//! constructors create threads.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};

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
}

/// The snapshot in force; null until the first scan. Never freed once published.
static CURRENT: AtomicPtr<Snapshot> = AtomicPtr::new(std::ptr::null_mut());

/// Every snapshot ever published (owned here, so they stay reachable), and the lock that makes
/// rescans one at a time (held across a fork by the engine's fork handlers). Boxed: CURRENT points at a snapshot, which must not move when the
/// vector grows.
#[allow(clippy::vec_box)]
pub(super) static PUBLISHED: EngineLock<Vec<Box<Snapshot>>> = EngineLock::new(Vec::new());

/// Answers whether `addr` lies in an object whose file name `is_worker` accepts.
pub fn in_worker_object(addr: usize, is_worker: &dyn Fn(&str) -> bool) -> bool {
    // SAFETY: a non-null CURRENT points into a Box owned by PUBLISHED, which is never dropped
    // nor shrunk (a fork child inherits it whole), and snapshots are immutable once published.
    let current = unsafe { CURRENT.load(Ordering::Acquire).as_ref() };
    if let Some(snapshot) = current {
        if let Some(worker) = lookup(&snapshot.segments, addr) {
            return worker;
        }
    }
    let loads = loads_so_far();
    if current.is_some_and(|s| s.loads_seen == loads) {
        return false;
    }
    let snapshot = Box::new(Snapshot {
        segments: scan(is_worker),
        loads_seen: loads,
    });
    let answer = lookup(&snapshot.segments, addr).unwrap_or(false);
    let mut published = PUBLISHED.lock();
    let raw = &*snapshot as *const Snapshot as *mut Snapshot;
    published.push(snapshot);
    CURRENT.store(raw, Ordering::Release);
    answer
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

fn scan(is_worker: &dyn Fn(&str) -> bool) -> Vec<Segment> {
    struct Scan<'a> {
        is_worker: &'a dyn Fn(&str) -> bool,
        segments: Vec<Segment>,
    }
    extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: `data` is the `Scan` passed below, alive for the call; the loader passes a valid
        // info record whose name is a NUL-terminated string (or null) and whose program headers
        // are `dlpi_phnum` entries long.
        unsafe {
            let scan = &mut *(data as *mut Scan);
            let info = &*info;
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
    let mut scan = Scan {
        is_worker,
        segments: Vec::new(),
    };
    // SAFETY: the callback only touches `scan`, alive for the call.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut scan as *mut Scan as *mut c_void) };
    scan.segments.sort_by_key(|s| s.start);
    scan.segments
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_object_that_holds_a_function() {
        let in_libc = libc::getpid as *const () as usize;
        let here = finds_the_object_that_holds_a_function as *const () as usize;
        assert!(in_worker_object(in_libc, &|f| f.starts_with("libc.so")));
        assert!(!in_worker_object(here, &|f| f.starts_with("libc.so")));
        assert!(!in_worker_object(1, &|_| true));
    }
}
