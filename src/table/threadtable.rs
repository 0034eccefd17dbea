//! The live thread table: how a running process shows `tllm-affinity ps` the roles and
//! placements its library holds.
//!
//! At its first thread, configure, worker scope or pin (not at load: see
//! `engine::publish_table_if_pending`) the library maps a small shared file,
//! `tllm-affinity.<pid namespace>.<pid>.threads`, in `/dev/shm` (else in
//! `TLLM_AFFINITY_LOCK_DIR`); the namespace (its inode) keeps two processes with one pid number in
//! two PID namespaces sharing `/dev/shm` apart. The registry keeps one 8-byte record per slot in it:
//! a thread's birth costs one store, its exit another. The file is sparse, so untouched
//! records cost no memory. `ps` reads the file and joins it with `/proc/<pid>/task`, where the
//! kernel's masks are; it believes a file only when the process's owner owns it, and reads the
//! header and the records it needs, never more than the capacity. The header carries the process start time, so a file left by a killed
//! process is never mistaken for a live one that reused its pid.
//!
//! Layout (little-endian): magic `TLLMAFT1`, pid (u32), 4 reserved bytes, start time in clock
//! ticks (u64, field 22 of `/proc/<pid>/stat`), capacity (u64), the notes' sequence number (u64,
//! odd while they are rewritten) and length (u64), 16 reserved bytes; then `capacity` records of
//! `tid | role << 32 | placement << 40`, where 0 is an empty record; then [`NOTES_BYTES`] of
//! notes: what the language adapters said about themselves, one printable line each, which `ps`
//! shows above the grid; then [`LEASES_BYTES`] of the open leases, one line each (see
//! [`LeaseLine`]), under a sequence number and length of their own in the header's last two
//! words. A table of a library from before the leases has zeros there and ends at the notes: it
//! reads as one with no lease, and a reader from before them never looks there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use crate::identity::{Placement, Role, Tid};
use crate::log_warn;
use crate::mask::CpuMask;
use crate::table::untrusted::{Dir, OwnFile, Rules};

pub const MAGIC: &[u8; 8] = b"TLLMAFT1";
pub const HEADER_BYTES: usize = 64;
/// Records for this many slots; a process with more live threads publishes the first ones.
pub const CAPACITY: usize = 1 << 20;
/// Where the notes start, after the last record.
pub const NOTES_OFFSET: usize = HEADER_BYTES + CAPACITY * 8;
/// Room for the notes: every adapter the library keeps, each with its longest line.
pub const NOTES_BYTES: usize = 8192;
/// Where the open leases' lines start, after the notes.
pub const LEASES_OFFSET: usize = NOTES_OFFSET + NOTES_BYTES;
/// Room for the leases' lines: dozens of leases, each with its device's name.
pub const LEASES_BYTES: usize = 4096;
/// The whole file.
pub const FILE_BYTES: usize = LEASES_OFFSET + LEASES_BYTES;

/// A text area of the table that one writer rewrites under a sequence number (a seqlock): the
/// header words (u64 index) of its sequence number and length, and where it lies.
struct TextArea {
    sequence_word: usize,
    length_word: usize,
    offset: usize,
    bytes: usize,
    /// What the text is, for the reader's errors.
    what: &'static str,
}

const NOTES: TextArea = TextArea {
    sequence_word: 4,
    length_word: 5,
    offset: NOTES_OFFSET,
    bytes: NOTES_BYTES,
    what: "the adapters' notes",
};

const LEASES: TextArea = TextArea {
    sequence_word: 6,
    length_word: 7,
    offset: LEASES_OFFSET,
    bytes: LEASES_BYTES,
    what: "the leases",
};

/// The table's file name for `pid` in the PID namespace `namespace` (the namespace's inode): a
/// process in another namespace that shares `/dev/shm` (`--ipc=host`) may have the same pid
/// number, never the same name.
pub fn file_name(pid: u32, namespace: u64) -> String {
    format!("tllm-affinity.{namespace}.{pid}.threads")
}

