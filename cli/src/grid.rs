//! The grid and the text around it at the terminal's width, for `ps PID` and the host view: how
//! wide the output may be, which CPUs each column of the grid stands for (one CPU a column where
//! the host fits, else whole cores of one node a column), the header over the columns, and prose
//! wrapped between words. Nothing here is cut: a number, a range or a word stays whole.

use tllm_affinity_core::host::topology::Topology;
use tllm_affinity_core::mask::CpuMask;

/// The width used when neither `COLUMNS` nor a terminal gives one.
pub const DEFAULT_WIDTH: usize = 120;
/// Columns between the groups (nodes) of a grid.
const GAP: usize = 1;

/// How wide the output may be: `COLUMNS` (as shells export it), else the width of the terminal
/// on stdout, else [`DEFAULT_WIDTH`]. A `COLUMNS` that is not a positive number is one line on
/// stderr and is passed over.
pub fn width() -> usize {
    let columns = std::env::var("COLUMNS").ok();
    let (width, complaint) = width_from(
        columns.as_deref(),
        tllm_affinity_core::sys::terminal_columns(1),
    );
    if let Some(complaint) = complaint {
        eprintln!("tllm-affinity: {complaint}");
    }
    width
}

/// [`width`] from `COLUMNS`' value and the terminal's width: the width, and the line to print
/// when `COLUMNS` is set to something that is not a positive number.
pub fn width_from(columns: Option<&str>, terminal: Option<usize>) -> (usize, Option<String>) {
    let fallback = terminal.unwrap_or(DEFAULT_WIDTH);
    match columns.map(str::trim) {
        None | Some("") => (fallback, None),
        Some(text) => match text.parse::<usize>() {
            Ok(n) if n > 0 => (n, None),
            _ => (
                fallback,
                Some(format!(
                    "COLUMNS={text:?} is not a positive number of columns; using {fallback}"
                )),
            ),
        },
    }
}

/// The CPUs of one NUMA node of the sysfs tree read (`None`: CPUs no node lists).
#[derive(Debug, Clone)]
pub struct CpuGroup {
    pub node: Option<usize>,
    pub cpus: Vec<usize>,
}

/// The grid's column groups: each node's CPUs among those shown (the online CPUs of the tree and
/// every CPU a thread may run on), then any CPU no node lists.
pub fn groups(topology: Option<&Topology>, masks: &CpuMask) -> Vec<CpuGroup> {
    let online = topology.map(|t| t.online.clone()).unwrap_or_else(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|t| CpuMask::parse_list(&t).ok())
            .unwrap_or_default()
    });
    let all = online.union(masks);
    let mut placed = CpuMask::default();
    let mut groups = Vec::new();
    for node in topology.map(|t| t.nodes.as_slice()).unwrap_or_default() {
        let cpus = node.cpus.intersection(&all);
        if cpus.is_empty() {
            continue;
        }
        placed = placed.union(&cpus);
        groups.push(CpuGroup {
            node: Some(node.id),
            cpus: cpus.iter().collect(),
        });
    }
    let rest: Vec<usize> = all.iter().filter(|&c| !placed.contains(c)).collect();
    if !rest.is_empty() {
        groups.push(CpuGroup {
            node: None,
            cpus: rest,
        });
    }
    groups
}

/// One group of the grid (a node's CPUs, or those no node lists) as columns: the CPUs each
/// column stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnGroup {
    pub node: Option<usize>,
    pub columns: Vec<CpuMask>,
}

/// The grid's columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub groups: Vec<ColumnGroup>,
    /// How many cores a column stands for; 0 where a column is one CPU.
    pub cores_per_column: usize,
}

impl Layout {
    /// The grid's width in characters, the gaps between groups included.
    pub fn width(&self) -> usize {
        let columns: usize = self.groups.iter().map(|g| g.columns.len()).sum();
        columns + GAP * self.groups.len().saturating_sub(1)
    }

