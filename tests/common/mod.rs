//! What every integration test needs: the real library built and located, test programs
//! compiled, a simulated sysfs tree, and processes run under the library whose per-thread masks
//! are read from `/proc`.
#![allow(dead_code)]

pub mod slurm;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Once, OnceLock};

use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::simulated;
use tllm_affinity_core::topology::{SysfsRoot, Topology};

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

/// Compiles `tests/programs/<src>.c` into `out_name` under target/<profile>/test-programs with
/// `compiler` and `flags` (after the source, before `-ldl`); rebuilt when the source,
/// a header of tests/programs, or the command line changed. Every test program goes through here.
pub fn compile_program(src: &str, out_name: &str, compiler: &str, flags: &[&str]) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out_dir = target_dir().join("test-programs");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(out_name);
    let src_path = programs_dir().join(format!("{src}.c"));
    let stamp = out.with_extension("args");
    let args = format!("{compiler} {}", flags.join(" "));
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
        let tmp = out_dir.join(format!("{out_name}.tmp{}", std::process::id()));
        let status = Command::new(compiler)
            .args(["-O1", "-g", "-Wall", "-pthread", "-o"])
            .arg(&tmp)
            .arg(&src_path)
            .args(flags)
            .arg("-ldl")
            .status()
            .unwrap_or_else(|e| panic!("{compiler}: {e}"));
        assert!(status.success(), "compiling {} failed", src_path.display());
        std::fs::rename(&tmp, &out).unwrap();
        std::fs::write(&stamp, &args).unwrap();
    }
    out
}

/// `tests/programs/<name>.c` built with cc; `shared` builds the shared object `lib<name>.so.2`.
pub fn compile_c(name: &str, shared: bool) -> PathBuf {
    compile_with(name, shared, "cc", &[])
}

/// The CPUs this test process may use.
pub fn allowed_cpus() -> CpuMask {
    tllm_affinity_core::engine::kernel::get_mask(0).expect("sched_getaffinity")
}

/// False, after saying why the test is skipped, when this process has fewer than two CPUs: `what`
/// (a worker set narrower than the host, a constraint...) cannot be shown then. In CI it fails.
pub fn two_cpus_or_skip(what: &str) -> bool {
    let all = allowed_cpus();
    require(
        all.count() >= 2,
        &format!("two allowed CPUs ({what}; this process has [{all}])"),
    )
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

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Device 0's local CPUs, as the topology model computes them from the tree.
    pub fn gpu0_local(&self) -> CpuMask {
        let t = Topology::read(&SysfsRoot::new(self.path())).unwrap();
        t.gpu_local_cpus(&t.gpus[0]).cpus
    }
}

