//! The host never hangs because of the library, whatever its other threads hold at a `fork`
//! (docs/reliability.md, "Locks and contexts"), checked the same way on every tier
//! (tests/process/never_hang.rs, tests/emulated/aarch64.rs). Each program runs for a few seconds, several
//! times, under a deadline; a run that does not finish fails with every thread's stack of every
//! process of its group (gdb), collected before the kill.
//!
//! - `fork_storm repro`: the reported hang. Two threads `dlopen`/`dlclose` plugins whose
//!   constructor and destructor create and join a thread (the loader's locks held), one creates
//!   threads, one configures and releases, one forks children that create a thread, one pins
//!   itself. A fork child used to classify its new thread with `dl_iterate_phdr` and wait
//!   forever on the loader lock the parent's `dlopen` held at the fork.
//! - `fork_storm storm`: the same, with a thread inside `dl_iterate_phdr`, `vfork`/`_Fork`/
//!   `posix_spawn` children that only exec or `_exit`, fork children that fork again, signals
//!   whose handler calls the interposed `sched_setaffinity`, and `exit` with every thread running.
//! - `handler_fork`: one thread, a `SIGALRM` handler forking every 200 µs while the thread is in
//!   the library's `sched_setaffinity` shim, holding the registry lock: the fork handlers must not
//!   wait for a lock the interrupted thread holds.
//! - `py_fork_storm.py`: the Python form (ctypes loads, extension imports, `os.fork` and
//!   `multiprocessing`'s fork start method with a thread in each child).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::tier::Tier;
use super::*;

/// The plugin, under two names so that each loader's `dlclose` really unloads its copy.
fn plugins(tier: &dyn Tier) -> [PathBuf; 2] {
    ["libstorm_plugin_a.so", "libstorm_plugin_b.so"]
        .map(|name| tier.shared_object("storm_plugin", name))
}

/// Runs `cmd` `runs` times, each within `limit`; each must exit 0 and print its `tag` line.
/// Returns the lines and the seconds each run took.
fn every_run_finishes(
    make: impl Fn() -> Command,
    tag: &str,
    runs: usize,
    limit: Duration,
) -> Vec<(String, f64)> {
    (0..runs)
        .map(|i| {
            let started = Instant::now();
            let mut run = Driver::spawn(make(), limit);
            let line = run.line(tag);
            let end = run.finish();
            assert!(
                end.status.success(),
                "run {i}: {}\n{line}\n{}",
                end.status,
                end.stderr
            );
            let seconds = started.elapsed().as_secs_f64();
            println!("run {i}: {seconds:.1} s: {line}");
            (line, seconds)
        })
        .collect()
}

/// `fork_storm` (`program`, this tier's build of it) in `mode` for `seconds`, four times, each
/// within `limit`: its STORM lines.
fn four_storms(
    tier: &dyn Tier,
    program: &Path,
    mode: &str,
    seconds: &str,
    limit: Duration,
) -> Vec<String> {
    let sysfs = Sysfs::two_nodes();
    let [a, b] = plugins(tier);
    let make = || {
        let mut cmd = tier.preloaded(program, &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", "warn")
            .args([mode, seconds])
            .args([&a, &b]);
        cmd
    };
    every_run_finishes(make, "STORM", 4, tier.limit(limit))
        .into_iter()
        .map(|(line, _)| line)
        .collect()
}

fn count(line: &str, key: &str) -> u64 {
    field(line, key).parse().unwrap()
}

/// The reported hang, four times: every run finishes, with forks and loads, and every fork
/// child exited 0.
pub fn check_fork_child_never_waits_for_the_loader_lock(tier: &dyn Tier, fork_storm: &Path) {
    for line in four_storms(tier, fork_storm, "repro", "2", Duration::from_secs(40)) {
        assert!(count(&line, "forks") > 10, "{line}");
        assert!(count(&line, "loads") > 10, "{line}");
        assert_eq!(count(&line, "children_bad"), 0, "{line}");
    }
}

/// The storm, four times: every run finishes, having done each of its things, and every child
/// exited 0.
pub fn check_storm_always_finishes(tier: &dyn Tier, fork_storm: &Path) {
    for line in four_storms(tier, fork_storm, "storm", "3", Duration::from_secs(50)) {
        for key in [
            "forks",
            "loads",
            "creates",
            "cycles",
            "iterations",
            "vforks",
            "underscore_forks",
            "spawns",
            "signals",
        ] {
            assert!(count(&line, key) > 0, "no {key}: {line}");
        }
        assert_eq!(count(&line, "children_bad"), 0, "{line}");
    }
}

/// The Python storm, three times: every run finishes, with forks and processes, none bad.
pub fn check_python_fork_children_finish(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let [a, b] = plugins(tier);
    for (line, _) in every_run_finishes(
        || {
            let mut cmd = tier.preloaded(&tier.python(), &sysfs);
            cmd.env("TLLM_AFFINITY_LOG", "warn")
                .arg(programs_dir().join("py_fork_storm.py"))
                .arg("3")
                .args([&a, &b]);
            cmd
        },
        "PYSTORM",
        3,
        tier.limit(Duration::from_secs(60)),
    ) {
        assert!(
            count(&line, "forks") > 0 && count(&line, "processes") > 0,
            "{line}"
        );
        assert_eq!(count(&line, "bad"), 0, "{line}");
    }
}

/// `handler_fork` once: it finishes, having forked from its handler many times, every fork
/// answered. Returns its HANDLERFORK line.
pub fn check_a_handler_forking_inside_the_library_finishes(tier: &dyn Tier) -> String {
    let sysfs = Sysfs::two_nodes();
    let program = tier.program("handler_fork");
    let make = || {
        let mut cmd = tier.preloaded(&program, &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", "warn").arg("2000");
        cmd
    };
    let (line, _) =
        every_run_finishes(make, "HANDLERFORK", 1, tier.limit(Duration::from_secs(60))).remove(0);
    assert!(count(&line, "forks") > 20, "the handler forked: {line}");
    assert_eq!(count(&line, "failed"), 0, "{line}");
    line
}
