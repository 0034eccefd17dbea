//! The fault-injection tier (issue #56, SPEC §9 "Resources run out, neighbours plant things"):
//! every system call the library's population makes fails with each errno the call can give,
//! and a program that survives that without the library survives it with the library: exit 0,
//! the same stdout, no hang, at most one `[tllm-affinity]` line. Then the resources themselves
//! run out: four descriptors, the task limit of a user, a read-only or full `/dev/shm`, a full
//! lock directory.
//!
//! The failure is injected the way SQLite's and glibc's tests inject theirs, from outside the
//! code under test: `tests/programs/fault_inject.c`, a seccomp filter answering one call with
//! one errno, installed at two points: before the program's exec (the loader, the library's
//! constructor and everything after see it) and, from a preload object of its own placed last
//! in `LD_PRELOAD`, after the loader mapped everything (so a call the loader cannot do without,
//! `openat`, `mmap`, fails for the library and the program only). The calls are what
//! `strace -f -c` counts in one run of the population with and without the library, so a call
//! the library starts making later is covered without editing a list. The table of outcomes is
//! generated into docs/reliability.md (`TLLM_AFFINITY_WRITE_DOCS=1` rewrites it).
//!
//! ```sh
//! cargo test --release --test process -- fault_injection:: --nocapture
//! TLLM_AFFINITY_WRITE_DOCS=1 cargo test --release --test process -- fault_injection::
//! ```

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;

/// One run's bound: the population takes ~20 ms; a run that needs this long hangs.
const RUN_LIMIT: Duration = Duration::from_secs(10);

/// Runs at once: the machine has two CPUs, shared.
const PARALLEL: usize = 2;

const BEGIN: &str = "<!-- fault-table:begin -->";
const END: &str = "<!-- fault-table:end -->";

fn population() -> PathBuf {
    Program::c("fault_population").build()
}

fn launcher() -> PathBuf {
    Program::c("fault_inject").build()
}

/// `fault_inject.c` as the preload object that arms the filter from its constructor.
fn arming_object() -> PathBuf {
    Program::c("fault_inject")
        .shared()
        .named("libfault_inject.so")
        .flags(&["-DFAULT_INJECT_AT_LOAD"])
        .build()
}

/// How a run ended, as the table shows it.
#[derive(Clone, PartialEq, Eq, Debug)]
struct Outcome {
    exit: String,
    stdout: String,
    stderr: String,
}

impl Outcome {
    fn survived(&self) -> bool {
        self.exit == "0"
    }

    /// The library's lines (`[tllm-affinity]`, src/log.rs); the program's own say `population:`.
    fn log_lines(&self) -> usize {
        self.stderr
            .lines()
            .filter(|l| l.starts_with("[tllm-affinity]"))
            .count()
    }
}

fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGILL => "SIGILL",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSYS => "SIGSYS",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGFPE => "SIGFPE",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

/// Runs `cmd` with stdin empty, its output in files (a pipe nobody reads could block it), in a
/// process group of its own that is killed past `limit`: a hang is an outcome ("hang"), not a
/// stuck test.
fn run(mut cmd: Command, limit: Duration) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("stdout");
    let err_path = dir.path().join("stderr");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: a signal to the process group this run made (its id is the child's pid); what the
    // program left behind in it goes too.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
    remove_table_left_by(child.id());
    let exit = match status {
        None => "hang".to_string(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(0), _) => "0".to_string(),
            (Some(code), _) => format!("exit {code}"),
            (None, Some(signal)) => signal_name(signal),
            _ => format!("{s}"),
        },
    };
    Outcome {
        exit,
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: String::from_utf8_lossy(&std::fs::read(&err_path).unwrap_or_default()).into_owned(),
    }
}

