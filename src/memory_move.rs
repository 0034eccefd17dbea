//! Memory follows a dedicated worker (SPEC §15): whether a configure moves the process's pages,
//! from which nodes to which, and which mappings the engine walks to do it.
//!
//! A worker pinned late (after the interpreter, the framework and the communication stack have
//! run) has part of its memory on another node. In a dedicated worker process every page is the
//! worker's, so the engine moves the pages on the other nodes with CPUs to the node the worker
//! set lies on. Everything that decides is here and pure; the engine reads `/proc/self/smaps`,
//! `/proc/self/numa_maps` and the memory policy, and calls `move_pages(2)` (`crate::sys`).

use crate::kernel_text::node_count;
use crate::mask::CpuMask;
use crate::policy::{scope_memory_node, Rule};

/// `MPOL_DEFAULT` of `get_mempolicy(2)`: no policy of the process's own.
const MPOL_DEFAULT: i32 = 0;

/// What a configure knows when it asks [`decide`].
#[derive(Debug, Clone)]
pub struct MoveInput<'a> {
    /// The process is the worker's whole: `configure` on its main thread (a dedicated worker
    /// process, or `TLLM_AFFINITY_PROCESS_ROLE=worker`), not a worker thread or scope in a
    /// process that goes on serving host work.
    pub dedicated: bool,
    /// `TLLM_AFFINITY_MOVE_MEMORY` (default on).
    pub enabled: bool,
    /// The topology is the kernel's (no `TLLM_AFFINITY_SYSFS_ROOT`): a simulated host's node
    /// numbers are not the kernel's.
    pub kernels_topology: bool,
    pub rule: Rule,
    /// The worker mask the configure applied (`None`: nothing pinned).
    pub worker_mask: Option<&'a CpuMask>,
    /// The host's nodes with memory, with their CPUs (empty on a host of one node).
    pub memory_nodes: &'a [(usize, CpuMask)],
    /// The configuring thread's memory policy mode (`get_mempolicy`), or the errno reading it.
    pub memory_policy: Result<i32, i32>,
    /// The node a previous configure of this process moved its memory to.
    pub moved_to: Option<usize>,
}

/// Why a configure leaves the memory where it lies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stay {
    /// A worker thread or scope in a process that also serves host work: its memory is not the
    /// library's.
    Shared,
    /// `TLLM_AFFINITY_MOVE_MEMORY=0`.
    Disabled,
    /// A simulated topology (`TLLM_AFFINITY_SYSFS_ROOT`).
    Simulated,
    /// The `clear` or `keep` rule, or nothing pinned.
    NotNuma,
    /// The worker set does not lie on exactly one memory node with CPUs (a host of one node,
    /// `TLLM_AFFINITY_CPUS`, a set spanning nodes).
    NoSingleNode,
    /// The process has a memory policy of its own (mode): `numactl --membind`, `set_mempolicy`.
    OwnPolicy(i32),
    /// `get_mempolicy` failed (errno): a kernel without NUMA.
    PolicyUnreadable(i32),
    /// A configure already moved the memory to this node.
    AlreadyThere(usize),
    /// No other node with CPUs to move from (one node with CPUs beside memory-only nodes).
    NoOtherNode,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoveDecision {
    /// Move the pages lying on `from` (the other nodes with CPUs) to `to`.
    Move {
        from: Vec<usize>,
        to: usize,
    },
    Stay(Stay),
}

