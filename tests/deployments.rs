//! The four shared-process deployments of seeds/shared-process-affinity-never-restored.txt
//! (issue #5, item 4; docs/runtimes.md), each as a Python program shaped like the deployment
//! (tests/programs/deploy_*.py over trtllm_shape.py, a shape-alike of the server's worker
//! plumbing, with the real `tllm_affinity` adapter in place of `configure_cpu_affinity`). For
//! each, the mask of every thread before, during and after the worker's life (released at
//! shutdown) is read from `/proc/<pid>/task/<tid>/status` and asserted.
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1. With two CPUs:
//! node0 = {0}, node1 = {1}.

mod common;

use std::process::Command;

use common::*;

fn deployment(sysfs: &Sysfs, program: &str) -> Command {
    let mut cmd = preloaded(python(), sysfs);
    with_openmp(&mut cmd)
        .arg(programs_dir().join(program))
        .env("PYTHONPATH", repo().join("python"))
        .env("RT_NCCL", Program::c("nccl").shared().build())
        .env("RT_SPAWN", Program::c("progress_threads").shared().build())
        .env_remove("TLLM_AFFINITY_WORKER_LIBS");
    cmd
}

/// An HTTP deployment through its five phases: `PORT <n>`, before, during (then the test sends
/// `GET /generate/a`), serving, shutdown (then `GET /generate/b`), after; the phases, the end and
/// the two responses.
fn serve_two_requests(cmd: Command) -> ([Phase; 5], Finished, String, String) {
    let mut run = Driver::spawn(cmd, DEADLINE);
    let port: u16 = run.after("PORT ").parse().unwrap();
    let before = run.phase();
    run.proceed();
    let during = run.phase();
    let a = http_get(port, "/generate/a");
    run.proceed();
    let serving = run.phase();
    run.proceed();
    let shutdown = run.phase();
    let b = http_get(port, "/generate/b");
    run.proceed();
    let after = run.phase();
    let end = run.finish();
    let phases = [before, during, serving, shutdown, after];
    (phases, end, a.join().unwrap(), b.join().unwrap())
}

fn record(deployment: &str, phases: &[&Phase]) {
    for phase in phases {
        println!("{deployment} {}", describe(phase));
    }
}

