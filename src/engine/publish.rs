//! Publishing: the live thread table (see [`crate::table::threadtable`]) that `tllm-affinity ps` reads,
//! mapped when the process first starts to matter, its path, and what happens at exit (the
//! report `TLLM_AFFINITY_REPORT` asks for, the table's removal).

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::panic::catch_unwind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::state::{in_own_process, lock_registry, state, LOAD_FACTS, REGISTRY};
use super::{exec, report};

use crate::lock::EngineLock;
use crate::sys;
use crate::table::threadtable::{self, Mapped, FILE_BYTES};
use crate::table::untrusted::{self, Dir, OwnFile};
use crate::{log_debug, log_error, log_warn};

/// Creates the table file for this pid and maps it. The file is created exclusively
/// (`O_CREAT | O_EXCL | O_NOFOLLOW`): nothing planted at its name is ever opened, truncated or
/// written through. A name this uid left behind (an earlier process with this pid) is removed
/// and created afresh; a name someone else holds (a file, a link, a FIFO, squatted ahead of
/// this pid) makes the process publish under [`threadtable::alternative_name`], which nobody
/// could have planted. `None` when the directory refuses (full, read-only): `ps` then shows masks
/// without roles, and no half-made file is left. Only the header's page is written here; the
/// rest is allocated as it is first used ([`threadtable::Mapped`]).
pub fn map_table(fallback_dir: &Path) -> Option<(&'static Mapped, PathBuf)> {
    let pid = std::process::id();
    let dir_path = threadtable::directory(fallback_dir);
    let dir = Dir::open(&dir_path).ok()?;
    let uid = sys::effective_uid();
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap_or(0);
    threadtable::remove_stale(&dir, uid, namespace);
    let usual = threadtable::file_name(pid, namespace);
    let created = dir.create_new(&usual, 0o644).map(|f| (f, usual.clone()));
    let created = match created {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            // A table of ours (a regular file of this uid with one name, left by an earlier
            // process with this pid, which remove_stale keeps while it is too fresh to judge):
            // taken back. Anything else, anyone else's: left as it is, and an alternative name.
            let ours = untrusted::Rules {
                owner: uid,
                max_bytes: FILE_BYTES as u64,
            };
            let again = (dir.open_file(&usual, &ours).is_ok() && dir.remove(&usual).is_ok())
                .then(|| dir.create_new(&usual, 0o644))
                .map(|created| created.map(|f| (f, usual.clone())));
            match again {
                Some(again) => again,
                None => {
                    let name =
                        threadtable::alternative_name(pid, namespace, untrusted::unpredictable()?);
                    log_debug!(
                        "{}: taken by someone else; the thread table is published as {name}",
                        dir_path.join(&usual).display()
                    );
                    dir.create_new(&name, 0o644).map(|f| (f, name))
                }
            }
        }
        other => other,
    };
    let (file, name) = match created {
        Ok(created) => created,
        Err(e) => {
            say_no_table(&dir_path, &e);
            return None;
        }
    };
    let path = dir_path.join(&name);
    match map_created(file, &path, pid, uid) {
        Ok(mapped) => Some((mapped, path)),
        Err(e) => {
            // Half-made (the header's page refused, say): no table is better than a stale one.
            let _ = dir.remove(&name);
            say_no_table(&dir_path, &e);
            None
        }
    }
}

/// The table file just created, sized, its header written and mapped.
fn map_created(
    mut file: std::fs::File,
    path: &Path,
    pid: u32,
    uid: u32,
) -> std::io::Result<&'static Mapped> {
    let meta = file.metadata()?;
    // Only a regular file of ours with no other name (created just now, so it is).
    if !meta.is_file() || meta.nlink() != 1 || meta.uid() != uid {
        return Err(std::io::Error::from_raw_os_error(libc::EPERM));
    }
    file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    let bytes = FILE_BYTES;
    file.set_len(0)?;
    file.set_len(bytes as u64)?;
    let start = threadtable::start_time(pid).unwrap_or(0);
    // Written, not stored: a full filesystem answers ENOSPC here, and the header's page exists
    // from now on (the later pages are allocated before their first store).
    file.write_all(&threadtable::header(pid, start))?;
    let remembered = OwnFile::remember(path, &file)?;
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
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the page-aligned mapping of FILE_BYTES bytes (a multiple of 8) lives for the rest
    // of the process; AtomicU64 has the size and alignment of u64, and every access to the file
    // goes through atomics.
    let words = unsafe { std::slice::from_raw_parts(base as *const AtomicU64, bytes / 8) };
    let page = sys::page_size();
    Ok(Box::leak(Box::new(Mapped::in_file(
        words,
        remembered,
        path.to_path_buf(),
        page,
    ))))
}

