//! The exec family, interposed to hand a launch's state to the programs it starts (SPEC §2,
//! §12; the variable is described in [`crate::handoff::launch`]).
//!
//! The state that never changes (the launch's id, the settings already reported) is put in the
//! environment once, at load, while the process has a single thread; every way of starting a
//! program (`system`, `popen`, `execl`, glibc-internal paths the shims never see) passes it on.
//! What depends on the thread that starts the program — whether it is on the library's worker
//! mask — is added here, to the environment handed to the new program, never with `setenv`: the
//! caller may be one thread of many, or a `vfork` child running on its parent's memory. So these
//! shims allocate nothing and take no lock: the worker mask in force is published lock-free
//! ([`publish_target`]), the new environment is built on the stack, and when anything does not
//! fit the real function runs with the caller's environment unchanged.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::memory_preference;
use super::real::{self, Argv};
use crate::handoff::launch::{self, LaunchId, StackText};
use crate::mask::CpuMask;

/// What the process knows of its launch, from load on.
#[derive(Debug)]
pub struct LaunchFacts {
    pub id: LaunchId,
    /// The settings' fingerprint: what this process reported, or found reported.
    pub fingerprint: u64,
    /// The mask the launch's first process was given.
    pub launch: CpuMask,
}

pub(super) static LAUNCH: OnceLock<LaunchFacts> = OnceLock::new();

/// Words of the largest mask published for the shims: 1024 CPUs. A bigger worker mask is not
/// handed over (the new program then judges on its own mask, as without the hand-over).
const WORDS: usize = 16;
/// Even while stable, odd while [`publish_target`] writes.
static TARGET_SEQ: AtomicU32 = AtomicU32::new(0);
static TARGET_LEN: AtomicUsize = AtomicUsize::new(0);
static TARGET_WORDS: [AtomicU64; WORDS] = [const { AtomicU64::new(0) }; WORDS];

/// Publishes the worker mask in force (`None` after the last release). Called with the
/// registry lock held, so writers never overlap.
pub(super) fn publish_target(mask: Option<&CpuMask>) {
    let words = mask.map(CpuMask::words).filter(|w| w.len() <= WORDS);
    TARGET_SEQ.fetch_add(1, Ordering::AcqRel);
    TARGET_LEN.store(words.map_or(0, <[u64]>::len), Ordering::Release);
    for (i, cell) in TARGET_WORDS.iter().enumerate() {
        let word = words.and_then(|w| w.get(i)).copied().unwrap_or(0);
        cell.store(word, Ordering::Release);
    }
    TARGET_SEQ.fetch_add(1, Ordering::AcqRel);
}

/// The published worker mask, or `None` when there is none or it kept changing while read (a
/// signal handler may interrupt the writer on its own thread: never wait for it).
fn read_target(out: &mut [u64; WORDS]) -> Option<usize> {
    for _ in 0..64 {
        let before = TARGET_SEQ.load(Ordering::Acquire);
        if before % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let len = TARGET_LEN.load(Ordering::Acquire);
        for (slot, cell) in out.iter_mut().zip(&TARGET_WORDS) {
            *slot = cell.load(Ordering::Acquire);
        }
        if TARGET_SEQ.load(Ordering::Acquire) == before {
            return (len > 0).then_some(len);
        }
    }
    None
}

/// Trailing zero words do not make masks differ.
fn same_words(a: &[u64], b: &[u64]) -> bool {
    let n = a.len().max(b.len());
    (0..n).all(|i| a.get(i).copied().unwrap_or(0) == b.get(i).copied().unwrap_or(0))
}

/// The worker mask in force, when the calling thread is on it and it is not the launch mask
/// itself: a program this thread starts now is handed the launch mask.
fn worker_mask_of_caller(facts: &LaunchFacts) -> Option<([u64; WORDS], usize)> {
    let (mut target, mut mine) = ([0u64; WORDS], [0u64; WORDS]);
    let target_len = read_target(&mut target)?;
    let mine_len = crate::sys::own_mask_words(&mut mine)?;
    let (placed, own) = (&target[..target_len], &mine[..mine_len]);
    (same_words(placed, own) && !same_words(placed, facts.launch.words()))
        .then_some((target, target_len))
}

/// Most environment entries a new environment built here holds, and the longest entry of ours;
/// past either, the caller's own environment is used unchanged. Both live on the stack of the
/// thread that execs, only when there is something to hand over.
const MOST_ENTRIES: usize = 512;
const LONGEST_ENTRY: usize = 768;

