//! What a hostile local user plants, and how a test watches it (tests/shared_host.rs,
//! tests/containers.rs): FIFOs, a device node, a forged table, inotify on their opens.
#![allow(dead_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tllm_affinity_core::identity::{Placement, Role};
use tllm_affinity_core::threadtable;

/// Removes what a test left in `/dev/shm` when it ends, passed or failed: a failure must not
/// leave another user's files in the way of later tests.
pub struct RemoveAtEnd(pub Vec<PathBuf>);

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
