//! The engine behind the preload shims: load-time set-up, the C ABI's behaviour, and the hooks.
//!
//! Initialisation is an explicit state machine (uninitialised → initialising → active, passive or
//! disabled), run by the constructor and, lazily, by every entry point, because another library's
//! constructor can create a thread before ours has run. Every entry point fails open.

pub mod create;
pub mod environ;
pub mod exec;
pub mod kernel;
pub mod objects;
pub mod observe;
pub mod packets;
pub mod publish;
pub mod pyhook;
pub mod real;
pub mod step_pin;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::lock::{EngineGuard, EngineLock};

use crate::cgroup;
use crate::device::{resolve_device_on, DeviceEnv};
use crate::launch::{self, LaunchId};
use crate::load_facts::LoadFacts;
use crate::mask::CpuMask;
use crate::policy::{self, Rule};
use crate::registry::{LeaseKind, Registry, Role, Slot, ThreadMasks};
use crate::report::Report;
use crate::settings::{PolicyChoice, ProcessRole, Settings};
use crate::sys;
use crate::topology::{LocalCpuSource, SysfsRoot, Topology};
use crate::{log_debug, log_error, log_info, log_warn};
use kernel::Kernel;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    Uninitialised = 0,
    Initialising = 1,
    /// Tracking roles and placing worker threads.
    Active = 2,
    /// A setting was malformed: nothing is tracked or changed, the program runs on.
    Passive = 3,
    /// Secure execution, or the platform refused what the library needs.
    Disabled = 4,
}

static STATE: AtomicU8 = AtomicU8::new(State::Uninitialised as u8);

static LOAD_FACTS: OnceLock<LoadFacts> = OnceLock::new();

/// One lock over the registry. It spins (yielding) instead of parking: parking_lot would park
/// through a thread-local with a destructor, whose registration takes the loader lock, and a new
/// thread in our trampoline must never wait for the loader.
static REGISTRY: EngineLock<Registry> = EngineLock::new(Registry::new());

pub fn registry() -> &'static EngineLock<Registry> {
    &REGISTRY
}

/// The registry, with the application's mask changes that the observing shims queued taken in
/// first. Every path takes it this way except a thread's birth and exit, which must not allocate
/// (they use [`registry`]): a change queued then is taken in by the next operation, before it
/// decides anything from that thread's mask.
pub fn lock_registry() -> EngineGuard<'static, Registry> {
    let mut reg = REGISTRY.lock();
    observe::take_queued(&mut reg);
    reg
}

/// The pid the registry describes: set at load and in a fork child. A `vfork` or
/// `clone(CLONE_VM)` child runs on our memory with another pid until it execs.
static OWN_PID: AtomicI32 = AtomicI32::new(0);

/// Whether the caller runs in the process the registry describes (not in a child sharing its
/// memory, nor in a child of `_Fork`/`clone` that skipped the fork handlers).
pub fn in_own_process() -> bool {
    OWN_PID.load(Ordering::Relaxed) == sys::getpid()
}

/// The load-time facts; only called after `ensure_init` returned `Active`.
pub fn load_facts() -> &'static LoadFacts {
    LOAD_FACTS.get().expect("engine used before initialisation")
}

pub fn state() -> State {
    match STATE.load(Ordering::Acquire) {
        0 => State::Uninitialised,
        1 => State::Initialising,
        2 => State::Active,
        3 => State::Passive,
        _ => State::Disabled,
    }
}

/// Runs initialisation once; a hook that arrives while it runs (on this thread or another)
/// passes through untouched.
pub fn ensure_init() -> State {
    let now = state();
    if now != State::Uninitialised {
        return now;
    }
    if STATE
        .compare_exchange(
            State::Uninitialised as u8,
            State::Initialising as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        return state();
    }
    let outcome = catch_unwind(initialise).unwrap_or(State::Disabled);
    STATE.store(outcome as u8, Ordering::Release);
    if outcome == State::Active && load_facts().settings.process_role == ProcessRole::Worker {
        // Fails open like every entry point: a panic here must not abort the host program.
        let _ = catch_unwind(configure_dedicated_worker);
    }
    let _ = catch_unwind(|| hand_over_at_load(outcome));
    outcome
}

