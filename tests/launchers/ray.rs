//! Ray actors (Ray from PyPI, a local cluster started by the test's driver with
//! `ray.init(num_cpus=2, num_gpus=2)`), the real library preloaded into the driver as a host
//! process and into each actor through `runtime_env={"env_vars": {"LD_PRELOAD": ...,
//! "TLLM_AFFINITY_PROCESS_ROLE": "worker"}}`: `tests/programs/ray_actors.py`. Ray sets
//! `CUDA_VISIBLE_DEVICES` inside the actor from Python when it assigns the GPU, after the library
//! loaded; each actor must end up on its own GPU's CPUs (SPEC §4), every one of its threads a
//! worker, and every thread of the driver a host on the CPUs it had.
//!
//! The simulated host (`Sysfs::two_nodes`): GPU 0 is local to node1 = {1}, GPU 1 to node0 = {0}.

use crate::common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(240);

/// One Ray cluster at a time: two CPUs, and each cluster starts a handful of daemons.
static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn ray_installed() -> bool {
    Command::new(python())
        .args(["-c", "import ray"])
        .env_remove("PYTHONPATH")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Two actors of one GPU each, dedicated worker processes: actor on GPU 0 → every thread on
/// CPU 1, actor on GPU 1 → every thread on CPU 0 (before the fix both stayed on GPU 0's, the
/// device they were configured for at load); one open lease each, for its GPU; the driver's
/// threads stay hosts on every CPU.
#[test]
fn ray_actors_each_end_up_on_their_own_gpus_cpus() {
    require!(two_cpus("two GPUs with different local CPUs"));
    require!(
        ray_installed(),
        "Ray for python3 (`python3 -m pip install ray==2.60.0`, as scripts/setup does)"
    );
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let sysfs = Sysfs::two_nodes();
    // Short: Ray's socket paths live under it and must fit in sun_path.
    let temp = tempfile::Builder::new()
        .prefix("tllm-ray.")
        .tempdir_in("/tmp")
        .unwrap();
    let library = library();
    let mut cmd = clean(python());
    cmd.arg(program("ray_actors.py"))
        .arg(&library)
        .arg(sysfs.path())
        .arg(temp.path())
        .env("LD_PRELOAD", &library)
        .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path())
        .env("TLLM_AFFINITY_LOG", "info")
        .env("RAY_DEDUP_LOGS", "0")
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env_remove("PYTHONPATH");
    let start = std::time::Instant::now();
    let end = run_bounded(cmd, LIMIT);
    println!("the driver ran {:?}", start.elapsed());
    let context = format!("stdout:\n{}\nstderr:\n{}", end.stdout, end.stderr);
    assert!(end.status.success(), "{:?}\n{context}", end.status);
    let parsed = |tag: &str| -> Vec<Value> {
        end.stdout
            .lines()
            .filter_map(|l| l.strip_prefix(tag))
            .map(|json| serde_json::from_str(json).unwrap())
            .collect()
    };
    let actors = parsed("ACTOR ");
    assert_eq!(actors.len(), 2, "{context}");
    let local = |gpu: i64| {
        if gpu == 0 {
            sysfs.node1.to_list()
        } else {
            sysfs.node0.to_list()
        }
    };
    let address = |gpu: i64| {
        if gpu == 0 {
            "0000:3b:00.0"
        } else {
            "0000:86:00.0"
        }
    };
    let mut gpus = BTreeSet::new();
    for actor in &actors {
        let ids = actor["gpu_ids"].as_array().unwrap();
        assert_eq!(ids.len(), 1, "{actor}");
        let gpu = ids[0].as_i64().unwrap();
        gpus.insert(gpu);
        assert_eq!(actor["cuda_visible_devices"], gpu.to_string(), "{actor}");
        let threads = actor["threads"].as_object().unwrap();
        assert!(
            threads.contains_key(&actor["own_thread"].to_string()),
            "{actor}"
        );
        for (tid, t) in threads {
            assert_eq!(
                (t["role"].as_str(), t["mask"].as_str()),
                (Some("worker"), Some(local(gpu).as_str())),
                "actor on GPU {gpu}, thread {tid} {}\n{context}",
                t["name"]
            );
        }
        let report = &actor["report"];
        assert_eq!(
            report["leases"].as_array().map(|l| l.len()),
            Some(1),
            "{report}"
        );
        assert_eq!(report["leases"][0]["device"], address(gpu), "{report}");
        assert_eq!(report["constrained"], false, "{report}");
        println!(
            "actor pid {} on GPU {gpu} (CUDA_VISIBLE_DEVICES={}): {} threads, every one a worker on [{}]",
            actor["pid"],
            actor["cuda_visible_devices"],
            threads.len(),
            local(gpu)
        );
    }
    assert_eq!(gpus, BTreeSet::from([0, 1]), "two actors, two GPUs");
    assert!(
        end.stderr
            .contains("retargeting worker threads from 0000:3b:00.0 to 0000:86:00.0"),
        "{context}"
    );
    let driver = &parsed("DRIVER ")[0];
    let all = allowed_cpus().to_list();
    let threads = driver["threads"].as_object().unwrap();
    for (tid, t) in threads {
        assert_eq!(
            (t["role"].as_str(), t["mask"].as_str()),
            (Some("host"), Some(all.as_str())),
            "driver thread {tid} {}",
            t["name"]
        );
    }
    println!(
        "driver pid {}: {} threads, every one a host on [{all}]",
        driver["pid"],
        threads.len()
    );
}