/// A run whose `unlink` failed leaves its thread table in /dev/shm; thousands of runs would pile
/// them up. Only a dead pid's, and only names the library gives (src/table/threadtable.rs).
fn remove_table_left_by(pid: u32) {
    // SAFETY: signal 0 only asks whether the pid exists.
    if unsafe { libc::kill(pid as i32, 0) } == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name.starts_with("tllm-affinity.")
            && name.ends_with(".threads")
            && name.split('.').nth(2) == Some(&pid.to_string());
        if ours {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Each of `jobs` through `work`, `PARALLEL` at a time, results in the jobs' order.
fn parallel<J: Sync, R: Send>(jobs: &[J], work: impl Fn(&J) -> R + Sync) -> Vec<R> {
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..PARALLEL {
            s.spawn(|| loop {
                let i = {
                    let mut next = next.lock().unwrap();
                    let i = *next;
                    *next += 1;
                    i
                };
                let Some(job) = jobs.get(i) else { break };
                let result = work(job);
                results.lock().unwrap()[i] = Some(result);
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// The population's command, with the library (on the simulated host, at the default log level:
/// a run without faults logs nothing, so every line is the fault's) or without.
fn population_command(program: &Path, with_library: bool, sysfs: &Sysfs) -> Command {
    let mut cmd = clean(program);
    if with_library {
        preload(&mut cmd, sysfs).env_remove("TLLM_AFFINITY_LOG");
    }
    cmd
}

/// This arch's system call numbers by name, from the kernel's headers as the C compiler sees
/// them (`__NR_openat 257`; aarch64's generic table defines some through another name,
/// `__NR_fcntl __NR3264_fcntl`).
fn syscall_numbers() -> Result<BTreeMap<String, u32>, String> {
    let out = Command::new("cc")
        .args(["-E", "-dM", "-x", "c", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"#include <sys/syscall.h>\n")?;
            child.wait_with_output()
        })
        .map_err(|e| format!("a C compiler for the system call numbers ({e})"))?;
    let defines: BTreeMap<String, String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut words = l.strip_prefix("#define ")?.split_whitespace();
            Some((words.next()?.to_string(), words.next()?.to_string()))
        })
        .collect();
    let resolve = |name: &String| {
        let mut value = name;
        for _ in 0..4 {
            if let Ok(n) = value.parse::<u32>() {
                return Some(n);
            }
            value = defines.get(value)?;
        }
        None
    };
    let numbers: BTreeMap<String, u32> = defines
        .keys()
        .filter_map(|name| {
            let call = name.strip_prefix("__NR_")?;
            Some((call.to_string(), resolve(name)?))
        })
        .collect();
    if numbers.contains_key("openat") {
        Ok(numbers)
    } else {
        Err("<sys/syscall.h> with __NR_ numbers".to_string())
    }
}

/// The calls one run of `cmd` makes, by name, as `strace -f -c` counts them.
fn calls_made(cmd: Command, what: &str) -> BTreeSet<String> {
    let dir = tempfile::tempdir().unwrap();
    let summary = dir.path().join("summary");
    let program = cmd.get_program().to_owned();
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let mut traced = Command::new("strace");
    traced
        .args(["-f", "-qq", "-c", "-o"])
        .arg(&summary)
        .arg("--")
        .arg(program)
        .args(args);
    for (name, value) in cmd.get_envs() {
        match value {
            Some(value) => traced.env(name, value),
            None => traced.env_remove(name),
        };
    }
    let end = run(traced, Duration::from_secs(60));
    assert!(end.survived(), "strace of {what}: {end:?}");
    let text = std::fs::read_to_string(&summary).unwrap();
    let calls: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('%') && !l.starts_with('-'))
        .filter_map(|l| l.split_whitespace().last())
        .filter(|name| *name != "total")
        .map(str::to_string)
        .collect();
    assert!(
        calls.contains("clone3") || calls.contains("clone"),
        "{text}"
    );
    calls
}

/// Calls left out, with the reason the doc gives: their failure is never returned to anything
/// that could go on (a failed exit loops in glibc until killed, with or without the library).
const NOT_INJECTED: &[&str] = &["exit", "exit_group", "rt_sigreturn"];

/// The errnos a call is made to fail with: EPERM (what a seccomp policy or an LSM gives any call)
/// and ENOSYS (a kernel or sandbox without the call) for every call, and those its man page lists
/// among the failures a running program meets: no memory, no descriptors, no space, try again.
fn errnos_of(call: &str) -> Vec<&'static str> {
    let extra: &[&str] = match call {
        "mmap" | "mprotect" | "munmap" | "mremap" | "brk" | "madvise" | "mlock" | "mincore" => {
            &["ENOMEM", "EAGAIN"]
        }
        "clone" | "clone3" | "fork" | "vfork" => &["ENOMEM", "EAGAIN"],
        "open" | "openat" | "openat2" | "creat" => &["ENOMEM", "EMFILE", "ENOSPC", "EAGAIN"],
        "dup" | "dup2" | "dup3" | "pipe" | "pipe2" | "socket" | "eventfd2" | "memfd_create"
        | "epoll_create1" | "inotify_init1" | "timerfd_create" | "accept" | "accept4" => {
            &["ENOMEM", "EMFILE"]
        }
        "fcntl" => &["EMFILE", "EAGAIN"],
        "write" | "pwrite64" | "writev" | "pwritev" | "pwritev2" => &["ENOSPC", "EAGAIN"],
        "read" | "pread64" | "readv" | "preadv" | "preadv2" => &["EAGAIN"],
        "fallocate" | "ftruncate" | "truncate" | "fsync" | "fdatasync" => &["ENOSPC"],
        "flock" => &["EAGAIN", "ENOLCK"],
        "futex" => &["EAGAIN"],
        "getrandom" => &["EAGAIN"],
        "access" | "faccessat" | "faccessat2" | "stat" | "fstat" | "lstat" | "newfstatat"
        | "statx" | "statfs" | "fstatfs" | "readlink" | "readlinkat" | "getdents64" | "getcwd"
        | "fchmod" | "fchmodat" => &["ENOMEM"],
        "unlink" | "unlinkat" | "rename" | "renameat" | "renameat2" | "mkdir" | "mkdirat"
        | "link" | "linkat" | "symlink" | "symlinkat" => &["ENOMEM", "ENOSPC"],
        "sched_setaffinity" | "sched_getaffinity" => &["EINVAL"],
        "set_mempolicy" | "mbind" | "get_mempolicy" | "move_pages" | "migrate_pages" => &["ENOMEM"],
        "prlimit64" | "getrlimit" | "setrlimit" => &["EINVAL"],
        _ => &[],
    };
    let mut errnos = vec!["EPERM", "ENOSYS"];
    errnos.extend_from_slice(extra);
    errnos
}

/// Where the filter goes in: before the exec, or after the loader (see the module's doc).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arm {
    Exec,
    Load,
}

