//! Worker scopes (SPEC §2, §7) in a real Python process under the preloaded library, on the
//! simulated two-node host: device 0's worker set is node1, host threads stay on the launch mask.
//! A main thread opens `tllm_affinity.worker_scope(0)`, starts threads in it and after it; the
//! masks are read from `/proc`.

mod common;

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
    assert!(
        end.stderr.contains("worker scope opened on thread"),
        "{}",
        end.stderr
    );
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