/// How the zero-code Ray deployment is started.
#[derive(Clone, Copy)]
struct RayRun {
    /// `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`: every GPU visible to each actor.
    noset: bool,
    /// Each actor's `num_gpus`.
    gpus: &'static str,
    /// Upstream's older layout (`executor/ray_gpu_worker.py`, the worker's own
    /// `_configure_affinity`).
    legacy: bool,
}

/// What every test of a Ray cluster needs: two CPUs, Ray, this binary's one cluster at a time,
/// the simulated host and a short temp dir (Ray's socket paths live under it and must fit in
/// sun_path); the error, for `require!`, when the machine lacks one.
fn one_cluster() -> Result<(std::sync::MutexGuard<'static, ()>, Sysfs, tempfile::TempDir), String> {
    two_cpus("two GPUs with different local CPUs")?;
    if !ray_installed() {
        return Err(
            "Ray for python3 (`python3 -m pip install ray==2.60.0`, as scripts/setup does)".into(),
        );
    }
    let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let temp = tempfile::Builder::new()
        .prefix("tllm-ray.")
        .tempdir_in("/tmp")
        .unwrap();
    Ok((one, Sysfs::two_nodes(), temp))
}

/// tests/programs/zero_code/ray_actors.py under `tllm-affinity run`, `ray.init()` inside the
/// `run` process: upstream's `RayWorkerWrapper` actors with `RayGPUWorker` built inside, no
/// `TLLM_AFFINITY_PROCESS_ROLE` set by anyone. After `setup_engine` every thread of each actor
/// (its main thread, which runs the actor's methods, included) is a worker on its GPU's CPUs;
/// after `shutdown()` every one is back on the launch mask; the driver's threads stay hosts.
fn ray_zero_code(how: RayRun) {
    let (_one, sysfs, temp) = require!(one_cluster());
    let mut cmd = driver_under_run(&sysfs, temp.path(), how);
    if how.noset {
        cmd.env("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1");
    }
    let end = run_bounded(cmd, LIMIT);
    check_actors(&end, &sysfs, how, Reached::Library);
}

/// tests/programs/zero_code/ray_actors.py, the driver, under `tllm-affinity run`.
fn driver_under_run(sysfs: &Sysfs, temp: &std::path::Path, how: RayRun) -> Command {
    let mut cmd = clean(cli());
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(sysfs.path())
        .args(["--log", "info", "--"])
        .arg(python())
        .arg(programs_dir().join("zero_code").join("ray_actors.py"))
        .arg(temp)
        .env("PYTHONPATH", stand_in_path())
        .env("RT_NUM_GPUS", how.gpus)
        .env(
            "RT_RAY_LAYOUT",
            if how.legacy { "legacy" } else { "current" },
        )
        .env("RAY_DEDUP_LOGS", "0")
        .env("RAY_USAGE_STATS_ENABLED", "0");
    with_openmp(&mut cmd);
    cmd
}

/// The upstream stand-in and the deployment's instrumentation, as a machine with TensorRT-LLM
/// installed has them.
fn stand_in_path() -> std::ffi::OsString {
    std::env::join_paths([programs_dir().join("upstream_trtllm"), programs_dir()]).unwrap()
}

/// What reached the actors.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reached {
    /// The library and its start-up hook: every actor thread a worker on its GPU's CPUs after
    /// `setup_engine`, all back on the launch mask after `shutdown()`.
    Library,
    /// Nothing of ours: upstream's process-wide pin, never undone (no role known).
    Nothing,
}

