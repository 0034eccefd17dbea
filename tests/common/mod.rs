//! What every integration test needs: the real library built and located, test programs
//! compiled, a simulated sysfs tree, and processes run under the library whose per-thread masks
//! are read from `/proc`.
#![allow(dead_code)]

pub mod bad_input;
pub mod deployments;
pub mod fork_exec;
pub mod guest;
pub mod never_hang;
pub mod slurm;
pub mod tier;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::simulated;
use tllm_affinity_core::topology::{SysfsRoot, Topology};

/// Skips the test where the host lacks something it needs: prints `skipped: needs <what>` and
/// returns, except in CI (`CI=true`, where `.ci/run` installs everything), where it fails.
/// `require!(available, "what")` for a condition; `let x = require!(probe())` for a probe giving
/// `Result<T, String>`, its error saying what is missing.
#[allow(unused_macros)]
macro_rules! require {
    ($available:expr, $what:expr $(,)?) => {
        if !$available {
            $crate::common::missing(&$what);
            return;
        }
    };
    ($probe:expr $(,)?) => {
        match $probe {
            Ok(found) => found,
            Err(what) => {
                $crate::common::missing(&what);
                return;
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use require;

/// A table of scenarios, one `#[test]` per row, named and documented by the row, each running
/// `check(&row)`: `table_tests! { check; /// doc\n name: row; ... }`.
#[allow(unused_macros)]
macro_rules! table_tests {
    ($check:path; $($(#[$doc:meta])* $name:ident: $row:expr;)*) => {
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                $check(&$row);
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use table_tests;

/// What [`require!`] does for a missing capability: fails in CI, says the test is skipped
/// elsewhere.
pub fn missing(what: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{what} is missing in CI, where .ci/run installs it"
    );
    println!("skipped: needs {what}");
}

/// Whether `name` is a program on PATH.
pub fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
        .unwrap_or(false)
}

/// Whether this process runs as root.
pub fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// target/<profile>, from this test binary's path (target/<profile>/deps/<test>).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// Builds the preload library and the CLI once per test binary, in this binary's profile.
fn build() {
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "-q",
            "-p",
            "tllm-affinity-preload",
            "-p",
            "tllm-affinity",
            "--lib",
            "--bins",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
        if target_dir().ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("cargo build");
        assert!(
            status.success(),
            "building the preload library and the CLI failed"
        );
    });
}

/// The real `libtllm_affinity.so`, absolute.
pub fn library() -> PathBuf {
    build();
    let lib = target_dir().join("libtllm_affinity.so");
    assert!(lib.exists(), "{} missing", lib.display());
    lib.canonicalize().unwrap()
}

/// `target/<profile>/tllm-affinity`, beside the library (where `run` looks for it).
pub fn cli() -> PathBuf {
    build();
    let bin = target_dir().join("tllm-affinity");
    assert!(bin.exists(), "{} missing", bin.display());
    bin
}

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file of `tests/programs`.
pub fn program(name: &str) -> PathBuf {
    programs_dir().join(name)
}

/// `program` with none of the variables that steer the library or the device mapping inherited
/// from the test's own environment, and the Python package importable.
pub fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        let steering = name.starts_with("TLLM_")
            || [
                "LD_PRELOAD",
                "CUDA_VISIBLE_DEVICES",
                "CUDA_DEVICE_ORDER",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID",
                "SLURM_LOCALID",
                "LOCAL_RANK",
                "NO_COLOR",
                "PYTHONPATH",
            ]
            .contains(&name.as_str());
        if steering {
            cmd.env_remove(name);
        }
    }
    cmd.env("PYTHONPATH", repo().join("python"));
    cmd
}

pub fn mask(list: &str) -> CpuMask {
    CpuMask::parse_list(list).unwrap()
}

/// A JSON list of CPU numbers (what Python's `sorted(os.sched_getaffinity(0))` prints) as a mask.
pub fn mask_of(value: &serde_json::Value) -> CpuMask {
    CpuMask::from_cpus(
        value
            .as_array()
            .unwrap_or_else(|| panic!("expected a CPU list, got {value}"))
            .iter()
            .map(|c| c.as_u64().unwrap() as usize),
    )
}

/// The real interpreter (PATH's `python3` may be a shell shim that forks).
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let out = Command::new("python3")
                .args(["-c", "import sys; print(sys.executable)"])
                .output()
                .expect("python3");
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        })
        .clone()
}

pub fn programs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs")
}

/// A C program of `tests/programs`, compiled into target/<profile>/test-programs with
/// `<compiler> -O1 -g -Wall -Wextra -Werror -pthread -o <output> <source> <flags> -ldl`. Every
/// test program goes through here: it is rebuilt only when its source, a header of
/// tests/programs, or the command line changed; one test thread at a time builds, and each build
/// goes to a file of its own renamed into place, so test binaries running at once never see a
/// half-written program.
pub struct Program {
    source: String,
    output: String,
    compiler: Vec<String>,
    flags: Vec<String>,
}

impl Program {
    /// `tests/programs/<source>.c`, built with `cc` as the executable `<source>`.
    pub fn c(source: &str) -> Program {
        Program {
            source: source.to_string(),
            output: source.to_string(),
            compiler: vec!["cc".to_string()],
            flags: Vec::new(),
        }
    }

