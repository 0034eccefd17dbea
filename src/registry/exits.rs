//! Exits: a thread unregistering, and the tombstones its children keep, freed once unneeded.

use super::{Registry, Role, Slot};

impl Registry {
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

    pub(super) fn drop_child_of(&mut self, creator: Slot) {
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
}
