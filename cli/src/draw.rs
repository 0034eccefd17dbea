//! How the CLI draws what it read: colours, grid marks and headers, escaped text, and the
//! memory, lease and host phrases that `ps`, the host view, `topo` and `plan` share.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal;

use serde_json::{json, Value};

use tllm_affinity_core::host::topology::Topology;
use tllm_affinity_core::registry::{Placement, Role};
use tllm_affinity_core::table::threadtable::LeaseLine;

use crate::memory_reading::NodeMemory;

/// ANSI colours, one per thing the grid tells apart.
pub const BLUE: &str = "\x1b[34m";
pub const GREEN: &str = "\x1b[32m";
pub const YELLOW: &str = "\x1b[33m";
pub const MAGENTA: &str = "\x1b[35m";
pub const CYAN: &str = "\x1b[36m";
pub const RED: &str = "\x1b[31m";
pub const GREY: &str = "\x1b[90m";
pub const RESET: &str = "\x1b[0m";
/// Where a thread may not run.
pub const NOT_ALLOWED: char = '.';

/// Whether to paint: not under `--no-color` or `NO_COLOR`, and only on a terminal.
pub fn wants_colour(no_color: bool) -> bool {
    !no_color
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
        && std::io::stdout().is_terminal()
}

/// `text` painted in ANSI colour `code`.
pub fn paint(text: &str, code: &str) -> String {
    format!("{code}{text}{RESET}")
}

/// One grid cell where a thread may run: a block in its colour, or its letter without colour.
pub fn cell((letter, code): (char, &str), colour: bool) -> String {
    if colour {
        paint("█", code)
    } else {
        letter.to_string()
    }
}

/// `text` (a name or a line another process wrote) safe to print on a terminal: every control
/// character — C0, DEL and C1 — is written `\xNN` (its code point), a backslash `\\`, the
/// characters that reorder text on screen (bidirectional overrides and isolates) `\u{NNNN}`,
/// and a byte that was not UTF-8 (read as U+FFFD) `?`, as procps shows it. The JSON output
/// carries the text exactly (JSON escapes what it must).
pub fn visible(text: &str) -> std::borrow::Cow<'_, str> {
    let reorders = |c: char| matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    let clean = |c: char| !c.is_control() && c != '\\' && c != '\u{fffd}' && !reorders(c);
    if text.chars().all(clean) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if clean(c) => out.push(c),
            '\\' => out.push_str("\\\\"),
            '\u{fffd}' => out.push('?'),
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\u{{{:04x}}}", c as u32);
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

pub fn role_name(known: Option<(Role, Placement)>) -> &'static str {
    match known {
        Some((Role::Host, _)) => "host",
        Some((Role::Worker, _)) => "worker",
        None => "unknown",
    }
}

pub fn placement_name(known: Option<(Role, Placement)>) -> &'static str {
    match known.map(|(_, p)| p) {
        Some(Placement::Inherited) => "inherited",
        Some(Placement::Worker) => "worker",
        Some(Placement::Step) => "step",
        Some(Placement::Result) => "result",
        Some(Placement::Explicit) => "explicit",
        Some(Placement::External) => "external",
        None => "unknown",
    }
}

/// The grid's mark for a thread (a letter without colour) and its ANSI colour. A placement other
/// than the role's own gets its own letter and colour, so a glance tells step from result
/// threads and a mask the application (`x`, cyan) or someone else (`!`, red) chose from one the
/// library chose, with or without colour.
pub fn mark(known: Option<(Role, Placement)>) -> (char, &'static str) {
    let letter = match known {
        Some((_, Placement::Step)) => 's',
        Some((_, Placement::Result)) => 'r',
        Some((_, Placement::Explicit)) => 'x',
        Some((_, Placement::External)) => '!',
        Some((Role::Worker, _)) => 'w',
        Some((Role::Host, _)) => 'h',
        None => '?',
    };
    let colour = match known {
        Some((_, Placement::Step)) => YELLOW,
        Some((_, Placement::Result)) => MAGENTA,
        Some((_, Placement::Explicit)) => CYAN,
        Some((_, Placement::External)) => RED,
        Some((Role::Worker, _)) => GREEN,
        Some((Role::Host, _)) => BLUE,
        None => GREY,
    };
    (letter, colour)
}

/// What a grid mark stands for in the legend: the placement where it has a mark of its own,
/// else the role.
pub fn mark_name(known: Option<(Role, Placement)>) -> &'static str {
    match known.map(|(_, p)| p) {
        Some(
            p @ (Placement::Step | Placement::Result | Placement::Explicit | Placement::External),
        ) => placement_name(Some((Role::Worker, p))),
        _ => role_name(known),
    }
}

/// The legend's items (`s step`, `w worker`, `. not allowed`): each mark in `marks` (in their
/// order, each once) and what it stands for, then `.` with `dot` where the grid prints one.
pub fn legend(marks: &[Option<(Role, Placement)>], dot: Option<&str>, colour: bool) -> Vec<String> {
    let mut seen = Vec::new();
    let mut items = Vec::new();
    for &known in marks {
        let m = mark(known);
        if seen.contains(&m.0) {
            continue;
        }
        seen.push(m.0);
        items.push(format!("{} {}", cell(m, colour), mark_name(known)));
    }
    if let Some(dot) = dot {
        items.push(format!("{NOT_ALLOWED} {dot}"));
    }
    items
}