    /// A shared object (`-fPIC -shared`), `lib<source>.so.2` unless [`Program::named`] says.
    pub fn shared(mut self) -> Program {
        self.output = format!("lib{}.so.2", self.source);
        self.flags
            .splice(0..0, ["-fPIC".to_string(), "-shared".to_string()]);
        self
    }

    /// The output's file name (a path under test-programs).
    pub fn named(mut self, output: &str) -> Program {
        self.output = output.to_string();
        self
    }

    /// Another compiler driver (`mpicc`; zig's `cc` with its target), its words in order.
    pub fn compiler(mut self, words: &[&str]) -> Program {
        self.compiler = words.iter().map(|w| w.to_string()).collect();
        self
    }

    /// Arguments after the source (`-fopenmp`, `-lrt`, link flags).
    pub fn flags(mut self, flags: &[&str]) -> Program {
        self.flags.extend(flags.iter().map(|f| f.to_string()));
        self
    }

    pub fn build(&self) -> PathBuf {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let out = target_dir().join("test-programs").join(&self.output);
        let out_dir = out.parent().unwrap().to_path_buf();
        std::fs::create_dir_all(&out_dir).unwrap();
        let src_path = programs_dir().join(format!("{}.c", self.source));
        let stamp = out.with_extension("args");
        let args = format!("{} {}", self.compiler.join(" "), self.flags.join(" "));
        let headers = std::fs::read_dir(programs_dir())
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "h"));
        let newest_input = headers
            .chain([src_path.clone()])
            .filter_map(|p| p.metadata().and_then(|m| m.modified()).ok())
            .max();
        let fresh = out.exists()
            && out.metadata().and_then(|m| m.modified()).ok() >= newest_input
            && std::fs::read_to_string(&stamp).ok().as_deref() == Some(args.as_str());
        if !fresh {
            let name = out.file_name().unwrap().to_string_lossy();
            let tmp = out_dir.join(format!("{name}.tmp{}", std::process::id()));
            let (compiler, words) = self.compiler.split_first().expect("a compiler");
            let built = Command::new(compiler)
                .args(words)
                .args(["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread", "-o"])
                .arg(&tmp)
                .arg(&src_path)
                .args(&self.flags)
                .arg("-ldl")
                .output()
                .unwrap_or_else(|e| panic!("{compiler}: {e}"));
            assert!(
                built.status.success(),
                "compiling {} failed:\n{}{}",
                src_path.display(),
                String::from_utf8_lossy(&built.stdout),
                String::from_utf8_lossy(&built.stderr)
            );
            std::fs::rename(&tmp, &out).unwrap();
            std::fs::write(&stamp, &args).unwrap();
        }
        out
    }
}

/// `tests/programs/worker_library_routine.c` as `libnccl_routine.so.2`: a start routine the default
/// `TLLM_AFFINITY_WORKER_LIBS` classifies, for the apply path (a host starting a worker).
pub fn worker_library() -> PathBuf {
    Program::c("worker_library_routine")
        .shared()
        .named("libnccl_routine.so.2")
        .build()
}

/// `libopenmp_region.so.2`: tests/programs/openmp_region.c built with `-fopenmp` (a real libgomp
/// pool).
pub fn openmp_library() -> PathBuf {
    Program::c("openmp_region")
        .shared()
        .flags(&["-fopenmp"])
        .build()
}

/// The CPUs this test process may use.
pub fn allowed_cpus() -> CpuMask {
    tllm_affinity_core::sys::get_mask(0).expect("sched_getaffinity")
}

/// For [`require!`]: whether this process may use two CPUs or more, which `why` needs (a worker
/// set narrower than the host, a constraint, two GPU-local sets cannot be shown on one).
pub fn two_cpus(why: &str) -> Result<(), String> {
    let allowed = allowed_cpus();
    if allowed.count() >= 2 {
        Ok(())
    } else {
        Err(format!(
            "two allowed CPUs ({why}; this process has [{allowed}])"
        ))
    }
}

/// The UUIDs [`Sysfs::gb200`]'s driver list gives its two GPUs.
pub const GB200_UUIDS: [&str; 2] = [
    "GPU-0b200000-0000-0000-0000-000000000000",
    "GPU-0b200000-0000-0000-0000-000000000001",
];

/// NVML's answer for `shape` in the test double's format (tests/programs/nvml_double.c): each
/// GPU's bus id with NVML's 8-digit domain, its UUID, its CPU affinity and the node
/// `nvmlDeviceGetNumaNodeId` gives ("-": not supported, as in CDMM mode).
pub fn grace_nvml(shape: &simulated::GraceHost) -> String {
    shape
        .gpus
        .iter()
        .map(|g| {
            let node = g.memory_node.map_or("-".to_string(), |n| n.to_string());
            format!(
                "gpu 0000{} {} {} {node}\n",
                g.address.to_ascii_uppercase(),
                g.uuid,
                g.nvml_cpus
            )
        })
        .collect()
}

