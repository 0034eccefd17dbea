//! SPEC §2–§5 on real runtimes inside one process (issue #5, item 1; docs/runtimes.md): a
//! python3 HTTP server (stdlib ThreadingHTTPServer, a thread per request) answering the test's
//! requests on loopback, real OpenMP (libgomp) pools and numpy's OpenBLAS pool, the real library
//! preloaded, every mask read from `/proc/<pid>/task/<tid>/status`.
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1. With two CPUs:
//! node0 = {0}, node1 = {1}.

use crate::common;

use common::*;
use tllm_affinity_core::placement::settings::DEFAULT_WORKER_LIBS;

/// The pool sizes are forced so that the test does not depend on the CPU count (see
/// `with_openmp`).
fn python_with_runtimes(sysfs: &Sysfs, program: &str) -> std::process::Command {
    let mut cmd = preloaded(python(), sysfs);
    with_openmp(&mut cmd)
        .arg(programs_dir().join(program))
        .env_remove("OPENBLAS_NUM_THREADS")
        .env_remove("OMP_DYNAMIC")
        .env_remove("TLLM_AFFINITY_WORKER_LIBS");
    cmd
}

fn named<'a>(phase: &'a Phase, prefix: &str) -> Vec<(&'a String, &'a ThreadSeen)> {
    phase
        .threads
        .iter()
        .filter(|(n, _)| n.starts_with(prefix))
        .collect()
}

/// A two-node host for a worker set narrower than the host: the host, every allowed CPU and the
/// GPU-local set (node 1), as lists.
fn two_sets() -> Result<(Sysfs, String, String), String> {
    two_cpus("a worker set narrower than the host")?;
    let sysfs = Sysfs::two_nodes();
    let local = sysfs.node1.to_list();
    Ok((sysfs, allowed_cpus().to_list(), local))
}

/// The main thread serves HTTP; a worker thread imports numpy, configures, runs OpenMP and BLAS
/// work, then releases. Host threads (the server, its per-request threads, the host's OpenMP
/// pools, whether started before or during the lease) keep the original mask; the worker's
/// OpenMP pool and its OpenBLAS pool get the GPU-local set; release puts every mask back and
/// the worker's pool, reused after release, runs on the restored mask.
#[test]
fn http_server_with_openmp_and_openblas_worker() {
    let (sysfs, all, local) = require!(two_sets());
    let mut run = Driver::spawn(
        python_with_runtimes(&sysfs, "http_server_with_pools.py"),
        DEADLINE,
    );
    let port: u16 = run.after("PORT ").parse().unwrap();
    let blas: usize = run.after("BLAS ").parse().unwrap();
    assert!(
        blas >= 1,
        "OpenBLAS starts a pool thread at import on a host with two CPUs"
    );

    let before = run.phase();
    let held_before = http_get(port, "/hold/req_before");
    run.proceed();
    let configured = run.phase();
    let held_during = http_get(port, "/hold/req_during?omp");
    run.proceed();
    let lease = run.phase();
    run.proceed();
    let released = run.phase();
    let held_after = http_get(port, "/hold/req_after");
    run.proceed();
    let after = run.phase();
    let end = run.succeed();
    for phase in [&before, &configured, &lease, &released, &after] {
        println!("{}", describe(phase));
    }

    // Before configure: nobody is a worker, every thread on the launch mask.
    expect(&before, All, host_on(&all), "before");
    assert_eq!(named(&before, "host_omp").len(), 2, "OMP_NUM_THREADS=3");
    assert_eq!(named(&before, "blas").len(), blas);

    // configure(0) on the worker thread: the worker, the OpenBLAS pool it started at import and
    // the OpenMP pool it started since get the GPU-local set; the HTTP server, the request held
    // since before and the host's OpenMP pool keep the launch mask.
    let (worker, host) = (worker_on(&local), host_on(&all));
    for phase in [&configured, &lease] {
        expect_each(&[
            (phase, "worker", worker, "the worker and its OpenMP pool"),
            (phase, "blas", worker, "the pool numpy's import started"),
            (phase, "main", host, "the HTTP server thread"),
            (phase, "host_omp", host, "the host's OpenMP pool"),
            (phase, "req_before", host, "a request thread"),
        ]);
    }
    assert_eq!(named(&configured, "worker_omp").len(), 2);
    // A request made during the lease: its thread (made by the server's thread) and the
    // OpenMP pool it starts are host threads on the launch mask.
    let during = "a request made during the lease";
    expect_each(&[(&lease, "req_during", host_on(&all), during)]);
    assert_eq!(named(&lease, "req_during_omp").len(), 2);

    // After release: every thread back on the launch mask; roles outlive the lease.
    expect(&released, All, on(&all), "released");
    expect_each(&[
        (
            &released,
            "worker",
            worker_on(&all),
            "restored, still a worker",
        ),
        (
            &released,
            "blas",
            worker_on(&all),
            "restored, still a worker",
        ),
    ]);
    // After release: a new request is a host thread on the launch mask, and the worker's OpenMP
    // pool, reused by the next region (same threads), runs on the restored mask.
    expect_each(&[
        (
            &after,
            "req_after",
            host_on(&all),
            "a request after release",
        ),
        (&after, "worker_omp", worker_on(&all), "the reused pool"),
    ]);
    for i in 1..=2 {
        let name = format!("worker_omp{i}");
        assert_eq!(
            after.thread(&name).tid,
            configured.thread(&name).tid,
            "libgomp keeps the worker's pool threads between regions"
        );
    }

    for (held, name) in [
        (held_before, "req_before"),
        (held_during, "req_during"),
        (held_after, "req_after"),
    ] {
        let response = held.join().unwrap();
        assert!(response.starts_with("HTTP/1.0 200"), "{name}: {response}");
        assert!(response.contains("\"role\": 0"), "{name}: {response}");
    }
    let at_configure = 1 + blas;
    let workers = at_configure + 2;
    says(&end.stderr, &[&format!(
            "CPU affinity set to [{local}] for optimal NUMA-aware scheduling ({at_configure}/{at_configure} threads)"
        )]);
    says(
        &end.stderr,
        &[&format!("restored {workers} threads, preserved 0")],
    );
}

