//! A real Slurm (tests/common/slurm.rs: munged, slurmctld and slurmd started by this binary)
//! runs `tests/programs/slurm_task.c` under `srun`, with the real library preloaded through
//! srun's environment (`LD_PRELOAD=... srun ...`), as a user would. Every mask is the kernel's
//! (`sched_getaffinity` in the task), the cpuset is read from the task's cgroup file, and the
//! expectation is SPEC §3's table applied to what Slurm gave the task.
//!
//! The simulated host (`Sysfs::two_nodes`): GPU 0 is local to CPU 1, GPU 1 to CPU 0; a task's
//! device is its `SLURM_LOCALID` modulo the two GPUs (`configure(-1)`).
//!
//! What Slurm gives a task here (measured on this machine kind, docs/runtimes.md): under `task/cgroup`
//! with `ConstrainCores=yes`, `-n1 -c1 --cpu-bind=cores` makes the step cpuset the task's one CPU
//! (not constrained), `-n2 -c1 --cpu-bind=cores` and `-n1 -c2 --cpu-bind=map_cpu:1` leave the
//! cpuset wider than the task's mask (constrained); under `task/affinity` alone every binding is
//! constrained; `--cpu-bind=none` with the whole node never is.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::slurm::{cluster, Cluster, TaskPlugin};
use common::*;
use serde_json::Value;
use tllm_affinity_core::mask::CpuMask;

const LIMIT: Duration = Duration::from_secs(90);

struct Binding {
    label: &'static str,
    args: &'static [&'static str],
    tasks: usize,
    /// Whether Slurm's binding is "constrained" (SPEC §3) under task/cgroup, under task/affinity.
    constrained: (bool, bool),
}

const BINDINGS: [Binding; 4] = [
    Binding {
        label: "-n1 -c1 --cpu-bind=cores",
        args: &["-n1", "-c1", "--cpu-bind=cores"],
        tasks: 1,
        constrained: (false, true),
    },
    Binding {
        label: "-n2 -c1 --cpu-bind=cores",
        args: &["-n2", "-c1", "--cpu-bind=cores"],
        tasks: 2,
        constrained: (true, true),
    },
    Binding {
        label: "-n1 -c2 --cpu-bind=map_cpu:1",
        args: &["-n1", "-c2", "--cpu-bind=map_cpu:1"],
        tasks: 1,
        constrained: (true, true),
    },
    Binding {
        label: "-n1 -c2 --cpu-bind=none",
        args: &["-n1", "-c2", "--cpu-bind=none"],
        tasks: 1,
        constrained: (false, false),
    },
];

