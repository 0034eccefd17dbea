//! Issue #2's lifecycle rules and issue #7's faults on real processes: compiled C programs
//! (`tests/programs/lifecycle_scenarios.c` and its shared objects) and real Python, the real
//! library preloaded, every mask read from `/proc/<pid>/task/<tid>/status` or from the report's
//! `kernel_mask`, every run bounded by a deadline (a hang fails the test).
//!
//! The simulated host (`Sysfs::two_nodes`) has node0 = {0} and node1 = {1}; device 0 is local to
//! node1, device 1 (0000:86:00.0) to node0. So the worker mask of device 0 is "local" = {1}, host
//! threads stay on "all" = {0,1}, and "other" = {0} is a CPU the library never chooses for
//! device 0: the tests pin there by hand.

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::fork_exec::*;
use common::leases::kernel_mask_in;
use common::tier::Native;
use common::*;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(60);

/// The three masks of the simulated host; the error (for `require!`) on a machine with a single
/// allowed CPU, where host and worker masks cannot differ.
fn cpus(sysfs: &Sysfs) -> Result<HostCpus, String> {
    sysfs.cpus("host and worker masks that differ")
}

fn life() -> PathBuf {
    Program::c("lifecycle_scenarios").build()
}

fn shared_object(src: &str, name: &str) -> PathBuf {
    Program::c(src).shared().named(name).build()
}

fn life_cmd(sysfs: &Sysfs, args: &[&str]) -> Command {
    let mut cmd = preloaded(life(), sysfs);
    cmd.args(args);
    cmd
}

fn python_cmd(sysfs: &Sysfs, script: &str, args: &[&str]) -> Command {
    let mut cmd = preloaded(python(), sysfs);
    cmd.arg(programs_dir().join(script))
        .args(args)
        .env("PYTHONPATH", repo().join("python"));
    cmd
}

// ---- Rule 1: explicit attr masks ---------------------------------------------------------

/// A thread a worker creates with `pthread_attr_setaffinity_np` during a lease keeps that mask
/// (placement `explicit`) through a second configure, a release and a configure after it; its
/// children, born before or after, inherit the mask and the choice.
#[test]
fn explicit_attr_masks_are_kept_through_configure_and_release() {
    common::leases::check_explicit_masks_through_leases(&Native);
}

// ---- Rule 2: the application's own calls, and taskset from outside -----------------------

/// A program whose threads pin themselves during a lease (`by_app`, and `child`, a child of the
/// first), on whose thread `ext` the test runs `taskset -p` from outside after a second
/// configure, while `workers` stay the library's. The C and the Python program are rows of it.
struct Preserved {
    command: fn(&Sysfs, &str) -> Command,
    by_app: &'static [&'static str],
    child: &'static [&'static str],
    workers: &'static [&'static str],
    ext: &'static str,
    /// `expect`'s words at the first phase, at release and at the configure after it.
    pinned: &'static str,
    released: &'static str,
    again: &'static str,
    own: fn(&Finished),
}

fn check_preserved(row: &Preserved) {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let cpu = sysfs.node0.first().unwrap().to_string();
    let mut run = Driver::spawn((row.command)(&sysfs, &cpu), LIMIT);
    let with = |names: &[&'static str], more: &[&'static str]| -> Vec<&'static str> {
        names.iter().chain(more).copied().collect()
    };
    let workers_and_ext = with(row.workers, &[row.ext]);
    let left_alone = with(&with(row.by_app, row.child), &[row.ext]);

    let pinned = run.phase();
    expect(&pinned, Named(row.by_app), on(&c.other), row.pinned);
    expect(&pinned, Named(&workers_and_ext), on(&c.local), "worker");
    run.proceed();

    let twice = run.phase();
    expect(
        &twice,
        Named(row.by_app),
        on(&c.other),
        "after the second configure",
    );
    if !row.child.is_empty() {
        expect(
            &twice,
            Named(row.child),
            on(&c.other),
            "child of a pinned thread",
        );
    }
    expect(&twice, Named(&workers_and_ext), on(&c.local), "worker");
    let ext = twice.thread(row.ext).tid;
    let taskset = Command::new("taskset")
        .args(["-p", "-c", &cpu, &ext.to_string()])
        .output()
        .expect("taskset");
    assert!(taskset.status.success(), "{taskset:?}");
    assert_eq!(kernel_mask(run.pid(), ext).to_list(), c.other);
    run.proceed();

    let released = run.phase();
    expect(
        &released,
        Named(&with(row.workers, &["main"])),
        on(&c.all),
        "restored",
    );
    expect(&released, Named(&left_alone), on(&c.other), row.released);
    run.proceed();
    let report = run.report("released");
    assert_eq!(report_placement(&report, ext), "external", "{report}");
    for t in row.by_app {
        assert_eq!(
            report_placement(&report, released.thread(t).tid),
            "explicit",
            "{t}"
        );
    }

    let again = run.phase();
    expect(&again, Named(&left_alone), on(&c.other), row.again);
    expect(&again, Named(row.workers), on(&c.local), "worker");
    let end = run.succeed();
    says(&end.stderr, &["preserved 1 externally changed"]);
    (row.own)(&end);
}

