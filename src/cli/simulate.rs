//! `tllm-affinity simulate DIR [--json]`: writes the simulated host `run --simulate` uses into
//! DIR and keeps it, so that `topo`, `plan`, `run` and a plain `LD_PRELOAD` can all read it
//! (`--sysfs-root DIR`, `TLLM_AFFINITY_SYSFS_ROOT=DIR`) on a machine without a GPU.

use std::path::PathBuf;

use serde_json::json;

use crate::simulated;
use crate::sys;
use crate::topology::{SysfsRoot, Topology};

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
    let allowed = sys::get_mask(0).map_err(|errno| {
        format!(
            "cannot read this process's CPU mask: {}",
            std::io::Error::from_raw_os_error(errno)
        )
    })?;
    simulated::two_node_one_gpu(&allowed)
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
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
        );
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
