//! What the C ABI's calls do (SPEC §3–§7): `configure`, `begin_worker_scope`,
//! `end_worker_scope`, `release`, `role`, `note_adapter`, `report`, and the step and result pins;
//! the worker set each configure resolves, and every log line these calls print.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::fork::adopt_if_forked_without_handlers;
use super::init::ensure_init;
use super::kernel::Kernel;
use super::publish::{publish_table_if_pending, show_notes};
use super::{
    create, environ, exec, load_facts, lock_registry, scope_memory, step_pin, State, LOAD_FACTS,
};

use crate::device::{resolve_device_on, DeviceEnv};
use crate::lock::EngineLock;
use crate::mask::CpuMask;
use crate::policy::{self, Rule};
use crate::registry::{LeaseKind, Registry, Role, Slot};
use crate::report::Report;
use crate::settings::PolicyChoice;
use crate::sys;
use crate::topology::{LocalCpuSource, SysfsRoot, Topology};
use crate::{log_debug, log_error, log_info, log_warn};

/// `tllm_affinity_configure`: makes the caller a worker and applies the policy (SPEC §3–§5).
pub fn configure(device_id: i32) -> i64 {
    open_for_caller(device_id, LeaseKind::Configure)
}

/// `tllm_affinity_begin_worker_scope`: the caller keeps its role, the threads it creates until
/// the scope ends are born workers; the policy applies as for `configure` (SPEC §2, §7).
pub fn begin_worker_scope(device_id: i32) -> i64 {
    open_for_caller(device_id, LeaseKind::WorkerScope)
}

fn open_for_caller(device_id: i32, kind: LeaseKind) -> i64 {
    if ensure_init() != State::Active {
        return -(libc::ENOTSUP as i64);
    }
    catch_unwind(|| {
        adopt_if_forked_without_handlers();
        publish_table_if_pending();
        let caller = current_or_register();
        configure_for(caller, device_id, kind, true)
    })
    .unwrap_or(-(libc::EFAULT as i64))
}

/// `tllm_affinity_end_worker_scope`: 0, or `-ENOENT` when `lease` is no open scope. The lease
/// stays open until released.
pub fn end_worker_scope(lease: i64) -> i32 {
    if ensure_init() != State::Active {
        return -libc::ENOENT;
    }
    match catch_unwind(|| lock_registry().end_scope(lease)) {
        Ok(Ok(tid)) => {
            scope_memory::restore_after_scope(lease);
            log_info!(
                "worker scope closed on thread {tid}: threads it creates take its role again (lease {lease} stays open until released)"
            );
            0
        }
        Ok(Err(_unknown)) => -libc::ENOENT,
        Err(_) => -libc::EFAULT,
    }
}

/// The calling thread's slot, registering it as a root if the library never saw it born.
fn current_or_register() -> Slot {
    if let Some(slot) = create::current_slot() {
        if lock_registry().entry(slot).is_some() {
            return slot;
        }
    }
    let tid = sys::gettid();
    let mask = sys::get_mask(0).unwrap_or_default();
    let handle = sys::pthread_self() as u64;
    let mut reg = lock_registry();
    let slot = match reg.find_tid(tid) {
        Some(slot) => slot,
        None => reg.register_root(tid, handle, Role::Host, mask),
    };
    drop(reg);
    create::set_current_slot(slot);
    slot
}

/// The worker CPU set for `device_id`, with a key naming the device and words saying where the
/// set came from.
#[derive(Clone)]
pub(super) struct WorkerSet {
    device: String,
    gpu_local: CpuMask,
    /// The host's nodes with memory, with their CPUs (none on a host of one node).
    memory_nodes: Vec<(usize, CpuMask)>,
    note: Option<String>,
    /// A configure already warned that the policy leaves this device no worker CPU.
    empty_warned: bool,
}

/// What a worker set was resolved from: the device id, the CUDA variables as they were, and
/// whether NVML could be asked.
type SetKey = (i32, DeviceEnv, bool);

/// Worker sets already resolved. The CUDA variables are part of the key, read at every configure
/// (a program may set `CUDA_VISIBLE_DEVICES` after load) from [`environ`]'s copy, never with a
/// `getenv` that another thread's `setenv` could race, so a repeated configure with the same ones
/// costs a copy of a few strings and no sysfs walk. NVML's answer is cached apart, in
/// [`crate::gpus`].
pub(super) static WORKER_SETS: EngineLock<Vec<(SetKey, WorkerSet)>> = EngineLock::new(Vec::new());

