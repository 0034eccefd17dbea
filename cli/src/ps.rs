//! `tllm-affinity ps PID [--json] [--no-color]`: every thread of a live process with its role and
//! placement (from the thread table the library publishes, see [`tllm_affinity_core::table::threadtable`]) and its
//! mask exactly as the kernel reports it (`Cpus_allowed_list` of `/proc/PID/task/TID/status`),
//! drawn as a grid: one row per thread, one column per CPU of the host. Without a PID, `main`
//! shows the host view of [`crate::host`] instead: every process with a table, built on this
//! module's [`read`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use tllm_affinity_core::host::kernel_text::{keyed_value, read_capped};
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::registry::{Placement, Role, Tid};
use tllm_affinity_core::table::threadtable::{self, LeaseLine, NoTable};
use tllm_affinity_core::table::untrusted;

use crate::draw::{
    cell, lease_device, lease_json, legend, mark, memory_json, memory_line, paint, placement_name,
    role_name, visible, NOT_ALLOWED,
};
use crate::grid::{wrap, wrap_items};

#[derive(clap::Args, Debug)]
pub struct PsArgs {
    /// The process to show; without one, every process on the host with a thread table, by GPU
    /// and by CPU, and what collides.
    pub pid: Option<u32>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// No colour (also when stdout is not a terminal or NO_COLOR is set).
    #[arg(long)]
    pub no_color: bool,
    /// Read the CPUs' NUMA nodes and cores, which the grid groups its columns by, under this
    /// directory (default: TLLM_AFFINITY_SYSFS_ROOT, else /).
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<PathBuf>,
}

/// One thread as `ps` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadRow {
    pub tid: Tid,
    /// The thread's id in the process's own PID namespace, when that is not ours.
    pub namespace_tid: Option<Tid>,
    pub name: String,
    /// `None`: the table does not list it (or there is no table).
    pub known: Option<(Role, Placement)>,
    /// `Cpus_allowed_list` as the kernel wrote it.
    pub mask_text: String,
    pub mask: CpuMask,
}

/// A process's threads, and whether its library published a table.
#[derive(Debug)]
pub struct Snapshot {
    pub pid: u32,
    /// The process's pid in its own PID namespace, when that is not ours (a container).
    pub namespace_pid: Option<u32>,
    pub name: String,
    /// Why roles are unknown, when the process has no table.
    pub no_table: Option<String>,
    /// A table is there but is not believed (another owner, an earlier process, not a table).
    pub table_refused: bool,
    /// Why the table is partial (its library could not allocate all of it), when it is.
    pub table_partial: Option<String>,
    /// Whether the library is mapped in the process; `None` when its maps are not ours to read.
    pub library_loaded: Option<bool>,
    /// The library is loaded and off: `TLLM_AFFINITY_DISABLE=1` in the process's environment.
    /// Read only for a process named to `ps PID` (see [`off_by_its_environment`]).
    pub disabled: bool,
    /// The host's online CPUs: the grid's columns.
    pub cpus: Vec<usize>,
    pub threads: Vec<ThreadRow>,
    /// Resident memory per NUMA node, or why it cannot be read.
    pub memory: Result<crate::memory_reading::NodeMemory, String>,
    /// What the language adapters noted (one line each), or why the notes cannot be read.
    pub adapters: Result<Vec<AdapterLine>, String>,
    /// The leases open in the process, or why they cannot be read.
    pub leases: Result<Vec<LeaseLine>, String>,
}

/// Where a process's thread table is, as the process itself named it: in its own root and PID
/// namespace when it is in a container (SPEC §13).
#[derive(Debug, Clone)]
pub struct Location {
    pub proc_dir: PathBuf,
    /// The process's pid in its own PID namespace, when that is not ours.
    pub namespace_pid: Option<u32>,
    /// The pid the table and its header carry.
    pub published_pid: u32,
    pub namespace: u64,
    pub dir: PathBuf,
    /// The table's path.
    pub file: PathBuf,
    /// Why the process's root cannot be looked into (another user's container, without the
    /// right to trace it): its table cannot be found.
    pub unreachable: Option<String>,
}

