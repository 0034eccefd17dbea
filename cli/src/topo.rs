//! `tllm-affinity topo [--json] [--sysfs-root DIR]`: the host as the library sees it — NUMA nodes
//! (a CPU-less node holding a GPU's memory named as such), cores with their SMT siblings, GPUs with
//! their local CPUs, the last-level-cache domains and each GPU's slice under
//! `TLLM_AFFINITY_SLICE=gpu`, the cgroup's cpuset and CPU quota, and the cpuidle states.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use tllm_affinity_core::host::cgroup::{self, CgroupLimits, CgroupVersion};
use tllm_affinity_core::host::gpus::{GpuMemoryMode, GpuMemoryNode, GpuSource, GpuView};
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::placement::device::{visible_in_view, DeviceEnv};
use tllm_affinity_core::placement::slice::{self, GpuSlice};
use tllm_affinity_core::sys;

#[derive(clap::Args, Debug)]
pub struct TopoArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Read sysfs under this directory (default: TLLM_AFFINITY_SYSFS_ROOT, else /).
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<PathBuf>,
}

pub fn run(args: &TopoArgs) -> Result<(), String> {
    let root = crate::sysfs_root(args.sysfs_root.as_deref());
    let mut topology = Topology::read(&root).map_err(|e| e.to_string())?;
    topology.read_llc_domains(&root);
    let view = tllm_affinity_core::host::gpus::current_view(&root, &mut topology, true);
    let memory_nodes = tllm_affinity_core::host::gpus::memory_nodes(&topology, &view);
    let grace_cpus = tllm_affinity_core::host::gpus::cpus_are_grace(&root);
    let mode =
        tllm_affinity_core::host::gpus::memory_mode(&topology, &view, &memory_nodes, grace_cpus);
    let real = root.root() == Path::new("/");
    let limits = cgroup::read_limits();
    // Slices divide the cpuset's online CPUs, as configure divides them; a simulated tree has
    // no cgroup of its own.
    let sliceable = if real {
        limits.cpuset_within(&topology.online)
    } else {
        topology.online.clone()
    };
    let slices = slice::slices(&topology, &sliceable);
    let host = Host {
        slices,
        view: &view,
        memory_nodes,
        mode,
        env: DeviceEnv::from_env(),
        real,
        root: &root,
        topology: &topology,
        process_mask: sys::get_mask(0).ok(),
        limits,
    };
    if args.json {
        let text = crate::json::pretty(&to_json(&host))?;
        println!("{text}");
    } else {
        print!("{}", to_text(&host));
    }
    Ok(())
}

/// What `topo` shows, gathered once.
struct Host<'a> {
    /// Every GPU's slice under `TLLM_AFFINITY_SLICE=gpu`, in PCI order.
    slices: Vec<GpuSlice>,
    /// The sysfs root is `/`, so the cgroup (always this machine's) describes the same host.
    real: bool,
    root: &'a SysfsRoot,
    topology: &'a Topology,
    /// The GPUs this process sees (NVML, the driver's list or sysfs).
    view: &'a GpuView,
    /// The CPU-less node holding each GPU's memory, by index into `topology.gpus`.
    memory_nodes: Vec<Option<GpuMemoryNode>>,
    /// NUMA or CDMM mode, where GPU memory may be a NUMA node (a Grace host).
    mode: Option<GpuMemoryMode>,
    env: DeviceEnv,
    process_mask: Option<CpuMask>,
    limits: CgroupLimits,
}

impl Host<'_> {
    /// The GPUs (index into `topology.gpus`, and where that was learned) whose memory `node`
    /// holds.
    fn gpus_with_memory_on(&self, node: usize) -> Vec<(usize, GpuMemoryNode)> {
        self.memory_nodes
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.filter(|m| m.node == node).map(|m| (i, m)))
            .collect()
    }

    fn cgroup_note(&self) -> Option<String> {
        (!self.real).then(|| {
            format!(
                "sysfs is read under {}, but the cgroup is this machine's real one",
                self.root
            )
        })
    }
}

fn version_name(v: CgroupVersion) -> &'static str {
    match v {
        CgroupVersion::V1 => "v1",
        CgroupVersion::V2 => "v2",
        CgroupVersion::Hybrid => "hybrid",
        CgroupVersion::None => "none",
    }
}