/// A simulated host written to a temp dir: node0 = the lower half of the allowed CPUs, node1
/// the rest; GPU 0 (0000:3b:00.0) local to node1, GPU 1 (0000:86:00.0) local to node0.
pub struct Sysfs {
    pub dir: tempfile::TempDir,
    pub node0: CpuMask,
    pub node1: CpuMask,
}

impl Sysfs {
    pub fn two_nodes() -> Sysfs {
        let allowed = allowed_cpus();
        let dir = tempfile::tempdir().unwrap();
        simulated::two_node_one_gpu(&allowed)
            .write(dir.path())
            .unwrap();
        let cpus: Vec<usize> = allowed.iter().collect();
        let half = cpus.len() / 2;
        Sysfs {
            dir,
            node0: cpus[..half.max(1)].iter().copied().collect(),
            node1: cpus[half.max(1)..].iter().copied().collect(),
        }
    }

    /// Half a GB200 tray ([`simulated::gb200_like`]) over the allowed CPUs: Grace node 0 the
    /// lower half, node 1 the rest, GPUs 0 and 1 on node 0 with their memory on the CPU-less
    /// nodes 2 and 10, as the driver's list and its `numa_status` files say.
    pub fn gb200() -> Sysfs {
        let allowed = allowed_cpus();
        let cpus: Vec<usize> = allowed.iter().collect();
        let half = (cpus.len() / 2).max(1);
        let node0: CpuMask = cpus[..half].iter().copied().collect();
        let node1: CpuMask = cpus[half..].iter().copied().collect();
        let dir = tempfile::tempdir().unwrap();
        let [gpu0, gpu1] = simulated::GB200_GPUS;
        simulated::gb200_like(&node0, &node1)
            .driver_gpu(gpu0, GB200_UUIDS[0], 0, true)
            .driver_gpu(gpu1, GB200_UUIDS[1], 1, true)
            .driver_numa_status(gpu0, 2)
            .driver_numa_status(gpu1, 10)
            .write(dir.path())
            .unwrap();
        Sysfs { dir, node0, node1 }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Device 0's local CPUs, as the topology model computes them from the tree.
    pub fn gpu0_local(&self) -> CpuMask {
        let t = Topology::read(&SysfsRoot::new(self.path())).unwrap();
        t.gpu_local_cpus(&t.gpus[0]).cpus
    }
}

/// The simulated host's masks as CPU lists: every allowed CPU, device 0's GPU-local set (node1)
/// and the other node's CPUs (node0, device 1's).
pub struct HostCpus {
    pub all: String,
    pub local: String,
    pub other: String,
}

impl Sysfs {
    /// [`HostCpus`]; the error (for [`require!`]) on a host with one CPU, where they cannot
    /// differ as `why` needs.
    pub fn cpus(&self, why: &str) -> Result<HostCpus, String> {
        two_cpus(why)?;
        Ok(HostCpus {
            all: allowed_cpus().to_list(),
            local: self.node1.to_list(),
            other: self.node0.to_list(),
        })
    }
}

/// A command with the library preloaded and the simulated topology in place.
pub fn preloaded(program: impl AsRef<std::ffi::OsStr>, sysfs: &Sysfs) -> Command {
    let mut cmd = Command::new(program);
    preload(&mut cmd, sysfs);
    cmd
}

/// [`preloaded`] for a command made otherwise (a cgroup's wrapper): the library preloaded, the
/// simulated topology in place, none of the test's own steering variables inherited.
pub fn preload<'a>(cmd: &'a mut Command, sysfs: &Sysfs) -> &'a mut Command {
    cmd.env("LD_PRELOAD", library())
        .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path())
        .env("TLLM_AFFINITY_LOG", "info");
    for var in [
        "TLLM_NUMA_AWARE_WORKER_AFFINITY",
        "TLLM_AFFINITY_POLICY",
        "TLLM_AFFINITY_CPUS",
        "CUDA_VISIBLE_DEVICES",
        "TLLM_AFFINITY_GPU",
        "TLLM_AFFINITY_PROCESS_ROLE",
        "TLLM_AFFINITY_STEP_CORE",
        "TLLM_AFFINITY_STRICT",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
        "LOCAL_RANK",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// The runtime programs' OpenMP: `RT_OMP` (a real libgomp region), three threads per team (the
/// caller and two pool threads) whatever the CPU count, passive waiting so idle pools sleep, and
/// no binding of libgomp's own.
pub fn with_openmp(cmd: &mut Command) -> &mut Command {
    with_openmp_of(cmd, openmp_library())
}

/// [`with_openmp`] with `library` (a tier's build of tests/programs/openmp_region.c) as `RT_OMP`.
pub fn with_openmp_of(cmd: &mut Command, library: PathBuf) -> &mut Command {
    cmd.env("RT_OMP", library)
        .env("OMP_NUM_THREADS", "3")
        .env("OMP_WAIT_POLICY", "passive")
        .env_remove("OMP_PROC_BIND")
        .env_remove("OMP_PLACES")
        .env_remove("GOMP_CPU_AFFINITY")
}

/// The mask the kernel reports for one thread of a live process.
pub fn kernel_mask(pid: u32, tid: i32) -> CpuMask {
    try_kernel_mask(pid, tid).unwrap_or_else(|| panic!("/proc/{pid}/task/{tid} is gone"))
}

/// As [`kernel_mask`], `None` when the thread has exited.
pub fn try_kernel_mask(pid: u32, tid: i32) -> Option<CpuMask> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    CpuMask::parse_list(line).ok()
}