/// Finds where process `pid` published its table (whether or not it did); an error when the
/// process is gone. Reads its `status` and nothing else of it.
pub fn locate(pid: u32) -> Result<Location, String> {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    // A process in another PID namespace (a container) published its table under its own pid,
    // in its own /dev/shm, with its own tids: found through its root and its NSpid lines.
    let status = read_capped(&proc_dir.join("status"), STATUS_BYTES)
        .map_err(|e| format!("no process {pid}: {e}"))?;
    let namespace_pid = nspid_last(&status).filter(|&inner| inner != pid);
    let root = match namespace_pid {
        Some(_) => proc_dir.join("root"),
        None => PathBuf::from("/"),
    };
    // Looking into another process's root takes the right to trace it.
    let unreachable = namespace_pid
        .and_then(|_| untrusted::Dir::open(&root).err())
        .map(|e| format!("{}: {e}", root.display()));
    let published_pid = namespace_pid.unwrap_or(pid);
    let dir = match namespace_pid {
        Some(_) => root.join("dev/shm"),
        None => threadtable::directory(&lock_dir()),
    };
    let namespace = threadtable::pid_namespace(&proc_dir).unwrap_or(0);
    let file = dir.join(threadtable::file_name(published_pid, namespace));
    Ok(Location {
        proc_dir,
        namespace_pid,
        published_pid,
        namespace,
        dir,
        file,
        unreachable,
    })
}

impl Location {
    /// The directory the table is in, held open: in a container, resolved inside its root with
    /// no link followed (its `/dev/shm`, else the lock directory there); on the host, our
    /// `/dev/shm`, else our lock directory.
    pub fn open_dir(&self) -> Result<untrusted::Dir, String> {
        let shown = |e: std::io::Error| format!("{}: {e}", self.dir.display());
        match self.namespace_pid {
            Some(_) => {
                let root = self.proc_dir.join("root");
                untrusted::Dir::open_in_root(&root, Path::new("/dev/shm"))
                    .or_else(|_| untrusted::Dir::open_in_root(&root, &lock_dir()))
                    .map_err(shown)
            }
            None => untrusted::Dir::open(&self.dir).map_err(shown),
        }
    }
}

/// The most `ps` reads of a `status` file (a process with thousands of supplementary groups
/// has a long one).
pub const STATUS_BYTES: u64 = 64 * 1024;
/// The most `ps` reads of a process's `maps`, to see whether the library is mapped: past it,
/// the answer is "not known".
pub const MAPS_BYTES: u64 = 4 << 20;
/// The most `ps` reads of a thread's `comm` (the kernel's are 16 bytes).
const COMM_BYTES: u64 = 256;
/// The most `ps PID` reads of a process's `environ`, to see whether the library is off: past it,
/// the switch is not seen and the usual note stands.
pub const ENVIRON_BYTES: u64 = 1 << 20;

/// One adapter's line in the table's notes: `name: state; detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterLine {
    pub name: String,
    pub state: String,
    pub detail: Option<String>,
}

impl AdapterLine {
    fn parse(line: &str) -> Option<AdapterLine> {
        let (name, rest) = line.split_once(": ")?;
        let (state, detail) = match rest.split_once("; ") {
            Some((state, detail)) => (state, Some(detail.to_string())),
            None => (rest, None),
        };
        Some(AdapterLine {
            name: name.to_string(),
            state: state.to_string(),
            detail,
        })
    }

    /// What the state means for the user, where it is not the adapter doing its work.
    fn meaning(&self) -> Option<&'static str> {
        match (self.name.as_str(), self.state.as_str()) {
            (_, "engaged") => None,
            ("trtllm", "not-found" | "signature") => Some(
                "adapter inactive: this TensorRT-LLM has none of the call sites the adapter wraps, \
                 so its own pinning (if any) runs as without tllm-affinity",
            ),
            ("trtllm", "not-imported") => Some("TensorRT-LLM is not imported in this process"),
            _ => None,
        }
    }
}

