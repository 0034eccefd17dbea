//! External constraints for real (issue #5, item 3; SPEC §3): `numactl --physcpubind`, `taskset
//! -c` and a cpuset cgroup the test creates, around the Python population
//! (tests/programs/constrained_population.py) and, under numactl, the C population
//! (tests/programs/population.c). tests/process/engine_population.rs covers the C population under
//! taskset and in a cgroup; this file covers the rest. Every mask is read from
//! `/proc/<pid>/task/<tid>/status`.
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1, device 1's to node 0.
//! The constraint binds the process to node 0's CPUs, so "GPU-local" (node 1), "keep" (node 0)
//! and "clear" (the whole cpuset) are three different masks. With two CPUs: {1}, {0}, {0-1}.

use crate::common;

use std::process::Command;

use common::*;

const HOSTS: [&str; 3] = ["main", "host", "host_late"];
const WORKERS: [&str; 5] = ["worker", "child0", "child1", "grandchild", "child_late"];

/// What runs around the program.
#[derive(Clone, Copy)]
enum Around<'a> {
    Numactl(&'a str),
    Taskset(&'a str),
    Cgroup(&'a CpusetCgroup),
}

impl std::fmt::Debug for Around<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Around::Numactl(cpus) => write!(f, "numactl --physcpubind={cpus}"),
            Around::Taskset(cpus) => write!(f, "taskset -c {cpus}"),
            Around::Cgroup(group) => write!(f, "cgroup {}", group.path.display()),
        }
    }
}

fn wrap(around: Around, sysfs: &Sysfs, program: &std::path::Path, args: &[&str]) -> Command {
    let mut cmd = match around {
        Around::Numactl(cpus) => {
            let mut c = preloaded("numactl", sysfs);
            c.arg(format!("--physcpubind={cpus}")).arg(program);
            c
        }
        Around::Taskset(cpus) => {
            let mut c = preloaded("taskset", sysfs);
            c.arg("-c").arg(cpus).arg(program);
            c
        }
        Around::Cgroup(group) => {
            let mut c = group.wrap(program, &[]);
            preload(&mut c, sysfs);
            c
        }
    };
    cmd.args(args);
    cmd
}

/// The Python population under `around`: its three phases and what it printed.
fn python_population(
    sysfs: &Sysfs,
    around: Around,
    device: &str,
    vars: &[(&str, &str)],
) -> ([Phase; 3], Finished) {
    let script = programs_dir().join("constrained_population.py");
    let script = script.to_str().unwrap();
    let mut cmd = wrap(around, sysfs, &python(), &[script, device]);
    cmd.envs(vars.iter().copied());
    let mut run = Driver::spawn(cmd, DEADLINE);
    let mut phases = Vec::new();
    for i in 0..3 {
        if i > 0 {
            run.proceed();
        }
        phases.push(run.phase());
    }
    let end = run.finish();
    assert!(end.status.success(), "{around:?} {vars:?}: {}", end.stderr);
    for phase in &phases {
        println!("{around:?} device {device} {vars:?} {}", describe(phase));
    }
    (phases.try_into().unwrap(), end)
}

/// The library's own view, printed by constrained_population.py after configure.
fn report_line(end: &Finished) -> serde_json::Value {
    let line = end
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("REPORT "))
        .unwrap_or_else(|| panic!("no REPORT line:\n{}", end.stderr));
    serde_json::from_str(line).unwrap()
}

/// The Python population's masks through one run: everyone on `load` before configure, workers
/// on `worker` and hosts on `load` during the lease, everyone on `load` after release.
fn assert_python_population(phases: &[Phase; 3], load: &str, worker: &str, case: &str) {
    let [before, configured, released] = phases;
    expect(before, All, on(load), &format!("{case}: before configure"));
    expect(configured, Named(&WORKERS), worker_on(worker), case);
    let never_moved = format!("{case}: a host thread is never widened nor narrowed");
    expect(configured, Named(&HOSTS), host_on(load), &never_moved);
    expect(released, All, on(load), &format!("{case}: after release"));
}

/// Variables set for one row of the policy table.
type Vars = &'static [(&'static str, &'static str)];

