//! The engine under hostile conditions, on real processes (`tests/programs/hostile.c`): signal
//! handlers that call an interposed function while their thread is inside the library, `vfork`
//! and `clone(CLONE_VM)` children, long chains of short-lived threads, glibc's own helper
//! threads, threads created from thread-specific-data and `thread_local` destructors, and a process that already
//! has a thread the library never saw when it loads. Every run is bounded by a deadline: a hang
//! fails the test.
//!
//! The simulated host (`Sysfs::two_nodes`) puts device 0's worker mask on node1 = {1}; host
//! threads stay on every allowed CPU.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

fn hostile() -> PathBuf {
    Program::c("hostile").flags(&["-lrt"]).build()
}

/// `hostile <args>` under the library on `sysfs`, every wait bounded by `limit`.
fn start(sysfs: &Sysfs, args: &[&str], limit: Duration) -> Driver {
    let mut cmd = preloaded(hostile(), sysfs);
    cmd.args(args);
    Driver::spawn(cmd, limit)
}

/// [`start`] on a two-node host with a worker mask narrower than the host's, within [`LIMIT`]:
/// the host (to outlive the run), its CPUs and the run.
fn started(args: &[&str]) -> Result<(Sysfs, HostCpus, Driver), String> {
    let sysfs = Sysfs::two_nodes();
    let cpus = all_and_local(&sysfs)?;
    let run = start(&sysfs, args, LIMIT);
    Ok((sysfs, cpus, run))
}

/// The thread an exiting worker created (from a destructor): a worker on the worker mask
/// while the lease is open, as its creator was.
fn orphan_is_a_worker(configured: &Phase, local: &str) {
    assert_eq!(configured.role("orphan"), 1, "a worker, as its creator was");
    assert_eq!(configured.mask("orphan"), local);
}

/// The host's mask and the worker mask; the error (for `require!`) on a host with one CPU.
fn all_and_local(sysfs: &Sysfs) -> Result<HostCpus, String> {
    sysfs.cpus("a worker mask narrower than the host's")
}

/// A `SIGUSR1` handler calls `sched_setaffinity` (async-signal-safe) while its thread is in the
/// library's setaffinity shim, in a thread creation or at a thread's exit, thousands of times:
/// the program finishes, and the handler's calls took effect.
#[test]
fn a_signal_handler_calling_sched_setaffinity_inside_the_library_never_hangs() {
    let sysfs = Sysfs::two_nodes();
    let mut run = start(&sysfs, &["signals", "3000"], LIMIT);
    let line = run.line("SIGNALS");
    let handled: u64 = field(&line, "handled").parse().unwrap();
    assert!(handled > 100, "the handler ran: {line}");
    run.line("DONE");
    run.succeed();
}

/// A worker's `vfork` child and `clone(CLONE_VM)` child each pin themselves before exiting: they
/// share the worker's memory and thread-local state, but the worker stays the library's (placed
/// `worker`, not `explicit`) and the last release restores it.
#[test]
fn vfork_and_clone_vm_children_leave_their_parent_as_it_was() {
    let (_sysfs, HostCpus { all, local, .. }, mut run) = require!(started(&["vfork"]));
    let report = run.report("children");
    let children = run.phase();
    let w = children.thread("W").tid;
    assert_eq!(report_thread(&report, w)["placement"], "worker", "{report}");
    assert_eq!(children.mask("W"), local);
    run.proceed();
    let released = run.phase();
    assert_eq!(released.mask("W"), all, "the release restored the worker");
    run.succeed();
}

/// 20 000 generations of threads that start their successor and exit: the heap (one arena, so
/// the library's allocations are counted) does not grow with the generations.
#[test]
fn a_chain_of_short_lived_threads_keeps_memory_bounded() {
    let sysfs = Sysfs::two_nodes();
    let mut run = start(&sysfs, &["chain", "20000"], Duration::from_secs(120));
    let line = run.line("CHAIN");
    let early: i64 = field(&line, "heap_at_1000").parse().unwrap();
    let late: i64 = field(&line, "heap_at_end").parse().unwrap();
    assert!(
        late - early < 64 * 1024,
        "the heap grew by {} bytes over 19 000 generations: {line}",
        late - early
    );
    run.succeed();
}

/// glibc starts a timer's `SIGEV_THREAD` helper and its `aio` helpers itself, from a worker,
/// where the library cannot see them: they are born on the worker mask. The last release gives
/// them the launch mask back; a thread that was there before the lease is untouched.
#[test]
fn glibc_helper_threads_born_on_the_worker_mask_get_the_launch_mask_back() {
    let (_sysfs, HostCpus { all, local, .. }, mut run) = require!(started(&["glibc"]));
    let unnamed = run.line("UNNAMED");
    let configured = run.phase();
    let helpers: Vec<&str> = configured
        .threads
        .keys()
        .filter(|t| t.starts_with("helper"))
        .map(String::as_str)
        .collect();
    assert!(!helpers.is_empty(), "glibc started helpers: {unnamed}");
    for h in &helpers {
        assert_eq!(configured.mask(h), local, "{h} was born on the worker mask");
    }
    assert_eq!(configured.mask("before"), all);
    run.proceed();
    let released = run.phase();
    for h in &helpers {
        assert_eq!(released.mask(h), all, "{h} after the last release");
    }
    assert_eq!(released.mask("W"), all);
    assert_eq!(released.mask("before"), all);
    run.succeed();
}