fn initialise() -> State {
    if !real::resolve_all() {
        return State::Disabled;
    }
    if sys::is_secure_execution() {
        return State::Disabled;
    }
    let pid = sys::getpid();
    OWN_PID.store(pid, Ordering::Relaxed);
    let main_mask = sys::get_mask(pid).unwrap_or_default();
    let launch = learn_launch(pid, &main_mask);
    let mask_at_load = launch.launch.clone();
    let said_already = launch.said_already;
    let _ = exec::LAUNCH.set(launch.facts());
    let (settings, errors) = Settings::from_env();
    crate::log::set_level(settings.log);
    // A malformed cosmetic variable (log level, strict, report path) changes no placement: it
    // falls back to its default with one line, and the library stays active. Under
    // TLLM_AFFINITY_STRICT=1 it stops the process like any other bad setting.
    let (cosmetic, errors): (Vec<_>, Vec<_>) = errors
        .into_iter()
        .partition(|e| e.is_cosmetic() && !settings.strict);
    for e in &cosmetic {
        setting_line(said_already, &format!("{e}; using its default"));
    }
    if !errors.is_empty() {
        // One line per malformed variable, saying what follows from it.
        for e in &errors {
            if settings.strict {
                setting_line(
                    said_already,
                    &format!("{e}; stopping with status 2 (TLLM_AFFINITY_STRICT=1)"),
                );
            } else {
                setting_line(
                    said_already,
                    &format!("{e}; staying passive: no thread mask will be changed"),
                );
            }
        }
        if settings.strict {
            // TLLM_AFFINITY_STRICT asked for exactly this.
            sys::exit_now(2);
        }
        return State::Passive;
    }
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|t| CpuMask::parse_list(&t).ok())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| mask_at_load.clone());
    let cpuset = cgroup::read_limits()
        .cpuset
        .map(|c| c.intersection(&online))
        .filter(|c| !c.is_empty())
        .unwrap_or(online);
    let constrained = policy::is_constrained(&mask_at_load, &cpuset);
    let step_core_invalid = match crate::step::check_at_load(settings.step_core, &mask_at_load) {
        Ok(()) => false,
        Err(line) => {
            setting_line(said_already, &line);
            if settings.strict {
                // As above: TLLM_AFFINITY_STRICT asks to stop at a bad setting.
                sys::exit_now(2);
            }
            true
        }
    };
    if !create::create_thread_key() {
        log_error!("no pthread key available; the library stays passive");
        return State::Disabled;
    }
    register_fork_handlers();
    environ::capture();
    let role = match settings.process_role {
        ProcessRole::Worker => Role::Worker,
        ProcessRole::Host => Role::Host,
    };
    let handle = if sys::gettid() == pid {
        sys::pthread_self() as u64
    } else {
        0
    };
    let main = {
        let mut reg = lock_registry();
        reg.set_unseen_natural(mask_at_load.intersection(&cpuset));
        reg.register_root(pid, handle, role, main_mask)
    };
    if handle != 0 {
        create::set_current_slot(main);
    }
    // The thread table is mapped later, by `publish_table_if_pending`.
    sys::at_exit(at_exit);
    log_debug!(
        "loaded: mask at load [{mask_at_load}], cpuset [{cpuset}], constrained: {constrained}"
    );
    let _ = LOAD_FACTS.set(LoadFacts {
        settings,
        mask_at_load,
        cpuset,
        constrained,
        step_core_invalid,
    });
    State::Active
}

/// What this image learned of its launch at load (SPEC §2, §12; see [`crate::launch`]).
struct LaunchAtLoad {
    id: LaunchId,
    fingerprint: u64,
    /// The mask "constrained" is judged on: the launch's, when this image was started from a
    /// worker thread and its main thread is still on that worker mask; its own otherwise.
    launch: CpuMask,
    /// An earlier image of the launch already printed the messages these settings give.
    said_already: bool,
}

impl LaunchAtLoad {
    fn facts(&self) -> exec::LaunchFacts {
        exec::LaunchFacts {
            id: self.id,
            fingerprint: self.fingerprint,
            launch: self.launch.clone(),
        }
    }
}

