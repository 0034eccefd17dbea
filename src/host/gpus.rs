//! Which GPUs this process sees, and from which source (SPEC §4).
//!
//! sysfs is not namespaced: inside a container it lists every GPU of the host, while CUDA's device
//! 0 is the container's first GPU. So the list CUDA numbers into comes, in order, from
//!
//! 1. NVML (what CUDA and pynvml see), when `libnvidia-ml.so.1` loads and answers;
//! 2. the driver's own list, `/proc/driver/nvidia/gpus/<pci>/information`, keeping only the GPUs
//!    whose `/dev/nvidia<minor>` this process may open (the container toolkit hides the other
//!    entries; a device cgroup does not, but refuses the open);
//! 3. sysfs's NVIDIA display and 3D functions, as before.
//!
//! The driver's list and `/dev` are read under the same root as sysfs
//! (`TLLM_AFFINITY_SYSFS_ROOT`), so tests can write them.
//!
//! On GB200, GB300 and GH200 in NUMA mode each GPU's memory is a NUMA node of its own, without
//! CPUs; [`memory_nodes`] names it for `topo`, from NVML, else the driver's `numa_status`.

#![forbid(unsafe_code)]

use crate::host::kernel_text::{hex_number, keyed_value, number_or_unknown};
use crate::host::nvml::{NvmlGpu, NvmlMemoryNode};
use crate::host::topology::{normalize_pci_address, LocalCpus, PciGpu, SysfsRoot, Topology};
use crate::lock::EngineLock;
use crate::mask::CpuMask;
use std::fmt;
use std::fs;

/// Where the visible-GPU list came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuSource {
    Nvml,
    DriverList,
    Sysfs,
}

impl fmt::Display for GpuSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Nvml => "NVML",
            Self::DriverList => "the driver's list (/proc/driver/nvidia/gpus)",
            Self::Sysfs => "sysfs",
        })
    }
}

/// One GPU CUDA can number, in PCI order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostGpu {
    /// Lowercase, with domain: `0000:3b:00.0`.
    pub address: String,
    /// `GPU-...`, when NVML or the driver's list names it.
    pub uuid: Option<String>,
    /// The UUIDs of its MIG instances (NVML only).
    pub migs: Vec<String>,
    /// NVML's CPU affinity for it.
    pub nvml_cpus: Option<CpuMask>,
    /// What NVML says of the NUMA node holding its memory (`nvmlDeviceGetNumaNodeId`).
    pub nvml_memory_node: NvmlMemoryNode,
}

impl HostGpu {
    pub fn from_pci(gpu: &PciGpu) -> Self {
        Self {
            address: gpu.address.clone(),
            uuid: None,
            migs: Vec::new(),
            nvml_cpus: None,
            nvml_memory_node: NvmlMemoryNode::Unknown,
        }
    }
}

/// One entry of `/proc/driver/nvidia/gpus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverGpu {
    pub address: String,
    pub uuid: Option<String>,
    pub minor: Option<u32>,
    /// `/dev/nvidia<minor>` opens for this process.
    pub opens: bool,
    /// The node its `numa_status` names as holding its memory (`None`: no file, or `Node: -1`).
    pub memory_node: Option<usize>,
}

/// The GPUs this process sees, and what each source said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    pub source: GpuSource,
    /// In PCI order.
    pub gpus: Vec<HostGpu>,
    pub sysfs_count: usize,
    /// The driver's entries, `None` when the directory does not exist.
    pub driver: Option<Vec<DriverGpu>>,
    /// Why NVML was not used, `None` when it was (or was not tried, see `nvml_tried`).
    pub nvml_error: Option<String>,
    pub nvml_tried: bool,
}

impl GpuView {
    /// The driver's GPUs this process may open.
    pub fn driver_visible(&self) -> Option<usize> {
        self.driver
            .as_ref()
            .map(|d| d.iter().filter(|g| g.opens).count())
    }

    /// A line when sysfs lists more GPUs than the process sees, e.g. "sysfs lists 8 NVIDIA GPUs,
    /// the driver shows 1: this looks like a container".
    pub fn disagreement(&self) -> Option<String> {
        let (who, seen) = match self.source {
            GpuSource::Nvml => ("NVML", self.gpus.len()),
            GpuSource::DriverList => ("the driver", self.gpus.len()),
            GpuSource::Sysfs => return None,
        };
        (seen != self.sysfs_count).then(|| {
            format!(
                "sysfs lists {} NVIDIA GPU{}, {who} shows {seen}: this looks like a container",
                self.sysfs_count,
                if self.sysfs_count == 1 { "" } else { "s" }
            )
        })
    }
}

