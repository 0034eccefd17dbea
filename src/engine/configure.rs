//! Opening a lease for a thread (SPEC §3–§5), the work behind `configure`, `begin_worker_scope`
//! and the dedicated worker: the worker set a device resolves to (kept per device and device
//! variables), the policy's mask over it, the registry's lease, and every line that says what
//! happened.

use super::exec;
use super::kernel::Kernel;
use super::memory_effects::{self, Configured};
use super::memory_preference;
use super::state::{load_facts, lock_registry};
use crate::host::topology::{LocalCpuSource, SysfsRoot, Topology};
use crate::lock::EngineLock;
use crate::mask::CpuMask;
use crate::placement::device::{resolve_device_on, DeviceEnv};
use crate::placement::plan;
use crate::placement::policy::{self, Rule};
use crate::placement::settings::{PolicyChoice, SliceMode};
use crate::placement::slice;
use crate::registry::{LeaseKind, LeaseSlice, Slot};
use crate::sys;
use crate::{log_debug, log_error, log_info, log_warn};

/// The worker CPU set for `device_id`, with a key naming the device and words saying where the
/// set came from.
#[derive(Clone)]
pub(super) struct WorkerSet {
    device: String,
    /// The GPU's index among the GPUs the process sees, for the thread table.
    gpu_index: Option<usize>,
    gpu_local: CpuMask,
    /// The host's nodes with memory, with their CPUs (none on a host of one node).
    memory_nodes: Vec<(usize, CpuMask)>,
    note: Option<String>,
    /// Under slicing, the GPU's slice and its step core, for the lease (SPEC §18).
    slice: Option<LeaseSlice>,
    /// A configure already warned that the policy leaves this device no worker CPU.
    empty_warned: bool,
}

/// What a worker set was resolved from: the device id, the CUDA variables as they were, and
/// whether NVML could be asked.
type SetKey = (i32, DeviceEnv, bool);

/// Worker sets already resolved. The CUDA variables are part of the key, read at every configure
/// (a program may set `CUDA_VISIBLE_DEVICES` after load) from `environ.rs`'s copy by the caller,
/// never with a `getenv` that another thread's `setenv` could race, so a repeated configure with
/// the same ones costs a copy of a few strings and no sysfs walk. NVML's answer is cached apart, in
/// [`crate::host::gpus`].
pub(super) static WORKER_SETS: EngineLock<Vec<(SetKey, WorkerSet)>> = EngineLock::new(Vec::new());

fn gpu_local_set(device_id: i32, env: DeviceEnv, nvml: bool) -> Result<WorkerSet, (i32, String)> {
    let key = (device_id, env, nvml);
    if let Some((_, set)) = WORKER_SETS.lock().iter().find(|(k, _)| *k == key) {
        return Ok(set.clone());
    }
    let set = resolve_worker_set(device_id, &key.1, nvml)?;
    WORKER_SETS.lock().push((key, set.clone()));
    Ok(set)
}

