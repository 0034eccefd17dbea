//! The thread table is mapped lazily: a preloaded process that never creates a thread and never
//! calls the library (every short-lived shell under `tllm-affinity run`) creates no table file,
//! maps nothing and scans nothing; the first thread, configure, worker scope or pin maps it, as
//! does a dedicated worker's configure at load, and `tllm-affinity ps` then shows the roles.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;
use tllm_affinity_core::table::threadtable;

const LIMIT: Duration = Duration::from_secs(30);

fn calls() -> PathBuf {
    Program::c("calls").build()
}

/// What a waiting process shows of its table: the file, and whether it is in its maps.
struct Seen {
    file: bool,
    mapped: bool,
    ps: Value,
}

/// Runs `cmd` (which prints `WAIT <pid>` and waits on stdin), looks at its table and `ps`, then
/// lets it end; it must end well.
fn seen_while_waiting(mut cmd: Command, lock_dir: &Path) -> Seen {
    cmd.env("TLLM_AFFINITY_LOCK_DIR", lock_dir)
        .env("TLLM_AFFINITY_LOG", "warn");
    let mut run = Driver::spawn(cmd, LIMIT);
    let line = run.line("WAIT ");
    let pid: u32 = line["WAIT ".len()..].trim().parse().unwrap();
    assert_eq!(pid, run.pid(), "{line}");
    let name = threadtable::file_name(
        pid,
        threadtable::pid_namespace(Path::new(&format!("/proc/{pid}"))).unwrap(),
    );
    let file = threadtable::directory(lock_dir).join(&name).exists();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mapped = maps.contains(&name);
    let out = clean(cli())
        .args(["ps", &pid.to_string(), "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let ps: Value = serde_json::from_slice(&out.stdout).unwrap();
    let end = run.succeed();
    assert!(
        !end.stderr.contains("[tllm-affinity]"),
        "nothing to say: {}",
        end.stderr
    );
    Seen { file, mapped, ps }
}

#[test]
fn a_process_that_never_calls_the_library_maps_no_table() {
    let sysfs = Sysfs::two_nodes();
    let lock_dir = tempfile::tempdir().unwrap();
    let mut shell = preloaded("sh", &sysfs);
    shell.args(["-c", "echo WAIT $$; read go"]);
    let mut c = preloaded(calls(), &sysfs);
    c.arg("wait");
    for (what, cmd) in [("sh", shell), ("C", c)] {
        let seen = seen_while_waiting(cmd, lock_dir.path());
        assert!(!seen.file, "{what}: a table file at load");
        assert!(!seen.mapped, "{what}: a table mapped at load");
        assert_eq!(seen.ps["table"], false, "{what}: {}", seen.ps);
        let note = seen.ps["note"].as_str().unwrap_or_default();
        assert!(
            note.contains("loaded") && !note.contains("not loaded"),
            "{what}: ps says the library is loaded: {note}"
        );
    }
}

#[test]
fn the_first_thread_configure_scope_or_pin_maps_the_table() {
    let sysfs = Sysfs::two_nodes();
    let lock_dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str], &str); 5] = [
        ("a thread", &["thread", "wait"], "host"),
        ("configure", &["configure", "0", "wait"], "worker"),
        ("a worker scope", &["scope", "0", "wait"], "host"),
        ("a step pin", &["step", "0", "wait"], "host"),
        ("a dedicated worker", &["wait"], "worker"),
    ];
    for (what, args, main_role) in cases {
        let mut cmd = preloaded(calls(), &sysfs);
        cmd.args(args);
        if what == "a dedicated worker" {
            cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker");
        }
        if what == "a step pin" {
            cmd.env(
                "TLLM_AFFINITY_STEP_CORE",
                allowed_cpus().iter().next().unwrap().to_string(),
            );
        }
        let seen = seen_while_waiting(cmd, lock_dir.path());
        assert!(seen.file, "{what}: no table file");
        assert!(seen.mapped, "{what}: the table is not mapped");
        assert_eq!(seen.ps["table"], true, "{what}: {}", seen.ps);
        let main = row(&seen.ps, "threads", "tid", seen.ps["pid"].clone()).clone();
        assert_eq!(main["role"], main_role, "{what}: {}", seen.ps);
    }
}
