//! The device variables set after load (SPEC §4): real Python (`tests/programs/dv_follow.py`)
//! with the real library preloaded sets `CUDA_VISIBLE_DEVICES` and `LOCAL_RANK` through
//! `os.environ` (libc `setenv`/`unsetenv`) from a thread other than the main one, as Ray does in an
//! actor; every mask is read from `/proc/<pid>/task/<tid>/status`.
//!
//! The simulated host (`Sysfs::two_nodes`): GPU 0 is local to node1 = {1} ("gpu0"), GPU 1 to
//! node0 = {0} ("gpu1"); host threads stay on every CPU ("all").

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

/// The masks of the simulated host (GPU 0's local set, GPU 1's the other node's); the error
/// (for `require!`) on a host with one CPU.
/// A two-node host whose two GPUs have different local CPUs, and its CPUs.
fn two_gpus_host() -> Result<(Sysfs, HostCpus), String> {
    let sysfs = Sysfs::two_nodes();
    let cpus = sysfs.cpus("two GPUs with different local CPUs")?;
    Ok((sysfs, cpus))
}

fn follow_cmd(sysfs: &Sysfs, steps: &[&str]) -> Command {
    let mut cmd = preloaded(python(), sysfs);
    cmd.arg(program("dv_follow.py"))
        .args(steps)
        .env("PYTHONPATH", repo().join("python"))
        .env_remove("MV2_COMM_WORLD_LOCAL_RANK")
        .env_remove("MPI_LOCALRANKID")
        .env_remove("CUDA_DEVICE_ORDER");
    cmd
}

/// Runs the steps and returns each phase (the load phase first) and the stderr.
fn run_steps(cmd: Command, steps: usize) -> (Vec<Phase>, String) {
    let mut run = Driver::spawn(cmd, LIMIT);
    let mut phases = Vec::new();
    for _ in 0..=steps {
        let phase = run.phase();
        println!("{}", describe(&phase));
        phases.push(phase);
        run.proceed();
    }
    let end = run.finish();
    assert!(end.status.success(), "{:?}\n{}", end.status, end.stderr);
    says(&end.stdout, &["DONE"]);
    (phases, end.stderr)
}

/// A dedicated worker process (`TLLM_AFFINITY_PROCESS_ROLE=worker`) is configured at load for
/// device 0 (no variable names another), then follows what the program assigns: every worker
/// thread — the main thread, threads started before the change, threads started after — moves to
/// the GPU the variables now name, at the assignment: `CUDA_VISIBLE_DEVICES=1` → GPU 1, `1,0` →
/// still GPU 1 (device 0 of that list), unset → GPU 0 again, `LOCAL_RANK=1` → GPU 1. The log
/// says "retargeting" for each move, and never "constrained".
#[test]
fn a_dedicated_worker_follows_the_device_variables_set_after_load() {
    let (sysfs, c) = require!(two_gpus_host());
    let steps = [
        "set:CUDA_VISIBLE_DEVICES=1",
        "set:CUDA_VISIBLE_DEVICES=1,0",
        "del:CUDA_VISIBLE_DEVICES",
        "set:LOCAL_RANK=1",
    ];
    let mut cmd = follow_cmd(&sysfs, &steps);
    cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker");
    let (phases, stderr) = run_steps(cmd, steps.len());
    let expected = [&c.local, &c.other, &c.other, &c.local, &c.other];
    for (phase, mask) in phases.iter().zip(expected) {
        expect(
            phase,
            All,
            worker_on(mask),
            &format!("stderr:\n{}", &stderr),
        );
    }
    assert_eq!(
        stderr
            .matches("retargeting worker threads from 0000:3b:00.0 to 0000:86:00.0")
            .count(),
        2,
        "{stderr}"
    );
    says(
        &stderr,
        &["retargeting worker threads from 0000:86:00.0 to 0000:3b:00.0"],
    );
    never_says(&stderr, &["constrained"]);
}

