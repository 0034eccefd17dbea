//! Births: the creator's plan for a new thread, the birth rule, and the child's registration.

use std::sync::Arc;

use super::{
    BirthMove, ChildPlan, CreatorAtPlan, Placement, Registry, Role, SharedMask, Slot, ThreadEntry,
    ThreadMasks, Tid,
};
use crate::mask::CpuMask;

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

impl Registry {
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
}
