//! Where the Python start-up hook (docs/runtimes.md) comes from, and how it reaches every
//! interpreter: `PYTHONPATH` led by the directory of the package's `sitecustomize`, the image's or
//! the user's own entries kept after it. `tllm-affinity run` sets it for the program it starts; a
//! library that brings its own hook (the layout `tllm-affinity cdi` mounts into a container) sets
//! it in each process at load, because a CDI spec can only *replace* a variable, and the image's
//! own `PYTHONPATH` must survive.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The variable that turns the hook off (`0`), read by the hook itself and by the library.
pub const SWITCH: &str = "TLLM_AFFINITY_PYTHON_HOOKS";
/// The package's directory holding the `sitecustomize` that runs the hook.
pub const SITECUSTOMIZE_DIR: &str = "_sitecustomize";
/// Beside a library that brings its own hook: the directory holding `_tllm_affinity_hook.py` and
/// the `tllm_affinity` package (`<dir of the library>/python/`).
pub const PYTHON_BESIDE_LIBRARY: &str = "python";

/// Whether the switch's value turns the hook off (`0`, spaces aside); anything else keeps it on.
pub fn switched_off(value: &OsStr) -> bool {
    value.as_bytes().trim_ascii() == b"0"
}

/// `tllm_affinity/_sitecustomize` inside `python_dir`, when its `sitecustomize.py` is there.
pub fn sitecustomize_in(python_dir: &Path) -> Option<PathBuf> {
    let dir = python_dir.join("tllm_affinity").join(SITECUSTOMIZE_DIR);
    dir.join("sitecustomize.py").is_file().then_some(dir)
}

/// `PYTHONPATH` with `hook_dir` first, once; the other entries kept in their order.
pub fn python_path_value(hook_dir: &Path, existing: &OsStr) -> OsString {
    let mut value = hook_dir.as_os_str().to_os_string();
    for entry in existing.as_bytes().split(|&b| b == b':') {
        if entry.is_empty() || Path::new(OsStr::from_bytes(entry)) == hook_dir {
            continue;
        }
        value.push(":");
        value.push(OsStr::from_bytes(entry));
    }
    value
}

/// The `PYTHONPATH` a process whose library file is `library` should have at load, or `None` to
/// leave the environment alone: the hook is off (`TLLM_AFFINITY_PYTHON_HOOKS=0`), the library has
/// no hook beside it (every layout but the container's), or the hook already leads the path.
pub fn python_path_at_load(
    library: &Path,
    existing: Option<&OsStr>,
    switch: Option<&OsStr>,
) -> Option<OsString> {
    if switch.is_some_and(switched_off) {
        return None;
    }
    let hook_dir = sitecustomize_in(&library.parent()?.join(PYTHON_BESIDE_LIBRARY))?;
    let existing = existing.unwrap_or_default();
    let value = python_path_value(&hook_dir, existing);
    (value.as_os_str() != existing).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_leads_python_path_once() {
        let hook = Path::new("/opt/t/tllm_affinity/_sitecustomize");
        assert_eq!(python_path_value(hook, OsStr::new("")), hook.as_os_str());
        assert_eq!(
            python_path_value(
                hook,
                OsStr::new("/a:/opt/t/tllm_affinity/_sitecustomize::/b")
            ),
            OsStr::new("/opt/t/tllm_affinity/_sitecustomize:/a:/b")
        );
    }

    #[test]
    fn a_library_with_its_hook_beside_it_leads_the_path_unless_switched_off() {
        let dir = tempfile::tempdir().unwrap();
        let library = dir.path().join("libtllm_affinity.so");
        assert_eq!(python_path_at_load(&library, None, None), None);
        let hook = dir.path().join("python/tllm_affinity/_sitecustomize");
        std::fs::create_dir_all(&hook).unwrap();
        std::fs::write(hook.join("sitecustomize.py"), "").unwrap();
        let theirs = OsStr::new("/app/lib");
        let value = python_path_at_load(&library, Some(theirs), None).unwrap();
        assert_eq!(
            value,
            OsString::from(format!("{}:/app/lib", hook.display()))
        );
        // Already in front (a child of a process that set it): nothing to change.
        assert_eq!(python_path_at_load(&library, Some(&value), None), None);
        assert_eq!(
            python_path_at_load(&library, Some(theirs), Some(OsStr::new("0"))),
            None
        );
    }
}
