//! The host view's model: every process with a table read (bounded in time and bytes), the
//! CPUs' groups, and the flags a user must see. Data only; [`super::drawing`] formats it.

use std::collections::{BTreeMap, BTreeSet};

use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::placement::slice;
use tllm_affinity_core::registry::{Placement, Role};
use tllm_affinity_core::table::threadtable::{self, LeaseLine};
use tllm_affinity_core::table::untrusted::Dir;

use crate::draw;
pub use crate::grid::CpuGroup;
use crate::memory_reading::NodeMemory;
use crate::ps;

/// What a thread does, as the host view tells them apart; in the grid's order of precedence
/// (a CPU shows the most particular thing a process's threads may do there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Step,
    Result,
    Worker,
    Host,
    Unknown,
}

impl Kind {
    pub(crate) const ALL: [Kind; 5] = [
        Kind::Step,
        Kind::Result,
        Kind::Worker,
        Kind::Host,
        Kind::Unknown,
    ];

    fn of(known: Option<(Role, Placement)>) -> Kind {
        match known {
            Some((_, Placement::Step)) => Kind::Step,
            Some((_, Placement::Result)) => Kind::Result,
            Some((Role::Worker, _)) => Kind::Worker,
            Some((Role::Host, _)) => Kind::Host,
            None => Kind::Unknown,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Step => "step",
            Kind::Result => "result",
            Kind::Worker => "worker",
            Kind::Host => "host",
            Kind::Unknown => "unknown",
        }
    }

    /// A role and placement of this kind, for `ps PID`'s mark and colour.
    pub(crate) fn known(self) -> Option<(Role, Placement)> {
        match self {
            Kind::Step => Some((Role::Worker, Placement::Step)),
            Kind::Result => Some((Role::Worker, Placement::Result)),
            Kind::Worker => Some((Role::Worker, Placement::Worker)),
            Kind::Host => Some((Role::Host, Placement::Inherited)),
            Kind::Unknown => None,
        }
    }
}

/// One process with a table that was read.
#[derive(Debug, Clone)]
pub struct ProcessRow {
    pub pid: u32,
    pub namespace_pid: Option<u32>,
    pub command: String,
    /// Its open leases, or why they cannot be read.
    pub leases: Result<Vec<LeaseLine>, String>,
    /// The CPUs the threads of each kind may run on, and how many threads of each kind.
    pub cpus: BTreeMap<Kind, CpuMask>,
    pub threads: BTreeMap<Kind, usize>,
    /// The CPUs of threads whose mask the application chose (`configure` with a mask of its
    /// own) and of those whose mask someone else changed after the library placed them.
    pub explicit: CpuMask,
    pub external: CpuMask,
    pub memory: Result<NodeMemory, String>,
}

impl ProcessRow {
    fn from_snapshot(s: &ps::Snapshot) -> ProcessRow {
        let mut cpus: BTreeMap<Kind, CpuMask> = BTreeMap::new();
        let mut threads = BTreeMap::new();
        let (mut explicit, mut external) = (CpuMask::default(), CpuMask::default());
        for t in &s.threads {
            match t.known {
                Some((_, Placement::Explicit)) => explicit = explicit.union(&t.mask),
                Some((_, Placement::External)) => external = external.union(&t.mask),
                _ => {}
            }
            let kind = Kind::of(t.known);
            let on = cpus.entry(kind).or_default();
            *on = on.union(&t.mask);
            *threads.entry(kind).or_insert(0) += 1;
        }
        ProcessRow {
            pid: s.pid,
            namespace_pid: s.namespace_pid,
            command: s.name.clone(),
            leases: s.leases.clone(),
            cpus,
            threads,
            explicit,
            external,
            memory: s.memory.clone(),
        }
    }

    pub fn on(&self, kind: Kind) -> CpuMask {
        self.cpus.get(&kind).cloned().unwrap_or_default()
    }

    /// `GPU 0 (0000:3b:00.0)` for each open lease, `-` for none.
    pub(crate) fn gpus(&self) -> String {
        match &self.leases {
            Ok(leases) if leases.is_empty() => "-".into(),
            Ok(leases) => leases
                .iter()
                .map(draw::lease_device)
                .collect::<Vec<_>>()
                .join(", "),
            Err(why) => format!("leases not readable ({why})"),
        }
    }

    /// The devices of its open leases: two processes on different GPUs have none in common.
    fn devices(&self) -> BTreeSet<&str> {
        match &self.leases {
            Ok(leases) => leases.iter().map(|l| l.device.as_str()).collect(),
            Err(_) => BTreeSet::new(),
        }
    }
}

/// A process with a table that could not be read: one line.
#[derive(Debug, Clone)]
pub struct ProcessLine {
    pub pid: u32,
    pub command: Option<String>,
    pub why: String,
}

#[derive(Debug, Clone)]
pub enum Entry {
    Row(ProcessRow),
    Line(ProcessLine),
}

