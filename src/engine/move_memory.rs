//! Memory follows a dedicated worker (SPEC §15): after a configure of the process's main thread
//! put the process on one node's CPUs, its pages on the other nodes with CPUs move there, on the
//! configuring thread (never in a fork handler or a signal handler: configure is neither), once
//! per configure that changes the node. [`crate::memory_move`] decides; this file reads
//! `/proc/self/smaps` and `numa_maps`, moves each mapping with `mbind(MPOL_MF_MOVE)` (page by
//! page with `move_pages(2)` where a CPU-less node's pages must stay), and reads `numa_maps`
//! again to count what moved and what could not.
//!
//! Counters are atomics, not a lock: the report reads them at any time, and a fork child
//! inherits them as they were (its pages are the parent's copies, already moved).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crate::mask::CpuMask;
use crate::memory_move::{self, MoveDecision, MoveInput, Stay, Walk};
use crate::policy::Rule;
use crate::report::MemoryMoved;
use crate::{log_debug, log_info, log_warn, sys};

/// No node yet.
const NONE: usize = usize::MAX;
/// The node the last move went to.
static MOVED_TO: AtomicUsize = AtomicUsize::new(NONE);
/// A move runs: a configure on another thread meanwhile leaves memory alone.
static MOVING: AtomicBool = AtomicBool::new(false);
static MOVES: AtomicU64 = AtomicU64::new(0);
static BYTES_MOVED: AtomicU64 = AtomicU64::new(0);
static BYTES_NOT_MOVED: AtomicU64 = AtomicU64::new(0);
static MICROS: AtomicU64 = AtomicU64::new(0);

/// The most bytes one `mbind` moves: the kernel holds the process's memory map for writing while
/// it moves them, so other threads' page faults wait at most one step.
const STEP: u64 = 64 << 20;
/// Pages per `move_pages` call: bounds the buffers (56 KiB) and how long one call holds the
/// process's memory map.
const CHUNK: usize = 4096;

/// What a configure knows, for [`follow_the_worker`].
pub(super) struct Configured<'a> {
    pub dedicated: bool,
    pub rule: Rule,
    pub mask: Option<&'a CpuMask>,
    pub memory_nodes: &'a [(usize, CpuMask)],
}

