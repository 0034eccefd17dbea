//! Grace hosts at full scale (GB200 tray in NUMA and CDMM mode, GB300 tray, GH200, quad GH200,
//! DGX Spark): sysfs trees written by `tllm_affinity_core::host::simulated`, with the driver's list
//! under the same root and NVML answered by the test double (`tests/programs/nvml_double.c`) as
//! the driver would. Each is checked against the table of docs/grace.md, read here: `topo`,
//! `plan` over every CPU of the written host, `configure` for every GPU in a real preloaded
//! process, `auto` step placement in one real process per GPU, and the host view of those.
//!
//! A written host has up to 288 CPUs; this machine may have far fewer. The kernel applies masks
//! over the CPUs that exist only, so the plan's numbers are checked for every CPU of the written
//! host (`plan --cpus <all>`), and the real processes' masks over the CPUs this process may use:
//! the documented set within them, or nothing pinned where they hold none of it.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::Value;
use tllm_affinity_core::host::simulated::{self, GraceHost};
use tllm_affinity_core::mask::CpuMask;

/// One row of docs/grace.md's table.
#[derive(Debug)]
struct Row {
    mode: Option<String>,
    nodes: usize,
    gpu: usize,
    address: String,
    pci_node: Option<usize>,
    memory_node: Option<usize>,
    worker: CpuMask,
    step: usize,
    result: usize,
}

fn dash_or<T: std::str::FromStr>(cell: &str) -> Option<T> {
    (cell != "-" && cell != "-1").then(|| {
        cell.parse()
            .unwrap_or_else(|_| panic!("docs/grace.md: bad cell {cell}"))
    })
}

/// The rows of docs/grace.md's table for `host`, in GPU order.
fn documented(host: &str) -> Vec<Row> {
    let path = repo().join("docs/grace.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let rows: Vec<Row> = text
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l
                .trim()
                .strip_prefix('|')?
                .strip_suffix('|')?
                .split('|')
                .map(str::trim)
                .collect();
            (cells.len() == 10 && cells[0] == host).then(|| Row {
                mode: dash_or(cells[1]),
                nodes: cells[2].parse().unwrap(),
                gpu: cells[3].parse().unwrap(),
                address: cells[4].to_string(),
                pci_node: dash_or(cells[5]),
                memory_node: dash_or(cells[6]),
                worker: mask(cells[7]),
                step: cells[8].parse().unwrap(),
                result: cells[9].parse().unwrap(),
            })
        })
        .collect();
    assert!(!rows.is_empty(), "docs/grace.md has no row for {host}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.gpu, i, "docs/grace.md: {host}'s rows in GPU order");
    }
    rows
}

/// A written Grace host: its tree, NVML's answer and the lock directory of its step cores.
struct Written {
    shape: GraceHost,
    sysfs: tempfile::TempDir,
    nvml: tempfile::TempDir,
    locks: tempfile::TempDir,
}

/// The double as `libnvidia-ml.so.1` in a directory of its own, for LD_LIBRARY_PATH.
fn nvml_double() -> PathBuf {
    let lib = Program::c("nvml_double")
        .shared()
        .named("nvml/libnvidia-ml.so.1")
        .build();
    lib.parent().unwrap().to_path_buf()
}

impl Written {
    fn new(shape: GraceHost) -> Written {
        let sysfs = tempfile::tempdir().unwrap();
        shape.host.write(sysfs.path()).unwrap();
        let nvml = tempfile::tempdir().unwrap();
        std::fs::write(nvml.path().join("nvml"), grace_nvml(&shape)).unwrap();
        Written {
            shape,
            sysfs,
            nvml,
            locks: tempfile::tempdir().unwrap(),
        }
    }

    fn root(&self) -> &Path {
        self.sysfs.path()
    }

