//! Slices (`TLLM_AFFINITY_SLICE=gpu`): the GPUs that share a node divide its CPUs.
//!
//! Written hosts at full scale (8×H100, AMD EPYC with 8 L3 domains per node, GB200 trays in NUMA
//! and CDMM mode, GH200): `plan --gpu N` for every GPU gives slices that are disjoint, cover the
//! node, keep SMT siblings together and follow the cache domains, with the `auto` step and result
//! CPUs inside each GPU's slice; without the variable every GPU's worker set is its whole node.
//! Then real preloaded processes, one per GPU, on a written two-node host over this machine's
//! CPUs: worker masks are the slices, host threads keep every CPU.

use crate::common;

use std::process::{Child, Command, Stdio};

use common::slices::two_nodes_two_gpus_each;
use common::*;
use serde_json::Value;
use tllm_affinity_core::host::simulated::{self, GpuMemoryMode, SimulatedHost};
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::CpuMask;

/// `program` on the tree at `root`, NVML left out (the tree is the whole host), none of the
/// test's own steering variables inherited.
fn on_tree(program: impl AsRef<std::ffi::OsStr>, root: &std::path::Path) -> Command {
    let mut cmd = clean(program);
    cmd.env("TLLM_AFFINITY_SYSFS_ROOT", root)
        .env("TLLM_AFFINITY_NVML", "0");
    cmd
}

