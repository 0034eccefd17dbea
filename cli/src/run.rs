//! `tllm-affinity run [options] -- CMD...`: runs a program with `libtllm_affinity.so` preloaded.
//!
//! The library is found with `TLLM_AFFINITY_LIB`, else beside this binary (`target/<profile>/` in
//! the build tree), else in `../lib/` of an installed layout. It is put first in `LD_PRELOAD`,
//! replacing any other copy of `libtllm_affinity.so` already listed there (two copies would both
//! interpose `pthread_create`). Each option becomes the library variable it names (see
//! docs/reference.md), checked with the library's own parser so that a typo fails here, not in
//! the child.
//!
//! `run` execs the program: the program's exit status and signals are the process's own. With
//! `--simulate` it first points `TLLM_AFFINITY_SYSFS_ROOT` at the built-in simulated host, kept in
//! the user's cache directory (`simulate::cached_tree`), so nothing is left to clean up after the
//! program and `run` need not outlive it.
//!
//! `--dry-run` prints what would be set and run instead (`--json` makes that JSON); without
//! `--dry-run`, `--json` is accepted and ignored, since the output is the program's own.

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Map, Value};

use super::Failure;
use tllm_affinity_core::handoff::pyhook;
use tllm_affinity_core::placement::settings::{parse_gpu, GpuChoice, Settings, GPU_EXPECTED};
use tllm_affinity_core::sys;

pub const LIBRARY_FILE: &str = "libtllm_affinity.so";

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Worker policy (TLLM_AFFINITY_POLICY): auto follows TLLM_NUMA_AWARE_WORKER_AFFINITY.
    #[arg(long, value_parser = ["auto", "numa", "clear", "keep"])]
    pub policy: Option<String>,
    /// Worker CPUs instead of the GPU-local set (TLLM_AFFINITY_CPUS), e.g. 0-15,32-47.
    #[arg(long, value_name = "CPULIST")]
    pub cpus: Option<String>,
    /// Soname globs whose threads are workers (TLLM_AFFINITY_WORKER_LIBS). A plain list replaces
    /// the default list (NCCL, UCX, MPI, libfabric); a leading + adds to it
    /// (+libmy_transport*.so*); "" disables.
    #[arg(long, value_name = "GLOBS", allow_hyphen_values = true)]
    pub worker_libs: Option<String>,
    /// The main thread's role (TLLM_AFFINITY_PROCESS_ROLE); worker configures at load.
    #[arg(long, value_parser = ["host", "worker"])]
    pub process_role: Option<String>,
    /// Step and result thread pinning (TLLM_AFFINITY_STEP_CORE): off, auto or a CPU number.
    #[arg(long, value_name = "off|auto|CPU")]
    pub step_core: Option<String>,
    /// Each GPU's workers on their own slice of the node (TLLM_AFFINITY_SLICE): off or gpu.
    #[arg(long, value_parser = ["off", "gpu"])]
    pub slice: Option<String>,
    /// Log level on stderr (TLLM_AFFINITY_LOG).
    #[arg(long, value_parser = ["off", "error", "warn", "info", "debug"])]
    pub log: Option<String>,
    /// Write the JSON report here at exit (TLLM_AFFINITY_REPORT).
    #[arg(long, value_name = "PATH")]
    pub report: Option<PathBuf>,
    /// The GPU of configure(-1) and of a worker process (TLLM_AFFINITY_GPU): index or PCI address.
    #[arg(long, value_name = "N|PCI")]
    pub gpu: Option<String>,
    /// Read sysfs under this directory (TLLM_AFFINITY_SYSFS_ROOT).
    #[arg(long, value_name = "DIR", conflicts_with = "simulate")]
    pub sysfs_root: Option<PathBuf>,
    /// Directory of the per-GPU step-core locks (TLLM_AFFINITY_LOCK_DIR).
    #[arg(long, value_name = "DIR")]
    pub lock_dir: Option<PathBuf>,
    /// Stop the program at load on a bad setting, with exit status 2 (TLLM_AFFINITY_STRICT=1).
    #[arg(long)]
    pub strict: bool,
    /// Run on a built-in simulated host (two NUMA nodes over this process's CPUs, two GPUs),
    /// kept in the user's cache directory ($XDG_CACHE_HOME/tllm-affinity, else
    /// ~/.cache/tllm-affinity, else a private directory in /tmp) and reused by the next run; the
    /// program is then execed as without it (a tree of your own: `tllm-affinity simulate DIR`,
    /// then --sysfs-root DIR).
    #[arg(long)]
    pub simulate: bool,
    /// Leave Python programs alone: no start-up hook (TLLM_AFFINITY_PYTHON_HOOKS=0), so an
    /// unmodified TensorRT-LLM server pins its threads as it would without tllm-affinity.
    #[arg(long)]
    pub no_python_hooks: bool,
    /// Turn the library off for this program (TLLM_AFFINITY_DISABLE=1): it stays loaded and
    /// inert, every call passes through, and Python servers pin their threads as they would
    /// without tllm-affinity.
    #[arg(long)]
    pub disable: bool,
    /// Print the environment and command instead of running it.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run, print JSON; otherwise ignored (the output is the program's own).
    #[arg(long)]
    pub json: bool,
    /// The program and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<OsString>,
}