/// Runs `exec` (an exec function or `posix_spawn`) with `envp` plus the hand-over, when there is
/// one to add; otherwise with `envp` itself. An entry of ours already in `envp` is replaced. The
/// process it starts never inherits a memory policy the library gave the calling thread: it is
/// dropped for the call and given back if the call returns (a `posix_spawn`'s child runs on
/// with the default; an exec that returned failed).
///
/// # Safety
/// `envp` is null or a null-terminated array of NUL-terminated strings.
unsafe fn with_handover<R>(
    envp: *const *const c_char,
    exec: impl FnOnce(*const *const c_char) -> R,
) -> R {
    // SAFETY: the caller's contract on `envp`, passed on.
    memory_preference::while_starting_a_child(|| unsafe { with_handover_env(envp, exec) })
}

/// [`with_handover`]'s environment.
///
/// # Safety
/// As for [`with_handover`].
unsafe fn with_handover_env<R>(
    envp: *const *const c_char,
    exec: impl FnOnce(*const *const c_char) -> R,
) -> R {
    let Some(facts) = LAUNCH.get().filter(|_| !envp.is_null()) else {
        return exec(envp);
    };
    let Some((target, len)) = worker_mask_of_caller(facts) else {
        return exec(envp);
    };
    // SAFETY: the caller's contract on `envp`, passed on.
    unsafe { exec_handing_over(envp, facts, &target[..len], exec) }
}

/// [`with_handover`] once there is something to hand over: the new environment is built here,
/// out of line, so that a thread with a small stack that execs without one never reserves it.
///
/// # Safety
/// As for [`with_handover`]; `envp` is not null.
#[inline(never)]
unsafe fn exec_handing_over<R>(
    envp: *const *const c_char,
    facts: &LaunchFacts,
    worker_mask: &[u64],
    exec: impl FnOnce(*const *const c_char) -> R,
) -> R {
    let mut text = StackText::<LONGEST_ENTRY>::new();
    let written = launch::write_value(
        &mut text,
        facts.id,
        facts.fingerprint,
        Some((facts.launch.words(), worker_mask)),
    );
    let Some(ours) = text.as_c_bytes().filter(|_| written.is_ok()) else {
        return exec(envp);
    };
    let prefix = b"TLLM_AFFINITY_LAUNCH=";
    let mut entries = [std::ptr::null::<c_char>(); MOST_ENTRIES];
    let mut n = 0;
    let mut i = 0;
    loop {
        // SAFETY: `envp` is a null-terminated array (the caller's contract); `i` stops at its
        // terminator.
        let entry = unsafe { *envp.add(i) };
        if entry.is_null() {
            break;
        }
        i += 1;
        // SAFETY: each entry is a NUL-terminated string; the comparison stops at its NUL.
        if unsafe { starts_with(entry, prefix) } {
            continue;
        }
        if n + 2 > MOST_ENTRIES {
            return exec(envp);
        }
        entries[n] = entry;
        n += 1;
    }
    entries[n] = ours.as_ptr().cast();
    exec(entries.as_ptr())
}

/// # Safety
/// `s` points to a NUL-terminated string.
unsafe fn starts_with(s: *const c_char, prefix: &[u8]) -> bool {
    prefix.iter().enumerate().all(|(i, &b)| {
        // SAFETY: every byte before the first mismatch (the NUL mismatches) is inside `s`.
        unsafe { *s.add(i) as u8 == b }
    })
}

extern "C" {
    static environ: *const *const c_char;
}

fn current_environ() -> *const *const c_char {
    // SAFETY: reading the pointer; glibc keeps it valid between environment changes.
    unsafe { environ }
}

/// # Safety
/// The arguments are those of `execve(2)`.
pub unsafe fn execve(path: *const c_char, argv: Argv, envp: Argv) -> c_int {
    // SAFETY: the caller's arguments, those of the real `execve`.
    unsafe { with_envp(path, argv, envp, real::execve()) }
}

/// # Safety
/// The arguments are those of `execvpe(3)`.
pub unsafe fn execvpe(file: *const c_char, argv: Argv, envp: Argv) -> c_int {
    // SAFETY: the caller's arguments, those of the real `execvpe`.
    unsafe { with_envp(file, argv, envp, real::execvpe()) }
}