/// One line when the directory refuses the table for want of room or of write access (the
/// process carries on without one); other refusals are the directory's owner's business.
fn say_no_table(dir: &Path, why: &std::io::Error) {
    let room = [libc::ENOSPC, libc::EDQUOT, libc::EROFS, libc::EFBIG];
    if why.raw_os_error().is_some_and(|e| room.contains(&e)) {
        log_warn!(
            "the thread table in {}: {why}; tllm-affinity ps shows this process without roles, \
             and placement goes on",
            dir.display()
        );
    } else {
        log_debug!("the thread table in {}: {why}", dir.display());
    }
}

/// The process's own table: its path, removed at exit; and every table mapped in this address
/// space, a fork's parent's included (the child keeps its parent's view mapped for good, never
/// writing it), kept reachable as what they are, mappings for the process's life — a leak
/// checker would count a fork child's copy lost otherwise.
pub(super) struct Tables {
    pub path: Option<PathBuf>,
    mapped: Vec<&'static Mapped>,
}

pub(super) static TABLE_PATH: EngineLock<Tables> = EngineLock::new(Tables {
    path: None,
    mapped: Vec::new(),
});
/// The table is mapped only when the process first creates a thread, configures, opens a worker
/// scope or pins: most preloaded processes are short single-threaded tools (every shell of a
/// launch script) that would pay an 8 MiB file and a scan of `/dev/shm` for a table nobody
/// reads. A fork child starts pending again: most children exec at once, and exec would strand
/// the file.
pub(super) static TABLE_PENDING: AtomicBool = AtomicBool::new(true);

/// Maps the thread table `tllm-affinity ps` reads; without it `ps` still shows masks.
fn publish_thread_table(dir: &std::path::Path) {
    let mapped = map_table(dir);
    let table = mapped.as_ref().map(|(table, _)| *table);
    {
        let mut tables = TABLE_PATH.lock();
        tables.path = mapped.map(|(_, path)| path);
        tables.mapped.extend(table);
    }
    super::report::notes_go_to(table);
    lock_registry().publish_into(table);
}

/// Called on the paths where a process starts to matter (thread creation, configure, worker
/// scope, pin). The registry publishes every slot it holds when the table arrives, so threads
/// registered before it (the main thread) are shown too.
#[inline]
pub fn publish_table_if_pending() {
    if TABLE_PENDING.load(Ordering::Relaxed) {
        publish_pending();
    }
}

#[cold]
#[inline(never)]
fn publish_pending() {
    let Some(p) = LOAD_FACTS.get() else {
        return;
    };
    if TABLE_PENDING.swap(false, Ordering::AcqRel) {
        publish_thread_table(&p.settings.lock_dir);
    }
}

pub(super) extern "C" fn at_exit() {
    // A child of `_Fork` or a raw `clone` that skipped our fork handlers holds its parent's
    // registry and table path: neither is its to write or remove (SPEC §12).
    if !in_own_process() {
        return;
    }
    report::say_if_python_hook_missing(true);
    write_report_at_exit();
    if let Some(path) = TABLE_PATH.lock().path.take() {
        let _ = std::fs::remove_file(path);
    }
}

fn write_report_at_exit() {
    let _ = catch_unwind(|| {
        let Some(path) = LOAD_FACTS
            .get()
            .and_then(|p| p.settings.report_path.clone())
        else {
            return;
        };
        let used = crate::registry::report::used_the_library(&REGISTRY.lock().history());
        let launch = exec::LAUNCH.get().map(|f| f.id.to_string());
        if !used && crate::registry::report::a_user_of_the_launch_wrote(&path, launch.as_deref()) {
            log_debug!(
                "TLLM_AFFINITY_REPORT='{}': kept the report of the program of this launch that used the library",
                path.display()
            );
            return;
        }
        if let Err(e) = crate::registry::report::write_file(&path, &report::json(state(), true)) {
            log_error!("TLLM_AFFINITY_REPORT='{}': {e}", path.display());
        }
    });
}