/// Variables added to srun's environment.
type Env = &'static [(&'static str, &'static str)];
type Policy = (&'static str, Env);

const POLICIES: [Policy; 6] = [
    ("unset", &[]),
    ("NUMA_AWARE=1", &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1")]),
    ("NUMA_AWARE=0", &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0")]),
    ("POLICY=keep", &[("TLLM_AFFINITY_POLICY", "keep")]),
    ("POLICY=clear", &[("TLLM_AFFINITY_POLICY", "clear")]),
    ("POLICY=numa", &[("TLLM_AFFINITY_POLICY", "numa")]),
];

/// What one task printed: its threads' masks and roles, the cpuset, configure's answer, the
/// library's report and log lines.
#[derive(Debug)]
struct Task {
    rank: usize,
    lease: i64,
    cpuset: Option<CpuMask>,
    threads: BTreeMap<String, (CpuMask, i32)>,
    report: Value,
    log: Vec<String>,
}

impl Task {
    fn mask(&self, thread: &str) -> &CpuMask {
        &self.threads[thread].0
    }
    fn role(&self, thread: &str) -> i32 {
        self.threads[thread].1
    }
}

const HOSTS: [&str; 3] = ["main", "host", "host_late"];
const WORKERS: [&str; 2] = ["worker", "worker_child"];

/// Runs the task program under srun with the library preloaded and `env` added; one [`Task`] per
/// task, by rank.
fn run_tasks(
    cluster: &Cluster,
    sysfs: &Sysfs,
    args: &[&str],
    env: &[(&str, &str)],
    tasks: usize,
) -> Vec<Task> {
    let program = Program::c("slurm_task").build();
    let library = library();
    let mut all_args = vec!["--label"];
    all_args.extend_from_slice(args);
    all_args.push(program.to_str().unwrap());
    let mut all_env = vec![
        ("LD_PRELOAD", library.to_str().unwrap()),
        ("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path().to_str().unwrap()),
        ("TLLM_AFFINITY_LOG", "info"),
    ];
    all_env.extend_from_slice(env);
    let end = cluster.srun(&all_args, &all_env, LIMIT);
    let context = format!(
        "srun {} {env:?} under {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        cluster.plugin.name(),
        end.stdout,
        end.stderr
    );
    assert!(end.status.success(), "{context}");
    let mut found: Vec<Task> = (0..tasks)
        .map(|rank| Task {
            rank,
            lease: 0,
            cpuset: None,
            threads: BTreeMap::new(),
            report: Value::Null,
            log: Vec::new(),
        })
        .collect();
    let labelled = |line: &str| -> Option<(usize, String)> {
        let (rank, rest) = line.split_once(": ")?;
        Some((rank.trim().parse().ok()?, rest.to_string()))
    };
    for (rank, rest) in end.stdout.lines().filter_map(labelled) {
        let task = &mut found[rank];
        if let Some(json) = rest.strip_prefix("REPORT task ") {
            task.report = serde_json::from_str(json).unwrap();
        } else if rest.starts_with("TASK ") {
            assert_eq!(field(&rest, "rank"), rank.to_string(), "{context}");
            task.lease = field(&rest, "lease").parse().unwrap();
            task.cpuset = CpuMask::parse_list(&field(&rest, "cpuset")).ok();
            for name in HOSTS.iter().chain(WORKERS.iter()) {
                let value = field(&rest, name);
                let (m, role) = value.split_once(':').unwrap();
                task.threads
                    .insert(name.to_string(), (mask(m), role.parse().unwrap()));
            }
        }
    }
    for (rank, rest) in end.stderr.lines().filter_map(labelled) {
        if rest.starts_with("[tllm-affinity]") {
            found[rank].log.push(rest);
        }
    }
    for task in &found {
        assert!(
            !task.threads.is_empty() && task.report.is_object(),
            "task {} printed nothing\n{context}",
            task.rank
        );
    }
    found
}

/// The GPU-local set of device `rank % 2` on the simulated host.
fn gpu_local(sysfs: &Sysfs, rank: usize) -> CpuMask {
    if rank.is_multiple_of(2) {
        sysfs.node1.clone()
    } else {
        sysfs.node0.clone()
    }
}

/// SPEC §3 applied by hand: the worker mask and the words of the log line that says so.
fn expected(
    policy: &[(&str, &str)],
    constrained: bool,
    launch: &CpuMask,
    cpuset: &CpuMask,
    local: &CpuMask,
) -> (CpuMask, String) {
    let var = |name: &str| policy.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    let rule = match (
        var("TLLM_AFFINITY_POLICY"),
        var("TLLM_NUMA_AWARE_WORKER_AFFINITY"),
    ) {
        (Some(p), _) => p,
        (None, Some("1")) => "numa",
        (None, Some(_)) => "keep",
        (None, None) if constrained => "clear-by-the-table",
        (None, None) => "numa",
    };
    match rule {
        "numa" => {
            let set = local.intersection(cpuset);
            if set.is_empty() {
                (launch.clone(), "no worker mask pinned".to_string())
            } else {
                (
                    set.clone(),
                    format!("CPU affinity set to [{set}] for optimal NUMA-aware scheduling"),
                )
            }
        }
        "clear-by-the-table" => (
            cpuset.clone(),
            "Removing CPU affinity constraints.".to_string(),
        ),
        "clear" => (cpuset.clone(), format!("CPU affinity set to [{cpuset}] (")),
        _ => (launch.clone(), "left unchanged by policy".to_string()),
    }
}

/// Every binding × every policy value under `plugin`, one srun each: a mixed population per task.
/// Host threads (main, one started before configure, one after) keep srun's binding; worker
/// threads (the configuring thread and its child) get SPEC §3's mask, said in one log line.
fn bindings_times_policies(plugin: TaskPlugin) {
    require!(two_cpus("two CPUs for Slurm to bind tasks to"));
    let cluster = require!(cluster(plugin));
    let sysfs = Sysfs::two_nodes();
    let mut table = vec![format!(
        "| {} | binding | policy | task | constrained | worker mask | host mask | log line |",
        plugin.name()
    )];
    for binding in &BINDINGS {
        let constrained = match plugin {
            TaskPlugin::AffinityAndCgroup => binding.constrained.0,
            TaskPlugin::Affinity => binding.constrained.1,
        };
        for (label, policy) in POLICIES {
            let tasks = run_tasks(cluster, &sysfs, binding.args, policy, binding.tasks);
            for task in &tasks {
                let case = format!(
                    "{} {} {label} task {}: {task:?}",
                    plugin.name(),
                    binding.label,
                    task.rank
                );
                // A host process's main thread keeps what srun gave the task.
                let launch = task.mask("main").clone();
                assert_eq!(
                    task.report["mask_at_load"].as_str(),
                    Some(launch.to_list().as_str()),
                    "{case}"
                );
                let cpuset = task.cpuset.clone().unwrap_or_else(allowed_cpus);
                assert_eq!(
                    task.report["cpuset"].as_str(),
                    Some(cpuset.to_list().as_str()),
                    "{case}"
                );
                // Slurm's binding is what the notes measured, and the library judges it so.
                assert_eq!(
                    launch != cpuset && launch.intersection(&cpuset) == launch,
                    constrained,
                    "{case}"
                );
                assert_eq!(task.report["constrained"], constrained, "{case}");
                let (worker, words) = expected(
                    policy,
                    constrained,
                    &launch,
                    &cpuset,
                    &gpu_local(&sysfs, task.rank),
                );
                assert!(task.lease > 0, "{case}");
                for t in HOSTS {
                    assert_eq!((task.mask(t), task.role(t)), (&launch, 0), "{t}: {case}");
                }
                for t in WORKERS {
                    assert_eq!((task.mask(t), task.role(t)), (&worker, 1), "{t}: {case}");
                }
                let line = task
                    .log
                    .iter()
                    .find(|l| l.contains(&words))
                    .unwrap_or_else(|| panic!("no log line with {words:?}: {case}"));
                if !(constrained && label == "unset") {
                    assert!(
                        !task.log.iter().any(|l| l.contains("constrained")),
                        "a false \"constrained\": {case}"
                    );
                }
                let line = line
                    .trim_start_matches("[tllm-affinity] ")
                    .replace(&format!(" {}", task.report["pid"]), " <pid>");
                table.push(format!(
                    "| | {} | {label} | {} | {constrained} | {worker} | {launch} | {line} |",
                    binding.label, task.rank
                ));
            }
        }
    }
    println!("{}", table.join("\n"));
}

#[test]
fn srun_bindings_times_policies_under_task_cgroup() {
    bindings_times_policies(TaskPlugin::AffinityAndCgroup);
}

#[test]
fn srun_bindings_times_policies_under_task_affinity_alone() {
    bindings_times_policies(TaskPlugin::Affinity);
}

/// `TLLM_AFFINITY_PROCESS_ROLE=worker` tasks pick their GPU by `SLURM_LOCALID`: with two tasks,
/// task 0 is configured at load for GPU 0 (CPU 1), task 1 for GPU 1 (CPU 0), every thread a
/// worker; the program's own `configure(-1)` finds its mask already in place. Once with each
/// task bound to its core and the NUMA-aware flag set, once unbound with the policy unset (the
/// default table: not constrained → NUMA-aware), under both task plugins.
#[test]
fn dedicated_worker_tasks_pick_their_gpu_by_slurm_localid() {
    require!(two_cpus("two CPUs for two tasks"));
    let sysfs = Sysfs::two_nodes();
    // The role through srun's --export, for the tasks alone: srun itself stays a host process.
    let role = "--export=ALL,TLLM_AFFINITY_PROCESS_ROLE=worker";
    let cases: [(&[&str], Env); 2] = [
        (
            &["-n2", "-c1", "--cpu-bind=cores", role],
            &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1")],
        ),
        (&["-n2", "-c1", "--cpu-bind=none", role], &[]),
    ];
    for plugin in [TaskPlugin::AffinityAndCgroup, TaskPlugin::Affinity] {
        let cluster = require!(cluster(plugin));
        for (args, env) in cases {
            let tasks = run_tasks(cluster, &sysfs, args, env, 2);
            let mut at_load = Vec::new();
            for task in &tasks {
                let case = format!("{} {args:?} {env:?}: {task:?}", plugin.name());
                let local = gpu_local(&sysfs, task.rank);
                for t in HOSTS.iter().chain(WORKERS.iter()) {
                    assert_eq!((task.mask(t), task.role(t)), (&local, 1), "{t}: {case}");
                }
                assert_eq!(task.report["leases"].as_array().unwrap().len(), 2, "{case}");
                assert!(task.lease > 0, "{case}");
                let numa_lines = task
                    .log
                    .iter()
                    .filter(|l| {
                        l.contains(&format!(
                            "CPU affinity set to [{local}] for optimal NUMA-aware scheduling"
                        ))
                    })
                    .count();
                assert_eq!(numa_lines, 1, "configured once, at load: {case}");
                assert!(
                    !task.log.iter().any(|l| l.contains("constrained")),
                    "{case}"
                );
                at_load.push(task.report["mask_at_load"].as_str().unwrap().to_string());
                println!(
                    "{} srun {} {env:?} task {}: mask at load [{}], every thread on [{local}]",
                    plugin.name(),
                    args.join(" "),
                    task.rank,
                    at_load.last().unwrap()
                );
            }
            if args.contains(&"--cpu-bind=cores") {
                // Each task on its own core: two single CPUs, different.
                assert!(at_load.iter().all(|m| mask(m).count() == 1), "{at_load:?}");
                assert_ne!(at_load[0], at_load[1]);
            }
        }
    }
}