    /// `program` on this host with NVML answering, the library not preloaded.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = clean(program);
        cmd.env("TLLM_AFFINITY_SYSFS_ROOT", self.root())
            .env("TLLM_AFFINITY_LOCK_DIR", self.locks.path())
            .env("LD_LIBRARY_PATH", nvml_double())
            .env("TLLM_NVML_DOUBLE", self.nvml.path().join("nvml"));
        cmd
    }

    /// [`Written::command`] with the library preloaded.
    fn preloaded(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = self.command(program);
        cmd.env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_LOG", "info");
        cmd
    }

    fn cli_json(&self, args: &[&str], env: &[(&str, &str)]) -> Value {
        println!("{}: {args:?}", self.shape.name);
        let out = succeeded(self.command(cli()).args(args).envs(env.iter().copied()));
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    fn online(&self) -> CpuMask {
        self.shape.host.online_cpus()
    }
}

/// `topo` names the mode, every node, each GPU's Grace node, local CPUs and memory node, in
/// JSON and text, as the table says.
fn check_topo(w: &Written, rows: &[Row]) {
    let name = w.shape.name;
    let v = w.cli_json(&["topo", "--json"], &[]);
    assert_eq!(v["visible"]["source"], "nvml", "{name}: {}", v["visible"]);
    assert_eq!(
        v["gpu_memory_mode"].as_str(),
        rows[0].mode.as_deref(),
        "{name}: mode"
    );
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), rows[0].nodes, "{name}: nodes");
    let with_cpus: CpuMask = nodes
        .iter()
        .filter(|n| n["cpus"] != "")
        .map(|n| n["id"].as_u64().unwrap() as usize)
        .collect();
    let pci_nodes: CpuMask = rows.iter().filter_map(|r| r.pci_node).collect();
    assert!(
        pci_nodes.is_subset(&with_cpus),
        "{name}: GPUs on Grace nodes"
    );
    assert_eq!(mask(v["online"].as_str().unwrap()), w.online(), "{name}");
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), rows.len(), "{name}: GPUs");
    for (gpu, row) in gpus.iter().zip(rows) {
        assert_eq!(gpu["address"], row.address.as_str(), "{name}: {gpu}");
        assert_eq!(
            gpu["numa_node"].as_u64(),
            row.pci_node.map(|n| n as u64),
            "{name}: {gpu}"
        );
        assert_eq!(
            gpu["memory_node"].as_u64(),
            row.memory_node.map(|n| n as u64),
            "{name}: {gpu}"
        );
        let device = &v["visible"]["devices"][row.gpu];
        assert_eq!(mask(device["local_cpus"].as_str().unwrap()), row.worker);
        // The memory node holds no CPU and memory; every other CPU-less node has neither.
        if let Some(id) = row.memory_node {
            let node = nodes.iter().find(|n| n["id"] == id).unwrap();
            assert_eq!(node["cpus"], "", "{name}: {node}");
            assert_eq!(node["has_memory"], true, "{name}: {node}");
        }
    }
    for node in nodes.iter().filter(|n| n["cpus"] == "") {
        let id = node["id"].as_u64().unwrap() as usize;
        let memory_of_gpu = rows.iter().any(|r| r.memory_node == Some(id));
        assert_eq!(node["has_memory"], memory_of_gpu, "{name}: {node}");
    }

    let out = w.command(cli()).arg("topo").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let mode_line = text.lines().find(|l| l.starts_with("GPU memory: "));
    match rows[0].mode.as_deref() {
        Some("numa") => assert!(
            mode_line.is_some_and(|l| l.starts_with("GPU memory: NUMA mode")),
            "{name}:\n{text}"
        ),
        Some("cdmm") => assert!(
            mode_line.is_some_and(|l| l.starts_with("GPU memory: CDMM mode")),
            "{name}:\n{text}"
        ),
        _ => assert_eq!(mode_line, None, "{name}:\n{text}"),
    }
    for row in rows {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("  {}: {}", row.gpu, row.address)))
            .unwrap_or_else(|| panic!("{name}: no GPU {} in\n{text}", row.gpu));
        match (row.memory_node, rows[0].mode.is_some()) {
            (Some(n), _) => says(line, &[&format!("its memory on node {n} (from NVML)")]),
            (None, true) => says(line, &["its memory on no NUMA node"]),
            (None, false) => never_says(line, &["its memory"]),
        }
    }
}

