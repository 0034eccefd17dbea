//! The four shared-process deployments of seeds/shared-process-affinity-never-restored.txt
//! (issue #5, item 4; docs/runtimes.md), checked the same way on every tier
//! (tests/process/deployments.rs, tests/emulated/aarch64.rs): each as a Python program shaped like the
//! deployment (tests/programs/deploy_*.py over trtllm_shape.py, a shape-alike of the server's
//! worker plumbing, with the real `tllm_affinity` adapter in place of `configure_cpu_affinity`).
//! For each, the mask of every thread before, during and after the worker's life (released at
//! shutdown) is read from `/proc/<pid>/task/<tid>/status` and asserted.
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1. With two CPUs:
//! node0 = {0}, node1 = {1}.

use std::process::Command;
use std::time::Duration;

use super::tier::Tier;
use super::*;

/// `program` (tests/programs/deploy_*.py) run by this tier's Python under its library, with its
/// OpenMP region (see [`with_openmp_of`]) and its stand-ins for NCCL and a native progress-thread
/// spawner.
fn deployment(tier: &dyn Tier, sysfs: &Sysfs, program: &str) -> Command {
    let mut cmd = tier.preloaded(&tier.python(), sysfs);
    with_openmp_of(&mut cmd, tier.openmp_library())
        .arg(programs_dir().join(program))
        .env("PYTHONPATH", repo().join("python"))
        .env("RT_NCCL", tier.shared_object("nccl", "libnccl.so.2"))
        .env(
            "RT_SPAWN",
            tier.shared_object("progress_threads", "libprogress_threads.so.2"),
        )
        .env_remove("TLLM_AFFINITY_WORKER_LIBS");
    cmd
}

/// An HTTP deployment through its five phases: `PORT <n>`, before, during (then the test sends
/// `GET /generate/a`), serving, shutdown (then `GET /generate/b`), after; the phases, the end and
/// the two responses.
fn serve_two_requests(cmd: Command, limit: Duration) -> ([Phase; 5], Finished, String, String) {
    let mut run = Driver::spawn(cmd, limit);
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

/// The five phases every deployment goes through, in order.
#[derive(Clone, Copy)]
pub enum At {
    Before,
    During,
    Serving,
    Shutdown,
    After,
}
use At::*;

/// The CPUs a rule expects: the launch mask, or the GPU-local set (node1).
#[derive(Clone, Copy)]
pub enum Cpus {
    Launch,
    Local,
}

/// One line of a deployment's table: in each phase of `at`, every thread `threads` matches is a
/// host (`worker == false`) or a worker on `cpus`.
pub struct Rule {
    pub at: &'static [At],
    pub threads: &'static [&'static str],
    pub worker: bool,
    pub cpus: Cpus,
    pub why: &'static str,
}

const fn host(at: &'static [At], threads: &'static [&'static str], why: &'static str) -> Rule {
    Rule {
        at,
        threads,
        worker: false,
        cpus: Cpus::Launch,
        why,
    }
}

const fn worker(
    at: &'static [At],
    threads: &'static [&'static str],
    cpus: Cpus,
    why: &'static str,
) -> Rule {
    Rule {
        at,
        threads,
        worker: true,
        cpus,
        why,
    }
}

const LEASE: &[At] = &[During, Serving];

/// A deployment: its program, whether it serves HTTP (then the test sends `GET /generate/a`
/// during the lease and `GET /generate/b` after shutdown), its table of rules and the checks
/// that are its own.
pub struct Deployment<'a> {
    pub label: &'static str,
    pub program: &'static str,
    pub http: bool,
    pub rules: &'a [Rule],
    pub own: fn(&Seen),
}

/// What a deployment's run left: its phases, its end, the two responses of an HTTP deployment
/// and the GPU-local set.
pub struct Seen {
    pub phases: [Phase; 5],
    pub end: Finished,
    pub a: String,
    pub b: String,
    pub local: String,
}

