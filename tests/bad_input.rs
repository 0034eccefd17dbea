//! Bad input, table-driven: every library variable with malformed values, under
//! the real library, in a compiled C program (`lifecycle_scenarios exit 3`, which also makes a
//! thread and reports) and in `sh -c 'exit 3'`.
//!
//! Load-time variables: exactly one `[tllm-affinity]` line, naming the variable, the value (as
//! the line escapes it) and what was expected; the program runs on, with its own exit status;
//! the library is passive, except for a cosmetic variable (log level, strict, report path), which
//! falls back to its default while the library stays active. With TLLM_AFFINITY_STRICT=1: the
//! same line and exit status 2.
//! Configure-time variables (a well-formed TLLM_AFFINITY_GPU naming no GPU, the local rank, CUDA_VISIBLE_DEVICES,
//! CUDA_DEVICE_ORDER; a TLLM_AFFINITY_CPUS outside the cpuset): one line at configure naming the
//! variable and the value, configure returns -errno (or pins nothing), no mask changes, the exit
//! status is the program's own, STRICT or not (STRICT is about settings read at load).

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

/// The variables that only change what the library says: malformed, they fall back to their
/// default and the library stays active.
const COSMETIC: [&str; 3] = [
    "TLLM_AFFINITY_LOG",
    "TLLM_AFFINITY_STRICT",
    "TLLM_AFFINITY_REPORT",
];

fn life() -> std::path::PathBuf {
    Program::c("lifecycle_scenarios").build()
}

/// The `[tllm-affinity]` lines of a run's stderr.
fn library_lines(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| l.starts_with("[tllm-affinity]"))
        .map(str::to_string)
        .collect()
}

/// How the line shows a value: as `str::escape_debug` does (one line whatever the value holds).
fn shown(value: &str) -> String {
    value.escape_debug().to_string()
}

fn run(program: Command, vars: &[(&str, &str)], strict: bool) -> Finished {
    let mut cmd = program;
    cmd.envs(vars.iter().copied());
    if strict {
        cmd.env("TLLM_AFFINITY_STRICT", "1");
    }
    run_bounded(cmd, LIMIT)
}

fn c_program(sysfs: &Sysfs, args: &[&str]) -> Command {
    let mut cmd = preloaded(life(), sysfs);
    cmd.env("TLLM_AFFINITY_LOG", "warn").args(args);
    cmd
}

fn shell(sysfs: &Sysfs) -> Command {
    let mut cmd = preloaded("sh", sysfs);
    cmd.env("TLLM_AFFINITY_LOG", "warn").args(["-c", "exit 3"]);
    cmd
}

