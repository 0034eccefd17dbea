//! Issue #7, security: a secure-execution process (AT_SECURE, really set: a setgid-root copy and
//! a copy with file capabilities, each run by `nobody`) gets no behaviour; the report, the
//! per-GPU lock and the thread table in /dev/shm never follow a symbolic link, never write
//! through a hard link, never hang on a FIFO or trip on a directory planted at their path, and
//! are created 0644 under umask 077.
//!
//! As root, a setuid-root binary run by root does not set AT_SECURE (nothing changes identity):
//! the test shows that too, as the reason for the non-root runs.

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use tllm_affinity_core::host::simulated::SimulatedHost;
use tllm_affinity_core::mask::CpuMask;

const LIMIT: Duration = Duration::from_secs(30);

fn life() -> PathBuf {
    Program::c("lifecycle_scenarios").build()
}

/// A world-readable temporary directory (`nobody` must reach what is in it).
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

fn secure_line(out: &Finished) -> String {
    out.stdout
        .lines()
        .find(|l| l.starts_with("SECURE"))
        .unwrap_or_else(|| panic!("{}\n{}", out.stdout, out.stderr))
        .to_string()
}

/// `program` run by `nobody` (via setpriv) with the library in LD_PRELOAD and as argv[1].
fn as_nobody(program: &Path, sysfs: &Sysfs) -> Command {
    let mut cmd = preloaded("setpriv", sysfs);
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(program)
        .arg(library());
    cmd
}

