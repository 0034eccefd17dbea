//! `tllm-affinity cdi [--output FILE] [--state-dir DIR]`: writes a Container Device Interface
//! spec that gives any glibc container the library, with no change to its image.
//!
//! The device `tllm-affinity.dev/preload=default` mounts, read-only:
//!
//! * the library `run` would preload, at `/opt/tllm-affinity/libtllm_affinity.so`;
//! * `<state dir>/ld.so.preload`, written here and naming that path, at `/etc/ld.so.preload`.
//!   glibc's loader preloads what that file lists into every program; musl's ignores the file,
//!   and a static binary has no loader, so neither is touched. `LD_PRELOAD` is not used: musl's
//!   loader honours it and every musl program would abort on the glibc library, and a CDI
//!   variable would replace the image's own `LD_PRELOAD` (jemalloc, tcmalloc);
//! * the Python start-up hook (`_tllm_affinity_hook.py` and the `tllm_affinity` package) at
//!   `/opt/tllm-affinity/python/`, which the library finds beside itself at load and puts in
//!   front of the image's own `PYTHONPATH` (`engine::pyhook`).
//!
//! The spec sets no variable: CDI variables win over `podman run -e` and a pod's env, and the
//! user's `TLLM_AFFINITY_*` and `TLLM_NUMA_AWARE_WORKER_AFFINITY` decide the policy.
//!
//! `cdiVersion` is 0.5.0: podman 4.3 accepts no later one, and later runtimes accept it.
//! The library is checked first: one that needs anything beyond glibc is refused (in an image
//! without that library every program would fail to start), and one that needs a glibc newer
//! than 2.17 is named with the oldest glibc an image may have.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::run::{find_library, find_python_hook_dir, LIBRARY_FILE};
use super::Failure;
use tllm_affinity_core::host::elf;

pub const KIND: &str = "tllm-affinity.dev/preload";
pub const DEVICE: &str = "default";
pub const CDI_VERSION: &str = "0.5.0";
/// Where the library and its Python hook sit inside a container.
pub const CONTAINER_DIR: &str = "/opt/tllm-affinity";
pub const PRELOAD_FILE: &str = "ld.so.preload";

#[derive(clap::Args, Debug)]
pub struct CdiArgs {
    /// Write the spec to this file (e.g. /etc/cdi/tllm-affinity.json or
    /// /var/run/cdi/tllm-affinity.json) instead of stdout.
    #[arg(long, short, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// The device's name: containers ask for tllm-affinity.dev/preload=NAME. Another name lets a
    /// second library (a canary build) sit beside the default one, each spec in its own file.
    #[arg(long, value_name = "NAME", default_value = DEVICE, value_parser = device_name)]
    pub name: String,
    /// Directory on the host for the ld.so.preload file the spec mounts.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/tllm-affinity")]
    pub state_dir: PathBuf,
    /// Leave the Python start-up hook out of the spec.
    #[arg(long)]
    pub no_python_hooks: bool,
    /// Errors as JSON (the spec is JSON either way).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &CdiArgs) -> Result<(), Failure> {
    let library = find_library()?;
    check_library(&library)?;
    let hook = if args.no_python_hooks {
        None
    } else {
        let found = python_hook_sources();
        if found.is_none() {
            eprintln!(
                "tllm-affinity cdi: the Python package's start-up hook is not beside this binary; \
                 the spec brings the library alone (Python servers run without the hook)"
            );
        }
        found
    };
    let state_dir = absolute(&args.state_dir)?;
    let preload = state_dir.join(PRELOAD_FILE);
    let container_library = format!("{CONTAINER_DIR}/{LIBRARY_FILE}");
    write_atomically(&preload, format!("{container_library}\n").as_bytes())?;
    let text = crate::json::pretty(&spec(&args.name, &library, &preload, hook.as_ref()))
        .map_err(Failure::usage)?;
    match &args.output {
        None => println!("{text}"),
        Some(path) => {
            write_atomically(&absolute(path)?, format!("{text}\n").as_bytes())?;
            eprintln!(
                "tllm-affinity cdi: wrote {} (device {KIND}={}; library {})",
                path.display(),
                args.name,
                library.display()
            );
        }
    }
    Ok(())
}