/// Parses an `information` file: `GPU UUID:` and `Device Minor:` (other lines are ignored).
pub fn parse_driver_information(text: &str) -> (Option<String>, Option<u32>) {
    let uuid = keyed_value(text, "GPU UUID").filter(|v| !v.is_empty());
    let minor = keyed_value(text, "Device Minor").and_then(|v| v.parse().ok());
    (uuid.map(str::to_string), minor)
}

/// Parses a `numa_status` file: the node its `Node:` line names, `None` for `-1` (the GPU's
/// memory is not a NUMA node) or no such line (other lines are ignored).
pub fn parse_driver_numa_status(text: &str) -> Option<usize> {
    keyed_value(text, "Node")
        .and_then(number_or_unknown)
        .flatten()
}

/// `proc/driver/nvidia/gpus` under `root`; `None` when the directory is absent (no driver, or
/// a sandbox that does not show it).
pub fn read_driver_list(root: &SysfsRoot) -> Option<Vec<DriverGpu>> {
    let dir = root.path("proc/driver/nvidia/gpus");
    let entries = fs::read_dir(&dir).ok()?;
    let mut gpus: Vec<DriverGpu> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let address = normalize_pci_address(&name)?;
            let text = fs::read_to_string(e.path().join("information")).unwrap_or_default();
            let (uuid, minor) = parse_driver_information(&text);
            let numa_status = fs::read_to_string(e.path().join("numa_status")).unwrap_or_default();
            // A GPU whose node this process may not open is not one CUDA can use.
            let opens =
                minor.is_some_and(|m| fs::File::open(root.path(&format!("dev/nvidia{m}"))).is_ok());
            Some(DriverGpu {
                address,
                uuid,
                minor,
                opens,
                memory_node: parse_driver_numa_status(&numa_status),
            })
        })
        .collect();
    gpus.sort_by(|a, b| a.address.cmp(&b.address));
    Some(gpus)
}

/// The view from the three sources: `nvml` is NVML's answer, `None` where it must not be tried
/// (a dedicated worker configured from the constructor).
pub fn view(
    root: &SysfsRoot,
    sysfs: &[PciGpu],
    nvml: Option<Result<Vec<NvmlGpu>, String>>,
) -> GpuView {
    let driver = read_driver_list(root);
    let nvml_tried = nvml.is_some();
    let mut nvml_error = None;
    if let Some(answer) = nvml {
        match answer.and_then(|gpus| from_nvml(&gpus)) {
            Ok(gpus) => {
                return GpuView {
                    source: GpuSource::Nvml,
                    gpus,
                    sysfs_count: sysfs.len(),
                    driver,
                    nvml_error: None,
                    nvml_tried,
                }
            }
            Err(e) => nvml_error = Some(e),
        }
    }
    // An empty driver directory says nothing (a sandbox that mounts it empty); entries that all
    // fail to open say this process has no GPU.
    let from_driver = driver.as_ref().filter(|d| !d.is_empty()).map(|d| {
        d.iter()
            .filter(|g| g.opens)
            .map(|g| HostGpu {
                address: g.address.clone(),
                uuid: g.uuid.clone(),
                migs: Vec::new(),
                nvml_cpus: None,
                nvml_memory_node: NvmlMemoryNode::Unknown,
            })
            .collect::<Vec<_>>()
    });
    let (source, gpus) = match from_driver {
        Some(gpus) => (GpuSource::DriverList, gpus),
        None => (
            GpuSource::Sysfs,
            sysfs.iter().map(HostGpu::from_pci).collect(),
        ),
    };
    GpuView {
        source,
        gpus,
        sysfs_count: sysfs.len(),
        driver,
        nvml_error,
        nvml_tried,
    }
}

/// NVML's GPUs in PCI order with normalised addresses (`00000000:3B:00.0` → `0000:3b:00.0`).
pub fn from_nvml(gpus: &[NvmlGpu]) -> Result<Vec<HostGpu>, String> {
    let mut out = Vec::with_capacity(gpus.len());
    for g in gpus {
        let Some(address) = normalize_nvml_bus_id(&g.bus_id) else {
            return Err(format!("NVML bus id '{}' is not a PCI address", g.bus_id));
        };
        out.push(HostGpu {
            address,
            uuid: Some(g.uuid.clone()),
            migs: g.migs.clone(),
            nvml_cpus: g.cpus.clone(),
            nvml_memory_node: g.numa_node,
        });
    }
    out.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(out)
}

