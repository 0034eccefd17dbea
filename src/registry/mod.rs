//! The registry model: every thread the library knows, its role and placement, the mask it would
//! have had without the library, and the leases (SPEC §2, §3, §5).
//!
//! The model is pure: it reaches the kernel only through a [`ThreadMasks`], so the rules are
//! unit-tested here without preloading, and the engine runs them against the real syscalls. The
//! engine holds the model under one lock; every operation that changes masks runs inside it, which
//! is what makes a thread being born and a `configure` sweeping the process agree.
//!
//! This file holds the model's types, its lookups, and the changes one call makes to one thread
//! (a role, the application's own mask, a step pin). Each other file holds the rules of one
//! concern: births, exits, leases, publishing into the thread table `ps` reads, and the registry
//! of a fork child; [`report`] writes the model as the JSON report.
//!
//! Uses the root's leaves, `handoff`, `table` (to publish) and `placement`; never the engine.

use std::sync::Arc;

use serde::Serialize;

mod births;
mod exits;
mod fork;
mod leases;
mod publish;
pub mod report;

pub use crate::identity::{Placement, Role, Tid};
use crate::mask::CpuMask;
use crate::table::threadtable;

pub type SharedMask = Arc<CpuMask>;

/// Index of a thread's entry; the engine stores `slot + 1` in the thread's pthread key.
pub type Slot = u32;

/// The kernel's per-thread masks, as the model needs them. Errors are positive errno values.
pub trait ThreadMasks {
    /// The current mask of `tid` (0 = the calling thread).
    fn get(&self, tid: Tid) -> Result<CpuMask, i32>;
    fn set(&self, tid: Tid, mask: &CpuMask) -> Result<(), i32>;

    /// Every thread of the process, as the kernel lists them (`/proc/self/task`), registered or
    /// not.
    fn thread_ids(&self) -> Vec<Tid>;

    /// How many threads the process has; cheaper than listing them (one small read).
    fn thread_count(&self) -> usize {
        self.thread_ids().len()
    }

    /// Reads `tid`'s mask and returns it only when it differs from `expected` (`Ok(None)` when
    /// equal). Configure and release ask this once a thread; the engine answers without
    /// allocating.
    fn differs_from(&self, tid: Tid, expected: &CpuMask) -> Result<Option<CpuMask>, i32> {
        let actual = self.get(tid)?;
        Ok((actual != *expected).then_some(actual))
    }
}

#[derive(Debug, Clone)]
pub struct ThreadEntry {
    pub tid: Tid,
    /// The `pthread_t`, 0 when unknown (the main thread seen from another thread).
    pub handle: u64,
    pub role: Role,
    pub placement: Placement,
    /// The mask this thread would have without the library; restoration puts it back.
    pub natural: SharedMask,
    /// The mask the library believes the kernel holds (what it set, inherited or observed).
    pub current: SharedMask,
    /// The mask it was born with; `configure` promotes only descendants still on it.
    pub born: SharedMask,
    /// The lease of the worker scope open on this thread: the threads it creates are born
    /// workers. Cleared when the scope ends or its lease is released.
    pub scope: Option<i64>,
    creator: Option<Slot>,
    /// Children alive or being born; an exited thread stays as a tombstone while it has any, so
    /// that grandchildren still count as descendants.
    live_children: u32,
    alive: bool,
}

/// The worker mask in force while a lease is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub device: String,
    pub mask: SharedMask,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseInfo {
    pub id: i64,
    pub device: String,
    /// The GPU's index among the GPUs the process sees; `None` where no GPU chose the CPUs
    /// (`TLLM_AFFINITY_CPUS`).
    pub gpu: Option<usize>,
    /// Under `TLLM_AFFINITY_SLICE=gpu`, the GPU's slice (its worker CPUs before the policy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slice: Option<String>,
    /// The step core `auto` gives the GPU within its slice, where the slice holds one: where
    /// an executor-loop pin that would leave the slice goes instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slice_step_core: Option<String>,
}

/// A lease's GPU slice, as [`Registry::describe_slice`] records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSlice {
    pub cpus: CpuMask,
    pub step_core: Option<CpuMask>,
}

/// What the creator decided for a thread about to be born; travels in the start packet.
#[derive(Debug, Clone)]
pub struct ChildPlan {
    creator: Option<Slot>,
    role: Role,
    /// Created in its creator's worker scope: the worker's thread, whatever mask its creator
    /// chose for itself.
    scoped: bool,
    explicit: Option<SharedMask>,
    epoch: u64,
    /// The mask the child must move onto, when inheritance does not already put it there.
    birth_move: Option<BirthMove>,
    /// The child is on `birth_move`'s mask: it moved itself before registering.
    moved: bool,
    /// The creator as it was at the plan, just before the kernel copied its mask into the child.
    creator_at_plan: Option<CreatorAtPlan>,
}