table_tests! {
    check_preserved;
    /// `sched_setaffinity(0)`, `sched_setaffinity(tid)` and `pthread_setaffinity_np` by the
    /// program on worker threads during a lease are observed: a second configure and the release
    /// leave them alone. `taskset -p` from outside on another worker is found at release
    /// ("preserved 1 externally changed", placement `external`) and a later configure leaves it
    /// too.
    applications_own_setaffinity_and_taskset_are_preserved: Preserved {
        command: |sysfs, cpu| life_cmd(sysfs, &["observe", cpu]),
        by_app: &["S1", "S2", "S4"],
        child: &["S1child"],
        workers: &["W", "C"],
        ext: "S3",
        pinned: "pinned by the program",
        released: "left alone by release",
        again: "left alone by the next configure",
        own: |end| {
            assert_eq!(end.stdout.matches("PINNED").count(), 3, "{}", end.stdout);
            assert!(!end.stdout.contains("-> -"), "a pin failed: {}", end.stdout);
        },
    };
    /// The same with real Python threads: `os.sched_setaffinity` on the calling thread and on
    /// another thread by its native id, and `taskset -p` on a third.
    python_sched_setaffinity_and_taskset_are_preserved: Preserved {
        command: |sysfs, cpu| python_cmd(sysfs, "own_setaffinity.py", &[cpu]),
        by_app: &["self_pinned", "other_pinned"],
        child: &[],
        workers: &["engine", "plain"],
        ext: "ext",
        pinned: "pinned by os.sched_setaffinity",
        released: "left alone",
        again: "left alone",
        own: |_| {},
    };
}

/// onnxruntime pins its own pool threads, sometimes to exactly the worker set: the thread is the
/// application's (`explicit`) in `tllm-affinity ps` at once (the thread table, before any other
/// call reaches the library), and the release leaves it where the application put it.
#[test]
fn an_application_pin_equal_to_the_worker_mask_stays_explicit_and_survives_release() {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let program = Program::c("pin_to_worker_set").build();
    let mut run = Driver::spawn(preloaded(program, &sysfs), LIMIT);
    let tid: i32 = field(&run.line("PINNED"), "tid").parse().unwrap();
    assert_eq!(kernel_mask(run.pid(), tid).to_list(), c.local);
    let ps = Command::new(cli())
        .args(["ps", &run.pid().to_string(), "--json"])
        .output()
        .expect("tllm-affinity ps");
    let ps: serde_json::Value = serde_json::from_slice(&ps.stdout).unwrap();
    let row = row(&ps, "threads", "tid", tid);
    assert_eq!(row["placement"], "explicit", "{ps}");
    run.proceed();
    let report = run.report("released");
    assert_eq!(report_placement(&report, tid), "explicit");
    assert_eq!(
        kernel_mask(run.pid(), tid).to_list(),
        c.local,
        "left where the application put it"
    );
    assert_eq!(kernel_mask(run.pid(), run.pid() as i32).to_list(), c.all);
    run.succeed();
}

// ---- Rule 3: exits, creation failure, fork, early and dlopen'd constructors ----------------

/// Threads ending by return, `pthread_exit`, deferred, asynchronous and in-wait cancellation,
/// and detached threads, from a host and from a worker during a lease; a parent that exits
/// before its child. The report's threads are the live threads, no more, no less.
#[test]
fn every_way_out_of_a_thread_leaves_the_registry_equal_to_the_live_threads() {
    check_every_way_out(&Native);
}

