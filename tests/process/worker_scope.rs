//! Worker scopes (SPEC §2, §7) in a real Python process under the preloaded library, on the
//! simulated two-node host: device 0's worker set is node1, host threads stay on the launch mask.
//! A main thread opens `tllm_affinity.worker_scope(0)`, starts threads in it and after it; the
//! masks are read from `/proc`.

use crate::common;

use common::*;
use serde_json::Value;

#[test]
fn threads_started_in_a_worker_scope_are_workers_and_the_caller_stays_host() {
    require!(two_cpus("a worker set narrower than the launch mask"));
    let sysfs = Sysfs::two_nodes();
    let local = sysfs.node1.to_list();
    let all = allowed_cpus().to_list();
    let mut cmd = preloaded(python(), &sysfs);
    cmd.arg(program("worker_scope.py"))
        .env("PYTHONPATH", repo().join("python"))
        .env("TLLM_AFFINITY_POLICY", "numa")
        .env("TLLM_AFFINITY_LOCK_DIR", sysfs.path());
    let mut population = Driver::spawn(cmd, DEADLINE);
    let api: Value = serde_json::from_str(&population.after("API ")).unwrap();
    let scoped = population.phase();
    population.proceed();
    let released = population.phase();
    let end = population.succeed();

    assert!(api["lease"].as_i64().unwrap() > 0, "{api}");
    assert_eq!(api["released"], false, "ending the scope keeps the lease");
    assert_eq!(api["role_in_scope"], "host");
    assert_eq!(api["role_after"], "host");
    assert_eq!(api["end_again"], -api["enoent"].as_i64().unwrap());

    assert_eq!(
        (scoped.role("main"), scoped.mask("main")),
        (0, all.clone()),
        "the caller keeps its role and its launch mask"
    );
    for t in ["engine", "engine_child", "pool"] {
        assert_eq!(
            (scoped.role(t), scoped.mask(t)),
            (1, local.clone()),
            "{t}, started in the scope"
        );
    }
    assert_eq!(
        (scoped.role("http"), scoped.mask("http")),
        (0, all.clone()),
        "http, started after the scope"
    );
    for t in ["main", "engine", "engine_child", "pool", "http", "late"] {
        assert_eq!(released.mask(t), all, "{t} after release");
    }
    assert_eq!(released.role("late"), 0);
    says(&end.stderr, &["worker scope opened on thread"]);
}

#[test]
fn a_passive_library_gives_an_inert_scope_and_a_warning() {
    let sysfs = Sysfs::two_nodes();
    let mut cmd = preloaded(python(), &sysfs);
    cmd.arg(program("worker_scope.py"))
        .arg("passive")
        .env("PYTHONPATH", repo().join("python"))
        .env("TLLM_AFFINITY_POLICY", "bogus")
        .env("TLLM_AFFINITY_LOCK_DIR", sysfs.path());
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["inert"], true);
    assert_eq!(v["categories"], serde_json::json!(["RuntimeWarning"]));
    let warning = v["warnings"][0].as_str().unwrap();
    assert!(
        warning.contains("passive") && warning.contains("begin_worker_scope(0)"),
        "{warning}"
    );
}

/// tests/programs/numa_placement.c's `POLICY main <phase>` line: the mode and the node mask.
fn caller_policy(stdout: &str, phase: &str) -> String {
    let prefix = format!("POLICY main {phase} ");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {prefix}line in:\n{stdout}"))
        .to_string()
}

/// numa_placement's run on device `device` of the simulated host, under `around` (numactl).
fn placement_policies(sysfs: &Sysfs, around: &[&str], device: &str) -> (String, String, String) {
    let mut cmd = clean(around.first().copied().unwrap_or("env"));
    cmd.args(around.iter().skip(1))
        .arg(Program::c("numa_placement").build())
        .arg(device);
    preload(&mut cmd, sysfs).env("TLLM_AFFINITY_POLICY", "numa");
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        caller_policy(&stdout, "configured")
            .split(' ')
            .next()
            .unwrap()
            .to_string(),
        caller_policy(&stdout, "scope"),
        caller_policy(&stdout, "after_scope"),
    )
}

