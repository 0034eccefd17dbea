//! The host never hangs because of the library, whatever its other threads hold at a `fork`
//! (docs/reliability.md, "Locks and contexts"), on this machine's build: the checks, shared with
//! the aarch64 tier, are in tests/common/never_hang.rs, which describes each program.

use crate::common;

use common::never_hang::*;
use common::tier::Native;
use common::{field, Program};

#[test]
fn a_fork_child_never_waits_for_the_loader_lock_a_parent_thread_held() {
    check_fork_child_never_waits_for_the_loader_lock(&Native, &Program::c("fork_storm").build());
}

#[test]
fn the_storm_of_loads_forks_spawns_signals_and_configures_always_finishes() {
    check_storm_always_finishes(&Native, &Program::c("fork_storm").build());
}

#[test]
fn python_fork_children_of_a_loading_process_always_finish() {
    check_python_fork_children_finish(&Native);
}

/// A `SIGALRM` handler forks (as a crash reporter or a profiler does) every 200 µs while the
/// process's one thread is mostly inside the library's `sched_setaffinity` shim, holding the
/// registry lock: the program finishes, having forked from the handler many times.
#[test]
fn a_signal_handler_forking_inside_the_library_never_hangs() {
    let line = check_a_handler_forking_inside_the_library_finishes(&Native);
    let forks: u64 = field(&line, "forks").parse().unwrap();
    assert!(forks > 100, "{line}");
    assert_eq!(field(&line, "threads"), "1", "one thread all along: {line}");
}
