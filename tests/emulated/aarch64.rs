//! The aarch64 tier: the aarch64 build of the library, the command and the wheel (`scripts/wheel
//! aarch64`, exactly what ships) run under qemu-user in an arm64 Debian root filesystem, on this
//! machine's real kernel. qemu-user runs each emulated thread as a host thread, so every mask
//! read from `/proc/<pid>/task/<tid>` is a real kernel mask and every `sched_setaffinity` a real
//! system call. The C programs are the x86_64 tier's own (tests/programs), cross-compiled by zig
//! against glibc 2.17; Python is the root filesystem's.
//!
//! Each program runs chrooted into the root filesystem, in a mount namespace of its own where
//! `/proc`, `/sys`, `/dev`, `/tmp`, this checkout and cargo's target directory are bound at their
//! own paths, so the paths the common helpers make (the simulated sysfs trees, the programs, the
//! library) hold there too.
//!
//! qemu-user starts one thread of its own before the program's first instruction (its RCU
//! thread, with the program's name): it is in `/proc/<pid>/task` but was never created by the
//! program, so the library, which learns of threads as they are born, does not list it. The
//! tier names it ([`QemuThread`]) and takes it out of the live threads it compares with the
//! library's table, and nothing else.
//!
//! The OpenMP objects are built by the root filesystem's own gcc (zig links no libgomp),
//! installed there by apt under qemu-user the first time a test needs it and kept.
//!
//! The root filesystem is made once with debootstrap (about 5 minutes on an idle machine, 0.3 GB)
//! and kept in `/var/cache/tllm-affinity/bookworm-arm64` for every checkout.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::tier::Tier;
use common::*;
use serde_json::Value;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const LIMIT: Duration = Duration::from_secs(120);
const ROOTFS: &str = "bookworm-arm64";
/// The directories the system's own tools are in.
const SYSTEM_DIRS: [&str; 4] = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"];

/// What every check needs: the arm64 root filesystem, the aarch64 wheel and the native files it
/// was assembled from (the library, and the command beside it).
struct Arm64 {
    root: PathBuf,
    wheel: PathBuf,
    library: PathBuf,
    cli: PathBuf,
}

