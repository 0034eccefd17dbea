//! Writes sysfs trees of made-up hosts, for tests and the demo (`TLLM_AFFINITY_SYSFS_ROOT`).
//!
//! Values are formatted as the kernel writes them, so [`crate::host::topology::Topology::read`] sees a
//! simulated host exactly as it would see a real one.

#![forbid(unsafe_code)]

use crate::host::topology::NVIDIA_VENDOR;
use crate::mask::CpuMask;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::Path;

/// PCI class of a 3D controller (datacenter GPUs).
const CLASS_3D: u32 = 0x030200;
/// H100 SXM device id.
const H100_DEVICE: u16 = 0x2330;
/// ACPI SLIT distances: a node to itself, and the remote default.
const LOCAL_DISTANCE: u32 = 10;
const REMOTE_DISTANCE: u32 = 20;

#[derive(Debug, Clone)]
struct SimCpu {
    core_id: usize,
    package_id: usize,
    siblings: CpuMask,
}

#[derive(Debug, Clone)]
struct SimPci {
    address: String,
    vendor: u16,
    device: u16,
    class: u32,
    numa_node: Option<usize>,
    local_cpus: Option<CpuMask>,
    write_local: bool,
}

/// A host to write as a sysfs tree. CPUs named by a node but not by [`SimulatedHost::cpu`] are
/// each their own core on a package numbered like their node.
#[derive(Debug, Clone, Default)]
pub struct SimulatedHost {
    online: Option<CpuMask>,
    cpus: BTreeMap<usize, SimCpu>,
    nodes: BTreeMap<usize, CpuMask>,
    /// Nodes left out of `has_memory` ([`SimulatedHost::placeholder_node`]).
    without_memory: BTreeSet<usize>,
    distances: Option<Vec<Vec<u32>>>,
    pci: Vec<SimPci>,
    idle_states: Vec<(String, u64)>,
    driver: Vec<SimDriverGpu>,
    /// Last-level-cache domains ([`SimulatedHost::llc_domain`]); a host with none writes no
    /// cache directories.
    llc_domains: Vec<CpuMask>,
    /// Every CPU's `regs/identification/midr_el1` ([`SimulatedHost::midr`]); `None` writes
    /// none, as on x86.
    midr: Option<u64>,
}

/// An entry of the driver's list (`/proc/driver/nvidia/gpus`), and whether its device node is
/// written (a GPU of this container) or not (one the device cgroup or the toolkit withholds).
#[derive(Debug, Clone)]
struct SimDriverGpu {
    address: String,
    uuid: String,
    minor: u32,
    opens: bool,
    /// The `Node:` line of its `numa_status` (`None`: no such file).
    numa_status: Option<i64>,
}

impl SimulatedHost {
    pub fn new() -> Self {
        Self::default()
    }

    /// A NUMA node; an empty `cpus` makes a memory-only node (GB200-style).
    #[must_use]
    pub fn node(mut self, id: usize, cpus: &CpuMask) -> Self {
        self.nodes.insert(id, cpus.clone());
        self
    }

    /// A NUMA node with neither CPUs nor memory: the per-GPU placeholders (ACPI generic
    /// initiators) a GB200 tray shows between its GPUs' memory nodes.
    #[must_use]
    pub fn placeholder_node(mut self, id: usize) -> Self {
        self.nodes.insert(id, CpuMask::new());
        self.without_memory.insert(id);
        self
    }

    #[must_use]
    pub fn cpu(mut self, id: usize, core_id: usize, package_id: usize, siblings: &CpuMask) -> Self {
        let mut siblings = siblings.clone();
        siblings.insert(id);
        self.cpus.insert(
            id,
            SimCpu {
                core_id,
                package_id,
                siblings,
            },
        );
        self
    }

    /// A last-level-cache domain: each of its CPUs gets the kernel's four cache entries (L1 data
    /// and instruction and L2 shared with its SMT siblings, L3 with the whole domain).
    #[must_use]
    pub fn llc_domain(mut self, cpus: &CpuMask) -> Self {
        self.llc_domains.push(cpus.clone());
        self
    }

    /// Overrides the online CPUs (default: every CPU named by a node or [`SimulatedHost::cpu`]).
    #[must_use]
    pub fn online(mut self, cpus: &CpuMask) -> Self {
        self.online = Some(cpus.clone());
        self
    }

    /// An NVIDIA 3D controller. `local_cpus: None` writes what the kernel would: the node's CPUs,
    /// or every online CPU when the node is unknown.
    #[must_use]
    pub fn gpu(
        mut self,
        address: &str,
        numa_node: Option<usize>,
        local_cpus: Option<&CpuMask>,
    ) -> Self {
        self.pci.push(SimPci {
            address: address.to_ascii_lowercase(),
            vendor: NVIDIA_VENDOR,
            device: H100_DEVICE,
            class: CLASS_3D,
            numa_node,
            local_cpus: local_cpus.cloned(),
            write_local: true,
        });
        self
    }

    /// Any other PCI function (no NUMA affinity), e.g. an ASPEED VGA (`0x1a03`, `0x030000`).
    #[must_use]
    pub fn pci_device(self, address: &str, vendor: u16, class: u32) -> Self {
        self.pci_device_on(address, vendor, class, None)
    }

    /// [`Self::pci_device`] on a NUMA node (its `local_cpulist` that node's CPUs), e.g. QEMU's
    /// `pci-testdev` (`0x1b36`, `0x00ff00`) behind a root bridge on node 1.
    #[must_use]
    pub fn pci_device_on(
        mut self,
        address: &str,
        vendor: u16,
        class: u32,
        numa_node: Option<usize>,
    ) -> Self {
        self.pci.push(SimPci {
            address: address.to_ascii_lowercase(),
            vendor,
            device: 0,
            class,
            numa_node,
            local_cpus: None,
            write_local: true,
        });
        self
    }

