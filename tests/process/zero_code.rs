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
//! The TP1 server also runs where the hook must find the library or reach the interpreter by
//! other means: the library copied to another file name (`libaffinity-site.so`), preloaded or
//! named by `TLLM_AFFINITY_LIB` under `run` (the hook asks the process for the library's symbol,
//! never a file name); under `run` with `python -E` and `python -I`, which ignore `PYTHONPATH`
//! (the installed package's `.pth` brings the hook); and embedded in a C program through libpython.
//!
//! At each phase the app lists every thread it has (phases.py's `census`: Python threads by name,
//! native threads by the name their library gave them) and the test reads each one's mask from
//! `/proc`; every run prints its table (`cargo test --test process -- zero_code:: --nocapture`).
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1. With two CPUs:
//! node0 = {0}, node1 = {1}.

use crate::common;

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    /// `tllm-affinity run --sysfs-root <tree> -- python app.py`.
    Run,
    /// `LD_PRELOAD=<lib>` and the pip-installed package's interpreter.
    Preload,
    /// As `Preload`, the library copied to another file name (`libaffinity-site.so`): a site's
    /// renamed or versioned copy.
    PreloadRenamed,
    /// As `Run`, with `TLLM_AFFINITY_LIB` naming the renamed copy.
    RunRenamed,
    /// As `Run`, the pip-installed package's interpreter started with this flag (`-E`, `-I`),
    /// which ignores `PYTHONPATH`: only the package's `.pth` brings the hook.
    RunIgnoringPythonPath(&'static str),
    /// As `Run`, the app run by tests/programs/embedded_python.c, which embeds CPython through
    /// libpython (`Py_Initialize`, `PyRun_SimpleFile`), as a C++ server's Python backend does.
    RunEmbedded,
    /// No library: upstream's behaviour.
    Upstream,
}

impl Way {
    fn library(self) -> bool {
        self != Way::Upstream
    }

    fn under_run(self) -> bool {
        matches!(
            self,
            Way::Run | Way::RunRenamed | Way::RunIgnoringPythonPath(_) | Way::RunEmbedded
        )
    }

    /// The pip-installed package's interpreter (its `.pth` runs the hook), not the build tree's.
    fn installed(self) -> bool {
        matches!(
            self,
            Way::Preload | Way::PreloadRenamed | Way::RunIgnoringPythonPath(_)
        )
    }

    fn label(self) -> &'static str {
        match self {
            Way::Run => "under `tllm-affinity run`",
            Way::Preload => "under LD_PRELOAD, package pip-installed",
            Way::PreloadRenamed => "under LD_PRELOAD=libaffinity-site.so, package pip-installed",
            Way::RunRenamed => "under `tllm-affinity run`, TLLM_AFFINITY_LIB=libaffinity-site.so",
            Way::RunIgnoringPythonPath("-E") => "under `tllm-affinity run`, python -E",
            Way::RunIgnoringPythonPath(_) => "under `tllm-affinity run`, python -I",
            Way::RunEmbedded => "under `tllm-affinity run`, embedded in a C program",
            Way::Upstream => "without the library (upstream)",
        }
    }
}

/// The library copied to a file name that says nothing of `libtllm_affinity`, as a site's
/// renamed or versioned copy (made once per test binary, renamed into place).
fn renamed_library() -> PathBuf {
    static COPY: OnceLock<PathBuf> = OnceLock::new();
    COPY.get_or_init(|| {
        let dir = target_dir().join("renamed-library");
        std::fs::create_dir_all(&dir).unwrap();
        let copy = dir.join(format!(".libaffinity-site.so.{}", std::process::id()));
        std::fs::copy(library(), &copy).unwrap();
        let renamed = dir.join("libaffinity-site.so");
        std::fs::rename(&copy, &renamed).unwrap();
        renamed
    })
    .clone()
}

/// tests/programs/embedded_python.c, built with the `python3-config` of the tests' interpreter
/// (`--includes`, `--ldflags --embed`); what is missing when it cannot be (for [`require!`]).
fn embedded_python() -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let config = python().with_file_name("python3-config");
            let missing = || {
                format!(
                    "{} (Python.h and libpython of {}; Debian: python3-dev, as scripts/setup \
                     installs)",
                    config.display(),
                    python().display()
                )
            };
            let words = |args: &[&str]| -> Result<Vec<String>, String> {
                let out = Command::new(&config)
                    .args(args)
                    .output()
                    .map_err(|_| missing())?;
                if !out.status.success() {
                    return Err(missing());
                }
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                Ok(text.split_whitespace().map(str::to_string).collect())
            };
            let mut flags = words(&["--includes"])?;
            flags.extend(words(&["--ldflags", "--embed"])?);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            Ok(Program::c("embedded_python").flags(&flags).build())
        })
        .clone()
}