/// NVML's 8-digit domain becomes sysfs's 4 digits when the upper half is zero.
pub fn normalize_nvml_bus_id(bus_id: &str) -> Option<String> {
    let a = normalize_pci_address(bus_id)?;
    let (domain, rest) = a.split_once(':')?;
    let domain = hex_number(domain)?;
    Some(format!("{domain:04x}:{rest}"))
}

/// NVML's answer for this process, asked once: the first `configure`, `plan` or `topo` loads it,
/// later calls reuse the plain data (a fork child too, without touching NVML).
static NVML_ANSWER: EngineLock<Option<Result<Vec<NvmlGpu>, String>>> = EngineLock::new(None);

/// For the engine's fork handlers.
pub fn nvml_lock() -> &'static EngineLock<Option<Result<Vec<NvmlGpu>, String>>> {
    &NVML_ANSWER
}

/// [`crate::host::nvml::query`], once per process. `TLLM_AFFINITY_NVML=0` skips NVML (a host where
/// loading it is unwanted); the answer is then an error saying so.
pub fn nvml_answer() -> Result<Vec<NvmlGpu>, String> {
    if let Some(answer) = NVML_ANSWER.lock().as_ref() {
        return answer.clone();
    }
    // Asked without the lock held: dlopen runs NVML's constructors, which may create threads
    // through our hooks. Two first callers both asking is harmless (NVML counts inits).
    let answer = if std::env::var_os("TLLM_AFFINITY_NVML").is_some_and(|v| v == "0") {
        Err("TLLM_AFFINITY_NVML=0".to_string())
    } else {
        crate::host::nvml::query().map_err(|unusable| {
            if unusable.initialised {
                crate::log_warn!(
                    "NVML initialised but cannot name every GPU it counts ({}): counted as no \
                     NVML; using the driver's list, else sysfs",
                    unusable.reason
                );
            } else {
                crate::log_debug!(
                    "no NVML: {}; using the driver's list, else sysfs",
                    unusable.reason
                );
            }
            unusable.reason
        })
    };
    let mut slot = NVML_ANSWER.lock();
    slot.get_or_insert(answer).clone()
}

/// [`view`] of this process's GPUs, asking NVML (once per process) when `nvml` allows it, with
/// the GPUs it names laid into `topology.gpus` ([`adopt_listed_gpus`]): `configure`, `plan`,
/// `topo` and the step threads' `auto` all call this, so they read one list and one PCI locality.
pub fn current_view(root: &SysfsRoot, topology: &mut Topology, nvml: bool) -> GpuView {
    let view = view(root, &topology.gpus, nvml.then(nvml_answer));
    adopt_listed_gpus(root, topology, &view);
    view
}

/// NVML or the driver's list can name as a GPU a PCI function that sysfs does not show as an
/// NVIDIA display or 3D function (another class, another vendor id). Such a GPU is laid into
/// `topology.gpus` (PCI order) from its own sysfs entry, so its `numa_node` and `local_cpulist`
/// are what the kernel says, as for any GPU. A GPU sysfs does not list at all stays out (NVML's
/// CPU affinity then answers, [`local_cpus`]); a function whose files cannot be read is left out
/// too, since the sysfs GPUs were read without error.
pub fn adopt_listed_gpus(root: &SysfsRoot, topology: &mut Topology, view: &GpuView) {
    let mut adopted = false;
    for gpu in &view.gpus {
        if topology.gpus.iter().any(|g| g.address == gpu.address) {
            continue;
        }
        if let Ok(Some(pci)) = crate::host::topology::read_pci_function(root, &gpu.address) {
            topology.gpus.push(pci);
            adopted = true;
        }
    }
    if adopted {
        topology.gpus.sort_by(|a, b| a.address.cmp(&b.address));
    }
}

/// The CPUs local to `gpu` (SPEC §4): [`Topology::local_cpus`] of its sysfs function (when
/// sysfs lists its address) and NVML's CPU affinity for it. `configure`, `plan`, `topo` and the
/// engine's notes all read a GPU's local CPUs here.
pub fn local_cpus(topology: &Topology, gpu: &HostGpu) -> LocalCpus {
    let pci = topology.gpus.iter().find(|g| g.address == gpu.address);
    topology.local_cpus(pci, gpu.nvml_cpus.as_ref())
}

