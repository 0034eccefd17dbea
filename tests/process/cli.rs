//! The `tllm-affinity` CLI against real processes: `ps` on a live Python process with
//! the library preloaded (roles from its thread table, masks exactly as the kernel reports them),
//! `run` preloading for real and passing exit statuses and signals through, and every `--json`
//! output parsing.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use common::*;
use serde_json::Value;

fn tllm_affinity(args: &[&str]) -> Command {
    let mut cmd = clean(cli());
    cmd.args(args);
    cmd
}

fn stdout_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs and parses stdout as one JSON document; the command must succeed.
fn json_of(cmd: &mut Command) -> Value {
    let out = succeeded(cmd);
    serde_json::from_str(&stdout_of(&out))
        .unwrap_or_else(|e| panic!("{e}: not JSON:\n{}", stdout_of(&out)))
}

/// `tllm-affinity <args>`'s JSON (see [`json_of`]).
fn json_from(args: &[&str]) -> Value {
    json_of(&mut tllm_affinity(args))
}

/// `py_ps_target.py` under the library: a host thread and a worker thread that configured for
/// device 0, waiting on stdin. Killed if a test fails before closing it.
struct Target {
    child: Child,
    info: Value,
    host: Sysfs,
}

impl Target {
    fn start() -> Target {
        let host = Sysfs::two_nodes();
        let mut child = clean(python())
            .arg(program("py_ps_target.py"))
            .env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_SYSFS_ROOT", host.path())
            .env("TLLM_AFFINITY_LOCK_DIR", host.path())
            .env("TLLM_AFFINITY_POLICY", "numa")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start python");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let info: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        Target { child, info, host }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn tid(&self, which: &str) -> i64 {
        self.info[which].as_i64().unwrap()
    }

    /// Closes stdin; the program releases its lease and exits.
    fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status:?}");
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn ps_shows_roles_from_the_table_and_the_kernels_masks() {
    let target = Target::start();
    let pid = target.pid();
    let v = json_from(&["ps", &pid.to_string(), "--json"]);
    assert_eq!(v["pid"], pid);
    assert_eq!(v["table"], true, "{v}");
    assert_eq!(v["note"], Value::Null);
    let threads = v["threads"].as_array().unwrap();
    let row = |tid: i64| {
        threads
            .iter()
            .find(|t| t["tid"] == tid)
            .unwrap_or_else(|| panic!("tid {tid} not in {v}"))
    };
    let (main, host, worker) = (target.tid("main"), target.tid("host"), target.tid("worker"));
    assert_eq!(row(main)["role"], "host");
    assert_eq!(row(main)["placement"], "inherited");
    assert_eq!(row(host)["role"], "host");
    assert_eq!(row(host)["name"], "tllm-host");
    assert_eq!(row(worker)["role"], "worker");
    assert_eq!(row(worker)["placement"], "worker");
    assert_eq!(row(worker)["name"], "tllm-worker");
    // Exactly what the kernel reports, thread by thread.
    for t in threads {
        let tid = t["tid"].as_i64().unwrap();
        assert_eq!(
            t["mask"],
            kernel_mask(pid, tid as i32).to_list(),
            "thread {tid}"
        );
    }
    let local = target.host.gpu0_local().clone();
    assert_eq!(mask(row(worker)["mask"].as_str().unwrap()), local);
    assert_eq!(mask(row(host)["mask"].as_str().unwrap()), allowed_cpus());

    // The text: one grid row per thread, a mark on each CPU it may run on.
    let out = tllm_affinity(&["ps", &pid.to_string(), "--no-color"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    assert!(!text.contains('\x1b'), "{text}");
    let cpus = mask(v["cpus"].as_str().unwrap());
    let grid = |allowed: &tllm_affinity_core::mask::CpuMask, letter: char| -> String {
        cpus.iter()
            .map(|c| if allowed.contains(c) { letter } else { '.' })
            .collect()
    };
    let line_of = |tid: i64| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(&tid.to_string()))
            .unwrap_or_else(|| panic!("no row for {tid}:\n{text}"))
    };
    assert!(line_of(worker).ends_with(&grid(&local, 'w')), "{text}");
    assert!(
        line_of(host).ends_with(&grid(&allowed_cpus(), 'h')),
        "{text}"
    );
    assert!(line_of(worker).contains(" worker "), "{text}");
    says(&text, &["legend:"]);
    // Piped stdout gets no colour even without --no-color.
    let plain = tllm_affinity(&["ps", &pid.to_string()]).output().unwrap();
    assert!(!stdout_of(&plain).contains('\x1b'));
    println!("$ tllm-affinity ps {pid}\n{text}");
    // Its memory per node, beside the grid: the host's one node holds it all.
    says(&text, &["memory per node: node 0 "]);
    let resident = &v["memory"]["bytes_per_node"]["0"];
    assert!(resident.as_u64().is_some_and(|b| b > 0), "{v}");
    target.finish();
}