/// The inode of the PID namespace of the process whose `/proc` directory is `proc_dir`
/// (`/proc/self`, `/proc/<pid>`): the same number seen from every namespace.
pub fn pid_namespace(proc_dir: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(proc_dir.join("ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// The name a process publishes under when its usual one ([`file_name`]) is taken by someone
/// else: the usual name with 64 unpredictable bits, which nobody could have planted ahead.
/// `ps` finds it by its pid and namespace, then believes it by its owner and header, as the usual
/// one.
pub fn alternative_name(pid: u32, namespace: u64, unpredictable: u64) -> String {
    format!("tllm-affinity.{namespace}.{pid}.{unpredictable:016x}.threads")
}

/// The name's pid and namespace, for a file named by [`file_name`] or [`alternative_name`].
pub fn parse_file_name(name: &str) -> Option<(u32, u64)> {
    let rest = name
        .strip_prefix("tllm-affinity.")?
        .strip_suffix(".threads")?;
    let mut parts = rest.split('.');
    let namespace = parts.next()?.parse().ok()?;
    let pid = parts.next()?.parse().ok()?;
    match parts.next() {
        None => {}
        Some(suffix) if suffix.len() == 16 && suffix.bytes().all(|b| b.is_ascii_hexdigit()) => {}
        Some(_) => return None,
    }
    if parts.next().is_some() {
        return None;
    }
    Some((pid, namespace))
}

/// The processes (pid, PID namespace) with a table in `dir`, under either name: one listing,
/// nothing opened.
pub fn listed(dir: &Dir) -> std::collections::BTreeSet<(u32, u64)> {
    dir.names()
        .unwrap_or_default()
        .iter()
        .filter_map(|name| parse_file_name(name))
        .collect()
}

/// Where a process publishes its table: `/dev/shm` when it is a directory, else `fallback`.
pub fn directory(fallback: &Path) -> PathBuf {
    directory_in(Path::new("/"), fallback)
}

/// [`directory`] as a process whose root is `root` sees it (`/proc/<pid>/root` for a process in
/// a container, whose `/dev/shm` is its own): both paths are taken inside `root`.
pub fn directory_in(root: &Path, fallback: &Path) -> PathBuf {
    let inside = |path: &Path| root.join(path.strip_prefix("/").unwrap_or(path));
    let shm = inside(Path::new("/dev/shm"));
    if shm.is_dir() {
        shm
    } else {
        inside(fallback)
    }
}

pub fn encode(tid: Tid, role: Role, placement: Placement) -> u64 {
    let role = match role {
        Role::Host => 1u64,
        Role::Worker => 2,
    };
    let placement = match placement {
        Placement::Inherited => 1u64,
        Placement::Worker => 2,
        Placement::Step => 3,
        Placement::Result => 4,
        Placement::Explicit => 5,
        Placement::External => 6,
    };
    (tid as u32 as u64) | role << 32 | placement << 40
}

pub fn decode(record: u64) -> Option<(Tid, Role, Placement)> {
    let tid = (record & 0xffff_ffff) as u32 as Tid;
    let role = match (record >> 32) & 0xff {
        1 => Role::Host,
        2 => Role::Worker,
        _ => return None,
    };
    let placement = match (record >> 40) & 0xff {
        1 => Placement::Inherited,
        2 => Placement::Worker,
        3 => Placement::Step,
        4 => Placement::Result,
        5 => Placement::Explicit,
        6 => Placement::External,
        _ => return None,
    };
    Some((tid, role, placement))
}

pub fn header(pid: u32, start_time: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&pid.to_le_bytes());
    h[16..24].copy_from_slice(&start_time.to_le_bytes());
    h[24..32].copy_from_slice(&(CAPACITY as u64).to_le_bytes());
    h
}

/// The header word whose high half carries the errno that first kept a part of the table from
/// being allocated (0: the table is whole); its low half is the pid.
const PARTIAL_WORD: usize = 1;

/// A table mapped into this process, and the one way to store into it: every store lands on a
/// page that was allocated first (SPEC §9). The file is sparse, and a full or read-only
/// filesystem answers a store into a page it cannot give with SIGBUS, so each part is allocated
/// (`fallocate`) before its first store: the records page by page as threads are born, the notes
/// and the leases at their first write; never the whole file up front, since a container's
/// `/dev/shm` is small and shared. A part that cannot be allocated is left out (threads born past
/// it unpublished, no notes, no leases), the header says why for `ps`, and the log says so once.
pub struct Mapped {
    header: &'static [AtomicU64],
    records: &'static [AtomicU64],
    notes: &'static [AtomicU64],
    leases: &'static [AtomicU64],
    pages: Pages,
}

/// Where a table's pages come from, and how far they are known to exist.
struct Pages {
    /// `None`: plain memory (the registry's unit tests), every page there.
    file: Option<OwnFile>,
    /// The file's path, for the log.
    path: PathBuf,
    page: usize,
    /// Bytes from the file's start known allocated: the header's page, then the records' pages.
    records_end: AtomicUsize,
    records_refused: AtomicBool,
    notes: AtomicU8,
    leases: AtomicU8,
    /// Whether the log has said that the table lost a part.
    said: AtomicBool,
}

/// An area's allocation, as [`Pages::notes`] and [`Pages::leases`] keep it.
const NOT_YET: u8 = 0;
const ALLOCATED: u8 = 1;
const REFUSED: u8 = 2;

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapped")
            .field("path", &self.pages.path)
            .field("records_end", &self.pages.records_end)
            .finish_non_exhaustive()
    }
}

impl Mapped {
    /// The table mapped at `words` (the whole file as words, [`FILE_BYTES`] long), its file
    /// remembered by `file` at `path`, of which the first `page` bytes (the header's page,
    /// written with `write(2)`) exist.
    pub fn in_file(
        words: &'static [AtomicU64],
        file: OwnFile,
        path: PathBuf,
        page: usize,
    ) -> Mapped {
        Mapped::new(words, Some(file), path, page)
    }