pub fn run(args: &RunArgs) -> Result<u8, Failure> {
    let library = find_library()?;
    let mut env = vec![(
        "LD_PRELOAD".to_string(),
        preload_value(&library, std::env::var_os("LD_PRELOAD").as_deref())?,
    )];
    env.extend(
        settings_env(args)?
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
    );
    // Off, the hook would step aside anyway: the interpreter's path is left as it is.
    if !args.disable {
        env.extend(python_hook_env(args.no_python_hooks));
    }
    if let Some(line) = args.cpus.as_deref().and_then(cpus_outside_this_process) {
        eprintln!("tllm-affinity run: {line}");
    }
    if args.dry_run {
        print_dry_run(args, &library, &env);
        return Ok(0);
    }
    let mut command = Command::new(&args.command[0]);
    command.args(&args.command[1..]).envs(env.iter().cloned());
    if args.simulate {
        let tree = super::simulate::cached_tree().map_err(Failure::usage)?;
        eprintln!(
            "tllm-affinity run: --simulate: {}",
            super::simulate::describe(&tree)
        );
        command.env("TLLM_AFFINITY_SYSFS_ROOT", &tree);
    }
    let error = command.exec();
    Err(cannot_run(&args.command[0], &error))
}

/// The library to preload: `TLLM_AFFINITY_LIB`, else beside this binary (a build tree), else
/// `../lib/`, else in the `tllm_affinity` package a pip install put beside it (the wheel).
pub fn find_library() -> Result<PathBuf, Failure> {
    if let Some(value) = std::env::var_os("TLLM_AFFINITY_LIB").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&value);
        return match path.canonicalize() {
            Ok(abs) if abs.is_file() => Ok(abs),
            _ => Err(Failure::usage(format!(
                "TLLM_AFFINITY_LIB='{}' is not valid: expected the path of {LIBRARY_FILE}",
                path.display()
            ))),
        };
    }
    let exe = std::env::current_exe()
        .map_err(|e| Failure::usage(format!("cannot find this binary's path: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let mut candidates = vec![
        dir.join(LIBRARY_FILE),
        dir.join("..").join("lib").join(LIBRARY_FILE),
    ];
    candidates.extend(
        installed_packages(dir)
            .into_iter()
            .map(|package| package.join("_lib").join(LIBRARY_FILE)),
    );
    for candidate in &candidates {
        if let Ok(abs) = candidate.canonicalize() {
            if abs.is_file() {
                return Ok(abs);
            }
        }
    }
    Err(Failure::usage(format!(
        "{LIBRARY_FILE} not found beside {} (nor in ../lib, nor in the tllm_affinity package \
         of ../lib/python3.*/site-packages): install the wheel (scripts/wheel in a checkout, \
         then pip install target/wheels/tllm_affinity-*.whl), build it with `cargo build --release`, or set TLLM_AFFINITY_LIB=/abs/path/{LIBRARY_FILE}",
        exe.display()
    )))
}

/// The Python start-up hook's variables (docs/runtimes.md): `PYTHONPATH` led by the directory of
/// the package's `sitecustomize`, so that every interpreter the command starts, through any
/// launcher or wrapper, wraps TensorRT-LLM's `configure_cpu_affinity`; or, with
/// `--no-python-hooks`, `TLLM_AFFINITY_PYTHON_HOOKS=0`, which also quiets a pip-installed hook.
fn python_hook_env(off: bool) -> Vec<(String, OsString)> {
    if off {
        return vec![(PYTHON_HOOKS_VAR.to_string(), "0".into())];
    }
    if std::env::var_os(PYTHON_HOOKS_VAR).is_some_and(|v| v == "0") {
        return Vec::new();
    }
    let Some(hook_dir) = find_python_hook_dir() else {
        eprintln!(
            "tllm-affinity run: the Python package's start-up hook (tllm_affinity/{}) \
             is not beside this binary; Python servers run without it (`pip install ./python` from \
             the repository, in the server's environment, brings it)",
            pyhook::SITECUSTOMIZE_DIR
        );
        return Vec::new();
    };
    let existing = std::env::var_os("PYTHONPATH").unwrap_or_default();
    vec![(
        "PYTHONPATH".to_string(),
        pyhook::python_path_value(&hook_dir, &existing),
    )]
}

pub const PYTHON_HOOKS_VAR: &str = pyhook::SWITCH;

/// `tllm_affinity/_sitecustomize` of the Python package: in the build tree (`python/` beside
/// `target/<profile>/`), or in the site-packages of the environment this binary is installed in.
pub fn find_python_hook_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let mut packages = vec![dir
        .join("..")
        .join("..")
        .join("python")
        .join("tllm_affinity")];
    packages.extend(installed_packages(dir));
    packages
        .into_iter()
        .find_map(|package| pyhook::sitecustomize_in(package.parent()?))
        .and_then(|c| c.canonicalize().ok())
}

