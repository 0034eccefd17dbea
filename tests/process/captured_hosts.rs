//! sysfs trees captured on real machines (`tests/fixtures/sysfs`, from hwloc's test tarballs),
//! read by the real `tllm-affinity topo` and `plan` binaries and by
//! `tllm_affinity_core::host::topology`, and checked against hwloc's own expected output for the same
//! tarball (`hwloc.console`): CPUs, packages, cores, NUMA nodes, node distances and which CPUs
//! each GPU is local to. The expectations come from that file, never from our own output, so a
//! misreading of real sysfs that `src/host/simulated.rs` shares with the reader shows up here.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Output;

use common::*;
use serde_json::Value;
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::CpuMask;

/// One object line of `lstopo -v` output: `  Package L#0 (P#0 total=46GiB ...)`.
struct HwObject {
    kind: String,
    logical: Option<usize>,
    attrs: String,
    parent: Option<usize>,
    children: Vec<usize>,
}

impl HwObject {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .split_whitespace()
            .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
    }

    /// `P#n`, the OS index.
    fn os_index(&self) -> Option<usize> {
        self.attrs
            .strip_prefix("P#")?
            .split(' ')
            .next()?
            .parse()
            .ok()
    }

    fn is_io(&self) -> bool {
        ["HostBridge", "PCIBridge", "PCI", "OSDev", "Bridge"]
            .iter()
            .any(|io| self.kind == *io || self.kind.starts_with(&format!("{io}[")))
    }
}

/// hwloc's expected topology, parsed from its console output.
struct Hwloc {
    objects: Vec<HwObject>,
    /// `NUMALatency` by logical index, when hwloc printed the matrix.
    latency: Vec<Vec<u32>>,
    /// "N processors not represented in topology: 0x...": the offline CPUs.
    not_represented: CpuMask,
}

impl Hwloc {
    fn parse(text: &str) -> Hwloc {
        let mut objects: Vec<HwObject> = Vec::new();
        let mut stack: Vec<(usize, usize)> = Vec::new();
        let mut latency = Vec::new();
        let mut not_represented = CpuMask::new();
        let mut in_matrix = false;
        for line in text.lines() {
            let depth = (line.len() - line.trim_start().len()) / 2;
            let body = line.trim();
            if let Some(hex) = body
                .split_once("processors not represented in topology: ")
                .map(|(_, h)| h)
            {
                not_represented = CpuMask::parse_hex(hex.trim_start_matches("0x")).unwrap();
                continue;
            }
            if body.starts_with("Relative latency matrix (name NUMALatency") {
                in_matrix = true;
                continue;
            }
            if in_matrix {
                if body.starts_with("index") {
                    continue;
                }
                let row: Vec<u32> = body
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|v| v.parse().ok())
                    .collect();
                if row.is_empty() || !body.starts_with(|c: char| c.is_ascii_digit()) {
                    in_matrix = false;
                } else {
                    latency.push(row);
                    continue;
                }
            }
            let (kind, logical, rest) = if let Some(rest) = body.strip_prefix("Machine (") {
                ("Machine".to_string(), None, rest)
            } else if let Some((kind, rest)) = body.split_once(" L#") {
                let (logical, rest) = rest.split_once(" (").unwrap_or((rest, ""));
                (kind.to_string(), logical.parse().ok(), rest)
            } else {
                continue;
            };
            let attrs = rest.rsplit_once(')').map_or(rest, |(a, _)| a).to_string();
            while stack.last().is_some_and(|&(d, _)| d >= depth) {
                stack.pop();
            }
            let parent = stack.last().map(|&(_, i)| i);
            let index = objects.len();
            objects.push(HwObject {
                kind,
                logical,
                attrs,
                parent,
                children: Vec::new(),
            });
            if let Some(p) = parent {
                objects[p].children.push(index);
            }
            stack.push((depth, index));
        }
        assert!(
            objects.first().is_some_and(|o| o.kind == "Machine"),
            "not lstopo -v output"
        );
        Hwloc {
            objects,
            latency,
            not_represented,
        }
    }

    fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = (usize, &'a HwObject)> + 'a {
        self.objects
            .iter()
            .enumerate()
            .filter(move |(_, o)| o.kind == kind)
    }

    /// The OS indexes of the PUs below object `index`.
    fn pus(&self, index: usize) -> CpuMask {
        let o = &self.objects[index];
        let mut cpus = CpuMask::new();
        if o.kind == "PU" {
            cpus.insert(o.os_index().unwrap());
        }
        for &c in &o.children {
            cpus = cpus.union(&self.pus(c));
        }
        cpus
    }

    fn all_pus(&self) -> CpuMask {
        self.pus(0)
    }

    /// The first ancestor of an I/O object that is not I/O: what hwloc attaches it to.
    fn io_locality(&self, index: usize) -> usize {
        let mut at = self.objects[index].parent.unwrap();
        while self.objects[at].is_io() {
            at = self.objects[at].parent.unwrap();
        }
        at
    }

    /// NUMA nodes with their CPUs: a node is a memory child of the object whose PUs it serves.
    fn nodes(&self) -> BTreeMap<usize, CpuMask> {
        self.of_kind("NUMANode")
            .map(|(_, o)| (o.os_index().unwrap(), self.pus(o.parent.unwrap())))
            .collect()
    }

    /// The NUMA node an I/O object sits under (the nearest ancestor with a NUMANode child).
    fn io_node(&self, index: usize) -> Option<usize> {
        let mut at = Some(self.io_locality(index));
        while let Some(i) = at {
            let node = self.objects[i]
                .children
                .iter()
                .map(|&c| &self.objects[c])
                .find(|c| c.kind == "NUMANode");
            if let Some(node) = node {
                return node.os_index();
            }
            at = self.objects[i].parent;
        }
        None
    }
}

