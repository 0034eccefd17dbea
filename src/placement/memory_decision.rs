//! Memory follows a dedicated worker (SPEC §15): whether a configure moves the process's pages,
//! from which nodes to which, and which mappings the engine walks to do it.
//!
//! A worker pinned late (after the interpreter, the framework and the communication stack have
//! run) has part of its memory on another node. In a dedicated worker process every page is the
//! worker's, so the engine moves the pages on the other nodes with CPUs to the node the worker
//! set lies on. Everything that decides is here and pure; the engine's `memory_effects` reads
//! `/proc/self/smaps`, `/proc/self/numa_maps` (each line through
//! [`crate::host::kernel_text::numa_maps_line`], as the CLI's `ps` reads another process's) and the
//! memory policy, and calls `move_pages(2)` (`crate::sys`). The node moved to is
//! [`crate::placement::policy::worker_memory_node`], the one a worker scope's caller prefers too.

use crate::host::kernel_text::{numa_maps_line, NodePages};
use crate::mask::CpuMask;
use crate::placement::policy::{worker_memory_node, Rule};

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
    let Some(to) = worker_memory_node(input.memory_nodes, mask) else {
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

/// Why a mapping's pages are never moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// `mlock`, `MAP_LOCKED` (`VmFlags: lo`): a program locks memory to keep it still.
    Locked,
    /// A shared mapping (`s` in the permissions: shmem, `/dev/shm`, a shared file): its pages
    /// and its shared policy are every mapper's.
    Shared,
    /// A device or I/O mapping (`VmFlags: io`, `pf`, `dd`): a driver's memory, not the page
    /// allocator's to move.
    Device,
    /// hugetlbfs pages (`VmFlags: ht`): a reserved pool per node, not the buddy allocator's.
    Hugetlb,
}

/// One mapping of `/proc/self/smaps`: its range, why it is kept if it is, and its transparent
/// huge pages (`AnonHugePages`) or whether it may hold some (`THPeligible`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub start: u64,
    pub end: u64,
    pub kept: Option<Kept>,
    pub anon_huge_bytes: u64,
    /// `THPeligible: 1`. `AnonHugePages` alone leaves out the huge pages automatic NUMA
    /// balancing has marked for a hinting fault: a loaded worker's buffer can show 0 kB of them
    /// while every page of it is huge (measured in the x86_64 guest).
    pub thp_eligible: bool,
}

/// The mappings of `/proc/self/smaps` text. A mapping whose header cannot be read is skipped.
pub fn smaps_ranges(text: &str) -> Vec<Range> {
    let mut ranges: Vec<Range> = Vec::new();
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(last) = ranges.last_mut() {
                let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
                if has("io") || has("pf") || has("dd") {
                    last.kept = Some(Kept::Device);
                } else if has("ht") {
                    last.kept = Some(Kept::Hugetlb);
                } else if has("lo") {
                    last.kept = last.kept.or(Some(Kept::Locked));
                }
            }
            continue;
        }
        if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            if let (Some(last), Some(kb)) = (
                ranges.last_mut(),
                kb.split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<u64>().ok()),
            ) {
                last.anon_huge_bytes = kb * 1024;
            }
            continue;
        }
        if let Some(flag) = line.strip_prefix("THPeligible:") {
            if let Some(last) = ranges.last_mut() {
                last.thp_eligible = flag.trim() == "1";
            }
            continue;
        }
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else {
            continue;
        };
        // A header starts with `start-end perms`; a field line with `Name:`.
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            {
                let shared = words.next().is_some_and(|perms| perms.ends_with('s'));
                ranges.push(Range {
                    start,
                    end,
                    kept: shared.then_some(Kept::Shared),
                    anon_huge_bytes: 0,
                    thp_eligible: false,
                });
            }
        }
    }
    ranges
}

/// The mappings of `/proc/self/numa_maps` text with resident pages. A line that cannot be read
/// is skipped.
pub fn numa_maps_pages(text: &str) -> Vec<NodePages> {
    text.lines()
        .filter_map(|line| numa_maps_line(line).ok().flatten())
        .collect()
}

/// A mapping to walk: its range, its page size, the bytes it has on the source nodes, and
/// whether it holds transparent huge pages (walked huge page by huge page where it can be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    pub start: u64,
    pub end: u64,
    pub page_bytes: u64,
    pub on_sources: u64,
    pub huge: bool,
}

/// What the engine does over the process's mappings: the mappings to walk, and the bytes on the
/// source nodes it leaves, by why: locked, shared, a device's, hugetlbfs, or under a policy of
/// their own (`mbind`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MovePlan {
    pub walks: Vec<Walk>,
    pub locked_bytes: u64,
    pub shared_bytes: u64,
    pub device_bytes: u64,
    pub hugetlb_bytes: u64,
    pub bound_bytes: u64,
}

impl MovePlan {
    /// The bytes on the sources the walk never touches, a policy of the process's own aside.
    pub fn kept_bytes(&self) -> u64 {
        self.locked_bytes + self.shared_bytes + self.device_bytes + self.hugetlb_bytes
    }
}