/// Moves the process's memory to the worker's node when [`memory_move::decide`] says so.
pub(super) fn follow_the_worker(c: Configured<'_>) {
    let settings = &super::state::load_facts().settings;
    let moved_to = match MOVED_TO.load(Ordering::Acquire) {
        NONE => None,
        node => Some(node),
    };
    // Read only for a dedicated worker: a shared process pays nothing.
    let memory_policy = if c.dedicated {
        sys::memory_policy().map(|(mode, _)| mode)
    } else {
        Ok(sys::MPOL_DEFAULT)
    };
    let decision = memory_move::decide(&MoveInput {
        dedicated: c.dedicated,
        enabled: settings.move_memory,
        kernels_topology: settings.sysfs_root.as_os_str() == "/",
        rule: c.rule,
        worker_mask: c.mask,
        memory_nodes: c.memory_nodes,
        memory_policy,
        moved_to,
    });
    let (from, to) = match decision {
        MoveDecision::Move { from, to } => (from, to),
        MoveDecision::Stay(why @ Stay::OwnPolicy(_)) if c.dedicated => {
            log_info!("dedicated worker: {}", why.describe());
            return;
        }
        // No permission (a container's seccomp profile without CAP_SYS_NICE): said as a
        // failure, once per configure that would have moved.
        MoveDecision::Stay(why @ Stay::PolicyUnreadable(_)) => {
            log_warn!(
                "dedicated worker: its memory was not moved: {}",
                why.describe()
            );
            return;
        }
        MoveDecision::Stay(why) => {
            if c.dedicated {
                log_debug!("dedicated worker: {}", why.describe());
            }
            return;
        }
    };
    if MOVING.swap(true, Ordering::AcqRel) {
        log_debug!("dedicated worker: a move of its memory is already running");
        return;
    }
    // Cleared however this ends, a panic caught by the entry point's catch_unwind included.
    struct Moving;
    impl Drop for Moving {
        fn drop(&mut self) {
            MOVING.store(false, Ordering::Release);
        }
    }
    let _moving = Moving;
    let started = Instant::now();
    let outcome = move_to(&from, to);
    let micros = started.elapsed().as_micros() as u64;
    match outcome {
        Ok(done) => {
            MOVED_TO.store(to, Ordering::Release);
            MOVES.fetch_add(1, Ordering::Relaxed);
            BYTES_MOVED.fetch_add(done.moved, Ordering::Relaxed);
            BYTES_NOT_MOVED.fetch_add(done.not_moved, Ordering::Relaxed);
            MICROS.fetch_add(micros, Ordering::Relaxed);
            log_info!(
                "dedicated worker: moved {} of its memory from NUMA node{} {} to node {to} in {:.1} ms; {} could not move (locked, shared, busy){}",
                mib(done.moved),
                if from.len() > 1 { "s" } else { "" },
                from.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
                micros as f64 / 1000.0,
                mib(done.not_moved),
                if done.bound > 0 {
                    format!("; {} under a policy of its own left", mib(done.bound))
                } else {
                    String::new()
                }
            );
        }
        // Said once: the pages stay, the placement is unchanged.
        Err(why) => {
            log_warn!("dedicated worker: its memory was not moved to NUMA node {to}: {why}")
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

struct Done {
    moved: u64,
    not_moved: u64,
    bound: u64,
}

fn move_to(from: &[usize], to: usize) -> Result<Done, String> {
    let numa_maps = || {
        std::fs::read_to_string("/proc/self/numa_maps")
            .map(|text| memory_move::numa_maps_pages(&text))
            .map_err(|e| format!("/proc/self/numa_maps: {e}"))
    };
    let smaps = std::fs::read_to_string("/proc/self/smaps")
        .map_err(|e| format!("/proc/self/smaps: {e}"))?;
    let plan = memory_move::plan(&memory_move::smaps_ranges(&smaps), &numa_maps()?, from, to);
    let mut done = Done {
        moved: 0,
        not_moved: plan.locked_bytes,
        bound: plan.bound_bytes,
    };
    for walk in &plan.walks {
        if walk.mixed {
            move_page_by_page(walk, from, to)?;
        } else {
            for (start, len) in memory_move::steps(walk, STEP) {
                match sys::bind_move_and_unbind(start as usize, len as usize, to) {
                    Ok(()) => {}
                    // Unmapped since smaps was read (another thread's munmap): nothing to move.
                    Err(libc::EFAULT) | Err(libc::ENOMEM) => {}
                    Err(errno) => return Err(format!("mbind failed (errno {errno})")),
                }
            }
        }
    }
    let (moved, left) = memory_move::outcome(&plan.walks, &numa_maps()?, from);
    done.moved = moved;
    done.not_moved += left;
    Ok(done)
}

/// A mapping that also has pages on a node that is neither a source nor the target (a CPU-less
/// node): only the pages on the sources move, chosen one by one with `move_pages`.
fn move_page_by_page(walk: &Walk, from: &[usize], to: usize) -> Result<(), String> {
    let mut addresses = Vec::with_capacity(CHUNK);
    let mut status = vec![0i32; CHUNK];
    let mut at = walk.start;
    while at < walk.end {
        addresses.clear();
        while at < walk.end && addresses.len() < CHUNK {
            addresses.push(at as usize);
            at += walk.page_bytes;
        }
        let status = &mut status[..addresses.len()];
        sys::page_nodes(&addresses, status)
            .map_err(|errno| format!("move_pages failed (errno {errno})"))?;
        let chosen: Vec<usize> = memory_move::to_move(status, from)
            .into_iter()
            .map(|i| addresses[i])
            .collect();
        if chosen.is_empty() {
            continue;
        }
        sys::move_pages_to(&chosen, to, &mut status[..chosen.len()])
            .map_err(|errno| format!("move_pages failed (errno {errno})"))?;
    }
    Ok(())
}

/// What the report says: `None` until a move ran.
pub(super) fn reported() -> Option<MemoryMoved> {
    let node = MOVED_TO.load(Ordering::Acquire);
    (node != NONE).then(|| MemoryMoved {
        node,
        moves: MOVES.load(Ordering::Relaxed),
        bytes_moved: BYTES_MOVED.load(Ordering::Relaxed),
        bytes_not_moved: BYTES_NOT_MOVED.load(Ordering::Relaxed),
        millis: MICROS.load(Ordering::Relaxed) as f64 / 1000.0,
    })
}

/// In a fork child: a move the parent was running is not running here.
pub(super) fn after_fork_child() {
    MOVING.store(false, Ordering::Release);
}
