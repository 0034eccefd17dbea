//! What the C ABI's calls do (SPEC §3–§7): `configure`, `begin_worker_scope`,
//! `end_worker_scope`, `release`, `role`, `report`, and the step and result pins. Each makes sure
//! the engine is initialised ([`super::init`]), then does its work or hands it to the file of
//! its concern ([`super::configure`], [`super::report`], [`super::step_pin`]); `note_adapter`
//! lives with the report.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::configure::configure_for;
use super::fork::adopt_if_forked_without_handlers;
use super::init::ensure_init;
use super::kernel::Kernel;
use super::publish::publish_table_if_pending;
use super::state::{lock_registry, State};
use super::thread_key::{current_slot, set_current_slot};
use super::{environ, exec, memory_preference, report, step_pin};
use crate::log_info;
use crate::registry::{LeaseKind, Role, Slot};
use crate::sys;

/// `tllm_affinity_configure`: makes the caller a worker and applies the policy (SPEC §3–§5).
pub fn configure(device_id: i32) -> i64 {
    open_for_caller(device_id, LeaseKind::Configure)
}

/// `tllm_affinity_begin_worker_scope`: the caller keeps its role, the threads it creates until
/// the scope ends are born workers; the policy applies as for `configure` (SPEC §2, §7).
pub fn begin_worker_scope(device_id: i32) -> i64 {
    open_for_caller(device_id, LeaseKind::WorkerScope)
}

fn open_for_caller(device_id: i32, kind: LeaseKind) -> i64 {
    if ensure_init() != State::Active {
        return -(libc::ENOTSUP as i64);
    }
    catch_unwind(|| {
        adopt_if_forked_without_handlers();
        publish_table_if_pending();
        let caller = current_or_register();
        configure_for(caller, device_id, kind, true, environ::device_env())
    })
    .unwrap_or(-(libc::EFAULT as i64))
}

/// `tllm_affinity_end_worker_scope`: 0, or `-ENOENT` when `lease` is no open scope. The lease
/// stays open until released.
pub fn end_worker_scope(lease: i64) -> i32 {
    match ensure_init() {
        State::Active => {}
        State::Off => return -libc::ENOTSUP,
        _ => return -libc::ENOENT,
    }
    match catch_unwind(|| lock_registry().end_scope(lease)) {
        Ok(Ok(tid)) => {
            memory_preference::restore_after_scope(lease);
            log_info!(
                "worker scope closed on thread {tid}: threads it creates take its role again (lease {lease} stays open until released)"
            );
            0
        }
        Ok(Err(_unknown)) => -libc::ENOENT,
        Err(_) => -libc::EFAULT,
    }
}

/// The calling thread's slot, registering it as a root if the library never saw it born.
fn current_or_register() -> Slot {
    if let Some(slot) = current_slot() {
        if lock_registry().entry(slot).is_some() {
            return slot;
        }
    }
    let tid = sys::gettid();
    let mask = sys::get_mask(0).unwrap_or_default();
    let handle = sys::pthread_self() as u64;
    let mut reg = lock_registry();
    let slot = match reg.find_tid(tid) {
        Some(slot) => slot,
        None => reg.register_root(tid, handle, Role::Host, mask),
    };
    drop(reg);
    set_current_slot(slot);
    slot
}

/// `tllm_affinity_release` (SPEC §5).
pub fn release(lease: i64) -> i32 {
    match ensure_init() {
        State::Active => {}
        State::Off => return -libc::ENOTSUP,
        _ => return -libc::ENOENT,
    }
    let result = catch_unwind(|| {
        let mut reg = lock_registry();
        let outcome = reg.release(lease, &Kernel);
        exec::publish_target(reg.target().map(|t| &*t.mask));
        outcome
    });
    match result {
        Ok(Ok(outcome)) => {
            memory_preference::restore_after_scope(lease);
            if outcome.last {
                log_info!(
                    "released lease {lease}: restored {} threads, preserved {} externally changed",
                    outcome.restored,
                    outcome.preserved
                );
            }
            0
        }
        Ok(Err(_unknown)) => -libc::ENOENT,
        Err(_) => -libc::EFAULT,
    }
}

/// Runs the body of an exported C entry point of the library's own API: a panic inside it
/// answers `failed` instead of unwinding into the host program, where an `extern "C"` function
/// that unwinds aborts the process (SPEC §9: every exported entry point fails open).
pub fn fail_open<T>(failed: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(failed)
}

/// `tllm_affinity_role`: 0 host, 1 worker, `-ENOENT` for a thread the library does not know.
/// Under `TLLM_AFFINITY_DISABLE=1` every call of the C API answers `-ENOTSUP` (SPEC §8).
pub fn role(tid: i32) -> i32 {
    match ensure_init() {
        State::Active => {}
        State::Off => return -libc::ENOTSUP,
        _ => return -libc::ENOENT,
    }
    let reg = lock_registry();
    let slot = if tid == 0 {
        current_slot().filter(|&s| reg.entry(s).is_some())
    } else {
        reg.find_tid(tid)
    };
    match slot.and_then(|s| reg.entry(s)).map(|e| e.role) {
        Some(Role::Host) => 0,
        Some(Role::Worker) => 1,
        None => -libc::ENOENT,
    }
}

/// `tllm_affinity_report`: the report as of now (see [`report`]).
pub fn report_json() -> String {
    report::json(ensure_init(), false)
}

/// `tllm_affinity_pin_step_thread` / `_result_thread` (SPEC §6).
pub fn pin_step_or_result(device_id: i32, result: bool) -> i32 {
    if ensure_init() != State::Active {
        return -libc::ENOTSUP;
    }
    catch_unwind(AssertUnwindSafe(|| {
        adopt_if_forked_without_handlers();
        publish_table_if_pending();
        let caller = current_or_register();
        step_pin::pin_calling_thread(caller, device_id, result)
    }))
    .unwrap_or(-libc::EFAULT)
}

/// `tllm_affinity_note_adapter` (see [`report::note_adapter`]). A process whose adapter noted
/// itself matters (it runs an inference server): its table is published first, so `ps` shows
/// the note even before the process's first thread.
///
/// The start-up hook's own note (`python`, see [`report::note_python_hook`]) is the exception:
/// every interpreter under the library gives it, so it maps nothing.
pub fn note_adapter(name: &[u8], state: &[u8]) -> i32 {
    if name == report::PYTHON_HOOK_ADAPTER {
        return report::note_python_hook(state);
    }
    publish_table_if_pending();
    report::note_adapter(name, state)
}
