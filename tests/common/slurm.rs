//! A real single-node Slurm for the tests (tests/launchers/slurm.rs): `munged`, `slurmctld` and `slurmd`
//! started by the test binary as its own processes, in the foreground, under one temporary
//! directory (its own munge key and socket, ports, state, spool, logs; no systemd), once per test
//! binary and per task plugin, and stopped by pid when the binary exits — a failing test too,
//! since libtest ends through `exit`. The daemons are spawned from one thread that lives as long
//! as the binary, with `PR_SET_PDEATHSIG`, so a binary killed outright takes them with it.
//!
//! Two clusters can run side by side: `TaskPlugin=task/affinity,task/cgroup` (cgroup v1 cpusets,
//! `ConstrainCores=yes`, `proctrack/cgroup`) and `task/affinity` alone (`proctrack/linuxproc`).
//! Node names carry the binary's pid, so the cgroups Slurm makes (`slurm_<node>` in the cpuset
//! and freezer hierarchies) never collide with another run's; they are removed at exit.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskPlugin {
    /// `TaskPlugin=task/affinity,task/cgroup`, `ConstrainCores=yes`.
    AffinityAndCgroup,
    /// `TaskPlugin=task/affinity` alone.
    Affinity,
}

impl TaskPlugin {
    pub fn name(self) -> &'static str {
        match self {
            TaskPlugin::AffinityAndCgroup => "task/affinity,task/cgroup",
            TaskPlugin::Affinity => "task/affinity",
        }
    }

    fn short(self) -> &'static str {
        match self {
            TaskPlugin::AffinityAndCgroup => "cg",
            TaskPlugin::Affinity => "af",
        }
    }
}

/// One running cluster: its `slurm.conf`, and a lock that runs its jobs one at a time (the node
/// has the machine's two CPUs; two jobs at once would queue or land on other CPUs).
pub struct Cluster {
    pub plugin: TaskPlugin,
    pub conf: PathBuf,
    pub node: String,
    jobs: Mutex<()>,
}

/// The state shared by both clusters: the directory, munged, the pids to stop at exit.
struct Base {
    dir: PathBuf,
    socket: PathBuf,
}

static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static NODES: Mutex<Vec<String>> = Mutex::new(Vec::new());
static DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

const DAEMONS: [&str; 4] = ["munged", "slurmctld", "slurmd", "srun"];

/// The first Slurm or munge program that is not installed (scripts/setup installs them), for
/// [`require!`](super::require).
fn installed() -> Result<(), String> {
    match DAEMONS.iter().find(|d| !super::on_path(d)) {
        Some(missing) => Err(format!("`{missing}` on PATH")),
        None => Ok(()),
    }
}

/// The cluster for `plugin`, started at the first call; the error (for
/// [`require!`](super::require)) says what this host lacks to run it.
pub fn cluster(plugin: TaskPlugin) -> Result<&'static Cluster, String> {
    static CG: OnceLock<Result<Cluster, String>> = OnceLock::new();
    static AF: OnceLock<Result<Cluster, String>> = OnceLock::new();
    let cell = match plugin {
        TaskPlugin::AffinityAndCgroup => &CG,
        TaskPlugin::Affinity => &AF,
    };
    cell.get_or_init(|| {
        installed()?;
        if plugin == TaskPlugin::AffinityAndCgroup
            && !(super::cpuset_cgroup_root().is_some()
                && Path::new("/sys/fs/cgroup/freezer").is_dir())
        {
            return Err(
                "cgroup v1 cpuset and freezer hierarchies (task/cgroup, proctrack/cgroup)".into(),
            );
        }
        Ok(start_cluster(plugin))
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl Cluster {
    /// Runs `srun <args>` against this cluster with `env` added, stdin closed, bounded by
    /// `limit`; jobs of one cluster run one at a time.
    pub fn srun(&self, args: &[&str], env: &[(&str, &str)], limit: Duration) -> super::Finished {
        let _one_at_a_time = self.lock();
        let mut cmd = Command::new("srun");
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy().into_owned();
            // A test run inside a Slurm job must not hand that job's variables to this one.
            // Nor the variables that steer the library or the device mapping.
            let steering = name.starts_with("TLLM_")
                || name.starts_with("CUDA_")
                || ["LD_PRELOAD", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]
                    .contains(&name.as_str());
            if name.starts_with("SLURM_") || name.starts_with("SRUN_") || steering {
                cmd.env_remove(name);
            }
        }
        cmd.env("SLURM_CONF", &self.conf)
            .args(args)
            .envs(env.iter().copied());
        super::run_bounded(cmd, limit)
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("tllm-slurm.")
            .tempdir()
            .unwrap()
            .keep();
        *DIR.lock().unwrap() = Some(dir.clone());
        // SAFETY: registering a plain extern "C" function with no arguments.
        unsafe { libc::atexit(stop_everything) };
        let key = dir.join("munge.key");
        // Our own key: a copy of the package's when there is one, else 1 KiB of random bytes.
        let bytes = std::fs::read("/etc/munge/munge.key").unwrap_or_else(|_| {
            let mut b = vec![0u8; 1024];
            use std::io::Read;
            std::fs::File::open("/dev/urandom")
                .unwrap()
                .read_exact(&mut b)
                .unwrap();
            b
        });
        std::fs::write(&key, bytes).unwrap();
        set_mode(&key, 0o600);
        let socket = dir.join("munge.sock");
        let mut munged = Command::new("munged");
        munged
            .args(["--foreground", "--force"])
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--pid-file={}", dir.join("munged.pid").display()))
            .arg(format!("--log-file={}", dir.join("munged.log").display()))
            .arg(format!("--seed-file={}", dir.join("munged.seed").display()));
        spawn_daemon(munged, &dir.join("munged.out"));
        wait_for(
            || socket.exists(),
            Duration::from_secs(20),
            "munged's socket",
            &dir,
        );
        Base { dir, socket }
    })
}

