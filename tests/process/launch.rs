//! Across a launch (SPEC §2, §12): what a process under the library hands to the programs it
//! starts, on real process trees — Python's `subprocess` and `os.posix_spawn` from a worker
//! thread, shell wrappers, `env`, `timeout`, `taskset` — with the real library preloaded.
//!
//! The simulated host (`Sysfs::two_nodes`) puts device 0's worker mask on node1 = {1}; the
//! launch mask is every allowed CPU.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(60);

fn script() -> String {
    programs_dir()
        .join("launch_children.py")
        .display()
        .to_string()
}

fn with_module(mut cmd: Command) -> Command {
    cmd.env(
        "PYTHONPATH",
        Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
    );
    cmd
}

fn child_line(out: &str) -> Value {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("CHILD "))
        .unwrap_or_else(|| panic!("no CHILD line in {out}"));
    serde_json::from_str(line).unwrap()
}

/// A program a worker thread starts — with `subprocess`, `os.posix_spawn`, or through
/// `sh -c 'exec ...'` — is born on the worker mask, but judges "constrained" on the mask the
/// launch was given: not constrained, no "Removing CPU affinity constraints", and its own
/// workers get the GPU-local set.
#[test]
fn a_workers_child_judges_constrained_on_the_launch_mask() {
    let sysfs = Sysfs::two_nodes();
    require!(two_cpus("a worker mask narrower than the launch mask"));
    let all = allowed_cpus().to_list();
    for how in ["worker-subprocess", "worker-posix-spawn", "worker-sh-exec"] {
        let mut cmd = with_module(preloaded(python(), &sysfs));
        cmd.args([&script(), how]);
        let out = Driver::spawn(cmd, LIMIT).finish();
        assert!(out.status.success(), "{how}: {}", out.stderr);
        let child = child_line(&out.stdout);
        assert_eq!(
            child["constrained"], false,
            "{how}: {child}\n{}",
            out.stderr
        );
        assert_eq!(child["mask_at_load"], all.as_str(), "{how}: {child}");
        for false_warning in ["is affined to run on", "Removing CPU affinity constraints"] {
            assert!(
                !out.stderr.contains(false_warning),
                "{how}: {false_warning:?} in\n{}",
                out.stderr
            );
        }
        assert!(
            out.stderr.contains(&format!(
                "CPU affinity set to [{}] for optimal NUMA-aware scheduling",
                sysfs.node1.to_list()
            )),
            "{how}: the child's workers got the GPU-local set\n{}",
            out.stderr
        );
    }
}

/// A child started by a host thread of a process launched under `taskset` is on the launcher's
/// mask: it is constrained, as its parent is.
#[test]
fn a_hosts_child_under_taskset_is_still_constrained() {
    let sysfs = Sysfs::two_nodes();
    require!(two_cpus("a taskset narrower than the cpuset"));
    let first = allowed_cpus().first().unwrap().to_string();
    let mut cmd = with_module(preloaded("taskset", &sysfs));
    cmd.args(["-c", &first])
        .arg(python())
        .args([&script(), "host-subprocess"]);
    let out = Driver::spawn(cmd, LIMIT).finish();
    assert!(out.status.success(), "{}", out.stderr);
    let child = child_line(&out.stdout);
    assert_eq!(child["constrained"], true, "{child}\n{}", out.stderr);
    assert_eq!(child["mask_at_load"], first.as_str());
}

fn library_lines(stderr: &str, about: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.starts_with("[tllm-affinity]") && l.contains(about))
        .count()
}

/// A malformed setting is reported by the first process of a launch and at `debug` by the
/// programs after it — through nested shells, `env` and `timeout` — and every process still
/// acts on it (passive, or exit status 2 under TLLM_AFFINITY_STRICT=1).
#[test]
fn a_bad_setting_is_reported_once_per_launch() {
    let sysfs = Sysfs::two_nodes();
    let chains: [&[&str]; 3] = [
        &["sh", "-c", "sh -c 'sh -c true; true'; true"],
        &["env", "env", "env", "sh", "-c", "true"],
        &["timeout", "30", "sh", "-c", "sh -c true; true"],
    ];
    for chain in chains {
        let mut cmd = preloaded(chain[0], &sysfs);
        cmd.args(&chain[1..])
            .env("TLLM_AFFINITY_POLICY", "sometimes");
        let out = Driver::spawn(cmd, LIMIT).finish();
        assert!(out.status.success(), "{chain:?}: {}", out.stderr);
        assert_eq!(
            library_lines(&out.stderr, "TLLM_AFFINITY_POLICY"),
            1,
            "{chain:?}:\n{}",
            out.stderr
        );
    }
    let mut strict = preloaded("sh", &sysfs);
    strict
        .args(["-c", "echo not reached"])
        .env("TLLM_AFFINITY_POLICY", "sometimes")
        .env("TLLM_AFFINITY_STRICT", "1");
    let out = Driver::spawn(strict, LIMIT).finish();
    assert_eq!(out.status.code(), Some(2), "{}", out.stderr);
    assert!(!out.stdout.contains("not reached"));
}

