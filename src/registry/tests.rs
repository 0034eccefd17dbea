//! The registry rules against an in-memory stand-in for the kernel's per-thread masks. The real
//! kernel is exercised by the integration tests under `tests/`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::table::threadtable;

fn m(s: &str) -> CpuMask {
    CpuMask::parse_list(s).unwrap()
}

/// Per-thread masks with Linux's inheritance done by [`Fake::spawn`].
#[derive(Default)]
struct Fake {
    masks: RefCell<HashMap<Tid, CpuMask>>,
    sets: RefCell<usize>,
}

impl ThreadMasks for Fake {
    fn get(&self, tid: Tid) -> Result<CpuMask, i32> {
        self.masks.borrow().get(&tid).cloned().ok_or(libc::ESRCH)
    }
    fn set(&self, tid: Tid, mask: &CpuMask) -> Result<(), i32> {
        *self.sets.borrow_mut() += 1;
        self.masks
            .borrow_mut()
            .get_mut(&tid)
            .map(|slot| *slot = mask.clone())
            .ok_or(libc::ESRCH)
    }
    fn thread_ids(&self) -> Vec<Tid> {
        self.masks.borrow().keys().copied().collect()
    }
}

struct World {
    reg: Registry,
    kernel: Fake,
    next_tid: Tid,
}

impl World {
    /// A process whose main thread (tid 100) is on `mask`.
    fn new(mask: &str) -> (World, Slot) {
        let kernel = Fake::default();
        kernel.masks.borrow_mut().insert(100, m(mask));
        let mut reg = Registry::new();
        let main = reg.register_root(100, 1, Role::Host, m(mask));
        (
            World {
                reg,
                kernel,
                next_tid: 101,
            },
            main,
        )
    }

    fn spawn_with(&mut self, creator: Slot, worker_lib: bool, explicit: Option<&str>) -> Slot {
        let plan = self
            .reg
            .plan_child(Some(creator), worker_lib, explicit.map(m));
        self.born(creator, plan, explicit)
    }

    /// What the kernel and the trampoline do between the creator's plan and the registration:
    /// the kernel copies the creator's mask (or applies the attr mask), the child moves itself
    /// when the plan says so.
    fn born(&mut self, creator: Slot, mut plan: ChildPlan, explicit: Option<&str>) -> Slot {
        let tid = self.next_tid;
        self.next_tid += 1;
        // The kernel copies the creator's mask (or applies the attr mask).
        let creator_tid = self.reg.entry(creator).unwrap().tid;
        let inherited = match explicit {
            Some(e) => m(e),
            None => self.kernel.get(creator_tid).unwrap(),
        };
        self.kernel.masks.borrow_mut().insert(tid, inherited);
        if plan
            .move_at_birth()
            .is_some_and(|mask| self.kernel.set(tid, mask).is_ok())
        {
            plan.mark_moved();
        }
        self.reg
            .register_child(&plan, tid, tid as u64, &self.kernel)
    }

    fn spawn(&mut self, creator: Slot) -> Slot {
        self.spawn_with(creator, false, None)
    }

    fn exit(&mut self, slot: Slot) {
        let tid = self.reg.entry(slot).unwrap().tid;
        self.kernel.masks.borrow_mut().remove(&tid);
        self.reg.thread_exited(slot);
    }

    fn mask(&self, slot: Slot) -> String {
        let tid = self.reg.entry(slot).unwrap().tid;
        self.kernel.get(tid).unwrap().to_list()
    }

    fn role(&self, slot: Slot) -> Role {
        self.reg.entry(slot).unwrap().role
    }

    fn placement(&self, slot: Slot) -> Placement {
        self.reg.entry(slot).unwrap().placement
    }

    fn configure(&mut self, caller: Slot, device: &str, mask: &str) -> ConfigureOutcome {
        self.reg.open(
            LeaseKind::Configure,
            caller,
            device,
            None,
            Some(m(mask)),
            &self.kernel,
        )
    }

    fn release(&mut self, lease: i64) -> Result<ReleaseOutcome, UnknownLease> {
        self.reg.release(lease, &self.kernel)
    }

    fn begin_scope(&mut self, caller: Slot, device: &str, mask: &str) -> ConfigureOutcome {
        self.reg.open(
            LeaseKind::WorkerScope,
            caller,
            device,
            None,
            Some(m(mask)),
            &self.kernel,
        )
    }

    fn natural(&self, slot: Slot) -> String {
        self.reg.entry(slot).unwrap().natural.to_list()
    }

    /// The application's own `sched_setaffinity` on `slot`, as the hook observes it.
    fn set_by_hand(&mut self, slot: Slot, mask: &str) {
        self.set_from_outside(slot, mask);
        self.reg.observe_explicit(slot, m(mask));
    }

    /// `slot`'s mask changed behind the library's back (`taskset -p` from outside): invisible
    /// until the library looks.
    fn set_from_outside(&mut self, slot: Slot, mask: &str) {
        let tid = self.reg.entry(slot).unwrap().tid;
        self.kernel.set(tid, &m(mask)).unwrap();
    }
}

impl World {
    /// A process whose main thread (tid 100) is on 0-3, and a thread it started (tid 101).
    fn with_worker() -> (World, Slot, Slot) {
        let (mut w, main) = World::new("0-3");
        let worker = w.spawn(main);
        (w, main, worker)
    }