/// Python threads ending normally, by an exception and by SystemExit, and a thread pool.
#[test]
fn python_thread_exits_leave_the_registry_equal_to_the_live_threads() {
    let sysfs = Sysfs::two_nodes();
    let mut run = Driver::spawn(python_cmd(&sysfs, "thread_exits.py", &[]), LIMIT);
    assert_eq!(run.line("ENDED"), "ENDED 110");
    run.phase_and_registry("ended");
    run.succeed();
}

/// `pthread_create` with an attr mask naming only a CPU no machine here has: EINVAL comes back
/// as without the library, errno is untouched, the thread never runs, and the registry holds
/// no trace of it — from a host and from a worker during a lease, 200 times each. (The leak
/// check of the same program under valgrind is in tests/process/memcheck.rs.)
#[test]
fn creation_failure_on_an_impossible_attr_mask_passes_through_and_leaves_nothing() {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let bare = run_bounded(
        {
            let mut cmd = Command::new(life());
            cmd.args(["createfail", "20"]);
            cmd
        },
        LIMIT,
    );
    let baseline = bare
        .stdout
        .lines()
        .find(|l| l.starts_with("CREATEFAIL main"))
        .unwrap_or_else(|| panic!("{}", bare.stdout))
        .to_string();
    assert_eq!(field(&baseline, "rc"), "22", "glibc's own answer");

    let mut run = Driver::spawn(life_cmd(&sysfs, &["createfail", "200"]), LIMIT);
    let before = run.report("before");
    assert_eq!(report_tids(&before).len(), 1);
    for who in ["main", "W"] {
        let line = run.line(&format!("CREATEFAIL {who}"));
        assert_eq!(field(&line, "rc"), field(&baseline, "rc"), "{line}");
        assert_eq!(field(&line, "failures"), "200", "{line}");
        assert_eq!(field(&line, "errno_kept"), "200", "{line}");
    }
    let (after, live, _) = run.phase_and_registry("after");
    assert_eq!(live.len(), 3, "main, W and C");
    assert_eq!(
        after.mask("C"),
        c.local,
        "creation still works after failures"
    );
    let end = run.succeed();
    never_says(&end.stdout, &["ERROR"]);
}

/// RLIMIT_NPROC: as root the limit is ignored, so the program drops to `nobody` (setresuid, after
/// the library loaded) with a limit of 16 tasks and creates threads until pthread_create fails.
/// The failure is EAGAIN with errno as glibc leaves it (checked against the same program without
/// the library), the registry holds exactly the threads that exist, and creation works again
/// once threads are joined.
#[test]
fn creation_failure_on_rlimit_nproc_as_nobody() {
    let sysfs = Sysfs::two_nodes();
    let bare = Driver::spawn(
        {
            let mut cmd = Command::new(life());
            cmd.arg("nproc");
            cmd
        },
        LIMIT,
    );
    let bare_line = {
        let mut bare = bare;
        let line = bare.line("NPROC");
        bare.proceed();
        bare.proceed();
        let _ = bare.finish();
        line
    };
    require!(
        !bare_line.contains("cannot drop privileges"),
        &format!("a way to drop privileges ({bare_line})"),
    );
    let mut run = Driver::spawn(life_cmd(&sysfs, &["nproc"]), LIMIT);
    let line = run.line("NPROC");
    assert_eq!(field(&line, "rc"), "11", "EAGAIN: {line}");
    assert_eq!(field(&line, "rc"), field(&bare_line, "rc"));
    assert_eq!(
        field(&line, "errno"),
        field(&bare_line, "errno"),
        "errno as without the library"
    );
    let made: usize = field(&line, "made").parse().unwrap();
    let (_, live, _) = run.phase_and_registry("limited");
    assert_eq!(live.len(), made + 2, "main, W and the threads made");
    let (recovered, _, _) = run.phase_and_registry("recovered");
    assert_eq!(recovered.role("late"), 0);
    run.succeed();
}

/// A fork from the host main thread and from a worker thread during a lease: each child holds
/// only the forking thread, with its role (tests/common/fork_exec.rs, shared with the aarch64
/// tier).
#[test]
fn a_fork_child_holds_only_the_forking_thread_with_its_role() {
    check_fork_children(&Native);
}