/// `plan --gpu N --cpus <every CPU of the host>` under `auto`: each GPU's worker set, step core
/// and result CPU as the table says, and every GPU's placement listed alike.
fn check_plan(w: &Written, rows: &[Row]) {
    let name = w.shape.name;
    let all = w.online().to_list();
    for row in rows {
        let v = w.cli_json(
            &[
                "plan",
                "--gpu",
                &row.gpu.to_string(),
                "--cpus",
                &all,
                "--json",
            ],
            &[("TLLM_AFFINITY_STEP_CORE", "auto")],
        );
        assert_eq!(v["gpu"]["address"], row.address.as_str(), "{name}: {v}");
        assert_eq!(v["allowed"], all.as_str(), "{name}: {v}");
        assert_eq!(mask(v["worker"]["cpus"].as_str().unwrap()), row.worker);
        assert_eq!(
            v["placement"]["step_cpus"],
            row.step.to_string(),
            "{name} GPU {}: {}",
            row.gpu,
            v["placement"]
        );
        assert_eq!(
            v["placement"]["result_cpu"], row.result,
            "{name} GPU {}: {}",
            row.gpu, v["placement"]
        );
    }
}

/// What this machine can apply of `documented`: the set within the CPUs this process may use.
fn real_part(documented: &CpuMask) -> CpuMask {
    documented.intersection(&allowed_cpus())
}

/// `configure(N)` for every GPU in one real preloaded process (tests/programs/gpu_population.c):
/// each worker and the thread it creates on the GPU's Grace node's CPUs that exist here, the
/// host thread untouched; where none exist here, nothing pinned and one warning naming the GPU.
fn check_configure(w: &Written, rows: &[Row]) {
    let name = w.shape.name;
    let mut cmd = w.preloaded(Program::c("gpu_population").build());
    cmd.args(rows.iter().map(|r| r.gpu.to_string()));
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}: {stdout}\n{stderr}");
    println!("{name}: configure for every GPU:\n{stdout}{stderr}");
    let lines: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("DEVICE "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), rows.len(), "{name}: {stdout}\n{stderr}");
    let all = allowed_cpus();
    for (w, row) in lines.iter().zip(rows) {
        let (worker, child, host) = (mask(w[5]), mask(w[7]), mask(w[9]));
        let lease: i64 = w[3].parse().unwrap();
        let expected = real_part(&row.worker);
        assert!(lease > 0, "{name} GPU {}: {w:?}\n{stderr}", row.gpu);
        assert_eq!(host, all, "{name}: host thread untouched: {w:?}\n{stderr}");
        if expected.is_empty() {
            assert_eq!(worker, all, "{name} GPU {}: nothing pinned", row.gpu);
            says(
                &stderr,
                &[&format!(
                    "configure for {}: the GPU-local CPUs [{}] and the cpuset [{all}] have no \
                     CPU in common; no worker mask pinned",
                    row.address, row.worker
                )],
            );
        } else {
            assert_eq!(worker, expected, "{name} GPU {}: {w:?}\n{stderr}", row.gpu);
            assert_eq!(child, expected, "{name} GPU {}: born worker", row.gpu);
        }
    }
}

/// One server per GPU (tests/programs/host_view_target.py under `tllm-affinity run --step-core
/// auto`): a worker thread configured for the GPU, a step and a result thread pinned for it.
struct Server {
    driver: Driver,
    info: Value,
}

impl Server {
    fn start(w: &Written, gpu: usize) -> Server {
        let mut cmd = w.command(cli());
        let gpu = gpu.to_string();
        cmd.args([
            "run",
            "--step-core",
            "auto",
            "--policy",
            "numa",
            "--log",
            "info",
        ])
        .arg("--sysfs-root")
        .arg(w.root())
        .arg("--lock-dir")
        .arg(w.locks.path())
        .arg("--")
        .arg(python())
        .arg(program("host_view_target.py"))
        .args(["--gpu", &gpu, "--step", &gpu, "--result", &gpu]);
        let mut driver = Driver::spawn(cmd, DEADLINE);
        let line = driver.line("{");
        let info: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        Server { driver, info }
    }

    fn pid(&self) -> u32 {
        self.driver.pid()
    }