/// A captured tree and what the test knows about it beyond hwloc's output.
struct Captured {
    dir: &'static str,
    /// hwloc's PCI objects that the fixture shows as NVIDIA GPUs (see the README).
    gpu_class: Option<&'static str>,
    /// The GPUs' `numa_node` files were captured.
    gpu_numa_node_files: bool,
}

const X86_GPU_SERVER: Captured = Captured {
    dir: "x86-2s-8-accelerators",
    gpu_class: Some("0b40(Co-Processor)"),
    gpu_numa_node_files: true,
};
const POWER9_V100: Captured = Captured {
    dir: "power9-6-v100-gpu-numa-nodes",
    gpu_class: Some("0300(VGA)"),
    gpu_numa_node_files: false,
};
const KVM_GUEST: Captured = Captured {
    dir: "kvm-guest-2-vcpus",
    gpu_class: None,
    gpu_numa_node_files: false,
};
const OFFLINE_CPUS: Captured = Captured {
    dir: "x86-2s-offline-cpus-and-node0",
    gpu_class: None,
    gpu_numa_node_files: false,
};

impl Captured {
    fn root(&self) -> PathBuf {
        repo().join("tests/fixtures/sysfs").join(self.dir)
    }

    fn hwloc(&self, file: &str) -> Hwloc {
        let path = self.root().join(file);
        Hwloc::parse(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
    }

    /// hwloc's GPUs in PCI order.
    fn hwloc_gpus(&self, hw: &Hwloc) -> Vec<HwGpu> {
        let Some(class) = self.gpu_class else {
            return Vec::new();
        };
        let mut gpus: Vec<HwGpu> = hw
            .of_kind("PCI")
            .filter(|(_, o)| o.attr("class") == Some(class))
            .map(|(i, o)| HwGpu {
                busid: o.attr("busid").unwrap().to_string(),
                local_cpus: hw.pus(hw.io_locality(i)),
                node: hw.io_node(i),
            })
            .collect();
        gpus.sort_by(|a, b| a.busid.cmp(&b.busid));
        gpus
    }
}

/// A GPU as hwloc places it: the PUs and the NUMA node of the object it hangs off.
struct HwGpu {
    busid: String,
    local_cpus: CpuMask,
    node: Option<usize>,
}

/// What a reader made of a tree, from `topo --json` or from [`Topology`].
struct Seen {
    online: CpuMask,
    /// By node id.
    nodes: BTreeMap<usize, SeenNode>,
    /// By CPU number.
    cpus: BTreeMap<usize, SeenCpu>,
    /// In PCI order.
    gpus: Vec<SeenGpu>,
}

struct SeenNode {
    cpus: CpuMask,
    has_memory: bool,
    /// In node id order.
    distances: Vec<u32>,
}

struct SeenCpu {
    core_id: Option<usize>,
    package_id: Option<usize>,
    node: Option<usize>,
    siblings: CpuMask,
}

struct SeenGpu {
    address: String,
    numa_node: Option<usize>,
    local_cpus: CpuMask,
}

fn list(value: &Value) -> CpuMask {
    mask(
        value
            .as_str()
            .unwrap_or_else(|| panic!("not a cpulist: {value}")),
    )
}

fn index(value: &Value) -> Option<usize> {
    value.as_u64().map(|v| v as usize)
}

fn array(value: &Value) -> &Vec<Value> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {value}"))
}