/// The policy table of SPEC §3 under a constraint: (variables, worker mask, whether the
/// server's "constrained" warning is due). `narrow` is the constraint, `local` GPU 0's set.
fn constrained_rows<'a>(
    all: &'a str,
    local: &'a str,
    narrow: &'a str,
) -> Vec<(Vars, &'a str, bool)> {
    vec![
        (&[], all, true),
        (&[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1")], local, false),
        (&[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0")], narrow, false),
        (&[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "")], narrow, false),
        (&[("TLLM_AFFINITY_POLICY", "auto")], all, true),
        (
            &[
                ("TLLM_AFFINITY_POLICY", "numa"),
                ("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0"),
            ],
            local,
            false,
        ),
        (
            &[
                ("TLLM_AFFINITY_POLICY", "clear"),
                ("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1"),
            ],
            all,
            false,
        ),
        (&[("TLLM_AFFINITY_POLICY", "keep")], narrow, false),
    ]
}

/// The first `rows` rows of [`constrained_rows`] under a constraint to node 0's CPUs: for each,
/// `run(sysfs, narrow, vars, worker)` runs the program under it and checks its masks, giving
/// the case's name and the end; the server's "constrained" warning came exactly where the row
/// says it is due.
fn policy_table_under_a_constraint(
    rows: usize,
    run: impl Fn(&Sysfs, &str, Vars, &str) -> (String, Finished),
) {
    require!(two_cpus("a constraint narrower than the cpuset"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let narrow = sysfs.node0.to_list();
    for (vars, worker, warns) in constrained_rows(&all, &local, &narrow)
        .into_iter()
        .take(rows)
    {
        let (case, end) = run(&sysfs, &narrow, vars, worker);
        assert_eq!(
            end.stderr.contains("has constrained CPU affinity"),
            warns,
            "{case}: the constrained warning:\n{}",
            end.stderr
        );
    }
}

/// `numactl --physcpubind=<node 0>` around the Python population: the process is constrained
/// (the library says so in its report), host threads keep numactl's binding whatever the
/// policy, and worker threads get the policy table's answer.
#[test]
fn numactl_physcpubind_python_population_policy_table() {
    policy_table_under_a_constraint(usize::MAX, |sysfs, narrow, vars, worker| {
        let case = format!("numactl --physcpubind={narrow} {vars:?}");
        let (phases, end) = python_population(sysfs, Around::Numactl(narrow), "0", vars);
        assert_python_population(&phases, narrow, worker, &case);
        let report = report_line(&end);
        assert_eq!(report["mask_at_load"], narrow, "{case}");
        assert_eq!(report["constrained"], true, "{case}");
        (case, end)
    });
}

/// The same under `taskset -c`, for the Python population (the C population's is in
/// tests/process/engine_population.rs): the three rows that differ.
#[test]
fn taskset_python_population_policy_table() {
    policy_table_under_a_constraint(3, |sysfs, narrow, vars, worker| {
        let case = format!("taskset -c {narrow} {vars:?}");
        let (phases, end) = python_population(sysfs, Around::Taskset(narrow), "0", vars);
        assert_python_population(&phases, narrow, worker, &case);
        assert_eq!(report_line(&end)["constrained"], true, "{case}");
        (case, end)
    });
}

/// `numactl --physcpubind` around the C population (its worker-libs thread included): the
/// rows that differ, host threads on numactl's binding.
#[test]
fn numactl_physcpubind_c_population() {
    let program = Program::c("population").build();
    let nccl = Program::c("nccl").shared().build();
    policy_table_under_a_constraint(3, |sysfs, narrow, vars, worker| {
        let case = format!("C population, numactl --physcpubind={narrow} {vars:?}");
        let mut cmd = wrap(Around::Numactl(narrow), sysfs, &program, &["0"]);
        cmd.env("FAKE_NCCL", &nccl).envs(vars.iter().copied());
        let mut run = Driver::spawn(cmd, DEADLINE);
        let before = run.phase();
        run.proceed();
        let configured = run.phase();
        let end = run.finish();
        println!("{case} {}", describe(&configured));
        expect(&before, All, on(narrow), &format!("{case}: before"));
        let workers = ["W", "C1", "G1", "C2", "P1"];
        expect(&configured, Named(&workers), worker_on(worker), &case);
        let host = format!("{case}: host");
        expect(&configured, Named(&["main", "H1"]), on(narrow), &host);
        (case, end)
    });
}

/// A cpuset cgroup the test creates, confining the Python population to node 1: not a
/// constraint (the mask at load equals the cpuset), so the unset policy places workers on the
/// GPU-local set within it, with no "constrained" warning; a GPU whose CPUs lie outside the
/// cpuset pins nothing and says why; "clear" means the cpuset, never the host. Nothing ever
/// leaves the cpuset.
#[test]
fn cgroup_cpuset_python_population() {
    require!(two_cpus("a constraint narrower than the cpuset"));
    let sysfs = Sysfs::two_nodes();
    let local = sysfs.node1.to_list();
    let group = require!(CpusetCgroup::create(&local));
    let around = Around::Cgroup(&group);

    let (phases, end) = python_population(&sysfs, around, "0", &[]);
    assert_python_population(&phases, &local, &local, "cgroup, device 0");
    let report = report_line(&end);
    assert_eq!(report["cpuset"], local.as_str());
    assert_eq!(report["mask_at_load"], local.as_str());
    assert_eq!(report["constrained"], false);
    assert_eq!(report["worker_mask"], local.as_str());
    never_says(&end.stderr, &["constrained CPU affinity"]);
    says(&end.stderr, &["NUMA-aware scheduling"]);

    // Device 1 is local to node 0, outside the cpuset: nothing is pinned, and the log says why.
    let (phases, end) = python_population(&sysfs, around, "1", &[]);
    assert_python_population(&phases, &local, &local, "cgroup, device 1");
    says(&end.stderr, &["no CPU in common"]);

    // "clear": the cpuset.
    let (phases, end) =
        python_population(&sysfs, around, "1", &[("TLLM_AFFINITY_POLICY", "clear")]);
    assert_python_population(&phases, &local, &local, "cgroup, clear");
    assert_eq!(report_line(&end)["worker_mask"], local.as_str());
}
