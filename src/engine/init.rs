//! Initialisation: the state machine run once by the constructor or by the first entry point,
//! what the library learns at load (settings, the mask at load, the cpuset, the launch it belongs
//! to), what it hands on to the programs this process starts, and the dedicated worker
//! (`TLLM_AFFINITY_PROCESS_ROLE=worker`) configured at load.

use std::panic::catch_unwind;
use std::sync::atomic::Ordering;

use super::configure::configure_for;
use super::kernel::Kernel;
use super::publish::{self, publish_table_if_pending};
use super::state::{load_facts, lock_registry, own_this_process, state, State, LOAD_FACTS, STATE};
use super::{environ, exec, fork, real, thread_key};

use crate::handoff::launch::{self, LaunchId};
use crate::host::cgroup;
use crate::mask::CpuMask;
use crate::placement::load_facts::LoadFacts;
use crate::placement::policy;
use crate::placement::settings::{ProcessRole, Settings};
use crate::registry::{LeaseKind, Role, ThreadMasks};
use crate::sys;
use crate::{log_debug, log_error, log_warn};

/// Runs initialisation once; a hook that arrives while it runs (on this thread or another)
/// passes through untouched.
#[inline]
pub fn ensure_init() -> State {
    let now = state();
    if now != State::Uninitialised {
        return now;
    }
    initialise_once()
}

/// [`ensure_init`]'s first call, out of line: every hook pays only the load above.
#[cold]
#[inline(never)]
fn initialise_once() -> State {
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
    // Before anything is read, set or registered: the operator's off switch leaves the process
    // as it would be without the library (no mask, table, lock, handler or environment change).
    if crate::placement::settings::disabled_by(
        std::env::var_os(crate::placement::settings::DISABLE).as_deref(),
    ) {
        return State::Off;
    }
    let pid = own_this_process();
    let main_mask = match sys::get_mask(pid) {
        Ok(mask) => mask,
        Err(errno) => {
            // Without the launch's mask nothing can be judged (constrained or not) nor
            // restored; an empty mask read as "constrained" widened workers with two false
            // lines. The library steps aside, with one line.
            crate::log::set_level(Settings::from_env().0.log);
            log_warn!(
                "cannot read the CPU mask of process {pid} ({}): the library steps aside",
                std::io::Error::from_raw_os_error(errno)
            );
            return State::Disabled;
        }
    };
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
        setting_line(said_already, &format!("{e}; {}", e.fallback()));
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
    let cpuset = cgroup::read_limits().cpuset_within(&online);
    let constrained = policy::is_constrained(&mask_at_load, &cpuset);
    let step_core_invalid =
        match crate::placement::step::check_at_load(settings.step_core, &mask_at_load) {
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
    if !thread_key::create_thread_key() {
        log_error!("no pthread key available; the library stays passive");
        return State::Disabled;
    }
    fork::register_fork_handlers();
    fork::set_mark();
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
        thread_key::set_current_slot(main);
    }
    // The thread table is mapped later, by `publish_table_if_pending`.
    sys::at_exit(publish::at_exit);
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

/// What this image learned of its launch at load (SPEC §2, §12; see [`crate::handoff::launch`]).
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
        start: crate::table::threadtable::start_time(pid as u32).unwrap_or(0),
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
    let lease = configure_for(main, -1, LeaseKind::Configure, false, environ::device_env());
    if lease < 0 {
        log_warn!("TLLM_AFFINITY_PROCESS_ROLE=worker: the process could not be configured");
        return;
    }
    environ::note_dedicated_lease(lease);
}
