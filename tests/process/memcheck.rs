//! Issue #7, valgrind memcheck over the integration programs with the real library preloaded:
//! the population program of tests/programs/population.c and the lifecycle programs (creation
//! failure, every way out of a thread, fork, dlopen'd constructors, explicit masks, observed
//! setaffinity calls, a short stress). No memcheck error, no definite leak, and in particular no
//! error whose stack has a libtllm_affinity frame.
//!
//! Also, without valgrind: threads the library starts allocate nothing, so none of them gets a
//! malloc arena a bare thread would not have (issue 6).
//!
//! `LD_PRELOAD=<lib> valgrind ... <program>`: valgrind adds its own preloads to the client's, so
//! the library is loaded into the program under memcheck; every run checks that it was active
//! (roles non-negative, report state "active").

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

fn valgrind_available() -> bool {
    Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The program under memcheck, the library preloaded, one log file per process in `logs`.
fn memcheck(program: &Path, args: &[&str], sysfs: &Sysfs, logs: &Path) -> Command {
    let mut cmd = preloaded("valgrind", sysfs);
    cmd.args([
        "--tool=memcheck",
        "--error-exitcode=99",
        "--leak-check=full",
        "--errors-for-leak-kinds=definite",
        "--show-leak-kinds=definite",
        "--num-callers=40",
        "--child-silent-after-fork=no",
    ])
    .arg(format!("--log-file={}/vg.%p.log", logs.display()))
    .arg(program)
    .args(args);
    cmd
}

struct Verdict {
    logs: usize,
    errors: u64,
    ours: Vec<String>,
    definitely_lost: Vec<String>,
}

/// Reads every valgrind log: error counts, error blocks naming our library, definite leaks.
fn verdict(logs: &Path) -> Verdict {
    let mut v = Verdict {
        logs: 0,
        errors: 0,
        ours: Vec::new(),
        definitely_lost: Vec::new(),
    };
    for entry in std::fs::read_dir(logs).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        v.logs += 1;
        for line in text.lines() {
            if let Some(rest) = line.split("ERROR SUMMARY: ").nth(1) {
                v.errors += rest
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
            }
            if line.contains("definitely lost:") && !line.contains("definitely lost: 0 bytes") {
                v.definitely_lost.push(line.to_string());
            }
        }
        // Error blocks are separated by lines holding only "==pid== ".
        let mut block = String::new();
        for line in text.lines() {
            let body = line.split_once("== ").map_or("", |(_, b)| b);
            if body.trim().is_empty() {
                let is_error = !block.contains("LEAK SUMMARY")
                    && !block.contains("HEAP SUMMARY")
                    && !block.contains("Memcheck, a memory error detector")
                    && !block.contains("still reachable")
                    && !block.contains("possibly lost in loss record")
                    && block.contains("at 0x");
                if is_error && block.contains("libtllm_affinity") {
                    v.ours.push(block.clone());
                }
                block.clear();
            } else {
                block.push_str(line);
                block.push('\n');
            }
        }
    }
    v
}

fn life() -> PathBuf {
    Program::c("lifecycle_scenarios").build()
}

fn check(name: &str, end: &Finished, logs: &Path) -> Verdict {
    let v = verdict(logs);
    println!(
        "memcheck {name}: {} process log(s), {} errors, {} from libtllm_affinity, {} definite leaks",
        v.logs,
        v.errors,
        v.ours.len(),
        v.definitely_lost.len()
    );
    assert!(v.logs > 0, "{name}: no valgrind log: {}", end.stderr);
    assert!(
        v.ours.is_empty(),
        "{name}: errors in our code:\n{}",
        v.ours.join("\n")
    );
    assert_eq!(
        v.errors,
        0,
        "{name}: memcheck errors, see the logs:\n{}",
        logs_text(logs)
    );
    assert!(
        v.definitely_lost.is_empty(),
        "{name}: {:?}",
        v.definitely_lost
    );
    assert_ne!(end.status.code(), Some(99), "{name}: valgrind's error exit");
    assert!(
        end.status.success(),
        "{name}: {:?}\n{}",
        end.status,
        end.stderr
    );
    v
}