impl Seen {
    fn from_topo_json(v: &Value) -> Seen {
        let nodes = array(&v["nodes"])
            .iter()
            .map(|n| {
                let node = SeenNode {
                    cpus: list(&n["cpus"]),
                    has_memory: n["has_memory"].as_bool().unwrap(),
                    distances: array(&n["distances"])
                        .iter()
                        .map(|d| d.as_u64().unwrap() as u32)
                        .collect(),
                };
                (index(&n["id"]).unwrap(), node)
            })
            .collect();
        let cpus = array(&v["cpus"])
            .iter()
            .map(|c| {
                let cpu = SeenCpu {
                    core_id: index(&c["core_id"]),
                    package_id: index(&c["package_id"]),
                    node: index(&c["node"]),
                    siblings: list(&c["siblings"]),
                };
                (index(&c["cpu"]).unwrap(), cpu)
            })
            .collect();
        let gpus = array(&v["gpus"])
            .iter()
            .map(|g| SeenGpu {
                address: g["address"].as_str().unwrap().to_string(),
                numa_node: index(&g["numa_node"]),
                local_cpus: list(&g["local_cpus"]),
            })
            .collect();
        Seen {
            online: list(&v["online"]),
            nodes,
            cpus,
            gpus,
        }
    }

    fn from_topology(t: &Topology) -> Seen {
        let nodes = t.nodes.iter().map(|n| {
            let node = SeenNode {
                cpus: n.cpus.clone(),
                has_memory: n.has_memory,
                distances: n.distances.clone(),
            };
            (n.id, node)
        });
        let cpus = t.cpus.iter().map(|c| {
            let cpu = SeenCpu {
                core_id: c.core_id,
                package_id: c.package_id,
                node: t.node_of_cpu(c.id),
                siblings: c.siblings.clone(),
            };
            (c.id, cpu)
        });
        let gpus = t.gpus.iter().map(|g| SeenGpu {
            address: g.address.clone(),
            numa_node: g.numa_node,
            local_cpus: t.gpu_local_cpus(g).cpus,
        });
        Seen {
            online: t.online.clone(),
            nodes: nodes.collect(),
            cpus: cpus.collect(),
            gpus: gpus.collect(),
        }
    }

    /// Distance from node `from` to node `to`, by the row's node-id order.
    fn distance(&self, from: usize, to: usize) -> Option<u32> {
        let position = self.nodes.keys().position(|&id| id == to)?;
        self.nodes[&from].distances.get(position).copied()
    }
}