/// The mappings with resident pages on `from`, from `smaps` and `numa_maps` read one after the
/// other: a mapping in only one of them (mapped or unmapped between the reads) is left out.
pub fn plan(ranges: &[Range], nodes: &[NodePages], from: &[usize]) -> MovePlan {
    let mut plan = MovePlan::default();
    for mapping in nodes {
        let on_sources = sources_bytes(mapping, from);
        if on_sources == 0 {
            continue;
        }
        let Some(range) = ranges.iter().find(|r| r.start == mapping.start) else {
            continue;
        };
        match range.kept {
            Some(Kept::Locked) => plan.locked_bytes += on_sources,
            Some(Kept::Shared) => plan.shared_bytes += on_sources,
            Some(Kept::Device) => plan.device_bytes += on_sources,
            Some(Kept::Hugetlb) => plan.hugetlb_bytes += on_sources,
            None if !mapping.default_policy => plan.bound_bytes += on_sources,
            None => plan.walks.push(Walk {
                start: range.start,
                end: range.end,
                page_bytes: mapping.page_bytes,
                on_sources,
                huge: range.anon_huge_bytes > 0 || range.thp_eligible,
            }),
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
/// its range. A range with no mapping left (unmapped meanwhile) counts as neither.
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

/// Pages in one batch of the walk: it bounds the buffers (about half a MiB) and one `move_pages`
/// call, while each batch costs a moving call (which drains every CPU's page lists), a read of
/// the target's free memory and of `/proc/buddyinfo`: 4096 pages a batch spent about 3 % of a
/// 1 GiB move in the x86_64 guest outside the kernel's moving and asking.
pub const BATCH_PAGES: u64 = 16384;

/// The bytes of one batch of the walk: about [`BATCH_PAGES`] pages, and a whole number of
/// transparent huge pages (`huge_bytes`, `hpage_pmd_size`), at least one.
pub fn batch_bytes(page_bytes: u64, huge_bytes: u64) -> u64 {
    let huge = huge_bytes.max(page_bytes).max(1);
    (BATCH_PAGES * page_bytes / huge).max(1) * huge
}

/// The batches a mapping is walked in: `(start, bytes)` with every boundary inside the mapping
/// on a multiple of `batch` (itself a multiple of the huge page size), so no batch ends inside a
/// transparent huge page, which the kernel aligns to its size.
pub fn batches(walk: &Walk, batch: u64) -> Vec<(u64, u64)> {
    let batch = batch.max(1);
    let mut out = Vec::new();
    let mut at = walk.start;
    while at < walk.end {
        let next = ((at / batch) + 1).saturating_mul(batch).min(walk.end);
        out.push((at, next - at));
        at = next;
    }
    out
}

/// `/proc/self/pagemap`'s bits this walk reads.
pub mod pagemap {
    pub const PRESENT: u64 = 1 << 63;
    /// A page-cache page or shared anonymous memory.
    pub const FILE_OR_SHARED: u64 = 1 << 61;
    /// Mapped by this process alone (mapcount 1).
    pub const EXCLUSIVE: u64 = 1 << 56;

    /// A page the walk may move: present, anonymous and private, mapped by this process alone.
    /// A page shared with a fork child (copy-on-write), a page-cache page of a file, the zero
    /// page and anything not present stay.
    pub fn movable(entry: u64) -> bool {
        entry & (PRESENT | FILE_OR_SHARED | EXCLUSIVE) == PRESENT | EXCLUSIVE
    }

    /// A private anonymous page present but mapped by another process too: a fork child's
    /// copy-on-write, until the child execs or exits (or for good, a child that lives on).
    pub fn shared_for_now(entry: u64) -> bool {
        entry & (PRESENT | FILE_OR_SHARED | EXCLUSIVE) == PRESENT
    }
}

/// The pages of a batch to move: the indices whose queried node (`status`, `move_pages` with no
/// target) is one of `from`. A negative status (not present, an error) is no page to move.
pub fn to_move(status: &[i32], from: &[usize]) -> Vec<usize> {
    status
        .iter()
        .enumerate()
        .filter(|(_, &s)| s >= 0 && from.contains(&(s as usize)))
        .map(|(i, _)| i)
        .collect()
}

/// Where whole huge-page blocks start in `addresses` (ascending, pages of `page` bytes): indices
/// `i` where `huge_bytes / page` consecutive pages begin on a `huge_bytes` boundary, found from
/// the front, a block never overlapping the one before. Such a block may be one transparent huge
/// page: moving its first page moves all of it.
pub fn huge_blocks(addresses: &[usize], page: u64, huge_bytes: u64) -> Vec<usize> {
    let per_huge = (huge_bytes / page.max(1)) as usize;
    let mut starts = Vec::new();
    if per_huge <= 1 {
        return starts;
    }
    let mut i = 0;
    while i < addresses.len() {
        let first = addresses[i] as u64;
        let whole = first.is_multiple_of(huge_bytes)
            && i + per_huge <= addresses.len()
            && addresses[i + per_huge - 1] as u64 == first + huge_bytes - page;
        if whole {
            starts.push(i);
            i += per_huge;
        } else {
            i += 1;
        }
    }
    starts
}

/// The entries of `pages` outside the blocks that start at `starts` (ascending indices into
/// `pages`, each `per_huge` entries long, not overlapping: [`huge_blocks`]' answer).
pub fn outside_blocks<T: Copy>(pages: &[T], starts: &[usize], per_huge: usize) -> Vec<T> {
    let mut outside = Vec::with_capacity(pages.len());
    let mut next = 0;
    for &start in starts {
        outside.extend_from_slice(&pages[next..start]);
        next = start + per_huge;
    }
    outside.extend_from_slice(&pages[next..]);
    outside
}

/// Memory the target keeps free in blocks of a huge page's size after a batch's huge pages:
/// the kernel splits a huge page it finds no free block of its size for, and a block or more
/// keeps other allocations above the watermarks meanwhile. In bytes, so that it means the same
/// whatever the page size: four blocks of 2 MiB (4 KiB pages), one of 32 MiB (16 KiB) or of
/// 512 MiB (64 KiB, where four blocks would be 2 GiB).
pub const HUGE_FREE_MARGIN_BYTES: u64 = 8 << 20;

/// [`HUGE_FREE_MARGIN_BYTES`] in free blocks of `huge_bytes`: rounded up, at least one.
pub fn huge_free_margin_blocks(huge_bytes: u64) -> u64 {
    HUGE_FREE_MARGIN_BYTES.div_ceil(huge_bytes.max(1)).max(1)
}

/// How many of a batch's `blocks` whole huge-page blocks move, in address order: each huge page
/// takes one of the target's `free_blocks` of its size (`/proc/buddyinfo`, read once a batch),
/// so no more than those less the margin ([`huge_free_margin_blocks`]), and no more than
/// `allowed` bytes hold. The rest stay whole.
pub fn huge_pages_that_fit(
    blocks: usize,
    free_blocks: u64,
    allowed: u64,
    huge_bytes: u64,
) -> usize {
    let room = free_blocks.saturating_sub(huge_free_margin_blocks(huge_bytes));
    let budget = allowed / huge_bytes.max(1);
    (blocks as u64).min(room).min(budget) as usize
}

/// Why whole huge pages stayed where [`huge_pages_that_fit`] took fewer than a batch had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePagesStay {
    /// Each is larger than what `TLLM_AFFINITY_MOVE_MEMORY`'s budget left (bytes).
    Budget { left: u64 },
    /// Each is larger than the target's free memory less its headroom (bytes).
    Headroom { left: u64 },
    /// The target had no free block of their size beyond the margin.
    NoFreeBlock,
}

/// Which limit held the huge pages back: the budget left (`budget_left`, bytes), the move's
/// allowance (`allowed`: the budget and the target's headroom), or the target's free blocks.
pub fn why_huge_pages_stay(budget_left: u64, allowed: u64, huge_bytes: u64) -> HugePagesStay {
    if budget_left < huge_bytes {
        HugePagesStay::Budget { left: budget_left }
    } else if allowed < huge_bytes {
        HugePagesStay::Headroom { left: allowed }
    } else {
        HugePagesStay::NoFreeBlock
    }
}

impl HugePagesStay {
    pub fn describe(&self) -> String {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20));
        match self {
            HugePagesStay::Budget { left } => format!(
                "each is larger than what TLLM_AFFINITY_MOVE_MEMORY's budget left ({})",
                mib(*left)
            ),
            HugePagesStay::Headroom { left } => format!(
                "each is larger than the node's free memory less the headroom kept free ({})",
                mib(*left)
            ),
            HugePagesStay::NoFreeBlock => "no free block of their size on the node".to_string(),
        }
    }
}