    /// The most CPUs one column stands for.
    pub fn most_cpus_per_column(&self) -> usize {
        self.groups
            .iter()
            .flat_map(|g| g.columns.iter().map(CpuMask::count))
            .max()
            .unwrap_or(1)
    }

    /// The grid row for one process or thread: each column's mark, `mark_of` choosing it from
    /// the column's CPUs (`None`: not allowed there).
    pub fn row(&self, mut mark_of: impl FnMut(&CpuMask) -> Option<String>) -> String {
        let mut out = String::new();
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                out.push_str(&" ".repeat(GAP));
            }
            for column in &g.columns {
                match mark_of(column) {
                    Some(mark) => out.push_str(&mark),
                    None => out.push(crate::draw::NOT_ALLOWED),
                }
            }
        }
        out
    }

    /// What a column stands for, for the legend: `None` where a column is one CPU.
    pub fn scale(&self) -> Option<String> {
        (self.cores_per_column > 0).then(|| {
            let cores = self.cores_per_column;
            format!(
                "a column is {cores} core{} of one node (up to {} CPUs, siblings included), numbered by its first CPU",
                if cores == 1 { "" } else { "s" },
                self.most_cpus_per_column()
            )
        })
    }

    /// The three lines over the columns: each group's node (`-` for CPUs no node lists); CPU
    /// numbers where they fit (every tenth CPU, or each column's first CPU); then each CPU's last
    /// digit, or `+` under a numbered column and `-` under the others.
    pub fn header(&self) -> [String; 3] {
        let mut nodes = String::new();
        let mut labels = String::new();
        let mut ticks = String::new();
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                for line in [&mut nodes, &mut labels, &mut ticks] {
                    line.push_str(&" ".repeat(GAP));
                }
            }
            let w = g.columns.len();
            let node = g.node.map_or_else(|| "-".to_string(), |n| n.to_string());
            nodes.push_str(&format!("{node:<w$}"));
            let firsts: Vec<usize> = g.columns.iter().filter_map(CpuMask::first).collect();
            let (l, t) = if self.cores_per_column == 0 {
                crate::draw::grid_header(&firsts)
            } else {
                numbered_columns(&firsts)
            };
            labels.push_str(&format!("{l:<w$}"));
            ticks.push_str(&t);
        }
        [
            nodes.trim_end().to_string(),
            labels.trim_end().to_string(),
            ticks,
        ]
    }
}

/// Each column's first CPU written over it where the number fits (a space after each), and a
/// tick line: `+` under a numbered column, `-` under the others.
fn numbered_columns(firsts: &[usize]) -> (String, String) {
    let mut labels = vec![' '; firsts.len()];
    let mut ticks = vec!['-'; firsts.len()];
    let mut free_from = 0;
    for (col, cpu) in firsts.iter().enumerate() {
        let text = cpu.to_string();
        if col < free_from || col + text.len() > firsts.len() {
            continue;
        }
        for (i, ch) in text.chars().enumerate() {
            labels[col + i] = ch;
        }
        ticks[col] = '+';
        free_from = col + text.len() + 1;
    }
    (labels.into_iter().collect(), ticks.into_iter().collect())
}