fn plan(root: &std::path::Path, gpu: usize, online: &CpuMask, env: &[(&str, &str)]) -> Value {
    let out = succeeded(
        on_tree(cli(), root)
            .args(["plan", "--gpu", &gpu.to_string(), "--json", "--cpus"])
            .arg(online.to_list())
            .envs(env.iter().copied()),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn cpulist(v: &Value) -> CpuMask {
    mask(
        v.as_str()
            .unwrap_or_else(|| panic!("expected a cpulist, got {v}")),
    )
}

/// Every GPU of `host` planned with and without slicing; the slices checked against the rule.
/// Returns each GPU's worker set under slicing.
fn check_shape(name: &str, host: &SimulatedHost) -> Vec<CpuMask> {
    let dir = tempfile::tempdir().unwrap();
    host.write(dir.path()).unwrap();
    let t = Topology::read(&SysfsRoot::new(dir.path())).unwrap();
    let online = t.online.clone();
    let cores = t.cores();
    let sliced = [
        ("TLLM_AFFINITY_SLICE", "gpu"),
        ("TLLM_AFFINITY_STEP_CORE", "auto"),
    ];
    let mut workers = Vec::new();
    let mut sets: Vec<(CpuMask, Vec<CpuMask>)> = Vec::new();
    for gpu in 0..t.gpus.len() {
        let p = plan(dir.path(), gpu, &online, &sliced);
        let slice = &p["slice"]["this_gpu"];
        assert_eq!(p["slice"]["on"], true, "{name} GPU {gpu}: {}", p["slice"]);
        let worker = cpulist(&p["worker"]["cpus"]);
        let set = cpulist(&slice["set"]);
        assert_eq!(
            worker,
            cpulist(&slice["cpus"]),
            "{name} GPU {gpu}: worker set = slice"
        );
        assert!(
            worker.is_subset(&set),
            "{name} GPU {gpu}: {worker} outside {set}"
        );
        for core in &cores {
            let inside = core.intersection(&worker);
            assert!(
                inside.is_empty() || inside == *core,
                "{name} GPU {gpu}: SMT siblings {core} split by {worker}"
            );
        }
        if slice["cut"] == "whole-cache-domains" {
            for d in slice["domains"].as_array().unwrap() {
                assert!(
                    cpulist(d).is_subset(&worker),
                    "{name} GPU {gpu}: domain {d} split"
                );
            }
        }
        // The auto step and result CPUs lie in the GPU's own slice.
        let placement = &p["placement"];
        let step = cpulist(&placement["step_cpus"]);
        let result = placement["result_cpu"].as_u64().unwrap() as usize;
        assert!(
            step.is_subset(&worker) && worker.contains(result) && !step.contains(result),
            "{name} GPU {gpu}: step {step} and result {result} in {worker}"
        );
        match sets.iter_mut().find(|(s, _)| *s == set) {
            Some((_, slices)) => slices.push(worker.clone()),
            None => sets.push((set.clone(), vec![worker.clone()])),
        }
        // Off: the whole node, as without the library's slicing.
        let whole = plan(dir.path(), gpu, &online, &[]);
        assert_eq!(whole["slice"]["on"], false);
        assert_eq!(
            cpulist(&whole["worker"]["cpus"]),
            set,
            "{name} GPU {gpu}: off"
        );
        println!("{name} GPU {gpu}: slice {worker} of {set}, step {step}, result {result}");
        workers.push(worker);
    }
    // The GPUs sharing a set: disjoint, covering it, in PCI order from the bottom (no wrap).
    for (set, slices) in &sets {
        let mut union = CpuMask::new();
        let mut first = None;
        for s in slices {
            assert!(
                union.intersection(s).is_empty(),
                "{name}: {s} overlaps within {set}"
            );
            assert!(first < s.first(), "{name}: {s} out of order");
            first = s.first();
            union = union.union(s);
        }
        assert_eq!(union, *set, "{name}: the slices cover {set}");
    }
    workers
}

fn lists(workers: &[CpuMask]) -> Vec<String> {
    workers.iter().map(CpuMask::to_list).collect()
}

#[test]
fn dgx_h100_eight_gpus_get_fourteen_cores_each() {
    let workers = check_shape("8xH100", &simulated::dgx_h100_like());
    assert_eq!(
        lists(&workers),
        [
            "0-13,112-125",
            "14-27,126-139",
            "28-41,140-153",
            "42-55,154-167",
            "56-69,168-181",
            "70-83,182-195",
            "84-97,196-209",
            "98-111,210-223",
        ]
    );
}

#[test]
fn amd_epyc_gpus_get_two_whole_ccds_each() {
    let workers = check_shape("AMD EPYC", &simulated::amd_epyc_like());
    assert_eq!(workers[0], mask("0-15,128-143"));
    assert_eq!(workers[3], mask("48-63,176-191"));
    assert_eq!(workers[4], mask("64-79,192-207"));
}

#[test]
fn grace_trays_two_gpus_share_each_grace() {
    for mode in [GpuMemoryMode::Numa, GpuMemoryMode::Cdmm] {
        let shape = simulated::gb200_tray(mode);
        let workers = check_shape(shape.name, &shape.host);
        assert_eq!(lists(&workers), ["0-35", "36-71", "72-107", "108-143"]);
    }
    let shape = simulated::gh200();
    assert_eq!(lists(&check_shape(shape.name, &shape.host)), ["0-71"]);
}

/// In a worker thread: configure(GPU), the worker's mask, a child thread's, and under
/// `STEP` the step thread's; then the main (host) thread's mask.
const PER_GPU: &str = "\
import json, os, sys, threading, tllm_affinity as t
gpu = int(sys.argv[1]); seen = {}
def worker():
    t.configure(gpu)
    seen['worker'] = sorted(os.sched_getaffinity(0))
    c = threading.Thread(target=lambda: seen.update(child=sorted(os.sched_getaffinity(0))))
    c.start(); c.join()
    if os.environ.get('STEP'):
        def step():
            seen['pinned'] = t.pin_step_thread(gpu)
            seen['step'] = sorted(os.sched_getaffinity(0))
        s = threading.Thread(target=step); s.start(); s.join()
w = threading.Thread(target=worker); w.start(); w.join()
seen['host'] = sorted(os.sched_getaffinity(0))
print(json.dumps(seen))
";

/// One preloaded process per GPU of the tree, all at once (nothing coordinates them): each
/// one's JSON and its stderr.
fn one_process_per_gpu(
    root: &std::path::Path,
    gpus: usize,
    env: &[(&str, &str)],
) -> Vec<(Value, String)> {
    let locks = tempfile::tempdir().unwrap();
    let children: Vec<Child> = (0..gpus)
        .map(|gpu| {
            on_tree(python(), root)
                .args(["-c", PER_GPU, &gpu.to_string()])
                .env("LD_PRELOAD", library())
                .env("TLLM_AFFINITY_LOG", "info")
                .env("TLLM_AFFINITY_LOCK_DIR", locks.path())
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().unwrap();
            let text = output_text(&out);
            assert!(out.status.success(), "{text}");
            let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {text}"));
            (v, String::from_utf8_lossy(&out.stderr).into_owned())
        })
        .collect()
}

/// Two nodes of one CPU each, two GPUs on each: a slice would be half a core, so each GPU keeps
/// its whole node, and says why once; without the variable, nothing is said. Any machine of two
/// CPUs or more shows it, since the tree describes two of them only.
#[test]
fn a_slice_under_two_cores_keeps_the_whole_node_with_one_warning() {
    require!(two_cpus("two nodes of one CPU each"));
    let allowed = allowed_cpus();
    let cpus: Vec<usize> = allowed.iter().take(2).collect();
    let (host, nodes) = two_nodes_two_gpus_each(&cpus);
    let dir = tempfile::tempdir().unwrap();
    host.write(dir.path()).unwrap();
    let sliced = [("TLLM_AFFINITY_SLICE", "gpu")];
    for (gpu, (v, stderr)) in one_process_per_gpu(dir.path(), 4, &sliced)
        .iter()
        .enumerate()
    {
        assert_eq!(mask_of(&v["worker"]), nodes[gpu / 2], "GPU {gpu}: {stderr}");
        assert_eq!(mask_of(&v["host"]), allowed);
        let warnings: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("keeps its whole set"))
            .collect();
        assert_eq!(warnings.len(), 1, "GPU {gpu}: {stderr}");
        assert!(
            warnings[0].contains("TLLM_AFFINITY_SLICE=gpu")
                && warnings[0].contains("fewer than two each"),
            "{}",
            warnings[0]
        );
    }
    for (gpu, (v, stderr)) in one_process_per_gpu(dir.path(), 4, &[]).iter().enumerate() {
        assert_eq!(mask_of(&v["worker"]), nodes[gpu / 2], "GPU {gpu}: {stderr}");
        assert!(!stderr.contains("TLLM_AFFINITY_SLICE"), "{stderr}");
    }
}

/// A malformed value is one line naming the variable, the value and what was expected.
#[test]
fn a_malformed_slice_value_is_one_clear_line() {
    let sysfs = Sysfs::two_nodes();
    let out = preloaded(python(), &sysfs)
        .args(["-c", "pass"])
        .env("TLLM_AFFINITY_SLICE", "node")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("TLLM_AFFINITY_SLICE"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("TLLM_AFFINITY_SLICE='node' is not valid: expected off or gpu"),
        "{stderr}"
    );
}

/// The executor loop's rule under slicing, alone (no library in the process): upstream's CPUs
/// stand inside the slice, go to the slice's step core when any lies outside (the whole slice
/// where it has none), and nothing changes without a pin or without a slice.
#[test]
fn the_executor_loop_goes_where_upstream_asks_inside_the_slice_else_on_its_step_core() {
    let out = succeeded(
        clean(python())
            .env("PYTHONPATH", repo().join("python"))
            .args([
                "-c",
                "import json\n\
                 from tllm_affinity.adapters.trtllm import executor_loop_cpus as rule\n\
                 print(json.dumps([rule([2, 3], {2, 3, 4, 5}, {2}), rule([1], {2, 3}, {2}),\n\
                 rule([3, 4], {0, 1, 2, 3}, {0}), rule([7], {0, 1}, set()),\n\
                 rule([], {0, 1}, {0}), rule([9], None, None)]))",
            ]),
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    let cpus: Vec<&Value> = got.as_array().unwrap().iter().map(|r| &r[0]).collect();
    assert_eq!(
        cpus,
        [
            &serde_json::json!([2, 3]),
            &serde_json::json!([2]),
            &serde_json::json!([0]),
            &serde_json::json!([0, 1]),
            &serde_json::json!([]),
            &serde_json::json!([9]),
        ],
        "{got}"
    );
    let why = |i: usize| got[i][1].as_str().unwrap_or_default().to_string();
    assert!(why(0).contains("lie inside the GPU's slice"), "{got}");
    assert!(why(1).contains("on the slice's step core instead"), "{got}");
    assert!(why(2).contains("[4] outside it"), "{got}");
    assert!(why(3).contains("on the whole slice instead"), "{got}");
    assert_eq!(got[4][1], Value::Null);
    assert_eq!(got[5][1], Value::Null);
}
