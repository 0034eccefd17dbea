//! Simulated hosts, CPU masks, and commands run under the library on them.

use super::*;

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

    /// `host` written as it is: a full-scale shape whose CPUs are mostly not this machine's (the
    /// library places threads on the allowed CPUs among them, and `ps` draws all of them).
    /// `node0` and `node1` are left empty: the shape's own nodes are in the tree.
    pub fn written(host: &simulated::SimulatedHost) -> Sysfs {
        let dir = tempfile::tempdir().unwrap();
        host.write(dir.path()).unwrap();
        Sysfs {
            dir,
            node0: CpuMask::new(),
            node1: CpuMask::new(),
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
        "TLLM_AFFINITY_SLICE",
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
