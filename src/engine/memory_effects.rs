//! Memory follows a dedicated worker (SPEC §15): after a configure of the process's main thread
//! put the process on one node's CPUs, its pages on the other nodes with CPUs move there, on the
//! configuring thread (never in a fork handler or a signal handler: configure is neither), once
//! per configure that changes the node. [`crate::placement::memory_decision`] decides; this file reads
//! `/proc/self/smaps` and `numa_maps`, walks each private mapping in batches aligned to the
//! transparent huge page size, picks the pages to move from `/proc/self/pagemap` (present,
//! anonymous, this process's alone) and `move_pages(2)`'s answer of where each lies, moves those
//! on a source node with `move_pages(2)` (which writes no memory policy: no other thread's fault
//! and no fork child ever sees one), within a budget of bytes and of the target node's free
//! memory, and reads `numa_maps` again to count what moved and what could not.
//!
//! Counters are atomics, not a lock: the report reads them at any time, and a fork child
//! inherits them as they were (its pages are the parent's copies, already moved).

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::lock::EngineLock;
use crate::mask::CpuMask;
use crate::placement::memory_decision::{
    self, pagemap, MoveDecision, MoveInput, Stay, StoppedShort, Walk,
};
use crate::placement::policy::Rule;
use crate::registry::report::MemoryMoved;
use crate::{log_debug, log_info, log_warn, sys};

/// No node yet.
const NONE: usize = usize::MAX;
/// The node the last move went to.
static MOVED_TO: AtomicUsize = AtomicUsize::new(NONE);
/// A move runs: a configure on another thread meanwhile leaves memory alone.
static MOVING: AtomicBool = AtomicBool::new(false);
/// Held by a walk again after pages another process mapped were seen: the fork prepare handler
/// takes it first (before any other engine lock), so a thread that forks waits in its `fork`
/// call until the walk is done, and the children forked before it have a bounded while to exit
/// or exec, after which the pages are this process's alone. A fork child maps every private page
/// of its parent; a thread forking in a loop keeps one such child alive nearly all the time.
pub(super) static FORK_GATE: EngineLock<()> = EngineLock::new(());
/// Forks of this process so far (the fork prepare handler counts them): a walk that saw one
/// walks again, since the pages it refused were mapped twice only for the child's while.
pub(super) static FORKS: AtomicU64 = AtomicU64::new(0);
/// How long a walk again, forks held off, waits for the children forked before it to be gone.
const CHILDREN_GONE_WITHIN: Duration = Duration::from_millis(100);
static MOVES: AtomicU64 = AtomicU64::new(0);
static BYTES_MOVED: AtomicU64 = AtomicU64::new(0);
static BYTES_NOT_MOVED: AtomicU64 = AtomicU64::new(0);
static MICROS: AtomicU64 = AtomicU64::new(0);
static HUGE_PAGES_MOVED: AtomicU64 = AtomicU64::new(0);

/// A move that runs longer than this says how far it got, and again each time as long.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// What a configure knows, for [`follow_the_worker`].
pub(super) struct Configured<'a> {
    pub dedicated: bool,
    pub rule: Rule,
    pub mask: Option<&'a CpuMask>,
    pub memory_nodes: &'a [(usize, CpuMask)],
}