/// The entries that are rows.
pub(crate) fn rows(entries: &[Entry]) -> impl Iterator<Item = &ProcessRow> {
    entries.iter().filter_map(|e| match e {
        Entry::Row(r) => Some(r),
        Entry::Line(_) => None,
    })
}

impl Entry {
    fn pid(&self) -> u32 {
        match self {
            Entry::Row(r) => r.pid,
            Entry::Line(l) => l.pid,
        }
    }
}

/// One thing the user must see, naming what and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    pub kind: &'static str,
    pub pids: Vec<u32>,
    pub cpus: CpuMask,
    pub text: String,
}

/// The host view.
#[derive(Debug)]
pub struct HostView {
    pub entries: Vec<Entry>,
    /// Processes in another PID namespace whose root the caller may not look into.
    pub unreachable: usize,
    /// Reader threads of earlier scans of this process still stuck ([`readers_stuck`]).
    pub readers_stuck: usize,
    pub groups: Vec<CpuGroup>,
    /// The host's cores (SMT sibling sets) under the tree read: the grid groups CPUs by them.
    pub cores: Vec<CpuMask>,
    pub flags: Vec<Flag>,
    /// The kernel's NUMA nodes with CPUs: where memory is judged (see [`off_node`]).
    pub kernel_nodes: Vec<(usize, CpuMask)>,
}

/// Reads every process with a table, the CPUs' nodes and cores under `root`, and judges memory
/// on the kernel's own nodes: where pages lie is a kernel fact, whatever tree `root` is.
pub fn gather(root: &SysfsRoot) -> HostView {
    let (found, unreachable) = processes_with_a_table();
    let mut entries = read_bounded(found, ps::PROCESS_LIMIT, VIEW_LIMIT);
    entries.sort_by_key(Entry::pid);
    let topology = Topology::read(root).ok().map(|mut t| {
        t.read_llc_domains(root);
        t
    });
    let kernel = if root.root() == Path::new("/") {
        topology.clone()
    } else {
        Topology::read(&SysfsRoot::new("/")).ok()
    };
    let shown: Vec<&ProcessRow> = rows(&entries).collect();
    let mut masks = CpuMask::default();
    for r in &shown {
        for m in r.cpus.values() {
            masks = masks.union(m);
        }
    }
    let groups = crate::grid::groups(topology.as_ref(), &masks);
    let cores = topology.as_ref().map(Topology::cores).unwrap_or_default();
    let kernel_nodes = kernel.map(|t| t.nodes_with_cpus()).unwrap_or_default();
    let gpu_local: BTreeMap<String, CpuMask> = topology
        .as_ref()
        .map(|t| {
            t.gpus
                .iter()
                .map(|g| (g.address.clone(), t.gpu_local_cpus(g).cpus))
                .collect()
        })
        .unwrap_or_default();
    // Each GPU's slice under TLLM_AFFINITY_SLICE=gpu, where it is narrower than its set.
    let slices: BTreeMap<String, CpuMask> = topology
        .as_ref()
        .map(|t| {
            slice::slices(t, &t.online)
                .into_iter()
                .filter(|s| matches!(s.cut, slice::Cut::WholeDomains | slice::Cut::Cores))
                .map(|s| (s.address, s.cpus))
                .collect()
        })
        .unwrap_or_default();
    let flags = flags(&shown, &cores, &kernel_nodes, &gpu_local, &slices);
    HostView {
        entries,
        unreachable,
        readers_stuck: readers_stuck(),
        groups,
        cores,
        flags,
        kernel_nodes,
    }
}

/// The most time the host view takes over all processes: those not read by then are one line
/// each.
pub const VIEW_LIMIT: Duration = Duration::from_secs(30);
/// How many processes are read at once.
const READERS: usize = 8;
/// The most reader threads alive at once, across scans (`metrics --every` and `--listen` scan
/// again and again in one process): those of earlier scans still stuck included. A process
/// whose reader cannot start is one line.
pub const READERS_AT_MOST: usize = 32;

/// The reader threads alive in this process, across scans: each one's process and whether its
/// scan gave up on it (stuck: a read of `/proc` that blocks cannot be interrupted).
struct Readers {
    next: u64,
    alive: BTreeMap<u64, (u32, bool)>,
}

static READERS_ALIVE: Mutex<Readers> = Mutex::new(Readers {
    next: 0,
    alive: BTreeMap::new(),
});

fn readers() -> MutexGuard<'static, Readers> {
    // Nothing inside the lock can panic halfway; a poisoned lock holds whole values.
    READERS_ALIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How many reader threads of earlier scans are still stuck in a process's `/proc` files.
pub fn readers_stuck() -> usize {
    readers().alive.values().filter(|(_, stuck)| *stuck).count()
}

/// Takes a reader thread's place out of [`READERS_ALIVE`] when the thread ends, however.
struct ReaderPlace(u64);

impl Drop for ReaderPlace {
    fn drop(&mut self) {
        readers().alive.remove(&self.0);
    }
}