/// The creator as it was at the plan: its placement and which of the registry's masks it was on
/// (by address: no reference is taken, the birth's hot path touches no count for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CreatorAtPlan {
    placement: Placement,
    on: usize,
}

impl CreatorAtPlan {
    fn of(entry: &ThreadEntry) -> Self {
        CreatorAtPlan {
            placement: entry.placement,
            on: Arc::as_ptr(&entry.current) as usize,
        }
    }
}

/// A move the creator decided under the lock, for the child to make before it takes the lock:
/// moving can migrate it to another CPU, tens of microseconds during which every other birth and
/// exit would wait.
#[derive(Debug, Clone)]
struct BirthMove {
    mask: SharedMask,
    placement: Placement,
    /// What the kernel gives the child at clone: its creator's mask.
    inherited: SharedMask,
}

impl ChildPlan {
    /// The mask the new thread should move onto before it registers, if any.
    pub fn move_at_birth(&self) -> Option<&CpuMask> {
        self.birth_move.as_ref().map(|b| &*b.mask)
    }

    /// Records that the new thread is on [`Self::move_at_birth`]'s mask.
    pub fn mark_moved(&mut self) {
        self.moved = self.birth_move.is_some();
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigureOutcome {
    pub lease: i64,
    /// The worker mask did not change (a repeated configure for the same device).
    pub unchanged: bool,
    /// Another device's mask replaced the one in force.
    pub retargeted_from: Option<String>,
    /// Worker threads now on the worker mask / worker threads considered.
    pub on_mask: usize,
    pub workers: usize,
    /// Worker threads left alone because someone else chose their mask.
    pub preserved: usize,
}

/// What opening a lease does to its caller (SPEC §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseKind {
    /// `configure`: the caller becomes a worker with its live descendants.
    Configure,
    /// `begin_worker_scope`: the caller keeps its role; the threads it creates until the scope
    /// ends are born workers.
    WorkerScope,
}

/// `release` of a lease that was never opened or is already closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownLease;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReleaseOutcome {
    /// This release closed the last lease, so masks were restored.
    pub last: bool,
    pub restored: usize,
    pub preserved: usize,
}

/// A thread as reports show it.
#[derive(Debug, Clone, Serialize)]
pub struct ThreadView {
    pub tid: Tid,
    pub role: Role,
    pub placement: Placement,
    pub mask: String,
    pub natural: String,
}

/// What the process did over its life, for the report written at exit, when the last release
/// has already put every mask back and the live threads alone would tell nothing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct History {
    /// The most worker threads alive at once.
    pub peak_workers: usize,
    pub leases_opened: u64,
    pub leases_released: u64,
    /// Threads the last releases put back on their natural mask.
    pub threads_restored: u64,
    /// Threads a last release left alone because someone else changed their mask.
    pub threads_preserved: u64,
    /// Threads the library saw being born (`pthread_create`).
    pub threads_created: u64,
}

#[derive(Debug, Default)]
pub struct Registry {
    slots: Vec<Option<ThreadEntry>>,
    free: Vec<Slot>,
    target: Option<Target>,
    leases: Vec<LeaseInfo>,
    next_lease: i64,
    /// Bumped whenever the target changes, so a thread born across a change re-decides.
    epoch: u64,
    /// The shared thread table `tllm-affinity ps` reads (see
    /// [`threadtable`](crate::table::threadtable)), when mapped.
    published: Option<&'static threadtable::Mapped>,
    /// Its records whose pages exist (see [`threadtable::Mapped::allocated_records`]).
    published_records: &'static [std::sync::atomic::AtomicU64],
    /// Children planned whose registration (or cancellation) is still to come.
    births_pending: usize,
    /// Worker threads alive now, kept as roles change so the peak costs no walk.
    workers_alive: usize,
    history: History,
    /// The threads that existed when the first open lease was opened (sorted): a thread the
    /// library never saw that is not among them was born during the leases.
    tids_at_first_lease: Vec<Tid>,
    /// What such an unseen thread would have had without the library, when it was born on a
    /// mask the library set: the launch mask within the cpuset (its creator is unknown).
    unseen_natural: Option<SharedMask>,
    /// Births decided by the general rule alone, so the tests can hold the fast births to it.
    #[cfg(test)]
    general_births_only: bool,
    /// Exits taken by the general rule alone, so the tests can hold the fast exits to it.
    #[cfg(test)]
    general_exits_only: bool,
}