/// [`Arm64`], made once per test binary; the error (for `require!`) names what is missing.
fn arm64() -> Result<&'static Arm64, String> {
    static ARM64: OnceLock<Result<Arm64, String>> = OnceLock::new();
    ARM64
        .get_or_init(|| {
            if !root() {
                return Err("root (chroot, mount namespaces)".into());
            }
            if !on_path("cargo-zigbuild") {
                return Err("`cargo-zigbuild` on PATH".into());
            }
            // Where the wrapper of [`Arm64::command`] looks for them.
            for tool in ["unshare", "chroot", "mount"] {
                if !SYSTEM_DIRS
                    .iter()
                    .any(|d| Path::new(d).join(tool).is_file())
                {
                    return Err(format!(
                        "`{tool}` in {SYSTEM_DIRS:?} (util-linux, coreutils)"
                    ));
                }
            }
            qemu_user()?;
            let root = arm64_rootfs()?;
            let wheel = aarch64_wheel();
            let native = aarch64_natives();
            Ok(Arm64 {
                root,
                wheel,
                library: native.join("libtllm_affinity.so"),
                cli: native.join("tllm-affinity"),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Cargo's target directory (the test programs, the venv), wherever CARGO_TARGET_DIR puts it.
fn target() -> PathBuf {
    target_dir().parent().unwrap().to_path_buf()
}

/// qemu-user registered with the kernel's binfmt_misc for aarch64 programs (scripts/setup).
fn qemu_user() -> Result<(), String> {
    let entry = Path::new("/proc/sys/fs/binfmt_misc/qemu-aarch64");
    match std::fs::read_to_string(entry) {
        Ok(text) if text.starts_with("enabled") => Ok(()),
        _ => Err(format!(
            "qemu-user for aarch64 in binfmt_misc ({}: apt-get install qemu-user-static \
             binfmt-support; update-binfmts --enable qemu-aarch64)",
            entry.display()
        )),
    }
}

/// Debian bookworm for arm64 (glibc 2.36, Python 3.11 with venv and pip's wheel; no compiler:
/// zig cross-compiles the programs), `debootstrap --foreign --variant=minbase`, its second stage
/// run under qemu-user, made once and kept in the cache.
fn arm64_rootfs() -> Result<PathBuf, String> {
    let rootfs = debootstrapped(
        ROOTFS,
        "usr/bin/python3",
        &format!("an arm64 Debian root filesystem: `debootstrap --arch=arm64 bookworm {MIRROR}`"),
        |partial| {
            let first = Command::new("debootstrap")
                .args(["--arch=arm64", "--foreign", "--variant=minbase"])
                .arg("--include=python3,python3-venv")
                .arg("bookworm")
                .arg(partial)
                .arg(MIRROR)
                .output()
                .unwrap();
            if !first.status.success() {
                return first;
            }
            Command::new("chroot")
                .arg(partial)
                .args(["/debootstrap/debootstrap", "--second-stage"])
                .output()
                .unwrap()
        },
    )?;
    // The mount points of this checkout and its target directory (empty directories; other
    // checkouts add their own).
    for dir in [repo(), &target()] {
        std::fs::create_dir_all(rootfs.join(dir.strip_prefix("/").unwrap())).unwrap();
    }
    Ok(rootfs)
}

/// The wrapper of [`Arm64::command`], run by `sh -c` in a mount namespace of its own: binds
/// `/proc`, `/sys`, `/dev`, `/tmp`, `$REPO` and `$TARGET` into the root filesystem `$1` at their
/// paths and execs `chroot` (found on `$2`) into it with the rest of the arguments.
const CHROOT_SCRIPT: &str = r#"set -e; root=$1; tools=$2; shift 2
    mount=$(PATH=$tools command -v mount)
    chroot=$(PATH=$tools command -v chroot)
    for dir in /proc /sys /dev /tmp "$REPO" "$TARGET"; do
        "$mount" --rbind "$dir" "$root$dir"
    done
    unset REPO TARGET
    exec "$chroot" "$root" "$@""#;

impl Arm64 {
    /// `program` (a path valid in the root filesystem) run chrooted there under qemu-user, in a
    /// mount namespace of its own with the host's `/proc`, `/sys`, `/dev`, `/tmp`, this checkout
    /// and the target directory bound at their paths. The environment is empty but for PATH,
    /// HOME and the Python package on PYTHONPATH; the process is the program's own (each step
    /// execs), so its pid is the program's.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let (unshare, words) = self.wrapper(program.as_ref().to_str().unwrap());
        let mut cmd = Command::new(unshare);
        cmd.args(words)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", "/root")
            .env("REPO", repo())
            .env("TARGET", target())
            .env("PYTHONPATH", repo().join("python"));
        cmd
    }

    /// `unshare` and its arguments for [`Arm64::command`] of `program`, which needs REPO and
    /// TARGET in the environment.
    fn wrapper(&self, program: &str) -> (PathBuf, Vec<String>) {
        let unshare = SYSTEM_DIRS
            .iter()
            .map(|d| Path::new(d).join("unshare"))
            .find(|p| p.is_file())
            .expect("unshare");
        let words = ["--mount", "--propagation", "private", "--", "sh", "-c"]
            .into_iter()
            .chain([CHROOT_SCRIPT, "sh", self.root.to_str().unwrap()])
            .chain([SYSTEM_DIRS.join(":").as_str(), program])
            .map(str::to_string)
            .collect();
        (unshare, words)
    }

    /// [`Arm64::command`] with the aarch64 library preloaded and the simulated host in place.
    fn preloaded(&self, program: &Path, sysfs: &Sysfs) -> Command {
        let mut cmd = self.command(program);
        cmd.env("LD_PRELOAD", &self.library)
            .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path())
            .env("TLLM_AFFINITY_LOG", "info");
        cmd
    }

    /// `tllm-affinity ps PID --json` by the aarch64 command.
    fn ps(&self, pid: u32) -> Value {
        let mut cmd = self.command(&self.cli);
        cmd.args(["ps", &pid.to_string(), "--json"]);
        let out = succeeded(&mut cmd);
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// The root filesystem's C compiler with OpenMP (gcc, libc6-dev, libgomp1: zig links no
/// libgomp), installed by apt under qemu-user the first time a test needs it and kept in the
/// cached root filesystem (a marker file says it is complete); the error (for `require!`) when
/// apt fails.
fn arm64_openmp_toolchain(a: &Arm64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let marker = a.root.join("var/lib/tllm-affinity/openmp-toolchain");
        let lock =
            std::fs::File::create(Path::new(ROOTFS_CACHE).join(format!("{ROOTFS}-gcc.lock")))
                .unwrap();
        // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        if marker.is_file() {
            return Ok(());
        }
        for step in [
            &["update", "-q"][..],
            &[
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                "gcc",
                "libc6-dev",
                "libgomp1",
            ],
        ] {
            let out = a
                .command("/usr/bin/apt-get")
                .args(step)
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .output()
                .unwrap();
            if !out.status.success() {
                let log = String::from_utf8_lossy(&out.stderr);
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                return Err(format!(
                    "gcc and libgomp in the arm64 root filesystem: `apt-get {}` failed (is the \
                     mirror reachable?): {}",
                    step.join(" "),
                    tail.join(" | ")
                ));
            }
        }
        std::fs::create_dir_all(marker.parent().unwrap()).unwrap();
        std::fs::write(&marker, "gcc libc6-dev libgomp1\n").unwrap();
        Ok(())
    })
    .clone()
}

impl Tier for Arm64 {
    fn program(&self, source: &str) -> PathBuf {
        arm64_program(source)
    }

    fn shared_object(&self, source: &str, name: &str) -> PathBuf {
        for_aarch64(Program::c(source).shared())
            .named(&format!("aarch64/{name}"))
            .build()
    }

    /// Built by the root filesystem's gcc, run chrooted there under qemu-user (every path of
    /// the build is bound at its own path).
    fn openmp_library(&self) -> PathBuf {
        arm64_openmp_toolchain(self).unwrap_or_else(|e| panic!("{e}"));
        let (unshare, words) = self.wrapper("/usr/bin/gcc");
        let mut compiler = vec![
            "/usr/bin/env".to_string(),
            "-i".to_string(),
            "PATH=/usr/bin:/bin".to_string(),
            format!("REPO={}", repo().display()),
            format!("TARGET={}", target().display()),
            unshare.display().to_string(),
        ];
        compiler.extend(words);
        let compiler: Vec<&str> = compiler.iter().map(String::as_str).collect();
        Program::c("openmp_region")
            .shared()
            .flags(&["-fopenmp"])
            .compiler(&compiler)
            .named("aarch64/libopenmp_region.so.2")
            .build()
    }

    fn preloaded(&self, program: &Path, sysfs: &Sysfs) -> Command {
        Arm64::preloaded(self, program, sysfs)
    }

    fn python(&self) -> PathBuf {
        PathBuf::from("/usr/bin/python3")
    }

    fn shell(&self) -> PathBuf {
        PathBuf::from("/bin/sh")
    }

    /// Every live thread but qemu's own ([`QemuThread::among`]).
    fn program_threads(
        &self,
        pid: u32,
        live: &BTreeSet<i32>,
        listed: &BTreeSet<i32>,
    ) -> BTreeSet<i32> {
        let qemu = QemuThread::among(pid, live, listed);
        live.iter().copied().filter(|&t| t != qemu.0).collect()
    }

    /// Emulation: each run starts qemu, and fork copies its translated code too.
    fn slowdown(&self) -> u32 {
        2
    }
}

/// qemu-user's own thread in an emulated process: the one thread of `/proc/<pid>/task` that
/// is neither the main thread nor any thread the library saw born. qemu starts it before the
/// program's first instruction, so it is born no later than any thread the program made.
struct QemuThread(i32);

impl QemuThread {
    /// Found among `live`, the threads of `/proc/<pid>/task` read while the program waited,
    /// given `listed`, every thread the program made (the library's table then, or the threads a
    /// phase names): exactly one live thread is not listed, and none of the listed threads but
    /// the main one was born before it.
    fn among(pid: u32, live: &BTreeSet<i32>, listed: &BTreeSet<i32>) -> QemuThread {
        let unlisted: Vec<i32> = live.difference(listed).copied().collect();
        assert_eq!(
            unlisted.len(),
            1,
            "one thread not the program's (qemu's own): live {live:?}, the library's {listed:?}"
        );
        let qemu = unlisted[0];
        // A program that goes on after printing its table may have ended some threads, or
        // exited: the order is checked for the threads still there.
        if let Some(qemu_born) = try_born(pid, qemu) {
            for &tid in listed.iter().filter(|&&t| t != pid as i32) {
                if let Some(tid_born) = try_born(pid, tid) {
                    assert!(
                        qemu_born <= tid_born,
                        "qemu's thread {qemu} is born before the program's {tid}"
                    );
                }
            }
        }
        QemuThread(qemu)
    }

    /// Found in `tllm-affinity ps --json` of a live process, which lists every thread of
    /// `/proc/<pid>/task`: the one row of role `unknown` (the library never saw it born), neither
    /// the main thread nor any of `program_threads`, born no later than they were.
    fn in_ps(pid: u32, ps: &Value, program_threads: &[i32]) -> QemuThread {
        let unknown: Vec<i32> = ps["threads"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["role"] == "unknown")
            .map(|t| t["tid"].as_i64().unwrap() as i32)
            .collect();
        assert_eq!(
            unknown.len(),
            1,
            "one thread of role unknown (qemu's): {ps}"
        );
        let qemu = unknown[0];
        assert!(
            qemu != pid as i32 && !program_threads.contains(&qemu),
            "{ps}"
        );
        for &tid in program_threads {
            assert!(born(pid, qemu) <= born(pid, tid), "{ps}");
        }
        QemuThread(qemu)
    }
}

/// When a thread of `pid` started, in clock ticks since boot (`/proc/<pid>/task/<tid>/stat`).
fn born(pid: u32, tid: i32) -> u64 {
    try_born(pid, tid).unwrap_or_else(|| panic!("/proc/{pid}/task/{tid} is gone"))
}

/// As [`born`], `None` when the thread has exited.
fn try_born(pid: u32, tid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    // After the command's closing parenthesis, the 20th field is starttime.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// The CPU lists of the simulated host, as the x86_64 tier's lifecycle tests name them.
fn cpus(sysfs: &Sysfs) -> Result<HostCpus, String> {
    sysfs.cpus("host and worker masks that differ")
}

// ---- The program's own affinity calls -----------------------------------------------------

/// The program's own `sched_setaffinity(0)`, `sched_setaffinity(tid)` and
/// `pthread_setaffinity_np` on worker threads during a lease succeed under the library and are
/// observed as the program's (placement `explicit`): a second configure and the release leave
/// them alone; `taskset -p` from outside is found at release (`external`). With the library
/// asking glibc for x86_64's symbol version, every one of these calls failed with ENOSYS.
#[test]
fn the_programs_own_setaffinity_calls_work_and_are_observed() {
    let a = require!(arm64());
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let cpu = sysfs.node0.first().unwrap().to_string();
    let mut cmd = a.preloaded(&arm64_program("lifecycle_scenarios"), &sysfs);
    cmd.args(["observe", &cpu]);
    let mut run = Driver::spawn(cmd, LIMIT);

    let pinned = run.phase();
    println!("{}", describe(&pinned));
    expect(&pinned, Named(&["S1", "S2", "S4"]), on(&c.other), "pinned");
    expect(&pinned, Named(&["W", "C", "S3"]), on(&c.local), "worker");
    run.proceed();
    let twice = run.phase();
    expect(
        &twice,
        Named(&["S1", "S2", "S4", "S1child"]),
        on(&c.other),
        "after the second configure",
    );
    expect(&twice, Named(&["W", "C", "S3"]), on(&c.local), "worker");
    let ext = twice.thread("S3").tid;
    let taskset = Command::new("taskset")
        .args(["-p", "-c", &cpu, &ext.to_string()])
        .output()
        .expect("taskset");
    assert!(taskset.status.success(), "{taskset:?}");
    run.proceed();
    let released = run.phase();
    println!("{}", describe(&released));
    expect(
        &released,
        Named(&["W", "C", "main"]),
        on(&c.all),
        "restored",
    );
    expect(
        &released,
        Named(&["S1", "S2", "S4", "S1child", "S3"]),
        on(&c.other),
        "left alone",
    );
    run.proceed();
    let report = run.report("released");
    assert_eq!(report_placement(&report, ext), "external", "{report}");
    for t in ["S1", "S2", "S4"] {
        assert_eq!(
            report_placement(&report, released.thread(t).tid),
            "explicit",
            "{t}"
        );
    }
    let again = run.phase();
    expect(&again, Named(&["W", "C"]), on(&c.local), "worker");
    let end = run.succeed();
    says(&end.stderr, &["preserved 1 externally changed"]);
    assert_eq!(end.stdout.matches("PINNED").count(), 3, "{}", end.stdout);
    assert!(
        !end.stdout.contains("-> -"),
        "a pin of the program's own failed: {}",
        end.stdout
    );
}

/// A pool thread pins itself with `pthread_setaffinity_np` to exactly the worker set: the
/// aarch64 `tllm-affinity ps` shows it `explicit` at once, and the release leaves it there.
#[test]
fn a_pin_equal_to_the_worker_mask_is_explicit_in_ps_and_survives_release() {
    let a = require!(arm64());
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let mut run = Driver::spawn(
        a.preloaded(&arm64_program("pin_to_worker_set"), &sysfs),
        LIMIT,
    );
    let tid: i32 = field(&run.line("PINNED"), "tid").parse().unwrap();
    assert_eq!(kernel_mask(run.pid(), tid).to_list(), c.local);
    let ps = a.ps(run.pid());
    let row = row(&ps, "threads", "tid", tid);
    assert_eq!(row["placement"], "explicit", "{ps}");
    // Every other row is the main thread (the worker) or qemu's own.
    let qemu = QemuThread::in_ps(run.pid(), &ps, &[tid]);
    let rows = ps["threads"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{ps}");
    for row in rows
        .iter()
        .filter(|t| t["tid"] != tid && t["tid"] != qemu.0)
    {
        assert_eq!(row["tid"], run.pid(), "{ps}");
        assert_eq!(row["role"], "worker", "{ps}");
    }
    let live = task_tids(run.pid());
    run.proceed();
    let report = run.report("released");
    assert_eq!(
        QemuThread::among(run.pid(), &live, &report_tids(&report)).0,
        qemu.0
    );
    assert_eq!(report_placement(&report, tid), "explicit");
    assert_eq!(kernel_mask(run.pid(), tid).to_list(), c.local);
    assert_eq!(kernel_mask(run.pid(), run.pid() as i32).to_list(), c.all);
    run.succeed();
}

// ---- Roles, placement, leases, restoration ------------------------------------------------

tier_tests! {
    arm64();
    /// A worker's threads during a lease are workers on the GPU-local set, the main thread a host
    /// on every CPU; a thread made with an attribute mask keeps it (`explicit`) through a second
    /// configure, the release and a configure after it; the release restores the rest. The
    /// library's table lists every live thread but qemu's own.
    roles_leases_and_restoration_as_on_x86_64: common::leases::check_explicit_masks_through_leases;
    /// The C population of the x86_64 tier (tests/programs/population.c, its worker-libs thread
    /// started in a stand-in libnccl): before configure nobody moved and the libnccl thread is
    /// already a worker; configure pins the worker, its descendants and the libnccl threads, the
    /// hosts keep every CPU; a second configure changes nothing and says nothing; the last release
    /// restores every mask; a worker born after it is born on the restored mask.
    the_c_population_as_on_x86_64: common::leases::check_c_population;
}

/// Real Python threads of the root filesystem's interpreter (tests/programs/host_and_worker.py):
/// the HTTP, request and loop threads hosts on every CPU, the worker and its pool and
/// grandchild workers on the GPU-local set until the release restores them; threads born after
/// it are on every CPU.
#[test]
fn python_host_and_worker_threads_as_on_x86_64() {
    let a = require!(arm64());
    let sysfs = Sysfs::two_nodes();
    check_host_and_worker(
        a.preloaded(Path::new("/usr/bin/python3"), &sysfs),
        &sysfs,
        LIMIT,
    );
}

// ---- fork and exec ------------------------------------------------------------------------
//
// qemu-user emulates fork by forking itself (vfork and posix_spawn's clone too: it drops
// CLONE_VM|CLONE_VFORK), and an exec of an aarch64 program goes through binfmt_misc again: the
// new image is a new qemu, with an RCU thread of its own, which the checks account for as
// before ([`QemuThread::among`]).

tier_tests! {
    arm64();
    /// Threads ending by return, `pthread_exit`, cancellation and detached, from a host and from a
    /// worker during a lease: the registry equals the live threads, as on x86_64, and the process
    /// ends well. The aarch64 library, as the wheel links it, once crashed the process at the first
    /// `pthread_exit` (its thread-start frame's personality routine, called by libgcc_s's forced
    /// unwind, ran LLVM's unwinder on libgcc_s's context).
    every_way_out_of_a_thread_leaves_the_registry_equal_to_the_live_threads:
        fork_exec::check_every_way_out;
    /// A fork from the host main thread and from a worker thread during a lease: each child's
    /// registry holds only the forking thread, with its role, as on x86_64 (tests/process/lifecycle.rs).
    a_fork_child_holds_only_the_forking_thread_with_its_role: fork_exec::check_fork_children;
    /// exec during a lease from the main thread and from a worker: the new image starts clean; its
    /// live threads are its main thread, the one it makes and the new qemu's own.
    exec_starts_the_new_image_clean: fork_exec::check_exec;
}

// ---- A fork from a signal handler inside the library (tests/common/never_hang.rs) ----------
//
// One thread, so no other emulated thread holds qemu's locks at the fork (see below).

tier_tests! {
    arm64();
    a_signal_handler_forking_inside_the_library_never_hangs:
        never_hang::check_a_handler_forking_inside_the_library_finishes;
}

// ---- Not in this tier: fork storms --------------------------------------------------------
//
// The fork storms of tests/process/never_hang.rs and tests/process/lifecycle.rs (`forkstorm`) fork while other
// threads load objects, create threads and configure. Under qemu-user 7.2 their fork children
// hang without the library too (qemu's own locks, held by another emulated thread at the fork,
// stay held in the child: `lifecycle_scenarios forkstorm 300` and `fork_storm repro 2`, not
// preloaded, leave children stuck after one or two forks), so they cannot tell a hang of the
// library's from qemu's here; they run on a real aarch64 host.

// ---- Bad input (tests/common/bad_input.rs) -----------------------------------------------

tier_tests! {
    arm64();
    malformed_load_time_variables_give_one_line_and_the_program_runs_on:
        bad_input::check_malformed_load_time_variables;
    malformed_configure_time_variables_give_one_line_and_an_errno:
        bad_input::check_malformed_configure_time_variables;
    a_malformed_gpu_is_refused_at_load_even_when_nothing_needs_it:
        bad_input::check_malformed_gpu_refused_at_load;
    every_valid_gpu_form_is_accepted_at_load_and_used_by_configure:
        bad_input::check_every_valid_gpu_form;
    a_repeated_empty_configure_warns_once: bad_input::check_repeated_empty_configure;
}

// ---- The four shared-process deployments (tests/common/deployments.rs) ---------------------

/// A deployment run by the root filesystem's Python, its OpenMP region built by the root
/// filesystem's gcc.
fn deployment(row: &deployments::Deployment) {
    let a = require!(arm64());
    require!(arm64_openmp_toolchain(a));
    deployments::check(a, row);
}

table_tests! {
    deployment;
    /// Deployment 1, single-process TP1 worker in the HTTP server's process (its OpenMP pool
    /// threads end by `pthread_exit` when the Python thread that owned the pool ends).
    tp1_worker_inside_the_http_server: deployments::TP1;
    /// Deployment 2, an externally supplied MpiCommSession, rank 0.
    mpi_comm_session_rank0_in_the_users_script: deployments::MPI_SESSION;
    /// Deployment 3, external-launch VisualGen rank 0 under an HTTP server.
    visualgen_rank0_coordinator_started_before_the_worker: deployments::VISUALGEN;
    /// Deployment 4, the leader of a multi-node launch.
    multi_node_leader_session_server_and_progress_threads: deployments::LEADER;
}

// ---- The wheel, pip-installed in the root filesystem --------------------------------------

/// A fresh venv of the root filesystem's Python with the aarch64 wheel pip-installed, no index:
/// `target/aarch64-venv` (bound into every run), made anew once per test binary; the venv's
/// bin/.
fn venv(a: &Arm64) -> PathBuf {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let venv = target().join("aarch64-venv");
        let _ = std::fs::remove_dir_all(&venv);
        succeeded(
            a.command("/usr/bin/python3")
                .args(["-m", "venv"])
                .arg(&venv),
        );
        let bin = venv.join("bin");
        succeeded(
            a.command(bin.join("pip"))
                .args(["install", "-q", "--no-index", "--disable-pip-version-check"])
                .arg(&a.wheel)
                .env_remove("PYTHONPATH"),
        );
        bin
    })
    .clone()
}

/// A user's shell in the root filesystem: the venv's bin/ first, nothing of the checkout's.
fn user(a: &Arm64, bin: &Path, program: &str) -> Command {
    let mut cmd = a.command(bin.join(program));
    cmd.env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env_remove("PYTHONPATH");
    cmd
}

/// The aarch64 wheel installs with pip in a fresh venv of the arm64 root filesystem; its
/// `tllm-affinity run` (no variable naming the library) places a mixed Python population as on
/// x86_64: main and host threads on every CPU, the worker and its children on device 0's local
/// CPUs; its `ps` reads the table the installed library published.
#[test]
fn the_aarch64_wheel_installs_in_a_venv_and_its_run_places_a_population() {
    let a = require!(arm64());
    let name = a.wheel.file_name().unwrap().to_str().unwrap();
    assert_eq!(
        name,
        format!(
            "tllm_affinity-{VERSION}-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.whl"
        )
    );
    let bin = venv(a);
    let version = succeeded(user(a, &bin, "tllm-affinity").arg("--version"));
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("tllm-affinity {VERSION}")
    );
    let seen = installed_population(|| user(a, &bin, "tllm-affinity"));
    let library = seen["library"].as_str().unwrap();
    assert!(
        library.starts_with(bin.parent().unwrap().to_str().unwrap())
            && library.ends_with("tllm_affinity/_lib/libtllm_affinity.so"),
        "{seen}"
    );
    assert_eq!(seen["preload"], library);
    assert_eq!(seen["version"], VERSION);
}

