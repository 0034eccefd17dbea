//! The host view drawn: the process table, the grid of the host's CPUs, the flags, and the
//! same as JSON. Reads a [`HostView`]; judges nothing.

use std::fmt::Write as _;

use serde_json::{json, Value};

use tllm_affinity_core::mask::CpuMask;

use super::model::*;
use crate::draw::{self, visible};

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

pub fn to_text(v: &HostView, colour: bool) -> String {
    let mut out = String::new();
    let shown = rows(&v.entries).count();
    let _ = writeln!(
        out,
        "{shown} process{} with a thread table (roles and leases from each table, masks from the kernel)",
        if shown == 1 { "" } else { "es" }
    );
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
        table.push(header);
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
    for r in &table {
        let mut line = format!("{:>w$}", r[0], w = widths[0].max(8));
        for (c, cell) in r.iter().enumerate().skip(1) {
            let _ = write!(line, "  {cell:<w$}", w = widths[c]);
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    for e in &v.entries {
        if let Entry::Line(l) = e {
            let command = visible(l.command.as_deref().unwrap_or("?"));
            let why = visible(&l.why);
            let _ = writeln!(out, "{:>8}  {command}: not shown: {why}", l.pid);
        }
    }
    if shown > 0 {
        out.push('\n');
        out.push_str(&grid(v, colour));
    }
    if v.flags.is_empty() {
        let _ = writeln!(out, "flags: none");
    }
    for f in &v.flags {
        let _ = writeln!(out, "flag: {}", visible(&f.text));
    }
    if v.unreachable > 0 {
        let _ = writeln!(
            out,
            "note: {} process{} in other PID namespaces could not be looked into (their root is not yours to read)",
            v.unreachable,
            if v.unreachable == 1 { "" } else { "es" }
        );
    }
    out
}

/// The host's CPUs grouped by NUMA node, one row per process shown: at each CPU the most
/// particular thing its threads may do there.
fn grid(v: &HostView, colour: bool) -> String {
    let mut out = String::new();
    let shown: Vec<&ProcessRow> = rows(&v.entries).collect();
    let w_name = shown
        .iter()
        .map(|r| visible(&r.command).chars().count())
        .max()
        .unwrap_or(0)
        .max(7);
    let prefix = |pid: &str, name: &str| format!("{pid:>8}  {name:<w_name$}  ");
    let mut nodes = String::new();
    let mut labels = String::new();
    let mut digits = String::new();
    for (i, g) in v.groups.iter().enumerate() {
        if i > 0 {
            nodes.push(' ');
            labels.push(' ');
            digits.push(' ');
        }
        let (l, d) = draw::grid_header(&g.cpus);
        let node = g.node.map_or_else(|| "-".to_string(), |n| n.to_string());
        nodes.push_str(&format!("{node:<w$}", w = g.cpus.len()));
        labels.push_str(&format!("{l:<w$}", w = g.cpus.len()));
        digits.push_str(&d);
    }
    let _ = writeln!(out, "{}{}", prefix("", "NODE"), nodes.trim_end());
    let _ = writeln!(out, "{}{}", prefix("", ""), labels.trim_end());
    let _ = writeln!(out, "{}{digits}", prefix("PID", "COMMAND"));
    for r in &shown {
        let mut cells = String::new();
        for (i, g) in v.groups.iter().enumerate() {
            if i > 0 {
                cells.push(' ');
            }
            for &cpu in &g.cpus {
                let kind = Kind::ALL
                    .into_iter()
                    .find(|k| r.cpus.get(k).is_some_and(|m| m.contains(cpu)));
                match kind {
                    Some(kind) => cells.push_str(&draw::cell(draw::mark(kind.known()), colour)),
                    None => cells.push(draw::NOT_ALLOWED),
                }
            }
        }
        let _ = writeln!(
            out,
            "{}{cells}",
            prefix(&r.pid.to_string(), &visible(&r.command))
        );
    }
    let legend: Vec<String> = Kind::ALL
        .iter()
        .map(|k| format!("{} {}", draw::cell(draw::mark(k.known()), colour), k.name()))
        .collect();
    let _ = writeln!(
        out,
        "legend: {}  {} none (a CPU shows the first of these its threads may run on)",
        legend.join("  "),
        draw::NOT_ALLOWED
    );
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
            flags: Vec::new(),
            kernel_nodes: nodes,
        };
        let text = to_text(&view, false);
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