/// Reads each process of `found` ([`entry_of`]) on a thread of its own, [`READERS`] at a time:
/// one that takes longer than `each` is one line and its reader is left behind, stuck (a read
/// of `/proc` that blocks cannot be interrupted), and once `all` has passed every process not
/// yet read is one line. Stuck readers are bounded across scans: a process whose reader of an
/// earlier scan is still stuck is not read again (one line), and no reader starts while
/// [`READERS_AT_MOST`] are alive (one line too).
pub fn read_bounded(found: Vec<(u32, Option<u64>)>, each: Duration, all: Duration) -> Vec<Entry> {
    read_bounded_by(found, each, all, entry_of)
}

/// [`read_bounded`] with `reader` in place of [`entry_of`] (the tests' readers that never
/// return stand for a process whose `/proc` files block).
fn read_bounded_by<R>(
    found: Vec<(u32, Option<u64>)>,
    each: Duration,
    all: Duration,
    reader: R,
) -> Vec<Entry>
where
    R: Fn(u32, Option<u64>) -> Entry + Clone + Send + 'static,
{
    let view_deadline = Instant::now() + all;
    let (done_tx, done) = std::sync::mpsc::channel::<(u32, Entry)>();
    let mut pending = found.into_iter();
    // Each process being read: its deadline and its reader's place.
    let mut reading: BTreeMap<u32, (Instant, u64)> = BTreeMap::new();
    let mut entries = Vec::new();
    let late = |pid: u32, why: String| {
        Entry::Line(ProcessLine {
            pid,
            command: None,
            why,
        })
    };
    let too_slow = format!(
        "not read within {} s (its /proc files do not answer)",
        each.as_secs_f64()
    );
    loop {
        while reading.len() < READERS && Instant::now() < view_deadline {
            let Some((pid, start)) = pending.next() else {
                break;
            };
            let place = {
                let mut alive = readers();
                if alive.alive.values().any(|&(p, stuck)| p == pid && stuck) {
                    drop(alive);
                    entries.push(late(
                        pid,
                        "not read: its reader of an earlier scan is still stuck (its /proc files \
                         do not answer)"
                            .into(),
                    ));
                    continue;
                }
                if alive.alive.len() >= READERS_AT_MOST {
                    let stuck = alive.alive.len();
                    drop(alive);
                    entries.push(late(
                        pid,
                        format!(
                            "not read: {stuck} readers are still stuck on other processes' /proc \
                             files"
                        ),
                    ));
                    continue;
                }
                let id = alive.next;
                alive.next += 1;
                alive.alive.insert(id, (pid, false));
                ReaderPlace(id)
            };
            let id = place.0;
            let tx = done_tx.clone();
            let reader = reader.clone();
            let started = std::thread::Builder::new()
                .name("ps-reader".into())
                .spawn(move || {
                    let _place = place;
                    let _ = tx.send((pid, reader(pid, start)));
                });
            match started {
                Ok(_) => {
                    reading.insert(pid, (Instant::now() + each, id));
                }
                // The closure, and with it the place, is dropped: the place is free again.
                Err(e) => entries.push(late(pid, format!("not read: no thread to read it ({e})"))),
            }
        }
        let Some(next_deadline) = reading.values().map(|(d, _)| *d).min() else {
            break;
        };
        let wait_until = next_deadline.min(view_deadline);
        match done.recv_timeout(wait_until.saturating_duration_since(Instant::now())) {
            Ok((pid, entry)) => {
                if reading.remove(&pid).is_some() {
                    entries.push(entry);
                }
            }
            Err(_) => {
                let now = Instant::now();
                let overdue: Vec<u32> = reading
                    .iter()
                    .filter(|(_, (deadline, _))| *deadline <= now || view_deadline <= now)
                    .map(|(&pid, _)| pid)
                    .collect();
                for pid in overdue {
                    if let Some((_, id)) = reading.remove(&pid) {
                        abandon(id);
                    }
                    entries.push(late(pid, too_slow.clone()));
                }
            }
        }
        if Instant::now() >= view_deadline {
            for (pid, (_, id)) in std::mem::take(&mut reading) {
                abandon(id);
                entries.push(late(pid, too_slow.clone()));
            }
            for (pid, _) in pending.by_ref() {
                entries.push(late(
                    pid,
                    format!("not read: the view's {} s had passed", all.as_secs_f64()),
                ));
            }
            break;
        }
    }
    entries
}

/// Marks reader `id` stuck, if it is still alive.
fn abandon(id: u64) {
    if let Some((_, stuck)) = readers().alive.get_mut(&id) {
        *stuck = true;
    }
}

/// Every process (but this one) whose table exists where it would publish it, with its start
/// time; and how many processes in other PID namespaces could not be looked into. Of each
/// process only `/proc/PID/status` is read (by [`ps::locate`]); each table directory is listed
/// once a scan (the host's, and each container's, however many processes it holds: a
/// directory is known by its device and inode), and nothing is opened.
fn processes_with_a_table() -> (Vec<(u32, Option<u64>)>, usize) {
    processes_listed_in(&mut Listings::default())
}