/// `numa_maps` is readable only by who may trace the process: another user's `ps` gets one line
/// saying so, and the threads all the same.
#[test]
fn ps_without_access_to_the_memory_says_so_and_still_shows_the_threads() {
    if !root() {
        return missing("root (to run ps as another user against this user's process)");
    }
    let target = Target::start();
    let pid = target.pid().to_string();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(cli())
        .args(["ps", &pid, "--no-color"])
        .output()
        .unwrap();
    let text = stdout_of(&out);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let line = text
        .lines()
        .find(|l| l.starts_with("memory per node: "))
        .unwrap_or_else(|| panic!("no memory line:\n{text}"));
    assert!(
        line.starts_with("memory per node: not readable (") && line.contains("numa_maps"),
        "{line}"
    );
    let worker = target.tid("worker").to_string();
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().next() == Some(worker.as_str())),
        "{text}"
    );
    target.finish();
}

#[test]
fn ps_of_a_process_without_the_library_says_so() {
    let me = std::process::id().to_string();
    let v = json_from(&["ps", &me, "--json"]);
    assert_eq!(v["table"], false);
    assert!(v["note"].as_str().unwrap().contains("not loaded"), "{v}");
    for t in v["threads"].as_array().unwrap() {
        assert_eq!(t["role"], "unknown");
        assert_eq!(t["placement"], "unknown");
    }
    let out = tllm_affinity(&["ps", &me]).output().unwrap();
    let text = stdout_of(&out);
    assert_eq!(
        text.lines().filter(|l| l.starts_with("note:")).count(),
        1,
        "{text}"
    );
    let out = tllm_affinity(&["ps", "999999999"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).starts_with("tllm-affinity ps: no process 999999999"));
    assert_eq!(stderr_of(&out).lines().count(), 1);
}

