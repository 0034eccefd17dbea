//! Step and result threads (SPEC §6): `tllm_affinity_pin_step_thread` and
//! `tllm_affinity_pin_result_thread`, and the per-GPU lock that keeps two processes on one GPU
//! from pinning to the same CPUs under `auto`.
//!
//! Which CPUs is decided by [`crate::placement::plan`] (the same code `tllm-affinity plan` prints); this
//! module reads the inputs and takes the lock ([`choose`]). The engine pins the calling thread
//! through the registry (`engine::step_pin`), whose birth rule keeps the pinned thread's children
//! off its core.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::host::topology::{SysfsRoot, Topology};
use crate::identity::Placement;
use crate::lock::EngineLock;
use crate::mask::CpuMask;
use crate::placement::device::{resolve_device_on, DeviceEnv};
use crate::placement::load_facts::LoadFacts;
use crate::placement::plan::{self, StepPlacement};
use crate::placement::settings::{SliceMode, StepCore};
use crate::placement::slice;
use crate::sys;
use crate::{log_error, log_warn};

/// SPEC §6: `TLLM_AFFINITY_STEP_CORE=<cpu>` outside the process mask is a startup error; the
/// returned line names the CPU and the mask.
pub fn check_at_load(step_core: StepCore, mask_at_load: &CpuMask) -> Result<(), String> {
    match step_core {
        StepCore::Cpu(cpu) if !mask_at_load.contains(cpu) => Err(format!(
            "TLLM_AFFINITY_STEP_CORE={cpu}: CPU {cpu} is outside the process mask [{mask_at_load}]"
        )),
        _ => Ok(()),
    }
}

/// Where a step or result thread goes: one CPU set, and the words the pin's log line gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPin {
    pub mask: CpuMask,
    pub how: Placement,
    /// What the CPUs were chosen for: `GPU <address>` or `TLLM_AFFINITY_STEP_CORE=<cpu>`.
    pub target: String,
    /// Why these CPUs, from the plan.
    pub why: String,
}

/// `"step"` or `"result"`, as the log lines name the thread.
pub fn thread_word(result: bool) -> &'static str {
    if result {
        "result"
    } else {
        "step"
    }
}

/// Chooses the CPUs for the calling thread's pin for `device_id` (resolved like `configure`'s;
/// only `auto` looks at it, since `<cpu>` names the same CPUs for every device), taking the GPU's
/// lock under `auto`. `Err` carries the pin's return value: 0 when not pinned (with a warning
/// saying why), or `-errno`. The engine pins the thread under the registry lock.
pub fn choose(facts: &LoadFacts, device_id: i32, result: bool) -> Result<StepPin, i32> {
    let what = thread_word(result);
    if facts.step_core_invalid {
        log_warn!(
            "{what} thread for device {device_id} not pinned: TLLM_AFFINITY_STEP_CORE names a \
             CPU outside the process mask (see the error at load)"
        );
        return Err(-libc::EINVAL);
    }
    let setting = facts.settings.step_core;
    if setting == StepCore::Off {
        log_warn!(
            "TLLM_AFFINITY_STEP_CORE is off: {what} thread for device {device_id} not pinned"
        );
        return Err(0);
    }
    let root = SysfsRoot::new(facts.settings.sysfs_root.clone());
    let mut topology = match Topology::read(&root) {
        Ok(t) => t,
        Err(e) => {
            log_error!("{what} thread for device {device_id} not pinned: {e}");
            return Err(-libc::EIO);
        }
    };
    let allowed = facts.mask_at_load.intersection(&facts.cpuset);
    let (placement, target) = match setting {
        StepCore::Cpu(cpu) => match plan::explicit_placement(&topology, &allowed, cpu) {
            Ok(placement) => (placement, format!("TLLM_AFFINITY_STEP_CORE={cpu}")),
            Err(reason) => {
                log_warn!("{what} thread for device {device_id} not pinned: {reason}");
                return Err(-libc::EINVAL);
            }
        },
        _ => {
            // Under slicing (SPEC §18) the pinned threads come from the GPU's own slice.
            let sliced_over = (facts.settings.slice == SliceMode::Gpu
                && facts.settings.cpus_override.is_none())
            .then_some(&facts.cpuset);
            auto(
                &mut topology,
                &root,
                &allowed,
                sliced_over,
                &facts.settings.lock_dir,
                device_id,
                what,
            )?
        }
    };
    let mask = if result {
        match placement.result {
            Some(cpu) => CpuMask::from_cpus([cpu]),
            None => {
                log_warn!(
                    "result thread for {target} not pinned: the allowed CPUs [{allowed}] hold no \
                     core besides the step core [{}]",
                    placement.step
                );
                return Err(0);
            }
        }
    } else {
        placement.step.clone()
    };
    let how = if result {
        Placement::Result
    } else {
        Placement::Step
    };
    Ok(StepPin {
        mask,
        how,
        target,
        why: placement.why,
    })
}