/// The host files of the Python hook: the package directory and the hook module beside it.
struct HookSources {
    package: PathBuf,
    module: PathBuf,
}

fn python_hook_sources() -> Option<HookSources> {
    // find_python_hook_dir names <python dir>/tllm_affinity/_sitecustomize.
    let package = find_python_hook_dir()?.parent()?.to_path_buf();
    let module = package.parent()?.join("_tllm_affinity_hook.py");
    module.is_file().then_some(HookSources { package, module })
}

/// The CDI spec: one device whose edits are read-only bind mounts, and no variable.
fn spec(name: &str, library: &Path, preload: &Path, hook: Option<&HookSources>) -> Value {
    let mount = |host: &Path, container: String| {
        json!({
            "hostPath": host.to_string_lossy(),
            "containerPath": container,
            "options": ["ro", "nosuid", "nodev", "bind"],
        })
    };
    let mut mounts = vec![
        mount(library, format!("{CONTAINER_DIR}/{LIBRARY_FILE}")),
        mount(preload, "/etc/ld.so.preload".to_string()),
    ];
    if let Some(hook) = hook {
        let python = format!(
            "{CONTAINER_DIR}/{}",
            tllm_affinity_core::handoff::pyhook::PYTHON_BESIDE_LIBRARY
        );
        mounts.push(mount(&hook.package, format!("{python}/tllm_affinity")));
        mounts.push(mount(
            &hook.module,
            format!("{python}/_tllm_affinity_hook.py"),
        ));
    }
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{
            "name": name,
            "containerEdits": { "mounts": mounts },
        }],
    })
}

/// A CDI device name: letters, digits, `_`, `-`, `.` and `:`, starting with a letter or digit.
fn device_name(text: &str) -> Result<String, String> {
    let mut chars = text.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c)) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "'{text}' is not a CDI device name: expected letters, digits, '_', '-', '.' or ':', \
             starting with a letter or digit"
        ))
    }
}

/// Refuses a library that needs more than glibc; names the oldest glibc it loads on.
fn check_library(library: &Path) -> Result<(), Failure> {
    let bytes = std::fs::read(library)
        .map_err(|e| Failure::usage(format!("cannot read {}: {e}", library.display())))?;
    let needs = elf::read_needs(&bytes)
        .map_err(|e| Failure::usage(format!("{}: {e}", library.display())))?;
    let beyond = needs.beyond_glibc();
    if !beyond.is_empty() {
        return Err(Failure::usage(format!(
            "{} needs {} beyond glibc: in an image without {} every program would fail to start; \
             use the wheel's library (scripts/wheel, then pip install \
             target/wheels/tllm_affinity-*.whl) or a build that links the unwinder statically \
             (cargo build --release does)",
            library.display(),
            beyond.join(", "),
            if beyond.len() == 1 { "it" } else { "them" }
        )));
    }
    if let Some(newest) = needs.newest_glibc().filter(|v| *v > vec![2, 17]) {
        let version: Vec<String> = newest.iter().map(u32::to_string).collect();
        eprintln!(
            "tllm-affinity cdi: {} needs glibc {} or newer: in an image with an older glibc every \
             program would fail to start; the wheel's library (scripts/wheel, then pip install \
             target/wheels/tllm_affinity-*.whl) needs 2.17",
            library.display(),
            version.join(".")
        );
    }
    Ok(())
}

fn absolute(path: &Path) -> Result<PathBuf, Failure> {
    std::path::absolute(path).map_err(|e| Failure::usage(format!("{}: {e}", path.display())))
}

/// Writes `bytes` to `path` (mode 0644) through a temporary file and a rename, so a runtime
/// scanning the CDI directory never reads half a spec.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), Failure> {
    let fail = |what: &str, e: std::io::Error| {
        Failure::usage(format!("cannot {what} {}: {e}", path.display()))
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail("create the directory of", e))?;
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // A dot name: runtimes read only *.json and *.yaml from a CDI directory.
    let partial = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&partial)?;
        file.write_all(bytes)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.sync_all()?;
        std::fs::rename(&partial, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(fail("write", e));
    }
    Ok(())
}