/// One checkpoint of a population program: its threads by name, with the role the library
/// reported and the mask the kernel reports.
#[derive(Debug)]
pub struct Phase {
    pub name: String,
    pub threads: BTreeMap<String, ThreadSeen>,
}

#[derive(Debug, Clone)]
pub struct ThreadSeen {
    pub tid: i32,
    /// 0 host, 1 worker, negative errno (or -1 without the library).
    pub role: i32,
    pub mask: CpuMask,
}

impl Phase {
    pub fn mask(&self, thread: &str) -> String {
        self.thread(thread).mask.to_list()
    }

    pub fn role(&self, thread: &str) -> i32 {
        self.thread(thread).role
    }

    pub fn thread(&self, thread: &str) -> &ThreadSeen {
        self.threads
            .get(thread)
            .unwrap_or_else(|| panic!("phase {} has no thread {thread}", self.name))
    }

    /// Names of the threads whose kernel mask is `mask`.
    pub fn on(&self, mask: &str) -> Vec<String> {
        self.threads
            .iter()
            .filter(|(_, t)| t.mask.to_list() == mask)
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// A `PHASE` line's words after the prefix (`<name> <thread>=<tid>:<role> ...`), each named
/// thread's mask read from `/proc/<pid>/task/<tid>`, where `tid` is what `host_tid` makes of the
/// printed one (the identity, or a container's namespace tid mapped to ours). Threads gone since
/// they were noted are left out.
pub fn parse_phase(words: &str, pid: u32, host_tid: impl Fn(i32) -> Option<i32>) -> Phase {
    let mut words = words.split_whitespace();
    let name = words.next().unwrap_or_default().to_string();
    let threads = words
        .filter_map(|w| {
            let (thread, rest) = w.split_once('=')?;
            let (tid, role) = rest.split_once(':')?;
            let tid = host_tid(tid.parse().ok()?)?;
            let mask = try_kernel_mask(pid, tid)?;
            Some((
                thread.to_string(),
                ThreadSeen {
                    tid,
                    role: role.parse().ok()?,
                    mask,
                },
            ))
        })
        .collect();
    Phase { name, threads }
}

/// The threads of a phase an [`expect`] speaks of.
#[derive(Clone, Copy, Debug)]
pub enum Threads<'a> {
    /// Every thread the phase lists.
    All,
    /// These threads, each of which the phase must list.
    Named(&'a [&'a str]),
    /// The threads whose names match a pattern (a name prefix, or `head*tail`); each pattern
    /// must match at least one.
    Matching(&'a [&'a str]),
}

/// Whether a thread's name matches one of `patterns`: each a name prefix, or `head*tail`.
pub fn matches(name: &str, patterns: &[&str]) -> bool {
    patterns.iter().any(|p| match p.split_once('*') {
        Some((head, tail)) => {
            name.len() >= head.len() + tail.len() && name.starts_with(head) && name.ends_with(tail)
        }
        None => name.starts_with(p),
    })
}

pub use Threads::{All, Matching, Named};

/// What an [`expect`] asks of each thread it picks: a kernel mask and, where it says one, a role
/// (0 host, 1 worker).
#[derive(Clone, Copy, Debug)]
pub struct Want<'a> {
    pub mask: &'a str,
    pub role: Option<i32>,
}

/// On `mask`, whatever the role.
pub fn on(mask: &str) -> Want<'_> {
    Want { mask, role: None }
}

/// A host thread on `mask`.
pub fn host_on(mask: &str) -> Want<'_> {
    Want {
        mask,
        role: Some(0),
    }
}

/// A worker thread on `mask`.
pub fn worker_on(mask: &str) -> Want<'_> {
    Want {
        mask,
        role: Some(1),
    }
}

/// The thread-table assertion of every phase test: each thread `threads` picks in `phase` is as
/// `want` says; `why` and the whole table are in the message.
pub fn expect(phase: &Phase, threads: Threads, want: Want, why: &str) {
    let picked: Vec<(&String, &ThreadSeen)> = match threads {
        All => phase.threads.iter().collect(),
        Named(names) => names
            .iter()
            .map(|n| {
                phase
                    .threads
                    .get_key_value(*n)
                    .unwrap_or_else(|| panic!("{}: no thread {n}: {}", phase.name, describe(phase)))
            })
            .collect(),
        Matching(patterns) => {
            present(phase, patterns);
            phase
                .threads
                .iter()
                .filter(|(n, _)| matches(n, patterns))
                .collect()
        }
    };
    for (name, seen) in picked {
        assert_eq!(
            (seen.mask.to_list().as_str(), seen.role),
            (want.mask, want.role.unwrap_or(seen.role)),
            "{} {name} (tid {}): {why}\n{}",
            phase.name,
            seen.tid,
            describe(phase)
        );
    }
}

/// Each of `patterns` (see [`matches`]) names at least one thread of `phase`.
pub fn present(phase: &Phase, patterns: &[&str]) {
    for p in patterns {
        assert!(
            phase.threads.keys().any(|n| matches(n, &[p])),
            "{}: no thread {p}: {}",
            phase.name,
            describe(phase)
        );
    }
}

