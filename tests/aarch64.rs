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
//! The root filesystem is made once with debootstrap (about 5 minutes on an idle machine, 0.3 GB)
//! and kept in `/var/cache/tllm-affinity/bookworm-arm64` for every checkout.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

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

impl Arm64 {
    /// `program` (a path valid in the root filesystem) run chrooted there under qemu-user, in a
    /// mount namespace of its own with the host's `/proc`, `/sys`, `/dev`, `/tmp`, this checkout
    /// and the target directory bound at their paths. The environment is empty but for PATH,
    /// HOME and the Python package on PYTHONPATH; the process is the program's own (each step
    /// execs), so its pid is the program's.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let path = SYSTEM_DIRS.join(":");
        let unshare = SYSTEM_DIRS
            .iter()
            .map(|d| Path::new(d).join("unshare"))
            .find(|p| p.is_file())
            .expect("unshare");
        let mut cmd = Command::new(unshare);
        cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(
                r#"set -e; root=$1; tools=$2; shift 2
                mount=$(PATH=$tools command -v mount)
                chroot=$(PATH=$tools command -v chroot)
                for dir in /proc /sys /dev /tmp "$REPO" "$TARGET"; do
                    "$mount" --rbind "$dir" "$root$dir"
                done
                unset REPO TARGET
                exec "$chroot" "$root" "$@""#,
            )
            .arg("sh")
            .arg(&self.root)
            .arg(path)
            .arg(program)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", "/root")
            .env("REPO", repo())
            .env("TARGET", target())
            .env("PYTHONPATH", repo().join("python"));
        cmd
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

/// qemu-user's own thread in an emulated process: the one thread of `/proc/<pid>/task` that
/// is neither the main thread nor any thread the library saw born. qemu starts it before the
/// program's first instruction, so it is born no later than any thread the program made.
struct QemuThread(i32);

impl QemuThread {
    /// Found in a live process whose table (`report`, the library's) lists every thread the
    /// program made: exactly one live thread is missing from it, and none of the listed threads
    /// was born before it.
    fn of(pid: u32, report: &Value) -> QemuThread {
        let live = task_tids(pid);
        let listed = report_tids(report);
        let unlisted: Vec<i32> = live.difference(&listed).copied().collect();
        assert_eq!(
            unlisted.len(),
            1,
            "one thread not the program's (qemu's own): live {live:?}, the library's {listed:?}"
        );
        let qemu = unlisted[0];
        for &tid in listed.iter().filter(|&&t| t != pid as i32) {
            assert!(
                born(pid, qemu) <= born(pid, tid),
                "qemu's thread {qemu} is born before the program's {tid}"
            );
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
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap();
    // After the command's closing parenthesis, the 20th field is starttime.
    let after = &stat[stat.rfind(')').unwrap() + 1..];
    after.split_whitespace().nth(19).unwrap().parse().unwrap()
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
    let row = ps["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tid"] == tid)
        .unwrap_or_else(|| panic!("{tid} not in {ps}"));
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
    run.proceed();
    let report = run.report("released");
    assert_eq!(QemuThread::of(run.pid(), &report).0, qemu.0);
    assert_eq!(report_placement(&report, tid), "explicit");
    assert_eq!(kernel_mask(run.pid(), tid).to_list(), c.local);
    assert_eq!(kernel_mask(run.pid(), run.pid() as i32).to_list(), c.all);
    run.succeed();
}

// ---- Roles, placement, leases, restoration ------------------------------------------------

/// A worker's threads during a lease are workers on the GPU-local set, the main thread a host
/// on every CPU; a thread made with an attribute mask keeps it (`explicit`) through a second
/// configure, the release and a configure after it; the release restores the rest. The
/// library's table lists every live thread but qemu's own.
#[test]
fn roles_leases_and_restoration_as_on_x86_64() {
    let a = require!(arm64());
    let sysfs = Sysfs::two_nodes();
    let c = require!(cpus(&sysfs));
    let cpu = sysfs.node0.first().unwrap().to_string();
    let mut cmd = a.preloaded(&arm64_program("lifecycle_scenarios"), &sysfs);
    cmd.args(["explicit", &cpu]);
    let mut run = Driver::spawn(cmd, LIMIT);

    let configured = run.phase();
    println!("{}", describe(&configured));
    expect(
        &configured,
        Named(&["W", "C"]),
        worker_on(&c.local),
        "worker",
    );
    expect(&configured, Named(&["E", "E1"]), on(&c.other), "explicit");
    expect(&configured, Named(&["main"]), host_on(&c.all), "host");
    assert_eq!(configured.role("E"), 1, "E was made by a worker");
    let live = task_tids(run.pid());
    run.proceed();
    let report = run.report("configured");
    let qemu = QemuThread::of(run.pid(), &report);
    let mut program_threads = live.clone();
    program_threads.remove(&qemu.0);
    assert_eq!(report_tids(&report), program_threads, "{report}");
    assert!(
        configured.threads.values().all(|t| t.tid != qemu.0),
        "qemu's thread is none of the program's"
    );
    let e = configured.thread("E").tid;
    assert_eq!(report_placement(&report, e), "explicit");

    let twice = run.phase();
    expect(&twice, Named(&["W", "C", "C2"]), on(&c.local), "worker");
    expect(&twice, Named(&["E", "E1", "E2"]), on(&c.other), "explicit");
    run.proceed();
    let released = run.phase();
    println!("{}", describe(&released));
    expect(
        &released,
        Named(&["W", "C", "C2", "main"]),
        on(&c.all),
        "restored",
    );
    expect(
        &released,
        Named(&["E", "E1", "E2", "E3"]),
        on(&c.other),
        "never restored",
    );
    run.proceed();
    let report = run.report("released");
    for t in ["E", "E1", "E2", "E3"] {
        assert_eq!(
            report_placement(&report, released.thread(t).tid),
            "explicit",
            "{t}"
        );
    }
    let again = run.phase();
    expect(&again, Named(&["W", "C", "C2"]), on(&c.local), "worker");
    let end = run.succeed();
    says(
        &end.stderr,
        &["4 worker threads keep masks set by someone else"],
    );
}

/// The C population of the x86_64 tier (tests/programs/population.c, its worker-libs thread
/// started in a stand-in libnccl): before configure nobody moved and the libnccl thread is
/// already a worker; configure pins the worker, its descendants and the libnccl threads, the
/// hosts keep every CPU; a second configure changes nothing and says nothing; the last release
/// restores every mask; a worker born after it is born on the restored mask.
#[test]
fn the_c_population_as_on_x86_64() {
    let a = require!(arm64());
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let local = sysfs.node1.to_list();
    let workers = ["W", "C1", "G1", "C2", "C3", "C4", "C5", "C6", "P1"];
    let nccl = arm64_shared_object("nccl");
    let mut cmd = a.preloaded(&arm64_program("population"), &sysfs);
    cmd.env("FAKE_NCCL", nccl).arg("0");
    let (phases, end) = Driver::spawn(cmd, LIMIT).all_phases::<5>();
    assert!(end.status.success(), "{}", end.stderr);
    let [before, configured, twice, released, after] = &phases;
    println!("{}\n{}", describe(configured), describe(released));
    expect(before, Named(&["main", "H1"]), on(&all), "before configure");
    expect(before, Named(&workers), on(&all), "before configure");
    assert_eq!(
        before.role("P1"),
        1,
        "a thread started in libnccl is a worker"
    );
    assert_eq!(before.role("W"), 0);
    expect(
        configured,
        Named(&workers),
        worker_on(&local),
        "after configure",
    );
    expect(configured, Named(&["main", "H1"]), host_on(&all), "host");
    expect(
        twice,
        Named(&workers),
        on(&local),
        "after the second configure",
    );
    expect(
        twice,
        Named(&["C7", "P2"]),
        on(&local),
        "born during the lease",
    );
    assert_eq!((twice.mask("H2"), twice.role("H2")), (all.clone(), 0));
    never_says(&end.stderr, &["constrained"]);
    says(
        &end.stderr,
        &[&format!(
            "CPU affinity set to [{local}] for optimal NUMA-aware scheduling (9/9 threads)"
        )],
    );
    assert_eq!(
        end.stderr
            .matches("for optimal NUMA-aware scheduling")
            .count(),
        1,
        "{}",
        end.stderr
    );
    expect(released, All, on(&all), "after release");
    says(
        &end.stderr,
        &[
            "release 1 -> 0",
            "release 2 -> 0",
            "release again -> -2",
            "restored 11 threads, preserved 0",
        ],
    );
    assert_eq!((after.mask("C8"), after.role("C8")), (all, 1));
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

// ---- Bad input ----------------------------------------------------------------------------

/// A malformed variable at load: one line naming it and its value, the library passive, the
/// program's own exit status; under TLLM_AFFINITY_STRICT=1 the same line and status 2.
#[test]
fn a_malformed_variable_is_one_line_and_the_program_runs_on() {
    let a = require!(arm64());
    let sysfs = Sysfs::two_nodes();
    let life = arm64_program("lifecycle_scenarios");
    for strict in [false, true] {
        let mut cmd = a.preloaded(&life, &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", "warn")
            .env("TLLM_AFFINITY_POLICY", "sideways")
            .args(["exit", "3"]);
        if strict {
            cmd.env("TLLM_AFFINITY_STRICT", "1");
        }
        let end = run_bounded(cmd, LIMIT);
        let lines = lines_starting(&end.stderr, "[tllm-affinity]");
        assert_eq!(lines.len(), 1, "strict={strict}: {}", end.stderr);
        says(lines[0], &["TLLM_AFFINITY_POLICY='sideways' is not valid"]);
        assert_eq!(
            end.status.code(),
            Some(if strict { 2 } else { 3 }),
            "strict={strict}: {}\n{}",
            end.stdout,
            end.stderr
        );
        if !strict {
            says(&end.stdout, &["\"state\":\"passive\""]);
        }
    }
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