/// The one decision: whether this configure moves the process's memory, from which nodes, to
/// which. Memory on a node without CPUs (a GPU's own memory in NUMA mode) is never a source.
pub fn decide(input: &MoveInput<'_>) -> MoveDecision {
    let stay = MoveDecision::Stay;
    if !input.dedicated {
        return stay(Stay::Shared);
    }
    if !input.enabled {
        return stay(Stay::Disabled);
    }
    if !input.kernels_topology {
        return stay(Stay::Simulated);
    }
    let mask = match (input.rule, input.worker_mask) {
        (Rule::Numa, Some(mask)) => mask,
        _ => return stay(Stay::NotNuma),
    };
    let with_cpus: Vec<&(usize, CpuMask)> = input
        .memory_nodes
        .iter()
        .filter(|(_, cpus)| !cpus.is_empty())
        .collect();
    let Some(to) = scope_memory_node(input.memory_nodes, mask) else {
        return stay(Stay::NoSingleNode);
    };
    match input.memory_policy {
        Ok(MPOL_DEFAULT) => {}
        Ok(mode) => return stay(Stay::OwnPolicy(mode)),
        Err(errno) => return stay(Stay::PolicyUnreadable(errno)),
    }
    if input.moved_to == Some(to) {
        return stay(Stay::AlreadyThere(to));
    }
    let from: Vec<usize> = with_cpus
        .iter()
        .map(|(node, _)| *node)
        .filter(|&node| node != to)
        .collect();
    if from.is_empty() {
        return stay(Stay::NoOtherNode);
    }
    MoveDecision::Move { from, to }
}

impl Stay {
    /// Words for the debug line (the own-policy case is an info line: the user chose it).
    pub fn describe(&self) -> String {
        match self {
            Stay::Shared => "a worker thread or scope in a shared process: its memory stays".into(),
            Stay::Disabled => "TLLM_AFFINITY_MOVE_MEMORY=0: memory stays".into(),
            Stay::Simulated => "a simulated topology: memory stays".into(),
            Stay::NotNuma => "not a NUMA-aware placement: memory stays".into(),
            Stay::NoSingleNode => {
                "the worker set lies on no single memory node with CPUs: memory stays".into()
            }
            Stay::OwnPolicy(mode) => format!(
                "the process has a memory policy of its own (mode {mode}): its memory stays where that policy put it"
            ),
            Stay::PolicyUnreadable(errno) => {
                format!("get_mempolicy failed (errno {errno}); memory stays")
            }
            Stay::AlreadyThere(node) => {
                format!("memory already moved to NUMA node {node}")
            }
            Stay::NoOtherNode => "no other node with CPUs: memory stays".into(),
        }
    }
}

/// One mapping of `/proc/self/smaps`: its range and whether it is locked (`VmFlags: lo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub start: u64,
    pub end: u64,
    pub locked: bool,
}

/// The mappings of `/proc/self/smaps` text. A mapping whose header cannot be read is skipped.
pub fn smaps_ranges(text: &str) -> Vec<Range> {
    let mut ranges: Vec<Range> = Vec::new();
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(last) = ranges.last_mut() {
                last.locked = flags.split_whitespace().any(|f| f == "lo");
            }
            continue;
        }
        let Some(first) = line.split_whitespace().next() else {
            continue;
        };
        // A header starts with `start-end`; a field line with `Name:`.
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            {
                ranges.push(Range {
                    start,
                    end,
                    locked: false,
                });
            }
        }
    }
    ranges
}

/// One mapping of `/proc/self/numa_maps`: its start, whether its policy is the default, its page
/// size and its resident pages per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePages {
    pub start: u64,
    pub default_policy: bool,
    pub page_bytes: u64,
    pub pages: Vec<(usize, u64)>,
}

/// The mappings of `/proc/self/numa_maps` text with resident pages. A line that cannot be read
/// is skipped.
pub fn numa_maps_pages(text: &str) -> Vec<NodePages> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let start = u64::from_str_radix(words.next()?, 16).ok()?;
            let policy = words.next()?;
            let mut page_bytes = None;
            let mut pages = Vec::new();
            for word in words {
                if let Some(kb) = word.strip_prefix("kernelpagesize_kB=") {
                    page_bytes = kb.parse::<u64>().ok().map(|kb| kb * 1024);
                } else if let Some(count) = node_count(word) {
                    pages.push(count);
                }
            }
            (!pages.is_empty()).then_some(NodePages {
                start,
                default_policy: policy == "default",
                page_bytes: page_bytes?,
                pages,
            })
        })
        .collect()
}

