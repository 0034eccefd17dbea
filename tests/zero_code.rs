//! The four shared-process deployments of seeds/shared-process-affinity-never-restored.txt and
//! the sequential LLMs of seeds/configure-not-idempotent.txt, run as an unmodified user runs
//! them: the apps of tests/programs/zero_code import only `tensorrt_llm` (the upstream-shaped
//! stand-in of tests/programs/upstream_trtllm, which pins every thread and never restores) and
//! the test instrumentation, never `tllm_affinity`. Each app runs three ways:
//!
//! * under `tllm-affinity run --sysfs-root <tree> -- python app.py` (the CLI's start-up hook);
//! * under a plain `LD_PRELOAD=<lib>` with the interpreter of a venv where `pip` installed the
//!   repo's `python/` package (its `.pth` start-up hook);
//! * with no library at all: upstream's behaviour, which these tests also assert, so that they
//!   prove the fixture reproduces the bug (host threads pinned, nothing restored).
//!
//! At each phase the app lists every thread it has (phases.py's `census`: Python threads by name,
//! native threads by the name their library gave them) and the test reads each one's mask from
//! `/proc`; every run prints its table (`cargo test --test zero_code -- --nocapture`).
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1. With two CPUs:
//! node0 = {0}, node1 = {1}.

mod common;

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    /// `tllm-affinity run --sysfs-root <tree> -- python app.py`.
    Run,
    /// `LD_PRELOAD=<lib>` and the pip-installed package's interpreter.
    Preload,
    /// No library: upstream's behaviour.
    Upstream,
}

impl Way {
    fn library(self) -> bool {
        self != Way::Upstream
    }

    fn label(self) -> &'static str {
        match self {
            Way::Run => "under `tllm-affinity run`",
            Way::Preload => "under LD_PRELOAD, package pip-installed",
            Way::Upstream => "without the library (upstream)",
        }
    }
}

/// `script` of tests/programs/zero_code run `way` on `sysfs`, under `taskset -c <pin>` when
/// given; stand-in and instrumentation on PYTHONPATH, nothing of `tllm_affinity` there.
fn app(way: Way, sysfs: &Sysfs, script: &str, pin: Option<&str>) -> Command {
    let interpreter = match way {
        Way::Preload => installed_python(),
        _ => python(),
    };
    let mut argv: Vec<OsString> = Vec::new();
    if let Some(cpus) = pin {
        argv.extend(["taskset", "-c", cpus].map(OsString::from));
    }
    if way == Way::Run {
        argv.push(cli().into());
        argv.extend(["run", "--sysfs-root"].map(OsString::from));
        argv.push(sysfs.path().into());
        argv.extend(["--log", "info", "--"].map(OsString::from));
    }
    argv.push(interpreter.into());
    argv.push(programs_dir().join("zero_code").join(script).into());
    let mut cmd = clean(&argv[0]);
    cmd.args(&argv[1..]);
    let path = std::env::join_paths([programs_dir().join("upstream_trtllm"), programs_dir()]);
    with_openmp(&mut cmd)
        .env("PYTHONPATH", path.unwrap())
        .env("TLLM_LOG_LEVEL", "info")
        .env_remove("VIRTUAL_ENV")
        .env_remove("PYTHONHOME");
    if way != Way::Run {
        // `run` sets it from --sysfs-root; the stand-in reads it too, in place of NVML.
        cmd.env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path());
    }
    if way == Way::Preload {
        cmd.env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_LOG", "info");
    }
    cmd
}

// ---- Reading the phases ----

/// Without the library every role reads -1.
fn no_roles(phases: &[&Phase]) {
    for phase in phases {
        for (name, seen) in &phase.threads {
            assert_eq!(seen.role, -1, "{} {name}: no library, no role", phase.name);
        }
    }
}

/// The threads of `phase` that were not alive (by tid) in `earlier`.
fn born_since(phase: &Phase, earlier: &Phase) -> BTreeSet<String> {
    let old: BTreeSet<i32> = earlier.threads.values().map(|t| t.tid).collect();
    phase
        .threads
        .iter()
        .filter(|(_, t)| !old.contains(&t.tid))
        .map(|(n, _)| n.clone())
        .collect()
}