/// Moves the process's memory to the worker's node when [`memory_decision::decide`] says so.
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
    let decision = memory_decision::decide(&MoveInput {
        dedicated: c.dedicated,
        enabled: settings.move_memory > 0,
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
    let outcome = move_to(&from, to, settings.move_memory, started);
    let micros = started.elapsed().as_micros() as u64;
    let from_words = format!(
        "NUMA node{} {}",
        if from.len() > 1 { "s" } else { "" },
        from.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    match outcome {
        Ok(done) => {
            MOVED_TO.store(to, Ordering::Release);
            MOVES.fetch_add(1, Ordering::Relaxed);
            BYTES_MOVED.fetch_add(done.moved, Ordering::Relaxed);
            BYTES_NOT_MOVED.fetch_add(done.kept + done.left, Ordering::Relaxed);
            HUGE_PAGES_MOVED.fetch_add(done.huge_pages, Ordering::Relaxed);
            MICROS.fetch_add(micros, Ordering::Relaxed);
            let rest = match &done.stopped {
                Some(why) => format!(
                    "; stopped short, {} left on {from_words}: {}",
                    mib(done.left),
                    why.describe()
                ),
                None if done.left > 0 => {
                    format!("; {} could not move (busy, pinned, shared)", mib(done.left))
                }
                None => String::new(),
            };
            log_info!(
                "dedicated worker: moved {} of its memory ({} huge pages) from {from_words} to node {to} in {:.1} ms; {} stays (locked, shared, a device's){}{rest}",
                mib(done.moved),
                done.huge_pages,
                micros as f64 / 1000.0,
                mib(done.kept),
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
    huge_pages: u64,
    /// On the sources in mappings never walked: locked, shared, a device's, hugetlbfs.
    kept: u64,
    /// Still on the sources in the walked mappings afterwards.
    left: u64,
    bound: u64,
    stopped: Option<StoppedShort>,
}

/// What the walk keeps between batches.
struct Walker<'a> {
    from: &'a [usize],
    to: usize,
    cap: u64,
    started: Instant,
    last_said: Instant,
    pagemap: File,
    huge_bytes: u64,
    huge_order: u32,
    /// The walked mapping's page size.
    page_bytes: u64,
    moved: u64,
    huge_pages: u64,
    huge_left: u64,
    /// Why the first huge pages that stayed did.
    huge_stay: Option<memory_decision::HugePagesStay>,
    node_meminfo: String,
    /// Pages `move_pages` refused, by why: still hidden by a hinting fault, shared, busy.
    hidden: u64,
    shared: u64,
    busy: u64,
    /// Anonymous pages present but mapped by another process too (`pagemap`), for now perhaps:
    /// a fork child's copy-on-write until it execs or exits.
    not_alone: u64,
    read: u64,
    read_refused: u64,
    steps: Steps,
}

/// Where the walk's time went, for the debug line after it (and `scripts/bench --memory-move`).
#[derive(Default)]
struct Steps {
    /// `move_pages` with no target: where pages lie.
    asking: Duration,
    /// `move_pages` to the target.
    moving: Duration,
    /// `process_vm_readv` taking hinting faults.
    reading: Duration,
}

fn move_to(from: &[usize], to: usize, cap: u64, started: Instant) -> Result<Done, String> {
    let numa_maps = || {
        std::fs::read_to_string("/proc/self/numa_maps")
            .map(|text| memory_decision::numa_maps_pages(&text))
            .map_err(|e| format!("/proc/self/numa_maps: {e}"))
    };
    let smaps = std::fs::read_to_string("/proc/self/smaps")
        .map_err(|e| format!("/proc/self/smaps: {e}"))?;
    let plan = memory_decision::plan(&memory_decision::smaps_ranges(&smaps), &numa_maps()?, from);
    let pagemap =
        File::open("/proc/self/pagemap").map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    let base_page = page_size();
    let huge_bytes = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
        .filter(|&b| b >= base_page && b.is_power_of_two())
        .unwrap_or(base_page * 512);
    let order = (huge_bytes / base_page).trailing_zeros();
    let mut walker = Walker {
        from,
        to,
        cap,
        started,
        last_said: started,
        pagemap,
        huge_bytes,
        huge_order: order,
        page_bytes: base_page,
        moved: 0,
        huge_pages: 0,
        huge_left: 0,
        huge_stay: None,
        node_meminfo: format!("/sys/devices/system/node/node{to}/meminfo"),
        hidden: 0,
        shared: 0,
        busy: 0,
        not_alone: 0,
        read: 0,
        read_refused: 0,
        steps: Steps::default(),
    };
    // A budget under one huge page moves none of them: said even where the walk stops (the
    // budget spent on base pages) before it reaches one.
    if cap < huge_bytes && plan.walks.iter().any(|w| w.huge) {
        walker.huge_stay = Some(memory_decision::why_huge_pages_stay(cap, cap, huge_bytes));
    }
    let mut stopped = None;
    // Set once the plan is read: numa_maps shows a mapping without a policy of its own under
    // the policy of the process's first thread, which may be this one.
    let own_faults_stay = OwnFaultsMoveNothing::set(to);
    let mut forks_at_walk = FORKS.load(Ordering::Relaxed);
    for round in 0.. {
        if round > 0 {
            // Pages not this process's alone count only while it has a child: the zero page,
            // which every process may map, is never its alone either. A fork during the walk
            // counts too, though its child may be gone by now: its pages were refused for it.
            let forked = FORKS.load(Ordering::Relaxed) != forks_at_walk;
            let refused = walker.shared + walker.busy + walker.not_alone > 0;
            let shared_seen = walker.shared > 0
                || (walker.not_alone > 0 && has_child_processes())
                || (forked && refused);
            forks_at_walk = FORKS.load(Ordering::Relaxed);
            let Some(wait) =
                memory_decision::walk_again_after(round, shared_seen, stopped.is_some())
            else {
                break;
            };
            std::thread::sleep(wait);
            // What is refused in this walk is what stays: the counts start again.
            (walker.hidden, walker.shared, walker.busy, walker.not_alone) = (0, 0, 0, 0);
        }
        let _no_fork_meanwhile = (round > 0).then(|| {
            let gate = FORK_GATE.lock();
            let waiting = Instant::now();
            while has_child_processes() && waiting.elapsed() < CHILDREN_GONE_WITHIN {
                std::thread::sleep(Duration::from_millis(1));
            }
            gate
        });
        'walks: for walk in &plan.walks {
            // Huge pages only where the mapping's pages are the base size (not hugetlbfs).
            let batch = memory_decision::batch_bytes(walk.page_bytes, walker.huge_bytes);
            for (start, len) in memory_decision::batches(walk, batch) {
                if let Err(why) = walker.batch(walk, start, len) {
                    stopped = Some(why);
                    break 'walks;
                }
            }
        }
    }
    drop(own_faults_stay);
    if let Some(why) = walker.huge_stay {
        let count = match walker.huge_left {
            0 => String::new(),
            n => format!("{n} "),
        };
        log_info!(
            "dedicated worker: {count}huge pages of {} stay whole where they are: {} (NUMA node {to})",
            mib(walker.huge_bytes),
            why.describe()
        );
    }
    let (mut moved, mut left) = memory_decision::outcome(&plan.walks, &numa_maps()?, from);
    // Pages move_pages could not see even after the read (a hinting fault it did not take):
    // migrate_pages(2) walks the page tables itself and writes no policy either, but moves every
    // page of the process on the sources, locked, shared-memory and bound ones included, and with
    // CAP_SYS_NICE those other processes map too. So only where that is the walk's own pages
    // (`memory_decision::may_sweep`).
    let mut swept = 0;
    let sweep = memory_decision::SweepInput {
        stopped: stopped.is_some(),
        hidden: walker.hidden,
        kept: plan.kept_bytes(),
        bound: plan.bound_bytes,
        fits: walker
            .allowance(base_page)
            .is_ok_and(|allowed| allowed >= left),
        cap_sys_nice: std::fs::read_to_string("/proc/self/status")
            .map_or(true, |status| memory_decision::has_cap_sys_nice(&status)),
    };
    if memory_decision::may_sweep(&sweep) {
        match sys::migrate_own_pages(from, to) {
            Ok(_) => {
                let before = moved;
                (moved, left) = memory_decision::outcome(&plan.walks, &numa_maps()?, from);
                swept = moved.saturating_sub(before);
            }
            Err(errno) => log_debug!("dedicated worker: migrate_pages failed (errno {errno})"),
        }
    }
    // Pages left that the budget or the target's headroom would not have taken: said as a stop.
    if stopped.is_none() && left > 0 {
        match walker.allowance(base_page) {
            Err(why) => stopped = Some(why),
            Ok(allowed) if allowed < left => stopped = Some(walker.short_of(allowed)),
            Ok(_) => {}
        }
    }
    let steps = &walker.steps;
    log_debug!(
        "dedicated worker: the move took {:.1} ms: {:.1} ms asking where pages lie, {:.1} ms moving them, {:.1} ms reading {} pages to take hinting faults",
        started.elapsed().as_secs_f64() * 1000.0,
        steps.asking.as_secs_f64() * 1000.0,
        steps.moving.as_secs_f64() * 1000.0,
        steps.reading.as_secs_f64() * 1000.0,
        walker.read
    );
    if walker.hidden + walker.shared + walker.busy > 0 {
        log_info!(
            "dedicated worker: move_pages refused {} pages hidden by a hinting fault ({} read to take it, {} reads refused), {} shared, {} busy; {} moved by migrate_pages",
            walker.hidden,
            walker.read,
            walker.read_refused,
            walker.shared,
            walker.busy,
            mib(swept)
        );
    }
    Ok(Done {
        moved,
        huge_pages: walker.huge_pages,
        kept: plan.kept_bytes(),
        left,
        bound: plan.bound_bytes,
        stopped,
    })
}

/// While the walk runs, the configuring thread's own memory policy is `MPOL_PREFERRED` on the
/// target. The walk's reads take hinting faults (see `resolve_hinting_faults`), and the kernel's
/// fault path moves the faulting page to the reading thread's node only under a policy that
/// allows it (`MPOL_F_MOF`: the default policy, or one set with `MPOL_F_NUMA_BALANCING`): under
/// the default, each read moved its page alone, one TLB shootdown each, the walk's largest cost
/// (about 0.25 ms a page in the x86_64 guest); under this one the page stays for the batch's
/// `move_pages` call. A thread's policy is its own: no mapping's policy, no other thread's and
/// no fork child's changes (a fork copies the forking thread's, and this one is in the walk);
/// only `/proc/PID/numa_maps`, where this thread is the process's first, shows it meanwhile for
/// the mappings without a policy of their own, as it shows any first thread's policy.
/// Dropped, it is `MPOL_DEFAULT` again: the decision moves only a thread without a policy.
struct OwnFaultsMoveNothing {
    set: bool,
}

impl OwnFaultsMoveNothing {
    fn set(to: usize) -> Self {
        let set = sys::set_memory_policy(Some(to)).is_ok();
        if set {
            super::memory_preference::note_held(to);
        }
        Self { set }
    }
}

impl Drop for OwnFaultsMoveNothing {
    fn drop(&mut self) {
        if self.set {
            super::memory_preference::note_released();
            if let Err(errno) = sys::set_memory_policy(None) {
                log_warn!("dedicated worker: its configuring thread's memory policy could not be set back to the default after the move (errno {errno})");
            }
        }
    }
}

/// Whether a thread of this process has a child process now (`/proc/self/task/*/children`): a
/// fork child maps every private page of its parent until it execs or exits.
fn has_child_processes() -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("children"))
            .is_ok_and(|children| !children.trim().is_empty())
    })
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the process.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as u64
    } else {
        4096
    }
}