    /// An entry of the driver's list, `proc/driver/nvidia/gpus/<address>/information`, with
    /// `dev/nvidia<minor>` written when `opens` (the root override prefixes both).
    #[must_use]
    pub fn driver_gpu(mut self, address: &str, uuid: &str, minor: u32, opens: bool) -> Self {
        self.driver.push(SimDriverGpu {
            address: address.to_ascii_lowercase(),
            uuid: uuid.to_string(),
            minor,
            opens,
            numa_status: None,
        });
        self
    }

    /// The driver's `proc/driver/nvidia/gpus/<address>/numa_status` for the entry
    /// [`Self::driver_gpu`] added at `address`: its `Node:` line names `node` (-1: the GPU's
    /// memory is no NUMA node).
    #[must_use]
    pub fn driver_numa_status(mut self, address: &str, node: i64) -> Self {
        let address = address.to_ascii_lowercase();
        for g in self.driver.iter_mut().filter(|g| g.address == address) {
            g.numa_status = Some(node);
        }
        self
    }

    /// The MIDR every CPU's `regs/identification/midr_el1` shows (an arm64 kernel's), or none
    /// (an x86 host's).
    #[must_use]
    pub fn midr(mut self, midr: Option<u64>) -> Self {
        self.midr = midr;
        self
    }

    /// A cpuidle state of CPU 0, in the order they are added.
    #[must_use]
    pub fn idle_state(mut self, name: &str, latency_us: u64) -> Self {
        self.idle_states.push((name.to_string(), latency_us));
        self
    }

    /// The distance matrix, rows and columns by ascending node id (default 10 local, 20 remote).
    #[must_use]
    pub fn node_distances(mut self, distances: Vec<Vec<u32>>) -> Self {
        self.distances = Some(distances);
        self
    }

    /// Writes neither `local_cpulist` nor `local_cpus` for the function at `address`, so readers
    /// must fall back to its `numa_node`.
    #[must_use]
    pub fn without_local_cpulist(mut self, address: &str) -> Self {
        let address = address.to_ascii_lowercase();
        for dev in self.pci.iter_mut().filter(|d| d.address == address) {
            dev.write_local = false;
        }
        self
    }

    /// The CPUs the tree will list as online.
    pub fn online_cpus(&self) -> CpuMask {
        self.online.clone().unwrap_or_else(|| {
            self.nodes
                .values()
                .fold(CpuMask::from_cpus(self.cpus.keys().copied()), |acc, m| {
                    acc.union(m)
                })
        })
    }

    /// The GPU addresses, in PCI order.
    pub fn gpu_addresses(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .pci
            .iter()
            .filter(|d| d.vendor == NVIDIA_VENDOR && d.class == CLASS_3D)
            .map(|d| d.address.clone())
            .collect();
        out.sort();
        out
    }

    /// Creates the tree under `root` (which must exist or be creatable); existing files are
    /// overwritten.
    pub fn write(&self, root: &Path) -> io::Result<()> {
        let online = self.online_cpus();
        let all_cpus = self.cpus.keys().fold(online.clone(), |mut acc, &c| {
            acc.insert(c);
            acc
        });
        let nr_cpu_ids = all_cpus.last().map_or(1, |c| c + 1);

        let cpu_dir = root.join("sys/devices/system/cpu");
        let list = |m: &CpuMask| format!("{}\n", m.to_list());
        put(&cpu_dir.join("online"), &list(&online))?;
        put(&cpu_dir.join("possible"), &list(&all_cpus))?;
        put(&cpu_dir.join("present"), &list(&all_cpus))?;
        for id in all_cpus.iter() {
            let cpu = self.cpus.get(&id).cloned().unwrap_or_else(|| SimCpu {
                core_id: id,
                package_id: self.node_of(id).unwrap_or(0),
                siblings: CpuMask::from_cpus([id]),
            });
            let topo = cpu_dir.join(format!("cpu{id}/topology"));
            put(&topo.join("core_id"), &format!("{}\n", cpu.core_id))?;
            put(
                &topo.join("physical_package_id"),
                &format!("{}\n", cpu.package_id),
            )?;
            put(&topo.join("thread_siblings_list"), &list(&cpu.siblings))?;
            if let Some(midr) = self.midr {
                let identification = cpu_dir.join(format!("cpu{id}/regs/identification"));
                put(
                    &identification.join("midr_el1"),
                    &format!("0x{midr:016x}\n"),
                )?;
            }
            if let Some(domain) = self.llc_domains.iter().find(|d| d.contains(id)) {
                let cache = cpu_dir.join(format!("cpu{id}/cache"));
                let entries = [
                    (1, "Data", &cpu.siblings),
                    (1, "Instruction", &cpu.siblings),
                    (2, "Unified", &cpu.siblings),
                    (3, "Unified", domain),
                ];
                for (index, (level, kind, shared)) in entries.into_iter().enumerate() {
                    let dir = cache.join(format!("index{index}"));
                    put(&dir.join("level"), &format!("{level}\n"))?;
                    put(&dir.join("type"), &format!("{kind}\n"))?;
                    put(&dir.join("shared_cpu_list"), &list(shared))?;
                }
            }
            put(&topo.join("core_cpus_list"), &list(&cpu.siblings))?;
            put(
                &topo.join("thread_siblings"),
                &format!("{}\n", cpu.siblings.to_hex(nr_cpu_ids)),
            )?;
        }
        for (n, (name, latency)) in self.idle_states.iter().enumerate() {
            let state = cpu_dir.join(format!("cpu0/cpuidle/state{n}"));
            put(&state.join("name"), &format!("{name}\n"))?;
            put(&state.join("desc"), &format!("{name}\n"))?;
            put(&state.join("latency"), &format!("{latency}\n"))?;
            put(&state.join("disable"), "0\n")?;
        }

        if !self.nodes.is_empty() {
            self.write_nodes(root, nr_cpu_ids)?;
        }

        let pci_dir = root.join("sys/bus/pci/devices");
        fs::create_dir_all(&pci_dir)?;
        for dev in &self.pci {
            let dir = pci_dir.join(&dev.address);
            put(&dir.join("vendor"), &format!("0x{:04x}\n", dev.vendor))?;
            put(&dir.join("device"), &format!("0x{:04x}\n", dev.device))?;
            put(&dir.join("class"), &format!("0x{:06x}\n", dev.class))?;
            let numa = dev.numa_node.map_or("-1".to_string(), |n| n.to_string());
            put(&dir.join("numa_node"), &format!("{numa}\n"))?;
            if dev.write_local {
                let local = dev.local_cpus.clone().unwrap_or_else(|| {
                    dev.numa_node
                        .and_then(|n| self.nodes.get(&n).cloned())
                        .unwrap_or_else(|| online.clone())
                });
                put(&dir.join("local_cpulist"), &list(&local))?;
                put(
                    &dir.join("local_cpus"),
                    &format!("{}\n", local.to_hex(nr_cpu_ids)),
                )?;
            }
        }
        Ok(())
    }