/// The most time `ps` gives one process: past it (its `/proc` files block: a process stopped
/// with its memory-map lock held), it is an error for `ps PID` and one line in the host view.
pub const PROCESS_LIMIT: Duration = Duration::from_secs(5);

/// `ps PID`: one process's threads.
pub fn run(pid: u32, args: &PsArgs) -> Result<(), String> {
    let snapshot = read_within(pid, PROCESS_LIMIT)?;
    if args.json {
        let text = crate::json::pretty(&to_json(&snapshot))?;
        println!("{text}");
    } else {
        let root = crate::sysfs_root(args.sysfs_root.as_deref());
        let columns = GridCpus::of(&root, &snapshot);
        let colour = crate::draw::wants_colour(args.no_color);
        print!(
            "{}",
            to_text(&snapshot, &columns, colour, crate::grid::width())
        );
    }
    Ok(())
}

/// The CPUs `ps PID`'s grid shows, by NUMA node, and the host's cores: those of the tree under
/// the sysfs root read (its online CPUs and every CPU a thread may run on), as the host view
/// shows them.
pub struct GridCpus {
    pub groups: Vec<crate::grid::CpuGroup>,
    pub cores: Vec<CpuMask>,
}

impl GridCpus {
    pub fn of(root: &tllm_affinity_core::host::topology::SysfsRoot, s: &Snapshot) -> GridCpus {
        let topology = tllm_affinity_core::host::topology::Topology::read(root).ok();
        let masks = s
            .threads
            .iter()
            .fold(CpuMask::from_cpus(s.cpus.iter().copied()), |acc, t| {
                acc.union(&t.mask)
            });
        GridCpus {
            groups: crate::grid::groups(topology.as_ref(), &masks),
            cores: topology.as_ref().map(|t| t.cores()).unwrap_or_default(),
        }
    }
}

/// [`read`] on a thread of its own, given up after `limit`: a process whose `/proc` files block
/// (stopped with its memory-map lock held) is an error, never a hang.
pub fn read_within(pid: u32, limit: Duration) -> Result<Snapshot, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("ps-reader".into())
        .spawn(move || {
            let _ = tx.send(read(pid).map(|mut snapshot| {
                snapshot.disabled = off_by_its_environment(&snapshot);
                snapshot
            }));
        })
        .map_err(|e| format!("process {pid}: no thread to read it: {e}"))?;
    rx.recv_timeout(limit).unwrap_or_else(|_| {
        Err(format!(
            "process {pid}: not read within {} s (its /proc files do not answer)",
            limit.as_secs_f64()
        ))
    })
}

/// Whether a process whose library is loaded and published no table was started with
/// `TLLM_AFFINITY_DISABLE=1`: its `environ` as it was at exec, which is what the library read at
/// load. Only `ps PID` asks, for the one process named (SPEC §8); the host view never reads an
/// `environ`.
fn off_by_its_environment(s: &Snapshot) -> bool {
    if s.no_table.is_none() || s.table_refused || s.library_loaded != Some(true) {
        return false;
    }
    let Ok(environ) = read_capped(
        Path::new(&format!("/proc/{}/environ", s.pid)),
        ENVIRON_BYTES,
    ) else {
        return false;
    };
    // The first entry is the one getenv finds, as the library did.
    let prefix = format!("{}=", tllm_affinity_core::placement::settings::DISABLE);
    environ
        .split('\0')
        .find_map(|entry| entry.strip_prefix(&prefix))
        .is_some_and(|value| {
            tllm_affinity_core::placement::settings::disabled_by(Some(value.as_ref()))
        })
}

