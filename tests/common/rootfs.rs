//! Debian root filesystems made with debootstrap (tests/process/wheel.rs, tests/process/containers.rs).

use super::*;

pub const ROOTFS_CACHE: &str = "/var/cache/tllm-affinity";
pub const MIRROR: &str = "http://deb.debian.org/debian";

/// Debian bullseye (glibc 2.31: the old-glibc checks of tests/process/wheel.rs and tests/process/containers.rs),
/// `debootstrap --variant=minbase`, made once and kept in
/// `/var/cache/tllm-affinity/bullseye-minbase` for every checkout. The error (for [`require!`])
/// says what is missing when it cannot be made: root, debootstrap, or the mirror.
pub fn bullseye_rootfs() -> Result<PathBuf, String> {
    minbase_rootfs("bullseye", &[], "usr/bin/true")
}

/// Debian trixie (glibc 2.41, Python 3.13 with venv: the new-glibc check of tests/process/wheel.rs),
/// made and kept as [`bullseye_rootfs`], in `/var/cache/tllm-affinity/trixie-minbase`.
pub fn trixie_rootfs() -> Result<PathBuf, String> {
    minbase_rootfs("trixie", &["python3", "python3-venv"], "usr/bin/python3")
}

/// Debian `release` for this machine, `debootstrap --variant=minbase` with `include`d packages,
/// in `ROOTFS_CACHE/<release>-minbase`; `ready` is a file it has once made.
fn minbase_rootfs(release: &str, include: &[&str], ready: &str) -> Result<PathBuf, String> {
    if !root() {
        return Err("root (chroot)".into());
    }
    let include = match include {
        [] => None,
        packages => Some(format!("--include={}", packages.join(","))),
    };
    debootstrapped(
        &format!("{release}-minbase"),
        ready,
        &format!(
            "a Debian {release} root filesystem: `debootstrap --variant=minbase {}{release} \
             {MIRROR}`",
            include
                .as_deref()
                .map(|i| format!("{i} "))
                .unwrap_or_default()
        ),
        |partial| {
            Command::new("debootstrap")
                .arg("--variant=minbase")
                .args(&include)
                .arg(release)
                .arg(partial)
                .arg(MIRROR)
                .output()
                .unwrap()
        },
    )
}

/// A root filesystem made once in `ROOTFS_CACHE/name` and kept for every checkout: `make`
/// (debootstrap's stages) builds it in a directory of its own, renamed into place when it
/// succeeded, under a lock so that test binaries running at once make it once; `ready` is a file
/// it has once made. The error (for [`require!`]) names what is missing: debootstrap, or `what`
/// with the last lines it printed.
pub fn debootstrapped(
    name: &str,
    ready: &str,
    what: &str,
    make: impl FnOnce(&Path) -> std::process::Output,
) -> Result<PathBuf, String> {
    use std::os::fd::AsRawFd;
    let cache = Path::new(ROOTFS_CACHE);
    let rootfs = cache.join(name);
    std::fs::create_dir_all(cache).unwrap();
    let lock = std::fs::File::create(cache.join(format!("{name}.lock"))).unwrap();
    // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if rootfs.join(ready).is_file() {
        return Ok(rootfs);
    }
    if !on_path("debootstrap") {
        return Err("`debootstrap` on PATH".into());
    }
    let partial = cache.join(format!("{name}.partial.{}", std::process::id()));
    let out = make(&partial);
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        return Err(format!(
            "{what} failed (is the mirror reachable?): {}",
            tail.join(" | ")
        ));
    }
    std::fs::rename(&partial, &rootfs).unwrap();
    Ok(rootfs)
}

/// A copy of `rootfs` made of hard links, in a directory under the cache that goes on drop, and
/// its root: instant, and the cache stays untouched (files are only added to or removed from
/// the copy, never written).
pub fn linked_copy(rootfs: &Path) -> (tempfile::TempDir, PathBuf) {
    let copy = tempfile::tempdir_in(ROOTFS_CACHE).unwrap();
    let root = copy.path().join("root");
    let status = Command::new("cp")
        .arg("-al")
        .arg(rootfs)
        .arg(&root)
        .status()
        .unwrap();
    assert!(status.success(), "cp -al {}", rootfs.display());
    (copy, root)
}

/// `tests/programs/old_glibc.c` linked against glibc 2.17 by zig (the wheel's toolchain), so that
/// it runs in the old root filesystem.
pub fn old_glibc_program() -> PathBuf {
    let python = python();
    Program::c("old_glibc")
        .compiler(&[
            python.to_str().unwrap(),
            "-m",
            "ziglang",
            "cc",
            "-target",
            "x86_64-linux-gnu.2.17",
        ])
        .build()
}