fn gpu_local_set(device_id: i32, nvml: bool) -> Result<WorkerSet, (i32, String)> {
    let key = (device_id, environ::device_env(), nvml);
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
            gpu_local: cpus.clone(),
            memory_nodes: Vec::new(),
            note: None,
            empty_warned: false,
        });
    }
    let root = SysfsRoot::new(settings.sysfs_root.clone());
    let mut topology = Topology::read(&root).map_err(|e| (libc::EIO, e.to_string()))?;
    let view = crate::gpus::current_view(&root, &mut topology, nvml);
    let resolved = resolve_device_on(device_id, env, &view, &root)
        .map_err(|e| (libc::ENODEV, e.to_string()))?;
    let local = crate::gpus::local_cpus(&topology, &view.gpus[resolved.gpu_index]);
    // A device whose node the kernel does not know (`numa_node` -1) has every online CPU in its
    // `local_cpulist` on a real kernel (seen in tests/guest.rs): that list says nothing either.
    let node_unknown = local.cpus == topology.online
        && topology.nodes.len() > 1
        && topology
            .gpu_by_address(&resolved.address)
            .is_some_and(|g| g.numa_node.is_none());
    let note = match local.source {
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
        _ => None,
    };
    log_debug!("{}", resolved.how);
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
        gpu_local: local.cpus,
        memory_nodes,
        note,
        empty_warned: false,
    })
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