/// 300 forks while other threads create threads and configure: every child is well
/// (tests/common/fork_exec.rs).
#[test]
fn fork_while_other_threads_create_and_configure() {
    check_fork_storm(&Native);
}

/// exec during a lease, from the host main thread and from a worker thread: the new image starts
/// clean (tests/common/fork_exec.rs).
#[test]
fn exec_starts_the_new_image_clean() {
    check_exec(&Native);
}

/// dlopen of objects whose constructors start threads (and wait for them, inside the loader
/// lock): from a worker after configure the threads are workers on the worker mask; from the
/// host main thread they are hosts; from the host main thread again, an object matched by
/// TLLM_AFFINITY_WORKER_LIBS gives workers. Release restores the workers.
#[test]
fn dlopen_constructor_threads_take_the_role_of_the_loading_thread() {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let a = shared_object("dlopen_threads", "libdlopen_threads.so.2");
    let b = shared_object("dlopen_threads", "libdlopen_threads_b.so.2");
    let n = shared_object("dlopen_threads", "libdlopen_worker.so.2");
    let mut cmd = life_cmd(
        &sysfs,
        &[
            "dlopen",
            a.to_str().unwrap(),
            b.to_str().unwrap(),
            n.to_str().unwrap(),
        ],
    );
    cmd.env("TLLM_AFFINITY_WORKER_LIBS", "libdlopen_worker*");
    let mut run = Driver::spawn(cmd, LIMIT);
    let loaded = run.phase();
    for i in 0..3 {
        for (prefix, role, mask) in [("A", 1, &c.local), ("B", 0, &c.all), ("N", 1, &c.local)] {
            let t = format!("{prefix}{i}");
            assert_eq!(loaded.role(&t), role, "{t}");
            assert_eq!(&loaded.mask(&t), mask, "{t}");
        }
    }
    let live = task_tids(run.pid());
    run.proceed();
    let report = run.report("loaded");
    assert_eq!(report_tids(&report), live);
    let released = run.phase();
    for t in loaded.threads.keys() {
        assert_eq!(released.mask(t), c.all, "{t} after release");
    }
    run.succeed();
}

/// A shared object whose constructor starts a thread, loaded before the library in LD_PRELOAD,
/// after it (its constructor then runs before ours: the hook initialises the library lazily), and
/// linked into the program: no crash, no hang, the early thread is a host, configure works and
/// never touches it.
#[test]
fn a_thread_created_before_the_librarys_constructor_gets_a_role() {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let early = shared_object("constructor_thread", "libconstructor_thread.so.2");
    let dir = early.parent().unwrap().to_str().unwrap().to_string();
    let linked = Program::c("lifecycle_scenarios")
        .named("lifecycle_scenarios_early")
        .flags(&[
            &format!("-L{dir}"),
            "-Wl,--no-as-needed",
            "-l:libconstructor_thread.so.2",
            &format!("-Wl,-rpath,{dir}"),
        ])
        .build();
    let lib = library();
    let variants = [
        (
            "early object first in LD_PRELOAD",
            life(),
            format!("{}:{}", early.display(), lib.display()),
        ),
        (
            "library first in LD_PRELOAD",
            life(),
            format!("{}:{}", lib.display(), early.display()),
        ),
        ("linked into the program", linked, lib.display().to_string()),
    ];
    for (how, program, preload) in variants {
        let mut cmd = preloaded(program, &sysfs);
        cmd.env("LD_PRELOAD", &preload).arg("early");
        let mut run = Driver::spawn(cmd, LIMIT);
        let line = run.line("EARLY");
        assert_eq!(field(&line, "role"), "0", "{how}: {line}");
        let early_tid: i32 = field(&line, "tid").parse().unwrap();
        let load = run.report("load");
        assert_eq!(report_thread(&load, early_tid)["role"], "host", "{how}");
        let configured = run.phase();
        assert_eq!(configured.mask("early"), c.all, "{how}");
        assert_eq!(configured.mask("main"), c.all, "{how}");
        expect(&configured, Named(&["W", "C"]), on(&c.local), how);
        let live = task_tids(run.pid());
        run.proceed();
        let report = run.report("configured");
        assert_eq!(report_tids(&report), live, "{how}");
        let released = run.phase();
        expect(
            &released,
            Named(&["W", "C", "early", "main"]),
            on(&c.all),
            how,
        );
        let end = run.finish();
        assert!(end.status.success(), "{how}: {}", end.stderr);
        assert!(
            end.stderr
                .contains("for optimal NUMA-aware scheduling (1/1 threads)"),
            "{how}: {}",
            end.stderr
        );
    }
}