#[test]
fn run_passes_the_exit_status_through() {
    let out = tllm_affinity(&["run", "--", "sh", "-c", "exit 7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let out = tllm_affinity(&["run", "--simulate", "--", "sh", "-c", "exit 7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let out = tllm_affinity(&["run", "--", "/nonexistent/program"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("cannot run '/nonexistent/program'"));
}

#[test]
fn run_passes_a_signal_through() {
    // exec: the program is the process, so the process dies of the signal itself.
    let out = tllm_affinity(&["run", "--", "sh", "-c", "kill -TERM $$"])
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{:?}", out.status);
    // --simulate execs too: the program is the process.
    let out = tllm_affinity(&["run", "--simulate", "--", "sh", "-c", "kill -TERM $$"])
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{:?}", out.status);
}

#[test]
fn run_simulate_is_the_program_so_a_signal_sent_to_it_ends_the_program() {
    let mut child = tllm_affinity(&[
        "run",
        "--simulate",
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 30",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    // SAFETY: kill with a pid we own and a valid signal number.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
}

const SHOW_ENV: &str = "import json, os, tllm_affinity; print(json.dumps({\
    'available': tllm_affinity.available(), \
    'role': tllm_affinity.role() if tllm_affinity.available() else None, \
    'env': {k: v for k, v in os.environ.items() if k.startswith('TLLM_') or k == 'LD_PRELOAD'}}))";

#[test]
fn run_preloads_the_library_and_sets_the_variables() {
    let python = python().to_str().unwrap().to_string();
    let reports = tempfile::tempdir().unwrap();
    let report = reports.path().join("r.json");
    let v = json_from(&[
        "run",
        "--policy",
        "numa",
        "--cpus",
        "0",
        "--log",
        "error",
        "--step-core",
        "off",
        "--slice",
        "gpu",
        "--process-role",
        "host",
        "--worker-libs",
        "libnccl*.so*",
        "--gpu",
        "3b:00.0",
        "--report",
        report.to_str().unwrap(),
        "--strict",
        "--",
        &python,
        "-c",
        SHOW_ENV,
    ]);
    assert_eq!(v["available"], true, "{v}");
    assert_eq!(v["role"], "host");
    let env = &v["env"];
    assert_eq!(env["LD_PRELOAD"], library().to_str().unwrap());
    assert_eq!(env["TLLM_AFFINITY_POLICY"], "numa");
    assert_eq!(env["TLLM_AFFINITY_CPUS"], "0");
    assert_eq!(env["TLLM_AFFINITY_LOG"], "error");
    assert_eq!(env["TLLM_AFFINITY_STEP_CORE"], "off");
    assert_eq!(env["TLLM_AFFINITY_SLICE"], "gpu");
    assert_eq!(env["TLLM_AFFINITY_PROCESS_ROLE"], "host");
    assert_eq!(env["TLLM_AFFINITY_WORKER_LIBS"], "libnccl*.so*");
    assert_eq!(env["TLLM_AFFINITY_GPU"], "0000:3b:00.0");
    assert_eq!(env["TLLM_AFFINITY_REPORT"], report.to_str().unwrap());
    assert_eq!(env["TLLM_AFFINITY_STRICT"], "1");
    // The library wrote its report at exit: it really ran in the child.
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(written["state"], "active");

    // Already preloaded: not listed twice; other preloads are kept after it.
    let lib = library();
    let v = json_of(tllm_affinity(&["run", "--", &python, "-c", SHOW_ENV]).env("LD_PRELOAD", &lib));
    assert_eq!(v["env"]["LD_PRELOAD"], lib.to_str().unwrap());
    let v = json_of(
        tllm_affinity(&["run", "--dry-run", "--json", "--", "true"])
            .env("LD_PRELOAD", format!("/opt/other.so {}", lib.display())),
    );
    assert_eq!(
        v["env"]["LD_PRELOAD"],
        format!("{}:/opt/other.so", lib.display())
    );
    assert_eq!(v["exec"], true);
    assert_eq!(v["command"], serde_json::json!(["true"]));
}

#[test]
fn run_simulate_gives_a_worker_the_simulated_gpus_cpus_from_one_cached_tree() {
    let python = python().to_str().unwrap().to_string();
    let code = "import json, os, threading, tllm_affinity\n\
        root = os.environ['TLLM_AFFINITY_SYSFS_ROOT']\n\
        out = {'root': root, 'exists': os.path.isdir(root + '/sys/bus/pci/devices')}\n\
        def w():\n    \
            lease = tllm_affinity.configure(0)\n    \
            out['lease'] = lease.id\n    \
            out['mask'] = sorted(os.sched_getaffinity(0))\n\
        t = threading.Thread(target=w); t.start(); t.join()\n\
        out['main'] = sorted(os.sched_getaffinity(0))\n\
        print(json.dumps(out))";
    let cache = tempfile::tempdir().unwrap();
    let run = || {
        tllm_affinity(&[
            "run",
            "--simulate",
            "--policy",
            "numa",
            "--",
            &python,
            "-c",
            code,
        ])
        .env("XDG_CACHE_HOME", cache.path())
        .output()
        .unwrap()
    };
    let out = run();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("--simulate: simulated host"),
        "{}",
        stderr_of(&out)
    );
    let v: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(v["exists"], true);
    assert!(v["lease"].as_i64().unwrap() > 0);
    let root = Path::new(v["root"].as_str().unwrap());
    assert!(
        root.starts_with(cache.path().join("tllm-affinity")),
        "{}",
        root.display()
    );
    // Kept in the cache, and found there by the next run rather than written again.
    let second: Value = serde_json::from_str(&stdout_of(&run())).unwrap();
    assert_eq!(second["root"], v["root"]);
    let entries = std::fs::read_dir(cache.path().join("tllm-affinity"))
        .unwrap()
        .count();
    assert_eq!(entries, 1, "one tree, no partial copies left");
    // The same tree the tests write: device 0 is local to the upper half of this process's CPUs.
    let sim = Sysfs::two_nodes();
    assert_eq!(mask_of(&v["mask"]), sim.gpu0_local());
    assert_eq!(mask_of(&v["main"]), allowed_cpus());
}

#[test]
fn run_refuses_bad_options_with_one_line() {
    for (args, names) in [
        (vec!["--cpus", "0-"], "TLLM_AFFINITY_CPUS"),
        (vec!["--step-core", "fast"], "TLLM_AFFINITY_STEP_CORE"),
        (vec!["--gpu", "gpu0"], "--gpu"),
        (
            vec!["--sysfs-root", "/nonexistent/dir"],
            "TLLM_AFFINITY_SYSFS_ROOT",
        ),
    ] {
        let mut full = vec!["run"];
        full.extend(args.iter().copied());
        full.extend(["--", "true"]);
        let out = tllm_affinity(&full).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr_of(&out);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("tllm-affinity run: ") && err.contains(names),
            "{err}"
        );
    }
    let out = tllm_affinity(&["run", "--", "true"])
        .env("TLLM_AFFINITY_LIB", "/nonexistent/libtllm_affinity.so")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("TLLM_AFFINITY_LIB"));
}

#[test]
fn every_json_output_parses() {
    let sim = Sysfs::two_nodes();
    let root = sim.path().to_str().unwrap();

    let topo = json_from(&["topo", "--json"]);
    assert_eq!(
        mask(topo["online"].as_str().unwrap()).count(),
        topo["cpus"].as_array().unwrap().len()
    );
    assert_eq!(topo["cgroup"]["note"], Value::Null);

    let topo = json_from(&["topo", "--json", "--sysfs-root", root]);
    assert_eq!(topo["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(topo["gpus"][0]["address"], "0000:3b:00.0");
    assert_eq!(topo["gpus"][0]["local_cpus"], sim.gpu0_local().to_list());
    assert!(topo["cgroup"]["note"]
        .as_str()
        .unwrap()
        .contains("real one"));

    let plan = json_from(&["plan", "--gpu", "0", "--json", "--sysfs-root", root]);
    assert_eq!(plan["gpu"]["address"], "0000:3b:00.0");
    assert_eq!(plan["worker"]["cpus"], sim.gpu0_local().to_list());

    let probe = json_from(&["probe", "--json", "--rounds", "5"]);
    assert!(probe.is_object());

    let ps = json_from(&["ps", &std::process::id().to_string(), "--json"]);
    assert!(ps["threads"].is_array());

    let dry = json_from(&["run", "--simulate", "--dry-run", "--json", "--", "true"]);
    assert_eq!(dry["simulate"], true);
    assert_eq!(dry["exec"], true);

    // A subcommand error under --json: one JSON line naming the subcommand, status 2.
    let out = tllm_affinity(&["plan", "--gpu", "9", "--json", "--sysfs-root", root])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = stderr_of(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    let error: Value = serde_json::from_str(&err).unwrap_or_else(|e| panic!("{e}: {err}"));
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .starts_with("tllm-affinity plan: "),
        "{err}"
    );
}

/// The first bytes each command writes meet a pipe whose reader is gone, as in `ps PID | head`
/// once head has its lines: the command ends quietly, killed by SIGPIPE as coreutils are, with
/// no panic and no backtrace.
#[test]
fn a_closed_pipe_ends_ps_and_topo_quietly() {
    let sim = Sysfs::two_nodes();
    let me = std::process::id().to_string();
    let root = sim.path().to_str().unwrap();
    for args in [
        vec!["ps", me.as_str(), "--no-color"],
        vec!["topo"],
        vec!["topo", "--sysfs-root", root],
        vec!["plan", "--gpu", "0", "--sysfs-root", root],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = tllm_affinity(&args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = stderr_of(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err, "", "{args:?}: nothing on stderr");
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "{args:?}: {:?}",
            out.status
        );
    }
}

#[test]
fn run_simulate_refuses_a_shared_cache_directory_that_others_may_write() {
    let tmp = tempfile::tempdir().unwrap();
    let uid = tllm_affinity_core::sys::effective_uid();
    let planted = tmp.path().join(format!("tllm-affinity-{uid}"));
    std::fs::create_dir(&planted).unwrap();
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = tllm_affinity(&["run", "--simulate", "--", "true"])
        .env_remove("XDG_CACHE_HOME")
        .env_remove("HOME")
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    says(&err, &["not a private directory"]);
    assert_eq!(std::fs::read_dir(&planted).unwrap().count(), 0);
}

#[test]
fn run_simulate_dry_run_json_names_the_sysfs_root() {
    let dry = json_from(&["run", "--simulate", "--dry-run", "--json", "--", "true"]);
    let root = dry["env"]["TLLM_AFFINITY_SYSFS_ROOT"].as_str();
    assert!(root.is_some_and(|r| r.contains("simulated host")), "{dry}");
    // The text form says the same.
    let out = tllm_affinity(&["run", "--simulate", "--dry-run", "--", "true"])
        .output()
        .unwrap();
    assert!(stdout_of(&out).contains("TLLM_AFFINITY_SYSFS_ROOT="));
}

#[test]
fn errors_under_json_are_json_on_stderr_with_the_same_status() {
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["run", "--json", "--cpus", "0-", "--", "true"], 2),
        (vec!["run", "--json", "--", "/nonexistent/program"], 127),
        (vec!["ps", "999999999", "--json"], 2),
        (vec!["topo", "--json", "--sysfs-root", "/nonexistent"], 2),
        (vec!["simulate", "/proc/self", "--json"], 2),
    ];
    for (args, status) in cases {
        let out = tllm_affinity(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(status), "{args:?}");
        let err = stderr_of(&out);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        let v: Value =
            serde_json::from_str(&err).unwrap_or_else(|e| panic!("{args:?}: {e}: {err}"));
        let message = v["error"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(&format!("tllm-affinity {}: ", args[0])),
            "{args:?}: {err}"
        );
        // Without --json the same failure is plain text with the same status.
        let plain: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
        let out = tllm_affinity(&plain).output().unwrap();
        assert_eq!(out.status.code(), Some(status), "{plain:?}");
        assert!(stderr_of(&out).starts_with("tllm-affinity "), "{plain:?}");
    }
}

#[test]
fn simulate_writes_a_reusable_tree_and_prints_the_variable_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("sim");
    let out = tllm_affinity(&["simulate", tree.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    let line = text.lines().last().unwrap_or_default();
    let root = line
        .strip_prefix("TLLM_AFFINITY_SYSFS_ROOT=")
        .unwrap_or_else(|| panic!("no variable line: {text}"));
    assert_eq!(Path::new(root), tree.canonicalize().unwrap());
    // Written again over itself: fine. Into a directory holding other files: refused.
    assert!(tllm_affinity(&["simulate", root])
        .status()
        .unwrap()
        .success());
    let busy = dir.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("notes.txt"), "mine").unwrap();
    let out = tllm_affinity(&["simulate", busy.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));

    // The tree stays: topo, plan and a plain LD_PRELOAD read it.
    let topo = json_from(&["topo", "--json", "--sysfs-root", root]);
    assert_eq!(topo["gpus"].as_array().unwrap().len(), 2);
    let code = "import json, os, threading, tllm_affinity\n\
        out = {}\n\
        def w():\n    \
            tllm_affinity.configure(0)\n    \
            out['mask'] = sorted(os.sched_getaffinity(0))\n\
        t = threading.Thread(target=w); t.start(); t.join()\n\
        print(json.dumps(out))";
    let v = json_of(
        clean(python())
            .args(["-c", code])
            .env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_SYSFS_ROOT", root)
            .env("TLLM_AFFINITY_POLICY", "numa"),
    );
    let sim = Sysfs::two_nodes();
    assert_eq!(mask_of(&v["mask"]), sim.gpu0_local());
}

/// A copy of the simulated tree with its GPUs taken out: a host without a GPU.
fn gpu_less_tree() -> tempfile::TempDir {
    let sim = Sysfs::two_nodes();
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new("cp")
        .args(["-a", &format!("{}/.", sim.path().display())])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    let devices = dir.path().join("sys/bus/pci/devices");
    for entry in std::fs::read_dir(&devices).unwrap() {
        let path = entry.unwrap().path();
        let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
    }
    dir
}

#[test]
fn a_host_without_a_gpu_hints_at_the_simulated_tree() {
    let tree = gpu_less_tree();
    let root = tree.path().to_str().unwrap();
    let wants = [
        "no GPU found",
        "--simulate",
        "tllm-affinity simulate DIR",
        "--sysfs-root",
    ];
    let out = tllm_affinity(&["plan", "--gpu", "0", "--sysfs-root", root])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = stderr_of(&out);
    for want in wants {
        assert!(err.contains(want), "plan: missing {want:?}: {err}");
    }
    let out = tllm_affinity(&["topo", "--sysfs-root", root])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = stdout_of(&out);
    for want in wants {
        assert!(text.contains(want), "topo: missing {want:?}: {text}");
    }
    let topo = json_from(&["topo", "--json", "--sysfs-root", root]);
    assert!(topo["hint"].as_str().unwrap().contains("no GPU found"));
}

#[test]
fn worker_libs_help_says_a_plain_list_replaces_and_a_plus_adds() {
    let out = tllm_affinity(&["run", "--help"]).output().unwrap();
    let help = stdout_of(&out)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    says(
        &help,
        &[
            "A plain list replaces the default list",
            "a leading + adds to it",
        ],
    );
    let dry = json_from(&[
        "run",
        "--worker-libs",
        "+libmy_transport*.so*",
        "--dry-run",
        "--json",
        "--",
        "true",
    ]);
    assert_eq!(
        dry["env"]["TLLM_AFFINITY_WORKER_LIBS"],
        "+libmy_transport*.so*"
    );
}

/// `--cpus` naming no CPU this process may use: said at `run`, and by the library at configure
/// under the variable's name, never as "the GPU-local CPUs".
#[test]
fn cpus_outside_the_allowed_cpus_are_called_by_their_name() {
    let out = tllm_affinity(&["run", "--cpus", "4000", "--dry-run", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = stderr_of(&out);
    says(&err, &["--cpus 4000 names no CPU this process may use"]);
    let sim = Sysfs::two_nodes();
    let code = "import threading, tllm_affinity\n\
        t = threading.Thread(target=lambda: tllm_affinity.configure(0)); t.start(); t.join()";
    let out = clean(python())
        .args(["-c", code])
        .env("LD_PRELOAD", library())
        .env("TLLM_AFFINITY_SYSFS_ROOT", sim.path())
        .env("TLLM_AFFINITY_CPUS", "4000")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    says(&err, &["TLLM_AFFINITY_CPUS [4000] names no CPU"]);
    never_says(&err, &["GPU-local"]);
}

/// The report written at exit, after the last release put every mask back, still says what the
/// process did: how many workers it had at most, the leases, the threads restored.
#[test]
fn the_report_at_exit_records_what_the_process_did() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    // Python's join returns before the OS thread has finished exiting (and before the library's
    // exit bookkeeping ran in it): wait until the kernel lists the main thread alone.
    let code = "import os, threading, time, tllm_affinity\n\
        def pool():\n    time.sleep(0.05)\n\
        def w():\n    \
            with tllm_affinity.worker(0):\n        \
                ts = [threading.Thread(target=pool) for _ in range(3)]\n        \
                [t.start() for t in ts]; [t.join() for t in ts]\n\
        t = threading.Thread(target=w); t.start(); t.join()\n\
        while len(os.listdir('/proc/self/task')) > 1: time.sleep(0.01)";
    let python = python().to_str().unwrap().to_string();
    let out = tllm_affinity(&[
        "run",
        "--simulate",
        "--policy",
        "numa",
        "--report",
        report.to_str().unwrap(),
        "--",
        &python,
        "-c",
        code,
    ])
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(v["workers"], 0, "nothing is a worker at exit: {v}");
    assert_eq!(v["peak_workers"], 4, "{v}");
    assert_eq!(v["leases_opened"], 1, "{v}");
    assert_eq!(v["leases_released"], 1, "{v}");
    assert!(v["threads_restored"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["threads_preserved"], 0, "{v}");
}

#[test]
fn topo_text_shows_nodes_cores_gpus_cgroup_and_idle_states() {
    let sim = Sysfs::two_nodes();
    let out = tllm_affinity(&["topo", "--sysfs-root", sim.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    for section in [
        "NUMA nodes:",
        "cores and SMT siblings:",
        "GPUs (PCI order):",
        "cgroup (",
        "cpuidle states",
        "0000:3b:00.0",
        "the cgroup is this machine's real one",
    ] {
        assert!(text.contains(section), "{section}:\n{text}");
    }
    let mut stdout = std::io::stdout();
    let _ = writeln!(
        stdout,
        "$ tllm-affinity topo --sysfs-root <simulated>\n{text}"
    );
}

/// A fork child publishes a thread table of its own once it creates a thread: `ps` of the child
/// shows its forking thread and the thread it made, both workers, on the kernel's masks.
#[test]
fn ps_sees_a_fork_childs_own_table() {
    let host = Sysfs::two_nodes();
    let mut child = clean(python())
        .arg(program("py_fork_ps.py"))
        .env("LD_PRELOAD", library())
        .env("TLLM_AFFINITY_SYSFS_ROOT", host.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let ids: Vec<i64> = line
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let (fork_pid, forking, made) = (ids[0], ids[1], ids[2]);
    let v = json_from(&["ps", &fork_pid.to_string(), "--json"]);
    drop(child.stdin.take());
    assert_eq!(v["table"], true, "{v}");
    for tid in [forking, made] {
        let row = row(&v, "threads", "tid", tid).clone();
        assert_eq!(row["role"], "worker", "{v}");
        assert_eq!(mask(row["mask"].as_str().unwrap()), host.gpu0_local());
    }
    assert!(child.wait().unwrap().success());
}

/// A process killed by a signal leaves its thread table behind; the next process that maps one
/// (here at its first thread) removes it, so tables never pile up in /dev/shm.
#[test]
fn a_killed_processs_thread_table_is_removed_by_the_next_one() {
    let dir = tllm_affinity_core::table::threadtable::directory(std::path::Path::new("/tmp"));
    let calls = Program::c("calls").build();
    let mut killed = clean(&calls)
        .args(["thread", "kill"])
        .env("LD_PRELOAD", library())
        .spawn()
        .unwrap();
    let killed_pid = killed.id();
    let status = killed.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // Only the killed process's own table counts: the directory is shared, and a dead table of
    // another user or another PID namespace is not the next process's to remove.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| pid_of(p) == killed_pid)
        .collect();
    assert_eq!(
        left.len(),
        1,
        "the killed process {killed_pid} left no table of its own in {}",
        dir.display()
    );
    let next = clean(&calls)
        .arg("thread")
        .env("LD_PRELOAD", library())
        .status()
        .unwrap();
    assert!(next.success());
    for path in left {
        assert!(!path.exists(), "{} is still there", path.display());
    }
}

fn pid_of(table: &std::path::Path) -> u32 {
    table
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("tllm-affinity."))
        .and_then(|n| n.strip_suffix(".threads"))
        .and_then(|n| n.rsplit_once('.'))
        .and_then(|(_, pid)| pid.parse().ok())
        .unwrap_or(0)
}

/// `run --simulate`'s help says what the code does: the simulated host is kept in the user's
/// cache directory and reused, and `run` execs the program (no temporary directory to remove,
/// no waiting parent).
#[test]
fn simulate_help_says_the_tree_is_cached_and_the_program_execed() {
    let run_help = tllm_affinity(&["run", "--help"]).output().unwrap();
    let run_help = stdout_of(&run_help)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    says(&run_help, &["kept in the user's cache directory", "reused"]);
    for stale in ["temporary directory", "removed when the program ends"] {
        assert!(!run_help.contains(stale), "run --help still says {stale:?}");
    }
    let top_help = tllm_affinity(&["--help"]).output().unwrap();
    let top_help = stdout_of(&top_help);
    assert!(
        !top_help.contains("waits with --simulate"),
        "tllm-affinity --help says run waits with --simulate, while it execs: {top_help}"
    );
}