    fn write_nodes(&self, root: &Path, nr_cpu_ids: usize) -> io::Result<()> {
        let node_dir = root.join("sys/devices/system/node");
        let ids: Vec<usize> = self.nodes.keys().copied().collect();
        let n = ids.len();
        let distances = match &self.distances {
            Some(d) if d.len() != n || d.iter().any(|row| row.len() != n) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("node_distances must be {n}x{n}, one row and column per node"),
                ))
            }
            Some(d) => d.clone(),
            None => (0..n)
                .map(|i| {
                    (0..n)
                        .map(|j| {
                            if i == j {
                                LOCAL_DISTANCE
                            } else {
                                REMOTE_DISTANCE
                            }
                        })
                        .collect()
                })
                .collect(),
        };
        let id_list = format!("{}\n", CpuMask::from_cpus(ids.iter().copied()).to_list());
        let with_cpus: CpuMask = self
            .nodes
            .iter()
            .filter(|(_, cpus)| !cpus.is_empty())
            .map(|(&id, _)| id)
            .collect();
        put(&node_dir.join("online"), &id_list)?;
        put(&node_dir.join("possible"), &id_list)?;
        let with_memory = CpuMask::from_cpus(
            ids.iter()
                .copied()
                .filter(|id| !self.without_memory.contains(id)),
        );
        let memory_list = format!("{}\n", with_memory.to_list());
        put(&node_dir.join("has_memory"), &memory_list)?;
        put(&node_dir.join("has_normal_memory"), &memory_list)?;
        put(
            &node_dir.join("has_cpu"),
            &format!("{}\n", with_cpus.to_list()),
        )?;
        for (pos, (id, cpus)) in self.nodes.iter().enumerate() {
            let dir = node_dir.join(format!("node{id}"));
            put(&dir.join("cpulist"), &format!("{}\n", cpus.to_list()))?;
            put(
                &dir.join("cpumap"),
                &format!("{}\n", cpus.to_hex(nr_cpu_ids)),
            )?;
            let row: Vec<String> = distances[pos].iter().map(u32::to_string).collect();
            put(&dir.join("distance"), &format!("{}\n", row.join(" ")))?;
        }
        for g in &self.driver {
            // The layout the driver writes (tabs and all), trimmed to the lines that matter.
            put(
                &root.join(format!("proc/driver/nvidia/gpus/{}/information", g.address)),
                &format!(
                    "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t {}\n\
                     Bus Type: \t PCIe\nBus Location: \t {}\nDevice Minor: \t {}\n\
                     GPU Excluded:\t No\n",
                    g.uuid, g.address, g.minor
                ),
            )?;
            if let Some(node) = g.numa_status {
                // The first lines the driver writes; the memory block lines after them differ.
                put(
                    &root.join(format!("proc/driver/nvidia/gpus/{}/numa_status", g.address)),
                    &format!("Node: {node}\nStatus: online\n"),
                )?;
            }
            if g.opens {
                put(&root.join(format!("dev/nvidia{}", g.minor)), "")?;
            }
        }
        Ok(())
    }

    fn node_of(&self, cpu: usize) -> Option<usize> {
        self.nodes
            .iter()
            .find(|(_, cpus)| cpus.contains(cpu))
            .map(|(&id, _)| id)
    }
}

/// Two NUMA nodes over the CPUs this process may use, so the demo runs on a small real machine:
/// node 0 takes the lower half of `allowed`, node 1 the rest, each CPU its own core. GPU
/// `0000:3b:00.0` (CUDA device 0) is local to node 1 and `0000:86:00.0` (device 1) to node 0.
/// With one allowed CPU the host has a single node holding it (and both GPUs).
pub fn two_node_one_gpu(allowed: &CpuMask) -> SimulatedHost {
    let cpus: Vec<usize> = allowed.iter().collect();
    let mut host = SimulatedHost::new();
    if cpus.len() < 2 {
        for &c in &cpus {
            host = host.cpu(c, c, 0, &CpuMask::from_cpus([c]));
        }
        return host
            .node(0, allowed)
            .gpu("0000:3b:00.0", Some(0), None)
            .gpu("0000:86:00.0", Some(0), None);
    }
    let half = cpus.len() / 2;
    let node0 = CpuMask::from_cpus(cpus[..half].iter().copied());
    let node1 = CpuMask::from_cpus(cpus[half..].iter().copied());
    for (i, &c) in cpus.iter().enumerate() {
        host = host.cpu(c, c, usize::from(i >= half), &CpuMask::from_cpus([c]));
    }
    host.node(0, &node0)
        .node(1, &node1)
        .node_distances(vec![vec![10, 21], vec![21, 10]])
        .gpu("0000:3b:00.0", Some(1), None)
        .gpu("0000:86:00.0", Some(0), None)
}