/// Reads `/proc/<pid>/task` and joins it with the process's thread table.
pub fn read(pid: u32) -> Result<Snapshot, String> {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let name = read_capped(&proc_dir.join("comm"), COMM_BYTES)
        .map_err(|e| format!("no process {pid}: {e}"))?
        .trim_end_matches('\n')
        .to_string();
    let location = locate(pid)?;
    let Location {
        ref proc_dir,
        namespace_pid,
        published_pid,
        namespace,
        ref file,
        ref unreachable,
        ..
    } = location;
    let mut tids: Vec<Tid> = std::fs::read_dir(proc_dir.join("task"))
        .map_err(|e| format!("cannot list the threads of process {pid}: {e}"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    let statuses: Vec<(Tid, String)> = tids
        .iter()
        .filter_map(|&tid| {
            // A thread may exit while we read: it is simply not shown.
            let status = read_capped(&proc_dir.join(format!("task/{tid}/status")), STATUS_BYTES);
            Some((tid, status.ok()?))
        })
        .collect();
    let wanted: Vec<Tid> = statuses
        .iter()
        .map(|(tid, status)| {
            namespace_pid
                .and_then(|_| nspid_last(status))
                .map_or(*tid, |t| t as Tid)
        })
        .collect();
    let expect = threadtable::Expect {
        pid: published_pid,
        proc_pid: pid,
        namespace,
        owner: owner_of(proc_dir).unwrap_or(u32::MAX),
        tids: &wanted,
    };
    // Err: whether something is there but not believed (another owner, an earlier process,
    // not a table), and why there is no table to read.
    let opened = match unreachable {
        Some(why) => Err((false, format!("its root cannot be looked into: {why}"))),
        None => location
            .open_dir()
            .map_err(|why| (false, why))
            .and_then(|dir| match threadtable::open(&dir, &expect) {
                Ok(table) => Ok(table),
                Err(NoTable::Missing) => Err((
                    false,
                    format!("no thread table at {}{}", file.display(), no_room(&dir)),
                )),
                Err(NoTable::Refused(why)) => Err((true, why)),
            }),
    };
    let table_refused = matches!(opened, Err((true, _)));
    let opened = opened.map_err(|(_, why)| why);
    let table_partial = opened.as_ref().ok().and_then(|t| t.partial());
    let (table, no_table, adapters, leases) = match opened {
        Ok(table) => match table.records(&wanted) {
            Ok(records) => (
                records,
                None,
                table
                    .notes()
                    .map(|notes| notes.lines().filter_map(AdapterLine::parse).collect()),
                table.leases(),
            ),
            Err(why) => (BTreeMap::new(), Some(why), Ok(Vec::new()), Ok(Vec::new())),
        },
        Err(why) => (BTreeMap::new(), Some(why), Ok(Vec::new()), Ok(Vec::new())),
    };
    let mut threads = Vec::with_capacity(statuses.len());
    for (tid, status) in statuses {
        let task = proc_dir.join(format!("task/{tid}"));
        let Some(mask_text) = keyed_value(&status, "Cpus_allowed_list").map(str::to_string) else {
            continue;
        };
        let name = read_capped(&task.join("comm"), COMM_BYTES)
            .map(|c| c.trim_end_matches('\n').to_string())
            .unwrap_or_default();
        let namespace_tid = namespace_pid
            .and_then(|_| nspid_last(&status))
            .map(|t| t as Tid);
        threads.push(ThreadRow {
            tid,
            namespace_tid,
            name,
            known: table.get(&namespace_tid.unwrap_or(tid)).copied(),
            mask: CpuMask::parse_list(&mask_text).unwrap_or_default(),
            mask_text,
        });
    }
    let mut cpus = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|t| CpuMask::parse_list(&t).ok())
        .unwrap_or_default();
    for t in &threads {
        cpus = cpus.union(&t.mask);
    }
    let library_loaded = read_capped(&proc_dir.join("maps"), MAPS_BYTES)
        .ok()
        .map(|maps| {
            maps.lines()
                .filter_map(|l| l.rsplit('/').next())
                .any(|file| file.starts_with("libtllm_affinity"))
        });
    Ok(Snapshot {
        pid,
        namespace_pid,
        name,
        no_table,
        table_refused,
        table_partial,
        library_loaded,
        disabled: false,
        cpus: cpus.iter().collect(),
        threads,
        memory: crate::memory_reading::read(proc_dir, pid),
        adapters,
        leases,
    })
}

/// The effective uid of the process (`Uid:` in `/proc/<pid>/status`, as our namespace sees it):
/// the library creates its table as that user.
fn owner_of(proc_dir: &Path) -> Option<u32> {
    let status = read_capped(&proc_dir.join("status"), STATUS_BYTES).ok()?;
    keyed_value(&status, "Uid")?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The last `NSpid:` entry of `/proc/<pid>/status`: the id in the innermost PID namespace.
fn nspid_last(status: &str) -> Option<u32> {
    keyed_value(status, "NSpid")?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Why a table directory may hold no table: full or read-only (the library, which could not
/// create one, carried on without it), in words after the path; empty otherwise.
fn no_room(dir: &untrusted::Dir) -> String {
    match dir.space() {
        Ok(space) if space.read_only => ": its directory is read-only".to_string(),
        Ok(space) if space.free_bytes < 64 * 1024 => format!(
            ": its directory has no space left ({} of {} bytes free)",
            space.free_bytes, space.total_bytes
        ),
        _ => String::new(),
    }
}

/// Where a process publishes its table when `/dev/shm` is missing: its `TLLM_AFFINITY_LOCK_DIR`,
/// which `ps` takes to be its own (another process's environment is never read: that would
/// read every process on the host, and take each one's memory-map lock), else `/tmp`.
fn lock_dir() -> PathBuf {
    std::env::var_os("TLLM_AFFINITY_LOCK_DIR")
        .map(PathBuf::from)
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("/tmp").to_path_buf())
}

/// The lines above the grid: the process and where its roles come from, why it has none, what
/// its adapters said, its memory per node and its open leases.
fn describe_process(s: &Snapshot) -> String {
    let mut out = String::new();
    let source = match (&s.no_table, &s.table_partial) {
        (None, None) => "roles from the library's thread table".to_string(),
        (None, Some(why)) => format!(
            "roles from the library's thread table, partial: part of it could not be allocated \
             ({why}), so some threads show no role"
        ),
        (Some(_), _) => "no thread table: roles unknown".to_string(),
    };
    let namespace = match s.namespace_pid {
        Some(inner) => format!(", pid {inner} in its PID namespace"),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "process {} ({}{namespace}): {} thread{}; {source}",
        s.pid,
        visible(&s.name),
        s.threads.len(),
        if s.threads.len() == 1 { "" } else { "s" }
    );
    if let Some(note) = note(s) {
        let _ = writeln!(out, "note: {}", visible(&note));
    }
    match &s.adapters {
        Ok(lines) => {
            for a in lines {
                let detail = a
                    .detail
                    .as_deref()
                    .map(|d| format!("; {d}"))
                    .unwrap_or_default();
                let meaning = a.meaning().map(|m| format!(" ({m})")).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "adapter {}: {}{}{meaning}",
                    visible(&a.name),
                    visible(&a.state),
                    visible(&detail)
                );
            }
        }
        Err(why) => {
            let _ = writeln!(out, "adapters: not readable ({})", visible(why));
        }
    }
    let _ = writeln!(out, "{}", visible(&memory_line(&s.memory)));
    match &s.leases {
        Ok(leases) if leases.is_empty() => {}
        Ok(leases) => {
            let each: Vec<String> = leases
                .iter()
                .map(|l| format!("{} on {}", l.id, visible(&lease_device(l))))
                .collect();
            let _ = writeln!(out, "leases open: {}", each.join(", "));
        }
        Err(why) => {
            let _ = writeln!(out, "leases: not readable ({})", visible(why));
        }
    }
    out
}

/// The process's threads as text within `width` columns: what it is and what is known of it
/// ([`describe_process`], wrapped between words), then the grid over `columns` (at the width's
/// scale, [`crate::grid::layout`]), one row a thread, and its legend.
pub fn to_text(s: &Snapshot, columns: &GridCpus, colour: bool, width: usize) -> String {
    let mut out = String::new();
    for line in describe_process(s).lines() {
        let _ = writeln!(out, "{}", wrap(line, width, 2));
    }
    let w_name = s
        .threads
        .iter()
        .map(|t| visible(&t.name).chars().count())
        .max()
        .unwrap_or(0)
        .max(4);
    let w_mask = s
        .threads
        .iter()
        .map(|t| t.mask_text.len())
        .max()
        .unwrap_or(0)
        .max(4);
    // `role` arrives padded to 7 columns: it may carry colour codes, which have no width.
    let prefix = |tid: &str, name: &str, role: &str, placement: &str, mask: &str| {
        format!("{tid:>8}  {name:<w_name$}  {role}  {placement:<9}  {mask:<w_mask$}  ")
    };
    let pad_role = |role: &str| format!("{role:<7}");
    let blank_width = prefix("", "", &pad_role(""), "", "").len();
    let fits = |room: usize| crate::grid::layout(&columns.groups, &columns.cores, room);
    // The grid beside each thread where a column a node fits there; else under it, indented.
    let (layout, beside) = match fits(width.saturating_sub(blank_width)) {
        l if l.width() + blank_width <= width => (l, true),
        _ => (fits(width.saturating_sub(GRID_INDENT)), false),
    };
    let [nodes, labels, ticks] = layout.header();
    let indent = if beside { blank_width } else { GRID_INDENT };
    let blank = " ".repeat(indent);
    let heading = prefix("TID", "NAME", &pad_role("ROLE"), "PLACEMENT", "MASK");
    if layout.groups.len() > 1 {
        let _ = writeln!(out, "{:>w$}  {nodes}", "NODE", w = indent - 2);
    }
    let _ = writeln!(out, "{blank}{labels}");
    if beside {
        let _ = writeln!(out, "{heading}{ticks}");
    } else {
        let _ = writeln!(out, "{}", heading.trim_end());
        let _ = writeln!(out, "{blank}{ticks}");
    }
    let mut printed = Vec::new();
    let mut dot = false;
    for t in &s.threads {
        let (_, code) = mark(t.known);
        let grid = layout.row(|column| {
            let on = !t.mask.intersection(column).is_empty();
            on.then(|| cell(mark(t.known), colour))
        });
        dot |= grid.contains(NOT_ALLOWED);
        if grid.chars().any(|c| c != NOT_ALLOWED && c != ' ') {
            printed.push(t.known);
        }
        let role = role_name(t.known);
        let role_cell = if colour {
            format!("{}{}", paint(role, code), " ".repeat(7 - role.len()))
        } else {
            pad_role(role)
        };
        let row = prefix(
            &t.tid.to_string(),
            &visible(&t.name),
            &role_cell,
            placement_name(t.known),
            &t.mask_text,
        );
        if beside {
            let _ = writeln!(out, "{row}{grid}");
        } else {
            let _ = writeln!(out, "{}", row.trim_end());
            let _ = writeln!(out, "{blank}{grid}");
        }
    }
    // The legend's marks in the order a reader meets roles, then the placements of their own.
    let order = |k: &Option<(Role, Placement)>| "hwsrx!?".find(mark(*k).0).unwrap_or(usize::MAX);
    printed.sort_by_key(order);
    let items = legend(&printed, dot.then_some("not allowed"), colour);
    let _ = writeln!(out, "{}", wrap_items("legend:", &items, width, 8));
    if let Some(scale) = layout.scale() {
        let _ = writeln!(out, "{}", wrap(&scale, width, 2));
    }
    if s.no_table.is_none() && s.threads.iter().any(|t| t.known.is_none()) {
        let _ = writeln!(
            out,
            "{}",
            wrap(
                "unknown: threads the library never saw (created before it loaded, by raw clone, \
                 or inside glibc); treated as host, never touched",
                width,
                2
            )
        );
    }
    out
}

/// Where the grid goes under each thread (a row too wide for it beside): this far in.
const GRID_INDENT: usize = 10;

/// Why a process shows no roles. The library maps its table only at the process's first thread,
/// configure, worker scope or pin, so a loaded library with no table is no fault.
fn note(s: &Snapshot) -> Option<String> {
    let reason = s.no_table.as_ref()?;
    let pid = s.pid;
    if s.disabled {
        return Some(format!(
            "process {pid}: library loaded, disabled by TLLM_AFFINITY_DISABLE=1: every call \
             passes through, no thread is placed and no thread table is published"
        ));
    }
    if s.table_refused {
        return Some(format!(
            "the thread table of process {pid} is not believed, so roles are not shown: {reason}"
        ));
    }
    Some(match s.library_loaded {
        Some(true) => format!(
            "libtllm_affinity.so is loaded in process {pid} but has published no thread table: \
             it publishes one at the process's first thread, configure, worker scope or pin \
             ({reason})"
        ),
        Some(false) => format!("libtllm_affinity.so is not loaded in process {pid} ({reason})"),
        None => format!(
            "process {pid} has no thread table: libtllm_affinity.so is not loaded there, or has \
             seen no thread, configure, worker scope or pin yet ({reason})"
        ),
    })
}

pub fn to_json(s: &Snapshot) -> Value {
    json!({
        "pid": s.pid,
        "namespace_pid": s.namespace_pid,
        "name": s.name,
        "table": s.no_table.is_none(),
        "table_partial": s.table_partial,
        "disabled": s.disabled,
        "note": note(s),
        "cpus": CpuMask::from_cpus(s.cpus.iter().copied()).to_list(),
        "memory": memory_json(&s.memory),
        "leases": match &s.leases {
            Ok(leases) => json!(leases.iter().map(lease_json).collect::<Vec<_>>()),
            Err(why) => json!({ "error": why }),
        },
        "adapters": match &s.adapters {
            Ok(lines) => json!(lines.iter().map(|a| json!({
                "name": a.name,
                "state": a.state,
                "detail": a.detail,
                "meaning": a.meaning(),
            })).collect::<Vec<_>>()),
            Err(why) => json!({ "error": why }),
        },
        "threads": s.threads.iter().map(|t| json!({
            "tid": t.tid,
            "namespace_tid": t.namespace_tid,
            "name": t.name,
            "role": role_name(t.known),
            "placement": placement_name(t.known),
            "mask": t.mask_text,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tid: Tid, known: Option<(Role, Placement)>, mask: &str) -> ThreadRow {
        ThreadRow {
            tid,
            namespace_tid: None,
            name: format!("t{tid}"),
            known,
            mask_text: mask.to_string(),
            mask: CpuMask::parse_list(mask).unwrap(),
        }
    }

    /// The snapshot's CPUs as one group of no node, cores unknown.
    fn flat(s: &Snapshot) -> GridCpus {
        GridCpus {
            groups: vec![crate::grid::CpuGroup {
                node: None,
                cpus: s.cpus.clone(),
            }],
            cores: Vec::new(),
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            pid: 10,
            namespace_pid: None,
            name: "server".into(),
            no_table: None,
            table_refused: false,
            table_partial: None,
            library_loaded: Some(true),
            disabled: false,
            cpus: (0..12).collect(),
            memory: Err("test".into()),
            adapters: Ok(Vec::new()),
            leases: Ok(Vec::new()),
            threads: vec![
                row(10, Some((Role::Host, Placement::Inherited)), "0-11"),
                row(11, Some((Role::Worker, Placement::Worker)), "6-11"),
                row(12, Some((Role::Worker, Placement::Step)), "6"),
                row(13, None, "0-11"),
            ],
        }
    }

    #[test]
    fn plain_grid_marks_roles_with_letters() {
        let text = to_text(&snapshot(), &flat(&snapshot()), false, 120);
        assert!(!text.contains('\x1b'), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[1], "memory per node: not readable (test)", "{text}");
        assert!(lines[4].ends_with("hhhhhhhhhhhh"), "{text}");
        assert!(lines[5].ends_with("......wwwwww"), "{text}");
        assert!(lines[6].ends_with("......s....."), "{text}");
        assert!(lines[7].ends_with("????????????"), "{text}");
        assert!(
            text.contains("unknown: threads the library never saw"),
            "{text}"
        );
    }

    #[test]
    fn each_placement_has_its_own_colour_in_the_grid() {
        let mut s = snapshot();
        s.threads
            .push(row(14, Some((Role::Worker, Placement::Result)), "7"));
        s.threads
            .push(row(15, Some((Role::Worker, Placement::Explicit)), "8"));
        s.threads
            .push(row(16, Some((Role::Host, Placement::External)), "9"));
        let text = to_text(&s, &flat(&s), true, 120);
        // The colour code painting each thread's row of the grid.
        let grid_colour = |tid: &str| {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(tid))
                .unwrap_or_else(|| panic!("no row {tid}: {text}"));
            let at = line.find('█').unwrap();
            let code_start = line[..at].rfind('\x1b').unwrap();
            line[code_start..at].to_string()
        };
        let colours: Vec<String> = ["10 ", "11 ", "12 ", "13 ", "14 ", "15 ", "16 "]
            .iter()
            .map(|t| grid_colour(t))
            .collect();
        let distinct: std::collections::BTreeSet<&String> = colours.iter().collect();
        assert_eq!(distinct.len(), colours.len(), "{colours:?}\n{text}");
    }

    #[test]
    fn colour_grid_paints_by_role() {
        let text = to_text(&snapshot(), &flat(&snapshot()), true, 120);
        assert!(text.contains("\x1b[34m█\x1b[0m"), "host blue");
        assert!(text.contains("\x1b[32m█\x1b[0m"), "worker green");
        assert!(text.contains("\x1b[33m█\x1b[0m"), "step yellow");
        assert!(text.contains("\x1b[90m█\x1b[0m"), "unknown grey");
        assert!(text.contains("\x1b[32mworker\x1b[0m"), "{text}");
        // A thread named like a role keeps its name plain; only the role cell is painted.
        let mut named = snapshot();
        named.threads[1].name = "host".into();
        let text = to_text(&named, &flat(&named), true, 120);
        assert!(text.contains("host  \x1b[32mworker\x1b[0m "), "{text}");
    }

    #[test]
    fn adapter_lines_say_what_engaged_and_what_inactive_means() {
        let mut s = snapshot();
        s.adapters = Ok([
            "trtllm: engaged; tensorrt_llm 1.2; base_worker found 1/0",
            "trtllm: not-found",
        ]
        .iter()
        .filter_map(|l| AdapterLine::parse(l))
        .collect());
        let text = to_text(&s, &flat(&s), false, 120);
        assert!(
            text.contains("adapter trtllm: engaged; tensorrt_llm 1.2; base_worker found 1/0\n"),
            "{text}"
        );
        assert!(
            text.contains("adapter trtllm: not-found (adapter inactive: "),
            "{text}"
        );
        s.adapters = Err("kept changing".into());
        assert!(
            to_text(&s, &flat(&s), false, 120).contains("adapters: not readable (kept changing)")
        );
    }

    #[test]
    fn this_process_has_no_table() {
        let s = read(std::process::id()).unwrap();
        assert!(s.no_table.is_some());
        assert!(s.threads.iter().all(|t| t.known.is_none()));
        let v = to_json(&s);
        assert_eq!(v["table"], false);
        assert!(!v["threads"].as_array().unwrap().is_empty());
    }
}