    fn mask_of(&self, thread: &str) -> CpuMask {
        kernel_mask(self.pid(), self.info[thread].as_i64().unwrap() as i32)
    }

    fn rc(&self, thread: &str) -> i64 {
        self.info["rc"][thread].as_i64().unwrap()
    }
}

/// `auto` in one real process per GPU, all at once: each step and result thread where `plan
/// --gpu N` over this process's real CPUs says (pinned, or not with its reason), never two on
/// one CPU; then the host view of the four: each row's GPU, workers and step CPUs, and no flag
/// among them.
fn check_servers(w: &Written, rows: &[Row]) {
    let name = w.shape.name;
    let servers: Vec<Server> = rows.iter().map(|r| Server::start(w, r.gpu)).collect();
    let mut pinned: BTreeMap<usize, u32> = BTreeMap::new();
    for (s, row) in servers.iter().zip(rows) {
        let plan = w.cli_json(
            &["plan", "--gpu", &row.gpu.to_string(), "--json"],
            &[("TLLM_AFFINITY_STEP_CORE", "auto")],
        );
        let stderr = s.driver.stderr();
        assert!(
            s.rc("worker") > 0,
            "{name} GPU {}: {}\n{stderr}",
            row.gpu,
            s.info
        );
        match plan["placement"]["step_cpus"].as_str() {
            Some(step) => {
                assert_eq!(s.mask_of("step"), mask(step), "{name} GPU {}", row.gpu);
                let result = plan["placement"]["result_cpu"].as_u64().unwrap() as usize;
                assert_eq!(s.mask_of("result"), CpuMask::from_cpus([result]));
                for cpu in mask(step).iter().chain([result]) {
                    let other = pinned.insert(cpu, s.pid());
                    assert_eq!(other, None, "{name}: CPU {cpu} pinned twice");
                }
            }
            None => {
                let why = plan["placement"]["not_pinned"].as_str().unwrap();
                assert_eq!(s.rc("step"), 0, "{name} GPU {}: {stderr}", row.gpu);
                says(&stderr, &[why.split(':').next().unwrap()]);
            }
        }
    }

    let out = w
        .command(cli())
        .args(["ps", "--json", "--sysfs-root"])
        .arg(w.root())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ours: Vec<u32> = servers.iter().map(Server::pid).collect();
    for (s, row) in servers.iter().zip(rows) {
        let p = v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == s.pid())
            .unwrap_or_else(|| panic!("{name}: no process {} in {v:#}", s.pid()));
        assert_eq!(p["leases"][0]["device"], row.address.as_str(), "{p:#}");
        assert_eq!(p["leases"][0]["gpu"], row.gpu, "{p:#}");
        assert_eq!(
            mask(p["worker_cpus"].as_str().unwrap()),
            s.mask_of("worker"),
            "{name}: {p:#}"
        );
        if s.rc("step") > 0 {
            assert_eq!(mask(p["step_cpus"].as_str().unwrap()), s.mask_of("step"));
        }
    }
    let ours_flagged: Vec<&Value> = v["flags"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            let pids = f["pids"].as_array().unwrap();
            pids.iter()
                .all(|p| ours.contains(&(p.as_u64().unwrap() as u32)))
        })
        .filter(|f| f["kind"] != "memory-off-node")
        .collect();
    // Where this machine lacks a GPU's Grace node, its server's workers stay on the CPUs
    // that exist, which the other servers' workers may use: that overlap is real here.
    let all_real = rows.iter().all(|r| !real_part(&r.worker).is_empty());
    if all_real {
        assert!(ours_flagged.is_empty(), "{name}: {ours_flagged:#?}");
    }
    for s in servers {
        s.driver.succeed();
    }
}

fn check(shape: &fn() -> GraceHost) {
    let w = Written::new(shape());
    let rows = documented(w.shape.name);
    assert_eq!(rows.len(), w.shape.gpus.len(), "{}", w.shape.name);
    check_topo(&w, &rows);
    check_plan(&w, &rows);
    check_configure(&w, &rows);
    check_servers(&w, &rows);
}

fn gb200_numa() -> GraceHost {
    simulated::gb200_tray(simulated::GpuMemoryMode::Numa)
}