/// The body of the exec functions given an environment: `real` (the real `execve` or
/// `execvpe`) with `envp`, or with a copy of it plus the hand-over.
///
/// # Safety
/// `name`, `argv` and `envp` are the arguments of `real`.
unsafe fn with_envp(
    name: *const c_char,
    argv: Argv,
    envp: Argv,
    real: Option<real::Execve>,
) -> c_int {
    let Some(real) = real else {
        return real::not_found();
    };
    // SAFETY: the caller's arguments; the environment is theirs or a copy of it plus ours.
    unsafe { with_handover(envp, |e| real(name, argv, e)) }
}

/// # Safety
/// The arguments are those of `execv(3)`.
pub unsafe fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the caller's arguments; execv is execve with `environ`.
    unsafe { with_environ(path, argv, real::execv(), real::execve()) }
}

/// # Safety
/// The arguments are those of `execvp(3)`.
pub unsafe fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the caller's arguments; execvp is execvpe with `environ`.
    unsafe { with_environ(file, argv, real::execvp(), real::execvpe()) }
}

/// The body of the exec functions that take the environment from `environ`: `plain` (the real
/// `execv` or `execvp`) when there is nothing to hand over, else `twin` (its `execve` or
/// `execvpe`) with the new environment.
///
/// # Safety
/// `name` and `argv` are the arguments of `plain`, and `twin` is `plain` with an environment.
unsafe fn with_environ(
    name: *const c_char,
    argv: *const *const c_char,
    plain: Option<real::Execv>,
    twin: Option<real::Execve>,
) -> c_int {
    let (Some(plain), Some(twin)) = (plain, twin) else {
        return real::not_found();
    };
    let envp = current_environ();
    // SAFETY: as in `execve`; the caller's arguments with `environ` or a copy of it plus ours.
    unsafe {
        with_handover(envp, |e| {
            if e == envp {
                plain(name, argv)
            } else {
                twin(name, argv, e)
            }
        })
    }
}

/// # Safety
/// The arguments are those of `fexecve(3)`.
pub unsafe fn fexecve(fd: c_int, argv: Argv, envp: Argv) -> c_int {
    let Some(real) = real::fexecve() else {
        return real::not_found();
    };
    // SAFETY: as in `execve`.
    unsafe { with_handover(envp, |e| real(fd, argv, e)) }
}

/// # Safety
/// The arguments are those of `posix_spawn(3)` (`spawnp`: of `posix_spawnp(3)`).
pub unsafe fn posix_spawn(
    spawnp: bool,
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let real = if spawnp {
        real::posix_spawnp()
    } else {
        real::posix_spawn()
    };
    let Some(real) = real else {
        return libc::ENOSYS;
    };
    // SAFETY: as in `execve`; posix_spawn copies the environment before it returns.
    unsafe { with_handover(envp, |e| real(pid, path, actions, attr, argv, e)) }
}

/// `system(3)` and `popen(3)`: glibc starts their shell through its own internal `posix_spawn`,
/// which no shim sees, so the library's memory policy (if this thread holds one) is dropped
/// around the real call here. The launch variable needs nothing: it is in the environment
/// already.
///
/// # Safety
/// The argument is that of `system(3)`.
pub unsafe fn system(command: *const c_char) -> c_int {
    let Some(real) = real::system() else {
        return real::not_found();
    };
    // SAFETY: the caller's argument, that of the real `system`.
    memory_preference::while_starting_a_child(|| unsafe { real(command) })
}

/// # Safety
/// The arguments are those of `popen(3)` (see [`system`]).
pub unsafe fn popen(command: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    let Some(real) = real::popen() else {
        crate::sys::set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    // SAFETY: the caller's arguments, those of the real `popen`.
    memory_preference::while_starting_a_child(|| unsafe { real(command, mode) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_published_reads_back_and_clears() {
        let mask = CpuMask::parse_list("1,65").unwrap();
        publish_target(Some(&mask));
        let mut out = [0u64; WORDS];
        let len = read_target(&mut out).unwrap();
        assert!(same_words(&out[..len], mask.words()));
        publish_target(None);
        assert_eq!(read_target(&mut out), None);
    }

    #[test]
    fn trailing_zero_words_do_not_count() {
        assert!(same_words(&[3, 0, 0], &[3]));
        assert!(!same_words(&[3, 1], &[3]));
    }
}
