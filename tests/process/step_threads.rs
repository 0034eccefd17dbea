//! SPEC §6 end to end: step and result threads pinned for real by the preloaded library, in
//! Python processes that call the C ABI through ctypes, on sysfs trees shaped over this machine's
//! own CPUs. The per-GPU lock is exercised across real processes (a second holder, a SIGKILLed
//! holder, the umask, a planted symlink).

use crate::common;

use common::{library, lines_starting, program, python, says, Driver, DEADLINE};

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;
use tllm_affinity_core::host::simulated::{two_node_one_gpu, SimulatedHost};
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::sys;

fn step_pin() -> PathBuf {
    program("step_pin.py")
}

/// The two lowest CPUs this test may use (they become the simulated host's CPUs).
fn lowest_two_cpus() -> (usize, usize) {
    let mask = sys::get_mask(0).expect("this thread's mask");
    let cpus: Vec<usize> = mask.iter().take(2).collect();
    assert!(
        cpus.len() == 2,
        "these tests need two CPUs, the mask is [{mask}]"
    );
    (cpus[0], cpus[1])
}

fn cpus(list: &[usize]) -> CpuMask {
    CpuMask::from_cpus(list.iter().copied())
}

/// One node over the two CPUs, each its own core, with one GPU: `auto` can pin (two cores for
/// one GPU), the step thread on the first CPU, the result thread on the second.
fn one_node_two_cores() -> SimulatedHost {
    let (a, b) = lowest_two_cpus();
    SimulatedHost::new()
        .cpu(a, 0, 0, &cpus(&[a]))
        .cpu(b, 1, 0, &cpus(&[b]))
        .node(0, &cpus(&[a, b]))
        .gpu("0000:3b:00.0", Some(0), None)
}

/// A test's sysfs tree and lock directory.
struct Host {
    sysfs: tempfile::TempDir,
    locks: tempfile::TempDir,
}

impl Host {
    fn new(host: &SimulatedHost) -> Host {
        let sysfs = tempfile::tempdir().unwrap();
        host.write(sysfs.path()).unwrap();
        Host {
            sysfs,
            locks: tempfile::tempdir().unwrap(),
        }
    }

    fn lock(&self, address: &str) -> PathBuf {
        self.locks
            .path()
            .join(format!("tllm-affinity-gpu-{address}.lock"))
    }

    /// The program under the library, with this host's tree and lock directory and `vars`.
    fn command(&self, vars: &[(&str, &str)], args: &[&str]) -> Command {
        let mut cmd = Command::new(python());
        cmd.arg(step_pin()).args(args);
        for (name, _) in std::env::vars() {
            let device_var = [
                "CUDA_VISIBLE_DEVICES",
                "CUDA_DEVICE_ORDER",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "SLURM_LOCALID",
                "LOCAL_RANK",
            ]
            .contains(&name.as_str());
            if name.starts_with("TLLM_") || device_var {
                cmd.env_remove(name);
            }
        }
        cmd.env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_SYSFS_ROOT", self.sysfs.path())
            .env("TLLM_AFFINITY_LOCK_DIR", self.locks.path())
            .env("TLLM_AFFINITY_LOG", "info")
            .env("TLLM_AFFINITY_POLICY", "numa")
            .envs(vars.iter().copied());
        cmd
    }

    fn run(&self, vars: &[(&str, &str)], args: &[&str]) -> Run {
        Run::from(self.command(vars, args).output().expect("run python"))
    }
}

struct Run {
    code: Option<i32>,
    json: Value,
    stderr: String,
}

impl From<Output> for Run {
    fn from(out: Output) -> Run {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let json = stdout
            .lines()
            .next()
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or(Value::Null);
        Run {
            code: out.status.code(),
            json,
            stderr,
        }
    }
}

impl Run {
    fn ok(self) -> Run {
        assert_eq!(self.code, Some(0), "stderr:\n{}", self.stderr);
        self
    }

    fn rc(&self, thread: &str) -> i64 {
        self.json[thread]["rc"]
            .as_i64()
            .unwrap_or_else(|| panic!("no rc for {thread}: {} / {}", self.json, self.stderr))
    }

