//! Bad input, table-driven: every library variable with malformed values, under
//! the real library, in a compiled C program (`lifecycle_scenarios exit 3`, which also makes a
//! thread and reports) and in `sh -c 'exit 3'`, checked the same way on every tier
//! (tests/process/bad_input.rs, tests/emulated/aarch64.rs).
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

use std::process::Command;
use std::time::Duration;

use super::tier::Tier;
use super::*;

const LIMIT: Duration = Duration::from_secs(30);

/// The variables that only change what the library says: malformed, they fall back to their
/// default and the library stays active.
const COSMETIC: [&str; 3] = [
    "TLLM_AFFINITY_LOG",
    "TLLM_AFFINITY_STRICT",
    "TLLM_AFFINITY_REPORT",
];

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

fn run(tier: &dyn Tier, program: Command, vars: &[(&str, &str)], strict: bool) -> Finished {
    let mut cmd = program;
    cmd.envs(vars.iter().copied());
    if strict {
        cmd.env("TLLM_AFFINITY_STRICT", "1");
    }
    run_bounded(cmd, tier.limit(LIMIT))
}

fn c_program(tier: &dyn Tier, sysfs: &Sysfs, args: &[&str]) -> Command {
    let mut cmd = tier.preloaded(&tier.program("lifecycle_scenarios"), sysfs);
    cmd.env("TLLM_AFFINITY_LOG", "warn").args(args);
    cmd
}

fn shell(tier: &dyn Tier, sysfs: &Sysfs) -> Command {
    let mut cmd = tier.preloaded(&tier.shell(), sysfs);
    cmd.env("TLLM_AFFINITY_LOG", "warn").args(["-c", "exit 3"]);
    cmd
}

/// A malformed `value` of `var`, refused at load in the C program and in `sh`, relaxed and
/// strict: the program's own status (3), or 2 under STRICT; exactly one line, saying
/// `<var>='<value>' is not valid: expected ` and `expected`; relaxed, that the library is passive
/// (or, for a cosmetic variable, uses its default and stays active), which the C program's report
/// shows; strict, stopped at load before any report.
fn refused_at_load(tier: &dyn Tier, sysfs: &Sysfs, var: &str, value: &str, expected: &str) {
    let vars = [(var, value)];
    let case = format!(
        "{var}={:?}",
        shown(value).chars().take(40).collect::<String>()
    );
    let head = format!("{var}='{}' is not valid: expected ", shown(value));
    // Only settings that decide placement make the library passive; a cosmetic one falls back
    // to its default and the library stays active.
    let (says, state) = if COSMETIC.contains(&var) {
        ("using its default", "active")
    } else {
        ("passive", "passive")
    };
    for (what, c) in [("C", true), ("sh", false)] {
        for strict in [false, true] {
            let program = if c {
                c_program(tier, sysfs, &["exit", "3"])
            } else {
                shell(tier, sysfs)
            };
            let case = format!("{case} in {what}{}", if strict { ", strict" } else { "" });
            let end = run(tier, program, &vars, strict);
            let status = if strict { 2 } else { 3 };
            assert_eq!(end.status.code(), Some(status), "{case}: {}", end.stderr);
            let lines = library_lines(&end.stderr);
            assert_eq!(lines.len(), 1, "{case}: exactly one line:\n{}", end.stderr);
            let line = &lines[0];
            assert!(line.contains(&head), "{case}: {line}");
            assert!(line.contains(expected), "{case}: {line}");
            if strict {
                assert!(!end.stdout.contains("REPORT"), "{case}: stopped at load");
                continue;
            }
            assert!(line.contains(says), "{case}: {line}");
            if c {
                assert!(
                    end.stdout.contains(&format!("\"state\":\"{state}\"")),
                    "{case}: the program ran on, the library {state}:\n{}",
                    end.stdout
                );
            }
        }
    }
}