#[test]
fn malformed_load_time_variables_give_one_line_and_the_program_runs_on() {
    let sysfs = Sysfs::two_nodes();
    let long = "x".repeat(100_000);
    let file = tempfile::NamedTempFile::new().unwrap();
    let file = file.path().to_str().unwrap().to_string();
    let empty_dir = tempfile::tempdir().unwrap();
    let empty_dir = empty_dir.path().to_str().unwrap().to_string();
    // (variable, malformed value, a fragment of what the line says was expected)
    let cases: Vec<(&str, &str, &str)> = vec![
        ("TLLM_AFFINITY_POLICY", "fast", "auto, numa, clear, keep"),
        ("TLLM_AFFINITY_POLICY", "", "auto, numa, clear, keep"),
        (
            "TLLM_AFFINITY_POLICY",
            "numa,clear",
            "auto, numa, clear, keep",
        ),
        ("TLLM_AFFINITY_POLICY", "nu\nma", "auto, numa, clear, keep"),
        (
            "TLLM_AFFINITY_POLICY",
            "\u{1b}[31mred",
            "auto, numa, clear, keep",
        ),
        ("TLLM_AFFINITY_POLICY", &long, "auto, numa, clear, keep"),
        ("TLLM_AFFINITY_CPUS", "0-", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "", "non-empty cpulist"),
        ("TLLM_AFFINITY_CPUS", "a", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "3-1", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "1,,2", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "0-7:0", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "-1", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "0x3", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "0-99999999", "cpulist"),
        ("TLLM_AFFINITY_CPUS", "18446744073709551616", "cpulist"),
        (
            "TLLM_AFFINITY_SYSFS_ROOT",
            "/nonexistent/root",
            "directory holding sys/",
        ),
        ("TLLM_AFFINITY_SYSFS_ROOT", "", "directory holding sys/"),
        ("TLLM_AFFINITY_SYSFS_ROOT", &file, "directory holding sys/"),
        (
            "TLLM_AFFINITY_SYSFS_ROOT",
            &empty_dir,
            "directory holding sys/",
        ),
        ("TLLM_AFFINITY_PROCESS_ROLE", "boss", "host or worker"),
        ("TLLM_AFFINITY_PROCESS_ROLE", "1", "host or worker"),
        ("TLLM_AFFINITY_WORKER_LIBS", "libnccl[.so", "soname globs"),
        ("TLLM_AFFINITY_WORKER_LIBS", "libucp*.so*,[", "soname globs"),
        ("TLLM_AFFINITY_LOG", "loud", "off, error, warn, info, debug"),
        ("TLLM_AFFINITY_LOG", "3", "off, error, warn, info, debug"),
        ("TLLM_AFFINITY_REPORT", "", "file path"),
        (
            "TLLM_AFFINITY_REPORT",
            "/nonexistent/dir/report.json",
            "existing directory",
        ),
        ("TLLM_AFFINITY_REPORT", "/tmp", "file path"),
        (
            "TLLM_AFFINITY_STEP_CORE",
            "-3",
            "off, auto, or a CPU number",
        ),
        (
            "TLLM_AFFINITY_STEP_CORE",
            "fast",
            "off, auto, or a CPU number",
        ),
        (
            "TLLM_AFFINITY_STEP_CORE",
            "1.5",
            "off, auto, or a CPU number",
        ),
        (
            "TLLM_AFFINITY_STEP_CORE",
            "99999999999",
            "off, auto, or a CPU number",
        ),
        (
            "TLLM_AFFINITY_LOCK_DIR",
            "/nonexistent/dir",
            "existing directory",
        ),
        ("TLLM_AFFINITY_LOCK_DIR", "", "existing directory"),
        ("TLLM_AFFINITY_LOCK_DIR", &file, "existing directory"),
    ];
    let mut tried = 0;
    for (var, value, expected) in &cases {
        let vars = [(*var, *value)];
        let case = format!(
            "{var}={:?}",
            shown(value).chars().take(40).collect::<String>()
        );
        let relaxed = run(c_program(&sysfs, &["exit", "3"]), &vars, false);
        assert_eq!(relaxed.status.code(), Some(3), "{case}: {}", relaxed.stderr);
        let lines = library_lines(&relaxed.stderr);
        assert_eq!(
            lines.len(),
            1,
            "{case}: exactly one line:\n{}",
            relaxed.stderr
        );
        let line = &lines[0];
        let head = format!("{var}='{}' is not valid: expected ", shown(value));
        assert!(line.contains(&head), "{case}: {line}");
        assert!(line.contains(expected), "{case}: {line}");
        // Only settings that decide placement make the library passive; a cosmetic one falls
        // back to its default and the library stays active.
        let (says, state) = if COSMETIC.contains(var) {
            ("using its default", "active")
        } else {
            ("passive", "passive")
        };
        assert!(line.contains(says), "{case}: {line}");
        assert!(
            relaxed.stdout.contains(&format!("\"state\":\"{state}\"")),
            "{case}: the program ran on, the library {state}:\n{}",
            relaxed.stdout
        );

        let strict = run(c_program(&sysfs, &["exit", "3"]), &vars, true);
        assert_eq!(
            strict.status.code(),
            Some(2),
            "{case} strict: {}",
            strict.stderr
        );
        let strict_lines = library_lines(&strict.stderr);
        assert_eq!(strict_lines.len(), 1, "{case} strict:\n{}", strict.stderr);
        assert!(
            strict_lines[0].contains(&head),
            "{case}: {}",
            strict_lines[0]
        );
        assert!(strict_lines[0].contains(expected));
        assert!(!strict.stdout.contains("REPORT"), "stopped at load");

        let sh = run(shell(&sysfs), &vars, false);
        assert_eq!(sh.status.code(), Some(3), "{case} in sh");
        assert_eq!(
            library_lines(&sh.stderr).len(),
            1,
            "{case} in sh: {}",
            sh.stderr
        );
        let sh = run(shell(&sysfs), &vars, true);
        assert_eq!(sh.status.code(), Some(2), "{case} in sh, strict");
        tried += 1;
    }

    // TLLM_AFFINITY_STRICT itself: malformed means "not strict", so the status is the program's,
    // and the library stays active.
    for value in ["yes", "2", "true", " 1x"] {
        let end = run(
            c_program(&sysfs, &["exit", "3"]),
            &[("TLLM_AFFINITY_STRICT", value)],
            false,
        );
        assert_eq!(end.status.code(), Some(3));
        let lines = library_lines(&end.stderr);
        assert_eq!(lines.len(), 1, "{}", end.stderr);
        assert!(lines[0].contains(&format!("TLLM_AFFINITY_STRICT='{}'", shown(value))));
        assert!(lines[0].contains("1 or 0"), "{}", lines[0]);
        assert!(lines[0].contains("using its default"), "{}", lines[0]);
        assert!(
            end.stdout.contains("\"state\":\"active\""),
            "{}",
            end.stdout
        );
        tried += 1;
    }

    // A step core outside the process mask: one line naming the CPU and the mask; the library
    // stays active (the pin calls answer -EINVAL); STRICT stops with status 2.
    for strict in [false, true] {
        let end = run(
            c_program(&sysfs, &["exit", "3"]),
            &[("TLLM_AFFINITY_STEP_CORE", "1000")],
            strict,
        );
        assert_eq!(end.status.code(), Some(if strict { 2 } else { 3 }));
        let lines = library_lines(&end.stderr);
        assert_eq!(lines.len(), 1, "{}", end.stderr);
        assert!(
            lines[0].contains("TLLM_AFFINITY_STEP_CORE=1000"),
            "{}",
            lines[0]
        );
        assert!(lines[0].contains(&allowed_cpus().to_list()), "{}", lines[0]);
        tried += 1;
    }
    println!("bad input: {tried} malformed load-time values, each in C and sh, strict and not");
}