/// Two header lines over the grid's columns: CPU numbers at every tenth CPU (where they fit),
/// then each CPU's last digit.
pub fn grid_header(cpus: &[usize]) -> (String, String) {
    let mut labels = vec![' '; cpus.len()];
    let mut free_from = 0;
    for (col, &cpu) in cpus.iter().enumerate() {
        if col < free_from || (cpu % 10 != 0 && col != 0) {
            continue;
        }
        let text = cpu.to_string();
        if col + text.len() > cpus.len() && col != 0 {
            continue;
        }
        for (i, ch) in text.chars().enumerate() {
            if let Some(slot) = labels.get_mut(col + i) {
                *slot = ch;
            }
        }
        free_from = col + text.len() + 1;
    }
    let digits = cpus
        .iter()
        .map(|c| char::from(b'0' + (c % 10) as u8))
        .collect();
    (
        labels
            .into_iter()
            .collect::<String>()
            .trim_end()
            .to_string(),
        digits,
    )
}

/// What a lease is on: `GPU 0 (0000:3b:00.0)`, or the `TLLM_AFFINITY_CPUS` that chose its CPUs.
pub fn lease_device(lease: &LeaseLine) -> String {
    match lease.gpu_index {
        Some(index) => format!("GPU {index} ({})", lease.device),
        None => lease.device.clone(),
    }
}

/// A lease as `--json` gives it.
pub fn lease_json(lease: &LeaseLine) -> Value {
    let mut v = json!({ "lease": lease.id, "gpu": lease.gpu_index, "device": lease.device });
    if let Some(slice) = &lease.slice {
        v["slice"] = json!(slice.to_list());
    }
    v
}

/// `memory per node: node 0 1.0 GiB, node 1 12.0 MiB (from ...)`, or why not.
pub fn memory_line(memory: &Result<NodeMemory, String>) -> String {
    match memory {
        Ok(m) => {
            let partial = m
                .partial
                .as_deref()
                .map(|p| format!("; partial: {p}"))
                .unwrap_or_default();
            format!(
                "memory per node: {} (resident, from {}{partial})",
                per_node(&m.bytes),
                m.source
            )
        }
        Err(why) => format!("memory per node: not readable ({why})"),
    }
}

pub fn memory_json(memory: &Result<NodeMemory, String>) -> Value {
    match memory {
        Ok(m) => json!({
            "bytes_per_node": m.bytes.iter().map(|(n, b)| (n.to_string(), json!(b))).collect::<serde_json::Map<_, _>>(),
            "source": m.source,
            "partial": m.partial,
        }),
        Err(why) => json!({ "error": format!("memory per node: not readable ({why})") }),
    }
}

/// `node 0 12.0 MiB, node 1 1.5 GiB`.
pub fn per_node(bytes: &BTreeMap<usize, u64>) -> String {
    if bytes.is_empty() {
        return "no resident pages".into();
    }
    bytes
        .iter()
        .map(|(node, b)| format!("node {node} {}", human(*b)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `1.5 GiB`.
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

/// `8 cores, 2 NUMA node(s), 4 GPU(s)`: the host in numbers, after its online CPUs (`topo` and
/// `plan` both say it).
pub fn host_counts(t: &Topology) -> String {
    format!(
        "{} cores, {} NUMA node(s), {} GPU(s)",
        t.cores().len(),
        t.nodes.len(),
        t.gpus.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_labels_every_tenth_cpu() {
        let (labels, digits) = grid_header(&(0..23).collect::<Vec<_>>());
        assert_eq!(labels, "0         10        20");
        assert_eq!(digits, "01234567890123456789012");
        let (labels, _) = grid_header(&[0, 1]);
        assert_eq!(labels, "0");
    }

    /// Whatever another process names itself, its text form holds no control character, no
    /// character that reorders the line, and tells apart what it escaped from what it did not.
    #[test]
    fn any_name_is_printed_without_a_control_character() {
        use proptest::prelude::*;
        let names = prop_oneof![
            any::<String>(),
            "[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}\\u{202a}-\\u{202e}a\\\\]{0,20}",
        ];
        proptest::test_runner::TestRunner::default()
            .run(&names, |name| {
                let shown = visible(&name);
                prop_assert!(
                    !shown
                        .chars()
                        .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c)),
                    "{shown:?}"
                );
                if !name.contains(|c: char| c.is_control() || c == '\\' || c > '\u{ff}') {
                    prop_assert_eq!(shown.as_ref(), name.as_str());
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(
            visible("\x1b]0;pwned\x07\x1b[2J"),
            r"\x1b]0;pwned\x07\x1b[2J"
        );
        assert_eq!(visible("a\\x1b\u{9b}\u{fffd}"), r"a\\x1b\x9b?");
    }
}
