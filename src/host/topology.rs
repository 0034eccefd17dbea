//! The host model read from a sysfs tree: online CPUs, SMT siblings, NUMA nodes, NVIDIA GPUs and
//! cpuidle states.
//!
//! Every read goes through a [`SysfsRoot`] (like hwloc's `HWLOC_FSROOT`), so tests and demos point
//! it at a tree written by [`crate::host::simulated`] and production uses `/`. Files are parsed
//! leniently about whitespace and trailing newlines, strictly about content: a file that exists
//! but does not say what the kernel would write is a [`TopologyError`] naming the path, never a
//! panic and never a silent guess.

#![forbid(unsafe_code)]

use crate::host::kernel_text::{hex_number, number_or_unknown, numbers, read_if_present};
use crate::mask::CpuMask;
use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// PCI vendor id of NVIDIA.
pub const NVIDIA_VENDOR: u16 = 0x10de;

/// PCI class (base class and subclass, the top 16 of the 24 bits) of a VGA display controller.
pub const PCI_CLASS_VGA: u32 = 0x0300;
/// PCI class of a 3D controller (what datacenter GPUs report).
pub const PCI_CLASS_3D: u32 = 0x0302;

/// The directory that stands for `/` when reading sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysfsRoot(PathBuf);

impl SysfsRoot {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self(path.into())
    }

    /// The root named by `TLLM_AFFINITY_SYSFS_ROOT`; unset or empty means `/`.
    pub fn from_env_value(value: Option<&str>) -> Self {
        match value {
            Some(v) if !v.is_empty() => Self::new(v),
            _ => Self::default(),
        }
    }

    /// `rel` (e.g. `"sys/bus/pci/devices"`, a leading `/` tolerated) under the root.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel.trim_start_matches('/'))
    }

    pub fn root(&self) -> &Path {
        &self.0
    }
}

impl Default for SysfsRoot {
    fn default() -> Self {
        Self::new("/")
    }
}

impl fmt::Display for SysfsRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.display())
    }
}

/// A sysfs file that could not be read or did not hold what the kernel writes there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyError {
    pub path: PathBuf,
    pub problem: String,
}

impl TopologyError {
    fn new(path: &Path, problem: impl Into<String>) -> Self {
        Self {
            path: path.to_path_buf(),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.problem)
    }
}

impl std::error::Error for TopologyError {}

/// One online logical CPU (hardware thread).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cpu {
    pub id: usize,
    pub core_id: Option<usize>,
    pub package_id: Option<usize>,
    /// `thread_siblings_list`: the hardware threads of this CPU's core, itself included.
    pub siblings: CpuMask,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    pub id: usize,
    /// The node's online CPUs: its `cpulist` within `cpu/online`.
    pub cpus: CpuMask,
    /// The node's `distance` row: entry `i` is the distance to the `i`-th node of
    /// [`Topology::nodes`] (node ids ascending, as the kernel writes them).
    pub distances: Vec<u32>,
    /// From `node/has_memory` when the kernel provides it, else assumed.
    pub has_memory: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciGpu {
    /// Lowercase, with domain: `0000:3b:00.0`.
    pub address: String,
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    /// `None` when the kernel says `-1` (no affinity known) or the file is missing.
    pub numa_node: Option<usize>,
    /// `local_cpulist`, else `local_cpus` (hex); `None` when neither exists.
    pub local_cpus: Option<CpuMask>,
}

/// A cpuidle state of CPU 0 (the probe assumes the states are the same on every CPU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuIdleState {
    pub name: String,
    pub latency_us: u64,
    pub disabled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub online: CpuMask,
    /// One entry per online CPU, by id.
    pub cpus: Vec<Cpu>,
    /// By id; a host without `sys/devices/system/node` gets one synthetic node 0.
    pub nodes: Vec<NumaNode>,
    /// NVIDIA display/3D functions, by address.
    pub gpus: Vec<PciGpu>,
    pub idle_states: Vec<CpuIdleState>,
    /// The last-level-cache domains of the online CPUs, by first CPU; empty until
    /// [`Topology::read_llc_domains`] (only slicing needs them, and they cost a walk of every
    /// domain's cache directories), and empty when sysfs does not describe every CPU's caches.
    pub llc_domains: Vec<CpuMask>,
}

/// The CPUs that count as local to a GPU, and where that answer came from (for the log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalCpus {
    pub cpus: CpuMask,
    pub source: LocalCpuSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalCpuSource {
    /// The GPU's own `local_cpulist` (or `local_cpus`).
    PciLocalCpulist,
    /// The `cpulist` of the GPU's NUMA node.
    NumaNode(usize),
    /// The GPU's node has no CPUs (memory-only, GB200-style); the nearest node that has CPUs.
    NearestNodeWithCpus { gpu_node: usize, used_node: usize },
    /// The host has a single NUMA node: every online CPU is local.
    SingleNode,
    /// Nothing says where the GPU is: every online CPU.
    AllOnline,
    /// sysfs knows no node for the GPU (or does not list it): NVML's CPU affinity for it.
    NvmlAffinity,
}