/// A dedicated worker whose program released the load-time lease has taken placement into its
/// own hands: a later assignment moves nothing (the masks are restored and stay so).
#[test]
fn a_dedicated_worker_that_released_its_lease_no_longer_follows() {
    let (sysfs, c) = require!(two_gpus_host());
    let steps = ["release", "set:CUDA_VISIBLE_DEVICES=1"];
    let mut cmd = follow_cmd(&sysfs, &steps);
    cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker");
    let (phases, stderr) = run_steps(cmd, steps.len());
    expect(
        &phases[0],
        All,
        worker_on(&c.local),
        &format!("stderr:\n{}", &stderr),
    );
    expect(
        &phases[1],
        All,
        worker_on(&c.all),
        &format!("stderr:\n{}", &stderr),
    );
    expect(
        &phases[2],
        All,
        worker_on(&c.all),
        &format!("stderr:\n{}", &stderr),
    );
    never_says(&stderr, &["retargeting"]);
}

/// In an ordinary process `configure(-1)` and `configure(N)` read the variables as they are at
/// the call: `CUDA_VISIBLE_DEVICES=1` then `configure(-1)` → GPU 1; `=0` then `configure(-1)` →
/// GPU 0 (a retarget); `=0,1` then `configure(1)` → GPU 1. An assignment alone moves nothing
/// here (the program chose its device by calling configure), and host threads never move.
#[test]
fn configure_reads_the_device_variables_as_they_are_at_the_call() {
    let (sysfs, c) = require!(two_gpus_host());
    let steps = [
        "set:CUDA_VISIBLE_DEVICES=1",
        "configure:-1",
        "set:CUDA_VISIBLE_DEVICES=0",
        "configure:-1",
        "set:CUDA_VISIBLE_DEVICES=0,1",
        "configure:1",
    ];
    let cmd = follow_cmd(&sysfs, &steps);
    let (phases, stderr) = run_steps(cmd, steps.len());
    // Thread `a` (the one that configures): its mask after each step.
    let a = [
        &c.all, &c.all, &c.other, &c.other, &c.local, &c.local, &c.other,
    ];
    for (phase, mask) in phases.iter().zip(a) {
        assert_eq!(&phase.mask("a"), mask, "{}\n{stderr}", describe(phase));
        for (name, t) in phase.threads.iter().filter(|(n, _)| *n != "a") {
            assert_eq!(
                (t.role, t.mask.to_list()),
                (0, c.all.clone()),
                "host thread {name}: {}\n{stderr}",
                describe(phase)
            );
        }
    }
}

/// A dedicated worker's `vfork` child that sets `CUDA_VISIBLE_DEVICES` before exiting shares the
/// worker's memory but is not the worker: nothing moves, and the library's copy of the variables
/// is not the child's doing (the worker's own `setenv` of the same value afterwards does move its
/// threads). A failing `setenv`/`unsetenv` keeps its return code and `errno` (EINVAL).
#[test]
fn a_vfork_child_setting_the_variables_moves_nothing_and_errno_passes_through() {
    let (sysfs, c) = require!(two_gpus_host());
    let mut cmd = preloaded(Program::c("dv_vfork").build(), &sysfs);
    cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker");
    let mut run = Driver::spawn(cmd, LIMIT);
    let vforked = run.phase();
    run.proceed();
    let set = run.phase();
    run.proceed();
    let errno = run.line("ERRNO ");
    let end = run.finish();
    assert!(end.status.success(), "{:?}\n{}", end.status, end.stderr);
    expect(
        &vforked,
        All,
        worker_on(&c.local),
        &format!("stderr:\n{}", &end.stderr),
    );
    expect(
        &set,
        All,
        worker_on(&c.other),
        &format!("stderr:\n{}", &end.stderr),
    );
    assert_eq!(
        errno,
        format!("ERRNO setenv=-1/{0} unsetenv=-1/{0}", libc::EINVAL)
    );
}