/// A command with the library preloaded and the simulated topology in place.
pub fn preloaded(program: impl AsRef<std::ffi::OsStr>, sysfs: &Sysfs) -> Command {
    let mut cmd = Command::new(program);
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

/// A program that prints `PHASE <name> <thread>=<tid>:<role> ...` and waits for a line on stdin.
pub struct Population {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    stderr_path: PathBuf,
    _stderr_dir: tempfile::TempDir,
}

pub struct Finished {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// A program with piped stdin and stdout, its stderr collected in a file (a pipe nobody reads
/// could fill and block it).
struct Piped {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    stderr_path: PathBuf,
    dir: tempfile::TempDir,
}

fn spawn_piped(cmd: &mut Command) -> Piped {
    let dir = tempfile::tempdir().unwrap();
    let stderr_path = dir.path().join("stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let stdin = child.stdin.take();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    Piped {
        child,
        stdin,
        stdout,
        stderr_path,
        dir,
    }
}

impl Population {
    pub fn spawn(mut cmd: Command) -> Population {
        let Piped {
            child,
            stdin,
            stdout,
            stderr_path,
            dir,
        } = spawn_piped(&mut cmd);
        Population {
            child,
            stdin,
            stdout,
            stderr_path,
            _stderr_dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Waits for the next checkpoint and reads every named thread's mask from `/proc`.
    pub fn phase(&mut self) -> Phase {
        let line = self.line("PHASE ");
        parse_phase(&line, self.pid(), Some)
    }

    /// Lets the program go on to its next phase.
    pub fn proceed(&mut self) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// Runs the program to its end, answering every phase, and collects what it printed.
    pub fn finish(mut self) -> Finished {
        // Answer a phase the program may still be waiting at (it may also have ended already,
        // so a closed pipe is fine), then close its stdin.
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.write_all(b"\n").and_then(|_| stdin.flush());
        }
        drop(self.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        let status = self.child.wait().unwrap();
        Finished {
            status,
            stdout: rest,
            stderr: self.stderr(),
        }
    }

    /// Collects every phase until the program ends.
    pub fn all_phases(mut self, count: usize) -> (Vec<Phase>, Finished) {
        let mut phases = Vec::new();
        for _ in 0..count {
            phases.push(self.phase());
            self.proceed();
        }
        let finished = self.finish();
        (phases, finished)
    }
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
    pub fn create(cpus: &str) -> Result<CpusetCgroup, String> {
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

// ---- Helpers of the runtime, MPI, constraint and deployment tests (tests/runtimes.rs, ...) ----

/// As [`compile_c`], with another compiler driver (`mpicc`) and extra flags (`-fopenmp`).
pub fn compile_with(name: &str, shared: bool, compiler: &str, flags: &[&str]) -> PathBuf {
    if shared {
        let flags: Vec<&str> = ["-fPIC", "-shared"].iter().chain(flags).copied().collect();
        compile_program(name, &format!("lib{name}.so.2"), compiler, &flags)
    } else {
        compile_program(name, name, compiler, flags)
    }
}

/// `librt_omp.so.2`: tests/programs/rt_omp.c built with `-fopenmp` (a real libgomp pool).
pub fn rt_omp() -> PathBuf {
    compile_with("rt_omp", true, "cc", &["-fopenmp"])
}

impl Population {
    /// Waits for a line starting with `prefix` (before the next phase) and returns the rest.
    pub fn line(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(
                n > 0,
                "program ended before printing {prefix:?}; stderr:\n{}",
                self.stderr()
            );
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }
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

// ---- Lifecycle, fault, stress and security tests (tests/lifecycle.rs and its siblings) ----

/// Compiles `tests/programs/<src>.c` (which may include `lc_common.h`) into `out_name`, warnings
/// as errors, with `extra` cc arguments (link flags, `-shared -fPIC`).
pub fn compile_lc(src: &str, out_name: &str, extra: &[&str]) -> PathBuf {
    let flags: Vec<&str> = ["-Wextra", "-Werror"]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    compile_program(src, out_name, "cc", &flags)
}

/// `tests/programs/lc_workerlib.c` as `libnccl_lc.so.2`: a start routine the default
/// `TLLM_AFFINITY_WORKER_LIBS` classifies, for the apply path (a host starting a worker).
pub fn worker_library() -> PathBuf {
    compile_lc("lc_workerlib", "libnccl_lc.so.2", &["-shared", "-fPIC"])
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

/// `key=value` from a result line such as `CHILD main threads=1 role=0`.
pub fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .to_string()
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

/// A program driven line by line with a deadline: every wait for output fails the test (and
/// kills the process) when the deadline passes, so a hang is a failure, never a stuck test.
pub struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
    deadline: std::time::Instant,
    /// Every stdout line read so far.
    pub out: Vec<String>,
}

impl Driver {
    pub fn spawn(mut cmd: Command, limit: std::time::Duration) -> Driver {
        let Piped {
            child,
            stdin,
            stdout,
            stderr_path,
            dir,
        } = spawn_piped(&mut cmd);
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
            deadline: std::time::Instant::now() + limit,
            out: Vec::new(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    fn fail(&mut self, why: &str) -> ! {
        let states = thread_states(self.pid());
        let _ = self.child.kill();
        let _ = self.child.wait();
        panic!(
            "{why}\nthreads (tid:state:wchan): {states}\nstdout so far:\n{}\nstderr:\n{}",
            self.out.join("\n"),
            self.stderr()
        );
    }

    /// The next stdout line that starts with `prefix` (lines before it are kept in `out`).
    pub fn line(&mut self, prefix: &str) -> String {
        loop {
            let left = self
                .deadline
                .saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.out.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    self.fail(&format!("deadline passed waiting for {prefix:?}: killed"))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().ok();
                    self.fail(&format!(
                        "the program ended ({status:?}) before printing {prefix:?}"
                    ))
                }
            }
        }
    }

    /// The next PHASE line, with every named thread's mask read from `/proc`.
    pub fn phase(&mut self) -> Phase {
        let line = self.line("PHASE ");
        parse_phase(&line["PHASE ".len()..], self.pid(), Some)
    }

    /// The next `REPORT <tag> <json>` line, parsed.
    pub fn report(&mut self, tag: &str) -> serde_json::Value {
        let line = self.line(&format!("REPORT {tag} "));
        let json = &line[format!("REPORT {tag} ").len()..];
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"))
    }

    /// Lets the program go on past its current phase.
    pub fn proceed(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.write_all(b"\n").and_then(|_| stdin.flush());
        }
    }

    /// Answers the current phase, closes stdin, reads the rest of stdout and waits for the end,
    /// all before the deadline;
    /// `stdout` is everything the program printed.
    pub fn finish(mut self) -> Finished {
        // Answer a phase the program may still be waiting at, then close its stdin.
        self.proceed();
        drop(self.stdin.take());
        let mut rest = Vec::new();
        loop {
            let left = self
                .deadline
                .saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => rest.push(line),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    self.out.append(&mut rest);
                    self.fail("deadline passed waiting for the end: killed")
                }
            }
        }
        self.out.extend(rest);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Finished {
                    status,
                    stdout: self.out.join("\n"),
                    stderr: self.stderr(),
                };
            }
            if std::time::Instant::now() > self.deadline {
                self.fail("deadline passed waiting for the exit: killed");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Driver {
    /// Runs the program to its end, answering every PHASE line as it comes; `stdout` is
    /// everything it printed.
    pub fn answer_all(mut self) -> Finished {
        loop {
            let left = self
                .deadline
                .saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let phase = line.starts_with("PHASE ");
                    self.out.push(line);
                    if phase {
                        self.proceed();
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return self.finish(),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    self.fail("deadline passed: killed")
                }
            }
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs a command to its end with stdin closed, failing (and killing it) past `limit`.
pub fn run_bounded(cmd: Command, limit: std::time::Duration) -> Finished {
    Driver::spawn(cmd, limit).finish()
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

impl Population {
    /// Answers the phase the program waits at (if it is still there), closes its stdin, and
    /// collects what it printed until it ends.
    pub fn conclude(mut self) -> Finished {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"\n");
            let _ = stdin.flush();
        }
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        let status = self.child.wait().unwrap();
        Finished {
            status,
            stdout: rest,
            stderr: self.stderr(),
        }
    }
}

/// True when the host can run what a test needs. When it cannot, the test fails in CI
/// (`CI=true`, where `.ci/run` installs everything) and elsewhere prints why it is skipped.
pub fn require(available: bool, what: &str) -> bool {
    if available {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{what} is missing in CI, where .ci/run installs it"
    );
    println!("skipped: needs {what}");
    false
}

/// [`require`] for a program on PATH.
pub fn require_command(name: &str) -> bool {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
        .unwrap_or(false);
    require(found, &format!("`{name}` on PATH"))
}

// ---- The pip-installed Python package (tests/zero_code.rs) ----

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
const MIRROR: &str = "http://deb.debian.org/debian";

/// Debian bullseye (glibc 2.31: the old-glibc checks of tests/wheel.rs and tests/containers.rs),
/// `debootstrap --variant=minbase`, made once and kept in
/// `/var/cache/tllm-affinity/bullseye-minbase` for every checkout. None (a skip; a failure in
/// CI) when it cannot be made: not root, no debootstrap, or the mirror out of reach.
pub fn bullseye_rootfs() -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    let cache = Path::new(ROOTFS_CACHE);
    let rootfs = cache.join("bullseye-minbase");
    // SAFETY: geteuid has no preconditions.
    if !require(unsafe { libc::geteuid() } == 0, "root (chroot)") {
        return None;
    }
    std::fs::create_dir_all(cache).unwrap();
    let lock = std::fs::File::create(cache.join("bullseye.lock")).unwrap();
    // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if rootfs.join("usr/bin/true").is_file() {
        return Some(rootfs);
    }
    if !require_command("debootstrap") {
        return None;
    }
    let partial = cache.join(format!("bullseye.partial.{}", std::process::id()));
    let out = Command::new("debootstrap")
        .args(["--variant=minbase", "bullseye"])
        .arg(&partial)
        .arg(MIRROR)
        .output()
        .unwrap();
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        require(
            false,
            &format!(
                "a Debian bullseye root filesystem: `debootstrap --variant=minbase bullseye {MIRROR}` \
                 failed (is the mirror reachable?): {}",
                tail.join(" | ")
            ),
        );
        return None;
    }
    std::fs::rename(&partial, &rootfs).unwrap();
    Some(rootfs)
}

/// `tests/programs/old_glibc.c` linked against glibc 2.17 by zig (the wheel's toolchain), so that
/// it runs in the old root filesystem.
pub fn old_glibc_program(to: &Path) {
    let out = Command::new(python())
        .args(["-m", "ziglang", "cc", "-target", "x86_64-linux-gnu.2.17"])
        .args(["-O1", "-Wall", "-pthread", "-o"])
        .arg(to)
        .arg(programs_dir().join("old_glibc.c"))
        .arg("-ldl")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "zig cc: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
