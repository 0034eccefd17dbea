//! The live thread table: how a running process shows `tllm-affinity ps` the roles and
//! placements its library holds.
//!
//! At its first thread, configure, worker scope or pin (not at load: see
//! `engine::publish_table_if_pending`) the library maps a small shared file, `tllm-affinity.<pid>.threads`, in `/dev/shm`
//! (else in `TLLM_AFFINITY_LOCK_DIR`). The registry keeps one 8-byte record per slot in it:
//! a thread's birth costs one store, its exit another. The file is sparse, so untouched
//! records cost no memory. `ps` reads the file and joins it with `/proc/<pid>/task`, where the
//! kernel's masks are. The header carries the process start time, so a file left by a killed
//! process is never mistaken for a live one that reused its pid.
//!
//! Layout (little-endian): magic `TLLMAFT1`, pid (u32), 4 reserved bytes, start time in clock
//! ticks (u64, field 22 of `/proc/<pid>/stat`), capacity (u64), 32 reserved bytes; then
//! `capacity` records of `tid | role << 32 | placement << 40`, where 0 is an empty record.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::registry::{Placement, Role, Tid};

pub const MAGIC: &[u8; 8] = b"TLLMAFT1";
pub const HEADER_BYTES: usize = 64;
/// Records for this many slots; a process with more live threads publishes the first ones.
pub const CAPACITY: usize = 1 << 20;

pub fn file_name(pid: u32) -> String {
    format!("tllm-affinity.{pid}.threads")
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

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Removes the tables in `dir` that processes of this user left when they ended without running
/// their exit handlers (`_exit`, a signal): a table whose pid is gone, or now names a process
/// that started at another time. Run by each process as it maps its own, so they never pile up.
pub fn remove_stale(dir: &Path, uid: u32) -> usize {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("tllm-affinity."))
            .and_then(|n| n.strip_suffix(".threads"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_file() || meta.uid() != uid {
            continue;
        }
        let mut head = [0u8; 24];
        let readable = std::fs::File::open(&path)
            .and_then(|mut f| f.read_exact(&mut head))
            .is_ok();
        let stale = if readable && &head[..8] == MAGIC {
            let recorded = u64::from_le_bytes(head[16..24].try_into().unwrap_or([0; 8]));
            start_time(pid) != Some(recorded)
        } else {
            // No header yet may be a process writing its table right now: wait a minute.
            meta.modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .is_some_and(|age| age.as_secs() > 60)
        };
        if stale && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Roles and placements a live process published, by tid.
pub fn read(pid: u32, dir: &Path) -> Result<BTreeMap<Tid, (Role, Placement)>, String> {
    read_as(pid, pid, dir)
}

/// [`read`] for a process that is `pid` in its own PID namespace (a container's) and `proc_pid`
/// in ours: the file and its header carry `pid` and the tids of that namespace, while its start
/// time is read from `/proc/<proc_pid>` (clock ticks since boot, the same in every namespace).
pub fn read_as(
    pid: u32,
    proc_pid: u32,
    dir: &Path,
) -> Result<BTreeMap<Tid, (Role, Placement)>, String> {
    let path = dir.join(file_name(pid));
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() < HEADER_BYTES || &bytes[..8] != MAGIC {
        return Err(format!(
            "{}: not a tllm-affinity thread table",
            path.display()
        ));
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]));
    let file_pid = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or([0; 4]));
    if file_pid != pid || Some(word(16)) != start_time(proc_pid) {
        return Err(format!(
            "{}: left by an earlier process with pid {pid}",
            path.display()
        ));
    }
    Ok(bytes[HEADER_BYTES..]
        .chunks_exact(8)
        .filter_map(|c| decode(u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))))
        .map(|(tid, role, placement)| (tid, (role, placement)))
        .collect())
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
        assert!(start_time(std::process::id()).is_some());
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
        std::fs::write(
            dir.path().join(file_name(me)),
            header(me, start_time(me).unwrap()),
        )
        .unwrap();
        std::fs::write(dir.path().join(file_name(me)).with_extension("x"), b"other").unwrap();
        // A pid reused by a process that started at another time, and a pid that is gone.
        std::fs::write(dir.path().join(file_name(1)), header(1, 12345)).unwrap();
        std::fs::write(
            dir.path().join(file_name(u32::MAX - 1)),
            header(u32::MAX - 1, 1),
        )
        .unwrap();
        assert_eq!(remove_stale(dir.path(), uid), 2);
        assert!(dir.path().join(file_name(me)).exists());
        assert!(!dir.path().join(file_name(1)).exists());
    }

    #[test]
    fn reads_a_table_and_refuses_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let pid = std::process::id();
        let mut bytes = header(pid, start_time(pid).unwrap()).to_vec();
        bytes.extend_from_slice(&encode(7, Role::Host, Placement::Inherited).to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&encode(9, Role::Worker, Placement::Worker).to_le_bytes());
        std::fs::write(dir.path().join(file_name(pid)), &bytes).unwrap();
        let table = read(pid, dir.path()).unwrap();
        assert_eq!(table.len(), 2);
        assert_eq!(table[&9], (Role::Worker, Placement::Worker));
        let mut stale = header(pid, 1).to_vec();
        stale.extend_from_slice(&bytes[HEADER_BYTES..]);
        std::fs::write(dir.path().join(file_name(pid)), &stale).unwrap();
        assert!(read(pid, dir.path())
            .unwrap_err()
            .contains("earlier process"));
    }
}