/// Whether a whole aligned block of a mapping with huge pages moves by its first page alone,
/// from where its two ends lie (`move_pages`' answers, `first` and `last`): both on one source
/// node, as a huge page's are. A block with an end elsewhere (the target, a CPU-less node),
/// hidden by a hinting fault or gone is asked about page by page instead. Whether it was one
/// huge page is known after the move: its last page moved with its first.
pub fn moves_by_its_first_page(first: i32, last: i32, from: &[usize]) -> bool {
    first == last && usize::try_from(first).is_ok_and(|node| from.contains(&node))
}

/// `MemFree` and `MemTotal` (bytes) of `/sys/devices/system/node/nodeN/meminfo` text.
pub fn node_free_and_total(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        meminfo.lines().find_map(|line| {
            let (_, rest) = line.split_once(name)?;
            rest.split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
                .map(|kb| kb * 1024)
        })
    };
    Some((field("MemFree:")?, field("MemTotal:")?))
}

/// What the move leaves free on the target node: 1/32 of the node's memory, at least 128 MiB,
/// so that moving never pushes the node under the kernel's watermarks into reclaiming other
/// tenants' pages, and allocations made meanwhile still find room.
pub fn headroom(node_total: u64) -> u64 {
    (node_total / 32).max(128 << 20)
}

/// The free blocks on `node` of at least `order` (pages of 2^order), in blocks of that order,
/// from `/proc/buddyinfo` text (`Node 1, zone Normal  c0 c1 ... cN`, counts by order).
pub fn free_blocks_of_order(buddyinfo: &str, node: usize, order: u32) -> u64 {
    let prefix = format!("Node {node},");
    buddyinfo
        .lines()
        .filter(|line| line.starts_with(&prefix))
        .map(|line| {
            line.split_whitespace()
                .skip(4)
                .filter_map(|w| w.parse::<u64>().ok())
                .enumerate()
                .filter(|&(o, _)| o as u32 >= order)
                .map(|(o, count)| count << (o as u32 - order))
                .sum::<u64>()
        })
        .sum()
}

/// One page's fate once a round of `move_pages` to the target is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterMove {
    /// On the target.
    Landed,
    /// Still on a source with no reason told: the kernel gave up on its group at another page
    /// (a pinned one) or never reached it. Moved again in the next round.
    TryAgain,
    /// `move_pages` cannot see it: a NUMA balancing hinting fault is pending (`-ENOENT`,
    /// `-EFAULT`).
    Hidden,
    /// Another process maps it too (`-EACCES`): a fork child's copy-on-write, for now.
    Shared,
    /// It would not migrate: long-term pinned, locked meanwhile, busy (`-EBUSY`, `-EAGAIN`,
    /// `-ENOMEM`, or still on a source after every round).
    Busy,
    /// On another node than a source or the target, or no page.
    Elsewhere,
}