/// (variables, configure's device, configure's answer (0: a lease that pins nothing), the
/// variable the line must name, the value it must show)
type ConfigureCase<'a> = (Vec<(&'a str, &'a str)>, &'a str, i64, &'a str, &'a str);

#[test]
fn malformed_configure_time_variables_give_one_line_and_an_errno() {
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let cases: Vec<ConfigureCase> = vec![
        (
            vec![("TLLM_AFFINITY_GPU", "7")],
            "-1",
            -19,
            "TLLM_AFFINITY_GPU",
            "7",
        ),
        (
            vec![("TLLM_AFFINITY_GPU", "0000:99:00.0")],
            "-1",
            -19,
            "TLLM_AFFINITY_GPU",
            "0000:99:00.0",
        ),
        (vec![("LOCAL_RANK", "x")], "-1", -19, "LOCAL_RANK", "x"),
        (vec![("LOCAL_RANK", "-1")], "-1", -19, "LOCAL_RANK", "-1"),
        (
            vec![("CUDA_VISIBLE_DEVICES", "abc")],
            "0",
            -19,
            "CUDA_VISIBLE_DEVICES",
            "abc",
        ),
        (
            vec![("CUDA_VISIBLE_DEVICES", "")],
            "0",
            -19,
            "CUDA_VISIBLE_DEVICES",
            "''",
        ),
        (
            vec![("CUDA_VISIBLE_DEVICES", "5")],
            "0",
            -19,
            "CUDA_VISIBLE_DEVICES",
            "5",
        ),
        (
            vec![("CUDA_VISIBLE_DEVICES", "1")],
            "1",
            -19,
            "CUDA_VISIBLE_DEVICES",
            "1",
        ),
        (
            vec![("CUDA_VISIBLE_DEVICES", "GPU-0f1e2d3c")],
            "0",
            -19,
            "CUDA_VISIBLE_DEVICES",
            "GPU-0f1e2d3c",
        ),
        (
            vec![("CUDA_VISIBLE_DEVICES", "MIG-1/2/3")],
            "0",
            -19,
            "CUDA_VISIBLE_DEVICES",
            "MIG-1/2/3",
        ),
        (
            vec![("CUDA_DEVICE_ORDER", "FOO")],
            "0",
            -19,
            "CUDA_DEVICE_ORDER",
            "FOO",
        ),
        (
            vec![("CUDA_DEVICE_ORDER", "pci_bus_id")],
            "0",
            -19,
            "CUDA_DEVICE_ORDER",
            "pci_bus_id",
        ),
        (
            vec![("TLLM_AFFINITY_CPUS", "1000")],
            "0",
            0,
            "TLLM_AFFINITY_CPUS",
            "1000",
        ),
    ];
    let mut tried = 0;
    for (vars, device, answer, name, value) in &cases {
        for strict in [false, true] {
            let case = format!("{vars:?} configure({device}) strict={strict}");
            let end = run(c_program(&sysfs, &["exit", "3", device]), vars, strict);
            assert_eq!(end.status.code(), Some(3), "{case}: {}", end.stderr);
            let line = end
                .stdout
                .lines()
                .find(|l| l.starts_with("CONFIGURE main"))
                .unwrap_or_else(|| panic!("{case}: {}", end.stdout));
            let lease: i64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
            if *answer < 0 {
                assert_eq!(lease, *answer, "{case}: {line}");
            } else {
                assert!(lease > 0, "{case}: {line}");
            }
            assert_eq!(field(line, "mask"), all, "{case}: no mask changed");
            let lines = library_lines(&end.stderr);
            assert_eq!(lines.len(), 1, "{case}: one line\n{}", end.stderr);
            assert!(lines[0].contains(name), "{case}: {}", lines[0]);
            assert!(lines[0].contains(value), "{case}: {}", lines[0]);
            assert!(end.stdout.contains("\"state\":\"active\""), "{case}");
            tried += 1;
        }
    }
    println!("bad input: {tried} configure-time runs");
}