/// The driver's `SETUP`, `SHUTDOWN` and `DRIVER` lines, checked for what `reached` the actors;
/// prints each actor's thread table.
fn check_actors(end: &Finished, sysfs: &Sysfs, how: RayRun, reached: Reached) {
    let context = format!("stdout:\n{}\nstderr:\n{}", end.stdout, end.stderr);
    assert!(end.status.success(), "{:?}\n{context}", end.status);
    let parsed = |tag: &str| -> Value {
        let line = end
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix(tag))
            .unwrap_or_else(|| panic!("no {tag}line\n{context}"));
        serde_json::from_str(line).unwrap()
    };
    let (setup, shutdown) = (parsed("SETUP "), parsed("SHUTDOWN "));
    let all = allowed_cpus().to_list();
    let local = |gpu: i64| {
        if gpu == 0 {
            sysfs.node1.to_list()
        } else {
            sysfs.node0.to_list()
        }
    };
    let mut gpus = BTreeSet::new();
    for (at_setup, at_shutdown) in setup
        .as_array()
        .unwrap()
        .iter()
        .zip(shutdown.as_array().unwrap())
    {
        let gpu = at_setup["gpu_ids"][0].as_i64().unwrap();
        gpus.insert(gpu);
        assert_eq!(at_setup["pid"], at_shutdown["pid"], "{context}");
        let expected_visible = if how.noset {
            None
        } else {
            Some(gpu.to_string())
        };
        assert_eq!(
            at_setup["cuda_visible_devices"]
                .as_str()
                .map(str::to_string),
            expected_visible,
            "{at_setup}"
        );
        println!(
            "\nRay actor pid {} on GPU {gpu} (num_gpus={}, CUDA_VISIBLE_DEVICES={}, device_id {})",
            at_setup["pid"], how.gpus, at_setup["cuda_visible_devices"], at_setup["device_id"]
        );
        println!(
            "  {:28}  {:14}  {:14}",
            "thread", "after setup", "after shutdown"
        );
        let threads = at_setup["threads"].as_object().unwrap();
        assert!(threads.contains_key("main"), "{at_setup}");
        let cell = |t: &Value| {
            let role = match t["role"].as_i64() {
                Some(0) => "host",
                Some(1) => "worker",
                _ => "?",
            };
            format!("{} {role}", t["mask"].as_str().unwrap_or("?"))
        };
        for (name, t) in threads {
            let later = &at_shutdown["threads"][name];
            let later_cell = if later.is_null() {
                ".".to_string()
            } else {
                cell(later)
            };
            println!("  {name:28}  {:14}  {later_cell:14}", cell(t));
        }
        // Without the library, upstream's sweep pinned every thread to the set its own device
        // lookup chose (the stand-in's reads sysfs by index), and nothing undoes it.
        let pinned = match reached {
            Reached::Library => local(gpu),
            Reached::Nothing => threads["main"]["mask"].as_str().unwrap().to_string(),
        };
        assert_ne!(pinned, all, "the actor's threads were pinned\n{context}");
        let (role, after) = match reached {
            Reached::Library => (1, all.clone()),
            Reached::Nothing => (-1, pinned.clone()),
        };
        for (name, t) in threads {
            assert_eq!(
                (t["role"].as_i64(), t["mask"].as_str()),
                (Some(role), Some(pinned.as_str())),
                "actor on GPU {gpu}, thread {name} after setup_engine\n{context}"
            );
        }
        for (name, t) in at_shutdown["threads"].as_object().unwrap() {
            assert_eq!(
                t["mask"].as_str(),
                Some(after.as_str()),
                "actor on GPU {gpu}, thread {name} after shutdown\n{context}"
            );
        }
    }
    if how.gpus == "1" {
        assert_eq!(gpus, BTreeSet::from([0, 1]), "two actors, two GPUs");
    }
    let driver = parsed("DRIVER ");
    for (name, t) in driver["threads"].as_object().unwrap() {
        assert_eq!(
            (t["role"].as_i64(), t["mask"].as_str()),
            (Some(0), Some(all.as_str())),
            "driver thread {name}"
        );
    }
}

#[test]
fn ray_zero_code_actors_are_dedicated_workers_with_no_variable() {
    ray_zero_code(RayRun {
        noset: false,
        gpus: "1",
        legacy: false,
    });
}

#[test]
fn ray_zero_code_actors_follow_upstreams_mapping_with_every_gpu_visible() {
    ray_zero_code(RayRun {
        noset: true,
        gpus: "1",
        legacy: false,
    });
}