/// What a page's answers say after a round: `written` is the status `move_pages` to the target
/// wrote ([`crate::sys::NO_STATUS`] where it wrote none), `now` where the page lies, asked again
/// after the call returned a positive count of pages it did not move or left a status unwritten
/// (`None`: not asked, the call answered for every page). A status the kernel never wrote is
/// never read as a node; a page counts as landed only where it lies on the target.
pub fn after_move(written: i32, now: Option<i32>, to: usize, from: &[usize]) -> AfterMove {
    let on_source = |s: i32| s >= 0 && from.contains(&(s as usize));
    let refused = |s: i32| match -s {
        libc::ENOENT | libc::EFAULT => AfterMove::Hidden,
        libc::EACCES => AfterMove::Shared,
        libc::EBUSY | libc::EAGAIN | libc::ENOMEM => AfterMove::Busy,
        _ => AfterMove::Elsewhere,
    };
    let written_reason =
        (written < 0 && written != crate::sys::NO_STATUS).then(|| refused(written));
    match now {
        Some(n) if n == to as i32 => AfterMove::Landed,
        // Visible on a source now: the reason the call gave, if it gave one that still holds.
        Some(n) if on_source(n) => match written_reason {
            Some(why @ (AfterMove::Shared | AfterMove::Busy)) => why,
            _ => AfterMove::TryAgain,
        },
        Some(n) if n < 0 => refused(n),
        Some(_) => AfterMove::Elsewhere,
        None if written == to as i32 => AfterMove::Landed,
        None if written == crate::sys::NO_STATUS || on_source(written) => AfterMove::TryAgain,
        None => written_reason.unwrap_or(AfterMove::Elsewhere),
    }
}

/// Whether a round of `move_pages` must be followed by asking where its pages lie: the call
/// said it left pages unmoved (`not_moved`, its positive return), or left a status unwritten.
pub fn ask_after_move(not_moved: usize, written: &[i32]) -> bool {
    not_moved > 0 || written.contains(&crate::sys::NO_STATUS)
}

/// The most rounds of `move_pages` one batch takes: the first, one for the pages a refused page
/// kept from being tried, and one more for pages a hinting fault hid meanwhile. A round in which
/// no page landed ends them: what is left is counted busy.
pub const MOVE_ROUNDS: usize = 3;

/// The waits before walking the mappings again when pages another process mapped were seen
/// (refused as shared, or not this process's alone by `pagemap`): between a `fork` and the
/// child's `exec` or exit every private page is mapped twice, for an instant. A child that
/// lives on (a pool worker) keeps them shared, and the walks after these waits, which skip such
/// pages on `pagemap` alone, cost little. 140 ms at most.
pub const WALK_AGAIN_AFTER: [std::time::Duration; 3] = [
    std::time::Duration::from_millis(10),
    std::time::Duration::from_millis(30),
    std::time::Duration::from_millis(100),
];

/// The wait before walk `round` (1 for the first walk again) when the walk before it saw
/// pages another process mapped (`shared_seen`: `move_pages` refused some as shared, or `pagemap`
/// showed some not this process's alone while it has a child process) and did not stop short
/// (`stopped`: budget, a full node; walking again would not move more); `None`: no walk again.
pub fn walk_again_after(
    round: usize,
    shared_seen: bool,
    stopped: bool,
) -> Option<std::time::Duration> {
    if !shared_seen || stopped {
        return None;
    }
    WALK_AGAIN_AFTER.get(round.checked_sub(1)?).copied()
}

/// `CAP_SYS_NICE` in the effective set of `/proc/self/status`' `CapEff:` line: with it,
/// `migrate_pages(2)` moves the pages other processes map too (`MPOL_MF_MOVE_ALL`). A status
/// without the line reads as having it: the sweep is then not used.
pub fn has_cap_sys_nice(proc_status: &str) -> bool {
    const CAP_SYS_NICE: u32 = 23;
    proc_status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_none_or(|caps| caps & (1 << CAP_SYS_NICE) != 0)
}

/// What the sweep by `migrate_pages(2)` after the walk needs to know.
#[derive(Debug, Clone, Copy)]
pub struct SweepInput {
    /// The walk stopped short (budget, a full node, a refusal).
    pub stopped: bool,
    /// Pages `move_pages` could not see even after the read.
    pub hidden: u64,
    /// Bytes on the sources in mappings never walked: locked, shared, a device's, file pages.
    pub kept: u64,
    /// Bytes under a policy of their own.
    pub bound: u64,
    /// The budget and the target's headroom take every byte left.
    pub fits: bool,
    /// The process has `CAP_SYS_NICE` ([`has_cap_sys_nice`]).
    pub cap_sys_nice: bool,
}

/// Whether the walk's leftovers are swept with `migrate_pages(2)`, which walks the page tables
/// itself and moves every page of the process on the sources: only where that is exactly the
/// walk's own pages. Never with `CAP_SYS_NICE`, which makes it move pages other processes map
/// (shared libraries' and model files' page cache in private file mappings, a fork child's
/// copy-on-write pages); never where anything locked, shared, a device's, a file's or bound lies
/// on a source; never past the budget.
pub fn may_sweep(input: &SweepInput) -> bool {
    !input.stopped
        && input.hidden > 0
        && input.kept == 0
        && input.bound == 0
        && input.fits
        && !input.cap_sys_nice
}

