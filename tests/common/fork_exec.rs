//! The ways out of a thread, fork and exec under the library (tests/programs/lifecycle_scenarios.c),
//! checked the same way on every tier (tests/process/lifecycle.rs, tests/emulated/aarch64.rs, and tests/process/wheel.rs
//! with the wheel's own library).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::tier::{phase_and_registry, Tier};
use super::*;

const LIMIT: Duration = Duration::from_secs(60);

fn life(tier: &dyn Tier) -> PathBuf {
    tier.program("lifecycle_scenarios")
}

fn life_cmd(tier: &dyn Tier, sysfs: &Sysfs, args: &[&str]) -> Command {
    let mut cmd = tier.preloaded(&life(tier), sysfs);
    cmd.args(args);
    cmd
}

/// Threads ending by return, `pthread_exit`, deferred, asynchronous and in-wait cancellation,
/// and detached threads, from a host and from a worker during a lease; a parent that exits
/// before its child. The report's threads are the live threads, no more, no less, and the
/// process ends well (a forced unwind, which `pthread_exit` and cancellation are, passes through
/// the library's thread-start frame).
pub fn check_every_way_out(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let mut run = Driver::spawn(life_cmd(tier, &sysfs, &["exits"]), tier.limit(LIMIT));
    let pid = run.pid() as i32;
    let start = run.report("start");
    assert_eq!(report_tids(&start), [pid].into());
    assert_eq!(run.line("ENDED main"), "ENDED main 240");
    assert_eq!(run.line("ENDED W"), "ENDED W 240");

    let (alive, live, report) = phase_and_registry(tier, &mut run, "orphan-alive");
    let orphan = alive.thread("orphan").tid;
    assert!(live.contains(&orphan));
    assert_eq!(
        report_thread(&report, orphan)["role"],
        "worker",
        "an orphan keeps the role it was born with"
    );

    assert_eq!(run.line("WAITED"), "WAITED 1");
    let (_, live, report) = phase_and_registry(tier, &mut run, "ended");
    assert_eq!(live, [pid].into(), "{report}");
    run.succeed();
}

/// A fork from the host main thread and one from a worker thread during a lease, while the
/// parent has five threads: each child's registry holds only the forking thread, with its role;
/// the child creates a thread (same role), configures and releases; the worker's child can also
/// release the lease its thread held, which restores its mask. A child forked by a host holds no
/// lease, so its own release restores.
pub fn check_fork_children(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let c = require!(sysfs.cpus("host and worker masks that differ"));
    let mut run = Driver::spawn(life_cmd(tier, &sysfs, &["fork"]), tier.limit(LIMIT));

    let report = forked_child(
        &mut run,
        "main",
        &[
            ("threads", "1"),
            ("role", "0"),
            ("thread_role", "0"),
            ("mask_before", c.all.as_str()),
            ("mask", c.local.as_str()),
            ("release", "0"),
            ("released_mask", c.all.as_str()),
            ("threads_after", "1"),
        ],
    );
    assert_eq!(report["leases"], serde_json::json!([]));

    let report = forked_child(
        &mut run,
        "W",
        &[
            ("threads", "1"),
            ("role", "1"),
            ("thread_role", "1"),
            ("mask_before", c.local.as_str()),
            ("release_inherited", "0"),
            ("restored", c.all.as_str()),
            ("mask", c.local.as_str()),
            ("release", "0"),
            ("released_mask", c.all.as_str()),
            ("threads_after", "1"),
        ],
    );
    let child_pid = report["pid"].as_i64().unwrap() as i32;
    assert_eq!(report_thread(&report, child_pid)["role"], "worker");

    let (parent, _, _) = phase_and_registry(tier, &mut run, "parent");
    expect(
        &parent,
        Named(&["W", "C1", "C2"]),
        on(&c.local),
        "parent worker",
    );
    expect(&parent, Named(&["main", "H"]), on(&c.all), "parent host");
    run.succeed();
}

/// The child forked by thread `who`: its CHILD line holds `expect`, its report lists exactly one
/// thread (itself), and it exited 0. Returns the report.
fn forked_child(run: &mut Driver, who: &str, expect: &[(&str, &str)]) -> Value {
    let line = run.line(&format!("CHILD {who}"));
    println!("{line}");
    for (k, v) in expect {
        assert_eq!(field(&line, k), *v, "{k} in {line}");
    }
    let tag = format!("CHILDREPORT {who} ");
    let report: Value =
        serde_json::from_str(run.line(tag.trim_end()).trim_start_matches(&tag)).unwrap();
    let child_pid = report["pid"].as_i64().unwrap() as i32;
    assert_eq!(report_tids(&report), [child_pid].into());
    assert_eq!(
        run.line(&format!("FORKED {who}")),
        format!("FORKED {who} status=0")
    );
    report
}

/// 300 forks while a host and a worker thread create and join threads and another thread
/// configures and releases in a loop: every child sees one thread (itself), creates a thread,
/// configures and releases, within 20 s (an alarm kills a stuck child, which fails the count).
pub fn check_fork_storm(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let mut run = Driver::spawn(
        life_cmd(tier, &sysfs, &["forkstorm", "300"]),
        tier.limit(LIMIT),
    );
    let line = run.line("FORKSTORM");
    println!("{line}");
    assert_eq!(field(&line, "ok"), "300", "{line}\n{}", run.stderr());
    assert_eq!(field(&line, "bad"), "0");
    assert!(field(&line, "threads_created").parse::<u64>().unwrap() > 0);
    phase_and_registry(tier, &mut run, "end");
    run.succeed();
}

/// exec during a lease, from the host main thread and from a worker thread: the new image starts
/// clean — its main thread is a host, no lease is open, the registry holds one thread, and the
/// program's live threads are its main thread and the one it then makes. (The kernel keeps the
/// exec'ing thread's mask across exec: from the worker that is the worker mask, which the new
/// image records as its mask at load.)
pub fn check_exec(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let c = require!(sysfs.cpus("host and worker masks that differ"));
    for (who, mask_after) in [("main", &c.all), ("worker", &c.local)] {
        let mut run = Driver::spawn(life_cmd(tier, &sysfs, &["exec", who]), tier.limit(LIMIT));
        let pid = run.pid();
        let before = run.phase();
        assert_eq!(before.mask("W"), c.local);
        run.proceed();
        let before = run.report("before-exec");
        assert_eq!(before["leases"].as_array().unwrap().len(), 1);
        let line = run.line("EXECED");
        println!("{line}");
        assert_eq!(field(&line, "from"), who);
        assert_eq!(field(&line, "pid"), pid.to_string());
        assert_eq!(field(&line, "role"), "0", "{line}");
        assert_eq!(&field(&line, "mask"), mask_after, "{line}");
        let report = run.report("execed");
        assert_eq!(report["state"], "active");
        assert_eq!(report["leases"], serde_json::json!([]), "{report}");
        assert_eq!(report["worker_mask"], Value::Null);
        assert_eq!(report_tids(&report), [pid as i32].into());
        assert_eq!(report_thread(&report, pid as i32)["role"], "host");
        let execed = run.phase();
        assert_eq!(execed.role("T"), 0, "a host's thread is a host");
        let listed: BTreeSet<i32> = [pid as i32, execed.thread("T").tid].into();
        assert_eq!(
            tier.program_threads(pid, &task_tids(pid), &listed),
            listed,
            "{who}: the new image's threads"
        );
        let end = run.finish();
        assert!(end.status.success(), "{who}: {}", end.stderr);
    }
}