/// With the library: every thread `workers` matches (see [`matches`]) is a worker on `worker`,
/// every other thread a host on `host`.
pub fn placed(phase: &Phase, workers: &[&str], worker: &str, host: &str, why: &str) {
    for name in phase.threads.keys() {
        let want = if matches(name, workers) {
            worker_on(worker)
        } else {
            host_on(host)
        };
        expect(phase, Named(&[name]), want, why);
    }
}

/// What a finished program left: its status, everything it printed on stdout, its stderr.
pub struct Finished {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// The deadline of a run whose test names none.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// A program driven line by line with a deadline: its stdout read by a thread, its stderr
/// collected in a file (a pipe nobody reads could fill and block it), in a process group of its
/// own. Every wait for output fails the test when the deadline passes, killing the process group,
/// so a hang is a failure, never a stuck test; dropping it kills the group too (what a failed
/// assertion or the program left running).
///
/// Programs with phases print `PHASE <name> <thread>=<tid>:<role> ...` and wait for a line on
/// stdin before going on.
pub struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
    deadline: Instant,
    /// Every stdout line read so far.
    pub out: Vec<String>,
    /// Lines read by [`Driver::line_in_any_order`] that no call has taken yet.
    unclaimed: Vec<String>,
}

impl Driver {
    pub fn spawn(mut cmd: Command, limit: Duration) -> Driver {
        let dir = tempfile::tempdir().unwrap();
        let stderr_path = dir.path().join("stderr");
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Driver {
            child,
            stdin,
            lines: rx,
            stderr_path,
            _dir: dir,
            deadline: Instant::now() + limit,
            out: Vec::new(),
            unclaimed: Vec::new(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Kills the program's process group (the program and whatever it started that stayed in
    /// it) and reaps the program.
    fn kill(&mut self) {
        // SAFETY: a signal to the process group this Driver made (its id is the program's pid).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn fail(&mut self, why: &str) -> ! {
        let states = thread_states(self.pid());
        // Before the kill: a hang is usually in a child, so every process of the group.
        let stacks = group_stacks(self.pid());
        self.kill();
        panic!(
            "{why}\nthreads (tid:state:wchan): {states}\n{stacks}\nstdout so far:\n{}\nstderr:\n{}",
            self.out.join("\n"),
            self.stderr()
        );
    }

    /// The next stdout line (kept in `out`), `None` once stdout is closed; past the deadline
    /// the test fails, saying it was `waiting_for` that.
    fn next_line(&mut self, waiting_for: &str) -> Option<String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left) {
            Ok(line) => {
                self.out.push(line.clone());
                Some(line)
            }
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => self.fail(&format!(
                "deadline passed waiting for {waiting_for}: killed"
            )),
        }
    }

    /// The next stdout line that starts with `prefix` (lines before it are kept in `out`).
    pub fn line(&mut self, prefix: &str) -> String {
        loop {
            match self.next_line(&format!("{prefix:?}")) {
                Some(line) if line.starts_with(prefix) => return line,
                Some(_) => {}
                None => {
                    let status = self.child.wait().ok();
                    self.fail(&format!(
                        "the program ended ({status:?}) before printing {prefix:?}"
                    ))
                }
            }
        }
    }

    /// The first line starting with `prefix` that no call of this kind took yet, whatever
    /// printed before it: for processes that print at once (MPI ranks), in any order.
    pub fn line_in_any_order(&mut self, prefix: &str) -> String {
        if let Some(i) = self.unclaimed.iter().position(|l| l.starts_with(prefix)) {
            return self.unclaimed.remove(i);
        }
        loop {
            match self.next_line(&format!("{prefix:?}")) {
                Some(line) if line.starts_with(prefix) => return line,
                Some(line) => self.unclaimed.push(line),
                None => {
                    let status = self.child.wait().ok();
                    self.fail(&format!(
                        "the program ended ({status:?}) before printing {prefix:?}"
                    ))
                }
            }
        }
    }

    /// Whether the program has exited, after waiting at most `limit` for it.
    pub fn exited_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What follows `prefix` on the next line that starts with it, trimmed (`PORT 8000` → `8000`).
    pub fn after(&mut self, prefix: &str) -> String {
        self.line(prefix)[prefix.len()..].trim().to_string()
    }

    /// The next PHASE line, with every named thread's mask read from `/proc`.
    pub fn phase(&mut self) -> Phase {
        let words = self.after("PHASE ");
        parse_phase(&words, self.pid(), Some)
    }

    /// The next `REPORT <tag> <json>` line, parsed.
    pub fn report(&mut self, tag: &str) -> serde_json::Value {
        let json = self.after(&format!("REPORT {tag} "));
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"))
    }

    /// Lets the program go on past its current phase (a program that has ended is fine).
    pub fn proceed(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.write_all(b"\n").and_then(|_| stdin.flush());
        }
    }

    /// Answers the current phase, closes stdin, reads the rest of stdout and waits for the end,
    /// all before the deadline; `stdout` is everything the program printed.
    pub fn finish(mut self) -> Finished {
        self.proceed();
        drop(self.stdin.take());
        while self.next_line("the end").is_some() {}
        self.wait()
    }

