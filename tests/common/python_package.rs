//! The pip-installed Python package (tests/process/zero_code.rs, tests/process/wheel.rs) and the populations it runs.

use super::*;

/// The worker threads of the zero-code fixture's single-process TP1 LLM
/// (tests/programs/zero_code, tests/process/zero_code.rs and tests/process/containers.rs).
pub const TP1_WORKERS: [&str; 5] = [
    "executor_loop",
    "await_response_thread",
    "stats_thread",
    "engine_omp",
    "loop_omp",
];

/// The worker threads of the zero-code fixture's MpiCommSession rank 0: the session's first
/// pool thread (where worker_main configures) and the engine it starts (tests/process/zero_code.rs,
/// tests/guests/guest.rs).
pub const SESSION_WORKERS: [&str; 6] = joined(&["ThreadPoolExecutor-*_0"], &TP1_WORKERS);

/// The worker threads of the zero-code fixture's VisualGen rank 0: the worker function's thread,
/// its pool and post-processing thread, and the two sequential LLMs' threads that outlive them
/// (the main thread's OpenMP pool, born in the first LLM's worker scope).
pub const VISUALGEN_WORKERS: [&str; 8] = joined(
    &["visual_gen_worker", "visual_gen_postprocess", "visual_omp"],
    &TP1_WORKERS,
);

/// The worker threads of the zero-code fixture's multi-node leader: rank 0's worker and engine,
/// and every native progress thread.
pub const LEADER_WORKERS: [&str; 9] = joined(
    &SESSION_WORKERS,
    &["mpi_progress", "nccl_progress", "mpi_req"],
);

/// `head` then `tail`, in a list of exactly their length.
const fn joined<const N: usize>(head: &[&'static str], tail: &[&'static str]) -> [&'static str; N] {
    assert!(head.len() + tail.len() == N, "N is the two lengths");
    let mut out = [""; N];
    let mut i = 0;
    while i < N {
        out[i] = if i < head.len() {
            head[i]
        } else {
            tail[i - head.len()]
        };
        i += 1;
    }
    out
}

/// The interpreter of a virtual environment holding the repo's `python/` package as `pip install`
/// leaves it for a user (the `.pth` start-up hook included, once the package ships one):
/// `target/zero-code-venv`, created by `python3 -m venv --system-site-packages` (so that the
/// system's setuptools and `wheel` build the package with no index) and the package reinstalled
/// into it once per test binary, so that the venv follows the working tree, with `pip install
/// --no-index --no-build-isolation` of a copy of `python/` (pip builds in the source directory; the
/// copy keeps `build/` and `*.egg-info` out of the checkout). Test binaries running at the same time
/// take turns through a lock file.
pub fn installed_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            use std::os::fd::AsRawFd;
            let target = target_dir().parent().expect("target/").to_path_buf();
            let venv = target.join("zero-code-venv");
            let lock = std::fs::File::create(target.join("zero-code-venv.lock")).unwrap();
            // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
            let locked = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
            assert_eq!(locked, 0, "flock zero-code-venv.lock");
            let bin = venv.join("bin").join("python");
            if !bin.exists() {
                let status = Command::new(python())
                    .args(["-m", "venv", "--system-site-packages"])
                    .arg(&venv)
                    .status()
                    .expect("python3 -m venv");
                assert!(
                    status.success(),
                    "python3 -m venv {} failed (Debian: apt-get install python3-venv)",
                    venv.display()
                );
            }
            let source = tempfile::tempdir_in(&target).unwrap();
            copy_package_source(&repo().join("python"), source.path());
            let out = Command::new(&bin)
                .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
                .args([
                    "--no-index",
                    "--no-build-isolation",
                    "--no-deps",
                    "--force-reinstall",
                ])
                .arg(source.path())
                .env_remove("PYTHONPATH")
                .output()
                .expect("pip");
            assert!(
                out.status.success(),
                "pip install of python/ into {} failed; it builds with the system's setuptools \
                 and wheel (`python3 -m pip install wheel`, as scripts/setup does):\n{}{}",
                venv.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            bin
        })
        .clone()
}

/// Copies the package's sources, leaving out what a build or a run left behind.
fn copy_package_source(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == "build" || name == "__pycache__" || name.ends_with(".egg-info") {
            continue;
        }
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            copy_package_source(&path, &to.join(&*name));
        } else {
            std::fs::copy(&path, to.join(&*name)).unwrap();
        }
    }
}

