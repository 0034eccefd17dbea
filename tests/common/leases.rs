//! Roles, leases and restoration around a thread made with an attribute mask
//! (tests/programs/lifecycle_scenarios.c, mode `explicit`), checked the same way on every tier
//! (tests/process/lifecycle.rs, tests/emulated/aarch64.rs).

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

/// The threads of tests/programs/population.c before configure, and its worker's.
pub const POPULATION_BEFORE: [&str; 11] = [
    "main", "H1", "W", "C1", "G1", "C2", "C3", "C4", "C5", "C6", "P1",
];
pub const POPULATION_WORKERS: [&str; 9] = ["W", "C1", "G1", "C2", "C3", "C4", "C5", "C6", "P1"];

/// The C population (tests/programs/population.c, its worker-libs thread started in a stand-in
/// libnccl): before configure nobody moved and the libnccl thread is already a worker; configure
/// pins the worker, its descendants and the libnccl threads, the hosts keep every CPU; a second
/// configure changes nothing and says nothing; the last release restores every mask; a worker
/// born after it is born on the restored mask.
pub fn check_c_population(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let nccl = tier.shared_object("nccl", "libnccl.so.2");
    let mut cmd = tier.preloaded(&tier.program("population"), &sysfs);
    cmd.env("FAKE_NCCL", nccl).arg("0");
    let (phases, end) = Driver::spawn(cmd, tier.limit(DEADLINE)).all_phases::<5>();
    assert!(end.status.success(), "{}", end.stderr);
    let [before, configured, twice, released, after] = &phases;
    println!("{}\n{}", describe(configured), describe(released));

    // Before configure: nobody has been moved; the worker-libs thread is already a worker.
    expect(
        before,
        Named(&POPULATION_BEFORE),
        on(&all),
        "before configure",
    );
    assert_eq!(
        before.role("P1"),
        1,
        "a thread started in libnccl is a worker"
    );
    assert_eq!(before.role("W"), 0);

    // configure on W: W, its children, its grandchild and the worker-libs thread get the
    // GPU-local set; the main thread and the host thread started before keep their mask.
    expect(
        configured,
        Named(&POPULATION_WORKERS),
        worker_on(&local),
        "after configure",
    );
    expect(configured, Named(&["main", "H1"]), host_on(&all), "host");

    // A second configure changes nothing; threads born in between stay pinned; host threads
    // born during the lease stay on the host mask.
    let second = "after the second configure";
    expect(twice, Named(&POPULATION_WORKERS), on(&local), second);
    expect(twice, Named(&["C7", "P2"]), on(&local), second);
    assert_eq!((twice.mask("H2"), twice.role("H2")), (all.clone(), 0));
    never_says(&end.stderr, &["constrained"]);
    says(
        &end.stderr,
        &[&format!(
            "CPU affinity set to [{local}] for optimal NUMA-aware scheduling (9/9 threads)"
        )],
    );
    assert_eq!(
        end.stderr
            .matches("for optimal NUMA-aware scheduling")
            .count(),
        1,
        "the second configure must log nothing new:\n{}",
        end.stderr
    );

    // The last release restores every mask; releasing again says ENOENT.
    expect(released, All, on(&all), "after release");
    says(
        &end.stderr,
        &[
            "release 1 -> 0",
            "release 2 -> 0",
            "release again -> -2",
            "restored 11 threads, preserved 0",
        ],
    );

    // A worker thread born after the last release is born on the restored mask.
    assert_eq!((after.mask("C8"), after.role("C8")), (all, 1));
}