/// The cores of one NUMA node, described compactly: one summary when every core has the same
/// shape (e.g. "56 cores x 2 threads: CPU c with c+112, c in 0-55"), else each core's CPUs.
pub fn describe_cores(cores: &[CpuMask]) -> String {
    let Some(first) = cores.first() else {
        return "no CPUs".to_string();
    };
    let shape = |core: &CpuMask| -> Vec<usize> {
        let base = core.first().unwrap_or(0);
        core.iter().map(|c| c - base).collect()
    };
    let first_shape = shape(first);
    if cores.iter().all(|c| shape(c) == first_shape) {
        let firsts = CpuMask::from_cpus(cores.iter().filter_map(CpuMask::first));
        let threads = first_shape.len();
        let count = match cores.len() {
            1 => "1 core".to_string(),
            n => format!("{n} cores"),
        };
        if threads == 1 {
            return format!("{count} x 1 thread: CPUs {firsts}");
        }
        let with: Vec<String> = first_shape[1..]
            .iter()
            .map(|off| format!("c+{off}"))
            .collect();
        return format!(
            "{count} x {threads} threads: CPU c with {}, c in {firsts}",
            with.join(", ")
        );
    }
    let listed: Vec<String> = cores.iter().map(|c| format!("[{c}]")).collect();
    format!("{} cores: {}", cores.len(), listed.join(" "))
}

/// The cores (SMT sibling sets) whose first CPU is on `node`.
fn cores_of_node(t: &Topology, node: usize) -> Vec<CpuMask> {
    t.cores()
        .into_iter()
        .filter(|c| c.first().and_then(|cpu| t.node_of_cpu(cpu)) == Some(node))
        .collect()
}