fn gb200_cdmm() -> GraceHost {
    simulated::gb200_tray(simulated::GpuMemoryMode::Cdmm)
}

table_tests! { check;
    /// 34 nodes, four GPUs on two Grace nodes, memory nodes 2, 10, 18, 26.
    gb200_tray_in_numa_mode: gb200_numa as fn() -> GraceHost;
    /// The same 34 nodes, no GPU memory node, NVML's NUMA-node query unsupported.
    gb200_tray_in_cdmm_mode: gb200_cdmm as fn() -> GraceHost;
    /// Only the two Grace nodes, NVML's NUMA-node query unsupported, Grace's MIDR: CDMM.
    gb200_tray_in_cdmm_mode_without_placeholder_nodes:
        simulated::gb200_tray_cdmm_without_placeholders as fn() -> GraceHost;
    /// GB300's bus ids 0008/0009 on node 0, 0018/0019 on node 1.
    gb300_tray: simulated::gb300_tray as fn() -> GraceHost;
    /// One Grace node, the GPU's memory node 1, nodes 2-8 empty.
    gh200: simulated::gh200 as fn() -> GraceHost;
    /// 36 nodes: four Grace nodes, 4 x 8 GPU nodes from 4.
    quad_gh200: simulated::quad_gh200 as fn() -> GraceHost;
    /// One node, the GPU's numa_node -1.
    dgx_spark: simulated::dgx_spark as fn() -> GraceHost;
}

/// The CDMM tray without placeholder nodes, its CPUs an x86 host's (no MIDR): the same two
/// nodes and NVML's same NOT_SUPPORTED, which every x86 host's NVML answers, name no mode.
#[test]
fn the_same_layout_on_x86_cpus_is_not_cdmm() {
    let mut shape = simulated::gb200_tray_cdmm_without_placeholders();
    shape.host = shape.host.midr(None);
    let w = Written::new(shape);
    let v = w.cli_json(&["topo", "--json"], &[]);
    assert_eq!(v["visible"]["source"], "nvml", "{}", v["visible"]);
    assert_eq!(v["gpu_memory_mode"], Value::Null, "{v}");
    let out = succeeded(w.command(cli()).arg("topo"));
    let text = String::from_utf8_lossy(&out.stdout);
    never_says(&text, &["GPU memory:", "its memory"]);
}

/// Every written shape is in docs/grace.md's table and every table row is a written shape.
#[test]
fn the_docs_table_lists_exactly_the_written_shapes() {
    for shape in simulated::grace_hosts() {
        let rows = documented(shape.name);
        let addresses: Vec<&str> = rows.iter().map(|r| r.address.as_str()).collect();
        let written: Vec<&str> = shape.gpus.iter().map(|g| g.address.as_str()).collect();
        assert_eq!(addresses, written, "{}", shape.name);
    }
}

/// Four servers on a GB200 tray written over this machine's CPUs (Grace node 0 the lower half,
/// node 1 the rest), checked by [`common::tray::check_tray_servers`]. With fewer than eight
/// CPUs `auto` pins no step thread here, so the step-thread collision that upstream's
/// process-wide pin makes is checked in the eight-CPU guest of tests/guests/guest.rs, which runs the same
/// servers and the same check.
#[test]
fn four_servers_on_a_tray_over_this_machines_cpus_share_their_grace_nodes_without_a_flag() {
    require!(two_cpus("two Grace nodes with CPUs"));
    let cpus: Vec<usize> = allowed_cpus().iter().collect();
    let half = cpus.len() / 2;
    let node0 = CpuMask::from_cpus(cpus[..half].iter().copied());
    let node1 = CpuMask::from_cpus(cpus[half..].iter().copied());
    let tray = tempfile::tempdir().unwrap();
    common::tray::write_tray(tray.path(), &node0, &node1);
    let out = clean(python())
        .arg(program("tray_servers.py"))
        .arg(cli())
        .arg(python())
        .arg(programs_dir())
        .arg(tray.path())
        .arg(nvml_double())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pinned = common::tray::check_tray_servers(&stdout, &node0, &node1);
    println!("`auto` pinned every server's step thread: {pinned}");
}