/// `cores` cores in sockets of `cores_per_socket`, two threads a core, numbered as Linux numbers
/// Intel and AMD hosts: CPU `c` and `c + cores` share a core.
fn smt_sockets(cores: usize, cores_per_socket: usize) -> SimulatedHost {
    let mut host = SimulatedHost::new();
    for core in 0..cores {
        let siblings = CpuMask::from_cpus([core, core + cores]);
        let socket = core / cores_per_socket;
        let core_id = core % cores_per_socket;
        host = host.cpu(core, core_id, socket, &siblings).cpu(
            core + cores,
            core_id,
            socket,
            &siblings,
        );
    }
    host
}

/// The CPUs of the cores `range` of an [`smt_sockets`] host of `cores` cores, siblings included.
fn with_siblings(range: std::ops::Range<usize>, cores: usize) -> CpuMask {
    CpuMask::from_cpus(range.clone().chain(range.map(|c| c + cores)))
}

/// `host` with the GPUs `gpus_by_node[n]` (PCI addresses) on NUMA node `n`.
fn with_gpus_by_node(mut host: SimulatedHost, gpus_by_node: [[&str; 4]; 2]) -> SimulatedHost {
    for (node, addrs) in gpus_by_node.into_iter().enumerate() {
        for addr in addrs {
            host = host.gpu(addr, Some(node), None);
        }
    }
    host
}

/// A DGX H100-like host: 2 sockets × 56 cores × 2 threads (224 CPUs, Linux-on-Intel numbering:
/// CPU `c` and `c + 112` share a core), one NUMA node per socket, 4 GPUs per node, an ASPEED BMC
/// VGA and an NVSwitch-like NVIDIA bridge (neither is a GPU), and the usual Intel idle states.
pub fn dgx_h100_like() -> SimulatedHost {
    const CORES: usize = 112;
    const CORES_PER_SOCKET: usize = 56;
    let mut host = smt_sockets(CORES, CORES_PER_SOCKET);
    let socket_cpus =
        |s: usize| with_siblings(s * CORES_PER_SOCKET..(s + 1) * CORES_PER_SOCKET, CORES);
    // One L3 per socket (Sapphire Rapids without sub-NUMA clustering).
    host = host
        .node(0, &socket_cpus(0))
        .node(1, &socket_cpus(1))
        .llc_domain(&socket_cpus(0))
        .llc_domain(&socket_cpus(1))
        .node_distances(vec![vec![10, 21], vec![21, 10]]);
    let gpus_by_node = [
        [
            "0000:18:00.0",
            "0000:2a:00.0",
            "0000:3a:00.0",
            "0000:5d:00.0",
        ],
        [
            "0000:9a:00.0",
            "0000:ab:00.0",
            "0000:ba:00.0",
            "0000:db:00.0",
        ],
    ];
    host = with_gpus_by_node(host, gpus_by_node);
    host.pci_device("0000:03:00.0", 0x1a03, 0x030000)
        .pci_device("0000:05:00.0", NVIDIA_VENDOR, 0x068000)
        .idle_state("POLL", 0)
        .idle_state("C1", 2)
        .idle_state("C1E", 10)
        .idle_state("C6", 170)
}

/// An AMD EPYC host (Genoa-like, NPS1): 2 sockets × 64 cores × 2 threads (256 CPUs, CPU `c` and
/// `c + 128` share a core), one NUMA node per socket, each socket 8 CCDs of 8 cores with an L3 of
/// their own (16 CPUs per domain), and 4 GPUs per node.
pub fn amd_epyc_like() -> SimulatedHost {
    const CORES: usize = 128;
    const CORES_PER_SOCKET: usize = 64;
    const CORES_PER_CCD: usize = 8;
    let mut host = smt_sockets(CORES, CORES_PER_SOCKET);
    let cores_with_siblings = |cores: std::ops::Range<usize>| with_siblings(cores, CORES);
    for ccd in 0..CORES / CORES_PER_CCD {
        host = host.llc_domain(&cores_with_siblings(
            ccd * CORES_PER_CCD..(ccd + 1) * CORES_PER_CCD,
        ));
    }
    host = host
        .node(0, &cores_with_siblings(0..CORES_PER_SOCKET))
        .node(1, &cores_with_siblings(CORES_PER_SOCKET..CORES))
        .node_distances(vec![vec![10, 32], vec![32, 10]]);
    let gpus_by_node = [
        [
            "0000:05:00.0",
            "0000:15:00.0",
            "0000:65:00.0",
            "0000:75:00.0",
        ],
        [
            "0000:85:00.0",
            "0000:95:00.0",
            "0000:e5:00.0",
            "0000:f5:00.0",
        ],
    ];
    with_gpus_by_node(host, gpus_by_node)
}