/// The calls program (`tests/programs/calls.c`): runs the library calls its arguments name.
fn calls() -> std::path::PathBuf {
    Program::c("calls").build()
}

/// A TLLM_AFFINITY_GPU that is neither a CUDA device number nor a PCI address is a bad setting
/// at load, like any other (SPEC §9): one line, passive, status 2 under STRICT, even in a
/// program that never configures and so never needs it.
#[test]
fn a_malformed_gpu_is_refused_at_load_even_when_nothing_needs_it() {
    let sysfs = Sysfs::two_nodes();
    let expected = "a CUDA device number (0, 1, ...) or a PCI address like 0000:3b:00.0";
    for value in ["zz:qq:00.0", "zz:zz", "banana", "-1", "0x1", "3b:00", "1.5"] {
        let vars = [("TLLM_AFFINITY_GPU", value)];
        let head = format!("TLLM_AFFINITY_GPU='{value}' is not valid: expected {expected}");
        for (what, program) in [
            ("C", c_program(&sysfs, &["exit", "3"])),
            ("sh", shell(&sysfs)),
        ] {
            let end = run(program, &vars, false);
            assert_eq!(
                end.status.code(),
                Some(3),
                "{value} in {what}: {}",
                end.stderr
            );
            let lines = library_lines(&end.stderr);
            assert_eq!(
                lines.len(),
                1,
                "{value} in {what}: one line\n{}",
                end.stderr
            );
            assert!(lines[0].contains(&head), "{value} in {what}: {}", lines[0]);
            assert!(
                lines[0].contains("passive"),
                "{value} in {what}: {}",
                lines[0]
            );
            if what == "C" {
                assert!(
                    end.stdout.contains("\"state\":\"passive\""),
                    "{value}: {}",
                    end.stdout
                );
            }
        }
        for program in [c_program(&sysfs, &["exit", "3"]), shell(&sysfs)] {
            let strict = run(program, &vars, true);
            assert_eq!(
                strict.status.code(),
                Some(2),
                "{value} strict: {}",
                strict.stderr
            );
            let lines = library_lines(&strict.stderr);
            assert_eq!(lines.len(), 1, "{value} strict:\n{}", strict.stderr);
            assert!(lines[0].contains(&head), "{value} strict: {}", lines[0]);
            assert!(!strict.stdout.contains("REPORT"), "stopped at load");
        }
    }
}

