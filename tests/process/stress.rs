//! Issue #7's bounded stress (`tests/programs/churn_stress.c`): 200 000+ threads made and ended by
//! host and worker creators, and by hosts starting worker-library routines (the apply path),
//! while two threads configure and release in a loop (leases overlap) and the application pins
//! threads itself, on the simulated host where the worker mask is {1} and host threads live on
//! {0,1}.
//!
//! Checked throughout, by the threads themselves: no host thread ever sees a mask other than the
//! host mask (after every step of the checkers, in every host child); every worker child and
//! grandchild is a worker; every apply child is a worker on the worker or the host mask; a
//! configurer holding a lease is on the worker mask; an application's own pin holds. Apply
//! children parked across the churn (born across configures and releases: they move themselves
//! before they register) are all on the host mask after the last release, on the worker mask
//! under one more lease and back after it. At the end: the registry holds exactly the live threads (report vs
//! `/proc/<pid>/task`), no lease is left open, the process exits 0. A watchdog kills the process
//! and fails the test past 58 s; the churn itself stops at 200 000 threads or 45 s.

use crate::common;

use std::time::Duration;

use common::*;

const THREADS: u64 = 200_000;

#[test]
fn churn_configure_release_and_application_pins_keep_every_invariant() {
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus();
    require!(two_cpus("this test"));
    let program = Program::c("churn_stress").build();
    let worker_lib = worker_library();
    let mut cmd = preloaded(program, &sysfs);
    cmd.env("TLLM_AFFINITY_LOG", "warn").args([
        &THREADS.to_string(),
        "45",
        &sysfs.node1.to_list(),
        &all.to_list(),
        worker_lib.to_str().unwrap(),
    ]);
    let started = std::time::Instant::now();
    let mut run = Driver::spawn(cmd, Duration::from_secs(58));
    let line = run.line("STRESS");
    println!("{line}");
    let n = |k: &str| -> u64 { field(&line, k).parse().unwrap() };
    assert_eq!(
        n("violations"),
        0,
        "a host thread saw a library mask: {line}\n{}",
        run.stderr()
    );
    assert_eq!(
        n("pin_violations"),
        0,
        "an application pin was overridden: {line}"
    );
    assert_eq!(n("worker_violations"), 0, "{line}\n{}", run.stderr());
    assert_eq!(n("create_failures"), 0, "{line}");
    assert!(
        n("threads") >= THREADS,
        "only {} threads churned: {line}",
        n("threads")
    );
    assert!(
        n("cycles") > 1000,
        "too few configure/release cycles: {line}"
    );
    assert!(n("app_pins") > 0 && n("host_checks") > 0 && n("grandchildren") > 0);
    assert!(n("applied") > 0 && n("parked") > 0, "{line}");
    assert_eq!(n("reaped"), 1, "threads never left /proc/<pid>/task");

    run.phase();
    let live = task_tids(run.pid());
    run.proceed();
    let report = run.report("end");
    assert_eq!(live, [run.pid() as i32].into());
    assert_eq!(report_tids(&report), live, "{report}");
    assert_eq!(report["leases"], serde_json::json!([]));
    assert_eq!(report["worker_mask"], serde_json::Value::Null);
    let end = run.finish();
    assert!(end.status.success(), "{:?}\n{}", end.status, end.stderr);
    never_says(&end.stderr, &["VIOLATION"]);
    println!(
        "stress: {} threads churned ({} on the apply path, {} parked), {} configure/release cycles, {} application pins, {} host checks in {:.1} s (whole run {:.1} s)",
        n("threads"),
        n("applied"),
        n("parked"),
        n("cycles"),
        n("app_pins"),
        n("host_checks"),
        field(&line, "seconds").parse::<f64>().unwrap(),
        started.elapsed().as_secs_f64()
    );
}
