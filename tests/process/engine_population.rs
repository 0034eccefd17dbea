//! SPEC §2–§5 on real processes: a compiled C population and real Python threads, the real
//! library preloaded, every mask read from `/proc/<pid>/task/<tid>/status`.
//!
//! The simulated host has two NUMA nodes made of this machine's CPUs; device 0's GPU is local to
//! node 1. With two CPUs: node0 = {0}, node1 = {1}.

use crate::common;

use common::*;

use common::leases::POPULATION_WORKERS as WORKERS;

fn population(sysfs: &Sysfs) -> std::process::Command {
    let program = Program::c("population").build();
    let nccl = Program::c("nccl").shared().build();
    let mut cmd = preloaded(program, sysfs);
    cmd.env("FAKE_NCCL", nccl).arg("0");
    cmd
}

/// The C population: roles, placement, a second configure that changes nothing, restoration
/// (tests/common/leases.rs, shared with the aarch64 tier).
#[test]
fn c_population_roles_placement_idempotency_and_restoration() {
    common::leases::check_c_population(&common::tier::Native);
}

/// Variables, worker mask unconstrained, worker mask under `taskset`, whether the server's
/// "constrained" warning is due under `taskset`.
type PolicyRow<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str, bool);

/// The policy table of SPEC §3, row by row, unconstrained and under `taskset`.
#[test]
fn policy_table_with_and_without_taskset() {
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus();
    require!(two_cpus("this test"));
    let local = sysfs.node1.to_list();
    let all = all.to_list();
    let narrow = sysfs.node0.to_list();
    // (variables, worker mask unconstrained, worker mask under `taskset -c <node0>`, whether the
    // inference server's "constrained ... Removing CPU affinity constraints" warning is due)
    let rows: [PolicyRow; 8] = [
        (&[], &local, &all, true),
        (
            &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1")],
            &local,
            &local,
            false,
        ),
        (
            &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0")],
            &all,
            &narrow,
            false,
        ),
        (
            &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "yes")],
            &all,
            &narrow,
            false,
        ),
        (&[("TLLM_AFFINITY_POLICY", "auto")], &local, &all, true),
        (
            &[
                ("TLLM_AFFINITY_POLICY", "numa"),
                ("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0"),
            ],
            &local,
            &local,
            false,
        ),
        (
            &[
                ("TLLM_AFFINITY_POLICY", "clear"),
                ("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1"),
            ],
            &all,
            &all,
            false,
        ),
        (&[("TLLM_AFFINITY_POLICY", "keep")], &all, &narrow, false),
    ];
    for (vars, unconstrained, constrained, warns_when_constrained) in rows {
        for (taskset, expected_worker, expected_host) in
            [(false, unconstrained, &all), (true, constrained, &narrow)]
        {
            let mut cmd = if taskset {
                let mut c = preloaded("taskset", &sysfs);
                c.arg("-c")
                    .arg(&narrow)
                    .arg(Program::c("population").build());
                c.env("FAKE_NCCL", Program::c("nccl").shared().build())
                    .arg("0");
                c
            } else {
                population(&sysfs)
            };
            cmd.envs(vars.iter().copied());
            let mut run = Driver::spawn(cmd, DEADLINE);
            run.phase();
            run.proceed();
            let configured = run.phase();
            let end = run.finish();
            let case = format!("{vars:?} taskset={taskset}");
            expect(&configured, Named(&WORKERS), on(expected_worker), &case);
            let host = format!("host in {case}");
            expect(
                &configured,
                Named(&["main", "H1"]),
                on(expected_host),
                &host,
            );
            let warned = end.stderr.contains("has constrained CPU affinity");
            assert_eq!(
                warned,
                taskset && warns_when_constrained,
                "constrained warning in {case}:\n{}",
                end.stderr
            );
        }
    }
}