/// `script` of tests/programs/zero_code run `way` on `sysfs`, under `taskset -c <pin>` when
/// given; stand-in and instrumentation on PYTHONPATH, nothing of `tllm_affinity` there.
fn app(way: Way, sysfs: &Sysfs, script: &str, pin: Option<&str>) -> Command {
    let interpreter = if way.installed() {
        installed_python()
    } else if way == Way::RunEmbedded {
        embedded_python().expect("checked by require! first")
    } else {
        python()
    };
    let mut argv: Vec<OsString> = Vec::new();
    if let Some(cpus) = pin {
        argv.extend(["taskset", "-c", cpus].map(OsString::from));
    }
    if way.under_run() {
        argv.push(cli().into());
        argv.extend(["run", "--sysfs-root"].map(OsString::from));
        argv.push(sysfs.path().into());
        argv.extend(["--log", "info", "--"].map(OsString::from));
    }
    argv.push(interpreter.into());
    if let Way::RunIgnoringPythonPath(flag) = way {
        argv.push(flag.into());
        argv.push(programs_dir().join("zero_code/launch_isolated.py").into());
    }
    argv.push(programs_dir().join("zero_code").join(script).into());
    let mut cmd = clean(&argv[0]);
    cmd.args(&argv[1..]);
    let path = std::env::join_paths([programs_dir().join("upstream_trtllm"), programs_dir()]);
    let path = path.unwrap();
    with_openmp(&mut cmd)
        .env("PYTHONPATH", &path)
        .env("RT_APP_PATH", &path)
        .env("TLLM_LOG_LEVEL", "info")
        .env_remove("VIRTUAL_ENV")
        .env_remove("PYTHONHOME");
    if !way.under_run() {
        // `run` sets it from --sysfs-root; the stand-in reads it too, in place of NVML.
        cmd.env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path());
    }
    match way {
        Way::Preload => {
            cmd.env("LD_PRELOAD", library());
        }
        Way::PreloadRenamed => {
            cmd.env("LD_PRELOAD", renamed_library());
        }
        Way::RunRenamed => {
            cmd.env("TLLM_AFFINITY_LIB", renamed_library());
        }
        _ => {}
    }
    if way.installed() && !way.under_run() {
        cmd.env("TLLM_AFFINITY_LOG", "info");
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

/// Runs a program through `count` phases (settled) with no action in between.
fn all_phases(cmd: Command, count: usize) -> (Vec<Phase>, Finished) {
    let mut run = Driver::spawn(cmd, LIMIT);
    let phases = (0..count)
        .map(|i| {
            if i > 0 {
                run.proceed();
            }
            settled(&mut run)
        })
        .collect();
    (phases, run.finish())
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
    upstream_pinned_everything_by_upstream(phases, local, end, sysfs);
}

// ---- The apps as data, one driver ----

/// The phases of the deployments' apps, in order; an HTTP app's test sends `GET /generate/a`
/// after `DURING` and `GET /generate/b` after `SHUTDOWN`.
const BEFORE: usize = 0;
const DURING: usize = 1;
const SERVING: usize = 2;
const SHUTDOWN: usize = 3;
const AFTER: usize = 4;

/// The CPUs a check expects: the mask the app was launched on (the allowed CPUs, or the taskset
/// CPU), or what the policy gives workers (the GPU-local set, node1, unless it clears).
#[derive(Clone, Copy, Debug)]
enum Cpus {
    Launch,
    Local,
}
use Cpus::{Launch, Local};

/// One of the two requests an HTTP app answers.
#[derive(Clone, Copy, Debug)]
enum Request {
    A,
    B,
}

/// One assertion on what a run left, `why` in its message.
#[derive(Clone, Copy, Debug)]
enum Check {
    /// Every thread of the phase is on these CPUs.
    AllOn(usize, Cpus, &'static str),
    /// Each pattern (see [`matches`]) names a thread of the phase.
    Present(usize, &'static [&'static str]),
    /// The thread is in the first phase and was not alive (by tid) in the second.
    BornSince(usize, usize, &'static str, &'static str),
    /// These threads are hosts on these CPUs.
    HostsOn(usize, &'static [&'static str], Cpus, &'static str),
    /// The response to the request contains the text.
    Answered(Request, &'static str, &'static str),
    /// Stderr contains the text.
    Logged(&'static str, &'static str),
    /// No line of stderr contains any of the texts.
    NeverLogged(&'static [&'static str], &'static str),
    /// Without the library every role reads -1.
    NoRoles,
    /// See [`upstream_pinned_everything`].
    UpstreamPinnedEverything,
}
use Check::*;

/// An app of tests/programs/zero_code: its script, its environment, whether it serves HTTP (then
/// its phases are the five of `BEFORE`..`AFTER`), how many phases it goes through, its worker
/// threads and the phases of its lease, and its checks: `always` on every run, `upstream`
/// without the library, with it `placed` (in each phase, why every thread is where it is: the
/// workers on the GPU-local set in the lease's phases, on the launch mask in the others; the
/// other threads hosts on the launch mask) and `library`.
struct App {
    title: &'static str,
    script: &'static str,
    env: &'static [(&'static str, &'static str)],
    /// The native progress threads' objects (RT_NCCL, RT_SPAWN), worker by the default
    /// TLLM_AFFINITY_WORKER_LIBS.
    progress_threads: bool,
    http: bool,
    phases: usize,
    workers: &'static [&'static str],
    lease: &'static [usize],
    always: &'static [Check],
    upstream: &'static [Check],
    placed: &'static [&'static str],
    library: &'static [Check],
}