/// The start-up hook of the pip-installed package: the venv's `tllm-affinity run` makes an
/// unmodified program's `configure_cpu_affinity` (the upstream-shaped `tensorrt_llm` of
/// tests/programs/hook_cases) the library's: the calling thread on device 0's local CPUs, the
/// main thread untouched, upstream's own function never run.
#[test]
fn the_installed_start_up_hook_wraps_configure_in_an_unmodified_program() {
    let a = require!(arm64());
    let host = Sysfs::two_nodes();
    let bin = venv(a);
    let mut cmd = user(a, &bin, "tllm-affinity");
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(host.path())
        .args(["--", "python"])
        .arg(program("hook_probe.py"))
        .args(["probe", "0"])
        .env(
            "PYTHONPATH",
            programs_dir().join("hook_cases").join("upstream"),
        );
    let v = last_json_line(&succeeded(&mut cmd).stdout);
    println!("{v}");
    assert_eq!(v["wrapped"], true, "{v}");
    assert_eq!(v["calls"], serde_json::json!([]), "upstream ran: {v}");
    assert_eq!(v["thread"]["result"], "None", "{v}");
    assert_eq!(mask_of(&v["thread"]["mask"]), host.gpu0_local(), "{v}");
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{v}");
    assert_eq!(v["adapter"]["state"], "engaged", "{v}");
    // The hook chains to Debian's own sitecustomize, which then holds the name.
    let chained = v["sitecustomize"].as_str().unwrap_or_default();
    assert!(
        chained.starts_with("/usr/lib/python3") && chained.ends_with("/sitecustomize.py"),
        "{v}"
    );
}
