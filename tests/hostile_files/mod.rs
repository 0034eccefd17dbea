//! What a hostile local user plants, and how a test watches it (tests/process/shared_host.rs,
//! tests/process/containers.rs): FIFOs, a device node, a forged table, inotify on their opens.
#![allow(dead_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use tllm_affinity_core::identity::{Placement, Role};
use tllm_affinity_core::table::threadtable;

/// Removes what a test left in `/dev/shm` when it ends, passed or failed: a failure must not
/// leave another user's files in the way of later tests.
pub struct RemoveAtEnd(pub Vec<PathBuf>);

impl RemoveAtEnd {
    /// A table's name and every name a swap of it leaves next to it (`keep`, `fifo`, `sparse`,
    /// `.tmp`).
    pub fn swapped(table: &Path) -> RemoveAtEnd {
        let tmp = PathBuf::from(format!("{}.tmp", table.display()));
        let mut names = vec![table.to_path_buf()];
        names.extend(["keep", "fifo", "sparse"].map(|what| table.with_extension(what)));
        names.push(tmp);
        RemoveAtEnd(names)
    }
}

impl Drop for RemoveAtEnd {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Opens of a file, watched with inotify from now on (the watch follows the inode across
/// renames): `opened()` says whether anyone opened it (an `O_PATH` look is no open).
pub struct OpenWatch {
    fd: i32,
    pub what: Vec<PathBuf>,
}

impl OpenWatch {
    pub fn new(paths: &[&Path]) -> OpenWatch {
        // SAFETY: no pointer arguments.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(fd >= 0, "inotify_init1");
        for path in paths {
            let c = CString::new(path.as_os_str().as_bytes()).unwrap();
            // SAFETY: a NUL-terminated path that outlives the call.
            let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), libc::IN_OPEN) };
            assert!(wd >= 0, "inotify_add_watch {}", path.display());
        }
        OpenWatch {
            fd,
            what: paths.iter().map(|p| p.to_path_buf()).collect(),
        }
    }

    /// How many opens were seen since the watch began.
    pub fn opens(&self) -> usize {
        let mut buf = [0u8; 4096];
        let mut events = 0;
        loop {
            // SAFETY: reads at most buf.len() bytes into buf.
            let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return events;
            }
            let size = std::mem::size_of::<libc::inotify_event>();
            let mut at = 0;
            while at + size <= n as usize {
                let len = u32::from_ne_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
                events += 1;
                at += size + len;
            }
        }
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        // SAFETY: closes the descriptor this watch owns.
        unsafe { libc::close(self.fd) };
    }
}

pub fn mkfifo(path: &Path, mode: u32) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), mode) }, 0, "mkfifo");
}

/// A character device node (`/dev/full`'s numbers) at `path`, 0666.
pub fn device_node(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 7)) };
    assert_eq!(rc, 0, "mknod {}", path.display());
}

pub fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

/// A root-owned table forged for process `pid` (its header, the start time right): every
/// thread listed as a result thread, which the process never had. Believed, it would show.
pub fn forge(path: &Path, pid: u32) {
    let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .map(|t| t.file_name().to_str().unwrap().parse().unwrap())
        .collect();
    forge_as(path, pid, pid, &tids);
}

/// [`forge`] for a process seen from its own PID namespace: the header carries `published_pid`
/// (its pid there) and the start time of `host_pid`; the records list `tids`.
pub fn forge_as(path: &Path, published_pid: u32, host_pid: u32, tids: &[i32]) {
    let start = threadtable::start_time(host_pid).unwrap();
    let mut bytes = threadtable::header(published_pid, start).to_vec();
    for &tid in tids {
        bytes.extend(threadtable::encode(tid, Role::Worker, Placement::Result).to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// What `tests/programs/table_swapper.c` swaps a table's name between: the names next to the
/// table (`keep`, a FIFO and a 1 TiB sparse file), and what root holds for the swapper to link
/// to (a device node and a FIFO, in a directory of root's that others may read).
pub struct SwapTargets {
    pub table: PathBuf,
    pub keep: PathBuf,
    pub fifo: PathBuf,
    pub sparse: PathBuf,
    pub held_dir: tempfile::TempDir,
    pub device: PathBuf,
    pub held: PathBuf,
}

impl SwapTargets {
    /// Plants the FIFO and the sparse file next to `table` (owned by `owner` when given: the
    /// swapping user's) and root's device node and FIFO.
    pub fn plant(table: &Path, owner: Option<(u32, u32)>) -> SwapTargets {
        let theirs = |what: &str| table.with_extension(what);
        let (keep, fifo, sparse) = (theirs("keep"), theirs("fifo"), theirs("sparse"));
        mkfifo(&fifo, 0o644);
        std::fs::File::create(&sparse)
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        if let Some((uid, gid)) = owner {
            chown(&fifo, uid, gid);
            chown(&sparse, uid, gid);
        }
        let held_dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(held_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let device = held_dir.path().join("device");
        device_node(&device);
        let held = held_dir.path().join("held-fifo");
        mkfifo(&held, 0o666);
        SwapTargets {
            table: table.to_path_buf(),
            keep,
            fifo,
            sparse,
            held_dir,
            device,
            held,
        }
    }

    /// The FIFOs, the device and the sparse file: none may ever be opened.
    pub fn never_opened(&self) -> [&Path; 4] {
        [&self.fifo, &self.sparse, &self.device, &self.held]
    }

    /// `swapper` given its arguments: the table's name, the names it swaps in, `link` (the
    /// file the last link names) and how many seconds to go on.
    pub fn swapper(&self, mut swapper: Command, link: &Path, seconds: &str) -> Command {
        swapper
            .arg(&self.table)
            .arg(&self.keep)
            .arg(&self.fifo)
            .arg(&self.sparse)
            .arg(&self.device)
            .arg(&self.held)
            .arg(link)
            .arg(seconds);
        swapper
    }
}

/// Runs `ps PID --json` and the host view (through `ps`, given `ps`'s arguments) over and over
/// until `swapping` ends: the forged table's result threads never show for `pid`. How many
/// times both ran.
pub fn ps_while_swapping(
    swapping: &mut crate::common::Driver,
    pid: u32,
    ps: impl Fn(&[&str]) -> serde_json::Value,
) -> usize {
    let pid_arg = pid.to_string();
    let mut runs = 0;
    while !swapping.exited_within(std::time::Duration::ZERO) {
        let one = ps(&[&pid_arg]);
        assert!(
            !crate::common::ps_column(&one, "placement").contains(&"result".to_string()),
            "the forged table was believed: {one}"
        );
        let host = ps(&[]);
        let victim_row = host["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid);
        if let Some(row) = victim_row {
            assert!(row["threads"].get("result").is_none(), "{row}");
        }
        runs += 1;
    }
    runs
}
