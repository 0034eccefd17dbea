//! The registry of a fork child: the forking thread alone, with its role.

use super::{History, Registry, Role, Slot, Tid};

impl Registry {
    /// After `fork`: the child holds only the forking thread, with its role (SPEC §5).
    pub fn reset_after_fork(&mut self, keep: Option<Slot>, tid: Tid, handle: u64) {
        // The table still mapped is the parent's: nothing of the child's goes there.
        self.published = None;
        self.published_records = &[];
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
}
