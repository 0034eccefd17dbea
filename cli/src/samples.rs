//! The `ps` samples in docs/*.md are generated, not typed. A block
//!
//! ````text
//! <!-- sample: NAME -->
//! ```
//! ...
//! ```
//! <!-- /sample -->
//! ````
//!
//! in any docs/*.md holds what sample NAME ([`generate`]) draws today, and the test below fails
//! when it does not; `TLLM_AFFINITY_WRITE_DOCS=1 cargo test -p tllm-affinity --bin tllm-affinity
//! samples` rewrites every block. To mark another block, put the two markers around it and give
//! its NAME a line in [`generate`].
//!
//! Each sample is the CLI's own drawing ([`crate::host::to_text`], [`crate::ps::to_text`]) of a
//! written full-scale host read back as the library reads it: each server's workers on its GPU's
//! local CPUs and its step and result threads where the library's `auto` puts them
//! ([`plan::auto_placement`]), the flags judged by the host view's own rules. Pids, thread names
//! and memory figures are fixed, so that a sample changes only when the drawing or the placement
//! does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tllm_affinity_core::host::simulated::{self, GpuMemoryMode, SimulatedHost};
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::placement::plan;
use tllm_affinity_core::registry::{Placement, Role};
use tllm_affinity_core::table::threadtable::LeaseLine;

use crate::host::{self, Entry, HostView, Kind, ProcessRow};
use crate::memory_reading::NodeMemory;
use crate::ps::{GridCpus, Snapshot, ThreadRow};

/// The width the samples are drawn at.
const WIDTH: usize = 100;
const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// The text of sample `name`; `None` for a name no sample has.
fn generate(name: &str) -> Option<String> {
    let gb200 = || simulated::gb200_tray(GpuMemoryMode::Numa).host;
    Some(match name {
        "host-view-gb200" => host_view(&gb200(), &[0, 1, 2, 3]),
        "host-view-8xh100" => host_view(&simulated::dgx_h100_like(), &[0, 1, 4, 5]),
        "ps-pid-gb200" => ps_pid(&gb200(), 2),
        "ps-pid-8xh100" => ps_pid(&simulated::dgx_h100_like(), 0),
        _ => return None,
    })
}

/// `shape` written to a directory and read back as the library and `ps` read it.
fn written(shape: &SimulatedHost) -> Topology {
    let dir = tempfile::tempdir().unwrap();
    shape.write(dir.path()).unwrap();
    let root = SysfsRoot::new(dir.path());
    let mut t = Topology::read(&root).unwrap();
    t.read_llc_domains(&root);
    t
}

/// GPU `gpu`'s lease, workers, and `auto` step and result CPUs on `t`.
fn placed(t: &Topology, gpu: usize) -> (LeaseLine, CpuMask, CpuMask, CpuMask) {
    let g = &t.gpus[gpu];
    let lease = LeaseLine {
        id: 1,
        gpu_index: Some(gpu),
        device: g.address.clone(),
        slice: None,
    };
    let workers = t.gpu_local_cpus(g).cpus;
    let auto = plan::auto_placement(t, &t.online);
    let (step, result) = match &auto[gpu].placement {
        Ok(p) => (p.step.clone(), CpuMask::from_cpus(p.result)),
        Err(_) => (CpuMask::default(), CpuMask::default()),
    };
    (lease, workers, step, result)
}

/// Resident memory mostly on the node of `workers`, a little on the others with CPUs.
fn memory(t: &Topology, workers: &CpuMask, source: String) -> NodeMemory {
    let bytes = t
        .nodes_with_cpus()
        .into_iter()
        .map(|(node, cpus)| {
            let here = !cpus.intersection(workers).is_empty();
            (node, if here { 9 * GIB + 512 * MIB } else { 86 * MIB })
        })
        .collect();
    NodeMemory {
        bytes,
        source,
        partial: None,
    }
}

/// The host view of one server on each GPU of `gpus`: a host thread pool on every CPU, workers,
/// and a step and a result thread.
fn host_view(shape: &SimulatedHost, gpus: &[usize]) -> String {
    let t = written(shape);
    let mut rows = Vec::new();
    for (i, &gpu) in gpus.iter().enumerate() {
        let (lease, workers, step, result) = placed(&t, gpu);
        let pid = 4100 + 100 * i as u32;
        let cpus: BTreeMap<Kind, CpuMask> = [
            (Kind::Host, t.online.clone()),
            (Kind::Worker, workers.clone()),
            (Kind::Step, step),
            (Kind::Result, result),
        ]
        .into_iter()
        .filter(|(_, m)| !m.is_empty())
        .collect();
        let threads = cpus
            .keys()
            .map(|&k| match k {
                Kind::Host => (k, 38),
                Kind::Worker => (k, 12),
                _ => (k, 1),
            })
            .collect();
        rows.push(ProcessRow {
            pid,
            namespace_pid: None,
            command: "trtllm-serve".into(),
            leases: Ok(vec![lease]),
            cpus,
            threads,
            explicit: CpuMask::default(),
            external: CpuMask::default(),
            memory: Ok(memory(&t, &workers, format!("/proc/{pid}/numa_maps"))),
        });
    }
    let masks = rows
        .iter()
        .flat_map(|r| r.cpus.values())
        .fold(CpuMask::default(), |a, m| a.union(m));
    let cores = t.cores();
    let kernel_nodes = t.nodes_with_cpus();
    let gpu_local = t
        .gpus
        .iter()
        .map(|g| (g.address.clone(), t.gpu_local_cpus(g).cpus))
        .collect();
    let shown: Vec<&ProcessRow> = rows.iter().collect();
    let flags = host::flags(&shown, &cores, &kernel_nodes, &gpu_local, &BTreeMap::new());
    let view = HostView {
        groups: crate::grid::groups(Some(&t), &masks),
        entries: rows.into_iter().map(Entry::Row).collect(),
        unreachable: 0,
        readers_stuck: 0,
        cores,
        flags,
        kernel_nodes,
    };
    host::to_text(&view, false, WIDTH)
}