fn resolve_worker_set(
    device_id: i32,
    env: &DeviceEnv,
    nvml: bool,
) -> Result<WorkerSet, (i32, String)> {
    let settings = &load_facts().settings;
    if let Some(cpus) = &settings.cpus_override {
        return Ok(WorkerSet {
            device: format!("TLLM_AFFINITY_CPUS={cpus}"),
            gpu_index: None,
            gpu_local: cpus.clone(),
            memory_nodes: Vec::new(),
            note: None,
            slice: None,
            empty_warned: false,
        });
    }
    let root = SysfsRoot::new(settings.sysfs_root.clone());
    let mut topology = Topology::read(&root).map_err(|e| (libc::EIO, e.to_string()))?;
    let view = crate::host::gpus::current_view(&root, &mut topology, nvml);
    let resolved = resolve_device_on(device_id, env, &view, &root)
        .map_err(|e| (libc::ENODEV, e.to_string()))?;
    let mut local = crate::host::gpus::local_cpus(&topology, &view.gpus[resolved.gpu_index]);
    // A device whose node the kernel does not know (`numa_node` -1) has every online CPU in its
    // `local_cpulist` on a real kernel (seen in tests/guest.rs): that list says nothing either.
    let node_unknown = local.cpus == topology.online
        && topology.nodes.len() > 1
        && topology
            .gpu_by_address(&resolved.address)
            .is_some_and(|g| g.numa_node.is_none());
    let mut note = match local.source {
        LocalCpuSource::PciLocalCpulist if node_unknown => Some(format!(
            "GPU {} has no NUMA node: using every online CPU",
            resolved.address
        )),
        LocalCpuSource::SingleNode => Some(
            "this host has one NUMA node: NUMA-aware placement means every allowed CPU".to_string(),
        ),
        LocalCpuSource::NearestNodeWithCpus { gpu_node, used_node } => Some(format!(
            "GPU {} sits on NUMA node {gpu_node}, which has no CPUs: using node {used_node}, the nearest with CPUs",
            resolved.address
        )),
        LocalCpuSource::AllOnline => Some(format!(
            "GPU {} has no NUMA node: using every online CPU",
            resolved.address
        )),
        LocalCpuSource::NvmlAffinity => Some(format!(
            "GPU {} has no NUMA node in sysfs: using NVML's CPU affinity [{}]",
            resolved.address, local.cpus
        )),
        _ => None,
    };
    log_debug!("{}", resolved.how);
    let mut lease_slice = None;
    if settings.slice == SliceMode::Gpu {
        // SPEC §18: the GPU's slice of its set, from the topology alone, so every process
        // computes the same slices. Resolved once per device, so the warning is one line.
        topology.read_llc_domains(&root);
        let sliceable = plan::slice_allowed(&topology, &load_facts().cpuset);
        let all = slice::slices(&topology, &sliceable);
        let base = slice::worker_base(&all, &sliceable, &resolved.address, &local.cpus);
        if let Some(warning) = &base.warning {
            log_warn!("{warning}");
        }
        if let Some(s) = &base.slice {
            let sliced = format!(
                "GPU {}'s workers on its slice [{}]: {}",
                resolved.address,
                s.cpus,
                s.describe()
            );
            note = Some(match note {
                Some(n) => format!("{n}; {sliced}"),
                None => sliced,
            });
            lease_slice = Some(LeaseSlice {
                cpus: s.cpus.clone(),
                step_core: slice_step_core(&topology, &all, &resolved.address),
            });
        }
        local.cpus = base.cpus;
    }
    let memory_nodes = if topology.nodes.len() > 1 {
        topology
            .nodes
            .iter()
            .filter(|n| n.has_memory)
            .map(|n| (n.id, n.cpus.clone()))
            .collect()
    } else {
        Vec::new()
    };
    Ok(WorkerSet {
        device: resolved.address,
        gpu_index: Some(resolved.gpu_index),
        gpu_local: local.cpus,
        memory_nodes,
        note,
        slice: lease_slice,
        empty_warned: false,
    })
}

/// The step core `auto` gives the GPU at `address` within its slice (`all`: every GPU's slice),
/// or `None` where its slice is too small for one: where upstream's executor-loop pin goes when
/// it would leave the slice.
fn slice_step_core(topology: &Topology, all: &[slice::GpuSlice], address: &str) -> Option<CpuMask> {
    let facts = load_facts();
    let allowed = facts.mask_at_load.intersection(&facts.cpuset);
    plan::step_placements(topology, &allowed, Some(all))
        .into_iter()
        .find(|g| g.address == address)
        .and_then(|g| g.placement.ok())
        .map(|p| p.step)
}

/// True the first time a configure finds `device`'s worker set empty: a repeated configure logs
/// no warning (SPEC §5), whichever device id or CUDA variables led to the same device.
fn first_empty_for(device: &str) -> bool {
    let mut sets = WORKER_SETS.lock();
    let first = !sets
        .iter()
        .any(|(_, s)| s.device == device && s.empty_warned);
    for (_, set) in sets.iter_mut().filter(|(_, s)| s.device == device) {
        set.empty_warned = true;
    }
    first
}

