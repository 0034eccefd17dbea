//! The host view drawn: the process table, the grid of the host's CPUs, the flags, and the
//! same as JSON. Reads a [`HostView`]; judges nothing.

use std::fmt::Write as _;

use serde_json::{json, Value};

use tllm_affinity_core::mask::CpuMask;

use tllm_affinity_core::registry::{Placement, Role};

use super::model::*;
use crate::draw::{self, visible};
use crate::grid::wrap;

/// `-` for no CPU.
fn list_or_dash(cpus: &CpuMask) -> String {
    if cpus.is_empty() {
        "-".into()
    } else {
        cpus.to_list()
    }
}

fn command_of(r: &ProcessRow) -> String {
    match r.namespace_pid {
        Some(inner) => format!("{} (pid {inner} inside)", r.command),
        None => r.command.clone(),
    }
}

fn threads_of(r: &ProcessRow) -> String {
    // Host first: the order a reader counts a server's threads in.
    [
        Kind::Host,
        Kind::Worker,
        Kind::Step,
        Kind::Result,
        Kind::Unknown,
    ]
    .iter()
    .filter_map(|k| r.threads.get(k).map(|n| format!("{n} {}", k.name())))
    .collect::<Vec<_>>()
    .join(", ")
}

fn memory_of(r: &ProcessRow) -> String {
    match &r.memory {
        Ok(m) => {
            let partial = if m.partial.is_some() {
                " (partial)"
            } else {
                ""
            };
            format!("{}{partial}", draw::per_node(&m.bytes))
        }
        Err(why) => format!("not readable ({why})"),
    }
}