impl Registry {
    pub const fn new() -> Self {
        Registry {
            slots: Vec::new(),
            free: Vec::new(),
            target: None,
            leases: Vec::new(),
            next_lease: 1,
            births_pending: 0,
            epoch: 0,
            published: None,
            published_records: &[],
            workers_alive: 0,
            history: History {
                peak_workers: 0,
                leases_opened: 0,
                leases_released: 0,
                threads_restored: 0,
                threads_preserved: 0,
                threads_created: 0,
            },
            tids_at_first_lease: Vec::new(),
            unseen_natural: None,
            #[cfg(test)]
            general_births_only: false,
            #[cfg(test)]
            general_exits_only: false,
        }
    }

    pub fn entry(&self, slot: Slot) -> Option<&ThreadEntry> {
        self.slots.get(slot as usize)?.as_ref().filter(|e| e.alive)
    }

    fn entry_mut(&mut self, slot: Slot) -> Option<&mut ThreadEntry> {
        self.slots
            .get_mut(slot as usize)?
            .as_mut()
            .filter(|e| e.alive)
    }

    pub fn target(&self) -> Option<&Target> {
        self.target.as_ref()
    }

    pub fn leases(&self) -> &[LeaseInfo] {
        &self.leases
    }

    pub fn history(&self) -> History {
        self.history
    }

    fn count_worker(&mut self, became_worker: bool) {
        if became_worker {
            self.workers_alive += 1;
            self.history.peak_workers = self.history.peak_workers.max(self.workers_alive);
        } else {
            self.workers_alive = self.workers_alive.saturating_sub(1);
        }
    }

    pub fn live_threads(&self) -> impl Iterator<Item = (Slot, &ThreadEntry)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().filter(|e| e.alive).map(|e| (i as Slot, e)))
    }

    pub fn live_count(&self) -> usize {
        self.live_threads().count()
    }

    pub fn find_tid(&self, tid: Tid) -> Option<Slot> {
        self.live_threads()
            .find(|(_, e)| e.tid == tid)
            .map(|(s, _)| s)
    }

    pub fn find_handle(&self, handle: u64) -> Option<Slot> {
        if handle == 0 {
            return None;
        }
        self.live_threads()
            .find(|(_, e)| e.handle == handle)
            .map(|(s, _)| s)
    }

    /// The application set this thread's mask itself (`sched_setaffinity`,
    /// `pthread_setaffinity_np`): from now on it is the application's choice.
    pub fn observe_explicit(&mut self, slot: Slot, mask: CpuMask) {
        if let Some(e) = self.entry_mut(slot) {
            e.placement = Placement::Explicit;
            e.current = Arc::new(mask);
        }
        self.publish(slot);
    }

    /// The application has just set `tid`'s mask: its placement is the application's from now
    /// on, in the thread table at once (`tllm-affinity ps`), whatever the mask, the worker mask
    /// included. Allocates nothing (a signal handler may be the caller); the mask itself is taken
    /// in by [`Registry::observe_explicit`] at the next operation.
    pub fn mark_explicit(&mut self, tid: Tid) {
        let Some(slot) = self.find_tid(tid) else {
            return;
        };
        if let Some(e) = self.entry_mut(slot) {
            e.placement = Placement::Explicit;
        }
        self.publish(slot);
    }

    /// Sets the role of a thread (the caller of `configure`), registering nothing new.
    pub fn set_role(&mut self, slot: Slot, role: Role) {
        let mut changed = false;
        if let Some(e) = self.entry_mut(slot) {
            changed = e.role != role;
            e.role = role;
        }
        if changed {
            self.count_worker(role == Role::Worker);
        }
        self.publish(slot);
    }

    /// Pins one thread for SPEC §6 (`Step` or `Result`), remembering its natural mask.
    pub fn pin(
        &mut self,
        slot: Slot,
        mask: CpuMask,
        placement: Placement,
        kernel: &impl ThreadMasks,
    ) -> Result<(), i32> {
        let e = self.entry(slot).ok_or(libc::ESRCH)?;
        kernel.set(e.tid, &mask)?;
        let natural = if e.placement.set_by_library() {
            e.natural.clone()
        } else {
            e.current.clone()
        };
        if let Some(e) = self.entry_mut(slot) {
            e.natural = natural;
            e.current = Arc::new(mask);
            e.placement = placement;
        }
        self.publish(slot);
        Ok(())
    }

    pub fn snapshot(&self) -> Vec<ThreadView> {
        self.live_threads()
            .map(|(_, e)| ThreadView {
                tid: e.tid,
                role: e.role,
                placement: e.placement,
                mask: e.current.to_list(),
                natural: e.natural.to_list(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