/// `auto`: this GPU's placement from the host-wide plan, once this process holds the GPU's lock;
/// `sliced_over`: the cpuset, when slicing is on. `Err` carries the return value (0 after a
/// warning, or `-errno`).
fn auto(
    topology: &mut Topology,
    root: &SysfsRoot,
    allowed: &CpuMask,
    sliced_over: Option<&CpuMask>,
    lock_dir: &Path,
    device_id: i32,
    what: &str,
) -> Result<(StepPlacement, String), i32> {
    let view = crate::host::gpus::current_view(root, topology, true);
    let resolved =
        resolve_device_on(device_id, &DeviceEnv::from_env(), &view, root).map_err(|e| {
            log_error!("{what} thread for device {device_id} not pinned: {e}");
            -libc::ENODEV
        })?;
    let target = format!("GPU {}", resolved.address);
    // The plan places every GPU sysfs lists; one sysfs does not list has no placement.
    let Some(index) = topology
        .gpus
        .iter()
        .position(|g| g.address == resolved.address)
    else {
        log_warn!("{what} thread for {target} not pinned: sysfs does not list it");
        return Err(0);
    };
    let slices = sliced_over.map(|cpuset| {
        topology.read_llc_domains(root);
        slice::slices(topology, &plan::slice_allowed(topology, cpuset))
    });
    let all = plan::step_placements(topology, allowed, slices.as_deref());
    let placement = match &all[index].placement {
        Ok(placement) => placement.clone(),
        Err(reason) => {
            log_warn!("{what} thread for {target} not pinned: {reason}");
            return Err(0);
        }
    };
    if let Err(e) = claim_gpu(lock_dir, &resolved.address) {
        log_warn!("{what} thread for {target} not pinned: {e}");
        return Err(0);
    }
    Ok((placement, target))
}

/// `<lock dir>/tllm-affinity-gpu-<pci address>.lock`.
pub fn lock_path(dir: &Path, address: &str) -> PathBuf {
    dir.join(format!("tllm-affinity-gpu-{address}.lock"))
}

/// Why a GPU's lock could not be taken; the text names the lock file.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds it.
    Held(PathBuf),
    /// The path is a symbolic link, which is never followed.
    Symlink(PathBuf),
    /// The path exists but is not a regular file.
    NotRegular(PathBuf),
    Io(PathBuf, io::Error),
}

impl std::fmt::Display for LockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockError::Held(p) => write!(
                f,
                "another process holds the GPU's lock {} (TLLM_AFFINITY_STEP_CORE=auto gives one \
                 process per GPU the step and result CPUs)",
                p.display()
            ),
            LockError::Symlink(p) => write!(
                f,
                "the GPU's lock {} is a symbolic link, which is never followed; remove it",
                p.display()
            ),
            LockError::NotRegular(p) => write!(
                f,
                "the GPU's lock {} is not a regular file; remove it",
                p.display()
            ),
            LockError::Io(p, e) => write!(f, "cannot open the GPU's lock {}: {e}", p.display()),
        }
    }
}

/// Takes an exclusive, non-blocking `flock` on `path` and returns the open file that holds it.
///
/// The file is created `0644` whatever the umask (other users' servers must be able to open it to
/// find it taken), opened read-only when it exists (it may belong to another user; `flock` needs
/// no write access), never truncated, and never reached through a symbolic link. `O_NONBLOCK`
/// keeps a FIFO planted at the path from blocking the open.
pub fn try_lock(path: &Path) -> Result<File, LockError> {
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let io_err = |e: io::Error| match e.raw_os_error() {
        Some(libc::ELOOP) => LockError::Symlink(path.to_path_buf()),
        _ => LockError::Io(path.to_path_buf(), e),
    };
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(flags)
        .open(path)
    {
        Ok(file) => {
            // The umask narrowed the mode given to open; set it outright.
            file.set_permissions(std::fs::Permissions::from_mode(0o644))
                .map_err(io_err)?;
            file
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(path)
            .map_err(io_err)?,
        Err(e) => return Err(io_err(e)),
    };
    if !file.metadata().map_err(io_err)?.file_type().is_file() {
        return Err(LockError::NotRegular(path.to_path_buf()));
    }
    if let Err(e) = sys::try_flock_exclusive(&file) {
        return Err(match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => LockError::Held(path.to_path_buf()),
            _ => LockError::Io(path.to_path_buf(), e),
        });
    }
    Ok(file)
}

