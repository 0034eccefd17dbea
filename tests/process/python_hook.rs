//! The Python start-up hook (docs/runtimes.md, "No code change"): `tllm-affinity run` makes every
//! Python interpreter it starts wrap TensorRT-LLM's `configure_cpu_affinity` at import, through
//! wrappers and `multiprocessing`, chaining to the `sitecustomize` it shadows; it can be turned
//! off; and whatever goes wrong (a broken `sitecustomize`, an unimportable or renamed upstream, a
//! device the library cannot resolve) the program runs on as it would without us, with one line.
//!
//! The program is tests/programs/hook_probe.py over the small `tensorrt_llm` packages of
//! tests/programs/hook_cases; it never calls `tllm_affinity`. Simulated host: `Sysfs::two_nodes`.

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use serde_json::Value;

fn case(name: &str) -> PathBuf {
    programs_dir().join("hook_cases").join(name)
}

fn hook_dir() -> PathBuf {
    repo().join("python/tllm_affinity/_sitecustomize")
}

/// `tllm-affinity run --sysfs-root <host> [options] -- <python> hook_probe.py <args>`, with the
/// `tensorrt_llm` of `case` on PYTHONPATH.
fn under_run(host: &Sysfs, case_name: &str, options: &[&str], args: &[&str]) -> Command {
    let mut cmd = clean(cli());
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(host.path())
        .args(options)
        .arg("--")
        .arg(python())
        .arg(program("hook_probe.py"))
        .args(args)
        .env("PYTHONPATH", case(case_name));
    cmd
}

/// [`under_run`] of `hook_probe.py probe 0` over the upstream-shaped package.
fn upstream_probe(host: &Sysfs, options: &[&str]) -> Command {
    under_run(host, "upstream", options, &["probe", "0"])
}

/// The probe's JSON line and the program's stderr.
fn probe(cmd: &mut Command) -> (Value, String) {
    let out = succeeded(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (last_json_line(&out.stdout), stderr)
}

/// A user's `sitecustomize.py` holding `code`, in a directory of its own, and a PYTHONPATH of
/// that directory then the upstream case.
fn user_site(code: &str) -> (tempfile::TempDir, std::ffi::OsString) {
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("sitecustomize.py"), code).unwrap();
    let path = std::env::join_paths([site.path().to_path_buf(), case("upstream")]).unwrap();
    (site, path)
}

/// The library said nothing.
fn no_library_line(stderr: &str) {
    assert!(lines_with(stderr, "[tllm-affinity]").is_empty(), "{stderr}");
}

/// The one line of `stderr` that holds `needle` (there must be exactly one).
fn said_once<'a>(stderr: &'a str, needle: &str) -> &'a str {
    let said = lines_with(stderr, needle);
    assert_eq!(said.len(), 1, "{stderr}");
    said[0]
}

fn lines_with<'a>(stderr: &'a str, needle: &str) -> Vec<&'a str> {
    stderr.lines().filter(|l| l.contains(needle)).collect()
}

/// The adapter took the call: upstream's function never ran, the calling thread is on the
/// GPU-local set, the main thread kept its mask.
fn assert_engaged(v: &Value, host: &Sysfs, how: &str) {
    assert_eq!(v["wrapped"], true, "{how}: {v}");
    assert_eq!(v["wrapped_in_utils"], true, "{how}: {v}");
    assert_eq!(v["sweep_wrapped"], true, "{how}: {v}");
    assert_eq!(
        v["calls"],
        serde_json::json!([]),
        "{how}: upstream ran: {v}"
    );
    assert_eq!(v["thread"]["result"], "None", "{how}: {v}");
    assert_eq!(
        mask_of(&v["thread"]["mask"]),
        host.gpu0_local(),
        "{how}: {v}"
    );
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{how}: {v}");
    assert_eq!(v["adapter"]["state"], "engaged", "{how}: {v}");
}

/// Upstream's own function ran: it pinned every thread, the main thread included.
fn assert_upstream_ran(v: &Value, how: &str) {
    assert_eq!(v["wrapped"], false, "{how}: {v}");
    assert_eq!(v["calls"][0][0], "configure", "{how}: {v}");
    let top = allowed_cpus().iter().max().unwrap();
    assert_eq!(
        mask_of(&v["main_mask"]).to_list(),
        top.to_string(),
        "{how}: {v}"
    );
}