// ---- Rule 4: dedicated worker processes -------------------------------------------------

/// TLLM_AFFINITY_PROCESS_ROLE=worker: the main thread is a worker on the GPU-local set from the
/// first report, with one lease, and every thread after it too. The device is -1's: device 0 by
/// default, LOCAL_RANK=1 → device 1, TLLM_AFFINITY_GPU as a PCI address or an index.
#[test]
fn a_dedicated_worker_process_is_configured_at_load() {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let cases: [(&[(&str, &str)], &str); 5] = [
        (&[], &c.local),
        (&[("LOCAL_RANK", "1")], &c.other),
        (&[("LOCAL_RANK", "2")], &c.local),
        (&[("TLLM_AFFINITY_GPU", "0000:86:00.0")], &c.other),
        (&[("TLLM_AFFINITY_GPU", "1")], &c.other),
    ];
    for (vars, mask) in cases {
        let mut cmd = life_cmd(&sysfs, &["role"]);
        cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker")
            .envs(vars.iter().copied());
        let mut run = Driver::spawn(cmd, LIMIT);
        let load = run.report("load");
        let pid = run.pid() as i32;
        assert_eq!(report_thread(&load, pid)["role"], "worker", "{vars:?}");
        assert_eq!(kernel_mask_in(&load, pid), mask, "{vars:?}");
        assert_eq!(load["leases"].as_array().unwrap().len(), 1);
        let running = run.phase();
        expect(
            &running,
            Named(&["main", "T", "T1"]),
            worker_on(mask),
            "worker process",
        );
        let end = run.finish();
        assert!(end.status.success(), "{vars:?}: {}", end.stderr);
        never_says(&end.stderr, &["constrained"]);
    }

    // The same in Python (the real interpreter, not a wrapper script).
    let mut cmd = python_cmd(&sysfs, "worker_process_role.py", &[]);
    cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker")
        .env("LOCAL_RANK", "1");
    let end = run_bounded(cmd, LIMIT);
    assert!(end.status.success(), "{}", end.stderr);
    let line = end.stdout.lines().find(|l| l.starts_with("ROLE ")).unwrap();
    let v: Value = serde_json::from_str(&line[5..]).unwrap();
    let other: Vec<usize> = sysfs.node0.iter().collect();
    assert_eq!(v["main"], serde_json::json!(["worker", other]));
    assert_eq!(v["thread"], serde_json::json!(["worker", other]));
}

// ---- Rule 5: CUDA_VISIBLE_DEVICES end to end --------------------------------------------