/// A GPU lock this process holds: its file stays open (and locked) for the process's life.
pub(crate) struct HeldLock {
    address: String,
    pid: i32,
    _file: File,
}

/// The GPU locks this process holds. An engine lock, held across a fork by the engine's fork
/// handlers like its own: a child must never inherit it held.
pub(crate) static HELD: EngineLock<Vec<HeldLock>> = EngineLock::new(Vec::new());

/// Takes the lock of the GPU at `address` unless this process already holds it. A refused claim
/// holds nothing, so a later pin call tries again (the holder may have exited by then).
fn claim_gpu(dir: &Path, address: &str) -> Result<(), LockError> {
    let mut held = HELD.lock();
    let pid = sys::getpid();
    // A forked child shares its parent's open file, and with it the lock: it is another process
    // on the GPU and must win the lock on its own.
    held.retain(|h| h.pid == pid);
    if held.iter().any(|h| h.address == address) {
        return Ok(());
    }
    let file = try_lock(&lock_path(dir, address))?;
    held.push(HeldLock {
        address: address.to_string(),
        pid,
        _file: file,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn a_cpu_outside_the_mask_is_a_startup_error_naming_both() {
        let mask = CpuMask::parse_list("0-1").unwrap();
        assert!(check_at_load(StepCore::Cpu(1), &mask).is_ok());
        assert!(check_at_load(StepCore::Auto, &mask).is_ok());
        let e = check_at_load(StepCore::Cpu(5), &mask).unwrap_err();
        assert_eq!(
            e,
            "TLLM_AFFINITY_STEP_CORE=5: CPU 5 is outside the process mask [0-1]"
        );
    }

    #[test]
    fn lock_path_names_the_gpu() {
        assert_eq!(
            lock_path(Path::new("/tmp"), "0000:3b:00.0"),
            PathBuf::from("/tmp/tllm-affinity-gpu-0000:3b:00.0.lock")
        );
    }

    #[test]
    fn one_holder_at_a_time_and_the_lock_goes_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_path(dir.path(), "0000:3b:00.0");
        let first = try_lock(&path).unwrap();
        // flock belongs to the open file: a second open, even in this process, is refused.
        let e = try_lock(&path).unwrap_err();
        assert!(matches!(e, LockError::Held(_)), "{e}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        drop(first);
        let again = try_lock(&path).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        drop(again);
    }

    #[test]
    fn an_existing_lock_file_is_reused_never_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_path(dir.path(), "0000:86:00.0");
        fs::write(&path, "keep me").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o444)).unwrap();
        let held = try_lock(&path).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "keep me");
        drop(held);
    }

    #[test]
    fn a_symlink_or_a_fifo_at_the_lock_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        fs::write(&target, "data").unwrap();
        let path = lock_path(dir.path(), "0000:18:00.0");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = try_lock(&path).unwrap_err();
        assert!(matches!(e, LockError::Symlink(_)), "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(fs::read_to_string(&target).unwrap(), "data");

        // A dangling link is not followed to create its target either.
        let dangling = lock_path(dir.path(), "0000:2a:00.0");
        std::os::unix::fs::symlink(dir.path().join("created-by-us"), &dangling).unwrap();
        assert!(matches!(try_lock(&dangling), Err(LockError::Symlink(_))));
        assert!(!dir.path().join("created-by-us").exists());

        let fifo = lock_path(dir.path(), "0000:3a:00.0");
        sys::make_fifo(&fifo).unwrap();
        assert!(matches!(try_lock(&fifo), Err(LockError::NotRegular(_))));
    }

    #[test]
    fn a_missing_lock_dir_is_an_io_error_naming_the_path() {
        let e = try_lock(Path::new("/nonexistent-dir/x.lock")).unwrap_err();
        assert!(matches!(e, LockError::Io(..)), "{e}");
        assert!(e.to_string().contains("/nonexistent-dir/x.lock"), "{e}");
    }
}