    /// A table in plain memory (`words`: [`FILE_BYTES`] of it), every page there: for tests.
    pub fn in_memory(words: &'static [AtomicU64]) -> Mapped {
        Mapped::new(words, None, PathBuf::new(), FILE_BYTES)
    }

    fn new(
        words: &'static [AtomicU64],
        file: Option<OwnFile>,
        path: PathBuf,
        page: usize,
    ) -> Mapped {
        let view = |offset: usize, bytes: usize| {
            let start = (offset / 8).min(words.len());
            &words[start..(start + bytes / 8).min(words.len())]
        };
        Mapped {
            header: view(0, HEADER_BYTES),
            records: view(HEADER_BYTES, CAPACITY * 8),
            notes: view(NOTES_OFFSET, NOTES_BYTES),
            leases: view(LEASES_OFFSET, LEASES_BYTES),
            pages: Pages {
                file,
                path,
                page: page.max(8),
                records_end: AtomicUsize::new(page),
                records_refused: AtomicBool::new(false),
                notes: AtomicU8::new(NOT_YET),
                leases: AtomicU8::new(NOT_YET),
                said: AtomicBool::new(false),
            },
        }
    }

    /// The records whose pages exist now: a store into any of them is safe. The registry keeps
    /// this slice, so a birth pays one bounds check, as it did before the pages were counted.
    pub fn allocated_records(&self) -> &'static [AtomicU64] {
        let end = self.pages.records_end.load(Ordering::Acquire);
        let slots = end.saturating_sub(HEADER_BYTES) / 8;
        &self.records[..slots.min(self.records.len())]
    }

    /// Allocates the records' pages through `slot` and answers the records that exist then
    /// ([`Self::allocated_records`]); `None` when `slot` is past the capacity or its page could
    /// not be allocated (it is then never published).
    #[cold]
    pub fn allocate_records_through(&self, slot: usize) -> Option<&'static [AtomicU64]> {
        if slot >= self.records.len() {
            return None;
        }
        let end = HEADER_BYTES + (slot + 1) * 8;
        if end > self.pages.records_end.load(Ordering::Acquire) && !self.allocate_records_to(end) {
            return None;
        }
        Some(self.allocated_records())
    }

    /// Rewrites the adapters' notes. A reader takes them only when the sequence number was even
    /// and the same before and after its read (a seqlock: one writer, whoever holds the adapters'
    /// lock). Text past the room is cut at its last whole line.
    pub fn write_notes(&self, text: &str) {
        if self.allocate_area(
            &self.pages.notes,
            NOTES_OFFSET,
            NOTES_BYTES,
            "notes",
            text.is_empty(),
        ) {
            write_notes(self.header, self.notes, text);
        }
    }

    /// Rewrites the open leases, as [`Self::write_notes`] does the notes; one writer, whoever
    /// holds the registry's lock.
    pub fn write_leases(&self, open: &[LeaseLine]) {
        if self.allocate_area(
            &self.pages.leases,
            LEASES_OFFSET,
            LEASES_BYTES,
            "leases",
            open.is_empty(),
        ) {
            write_leases(self.header, self.leases, open);
        }
    }

    /// Allocates the records' pages up to byte `end`, one page at a time as threads are born.
    #[cold]
    fn allocate_records_to(&self, end: usize) -> bool {
        let pages = &self.pages;
        if pages.records_refused.load(Ordering::Relaxed) {
            return false;
        }
        let from = pages.records_end.load(Ordering::Acquire);
        let to = end.div_ceil(pages.page) * pages.page;
        match self.allocate(from, to - from) {
            Ok(()) => {
                pages.records_end.fetch_max(to, Ordering::AcqRel);
                true
            }
            Err(e) => {
                pages.records_refused.store(true, Ordering::Relaxed);
                let slots = from.saturating_sub(HEADER_BYTES) / 8;
                self.refused(&e, &format!("records past the first {slots} threads"));
                false
            }
        }
    }

    /// Allocates an area at its first write; `state` remembers the answer.
    fn allocate_area(
        &self,
        state: &AtomicU8,
        offset: usize,
        bytes: usize,
        what: &str,
        text_is_empty: bool,
    ) -> bool {
        match state.load(Ordering::Acquire) {
            ALLOCATED => return true,
            REFUSED => return false,
            // Never written: it reads as empty already (its length word is 0), and most
            // processes never have a note or a lease, so their table stays a page or two.
            _ if text_is_empty => return false,
            _ => {}
        }
        let page = self.pages.page;
        let start = offset / page * page;
        let end = (offset + bytes).div_ceil(page) * page;
        match self.allocate(start, end - start) {
            Ok(()) => {
                state.store(ALLOCATED, Ordering::Release);
                true
            }
            Err(e) => {
                state.store(REFUSED, Ordering::Release);
                self.refused(&e, &format!("its {what}"));
                false
            }
        }
    }

    fn allocate(&self, offset: usize, len: usize) -> std::io::Result<()> {
        match &self.pages.file {
            Some(file) if len > 0 => file.allocate(offset as u64, len as u64),
            _ => Ok(()),
        }
    }

    /// Says once in the log, and once in the header for `ps`, that a part of the table is left out.
    fn refused(&self, why: &std::io::Error, what: &str) {
        if self.pages.said.swap(true, Ordering::AcqRel) {
            return;
        }
        let errno = why.raw_os_error().unwrap_or(libc::EIO).clamp(1, i32::MAX) as u64;
        if let Some(word) = self.header.get(PARTIAL_WORD) {
            word.fetch_or(errno << 32, Ordering::Relaxed);
        }
        log_warn!(
            "the thread table {}: {what} could not be allocated ({why}); tllm-affinity ps shows \
             this process without them, and placement goes on",
            self.pages.path.display()
        );
    }
}