fn errno_number(name: &str) -> i32 {
    match name {
        "EPERM" => libc::EPERM,
        "ENOSYS" => libc::ENOSYS,
        "ENOMEM" => libc::ENOMEM,
        "EMFILE" => libc::EMFILE,
        "ENOSPC" => libc::ENOSPC,
        "EAGAIN" => libc::EAGAIN,
        "ENOLCK" => libc::ENOLCK,
        "EINVAL" => libc::EINVAL,
        _ => panic!("no number for {name}"),
    }
}

/// The population with `call` failing with `errno` from `arm` on, with the library or without.
/// From the exec, the launcher itself runs under `LD_PRELOAD` too when the library is there, as
/// every wrapper of a launch does (its exec goes through the library's exec shim, under the
/// filter).
fn faulted(number: u32, errno: &str, arm: Arm, with_library: bool, sysfs: &Sysfs) -> Outcome {
    let errno = errno_number(errno).to_string();
    let cmd = match arm {
        Arm::Exec => {
            let mut cmd = population_command(&launcher(), with_library, sysfs);
            cmd.args([number.to_string(), errno, "--".to_string()])
                .arg(population());
            cmd
        }
        Arm::Load => {
            let mut cmd = population_command(&population(), with_library, sysfs);
            // Last in the list: its constructor runs first (the loader runs them in reverse).
            let objects = if with_library {
                format!("{} {}", library().display(), arming_object().display())
            } else {
                arming_object().display().to_string()
            };
            cmd.env("LD_PRELOAD", objects)
                .env("FAULT_INJECT", format!("{number} {errno}"));
            cmd
        }
    };
    run(cmd, RUN_LIMIT)
}

