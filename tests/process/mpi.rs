//! Open MPI for real (issue #5, item 2; docs/runtimes.md): `mpirun -np 2` with the library
//! preloaded through `-x LD_PRELOAD=...`, ranks linked with libmpi (tests/programs/mpi_rank.c)
//! so that Open MPI's own progress threads exist, every mask read from
//! `/proc/<rank pid>/task/<tid>/status`.
//!
//! Simulated host (Sysfs::two_nodes): GPU 0 is local to node 1, GPU 1 to node 0; a dedicated
//! worker rank is configured at load for its local rank modulo the two visible GPUs, so rank 0
//! → GPU 0 → node 1 and rank 1 → GPU 1 → node 0. With two CPUs: node0 = {0}, node1 = {1}.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::placement::settings::DEFAULT_WORKER_LIBS;

fn rank_program() -> PathBuf {
    Program::c("mpi_rank").compiler(&["mpicc"]).build()
}

/// One rank at one phase: what the rank said (pid, mask at load) and each named thread's role
/// with the kernel's mask.
struct RankPhase {
    phase: Phase,
    pid: u32,
    load: CpuMask,
    constrained: bool,
}

impl RankPhase {
    /// The progress threads MPI_Init started (mpi1, mpi2, ...).
    fn progress(&self) -> Vec<(&String, &ThreadSeen)> {
        self.phase
            .threads
            .iter()
            .filter(|(n, _)| n.starts_with("mpi"))
            .collect()
    }
}

/// Each progress thread on its role's set: a worker on `local`, a host on `all` (`what` names
/// the case in the message).
fn progress_on_their_roles_sets(
    progress: &[(&String, &ThreadSeen)],
    local: &str,
    all: &str,
    what: &str,
) {
    for (name, t) in progress {
        let expected = if t.role == 1 { local } else { all };
        assert_eq!(
            t.mask.to_list(),
            expected,
            "{what}: progress thread {name} {t:?}"
        );
    }
}

/// A running `mpirun`: its ranks' PHASE lines arrive on stdout; a rank waits at each phase
/// until the test creates the file of that name in the go directory.
struct MpiRun {
    /// Taken by `finish`.
    run: Option<Driver>,
    go: tempfile::TempDir,
}

/// A rank configuration: the variables of its app context and how many ranks run it.
struct Ranks<'a> {
    np: u32,
    vars: &'a [(&'a str, &'a str)],
}

impl MpiRun {
    /// `mpirun --bind-to <bind>` of mpi_rank `mode`, one app context per entry of `contexts`
    /// (several make an MPMD launch), the library and the simulated host exported to every rank
    /// with `-x`, as docs/runtimes.md says.
    fn start(sysfs: &Sysfs, bind: &str, mode: &str, contexts: &[Ranks]) -> MpiRun {
        let go = tempfile::tempdir().unwrap();
        let program = rank_program();
        // A session directory of its own: concurrent mpiruns share the default one under
        // /tmp, and one that ends removes it while another is creating its own inside it.
        let session = go.path().join("tmp");
        std::fs::create_dir(&session).unwrap();
        let mut cmd = Command::new("mpirun");
        // No rank reads stdin: mpirun forwards none.
        cmd.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", bind])
            .args(["--stdin", "none"])
            .arg("--mca")
            .arg("orte_tmpdir_base")
            .arg(&session)
            .env("TMPDIR", &session);
        let global = [
            format!("LD_PRELOAD={}", library().display()),
            format!("TLLM_AFFINITY_SYSFS_ROOT={}", sysfs.path().display()),
            "TLLM_AFFINITY_LOG=info".to_string(),
            format!("RT_GO_DIR={}", go.path().display()),
        ];
        for (i, ranks) in contexts.iter().enumerate() {
            if i > 0 {
                cmd.arg(":");
            }
            cmd.args(["-np", &ranks.np.to_string()]);
            // In an MPMD launch, `-x` applies to the app context it appears in.
            for var in &global {
                cmd.args(["-x", var]);
            }
            for (k, v) in ranks.vars {
                cmd.args(["-x", &format!("{k}={v}")]);
            }
            cmd.arg(&program).arg(mode);
        }
        // Locally launched ranks inherit mpirun's environment: nothing of the test runner's
        // own settings may leak into them.
        for var in [
            "LD_PRELOAD",
            "TLLM_NUMA_AWARE_WORKER_AFFINITY",
            "TLLM_AFFINITY_POLICY",
            "TLLM_AFFINITY_CPUS",
            "TLLM_AFFINITY_GPU",
            "TLLM_AFFINITY_PROCESS_ROLE",
            "TLLM_AFFINITY_WORKER_LIBS",
            "TLLM_AFFINITY_STRICT",
            "CUDA_VISIBLE_DEVICES",
        ] {
            cmd.env_remove(var);
        }
        MpiRun {
            run: Some(Driver::spawn(cmd, DEADLINE)),
            go,
        }
    }