/// The notes written into `header` and `notes` (the table's words of each): [`Mapped::write_notes`]
/// once their pages exist.
fn write_notes(header: &[AtomicU64], notes: &[AtomicU64], text: &str) {
    write_text(&NOTES, header, notes, text);
}

/// The open leases written into `header` and `leases`: [`Mapped::write_leases`] once their pages
/// exist.
fn write_leases(header: &[AtomicU64], leases: &[AtomicU64], open: &[LeaseLine]) {
    let text: String = open.iter().map(LeaseLine::to_line).collect();
    write_text(&LEASES, header, leases, &text);
}

fn write_text(area: &TextArea, header: &[AtomicU64], words: &[AtomicU64], text: &str) {
    let mut text = text.as_bytes();
    if text.len() > area.bytes {
        let cut = text[..area.bytes]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |at| at + 1);
        text = &text[..cut];
    }
    let (Some(sequence), Some(length)) =
        (header.get(area.sequence_word), header.get(area.length_word))
    else {
        return;
    };
    sequence.fetch_add(1, Ordering::AcqRel);
    for (word, chunk) in words.iter().zip(text.chunks(8)) {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
    }
    length.store(text.len() as u64, Ordering::Relaxed);
    sequence.fetch_add(1, Ordering::Release);
}

/// One open lease as the table carries it: `<lease> <GPU index or -> <device> [<slice>]`, the
/// device being the GPU's PCI address (or `TLLM_AFFINITY_CPUS=<list>` where that variable chose
/// the CPUs), the index the GPU's among the GPUs the process sees, the slice the GPU's CPU list
/// under `TLLM_AFFINITY_SLICE=gpu` (absent otherwise, and in a library from before slices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLine {
    pub id: i64,
    pub gpu_index: Option<usize>,
    pub device: String,
    pub slice: Option<CpuMask>,
}

impl LeaseLine {
    fn to_line(&self) -> String {
        let index = self
            .gpu_index
            .map_or_else(|| "-".to_string(), |i| i.to_string());
        // A device name is one word: a space or line break in it would break the line.
        let device: String = self
            .device
            .chars()
            .map(|c| if c.is_ascii_graphic() { c } else { '_' })
            .collect();
        match &self.slice {
            Some(slice) => format!("{} {index} {device} {}\n", self.id, slice.to_list()),
            None => format!("{} {index} {device}\n", self.id),
        }
    }

    /// A line [`Self::to_line`] wrote; a slice that is not a CPU list is no slice, and words after
    /// it (a later library's) are ignored.
    fn parse(line: &str) -> Option<LeaseLine> {
        let mut words = line.split_whitespace();
        let id = words.next()?.parse().ok()?;
        let gpu_index = match words.next()? {
            "-" => None,
            index => Some(index.parse().ok()?),
        };
        let device = words.next()?.to_string();
        let slice = words.next().and_then(|w| CpuMask::parse_list(w).ok());
        Some(LeaseLine {
            id,
            gpu_index,
            device,
            slice,
        })
    }
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot. Read
/// from its main thread's own `task/<pid>/stat`, which holds the same value: qemu-user fakes
/// a process's view of `/proc/<own pid>/stat` (its start time rounded to whole seconds), so the
/// library under qemu would record a start time that `ps` never reads back.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat")).ok()?;
    crate::host::kernel_text::stat_field(&stat, 22)
}