/// Deployment 1, single-process TP1 worker in the HTTP server's process: the event loop (main),
/// the host pool (a background task's thread, the threads requests run on, made before, during
/// and after the lease) keep the launch mask; the executor thread, the engine's threads and its
/// OpenMP pool get the GPU-local set and serve the request; shutdown restores every mask.
#[test]
fn tp1_worker_inside_the_http_server() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let ([before, during, serving, shutdown, after], end, a, b) =
        serve_two_requests(deployment(&sysfs, "deploy_tp1_server.py"));
    assert!(end.status.success(), "{}", end.stderr);
    record("tp1", &[&before, &during, &serving, &shutdown, &after]);

    expect(&before, All, on(&all), "nothing configured yet");
    expect(
        &before,
        Matching(&["main", "host_pool0", "executor"]),
        host_on(&all),
        "host",
    );

    for phase in [&during, &serving] {
        expect(
            phase,
            Matching(&["main", "host_pool0"]),
            host_on(&all),
            "the server's threads",
        );
        expect(
            phase,
            Matching(&["executor", "executor_loop", "await_response", "engine_omp"]),
            worker_on(&local),
            "the worker's threads",
        );
    }
    expect(
        &serving,
        Matching(&["req_a"]),
        host_on(&all),
        "a request thread made during the lease",
    );
    assert_ne!(
        serving.thread("req_a").tid,
        serving.thread("host_pool0").tid,
        "the pool grew for the request: a thread the event loop made during the lease"
    );

    // Shutdown: the engine's threads were joined; the executor thread and its OpenMP pool
    // remain, restored; the server's threads never moved.
    expect(&shutdown, All, on(&all), "restored at shutdown");
    expect(
        &shutdown,
        Matching(&["executor", "engine_omp"]),
        worker_on(&all),
        "restored",
    );
    expect(&after, All, on(&all), "after the worker's life");
    expect(
        &after,
        Matching(&["req_b"]),
        host_on(&all),
        "a request after shutdown",
    );

    assert!(a.starts_with("HTTP/1.0 200"), "{a}");
    assert!(
        a.contains(r#""role": 1"#),
        "the engine (a worker) answered: {a}"
    );
    assert!(b.contains(r#""by": null"#), "no engine after shutdown: {b}");
    assert!(
        end.stderr.contains("released lease 1: restored"),
        "{}",
        end.stderr
    );
}

/// Deployment 2, an externally supplied MpiCommSession, rank 0: the user's script (main, its
/// event loop's executor, grown during the lease), the proxy's dispatch and result threads and
/// the session's second pool thread keep the launch mask; worker_main's pool thread and the
/// engine's threads get the GPU-local set and answer the proxied request; at shutdown the
/// worker's pool thread, idle in the session's pool, is restored.
#[test]
fn mpi_comm_session_rank0_in_the_users_script() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let (phases, end) =
        Driver::spawn(deployment(&sysfs, "deploy_mpi_session.py"), DEADLINE).all_phases::<5>();
    assert!(end.status.success(), "{}", end.stderr);
    let [before, during, serving, shutdown, after] = &phases;
    record("mpi-session", &[before, during, serving, shutdown, after]);

    let script = ["main", "user_pool0", "proxy_dispatch", "proxy_result"];
    expect(before, All, on(&all), "nothing configured yet");
    expect(
        before,
        Matching(&script),
        host_on(&all),
        "the user's script",
    );
    for phase in [during, serving] {
        expect(phase, Matching(&script), host_on(&all), "the user's script");
        expect(
            phase,
            Matching(&["session_pool1"]),
            host_on(&all),
            "the session's other pool thread",
        );
        expect(
            phase,
            Matching(&["session_worker", "executor_loop", "await_response"]),
            worker_on(&local),
            "rank 0's worker",
        );
    }
    expect(
        serving,
        Matching(&["user_pool_grown"]),
        host_on(&all),
        "the user's loop grew its executor during the lease",
    );
    // Two blocking calls ran at once on the loop's executor: two threads, one of them made
    // (by the loop's thread) during the lease.
    let held = serving.thread("user_pool_held").tid;
    let grown = serving.thread("user_pool_grown").tid;
    assert_ne!(held, grown, "{}", describe(serving));
    assert!(
        [held, grown]
            .iter()
            .any(|tid| during.threads.values().all(|t| t.tid != *tid)),
        "the executor grew during the lease: {}",
        describe(serving)
    );
    expect(
        serving,
        Matching(&["user_pool_held"]),
        host_on(&all),
        "the user's loop executor",
    );

    expect(shutdown, All, on(&all), "restored at shutdown");
    expect(
        shutdown,
        Matching(&["session_worker"]),
        worker_on(&all),
        "the worker's pool thread, idle, restored",
    );
    expect(shutdown, Matching(&script), host_on(&all), "never touched");
    expect(after, All, on(&all), "after the worker's life");
    assert!(
        end.stderr.contains("released lease 1: restored"),
        "{}",
        end.stderr
    );
}

/// Deployment 3, external-launch VisualGen rank 0 under an HTTP server: the HTTP server (main)
/// and its request threads, the coordinator thread started before the worker, with its own
/// event loop and the executor threads it makes (before and during the lease), keep the launch
/// mask; the worker thread, the engine's threads and its OpenMP denoising pool get the
/// GPU-local set and answer the request relayed over loopback; shutdown restores them.
#[test]
fn visualgen_rank0_coordinator_started_before_the_worker() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let ([before, during, serving, shutdown, after], end, a, b) =
        serve_two_requests(deployment(&sysfs, "deploy_visualgen.py"));
    assert!(end.status.success(), "{}", end.stderr);
    record(
        "visualgen",
        &[&before, &during, &serving, &shutdown, &after],
    );

    let hosts = ["main", "coordinator", "coord_pool0"];
    expect(&before, All, on(&all), "nothing configured yet");
    expect(&before, Matching(&hosts), host_on(&all), "host");
    expect(
        &before,
        Matching(&["worker"]),
        host_on(&all),
        "not a worker until it configures",
    );
    for phase in [&during, &serving] {
        expect(
            phase,
            Matching(&hosts),
            host_on(&all),
            "the server and the coordinator",
        );
        expect(
            phase,
            Matching(&["worker", "executor_loop", "await_response", "engine_omp"]),
            worker_on(&local),
            "the diffusion worker",
        );
    }
    expect(
        &serving,
        Matching(&["req_a", "coord_pool_a"]),
        host_on(&all),
        "the request's threads, made during the lease",
    );

    expect(&shutdown, All, on(&all), "restored at shutdown");
    expect(
        &shutdown,
        Matching(&["worker", "engine_omp"]),
        worker_on(&all),
        "restored",
    );
    expect(&shutdown, Matching(&hosts), host_on(&all), "never touched");
    expect(&after, All, on(&all), "after the worker's life");
    expect(
        &after,
        Matching(&["req_b"]),
        host_on(&all),
        "a request after shutdown",
    );

    assert!(a.starts_with("HTTP/1.0 200"), "{a}");
    assert!(a.contains(r#""role": 1"#), "the worker denoised: {a}");
    assert!(b.contains(r#""by": null"#), "{b}");
    assert!(
        end.stderr.contains("released lease 1: restored"),
        "{}",
        end.stderr
    );
}

/// Deployment 4, the leader of a multi-node launch: the session server thread, main and the
/// session's other pool thread keep the launch mask; rank 0's worker on the session pool, the
/// engine's threads and every native progress thread started from the worker-libs object —
/// by main before configure (MPI), by the worker (NCCL), by the session server during the
/// lease — get the GPU-local set: NUMA pinning stays effective for the leader. Shutdown
/// restores them all, and a progress thread started afterwards is born on the launch mask.
#[test]
fn multi_node_leader_session_server_and_progress_threads() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let (phases, end) =
        Driver::spawn(deployment(&sysfs, "deploy_multinode_leader.py"), DEADLINE).all_phases::<5>();
    assert!(end.status.success(), "{}", end.stderr);
    let [before, during, serving, shutdown, after] = &phases;
    record("leader", &[before, during, serving, shutdown, after]);

    let hosts = ["main", "session_server"];
    expect(before, All, on(&all), "nothing configured yet");
    expect(before, Matching(&hosts), host_on(&all), "host");
    expect(
        before,
        Matching(&["mpi_progress"]),
        worker_on(&all),
        "a worker by TLLM_AFFINITY_WORKER_LIBS, though main started it",
    );
    let workers = [
        "leader_worker",
        "executor_loop",
        "await_response",
        "mpi_progress",
        "nccl_progress",
    ];
    for phase in [during, serving] {
        expect(
            phase,
            Matching(&hosts),
            host_on(&all),
            "the leader's host threads",
        );
        expect(
            phase,
            Matching(&["session_pool1"]),
            host_on(&all),
            "the session's other pool thread",
        );
        expect(
            phase,
            Matching(&workers),
            worker_on(&local),
            "rank 0's worker threads",
        );
    }
    expect(
        serving,
        Matching(&["late_progress"]),
        worker_on(&local),
        "started by the session server during the lease: born on the worker set",
    );

    expect(shutdown, All, on(&all), "restored at shutdown");
    expect(
        shutdown,
        Matching(&[
            "leader_worker",
            "mpi_progress",
            "nccl_progress",
            "late_progress",
        ]),
        worker_on(&all),
        "restored, still workers",
    );
    expect(shutdown, Matching(&hosts), host_on(&all), "never touched");
    expect(
        after,
        Matching(&["after_progress"]),
        worker_on(&all),
        "born after the last release: on the restored mask",
    );
    expect(after, All, on(&all), "after the worker's life");
    assert!(
        end.stderr.contains(&format!(
            "CPU affinity set to [{local}] for optimal NUMA-aware scheduling (2/2 threads)"
        )),
        "configure placed the worker and the progress thread main had started:\n{}",
        end.stderr
    );
    assert!(
        end.stderr.contains("released lease 1: restored"),
        "{}",
        end.stderr
    );
}