/// A mapping to move: its range, its page size, the bytes it has on the source nodes, and
/// whether it also has pages on a node that is neither a source nor the target (a CPU-less node:
/// such a mapping is moved page by page, so that those pages stay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    pub start: u64,
    pub end: u64,
    pub page_bytes: u64,
    pub on_sources: u64,
    pub mixed: bool,
}

/// What the engine does over the process's mappings: the mappings to move, and the bytes on the
/// source nodes it leaves because they are locked (`mlock`: kept still on purpose) or under a
/// policy of their own (`mbind`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MovePlan {
    pub walks: Vec<Walk>,
    pub locked_bytes: u64,
    pub bound_bytes: u64,
}

/// The mappings with resident pages on `from`, from `smaps` and `numa_maps` read one after the
/// other: a mapping in only one of them (mapped or unmapped between the reads) is left out.
pub fn plan(ranges: &[Range], nodes: &[NodePages], from: &[usize], to: usize) -> MovePlan {
    let mut plan = MovePlan::default();
    for mapping in nodes {
        let on_sources = sources_bytes(mapping, from);
        if on_sources == 0 {
            continue;
        }
        let Some(range) = ranges.iter().find(|r| r.start == mapping.start) else {
            continue;
        };
        if range.locked {
            plan.locked_bytes += on_sources;
        } else if !mapping.default_policy {
            plan.bound_bytes += on_sources;
        } else {
            plan.walks.push(Walk {
                start: range.start,
                end: range.end,
                page_bytes: mapping.page_bytes,
                on_sources,
                mixed: mapping
                    .pages
                    .iter()
                    .any(|(node, n)| *n > 0 && *node != to && !from.contains(node)),
            });
        }
    }
    plan
}

fn sources_bytes(mapping: &NodePages, from: &[usize]) -> u64 {
    let pages: u64 = mapping
        .pages
        .iter()
        .filter(|(node, _)| from.contains(node))
        .map(|(_, pages)| pages)
        .sum();
    pages * mapping.page_bytes
}

/// What a move did, from `numa_maps` read again afterwards: (bytes moved, bytes still on the
/// sources) over the mappings of `walks`, each counted over every mapping that now starts inside
/// its range (moving may split a mapping the kernel did not merge back). A range with no mapping
/// left (unmapped meanwhile) counts as neither.
pub fn outcome(walks: &[Walk], after: &[NodePages], from: &[usize]) -> (u64, u64) {
    walks.iter().fold((0, 0), |(moved, left), walk| {
        let inside: Vec<&NodePages> = after
            .iter()
            .filter(|m| (walk.start..walk.end).contains(&m.start))
            .collect();
        if inside.is_empty() {
            return (moved, left);
        }
        let still = inside
            .iter()
            .map(|m| sources_bytes(m, from))
            .sum::<u64>()
            .min(walk.on_sources);
        (moved + walk.on_sources - still, left + still)
    })
}

/// The steps a mapping is moved in: `step` bytes at most (rounded to whole pages), so that the
/// process's memory map, which the kernel holds for writing while it moves a step, is never held
/// for the whole of a large mapping.
pub fn steps(walk: &Walk, step: u64) -> Vec<(u64, u64)> {
    let page = walk.page_bytes.max(1);
    let step = (step / page).max(1) * page;
    let mut out = Vec::new();
    let mut at = walk.start;
    while at < walk.end {
        let len = step.min(walk.end - at);
        out.push((at, len));
        at += len;
    }
    out
}