    /// [`World::with_worker`], the second thread configured for gpu0 on 2-3: the lease.
    fn configured() -> (World, Slot, Slot, i64) {
        let (mut w, main, worker) = World::with_worker();
        let lease = w.configure(worker, "gpu0", "2-3").lease;
        (w, main, worker, lease)
    }

    /// A process whose main thread (tid 100, on 0-3) opened a worker scope for gpu0 on 2-3: the
    /// lease.
    fn scoped() -> (World, Slot, i64) {
        let (mut w, main) = World::new("0-3");
        let lease = w.begin_scope(main, "gpu0", "2-3").lease;
        (w, main, lease)
    }

    /// A thread the registry has not seen, `tid` on `mask` in the kernel.
    fn insert(&self, tid: Tid, mask: &str) {
        self.kernel.masks.borrow_mut().insert(tid, m(mask));
    }

    /// How many `sched_setaffinity` calls the kernel has seen.
    fn sets(&self) -> usize {
        *self.kernel.sets.borrow()
    }

    /// How many registry slots hold an entry (live threads and tombstones).
    fn slots_in_use(&self) -> usize {
        self.reg.slots.iter().filter(|s| s.is_some()).count()
    }

    /// The kernel mask and the placement of `slot`.
    fn placed(&self, slot: Slot) -> (String, Placement) {
        (self.mask(slot), self.placement(slot))
    }

    /// The role and the kernel mask of `slot`.
    fn role_and_mask(&self, slot: Slot) -> (Role, String) {
        (self.role(slot), self.mask(slot))
    }

    /// The role, the placement and the kernel mask of `slot`, for one assertion on all three.
    fn state(&self, slot: Slot) -> (Role, Placement, String) {
        (self.role(slot), self.placement(slot), self.mask(slot))
    }
}

/// The mask a planned child moves itself onto at birth, if any.
fn moves_to(plan: &ChildPlan) -> Option<String> {
    plan.move_at_birth().map(|m| m.to_list())
}

#[test]
fn host_threads_keep_their_mask_through_configure_and_release() {
    let (mut w, main) = World::new("0-3");
    let host_a = w.spawn(main);
    let worker = w.spawn(main);
    let lease = w.configure(worker, "gpu0", "2-3").lease;
    assert_eq!(w.mask(main), "0-3");
    assert_eq!(w.mask(host_a), "0-3");
    assert_eq!(w.mask(worker), "2-3");
    // A host thread born during the lease is still a host thread on the host mask.
    let host_b = w.spawn(host_a);
    assert_eq!(w.role_and_mask(host_b), (Role::Host, "0-3".into()));
    w.release(lease).unwrap();
    assert_eq!(w.mask(worker), "0-3");
    assert_eq!(w.mask(host_a), "0-3");
}

#[test]
fn workers_children_inherit_the_worker_mask_with_no_syscall() {
    let (mut w, _, worker, _) = World::configured();
    let sets = w.sets();
    let child = w.spawn(worker);
    let grandchild = w.spawn(child);
    assert_eq!(w.sets(), sets, "inherited path made a syscall");
    for t in [child, grandchild] {
        assert_eq!(w.role(t), Role::Worker);
        assert_eq!(w.placement(t), Placement::Worker);
        assert_eq!(w.mask(t), "2-3");
        assert_eq!(w.reg.entry(t).unwrap().natural.to_list(), "0-3");
    }
}

#[test]
fn a_worker_lib_thread_made_by_a_host_is_a_worker_on_the_worker_mask() {
    let (mut w, main, _, _) = World::configured();
    let progress = w.spawn_with(main, true, None);
    assert_eq!(w.role(progress), Role::Worker);
    assert_eq!(w.mask(progress), "2-3");
}

#[test]
fn worker_lib_threads_made_before_configure_are_swept_in() {
    let (mut w, main) = World::new("0-3");
    let progress = w.spawn_with(main, true, None);
    assert_eq!(w.mask(progress), "0-3");
    w.configure(main, "gpu0", "1");
    assert_eq!(w.mask(progress), "1");
}

#[test]
fn a_second_configure_keeps_everything_pinned() {
    let (mut w, _, worker) = World::with_worker();
    let six: Vec<Slot> = (0..6).map(|_| w.spawn(worker)).collect();
    let first = w.configure(worker, "gpu0", "2-3");
    assert_eq!((first.on_mask, first.workers), (7, 7));
    let between = w.spawn(worker);
    let second = w.configure(worker, "gpu0", "2-3");
    assert!(second.unchanged);
    assert_eq!(second.retargeted_from, None);
    for t in six.iter().chain([&worker, &between]) {
        assert_eq!(w.mask(*t), "2-3");
    }
    let after = w.spawn(worker);
    assert_eq!(w.mask(after), "2-3");
}

#[test]
fn configure_for_another_device_retargets() {
    let (mut w, _, worker) = World::with_worker();
    let child = w.spawn(worker);
    w.configure(worker, "gpu0", "2-3");
    let out = w.configure(worker, "gpu1", "0-1");
    assert_eq!(out.retargeted_from.as_deref(), Some("gpu0"));
    assert_eq!(w.mask(worker), "0-1");
    assert_eq!(w.mask(child), "0-1");
}