/// One run of openblas_pool.py: how many threads `import numpy` started, and the three phases.
fn blas_run(sysfs: &Sysfs, mode: &str, vars: &[(&str, &str)]) -> (usize, [Phase; 3], Finished) {
    let mut cmd = python_with_runtimes(sysfs, "openblas_pool.py");
    cmd.arg(mode).envs(vars.iter().copied());
    let mut run = Driver::spawn(cmd, DEADLINE);
    let mut blas = None;
    if mode != "worker-after" {
        blas = Some(run.after("BLAS ").parse().unwrap());
    }
    let before = run.phase();
    run.proceed();
    if mode == "worker-after" {
        blas = Some(run.after("BLAS ").parse().unwrap());
    }
    let configured = run.phase();
    run.proceed();
    let released = run.phase();
    let end = run.finish();
    assert!(end.status.success(), "{mode} {vars:?}: {}", end.stderr);
    for phase in [&before, &configured, &released] {
        println!("{mode} {vars:?} {}", describe(phase));
    }
    (blas.unwrap(), [before, configured, released], end)
}

/// `expect` for rows of (phase, the threads whose names start with `name`, what they have, why).
fn expect_each(rows: &[(&Phase, &str, Want, &str)]) {
    for (phase, name, want, why) in rows {
        expect(phase, Matching(&[name]), *want, why);
    }
}

/// The recipe of docs/runtimes.md: import numpy on the thread that configures. Before
/// configure, OpenBLAS's pool is born on the launch mask, sized to it, and configure promotes it
/// with its creator; after configure, it is born on the worker set and sized to it. Either way
/// the pool runs on the GPU-local set during the lease and is restored by release.
#[test]
fn openblas_pool_imported_on_the_worker_thread() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus();
    let local = sysfs.node1.to_list();

    // numpy's wheel builds OpenBLAS with MAX_THREADS=64 (numpy.show_config()).
    let pool_for = |cpus: usize| cpus.min(64) - 1;
    let (blas, [before, configured, released], _) = blas_run(&sysfs, "worker-before", &[]);
    assert_eq!(
        blas,
        pool_for(all.count()),
        "OpenBLAS's pool: one thread per CPU of the importing thread, less the caller"
    );
    expect_each(&[
        (
            &before,
            "blas",
            host_on(&all.to_list()),
            "born on the launch mask",
        ),
        (
            &configured,
            "blas",
            worker_on(&local),
            "promoted with its creator",
        ),
        (&configured, "main", host_on(&all.to_list()), "host"),
        (&released, "blas", worker_on(&all.to_list()), "restored"),
    ]);

    let (blas, [_, configured, released], end) = blas_run(&sysfs, "worker-after", &[]);
    assert_eq!(
        blas,
        pool_for(sysfs.node1.count()),
        "imported after configure, the pool is sized to the worker set:\n{}",
        end.stderr
    );
    if blas > 0 {
        expect_each(&[
            (
                &configured,
                "blas",
                worker_on(&local),
                "born on the worker set",
            ),
            (&released, "blas", worker_on(&all.to_list()), "restored"),
        ]);
    }
    expect_each(&[
        (&configured, "worker", worker_on(&local), "the worker"),
        (&released, "worker", worker_on(&all.to_list()), "restored"),
    ]);
}