/// A worker creates the process's first `SIGEV_THREAD` timer, so glibc starts its helper thread
/// on the worker mask, and every later callback thread is that helper's child. A callback runs
/// as its timer's creator would have it: a host's on the host mask, a worker's on the worker
/// mask during the lease and on its own mask after the release.
#[test]
fn a_timers_callback_runs_with_its_creators_role_not_glibcs_helpers() {
    let (_sysfs, HostCpus { all, local, .. }, mut run) = require!(started(&["timers"]));
    let line = run.line("TIMERS");
    run.succeed();
    assert_eq!(field(&line, "worker"), local, "{line}");
    assert_eq!(field(&line, "host"), all, "a host's callback: {line}");
    assert_eq!(
        field(&line, "worker_after"),
        all,
        "after the release: {line}"
    );
    assert_eq!(field(&line, "host_after"), all, "{line}");
}

/// A worker thread's thread-specific-data destructor (a key created after the library's)
/// creates a thread as the worker exits: the new thread is the worker's child, a worker on the
/// worker mask, and the last release restores it.
#[test]
fn a_thread_created_from_a_tsd_destructor_is_its_exiting_creators_child() {
    let (_sysfs, HostCpus { all, local, .. }, mut run) = require!(started(&["tsd"]));
    let configured = run.phase();
    orphan_is_a_worker(&configured, &local);
    run.proceed();
    let released = run.phase();
    assert_eq!(released.mask("orphan"), all, "restored at the last release");
    run.succeed();
}

/// A worker thread's `thread_local` destructor (registered with `__cxa_thread_atexit_impl`, as
/// C++ does) sets its own mask and creates a thread after the worker's routine returned: the
/// worker is still registered then (its child is a worker on the worker mask, restored at the
/// last release), and unregistered once it is gone (the registry holds the live threads alone).
#[test]
fn a_thread_created_from_a_thread_local_destructor_is_its_exiting_creators_child() {
    let (_sysfs, HostCpus { all, local, .. }, mut run) = require!(started(&["tlsdtor"]));
    let exited = run.after("EXITED ");
    let (tid, role) = exited.split_once(" role=").unwrap();
    assert!(
        role.parse::<i32>().unwrap() < 0,
        "unknown once gone: {exited}"
    );
    // The report lists the live threads and no other (checked there).
    let (configured, _, report) = run.phase_and_registry("configured");
    orphan_is_a_worker(&configured, &local);
    assert!(
        !report_tids(&report).contains(&tid.parse().unwrap()),
        "the exited worker is unregistered: {report}"
    );
    let released = run.phase();
    assert_eq!(released.mask("orphan"), all, "restored at the last release");
    run.succeed();
}

/// A dedicated worker process records its launch (and its launch mask) for the programs it
/// starts with `setenv`, which races with any other thread's `getenv`: it does so only while it
/// has no other thread. Here another object's constructor already started one the library could
/// not see.
#[test]
fn a_dedicated_worker_sets_no_variable_once_another_thread_runs() {
    let sysfs = Sysfs::two_nodes();
    require!(all_and_local(&sysfs));
    let early = Program::c("unseen_early_thread")
        .shared()
        .named("libunseen_early_thread.so")
        .build();
    let run = |preload: String| {
        let mut cmd = preloaded(hostile(), &sysfs);
        cmd.env("LD_PRELOAD", preload)
            .env("TLLM_AFFINITY_PROCESS_ROLE", "worker")
            .arg("launchvar");
        let mut run = Driver::spawn(cmd, LIMIT);
        let line = run.line("LAUNCHVAR");
        run.succeed();
        line
    };
    let alone = run(library().display().to_string());
    assert!(
        !alone.contains("(unset)"),
        "alone, it carries the mask: {alone}"
    );
    let crowded = run(format!("{}:{}", library().display(), early.display()));
    says(&crowded, &["threads=2", "(unset)"]);
}

/// Two `SCHED_FIFO` threads of different priorities on one CPU both create threads, so both
/// take the library's locks. A waiter that only spun (even yielding) would never let the
/// lower-priority holder run again on that CPU: the higher one must sleep until it is free.
#[test]
fn a_high_priority_fifo_waiter_lets_a_low_priority_holder_finish() {
    let sysfs = Sysfs::two_nodes();
    let mut run = start(&sysfs, &["fifo", "2000"], Duration::from_secs(30));
    let line = run.line("FIFO");
    require!(
        !line.contains("unavailable"),
        &format!("SCHED_FIFO ({line})"),
    );
    let high: u64 = field(&line, "high").parse().unwrap();
    assert!(high > 100, "the high-priority thread made progress: {line}");
    run.succeed();
}
