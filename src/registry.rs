//! The registry model: every thread the library knows, its role and placement, the mask it would
//! have had without the library, and the leases (SPEC §2, §3, §5).
//!
//! The model is pure: it reaches the kernel only through a [`ThreadMasks`], so the rules are
//! unit-tested here without preloading, and the engine runs them against the real syscalls. The
//! engine holds the model under one lock; every operation that changes masks runs inside it, which
//! is what makes a thread being born and a `configure` sweeping the process agree.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::Serialize;

pub use crate::identity::{Placement, Role, Tid};
use crate::mask::CpuMask;
use crate::threadtable;

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

/// Whether a child now on `child_mask` was cloned before its creator changed from `at_plan` to
/// `now`. The clone copied the creator's mask. When the registry knows the creator's new mask
/// (a configure or `observe_explicit` replaced it), a child on another mask was cloned before.
/// When only the placement changed (a program's own set, marked by the shim before its mask is
/// read in), the registry's mask is still the one of the plan, and a child on it was cloned
/// before.
fn born_before_the_change(now: &ThreadEntry, at_plan: CreatorAtPlan, child_mask: &CpuMask) -> bool {
    if Arc::as_ptr(&now.current) as usize == at_plan.on {
        *now.current == *child_mask
    } else {
        *now.current != *child_mask
    }
}

/// A creator as the birth rule reads it: as it is now, or as it was at the plan.
#[derive(Clone, Copy)]
struct CreatorView<'a> {
    placement: Placement,
    natural: &'a SharedMask,
}

impl<'a> CreatorView<'a> {
    fn now(entry: &'a ThreadEntry) -> Self {
        CreatorView {
            placement: entry.placement,
            natural: &entry.natural,
        }
    }