fn to_text(h: &Host<'_>) -> String {
    let t = h.topology;
    let mut out = String::new();
    let _ = writeln!(out, "host (sysfs under {}):", h.root);
    let online = &t.online;
    let _ = writeln!(
        out,
        "  {} CPUs online [{online}], {}",
        online.count(),
        crate::draw::host_counts(t)
    );
    if let Some(mask) = &h.process_mask {
        let _ = writeln!(out, "  this process may run on [{mask}]");
    }
    let _ = writeln!(out, "NUMA nodes:");
    for n in &t.nodes {
        let distances: Vec<String> = n.distances.iter().map(u32::to_string).collect();
        let gpu_memory: String = h
            .gpus_with_memory_on(n.id)
            .iter()
            .map(|(i, m)| {
                format!(
                    ", holds GPU {i}'s memory ({}, from {})",
                    t.gpus[*i].address, m.source
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "  node {}: CPUs [{}] ({}), memory {}, distances {}{gpu_memory}",
            n.id,
            n.cpus,
            n.cpus.count(),
            if n.has_memory { "yes" } else { "no" },
            if distances.is_empty() {
                "unknown".to_string()
            } else {
                distances.join(" ")
            }
        );
    }
    if let Some(mode) = h.mode {
        let _ = writeln!(out, "GPU memory: {mode}");
    }
    let _ = writeln!(out, "cores and SMT siblings:");
    for n in &t.nodes {
        let cores = cores_of_node(t, n.id);
        if !cores.is_empty() {
            let _ = writeln!(out, "  node {}: {}", n.id, describe_cores(&cores));
        }
    }
    let orphans: Vec<CpuMask> = t
        .cores()
        .into_iter()
        .filter(|c| c.first().and_then(|cpu| t.node_of_cpu(cpu)).is_none())
        .collect();
    if !orphans.is_empty() {
        let _ = writeln!(out, "  no node: {}", describe_cores(&orphans));
    }
    let _ = writeln!(out, "GPUs (PCI order):");
    if t.gpus.is_empty() {
        let _ = writeln!(
            out,
            "  none found under {}",
            h.root.path("sys/bus/pci/devices").display()
        );
        let _ = writeln!(out, "  hint: {}", super::NO_GPU_HINT);
    }
    for (i, g) in t.gpus.iter().enumerate() {
        let local = tllm_affinity_core::host::gpus::pci_local_cpus(t, h.view, g);
        let node = g.numa_node.map_or("unknown".to_string(), |n| n.to_string());
        let memory = match (h.memory_nodes[i], h.mode) {
            (Some(m), _) => format!(", its memory on node {} (from {})", m.node, m.source),
            (None, Some(GpuMemoryMode::Cdmm)) => ", its memory on no NUMA node".to_string(),
            (None, Some(GpuMemoryMode::Numa)) => {
                ", its memory node not named (neither NVML nor the driver names it)".to_string()
            }
            (None, None) => String::new(),
        };
        let _ = writeln!(
            out,
            "  {i}: {} (device {:04x}), NUMA node {node}, local CPUs [{}] from {}{memory}",
            g.address, g.device, local.cpus, local.source
        );
    }
    slices_text(h, &mut out);
    visible_text(h, &mut out);
    let limits = &h.limits;
    let _ = writeln!(out, "cgroup ({}):", version_name(limits.version));
    let _ = writeln!(
        out,
        "  cpuset: {}",
        limits
            .cpuset
            .as_ref()
            .map_or("none found (every online CPU)".to_string(), |c| format!(
                "[{c}]"
            ))
    );
    let _ = writeln!(
        out,
        "  CPU quota: {}",
        limits.quota.map_or("none".to_string(), |q| format!(
            "{:.2} CPUs ({} µs per {} µs)",
            q.cpus(),
            q.quota_us,
            q.period_us
        ))
    );
    if let Some(note) = h.cgroup_note() {
        let _ = writeln!(out, "  note: {note}");
    }
    let _ = writeln!(out, "cpuidle states (CPU 0):");
    if t.idle_states.is_empty() {
        let _ = writeln!(out, "  none (no cpuidle driver, or a VM)");
    }
    let w = t
        .idle_states
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(0);
    for s in &t.idle_states {
        let _ = writeln!(
            out,
            "  {:<w$}  exit latency {:>5} µs{}",
            s.name,
            s.latency_us,
            if s.disabled { " (disabled)" } else { "" }
        );
    }
    out
}

/// The last-level-cache domains and every GPU's slice under `TLLM_AFFINITY_SLICE=gpu`.
fn slices_text(h: &Host<'_>, out: &mut String) {
    let t = h.topology;
    let domains: Vec<String> = t.llc_domains.iter().map(|d| format!("[{d}]")).collect();
    let _ = writeln!(
        out,
        "last-level caches: {}",
        if domains.is_empty() {
            "not described by sysfs".to_string()
        } else {
            format!("{} domain(s) {}", domains.len(), domains.join(" "))
        }
    );
    if h.slices.is_empty() {
        return;
    }
    let _ = writeln!(out, "slices (TLLM_AFFINITY_SLICE=gpu):");
    for (i, s) in h.slices.iter().enumerate() {
        let _ = writeln!(out, "  {i}: {} [{}]: {}", s.address, s.cpus, s.describe());
    }
}

/// What NVML said, in a line: its GPU count, or why it was not used.
fn nvml_text(v: &GpuView) -> String {
    match (&v.nvml_error, v.source, v.nvml_tried) {
        (_, GpuSource::Nvml, _) => format!("{} GPU(s)", v.gpus.len()),
        (Some(e), _, _) => format!("not used: {e}"),
        _ => "not asked".to_string(),
    }
}

fn driver_text(v: &GpuView) -> String {
    match &v.driver {
        None => "no /proc/driver/nvidia/gpus".to_string(),
        Some(d) => format!(
            "{} listed, {} this process may open",
            d.len(),
            v.driver_visible().unwrap_or(0)
        ),
    }
}

/// The GPUs CUDA numbers for this process, where that list came from, and the views that
/// disagree with it.
fn visible_text(h: &Host<'_>, out: &mut String) {
    let v = h.view;
    let _ = writeln!(out, "GPUs this process sees (from {}):", v.source);
    let _ = writeln!(out, "  NVML: {}", nvml_text(v));
    let _ = writeln!(out, "  driver: {}", driver_text(v));
    let _ = writeln!(out, "  sysfs: {} NVIDIA GPU(s)", v.sysfs_count);
    if let Some(line) = v.disagreement() {
        let _ = writeln!(out, "  note: {line}");
    }
    match visible_in_view(&h.env, v) {
        Ok(visible) => {
            for (cuda, &i) in visible.iter().enumerate() {
                let g = &v.gpus[i];
                let local = tllm_affinity_core::host::gpus::local_cpus(h.topology, g);
                let _ = writeln!(
                    out,
                    "  CUDA device {cuda}: {}{}, local CPUs [{}] from {}",
                    g.address,
                    g.uuid
                        .as_deref()
                        .map(|u| format!(" ({u})"))
                        .unwrap_or_default(),
                    local.cpus,
                    local.source
                );
            }
            if visible.is_empty() {
                let _ = writeln!(out, "  no CUDA device visible");
            }
        }
        Err(e) => {
            let _ = writeln!(out, "  warning: {e}");
        }
    }
}

fn visible_json(h: &Host<'_>) -> Value {
    let v = h.view;
    let (devices, warning) = match visible_in_view(&h.env, v) {
        Ok(visible) => (
            visible
                .iter()
                .enumerate()
                .map(|(cuda, &i)| {
                    let g = &v.gpus[i];
                    let local = tllm_affinity_core::host::gpus::local_cpus(h.topology, g);
                    json!({
                        "cuda_device": cuda,
                        "address": g.address,
                        "uuid": g.uuid,
                        "migs": g.migs,
                        "nvml_cpus": g.nvml_cpus.as_ref().map(CpuMask::to_list),
                        "local_cpus": local.cpus.to_list(),
                        "local_cpus_from": local.source.to_string(),
                    })
                })
                .collect::<Vec<_>>(),
            None,
        ),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    json!({
        "source": match v.source {
            GpuSource::Nvml => "nvml",
            GpuSource::DriverList => "driver",
            GpuSource::Sysfs => "sysfs",
        },
        "nvml": nvml_text(v),
        "driver": driver_text(v),
        "sysfs_gpus": v.sysfs_count,
        "note": v.disagreement(),
        "devices": devices,
        "warning": warning,
    })
}

fn to_json(h: &Host<'_>) -> Value {
    let t = h.topology;
    let cpus: Vec<Value> = t
        .cpus
        .iter()
        .map(|c| {
            json!({
                "cpu": c.id,
                "core_id": c.core_id,
                "package_id": c.package_id,
                "node": t.node_of_cpu(c.id),
                "siblings": c.siblings.to_list(),
            })
        })
        .collect();
    let nodes: Vec<Value> = t
        .nodes
        .iter()
        .map(|n| {
            json!({
                "id": n.id,
                "cpus": n.cpus.to_list(),
                "has_memory": n.has_memory,
                "distances": n.distances,
                "cores": cores_of_node(t, n.id).iter().map(CpuMask::to_list).collect::<Vec<_>>(),
                "gpu_memory_of": h.gpus_with_memory_on(n.id).iter().map(|(i, m)| json!({
                    "index": i,
                    "address": t.gpus[*i].address,
                    "from": m.source.key(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let gpus: Vec<Value> = t
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let local = tllm_affinity_core::host::gpus::pci_local_cpus(t, h.view, g);
            json!({
                "index": i,
                "address": g.address,
                "device": format!("{:04x}", g.device),
                "numa_node": g.numa_node,
                "local_cpus": local.cpus.to_list(),
                "local_cpus_from": local.source.to_string(),
                "memory_node": h.memory_nodes[i].map(|m| m.node),
                "memory_node_from": h.memory_nodes[i].map(|m| m.source.key()),
                "slice": h.slices.get(i).map(|s| json!({
                    "cpus": s.cpus.to_list(),
                    "set": s.set.to_list(),
                    "rank": s.rank,
                    "sharing": s.sharing,
                    "cut": s.cut.name(),
                    "domains": s.domains.iter().map(CpuMask::to_list).collect::<Vec<_>>(),
                })),
            })
        })
        .collect();
    let limits = &h.limits;
    json!({
        "sysfs_root": h.root.to_string(),
        "online": t.online.to_list(),
        "process_mask": h.process_mask.as_ref().map(CpuMask::to_list),
        "gpu_memory_mode": h.mode.map(GpuMemoryMode::key),
        "nodes": nodes,
        "cpus": cpus,
        "gpus": gpus,
        "llc_domains": t.llc_domains.iter().map(CpuMask::to_list).collect::<Vec<_>>(),
        "visible": visible_json(h),
        "hint": t.gpus.is_empty().then_some(super::NO_GPU_HINT),
        "cgroup": {
            "version": version_name(limits.version),
            "cpuset": limits.cpuset.as_ref().map(CpuMask::to_list),
            "quota": limits.quota.map(|q| json!({
                "quota_us": q.quota_us,
                "period_us": q.period_us,
                "cpus": q.cpus(),
            })),
            "note": h.cgroup_note(),
        },
        "idle_states": t.idle_states.iter().map(|s| json!({
            "name": s.name,
            "latency_us": s.latency_us,
            "disabled": s.disabled,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tllm_affinity_core::host::simulated::dgx_h100_like;

    fn masks(lists: &[&str]) -> Vec<CpuMask> {
        lists
            .iter()
            .map(|l| CpuMask::parse_list(l).unwrap())
            .collect()
    }

    #[test]
    fn cores_are_summarised_when_regular() {
        assert_eq!(
            describe_cores(&masks(&["0,4", "1,5"])),
            "2 cores x 2 threads: CPU c with c+4, c in 0-1"
        );
        assert_eq!(
            describe_cores(&masks(&["0", "1", "3"])),
            "3 cores x 1 thread: CPUs 0-1,3"
        );
        assert_eq!(describe_cores(&masks(&["1"])), "1 core x 1 thread: CPUs 1");
        assert_eq!(describe_cores(&masks(&["0,4", "1"])), "2 cores: [0,4] [1]");
    }

    #[test]
    fn the_dgx_in_text_and_json() {
        let dir = tempfile::tempdir().unwrap();
        dgx_h100_like().write(dir.path()).unwrap();
        let root = SysfsRoot::new(dir.path());
        let mut t = Topology::read(&root).unwrap();
        t.read_llc_domains(&root);
        let view = tllm_affinity_core::host::gpus::view(&root, &t.gpus, None);
        let memory_nodes = tllm_affinity_core::host::gpus::memory_nodes(&t, &view);
        let host = Host {
            slices: slice::slices(&t, &t.online),
            mode: tllm_affinity_core::host::gpus::memory_mode(
                &t,
                &view,
                &memory_nodes,
                tllm_affinity_core::host::gpus::cpus_are_grace(&root),
            ),
            memory_nodes,
            view: &view,
            env: DeviceEnv::default(),
            real: false,
            root: &root,
            topology: &t,
            process_mask: None,
            limits: cgroup::read_limits(),
        };
        let text = to_text(&host);
        assert!(
            text.contains("node 0: 56 cores x 2 threads: CPU c with c+112, c in 0-55"),
            "{text}"
        );
        assert!(text.contains("0000:18:00.0"), "{text}");
        assert!(
            text.contains("the cgroup is this machine's real one"),
            "{text}"
        );
        let v = to_json(&host);
        assert_eq!(v["gpus"].as_array().unwrap().len(), 8);
        assert_eq!(v["cpus"].as_array().unwrap().len(), 224);
        assert_eq!(v["nodes"][1]["cores"].as_array().unwrap().len(), 56);
        assert_eq!(v["gpu_memory_mode"], Value::Null, "an x86 host has no mode");
        assert!(!text.contains("GPU memory:"), "{text}");
        // One L3 per socket, four GPUs on each: runs of 14 cores with their siblings.
        assert!(
            text.contains("last-level caches: 2 domain(s) [0-55,112-167] [56-111,168-223]"),
            "{text}"
        );
        assert!(
            text.contains("  1: 0000:2a:00.0 [14-27,126-139]: slice 1 of 4 of [0-55,112-167]"),
            "{text}"
        );
        assert_eq!(v["gpus"][7]["slice"]["cpus"], "98-111,210-223");
        assert_eq!(v["gpus"][7]["slice"]["cut"], "cores");
        assert_eq!(v["llc_domains"][1], "56-111,168-223");
    }
}