    /// [`Driver::finish`], and the program exited 0 (its stderr in the message).
    pub fn succeed(self) -> Finished {
        let end = self.finish();
        assert!(end.status.success(), "{}\n{}", end.status, end.stderr);
        end
    }

    /// At the program's next phase, the thread ids the kernel lists; answered, the program prints
    /// `REPORT <tag> <json>`, whose threads must be exactly those (the library's registry equals
    /// the live threads). The phase, the tids and the report.
    pub fn phase_and_registry(&mut self, tag: &str) -> (Phase, BTreeSet<i32>, serde_json::Value) {
        let phase = self.phase();
        let live = task_tids(self.pid());
        self.proceed();
        let report = self.report(tag);
        assert_eq!(report_tids(&report), live, "{report}");
        (phase, live, report)
    }

    /// `N` phases, answered in turn, then the end.
    pub fn all_phases<const N: usize>(self) -> ([Phase; N], Finished) {
        self.phases_with(Driver::phase)
    }

    /// [`Driver::all_phases`], each phase read by `read` (a containerised program's, one
    /// settled after its exiting threads are gone).
    pub fn phases_with<const N: usize>(
        mut self,
        mut read: impl FnMut(&mut Driver) -> Phase,
    ) -> ([Phase; N], Finished) {
        let phases = std::array::from_fn(|i| {
            if i > 0 {
                self.proceed();
            }
            read(&mut self)
        });
        (phases, self.finish())
    }

    /// Runs the program to its end, answering every PHASE line as it comes; `stdout` is
    /// everything it printed.
    pub fn answer_all(mut self) -> Finished {
        while let Some(line) = self.next_line("the end") {
            if line.starts_with("PHASE ") {
                self.proceed();
            }
        }
        self.finish()
    }

    /// The exit, once stdout is closed, before the deadline.
    fn wait(&mut self) -> Finished {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Finished {
                    status,
                    stdout: self.out.join("\n"),
                    stderr: self.stderr(),
                };
            }
            if Instant::now() > self.deadline {
                self.fail("deadline passed waiting for the exit: killed");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs a command to its end with stdin closed, failing (and killing it) past `limit`.
pub fn run_bounded(cmd: Command, limit: Duration) -> Finished {
    Driver::spawn(cmd, limit).finish()
}

/// True when the kernel lets this process make cpuset cgroups (v1 here, v2 elsewhere).
pub fn cpuset_cgroup_root() -> Option<PathBuf> {
    let v1 = Path::new("/sys/fs/cgroup/cpuset");
    if v1.join("cpuset.cpus").exists() {
        return Some(v1.to_path_buf());
    }
    None
}

/// A cpuset cgroup allowing `cpus`, removed on drop.
pub struct CpusetCgroup {
    pub path: PathBuf,
}

impl CpusetCgroup {
    /// The error (for [`require!`]) says why there is none.
    pub fn create(cpus: &str) -> Result<CpusetCgroup, String> {
        Self::make(cpus).map_err(|why| format!("a cpuset cgroup ({why})"))
    }

    fn make(cpus: &str) -> Result<CpusetCgroup, String> {
        let root = cpuset_cgroup_root().ok_or("no cgroup v1 cpuset hierarchy mounted")?;
        let path = root.join(format!(
            "tllm-affinity-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir(&path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
        let group = CpusetCgroup { path };
        let mems = std::fs::read_to_string(root.join("cpuset.mems")).unwrap_or("0".into());
        std::fs::write(group.path.join("cpuset.cpus"), cpus)
            .map_err(|e| format!("cpuset.cpus: {e}"))?;
        std::fs::write(group.path.join("cpuset.mems"), mems.trim())
            .map_err(|e| format!("cpuset.mems: {e}"))?;
        Ok(group)
    }

    /// `cmd` run inside the cgroup: a shell joins it, then execs the program.
    pub fn wrap(&self, program: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0/tasks" && shift && exec "$@""#)
            .arg(&self.path)
            .arg("--")
            .arg(program)
            .args(args);
        cmd
    }
}

impl Drop for CpusetCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0)
}

/// `GET <path>` on 127.0.0.1:`port` from a new thread; the handle gives the whole response.
/// Bounded: a server that never answers fails the request after 30 s.
pub fn http_get(port: u16, path: &str) -> std::thread::JoinHandle<String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    std::thread::spawn(move || {
        use std::io::Read;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("response");
        response
    })
}

/// Runs `cmd` to its end, which must be a success (the command, its status and its output in
/// the message).
pub fn succeeded(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The thread ids the kernel lists for a live process.
pub fn task_tids(pid: u32) -> std::collections::BTreeSet<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The thread ids a JSON report lists.
pub fn report_tids(report: &serde_json::Value) -> std::collections::BTreeSet<i32> {
    report["threads"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t["tid"].as_i64())
                .map(|t| t as i32)
                .collect()
        })
        .unwrap_or_default()
}