impl fmt::Display for LocalCpuSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PciLocalCpulist => f.write_str("the GPU's PCI local_cpulist"),
            Self::NumaNode(n) => write!(f, "NUMA node {n}"),
            Self::NearestNodeWithCpus {
                gpu_node,
                used_node,
            } => write!(
                f,
                "NUMA node {used_node}, the nearest with CPUs to the GPU's CPU-less node {gpu_node}"
            ),
            Self::SingleNode => f.write_str("every online CPU (single NUMA node host)"),
            Self::AllOnline => f.write_str("every online CPU (the GPU's NUMA node is unknown)"),
            Self::NvmlAffinity => {
                f.write_str("NVML's CPU affinity (sysfs knows no NUMA node for the GPU)")
            }
        }
    }
}

impl Topology {
    /// Reads the whole host model under `root`.
    pub fn read(root: &SysfsRoot) -> Result<Topology, TopologyError> {
        let cpu_dir = root.path("sys/devices/system/cpu");
        let online = read_online(&cpu_dir)?;
        let mut cpus = Vec::with_capacity(online.count());
        for id in online.iter() {
            cpus.push(read_cpu(&cpu_dir, id)?);
        }
        let nodes = read_nodes(root, &online)?;
        let gpus = read_gpus_of_vendor(root, NVIDIA_VENDOR)?;
        let idle_states = read_idle_states(&cpu_dir)?;
        Ok(Topology {
            online,
            cpus,
            nodes,
            gpus,
            idle_states,
            llc_domains: Vec::new(),
        })
    }

    /// Fills [`Topology::llc_domains`] from `cpu/cpuN/cache/index*`: for each CPU, the
    /// `shared_cpu_list` of its cache of the highest `level` (instruction caches aside). One CPU
    /// per domain is read, since the others share its list. A CPU without cache files leaves the
    /// whole answer empty: half a picture would cut slices along domains that are not there.
    pub fn read_llc_domains(&mut self, root: &SysfsRoot) {
        let cpu_dir = root.path("sys/devices/system/cpu");
        let mut covered = CpuMask::new();
        let mut domains = Vec::new();
        for cpu in self.online.iter() {
            if covered.contains(cpu) {
                continue;
            }
            let Some(mut domain) = read_llc_of(&cpu_dir, cpu) else {
                self.llc_domains = Vec::new();
                return;
            };
            domain.insert(cpu);
            // A CPU two lists claim is the first list's: domains stay disjoint.
            let domain = domain.intersection(&self.online).difference(&covered);
            covered = covered.union(&domain);
            domains.push(domain);
        }
        domains.sort_by_key(|d| d.first());
        self.llc_domains = domains;
    }