/// The columns for `groups` within `room` characters: one CPU a column where they fit; else
/// each node's cores (`cores`: SMT sibling sets; a CPU none lists is a core of its own), in
/// order of their first CPU, as few to a column as fit, never a column across two nodes. Where
/// even one column a node does not fit, one column a node.
pub fn layout(groups: &[CpuGroup], cores: &[CpuMask], room: usize) -> Layout {
    let per_cpu = Layout {
        groups: groups
            .iter()
            .map(|g| ColumnGroup {
                node: g.node,
                columns: g.cpus.iter().map(|&c| CpuMask::from_cpus([c])).collect(),
            })
            .collect(),
        cores_per_column: 0,
    };
    if per_cpu.width() <= room {
        return per_cpu;
    }
    // Each group's cores: the CPUs of the group that share a core, in order of their first CPU.
    let grouped_cores: Vec<Vec<CpuMask>> = groups
        .iter()
        .map(|g| {
            let cpus = CpuMask::from_cpus(g.cpus.iter().copied());
            let mut seen = CpuMask::default();
            let mut out = Vec::new();
            for &cpu in &g.cpus {
                if seen.contains(cpu) {
                    continue;
                }
                let core = cores
                    .iter()
                    .find(|c| c.contains(cpu))
                    .map(|c| c.intersection(&cpus))
                    .unwrap_or_else(|| CpuMask::from_cpus([cpu]));
                seen = seen.union(&core);
                out.push(core);
            }
            out
        })
        .collect();
    let most_cores = grouped_cores.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let at = |per: usize| Layout {
        groups: groups
            .iter()
            .zip(&grouped_cores)
            .map(|(g, cores)| ColumnGroup {
                node: g.node,
                columns: cores
                    .chunks(per)
                    .map(|chunk| chunk.iter().fold(CpuMask::default(), |a, c| a.union(c)))
                    .collect(),
            })
            .collect(),
        cores_per_column: per,
    };
    (1..=most_cores)
        .map(at)
        .find(|l| l.width() <= room)
        .unwrap_or_else(|| at(most_cores))
}

/// How many characters `text` takes on a terminal: its characters, ANSI colour sequences left
/// out.
pub fn shown_width(text: &str) -> usize {
    let mut width = 0;
    let mut in_escape = false;
    for c in text.chars() {
        match (in_escape, c) {
            (false, '\x1b') => in_escape = true,
            (false, _) => width += 1,
            (true, 'm') => in_escape = false,
            (true, _) => {}
        }
    }
    width
}