#[test]
fn ray_zero_code_fractional_gpus_are_placed_on_the_gpu_ray_gave() {
    ray_zero_code(RayRun {
        noset: false,
        gpus: "0.5",
        legacy: false,
    });
}

/// Upstream's older layout, where `RayGPUWorker` sets its engine up at construction and its own
/// `_configure_affinity` pins every thread: the adapter covers that method too.
#[test]
fn ray_zero_code_actors_of_the_older_layout_are_dedicated_workers_too() {
    ray_zero_code(RayRun {
        noset: false,
        gpus: "1",
        legacy: true,
    });
}

/// A cluster started beforehand with `ray start`, as production does, and the driver under
/// `tllm-affinity run` joining it: the actors are the raylet's children, not the driver's, so
/// they have what the cluster was started with plus what the job passes on in its runtime_env.
/// Started with `runtime_env`, what reached each actor, in one row: `Nothing` without it.
fn ray_start_cluster(runtime_env: bool) {
    let (_one, sysfs, temp) = require!(one_cluster());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let cluster = RayCluster::start(&sysfs, temp.path(), port);
    let how = RayRun {
        noset: false,
        gpus: "1",
        legacy: false,
    };
    let mut cmd = driver_under_run(&sysfs, temp.path(), how);
    cmd.env("RT_RAY_ADDRESS", format!("127.0.0.1:{port}"))
        .env("RAY_AUTH_MODE", "disabled");
    if runtime_env {
        // What the job passes on: the library and the start-up hook `tllm-affinity run` gave the
        // driver, and the simulated host.
        let hook = std::env::join_paths([
            repo().join("python/tllm_affinity/_sitecustomize"),
            repo().join("python"),
            programs_dir().join("upstream_trtllm"),
            programs_dir(),
        ])
        .unwrap();
        let env = serde_json::json!({"env_vars": {
            "LD_PRELOAD": library().to_str().unwrap(),
            "PYTHONPATH": hook.to_str().unwrap(),
            "TLLM_AFFINITY_SYSFS_ROOT": sysfs.path().to_str().unwrap(),
        }});
        cmd.env("RT_RAY_RUNTIME_ENV", env.to_string());
    }
    let end = run_bounded(cmd, LIMIT);
    drop(cluster);
    let reached = if runtime_env {
        Reached::Library
    } else {
        Reached::Nothing
    };
    check_actors(&end, &sysfs, how, reached);
}

/// `ray start --head` on the test's own port and temp dir; `ray stop` when dropped.
struct RayCluster {
    env: Vec<(String, std::ffi::OsString)>,
}

impl RayCluster {
    fn start(sysfs: &Sysfs, temp: &std::path::Path, port: u16) -> RayCluster {
        let env = vec![
            ("PYTHONPATH".to_string(), stand_in_path()),
            (
                "TLLM_AFFINITY_SYSFS_ROOT".to_string(),
                sysfs.path().as_os_str().to_owned(),
            ),
            ("RAY_USAGE_STATS_ENABLED".to_string(), "0".into()),
            // The test's own cluster on loopback: no token for the driver to find.
            ("RAY_AUTH_MODE".to_string(), "disabled".into()),
        ];
        // The daemons it leaves running keep whatever it writes to open: a file, not a pipe.
        let log = temp.join("ray-start.log");
        let mut cmd = clean("timeout");
        cmd.arg("120")
            .arg(python())
            .args(["-m", "ray.scripts.scripts", "start", "--head"])
            .arg(format!("--port={port}"))
            .args(["--num-cpus=2", "--num-gpus=2", "--include-dashboard=false"])
            .arg(format!("--temp-dir={}", temp.display()))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(temp.join("ray-start.err")).unwrap());
        let status = cmd.status().expect("ray start");
        let cluster = RayCluster { env };
        assert!(
            status.success(),
            "ray start: {status}\n{}",
            std::fs::read_to_string(temp.join("ray-start.err")).unwrap_or_default()
        );
        cluster
    }
}

impl Drop for RayCluster {
    fn drop(&mut self) {
        let _ = clean("timeout")
            .arg("60")
            .arg(python())
            .args(["-m", "ray.scripts.scripts", "stop", "--force"])
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

#[test]
fn ray_start_cluster_actors_get_the_library_through_the_jobs_runtime_env() {
    ray_start_cluster(true);
}

#[test]
fn ray_start_cluster_actors_without_a_runtime_env_are_upstreams_process_wide_pin() {
    ray_start_cluster(false);
}