/// The pages of a chunk to move: the indices whose queried node (`status`, `move_pages` with no
/// target) is one of `from`. A negative status (not present, an error) is no page to move.
pub fn to_move(status: &[i32], from: &[usize]) -> Vec<usize> {
    status
        .iter()
        .enumerate()
        .filter(|(_, &s)| s >= 0 && from.contains(&(s as usize)))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> CpuMask {
        CpuMask::parse_list(s).unwrap()
    }

    fn two() -> Vec<(usize, CpuMask)> {
        vec![(0, m("0-1")), (1, m("2-3"))]
    }

    fn input<'a>(nodes: &'a [(usize, CpuMask)], mask: &'a CpuMask) -> MoveInput<'a> {
        MoveInput {
            dedicated: true,
            enabled: true,
            kernels_topology: true,
            rule: Rule::Numa,
            worker_mask: Some(mask),
            memory_nodes: nodes,
            memory_policy: Ok(MPOL_DEFAULT),
            moved_to: None,
        }
    }

    #[test]
    fn a_dedicated_worker_on_one_node_moves_the_other_cpu_nodes_pages_there() {
        let nodes = two();
        let mask = m("2-3");
        assert_eq!(
            decide(&input(&nodes, &mask)),
            MoveDecision::Move {
                from: vec![0],
                to: 1
            }
        );
        let one_cpu = m("3");
        assert_eq!(
            decide(&input(&nodes, &one_cpu)),
            MoveDecision::Move {
                from: vec![0],
                to: 1
            }
        );
        let four = vec![(0, m("0")), (1, m("1")), (2, m("2")), (3, m("3"))];
        let on_2 = m("2");
        assert_eq!(
            decide(&input(&four, &on_2)),
            MoveDecision::Move {
                from: vec![0, 1, 3],
                to: 2
            }
        );
    }

    #[test]
    fn a_cpu_less_node_is_never_a_source_nor_a_target() {
        // GB200-shaped: node 0 with CPUs, node 1 the GPU's memory, node 2 another CPU node.
        let nodes = vec![(0, m("0-3")), (1, CpuMask::default()), (2, m("4-7"))];
        let mask = m("0-3");
        assert_eq!(
            decide(&input(&nodes, &mask)),
            MoveDecision::Move {
                from: vec![2],
                to: 0
            }
        );
        // A GB200 tray's sparse ids: the GPUs' memory nodes 2 and 10 are never the target.
        let tray = vec![
            (0, m("0-3")),
            (1, m("4-7")),
            (2, CpuMask::default()),
            (10, CpuMask::default()),
        ];
        assert_eq!(
            decide(&input(&tray, &mask)),
            MoveDecision::Move {
                from: vec![1],
                to: 0
            }
        );
        // One node with CPUs and a memory-only node: nothing to move from.
        let gb = vec![(0, m("0-3")), (1, CpuMask::default())];
        assert_eq!(
            decide(&input(&gb, &mask)),
            MoveDecision::Stay(Stay::NoOtherNode)
        );
    }

    #[test]
    fn every_case_that_leaves_memory_where_it_lies() {
        let nodes = two();
        let mask = m("2-3");
        let spans = m("1-2");
        let cases: Vec<(MoveInput, Stay)> = vec![
            (
                MoveInput {
                    dedicated: false,
                    ..input(&nodes, &mask)
                },
                Stay::Shared,
            ),
            (
                MoveInput {
                    enabled: false,
                    ..input(&nodes, &mask)
                },
                Stay::Disabled,
            ),
            (
                MoveInput {
                    kernels_topology: false,
                    ..input(&nodes, &mask)
                },
                Stay::Simulated,
            ),
            (
                MoveInput {
                    rule: Rule::Clear,
                    ..input(&nodes, &mask)
                },
                Stay::NotNuma,
            ),
            (
                MoveInput {
                    rule: Rule::Keep,
                    worker_mask: None,
                    ..input(&nodes, &mask)
                },
                Stay::NotNuma,
            ),
            (
                MoveInput {
                    worker_mask: None,
                    ..input(&nodes, &mask)
                },
                Stay::NotNuma,
            ),
            (input(&nodes, &spans), Stay::NoSingleNode),
            (input(&nodes[..1], &mask), Stay::NoSingleNode),
            (input(&[], &mask), Stay::NoSingleNode),
            (
                MoveInput {
                    memory_policy: Ok(2),
                    ..input(&nodes, &mask)
                },
                Stay::OwnPolicy(2),
            ),
            (
                MoveInput {
                    memory_policy: Ok(1),
                    ..input(&nodes, &mask)
                },
                Stay::OwnPolicy(1),
            ),
            (
                MoveInput {
                    memory_policy: Err(libc::ENOSYS),
                    ..input(&nodes, &mask)
                },
                Stay::PolicyUnreadable(libc::ENOSYS),
            ),
            (
                MoveInput {
                    moved_to: Some(1),
                    ..input(&nodes, &mask)
                },
                Stay::AlreadyThere(1),
            ),
        ];
        for (input, why) in cases {
            assert_eq!(decide(&input), MoveDecision::Stay(why.clone()), "{why:?}");
            assert!(!why.describe().contains('\n'));
        }
        // A retarget to another node moves again.
        let back = m("0-1");
        assert_eq!(
            decide(&MoveInput {
                moved_to: Some(1),
                ..input(&nodes, &back)
            }),
            MoveDecision::Move {
                from: vec![1],
                to: 0
            }
        );
    }

    const SMAPS: &str = "\
55d4c0a00000-55d4c0a21000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                   8 kB
VmFlags: rd wr mr mw me ac
7f1c00000000-7f1c04000000 rw-p 00000000 00:00 0
Size:              65536 kB
Locked:            65536 kB
VmFlags: rd wr mr mw me lo ac
7f1c08000000-7f1c0c000000 rw-p 00000000 00:00 0
Size:              65536 kB
VmFlags: rd wr mr mw me ac
7f1c10000000-7f1c10200000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac ht
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
VmFlags: ex
";

    const NUMA_MAPS: &str = "\
55d4c0a00000 default heap anon=2 dirty=2 N0=1 N1=1 kernelpagesize_kB=4
7f1c00000000 default anon=16384 dirty=16384 N0=16384 kernelpagesize_kB=4
7f1c08000000 default anon=16384 dirty=16384 N0=12000 N1=4384 kernelpagesize_kB=4
7f1c10000000 bind:0 anon=1 dirty=1 N0=1 kernelpagesize_kB=2048
7f1c20000000 default file=/usr/lib/libc.so.6 mapped=10 mapmax=40 N1=10 kernelpagesize_kB=4
7f1c30000000 default
";

    #[test]
    fn smaps_gives_ranges_and_their_lock() {
        let ranges = smaps_ranges(SMAPS);
        assert_eq!(ranges.len(), 5);
        assert_eq!(
            ranges[0],
            Range {
                start: 0x55d4c0a00000,
                end: 0x55d4c0a21000,
                locked: false
            }
        );
        assert!(ranges[1].locked);
        assert!(!ranges[2].locked);
        assert_eq!(ranges[4].start, 0xffffffffff600000);
    }

    #[test]
    fn numa_maps_gives_pages_per_node_and_policy() {
        let pages = numa_maps_pages(NUMA_MAPS);
        assert_eq!(pages.len(), 5, "the mapping without pages is left out");
        assert_eq!(pages[0].pages, vec![(0, 1), (1, 1)]);
        assert!(pages[0].default_policy);
        assert!(!pages[3].default_policy);
        assert_eq!(pages[3].page_bytes, 2 << 20);
    }

    #[test]
    fn the_plan_walks_unlocked_default_mappings_with_pages_on_the_sources() {
        let plan = plan(&smaps_ranges(SMAPS), &numa_maps_pages(NUMA_MAPS), &[0], 1);
        assert_eq!(
            plan.walks,
            vec![
                Walk {
                    start: 0x55d4c0a00000,
                    end: 0x55d4c0a21000,
                    page_bytes: 4096,
                    on_sources: 4096,
                    mixed: false,
                },
                Walk {
                    start: 0x7f1c08000000,
                    end: 0x7f1c0c000000,
                    page_bytes: 4096,
                    on_sources: 12000 * 4096,
                    mixed: false,
                },
            ]
        );
        assert_eq!(plan.locked_bytes, 16384 * 4096, "the mlock'd mapping");
        assert_eq!(plan.bound_bytes, 2 << 20, "the mbind'd mapping");
        // From node 1 to node 0: the heap and the second buffer; libc's pages are in no smaps
        // range here.
        let from_1 = super::plan(&smaps_ranges(SMAPS), &numa_maps_pages(NUMA_MAPS), &[1], 0);
        assert_eq!(from_1.walks.len(), 2);
        assert_eq!(from_1.locked_bytes, 0);
        // A mapping with pages on a node that is neither (a CPU-less node 2) is moved page by
        // page.
        let gpu = "7f1c08000000 default anon=3 N0=1 N1=1 N2=1 kernelpagesize_kB=4\n";
        let mixed = super::plan(&smaps_ranges(SMAPS), &numa_maps_pages(gpu), &[0], 1);
        assert!(mixed.walks[0].mixed, "{mixed:?}");
    }

    #[test]
    fn the_outcome_is_read_from_numa_maps_after_the_move() {
        let before = numa_maps_pages(NUMA_MAPS);
        let plan = plan(&smaps_ranges(SMAPS), &before, &[0], 1);
        let after = numa_maps_pages(
            "55d4c0a00000 default heap anon=2 dirty=2 N1=2 kernelpagesize_kB=4\n\
             7f1c08000000 default anon=16384 N0=100 N1=16284 kernelpagesize_kB=4\n",
        );
        assert_eq!(
            outcome(&plan.walks, &after, &[0]),
            (4096 + 11900 * 4096, 100 * 4096)
        );
        // A mapping unmapped meanwhile: neither moved nor left.
        assert_eq!(outcome(&plan.walks, &after[..1], &[0]), (4096, 0));
        // A mapping left split in two by the move: both halves count.
        let split = numa_maps_pages(
            "7f1c08000000 default anon=8192 N0=50 N1=8142 kernelpagesize_kB=4\n\
             7f1c0a000000 default anon=8192 N0=50 N1=8142 kernelpagesize_kB=4\n",
        );
        assert_eq!(
            outcome(&plan.walks[1..], &split, &[0]),
            (11900 * 4096, 100 * 4096)
        );
    }

    #[test]
    fn a_large_mapping_moves_in_steps_of_whole_pages() {
        let walk = |end: u64, page_bytes: u64| Walk {
            start: 0x1000_0000,
            end,
            page_bytes,
            on_sources: 1,
            mixed: false,
        };
        let small = walk(0x1000_0000 + (1 << 20), 4096);
        assert_eq!(steps(&small, 64 << 20), vec![(0x1000_0000, 1 << 20)]);
        let big = walk(0x1000_0000 + (160 << 20), 4096);
        assert_eq!(
            steps(&big, 64 << 20),
            vec![
                (0x1000_0000, 64 << 20),
                (0x1000_0000 + (64 << 20), 64 << 20),
                (0x1000_0000 + (128 << 20), 32 << 20)
            ]
        );
        // 1 GiB huge pages: a step is one page.
        let huge = walk(0x1000_0000 + (2 << 30), 1 << 30);
        assert_eq!(steps(&huge, 64 << 20).len(), 2);
    }

    #[test]
    fn only_pages_on_a_source_node_are_moved() {
        assert_eq!(
            to_move(&[0, 1, -libc::ENOENT, 2, 0, -libc::EFAULT], &[0, 2]),
            vec![0, 3, 4]
        );
        assert!(to_move(&[], &[0]).is_empty());
    }
}
