//! The `tllm_affinity` Python module (SPEC §7) in real Python processes with the real library
//! preloaded, on a simulated sysfs tree over this machine's CPUs: leases, `worker()`, roles,
//! reports, step pinning, the passive and not-preloaded paths, the TensorRT-LLM adapter, the
//! report written at exit (`TLLM_AFFINITY_REPORT`), and `pip install ./python`.

use crate::common;

use std::process::{Command, Output};

use common::*;
use serde_json::Value;

/// The program under the library on `host`'s tree, with `vars`.
fn preloaded_script(host: &Sysfs, script: &str, args: &[&str], vars: &[(&str, &str)]) -> Command {
    let mut cmd = clean(python());
    cmd.arg(program(script))
        .args(args)
        .env("LD_PRELOAD", library())
        .env("TLLM_AFFINITY_SYSFS_ROOT", host.path())
        .env("TLLM_AFFINITY_LOCK_DIR", host.path())
        .env("TLLM_AFFINITY_POLICY", "numa")
        .env("TLLM_AFFINITY_LOG", "info")
        .envs(vars.iter().copied());
    cmd
}

/// Runs to completion and parses the one JSON line the program prints.
fn json_of(cmd: &mut Command) -> (Value, Output) {
    let out = succeeded(cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    (value, out)
}

/// [`json_of`] `script` under the library on a two-node host of its own.
fn json_on_two_nodes(script: &str, args: &[&str], vars: &[(&str, &str)]) -> (Value, Output) {
    let host = Sysfs::two_nodes();
    json_of(&mut preloaded_script(&host, script, args, vars))
}

fn all_cpus() -> Vec<usize> {
    allowed_cpus().iter().collect()
}

#[test]
fn configure_worker_role_and_report_move_only_worker_threads() {
    let host = Sysfs::two_nodes();
    let (v, out) = json_of(&mut preloaded_script(&host, "py_api.py", &["api"], &[]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let local = &host.gpu0_local();
    let everything = allowed_cpus();

    assert_eq!(v["available"], true);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["main_role"], "host");

    let w = &v["worker"];
    assert!(w["lease"].as_i64().unwrap() > 0, "{w}");
    assert_eq!(w["role"], "worker");
    assert_eq!(
        mask_of(&w["mask"]),
        *local,
        "the worker is on device 0's CPUs"
    );
    assert_eq!(mask(w["status_mask"].as_str().unwrap()), *local);
    // A thread the worker starts is a worker, born on the worker mask.
    assert_eq!(w["child"]["role"], "worker");
    assert_eq!(mask_of(&w["child"]["mask"]), *local);
    // A second configure for the same device changes nothing; closing it is not the last release.
    assert!(w["again_lease"].as_i64().unwrap() > w["lease"].as_i64().unwrap());
    assert_eq!(mask_of(&w["mask_after_again"]), *local);
    assert_eq!(mask_of(&w["mask_after_again_release"]), *local);
    never_says(&stderr, &["constrained"]);
    // The host thread living across the lease is never touched.
    assert_eq!(w["host_role"], "host");
    assert_eq!(mask_of(&v["host_mask_before"]), everything);
    assert_eq!(mask_of(&w["host_mask_during"]), everything);
    assert_eq!(mask_of(&v["host_mask_after"]), everything);
    // Leaving worker() released: the mask is back; releasing again is harmless, by id it's ENOENT.
    assert_eq!(mask_of(&w["mask_after_release"]), everything);
    assert_eq!(w["released"], true);
    assert_eq!(w["release_by_id_errno"], libc::ENOENT);
    // report() lists the threads with their roles, masks as the kernel holds them.
    let report = &w["report"];
    assert_eq!(report["schema"], 1);
    assert_eq!(report["state"], "active");
    assert_eq!(report["worker_mask"], local.to_list());
    let threads = report["threads"].as_array().unwrap();
    let find = |tid: &Value| {
        threads
            .iter()
            .find(|t| t["tid"] == *tid)
            .unwrap_or_else(|| panic!("tid {tid} not in {report}"))
    };
    assert_eq!(find(&v["main_tid"])["role"], "host");
    assert_eq!(find(&v["host_tid"])["role"], "host");
    assert_eq!(find(&w["tid"])["role"], "worker");
    assert_eq!(find(&w["tid"])["placement"], "worker");
    assert_eq!(find(&w["tid"])["kernel_mask"], local.to_list());
    // Errors: unknown thread → None, unknown device → OSError(ENODEV), step core off → 0.
    assert_eq!(v["unknown_role"], Value::Null);
    assert_eq!(v["bad_device_errno"], libc::ENODEV);
    assert_eq!(v["step_off"], 0);
    assert_eq!(v["context_lease_open"], true);
    assert_eq!(v["context_lease_released"], true);
}

#[test]
fn pin_step_and_result_threads() {
    let cpus = all_cpus();
    assert!(cpus.len() >= 2, "this test needs two CPUs");
    let step_cpu = cpus[cpus.len() - 1].to_string();
    let (v, _) = json_on_two_nodes(
        "py_api.py",
        &["step"],
        &[("TLLM_AFFINITY_STEP_CORE", &step_cpu)],
    );
    // Every simulated core has one thread: one CPU each, on two different cores.
    assert_eq!(v["step"]["rc"], 1, "{v}");
    assert_eq!(mask_of(&v["step"]["mask"]), mask(&step_cpu));
    assert_eq!(v["result"]["rc"], 1, "{v}");
    let result = mask_of(&v["result"]["mask"]);
    assert_eq!(result.count(), 1);
    assert_ne!(result, mask(&step_cpu));
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus());
}

#[test]
fn a_passive_library_gives_an_inert_lease_and_a_warning() {
    let (v, out) = json_on_two_nodes(
        "py_api.py",
        &["passive"],
        &[("TLLM_AFFINITY_POLICY", "bogus")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    says(&stderr, &["TLLM_AFFINITY_POLICY='bogus' is not valid"]);
    assert_eq!(v["available"], true);
    assert_eq!(v["inert"], true);
    assert_eq!(v["id"], Value::Null);
    assert_eq!(v["categories"][0], "RuntimeWarning");
    assert!(
        v["warnings"][0].as_str().unwrap().contains("passive"),
        "{v}"
    );
    assert_eq!(v["role"], Value::Null);
    assert_eq!(v["state"], "passive");
    assert_eq!(mask_of(&v["mask"]), allowed_cpus());
}

#[test]
fn without_the_library_every_call_says_how_to_preload_it() {
    let mut cmd = clean(python());
    cmd.arg(program("py_api.py")).arg("unavailable");
    let (v, _) = json_of(&mut cmd);
    assert_eq!(v["available"], false);
    let raised = v["raised"].as_object().unwrap();
    assert_eq!(raised.len(), 7);
    for (call, error) in raised {
        assert_ne!(error, &Value::Null, "{call} did not raise");
        assert_eq!(error["runtime_error"], true, "{call}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains("tllm-affinity run"), "{call}: {message}");
        assert!(
            message.contains("LD_PRELOAD=") && message.contains("libtllm_affinity.so"),
            "{call}: {message}"
        );
    }
}

#[test]
fn the_trtllm_adapter_routes_configure_and_releases_at_shutdown() {
    let host = Sysfs::two_nodes();
    let (v, _) = json_of(&mut preloaded_script(
        &host,
        "py_adapter.py",
        &["preloaded"],
        &[],
    ));
    assert_eq!(v["same_on_reinstall"], true);
    assert_eq!(v["wrapped_name"], "configure_cpu_affinity");
    let w = &v["worker"];
    // Upstream's contract: the wrapper returns None and keeps the lease itself.
    assert_eq!(w["returned"], "None");
    assert_eq!(w["returned_again"], "None");
    let first = w["leases"].as_array().unwrap();
    assert_eq!(first.len(), 1, "{w}");
    assert!(first[0].as_i64().unwrap() > 0);
    let both = w["leases_again"].as_array().unwrap();
    assert_eq!(both.len(), 2, "{w}");
    assert!(both[1].as_i64().unwrap() > both[0].as_i64().unwrap());
    assert_eq!(w["role"], "worker");
    assert_eq!(mask_of(&w["mask"]), host.gpu0_local());
    // Only the worker thread moved; the original function never ran.
    assert_eq!(v["main_role"], "host");
    assert_eq!(mask_of(&v["main_mask"]), allowed_cpus());
    assert_eq!(v["original_calls"]["configure"], serde_json::json!([]));
    // The shutdown hook ran the original and released both leases: the mask is restored.
    assert_eq!(v["open_before_shutdown"], 2);
    assert_eq!(v["open_after_shutdown"], 0);
    assert_eq!(v["original_calls"]["shutdown"], 1);
    assert_eq!(mask_of(&w["mask_after_shutdown"]), allowed_cpus());
    assert_eq!(v["release_all_again"], 0);
    assert_eq!(v["restored"], true);
    assert_eq!(v["atexit_registered"], true);
    assert_eq!(v["missing_raises"], true);
}

#[test]
fn the_adapter_without_the_library_calls_the_original() {
    let mut cmd = clean(python());
    cmd.arg(program("py_adapter.py")).arg("unavailable");
    let (v, out) = json_of(&mut cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(v["available"], false);
    assert_eq!(v["results"], serde_json::json!(["original", "original"]));
    assert_eq!(v["original_calls"]["configure"], serde_json::json!([3, 4]));
    // Said once, not per call.
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("is not preloaded"))
        .collect();
    assert_eq!(said.len(), 1, "{stderr}");
}

#[test]
fn the_report_written_at_exit_lists_the_threads_with_roles() {
    let host = Sysfs::two_nodes();
    let path = host.path().join("report.json");
    let (v, _) = json_of(&mut preloaded_script(
        &host,
        "py_api.py",
        &["report-at-exit"],
        &[("TLLM_AFFINITY_REPORT", path.to_str().unwrap())],
    ));
    let text = std::fs::read_to_string(&path).expect("the report file");
    let report: Value = serde_json::from_str(&text).expect("the report parses");
    assert_eq!(report["schema"], 1);
    assert_eq!(report["state"], "active");
    assert_eq!(report["library"], env!("CARGO_PKG_VERSION"));
    assert_eq!(
        report["pid"].as_u64().unwrap() as i64,
        v["main"].as_i64().unwrap()
    );
    assert_eq!(report["constrained"], false);
    assert_eq!(report["worker_mask"], host.gpu0_local().to_list());
    assert_eq!(report["leases"][0]["id"], v["lease"]);
    assert_eq!(report["hosts"], 1);
    assert_eq!(report["workers"], 1);
    let threads = report["threads"].as_array().unwrap();
    let by_tid = |tid: &Value| threads.iter().find(|t| t["tid"] == *tid).unwrap();
    let main = by_tid(&v["main"]);
    assert_eq!(main["role"], "host");
    assert_eq!(main["placement"], "inherited");
    assert_eq!(main["kernel_mask"], allowed_cpus().to_list());
    let worker = by_tid(&v["worker"]);
    assert_eq!(worker["role"], "worker");
    assert_eq!(worker["placement"], "worker");
    assert_eq!(worker["mask"], host.gpu0_local().to_list());
    assert_eq!(worker["natural"], allowed_cpus().to_list());
    assert_eq!(mask_of(&v["worker_mask"]), host.gpu0_local());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o644);
}

#[test]
fn pip_installs_the_pure_python_package() {
    // From a copy, so that the build leaves nothing in the source tree.
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    let python_dir = repo().join("python");
    for file in [
        "pyproject.toml",
        "setup.py",
        "tllm_affinity.pth",
        "_tllm_affinity_hook.py",
        "tllm_affinity/__init__.py",
        "tllm_affinity/__main__.py",
        "tllm_affinity/_sitecustomize/sitecustomize.py",
        "tllm_affinity/adapters/__init__.py",
        "tllm_affinity/adapters/trtllm.py",
    ] {
        let to = src.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(python_dir.join(file), to).unwrap();
    }
    let target = work.path().join("site");
    let pip = |isolated: bool| {
        let mut cmd = clean(python());
        cmd.args(["-m", "pip", "install", "--quiet", "--no-deps"])
            .args(["--root-user-action=ignore", "--target"])
            .arg(&target)
            .arg(&src)
            .env_remove("PYTHONPATH");
        if !isolated {
            cmd.arg("--no-build-isolation");
        }
        cmd.output().expect("run pip")
    };
    // The installed setuptools when it can build on its own (it needs `wheel` before v70); else
    // pip's usual isolated build, which fetches setuptools from the package index.
    let mut out = pip(false);
    if !out.status.success() {
        out = pip(true);
    }
    assert!(
        out.status.success(),
        "pip install failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = succeeded(
        clean(python())
            .args([
                "-c",
                "import tllm_affinity, tllm_affinity.adapters.trtllm as t; \
                 print(tllm_affinity.__file__, tllm_affinity.available())",
            ])
            .env("PYTHONPATH", &target),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with(target.to_str().unwrap()) && stdout.trim_end().ends_with("False"),
        "{stdout}"
    );
    // The start-up hook lands at the top of site-packages, where Python runs `.pth` files.
    for file in [
        "tllm_affinity.pth",
        "_tllm_affinity_hook.py",
        "tllm_affinity/_sitecustomize/sitecustomize.py",
    ] {
        assert!(target.join(file).is_file(), "{file} not installed");
    }
}