/// The report `--report` wrote at exit.
fn report_at(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the report")).unwrap()
}

#[test]
fn run_wraps_configure_in_an_unmodified_program() {
    let host = Sysfs::two_nodes();
    let report = host.path().join("report.json");
    let report_option = format!("--report={}", report.display());
    let (v, stderr) = probe(upstream_probe(&host, &[&report_option]).env("HOOK_PROBE_PS", cli()));
    assert_engaged(&v, &host, "run");
    // `ps` of the live process shows what engaged in one line, beside its memory per node.
    let ps = v["ps"].as_str().unwrap_or_default();
    println!("$ tllm-affinity ps (the probe, live)\n{ps}");
    let adapter_line = ps
        .lines()
        .find(|l| l.starts_with("adapter trtllm: engaged; tensorrt_llm "))
        .unwrap_or_else(|| panic!("no adapter line in ps:\n{ps}"));
    assert!(
        adapter_line.contains(" 1/"),
        "one lease opened: {adapter_line}"
    );
    says(ps, &["memory per node: node 0 "]);
    assert_eq!(report_at(&report)["adapters"]["trtllm"], "engaged");
    // What engaged, in one line: the version, the callers and their leases.
    let detail = report_at(&report)["adapter_details"]["trtllm"].clone();
    println!("adapter_details.trtllm: {detail}");
    assert!(
        detail
            .as_str()
            .is_some_and(|d| d.starts_with("tensorrt_llm ")),
        "{detail}"
    );
    assert!(
        v["sitecustomize"]
            .as_str()
            .unwrap()
            .starts_with(hook_dir().to_str().unwrap()),
        "{v}"
    );
    no_library_line(&stderr);
}

#[test]
fn no_python_hooks_and_the_variable_leave_upstream_alone() {
    let host = Sysfs::two_nodes();
    let (v, _) = probe(&mut upstream_probe(&host, &["--no-python-hooks"]));
    assert_upstream_ran(&v, "--no-python-hooks");
    let (v, _) = probe(upstream_probe(&host, &[]).env("TLLM_AFFINITY_PYTHON_HOOKS", "0"));
    assert_upstream_ran(&v, "TLLM_AFFINITY_PYTHON_HOOKS=0");
}

#[test]
fn a_malformed_switch_keeps_the_hook_on_with_one_line() {
    let host = Sysfs::two_nodes();
    let (v, stderr) = probe(upstream_probe(&host, &[]).env("TLLM_AFFINITY_PYTHON_HOOKS", "yes"));
    assert_engaged(&v, &host, "TLLM_AFFINITY_PYTHON_HOOKS=yes");
    let said = said_once(&stderr, "TLLM_AFFINITY_PYTHON_HOOKS='yes'");
    assert!(said.contains("expected 0 or 1"), "{stderr}");
}

#[test]
fn the_hook_reaches_interpreters_started_through_wrappers_and_spawn() {
    let host = Sysfs::two_nodes();
    let script = format!(
        "{} {} probe 0; true",
        python().display(),
        program("hook_probe.py").display()
    );
    let mut shell = clean(cli());
    shell
        .arg("run")
        .arg("--sysfs-root")
        .arg(host.path())
        .args(["--", "sh", "-c", &script])
        .env("PYTHONPATH", case("upstream"));
    let (v, _) = probe(&mut shell);
    assert_engaged(&v, &host, "sh -c");

    let (v, _) = probe(&mut under_run(&host, "upstream", &[], &["spawn", "0"]));
    assert_ne!(v["pid"], v["parent_pid"]);
    assert_engaged(&v, &host, "multiprocessing spawn child");
}

