//! The engine under hostile loading (SPEC §2, §9): objects unloaded and others mapped in their
//! place, plugins loaded and unloaded thousands of times, and two copies of the library in one
//! process. Real processes, the real library preloaded, masks read from the kernel.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

/// The worker-library glob the tests set: it names the first build of the plugin only.
const WORKER_GLOB: &str = "libreload_worker*";

/// tests/programs/reload_plugin.c built as `name` (its soname too).
fn plugin(name: &str) -> PathBuf {
    Program::c("reload_plugin")
        .shared()
        .named(name)
        .flags(&[&format!("-Wl,-soname,{name}")])
        .build()
}

/// A worker library unloaded and a host library mapped at its address: a thread started from
/// the new object is classified by the new object, not by what used to be there. With a lease
/// open (W configured) and the main thread a host, a wrong "worker" answer would move it onto
/// the worker mask.
#[test]
fn a_host_library_loaded_where_a_worker_library_was_starts_host_threads() {
    let sysfs = Sysfs::two_nodes();
    require!(two_cpus("a worker mask narrower than the host"));
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let worker = plugin("libreload_worker.so.2");
    let hosted = plugin("libreload_hosted.so.2");
    let mut cmd = preloaded(Program::c("reload_same_address").build(), &sysfs);
    cmd.env("TLLM_AFFINITY_WORKER_LIBS", WORKER_GLOB)
        .arg(&worker)
        .arg(&hosted);
    let mut run = Driver::spawn(cmd, LIMIT);

    let first = run.phase();
    println!("{}", describe(&first));
    assert_eq!(first.role("W"), 1, "W configured");
    assert_eq!(
        (first.role("P1"), first.mask("P1")),
        (1, local.clone()),
        "P1, started in the worker library"
    );
    assert_eq!((first.role("main"), first.mask("main")), (0, all.clone()));
    run.proceed();

    let address = run.line("ADDRESS ");
    println!("{address}");
    let reloaded = run.phase();
    println!("{}", describe(&reloaded));
    assert_eq!(
        (reloaded.role("P2"), reloaded.mask("P2")),
        (0, all.clone()),
        "P2, started by a host from a library that is no worker library ({address})"
    );
    assert_eq!((reloaded.role("main"), reloaded.mask("main")), (0, all));
    assert_eq!(reloaded.mask("W"), local, "the lease stays open");
    run.succeed();
}

/// Thousands of load / thread / unload cycles of a plugin that lands at a new address each time:
/// the heap in use (mallinfo2, inside the process) after 5000 cycles is what it was after 200.
/// Without reclamation every rescan of the loaded objects kept its snapshot (about 260 bytes).
#[test]
fn plugins_loaded_and_unloaded_thousands_of_times_leave_the_heap_flat() {
    let sysfs = Sysfs::two_nodes();
    let worker = plugin("libreload_worker.so.2");
    let mut cmd = preloaded(Program::c("reload_cycles").build(), &sysfs);
    cmd.env("TLLM_AFFINITY_WORKER_LIBS", WORKER_GLOB)
        .arg(&worker)
        .args(["200", "5000"]);
    let end = run_bounded(cmd, LIMIT);
    assert!(end.status.success(), "{}", end.stderr);
    let line = end
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("HEAP "))
        .unwrap_or_else(|| panic!("no HEAP line: {}", end.stdout));
    println!("{line}");
    let words: Vec<&str> = line.split_whitespace().collect();
    let (warm, last): (usize, usize) = (words[1].parse().unwrap(), words[3].parse().unwrap());
    let moved: usize = field(line, "moved").parse().unwrap();
    assert!(
        moved > 4000,
        "the plugin must land at new addresses: {line}"
    );
    // 4800 more cycles: a leak of even 8 bytes a cycle shows as 38 KiB.
    assert!(
        last <= warm + 16 * 1024,
        "the heap grew from {warm} to {last} bytes over 4800 cycles: {line}"
    );
}

/// The mixed population of tests/process/engine_population.rs, run with the library preloaded once and
/// with two copies of it (the same file under two paths) preloaded by hand.
fn population(sysfs: &Sysfs, preload: &str) -> (Vec<Phase>, Finished, usize) {
    let program = Program::c("population").build();
    let nccl = Program::c("nccl").shared().build();
    let mut cmd = preloaded(program, sysfs);
    cmd.env("LD_PRELOAD", preload)
        .env("FAKE_NCCL", nccl)
        .arg("0");
    let mut run = Driver::spawn(cmd, DEADLINE);
    let mut phases = Vec::new();
    let mut tables = 0;
    for i in 0..5 {
        phases.push(run.phase());
        if i == 1 {
            let name = tllm_affinity_core::table::threadtable::file_name(
                run.pid(),
                tllm_affinity_core::table::threadtable::pid_namespace(std::path::Path::new(
                    "/proc/self",
                ))
                .unwrap(),
            );
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", run.pid())).unwrap();
            tables = maps.lines().filter(|l| l.ends_with(&name)).count();
        }
        run.proceed();
    }
    (phases, run.finish(), tables)
}

/// Two copies of the library preloaded: the first in the search order acts, the other stays
/// inert. Roles and masks are exactly those of one copy, with one configure line and one table.
#[test]
fn two_copies_of_the_library_act_as_one() {
    let sysfs = Sysfs::two_nodes();
    require!(two_cpus("a worker mask narrower than the host"));
    let lib = library();
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("libtllm_affinity.so");
    std::fs::copy(&lib, &copy).unwrap();

    let (one, one_end, one_tables) = population(&sysfs, lib.to_str().unwrap());
    assert!(one_end.status.success(), "{}", one_end.stderr);
    let both = format!("{}:{}", lib.display(), copy.display());
    let (two, two_end, two_tables) = population(&sysfs, &both);
    assert!(two_end.status.success(), "{}", two_end.stderr);

    for (a, b) in one.iter().zip(&two) {
        println!("one copy   {}\ntwo copies {}", describe(a), describe(b));
        assert_eq!(
            a.threads.keys().collect::<Vec<_>>(),
            b.threads.keys().collect::<Vec<_>>(),
            "phase {}",
            a.name
        );
        for (name, seen) in &a.threads {
            let other = b.thread(name);
            assert_eq!(
                (seen.role, &seen.mask),
                (other.role, &other.mask),
                "{name} in phase {} (one copy, then two)",
                a.name
            );
        }
    }
    let configured = |stderr: &str| stderr.matches("CPU affinity set to").count();
    assert_eq!(configured(&one_end.stderr), 1, "{}", one_end.stderr);
    assert_eq!(
        configured(&two_end.stderr),
        1,
        "one configure line with two copies:\n{}",
        two_end.stderr
    );
    let lines = |stderr: &str| stderr.matches("[tllm-affinity]").count();
    assert_eq!(
        lines(&two_end.stderr),
        lines(&one_end.stderr),
        "the second copy says nothing:\none copy:\n{}\ntwo copies:\n{}",
        one_end.stderr,
        two_end.stderr
    );
    assert_eq!(one_tables, 1, "one copy maps one thread table");
    assert_eq!(
        two_tables, 1,
        "two copies map one thread table between them"
    );
}
