//! `tllm-affinity simulate DIR [--json]`: writes the simulated host `run --simulate` uses into
//! DIR and keeps it, so that `topo`, `plan`, `run` and a plain `LD_PRELOAD` can all read it
//! (`--sysfs-root DIR`, `TLLM_AFFINITY_SYSFS_ROOT=DIR`) on a machine without a GPU.
//! [`cached_tree`] is the copy `run --simulate` uses, kept in the user's cache directory.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::json;

use tllm_affinity_core::host::simulated;
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::sys;

#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Where to write the tree (created when missing; must be empty or hold an earlier tree).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &SimulateArgs) -> Result<(), String> {
    let dir = &args.dir;
    // An earlier tree is rewritten; anything else in a non-empty directory is not ours to touch.
    if let Ok(mut entries) = std::fs::read_dir(dir) {
        let foreign = entries.any(|e| e.is_ok_and(|e| e.file_name() != "sys"));
        if foreign {
            return Err(format!(
                "'{}' holds files other than a simulated sys/ tree: pick an empty directory",
                dir.display()
            ));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create '{}': {e}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("'{}': {e}", dir.display()))?;
    simulated_host()?
        .write(&dir)
        .map_err(|e| format!("cannot write the simulated host in {}: {e}", dir.display()))?;
    let topology = Topology::read(&SysfsRoot::new(&dir)).map_err(|e| e.to_string())?;
    let (nodes, gpus) = nodes_and_gpus(&topology);
    if args.json {
        let out = json!({
            "sysfs_root": dir.to_string_lossy(),
            "nodes": nodes,
            "gpus": gpus,
            "env": { "TLLM_AFFINITY_SYSFS_ROOT": dir.to_string_lossy() },
        });
        println!("{}", crate::json::pretty(&out)?);
    } else {
        println!(
            "# simulated host: NUMA {}; GPUs {}",
            nodes.join(", "),
            gpus.join(", ")
        );
        println!("TLLM_AFFINITY_SYSFS_ROOT={}", dir.display());
    }
    Ok(())
}

/// The simulated host's NUMA nodes (`node 1 [1]`) and GPUs (`0000:3b:00.0 on node 1`), as
/// `simulate` and `run --simulate` name them.
pub fn nodes_and_gpus(topology: &Topology) -> (Vec<String>, Vec<String>) {
    let nodes = topology
        .nodes
        .iter()
        .map(|n| format!("node {} [{}]", n.id, n.cpus))
        .collect();
    let gpus = topology
        .gpus
        .iter()
        .map(|g| match g.numa_node {
            Some(n) => format!("{} on node {n}", g.address),
            None => g.address.clone(),
        })
        .collect();
    (nodes, gpus)
}

/// The built-in simulated host over this process's CPUs.
fn simulated_host() -> Result<simulated::SimulatedHost, String> {
    Ok(simulated::two_node_one_gpu(&crate::process_mask()?))
}

/// The simulated host `run --simulate` points the program at: one tree per distinct host (named by
/// a fingerprint of what it holds, so a changed host or a newer version gets its own), written
/// once under `$XDG_CACHE_HOME/tllm-affinity/` (else `~/.cache/`, else a private directory in the
/// temp dir) and renamed into place whole, so concurrent runs share it and none reads half a tree.
/// Kept rather than removed after the program: `run` execs, so nothing would be left to remove it.
pub fn cached_tree() -> Result<PathBuf, String> {
    let host = simulated_host()?;
    let base = cache_dir()?;
    let tree = base.join(format!(
        "simulated-{:016x}",
        fingerprint(&format!("{host:?}"))
    ));
    if tree.join("sys").is_dir() {
        return Ok(tree);
    }
    let partial = base.join(format!(".simulated.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    let written = host
        .write(&partial)
        .and_then(|()| std::fs::rename(&partial, &tree));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&partial);
        // Another run renamed its copy into place first: that one serves.
        if !tree.join("sys").is_dir() {
            return Err(format!(
                "cannot write the simulated host in {}: {e}",
                tree.display()
            ));
        }
    }
    Ok(tree)
}

/// Where simulated trees are kept: the user's cache directory, else `tllm-affinity-<uid>` in the
/// temp dir, created private and refused when another user owns it or others may write it.
fn cache_dir() -> Result<PathBuf, String> {
    let home_cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| Path::new(v).is_absolute())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| Path::new(v).is_absolute())
                .map(|home| Path::new(&home).join(".cache"))
        });
    if let Some(dir) = home_cache.map(|c| c.join("tllm-affinity")) {
        if std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .is_ok()
        {
            return Ok(dir);
        }
    }
    let uid = sys::effective_uid();
    let dir = std::env::temp_dir().join(format!("tllm-affinity-{uid}"));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let meta = std::fs::symlink_metadata(&dir).map_err(|e| format!("'{}': {e}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o022 != 0 {
        return Err(format!(
            "'{}' is not a private directory of this user: remove it, or set XDG_CACHE_HOME",
            dir.display()
        ));
    }
    Ok(dir)
}

/// A name for a tree's contents. std's SipHash with its fixed keys: stable from run to run (a new
/// toolchain may name the same tree anew, which only writes it once more).
fn fingerprint(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

/// One line: the made-up nodes and GPUs, so nobody mistakes the demo for the real host.
pub fn describe(tree: &Path) -> String {
    let Ok(t) = Topology::read(&SysfsRoot::new(tree)) else {
        return format!("simulated host in {}", tree.display());
    };
    let (nodes, gpus) = nodes_and_gpus(&t);
    format!(
        "simulated host with NUMA {} and GPUs {} (sysfs tree {})",
        nodes.join(", "),
        gpus.join(", "),
        tree.display()
    )
}
