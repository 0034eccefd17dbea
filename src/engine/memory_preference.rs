//! The worker scope's caller and its memory (SPEC §7): the caller keeps its host mask, so what
//! it allocates while the scope is open (the engine it builds for the workers) would land
//! wherever the scheduler runs it. It prefers the GPU's node (`MPOL_PREFERRED`) until the scope
//! ends, unless it already has a policy of its own (`numactl --membind`, `--preferred`), which is
//! left alone. A thread's memory policy can only be set by the thread itself: a scope ended on
//! another thread leaves the preference in place, and says so.
//!
//! A policy the library set is its thread's alone (SPEC §15): the threads it creates meanwhile
//! inherit it (the scope's point), but a process it starts does not. The kernel copies a thread's
//! policy into every `fork`, `vfork`, `clone` and `posix_spawn` child and keeps it across
//! `execve`, so the thread marks itself in its block ([`note_held`]) and the paths that start a process drop the
//! policy for the child: the fork child handler sets the default in the child, and the
//! interposed `posix_spawn` and exec functions drop it around the real call (the caller, or a
//! `vfork` child with its own policy copy, is the only task that runs meanwhile).

use crate::lock::EngineLock;
use crate::mask::CpuMask;
use crate::placement::policy;
use crate::registry::Tid;
use crate::{log_debug, log_info, per_thread, sys};

/// A preference the library gave: the scope's lease, the thread, the node.
pub(super) struct Preference {
    lease: i64,
    tid: Tid,
    node: usize,
}

/// The preferences given and not yet taken back.
pub(super) static PREFERRED: EngineLock<Vec<Preference>> = EngineLock::new(Vec::new());

/// Notes that this thread's policy is now `MPOL_PREFERRED` on `node`, set by the library: in the
/// thread's own block ([`per_thread`]), which a `vfork` child shares with its parent thread,
/// whose policy it inherited.
pub(super) fn note_held(node: usize) {
    per_thread::with(|me| me.preferred_node.set(node + 1));
}

/// Notes that this thread's policy is no longer one the library set.
pub(super) fn note_released() {
    per_thread::with(|me| me.preferred_node.set(0));
}

/// The node this thread prefers because the library set it: marked, and its policy still the
/// one the library set (the thread may have set one of its own since, which is then left alone
/// and forgotten; a policy that cannot be read is taken to be still ours). Allocation-free.
fn held() -> Option<usize> {
    let node = per_thread::with(|me| me.preferred_node.get().checked_sub(1))?;
    if sys::prefers_only(node) == Ok(false) {
        note_released();
        return None;
    }
    Some(node)
}

/// Runs `start`, a call that starts a process from this thread (`posix_spawn`, `system`,
/// `popen`, an exec in a `vfork` child or in this thread), with the library's preference dropped
/// if this thread holds one, so that the child starts with the default policy this thread had
/// before; the preference is given back when the call returns (the child runs, or an exec
/// failed), with `errno` as `start` left it. A thread that holds none pays a thread-local read;
/// one that does, three system calls. Safe in a `vfork` child, allocation-free.
pub(super) fn while_starting_a_child<R>(start: impl FnOnce() -> R) -> R {
    let Some(node) = held() else {
        return start();
    };
    let dropped = sys::set_memory_policy(None).is_ok();
    let returned = start();
    if dropped {
        let errno = sys::errno();
        let _ = sys::set_memory_policy(Some(node));
        sys::set_errno(errno);
    }
    returned
}

/// In a fork child, on the forking thread: a preference the library gave that thread is not the
/// child's. Its policy goes back to the default it had before.
pub(super) fn clear_in_fork_child() {
    if held().is_some() && sys::set_memory_policy(None).is_ok() {
        note_released();
    }
}

/// Called on the thread that opened the scope `lease`, whose workers get `worker_mask`.
pub(super) fn prefer_while_open(
    lease: i64,
    memory_nodes: &[(usize, CpuMask)],
    worker_mask: &CpuMask,
) {
    let Some(node) = policy::worker_memory_node(memory_nodes, worker_mask) else {
        return;
    };
    let tid = sys::gettid();
    match sys::memory_policy() {
        Ok((sys::MPOL_DEFAULT, _)) => {}
        Ok((mode, nodes)) => {
            log_info!(
                "worker scope on thread {tid}: its own memory policy (mode {mode}, nodes {nodes:?}) is left as it is"
            );
            return;
        }
        Err(errno) => {
            log_debug!("worker scope on thread {tid}: get_mempolicy failed (errno {errno}): memory policy left as it is");
            return;
        }
    }
    match sys::set_memory_policy(Some(node)) {
        Ok(()) => {
            log_info!(
                "worker scope on thread {tid}: what it allocates prefers NUMA node {node}, the workers' node, until the scope ends"
            );
            note_held(node);
            PREFERRED.lock().push(Preference { lease, tid, node });
        }
        // A node the kernel does not have (a simulated topology's): nothing to prefer.
        Err(errno) => log_debug!(
            "worker scope on thread {tid}: set_mempolicy(MPOL_PREFERRED, node {node}) failed (errno {errno}): memory policy left as it is"
        ),
    }
}

/// Called when the scope `lease` ends (or its lease is released): the opener's policy goes back
/// to the default, if this is the opener and its policy is still the one the library gave.
pub(super) fn restore_after_scope(lease: i64) {
    let taken = {
        let mut preferred = PREFERRED.lock();
        let Some(at) = preferred.iter().position(|p| p.lease == lease) else {
            return;
        };
        preferred.swap_remove(at)
    };
    let (tid, node) = (taken.tid, taken.node);
    if sys::gettid() != tid {
        log_info!(
            "worker scope {lease} ended on thread {}: thread {tid} keeps preferring NUMA node {node}'s memory (only a thread can change its own memory policy)",
            sys::gettid()
        );
        return;
    }
    match sys::memory_policy() {
        Ok((sys::MPOL_PREFERRED, nodes)) if nodes == [node] => {
            if sys::set_memory_policy(None).is_ok() {
                note_released();
                log_info!(
                    "worker scope on thread {tid} ended: its memory policy is the default again"
                );
            }
        }
        _ => {
            note_released();
            log_debug!(
                "worker scope on thread {tid} ended: its memory policy was changed since; left as it is"
            )
        }
    }
}

/// A fork child's threads are not the parent's: the preferences are the parent's to take back.
pub(super) fn forget_after_fork() {
    PREFERRED.lock().clear();
}