fn learn_launch(pid: i32, main_mask: &CpuMask) -> LaunchAtLoad {
    let handed = std::env::var(launch::VAR)
        .ok()
        .and_then(|v| launch::Handed::parse(&v));
    let vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(n, v)| Some((n.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(n, _)| launch::is_setting(n))
        .collect();
    let fingerprint =
        launch::settings_fingerprint(vars.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    let id = handed.as_ref().map(|h| h.id).unwrap_or(LaunchId {
        pid: pid as u32,
        start: crate::threadtable::start_time(pid as u32).unwrap_or(0),
    });
    LaunchAtLoad {
        id,
        fingerprint,
        launch: handed
            .as_ref()
            .and_then(|h| h.launch_mask_for(main_mask))
            .unwrap_or_else(|| main_mask.clone()),
        said_already: handed.is_some_and(|h| h.said == Some(fingerprint)),
    }
}

/// A warning or error about a setting: printed by the first image of a launch that meets it, at
/// `debug` by the later ones, which still act on it (SPEC §12).
fn setting_line(said_already: bool, line: &str) {
    if said_already {
        log_debug!("{line} (an earlier program of this launch reported it)");
    } else {
        log_error!("{line}");
    }
}

/// Whether the caller is the main thread of a process with no other thread: the only time the
/// library may call `setenv`, which races with any other thread's `getenv` (glibc may move
/// `environ`). True in a constructor, unless another library's constructor started a thread.
pub fn alone() -> bool {
    sys::gettid() == sys::getpid() && Kernel.thread_ids().len() == 1
}

/// Puts the launch's state in the environment, for every program this process starts however
/// it starts it: only from the main thread of a process with no other thread yet, because
/// `setenv` races with any other thread's `getenv` (glibc may move `environ`). Another
/// library's constructor may already have started one before ours ran; the programs this
/// process starts then learn the state only through the exec shims ([`exec`]).
fn hand_over_at_load(state: State) {
    let Some(facts) = exec::LAUNCH.get() else {
        return;
    };
    if state == State::Disabled || !alone() {
        return;
    }
    let main_mask = sys::get_mask(0).unwrap_or_default();
    // The main thread is on the worker mask: a dedicated worker configured at load, or an image
    // started from a worker whose launch mask it took over.
    let placed = (state == State::Active && main_mask != facts.launch).then_some(&main_mask);
    let mut line = String::new();
    let written = launch::write_value(
        &mut line,
        facts.id,
        facts.fingerprint,
        placed.map(|p| (facts.launch.words(), p.words())),
    );
    let Some((_, value)) = line.split_once('=').filter(|_| written.is_ok()) else {
        return;
    };
    if std::env::var(launch::VAR).ok().as_deref() != Some(value) {
        std::env::set_var(launch::VAR, value);
    }
}

fn configure_dedicated_worker() {
    publish_table_if_pending();
    let pid = sys::getpid();
    let Some(main) = lock_registry().find_tid(pid) else {
        return;
    };
    // From the constructor: NVML must not be loaded here, the driver's list and sysfs decide.
    let lease = configure_for(main, -1, LeaseKind::Configure, false);
    if lease < 0 {
        log_warn!("TLLM_AFFINITY_PROCESS_ROLE=worker: the process could not be configured");
        return;
    }
    environ::note_dedicated_lease(lease);
}

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
struct WorkerSet {
    device: String,
    gpu_local: CpuMask,
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
static WORKER_SETS: EngineLock<Vec<(SetKey, WorkerSet)>> = EngineLock::new(Vec::new());

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
            note: None,
            empty_warned: false,
        });
    }
    let root = SysfsRoot::new(settings.sysfs_root.clone());
    let topology = Topology::read(&root).map_err(|e| (libc::EIO, e.to_string()))?;
    let view = crate::gpus::current_view(&root, &topology, nvml);
    let resolved = resolve_device_on(device_id, env, &view, &root)
        .map_err(|e| (libc::ENODEV, e.to_string()))?;
    let local = crate::gpus::local_cpus(&topology, &view.gpus[resolved.gpu_index]);
    let note = match local.source {
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
    Ok(WorkerSet {
        device: resolved.address,
        gpu_local: local.cpus,
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

fn configure_for(caller: Slot, device_id: i32, kind: LeaseKind, nvml: bool) -> i64 {
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
static ADAPTERS: EngineLock<Vec<(String, String)>> = EngineLock::new(Vec::new());
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
    let (name, state) = (
        String::from_utf8_lossy(name).into_owned(),
        String::from_utf8_lossy(state).into_owned(),
    );
    let mut adapters = ADAPTERS.lock();
    if let Some(entry) = adapters.iter_mut().find(|(n, _)| *n == name) {
        entry.1 = state;
    } else if adapters.len() < MOST_ADAPTERS {
        adapters.push((name, state));
    } else {
        return -libc::ENOSPC;
    }
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
    report.adapters = ADAPTERS.lock().iter().cloned().collect();
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

static TABLE_PATH: EngineLock<Option<std::path::PathBuf>> = EngineLock::new(None);
/// The table is mapped only when the process first creates a thread, configures, opens a worker
/// scope or pins: most preloaded processes are short single-threaded tools (every shell of a
/// launch script) that would pay an 8 MiB file and a scan of `/dev/shm` for a table nobody
/// reads. A fork child starts pending again: most children exec at once, and exec would strand
/// the file.
static TABLE_PENDING: AtomicBool = AtomicBool::new(true);

/// Maps the thread table `tllm-affinity ps` reads; without it `ps` still shows masks.
fn publish_thread_table(dir: &std::path::Path) {
    let mapped = publish::map_table(dir);
    *TABLE_PATH.lock() = mapped.as_ref().map(|(_, path)| path.clone());
    lock_registry().publish_into(mapped.map(|(records, _)| records));
}

/// A child of `_Fork` or a raw `clone` ran no fork handler: it would publish into its parent's
/// table, which it still has mapped. It starts as a fork child on the first path that needs it
/// (a thread creation, a configure; never in a `vfork` child, which may only exec or exit).
/// `getpid` is a system call: the thread-creation path asks only when its registry entry names
/// another tid than the thread's own descriptor (which `_Fork` updates).
pub fn adopt_if_forked_without_handlers() {
    if !in_own_process() && state() == State::Active {
        start_as_fork_child();
    }
}

/// Called on the paths where a process starts to matter (thread creation, configure, worker
/// scope, pin). The registry publishes every slot it holds when the table arrives, so threads
/// registered before it (the main thread) are shown too.
pub fn publish_table_if_pending() {
    if !TABLE_PENDING.load(Ordering::Relaxed) {
        return;
    }
    let Some(p) = LOAD_FACTS.get() else {
        return;
    };
    if TABLE_PENDING.swap(false, Ordering::AcqRel) {
        publish_thread_table(&p.settings.lock_dir);
    }
}

extern "C" fn at_exit() {
    // A child of `_Fork` or a raw `clone` that skipped our fork handlers holds its parent's
    // registry and table path: neither is its to write or remove (SPEC §12).
    if !in_own_process() {
        return;
    }
    write_report_at_exit();
    if let Some(path) = TABLE_PATH.lock().take() {
        let _ = std::fs::remove_file(path);
    }
}

fn write_report_at_exit() {
    let _ = catch_unwind(|| {
        let Some(path) = LOAD_FACTS
            .get()
            .and_then(|p| p.settings.report_path.clone())
        else {
            return;
        };
        let used = crate::report::used_the_library(&REGISTRY.lock().history());
        let launch = exec::LAUNCH.get().map(|f| f.id.to_string());
        if !used && crate::report::a_user_of_the_launch_wrote(&path, launch.as_deref()) {
            log_debug!(
                "TLLM_AFFINITY_REPORT='{}': kept the report of the program of this launch that used the library",
                path.display()
            );
            return;
        }
        if let Err(e) = crate::report::write_file(&path, &report_json()) {
            log_error!("TLLM_AFFINITY_REPORT='{}': {e}", path.display());
        }
    });
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

/// What a fork child does before anything else: the registry keeps only this thread (SPEC §5),
/// and the parent's table, still mapped, is left to the parent.
fn start_as_fork_child() {
    environ::after_fork_child();
    OWN_PID.store(sys::getpid(), Ordering::Relaxed);
    objects::after_fork_in_child();
    let handle = sys::pthread_self() as u64;
    {
        let mut reg = REGISTRY.lock();
        reg.reset_after_fork(create::current_slot(), sys::gettid(), handle);
        exec::publish_target(reg.target().map(|t| &*t.mask));
    }
    lock_registry().publish_into(None);
    *TABLE_PATH.lock() = None;
    TABLE_PENDING.store(true, Ordering::Release);
}

fn register_fork_handlers() {
    // Every lock of the engine, so that no other thread holds one across the fork: a child
    // would spin forever on a lock its holder is not there to release. No code path holds two
    // of them at once, so the order here cannot deadlock.
    extern "C" fn prepare() {
        objects::PUBLISHED.hold_for_fork();
        crate::step::HELD.hold_for_fork();
        WORKER_SETS.hold_for_fork();
        environ::shadow_lock().hold_for_fork();
        crate::gpus::nvml_lock().hold_for_fork();
        TABLE_PATH.hold_for_fork();
        ADAPTERS.hold_for_fork();
        REGISTRY.hold_for_fork();
    }
    fn unlock_all() {
        // SAFETY: `prepare` of this same fork took each of them.
        unsafe {
            REGISTRY.force_unlock();
            ADAPTERS.force_unlock();
            TABLE_PATH.force_unlock();
            crate::gpus::nvml_lock().force_unlock();
            environ::shadow_lock().force_unlock();
            WORKER_SETS.force_unlock();
            crate::step::HELD.force_unlock();
            objects::PUBLISHED.force_unlock();
        }
    }
    extern "C" fn parent() {
        unlock_all();
    }
    extern "C" fn child() {
        unlock_all();
        start_as_fork_child();
    }
    sys::at_fork(prepare, parent, child);
}