    pub fn node(&self, id: usize) -> Option<&NumaNode> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The nodes with CPUs, each with its CPUs (a GPU's memory node in NUMA mode has none).
    pub fn nodes_with_cpus(&self) -> Vec<(usize, CpuMask)> {
        self.nodes
            .iter()
            .filter(|n| !n.cpus.is_empty())
            .map(|n| (n.id, n.cpus.clone()))
            .collect()
    }

    pub fn node_of_cpu(&self, cpu: usize) -> Option<usize> {
        self.nodes
            .iter()
            .find(|n| n.cpus.contains(cpu))
            .map(|n| n.id)
    }

    /// Finds a GPU by PCI address, case-insensitively, accepting the short `3b:00.0` form.
    pub fn gpu_by_address(&self, address: &str) -> Option<&PciGpu> {
        let wanted = normalize_pci_address(address)?;
        self.gpus.iter().find(|g| g.address == wanted)
    }

    /// The distinct SMT sibling sets, one per core, ordered by their first CPU.
    pub fn cores(&self) -> Vec<CpuMask> {
        let mut seen = HashSet::new();
        let mut cores: Vec<CpuMask> = self
            .cpus
            .iter()
            .filter(|c| seen.insert(c.siblings.clone()))
            .map(|c| c.siblings.clone())
            .collect();
        cores.sort_by_key(|m| m.first());
        cores
    }

    /// The CPUs local to `gpu` from sysfs alone: [`Topology::local_cpus`] without NVML.
    pub fn gpu_local_cpus(&self, gpu: &PciGpu) -> LocalCpus {
        self.local_cpus(Some(gpu), None)
    }

    /// The CPUs local to a GPU (SPEC §4), always a subset of the online CPUs: `gpu` is its sysfs
    /// function (`None` when sysfs does not list it), `nvml` NVML's CPU affinity for it. The one
    /// decision `configure`, `plan` and `topo` all take (through [`crate::host::gpus::local_cpus`]):
    ///
    /// 1. one NUMA node (or none) → every online CPU ([`LocalCpuSource::SingleNode`]);
    /// 2. a `local_cpulist` that is non-empty and narrower than all online CPUs →
    ///    it ([`LocalCpuSource::PciLocalCpulist`]);
    /// 3. a known `numa_node` whose node has CPUs → that node's CPUs;
    /// 4. a known `numa_node` without CPUs (memory-only, GB200-style) → the CPUs of the nearest
    ///    node that has some, by the GPU node's distance row, ties to the lowest id;
    /// 5. NVML's CPU affinity, where it names an online CPU ([`LocalCpuSource::NvmlAffinity`]);
    /// 6. otherwise a `local_cpulist` naming every online CPU is kept as is (source
    ///    `PciLocalCpulist`), and with no information at all → every online CPU (`AllOnline`).
    ///
    /// A `local_cpulist` equal to every online CPU on a multi-node host is what the kernel writes
    /// when it does not know the device's node (`numa_node` -1: a DGX Spark, some Grace setups),
    /// so it says nothing: a known `numa_node` and NVML's affinity both win over it. Offline CPUs
    /// in any source are dropped, since they cannot be pinned to.
    pub fn local_cpus(&self, gpu: Option<&PciGpu>, nvml: Option<&CpuMask>) -> LocalCpus {
        let found = |cpus: CpuMask, source| LocalCpus { cpus, source };
        if self.nodes.len() <= 1 {
            return found(self.online.clone(), LocalCpuSource::SingleNode);
        }
        let online_part =
            |m: &CpuMask| Some(m.intersection(&self.online)).filter(|m| !m.is_empty());
        let pci = gpu
            .and_then(|g| g.local_cpus.as_ref())
            .and_then(online_part);
        if let Some(cpus) = &pci {
            if *cpus != self.online {
                return found(cpus.clone(), LocalCpuSource::PciLocalCpulist);
            }
        }
        if let Some(n) = gpu.and_then(|g| g.numa_node) {
            if let Some(node) = self.node(n) {
                let cpus = node.cpus.intersection(&self.online);
                if !cpus.is_empty() {
                    return found(cpus, LocalCpuSource::NumaNode(n));
                }
                if let Some((used, cpus)) = self.nearest_node_with_cpus(node) {
                    return found(
                        cpus,
                        LocalCpuSource::NearestNodeWithCpus {
                            gpu_node: n,
                            used_node: used,
                        },
                    );
                }
            }
        }
        if let Some(cpus) = nvml.and_then(online_part) {
            return found(cpus, LocalCpuSource::NvmlAffinity);
        }
        match pci {
            Some(cpus) => found(cpus, LocalCpuSource::PciLocalCpulist),
            None => found(self.online.clone(), LocalCpuSource::AllOnline),
        }
    }

    /// The node with online CPUs closest to `from`; a missing distance counts as farthest.
    fn nearest_node_with_cpus(&self, from: &NumaNode) -> Option<(usize, CpuMask)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.id != from.id)
            .map(|(pos, n)| (pos, n, n.cpus.intersection(&self.online)))
            .filter(|(_, _, cpus)| !cpus.is_empty())
            .min_by_key(|(pos, n, _)| (from.distances.get(*pos).copied().unwrap_or(u32::MAX), n.id))
            .map(|(_, n, cpus)| (n.id, cpus))
    }
}

#[cfg(test)]
impl Topology {
    /// The CPUs local to the `i`-th GPU and where that answer came from, as one pair to compare.
    pub(crate) fn local_cpus_of(&self, i: usize) -> (CpuMask, LocalCpuSource) {
        let local = self.gpu_local_cpus(&self.gpus[i]);
        (local.cpus, local.source)
    }
}