impl Walker<'_> {
    /// Where each page at `at` lies (`sys::page_nodes`), timed.
    fn ask(&mut self, at: &[usize], status: &mut [i32]) -> Result<(), i32> {
        if at.is_empty() {
            return Ok(());
        }
        let asking = Instant::now();
        let asked = sys::page_nodes(at, status);
        self.steps.asking += asking.elapsed();
        asked
    }

    /// Moves the pages at `at` to the target (`sys::move_pages_to`), timed.
    fn move_pages(&mut self, at: &[usize], status: &mut [i32]) -> Result<usize, i32> {
        let moving = Instant::now();
        let moved = sys::move_pages_to(at, self.to, status);
        self.steps.moving += moving.elapsed();
        moved
    }

    /// The bytes this batch may still move, or why the move stops here.
    fn allowance(&self, page_bytes: u64) -> Result<u64, StoppedShort> {
        let free_and_headroom = std::fs::read_to_string(&self.node_meminfo)
            .ok()
            .and_then(|t| memory_decision::node_free_and_total(&t))
            .map(|(free, total)| (free, memory_decision::headroom(total)));
        memory_decision::allowance(self.cap, self.moved, page_bytes, free_and_headroom)
    }

    /// Why `allowed` bytes are all the move may still take: the cap, or the node's headroom.
    fn short_of(&self, allowed: u64) -> StoppedShort {
        if self.cap.saturating_sub(self.moved) <= allowed {
            return StoppedShort::Budget(self.cap);
        }
        let (free, total) = std::fs::read_to_string(&self.node_meminfo)
            .ok()
            .and_then(|t| memory_decision::node_free_and_total(&t))
            .unwrap_or((0, 0));
        StoppedShort::NodeFull {
            free,
            headroom: memory_decision::headroom(total),
        }
    }

    /// Moves the movable pages of `start..start+len` that lie on a source node.
    fn batch(&mut self, walk: &Walk, start: u64, len: u64) -> Result<(), StoppedShort> {
        let page = walk.page_bytes;
        self.page_bytes = page;
        let mut allowed = self.allowance(page)?;
        let count = (len / page) as usize;
        let mut entries = vec![0u64; count];
        if sys::pagemap_entries(&self.pagemap, start as usize, page as usize, &mut entries).is_err()
        {
            return Ok(());
        }
        self.not_alone += entries
            .iter()
            .filter(|&&e| pagemap::shared_for_now(e))
            .count() as u64;
        let addresses: Vec<usize> = (0..count)
            .filter(|&i| pagemap::movable(entries[i]))
            .map(|i| (start + i as u64 * page) as usize)
            .collect();
        if addresses.is_empty() {
            return Ok(());
        }
        // Transparent huge pages: in a mapping that has them, a whole aligned block of this
        // process's pages may be one huge page, which lies on one node and moves whole by its
        // first address. Such a block is asked about by its two ends alone (asking where each
        // page lies was a twentieth of the move); a block whose ends lie on one source node
        // moves by its first address, and the others are asked about page by page.
        let per_huge = (self.huge_bytes / page).max(1) as usize;
        let candidates = if walk.huge && per_huge > 1 {
            memory_decision::huge_blocks(&addresses, page, self.huge_bytes)
        } else {
            Vec::new()
        };
        let before_reads = self.moved;
        let (mut firsts, unsure) = self.blocks_on_one_source(&addresses, &candidates, per_huge);
        let mut singles = memory_decision::outside_blocks(&addresses, &candidates, per_huge);
        for first in unsure {
            let at = singles.partition_point(|&a| a < first);
            singles.splice(at..at, (0..per_huge).map(|k| first + k * page as usize));
        }
        let mut status = vec![0i32; singles.len()];
        if self.ask(&singles, &mut status).is_err() {
            return Ok(());
        }
        self.resolve_hinting_faults(walk.huge, &singles, &mut status, allowed / page);
        // What the reads' faults moved counts against the budget like the rest.
        allowed = allowed.saturating_sub(self.moved - before_reads);
        let chosen: Vec<usize> = memory_decision::to_move(&status, self.from)
            .into_iter()
            .map(|i| singles[i])
            .collect();
        // Whole blocks among the pages asked one by one (a huge page whose ends were hidden).
        let starts = if walk.huge && per_huge > 1 {
            memory_decision::huge_blocks(&chosen, page, self.huge_bytes)
        } else {
            Vec::new()
        };
        let mut base = memory_decision::outside_blocks(&chosen, &starts, per_huge);
        firsts.extend(starts.iter().map(|&b| chosen[b]));
        firsts.sort_unstable();
        let fit = if firsts.is_empty() {
            0
        } else {
            let free_blocks = std::fs::read_to_string("/proc/buddyinfo")
                .map(|t| memory_decision::free_blocks_of_order(&t, self.to, self.huge_order))
                .unwrap_or(0);
            memory_decision::huge_pages_that_fit(
                firsts.len(),
                free_blocks,
                allowed,
                self.huge_bytes,
            )
        };
        // The blocks past `fit` stay whole.
        if fit < firsts.len() && self.huge_stay.is_none() {
            self.huge_stay = Some(memory_decision::why_huge_pages_stay(
                self.cap.saturating_sub(self.moved),
                allowed,
                self.huge_bytes,
            ));
        }
        self.huge_left += (firsts.len() - fit) as u64;
        firsts.truncate(fit);
        let huge_allowed = firsts.len() as u64 * self.huge_bytes;
        base.truncate((allowed.saturating_sub(huge_allowed) / page) as usize);
        // One `move_pages` call takes the blocks' first pages and the base pages together: each
        // call drains every CPU's page lists (`lru_cache_disable`), the move's main cost per call.
        let moved_before = self.moved;
        let together: Vec<usize> = firsts.iter().chain(base.iter()).copied().collect();
        let status = self.move_and_count(&together)?;
        let (first_status, base_status) = status.split_at(firsts.len());
        self.moved += self.landed(base_status) * page;
        // A block's last page lay on the source with its first: on the target now, it moved
        // with the first, so the block was one huge page. Otherwise its other pages are asked
        // about and those on a source move as base pages, within the allowance left.
        let mut others = Vec::new();
        if !firsts.is_empty() {
            let lasts: Vec<usize> = firsts
                .iter()
                .map(|&f| f + (per_huge - 1) * page as usize)
                .collect();
            let mut tails = vec![0i32; lasts.len()];
            let _ = self.ask(&lasts, &mut tails);
            for ((&first, tail), &first_now) in firsts.iter().zip(tails).zip(first_status) {
                if tail == self.to as i32 {
                    self.huge_pages += 1;
                    self.moved += self.huge_bytes;
                } else {
                    if first_now == self.to as i32 {
                        self.moved += page;
                    }
                    others.extend((1..per_huge).map(|k| first + k * page as usize));
                }
            }
        }
        let mut rest = Vec::new();
        if !others.is_empty() {
            let mut where_now = vec![0i32; others.len()];
            if self.ask(&others, &mut where_now).is_ok() {
                let left = allowed.saturating_sub(self.moved - moved_before) / page;
                self.resolve_hinting_faults(false, &others, &mut where_now, left);
                rest = memory_decision::to_move(&where_now, self.from)
                    .into_iter()
                    .map(|i| others[i])
                    .collect();
            }
        }
        rest.truncate((allowed.saturating_sub(self.moved - moved_before) / page) as usize);
        let status = self.move_and_count(&rest)?;
        self.moved += self.landed(&status) * page;
        if self.last_said.elapsed() >= PROGRESS_EVERY {
            self.last_said = Instant::now();
            log_info!(
                "dedicated worker: moving its memory to NUMA node {}: {} moved in {:.1} s so far",
                self.to,
                mib(self.moved),
                self.started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// The aligned blocks of `addresses` at `candidates` (whole runs of `per_huge` pages), asked
    /// about by their first and last pages: the first addresses of those whose two ends lie on
    /// one source node, and of those to ask about page by page (an end elsewhere, or still
    /// hidden by a hinting fault). A block with a hidden end has its first page read (one read
    /// takes a whole huge page's fault) and its ends asked again; one then wholly on the target
    /// was a huge page the fault path moved (where the thread's policy could not be set, see
    /// `OwnFaultsMoveNothing`), counted as one.
    fn blocks_on_one_source(
        &mut self,
        addresses: &[usize],
        candidates: &[usize],
        per_huge: usize,
    ) -> (Vec<usize>, Vec<usize>) {
        let (mut whole, mut unsure) = (Vec::new(), Vec::new());
        if candidates.is_empty() {
            return (whole, unsure);
        }
        let ends: Vec<usize> = candidates
            .iter()
            .flat_map(|&b| [addresses[b], addresses[b + per_huge - 1]])
            .collect();
        let mut status = vec![0i32; ends.len()];
        if self.ask(&ends, &mut status).is_err() {
            return (whole, candidates.iter().map(|&b| addresses[b]).collect());
        }
        let hidden: Vec<usize> = (0..candidates.len())
            .filter(|&k| status[2 * k] < 0 || status[2 * k + 1] < 0)
            .collect();
        let mut moved_by_fault = vec![false; candidates.len()];
        let firsts: Vec<usize> = hidden.iter().map(|&k| ends[2 * k]).collect();
        if !hidden.is_empty() && self.read_to_take_faults(&firsts) {
            let again_at: Vec<usize> = hidden
                .iter()
                .flat_map(|&k| [ends[2 * k], ends[2 * k + 1]])
                .collect();
            let mut again = vec![0i32; again_at.len()];
            if self.ask(&again_at, &mut again).is_ok() {
                for (j, &k) in hidden.iter().enumerate() {
                    let (first, last) = (again[2 * j], again[2 * j + 1]);
                    // Both on the target after the read, the last page not there before: the
                    // fault moved a huge page whole.
                    moved_by_fault[k] = first == self.to as i32
                        && last == first
                        && status[2 * k + 1] != self.to as i32;
                    if moved_by_fault[k] {
                        self.huge_pages += 1;
                        self.moved += self.huge_bytes;
                    }
                    status[2 * k] = first;
                    status[2 * k + 1] = last;
                }
            }
        }
        for (k, &b) in candidates.iter().enumerate() {
            let (first, last) = (status[2 * k], status[2 * k + 1]);
            if moved_by_fault[k] {
                continue;
            }
            if memory_decision::moves_by_its_first_page(first, last, self.from) {
                whole.push(addresses[b]);
            } else {
                unsure.push(addresses[b]);
            }
        }
        (whole, unsure)
    }

    /// Moves the pages at `at` to the target and returns, for each, the target's node where it
    /// landed or a negative errno why not (`-EBUSY`, `-EACCES`, `-ENOENT`, ...), counting those
    /// refused by why. `move_pages` is read exactly ([`memory_decision::after_move`]): after a
    /// positive return (a page of a group would not migrate, and the kernel wrote no status for
    /// the group) the pages are asked where they lie, and those it never tried are moved again,
    /// in [`memory_decision::MOVE_ROUNDS`] rounds at most; those still on a source count as
    /// busy. NUMA balancing's scan may mark pages between the question and the move (it runs as
    /// the thread returns from a call): those are read and moved again too.
    fn move_and_count(&mut self, at: &[usize]) -> Result<Vec<i32>, StoppedShort> {
        use memory_decision::AfterMove;
        let mut result = vec![-libc::EBUSY; at.len()];
        let mut pending: Vec<usize> = (0..at.len()).collect();
        for _ in 0..memory_decision::MOVE_ROUNDS {
            if pending.is_empty() {
                break;
            }
            let addresses: Vec<usize> = pending.iter().map(|&i| at[i]).collect();
            let mut written = vec![sys::NO_STATUS; addresses.len()];
            let not_moved = self
                .move_pages(&addresses, &mut written)
                .map_err(StoppedShort::Refused)?;
            let mut now = None;
            if memory_decision::ask_after_move(not_moved, &written) {
                let mut asked = vec![sys::NO_STATUS; addresses.len()];
                if self.ask(&addresses, &mut asked).is_ok() {
                    now = Some(asked);
                }
            }
            let (mut again, mut hidden) = (Vec::new(), Vec::new());
            let mut landed = 0;
            for (k, &i) in pending.iter().enumerate() {
                let fate = memory_decision::after_move(
                    written[k],
                    now.as_ref().map(|n| n[k]),
                    self.to,
                    self.from,
                );
                result[i] = match fate {
                    AfterMove::Landed => {
                        landed += 1;
                        self.to as i32
                    }
                    AfterMove::TryAgain => {
                        again.push(i);
                        -libc::EBUSY
                    }
                    AfterMove::Hidden => {
                        hidden.push(i);
                        -libc::ENOENT
                    }
                    AfterMove::Shared => -libc::EACCES,
                    AfterMove::Busy => -libc::EBUSY,
                    AfterMove::Elsewhere => -libc::EINVAL,
                };
            }
            // Hidden pages are read (taking their hinting fault) and tried again with the rest.
            let read: Vec<usize> = hidden.iter().map(|&i| at[i]).collect();
            let took_faults = !read.is_empty() && self.read_to_take_faults(&read);
            if took_faults {
                again.extend(hidden);
                again.sort_unstable();
            }
            // A round where nothing landed and nothing was made visible: what is left stays.
            if landed == 0 && !took_faults {
                break;
            }
            pending = again;
        }
        for &s in &result {
            match -s {
                libc::ENOENT => self.hidden += 1,
                libc::EACCES => self.shared += 1,
                libc::EBUSY => self.busy += 1,
                _ => {}
            }
        }
        Ok(result)
    }

    /// How many of `status` lie on the target.
    fn landed(&self, status: &[i32]) -> u64 {
        status.iter().filter(|&&s| s == self.to as i32).count() as u64
    }

    /// Pages present by `pagemap` that `move_pages` answers `-ENOENT` for: on kernels 6.1 to
    /// 6.4 it does so for every page automatic NUMA balancing has marked for a hinting fault
    /// (measured in the guest: most of a buffer a second after it was touched). Reading a byte
    /// of each through `process_vm_readv` takes that fault as the program's own access would,
    /// after which `move_pages` sees the page; their status is asked again. Where that read is
    /// refused (a seccomp profile), they stay and count as not moved.
    /// Where the thread's policy could not be set (`OwnFaultsMoveNothing`), the kernel's fault
    /// path may itself move a page it finds misplaced: at most `limit` pages are read (the
    /// budget left), and those that land on the target count as moved.
    /// In a mapping with huge pages, whole hidden blocks go first (`resolve_hidden_huge_pages`).
    fn resolve_hinting_faults(
        &mut self,
        huge: bool,
        addresses: &[usize],
        status: &mut [i32],
        mut limit: u64,
    ) {
        if huge && self.page_bytes < self.huge_bytes {
            limit = limit.saturating_sub(self.resolve_hidden_huge_pages(addresses, status, limit));
        }
        let hidden: Vec<usize> = hidden_by_a_hinting_fault(status)
            .take(limit as usize)
            .collect();
        if hidden.is_empty() {
            return;
        }
        let at: Vec<usize> = hidden.iter().map(|&i| addresses[i]).collect();
        if !self.read_to_take_faults(&at) {
            return;
        }
        let mut again = vec![0i32; at.len()];
        if self.ask(&at, &mut again).is_ok() {
            for (&i, s) in hidden.iter().zip(again) {
                if s == self.to as i32 {
                    self.moved += self.page_bytes;
                }
                status[i] = s;
            }
        }
    }

    /// Reads one byte of each page at `at`, taking their hinting faults, and counts the reads
    /// done and refused. False where the call itself was refused (a seccomp profile).
    fn read_to_take_faults(&mut self, at: &[usize]) -> bool {
        let reading = Instant::now();
        let read = sys::read_one_byte_of_each(at);
        self.steps.reading += reading.elapsed();
        match read {
            Ok(n) => {
                self.read += n as u64;
                self.read_refused += (at.len() - n) as u64;
                true
            }
            Err(_) => {
                self.read_refused += at.len() as u64;
                false
            }
        }
    }

    /// Hidden whole blocks of a mapping with huge pages: a read of a block's first page takes the
    /// hinting fault of the whole huge page, and the kernel's fault path may move that huge page
    /// whole to the reading thread's node. A block whose last page, not read, then answers the
    /// target was one huge page and moved: counted as one (the rest of the walk never sees it
    /// again). Returns the base pages it took of `limit`.
    fn resolve_hidden_huge_pages(
        &mut self,
        addresses: &[usize],
        status: &mut [i32],
        limit: u64,
    ) -> u64 {
        let per_huge = (self.huge_bytes / self.page_bytes) as usize;
        let hidden: Vec<usize> = hidden_by_a_hinting_fault(status).collect();
        let hidden_at: Vec<usize> = hidden.iter().map(|&i| addresses[i]).collect();
        let blocks: Vec<usize> =
            memory_decision::huge_blocks(&hidden_at, self.page_bytes, self.huge_bytes)
                .into_iter()
                .take((limit / per_huge as u64) as usize)
                .collect();
        if blocks.is_empty() {
            return 0;
        }
        let firsts: Vec<usize> = blocks.iter().map(|&b| hidden_at[b]).collect();
        if !self.read_to_take_faults(&firsts) {
            return 0;
        }
        // Every page of the blocks asked again: one read took a huge page's fault for all of it.
        let pages: Vec<usize> = blocks.iter().flat_map(|&b| b..b + per_huge).collect();
        let at: Vec<usize> = pages.iter().map(|&p| hidden_at[p]).collect();
        let mut again = vec![0i32; at.len()];
        if self.ask(&at, &mut again).is_err() {
            return 0;
        }
        for (&p, &s) in pages.iter().zip(&again) {
            status[hidden[p]] = s;
        }
        // A block wholly on the target now was a huge page the fault path moved (where the
        // thread's policy could not be set, see `OwnFaultsMoveNothing`); the others are moved
        // with the batch, whole.
        let mut taken = 0;
        for block in again.chunks(per_huge) {
            if block.iter().all(|&s| s == self.to as i32) {
                self.huge_pages += 1;
                self.moved += self.huge_bytes;
                taken += per_huge as u64;
            }
        }
        taken
    }
}

/// The indices of `status` (`move_pages`' answers) for pages it could not see: on kernels 6.1 to
/// 6.4, those marked for a hinting fault.
fn hidden_by_a_hinting_fault(status: &[i32]) -> impl Iterator<Item = usize> + '_ {
    (0..status.len()).filter(|&i| status[i] == -libc::ENOENT || status[i] == -libc::EFAULT)
}

/// What the report says: `None` until a move ran.
pub(super) fn reported() -> Option<MemoryMoved> {
    let node = MOVED_TO.load(Ordering::Acquire);
    (node != NONE).then(|| MemoryMoved {
        node,
        moves: MOVES.load(Ordering::Relaxed),
        bytes_moved: BYTES_MOVED.load(Ordering::Relaxed),
        bytes_not_moved: BYTES_NOT_MOVED.load(Ordering::Relaxed),
        huge_pages_moved: HUGE_PAGES_MOVED.load(Ordering::Relaxed),
        millis: MICROS.load(Ordering::Relaxed) as f64 / 1000.0,
    })
}

/// In a fork child: a move the parent was running is not running here.
pub(super) fn after_fork_child() {
    MOVING.store(false, Ordering::Release);
}
