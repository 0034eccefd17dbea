//! What the tooling tests (`cli`, `python_module`, `header`) share: the built artifacts, the real
//! Python interpreter, clean child environments and simulated hosts over this machine's CPUs.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Once, OnceLock};

use tllm_affinity_core::engine::kernel;
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::simulated::two_node_one_gpu;
use tllm_affinity_core::topology::{SysfsRoot, Topology};

/// `target/<profile>`, from this test binary's path (`target/<profile>/deps/<test>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary under target/<profile>/deps")
        .to_path_buf()
}

/// Builds the preload library and the CLI once per test binary, in this binary's profile.
fn build() {
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args([
                "build",
                "-p",
                "tllm-affinity-preload",
                "-p",
                "tllm-affinity",
                "--bins",
                "--lib",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_dir().file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("run cargo build");
        assert!(
            status.success(),
            "cargo build of the library and CLI failed"
        );
    });
}

/// `target/<profile>/libtllm_affinity.so`, absolute.
pub fn library() -> PathBuf {
    build();
    let lib = profile_dir().join("libtllm_affinity.so");
    assert!(lib.exists(), "{} missing", lib.display());
    lib.canonicalize().unwrap()
}

/// `target/<profile>/tllm-affinity`, beside the library (where `run` looks for it).
pub fn cli() -> PathBuf {
    build();
    let bin = profile_dir().join("tllm-affinity");
    assert!(bin.exists(), "{} missing", bin.display());
    bin
}

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub fn program(name: &str) -> PathBuf {
    repo().join("tests/programs").join(name)
}

/// The real interpreter: `python3` on PATH may be a pyenv shell shim that forks many processes.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3 on PATH");
        assert!(out.status.success());
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
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

/// This thread's CPU mask as the kernel has it.
pub fn my_mask() -> CpuMask {
    kernel::get_mask(0).expect("this thread's mask")
}

/// A sysfs tree of `simulated::two_node_one_gpu` over this process's CPUs (what `run --simulate`
/// writes), with device 0's GPU-local CPUs.
pub struct SimulatedHost {
    pub dir: tempfile::TempDir,
    pub gpu0_local: CpuMask,
}

impl SimulatedHost {
    pub fn new() -> SimulatedHost {
        let dir = tempfile::tempdir().unwrap();
        two_node_one_gpu(&my_mask()).write(dir.path()).unwrap();
        let gpu0_local = expected_gpu0_local(dir.path());
        SimulatedHost { dir, gpu0_local }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Device 0's local CPUs in the tree at `root`, as the topology model computes them.
pub fn expected_gpu0_local(root: &Path) -> CpuMask {
    let t = Topology::read(&SysfsRoot::new(root)).unwrap();
    t.gpu_local_cpus(&t.gpus[0]).cpus
}

/// `Cpus_allowed_list` of a thread, from the kernel.
pub fn kernel_mask_text(pid: u32, tid: i64) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list")
        .trim()
        .to_string()
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