/// [`local_cpus`] of a GPU sysfs lists, with what `view` (NVML) says of it when the view has it:
/// `topo`'s list of the host's GPUs, visible or not.
pub fn pci_local_cpus(topology: &Topology, view: &GpuView, pci: &PciGpu) -> LocalCpus {
    match view.gpus.iter().find(|g| g.address == pci.address) {
        Some(gpu) => local_cpus(topology, gpu),
        None => local_cpus(topology, &HostGpu::from_pci(pci)),
    }
}

/// Where the node holding a GPU's memory was learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryNodeSource {
    /// `nvmlDeviceGetNumaNodeId`.
    Nvml,
    /// The `Node:` line of `/proc/driver/nvidia/gpus/<bus id>/numa_status`.
    DriverNumaStatus,
}

impl MemoryNodeSource {
    /// The short name `topo --json` gives it.
    pub fn key(self) -> &'static str {
        match self {
            Self::Nvml => "nvml",
            Self::DriverNumaStatus => "numa_status",
        }
    }
}

impl fmt::Display for MemoryNodeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Nvml => "NVML",
            Self::DriverNumaStatus => "the driver's numa_status",
        })
    }
}

/// The CPU-less NUMA node holding a GPU's memory (GB200, GB300, GH200 in NUMA mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemoryNode {
    pub node: usize,
    pub source: MemoryNodeSource,
}

/// For each GPU of `topology.gpus`, the node holding its memory: NVML's
/// `nvmlDeviceGetNumaNodeId` for it (in `view`), else the driver's `numa_status`. Only a node
/// the host has and that has no CPUs counts: such a node is the GPU's memory, never a place for
/// threads. A node with CPUs that NVML names (a driver answering with the GPU's PCI node) is
/// ignored, with a debug line.
pub fn memory_nodes(topology: &Topology, view: &GpuView) -> Vec<Option<GpuMemoryNode>> {
    let cpu_less = |node: usize| {
        topology
            .node(node)
            .is_some_and(|n| n.cpus.intersection(&topology.online).is_empty())
    };
    topology
        .gpus
        .iter()
        .map(|pci| {
            let nvml = view
                .gpus
                .iter()
                .find(|g| g.address == pci.address)
                .and_then(|g| g.nvml_memory_node.node());
            let from_nvml = nvml.filter(|&n| {
                let counts = cpu_less(n);
                if !counts {
                    crate::log_debug!(
                        "NVML names NUMA node {n} as GPU {}'s memory, but that node {}: ignored",
                        pci.address,
                        if topology.node(n).is_some() {
                            "has CPUs"
                        } else {
                            "does not exist"
                        }
                    );
                }
                counts
            });
            let from_driver = || {
                view.driver
                    .iter()
                    .flatten()
                    .find(|d| d.address == pci.address)
                    .and_then(|d| d.memory_node)
                    .filter(|&n| cpu_less(n))
            };
            match from_nvml {
                Some(node) => Some(GpuMemoryNode {
                    node,
                    source: MemoryNodeSource::Nvml,
                }),
                None => from_driver().map(|node| GpuMemoryNode {
                    node,
                    source: MemoryNodeSource::DriverNumaStatus,
                }),
            }
        })
        .collect()
}

/// How a Grace host's driver exposes GPU memory: as CPU-less NUMA nodes (NUMA mode, the
/// driver's default) or not at all (CDMM, driver R580+, the Kubernetes default on GB200/GB300:
/// only the CPU nodes carry memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMemoryMode {
    Numa,
    Cdmm,
}

impl GpuMemoryMode {
    /// The JSON value.
    pub fn key(self) -> &'static str {
        match self {
            GpuMemoryMode::Numa => "numa",
            GpuMemoryMode::Cdmm => "cdmm",
        }
    }
}

impl std::fmt::Display for GpuMemoryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuMemoryMode::Numa => "NUMA mode (each GPU's memory is a CPU-less NUMA node)",
            GpuMemoryMode::Cdmm => {
                "CDMM mode (GPU memory is not onlined as NUMA nodes: only the nodes with CPUs \
                 have memory)"
            }
        })
    }
}

