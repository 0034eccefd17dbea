//! Leases: `configure` and worker scopes open them and place workers; the last release restores.

use std::sync::Arc;

use super::{
    ConfigureOutcome, LeaseInfo, LeaseKind, LeaseSlice, Placement, Registry, ReleaseOutcome, Role,
    SharedMask, Slot, Target, ThreadMasks, Tid, UnknownLease,
};
use crate::mask::CpuMask;

impl Registry {
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
            slice: None,
            slice_step_core: None,
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

    /// Records the GPU slice `lease` was opened on (SPEC §18), for the report and the table.
    pub fn describe_slice(&mut self, lease: i64, slice: &LeaseSlice) {
        if let Some(info) = self.leases.iter_mut().find(|l| l.id == lease) {
            info.slice = Some(slice.cpus.to_list());
            info.slice_step_core = slice.step_core.as_ref().map(CpuMask::to_list);
        }
        self.publish_leases();
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

    /// Sets the mask an unseen thread born on a library mask gets back at the last release.
    pub fn set_unseen_natural(&mut self, mask: CpuMask) {
        self.unseen_natural = (!mask.is_empty()).then(|| Arc::new(mask));
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
}
