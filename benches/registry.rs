//! The registry model's hot path (a thread's birth and exit), its sweep (configure + release over
//! N threads, against a kernel that answers from memory: the library's own bookkeeping, without
//! the syscalls), and its memory per live thread.
//!
//! The kernel side of the costs (the preloaded library against bare `pthread_create`, configure
//! against raw `sched_setaffinity`) is measured by `scripts/bench`, which runs real processes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::sync::atomic::{AtomicIsize, Ordering};

use criterion::{criterion_group, BenchmarkId, Criterion};
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::registry::{LeaseKind, Registry, Role, ThreadMasks, Tid};

/// Counts live heap bytes, so the bench can say what the registry holds per thread.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is a side note.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Masks that never change: births on the inherited path never ask the kernel.
struct Still;

impl ThreadMasks for Still {
    fn get(&self, _tid: Tid) -> Result<CpuMask, i32> {
        Ok(CpuMask::parse_list("0-3").unwrap_or_default())
    }
    fn set(&self, _tid: Tid, _mask: &CpuMask) -> Result<(), i32> {
        Ok(())
    }
    fn thread_ids(&self) -> Vec<Tid> {
        Vec::new()
    }
}

/// Per-thread masks kept in memory (tid = index), answered without allocating, as the engine's
/// stack-buffer syscalls are.
struct Remembering(RefCell<Vec<CpuMask>>);

impl ThreadMasks for Remembering {
    fn get(&self, tid: Tid) -> Result<CpuMask, i32> {
        self.0
            .borrow()
            .get(tid as usize)
            .cloned()
            .ok_or(libc::ESRCH)
    }
    fn set(&self, tid: Tid, mask: &CpuMask) -> Result<(), i32> {
        let mut masks = self.0.borrow_mut();
        let slot = masks.get_mut(tid as usize).ok_or(libc::ESRCH)?;
        slot.clone_from(mask);
        Ok(())
    }
    /// Every thread the masks describe, as `/proc/self/task` lists a real process's.
    fn thread_ids(&self) -> Vec<Tid> {
        (0..self.0.borrow().len() as Tid).collect()
    }
    fn differs_from(&self, tid: Tid, expected: &CpuMask) -> Result<Option<CpuMask>, i32> {
        let masks = self.0.borrow();
        let actual = masks.get(tid as usize).ok_or(libc::ESRCH)?;
        Ok((actual != expected).then(|| actual.clone()))
    }
}

fn sweep(c: &mut Criterion) {
    let mut group = c.benchmark_group("registry");
    let all = CpuMask::parse_list("0-3").unwrap();
    for n in [100usize, 1000, 10_000] {
        let kernel = Remembering(RefCell::new(vec![all.clone(); n + 2]));
        let mut reg = Registry::new();
        let sweeper = reg.register_root(0, 0, Role::Host, all.clone());
        for tid in 2..n as Tid + 2 {
            let plan = reg.plan_child(Some(sweeper), false, None);
            reg.register_child(&plan, tid, tid as u64, &kernel);
        }
        let worker_set = CpuMask::parse_list("2-3").unwrap();
        group.bench_function(BenchmarkId::new("configure+release", n), |b| {
            b.iter(|| {
                let outcome = reg.open(
                    LeaseKind::Configure,
                    sweeper,
                    "gpu0",
                    Some(0),
                    Some(worker_set.clone()),
                    &kernel,
                );
                reg.release(outcome.lease, &kernel).unwrap();
            })
        });
    }
    group.finish();
}

fn birth_and_exit(c: &mut Criterion) {
    let mut group = c.benchmark_group("registry");
    for lease in [false, true] {
        let mut reg = Registry::new();
        let main = reg.register_root(1, 1, Role::Host, CpuMask::parse_list("0-3").unwrap());
        let worker = reg.register_root(2, 2, Role::Host, CpuMask::parse_list("0-3").unwrap());
        if lease {
            reg.open(
                LeaseKind::Configure,
                worker,
                "gpu0",
                Some(0),
                Some(CpuMask::parse_list("2-3").unwrap()),
                &Still,
            );
        }
        let creator = if lease { worker } else { main };
        let name = if lease {
            "worker creator, lease open"
        } else {
            "host creator, no lease"
        };
        group.bench_function(BenchmarkId::new("birth+exit", name), |b| {
            b.iter(|| {
                let plan = reg.plan_child(Some(creator), false, None);
                let slot = reg.register_child(&plan, 10, 10, &Still);
                reg.thread_exited(slot);
            })
        });
    }
    group.finish();
}

/// Heap bytes the registry holds per live thread, 10 000 threads alive.
fn bytes_per_thread() -> f64 {
    let mut reg = Registry::new();
    let main = reg.register_root(1, 1, Role::Host, CpuMask::parse_list("0-3").unwrap());
    let before = LIVE.load(Ordering::Relaxed);
    let n = 10_000;
    for tid in 0..n {
        let plan = reg.plan_child(Some(main), false, None);
        reg.register_child(&plan, 100 + tid, tid as u64, &Still);
    }
    let after = LIVE.load(Ordering::Relaxed);
    (after - before) as f64 / n as f64
}

criterion_group!(benches, birth_and_exit, sweep);

fn main() {
    println!(
        "registry heap bytes per live thread (10 000 alive): {:.1}",
        bytes_per_thread()
    );
    benches();
    Criterion::default().configure_from_args().final_summary();
}