#[test]
fn a_secure_execution_process_gets_no_behaviour() {
    let sysfs = Sysfs::two_nodes();
    std::fs::set_permissions(sysfs.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let local = sysfs.node1.to_list();
    let all = allowed_cpus().to_list();
    let built = Program::c("secure_execution").build();
    let dir = open_dir();
    let copy = |name: &str| {
        let path = dir.path().join(name);
        std::fs::copy(&built, &path).unwrap();
        path
    };

    // The control: the same program by nobody, no privilege change: the library acts.
    let plain = copy("plain");
    let out = run_bounded(as_nobody(&plain, &sysfs), LIMIT);
    let line = secure_line(&out);
    assert_eq!(field(&line, "at_secure"), "0", "{line}");
    assert_eq!(field(&line, "preloaded"), "1", "{line}");
    assert_eq!(field(&line, "state"), "active", "{line}");
    assert!(
        field(&line, "configure").parse::<i64>().unwrap() > 0,
        "{line}"
    );
    assert_eq!(field(&line, "mask_after"), local, "{line}");

    // Why not as root: a setuid-root binary run by root changes no identity, so no AT_SECURE.
    let setuid = copy("setuid");
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let mut cmd = preloaded(&setuid, &sysfs);
    cmd.arg(library());
    let line = secure_line(&run_bounded(cmd, LIMIT));
    if field(&line, "uid") == "0" {
        assert_eq!(field(&line, "at_secure"), "0", "{line}");
    }

    // Really secure: setgid root (egid 0 != gid 65534), and file capabilities.
    let setgid = copy("setgid");
    std::os::unix::fs::chown(&setgid, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&setgid, std::fs::Permissions::from_mode(0o2755)).unwrap();
    let mut secure = vec![("setgid root", setgid)];
    let caps = copy("caps");
    match Command::new("setcap")
        .arg("cap_sys_nice+ep")
        .arg(&caps)
        .output()
    {
        Ok(o) if o.status.success() => secure.push(("file capabilities", caps)),
        other => println!("setcap unavailable ({other:?}): only the setgid copy is run"),
    }
    for (how, program) in secure {
        let out = run_bounded(as_nobody(&program, &sysfs), LIMIT);
        let line = secure_line(&out);
        assert_eq!(
            field(&line, "at_secure"),
            "1",
            "{how}: AT_SECURE not set: {line}"
        );
        // The loader ignores LD_PRELOAD there; dlopen'd, the library disables itself.
        assert_eq!(field(&line, "preloaded"), "0", "{how}: {line}");
        assert_eq!(field(&line, "state"), "disabled", "{how}: {line}");
        assert_eq!(field(&line, "role"), "-2", "{how}: {line}");
        assert_eq!(field(&line, "configure"), "-95", "{how}: ENOTSUP: {line}");
        assert_eq!(field(&line, "mask_after"), all, "{how}: {line}");
        assert!(
            !out.stderr.contains("[tllm-affinity]"),
            "{how}: not a word: {}",
            out.stderr
        );
        assert!(out.status.success(), "{how}: {}", out.stderr);
    }
}

/// The hostile things a path can hold before the library opens it. Each returns a check that
/// the planted thing (and whatever it points to) is unchanged.
#[derive(Clone, Copy, Debug)]
enum Planted {
    Symlink,
    HardLink,
    Fifo,
    Directory,
}

const PLANTED: [Planted; 4] = [
    Planted::Symlink,
    Planted::HardLink,
    Planted::Fifo,
    Planted::Directory,
];

/// Plants `what` at `path`; the victim lives in `victim_dir` (same filesystem, for hard links).
fn plant(what: Planted, path: &Path, victim_dir: &Path) -> Box<dyn Fn()> {
    let victim = victim_dir.join(format!(
        "lc-victim-{}-{}",
        std::process::id(),
        path.file_name().unwrap().to_string_lossy()
    ));
    let content = "root:x:0:0:root:/root:/bin/bash\n";
    let path = path.to_path_buf();
    // A table left by a killed process that had this pid before would be in the way.
    let _ = std::fs::remove_file(&path);
    match what {
        Planted::Symlink | Planted::HardLink => {
            std::fs::write(&victim, content).unwrap();
            std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
            if matches!(what, Planted::Symlink) {
                std::os::unix::fs::symlink(&victim, &path).unwrap();
            } else {
                std::fs::hard_link(&victim, &path).unwrap();
            }
            Box::new(move || {
                assert_eq!(
                    std::fs::read_to_string(&victim).unwrap(),
                    content,
                    "{what:?}: the victim was written"
                );
                assert_eq!(mode(&victim), 0o600, "{what:?}: the victim's mode changed");
                let _ = std::fs::remove_file(&victim);
                let _ = std::fs::remove_file(&path);
            })
        }
        Planted::Fifo => {
            let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
            // SAFETY: a NUL-terminated path; mkfifo reads it only.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
            Box::new(move || {
                use std::os::unix::fs::FileTypeExt;
                assert!(std::fs::symlink_metadata(&path)
                    .unwrap()
                    .file_type()
                    .is_fifo());
                let _ = std::fs::remove_file(&path);
            })
        }
        Planted::Directory => {
            std::fs::create_dir(&path).unwrap();
            Box::new(move || {
                assert!(path.is_dir());
                assert_eq!(std::fs::read_dir(&path).unwrap().count(), 0);
                let _ = std::fs::remove_dir(&path);
            })
        }
    }
}

/// `cmd` started by a shell that sets umask 077 first (the shell itself not preloaded).
fn under_umask_077(cmd: &Command) -> Command {
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg(r#"umask 077; export LD_PRELOAD="$LC_PRELOAD"; exec "$@""#)
        .arg("sh")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (name, value) in cmd.get_envs() {
        match value {
            Some(v) if name == "LD_PRELOAD" => sh.env("LC_PRELOAD", v),
            Some(v) => sh.env(name, v),
            None => sh.env_remove(name),
        };
    }
    sh.env_remove("LD_PRELOAD");
    sh
}

#[test]
fn the_report_file_never_follows_links_never_hangs_and_is_0644() {
    let sysfs = Sysfs::two_nodes();
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let program = |path: &Path| {
        let mut cmd = preloaded(life(), &sysfs);
        cmd.env("TLLM_AFFINITY_REPORT", path)
            .env("TLLM_AFFINITY_LOG", "warn")
            .args(["exit", "3"]);
        cmd
    };

    // Created 0644 under umask 077; a pre-existing 0600 report of ours is replaced, 0644.
    let out = run_bounded(under_umask_077(&program(&report)), LIMIT);
    assert_eq!(out.status.code(), Some(3), "{}", out.stderr);
    assert_eq!(mode(&report), 0o644);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(v["state"], "active");
    std::fs::write(&report, "old").unwrap();
    std::fs::set_permissions(&report, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = run_bounded(under_umask_077(&program(&report)), LIMIT);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(mode(&report), 0o644);
    assert!(std::fs::read_to_string(&report)
        .unwrap()
        .contains("\"schema\":1"));

    for what in PLANTED {
        let path = dir.path().join(format!("planted-{what:?}.json"));
        let check = plant(what, &path, dir.path());
        let out = run_bounded(program(&path), LIMIT);
        assert_eq!(out.status.code(), Some(3), "{what:?}: {}", out.stderr);
        let lines = lines_starting(&out.stderr, "[tllm-affinity]");
        assert_eq!(lines.len(), 1, "{what:?}: one line at exit: {}", out.stderr);
        assert!(lines[0].contains("TLLM_AFFINITY_REPORT"), "{}", lines[0]);
        check();
    }
}

/// One NUMA node over two CPUs, each its own core, one GPU: `auto` can pin, so it takes the lock.
fn one_node_two_cores() -> SimulatedHost {
    let cpus: Vec<usize> = allowed_cpus().iter().take(2).collect();
    let one = |c: usize| CpuMask::from_cpus([c]);
    SimulatedHost::new()
        .cpu(cpus[0], 0, 0, &one(cpus[0]))
        .cpu(cpus[1], 1, 0, &one(cpus[1]))
        .node(0, &CpuMask::from_cpus(cpus.iter().copied()))
        .gpu("0000:3b:00.0", Some(0), None)
}

#[test]
fn the_gpu_lock_never_follows_links_never_hangs_and_is_0644() {
    require!(two_cpus("this test"));
    let sysfs = Sysfs::two_nodes();
    let tree = tempfile::tempdir().unwrap();
    one_node_two_cores().write(tree.path()).unwrap();
    let locks = tempfile::tempdir().unwrap();
    let lock = locks.path().join("tllm-affinity-gpu-0000:3b:00.0.lock");
    let program = || {
        let mut cmd = preloaded(life(), &sysfs);
        cmd.env("TLLM_AFFINITY_SYSFS_ROOT", tree.path())
            .env("TLLM_AFFINITY_LOCK_DIR", locks.path())
            .env("TLLM_AFFINITY_STEP_CORE", "auto")
            .env("TLLM_AFFINITY_POLICY", "numa")
            .env("TLLM_AFFINITY_LOG", "warn")
            .arg("step");
        cmd
    };
    let first = allowed_cpus().first().unwrap().to_string();

    let out = run_bounded(under_umask_077(&program()), LIMIT);
    let line = out.stdout.lines().find(|l| l.starts_with("STEP")).unwrap();
    assert_eq!(field(line, "rc"), "1", "pinned: {line}\n{}", out.stderr);
    assert_eq!(field(line, "mask"), first);
    assert_eq!(mode(&lock), 0o644);
    std::fs::remove_file(&lock).unwrap();

    for what in PLANTED {
        let check = plant(what, &lock, locks.path());
        let out = run_bounded(program(), LIMIT);
        assert!(out.status.success(), "{what:?}: {}", out.stderr);
        let line = out.stdout.lines().find(|l| l.starts_with("STEP")).unwrap();
        match what {
            // A hard link to a file of ours is a regular file: flock on it harms nothing (the
            // file is opened read-only when it exists, never truncated).
            Planted::HardLink => assert_eq!(field(line, "rc"), "1", "{line}"),
            _ => {
                assert_eq!(field(line, "rc"), "0", "{what:?}: not pinned: {line}");
                assert!(
                    out.stderr.contains(&lock.display().to_string()),
                    "{}",
                    out.stderr
                );
            }
        }
        check();
    }
}

/// The thread table's path is known only once the pid is: a shell (not preloaded) waits for a
/// line, the test plants at /dev/shm/tllm-affinity.<pid>.threads, then the shell execs the
/// program with the library, keeping the pid.
fn table_run(sysfs: &Sysfs, umask: bool) -> (Driver, PathBuf) {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            r#"read go; {} export LD_PRELOAD="$LC_PRELOAD"; exec "$@""#,
            if umask { "umask 077;" } else { "" }
        ))
        .arg("sh")
        .arg(life())
        .arg("role")
        .env("LC_PRELOAD", library())
        .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path())
        .env("TLLM_AFFINITY_LOG", "warn")
        .env_remove("LD_PRELOAD")
        .env_remove("TLLM_AFFINITY_PROCESS_ROLE");
    let run = Driver::spawn(cmd, LIMIT);
    let path = Path::new("/dev/shm").join(tllm_affinity_core::table::threadtable::file_name(
        run.pid(),
        tllm_affinity_core::table::threadtable::pid_namespace(Path::new("/proc/self")).unwrap(),
    ));
    (run, path)
}