/// One (call, errno, arm): both runs, and what went wrong with the library.
struct Row {
    call: String,
    errno: &'static str,
    arm: Arm,
    without: Outcome,
    with: Outcome,
}

impl Row {
    /// Why the row breaks SPEC §9, or `None`: only a population that survived without the library
    /// is held to surviving with it.
    fn failure(&self) -> Option<String> {
        if !self.without.survived() {
            return None;
        }
        let mut why = Vec::new();
        if !self.with.survived() {
            why.push(format!("exit {} (without: 0)", self.with.exit));
        } else if self.with.stdout != self.without.stdout {
            why.push("another stdout".to_string());
        }
        if self.with.log_lines() > 1 {
            why.push(format!("{} log lines", self.with.log_lines()));
        }
        (!why.is_empty()).then(|| {
            format!(
                "{} {} ({:?}): {}\n--- without, stdout:\n{}--- with, stdout:\n{}--- with, stderr:\n{}",
                self.call,
                self.errno,
                self.arm,
                why.join(", "),
                self.without.stdout,
                self.with.stdout,
                self.with.stderr
            )
        })
    }
}

fn cell(outcome: &Outcome) -> String {
    outcome.exit.clone()
}

/// The generated section of docs/reliability.md: one row per (call, errno), both arms.
fn table(rows: &[Row], library_only: &BTreeSet<String>) -> String {
    let mut by_pair: BTreeMap<(&str, &str), [Option<&Row>; 2]> = BTreeMap::new();
    for row in rows {
        let slot = by_pair.entry((&row.call, row.errno)).or_default();
        slot[(row.arm == Arm::Load) as usize] = Some(row);
    }
    let calls: BTreeSet<&str> = rows.iter().map(|r| r.call.as_str()).collect();
    let compared = rows.iter().filter(|r| r.without.survived()).count();
    let mut text = format!(
        "{} calls, {} (call, errno) pairs, each injected at both points: {} runs with the \
         library and {} without; {} of the {} injections leave the population alive without \
         the library, and are held to the rule. Calls marked † are made only with the library.\n\n",
        calls.len(),
        by_pair.len(),
        rows.len(),
        rows.len(),
        compared,
        rows.len(),
    );
    text.push_str(
        "| call | errno | from exec: without | with | lines | after load: without | with | lines |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for ((call, errno), arms) in &by_pair {
        let mark = if library_only.contains(*call) {
            " †"
        } else {
            ""
        };
        text.push_str(&format!("| `{call}`{mark} | {errno} |"));
        for row in arms {
            match row {
                Some(r) => text.push_str(&format!(
                    " {} | {} | {} |",
                    cell(&r.without),
                    cell(&r.with),
                    r.with.log_lines()
                )),
                None => text.push_str(" – | – | – |"),
            }
        }
        text.push('\n');
    }
    text
}

fn doc_path() -> PathBuf {
    repo().join("docs/reliability.md")
}

/// The text between the markers of docs/reliability.md.
fn doc_section(doc: &str) -> Option<(usize, usize)> {
    let start = doc.find(BEGIN)? + BEGIN.len();
    let end = start + doc[start..].find(END)?;
    Some((start, end))
}