#[test]
fn only_the_last_release_restores_and_release_is_idempotent() {
    let (mut w, _, worker) = World::with_worker();
    let a = w.configure(worker, "gpu0", "2-3").lease;
    let b = w.configure(worker, "gpu0", "2-3").lease;
    let first = w.release(a).unwrap();
    assert!(!first.last);
    assert_eq!(w.mask(worker), "2-3");
    assert!(w.release(a).is_err());
    let last = w.release(b).unwrap();
    assert_eq!((last.last, last.restored, last.preserved), (true, 1, 0));
    assert_eq!(w.mask(worker), "0-3");
    assert!(w.release(b).is_err());
}

#[test]
fn masks_changed_behind_the_librarys_back_are_preserved_and_counted() {
    let (mut w, _, worker) = World::with_worker();
    let moved = w.spawn(worker);
    let observed = w.spawn(worker);
    let lease = w.configure(worker, "gpu0", "2-3").lease;
    // `taskset -p` from outside: invisible until the library looks.
    w.set_from_outside(moved, "3");
    // The application's own call, observed by the hook.
    w.set_by_hand(observed, "1");
    let out = w.release(lease).unwrap();
    assert_eq!((out.restored, out.preserved), (1, 1));
    assert_eq!(w.mask(moved), "3");
    assert_eq!(w.placement(moved), Placement::External);
    assert_eq!(w.mask(observed), "1");
    assert_eq!(w.mask(worker), "0-3");
}

#[test]
fn threads_born_after_the_last_release_get_restored_masks() {
    let (mut w, _, worker, lease) = World::configured();
    w.release(lease).unwrap();
    let later = w.spawn(worker);
    assert_eq!(w.mask(later), "0-3");
    assert_eq!(w.placement(later), Placement::Inherited);
}

#[test]
fn configure_promotes_only_descendants_still_on_their_birth_mask() {
    let (mut w, main, worker) = World::with_worker();
    let kept = w.spawn(worker);
    let grandchild = w.spawn(kept);
    let repinned = w.spawn(worker);
    w.set_from_outside(repinned, "0");
    let sibling = w.spawn(main);
    w.configure(worker, "gpu0", "2-3");
    assert_eq!(w.role(kept), Role::Worker);
    assert_eq!(w.role(grandchild), Role::Worker);
    assert_eq!(w.mask(grandchild), "2-3");
    assert_eq!(w.role(repinned), Role::Host);
    assert_eq!(w.mask(repinned), "0");
    assert_eq!(w.role(sibling), Role::Host);
}

#[test]
fn a_grandchild_stays_a_descendant_after_its_parent_exits() {
    let (mut w, _, worker) = World::with_worker();
    let parent = w.spawn(worker);
    let grandchild = w.spawn(parent);
    w.exit(parent);
    w.configure(worker, "gpu0", "2-3");
    assert_eq!(w.role(grandchild), Role::Worker);
    w.exit(grandchild);
    w.exit(worker);
    // The tombstone went with its last child: only the main thread is left.
    assert_eq!(w.reg.live_count(), 1);
    assert_eq!(w.slots_in_use(), 1);
}

/// Threads that start their successor and exit, one alive at a time: the registry holds a
/// bounded number of entries however long the chain, and the last of it is still a descendant
/// of the thread that started it.
#[test]
fn a_chain_of_successors_keeps_a_bounded_registry() {
    let (mut w, main) = World::new("0-3");
    let head = w.spawn(main);
    let mut current = w.spawn(head);
    for _ in 0..1000 {
        let next = w.spawn(current);
        w.exit(current);
        current = next;
        assert!(w.slots_in_use() <= 4);
    }
    w.configure(head, "gpu0", "2-3");
    assert_eq!(w.role(current), Role::Worker, "still the head's descendant");
    assert_eq!(w.mask(current), "2-3");
}

/// An exited thread's tombstone goes as soon as its children are gone, also when a child is
/// itself an exited thread with a live child of its own.
#[test]
fn an_exit_under_a_tombstone_frees_the_tombstone() {
    let (mut w, main) = World::new("0-3");
    let a = w.spawn(main);
    let b = w.spawn(a);
    let c = w.spawn(b);
    w.exit(a);
    w.exit(b);
    // b relinked past a: a is gone, b stays for c.
    assert_eq!(w.slots_in_use(), 3);
    w.configure(main, "gpu0", "2-3");
    assert_eq!(
        w.role(c),
        Role::Worker,
        "a descendant of main through two exits"
    );
    w.exit(c);
    assert_eq!(w.slots_in_use(), 1);
}

#[test]
fn explicit_attr_masks_are_never_overridden_nor_restored() {
    let (mut w, _, worker, lease) = World::configured();
    let pinned = w.spawn_with(worker, false, Some("0"));
    assert_eq!(w.placement(pinned), Placement::Explicit);
    assert_eq!(w.mask(pinned), "0");
    // Its children inherit the application's choice.
    let child = w.spawn(pinned);
    assert_eq!(w.mask(child), "0");
    w.release(lease).unwrap();
    assert_eq!(w.mask(pinned), "0");
}

#[test]
fn children_of_a_step_thread_are_born_on_the_worker_mask() {
    let (mut w, _, worker, _) = World::configured();
    let step = w.spawn(worker);
    w.reg.pin(step, m("2"), Placement::Step, &w.kernel).unwrap();
    let pool = w.spawn(step);
    assert_eq!(w.mask(pool), "2-3");
    assert_eq!(w.placement(pool), Placement::Worker);
}