/// The host view as text within `width` columns: the processes (a table where it fits, else a
/// few lines each), those not shown, the grid ([`grid`]), the flags and notes, wrapped between
/// words.
pub fn to_text(v: &HostView, colour: bool, width: usize) -> String {
    let mut out = String::new();
    let shown = rows(&v.entries).count();
    let heading = format!(
        "{shown} process{} with a thread table (roles and leases from each table, masks from the kernel)",
        if shown == 1 { "" } else { "es" }
    );
    let _ = writeln!(out, "{}", wrap(&heading, width, 2));
    let header = [
        "PID",
        "COMMAND",
        "GPU",
        "WORKERS",
        "STEP",
        "RESULT",
        "THREADS",
        "MEMORY PER NODE",
    ]
    .map(String::from);
    let mut table: Vec<[String; 8]> = Vec::new();
    if shown > 0 {
        table.push(header.clone());
    }
    for e in &v.entries {
        if let Entry::Row(r) = e {
            // Commands and errors are another process's strings: escaped (no colour here).
            table.push(
                [
                    r.pid.to_string(),
                    command_of(r),
                    r.gpus(),
                    list_or_dash(&r.on(Kind::Worker)),
                    list_or_dash(&r.on(Kind::Step)),
                    list_or_dash(&r.on(Kind::Result)),
                    threads_of(r),
                    memory_of(r),
                ]
                .map(|cell| visible(&cell).into_owned()),
            );
        }
    }
    let widths: Vec<usize> = (0..8)
        .map(|c| {
            table
                .iter()
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let lines: Vec<String> = table
        .iter()
        .map(|r| {
            let mut line = format!("{:>w$}", r[0], w = widths[0].max(8));
            for (c, cell) in r.iter().enumerate().skip(1) {
                let _ = write!(line, "  {cell:<w$}", w = widths[c]);
            }
            line.trim_end().to_string()
        })
        .collect();
    if lines.iter().all(|l| l.chars().count() <= width) {
        for line in lines {
            let _ = writeln!(out, "{line}");
        }
    } else {
        // Too wide for a table: each process a few lines, each value after its column's name.
        for r in table.iter().skip(1) {
            let _ = writeln!(
                out,
                "{}",
                wrap(&format!("{:>8}  {}", r[0], r[1]), width, 10)
            );
            let pinned = format!(
                "{}: {}; {}: {}; {}: {}",
                header[3].to_lowercase(),
                r[3],
                header[4].to_lowercase(),
                r[4],
                header[5].to_lowercase(),
                r[5]
            );
            for detail in [
                format!("{}: {}", header[2], r[2]),
                pinned,
                format!("{}: {}", header[6].to_lowercase(), r[6]),
                format!("{}: {}", header[7].to_lowercase(), r[7]),
            ] {
                let _ = writeln!(out, "{}", wrap(&format!("{:10}{detail}", ""), width, 12));
            }
        }
    }
    for e in &v.entries {
        if let Entry::Line(l) = e {
            let command = visible(l.command.as_deref().unwrap_or("?"));
            let why = visible(&l.why);
            let line = format!("{:>8}  {command}: not shown: {why}", l.pid);
            let _ = writeln!(out, "{}", wrap(&line, width, 10));
        }
    }
    if shown > 0 {
        out.push('\n');
        out.push_str(&grid(v, colour, width));
    }
    if v.flags.is_empty() {
        let _ = writeln!(out, "flags: none");
    }
    for f in &v.flags {
        let line = format!("flag: {}", visible(&f.text));
        let _ = writeln!(out, "{}", wrap(&line, width, 6));
    }
    if v.unreachable > 0 {
        let note = format!(
            "note: {} process{} in other PID namespaces could not be looked into (their root is not yours to read)",
            v.unreachable,
            if v.unreachable == 1 { "" } else { "es" }
        );
        let _ = writeln!(out, "{}", wrap(&note, width, 6));
    }
    out
}

/// What a grid cell can show for a process, most particular first: a CPU (or a column) shows
/// the first of these the process's threads may run on.
fn layers(r: &ProcessRow) -> Vec<(Option<(Role, Placement)>, CpuMask)> {
    let kind = |k: Kind| (k.known(), r.on(k));
    vec![
        kind(Kind::Step),
        kind(Kind::Result),
        (
            Some((Role::Worker, Placement::External)),
            r.external.clone(),
        ),
        (
            Some((Role::Worker, Placement::Explicit)),
            r.explicit.clone(),
        ),
        kind(Kind::Worker),
        kind(Kind::Host),
        kind(Kind::Unknown),
    ]
}

/// The host's CPUs grouped by NUMA node, one row per process shown: at each CPU (or each column
/// of whole cores, where one CPU a column does not fit in `width`) the most particular thing
/// its threads may do there; the legend names only the marks the grid prints.
fn grid(v: &HostView, colour: bool, width: usize) -> String {
    let mut out = String::new();
    let shown: Vec<&ProcessRow> = rows(&v.entries).collect();
    let w_name = shown
        .iter()
        .map(|r| visible(&r.command).chars().count())
        .max()
        .unwrap_or(0)
        .max(7);
    let prefix = |pid: &str, name: &str| format!("{pid:>8}  {name:<w_name$}  ");
    let room = width.saturating_sub(prefix("", "").len());
    let layout = crate::grid::layout(&v.groups, &v.cores, room);
    let [nodes, labels, ticks] = layout.header();
    let _ = writeln!(out, "{}{nodes}", prefix("", "NODE"));
    let _ = writeln!(out, "{}{labels}", prefix("", ""));
    let _ = writeln!(out, "{}{ticks}", prefix("PID", "COMMAND"));
    let mut printed = Vec::new();
    let mut dot = false;
    for r in &shown {
        let layers = layers(r);
        let cells = layout.row(|column| {
            let (known, _) = layers
                .iter()
                .find(|(_, cpus)| !cpus.intersection(column).is_empty())?;
            if !printed.contains(known) {
                printed.push(*known);
            }
            Some(draw::cell(draw::mark(*known), colour))
        });
        dot |= cells.contains(draw::NOT_ALLOWED);
        let _ = writeln!(
            out,
            "{}{cells}",
            prefix(&r.pid.to_string(), &visible(&r.command))
        );
    }
    // The legend in the grid's order of precedence.
    let order: Vec<Option<(Role, Placement)>> = shown
        .first()
        .map(|r| layers(r).into_iter().map(|(k, _)| k).collect())
        .unwrap_or_default();
    printed.sort_by_key(|k| order.iter().position(|o| o == k));
    let what = if layout.cores_per_column == 0 {
        "a CPU"
    } else {
        "a column"
    };
    let mut items = draw::legend(&printed, dot.then_some("none"), colour);
    items.push(format!(
        "({what} shows the first of these its threads may run on)"
    ));
    let _ = writeln!(
        out,
        "{}",
        crate::grid::wrap_items("legend:", &items, width, 8)
    );
    if let Some(scale) = layout.scale() {
        let _ = writeln!(out, "{}", wrap(&scale, width, 2));
    }
    out
}

pub fn to_json(v: &HostView) -> Value {
    let processes: Vec<Value> = v
        .entries
        .iter()
        .map(|e| match e {
            Entry::Row(r) => json!({
                "pid": r.pid,
                "namespace_pid": r.namespace_pid,
                "command": r.command,
                "leases": match &r.leases {
                    Ok(leases) => json!(leases.iter().map(draw::lease_json).collect::<Vec<_>>()),
                    Err(why) => json!({ "error": why }),
                },
                "worker_cpus": r.on(Kind::Worker).to_list(),
                "step_cpus": r.on(Kind::Step).to_list(),
                "result_cpus": r.on(Kind::Result).to_list(),
                "host_cpus": r.on(Kind::Host).to_list(),
                "explicit_cpus": r.explicit.to_list(),
                "external_cpus": r.external.to_list(),
                "threads": r.threads.iter().map(|(k, n)| (k.name().to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
                "memory": draw::memory_json(&r.memory),
            }),
            Entry::Line(l) => json!({
                "pid": l.pid,
                "command": l.command,
                "error": l.why,
            }),
        })
        .collect();
    let mut cpus = Vec::new();
    for g in &v.groups {
        for &cpu in &g.cpus {
            let on: Vec<Value> = rows(&v.entries)
                .filter_map(|r| {
                    let roles: Vec<&str> = Kind::ALL
                        .iter()
                        .filter(|k| r.cpus.get(k).is_some_and(|m| m.contains(cpu)))
                        .map(|k| k.name())
                        .collect();
                    (!roles.is_empty()).then(|| json!({ "pid": r.pid, "roles": roles }))
                })
                .collect();
            cpus.push(json!({ "cpu": cpu, "node": g.node, "processes": on }));
        }
    }
    json!({
        "processes": processes,
        "nodes": v.groups.iter().map(|g| json!({
            "node": g.node,
            "cpus": CpuMask::from_cpus(g.cpus.iter().copied()).to_list(),
        })).collect::<Vec<_>>(),
        "cpus": cpus,
        "flags": v.flags.iter().map(|f| json!({
            "kind": f.kind,
            "pids": f.pids,
            "cpus": f.cpus.to_list(),
            "text": f.text,
        })).collect::<Vec<_>>(),
        "not_looked_into": v.unreachable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::model::tests::*;
    use serde_json::json;

    #[test]
    fn the_grid_groups_cpus_by_node_and_shows_the_most_particular_role() {
        let (_, nodes) = host();
        let r = row(
            7,
            &[GPU0],
            &[
                (Kind::Host, "0-15"),
                (Kind::Worker, "8-15"),
                (Kind::Step, "8"),
            ],
            &[],
        );
        let view = HostView {
            entries: vec![
                Entry::Row(r),
                Entry::Line(ProcessLine {
                    pid: 9,
                    command: Some("other".into()),
                    why: "exited while it was read".into(),
                }),
            ],
            unreachable: 2,
            readers_stuck: 0,
            groups: nodes
                .iter()
                .map(|(id, cpus)| CpuGroup {
                    node: Some(*id),
                    cpus: cpus.iter().collect(),
                })
                .collect(),
            cores: Vec::new(),
            flags: Vec::new(),
            kernel_nodes: nodes,
        };
        let text = to_text(&view, false, 120);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines.iter().any(|l| l.ends_with("  hhhhhhhh swwwwwww")),
            "{text}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.trim_start().starts_with("NODE     0        1")),
            "{text}"
        );
        assert!(
            lines.contains(&"       9  other: not shown: exited while it was read"),
            "{text}"
        );
        assert!(text.contains("flags: none"), "{text}");
        assert!(
            text.contains("note: 2 processes in other PID namespaces"),
            "{text}"
        );
        let v = to_json(&view);
        assert_eq!(v["processes"][0]["step_cpus"], "8");
        assert_eq!(v["processes"][1]["error"], "exited while it was read");
        assert_eq!(
            v["cpus"][8]["processes"][0]["roles"],
            json!(["step", "worker", "host"])
        );
        assert_eq!(v["not_looked_into"], 2);
    }
}