/// The `tllm_affinity` package directories a pip install puts beside a command installed in
/// `bin_dir`: the wheel installs the command in `<prefix>/bin` and the package in
/// `<prefix>/lib/python3.X/site-packages` (a venv, `--user`, `--prefix`; Debian's system Python
/// says `dist-packages`), the library and the start-up hook inside the package.
fn installed_packages(bin_dir: &Path) -> Vec<PathBuf> {
    let mut packages = Vec::new();
    let Ok(entries) = std::fs::read_dir(bin_dir.join("..").join("lib")) else {
        return packages;
    };
    let mut pythons: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    // A fixed order for a prefix holding several Pythons, each with the package.
    pythons.sort();
    for python in pythons {
        for site in ["site-packages", "dist-packages"] {
            packages.push(python.join(site).join("tllm_affinity"));
        }
    }
    packages
}

/// `LD_PRELOAD` with `library` first and no other copy of the library, the other entries kept in
/// their order. The loader splits the variable at colons and spaces, so the path may hold neither.
pub fn preload_value(library: &Path, existing: Option<&OsStr>) -> Result<OsString, Failure> {
    let lib_bytes = library.as_os_str().as_bytes();
    if lib_bytes.iter().any(|&b| b == b':' || b == b' ') {
        return Err(Failure::usage(format!(
            "the library path '{}' holds a ':' or a space, which LD_PRELOAD cannot carry",
            library.display()
        )));
    }
    let mut value = library.as_os_str().to_os_string();
    let entries = existing
        .map(|e| e.as_bytes())
        .unwrap_or_default()
        .split(|&b| b == b':' || b == b' ')
        .filter(|e| !e.is_empty())
        .map(OsStr::from_bytes);
    for entry in entries {
        let path = Path::new(entry);
        let same_file = path.canonicalize().is_ok_and(|p| p == library);
        let other_copy = path.file_name() == Some(OsStr::new(LIBRARY_FILE));
        if !same_file && !other_copy {
            value.push(":");
            value.push(entry);
        }
    }
    Ok(value)
}

/// The library variables the options name, each checked by the library's own parser.
fn settings_env(args: &RunArgs) -> Result<Vec<(&'static str, OsString)>, Failure> {
    // Absolute, so that a program that changes directory still finds them.
    let absolute = |path: &Option<PathBuf>| -> Result<Option<OsString>, Failure> {
        let Some(p) = path else { return Ok(None) };
        std::path::absolute(p)
            .map(|p| Some(p.into_os_string()))
            .map_err(|e| Failure::usage(format!("'{}': {e}", p.display())))
    };
    let text = |value: &Option<String>| value.clone().map(OsString::from);
    let mut env: Vec<(&'static str, OsString)> = Vec::new();
    let mut put = |name, value: Option<OsString>| {
        if let Some(v) = value {
            env.push((name, v));
        }
    };
    put("TLLM_AFFINITY_POLICY", text(&args.policy));
    put("TLLM_AFFINITY_CPUS", text(&args.cpus));
    put("TLLM_AFFINITY_WORKER_LIBS", text(&args.worker_libs));
    put("TLLM_AFFINITY_PROCESS_ROLE", text(&args.process_role));
    put("TLLM_AFFINITY_STEP_CORE", text(&args.step_core));
    put("TLLM_AFFINITY_SLICE", text(&args.slice));
    put("TLLM_AFFINITY_LOG", text(&args.log));
    put("TLLM_AFFINITY_REPORT", absolute(&args.report)?);
    put(
        "TLLM_AFFINITY_GPU",
        args.gpu.as_deref().map(gpu_value).transpose()?,
    );
    put("TLLM_AFFINITY_SYSFS_ROOT", absolute(&args.sysfs_root)?);
    put("TLLM_AFFINITY_LOCK_DIR", absolute(&args.lock_dir)?);
    put("TLLM_AFFINITY_STRICT", args.strict.then(|| "1".into()));
    put(
        tllm_affinity_core::placement::settings::DISABLE,
        args.disable.then(|| "1".into()),
    );
    let lookup = |name: &str| {
        env.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.to_string_lossy().into_owned())
    };
    let (_, errors) = Settings::from_lookup(lookup);
    if let Some(first) = errors.first() {
        return Err(Failure::usage(first.to_string()));
    }
    Ok(env)
}

