//! Resources running out and neighbours planting things (SPEC §9), on real processes in a private
//! mount namespace whose `/dev/shm` is a tmpfs of the test's own: a `/dev/shm` that fills up
//! while the program runs costs the thread table (with one log line, and `ps` saying why), never
//! a SIGBUS; names another user planted in the table directory cost a process's first thread no
//! more than an empty directory does.
//!
//! Needs root (a mount namespace, a tmpfs, another user to plant as): without it, the tests fail
//! under `CI=true` and say what is missing elsewhere.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;
use tllm_affinity_core::table::threadtable;

const LIMIT: Duration = Duration::from_secs(120);

fn shm_exhaustion() -> PathBuf {
    Program::c("shm_exhaustion").flags(&["-pthread"]).build()
}

/// Root with `unshare` and `mount`, or why not.
fn private_mounts() -> Result<(), String> {
    if !root() {
        return Err("root, for a private mount namespace with a tmpfs /dev/shm".into());
    }
    for tool in ["unshare", "mount", "setpriv", "nsenter"] {
        if !on_path(tool) {
            return Err(format!("{tool} (util-linux)"));
        }
    }
    Ok(())
}

/// `program args` in a mount namespace of its own whose `/dev/shm` is a fresh tmpfs mounted with
/// `options`, after `before` (a shell command run there first, as root).
fn in_private_shm(program: &Path, args: &[&str], options: &str, before: &str) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o {options},mode=1777 tmpfs /dev/shm && {before} exec \"$0\" \"$@\""
        ))
        .arg(program)
        .args(args);
    cmd
}

/// The pid of a run that printed `WAIT <pid>` and waits.
fn waiting_pid(run: &mut Driver) -> u32 {
    let line = run.line("WAIT ");
    line["WAIT ".len()..].trim().parse().unwrap()
}

/// `tllm-affinity ps PID --json` run in the mount namespace of process `pid` (its `/dev/shm`).
fn ps_json_in_the_mounts_of(pid: u32) -> Value {
    let out = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "--"])
        .arg(cli())
        .args(["ps", &pid.to_string(), "--json"])
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", output_text(&out)))
}

/// The library's own lines in a run's stderr.
fn library_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("[tllm-affinity]"))
        .collect()
}

/// The steps of the run whose `/dev/shm` fills after its first thread: 600 live threads (past the
/// table's first records page), a configure (the leases), an adapter's note, a worker.
const FILL_AFTER_FIRST_THREAD: [&str; 10] = [
    "thread",
    "fill",
    "live",
    "600",
    "configure",
    "0",
    "note",
    "worker",
    "wait",
    "thread",
];

/// A `/dev/shm` of 64 KiB fills up after the program's first thread (its table's header page is
/// there, nothing else): 600 more live threads, a configure, an adapter's note and a worker run as
/// they run without the library, with no signal; the library says once that the table lost pages;
/// `ps` run in the process's mount namespace shows the table and says it is partial, and why.
#[test]
fn a_dev_shm_that_fills_after_the_first_thread_costs_the_table_never_a_sigbus() {
    require!(private_mounts());
    let sysfs = Sysfs::two_nodes();
    let program = shm_exhaustion();

    let mut bare = in_private_shm(&program, &FILL_AFTER_FIRST_THREAD, "size=64k", "");
    bare.env_remove("LD_PRELOAD");
    let mut bare = Driver::spawn(bare, LIMIT);
    bare.line("WAIT ");
    bare.proceed();
    let without = bare.succeed();

    let mut cmd = in_private_shm(&program, &FILL_AFTER_FIRST_THREAD, "size=64k", "");
    preload(&mut cmd, &sysfs).env("TLLM_AFFINITY_LOG", "warn");
    let mut run = Driver::spawn(cmd, LIMIT);
    let pid = waiting_pid(&mut run);
    let ps = ps_json_in_the_mounts_of(pid);
    run.proceed();
    let with = run.finish();

    assert!(
        with.status.success(),
        "the program ends as without the library ({:?}), not {:?}; stderr:\n{}",
        without.status,
        with.status,
        with.stderr
    );
    let comparable = |stdout: &str| -> Vec<String> {
        stdout
            .lines()
            .filter(|l| {
                !l.starts_with("CONFIGURE")
                    && !l.starts_with("NOTE")
                    && !l.starts_with("WORKER")
                    && !l.starts_with("WAIT")
            })
            .map(str::to_string)
            .collect()
    };
    assert_eq!(comparable(&with.stdout), comparable(&without.stdout));
    assert!(with.stdout.contains("CONFIGURE ok"), "{}", with.stdout);
    assert!(
        with.stdout.contains("WORKER 1"),
        "the worker is placed, table or not: {}",
        with.stdout
    );
    let lines = library_lines(&with.stderr);
    assert_eq!(
        lines.len(),
        1,
        "one line says the table lost pages: {lines:?}"
    );
    assert!(
        lines[0].contains("No space left on device") && lines[0].contains("thread table"),
        "{}",
        lines[0]
    );
    assert_eq!(ps["table"], true, "{ps}");
    let partial = ps["table_partial"].as_str().unwrap_or_default();
    assert!(
        partial.contains("No space left on device"),
        "ps says the table is partial and why: {ps}"
    );
}