/// Everything hwloc's output says that the reader must agree with.
fn assert_matches_hwloc(seen: &Seen, host: &Captured, hw: &Hwloc) {
    let what = host.dir;
    assert_eq!(seen.online, hw.all_pus(), "{what}: online CPUs");
    assert!(
        seen.online.intersection(&hw.not_represented).is_empty(),
        "{what}: offline CPUs {} read as online",
        hw.not_represented
    );
    for (id, cpus) in hw.nodes() {
        let node = seen
            .nodes
            .get(&id)
            .unwrap_or_else(|| panic!("{what}: no node {id}"));
        assert_eq!(node.cpus, cpus, "{what}: CPUs of NUMA node {id}");
        for cpu in cpus.iter() {
            assert_eq!(seen.cpus[&cpu].node, Some(id), "{what}: node of CPU {cpu}");
        }
    }
    for (_, o) in hw.of_kind("NUMANode") {
        let id = o.os_index().unwrap();
        let local_memory = o.attr("local").is_some_and(|m| !m.starts_with('0'));
        assert_eq!(
            seen.nodes[&id].has_memory, local_memory,
            "{what}: memory of node {id}"
        );
    }
    for (id, node) in &seen.nodes {
        assert!(
            node.cpus.is_subset(&seen.online),
            "{what}: node {id} lists CPUs [{}] that are not online [{}]",
            node.cpus,
            seen.online
        );
    }
    for (i, package) in hw.of_kind("Package") {
        for cpu in hw.pus(i).iter() {
            assert_eq!(
                seen.cpus[&cpu].package_id,
                package.os_index(),
                "{what}: package of CPU {cpu}"
            );
        }
    }
    for (i, core) in hw.of_kind("Core") {
        let threads = hw.pus(i);
        for cpu in threads.iter() {
            let seen_cpu = &seen.cpus[&cpu];
            assert_eq!(
                seen_cpu.core_id,
                core.os_index(),
                "{what}: core of CPU {cpu}"
            );
            assert_eq!(
                seen_cpu.siblings, threads,
                "{what}: SMT siblings of CPU {cpu}"
            );
        }
    }
    assert_eq!(
        seen.cpus.len(),
        hw.of_kind("PU").count(),
        "{what}: one entry per online CPU"
    );
    let logical_to_id: BTreeMap<usize, usize> = hw
        .of_kind("NUMANode")
        .map(|(_, o)| (o.logical.unwrap(), o.os_index().unwrap()))
        .collect();
    for (a, row) in hw.latency.iter().enumerate() {
        for (b, &d) in row.iter().enumerate() {
            let (from, to) = (logical_to_id[&a], logical_to_id[&b]);
            assert_eq!(
                seen.distance(from, to),
                Some(d),
                "{what}: distance node {from} -> node {to}"
            );
        }
    }
    let gpus = host.hwloc_gpus(hw);
    let addresses: Vec<&str> = seen.gpus.iter().map(|g| g.address.as_str()).collect();
    let expected: Vec<&str> = gpus.iter().map(|g| g.busid.as_str()).collect();
    assert_eq!(addresses, expected, "{what}: GPUs in PCI order");
    for (gpu, hw_gpu) in seen.gpus.iter().zip(&gpus) {
        let address = &gpu.address;
        assert_eq!(
            gpu.local_cpus, hw_gpu.local_cpus,
            "{what}: local CPUs of GPU {address}"
        );
        let expected_node = hw_gpu.node.filter(|_| host.gpu_numa_node_files);
        assert_eq!(
            gpu.numa_node, expected_node,
            "{what}: numa_node of GPU {address}"
        );
    }
}

fn stdout_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `tllm-affinity ARGS` on the captured tree: `TLLM_AFFINITY_SYSFS_ROOT` set, NVML off so that a
/// machine with real GPUs does not answer for the tree.
fn tllm_affinity_on(host: &Captured, args: &[&str]) -> Output {
    clean(cli())
        .args(args)
        .env("TLLM_AFFINITY_SYSFS_ROOT", host.root())
        .env("TLLM_AFFINITY_NVML", "0")
        .output()
        .expect("run tllm-affinity")
}

fn json_on(host: &Captured, args: &[&str]) -> Value {
    let out = tllm_affinity_on(host, args);
    assert!(
        out.status.success(),
        "{args:?} on {}: {:?}\n{}",
        host.dir,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout_of(&out)).unwrap()
}

fn topo_cli_agrees_with_hwloc(host: &Captured) {
    let v = json_on(host, &["topo", "--json"]);
    assert_eq!(v["visible"]["source"], "sysfs", "{v}");
    assert_matches_hwloc(
        &Seen::from_topo_json(&v),
        host,
        &host.hwloc("hwloc.console"),
    );
}