/// Half a GB200 tray in NUMA mode: Grace nodes 0 and 1 on `node0` and `node1`, GPUs
/// `0008:06:00.0` and `0009:06:00.0` on node 0 (PCI `numa_node` 0), each GPU's memory a CPU-less
/// node of its own with the tray's sparse ids, 2 and 10, and the placeholder nodes 3-9 between
/// them (neither CPUs nor memory). The GPUs' memory nodes are known to NVML and the driver, not
/// to sysfs: tests give them through the NVML double or [`Self::driver_numa_status`].
pub fn gb200_like(node0: &CpuMask, node1: &CpuMask) -> SimulatedHost {
    let mut host = SimulatedHost::new()
        .node(0, node0)
        .node(1, node1)
        .node(2, &CpuMask::new())
        .node(10, &CpuMask::new());
    for placeholder in 3..=9 {
        host = host.placeholder_node(placeholder);
    }
    host.gpu(GB200_GPUS[0], Some(0), None)
        .gpu(GB200_GPUS[1], Some(0), None)
}

/// The PCI addresses of [`gb200_like`]'s GPUs, in PCI order.
pub const GB200_GPUS: [&str; 2] = ["0008:06:00.0", "0009:06:00.0"];

pub use crate::host::gpus::GpuMemoryMode;

/// Grace's MIDR: Arm (0x41), Neoverse V2 (part 0xd4f), r0p0.
pub const GRACE_MIDR: u64 = 0x410f_d4f0;
/// GB10's first cores' MIDR: Arm, Cortex-X925 (part 0xd85), r0p0.
pub const GB10_MIDR: u64 = 0x410f_d850;

/// Which CPU-less nodes a [`grace_host`] shows for its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GpuNodes {
    /// Eight per GPU: its memory node (an empty placeholder in CDMM) and seven placeholders.
    EightPerGpu,
    /// None: only the Grace nodes (a CDMM tray whose kernel shows no placeholders).
    None,
}

/// One GPU of a [`GraceHost`], as the driver and NVML describe it.
#[derive(Debug, Clone)]
pub struct GraceGpu {
    /// Its PCI address (lower case, as sysfs names it).
    pub address: String,
    pub uuid: String,
    /// Its PCI device's `numa_node`: the Grace node it hangs off, `None` for -1 (GB10).
    pub pci_node: Option<usize>,
    /// NVML's CPU affinity (`nvidia-smi topo -m`'s "CPU Affinity"): its Grace node's CPUs.
    pub nvml_cpus: CpuMask,
    /// The node holding its memory (`nvmlDeviceGetNumaNodeId`, the driver's `numa_status`,
    /// `nvidia-smi`'s "GPU NUMA ID"); `None` in CDMM mode and on GB10.
    pub memory_node: Option<usize>,
}

/// A Grace host at full scale: the sysfs tree (with the driver's list under the same root) and
/// what NVML says of each GPU. Shapes from public sources: 72 Neoverse V2 cores per Grace
/// socket, no SMT; each GPU's memory a CPU-less node in NUMA mode, with per-GPU placeholder
/// nodes (neither CPUs nor memory) after it.
#[derive(Debug, Clone)]
pub struct GraceHost {
    pub name: &'static str,
    pub host: SimulatedHost,
    pub gpus: Vec<GraceGpu>,
    /// `None` where GPU memory is no NUMA node by design (GB10's unified memory).
    pub mode: Option<GpuMemoryMode>,
}

/// CPUs per Grace socket.
pub const GRACE_CPUS: usize = 72;

/// The CPUs of Grace socket `socket`: `72 * socket` to `72 * socket + 71`.
pub fn grace_socket_cpus(socket: usize) -> CpuMask {
    CpuMask::from_cpus(socket * GRACE_CPUS..(socket + 1) * GRACE_CPUS)
}

/// Grace nodes 0, 1, ... on `sockets`' CPUs (Grace's MIDR), then with [`GpuNodes::EightPerGpu`]
/// for each GPU eight CPU-less nodes from `first_gpu_node`: the first holds its memory in NUMA
/// mode (an empty placeholder in CDMM), the other seven are placeholders. GPU `g` (of
/// `addresses`) hangs off socket `socket_of(g)`.
fn grace_host(
    name: &'static str,
    sockets: &[CpuMask],
    (first_gpu_node, gpu_nodes): (usize, GpuNodes),
    addresses: &[&str],
    socket_of: impl Fn(usize) -> usize,
    mode: GpuMemoryMode,
) -> GraceHost {
    let mut host = SimulatedHost::new().midr(Some(GRACE_MIDR));
    // One L3 (the SCF cache) per Grace socket.
    for (socket, cpus) in sockets.iter().enumerate() {
        host = host.node(socket, cpus).llc_domain(cpus);
    }
    let mut gpus = Vec::new();
    for (g, address) in addresses.iter().enumerate() {
        let memory = first_gpu_node + 8 * g;
        if gpu_nodes == GpuNodes::EightPerGpu {
            host = match mode {
                GpuMemoryMode::Numa => host.node(memory, &CpuMask::new()),
                GpuMemoryMode::Cdmm => host.placeholder_node(memory),
            };
            for placeholder in memory + 1..memory + 8 {
                host = host.placeholder_node(placeholder);
            }
        }
        let socket = socket_of(g);
        let uuid = format!("GPU-9a{g:06x}-0000-0000-0000-{:012x}", sockets.len());
        host = host
            .gpu(address, Some(socket), None)
            .driver_gpu(address, &uuid, g as u32, true);
        // In CDMM mode the driver's numa_status names no node.
        host = host.driver_numa_status(
            address,
            match mode {
                GpuMemoryMode::Numa => memory as i64,
                GpuMemoryMode::Cdmm => -1,
            },
        );
        gpus.push(GraceGpu {
            address: address.to_string(),
            uuid,
            pci_node: Some(socket),
            nvml_cpus: sockets[socket].clone(),
            memory_node: (mode == GpuMemoryMode::Numa).then_some(memory),
        });
    }
    GraceHost {
        name,
        host,
        gpus,
        mode: Some(mode),
    }
}