    /// The thread's mask as it saw it (sched_getaffinity), checked against /proc.
    fn mask(&self, thread: &Value) -> Vec<usize> {
        let mask: Vec<usize> = thread["mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap() as usize)
            .collect();
        let status = thread["status"].as_str().unwrap();
        assert_eq!(
            CpuMask::parse_list(status).unwrap(),
            cpus(&mask),
            "/proc disagrees"
        );
        mask
    }

    fn pool_masks(&self, thread: &str) -> Vec<Vec<usize>> {
        let pool = self.json[thread]["pool"].as_array().expect("pool");
        let tids: std::collections::HashSet<u64> =
            pool.iter().map(|t| t["tid"].as_u64().unwrap()).collect();
        assert_eq!(tids.len(), pool.len(), "pool threads are distinct");
        pool.iter().map(|t| self.mask(t)).collect()
    }

    fn warnings(&self) -> Vec<&str> {
        lines_starting(&self.stderr, "[tllm-affinity] warning:")
    }

    /// The step and result threads were started on their natural mask, not pinned, with one
    /// warning each: the warnings.
    fn unpinned_with_a_warning_each(&self) -> Vec<&str> {
        assert_eq!(self.rc("step"), 0);
        assert_eq!(self.rc("result"), 0);
        assert_eq!(self.mask(&self.json["step"]), natural(self));
        let warnings = self.warnings();
        assert_eq!(warnings.len(), 2, "{}", self.stderr);
        warnings
    }
}

/// The main thread's mask at start (the natural mask of every thread the program starts).
fn natural(run: &Run) -> Vec<usize> {
    run.mask(&run.json["main"])
}

#[test]
fn off_pins_nothing_and_says_so() {
    let (a, b) = lowest_two_cpus();
    let host = Host::new(&two_node_one_gpu(&cpus(&[a, b])));
    let run = host.run(&[], &["--step", "0", "--result", "0"]).ok();
    assert_eq!(run.rc("step"), 0);
    assert_eq!(run.rc("result"), 0);
    assert_eq!(run.mask(&run.json["step"]), natural(&run));
    let warnings = run.warnings();
    assert_eq!(warnings.len(), 2, "{}", run.stderr);
    assert!(
        warnings[0].contains("TLLM_AFFINITY_STEP_CORE is off"),
        "{}",
        warnings[0]
    );
}

#[test]
fn auto_with_one_core_per_gpu_pool_pins_nothing_and_warns() {
    // Each CPU is its own core on its own node, one GPU per node: one core per GPU in each pool.
    let (a, b) = lowest_two_cpus();
    let host = Host::new(&two_node_one_gpu(&cpus(&[a, b])));
    for device in ["0", "1"] {
        let run = host
            .run(
                &[("TLLM_AFFINITY_STEP_CORE", "auto")],
                &["--step", device, "--result", device],
            )
            .ok();
        for w in run.unpinned_with_a_warning_each() {
            says(
                w,
                &[
                    "not pinned",
                    "1 allowed core(s) for the 1 GPU(s)",
                    "needs two",
                ],
            );
        }
    }
    // Nothing pinned, so no lock taken.
    assert_eq!(std::fs::read_dir(host.locks.path()).unwrap().count(), 0);
}

#[test]
fn cpu_setting_pins_the_step_core_and_the_next_core_for_the_result() {
    let (a, b) = lowest_two_cpus();
    let host = Host::new(&two_node_one_gpu(&cpus(&[a, b])));
    let b_text = b.to_string();
    let vars = [("TLLM_AFFINITY_STEP_CORE", b_text.as_str())];
    let run = host
        .run(&vars, &["--step", "0", "--result", "0", "--pool", "2"])
        .ok();
    assert_eq!(run.rc("step"), 1);
    assert_eq!(run.mask(&run.json["step"]), vec![b]);
    // b is the highest core, so the result thread wraps to the lowest.
    assert_eq!(run.rc("result"), 1);
    assert_eq!(run.mask(&run.json["result"]), vec![a]);
    // No lease: the pools the pinned threads start are on the natural mask.
    let natural = natural(&run);
    assert_eq!(natural, vec![a, b]);
    for thread in ["step", "result"] {
        for mask in run.pool_masks(thread) {
            assert_eq!(mask, natural, "{thread} pool");
        }
    }
    assert!(run.warnings().is_empty(), "{}", run.stderr);
    says(&run.stderr, &["step thread"]);
}

#[test]
fn a_step_threads_pool_is_born_on_the_worker_mask_under_a_lease() {
    let (a, b) = lowest_two_cpus();
    let host = Host::new(&two_node_one_gpu(&cpus(&[a, b])));
    let b_text = b.to_string();
    // Device 1 sits on node 0 = {a}: the worker mask; the step core is b.
    let run = host
        .run(
            &[("TLLM_AFFINITY_STEP_CORE", b_text.as_str())],
            &["--configure", "1", "--step", "1", "--pool", "3"],
        )
        .ok();
    assert!(
        run.json["configure"].as_i64().unwrap() > 0,
        "{}",
        run.stderr
    );
    assert_eq!(run.rc("step"), 1);
    assert_eq!(run.mask(&run.json["step"]), vec![b]);
    let pool = run.pool_masks("step");
    assert_eq!(pool.len(), 3);
    for mask in pool {
        assert_eq!(mask, vec![a]);
    }
}

#[test]
fn auto_pins_step_and_result_cores_when_the_pool_has_two_cores_per_gpu() {
    let (a, b) = lowest_two_cpus();
    let host = Host::new(&one_node_two_cores());
    let run = host
        .run(
            &[("TLLM_AFFINITY_STEP_CORE", "auto")],
            &["--step", "0", "--result", "0", "--pool", "2"],
        )
        .ok();
    assert_eq!(run.rc("step"), 1, "{}", run.stderr);
    assert_eq!(run.mask(&run.json["step"]), vec![a]);
    assert_eq!(run.rc("result"), 1);
    assert_eq!(run.mask(&run.json["result"]), vec![b]);
    for mask in run.pool_masks("step") {
        assert_eq!(mask, natural(&run));
    }
    assert!(host.lock("0000:3b:00.0").exists());
}

#[test]
fn a_cpu_outside_the_mask_fails_at_startup_and_pins_return_einval() {
    let (a, b) = lowest_two_cpus();
    let host = Host::new(&two_node_one_gpu(&cpus(&[a, b])));
    let mask = sys::get_mask(0).unwrap();
    let outside = (5..).find(|&c| !mask.contains(c)).unwrap();
    let text = outside.to_string();
    let run = host
        .run(
            &[("TLLM_AFFINITY_STEP_CORE", text.as_str())],
            &["--step", "0", "--result", "0"],
        )
        .ok();
    let errors = lines_starting(&run.stderr, "[tllm-affinity] error:");
    assert_eq!(errors.len(), 1, "{}", run.stderr);
    assert!(
        errors[0].contains(&format!(
            "CPU {outside} is outside the process mask [{mask}]"
        )),
        "{}",
        errors[0]
    );
    assert_eq!(run.rc("step"), -(libc::EINVAL as i64));
    assert_eq!(run.rc("result"), -(libc::EINVAL as i64));
    assert_eq!(run.mask(&run.json["step"]), natural(&run));

    let strict = host.run(
        &[
            ("TLLM_AFFINITY_STEP_CORE", text.as_str()),
            ("TLLM_AFFINITY_STRICT", "1"),
        ],
        &["--step", "0"],
    );
    assert_eq!(strict.code, Some(2), "{}", strict.stderr);
    says(&strict.stderr, &[&format!("CPU {outside}")]);
    assert_eq!(strict.json, Value::Null, "the program never ran");
}

/// Starts a process that pins for GPU 0 under `auto` and keeps running (killed, SIGKILL, when
/// the Driver is dropped); returns once it pinned.
fn hold(host: &Host) -> Driver {
    let cmd = host.command(
        &[("TLLM_AFFINITY_STEP_CORE", "auto")],
        &["--step", "0", "--hold"],
    );
    let mut holder = Driver::spawn(cmd, DEADLINE);
    let json: Value = serde_json::from_str(&holder.line("")).expect("holder's report");
    assert_eq!(json["step"]["rc"], 1, "holder pinned");
    holder
}

#[test]
fn one_process_per_gpu_holds_the_lock_and_a_killed_holder_frees_it() {
    let host = Host::new(&one_node_two_cores());
    let lock = host.lock("0000:3b:00.0");
    let first = hold(&host);

    let auto = [("TLLM_AFFINITY_STEP_CORE", "auto")];
    let second = host.run(&auto, &["--step", "0", "--result", "0"]).ok();
    for w in second.unpinned_with_a_warning_each() {
        says(w, &["another process holds"]);
        assert!(w.contains(&lock.display().to_string()), "{w}");
    }

    // SIGKILL: the kernel drops the flock with the process, the file stays.
    drop(first);
    assert!(lock.exists());
    let third = host.run(&auto, &["--step", "0"]).ok();
    assert_eq!(third.rc("step"), 1, "{}", third.stderr);
}

#[test]
fn the_lock_file_is_0644_whatever_the_umask() {
    let host = Host::new(&one_node_two_cores());
    let inner = host.command(&[("TLLM_AFFINITY_STEP_CORE", "auto")], &["--step", "0"]);
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("umask 077; exec \"$@\"")
        .arg("sh")
        .arg(inner.get_program())
        .args(inner.get_args());
    for (name, value) in inner.get_envs() {
        match value {
            Some(v) => cmd.env(name, v),
            None => cmd.env_remove(name),
        };
    }
    let run = Run::from(cmd.output().unwrap()).ok();
    assert_eq!(run.rc("step"), 1, "{}", run.stderr);
    let mode = std::fs::metadata(host.lock("0000:3b:00.0"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);
}

#[test]
fn a_symlink_at_the_lock_path_is_not_followed() {
    let host = Host::new(&one_node_two_cores());
    let target = host.locks.path().join("precious");
    std::fs::write(&target, "precious data").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let lock = host.lock("0000:3b:00.0");
    std::os::unix::fs::symlink(&target, &lock).unwrap();

    let run = host
        .run(&[("TLLM_AFFINITY_STEP_CORE", "auto")], &["--step", "0"])
        .ok();
    assert_eq!(run.rc("step"), 0);
    assert_eq!(run.mask(&run.json["step"]), natural(&run));
    let warnings = run.warnings();
    assert_eq!(warnings.len(), 1, "{}", run.stderr);
    assert!(warnings[0].contains("symbolic link"), "{}", warnings[0]);
    assert!(
        warnings[0].contains(&lock.display().to_string()),
        "{}",
        warnings[0]
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious data");
    let mode = std::fs::metadata(&target).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(std::fs::symlink_metadata(&lock)
        .unwrap()
        .file_type()
        .is_symlink());
}
