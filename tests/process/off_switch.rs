//! The off switch (SPEC §8): under `TLLM_AFFINITY_DISABLE=1` the library stays loaded and
//! inert. A C population that configures, spawns and releases ends with every mask as without the
//! library, publishes no thread table, takes no lock, and its C API answers `-ENOTSUP`; `ps PID`
//! says the library is disabled; `tllm-affinity run --disable` sets the switch; a malformed value
//! is one line and leaves the library on. (The Python side, upstream's own pin under the switch:
//! tests/process/zero_code.rs.)
//!
//! Simulated host (Sysfs::two_nodes): device 0's GPU is local to node 1.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;
use tllm_affinity_core::table::threadtable;

const ENOTSUP: i32 = 95;

/// tests/programs/population.c: configures on its worker thread, twice, spawns before, during
/// and after, releases.
fn population(mut cmd: Command) -> Command {
    cmd.env("FAKE_NCCL", Program::c("nccl").shared().build())
        .arg("0");
    cmd
}

/// Each phase's masks by thread name.
type Masks = Vec<(String, BTreeMap<String, String>)>;

fn masks(phases: &[Phase]) -> Masks {
    phases
        .iter()
        .map(|p| {
            let by_name = p
                .threads
                .iter()
                .map(|(name, t)| (name.clone(), t.mask.to_list()))
                .collect();
            (p.name.clone(), by_name)
        })
        .collect()
}

/// The table file process `pid` would publish.
fn table_file(pid: u32, dir: &Path) -> std::path::PathBuf {
    let namespace = threadtable::pid_namespace(Path::new(&format!("/proc/{pid}"))).unwrap();
    threadtable::directory(dir).join(threadtable::file_name(pid, namespace))
}

fn ps(pid: u32, json: bool) -> String {
    let mut cmd = clean(cli());
    cmd.args(["ps", &pid.to_string()]);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_population_under_the_off_switch_ends_as_without_the_library() {
    require!(two_cpus("a worker set narrower than the host"));
    let sysfs = Sysfs::two_nodes();
    let lock_dir = tempfile::tempdir().unwrap();

    let without = Driver::spawn(
        population(clean(Program::c("population").build())),
        DEADLINE,
    );
    let (upstream, end) = without.all_phases::<5>();
    assert!(end.status.success(), "{}", end.stderr);

    let mut cmd = population(preloaded(Program::c("population").build(), &sysfs));
    cmd.env("TLLM_AFFINITY_DISABLE", "1")
        .env("TLLM_AFFINITY_LOCK_DIR", lock_dir.path())
        .env("TLLM_AFFINITY_LOG", "debug");
    let mut run = Driver::spawn(cmd, DEADLINE);
    let pid = run.pid();
    let mut off = Vec::new();
    for i in 0..5 {
        if i > 0 {
            run.proceed();
        }
        off.push(run.phase());
        // While it runs (a table is removed at exit): no table file, nothing mapped.
        let file = table_file(pid, lock_dir.path());
        assert!(
            !file.exists(),
            "{}: a table file {}",
            off[i].name,
            file.display()
        );
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        assert!(
            maps.contains("libtllm_affinity"),
            "the library stays loaded"
        );
        assert!(!maps.contains("tllm-affinity."), "a table mapped:\n{maps}");
        if i == 1 {
            let text = ps(pid, false);
            assert!(
                text.contains("library loaded, disabled by TLLM_AFFINITY_DISABLE"),
                "{text}"
            );
            let json: Value = serde_json::from_str(&ps(pid, true)).unwrap();
            assert_eq!(json["disabled"], true, "{json}");
            assert_eq!(json["table"], false, "{json}");
            let note = json["note"].as_str().unwrap();
            assert!(
                note.contains("library loaded, disabled by TLLM_AFFINITY_DISABLE"),
                "{note}"
            );
        }
    }
    let end = run.finish();
    assert!(end.status.success(), "{}", end.stderr);

    assert_eq!(
        masks(&off),
        masks(&upstream),
        "every mask as without the library"
    );
    for phase in &off {
        for (name, t) in &phase.threads {
            assert_eq!(
                t.role, -ENOTSUP,
                "{} {name}: role answers -ENOTSUP",
                phase.name
            );
        }
    }
    let stderr = &end.stderr;
    assert!(stderr.contains("configure -> -95"), "{stderr}");
    assert!(stderr.contains("release -95 -> -95"), "{stderr}");
    assert!(
        !stderr.contains("[tllm-affinity]"),
        "not a word, even at debug:\n{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(lock_dir.path()).unwrap().collect();
    assert!(left.is_empty(), "no lock file, no table: {left:?}");
}

#[test]
fn run_disable_sets_the_switch_and_the_api_answers_enotsup() {
    let sysfs = Sysfs::two_nodes();
    let dry = clean(cli())
        .args(["run", "--disable", "--dry-run", "--json", "--", "true"])
        .output()
        .unwrap();
    assert!(dry.status.success(), "{dry:?}");
    let dry: Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(dry["env"]["TLLM_AFFINITY_DISABLE"], "1", "{dry}");
    assert!(dry["env"]["PYTHONPATH"].is_null(), "no hook to add: {dry}");

    let out = clean(cli())
        .arg("run")
        .arg("--sysfs-root")
        .arg(sysfs.path())
        .args(["--disable", "--"])
        .arg(Program::c("calls").build())
        .args(["configure", "0", "scope", "0", "step", "0", "thread"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for line in ["CONFIGURE -95", "SCOPE -95", "STEP -95", "THREAD 0"] {
        assert!(stdout.lines().any(|l| l == line), "{line}:\n{stdout}");
    }
}

#[test]
fn a_malformed_off_switch_is_one_line_and_leaves_the_library_on() {
    let sysfs = Sysfs::two_nodes();
    for value in ["yes", "true", "2"] {
        let mut cmd = preloaded(Program::c("calls").build(), &sysfs);
        cmd.env("TLLM_AFFINITY_DISABLE", value)
            .env("TLLM_AFFINITY_LOG", "warn")
            .args(["configure", "0", "thread"]);
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("[tllm-affinity]"))
            .collect();
        assert_eq!(lines.len(), 1, "{value}: one line:\n{stderr}");
        let line = lines[0];
        for text in [
            &format!("TLLM_AFFINITY_DISABLE='{value}' is not valid"),
            "expected 1",
            "or 0",
            "treated as not disabled",
        ] {
            assert!(line.contains(text), "{value}: {text}: {line}");
        }
        let lease: i64 = stdout
            .lines()
            .find_map(|l| l.strip_prefix("CONFIGURE "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(lease > 0, "{value}: the library stays on:\n{stdout}");
    }
}