/// numpy imported by the host before any worker exists (the usual import order of a server):
/// the pool is a host thread and stays on the launch mask through configure. Naming OpenBLAS in
/// TLLM_AFFINITY_WORKER_LIBS makes the pool a worker whoever started it: placed at configure,
/// restored at release. OPENBLAS_NUM_THREADS=1 starts no pool: BLAS runs on the calling thread.
#[test]
fn openblas_pool_imported_by_the_host() {
    let (sysfs, all, local) = require!(two_sets());

    let (blas, [before, configured, released], _) = blas_run(&sysfs, "host-first", &[]);
    assert!(blas >= 1);
    expect_each(&[
        (&before, "blas", host_on(&all), "started by the main thread"),
        (&configured, "blas", host_on(&all), "a host pool stays host"),
        (&configured, "worker", worker_on(&local), "the worker"),
        (&released, "blas", host_on(&all), "untouched"),
    ]);

    let libs = format!("{DEFAULT_WORKER_LIBS},libscipy_openblas*.so*,libopenblas*.so*");
    let (blas, [before, configured, released], end) = blas_run(
        &sysfs,
        "host-first",
        &[("TLLM_AFFINITY_WORKER_LIBS", libs.as_str())],
    );
    assert!(blas >= 1);
    expect_each(&[
        (
            &before,
            "blas",
            worker_on(&all),
            "a worker by TLLM_AFFINITY_WORKER_LIBS",
        ),
        (&before, "main", host_on(&all), "its creator is a host"),
        (
            &configured,
            "blas",
            worker_on(&local),
            "placed at configure",
        ),
        (&configured, "main", host_on(&all), "host"),
        (&released, "blas", worker_on(&all), "restored"),
    ]);
    let n = 1 + blas;
    says(&end.stderr, &[&format!("({n}/{n} threads)")]);

    let (blas, [_, configured, _], _) =
        blas_run(&sysfs, "host-first", &[("OPENBLAS_NUM_THREADS", "1")]);
    assert_eq!(blas, 0, "OPENBLAS_NUM_THREADS=1 starts no pool");
    expect(
        &configured,
        Matching(&["worker"]),
        worker_on(&local),
        "BLAS runs on the worker itself",
    );
}

/// OpenMP binding its own threads (OMP_PROC_BIND=close, OMP_PLACES=cores): libgomp gives every
/// pool thread an affinity in its pthread_attr_t and moves the calling thread itself, so they
/// are `explicit` — the caller's choice, never overridden and never restored (SPEC §2). The
/// worker's team keeps libgomp's one-core places through configure and release; docs/runtimes.md
/// says to leave these variables unset in a shared process.
#[test]
fn openmp_proc_bind_places_are_explicit() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let mut cmd = python_with_runtimes(&sysfs, "openmp_own_binding.py");
    cmd.env("OMP_PROC_BIND", "close").env("OMP_PLACES", "cores");
    let mut run = Driver::spawn(cmd, DEADLINE);
    let configured = run.phase();
    run.proceed();
    let released = run.phase();
    let end = run.succeed();
    for phase in [&configured, &released] {
        println!("OMP_PROC_BIND=close {}", describe(phase));
    }
    let reports: Vec<serde_json::Value> = end
        .stderr
        .lines()
        .filter_map(|l| l.strip_prefix("PLACEMENTS "))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reports.len(), 2, "{}", end.stderr);
    for prefix in ["worker_omp", "host_omp", "worker"] {
        for (name, seen) in named(&configured, prefix) {
            assert_eq!(
                seen.mask.count(),
                1,
                "{name}: libgomp bound it to one core's place"
            );
            assert_eq!(
                released.thread(name).mask,
                seen.mask,
                "{name}: release leaves an explicit placement alone"
            );
            for report in &reports {
                assert_eq!(report[seen.tid.to_string()], "explicit", "{name}: {report}");
            }
        }
    }
    for name in ["worker_omp1", "worker_omp2"] {
        assert_eq!(configured.role(name), 1, "{name} is still a worker");
    }
    assert!(
        end.stderr.contains("restored 0 threads"),
        "nothing to restore: {}",
        end.stderr
    );
}

/// Threads born while configure sweeps the process: a child of the worker thread keeps
/// creating threads while the worker configures. Each is a descendant of the worker, so each
/// ends up a worker on the GPU-local set — born before configure (promoted), after it
/// (inherited), or across it (planned as a host by a creator that configure then promoted: the
/// library promotes it when it registers). Several runs, as the crossing is a matter of timing.
#[test]
fn threads_born_while_configure_sweeps_are_workers() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let local = sysfs.node1.to_list();
    let program = Program::c("births_during_configure").build();
    for round in 0..8 {
        let mut cmd = preloaded(&program, &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", "warn");
        let mut run = Driver::spawn(cmd, DEADLINE);
        let configured = run.phase();
        run.succeed();
        assert!(configured.threads.len() > 20, "{}", describe(&configured));
        let wrong: Vec<String> = configured
            .threads
            .iter()
            .filter(|(_, t)| t.role != 1 || t.mask.to_list() != local)
            .map(|(n, t)| format!("{n} (tid {}) role {} [{}]", t.tid, t.role, t.mask))
            .collect();
        assert!(
            wrong.is_empty(),
            "round {round}: descendants of the worker left out of configure: {wrong:?}"
        );
    }
}