/// `ps PID` of one server on GPU `gpu`: its main and HTTP threads (host), a tokenizer thread the
/// application pinned itself (explicit), workers, and its step and result threads.
fn ps_pid(shape: &SimulatedHost, gpu: usize) -> String {
    let t = written(shape);
    let (lease, workers, step, result) = placed(&t, gpu);
    let pid = 4100;
    let thread = |n: u32, name: &str, known: (Role, Placement), mask: &CpuMask| ThreadRow {
        tid: (pid + n) as i32,
        namespace_tid: None,
        name: name.into(),
        known: Some(known),
        mask_text: mask.to_list(),
        mask: mask.clone(),
    };
    let host = (Role::Host, Placement::Inherited);
    let worker = (Role::Worker, Placement::Worker);
    let tokenizer = CpuMask::from_cpus(workers.iter().last());
    let threads = vec![
        thread(0, "trtllm-serve", host, &t.online),
        thread(1, "uvicorn", host, &t.online),
        thread(
            2,
            "tokenizer",
            (Role::Host, Placement::Explicit),
            &tokenizer,
        ),
        thread(
            3,
            "trtllm-serve",
            (Role::Worker, Placement::Inherited),
            &workers,
        ),
        thread(4, "cuda-EvtHandlr", worker, &workers),
        thread(5, "nccl-proxy", worker, &workers),
        thread(6, "executor-loop", (Role::Worker, Placement::Step), &step),
        thread(
            7,
            "await-response",
            (Role::Worker, Placement::Result),
            &result,
        ),
    ];
    let snapshot = Snapshot {
        pid,
        namespace_pid: None,
        name: "trtllm-serve".into(),
        no_table: None,
        table_refused: false,
        table_partial: None,
        library_loaded: Some(true),
        disabled: false,
        cpus: t.online.iter().collect(),
        threads,
        memory: Ok(memory(&t, &workers, format!("/proc/{pid}/numa_maps"))),
        adapters: Ok(Vec::new()),
        leases: Ok(vec![lease]),
    };
    let columns = GridCpus {
        groups: crate::grid::groups(Some(&t), &t.online),
        cores: t.cores(),
    };
    crate::ps::to_text(&snapshot, &columns, false, WIDTH)
}

const OPEN: &str = "<!-- sample: ";
const CLOSE: &str = "<!-- /sample -->";

/// `text` with every sample block regenerated; the names it found.
fn regenerated(text: &str, file: &Path) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        let (before, block) = rest.split_at(at);
        out.push_str(before);
        let name_end = block
            .find(" -->")
            .unwrap_or_else(|| panic!("{}: a sample marker without its end", file.display()));
        let name = block[OPEN.len()..name_end].trim().to_string();
        let close = block
            .find(CLOSE)
            .unwrap_or_else(|| panic!("{}: sample {name} has no {CLOSE}", file.display()));
        let sample = generate(&name)
            .unwrap_or_else(|| panic!("{}: no sample is named {name:?}", file.display()));
        out.push_str(&format!("{OPEN}{name} -->\n```\n{sample}```\n{CLOSE}"));
        names.push(name);
        rest = &block[close + CLOSE.len()..];
    }
    out.push_str(rest);
    (out, names)
}

fn docs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort();
    files
}

/// Every sample block in docs/*.md is what its sample draws today (rewritten instead under
/// `TLLM_AFFINITY_WRITE_DOCS=1`), and the GB200 and 8×H100 samples are in the docs.
#[test]
fn samples_in_the_docs_are_what_the_cli_draws() {
    let write = std::env::var("TLLM_AFFINITY_WRITE_DOCS").is_ok_and(|v| v == "1");
    let mut found = Vec::new();
    for file in docs() {
        let text = std::fs::read_to_string(&file).unwrap();
        let (fresh, names) = regenerated(&text, &file);
        found.extend(names);
        if write {
            if fresh != text {
                std::fs::write(&file, fresh).unwrap();
            }
        } else {
            assert!(
                fresh == text,
                "{}: a sample differs from what the CLI draws; rewrite them with \
                 TLLM_AFFINITY_WRITE_DOCS=1 cargo test -p tllm-affinity --bin tllm-affinity samples",
                file.display()
            );
        }
    }
    for name in [
        "host-view-gb200",
        "host-view-8xh100",
        "ps-pid-gb200",
        "ps-pid-8xh100",
    ] {
        assert!(found.iter().any(|f| f == name), "no sample {name} in docs/");
    }
}

/// Each sample fits its width, shows every server's GPU, and its grid groups the host's CPUs.
#[test]
fn samples_fit_their_width_and_show_each_gpu() {
    for name in [
        "host-view-gb200",
        "host-view-8xh100",
        "ps-pid-gb200",
        "ps-pid-8xh100",
    ] {
        let text = generate(name).unwrap();
        for line in text.lines() {
            assert!(line.chars().count() <= WIDTH, "{name}: {line}");
        }
        assert!(text.contains("GPU "), "{name}:\n{text}");
        assert!(text.contains("a column is"), "{name}:\n{text}");
    }
    let gb200 = generate("host-view-gb200").unwrap();
    for gpu in 0..4 {
        assert!(gb200.contains(&format!("GPU {gpu} (")), "{gb200}");
    }
    assert!(generate("ps-pid-8xh100").unwrap().contains("x explicit"));
}
