//! Roles, leases and restoration around a thread made with an attribute mask
//! (tests/programs/lifecycle_scenarios.c, mode `explicit`), checked the same way on every tier
//! (tests/lifecycle.rs, tests/aarch64.rs).

use std::time::Duration;

use serde_json::Value;

use super::tier::{phase_and_registry, Tier};
use super::*;

const LIMIT: Duration = Duration::from_secs(60);

/// The mask the report gives a thread (`kernel_mask`, read by the library from the kernel).
pub fn kernel_mask_in(report: &Value, tid: i32) -> String {
    report_thread(report, tid)["kernel_mask"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// A worker's threads during a lease are workers on the GPU-local set, the main thread a host on
/// every CPU; a thread a worker creates with `pthread_attr_setaffinity_np` keeps that mask
/// (placement `explicit`) through a second configure, the release and a configure after it, and
/// its children, born before or after, inherit the mask and the choice; the release restores the
/// rest. The library's table lists every thread the program made.
pub fn check_explicit_masks_through_leases(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let c = require!(sysfs.cpus("host and worker masks that differ"));
    let cpu = sysfs.node0.first().unwrap().to_string();
    let mut cmd = tier.preloaded(&tier.program("lifecycle_scenarios"), &sysfs);
    cmd.args(["explicit", &cpu]);
    let mut run = Driver::spawn(cmd, tier.limit(LIMIT));

    let (configured, _, report) = phase_and_registry(tier, &mut run, "configured");
    expect(
        &configured,
        Named(&["W", "C"]),
        worker_on(&c.local),
        "worker",
    );
    expect(&configured, Named(&["E", "E1"]), on(&c.other), "explicit");
    expect(&configured, Named(&["main"]), host_on(&c.all), "host");
    assert_eq!(configured.role("E"), 1, "E was made by a worker");
    let e = configured.thread("E").tid;
    assert_eq!(report_placement(&report, e), "explicit");
    assert_eq!(kernel_mask_in(&report, e), c.other);

    let twice = run.phase();
    expect(&twice, Named(&["W", "C", "C2"]), on(&c.local), "worker");
    expect(
        &twice,
        Named(&["E", "E1", "E2"]),
        on(&c.other),
        "explicit subtree",
    );
    run.proceed();

    let (released, _, report) = phase_and_registry(tier, &mut run, "released");
    expect(
        &released,
        Named(&["W", "C", "C2", "main"]),
        on(&c.all),
        "restored",
    );
    expect(
        &released,
        Named(&["E", "E1", "E2", "E3"]),
        on(&c.other),
        "never restored",
    );
    for t in ["E", "E1", "E2", "E3"] {
        let tid = released.thread(t).tid;
        assert_eq!(report_placement(&report, tid), "explicit", "{t}: {report}");
        assert_eq!(kernel_mask_in(&report, tid), c.other, "{t}");
    }

    let again = run.phase();
    expect(&again, Named(&["W", "C", "C2"]), on(&c.local), "worker");
    expect(
        &again,
        Named(&["E", "E1", "E2", "E3"]),
        on(&c.other),
        "never overridden",
    );
    let end = run.succeed();
    never_says(&end.stderr, &["constrained"]);
    says(
        &end.stderr,
        &["4 worker threads keep masks set by someone else"],
    );
}
