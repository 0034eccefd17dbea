//! Maps the live thread table (see [`crate::threadtable`]) that `tllm-affinity ps` reads.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use crate::threadtable::{self, CAPACITY, HEADER_BYTES};

/// Creates (or takes over, if this uid left it) the table file for this pid and maps its
/// records. `None` when the directory refuses, or something else holds the path (a symbolic
/// link, a FIFO, a directory, a hard link, another user's file): `ps` then shows masks without
/// roles.
pub fn map_table(fallback_dir: &Path) -> Option<(&'static [AtomicU64], PathBuf)> {
    let pid = std::process::id();
    let dir = threadtable::directory(fallback_dir);
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap_or(0);
    // SAFETY: geteuid has no preconditions.
    threadtable::remove_stale(&dir, unsafe { libc::geteuid() }, namespace);
    let path = dir.join(threadtable::file_name(pid, namespace));
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .mode(0o644)
        .open(&path)
        .ok()?;
    let meta = file.metadata().ok()?;
    // Only a regular file of ours with no other name: never truncate and map a file that a
    // hard link planted at the predictable path shares with something else.
    // SAFETY: geteuid has no preconditions.
    if !meta.is_file() || meta.nlink() != 1 || meta.uid() != unsafe { libc::geteuid() } {
        return None;
    }
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
        .ok()?;
    let bytes = HEADER_BYTES + CAPACITY * 8;
    file.set_len(0).ok()?;
    file.set_len(bytes as u64).ok()?;
    let start = threadtable::start_time(pid).unwrap_or(0);
    file.write_all(&threadtable::header(pid, start)).ok()?;
    // SAFETY: a fresh shared mapping of `bytes` bytes of a file that is `bytes` long; the kernel
    // picks the address. The mapping is never unmapped in this process (the registry holds it
    // for the process's life; the fork child maps its own and leaks the parent's view).
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the records start HEADER_BYTES (a multiple of 8) into a page-aligned mapping of
    // HEADER_BYTES + CAPACITY * 8 bytes that lives for the rest of the process; AtomicU64 has
    // the size and alignment of u64, and every access to the records goes through atomics.
    let records = unsafe {
        std::slice::from_raw_parts(
            (base as *const u8).add(HEADER_BYTES) as *const AtomicU64,
            CAPACITY,
        )
    };
    Some((records, path))
}