/// Every form SPEC §4 names still loads quietly under STRICT and picks its GPU at configure(-1):
/// an index (through visibility), a PCI address with or without its domain, in either case.
/// A blank value means unset.
#[test]
fn every_valid_gpu_form_is_accepted_at_load_and_used_by_configure() {
    let sysfs = Sysfs::two_nodes();
    // GPU 0 (0000:3b:00.0) is local to node1, GPU 1 (0000:86:00.0) to node0.
    let gpu0 = sysfs.gpu0_local().to_list();
    let gpu1 = sysfs.node0.to_list();
    let cases = [
        ("0", &gpu0),
        ("1", &gpu1),
        (" 1 ", &gpu1),
        ("0000:3b:00.0", &gpu0),
        ("3b:00.0", &gpu0),
        ("0000:86:00.0", &gpu1),
        ("86:00.0", &gpu1),
        ("0000:3B:00.0", &gpu0),
        ("", &gpu0),
    ];
    for (value, mask) in cases {
        let end = run(
            c_program(&sysfs, &["exit", "3", "-1"]),
            &[("TLLM_AFFINITY_GPU", value)],
            true,
        );
        assert_eq!(end.status.code(), Some(3), "{value:?}: {}", end.stderr);
        assert!(
            library_lines(&end.stderr).is_empty(),
            "{value:?}: no line\n{}",
            end.stderr
        );
        let line = end
            .stdout
            .lines()
            .find(|l| l.starts_with("CONFIGURE main"))
            .unwrap_or_else(|| panic!("{value:?}: {}", end.stdout));
        let lease: i64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!(lease > 0, "{value:?}: {line}");
        assert_eq!(&field(line, "mask"), mask, "{value:?}: {line}");
    }
}

/// A second configure whose worker set is empty changes nothing and says nothing new (SPEC §5):
/// the "no worker mask pinned" warning comes once per device; later ones are debug lines.
#[test]
fn a_repeated_empty_configure_warns_once() {
    let sysfs = Sysfs::two_nodes();
    for level in ["warn", "debug"] {
        let mut cmd = preloaded(calls(), &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", level)
            .env("TLLM_AFFINITY_CPUS", "1000")
            .args(["configure", "0", "configure", "0", "configure", "-1"]);
        let end = run_bounded(cmd, LIMIT);
        assert!(end.status.success(), "{level}: {}", end.stderr);
        let leases: Vec<i64> = end
            .stdout
            .lines()
            .filter_map(|l| l.strip_prefix("CONFIGURE "))
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(leases.len(), 3, "{level}: {}", end.stdout);
        assert!(leases.iter().all(|&l| l > 0), "{level}: {leases:?}");
        let said: Vec<String> = library_lines(&end.stderr)
            .into_iter()
            .filter(|l| l.contains("no worker mask pinned"))
            .collect();
        let warnings = said.iter().filter(|l| l.contains("warning:")).count();
        assert_eq!(warnings, 1, "{level}: one warning\n{}", end.stderr);
        assert!(said[0].contains("TLLM_AFFINITY_CPUS [1000]"), "{}", said[0]);
        if level == "debug" {
            assert_eq!(said.len(), 3, "later ones at debug\n{}", end.stderr);
        } else {
            assert_eq!(said.len(), 1, "{}", end.stderr);
        }
    }
}