    /// Waits for `rank` to reach `phase`, and reads its threads' masks.
    fn expect(&mut self, phase: &str, rank: u32) -> RankPhase {
        let run = self.run.as_mut().unwrap();
        let line = run.line_in_any_order(&format!("PHASE {phase} rank={rank} "));
        // PHASE <phase> rank=<r> pid=<pid> load=<list> constrained=<bool> <thread>=<tid>:<role>...
        let words = &line["PHASE ".len()..];
        let fields: BTreeMap<&str, &str> = words
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .filter(|(_, value)| !value.contains(':'))
            .collect();
        let pid: u32 = fields["pid"].parse().unwrap();
        let mut threads = parse_phase(words, pid, Some);
        threads.name = format!("{phase} (rank {rank})");
        let seen = RankPhase {
            phase: threads,
            pid,
            load: CpuMask::parse_list(fields["load"])
                .unwrap_or_else(|_| panic!("rank {rank}: mask at load {}", fields["load"])),
            constrained: fields["constrained"] == "true",
        };
        println!(
            "pid {pid} load [{}] constrained {}: {}",
            seen.load,
            seen.constrained,
            describe(&seen.phase)
        );
        seen
    }

    /// Lets every rank waiting at `phase` go on.
    fn go(&self, phase: &str) {
        std::fs::write(self.go.path().join(phase), b"").unwrap();
    }

    /// Waits for mpirun to end; returns its stderr (the ranks' log lines).
    fn finish(mut self) -> String {
        let end = self.run.take().unwrap().finish();
        assert!(
            end.status.success(),
            "mpirun: {}; stderr:\n{}",
            end.status,
            end.stderr
        );
        end.stderr
    }
}

impl Drop for MpiRun {
    /// On a failed assertion: every waiting rank exits (the quit file), then mpirun is ended.
    fn drop(&mut self) {
        if let Some(run) = self.run.as_mut() {
            let _ = std::fs::write(self.go.path().join("quit"), b"");
            run.exited_within(Duration::from_secs(2));
        }
    }
}

/// The GPU-local set of a rank's device on the simulated host: rank 0 → GPU 0 → node 1,
/// rank 1 → GPU 1 → node 0.
fn local_of(sysfs: &Sysfs, rank: u32) -> String {
    if rank.is_multiple_of(2) {
        sysfs.node1.to_list()
    } else {
        sysfs.node0.to_list()
    }
}

const WORKER: &[(&str, &str)] = &[("TLLM_AFFINITY_PROCESS_ROLE", "worker")];

/// Every thread of a dedicated worker rank — main, Open MPI's progress threads, the thread main
/// starts after MPI_Init — is a worker on `mask`.
fn assert_dedicated(seen: &RankPhase, mask: &str, case: &str) {
    assert!(
        seen.progress().len() >= 2,
        "{case}: MPI_Init starts Open MPI's progress threads: {:?}",
        seen.phase
    );
    let why = format!("{case} (pid {})", seen.pid);
    expect(
        &seen.phase,
        Named(&["main", "engine"]),
        worker_on(mask),
        &why,
    );
    expect(&seen.phase, All, worker_on(mask), &why);
}