/// Why a move stopped before every movable page had moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoppedShort {
    /// `TLLM_AFFINITY_MOVE_MEMORY`'s cap (bytes) was reached.
    Budget(u64),
    /// The target node's free memory came down to the headroom: (free, headroom) bytes.
    NodeFull { free: u64, headroom: u64 },
    /// `move_pages` refused the whole call (errno): the node is not in the cpuset's `mems`.
    Refused(i32),
}

impl StoppedShort {
    pub fn describe(&self) -> String {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20));
        match self {
            StoppedShort::Budget(cap) => {
                format!(
                    "TLLM_AFFINITY_MOVE_MEMORY's budget of {} reached",
                    mib(*cap)
                )
            }
            StoppedShort::NodeFull { free, headroom } => format!(
                "the node's free memory ({}) is down to the headroom kept free ({})",
                mib(*free),
                mib(*headroom)
            ),
            StoppedShort::Refused(errno) => format!(
                "move_pages refused (errno {errno}{})",
                if *errno == libc::EACCES {
                    ": the node is not in this cpuset's mems"
                } else {
                    ""
                }
            ),
        }
    }
}

/// How many more bytes the move may take: the cap less what moved, and the target's free memory
/// less the headroom (`None`: the node's meminfo could not be read, so only the cap bounds it).
/// Less than one page left is a stop.
pub fn allowance(
    cap: u64,
    moved: u64,
    page_bytes: u64,
    free_and_headroom: Option<(u64, u64)>,
) -> Result<u64, StoppedShort> {
    let by_cap = cap.saturating_sub(moved);
    if by_cap < page_bytes.max(1) {
        return Err(StoppedShort::Budget(cap));
    }
    match free_and_headroom {
        Some((free, headroom)) if free < headroom + page_bytes.max(1) => {
            Err(StoppedShort::NodeFull { free, headroom })
        }
        Some((free, headroom)) => Ok(by_cap.min(free - headroom)),
        None => Ok(by_cap),
    }
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
AnonHugePages:         0 kB
THPeligible:    1
VmFlags: rd wr mr mw me ac
7f1c00000000-7f1c04000000 rw-p 00000000 00:00 0
Size:              65536 kB
Locked:            65536 kB
VmFlags: rd wr mr mw me lo ac
7f1c08000000-7f1c0c000000 rw-p 00000000 00:00 0
Size:              65536 kB
AnonHugePages:     49152 kB
VmFlags: rd wr mr mw me ac
7f1c10000000-7f1c10200000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac ht
7f1c20000000-7f1c24000000 rw-s 00000000 00:01 1234                       /dev/shm/x
VmFlags: rd wr sh mr mw me ms
7f1c30000000-7f1c30100000 rw-s 00000000 00:05 77                         /dev/nvidia0
VmFlags: rd wr sh mr mw me ms io pf dd
7f1c40000000-7f1c40100000 rw-p 00000000 00:05 78                         /dev/dri/x
VmFlags: rd wr mr mw me dc de dd
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
VmFlags: ex
";

    const NUMA_MAPS: &str = "\
55d4c0a00000 default heap anon=2 dirty=2 N0=1 N1=1 kernelpagesize_kB=4
7f1c00000000 default anon=16384 dirty=16384 N0=16384 kernelpagesize_kB=4
7f1c08000000 default anon=16384 dirty=16384 N0=12000 N1=4384 kernelpagesize_kB=4
7f1c10000000 default anon=1 dirty=1 N0=1 kernelpagesize_kB=2048
7f1c20000000 bind:1 file=/dev/shm/x dirty=8 N0=8 kernelpagesize_kB=4
7f1c30000000 default file=/dev/nvidia0 N0=2 kernelpagesize_kB=4
7f1c40000000 default file=/dev/dri/x N0=3 kernelpagesize_kB=4
7f1c50000000 default
";

    #[test]
    fn smaps_gives_ranges_why_they_are_kept_and_their_huge_pages() {
        let ranges = smaps_ranges(SMAPS);
        assert_eq!(ranges.len(), 8);
        assert_eq!(
            ranges[0],
            Range {
                start: 0x55d4c0a00000,
                end: 0x55d4c0a21000,
                kept: None,
                anon_huge_bytes: 0,
                thp_eligible: true,
            }
        );
        let kept: Vec<Option<Kept>> = ranges.iter().map(|r| r.kept).collect();
        assert_eq!(
            kept,
            [
                None,
                Some(Kept::Locked),
                None,
                Some(Kept::Hugetlb),
                Some(Kept::Shared),
                Some(Kept::Device),
                Some(Kept::Device),
                None
            ]
        );
        assert_eq!(ranges[2].anon_huge_bytes, 48 << 20);
        assert!(!ranges[2].thp_eligible, "no THPeligible line");
        assert_eq!(ranges[7].start, 0xffffffffff600000);
    }

    #[test]
    fn numa_maps_gives_pages_per_node_and_policy() {
        let pages = numa_maps_pages(NUMA_MAPS);
        assert_eq!(pages.len(), 7, "the mapping without pages is left out");
        assert_eq!(pages[0].pages, vec![(0, 1), (1, 1)]);
        assert!(pages[0].default_policy);
        assert!(!pages[4].default_policy);
        assert_eq!(pages[3].page_bytes, 2 << 20);
    }

    #[test]
    fn the_plan_walks_private_unlocked_default_mappings_and_counts_what_it_keeps() {
        let plan = plan(&smaps_ranges(SMAPS), &numa_maps_pages(NUMA_MAPS), &[0]);
        assert_eq!(
            plan.walks,
            vec![
                Walk {
                    start: 0x55d4c0a00000,
                    end: 0x55d4c0a21000,
                    page_bytes: 4096,
                    on_sources: 4096,
                    // Eligible, its huge pages (if any) marked for a hinting fault.
                    huge: true,
                },
                Walk {
                    start: 0x7f1c08000000,
                    end: 0x7f1c0c000000,
                    page_bytes: 4096,
                    on_sources: 12000 * 4096,
                    huge: true,
                },
            ]
        );
        assert_eq!(plan.locked_bytes, 16384 * 4096, "the mlock'd mapping");
        assert_eq!(plan.hugetlb_bytes, 2 << 20, "hugetlbfs");
        assert_eq!(
            plan.shared_bytes,
            8 * 4096,
            "the shmem mapping, its policy another's"
        );
        assert_eq!(plan.device_bytes, 5 * 4096, "the device mappings");
        assert_eq!(plan.bound_bytes, 0);
        assert_eq!(plan.kept_bytes(), (16384 + 8 + 5) * 4096 + (2 << 20));
        // A private mapping the process mbind'd itself keeps its pages.
        let bound = "7f1c08000000 bind:0 anon=1 N0=1 kernelpagesize_kB=4\n";
        let own = super::plan(&smaps_ranges(SMAPS), &numa_maps_pages(bound), &[0]);
        assert_eq!((own.walks.len(), own.bound_bytes), (0, 4096));
    }

    #[test]
    fn the_outcome_is_read_from_numa_maps_after_the_move() {
        let before = numa_maps_pages(NUMA_MAPS);
        let plan = plan(&smaps_ranges(SMAPS), &before, &[0]);
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
        // A mapping split in two meanwhile: both halves count.
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
    fn batches_end_on_huge_page_boundaries_never_inside_one() {
        // x86_64: 4 KiB pages, 2 MiB huge pages: 64 MiB batches. Grace: 64 KiB pages, 512 MiB
        // huge pages: two huge pages a batch. 16 KiB pages, 32 MiB huge pages: 256 MiB.
        assert_eq!(batch_bytes(4096, 2 << 20), 64 << 20);
        assert_eq!(batch_bytes(64 << 10, 512 << 20), 1 << 30);
        assert_eq!(batch_bytes(16 << 10, 32 << 20), 256 << 20);
        // No huge pages bigger than a batch: one huge page a batch.
        assert_eq!(batch_bytes(4096, 1 << 30), 1 << 30);
        let walk = |start: u64, end: u64| Walk {
            start,
            end,
            page_bytes: 4096,
            on_sources: 1,
            huge: true,
        };
        // A mapping that starts 1 MiB past a huge page boundary: the first batch ends on one.
        let at = 0x7f00_0010_0000u64;
        let b = batches(&walk(at, at + (40 << 20)), 16 << 20);
        assert_eq!(b[0], (at, 15 << 20));
        for (start, len) in &b[1..] {
            assert_eq!(start % (16 << 20), 0, "{b:?}");
            assert!(*len <= 16 << 20);
        }
        assert_eq!(b.iter().map(|(_, l)| l).sum::<u64>(), 40 << 20);
        assert_eq!(
            batches(&walk(0x1000, 0x3000), 16 << 20),
            vec![(0x1000, 0x2000)]
        );
        // Grace: a 1.5 GiB mapping aligned on 512 MiB: three batches, one huge page each.
        let grace = Walk {
            page_bytes: 64 << 10,
            ..walk(0x4000_0000_0000, 0x4000_0000_0000 + (1536 << 20))
        };
        assert_eq!(batches(&grace, 512 << 20).len(), 3);
    }

    #[test]
    fn only_private_anonymous_pages_of_this_process_alone_are_movable() {
        use pagemap::*;
        assert!(movable(PRESENT | EXCLUSIVE | 0x1234));
        assert!(!movable(EXCLUSIVE), "not present");
        assert!(!movable(PRESENT), "shared with a fork child");
        assert!(
            !movable(PRESENT | EXCLUSIVE | FILE_OR_SHARED),
            "a file's page"
        );
    }

    #[test]
    fn only_pages_on_a_source_node_are_moved() {
        assert_eq!(
            to_move(&[0, 1, -libc::ENOENT, 2, 0, -libc::EFAULT], &[0, 2]),
            vec![0, 3, 4]
        );
        assert!(to_move(&[], &[0]).is_empty());
    }

    #[test]
    fn the_budget_is_the_cap_and_the_nodes_free_memory_less_the_headroom() {
        let meminfo = "Node 1 MemTotal:        1048576 kB\nNode 1 MemFree:          524288 kB\nNode 1 MemUsed: 1 kB\n";
        assert_eq!(node_free_and_total(meminfo), Some((512 << 20, 1 << 30)));
        assert_eq!(node_free_and_total("nothing"), None);
        assert_eq!(headroom(1 << 30), 128 << 20);
        assert_eq!(headroom(480 << 30), 15 << 30);
        let page = 4096;
        assert_eq!(allowance(64 << 20, 0, page, None), Ok(64 << 20));
        assert_eq!(
            allowance(64 << 20, 0, page, Some((512 << 20, 128 << 20))),
            Ok(64 << 20)
        );
        assert_eq!(
            allowance(1 << 30, 0, page, Some((512 << 20, 128 << 20))),
            Ok(384 << 20)
        );
        assert_eq!(
            allowance(64 << 20, 64 << 20, page, None),
            Err(StoppedShort::Budget(64 << 20))
        );
        assert_eq!(
            allowance(1 << 30, 0, page, Some((100 << 20, 128 << 20))),
            Err(StoppedShort::NodeFull {
                free: 100 << 20,
                headroom: 128 << 20
            })
        );
        assert!(StoppedShort::Budget(32 << 20)
            .describe()
            .contains("TLLM_AFFINITY_MOVE_MEMORY's budget of 32.0 MiB"));
    }

    #[test]
    fn free_huge_blocks_are_counted_from_buddyinfo() {
        let buddy = "Node 0, zone      DMA      1      1      1      0      2      1      1      0      1      1      3\n\
                     Node 1, zone   Normal    100     50     20     10      5      4      3      2      1      3      2\n";
        // Order 9 (2 MiB of 4 KiB pages): 3 blocks of order 9 and 2 of order 10 (two each).
        assert_eq!(free_blocks_of_order(buddy, 1, 9), 3 + 2 * 2);
        assert_eq!(free_blocks_of_order(buddy, 1, 10), 2);
        assert_eq!(free_blocks_of_order(buddy, 2, 9), 0);
    }

    #[test]
    fn huge_blocks_are_aligned_runs_of_a_huge_pages_worth_of_pages() {
        let page = 4096usize;
        let huge = 4 * page;
        // One page before a boundary, a whole block, a block with a hole, then a whole one.
        let mut addresses = vec![huge - page];
        addresses.extend((0..4).map(|k| huge + k * page));
        addresses.extend([2 * huge, 2 * huge + page, 2 * huge + 3 * page]);
        addresses.extend((0..4).map(|k| 3 * huge + k * page));
        assert_eq!(
            huge_blocks(&addresses, page as u64, huge as u64),
            vec![1, 8]
        );
        // A run that starts off a boundary is no block; base pages as large as a huge one none.
        let shifted: Vec<usize> = (1..6).map(|k| k * page).collect();
        assert_eq!(
            huge_blocks(&shifted, page as u64, huge as u64),
            Vec::<usize>::new()
        );
        assert!(huge_blocks(&[0, huge], huge as u64, huge as u64).is_empty());
    }

    #[test]
    fn huge_pages_move_while_the_target_has_free_blocks_beyond_the_margin_and_the_budget_holds() {
        let huge = 2 << 20;
        // Room and budget for all.
        assert_eq!(huge_pages_that_fit(8, 100, 64 * huge, huge), 8);
        // Ten free blocks: six move, four stay free on the target.
        assert_eq!(huge_pages_that_fit(8, 10, 64 * huge, huge), 6);
        assert_eq!(huge_pages_that_fit(8, 4, 64 * huge, huge), 0);
        assert_eq!(huge_pages_that_fit(8, 0, 64 * huge, huge), 0);
        // A budget of three and a half huge pages: three.
        assert_eq!(huge_pages_that_fit(8, 100, 3 * huge + huge / 2, huge), 3);
        assert_eq!(huge_pages_that_fit(0, 100, 64 * huge, huge), 0);
    }

    #[test]
    fn the_margin_kept_free_on_the_target_is_bytes_not_a_count_of_huge_pages() {
        // 4 KiB pages, 2 MiB huge pages: 8 MiB kept free is four blocks.
        assert_eq!(huge_pages_that_fit(8, 10, 64 << 20, 2 << 20), 6);
        // 64 KiB pages, 512 MiB huge pages: one block kept free, not four (2 GiB); a 3 GiB
        // node with five free blocks takes both huge pages of a batch.
        assert_eq!(huge_pages_that_fit(2, 5, 2 << 30, 512 << 20), 2);
        assert_eq!(huge_pages_that_fit(2, 2, 2 << 30, 512 << 20), 1);
        assert_eq!(huge_pages_that_fit(2, 1, 2 << 30, 512 << 20), 0);
        // 16 KiB pages, 32 MiB huge pages: one block.
        assert_eq!(huge_pages_that_fit(4, 3, 1 << 30, 32 << 20), 2);
    }

    #[test]
    fn huge_pages_that_stay_say_which_limit_held_them() {
        let huge = 512 << 20;
        // A budget of 256 MiB: no 512 MiB huge page fits it.
        assert_eq!(
            why_huge_pages_stay(256 << 20, 256 << 20, huge),
            HugePagesStay::Budget { left: 256 << 20 }
        );
        assert!(why_huge_pages_stay(256 << 20, 256 << 20, huge)
            .describe()
            .contains("larger than what TLLM_AFFINITY_MOVE_MEMORY's budget left (256.0 MiB)"));
        // The budget holds one, the node's headroom does not.
        assert_eq!(
            why_huge_pages_stay(16 << 30, 300 << 20, huge),
            HugePagesStay::Headroom { left: 300 << 20 }
        );
        assert_eq!(
            why_huge_pages_stay(16 << 30, 4 << 30, huge),
            HugePagesStay::NoFreeBlock
        );
    }

    #[test]
    fn the_pages_outside_the_blocks_keep_their_order() {
        let pages: Vec<usize> = (0..10).collect();
        assert_eq!(outside_blocks(&pages, &[1, 6], 3), vec![0, 4, 5, 9]);
        assert_eq!(outside_blocks(&pages, &[], 3), pages);
        assert_eq!(outside_blocks(&pages, &[0, 5], 5), Vec::<usize>::new());
    }

    #[test]
    fn a_block_moves_by_its_first_page_only_with_both_ends_on_one_source() {
        let from = [0, 2];
        assert!(moves_by_its_first_page(0, 0, &from));
        assert!(moves_by_its_first_page(2, 2, &from));
        // Ends on two nodes: not one huge page.
        assert!(!moves_by_its_first_page(0, 2, &from));
        // Already on the target, or on a CPU-less node (not a source).
        assert!(!moves_by_its_first_page(1, 1, &from));
        assert!(!moves_by_its_first_page(3, 3, &from));
        // Hidden by a hinting fault (-ENOENT), or gone (-EFAULT).
        assert!(!moves_by_its_first_page(
            -libc::ENOENT,
            -libc::ENOENT,
            &from
        ));
        assert!(!moves_by_its_first_page(-libc::EFAULT, 0, &from));
    }

    const FROM: [usize; 1] = [0];
    const NONE_WRITTEN: i32 = crate::sys::NO_STATUS;

    #[test]
    fn an_unwritten_status_is_never_a_node_and_a_page_lands_only_on_the_target() {
        // The call answered for every page.
        assert_eq!(after_move(1, None, 1, &FROM), AfterMove::Landed);
        assert_eq!(
            after_move(NONE_WRITTEN, None, 1, &FROM),
            AfterMove::TryAgain
        );
        assert_eq!(after_move(0, None, 1, &FROM), AfterMove::TryAgain);
        assert_eq!(after_move(-libc::EBUSY, None, 1, &FROM), AfterMove::Busy);
        assert_eq!(after_move(-libc::EAGAIN, None, 1, &FROM), AfterMove::Busy);
        assert_eq!(after_move(-libc::EACCES, None, 1, &FROM), AfterMove::Shared);
        assert_eq!(after_move(-libc::ENOENT, None, 1, &FROM), AfterMove::Hidden);
        assert_eq!(after_move(-libc::EFAULT, None, 1, &FROM), AfterMove::Hidden);
        assert_eq!(after_move(2, None, 1, &FROM), AfterMove::Elsewhere);
        // Asked again after a positive return: where the page lies decides, the reason written
        // says why it stayed, no reason means it was not tried.
        assert_eq!(
            after_move(NONE_WRITTEN, Some(1), 1, &FROM),
            AfterMove::Landed
        );
        assert_eq!(
            after_move(NONE_WRITTEN, Some(0), 1, &FROM),
            AfterMove::TryAgain
        );
        assert_eq!(after_move(-libc::EBUSY, Some(0), 1, &FROM), AfterMove::Busy);
        assert_eq!(
            after_move(-libc::EACCES, Some(0), 1, &FROM),
            AfterMove::Shared
        );
        assert_eq!(
            after_move(-libc::ENOENT, Some(0), 1, &FROM),
            AfterMove::TryAgain
        );
        assert_eq!(
            after_move(-libc::EBUSY, Some(1), 1, &FROM),
            AfterMove::Landed
        );
        assert_eq!(
            after_move(NONE_WRITTEN, Some(-libc::ENOENT), 1, &FROM),
            AfterMove::Hidden
        );
        assert_eq!(
            after_move(NONE_WRITTEN, Some(2), 1, &FROM),
            AfterMove::Elsewhere
        );
        // Node 0 written by the kernel is node 0, not the zero of a status never written.
        assert_eq!(after_move(0, None, 0, &[1]), AfterMove::Landed);
    }

    #[test]
    fn pages_are_asked_again_after_a_positive_return_or_a_missing_status() {
        assert!(!ask_after_move(0, &[1, 1, -libc::EBUSY]));
        assert!(ask_after_move(3, &[1, 1, 1]));
        assert!(ask_after_move(0, &[1, NONE_WRITTEN]));
        assert!(!ask_after_move(0, &[]));
    }

    #[test]
    fn shared_pages_are_walked_again_after_short_bounded_waits() {
        assert_eq!(walk_again_after(1, false, false), None);
        assert_eq!(walk_again_after(1, true, true), None);
        assert_eq!(walk_again_after(0, true, false), None);
        let waits: Vec<_> = (1..10)
            .map_while(|r| walk_again_after(r, true, false))
            .collect();
        assert_eq!(waits, WALK_AGAIN_AFTER);
        let total: std::time::Duration = waits.iter().sum();
        assert!(total <= std::time::Duration::from_millis(200), "{total:?}");
    }

    #[test]
    fn cap_sys_nice_is_read_from_the_effective_set() {
        let status = |eff: &str| {
            format!(
                "Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t{eff}\n"
            )
        };
        assert!(has_cap_sys_nice(&status("000001ffffffffff")));
        assert!(has_cap_sys_nice(&status("0000000000800000")));
        assert!(!has_cap_sys_nice(&status("0000000000000000")));
        // A container runtime's default set, without it.
        assert!(!has_cap_sys_nice(&status("00000000a80425fb")));
        // Unreadable: taken as having it, so the sweep stays off.
        assert!(has_cap_sys_nice("Name:\tx\n"));
        assert!(has_cap_sys_nice("CapEff:\tnot hex\n"));
    }

    #[test]
    fn the_sweep_runs_only_where_it_moves_exactly_the_walks_own_pages() {
        let ok = SweepInput {
            stopped: false,
            hidden: 3,
            kept: 0,
            bound: 0,
            fits: true,
            cap_sys_nice: false,
        };
        assert!(may_sweep(&ok));
        assert!(!may_sweep(&SweepInput {
            cap_sys_nice: true,
            ..ok
        }));
        assert!(!may_sweep(&SweepInput { hidden: 0, ..ok }));
        assert!(!may_sweep(&SweepInput { kept: 4096, ..ok }));
        assert!(!may_sweep(&SweepInput { bound: 4096, ..ok }));
        assert!(!may_sweep(&SweepInput { fits: false, ..ok }));
        assert!(!may_sweep(&SweepInput {
            stopped: true,
            ..ok
        }));
    }
}