/// Removes the tables in `dir` that processes of this user left when they ended without running
/// their exit handlers (`_exit`, a signal): a table whose pid is gone, or now names a process
/// that started at another time. Run by each process as it maps its own, so they never pile up.
/// Only tables of `namespace`, our own PID namespace, can be judged: another namespace's pids
/// mean other processes, and its tables are left to its own processes. Each is opened by the
/// shared rules ([`crate::table::untrusted`]): whatever another user (or this one) swaps in, nothing
/// but a regular file of `uid` is opened, and nothing blocks.
///
/// It runs on a process's first thread, in a directory every local user can write, so it is
/// bounded: it looks at the first [`SWEEP_NAMES`] names the kernel lists and stops after
/// [`SWEEP_TIME`], whatever the directory holds (300 000 planted names cost the first thread
/// seconds when it read them all). A table it does not reach is left for a later process.
pub fn remove_stale(dir: &Dir, uid: u32, namespace: u64) -> usize {
    use std::os::unix::fs::FileExt;
    let started = std::time::Instant::now();
    let Ok(names) = dir.names_at_most(SWEEP_NAMES) else {
        return 0;
    };
    let rules = Rules {
        owner: uid,
        max_bytes: FILE_BYTES as u64,
    };
    let mut removed = 0;
    for name in names {
        if started.elapsed() > SWEEP_TIME {
            break;
        }
        let Some(pid) = parse_file_name(&name)
            .filter(|&(_, ns)| ns == namespace)
            .map(|(pid, _)| pid)
        else {
            continue;
        };
        // Another user's file is not ours to judge (nor, in a sticky directory, to remove).
        if dir.owner_of(&name) != Some(uid) {
            continue;
        }
        let Ok((file, facts)) = dir.open_file(&name, &rules) else {
            continue;
        };
        let mut head = [0u8; 24];
        let readable = file.read_exact_at(&mut head, 0).is_ok();
        let stale = if readable && &head[..8] == MAGIC {
            let recorded = u64::from_le_bytes(head[16..24].try_into().unwrap_or([0; 8]));
            start_time(pid) != Some(recorded)
        } else {
            // No header yet may be a process writing its table right now: wait a minute.
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            now - facts.modified > 60
        };
        if stale && dir.remove(&name).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The most names one sweep of stale tables looks at: a few `getdents` calls.
pub const SWEEP_NAMES: usize = 4096;
/// The most time one sweep takes.
pub const SWEEP_TIME: std::time::Duration = std::time::Duration::from_millis(2);

/// Who a table must belong to, and which threads to look for in it.
pub struct Expect<'a> {
    /// The pid in the process's own PID namespace (the file and its header carry it).
    pub pid: u32,
    /// The pid in ours, where `/proc` tells its start time and owner.
    pub proc_pid: u32,
    /// The process's PID namespace (the file's name carries it).
    pub namespace: u64,
    /// The effective uid of the process: a table owned by anyone else is not believed.
    pub owner: u32,
    /// The threads to find (tids of the process's namespace): reading stops once all are found.
    pub tids: &'a [Tid],
}

/// A table opened and believed: a regular file of the process's owner, with the magic, and the
/// header of this very process (not of an earlier one with its pid).
pub struct Table {
    file: std::fs::File,
    /// The name it has in its directory (the usual one, or the alternative).
    pub name: String,
}

/// Why a process has no table to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoTable {
    /// Nothing under either name.
    Missing,
    /// Something is there but is not believed: why.
    Refused(String),
}

impl std::fmt::Display for NoTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoTable::Missing => write!(f, "no thread table"),
            NoTable::Refused(why) => write!(f, "{why}"),
        }
    }
}

/// Opens the table `expect` names in `dir`: its usual name, else the alternatives its process
/// may have published under when the usual one was taken (see [`alternative_name`]), each only
/// through [`crate::table::untrusted`]'s rules: never a link, never anything but a regular file of the
/// process's owner, one name, at most [`FILE_BYTES`].
pub fn open(dir: &Dir, expect: &Expect) -> Result<Table, NoTable> {
    let usual = file_name(expect.pid, expect.namespace);
    let mut candidates = Vec::new();
    let mut refused = None;
    if dir.has(&usual) {
        candidates.push(usual.clone());
    }
    // The alternatives are looked for only when the usual name is not the owner's: another
    // user's file there is what makes a process publish under one.
    if dir.owner_of(&usual) != Some(expect.owner) {
        let theirs = dir.names().unwrap_or_default().into_iter().filter(|name| {
            *name != usual
                && parse_file_name(name) == Some((expect.pid, expect.namespace))
                && dir.owner_of(name) == Some(expect.owner)
        });
        candidates.extend(theirs);
    }
    for name in candidates {
        match open_one(dir, &name, expect) {
            Ok(file) => return Ok(Table { file, name }),
            Err(why) => {
                refused.get_or_insert(why);
            }
        }
    }
    Err(refused.map_or(NoTable::Missing, NoTable::Refused))
}

fn open_one(dir: &Dir, name: &str, expect: &Expect) -> Result<std::fs::File, String> {
    use std::os::unix::fs::FileExt;
    let rules = Rules {
        owner: expect.owner,
        max_bytes: FILE_BYTES as u64,
    };
    let (file, _) = dir
        .open_file(name, &rules)
        .map_err(|why| format!("{name}: {why}"))?;
    let mut head = [0u8; HEADER_BYTES];
    if file.read_exact_at(&mut head, 0).is_err() || &head[..8] != MAGIC {
        return Err(format!("{name}: not a tllm-affinity thread table"));
    }
    let file_pid = u32::from_le_bytes(head[8..12].try_into().unwrap_or([0; 4]));
    if file_pid != expect.pid || Some(header_word(&head, 2)) != start_time(expect.proc_pid) {
        return Err(format!(
            "{name}: left by an earlier process with pid {}",
            expect.pid
        ));
    }
    Ok(file)
}