/// `0000:3b:00.0` from `3b:00.0`, `0000:3B:00.0` or ` 0000:3b:00.0 `; `None` when the text is
/// not shaped like a PCI address.
pub fn normalize_pci_address(text: &str) -> Option<String> {
    let lower = text.trim().to_ascii_lowercase();
    let parts: Vec<&str> = lower.split(':').collect();
    let (domain, bus, slot_fn) = match parts.as_slice() {
        [bus, slot_fn] => ("0000", *bus, *slot_fn),
        [domain, bus, slot_fn] => (*domain, *bus, *slot_fn),
        _ => return None,
    };
    let (slot, func) = slot_fn.split_once('.')?;
    let hex = |s: &str, max_len: usize| {
        !s.is_empty() && s.len() <= max_len && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    // Domains above ffff exist (Intel VMD), so the domain may be longer than 4 digits.
    if !(hex(domain, 8) && hex(bus, 2) && hex(slot, 2) && hex(func, 1)) {
        return None;
    }
    Some(format!("{domain:0>4}:{bus:0>2}:{slot:0>2}.{func}"))
}

/// The PCI display (VGA) and 3D controller functions of `vendor` under
/// `sys/bus/pci/devices`, sorted by address. No PCI directory at all means no GPU, not an error.
pub fn read_gpus_of_vendor(root: &SysfsRoot, vendor: u16) -> Result<Vec<PciGpu>, TopologyError> {
    let dir = root.path("sys/bus/pci/devices");
    let mut names = entry_names(&dir)?;
    names.sort();
    let mut gpus = Vec::new();
    for name in names {
        if let Some(gpu) = read_pci_gpu(&dir.join(&name), &name, Some(vendor))? {
            gpus.push(gpu);
        }
    }
    gpus.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(gpus)
}

/// The PCI function at `address` under `sys/bus/pci/devices`, of any vendor and class: a device
/// that NVML or the driver's list names as a GPU although sysfs does not show it as an NVIDIA
/// display or 3D function. `None` when sysfs has no such function.
pub fn read_pci_function(root: &SysfsRoot, address: &str) -> Result<Option<PciGpu>, TopologyError> {
    let Some(name) = normalize_pci_address(address) else {
        return Ok(None);
    };
    let dev = root.path("sys/bus/pci/devices").join(&name);
    if !dev.is_dir() {
        return Ok(None);
    }
    read_pci_gpu(&dev, &name, None)
}

/// One PCI function's directory `dev` named `name`; `None` when it is not a PCI function, or
/// (with `vendor`) not that vendor's display or 3D controller.
fn read_pci_gpu(
    dev: &Path,
    name: &str,
    vendor: Option<u16>,
) -> Result<Option<PciGpu>, TopologyError> {
    // Entries without a vendor file are not PCI functions (nothing else lives here, but a
    // hand-made tree may hold stray files).
    let Some(found_vendor) = read_parsed(&dev.join("vendor"), "a hex vendor id", parse_hex_u16)?
    else {
        return Ok(None);
    };
    let class = read_parsed(&dev.join("class"), "a hex PCI class", parse_hex_u32)?.unwrap_or(0);
    if let Some(vendor) = vendor {
        if found_vendor != vendor || !matches!(class >> 8, PCI_CLASS_VGA | PCI_CLASS_3D) {
            return Ok(None);
        }
    }
    let device = read_parsed(&dev.join("device"), "a hex device id", parse_hex_u16)?.unwrap_or(0);
    let numa_node = read_parsed(
        &dev.join("numa_node"),
        "a node number or -1",
        number_or_unknown,
    )?
    .flatten();
    let local_cpus = match read_cpulist(&dev.join("local_cpulist"))? {
        Some(m) => Some(m),
        None => read_parsed(
            &dev.join("local_cpus"),
            "a hex CPU mask",
            CpuMask::parse_hex,
        )?,
    };
    Ok(Some(PciGpu {
        address: name.to_ascii_lowercase(),
        vendor: found_vendor,
        device,
        class,
        numa_node,
        local_cpus,
    }))
}

fn read_online(cpu_dir: &Path) -> Result<CpuMask, TopologyError> {
    let path = cpu_dir.join("online");
    let online = match read_cpulist(&path)? {
        Some(m) => m,
        // Kernels always have the file; a hand-made tree may only have the cpuN directories.
        None => CpuMask::from_cpus(numbered_entries(cpu_dir, "cpu")?),
    };
    if online.is_empty() {
        return Err(TopologyError::new(
            cpu_dir,
            "no online CPU (the 'online' file is missing or empty and there is no cpuN directory)",
        ));
    }
    Ok(online)
}

fn read_cpu(cpu_dir: &Path, id: usize) -> Result<Cpu, TopologyError> {
    let topo = cpu_dir.join(format!("cpu{id}/topology"));
    let core_id = read_parsed(&topo.join("core_id"), "a core number", number_or_unknown)?.flatten();
    // Some ARM and VM kernels write -1 for the package.
    let package_id = read_parsed(
        &topo.join("physical_package_id"),
        "a package number or -1",
        number_or_unknown,
    )?
    .flatten();
    let mut siblings = read_cpulist(&topo.join("thread_siblings_list"))?.unwrap_or_default();
    siblings.insert(id);
    Ok(Cpu {
        id,
        core_id,
        package_id,
        siblings,
    })
}

/// The `shared_cpu_list` of `cpu`'s highest-level data or unified cache; `None` when sysfs
/// describes none.
fn read_llc_of(cpu_dir: &Path, cpu: usize) -> Option<CpuMask> {
    let cache_dir = cpu_dir.join(format!("cpu{cpu}/cache"));
    let mut best: Option<(u32, CpuMask)> = None;
    for index in numbered_entries(&cache_dir, "index").ok()? {
        let dir = cache_dir.join(format!("index{index}"));
        let level = read_text(&dir.join("level"))
            .ok()??
            .trim()
            .parse::<u32>()
            .ok()?;
        let kind = read_text(&dir.join("type"))
            .ok()
            .flatten()
            .unwrap_or_default();
        if kind.trim() == "Instruction" {
            continue;
        }
        let Ok(Some(shared)) = read_cpulist(&dir.join("shared_cpu_list")) else {
            continue;
        };
        if best.as_ref().is_none_or(|(l, _)| level > *l) {
            best = Some((level, shared));
        }
    }
    best.map(|(_, shared)| shared)
}

fn read_nodes(root: &SysfsRoot, online: &CpuMask) -> Result<Vec<NumaNode>, TopologyError> {
    let dir = root.path("sys/devices/system/node");
    let ids = numbered_entries(&dir, "node")?;
    if ids.is_empty() {
        // Kernels built without NUMA (and some VMs) have no node directory: one node holds all.
        return Ok(vec![NumaNode {
            id: 0,
            cpus: online.clone(),
            distances: vec![10],
            has_memory: true,
        }]);
    }
    let with_memory = read_cpulist(&dir.join("has_memory"))?;
    let mut nodes = Vec::with_capacity(ids.len());
    for id in ids {
        let node_dir = dir.join(format!("node{id}"));
        // A node's cpulist may name CPUs that are not online (powerpc keeps offline CPUs there);
        // they cannot be pinned to.
        let cpus = read_cpulist(&node_dir.join("cpulist"))?
            .unwrap_or_default()
            .intersection(online);
        let distances = read_parsed(&node_dir.join("distance"), "distances", numbers::<u32>)?
            .unwrap_or_default();
        nodes.push(NumaNode {
            id,
            cpus,
            distances,
            has_memory: with_memory.as_ref().is_none_or(|m| m.contains(id)),
        });
    }
    Ok(nodes)
}

fn read_idle_states(cpu_dir: &Path) -> Result<Vec<CpuIdleState>, TopologyError> {
    let dir = cpu_dir.join("cpu0/cpuidle");
    let mut states = Vec::new();
    for n in numbered_entries(&dir, "state")? {
        let state = dir.join(format!("state{n}"));
        let name = read_text(&state.join("name"))?
            .map(|t| t.trim().to_string())
            .unwrap_or_else(|| format!("state{n}"));
        let latency_us =
            read_parsed(&state.join("latency"), "microseconds", |t| t.parse().ok())?.unwrap_or(0);
        let disabled = read_parsed(&state.join("disable"), "0 or 1", |t| t.parse::<u64>().ok())?
            .is_some_and(|d| d != 0);
        states.push(CpuIdleState {
            name,
            latency_us,
            disabled,
        });
    }
    Ok(states)
}

/// The file's text, `None` when it does not exist.
fn read_text(path: &Path) -> Result<Option<String>, TopologyError> {
    read_if_present(path).map_err(|e| TopologyError::new(path, format!("cannot read: {e}")))
}

/// Reads and parses a file (trimmed); `None` when it does not exist, an error naming the path
/// and the text when `parse` rejects it.
fn read_parsed<T>(
    path: &Path,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>, TopologyError> {
    let Some(text) = read_text(path)? else {
        return Ok(None);
    };
    let trimmed = text.trim();
    match parse(trimmed) {
        Some(v) => Ok(Some(v)),
        None => Err(TopologyError::new(
            path,
            format!("expected {expected}, found {trimmed:?}"),
        )),
    }
}

fn read_cpulist(path: &Path) -> Result<Option<CpuMask>, TopologyError> {
    let Some(text) = read_text(path)? else {
        return Ok(None);
    };
    CpuMask::parse_list(&text)
        .map(Some)
        .map_err(|e| TopologyError::new(path, e.to_string()))
}

fn parse_hex_u32(text: &str) -> Option<u32> {
    hex_number(text).and_then(|v| u32::try_from(v).ok())
}

fn parse_hex_u16(text: &str) -> Option<u16> {
    hex_number(text).and_then(|v| u16::try_from(v).ok())
}

/// The names of the entries of `dir` (lossily UTF-8), in the order listed; none when `dir` is
/// missing (sysfs leaves out what a host does not have).
fn entry_names(dir: &Path) -> Result<Vec<String>, TopologyError> {
    let cannot_list = |e: io::Error| TopologyError::new(dir, format!("cannot list: {e}"));
    match fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()
            .map_err(cannot_list),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(cannot_list(e)),
    }
}

/// The numbers `N` of the entries named `<prefix>N` in `dir`, ascending; none when `dir` is
/// missing.
fn numbered_entries(dir: &Path, prefix: &str) -> Result<Vec<usize>, TopologyError> {
    let mut ids = Vec::new();
    for name in entry_names(dir)? {
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
            // No kernel numbers CPUs, nodes or idle states past MAX_CPU; a stray `cpu<huge>`
            // entry must not make a mask allocate gigabytes.
            if let Ok(id) = rest.parse::<usize>() {
                if id <= crate::mask::MAX_CPU {
                    ids.push(id);
                }
            }
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::host::simulated::write_tree_file as put;
    use crate::mask::mask;

    fn put_cpu(root: &Path, id: usize, core: usize, pkg: usize, siblings: &str) {
        let dir = format!("sys/devices/system/cpu/cpu{id}/topology");
        put(root, &format!("{dir}/core_id"), &format!("{core}\n"));
        put(
            root,
            &format!("{dir}/physical_package_id"),
            &format!("{pkg}\n"),
        );
        put(
            root,
            &format!("{dir}/thread_siblings_list"),
            &format!("{siblings}\n"),
        );
    }

    fn put_gpu(root: &Path, addr: &str, numa: &str, local: Option<&str>) {
        let dir = format!("sys/bus/pci/devices/{addr}");
        put(root, &format!("{dir}/vendor"), "0x10de\n");
        put(root, &format!("{dir}/device"), "0x2330\n");
        put(root, &format!("{dir}/class"), "0x030200\n");
        put(root, &format!("{dir}/numa_node"), &format!("{numa}\n"));
        if let Some(local) = local {
            put(root, &format!("{dir}/local_cpulist"), &format!("{local}\n"));
        }
    }

    /// Two nodes of two cores each (SMT pairs 0/4, 1/5 on node 0; 2/6, 3/7 on node 1).
    fn two_node_host(root: &Path) {
        put(root, "sys/devices/system/cpu/online", "0-7\n");
        for c in 0..4 {
            let siblings = format!("{},{}", c, c + 4);
            put_cpu(root, c, c, c / 2, &siblings);
            put_cpu(root, c + 4, c, c / 2, &siblings);
        }
        put_node(root, 0, "0-1,4-5", "10 21");
        put_node(root, 1, "2-3,6-7", "21 10");
    }

    /// NUMA node `node`: its CPU list and its row of distances.
    fn put_node(root: &Path, node: usize, cpulist: &str, distances: &str) {
        let dir = format!("sys/devices/system/node/node{node}");
        put(root, &format!("{dir}/cpulist"), &format!("{cpulist}\n"));
        put(root, &format!("{dir}/distance"), &format!("{distances}\n"));
    }

    fn read(root: &Path) -> Topology {
        Topology::read(&SysfsRoot::new(root)).unwrap()
    }

    #[test]
    fn sysfs_root_paths() {
        assert_eq!(SysfsRoot::default().root(), Path::new("/"));
        assert_eq!(SysfsRoot::from_env_value(None), SysfsRoot::default());
        assert_eq!(SysfsRoot::from_env_value(Some("")), SysfsRoot::default());
        let r = SysfsRoot::from_env_value(Some("/tmp/x"));
        assert_eq!(
            r.path("sys/bus/pci/devices"),
            PathBuf::from("/tmp/x/sys/bus/pci/devices")
        );
        assert_eq!(r.path("/sys/fs"), PathBuf::from("/tmp/x/sys/fs"));
    }

    #[test]
    fn reads_cpus_nodes_and_gpus() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        put(root, "sys/devices/system/node/has_memory", "0-1\n");
        put_gpu(root, "0000:b1:00.0", "1", Some("2-3,6-7"));
        put_gpu(root, "0000:3b:00.0", "0", Some("0-1,4-5"));
        // An ASPEED VGA and an NVIDIA bridge (NVSwitch-like): neither is a GPU of ours.
        put(root, "sys/bus/pci/devices/0000:03:00.0/vendor", "0x1a03\n");
        put(root, "sys/bus/pci/devices/0000:03:00.0/class", "0x030000\n");
        put(root, "sys/bus/pci/devices/0000:05:00.0/vendor", "0x10de\n");
        put(root, "sys/bus/pci/devices/0000:05:00.0/class", "0x068000\n");
        put(
            root,
            "sys/devices/system/cpu/cpu0/cpuidle/state0/name",
            "POLL\n",
        );
        put(
            root,
            "sys/devices/system/cpu/cpu0/cpuidle/state0/latency",
            "0\n",
        );
        put(
            root,
            "sys/devices/system/cpu/cpu0/cpuidle/state1/name",
            "C6\n",
        );
        put(
            root,
            "sys/devices/system/cpu/cpu0/cpuidle/state1/latency",
            "170\n",
        );
        put(
            root,
            "sys/devices/system/cpu/cpu0/cpuidle/state1/disable",
            "1\n",
        );

        let t = read(root);
        assert_eq!(t.online, mask("0-7"));
        assert_eq!(t.cpus.len(), 8);
        assert_eq!(t.cpus[5].core_id, Some(1));
        assert_eq!(t.cpus[5].package_id, Some(0));
        assert_eq!(t.cpus[5].siblings, mask("1,5"));
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[1].cpus, mask("2-3,6-7"));
        assert_eq!(t.nodes[1].distances, vec![21, 10]);
        assert!(t.nodes.iter().all(|n| n.has_memory));
        assert_eq!(t.node_of_cpu(6), Some(1));
        assert_eq!(t.node_of_cpu(9), None);
        let addrs: Vec<_> = t.gpus.iter().map(|g| g.address.as_str()).collect();
        assert_eq!(addrs, ["0000:3b:00.0", "0000:b1:00.0"]);
        assert_eq!(t.gpus[0].vendor, NVIDIA_VENDOR);
        assert_eq!(t.gpus[0].device, 0x2330);
        assert_eq!(t.gpus[0].class, 0x030200);
        assert_eq!(t.gpus[1].numa_node, Some(1));
        assert_eq!(
            t.local_cpus_of(1),
            (mask("2-3,6-7"), LocalCpuSource::PciLocalCpulist)
        );
        assert_eq!(
            t.cores(),
            vec![mask("0,4"), mask("1,5"), mask("2,6"), mask("3,7")]
        );
        assert_eq!(
            t.idle_states,
            vec![
                CpuIdleState {
                    name: "POLL".into(),
                    latency_us: 0,
                    disabled: false
                },
                CpuIdleState {
                    name: "C6".into(),
                    latency_us: 170,
                    disabled: true
                },
            ]
        );
    }

    #[test]
    fn gpu_lookup_by_address_forms() {
        let dir = tempfile::tempdir().unwrap();
        two_node_host(dir.path());
        put_gpu(dir.path(), "0000:3b:00.0", "0", None);
        let t = read(dir.path());
        for form in ["0000:3b:00.0", "3b:00.0", "3B:00.0", " 0000:3B:00.0\n"] {
            assert_eq!(
                t.gpu_by_address(form).map(|g| g.address.as_str()),
                Some("0000:3b:00.0"),
                "{form}"
            );
        }
        assert!(t.gpu_by_address("3c:00.0").is_none());
        assert!(t.gpu_by_address("nonsense").is_none());
        assert_eq!(
            normalize_pci_address("1:2.3").as_deref(),
            Some("0000:01:02.3")
        );
        assert_eq!(normalize_pci_address("3b:00"), None);
    }

    #[test]
    fn cpu_less_node_falls_back_to_the_nearest_node_with_cpus() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        put(root, "sys/devices/system/cpu/online", "0-3\n");
        put_node(root, 0, "0-1", "10 20 40 40");
        put_node(root, 1, "2-3", "20 10 40 40");
        // GB200-style memory-only nodes: node 2 is nearer to node 1, node 3 ties.
        put_node(root, 2, "", "80 40 10 80");
        put_node(root, 3, "", "80 80 80 10");
        put_gpu(root, "0009:01:00.0", "2", Some(""));
        put_gpu(root, "0019:01:00.0", "3", None);
        let t = read(root);
        assert!(t.nodes[2].cpus.is_empty());
        let nearest = |gpu_node, used_node| LocalCpuSource::NearestNodeWithCpus {
            gpu_node,
            used_node,
        };
        assert_eq!(t.local_cpus_of(0), (mask("2-3"), nearest(2, 1)));
        assert_eq!(t.local_cpus_of(1), (mask("0-1"), nearest(3, 0)));
    }

    #[test]
    fn unknown_numa_node() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        // -1 with every CPU local: nothing known, the list is kept.
        put_gpu(root, "0000:01:00.0", "-1", Some("0-7"));
        // -1 and no local CPU files at all.
        put_gpu(root, "0000:02:00.0", "-1", None);
        // -1 but an informative list.
        put_gpu(root, "0000:03:00.0", "-1", Some("2-3,6-7"));
        let t = read(root);
        assert_eq!(t.gpus[0].numa_node, None);
        assert_eq!(
            t.local_cpus_of(0),
            (mask("0-7"), LocalCpuSource::PciLocalCpulist)
        );
        assert_eq!(t.local_cpus_of(1), (mask("0-7"), LocalCpuSource::AllOnline));
        assert_eq!(
            t.local_cpus_of(2),
            (mask("2-3,6-7"), LocalCpuSource::PciLocalCpulist)
        );
    }

    /// NVML's CPU affinity decides only where sysfs knows no node: over an all-CPU
    /// `local_cpulist` of a GPU whose `numa_node` is -1 (the kernel's "unknown"), or for a GPU
    /// sysfs does not list; never over a narrower list or a known node.
    #[test]
    fn nvml_affinity_decides_where_sysfs_knows_no_node() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        put_gpu(root, "0000:01:00.0", "-1", Some("0-7"));
        put_gpu(root, "0000:02:00.0", "-1", None);
        put_gpu(root, "0000:03:00.0", "-1", Some("0-1,4-5"));
        put_gpu(root, "0000:04:00.0", "0", Some("0-7"));
        let t = read(root);
        let node1 = mask("2-3,6-7");
        let with_nvml = |gpu: Option<&PciGpu>, nvml: &CpuMask| {
            let l = t.local_cpus(gpu, Some(nvml));
            (l.cpus, l.source)
        };
        let nvml = (node1.clone(), LocalCpuSource::NvmlAffinity);
        assert_eq!(with_nvml(Some(&t.gpus[0]), &node1), nvml);
        assert_eq!(with_nvml(Some(&t.gpus[1]), &node1), nvml);
        assert_eq!(with_nvml(None, &node1), nvml);
        // Offline CPUs are dropped from NVML's answer; one naming none online says nothing.
        assert_eq!(
            with_nvml(Some(&t.gpus[0]), &mask("3,9")),
            (mask("3"), LocalCpuSource::NvmlAffinity)
        );
        assert_eq!(
            with_nvml(Some(&t.gpus[0]), &mask("9")),
            (mask("0-7"), LocalCpuSource::PciLocalCpulist)
        );
        // sysfs's narrower list and a known node win over NVML.
        assert_eq!(
            with_nvml(Some(&t.gpus[2]), &node1),
            (mask("0-1,4-5"), LocalCpuSource::PciLocalCpulist)
        );
        assert_eq!(
            with_nvml(Some(&t.gpus[3]), &node1),
            (mask("0-1,4-5"), LocalCpuSource::NumaNode(0))
        );
        // Without NVML: as sysfs alone says.
        assert_eq!(
            t.local_cpus(Some(&t.gpus[0]), None),
            t.gpu_local_cpus(&t.gpus[0])
        );
        assert_eq!(
            t.local_cpus(None, None),
            LocalCpus {
                cpus: mask("0-7"),
                source: LocalCpuSource::AllOnline
            }
        );
    }

    #[test]
    fn missing_or_uninformative_local_cpulist_uses_the_numa_node() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        put_gpu(root, "0000:01:00.0", "1", None);
        put_gpu(root, "0000:02:00.0", "1", Some("0-7"));
        // Only the hex form: CPUs 0,1,4,5.
        put_gpu(root, "0000:03:00.0", "1", None);
        put(
            root,
            "sys/bus/pci/devices/0000:03:00.0/local_cpus",
            "00000033\n",
        );
        let t = read(root);
        assert_eq!(t.gpus[0].local_cpus, None);
        for gpu in &t.gpus[..2] {
            let l = t.gpu_local_cpus(gpu);
            assert_eq!(
                (l.cpus, l.source),
                (mask("2-3,6-7"), LocalCpuSource::NumaNode(1))
            );
        }
        assert_eq!(t.gpus[2].local_cpus, Some(mask("0-1,4-5")));
        assert_eq!(
            t.gpu_local_cpus(&t.gpus[2]).source,
            LocalCpuSource::PciLocalCpulist
        );
    }

    #[test]
    fn single_node_host_without_node_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // No online file, no topology files: everything falls back.
        for c in 0..3 {
            fs::create_dir_all(root.join(format!("sys/devices/system/cpu/cpu{c}"))).unwrap();
        }
        fs::create_dir_all(root.join("sys/devices/system/cpu/cpufreq")).unwrap();
        put_gpu(root, "0000:00:1e.0", "-1", Some("0-2"));
        let t = read(root);
        assert_eq!(t.online, mask("0-2"));
        assert_eq!(t.cpus[1].core_id, None);
        assert_eq!(t.cpus[1].package_id, None);
        assert_eq!(t.cpus[1].siblings, mask("1"));
        assert_eq!(t.nodes.len(), 1);
        assert_eq!(t.nodes[0].id, 0);
        assert_eq!(t.nodes[0].cpus, mask("0-2"));
        assert_eq!(t.node_of_cpu(2), Some(0));
        assert_eq!(
            t.local_cpus_of(0),
            (mask("0-2"), LocalCpuSource::SingleNode)
        );
        assert!(t.idle_states.is_empty());
        assert_eq!(t.cores().len(), 3);
    }

    #[test]
    fn memory_less_nodes_are_marked() {
        let dir = tempfile::tempdir().unwrap();
        two_node_host(dir.path());
        put(dir.path(), "sys/devices/system/node/has_memory", "1\n");
        let t = read(dir.path());
        assert!(!t.nodes[0].has_memory);
        assert!(t.nodes[1].has_memory);
    }

    #[test]
    fn offline_cpus_are_not_local() {
        let dir = tempfile::tempdir().unwrap();
        two_node_host(dir.path());
        put(dir.path(), "sys/devices/system/cpu/online", "0-6\n");
        put_gpu(dir.path(), "0000:01:00.0", "1", Some("2-3,6-7"));
        let t = read(dir.path());
        assert_eq!(t.cpus.len(), 7);
        assert_eq!(t.nodes[1].cpus, mask("2-3,6"));
        assert_eq!(t.gpu_local_cpus(&t.gpus[0]).cpus, mask("2-3,6"));
    }

    #[test]
    fn malformed_files_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        put(
            root,
            "sys/devices/system/cpu/cpu3/topology/core_id",
            "three\n",
        );
        let err = Topology::read(&SysfsRoot::new(root)).unwrap_err();
        assert!(err.path.ends_with("cpu3/topology/core_id"), "{err}");
        let text = err.to_string();
        assert!(text.contains("cpu3/topology/core_id"), "{text}");
        assert!(text.contains("\"three\""), "{text}");

        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        put(root, "sys/devices/system/node/node1/cpulist", "2-x\n");
        let err = Topology::read(&SysfsRoot::new(root)).unwrap_err();
        assert!(err.to_string().contains("node1/cpulist"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        two_node_host(root);
        put(root, "sys/bus/pci/devices/0000:01:00.0/vendor", "nvidia\n");
        let err = Topology::read(&SysfsRoot::new(root)).unwrap_err();
        assert!(err.to_string().contains("0000:01:00.0/vendor"), "{err}");
        assert!(err.to_string().contains("hex vendor id"), "{err}");
    }

    #[test]
    fn an_empty_tree_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let err = Topology::read(&SysfsRoot::new(dir.path())).unwrap_err();
        assert!(err.to_string().contains("no online CPU"), "{err}");
    }

    #[test]
    fn reads_this_machine_without_error() {
        // Whatever this host is, reading it must not fail or panic.
        let t = Topology::read(&SysfsRoot::default()).unwrap();
        assert!(!t.online.is_empty());
        assert!(!t.nodes.is_empty());
        for gpu in &t.gpus {
            assert!(!t.gpu_local_cpus(gpu).cpus.is_empty());
        }
    }
}