/// `text` in lines of at most `width` characters, broken after a space or a comma, each line
/// after the first indented by `indent` spaces; a word longer than a line is left whole on a
/// line of its own. Ends without a newline.
pub fn wrap(text: &str, width: usize, indent: usize) -> String {
    if shown_width(text) <= width {
        return text.to_string();
    }
    // Pieces that end where a line may break: after a space or a comma.
    let mut pieces = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c == ' ' || c == ',' {
            pieces.push(&text[start..i + 1]);
            start = i + 1;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for piece in pieces {
        let room = if lines.is_empty() {
            width
        } else {
            width.saturating_sub(indent)
        };
        let taken = shown_width(&line) + shown_width(piece.trim_end());
        if !line.trim().is_empty() && taken > room {
            lines.push(line.trim_end().to_string());
            line = String::new();
        }
        if line.is_empty() && !lines.is_empty() && piece.trim().is_empty() {
            continue;
        }
        line.push_str(piece);
    }
    if !line.trim().is_empty() {
        lines.push(line.trim_end().to_string());
    }
    let pad = " ".repeat(indent);
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                l.clone()
            } else {
                format!("{pad}{l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `head` then `items` two spaces apart, in lines of at most `width` characters broken only
/// between items (a mark and its meaning stay together), each line after the first indented by
/// `indent` spaces. Ends without a newline.
pub fn wrap_items(head: &str, items: &[String], width: usize, indent: usize) -> String {
    let mut out = head.to_string();
    let mut line = shown_width(head);
    for (i, item) in items.iter().enumerate() {
        let sep = if i == 0 { " " } else { "  " };
        let w = shown_width(item);
        if line + sep.len() + w > width && line > indent {
            out.push('\n');
            out.push_str(&" ".repeat(indent));
            out.push_str(item);
            line = indent + w;
        } else {
            out.push_str(sep);
            out.push_str(item);
            line += sep.len() + w;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(list: &str) -> CpuMask {
        CpuMask::parse_list(list).unwrap()
    }

    /// An 8×H100-shaped host: two nodes of 56 cores, CPU `c` and `c + 112` one core.
    fn h100() -> (Vec<CpuGroup>, Vec<CpuMask>) {
        let cores: Vec<CpuMask> = (0..112).map(|c| CpuMask::from_cpus([c, c + 112])).collect();
        let groups = (0..2)
            .map(|n| CpuGroup {
                node: Some(n),
                cpus: m(&format!(
                    "{}-{},{}-{}",
                    56 * n,
                    56 * n + 55,
                    112 + 56 * n,
                    112 + 56 * n + 55
                ))
                .iter()
                .collect(),
            })
            .collect();
        (groups, cores)
    }

    #[test]
    fn width_is_columns_else_the_terminal_else_120_and_a_bad_columns_is_one_line() {
        assert_eq!(width_from(Some("80"), Some(200)), (80, None));
        assert_eq!(width_from(None, Some(200)), (200, None));
        assert_eq!(width_from(None, None), (120, None));
        assert_eq!(width_from(Some(""), None), (120, None));
        let (w, complaint) = width_from(Some("wide"), None);
        assert_eq!(w, 120);
        assert_eq!(
            complaint.as_deref(),
            Some("COLUMNS=\"wide\" is not a positive number of columns; using 120")
        );
        assert!(width_from(Some("0"), Some(90)).1.is_some());
    }

    #[test]
    fn a_host_that_fits_gets_a_column_a_cpu() {
        let groups = vec![CpuGroup {
            node: Some(0),
            cpus: (0..8).collect(),
        }];
        let l = layout(&groups, &[], 8);
        assert_eq!(l.cores_per_column, 0);
        assert_eq!(l.width(), 8);
        assert_eq!(l.header()[2], "01234567");
    }

    /// 224 CPUs in 60 columns: whole cores per column, siblings together, each node apart, and
    /// every CPU in exactly one column.
    #[test]
    fn a_large_host_is_grouped_by_node_and_core_within_the_room() {
        let (groups, cores) = h100();
        for room in [20, 60, 113, 200] {
            let l = layout(&groups, &cores, room);
            assert!(l.width() <= room, "{room}: {}", l.width());
            let mut all = CpuMask::default();
            for g in &l.groups {
                let node = CpuMask::from_cpus(groups[g.node.unwrap()].cpus.iter().copied());
                for column in &g.columns {
                    assert!(column.is_subset(&node), "a column across nodes");
                    for c in column.iter() {
                        assert!(column.contains((c + 112) % 224), "siblings apart");
                    }
                    assert!(all.intersection(column).is_empty());
                    all = all.union(column);
                }
            }
            assert_eq!(all.count(), 224);
        }
        let l = layout(&groups, &cores, 60);
        assert_eq!(l.cores_per_column, 2);
        let [nodes, labels, ticks] = l.header();
        assert!(nodes.starts_with("0 "), "{nodes}");
        assert!(labels.starts_with("0 4 8"), "{labels}");
        assert_eq!(ticks.len(), l.width());
        assert_eq!(
            l.scale().unwrap(),
            "a column is 2 cores of one node (up to 4 CPUs, siblings included), numbered by its first CPU"
        );
        // No room at all: one column a node, never nothing.
        assert_eq!(layout(&groups, &cores, 1).width(), 3);
    }

    #[test]
    fn wrapped_text_breaks_between_words_and_keeps_each_whole() {
        let text =
            "flag: workers of 1 on GPU 0 (0000:3b:00.0) and 2 on GPU 1 share CPUs 0-55,112-167";
        let wrapped = wrap(text, 30, 4);
        for line in wrapped.lines() {
            assert!(line.len() <= 30, "{line:?}");
        }
        assert_eq!(
            wrapped.split_whitespace().collect::<String>(),
            text.split_whitespace().collect::<String>()
        );
        assert!(wrapped.contains("(0000:3b:00.0)"), "{wrapped}");
        assert_eq!(wrap("short", 30, 4), "short");
        // A word longer than the line stays whole.
        assert_eq!(wrap("a 0123456789 b", 6, 2), "a\n  0123456789\n  b");
        assert_eq!(shown_width("\x1b[32m█\x1b[0m w"), 3);
        let items = ["s step", "w worker", ". none (a CPU shows the first)"].map(String::from);
        assert_eq!(
            wrap_items("legend:", &items, 30, 8),
            "legend: s step  w worker\n        . none (a CPU shows the first)"
        );
    }
}