/// Why part of a table is missing (see [`Mapped`]): the errno its library met, in words.
fn partial_reason(head: &[u8; HEADER_BYTES]) -> Option<String> {
    let errno = (header_word(head, PARTIAL_WORD) >> 32) as i32;
    (errno != 0).then(|| std::io::Error::from_raw_os_error(errno).to_string())
}

fn header_word(head: &[u8; HEADER_BYTES], index: usize) -> u64 {
    let at = index * 8;
    u64::from_le_bytes(head[at..at + 8].try_into().unwrap_or([0; 8]))
}

impl Table {
    /// Roles and placements the process published, for the threads `tids`. Reads the records
    /// only as far as needed: never more than [`CAPACITY`] of them (the file is at most
    /// [`FILE_BYTES`], checked as it was opened). Linear in records plus threads: each record
    /// is looked up in a set of the tids.
    pub fn records(&self, tids: &[Tid]) -> Result<BTreeMap<Tid, (Role, Placement)>, String> {
        use std::io::{Read, Seek};
        let tids: std::collections::HashSet<Tid> = tids.iter().copied().collect();
        let name = &self.name;
        let mut file = &self.file;
        file.seek(std::io::SeekFrom::Start(HEADER_BYTES as u64))
            .map_err(|e| format!("{name}: {e}"))?;
        let mut reader = file.take((CAPACITY * 8) as u64);
        let mut found = BTreeMap::new();
        let mut chunk = vec![0u8; 64 * 1024];
        while found.len() < tids.len() {
            let n = reader
                .read(&mut chunk)
                .map_err(|e| format!("{name}: {e}"))?;
            if n == 0 {
                break;
            }
            for record in chunk[..n - n % 8].chunks_exact(8) {
                if let Some((tid, role, placement)) =
                    decode(u64::from_le_bytes(record.try_into().unwrap_or([0; 8])))
                {
                    if tids.contains(&tid) {
                        found.insert(tid, (role, placement));
                    }
                }
            }
        }
        Ok(found)
    }

    /// The notes the process published (see [`write_notes`]): empty when it has none, an error
    /// when they kept changing while we read them.
    pub fn notes(&self) -> Result<String, String> {
        read_text(&NOTES, &self.file)
    }

    /// Why the process could not publish all of its table (its `/dev/shm` full, say), in words;
    /// `None` when the table is whole.
    pub fn partial(&self) -> Option<String> {
        use std::os::unix::fs::FileExt;
        let mut head = [0u8; HEADER_BYTES];
        self.file.read_exact_at(&mut head, 0).ok()?;
        partial_reason(&head)
    }

    /// The leases the process has open (see [`write_leases`]): none for a table of a library
    /// from before them; an error when its lines are not ours, or they kept changing while we
    /// read them.
    pub fn leases(&self) -> Result<Vec<LeaseLine>, String> {
        read_text(&LEASES, &self.file)?
            .lines()
            .map(|line| {
                LeaseLine::parse(line)
                    .ok_or_else(|| format!("{line:?} is not a lease: not believed"))
            })
            .collect()
    }
}

/// [`open`] then [`Table::records`] for `expect.tids`.
pub fn read(dir: &Dir, expect: &Expect) -> Result<BTreeMap<Tid, (Role, Placement)>, String> {
    open(dir, expect)
        .map_err(|e| e.to_string())?
        .records(expect.tids)
}

/// [`open`] then [`Table::notes`].
pub fn read_notes(dir: &Dir, expect: &Expect) -> Result<String, String> {
    open(dir, expect).map_err(|e| e.to_string())?.notes()
}

/// [`open`] then [`Table::leases`].
pub fn read_leases(dir: &Dir, expect: &Expect) -> Result<Vec<LeaseLine>, String> {
    open(dir, expect).map_err(|e| e.to_string())?.leases()
}