/// Where sysfs shows the MIDR of the first CPU (arm64 only).
const CPU0_MIDR: &str = "sys/devices/system/cpu/cpu0/regs/identification/midr_el1";

/// `midr_el1` names an Arm Neoverse V2 (implementer 0x41, part 0xd4f): Grace's core. GB10's
/// Cortex-X925/A725 and every x86 CPU (which has no such file) are not.
pub fn midr_is_grace(text: &str) -> bool {
    let Some(midr) = hex_number(text.trim()) else {
        return false;
    };
    let implementer = (midr >> 24) & 0xff;
    let part = (midr >> 4) & 0xfff;
    implementer == 0x41 && part == 0xd4f
}

/// The host's CPUs are Grace's, by cpu0's MIDR under `root`.
pub fn cpus_are_grace(root: &SysfsRoot) -> bool {
    fs::read_to_string(root.path(CPU0_MIDR)).is_ok_and(|text| midr_is_grace(&text))
}

/// The mode of a host whose GPUs' memory may be NUMA nodes, from `memory_nodes` (what
/// [`memory_nodes`] found), what NVML said of each GPU's memory node (in `view`), whether the
/// CPUs are Grace's (`grace_cpus`, see [`cpus_are_grace`]) and the kernel's nodes:
///
/// - NUMA mode when a GPU's memory node is known, or when nodes with neither CPUs nor memory
///   (the per-GPU placeholders a Grace host shows) sit beside a CPU-less node with memory;
/// - CDMM when such placeholders exist and no CPU-less node has memory, or, without
///   placeholders, on Grace CPUs where NVML answers NOT_SUPPORTED for every GPU's memory node
///   and the driver's `numa_status` names none (whether CDMM trays keep the placeholders is
///   not settled, so both signs count);
/// - `None` elsewhere (an x86 or a GB10 host, whose NVML also answers NOT_SUPPORTED): there GPU
///   memory is no NUMA node by design, and neither mode applies.
pub fn memory_mode(
    topology: &Topology,
    view: &GpuView,
    memory_nodes: &[Option<GpuMemoryNode>],
    grace_cpus: bool,
) -> Option<GpuMemoryMode> {
    if memory_nodes.iter().any(Option::is_some) {
        return Some(GpuMemoryMode::Numa);
    }
    if topology.gpus.is_empty() {
        return None;
    }
    let cpu_less =
        |n: &&crate::host::topology::NumaNode| n.cpus.intersection(&topology.online).is_empty();
    let placeholders = topology
        .nodes
        .iter()
        .filter(cpu_less)
        .any(|n| !n.has_memory);
    if !placeholders {
        let nvml_says_no_node = topology.gpus.iter().all(|pci| {
            view.gpus.iter().any(|g| {
                g.address == pci.address && g.nvml_memory_node == NvmlMemoryNode::NotSupported
            })
        });
        return (grace_cpus && nvml_says_no_node).then_some(GpuMemoryMode::Cdmm);
    }
    let memory_without_cpus = topology.nodes.iter().filter(cpu_less).any(|n| n.has_memory);
    Some(if memory_without_cpus {
        GpuMemoryMode::Numa
    } else {
        GpuMemoryMode::Cdmm
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::topology::LocalCpuSource;

    fn nv(bus: &str, uuid: &str) -> NvmlGpu {
        NvmlGpu {
            bus_id: bus.to_string(),
            uuid: uuid.to_string(),
            migs: Vec::new(),
            cpus: None,
            numa_node: NvmlMemoryNode::Unknown,
        }
    }

    #[test]
    fn nvml_bus_ids_are_normalised() {
        assert_eq!(
            normalize_nvml_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_nvml_bus_id("00010000:3B:00.0").as_deref(),
            Some("10000:3b:00.0")
        );
        assert_eq!(
            normalize_nvml_bus_id("3b:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(normalize_nvml_bus_id("nonsense"), None);
        let gpus = from_nvml(&[
            nv("00000000:DB:00.0", "GPU-b"),
            nv("00000000:1B:00.0", "GPU-a"),
        ])
        .unwrap();
        let order: Vec<&str> = gpus.iter().map(|g| g.address.as_str()).collect();
        assert_eq!(order, ["0000:1b:00.0", "0000:db:00.0"]);
        assert!(from_nvml(&[nv("bad", "GPU-x")]).is_err());
    }

    #[test]
    fn driver_information_is_parsed() {
        let text = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 17\nGPU UUID: \t GPU-8f3c0a1e-1111-2222-3333-444455556666\nBus Location: \t 0000:18:00.0\nDevice Minor: \t 3\n";
        assert_eq!(
            parse_driver_information(text),
            (
                Some("GPU-8f3c0a1e-1111-2222-3333-444455556666".to_string()),
                Some(3)
            )
        );
        assert_eq!(parse_driver_information("Device Minor: x\n"), (None, None));
    }

    #[test]
    fn disagreement_is_worded_for_a_container() {
        let v = GpuView {
            source: GpuSource::DriverList,
            gpus: vec![HostGpu {
                address: "0000:18:00.0".into(),
                uuid: None,
                migs: vec![],
                nvml_cpus: None,
                nvml_memory_node: NvmlMemoryNode::Unknown,
            }],
            sysfs_count: 8,
            driver: None,
            nvml_error: None,
            nvml_tried: false,
        };
        assert_eq!(
            v.disagreement().unwrap(),
            "sysfs lists 8 NVIDIA GPUs, the driver shows 1: this looks like a container"
        );
        let same = GpuView {
            sysfs_count: 1,
            ..v.clone()
        };
        assert_eq!(same.disagreement(), None);
        let sysfs = GpuView {
            source: GpuSource::Sysfs,
            ..v
        };
        assert_eq!(sysfs.disagreement(), None);
    }

    /// 8 GPUs in sysfs over two nodes, the driver listing 2 of them with device nodes for 1.
    fn container() -> (tempfile::TempDir, SysfsRoot, Topology) {
        let dir = tempfile::tempdir().unwrap();
        crate::host::simulated::dgx_h100_like()
            .driver_gpu(
                "0000:ba:00.0",
                "GPU-aaaa0000-0000-0000-0000-000000000006",
                6,
                true,
            )
            .driver_gpu(
                "0000:18:00.0",
                "GPU-bbbb0000-0000-0000-0000-000000000000",
                0,
                false,
            )
            .write(dir.path())
            .unwrap();
        let root = SysfsRoot::new(dir.path());
        let t = Topology::read(&root).unwrap();
        (dir, root, t)
    }

    #[test]
    fn the_driver_list_counts_only_gpus_whose_node_opens() {
        let (_dir, root, t) = container();
        let v = view(&root, &t.gpus, None);
        assert_eq!(v.source, GpuSource::DriverList);
        assert_eq!(v.gpus.len(), 1);
        assert_eq!(v.gpus[0].address, "0000:ba:00.0");
        assert_eq!(v.driver_visible(), Some(1));
        assert_eq!(v.driver.as_ref().unwrap().len(), 2);
        assert_eq!(
            v.disagreement().unwrap(),
            "sysfs lists 8 NVIDIA GPUs, the driver shows 1: this looks like a container"
        );
        // CUDA device 0 is the container's GPU, local to node 1 (not GPU 0's node 0).
        let local = local_cpus(&t, &v.gpus[0]);
        assert_eq!(local.cpus, t.node(1).unwrap().cpus);
    }

    #[test]
    fn nvml_wins_over_the_driver_and_its_failure_is_kept() {
        let (_dir, root, t) = container();
        let answer = Ok(vec![
            nv("00000000:DB:00.0", "GPU-x"),
            nv("00000000:18:00.0", "GPU-y"),
        ]);
        let v = view(&root, &t.gpus, Some(answer));
        assert_eq!(v.source, GpuSource::Nvml);
        assert_eq!(v.gpus[0].address, "0000:18:00.0");
        assert_eq!(
            v.disagreement().unwrap(),
            "sysfs lists 8 NVIDIA GPUs, NVML shows 2: this looks like a container"
        );
        let v = view(&root, &t.gpus, Some(Err("nvmlInit_v2 returned 9".into())));
        assert_eq!(v.source, GpuSource::DriverList);
        assert_eq!(v.nvml_error.as_deref(), Some("nvmlInit_v2 returned 9"));
    }

    #[test]
    fn nvml_cpus_only_where_sysfs_knows_no_node() {
        let (_dir, _root, t) = container();
        let mut gpu = HostGpu {
            address: "0000:18:00.0".into(),
            uuid: None,
            migs: vec![],
            nvml_cpus: Some(CpuMask::from_cpus([1, 2])),
            nvml_memory_node: NvmlMemoryNode::Unknown,
        };
        // sysfs knows the GPU: its local_cpulist wins.
        assert_eq!(local_cpus(&t, &gpu).source, LocalCpuSource::PciLocalCpulist);
        // sysfs does not list it (a partial tree): NVML's affinity.
        gpu.address = "0000:01:00.0".into();
        let local = local_cpus(&t, &gpu);
        assert_eq!(local.source, LocalCpuSource::NvmlAffinity);
        assert_eq!(local.cpus, CpuMask::from_cpus([1, 2]));
        gpu.nvml_cpus = None;
        assert_eq!(local_cpus(&t, &gpu).source, LocalCpuSource::AllOnline);
    }

    /// A GPU whose `numa_node` is -1 and whose `local_cpulist` names every CPU (a DGX Spark's):
    /// NVML's CPU affinity, for a CUDA device and for topo's list of sysfs's GPUs alike.
    #[test]
    fn nvml_cpus_win_over_an_all_cpu_local_cpulist() {
        let dir = tempfile::tempdir().unwrap();
        crate::host::simulated::dgx_h100_like()
            .gpu("000f:01:00.0", None, None)
            .write(dir.path())
            .unwrap();
        let root = SysfsRoot::new(dir.path());
        let t = Topology::read(&root).unwrap();
        let spark = t.gpu_by_address("000f:01:00.0").unwrap();
        assert_eq!(spark.local_cpus.as_ref(), Some(&t.online));
        let node1 = t.node(1).unwrap().cpus.clone();
        let mut answer = nv("0000000F:01:00.0", "GPU-spark");
        answer.cpus = Some(node1.clone());
        let v = view(&root, &t.gpus, Some(Ok(vec![answer])));
        let nvml = LocalCpus {
            cpus: node1,
            source: LocalCpuSource::NvmlAffinity,
        };
        assert_eq!(local_cpus(&t, &v.gpus[0]), nvml);
        assert_eq!(pci_local_cpus(&t, &v, spark), nvml);
        // A GPU NVML does not show keeps sysfs's answer.
        assert_eq!(
            pci_local_cpus(&t, &v, &t.gpus[0]),
            t.gpu_local_cpus(&t.gpus[0])
        );
        // Without NVML: every CPU, from the list, as before.
        let v = view(&root, &t.gpus, None);
        let local = pci_local_cpus(&t, &v, spark);
        assert_eq!(local.cpus, t.online);
        assert_eq!(local.source, LocalCpuSource::PciLocalCpulist);
    }

    #[test]
    fn numa_status_is_parsed() {
        let text = "Node: 2\nStatus: online\nMemory block size: 0x8000000\n";
        assert_eq!(parse_driver_numa_status(text), Some(2));
        assert_eq!(
            parse_driver_numa_status("Node: -1\nStatus: offline\n"),
            None
        );
        assert_eq!(parse_driver_numa_status("Node: two\n"), None);
        assert_eq!(parse_driver_numa_status(""), None);
    }

    /// Half a GB200 tray: GPUs 0 and 1 on Grace node 0, their memory on CPU-less nodes 2 and 10;
    /// the driver's numa_status names them too (GPU 1's wrongly as node 1, which has CPUs).
    #[test]
    fn a_gpus_memory_node_is_a_cpu_less_node_from_nvml_else_the_driver() {
        use crate::host::simulated::{gb200_like, GB200_GPUS};
        let dir = tempfile::tempdir().unwrap();
        gb200_like(&CpuMask::from_cpus(0..4), &CpuMask::from_cpus(4..8))
            .driver_gpu(GB200_GPUS[0], "GPU-a", 0, true)
            .driver_gpu(GB200_GPUS[1], "GPU-b", 1, true)
            .driver_numa_status(GB200_GPUS[0], 2)
            .driver_numa_status(GB200_GPUS[1], 1)
            .write(dir.path())
            .unwrap();
        let root = SysfsRoot::new(dir.path());
        let t = Topology::read(&root).unwrap();
        let at = |node, source| Some(GpuMemoryNode { node, source });
        let nvml_says = |nodes: [Option<usize>; 2]| {
            let answer = GB200_GPUS
                .iter()
                .zip(nodes)
                .map(|(address, node)| NvmlGpu {
                    numa_node: node.map_or(NvmlMemoryNode::NotSupported, NvmlMemoryNode::Node),
                    ..nv(&format!("0000{address}"), "GPU-x")
                })
                .collect();
            memory_nodes(&t, &view(&root, &t.gpus, Some(Ok(answer))))
        };
        use MemoryNodeSource::{DriverNumaStatus, Nvml};
        assert_eq!(nvml_says([Some(2), Some(10)]), [at(2, Nvml), at(10, Nvml)]);
        // NVML naming a node with CPUs (the GPU's PCI node), or one the host lacks, is ignored:
        // the driver's numa_status answers, and only where it names a CPU-less node.
        assert_eq!(
            nvml_says([Some(0), Some(40)]),
            [at(2, DriverNumaStatus), None]
        );
        // No NVML: the driver's numa_status alone.
        let v = view(&root, &t.gpus, None);
        assert_eq!(memory_nodes(&t, &v), [at(2, DriverNumaStatus), None]);
        assert_eq!(v.driver.as_ref().unwrap()[1].memory_node, Some(1));
    }

    /// A view of `t`'s GPUs as NVML lists them, each memory node answered by `answer`.
    fn nvml_answering(t: &Topology, answer: NvmlMemoryNode) -> GpuView {
        GpuView {
            source: GpuSource::Nvml,
            gpus: t
                .gpus
                .iter()
                .map(|pci| HostGpu {
                    nvml_memory_node: answer,
                    ..HostGpu::from_pci(pci)
                })
                .collect(),
            sysfs_count: t.gpus.len(),
            driver: None,
            nvml_error: None,
            nvml_tried: true,
        }
    }

    /// NUMA mode from named memory nodes, or from a CPU-less node with memory beside
    /// placeholders; CDMM from placeholders alone, or without them on Grace CPUs whose NVML
    /// answers NOT_SUPPORTED for every GPU; no mode on other hosts.
    #[test]
    fn the_memory_mode_of_grace_hosts_and_of_others() {
        use crate::host::simulated::{
            dgx_h100_like, dgx_spark, gb200_like, gb200_tray, gb200_tray_cdmm_without_placeholders,
            GpuMemoryMode,
        };
        use NvmlMemoryNode::{NotSupported, Unknown};
        let unnamed = |t: &Topology| vec![None; t.gpus.len()];
        let mode = |t: &Topology, nvml, grace| {
            memory_mode(t, &nvml_answering(t, nvml), &unnamed(t), grace)
        };
        let t = gb200_like(&CpuMask::from_cpus([0]), &CpuMask::from_cpus([1])).topology();
        assert_eq!(mode(&t, Unknown, true), Some(GpuMemoryMode::Numa));
        let named = [
            Some(GpuMemoryNode {
                node: 2,
                source: MemoryNodeSource::Nvml,
            }),
            None,
        ];
        let v = nvml_answering(&t, Unknown);
        assert_eq!(memory_mode(&t, &v, &named, true), Some(GpuMemoryMode::Numa));
        let t = gb200_tray(GpuMemoryMode::Cdmm).host.topology();
        assert_eq!(mode(&t, Unknown, false), Some(GpuMemoryMode::Cdmm));
        let t = gb200_tray(GpuMemoryMode::Numa).host.topology();
        assert_eq!(mode(&t, Unknown, false), Some(GpuMemoryMode::Numa));
        // Only the Grace nodes: CDMM on Grace CPUs whose NVML says NOT_SUPPORTED, else no mode.
        let t = gb200_tray_cdmm_without_placeholders().host.topology();
        assert_eq!(mode(&t, NotSupported, true), Some(GpuMemoryMode::Cdmm));
        assert_eq!(mode(&t, NotSupported, false), None, "not Grace");
        assert_eq!(mode(&t, Unknown, true), None, "NVML said nothing");
        for t in [dgx_h100_like().topology(), dgx_spark().host.topology()] {
            assert_eq!(mode(&t, NotSupported, false), None);
            assert_eq!(mode(&t, Unknown, false), None);
        }
    }

    #[test]
    fn grace_is_told_by_its_midr() {
        assert!(midr_is_grace("0x00000000410fd4f0\n"));
        assert!(midr_is_grace("0x00000000411fd4f1"), "another revision");
        for other in [
            "0x00000000410fd850\n", // Cortex-X925 (GB10)
            "0x00000000410fd0c1\n", // Neoverse N1
            "0x00000000000fd4f0\n", // part 0xd4f of another implementer
            "",
            "garbage",
        ] {
            assert!(!midr_is_grace(other), "{other:?}");
        }
    }
}
