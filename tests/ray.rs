//! Ray actors (Ray from PyPI, a local cluster started by the test's driver with
//! `ray.init(num_cpus=2, num_gpus=2)`), the real library preloaded into the driver as a host
//! process and into each actor through `runtime_env={"env_vars": {"LD_PRELOAD": ...,
//! "TLLM_AFFINITY_PROCESS_ROLE": "worker"}}`: `tests/programs/ray_actors.py`. Ray sets
//! `CUDA_VISIBLE_DEVICES` inside the actor from Python when it assigns the GPU, after the library
//! loaded; each actor must end up on its own GPU's CPUs (SPEC §4), every one of its threads a
//! worker, and every thread of the driver a host on the CPUs it had.
//!
//! The simulated host (`Sysfs::two_nodes`): GPU 0 is local to node1 = {1}, GPU 1 to node0 = {0}.

mod common;

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

/// tests/programs/zero_code/ray_actors.py under `tllm-affinity run`, `ray.init()` inside the
/// `run` process: upstream's `RayWorkerWrapper` actors with `RayGPUWorker` built inside, no
/// `TLLM_AFFINITY_PROCESS_ROLE` set by anyone. After `setup_engine` every thread of each actor
/// (its main thread, which runs the actor's methods, included) is a worker on its GPU's CPUs;
/// after `shutdown()` every one is back on the launch mask; the driver's threads stay hosts.
fn ray_zero_code(how: RayRun) {
    require!(two_cpus("two GPUs with different local CPUs"));
    require!(
        ray_installed(),
        "Ray for python3 (`python3 -m pip install ray==2.60.0`, as scripts/setup does)"
    );
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let sysfs = Sysfs::two_nodes();
    let temp = tempfile::Builder::new()
        .prefix("tllm-ray.")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cmd = clean(cli());
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(sysfs.path())
        .args(["--log", "info", "--"])
        .arg(python())
        .arg(programs_dir().join("zero_code").join("ray_actors.py"))
        .arg(temp.path())
        .env(
            "PYTHONPATH",
            std::env::join_paths([programs_dir().join("upstream_trtllm"), programs_dir()]).unwrap(),
        )
        .env("RT_NUM_GPUS", how.gpus)
        .env(
            "RT_RAY_LAYOUT",
            if how.legacy { "legacy" } else { "current" },
        )
        .env("RAY_DEDUP_LOGS", "0")
        .env("RAY_USAGE_STATS_ENABLED", "0");
    if how.noset {
        cmd.env("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1");
    }
    with_openmp(&mut cmd);
    let end = run_bounded(cmd, LIMIT);
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
        for (name, t) in threads {
            assert_eq!(
                (t["role"].as_i64(), t["mask"].as_str()),
                (Some(1), Some(local(gpu).as_str())),
                "actor on GPU {gpu}, thread {name} after setup_engine\n{context}"
            );
        }
        for (name, t) in at_shutdown["threads"].as_object().unwrap() {
            assert_eq!(
                t["mask"].as_str(),
                Some(all.as_str()),
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