pub(super) fn configure_for(caller: Slot, device_id: i32, kind: LeaseKind, nvml: bool) -> i64 {
    let p = load_facts();
    let call = match kind {
        LeaseKind::Configure => "configure",
        LeaseKind::WorkerScope => "begin_worker_scope",
    };
    let set = match gpu_local_set(device_id, nvml) {
        Ok(set) => set,
        Err((errno, message)) => {
            log_error!("{call}({device_id}): {message}; no mask changed");
            return -(errno as i64);
        }
    };
    let decision = policy::worker_set(&p.settings, &set.gpu_local, p.constrained, &p.cpuset);
    let outcome = {
        let mut reg = lock_registry();
        let outcome = reg.open(kind, caller, &set.device, decision.mask.clone(), &Kernel);
        exec::publish_target(reg.target().map(|t| &*t.mask));
        outcome
    };
    let pid = sys::getpid();
    if kind == LeaseKind::WorkerScope {
        log_info!(
            "worker scope opened on thread {} for {}: threads it creates are workers (lease {})",
            sys::gettid(),
            set.device,
            outcome.lease
        );
        if let Some(mask) = &decision.mask {
            scope_memory::prefer_while_open(outcome.lease, &set.memory_nodes, mask);
        }
    }
    if outcome.unchanged {
        log_debug!(
            "{call} for {}: worker mask already in place (lease {})",
            set.device,
            outcome.lease
        );
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
    outcome.lease
}

/// `tllm_affinity_release` (SPEC §5).
pub fn release(lease: i64) -> i32 {
    if ensure_init() != State::Active {
        return -libc::ENOENT;
    }
    let result = catch_unwind(|| {
        let mut reg = lock_registry();
        let outcome = reg.release(lease, &Kernel);
        exec::publish_target(reg.target().map(|t| &*t.mask));
        outcome
    });
    match result {
        Ok(Ok(outcome)) => {
            scope_memory::restore_after_scope(lease);
            if outcome.last {
                log_info!(
                    "released lease {lease}: restored {} threads, preserved {} externally changed",
                    outcome.restored,
                    outcome.preserved
                );
            }
            0
        }
        Ok(Err(_unknown)) => -libc::ENOENT,
        Err(_) => -libc::EFAULT,
    }
}

/// `tllm_affinity_role`: 0 host, 1 worker, `-ENOENT` for a thread the library does not know.
pub fn role(tid: i32) -> i32 {
    if ensure_init() != State::Active {
        return -libc::ENOENT;
    }
    let reg = lock_registry();
    let slot = if tid == 0 {
        create::current_slot().filter(|&s| reg.entry(s).is_some())
    } else {
        reg.find_tid(tid)
    };
    match slot.and_then(|s| reg.entry(s)).map(|e| e.role) {
        Some(Role::Host) => 0,
        Some(Role::Worker) => 1,
        None => -libc::ENOENT,
    }
}

/// What language adapters said about themselves (`tllm_affinity_note_adapter`): the Python
/// adapter records whether it found TensorRT-LLM's function to wrap, so a report shows a server
/// the library silently changed nothing in.
pub(super) static ADAPTERS: EngineLock<Vec<AdapterNote>> = EngineLock::new(Vec::new());

/// One adapter's word (`engaged`, `not-found`, ...) and its line of detail, if it gave one.
pub(super) struct AdapterNote {
    name: String,
    state: String,
    detail: Option<String>,
}

/// The longest detail line an adapter may give.
const LONGEST_ADAPTER_DETAIL: usize = 512;
/// Adapters the report keeps; a name or state longer than this is refused.
const MOST_ADAPTERS: usize = 8;
const LONGEST_ADAPTER_WORD: usize = 32;

/// `tllm_affinity_note_adapter`: 0, or `-EINVAL` for a name or state that is not a short word.
pub fn note_adapter(name: &[u8], state: &[u8]) -> i32 {
    let word = |w: &[u8]| {
        (1..=LONGEST_ADAPTER_WORD).contains(&w.len())
            && w.iter()
                .all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !word(name) || !word(state) {
        return -libc::EINVAL;
    }
    // A process whose adapter noted itself matters (it runs an inference server): `ps` shows
    // the note even before its first thread. Not under the adapters' lock, which publishing takes.
    publish_table_if_pending();
    let (name, state) = (
        String::from_utf8_lossy(name).into_owned(),
        String::from_utf8_lossy(state).into_owned(),
    );
    let mut adapters = ADAPTERS.lock();
    if let Some(entry) = adapters.iter_mut().find(|a| a.name == name) {
        entry.state = state;
    } else if adapters.len() < MOST_ADAPTERS {
        adapters.push(AdapterNote {
            name,
            state,
            detail: None,
        });
    } else {
        return -libc::ENOSPC;
    }
    show_notes(&notes_text(&adapters));
    0
}

/// The adapters' notes as `ps` shows them: `name: state` and the detail, one line each.
fn notes_text(adapters: &[AdapterNote]) -> String {
    adapters
        .iter()
        .map(|a| match &a.detail {
            Some(detail) => format!("{}: {}; {detail}\n", a.name, a.state),
            None => format!("{}: {}\n", a.name, a.state),
        })
        .collect()
}

/// Shows the notes given so far, when the table has just been mapped (an adapter that engaged
/// at import noted itself before). Under the adapters' lock, as every write of the notes is, so
/// an older text never overwrites a newer one.
pub(super) fn show_adapter_notes() {
    let adapters = ADAPTERS.lock();
    show_notes(&notes_text(&adapters));
}

/// `tllm_affinity_note_adapter_detail`: one line of what an adapter that already noted its state
/// engaged (for TensorRT-LLM: the version, each call site found or missing, and its leases).
/// 0; `-EINVAL` for a line that is empty, longer than 512 bytes or not printable ASCII;
/// `-ENOENT` for an adapter that noted no state.
pub fn note_adapter_detail(name: &[u8], detail: &[u8]) -> i32 {
    let printable = (1..=LONGEST_ADAPTER_DETAIL).contains(&detail.len())
        && detail.iter().all(|&b| (b' '..=b'~').contains(&b));
    if !printable {
        return -libc::EINVAL;
    }
    let mut adapters = ADAPTERS.lock();
    let Some(entry) = adapters.iter_mut().find(|a| a.name.as_bytes() == name) else {
        return -libc::ENOENT;
    };
    entry.detail = Some(String::from_utf8_lossy(detail).into_owned());
    show_notes(&notes_text(&adapters));
    0
}

/// A JSON snapshot of the process as the library sees it, with the kernel's current masks.
pub fn report_json() -> String {
    let state = ensure_init();
    let mut report = match (state, LOAD_FACTS.get()) {
        (State::Active, Some(p)) => {
            let reg = lock_registry();
            Report::build(state_name(state), Some(p), &reg, |tid| {
                sys::get_mask(tid).ok()
            })
        }
        _ => Report::build(state_name(state), None, &Registry::new(), |_| None),
    };
    for a in ADAPTERS.lock().iter() {
        report.adapters.insert(a.name.clone(), a.state.clone());
        if let Some(detail) = &a.detail {
            report
                .adapter_details
                .insert(a.name.clone(), detail.clone());
        }
    }
    report.launch = exec::LAUNCH.get().map(|f| f.id.to_string());
    serde_json::to_string(&report).unwrap_or_else(|_| "{}".into())
}

fn state_name(state: State) -> &'static str {
    match state {
        State::Active => "active",
        State::Passive => "passive",
        State::Disabled => "disabled",
        State::Uninitialised | State::Initialising => "initialising",
    }
}

/// `tllm_affinity_pin_step_thread` / `_result_thread` (SPEC §6).
pub fn pin_step_or_result(device_id: i32, result: bool) -> i32 {
    if ensure_init() != State::Active {
        return -libc::ENOTSUP;
    }
    catch_unwind(AssertUnwindSafe(|| {
        adopt_if_forked_without_handlers();
        publish_table_if_pending();
        let caller = current_or_register();
        step_pin::pin_calling_thread(caller, device_id, result)
    }))
    .unwrap_or(-libc::EFAULT)
}