/// [`processes_with_a_table`], the directories' listings kept in `listings`.
fn processes_listed_in(listings: &mut Listings) -> (Vec<(u32, Option<u64>)>, usize) {
    let me = std::process::id();
    let mut found = Vec::new();
    let mut unreachable = 0;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return (found, unreachable);
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        // Gone already: it is not on the host any more.
        let Ok(location) = ps::locate(pid) else {
            continue;
        };
        if location.unreachable.is_some() {
            unreachable += 1;
            continue;
        }
        let key = (location.published_pid, location.namespace);
        let listed = location.open_dir().is_ok_and(|d| listings.holds(&d, key));
        if listed {
            found.push((pid, threadtable::start_time(pid)));
        }
    }
    (found, unreachable)
}

/// The table directories listed in one scan, by device and inode.
#[derive(Default)]
struct Listings {
    listed: BTreeMap<(u64, u64), BTreeSet<(u32, u64)>>,
    /// How many listings were made (for the test that there is one a directory).
    made: usize,
}

impl Listings {
    /// Whether `dir` has a table of `key` (pid, PID namespace): `dir` listed the first time.
    fn holds(&mut self, dir: &Dir, key: (u32, u64)) -> bool {
        let Listings { listed, made } = self;
        match dir.identity() {
            Ok(identity) => listed
                .entry(identity)
                .or_insert_with(|| {
                    *made += 1;
                    threadtable::listed(dir)
                })
                .contains(&key),
            // Not known by an identity (fstat failed): listed on its own.
            Err(_) => {
                *made += 1;
                threadtable::listed(dir).contains(&key)
            }
        }
    }
}

/// Reads process `pid`, found with a table when it had the start time `start`: its row, or one
/// line saying why there is none.
pub fn entry_of(pid: u32, start: Option<u64>) -> Entry {
    let snapshot = ps::read(pid);
    // Another start time (or none) means the process found is not the one read to the end.
    if start.is_none() || threadtable::start_time(pid) != start {
        return Entry::Line(ProcessLine {
            pid,
            command: snapshot.ok().map(|s| s.name),
            why: "exited while it was read".into(),
        });
    }
    match snapshot {
        Err(why) => Entry::Line(ProcessLine {
            pid,
            command: None,
            why,
        }),
        Ok(s) => match &s.no_table {
            Some(why) => Entry::Line(ProcessLine {
                pid,
                command: Some(s.name.clone()),
                why: format!("thread table not read: {why}"),
            }),
            None => Entry::Row(ProcessRow::from_snapshot(&s)),
        },
    }
}

/// SPEC §16's flags over the rows: workers of two processes on different GPUs sharing CPUs; a
/// step thread sharing a core with another process's step or result thread (`cores`: the SMT
/// sibling sets; a CPU none lists is a core of its own); a process whose memory lies mostly off
/// its workers' node (`kernel_nodes`: the kernel's nodes with CPUs; memory on nodes without CPUs,
/// a GPU's own memory, is left out). `gpu_local`: each GPU's local CPUs by PCI address; workers
/// of two GPUs sharing CPUs local to both (two GPUs of one Grace node or socket) are where the
/// library puts them, not a collision — unless one of them works on its GPU's slice (`slices`:
/// each GPU's slice by PCI address, SPEC §18), which no other GPU's workers may share.
pub fn flags(
    rows: &[&ProcessRow],
    cores: &[CpuMask],
    kernel_nodes: &[(usize, CpuMask)],
    gpu_local: &BTreeMap<String, CpuMask>,
    slices: &BTreeMap<String, CpuMask>,
) -> Vec<Flag> {
    let mut flags = Vec::new();
    for (i, a) in rows.iter().enumerate() {
        for b in &rows[i + 1..] {
            if let Some(flag) = workers_share(a, b, gpu_local, slices) {
                flags.push(flag);
            }
            if let Some(flag) = steps_share_a_core(a, b, cores) {
                flags.push(flag);
            }
        }
    }
    for r in rows {
        if let Some(flag) = memory_off_node(r, kernel_nodes) {
            flags.push(flag);
        }
    }
    flags
}