#[test]
fn the_hook_reaches_every_rank_of_mpirun() {
    require!(on_path("mpirun"), "`mpirun` on PATH");
    let host = Sysfs::two_nodes();
    let session = tempfile::tempdir().unwrap();
    let mut cmd = clean(cli());
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(host.path())
        .args(["--", "mpirun", "--allow-run-as-root", "--oversubscribe"])
        .args(["--bind-to", "none", "-np", "2", "--mca", "orte_tmpdir_base"])
        .arg(session.path())
        .arg(python())
        .arg(program("hook_probe.py"))
        .args(["probe", "0"])
        .env("PYTHONPATH", case("upstream"))
        .env("TMPDIR", session.path());
    let out = succeeded(&mut cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ranks: Vec<Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(ranks.len(), 2, "{stdout}");
    for v in &ranks {
        assert_engaged(v, &host, "mpirun rank");
    }
}

#[test]
fn the_hook_chains_to_the_users_sitecustomize() {
    let host = Sysfs::two_nodes();
    let (site, path) = user_site("import builtins\nbuiltins.USER_SITECUSTOMIZE_RAN = True\n");
    let (v, _) = probe(upstream_probe(&host, &[]).env("PYTHONPATH", path));
    assert_eq!(v["user_sitecustomize"], true, "{v}");
    assert_eq!(
        v["sitecustomize"],
        site.path().join("sitecustomize.py").to_str().unwrap(),
        "the user's module stands as `sitecustomize` afterwards: {v}"
    );
    assert_engaged(&v, &host, "with the user's sitecustomize");
}

#[test]
fn the_hook_chains_to_debians_own_sitecustomize() {
    // Debian's interpreter ships /usr/lib/python3.X/sitecustomize.py (the apport hook).
    let debian = PathBuf::from("/usr/bin/python3");
    let ships_one = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.path().join("sitecustomize.py").is_file());
    require!(
        debian.exists() && ships_one,
        "Debian's python3 with its sitecustomize.py",
    );
    let host = Sysfs::two_nodes();
    let mut cmd = clean(cli());
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(host.path())
        .arg("--")
        .arg(&debian)
        .arg(program("hook_probe.py"))
        .args(["probe", "0"])
        .env("PYTHONPATH", case("upstream"));
    let (v, _) = probe(&mut cmd);
    let chained = v["sitecustomize"].as_str().unwrap();
    assert!(
        chained.starts_with("/usr/lib/python3") && chained.ends_with("/sitecustomize.py"),
        "{v}"
    );
    assert_engaged(&v, &host, "Debian's python3");
}

#[test]
fn a_broken_user_sitecustomize_is_one_line_and_the_hook_still_works() {
    let host = Sysfs::two_nodes();
    let (_site, path) = user_site("raise RuntimeError('the site is misconfigured')\n");
    let (v, stderr) = probe(upstream_probe(&host, &[]).env("PYTHONPATH", path));
    assert_engaged(&v, &host, "broken sitecustomize");
    // site.py's own words, once, as without the hook.
    said_once(&stderr, "Error in sitecustomize");
    said_once(&stderr, "RuntimeError: the site is misconfigured");
    assert!(!stderr.contains("Traceback"), "{stderr}");
}

#[test]
fn an_unimportable_tensorrt_llm_fails_exactly_as_without_us() {
    let host = Sysfs::two_nodes();
    let (with, stderr) = probe(&mut under_run(&host, "unimportable", &[], &["probe", "0"]));
    let (without, _) = probe(&mut under_run(
        &host,
        "unimportable",
        &["--no-python-hooks"],
        &["probe", "0"],
    ));
    assert_eq!(
        with["import_error"],
        "tensorrt_llm bindings are not built for this Python"
    );
    assert_eq!(with["import_error"], without["import_error"]);
    no_library_line(&stderr);
}

#[test]
fn a_renamed_upstream_is_said_once_and_recorded() {
    let host = Sysfs::two_nodes();
    let report = host.path().join("report.json");
    let report_option = format!("--report={}", report.display());
    let (v, stderr) = probe(
        under_run(&host, "renamed", &[&report_option], &["probe", "0"]).env("HOOK_PROBE_PS", cli()),
    );
    assert_eq!(v["wrapped"], false, "{v}");
    assert_eq!(v["adapter"]["state"], "not-found", "{v}");
    // `ps` says the adapter is inactive and what that means.
    let ps = v["ps"].as_str().unwrap_or_default();
    assert!(
        ps.contains("adapter trtllm: not-found") && ps.contains("adapter inactive:"),
        "{ps}"
    );
    assert_eq!(report_at(&report)["adapters"]["trtllm"], "not-found");
    let said = said_once(&stderr, "found no configure_cpu_affinity");
    assert!(said.contains("did not engage"), "{stderr}");
}