/// `/dev/shm` full before the process maps its table (the header's write fails): no table file is
/// left behind, the program runs as without the library, and `ps` says why there is no table.
#[test]
fn a_dev_shm_full_before_the_table_leaves_no_file_and_ps_says_why() {
    require!(private_mounts());
    let sysfs = Sysfs::two_nodes();
    let program = shm_exhaustion();
    let fill = format!("FILL_DIR=/dev/shm {} fill >/dev/null &&", program.display());
    let mut cmd = in_private_shm(
        &program,
        &["thread", "configure", "0", "wait"],
        "size=64k",
        &fill,
    );
    preload(&mut cmd, &sysfs).env("TLLM_AFFINITY_LOG", "warn");
    let mut run = Driver::spawn(cmd, LIMIT);
    let pid = waiting_pid(&mut run);
    let listing = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "--", "ls", "-A", "/dev/shm"])
        .output()
        .unwrap();
    let ps = ps_json_in_the_mounts_of(pid);
    run.proceed();
    let with = run.succeed();
    let names = String::from_utf8_lossy(&listing.stdout).into_owned();
    assert!(
        !names.contains("tllm-affinity."),
        "no table file left half-made: {names}"
    );
    assert!(with.stdout.contains("CONFIGURE ok"), "{}", with.stdout);
    assert_eq!(ps["table"], false, "{ps}");
    let note = ps["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("no space left"),
        "ps says the table directory is full: {note}"
    );
}

/// Another local user (`nobody`) plants 300 000 names of the table's shape, with this PID
/// namespace's number in them, in `/dev/shm`: a preloaded process's first `pthread_create` +
/// `join` still takes what it takes in an empty directory, within a few milliseconds (the bound
/// here is generous for a loaded CI machine; scripts/bench gives the medians).
#[test]
fn names_another_user_planted_do_not_slow_the_first_thread() {
    require!(private_mounts());
    let sysfs = Sysfs::two_nodes();
    let program = shm_exhaustion();
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
    let plant = format!(
        "setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 -c 'import os; \
[os.close(os.open(\"/dev/shm/tllm-affinity.{namespace}.%d.threads\" % (4000000 + i), \
os.O_CREAT | os.O_WRONLY, 0o644)) for i in range(300000)]' &&"
    );
    let first_birth_us = |before: &str| -> u64 {
        let mut times: Vec<u64> = (0..3)
            .map(|_| {
                let mut cmd = in_private_shm(
                    &program,
                    &["first-birth"],
                    "size=512m,nr_inodes=400k",
                    before,
                );
                preload(&mut cmd, &sysfs);
                let done = run_bounded(cmd, LIMIT);
                assert!(done.status.success(), "{}", done.stderr);
                let line = done
                    .stdout
                    .lines()
                    .find(|l| l.starts_with("FIRST_BIRTH_US "))
                    .unwrap_or_else(|| panic!("{}", done.stdout))
                    .to_string();
                line["FIRST_BIRTH_US ".len()..].trim().parse().unwrap()
            })
            .collect();
        times.sort();
        times[1]
    };
    let empty = first_birth_us("");
    let planted = first_birth_us(&plant);
    eprintln!(
        "first birth: {empty} us in an empty /dev/shm, {planted} us among 300 000 planted names"
    );
    assert!(
        planted < empty + 100_000,
        "300 000 planted names slowed the first thread: {planted} us against {empty} us"
    );
}