fn workers_share(
    a: &ProcessRow,
    b: &ProcessRow,
    gpu_local: &BTreeMap<String, CpuMask>,
    slices: &BTreeMap<String, CpuMask>,
) -> Option<Flag> {
    let (da, db) = (a.devices(), b.devices());
    if da.is_empty() || db.is_empty() || !da.is_disjoint(&db) {
        return None;
    }
    // A process runs under slicing when its workers lie within its GPUs' slices: the table does
    // not say, but a worker set that narrow is a slice's.
    let sliced = |p: &ProcessRow| {
        let slice = p
            .devices()
            .iter()
            .filter_map(|d| slices.get(*d))
            .fold(CpuMask::default(), |acc, s| acc.union(s));
        let workers = p.on(Kind::Worker);
        !slice.is_empty() && !workers.is_empty() && workers.is_subset(&slice)
    };
    // The CPUs local to every GPU of both (none when one is not a GPU of this tree, or under
    // slicing, where a slice is its GPU's alone).
    let local_to_all = if sliced(a) || sliced(b) {
        CpuMask::default()
    } else {
        da.union(&db)
            .map(|d| gpu_local.get(*d).cloned().unwrap_or_default())
            .reduce(|acc, m| acc.intersection(&m))
            .unwrap_or_default()
    };
    let shared = a
        .on(Kind::Worker)
        .intersection(&b.on(Kind::Worker))
        .difference(&local_to_all);
    if shared.is_empty() {
        return None;
    }
    let text = format!(
        "workers of {} on {} and {} on {} share CPU{} {}",
        a.pid,
        a.gpus(),
        b.pid,
        b.gpus(),
        plural(&shared),
        shared.to_list()
    );
    Some(Flag {
        kind: "workers-share-cpus",
        pids: vec![a.pid, b.pid],
        cpus: shared,
        text,
    })
}

fn steps_share_a_core(a: &ProcessRow, b: &ProcessRow, cores: &[CpuMask]) -> Option<Flag> {
    let core_of = |cpu: usize| {
        cores
            .iter()
            .find(|c| c.contains(cpu))
            .cloned()
            .unwrap_or_else(|| CpuMask::from_cpus([cpu]))
    };
    let pinned = |r: &ProcessRow| r.on(Kind::Step).union(&r.on(Kind::Result));
    let mut shared = CpuMask::default();
    let mut what = None;
    for cpu in pinned(a).iter() {
        let core = core_of(cpu);
        let touches = |r: &ProcessRow, kind| !r.on(kind).intersection(&core).is_empty();
        let found = if touches(a, Kind::Step) && touches(b, Kind::Step) {
            Some(format!("step threads of {} and {}", a.pid, b.pid))
        } else if touches(a, Kind::Step) && touches(b, Kind::Result) {
            Some(format!(
                "the step thread of {} and the result thread of {}",
                a.pid, b.pid
            ))
        } else if touches(a, Kind::Result) && touches(b, Kind::Step) {
            Some(format!(
                "the result thread of {} and the step thread of {}",
                a.pid, b.pid
            ))
        } else {
            None
        };
        if let Some(found) = found {
            what.get_or_insert(found);
            shared = shared.union(&core.intersection(&pinned(a).union(&pinned(b))));
        }
    }
    let what = what?;
    let text = format!(
        "{what} on one core: CPU{} {}",
        plural(&shared),
        shared.to_list()
    );
    Some(Flag {
        kind: "step-threads-share-a-core",
        pids: vec![a.pid, b.pid],
        cpus: shared,
        text,
    })
}

/// A worker process's resident memory against its workers' node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffNode {
    /// The one kernel node its workers' CPUs are on.
    pub node: usize,
    /// Bytes on each other node with CPUs (none of them zero).
    pub off: BTreeMap<usize, u64>,
    /// Bytes on every node with CPUs.
    pub total: u64,
}

/// Where `r`'s memory lies against its workers' node (`kernel_nodes`: the kernel's nodes with
/// CPUs; memory on nodes without CPUs, a GPU's own memory, is left out); `None` when its workers
/// are on no node or several, or its memory is not readable.
pub fn off_node(r: &ProcessRow, kernel_nodes: &[(usize, CpuMask)]) -> Option<OffNode> {
    let workers = r.on(Kind::Worker);
    let memory = r.memory.as_ref().ok()?;
    let nodes: Vec<usize> = kernel_nodes
        .iter()
        .filter(|(_, cpus)| !cpus.intersection(&workers).is_empty())
        .map(|(id, _)| *id)
        .collect();
    // Workers over several nodes have no one node their memory belongs on.
    let [node] = nodes.as_slice() else {
        return None;
    };
    let with_cpus: BTreeMap<usize, u64> = memory
        .bytes
        .iter()
        .filter(|(n, _)| kernel_nodes.iter().any(|(id, _)| id == *n))
        .map(|(n, b)| (*n, *b))
        .collect();
    let total: u64 = with_cpus.values().sum();
    let off: BTreeMap<usize, u64> = with_cpus
        .into_iter()
        .filter(|(n, b)| n != node && *b > 0)
        .collect();
    Some(OffNode {
        node: *node,
        off,
        total,
    })
}

fn memory_off_node(r: &ProcessRow, kernel_nodes: &[(usize, CpuMask)]) -> Option<Flag> {
    let workers = r.on(Kind::Worker);
    let OffNode { node, off, total } = off_node(r, kernel_nodes)?;
    let off_total: u64 = off.values().sum();
    if total == 0 || off_total * 2 <= total {
        return None;
    }
    let elsewhere: Vec<String> = off.keys().map(usize::to_string).collect();
    let text = format!(
        "memory of {} lies mostly off its workers' node {node} (CPU{} {}): {} of {} on node{} {}",
        r.pid,
        plural(&workers),
        workers.to_list(),
        draw::human(off_total),
        draw::human(total),
        if elsewhere.len() == 1 { "" } else { "s" },
        elsewhere.join(", "),
    );
    Some(Flag {
        kind: "memory-off-node",
        pids: vec![r.pid],
        cpus: workers,
        text,
    })
}

