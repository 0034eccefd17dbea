//! What every integration test needs: the real library built and located, test programs
//! compiled, a simulated sysfs tree, and processes run under the library whose per-thread masks
//! are read from `/proc`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Once, OnceLock};

use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::simulated;

/// target/<profile>, from this test binary's path (target/<profile>/deps/<test>).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// The real `libtllm_affinity.so`, built once per test binary in this test's profile.
pub fn library() -> PathBuf {
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-q", "-p", "tllm-affinity-preload"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if target_dir().ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("cargo build");
        assert!(status.success(), "building the preload library failed");
    });
    let lib = target_dir().join("libtllm_affinity.so");
    assert!(lib.exists(), "{} missing", lib.display());
    lib
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

/// Compiles `tests/programs/<name>.c` (once per test binary and name) and returns the binary.
/// `shared` builds a shared object named `lib<name>.so.2` instead.
pub fn compile_c(name: &str, shared: bool) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out_dir = target_dir().join("test-programs");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = if shared {
        out_dir.join(format!("lib{name}.so.2"))
    } else {
        out_dir.join(name)
    };
    let src = programs_dir().join(format!("{name}.c"));
    let fresh = out.metadata().and_then(|m| m.modified()).ok()
        >= src.metadata().and_then(|m| m.modified()).ok()
        && out.exists();
    if !fresh {
        let tmp = out.with_extension(format!("tmp{}", std::process::id()));
        let mut cmd = Command::new("cc");
        cmd.args(["-O1", "-g", "-Wall", "-pthread"]);
        if shared {
            cmd.args(["-fPIC", "-shared"]);
        }
        cmd.arg("-o").arg(&tmp).arg(&src).arg("-ldl");
        let status = cmd.status().expect("cc");
        assert!(status.success(), "compiling {} failed", src.display());
        std::fs::rename(&tmp, &out).unwrap();
    }
    out
}

/// The CPUs this test process may use.
pub fn allowed_cpus() -> CpuMask {
    tllm_affinity_core::engine::kernel::get_mask(0).expect("sched_getaffinity")
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

impl Population {
    pub fn spawn(mut cmd: Command) -> Population {
        let dir = tempfile::tempdir().unwrap();
        let stderr_path = dir.path().join("stderr");
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn population");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
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
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(
                n > 0,
                "population ended before its next phase; stderr:\n{}",
                self.stderr()
            );
            if line.starts_with("PHASE ") {
                break;
            }
        }
        let mut words = line.split_whitespace().skip(1);
        let name = words.next().unwrap().to_string();
        let pid = self.pid();
        // Threads that have exited since they were noted are left out.
        let threads = words
            .filter_map(|w| {
                let (thread, rest) = w.split_once('=').unwrap();
                let (tid, role) = rest.split_once(':').unwrap();
                let tid: i32 = tid.parse().unwrap();
                let mask = try_kernel_mask(pid, tid)?;
                Some((
                    thread.to_string(),
                    ThreadSeen {
                        tid,
                        role: role.parse().unwrap(),
                        mask,
                    },
                ))
            })
            .collect();
        Phase { name, threads }
    }

    /// Lets the program go on to its next phase.
    pub fn proceed(&mut self) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// Runs the program to its end, answering every phase, and collects what it printed.
    pub fn finish(mut self) -> Finished {
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