/// Prints one run's per-thread table: a row per thread, a column per phase, each cell the
/// kernel mask and the library's role ("-": no library).
fn table(title: &str, phases: &[&Phase]) {
    let names: BTreeSet<&String> = phases.iter().flat_map(|p| p.threads.keys()).collect();
    let width = names.iter().map(|n| n.len()).max().unwrap_or(6).max(6);
    println!("\n{title}");
    let mut header = format!("  {:width$}", "thread");
    for phase in phases {
        header.push_str(&format!("  {:<12}", phase.name));
    }
    println!("{}", header.trim_end());
    for name in names {
        let mut row = format!("  {name:width$}");
        for phase in phases {
            let cell = match phase.threads.get(name) {
                Some(t) => {
                    let role = match t.role {
                        0 => "host".to_string(),
                        1 => "worker".to_string(),
                        -1 => "-".to_string(),
                        e => e.to_string(),
                    };
                    format!("{} {role}", t.mask.to_list())
                }
                None => ".".to_string(),
            };
            row.push_str(&format!("  {cell:<12}"));
        }
        println!("{}", row.trim_end());
    }
}

/// The app's next phase, less the threads that were exiting when it listed them (gone 50 ms
/// later): a worker's OpenMP pool winds down on its own after its owner thread has exited.
fn settled(run: &mut Driver) -> Phase {
    let mut phase = run.phase();
    std::thread::sleep(Duration::from_millis(50));
    let pid = run.pid();
    phase
        .threads
        .retain(|_, t| try_kernel_mask(pid, t.tid).is_some());
    phase
}

/// An HTTP app through its five phases: before, `PORT <n>`, during (then the test sends
/// `GET /generate/a`), serving, shutdown (then `GET /generate/b`), after; the phases (settled),
/// the end and the two responses.
fn serve_two_requests(cmd: Command) -> ([Phase; 5], Finished, String, String) {
    let mut run = Driver::spawn(cmd, LIMIT);
    let before = settled(&mut run);
    run.proceed();
    let port: u16 = run.after("PORT ").parse().unwrap();
    let during = settled(&mut run);
    let a = http_get(port, "/generate/a");
    run.proceed();
    let serving = settled(&mut run);
    run.proceed();
    let shutdown = settled(&mut run);
    let b = http_get(port, "/generate/b");
    run.proceed();
    let after = settled(&mut run);
    let end = run.finish();
    let phases = [before, during, serving, shutdown, after];
    (phases, end, a.join().unwrap(), b.join().unwrap())
}

/// Runs a program through its `N` phases (settled) with no action in between.
fn all_phases<const N: usize>(cmd: Command) -> ([Phase; N], Finished) {
    Driver::spawn(cmd, LIMIT).phases_with(settled)
}

/// Upstream's own log line, with the GPU-local CPUs as the Python list it prints.
fn upstream_numa_line(cpus: &tllm_affinity_core::mask::CpuMask) -> String {
    let list: Vec<usize> = cpus.iter().collect();
    format!("CPU affinity set to {list:?} for optimal NUMA-aware scheduling")
}

/// Without the library: the sweep pinned every thread of the process, host threads included,
/// from the worker's configure on, and nothing was restored.
fn upstream_pinned_everything(phases: &[&Phase], local: &str, end: &Finished, sysfs: &Sysfs) {
    no_roles(phases);
    for phase in &phases[1..] {
        expect(
            phase,
            All,
            on(local),
            "upstream pins every thread of the process, never restores",
        );
    }
    assert!(
        end.stderr.contains(&upstream_numa_line(&sysfs.node1)),
        "upstream's configure ran:\n{}",
        end.stderr
    );
}

// ---- Deployment 1: single-process TP1 worker in the HTTP server's process ----