/// The PCI addresses of a GB200/GB300 compute tray's four GPUs (GB300's, as `nvidia-smi`
/// shows them): the first two on Grace node 0, the others on node 1.
pub const TRAY_GPUS: [&str; 4] = [
    "0008:06:00.0",
    "0009:06:00.0",
    "0018:06:00.0",
    "0019:06:00.0",
];

/// A GB200 compute tray: Grace nodes 0 (CPUs 0-71) and 1 (72-143), GPUs 0-1 on node 0 and 2-3
/// on node 1; in NUMA mode their memory on nodes 2, 10, 18, 26 and placeholders 3-9, 11-17,
/// 19-25, 27-33 (34 nodes); in CDMM mode the same 34 nodes, none of the GPUs' with memory.
pub fn gb200_tray(mode: GpuMemoryMode) -> GraceHost {
    let name = match mode {
        GpuMemoryMode::Numa => "GB200 tray, NUMA mode",
        GpuMemoryMode::Cdmm => "GB200 tray, CDMM mode",
    };
    let sockets = [grace_socket_cpus(0), grace_socket_cpus(1)];
    grace_host(
        name,
        &sockets,
        (2, GpuNodes::EightPerGpu),
        &TRAY_GPUS,
        |g| g / 2,
        mode,
    )
}

/// A GB200 tray in CDMM mode whose kernel shows only Grace nodes 0 (CPUs 0-71) and 1 (72-143):
/// no placeholder nodes, NVML's NUMA-node query unsupported and the driver's `numa_status`
/// naming no node; only Grace's MIDR tells it from an x86 host of the same layout.
pub fn gb200_tray_cdmm_without_placeholders() -> GraceHost {
    let sockets = [grace_socket_cpus(0), grace_socket_cpus(1)];
    grace_host(
        "GB200 tray, CDMM mode, no placeholder nodes",
        &sockets,
        (2, GpuNodes::None),
        &TRAY_GPUS,
        |g| g / 2,
        GpuMemoryMode::Cdmm,
    )
}

/// A GB200 tray in NUMA mode (34 nodes, four GPUs) whose Grace nodes hold `node0` and `node1`:
/// the tray's shape over the CPUs a machine or guest has, so that its masks are applied for real.
pub fn gb200_tray_over(node0: &CpuMask, node1: &CpuMask) -> GraceHost {
    let sockets = [node0.clone(), node1.clone()];
    let name = "GB200 tray over this machine's CPUs";
    grace_host(
        name,
        &sockets,
        (2, GpuNodes::EightPerGpu),
        &TRAY_GPUS,
        |g| g / 2,
        GpuMemoryMode::Numa,
    )
}

/// A GB300 compute tray in NUMA mode: the GB200 tray's shape at GB300's bus ids.
pub fn gb300_tray() -> GraceHost {
    let sockets = [grace_socket_cpus(0), grace_socket_cpus(1)];
    let numa = GpuMemoryMode::Numa;
    grace_host(
        "GB300 tray",
        &sockets,
        (2, GpuNodes::EightPerGpu),
        &TRAY_GPUS,
        |g| g / 2,
        numa,
    )
}

/// One GH200 superchip in NUMA mode: node 0 holds CPUs 0-71, node 1 the GPU's memory, nodes 2-8
/// have neither CPUs nor memory. The bus id is a stand-in.
pub fn gh200() -> GraceHost {
    grace_host(
        "GH200",
        &[grace_socket_cpus(0)],
        (1, GpuNodes::EightPerGpu),
        &["0009:01:00.0"],
        |_| 0,
        GpuMemoryMode::Numa,
    )
}

/// A quad-GH200 node in NUMA mode: four Grace nodes (0-71, 72-143, 144-215, 216-287) and 4 x 8
/// CPU-less GPU nodes from node 4, GPU `g`'s memory on node `4 + 8g`: 36 nodes. The bus ids are
/// stand-ins.
pub fn quad_gh200() -> GraceHost {
    let sockets: Vec<CpuMask> = (0..4).map(grace_socket_cpus).collect();
    grace_host(
        "quad GH200",
        &sockets,
        (4, GpuNodes::EightPerGpu),
        &[
            "0009:01:00.0",
            "0019:01:00.0",
            "0029:01:00.0",
            "0039:01:00.0",
        ],
        |g| g,
        GpuMemoryMode::Numa,
    )
}

/// A DGX Spark (GB10): one node 0 with CPUs 0-19, no SMT, the GPU at `000f:01:00.0` with PCI
/// `numa_node` -1 (so every online CPU in its `local_cpulist`, as the kernel writes it).
pub fn dgx_spark() -> GraceHost {
    let cpus = CpuMask::from_cpus(0..20);
    let address = "000f:01:00.0";
    let uuid = "GPU-9b100000-0000-0000-0000-000000000000";
    GraceHost {
        name: "DGX Spark (GB10)",
        host: SimulatedHost::new()
            .midr(Some(GB10_MIDR))
            .node(0, &cpus)
            .gpu(address, None, None)
            .driver_gpu(address, uuid, 0, true),
        gpus: vec![GraceGpu {
            address: address.to_string(),
            uuid: uuid.to_string(),
            pci_node: None,
            nvml_cpus: cpus,
            memory_node: None,
        }],
        mode: None,
    }
}