/// The scope's caller keeps its host mask, so what it allocates while the scope is open would
/// land wherever the scheduler runs it: it prefers the workers' node (`MPOL_PREFERRED`, mode 1)
/// until the scope ends, then has the default (0) again. A policy of its own (numactl
/// `--membind`: 2, `--preferred`) is left as it is, during and after. Device 1 of the simulated
/// host is local to node 0, the one node this kernel really has (the guest tier shows node 1 of
/// a real two-node kernel); device 0's node 1 the kernel lacks, so nothing changes there.
#[test]
fn a_scopes_caller_prefers_the_workers_node_until_the_scope_ends_unless_it_has_a_policy() {
    require!(two_cpus("a simulated host of two nodes"));
    let sysfs = Sysfs::two_nodes();
    let (configured, scope, after) = placement_policies(&sysfs, &[], "1");
    assert_eq!(configured, "0", "no scope open: the default");
    assert_eq!(
        scope, "1 1",
        "MPOL_PREFERRED on node 0 while the scope is open"
    );
    assert_eq!(after, "0 0", "the default again once it ended");
    if !on_path("numactl") {
        return missing("numactl");
    }
    let membind = placement_policies(&sysfs, &["numactl", "--membind=0"], "1");
    assert_eq!((membind.1.as_str(), membind.2.as_str()), ("2 1", "2 1"));
    let preferred = placement_policies(&sysfs, &["numactl", "--preferred=0"], "1");
    assert_eq!((preferred.1.as_str(), preferred.2.as_str()), ("1 1", "1 1"));
    let absent = placement_policies(&sysfs, &[], "0");
    assert_eq!((absent.1.as_str(), absent.2.as_str()), ("0 0", "0 0"));
}

/// A thread created in the scope prefers the workers' node (the kernel copied its creator's
/// policy), and what it starts does not: a bare `fork` child and a `system` child have the
/// default. Once the thread sets a policy of its own (`MPOL_BIND` on node 0), that one is left
/// alone: its children inherit it, and it is still the thread's after they started. Device 1 of
/// the simulated host is local to node 0, the node this kernel has.
#[test]
fn a_thread_created_in_the_scope_keeps_its_preference_from_its_children_and_its_own_policy() {
    require!(two_cpus("a simulated host of two nodes"));
    let sysfs = Sysfs::two_nodes();
    let mut cmd = preloaded(python(), &sysfs);
    cmd.arg(program("scope_thread_children.py"))
        .env("TLLM_AFFINITY_POLICY", "numa");
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let policy = |who: &str| {
        let prefix = format!("{who} ");
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {who} line in:\n{stdout}"))
            .to_string()
    };
    // `<mode> <node mask>`: MPOL_PREFERRED (1) or MPOL_BIND (2) on node 0, or the default.
    let expected = [
        ("CALLER", "1 0x1"),
        ("THREAD", "1 0x1"),
        ("THREAD_FORK", "0 0x0"),
        ("THREAD_SYSTEM", "0 0x0"),
        ("BOUND", "2 0x1"),
        ("BOUND_FORK", "2 0x1"),
        ("BOUND_SYSTEM", "2 0x1"),
        ("BOUND_AFTER", "2 0x1"),
    ];
    let got: Vec<(&str, String)> = expected
        .iter()
        .map(|&(who, _)| (who, policy(who)))
        .collect();
    let want: Vec<(&str, String)> = expected
        .iter()
        .map(|&(who, p)| (who, p.to_string()))
        .collect();
    assert_eq!(got, want, "{stdout}");
}

/// On half a GB200 tray (Grace nodes 0 and 1; GPU 0 on node 0, its memory the CPU-less node 2,
/// GPU 1's node 10, as the driver's `numa_status` says), the scope's caller for device 0 prefers
/// node 0, the Grace node its workers run on, never the GPU's memory node: `MPOL_PREFERRED` (1)
/// with node mask 1. This kernel has node 0 only, so a preference for node 2 or 10 would fail
/// and leave the default (0 0).
#[test]
fn a_scopes_caller_on_a_gb200_tray_prefers_the_grace_node_not_the_gpus_memory_node() {
    require!(two_cpus("a simulated host of two Grace nodes"));
    let sysfs = Sysfs::gb200();
    let (_, scope, after) = placement_policies(&sysfs, &[], "0");
    assert_eq!(
        scope, "1 1",
        "MPOL_PREFERRED on node 0 while the scope is open"
    );
    assert_eq!(after, "0 0", "the default again once it ended");
}