/// Every load-time variable, malformed: see the module's documentation.
pub fn check_malformed_load_time_variables(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let long = "x".repeat(100_000);
    let file = tempfile::NamedTempFile::new().unwrap();
    let file = file.path().to_str().unwrap().to_string();
    let empty_dir = tempfile::tempdir().unwrap();
    let empty_dir = empty_dir.path().to_str().unwrap().to_string();
    let policies = "auto, numa, clear, keep";
    let root = "directory holding sys/";
    let step_core = "off, auto, or a CPU number";
    let log = "off, error, warn, info, debug";
    let dir = "existing directory";
    // (variable less its TLLM_AFFINITY_, a fragment of what the line says was expected, the
    // malformed values)
    let cases: Vec<(&str, &str, Vec<&str>)> = vec![
        ("POLICY", policies, vec!["fast", "", "numa,clear"]),
        ("POLICY", policies, vec!["nu\nma", "\u{1b}[31mred", &long]),
        ("CPUS", "cpulist", vec!["0-"]),
        ("CPUS", "non-empty cpulist", vec![""]),
        ("CPUS", "cpulist", vec!["a", "3-1", "1,,2", "0-7:0"]),
        ("CPUS", "cpulist", vec!["-1", "0x3", "0-99999999"]),
        ("CPUS", "cpulist", vec!["18446744073709551616"]),
        ("SYSFS_ROOT", root, vec!["/nonexistent/root", ""]),
        ("SYSFS_ROOT", root, vec![&file, &empty_dir]),
        ("PROCESS_ROLE", "host or worker", vec!["boss", "1"]),
        ("WORKER_LIBS", "soname globs", vec!["libnccl[.so"]),
        ("WORKER_LIBS", "soname globs", vec!["libucp*.so*,["]),
        ("LOG", log, vec!["loud", "3"]),
        ("REPORT", "file path", vec![""]),
        ("REPORT", dir, vec!["/nonexistent/dir/report.json"]),
        ("REPORT", "file path", vec!["/tmp"]),
        ("STEP_CORE", step_core, vec!["-3", "fast", "1.5"]),
        ("STEP_CORE", step_core, vec!["99999999999"]),
        ("LOCK_DIR", dir, vec!["/nonexistent/dir", "", &file]),
    ];
    let mut tried = 0;
    for (var, expected, values) in &cases {
        for value in values {
            refused_at_load(
                tier,
                &sysfs,
                &format!("TLLM_AFFINITY_{var}"),
                value,
                expected,
            );
            tried += 1;
        }
    }

    // TLLM_AFFINITY_STRICT itself: malformed means "not strict", so the status is the program's,
    // and the library stays active.
    for value in ["yes", "2", "true", " 1x"] {
        let end = run(
            tier,
            c_program(tier, &sysfs, &["exit", "3"]),
            &[("TLLM_AFFINITY_STRICT", value)],
            false,
        );
        assert_eq!(end.status.code(), Some(3));
        let lines = library_lines(&end.stderr);
        assert_eq!(lines.len(), 1, "{}", end.stderr);
        assert!(lines[0].contains(&format!("TLLM_AFFINITY_STRICT='{}'", shown(value))));
        assert!(lines[0].contains("1 or 0"), "{}", lines[0]);
        assert!(lines[0].contains("using its default"), "{}", lines[0]);
        says(&end.stdout, &["\"state\":\"active\""]);
        tried += 1;
    }

    // A step core outside the process mask: one line naming the CPU and the mask; the library
    // stays active (the pin calls answer -EINVAL); STRICT stops with status 2.
    for strict in [false, true] {
        let end = run(
            tier,
            c_program(tier, &sysfs, &["exit", "3"]),
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

/// The program's `CONFIGURE main <lease> ...` line and the lease it shows.
fn configure_line<'a>(end: &'a Finished, case: &str) -> (&'a str, i64) {
    let line = end
        .stdout
        .lines()
        .find(|l| l.starts_with("CONFIGURE main"))
        .unwrap_or_else(|| panic!("{case}: {}", end.stdout));
    let lease = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    (line, lease)
}

/// Every configure-time variable, malformed: see the module's documentation.
pub fn check_malformed_configure_time_variables(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let all = allowed_cpus().to_list();
    let (gpu, cvd, order) = (
        "TLLM_AFFINITY_GPU",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
    );
    // (variable, value, configure's device, configure's answer (0: a lease that pins nothing),
    // the value as the line shows it)
    let cases = [
        (gpu, "7", "-1", -19, "7"),
        (gpu, "0000:99:00.0", "-1", -19, "0000:99:00.0"),
        ("LOCAL_RANK", "x", "-1", -19, "x"),
        ("LOCAL_RANK", "-1", "-1", -19, "-1"),
        (cvd, "abc", "0", -19, "abc"),
        (cvd, "", "0", -19, "''"),
        (cvd, "5", "0", -19, "5"),
        (cvd, "1", "1", -19, "1"),
        (cvd, "GPU-0f1e2d3c", "0", -19, "GPU-0f1e2d3c"),
        (cvd, "MIG-1/2/3", "0", -19, "MIG-1/2/3"),
        (order, "FOO", "0", -19, "FOO"),
        (order, "pci_bus_id", "0", -19, "pci_bus_id"),
        ("TLLM_AFFINITY_CPUS", "1000", "0", 0, "1000"),
    ];
    let mut tried = 0;
    for (name, set, device, answer, value) in &cases {
        let vars = vec![(*name, *set)];
        for strict in [false, true] {
            let case = format!("{vars:?} configure({device}) strict={strict}");
            let end = run(
                tier,
                c_program(tier, &sysfs, &["exit", "3", device]),
                &vars,
                strict,
            );
            assert_eq!(end.status.code(), Some(3), "{case}: {}", end.stderr);
            let (line, lease) = configure_line(&end, &case);
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

/// A TLLM_AFFINITY_GPU that is neither a CUDA device number nor a PCI address is a bad setting
/// at load, like any other (SPEC §9): one line, passive, status 2 under STRICT, even in a
/// program that never configures and so never needs it.
pub fn check_malformed_gpu_refused_at_load(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    let expected = "expected a CUDA device number (0, 1, ...) or a PCI address like 0000:3b:00.0";
    for value in ["zz:qq:00.0", "zz:zz", "banana", "-1", "0x1", "3b:00", "1.5"] {
        refused_at_load(tier, &sysfs, "TLLM_AFFINITY_GPU", value, expected);
    }
}

/// Every form SPEC §4 names still loads quietly under STRICT and picks its GPU at configure(-1):
/// an index (through visibility), a PCI address with or without its domain, in either case.
/// A blank value means unset.
pub fn check_every_valid_gpu_form(tier: &dyn Tier) {
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
            tier,
            c_program(tier, &sysfs, &["exit", "3", "-1"]),
            &[("TLLM_AFFINITY_GPU", value)],
            true,
        );
        assert_eq!(end.status.code(), Some(3), "{value:?}: {}", end.stderr);
        assert!(
            library_lines(&end.stderr).is_empty(),
            "{value:?}: no line\n{}",
            end.stderr
        );
        let (line, lease) = configure_line(&end, &format!("{value:?}"));
        assert!(lease > 0, "{value:?}: {line}");
        assert_eq!(&field(line, "mask"), mask, "{value:?}: {line}");
    }
}

/// A second configure whose worker set is empty changes nothing and says nothing new (SPEC §5):
/// the "no worker mask pinned" warning comes once per device; later ones are debug lines.
/// The calls program (`tests/programs/calls.c`, which runs the library calls its arguments
/// name) configuring three times.
pub fn check_repeated_empty_configure(tier: &dyn Tier) {
    let sysfs = Sysfs::two_nodes();
    for level in ["warn", "debug"] {
        let mut cmd = tier.preloaded(&tier.program("calls"), &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", level)
            .env("TLLM_AFFINITY_CPUS", "1000")
            .args(["configure", "0", "configure", "0", "configure", "-1"]);
        let end = run_bounded(cmd, tier.limit(LIMIT));
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