fn library_agrees_with_hwloc(host: &Captured) {
    let t = Topology::read(&SysfsRoot::new(host.root())).unwrap();
    assert_matches_hwloc(&Seen::from_topology(&t), host, &host.hwloc("hwloc.console"));
}

/// `plan --gpu N --cpus <every online CPU>` for each GPU: the GPU CUDA numbers N is hwloc's N-th
/// in PCI order, and the worker set is exactly the CPUs hwloc puts beside it. `--cpus` stands in
/// for a process allowed the whole captured host (this machine has far fewer CPUs).
fn plan_cli_agrees_with_hwloc(host: &Captured) -> Vec<Value> {
    let hw = host.hwloc("hwloc.console");
    let online = hw.all_pus().to_list();
    let gpus = host.hwloc_gpus(&hw);
    assert!(!gpus.is_empty(), "{}: hwloc lists no GPU", host.dir);
    let mut plans = Vec::new();
    for (n, gpu) in gpus.iter().enumerate() {
        let v = json_on(
            host,
            &["plan", "--gpu", &n.to_string(), "--cpus", &online, "--json"],
        );
        assert_eq!(v["gpu"]["address"], gpu.busid.as_str(), "{v}");
        assert_eq!(v["allowed"], online.as_str(), "{v}");
        assert_eq!(list(&v["worker"]["cpus"]), gpu.local_cpus, "{v}");
        let listed: Vec<&str> = array(&v["gpus"])
            .iter()
            .map(|g| g["address"].as_str().unwrap())
            .collect();
        let expected: Vec<&str> = gpus.iter().map(|g| g.busid.as_str()).collect();
        assert_eq!(listed, expected, "{v}");
        plans.push(v);
    }
    plans
}

#[test]
fn x86_gpu_server_topo_matches_hwloc_nodes_packages_smt_and_gpu_locality() {
    topo_cli_agrees_with_hwloc(&X86_GPU_SERVER);
}

#[test]
fn x86_gpu_server_read_by_the_library_matches_hwloc() {
    library_agrees_with_hwloc(&X86_GPU_SERVER);
}

/// All eight GPUs hang off socket 0, whose 8 cores cannot give each a step and a result core:
/// the plan keeps every GPU's worker set on socket 0 and pins no step thread, saying why in
/// numbers hwloc's output gives.
#[test]
fn x86_gpu_server_plan_keeps_every_gpu_on_socket_0_and_pins_no_step_thread() {
    let hw = X86_GPU_SERVER.hwloc("hwloc.console");
    let (package0, _) = hw
        .of_kind("Package")
        .find(|(_, o)| o.os_index() == Some(0))
        .unwrap();
    let cores_on_0 = hw
        .of_kind("Core")
        .filter(|(i, _)| hw.pus(*i).is_subset(&hw.pus(package0)))
        .count();
    let gpus_on_0 = X86_GPU_SERVER
        .hwloc_gpus(&hw)
        .iter()
        .filter(|g| g.node == Some(0))
        .count();
    let why =
        format!("NUMA node 0 has {cores_on_0} allowed core(s) for the {gpus_on_0} GPU(s) on it");
    for v in plan_cli_agrees_with_hwloc(&X86_GPU_SERVER) {
        assert_eq!(v["gpu"]["numa_node"], 0, "{v}");
        let reason = v["placement"]["not_pinned"].as_str().unwrap_or_default();
        assert!(reason.starts_with(&why), "{why}\n{v}");
    }
}

#[test]
fn power9_gpu_memory_nodes_topo_matches_hwloc() {
    topo_cli_agrees_with_hwloc(&POWER9_V100);
}

#[test]
fn power9_gpu_memory_nodes_read_by_the_library_match_hwloc() {
    library_agrees_with_hwloc(&POWER9_V100);
}