/// Every full-scale Grace host, in the order docs/grace.md lists them.
pub fn grace_hosts() -> Vec<GraceHost> {
    vec![
        gb200_tray(GpuMemoryMode::Numa),
        gb200_tray(GpuMemoryMode::Cdmm),
        gb200_tray_cdmm_without_placeholders(),
        gb300_tray(),
        gh200(),
        quad_gh200(),
        dgx_spark(),
    ]
}

/// A VM without NUMA information: `cpus` CPUs (each its own core), no node directory, and `gpus`
/// GPUs at `0000:10:00.0`, `0000:11:00.0`, ... whose `numa_node` is -1.
pub fn single_node_vm(cpus: usize, gpus: usize) -> SimulatedHost {
    let mut host = SimulatedHost::new();
    for c in 0..cpus {
        host = host.cpu(c, c, 0, &CpuMask::from_cpus([c]));
    }
    for g in 0..gpus {
        host = host.gpu(&format!("0000:{:02x}:00.0", 0x10 + g), None, None);
    }
    host
}

fn put(path: &Path, text: &str) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(path, text)
}

/// Test support: writes one file of a hand-made tree under `root`, parents included.
#[cfg(test)]
pub(crate) fn write_tree_file(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Test support: a temporary tree holding `files`, each a path under its root and its text.
#[cfg(test)]
pub(crate) fn tree_of(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (rel, text) in files {
        write_tree_file(dir.path(), rel, text);
    }
    dir
}

#[cfg(test)]
impl SimulatedHost {
    /// Writes this host into a temporary directory and reads it back, as the library would.
    pub(crate) fn topology(&self) -> crate::host::topology::Topology {
        let dir = tempfile::tempdir().unwrap();
        self.write(dir.path()).unwrap();
        crate::host::topology::Topology::read(&crate::host::topology::SysfsRoot::new(dir.path()))
            .unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::topology::{LocalCpuSource, SysfsRoot, Topology};
    use crate::placement::device::{resolve_device, DeviceEnv};

    use crate::mask::mask;

    #[test]
    fn dgx_h100_round_trip() {
        let host = dgx_h100_like();
        let t = host.topology();
        assert_eq!(t.online, mask("0-223"));
        assert_eq!(t.cpus.len(), 224);
        assert_eq!(t.cpus[170].siblings, mask("58,170"));
        assert_eq!(t.cpus[170].core_id, Some(2));
        assert_eq!(t.cpus[170].package_id, Some(1));
        assert_eq!(t.cores().len(), 112);
        assert_eq!(t.cores()[0], mask("0,112"));
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[0].cpus, mask("0-55,112-167"));
        assert_eq!(t.nodes[1].cpus, mask("56-111,168-223"));
        assert_eq!(t.nodes[0].distances, vec![10, 21]);
        let addrs: Vec<_> = t.gpus.iter().map(|g| g.address.clone()).collect();
        assert_eq!(addrs, host.gpu_addresses());
        assert_eq!(addrs.len(), 8);
        assert_eq!(addrs[0], "0000:18:00.0");
        assert_eq!(addrs[7], "0000:db:00.0");
        for (i, gpu) in t.gpus.iter().enumerate() {
            let node = i / 4;
            assert_eq!(gpu.numa_node, Some(node));
            let local = t.gpu_local_cpus(gpu);
            assert_eq!(local.cpus, t.nodes[node].cpus);
            assert_eq!(local.source, LocalCpuSource::PciLocalCpulist);
        }
        let names: Vec<_> = t
            .idle_states
            .iter()
            .map(|s| (s.name.as_str(), s.latency_us))
            .collect();
        assert_eq!(names, [("POLL", 0), ("C1", 2), ("C1E", 10), ("C6", 170)]);
    }

    #[test]
    fn formats_like_the_kernel() {
        let dir = tempfile::tempdir().unwrap();
        dgx_h100_like().write(dir.path()).unwrap();
        let read = |rel: &str| fs::read_to_string(dir.path().join(rel)).unwrap();
        let gpu = "sys/bus/pci/devices/0000:18:00.0";
        assert_eq!(read(&format!("{gpu}/vendor")), "0x10de\n");
        assert_eq!(read(&format!("{gpu}/class")), "0x030200\n");
        assert_eq!(read(&format!("{gpu}/numa_node")), "0\n");
        assert_eq!(read(&format!("{gpu}/local_cpulist")), "0-55,112-167\n");
        assert_eq!(read("sys/bus/pci/devices/0000:03:00.0/numa_node"), "-1\n");
        assert_eq!(read("sys/devices/system/cpu/online"), "0-223\n");
        assert_eq!(read("sys/devices/system/node/node1/distance"), "21 10\n");
        assert_eq!(
            read("sys/devices/system/cpu/cpu0/topology/thread_siblings_list"),
            "0,112\n"
        );
    }

    #[test]
    fn dgx_without_local_cpulist_uses_numa_node() {
        let t = dgx_h100_like()
            .without_local_cpulist("0000:DB:00.0")
            .topology();
        let gpu = t.gpu_by_address("db:00.0").unwrap();
        assert_eq!(gpu.local_cpus, None);
        let local = t.gpu_local_cpus(gpu);
        assert_eq!(local.source, LocalCpuSource::NumaNode(1));
        assert_eq!(local.cpus, mask("56-111,168-223"));
    }

    #[test]
    fn two_node_demo_host_on_small_machines() {
        let t = two_node_one_gpu(&mask("0-1")).topology();
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[0].cpus, mask("0"));
        assert_eq!(t.nodes[1].cpus, mask("1"));
        let env = DeviceEnv::default();
        let dev0 = resolve_device(0, &env, &t.gpus).unwrap();
        assert_eq!(dev0.address, "0000:3b:00.0");
        assert_eq!(
            t.local_cpus_of(dev0.gpu_index),
            (mask("1"), LocalCpuSource::PciLocalCpulist)
        );
        let dev1 = resolve_device(1, &env, &t.gpus).unwrap();
        assert_eq!(t.gpu_local_cpus(&t.gpus[dev1.gpu_index]).cpus, mask("0"));

        let t = two_node_one_gpu(&mask("2-4,9")).topology();
        assert_eq!(t.online, mask("2-4,9"));
        assert_eq!(t.nodes[0].cpus, mask("2-3"));
        assert_eq!(t.nodes[1].cpus, mask("4,9"));
        assert_eq!(t.cpus.iter().map(|c| c.siblings.count()).max(), Some(1));
        assert_eq!(t.gpu_local_cpus(&t.gpus[0]).cpus, mask("4,9"));

        let t = two_node_one_gpu(&mask("5")).topology();
        assert_eq!(t.nodes.len(), 1);
        assert_eq!(t.online, mask("5"));
        assert_eq!(t.local_cpus_of(0), (mask("5"), LocalCpuSource::SingleNode));
    }

    #[test]
    fn single_node_vm_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        single_node_vm(4, 2).write(dir.path()).unwrap();
        assert!(!dir.path().join("sys/devices/system/node").exists());
        let t = Topology::read(&SysfsRoot::new(dir.path())).unwrap();
        assert_eq!(t.online, mask("0-3"));
        assert_eq!(t.nodes.len(), 1);
        assert_eq!(t.nodes[0].cpus, mask("0-3"));
        assert_eq!(t.gpus.len(), 2);
        assert_eq!(t.gpus[1].address, "0000:11:00.0");
        assert!(t.gpus.iter().all(|g| g.numa_node.is_none()));
        assert_eq!(
            t.local_cpus_of(1),
            (mask("0-3"), LocalCpuSource::SingleNode)
        );
        assert!(t.idle_states.is_empty());
    }

    #[test]
    fn memory_only_node_round_trip() {
        // A GB200-like pair: node 0 with CPUs, node 1 holding only the GPU's memory.
        let host = SimulatedHost::new()
            .node(0, &mask("0-3"))
            .node(1, &CpuMask::new())
            .node_distances(vec![vec![10, 40], vec![40, 10]])
            .gpu("0008:01:00.0", Some(1), Some(&CpuMask::new()));
        let t = host.topology();
        let nearest = LocalCpuSource::NearestNodeWithCpus {
            gpu_node: 1,
            used_node: 0,
        };
        assert_eq!(t.local_cpus_of(0), (mask("0-3"), nearest));
    }

    #[test]
    fn bad_distance_matrix_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let host = SimulatedHost::new()
            .node(0, &mask("0"))
            .node(1, &mask("1"))
            .node_distances(vec![vec![10]]);
        let err = host.write(dir.path()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn grace_hosts_at_full_scale_have_the_documented_node_counts() {
        let counts: Vec<(usize, usize, usize)> = grace_hosts()
            .iter()
            .map(|g| {
                let t = g.host.topology();
                let with_cpus = t.nodes.iter().filter(|n| !n.cpus.is_empty()).count();
                let with_memory = t.nodes.iter().filter(|n| n.has_memory).count();
                (t.nodes.len(), with_cpus, with_memory)
            })
            .collect();
        assert_eq!(
            counts,
            [
                (34, 2, 6),
                (34, 2, 2),
                (2, 2, 2),
                (34, 2, 6),
                (9, 1, 2),
                (36, 4, 8),
                (1, 1, 1)
            ]
        );
        let t = gb200_tray(GpuMemoryMode::Numa).host.topology();
        assert_eq!(t.online, mask("0-143"));
        assert_eq!(t.node(1).unwrap().cpus, mask("72-143"));
        assert!(t.cpus.iter().all(|c| c.siblings.count() == 1), "no SMT");
        let t = quad_gh200().host.topology();
        assert_eq!(t.node(3).unwrap().cpus, mask("216-287"));
        assert_eq!(t.gpus[3].numa_node, Some(3));
    }

    #[test]
    fn gb200_round_trip_keeps_sparse_node_ids_and_memory_less_placeholders() {
        let t = gb200_like(&mask("0-3"), &mask("4-7")).topology();
        let ids: Vec<usize> = t.nodes.iter().map(|n| n.id).collect();
        assert_eq!(ids, (0..=10).collect::<Vec<_>>());
        let with_memory: Vec<usize> = t
            .nodes
            .iter()
            .filter(|n| n.has_memory)
            .map(|n| n.id)
            .collect();
        assert_eq!(with_memory, [0, 1, 2, 10]);
        assert!(t.node(2).unwrap().cpus.is_empty());
        let addrs: Vec<&str> = t.gpus.iter().map(|g| g.address.as_str()).collect();
        assert_eq!(addrs, GB200_GPUS);
        for i in 0..2 {
            assert_eq!(t.gpus[i].numa_node, Some(0));
            assert_eq!(
                t.local_cpus_of(i),
                (mask("0-3"), LocalCpuSource::PciLocalCpulist)
            );
        }
        let dir = tempfile::tempdir().unwrap();
        gb200_like(&mask("0-3"), &mask("4-7"))
            .driver_gpu(GB200_GPUS[0], "GPU-a", 0, true)
            .driver_numa_status(GB200_GPUS[0], 2)
            .write(dir.path())
            .unwrap();
        let status = format!("proc/driver/nvidia/gpus/{}/numa_status", GB200_GPUS[0]);
        let text = fs::read_to_string(dir.path().join(status)).unwrap();
        assert!(text.starts_with("Node: 2\n"), "{text}");
    }
}