#[test]
fn the_thread_table_never_follows_links_never_hangs_and_is_0644() {
    require!(Path::new("/dev/shm").is_dir(), "/dev/shm");
    let sysfs = Sysfs::two_nodes();

    // The normal case: created 0644 under umask 077, removed at exit.
    let (mut run, path) = table_run(&sysfs, true);
    run.proceed();
    let report = run.report("load");
    assert_eq!(report["state"], "active");
    run.phase();
    assert_eq!(mode(&path), 0o644, "{}", path.display());
    let meta = std::fs::metadata(&path).unwrap();
    assert!(meta.is_file() && meta.nlink() == 1);
    run.succeed();
    assert!(!path.exists(), "the table is removed at exit");

    // Hostile things planted at the path, and a file of another user.
    let shm = Path::new("/dev/shm");
    for what in PLANTED.iter().map(Some).chain([None]) {
        let (mut run, path) = table_run(&sysfs, false);
        let check: Box<dyn Fn()> = match what {
            Some(w) => plant(*w, &path, shm),
            None => {
                std::fs::write(&path, "someone else's\n").unwrap();
                std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
                let p = path.clone();
                Box::new(move || {
                    assert_eq!(std::fs::read_to_string(&p).unwrap(), "someone else's\n");
                    assert_eq!(std::fs::metadata(&p).unwrap().uid(), 65534);
                    let _ = std::fs::remove_file(&p);
                })
            }
        };
        run.proceed();
        let report = run.report("load");
        assert_eq!(report["state"], "active", "{what:?}: the program runs on");
        let running = run.phase();
        assert_eq!(running.role("T1"), 0, "{what:?}: roles still tracked");
        let end = run.finish();
        assert!(end.status.success(), "{what:?}: {}", end.stderr);
        check();
    }
}