/// The main thread builds the LLM (the worker's threads and the main thread's OpenMP pool are
/// born in the worker scope), then serves HTTP: the loop's executor threads, born after the LLM,
/// are host threads; shutdown on the main thread restores the pool it kept.
fn tp1_http_server(way: Way) {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let mut cmd = app(way, &sysfs, "tp1_http_server.py", None);
    cmd.env("TLLM_WORKER_USE_SINGLE_PROCESS", "1");
    let ([before, during, serving, shutdown, after], end, a, b) = serve_two_requests(cmd);
    let phases = [&before, &during, &serving, &shutdown, &after];
    table(&format!("tp1 HTTP server {}", way.label()), &phases);
    assert!(end.status.success(), "{}", end.stderr);
    assert!(a.contains(r#""engine": true"#), "the LLM answered a: {a}");
    assert!(
        b.contains(r#""engine": false"#),
        "no LLM after shutdown: {b}"
    );

    expect(&before, All, on(&all), "nothing configured yet");
    present(&before, &["main", "user_metrics"]);
    present(&during, &["main", "user_metrics", "executor_loop"]);
    present(&during, &["await_response_thread", "engine_omp"]);
    present(&serving, &["stats_thread", "loop_omp", "asyncio_", "req_a"]);
    present(&after, &["req_b"]);
    assert!(
        born_since(&serving, &during).contains("req_a"),
        "the loop's executor thread was born after the LLM"
    );
    assert!(born_since(&after, &shutdown).contains("req_b"));
    if !way.library() {
        upstream_pinned_everything(&phases, &local, &end, &sysfs);
        return;
    }
    placed(&before, &TP1_WORKERS, &all, &all, "no worker yet");
    placed(&during, &TP1_WORKERS, &local, &all, "built in the scope");
    placed(&serving, &TP1_WORKERS, &local, &all, "serving");
    placed(&shutdown, &TP1_WORKERS, &all, &all, "restored at shutdown");
    placed(&after, &TP1_WORKERS, &all, &all, "after the worker's life");
    present(&shutdown, &["engine_omp"]);
    assert!(
        a.contains(r#""handler_role": 0"#),
        "a host thread served a: {a}"
    );
}

#[test]
fn tp1_under_run_pins_only_the_worker() {
    tp1_http_server(Way::Run);
}

#[test]
fn tp1_under_preload_pins_only_the_worker() {
    tp1_http_server(Way::Preload);
}

#[test]
fn tp1_without_the_library_pins_the_whole_server_and_never_restores() {
    tp1_http_server(Way::Upstream);
}

// ---- Deployment 2: an externally supplied MpiCommSession, rank 0 ----

/// worker_main configures on the session's first pool thread: it and the engine it starts are
/// workers; the user's script (main, its loop thread and the loop's executor, grown during the
/// lease), the proxy's dispatch thread and the session's second pool thread are hosts.
fn mpi_session_rank0(way: Way) {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let (phases, end) = all_phases::<5>(app(way, &sysfs, "mpi_session_rank0.py", None));
    let [before, during, serving, shutdown, after] = &phases;
    let phases = [before, during, serving, shutdown, after];
    table(&format!("MpiCommSession rank 0 {}", way.label()), &phases);
    assert!(end.status.success(), "{}", end.stderr);

    expect(before, All, on(&all), "nothing configured yet");
    present(before, &["main", "user_loop", "user_pool0"]);
    present(during, &["ThreadPoolExecutor-*_0", "executor_loop"]);
    present(
        during,
        &["await_response_thread", "proxy_dispatch_result_thread"],
    );
    present(
        serving,
        &["ThreadPoolExecutor-*_1", "stats_thread", "user_pool_grown"],
    );
    assert!(
        born_since(serving, during).contains("user_pool_grown"),
        "the user's loop grew its executor during the lease"
    );
    if !way.library() {
        upstream_pinned_everything(&phases, &local, &end, &sysfs);
        return;
    }
    placed(before, &SESSION_WORKERS, &all, &all, "no worker yet");
    placed(during, &SESSION_WORKERS, &local, &all, "rank 0's worker");
    placed(serving, &SESSION_WORKERS, &local, &all, "serving");
    placed(
        shutdown,
        &SESSION_WORKERS,
        &all,
        &all,
        "restored at shutdown",
    );
    placed(
        after,
        &SESSION_WORKERS,
        &all,
        &all,
        "after the worker's life",
    );
    present(shutdown, &["ThreadPoolExecutor-*_0"]);
}

#[test]
fn mpi_session_rank0_under_run_pins_only_the_worker_pool_thread() {
    mpi_session_rank0(Way::Run);
}

#[test]
fn mpi_session_rank0_under_preload_pins_only_the_worker_pool_thread() {
    mpi_session_rank0(Way::Preload);
}

#[test]
fn mpi_session_rank0_without_the_library_pins_the_users_script() {
    mpi_session_rank0(Way::Upstream);
}

// ---- Deployment 3: external-launch VisualGen, rank 0, under an HTTP server ----

/// How a VisualGen run is set up.
#[derive(Clone, Copy, Debug)]
enum Visual {
    /// No constraint, upstream's configure alone.
    Unconstrained,
    /// Upstream's re-sweep helper called by the worker once its threads are started.
    Resweep,
    /// Under `taskset -c <node0's first CPU>`, TLLM_NUMA_AWARE_WORKER_AFFINITY unset or set.
    Taskset(Option<&'static str>),
}

/// Two sequential LLMs (two `BaseWorker`s) are built, used and shut down on the main thread,
/// then the VisualGen client: its worker thread runs upstream's module-level
/// `run_diffusion_worker`, which configures: it, its pool and its post-processing thread are
/// workers; the HTTP server (main) and its request threads, the control thread, the coordinator
/// started before the worker and the executor threads its loop grows are hosts. The lease ends
/// when `run_diffusion_worker` returns (the client's shutdown): every mask is back on the launch
/// mask while the process goes on serving, and a thread born after (req_b) is not pinned.
fn visualgen_rank0(way: Way, visual: Visual) {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let pinned = sysfs.node0.iter().next().unwrap().to_string();
    let (launch, local, setting) = match visual {
        Visual::Taskset(None) => (
            pinned.clone(),
            allowed_cpus().to_list(),
            "taskset, policy unset",
        ),
        Visual::Taskset(Some(_)) => (pinned.clone(), sysfs.node1.to_list(), "taskset, policy =1"),
        Visual::Resweep => (allowed_cpus().to_list(), sysfs.node1.to_list(), "re-sweep"),
        Visual::Unconstrained => (
            allowed_cpus().to_list(),
            sysfs.node1.to_list(),
            "unconstrained",
        ),
    };
    let taskset = matches!(visual, Visual::Taskset(_)).then_some(pinned.as_str());
    let mut cmd = app(way, &sysfs, "visualgen_rank0.py", taskset);
    cmd.env("TLLM_WORKER_USE_SINGLE_PROCESS", "1");
    if let Visual::Taskset(Some(value)) = visual {
        cmd.env("TLLM_NUMA_AWARE_WORKER_AFFINITY", value);
    }
    if let Visual::Resweep = visual {
        cmd.env("RT_RESWEEP", "1");
    }
    let ([before, during, serving, shutdown, after], end, a, b) = serve_two_requests(cmd);
    let phases = [&before, &during, &serving, &shutdown, &after];
    table(
        &format!("VisualGen rank 0 ({setting}) {}", way.label()),
        &phases,
    );
    assert!(end.status.success(), "{}", end.stderr);
    assert!(a.contains("denoised"), "the worker answered a: {a}");
    assert!(
        b.contains(r#""image": null"#),
        "no executor after shutdown: {b}"
    );

    expect(&before, All, on(&launch), "nothing configured yet");
    present(&before, &["main", "control"]);
    present(&during, &["visual_gen_coordinator", "visual_gen_worker"]);
    present(&during, &["visual_gen_postprocess", "visual_omp"]);
    present(&serving, &["req_a", "asyncio_"]);
    present(&after, &["req_b"]);
    assert!(born_since(&after, &shutdown).contains("req_b"));
    if !way.library() {
        upstream_pinned_everything(&phases, &local, &end, &sysfs);
        return;
    }
    placed(
        &before,
        &VISUALGEN_WORKERS,
        &launch,
        &launch,
        "both LLMs shut down, restored",
    );
    placed(
        &during,
        &VISUALGEN_WORKERS,
        &local,
        &launch,
        "the worker thread",
    );
    placed(&serving, &VISUALGEN_WORKERS, &local, &launch, "serving");
    placed(
        &shutdown,
        &VISUALGEN_WORKERS,
        &launch,
        &launch,
        "run_diffusion_worker returned: restored",
    );
    placed(
        &after,
        &VISUALGEN_WORKERS,
        &launch,
        &launch,
        "after the worker's life, still serving",
    );
    expect(
        &after,
        Named(&["req_b"]),
        host_on(&launch),
        "born after: not pinned",
    );
    assert!(
        a.contains(r#""handler_role": 0"#),
        "a host thread served a: {a}"
    );
}

#[test]
fn visualgen_rank0_under_run_spares_the_coordinator_and_the_http_server() {
    visualgen_rank0(Way::Run, Visual::Unconstrained);
}

#[test]
fn visualgen_rank0_under_preload_spares_the_coordinator_and_the_http_server() {
    visualgen_rank0(Way::Preload, Visual::Unconstrained);
}

#[test]
fn visualgen_rank0_without_the_library_pins_the_coordinator_and_the_http_server() {
    visualgen_rank0(Way::Upstream, Visual::Unconstrained);
}

#[test]
fn visualgen_rank0_with_upstreams_resweep_restores_when_the_worker_function_returns() {
    visualgen_rank0(Way::Run, Visual::Resweep);
}

#[test]
fn visualgen_rank0_under_taskset_policy_unset_restores_the_launch_mask() {
    require!(on_path("taskset"), "`taskset` on PATH");
    visualgen_rank0(Way::Run, Visual::Taskset(None));
}

#[test]
fn visualgen_rank0_under_taskset_policy_1_restores_the_launch_mask() {
    require!(on_path("taskset"), "`taskset` on PATH");
    visualgen_rank0(Way::Run, Visual::Taskset(Some("1")));
}

// ---- Deployment 4: the leader of a multi-node launch ----

/// Rank 0's worker on the session's first pool thread, its engine and every native progress
/// thread (started in libnccl.so.2 by main before configure, by the session server before and
/// during the lease, by the worker) are workers: NUMA pinning stays effective for the leader;
/// main, the control thread, the session server and the session's second pool thread are hosts.
fn leader(way: Way) {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let mut cmd = app(way, &sysfs, "leader.py", None);
    cmd.env("RT_NCCL", Program::c("nccl").shared().build())
        .env("RT_SPAWN", Program::c("progress_threads").shared().build())
        .env_remove("TLLM_AFFINITY_WORKER_LIBS");
    let (phases, end) = all_phases::<5>(cmd);
    let [before, during, serving, shutdown, after] = &phases;
    let phases = [before, during, serving, shutdown, after];
    table(&format!("multi-node leader {}", way.label()), &phases);
    assert!(end.status.success(), "{}", end.stderr);

    expect(before, All, on(&all), "nothing configured yet");
    present(
        before,
        &["main", "control", "session_server", "mpi_progress"],
    );
    present(
        during,
        &["ThreadPoolExecutor-*_0", "executor_loop", "nccl_progress"],
    );
    present(during, &["mpi_req1"]);
    present(serving, &["ThreadPoolExecutor-*_1", "mpi_req2"]);
    present(after, &["mpi_req3"]);
    assert!(born_since(serving, during).contains("mpi_req2"));
    assert!(born_since(after, shutdown).contains("mpi_req3"));
    if !way.library() {
        upstream_pinned_everything(&phases, &local, &end, &sysfs);
        return;
    }
    // mpi_progress is a worker by TLLM_AFFINITY_WORKER_LIBS before anything is configured.
    placed(before, &LEADER_WORKERS, &all, &all, "no lease yet");
    placed(during, &LEADER_WORKERS, &local, &all, "rank 0's threads");
    placed(
        serving,
        &LEADER_WORKERS,
        &local,
        &all,
        "mpi_req2 born on the worker set",
    );
    placed(
        shutdown,
        &LEADER_WORKERS,
        &all,
        &all,
        "restored at shutdown",
    );
    placed(
        after,
        &LEADER_WORKERS,
        &all,
        &all,
        "mpi_req3 born on the restored mask",
    );
}

#[test]
fn leader_under_run_pins_rank0_and_progress_threads_not_the_session_server() {
    leader(Way::Run);
}

#[test]
fn leader_under_preload_pins_rank0_and_progress_threads_not_the_session_server() {
    leader(Way::Preload);
}

#[test]
fn leader_without_the_library_pins_the_session_server() {
    leader(Way::Upstream);
}

// ---- Sequential LLMs (seeds/configure-not-idempotent.txt) ----

const TWO_LLMS_PHASES: usize = 6;

fn two_llms(way: Way) {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let mut cmd = app(way, &sysfs, "two_llms.py", None);
    cmd.env("TLLM_WORKER_USE_SINGLE_PROCESS", "1");
    let (phases, end) = all_phases::<TWO_LLMS_PHASES>(cmd);
    let [before, first, second, first_down, third, last] = &phases;
    let phases = [before, first, second, first_down, third, last];
    table(&format!("sequential LLMs {}", way.label()), &phases);
    assert!(end.status.success(), "{}", end.stderr);
    present(second, &["executor_loop#2", "stats_thread"]);
    present(third, &["executor_loop#2"]);

    if !way.library() {
        no_roles(&phases);
        expect(
            first,
            All,
            on(&local),
            "upstream's first call pins every thread",
        );
        expect(
            second,
            All,
            on(&all),
            "upstream's second call takes its own pin for a constraint and un-pins every thread",
        );
        assert!(
            end.stderr.contains("Removing CPU affinity constraints"),
            "upstream's false warning:\n{}",
            end.stderr
        );
        return;
    }
    placed(before, &TP1_WORKERS, &all, &all, "no LLM yet");
    placed(first, &TP1_WORKERS, &local, &all, "the first LLM");
    placed(
        second,
        &TP1_WORKERS,
        &local,
        &all,
        "both LLMs, stats_thread born between",
    );
    placed(
        first_down,
        &TP1_WORKERS,
        &local,
        &all,
        "the second LLM still open",
    );
    placed(
        third,
        &TP1_WORKERS,
        &local,
        &all,
        "built after the first shut down",
    );
    placed(last, &TP1_WORKERS, &all, &all, "every LLM shut down");
    for line in end.stderr.lines() {
        assert!(
            !line.contains("constrained") && !line.contains("Removing CPU affinity constraints"),
            "no constraint to report: {line}\n{}",
            end.stderr
        );
    }
}

#[test]
fn sequential_llms_under_run_stay_pinned_with_no_constrained_warning() {
    two_llms(Way::Run);
}

#[test]
fn sequential_llms_under_preload_stay_pinned_with_no_constrained_warning() {
    two_llms(Way::Preload);
}

#[test]
fn sequential_llms_without_the_library_unpin_at_the_second_llm() {
    two_llms(Way::Upstream);
}

// ---- The policy table under taskset ----

/// Under `taskset -c <first CPU>` (constrained: node0's first CPU only), the first LLM's worker
/// threads get the same masks with the library as upstream gives them after its first call, while
/// with the library the host threads keep the taskset mask.
fn policy_under_taskset(numa_aware: Option<&str>, upstream_gives: fn(&Sysfs) -> String) {
    require!(two_cpus("a constraint narrower than the host"));
    require!(on_path("taskset"), "`taskset` on PATH");
    let sysfs = Sysfs::two_nodes();
    let pinned = sysfs.node0.iter().next().unwrap().to_string();
    let first_phase = |way: Way| {
        let mut cmd = app(way, &sysfs, "two_llms.py", Some(&pinned));
        cmd.env("TLLM_WORKER_USE_SINGLE_PROCESS", "1");
        if let Some(value) = numa_aware {
            cmd.env("TLLM_NUMA_AWARE_WORKER_AFFINITY", value);
        }
        let (phases, end) = all_phases::<TWO_LLMS_PHASES>(cmd);
        assert!(end.status.success(), "{}", end.stderr);
        let first = phases.into_iter().nth(1).unwrap();
        let setting = numa_aware.map_or("unset".to_string(), |v| format!("={v}"));
        table(
            &format!(
                "TLLM_NUMA_AWARE_WORKER_AFFINITY {setting}, taskset -c {pinned}, first LLM {}",
                way.label()
            ),
            &[&first],
        );
        first
    };
    let with = first_phase(Way::Run);
    let without = first_phase(Way::Upstream);

    let workers = |phase: &Phase| -> Vec<(String, String)> {
        phase
            .threads
            .iter()
            .filter(|(n, _)| matches(n, &TP1_WORKERS))
            .map(|(n, t)| (n.clone(), t.mask.to_list()))
            .collect()
    };
    let expected = upstream_gives(&sysfs);
    for (name, mask) in workers(&without) {
        assert_eq!(
            mask, expected,
            "upstream's table, {name}: the fixture reproduces it"
        );
    }
    assert_eq!(
        workers(&with),
        workers(&without),
        "worker threads: the library gives what upstream gives"
    );
    present(&with, &["executor_loop", "engine_omp"]);
    placed(
        &with,
        &TP1_WORKERS,
        &expected,
        &pinned,
        "hosts keep the taskset mask",
    );
}

#[test]
fn policy_unset_under_taskset_clears_workers_as_upstream_and_keeps_hosts_on_the_constraint() {
    policy_under_taskset(None, |_| allowed_cpus().to_list());
}

#[test]
fn policy_numa_1_under_taskset_pins_workers_as_upstream_and_keeps_hosts_on_the_constraint() {
    policy_under_taskset(Some("1"), |sysfs| sysfs.node1.to_list());
}

#[test]
fn policy_0_under_taskset_leaves_workers_as_upstream_does_and_hosts_on_the_constraint() {
    policy_under_taskset(Some("0"), |sysfs| {
        sysfs.node0.iter().next().unwrap().to_string()
    });
}