/// The calls the doc's table names, each as the first cell of a row.
fn calls_in_doc(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect()
}

/// Every call of the population (strace, with and without the library), plus every call the
/// doc's table names, with each errno that fits it, injected from the exec and after the load:
/// a population that survives without the library survives with it (exit 0, the same stdout,
/// at most one line). Its output names no mask or tid, so all of it must be equal. The table
/// goes to docs/reliability.md (`TLLM_AFFINITY_WRITE_DOCS=1`), or is compared with it.
#[test]
fn every_call_failing_with_every_errno_costs_what_it_costs_without_the_library() {
    require!(on_path("strace"), "strace (scripts/setup installs it)");
    let numbers = require!(syscall_numbers());
    let started = Instant::now();
    let sysfs = Sysfs::two_nodes();
    let (program, launcher, _) = (population(), launcher(), arming_object());
    let _ = (launcher, library());

    // The runs the faults are compared with: both exit 0 with the same stdout, and the library
    // says nothing, so every line in a faulted run is the fault's.
    let bare = run(population_command(&program, false, &sysfs), RUN_LIMIT);
    let preloaded = run(population_command(&program, true, &sysfs), RUN_LIMIT);
    assert!(
        bare.survived() && preloaded.survived(),
        "{bare:?}\n{preloaded:?}"
    );
    assert_eq!(bare.stdout, preloaded.stdout);
    assert_eq!(preloaded.log_lines(), 0, "{}", preloaded.stderr);
    assert!(
        preloaded.stderr.contains("configure -> 1"),
        "{}",
        preloaded.stderr
    );

    let without = calls_made(population_command(&program, false, &sysfs), "the bare run");
    let with = calls_made(
        population_command(&program, true, &sysfs),
        "the preloaded run",
    );
    let library_only: BTreeSet<String> = with.difference(&without).cloned().collect();
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    let documented = doc_section(&doc)
        .map(|(s, e)| calls_in_doc(&doc[s..e]))
        .unwrap_or_default();
    let calls: BTreeSet<String> = with
        .union(&without)
        .chain(&documented)
        .filter(|c| !NOT_INJECTED.contains(&c.as_str()))
        .cloned()
        .collect();
    let unknown: Vec<_> = calls.iter().filter(|c| !numbers.contains_key(*c)).collect();
    assert!(unknown.is_empty(), "no number for {unknown:?}");

    let jobs: Vec<(String, &'static str, Arm)> = calls
        .iter()
        .flat_map(|call| {
            errnos_of(call)
                .into_iter()
                .flat_map(move |errno| [Arm::Exec, Arm::Load].map(|arm| (call.clone(), errno, arm)))
        })
        .collect();
    let rows: Vec<Row> = parallel(&jobs, |(call, errno, arm)| {
        let number = numbers[call];
        let without = faulted(number, errno, *arm, false, &sysfs);
        let with = faulted(number, errno, *arm, true, &sysfs);
        Row {
            call: call.clone(),
            errno,
            arm: *arm,
            without,
            with,
        }
    });
    let failures: Vec<String> = rows.iter().filter_map(Row::failure).collect();
    let generated = table(&rows, &library_only);
    println!(
        "{} calls ({} only with the library: {library_only:?}), {} injections, {} runs in {:.0?}",
        calls.len(),
        library_only.len(),
        rows.len(),
        rows.len() * 2,
        started.elapsed()
    );
    println!("{generated}");

    if std::env::var("TLLM_AFFINITY_WRITE_DOCS").as_deref() == Ok("1") {
        let (start, end) =
            doc_section(&doc).expect("the fault-table markers in docs/reliability.md");
        let mut new_doc = doc.clone();
        new_doc.replace_range(start..end, &format!("\n{generated}"));
        std::fs::write(doc_path(), new_doc).unwrap();
    } else {
        check_doc(&doc, &generated, &calls);
    }
    assert!(
        failures.is_empty(),
        "{} of {} injections changed the outcome with the library:\n\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n\n")
    );
}