fn start_cluster(plugin: TaskPlugin) -> Cluster {
    let base = base();
    let dir = base.dir.join(plugin.short());
    for sub in ["state", "spool"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let node = format!("tllm{}{}", std::process::id(), plugin.short());
    NODES.lock().unwrap().push(node.clone());
    let (ctld_port, d_port) = free_ports();
    let host = hostname();
    let (proctrack, task) = match plugin {
        TaskPlugin::AffinityAndCgroup => ("proctrack/cgroup", "task/affinity,task/cgroup"),
        TaskPlugin::Affinity => ("proctrack/linuxproc", "task/affinity"),
    };
    let d = dir.display();
    let conf = format!(
        "ClusterName={node}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType={proctrack}
TaskPlugin={task}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
",
        socket = base.socket.display(),
    );
    let conf_path = dir.join("slurm.conf");
    std::fs::write(&conf_path, conf).unwrap();
    // Read from beside slurm.conf; task/cgroup needs it, and it is harmless without.
    std::fs::write(
        dir.join("cgroup.conf"),
        "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainCores=yes\n",
    )
    .unwrap();
    let mut ctld = Command::new("slurmctld");
    ctld.args(["-D", "-i"]).env("SLURM_CONF", &conf_path);
    spawn_daemon(ctld, &dir.join("slurmctld.out"));
    let mut slurmd = Command::new("slurmd");
    slurmd
        .args(["-D", "-N", &node])
        .env("SLURM_CONF", &conf_path);
    spawn_daemon(slurmd, &dir.join("slurmd.out"));
    let idle = || {
        Command::new("sinfo")
            .args(["-h", "-o", "%t", "-n", &node])
            .env("SLURM_CONF", &conf_path)
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
    };
    wait_for(idle, Duration::from_secs(60), "the node to be idle", &dir);
    Cluster {
        plugin,
        conf: conf_path,
        node,
        jobs: Mutex::new(()),
    }
}

/// Spawns a daemon from the one thread that lives as long as the binary (a thread's death is
/// what `PR_SET_PDEATHSIG` watches), its output into `log`, and records its pid for the exit.
fn spawn_daemon(mut cmd: Command, log: &Path) {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static KEEPER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
            // Every sender is in a static: this thread only ends with the process.
            loop {
                std::thread::park();
            }
        });
        Mutex::new(tx)
    });
    let out = std::fs::File::create(log).unwrap();
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    // SAFETY: prctl is async-signal-safe and touches nothing of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    keeper.lock().unwrap().send((cmd, tx)).unwrap();
    let child = rx
        .recv()
        .unwrap()
        .unwrap_or_else(|e| panic!("spawning a daemon: {e}"));
    PIDS.lock().unwrap().push(child.id());
    // The Child is dropped without waiting: the exit handler reaps it by pid.
    std::mem::forget(child);
}

fn wait_for(mut ready: impl FnMut() -> bool, limit: Duration, what: &str, dir: &Path) {
    let deadline = Instant::now() + limit;
    while !ready() {
        if Instant::now() > deadline {
            let logs: String = ["munged.out", "cg/slurmctld.log", "cg/slurmd.log"]
                .iter()
                .chain(["af/slurmctld.log", "af/slurmd.log"].iter())
                .filter_map(|f| {
                    let text = std::fs::read_to_string(dir.join(f)).ok()?;
                    let tail: Vec<&str> = text.lines().rev().take(15).collect();
                    Some(format!(
                        "--- {f}:\n{}\n",
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    ))
                })
                .collect();
            panic!("waited {limit:?} for {what}\n{logs}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops the daemons by pid (SIGTERM, then SIGKILL after 10 s), reaps them, removes the cgroups
/// Slurm made for our nodes and the directory.
extern "C" fn stop_everything() {
    let pids: Vec<u32> = std::mem::take(&mut *PIDS.lock().unwrap_or_else(|e| e.into_inner()));
    // slurmd before slurmctld before munged: the reverse of the start.
    for &pid in pids.iter().rev() {
        // SAFETY: signalling and reaping a child this process started and has not reaped.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for &pid in pids.iter().rev() {
        loop {
            let mut status = 0;
            // SAFETY: as above.
            let done = unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
            if done != 0 {
                break;
            }
            if Instant::now() > deadline {
                // SAFETY: as above.
                unsafe {
                    libc::kill(pid as i32, libc::SIGKILL);
                    libc::waitpid(pid as i32, &mut status, 0);
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for node in NODES.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        for hierarchy in ["cpuset", "freezer", "memory", "devices", "cpuacct", "cpu"] {
            remove_cgroup_tree(
                &Path::new("/sys/fs/cgroup")
                    .join(hierarchy)
                    .join(format!("slurm_{node}")),
            );
        }
    }
    if let Some(dir) = DIR.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// rmdir, deepest first (a cgroup directory goes only with rmdir, once its children are gone).
fn remove_cgroup_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&entry.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Two ports nobody listens on now (both held until both are known, so they differ).
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

fn hostname() -> String {
    let out = Command::new("hostname").arg("-s").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}