fn read_text(area: &TextArea, file: &std::fs::File) -> Result<String, String> {
    use std::os::unix::fs::FileExt;
    let mut head = [0u8; HEADER_BYTES];
    for _ in 0..8 {
        file.read_exact_at(&mut head, 0)
            .map_err(|e| e.to_string())?;
        let before = header_word(&head, area.sequence_word);
        let length = (header_word(&head, area.length_word) as usize).min(area.bytes);
        let mut text = vec![0u8; length];
        // A table of a library from before this area ends ahead of it: no text.
        if length > 0 && file.read_exact_at(&mut text, area.offset as u64).is_err() {
            return Ok(String::new());
        }
        file.read_exact_at(&mut head, 0)
            .map_err(|e| e.to_string())?;
        if before.is_multiple_of(2) && header_word(&head, area.sequence_word) == before {
            let printable = text
                .iter()
                .all(|&b| b == b'\n' || (b' '..=b'~').contains(&b));
            if !printable {
                return Err(format!(
                    "{} are not printable text: not believed",
                    area.what
                ));
            }
            return Ok(String::from_utf8_lossy(&text).into_owned());
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Err(format!("{} kept changing while read", area.what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let r = encode(123456, Role::Worker, Placement::Step);
        assert_eq!(decode(r), Some((123456, Role::Worker, Placement::Step)));
        assert_eq!(decode(0), None);
    }

    #[test]
    fn start_time_of_this_process_is_readable() {
        let me = std::process::id();
        // The main thread's file and the process's agree on a kernel (not under qemu-user,
        // which fakes the process's).
        let stat = std::fs::read_to_string(format!("/proc/{me}/stat")).unwrap();
        let process = crate::host::kernel_text::stat_field(&stat, 22);
        assert!(process.is_some());
        assert_eq!(start_time(me), process);
    }

    fn ns() -> u64 {
        pid_namespace(Path::new("/proc/self")).unwrap()
    }

    #[test]
    fn stale_tables_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let uid = std::fs::metadata(dir.path()).map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.uid()
        });
        let uid = uid.unwrap();
        let me = std::process::id();
        let name = |pid| file_name(pid, ns());
        std::fs::write(
            dir.path().join(name(me)),
            header(me, start_time(me).unwrap()),
        )
        .unwrap();
        std::fs::write(dir.path().join(name(me)).with_extension("x"), b"other").unwrap();
        // A pid reused by a process that started at another time, and a pid that is gone.
        std::fs::write(dir.path().join(name(1)), header(1, 12345)).unwrap();
        std::fs::write(dir.path().join(name(u32::MAX - 1)), header(u32::MAX - 1, 1)).unwrap();
        // Another namespace's table: its pid means another process; never judged here.
        let foreign = dir.path().join(file_name(1, ns() + 1));
        std::fs::write(&foreign, header(1, 12345)).unwrap();
        assert_eq!(remove_stale(&Dir::open(dir.path()).unwrap(), uid, ns()), 2);
        assert!(dir.path().join(name(me)).exists());
        assert!(!dir.path().join(name(1)).exists());
        assert!(foreign.exists());
    }

    /// The header this process's table starts with.
    fn own_header() -> [u8; HEADER_BYTES] {
        let pid = std::process::id();
        header(pid, start_time(pid).unwrap())
    }

    /// Where this process's table lies in `dir`.
    fn own_table(dir: &Path) -> std::path::PathBuf {
        dir.join(file_name(std::process::id(), ns()))
    }

    fn expect(tids: &[Tid]) -> Expect<'_> {
        let pid = std::process::id();
        Expect {
            pid,
            proc_pid: pid,
            namespace: ns(),
            owner: crate::sys::effective_uid(),
            tids,
        }
    }

    #[test]
    fn reads_a_table_and_refuses_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = own_table(dir.path());
        let mut bytes = own_header().to_vec();
        bytes.extend_from_slice(&encode(7, Role::Host, Placement::Inherited).to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&encode(9, Role::Worker, Placement::Worker).to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let table = read(&Dir::open(dir.path()).unwrap(), &expect(&[7, 9, 11])).unwrap();
        assert_eq!(table.len(), 2);
        assert_eq!(table[&9], (Role::Worker, Placement::Worker));
        assert_eq!(
            read(&Dir::open(dir.path()).unwrap(), &expect(&[9]))
                .unwrap()
                .len(),
            1
        );
        let mut stale = header(std::process::id(), 1).to_vec();
        stale.extend_from_slice(&bytes[HEADER_BYTES..]);
        std::fs::write(&path, &stale).unwrap();
        assert!(read(&Dir::open(dir.path()).unwrap(), &expect(&[7]))
            .unwrap_err()
            .contains("earlier process"));
    }

    /// A table of a million records (every other tid a worker, the rest hosts) asked for 20 000
    /// threads, half of them not in it (so every record is read): each thread found is found
    /// with its role, none other. The reading is linear in records plus threads (a set of the
    /// tids, not a search of them per record): benches/thread_table.rs times it.
    #[test]
    fn a_million_records_and_twenty_thousand_threads_are_matched_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let records = 1_000_000u32;
        let mut bytes = own_header().to_vec();
        bytes.reserve(records as usize * 8);
        for tid in 1..=records {
            let (role, placement) = if tid % 2 == 0 {
                (Role::Worker, Placement::Worker)
            } else {
                (Role::Host, Placement::Inherited)
            };
            bytes.extend_from_slice(&encode(tid as Tid, role, placement).to_le_bytes());
        }
        std::fs::write(own_table(dir.path()), &bytes).unwrap();
        // 10 000 tids in the table (spread over it, the last record included), 10 000 beyond it.
        let tids: Vec<Tid> = (1..=10_000u32)
            .map(|i| (i * 100) as Tid)
            .chain((1..=10_000u32).map(|i| (records + i) as Tid))
            .collect();
        let found = read(&Dir::open(dir.path()).unwrap(), &expect(&tids)).unwrap();
        assert_eq!(found.len(), 10_000);
        assert!(found
            .keys()
            .all(|tid| *tid as u32 <= records && tid % 100 == 0));
        assert_eq!(found[&(records as Tid)], (Role::Worker, Placement::Worker));
        assert_eq!(found[&100], (Role::Worker, Placement::Worker));
    }

    #[test]
    fn a_table_of_another_owner_is_not_believed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(own_table(dir.path()), own_header()).unwrap();
        let mut other = expect(&[7]);
        other.owner = other.owner.wrapping_add(1);
        assert!(read(&Dir::open(dir.path()).unwrap(), &other)
            .unwrap_err()
            .contains("not believed"));
    }

    /// The table's bytes as a mapping holds them: header words, records, notes words.
    fn file_bytes(header: &[AtomicU64], notes: &[AtomicU64]) -> Vec<u8> {
        let mut bytes: Vec<u8> = header
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        bytes.resize(NOTES_OFFSET, 0);
        bytes.extend(
            notes
                .iter()
                .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()),
        );
        bytes
    }

    fn words(bytes: &[u8]) -> Vec<AtomicU64> {
        bytes
            .chunks(8)
            .map(|c| AtomicU64::new(u64::from_le_bytes(c.try_into().unwrap())))
            .collect()
    }

    #[test]
    fn notes_round_trip_and_a_long_text_is_cut_at_a_whole_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = own_table(dir.path());
        let header = words(&own_header());
        let notes: Vec<AtomicU64> = (0..NOTES_BYTES / 8).map(|_| AtomicU64::new(0)).collect();
        std::fs::write(&path, file_bytes(&header, &notes)).unwrap();
        assert_eq!(
            read_notes(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            ""
        );
        write_notes(&header, &notes, "trtllm: engaged; tensorrt_llm 1.2\n");
        std::fs::write(&path, file_bytes(&header, &notes)).unwrap();
        assert_eq!(
            read_notes(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            "trtllm: engaged; tensorrt_llm 1.2\n"
        );
        let line = format!("{}\n", "x".repeat(1000));
        write_notes(&header, &notes, &line.repeat(9));
        std::fs::write(&path, file_bytes(&header, &notes)).unwrap();
        assert_eq!(
            read_notes(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            line.repeat(8)
        );
        // A writer caught in the middle (odd sequence number) is never believed.
        header[NOTES.sequence_word].fetch_add(1, Ordering::Relaxed);
        std::fs::write(&path, file_bytes(&header, &notes)).unwrap();
        assert!(read_notes(&Dir::open(dir.path()).unwrap(), &expect(&[]))
            .unwrap_err()
            .contains("kept changing"));
    }

    #[test]
    fn leases_round_trip_and_a_table_from_before_them_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = own_table(dir.path());
        let header = words(&own_header());
        let notes: Vec<AtomicU64> = (0..NOTES_BYTES / 8).map(|_| AtomicU64::new(0)).collect();
        let leases: Vec<AtomicU64> = (0..LEASES_BYTES / 8).map(|_| AtomicU64::new(0)).collect();
        let whole = |header: &[AtomicU64], leases: &[AtomicU64]| {
            let mut bytes = file_bytes(header, &notes);
            bytes.extend(
                leases
                    .iter()
                    .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()),
            );
            bytes
        };
        // A library from before the leases: zeros in the header's last words, no room after the
        // notes.
        std::fs::write(&path, file_bytes(&header, &notes)).unwrap();
        assert_eq!(
            read_leases(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            vec![]
        );
        let open = vec![
            LeaseLine {
                id: 1,
                gpu_index: Some(1),
                device: "0000:86:00.0".into(),
                slice: Some(CpuMask::parse_list("4-7,12-15").unwrap()),
            },
            LeaseLine {
                id: 2,
                gpu_index: None,
                device: "TLLM_AFFINITY_CPUS=0-3".into(),
                slice: None,
            },
        ];
        write_leases(&header, &leases, &open);
        write_notes(&header, &notes, "trtllm: engaged\n");
        std::fs::write(&path, whole(&header, &leases)).unwrap();
        assert_eq!(
            read_leases(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            open
        );
        // The notes keep their own words.
        assert_eq!(
            read_notes(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            "trtllm: engaged\n"
        );
        // The table only ever shows what is open now.
        write_leases(&header, &leases, &open[1..]);
        std::fs::write(&path, whole(&header, &leases)).unwrap();
        assert_eq!(
            read_leases(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            &open[1..]
        );
        // Lines that are not ours are not believed.
        write_text(&LEASES, &header, &leases, "garbage\n");
        std::fs::write(&path, whole(&header, &leases)).unwrap();
        assert!(read_leases(&Dir::open(dir.path()).unwrap(), &expect(&[]))
            .unwrap_err()
            .contains("not a lease"));
    }

    #[test]
    fn a_table_from_before_the_notes_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = own_header().to_vec();
        bytes[40..48].copy_from_slice(&100u64.to_le_bytes());
        std::fs::write(own_table(dir.path()), bytes).unwrap();
        assert_eq!(
            read_notes(&Dir::open(dir.path()).unwrap(), &expect(&[])).unwrap(),
            ""
        );
    }
}