/// What the doc must agree with.
fn check_doc(doc: &str, generated: &str, tested: &BTreeSet<String>) {
    let (start, end) = doc_section(doc).expect("the fault-table markers in docs/reliability.md");
    let section = &doc[start..end];
    let documented = calls_in_doc(section);
    let missing: Vec<_> = tested.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "calls tested but not in docs/reliability.md's table: {missing:?}; \
         TLLM_AFFINITY_WRITE_DOCS=1 rewrites it"
    );
    assert_eq!(
        section.trim(),
        generated.trim(),
        "docs/reliability.md's fault table is not what was measured; \
         TLLM_AFFINITY_WRITE_DOCS=1 rewrites it"
    );
}

/// The population with `children` children, without the library and with it, each command made
/// by `wrap` from the population's: the bare run must exit 0 (else the scenario is wrong, not
/// the library), and the preloaded one the same, with the same stdout, within the bound, with at
/// most one line. Both outcomes, for what a test checks beyond.
fn survives_as_without(
    children: usize,
    limit: Duration,
    wrap: impl Fn(Command) -> Command,
) -> (Outcome, Outcome) {
    let sysfs = Sysfs::two_nodes();
    // A user other than root reads the simulated host too (tempfile makes it 0700).
    std::fs::set_permissions(
        sysfs.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let program = population();
    let outcome = |with_library| {
        let mut cmd = population_command(&program, with_library, &sysfs);
        cmd.arg(children.to_string());
        run(wrap(cmd), limit)
    };
    let without = outcome(false);
    assert!(without.survived(), "without the library: {without:?}");
    assert!(without.stdout.ends_with("done\n"), "{without:?}");
    let with = outcome(true);
    assert_eq!(with.exit, "0", "with the library: {with:?}");
    assert_eq!(
        with.stdout, without.stdout,
        "stderr with the library:\n{}",
        with.stderr
    );
    assert!(
        with.log_lines() <= 1,
        "more than one line:\n{}",
        with.stderr
    );
    assert!(
        with.stderr.contains("population: configure -> "),
        "the library's configure ran: {}",
        with.stderr
    );
    println!(
        "with the library: {} line(s)\n{}",
        with.log_lines(),
        with.stderr
    );
    (without, with)
}

/// `cmd` run by `sh -c "<setup> && exec CMD"` in a mount namespace of its own (`unshare -m`,
/// private propagation: nothing mounted there is seen outside), the library preloaded only into
/// `CMD` (the shell, `mount` and `dd` run bare).
fn in_mount_namespace(cmd: Command, setup: &str) -> Command {
    let mut wrapped = Command::new("unshare");
    wrapped
        .args(["-m", "--propagation", "private", "--", "sh", "-c"])
        .arg(format!(
            "set -e; {setup}; export LD_PRELOAD=\"$TIER_PRELOAD\"; exec \"$@\""
        ))
        .arg("sh")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (name, value) in cmd.get_envs() {
        let name = if name == "LD_PRELOAD" {
            std::ffi::OsStr::new("TIER_PRELOAD")
        } else {
            name
        };
        match value {
            Some(value) => wrapped.env(name, value),
            None => wrapped.env_remove(name),
        };
    }
    wrapped
}

/// For `require!`: root and `unshare`, which the tests that mount need.
fn mount_namespaces() -> Result<(), String> {
    if !root() {
        return Err("root (a mount namespace over /dev/shm)".to_string());
    }
    if !on_path("unshare") {
        return Err("unshare (util-linux, scripts/setup installs it)".to_string());
    }
    Ok(())
}

/// A `size=64k` tmpfs mounted at `dir` and filled to the last block.
fn full_tmpfs(dir: &str) -> String {
    format!(
        "mount -t tmpfs -o size=64k tmpfs {dir}; \
         dd if=/dev/zero of={dir}/fill bs=4k 2>/dev/null || true; \
         [ \"$(df --output=avail {dir} | tail -1 | tr -d ' ')\" = 0 ]"
    )
}

fn limited(mut cmd: Command, resource: libc::__rlimit_resource_t, limit: u64) -> Command {
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(move || {
            let value = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(resource, &value) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// `RLIMIT_NOFILE` 4: the three standard streams and one descriptor more. The loader opens one
/// object at a time; the library's reads of sysfs, `/proc` and its table meet `EMFILE`.
#[test]
fn four_descriptors_cost_what_they_cost_without_the_library() {
    survives_as_without(4, RUN_LIMIT, |cmd| limited(cmd, libc::RLIMIT_NOFILE, 4));
}

/// `RLIMIT_NPROC` reached, as a user that is not root (root ignores the limit): uid 56056, which
/// no account or process uses (setpriv needs no passwd entry), so its count of tasks is the
/// program's own. A limit of 5 is the main thread, the host, the worker and two children; the
/// third child's creation fails with `EAGAIN`, with and without the library (which starts no
/// thread of its own).
#[test]
fn a_users_task_limit_costs_what_it_costs_without_the_library() {
    require!(root(), "root (to run as another user)");
    require!(on_path("setpriv"), "setpriv (util-linux)");
    let (without, _) = survives_as_without(8, RUN_LIMIT, |cmd| {
        let mut wrapped = Command::new("setpriv");
        wrapped
            .args(["--reuid=56056", "--regid=56056", "--clear-groups", "--"])
            .arg(cmd.get_program())
            .args(cmd.get_args());
        for (name, value) in cmd.get_envs() {
            match value {
                Some(value) => wrapped.env(name, value),
                None => wrapped.env_remove(name),
            };
        }
        limited(wrapped, libc::RLIMIT_NPROC, 5)
    });
    assert!(
        without
            .stdout
            .contains("children: 2 created, 6 not (first: EAGAIN)"),
        "the limit was reached: {without:?}"
    );
}

/// `/dev/shm` mounted read-only: the thread table cannot be created; the table is what it costs.
#[test]
fn a_read_only_dev_shm_costs_the_table_only() {
    require!(mount_namespaces());
    survives_as_without(4, RUN_LIMIT, |cmd| {
        in_mount_namespace(cmd, "mount -t tmpfs -o ro,size=64k tmpfs /dev/shm")
    });
}

/// No `/dev/shm` directory (a file there, on a tmpfs over `/dev`), so the table goes to
/// `TLLM_AFFINITY_LOCK_DIR` (src/table/threadtable.rs `directory`), a tmpfs filled to its last block
/// before the start.
#[test]
fn a_full_lock_directory_costs_the_table_only() {
    require!(mount_namespaces());
    let lock_dir = tempfile::tempdir().unwrap();
    let dir = lock_dir.path().display().to_string();
    survives_as_without(4, RUN_LIMIT, |mut cmd| {
        cmd.env("TLLM_AFFINITY_LOCK_DIR", &dir);
        let setup = format!(
            "{}; mount -t tmpfs -o size=16k tmpfs /dev; touch /dev/shm; [ ! -d /dev/shm ]",
            full_tmpfs(&dir)
        );
        in_mount_namespace(cmd, &setup)
    });
}

/// 600 threads alive at once after `/dev/shm` was filled (a tiny tmpfs, full before the start):
/// the table never gets its pages, and no store reaches a page that is not there (no SIGBUS).
#[test]
fn six_hundred_threads_on_a_dev_shm_full_before_the_start() {
    require!(mount_namespaces());
    let (without, _) = survives_as_without(600, Duration::from_secs(60), |cmd| {
        in_mount_namespace(cmd, &full_tmpfs("/dev/shm"))
    });
    assert!(
        without.stdout.contains("children: 600 created, 0 not"),
        "{without:?}"
    );
}