/// `--bind-to none`: each dedicated worker rank is configured at load for its local rank's
/// GPU; the progress threads MPI_Init starts are born on that set (inherited from main).
#[test]
fn dedicated_worker_ranks_without_binding() {
    require!(two_cpus("two ranks on two GPU-local sets"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let mut run = MpiRun::start(
        &sysfs,
        "none",
        "dedicated",
        &[Ranks {
            np: 2,
            vars: WORKER,
        }],
    );
    let ranks = [run.expect("running", 0), run.expect("running", 1)];
    run.go("running");
    let stderr = run.finish();
    for (rank, seen) in ranks.iter().enumerate() {
        let local = local_of(&sysfs, rank as u32);
        assert_eq!(seen.load.to_list(), all, "--bind-to none leaves the mask");
        assert!(!seen.constrained);
        assert_dedicated(seen, &local, "--bind-to none");
        says(
            &stderr,
            &[&format!(
                "Worker process {} CPU affinity set to [{local}] for optimal NUMA-aware scheduling",
                seen.pid
            )],
        );
    }
    never_says(&stderr, &["constrained"]);
}

/// `--bind-to core`: each rank starts bound to one core, narrower than the cpuset, so it is
/// constrained and the policy table decides: unset → every CPU of the cpuset ("clear", with the
/// server's warning), `1` → the GPU-local set, `0` → mpirun's binding kept.
#[test]
fn dedicated_worker_ranks_bound_to_cores_follow_the_policy_table() {
    require!(two_cpus("two ranks on two GPU-local sets"));
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    for (numa, worker_mask, warns) in [
        (None, "cpuset", true),
        (Some("1"), "local", false),
        (Some("0"), "binding", false),
    ] {
        let mut vars = WORKER.to_vec();
        if let Some(v) = numa {
            vars.push(("TLLM_NUMA_AWARE_WORKER_AFFINITY", v));
        }
        let case = format!("--bind-to core, TLLM_NUMA_AWARE_WORKER_AFFINITY={numa:?}");
        let mut run = MpiRun::start(&sysfs, "core", "dedicated", &[Ranks { np: 2, vars: &vars }]);
        let ranks = [run.expect("running", 0), run.expect("running", 1)];
        run.go("running");
        let stderr = run.finish();
        assert_ne!(
            ranks[0].load.to_list(),
            ranks[1].load.to_list(),
            "{case}: mpirun binds the ranks to different cores"
        );
        for (rank, seen) in ranks.iter().enumerate() {
            assert!(
                seen.load.count() < allowed_cpus().count(),
                "{case}: rank {rank} bound at load: [{}]",
                seen.load
            );
            assert!(seen.constrained, "{case}: rank {rank}");
            let expected = match worker_mask {
                "cpuset" => all.clone(),
                "local" => local_of(&sysfs, rank as u32),
                _ => seen.load.to_list(),
            };
            assert_dedicated(seen, &expected, &case);
            assert_eq!(
                stderr.contains(&format!("Worker process {}", seen.pid))
                    && stderr.contains("has constrained CPU affinity"),
                warns,
                "{case}: the constrained warning; stderr:\n{stderr}"
            );
        }
    }
}

/// One leader launch (MPMD): rank 0 is a host process whose worker runs on a pool thread;
/// rank 1 is a dedicated worker. Returns rank 0 configured and released, rank 1 running.
fn leader_launch(sysfs: &Sysfs, worker_libs: Option<&str>) -> [RankPhase; 3] {
    let mut leader_vars = vec![];
    let mut worker_vars = WORKER.to_vec();
    if let Some(libs) = worker_libs {
        leader_vars.push(("TLLM_AFFINITY_WORKER_LIBS", libs));
        worker_vars.push(("TLLM_AFFINITY_WORKER_LIBS", libs));
    }
    let mut run = MpiRun::start(
        sysfs,
        "none",
        "leader",
        &[
            Ranks {
                np: 1,
                vars: &leader_vars,
            },
            Ranks {
                np: 1,
                vars: &worker_vars,
            },
        ],
    );
    let rank1 = run.expect("running", 1);
    let configured = run.expect("configured", 0);
    run.go("configured");
    let released = run.expect("released", 0);
    run.go("released");
    run.go("running");
    let stderr = run.finish();
    says(
        &stderr,
        &["rank 0: configure(-1) -> 1", "rank 0: release -> 0"],
    );
    [configured, released, rank1]
}

/// A two-node host for two ranks on two GPU-local sets: the host, every allowed CPU and GPU 0's
/// local set, as lists.
fn two_ranks_host() -> Result<(Sysfs, String, String), String> {
    two_cpus("two ranks on two GPU-local sets")?;
    let sysfs = Sysfs::two_nodes();
    let local = local_of(&sysfs, 0);
    Ok((sysfs, allowed_cpus().to_list(), local))
}

/// The multi-node leader: rank 0's main thread (MPI_Init), the session server thread and the
/// second pool thread are host threads and keep the launch mask; rank 0's worker on pool0
/// (configure(-1): local rank 0 → GPU 0) and its engine thread get GPU 0's set, and so do the
/// Open MPI progress threads the host started, classified by TLLM_AFFINITY_WORKER_LIBS. With
/// the default list, the threads from libopen-pal and from the PMIx client (libpmix) are covered;
/// the test also runs with `libpmix*.so*` named twice, which changes nothing. Release puts rank
/// 0's masks back; rank 1 stays a dedicated worker on GPU 1's set.
#[test]
fn multi_node_leader_rank0_worker_on_a_pool_thread() {
    let (sysfs, all, local) = require!(two_ranks_host());
    let with_pmix = format!("{DEFAULT_WORKER_LIBS},libpmix*.so*");
    for libs in [None, Some(with_pmix.as_str())] {
        let [configured, released, rank1] = leader_launch(&sysfs, libs);
        let case = format!("TLLM_AFFINITY_WORKER_LIBS={libs:?}");
        let phase = &configured.phase;
        for host in ["main", "session", "pool1"] {
            assert_eq!(
                (phase.mask(host), phase.role(host)),
                (all.clone(), 0),
                "{case}: leader host thread {host}"
            );
        }
        for worker in ["pool0", "engine"] {
            assert_eq!(
                (phase.mask(worker), phase.role(worker)),
                (local.clone(), 1),
                "{case}: leader worker thread {worker}"
            );
        }
        let progress = configured.progress();
        assert!(progress.len() >= 2, "{case}: {phase:?}");
        let workers: Vec<_> = progress.iter().filter(|(_, t)| t.role == 1).collect();
        progress_on_their_roles_sets(&progress, &local, &all, &case);
        let pmix_covered = libs.is_some() || DEFAULT_WORKER_LIBS.contains("libpmix");
        let expected_workers = if pmix_covered { progress.len() } else { 1 };
        assert_eq!(
            workers.len(),
            expected_workers,
            "{case}: progress threads classified as workers: {progress:?}"
        );
        let why = format!("{case}: leader after release");
        expect(&released.phase, All, on(&all), &why);
        assert_eq!(released.phase.role("pool0"), 1, "roles outlive the lease");
        assert_dedicated(&rank1, &local_of(&sysfs, 1), &case);
    }
}

/// Where Open MPI's progress threads start, found with the library itself: naming only
/// libopen-pal makes exactly one of them a worker (the first MPI_Init starts), naming only
/// libpmix exactly the other one, and an empty list none.
#[test]
fn open_mpi_progress_threads_start_in_open_pal_and_pmix() {
    let (sysfs, all, local) = require!(two_ranks_host());
    let mut found = BTreeMap::new();
    for libs in ["libopen-pal*.so*", "libpmix*.so*", ""] {
        let [configured, _, _] = leader_launch(&sysfs, Some(libs));
        let progress = configured.progress();
        assert_eq!(
            progress.len(),
            2,
            "Open MPI 4.1 starts two progress threads in MPI_Init: {progress:?}"
        );
        progress_on_their_roles_sets(
            &progress,
            &local,
            &all,
            &format!("TLLM_AFFINITY_WORKER_LIBS={libs:?}"),
        );
        let workers: Vec<String> = progress
            .iter()
            .filter(|(_, t)| t.role == 1)
            .map(|(n, _)| n.to_string())
            .collect();
        found.insert(libs, workers);
    }
    assert_eq!(found[""], Vec::<String>::new(), "{found:?}");
    assert_eq!(found["libopen-pal*.so*"].len(), 1, "{found:?}");
    assert_eq!(found["libpmix*.so*"].len(), 1, "{found:?}");
    assert_ne!(
        found["libopen-pal*.so*"], found["libpmix*.so*"],
        "two threads, two objects: {found:?}"
    );
}
