//! The worker scope's caller and its memory (SPEC §7): the caller keeps its host mask, so what
//! it allocates while the scope is open (the engine it builds for the workers) would land
//! wherever the scheduler runs it. It prefers the GPU's node (`MPOL_PREFERRED`) until the scope
//! ends, unless it already has a policy of its own (`numactl --membind`, `--preferred`), which is
//! left alone. A thread's memory policy can only be set by the thread itself: a scope ended on
//! another thread leaves the preference in place, and says so.

use crate::lock::EngineLock;
use crate::mask::CpuMask;
use crate::placement::policy;
use crate::registry::Tid;
use crate::{log_debug, log_info, sys};

/// A preference the library gave: the scope's lease, the thread, the node.
pub(super) struct Preference {
    lease: i64,
    tid: Tid,
    node: usize,
}

/// The preferences given and not yet taken back.
pub(super) static PREFERRED: EngineLock<Vec<Preference>> = EngineLock::new(Vec::new());

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
                log_info!(
                    "worker scope on thread {tid} ended: its memory policy is the default again"
                );
            }
        }
        _ => log_debug!(
            "worker scope on thread {tid} ended: its memory policy was changed since; left as it is"
        ),
    }
}

/// A fork child's threads are not the parent's: the preferences are the parent's to take back.
pub(super) fn forget_after_fork() {
    PREFERRED.lock().clear();
}