/// What the deployments share: five phases, the lease over `DURING` and `SERVING`; without the
/// library, upstream pins every thread.
const DEPLOYMENT: App = App {
    title: "",
    script: "",
    env: &[],
    progress_threads: false,
    http: false,
    phases: 5,
    workers: &[],
    lease: &[DURING, SERVING],
    always: &[],
    upstream: &[UpstreamPinnedEverything],
    placed: &[],
    library: &[],
};

const SINGLE_PROCESS: &[(&str, &str)] = &[("TLLM_WORKER_USE_SINGLE_PROCESS", "1")];

/// Deployment 1, single-process TP1 worker in the HTTP server's process. The main thread builds
/// the LLM (the worker's threads and the main thread's OpenMP pool are born in the worker scope),
/// then serves HTTP: the loop's executor threads, born after the LLM, are host threads; shutdown
/// on the main thread restores the pool it kept.
const TP1: App = App {
    title: "tp1 HTTP server",
    script: "tp1_http_server.py",
    env: SINGLE_PROCESS,
    http: true,
    workers: &TP1_WORKERS,
    always: &[
        Answered(Request::A, r#""engine": true"#, "the LLM answered a"),
        Answered(Request::B, r#""engine": false"#, "no LLM after shutdown"),
        AllOn(BEFORE, Launch, "nothing configured yet"),
        Present(BEFORE, &["main", "user_metrics"]),
        Present(DURING, &["main", "user_metrics", "executor_loop"]),
        Present(DURING, &["await_response_thread", "engine_omp"]),
        Present(SERVING, &["stats_thread", "loop_omp", "asyncio_", "req_a"]),
        Present(AFTER, &["req_b"]),
        BornSince(
            SERVING,
            DURING,
            "req_a",
            "the loop's executor thread was born after the LLM",
        ),
        BornSince(AFTER, SHUTDOWN, "req_b", "a request after shutdown"),
    ],
    placed: &[
        "no worker yet",
        "built in the scope",
        "serving",
        "restored at shutdown",
        "after the worker's life",
    ],
    library: &[
        Present(SHUTDOWN, &["engine_omp"]),
        Answered(Request::A, r#""handler_role": 0"#, "a host thread served a"),
    ],
    ..DEPLOYMENT
};

/// Deployment 2, an externally supplied MpiCommSession, rank 0. worker_main configures on the
/// session's first pool thread: it and the engine it starts are workers; the user's script (main,
/// its loop thread and the loop's executor, grown during the lease), the proxy's dispatch thread
/// and the session's second pool thread are hosts.
const MPI_SESSION: App = App {
    title: "MpiCommSession rank 0",
    script: "mpi_session_rank0.py",
    workers: &SESSION_WORKERS,
    always: &[
        AllOn(BEFORE, Launch, "nothing configured yet"),
        Present(BEFORE, &["main", "user_loop", "user_pool0"]),
        Present(DURING, &["ThreadPoolExecutor-*_0", "executor_loop"]),
        Present(
            DURING,
            &["await_response_thread", "proxy_dispatch_result_thread"],
        ),
        Present(
            SERVING,
            &["ThreadPoolExecutor-*_1", "stats_thread", "user_pool_grown"],
        ),
        BornSince(
            SERVING,
            DURING,
            "user_pool_grown",
            "the user's loop grew its executor during the lease",
        ),
    ],
    placed: &[
        "no worker yet",
        "rank 0's worker",
        "serving",
        "restored at shutdown",
        "after the worker's life",
    ],
    library: &[Present(SHUTDOWN, &["ThreadPoolExecutor-*_0"])],
    ..DEPLOYMENT
};

/// Deployment 3, external-launch VisualGen, rank 0, under an HTTP server. Two sequential LLMs
/// (two `BaseWorker`s) are built, used and shut down on the main thread, then the VisualGen
/// client: its worker thread runs upstream's module-level `run_diffusion_worker`, which
/// configures: it, its pool and its post-processing thread are workers; the HTTP server (main)
/// and its request threads, the control thread, the coordinator started before the worker and
/// the executor threads its loop grows are hosts. The lease ends when `run_diffusion_worker`
/// returns (the client's shutdown): every mask is back on the launch mask while the process goes
/// on serving, and a thread born after (req_b) is not pinned.
const VISUALGEN: App = App {
    title: "VisualGen rank 0",
    script: "visualgen_rank0.py",
    env: SINGLE_PROCESS,
    http: true,
    workers: &VISUALGEN_WORKERS,
    always: &[
        Answered(Request::A, "denoised", "the worker answered a"),
        Answered(Request::B, r#""image": null"#, "no executor after shutdown"),
        AllOn(BEFORE, Launch, "nothing configured yet"),
        Present(BEFORE, &["main", "control"]),
        Present(DURING, &["visual_gen_coordinator", "visual_gen_worker"]),
        Present(DURING, &["visual_gen_postprocess", "visual_omp"]),
        Present(SERVING, &["req_a", "asyncio_"]),
        Present(AFTER, &["req_b"]),
        BornSince(AFTER, SHUTDOWN, "req_b", "a request after shutdown"),
    ],
    placed: &[
        "both LLMs shut down, restored",
        "the worker thread",
        "serving",
        "run_diffusion_worker returned: restored",
        "after the worker's life, still serving",
    ],
    library: &[
        HostsOn(AFTER, &["req_b"], Launch, "born after: not pinned"),
        Answered(Request::A, r#""handler_role": 0"#, "a host thread served a"),
    ],
    ..DEPLOYMENT
};

/// Deployment 4, the leader of a multi-node launch. Rank 0's worker on the session's first pool
/// thread, its engine and every native progress thread (started in libnccl.so.2 by main before
/// configure, by the session server before and during the lease, by the worker) are workers:
/// NUMA pinning stays effective for the leader; main, the control thread, the session server and
/// the session's second pool thread are hosts. mpi_progress is a worker by
/// TLLM_AFFINITY_WORKER_LIBS before anything is configured.
const LEADER: App = App {
    title: "multi-node leader",
    script: "leader.py",
    progress_threads: true,
    workers: &LEADER_WORKERS,
    always: &[
        AllOn(BEFORE, Launch, "nothing configured yet"),
        Present(
            BEFORE,
            &["main", "control", "session_server", "mpi_progress"],
        ),
        Present(
            DURING,
            &["ThreadPoolExecutor-*_0", "executor_loop", "nccl_progress"],
        ),
        Present(DURING, &["mpi_req1"]),
        Present(SERVING, &["ThreadPoolExecutor-*_1", "mpi_req2"]),
        Present(AFTER, &["mpi_req3"]),
        BornSince(SERVING, DURING, "mpi_req2", "started during the lease"),
        BornSince(AFTER, SHUTDOWN, "mpi_req3", "started after shutdown"),
    ],
    placed: &[
        "no lease yet",
        "rank 0's threads",
        "mpi_req2 born on the worker set",
        "restored at shutdown",
        "mpi_req3 born on the restored mask",
    ],
    ..DEPLOYMENT
};

/// The phases of the sequential LLMs (seeds/configure-not-idempotent.txt): before, the first
/// LLM, both, the first shut down, a third built, every one shut down.
const TWO_LLMS_PHASES: usize = 6;
const FIRST: usize = 1;
const SECOND: usize = 2;
const FIRST_DOWN: usize = 3;
const THIRD: usize = 4;

/// Sequential LLMs on the main thread: each one's threads stay pinned while any LLM is open, with
/// no constraint reported; upstream's second call takes its own pin for a constraint.
const TWO_LLMS: App = App {
    title: "sequential LLMs",
    script: "two_llms.py",
    env: SINGLE_PROCESS,
    progress_threads: false,
    http: false,
    phases: TWO_LLMS_PHASES,
    workers: &TP1_WORKERS,
    lease: &[FIRST, SECOND, FIRST_DOWN, THIRD],
    always: &[
        Present(SECOND, &["executor_loop#2", "stats_thread"]),
        Present(THIRD, &["executor_loop#2"]),
    ],
    upstream: &[
        NoRoles,
        AllOn(FIRST, Local, "upstream's first call pins every thread"),
        AllOn(
            SECOND,
            Launch,
            "upstream's second call takes its own pin for a constraint and un-pins every thread",
        ),
        Logged(
            "Removing CPU affinity constraints",
            "upstream's false warning",
        ),
    ],
    placed: &[
        "no LLM yet",
        "the first LLM",
        "both LLMs, stats_thread born between",
        "the second LLM still open",
        "built after the first shut down",
        "every LLM shut down",
    ],
    library: &[NeverLogged(
        &["constrained", "Removing CPU affinity constraints"],
        "no constraint to report",
    )],
};

// ---- An upstream the adapter half-knows (tests/programs/upstream_trtllm/tensorrt_llm/_release.py)

/// The app as another upstream release shapes it: `RT_UPSTREAM_SHAPE=shape`, the same checks.
macro_rules! release {
    ($app:expr, $title:literal, $shape:literal) => {
        App {
            title: $title,
            env: &[
                ("TLLM_WORKER_USE_SINGLE_PROCESS", "1"),
                ("RT_UPSTREAM_SHAPE", $shape),
            ],
            ..$app
        }
    };
}

const VISUALGEN_FEWER: App = release!(
    VISUALGEN,
    "VisualGen rank 0, run_diffusion_worker with fewer parameters",
    "entry-fewer"
);
const VISUALGEN_MORE: App = release!(
    VISUALGEN,
    "VisualGen rank 0, run_diffusion_worker with more parameters",
    "entry-more"
);
const VISUALGEN_RENAMED: App = release!(
    VISUALGEN,
    "VisualGen rank 0, run_diffusion_worker with renamed parameters",
    "entry-renamed"
);
const TP1_KEYWORD: App = release!(
    TP1,
    "tp1 HTTP server, configure_cpu_affinity(*, gpu_index)",
    "configure-keyword"
);
const VISUALGEN_KEYWORD: App = release!(
    VISUALGEN,
    "VisualGen rank 0, configure_cpu_affinity(*, gpu_index)",
    "configure-keyword"
);
// The MPI session and the leader run without the single-process switch.
const MPI_SESSION_KEYWORD: App = App {
    env: &[("RT_UPSTREAM_SHAPE", "configure-keyword")],
    title: "MpiCommSession rank 0, configure_cpu_affinity(*, gpu_index)",
    ..MPI_SESSION
};
const LEADER_KEYWORD: App = App {
    env: &[("RT_UPSTREAM_SHAPE", "configure-keyword")],
    title: "multi-node leader, configure_cpu_affinity(*, gpu_index)",
    ..LEADER
};

/// The worker object has no `shutdown()`: its lease ends at exit, so the workers stay on the
/// GPU-local set after the app stopped them, the hosts never move, and the adapter says why.
const UNTIL_EXIT: &[usize] = &[DURING, SERVING, SHUTDOWN, AFTER];
const NO_SHUTDOWN_SAID: Check = Logged(
    "has no shutdown(): its worker's lease ends at exit",
    "the adapter names what differed",
);
const TP1_NO_SHUTDOWN: App = App {
    title: "tp1 HTTP server, a worker without shutdown()",
    env: &[
        ("TLLM_WORKER_USE_SINGLE_PROCESS", "1"),
        ("RT_UPSTREAM_SHAPE", "no-shutdown"),
    ],
    lease: UNTIL_EXIT,
    placed: &[
        "no worker yet",
        "built in the scope",
        "serving",
        "stopped, lease open until exit",
        "lease open until exit",
    ],
    library: &[
        NO_SHUTDOWN_SAID,
        Answered(Request::A, r#""handler_role": 0"#, "a host thread served a"),
    ],
    ..TP1
};
const MPI_SESSION_NO_SHUTDOWN: App = App {
    title: "MpiCommSession rank 0, a worker without shutdown()",
    env: &[("RT_UPSTREAM_SHAPE", "no-shutdown")],
    lease: UNTIL_EXIT,
    placed: &[
        "no worker yet",
        "rank 0's worker",
        "serving",
        "stopped, lease open until exit",
        "lease open until exit",
    ],
    library: &[NO_SHUTDOWN_SAID],
    ..MPI_SESSION
};
const LEADER_NO_SHUTDOWN: App = App {
    title: "multi-node leader, a worker without shutdown()",
    env: &[("RT_UPSTREAM_SHAPE", "no-shutdown")],
    lease: UNTIL_EXIT,
    placed: &[
        "no lease yet",
        "rank 0's threads",
        "mpi_req2 born on the worker set",
        "stopped, lease open until exit",
        "mpi_req3 born on the worker set",
    ],
    library: &[NO_SHUTDOWN_SAID],
    ..LEADER
};

/// How an app is launched besides the way.
#[derive(Clone, Copy, Debug)]
enum Setting {
    /// No constraint, upstream's configure alone.
    Unconstrained,
    /// Upstream's re-sweep helper called by the worker once its threads are started
    /// (`RT_RESWEEP=1`).
    Resweep,
    /// Under `taskset -c <node0's first CPU>`, TLLM_NUMA_AWARE_WORKER_AFFINITY unset or set.
    Taskset(Option<&'static str>),
}

impl Setting {
    fn label(self) -> &'static str {
        match self {
            Setting::Unconstrained => "unconstrained",
            Setting::Resweep => "re-sweep",
            Setting::Taskset(None) => "taskset, policy unset",
            Setting::Taskset(Some(_)) => "taskset, policy =1",
        }
    }
}

/// One `#[test]`: an app run one way.
struct Row {
    app: &'static App,
    way: Way,
    setting: Setting,
}

/// What a run left, for the checks.
struct Seen {
    phases: Vec<Phase>,
    end: Finished,
    a: String,
    b: String,
    launch: String,
    local: String,
}

impl Seen {
    fn cpus(&self, cpus: Cpus) -> &str {
        match cpus {
            Launch => &self.launch,
            Local => &self.local,
        }
    }
}

/// Runs `row`'s app its way and setting, prints its table, and asserts that it exited 0, then
/// the app's checks: `always`, then `upstream` without the library or `library` with it.
fn check(row: &Row) {
    require!(two_cpus("a worker set narrower than the host"));
    if let Setting::Taskset(_) = row.setting {
        require!(on_path("taskset"), "`taskset` on PATH");
    }
    if row.way == Way::RunEmbedded {
        require!(embedded_python());
    }
    let app = row.app;
    let sysfs = Sysfs::two_nodes();
    let pinned = sysfs.node0.iter().next().unwrap().to_string();
    let (launch, local) = match row.setting {
        Setting::Taskset(None) => (pinned.clone(), allowed_cpus().to_list()),
        Setting::Taskset(Some(_)) => (pinned.clone(), sysfs.node1.to_list()),
        Setting::Unconstrained | Setting::Resweep => {
            (allowed_cpus().to_list(), sysfs.node1.to_list())
        }
    };
    let taskset = matches!(row.setting, Setting::Taskset(_)).then_some(pinned.as_str());
    let mut cmd = self::app(row.way, &sysfs, app.script, taskset);
    for (name, value) in app.env {
        cmd.env(name, value);
    }
    if app.progress_threads {
        cmd.env("RT_NCCL", Program::c("nccl").shared().build())
            .env("RT_SPAWN", Program::c("progress_threads").shared().build())
            .env_remove("TLLM_AFFINITY_WORKER_LIBS");
    }
    match row.setting {
        Setting::Taskset(Some(value)) => {
            cmd.env("TLLM_NUMA_AWARE_WORKER_AFFINITY", value);
        }
        Setting::Resweep => {
            cmd.env("RT_RESWEEP", "1");
        }
        _ => {}
    }
    let (phases, end, a, b) = if app.http {
        let (phases, end, a, b) = serve_two_requests(cmd);
        (Vec::from(phases), end, a, b)
    } else {
        let (phases, end) = all_phases(cmd, app.phases);
        (phases, end, String::new(), String::new())
    };
    let seen = Seen {
        phases,
        end,
        a,
        b,
        launch,
        local,
    };
    let all: Vec<&Phase> = seen.phases.iter().collect();
    table(
        &format!(
            "{} ({}) {}",
            app.title,
            row.setting.label(),
            row.way.label()
        ),
        &all,
    );
    assert!(seen.end.status.success(), "{}", seen.end.stderr);
    let by_way = if row.way.library() {
        app.library
    } else {
        app.upstream
    };
    for check in app.always.iter().chain(by_way) {
        verify(*check, &seen, &sysfs);
    }
    if row.way.library() {
        assert_eq!(app.placed.len(), app.phases, "a why for every phase");
        for (phase, why) in app.placed.iter().enumerate() {
            let workers = if app.lease.contains(&phase) {
                Local
            } else {
                Launch
            };
            let (worker, host) = (seen.cpus(workers), seen.cpus(Launch));
            placed(&seen.phases[phase], app.workers, worker, host, why);
        }
    }
}

/// One check on what a run left.
fn verify(check: Check, seen: &Seen, sysfs: &Sysfs) {
    let stderr = &seen.end.stderr;
    match check {
        AllOn(phase, cpus, why) => expect(&seen.phases[phase], All, on(seen.cpus(cpus)), why),
        Present(phase, patterns) => present(&seen.phases[phase], patterns),
        BornSince(phase, earlier, thread, why) => assert!(
            born_since(&seen.phases[phase], &seen.phases[earlier]).contains(thread),
            "{thread}: {why}"
        ),
        HostsOn(phase, threads, cpus, why) => expect(
            &seen.phases[phase],
            Named(threads),
            host_on(seen.cpus(cpus)),
            why,
        ),
        Answered(request, text, why) => {
            let response = match request {
                Request::A => &seen.a,
                Request::B => &seen.b,
            };
            assert!(response.contains(text), "{why}: {response}");
        }
        Logged(text, why) => assert!(stderr.contains(text), "{why}:\n{stderr}"),
        NeverLogged(texts, why) => {
            for line in stderr.lines() {
                assert!(
                    !texts.iter().any(|t| line.contains(t)),
                    "{why}: {line}\n{stderr}"
                );
            }
        }
        NoRoles => no_roles(&seen.phases.iter().collect::<Vec<_>>()),
        UpstreamPinnedEverything => upstream_pinned_everything(
            &seen.phases.iter().collect::<Vec<_>>(),
            seen.cpus(Local),
            &seen.end,
            sysfs,
        ),
    }
}

// One `#[test]` per app and way, named after the rule it shows.
table_tests! {
    check;
    tp1_under_run_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    tp1_under_preload_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::Preload,
        setting: Setting::Unconstrained,
    };
    tp1_with_the_library_under_another_file_name_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::PreloadRenamed,
        setting: Setting::Unconstrained,
    };
    tp1_under_run_with_the_library_under_another_file_name_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::RunRenamed,
        setting: Setting::Unconstrained,
    };
    tp1_under_run_with_python_dash_e_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::RunIgnoringPythonPath("-E"),
        setting: Setting::Unconstrained,
    };
    tp1_under_run_with_python_dash_i_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::RunIgnoringPythonPath("-I"),
        setting: Setting::Unconstrained,
    };
    tp1_embedded_in_a_c_program_under_run_pins_only_the_worker: Row {
        app: &TP1,
        way: Way::RunEmbedded,
        setting: Setting::Unconstrained,
    };
    tp1_without_the_library_pins_the_whole_server_and_never_restores: Row {
        app: &TP1,
        way: Way::Upstream,
        setting: Setting::Unconstrained,
    };
    mpi_session_rank0_under_run_pins_only_the_worker_pool_thread: Row {
        app: &MPI_SESSION,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    mpi_session_rank0_under_preload_pins_only_the_worker_pool_thread: Row {
        app: &MPI_SESSION,
        way: Way::Preload,
        setting: Setting::Unconstrained,
    };
    mpi_session_rank0_without_the_library_pins_the_users_script: Row {
        app: &MPI_SESSION,
        way: Way::Upstream,
        setting: Setting::Unconstrained,
    };
    visualgen_rank0_under_run_spares_the_coordinator_and_the_http_server: Row {
        app: &VISUALGEN,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    visualgen_rank0_under_preload_spares_the_coordinator_and_the_http_server: Row {
        app: &VISUALGEN,
        way: Way::Preload,
        setting: Setting::Unconstrained,
    };
    visualgen_rank0_without_the_library_pins_the_coordinator_and_the_http_server: Row {
        app: &VISUALGEN,
        way: Way::Upstream,
        setting: Setting::Unconstrained,
    };
    visualgen_rank0_with_upstreams_resweep_restores_when_the_worker_function_returns: Row {
        app: &VISUALGEN,
        way: Way::Run,
        setting: Setting::Resweep,
    };
    visualgen_rank0_under_taskset_policy_unset_restores_the_launch_mask: Row {
        app: &VISUALGEN,
        way: Way::Run,
        setting: Setting::Taskset(None),
    };
    visualgen_rank0_under_taskset_policy_1_restores_the_launch_mask: Row {
        app: &VISUALGEN,
        way: Way::Run,
        setting: Setting::Taskset(Some("1")),
    };
    leader_under_run_pins_rank0_and_progress_threads_not_the_session_server: Row {
        app: &LEADER,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    leader_under_preload_pins_rank0_and_progress_threads_not_the_session_server: Row {
        app: &LEADER,
        way: Way::Preload,
        setting: Setting::Unconstrained,
    };
    leader_without_the_library_pins_the_session_server: Row {
        app: &LEADER,
        way: Way::Upstream,
        setting: Setting::Unconstrained,
    };
    visualgen_entry_with_fewer_parameters_spares_the_hosts_and_restores_at_its_return: Row {
        app: &VISUALGEN_FEWER,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    visualgen_entry_with_more_parameters_spares_the_hosts_and_restores_at_its_return: Row {
        app: &VISUALGEN_MORE,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    visualgen_entry_with_renamed_parameters_spares_the_hosts_and_restores_at_its_return: Row {
        app: &VISUALGEN_RENAMED,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    visualgen_entry_with_renamed_parameters_under_preload_spares_the_hosts: Row {
        app: &VISUALGEN_RENAMED,
        way: Way::Preload,
        setting: Setting::Unconstrained,
    };
    tp1_with_a_keyword_only_configure_pins_only_the_worker: Row {
        app: &TP1_KEYWORD,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    mpi_session_with_a_keyword_only_configure_pins_only_the_worker_pool_thread: Row {
        app: &MPI_SESSION_KEYWORD,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    visualgen_with_a_keyword_only_configure_spares_the_coordinator_and_the_http_server: Row {
        app: &VISUALGEN_KEYWORD,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    leader_with_a_keyword_only_configure_pins_rank0_not_the_session_server: Row {
        app: &LEADER_KEYWORD,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    tp1_with_a_worker_without_shutdown_pins_only_the_worker_until_exit: Row {
        app: &TP1_NO_SHUTDOWN,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    mpi_session_with_a_worker_without_shutdown_pins_only_the_worker_until_exit: Row {
        app: &MPI_SESSION_NO_SHUTDOWN,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    leader_with_a_worker_without_shutdown_pins_only_rank0_until_exit: Row {
        app: &LEADER_NO_SHUTDOWN,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    visualgen_entry_with_renamed_parameters_without_the_library_pins_everything: Row {
        app: &VISUALGEN_RENAMED,
        way: Way::Upstream,
        setting: Setting::Unconstrained,
    };
    sequential_llms_under_run_stay_pinned_with_no_constrained_warning: Row {
        app: &TWO_LLMS,
        way: Way::Run,
        setting: Setting::Unconstrained,
    };
    sequential_llms_under_preload_stay_pinned_with_no_constrained_warning: Row {
        app: &TWO_LLMS,
        way: Way::Preload,
        setting: Setting::Unconstrained,
    };
    mpi_session_rank0_with_the_library_under_another_file_name_pins_only_the_worker_pool_thread: Row {
        app: &MPI_SESSION,
        way: Way::PreloadRenamed,
        setting: Setting::Unconstrained,
    };
    visualgen_rank0_with_the_library_under_another_file_name_spares_the_coordinator: Row {
        app: &VISUALGEN,
        way: Way::PreloadRenamed,
        setting: Setting::Unconstrained,
    };
    leader_with_the_library_under_another_file_name_pins_rank0_not_the_session_server: Row {
        app: &LEADER,
        way: Way::PreloadRenamed,
        setting: Setting::Unconstrained,
    };
    sequential_llms_with_the_library_under_another_file_name_stay_pinned: Row {
        app: &TWO_LLMS,
        way: Way::PreloadRenamed,
        setting: Setting::Unconstrained,
    };
    sequential_llms_without_the_library_unpin_at_the_second_llm: Row {
        app: &TWO_LLMS,
        way: Way::Upstream,
        setting: Setting::Unconstrained,
    };
}

// ---- The policy table under taskset ----

/// Under `taskset -c <first CPU>` (constrained: node0's first CPU only), the first LLM's worker
/// threads get the same masks with the library as upstream gives them after its first call, while
/// with the library the host threads keep the taskset mask.
struct Policy {
    /// TLLM_NUMA_AWARE_WORKER_AFFINITY, when set.
    numa_aware: Option<&'static str>,
    /// The worker threads' mask after upstream's first call.
    upstream_gives: fn(&Sysfs) -> String,
}

fn policy_under_taskset(policy: &Policy) {
    let Policy {
        numa_aware,
        upstream_gives,
    } = *policy;
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
        let (phases, end) = all_phases(cmd, TWO_LLMS_PHASES);
        assert!(end.status.success(), "{}", end.stderr);
        let first = phases.into_iter().nth(FIRST).unwrap();
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

table_tests! {
    policy_under_taskset;
    policy_unset_under_taskset_clears_workers_as_upstream_and_keeps_hosts_on_the_constraint: Policy {
        numa_aware: None,
        upstream_gives: |_| allowed_cpus().to_list(),
    };
    policy_numa_1_under_taskset_pins_workers_as_upstream_and_keeps_hosts_on_the_constraint: Policy {
        numa_aware: Some("1"),
        upstream_gives: |sysfs| sysfs.node1.to_list(),
    };
    policy_0_under_taskset_leaves_workers_as_upstream_does_and_hosts_on_the_constraint: Policy {
        numa_aware: Some("0"),
        upstream_gives: |sysfs| sysfs.node0.iter().next().unwrap().to_string(),
    };
}

// ---- The off switch (SPEC §8) ----

/// Under `TLLM_AFFINITY_DISABLE=1` the start-up hook steps aside and the library is inert, so
/// upstream's own `configure_cpu_affinity` pins every thread as it does without the library: each
/// phase's masks, thread by thread, equal the run without it; every role answers `-ENOTSUP`;
/// no thread table is published; the library says nothing.
#[test]
fn under_the_off_switch_upstream_pins_as_without_the_library() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let masks_by_phase = |phases: &[Phase]| -> Vec<(String, Vec<(String, String)>)> {
        phases
            .iter()
            .map(|p| {
                let masks = p
                    .threads
                    .iter()
                    .map(|(n, t)| (n.clone(), t.mask.to_list()))
                    .collect();
                (p.name.clone(), masks)
            })
            .collect()
    };
    let (upstream, end) = all_phases(
        app(Way::Upstream, &sysfs, MPI_SESSION.script, None),
        MPI_SESSION.phases,
    );
    assert!(end.status.success(), "{}", end.stderr);
    for way in [Way::Run, Way::Preload] {
        let lock_dir = tempfile::tempdir().unwrap();
        let mut cmd = app(way, &sysfs, MPI_SESSION.script, None);
        cmd.env("TLLM_AFFINITY_DISABLE", "1")
            .env("TLLM_AFFINITY_LOCK_DIR", lock_dir.path());
        let mut run = Driver::spawn(cmd, LIMIT);
        let pid = run.pid();
        let namespace = tllm_affinity_core::table::threadtable::pid_namespace(&PathBuf::from(
            format!("/proc/{pid}"),
        ))
        .unwrap();
        let table = tllm_affinity_core::table::threadtable::directory(lock_dir.path()).join(
            tllm_affinity_core::table::threadtable::file_name(pid, namespace),
        );
        let mut off = Vec::new();
        for i in 0..MPI_SESSION.phases {
            if i > 0 {
                run.proceed();
            }
            off.push(settled(&mut run));
            assert!(!table.exists(), "{}: a thread table", way.label());
        }
        let end = run.finish();
        let all: Vec<&Phase> = off.iter().collect();
        table_print(way, &all);
        assert!(end.status.success(), "{}", end.stderr);
        assert_eq!(
            masks_by_phase(&off),
            masks_by_phase(&upstream),
            "{}: every mask as without the library",
            way.label()
        );
        for phase in &off {
            for (name, seen) in &phase.threads {
                assert_eq!(seen.role, -libc::ENOTSUP, "{} {name}", phase.name);
            }
        }
        upstream_pinned_everything_by_upstream(&all, &sysfs.node1.to_list(), &end, &sysfs);
        assert!(
            !end.stderr.contains("[tllm-affinity]"),
            "{}: the hook and the library say nothing:\n{}",
            way.label(),
            end.stderr
        );
        let left: Vec<_> = std::fs::read_dir(lock_dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{}: {left:?}", way.label());
    }
}

fn table_print(way: Way, phases: &[&Phase]) {
    table(
        &format!(
            "MpiCommSession rank 0, TLLM_AFFINITY_DISABLE=1, {}",
            way.label()
        ),
        phases,
    );
}

/// [`upstream_pinned_everything`] less its "no role" check: the library is loaded, its roles
/// answer `-ENOTSUP`.
fn upstream_pinned_everything_by_upstream(
    phases: &[&Phase],
    local: &str,
    end: &Finished,
    sysfs: &Sysfs,
) {
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