    /// The creator with the placement it had at the plan. Its natural mask is the one it has
    /// now: setting a mask (its own, a configure's, a release's) leaves that alone.
    fn at_plan(at_plan: CreatorAtPlan, now: &'a ThreadEntry) -> Self {
        CreatorView {
            placement: at_plan.placement,
            natural: &now.natural,
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
    /// The shared thread table `tllm-affinity ps` reads (see [`threadtable`]), when mapped.
    published: Option<&'static [AtomicU64]>,
    /// The table's header and lease words, where the open leases are published.
    published_leases: Option<(&'static [AtomicU64], &'static [AtomicU64])>,
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
            published_leases: None,
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

    /// Sets the mask an unseen thread born on a library mask gets back at the last release.
    pub fn set_unseen_natural(&mut self, mask: CpuMask) {
        self.unseen_natural = (!mask.is_empty()).then(|| Arc::new(mask));
    }

    /// Starts publishing roles and placements into `table`, one record per slot.
    pub fn publish_into(&mut self, table: Option<&'static [AtomicU64]>) {
        self.published = table;
        if let Some(t) = table {
            for record in t.iter().take(self.slots.len()) {
                record.store(0, Ordering::Relaxed);
            }
        }
        self.publish_all();
    }

    /// Starts publishing the open leases into a table's header and lease words (see
    /// [`threadtable::write_leases`]), and publishes those open now.
    pub fn publish_leases_into(
        &mut self,
        words: Option<(&'static [AtomicU64], &'static [AtomicU64])>,
    ) {
        self.published_leases = words;
        self.publish_leases();
    }

    /// Writes the open leases into the table; under the registry's lock, their one writer.
    fn publish_leases(&self) {
        let Some((header, words)) = self.published_leases else {
            return;
        };
        let open: Vec<threadtable::LeaseLine> = self
            .leases
            .iter()
            .map(|l| threadtable::LeaseLine {
                id: l.id,
                gpu_index: l.gpu,
                device: l.device.clone(),
            })
            .collect();
        threadtable::write_leases(header, words, &open);
    }

    fn publish(&self, slot: Slot) {
        let Some(record) = self.published.and_then(|t| t.get(slot as usize)) else {
            return;
        };
        let value = match self.entry(slot) {
            Some(e) => threadtable::encode(e.tid, e.role, e.placement),
            None => 0,
        };
        record.store(value, Ordering::Relaxed);
    }

    fn publish_all(&self) {
        if self.published.is_some() {
            for slot in 0..self.slots.len() as Slot {
                self.publish(slot);
            }
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

    // Inlined: it runs on every birth, and the call would cost more than its body.
    #[inline(always)]
    fn insert(&mut self, entry: ThreadEntry) -> Slot {
        if entry.role == Role::Worker {
            self.count_worker(true);
        }
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(entry);
                slot
            }
            None => {
                self.slots.push(Some(entry));
                (self.slots.len() - 1) as Slot
            }
        };
        self.publish(slot);
        slot
    }

    /// Registers a thread the library did not see being born (the main thread at load, or a
    /// thread that calls in before anything else knew it), with its mask as the kernel has it.
    pub fn register_root(&mut self, tid: Tid, handle: u64, role: Role, mask: CpuMask) -> Slot {
        let mask = Arc::new(mask);
        let slot = self.insert(ThreadEntry {
            tid,
            handle,
            role,
            placement: Placement::Inherited,
            natural: mask.clone(),
            current: mask.clone(),
            born: mask,
            scope: None,
            creator: None,
            live_children: 0,
            alive: true,
        });
        // A pending child may have counted on the room this root took.
        self.keep_room_for_births();
        slot
    }

    /// SPEC §2, the role rule: a new thread takes its creator's role, unless its start routine
    /// lives in a worker library or its creator has a worker scope open (then it is a worker);
    /// an unknown creator counts as host. An explicit attr mask is the caller's choice and is
    /// never overridden.
    #[inline(always)]
    pub fn plan_child(
        &mut self,
        creator: Option<Slot>,
        start_in_worker_lib: bool,
        explicit: Option<CpuMask>,
    ) -> ChildPlan {
        let creator_entry = creator.and_then(|s| self.entry(s));
        let scoped = creator_entry.is_some_and(|c| c.scope.is_some());
        let role = match creator_entry {
            _ if start_in_worker_lib || scoped => Role::Worker,
            Some(c) => c.role,
            None => Role::Host,
        };
        let birth_move = creator_entry
            .filter(|c| explicit.is_none() && c.placement != Placement::External)
            .and_then(|c| {
                let (mask, placement) =
                    self.birth(role, scoped, Some(CreatorView::now(c)), &c.current);
                (*mask != c.current).then(|| BirthMove {
                    mask: mask.clone(),
                    placement,
                    inherited: c.current.clone(),
                })
            });
        let creator_at_plan = creator_entry.map(CreatorAtPlan::of);
        let creator = creator.filter(|_| creator_entry.is_some());
        if let Some(e) = creator.and_then(|s| self.entry_mut(s)) {
            e.live_children += 1;
        }
        self.births_pending += 1;
        self.keep_room_for_births();
        ChildPlan {
            creator,
            role,
            scoped,
            explicit: explicit.map(Arc::new),
            epoch: self.epoch,
            birth_move,
            moved: false,
            creator_at_plan,
        }
    }

    /// The new thread registers and later exits without allocating: a `malloc` or `free` there
    /// would build its malloc cache and attach it to an arena (see `engine::packets`). So the
    /// creator grows the slot table and the free list for every birth still pending.
    fn keep_room_for_births(&mut self) {
        self.slots.reserve(self.births_pending);
        let most_free = self.slots.len() + self.births_pending;
        self.free.reserve(most_free.saturating_sub(self.free.len()));
    }

    /// The real `pthread_create` failed: the child will never register.
    pub fn cancel_child(&mut self, plan: ChildPlan) {
        self.births_pending = self.births_pending.saturating_sub(1);
        if let Some(creator) = plan.creator {
            self.drop_child_of(creator);
        }
    }

    /// SPEC §2/§3/§6, the birth rule, in one place. Returns the mask the new thread must be on
    /// and its placement, given the mask the kernel gave it by inheritance. `scoped`: created in
    /// its creator's worker scope.
    fn birth<'a>(
        &'a self,
        role: Role,
        scoped: bool,
        creator: Option<CreatorView<'a>>,
        inherited: &'a SharedMask,
    ) -> (&'a SharedMask, Placement) {
        // A scope says the new thread is the worker's, not the creator's: the creator's own
        // hand-chosen mask does not pass to it.
        let creator_chose_by_hand =
            !scoped && creator.is_some_and(|c| c.placement.chosen_by_others());
        match (&self.target, creator) {
            // A worker is born on the worker mask while a lease is open, unless its worker
            // creator's mask was chosen by the application (children inherit that choice).
            (Some(t), _) if role == Role::Worker && !creator_chose_by_hand => {
                (&t.mask, Placement::Worker)
            }
            // Children of a pinned step/result thread never stay on its single core.
            (_, Some(c)) if matches!(c.placement, Placement::Step | Placement::Result) => {
                (c.natural, Placement::Inherited)
            }
            _ => (inherited, Placement::Inherited),
        }
    }

    /// Registers a newly born thread from inside it and puts it on its mask. `inherited` is the
    /// mask the kernel gave it when the engine knows it without asking (the creator's current
    /// mask); otherwise the model asks the kernel.
    pub fn register_child(
        &mut self,
        plan: &ChildPlan,
        tid: Tid,
        handle: u64,
        kernel: &impl ThreadMasks,
    ) -> Slot {
        self.births_pending = self.births_pending.saturating_sub(1);
        // Borrowed, not cloned: this runs for every new thread. An exited creator stays as a
        // tombstone until its children register, so its slot still holds it.
        let creator: Option<&ThreadEntry> = plan
            .creator
            .and_then(|s| self.slots.get(s as usize)?.as_ref());
        if let Some((c, placement)) =
            creator.and_then(|c| self.continues_creator(plan, c).map(|p| (c, p)))
        {
            let natural = match placement {
                Placement::Worker => &c.natural,
                _ => &c.current,
            };
            let entry = ThreadEntry {
                tid,
                handle,
                role: plan.role,
                placement,
                natural: natural.clone(),
                current: c.current.clone(),
                born: c.current.clone(),
                scope: None,
                creator: plan.creator,
                live_children: 0,
                alive: true,
            };
            self.history.threads_created += 1;
            return self.insert(entry);
        }
        let moved = plan.birth_move.as_ref().filter(|_| plan.moved);
        let across_a_change = plan.epoch != self.epoch;
        let at_plan = plan.creator_at_plan;
        let changed_since_plan =
            matches!((creator, at_plan), (Some(c), Some(p)) if CreatorAtPlan::of(c) != p);
        let mut view = creator.map(CreatorView::now);
        // The creator's current mask is what the kernel copied, unless it changed behind our
        // back, or it or the target changed while the thread was being born; then ask the
        // kernel. The kernel copied the creator's mask at the clone, so when the creator changed
        // since the plan, the child's mask tells whether the change came after the clone (a
        // creator setting its own mask once the create returned: the child continues the
        // creator as it was) or before (a configure on another thread moving it: as it is). A
        // child that already moved cannot ask: born across a change, it is decided as if born
        // now, from its creator's mask now.
        let read_from_kernel;
        let inherited: &SharedMask = match (moved, creator) {
            (None, Some(c))
                if !across_a_change
                    && !changed_since_plan
                    && c.placement != Placement::External =>
            {
                &c.current
            }
            (None, _) => {
                read_from_kernel = Arc::new(kernel.get(tid).unwrap_or_default());
                if let (Some(c), Some(p)) = (creator, at_plan) {
                    if changed_since_plan
                        && p.placement != Placement::External
                        && born_before_the_change(c, p, &read_from_kernel)
                    {
                        view = Some(CreatorView::at_plan(p, c));
                    }
                }
                &read_from_kernel
            }
            (Some(_), Some(c)) if across_a_change && c.placement != Placement::External => {
                &c.current
            }
            (Some(m), _) => &m.inherited,
        };
        // The mask the thread is on now.
        let on_now = moved.map_or(inherited, |m| &m.mask);
        // A configure that promoted the creator after it planned this thread, but before the
        // thread could register, did not see it: it is a live descendant on its birth mask, so
        // it is promoted here, as configure would have (SPEC §2).
        let role = match creator {
            Some(c) if plan.role == Role::Host && c.role == Role::Worker => Role::Worker,
            _ => plan.role,
        };
        let (mask, placement) = if let Some(explicit) = &plan.explicit {
            (explicit, Placement::Explicit)
        } else {
            let (wanted, placement) = self.birth(role, plan.scoped, view, inherited);
            if wanted != on_now && kernel.set(tid, wanted).is_err() {
                moved.map_or((on_now, Placement::Inherited), |m| (&m.mask, m.placement))
            } else {
                (wanted, placement)
            }
        };
        // A worker born on the mask the application chose for its creator carries that choice:
        // a later configure (even a repeated one for the same device) must not override it,
        // nor a release "restore" it. A scope's thread is the worker's, not the creator's.
        let placement = match view {
            Some(c)
                if role == Role::Worker
                    && !plan.scoped
                    && placement == Placement::Inherited
                    && c.placement.chosen_by_others() =>
            {
                c.placement
            }
            _ => placement,
        };
        let natural = match view {
            _ if placement == Placement::Explicit => mask,
            Some(c) if c.placement.set_by_library() => c.natural,
            _ => inherited,
        };
        // The only reference counts this birth touches: three.
        let entry = ThreadEntry {
            tid,
            handle,
            role,
            placement,
            natural: natural.clone(),
            current: mask.clone(),
            born: mask.clone(),
            scope: None,
            creator: plan.creator,
            live_children: 0,
            alive: true,
        };
        self.history.threads_created += 1;
        self.insert(entry)
    }

    /// The births most threads have, decided without the general rule below: nothing changed
    /// since the creator planned the child (same epoch, the creator as at the plan, its mask
    /// neither asked for nor moved onto), and the child continues its creator on the creator's
    /// mask, either as a thread of the same role inheriting an inherited mask outside a worker's
    /// move, or as a worker born on the worker mask its worker creator is on. Returns the
    /// child's placement; its mask is the creator's current one, its natural mask the creator's
    /// for a worker (the library set both), the same mask otherwise. What it decides is what the
    /// general rule decides (`registry::tests::fast_births_decide_as_the_general_rule`).
    fn continues_creator(&self, plan: &ChildPlan, c: &ThreadEntry) -> Option<Placement> {
        #[cfg(test)]
        if self.general_births_only {
            return None;
        }
        if plan.explicit.is_some() || plan.birth_move.is_some() || plan.epoch != self.epoch {
            return None;
        }
        if plan.creator_at_plan != Some(CreatorAtPlan::of(c)) {
            return None;
        }
        match (c.placement, &self.target) {
            (Placement::Inherited, None) if plan.role == c.role => Some(Placement::Inherited),
            (Placement::Inherited, Some(_)) if plan.role == c.role && c.role == Role::Host => {
                Some(Placement::Inherited)
            }
            (Placement::Worker, Some(t))
                if plan.role == Role::Worker
                    && c.role == Role::Worker
                    && Arc::ptr_eq(&t.mask, &c.current) =>
            {
                Some(Placement::Worker)
            }
            _ => None,
        }
    }

    /// The thread in `slot` exited (return, `pthread_exit` or cancellation).
    #[inline(always)]
    pub fn thread_exited(&mut self, slot: Slot) {
        let Some(Some(e)) = self.slots.get_mut(slot as usize) else {
            return;
        };
        let was_live_worker = e.alive && e.role == Role::Worker;
        e.alive = false;
        let (leaf, creator) = (e.live_children == 0, e.creator);
        if was_live_worker {
            self.count_worker(false);
        }
        self.publish(slot);
        #[cfg(test)]
        let leaf = leaf && !self.general_exits_only;
        // Most exits: a thread with no children whose creator is alive (or unknown) leaves no
        // tombstone and links nothing anew, so its entry goes at once, as `reap` would free it
        // (`registry::tests::fast_exits_free_as_the_general_rule`).
        if leaf {
            let creator_entry = creator.and_then(|c| self.slots.get_mut(c as usize)?.as_mut());
            match creator_entry {
                Some(c) if c.alive => c.live_children = c.live_children.saturating_sub(1),
                Some(_) => {
                    self.skip_exited_creators(slot);
                    self.reap(slot);
                    return;
                }
                None => {}
            }
            self.slots[slot as usize] = None;
            self.free.push(slot);
            return;
        }
        self.skip_exited_creators(slot);
        self.reap(slot);
    }

    /// Links `slot` to its nearest live ancestor, past exited creators, freeing any that no
    /// child needs any more. A tombstone that stays for its children then never points at
    /// another tombstone, so threads that start their successor and exit keep one entry or two,
    /// not the whole chain (SPEC §9: memory grows with the threads alive, not with all ever).
    fn skip_exited_creators(&mut self, slot: Slot) {
        loop {
            let Some(creator) = self
                .slots
                .get(slot as usize)
                .and_then(|e| e.as_ref()?.creator)
            else {
                return;
            };
            let Some(Some(c)) = self.slots.get(creator as usize) else {
                return;
            };
            if c.alive {
                return;
            }
            let grandparent = c.creator;
            if let Some(Some(g)) = grandparent.and_then(|g| self.slots.get_mut(g as usize)) {
                g.live_children += 1;
            }
            if let Some(Some(e)) = self.slots.get_mut(slot as usize) {
                e.creator = grandparent;
            }
            self.drop_child_of(creator);
        }
    }

    fn drop_child_of(&mut self, creator: Slot) {
        if let Some(Some(e)) = self.slots.get_mut(creator as usize) {
            e.live_children = e.live_children.saturating_sub(1);
            self.reap(creator);
        }
    }

    /// Frees exited entries that no child needs any more, walking up the creator chain.
    fn reap(&mut self, mut slot: Slot) {
        loop {
            let Some(Some(e)) = self.slots.get(slot as usize) else {
                return;
            };
            if e.alive || e.live_children > 0 {
                return;
            }
            let creator = e.creator;
            self.slots[slot as usize] = None;
            self.free.push(slot);
            let Some(parent) = creator else { return };
            match self.slots.get_mut(parent as usize) {
                Some(Some(p)) => p.live_children = p.live_children.saturating_sub(1),
                _ => return,
            }
            slot = parent;
        }
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

    fn is_descendant(&self, slot: Slot, ancestor: Slot) -> bool {
        let mut cursor = self
            .slots
            .get(slot as usize)
            .and_then(|e| e.as_ref()?.creator);
        // Creator links only point at older entries, and an entry with children is never
        // freed, so the walk ends; the bound guards against a corrupted chain all the same.
        for _ in 0..self.slots.len() {
            match cursor {
                Some(c) if c == ancestor => return true,
                Some(c) => cursor = self.slots.get(c as usize).and_then(|e| e.as_ref()?.creator),
                None => return false,
            }
        }
        false
    }

    /// SPEC §2/§3/§5: opens a lease of `kind` for `caller` on `device` (the host's GPU `gpu`, as
    /// the table shows it, SPEC §16). For `configure` the caller becomes a
    /// worker with every live descendant still on the mask it was born with; for a worker scope
    /// the caller keeps its role and so do its descendants, and the threads it creates until
    /// [`Self::end_scope`] are born workers. Then every worker thread whose mask the library may
    /// choose is put on `worker_mask` (when the policy gives one); a thread whose mask changed
    /// behind the library's back is left alone and marked `external`.
    pub fn open(
        &mut self,
        kind: LeaseKind,
        caller: Slot,
        device: &str,
        gpu: Option<usize>,
        worker_mask: Option<CpuMask>,
        kernel: &impl ThreadMasks,
    ) -> ConfigureOutcome {
        if self.leases.is_empty() {
            self.tids_at_first_lease = if self.unseen_threads_exist(kernel) {
                let mut tids = kernel.thread_ids();
                tids.sort_unstable();
                tids
            } else {
                Vec::new()
            };
        }
        let lease = self.next_lease;
        self.next_lease += 1;
        self.history.leases_opened += 1;
        self.leases.push(LeaseInfo {
            id: lease,
            device: device.to_string(),
            gpu,
        });
        self.publish_leases();
        let mut outcome = ConfigureOutcome {
            lease,
            ..Default::default()
        };
        let promote = match kind {
            LeaseKind::Configure => {
                self.set_role(caller, Role::Worker);
                Some(caller)
            }
            LeaseKind::WorkerScope => {
                // A thread holds one scope: a nested one leaves the outer in place, so the
                // threads of the outer block stay workers until the outer scope ends.
                if let Some(e) = self.entry_mut(caller) {
                    e.scope.get_or_insert(lease);
                }
                None
            }
        };
        self.set_target(device, worker_mask, &mut outcome);
        self.place_workers(promote, kernel, &mut outcome);
        outcome
    }

    /// The worker mask in force from now on: a repeated mask changes nothing (SPEC §5), another
    /// device's mask retargets.
    fn set_target(
        &mut self,
        device: &str,
        worker_mask: Option<CpuMask>,
        outcome: &mut ConfigureOutcome,
    ) {
        let Some(mask) = worker_mask else { return };
        let previous = self.target.take();
        let unchanged = previous.as_ref().is_some_and(|t| *t.mask == mask);
        outcome.unchanged = unchanged;
        if let Some(p) = previous
            .as_ref()
            .filter(|p| p.device != device && !unchanged)
        {
            outcome.retargeted_from = Some(p.device.clone());
        }
        if !unchanged {
            self.epoch += 1;
        }
        self.target = Some(Target {
            device: device.to_string(),
            mask: previous
                .filter(|_| unchanged)
                .map_or_else(|| Arc::new(mask), |p| p.mask),
        });
    }

    /// Puts every worker thread whose mask the library may choose on the target, promoting
    /// first the live descendants of `promote` still on their birth mask (SPEC §2).
    fn place_workers(
        &mut self,
        promote: Option<Slot>,
        kernel: &impl ThreadMasks,
        outcome: &mut ConfigureOutcome,
    ) {
        let target = self.target.as_ref().map(|t| t.mask.clone());

        // One pass, at most one read and one write a thread: the floor is one write a thread.
        for slot in 0..self.slots.len() as Slot {
            let Some(e) = self.entry(slot) else { continue };
            // The mask read to judge a descendant, when it also proves the thread is on the mask
            // the library believes it holds.
            let mut verified = false;
            if e.role == Role::Host {
                if !promote.is_some_and(|caller| self.is_descendant(slot, caller)) {
                    continue;
                }
                // SPEC §2: a live descendant still on its birth mask becomes a worker.
                if kernel.differs_from(e.tid, &e.born) != Ok(None) {
                    continue;
                }
                verified = e.born == e.current;
                self.set_role(slot, Role::Worker);
            }
            outcome.workers += 1;
            let (Some(target), Some(e)) = (&target, self.entry(slot)) else {
                continue;
            };
            if e.placement.chosen_by_others() {
                outcome.preserved += 1;
                continue;
            }
            if matches!(e.placement, Placement::Step | Placement::Result) {
                continue;
            }
            // Already placed by an earlier configure: nothing to read or write.
            if e.placement == Placement::Worker && e.current == *target {
                outcome.on_mask += 1;
                continue;
            }
            if !verified && !self.still_as_set(slot, kernel, &mut outcome.preserved) {
                continue;
            }
            let Some(e) = self.entry(slot) else { continue };
            if e.current != *target && kernel.set(e.tid, target).is_err() {
                continue;
            }
            if let Some(e) = self.entry_mut(slot) {
                e.placement = Placement::Worker;
                e.current = target.clone();
            }
            self.publish(slot);
            outcome.on_mask += 1;
        }
    }

    /// Ends the worker scope of `lease` (SPEC §7): the thread that holds it creates threads with
    /// its own role again. The lease stays open until released. Returns that thread's tid.
    pub fn end_scope(&mut self, lease: i64) -> Result<Tid, UnknownLease> {
        if !self.leases.iter().any(|l| l.id == lease) {
            return Err(UnknownLease);
        }
        self.close_scope(lease).ok_or(UnknownLease)
    }

    /// Clears the scope of `lease` from the live thread that holds it, if any.
    fn close_scope(&mut self, lease: i64) -> Option<Tid> {
        let slot = self
            .live_threads()
            .find(|(_, e)| e.scope == Some(lease))
            .map(|(slot, _)| slot)?;
        let e = self.entry_mut(slot)?;
        e.scope = None;
        Some(e.tid)
    }

    /// Looks at the thread's mask: true when it is what the library believes. A mask changed
    /// behind the library's back makes the thread `external` (SPEC §2, found when it looks) and
    /// is counted in `preserved`; a thread the kernel no longer knows is neither.
    fn still_as_set(
        &mut self,
        slot: Slot,
        kernel: &impl ThreadMasks,
        preserved: &mut usize,
    ) -> bool {
        let Some(e) = self.entry(slot) else {
            return false;
        };
        match kernel.differs_from(e.tid, &e.current) {
            Ok(None) => true,
            Ok(Some(actual)) => {
                if let Some(e) = self.entry_mut(slot) {
                    e.placement = Placement::External;
                    e.current = Arc::new(actual);
                }
                self.publish(slot);
                *preserved += 1;
                false
            }
            Err(_) => false,
        }
    }

    /// Puts back the natural mask of a thread the library placed, unless it changed since.
    fn restore(&mut self, slot: Slot, kernel: &impl ThreadMasks, outcome: &mut ReleaseOutcome) {
        if !self.still_as_set(slot, kernel, &mut outcome.preserved) {
            return;
        }
        let Some(e) = self.entry(slot) else {
            return;
        };
        if e.natural != e.current && kernel.set(e.tid, &e.natural).is_err() {
            return;
        }
        if let Some(e) = self.entry_mut(slot) {
            e.placement = Placement::Inherited;
            e.current = e.natural.clone();
        }
        self.publish(slot);
        outcome.restored += 1;
    }

    /// SPEC §5: closes a lease (and its worker scope, if still open); the last one restores every
    /// mask the library set, except those changed since, which are preserved and counted.
    pub fn release(
        &mut self,
        lease: i64,
        kernel: &impl ThreadMasks,
    ) -> Result<ReleaseOutcome, UnknownLease> {
        let index = self
            .leases
            .iter()
            .position(|l| l.id == lease)
            .ok_or(UnknownLease)?;
        self.leases.remove(index);
        self.publish_leases();
        self.history.leases_released += 1;
        // A scope ends with its lease, ended or not.
        self.close_scope(lease);
        if !self.leases.is_empty() {
            return Ok(ReleaseOutcome::default());
        }
        let mut outcome = ReleaseOutcome {
            last: true,
            ..Default::default()
        };
        let library_masks: Vec<SharedMask> = self
            .target
            .iter()
            .map(|t| t.mask.clone())
            .chain(
                self.live_threads()
                    .filter(|(_, e)| e.placement.set_by_library())
                    .map(|(_, e)| e.current.clone()),
            )
            .collect();
        if self.target.take().is_some() {
            self.epoch += 1;
        }
        for slot in 0..self.slots.len() as Slot {
            if self
                .entry(slot)
                .is_some_and(|e| e.placement.set_by_library())
            {
                self.restore(slot, kernel, &mut outcome);
            }
        }
        self.restore_unseen(&library_masks, kernel, &mut outcome);
        self.history.threads_restored += outcome.restored as u64;
        self.history.threads_preserved += outcome.preserved as u64;
        Ok(outcome)
    }

    /// SPEC §2's one exception for unseen threads: a thread the library never saw (glibc's
    /// timer, `aio` and `getaddrinfo_a` helpers, started from a worker by glibc itself), born
    /// during the leases and still on a mask the library set, gets back the launch mask within
    /// the cpuset. Threads that existed before the first lease, and unseen threads on any other
    /// mask, are never touched.
    fn restore_unseen(
        &mut self,
        library_masks: &[SharedMask],
        kernel: &impl ThreadMasks,
        outcome: &mut ReleaseOutcome,
    ) {
        let before = std::mem::take(&mut self.tids_at_first_lease);
        let Some(natural) = self.unseen_natural.clone() else {
            return;
        };
        // A thread being born is not registered yet, but it is no unseen thread: it may have
        // moved itself onto the worker mask already, and registers believing so. Its tid is not
        // known until then, so while any birth is pending the sweep waits for a later release.
        if self.births_pending > 0 || !self.unseen_threads_exist(kernel) {
            return;
        }
        let mut known: Vec<Tid> = self.live_threads().map(|(_, e)| e.tid).collect();
        known.sort_unstable();
        for tid in kernel.thread_ids() {
            if known.binary_search(&tid).is_ok() || before.binary_search(&tid).is_ok() {
                continue;
            }
            let Ok(Some(actual)) = kernel.differs_from(tid, &natural) else {
                continue;
            };
            if library_masks.iter().any(|m| **m == actual) && kernel.set(tid, &natural).is_ok() {
                outcome.restored += 1;
            }
        }
    }

    /// Whether the process has threads the registry does not hold: counting first spares a
    /// process of thousands of threads listing them at every first lease and last release.
    fn unseen_threads_exist(&self, kernel: &impl ThreadMasks) -> bool {
        kernel.thread_count() > self.live_count()
    }

    /// The thread in `slot` is exiting; its later thread-specific-data destructors may still
    /// create threads. When such a thread would differ from one with an unknown creator (a host
    /// on the kernel's mask) — the exiting thread is a worker, or its scope is open — the entry
    /// stays and this answers false: call [`Self::thread_exited`] once those have run. Otherwise
    /// the thread is unregistered now and this answers true.
    pub fn thread_exiting(&mut self, slot: Slot) -> bool {
        let needs_its_entry = self
            .entry(slot)
            .is_some_and(|e| e.role == Role::Worker || e.scope.is_some());
        if !needs_its_entry {
            self.thread_exited(slot);
        }
        !needs_its_entry
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

    /// After `fork`: the child holds only the forking thread, with its role (SPEC §5).
    pub fn reset_after_fork(&mut self, keep: Option<Slot>, tid: Tid, handle: u64) {
        // The table still mapped is the parent's: nothing of the child's goes there.
        self.published = None;
        self.published_leases = None;
        // Children the parent's other threads were creating are born in the parent only.
        self.births_pending = 0;
        let kept = keep.and_then(|s| self.entry(s).cloned());
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if Some(i as Slot) != keep {
                *slot = None;
            }
        }
        let kept_slot = keep.filter(|_| kept.is_some());
        self.free = (0..self.slots.len() as Slot)
            .rev()
            .filter(|&s| Some(s) != kept_slot)
            .collect();
        let forked_by_worker = kept.as_ref().is_some_and(|e| e.role == Role::Worker);
        if let (Some(slot), Some(mut e)) = (kept_slot, kept) {
            e.tid = tid;
            e.handle = handle;
            e.creator = None;
            e.live_children = 0;
            // Its scope goes with the leases below.
            if !forked_by_worker {
                e.scope = None;
            }
            self.slots[slot as usize] = Some(e);
        }
        // The child's history starts with it: what it did, not what its parent did.
        self.workers_alive = usize::from(forked_by_worker && kept_slot.is_some());
        self.history = History {
            peak_workers: self.workers_alive,
            ..History::default()
        };
        // The parent's leases stay open in the child only when a worker forked: it may hold them
        // and release them there. Nothing in a child forked by a host thread can release them,
        // so they would keep every later lease of the child from ever restoring.
        if !forked_by_worker {
            self.leases.clear();
            if self.target.take().is_some() {
                self.epoch += 1;
            }
        }
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