/// configure(0) under CUDA_VISIBLE_DEVICES: `1` → GPU 1's CPUs; `1,0` with configure(1) → GPU 0;
/// a GPU UUID → one clear line, -ENODEV, no mask touched; TLLM_AFFINITY_CPUS overrides both.
#[test]
fn cuda_visible_devices_maps_configure_end_to_end() {
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let uuid = "GPU-8f3a2b1c-0d4e-5f60-7a8b-9c0d1e2f3a4b";
    // (CUDA_VISIBLE_DEVICES, TLLM_AFFINITY_CPUS, device, configure's answer, worker mask)
    let cases: [(&str, Option<&str>, &str, i64, &str); 6] = [
        ("1", None, "0", 1, &c.other),
        ("0", None, "0", 1, &c.local),
        ("1,0", None, "1", 1, &c.local),
        (uuid, None, "0", -19, &c.all),
        ("1", Some(&c.local), "0", 1, &c.local),
        (uuid, Some(&c.other), "0", 1, &c.other),
    ];
    for (visible, cpus_override, device, answer, mask) in cases {
        let case = format!("CUDA_VISIBLE_DEVICES={visible} TLLM_AFFINITY_CPUS={cpus_override:?}");
        let mut cmd = life_cmd(&sysfs, &["configure", device]);
        cmd.env("CUDA_VISIBLE_DEVICES", visible);
        if let Some(list) = cpus_override {
            cmd.env("TLLM_AFFINITY_CPUS", list);
        }
        let mut run = Driver::spawn(cmd, LIMIT);
        let line = run.line("CONFIGURE W");
        let lease: i64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert_eq!(lease.signum(), answer.signum(), "{case}: {line}");
        if answer < 0 {
            assert_eq!(lease, answer, "{case}");
        }
        let configured = run.phase();
        expect(&configured, Named(&["W", "C"]), on(mask), &case);
        assert_eq!(configured.mask("main"), c.all, "{case}");
        run.proceed();
        let report = run.report("configured");
        if answer < 0 {
            assert_eq!(report["leases"], serde_json::json!([]), "{case}");
        }
        let released = run.phase();
        expect(&released, Named(&["W", "C", "main"]), on(&c.all), &case);
        let end = run.finish();
        assert!(end.status.success(), "{case}: {}", end.stderr);
        if answer < 0 {
            let lines = lines_starting(&end.stderr, "[tllm-affinity]");
            assert_eq!(lines.len(), 1, "{case}: one line\n{}", end.stderr);
            assert!(lines[0].contains("CUDA_VISIBLE_DEVICES"), "{}", lines[0]);
            assert!(lines[0].contains(uuid), "{}", lines[0]);
            assert!(lines[0].contains("configure(0)"), "{}", lines[0]);
        }
    }
}

/// A host starts a worker-library routine and at once releases the only lease, whose sweep over
/// 1 000 worker threads holds the registry lock for milliseconds. The child moves itself onto the
/// worker mask before it takes the lock (the move can migrate it) and registers after the sweep:
/// it must be born as if after the release, back on the host mask, since no later release would
/// restore it. `raced=1` marks rounds where the child registered after the release began (its
/// routine started on the host mask); at least one must, or the race was not exercised.
#[test]
fn a_child_that_moved_while_a_release_swept_is_born_as_if_after_it() {
    require!(two_cpus("a worker mask narrower than the host mask"));
    let sysfs = Sysfs::two_nodes();
    let mut cmd = preloaded(Program::c("birth_during_release").build(), &sysfs);
    cmd.arg(worker_library()).args(["20", "1000"]);
    let end = run_bounded(cmd, LIMIT);
    assert!(end.status.success(), "{:?}\n{}", end.status, end.stderr);
    says(&end.stdout, &["DONE"]);
    let host = allowed_cpus();
    let mut raced = 0;
    for line in end.stdout.lines().filter(|l| l.starts_with("ROUND ")) {
        println!("{line}");
        assert_eq!(field(line, "role"), "1", "{line}");
        assert_eq!(
            mask(&field(line, "mask")),
            host,
            "left on the worker mask: {line}"
        );
        raced += usize::from(field(line, "raced") == "1");
    }
    assert!(raced > 0, "no round raced the release:\n{}", end.stdout);
}

/// A worker that sets its own mask as soon as `pthread_create` returned does not take its child
/// with it: the child was cloned on the worker mask, the library's choice, so the last release
/// puts it back on the launch mask, however late it registered after the worker's set.
#[test]
fn a_workers_own_mask_set_right_after_a_create_does_not_keep_its_child_from_being_restored() {
    let sysfs = Sysfs::two_nodes();
    let cpus = require!(cpus(&sysfs));
    let other_cpu = cpus.other.split([',', '-']).next().unwrap().to_string();
    let program = Program::c("own_mask_after_create").build();
    let mut cmd = preloaded(program, &sysfs);
    cmd.args(["50", &other_cpu]);
    let end = run_bounded(cmd, LIMIT);
    assert!(end.status.success(), "{:?}\n{}", end.status, end.stderr);
    says(&end.stdout, &["DONE"]);
    let mut raced = 0;
    for line in lines_starting(&end.stdout, "ROUND ") {
        assert_eq!(field(line, "role"), "1", "{line}");
        assert_eq!(
            field(line, "mask"),
            cpus.all,
            "left on the worker mask: {line}"
        );
        raced += usize::from(field(line, "raced") == "1");
    }
    assert!(
        raced > 0,
        "no round set the worker's mask before its child ran:\n{}",
        end.stdout
    );
}