/// One thread of a JSON report, by tid.
pub fn report_thread(report: &serde_json::Value, tid: i32) -> &serde_json::Value {
    report["threads"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["tid"].as_i64() == Some(tid as i64)))
        .unwrap_or_else(|| panic!("thread {tid} is not in the report {report}"))
}

/// The placement the report gives thread `tid` (`worker`, `explicit`, ...; empty when absent).
pub fn report_placement(report: &serde_json::Value, tid: i32) -> String {
    report_thread(report, tid)["placement"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The last line of a program's stdout that is a JSON object, parsed (the test programs print
/// what they saw as one such line, after whatever else they print).
pub fn last_json_line(stdout: &[u8]) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in {stdout}"));
    serde_json::from_str(line).unwrap()
}

/// The lines of `text` (a program's stderr) that start with `prefix`: `"[tllm-affinity]"` for
/// every line of the library's, `"[tllm-affinity] error:"` for its errors.
pub fn lines_starting<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// Each of `parts` is in `text` (a program's output; the whole of it in the message).
#[track_caller]
pub fn says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "no {part:?} in:\n{text}");
    }
}

/// None of `parts` is in `text` (the whole of it in the message).
#[track_caller]
pub fn never_says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(!text.contains(part), "{part:?} in:\n{text}");
    }
}

/// `key=value` from a result line such as `CHILD main threads=1 role=0`.
pub fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .to_string()
}

/// The processes of process group `pgid` (a [`Driver`]'s program and what it started that
/// stayed in its group), from `/proc/<pid>/stat`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid: &u32| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After the command's closing parenthesis: state, ppid, pgrp.
            stat.rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().nth(2)?.parse().ok())
                == Some(pgid)
        })
        .collect();
    pids.sort();
    pids
}

/// Every thread's stack of every process in the group, from `gdb -batch` (at most 8
/// processes, 30 s each), for the message of a test that found a hang.
pub fn group_stacks(pgid: u32) -> String {
    if !on_path("gdb") {
        return "stacks: gdb is not installed (scripts/setup installs it)".to_string();
    }
    let members = group_members(pgid);
    let mut out = format!("stacks of the {} processes of group {pgid}:", members.len());
    for pid in members.iter().take(8) {
        let stacks = Command::new("timeout")
            .args(["30", "gdb", "-batch", "-nx", "-p", &pid.to_string()])
            .args(["-ex", "thread apply all bt"])
            .stdin(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("gdb: {e}"));
        let frames: Vec<&str> = stacks
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread "))
            .collect();
        out.push_str(&format!("\n--- pid {pid}\n{}", frames.join("\n")));
    }
    out
}