/// A renamed upstream (no `configure_cpu_affinity` to wrap) whose renamed function still calls
/// upstream's all-thread sweep: the adapter is not engaged, yet the sweep touches no thread, so
/// the main thread keeps its mask.
#[test]
fn a_renamed_upstreams_sweep_touches_no_thread() {
    let host = Sysfs::two_nodes();
    let (v, _) = probe(&mut under_run(&host, "renamed", &[], &["renamed", "0"]));
    assert_eq!(v["sweep_wrapped"], true, "{v}");
    assert_eq!(
        v["calls"],
        serde_json::json!([["configure", 0]]),
        "the renamed function ran, upstream's sweep did not: {v}"
    );
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{v}");
}

/// A `configure_cpu_affinity` that takes no device id (another release's) is still the
/// library's: wrapped, the calling thread placed for the device its caller passed, the main
/// thread untouched, upstream's own function never run, one warning naming the signature.
#[test]
fn another_signature_is_placed_by_the_library_with_one_line() {
    let host = Sysfs::two_nodes();
    let (v, stderr) = probe(&mut under_run(
        &host,
        "other_signature",
        &[],
        &["probe", "0"],
    ));
    assert_eq!(v["wrapped"], true, "{v}");
    assert_eq!(v["adapter"]["state"], "engaged", "{v}");
    let said = said_once(&stderr, "does not take a device id");
    assert!(said.contains("configure_cpu_affinity()"), "{said}");
    assert_eq!(v["calls"], serde_json::json!([]), "upstream ran: {v}");
    assert_eq!(v["thread"]["result"], "None", "{v}");
    assert!(v["thread"].get("raised").is_none(), "{v}");
    assert_eq!(mask_of(&v["thread"]["mask"]), host.gpu0_local(), "{v}");
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{v}");
}

#[test]
fn a_device_the_library_cannot_resolve_pins_nothing_and_raises_nothing() {
    let host = Sysfs::two_nodes();
    let (v, stderr) = probe(&mut under_run(&host, "upstream", &[], &["probe", "7"]));
    assert_eq!(v["wrapped"], true, "{v}");
    assert_eq!(v["thread"]["result"], "None", "{v}");
    assert!(v["thread"].get("raised").is_none(), "{v}");
    assert_eq!(mask_of(&v["thread"]["mask"]), allowed_cpus(), "{v}");
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{v}");
    assert_eq!(v["calls"], serde_json::json!([]), "{v}");
    let said = lines_starting(&stderr, "[tllm-affinity]");
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(said[0].contains("no mask changed"), "{stderr}");
}

#[test]
fn a_module_that_bound_the_name_before_the_hook_gets_the_wrapper() {
    let host = Sysfs::two_nodes();
    let path = std::env::join_paths([case("upstream"), repo().join("python")]).unwrap();
    let (v, _) = probe(
        under_run(&host, "upstream", &[], &["late", "0"])
            .env("TLLM_AFFINITY_PYTHON_HOOKS", "0")
            .env("PYTHONPATH", path),
    );
    assert_engaged(&v, &host, "hook installed after the import");
}

#[test]
fn without_the_library_the_hook_changes_nothing() {
    let path = std::env::join_paths([hook_dir(), case("upstream")]).unwrap();
    let mut cmd = clean(python());
    cmd.arg(program("hook_probe.py"))
        .args(["probe", "0"])
        .env("PYTHONPATH", path);
    let (v, stderr) = probe(&mut cmd);
    assert_upstream_ran(&v, "no library");
    assert!(v["adapter"].is_null(), "the adapter was imported: {v}");
    no_library_line(&stderr);
}

