//! The report the C ABI's `tllm_affinity_report` and the exit report (`TLLM_AFFINITY_REPORT`)
//! give: [`crate::registry::report`] built over the registry, with what language adapters said about
//! themselves (`tllm_affinity_note_adapter`, `_detail`), which only the report shows.

use super::state::{lock_registry, State, LOAD_FACTS};
use super::{exec, memory_effects};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::lock::EngineLock;
use crate::registry::report::Report;
use crate::registry::Registry;
use crate::sys;
use crate::table::threadtable::Mapped;

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
    show_notes(&adapters);
    0
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
    show_notes(&adapters);
    0
}

/// Where the adapters' notes go once the thread table is mapped (`ps` shows them above the
/// grid): its header and notes words, set by [`super::publish`].
pub(super) static NOTES: EngineLock<Option<&'static Mapped>> = EngineLock::new(None);

/// The table has just been mapped (or, `None`, is the parent's in a fork child): notes given
/// before it (an adapter that engaged at import) are shown at once. Under the adapters' lock, as
/// every write of the notes is, so an older text never overwrites a newer one; the fork handlers
/// take ADAPTERS before NOTES too.
pub(super) fn notes_go_to(view: Option<&'static Mapped>) {
    let adapters = ADAPTERS.lock();
    *NOTES.lock() = view;
    show_notes(&adapters);
}

/// Writes the adapters' notes, `name: state; detail` one line each, into the table if mapped.
fn show_notes(adapters: &[AdapterNote]) {
    let text: String = adapters
        .iter()
        .map(|a| match &a.detail {
            Some(detail) => format!("{}: {}; {detail}\n", a.name, a.state),
            None => format!("{}: {}\n", a.name, a.state),
        })
        .collect();
    if let Some(table) = *NOTES.lock() {
        table.write_notes(&text);
    }
}

/// A JSON snapshot of the process as the library sees it in `state`, with the kernel's current
/// masks and what the adapters said.
pub(super) fn json(state: State, at_exit: bool) -> String {
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
    if let Some(word) = python_hook_word(at_exit) {
        report.adapters.insert(
            String::from_utf8_lossy(PYTHON_HOOK_ADAPTER).into_owned(),
            word.to_string(),
        );
    }
    report.launch = exec::LAUNCH.get().map(|f| f.id.to_string());
    report.memory_moved = memory_effects::reported();
    serde_json::to_string(&report).unwrap_or_else(|_| "{}".into())
}

// ---- The Python start-up hook's word ----
//
// The library cannot see inside an interpreter; the hook tells it instead. A process is watched
// when CPython's API is in its global symbol scope and not yet initialised when the library loads
// (the `python` executable, a program embedding libpython), with the hook not switched off: its
// interpreter starts after the library, so the hook, if Python runs it, notes itself
// (`tllm_affinity_note_adapter("python", "hook")`) before any of the program's code. A watched
// process whose interpreter started without that note (`-S`; `-E`/`-I` or an embedding without
// the package installed where they look) has `adapters.python` `no-hook` in its report, and is
// said once in the log when it matters: once a thread's mask was set from another thread (an
// all-thread pin, as TensorRT-LLM's own `configure_cpu_affinity` makes), at the next thread's
// birth or at exit. Programs that use the library's API themselves, without the hook, are not
// told at every start.

/// Whether a watched process's interpreter has started (`Py_IsInitialized`, see `pyhook`).
static INTERPRETER_STARTED: OnceLock<fn() -> bool> = OnceLock::new();
static HOOK_RAN: AtomicBool = AtomicBool::new(false);
static HOOK_MISSING_SAID: AtomicBool = AtomicBool::new(false);
/// A thread's mask was set from another thread (`observe`).
static ANOTHER_THREADS_MASK_SET: AtomicBool = AtomicBool::new(false);

/// The adapter name the start-up hook notes itself under, and its state.
pub const PYTHON_HOOK_ADAPTER: &[u8] = b"python";
const HOOK_RAN_WORD: &str = "hook";
const NO_HOOK_WORD: &str = "no-hook";

/// At load: this process's interpreter starts after the library; `started` says whether it has.
pub fn watch_interpreter(started: fn() -> bool) {
    let _ = INTERPRETER_STARTED.set(started);
}

/// The program set another thread's mask: noted while a watched interpreter runs (a program that
/// embeds Python sets masks of its own before it starts one). Lock-free and allocation-free: the
/// shims that call it may run in a signal handler, and `Py_IsInitialized` only reads a word.
pub fn note_another_threads_mask_set() {
    if INTERPRETER_STARTED.get().is_some_and(|started| started()) {
        ANOTHER_THREADS_MASK_SET.store(true, Ordering::Relaxed);
    }
}

/// `tllm_affinity_note_adapter("python", state)`: the start-up hook ran in this interpreter.
/// Lock-free and allocation-free: every interpreter under the library calls it at start-up, and
/// it maps no table (a process matters once it has a thread or calls the library).
pub fn note_python_hook(state: &[u8]) -> i32 {
    if state != HOOK_RAN_WORD.as_bytes() {
        return -libc::EINVAL;
    }
    HOOK_RAN.store(true, Ordering::Release);
    0
}

/// The report's `adapters.python`: `hook`, `no-hook` (a watched interpreter that started
/// without it), or nothing (not a watched process, or its interpreter has not started).
fn python_hook_word(at_exit: bool) -> Option<&'static str> {
    if HOOK_RAN.load(Ordering::Acquire) {
        return Some(HOOK_RAN_WORD);
    }
    let started = INTERPRETER_STARTED.get()?;
    // At exit the interpreter has been finalised (Py_IsInitialized reads 0 again): a watched
    // process that ran its program without the note never had the hook.
    (at_exit || started()).then_some(NO_HOOK_WORD)
}

/// Says, once per process, that its interpreter started without the hook, once another thread's
/// mask was set: at the next thread's birth (`at_exit` false), else at exit.
pub fn say_if_python_hook_missing(at_exit: bool) {
    if HOOK_MISSING_SAID.load(Ordering::Relaxed)
        || !ANOTHER_THREADS_MASK_SET.load(Ordering::Relaxed)
        || python_hook_word(at_exit) != Some(NO_HOOK_WORD)
    {
        return;
    }
    if HOOK_MISSING_SAID.swap(true, Ordering::AcqRel) {
        return;
    }
    crate::log_warn!(
        "a thread's mask was set from another thread in a Python interpreter that did not run \
         the tllm-affinity start-up hook (started with -S; or with -E, -I or embedded, where \
         the tllm_affinity package is not installed in the interpreter's site-packages): if that \
         was TensorRT-LLM's configure_cpu_affinity, it pinned every thread of the process, host \
         threads included (install the tllm_affinity package in the server's environment: the wheel \
         from scripts/wheel, pip install target/wheels/tllm_affinity-*.whl, or pip install ./python \
         from the repository; or drop -S)"
    );
}

fn state_name(state: State) -> &'static str {
    match state {
        State::Active => "active",
        State::Passive => "passive",
        State::Disabled => "disabled",
        State::Off => "off",
        State::Uninitialised | State::Initialising => "initialising",
    }
}