/// A cgroup cpuset is not an external constraint: a process inside one is judged against it,
/// and every worker mask is intersected with it.
#[test]
fn policy_under_a_cgroup_cpuset() {
    let sysfs = Sysfs::two_nodes();
    let local = sysfs.node1.to_list();
    let group = require!(CpusetCgroup::create(&local));
    let program = Program::c("population").build();
    let nccl = Program::c("nccl").shared().build();
    let run_in_group = |device: &str, extra: &[(&str, &str)]| {
        let mut cmd = group.wrap(&program, &[device]);
        cmd.env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path())
            .env("TLLM_AFFINITY_LOG", "info")
            .env("FAKE_NCCL", &nccl)
            .env_remove("TLLM_NUMA_AWARE_WORKER_AFFINITY")
            .env_remove("TLLM_AFFINITY_POLICY")
            .envs(extra.iter().copied());
        let mut run = Driver::spawn(cmd, DEADLINE);
        let before = run.phase();
        run.proceed();
        let configured = run.phase();
        (before, configured, run.finish())
    };

    // Unset policy, device 0 (local to the cpuset's CPUs): NUMA placement, not "clear", and no
    // constrained warning although the mask is narrower than the host.
    let (before, configured, end) = run_in_group("0", &[]);
    assert_eq!(
        before.mask("main"),
        local,
        "the cgroup confines the process"
    );
    for t in WORKERS {
        assert_eq!(configured.mask(t), local);
    }
    never_says(&end.stderr, &["constrained"]);
    says(&end.stderr, &["NUMA-aware scheduling"]);

    // Device 1's CPUs lie outside the cpuset: nothing is pinned, and the log says why.
    let (_, configured, end) = run_in_group("1", &[]);
    for t in WORKERS {
        assert_eq!(configured.mask(t), local);
    }
    says(&end.stderr, &["no CPU in common"]);

    // "clear" means the cpuset, never the whole host. The kernel would clip a wider mask to the
    // cpuset anyway, so the mask the library chose is read from its own log line.
    let (_, configured, end) = run_in_group("0", &[("TLLM_AFFINITY_POLICY", "clear")]);
    assert_eq!(configured.mask("W"), local);
    says(
        &end.stderr,
        &[&format!("CPU affinity set to [{local}] (9/9 threads)")],
    );
}

/// The reproduction of seeds/configure-not-idempotent.txt with real Python threads: six worker
/// threads alive, policy unset, configure twice.
#[test]
fn python_configure_twice_keeps_six_workers_pinned() {
    let sysfs = Sysfs::two_nodes();
    let local = sysfs.node1.to_list();
    let mut cmd = preloaded(python(), &sysfs);
    cmd.arg(programs_dir().join("configure_twice.py"));
    let (phases, end) = Driver::spawn(cmd, DEADLINE).all_phases::<4>();
    assert!(end.status.success(), "{}", end.stderr);
    let [start, first, second, created_after] = &phases;
    let all = allowed_cpus().to_list();
    let workers: Vec<String> = (0..6).map(|i| format!("w{i}")).collect();
    for w in &workers {
        assert_eq!(start.mask(w), all);
        assert_eq!(first.mask(w), local, "{w} after the first configure");
        assert_eq!(second.mask(w), local, "{w} after the second configure");
    }
    assert_eq!(first.mask("engine"), local);
    assert_eq!(second.mask("engine"), local);
    assert_eq!(second.mask("between"), local, "born between the calls");
    assert_eq!(created_after.mask("later"), local);
    assert_eq!(second.mask("main"), all);
    never_says(&end.stderr, &["constrained"]);
    assert!(!end.stderr.contains("Removing CPU affinity constraints"));
    says(
        &end.stderr,
        &[&format!(
            "CPU affinity set to [{local}] for optimal NUMA-aware scheduling (7/7 threads)"
        )],
    );
}

/// A Python process shaped like an HTTP server hosting a worker: host threads started before
/// the worker keep their mask through configure and release; the worker's threads and
/// grandchildren get the GPU-local set; release puts everything back.
#[test]
fn python_host_and_worker_threads() {
    let sysfs = Sysfs::two_nodes();
    check_host_and_worker(preloaded(python(), &sysfs), &sysfs, DEADLINE);
}

/// A dedicated worker process whose first image execs the real program (a pyenv or conda shim,
/// a wrapper script): the exec'd image is born on the worker mask the first image set, yet it
/// must judge "constrained" on the launch mask — no false warning, and its threads stay on the
/// GPU-local set instead of being cleared to every CPU.
#[test]
fn a_dedicated_worker_that_execs_keeps_its_numa_placement() {
    let sysfs = Sysfs::two_nodes();
    require!(two_cpus("this test"));
    let local = sysfs.node1.to_list();
    let script = "import json, os, threading\n\
                  seen = {}\n\
                  t = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))\n\
                  t.start(); t.join()\n\
                  seen['main'] = sorted(os.sched_getaffinity(0))\n\
                  print(json.dumps(seen))";
    let mut cmd = preloaded("sh", &sysfs);
    cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker")
        .arg("-c")
        .arg(r#"exec "$0" -c "$1""#)
        .arg(python())
        .arg(script);
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let cpus = |v: &serde_json::Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap() as usize)
            .collect::<tllm_affinity_core::mask::CpuMask>()
            .to_list()
    };
    assert_eq!(cpus(&seen["main"]), local, "{stderr}");
    assert_eq!(cpus(&seen["thread"]), local, "{stderr}");
    assert!(
        !stderr.contains("constrained"),
        "false constrained warning:\n{stderr}"
    );
    assert_eq!(
        stderr.matches("for optimal NUMA-aware scheduling").count(),
        2,
        "both images configure at load:\n{stderr}"
    );
}