/// A warning when `--cpus` names no CPU this process may run on: the library would pin nothing,
/// and the list is the user's, not "the GPU-local CPUs".
fn cpus_outside_this_process(list: &str) -> Option<String> {
    let wanted = tllm_affinity_core::mask::CpuMask::parse_list(list).ok()?;
    let allowed = sys::get_mask(0).ok()?;
    wanted.intersection(&allowed).is_empty().then(|| {
        format!(
            "--cpus {wanted} names no CPU this process may use (allowed: {allowed}); worker \
             threads will keep their masks"
        )
    })
}

/// `--gpu`: a CUDA device number, or a PCI address (normalised to the kernel's form), read by
/// the library's own parser.
fn gpu_value(text: &str) -> Result<OsString, Failure> {
    match parse_gpu(text) {
        Ok(Some(GpuChoice::Index(index))) => Ok(index.to_string().into()),
        Ok(Some(GpuChoice::Address(address))) => Ok(address.into()),
        Ok(None) | Err(_) => Err(Failure::usage(format!(
            "--gpu '{text}' is not valid: expected {GPU_EXPECTED}"
        ))),
    }
}

fn print_dry_run(args: &RunArgs, library: &Path, env: &[(String, OsString)]) {
    let lossy = |s: &OsStr| s.to_string_lossy().into_owned();
    if args.json {
        let mut vars: Map<String, Value> = env
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(lossy(v))))
            .collect();
        if args.simulate {
            vars.insert(
                "TLLM_AFFINITY_SYSFS_ROOT".to_string(),
                Value::String(SIMULATED_ROOT_PLACEHOLDER.to_string()),
            );
        }
        let out = json!({
            "library": lossy(library.as_os_str()),
            "env": vars,
            "simulate": args.simulate,
            "exec": true,
            "command": args.command.iter().map(|a| lossy(a)).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            crate::json::pretty(&out).unwrap_or_else(|_| "{}".into())
        );
        return;
    }
    let mut out = String::new();
    for (k, v) in env {
        let _ = writeln!(out, "{k}={}", shell_word(&lossy(v)));
    }
    if args.simulate {
        let _ = writeln!(out, "TLLM_AFFINITY_SYSFS_ROOT={SIMULATED_ROOT_PLACEHOLDER}");
    }
    let words: Vec<String> = args.command.iter().map(|a| shell_word(&lossy(a))).collect();
    let _ = writeln!(out, "exec: {}", words.join(" "));
    print!("{out}");
}

/// What `--dry-run` shows for the simulated tree, which is written (or found) only once the
/// program runs.
const SIMULATED_ROOT_PLACEHOLDER: &str =
    "<the simulated host, in the cache directory when the program runs>";

/// `word` quoted for a POSIX shell when it needs to be.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// What a shell would answer: 127 when the program does not exist, 126 when it cannot run.
fn cannot_run(program: &OsStr, error: &std::io::Error) -> Failure {
    let status = if error.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    };
    Failure {
        status,
        message: format!("cannot run '{}': {error}", program.to_string_lossy()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_goes_first_once_and_replaces_other_copies() {
        let lib = Path::new("/opt/tllm/libtllm_affinity.so");
        assert_eq!(preload_value(lib, None).unwrap(), lib.as_os_str());
        let v = preload_value(
            lib,
            Some(OsStr::new(
                "/a/libfoo.so /old/libtllm_affinity.so:/opt/tllm/libtllm_affinity.so::/b/libbar.so",
            )),
        )
        .unwrap();
        assert_eq!(
            v,
            OsStr::new("/opt/tllm/libtllm_affinity.so:/a/libfoo.so:/b/libbar.so")
        );
        assert!(preload_value(Path::new("/with space/libtllm_affinity.so"), None).is_err());
    }

    #[test]
    fn shell_words() {
        assert_eq!(shell_word("python3"), "python3");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }

    #[test]
    fn gpu_values() {
        assert_eq!(gpu_value("3").unwrap(), OsStr::new("3"));
        assert_eq!(gpu_value("3B:00.0").unwrap(), OsStr::new("0000:3b:00.0"));
        assert!(gpu_value("-1").is_err());
        assert!(gpu_value("gpu0").is_err());
    }
}