fn plural(cpus: &CpuMask) -> &'static str {
    if cpus.count() == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(crate) fn m(list: &str) -> CpuMask {
        CpuMask::parse_list(list).unwrap()
    }

    pub(crate) fn lease(device: &str, gpu: usize) -> LeaseLine {
        LeaseLine {
            id: 1,
            gpu_index: Some(gpu),
            device: device.into(),
            slice: None,
        }
    }

    /// A process with `kinds`' CPUs, a thread of each, leases on `devices`, and `memory` bytes
    /// per node.
    pub(crate) fn row(
        pid: u32,
        devices: &[(&str, usize)],
        kinds: &[(Kind, &str)],
        memory: &[(usize, u64)],
    ) -> ProcessRow {
        ProcessRow {
            pid,
            namespace_pid: None,
            command: "server".into(),
            leases: Ok(devices.iter().map(|(d, g)| lease(d, *g)).collect()),
            cpus: kinds.iter().map(|(k, l)| (*k, m(l))).collect(),
            threads: kinds.iter().map(|(k, _)| (*k, 1)).collect(),
            explicit: CpuMask::default(),
            external: CpuMask::default(),
            memory: Ok(NodeMemory {
                bytes: memory.iter().copied().collect(),
                source: "test".into(),
                partial: None,
            }),
        }
    }

    pub(crate) const GPU0: (&str, usize) = ("0000:3b:00.0", 0);
    pub(crate) const GPU1: (&str, usize) = ("0000:86:00.0", 1);

    /// Two nodes of four CPUs, two hardware threads a core (0,4 1,5 2,6 3,7 on node 0).
    pub(crate) fn host() -> (Vec<CpuMask>, Vec<(usize, CpuMask)>) {
        let cores = (0..4)
            .map(|c| m(&format!("{c},{}", c + 4)))
            .collect::<Vec<_>>();
        let cores = cores
            .into_iter()
            .chain((8..12).map(|c| m(&format!("{c},{}", c + 4))))
            .collect();
        (cores, vec![(0, m("0-7")), (1, m("8-15"))])
    }

    /// The flags of `rows` on [`host`], with no GPU-local CPUs or slices known.
    fn flags_on_host(rows: &[&ProcessRow]) -> Vec<Flag> {
        let (cores, nodes) = host();
        flags(rows, &cores, &nodes, &BTreeMap::new(), &BTreeMap::new())
    }

    pub(crate) fn kinds(flags: &[Flag]) -> Vec<(&'static str, Vec<u32>, String)> {
        flags
            .iter()
            .map(|f| (f.kind, f.pids.clone(), f.cpus.to_list()))
            .collect()
    }

    #[test]
    fn workers_of_two_gpus_on_shared_cpus_are_flagged_and_one_gpus_are_not() {
        let a = row(1, &[GPU0], &[(Kind::Worker, "8-15")], &[]);
        let b = row(2, &[GPU1], &[(Kind::Worker, "12-15")], &[]);
        let same_gpu = row(3, &[GPU0], &[(Kind::Worker, "8-15")], &[]);
        let host_only = row(4, &[], &[(Kind::Host, "0-15")], &[]);
        let f = flags_on_host(&[&a, &b, &same_gpu, &host_only]);
        assert_eq!(
            kinds(&f),
            [
                ("workers-share-cpus", vec![1, 2], "12-15".to_string()),
                ("workers-share-cpus", vec![2, 3], "12-15".to_string()),
            ]
        );
        assert_eq!(
            f[0].text,
            "workers of 1 on GPU 0 (0000:3b:00.0) and 2 on GPU 1 (0000:86:00.0) share CPUs 12-15"
        );
    }

    /// Two GPUs of one Grace node (a GB200 tray's 0 and 1, both local to CPUs 0-7 here): their
    /// workers on that node's CPUs are where the library puts them; workers of a GPU of the
    /// other node on them are still flagged.
    #[test]
    fn workers_of_two_gpus_sharing_cpus_local_to_both_are_not_flagged() {
        let (cores, nodes) = host();
        let tray0 = ("0008:06:00.0", 0);
        let tray1 = ("0009:06:00.0", 1);
        let tray2 = ("0018:06:00.0", 2);
        let local: BTreeMap<String, CpuMask> = [
            (tray0.0.to_string(), m("0-7")),
            (tray1.0.to_string(), m("0-7")),
            (tray2.0.to_string(), m("8-15")),
        ]
        .into();
        let a = row(1, &[tray0], &[(Kind::Worker, "0-7")], &[]);
        let b = row(2, &[tray1], &[(Kind::Worker, "0-7")], &[]);
        let c = row(3, &[tray2], &[(Kind::Worker, "6-15")], &[]);
        let f = flags(&[&a, &b, &c], &cores, &nodes, &local, &BTreeMap::new());
        assert_eq!(
            kinds(&f),
            [
                ("workers-share-cpus", vec![1, 3], "6-7".to_string()),
                ("workers-share-cpus", vec![2, 3], "6-7".to_string()),
            ]
        );
        // Without the tree's GPUs, every shared CPU is flagged.
        let f = flags_on_host(&[&a, &b]);
        assert_eq!(
            kinds(&f),
            [("workers-share-cpus", vec![1, 2], "0-7".to_string())]
        );
    }

    #[test]
    fn a_step_thread_sharing_a_core_with_another_processs_step_or_result_is_flagged() {
        // Siblings 1 and 5 are one core: two CPUs, one core.
        let a = row(1, &[GPU0], &[(Kind::Step, "1")], &[]);
        let b = row(2, &[GPU1], &[(Kind::Step, "5")], &[]);
        let c = row(3, &[GPU1], &[(Kind::Result, "2")], &[]);
        let d = row(4, &[GPU0], &[(Kind::Step, "6")], &[]);
        // Results alone on one core: not a step collision.
        let e = row(5, &[GPU0], &[(Kind::Result, "3")], &[]);
        let f5 = row(6, &[GPU1], &[(Kind::Result, "7")], &[]);
        let f = flags_on_host(&[&a, &b, &c, &d, &e, &f5]);
        assert_eq!(
            kinds(&f),
            [
                ("step-threads-share-a-core", vec![1, 2], "1,5".to_string()),
                ("step-threads-share-a-core", vec![3, 4], "2,6".to_string()),
            ]
        );
        assert_eq!(
            f[1].text,
            "the result thread of 3 and the step thread of 4 on one core: CPUs 2,6"
        );
    }

    /// Under slicing, two GPUs of one node each own a slice: a worker of the other GPU on it is
    /// flagged, while workers on their own slices, or both on the whole node (slicing off), are
    /// not.
    #[test]
    fn a_slice_is_its_gpus_alone_and_the_shared_node_excuses_nothing() {
        let (cores, nodes) = host();
        let tray0 = ("0008:06:00.0", 0);
        let tray1 = ("0009:06:00.0", 1);
        let local: BTreeMap<String, CpuMask> = [
            (tray0.0.to_string(), m("0-7")),
            (tray1.0.to_string(), m("0-7")),
        ]
        .into();
        let slices: BTreeMap<String, CpuMask> = [
            (tray0.0.to_string(), m("0-3")),
            (tray1.0.to_string(), m("4-7")),
        ]
        .into();
        let sliced0 = row(1, &[tray0], &[(Kind::Worker, "0-3")], &[]);
        let sliced1 = row(2, &[tray1], &[(Kind::Worker, "4-7")], &[]);
        let whole1 = row(3, &[tray1], &[(Kind::Worker, "0-7")], &[]);
        let whole0 = row(4, &[tray0], &[(Kind::Worker, "0-7")], &[]);
        let f = flags(&[&sliced0, &sliced1], &cores, &nodes, &local, &slices);
        assert!(f.is_empty(), "{:?}", kinds(&f));
        let f = flags(&[&sliced0, &whole1], &cores, &nodes, &local, &slices);
        assert_eq!(
            kinds(&f),
            [("workers-share-cpus", vec![1, 3], "0-3".to_string())]
        );
        let f = flags(&[&whole0, &whole1], &cores, &nodes, &local, &slices);
        assert!(f.is_empty(), "slicing off: {:?}", kinds(&f));
    }

    #[test]
    fn memory_mostly_off_the_workers_node_is_flagged_and_a_cpuless_node_does_not_count() {
        let gib = 1 << 30;
        let off = row(
            1,
            &[GPU0],
            &[(Kind::Worker, "8-11")],
            &[(0, 3 * gib), (1, gib)],
        );
        let half = row(2, &[GPU0], &[(Kind::Worker, "8-11")], &[(0, gib), (1, gib)]);
        // Node 2 has no CPU (a GPU's memory): left out.
        let gpu_memory = row(
            3,
            &[GPU0],
            &[(Kind::Worker, "8-11")],
            &[(1, gib), (2, 9 * gib)],
        );
        // Workers on both nodes: no one node their memory belongs on.
        let spread = row(4, &[GPU0], &[(Kind::Worker, "0-15")], &[(0, 9 * gib)]);
        let f = flags_on_host(&[&off, &half, &gpu_memory, &spread]);
        let memory: Vec<_> = kinds(&f)
            .into_iter()
            .filter(|k| k.0 == "memory-off-node")
            .collect();
        assert_eq!(memory, [("memory-off-node", vec![1], "8-11".to_string())]);
        let text = &f.iter().find(|f| f.kind == "memory-off-node").unwrap().text;
        assert_eq!(
            text,
            "memory of 1 lies mostly off its workers' node 1 (CPUs 8-11): 3.0 GiB of 4.0 GiB on node 0"
        );
    }

    #[test]
    fn a_process_gone_after_it_was_found_is_one_line() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = threadtable::start_time(pid);
        assert!(start.is_some());
        child.kill().unwrap();
        child.wait().unwrap();
        let Entry::Line(line) = entry_of(pid, start) else {
            panic!("a row for a process that is gone");
        };
        assert_eq!(line.why, "exited while it was read");
        // The same pid with another start time: another process, never read as the one found.
        let me = std::process::id();
        let Entry::Line(line) = entry_of(me, Some(1)) else {
            panic!("a row for another start time");
        };
        assert_eq!(line.why, "exited while it was read");
    }

    /// Readers of a process whose `/proc` files never answer (the reader below blocks until the
    /// test ends, as a read of a process stopped with its memory-map lock held does), scan after
    /// scan as `metrics --every` and `--listen` scan: every process is one entry a scan, and the
    /// readers still blocked stay bounded, whether the same 20 processes block in every scan or
    /// 20 others each time.
    #[test]
    fn readers_stuck_scan_after_scan_stay_bounded() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Condvar, Mutex};

        let blocked = Arc::new(AtomicUsize::new(0));
        let released = Arc::new((Mutex::new(false), Condvar::new()));
        let reader = {
            let (blocked, released) = (blocked.clone(), released.clone());
            move |pid: u32, _start: Option<u64>| {
                if pid >= 1000 {
                    blocked.fetch_add(1, Ordering::SeqCst);
                    let (lock, changed) = &*released;
                    let mut done = lock.lock().unwrap();
                    while !*done {
                        done = changed.wait(done).unwrap();
                    }
                    blocked.fetch_sub(1, Ordering::SeqCst);
                }
                Entry::Line(ProcessLine {
                    pid,
                    command: None,
                    why: "read".into(),
                })
            }
        };
        let each = Duration::from_millis(50);
        let mut most_blocked = 0;
        for scan in 0..12u32 {
            // The same 20 blocking processes in the first half, 20 others each scan after.
            let first = if scan < 6 { 1000 } else { 2000 + scan * 20 };
            let found: Vec<(u32, Option<u64>)> = (1..=5)
                .chain(first..first + 20)
                .map(|pid| (pid, Some(1)))
                .collect();
            let entries = read_bounded_by(found, each, Duration::from_secs(10), reader.clone());
            assert_eq!(entries.len(), 25, "scan {scan}");
            let read = entries
                .iter()
                .filter(|e| matches!(e, Entry::Line(l) if l.why == "read"))
                .count();
            if scan < 6 {
                // 20 stuck, room for the rest: those that answer are read.
                assert_eq!(read, 5, "scan {scan}: the processes that answer are read");
            }
            if scan == 11 {
                // Every place taken by a stuck reader: one line each, no reader started.
                assert!(
                    entries.iter().all(|e| matches!(e, Entry::Line(l)
                        if l.why.starts_with("not read: ") && l.why.contains("still stuck"))),
                    "{entries:?}"
                );
            }
            most_blocked = most_blocked.max(blocked.load(Ordering::SeqCst));
            assert!(
                most_blocked <= READERS_AT_MOST,
                "scan {scan}: {most_blocked} readers blocked"
            );
            // Every blocked reader was given up on, and is counted as stuck.
            assert_eq!(
                readers_stuck(),
                blocked.load(Ordering::SeqCst),
                "scan {scan}"
            );
        }
        assert!(most_blocked >= 20, "{most_blocked}");
        let (lock, changed) = &*released;
        *lock.lock().unwrap() = true;
        changed.notify_all();
    }

    /// Processes in PID namespaces of their own whose root is the host's (`unshare --pid`): each
    /// one's table directory is the host's `/dev/shm`, listed once for all of them.
    #[test]
    fn each_table_directory_is_listed_once_a_scan() {
        struct Reaped(Vec<std::process::Child>);
        impl Drop for Reaped {
            fn drop(&mut self) {
                for child in &mut self.0 {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
        let spawned: Vec<std::process::Child> = (0..4)
            .map(|_| {
                std::process::Command::new("unshare")
                    .args([
                        "--user",
                        "--map-root-user",
                        "--pid",
                        "--fork",
                        "sleep",
                        "60",
                    ])
                    .spawn()
                    .expect("unshare")
            })
            .collect();
        let children = Reaped(spawned);
        // Until each one's child runs in its namespace (`sleep` there, pid 1 of it).
        let inside = |parent: u32| {
            std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
                .ok()
                .and_then(|c| c.split_whitespace().next()?.parse::<u32>().ok())
                .filter(|&child| ps::locate(child).is_ok_and(|l| l.namespace_pid.is_some()))
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !children.0.iter().all(|c| inside(c.id()).is_some()) {
            assert!(
                Instant::now() < deadline,
                "the namespaced processes never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut listings = Listings::default();
        let _ = processes_listed_in(&mut listings);
        assert!(listings.made >= 1);
        assert_eq!(
            listings.made,
            listings.listed.len(),
            "a directory listed more than once"
        );
        drop(children);
    }
}