#[test]
fn a_thread_born_across_a_retarget_takes_the_new_mask() {
    let (mut w, _, worker, _) = World::configured();
    // The creator decides, then configure retargets before the child registers.
    let plan = w.reg.plan_child(Some(worker), false, None);
    w.insert(500, "2-3");
    w.configure(worker, "gpu1", "0-1");
    let child = w.reg.register_child(&plan, 500, 500, &w.kernel);
    assert_eq!(w.mask(child), "0-1");
}

#[test]
fn a_failed_create_leaves_nothing_behind() {
    let (mut w, _, worker) = World::with_worker();
    let plan = w.reg.plan_child(Some(worker), false, None);
    w.reg.cancel_child(plan);
    w.exit(worker);
    assert_eq!(w.slots_in_use(), 1);
}

#[test]
fn fork_keeps_only_the_forking_thread_with_its_role() {
    let (mut w, _, worker) = World::with_worker();
    w.spawn(worker);
    w.configure(worker, "gpu0", "2-3");
    w.reg.reset_after_fork(Some(worker), 900, 9);
    assert_eq!(w.reg.live_count(), 1);
    let e = w.reg.entry(worker).unwrap();
    assert_eq!((e.tid, e.role), (900, Role::Worker));
    // Freed slots are reused.
    w.insert(900, "2-3");
    let child = w.spawn(worker);
    assert_ne!(child, worker);
}

#[test]
fn the_thread_table_follows_births_roles_placements_and_exits() {
    let words = table_words();
    let (mut w, main) = World::new("0-3");
    w.reg
        .publish_into(Some(Box::leak(Box::new(threadtable::Mapped::in_memory(
            words,
        )))));
    let worker = w.spawn(main);
    let record = |slot: Slot| &words[threadtable::HEADER_BYTES / 8 + slot as usize];
    let read = |slot: Slot| threadtable::decode(record(slot).load(Ordering::Relaxed));
    assert_eq!(read(worker), Some((101, Role::Host, Placement::Inherited)));
    w.configure(worker, "gpu0", "2-3");
    assert_eq!(read(worker), Some((101, Role::Worker, Placement::Worker)));
    assert_eq!(read(main), Some((100, Role::Host, Placement::Inherited)));
    w.exit(worker);
    assert_eq!(read(worker), None);
}

/// A whole table's words in plain memory.
fn table_words() -> &'static [AtomicU64] {
    Box::leak(
        (0..threadtable::FILE_BYTES / 8)
            .map(|_| AtomicU64::new(0))
            .collect(),
    )
}