// ---- Thread tables that nobody else can break (the launch rules) ----------------------------

fn calls(args: &[&str], sysfs: &Sysfs) -> Command {
    let mut cmd = preloaded(Program::c("calls").build(), sysfs);
    cmd.args(args);
    cmd
}

fn ps_json(pid: u32) -> serde_json::Value {
    let out = succeeded(clean(cli()).args(["ps", &pid.to_string(), "--json"]));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn roles(ps: &serde_json::Value) -> Vec<String> {
    ps_column(ps, "role")
}

/// The pid of the only child of `pid` (the program `unshare --fork` starts).
fn only_child(pid: u32) -> u32 {
    for _ in 0..500 {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        if let Some(child) = children.split_whitespace().next() {
            return child.parse().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("process {pid} started no child");
}

/// Two processes in two PID namespaces sharing `/dev/shm` (`--ipc=host` in a container), both
/// pid 1 there: the second never removes or takes over the first's table, and `ps` on the first
/// shows its roles.
#[test]
fn a_process_in_another_pid_namespace_with_the_same_pid_keeps_its_own_table() {
    let sysfs = Sysfs::two_nodes();
    require!(Path::new("/dev/shm").is_dir(), "/dev/shm");
    require!(on_path("unshare"), "`unshare` on PATH");
    require!(two_cpus("a worker role that ps can tell from a host"));
    let in_namespace = |args: &[&str]| {
        let mut cmd = preloaded("unshare", &sysfs);
        cmd.args(["--pid", "--fork", "--mount-proc"])
            .arg(Program::c("calls").build())
            .args(args);
        cmd
    };
    let mut first = Driver::spawn(in_namespace(&["thread", "configure", "0", "wait"]), LIMIT);
    assert_eq!(first.line("WAIT"), "WAIT 1", "pid 1 in its namespace");
    let first_pid = only_child(first.pid());
    assert_eq!(roles(&ps_json(first_pid)), ["worker"], "before the second");
    let mut second = Driver::spawn(in_namespace(&["thread", "wait"]), LIMIT);
    assert_eq!(second.line("WAIT"), "WAIT 1");
    let second_pid = only_child(second.pid());
    let ps = ps_json(first_pid);
    assert_eq!(roles(&ps), ["worker"], "after the second: {ps}");
    assert_eq!(roles(&ps_json(second_pid)), ["host"]);
    first.succeed();
    second.succeed();
}

/// A table that is not the process's owner's is not believed: `ps` shows masks without roles
/// and says why.
#[test]
fn ps_believes_a_table_only_from_the_processs_owner() {
    let sysfs = Sysfs::two_nodes();
    require!(Path::new("/dev/shm").is_dir(), "/dev/shm");
    require!(two_cpus("a worker role that ps can tell from a host"));
    let mut run = Driver::spawn(calls(&["thread", "configure", "0", "wait"], &sysfs), LIMIT);
    run.line("WAIT");
    let pid = run.pid();
    assert_eq!(roles(&ps_json(pid)), ["worker"]);
    let table = Path::new("/dev/shm").join(tllm_affinity_core::table::threadtable::file_name(
        pid,
        tllm_affinity_core::table::threadtable::pid_namespace(Path::new("/proc/self")).unwrap(),
    ));
    std::os::unix::fs::chown(&table, Some(65534), None).unwrap();
    let ps = ps_json(pid);
    // Given back before judging: a table left to another user is not ours to remove later.
    std::os::unix::fs::chown(&table, Some(0), None).unwrap();
    assert_eq!(roles(&ps), ["unknown"], "{ps}");
    assert!(ps.to_string().contains("not believed"), "{ps}");
    run.succeed();
}

/// Anybody may plant a sparse file of any size at a process's table path: `ps` reads the
/// header and the records it needs, never the whole file (its peak RSS stays far below it).
#[test]
fn ps_reads_a_bounded_amount_of_a_planted_table() {
    let sysfs = Sysfs::two_nodes();
    require!(Path::new("/dev/shm").is_dir(), "/dev/shm");
    let mut run = Driver::spawn(calls(&["wait"], &sysfs), LIMIT);
    run.line("WAIT");
    let pid = run.pid();
    let header = tllm_affinity_core::table::threadtable::header(
        pid,
        tllm_affinity_core::table::threadtable::start_time(pid).unwrap(),
    );
    let namespace =
        tllm_affinity_core::table::threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
    let planted = Path::new("/dev/shm").join(tllm_affinity_core::table::threadtable::file_name(
        pid, namespace,
    ));
    let file = std::fs::File::create(&planted).unwrap();
    std::io::Write::write_all(&mut &file, &header).unwrap();
    file.set_len(2 << 30).unwrap();
    // Reaped with wait4 below, which also gives its peak RSS (std's wait does not).
    #[allow(clippy::zombie_processes)]
    let child = clean(cli())
        .args(["ps", &pid.to_string(), "--json"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid out-parameter; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for the child spawned above, with valid out-pointers.
    let waited = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let _ = std::fs::remove_file(&planted);
    assert_eq!(waited, child.id() as i32);
    assert_eq!(status, 0, "ps succeeded");
    let peak_mib = usage.ru_maxrss / 1024;
    assert!(
        peak_mib < 64,
        "ps peaked at {peak_mib} MiB on a 2 GiB table"
    );
    run.succeed();
}