/// A call site with another parameter list (`BaseWorker._get_comm_ranks_device_id(self, rank)`)
/// and a `run_diffusion_worker` that is a generator function: both are still the adapter's (no
/// parameter list is needed, and the entry wrapper is a generator too); each call is placed by
/// the library on its own thread, upstream's own function and its sweep never run, the main
/// thread is untouched, and the generator's lease ends when it is exhausted.
#[test]
fn call_sites_of_another_shape_are_still_placed_by_the_library() {
    let host = Sysfs::two_nodes();
    let (v, stderr) = probe(&mut under_run(&host, "bad_sites", &[], &["sites", "0"]));
    let sites = &v["adapter"]["sites"];
    assert_eq!(sites["base_worker"]["state"], "found", "{v}");
    assert_eq!(sites["visual_gen"]["state"], "found", "{v}");
    assert_eq!(sites["base_worker"]["opened"], 1, "{v}");
    assert_eq!(sites["visual_gen"]["opened"], 1, "{v}");
    assert_eq!(sites["visual_gen"]["closed"], 1, "at its end: {v}");
    assert_eq!(v["adapter"]["version"], "0.0.bad-sites", "{v}");
    assert_eq!(v["entry_wrapped"], true, "{v}");
    assert_eq!(v["calls"], serde_json::json!([]), "upstream ran: {v}");
    for site in ["base_worker", "visual_gen"] {
        assert!(v[site].get("raised").is_none(), "{site}: {v}");
    }
    assert_eq!(mask_of(&v["base_worker"]["mask"]), host.gpu0_local(), "{v}");
    let serving: Value = serde_json::from_str(v["visual_gen"]["result"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {v}"));
    assert_eq!(
        mask_of(&serving),
        host.gpu0_local(),
        "the generator served on the GPU-local set: {v}"
    );
    // Its lease closed when it was exhausted (`closed` above); the masks come back at the last
    // release, and base_worker's lease is still open.
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{v}");
    assert!(
        lines_with(&stderr, "runs as without tllm-affinity").is_empty(),
        "{stderr}"
    );
}

/// The start-up hook watches exactly the adapter's modules: utils and each call site's.
#[test]
fn the_hook_watches_every_call_sites_module() {
    let out = Command::new(python())
        .args([
            "-c",
            "import _tllm_affinity_hook as h, tllm_affinity.adapters.trtllm as t; \
             print(h.UPSTREAM_MODULES == t.WATCHED_MODULES)",
        ])
        .env("PYTHONPATH", repo().join("python"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "True",
        "{out:?}"
    );
}

/// The line the library gives, once, for an interpreter that started without the hook.
const NO_HOOK_LINE: &str = "did not run the tllm-affinity start-up hook";

/// `tllm-affinity run --sysfs-root <host> --report <report> -- <interpreter> <flags...> <args...>`.
fn run_interpreter(
    host: &Sysfs,
    report: &std::path::Path,
    interpreter: &std::path::Path,
    args: &[&std::ffi::OsStr],
) -> Command {
    let mut cmd = clean(cli());
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(host.path())
        .arg(format!("--report={}", report.display()))
        .arg("--")
        .arg(interpreter)
        .args(args);
    cmd
}

/// `python -S` imports no `site`, so neither `run`'s `sitecustomize` nor an installed package's
/// `.pth` runs: upstream's own function runs with its all-thread pin, and the library, which
/// cannot stop that, says so once in its log and in the report.
#[test]
fn python_dash_s_cannot_run_the_hook_and_the_library_says_so_once() {
    let host = Sysfs::two_nodes();
    let report = host.path().join("report.json");
    let mut cmd = run_interpreter(
        &host,
        &report,
        &python(),
        &[
            "-S".as_ref(),
            program("hook_probe.py").as_os_str(),
            "probe".as_ref(),
            "0".as_ref(),
        ],
    );
    let (v, stderr) = probe(cmd.env("PYTHONPATH", case("upstream")));
    assert_upstream_ran(&v, "python -S");
    let said = said_once(&stderr, NO_HOOK_LINE);
    assert!(said.contains("-S"), "{said}");
    assert_eq!(report_at(&report)["adapters"]["python"], "no-hook");
}

/// `python -E` ignores `PYTHONPATH`: in an environment without the package installed nothing
/// brings the hook. The library says so once, when it matters: the program set another thread's
/// mask (as an all-thread pin does), so the line comes at the next thread's birth.
#[test]
fn python_dash_e_without_the_package_installed_is_said_once_at_an_all_thread_pin() {
    let host = Sysfs::two_nodes();
    let bare = tempfile::tempdir().unwrap();
    let venv = new_venv(bare.path(), &["--without-pip"]);
    let report = host.path().join("report.json");
    let code = [
        "import os, sys, threading",
        "go = threading.Event()",
        "t = threading.Thread(target=go.wait); t.start()",
        "sys.stderr.write('BEFORE\\n'); sys.stderr.flush()",
        "os.sched_setaffinity(t.native_id, os.sched_getaffinity(0))",
        "u = threading.Thread(target=lambda: None); u.start(); u.join()",
        "sys.stderr.write('AFTER\\n'); go.set(); t.join()",
    ]
    .join("\n");
    let mut cmd = run_interpreter(
        &host,
        &report,
        &venv.join("bin/python"),
        &["-E".as_ref(), "-c".as_ref(), code.as_str().as_ref()],
    );
    let out = succeeded(&mut cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    said_once(&stderr, NO_HOOK_LINE);
    let at = stderr.find(NO_HOOK_LINE).unwrap();
    assert!(
        stderr.find("BEFORE").unwrap() < at && at < stderr.find("AFTER").unwrap(),
        "said at the next thread after the pin:\n{stderr}"
    );
    assert_eq!(report_at(&report)["adapters"]["python"], "no-hook");
}

/// Where the hook runs, the library hears it, says nothing, and the report says `hook`; where it
/// is switched off, the library says nothing either.
#[test]
fn an_interpreter_that_ran_the_hook_is_not_said() {
    let host = Sysfs::two_nodes();
    let report = host.path().join("report.json");
    let report_option = format!("--report={}", report.display());
    let (_, stderr) = probe(&mut upstream_probe(&host, &[&report_option]));
    assert!(lines_with(&stderr, NO_HOOK_LINE).is_empty(), "{stderr}");
    assert_eq!(report_at(&report)["adapters"]["python"], "hook");
    let (_, stderr) = probe(&mut upstream_probe(&host, &["--no-python-hooks"]));
    assert!(lines_with(&stderr, NO_HOOK_LINE).is_empty(), "{stderr}");
}

/// Upstream's function and sweep held under an alias, in a list, a dict, a `functools.partial` and
/// a default argument, and through `from tensorrt_llm.llmapi import utils as u`: every one reaches
/// the adapter, whether the hook ran at start-up (the module was patched before anyone could hold
/// the originals) or the adapter arrived after they were taken (the original function objects are
/// redirected to their wrappers): upstream's function and sweep never run, each calling thread is
/// placed, the main thread keeps its mask.
#[test]
fn references_held_under_aliases_and_in_containers_reach_the_adapter() {
    let host = Sysfs::two_nodes();
    // The probe installs the hook itself when it started without it.
    let path = std::env::join_paths([case("upstream"), repo().join("python")]).unwrap();
    for (how, switch) in [
        ("hook at start-up", "1"),
        ("adapter after the references", "0"),
    ] {
        let (v, _) = probe(
            under_run(&host, "upstream", &[], &["stored", "0"])
                .env("TLLM_AFFINITY_PYTHON_HOOKS", switch)
                .env("PYTHONPATH", &path),
        );
        assert_eq!(v["adapter"]["state"], "engaged", "{how}: {v}");
        assert_eq!(
            v["calls"],
            serde_json::json!([]),
            "{how}: upstream ran: {v}"
        );
        let threads = v["threads"].as_object().unwrap();
        assert_eq!(threads.len(), 6, "{v}");
        for (shape, seen) in threads {
            assert_eq!(seen["result"], "None", "{how}, {shape}: {v}");
            assert_eq!(
                mask_of(&seen["mask"]),
                host.gpu0_local(),
                "{how}, {shape}: {v}"
            );
        }
        assert_eq!(mask_of(&v["main_mask"]), allowed_cpus(), "{how}: {v}");
    }
}