/// The open leases as the table's lease words hold them (the header's word 7 is their length).
fn published_leases(table: &[AtomicU64]) -> String {
    let length = table[7].load(Ordering::Relaxed) as usize;
    let bytes: Vec<u8> = table[threadtable::LEASES_OFFSET / 8..]
        .iter()
        .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
        .take(length)
        .collect();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn the_thread_table_shows_the_open_leases_and_a_fork_child_leaves_its_parents_alone() {
    let words = table_words();
    let (mut w, main) = World::new("0-3");
    let worker = w.spawn(main);
    let first = w.reg.open(
        LeaseKind::Configure,
        worker,
        "0000:86:00.0",
        Some(1),
        Some(m("2-3")),
        &w.kernel,
    );
    // Leases opened before the table arrives are published with it.
    w.reg
        .publish_into(Some(Box::leak(Box::new(threadtable::Mapped::in_memory(
            words,
        )))));
    assert_eq!(published_leases(words), "1 1 0000:86:00.0\n");
    let second = w.configure(worker, "TLLM_AFFINITY_CPUS=2-3", "2-3");
    assert_eq!(
        published_leases(words),
        "1 1 0000:86:00.0\n2 - TLLM_AFFINITY_CPUS=2-3\n"
    );
    w.release(first.lease).unwrap();
    assert_eq!(published_leases(words), "2 - TLLM_AFFINITY_CPUS=2-3\n");
    // A child forked by a host thread drops the leases, in its own registry only.
    w.reg.reset_after_fork(Some(main), 900, 9);
    assert!(w.reg.leases().is_empty());
    assert_eq!(published_leases(words), "2 - TLLM_AFFINITY_CPUS=2-3\n");
    assert_eq!(second.lease, 2);
}

#[test]
fn a_host_made_worker_moves_itself_once_before_it_registers() {
    let (mut w, main, worker, _) = World::configured();
    let plan = w.reg.plan_child(Some(main), true, None);
    assert_eq!(moves_to(&plan).as_deref(), Some("2-3"));
    let sets = w.sets();
    let progress = w.born(main, plan, None);
    assert_eq!(w.sets(), sets + 1, "one move, none under the lock");
    assert_eq!(w.placed(progress), ("2-3".into(), Placement::Worker));
    assert_eq!(w.reg.entry(progress).unwrap().natural.to_list(), "0-3");
    // Inheritance needs no move: a worker's child has no birth move.
    assert!(w
        .reg
        .plan_child(Some(worker), false, None)
        .move_at_birth()
        .is_none());
}

/// A host starts a worker-library thread while a lease is open; the thread moves itself onto the
/// worker mask, then `change` runs before it registers.
fn moved_then(w: &mut World, creator: Slot, change: impl FnOnce(&mut World)) -> Slot {
    let mut plan = w.reg.plan_child(Some(creator), true, None);
    let tid = w.next_tid;
    w.next_tid += 1;
    let mask = plan.move_at_birth().unwrap().clone();
    w.kernel.masks.borrow_mut().insert(tid, mask);
    plan.mark_moved();
    change(w);
    w.reg.register_child(&plan, tid, tid as u64, &w.kernel)
}

#[test]
fn a_child_that_moved_across_a_release_is_born_as_if_after_it() {
    let (mut w, main, _, lease) = World::configured();
    let child = moved_then(&mut w, main, |w| {
        w.release(lease).unwrap();
    });
    assert_eq!(w.placed(child), ("0-3".into(), Placement::Inherited));
}

#[test]
fn a_child_that_moved_across_a_retarget_takes_the_new_mask() {
    let (mut w, main, worker, _) = World::configured();
    let child = moved_then(&mut w, main, |w| {
        w.configure(worker, "gpu1", "0-1");
    });
    assert_eq!(w.placed(child), ("0-1".into(), Placement::Worker));
}

// ---- Worker scopes (SPEC §2, §7) ----------------------------------------------------------

#[test]
fn scope_children_are_workers_on_the_target_while_the_caller_stays_host() {
    let (mut w, main) = World::new("0-3");
    let out = w.begin_scope(main, "gpu0", "2-3");
    assert!(out.lease > 0);
    let child = w.spawn(main);
    assert_eq!(
        w.state(main),
        (Role::Host, Placement::Inherited, "0-3".into())
    );
    assert_eq!(
        w.state(child),
        (Role::Worker, Placement::Worker, "2-3".into())
    );
    assert_eq!(w.natural(child), "0-3");
}

#[test]
fn a_child_created_after_end_scope_is_a_host_on_the_callers_mask() {
    let (mut w, main, lease) = World::scoped();
    let inside = w.spawn(main);
    assert_eq!(w.reg.end_scope(lease), Ok(100));
    let after = w.spawn(main);
    assert_eq!(
        w.state(after),
        (Role::Host, Placement::Inherited, "0-3".into())
    );
    // The lease stays open: the scope's thread stays placed.
    assert_eq!(w.reg.leases().len(), 1);
    assert_eq!(w.role_and_mask(inside), (Role::Worker, "2-3".into()));
}

#[test]
fn grandchildren_of_a_scope_child_are_workers() {
    let (mut w, main, lease) = World::scoped();
    let child = w.spawn(main);
    let grandchild = w.spawn(child);
    w.reg.end_scope(lease).unwrap();
    let later = w.spawn(child);
    for t in [grandchild, later] {
        assert_eq!(w.state(t), (Role::Worker, Placement::Worker, "2-3".into()));
        assert_eq!(w.natural(t), "0-3");
    }
}

#[test]
fn release_restores_scope_children_to_the_callers_mask() {
    let (mut w, main, lease) = World::scoped();
    let child = w.spawn(main);
    let grandchild = w.spawn(child);
    w.reg.end_scope(lease).unwrap();
    let out = w.release(lease).unwrap();
    assert_eq!((out.last, out.restored, out.preserved), (true, 2, 0));
    for t in [main, child, grandchild] {
        assert_eq!(w.mask(t), "0-3");
    }
    assert_eq!(w.placement(child), Placement::Inherited);
}

#[test]
fn end_scope_of_an_unknown_lease_errs() {
    let (mut w, main) = World::new("0-3");
    assert_eq!(w.reg.end_scope(42), Err(UnknownLease));
    let worker = w.spawn(main);
    let plain = w.configure(worker, "gpu0", "2-3").lease;
    assert_eq!(w.reg.end_scope(plain), Err(UnknownLease), "not a scope");
    let scope = w.begin_scope(main, "gpu0", "2-3").lease;
    assert!(w.reg.end_scope(scope).is_ok());
    assert_eq!(w.reg.end_scope(scope), Err(UnknownLease), "ended already");
}

#[test]
fn release_of_a_scope_lease_ends_the_scope() {
    let (mut w, main, lease) = World::scoped();
    w.release(lease).unwrap();
    assert_eq!(w.reg.entry(main).unwrap().scope, None);
    assert_eq!(w.reg.end_scope(lease), Err(UnknownLease));
    // Never ended, yet over: the caller's new threads are born as before.
    let after = w.spawn(main);
    assert_eq!(w.role_and_mask(after), (Role::Host, "0-3".into()));
}

#[test]
fn a_repeated_configure_for_the_same_device_in_a_scope_is_unchanged() {
    let (mut w, main, _) = World::scoped();
    let engine = w.spawn(main);
    let sets = w.sets();
    let out = w.configure(engine, "gpu0", "2-3");
    assert!(out.unchanged);
    assert_eq!(out.retargeted_from, None);
    assert_eq!((out.on_mask, out.workers), (1, 1));
    assert_eq!(w.sets(), sets, "nothing to move");
    assert_eq!(w.mask(engine), "2-3");
    assert_eq!(w.role(main), Role::Host);
}

#[test]
fn an_explicit_attr_mask_in_a_scope_stays_explicit() {
    let (mut w, main, lease) = World::scoped();
    let pinned = w.spawn_with(main, false, Some("0"));
    assert_eq!(w.placed(pinned), ("0".into(), Placement::Explicit));
    w.release(lease).unwrap();
    assert_eq!(w.mask(pinned), "0");
}

#[test]
fn a_scope_on_an_explicit_creator_yields_workers_whose_natural_is_the_creators_mask() {
    let (mut w, main) = World::new("0-3");
    let server = w.spawn(main);
    w.set_by_hand(server, "0-1");
    let lease = w.begin_scope(server, "gpu0", "2-3").lease;
    let child = w.spawn(server);
    assert_eq!(
        w.state(child),
        (Role::Worker, Placement::Worker, "2-3".into())
    );
    assert_eq!(w.natural(child), "0-1");
    assert_eq!(
        w.state(server),
        (Role::Host, Placement::Explicit, "0-1".into())
    );
    w.release(lease).unwrap();
    assert_eq!(w.mask(child), "0-1");
    assert_eq!(w.mask(server), "0-1");
}

#[test]
fn a_scope_places_existing_workers_and_promotes_no_descendant() {
    let (mut w, main) = World::new("0-3");
    let host = w.spawn(main);
    let progress = w.spawn_with(main, true, None);
    let out = w.begin_scope(main, "gpu0", "2-3");
    assert_eq!((out.on_mask, out.workers), (1, 1));
    assert_eq!(w.role_and_mask(host), (Role::Host, "0-3".into()));
    assert_eq!(w.mask(progress), "2-3");
}

#[test]
fn a_scope_goes_with_its_thread_and_its_lease_stays_open() {
    let (mut w, main) = World::new("0-3");
    let server = w.spawn(main);
    let lease = w.begin_scope(server, "gpu0", "2-3").lease;
    let child = w.spawn(server);
    w.exit(server);
    assert_eq!(w.reg.end_scope(lease), Err(UnknownLease));
    assert_eq!(w.mask(child), "2-3");
    assert!(w.release(lease).unwrap().last);
    assert_eq!(w.mask(child), "0-3");
}

#[test]
fn a_nested_scope_leaves_the_outer_one_open() {
    let (mut w, main) = World::new("0-3");
    let outer = w.begin_scope(main, "gpu0", "2-3").lease;
    let inner = w.begin_scope(main, "gpu0", "2-3").lease;
    assert_eq!(w.reg.end_scope(inner), Err(UnknownLease));
    let still_inside = w.spawn(main);
    assert_eq!(w.role(still_inside), Role::Worker);
    w.reg.end_scope(outer).unwrap();
    let after = w.spawn(main);
    assert_eq!(w.role(after), Role::Host);
}

#[test]
fn a_fork_by_a_host_drops_its_scope_with_the_leases() {
    let (mut w, main, _) = World::scoped();
    w.reg.reset_after_fork(Some(main), 900, 9);
    assert!(w.reg.leases().is_empty());
    assert_eq!(w.reg.entry(main).unwrap().scope, None);
    w.insert(900, "0-3");
    let child = w.spawn(main);
    assert_eq!(w.role_and_mask(child), (Role::Host, "0-3".into()));
}

#[test]
fn a_scope_child_that_moved_across_the_release_is_born_as_if_after_it() {
    let (mut w, main, lease) = World::scoped();
    let mut plan = w.reg.plan_child(Some(main), false, None);
    assert_eq!(moves_to(&plan).as_deref(), Some("2-3"));
    w.insert(500, "2-3");
    plan.mark_moved();
    w.release(lease).unwrap();
    let child = w.reg.register_child(&plan, 500, 500, &w.kernel);
    assert_eq!(w.placed(child), ("0-3".into(), Placement::Inherited));
}

#[test]
fn a_scope_child_of_an_explicit_creator_is_the_workers_even_with_no_worker_mask() {
    let (mut w, main) = World::new("0-3");
    let server = w.spawn(main);
    w.set_by_hand(server, "0-1");
    // The policy keeps masks: the scope opens a lease with no target.
    w.reg.open(
        LeaseKind::WorkerScope,
        server,
        "gpu0",
        None,
        None,
        &w.kernel,
    );
    let child = w.spawn(server);
    assert_eq!(
        w.state(child),
        (Role::Worker, Placement::Inherited, "0-1".into())
    );
    // Not the creator's choice: a later configure places it.
    let engine = w.spawn(main);
    w.configure(engine, "gpu0", "2-3");
    assert_eq!(w.mask(child), "2-3");
    assert_eq!(w.natural(child), "0-1");
}

#[test]
fn the_history_outlives_the_last_release_and_the_workers() {
    let (mut w, _, worker, lease) = World::configured();
    let pool: Vec<Slot> = (0..3).map(|_| w.spawn(worker)).collect();
    let second = w.configure(worker, "gpu0", "2-3").lease;
    w.release(second).unwrap();
    for t in pool {
        w.exit(t);
    }
    w.release(lease).unwrap();
    w.exit(worker);
    let history = w.reg.history();
    assert_eq!(
        history,
        History {
            peak_workers: 4,
            leases_opened: 2,
            leases_released: 2,
            threads_restored: 1,
            threads_preserved: 0,
            threads_created: history.threads_created,
        }
    );
    assert!(history.threads_created > 0);
    // Nothing is left alive that says so: only the history does.
    assert!(w.reg.live_threads().all(|(_, e)| e.role == Role::Host));
}

/// A thread the library never saw, born from a worker during a lease (glibc's timer helper): at
/// the last release it gets the launch mask within the cpuset; unseen threads from before the
/// lease, or on a mask the library never set, keep theirs.
#[test]
fn unseen_threads_born_on_a_library_mask_get_the_launch_mask_back() {
    let (mut w, main) = World::new("0-3");
    w.reg.set_unseen_natural(m("0-3"));
    w.insert(900, "0-3");
    let worker = w.spawn(main);
    let lease = w.configure(worker, "gpu0", "2-3").lease;
    // Born by clone from the worker (the library sees no pthread_create) and from the host.
    w.insert(901, "2-3");
    w.insert(902, "1");
    // An unseen thread from before the lease, moved onto the worker CPUs by hand.
    w.kernel.set(900, &m("2-3")).unwrap();
    let outcome = w.release(lease).unwrap();
    let mask = |tid| w.kernel.get(tid).unwrap().to_list();
    assert_eq!(mask(901), "0-3", "born on the worker mask: restored");
    assert_eq!(mask(902), "1", "on a mask the library never set: kept");
    assert_eq!(mask(900), "2-3", "there before the lease: never touched");
    assert_eq!(outcome.restored, 2, "the worker and the unseen helper");
}

/// An exiting host is unregistered at once; an exiting worker stays until its later
/// thread-specific-data destructors have run, so a thread they create is still its child.
#[test]
fn an_exiting_worker_stays_for_its_destructors_and_a_host_goes_at_once() {
    let (mut w, main) = World::new("0-3");
    let host = w.spawn(main);
    let worker = w.spawn(main);
    w.configure(worker, "gpu0", "2-3");
    assert!(w.reg.thread_exiting(host));
    assert!(w.reg.entry(host).is_none());
    assert!(!w.reg.thread_exiting(worker));
    let late = w.spawn(worker);
    assert_eq!(w.role_and_mask(late), (Role::Worker, "2-3".into()));
    w.reg.thread_exited(worker);
    assert!(w.reg.entry(worker).is_none());
}

/// A thread being born — it moved itself onto the worker mask, and has not registered yet — is
/// no unseen thread: a last release then leaves it alone, so that, registering under the next
/// lease, the registry's belief and the kernel's mask agree (found by the stress test).
#[test]
fn a_thread_being_born_across_a_release_and_a_configure_is_not_taken_for_an_unseen_one() {
    let (mut w, main) = World::new("0-3");
    w.reg.set_unseen_natural(m("0-3"));
    let worker = w.spawn(main);
    let lease = w.configure(worker, "gpu0", "2-3").lease;
    let child = moved_then(&mut w, main, |w| {
        w.release(lease).unwrap();
        w.configure(worker, "gpu0", "2-3");
    });
    let current = w.reg.entry(child).unwrap().current.to_list();
    assert_eq!(
        w.mask(child),
        current,
        "the kernel's mask is the one the registry believes"
    );
    assert_eq!(
        (current.as_str(), w.placement(child)),
        ("2-3", Placement::Worker)
    );
}

/// The fast births (`Registry::continues_creator`) decide what the general rule decides: a child
/// of each kind of creator, plain and with its routine in a worker library, comes out the same
/// in a world that has the general rule only.
#[test]
fn fast_births_decide_as_the_general_rule() {
    type Creator = fn(&mut World, Slot) -> Slot;
    fn worker(w: &mut World, main: Slot) -> Slot {
        let worker = w.spawn(main);
        w.configure(worker, "gpu0", "2-3");
        worker
    }
    let creators: [(&str, Creator); 9] = [
        ("a host, no lease", |_, main| main),
        ("a host under a lease", |w, main| {
            worker(w, main);
            main
        }),
        ("a worker under a lease", worker),
        ("a worker after the last release", |w, main| {
            let worker = w.spawn(main);
            let lease = w.configure(worker, "gpu0", "2-3").lease;
            w.release(lease).unwrap();
            worker
        }),
        ("a worker whose mask the program set", |w, main| {
            let worker = worker(w, main);
            w.set_by_hand(worker, "1");
            worker
        }),
        ("a host whose mask the program set", |w, main| {
            w.set_by_hand(main, "1");
            main
        }),
        ("a step thread", |w, main| {
            let worker = worker(w, main);
            let step = w.spawn(worker);
            w.reg.pin(step, m("2"), Placement::Step, &w.kernel).unwrap();
            step
        }),
        ("a host with a worker scope open", |w, main| {
            w.begin_scope(main, "gpu0", "2-3");
            main
        }),
        ("a worker retargeted to another device", |w, main| {
            let worker = worker(w, main);
            w.configure(worker, "gpu1", "0-1");
            worker
        }),
    ];
    for (name, make_creator) in creators {
        for worker_lib in [false, true] {
            let child = |general_births_only| {
                let (mut w, main) = World::new("0-3");
                w.reg.general_births_only = general_births_only;
                let creator = make_creator(&mut w, main);
                let child = w.spawn_with(creator, worker_lib, None);
                let e = w.reg.entry(child).unwrap();
                let born = e.born.to_list();
                (
                    w.role(child),
                    w.placement(child),
                    w.mask(child),
                    w.natural(child),
                    born,
                )
            };
            assert_eq!(
                child(false),
                child(true),
                "{name}, worker library: {worker_lib}"
            );
        }
    }
}

/// Whatever order the threads of a small tree exit in, the fast exit leaves the registry as the
/// general rule (relink past exited creators, then reap) does, after every exit: the same
/// entries, links and child counts, and the same slots free.
#[test]
fn fast_exits_free_as_the_general_rule() {
    // main - a - b - c, a - d, main - e: a chain, a sibling under a tombstone-to-be, a leaf.
    fn orders(items: Vec<usize>) -> Vec<Vec<usize>> {
        if items.len() <= 1 {
            return vec![items];
        }
        let mut all = Vec::new();
        for (i, &first) in items.iter().enumerate() {
            let mut rest = items.clone();
            rest.remove(i);
            for mut tail in orders(rest) {
                tail.insert(0, first);
                all.push(tail);
            }
        }
        all
    }
    /// Each slot's entry (tid, alive, live children, creator), and the free slots.
    type State = (Vec<Option<(Tid, bool, u32, Option<Slot>)>>, Vec<Slot>);
    fn state(w: &World) -> State {
        let entries = w
            .reg
            .slots
            .iter()
            .map(|s| {
                s.as_ref()
                    .map(|e| (e.tid, e.alive, e.live_children, e.creator))
            })
            .collect();
        let mut free = w.reg.free.clone();
        free.sort_unstable();
        (entries, free)
    }
    for order in orders((0..5).collect()) {
        let run = |general_exits_only| {
            let (mut w, main) = World::new("0-3");
            w.reg.general_exits_only = general_exits_only;
            let a = w.spawn(main);
            let b = w.spawn(a);
            let c = w.spawn(b);
            let d = w.spawn(a);
            let e = w.spawn(main);
            let threads = [a, b, c, d, e];
            let mut states = Vec::new();
            for &i in &order {
                w.exit(threads[i]);
                states.push(state(&w));
            }
            states
        };
        assert_eq!(run(false), run(true), "exit order {order:?}");
    }
}

/// A child planned by `creator`, cloned (the kernel copies the creator's mask) and registered,
/// with `before_clone` run between the plan and the clone and `after_clone` between the clone
/// and the registration: the interleavings of a change to the creator's mask with its child's
/// birth.
fn born_around(
    w: &mut World,
    creator: Slot,
    before_clone: impl FnOnce(&mut World),
    after_clone: impl FnOnce(&mut World),
) -> Slot {
    let plan = w.reg.plan_child(Some(creator), false, None);
    before_clone(w);
    let tid = w.next_tid;
    w.next_tid += 1;
    let creator_tid = w.reg.entry(creator).unwrap().tid;
    let at_clone = w.kernel.get(creator_tid).unwrap();
    w.kernel.masks.borrow_mut().insert(tid, at_clone);
    after_clone(w);
    w.reg.register_child(&plan, tid, tid as u64, &w.kernel)
}

/// A worker that sets its own mask right after creating a thread does not take the thread with
/// it: the kernel gave the child the worker mask at clone, before the set, so the child is the
/// library's worker, put back at the last release, however late it registers.
#[test]
fn a_creators_own_mask_set_after_the_clone_does_not_pass_to_a_child_registering_later() {
    let (mut w, main) = World::new("0-3");
    let worker = w.spawn(main);
    let lease = w.configure(worker, "gpu0", "2-3").lease;
    let child = born_around(&mut w, worker, |_| {}, |w| w.set_by_hand(worker, "1"));
    assert_eq!(
        w.state(child),
        (Role::Worker, Placement::Worker, "2-3".into())
    );
    assert_eq!(w.natural(child), "0-3");
    assert_eq!(w.placement(worker), Placement::Explicit);
    w.release(lease).unwrap();
    assert_eq!(
        w.mask(child),
        "0-3",
        "the child is put back at the last release"
    );
    assert_eq!(w.mask(worker), "1", "the worker's own choice stays");
}

/// The same, as the preloaded shim reports a program's own set: the placement at once
/// (`mark_explicit`), the mask only at the next operation.
#[test]
fn a_creators_own_mask_marked_after_the_clone_does_not_pass_to_a_child_registering_later() {
    let (mut w, main) = World::new("0-3");
    let worker = w.spawn(main);
    let lease = w.configure(worker, "gpu0", "2-3").lease;
    let child = born_around(
        &mut w,
        worker,
        |_| {},
        |w| {
            let tid = w.reg.entry(worker).unwrap().tid;
            w.kernel.set(tid, &m("1")).unwrap();
            w.reg.mark_explicit(tid);
        },
    );
    assert_eq!(
        w.state(child),
        (Role::Worker, Placement::Worker, "2-3".into())
    );
    assert_eq!(w.natural(child), "0-3");
    w.release(lease).unwrap();
    assert_eq!(
        w.mask(child),
        "0-3",
        "the child is put back at the last release"
    );
}

/// The other interleaving: a configure on another thread moves the creator between its plan and
/// the clone, so the child is born on the creator's new mask, and is promoted with it.
#[test]
fn a_creator_moved_by_a_configure_before_the_clone_passes_its_new_mask_to_the_child() {
    let (mut w, main) = World::new("0-3");
    let host = w.spawn(main);
    let child = born_around(
        &mut w,
        host,
        |w| {
            w.configure(main, "gpu0", "2-3");
        },
        |_| {},
    );
    assert_eq!(
        w.state(child),
        (Role::Worker, Placement::Worker, "2-3".into())
    );
    assert_eq!(w.natural(child), "0-3");
}