/// Runs `deployment` through its phases and checks what every deployment shares (the whole
/// process on the launch mask before configure, at shutdown and after; lease 1 released with
/// its masks restored; an HTTP deployment's worker answering, nothing after shutdown), its
/// table, then its own checks.
pub fn check(tier: &dyn Tier, deployment: &Deployment) {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let cmd = self::deployment(tier, &sysfs, deployment.program);
    let (phases, end, a, b) = if deployment.http {
        serve_two_requests(cmd, tier.limit(DEADLINE))
    } else {
        let (phases, end) = Driver::spawn(cmd, tier.limit(DEADLINE)).all_phases::<5>();
        (phases, end, String::new(), String::new())
    };
    assert!(end.status.success(), "{}", end.stderr);
    for phase in &phases {
        println!("{} {}", deployment.label, describe(phase));
    }
    let seen = Seen {
        phases,
        end,
        a,
        b,
        local,
    };
    let phase = |at: At| &seen.phases[at as usize];

    expect(phase(Before), All, on(&all), "nothing configured yet");
    expect(phase(Shutdown), All, on(&all), "restored at shutdown");
    expect(phase(After), All, on(&all), "after the worker's life");
    for rule in deployment.rules {
        let cpus = match rule.cpus {
            Cpus::Launch => &all,
            Cpus::Local => &seen.local,
        };
        let want = if rule.worker {
            worker_on(cpus)
        } else {
            host_on(cpus)
        };
        for at in rule.at {
            expect(phase(*at), Matching(rule.threads), want, rule.why);
        }
    }
    if deployment.http {
        let (a, b) = (&seen.a, &seen.b);
        assert!(a.starts_with("HTTP/1.0 200"), "{a}");
        assert!(a.contains(r#""role": 1"#), "a worker answered: {a}");
        assert!(b.contains(r#""by": null"#), "no worker after shutdown: {b}");
    }
    assert!(
        seen.end.stderr.contains("released lease 1: restored"),
        "{}",
        seen.end.stderr
    );
    (deployment.own)(&seen);
}

/// Deployment 1, single-process TP1 worker in the HTTP server's process: the event loop
/// (main), the host pool (a background task's thread, the threads requests run on, made
/// before, during and after the lease) keep the launch mask; the executor thread, the
/// engine's threads and its OpenMP pool get the GPU-local set and serve the request;
/// shutdown restores every mask.
pub const TP1: Deployment = Deployment {
    label: "tp1",
    program: "deploy_tp1_server.py",
    http: true,
    rules: &[
        host(&[Before], &["main", "host_pool0", "executor"], "host"),
        host(LEASE, &["main", "host_pool0"], "the server's threads"),
        worker(
            LEASE,
            &["executor", "executor_loop", "await_response", "engine_omp"],
            Cpus::Local,
            "the worker's threads",
        ),
        host(
            &[Serving],
            &["req_a"],
            "a request thread made during the lease",
        ),
        // The engine's threads were joined; the executor thread and its OpenMP pool
        // remain, restored; the server's threads never moved.
        worker(
            &[Shutdown],
            &["executor", "engine_omp"],
            Cpus::Launch,
            "restored",
        ),
        host(&[After], &["req_b"], "a request after shutdown"),
    ],
    own: |seen| {
        let serving = &seen.phases[Serving as usize];
        assert_ne!(
            serving.thread("req_a").tid,
            serving.thread("host_pool0").tid,
            "the pool grew for the request: a thread the event loop made during the lease"
        );
    },
};

/// Deployment 2, an externally supplied MpiCommSession, rank 0: the user's script (main,
/// its event loop's executor, grown during the lease), the proxy's dispatch and result
/// threads and the session's second pool thread keep the launch mask; worker_main's pool
/// thread and the engine's threads get the GPU-local set and answer the proxied request; at
/// shutdown the worker's pool thread, idle in the session's pool, is restored.
pub const MPI_SESSION: Deployment = Deployment {
    label: "mpi-session",
    program: "deploy_mpi_session.py",
    http: false,
    rules: &[
        host(&[Before, During, Serving], MPI_SCRIPT, "the user's script"),
        host(LEASE, &["session_pool1"], "the session's other pool thread"),
        worker(
            LEASE,
            &["session_worker", "executor_loop", "await_response"],
            Cpus::Local,
            "rank 0's worker",
        ),
        host(
            &[Serving],
            &["user_pool_grown"],
            "the user's loop grew its executor during the lease",
        ),
        host(&[Serving], &["user_pool_held"], "the user's loop executor"),
        worker(
            &[Shutdown],
            &["session_worker"],
            Cpus::Launch,
            "the worker's pool thread, idle, restored",
        ),
        host(&[Shutdown], MPI_SCRIPT, "never touched"),
    ],
    own: |seen| {
        // Two blocking calls ran at once on the loop's executor: two threads, one of them
        // made (by the loop's thread) during the lease.
        let (during, serving) = (
            &seen.phases[During as usize],
            &seen.phases[Serving as usize],
        );
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
    },
};

/// Deployment 3, external-launch VisualGen rank 0 under an HTTP server: the HTTP server
/// (main) and its request threads, the coordinator thread started before the worker, with
/// its own event loop and the executor threads it makes (before and during the lease), keep
/// the launch mask; the worker thread, the engine's threads and its OpenMP denoising pool
/// get the GPU-local set and answer the request relayed over loopback; shutdown restores
/// them.
pub const VISUALGEN: Deployment = Deployment {
    label: "visualgen",
    program: "deploy_visualgen.py",
    http: true,
    rules: &[
        host(&[Before], VISUALGEN_HOSTS, "host"),
        host(&[Before], &["worker"], "not a worker until it configures"),
        host(LEASE, VISUALGEN_HOSTS, "the server and the coordinator"),
        worker(
            LEASE,
            &["worker", "executor_loop", "await_response", "engine_omp"],
            Cpus::Local,
            "the diffusion worker",
        ),
        host(
            &[Serving],
            &["req_a", "coord_pool_a"],
            "the request's threads, made during the lease",
        ),
        worker(
            &[Shutdown],
            &["worker", "engine_omp"],
            Cpus::Launch,
            "restored",
        ),
        host(&[Shutdown], VISUALGEN_HOSTS, "never touched"),
        host(&[After], &["req_b"], "a request after shutdown"),
    ],
    own: |_| {},
};

/// Deployment 4, the leader of a multi-node launch: the session server thread, main and
/// the session's other pool thread keep the launch mask; rank 0's worker on the session
/// pool, the engine's threads and every native progress thread started from the
/// worker-libs object — by main before configure (MPI), by the worker (NCCL), by the
/// session server during the lease — get the GPU-local set: NUMA pinning stays effective
/// for the leader. Shutdown restores them all, and a progress thread started afterwards is
/// born on the launch mask.
pub const LEADER: Deployment = Deployment {
    label: "leader",
    program: "deploy_multinode_leader.py",
    http: false,
    rules: &[
        host(&[Before], LEADER_HOSTS, "host"),
        worker(
            &[Before],
            &["mpi_progress"],
            Cpus::Launch,
            "a worker by TLLM_AFFINITY_WORKER_LIBS, though main started it",
        ),
        host(LEASE, LEADER_HOSTS, "the leader's host threads"),
        host(LEASE, &["session_pool1"], "the session's other pool thread"),
        worker(
            LEASE,
            &[
                "leader_worker",
                "executor_loop",
                "await_response",
                "mpi_progress",
                "nccl_progress",
            ],
            Cpus::Local,
            "rank 0's worker threads",
        ),
        worker(
            &[Serving],
            &["late_progress"],
            Cpus::Local,
            "started by the session server during the lease: born on the worker set",
        ),
        worker(
            &[Shutdown],
            &[
                "leader_worker",
                "mpi_progress",
                "nccl_progress",
                "late_progress",
            ],
            Cpus::Launch,
            "restored, still workers",
        ),
        host(&[Shutdown], LEADER_HOSTS, "never touched"),
        worker(
            &[After],
            &["after_progress"],
            Cpus::Launch,
            "born after the last release: on the restored mask",
        ),
    ],
    own: |seen| {
        let local = &seen.local;
        assert!(
            seen.end.stderr.contains(&format!(
                "CPU affinity set to [{local}] for optimal NUMA-aware scheduling (2/2 threads)"
            )),
            "configure placed the worker and the progress thread main had started:\n{}",
            seen.end.stderr
        );
    },
};

pub const MPI_SCRIPT: &[&str] = &["main", "user_pool0", "proxy_dispatch", "proxy_result"];
pub const VISUALGEN_HOSTS: &[&str] = &["main", "coordinator", "coord_pool0"];
pub const LEADER_HOSTS: &[&str] = &["main", "session_server"];