fn logs_text(logs: &Path) -> String {
    std::fs::read_dir(logs)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every PHASE line's roles are non-negative: the library answered, so it was loaded and active.
fn assert_active(name: &str, stdout: &str) {
    let mut roles = 0;
    for line in stdout.lines().filter(|l| l.starts_with("PHASE ")) {
        for word in line.split_whitespace().skip(2) {
            let role: i32 = word.rsplit(':').next().unwrap().parse().unwrap();
            // A thread that has exited since it was noted answers -ENOENT.
            assert!(role >= 0 || role == -2, "{name}: {line}");
            roles += usize::from(role >= 0);
        }
    }
    assert!(roles > 0, "{name}: the library never answered:\n{stdout}");
    assert!(
        !stdout.contains("\"state\":\"passive\"") && !stdout.contains("REPORT before null"),
        "{name}: {stdout}"
    );
}

#[test]
fn the_population_program_is_clean_under_memcheck() {
    require!(valgrind_available(), "valgrind");
    let sysfs = Sysfs::two_nodes();
    let logs = tempfile::tempdir().unwrap();
    let program = Program::c("population").build();
    let mut cmd = memcheck(&program, &["0"], &sysfs, logs.path());
    cmd.env("FAKE_NCCL", Program::c("nccl").shared().build());
    let end = Driver::spawn(cmd, LIMIT).answer_all();
    assert_active("population", &end.stdout);
    assert!(
        end.stderr.contains("restored 11 threads"),
        "the library placed and restored under valgrind:\n{}",
        end.stderr
    );
    check("population", &end, logs.path());
}

#[test]
fn the_lifecycle_programs_are_clean_under_memcheck() {
    require!(valgrind_available(), "valgrind");
    let sysfs = Sysfs::two_nodes();
    let cpu = sysfs.node0.first().unwrap_or(0).to_string();
    let so = |name: &str| Program::c("dlopen_threads").shared().named(name).build();
    let (a, b, n) = (
        so("libdlopen_threads.so.2"),
        so("libdlopen_threads_b.so.2"),
        so("libdlopen_worker.so.2"),
    );
    let dl = [
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        n.to_str().unwrap(),
    ];
    let runs: Vec<(&str, Vec<&str>)> = vec![
        ("createfail", vec!["createfail", "100"]),
        ("exits", vec!["exits"]),
        ("fork", vec!["fork"]),
        ("dlopen", vec!["dlopen", dl[0], dl[1], dl[2]]),
        ("explicit", vec!["explicit", &cpu]),
        ("observe", vec!["observe", &cpu]),
    ];
    for (name, args) in runs {
        let logs = tempfile::tempdir().unwrap();
        let mut cmd = memcheck(&life(), &args, &sysfs, logs.path());
        cmd.env("TLLM_AFFINITY_WORKER_LIBS", "libdlopen_worker*");
        let end = Driver::spawn(cmd, LIMIT).answer_all();
        assert_active(name, &end.stdout);
        if name == "createfail" {
            // The creation failures really happened under valgrind, errno untouched.
            says(
                &end.stdout,
                &["CREATEFAIL W rc=22 failures=100 errno_kept=100"],
            );
        }
        if name == "fork" {
            says(&end.stdout, &["FORKED W status=0"]);
        }
        check(name, &end, logs.path());
    }
}

#[test]
fn a_short_stress_is_clean_under_memcheck() {
    require!(valgrind_available(), "valgrind");
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus();
    require!(two_cpus("this test"));
    let logs = tempfile::tempdir().unwrap();
    let program = Program::c("churn_stress").build();
    let worker_lib = worker_library();
    let worker = sysfs.node1.to_list();
    let host = all.to_list();
    let mut cmd = memcheck(
        &program,
        &["400", "20", &worker, &host, worker_lib.to_str().unwrap()],
        &sysfs,
        logs.path(),
    );
    cmd.env("TLLM_AFFINITY_LOG", "warn");
    let end = Driver::spawn(cmd, LIMIT).answer_all();
    let line = end
        .stdout
        .lines()
        .find(|l| l.starts_with("STRESS"))
        .unwrap_or_else(|| panic!("{}\n{}", end.stdout, end.stderr))
        .to_string();
    println!("{line}");
    for k in ["violations", "pin_violations", "worker_violations"] {
        assert_eq!(field(&line, k), "0", "{line}\n{}", end.stderr);
    }
    assert!(field(&line, "cycles").parse::<u64>().unwrap() > 0, "{line}");
    assert!(end.stdout.contains("\"state\":\"active\""));
    check("stress", &end, logs.path());
}

/// A bare thread that never allocates has no malloc cache and no arena. Under the library the
/// creator hands over and recycles the start packet and reserves the registry's room, so the
/// new thread's registration, placement and exit allocate nothing either, on every path. Before
/// this was fixed each new thread freed its packet and got an arena of its own here.
#[test]
fn threads_the_library_starts_allocate_nothing_and_get_no_malloc_arena() {
    require!(two_cpus("the apply path"));
    let sysfs = Sysfs::two_nodes();
    let program = Program::c("malloc_arenas").build();
    let worker_lib = worker_library();
    let all = allowed_cpus().to_list();
    let gpu = sysfs.gpu0_local().to_list();
    for under_library in [false, true] {
        let mut cmd = if under_library {
            preloaded(&program, &sysfs)
        } else {
            clean(&program)
        };
        cmd.arg(&worker_lib);
        let end = run_bounded(cmd, LIMIT);
        assert!(end.status.success(), "{:?}\n{}", end.status, end.stderr);
        println!("library {under_library}:\n{}", end.stdout);
        let arenas: Vec<usize> = end
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("ARENAS "))
            .expect("ARENAS line")
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect();
        assert_eq!(
            arenas[1], arenas[0],
            "36 live children added malloc arenas (library {under_library})"
        );
        let children: Vec<(&str, &str, &str)> = end
            .stdout
            .lines()
            .filter_map(|l| l.strip_prefix("CHILD "))
            .map(|l| {
                let mut w = l.split_whitespace();
                (w.next().unwrap(), w.next().unwrap(), w.next().unwrap())
            })
            .collect();
        assert_eq!(children.len(), 36);
        for (path, role, mask) in children {
            let expected = match (under_library, path) {
                (false, _) => ("-1", all.as_str()),
                (true, "host") => ("0", all.as_str()),
                (true, _) => ("1", gpu.as_str()),
            };
            let mask = common::mask(mask).to_list();
            assert_eq!(
                (role, mask.as_str()),
                expected,
                "a {path} child, library {under_library}"
            );
        }
    }
}