/// The functions the library interposes: each must reach the real libc function, so it is not
/// wrapped whole; the engine fails open inside each (the real call always runs).
const INTERPOSED: [&str; 21] = [
    "__cxa_thread_atexit_impl",
    "clearenv",
    "dlclose",
    "execv",
    "execve",
    "execvp",
    "execvpe",
    "fexecve",
    "popen",
    "posix_spawn",
    "posix_spawnp",
    "pthread_create",
    "pthread_setaffinity_np",
    "pthread_setspecific",
    "putenv",
    "sched_setaffinity",
    "setenv",
    "system",
    "timer_create",
    "timer_delete",
    "unsetenv",
];

/// Every function the built library exports is either an interposed libc function (above) or
/// its own C API, whose shim runs its whole body under `engine::fail_open`: a panic inside the
/// library answers an error code, never unwinds into (and aborts) the host. A new export is
/// caught here until it is one or the other.
#[test]
fn every_exported_entry_point_fails_open() {
    require!(on_path("nm"), "nm (binutils)");
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(library())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let exported: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(
            |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                [_, "T", name] => Some(name.to_string()),
                _ => None,
            },
        )
        .collect();
    assert!(exported.len() > INTERPOSED.len(), "{exported:?}");
    let shims = std::fs::read_to_string(repo().join("cdylib/src/lib.rs")).unwrap();
    for name in &exported {
        if INTERPOSED.contains(&name.as_str()) {
            continue;
        }
        assert!(
            name.starts_with("tllm_affinity_"),
            "{name}: exported, but neither interposed nor the library's API"
        );
        let at = shims
            .find(&format!("fn {name}("))
            .unwrap_or_else(|| panic!("{name}: no shim in cdylib/src/lib.rs"));
        let body = &shims[at..];
        let body = &body[..body.find("\n}\n").unwrap_or(body.len())];
        let open = body.find('{').unwrap_or(0);
        assert!(
            body[open..]
                .trim_start_matches('{')
                .trim_start()
                .starts_with("engine::fail_open("),
            "{name}: its shim's body does not run under engine::fail_open:\n{body}"
        );
    }
}

/// `/proc` mounted `hidepid=2` (a private mount namespace): another user's `ps` sees none of
/// root's processes. The host view ends at once and lists none of them, never an error; `ps PID`
/// on a process it cannot see is one line and a failing exit, never a hang.
#[test]
fn ps_under_hidepid_sees_only_its_own_and_ends() {
    require!(private_mounts());
    let sysfs = Sysfs::two_nodes();
    let mut cmd = preloaded(shm_exhaustion(), &sysfs);
    cmd.args(["thread", "configure", "0", "wait"]);
    let mut run = Driver::spawn(cmd, LIMIT);
    let pid = waiting_pid(&mut run);
    let as_nobody = |args: &str| {
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount -t proc -o hidepid=2 proc /proc && exec setpriv --reuid=65534 \
                 --regid=65534 --clear-groups \"$0\" {args}"
            ))
            .arg(cli())
            .env_remove("LD_PRELOAD");
        run_bounded(cmd, Duration::from_secs(30))
    };
    let view = as_nobody("ps --json");
    let one = as_nobody(&format!("ps {pid}"));
    run.proceed();
    run.succeed();
    assert!(view.status.success(), "{}\n{}", view.stdout, view.stderr);
    let v: Value =
        serde_json::from_str(&view.stdout).unwrap_or_else(|e| panic!("{e}: {}", view.stdout));
    assert!(
        !v.to_string().contains(&format!("\"pid\":{pid}")),
        "root's process is hidden from nobody: {v}"
    );
    assert!(!one.status.success(), "{}", one.stdout);
    let lines: Vec<&str> = one.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {lines:?}");
    assert!(lines[0].contains(&pid.to_string()), "{}", lines[0]);
}