/// `wheel_population.py` under an installed `tllm-affinity` (`tllm` makes a command of that
/// installation, however it is reached): `run --simulate --policy numa`, its population's JSON
/// line, `ps PID --json` of the live process, then its release. Asserts every thread's role and
/// mask on the simulated host (main and host on every CPU, the worker and its children on device
/// 0's local CPUs) and that `ps` read the worker's role from the installed library's table.
/// Returns the population for the caller's own checks.
pub fn installed_population(tllm: impl Fn() -> Command) -> serde_json::Value {
    let mut cmd = tllm();
    cmd.args(["run", "--simulate", "--policy", "numa", "--", "python"])
        .arg(program("wheel_population.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let seen: serde_json::Value = match serde_json::from_str(&line) {
        Ok(seen) => seen,
        Err(_) => {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "no population: {line}{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        }
    };
    let pid = seen["pid"].as_u64().unwrap().to_string();
    let ps = tllm().args(["ps", &pid, "--json"]).output().unwrap();
    writeln!(child.stdin.take().unwrap()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{seen}");
    let sim = Sysfs::two_nodes();
    for (name, role, cpus) in [
        ("main", "host", allowed_cpus()),
        ("host", "host", allowed_cpus()),
        ("worker", "worker", sim.gpu0_local()),
        ("child1", "worker", sim.gpu0_local()),
        ("child2", "worker", sim.gpu0_local()),
    ] {
        let thread = &seen["threads"][name];
        assert_eq!(thread["role"], role, "{name}: {seen}");
        assert_eq!(mask_of(&thread["mask"]), cpus, "{name}: {seen}");
    }
    assert!(
        ps.status.success(),
        "{}",
        String::from_utf8_lossy(&ps.stderr)
    );
    let table: serde_json::Value = serde_json::from_slice(&ps.stdout).unwrap();
    assert_eq!(table["table"], true, "{table}");
    let worker = &seen["threads"]["worker"]["tid"];
    let row = table["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| &t["tid"] == worker)
        .unwrap_or_else(|| panic!("worker {worker} not in {table}"));
    assert_eq!(row["role"], "worker", "{table}");
    seen
}

/// tests/programs/host_and_worker.py, an HTTP server's threads hosting a worker, run by `cmd`
/// (the interpreter under the library on `sysfs`; the script is added here): the HTTP, request
/// and loop threads stay hosts on every CPU, the worker, its pool and grandchild are workers on
/// the GPU-local set until the release restores them, threads born after are on every CPU. The
/// x86_64 tier and the aarch64 one assert the same.
pub fn check_host_and_worker(mut cmd: Command, sysfs: &Sysfs, limit: Duration) {
    let local = sysfs.node1.to_list();
    let all = allowed_cpus().to_list();
    cmd.arg(programs_dir().join("host_and_worker.py"));
    let (phases, end) = Driver::spawn(cmd, limit).all_phases::<3>();
    assert!(end.status.success(), "{}", end.stderr);
    let [configured, released, after] = &phases;
    println!("{}", describe(configured));
    let hosts = ["main", "http", "request", "loop"];
    expect(configured, Named(&hosts), host_on(&all), "host");
    expect(
        released,
        Named(&["main", "http", "loop"]),
        on(&all),
        "after release",
    );
    let workers = ["worker", "pool0", "pool1", "grandchild"];
    expect(configured, Named(&workers), worker_on(&local), "worker");
    expect(released, Named(&workers), on(&all), "worker after release");
    assert_eq!(after.mask("late_request"), all);
    assert_eq!(after.role("late_request"), 0);
    assert_eq!(after.mask("late_worker_child"), all);
}

/// A fresh venv of this machine's Python at `dir/venv`, made with `python -m venv <options>`
/// (Debian: python3-venv); its path.
pub fn new_venv(dir: &Path, options: &[&str]) -> PathBuf {
    let venv = dir.join("venv");
    let made = Command::new(python())
        .args(["-m", "venv"])
        .args(options)
        .arg(&venv)
        .status()
        .expect("python3 -m venv");
    assert!(
        made.success(),
        "python3 -m venv {options:?} (Debian: python3-venv)"
    );
    venv
}
