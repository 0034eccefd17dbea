//! The report the C ABI's `tllm_affinity_report` and the exit report (`TLLM_AFFINITY_REPORT`)
//! give: [`crate::report`] built over the registry, with what language adapters said about
//! themselves (`tllm_affinity_note_adapter`, `_detail`), which only the report shows.

use super::state::{lock_registry, State, LOAD_FACTS};
use super::{exec, move_memory};
use std::sync::atomic::AtomicU64;

use crate::lock::EngineLock;
use crate::registry::Registry;
use crate::report::Report;
use crate::sys;

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
pub(super) static NOTES: EngineLock<Option<(&'static [AtomicU64], &'static [AtomicU64])>> =
    EngineLock::new(None);

/// The table has just been mapped (or, `None`, is the parent's in a fork child): notes given
/// before it (an adapter that engaged at import) are shown at once. Under the adapters' lock, as
/// every write of the notes is, so an older text never overwrites a newer one; the fork handlers
/// take ADAPTERS before NOTES too.
pub(super) fn notes_go_to(view: Option<(&'static [AtomicU64], &'static [AtomicU64])>) {
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
    if let Some((header, notes)) = *NOTES.lock() {
        crate::threadtable::write_notes(header, notes, &text);
    }
}

/// A JSON snapshot of the process as the library sees it in `state`, with the kernel's current
/// masks and what the adapters said.
pub(super) fn json(state: State) -> String {
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
    report.memory_moved = move_memory::reported();
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