/// What each thread of a live process is blocked in, for a watchdog's message.
pub fn thread_states(pid: u32) -> String {
    task_tids(pid)
        .iter()
        .map(|tid| {
            let wchan = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/wchan"))
                .unwrap_or_default();
            let stat =
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next())
                .unwrap_or("?")
                .to_string();
            format!("{tid}:{state}:{wchan}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line per phase, `phase: thread=mask(role) ...`, for the tests' printed record (seen with
/// `--nocapture`, and on failure).
pub fn describe(phase: &Phase) -> String {
    let role = |r: i32| match r {
        0 => "host".to_string(),
        1 => "worker".to_string(),
        other => other.to_string(),
    };
    let threads: Vec<String> = phase
        .threads
        .iter()
        .map(|(n, t)| format!("{n}=[{}]({})", t.mask.to_list(), role(t.role)))
        .collect();
    format!("{}: {}", phase.name, threads.join(" "))
}

// ---- The pip-installed Python package (tests/zero_code.rs) ----

/// The worker threads of the zero-code fixture's single-process TP1 LLM
/// (tests/programs/zero_code, tests/zero_code.rs and tests/containers.rs).
pub const TP1_WORKERS: [&str; 5] = [
    "executor_loop",
    "await_response_thread",
    "stats_thread",
    "engine_omp",
    "loop_omp",
];

/// The worker threads of the zero-code fixture's MpiCommSession rank 0: the session's first
/// pool thread (where worker_main configures) and the engine it starts (tests/zero_code.rs,
/// tests/guest.rs).
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

// ---- Root filesystems (tests/wheel.rs, tests/containers.rs) ----

pub const ROOTFS_CACHE: &str = "/var/cache/tllm-affinity";
pub const MIRROR: &str = "http://deb.debian.org/debian";

/// Debian bullseye (glibc 2.31: the old-glibc checks of tests/wheel.rs and tests/containers.rs),
/// `debootstrap --variant=minbase`, made once and kept in
/// `/var/cache/tllm-affinity/bullseye-minbase` for every checkout. The error (for [`require!`])
/// says what is missing when it cannot be made: root, debootstrap, or the mirror.
pub fn bullseye_rootfs() -> Result<PathBuf, String> {
    minbase_rootfs("bullseye", &[], "usr/bin/true")
}

/// Debian trixie (glibc 2.41, Python 3.13 with venv: the new-glibc check of tests/wheel.rs),
/// made and kept as [`bullseye_rootfs`], in `/var/cache/tllm-affinity/trixie-minbase`.
pub fn trixie_rootfs() -> Result<PathBuf, String> {
    minbase_rootfs("trixie", &["python3", "python3-venv"], "usr/bin/python3")
}

/// Debian `release` for this machine, `debootstrap --variant=minbase` with `include`d packages,
/// in `ROOTFS_CACHE/<release>-minbase`; `ready` is a file it has once made.
fn minbase_rootfs(release: &str, include: &[&str], ready: &str) -> Result<PathBuf, String> {
    if !root() {
        return Err("root (chroot)".into());
    }
    let include = match include {
        [] => None,
        packages => Some(format!("--include={}", packages.join(","))),
    };
    debootstrapped(
        &format!("{release}-minbase"),
        ready,
        &format!(
            "a Debian {release} root filesystem: `debootstrap --variant=minbase {}{release} \
             {MIRROR}`",
            include
                .as_deref()
                .map(|i| format!("{i} "))
                .unwrap_or_default()
        ),
        |partial| {
            Command::new("debootstrap")
                .arg("--variant=minbase")
                .args(&include)
                .arg(release)
                .arg(partial)
                .arg(MIRROR)
                .output()
                .unwrap()
        },
    )
}

/// A root filesystem made once in `ROOTFS_CACHE/name` and kept for every checkout: `make`
/// (debootstrap's stages) builds it in a directory of its own, renamed into place when it
/// succeeded, under a lock so that test binaries running at once make it once; `ready` is a file
/// it has once made. The error (for [`require!`]) names what is missing: debootstrap, or `what`
/// with the last lines it printed.
pub fn debootstrapped(
    name: &str,
    ready: &str,
    what: &str,
    make: impl FnOnce(&Path) -> std::process::Output,
) -> Result<PathBuf, String> {
    use std::os::fd::AsRawFd;
    let cache = Path::new(ROOTFS_CACHE);
    let rootfs = cache.join(name);
    std::fs::create_dir_all(cache).unwrap();
    let lock = std::fs::File::create(cache.join(format!("{name}.lock"))).unwrap();
    // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if rootfs.join(ready).is_file() {
        return Ok(rootfs);
    }
    if !on_path("debootstrap") {
        return Err("`debootstrap` on PATH".into());
    }
    let partial = cache.join(format!("{name}.partial.{}", std::process::id()));
    let out = make(&partial);
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        return Err(format!(
            "{what} failed (is the mirror reachable?): {}",
            tail.join(" | ")
        ));
    }
    std::fs::rename(&partial, &rootfs).unwrap();
    Ok(rootfs)
}

/// A copy of `rootfs` made of hard links, in a directory under the cache that goes on drop, and
/// its root: instant, and the cache stays untouched (files are only added to or removed from
/// the copy, never written).
pub fn linked_copy(rootfs: &Path) -> (tempfile::TempDir, PathBuf) {
    let copy = tempfile::tempdir_in(ROOTFS_CACHE).unwrap();
    let root = copy.path().join("root");
    let status = Command::new("cp")
        .arg("-al")
        .arg(rootfs)
        .arg(&root)
        .status()
        .unwrap();
    assert!(status.success(), "cp -al {}", rootfs.display());
    (copy, root)
}

/// `tests/programs/old_glibc.c` linked against glibc 2.17 by zig (the wheel's toolchain), so that
/// it runs in the old root filesystem.
pub fn old_glibc_program() -> PathBuf {
    let python = python();
    Program::c("old_glibc")
        .compiler(&[
            python.to_str().unwrap(),
            "-m",
            "ziglang",
            "cc",
            "-target",
            "x86_64-linux-gnu.2.17",
        ])
        .build()
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

/// `scripts/wheel aarch64`: the wheel, built once per test binary (cargo rebuilds only what
/// changed); the native files stay in [`aarch64_natives`].
pub fn aarch64_wheel() -> PathBuf {
    let out = Command::new(repo().join("scripts/wheel"))
        .arg("aarch64")
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/wheel");
    assert!(out.status.success(), "scripts/wheel aarch64 failed");
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    assert!(path.is_file(), "scripts/wheel printed {}", path.display());
    path
}

/// A C program of tests/programs, cross-compiled for aarch64 by zig against glibc 2.17 (as the
/// wheel's library is linked), into test-programs/aarch64/.
pub fn arm64_program(source: &str) -> PathBuf {
    for_aarch64(Program::c(source))
        .named(&format!("aarch64/{source}"))
        .build()
}

/// A shared object of tests/programs (`lib<source>.so.2`), cross-compiled as [`arm64_program`].
pub fn arm64_shared_object(source: &str) -> PathBuf {
    for_aarch64(Program::c(source).shared())
        .named(&format!("aarch64/lib{source}.so.2"))
        .build()
}

/// `program` compiled by zig's `cc` for aarch64 and glibc 2.17.
pub fn for_aarch64(program: Program) -> Program {
    let python = python();
    program.compiler(&[
        python.to_str().unwrap(),
        "-m",
        "ziglang",
        "cc",
        "-target",
        "aarch64-linux-gnu.2.17",
    ])
}

/// Where `scripts/wheel aarch64` leaves the native files the aarch64 wheel is assembled from
/// (`libtllm_affinity.so`, `tllm-affinity`).
pub fn aarch64_natives() -> PathBuf {
    repo().join("target/zig/aarch64-unknown-linux-gnu/wheel")
}