/// `TLLM_AFFINITY_REPORT` under a wrapper that exits after the program (`sh -c 'python ...;
/// true'`, `timeout`): the report is the program's, not the wrapper's.
#[test]
fn the_report_belongs_to_the_program_not_its_wrapper() {
    let sysfs = Sysfs::two_nodes();
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let app = format!("{} {} app", python().display(), script());
    let wrappers: [Vec<String>; 2] = [
        vec!["sh".into(), "-c".into(), format!("{app}; true")],
        vec![
            "timeout".into(),
            "60".into(),
            python().display().to_string(),
            script(),
            "app".into(),
        ],
    ];
    for wrapper in wrappers {
        let _ = std::fs::remove_file(&report);
        let mut cmd = with_module(preloaded(&wrapper[0], &sysfs));
        cmd.args(&wrapper[1..]).env("TLLM_AFFINITY_REPORT", &report);
        let out = Driver::spawn(cmd, LIMIT).finish();
        assert!(out.status.success(), "{wrapper:?}: {}", out.stderr);
        let app_pid: u64 = out
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("APP "))
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("{wrapper:?}: {}", out.stdout));
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        assert_eq!(written["pid"], app_pid, "{wrapper:?}: {written}");
        assert!(written["threads_created"].as_u64().unwrap() >= 1);
    }
    // A program alone that never used the library still writes its own report.
    let _ = std::fs::remove_file(&report);
    let mut alone = preloaded("true", &sysfs);
    alone.env("TLLM_AFFINITY_REPORT", &report);
    assert!(Driver::spawn(alone, LIMIT).finish().status.success());
    assert!(report.exists());
}

/// `fork_without_handlers <mode>` under the library on a two-node host (which it returns, to
/// outlive the run), its table in `/dev/shm`: its child is made by `_Fork()`.
fn without_handlers(mode: &str) -> Result<(Sysfs, Driver), String> {
    if !Path::new("/dev/shm").is_dir() {
        return Err("/dev/shm".into());
    }
    let sysfs = Sysfs::two_nodes();
    let mut cmd = preloaded(Program::c("fork_without_handlers").build(), &sysfs);
    cmd.arg(mode);
    let run = Driver::spawn(cmd, LIMIT);
    Ok((sysfs, run))
}

/// A child made by `_Fork()` (no fork handlers) that exits through `exit()` runs the exit
/// handlers it inherited: the parent's thread table stays.
#[test]
fn a_child_that_skipped_the_fork_handlers_leaves_the_parents_table() {
    let (_sysfs, mut run) = require!(without_handlers("exit"));
    let line = run.line("TABLE");
    says(&line, &["before=1", "after=1"]);
    run.succeed();
}

/// A child made by `_Fork()` that creates a thread starts as a fork child then: its thread is
/// in no record of the parent's table, which the child still has mapped.
#[test]
fn a_child_that_skipped_the_fork_handlers_never_writes_the_parents_table() {
    let (_sysfs, mut run) = require!(without_handlers("thread"));
    let child = run.line("CHILD");
    let child_thread: i32 = child.split_whitespace().nth(2).unwrap().parse().unwrap();
    let table = run.line("TABLE");
    let path = table.split_whitespace().nth(1).unwrap().to_string();
    let bytes = std::fs::read(&path).unwrap();
    let tids: Vec<i32> = bytes[tllm_affinity_core::table::threadtable::HEADER_BYTES..]
        .chunks_exact(8)
        .filter_map(|c| {
            tllm_affinity_core::table::threadtable::decode(u64::from_le_bytes(
                c.try_into().unwrap(),
            ))
        })
        .map(|(tid, _, _)| tid)
        .collect();
    assert!(
        !tids.contains(&child_thread),
        "the child's thread {child_thread} is in the parent's table: {tids:?}"
    );
    let parent = task_tids(run.pid());
    assert!(
        tids.iter().all(|t| parent.contains(t)),
        "{tids:?} vs {parent:?}"
    );
    run.succeed();
}