/// Opens a lease of `kind` for `caller` on `device_id`'s worker set, as the device variables
/// `env` name it; `nvml`: whether NVML may be loaded. The lease, or `-errno`.
pub(super) fn configure_for(
    caller: Slot,
    device_id: i32,
    kind: LeaseKind,
    nvml: bool,
    env: DeviceEnv,
) -> i64 {
    let p = load_facts();
    let call = match kind {
        LeaseKind::Configure => "configure",
        LeaseKind::WorkerScope => "begin_worker_scope",
    };
    let set = match gpu_local_set(device_id, env, nvml) {
        Ok(set) => set,
        Err((errno, message)) => {
            log_error!("{call}({device_id}): {message}; no mask changed");
            return -(errno as i64);
        }
    };
    let decision = policy::worker_set(&p.settings, &set.gpu_local, p.constrained, &p.cpuset);
    let pid = sys::getpid();
    let (outcome, on_main) = {
        let mut reg = lock_registry();
        let on_main = reg.entry(caller).is_some_and(|e| e.tid == pid);
        let outcome = reg.open(
            kind,
            caller,
            &set.device,
            set.gpu_index,
            decision.mask.clone(),
            &Kernel,
        );
        if let Some(slice) = &set.slice {
            reg.describe_slice(outcome.lease, slice);
        }
        exec::publish_target(reg.target().map(|t| &*t.mask));
        (outcome, on_main)
    };
    // A configure of the main thread makes the whole process the worker's (a dedicated worker
    // process, TLLM_AFFINITY_PROCESS_ROLE=worker): its memory follows the worker to its node,
    // after the threads moved (what they allocate from now on lands there).
    let follow = || {
        memory_effects::follow_the_worker(Configured {
            dedicated: kind == LeaseKind::Configure && on_main,
            rule: decision.rule,
            mask: decision.mask.as_ref(),
            memory_nodes: &set.memory_nodes,
        })
    };
    if kind == LeaseKind::WorkerScope {
        log_info!(
            "worker scope opened on thread {} for {}: threads it creates are workers (lease {})",
            sys::gettid(),
            set.device,
            outcome.lease
        );
        if let Some(mask) = &decision.mask {
            memory_preference::prefer_while_open(outcome.lease, &set.memory_nodes, mask);
        }
    }
    if outcome.unchanged {
        log_debug!(
            "{call} for {}: worker mask already in place (lease {})",
            set.device,
            outcome.lease
        );
        follow();
        return outcome.lease;
    }
    if let Some(reason) = &decision.empty_reason {
        if first_empty_for(&set.device) {
            log_warn!("{call} for {}: {reason}; no worker mask pinned", set.device);
        } else {
            log_debug!("{call} for {}: {reason}; no worker mask pinned", set.device);
        }
    }
    if let Some(note) = &set.note {
        log_info!("{note}");
    }
    if let Some(from) = &outcome.retargeted_from {
        log_info!("retargeting worker threads from {from} to {}", set.device);
    }
    match (decision.rule, &decision.mask) {
        (Rule::Numa, Some(mask)) => log_info!(
            "Worker process {pid} CPU affinity set to [{mask}] for optimal NUMA-aware scheduling ({}/{} threads).",
            outcome.on_mask,
            outcome.workers
        ),
        (Rule::Clear, Some(mask)) => {
            let cleared_by_the_table =
                matches!(p.settings.policy, None | Some(PolicyChoice::Auto));
            if p.constrained && cleared_by_the_table {
                log_warn!(
                    "Worker process {pid} is affined to run on the following CPUs: [{}]",
                    p.mask_at_load
                );
                log_warn!(
                    "Worker process {pid} has constrained CPU affinity but `TLLM_NUMA_AWARE_WORKER_AFFINITY` is not set. Removing CPU affinity constraints."
                );
            }
            log_info!(
                "Worker process {pid} CPU affinity set to [{mask}] ({}/{} threads).",
                outcome.on_mask,
                outcome.workers
            );
        }
        (Rule::Keep, _) => log_info!(
            "Worker process {pid}: worker CPU affinity left unchanged by policy ({} worker threads tracked).",
            outcome.workers
        ),
        _ => {}
    }
    if outcome.preserved > 0 {
        log_info!(
            "{} worker threads keep masks set by someone else",
            outcome.preserved
        );
    }
    follow();
    outcome.lease
}