/// With hwloc told to keep them, the V100s' memory shows as NUMA nodes 250-255: the reader
/// lists the same node ids, the GPU memory nodes without CPUs and with memory.
#[test]
fn power9_gpu_memory_nodes_are_cpu_less_nodes_with_memory() {
    let kept = POWER9_V100.hwloc("hwloc-kept.console");
    let t = Topology::read(&SysfsRoot::new(POWER9_V100.root())).unwrap();
    let ids: Vec<usize> = t.nodes.iter().map(|n| n.id).collect();
    let mut expected: Vec<usize> = kept
        .of_kind("NUMANode")
        .chain(kept.of_kind("NUMANode(GPUMemory)"))
        .map(|(_, o)| o.os_index().unwrap())
        .collect();
    expected.sort_unstable();
    assert_eq!(ids, expected);
    let gpu_memory: Vec<(usize, &HwObject)> = kept.of_kind("NUMANode(GPUMemory)").collect();
    assert_eq!(gpu_memory.len(), 6);
    for (_, o) in gpu_memory {
        let node = t.node(o.os_index().unwrap()).unwrap();
        assert!(node.cpus.is_empty(), "node {} has CPUs", node.id);
        assert!(node.has_memory, "node {} has memory", node.id);
    }
}

/// The GPUs' only locality file is the hex `local_cpus`, 176 bits in comma-separated groups:
/// each plan's worker set is its socket's online CPUs, as hwloc places it.
#[test]
fn power9_plan_takes_worker_cpus_from_the_hex_local_cpus() {
    for v in plan_cli_agrees_with_hwloc(&POWER9_V100) {
        assert_eq!(v["gpu"]["numa_node"], Value::Null, "{v}");
        assert_eq!(v["worker"]["source"], "the GPU's PCI local_cpulist", "{v}");
    }
}

#[test]
fn kvm_guest_topo_matches_hwloc_and_finds_no_gpu() {
    topo_cli_agrees_with_hwloc(&KVM_GUEST);
}

/// The guest's only display device is an emulated Cirrus VGA (hwloc: `id=1013:00b8`): not an
/// NVIDIA GPU, so `plan` refuses with the hint, and the missing `has_memory` file means memory.
#[test]
fn kvm_guest_read_by_the_library_matches_hwloc_and_plan_finds_no_gpu() {
    library_agrees_with_hwloc(&KVM_GUEST);
    let hw = KVM_GUEST.hwloc("hwloc.console");
    let vga: Vec<&str> = hw
        .of_kind("PCI")
        .filter(|(_, o)| o.attr("class") == Some("0300(VGA)"))
        .map(|(_, o)| o.attr("id").unwrap())
        .collect();
    assert_eq!(vga, ["1013:00b8"]);
    let t = Topology::read(&SysfsRoot::new(KVM_GUEST.root())).unwrap();
    assert!(t.nodes.iter().all(|n| n.has_memory));
    let out = tllm_affinity_on(&KVM_GUEST, &["plan", "--gpu", "0"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    says(&stderr, &["no GPU found on this host"]);
}

#[test]
fn offline_cpus_and_node_topo_matches_hwloc() {
    topo_cli_agrees_with_hwloc(&OFFLINE_CPUS);
}

/// CPUs 0-3 and 21-23 are offline and node 0 with them: no offline CPU is read as online or in a
/// node, node 1 holds exactly the online CPUs of package 1, and package 0's online CPUs are in no
/// node, as hwloc has them.
#[test]
fn offline_cpus_and_node_read_by_the_library_match_hwloc() {
    library_agrees_with_hwloc(&OFFLINE_CPUS);
    let hw = OFFLINE_CPUS.hwloc("hwloc.console");
    assert_eq!(hw.not_represented, mask("0-3,21-23"));
    let t = Topology::read(&SysfsRoot::new(OFFLINE_CPUS.root())).unwrap();
    for cpu in hw.not_represented.iter() {
        assert_eq!(t.node_of_cpu(cpu), None, "offline CPU {cpu} in a node");
    }
    let (package0, _) = hw
        .of_kind("Package")
        .find(|(_, o)| o.os_index() == Some(0))
        .unwrap();
    for cpu in hw.pus(package0).iter() {
        assert_eq!(t.node_of_cpu(cpu), None, "CPU {cpu} of package 0");
    }
}
